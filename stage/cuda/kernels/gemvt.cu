// gemvt_*: the skinny products of steps of 9 to 32 token rows on the tensor
// cores, with gemv.cu's row mapping, units and epilogues (the same
// parameters, GEMV_PARAMS, then the split-k ones), for when gemv's own
// loop is bound by its activations: each of its warps reloads and splits
// every k-block of all 32 token columns for its 16 rows, so at 32 tokens
// it moves four times as many activation bytes as weight bytes.
//
// Here a block of GT_WARPS warps computes GT_WARPS consecutive units, one
// per warp, over a range of k (a split), and the activations are staged
// once per block: chunk by chunk (GT_KC of k), the block's threads load the
// 32 token columns' fp32 activations (times the norm weight, their squares
// summed for the norm), split them into bf16 and bf16 remainder (as
// gemv.cu does) and store both in shared memory, where every warp reads its
// mma B operands. The weights stream through shared memory with cp.async,
// GT_STAGES chunks in flight (16-byte copies of whole 128-byte row
// segments, bypassing L1), and each warp reads its A operands there; the
// 16-byte chunks of a row are swizzled so that the fragment reads of two
// rows never share a bank. The k-permutation of gemv.cu is kept: within a
// 32-wide k-block, thread (g, q) takes elements 8q..8q+7 of rows g and g+8
// and of token column g.
//
// Split k: with splits > 1 (a grid of (blocks, splits)) each block writes
// its units' partial sums and its sums of squares to part, and the last
// block of a row block to finish (counted in counters, which it resets to
// 0) adds the splits' partials in split order, so results do not depend on
// timing (at most GT_MAXSPLITS splits); the block that has every sum runs
// gemv.cu's epilogue (emit) for each of its units in turn. The split of k depends only on the product, never
// on the token count, so a token column's result is the same in every step.
//
// Launch: grid (ceil(units / GT_WARPS), splits), GT_THREADS threads,
// gemvt_smem(MT) bytes of dynamic shared memory; part holds splits *
// (GT_WARPS * 16 * MT * GT_C + GT_C) floats per row block, counters one int
// per row block (zero between launches). A programmatic dependent: only
// weights are read before griddepcontrol.wait.
#define GT_WARPS 4
#define GT_THREADS (GT_WARPS * 32)
#define GT_KC 64
#define GT_STAGES 4
#define GT_C 32
#define GT_MAXSPLITS 16
// Row stride of the staged activations, in bf16: 192 bytes, so that the
// fragment reads of two token columns fall in different banks.
#define GT_XS (GT_KC + 32)

__device__ __forceinline__ void lds128(unsigned a, unsigned* r) {
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

__device__ __forceinline__ void sts128(unsigned a, unsigned x, unsigned y, unsigned z, unsigned w) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}

// ldcg4 loads 4 floats an earlier kernel wrote, from L2.
__device__ __forceinline__ void ldcg4(const float* p, float* v) {
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                 : "l"(p));
}

#define GEMVT_PARAMS GEMV_PARAMS, int splits, float *part, int *counters

