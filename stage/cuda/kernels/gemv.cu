// gemv_*: the layer and LM-head products of steps with few token rows
// ("skinny" GEMMs, T <= 8 * NT tokens), on the tensor cores, bound by the
// weight reads. For token column t and weight row n of a bf16 weight W
// [rows][k] (Hugging Face [out, in], row-major):
//
//   v[t][n] = inv[t] * sum_k xt[t][k] * W[n][k],   xt[t][k] = x[xr][k] * g[k]
//
// with x fp32 activations (xr = rowmap ? rowmap[t] : t), g an RMSNorm weight
// (null: 1) and inv[t] = rsqrt(mean_k x[xr][k]^2 + eps) when g is given (the
// norm is folded into the product: the statistic is gathered from the same
// loads), else 1. xt is split into its bf16 rounding and the bf16 rounding
// of the remainder, and both are multiplied (two tensor-core products into
// one fp32 accumulator), so the activations carry about 16 significant bits,
// as the compensated cuBLAS path's do; the accumulation is fp32.
//
// Work split: a unit of MT tiles of 16 weight rows is computed by one block
// of 8 warps for every token column; its warps split k (warp w takes the
// 32-wide k-blocks w, w+8, ...) and their partial sums are added in shared
// memory in a fixed order, so results do not depend on timing. Blocks are
// persistent (as many as fit on the device, each taking units b, b + grid,
// ...) and software-pipelined: each warp loads the weights of its next
// group of k-blocks while it multiplies the current one and while the
// block runs a unit's epilogue, so the weight stream never stops. Weights
// are read once, 16 bytes per load, bypassing L1. On the
// tensor cores the weights are the A operand (m16, k16) and the token
// columns the B operand (n8); within a 32-wide k-block, thread (g, q) of a
// warp loads the 8 consecutive elements k0+8q..k0+8q+7 of its rows (g and
// g+8) and of its token column g, and each mma step s takes elements
// 4s..4s+3 of those: a permutation of k applied alike to A and B, which a
// dot product does not see.
//
// Row mapping: local tile l of block b, row r in [0,16) is segment row
//   rs = (b / s) * u + (b % s) * 16 * mh + (l % mh) * 16 + r
// of segment l / mh (b the unit, in [0, units)), whose first row is
// (l / mh) * seg: one formula for
// plain row ranges (s 1, u 16*MT, mh MT), the gate and up halves of a fused
// gate|up weight (mh MT/2, seg the intermediate size), and rotary pairs of a
// q|k|v weight (s hd/32, u hd, mh 1, seg hd/2: tiles j and j + hd/32 of a
// head). Rows with rs >= n are neither read nor written.
//
// Epilogues (EPI):
//   GEMV_STORE  out[t * ldo + row] = v
//   GEMV_HEAD   as STORE, and per (t, unit) the unit's (max, argmax,
//               sum exp(v - max), non-finite flag) in stats[(t * units + b) * 4]
//   GEMV_RESID  out[t * ldo + row] += v (the residual stream)
//   GEMV_SILU   out[t * ldo + rs] = silu(v_gate) * v_up
//   GEMV_ROPE   q|k|v with bias, rotary embedding and the KV cache write, as
//               rope_qkv does: q to out (fp32, ldo = q width), k and v to the
//               cache row cache_row[t]; a row's rotary partner is pdelta local
//               rows on.
//
// Every gemv kernel is launched with GEMV_THREADS threads, at most
// min(units, SMs * its GEMV_ENTRY minimum of resident blocks) blocks, and
// gemv_smem(MT, NT) bytes of dynamic shared memory; it may be launched as a
// programmatic dependent (it reads only weights before griddepcontrol.wait).
#define GEMV_THREADS 256
#define GEMV_WARPS 8

#define GEMV_STORE 0
#define GEMV_HEAD 1
#define GEMV_RESID 2
#define GEMV_SILU 3
#define GEMV_ROPE 4

struct u32x4 {
    unsigned x, y, z, w;
};

