/* cuda_rope.cu -- rope_store_kv: rotate-half RoPE on the q and k heads of a fused qkv row,
 * then store k (rotated) and v into the paged cache at the row's slot (slot < 0: not stored);
 * with q_norm / k_norm, Qwen3's per-head RMSNorm first. The angles are pos * inv_freq[i] in
 * fp32 and cos/sin are taken in double and rounded once, as the CPU op does.
 * For head_dim a multiple of 64 (up to 256) one warp takes one head of one token: each lane
 * holds head_dim / 32 elements, element i and its rotation partner i + head_dim / 2 in the
 * same lane, so norm, rotation and stores need no shared memory and every head of a batch of
 * one is in flight at once (decode steps are latency-bound here). Other sizes: one block per
 * token, the norms by the head_rmsnorm op before it.
 * Both kernels are templates on the cache's element type. With an FP8 cache (pd_fp8: the
 * kv_fp8 op set's rope_store_kv) the cache gets e4m3(k / k_scale) and e4m3(v / v_scale), k as
 * the CPU's reference computes it in f32 (cpu_backend.c): the head norm's sum of squares in
 * double and its output not rounded to bf16, the rotation without fused multiply-adds, an
 * IEEE division; so the bytes equal the CPU's on the same inputs (the warp kernel's; the
 * other one's norm is head_rmsnorm's, rounded to bf16). q and the qkv row are as with bf16. */
#include "kernels/cuda/cuda_kv_fp8.cuh"

#define THREADS 128
#define MAX_HALF 256 /* head_dim up to 512 */

/* A cache element from an f32 value: bf16 as rounded, or e4m3(x / scale). */
static __device__ __forceinline__ void kv_put(bf16 *p, float x, float scale)
{
    (void)scale;
    *p = __float2bfloat16_rn(x);
}
static __device__ __forceinline__ void kv_put(pd_fp8 *p, float x, float scale)
{
    p->x = pd_f32_to_e4m3_dev(__fdiv_rn(x, scale));
}

/* The rotation of (x1, x2) by (cs, sn): contracted into fused multiply-adds as nvcc does for
 * bf16 (unchanged), each product and sum rounded for an FP8 cache (the CPU's order). */
template <typename KV>
static __device__ __forceinline__ void rotate(float x1, float x2, float cs, float sn, float *o1,
                                              float *o2)
{
    if constexpr (sizeof(KV) == 1) {
        *o1 = __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn));
        *o2 = __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
    } else {
        *o1 = x1 * cs - x2 * sn;
        *o2 = x2 * cs + x1 * sn;
    }
}

template <typename KV>
static __global__ void __launch_bounds__(THREADS)
rope_kernel(bf16 *qkv, const int32_t *positions, const int32_t *slots, const float *inv_freq,
            KV *k_cache, KV *v_cache, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
            float attn_factor, float k_scale, float v_scale)
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
    KV *kd = slot >= 0 ? k_cache + (size_t)slot * kv_row : NULL;
    /* q heads then k heads are consecutive in the row: head h of either is at h * head_dim. */
    const int32_t pairs = (n_heads + n_kv_heads) * half;
    for (int32_t j = threadIdx.x; j < pairs; j += THREADS) {
        const int32_t h = j / half, i = j % half;
        bf16 *p = row + (size_t)h * head_dim;
        const float x1 = pd_ld(p + i), x2 = pd_ld(p + i + half);
        float o1, o2;
        rotate<KV>(x1, x2, cs[i], sn[i], &o1, &o2);
        p[i] = __float2bfloat16_rn(o1);
        p[i + half] = __float2bfloat16_rn(o2);
        if (kd && h >= n_heads) {
            KV *kh = kd + (size_t)(h - n_heads) * head_dim;
            kv_put(kh + i, o1, k_scale);
            kv_put(kh + i + half, o2, k_scale);
        }
    }
    if (kd) {
        KV *vd = v_cache + (size_t)slot * kv_row;
        for (int32_t j = threadIdx.x; j < kv_row; j += THREADS)
            kv_put(vd + j, pd_ld(v + j), v_scale);
    }
}

#define WARPS 4

/* NR = head_dim / 32 elements per lane (even). Items are (token, head) over the q, k and v
 * heads of each row: a v head is only copied to the cache. */
