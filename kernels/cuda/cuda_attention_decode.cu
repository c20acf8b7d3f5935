/* cuda_attention_decode.cu -- Split-KV ("flash-decoding") paged attention for decode batches
 * (every sequence has one query row). Grid (split, kv head, sequence): each block takes all
 * the query heads of one GQA group over one chunk of the sequence's context, so each K/V row
 * is read once per group, not once per query head. In a block, TPK = head_dim / 8 lanes share
 * a key (16 bytes of K and of V each, 8 bf16 kept packed until used), so a warp works on
 * 32 / TPK keys at a time; every lane group keeps its own online softmax in fp32 (base 2, the
 * scale folded into q) and the groups are merged through shared memory at the end.
 *
 * Three kernels walk the keys. On sm_90 with head sizes 64 and 128 (the default there) the
 * tensor-core kernel: each warp streams tiles of 16 keys' K/V rows with bulk copies through its own
 * ring in shared memory and computes S = Q K^T and O += P V with mma.sync, the GQA group's query
 * heads as the rows (PDSERVE_CUDA_DECODE_MMA: its ring's slots, 2 by default, 0 = off). The
 * CUDA-core kernels below it (head sizes 64 and 128 elsewhere, and every other size) give each key
 * TPK = head_dim / 8 lanes, 16 bytes of K and of V each, with an online softmax per lane group;
 * they issue about 130 instructions per key and head, which makes them issue-bound below the copy
 * rate. The pipelined one streams each lane's K/V through a ring of STAGES tiles with cp.async, so
 * STAGES - 1 tiles stay in flight while one is computed; the register kernel (every head size, and
 * PDSERVE_CUDA_DECODE_STAGES=0) loads K/V straight into registers, two rounds unrolled, the
 * block-table entries a round ahead. The tensor-core kernel comes closest to the copy rate, then
 * the pipelined one, then the register one (docs/perf-history.md, the third and fifth passes of
 * issue #8).
 *
 * A sequence whose keys fit one chunk is written by split 0 directly; otherwise each split with
 * keys writes its unnormalised partial output, max and sum to the workspace and the last one to
 * finish (a counter per (sequence, KV head)) combines them; splits past a sequence's keys return at
 * once. The split count aims at PDSERVE_CUDA_DECODE_BLOCKS_PER_SM blocks per SM (4 for the
 * tensor-core kernel, 16 for the others), chunks of at least MIN_CHUNK keys, at most INLINE_SPLITS,
 * within the workspace; with the longest context unknown (a graph) it comes from the batch alone
 * and each sequence cuts its own context. Many small blocks keep the last wave short on the varied
 * contexts of a serving batch (the 256-request workload with the CUDA-core kernel was nearer its
 * floor at 16 blocks per SM than at 4: docs/perf-history.md, issue #8's third pass). What these
 * kernels do not cover (head_dim not in {8, 16, 32, 64, 128, 256}, more than 8 query heads per KV
 * head, prefill-shaped batches, a batch too large for the workspace, unaligned caches,
 * PDSERVE_CUDA_SPLIT_KV=0) goes to the general kernel (cuda_attention.cu). */

#include <math.h>

#include "kernels/cuda/cuda_kv_fp8.cuh"

#define NW 4            /* warps per block */
#define UNROLL 2        /* key rounds per loop iteration (4: slower, fewer blocks fit) */
#define MIN_CHUNK 64    /* fewest keys a split gets: the 4 tiles of 16 keys a pipelined block
                         * has in flight at once (fewer, longer splits for short contexts:
                         * the partial outputs and their combine cost more than they save) */
#define MAX_G 8         /* query heads per KV head handled here */
#define INLINE_SPLITS 128 /* most splits (the last block combines them in shared memory) */

struct __align__(16) bf16x8 { __nv_bfloat162 h[4]; };

/* How the kernels read a cache of element type KV (bf16, or pd_fp8: an FP8 cache): a lane's 8
 * elements of a key's row are one `vec` (16 bytes of bf16, 8 of e4m3), copied into shared
 * memory by cp, and unpack gives them as 8 bf16 (e4m3 converts exactly). */
template <typename KV> struct kv_io;
template <> struct kv_io<bf16> {
    typedef uint4 vec;
    static __device__ __forceinline__ bf16x8 unpack(vec v)
    {
        return *reinterpret_cast<const bf16x8 *>(&v);
    }
    static __device__ __forceinline__ void cp(void *dst, const void *src, bool ok)
    {
        pd_cp16(dst, src, ok);
    }
};
template <> struct kv_io<pd_fp8> {
    typedef uint2 vec;
    static __device__ __forceinline__ bf16x8 unpack(vec v)
    {
        const uint4 u = pd_e4m3x8_to_bf16x8(v);
        return *reinterpret_cast<const bf16x8 *>(&u);
    }
    static __device__ __forceinline__ void cp(void *dst, const void *src, bool ok)
    {
        pd_cp8(dst, src, ok);
    }
};

/* Element e (a constant after unrolling) of 8 packed bf16: K and V stay packed in registers
 * until used, half the registers of floats, so more blocks fit on an SM. */
static __device__ __forceinline__ float elem(const bf16x8 &v, int e)
{
    return e & 1 ? __high2float(v.h[e >> 1]) : __low2float(v.h[e >> 1]);
}

/* One online-softmax round over U keys, the same for every lane group: a lane holds 8 of
 * head_dim elements of q (scaled by scale * log2 e), of its key's K and V and of the running
 * output of each of the G query heads; ok[u] false masks key u (its V must be finite). */
template <int TPK, int MAXG, int U>
static __device__ __forceinline__ void attend(const float (&qf)[MAXG][8], float (&acc)[MAXG][8],
                                              float (&m)[MAXG], float (&l)[MAXG],
                                              const bf16x8 (&kr)[U], const bf16x8 (&vr)[U],
                                              const bool (&ok)[U], int G)
{
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g >= G) break;
        float sc[U], mx = m[g];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float d = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) d = fmaf(qf[g][e], elem(kr[u], e), d);
