/* cuda_attention.cu -- Paged causal attention (GQA, sliding window, any context length) for
 * prefill and decode batches: one block per (query row, head). Its warps split the context;
 * each warp takes KEYS keys at a time, reads them through the block table, and keeps an
 * online softmax in fp32 (running max, sum and output, the head split over the lanes); the
 * warps' partial results are merged at the end. No score matrix is ever stored. Prefill
 * batches whose shape the tensor-core kernel takes go there instead
 * (cuda_attention_prefill.cu). The kernel is a template on the cache's element type: bf16, or
 * pd_fp8 for the FP8 cache's op (pd_cuda__attention_fp8: keys e4m3 * k_scale, the key scale
 * folded into the softmax scale, values e4m3 * v_scale, the value scale applied to the
 * output). */
#include <math.h>

#include "kernels/cuda/cuda_kv_fp8.cuh"

#define WARPS 8
#define KEYS 4          /* keys per warp per step, loaded together */
#define MAX_HEAD_DIM 256

/* NPL = head elements per lane: lane l holds elements l, l + 32, ..., l + 32 (NPL - 1). KV:
 * the cache's element type; v_scale multiplies the output (1 for bf16). */
template <typename KV, int NPL>
static __global__ void __launch_bounds__(WARPS * 32)
attention_kernel(const bf16 *q, int64_t q_row_stride, const KV *k_cache, const KV *v_cache,
                 bf16 *out, const int32_t *cu_q, const int32_t *ctx_lens,
                 const int32_t *block_tables, int32_t n_seqs, int32_t max_blocks_per_seq,
                 int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                 int32_t sliding_window, float scale, float v_scale)
{
    __shared__ float s_max[WARPS], s_sum[WARPS];
    __shared__ float s_acc[WARPS][MAX_HEAD_DIM];
    const int32_t t = blockIdx.x, h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    /* The row's sequence: the last s with cu_q[s] <= t. */
    int32_t lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        const int32_t mid = (lo + hi + 1) >> 1;
        if (cu_q[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const int32_t s = lo, q0 = cu_q[s], q_len = cu_q[s + 1] - q0;
    if (t < q0) return; /* a row before the batch's first (a mixed batch's decode rows) */
    const int32_t pos = ctx_lens[s] - q_len + (t - q0);
    int32_t start = 0;
    if (sliding_window > 0 && pos - sliding_window + 1 > 0) start = pos - sliding_window + 1;
    const int32_t n_keys = pos - start + 1;
    const int32_t *table = block_tables + (size_t)s * max_blocks_per_seq;
    const int64_t kv_row = (int64_t)n_kv_heads * head_dim;
    const int64_t head_off = (int64_t)(h / (n_heads / n_kv_heads)) * head_dim;

    float qv[NPL], acc[NPL];
    const bf16 *qp = q + (size_t)t * q_row_stride + (size_t)h * head_dim;
#pragma unroll
    for (int j = 0; j < NPL; j++) {
        const int d = lane + 32 * j;
        qv[j] = d < head_dim ? pd_ld(qp + d) : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int32_t k0 = warp * KEYS; k0 < n_keys; k0 += WARPS * KEYS) {
        float sc[KEYS];
        const KV *vp[KEYS];
#pragma unroll
        for (int u = 0; u < KEYS; u++) {
            sc[u] = 0.0f;
            vp[u] = NULL;
            if (k0 + u < n_keys) { /* the same for the whole warp */
                const int32_t p = start + k0 + u;
                const size_t base =
                    ((size_t)table[p / block_size] * block_size + (size_t)(p % block_size)) *
                        kv_row + head_off;
                const KV *kp = k_cache + base;
                vp[u] = v_cache + base;
#pragma unroll
                for (int j = 0; j < NPL; j++) {
                    const int d = lane + 32 * j;
                    if (d < head_dim) sc[u] += qv[j] * pd_ld(kp + d);
                }
            }
        }
        float mx = m;
#pragma unroll
        for (int u = 0; u < KEYS; u++) {
            if (k0 + u < n_keys) {
                sc[u] = pd_warp_sum(sc[u]) * scale;
                mx = fmaxf(mx, sc[u]);
            }
        }
        const float corr = expf(m - mx); /* 0 on the first step (m = -inf, mx finite) */
        float pu[KEYS];
        l *= corr;
#pragma unroll
        for (int u = 0; u < KEYS; u++) {
            pu[u] = k0 + u < n_keys ? expf(sc[u] - mx) : 0.0f;
            l += pu[u];
        }
#pragma unroll
        for (int j = 0; j < NPL; j++) {
            const int d = lane + 32 * j;
            float a = acc[j] * corr;
            if (d < head_dim) {
#pragma unroll
                for (int u = 0; u < KEYS; u++)
                    if (vp[u]) a += pu[u] * pd_ld(vp[u] + d);
            }
            acc[j] = a;
        }
        m = mx;
    }

    /* Merge the warps: a warp that saw no key has m = -inf and weighs 0. */
    if (lane == 0) {
        s_max[warp] = m;
        s_sum[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < NPL; j++) {
        const int d = lane + 32 * j;
        if (d < head_dim) s_acc[warp][d] = acc[j];
    }
    __syncthreads();
    float gmax = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; w++) gmax = fmaxf(gmax, s_max[w]);
    float f[WARPS], total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) {
        f[w] = s_max[w] == -INFINITY ? 0.0f : expf(s_max[w] - gmax);
        total += s_sum[w] * f[w];
    }
    const float inv = (sizeof(KV) == 1 ? v_scale : 1.0f) / total;
    bf16 *o = out + (size_t)t * ((size_t)n_heads * head_dim) + (size_t)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += WARPS * 32) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) v += s_acc[w][d] * f[w];
        pd_st(o + d, v * inv);
    }
}

