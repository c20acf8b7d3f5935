/* cuda_attention_decode.cu -- Split-KV ("flash-decoding") paged attention for decode batches
 * (every sequence has one query row). Grid (split, kv head, sequence): each block takes all
 * the query heads of one GQA group over one chunk of the sequence's context, so each K/V row
 * is read once per group, not once per query head. In a block, TPK = head_dim / 8 lanes share
 * a key (one 16-byte load of K and one of V each, 8 bf16 kept packed until used), so a warp
 * works on 32 / TPK keys at a time, two such rounds unrolled, the block-table entries of the
 * next round loaded a round ahead; every lane group keeps its own online softmax in fp32
 * (base 2, the scale folded into q) and the groups are merged through shared memory at the
 * end. With one split the block writes the output; with several it writes its unnormalised
 * partial output, max and sum to the context's workspace, and a second kernel combines the
 * splits. The split count aims at about 4 blocks per SM (PDSERVE_CUDA_DECODE_BLOCKS_PER_SM)
 * with chunks of at least MIN_CHUNK keys, within the workspace; with the longest context
 * unknown (a graph) it comes from the batch alone and each sequence cuts its own context.
 * Latency-bound: the decode kernel is measured by pdserve-bench-kernels --attention (packed
 * K/V and the early table loads took batch 256 x 1k from 61% to 67% of the copy rate on an
 * H200; 4 rounds unrolled was slower: fewer blocks fit). What this kernel does not cover
 * (head_dim not in {8, 16, 32, 64, 128, 256}, more than 8 query heads per KV head,
 * prefill-shaped batches, a batch too large for the workspace, unaligned caches,
 * PDSERVE_CUDA_SPLIT_KV=0) goes to the general kernel (cuda_attention.cu). */

#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

#define NW 4            /* warps per block */
#define UNROLL 2        /* key rounds per loop iteration (4: slower, fewer blocks fit) */
#define MIN_CHUNK 32    /* fewest keys a split gets */
#define MAX_G 8         /* query heads per KV head handled here */

struct __align__(16) bf16x8 { __nv_bfloat162 h[4]; };

/* Element e (a constant after unrolling) of 8 packed bf16: K and V stay packed in registers
 * until used, half the registers of floats, so more blocks fit on an SM. */
static __device__ __forceinline__ float elem(const bf16x8 &v, int e)
{
    return e & 1 ? __high2float(v.h[e >> 1]) : __low2float(v.h[e >> 1]);
}

/* TPK lanes per key (head_dim = 8 TPK); MAXG >= G query heads per KV head. */
template <int TPK, int MAXG>
static __global__ void __launch_bounds__(NW * 32)
split_kernel(const bf16 *__restrict__ q, int64_t q_row_stride, const bf16 *__restrict__ k_cache,
             const bf16 *__restrict__ v_cache, bf16 *__restrict__ out, float *__restrict__ part,
             const int32_t *__restrict__ cu_q, const int32_t *__restrict__ ctx_lens,
             const int32_t *__restrict__ block_tables, int32_t n_seqs, int32_t max_blocks_per_seq,
             int32_t n_heads, int32_t n_kv_heads, int32_t G, int32_t block_size,
             int32_t sliding_window, int32_t chunk, float scale_log2)
{
    constexpr int HD = TPK * 8, KPW = 32 / TPK, GROUPS = NW * KPW;
    __shared__ float sm_m[GROUPS][MAXG], sm_l[GROUPS][MAXG];
    __shared__ float sm_acc[GROUPS][MAXG][HD];
    pd_pdl_wait(); /* large decode batches take several waves: no early successor */
    const int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, n_splits = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane / TPK, sub = lane % TPK, gid = warp * KPW + grp;

    const int32_t ctx = ctx_lens[s], row = cu_q[s];
    int32_t start = 0;
    if (sliding_window > 0 && ctx - sliding_window > 0) start = ctx - sliding_window;
    if (chunk <= 0) { /* sized per sequence (the batch's longest context is not known) */
        const int32_t n_keys = ctx - start;
        chunk = max((n_keys + n_splits - 1) / n_splits, MIN_CHUNK);
    }
    const int32_t k_begin = start + split * chunk;
    const int32_t k_end = min(k_begin + chunk, ctx);
    const int32_t *table = block_tables + (size_t)s * max_blocks_per_seq;
    const int64_t kv_row = (int64_t)n_kv_heads * HD;
    const int64_t col = (int64_t)kvh * HD + sub * 8;

    float qf[MAXG][8], acc[MAXG][8], m[MAXG], l[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        const bf16 *qp = q + (size_t)row * q_row_stride + (size_t)(kvh * G + g) * HD + sub * 8;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            qf[g][e] = g < G ? pd_ld(qp + e) * scale_log2 : 0.0f;
            acc[g][e] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }

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
                kr[u] = *reinterpret_cast<const bf16x8 *>(k_cache + off);
                vr[u] = *reinterpret_cast<const bf16x8 *>(v_cache + off);
            } else {
                const __nv_bfloat162 z = __float2bfloat162_rn(0.0f);
#pragma unroll
                for (int i = 0; i < 4; i++) kr[u].h[i] = vr[u].h[i] = z;
            }
        }
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            if (g >= G) break;
            float sc[UNROLL], mx = m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
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
            float p[UNROLL];
            l[g] *= corr;
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                p[u] = ok[u] ? exp2f(sc[u] - mx) : 0.0f;
                l[g] += p[u];
            }
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float a = acc[g][e] * corr;
#pragma unroll
                for (int u = 0; u < UNROLL; u++) a = fmaf(p[u], elem(vr[u], e), a);
                acc[g][e] = a;
            }
            m[g] = mx;
        }
    }

