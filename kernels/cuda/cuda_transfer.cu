/* cuda_transfer.cu -- Host <-> device copies with type conversion: upload (F32/BF16/F16/I32
 * host data into BF16, F32 or I32 buffers; e4m3 bytes into F8E4M3 ones) and download_f32.
 * Same-type copies go straight through cudaMemcpyAsync; converting ones are converted on the
 * host in chunks through the context's pinned staging buffer. */
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

/* Converts n elements of src_type at src into dst_type at dst (host memory both). */
static void convert_host(void *dst, pd_dtype dst_type, const void *src, pd_dtype src_type,
                         size_t n)
{
    if (dst_type == PD_DTYPE_F32) {
        pd_convert_to_f32((float *)dst, src, src_type, n);
        return;
    }
    /* dst BF16 */
    uint16_t *d = (uint16_t *)dst;
    switch (src_type) {
    case PD_DTYPE_F32:
        for (size_t i = 0; i < n; i++) d[i] = pd_f32_to_bf16(((const float *)src)[i]);
        break;
    case PD_DTYPE_F16:
        for (size_t i = 0; i < n; i++) d[i] = pd_f32_to_bf16(pd_f16_to_f32(((const uint16_t *)src)[i]));
        break;
    case PD_DTYPE_I32:
        for (size_t i = 0; i < n; i++) d[i] = pd_f32_to_bf16((float)((const int32_t *)src)[i]);
        break;
    case PD_DTYPE_BF16:
        memcpy(d, src, n * sizeof(uint16_t));
        break;
    case PD_DTYPE_F8E4M3:
        for (size_t i = 0; i < n; i++) d[i] = pd_f32_to_bf16(pd_e4m3_to_f32(((const uint8_t *)src)[i]));
        break;
    }
}

static bool valid_dtype(pd_dtype t)
{
    return t == PD_DTYPE_F32 || t == PD_DTYPE_BF16 || t == PD_DTYPE_F16 || t == PD_DTYPE_I32 ||
           t == PD_DTYPE_F8E4M3;
}

extern "C" int pd_cuda__upload(void *ctx, void *dst, pd_dtype dst_type, size_t dst_off,
                               const void *src, pd_dtype src_type, size_t n)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    c->pick.on = false; /* a forward's metadata: the last one's picks are not this one's */
    if (n == 0) return 0;
    if (!dst || !src || !valid_dtype(src_type)) return PD_EINVAL;
    if (dst_type != PD_DTYPE_BF16 && dst_type != PD_DTYPE_F32 && dst_type != PD_DTYPE_I32 &&
        dst_type != PD_DTYPE_F8E4M3)
        return PD_EINVAL;
    /* integers and e4m3 bytes (an FP8 KV cache) only from their own type: as they are */
    if ((dst_type == PD_DTYPE_I32 || dst_type == PD_DTYPE_F8E4M3) && src_type != dst_type)
        return PD_EINVAL;
    const size_t es = pd_dtype_size(dst_type);
    char *d = (char *)dst + dst_off * es;
    if (src_type == dst_type) {
        /* From pageable memory the source is consumed before the call returns. */
        PD_CUDA_CHECK(cudaMemcpyAsync(d, src, n * es, cudaMemcpyHostToDevice, c->stream));
        return 0;
    }
    const size_t chunk = c->staging_bytes / es, ses = pd_dtype_size(src_type);
    for (size_t i = 0; i < n; i += chunk) {
        const size_t m = n - i < chunk ? n - i : chunk;
        /* The previous chunk's copy may still read the staging buffer. */
        PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        convert_host(c->staging, dst_type, (const char *)src + i * ses, src_type, m);
        PD_CUDA_CHECK(cudaMemcpyAsync(d + i * es, c->staging, m * es, cudaMemcpyHostToDevice,
                                      c->stream));
    }
    PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return 0;
}

extern "C" int pd_cuda__download_f32(void *ctx, float *dst, const void *src, pd_dtype src_type,
                                     size_t src_off, size_t n)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n == 0) return 0;
    if (!dst || !src) return PD_EINVAL;
    if (src_type != PD_DTYPE_BF16 && src_type != PD_DTYPE_F32 && src_type != PD_DTYPE_I32 &&
        src_type != PD_DTYPE_F8E4M3)
        return PD_EINVAL;
    const size_t es = pd_dtype_size(src_type);
    const char *s = (const char *)src + src_off * es;
    if (src_type == PD_DTYPE_F32) {
        PD_CUDA_CHECK(cudaMemcpyAsync(dst, s, n * es, cudaMemcpyDeviceToHost, c->stream));
        PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        return 0;
    }
    const size_t chunk = c->staging_bytes / es;
    for (size_t i = 0; i < n; i += chunk) {
        const size_t m = n - i < chunk ? n - i : chunk;
        PD_CUDA_CHECK(cudaMemcpyAsync(c->staging, s + i * es, m * es, cudaMemcpyDeviceToHost,
                                      c->stream));
        PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        pd_convert_to_f32(dst + i, c->staging, src_type, m);
    }
    return 0;
}
