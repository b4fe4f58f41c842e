// rmsnorm normalises rows of the fp32 residual stream into bf16 GEMM inputs:
//   out[r] = bf16(x[src] * rsqrt(mean(x[src]^2) + eps) * w)
// with src = rowmap ? rowmap[r] : r, so the last stage normalises only the
// rows it needs logits for. All arithmetic is fp32; the output is rounded
// once. Grid: (rows). Block: a multiple of 32.
extern "C" __global__ void rmsnorm(const float* x, const bf16* w, bf16* out, const int* rowmap,
                                   int hidden, float eps) {
    __shared__ float sh[32];
    int r = blockIdx.x;
    const float* row = x + (size_t)(rowmap ? rowmap[r] : r) * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = row[i];
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, sh) / (float)hidden + eps);
    bf16* o = out + (size_t)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        o[i] = f2bf(row[i] * inv * bf2f(w[i]));
    }
}