#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g >= G) break;
#pragma unroll
        for (int e = 0; e < 8; e++) sm_acc[gid][g][sub * 8 + e] = acc[g][e];
        if (sub == 0) {
            sm_m[gid][g] = m[g];
            sm_l[gid][g] = l[g];
        }
    }
    __syncthreads();

    /* Merge the lane groups: one (head, element) pair per thread and round. */
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
        if (n_splits == 1) { /* no key at all (a padding row of context 0) gives zeros */
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
}

/* Combines the splits of each (sequence, head): grid (head, sequence), a thread per element. */
static __global__ void combine_kernel(const float *__restrict__ part, bf16 *__restrict__ out,
                                      const int32_t *__restrict__ cu_q, int32_t n_seqs,
                                      int32_t n_heads, int32_t head_dim, int32_t n_splits)
{
    pd_pdl_enter();
    const int h = blockIdx.x, s = blockIdx.y;
    const size_t item0 = ((size_t)s * n_heads + h) * n_splits;
    const float *ml = part + (size_t)n_seqs * n_heads * n_splits * head_dim + 2 * item0;
    float gm = -INFINITY;
    for (int j = 0; j < n_splits; j++) gm = fmaxf(gm, ml[2 * j]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float total = 0.0f, o = 0.0f;
        for (int j = 0; j < n_splits; j++) {
            const float mj = ml[2 * j];
            if (mj == -INFINITY) continue; /* an empty split (a shorter sequence) */
            const float f = exp2f(mj - gm);
            total += ml[2 * j + 1] * f;
            o += part[(item0 + j) * head_dim + d] * f;
        }
        pd_st(out + (size_t)cu_q[s] * ((size_t)n_heads * head_dim) + (size_t)h * head_dim + d,
              total > 0.0f ? o / total : 0.0f);
    }
}