template <typename KV, int NR>
static __global__ void __launch_bounds__(WARPS * 32)
rope_warp_kernel(bf16 *qkv, const int32_t *positions, const int32_t *slots,
                 const float *inv_freq, KV *k_cache, KV *v_cache, int32_t n_heads,
                 int32_t n_kv_heads, float attn_factor, const bf16 *q_norm, const bf16 *k_norm,
                 float eps, int64_t n_items, float k_scale, float v_scale)
{
    constexpr int HD = NR * 32, HALF = HD / 2, NP = NR / 2;
    constexpr bool FP8 = sizeof(KV) == 1;
    pd_pdl_enter();
    const int64_t item = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (item >= n_items) return;
    const int32_t heads = n_heads + 2 * n_kv_heads;
    const int64_t t = item / heads;
    const int32_t h = (int32_t)(item % heads);
    bf16 *p = qkv + (size_t)t * heads * HD + (size_t)h * HD;
    const int32_t slot = slots[t];
    const int64_t kv_row = (int64_t)n_kv_heads * HD;
    if (h >= n_heads + n_kv_heads) { /* a v head: to the cache as it is */
        if (slot < 0) return;
        KV *vd = v_cache + (size_t)slot * kv_row + (size_t)(h - n_heads - n_kv_heads) * HD;
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if constexpr (FP8) kv_put(vd + lane + 32 * r, pd_ld(p + lane + 32 * r), v_scale);
            else vd[lane + 32 * r] = p[lane + 32 * r];
        }
        return;
    }
    /* an FP8 cache's k head: computed as the CPU does (the file's comment) */
    const bool exact = FP8 && h >= n_heads;
    float x[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) x[r] = pd_ld(p + lane + 32 * r);
    const bf16 *nw = h < n_heads ? q_norm : k_norm;
    if (nw && exact) { /* the sum in double (exact for bf16 inputs), no rounding to bf16 */
        double ss = 0.0;
#pragma unroll
        for (int r = 0; r < NR; r++) ss += (double)x[r] * x[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float rr = (float)(1.0 / sqrt(ss / HD + eps));
#pragma unroll
        for (int r = 0; r < NR; r++)
            x[r] = __fmul_rn(pd_ld(nw + lane + 32 * r), __fmul_rn(x[r], rr));
    } else if (nw) { /* rounded to bf16 as the unfused norm stores it */
        float ss = 0.0f;
#pragma unroll
        for (int r = 0; r < NR; r++) ss += x[r] * x[r];
        ss = pd_warp_sum(ss);
        const float rr = (float)(1.0 / sqrt((double)ss / HD + eps));
#pragma unroll
        for (int r = 0; r < NR; r++)
            x[r] = __bfloat162float(__float2bfloat16_rn(pd_ld(nw + lane + 32 * r) * (x[r] * rr)));
    }
    const float pos = (float)positions[t];
    KV *kd = h >= n_heads && slot >= 0
                 ? k_cache + (size_t)slot * kv_row + (size_t)(h - n_heads) * HD : NULL;
#pragma unroll
    for (int r = 0; r < NP; r++) {
        const int i = lane + 32 * r;
        double sd, cd;
        sincos((double)(pos * inv_freq[i]), &sd, &cd);
        const float cs = (float)cd * attn_factor, sn = (float)sd * attn_factor;
        const float x1 = x[r], x2 = x[r + NP];
        float o1, o2;
        if (exact) rotate<KV>(x1, x2, cs, sn, &o1, &o2);
        else rotate<bf16>(x1, x2, cs, sn, &o1, &o2);
        p[i] = __float2bfloat16_rn(o1);
        p[i + HALF] = __float2bfloat16_rn(o2);
        if (kd) {
            kv_put(kd + i, o1, k_scale);
            kv_put(kd + i + HALF, o2, k_scale);
        }
    }
}

/* An FP8 cache's scales (a bf16 cache's are not read: backend.h). */
template <typename KV>
static float2 scales_of(const pd_rope_args *a)
{
    return sizeof(KV) == 1 ? make_float2(a->k_scale, a->v_scale) : make_float2(1.0f, 1.0f);
}

/* ---- a block a token, 16-byte accesses (head_dim 64, 128, 256) ----
 * The warp kernel above computes each angle's cos and sin once a head (in double) and moves
 * 2-byte elements: a prefill step's rows of many heads spent more time there than their bytes
 * take (docs/perf-history.md, "FP8 prefill: the quantization fused into its producers").
 * Here a block takes a token: its angles once into shared memory, then LPH = head_dim / 16
 * lanes a head, a lane's 8 elements of the first half (one 16-byte load) and their 8 rotation
 * partners of the second half. Each element's arithmetic is the warp kernel's (the same bits;
 * a head norm's sum is reduced in another order, so a normed bf16 q or k may differ in its last
 * bit; an FP8 cache's exact k path sums in double, exact in any order). */

