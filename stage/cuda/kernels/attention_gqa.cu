// attention_gqa_d<HD>: attention_r*'s work (each token row at its own
// position, split along the sequence) on the tensor cores: a block takes
// the R = nh / nkv query heads of one kv head (R at most 8: the mma's rows
// 0..R-1, the others zero) of one token row, over one part of its keys
// (parts of max(ceil(n / splits), min_chunk) keys, as attention_r*). The
// keys go in tiles of 16 W (W warps), copied into shared memory with
// cp.async into GQA_STAGES stages: the first GQA_STAGES tiles' copies all
// start at once (their keys of earlier steps before pdl_wait, the ones
// this step writes after it), and a stage once used takes the tile
// GQA_STAGES on (keys past the part zero-filled where a warp reads them).
// The host keeps a part to at least the keys of all stages (attnPlan), so
// a short sequence is one part, loaded in one round. Its dependents may
// start once every block has its first tile in (pdl_trigger there, not
// first). Warp w takes keys 16w..16w+15 of each tile: S = q·Kᵀ with q as
// a bf16 value and remainder pair (two mma per fragment; K's fragments by
// ldmatrix), an fp32 online softmax per row (tc_softmax_row), O += P·V
// with P as a pair too (V's fragments by ldmatrix.trans). The warps'
// states merge through shared memory (att_warps_out); then, with one
// part, the block writes the output (as attention_r*: fp32 rows
// to out, or the bf16 pair to out_bf), else its partial, and the last
// block of the (token, kv head) merges the parts (att_merge_parts; unit
// t * nkv + kv head, as attention_r* with one group). Rows as attention_r*
// takes them (all, or those listed in rows).
// attention_gqa_d<HD>_w<W>: grid (tokens or rows listed, nkv, splits), block W * 32
// threads, dynamic shared memory GQA_STAGES * 2 * 16 W * (HD + 8) bf16
// (gqaSmem: each stage's K and V tiles, then the warps' states).
// Parameters: ATT_PARAMS (hd must be HD). Needs sm_80 (the host launches
// it only there).
//
// attention_gqa_rope_d<HD>_w<W> also does rope_qkv's work, for a step
// whose every token row is the one token of its sequence (a decode step):
// with GQA_ROPE_PARAMS (the q|k|v projection's fp32 rows qkv in two halves
// lo rows apart, as rope_qkv takes them, or, for attention_gqa_ropep_*,
// in planes; q unused), each block rotates its
// R query heads' rows into shared memory, and the block of the part that
// holds this step's key (the sequence's last) rotates it, writes it and
// the value to the cache at cache_row[t] and into its tile. No block reads
// another row's key of this step, so no kernel between the projection and
// attention is needed: one launch a layer fewer. The arithmetic is
// rope_qkv's, so the results are the same bit for bit.
#define GQA_STAGES 2

// ldsm_x4 loads four 8x8 bf16 matrices from shared memory, lanes 8m..8m+7
// giving the row addresses of matrix m (ldmatrix); ldsm_x4_t transposes
// each.
__device__ __forceinline__ void ldsm_x4(unsigned a, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_t(unsigned a, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// tc_softmax_row folds row r (0: the lane's mma row g, 1: g + 8) of a
// tile's scores sc (NK column tiles of 8 keys, an mma accumulator each;
// keys out of the row's reach already NEG_INF, mx their maximum in this
// lane) into the row's online softmax state (m, l) and its output o (ND
// column tiles): the scores become exp(s - max), with __expf (the
// hardware's ex2: in the decode step's latency chain expf cost about 1% of
// a batch-1 step), and l and o rescale to the new maximum. The maximum
// must be finite after the fold: a key of the row in this tile or before.
template <int NK, int ND>
__device__ __forceinline__ void tc_softmax_row(float (&sc)[NK][4], float (&o)[ND][4], int r, float mx, float& m,
                                               float& l) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m, mx);
    const float corr = m == NEG_INF ? 0.f : __expf(m - mn);
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NK; n++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float& v = sc[n][2 * r + e];
            v = v == NEG_INF ? 0.f : __expf(v - mn);
            sum += v;
        }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    m = mn;
    l = l * corr + sum;
