// Common definitions for tandem's kernels. The .cu files of this directory
// are concatenated in name order into one NVRTC program, so this file comes
// first. No headers are included: bf16 is handled as raw 16-bit patterns,
// which keeps the program independent of the toolkit's header set.

typedef unsigned short bf16;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

// Status codes a kernel records in the first word of the stage's status
// array (first stage), the first error winning; the host reads the array
// back after the step, reports the error and clears it.
#define STATUS_NO_TOKEN 1 // [1] token row, [2] slot: a placeholder found no token
#define STATUS_BAD_ROW 2  // [1] row, [2] slot, [3] token: a hand-off row was refused

// Programmatic dependent launch (sm_90): every kernel of the program may be
// launched as a dependent of the kernel before it on the stream, which then
// lets it start early. pdl_trigger allows this kernel's own dependents to
// start; pdl_wait blocks until the kernels this one depends on have finished
// and their writes are visible. A kernel must call pdl_wait before it reads
// or writes anything other kernels write or read (weights excepted). Both
// are no-ops for a kernel launched without the dependency.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A block timeline (a diagnostic: compiled only with TANDEM_TIMELINE, which
// the stage's Config.timeline sets; timeline.go reads it). Every gemvf
// block and every decode-attention block records, from the global timer,
// when it started, when its pdl_wait returned, a mark (gemvf: activations
// staged; attention: first key tile in, dependents triggered) and when it
// ended, in 4 words: tag << 56 | multiprocessor << 48 | blocks of the grid
// << 24 | block; start (ns); wait | mark << 32 (ns after start); end (ns
// after start). Tags: TL_ATTENTION, TL_ATTENTION_EMPTY (a part past its
// sequence's end), TL_GEMVF + the gemvf epilogue, and the cuBLAS path's
// kernels of our own: TL_GEMVS, TL_GEMVG, TL_GEMVH, TL_NORM (rmsnorm, rmsnorm_planes),
// TL_SILU (silu_mul; its mark is its wait). tl_reset empties the records,
// tl_read copies them out with their count.
#ifdef TANDEM_TIMELINE
#define TL_MAX 65536
#define TL_ATTENTION 1
#define TL_ATTENTION_EMPTY 2
#define TL_GEMVF 10
#define TL_GEMVS 20
#define TL_GEMVG 21
#define TL_NORM 22
#define TL_SILU 23
#define TL_GEMVH 24
__device__ unsigned long long tl_rec[TL_MAX * 4];
__device__ unsigned tl_cnt;
__device__ __forceinline__ unsigned long long tl_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned tl_smid() {
    unsigned r;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void tl_put(unsigned tag, unsigned long long t0, unsigned long long t1,
                                       unsigned long long t2) {
    unsigned long long e = tl_now();
    unsigned i = atomicAdd(&tl_cnt, 1u);
    if (i < TL_MAX) {
        unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        unsigned grid = gridDim.x * gridDim.y * gridDim.z;
        tl_rec[4 * i] = ((unsigned long long)tag << 56) | ((unsigned long long)tl_smid() << 48) |
                        ((unsigned long long)grid << 24) | blk;
        tl_rec[4 * i + 1] = t0;
        tl_rec[4 * i + 2] = (t1 - t0) | ((t2 - t0) << 32);
        tl_rec[4 * i + 3] = e - t0;
    }
}
extern "C" __global__ void tl_reset() { tl_cnt = 0; }
extern "C" __global__ void tl_read(unsigned long long* out, unsigned* n) {
    unsigned c = min(tl_cnt, (unsigned)TL_MAX);
    for (unsigned i = threadIdx.x + blockIdx.x * blockDim.x; i < c * 4; i += blockDim.x * gridDim.x) out[i] = tl_rec[i];
    if (threadIdx.x == 0 && blockIdx.x == 0) *n = c;
}
#define TL_BEGIN unsigned long long tl0 = tl_now(), tl1 = tl0, tl2 = tl0;
#define TL_WAIT tl1 = tl_now();
#define TL_MARK tl2 = tl_now();
// TL_END records once every thread of the block is done; TL_END_NOW at once
// (a block leaving together).
#define TL_END(tag)                                       \
    {                                                     \
        __syncthreads();                                  \
        if (threadIdx.x == 0) tl_put(tag, tl0, tl1, tl2); \
    }
#define TL_END_NOW(tag) \
    if (threadIdx.x == 0) tl_put(tag, tl0, tl1, tl2);
#else
#define TL_BEGIN
#define TL_WAIT
#define TL_MARK
#define TL_END(tag)
#define TL_END_NOW(tag)
#endif

// pdl_start is where a kernel that prefetches nothing begins.
__device__ __forceinline__ void pdl_start() {
    pdl_trigger();
    pdl_wait();
}

// Loads of data an earlier kernel of the step wrote, from L2: a kernel that
// started early (above) shares its multiprocessor with kernels still
// running, so it does not rely on lines they brought into L1.
__device__ __forceinline__ float ldcg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ void ldcg_u4(const void* p, unsigned* w) {
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p));
}

// smem_addr is the shared-window address of a generic pointer to shared
// memory.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(a) : "l"(p));
    return a;
}

// Thread block clusters (sm_90): cluster_arrive and cluster_wait are the
// two halves of a barrier of every thread of the cluster's blocks (arrive
// releases this thread's writes, wait acquires the others'); st_cluster
// writes v to the float at p in the shared memory of the cluster's block
// rank, which must have started (a barrier's wait after its arrival).
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void st_cluster(float* p, unsigned rank, float v) {
#if __CUDA_ARCH__ >= 900
    unsigned a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(a), "f"(v) : "memory");
#endif
}

