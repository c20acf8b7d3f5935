/* cuda_sample.cu -- The sample op: smp_sample (engine/sampler.c) where the logits are, so that
 * only the picked tokens and their log-probabilities come back to the host. The
 * log-probabilities (smp_logprobs: the raw distribution's, the pick's and the top-n
 * alternatives') are a second kernel over the same logits, launched only when asked.
 *
 * One cluster of C blocks (thread block clusters, sm_90) per row, each block a contiguous slice
 * of the vocabulary; C = 1 at large batches, up to 8 when few rows would leave SMs idle.
 * Every filter is a threshold found by radix select over 32-bit keys, with one histogram
 * (per-block shared memory, summed over the cluster through distributed shared memory) per
 * 11-bit digit:
 *   - top-k: the key of the k-th best value (keys order floats, ties broken by ascending id:
 *     a second select over the ids of the tied tokens);
 *   - top-p: the same over probability mass of the top-k set, to the first prefix whose mass
 *     reaches top_p of the set's;
 *   - the draw: a select over token ids weighted by the kept mass, to the token where the
 *     id-order cumulative mass passes u x total (smp_sample walks its kept set in id order too).
 * Probabilities are exp(v - max) as floats, summed as fixed-point integers (2^-S units), so
 * every sum is exact whatever the order, the slice boundaries or the cluster size: a row gives
 * the same bits in any batch. Penalized tokens (at most the row's list) are kept out of the
 * vocabulary scans by a per-block bitmap and visited from the list, with their f32 values. */
#include <cooperative_groups.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

namespace cg = cooperative_groups;

typedef unsigned long long u64;

#define SMP_THREADS 512                 /* per block; 2 blocks per SM */
#define SMP_WARPS (SMP_THREADS / 32)
#define SMP_DIGIT 11                    /* radix digit width */
#define SMP_BUCKETS (1 << SMP_DIGIT)    /* histogram buckets; each thread scans 4 */
#define SMP_CHUNK 256                   /* tokens per warp per step (32 lanes x 8): slices and
                                         * id ranges are multiples of it */
#define SMP_MAX_CLUSTER 8
#define SMP_GREEDY_EPS 1e-5f            /* smp_sample's SMP_GREEDY_EPS */
#define SMP_GOLDEN 0x9E3779B97F4A7C15ull
#define SMP_NONE 0xFFFFFFFFu
#define SMP_FULL 0xFFFFFFFFu

/* Dynamic shared memory: two histograms (a cluster reads one while the next pass fills the
 * other), then the penalty bitmap. */
#define SMP_HIST_BYTES (2 * SMP_BUCKETS * sizeof(u64))
#define SMP_FIXED_BYTES SMP_HIST_BYTES

typedef struct {
    const bf16 *logits;         /* [n][vocab] */
    const pd_sample_row *rows;  /* [n] (device copy) */
    const pd_penalty_tok *pen;  /* [n_pen] (device copy) */
    int32_t *tok;               /* [n] out */
    int32_t vocab;
    int32_t cluster;            /* blocks per row */
    int32_t shift;              /* fixed point: masses in units of 2^-shift */
    int32_t id_bits;            /* bits of vocab - 1 (at least 1) */
    int32_t vec;                /* rows are 16-byte aligned: 8-token vector loads */
    int32_t bitmap;             /* some row has penalties: the bitmap region exists */
} smp_args;

/* What one block knows about its row and slice. */
typedef struct {
    const bf16 *x;              /* the row's logits */
    const pd_penalty_tok *pen;  /* the row's penalty entries */
    int32_t pen_n;
    const uint8_t *bits;        /* bit t - lo: token t's value comes from pen; NULL if none */
    int32_t lo, hi;             /* this block's tokens [lo, hi) */
    int32_t vec;
    float rep, freq, pres;
} smp_slice;

/* The row's filters once known; every thread of the cluster holds the same copy. */
typedef struct {
    float temp;                 /* temperature (sampling rows) */
    float m;                    /* the largest scaled logit */
    float scale;                /* 2^shift */
    float min_p;
    bool hk, hp;                /* top-k / top-p on */
    uint32_t xk, xp;            /* boundary keys of the top-k / top-p sets */
    int32_t idk, idp;           /* tokens with the boundary key are kept up to this id */
} smp_filters;

enum { M_TOPK, M_TIEK, M_TOPP, M_TIEP, M_DRAW };  /* what a select pass weighs */
enum { T_GIVEN, T_TOPP, T_DRAW };                 /* how a select's target is set */

typedef struct {
    uint32_t b;                 /* the bucket where the target falls */
    u64 lt;                     /* weight of this level's buckets below b */
    u64 eq;                     /* weight of bucket b */
    u64 total;                  /* weight of this level */
    u64 target;
    int found;
} smp_step;

typedef struct {
    float m;                    /* block's best value */
    int32_t best;               /* its lowest id; INT32_MAX = none */
} smp_xchg;

/* ---- cluster helpers (a cluster of 1 is a block) ---- */

static __device__ __forceinline__ void cl_sync(int C)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (C > 1) {
        cg::this_cluster().sync();
        return;
    }
#endif
    __syncthreads();
}

/* The same shared variable in block `rank` of the cluster. */
template <class T>
static __device__ __forceinline__ T *cl_map(T *p, int C, int rank)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (C > 1) return cg::this_cluster().map_shared_rank(p, rank);
#else
    (void)C;
    (void)rank;
#endif
    return p;
}

/* ---- value helpers ---- */