// ldg_weights loads 16 bytes that no kernel writes, keeping them out of L1
// and fetching 128 bytes into L2 at a time. The 256-byte hint streams the
// same bytes slower: measured on one H200 beside it (NOTES.md, phase 17),
// the batch-1 step 0.820 -> 0.803 ms (1B) and 4.176 -> 4.081 ms (8B); the
// 64-byte hint and none at all were level with 128 (0.802-0.805 ms, 1B).
__device__ __forceinline__ u32x4 ldg_weights(const bf16* p) {
    u32x4 r;
    asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// staged_row is the row of x that staged row r holds (gemvs.cu, gemvg.cu):
// the t tokens' rows from row 0 and, with lo, their remainders (x's rows
// lo on) from row half on; -1: none (zeros).
__device__ __forceinline__ int staged_row(int r, int t, int lo, int half) {
    return r < t ? r : (lo && r >= half && r - half < t ? r - half + lo : -1);
}

// mma_staged multiplies J 32-k chunks of A fragments (wring_mma's: k
// permuted within each chunk, 8 c .. 8 c + 7 a lane) from kc on with every n-tile's
// B fragments, the same k of staged rows g + 8 nt in shared memory (blane:
// the lane's row g at its 8 c; rows stride bf16 apart, their 16-byte
// chunks swizzled as stage_cols lays them: so chunk j of an odd row is
// read at j ^ 1; kc a multiple of 64, J even), into acc[nt].
template <int NT, int J>
__device__ __forceinline__ void mma_staged(float (&acc)[NT][4], const u32x4 (&a)[J][2], unsigned blane, int stride,
                                           int kc) {
    const int odd = (threadIdx.x >> 2) & 1;  // the parity of the lane's row g
#pragma unroll
    for (int j = 0; j < J; j++) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            unsigned b[4];
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                         : "r"(blane + (unsigned)((nt * 8 * stride + kc + 32 * (j ^ odd)) * 2)));
            mma_bf16(acc[nt], a[j][0].x, a[j][1].x, a[j][0].y, a[j][1].y, b[0], b[1]);
            mma_bf16(acc[nt], a[j][0].z, a[j][1].z, a[j][0].w, a[j][1].w, b[2], b[3]);
        }
    }
}

// A warp's weight ring (gemvs.cu, gemvg.cu): the warp's 16 weight rows
// (rows 0-7 from r0, rows 8-15 from r1, each k elements from the previous)
// stream through WRING_STAGES stages of WRING_KS k in shared memory by
// cp.async, WRING_STAGES - 1 stages ahead of the one being multiplied, so
// that the warp's loads never wait on its multiplies (weights in register
// sets stop being loaded while a set is multiplied, and a lane's registers
// hold at most a few KB in flight: phase 20 in NOTES.md). A stage is 16
// rows of 128 bytes, 16-byte chunk ch of row r at chunk ch ^ 4 (r & 1), so
// that a quarter warp's reads of rows g and g + 1 fall in distinct banks.
// WRING_BYTES a warp.
#define WRING_STAGES 6
#define WRING_KS 64
#define WRING_BYTES (WRING_STAGES * 16 * WRING_KS * 2)

// stage_cols starts copying columns c0 .. c1 - 1 of the NT * 8 staged rows
// of x (staged_row's, from column k0 of x's rows of k; a row of none
// zero-filled) into shared memory at sbase, rows stride bf16 apart, by
// cp.async from the block's THREADS threads, as one group. Rows lie
// unpadded (stride a multiple of 64), 16-byte chunk ch of row r at chunk
// ch ^ 4 (r & 1), so that a quarter warp's reads of rows g and g + 1 fall
// in distinct banks (mma_staged), as the weight ring's do: 2 KB less at
// 32 rows than the 64 bf16 of padding a row they had (phase 22 in
// NOTES.md; residency is now the host's choice, gemvsLaunchSmem and
// gemvgLaunchSmem).
template <int NT, int THREADS>
__device__ __forceinline__ void stage_cols(unsigned sbase, const bf16* x, int k, int k0, int c0, int c1, int stride,
                                           int t, int lo) {
    const int cpr = (c1 - c0) / 8;  // 16-byte chunks of a staged row
    for (int e = threadIdx.x; e < NT * 8 * cpr; e += THREADS) {
        const int r = e / cpr, col = c0 + e % cpr * 8;
        const int xr = staged_row(r, t, lo, NT * 4);
        const unsigned dst = sbase + (unsigned)((r * stride + (col ^ ((r & 1) << 5))) * 2);
        cp_async16(dst, xr >= 0 ? x + (size_t)xr * k + k0 + col : x, xr >= 0 ? 16 : 0);
    }
    cp_async_commit();
}