// cp_async16 copies 16 bytes from global to shared memory in the
// background (only the first bytes of src, zero-filling the rest), with
// 256 bytes fetched into L2 at a time.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// cp_async_wait waits until at most N of this thread's groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ float bf2f(bf16 x) {
    return __uint_as_float(((unsigned)x) << 16);
}

// f2bf rounds to nearest even, keeping NaN a NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// pack_bf16 rounds a and b to bf16 (nearest even) into one register, a in
// the low half.
__device__ __forceinline__ unsigned pack_bf16(float a, float b) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

__device__ __forceinline__ float lo_bf16(unsigned p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float hi_bf16(unsigned p) { return __uint_as_float(p & 0xffff0000u); }

// mma_bf16 accumulates the m16n8k16 product of A (a0..a3) and B (b0, b1)
// into c.
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// put_split stores v at out[i] rounded to bf16 and, when lo is not 0, the
// rounding remainder (v minus that), rounded to bf16 too, at out[i + lo]:
// the two together carry v to about 16 significant bits, and a GEMM over
// both (one matrix of twice the rows, see below) computes x·Wᵀ as if x had
// them, reading the weights once.
__device__ __forceinline__ void put_split(bf16* out, size_t i, size_t lo, float v) {
    bf16 h = f2bf(v);
    out[i] = h;
    if (lo) {
        out[i + lo] = f2bf(v - bf2f(h));
    }
}

// Compensated GEMMs: every layer GEMM multiplies a matrix of 2T rows, the
// bf16 values of its T inputs (rows 0..T-1) and their rounding remainders
// (rows T..2T-1), so its output has two halves too, summed by the kernel
// that reads it. lo is that row offset T.

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// block_sum returns the sum of v over the block to every thread. blockDim.x
// must be a multiple of 32 and every thread must call it; sh holds 32 floats.
__device__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        sh[w] = v;
    }
    __syncthreads();
    if (w == 0) {
        v = lane < nw ? sh[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) {
            sh[0] = v;
        }
    }
    __syncthreads();
    return sh[0];
}

// block_max is block_sum's counterpart for the maximum.
__device__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) {
        sh[w] = v;
    }
    __syncthreads();
    if (w == 0) {
        v = lane < nw ? sh[lane] : NEG_INF;
        v = warp_max(v);
        if (lane == 0) {
            sh[0] = v;
        }
    }
    __syncthreads();
    return sh[0];
}

// better orders (value, index) pairs: larger value first, then lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// A softmax partial of logits (logit_stats, gemvh; sample merges them): the
// maximum m, its lowest index mi, the sum s of exp(v - m) and whether a
// value was NaN or infinite (bad). stats_add folds logit v of index i in.
__device__ __forceinline__ void stats_add(float v, int i, float& m, int& mi, float& s, int& bad) {
    bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
    if (better(v, i, m, mi)) {
        s = m == NEG_INF ? 0.f : s * expf(m - v);
        m = v;
        mi = i;
    }
    s += expf(v - m);
}

// stats_merge merges the partial of the lane o lanes over (xor) into this
// lane's, in the same order in both lanes (the sums commute).
__device__ __forceinline__ void stats_merge(float& m, int& mi, float& s, int& bad, int o) {
    const float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
    const int oi = __shfl_xor_sync(0xffffffffu, mi, o);
    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    const bool take = better(om, oi, m, mi);
    const float nm = take ? om : m;
    s = (m == NEG_INF ? 0.f : s * expf(m - nm)) + (om == NEG_INF ? 0.f : os * expf(om - nm));
    m = nm;
    mi = take ? oi : mi;
}

// block_argmax reduces (v, i) pairs to the best one by better(), returned to
// every thread through *v and *i. shv and shi hold 32 entries each.
__device__ void block_argmax(float* v, int* i, float* shv, int* shi) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int nw = blockDim.x >> 5;
    float bv = *v;
    int bi = *i;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    __syncthreads();
    if (lane == 0) {
        shv[w] = bv;
        shi[w] = bi;
    }
    __syncthreads();
    if (w == 0) {
        bv = lane < nw ? shv[lane] : NEG_INF;
        bi = lane < nw ? shi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            shv[0] = bv;
            shi[0] = bi;
        }
    }
    __syncthreads();
    *v = shv[0];
    *i = shi[0];
}

// rope_rotate turns the rotary pair (x1, x2) of a head (elements i and
// i + head_dim/2: Hugging Face's rotate_half layout) by the angle
// pos * inv_freq[i]. Every kernel that applies the rotary embedding does it
// here, so that their results agree bit for bit.
__device__ __forceinline__ void rope_rotate(float& x1, float& x2, int pos, float inv_freq_i) {
    float s, c;
    sincosf((float)pos * inv_freq_i, &s, &c);
    const float y1 = x1 * c - x2 * s;
    x2 = x2 * c + x1 * s;
    x1 = y1;
}

// A product's output may come in planes, ps elements apart, that its
// consumer adds up in order: cuBLAS's two (the values' and the remainders'
// rows) or one, gemvs.cu's one a split of k, at most MAX_PLANES.
#define MAX_PLANES 8

// qkv_in is element i of a q|k|v projection row as the GEMM path leaves
// it: its planes (at most P) added, and the bias, when there is one. P is
// 2 for cuBLAS's output, so that its consumers keep their registers.
template <int P>
__device__ __forceinline__ float qkv_in(const float* row, size_t ps, int planes, const bf16* bias, int i) {
    float v[P];
#pragma unroll
    for (int p = 0; p < P; p++) {
        v[p] = p < planes ? ldcg(row + p * ps + i) : 0.f;
    }
    float x = v[0];
#pragma unroll
    for (int p = 1; p < P; p++) {
        if (p < planes) {
            x += v[p];
        }
    }
    if (bias) {
        x += bf2f(bias[i]);
    }
    return x;
}
