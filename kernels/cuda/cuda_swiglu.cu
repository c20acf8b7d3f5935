/* cuda_swiglu.cu -- swiglu: out[n][f] = silu(gate_up[n][0:f]) * gate_up[n][f:2f], in fp32
 * (pd_silu_mul). */
#include "kernels/cuda/cuda_common.cuh"

static __global__ void swiglu_kernel(const bf16 *gate_up, size_t total, int32_t f, bf16 *out)
{
    pd_pdl_enter();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / (size_t)f, j = i % (size_t)f;
        const bf16 *g = gate_up + r * 2 * (size_t)f;
        const float x = pd_ld(g + j), u = pd_ld(g + f + j);
        pd_st(out + i, pd_silu_mul(x, u));
    }
}

/* 8 outputs a thread with 16-byte loads and stores and 32-bit indices (f % 8 == 0, aligned
 * buffers, fewer than 2^32 groups of 8): a prefill's SwiGLU is bound by its bytes, which the
 * element-wise kernel's 2-byte accesses and 64-bit divisions did not reach (docs/perf-history.md,
 * issue #8's third pass). */
static __global__ void swiglu8_kernel(const uint4 *__restrict__ gate_up, uint32_t groups,
                                      uint32_t f8, uint4 *__restrict__ out)
{
    pd_pdl_enter();
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < groups;
         i += gridDim.x * blockDim.x) {
        const uint32_t r = i / f8, j = i - r * f8;
        const uint4 *row = gate_up + (size_t)r * 2 * f8;
        out[i] = pd_swiglu8(row[j], row[f8 + j]);
    }
}

static cudaError_t launch_swiglu(const bf16 *gate_up, int32_t n, int32_t f, bf16 *out,
                                 cudaStream_t stream)
{
    const size_t total = (size_t)n * f;
    const bool aligned = (((uintptr_t)gate_up | (uintptr_t)out) & 15) == 0;
    if (f % 8 == 0 && total / 8 < UINT32_MAX && aligned)
        return pd_cuda__launch(swiglu8_kernel, dim3(pd_cuda__blocks(total / 8, 256)), dim3(256),
                               0, stream, (const uint4 *)gate_up, (uint32_t)(total / 8),
                               (uint32_t)(f / 8), (uint4 *)out);
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