// stage_rows stages the block's kb columns of x (stage_cols; gemvs.cu,
// gemvg.cu) in two groups, a first part of ka columns (at least the
// WRING_STAGES - 2 stages wring_mma's waits complete the second group by,
// a quarter of kb where that is more) and the rest, waits for the first,
// and returns the ring stage before which the block must meet for the rest
// (wring_mma's sync; past the last stage when there is no rest): so that
// the multiplies, and with them the ring's refills, start once the first
// part is in.
template <int NT, int THREADS, bool SPLIT>
__device__ __forceinline__ int stage_rows(unsigned sbase, const bf16* x, int k, int k0, int kb, int stride, int t,
                                          int lo) {
    const int ka = SPLIT ? min(kb, max(WRING_KS * (WRING_STAGES - 2), kb / 4 / WRING_KS * WRING_KS)) : kb;
    stage_cols<NT, THREADS>(sbase, x, k, k0, 0, ka, stride, t, lo);
    stage_cols<NT, THREADS>(sbase, x, k, k0, ka, kb, stride, t, lo);
    cp_async_wait<1>();
    __syncthreads();
    return ka / WRING_KS;
}

// wring_copy starts the lane's part of copying k from kst * WRING_KS on of
// the warp's 16 weight rows (r0, r1) into ring slot slot.
__device__ __forceinline__ void wring_copy(unsigned ring, const bf16* r0, const bf16* r1, int k, int kst, int slot,
                                           int lane) {
    const unsigned dst = ring + (unsigned)(slot * (16 * WRING_KS * 2));
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int r = (lane >> 3) + 4 * j, ch = lane & 7;
        const bf16* src = (j < 2 ? r0 + (size_t)r * k : r1 + (size_t)(r - 8) * k) + kst * WRING_KS + ch * 8;
        cp_async16(dst + (unsigned)(r * 128 + (ch ^ ((r & 1) << 2)) * 16), src, 16);
    }
}

// wring_issue starts the lane's part of stage st (k from st * WRING_KS on)
// into its slot, unless st >= nst, and commits a cp.async group either way,
// so that every lane counts the same groups.
__device__ __forceinline__ void wring_issue(unsigned ring, const bf16* r0, const bf16* r1, int k, int st, int nst,
                                            int lane) {
    if (st < nst) {
        wring_copy(ring, r0, r1, k, st, st % WRING_STAGES, lane);
    }
    cp_async_commit();
}

// wring_prime starts the dependent launch's successor, issues the ring's
// first WRING_STAGES - 1 stages (weights no kernel of the step writes) and
// then waits for the kernels ahead (griddepcontrol.wait): the prologue of
// gemvs.cu and gemvg.cu, whose loads so overlap the kernel before them.
__device__ __forceinline__ void wring_prime(unsigned ring, const bf16* r0, const bf16* r1, int k, int nst, int lane) {
    pdl_trigger();
#pragma unroll
    for (int st = 0; st < WRING_STAGES - 1; st++) {
        wring_issue(ring, r0, r1, k, st, nst, lane);
    }
    pdl_wait();
}