/* A lane's 8 cache elements (16 bytes of bf16, 8 of e4m3) from f32 values. */
static __device__ __forceinline__ void kv_put8(bf16 *p, const float (&x)[8], float scale)
{
    (void)scale;
    *reinterpret_cast<uint4 *>(p) = make_uint4(pd_pack_bf16(x[0], x[1]), pd_pack_bf16(x[2], x[3]),
                                               pd_pack_bf16(x[4], x[5]), pd_pack_bf16(x[6], x[7]));
}
static __device__ __forceinline__ void kv_put8(pd_fp8 *p, const float (&x)[8], float scale)
{
    const float r = __frcp_rn(scale); /* e4m3(x / scale), bit for bit (pd_e4m3x2_div) */
    uint32_t o[2];
#pragma unroll
    for (int e = 0; e < 2; e++)
        o[e] = pd_e4m3x2_div(x[4 * e], x[4 * e + 1], scale, r) |
               pd_e4m3x2_div(x[4 * e + 2], x[4 * e + 3], scale, r) << 16;
    *reinterpret_cast<uint2 *>(p) = make_uint2(o[0], o[1]);
}

static __device__ __forceinline__ void unpack8(uint4 v, float (&x)[8])
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        x[2 * e] = pd_bf16_lo(w[e]);
        x[2 * e + 1] = pd_bf16_hi(w[e]);
    }
}

/* A sum over the LPH lanes of a head (mask: those lanes). */
template <int LPH, typename T>
static __device__ __forceinline__ T head_sum(T v, unsigned mask)
{
#pragma unroll
    for (int o = LPH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
    return v;
}

template <typename KV, int HD>
static __global__ void __launch_bounds__(1024)
rope_vec_kernel(bf16 *qkv, const int32_t *positions, const int32_t *slots,
                const float *inv_freq, KV *k_cache, KV *v_cache, int32_t n_heads,
                int32_t n_kv_heads, float attn_factor, const bf16 *q_norm, const bf16 *k_norm,
                float eps, float k_scale, float v_scale)
{
    constexpr int HALF = HD / 2, LPH = HALF / 8;
    constexpr bool FP8 = sizeof(KV) == 1;
    __shared__ float cs[HALF], sn[HALF];
    pd_pdl_enter();
    const int64_t t = blockIdx.x;
    const int32_t heads = n_heads + 2 * n_kv_heads, slot = slots[t];
    const int c = threadIdx.x % LPH, lane = threadIdx.x & 31;
    bf16 *row = qkv + t * heads * HD;
    /* the thread's first head is loaded before the angles (usually its only one: the block
     * has a lane for every head's chunk up to 1024 threads) */
    int32_t h = threadIdx.x / LPH;
    uint4 a1 = make_uint4(0u, 0u, 0u, 0u), a2 = a1;
    if (h < heads) {
        a1 = *reinterpret_cast<const uint4 *>(row + (size_t)h * HD + 8 * c);
        a2 = *reinterpret_cast<const uint4 *>(row + (size_t)h * HD + HALF + 8 * c);
    }
    const float pos = (float)positions[t];
    for (int i = threadIdx.x; i < HALF; i += blockDim.x) {
        double sd, cd;
        sincos((double)(pos * inv_freq[i]), &sd, &cd);
        cs[i] = (float)cd * attn_factor;
        sn[i] = (float)sd * attn_factor;
    }
    __syncthreads();
    const int64_t kv_row = (int64_t)n_kv_heads * HD;
    const unsigned mask = (LPH == 32 ? 0xffffffffu : ((1u << LPH) - 1u)) << (lane / LPH * LPH);
    for (bool first = true; h < heads; h += blockDim.x / LPH, first = false) {
        bf16 *p = row + (size_t)h * HD;
        uint4 *p1 = reinterpret_cast<uint4 *>(p + 8 * c), *p2 = reinterpret_cast<uint4 *>(p + HALF + 8 * c);
        float x1[8], x2[8];
        unpack8(first ? a1 : *p1, x1);
        unpack8(first ? a2 : *p2, x2);
        if (h >= n_heads + n_kv_heads) { /* a v head: to the cache as it is */
            if (slot >= 0) {
                KV *vd = v_cache + (size_t)slot * kv_row + (size_t)(h - n_heads - n_kv_heads) * HD;
                kv_put8(vd + 8 * c, x1, v_scale);
                kv_put8(vd + HALF + 8 * c, x2, v_scale);
            }
            continue;
        }
        const bool exact = FP8 && h >= n_heads; /* an FP8 cache's k head (the file's comment) */
        const bf16 *nw = h < n_heads ? q_norm : k_norm;
        if (nw) {
            float w1[8], w2[8];
            unpack8(*reinterpret_cast<const uint4 *>(nw + 8 * c), w1);
            unpack8(*reinterpret_cast<const uint4 *>(nw + HALF + 8 * c), w2);
            if (exact) {
                double ss = 0.0;
#pragma unroll
                for (int e = 0; e < 8; e++) ss += (double)x1[e] * x1[e] + (double)x2[e] * x2[e];
                const float rr = (float)(1.0 / sqrt(head_sum<LPH>(ss, mask) / HD + eps));
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    x1[e] = __fmul_rn(w1[e], __fmul_rn(x1[e], rr));
                    x2[e] = __fmul_rn(w2[e], __fmul_rn(x2[e], rr));
                }
            } else {
                float ss = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) ss += x1[e] * x1[e] + x2[e] * x2[e];
                const float rr = (float)(1.0 / sqrt((double)head_sum<LPH>(ss, mask) / HD + eps));
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    x1[e] = __bfloat162float(__float2bfloat16_rn(w1[e] * (x1[e] * rr)));
                    x2[e] = __bfloat162float(__float2bfloat16_rn(w2[e] * (x2[e] * rr)));
                }
            }
        }
        float o1[8], o2[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int i = 8 * c + e;
            if (exact) rotate<KV>(x1[e], x2[e], cs[i], sn[i], &o1[e], &o2[e]);
            else rotate<bf16>(x1[e], x2[e], cs[i], sn[i], &o1[e], &o2[e]);
        }
        kv_put8(reinterpret_cast<bf16 *>(p1), o1, 1.0f);
        kv_put8(reinterpret_cast<bf16 *>(p2), o2, 1.0f);
        if (h >= n_heads && slot >= 0) {
            KV *kd = k_cache + (size_t)slot * kv_row + (size_t)(h - n_heads) * HD;
            kv_put8(kd + 8 * c, o1, k_scale);
            kv_put8(kd + HALF + 8 * c, o2, k_scale);
        }
    }
}

