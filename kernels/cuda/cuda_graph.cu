/* cuda_graph.cu -- What lets the model runner replay a decode step as one CUDA graph: pinned
 * host memory, asynchronous row uploads from it (a step's metadata goes in with one or two
 * copies), and graph capture, instantiation and launch on the context's stream. */
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

extern "C" int pd_cuda__upload_rows(void *ctx, void *dst, size_t dst_pitch, const void *src,
                                    size_t src_pitch, size_t row_bytes, size_t rows)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (rows == 0 || row_bytes == 0) return 0;
    if (!dst || !src || dst_pitch < row_bytes || src_pitch < row_bytes) return PD_EINVAL;
    if (rows == 1)
        PD_CUDA_CHECK(cudaMemcpyAsync(dst, src, row_bytes, cudaMemcpyHostToDevice, c->stream));
    else
        PD_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                        cudaMemcpyHostToDevice, c->stream));
    return 0;
}

/* Thread-local capture: only this thread's unsafe calls (synchronisations, allocations) break
 * the capture; another thread of the process (the KV transfer's) may go on allocating. */
extern "C" int pd_cuda__graph_begin(void *ctx)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
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
    PD_CUDA_CHECK(cudaGraphUpload(x, c->stream));
    *graph = x;
    return 0;
}

extern "C" int pd_cuda__graph_launch(void *ctx, void *graph)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!graph) return PD_EINVAL;
    PD_CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph, c->stream));
    return 0;
}

extern "C" void pd_cuda__graph_destroy(void *ctx, void *graph)
{
    if (!graph) return;
    (void)pd_cuda__ctx(ctx);
    cudaError_t e = cudaGraphExecDestroy((cudaGraphExec_t)graph);
    if (e != cudaSuccess)
        pd_cuda__report("cudaGraphExecDestroy(graph)", cudaGetErrorString(e), __FILE__, __LINE__);
}
