/* cuda_gather_rows.cu -- gather_rows: out[i] = x[idx[i]], one block per output row. */
#include "kernels/cuda/cuda_common.cuh"

static __global__ void gather_rows_kernel(const bf16 *x, const int32_t *idx, int32_t dim,
                                          bf16 *out)
{
    const bf16 *src = x + (size_t)idx[blockIdx.x] * dim;
    bf16 *dst = out + (size_t)blockIdx.x * dim;
    for (int32_t j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = src[j];
}

static cudaError_t launch_gather_rows(const bf16 *x, const int32_t *idx, int32_t n_idx,
                                      int32_t dim, bf16 *out, cudaStream_t stream)
{
    gather_rows_kernel<<<n_idx, 128, 0, stream>>>(x, idx, dim, out);
    return cudaGetLastError();
}

extern "C" int pd_cuda__gather_rows(void *ctx, const void *x, const int32_t *idx, int32_t n_idx,
                                    int32_t dim, void *out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n_idx == 0) return 0;
    if (n_idx < 0 || dim <= 0 || !x || !idx || !out) return PD_EINVAL;
    PD_CUDA_CHECK(launch_gather_rows((const bf16 *)x, idx, n_idx, dim, (bf16 *)out, c->stream));
    return 0;
}