static __device__ __forceinline__ u64 mix64(u64 z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* smp_uniform(seed, n) as its 53-bit integer U (u = U x 2^-53). */
static __device__ __forceinline__ u64 uniform53(u64 seed, int32_t n)
{
    u64 state = mix64(seed + SMP_GOLDEN);
    return mix64(state + ((u64)(long long)n + 1ull) * SMP_GOLDEN) >> 11;
}

/* Floats to unsigned keys in the same order (-0 and +0 must be made equal first). */
static __device__ __forceinline__ uint32_t fkey(float v)
{
    uint32_t u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* apply_penalties for one listed token, with smp_sample's float operations (no contraction). */
static __device__ __forceinline__ float pen_logit(float l, int32_t count, const smp_slice &c)
{
    if (c.rep != 1.0f) l = l > 0.0f ? __fdiv_rn(l, c.rep) : __fmul_rn(l, c.rep);
    if ((c.freq != 0.0f || c.pres != 0.0f) && count > 0) {
        l = __fsub_rn(l, __fmul_rn(c.freq, (float)count));
        l = __fsub_rn(l, c.pres);
    }
    return l;
}

/* The scaled logit of a sampling row: NaN -> -inf, -0 -> +0 (equal values, equal keys). */
static __device__ __forceinline__ float scaled(float l, float temp)
{
    float v = __fdiv_rn(l, temp);
    if (isnan(v)) v = -INFINITY;
    return v == 0.0f ? 0.0f : v;
}

static __device__ __forceinline__ float prob_of(const smp_filters &f, float v)
{
    return v == f.m ? 1.0f : expf(v - f.m);
}

static __device__ __forceinline__ u64 mass_of(const smp_filters &f, float p)
{
    return __float2ull_rn(p * f.scale);
}

static __device__ __forceinline__ bool in_k(const smp_filters &f, int32_t id, uint32_t key)
{
    return !f.hk || key > f.xk || (key == f.xk && id <= f.idk);
}

static __device__ __forceinline__ bool in_p(const smp_filters &f, int32_t id, uint32_t key)
{
    return !f.hp || key > f.xp || (key == f.xp && id <= f.idp);
}

/* The weight a select pass gives one token (0 = not taking part). */
static __device__ __forceinline__ u64 weight_of(const smp_filters &f, int mode, int32_t id,
                                                float v, uint32_t key)
{
    switch (mode) {
    case M_TOPK: return 1;
    case M_TIEK: return key == f.xk;
    case M_TOPP: return in_k(f, id, key) ? mass_of(f, prob_of(f, v)) : 0;
    case M_TIEP: return key == f.xp && in_k(f, id, key) ? mass_of(f, prob_of(f, v)) : 0;
    default: {
        if (!in_k(f, id, key) || !in_p(f, id, key)) return 0;
        float p = prob_of(f, v);
        if (f.min_p > 0.0f && !(p >= f.min_p)) return 0;
        return mass_of(f, p);
    }
    }
}

static __device__ __forceinline__ u64 warp_sum_u64(u64 v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SMP_FULL, v, o);
    return v;
}

/* Keeps the better of (bv, bi) and (v, i): larger value, lower id on ties. */
static __device__ __forceinline__ void best_merge(float &bv, int32_t &bi, float v, int32_t i)
{
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

/* ---- the scan over a block's tokens ---- */

/* Calls fe(valid, id, l, from_vocab) for every token of [a, b) in this block's slice, l being
 * its logit after the penalties: first the vocabulary in steps of 8 tokens per lane (whole
 * warps call fe together, with valid = false for padding and penalized tokens, so fe may use
 * warp intrinsics when from_vocab), then fi(first id of the warp's 256) after each step; then
 * the listed tokens of the range (whole warps again). a is a multiple of SMP_CHUNK. */
template <class FE, class FI>
static __device__ __forceinline__ void visit(const smp_slice &c, int32_t a, int32_t b, FE &&fe,
                                             FI &&fi)
{
    a = max(a, c.lo);
    b = min(b, c.hi);
    if (a >= b) return;
    const int lane = threadIdx.x & 31;
    const int32_t ga = a >> 3, gb = (b + 7) >> 3;
    for (int32_t base = ga + (int32_t)(threadIdx.x & ~31u); base < gb; base += SMP_THREADS) {
        const int32_t g = base + lane, t0 = g * 8;
        float l[8];
        unsigned skip = 0xFFu;
        if (g < gb) {
            skip = c.bits ? c.bits[(t0 - c.lo) >> 3] : 0u;
            if (c.vec && t0 + 8 <= b) {
                const uint4 q = *reinterpret_cast<const uint4 *>(c.x + t0);
                const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    l[2 * j] = __uint_as_float(w[j] << 16);
                    l[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    l[j] = 0.0f;
                    if (t0 + j < b) l[j] = pd_ld(c.x + t0 + j);
                    else skip |= 1u << j;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) l[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) fe(!((skip >> j) & 1u), t0 + j, l[j], true);
        fi(base * 8);
    }
    for (int32_t base = (int32_t)(threadIdx.x & ~31u); base < c.pen_n; base += SMP_THREADS) {
        const int32_t e = base + lane;
        bool ok = false;
        int32_t t = 0;
        float l = 0.0f;
        if (e < c.pen_n) {
            const pd_penalty_tok pt = c.pen[e];
            t = pt.token;
            if (t >= a && t < b) {
                ok = true;
                l = pen_logit(pd_ld(c.x + t), pt.count, c);
            }
        }
        fe(ok, t, l, false);
    }
}

/* ---- block and cluster reductions ---- */

__shared__ u64 s_wsum[SMP_WARPS];
__shared__ float s_wbv[SMP_WARPS];
__shared__ int32_t s_wbi[SMP_WARPS];
__shared__ smp_step s_step;
__shared__ smp_xchg s_x;

/* Exclusive prefix sum of v over the block in thread order; *total gets the block's sum. */
static __device__ u64 block_excl_scan(u64 v, u64 *total)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    u64 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 y = __shfl_up_sync(SMP_FULL, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s_wsum[w] = x;
    __syncthreads();
    u64 before = 0, all = 0;
    for (int i = 0; i < SMP_WARPS; i++) {
        u64 t = s_wsum[i];
        if (i < w) before += t;
        all += t;
    }
    *total = all;
    return before + x - v;
}

/* The block's best (value, id) into s_x (every thread must call; thread 0 writes; blocks of
 * up to SMP_THREADS). */
static __device__ void block_best(float bv, int32_t bi)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        best_merge(bv, bi, __shfl_xor_sync(SMP_FULL, bv, o), __shfl_xor_sync(SMP_FULL, bi, o));
    if ((threadIdx.x & 31) == 0) {
        s_wbv[threadIdx.x >> 5] = bv;
        s_wbi[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < (int)(blockDim.x >> 5); i++) best_merge(bv, bi, s_wbv[i], s_wbi[i]);
        s_x.m = bv;
        s_x.best = bi;
    }
}

/* After a cluster sync: the best (value, id) over the cluster's blocks. */
static __device__ void cluster_best(int C, float *m, int32_t *best)
{
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    for (int r = 0; r < C; r++) {
        const smp_xchg *x = cl_map(&s_x, C, r);
        best_merge(bv, bi, x->m, x->best);
    }
    *m = bv;
    *best = bi;
}

/* After a cluster sync: sums the cluster's histograms h (nb buckets, 4 per thread, in bucket
 * order) and finds the bucket where the target falls: the first b with
 * before + sum(buckets < b) < target <= before + sum(buckets <= b). At a select's first level
 * tmode sets the target from the level's total: T_TOPP ceil(top_p x total) in [1, total],
 * T_DRAW floor(U x total / 2^53) + 1. Returns the same step in every thread of the cluster. */
static __device__ smp_step merge_find(int C, u64 *h, int nb, u64 before, int tmode, u64 target,
                                      float top_p, u64 U)
{
    u64 v[4], s = 0;
    if (threadIdx.x == 0) s_step.found = 0;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int b = (int)threadIdx.x * 4 + q;
        v[q] = 0;
        if (b < nb)
            for (int r = 0; r < C; r++) v[q] += cl_map(h, C, r)[b];
        s += v[q];
    }
    u64 total;
    u64 c = before + block_excl_scan(s, &total);
    if (tmode == T_TOPP) {
        double cut = ceil((double)top_p * (double)total);
        target = cut < 1.0 ? 1 : cut >= (double)total ? total : (u64)cut;
    } else if (tmode == T_DRAW) {
        target = ((__umul64hi(U, total) << 11) | ((U * total) >> 53)) + 1;
    }
#pragma unroll
    for (int q = 0; q < 4; q++) {
        if (v[q] && c < target && target <= c + v[q]) {
            s_step.b = threadIdx.x * 4 + q;
            s_step.lt = c - before;
            s_step.eq = v[q];
            s_step.found = 1;
        }
        c += v[q];
    }
    __syncthreads();
    smp_step st = s_step;
    st.total = total;
    st.target = target;
    __syncthreads(); /* s_step and s_wsum are free again */
    return st;
}

typedef struct {
    uint32_t r;                 /* the selected key or id */
    u64 lt;                     /* weight before it */
    u64 eq;                     /* weight of the tokens with exactly r */
    u64 total;                  /* weight of all participants */
    u64 target;
    int found;
} smp_sel;

/* Digits of a select over nbits-bit keys: the first takes what the 11-bit others leave. */
static __device__ __forceinline__ int first_width(int nbits)
{
    return nbits - SMP_DIGIT * ((nbits + SMP_DIGIT - 1) / SMP_DIGIT - 1);
}

/* One histogram pass of a select: adds the weight of every participant whose key matches
 * `prefix` above the digit [shift, shift + width) into h[digit]. Keys are ~fkey (best first)
 * for value selects, token ids for id selects (then only that id range is read). Counts of a
 * value select go in warp-aggregated; id digits at or above bit 8 are uniform over a warp's
 * 256 tokens and go in as one warp sum. */
static __device__ void hist_pass(const smp_slice &c, const smp_filters &f, int mode,
                                 bool id_mode, int shift, int width, uint32_t prefix, u64 *h)
{
    const uint32_t mask = (1u << width) - 1u;
    const int up = shift + width;
    const int lane = threadIdx.x & 31;
    const bool counts = !id_mode && mode == M_TOPK;
    const bool warp_acc = id_mode && shift >= 8;
    int32_t a = 0, b = INT32_MAX;
    if (id_mode) {
        long long ra = (long long)prefix << up, rb = ra + (1ll << up);
        a = (int32_t)min(ra, (long long)INT32_MAX);
        b = (int32_t)min(rb, (long long)INT32_MAX);
    }
    u64 acc = 0;
    visit(
        c, a, b,
        [&](bool valid, int32_t id, float l, bool vocab) {
            uint32_t bucket = SMP_NONE;
            u64 w = 0;
            if (valid) {
                const float v = scaled(l, f.temp);
                const uint32_t key = fkey(v);
                w = weight_of(f, mode, id, v, key);
                const uint32_t R = id_mode ? (uint32_t)id : ~key;
                if (w && ((u64)R >> up) == (u64)prefix) {
                    bucket = (R >> shift) & mask;
                } else {
                    w = 0;
                }
            }
            if (vocab && warp_acc) {
                acc += w;
            } else if (vocab && counts) {
                const unsigned peers = __match_any_sync(SMP_FULL, bucket);
                if (bucket != SMP_NONE && lane == __ffs(peers) - 1)
                    atomicAdd(&h[bucket], (u64)__popc(peers));
            } else if (bucket != SMP_NONE) {
                atomicAdd(&h[bucket], w);
            }
        },
        [&](int32_t first) {
            if (!warp_acc) return;
            const u64 s = warp_sum_u64(acc);
            acc = 0;
            if (lane == 0 && s) atomicAdd(&h[((uint32_t)first >> shift) & mask], s);
        });
}

/* A whole select: digit passes from the top, each followed by a cluster sync and merge_find.
 * With prebuilt the first digit's histogram is already in hist buffer *buf. Returns the key
 * (or id) of the first participant, in key order, at which the cumulative weight reaches the
 * target, with the weights around it; found = 0 when the participants weigh nothing. */
static __device__ smp_sel radix_select(int C, int *buf, u64 *hist, const smp_slice &c,
                                 const smp_filters &f, int mode, bool id_mode, int nbits,
                                 int tmode, u64 target, float top_p, u64 U, bool prebuilt)
{
    const int npass = (nbits + SMP_DIGIT - 1) / SMP_DIGIT;
    smp_sel res;
    res.r = 0;
    res.lt = res.eq = res.total = 0;
    res.target = target;
    res.found = 0;
    uint32_t prefix = 0;
    u64 before = 0;
    int shift = nbits;
    for (int d = 0; d < npass; d++) {
        const int width = d ? SMP_DIGIT : first_width(nbits);
        shift -= width;
        u64 *h = hist + (size_t)*buf * SMP_BUCKETS;
        *buf ^= 1;
        if (!(d == 0 && prebuilt)) {
            for (int i = threadIdx.x; i < (1 << width); i += SMP_THREADS) h[i] = 0;
            __syncthreads();
            hist_pass(c, f, mode, id_mode, shift, width, prefix, h);
        }
        cl_sync(C);
        const smp_step st = merge_find(C, h, 1 << width, before, d ? T_GIVEN : tmode, target,
                                       top_p, U);
        if (d == 0) {
            res.total = st.total;
            target = st.target;
        }
        if (!st.found) return res;
        before += st.lt;
        prefix = (prefix << width) | st.b;
        res.eq = st.eq;
    }
    res.r = prefix;
    res.lt = before;
    res.target = target;
    res.found = 1;
    return res;
}

/* ---- the kernel ---- */

/* The block of cluster rank r holds token chunks [r x chunks / C, (r + 1) x chunks / C). */
static __device__ __forceinline__ int32_t slice_start(int32_t vocab, int C, int r)
{
    const long long chunks = (vocab + SMP_CHUNK - 1) / SMP_CHUNK;
    return (int32_t)min((long long)vocab, chunks * r / C * SMP_CHUNK);
}

static __device__ void emit(const smp_args &a, int rank, int row, int32_t tok)
{
    if (rank == 0 && threadIdx.x == 0) a.tok[row] = tok;
}

static __device__ void sample_greedy(const smp_args &a, const smp_slice &c, int rank, int row)
{
    const int C = a.cluster;
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    visit(
        c, c.lo, c.hi,
        [&](bool valid, int32_t id, float l, bool) {
            if (valid && l > -INFINITY) best_merge(bv, bi, l, id); /* NaN fails the test */
        },
        [](int32_t) {});
    block_best(bv, bi);
    cl_sync(C);
    float m;
    int32_t best;
    cluster_best(C, &m, &best);
    (void)m;
    emit(a, rank, row, best == INT32_MAX ? 0 : best); /* nothing can win: 0, as smp_sample */
}

static __device__ void sample_filtered(const smp_args &a, const smp_slice &c,
                                       const pd_sample_row &rw, int rank, int row, u64 *hist)
{
    const int C = a.cluster;
    smp_filters f;
    f.temp = rw.temperature;
    f.m = 0.0f;
    f.scale = (float)(1ull << a.shift);
    f.min_p = rw.min_p;
    f.hk = rw.top_k > 0 && rw.top_k < a.vocab;
    f.hp = rw.top_p < 1.0f;
    f.xk = f.xp = 0;
    f.idk = f.idp = INT32_MAX;
    int buf = 0;

    /* Pass 1: the largest scaled logit, fused with the top-k select's first digit (keys do
     * not depend on the maximum). */
    const int w0 = first_width(32), s0 = 32 - w0;
    if (f.hk) {
        for (int i = threadIdx.x; i < (1 << w0); i += SMP_THREADS) hist[i] = 0;
        __syncthreads();
    }
    const int lane = threadIdx.x & 31;
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    visit(
        c, c.lo, c.hi,
        [&](bool valid, int32_t id, float l, bool vocab) {
            uint32_t bucket = SMP_NONE;
            if (valid) {
                const float v = scaled(l, f.temp);
                best_merge(bv, bi, v, id);
                bucket = ~fkey(v) >> s0;
            }
            if (!f.hk) return;
            if (vocab) {
                const unsigned peers = __match_any_sync(SMP_FULL, bucket);
                if (bucket != SMP_NONE && lane == __ffs(peers) - 1)
                    atomicAdd(&hist[bucket], (u64)__popc(peers));
            } else if (bucket != SMP_NONE) {
                atomicAdd(&hist[bucket], 1ull);
            }
        },
        [](int32_t) {});
    block_best(bv, bi);
    cl_sync(C);
    int32_t best;
    cluster_best(C, &f.m, &best);
    if (f.m == -INFINITY) { /* smp_sample falls back to greedy: no token can win */
        emit(a, rank, row, 0);
        return;
    }
    const u64 U = uniform53(rw.seed, rw.n_output);
    if (f.hk) {
        const u64 k = (u64)rw.top_k;
        const smp_sel s = radix_select(C, &buf, hist, c, f, M_TOPK, false, 32, T_GIVEN, k, 0.0f, 0,
                                 true);
        f.xk = ~s.r;
        if (s.lt + s.eq > k) /* only the lowest ids of the boundary value fit */
            f.idk = (int32_t)radix_select(C, &buf, hist, c, f, M_TIEK, true, a.id_bits, T_GIVEN,
                                    k - s.lt, 0.0f, 0, false).r;
    }
    if (f.hp) {
        const smp_sel s = radix_select(C, &buf, hist, c, f, M_TOPP, false, 32, T_TOPP, 0, rw.top_p, 0,
                                 false);
        f.xp = ~s.r;
        f.idp = (int32_t)radix_select(C, &buf, hist, c, f, M_TIEP, true, a.id_bits, T_GIVEN,
                                s.target - s.lt, 0.0f, 0, false).r;
    }
    const smp_sel d = radix_select(C, &buf, hist, c, f, M_DRAW, true, a.id_bits, T_DRAW, 0, 0.0f, U,
                             false);
    /* nothing kept with mass (min_p > 1): the best token */
    emit(a, rank, row, d.found ? (int32_t)d.r : best);
}

static __global__ void __launch_bounds__(SMP_THREADS, 2) sample_kernel(smp_args a)
{
    extern __shared__ __align__(16) unsigned char smp_dyn[];
    u64 *hist = reinterpret_cast<u64 *>(smp_dyn);
    uint32_t *bitmap = reinterpret_cast<uint32_t *>(smp_dyn + SMP_FIXED_BYTES);
    const int C = a.cluster;
    const int rank = (int)(blockIdx.x % (unsigned)C), row = (int)(blockIdx.x / (unsigned)C);
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
    if (C > 1) __trap(); /* the host launches clusters only for kernels built for sm_90+ */
#endif
    const pd_sample_row rw = a.rows[row];
    smp_slice c;
    c.x = a.logits + (size_t)row * (size_t)a.vocab;
    c.pen = a.pen + rw.pen_off;
    c.pen_n = rw.pen_n;
    c.lo = slice_start(a.vocab, C, rank);
    c.hi = slice_start(a.vocab, C, rank + 1);
    c.vec = a.vec;
    c.rep = rw.repetition_penalty;
    c.freq = rw.frequency_penalty;
    c.pres = rw.presence_penalty;
    c.bits = NULL;
    if (c.pen_n > 0 && a.bitmap && c.lo < c.hi) {
        const int32_t words = (c.hi - c.lo + 31) / 32;
        for (int32_t i = threadIdx.x; i < words; i += SMP_THREADS) bitmap[i] = 0;
        __syncthreads();
        for (int32_t e = threadIdx.x; e < c.pen_n; e += SMP_THREADS) {
            const int32_t t = c.pen[e].token - c.lo;
            if (t >= 0 && t < c.hi - c.lo) atomicOr(&bitmap[t >> 5], 1u << (t & 31));
        }
        __syncthreads();
        c.bits = reinterpret_cast<const uint8_t *>(bitmap);
    }
    if (!(rw.temperature >= SMP_GREEDY_EPS)) sample_greedy(a, c, rank, row);
    else sample_filtered(a, c, rw, rank, row, hist);
    cl_sync(C); /* no block leaves while another may still read its shared memory */
}

/* ---- the greedy rows alone ---- */

/* Rows that are all greedy, without penalties or log-probabilities, need only each row's first
 * largest logit: up to GR_MAX_BLOCKS blocks a row (no cluster, no rows uploaded), each the best of its
 * slice into part; the last block of a row (a counter, reset by it) takes the best of those.
 * The same pick as sample_greedy: the largest value, the lowest id among equals, NaN never. */
#define GR_THREADS 256 /* at most SMP_THREADS (block_best) */
#define GR_MAX_BLOCKS 64

static __global__ void __launch_bounds__(GR_THREADS) greedy_kernel(const bf16 *logits,
                                                                   int32_t vocab, int32_t nb,
                                                                   int32_t vec, float2 *part,
                                                                   unsigned *count,
                                                                   int32_t *tok, int32_t *ids)
{
    __shared__ bool last;
    const int32_t row = (int32_t)blockIdx.x / nb, b = (int32_t)blockIdx.x % nb;
    const bf16 *x = logits + (size_t)row * (size_t)vocab;
    const int32_t per = (vocab / 8 + nb - 1) / nb * 8; /* whole 8s a block */
    const int32_t lo = min(vocab, b * per), hi = b + 1 == nb ? vocab : min(vocab, lo + per);
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    if (vec) { /* vocab % 8 == 0: every slice is whole 8s */
        for (int32_t i = lo + 8 * (int32_t)threadIdx.x; i < hi; i += 8 * GR_THREADS) {
            const uint4 v = __ldcg(reinterpret_cast<const uint4 *>(x + i));
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float l = e & 1 ? pd_bf16_hi(w[e >> 1]) : pd_bf16_lo(w[e >> 1]);
                if (l > -INFINITY) best_merge(bv, bi, l, i + e); /* NaN fails the test */
            }
        }
    } else {
        for (int32_t i = lo + (int32_t)threadIdx.x; i < hi; i += GR_THREADS) {
            const float l = __bfloat162float(x[i]);
            if (l > -INFINITY) best_merge(bv, bi, l, i);
        }
    }
    block_best(bv, bi);
    if (threadIdx.x == 0) {
        part[(size_t)row * nb + b] = make_float2(s_x.m, __int_as_float(s_x.best));
        __threadfence();
        last = atomicAdd(&count[row], 1u) == (unsigned)nb - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = -INFINITY;
    bi = INT32_MAX;
    for (int32_t i = (int32_t)threadIdx.x; i < nb; i += GR_THREADS) {
        const float2 v = __ldcg(part + (size_t)row * nb + i);
        best_merge(bv, bi, v.x, __float_as_int(v.y));
    }
    block_best(bv, bi);
    if (threadIdx.x == 0) {
        const int32_t t = s_x.best == INT32_MAX ? 0 : s_x.best; /* nothing can win: 0, as smp_sample */
        tok[row] = t;
        if (ids) ids[row] = t; /* the next step's input */
        count[row] = 0; /* for the next launch */
    }
}

/* ---- log-probabilities of the raw distribution (smp_logprobs) ---- */

/* One block a row whose n_top is >= 0: each thread keeps an online log-sum-exp of its tokens
 * and a sorted list of its K best (K >= every row's n_top, a template parameter so that the
 * list lives in registers: every index is a constant once the loops unroll), visiting its
 * tokens in ascending id order so that a later equal value never enters; each warp then merges
 * its lanes' lists into one (n_top rounds of a shuffle arg-max), and warp 0 merges the warps'
 * (from shared memory) and writes the row's pick logprob and list (token -1 past the tokens
 * whose logit is above -inf). Only those n_top pairs and one float a row go to the host. */
#define LP_THREADS 512
#define LP_WARPS (LP_THREADS / 32)
#define LP_K PD_MAX_TOP_LOGPROBS

typedef struct {
    const bf16 *logits;         /* [n][vocab] */
    const pd_sample_row *rows;  /* [n] (device copy): n_top */
    const int32_t *tok;         /* [n] the picks (the sample kernel's output) */
    float *lp;                  /* [n] out */
    pd_top_logprob *top;        /* [n][stride] out */
    int32_t vocab;
    int32_t stride;             /* entries a row in top: the call's largest n_top */
    int32_t vec;                /* 16-byte aligned rows: 8-token vector loads */
} lp_args;

static __device__ __forceinline__ bool lp_better(float va, int32_t a, float vb, int32_t b)
{
    return va > vb || (va == vb && a < b);
}

/* (m, s) += (m2, s2) for sums of exp(v - m): the larger maximum rescales the other sum. */
static __device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2)
{
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) {
        m = m2;
        s = s2;
    } else if (m2 > m) {
        s = s * expf(m - m2) + s2;
        m = m2;
    } else {
        s += s2 * expf(m2 - m);
    }
}

