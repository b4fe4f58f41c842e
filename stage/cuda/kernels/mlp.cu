// silu_mul computes the SwiGLU activation from the fused gate|up projection:
// out[t][i] = silu(gu[t][i]) * gu[t][inter + i], in fp32, rounded once.
// Grid: (ceil(inter / blockDim.x), tokens).
extern "C" __global__ void silu_mul(const bf16* gu, bf16* out, int inter) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) {
        return;
    }
    size_t t = blockIdx.y;
    float g = bf2f(gu[t * 2 * inter + i]);
    float u = bf2f(gu[t * 2 * inter + inter + i]);
    out[t * inter + i] = f2bf(g / (1.f + expf(-g)) * u);
}