#pragma unroll
    for (int n = 0; n < ND; n++) {
        o[n][2 * r] *= corr;
        o[n][2 * r + 1] *= corr;
    }
}

// tc_qk sets sc to the scores q·Kᵀ of NK column tiles of 8 keys: q as a
// bf16 value and remainder pair (qh, ql: A fragments of KS k-steps; two mma
// per fragment), K's B fragments by ldmatrix from shared memory (klane:
// this lane's row address at the first key, as the kernels compute it; key
// rows RS bf16 apart).
template <int NK, int KS, int RS>
__device__ __forceinline__ void tc_qk(float (&sc)[NK][4], const unsigned (&qh)[KS][4], const unsigned (&ql)[KS][4],
                                      unsigned klane) {
#pragma unroll
    for (int n = 0; n < NK; n++) {
#pragma unroll
        for (int i = 0; i < 4; i++) sc[n][i] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; s += 2) {
            unsigned b[4];
            ldsm_x4(klane + (unsigned)((n * 8 * RS + 16 * s) * 2), b);
            mma_bf16(sc[n], qh[s][0], qh[s][1], qh[s][2], qh[s][3], b[0], b[1]);
            mma_bf16(sc[n], ql[s][0], ql[s][1], ql[s][2], ql[s][3], b[0], b[1]);
            mma_bf16(sc[n], qh[s + 1][0], qh[s + 1][1], qh[s + 1][2], qh[s + 1][3], b[2], b[3]);
            mma_bf16(sc[n], ql[s + 1][0], ql[s + 1][1], ql[s + 1][2], ql[s + 1][3], b[2], b[3]);
        }
    }
}

// tc_pv adds P·V of 16 keys to o (ND column tiles): P the softmax weights
// s0 (keys 0-7) and s1 (8-15) of tc_softmax_row, as a bf16 value and
// remainder pair of A fragments; V's B fragments by ldmatrix.trans (vlane:
// this lane's address at the 16 keys' first row, as the kernels compute
// it).
template <int ND>
__device__ __forceinline__ void tc_pv(float (&o)[ND][4], const float (&s0)[4], const float (&s1)[4], unsigned vlane) {
    unsigned ph[4], pl[4];
    const float pv[4][2] = {{s0[0], s0[1]}, {s0[2], s0[3]}, {s1[0], s1[1]}, {s1[2], s1[3]}};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        ph[i] = pack_bf16(pv[i][0], pv[i][1]);
        pl[i] = pack_bf16(pv[i][0] - lo_bf16(ph[i]), pv[i][1] - hi_bf16(ph[i]));
    }
#pragma unroll
    for (int nd = 0; nd < ND; nd += 2) {
        unsigned b[4];
        ldsm_x4_t(vlane + (unsigned)(nd * 8 * 2), b);
        mma_bf16(o[nd], ph[0], ph[1], ph[2], ph[3], b[0], b[1]);
        mma_bf16(o[nd], pl[0], pl[1], pl[2], pl[3], b[0], b[1]);
        mma_bf16(o[nd + 1], ph[0], ph[1], ph[2], ph[3], b[2], b[3]);
        mma_bf16(o[nd + 1], pl[0], pl[1], pl[2], pl[3], b[2], b[3]);
    }
}

// GQA_ROPE_PARAMS: rope_qkv's inputs after ATT_PARAMS.
#define GQA_ROPE_PARAMS \
    ATT_PARAMS, const float *qkv, const bf16 *bias, const float *inv_freq, const int *cache_row