/* The better of each lane's (v, i) over the warp, in every lane. */
static __device__ __forceinline__ void warp_argbest(float &v, int32_t &i)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(SMP_FULL, v, o);
        const int32_t oi = __shfl_xor_sync(SMP_FULL, i, o);
        if (lp_better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

/* One token of a thread's: into its online log-sum-exp (m, sum) and, when it passes the bar
 * (its list's last value; +inf when nothing is listed), into its sorted list tv / ti. */
template <int K>
static __device__ __forceinline__ void lp_see(float v, int32_t id, float &m, float &sum,
                                              float &bar, float (&tv)[K], int32_t (&ti)[K])
{
    if (!(v > -INFINITY)) return; /* -inf and NaN: no mass, never listed */
    if (v > m) {
        sum = sum * expf(m - v) + 1.0f;
        m = v;
    } else {
        sum += expf(v - m);
    }
    if (!(v > bar)) return;
    float cv = v;
    int32_t ci = id;
#pragma unroll
    for (int j = 0; j < K; j++) {
        if (lp_better(cv, ci, tv[j], ti[j])) {
            const float t = tv[j];
            const int32_t u = ti[j];
            tv[j] = cv;
            ti[j] = ci;
            cv = t;
            ci = u;
        }
    }
    bar = tv[K - 1];
}

template <int K>
static __global__ void __launch_bounds__(LP_THREADS) logprob_kernel(lp_args a)
{
    __shared__ float s_m[LP_WARPS], s_s[LP_WARPS];
    __shared__ float s_tv[LP_WARPS][LP_K];
    __shared__ int32_t s_ti[LP_WARPS][LP_K];
    const int row = (int)blockIdx.x, lane = (int)(threadIdx.x & 31), w = (int)(threadIdx.x >> 5);
    const int n = a.rows[row].n_top;
    if (n < 0) {
        if (threadIdx.x == 0) a.lp[row] = 0.0f;
        return;
    }
    const bf16 *x = a.logits + (size_t)row * (size_t)a.vocab;
    float tv[K];
    int32_t ti[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
        tv[j] = -INFINITY;
        ti[j] = INT32_MAX;
    }
    float bar = n > 0 ? -INFINITY : INFINITY; /* what a value must pass to enter: tv[K - 1] */
    float m = -INFINITY, sum = 0.0f;
    if (a.vec) {
        for (int32_t g = (int32_t)threadIdx.x; g < a.vocab / 8; g += LP_THREADS) {
            const uint4 q = *reinterpret_cast<const uint4 *>(x + (size_t)g * 8);
            const uint32_t wd[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int e = 0; e < 8; e++)
                lp_see<K>(e & 1 ? pd_bf16_hi(wd[e >> 1]) : pd_bf16_lo(wd[e >> 1]), g * 8 + e, m,
                          sum, bar, tv, ti);
        }
    } else {
        for (int32_t i = (int32_t)threadIdx.x; i < a.vocab; i += LP_THREADS)
            lp_see<K>(pd_ld(x + i), i, m, sum, bar, tv, ti);
    }
    /* the warp's sum and list */
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(SMP_FULL, m, o), s2 = __shfl_xor_sync(SMP_FULL, sum, o);
        lse_merge(m, sum, m2, s2);
    }
    if (lane == 0) {
        s_m[w] = m;
        s_s[w] = sum;
    }
    for (int r = 0; r < n; r++) {
        float bv = tv[0];
        int32_t bi = ti[0];
        warp_argbest(bv, bi);
        if (bi != INT32_MAX && ti[0] == bi) { /* this lane's head won: the next moves up */
#pragma unroll
            for (int j = 0; j + 1 < K; j++) {
                tv[j] = tv[j + 1];
                ti[j] = ti[j + 1];
            }
            tv[K - 1] = -INFINITY;
            ti[K - 1] = INT32_MAX;
        }
        if (lane == 0) {
            s_tv[w][r] = bv;
            s_ti[w][r] = bi;
        }
    }
    __syncthreads();
    if (w != 0) return;
    /* warp 0: the row's */
    m = lane < LP_WARPS ? s_m[lane] : -INFINITY;
    sum = lane < LP_WARPS ? s_s[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(SMP_FULL, m, o), s2 = __shfl_xor_sync(SMP_FULL, sum, o);
        lse_merge(m, sum, m2, s2);
    }
    const double lse = m == -INFINITY ? -INFINITY : (double)m + log((double)sum);
    pd_top_logprob *out = a.top + (size_t)row * (size_t)a.stride;
    int p = 0; /* this lane's next entry of warp `lane`'s list */
    for (int r = 0; r < n; r++) {
        const bool has = lane < LP_WARPS && p < n;
        float bv = has ? s_tv[lane][p] : -INFINITY;
        int32_t bi = has ? s_ti[lane][p] : INT32_MAX;
        const int32_t mine = bi;
        warp_argbest(bv, bi);
        if (has && bi != INT32_MAX && mine == bi) p++;
        if (lane == 0) {
            pd_top_logprob e;
            e.token = bi == INT32_MAX ? -1 : bi;
            e.logprob = bi == INT32_MAX ? 0.0f : (float)((double)bv - lse);
            out[r] = e;
        }
    }
    if (lane == 0) {
        const int32_t t = a.tok[row];
        const float v = t >= 0 && t < a.vocab ? pd_ld(x + t) : NAN;
        a.lp[row] = v > -INFINITY ? (float)((double)v - lse) : -INFINITY;
    }
}

