// silu_mul computes the SwiGLU activation from the fused gate|up projection
// (fp32, as the GEMM wrote it, in two halves lo rows apart; lo 0: one):
// out[t][i] = silu(gu[t][i]) * gu[t][inter + i], rounded to bf16, its
// rounding remainder at row t + lo (put_split). Each thread takes vec
// consecutive elements (4, with 16-byte loads, when inter is a multiple of
// 4; else 1). Grid: (ceil(inter / vec / blockDim.x), tokens).
__device__ __forceinline__ void ld_f32(const float* p, float* v, int vec) {
    if (vec == 4) {
        asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                     : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                     : "l"(p));
    } else {
        v[0] = ldcg(p);
    }
}

extern "C" __global__ void silu_mul(const float* gu, bf16* out, int lo, int inter, int vec) {
    TL_BEGIN
    pdl_start();
    TL_WAIT
    TL_MARK
    int i = (blockIdx.x * blockDim.x + threadIdx.x) * vec;
    if (i >= inter) {
        return;
    }
    size_t t = blockIdx.y;
    const float* row = gu + t * 2 * inter;
    const float* row2 = gu + (t + lo) * 2 * inter;
    float g[4], u[4];
    ld_f32(row + i, g, vec);
    ld_f32(row + inter + i, u, vec);
    if (lo) {
        float g2[4], u2[4];
        ld_f32(row2 + i, g2, vec);
        ld_f32(row2 + inter + i, u2, vec);
        for (int e = 0; e < vec; e++) {
            g[e] += g2[e];
            u[e] += u2[e];
        }
    }
    for (int e = 0; e < vec; e++) {
        put_split(out, t * inter + i + e, (size_t)lo * inter, g[e] / (1.f + expf(-g[e])) * u[e]);
    }
    // Thread 0 of every block has work (the grid covers inter), so it records.
    TL_END_NOW(TL_SILU)
}
