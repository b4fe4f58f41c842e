// attention_prefill_d<HD>: causal attention for the whole prefill tiles of a
// step (the host's prefillLists: up to 64 rows of one sequence at
// consecutive positions, at least 16) on the tensor cores, flash-attention
// style.
// attention_r* (attention.cu) attends once per row, re-reading every key
// for every row; here a tile's rows share each key. The other
// rows are attention_r*'s (those the host lists), launched beside it.
//
// Block: PF_WARPS warps for one query head h (kv head h / (nh / nkv)) and
// one tile, rows tiles[2x] .. tiles[2x + 1] for x = gridDim.y - 1 -
// blockIdx.y, each warp 16 of its rows. The host lists a sequence's tiles
// in position order, so the blocks start (heads fastest) with the longest
// tiles of each sequence and the grid ends with short ones: 1B 4 x 512
// 97.0 -> 91.3 us, 8B 166.9 -> 161.6 against tiles fastest, in reverse
// (one H200, NOTES.md phase 26). The keys 0..pos of the tile's
// last row go in blocks of PF_KEYS, copied by cp.async (through the
// sequence's block table, keys past the last zero-filled) into PF_STAGES
// stages of shared memory: the next blocks' copies are in flight while a
// block is multiplied. Each warp computes S = q·Kᵀ with its fp32 q (times
// scale) split into a bf16 value and remainder (two mma per
// fragment: about 16 bits of q; K is bf16 in the cache; K's fragments by
// ldmatrix), masks the keys past each row's position (the diagonal block
// only), keeps an fp32 online softmax per row, and adds P·V with P split
// the same way (V's fragments by ldmatrix.trans). A warp whose rows all
// precede a key block skips its products. Output as attention_r*: fp32
// rows to out, or the bf16 pair to out_bf (put_split, remainders lo rows
// on).
//
// mma.m16n8k16 fragments: thread (g, c) = (lane / 4, lane % 4) holds A
// elements (rows g, g + 8; columns 2c, 2c + 1, 2c + 8, 2c + 9), B elements
// (k 2c, 2c + 1, 2c + 8, 2c + 9; column g) and C elements (rows g, g + 8;
// columns 2c, 2c + 1); S's C fragments are P's A fragments once packed.
// Grid: (nh, tiles). Block: PF_THREADS. Dynamic shared memory:
// PF_STAGES * 2 * PF_KEYS * (HD + 8) bf16 (prefillSmem). Needs sm_80 (the
// host launches it only there) and HD 64 or 128.
#define PF_WARPS 4
#define PF_THREADS (PF_WARPS * 32)
#define PF_KEYS 64
#define PF_STAGES 2