/* ---- host side ---- */

/* One set of the op's buffers: pinned host memory (rows | penalty list | tokens | logprobs |
 * top lists) and its device twin, of `bytes` each. */
typedef struct {
    unsigned char *host;
    unsigned char *dev;
    unsigned char *host_dev;    /* host as the device addresses it (mapped), or NULL */
    size_t bytes;
} smp_buf;

/* The sets: SMP_SYNC for the sample op, 0 and 1 for sample_launch's slots (a slot's set is
 * reused only once its last launch was collected). */
#define SMP_SYNC PD_SAMPLE_SYNC_SLOT

typedef struct {
    smp_buf buf[3];
    cudaEvent_t done[2];        /* sample_launch: recorded after the slot's results */
    int32_t n[2];               /* sample_launch: the slot's rows, */
    size_t out_off[2];          /* where its results are in its set, */
    bool want_lp[2];            /* whether it computed logprobs, */
    int32_t stride[2];          /* and entries a row in its top lists */
    bool picked[2];             /* whether its tokens are decode_layers' picks (pick_host) */
    uint32_t *mark;             /* duplicate check: stamp per token, mark_n tokens */
    int32_t mark_n;
    uint32_t stamp;
    size_t smem_max;            /* the device's opt-in limit per block */
    float2 *gr_part;            /* greedy_kernel: [gr_rows][GR_MAX_BLOCKS] bests */
    unsigned *gr_count;         /* [gr_rows] blocks done, zero between launches (the launches
                                 * of both slots run in queue order: one scratch serves) */
    int32_t gr_rows;
    int max_cluster;            /* 8 with thread block clusters, 1 without */
} smp_state;

