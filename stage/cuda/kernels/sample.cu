// sample picks one token per sampled sequence from fp32 logits, with its
// log-probability and the top alternatives. One block per sequence.
//
// params (SAMPLE_PARAMS ints per sequence):
//   [0] logits row   [1] temperature (float bits)   [2] top_k (0: off)
//   [3] top_p (float bits; 0 or >= 1: off)   [4] seed low   [5] seed high
//   [6] sample index   [7] number of top alternatives wanted (<= maxlp)
//   [8] hand-off slot   [9] apply: also record the token under the slot in
//   slot_tokens (a stage that is first and last, applying its own hand-off
//   in the step, as handoff_apply would: the planner has validated the slot
//   and no other row of the step names it)
// out (2 + 2 * maxlp ints per sequence):
//   [0] token   [1] log-probability (float bits)   then (token, logprob) pairs.
//   A row holding NaN or an infinity has no distribution to draw from: then
//   [0] is -1 and [1] the number of such values, and nothing else is set.
// handoff (null: none) gets one (slot, token) row per sequence; token 0 for
// a row that could not be sampled, so that the first stage accepts the
// message (the leader fails that sequence's request); slot_tokens (null:
// none) gets the same token under the slot of each row with [9] set.
// stats (null: none) holds, per logits row, nstat partial softmax statistics
// of the LM head's blocks (GEMV_HEAD in gemv.cu, gemvf.cu) or of
// logit_stats (below): with them, the maximum,
// the greedy token and the log partition function come from the partials
// instead of two passes over the row, unless a partial saw a non-finite
// logit (then the pass over the row counts them, as above).
//
// Log-probabilities are the log-softmax of the raw logits (temperature does
// not apply). Temperature 0 (or top_k 1) is greedy, ties to the lowest id.
// Otherwise the logits are divided by the temperature, top-k keeps the
// tokens whose logit is at least the k-th largest (ties at the boundary are
// all kept), top-p then keeps the fewest highest tokens whose renormalised
// probability reaches p, and the token is drawn by the Gumbel-max trick with
// noise hashed from (seed, index, token id): the draw depends only on the
// request's seed and sample index, never on the batch it shares.
// Grid: (sequences). Block: SAMPLE_THREADS.
#define SAMPLE_PARAMS 10
#define SAMPLE_THREADS 1024

// fkey maps a float to an unsigned key with the same order.
__device__ __forceinline__ unsigned fkey(float f) {
    unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// gumbel returns Gumbel(0, 1) noise for token i of draw (seed, index).
__device__ __forceinline__ float gumbel(u64 seed, u64 index, u64 i) {
    u64 h = mix64(seed ^ 0x243f6a8885a308d3ULL);
    h = mix64(h ^ (index * 0x9e3779b97f4a7c15ULL));
    h = mix64(h ^ (i * 0xd1b54a32d192ed03ULL));
    float u = ((float)(h >> 40) + 0.5f) * (1.f / 16777216.f);
    return -logf(-logf(u));
}

// count_at_least returns how many logits have a key >= k.
__device__ float count_at_least(const float* l, int vocab, unsigned k, float* sh) {
    float c = 0.f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        c += fkey(l[i]) >= k ? 1.f : 0.f;
    }
    return block_sum(c, sh);
}

// mass_at_least returns the sum of exp((l - m) * invt) over logits with key >= k.
__device__ float mass_at_least(const float* l, int vocab, unsigned k, float m, float invt,
                               float* sh) {
    float s = 0.f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = l[i];
        if (fkey(v) >= k) {
            s += expf((v - m) * invt);
        }
    }
    return block_sum(s, sh);
}

// logit_stats computes, for an LM head on cuBLAS, the softmax partials the
// skinny LM head hands sample (stats): block (r, c) reads logits
// [c * LS_CHUNK, (c + 1) * LS_CHUNK) of row r, each thread every
// LS_THREADS-th from its own (independent loads, many in flight: sample's
// own passes over a row, one block a row, take about 2 us per 10,000
// logits), and each warp writes the maximum, its lowest index, the sum of
// exp(v - maximum) and whether a value was NaN or infinite, over its lanes'
// values, to stats[((r * gridDim.y + c) * LS_WARPS + warp) * 4]. The chunks
// are fixed, so a row's partials never depend on the step's other rows.
// Grid: (rows, ceil(vocab / LS_CHUNK)). Block: LS_THREADS.
#define LS_CHUNK 8192
#define LS_THREADS 256
#define LS_WARPS (LS_THREADS / 32)
extern "C" __global__ void __launch_bounds__(LS_THREADS) logit_stats(const float* logits, int vocab, float* stats) {
    pdl_start();
    const int r = blockIdx.x, c = blockIdx.y;
    const float* l = logits + (size_t)r * vocab;
    const int e = min(vocab, (c + 1) * LS_CHUNK);
    float m = NEG_INF, s = 0.f;
    int mi = 0x7fffffff, bad = 0;
#pragma unroll 8
    for (int i = c * LS_CHUNK + (int)threadIdx.x; i < e; i += LS_THREADS) {
        stats_add(l[i], i, m, mi, s, bad);
    }
    // The warp's partial: pairs merged in a fixed order, the same in every
    // lane (the sums commute).
    for (int o = 16; o > 0; o >>= 1) {
        stats_merge(m, mi, s, bad, o);
    }
    if ((threadIdx.x & 31) == 0) {
        float* st = stats + (((size_t)r * gridDim.y + c) * LS_WARPS + (threadIdx.x >> 5)) * 4;
        st[0] = m;
        st[1] = __int_as_float(mi);
        st[2] = s;
        st[3] = __int_as_float(bad);
    }
}

