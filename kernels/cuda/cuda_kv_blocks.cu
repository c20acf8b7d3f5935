/* cuda_kv_blocks.cu -- KV blocks between the bf16 device cache and f32 host memory (staging
 * for KV transfer): blocks are copied through the pinned staging buffer, as many per round
 * as fit, and converted on the host. ids are host memory. */
#include "kernels/cuda/cuda_common.cuh"

static int check_args(const void *cache, const int32_t *ids, int32_t n, size_t block_elems,
                      const void *host, size_t staging_bytes)
{
    if (n < 0 || (n > 0 && (!cache || !ids || !host || block_elems == 0))) return PD_EINVAL;
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0) return PD_EINVAL;
    if (block_elems * sizeof(bf16) > staging_bytes) return PD_EUNSUPPORTED;
    return 0;
}

extern "C" int pd_cuda__kv_blocks_to_host(void *ctx, const void *cache, const int32_t *ids,
                                          int32_t n, size_t block_elems, float *host)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    int rc = check_args(cache, ids, n, block_elems, host, c->staging_bytes);
    if (rc < 0 || n == 0) return rc;
    const size_t bb = block_elems * sizeof(bf16);
    const int32_t per_round = (int32_t)(c->staging_bytes / bb);
    bf16 *st = (bf16 *)c->staging;
    for (int32_t i0 = 0; i0 < n; i0 += per_round) {
        const int32_t m = n - i0 < per_round ? n - i0 : per_round;
        for (int32_t i = 0; i < m; i++)
            PD_CUDA_CHECK(cudaMemcpyAsync(st + (size_t)i * block_elems,
                                          (const bf16 *)cache + (size_t)ids[i0 + i] * block_elems,
                                          bb, cudaMemcpyDeviceToHost, c->stream));
        PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        pd_convert_to_f32(host + (size_t)i0 * block_elems, st, PD_DTYPE_BF16,
                          (size_t)m * block_elems);
    }
    return 0;
}

extern "C" int pd_cuda__kv_blocks_from_host(void *ctx, void *cache, const int32_t *ids,
                                            int32_t n, size_t block_elems, const float *host)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    int rc = check_args(cache, ids, n, block_elems, host, c->staging_bytes);
    if (rc < 0 || n == 0) return rc;
    const size_t bb = block_elems * sizeof(bf16);
    const int32_t per_round = (int32_t)(c->staging_bytes / bb);
    uint16_t *st = (uint16_t *)c->staging;
    for (int32_t i0 = 0; i0 < n; i0 += per_round) {
        const int32_t m = n - i0 < per_round ? n - i0 : per_round;
        PD_CUDA_CHECK(cudaStreamSynchronize(c->stream)); /* staging free again */
        const float *src = host + (size_t)i0 * block_elems;
        for (size_t j = 0; j < (size_t)m * block_elems; j++) st[j] = pd_f32_to_bf16(src[j]);
        for (int32_t i = 0; i < m; i++)
            PD_CUDA_CHECK(cudaMemcpyAsync((bf16 *)cache + (size_t)ids[i0 + i] * block_elems,
                                          st + (size_t)i * block_elems, bb,
                                          cudaMemcpyHostToDevice, c->stream));
    }
    PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return 0;
}

/* Raw block copies between the device cache and a host mirror laid out the same way (pinned
 * with pd_cuda__host_register for full speed). Runs of consecutive ids become one copy. */
extern "C" int pd_cuda__kv_blocks_copy(void *ctx, void *cache, const int32_t *ids, int32_t n,
                                       size_t block_bytes, void *host, bool to_host)
{
    if (n < 0 || (n > 0 && (!cache || !ids || !host || block_bytes == 0))) return PD_EINVAL;
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0) return PD_EINVAL;
    if (n == 0) return 0;
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    for (int32_t i = 0; i < n;) {
        int32_t j = i + 1;
        while (j < n && ids[j] == ids[j - 1] + 1) j++;
        const size_t off = (size_t)ids[i] * block_bytes, len = (size_t)(j - i) * block_bytes;
        uint8_t *d = (uint8_t *)cache + off, *h = (uint8_t *)host + off;
        if (to_host)
            PD_CUDA_CHECK(cudaMemcpyAsync(h, d, len, cudaMemcpyDeviceToHost, c->stream));
        else
            PD_CUDA_CHECK(cudaMemcpyAsync(d, h, len, cudaMemcpyHostToDevice, c->stream));
        i = j;
    }
    PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return 0;
}

extern "C" int pd_cuda__host_register(void *ctx, void *p, size_t bytes)
{
    (void)pd_cuda__ctx(ctx); /* makes the context's device current */
    if (!p || bytes == 0) return PD_EINVAL;
    /* Mapped: the copy queue's kernel reads and writes a registered range (the staged KV
     * path's ring) through the same pointer (unified addressing). */
    PD_CUDA_CHECK(cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
    return 0;
}

extern "C" int pd_cuda__host_unregister(void *ctx, void *p)
{
    (void)pd_cuda__ctx(ctx);
    if (!p) return 0;
    PD_CUDA_CHECK(cudaHostUnregister(p));
    return 0;
}
