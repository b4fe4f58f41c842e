// rmsnorm adds the residual update and normalises, in one pass over a row:
//   x = res_in[src] + delta[src]        (delta may be null)
//   res_out[src] = bf16(x)              (res_out may be null, or alias res_in)
//   out[r] = bf16(bf16(x) * rsqrt(mean(bf16(x)^2) + eps) * w)   (skipped when w is null)
// where src = rowmap ? rowmap[r] : r, so the last stage can normalise only
// the rows it needs logits for. Statistics are accumulated in fp32.
// Grid: (rows). Block: a multiple of 32.
extern "C" __global__ void rmsnorm(const bf16* res_in, const bf16* delta, bf16* res_out,
                                   const bf16* w, bf16* out, const int* rowmap, int hidden,
                                   float eps) {
    __shared__ float sh[32];
    int r = blockIdx.x;
    size_t src = (size_t)(rowmap ? rowmap[r] : r) * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float x = bf2f(res_in[src + i]);
        if (delta) {
            x += bf2f(delta[src + i]);
        }
        bf16 xr = f2bf(x);
        if (res_out) {
            res_out[src + i] = xr;
        }
        float xf = bf2f(xr);
        ss += xf * xf;
    }
    if (!w) {
        return;
    }
    float inv = rsqrtf(block_sum(ss, sh) / (float)hidden + eps);
    bf16* o = out + (size_t)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float xf;
        if (res_out) {
            xf = bf2f(res_out[src + i]);
        } else {
            xf = bf2f(res_in[src + i]);
            if (delta) {
                xf += bf2f(delta[src + i]);
            }
            xf = bf2f(f2bf(xf));
        }
        o[i] = f2bf(xf * inv * bf2f(w[i]));
    }
}