template <typename KV, int NPL>
static void launch_npl(const pd_attn_args *a, cudaStream_t stream)
{
    const dim3 grid((unsigned)a->n_tokens, (unsigned)a->n_heads);
    const bool fp8 = sizeof(KV) == 1; /* a bf16 cache's scales are not read */
    attention_kernel<KV, NPL><<<grid, WARPS * 32, 0, stream>>>(
        (const bf16 *)a->q, a->q_row_stride, (const KV *)a->k_cache, (const KV *)a->v_cache,
        (bf16 *)a->out, a->cu_q, a->ctx_lens, a->block_tables, a->n_seqs, a->max_blocks_per_seq,
        a->n_heads, a->n_kv_heads, a->head_dim, a->block_size, a->sliding_window,
        fp8 ? a->scale * a->k_scale : a->scale, fp8 ? a->v_scale : 1.0f);
}

template <typename KV>
static cudaError_t launch_attention(const pd_attn_args *a, cudaStream_t stream)
{
    if (a->head_dim <= 32) launch_npl<KV, 1>(a, stream);
    else if (a->head_dim <= 64) launch_npl<KV, 2>(a, stream);
    else if (a->head_dim <= 128) launch_npl<KV, 4>(a, stream);
    else launch_npl<KV, 8>(a, stream);
    return cudaGetLastError();
}

/* The op for a cache of element type KV (the bf16 op and the FP8 cache's). */
template <typename KV>
static int attention(void *ctx, const pd_attn_args *a)
{
    constexpr bool FP8 = sizeof(KV) == 1;
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a) return PD_EINVAL;
    if (FP8 && (!(a->k_scale > 0) || !(a->v_scale > 0) || !isfinite(a->k_scale) ||
                !isfinite(a->v_scale)))
        return PD_EINVAL;
    if (a->n_tokens == 0) return 0;
    if (a->n_tokens < 0 || a->n_seqs <= 0 || a->n_heads <= 0 || a->n_kv_heads <= 0 ||
        a->n_heads % a->n_kv_heads || a->head_dim <= 0 || a->block_size <= 0 ||
        a->max_blocks_per_seq <= 0 || a->sliding_window < 0 ||
        a->q_row_stride < (int64_t)a->n_heads * a->head_dim || !a->q || !a->k_cache ||
        !a->v_cache || !a->out || !a->cu_q || !a->ctx_lens || !a->block_tables ||
        a->n_decode < 0 || a->n_decode > a->n_seqs)
        return PD_EINVAL;
    /* A mixed batch's leading one-row sequences (running decodes beside new prompts) go to the
     * decode kernel as a batch of their own: in the prefill kernel each would take a block of
     * 64 - 128 query rows to use 1 - 8 of them. The rest keeps its absolute rows (cu_q
     * values); the prefill kernel's blocks before them leave at once. */
    if (a->max_q_len > 1 && a->n_decode > 0 && a->n_decode < a->n_seqs) {
        const int32_t D = a->n_decode;
        pd_attn_args d = *a, p = *a;
        d.n_seqs = d.n_tokens = D;
        d.max_q_len = 1;
        d.n_decode = 0;
        int rc = FP8 ? pd_cuda__attention_decode_fp8(ctx, &d)
                     : pd_cuda__attention_decode(ctx, &d);
        if (rc < 0) return rc;
        p.n_seqs = a->n_seqs - D;
        p.cu_q = a->cu_q + D;
        p.ctx_lens = a->ctx_lens + D;
        p.block_tables = a->block_tables + (size_t)D * a->max_blocks_per_seq;
        p.n_decode = 0;
        return attention<KV>(ctx, &p);
    }
    /* Prefill batches go to the tensor-core kernel when their shape fits it (it answers 1
     * when not); decode batches (one query row each) come here only as the decode kernel's
     * fallback and stay here. */
    if (a->max_q_len > 1) {
        const int rc =
            FP8 ? pd_cuda__attention_prefill_fp8(ctx, a) : pd_cuda__attention_prefill(ctx, a);
        if (rc <= 0) return rc;
    }
    if (a->head_dim > MAX_HEAD_DIM || a->n_heads > 65535) return PD_EUNSUPPORTED;
    PD_CUDA_CHECK(launch_attention<KV>(a, c->stream));
    return 0;
}

extern "C" int pd_cuda__attention(void *ctx, const pd_attn_args *a)
{
    return attention<bf16>(ctx, a);
}

/* The FP8 cache's (pd_kv_ops.attention_prefill, and the decode op's fallback). */
extern "C" int pd_cuda__attention_fp8(void *ctx, const pd_attn_args *a)
{
    return attention<pd_fp8>(ctx, a);
}
