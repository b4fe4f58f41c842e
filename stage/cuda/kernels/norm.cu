// rmsnorm normalises rows of the fp32 residual stream into bf16 GEMM inputs.
// The pending output y of the layer's last GEMM (null: none), in two halves
// lo rows apart, is first added to the residual:
//   x = resid[src] + (y[src] + y[src + lo])
//   out[r] = bf16(x * rsqrt(mean(x^2) + eps) * w)
// with src = rowmap ? rowmap[r] : r. Without rowmap the sum is written back
// to resid; with one (the last stage normalising only the rows it needs
// logits for, a row possibly more than once) resid is only read. When outlo
// is not 0, the rounding remainder of each output goes to row r + outlo
// (put_split). All arithmetic is fp32. Grid: (rows). Block: a multiple of 32.
extern "C" __global__ void rmsnorm(float* resid, const float* y, int lo, const bf16* w, bf16* out,
                                   int outlo, const int* rowmap, int hidden, float eps) {
    __shared__ float sh[32];
    int r = blockIdx.x;
    size_t src = rowmap ? rowmap[r] : r;
    float* row = resid + src * hidden;
    const float* y1 = y ? y + src * hidden : 0;
    const float* y2 = y ? y + (src + lo) * hidden : 0;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = row[i];
        if (y1) {
            v += y1[i] + y2[i];
            if (!rowmap) {
                row[i] = v;
            }
        }
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, sh) / (float)hidden + eps);
    size_t olo = (size_t)outlo * hidden;
    bf16* o = out + (size_t)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = row[i];
        if (y1 && rowmap) {
            v += y1[i] + y2[i];
        }
        put_split(o, i, olo, v * inv * bf2f(w[i]));
    }
}

// residual_add adds the pending GEMM output y (two halves lo rows apart)
// into the residual stream, as the next rmsnorm would: resid[t] += y[t] +
// y[t + lo]. It ends a stage that hands its residual stream on.
// Grid: (ceil(hidden / blockDim.x), rows).
extern "C" __global__ void residual_add(float* resid, const float* y, int lo, int hidden) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hidden) {
        return;
    }
    size_t t = blockIdx.y;
    resid[t * hidden + i] += y[t * hidden + i] + y[(t + lo) * hidden + i];
}