template <int HD, int W, bool ROPE, int P>
__device__ __forceinline__ void gqa_body(GQA_ROPE_PARAMS, int planes, int pstride) {
    constexpr int KS = HD / 16;     // k-steps of q·Kᵀ
    constexpr int ND = HD / 8;      // column tiles of the output
    constexpr int RS = HD + 8;      // shared row stride in bf16
    constexpr int CH = HD / 8;      // 16-byte chunks of a key row
    constexpr int KEYS = 16 * W;    // keys of a tile
    constexpr int NT = 32 * W;      // threads
    constexpr int LD = KEYS * CH / NT;  // chunks of K (and of V) a thread copies a tile
    constexpr int S = GQA_STAGES;
    constexpr unsigned TILE = KEYS * RS * 2;  // bytes of a K (or V) tile
    extern __shared__ unsigned gqa_sm[];
    // Stage st: its K tile at sbase + 2 st TILE, its V tile TILE on.
    const unsigned sbase = smem_addr(gqa_sm);
    __shared__ int last;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int t = rows ? rows[2 * blockIdx.x] : blockIdx.x, kh = blockIdx.y, sp = blockIdx.z;
    const int R = nh / nkv;
    // The batch description and the keys of earlier steps are there before
    // the kernels this one depends on end: read them first.
    const int n = pos[t] + 1;
    const int chunk = max((n + splits - 1) / splits, min_chunk);
    const int parts = (n + chunk - 1) / chunk;
    TL_BEGIN
    if (sp >= parts) {
        pdl_wait();
        TL_WAIT
        TL_END_NOW(TL_ATTENTION_EMPTY)
        return;
    }
    const int jb = sp * chunk, je = min(n, jb + chunk);
    // Keys this step may write: from here on (with ROPE, only its own).
    const int fresh = ROPE ? n - 1 : rows ? rows[2 * blockIdx.x + 1] : n - (int)gridDim.x;
    const int* tab = tables + table_off[t];
    const int kvdim = nkv * HD;

    // issue copies keys [j0, j1) of the tile at kb into stage st (16-byte
    // chunk e = tid + i * NT: key e / CH, chunk e % CH) and, with fill,
    // zeroes the keys past the part that a warp with keys in it reads.
    auto issue = [&](int kb, int st, int j0, int j1, bool fill) {
#pragma unroll
        for (int i = 0; i < LD; i++) {
            const int e = tid + i * NT, j = kb + e / CH;
            const unsigned kd = sbase + 2 * st * TILE + (unsigned)(((e / CH) * RS + (e % CH) * 8) * 2);
            if (j >= j0 && j < j1) {
                const size_t off = (size_t)(tab[j / bs] * bs + j % bs) * kvdim + kh * HD + (e % CH) * 8;
                cp_async16(kd, kcache + off, 16);
                cp_async16(kd + TILE, vcache + off, 16);
            } else if (fill && j >= je && kb + (e / CH) / 16 * 16 < je) {
                cp_async16(kd, kcache, 0);
                cp_async16(kd + TILE, vcache, 0);
            }
        }
    };
    // The first S tiles, in one group: their keys of earlier steps, then,
    // once this step's are written, those.
#pragma unroll
    for (int st = 0; st < S; st++) {
        if (jb + st * KEYS < je) {
            issue(jb + st * KEYS, st, jb, min(je, fresh), false);
        }
    }
    pdl_wait();
    TL_WAIT
    // With ROPE: the rotated q rows (scaled), and this step's key and value
    // written by this block (see above) instead of copied.
    __shared__ float qs[ROPE ? 8 * HD : 1];
    if (ROPE) {
        constexpr int half = HD / 2;
        const size_t width = (size_t)(nh + 2 * nkv) * HD;
        const float* row = qkv + (size_t)t * width;
        const size_t ps = (size_t)pstride * width;  // elements between the planes
        auto qkvp = [&](int i) { return qkv_in<P>(row, ps, planes, bias, i); };
        const int items = (R + (je == n ? 1 : 0)) * half;
        const int kj = n - 1 - jb;  // this step's key in the part's first tiles, if < S * KEYS
        for (int e = tid; e < items; e += NT) {
            const int r = e / half, i = e % half;
            const int off = r < R ? (kh * R + r) * HD : (nh + kh) * HD;
            float y1 = qkvp(off + i), y2 = qkvp(off + i + half);
            rope_rotate(y1, y2, pos[t], inv_freq[i]);
            if (r < R) {
                qs[r * HD + i] = y1;
                qs[r * HD + i + half] = y2;
                continue;
            }
            const int voff = (nh + nkv) * HD + kh * HD;
            const float v1 = qkvp(voff + i), v2 = qkvp(voff + i + half);
            const bf16 k1 = f2bf(y1), k2 = f2bf(y2), w1 = f2bf(v1), w2 = f2bf(v2);
            const size_t dst = ((size_t)cache_row[t] * nkv + kh) * HD;
            bf16* kc = (bf16*)kcache;  // ATT_PARAMS's caches are read-only elsewhere
            bf16* vc = (bf16*)vcache;
            kc[dst + i] = k1;
            kc[dst + i + half] = k2;
            vc[dst + i] = w1;
            vc[dst + i + half] = w2;
            if (kj < S * KEYS) {
                bf16* kt = (bf16*)gqa_sm + (size_t)(kj / KEYS) * 2 * (TILE / 2) + (kj % KEYS) * RS;
                kt[i] = k1;
                kt[i + half] = k2;
                kt[TILE / 2 + i] = w1;
                kt[TILE / 2 + i + half] = w2;
            }
        }
    }
#pragma unroll
    for (int st = 0; st < S; st++) {
        if (jb + st * KEYS < je) {
            issue(jb + st * KEYS, st, ROPE ? je : max(jb, fresh), je, true);
        }
    }
    cp_async_commit();
    if (ROPE) {
        __syncthreads();  // qs and this step's key are in
    }

    unsigned qh[KS][4], ql[KS][4];
#pragma unroll
    for (int s = 0; s < KS; s++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = g + (i & 1) * 8, col = 16 * s + 2 * c + (i >> 1) * 8;
            float v0 = 0.f, v1 = 0.f;
            if (row < R) {
                if (ROPE) {
                    v0 = qs[row * HD + col] * scale;
                    v1 = qs[row * HD + col + 1] * scale;
                } else {
                    const float* qp = q + ((size_t)t * nh + kh * R + row) * HD + col;
                    v0 = ldcg(qp) * scale;
                    v1 = ldcg(qp + 1) * scale;
                }
            }
            qh[s][i] = pack_bf16(v0, v1);
            ql[s][i] = pack_bf16(v0 - lo_bf16(qh[s][i]), v1 - hi_bf16(qh[s][i]));
        }
    // Rows g (r 0) and g + 8 (r 1, always past R: zero q, never written).
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; nd++)
#pragma unroll
        for (int i = 0; i < 4; i++) o[nd][i] = 0.f;
    // This lane's row addresses for ldmatrix, from its warp's key 0 of a
    // stage: K rows (lane & 7) of matrices 16-column k-steps apart (non-
    // transposed: B fragments of q·Kᵀ for k-steps s and s + 1); V rows
    // (lane & 7) + 8 ((lane >> 3) & 1), columns 8 (lane >> 4) (transposed:
    // B fragments of P·V for column tiles nd and nd + 1).
    const unsigned klane = (unsigned)(((wid * 16 + (lane & 7)) * RS + (lane >> 3) * 8) * 2);
    const unsigned vlane = TILE + (unsigned)(((wid * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * RS + (lane >> 4) * 8) * 2);
    int it = 0;
    for (int kb = jb; kb < je; kb += KEYS, it++) {
        if (it == 0) {
            cp_async_wait<0>();
        } else {
            cp_async_wait<S - 1>();
        }
        __syncthreads();  // this tile is in
        if (it == 0) {
            // Only now may the next kernel's blocks start: started with
            // this one, they load their weights while this block's q and
            // key round trips wait behind those loads (NOTES.md, phase 9).
            pdl_trigger();
            TL_MARK
        }
        const int k0 = wid * 16;  // this warp's keys of the tile
        if (kb + k0 < je) {
            const unsigned st = sbase + 2 * (it % S) * TILE;
            float sc[2][4];
            tc_qk<2, KS, RS>(sc, qh, ql, st + klane);
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float mx = NEG_INF;
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float& v = sc[nt][2 * r + e];
                        v = kb + k0 + nt * 8 + 2 * c + e < je ? v : NEG_INF;
                        mx = fmaxf(mx, v);
                    }
                // The warp's first key is in the part, so the maximum is finite.
                tc_softmax_row(sc, o, r, mx, m[r], l[r]);
            }
            tc_pv(o, sc[0], sc[1], st + vlane);
        }
        if (kb + S * KEYS < je) {
            __syncthreads();  // every warp is done with this stage
            issue(kb + S * KEYS, it % S, jb, je, true);
        }
        cp_async_commit();
    }
    // The warps' states through shared memory (stage 0's tiles, once no
    // copy is in flight): rows 0..7.
    cp_async_wait<0>();
    __syncthreads();
    float* wo = (float*)gqa_sm;                      // [W warps][8 rows][HD]
    float* wm = (float*)gqa_sm + TILE / 4;           // [W][8] maxima, then [W][8] sums
    float* wl = wm + 8 * W;
    if (g < R) {
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
            wo[(wid * 8 + g) * HD + nd * 8 + 2 * c] = o[nd][0];
            wo[(wid * 8 + g) * HD + nd * 8 + 2 * c + 1] = o[nd][1];
        }
        if (c == 0) {
            wm[wid * 8 + g] = m[0];
            wl[wid * 8 + g] = l[0];
        }
    }
    __syncthreads();
    const size_t olo = (size_t)lo * nh * HD;
    const size_t unit = (size_t)t * gridDim.y + kh;
    float* pp = part + (unit * splits + sp) * ATT_RMAX * HD;
    float* pm = part_ml + (unit * splits + sp) * ATT_RMAX * 2;
    att_warps_out<W>(wm, wl, wo, 8, R, HD, parts, ((size_t)t * nh + kh * R) * HD, out, out_bf, olo, pp, pm);
    if (parts > 1) {
        att_merge_parts(part, part_ml, counters, unit, splits, parts, R, HD, t, nh, kh * R, out, out_bf, olo, &last);
    }
    TL_END(TL_ATTENTION)
}