// wring_frags loads the lane's A fragments of ring slot slot (arow: the
// ring at the lane's row g): rows g and g + 8 (same parity), k 32 j + 8 c
// .. + 7 of each 32-k chunk j, as mma_staged takes them.
__device__ __forceinline__ void wring_frags(u32x4 (&a)[WRING_KS / 32][2], unsigned arow, int slot, int g, int c) {
    const unsigned as = arow + (unsigned)(slot * (16 * WRING_KS * 2));
#pragma unroll
    for (int j = 0; j < WRING_KS / 32; j++) {
        const unsigned off = (unsigned)(((4 * j + c) ^ ((g & 1) << 2)) * 16);
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(a[j][0].x), "=r"(a[j][0].y), "=r"(a[j][0].z), "=r"(a[j][0].w)
                     : "r"(as + off));
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(a[j][1].x), "=r"(a[j][1].y), "=r"(a[j][1].z), "=r"(a[j][1].w)
                     : "r"(as + 8 * 128 + off));
    }
}

// wring_mma multiplies the nst stages of the ring with every n-tile of the
// staged rows (mma_staged: blane, stride; stage st at staged k st *
// WRING_KS), refilling each slot as it is freed. The caller has issued
// stages 0 .. WRING_STAGES - 2 and then its staged rows' groups, and waited
// for those up to stage sync; the block meets before stage sync (at least
// WRING_STAGES - 2, by when each thread's wait has completed every group
// before its own refills).
template <int NT>
__device__ __forceinline__ void wring_mma(float (&acc)[NT][4], unsigned ring, const bf16* r0, const bf16* r1, int k,
                                          int nst, unsigned blane, int stride, int lane, int sync) {
    const int g = lane >> 2, c = lane & 3;
    const unsigned arow = ring + (unsigned)(g * 128);
#pragma unroll 1
    for (int st = 0; st < nst; st++) {
        // Stage st is in for this lane; __syncwarp makes the others' visible.
        cp_async_wait<WRING_STAGES - 2>();
        if (st == sync) {
            __syncthreads();  // every thread's rest of the staged rows is in
        } else {
            __syncwarp();
        }
        u32x4 a[WRING_KS / 32][2];
        wring_frags(a, arow, st % WRING_STAGES, g, c);
        // Slot st - 1's reads are a whole iteration behind; refill it.
        wring_issue(ring, r0, r1, k, st + WRING_STAGES - 1, nst, lane);
        mma_staged<NT, WRING_KS / 32>(acc, a, blane, stride, st * WRING_KS);
    }
}

