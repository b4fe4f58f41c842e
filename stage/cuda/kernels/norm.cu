// rmsnorm normalises rows of the fp32 residual stream into bf16 GEMM inputs
// (the cuBLAS path; the skinny path folds the norm into its products). The
// pending output y of the layer's last product (null: none), in planes lo
// rows apart (cuBLAS's two halves or one; rmsnorm_planes: gemvs.cu's
// splits), is first added to the residual and written back:
//   x = resid[src] (+ (y[src] + y[src + lo] + ...)), out[r] = bf16(x * rsqrt(mean(x^2) + eps) * w)
// with src = rowmap ? rowmap[r] : r (the last stage normalising only the
// rows it needs logits for, a row possibly more than once; then y must be
// null). When outlo is not 0, the rounding remainder of each output goes to
// row r + outlo (put_split). All arithmetic is fp32. A thread takes 4
// consecutive elements at a time (16-byte loads; when hidden is a multiple
// of 4, else 1) and keeps up to NORM_KEEP rounds of them in registers for
// the second pass: the host sizes the block (normBlock) so that a row is
// one round where it can, because at few rows the kernel is a chain of
// latencies (one element a thread, 256 threads, took 16 us a row of 4,096
// at 32 rows), and at many rows a second read of the row from memory
// doubles its traffic. Grid: (rows). Block: normBlock(hidden), at most
// NORM_THREADS.
#define NORM_THREADS 1024
#define NORM_KEEP 4

// norm_load is elements i..i+VEC-1 of the row with the pending output
// added: x + (y1 + y1[ps] + ...: planes planes, at most P, ps elements
// apart), every load issued first. v holds 4. P is 2 for cuBLAS's output
// (two halves or one), so that the common case keeps its registers.
template <int VEC, int P>
__device__ __forceinline__ void norm_load(const float* row, const float* y1, size_t ps, int planes, int i, float* v) {
    float a[4];
    if (VEC == 4) {
        ldcg_u4(row + i, (unsigned*)v);
        if (y1) {
            ldcg_u4(y1 + i, (unsigned*)a);
        }
    } else {
        v[0] = ldcg(row + i);
        if (y1) {
            a[0] = ldcg(y1 + i);
        }
    }
    if (!y1) {
        return;
    }
    float b[P][4];
#pragma unroll
    for (int p = 1; p < P; p++) {
        if (p < planes) {
            if (VEC == 4) {
                ldcg_u4(y1 + p * ps + i, (unsigned*)b[p]);
            } else {
                b[p][0] = ldcg(y1 + p * ps + i);
            }
        }
    }
#pragma unroll
    for (int p = 1; p < P; p++) {
        if (p < planes) {
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                a[e] += b[p][e];
            }
        }
    }
#pragma unroll
    for (int e = 0; e < VEC; e++) {
        v[e] += a[e];
    }
}