template <int TPK, int MAXG>
static cudaError_t launch_tg(const pd_attn_args *a, float *part, int n_splits, int chunk,
                             cudaStream_t stream)
{
    const dim3 grid((unsigned)n_splits, (unsigned)a->n_kv_heads, (unsigned)a->n_seqs);
    const float log2e = 1.4426950408889634f;
#define PD_SPLIT_ARGS                                                                          \
    (const bf16 *)a->q, a->q_row_stride, (const bf16 *)a->k_cache, (const bf16 *)a->v_cache,   \
        (bf16 *)a->out, part, a->cu_q, a->ctx_lens, a->block_tables, a->n_seqs,                \
        a->max_blocks_per_seq, a->n_heads, a->n_kv_heads, a->n_heads / a->n_kv_heads,          \
        a->block_size, a->sliding_window, chunk, a->scale * log2e
    cudaError_t e =
        pd_cuda__launch(split_kernel<TPK, MAXG>, grid, dim3(NW * 32), 0, stream, PD_SPLIT_ARGS);
#undef PD_SPLIT_ARGS
    if (e != cudaSuccess || n_splits == 1) return e;
    const dim3 cgrid((unsigned)a->n_heads, (unsigned)a->n_seqs);
    const int threads = a->head_dim < 32 ? 32 : a->head_dim;
    return pd_cuda__launch(combine_kernel, cgrid, dim3((unsigned)threads), 0, stream, part,
                           (bf16 *)a->out, a->cu_q, a->n_seqs, a->n_heads, a->head_dim,
                           n_splits);
}

template <int TPK>
static cudaError_t launch_t(const pd_attn_args *a, float *part, int n_splits, int chunk,
                            cudaStream_t stream)
{
    const int G = a->n_heads / a->n_kv_heads;
    if (G <= 1) return launch_tg<TPK, 1>(a, part, n_splits, chunk, stream);
    if (G <= 2) return launch_tg<TPK, 2>(a, part, n_splits, chunk, stream);
    if (G <= 4) return launch_tg<TPK, 4>(a, part, n_splits, chunk, stream);
    return launch_tg<TPK, 8>(a, part, n_splits, chunk, stream);
}

static cudaError_t launch_split(const pd_attn_args *a, float *part, int n_splits, int chunk,
                                cudaStream_t stream)
{
    switch (a->head_dim) {
    case 8: return launch_t<1>(a, part, n_splits, chunk, stream);
    case 16: return launch_t<2>(a, part, n_splits, chunk, stream);
    case 32: return launch_t<4>(a, part, n_splits, chunk, stream);
    case 64: return launch_t<8>(a, part, n_splits, chunk, stream);
    case 128: return launch_t<16>(a, part, n_splits, chunk, stream);
    default: return launch_t<32>(a, part, n_splits, chunk, stream);
    }
}

extern "C" int pd_cuda__attention_decode(void *ctx, const pd_attn_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a) return PD_EINVAL;
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
        return pd_cuda__attention(ctx, a);
    }

    /* Splits: about two blocks per SM, chunks of at least MIN_CHUNK keys, within the
     * workspace (partial outputs, max and sum of each split of each head). With the longest
     * context unknown (max_ctx_len 0: a graph replayed over other contexts) the split count
     * comes from the batch alone and each sequence cuts its own context into that many
     * chunks (chunk 0 tells the kernel so); splits past a short context stay empty. */
    int32_t n_keys = a->max_ctx_len;
    if (a->sliding_window > 0 && (n_keys == 0 || a->sliding_window < n_keys))
        n_keys = a->sliding_window;
    const int64_t base_blocks = (int64_t)a->n_seqs * a->n_kv_heads;
    const int64_t target = (int64_t)c->decode_blocks_per_sm * c->sm_count;
    int64_t ns = (target + base_blocks - 1) / base_blocks;
    if (n_keys > 0) {
        const int64_t by_len = (n_keys + MIN_CHUNK - 1) / MIN_CHUNK;
        if (ns > by_len) ns = by_len;
    }
    const int64_t per_split = (int64_t)a->n_seqs * a->n_heads * (hd + 2);
    const int64_t by_ws = (int64_t)(c->attn_part_floats / (size_t)per_split);
    if (ns > by_ws) ns = by_ws;
    if (ns > 65535) ns = 65535;
    if (ns < 1) ns = 1; /* one split writes the output directly: no workspace */
    int32_t chunk = 0;
    int n_splits = (int)ns;
    if (a->max_ctx_len > 0) {
        chunk = (int32_t)((n_keys + ns - 1) / ns);
        n_splits = (int)((n_keys + chunk - 1) / chunk);
    }
    PD_CUDA_CHECK(launch_split(a, c->attn_part, n_splits, chunk, c->stream));
    return 0;
}