#pragma unroll
            for (int o = TPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            sc[u] = ok[u] ? d : -INFINITY;
            mx = fmaxf(mx, sc[u]);
        }
        /* mx = -inf (this lane group has seen no key yet) leaves everything at 0 and -inf;
         * no divergent skip here: the next head's shuffles need the whole warp. */
        const float corr = m[g] == -INFINITY ? 0.0f : exp2f(m[g] - mx);
        float p[U];
        l[g] *= corr;
#pragma unroll
        for (int u = 0; u < U; u++) {
            p[u] = ok[u] ? exp2f(sc[u] - mx) : 0.0f;
            l[g] += p[u];
        }
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float a = acc[g][e] * corr;
#pragma unroll
            for (int u = 0; u < U; u++) a = fmaf(p[u], elem(vr[u], e), a);
            acc[g][e] = a;
        }
        m[g] = mx;
    }
}

/* A block's context chunk and its query heads, as both decode kernels start. */
struct chunk_info {
    int32_t row, k_begin, k_end;
    int32_t n_used; /* splits of this sequence that have keys (1: split 0 writes the output) */
    const int32_t *table;
};

/* Sequence s's first key and chunk (chunk <= 0: cut from its own context into n_splits, as
 * in a graph), and how many splits have keys (at least 1: a padding row's zeros). */
static __device__ __forceinline__ int32_t seq_chunk(int32_t ctx, int32_t sliding_window,
                                                    int32_t chunk, int32_t n_splits,
                                                    int32_t *start, int32_t *n_used)
{
    *start = sliding_window > 0 && ctx - sliding_window > 0 ? ctx - sliding_window : 0;
    const int32_t n_keys = ctx - *start;
    if (chunk <= 0) chunk = max((n_keys + n_splits - 1) / n_splits, MIN_CHUNK);
    *n_used = max(min((n_keys + chunk - 1) / chunk, n_splits), 1);
    return chunk;
}

template <int TPK, int MAXG>
static __device__ __forceinline__ chunk_info
begin_chunk(const bf16 *__restrict__ q, int64_t q_row_stride, const int32_t *__restrict__ cu_q,
            const int32_t *__restrict__ ctx_lens, const int32_t *__restrict__ block_tables,
            int32_t max_blocks_per_seq, int32_t G, int32_t sliding_window, int32_t chunk,
            float scale_log2, float (&qf)[MAXG][8], float (&acc)[MAXG][8], float (&m)[MAXG],
            float (&l)[MAXG])
{
    constexpr int HD = TPK * 8;
    const int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, n_splits = gridDim.x;
    const int sub = (threadIdx.x & 31) % TPK;
    chunk_info ci;
    const int32_t ctx = ctx_lens[s];
    ci.row = cu_q[s];
    int32_t start;
    chunk = seq_chunk(ctx, sliding_window, chunk, n_splits, &start, &ci.n_used);
    ci.k_begin = start + split * chunk;
    ci.k_end = min(ci.k_begin + chunk, ctx);
    ci.table = block_tables + (size_t)s * max_blocks_per_seq;
    if (split >= ci.n_used) return ci; /* the caller leaves: no q needed */
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        const bf16 *qp = q + (size_t)ci.row * q_row_stride + (size_t)(kvh * G + g) * HD + sub * 8;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            qf[g][e] = g < G ? pd_ld(qp + e) * scale_log2 : 0.0f;
            acc[g][e] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    return ci;
}

/* Merges the block's lane groups through shared memory (sm: GROUPS x MAXG x (HD + 2) floats,
 * free for this use) and writes the output, or the split's partial output, max and sum. */
/* The last split block of a (sequence, KV head) to finish combines the splits of its G heads
 * (count: a zeroed counter per (sequence, KV head), which it sets back to 0), so no second
 * kernel is launched. sm: at least G * (2 n_splits + 1) floats; n_splits <= INLINE_SPLITS.
 * The other blocks' partials are read through L2 (__ldcg: L1 is not coherent). */
static __device__ __forceinline__ void combine_inline(float *sm, bf16 *__restrict__ out,
                                                      const float *__restrict__ part,
                                                      int32_t *__restrict__ count, int32_t row,
                                                      int32_t n_used, int32_t n_seqs,
                                                      int32_t n_heads, int32_t G, int HD)
{
    __shared__ int is_last;
    const int kvh = blockIdx.y, s = blockIdx.z, n_splits = gridDim.x;
    int32_t *cnt = count + (size_t)s * gridDim.y + kvh;
    __threadfence(); /* this block's partials are visible before its count */
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(cnt, 1) == n_used - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float *ml = part + (size_t)n_seqs * n_heads * n_splits * HD;
    const size_t item0 = ((size_t)s * n_heads + (size_t)kvh * G) * n_splits;
    /* [g][j] for the n_used splits of head g (split j of head g is item item0 + g n_splits + j) */
    float *fac = sm, *lsum = sm + G * n_used, *tot = sm + 2 * G * n_used;
    for (int i = threadIdx.x; i < G * n_used; i += blockDim.x) {
        const size_t item = item0 + (size_t)(i / n_used) * n_splits + i % n_used;
        fac[i] = __ldcg(ml + 2 * item);
        lsum[i] = __ldcg(ml + 2 * item + 1);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g = warp; g < G; g += blockDim.x >> 5) { /* a warp per head: max, factors, sum */
        float gm = -INFINITY;
        for (int j = lane; j < n_used; j += 32) gm = fmaxf(gm, fac[g * n_used + j]);
        gm = pd_warp_max(gm);
        float total = 0.0f;
        for (int j = lane; j < n_used; j += 32) {
            const float mj = fac[g * n_used + j];
            const float f = mj == -INFINITY ? 0.0f : exp2f(mj - gm); /* no key seen: 0 */
            fac[g * n_used + j] = f;
            total += lsum[g * n_used + j] * f;
        }
        total = pd_warp_sum(total);
        if (lane == 0) tot[g] = total;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        const float *pg = part + (item0 + (size_t)g * n_splits) * HD + d;
        float o = 0.0f;
        for (int j = 0; j < n_used; j++) {
            const float f = fac[g * n_used + j];
            if (f != 0.0f) o = fmaf(__ldcg(pg + (size_t)j * HD), f, o);
        }
        const float total = tot[g];
        pd_st(out + (size_t)row * ((size_t)n_heads * HD) + (size_t)(kvh * G + g) * HD + d,
              total > 0.0f ? o / total : 0.0f);
    }
    if (threadIdx.x == 0) *cnt = 0;
}

