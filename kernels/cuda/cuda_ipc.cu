/* cuda_ipc.cu -- KV blocks device to device between processes (kvtransfer's device path): CUDA
 * IPC export and open with peer access enabled both ways, events on the compute stream, and
 * copy queues whose kernel moves lists of blocks into a peer's pool on a stream of their own.
 *
 * Why a kernel: a request's KV is scattered blocks (32 KiB each for Llama-3-8B), K and V of
 * every layer; one cudaMemcpyAsync per block costs microseconds of launch each, while one
 * launch per layer moves every block of the step's requests. The block lists ride in the
 * kernel's parameters (no staging buffer whose reuse would have to wait); PDSERVE_KV_COPY=
 * memcpy uses one cudaMemcpyAsync per run of consecutive blocks instead (for comparison). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

#define CQ_MAX_PAIRS 1024  /* block pairs per launch: 8 KiB of ids in the parameters */
#define CQ_MAX_REGIONS 4   /* regions per launch (a layer's K and V) */

typedef struct {
    void *dst[CQ_MAX_REGIONS];
    const void *src[CQ_MAX_REGIONS];
    int32_t n_regions, n;
    uint64_t block_bytes;
    int32_t dst_ids[CQ_MAX_PAIRS];
    int32_t src_ids[CQ_MAX_PAIRS];
} cq_args;


/* One CUDA block per (pair, region): block_bytes in 16-byte words (or bytes when the
 * addresses or the size are not 16-byte aligned). */
static __global__ void cq_kernel(const __grid_constant__ cq_args a, int vec)
{
    const int item = (int)blockIdx.x, r = item % a.n_regions, i = item / a.n_regions;
    const char *s = (const char *)a.src[r] + (size_t)a.src_ids[i] * a.block_bytes;
    char *d = (char *)a.dst[r] + (size_t)a.dst_ids[i] * a.block_bytes;
    if (vec) {
        const uint4 *s4 = (const uint4 *)s;
        uint4 *d4 = (uint4 *)d;
        const size_t nv = a.block_bytes / 16;
        for (size_t k = threadIdx.x; k < nv; k += blockDim.x) d4[k] = s4[k];
    } else {
        for (size_t k = threadIdx.x; k < a.block_bytes; k += blockDim.x) d[k] = s[k];
    }
}

extern "C" int pd_cuda__dev_export(void *ctx, void *p, void *export_bytes, char *bus_id)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!p || !export_bytes || !bus_id) return PD_EINVAL;
    static_assert(sizeof(cudaIpcMemHandle_t) == PD_DEV_EXPORT_BYTES, "IPC handle size");
    cudaIpcMemHandle_t h;
    PD_CUDA_CHECK(cudaIpcGetMemHandle(&h, p));
    memcpy(export_bytes, &h, sizeof h);
    PD_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, PD_BUS_ID_LEN, c->device));
    return 0;
}

/* Enables peer access from the current device to `peer`; already enabled is fine. */
static cudaError_t enable_peer(int peer)
{
    cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError(); /* clear it */
        return cudaSuccess;
    }
    return e;
}

extern "C" int pd_cuda__dev_open(void *ctx, const void *export_bytes, const char *bus_id,
                                 void **base, char *err)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!export_bytes || !bus_id || !base) return PD_EINVAL;
    *base = NULL;
    char bus[PD_BUS_ID_LEN];
    snprintf(bus, sizeof bus, "%s", bus_id);
    int dev = -1;
    if (cudaDeviceGetByPCIBusId(&dev, bus) != cudaSuccess) {
        (void)cudaGetLastError();
        return pd_errf(err, PD_EUNSUPPORTED, "the decode pool's GPU (PCI %s) is not visible to "
                       "this process (CUDA_VISIBLE_DEVICES hides it; give each service --device "
                       "instead)", bus);
    }
    if (dev != c->device) {
        int ab = 0, ba = 0;
        PD_CUDA_CHECK(cudaDeviceCanAccessPeer(&ab, c->device, dev));
        PD_CUDA_CHECK(cudaDeviceCanAccessPeer(&ba, dev, c->device));
        if (!ab || !ba)
            return pd_errf(err, PD_EUNSUPPORTED, "GPU %d cannot reach GPU %d (PCI %s) peer to "
                           "peer", c->device, dev, bus);
        /* Both directions, in this process (the one issuing the copies): with one direction
         * only the driver stages the copy through the host at a tenth of the link rate
         * (../shared/notes/cuda-ipc.md). */
        cudaError_t e1 = enable_peer(dev);
        PD_CUDA_CHECK(cudaSetDevice(dev));
        cudaError_t e2 = enable_peer(c->device);
        PD_CUDA_CHECK(cudaSetDevice(c->device));
        if (e1 != cudaSuccess || e2 != cudaSuccess) {
            (void)cudaGetLastError();
            return pd_errf(err, PD_EUNSUPPORTED, "cannot enable peer access between GPU %d and "
                           "GPU %d: %s", c->device, dev,
                           cudaGetErrorString(e1 != cudaSuccess ? e1 : e2));
        }
    }
    cudaIpcMemHandle_t h;
    memcpy(&h, export_bytes, sizeof h);
    cudaError_t e = cudaIpcOpenMemHandle(base, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *base = NULL;
        return pd_errf(err, e == cudaErrorInvalidValue || e == cudaErrorInvalidResourceHandle
                                ? PD_EUNSUPPORTED : PD_EBACKEND,
                       "cannot open the decode pool's CUDA IPC handle: %s", cudaGetErrorString(e));
    }
    return 0;
}

extern "C" void pd_cuda__dev_close(void *ctx, void *base)
{
    (void)pd_cuda__ctx(ctx);
    if (base) (void)cudaIpcCloseMemHandle(base);
}

