// gemvs_nt<NT>: the cuBLAS path's products of decode steps of 2-32 tokens
// but gate|up (q|k|v, o, down: gemvs.go says which), as dependent launches.
// cuBLAS's products of these few rows are bound by their own latency, not
// their bytes (NOTES.md, phase 12), and cannot start before the kernel
// ahead of them ends; these load their weights before griddepcontrol.wait.
//
// y_s = x · Wᵀ over split s of k, for the bf16 rows x of t tokens (with lo,
// each token's rounding remainder lo rows on: the pair is summed here) and
// W [n x k], into fp32 plane s of y: y + s * t * n, row-major [t x n]. The
// consumer adds the planes up (rmsnorm's and attention_gqa_rope's planes
// parameters: at most MAX_PLANES), so no kernel sums the splits. Grid
// (n / 128, k / kb); block GEMVS_THREADS: warp w takes weight rows
// 16 w..16 w + 15 of the block's 128 over the split's kb (a multiple of
// 256) through its weight ring (gemv.cu: wring_*), as mma A fragments (16
// bytes of rows g and g + 8 a lane and 32-k chunk: k permuted within the
// chunk, the same way for x), its first WRING_STAGES - 1 stages started
// before the wait. The block stages its split of x in shared memory by
// cp.async, NT * 8 rows (the tokens' values from row 0, with lo their
// remainders from row NT * 4; rows between zero) of kb, swizzled
// (gemv.cu: stage_cols), and every warp reads its B fragments there, all
// of it in before the multiplies start (staged in two parts as gemvg does,
// the 1B shape's batch-32 products took 5.35 us a run against 5.20). The
// host keeps a one-wave grid to a block a multiprocessor
// (gemvsLaunchSmem). Dynamic shared memory: gemvsSmem(NT, kb),
// the staged rows, then the warps' rings.
#define GEMVS_THREADS 256

template <int NT>
__device__ __forceinline__ void gemvs_body(const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ y,
                                           int n, int k, int t, int lo, int kb) {
    extern __shared__ unsigned gemvs_sm[];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, g = lane >> 2, c = lane & 3;
    const int n0 = blockIdx.x * 128 + wid * 16, k0 = blockIdx.y * kb, stride = kb, nst = kb / WRING_KS;
    const unsigned sbase = smem_addr(gemvs_sm);
    const unsigned ring = sbase + (unsigned)(NT * 8 * stride * 2 + wid * WRING_BYTES);
    // Rows n0 .. n0 + 15 of W from the split's first k.
    const bf16* r0 = w + (size_t)n0 * k + k0;
    const bf16* r1 = r0 + (size_t)8 * k;
    TL_BEGIN
    wring_prime(ring, r0, r1, k, nst, lane);
    TL_WAIT
    const int sync = stage_rows<NT, GEMVS_THREADS, false>(sbase, x, k, k0, kb, stride, t, lo);
    TL_MARK
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[nt][i] = 0.f;
    // B fragments of row g of n-tile nt: its 16 bytes at the lane's k.
    wring_mma<NT>(acc, ring, r0, r1, k, nst, sbase + (unsigned)((g * stride + 8 * c) * 2), stride, lane, sync);
    // acc[nt]: staged rows 2c, 2c + 1 of n-tile nt, features n0 + g and
    // n0 + g + 8; with lo, n-tile nt + NT / 2 holds the same tokens'
    // remainders.
    float* yp = y + (size_t)blockIdx.y * t * n;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = nt * 8 + 2 * c + (i & 1), f = n0 + g + (i >> 1) * 8;
            if (r < t && (!lo || nt < NT / 2)) {
                yp[(size_t)r * n + f] = lo ? acc[nt][i] + acc[nt + NT / 2][i] : acc[nt][i];
            }
        }
    TL_END(TL_GEMVS)
}

#define GEMVS_ENTRY(name, nt)                                                                               \
    extern "C" __global__ void __launch_bounds__(GEMVS_THREADS, 1)                                          \
        name(const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ y, int n, \
                     int k, int t, int lo, int kb) {                                                        \
        gemvs_body<nt>(w, x, y, n, k, t, lo, kb);                                                           \
    }

GEMVS_ENTRY(gemvs_nt1, 1)
GEMVS_ENTRY(gemvs_nt2, 2)
GEMVS_ENTRY(gemvs_nt4, 4)