// ldg_const loads 16 bytes that no kernel writes (norm weights).
__device__ __forceinline__ u32x4 ldg_const(const bf16* p) {
    u32x4 r;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// ldg_act8 loads 8 consecutive floats (32-byte aligned) that an earlier
// kernel wrote, from L2 (not L1, which may hold lines of an earlier step).
// Not volatile, so that the compiler may issue the loads of several
// k-blocks at once: the address must depend on pdl_wait_token to stay
// after the wait.
__device__ __forceinline__ void ldg_act8(const float* p, float* v) {
    asm("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
        : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
        : "l"(p));
    asm("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
        : "=f"(v[4]), "=f"(v[5]), "=f"(v[6]), "=f"(v[7])
        : "l"(p + 4));
}

// pdl_wait_token is pdl_wait returning 0 in a way the compiler cannot see
// through: adding it to an address orders a non-volatile load after the
// wait.
__device__ __forceinline__ int pdl_wait_token() {
    int z;
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n\tmov.u32 %0, 0;" : "=r"(z) : : "memory");
#else
    asm volatile("mov.u32 %0, 0;" : "=r"(z) : : "memory");
#endif
    return z;
}

#define GEMV_PARAMS                                                                          \
    const bf16 *__restrict__ w, const float *__restrict__ x, const int *__restrict__ rowmap, \
        const bf16 *__restrict__ g, float eps, int k, int n, int t, int s, int u, int mh,    \
        int seg, int units, float *out, int ldo, const bf16 *__restrict__ bias,              \
        const float *__restrict__ inv_freq, const int *__restrict__ pos,                     \
        const int *__restrict__ cache_row, bf16 *kcache, bf16 *vcache, int nh, int nkv,      \
        int hd, int pdelta, float *stats
#define GEMV_ARGS \
    w, x, rowmap, g, eps, k, n, t, s, u, mh, seg, units, out, ldo, bias, inv_freq, pos, \
        cache_row, kcache, vcache, nh, nkv, hd, pdelta, stats

// Gemv is one gemv launch's parameters and the per-thread state of its
// software pipeline. A block works through units (blocks of MT tiles)
// blockIdx.x, blockIdx.x + gridDim.x, ...; each warp through groups of U
// k-blocks of each unit; every warp has the same number of groups per unit
// (empty ones at the end of a short k range), so that the block-wide
// epilogue after a unit's last group finds every warp there. The weights of
// the next group are loaded while the current one is multiplied and while a
// unit's epilogue runs.
template <int EPI, int MT, int NT>
struct Gemv {
    static constexpr int U = 4 / MT;  // k-blocks per group
    static constexpr int R = MT * 16, C = NT * 8;
    const bf16* __restrict__ w;
    const float* __restrict__ x;
    const int* __restrict__ rowmap;
    const bf16* __restrict__ g;
    float eps;
    int k, n, t, s, u, mh, seg, units;
    float* out;
    int ldo;
    const bf16* __restrict__ bias;
    const float* __restrict__ inv_freq;
    const int* __restrict__ pos;
    const int* __restrict__ cache_row;
    bf16 *kcache, *vcache;
    int nh, nkv, hd, pdelta;
    float* stats;

    int lane, wid, gq, tq, kbn, ng, tok;
    float acc[MT][NT][4];
    float ssq[NT];

    // unit and group of step q of this block, and the unit's first row.
    __device__ __forceinline__ int unit_of(int q) const { return blockIdx.x + (q / ng) * gridDim.x; }
    __device__ __forceinline__ int base_of(int un) const { return (un / s) * u + (un % s) * 16 * mh; }
    __device__ __forceinline__ int kblock(int q, int jj) const {
        return wid + GEMV_WARPS * ((q % ng) * U + jj);
    }

    // load issues the weight loads of step q into buf.
    __device__ __forceinline__ void load(u32x4 (&buf)[U][MT][2], int q) const {
        const int base = base_of(unit_of(q));
        const u32x4 zero = {0, 0, 0, 0};
#pragma unroll
        for (int l = 0; l < MT; l++) {
            int rs = base + (l % mh) * 16 + gq;
            const bf16* p = w + ((size_t)((l / mh) * seg) + rs) * k;
#pragma unroll
            for (int jj = 0; jj < U; jj++) {
                int kb = kblock(q, jj);
                int kk = kb * 32 + tq * 8;
                bool ok = kb < kbn && kk < k;
                buf[jj][l][0] = ok && rs < n ? ldg_weights(p + kk) : zero;
                buf[jj][l][1] = ok && rs + 8 < n ? ldg_weights(p + (size_t)8 * k + kk) : zero;
            }
        }
    }

    // step multiplies the weights of step q (in buf) with the activations
    // and, after a unit's last group, runs the unit's epilogue.
    __device__ __forceinline__ void step(const u32x4 (&buf)[U][MT][2], int q, float* red) {
#pragma unroll
        for (int jj = 0; jj < U; jj++) {
            int kb = kblock(q, jj);
            int kk = kb * 32 + tq * 8;
            if (kb >= kbn) {
                continue;  // uniform across the warp: the mma below is warp-wide
            }
#pragma unroll
            for (int c = 0; c < NT; c++) {
                int col = c * 8 + gq;
                float v[8];
                if (col < t && kk < k) {
                    int xr = (rowmap ? rowmap[col] : col) + tok;
                    ldg_act8(x + (size_t)xr * k + kk, v);
                    if (g) {
                        u32x4 gv = ldg_const(g + kk);
                        unsigned gw[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
                        for (int i = 0; i < 8; i++) {
                            ssq[c] += v[i] * v[i];
                            v[i] *= (i & 1) ? hi_bf16(gw[i >> 1]) : lo_bf16(gw[i >> 1]);
                        }
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++) v[i] = 0.f;
                }
                unsigned bh[4], bl[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    bh[i] = pack_bf16(v[2 * i], v[2 * i + 1]);
                    bl[i] = pack_bf16(v[2 * i] - lo_bf16(bh[i]), v[2 * i + 1] - hi_bf16(bh[i]));
                }
#pragma unroll
                for (int l = 0; l < MT; l++) {
                    const u32x4 a = buf[jj][l][0], a8 = buf[jj][l][1];
                    mma_bf16(acc[l][c], a.x, a8.x, a.y, a8.y, bh[0], bh[1]);
                    mma_bf16(acc[l][c], a.x, a8.x, a.y, a8.y, bl[0], bl[1]);
                    mma_bf16(acc[l][c], a.z, a8.z, a.w, a8.w, bh[2], bh[3]);
                    mma_bf16(acc[l][c], a.z, a8.z, a.w, a8.w, bl[2], bl[3]);
                }
            }
        }
        if (q % ng == ng - 1) {
            epilogue(unit_of(q), red);
        }
    }

    // epilogue sums the warps' partials of unit un in a fixed order,
    // applies the norm and writes the outputs; then clears the partials.
    __device__ __forceinline__ void epilogue(int un, float* red) {
        float* sq = red + GEMV_WARPS * R * C;  // [GEMV_WARPS][C]
        float* invs = sq + GEMV_WARPS * C;     // [C]
        const int tid = threadIdx.x;
#pragma unroll
        for (int l = 0; l < MT; l++)
#pragma unroll
            for (int c = 0; c < NT; c++) {
                float* r0 = red + (wid * R + l * 16 + gq) * C + c * 8 + 2 * tq;
                r0[0] = acc[l][c][0];
                r0[1] = acc[l][c][1];
                r0[8 * C] = acc[l][c][2];
                r0[8 * C + 1] = acc[l][c][3];
#pragma unroll
                for (int i = 0; i < 4; i++) acc[l][c][i] = 0.f;
            }
#pragma unroll
        for (int c = 0; c < NT; c++) {
            float v = ssq[c];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (tq == 0) {
                sq[wid * C + c * 8 + gq] = v;
            }
            ssq[c] = 0.f;
        }
        __syncthreads();
        for (int e = tid; e < R * C; e += GEMV_THREADS) {
            float v = red[e];
#pragma unroll
            for (int ww = 1; ww < GEMV_WARPS; ww++) v += red[ww * R * C + e];
            red[e] = v;
        }
        if (tid < C) {
            float inv = 1.f;
            if (g) {
                float v = 0.f;
#pragma unroll
                for (int ww = 0; ww < GEMV_WARPS; ww++) v += sq[ww * C + tid];
                inv = rsqrtf(v / (float)k + eps);
            }
            invs[tid] = inv;
        }
        __syncthreads();
        emit(red, invs, un, tid, GEMV_THREADS, wid, GEMV_WARPS);
        __syncthreads();  // red is free for the next unit
    }

    // emit applies the epilogue to unit un's sums: red[rl * C + col] for
    // local row rl (tile rl / 16, row rl % 16) and token column col, scaled
    // by invs[col]. Threads first, first + step, ... of the caller share
    // the rows' outputs, and warps wfirst, wfirst + wstep, ... the token
    // columns' softmax statistics (GEMV_HEAD; lane is the thread's lane).
    __device__ __forceinline__ void emit(const float* red, const float* invs, int un, int first, int step,
                                         int wfirst, int wstep) {
        const int base = base_of(un);
        // fin[rl][col] = red[rl * C + col], rl the local row (tile rl / 16,
        // row rl % 16), rows fastest so that stores coalesce.
        for (int e = first; e < R * t && e < R * C; e += step) {
            int rl = e % R, col = e / R;
            int l = rl >> 4;
            int rs = base + (l % mh) * 16 + (rl & 15);
            if (rs >= n) {
                continue;
            }
            int row = (l / mh) * seg + rs;
            float v = red[rl * C + col] * invs[col];
            if (EPI == GEMV_STORE || EPI == GEMV_HEAD) {
                out[(size_t)col * ldo + row] = v;
            } else if (EPI == GEMV_RESID) {
                float* o = out + (size_t)col * ldo + row;
                *o = ldcg(o) + v;
            } else if (EPI == GEMV_SILU) {
                if (l < mh) {
                    float up = red[(rl + mh * 16) * C + col] * invs[col];
                    out[(size_t)col * ldo + rs] = v / (1.f + expf(-v)) * up;
                }
            } else if (EPI == GEMV_ROPE) {
                int half = hd >> 1;
                int hh = row / hd, i = row % hd;
                if (i >= half) {
                    continue;
                }
                float x1 = v, x2 = red[(rl + pdelta) * C + col] * invs[col];
                if (bias) {
                    x1 += bf2f(bias[row]);
                    x2 += bf2f(bias[row + half]);
                }
                if (hh < nh + nkv) {
                    rope_rotate(x1, x2, pos[col], inv_freq[i]);
                }
                if (hh < nh) {
                    out[(size_t)col * ldo + row] = x1;
                    out[(size_t)col * ldo + row + half] = x2;
                } else {
                    int kvh = hh < nh + nkv ? hh - nh : hh - nh - nkv;
                    bf16* cache = hh < nh + nkv ? kcache : vcache;
                    size_t dst = ((size_t)cache_row[col] * nkv + kvh) * hd + i;
                    cache[dst] = f2bf(x1);
                    cache[dst + half] = f2bf(x2);
                }
            }
        }
        if (EPI == GEMV_HEAD) {
            // Per token column, this unit's share of the softmax statistics.
            for (int col = wfirst; col < t && col < C; col += wstep) {
                float bv = NEG_INF, sum = 0.f;
                int bi = 0x7fffffff, bad = 0;
                for (int rl = lane; rl < R; rl += 32) {
                    int l = rl >> 4;
                    int rs = base + (l % mh) * 16 + (rl & 15);
                    if (rs < n) {
                        float v = red[rl * C + col] * invs[col];
                        bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
                        if (better(v, rs, bv, bi)) {
                            bv = v;
                            bi = rs;
                        }
                    }
                }
                for (int o = 16; o > 0; o >>= 1) {
                    float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                    int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                    if (better(ov, oi, bv, bi)) {
                        bv = ov;
                        bi = oi;
                    }
                    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
                }
                for (int rl = lane; rl < R; rl += 32) {
                    int l = rl >> 4;
                    int rs = base + (l % mh) * 16 + (rl & 15);
                    if (rs < n) {
                        sum += expf(red[rl * C + col] * invs[col] - bv);
                    }
                }
                sum = warp_sum(sum);
                if (lane == 0) {
                    float* st = stats + ((size_t)col * units + un) * 4;
                    st[0] = bv;
                    st[1] = __int_as_float(bi);
                    st[2] = sum;
                    st[3] = __int_as_float(bad);
                }
            }
        }
    }
};

template <int EPI, int MT, int NT>
__device__ __forceinline__ void gemv_body(GEMV_PARAMS) {
    extern __shared__ float gsm[];
    pdl_trigger();
    Gemv<EPI, MT, NT> m{w, x, rowmap, g, eps, k, n, t, s, u, mh, seg, units, out, ldo, bias,
                        inv_freq, pos, cache_row, kcache, vcache, nh, nkv, hd, pdelta, stats};
    const int lane = threadIdx.x & 31;
    m.lane = lane;
    m.wid = threadIdx.x >> 5;
    m.gq = lane >> 2;
    m.tq = lane & 3;
    m.kbn = (k + 31) >> 5;
    const int kpw = (m.kbn + GEMV_WARPS - 1) / GEMV_WARPS;  // k-blocks per warp, at most
    m.ng = (kpw + Gemv<EPI, MT, NT>::U - 1) / Gemv<EPI, MT, NT>::U;
#pragma unroll
    for (int l = 0; l < MT; l++)
#pragma unroll
        for (int c = 0; c < NT; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) m.acc[l][c][i] = 0.f;
#pragma unroll
    for (int c = 0; c < NT; c++) m.ssq[c] = 0.f;
    const int myunits = blockIdx.x < units ? (units - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int nq = myunits * m.ng;
    u32x4 wa[Gemv<EPI, MT, NT>::U][MT][2], wb[Gemv<EPI, MT, NT>::U][MT][2];
    if (nq > 0) {
        m.load(wa, 0);  // weights only, before the wait
    }
    m.tok = pdl_wait_token();
    for (int q = 0; q < nq; q += 2) {
        if (q + 1 < nq) {
            m.load(wb, q + 1);
        }
        m.step(wa, q, gsm);
        if (q + 1 >= nq) {
            break;
        }
        if (q + 2 < nq) {
            m.load(wa, q + 2);
        }
        m.step(wb, q + 1, gsm);
    }
}

#define GEMV_ENTRY(name, epi, mt, nt, minb)                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, minb) name(GEMV_PARAMS) { \
        gemv_body<epi, mt, nt>(GEMV_ARGS);                                                  \
    }

GEMV_ENTRY(gemv_store_m4_n1, GEMV_STORE, 4, 1, 1)
GEMV_ENTRY(gemv_store_m4_n2, GEMV_STORE, 4, 2, 1)
GEMV_ENTRY(gemv_store_m4_n4, GEMV_STORE, 4, 4, 1)
GEMV_ENTRY(gemv_head_m4_n1, GEMV_HEAD, 4, 1, 1)
GEMV_ENTRY(gemv_head_m4_n2, GEMV_HEAD, 4, 2, 1)
GEMV_ENTRY(gemv_head_m4_n4, GEMV_HEAD, 4, 4, 1)
GEMV_ENTRY(gemv_resid_m1_n1, GEMV_RESID, 1, 1, 2)
GEMV_ENTRY(gemv_resid_m1_n2, GEMV_RESID, 1, 2, 2)
GEMV_ENTRY(gemv_resid_m1_n4, GEMV_RESID, 1, 4, 2)
GEMV_ENTRY(gemv_resid_m2_n1, GEMV_RESID, 2, 1, 2)
GEMV_ENTRY(gemv_resid_m2_n2, GEMV_RESID, 2, 2, 2)
GEMV_ENTRY(gemv_resid_m2_n4, GEMV_RESID, 2, 4, 1)
GEMV_ENTRY(gemv_silu_m2_n1, GEMV_SILU, 2, 1, 2)
GEMV_ENTRY(gemv_silu_m2_n2, GEMV_SILU, 2, 2, 2)
GEMV_ENTRY(gemv_silu_m2_n4, GEMV_SILU, 2, 4, 1)
GEMV_ENTRY(gemv_silu_m4_n1, GEMV_SILU, 4, 1, 1)
GEMV_ENTRY(gemv_silu_m4_n2, GEMV_SILU, 4, 2, 1)
GEMV_ENTRY(gemv_silu_m4_n4, GEMV_SILU, 4, 4, 1)
GEMV_ENTRY(gemv_rope_m1_n1, GEMV_ROPE, 1, 1, 2)
GEMV_ENTRY(gemv_rope_m1_n2, GEMV_ROPE, 1, 2, 2)
GEMV_ENTRY(gemv_rope_m1_n4, GEMV_ROPE, 1, 4, 2)
GEMV_ENTRY(gemv_rope_m2_n1, GEMV_ROPE, 2, 1, 2)
GEMV_ENTRY(gemv_rope_m2_n2, GEMV_ROPE, 2, 2, 2)
GEMV_ENTRY(gemv_rope_m2_n4, GEMV_ROPE, 2, 4, 1)