template <int EPI, int MT>
__device__ __forceinline__ void gemvt_body(GEMVT_PARAMS) {
    constexpr int R = MT * 16;             // rows of a warp's unit
    constexpr int WROWS = GT_WARPS * R;    // rows of the block
    constexpr int WSTAGE = WROWS * GT_KC;  // bf16 of one weight stage
    constexpr int XBUF = 2 * GT_C * GT_XS; // bf16 of one activation buffer (values, remainders)
    extern __shared__ float gts[];
    __shared__ int gt_last;
    bf16* wsm = (bf16*)gts;                           // [GT_STAGES][WROWS][GT_KC], swizzled
    bf16* xsm = wsm + GT_STAGES * WSTAGE;             // [2][2][GT_C][GT_XS]
    float* ssq_s = (float*)(xsm + 2 * XBUF);          // [GT_C]
    float* invs = ssq_s + GT_C;                       // [GT_C]
    float* red = gts;                                 // [WROWS][GT_C], after the main loop
    pdl_trigger();
    Gemv<EPI, MT, 4> m{w, x, rowmap, g, eps, k, n, t, s, u, mh, seg, units, out, ldo, bias,
                       inv_freq, pos, cache_row, kcache, vcache, nh, nkv, hd, pdelta, stats};
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    m.lane = lane;
    m.wid = wid;
    m.gq = gq;
    m.tq = tq;
    const int rb = blockIdx.x, ks = blockIdx.y;
    const int un = rb * GT_WARPS + wid;  // this warp's unit
    const bool live = un < units;        // uniform across the warp
    const int base = live ? m.base_of(un) : 0;
    const int nch = (k + GT_KC - 1) / GT_KC;
    const int per = (nch + splits - 1) / splits;
    const int c0 = min(nch, ks * per), c1 = min(nch, c0 + per);
    const unsigned wsa = smem_addr(wsm), xsa = smem_addr(xsm);

    // load_w starts the copies of chunk c's weights of this warp's unit
    // into their stage; every thread commits one group per call.
    auto load_w = [&](int c) {
        if (c < c1 && live) {
            const unsigned dst = wsa + (unsigned)(((c - c0) % GT_STAGES) * WSTAGE + wid * R * GT_KC) * 2u;
            const int kc = c * GT_KC;
#pragma unroll
            for (int j = 0; j < R * 8 / 32; j++) {
                const int idx = j * 32 + lane;
                const int row = idx >> 3, ch = idx & 7;
                const int l = row >> 4;
                const int rs = base + (l % mh) * 16 + (row & 15);
                const int kk = kc + ch * 8;
                const bool ok = rs < n && kk < k;
                const bf16* src = ok ? w + ((size_t)((l / mh) * seg) + rs) * k + kk : w;
                cp_async16(dst + (unsigned)(row * GT_KC + ((ch ^ ((row & 1) << 2)) << 3)) * 2u, src, ok ? 16 : 0);
            }
        }
        cp_async_commit();
    };

    // The activations: thread tid stages token column tk = tid / 4,
    // elements (tid % 4) * 16 .. + 15 of each chunk.
    const int tk = tid >> 2, kp = (tid & 3) * 16;
    const bool tlive = tk < t;
    const float* xrow = x + (size_t)(tlive ? (rowmap ? rowmap[tk] : tk) : 0) * k;
    float xv[16];
    unsigned gv[8];
    auto load_x = [&](int c) {
        const int kk = c * GT_KC + kp;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (tlive && kk + 4 * i < k) {
                ldcg4(xrow + kk + 4 * i, xv + 4 * i);
            } else {
                xv[4 * i] = xv[4 * i + 1] = xv[4 * i + 2] = xv[4 * i + 3] = 0.f;
            }
        }
        if (g) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                if (kk + 8 * i < k) {
                    u32x4 q = ldg_const(g + kk + 8 * i);
                    gv[4 * i] = q.x;
                    gv[4 * i + 1] = q.y;
                    gv[4 * i + 2] = q.z;
                    gv[4 * i + 3] = q.w;
                } else {
                    gv[4 * i] = gv[4 * i + 1] = gv[4 * i + 2] = gv[4 * i + 3] = 0u;
                }
            }
        }
    };
    float ssq = 0.f;
    // store_x splits the loaded activations into buffer b.
    auto store_x = [&](int b) {
        unsigned hv[8], lv[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float a0 = xv[2 * i], a1 = xv[2 * i + 1];
            ssq += a0 * a0 + a1 * a1;
            if (g) {
                a0 *= lo_bf16(gv[i]);
                a1 *= hi_bf16(gv[i]);
            }
            hv[i] = pack_bf16(a0, a1);
            lv[i] = pack_bf16(a0 - lo_bf16(hv[i]), a1 - hi_bf16(hv[i]));
        }
        const unsigned hi = xsa + (unsigned)(b * XBUF + tk * GT_XS + kp) * 2u;
        const unsigned lo = hi + (unsigned)(GT_C * GT_XS) * 2u;
        sts128(hi, hv[0], hv[1], hv[2], hv[3]);
        sts128(hi + 16, hv[4], hv[5], hv[6], hv[7]);
        sts128(lo, lv[0], lv[1], lv[2], lv[3]);
        sts128(lo + 16, lv[4], lv[5], lv[6], lv[7]);
    };

    float acc[MT][4][4];
#pragma unroll
    for (int l = 0; l < MT; l++)
