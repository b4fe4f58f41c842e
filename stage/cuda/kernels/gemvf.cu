// gemvf_*: the skinny products of steps of 1 or 2 token rows (TT), with
// fp32 multiply-adds instead of the tensor cores: at so few rows the work
// is reading the weights, and a warp reading 512 contiguous bytes of one
// row per load instruction streams them better than the tensor-core
// fragments' layout (8 rows x 64 bytes per instruction) allows. The same
// products as gemv.cu (v[t][n] = inv[t] * sum_k x[xr][k] * g[k] * W[n][k]),
// with the activations kept in fp32 (no bf16 split: closer still).
//
// Each block stages its activation rows, times the norm weight, in shared
// memory (and their sums of squares for the norm; rows without a norm by
// cp.async, as they are), then its warps work
// through warp units of 4 weight rows: rows a, a+1, a+d, a+d+1 with
//   a = (wu / s) * u + (wu % s) * 2
// for warp unit wu (plain: s 1, u 4, d 2; gate|up: u 2, d the intermediate
// size, the first pair gate rows and the second their up rows; q|k|v: s
// hd/4, u hd, d hd/2, each pair's rotary partners). The first pair is valid
// while a + e < n, the second while a + e + dn < n. Lane L of a warp reads
// elements 8L..8L+7 of every 256 of each row (16-byte loads, 16 in flight),
// multiplies them with the staged activations, and the warp adds its lanes
// up (butterfly shuffles, a fixed order). ks warps (1, 2, 4 or 8, dividing
// the 8 of a block) share a unit when the units are too few to fill the
// device: warp part p of the unit's ks reads chunks [p*nj/ks, (p+1)*nj/ks)
// of the nj 256-element chunks, parts 1.. leave their sums in shared memory
// and part 0 adds them in part order (a fixed order) and runs the epilogue.
// Blocks are persistent: warp gw takes virtual warps gw, gw + 8 * grid, ...
// of wunits * ks, unit vw / ks and part vw % ks (so a unit's parts are
// consecutive warps of one block). Epilogues as gemv.cu's; for GEMV_HEAD
// (ks 1) each warp keeps its own running softmax statistics over its rows
// and writes them at the end to stats[(t * warps + warp) * 4] (warps = 8 *
// grid).
//
// GEMV_ROPE with tables (the batch's block tables, table_off and bs as
// attention takes them) also prefetches attention's first keys (below).
//
// Dynamic shared memory: gemvfSmem(TT, k) = (TT * k + 32 + 8 * 4 * TT) * 4
// bytes: the activations, 32 floats of scratch, the parts' sums.
#define GEMVF_THREADS 256
#define GEMVF_XB 4
#define GEMVF_KV_PREFETCH 256

#define GEMVF_PARAMS                                                                         \
    const bf16 *__restrict__ w, const float *__restrict__ x, const int *__restrict__ rowmap, \
        const bf16 *__restrict__ g, float eps, int k, int n, int t, int s, int u, int d,     \
        int dn, int wunits, int ks, float *out, int ldo, const bf16 *__restrict__ bias,              \
        const float *__restrict__ inv_freq, const int *__restrict__ pos,                     \
        const int *__restrict__ cache_row, bf16 *kcache, bf16 *vcache, int nh, int nkv,      \
        int hd, float *stats, const int *__restrict__ tables, const int *__restrict__ table_off, int bs
#define GEMVF_ARGS \
    w, x, rowmap, g, eps, k, n, t, s, u, d, dn, wunits, ks, out, ldo, bias, inv_freq, pos, \
        cache_row, kcache, vcache, nh, nkv, hd, stats, tables, table_off, bs

// dot8 adds the products of 8 bf16 weights (4 words) and 8 floats.
__device__ __forceinline__ float dot8(u32x4 wv, const float* xv, float a) {
    a += lo_bf16(wv.x) * xv[0];
    a += hi_bf16(wv.x) * xv[1];
    a += lo_bf16(wv.y) * xv[2];
    a += hi_bf16(wv.y) * xv[3];
    a += lo_bf16(wv.z) * xv[4];
    a += hi_bf16(wv.z) * xv[5];
    a += lo_bf16(wv.w) * xv[6];
    a += hi_bf16(wv.w) * xv[7];
    return a;
}