extern "C" void pd_cuda__sample_free(void *state)
{
    smp_state *st = (smp_state *)state;
    if (!st) return;
    for (int i = 0; i < 3; i++) {
        if (st->buf[i].host) (void)cudaFreeHost(st->buf[i].host);
        if (st->buf[i].dev) (void)cudaFree(st->buf[i].dev);
    }
    for (int i = 0; i < 2; i++)
        if (st->done[i]) (void)cudaEventDestroy(st->done[i]);
    if (st->gr_part) (void)cudaFree(st->gr_part);
    if (st->gr_count) (void)cudaFree(st->gr_count);
    free(st->mark);
    free(st);
}

static int state_get(pd_cuda_ctx *c, smp_state **out)
{
    if (!c->sample_state) {
        smp_state *st = (smp_state *)calloc(1, sizeof *st);
        if (!st) return PD_ENOMEM;
        int major = 0, optin = 0;
        cudaFuncAttributes fa;
        cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->device);
        if (e == cudaSuccess)
            e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c->device);
        if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, sample_kernel);
        if (e != cudaSuccess) {
            pd_cuda__report("sample: device attributes", cudaGetErrorString(e), __FILE__, __LINE__);
            free(st);
            return PD_EBACKEND;
        }
        /* Clusters need the device and the kernel's machine code to be sm_90 or newer.
         * PDSERVE_CUDA_SAMPLE_CLUSTER=1|2|4|8 caps the blocks per row (for A/B runs: the
         * results are the same bits whatever the cap). */
        st->max_cluster = major >= 9 && fa.binaryVersion >= 90 ? SMP_MAX_CLUSTER : 1;
        const int64_t cap = pd_env_int("PDSERVE_CUDA_SAMPLE_CLUSTER");
        if (cap >= 1)
            while (st->max_cluster > cap) st->max_cluster >>= 1;
        st->smem_max = (size_t)optin - fa.sharedSizeBytes;
        /* Once for all: the limit only allows; each launch asks for what it needs. */
        e = cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)st->smem_max);
        if (e != cudaSuccess) {
            pd_cuda__report("cudaFuncSetAttribute(sample_kernel)", cudaGetErrorString(e),
                            __FILE__, __LINE__);
            free(st);
            return PD_EBACKEND;
        }
        for (int i = 0; i < 2; i++) {
            e = cudaEventCreateWithFlags(&st->done[i], cudaEventDisableTiming);
            if (e != cudaSuccess) {
                pd_cuda__report("cudaEventCreateWithFlags(&st->done[i])", cudaGetErrorString(e),
                                __FILE__, __LINE__);
                pd_cuda__sample_free(st);
                return PD_EBACKEND;
            }
        }
        c->sample_state = st;
    }
    *out = (smp_state *)c->sample_state;
    return 0;
}

