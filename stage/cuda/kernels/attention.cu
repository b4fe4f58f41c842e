// attention computes causal grouped-query attention over the paged KV cache,
// split along the sequence (flash-decoding). Token t at position pos[t]
// attends to its sequence's keys at positions 0..pos[t]; position j sits in
// cache row tab[j / bs] * bs + j % bs, where tab = tables + table_off[t] is
// the sequence's block table.
//
// One block per (token, kv head, group of up to ATT_RMAX of its query heads,
// split): the block reads each key and value row of its part of the
// sequence once for all of its query heads. The n = pos[t] + 1 positions are
// cut into `splits` parts of ceil(n / splits); each block runs an fp32
// online softmax over its part in tiles of ATT_TILE keys (scores: hd/8 lanes
// per key, 16-byte loads; values: 16-byte loads, the block's threads
// splitting keys). With one split the block writes the output; with more,
// each writes its unnormalised partial (running max, sum, weighted values)
// to part / part_ml, and the last block of the (token, kv head, group) to
// finish (counted in counters, which it resets to 0) combines them in split
// order, so the result does not depend on timing.
//
// q is fp32 [tokens][nh][hd]; scale multiplies it. The output goes to out
// (fp32, [tokens][nh][hd]) when not null, and to out_bf (bf16) when not
// null, with its rounding remainder lo rows on (put_split).
// Grid: (tokens, nkv * groups, splits), groups = ceil((nh / nkv) / ATT_RMAX).
// Block: ATT_THREADS. hd: a multiple of 8, at most 256.
#define ATT_THREADS 128
#define ATT_TILE 64
#define ATT_RMAX 8

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention(const float* q, const bf16* kcache, const bf16* vcache, float* out, bf16* out_bf,
              int lo, const int* tables, const int* table_off, const int* pos, int bs, int nh,
              int nkv, int hd, float scale, int splits, float* part, float* part_ml,
              int* counters) {
    __shared__ float qs[ATT_RMAX * 256];
    __shared__ float sc[ATT_RMAX][ATT_TILE];
    __shared__ int rows[ATT_TILE];
    __shared__ float m_s[ATT_RMAX], l_s[ATT_RMAX], corr_s[ATT_RMAX];
    __shared__ float red[ATT_THREADS * ATT_RMAX * 8];
    __shared__ int last;
    pdl_start();
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int t = blockIdx.x, sp = blockIdx.z;
    const int R = nh / nkv;
    const int groups = (R + ATT_RMAX - 1) / ATT_RMAX;
    const int kh = blockIdx.y / groups;
    const int r0 = (blockIdx.y % groups) * ATT_RMAX;
    const int nr = min(ATT_RMAX, R - r0);
    const int h0 = kh * R + r0;  // first query head of the block
    const int n = pos[t] + 1;
    const int chunk = (n + splits - 1) / splits;
    const int jb = min(n, sp * chunk), je = min(n, jb + chunk);
    const int* tab = tables + table_off[t];
    const int kvdim = nkv * hd;
    const int G = hd >> 3;  // 16-byte chunks per row
    int gp = 1;             // lanes per key: G rounded up to a power of two
    while (gp < G) {
        gp <<= 1;
    }

    for (int e = tid; e < nr * hd; e += ATT_THREADS) {
        qs[e] = ldcg(q + ((size_t)t * nh + h0) * hd + e) * scale;
    }
    if (tid < ATT_RMAX) {
        m_s[tid] = NEG_INF;
        l_s[tid] = 0.f;
    }
    __syncthreads();

    // Scores: lane c of a group of gp handles elements 8c..8c+7 of its key.
    const int c = lane & (gp - 1);
    const int kslot = lane / gp;
    const int kpw = 32 / gp;  // keys per warp per pass
    float qr[ATT_RMAX][8];
#pragma unroll
    for (int r = 0; r < ATT_RMAX; r++)
#pragma unroll
        for (int i = 0; i < 8; i++) qr[r][i] = r < nr && c < G ? qs[r * hd + 8 * c + i] : 0.f;
    // Values: thread (kg, dc) handles chunk dc of the keys kg, kg + kgn, ...
    const int dc = tid % G, kg = tid / G, kgn = ATT_THREADS / G;
    float acc[ATT_RMAX][8];
#pragma unroll
    for (int r = 0; r < ATT_RMAX; r++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[r][i] = 0.f;

    for (int j0 = jb; j0 < je; j0 += ATT_TILE) {
        int len = min(ATT_TILE, je - j0);
        for (int p0 = 0; p0 < len; p0 += 4 * kpw) {
            int jl = p0 + wid * kpw + kslot;
            bool ok = jl < len && c < G;
            float d[ATT_RMAX];
#pragma unroll
            for (int r = 0; r < ATT_RMAX; r++) d[r] = 0.f;
            int row = 0;
            if (jl < len) {
                int j = j0 + jl;
                row = tab[j / bs] * bs + j % bs;
            }
            if (ok) {
                unsigned kw[4];
                ldcg_u4(kcache + (size_t)row * kvdim + kh * hd + 8 * c, kw);
                float kv[8];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    kv[2 * i] = __uint_as_float(kw[i] << 16);
                    kv[2 * i + 1] = __uint_as_float(kw[i] & 0xffff0000u);
                }
#pragma unroll
                for (int r = 0; r < ATT_RMAX; r++)
#pragma unroll
                    for (int i = 0; i < 8; i++) d[r] += qr[r][i] * kv[i];
            }
            for (int o = gp >> 1; o > 0; o >>= 1) {
#pragma unroll
                for (int r = 0; r < ATT_RMAX; r++) d[r] += __shfl_xor_sync(0xffffffffu, d[r], o);
            }
            if (c == 0 && jl < len) {
#pragma unroll
                for (int r = 0; r < ATT_RMAX; r++) sc[r][jl] = d[r];
                rows[jl] = row;
            }
        }
        __syncthreads();
        // Online softmax over the tile, one warp per query head.
        for (int r = wid; r < nr; r += ATT_THREADS / 32) {
            float s0 = lane < len ? sc[r][lane] : NEG_INF;
            float s1 = lane + 32 < len ? sc[r][lane + 32] : NEG_INF;
            float mold = m_s[r];
            float mnew = fmaxf(mold, warp_max(fmaxf(s0, s1)));
            float p0 = lane < len ? expf(s0 - mnew) : 0.f;
            float p1 = lane + 32 < len ? expf(s1 - mnew) : 0.f;
            if (lane < len) {
                sc[r][lane] = p0;
            }
            if (lane + 32 < len) {
                sc[r][lane + 32] = p1;
            }
            float sum = warp_sum(p0 + p1);
            if (lane == 0) {
                float corr = expf(mold - mnew);
                corr_s[r] = corr;
                l_s[r] = l_s[r] * corr + sum;
                m_s[r] = mnew;
            }
        }
        __syncthreads();
        if (kg < kgn) {
#pragma unroll
            for (int r = 0; r < ATT_RMAX; r++) {
                float corr = r < nr ? corr_s[r] : 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[r][i] *= corr;
            }
            for (int jl = kg; jl < len; jl += kgn) {
                unsigned vw[4];
                ldcg_u4(vcache + (size_t)rows[jl] * kvdim + kh * hd + 8 * dc, vw);
                float vv[8];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    vv[2 * i] = __uint_as_float(vw[i] << 16);
                    vv[2 * i + 1] = __uint_as_float(vw[i] & 0xffff0000u);
                }
#pragma unroll
                for (int r = 0; r < ATT_RMAX; r++) {
                    float p = r < nr ? sc[r][jl] : 0.f;
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[r][i] += p * vv[i];
                }
            }
        }
        __syncthreads();
    }

    // Sum the key groups: red[kg][r][d].
    if (kg < kgn) {
#pragma unroll
        for (int r = 0; r < ATT_RMAX; r++)
#pragma unroll
            for (int i = 0; i < 8; i++) red[(kg * ATT_RMAX + r) * hd + 8 * dc + i] = acc[r][i];
    }
    __syncthreads();
    const size_t olo = (size_t)lo * nh * hd;
    if (splits == 1) {
        for (int e = tid; e < nr * hd; e += ATT_THREADS) {
            int r = e / hd, d = e % hd;
            float v = 0.f;
            for (int g2 = 0; g2 < kgn; g2++) v += red[(g2 * ATT_RMAX + r) * hd + d];
            v /= l_s[r];
            size_t o = ((size_t)t * nh + h0 + r) * hd + d;
            if (out) {
                out[o] = v;
            }
            if (out_bf) {
                put_split(out_bf, o, olo, v);
            }
        }
        return;
    }
    const size_t unit = (size_t)t * gridDim.y + blockIdx.y;  // (token, kv head, group)
    float* pp = part + (unit * splits + sp) * ATT_RMAX * hd;
    float* pm = part_ml + (unit * splits + sp) * ATT_RMAX * 2;
    for (int e = tid; e < nr * hd; e += ATT_THREADS) {
        int r = e / hd, d = e % hd;
        float v = 0.f;
        for (int g2 = 0; g2 < kgn; g2++) v += red[(g2 * ATT_RMAX + r) * hd + d];
        pp[e] = v;
    }
    if (tid < nr) {
        pm[2 * tid] = m_s[tid];
        pm[2 * tid + 1] = l_s[tid];
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        last = atomicAdd(&counters[unit], 1) == splits - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    const float* p0 = part + unit * splits * ATT_RMAX * hd;
    const float* m0 = part_ml + unit * splits * ATT_RMAX * 2;
    for (int e = tid; e < nr * hd; e += ATT_THREADS) {
        int r = e / hd, d = e % hd;
        float M = NEG_INF;
        for (int s2 = 0; s2 < splits; s2++) M = fmaxf(M, ldcg(m0 + (s2 * ATT_RMAX + r) * 2));
        float L = 0.f, O = 0.f;
        for (int s2 = 0; s2 < splits; s2++) {
            float f = expf(ldcg(m0 + (s2 * ATT_RMAX + r) * 2) - M);
            L += ldcg(m0 + (s2 * ATT_RMAX + r) * 2 + 1) * f;
            O += ldcg(p0 + (size_t)s2 * ATT_RMAX * hd + e) * f;
        }
        float v = O / L;
        size_t o = ((size_t)t * nh + h0 + r) * hd + d;
        if (out) {
            out[o] = v;
        }
        if (out_bf) {
            put_split(out_bf, o, olo, v);
        }
    }
    if (tid == 0) {
        counters[unit] = 0;
    }
}