template <int EPI, int TT>
__device__ __forceinline__ void gemvf_body(GEMVF_PARAMS) {
    constexpr int J = 4;  // 256-element chunks per batch of loads (16 loads in flight)
    extern __shared__ float xs[];  // [TT][k], 32 floats of scratch, [8][4 * TT] sums
    float* scratch = xs + TT * k;
    float* red = scratch + 32;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int warps = gridDim.x * (GEMVF_THREADS / 32);
    const int gw = blockIdx.x * (GEMVF_THREADS / 32) + wid;
    TL_BEGIN
    pdl_trigger();

    // Weight rows of warp unit wu, and whether each is valid.
    auto rows_of = [&](int wu, const bf16** p, bool* ok) {
        int a = (wu / s) * u + (wu % s) * 2;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = a + (e >> 1) * d + (e & 1);
            ok[e] = a + (e & 1) + (e >> 1) * dn < n;
            p[e] = w + (size_t)r * k;
        }
        return a;
    };
    // The chunks of part p: [jb, je).
    const int nj = (k + 255) / 256, vunits = wunits * ks;
    auto chunks_of = [&](int p, int* jb, int* je) {
        *jb = p * nj / ks;
        *je = (p + 1) * nj / ks;
    };
    // The first loads of this warp's first unit, before the wait.
    u32x4 wv[J][4];
    const u32x4 zero = {0, 0, 0, 0};
    if (gw < vunits) {
        const bf16* p[4];
        bool ok[4];
        rows_of(gw / ks, p, ok);
        int jb, je;
        chunks_of(gw % ks, &jb, &je);
#pragma unroll
        for (int j = 0; j < J; j++) {
            int kk = (jb + j) * 256 + lane * 8;
            bool in = jb + j < je && kk < k;
#pragma unroll
            for (int e = 0; e < 4; e++) wv[j][e] = ok[e] && in ? ldg_weights(p[e] + kk) : zero;
        }
    }
    if (EPI == GEMV_ROPE && tables) {
        // Ask L2 for the keys and values of earlier steps that attention
        // copies first (up to GEMVF_KV_PREFETCH keys of each row: the 1B
        // shape's attention_gqa tiles of one round), so that its copies,
        // issued only once this kernel's blocks leave, hit L2. Measured on
        // one H200 (NOTES.md, phase 11): 1B batch 1 0.850 -> 0.844 ms (three
        // calls), 8B unchanged.
        const int lpr = hd / 64;  // 128-byte lines of a key row of one kv head
        const int gt = blockIdx.x * GEMVF_THREADS + tid, nt = gridDim.x * GEMVF_THREADS;
        for (int tt = 0; tt < t; tt++) {
            const int nk = min(pos[tt], GEMVF_KV_PREFETCH);
            const int* tab = tables + table_off[tt];
            for (int i = gt; i < nk * nkv * 2 * lpr; i += nt) {
                const int c = i % lpr, r = i / lpr, kv = r & 1, h = (r >> 1) % nkv, j = (r >> 1) / nkv;
                const bf16* p = (kv ? vcache : kcache) + ((size_t)(tab[j / bs] * bs + j % bs) * nkv + h) * hd + c * 64;
                asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
            }
        }
    }
    const int tok = pdl_wait_token();
    TL_WAIT

    // Stage the activations times the norm weight, and their squares' sums.
    float ss[TT];
#pragma unroll
    for (int tt = 0; tt < TT; tt++) ss[tt] = 0.f;
    if (!g) {
        // No norm (the o and down products): the rows are copied as they
        // are by cp.async, all of a thread's 16-byte pieces in flight at
        // once and no register held (the loads below go GEMVF_XB groups
        // at a time). Measured on one H200 beside the loads (NOTES.md,
        // phase 17): 1B batch 1 0.804 -> 0.796 ms, 8B 4.088 -> 4.050.
        for (int tt = 0; tt < t; tt++) {
            const float* xp = x + (size_t)((rowmap ? rowmap[tt] : tt) + tok) * k;
            for (int i = tid * 4; i < k; i += GEMVF_THREADS * 4) cp_async16(smem_addr(xs + tt * k + i), xp + i, 16);
        }
        cp_async_commit();
        cp_async_wait<0>();
    }