// norm_weights loads the 4 bf16 norm weights at p (two words).
__device__ __forceinline__ void norm_weights(const bf16* p, unsigned* wv) {
    asm("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(wv[0]), "=r"(wv[1]) : "l"(p));
}

// norm_put4 stores 4 elements of a row: their sums v back into the
// residual row (null: not), and v * inv * w (w: 4 bf16 weights in two
// words) as bf16 at o, their rounding remainders olo elements on (0: none);
// in one 16-byte and one (two) 8-byte stores, so that a warp's stores are
// whole lines.
__device__ __forceinline__ void norm_put4(float* row, bf16* o, size_t olo, const float* v, float inv, const unsigned* wv) {
    unsigned h[2], l[2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const float x0 = v[2 * e] * inv * lo_bf16(wv[e]), x1 = v[2 * e + 1] * inv * hi_bf16(wv[e]);
        const bf16 b0 = f2bf(x0), b1 = f2bf(x1);
        h[e] = (unsigned)b0 | (unsigned)b1 << 16;
        l[e] = (unsigned)f2bf(x0 - bf2f(b0)) | (unsigned)f2bf(x1 - bf2f(b1)) << 16;
    }
    if (row) {
        asm volatile("st.global.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(row), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                     : "memory");
    }
    asm volatile("st.global.v2.u32 [%0], {%1,%2};" ::"l"(o), "r"(h[0]), "r"(h[1]) : "memory");
    if (olo) {
        asm volatile("st.global.v2.u32 [%0], {%1,%2};" ::"l"(o + olo), "r"(l[0]), "r"(l[1]) : "memory");
    }
}

// norm_elem is the first element of this thread's round r of a row, VEC
// elements a thread a round.
template <int VEC>
__device__ __forceinline__ int norm_elem(int r) {
    return (threadIdx.x + r * blockDim.x) * VEC;
}

// rmsnorm_row normalises one row; wk holds the norm weights of this
// thread's kept rounds, loaded before the kernel's wait (VEC 4 only).
template <int VEC, int P>
__device__ __forceinline__ void rmsnorm_row(float* row, const float* y1, size_t ps, int planes, const bf16* w, bf16* o,
                                            size_t olo, int hidden, float eps, float* sh, const unsigned (*wk)[2]) {
    const int step = blockDim.x * VEC, kept = norm_elem<VEC>(NORM_KEEP);
    float keep[NORM_KEEP][4];
    float ss = 0.f;
#pragma unroll
    for (int r = 0; r < NORM_KEEP; r++) {
        const int i = norm_elem<VEC>(r);
        if (i < hidden) {
            norm_load<VEC, P>(row, y1, ps, planes, i, keep[r]);
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                ss += keep[r][e] * keep[r][e];
            }
        }
    }
    for (int i = kept; i < hidden; i += step) {
        float v[4];
        norm_load<VEC, P>(row, y1, ps, planes, i, v);
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            ss += v[e] * v[e];
        }
    }
    const float inv = rsqrtf(block_sum(ss, sh) / (float)hidden + eps);
    // put stores elements i..i+VEC-1: the sums back into the row, the
    // normalised values (and remainders) as bf16.
    auto put = [&](int i, const float* v, int r) {
        if (VEC == 4) {
            unsigned wv[2];
            if (r >= 0) {
                wv[0] = wk[r][0];
                wv[1] = wk[r][1];
            } else {
                norm_weights(w + i, wv);
            }
            norm_put4(y1 ? row + i : 0, o + i, olo, v, inv, wv);
            return;
        }
        if (y1) {
            row[i] = v[0];
        }
        put_split(o, i, olo, v[0] * inv * bf2f(w[i]));
    };
#pragma unroll
    for (int r = 0; r < NORM_KEEP; r++) {
        const int i = norm_elem<VEC>(r);
        if (i < hidden) {
            put(i, keep[r], r);
        }
    }
    for (int i = kept; i < hidden; i += step) {
        float v[4];
        norm_load<VEC, P>(row, y1, ps, planes, i, v);
        put(i, v, -1);
    }
}

// rmsnorm_body is rmsnorm's work with y in at most P planes.
template <int P>
__device__ __forceinline__ void rmsnorm_body(float* resid, const float* y, int lo, const bf16* w, bf16* out, int outlo,
                                             const int* rowmap, int hidden, float eps, int planes) {
    __shared__ float sh[32];
    TL_BEGIN
    pdl_trigger();
    // The norm weights of this thread's kept elements are loaded before the
    // wait (no kernel of the step writes them), so that the stores after
    // the row's sum do not wait for them.
    unsigned wk[NORM_KEEP][2] = {};
    if ((hidden & 3) == 0) {
#pragma unroll
        for (int r = 0; r < NORM_KEEP; r++) {
            const int i = norm_elem<4>(r);
            if (i < hidden) {
                norm_weights(w + i, wk[r]);
            }
        }
    }
    pdl_wait();
    TL_WAIT
    TL_MARK
    int r = blockIdx.x;
    size_t src = rowmap ? rowmap[r] : r;
    float* row = resid + src * hidden;
    const float* y1 = y ? y + src * hidden : 0;
    const size_t ps = (size_t)lo * hidden;
    bf16* o = out + (size_t)r * hidden;
    if ((hidden & 3) == 0) {
        rmsnorm_row<4, P>(row, y1, ps, planes, w, o, (size_t)outlo * hidden, hidden, eps, sh, wk);
    } else {
        rmsnorm_row<1, P>(row, y1, ps, planes, w, o, (size_t)outlo * hidden, hidden, eps, sh, wk);
    }
    TL_END(TL_NORM)
}

// rmsnorm: y (cuBLAS's output) in two halves lo rows apart, lo 0: one.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm(float* resid, const float* y, int lo, const bf16* w,
                                                                   bf16* out, int outlo, const int* rowmap, int hidden,
                                                                   float eps) {
    rmsnorm_body<2>(resid, y, lo, w, out, outlo, rowmap, hidden, eps, lo ? 2 : 1);
}