template <typename KV, int HD>
static cudaError_t launch_vec_t(const pd_rope_args *a, cudaStream_t stream)
{
    const int32_t heads = a->n_heads + 2 * a->n_kv_heads;
    const int64_t lanes = (int64_t)heads * (HD / 16);
    const unsigned threads = (unsigned)(lanes >= 1024 ? 1024 : (lanes + 31) / 32 * 32);
    const float2 sc = scales_of<KV>(a);
    return pd_cuda__launch(rope_vec_kernel<KV, HD>, dim3((unsigned)a->n_tokens), dim3(threads), 0,
                           stream, (bf16 *)a->qkv, a->positions, a->slot_mapping, a->inv_freq,
                           (KV *)a->k_cache, (KV *)a->v_cache, a->n_heads, a->n_kv_heads,
                           a->attn_factor, (const bf16 *)a->q_norm, (const bf16 *)a->k_norm,
                           a->norm_eps, sc.x, sc.y);
}

/* The block-a-token kernel for its head sizes and 16-byte aligned buffers;
 * cudaErrorNotSupported for the others. */
template <typename KV>
static cudaError_t launch_vec(const pd_rope_args *a, cudaStream_t stream)
{
    const uintptr_t al = (uintptr_t)a->qkv | (uintptr_t)a->k_cache | (uintptr_t)a->v_cache |
                         (uintptr_t)a->q_norm | (uintptr_t)a->k_norm;
    if ((al & 15) != 0 || a->n_tokens > INT32_MAX) return cudaErrorNotSupported;
    switch (a->head_dim) {
    case 64: return launch_vec_t<KV, 64>(a, stream);
    case 128: return launch_vec_t<KV, 128>(a, stream);
    case 256: return launch_vec_t<KV, 256>(a, stream);
    default: return cudaErrorNotSupported;
    }
}


