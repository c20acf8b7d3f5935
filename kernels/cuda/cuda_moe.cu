/* cuda_moe.cu -- The CUDA backend's mixture-of-experts ops (backend.h's moe_route and
 * moe_combine): the routing of each token row on the device (the softmax in double and the
 * top k by kernels/moe_select.h, the CPU backend's own definition, so both resolve equal
 * probabilities alike), the choices' grouping by expert on the host (the op hands the groups'
 * bounds to the host anyway: the engine sizes the experts' products by them), and the
 * weighted sum of the experts' outputs back into token order. */
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/moe_select.h"

#define ROUTE_THREADS 32

/* A block a row: the row's logits into shared memory, then one thread replays the selection
 * (sequential by nature; E is at most a few hundred). Shared: E floats, E candidates. */
static __global__ void __launch_bounds__(ROUTE_THREADS)
route_kernel(const bf16 *logits, int32_t E, int32_t k, bool renorm, int32_t *ids, float *w)
{
    extern __shared__ double smem_d[]; /* (double alignment for the candidates) */
    pd_moe_cand *c = reinterpret_cast<pd_moe_cand *>(smem_d);
    float *lg = reinterpret_cast<float *>(c + E);
    const size_t t = blockIdx.x;
    for (int32_t e = threadIdx.x; e < E; e += ROUTE_THREADS) lg[e] = pd_ld(logits + t * E + e);
    __syncthreads();
    if (threadIdx.x == 0) pd_moe_route_row(lg, E, k, renorm, c, ids + t * k, w + t * k);
}

/* out[t][d] = (out[t][d] +) sum over j of w[t][j] * y[pos[t][j]][d], the sum in f32 in j
 * order, then added to out and rounded once. */
static __global__ void combine_kernel(const bf16 *y, const int32_t *pos, const float *w,
                                      int32_t n, int32_t k, int32_t dim, bool accumulate,
                                      bf16 *out)
{
    const size_t total = (size_t)n * dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / (size_t)dim, d = i - t * (size_t)dim;
        float s = 0.0f;
        for (int32_t j = 0; j < k; j++)
            s += w[t * k + j] * pd_ld(y + (size_t)pos[t * k + j] * dim + d);
        pd_st(out + i, accumulate ? pd_ld(out + i) + s : s);
    }
}

/* The context's host scratch for the grouping, grown to bytes (kept until the context goes). */
static int host_scratch(pd_cuda_ctx *c, size_t bytes, int32_t **out)
{
    if (bytes > c->moe_host_bytes) {
        void *p = realloc(c->moe_host, bytes);
        if (!p) return PD_ENOMEM;
        c->moe_host = p;
        c->moe_host_bytes = bytes;
    }
    *out = (int32_t *)c->moe_host;
    return 0;
}

extern "C" int pd_cuda__moe_route(void *ctx, const pd_moe_route_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a || a->n < 0 || a->n_experts < 1 || a->k < 1 || a->k > a->n_experts || !a->offsets ||
        (a->n > 0 && (!a->logits || !a->ids || !a->weights || !a->rows || !a->pos)))
        return PD_EINVAL;
    const int32_t n = a->n, E = a->n_experts, k = a->k;
    const size_t smem = (size_t)E * (sizeof(pd_moe_cand) + sizeof(float));
    if (smem > 48 * 1024) return PD_EINVAL; /* (thousands of experts: not a model we know) */
    if (n == 0) {
        for (int32_t e = 0; e <= E; e++) a->offsets[e] = 0;
        return 0;
    }
    const size_t nk = (size_t)n * k;
    int32_t *h = NULL;
    int rc = host_scratch(c, (3 * nk + (size_t)E) * sizeof(int32_t), &h);
    if (rc < 0) return rc;
    int32_t *h_ids = h, *h_rows = h + nk, *h_pos = h + 2 * nk, *cursor = h + 3 * nk;
    route_kernel<<<(unsigned)n, ROUTE_THREADS, smem, c->stream>>>(
        (const bf16 *)a->logits, E, k, a->renormalize, a->ids, a->weights);
    PD_CUDA_CHECK(cudaGetLastError());
    /* the groups are the host's to size the experts' products: synchronous copies */
    PD_CUDA_CHECK(cudaMemcpyAsync(h_ids, a->ids, nk * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                  c->stream));
    PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    pd_moe_group(h_ids, n, k, E, a->offsets, cursor, h_rows, h_pos);
    PD_CUDA_CHECK(cudaMemcpyAsync(a->rows, h_rows, nk * sizeof(int32_t), cudaMemcpyHostToDevice,
                                  c->stream));
    PD_CUDA_CHECK(cudaMemcpyAsync(a->pos, h_pos, nk * sizeof(int32_t), cudaMemcpyHostToDevice,
                                  c->stream));
    /* (pageable sources: the copies have read them when they return) */
    return 0;
}

extern "C" int pd_cuda__moe_combine(void *ctx, const pd_moe_combine_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a || a->n < 0 || a->k < 1 || a->dim < 1 ||
        (a->n > 0 && (!a->y || !a->pos || !a->weights || !a->out)))
        return PD_EINVAL;
    if (a->n == 0) return 0;
    const size_t total = (size_t)a->n * a->dim;
    combine_kernel<<<pd_cuda__blocks(total, 256), 256, 0, c->stream>>>(
        (const bf16 *)a->y, a->pos, a->weights, a->n, a->k, a->dim, a->accumulate,
        (bf16 *)a->out);
    PD_CUDA_CHECK(cudaGetLastError());
    return 0;
}
