/* cuda_kv_clone.cu -- kv_blocks_clone: whole KV blocks copied within the device pool on the
 * compute stream (a forked sequence's partial block, copy on write). One CUDA block per
 * (pair, region); the pairs travel in the kernel's parameters, KV_CLONE_PAIRS per launch. */
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

#define KV_CLONE_PAIRS 64

typedef struct {
    int32_t src[KV_CLONE_PAIRS], dst[KV_CLONE_PAIRS];
} kv_clone_pairs;

/* 16-byte words when every block starts 16-byte aligned, else bytes. */
template <typename T>
static __global__ void kv_clone_kernel(uint8_t *pool, size_t region_bytes, size_t block_bytes,
                                       kv_clone_pairs p)
{
    uint8_t *base = pool + (size_t)blockIdx.y * region_bytes;
    const T *s = (const T *)(base + (size_t)p.src[blockIdx.x] * block_bytes);
    T *d = (T *)(base + (size_t)p.dst[blockIdx.x] * block_bytes);
    const size_t n = block_bytes / sizeof(T);
    for (size_t j = threadIdx.x; j < n; j += blockDim.x) d[j] = s[j];
}

static cudaError_t launch_kv_clone(uint8_t *pool, size_t region_bytes, int32_t n_regions,
                                   const kv_clone_pairs *p, int32_t n, size_t block_bytes,
                                   cudaStream_t stream)
{
    dim3 grid((unsigned)n, (unsigned)n_regions);
    const bool wide = ((uintptr_t)pool % 16 == 0) && region_bytes % 16 == 0 && block_bytes % 16 == 0;
    if (wide) kv_clone_kernel<int4><<<grid, 256, 0, stream>>>(pool, region_bytes, block_bytes, *p);
    else kv_clone_kernel<uint8_t><<<grid, 256, 0, stream>>>(pool, region_bytes, block_bytes, *p);
    return cudaGetLastError();
}

extern "C" int pd_cuda__kv_blocks_clone(void *ctx, void *pool, size_t region_bytes,
                                        int32_t n_regions, const int32_t *src, const int32_t *dst,
                                        int32_t n, size_t block_bytes)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n < 0 || n_regions < 0 ||
        (n > 0 && (!pool || !src || !dst || block_bytes == 0 || region_bytes < block_bytes)))
        return PD_EINVAL;
    if (n_regions > 65535) return PD_EINVAL;
    const size_t per_region = region_bytes / block_bytes;
    for (int32_t i = 0; i < n; i++) {
        if (src[i] < 0 || dst[i] < 0 || (size_t)src[i] >= per_region || (size_t)dst[i] >= per_region)
            return PD_EINVAL;
        for (int32_t j = 0; j < n; j++)
            if (dst[i] == src[j]) return PD_EINVAL;
    }
    if (n == 0 || n_regions == 0) return 0;
    for (int32_t i0 = 0; i0 < n; i0 += KV_CLONE_PAIRS) {
        const int32_t m = n - i0 < KV_CLONE_PAIRS ? n - i0 : KV_CLONE_PAIRS;
        kv_clone_pairs p;
        memset(&p, 0, sizeof p);
        memcpy(p.src, src + i0, (size_t)m * sizeof(int32_t));
        memcpy(p.dst, dst + i0, (size_t)m * sizeof(int32_t));
        PD_CUDA_CHECK(launch_kv_clone((uint8_t *)pool, region_bytes, n_regions, &p, m,
                                      block_bytes, c->stream));
    }
    return 0;
}