static size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }

/* Checks what the kernel relies on: ranges, and penalty tokens distinct within a row (each is
 * visited once). Uses st->mark, grown to the vocabulary. */
static int validate(smp_state *st, void *logits, int32_t n, int32_t vocab,
                    const pd_sample_row *rows, const pd_penalty_tok *pen, int32_t n_pen,
                    const int32_t *tokens)
{
    if (!logits || n <= 0 || vocab <= 0 || !rows || !tokens || n_pen < 0 || (n_pen > 0 && !pen))
        return PD_EINVAL;
    for (int32_t i = 0; i < n_pen; i++)
        if (pen[i].token < 0 || pen[i].token >= vocab || pen[i].count < 0) return PD_EINVAL;
    bool any = false;
    for (int32_t r = 0; r < n; r++) {
        const pd_sample_row *w = &rows[r];
        if (w->pen_off < 0 || w->pen_n < 0 || (int64_t)w->pen_off + w->pen_n > n_pen ||
            w->n_top > PD_MAX_TOP_LOGPROBS)
            return PD_EINVAL;
        any |= w->pen_n > 0;
    }
    if (!any) return 0;
    if (st->mark_n < vocab) {
        uint32_t *m = (uint32_t *)calloc((size_t)vocab, sizeof *m);
        if (!m) return PD_ENOMEM;
        free(st->mark);
        st->mark = m;
        st->mark_n = vocab;
        st->stamp = 0;
    }
    for (int32_t r = 0; r < n; r++) {
        if (++st->stamp == 0) {
            memset(st->mark, 0, (size_t)st->mark_n * sizeof *st->mark);
            st->stamp = 1;
        }
        const pd_penalty_tok *p = pen + rows[r].pen_off;
        for (int32_t i = 0; i < rows[r].pen_n; i++) {
            if (st->mark[p[i].token] == st->stamp) return PD_EINVAL;
            st->mark[p[i].token] = st->stamp;
        }
    }
    return 0;
}

/* Blocks per row: enough to give every SM about two blocks, at most 8 (a portable cluster). */
static int pick_cluster(const pd_cuda_ctx *c, const smp_state *st, int32_t n, int32_t vocab)
{
    const int32_t chunks = (vocab + SMP_CHUNK - 1) / SMP_CHUNK;
    int C = st->max_cluster;
    while (C > 1 && ((int64_t)n * C > 2 * (int64_t)c->sm_count || C > chunks)) C >>= 1;
    return C;
}

static size_t smem_bytes(int32_t vocab, int C, bool bitmap)
{
    if (!bitmap) return SMP_FIXED_BYTES;
    const int64_t chunks = (vocab + SMP_CHUNK - 1) / SMP_CHUNK;
    const int64_t per = (chunks + C - 1) / C * SMP_CHUNK; /* tokens of the largest slice */
    return SMP_FIXED_BYTES + (size_t)(per / 8);
}