/* Merges the states of a block's GROUPS lane groups (in sm: [GROUPS][MAXG][HD] unnormalised
 * outputs, then [GROUPS][MAXG] maxima, then [GROUPS][MAXG] sums; a group that saw no key has
 * max -inf) and writes the output, or the split's partial output, max and sum (then the last
 * split combines them). */
template <int GROUPS, int MAXG, int HD>
static __device__ __forceinline__ void
merge_groups(float *sm, bf16 *__restrict__ out, float *__restrict__ part,
             int32_t *__restrict__ count, int32_t row, int32_t n_used, int32_t n_seqs,
             int32_t n_heads, int32_t G)
{
    float(*sm_acc)[MAXG][HD] = reinterpret_cast<float(*)[MAXG][HD]>(sm);
    float(*sm_m)[MAXG] = reinterpret_cast<float(*)[MAXG]>(sm + GROUPS * MAXG * HD);
    float(*sm_l)[MAXG] = reinterpret_cast<float(*)[MAXG]>(sm + GROUPS * MAXG * (HD + 1));
    const int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, n_splits = gridDim.x;
    __syncthreads();
    /* One (head, element) pair per thread and round. */
    for (int i = threadIdx.x; i < G * HD; i += NW * 32) {
        const int g = i / HD, d = i % HD, h = kvh * G + g;
        float gm = -INFINITY;
        for (int j = 0; j < GROUPS; j++) gm = fmaxf(gm, sm_m[j][g]);
        float total = 0.0f, o = 0.0f;
        if (gm != -INFINITY) {
            for (int j = 0; j < GROUPS; j++) {
                const float mj = sm_m[j][g];
                if (mj == -INFINITY) continue;
                const float f = exp2f(mj - gm);
                total += sm_l[j][g] * f;
                o += sm_acc[j][g][d] * f;
            }
        }
        if (n_used == 1) { /* no key at all (a padding row of context 0) gives zeros */
            pd_st(out + (size_t)row * ((size_t)n_heads * HD) + (size_t)h * HD + d,
                  total > 0.0f ? o / total : 0.0f);
        } else {
            const size_t item = ((size_t)s * n_heads + h) * n_splits + split;
            part[item * HD + d] = o;
            if (d == 0) {
                float *ml = part + (size_t)n_seqs * n_heads * n_splits * HD;
                ml[2 * item] = gm;
                ml[2 * item + 1] = total;
            }
        }
    }
    if (n_used > 1)
        combine_inline(sm, out, part, count, row, n_used, n_seqs, n_heads, G, HD);
}

/* The CUDA-core kernels' end: every lane group's state into shared memory (an FP8 cache's
 * outputs times v_scale, its value scale, applied once), then merged. */
template <typename KV, int TPK, int MAXG>
static __device__ __forceinline__ void
finish_chunk(float *sm, const float (&acc)[MAXG][8], const float (&m)[MAXG],
             const float (&l)[MAXG], bf16 *__restrict__ out, float *__restrict__ part,
             int32_t *__restrict__ count, int32_t row, int32_t n_used, int32_t n_seqs,
             int32_t n_heads, int32_t G, float v_scale)
{
    constexpr int HD = TPK * 8, KPW = 32 / TPK, GROUPS = NW * KPW;
    float(*sm_acc)[MAXG][HD] = reinterpret_cast<float(*)[MAXG][HD]>(sm);
    float(*sm_m)[MAXG] = reinterpret_cast<float(*)[MAXG]>(sm + GROUPS * MAXG * HD);
    float(*sm_l)[MAXG] = reinterpret_cast<float(*)[MAXG]>(sm + GROUPS * MAXG * (HD + 1));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane / TPK, sub = lane % TPK, gid = warp * KPW + grp;
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g >= G) break;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            if constexpr (sizeof(KV) == 1) sm_acc[gid][g][sub * 8 + e] = acc[g][e] * v_scale;
            else sm_acc[gid][g][sub * 8 + e] = acc[g][e];
        }
        if (sub == 0) {
            sm_m[gid][g] = m[g];
            sm_l[gid][g] = l[g];
        }
    }
    merge_groups<GROUPS, MAXG, HD>(sm, out, part, count, row, n_used, n_seqs, n_heads, G);
}

/* KV: the cache's element type. scale_log2 includes an FP8 cache's key scale, v_scale is its
 * value scale (1 for bf16). */
#define PD_SPLIT_PARAMS                                                                        \
    const bf16 *__restrict__ q, int64_t q_row_stride, const KV *__restrict__ k_cache,          \
        const KV *__restrict__ v_cache, bf16 *__restrict__ out, float *__restrict__ part,      \
        int32_t *__restrict__ count, const int32_t *__restrict__ cu_q,                         \
        const int32_t *__restrict__ ctx_lens, const int32_t *__restrict__ block_tables,        \
        int32_t n_seqs, int32_t max_blocks_per_seq, int32_t n_heads, int32_t n_kv_heads,       \
        int32_t G, int32_t block_size, int32_t sliding_window, int32_t chunk, float scale_log2,  \
        float v_scale

/* Register kernel: K/V loaded straight into registers, TPK lanes per key (head_dim = 8 TPK),
 * MAXG >= G query heads per KV head. */
