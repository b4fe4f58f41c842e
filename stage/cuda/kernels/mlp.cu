// silu_mul computes the SwiGLU activation from the fused gate|up projection
// (fp32, as the GEMM wrote it): out[t][i] = silu(gu[t][i]) * gu[t][inter + i],
// rounded once to bf16.
// Grid: (ceil(inter / blockDim.x), tokens).
extern "C" __global__ void silu_mul(const float* gu, bf16* out, int inter) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) {
        return;
    }
    size_t t = blockIdx.y;
    float g = gu[t * 2 * inter + i];
    float u = gu[t * 2 * inter + inter + i];
    out[t * inter + i] = f2bf(g / (1.f + expf(-g)) * u);
}
