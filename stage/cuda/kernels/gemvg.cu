// gemvg_nt<NT>: the cuBLAS path's gate|up product of steps of up to 32
// staged rows (tokens and their remainders) with SwiGLU in its epilogue
// (gemvg.go says which steps), a dependent launch: it loads its first
// weights before griddepcontrol.wait, and no silu_mul kernel follows it.
//
// out[r][f] = silu(g) * u, g = x_r · gate_f, u = x_r · up_f, for the bf16
// rows x of t tokens (with lo, each token's rounding remainder lo rows on:
// the pair is summed here) and the gate|up weight [2 inter x k] (gate rows,
// then up rows), rounded to bf16 into out [t x inter] with the rounding
// remainder at row r + lo (put_split, as silu_mul writes it). Grid
// inter / 64; block GEMVG_THREADS: warp w takes features f0 = 64 b + 8 w ..
// f0 + 7 as one mma m-tile whose rows 0-7 are their gate rows and rows
// 8-15 their up rows, so that a lane's accumulators hold the gate and the
// up sum of the same feature and token. The weights stream through the
// warp's weight ring (gemv.cu: wring_*; its rows 0-7 the gate rows, 8-15
// the up rows), its first WRING_STAGES - 1 stages started before the wait.
// The block stages all of x (NT * 8 rows of k, laid out as gemvs.cu's)
// by cp.async after the wait, in two parts (stage_rows: a quarter of k,
// then the rest), and starts its multiplies once the first is in: the
// whole took 4.45 us after the wait at 32 rows (1B, one H200), every block
// reading the same 128 KB, while the warps' rings sat full. A block holds
// a multiprocessor (at 32 rows alone: gemvgLaunchSmem). Dynamic shared
// memory: gemvgSmem(NT, k), the staged rows, then the warps' rings. k must
// be a multiple of WRING_KS.
#define GEMVG_THREADS 256

template <int NT>
__device__ __forceinline__ void gemvg_body(const bf16* __restrict__ w, const bf16* __restrict__ x,
                                           bf16* __restrict__ out, int inter, int k, int t, int lo) {
    extern __shared__ unsigned gemvg_sm[];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, g = lane >> 2, c = lane & 3;
    const int f = blockIdx.x * 64 + wid * 8 + g, stride = k, nst = k / WRING_KS;
    const unsigned sbase = smem_addr(gemvg_sm);
    const unsigned ring = sbase + (unsigned)(NT * 8 * stride * 2 + wid * WRING_BYTES);
    // The warp's gate rows (ring rows 0-7) and up rows (8-15).
    const bf16* r0 = w + (size_t)(f - g) * k;
    const bf16* r1 = r0 + (size_t)inter * k;
    TL_BEGIN
    wring_prime(ring, r0, r1, k, nst, lane);
    TL_WAIT
    const int sync = stage_rows<NT, GEMVG_THREADS, true>(sbase, x, k, 0, k, stride, t, lo);
    TL_MARK
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[nt][i] = 0.f;
    // B fragments of row g of n-tile nt: its 16 bytes at the lane's k.
    wring_mma<NT>(acc, ring, r0, r1, k, nst, sbase + (unsigned)((g * stride + 8 * c) * 2), stride, lane, sync);
    // acc[nt]: staged rows (tokens) 2c, 2c + 1 of n-tile nt; [0], [1] the
    // gate sums, [2], [3] the up sums of feature f. With lo, n-tile
    // nt + NT / 2 holds the same tokens' remainders.
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = nt * 8 + 2 * c + h;
            if (r < t && (!lo || nt < NT / 2)) {
                float gs = acc[nt][h], us = acc[nt][2 + h];
                if (lo) {
                    gs += acc[(nt + NT / 2) % NT][h];
                    us += acc[(nt + NT / 2) % NT][2 + h];
                }
                put_split(out, (size_t)r * inter + f, (size_t)lo * inter, gs / (1.f + expf(-gs)) * us);
            }
        }
    TL_END(TL_GEMVG)
}

#define GEMVG_ENTRY(name, nt)                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMVG_THREADS, 1)                                      \
        name(const bf16* __restrict__ w, const bf16* __restrict__ x, bf16* __restrict__ out, int inter, \
             int k, int t, int lo) {                                                                    \
        gemvg_body<nt>(w, x, out, inter, k, t, lo);                                                     \
    }

GEMVG_ENTRY(gemvg_nt1, 1)
GEMVG_ENTRY(gemvg_nt2, 2)
GEMVG_ENTRY(gemvg_nt4, 4)
