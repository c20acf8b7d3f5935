/* cuda_graph.cu -- What lets the model runner replay a decode step as one CUDA graph: pinned
 * host memory, asynchronous row uploads from it (a step's metadata goes in with one or two
 * copies), and graph capture, instantiation and launch on the context's stream. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kernels/cuda/cuda_common.cuh"

extern "C" int pd_cuda__host_alloc(void *ctx, size_t bytes, void **out)
{
    (void)pd_cuda__ctx(ctx);
    *out = NULL;
    if (bytes == 0) return PD_EINVAL;
    PD_CUDA_CHECK(cudaMallocHost(out, bytes));
    return 0;
}

extern "C" void pd_cuda__host_free(void *ctx, void *p)
{
    if (!p) return;
    (void)pd_cuda__ctx(ctx);
    cudaError_t e = cudaFreeHost(p);
    if (e != cudaSuccess) pd_cuda__report("cudaFreeHost(p)", cudaGetErrorString(e), __FILE__, __LINE__);
}

/* ---- PDSERVE_CUDA_STEP_TIMING ---- */

static int st_on = -1; /* -1 not read yet */
static struct {
    bool open;
    unsigned seen; /* the points recorded in the open step */
    cudaEvent_t ev[PD_ST_N];
    double t0, acc[PD_ST_N + 1];
    long steps;
} st_;

static double host_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The first context that marks a step owns the timing: with tensor parallelism every rank's
 * context marks its own steps, and only one stream's can go into st_ (its events are of the
 * owner's device). */
static pd_cuda_ctx *st_owner;

void pd_cuda__steptime_mark(pd_cuda_ctx *c, int k)
{
    if (st_on == 0) return;
    pd_cuda_ctx *first = NULL;
    if (!__atomic_compare_exchange_n(&st_owner, &first, c, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE) && first != c)
        return;
    if (st_on < 0) {
        st_on = pd_env_bool("PDSERVE_CUDA_STEP_TIMING");
        for (int i = 0; st_on && i < PD_ST_N; i++)
            if (cudaEventCreate(&st_.ev[i]) != cudaSuccess) st_on = 0;
    }
    if (!st_on) return;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(c->stream, &cap) != cudaSuccess || cap != cudaStreamCaptureStatusNone)
        return;
    if (k == PD_ST_START) {
        if (st_.open) return;
        st_.open = true;
        st_.seen = 0;
        st_.t0 = host_now();
    } else if (!st_.open) {
        return;
    }
    if (cudaEventRecord(st_.ev[k], c->stream) == cudaSuccess) st_.seen |= 1u << k;
}

void pd_cuda__steptime_end(pd_cuda_ctx *c)
{
    if (st_on <= 0 || c != __atomic_load_n(&st_owner, __ATOMIC_ACQUIRE) || !st_.open) return;
    st_.open = false;
    const double host_us = (host_now() - st_.t0) * 1e6;
    if (st_.seen != (1u << PD_ST_N) - 1) return; /* not a graph step */
    float ms[PD_ST_N] = {0};
    for (int k = 1; k < PD_ST_N; k++)
        if (cudaEventElapsedTime(&ms[k], st_.ev[k - 1], st_.ev[k]) != cudaSuccess) {
            (void)cudaGetLastError();
            return;
        }
    for (int k = 1; k < PD_ST_N; k++) st_.acc[k] += ms[k] * 1e3;
    st_.acc[PD_ST_N] += host_us;
    if (++st_.steps % 256) return;
    const double n = (double)st_.steps;
    fprintf(stderr, "step timing (us, mean of %ld graph steps): upload %.2f | graph %.2f | to the "
            "copy (sample) %.2f | copy %.2f | host, call to sync %.2f\n", st_.steps,
            st_.acc[1] / n, st_.acc[2] / n, st_.acc[3] / n, st_.acc[4] / n, st_.acc[5] / n);
}

/* rows rows of row_bytes, host to device, queued on stream. */
static cudaError_t copy_rows(void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                             size_t row_bytes, size_t rows, cudaStream_t stream)
{
    return rows == 1 ? cudaMemcpyAsync(dst, src, row_bytes, cudaMemcpyHostToDevice, stream)
                     : cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                         cudaMemcpyHostToDevice, stream);
}

