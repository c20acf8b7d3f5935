/* cuda_embedding.cu -- embedding: out[i] = table[ids[i]], one block per output row. */
#include "kernels/cuda/cuda_common.cuh"

static __global__ void embedding_kernel(const int32_t *ids, const bf16 *table, int32_t dim,
                                        bf16 *out)
{
    const bf16 *src = table + (size_t)ids[blockIdx.x] * dim;
    bf16 *dst = out + (size_t)blockIdx.x * dim;
    for (int32_t j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = src[j];
}

static cudaError_t launch_embedding(const int32_t *ids, int32_t n, const bf16 *table,
                                    int32_t dim, bf16 *out, cudaStream_t stream)
{
    embedding_kernel<<<n, 128, 0, stream>>>(ids, table, dim, out);
    return cudaGetLastError();
}

extern "C" int pd_cuda__embedding(void *ctx, const int32_t *ids, int32_t n, const void *table,
                                  int32_t dim, void *out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n == 0) return 0;
    if (n < 0 || dim <= 0 || !ids || !table || !out) return PD_EINVAL;
    PD_CUDA_CHECK(launch_embedding(ids, n, (const bf16 *)table, dim, (bf16 *)out, c->stream));
    return 0;
}
