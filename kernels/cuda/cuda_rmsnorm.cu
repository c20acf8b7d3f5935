/* cuda_rmsnorm.cu -- RMSNorm with the residual add fused, one block per row. With a residual,
 * residual += x is rounded to bf16 and stored first, and the norm is taken of the stored
 * values (what the next layer will read), as the CPU op takes it of its stored residual. */
#include "kernels/cuda/cuda_common.cuh"

#define THREADS PD_RMSNORM_THREADS

/* out may alias x: every x element is read before the block's barrier (with a residual) or
 * read and written by the same thread (without). */
#define MAXK 16 /* row elements a thread keeps in registers: rows up to THREADS * MAXK */

/* Rows of at most NT * MAXK elements: each thread loads its elements once and keeps them
 * in registers for the scaling pass (all loads of the row in flight at once). NT = 256 up to
 * 4096 elements, 1024 up to 16384 (a Llama-3-70B row of 8192: the looping kernel's dependent
 * load-store passes over one row took as long as a large weight product, and with tensor
 * parallelism two of these run every layer of a decode step; docs/perf-history.md, issue
 * #29's fused decode steps). */
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

/* Many rows (a prefill step: as many rows as the GPU has SMs or more) of dim = 8 * THREADS * V
 * at most, dim % 8 == 0 and 16-byte aligned rows: THREADS threads a row and 16-byte accesses,
 * V of them a thread, the row kept in registers as bf16 pairs (the sum rounded to bf16 is what
 * is normed), the weights loaded with it. The register kernel above keeps 16 floats a thread
 * and, at 1024 threads a row for 8192-wide rows, one block an SM: a 2048-row prefill step of a
 * Llama-3-70B shape ran its rows one SM-wave after the other, each a memory round trip; this
 * one keeps a few per SM in flight (docs/perf-history.md, issue #29's prefill norms). */
template <int V>
static __global__ void __launch_bounds__(THREADS)
rmsnorm_vec_kernel(const bf16 *x, bf16 *residual, const bf16 *w, int32_t dim, float eps,
                   bf16 *out)
{
    pd_pdl_enter();
    const size_t row = (size_t)blockIdx.x * dim;
    const uint4 *xr = reinterpret_cast<const uint4 *>(x + row);
    uint4 *rr = residual ? reinterpret_cast<uint4 *>(residual + row) : NULL;
    const uint4 *wr = reinterpret_cast<const uint4 *>(w);
    const int32_t n8 = dim / 8;
    uint4 v[V], wv[V];
#pragma unroll
    for (int k = 0; k < V; k++) {
        const int32_t j = threadIdx.x + k * THREADS;
        v[k] = wv[k] = make_uint4(0u, 0u, 0u, 0u);
        if (j < n8) {
            v[k] = xr[j];
            wv[k] = __ldg(wr + j);
        }
    }
    if (rr) {
#pragma unroll
        for (int k = 0; k < V; k++) {
            const int32_t j = threadIdx.x + k * THREADS;
            if (j < n8) {
                const uint4 a = rr[j];
                const uint32_t xa[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
                const uint32_t ra[4] = {a.x, a.y, a.z, a.w};
                uint32_t o[4];
#pragma unroll
                for (int e = 0; e < 4; e++)
                    o[e] = pd_pack_bf16(pd_bf16_lo(ra[e]) + pd_bf16_lo(xa[e]),
                                        pd_bf16_hi(ra[e]) + pd_bf16_hi(xa[e]));
                v[k] = make_uint4(o[0], o[1], o[2], o[3]);
                rr[j] = v[k];
            }
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < V; k++) ss += pd_sumsq8(v[k]);
    const float r = pd_rms_inv(ss, dim, eps);
    uint4 *o4 = reinterpret_cast<uint4 *>(out + row);
#pragma unroll
    for (int k = 0; k < V; k++) {
        const int32_t j = threadIdx.x + k * THREADS;
        if (j < n8) o4[j] = pd_rmsnorm8(v[k], wv[k], r);
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

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

static cudaError_t launch_rmsnorm(const bf16 *x, bf16 *residual, const bf16 *w, int32_t n,
                                  int32_t dim, float eps, bf16 *out, int sm_count,
                                  cudaStream_t stream)
{
    if (pd_rmsnorm_vec_fits(n, dim, sm_count) && aligned16(x) && aligned16(w) &&
        aligned16(out) && (!residual || aligned16(residual))) {
        const dim3 g((unsigned)n), b(THREADS);
        if (dim <= 8 * THREADS * 1)
            return pd_cuda__launch(rmsnorm_vec_kernel<1>, g, b, 0, stream, x, residual, w, dim,
                                   eps, out);
        if (dim <= 8 * THREADS * 2)
            return pd_cuda__launch(rmsnorm_vec_kernel<2>, g, b, 0, stream, x, residual, w, dim,
                                   eps, out);
        if (dim <= 8 * THREADS * 4)
            return pd_cuda__launch(rmsnorm_vec_kernel<4>, g, b, 0, stream, x, residual, w, dim,
                                   eps, out);
        return pd_cuda__launch(rmsnorm_vec_kernel<8>, g, b, 0, stream, x, residual, w, dim, eps,
                               out);
    }
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
                                 (bf16 *)out, c->sm_count, c->stream));
    return 0;
}