// rmsnorm_planes: y (gemvs.cu's output) in planes planes lo rows apart, up
// to MAX_PLANES.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_planes(float* resid, const float* y, int lo,
                                                                          const bf16* w, bf16* out, int outlo,
                                                                          const int* rowmap, int hidden, float eps,
                                                                          int planes) {
    rmsnorm_body<MAX_PLANES>(resid, y, lo, w, out, outlo, rowmap, hidden, eps, planes);
}

// rmsnorm_cluster is rmsnorm_planes (y in planes planes, at most
// MAX_PLANES, lo rows apart; cuBLAS's one or two halves too) with each row
// split over a cluster of NORM_CLUSTER blocks, a thread for 4 of its
// elements: each block sums the squares of its part and writes the sum
// into every block's shared memory, one barrier later each adds the
// cluster's sums from its own (every block in the same order, so all scale
// by the same factor) and normalises its part. At 32 rows rmsnorm_planes
// is 32 blocks, each a chain of latencies over a whole row (4.4 us a run,
// 1B, batch 32, one H200; this kernel 2.54 us reading the others' sums
// after the barrier, which kept every block until all had read, and 2.26
// writing them before it). Grid:
// (NORM_CLUSTER, rows). Block: hidden / (4 * NORM_CLUSTER), whole warps
// (normClusterBlock). Clusters need sm_90: elsewhere the kernel is
// compiled without one, and the host never launches it.
#define NORM_CLUSTER 8
#if __CUDA_ARCH__ >= 900
#define NORM_CLUSTER_DIMS __cluster_dims__(NORM_CLUSTER, 1, 1)
#else
#define NORM_CLUSTER_DIMS
#endif
extern "C" __global__ void NORM_CLUSTER_DIMS __launch_bounds__(NORM_THREADS)
    rmsnorm_cluster(float* resid, const float* y, int lo, const bf16* w, bf16* out, int outlo, const int* rowmap,
                    int hidden, float eps, int planes) {
    __shared__ float sh[32];
    __shared__ float parts[NORM_CLUSTER];
    TL_BEGIN
    pdl_trigger();
    // A block may write another's shared memory only once that one runs:
    // this barrier's wait, before the writes, comes long after every
    // block's arrival here.
    cluster_arrive();
    const int i = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    unsigned wv[2];
    norm_weights(w + i, wv);
    pdl_wait();
    TL_WAIT
    TL_MARK
    const size_t r = blockIdx.y, src = rowmap ? rowmap[r] : r;
    float* row = resid + src * hidden;
    const float* y1 = y ? y + src * hidden : 0;
    float v[4];
    norm_load<4, MAX_PLANES>(row, y1, (size_t)lo * hidden, planes, i, v);
    const float ss = block_sum(v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3], sh);
    // Every block's sum goes to its slot in every block's parts, so that
    // after the next barrier each reads its own shared memory alone and may
    // leave as soon as it is done.
    const int lane = threadIdx.x & 31;
    cluster_wait();
    if (threadIdx.x < NORM_CLUSTER) {
        st_cluster(&parts[blockIdx.x], threadIdx.x, ss);
    }
    cluster_arrive();
    cluster_wait();
    const float tot = warp_sum(lane < NORM_CLUSTER ? parts[lane] : 0.f);
    const float inv = rsqrtf(tot / (float)hidden + eps);
    norm_put4(y1 ? row + i : 0, out + r * hidden + i, (size_t)outlo * hidden, v, inv, wv);
    TL_END(TL_NORM)
}

// residual_add adds a product's output y, in planes planes ps rows apart
// (cuBLAS's two halves or one, gemvs.cu's splits), into the residual
// stream in their order: resid[t] += y[t] (+ y[t + ps] + ...).
// Grid: (ceil(hidden / blockDim.x), rows).
extern "C" __global__ void residual_add(float* resid, const float* y, int ps, int planes, int hidden) {
    pdl_start();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hidden) {
        return;
    }
    size_t t = blockIdx.y;
    float v = y[t * hidden + i];
    for (int p = 1; p < planes; p++) {
        v += y[(t + (size_t)p * ps) * hidden + i];
    }
    resid[t * hidden + i] += v;
}

// spin keeps the stream busy for ns nanoseconds: the profiling mode queues
// it first, so that the host has ordered the whole step before the GPU
// reaches it and the events around each kernel time the kernel, not the
// host's launches.
extern "C" __global__ void spin(long long ns) {
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    } while ((long long)(t1 - t0) < ns);
}
