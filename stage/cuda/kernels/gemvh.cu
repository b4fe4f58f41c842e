// gemvh_nt<NT>: the LM head of the cuBLAS path's steps of 1-32 logits
// rows (gemvh.go says which), with the softmax partials the sampler reads
// in its epilogue, a dependent launch: no logit_stats kernel follows it,
// and its first weights load before griddepcontrol.wait, beside the final
// norm.
//
// out[r][f] = x_r · W_f for the bf16 rows x of t logits rows and the head
// W [n x k], in fp32 (out row-major [t x n]). The grid is persistent: each
// warp of the grid takes units of 16 weight rows (n / 16 of them),
// unit u by warp u mod warps, warps numbered warp-major (warp w of block b
// is w * gridDim.x + b) so that the units left over spread across the
// blocks: a block's share differs from another's by at most one unit. The
// warp streams all of its units' weights through its ring (gemv.cu:
// wring_*) as one run of stages, so the next unit's first stages load
// while a unit ends. It walks the run by counters (unit, k-stage, slot):
// at 32 rows the kernel runs at its warps' issue rate, and two divisions a
// stage took more issue slots than its 16 mma (NOTES.md phase 28). The block
// stages x once (NT * 8 rows of k, as gemvs.cu; in two parts as gemvg.cu)
// after the wait.
//
// Each lane keeps, for each of its rows, a running softmax partial over
// the logits it computes (its 2 features of every unit of its warp:
// stats_add, as logit_stats does); at the end the 8 lanes of a row merge
// theirs (stats_merge) and write the warp's partial of the row to
// stats[(r * gridDim.x * W + warp) * 4], the layout sample reads (nstat =
// gridDim.x * W, W the block's warps: GemvhGeom). The partials depend on
// the grid alone, never on the step's other rows.
//
// Grid: at most n / 16 / W blocks (every warp has a unit); block W * 32
// threads; dynamic shared memory gemvhSmem(NT, k): the staged rows,
// then the warps' rings. n a multiple of 16, k of WRING_KS.
#define GEMVH_THREADS 256
// At n-tile 4 the staged rows take 128 KB of k 2,048: a block of
// GEMVH_WARPS4 warps with rings of GEMVH_STAGES4 stages (more warps to
// issue, shallower rings: 16 x 3 took 3 us off the head at 32 rows, where
// 12 x 4 added 3; NOTES.md phase 29), where the other n-tiles keep
// GEMVH_THREADS and WRING_STAGES.
#define GEMVH_WARPS4 16
#define GEMVH_STAGES4 3

template <int NT>
struct GemvhGeom {
    static constexpr int warps = NT == 4 ? GEMVH_WARPS4 : GEMVH_THREADS / 32;
    static constexpr int stages = NT == 4 ? GEMVH_STAGES4 : WRING_STAGES;
};