template <typename KV, int NR>
static cudaError_t launch_warp_t(const pd_rope_args *a, cudaStream_t stream)
{
    const int64_t items = (int64_t)a->n_tokens * (a->n_heads + 2 * a->n_kv_heads);
    const unsigned blocks = (unsigned)((items + WARPS - 1) / WARPS);
    const float2 sc = scales_of<KV>(a);
    return pd_cuda__launch(rope_warp_kernel<KV, NR>, dim3(blocks), dim3(WARPS * 32), 0, stream,
                           (bf16 *)a->qkv, a->positions, a->slot_mapping, a->inv_freq,
                           (KV *)a->k_cache, (KV *)a->v_cache, a->n_heads, a->n_kv_heads,
                           a->attn_factor, (const bf16 *)a->q_norm, (const bf16 *)a->k_norm,
                           a->norm_eps, items, sc.x, sc.y);
}

/* The warp kernel for its head sizes; cudaErrorNotSupported for the others. */
template <typename KV>
static cudaError_t launch_warp(const pd_rope_args *a, cudaStream_t stream)
{
    switch (a->head_dim) {
    case 64: return launch_warp_t<KV, 2>(a, stream);
    case 128: return launch_warp_t<KV, 4>(a, stream);
    case 192: return launch_warp_t<KV, 6>(a, stream);
    case 256: return launch_warp_t<KV, 8>(a, stream);
    default: return cudaErrorNotSupported;
    }
}

template <typename KV>
static cudaError_t launch_rope(const pd_rope_args *a, cudaStream_t stream)
{
    const float2 sc = scales_of<KV>(a);
    rope_kernel<KV><<<a->n_tokens, THREADS, 0, stream>>>(
        (bf16 *)a->qkv, a->positions, a->slot_mapping, a->inv_freq, (KV *)a->k_cache,
        (KV *)a->v_cache, a->n_heads, a->n_kv_heads, a->head_dim, a->attn_factor, sc.x, sc.y);
    return cudaGetLastError();
}

/* The op for a cache of element type KV (the bf16 op and the FP8 cache's). */
template <typename KV>
static int rope_store_kv(void *ctx, const pd_rope_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a) return PD_EINVAL;
    if (sizeof(KV) == 1 && (!(a->k_scale > 0) || !(a->v_scale > 0) || !isfinite(a->k_scale) ||
                            !isfinite(a->v_scale)))
        return PD_EINVAL;
    if (a->n_tokens == 0) return 0;
    if (a->n_tokens < 0 || a->n_heads <= 0 || a->n_kv_heads <= 0 || a->head_dim <= 0 ||
        a->head_dim % 2 || !a->qkv || !a->positions || !a->slot_mapping || !a->inv_freq ||
        !a->k_cache || !a->v_cache)
        return PD_EINVAL;
    if (a->head_dim / 2 > MAX_HALF) return PD_EUNSUPPORTED;
    if (!a->q_norm != !a->k_norm) return PD_EINVAL;
    const int64_t items = (int64_t)a->n_tokens * (a->n_heads + 2 * a->n_kv_heads);
    static const bool vec = pd_env_bool("PDSERVE_CUDA_ROPE_VEC");
    if (vec) {
        const cudaError_t e = launch_vec<KV>(a, c->stream);
        if (e != cudaErrorNotSupported) {
            PD_CUDA_CHECK(e);
            return 0;
        }
    }
    if (a->head_dim % 64 == 0 && a->head_dim <= 256 && (items + WARPS - 1) / WARPS < INT32_MAX) {
        PD_CUDA_CHECK(launch_warp<KV>(a, c->stream));
        return 0;
    }
    if (a->q_norm) {
        const int64_t row = (int64_t)(a->n_heads + 2 * a->n_kv_heads) * a->head_dim;
        int rc = pd_cuda__head_rmsnorm(ctx, a->qkv, a->n_tokens, row, a->n_heads, a->head_dim,
                                       a->q_norm, a->norm_eps);
        if (rc == 0)
            rc = pd_cuda__head_rmsnorm(ctx, (bf16 *)a->qkv + (size_t)a->n_heads * a->head_dim,
                                       a->n_tokens, row, a->n_kv_heads, a->head_dim, a->k_norm,
                                       a->norm_eps);
        if (rc < 0) return rc;
    }
    PD_CUDA_CHECK(launch_rope<KV>(a, c->stream));
    return 0;
}

extern "C" int pd_cuda__rope_store_kv(void *ctx, const pd_rope_args *a)
{
    return rope_store_kv<bf16>(ctx, a);
}

/* The FP8 cache's (pd_kv_ops.rope_store_kv). */
extern "C" int pd_cuda__rope_store_kv_fp8(void *ctx, const pd_rope_args *a)
{
    return rope_store_kv<pd_fp8>(ctx, a);
}