/* A new event recorded on stream after everything queued on it so far, into *out. */
static int record_on(cudaStream_t stream, void **out)
{
    cudaEvent_t e;
    PD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cudaError_t r = cudaEventRecord(e, stream);
    if (r != cudaSuccess) {
        cudaEventDestroy(e);
        PD_CUDA_CHECK(r);
    }
    *out = (void *)e;
    return 0;
}

extern "C" int pd_cuda__event_record(void *ctx, void **ev)
{
    return record_on(pd_cuda__ctx(ctx)->stream, ev);
}

extern "C" int pd_cuda__event_query(void *ctx, void *ev)
{
    (void)pd_cuda__ctx(ctx);
    cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return 0;
    }
    PD_CUDA_CHECK(e);
    return 1;
}

extern "C" void pd_cuda__event_release(void *ctx, void *ev)
{
    (void)pd_cuda__ctx(ctx);
    if (ev) (void)cudaEventDestroy((cudaEvent_t)ev);
}

extern "C" int pd_cuda__copyq_create(void *ctx, void **out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    pd_copyq *q = (pd_copyq *)calloc(1, sizeof *q);
    if (!q) return PD_ENOMEM;
    q->device = c->device;
    q->use_memcpy = !strcmp(pd_env_str("PDSERVE_KV_COPY"), "memcpy");
    cudaError_t e = cudaStreamCreateWithFlags(&q->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(q);
        PD_CUDA_CHECK(e);
    }
    *out = q;
    return 0;
}

extern "C" void pd_cuda__copyq_destroy(void *ctx, void *qv)
{
    (void)pd_cuda__ctx(ctx);
    pd_copyq *q = (pd_copyq *)qv;
    if (!q) return;
    (void)cudaStreamSynchronize(q->stream);
    (void)cudaStreamDestroy(q->stream);
    free(q);
}

/* One cudaMemcpyAsync per run of blocks consecutive on both sides (PDSERVE_KV_COPY=memcpy). */
static int copy_runs(pd_copyq *q, void *const *dst, const void *const *src, int32_t n_regions,
                     const int32_t *dst_ids, const int32_t *src_ids, int32_t n, size_t bb)
{
    for (int32_t r = 0; r < n_regions; r++)
        for (int32_t i = 0; i < n;) {
            int32_t j = i + 1;
            while (j < n && dst_ids[j] == dst_ids[j - 1] + 1 && src_ids[j] == src_ids[j - 1] + 1) j++;
            PD_CUDA_CHECK(cudaMemcpyAsync((char *)dst[r] + (size_t)dst_ids[i] * bb,
                                          (const char *)src[r] + (size_t)src_ids[i] * bb,
                                          (size_t)(j - i) * bb, cudaMemcpyDefault,
                                          q->stream));
            i = j;
        }
    return 0;
}


/* The event after everything queued on q so far, into *done (a copy's completion). */
int pd_cuda__copyq_done(pd_copyq *q, void **done) { return record_on(q->stream, done); }

extern "C" int pd_cuda__copyq_blocks(void *ctx, void *qv, void *after, void *const *dst,
                                     const void *const *src, int32_t n_regions,
                                     const int32_t *dst_ids, const int32_t *src_ids, int32_t n,
                                     size_t block_bytes, void **done)
{
    (void)pd_cuda__ctx(ctx);
    pd_copyq *q = (pd_copyq *)qv;
    if (!q || !done || n < 0 || n_regions < 1 || n_regions > CQ_MAX_REGIONS || block_bytes == 0 ||
        (n > 0 && (!dst || !src || !dst_ids || !src_ids)))
        return PD_EINVAL;
    bool vec = block_bytes % 16 == 0;
    for (int32_t r = 0; r < n_regions; r++) {
        if (!dst[r] || !src[r]) return PD_EINVAL;
        vec = vec && ((uintptr_t)dst[r] % 16 == 0) && ((uintptr_t)src[r] % 16 == 0);
    }
    for (int32_t i = 0; i < n; i++)
        if (dst_ids[i] < 0 || src_ids[i] < 0) return PD_EINVAL;
    if (after) PD_CUDA_CHECK(cudaStreamWaitEvent(q->stream, (cudaEvent_t)after, 0));
    if (q->use_memcpy) {
        int rc = copy_runs(q, dst, src, n_regions, dst_ids, src_ids, n, block_bytes);
        if (rc < 0) return rc;
    } else {
        cq_args *a = (cq_args *)malloc(sizeof *a); /* 8 KiB: not on the stack */
        if (!a) return PD_ENOMEM;
        a->n_regions = n_regions;
        a->block_bytes = block_bytes;
        for (int32_t r = 0; r < n_regions; r++) {
            a->dst[r] = dst[r];
            a->src[r] = src[r];
        }
        for (int32_t i0 = 0; i0 < n; i0 += CQ_MAX_PAIRS) {
            const int32_t m = n - i0 < CQ_MAX_PAIRS ? n - i0 : CQ_MAX_PAIRS;
            a->n = m;
            memcpy(a->dst_ids, dst_ids + i0, (size_t)m * sizeof(int32_t));
            memcpy(a->src_ids, src_ids + i0, (size_t)m * sizeof(int32_t));
            cq_kernel<<<(unsigned)(m * n_regions), 256, 0, q->stream>>>(*a, vec ? 1 : 0);
            cudaError_t e = cudaGetLastError();
            if (e != cudaSuccess) {
                free(a);
                PD_CUDA_CHECK(e);
            }
        }
        free(a);
    }
    return pd_cuda__copyq_done(q, done);
}