template <int NT>
__device__ __forceinline__ void gemvh_body(const bf16* __restrict__ w, const bf16* __restrict__ x,
                                           float* __restrict__ out, int n, int k, int t, float* __restrict__ stats) {
    extern __shared__ unsigned gemvh_sm[];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, g = lane >> 2, c = lane & 3;
    const int stride = k, nst = k / WRING_KS;
    constexpr int W = GemvhGeom<NT>::warps, S = GemvhGeom<NT>::stages;
    const int warps = gridDim.x * W, gw = wid * gridDim.x + blockIdx.x;
    const int total = (n / 16 - gw + warps - 1) / warps * nst;  // the warp's stages
    const unsigned sbase = smem_addr(gemvh_sm);
    const unsigned ring = sbase + (unsigned)(NT * 8 * stride * 2 + wid * S * (16 * WRING_KS * 2));
    // The issuing side walks the warp's run by counters, never dividing:
    // left stages still to issue, the k-stage ik of the unit whose first
    // row is at iw, and the slot is.
    const size_t ustep = (size_t)warps * 16 * k;  // from a warp's unit to its next
    const bf16* iw = w + (size_t)gw * 16 * k;
    int left = total, ik = 0, is = 0;
    // issue starts the next stage into its slot, and commits a group
    // either way.
    auto issue = [&]() {
        if (left > 0) {
            wring_copy(ring, iw, iw + (size_t)8 * k, k, ik, is, lane);
        }
        cp_async_commit();
        left--;
        if (++ik == nst) {
            ik = 0;
            iw += ustep;
        }
        if (++is == S) is = 0;
    };
    TL_BEGIN
    pdl_trigger();
#pragma unroll
    for (int st = 0; st < S - 1; st++) {
        issue();
    }
    pdl_wait();
    TL_WAIT
    const int sync = stage_rows<NT, W * 32, true>(sbase, x, k, 0, k, stride, t, 0);
    TL_MARK
    float acc[NT][4];
    // The lane's running partial of row nt * 8 + 2c + h: sm, si, ss, sb.
    float sm[NT][2], ss[NT][2];
    int si[NT][2], sb[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int i = 0; i < 4; i++) acc[nt][i] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sm[nt][h] = NEG_INF;
            ss[nt][h] = 0.f;
            si[nt][h] = 0x7fffffff;
            sb[nt][h] = 0;
        }
    }
    const unsigned blane = sbase + (unsigned)((g * stride + 8 * c) * 2);
    const unsigned arow = ring + (unsigned)(g * 128);
    // The multiplying side's counters: k-stage kst, slot rs, and the lane's
    // first feature f of the unit being multiplied.
    int kst = 0, rs = 0, f = gw * 16 + g;
#pragma unroll 1
    for (int st = 0; st < total; st++) {
        cp_async_wait<S - 2>();
        if (st == sync && sync < nst) {
            // Every thread's rest of the staged rows is in (in every
            // warp's first unit; with no rest, stage_rows met already).
            __syncthreads();
        } else {
            __syncwarp();
        }
        u32x4 a[WRING_KS / 32][2];
        wring_frags(a, arow, rs, g, c);
        issue();
        mma_staged<NT, WRING_KS / 32>(acc, a, blane, stride, kst * WRING_KS);
        if (++rs == S) rs = 0;
        if (++kst == nst) {
            kst = 0;
            // The unit's logits: features f and f + 8 of rows 2c, 2c + 1
            // of each n-tile, in increasing feature order per lane.
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = nt * 8 + 2 * c + h;
                    if (r < t) {
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const float v = acc[nt][2 * e + h];
                            const int i = f + 8 * e;
                            out[(size_t)r * n + i] = v;
                            stats_add(v, i, sm[nt][h], si[nt][h], ss[nt][h], sb[nt][h]);
                        }
                    }
                }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[nt][i] = 0.f;
            f += warps * 16;
        }
    }
    // The 8 lanes of each row (lanes c, c + 4, ..., c + 28) merge their
    // partials; lane c writes the warp's.
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float m = sm[nt][h], s = ss[nt][h];
            int mi = si[nt][h], bad = sb[nt][h];
            for (int o = 16; o >= 4; o >>= 1) {
                stats_merge(m, mi, s, bad, o);
            }
            const int r = nt * 8 + 2 * c + h;
            if (g == 0 && r < t) {
                float* p = stats + ((size_t)r * warps + blockIdx.x * W + wid) * 4;
                p[0] = m;
                p[1] = __int_as_float(mi);
                p[2] = s;
                p[3] = __int_as_float(bad);
            }
        }
    TL_END(TL_GEMVH)
}

#define GEMVH_ENTRY(name, nt)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GemvhGeom<nt>::warps * 32, 1)                                  \
        name(const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ out, int n, int k, int t, \
             float* __restrict__ stats) {                                                                      \
        gemvh_body<nt>(w, x, out, n, k, t, stats);                                                             \
    }

GEMVH_ENTRY(gemvh_nt1, 1)
GEMVH_ENTRY(gemvh_nt2, 2)
GEMVH_ENTRY(gemvh_nt4, 4)
