// attention computes causal grouped-query attention over the paged KV cache,
// split along the sequence (flash-decoding). Token t at position pos[t]
// attends to its sequence's keys at positions 0..pos[t]; position j sits in
// cache row tab[j / bs] * bs + j % bs, where tab = tables + table_off[t] is
// the sequence's block table.
//
// One block per (token, kv head, group of up to ATT_RMAX of its query heads,
// split): the block reads each key and value row of its part of the
// sequence once for all of its query heads. The n = pos[t] + 1 positions are
// cut into parts of max(ceil(n / splits), min_chunk) keys, so a short
// sequence uses fewer parts (blocks past the last part return at once).
// Within a block every group of hd/8 lanes (rounded up to a power of two)
// takes one key at a time, each lane 8 elements of it (16-byte loads of the
// key and value rows), and keeps its own fp32 online softmax (running
// maximum, sum and weighted values) over the keys it takes; the groups of a
// warp, then the warps, then the parts are merged in a fixed order, so the
// result does not depend on timing. With one part the block writes the
// output; with more, each writes its unnormalised partial to part /
// part_ml, and the last block of the (token, kv head, group) to finish
// (counted in counters, which it resets to 0) merges them in part order.
//
// q is fp32 [tokens][nh][hd]; scale multiplies it. The output goes to out
// (fp32, [tokens][nh][hd]) when not null, and to out_bf (bf16) when not
// null, with its rounding remainder lo rows on (put_split).
// attention_rN takes groups of up to N query heads (N = 1, 2, 4, 8; the
// launch picks the smallest N at least nh / nkv, or 8).
// With rows set (a step with whole prefill tiles, which
// attention_prefill_d* takes beside this kernel), block x takes row
// rows[2x], whose sequence's first position in the step is rows[2x + 1]
// (the host's prefillLists); else block x takes row x.
// Grid: (tokens or rows listed, nkv * groups, splits), groups = ceil((nh / nkv) / N).
// Block: W * 32 threads (attention_rN_wW: W warps, 4 or 16); dynamic
// shared memory W * N * (hd + 2) floats (the warps' partial softmax
// states). hd: a multiple of 8, at most 256.
#define ATT_RMAX 8
#define ATT_U 2  // keys a lane has in flight (4 was slower: NOTES.md)

// att_merge folds the running softmax state (m2, l2, a2) into (m, l, a).
__device__ __forceinline__ void att_merge(float& m, float& l, float* a, float m2, float l2,
                                          const float* a2) {
    float mm = fmaxf(m, m2);
    float f1 = m == NEG_INF ? 0.f : expf(m - mm);
    float f2 = m2 == NEG_INF ? 0.f : expf(m2 - mm);
    m = mm;
    l = l * f1 + l2 * f2;
#pragma unroll
    for (int i = 0; i < 8; i++) a[i] = a[i] * f1 + a2[i] * f2;
}

// att_put stores element i of the attention output v: fp32 to out and the
// bf16 pair to out_bf (put_split, the remainder olo on), whichever is set.
__device__ __forceinline__ void att_put(float* out, bf16* out_bf, size_t i, size_t olo, float v) {
    if (out) {
        out[i] = v;
    }
    if (out_bf) {
        put_split(out_bf, i, olo, v);
    }
}