/* ---- uploads by a kernel ----
 * A step's metadata is a few hundred bytes to a few KiB. A kernel that reads the pinned host
 * memory itself (unified addressing) costs a launch and one round trip over the bus, less than
 * the copy engine's copy, whether in the stream's order or on a side stream behind a
 * cross-stream wait: a pipelined Qwen3-0.6B batch-1 step came out faster either way
 * (docs/perf-history.md, issue #8's eleventh pass). Larger uploads keep the copy engine. */
#define FETCH_MAX_BYTES (64 << 10)
#define FETCH_THREADS 256

static __global__ void __launch_bounds__(FETCH_THREADS)
fetch_rows_kernel(char *dst, size_t dst_pitch, const char *src, size_t src_pitch,
                  size_t row_bytes, size_t rows, int words)
{   /* loads that bypass the caches: the host rewrites src between launches */
    const size_t per = words ? row_bytes / 4 : row_bytes, n = per * rows;
    for (size_t i = (size_t)blockIdx.x * FETCH_THREADS + threadIdx.x; i < n;
         i += (size_t)gridDim.x * FETCH_THREADS) {
        const size_t r = i / per, e = i % per;
        if (words)
            reinterpret_cast<uint32_t *>(dst + r * dst_pitch)[e] =
                __ldcv(reinterpret_cast<const unsigned *>(src + r * src_pitch) + e);
        else
            dst[r * dst_pitch + e] = reinterpret_cast<const volatile char *>(src + r * src_pitch)[e];
    }
}

/* src's device address for fetch_rows when the upload is small and src is pinned host memory
 * a kernel can read, else NULL. */
static const void *fetchable(const void *src, size_t row_bytes, size_t rows)
{
    if (rows * row_bytes > FETCH_MAX_BYTES) return NULL;
    cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, src) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return at.type == cudaMemoryTypeHost ? at.devicePointer : NULL;
}

/* The upload from dsrc (fetchable's) by fetch_rows_kernel, queued on stream. */
static cudaError_t fetch_rows(void *dst, size_t dst_pitch, const void *dsrc, size_t src_pitch,
                              size_t row_bytes, size_t rows, cudaStream_t stream)
{
    const int words = ((uintptr_t)dst | (uintptr_t)dsrc | dst_pitch | src_pitch | row_bytes) % 4 == 0;
    const size_t n = (words ? row_bytes / 4 : row_bytes) * rows;
    size_t blocks = (n + FETCH_THREADS - 1) / FETCH_THREADS;
    if (blocks > 64) blocks = 64;
    fetch_rows_kernel<<<(unsigned)blocks, FETCH_THREADS, 0, stream>>>(
        (char *)dst, dst_pitch, (const char *)dsrc, src_pitch, row_bytes, rows, words);
    return cudaGetLastError();
}

/* The upload in the stream's order: by fetch_rows from dsrc (fetchable's), else the copy
 * engine's copy from src. */
static int upload_in_order(pd_cuda_ctx *c, void *dst, size_t dst_pitch, const void *src,
                           const void *dsrc, size_t src_pitch, size_t row_bytes, size_t rows)
{
    pd_cuda__steptime_mark(c, PD_ST_START);
    PD_CUDA_CHECK(dsrc ? fetch_rows(dst, dst_pitch, dsrc, src_pitch, row_bytes, rows, c->stream)
                       : copy_rows(dst, dst_pitch, src, src_pitch, row_bytes, rows, c->stream));
    return 0;
}

extern "C" int pd_cuda__upload_rows(void *ctx, void *dst, size_t dst_pitch, const void *src,
                                    size_t src_pitch, size_t row_bytes, size_t rows)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    c->pick.on = false; /* a forward's metadata: the last one's picks are not this one's */
    if (rows == 0 || row_bytes == 0) return 0;
    if (!dst || !src || dst_pitch < row_bytes || src_pitch < row_bytes) return PD_EINVAL;
    return upload_in_order(c, dst, dst_pitch, src, fetchable(src, row_bytes, rows), src_pitch,
                           row_bytes, rows);
}

/* The side stream and its events, once. */
static int side_init(pd_cuda_ctx *c)
{
    if (c->side) return 0;
    PD_CUDA_CHECK(cudaEventCreateWithFlags(&c->ev_upload, cudaEventDisableTiming));
    PD_CUDA_CHECK(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking));
    return 0;
}

