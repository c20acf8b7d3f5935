/* cuda_context.cu -- The CUDA backend's context (device, stream, cuBLAS handle, pinned staging
 * buffer) and its memory ops: alloc, free, sync, mem_info. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

#define STAGING_BYTES ((size_t)16 << 20) /* pinned bytes for converting transfers, per chunk */
#define CUBLAS_WS_BYTES ((size_t)32 << 20) /* cuBLAS workspace (its Hopper recommendation) */
#define ATTN_PART_FLOATS ((size_t)4 << 20) /* split-KV decode workspace (16 MiB) */
/* Its combine counters, one per (sequence, KV head) of a split launch: a launch splits only
 * where 2 splits of partials fit, n_seqs x n_heads x 2 x (head_dim + 2) floats, head_dim >= 8,
 * so this many cover every one (819 KiB). */
#define ATTN_COUNT_N (ATTN_PART_FLOATS / (2 * (8 + 2)))
/* decode_layers' exchange lines: 8 rows of a 70B-shape layer's outputs take 2 MiB. */
#define DL_LL_BYTES ((size_t)4 << 20)

void pd_cuda__report(const char *call, const char *msg, const char *file, int line)
{
    PD_LOGE("cuda: %s failed: %s (%s:%d)", call, msg, file, line);
}

bool pd_cuda__switch_on(const char *name, int *cache)
{
    if (*cache < 0) *cache = pd_env_bool(name); /* racy first reads all get the same value */
    return *cache != 0;
}

/* PDL needs sm_90; the kernels are built for sm_90a (PD_CUDA_ARCHS) and the check in them
 * makes the instructions no-ops below that. On unless PDSERVE_CUDA_PDL=0: it makes the
 * latency-bound decode steps faster (small dense batches, a MoE model's batch 1) and left the
 * 256-request workload where it was (docs/perf-history.md, "MoE decode: the routing in
 * registers, launches overlapped"). */
bool pd_cuda__pdl_on(void)
{
    static int on = -1; /* racy first reads all get the same value */
    if (on < 0) on = pd_env_bool("PDSERVE_CUDA_PDL");
    return on != 0;
}

extern "C" int pd_backend_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* "no driver" / "no device" is an answer, not a failure */
        return 0;
    }
    return n;
}

extern "C" void pd_cuda__ctx_destroy(void *ctx)
{
    if (!ctx) return;
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (c->stream) (void)cudaStreamSynchronize(c->stream);
    pd_cuda__sample_free(c->sample_state);
    pd_cuda__fp8_free(c->fp8_state);
    if (c->moe_off) (void)cudaFree(c->moe_off);
    if (c->cublas) (void)cublasDestroy(c->cublas);
    if (c->staging) (void)cudaFreeHost(c->staging);
    if (c->attn_part) (void)cudaFree(c->attn_part);
    if (c->attn_count) (void)cudaFree(c->attn_count);
    if (c->dl_counters) (void)cudaFree(c->dl_counters);
    if (c->dl_ll) (void)cudaFree(c->dl_ll);
    if (c->dl_best) (void)cudaFree(c->dl_best);
    if (c->pick_host) (void)cudaFreeHost(c->pick_host);
    if (c->cublas_ws) (void)cudaFree(c->cublas_ws);
    if (c->side) (void)cudaStreamSynchronize(c->side);
    if (c->ev_upload) (void)cudaEventDestroy(c->ev_upload);
    if (c->side) (void)cudaStreamDestroy(c->side);
    if (c->stream) (void)cudaStreamDestroy(c->stream);
    free(c);
}

/* The constructor's checks: log the call, set rc and the caller's message, unwind. */
#define CTX_TRY(call, code)                                                             \
    do {                                                                                \
        if (!(call)) {                                                                  \
            rc = pd_errf(err, (code), "cuda backend: %s failed on device %d", #call,    \
                         device);                                                       \
            goto fail;                                                                  \
        }                                                                               \
    } while (0)