// att_merge_parts ends a block of a unit (token, kv head, group) whose
// sequence was cut into parts > 1, once the block has written its part's
// partial: the last block of the unit to finish (counted in counters,
// which it resets to 0) merges the parts' partials in part order into the
// output. Every thread of the block calls it; last is a shared flag.
__device__ void att_merge_parts(const float* part, const float* part_ml, int* counters, size_t unit, int splits,
                                int parts, int nr, int hd, int t, int nh, int h0, float* out, bf16* out_bf,
                                size_t olo, int* last) {
    const int tid = threadIdx.x;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        *last = atomicAdd(&counters[unit], 1) == parts - 1;
    }
    __syncthreads();
    if (!*last) {
        return;
    }
    __threadfence();
    const float* p0 = part + unit * splits * ATT_RMAX * hd;
    const float* m0 = part_ml + unit * splits * ATT_RMAX * 2;
    for (int e = tid; e < nr * hd; e += blockDim.x) {
        int r = e / hd, d = e % hd;
        float M = NEG_INF;
        for (int s2 = 0; s2 < parts; s2++) M = fmaxf(M, ldcg(m0 + (s2 * ATT_RMAX + r) * 2));
        float L = 0.f, O = 0.f;
        for (int s2 = 0; s2 < parts; s2++) {
            float mv = ldcg(m0 + (s2 * ATT_RMAX + r) * 2);
            float f = mv == NEG_INF ? 0.f : expf(mv - M);
            L += ldcg(m0 + (s2 * ATT_RMAX + r) * 2 + 1) * f;
            O += ldcg(p0 + (size_t)s2 * ATT_RMAX * hd + e) * f;
        }
        att_put(out, out_bf, ((size_t)t * nh + h0 + r) * hd + d, olo, O / L);
    }
    if (tid == 0) {
        counters[unit] = 0;
    }
}

// att_warps_out ends a block of W warps whose softmax states are in shared
// memory (rows 0..nr-1, row stride rs: maxima wm and sums wl [W][rs],
// weighted values wv [W][rs][hd]): it merges them in warp order into the
// output, element e of the block's rows at o0 + e (one part), or into this
// part's partial (pp, pm; then the caller's att_merge_parts).
template <int W>
__device__ __forceinline__ void att_warps_out(const float* wm, const float* wl, const float* wv, int rs, int nr,
                                              int hd, int parts, size_t o0, float* out, bf16* out_bf, size_t olo,
                                              float* pp, float* pm) {
    for (int e = threadIdx.x; e < nr * hd; e += W * 32) {
        const int r = e / hd, d = e % hd;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < W; w++) M = fmaxf(M, wm[w * rs + r]);
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int w = 0; w < W; w++) {
            const float f = wm[w * rs + r] == NEG_INF ? 0.f : __expf(wm[w * rs + r] - M);
            L += wl[w * rs + r] * f;
            O += wv[(w * rs + r) * hd + d] * f;
        }
        if (parts == 1) {
            att_put(out, out_bf, o0 + e, olo, O / L);
        } else {
            pp[e] = O;
            if (d == 0) {
                pm[2 * r] = M;
                pm[2 * r + 1] = L;
            }
        }
    }
}

#define ATT_PARAMS                                                                          \
    const float *q, const bf16 *kcache, const bf16 *vcache, float *out, bf16 *out_bf, int lo, \
        const int *tables, const int *table_off, const int *pos, int bs, int nh, int nkv,     \
        int hd, float scale, int splits, int min_chunk, float *part, float *part_ml, int *counters, const int *rows
#define ATT_ARGS \
    q, kcache, vcache, out, out_bf, lo, tables, table_off, pos, bs, nh, nkv, hd, scale, splits, \
        min_chunk, part, part_ml, counters, rows

