/* cuda_head_rmsnorm.cu -- In-place RMSNorm of each head of each row (Qwen3's q_norm and
 * k_norm), one warp per (row, head). */
#include "kernels/cuda/cuda_common.cuh"

#define WARPS 4

static __global__ void __launch_bounds__(WARPS * 32)
head_rmsnorm_kernel(bf16 *x, int32_t n, int64_t row_stride, int32_t n_heads, int32_t head_dim,
                    const bf16 *w, float eps)
{
    const int64_t item = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (item >= (int64_t)n * n_heads) return;
    bf16 *v = x + (item / n_heads) * row_stride + (item % n_heads) * head_dim;
    float ss = 0.0f;
    for (int32_t j = lane; j < head_dim; j += 32) {
        const float e = pd_ld(v + j);
        ss += e * e;
    }
    ss = pd_warp_sum(ss);
    const float r = (float)(1.0 / sqrt((double)ss / head_dim + eps));
    for (int32_t j = lane; j < head_dim; j += 32) pd_st(v + j, pd_ld(w + j) * (pd_ld(v + j) * r));
}

static cudaError_t launch_head_rmsnorm(bf16 *x, int32_t n, int64_t row_stride, int32_t n_heads,
                                       int32_t head_dim, const bf16 *w, float eps,
                                       cudaStream_t stream)
{
    const int64_t items = (int64_t)n * n_heads;
    const unsigned blocks = (unsigned)((items + WARPS - 1) / WARPS);
    head_rmsnorm_kernel<<<blocks, WARPS * 32, 0, stream>>>(x, n, row_stride, n_heads, head_dim,
                                                           w, eps);
    return cudaGetLastError();
}

extern "C" int pd_cuda__head_rmsnorm(void *ctx, void *x, int32_t n, int64_t row_stride,
                                     int32_t n_heads, int32_t head_dim, const void *w, float eps)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n == 0 || n_heads == 0) return 0;
    if (n < 0 || n_heads < 0 || head_dim <= 0 || row_stride < (int64_t)n_heads * head_dim ||
        !x || !w)
        return PD_EINVAL;
    if ((int64_t)n * n_heads / WARPS >= INT32_MAX) return PD_EUNSUPPORTED;
    PD_CUDA_CHECK(launch_head_rmsnorm((bf16 *)x, n, row_stride, n_heads, head_dim,
                                      (const bf16 *)w, eps, c->stream));
    return 0;
}