#pragma unroll
        for (int c = 0; c < 4; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[l][c][i] = 0.f;

#pragma unroll
    for (int i = 0; i < GT_STAGES - 1; i++) {
        load_w(c0 + i);  // weights only, before the wait
    }
    pdl_wait();
    if (c0 < c1) {
        load_x(c0);
    }
    for (int c = c0; c < c1; c++) {
        const int b = (c - c0) & 1;
        store_x(b);
        if (c + 1 < c1) {
            load_x(c + 1);  // in flight across the wait and this chunk's products
        }
        cp_async_wait<GT_STAGES - 2>();
        __syncthreads();  // chunk c's weights and activations are in; chunk c - 1's stage is free
        load_w(c + GT_STAGES - 1);
        if (live) {
            const unsigned ws = wsa + (unsigned)(((c - c0) % GT_STAGES) * WSTAGE + wid * R * GT_KC) * 2u;
            const unsigned xs = xsa + (unsigned)(b * XBUF) * 2u;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                unsigned bh[4][4], bl[4][4], a[MT][4], a8[MT][4];
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    const unsigned xa = xs + (unsigned)((nt * 8 + gq) * GT_XS + h * 32 + tq * 8) * 2u;
                    lds128(xa, bh[nt]);
                    lds128(xa + (unsigned)(GT_C * GT_XS) * 2u, bl[nt]);
                }
                const int pch = ((h * 4 + tq) ^ ((gq & 1) << 2)) << 3;
#pragma unroll
                for (int l = 0; l < MT; l++) {
                    lds128(ws + (unsigned)((l * 16 + gq) * GT_KC + pch) * 2u, a[l]);
                    lds128(ws + (unsigned)((l * 16 + gq + 8) * GT_KC + pch) * 2u, a8[l]);
                }
                // Each accumulator takes its four products (k 0..15 value
                // and remainder, then k 16..31), in that order; consecutive
                // products go to different accumulators, so that they do
                // not wait for one another.
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int r = (q >> 1) * 2;
#pragma unroll
                    for (int l = 0; l < MT; l++)
#pragma unroll
                        for (int nt = 0; nt < 4; nt++) {
                            const unsigned b0 = (q & 1) ? bl[nt][r] : bh[nt][r];
                            const unsigned b1 = (q & 1) ? bl[nt][r + 1] : bh[nt][r + 1];
                            mma_bf16(acc[l][nt], a[l][r], a8[l][r], a[l][r + 1], a8[l][r + 1], b0, b1);
                        }
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the stages are free: red overlays them

    // Sums of squares per token column (its 4 threads), and the block's
    // partial sums, rows of each unit in order.
    ssq += __shfl_xor_sync(0xffffffffu, ssq, 1);
    ssq += __shfl_xor_sync(0xffffffffu, ssq, 2);
    if ((tid & 3) == 0) {
        ssq_s[tk] = ssq;
    }
    if (live) {
#pragma unroll
        for (int l = 0; l < MT; l++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                float* r0 = red + (wid * R + l * 16 + gq) * GT_C + nt * 8 + 2 * tq;
                r0[0] = acc[l][nt][0];
                r0[1] = acc[l][nt][1];
                r0[8 * GT_C] = acc[l][nt][2];
                r0[8 * GT_C + 1] = acc[l][nt][3];
            }
    }
    __syncthreads();
    if (splits > 1) {
        const int stride = WROWS * GT_C + GT_C;
        float* mine = part + ((size_t)rb * splits + ks) * stride;
        for (int e = tid; e < WROWS * GT_C; e += GT_THREADS) {
            mine[e] = red[e];
        }
        if (tid < GT_C) {
            mine[WROWS * GT_C + tid] = ssq_s[tid];
        }
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            gt_last = atomicAdd(&counters[rb], 1) == splits - 1;
        }
        __syncthreads();
        if (!gt_last) {
            return;
        }
        __threadfence();
        const float* p0 = part + (size_t)rb * splits * stride;
        for (int e = tid; e < stride; e += GT_THREADS) {
            // Every split's partial in flight at once, then added in order.
            float pv[GT_MAXSPLITS];
#pragma unroll
            for (int s2 = 0; s2 < GT_MAXSPLITS; s2++) {
                pv[s2] = s2 < splits ? ldcg(p0 + (size_t)s2 * stride + e) : 0.f;
            }
            float v = 0.f;
#pragma unroll
            for (int s2 = 0; s2 < GT_MAXSPLITS; s2++) {
                v += pv[s2];
            }
            if (e < WROWS * GT_C) {
                red[e] = v;
            } else {
                ssq_s[e - WROWS * GT_C] = v;
            }
        }
        if (tid == 0) {
            counters[rb] = 0;
        }
        __syncthreads();
    }
    if (tid < GT_C) {
        invs[tid] = g ? rsqrtf(ssq_s[tid] / (float)k + eps) : 1.f;
    }
    __syncthreads();
    // The epilogue of each unit by the whole block: each thread has few
    // outputs (a residual add waits for its load), each warp a few token
    // columns' softmax statistics.
    for (int i = 0; i < GT_WARPS; i++) {
        if (rb * GT_WARPS + i < units) {
            m.emit(red + i * R * GT_C, invs, rb * GT_WARPS + i, tid, GT_THREADS, wid, GT_WARPS);
        }
    }
}

#define GEMVT_ENTRY(name, epi, mt, minb)                                                   \
    extern "C" __global__ void __launch_bounds__(GT_THREADS, minb) name(GEMVT_PARAMS) { \
        gemvt_body<epi, mt>(GEMV_ARGS, splits, part, counters);                            \
    }

GEMVT_ENTRY(gemvt_store_m4, GEMV_STORE, 4, 1)
GEMVT_ENTRY(gemvt_head_m4, GEMV_HEAD, 4, 1)
GEMVT_ENTRY(gemvt_resid_m1, GEMV_RESID, 1, 3)
GEMVT_ENTRY(gemvt_resid_m2, GEMV_RESID, 2, 2)
GEMVT_ENTRY(gemvt_silu_m2, GEMV_SILU, 2, 2)
GEMVT_ENTRY(gemvt_silu_m4, GEMV_SILU, 4, 1)
GEMVT_ENTRY(gemvt_rope_m1, GEMV_ROPE, 1, 3)
GEMVT_ENTRY(gemvt_rope_m2, GEMV_ROPE, 2, 2)
