/* cuda_linear.cu -- linear: out[n][m] = x[n][k] . w[m][k]^T (+ bias[m]) through cuBLAS, bf16
 * operands, fp32 accumulation, bf16 result. Row-major to column-major: the row-major [n][m]
 * result is the column-major m x n matrix W . X^T, where the row-major weight [m][k] read
 * column-major is the k x m matrix W^T (so op T, lda k) and the row-major x [n][k] is the
 * k x n matrix X^T (op N, ldb k). */
#include "kernels/cuda/cuda_common.cuh"

/* out[i][j] += bias[j], in fp32, rounded once. */
static __global__ void bias_kernel(bf16 *out, const bf16 *bias, size_t total, int32_t m)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        pd_st(out + i, pd_ld(out + i) + pd_ld(bias + i % m));
}

static cudaError_t launch_bias(bf16 *out, const bf16 *bias, int32_t n, int32_t m,
                               cudaStream_t stream)
{
    const size_t total = (size_t)n * m;
    bias_kernel<<<pd_cuda__blocks(total, 256), 256, 0, stream>>>(out, bias, total, m);
    return cudaGetLastError();
}

extern "C" int pd_cuda__linear(void *ctx, const void *x, const void *w, const void *bias,
                               int32_t n, int32_t k, int32_t m, void *out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n == 0) return 0;
    if (n < 0 || k <= 0 || m <= 0 || !x || !w || !out) return PD_EINVAL;
    const float alpha = 1.0f, beta = 0.0f;
    PD_CUBLAS_CHECK(cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, w,
                                 CUDA_R_16BF, k, x, CUDA_R_16BF, k, &beta, out, CUDA_R_16BF, m,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (bias) PD_CUDA_CHECK(launch_bias((bf16 *)out, (const bf16 *)bias, n, m, c->stream));
    return 0;
}