template <typename KV, int TPK, int MAXG>
static __global__ void __launch_bounds__(NW * 32) split_kernel(PD_SPLIT_PARAMS)
{
    constexpr int HD = TPK * 8, KPW = 32 / TPK, GROUPS = NW * KPW;
    __shared__ float sm[GROUPS * MAXG * (HD + 2)];
    pd_pdl_wait(); /* large decode batches take several waves: no early successor */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = lane / TPK;
    float qf[MAXG][8], acc[MAXG][8], m[MAXG], l[MAXG];
    const chunk_info ci =
        begin_chunk<TPK, MAXG>(q, q_row_stride, cu_q, ctx_lens, block_tables, max_blocks_per_seq,
                               G, sliding_window, chunk, scale_log2, qf, acc, m, l);
    if ((int32_t)blockIdx.x >= ci.n_used) return; /* no keys, no partials: nothing to do */
    const int32_t k_begin = ci.k_begin, k_end = ci.k_end;
    const int32_t *table = ci.table;
    const int64_t kv_row = (int64_t)n_kv_heads * HD;
    const int64_t col = (int64_t)blockIdx.y * HD + (lane % TPK) * 8;

    /* The block-table entries of the next round's keys are loaded a round ahead, so that a
     * round's K/V loads don't wait for a dependent table load first. */
    constexpr int STEP = NW * KPW * UNROLL;
    int32_t blk[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int32_t k = k_begin + warp * KPW + u * NW * KPW + grp;
        blk[u] = k < k_end ? table[k / block_size] : 0;
    }
    for (int32_t base = k_begin + warp * KPW; base < k_end; base += STEP) {
        bf16x8 kr[UNROLL], vr[UNROLL];
        bool ok[UNROLL];
        int32_t cur[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            cur[u] = blk[u];
            const int32_t kn = base + STEP + u * NW * KPW + grp;
            blk[u] = kn < k_end ? table[kn / block_size] : 0;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int32_t k = base + u * NW * KPW + grp;
            ok[u] = k < k_end;
            if (ok[u]) {
                const int64_t off = ((int64_t)cur[u] * block_size + k % block_size) * kv_row +
                                    col;
                typedef typename kv_io<KV>::vec vec;
                kr[u] = kv_io<KV>::unpack(*reinterpret_cast<const vec *>(k_cache + off));
                vr[u] = kv_io<KV>::unpack(*reinterpret_cast<const vec *>(v_cache + off));
            } else {
                const __nv_bfloat162 z = __float2bfloat162_rn(0.0f);
#pragma unroll
                for (int i = 0; i < 4; i++) kr[u].h[i] = vr[u].h[i] = z;
            }
        }
        attend<TPK, MAXG, UNROLL>(qf, acc, m, l, kr, vr, ok, G);
    }
    finish_chunk<KV, TPK, MAXG>(sm, acc, m, l, out, part, count, ci.row, ci.n_used, n_seqs,
                                n_heads, G, v_scale);
}

/* Pipelined kernel: each lane streams its own keys' K/V through a ring of STAGES slots in
 * shared memory with cp.async, so STAGES - 1 tiles stay in flight while one is computed (the
 * register kernel has at most one round in flight per warp). A lane reads back only what it
 * copied itself: no barrier in the loop. Warp w takes keys [t * NW + w) * KS, + KS) of tile
 * t, KS = R rounds of 32 / TPK keys. */
#define ASYNC_R 2
template <typename KV, int TPK, int STAGES>
static constexpr size_t async_ring_bytes(void)
{
    return (size_t)STAGES * ASYNC_R * 2 * NW * 32 * sizeof(typename kv_io<KV>::vec);
}

template <typename KV, int TPK, int MAXG, int STAGES>
static __global__ void __launch_bounds__(NW * 32, MAXG <= 2 ? 6 : 1)
split_async_kernel(PD_SPLIT_PARAMS) /* 6 blocks an SM (their ring's share of shared memory) */
{
    constexpr int HD = TPK * 8, KPW = 32 / TPK, R = ASYNC_R, KS = R * KPW, TILE = NW * KS;
    constexpr int SLOT = NW * 32; /* vecs between a lane's consecutive ring entries */
    typedef typename kv_io<KV>::vec vec;
    extern __shared__ uint4 dyn[];
    pd_pdl_wait();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = lane / TPK;
    float qf[MAXG][8], acc[MAXG][8], m[MAXG], l[MAXG];
    const chunk_info ci =
        begin_chunk<TPK, MAXG>(q, q_row_stride, cu_q, ctx_lens, block_tables, max_blocks_per_seq,
                               G, sliding_window, chunk, scale_log2, qf, acc, m, l);
    if ((int32_t)blockIdx.x >= ci.n_used) return; /* no keys, no partials: nothing to do */
    const int32_t k_end = ci.k_end;
    const int32_t *table = ci.table;
    const int64_t kv_row = (int64_t)n_kv_heads * HD;
    const int64_t col = (int64_t)blockIdx.y * HD + (lane % TPK) * 8;
    const int32_t n_tiles = k_end > ci.k_begin ? (k_end - ci.k_begin + TILE - 1) / TILE : 0;
    const int32_t k0 = ci.k_begin + warp * KS + grp; /* this lane's key in round 0 of tile 0 */
    vec *ring = reinterpret_cast<vec *>(dyn) + threadIdx.x;

    /* Table entries of tile t (-1: past the chunk), loaded a tile before they are used. */
    int32_t cur[R], nxt[R];
    auto table_of = [&](int32_t t, int32_t (&b)[R]) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int32_t k = k0 + t * TILE + r * KPW;
            b[r] = t < n_tiles && k < k_end ? table[k / block_size] : -1;
        }
    };
    auto issue = [&](int32_t t, int slot, const int32_t (&b)[R]) {
        if (t < n_tiles) { /* keys past the end in the last tile get zeros */
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int32_t k = k0 + t * TILE + r * KPW;
                const bool ok = b[r] >= 0;
                const int64_t off =
                    ok ? ((int64_t)b[r] * block_size + k % block_size) * kv_row + col : 0;
                kv_io<KV>::cp(ring + ((slot * R + r) * 2) * SLOT, k_cache + off, ok);
                kv_io<KV>::cp(ring + ((slot * R + r) * 2 + 1) * SLOT, v_cache + off, ok);
            }
        }
        pd_cp_commit(); /* a group per tile, empty or not: the wait counts groups */
    };
    { /* the first STAGES + 1 tiles' entries in one round of loads, not one after another */
        int32_t pro[STAGES + 1][R];
#pragma unroll
        for (int t = 0; t <= STAGES; t++) table_of(t, pro[t]);
#pragma unroll
        for (int t = 0; t < STAGES; t++) issue(t, t, pro[t]);
#pragma unroll
        for (int r = 0; r < R; r++) cur[r] = pro[STAGES][r];
    }
    /* cur: the table entries of tile STAGES */
    for (int32_t t = 0; t < n_tiles; t++) {
        const int slot = t % STAGES;
        pd_cp_wait<STAGES - 1>();
        bf16x8 kr[R], vr[R];
        bool ok[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const vec kv = ring[((slot * R + r) * 2) * SLOT];
            const vec vv = ring[((slot * R + r) * 2 + 1) * SLOT];
            kr[r] = kv_io<KV>::unpack(kv);
            vr[r] = kv_io<KV>::unpack(vv);
            ok[r] = k0 + t * TILE + r * KPW < k_end;
        }
        attend<TPK, MAXG, R>(qf, acc, m, l, kr, vr, ok, G);
        asm volatile("" ::: "memory"); /* the slot's reads stay before its refill */
        table_of(t + STAGES + 1, nxt);
        issue(t + STAGES, slot, cur);
#pragma unroll
        for (int r = 0; r < R; r++) cur[r] = nxt[r];
    }
    pd_cp_wait<0>();
    __syncthreads(); /* the ring becomes the merge's scratch */
    finish_chunk<KV, TPK, MAXG>(reinterpret_cast<float *>(dyn), acc, m, l, out, part, count,
                                ci.row, ci.n_used, n_seqs, n_heads, G, v_scale);
}

