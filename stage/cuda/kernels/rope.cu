// rope_qkv takes one token's fused q|k|v projection row (fp32, as the GEMM
// wrote it, in two halves: rows t and t + lo; lo 0: one), adds the bias (Qwen2; bias
// may be null), rotates q and k in the Hugging Face rotate_half layout
// (element i pairs with i + head_dim/2) by the angle pos * inv_freq[i],
// writes q to q_out (fp32) and k, v to the KV cache (bf16) at row cache_row[t]. The cache of one layer is [rows][kv_heads][head_dim]; the
// row index is the only thing that ties a token to its place in the cache.
// Thread e of a token's (heads + kv_heads) * head_dim / 2 takes head
// e / (head_dim / 2), rotary pair e % (head_dim / 2).
// Grid: (tokens, ceil((heads + kv_heads) * head_dim / 2 / blockDim.x)).
extern "C" __global__ void rope_qkv(const float* qkv, int lo, const bf16* bias,
                                    const float* inv_freq, const int* pos, const int* cache_row,
                                    float* q_out, bf16* kcache, bf16* vcache, int nh, int nkv,
                                    int hd) {
    pdl_start();
    int half = hd >> 1;
    int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= (nh + nkv) * half) {
        return;
    }
    int t = blockIdx.x, h = e / half, i = e % half;
    size_t width = (size_t)(nh + 2 * nkv) * hd;
    const float* row = qkv + t * width;
    const size_t ps = lo * width;
    const int planes = lo ? 2 : 1;
    int off = h * hd;
    float y1 = qkv_in<2>(row, ps, planes, bias, off + i), y2 = qkv_in<2>(row, ps, planes, bias, off + i + half);
    rope_rotate(y1, y2, pos[t], inv_freq[i]);
    if (h < nh) {
        float* q = q_out + ((size_t)t * nh + h) * hd;
        q[i] = y1;
        q[i + half] = y2;
        return;
    }
    int kh = h - nh;
    size_t dst = ((size_t)cache_row[t] * nkv + kh) * hd;
    kcache[dst + i] = f2bf(y1);
    kcache[dst + i + half] = f2bf(y2);
    int voff = (nh + nkv) * hd + kh * hd;
    float v1 = qkv_in<2>(row, ps, planes, bias, voff + i), v2 = qkv_in<2>(row, ps, planes, bias, voff + i + half);
    vcache[dst + i] = f2bf(v1);
    vcache[dst + i + half] = f2bf(v2);
}