static cudaError_t launch(pd_cuda_ctx *c, const smp_args &a, int32_t n, size_t smem)
{
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1] = {};
    cfg.gridDim = dim3((unsigned)n * (unsigned)a.cluster);
    cfg.blockDim = dim3(SMP_THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    if (a.cluster > 1) {
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = (unsigned)a.cluster;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, sample_kernel, a);
}

/* Set b at least `need` bytes (what it held is not kept). */
static int buf_reserve(smp_buf *b, size_t need)
{
    if (need <= b->bytes) return 0;
    const size_t want = (need + 65535) & ~(size_t)65535;
    if (b->host) (void)cudaFreeHost(b->host);
    if (b->dev) (void)cudaFree(b->dev);
    b->host = b->dev = b->host_dev = NULL;
    b->bytes = 0;
    PD_CUDA_CHECK(cudaMallocHost((void **)&b->host, want));
    PD_CUDA_CHECK(cudaMalloc((void **)&b->dev, want));
    b->bytes = want;
    if (cudaHostGetDevicePointer((void **)&b->host_dev, b->host, 0) != cudaSuccess) {
        b->host_dev = NULL; /* not mapped: the tokens come back by copy */
        (void)cudaGetLastError();
    }
    return 0;
}

/* Whether every row's first largest logit is all it takes. */
static bool all_greedy(const pd_sample_row *rows, int32_t n, bool want_lp)
{
    if (want_lp) return false;
    for (int32_t r = 0; r < n; r++)
        if (rows[r].temperature >= SMP_GREEDY_EPS || rows[r].pen_n != 0) return false;
    return true;
}

/* Whether the greedy picks the last forward left (decode_layers: pd_decode_args' pick_ids)
 * answer this call: the same logits, rows that are all greedy, the ids (if any) where the
 * picks went. They are used once. */
static bool take_picks(pd_cuda_ctx *c, const void *logits, int32_t n, int32_t vocab,
                       const pd_sample_row *rows, bool want_lp, const int32_t *ids)
{
    const pd_cuda_pick k = c->pick;
    c->pick.on = false;
    return k.on && logits == k.logits && n == k.n && vocab == k.vocab && (!ids || ids == k.ids) &&
           all_greedy(rows, n, want_lp);
}

/* n tokens of the picks in pick_host's slot (once the queue got past their launch). */
static void take_picked(const pd_cuda_ctx *c, int slot, int32_t n, int32_t *tokens)
{
    memcpy(tokens, c->pick_host + (size_t)slot * PD_PICK_ROWS, (size_t)n * sizeof *tokens);
}

/* Queues the op for n validated rows through set b: the rows and penalty list go in with one
 * copy; the tokens reach b's pinned memory at *out_off when the queue gets there, with
 * want_lp the logprobs after them (from the next 16 bytes: see take) and the top lists, *stride
 * entries a row (the largest n_top asked). With ids (device memory), the tokens go there too. */
static int enqueue(pd_cuda_ctx *c, smp_state *st, smp_buf *b, void *logits, int32_t n,
                   int32_t vocab, const pd_sample_row *rows, const pd_penalty_tok *pen,
                   int32_t n_pen, bool want_lp, int32_t *ids, size_t *out_off, int32_t *stride)
{
    bool bitmap = false;
    for (int32_t r = 0; r < n && !bitmap; r++) bitmap = rows[r].pen_n > 0;
    *stride = 0;
    for (int32_t r = 0; r < n && want_lp; r++)
        if (rows[r].n_top > *stride) *stride = rows[r].n_top;
    const size_t rows_b = align16((size_t)n * sizeof *rows);
    const size_t in_b = rows_b + align16((size_t)n_pen * sizeof *pen);
    const size_t tok_b = align16((size_t)n * sizeof(int32_t));
    const size_t lp_b = align16((size_t)n * sizeof(float));
    const size_t out_b =
        tok_b + (want_lp ? lp_b + (size_t)n * (size_t)*stride * sizeof(pd_top_logprob) : 0);
    int rc = buf_reserve(b, in_b + out_b);
    if (rc < 0) return rc;
    *out_off = in_b;

    if (all_greedy(rows, n, want_lp)) { /* nothing uploaded */
        if (n > st->gr_rows) {
            if (st->gr_part) (void)cudaFree(st->gr_part);
            if (st->gr_count) (void)cudaFree(st->gr_count);
            st->gr_part = NULL;
            st->gr_count = NULL;
            st->gr_rows = 0;
            PD_CUDA_CHECK(cudaMalloc((void **)&st->gr_part,
                                     (size_t)n * GR_MAX_BLOCKS * sizeof(float2)));
            PD_CUDA_CHECK(cudaMalloc((void **)&st->gr_count, (size_t)n * sizeof(unsigned)));
            PD_CUDA_CHECK(cudaMemsetAsync(st->gr_count, 0, (size_t)n * sizeof(unsigned), c->stream));
            st->gr_rows = n;
        }
        /* about two blocks an SM, each at least 8 tokens a thread */
        int32_t nb = 2 * c->sm_count / n;
        const int32_t most = (vocab + 8 * GR_THREADS - 1) / (8 * GR_THREADS);
        if (nb > most) nb = most;
        if (nb > GR_MAX_BLOCKS) nb = GR_MAX_BLOCKS;
        if (nb < 1) nb = 1;
        const int32_t vec = vocab % 8 == 0 && ((uintptr_t)logits & 15) == 0;
        /* the tokens straight into the pinned memory when the device can write it (one
         * copy's latency less a step), else through the device's */
        int32_t *tok = (int32_t *)((b->host_dev ? b->host_dev : b->dev) + in_b);
        greedy_kernel<<<(unsigned)n * (unsigned)nb, GR_THREADS, 0, c->stream>>>(
            (const bf16 *)logits, vocab, nb, vec, st->gr_part, st->gr_count, tok, ids);
        PD_CUDA_CHECK(cudaGetLastError());
        pd_cuda__steptime_mark(c, PD_ST_COPY);
        if (!b->host_dev)
            PD_CUDA_CHECK(cudaMemcpyAsync(b->host + in_b, b->dev + in_b, tok_b,
                                          cudaMemcpyDeviceToHost, c->stream));
        pd_cuda__steptime_mark(c, PD_ST_COPY_END);
        return 0;
    }
    memcpy(b->host, rows, (size_t)n * sizeof *rows);
    if (n_pen > 0) memcpy(b->host + rows_b, pen, (size_t)n_pen * sizeof *pen);

    int C = pick_cluster(c, st, n, vocab);
    size_t smem = smem_bytes(vocab, C, bitmap);
    while (smem > st->smem_max && C < st->max_cluster) smem = smem_bytes(vocab, C <<= 1, bitmap);
    if (smem > st->smem_max) {
        PD_LOGE("cuda sample: vocabulary %d too large for penalties (%zu bytes of shared memory)",
                (int)vocab, smem);
        return PD_EINVAL;
    }
    int shift = 40;
    {
        int lg = 0;
        while (lg < 31 && (1ll << lg) < (long long)vocab) lg++;
        if (62 - lg < shift) shift = 62 - lg; /* vocab x 2^shift fits in 63 bits */
    }
    smp_args a;
    a.logits = (const bf16 *)logits;
    a.rows = (const pd_sample_row *)b->dev;
    a.pen = (const pd_penalty_tok *)(b->dev + rows_b);
    a.tok = (int32_t *)(b->dev + in_b);
    a.vocab = vocab;
    a.cluster = C;
    a.shift = shift;
    a.id_bits = vocab > 1 ? 32 - __builtin_clz((unsigned)(vocab - 1)) : 1;
    a.vec = vocab % 8 == 0 && ((uintptr_t)logits & 15) == 0;
    a.bitmap = bitmap;

    PD_CUDA_CHECK(cudaMemcpyAsync(b->dev, b->host, in_b, cudaMemcpyHostToDevice, c->stream));
    cudaError_t e = launch(c, a, n, smem);
    if (e != cudaSuccess && C > 1) {
        /* A cluster that cannot be placed: one block per row gives the same results. */
        PD_LOGW("cuda sample: clusters of %d unavailable (%s); using one block per row", C,
                cudaGetErrorString(e));
        (void)cudaGetLastError();
        st->max_cluster = 1;
        a.cluster = C = 1;
        smem = smem_bytes(vocab, 1, bitmap);
        if (smem > st->smem_max) return PD_EINVAL;
        e = launch(c, a, n, smem);
    }
    PD_CUDA_CHECK(e);
    if (want_lp) { /* the raw distribution's, from the same logits (not changed by the pick) */
        lp_args la;
        la.logits = a.logits;
        la.rows = a.rows;
        la.tok = a.tok;
        la.lp = (float *)(b->dev + in_b + tok_b);
        la.top = (pd_top_logprob *)(b->dev + in_b + tok_b + lp_b);
        la.vocab = vocab;
        la.stride = *stride;
        la.vec = a.vec;
        /* the threads' lists as short as the call allows (4, 8 or 20 entries) */
        if (*stride <= 4) logprob_kernel<4><<<(unsigned)n, LP_THREADS, 0, c->stream>>>(la);
        else if (*stride <= 8) logprob_kernel<8><<<(unsigned)n, LP_THREADS, 0, c->stream>>>(la);
        else logprob_kernel<LP_K><<<(unsigned)n, LP_THREADS, 0, c->stream>>>(la);
        PD_CUDA_CHECK(cudaGetLastError());
    }
    if (ids)
        PD_CUDA_CHECK(cudaMemcpyAsync(ids, a.tok, (size_t)n * sizeof(int32_t),
                                      cudaMemcpyDeviceToDevice, c->stream));
    pd_cuda__steptime_mark(c, PD_ST_COPY);
    PD_CUDA_CHECK(cudaMemcpyAsync(b->host + in_b, b->dev + in_b, out_b, cudaMemcpyDeviceToHost,
                                  c->stream));
    pd_cuda__steptime_mark(c, PD_ST_COPY_END);
    return 0;
}

