// attention computes causal grouped-query attention for one (token, head)
// per block. Token t at position pos[t] attends to its sequence's keys at
// positions 0..pos[t] in the paged KV cache: position j sits in cache row
// tab[j / bs] * bs + j % bs, where tab = tables + table_off[t] is the
// sequence's block table. Scores and the softmax are fp32, with an online
// (running max) softmax over tiles of blockDim.x keys; q is pre-scaled by
// `scale`. The output is rounded to bf16, its rounding remainder at row
// t + lo (put_split).
// Grid: (tokens, heads). Block: 128 threads; head_dim <= 256.
#define ATT_THREADS 128
extern "C" __global__ void attention(const bf16* q, const bf16* kcache, const bf16* vcache,
                                     bf16* out, int lo, const int* tables, const int* table_off,
                                     const int* pos, int bs, int nh, int nkv, int hd, float scale) {
    __shared__ float qs[256];
    __shared__ float ps[ATT_THREADS];
    __shared__ int rows[ATT_THREADS];
    __shared__ float sh[32];
    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int kvh = h / (nh / nkv);
    int n = pos[t] + 1;
    const int* tab = tables + table_off[t];
    int kvdim = nkv * hd;
    const bf16* qrow = q + ((size_t)t * nh + h) * hd;
    for (int d = tid; d < hd; d += ATT_THREADS) {
        qs[d] = bf2f(qrow[d]) * scale;
    }
    __syncthreads();
    float m = NEG_INF, l = 0.f, acc0 = 0.f, acc1 = 0.f;
    for (int j0 = 0; j0 < n; j0 += ATT_THREADS) {
        int j = j0 + tid;
        float s = NEG_INF;
        if (j < n) {
            int row = tab[j / bs] * bs + j % bs;
            rows[tid] = row;
            const bf16* k = kcache + (size_t)row * kvdim + kvh * hd;
            float a = 0.f;
            for (int d = 0; d < hd; d++) {
                a += qs[d] * bf2f(k[d]);
            }
            s = a;
        }
        float mnew = fmaxf(m, block_max(s, sh));
        float p = j < n ? expf(s - mnew) : 0.f;
        ps[tid] = p;
        float corr = expf(m - mnew);
        l = l * corr + block_sum(p, sh);
        acc0 *= corr;
        acc1 *= corr;
        m = mnew;
        int cnt = min(ATT_THREADS, n - j0);
        for (int jj = 0; jj < cnt; jj++) {
            float pj = ps[jj];
            const bf16* v = vcache + (size_t)rows[jj] * kvdim + kvh * hd;
            if (tid < hd) {
                acc0 += pj * bf2f(v[tid]);
            }
            if (tid + ATT_THREADS < hd) {
                acc1 += pj * bf2f(v[tid + ATT_THREADS]);
            }
        }
        __syncthreads();
    }
    bf16* o = out + ((size_t)t * nh + h) * hd;
    size_t olo = (size_t)lo * nh * hd;
    float inv = 1.f / l;
    if (tid < hd) {
        put_split(o, tid, olo, acc0 * inv);
    }
    if (tid + ATT_THREADS < hd) {
        put_split(o, tid + ATT_THREADS, olo, acc1 * inv);
    }
}