#pragma unroll
    for (int tt = 0; tt < TT; tt++) {
        if (tt >= t || !g) {
            continue;
        }
        int xr = (rowmap ? rowmap[tt] : tt) + tok;
        const float* xp = x + (size_t)xr * k;
        // GEMVF_XB groups of 4 elements a thread at a time, every load of
        // a batch (activations, and 4 norm weights in one) issued first.
        for (int i0 = tid * 4; i0 < k; i0 += GEMVF_THREADS * 4 * GEMVF_XB) {
            float v[GEMVF_XB][4];
            unsigned gv[GEMVF_XB][2];
#pragma unroll
            for (int b = 0; b < GEMVF_XB; b++) {
                const int i = i0 + b * GEMVF_THREADS * 4;
                if (i < k) {
                    asm("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                        : "=f"(v[b][0]), "=f"(v[b][1]), "=f"(v[b][2]), "=f"(v[b][3])
                        : "l"(xp + i));
                    asm("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(gv[b][0]), "=r"(gv[b][1]) : "l"(g + i));
                }
            }
#pragma unroll
            for (int b = 0; b < GEMVF_XB; b++) {
                const int i = i0 + b * GEMVF_THREADS * 4;
                if (i < k) {
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        ss[tt] += v[b][q] * v[b][q];
                        const float gq = (q & 1) ? hi_bf16(gv[b][q >> 1]) : lo_bf16(gv[b][q >> 1]);
                        xs[tt * k + i + q] = v[b][q] * gq;
                    }
                }
            }
        }
    }
    float inv[TT];
#pragma unroll
    for (int tt = 0; tt < TT; tt++) {
        inv[tt] = g ? rsqrtf(block_sum(ss[tt], scratch) / (float)k + eps) : 1.f;
    }
    __syncthreads();
    TL_MARK

    float hm[TT], hs[TT];  // GEMV_HEAD: running maximum and sum of this warp
    int hi[TT], hbad = 0;