template <int RM, int W>
__device__ __forceinline__ void attention_body(ATT_PARAMS) {
    extern __shared__ float att_sm[];  // [W][RM] maxima, [W][RM] sums, [W][RM][hd] weighted values
    float* wm = att_sm;
    float* wl = wm + W * RM;
    float* wacc = wl + W * RM;
    __shared__ int last;
    pdl_trigger();
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int t = rows ? rows[2 * blockIdx.x] : blockIdx.x, sp = blockIdx.z;
    const int R = nh / nkv;
    const int groups = (R + RM - 1) / RM;
    const int kh = blockIdx.y / groups;
    const int r0 = (blockIdx.y % groups) * RM;
    const int nr = min(RM, R - r0);
    const int h0 = kh * R + r0;  // first query head of the block
    // The batch description and the keys of earlier steps are there before
    // the kernels this one depends on end: read them first.
    const int n = pos[t] + 1;
    const int chunk = max((n + splits - 1) / splits, min_chunk);
    const int parts = (n + chunk - 1) / chunk;
    if (sp >= parts) {
        pdl_wait();
        return;
    }
    const int jb = sp * chunk, je = min(n, jb + chunk);
    // Keys this step writes (from its sequence's first position in the
    // step: listed, or at most gridDim.x positions before pos[t]) are read
    // after the wait; those before, at once.
    const int fresh = rows ? rows[2 * blockIdx.x + 1] : n - (int)gridDim.x;
    const int* tab = tables + table_off[t];
    const int kvdim = nkv * hd;
    const int G = hd >> 3;  // 16-byte chunks per row
    int gp = 1;             // lanes per key: G rounded up to a power of two
    while (gp < G) {
        gp <<= 1;
    }
    const int c = lane & (gp - 1);  // this lane's chunk of a key
    const int kslot = lane / gp;
    const int kpw = 32 / gp;  // keys a warp takes at once
    const bool active = c < G;
    // Keys jb + wid*kpw + kslot + W*kpw*i, ATT_U at a time, the
    // next ATT_U loading while the current ones are used; the loop is
    // uniform across the warp (its shuffles need every lane).
    const int stride = W * kpw;
    unsigned nk[ATT_U][4], nv[ATT_U][4];
    bool loaded[ATT_U];
    auto load = [&](int j0, bool early) {
#pragma unroll
        for (int u = 0; u < ATT_U; u++) {
            int j = j0 + kslot + u * stride;
            loaded[u] = false;
            if (j < je && active && (!early || j < fresh)) {
                size_t off = ((size_t)(tab[j / bs] * bs + j % bs) * kvdim + kh * hd + 8 * c);
                ldcg_u4(kcache + off, nk[u]);
                ldcg_u4(vcache + off, nv[u]);
                loaded[u] = true;
            }
        }
    };
    const int jstart = jb + wid * kpw;
    load(jstart, true);
    pdl_wait();
    // What the early load left out (this step's keys).
#pragma unroll
    for (int u = 0; u < ATT_U; u++) {
        int j = jstart + kslot + u * stride;
        if (!loaded[u] && j < je && active) {
            size_t off = ((size_t)(tab[j / bs] * bs + j % bs) * kvdim + kh * hd + 8 * c);
            ldcg_u4(kcache + off, nk[u]);
            ldcg_u4(vcache + off, nv[u]);
        }
    }

    float qr[RM][8];
#pragma unroll
    for (int r = 0; r < RM; r++)
#pragma unroll
        for (int i = 0; i < 8; i++)
            qr[r][i] = r < nr && active ? ldcg(q + ((size_t)t * nh + h0 + r) * hd + 8 * c + i) * scale : 0.f;
    float m[RM], l[RM], acc[RM][8];
#pragma unroll
    for (int r = 0; r < RM; r++) {
        m[r] = NEG_INF;
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[r][i] = 0.f;
    }

    for (int j0 = jstart; j0 < je; j0 += ATT_U * stride) {
        unsigned kw[ATT_U][4], vw[ATT_U][4];
        bool ok[ATT_U];
#pragma unroll
        for (int u = 0; u < ATT_U; u++) {
            int j = j0 + kslot + u * stride;
            ok[u] = j < je;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                kw[u][i] = ok[u] && active ? nk[u][i] : 0u;
                vw[u][i] = ok[u] && active ? nv[u][i] : 0u;
            }
        }
        if (j0 + ATT_U * stride < je) {
            load(j0 + ATT_U * stride, false);
        }
#pragma unroll
        for (int u = 0; u < ATT_U; u++) {
            float kv[8], vv[8];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                kv[2 * i] = __uint_as_float(kw[u][i] << 16);
                kv[2 * i + 1] = __uint_as_float(kw[u][i] & 0xffff0000u);
                vv[2 * i] = __uint_as_float(vw[u][i] << 16);
                vv[2 * i + 1] = __uint_as_float(vw[u][i] & 0xffff0000u);
            }
            float s[RM];
#pragma unroll
            for (int r = 0; r < RM; r++) {
                s[r] = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) s[r] += qr[r][i] * kv[i];
            }
            for (int o = gp >> 1; o > 0; o >>= 1) {
#pragma unroll
                for (int r = 0; r < RM; r++) s[r] += __shfl_xor_sync(0xffffffffu, s[r], o);
            }
            if (ok[u]) {
#pragma unroll
                for (int r = 0; r < RM; r++) {
                    float mn = fmaxf(m[r], s[r]);
                    float corr = expf(m[r] - mn);  // 0 while m is -inf
                    float p = expf(s[r] - mn);
                    m[r] = mn;
                    l[r] = l[r] * corr + p;
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[r][i] = acc[r][i] * corr + p * vv[i];
                }
            }
        }
    }

    // Merge the key slots of each warp (lanes c, c + gp, ...), then the
    // warps through shared memory.
    for (int o = gp; o < 32; o <<= 1) {
#pragma unroll
        for (int r = 0; r < RM; r++) {
            float m2 = __shfl_xor_sync(0xffffffffu, m[r], o);
            float l2 = __shfl_xor_sync(0xffffffffu, l[r], o);
            float a2[8];
#pragma unroll
            for (int i = 0; i < 8; i++) a2[i] = __shfl_xor_sync(0xffffffffu, acc[r][i], o);
            att_merge(m[r], l[r], acc[r], m2, l2, a2);
        }
    }
    if (kslot == 0 && active) {
#pragma unroll
        for (int r = 0; r < RM; r++) {
            if (c == 0) {
                wm[wid * RM + r] = m[r];
                wl[wid * RM + r] = l[r];
            }
#pragma unroll
            for (int i = 0; i < 8; i++) wacc[(wid * RM + r) * hd + 8 * c + i] = acc[r][i];
        }
    }
    __syncthreads();
    // Thread e of the block: head r = e / hd, element d = e % hd.
    const size_t olo = (size_t)lo * nh * hd;
    const size_t unit = (size_t)t * gridDim.y + blockIdx.y;  // (token, kv head, group)
    float* pp = part + (unit * splits + sp) * ATT_RMAX * hd;
    float* pm = part_ml + (unit * splits + sp) * ATT_RMAX * 2;
    att_warps_out<W>(wm, wl, wacc, RM, nr, hd, parts, ((size_t)t * nh + h0) * hd, out, out_bf, olo, pp, pm);
    if (parts > 1) {
        att_merge_parts(part, part_ml, counters, unit, splits, parts, nr, hd, t, nh, h0, out, out_bf, olo, &last);
    }
}

extern "C" __global__ void __launch_bounds__(128) attention_r1_w4(ATT_PARAMS) { attention_body<1, 4>(ATT_ARGS); }
extern "C" __global__ void __launch_bounds__(128) attention_r2_w4(ATT_PARAMS) { attention_body<2, 4>(ATT_ARGS); }
extern "C" __global__ void __launch_bounds__(128) attention_r4_w4(ATT_PARAMS) { attention_body<4, 4>(ATT_ARGS); }
extern "C" __global__ void __launch_bounds__(128) attention_r8_w4(ATT_PARAMS) { attention_body<8, 4>(ATT_ARGS); }
extern "C" __global__ void __launch_bounds__(512) attention_r1_w16(ATT_PARAMS) { attention_body<1, 16>(ATT_ARGS); }
extern "C" __global__ void __launch_bounds__(512) attention_r2_w16(ATT_PARAMS) { attention_body<2, 16>(ATT_ARGS); }
extern "C" __global__ void __launch_bounds__(512) attention_r4_w16(ATT_PARAMS) { attention_body<4, 16>(ATT_ARGS); }
extern "C" __global__ void __launch_bounds__(512) attention_r8_w16(ATT_PARAMS) { attention_body<8, 16>(ATT_ARGS); }
