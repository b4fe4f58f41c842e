// copy_words copies n 32-bit words from src to dst, where either may be
// the stage's pinned host memory, which the device addresses directly
// (unified addressing): the batch description's upload and the status and
// sampled tokens read back are kernels on the step's stream rather than
// copies, so that the stream does not hand over to a copy engine and back
// around every step (NOTES.md, phase 11). Both pointers 16-byte aligned.
// Grid: any. Block: any.
struct alignas(16) words4 {
    unsigned x, y, z, w;
};

extern "C" __global__ void copy_words(const int* __restrict__ src, int* __restrict__ dst, int n) {
    const int nt = gridDim.x * blockDim.x, i0 = blockIdx.x * blockDim.x + threadIdx.x;
    // Volatile loads (.cv): host memory the host rewrites between steps is
    // never served from a cache.
    words4* d4 = (words4*)dst;
    for (int i = i0; i < n / 4; i += nt) {
        words4 v;
        asm volatile("ld.global.cv.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(src + 4 * i));
        d4[i] = v;
    }
    for (int i = n / 4 * 4 + i0; i < n; i += nt) {
        unsigned v;
        asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(v) : "l"(src + i));
        dst[i] = (int)v;
    }
}
