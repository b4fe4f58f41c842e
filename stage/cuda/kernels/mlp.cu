// silu_mul computes the SwiGLU activation from the fused gate|up projection
// (fp32, as the GEMM wrote it, in two halves lo rows apart; lo 0: one):
// out[t][i] = silu(gu[t][i]) * gu[t][inter + i], rounded to bf16, its
// rounding remainder at row t + lo (put_split).
// Grid: (ceil(inter / blockDim.x), tokens).
extern "C" __global__ void silu_mul(const float* gu, bf16* out, int lo, int inter) {
    pdl_start();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) {
        return;
    }
    size_t t = blockIdx.y;
    const float* row = gu + t * 2 * inter;
    const float* row2 = gu + (t + lo) * 2 * inter;
    float g = row[i], u = row[inter + i];
    if (lo) {
        g += row2[i];
        u += row2[inter + i];
    }
    put_split(out, t * inter + i, (size_t)lo * inter, g / (1.f + expf(-g)) * u);
}
