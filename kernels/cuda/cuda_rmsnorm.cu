/* cuda_rmsnorm.cu -- RMSNorm with the residual add fused, one block per row. With a residual,
 * residual += x is rounded to bf16 and stored first, and the norm is taken of the stored
 * values (what the next layer will read), as the CPU op takes it of its stored residual. */
#include "kernels/cuda/cuda_common.cuh"

#define THREADS 256

/* out may alias x: every x element is read before the block's barrier (with a residual) or
 * read and written by the same thread (without). */
#define MAXK 16 /* row elements a thread keeps in registers: rows up to THREADS * MAXK */

/* Rows of at most NT * MAXK elements: each thread loads its elements once and keeps them
 * in registers for the scaling pass (all loads of the row in flight at once). NT = 256 up to
 * 4096 elements, 1024 up to 16384 (a Llama-3-70B row of 8192: the looping kernel's dependent
 * load-store passes over one row took ~25 us, as long as a 30 MB product; with tensor
 * parallelism two of these run every layer of a decode step). */
template <int NT>
static __global__ void __launch_bounds__(NT)
rmsnorm_reg_kernel(const bf16 *x, bf16 *residual, const bf16 *w, int32_t dim, float eps,
                   bf16 *out)
{
    pd_pdl_enter();
    const size_t row = (size_t)blockIdx.x * dim;
    const bf16 *xr = x + row;
    bf16 *rr = residual ? residual + row : NULL;
    float v[MAXK], wv[MAXK];
    float ss = 0.0f;
    /* The weights are loaded with the row, not after the reduction: one memory round trip. */
#pragma unroll
    for (int k = 0; k < MAXK; k++) {
        const int32_t j = threadIdx.x + k * NT;
        v[k] = wv[k] = 0.0f;
        if (j < dim) {
            v[k] = pd_ld(xr + j);
            wv[k] = pd_ld(w + j);
        }
    }
    if (rr) {
#pragma unroll
        for (int k = 0; k < MAXK; k++) {
            const int32_t j = threadIdx.x + k * NT;
            if (j < dim) {
                const bf16 s = __float2bfloat16_rn(pd_ld(rr + j) + v[k]);
                rr[j] = s;
                v[k] = __bfloat162float(s);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < MAXK; k++) ss += v[k] * v[k];
    ss = pd_block_sum(ss);
    const float r = (float)(1.0 / sqrt((double)ss / dim + eps));
    bf16 *o = out + row;
#pragma unroll
    for (int k = 0; k < MAXK; k++) {
        const int32_t j = threadIdx.x + k * NT;
        if (j < dim) pd_st(o + j, wv[k] * (v[k] * r));
    }
}

static __global__ void __launch_bounds__(THREADS)
rmsnorm_kernel(const bf16 *x, bf16 *residual, const bf16 *w, int32_t dim, float eps, bf16 *out)
{
    pd_pdl_enter();
    const size_t row = (size_t)blockIdx.x * dim;
    const bf16 *xr = x + row;
    bf16 *rr = residual ? residual + row : NULL;
    float ss = 0.0f;
    for (int32_t j = threadIdx.x; j < dim; j += THREADS) {
        float v;
        if (rr) {
            const bf16 s = __float2bfloat16_rn(pd_ld(rr + j) + pd_ld(xr + j));
            rr[j] = s;
            v = __bfloat162float(s);
        } else {
            v = pd_ld(xr + j);
        }
        ss += v * v;
    }
    ss = pd_block_sum(ss);
    const float r = (float)(1.0 / sqrt((double)ss / dim + eps));
    const bf16 *src = rr ? rr : xr;
    bf16 *o = out + row;
    for (int32_t j = threadIdx.x; j < dim; j += THREADS) pd_st(o + j, pd_ld(w + j) * (pd_ld(src + j) * r));
}

static cudaError_t launch_rmsnorm(const bf16 *x, bf16 *residual, const bf16 *w, int32_t n,
                                  int32_t dim, float eps, bf16 *out, cudaStream_t stream)
{
    if (dim <= THREADS * MAXK)
        return pd_cuda__launch(rmsnorm_reg_kernel<THREADS>, dim3((unsigned)n), dim3(THREADS), 0,
                               stream, x, residual, w, dim, eps, out);
    if (dim <= 1024 * MAXK)
        return pd_cuda__launch(rmsnorm_reg_kernel<1024>, dim3((unsigned)n), dim3(1024), 0,
                               stream, x, residual, w, dim, eps, out);
    return pd_cuda__launch(rmsnorm_kernel, dim3((unsigned)n), dim3(THREADS), 0, stream, x,
                           residual, w, dim, eps, out);
    return cudaGetLastError();
}

extern "C" int pd_cuda__rmsnorm(void *ctx, const void *x, void *residual, const void *w,
                                int32_t n, int32_t dim, float eps, void *out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n == 0) return 0;
    if (n < 0 || dim <= 0 || !x || !w || !out) return PD_EINVAL;
    PD_CUDA_CHECK(launch_rmsnorm((const bf16 *)x, (bf16 *)residual, (const bf16 *)w, n, dim, eps,
                                 (bf16 *)out, c->stream));
    return 0;
}