extern "C" int pd_cuda__ctx_create(int32_t device, void **out, char *err)
{
    *out = NULL;
    int n = 0, rc;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return pd_errf(err, PD_ENOTFOUND, "cuda backend: no usable CUDA device (%s)",
                       cudaGetErrorString(e));
    }
    if (device < 0 || device >= n)
        return pd_errf(err, PD_ENOTFOUND, "cuda backend: device %d does not exist (%d present)",
                       device, n);
    pd_cuda_ctx *c = (pd_cuda_ctx *)calloc(1, sizeof *c);
    if (!c) return pd_errf(err, PD_ENOMEM, "out of memory creating the cuda backend");
    c->device = device;
    cudaDeviceProp prop;
    CTX_TRY(cudaSetDevice(device) == cudaSuccess, PD_EBACKEND);
    CTX_TRY(cudaGetDeviceProperties(&prop, device) == cudaSuccess, PD_EBACKEND);
    {   /* the baseline of mem_info's used_bytes (the CUDA context itself exists by now) */
        size_t total = 0;
        CTX_TRY(cudaMemGetInfo(&c->free_at_create, &total) == cudaSuccess, PD_EBACKEND);
    }
    CTX_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking) == cudaSuccess,
            PD_EBACKEND);
    CTX_TRY(cublasCreate(&c->cublas) == CUBLAS_STATUS_SUCCESS, PD_EBACKEND);
    CTX_TRY(cublasSetStream(c->cublas, c->stream) == CUBLAS_STATUS_SUCCESS, PD_EBACKEND);
    CTX_TRY(cudaMalloc(&c->cublas_ws, CUBLAS_WS_BYTES) == cudaSuccess, PD_ENOMEM);
    CTX_TRY(cublasSetWorkspace(c->cublas, c->cublas_ws, CUBLAS_WS_BYTES) == CUBLAS_STATUS_SUCCESS,
            PD_EBACKEND);
    CTX_TRY(cudaMallocHost(&c->staging, STAGING_BYTES) == cudaSuccess, PD_ENOMEM);
    c->staging_bytes = STAGING_BYTES;
    CTX_TRY(cudaMalloc((void **)&c->attn_part, ATTN_PART_FLOATS * sizeof(float)) == cudaSuccess,
            PD_ENOMEM);
    c->attn_part_floats = ATTN_PART_FLOATS;
    CTX_TRY(cudaMalloc((void **)&c->attn_count, ATTN_COUNT_N * sizeof(int32_t)) == cudaSuccess,
            PD_ENOMEM);
    CTX_TRY(cudaMemset(c->attn_count, 0, ATTN_COUNT_N * sizeof(int32_t)) == cudaSuccess,
            PD_EBACKEND);
    c->attn_count_n = ATTN_COUNT_N;
    CTX_TRY(cudaMalloc((void **)&c->dl_counters, 2 * sizeof(unsigned)) == cudaSuccess, PD_ENOMEM);
    CTX_TRY(cudaMemset(c->dl_counters, 0, 2 * sizeof(unsigned)) == cudaSuccess, PD_EBACKEND);
    CTX_TRY(cudaMalloc(&c->dl_ll, DL_LL_BYTES) == cudaSuccess, PD_ENOMEM);
    CTX_TRY(cudaMemset(c->dl_ll, 0, DL_LL_BYTES) == cudaSuccess, PD_EBACKEND);
    c->dl_ll_bytes = DL_LL_BYTES;
    CTX_TRY(cudaMalloc((void **)&c->dl_best, PD_PICK_ROWS * sizeof *c->dl_best) == cudaSuccess,
            PD_ENOMEM);
    CTX_TRY(cudaMemset(c->dl_best, 0, PD_PICK_ROWS * sizeof *c->dl_best) == cudaSuccess,
            PD_EBACKEND);
    CTX_TRY(cudaMallocHost((void **)&c->pick_host,
                           PD_PICK_SLOTS * PD_PICK_ROWS * sizeof *c->pick_host) == cudaSuccess,
            PD_ENOMEM);
    if (cudaHostGetDevicePointer((void **)&c->pick_dev, c->pick_host, 0) != cudaSuccess) {
        c->pick_dev = NULL; /* not mapped: the sample ops sample */
        (void)cudaGetLastError();
    }
    c->sm_count = prop.multiProcessorCount;
    c->cc_major = prop.major;
    c->cc_minor = prop.minor;
    c->smem_optin = (int)prop.sharedMemPerBlockOptin;
    c->split_kv = pd_env_bool("PDSERVE_CUDA_SPLIT_KV");
    /* The decode kernel's split target (0: auto) and pipeline stages, for A/B runs
     * (pdserve-bench-kernels); common/env.c holds their ranges and defaults. */
    c->decode_blocks_per_sm = (int)pd_env_int("PDSERVE_CUDA_DECODE_BLOCKS_PER_SM");
    c->decode_stages = (int)pd_env_int("PDSERVE_CUDA_DECODE_STAGES");
    c->decode_mma_stages = (int)pd_env_int("PDSERVE_CUDA_DECODE_MMA");
    PD_LOGI("cuda backend: device %d, %s (sm_%d%d, %d SMs, %.1f GiB)", device, prop.name,
            prop.major, prop.minor, prop.multiProcessorCount,
            (double)prop.totalGlobalMem / (1 << 30));
    *out = c;
    return 0;
fail:
    {
        cudaError_t last = cudaGetLastError();
        if (last != cudaSuccess) PD_LOGE("cuda backend: %s", cudaGetErrorString(last));
    }
    pd_cuda__ctx_destroy(c);
    return rc;
}

extern "C" int pd_cuda__alloc(void *ctx, pd_dtype dtype, size_t n, void **out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    *out = NULL;
    /* F8E4M3: an FP8 KV cache (the backend's kv_fp8 op set), a byte an element */
    if (dtype != PD_DTYPE_BF16 && dtype != PD_DTYPE_F32 && dtype != PD_DTYPE_I32 &&
        dtype != PD_DTYPE_F8E4M3)
        return PD_EINVAL;
    size_t bytes = (n ? n : 1) * pd_dtype_size(dtype);
    void *p = NULL;
    PD_CUDA_CHECK(cudaMalloc(&p, bytes));
    cudaError_t e = cudaMemsetAsync(p, 0, bytes, c->stream);
    if (e != cudaSuccess) {
        pd_cuda__report("cudaMemsetAsync(p, 0, bytes, c->stream)", cudaGetErrorString(e),
                        __FILE__, __LINE__);
        (void)cudaFree(p);
        return PD_EBACKEND;
    }
    *out = p;
    return 0;
}

extern "C" void pd_cuda__free(void *ctx, void *buf)
{
    if (!buf) return;
    (void)pd_cuda__ctx(ctx);
    cudaError_t e = cudaFree(buf);
    if (e != cudaSuccess) pd_cuda__report("cudaFree(buf)", cudaGetErrorString(e), __FILE__, __LINE__);
}

extern "C" int pd_cuda__sync(void *ctx)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    PD_CUDA_CHECK(cudaGetLastError());
    return 0;
}

extern "C" int pd_cuda__mem_info(void *ctx, size_t *free_bytes, size_t *total_bytes,
                                 size_t *used_bytes)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    PD_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
    *used_bytes = c->free_at_create > *free_bytes ? c->free_at_create - *free_bytes : 0;
    return 0;
}