/* The results of n rows out of set b's pinned memory at off (once they are there): the
 * tokens, and what enqueue laid out after them when it was asked for logprobs; top rows are
 * PD_MAX_TOP_LOGPROBS apart in the caller's memory, stride apart in b's. */
static void take(const smp_buf *b, size_t off, int32_t n, int32_t stride, int32_t *tokens,
                 float *logprobs, pd_top_logprob *top)
{
    memcpy(tokens, b->host + off, (size_t)n * sizeof *tokens);
    const size_t lp_off = off + align16((size_t)n * sizeof(int32_t));
    if (logprobs) memcpy(logprobs, b->host + lp_off, (size_t)n * sizeof *logprobs);
    const unsigned char *t = b->host + lp_off + align16((size_t)n * sizeof(float));
    for (int32_t r = 0; top && r < n && stride > 0; r++)
        memcpy(top + (size_t)r * PD_MAX_TOP_LOGPROBS, t + (size_t)r * stride * sizeof *top,
               (size_t)stride * sizeof *top);
}

extern "C" int pd_cuda__sample(void *ctx, void *logits, int32_t n, int32_t vocab,
                               const pd_sample_row *rows, const pd_penalty_tok *pen,
                               int32_t n_pen, int32_t *tokens, float *logprobs,
                               pd_top_logprob *top)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    smp_state *st = NULL;
    int rc = state_get(c, &st);
    if (rc < 0) return rc;
    rc = validate(st, logits, n, vocab, rows, pen, n_pen, tokens);
    if (rc < 0) return rc;
    if (take_picks(c, logits, n, vocab, rows, logprobs != NULL, NULL)) {
        PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        PD_CUDA_CHECK(cudaGetLastError());
        pd_cuda__steptime_end(c);
        take_picked(c, SMP_SYNC, n, tokens);
        return 0;
    }
    smp_buf *b = &st->buf[SMP_SYNC];
    size_t off = 0;
    int32_t stride = 0;
    if ((rc = enqueue(c, st, b, logits, n, vocab, rows, pen, n_pen, logprobs != NULL, NULL,
                      &off, &stride)) < 0)
        return rc;
    PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    PD_CUDA_CHECK(cudaGetLastError());
    pd_cuda__steptime_end(c);
    take(b, off, n, stride, tokens, logprobs, logprobs ? top : NULL);
    return 0;
}

extern "C" int pd_cuda__sample_launch(void *ctx, void *logits, int32_t n, int32_t vocab,
                                      const pd_sample_row *rows, const pd_penalty_tok *pen,
                                      int32_t n_pen, bool logprobs, int32_t *ids_out, int slot)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (slot < 0 || slot > 1) return PD_EINVAL;
    smp_state *st = NULL;
    int rc = state_get(c, &st);
    if (rc < 0) return rc;
    const int32_t dummy = 0;
    rc = validate(st, logits, n, vocab, rows, pen, n_pen, &dummy);
    if (rc < 0) return rc;
    st->picked[slot] = take_picks(c, logits, n, vocab, rows, logprobs, ids_out);
    if (st->picked[slot]) { /* the tokens are on their way to pick_host */
        PD_CUDA_CHECK(cudaEventRecord(st->done[slot], c->stream));
        st->n[slot] = n;
        st->want_lp[slot] = false;
        st->stride[slot] = 0;
        return 0;
    }
    if ((rc = enqueue(c, st, &st->buf[slot], logits, n, vocab, rows, pen, n_pen, logprobs,
                      ids_out, &st->out_off[slot], &st->stride[slot])) < 0)
        return rc;
    PD_CUDA_CHECK(cudaEventRecord(st->done[slot], c->stream));
    st->n[slot] = n;
    st->want_lp[slot] = logprobs;
    return 0;
}

extern "C" int pd_cuda__sample_collect(void *ctx, int slot, int32_t *tokens, float *logprobs,
                                       pd_top_logprob *top)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    smp_state *st = (smp_state *)c->sample_state;
    if (!st || slot < 0 || slot > 1 || !tokens || st->n[slot] <= 0 ||
        ((logprobs || top) && !st->want_lp[slot]))
        return PD_EINVAL;
    PD_CUDA_CHECK(cudaEventSynchronize(st->done[slot]));
    PD_CUDA_CHECK(cudaGetLastError());
    pd_cuda__steptime_end(c);
    if (st->picked[slot])
        take_picked(c, slot, st->n[slot], tokens);
    else
        take(&st->buf[slot], st->out_off[slot], st->n[slot], st->stride[slot], tokens, logprobs,
             top);
    st->n[slot] = 0;
    return 0;
}