/* Whether upload_rows_overlap overlaps (PDSERVE_CUDA_OVERLAP_UPLOAD=0: in order, for A/B). */
static bool overlap_on(void)
{
    static int v = -1;
    return pd_cuda__switch_on("PDSERVE_CUDA_OVERLAP_UPLOAD", &v);
}

/* The copy engine's copy on the side stream, ordered after nothing queued before it: a
 * pipelined step's metadata goes in while the step before runs on every SM (a kernel's copy
 * would wait for it); the main stream waits for the copy before its next op. */
extern "C" int pd_cuda__upload_rows_overlap(void *ctx, void *dst, size_t dst_pitch,
                                            const void *src, size_t src_pitch, size_t row_bytes,
                                            size_t rows)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (rows == 0 || row_bytes == 0 || !overlap_on())
        return pd_cuda__upload_rows(ctx, dst, dst_pitch, src, src_pitch, row_bytes, rows);
    c->pick.on = false;
    if (!dst || !src || dst_pitch < row_bytes || src_pitch < row_bytes) return PD_EINVAL;
    int rc = side_init(c);
    if (rc < 0) return rc;
    PD_CUDA_CHECK(copy_rows(dst, dst_pitch, src, src_pitch, row_bytes, rows, c->side));
    PD_CUDA_CHECK(cudaEventRecord(c->ev_upload, c->side));
    PD_CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->ev_upload, 0));
    return 0;
}

/* Thread-local capture: only this thread's unsafe calls (synchronisations, allocations) break
 * the capture; another thread of the process (the KV transfer's) may go on allocating. */
/* A graph: the executable one, and the greedy picks its replays leave (decode_layers). */
typedef struct {
    cudaGraphExec_t exec;
    pd_cuda_pick pick;
} cuda_graph;

extern "C" int pd_cuda__graph_begin(void *ctx)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    c->cap_pick.on = false;
    PD_CUDA_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    return 0;
}

extern "C" int pd_cuda__graph_end(void *ctx, void **graph)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    *graph = NULL;
    cudaGraph_t g = NULL;
    /* Ends the capture whatever happened in it; an op that failed inside invalidated it. */
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (e != cudaSuccess || !g) {
        pd_cuda__report("cudaStreamEndCapture(c->stream, &g)", cudaGetErrorString(e), __FILE__,
                        __LINE__);
        if (g) (void)cudaGraphDestroy(g);
        (void)cudaGetLastError();
        return PD_EBACKEND;
    }
    cudaGraphExec_t x = NULL;
    e = cudaGraphInstantiate(&x, g, 0);
    (void)cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        pd_cuda__report("cudaGraphInstantiate(&x, g, 0)", cudaGetErrorString(e), __FILE__,
                        __LINE__);
        (void)cudaGetLastError();
        return e == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EBACKEND;
    }
    /* Uploading now moves the first launch's setup cost to start-up. */
    cuda_graph *w = (cuda_graph *)malloc(sizeof *w);
    if (!w) {
        (void)cudaGraphExecDestroy(x);
        return PD_ENOMEM;
    }
    w->exec = x;
    w->pick = c->cap_pick;
    c->cap_pick.on = false;
    e = cudaGraphUpload(x, c->stream);
    if (e != cudaSuccess) {
        pd_cuda__report("cudaGraphUpload(x, c->stream)", cudaGetErrorString(e), __FILE__,
                        __LINE__);
        (void)cudaGraphExecDestroy(x);
        free(w);
        return PD_EBACKEND;
    }
    *graph = w;
    return 0;
}

extern "C" int pd_cuda__graph_launch(void *ctx, void *graph)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!graph) return PD_EINVAL;
    pd_cuda__steptime_mark(c, PD_ST_GRAPH);
    const cuda_graph *w = (const cuda_graph *)graph;
    c->pick.on = false;
    PD_CUDA_CHECK(cudaGraphLaunch(w->exec, c->stream));
    c->pick = w->pick;
    pd_cuda__steptime_mark(c, PD_ST_GRAPH_END);
    return 0;
}

extern "C" void pd_cuda__graph_destroy(void *ctx, void *graph)
{
    if (!graph) return;
    (void)pd_cuda__ctx(ctx);
    cuda_graph *w = (cuda_graph *)graph;
    cudaError_t e = cudaGraphExecDestroy(w->exec);
    if (e != cudaSuccess)
        pd_cuda__report("cudaGraphExecDestroy(graph)", cudaGetErrorString(e), __FILE__, __LINE__);
    free(w);
}
