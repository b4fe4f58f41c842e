// rmsnorm normalises rows of the fp32 residual stream into bf16 GEMM inputs
// (the cuBLAS path; the skinny path folds the norm into its products). The
// pending output y of the layer's last GEMM (null: none), in two halves lo
// rows apart (lo 0: one), is first added to the residual and written back:
//   x = resid[src] (+ y[src] + y[src + lo]), out[r] = bf16(x * rsqrt(mean(x^2) + eps) * w)
// with src = rowmap ? rowmap[r] : r (the last stage normalising only the
// rows it needs logits for, a row possibly more than once; then y must be
// null). When outlo is not 0, the rounding remainder of each output goes to
// row r + outlo (put_split). All arithmetic is fp32. A thread takes 4
// consecutive elements at a time (16-byte loads; when hidden is a multiple
// of 4, else 1), so that with NORM_THREADS a row of up to 4,096 is one
// round of loads: the kernel is a chain of latencies (a block per row),
// and with one element a thread a row of 4,096 took 16 us at 32 rows.
// Grid: (rows). Block: NORM_THREADS.
#define NORM_THREADS 1024

// norm_load is elements i..i+VEC-1 of the row with the pending output
// added: x (+ y1 + y2), summed as rmsnorm has always summed. v holds 4.
template <int VEC>
__device__ __forceinline__ void norm_load(const float* row, const float* y1, const float* y2, int i, float* v) {
    float a[4], b[4];
    if (VEC == 4) {
        ldcg_u4(row + i, (unsigned*)v);
        if (y1) {
            ldcg_u4(y1 + i, (unsigned*)a);
        }
        if (y2) {
            ldcg_u4(y2 + i, (unsigned*)b);
        }
    } else {
        v[0] = ldcg(row + i);
        if (y1) {
            a[0] = ldcg(y1 + i);
        }
        if (y2) {
            b[0] = ldcg(y2 + i);
        }
    }
    if (y1) {
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            v[e] += y2 ? a[e] + b[e] : a[e];
        }
    }
}

template <int VEC>
__device__ __forceinline__ void rmsnorm_row(float* row, const float* y1, const float* y2, const bf16* w, bf16* o,
                                            size_t olo, int hidden, float eps, float* sh) {
    float ss = 0.f;
    for (int i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
        float v[4];
        norm_load<VEC>(row, y1, y2, i, v);
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            ss += v[e] * v[e];
        }
    }
    const float inv = rsqrtf(block_sum(ss, sh) / (float)hidden + eps);
    for (int i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
        float v[4];
        norm_load<VEC>(row, y1, y2, i, v);
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            if (y1) {
                row[i + e] = v[e];
            }
            put_split(o, i + e, olo, v[e] * inv * bf2f(w[i + e]));
        }
    }
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm(float* resid, const float* y, int lo, const bf16* w,
                                                                   bf16* out, int outlo, const int* rowmap, int hidden,
                                                                   float eps) {
    __shared__ float sh[32];
    pdl_start();
    int r = blockIdx.x;
    size_t src = rowmap ? rowmap[r] : r;
    float* row = resid + src * hidden;
    const float* y1 = y ? y + src * hidden : 0;
    const float* y2 = y && lo ? y + (src + lo) * hidden : 0;
    bf16* o = out + (size_t)r * hidden;
    if ((hidden & 3) == 0) {
        rmsnorm_row<4>(row, y1, y2, w, o, (size_t)outlo * hidden, hidden, eps, sh);
    } else {
        rmsnorm_row<1>(row, y1, y2, w, o, (size_t)outlo * hidden, hidden, eps, sh);
    }
}

// residual_add adds a GEMM output y (two halves lo rows apart; lo 0: one)
// into the residual stream: resid[t] += y[t] (+ y[t + lo]).
// Grid: (ceil(hidden / blockDim.x), rows).
extern "C" __global__ void residual_add(float* resid, const float* y, int lo, int hidden) {
    pdl_start();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hidden) {
        return;
    }
    size_t t = blockIdx.y;
    float v = y[t * hidden + i];
    if (lo) {
        v += y[(t + lo) * hidden + i];
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