#define GQA_ENTRY(name, hd, w)                                                           \
    extern "C" __global__ void __launch_bounds__(w * 32) name(ATT_PARAMS) {              \
        gqa_body<hd, w, false, 2>(ATT_ARGS, nullptr, nullptr, nullptr, nullptr, 0, 0);   \
    }
#define GQA_ROPE_ENTRY(name, hd, w)                                                      \
    extern "C" __global__ void __launch_bounds__(w * 32) name(GQA_ROPE_PARAMS) {         \
        gqa_body<hd, w, true, 2>(ATT_ARGS, qkv, bias, inv_freq, cache_row, lo ? 2 : 1, lo); \
    }
// attention_gqa_ropep_*: the same, q|k|v in planes planes pstride rows
// apart (gemvs.cu's splits), up to MAX_PLANES.
#define GQA_ROPEP_ENTRY(name, hd, w)                                                              \
    extern "C" __global__ void __launch_bounds__(w * 32) name(GQA_ROPE_PARAMS, int planes, int pstride) { \
        gqa_body<hd, w, true, MAX_PLANES>(ATT_ARGS, qkv, bias, inv_freq, cache_row, planes, pstride); \
    }

GQA_ENTRY(attention_gqa_d64_w4, 64, 4)
GQA_ENTRY(attention_gqa_d64_w8, 64, 8)
GQA_ENTRY(attention_gqa_d128_w4, 128, 4)
GQA_ENTRY(attention_gqa_d128_w8, 128, 8)
GQA_ROPE_ENTRY(attention_gqa_rope_d64_w4, 64, 4)
GQA_ROPE_ENTRY(attention_gqa_rope_d64_w8, 64, 8)
GQA_ROPE_ENTRY(attention_gqa_rope_d128_w4, 128, 4)
GQA_ROPE_ENTRY(attention_gqa_rope_d128_w8, 128, 8)
GQA_ROPEP_ENTRY(attention_gqa_ropep_d64_w4, 64, 4)
GQA_ROPEP_ENTRY(attention_gqa_ropep_d64_w8, 64, 8)
GQA_ROPEP_ENTRY(attention_gqa_ropep_d128_w4, 128, 4)
GQA_ROPEP_ENTRY(attention_gqa_ropep_d128_w8, 128, 8)