// sample_handoff reports token tok of sequence i with params p: its
// hand-off row, and its slot's token where the step applies it.
__device__ __forceinline__ void sample_handoff(int* handoff, int* slot_tokens, const int* p, int i, int tok) {
    if (handoff) {
        handoff[2 * i] = p[8];
        handoff[2 * i + 1] = tok;
    }
    if (slot_tokens && p[9]) {
        slot_tokens[p[8]] = tok;
    }
}

extern "C" __global__ void sample(const float* logits, int vocab, const int* params, int* out,
                                  int maxlp, int* handoff, const float* stats, int nstat, int* slot_tokens) {
    __shared__ float sh[32];
    __shared__ float shv[32];
    __shared__ int shi[32];
    pdl_start();
    const int* p = params + blockIdx.x * SAMPLE_PARAMS;
    const float* l = logits + (size_t)p[0] * vocab;
    float temp = __int_as_float(p[1]);
    int topk = p[2];
    float topp = __int_as_float(p[3]);
    u64 seed = ((u64)(unsigned)p[5] << 32) | (unsigned)p[4];
    u64 index = (u64)(unsigned)p[6];
    int nlp = min(p[7], maxlp);
    int* o = out + blockIdx.x * (2 + 2 * maxlp);

    // Maximum (and greedy token), then the log partition function; and how
    // many values are NaN or infinite (all exponent bits set).
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    float m, logz;
    int greedy;
    bool done = false;
    if (stats) {
        // The LM head's partials: they saw every logit, so with no partial
        // flagging a non-finite one the row has none.
        const float* st = stats + (size_t)p[0] * nstat * 4;
        float flagged = 0.f;
        for (int i = threadIdx.x; i < nstat; i += blockDim.x) {
            float v = st[4 * i];
            int idx = __float_as_int(st[4 * i + 1]);
            flagged += __float_as_int(st[4 * i + 3]) ? 1.f : 0.f;
            if (better(v, idx, bv, bi)) {
                bv = v;
                bi = idx;
            }
        }
        block_argmax(&bv, &bi, shv, shi);
        if (block_sum(flagged, sh) == 0.f) {
            float z = 0.f;
            for (int i = threadIdx.x; i < nstat; i += blockDim.x) {
                z += st[4 * i + 2] * expf(st[4 * i] - bv);
            }
            m = bv;
            greedy = bi;
            logz = m + logf(block_sum(z, sh));
            done = true;
        } else {
            bv = NEG_INF;
            bi = 0x7fffffff;
        }
    }
    if (!done) {
        float bad = 0.f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float v = l[i];
            bad += (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u ? 1.f : 0.f;
            if (better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        bad = block_sum(bad, sh);  // every thread gets it: they all return below
        if (bad > 0.f) {
            if (threadIdx.x == 0) {
                o[0] = -1;
                o[1] = (int)bad;
                sample_handoff(handoff, slot_tokens, p, blockIdx.x, 0);
            }
            return;
        }
        block_argmax(&bv, &bi, shv, shi);
        m = bv;
        greedy = bi;
        float z = 0.f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            z += expf(l[i] - m);
        }
        logz = m + logf(block_sum(z, sh));
    }

    // Top alternatives: each pass finds the best pair after the previous one.
    float pv = POS_INF;
    int pi = -1;
    for (int k = 0; k < nlp; k++) {
        bv = NEG_INF;
        bi = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float v = l[i];
            if ((v < pv || (v == pv && i > pi)) && better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        block_argmax(&bv, &bi, shv, shi);
        if (threadIdx.x == 0) {
            o[2 + 2 * k] = bi;
            o[3 + 2 * k] = __float_as_int(bv - logz);
        }
        pv = bv;
        pi = bi;
    }

    int tok = greedy;
    if (temp > 0.f && topk != 1) {
        float invt = 1.f / temp;
        // Threshold keys are built bit by bit, from the top: the largest key
        // that still keeps enough tokens (top-k) or enough mass (top-p).
        unsigned thr = 0;
        if (topk > 0 && topk < vocab) {
            unsigned res = 0;
            for (int b = 31; b >= 0; b--) {
                unsigned cand = res | (1u << b);
                if (count_at_least(l, vocab, cand, sh) >= (float)topk) {
                    res = cand;
                }
            }
            thr = res;
        }
        if (topp > 0.f && topp < 1.f) {
            float target = topp * mass_at_least(l, vocab, thr, m, invt, sh);
            unsigned res = 0;
            for (int b = 31; b >= 0; b--) {
                unsigned cand = res | (1u << b);
                unsigned k = cand > thr ? cand : thr;
                if (mass_at_least(l, vocab, k, m, invt, sh) >= target) {
                    res = cand;
                }
            }
            thr = res > thr ? res : thr;
        }
        bv = NEG_INF;
        bi = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float v = l[i];
            if (fkey(v) >= thr) {
                float g = v * invt + gumbel(seed, index, (u64)i);
                if (better(g, i, bv, bi)) {
                    bv = g;
                    bi = i;
                }
            }
        }
        block_argmax(&bv, &bi, shv, shi);
        tok = bi;
    }
    if (threadIdx.x == 0) {
        o[0] = tok;
        o[1] = __float_as_int(l[tok] - logz);
        sample_handoff(handoff, slot_tokens, p, blockIdx.x, tok);
    }
}