/* Tensor-core kernel (sm_90; head sizes 64 and 128, up to 8 query heads per KV head): the CUDA-core
 * kernels spend about 130 instructions per key and head, which caps them below the copy rate
 * (issue-bound under ncu: docs/perf-history.md, issue #8's fifth pass). Here each warp takes every
 * NW-th tile of MMA_KT keys of the block's chunk and streams them through its own ring of STAGES
 * slots with bulk copies (cp.async.bulk, one 2 * head_dim-byte row of K or V per lane, completion
 * on an mbarrier per slot), so one warp instruction fetches a whole tile. S = Q K^T and O += P V
 * run on mma.m16n8k16 with the GQA group's query heads as the rows (rows G .. 15 are zero), P in
 * bf16, the online softmax in fp32 (base 2) on the quad of lanes that holds a row. Shared-memory
 * rows are padded by 16 bytes, so the 8 rows an ldmatrix reads fall in different banks. About 6
 * instructions per key and head. With an FP8 cache (KV = pd_fp8) the ring holds e4m3 rows (half the
 * bytes); once a tile has landed each lane converts its own row into the warp's bf16 tile (exact)
 * and refills the slot at once, and the same mma code reads that tile. */
#define MMA_KT 16 /* keys per tile: a lane per K row, a lane per V row */

template <int HD>
static constexpr __host__ __device__ int mma_pitch(void) /* bf16 elements per shared row */
{
    return HD + 8;
}

/* Elements of KV per ring row: a row and 16 bytes. */
template <typename KV, int HD>
static constexpr __host__ __device__ int mma_ring_pitch(void)
{
    return HD + 16 / (int)sizeof(KV);
}

/* The rings of the block's warps, then (FP8 cache) each warp's bf16 tile. */
template <typename KV, int HD, int STAGES>
static constexpr size_t mma_ring_bytes(void)
{
    constexpr bool FP8 = sizeof(KV) == 1;
    return (size_t)NW * STAGES * 2 * MMA_KT * mma_ring_pitch<KV, HD>() * sizeof(KV) +
           (FP8 ? (size_t)NW * 2 * MMA_KT * mma_pitch<HD>() * sizeof(bf16) : 0);
}

