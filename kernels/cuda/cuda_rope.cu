/* cuda_rope.cu -- rope_store_kv: rotate-half RoPE on the q and k heads of a fused qkv row,
 * then store k (rotated) and v into the paged cache at the row's slot (slot < 0: not stored).
 * One block per token; the angles are pos * inv_freq[i] in fp32 and cos/sin are taken in
 * double and rounded once, as the CPU op does. */
#include "kernels/cuda/cuda_common.cuh"

#define THREADS 128
#define MAX_HALF 256 /* head_dim up to 512 */

static __global__ void __launch_bounds__(THREADS)
rope_kernel(bf16 *qkv, const int32_t *positions, const int32_t *slots, const float *inv_freq,
            bf16 *k_cache, bf16 *v_cache, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
            float attn_factor)
{
    __shared__ float cs[MAX_HALF], sn[MAX_HALF];
    const int32_t t = blockIdx.x, half = head_dim / 2;
    const float pos = (float)positions[t];
    for (int32_t i = threadIdx.x; i < half; i += THREADS) {
        double s, co;
        sincos((double)(pos * inv_freq[i]), &s, &co);
        cs[i] = (float)co * attn_factor;
        sn[i] = (float)s * attn_factor;
    }
    __syncthreads();
    const int64_t kv_row = (int64_t)n_kv_heads * head_dim;
    bf16 *row = qkv + (size_t)t * ((size_t)(n_heads + 2 * n_kv_heads) * head_dim);
    const bf16 *v = row + (size_t)(n_heads + n_kv_heads) * head_dim;
    const int32_t slot = slots[t];
    bf16 *kd = slot >= 0 ? k_cache + (size_t)slot * kv_row : NULL;
    /* q heads then k heads are consecutive in the row: head h of either is at h * head_dim. */
    const int32_t pairs = (n_heads + n_kv_heads) * half;
    for (int32_t j = threadIdx.x; j < pairs; j += THREADS) {
        const int32_t h = j / half, i = j % half;
        bf16 *p = row + (size_t)h * head_dim;
        const float x1 = pd_ld(p + i), x2 = pd_ld(p + i + half);
        const bf16 o1 = __float2bfloat16_rn(x1 * cs[i] - x2 * sn[i]);
        const bf16 o2 = __float2bfloat16_rn(x2 * cs[i] + x1 * sn[i]);
        p[i] = o1;
        p[i + half] = o2;
        if (kd && h >= n_heads) {
            bf16 *kh = kd + (size_t)(h - n_heads) * head_dim;
            kh[i] = o1;
            kh[i + half] = o2;
        }
    }
    if (kd) {
        bf16 *vd = v_cache + (size_t)slot * kv_row;
        for (int32_t j = threadIdx.x; j < kv_row; j += THREADS) vd[j] = v[j];
    }
}

static cudaError_t launch_rope(const pd_rope_args *a, cudaStream_t stream)
{
    rope_kernel<<<a->n_tokens, THREADS, 0, stream>>>(
        (bf16 *)a->qkv, a->positions, a->slot_mapping, a->inv_freq, (bf16 *)a->k_cache,
        (bf16 *)a->v_cache, a->n_heads, a->n_kv_heads, a->head_dim, a->attn_factor);
    return cudaGetLastError();
}

extern "C" int pd_cuda__rope_store_kv(void *ctx, const pd_rope_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a) return PD_EINVAL;
    if (a->n_tokens == 0) return 0;
    if (a->n_tokens < 0 || a->n_heads <= 0 || a->n_kv_heads <= 0 || a->head_dim <= 0 ||
        a->head_dim % 2 || !a->qkv || !a->positions || !a->slot_mapping || !a->inv_freq ||
        !a->k_cache || !a->v_cache)
        return PD_EINVAL;
    if (a->head_dim / 2 > MAX_HALF) return PD_EUNSUPPORTED;
    PD_CUDA_CHECK(launch_rope(a, c->stream));
    return 0;
}