#pragma unroll
    for (int tt = 0; tt < TT; tt++) {
        hm[tt] = NEG_INF;
        hs[tt] = 0.f;
        hi[tt] = 0x7fffffff;
    }
    bool first = true;
    for (int vw = gw; vw < vunits; vw += warps) {
        const bf16* p[4];
        bool ok[4];
        const int a = rows_of(vw / ks, p, ok), part = vw % ks;
        int jb, je;
        chunks_of(part, &jb, &je);
        float acc[4][TT];
#pragma unroll
        for (int e = 0; e < 4; e++)
#pragma unroll
            for (int tt = 0; tt < TT; tt++) acc[e][tt] = 0.f;
        // GEMV_RESID: the residual value this lane's epilogue adds to, read
        // now so that its round trip is not the unit's last.
        float rv = 0.f;
        if (EPI == GEMV_RESID && part == 0 && lane < 4 * TT) {
            const int e = lane / TT, tt = lane % TT;
            if (ok[e] && tt < t) {
                rv = ldcg(out + (size_t)tt * ldo + a + (e >> 1) * d + (e & 1));
            }
        }
        for (int j0 = jb; j0 < je; j0 += J) {
            if (!first) {
#pragma unroll
                for (int j = 0; j < J; j++) {
                    int kk = (j0 + j) * 256 + lane * 8;
                    bool in = j0 + j < je && kk < k;
#pragma unroll
                    for (int e = 0; e < 4; e++) wv[j][e] = ok[e] && in ? ldg_weights(p[e] + kk) : zero;
                }
            }
            first = false;
#pragma unroll
            for (int j = 0; j < J; j++) {
                int kk = (j0 + j) * 256 + lane * 8;
                if (j0 + j < je && kk < k) {
#pragma unroll
                    for (int tt = 0; tt < TT; tt++) {
                        const float* xv = xs + tt * k + kk;
                        float xr[8];
#pragma unroll
                        for (int i = 0; i < 8; i++) xr[i] = xv[i];
#pragma unroll
                        for (int e = 0; e < 4; e++) acc[e][tt] = dot8(wv[j][e], xr, acc[e][tt]);
                    }
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 4; e++)
#pragma unroll
            for (int tt = 0; tt < TT; tt++) acc[e][tt] = warp_sum(acc[e][tt]);
        if (ks > 1) {
            // The unit's parts meet at a named barrier of their own (ids
            // 1..8; 0 is __syncthreads'): parts 1.. leave their sums, part 0
            // adds them, and the second barrier frees the sums for reuse.
            const int bar = 1 + wid / ks, nthreads = 32 * ks;
            if (part != 0 && lane == 0) {
#pragma unroll
                for (int e = 0; e < 4; e++)
#pragma unroll
                    for (int tt = 0; tt < TT; tt++) red[(wid * 4 + e) * TT + tt] = acc[e][tt];
            }
            asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(nthreads) : "memory");
            if (part == 0) {
                for (int q = 1; q < ks; q++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
#pragma unroll
                        for (int tt = 0; tt < TT; tt++) acc[e][tt] += red[((wid + q) * 4 + e) * TT + tt];
            }
            asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(nthreads) : "memory");
            if (part != 0) {
                continue;
            }
        }
#pragma unroll
        for (int e = 0; e < 4; e++)
#pragma unroll
            for (int tt = 0; tt < TT; tt++) acc[e][tt] *= inv[tt];
        // Epilogue: lane l takes value (e, tt) = (l / TT, l % TT).
        if (EPI == GEMV_STORE || EPI == GEMV_HEAD || EPI == GEMV_RESID) {
            if (lane < 4 * TT) {
                int e = lane / TT, tt = lane % TT;
                float v = 0.f;
#pragma unroll
                for (int e2 = 0; e2 < 4; e2++)
#pragma unroll
                    for (int t2 = 0; t2 < TT; t2++)
                        if (e2 == e && t2 == tt) v = acc[e2][t2];
                int row = a + (e >> 1) * d + (e & 1);
                if (ok[e] && tt < t) {
                    float* o = out + (size_t)tt * ldo + row;
                    *o = EPI == GEMV_RESID ? rv + v : v;
                }
            }
        } else if (lane < 2 * TT) {
            int e = lane / TT, tt = lane % TT;
            float v1 = 0.f, v2 = 0.f;
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++)
#pragma unroll
                for (int t2 = 0; t2 < TT; t2++)
                    if (e2 == e && t2 == tt) {
                        v1 = acc[e2][t2];
                        v2 = acc[e2 + 2][t2];
                    }
            if (ok[e] && tt < t) {
                if (EPI == GEMV_SILU) {
                    out[(size_t)tt * ldo + a + e] = v1 / (1.f + expf(-v1)) * v2;
                } else {  // GEMV_ROPE: rows r and r + half of head hh
                    int row = a + e, half = hd >> 1;
                    int hh = row / hd, i = row % hd;
                    if (bias) {
                        v1 += bf2f(bias[row]);
                        v2 += bf2f(bias[row + half]);
                    }
                    if (hh < nh + nkv) {
                        rope_rotate(v1, v2, pos[tt], inv_freq[i]);
                    }
                    if (hh < nh) {
                        out[(size_t)tt * ldo + row] = v1;
                        out[(size_t)tt * ldo + row + half] = v2;
                    } else {
                        int kvh = hh < nh + nkv ? hh - nh : hh - nh - nkv;
                        bf16* cache = hh < nh + nkv ? kcache : vcache;
                        size_t dst = ((size_t)cache_row[tt] * nkv + kvh) * hd + i;
                        cache[dst] = f2bf(v1);
                        cache[dst + half] = f2bf(v2);
                    }
                }
            }
        }
        if (EPI == GEMV_HEAD) {
            // Every lane holds every value: all keep the same statistics.
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = a + (e >> 1) * d + (e & 1);
                if (!ok[e]) {
                    continue;
                }
#pragma unroll
                for (int tt = 0; tt < TT; tt++) {
                    float v = acc[e][tt];
                    hbad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
                    if (better(v, row, hm[tt], hi[tt])) {
                        hs[tt] = hm[tt] == NEG_INF ? hs[tt] : hs[tt] * expf(hm[tt] - v);
                        hm[tt] = v;
                        hi[tt] = row;
                    }
                    hs[tt] += expf(v - hm[tt]);
                }
            }
        }
    }
    if (EPI == GEMV_HEAD && lane == 0) {
#pragma unroll
        for (int tt = 0; tt < TT; tt++) {
            if (tt < t) {
                float* st = stats + ((size_t)tt * warps + gw) * 4;
                st[0] = hm[tt];
                st[1] = __int_as_float(hi[tt]);
                st[2] = hs[tt];
                st[3] = __int_as_float(hbad);
            }
        }
    }
    TL_END(TL_GEMVF + EPI)
}

#define GEMVF_ENTRY(name, epi, tt)                                                       \
    extern "C" __global__ void __launch_bounds__(GEMVF_THREADS, 2) name(GEMVF_PARAMS) { \
        gemvf_body<epi, tt>(GEMVF_ARGS);                                                 \
    }

GEMVF_ENTRY(gemvf_head_t1, GEMV_HEAD, 1)
GEMVF_ENTRY(gemvf_head_t2, GEMV_HEAD, 2)
GEMVF_ENTRY(gemvf_resid_t1, GEMV_RESID, 1)
GEMVF_ENTRY(gemvf_resid_t2, GEMV_RESID, 2)
GEMVF_ENTRY(gemvf_silu_t1, GEMV_SILU, 1)
GEMVF_ENTRY(gemvf_silu_t2, GEMV_SILU, 2)
GEMVF_ENTRY(gemvf_rope_t1, GEMV_ROPE, 1)
GEMVF_ENTRY(gemvf_rope_t2, GEMV_ROPE, 2)