template <typename KV, int HD, int STAGES>
static __global__ void __launch_bounds__(NW * 32) split_mma_kernel(PD_SPLIT_PARAMS)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr bool FP8 = sizeof(KV) == 1;
    constexpr int P = mma_pitch<HD>(), KS = HD / 16, NB = HD / 8;
    constexpr int PK = mma_ring_pitch<KV, HD>(), TILE = 2 * MMA_KT * PK; /* in KV elements */
    constexpr int ROW_BYTES = HD * (int)sizeof(KV);
    extern __shared__ __align__(128) uint4 dyn[];
    __shared__ __align__(8) uint64_t bars[NW][STAGES];
    pd_pdl_wait();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q4 = lane & 3;
    const int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, n_splits = gridDim.x;
    const int32_t ctx = ctx_lens[s], row = cu_q[s];
    int32_t start, n_used;
    const int32_t ch = seq_chunk(ctx, sliding_window, chunk, n_splits, &start, &n_used);
    if (split >= n_used) return; /* no keys, no partials: nothing to do */
    const int32_t k_begin = start + split * ch, k_end = min(k_begin + ch, ctx);
    const int32_t *table = block_tables + (size_t)s * max_blocks_per_seq;
    const int32_t n_tiles = k_end > k_begin ? (k_end - k_begin + MMA_KT - 1) / MMA_KT : 0;
    const int32_t mine = n_tiles > warp ? (n_tiles - warp + NW - 1) / NW : 0;
    KV *ring = reinterpret_cast<KV *>(dyn) + (size_t)warp * STAGES * TILE;
    /* FP8: the warp's bf16 tile, after every warp's ring */
    bf16 *stage =
        reinterpret_cast<bf16 *>(reinterpret_cast<KV *>(dyn) + (size_t)NW * STAGES * TILE) +
        (size_t)warp * 2 * MMA_KT * P;
    (void)stage;
    uint64_t *bar = bars[warp];
    if (lane == 0) {
        for (int i = 0; i < STAGES; i++) pd_mbar_init(&bar[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();

    /* Tile i of this warp: keys from k_begin + (warp + i NW) MMA_KT. Lane l fetches row l % 16
     * of K (l < 16) or of V; a row past the chunk is zeroed instead (P is 0 there, and 0 x a
     * stale NaN would not be). */
    const int64_t kv_row = (int64_t)n_kv_heads * HD;
    const int32_t my_key = lane & 15;
    const KV *cache = (lane < 16 ? k_cache : v_cache) + (int64_t)kvh * HD;
    auto entry_of = [&](int32_t i) -> int32_t {
        const int32_t k = k_begin + (warp + i * NW) * MMA_KT + my_key;
        return i < mine && k < k_end ? table[k / block_size] : 0;
    };
    auto issue = [&](int32_t i, int32_t entry) {
        if (i >= mine) return;
        const int slot = i % STAGES;
        const int32_t kb = k_begin + (warp + i * NW) * MMA_KT, k = kb + my_key;
        KV *dst = ring + slot * TILE + lane * PK; /* row lane: K rows, then V rows */
        if (lane == 0)
            pd_mbar_expect_tx(&bar[slot], (uint32_t)(min(MMA_KT, k_end - kb) * 2 * ROW_BYTES));
        __syncwarp(); /* the expected bytes are set before any copy can land */
        if (k < k_end) {
            pd_bulk_load(dst, cache + ((int64_t)entry * block_size + k % block_size) * kv_row,
                         ROW_BYTES, &bar[slot]);
        } else {
#pragma unroll
            for (int c = 0; c < ROW_BYTES / 16; c++)
                reinterpret_cast<uint4 *>(dst)[c] = make_uint4(0u, 0u, 0u, 0u);
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        }
    };

    /* Q as the A operand (row g = query head g of the group; rows >= G and g + 8 are 0), K
     * scores scaled in fp32 afterwards: q stays exact. */
    uint32_t qa[KS][2];
    {
        const bf16 *qp = q + (size_t)row * q_row_stride + (size_t)(kvh * G + min(g, G - 1)) * HD +
                         2 * q4;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            qa[ks][0] = g < G ? *reinterpret_cast<const uint32_t *>(qp + ks * 16) : 0u;
            qa[ks][1] = g < G ? *reinterpret_cast<const uint32_t *>(qp + ks * 16 + 8) : 0u;
        }
    }
    float o[NB][4];
#pragma unroll
    for (int j = 0; j < NB; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m = -INFINITY, l = 0.0f;

    {
        int32_t e[STAGES];
#pragma unroll
        for (int i = 0; i < STAGES; i++) e[i] = entry_of(i);
#pragma unroll
        for (int i = 0; i < STAGES; i++) issue(i, e[i]);
    }
    for (int32_t i = 0; i < mine; i++) {
        const int32_t next = entry_of(i + STAGES); /* its latency hides behind this tile */
        const int slot = i % STAGES;
        pd_mbar_wait(&bar[slot], (uint32_t)((i / STAGES) & 1));
        __syncwarp(); /* zeroed rows of other lanes are visible */
        const bf16 *sk;
        if constexpr (FP8) {
            /* this lane's row of the slot into the bf16 tile; then the slot is free */
            const uint4 *src = reinterpret_cast<const uint4 *>(ring + slot * TILE + lane * PK);
            uint4 *dst = reinterpret_cast<uint4 *>(stage + lane * P);
#pragma unroll
            for (int c = 0; c < ROW_BYTES / 16; c++) {
                const uint4 v = src[c];
                dst[2 * c] = pd_e4m3x8_to_bf16x8(make_uint2(v.x, v.y));
                dst[2 * c + 1] = pd_e4m3x8_to_bf16x8(make_uint2(v.z, v.w));
            }
            __syncwarp(); /* every row converted; every lane done with the slot */
            issue(i + STAGES, next);
            sk = stage;
        } else {
            sk = reinterpret_cast<const bf16 *>(ring + slot * TILE);
        }
        const bf16 *sv = sk + MMA_KT * P;
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            unsigned b[4];
            /* lanes 0-7 / 8-15: keys 0-7 at k 0 / 8 (n-block 0); 16-31: keys 8-15 */
            pd_ldsm4(b, sk + ((lane & 7) + ((lane >> 4) << 3)) * P + ks * 16 +
                            ((lane >> 3) & 1) * 8);
            mma_bf16(sc[0], qa[ks][0], 0u, qa[ks][1], 0u, b[0], b[1]);
            mma_bf16(sc[1], qa[ks][0], 0u, qa[ks][1], 0u, b[2], b[3]);
        }
        /* Row g's scores of keys kb + 8 nb + 2 q4 + {0, 1}; the quad of lanes 4g .. 4g + 3
         * holds the row. */
        const int32_t kb = k_begin + (warp + i * NW) * MMA_KT;
        float sv4[4], mx = m;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int32_t k = kb + (j >> 1) * 8 + 2 * q4 + (j & 1);
            sv4[j] = k < k_end ? sc[j >> 1][j & 1] * scale_log2 : -INFINITY;
            mx = fmaxf(mx, sv4[j]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        /* mx is finite: every tile holds a key. m = -inf (first tile) gives corr 0. */
        const float corr = pd_exp2(m - mx);
        float p[4];
#pragma unroll
        for (int j = 0; j < 4; j++) p[j] = pd_exp2(sv4[j] - mx);
        l = fmaf(l, corr, (p[0] + p[1]) + (p[2] + p[3]));
        m = mx;
        if (__any_sync(0xffffffffu, corr != 1.0f)) {
#pragma unroll
            for (int j = 0; j < NB; j++) {
                o[j][0] *= corr;
                o[j][1] *= corr;
            }
        }
        const uint32_t pa0 = pd_pack_bf16(p[0], p[1]), pa2 = pd_pack_bf16(p[2], p[3]);
#pragma unroll
        for (int j = 0; j < NB; j += 2) {
            unsigned b[4];
            pd_ldsm4t(b, sv + (lane & 15) * P + (j + (lane >> 4)) * 8);
            mma_bf16(o[j], pa0, 0u, pa2, 0u, b[0], b[1]);
            mma_bf16(o[j + 1], pa0, 0u, pa2, 0u, b[2], b[3]);
        }
        __syncwarp(); /* every lane is done with the slot (the tile) before it is refilled */
        if constexpr (!FP8) issue(i + STAGES, next);
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);

    /* The warps' states into shared memory (the ring's space: every warp is past it), merged. */
    constexpr int MAXG = MAX_G;
    __syncthreads();
    float *sm = reinterpret_cast<float *>(dyn);
    float(*sm_acc)[MAXG][HD] = reinterpret_cast<float(*)[MAXG][HD]>(sm);
    float(*sm_m)[MAXG] = reinterpret_cast<float(*)[MAXG]>(sm + NW * MAXG * HD);
    float(*sm_l)[MAXG] = reinterpret_cast<float(*)[MAXG]>(sm + NW * MAXG * (HD + 1));
    if (g < G) {
#pragma unroll
        for (int j = 0; j < NB; j++) {
            if constexpr (FP8) {
                o[j][0] *= v_scale;
                o[j][1] *= v_scale;
            }
            sm_acc[warp][g][j * 8 + 2 * q4] = o[j][0];
            sm_acc[warp][g][j * 8 + 2 * q4 + 1] = o[j][1];
        }
        if (q4 == 0) {
            sm_m[warp][g] = m;
            sm_l[warp][g] = l;
        }
    }
    merge_groups<NW, MAXG, HD>(sm, out, part, count, row, n_used, n_seqs, n_heads, G);
#else
    __trap(); /* launched only on compute capability 9.0 and up */
#endif
}

/* The scales as the kernels take them: scale_log2 with an FP8 cache's key scale folded in
 * (exact to apply to the dot product once), and its value scale (applied to the output once);
 * a bf16 cache's scales are not read (backend.h: unused by the other ops). */
struct kv_scales {
    float scale_log2, v_scale;
};

template <typename KV>
static kv_scales scales_of(const pd_attn_args *a)
{
    const float log2e = 1.4426950408889634f;
    if constexpr (sizeof(KV) == 1) return {a->scale * log2e * a->k_scale, a->v_scale};
    else return {a->scale * log2e, 1.0f};
}

template <typename KV, int TPK, int MAXG, int STAGES>
static cudaError_t launch_tg(const pd_attn_args *a, float *part, int32_t *count, int n_splits,
                             int chunk, cudaStream_t stream)
{
    constexpr int HD = TPK * 8, GROUPS = NW * (32 / TPK);
    const dim3 grid((unsigned)n_splits, (unsigned)a->n_kv_heads, (unsigned)a->n_seqs);
    const kv_scales sc = scales_of<KV>(a);
#define PD_SPLIT_ARGS                                                                          \
    (const bf16 *)a->q, a->q_row_stride, (const KV *)a->k_cache, (const KV *)a->v_cache,       \
        (bf16 *)a->out, part, count, a->cu_q, a->ctx_lens, a->block_tables, a->n_seqs,         \
        a->max_blocks_per_seq, a->n_heads, a->n_kv_heads, a->n_heads / a->n_kv_heads,          \
        a->block_size, a->sliding_window, chunk, sc.scale_log2, sc.v_scale
    cudaError_t e;
    if constexpr (STAGES == 0) {
        e = pd_cuda__launch(split_kernel<KV, TPK, MAXG>, grid, dim3(NW * 32), 0, stream,
                            PD_SPLIT_ARGS);
    } else {
        const size_t ring = async_ring_bytes<KV, TPK, STAGES>();
        const size_t merge = (size_t)GROUPS * MAXG * (HD + 2) * sizeof(float);
        e = pd_cuda__launch(split_async_kernel<KV, TPK, MAXG, STAGES>, grid,
                            dim3(NW * 32), ring > merge ? ring : merge, stream, PD_SPLIT_ARGS);
    }
#undef PD_SPLIT_ARGS
    return e;
}

template <typename KV, int TPK, int STAGES>
static cudaError_t launch_ts(const pd_attn_args *a, float *part, int32_t *count, int n_splits,
                             int chunk, cudaStream_t stream)
{
    const int G = a->n_heads / a->n_kv_heads;
    if (G <= 1) return launch_tg<KV, TPK, 1, STAGES>(a, part, count, n_splits, chunk, stream);
    if (G <= 2) return launch_tg<KV, TPK, 2, STAGES>(a, part, count, n_splits, chunk, stream);
    if (G <= 4) return launch_tg<KV, TPK, 4, STAGES>(a, part, count, n_splits, chunk, stream);
    return launch_tg<KV, TPK, 8, STAGES>(a, part, count, n_splits, chunk, stream);
}

template <typename KV, int HD, int STAGES>
static cudaError_t launch_mma(const pd_attn_args *a, float *part, int32_t *count, int n_splits,
                              int chunk, cudaStream_t stream)
{
    const size_t ring = mma_ring_bytes<KV, HD, STAGES>();
    const size_t merge = (size_t)NW * MAX_G * (HD + 2) * sizeof(float);
    const size_t smem = ring > merge ? ring : merge;
    /* above 48 KiB allowed explicitly, per device: on every launch (cuda_attention_prefill.cu) */
    cudaError_t e = cudaFuncSetAttribute(split_mma_kernel<KV, HD, STAGES>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    const dim3 grid((unsigned)n_splits, (unsigned)a->n_kv_heads, (unsigned)a->n_seqs);
    const kv_scales sc = scales_of<KV>(a);
    return pd_cuda__launch(split_mma_kernel<KV, HD, STAGES>, grid, dim3(NW * 32), smem, stream,
                           (const bf16 *)a->q, a->q_row_stride, (const KV *)a->k_cache,
                           (const KV *)a->v_cache, (bf16 *)a->out, part, count, a->cu_q,
                           a->ctx_lens, a->block_tables, a->n_seqs, a->max_blocks_per_seq,
                           a->n_heads, a->n_kv_heads, a->n_heads / a->n_kv_heads, a->block_size,
                           a->sliding_window, chunk, sc.scale_log2, sc.v_scale);
}

/* Head sizes 64 and 128: the tensor-core kernel on sm_90 (mma_stages 2 - 4: its ring; 0 = off),
 * else the pipelined kernel (stages 2 or 4; others round down: 2, the default, was the best of 2, 4
 * and 6 in issue #8's third pass, docs/perf-history.md); the register kernel otherwise and with
 * stages 0. */
template <typename KV, int TPK>
static cudaError_t launch_t(const pd_attn_args *a, float *part, int32_t *count, int n_splits,
                            int chunk, int stages, int mma_stages, cudaStream_t stream)
{
    if constexpr (TPK == 8 || TPK == 16) {
        constexpr int HD = TPK * 8;
        if (mma_stages >= 4) return launch_mma<KV, HD, 4>(a, part, count, n_splits, chunk, stream);
        if (mma_stages == 3) return launch_mma<KV, HD, 3>(a, part, count, n_splits, chunk, stream);
        if (mma_stages > 0) return launch_mma<KV, HD, 2>(a, part, count, n_splits, chunk, stream);
        if (stages >= 4) return launch_ts<KV, TPK, 4>(a, part, count, n_splits, chunk, stream);
        if (stages >= 2) return launch_ts<KV, TPK, 2>(a, part, count, n_splits, chunk, stream);
    }
    (void)mma_stages;
    return launch_ts<KV, TPK, 0>(a, part, count, n_splits, chunk, stream);
}

template <typename KV>
static cudaError_t launch_split(const pd_attn_args *a, float *part, int32_t *count, int n_splits,
                                int chunk, int stages, int mma_stages, cudaStream_t stream)
{
    switch (a->head_dim) {
    case 8: return launch_t<KV, 1>(a, part, count, n_splits, chunk, 0, 0, stream);
    case 16: return launch_t<KV, 2>(a, part, count, n_splits, chunk, 0, 0, stream);
    case 32: return launch_t<KV, 4>(a, part, count, n_splits, chunk, 0, 0, stream);
    case 64: return launch_t<KV, 8>(a, part, count, n_splits, chunk, stages, mma_stages, stream);
    case 128: return launch_t<KV, 16>(a, part, count, n_splits, chunk, stages, mma_stages, stream);
    default: return launch_t<KV, 32>(a, part, count, n_splits, chunk, 0, 0, stream);
    }
}

/* The decode op for a cache of element type KV (the bf16 op and the FP8 cache's). */
template <typename KV>
static int attention_decode(void *ctx, const pd_attn_args *a)
{
    constexpr bool FP8 = sizeof(KV) == 1;
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a) return PD_EINVAL;
    if (FP8 && (!(a->k_scale > 0) || !(a->v_scale > 0) || !isfinite(a->k_scale) ||
                !isfinite(a->v_scale)))
        return PD_EINVAL;
    const int32_t hd = a->head_dim;
    const bool shape_ok = a->n_tokens > 0 && a->n_seqs > 0 && a->n_tokens == a->n_seqs &&
        a->max_q_len == 1 && a->max_ctx_len >= 0 && a->n_kv_heads > 0 && a->n_heads > 0 &&
        a->n_heads % a->n_kv_heads == 0 && a->n_heads / a->n_kv_heads <= MAX_G &&
        (hd == 8 || hd == 16 || hd == 32 || hd == 64 || hd == 128 || hd == 256) &&
        a->block_size > 0 && a->max_blocks_per_seq > 0 && a->sliding_window >= 0 &&
        a->q_row_stride >= (int64_t)a->n_heads * hd && a->n_kv_heads <= 65535 &&
        a->n_seqs <= 65535 && a->q && a->k_cache && a->v_cache && a->out && a->cu_q &&
        a->ctx_lens && a->block_tables &&
        ((uintptr_t)a->k_cache & 15) == 0 && ((uintptr_t)a->v_cache & 15) == 0;
    if (!c->split_kv || !shape_ok || !c->attn_part) {
        /* The general kernel needs the longest context to size its grid. */
        if (a->max_ctx_len == 0) return PD_EINVAL;
        return FP8 ? pd_cuda__attention_fp8(ctx, a) : pd_cuda__attention(ctx, a);
    }

    /* Splits: about per_sm blocks per SM, chunks of at least MIN_CHUNK keys,
     * within the workspace (partial outputs, max and sum of each split of each head). With
     * the longest context unknown (max_ctx_len 0: a graph replayed over other contexts) the
     * split count comes from the batch alone and each sequence cuts its own context into
     * that many chunks (chunk 0 tells the kernel so); splits past a short context return. */
    int32_t n_keys = a->max_ctx_len;
    if (a->sliding_window > 0 && (n_keys == 0 || a->sliding_window < n_keys))
        n_keys = a->sliding_window;
    const int mma_stages = c->cc_major >= 9 ? c->decode_mma_stages : 0;
    const bool mma = mma_stages > 0 && (hd == 64 || hd == 128);
    /* Blocks per SM aimed at: about as many as fit at once for the tensor-core kernel (3 of
     * its blocks do): 4 beat 8 on short and long contexts alike, since splits cost their combine
     * and more waves, and left the 256-request workload where it was, while 16 lost on it. The
     * CUDA-core kernels' best was 16 (docs/perf-history.md, issue #8's fifth pass). */
    const int per_sm = c->decode_blocks_per_sm > 0 ? c->decode_blocks_per_sm : mma ? 4 : 16;
    const int64_t base_blocks = (int64_t)a->n_seqs * a->n_kv_heads;
    const int64_t target = (int64_t)per_sm * c->sm_count;
    /* Rounded up: a batch of 256 x 8 KV heads gets 2 splits, slower on uniform contexts than 1
     * (rounding to nearest), but the 256-request workload, whose batches pass through
     * 130 - 260 sequences of varied contexts, runs faster with it (docs/perf-history.md, issue
     * #8's third pass). */
    int64_t ns = (target + base_blocks - 1) / base_blocks;
    if (n_keys > 0) {
        const int64_t by_len = (n_keys + MIN_CHUNK - 1) / MIN_CHUNK;
        if (ns > by_len) ns = by_len;
    }
    const int64_t per_split = (int64_t)a->n_seqs * a->n_heads * (hd + 2);
    const int64_t by_ws = (int64_t)(c->attn_part_floats / (size_t)per_split);
    if (ns > by_ws) ns = by_ws;
    if ((size_t)base_blocks > c->attn_count_n) ns = 1; /* no counter each (cuda_context.cu
                                                         * sizes them so this never holds) */
    if (ns > INLINE_SPLITS) ns = INLINE_SPLITS; /* combined in the kernel, and a graph's grid
                                                 * of mostly idle splits stays small */
    if (ns < 1) ns = 1; /* one split writes the output directly: no workspace */
    int32_t chunk = 0;
    int n_splits = (int)ns;
    if (a->max_ctx_len > 0) {
        chunk = (int32_t)((n_keys + ns - 1) / ns);
        n_splits = (int)((n_keys + chunk - 1) / chunk);
    }
    PD_CUDA_CHECK(launch_split<KV>(a, c->attn_part, c->attn_count, n_splits, chunk,
                                   c->decode_stages, mma_stages, c->stream));
    return 0;
}

extern "C" int pd_cuda__attention_decode(void *ctx, const pd_attn_args *a)
{
    return attention_decode<bf16>(ctx, a);
}

/* The FP8 cache's (pd_kv_ops.attention_decode): keys and values e4m3 * k_scale, * v_scale. */
extern "C" int pd_cuda__attention_decode_fp8(void *ctx, const pd_attn_args *a)
{
    return attention_decode<pd_fp8>(ctx, a);
}
