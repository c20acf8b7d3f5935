/* cuda_swiglu.cu -- swiglu: out[n][f] = silu(gate_up[n][0:f]) * gate_up[n][f:2f], in fp32. */
#include "kernels/cuda/cuda_common.cuh"

static __global__ void swiglu_kernel(const bf16 *gate_up, size_t total, int32_t f, bf16 *out)
{
    pd_pdl_enter();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / (size_t)f, j = i % (size_t)f;
        const bf16 *g = gate_up + r * 2 * (size_t)f;
        const float x = pd_ld(g + j), u = pd_ld(g + f + j);
        pd_st(out + i, x / (1.0f + expf(-x)) * u);
    }
}

static cudaError_t launch_swiglu(const bf16 *gate_up, int32_t n, int32_t f, bf16 *out,
                                 cudaStream_t stream)
{
    const size_t total = (size_t)n * f;
    return pd_cuda__launch(swiglu_kernel, dim3(pd_cuda__blocks(total, 256)), dim3(256), 0, stream,
                           gate_up, total, f, out);
}

extern "C" int pd_cuda__swiglu(void *ctx, const void *gate_up, int32_t n, int32_t f, void *out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n == 0) return 0;
    if (n < 0 || f <= 0 || !gate_up || !out) return PD_EINVAL;
    PD_CUDA_CHECK(launch_swiglu((const bf16 *)gate_up, n, f, (bf16 *)out, c->stream));
    return 0;
}