template <int HD>
__device__ __forceinline__ void prefill_body(const float* q, const bf16* kcache, const bf16* vcache, float* out,
                                             bf16* out_bf, int lo, const int* tables, const int* table_off,
                                             const int* pos, int bs, int nh, int nkv, float scale, const int* tiles) {
    constexpr int KS = HD / 16;  // k-steps of q·Kᵀ
    constexpr int ND = HD / 8;   // column tiles of the output
    constexpr int RS = HD + 8;   // shared row stride in bf16: rows 16 bytes apart in the banks
    constexpr int CH = HD / 8;   // 16-byte chunks of a key row
    constexpr int LD = PF_KEYS * CH / PF_THREADS;   // chunks of K (and of V) a thread copies a block
    constexpr unsigned TILE = PF_KEYS * RS * 2;     // bytes of a K (or V) block
    extern __shared__ unsigned pf_sm[];
    // Stage st: its K block at sbase + 2 st TILE, its V block TILE on.
    const unsigned sbase = smem_addr(pf_sm);
    pdl_trigger();
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int h = blockIdx.x, x = gridDim.y - 1 - blockIdx.y;
    // The batch description is there before the kernels this one depends
    // on end.
    const int t0 = tiles[2 * x], t1 = tiles[2 * x + 1];
    const int p0 = pos[t0], nkeys = pos[t1] + 1;
    const int kh = h / (nh / nkv), kvdim = nkv * HD;
    const int* tab = tables + table_off[t0];
    const int wr0 = wid * 16;                   // the warp's first row in the tile
    const int wlast = min(wr0 + 15, t1 - t0);   // its last valid row (wr0 > t1 - t0: none)
    const int pr[2] = {p0 + wr0 + g, p0 + wr0 + g + 8};
    const int nb = (nkeys + PF_KEYS - 1) / PF_KEYS;

    // issue copies key block b into stage b % PF_STAGES (16-byte chunk e =
    // tid + i * PF_THREADS: key e / CH, chunk e % CH), zero-filling the
    // keys past nkeys, unless b >= nb, and commits a group either way, so
    // that every thread counts the same groups.
    auto issue = [&](int b) {
        const unsigned st = sbase + (unsigned)(b % PF_STAGES) * 2 * TILE;
#pragma unroll
        for (int i = 0; i < LD && b < nb; i++) {
            const int e = tid + i * PF_THREADS, j = b * PF_KEYS + e / CH;
            const unsigned kd = st + (unsigned)(((e / CH) * RS + (e % CH) * 8) * 2);
            if (j < nkeys) {
                const size_t off = (size_t)(tab[j / bs] * bs + j % bs) * kvdim + kh * HD + (e % CH) * 8;
                cp_async16(kd, kcache + off, 16);
                cp_async16(kd + TILE, vcache + off, 16);
            } else {
                cp_async16(kd, kcache, 0);
                cp_async16(kd + TILE, vcache, 0);
            }
        }
        cp_async_commit();
    };
    pdl_wait();  // q and this step's keys are written
#pragma unroll
    for (int b = 0; b < PF_STAGES - 1; b++) {
        issue(b);
    }

    unsigned qh[KS][4], ql[KS][4];
#pragma unroll
    for (int s = 0; s < KS; s++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = wr0 + g + (i & 1) * 8, col = 16 * s + 2 * c + (i >> 1) * 8;
            float v0 = 0.f, v1 = 0.f;
            if (row <= t1 - t0) {
                const float* qp = q + ((size_t)(t0 + row) * nh + h) * HD + col;
                v0 = ldcg(qp) * scale;
                v1 = ldcg(qp + 1) * scale;
            }
            qh[s][i] = pack_bf16(v0, v1);
            ql[s][i] = pack_bf16(v0 - lo_bf16(qh[s][i]), v1 - hi_bf16(qh[s][i]));
        }
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) o[n][i] = 0.f;
    // This lane's row addresses for ldmatrix from a stage's key 0: K rows
    // (lane & 7) of matrices 8 columns apart (B fragments of q·Kᵀ for
    // k-steps s and s + 1 of 8 keys); V rows (lane & 7) + 8 ((lane >> 3) &
    // 1), columns 8 (lane >> 4) (transposed: B fragments of P·V for 16 keys
    // and column tiles n and n + 1).
    const unsigned klane = (unsigned)(((lane & 7) * RS + (lane >> 3) * 8) * 2);
    const unsigned vlane = TILE + (unsigned)((((lane & 7) + ((lane >> 3) & 1) * 8) * RS + (lane >> 4) * 8) * 2);

    for (int b = 0; b < nb; b++) {
        // Block b + PF_STAGES - 1 into the stage block b - 1 freed.
        issue(b + PF_STAGES - 1);
        cp_async_wait<PF_STAGES - 1>();
        __syncthreads();  // block b is in
        const int kb = b * PF_KEYS;
        if (wr0 <= t1 - t0 && kb <= p0 + wlast) {  // some row of this warp reaches these keys
            const unsigned st = sbase + (unsigned)(b % PF_STAGES) * 2 * TILE;
            float sc[PF_KEYS / 8][4];
            tc_qk<PF_KEYS / 8, KS, RS>(sc, qh, ql, st + klane);
            // Mask (only a block past the warp's first row has keys out of
            // reach), and the online softmax of rows g (r 0) and g + 8 (r 1).
            const bool diag = kb + PF_KEYS - 1 > p0 + wr0;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float mx = NEG_INF;
#pragma unroll
                for (int n = 0; n < PF_KEYS / 8; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int j = kb + n * 8 + 2 * c + e;
                        float& v = sc[n][2 * r + e];
                        v = !diag || j <= pr[r] ? v : NEG_INF;
                        mx = fmaxf(mx, v);
                    }
                // Key 0 is every row's, so the maximum is finite from the first block on.
                tc_softmax_row(sc, o, r, mx, m[r], l[r]);
            }
            // O += P·V, 16 keys a step.
#pragma unroll
            for (int kk = 0; kk < PF_KEYS / 16; kk++) {
                tc_pv(o, sc[2 * kk], sc[2 * kk + 1], st + vlane + (unsigned)(16 * kk * RS * 2));
            }
        }
        __syncthreads();  // block b's stage is free for block b + PF_STAGES
    }
    const size_t olo = (size_t)lo * nh * HD;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = wr0 + g + 8 * r;
        if (row > t1 - t0) {
            continue;
        }
        const float inv = 1.f / l[r];
        const size_t base = ((size_t)(t0 + row) * nh + h) * HD + 2 * c;
#pragma unroll
        for (int n = 0; n < ND; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float v = o[n][2 * r + e] * inv;
                att_put(out, out_bf, base + n * 8 + e, olo, v);
            }
    }
}

#define PF_PARAMS                                                                                   \
    const float *q, const bf16 *kcache, const bf16 *vcache, float *out, bf16 *out_bf, int lo,        \
        const int *tables, const int *table_off, const int *pos, int bs, int nh, int nkv, float scale, \
        const int* tiles
#define PF_ARGS q, kcache, vcache, out, out_bf, lo, tables, table_off, pos, bs, nh, nkv, scale, tiles

// At HD 64, three blocks a multiprocessor (168 registers and 8 bytes
// spilled; 179 and two blocks without the bound): 97.0 -> 86.4 us for the
// 1B shape's 4 x 512 (NOTES.md phase 26). At 128 two blocks, the most its
// 255 registers (8 bytes spilled) fit.
extern "C" __global__ void __launch_bounds__(PF_THREADS, 3) attention_prefill_d64(PF_PARAMS) {
    prefill_body<64>(PF_ARGS);
}
extern "C" __global__ void __launch_bounds__(PF_THREADS) attention_prefill_d128(PF_PARAMS) {
    prefill_body<128>(PF_ARGS);
}
