/* bench_kernels.cu -- pdserve-bench-kernels: times the CUDA backend's decode-path ops (linear,
 * attention_decode, sample) through its op table, against the physical floors measured in the
 * same run: a large device-to-device copy (memory bandwidth) and a large cuBLAS bf16 GEMM
 * (matrix rate). Built with the CUDA backend only; docs/perf-history.md keeps its results. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

extern "C" {
#include "common/env.h"
#include "common/error.h"
#include "kernels/backend.h"
}

#define ROTATE_BYTES ((size_t)256 << 20) /* weights / KV cycled per batch: 4x+ the L2 */
#define BATCH_BYTES ((double)(2u << 30))  /* a timed batch moves about this much */
#define MAX_CALLS 1024                    /* ops per timed batch at most */
#define REPEATS 7                         /* timed batches per case (the median is printed) */

static void usage(FILE *f)
{
    fprintf(f,
        "usage: pdserve-bench-kernels [--floor] [--linear] [--attention] [--kv-fp8] [--sample]\n"
        "                             [--prefill-attention] [--all] [--fp8] [--all-reduce N]\n"
        "                             [--device N] [--json]\n"
        "\n"
        "Times the CUDA backend's decode-path ops through its op table on random data, and the\n"
        "device's physical floors in the same run. Sections (none given = --all):\n"
        "  --floor      device-to-device cudaMemcpy of 1 GiB (GB/s counting bytes read + written,\n"
        "               and read-only = half) and a cuBLAS bf16 8192^3 GEMM with fp32\n"
        "               accumulation (TFLOP/s)\n"
        "  --linear     the linear op on Qwen3-0.6B's and Llama-3-8B's products, and one rank's\n"
        "               of Llama-3-8B at tensor parallel 2 and Llama-3-70B at 4, at n = 1 .. 256:\n"
        "               us per call, weight GB/s and %% of the copy's rate, TFLOP/s and %% of the\n"
        "               GEMM rate\n"
        "  --attention  attention_decode, Qwen3-0.6B heads (16 q, 8 KV, head_dim 128, blocks\n"
        "               of 16), batch 256 x context 1024 (also with max_ctx_len = 0), batch\n"
        "               1 / 32 at contexts 128 / 1024 / 8192, batch 128 at 128 / 512: us, KV\n"
        "               bytes read per second, %% of the copy\n"
        "  --kv-fp8     attention_decode with a bf16 and an FP8 KV cache (the backend's kv_fp8\n"
        "               op set), the same heads, batch 1 / 32 / 64 at contexts 1024 / 8192: us\n"
        "               per call of each next to its floor (KV bytes read / the copy's rate),\n"
        "               and the FP8 cache's speed-up\n"
        "  --prefill-attention\n"
        "               attention_prefill of fresh causal prompts, Llama-3-8B heads (32 q, 8 KV,\n"
        "               head_dim 128, blocks of 16), 1 x 512 / 1024 / 2048 / 8192, 8 x 2048 and\n"
        "               32 x 512 tokens, a bf16 and an FP8 KV cache: us per call, TFLOP/s\n"
        "               counting the causal products (4 x head_dim x heads x the keys each\n"
        "               query sees) and %% of the GEMM rate. Not part of --all.\n"
        "  --sample     the sample op (if offered) on 1 / 32 / 256 rows of 151,936 logits, greedy\n"
        "               and temperature 1 + top-p 0.9 + top-k 50\n"
        "  --fp8        the FP8 weight op set's linear_fused (pd_backend_ops.fp8, dynamic\n"
        "               per-token activations) on Llama-3-8B's products: at n = 256 and 2048\n"
        "               (cuBLASLt's FP8 GEMM with the quantization kernel; per-channel and\n"
        "               128 x 128 block scales) TFLOP/s next to the bf16 linear's and the GEMM\n"
        "               floor; at n = 1 .. 8 (the weight-streaming kernel) us per call next to\n"
        "               the floor, the weight's bytes over the copy rate. Not part of --all.\n"
        "  --all-reduce N\n"
        "               the communicator of tensor parallelism (pd_comm: NCCL, loaded as the\n"
        "               services load it) over devices 0 .. N-1, one thread a rank: all_reduce_sum\n"
        "               of bf16 buffers of 4 KiB .. 256 MiB, called directly (eager) and\n"
        "               captured in a graph on every rank (as the decode graphs hold it): us per\n"
        "               call (the slowest rank's median) and bus bandwidth, nccl-tests' measure\n"
        "               (bytes x 2(N-1)/N / time). Not part of --all.\n"
        "  --device N   GPU ordinal (default 0)\n"
        "  --json       one JSON object per result line instead of the tables\n"
        "\n"
        "%% of the copy: bytes the op must move per second over the bytes the copy moves per\n"
        "second (read + written: both are bytes through device memory; a read-only stream is\n"
        "not bound by the copy's read half). The floors are always measured (the percentages\n"
        "need them) and the run always ends in one line\n"
        "  FLOOR copy_gbps=<read+write GB/s> gemm_tflops=<TFLOP/s>\n"
        "Times are medians of %d batches after a warm-up batch. An op batch is recorded once as\n"
        "a CUDA graph (the backend's graph ops) and replayed, timed by sync + clock: back-to-back\n"
        "kernels as in a captured decode step; without graphs, direct calls. Weights and KV\n"
        "blocks rotate over at least 256 MiB so that the L2 does not hold them.\n",
        REPEATS);
}

typedef struct {
    bool floor, linear, attention, sample; /* sections */
    bool fp8;                              /* --fp8 */
    bool kv_fp8;                           /* the bf16 / FP8 cache comparison (--kv-fp8) */
    bool prefill;                          /* attention_prefill (--prefill-attention) */
    int all_reduce;                        /* ranks of --all-reduce (0: not run) */
    bool json;                             /* JSON lines instead of tables */
    int device;                            /* CUDA ordinal */
} bk_opts;

typedef struct {
    double copy_gbps;   /* device-to-device copy, bytes read + written per second / 1e9 */
    double gemm_tflops; /* cuBLAS bf16 8192^3 */
} bk_floor;

#define BK_CUDA(call)                                                                      \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "pdserve-bench-kernels: %s failed: %s (%s:%d)\n", #call,      \
                    cudaGetErrorString(e_), __FILE__, __LINE__);                           \
            goto fail;                                                                     \
        }                                                                                  \
    } while (0)

#define BK_CUBLAS(call)                                                                    \
    do {                                                                                   \
        cublasStatus_t s_ = (call);                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
            fprintf(stderr, "pdserve-bench-kernels: %s failed: %s (%s:%d)\n", #call,      \
                    cublasGetStatusString(s_), __FILE__, __LINE__);                        \
            goto fail;                                                                     \
        }                                                                                  \
    } while (0)

/* A backend op returning 0 or a negative pd error. */
#define BK_OP(call)                                                                        \
    do {                                                                                   \
        int r_ = (call);                                                                   \
        if (r_ != 0) {                                                                     \
            fprintf(stderr, "pdserve-bench-kernels: %s failed: %s (%s:%d)\n", #call,      \
                    pd_strerror(r_), __FILE__, __LINE__);                                  \
            goto fail;                                                                     \
        }                                                                                  \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void) /* xorshift64 */
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

/* A zeroed backend buffer filled with uniform values in [lo, hi). */
static void *rand_buf(pd_backend *be, pd_dtype t, size_t n, uint64_t seed, float lo, float hi)
{
    void *p = NULL;
    if (be->ops->alloc(be->ctx, t, n, &p) != 0) {
        fprintf(stderr, "pdserve-bench-kernels: alloc of %zu %s elements failed\n", n,
                pd_dtype_name(t));
        return NULL;
    }
    if (be->ops->fill_uniform(be->ctx, p, t, n, seed, lo, hi) != 0) {
        be->ops->free(be->ctx, p);
        return NULL;
    }
    return p;
}

/* ---- timing of op batches ---- */

/* One batch: `calls` calls of an op, call i given its index (to pick rotating buffers).
 * Returns 0 or a pd error. */
typedef int (*bk_call_fn)(pd_backend *be, void *arg, int i);

/* Median seconds per call over REPEATS batches of `calls` calls, after one warm-up batch. The
 * batch is captured as a graph when the backend offers graphs (*graphed says whether it was),
 * else called directly. Returns a negative value when an op fails. */
static double time_batch(pd_backend *be, bk_call_fn fn, void *arg, int calls, bool *graphed)
{
    const pd_backend_ops *o = be->ops;
    void *graph = NULL;
    double t[REPEATS];
    *graphed = false;
    if (o->graph_begin && o->graph_end && o->graph_launch && o->sync(be->ctx) == 0 &&
        o->graph_begin(be->ctx) == 0) {
        int rc = 0;
        for (int i = 0; i < calls && rc == 0; i++) rc = fn(be, arg, i);
        const int end = o->graph_end(be->ctx, &graph); /* ends the capture in any case */
        if (rc != 0 || end != 0) {
            if (graph) o->graph_destroy(be->ctx, graph);
            graph = NULL;
            (void)cudaGetLastError();
        }
    }
    *graphed = graph != NULL;
    for (int r = -1; r < REPEATS; r++) {
        if (o->sync(be->ctx) != 0) goto fail;
        const double t0 = now_s();
        if (graph) {
            if (o->graph_launch(be->ctx, graph) != 0) goto fail;
        } else {
            for (int i = 0; i < calls; i++)
                if (fn(be, arg, i) != 0) goto fail;
        }
        if (o->sync(be->ctx) != 0) goto fail;
        if (r >= 0) t[r] = (now_s() - t0) / calls;
    }
    if (graph) o->graph_destroy(be->ctx, graph);
    return median(t, REPEATS);
fail:
    if (graph) o->graph_destroy(be->ctx, graph);
    return -1.0;
}

/* Calls per batch: about BATCH_BYTES moved, at least `min_calls` (a whole rotation) and 4,
 * at most MAX_CALLS. */
static int batch_calls(double bytes_per_call, int min_calls)
{
    double c = ceil(BATCH_BYTES / bytes_per_call);
    if (c < min_calls) c = min_calls;
    if (c < 4) c = 4;
    if (c > MAX_CALLS) c = MAX_CALLS;
    return (int)c;
}

/* ---- floors ---- */

static int bench_floor(const bk_opts *opt, pd_backend *be, bk_floor *fl)
{
    const pd_backend_ops *o = be->ops;
    const size_t copy_elems = (size_t)1 << 29; /* 1 GiB of bf16 */
    const size_t copy_bytes = copy_elems * 2;
    const int gn = 8192;
    const size_t gelems = (size_t)gn * gn;
    void *src = NULL, *dst = NULL, *ga = NULL, *gb = NULL, *gc = NULL;
    cudaStream_t st = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    cublasHandle_t cb = NULL;
    double tc[20], tg[10];
    int rc = -1;

    if (!(src = rand_buf(be, PD_DTYPE_BF16, copy_elems, 11, -1.0f, 1.0f))) goto fail;
    if (!(dst = rand_buf(be, PD_DTYPE_BF16, copy_elems, 12, -1.0f, 1.0f))) goto fail;
    BK_OP(o->sync(be->ctx));
    BK_CUDA(cudaSetDevice(opt->device));
    BK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    BK_CUDA(cudaEventCreate(&e0));
    BK_CUDA(cudaEventCreate(&e1));
    for (int r = -3; r < 20; r++) {
        BK_CUDA(cudaEventRecord(e0, st));
        BK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, st));
        BK_CUDA(cudaEventRecord(e1, st));
        BK_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        BK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 0) tc[r] = ms * 1e-3;
    }
    fl->copy_gbps = 2.0 * (double)copy_bytes / median(tc, 20) / 1e9;
    o->free(be->ctx, src);
    o->free(be->ctx, dst);
    src = dst = NULL;

    if (!(ga = rand_buf(be, PD_DTYPE_BF16, gelems, 21, -1.0f, 1.0f))) goto fail;
    if (!(gb = rand_buf(be, PD_DTYPE_BF16, gelems, 22, -1.0f, 1.0f))) goto fail;
    if (!(gc = rand_buf(be, PD_DTYPE_BF16, gelems, 23, -1.0f, 1.0f))) goto fail;
    BK_OP(o->sync(be->ctx));
    BK_CUBLAS(cublasCreate(&cb));
    BK_CUBLAS(cublasSetStream(cb, st));
    for (int r = -3; r < 10; r++) {
        const float alpha = 1.0f, beta = 0.0f;
        BK_CUDA(cudaEventRecord(e0, st));
        BK_CUBLAS(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, gn, gn, gn, &alpha, ga, CUDA_R_16BF,
                               gn, gb, CUDA_R_16BF, gn, &beta, gc, CUDA_R_16BF, gn,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        BK_CUDA(cudaEventRecord(e1, st));
        BK_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        BK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 0) tg[r] = ms * 1e-3;
    }
    fl->gemm_tflops = 2.0 * gn * (double)gn * gn / median(tg, 10) / 1e12;
    rc = 0;
    if (opt->floor) {
        if (opt->json)
            printf("{\"bench\":\"floor\",\"copy_bytes\":%zu,\"copy_gbps\":%.1f,"
                   "\"copy_read_gbps\":%.1f,\"gemm_n\":%d,\"gemm_tflops\":%.1f}\n",
                   copy_bytes, fl->copy_gbps, fl->copy_gbps / 2, gn, fl->gemm_tflops);
        else
            printf("\n## floor\n"
                   "device-to-device cudaMemcpy of 1 GiB (median of 20): %8.1f GB/s read + "
                   "written, %8.1f GB/s read\n"
                   "cuBLAS bf16 %dx%dx%d GEMM, fp32 accumulation (median of 10): %8.1f TFLOP/s\n",
                   fl->copy_gbps, fl->copy_gbps / 2, gn, gn, gn, fl->gemm_tflops);
    }
fail:
    if (cb) (void)cublasDestroy(cb);
    if (e0) (void)cudaEventDestroy(e0);
    if (e1) (void)cudaEventDestroy(e1);
    if (st) (void)cudaStreamDestroy(st);
    o->free(be->ctx, src);
    o->free(be->ctx, dst);
    o->free(be->ctx, ga);
    o->free(be->ctx, gb);
    o->free(be->ctx, gc);
    return rc;
}

/* ---- linear ---- */

typedef struct {
    const char *model, *op;
    int32_t k, m;
} lin_shape;

static const lin_shape k_lin_shapes[] = {
    {"qwen3-0.6b", "qkv", 1024, 4096},      {"qwen3-0.6b", "o_proj", 2048, 1024},
    {"qwen3-0.6b", "gate_up", 1024, 6144},  {"qwen3-0.6b", "down", 3072, 1024},
    {"qwen3-0.6b", "lm_head", 1024, 151936}, {"llama3-8b", "qkv", 4096, 6144},
    {"llama3-8b", "o_proj", 4096, 4096},    {"llama3-8b", "gate_up", 4096, 28672},
    {"llama3-8b", "down", 14336, 4096},     {"llama3-8b", "lm_head", 4096, 128256},
    /* one rank's products at tensor parallel 2 (Llama-3-8B) and 4 (Llama-3-70B) */
    {"8b-tp2", "qkv", 4096, 3072},          {"8b-tp2", "o_proj", 2048, 4096},
    {"8b-tp2", "gate_up", 4096, 14336},     {"8b-tp2", "down", 7168, 4096},
    {"70b-tp4", "qkv", 8192, 2560},         {"70b-tp4", "o_proj", 2048, 8192},
    {"70b-tp4", "gate_up", 8192, 14336},    {"70b-tp4", "down", 7168, 8192},
    {"70b", "lm_head", 8192, 128256},
};
static const int32_t k_lin_n[] = {1, 2, 4, 8, 16, 32, 64, 256};

typedef struct {
    const void *x, *w;
    void *out;
    int32_t n, k, m;
    int copies;        /* weight copies rotated over */
    size_t copy_elems; /* m * k */
} lin_arg;

static int lin_call(pd_backend *be, void *arg, int i)
{
    const lin_arg *a = (const lin_arg *)arg;
    const char *w = (const char *)a->w + (size_t)(i % a->copies) * a->copy_elems * 2;
    return be->ops->linear(be->ctx, a->x, w, NULL, a->n, a->k, a->m, a->out);
}

static int bench_linear(const bk_opts *opt, pd_backend *be, const bk_floor *fl)
{
    const pd_backend_ops *o = be->ops;
    const int32_t n_max = k_lin_n[sizeof k_lin_n / sizeof k_lin_n[0] - 1];
    const char *env = pd_env_raw("PDSERVE_CUDA_GEMV_MAX_N");
    if (!opt->json)
        printf("\n## linear (out[n][m] = x[n][k] . w[m][k]^T, bf16, no bias%s%s)\n"
               "%-11s %-8s %6s %7s %4s %10s %9s %7s %9s %7s %s\n",
               env ? ", PDSERVE_CUDA_GEMV_MAX_N=" : "", env ? env : "", "model", "op", "k", "m",
               "n", "us/call", "weight GB/s", "%copy", "TFLOP/s", "%gemm", "mode");
    for (size_t s = 0; s < sizeof k_lin_shapes / sizeof k_lin_shapes[0]; s++) {
        const lin_shape *sh = &k_lin_shapes[s];
        const size_t welems = (size_t)sh->m * sh->k, wbytes = welems * 2;
        int copies = (int)((ROTATE_BYTES + wbytes - 1) / wbytes);
        if (copies > 64) copies = 64;
        void *w = rand_buf(be, PD_DTYPE_BF16, welems * copies, 100 + s, -0.05f, 0.05f);
        void *x = rand_buf(be, PD_DTYPE_BF16, (size_t)n_max * sh->k, 200 + s, -1.0f, 1.0f);
        void *out = rand_buf(be, PD_DTYPE_BF16, (size_t)n_max * sh->m, 300 + s, -1.0f, 1.0f);
        if (!w || !x || !out) {
            o->free(be->ctx, w);
            o->free(be->ctx, x);
            o->free(be->ctx, out);
            return -1;
        }
        for (size_t j = 0; j < sizeof k_lin_n / sizeof k_lin_n[0]; j++) {
            lin_arg a = {x, w, out, k_lin_n[j], sh->k, sh->m, copies, welems};
            bool graphed = false;
            const int calls = batch_calls((double)wbytes, copies);
            const double t = time_batch(be, lin_call, &a, calls, &graphed);
            if (t <= 0) {
                fprintf(stderr, "pdserve-bench-kernels: linear %s %s n=%d failed\n", sh->model,
                        sh->op, a.n);
                o->free(be->ctx, w);
                o->free(be->ctx, x);
                o->free(be->ctx, out);
                return -1;
            }
            const double gbps = (double)wbytes / t / 1e9;
            const double pct_copy = 100.0 * gbps / fl->copy_gbps;
            const double tflops = 2.0 * a.n * (double)welems / t / 1e12;
            const double pct_gemm = 100.0 * tflops / fl->gemm_tflops;
            if (opt->json)
                printf("{\"bench\":\"linear\",\"model\":\"%s\",\"op\":\"%s\",\"k\":%d,\"m\":%d,"
                       "\"n\":%d,\"us\":%.2f,\"weight_gbps\":%.1f,\"pct_copy\":%.1f,"
                       "\"tflops\":%.2f,\"pct_gemm\":%.1f,\"graph\":%s,\"calls\":%d}\n",
                       sh->model, sh->op, sh->k, sh->m, a.n, t * 1e6, gbps, pct_copy, tflops,
                       pct_gemm, graphed ? "true" : "false", calls);
            else
                printf("%-11s %-8s %6d %7d %4d %10.2f %9.1f %6.1f%% %9.2f %6.1f%% %s\n",
                       sh->model, sh->op, sh->k, sh->m, a.n, t * 1e6, gbps, pct_copy, tflops,
                       pct_gemm, graphed ? "graph" : "direct");
            fflush(stdout);
        }
        o->free(be->ctx, w);
        o->free(be->ctx, x);
        o->free(be->ctx, out);
    }
    return 0;
}

/* ---- the FP8 weight op set (--fp8) ---- */

static const lin_shape k_fp8_shapes[] = {
    {"llama3-8b", "qkv", 4096, 6144},     {"llama3-8b", "o_proj", 4096, 4096},
    {"llama3-8b", "gate_up", 4096, 28672}, {"llama3-8b", "down", 14336, 4096},
};
static const int32_t k_fp8_gemm_n[] = {256, 2048};
static const int32_t k_fp8_gemv_n[] = {1, 2, 4, 8};
#define FP8_MAX_COPIES 16

typedef struct {
    const void *x;
    void *out;
    void *w[FP8_MAX_COPIES]; /* weight_create results, rotated over */
    int copies;
    int32_t n, k, m;
} fp8_arg;

static int fp8_call(pd_backend *be, void *arg, int i)
{
    const fp8_arg *a = (const fp8_arg *)arg;
    pd_linear_args l;
    memset(&l, 0, sizeof l);
    l.x = a->x;
    l.w = a->w[i % a->copies];
    l.out = a->out;
    l.n = a->n;
    l.k = a->k;
    l.m = a->m;
    return be->ops->fp8->linear_fused(be->ctx, &l);
}

/* One shape's FP8 weights (copies of random codes and scales: per row, or per 128 x 128
 * block) and the bf16 weights of the same shape; times every n of both lists. */
static int bench_fp8_shape(const bk_opts *opt, pd_backend *be, const bk_floor *fl,
                           const lin_shape *sh, int32_t group, void *x, void *out)
{
    const pd_backend_ops *o = be->ops;
    const size_t welems = (size_t)sh->m * sh->k;
    const int32_t ng = (sh->k + group - 1) / group;
    const size_t wbytes = welems + (size_t)sh->m * ng * sizeof(float);
    int copies = (int)((ROTATE_BYTES + wbytes - 1) / wbytes);
    if (copies > FP8_MAX_COPIES) copies = FP8_MAX_COPIES;
    fp8_arg a;
    memset(&a, 0, sizeof a);
    uint8_t *w8 = (uint8_t *)malloc(welems);
    float *scale = (float *)malloc((size_t)sh->m * ng * sizeof(float));
    int bcopies = (int)((ROTATE_BYTES + 2 * welems - 1) / (2 * welems));
    if (bcopies > 64) bcopies = 64;
    void *wb = NULL;
    int rc = -1;
    if (!w8 || !scale) goto fail;
    for (int c = 0; c < copies; c++) {
        for (size_t i = 0; i < welems; i++) {
            uint8_t b = (uint8_t)(rnd() >> 56);
            if ((b & 0x7f) == 0x7f) b ^= 1; /* never NaN */
            w8[i] = b & 0xbf; /* |value| < 2: sums stay moderate */
        }
        for (int32_t i = 0; i < sh->m; i++)
            for (int32_t g = 0; g < ng; g++)
                scale[(size_t)i * ng + g] =
                    group == sh->k || i % 128 == 0 ? 1e-3f * (float)(1 + rnd() % 7)
                                                   : scale[(size_t)(i / 128 * 128) * ng + g];
        pd_qweight_desc d = {w8, scale, sh->m, sh->k, group, PD_ACT_DYNAMIC, 0.0f, 0};
        BK_OP(o->fp8->weight_create(be->ctx, &d, &a.w[c]));
        a.copies = c + 1;
    }
    if (group == sh->k && !(wb = rand_buf(be, PD_DTYPE_BF16, welems * bcopies, 500, -0.05f, 0.05f)))
        goto fail;
    a.x = x;
    a.out = out;
    a.k = sh->k;
    a.m = sh->m;
    for (int pass = 0; pass < 2; pass++) {
        const int32_t *ns = pass ? k_fp8_gemv_n : k_fp8_gemm_n;
        const size_t nn = pass ? sizeof k_fp8_gemv_n / sizeof k_fp8_gemv_n[0]
                               : sizeof k_fp8_gemm_n / sizeof k_fp8_gemm_n[0];
        for (size_t j = 0; j < nn; j++) {
            a.n = ns[j];
            BK_OP(fp8_call(be, &a, 0)); /* its workspaces grown outside the capture */
            BK_OP(o->sync(be->ctx));
            bool graphed = false;
            const int calls = batch_calls((double)wbytes + (double)a.n * sh->k * 3, copies);
            const double t = time_batch(be, fp8_call, &a, calls, &graphed);
            if (t <= 0) goto fail;
            const double tflops = 2.0 * a.n * (double)welems / t / 1e12;
            double tb = 0.0; /* the bf16 linear, per-channel pass only */
            if (wb && !pass) {
                lin_arg la = {x, wb, out, a.n, sh->k, sh->m, bcopies, welems};
                bool g2 = false;
                tb = time_batch(be, lin_call, &la, batch_calls(2.0 * welems, bcopies), &g2);
                if (tb <= 0) goto fail;
            }
            const double floor_us = (double)wbytes / (fl->copy_gbps * 1e9) * 1e6;
            if (opt->json) {
                printf("{\"bench\":\"fp8\",\"model\":\"%s\",\"op\":\"%s\",\"k\":%d,"
                       "\"m\":%d,\"n\":%d,\"group\":%d,\"us\":%.2f,\"tflops\":%.2f,"
                       "\"pct_gemm\":%.1f,\"floor_us\":%.2f,\"bf16_us\":%.2f,"
                       "\"bf16_tflops\":%.2f,\"graph\":%s}\n",
                       sh->model, sh->op, sh->k, sh->m, a.n, group, t * 1e6, tflops,
                       100.0 * tflops / fl->gemm_tflops, floor_us, tb * 1e6,
                       tb > 0 ? 2.0 * a.n * (double)welems / tb / 1e12 : 0.0,
                       graphed ? "true" : "false");
            } else if (!pass) {
                printf("%-10s %-8s %6d %6d %5d %6s %10.2f %8.1f %6.1f%%", sh->model, sh->op,
                       sh->k, sh->m, a.n, group == sh->k ? "k" : "128", t * 1e6, tflops,
                       100.0 * tflops / fl->gemm_tflops);
                if (tb > 0)
                    printf(" %10.2f %8.1f %6.2fx\n", tb * 1e6,
                           2.0 * a.n * (double)welems / tb / 1e12, tb / t);
                else
                    printf("\n");
            } else {
                printf("%-10s %-8s %6d %6d %5d %6s %10.2f %10.2f %7.1f%%  (floor, %% of it)\n",
                       sh->model, sh->op, sh->k, sh->m, a.n, group == sh->k ? "k" : "128",
                       t * 1e6, floor_us, 100.0 * floor_us / (t * 1e6));
            }
            fflush(stdout);
        }
    }
    rc = 0;
fail:
    for (int c = 0; c < a.copies; c++) o->fp8->weight_destroy(be->ctx, a.w[c]);
    o->free(be->ctx, wb);
    free(w8);
    free(scale);
    return rc;
}

static int bench_fp8(const bk_opts *opt, pd_backend *be, const bk_floor *fl)
{
    const pd_backend_ops *o = be->ops;
    if (!o->fp8) {
        fprintf(stderr, "pdserve-bench-kernels: this backend has no fp8 op set\n");
        return -1;
    }
    const int32_t n_max = 2048, k_max = 14336, m_max = 28672;
    void *x = rand_buf(be, PD_DTYPE_BF16, (size_t)n_max * k_max, 600, -1.0f, 1.0f);
    void *out = rand_buf(be, PD_DTYPE_BF16, (size_t)n_max * m_max, 601, -1.0f, 1.0f);
    int rc = x && out ? 0 : -1;
    if (!opt->json && rc == 0)
        printf("\n## fp8 (linear_fused of the fp8 op set, e4m3 weights, dynamic per-token "
               "e4m3 activations; group k = per-channel, 128 = 128 x 128 blocks)\n"
               "rows: us per call incl. the activation quantization, TFLOP/s, %% of the bf16 "
               "GEMM floor; then the bf16 linear's us, TFLOP/s and its time over fp8's;\n"
               "decode rows (n <= 8): us, the floor (weight + scale bytes / copy rate), %% of "
               "the floor reached\n"
               "%-10s %-8s %6s %6s %5s %6s %10s %8s %7s %10s %8s %7s\n",
               "model", "op", "k", "m", "n", "group", "us/call", "TFLOP/s", "%gemm", "bf16 us",
               "TFLOP/s", "speedup");
    for (size_t s = 0; rc == 0 && s < sizeof k_fp8_shapes / sizeof k_fp8_shapes[0]; s++)
        for (int gi = 0; rc == 0 && gi < 2; gi++)
            rc = bench_fp8_shape(opt, be, fl, &k_fp8_shapes[s], gi ? 128 : k_fp8_shapes[s].k, x,
                                 out);
    o->free(be->ctx, x);
    o->free(be->ctx, out);
    return rc;
}

/* ---- attention_decode ---- */

#define ATT_HEADS 16
#define ATT_KV_HEADS 8
#define ATT_HEAD_DIM 128
#define ATT_BLOCK 16
#define ATT_POOL_BLOCKS 16384 /* per cache: 16384 x 16 x 8 x 128 bf16 = 512 MiB each */

typedef struct {
    pd_attn_args a;       /* block_tables: set 0; the others follow */
    const pd_kv_ops *kv;  /* an FP8 cache's op set, or NULL: the backend's own op */
    const int32_t *bt;    /* [sets][batch][max_blocks] */
    int sets;
    size_t set_entries;   /* batch * max_blocks */
} att_arg;

/* A batch's block tables, context lengths and query offsets on the device. */
typedef struct {
    void *bt, *lens, *cu;
} att_tables;

static void att_tables_free(pd_backend *be, att_tables *t)
{
    be->ops->free(be->ctx, t->bt);
    be->ops->free(be->ctx, t->lens);
    be->ops->free(be->ctx, t->cu);
    memset(t, 0, sizeof *t);
}

/* seqs sequences of ctx tokens, the last q_len of each the queries; the block tables are the
 * first `entries` blocks (entries <= n_pool) of a fresh random order of the pool's n_pool
 * (perm), so that the tables of different sets are disjoint. Returns 0 or -1. */
static int att_tables_make(pd_backend *be, att_tables *t, int32_t *perm, int32_t n_pool,
                           size_t entries, int32_t seqs, int32_t ctx, int32_t q_len)
{
    const pd_backend_ops *o = be->ops;
    int32_t *lens = (int32_t *)malloc((size_t)seqs * sizeof(int32_t));
    int32_t *cu = (int32_t *)malloc(((size_t)seqs + 1) * sizeof(int32_t));
    int rc = -1;
    memset(t, 0, sizeof *t);
    if (!lens || !cu || entries > (size_t)n_pool) goto done;
    for (int32_t i = n_pool - 1; i > 0; i--) {
        const int32_t j = (int32_t)(rnd() % (uint64_t)(i + 1)), tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    for (int32_t i = 0; i < seqs; i++) lens[i] = ctx;
    for (int32_t i = 0; i <= seqs; i++) cu[i] = i * q_len;
    if (o->alloc(be->ctx, PD_DTYPE_I32, entries, &t->bt) != 0 ||
        o->alloc(be->ctx, PD_DTYPE_I32, (size_t)seqs, &t->lens) != 0 ||
        o->alloc(be->ctx, PD_DTYPE_I32, (size_t)seqs + 1, &t->cu) != 0 ||
        o->upload(be->ctx, t->bt, PD_DTYPE_I32, 0, perm, PD_DTYPE_I32, entries) != 0 ||
        o->upload(be->ctx, t->lens, PD_DTYPE_I32, 0, lens, PD_DTYPE_I32, seqs) != 0 ||
        o->upload(be->ctx, t->cu, PD_DTYPE_I32, 0, cu, PD_DTYPE_I32, seqs + 1) != 0)
        goto done;
    rc = 0;
done:
    free(lens);
    free(cu);
    if (rc != 0) att_tables_free(be, t);
    return rc;
}

/* The arguments every case shares: the tables, heads of ATT_HEAD_DIM (the queries' rows
 * packed), blocks of ATT_BLOCK (mb a sequence), no window, 1 / sqrt(head_dim), the FP8
 * cache's scales. */
static void att_args_init(pd_attn_args *a, const att_tables *d, int32_t heads, int32_t kv_heads,
                          int32_t mb)
{
    a->q_row_stride = (int64_t)heads * ATT_HEAD_DIM;
    a->cu_q = (const int32_t *)d->cu;
    a->ctx_lens = (const int32_t *)d->lens;
    a->block_tables = (const int32_t *)d->bt;
    a->max_blocks_per_seq = mb;
    a->n_heads = heads;
    a->n_kv_heads = kv_heads;
    a->head_dim = ATT_HEAD_DIM;
    a->block_size = ATT_BLOCK;
    a->sliding_window = 0;
    a->scale = 1.0f / sqrtf((float)ATT_HEAD_DIM);
    a->k_scale = 1.0f / 256;
    a->v_scale = 1.0f / 256;
}

static int att_call(pd_backend *be, void *arg, int i)
{
    const att_arg *t = (const att_arg *)arg;
    pd_attn_args a = t->a;
    a.block_tables = t->bt + (size_t)(i % t->sets) * t->set_entries;
    return t->kv ? t->kv->attention_decode(be->ctx, &a) : be->ops->attention_decode(be->ctx, &a);
}

static int bench_attention(const bk_opts *opt, pd_backend *be, const bk_floor *fl)
{
    static const struct { int32_t batch, ctx; bool unknown; } cases[] = {
        {256, 1024, false}, {256, 1024, true}, {1, 128, false},   {1, 1024, false},
        {1, 8192, false},   {32, 128, false},  {32, 1024, false},  {32, 8192, false},
        {128, 128, false},  {128, 512, false}, {128, 512, true},
    };
    const pd_backend_ops *o = be->ops;
    const size_t blk_elems = (size_t)ATT_BLOCK * ATT_KV_HEADS * ATT_HEAD_DIM;
    const int32_t q_dim = ATT_HEADS * ATT_HEAD_DIM;
    void *kc = rand_buf(be, PD_DTYPE_BF16, blk_elems * ATT_POOL_BLOCKS, 400, -1.0f, 1.0f);
    void *vc = rand_buf(be, PD_DTYPE_BF16, blk_elems * ATT_POOL_BLOCKS, 401, -1.0f, 1.0f);
    void *q = rand_buf(be, PD_DTYPE_BF16, (size_t)256 * q_dim, 402, -1.0f, 1.0f);
    void *out = rand_buf(be, PD_DTYPE_BF16, (size_t)256 * q_dim, 403, -1.0f, 1.0f);
    int32_t *perm = (int32_t *)malloc(ATT_POOL_BLOCKS * sizeof(int32_t));
    int rc = -1;
    if (!kc || !vc || !q || !out || !perm) goto done;
    for (int32_t i = 0; i < ATT_POOL_BLOCKS; i++) perm[i] = i;
    if (!opt->json)
        printf("\n## attention_decode (16 q heads, 8 KV heads, head_dim 128, blocks of 16, "
               "random block tables)\n%5s %7s %-12s %5s %10s %10s %9s %7s %s\n", "batch", "ctx",
               "max_ctx_len", "sets", "us/call", "KV MB", "KV GB/s", "%copy", "mode");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int32_t batch = cases[c].batch, ctx = cases[c].ctx;
        const int32_t mb = (ctx + ATT_BLOCK - 1) / ATT_BLOCK;
        const int32_t need = batch * mb;
        int sets = ATT_POOL_BLOCKS / need;
        if (sets > MAX_CALLS) sets = MAX_CALLS;
        const size_t entries = (size_t)need * sets;
        att_tables d;
        const bool ok =
            att_tables_make(be, &d, perm, ATT_POOL_BLOCKS, entries, batch, ctx, 1) == 0;
        att_arg t;
        memset(&t, 0, sizeof t);
        att_args_init(&t.a, &d, ATT_HEADS, ATT_KV_HEADS, mb);
        t.a.q = q;
        t.a.k_cache = kc;
        t.a.v_cache = vc;
        t.a.out = out;
        t.a.n_seqs = batch;
        t.a.n_tokens = batch;
        t.a.max_q_len = 1;
        t.a.max_ctx_len = cases[c].unknown ? 0 : ctx;
        t.bt = (const int32_t *)d.bt;
        t.sets = sets;
        t.set_entries = (size_t)need;
        const double kv_bytes = (double)batch * ctx * ATT_KV_HEADS * ATT_HEAD_DIM * 2 * 2;
        char mcl[16];
        snprintf(mcl, sizeof mcl, "%d", t.a.max_ctx_len);
        /* an op that refuses the case (max_ctx_len 0 before the kernel takes it) is n/a */
        const bool takes = ok && o->attention_decode(be->ctx, &t.a) == 0 && o->sync(be->ctx) == 0;
        double tm = -1;
        bool graphed = false;
        int calls = 0;
        if (takes) {
            calls = batch_calls(kv_bytes, sets);
            tm = time_batch(be, att_call, &t, calls, &graphed);
        }
        if (ok && tm > 0) {
            const double gbps = kv_bytes / tm / 1e9, pct = 100.0 * gbps / fl->copy_gbps;
            if (opt->json)
                printf("{\"bench\":\"attention_decode\",\"batch\":%d,\"ctx\":%d,"
                       "\"max_ctx_len\":%d,\"sets\":%d,\"us\":%.2f,\"kv_bytes\":%.0f,"
                       "\"kv_gbps\":%.1f,\"pct_copy\":%.1f,\"graph\":%s,\"calls\":%d}\n",
                       batch, ctx, t.a.max_ctx_len, sets, tm * 1e6, kv_bytes, gbps, pct,
                       graphed ? "true" : "false", calls);
            else
                printf("%5d %7d %-12s %5d %10.2f %10.1f %9.1f %6.1f%% %s\n", batch, ctx,
                       cases[c].unknown ? "0 (unknown)" : mcl, sets, tm * 1e6, kv_bytes / 1e6,
                       gbps, pct, graphed ? "graph" : "direct");
        } else if (opt->json) {
            printf("{\"bench\":\"attention_decode\",\"batch\":%d,\"ctx\":%d,\"max_ctx_len\":%d,"
                   "\"us\":null}\n", batch, ctx, t.a.max_ctx_len);
        } else {
            printf("%5d %7d %-12s %5d %10s\n", batch, ctx,
                   cases[c].unknown ? "0 (unknown)" : mcl, sets, "n/a");
        }
        fflush(stdout);
        (void)cudaGetLastError();
        att_tables_free(be, &d);
        if (!ok) goto done;
    }
    rc = 0;
done:
    o->free(be->ctx, kc);
    o->free(be->ctx, vc);
    o->free(be->ctx, q);
    o->free(be->ctx, out);
    free(perm);
    return rc;
}

/* ---- attention_decode, bf16 and FP8 KV caches (--kv-fp8) ---- */

#define KV8_POOL_BLOCKS 32768 /* per cache: batch 64 x 8192 once (1 GiB of bf16 each) */

/* An FP8 cache of n bytes holding random e4m3 values (no NaN), uploaded from host memory. */
static void *fp8_buf(pd_backend *be, size_t n)
{
    const size_t chunk = (size_t)16 << 20;
    uint8_t *h = (uint8_t *)malloc(chunk);
    void *p = NULL;
    if (!h || be->ops->alloc(be->ctx, PD_DTYPE_F8E4M3, n, &p) != 0) {
        fprintf(stderr, "pdserve-bench-kernels: alloc of %zu e4m3 bytes failed\n", n);
        free(h);
        return NULL;
    }
    for (size_t i = 0; i < chunk; i++) {
        uint8_t b = (uint8_t)(rnd() >> 56);
        if ((b & 0x7f) == 0x7f) b = 0x30; /* NaN -> 0.5 */
        h[i] = b;
    }
    for (size_t off = 0; off < n; off += chunk) {
        const size_t m = n - off < chunk ? n - off : chunk;
        if (be->ops->upload(be->ctx, p, PD_DTYPE_F8E4M3, off, h, PD_DTYPE_F8E4M3, m) != 0) {
            be->ops->free(be->ctx, p);
            p = NULL;
            break;
        }
    }
    free(h);
    return p;
}

/* One case at both cache types: the same q, block tables and contexts; each cache type its own
 * pool. Prints a row (or a JSON line per cache type). Returns 0 or -1. */
static int kv8_case(const bk_opts *opt, pd_backend *be, const bk_floor *fl, int32_t batch,
                    int32_t ctx, void *const pools[2][2], void *q, void *out, int32_t *perm)
{
    const pd_backend_ops *o = be->ops;
    const int32_t mb = (ctx + ATT_BLOCK - 1) / ATT_BLOCK, need = batch * mb;
    int sets = KV8_POOL_BLOCKS / need;
    if (sets > MAX_CALLS) sets = MAX_CALLS;
    const size_t entries = (size_t)need * sets;
    att_tables d = {NULL, NULL, NULL};
    int rc = -1;
    double us[2] = {-1, -1}, floor_us[2], kv_bytes[2];
    if (sets < 1 || att_tables_make(be, &d, perm, KV8_POOL_BLOCKS, entries, batch, ctx, 1) != 0)
        goto done;
    for (int f = 0; f < 2; f++) { /* 0: bf16, 1: FP8 */
        att_arg t;
        memset(&t, 0, sizeof t);
        t.kv = f ? o->kv_fp8 : NULL;
        att_args_init(&t.a, &d, ATT_HEADS, ATT_KV_HEADS, mb);
        t.a.q = q;
        t.a.k_cache = pools[f][0];
        t.a.v_cache = pools[f][1];
        t.a.out = out;
        t.a.n_seqs = t.a.n_tokens = batch;
        t.a.max_q_len = 1;
        t.a.max_ctx_len = ctx;
        t.bt = (const int32_t *)d.bt;
        t.sets = sets;
        t.set_entries = (size_t)need;
        kv_bytes[f] = (double)batch * ctx * ATT_KV_HEADS * ATT_HEAD_DIM * 2 * (f ? 1 : 2);
        floor_us[f] = kv_bytes[f] / (fl->copy_gbps * 1e9) * 1e6;
        const int first = t.kv ? t.kv->attention_decode(be->ctx, &t.a)
                               : o->attention_decode(be->ctx, &t.a);
        if (first != 0 || o->sync(be->ctx) != 0) {
            fprintf(stderr, "pdserve-bench-kernels: attention_decode (%s cache) failed\n",
                    f ? "fp8" : "bf16");
            goto done;
        }
        bool graphed = false;
        const int calls = batch_calls(kv_bytes[f], sets);
        const double tm = time_batch(be, att_call, &t, calls, &graphed);
        if (tm <= 0) goto done;
        us[f] = tm * 1e6;
        if (opt->json)
            printf("{\"bench\":\"attention_decode_kv\",\"cache\":\"%s\",\"batch\":%d,\"ctx\":%d,"
                   "\"us\":%.2f,\"kv_bytes\":%.0f,\"floor_us\":%.2f,\"pct_floor\":%.1f,"
                   "\"graph\":%s,\"calls\":%d}\n",
                   f ? "fp8" : "bf16", batch, ctx, us[f], kv_bytes[f], floor_us[f],
                   100.0 * floor_us[f] / us[f], graphed ? "true" : "false", calls);
    }
    if (!opt->json)
        printf("%5d %7d %10.2f %10.2f %6.1f%% %10.2f %10.2f %6.1f%% %8.2fx\n", batch, ctx, us[0],
               floor_us[0], 100.0 * floor_us[0] / us[0], us[1], floor_us[1],
               100.0 * floor_us[1] / us[1], us[0] / us[1]);
    fflush(stdout);
    rc = 0;
done:
    (void)cudaGetLastError();
    att_tables_free(be, &d);
    return rc;
}

static int bench_attention_kv8(const bk_opts *opt, pd_backend *be, const bk_floor *fl)
{
    static const int32_t batches[3] = {1, 32, 64}, ctxs[2] = {1024, 8192};
    const pd_backend_ops *o = be->ops;
    if (!o->kv_fp8) {
        fprintf(stderr, "pdserve-bench-kernels: --kv-fp8: the backend has no FP8 KV ops\n");
        return -1;
    }
    const size_t blk_elems = (size_t)ATT_BLOCK * ATT_KV_HEADS * ATT_HEAD_DIM;
    const size_t n = blk_elems * KV8_POOL_BLOCKS;
    const int32_t q_dim = ATT_HEADS * ATT_HEAD_DIM;
    void *pools[2][2] = {{rand_buf(be, PD_DTYPE_BF16, n, 410, -1.0f, 1.0f),
                          rand_buf(be, PD_DTYPE_BF16, n, 411, -1.0f, 1.0f)},
                         {fp8_buf(be, n), fp8_buf(be, n)}};
    void *q = rand_buf(be, PD_DTYPE_BF16, (size_t)64 * q_dim, 412, -1.0f, 1.0f);
    void *out = rand_buf(be, PD_DTYPE_BF16, (size_t)64 * q_dim, 413, -1.0f, 1.0f);
    int32_t *perm = (int32_t *)malloc(KV8_POOL_BLOCKS * sizeof(int32_t));
    int rc = -1;
    if (!pools[0][0] || !pools[0][1] || !pools[1][0] || !pools[1][1] || !q || !out || !perm)
        goto done;
    for (int32_t i = 0; i < KV8_POOL_BLOCKS; i++) perm[i] = i;
    if (!opt->json)
        printf("\n## attention_decode, bf16 vs FP8 KV cache (16 q heads, 8 KV heads, head_dim "
               "128, blocks of 16; floor = KV bytes / copy rate)\n%5s %7s %10s %10s %7s %10s "
               "%10s %7s %9s\n", "batch", "ctx", "bf16 us", "floor us", "%floor", "fp8 us",
               "floor us", "%floor", "speed-up");
    for (int b = 0; b < 3; b++)
        for (int c = 0; c < 2; c++)
            if (kv8_case(opt, be, fl, batches[b], ctxs[c], pools, q, out, perm) != 0) goto done;
    rc = 0;
done:
    for (int f = 0; f < 2; f++)
        for (int k = 0; k < 2; k++) o->free(be->ctx, pools[f][k]);
    o->free(be->ctx, q);
    o->free(be->ctx, out);
    free(perm);
    return rc;
}

/* ---- attention_prefill (--prefill-attention) ---- */

#define PA_HEADS 32
#define PA_KV_HEADS 8
#define PA_POOL_BLOCKS 4096 /* per cache: 4096 x 16 x 8 x 128 = 64 Mi elements */
#define PA_MAX_TOKENS 16384

static int pa_call(pd_backend *be, void *arg, int i)
{
    (void)i;
    const att_arg *t = (const att_arg *)arg;
    return t->kv ? t->kv->attention_prefill(be->ctx, &t->a)
                 : be->ops->attention_prefill(be->ctx, &t->a);
}

/* One prompt shape (seqs x len fresh tokens) at both cache types. Returns 0 or -1. */
static int pa_case(const bk_opts *opt, pd_backend *be, const bk_floor *fl, int32_t seqs,
                   int32_t len, void *const pools[2][2], void *q, void *out, int32_t *perm)
{
    const pd_backend_ops *o = be->ops;
    const int32_t mb = (len + ATT_BLOCK - 1) / ATT_BLOCK, need = seqs * mb;
    att_tables d = {NULL, NULL, NULL};
    double us[2] = {-1, -1};
    int rc = -1;
    /* each query sees its own position's keys: len (len + 1) / 2 a sequence */
    const double flops =
        4.0 * ATT_HEAD_DIM * PA_HEADS * (double)seqs * (double)len * (len + 1) / 2.0;
    if (seqs * len > PA_MAX_TOKENS ||
        att_tables_make(be, &d, perm, PA_POOL_BLOCKS, (size_t)need, seqs, len, len) != 0)
        goto done;
    for (int f = 0; f < 2; f++) { /* 0: bf16, 1: FP8 */
        att_arg t;
        memset(&t, 0, sizeof t);
        t.kv = f ? o->kv_fp8 : NULL;
        if (f && !t.kv) break; /* no FP8 cache ops: the bf16 row alone */
        att_args_init(&t.a, &d, PA_HEADS, PA_KV_HEADS, mb);
        t.a.q = q;
        t.a.k_cache = pools[f][0];
        t.a.v_cache = pools[f][1];
        t.a.out = out;
        t.a.n_seqs = seqs;
        t.a.n_tokens = seqs * len;
        t.a.max_q_len = len;
        t.a.max_ctx_len = len;
        if (pa_call(be, &t, 0) != 0 || o->sync(be->ctx) != 0) {
            fprintf(stderr, "pdserve-bench-kernels: attention_prefill (%s cache) failed\n",
                    f ? "fp8" : "bf16");
            goto done;
        }
        bool graphed = false;
        const double tm = time_batch(be, pa_call, &t, 4, &graphed);
        if (tm <= 0) goto done;
        us[f] = tm * 1e6;
        if (opt->json)
            printf("{\"bench\":\"attention_prefill\",\"cache\":\"%s\",\"seqs\":%d,"
                   "\"len\":%d,\"us\":%.1f,\"tflops\":%.1f,\"pct_gemm\":%.1f,"
                   "\"graph\":%s}\n",
                   f ? "fp8" : "bf16", seqs, len, us[f], flops / tm / 1e12,
                   100.0 * flops / tm / 1e12 / fl->gemm_tflops, graphed ? "true" : "false");
    }
    if (!opt->json) {
        printf("%5d %6d %10.1f %8.1f %6.1f%%", seqs, len, us[0], flops / us[0] / 1e6,
               100.0 * flops / us[0] / 1e6 / fl->gemm_tflops);
        if (us[1] > 0)
            printf(" %10.1f %8.1f %6.1f%%", us[1], flops / us[1] / 1e6,
                   100.0 * flops / us[1] / 1e6 / fl->gemm_tflops);
        printf("\n");
    }
    fflush(stdout);
    rc = 0;
done:
    (void)cudaGetLastError();
    att_tables_free(be, &d);
    return rc;
}

static int bench_prefill_attention(const bk_opts *opt, pd_backend *be, const bk_floor *fl)
{
    static const int32_t shapes[][2] = {{1, 512}, {1, 1024}, {1, 2048}, {8, 2048}, {1, 8192},
                                        {32, 512}};
    const pd_backend_ops *o = be->ops;
    const size_t n = (size_t)ATT_BLOCK * PA_KV_HEADS * ATT_HEAD_DIM * PA_POOL_BLOCKS;
    const size_t q_elems = (size_t)PA_MAX_TOKENS * PA_HEADS * ATT_HEAD_DIM;
    void *pools[2][2] = {{rand_buf(be, PD_DTYPE_BF16, n, 420, -1.0f, 1.0f),
                          rand_buf(be, PD_DTYPE_BF16, n, 421, -1.0f, 1.0f)},
                         {o->kv_fp8 ? fp8_buf(be, n) : NULL, o->kv_fp8 ? fp8_buf(be, n) : NULL}};
    void *q = rand_buf(be, PD_DTYPE_BF16, q_elems, 422, -1.0f, 1.0f);
    void *out = rand_buf(be, PD_DTYPE_BF16, q_elems, 423, -1.0f, 1.0f);
    int32_t *perm = (int32_t *)malloc(PA_POOL_BLOCKS * sizeof(int32_t));
    int rc = -1;
    if (!pools[0][0] || !pools[0][1] || (o->kv_fp8 && (!pools[1][0] || !pools[1][1])) || !q ||
        !out || !perm)
        goto done;
    for (int32_t i = 0; i < PA_POOL_BLOCKS; i++) perm[i] = i;
    if (!opt->json)
        printf("\n## attention_prefill, fresh causal prompts (32 q heads, 8 KV heads, head_dim "
               "128, blocks of 16; %% of the GEMM rate %.1f TFLOP/s)\n%5s %6s %10s %8s %7s %10s "
               "%8s %7s\n", fl->gemm_tflops, "seqs", "len", "bf16 us", "TFLOP/s", "%gemm",
               "fp8 us", "TFLOP/s", "%gemm");
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++)
        if (pa_case(opt, be, fl, shapes[c][0], shapes[c][1], pools, q, out, perm) != 0)
            goto done;
    rc = 0;
done:
    for (int f = 0; f < 2; f++)
        for (int k = 0; k < 2; k++)
            if (pools[f][k]) o->free(be->ctx, pools[f][k]);
    o->free(be->ctx, q);
    o->free(be->ctx, out);
    free(perm);
    return rc;
}

/* ---- sample ---- */

static int bench_sample(const bk_opts *opt, pd_backend *be)
{
    static const int32_t rows_n[] = {1, 32, 256};
    const int32_t vocab = 151936, n_max = 256;
    const pd_backend_ops *o = be->ops;
    if (!o->sample) {
        if (opt->json) printf("{\"bench\":\"sample\",\"us\":null}\n");
        else printf("\n## sample\nn/a (the backend offers no sample op)\n");
        return 0;
    }
    const size_t elems = (size_t)n_max * vocab;
    void *logits = rand_buf(be, o->act_dtype, elems, 500, -10.0f, 10.0f);
    void *pristine = rand_buf(be, o->act_dtype, elems, 501, -10.0f, 10.0f);
    pd_sample_row *rows = (pd_sample_row *)calloc((size_t)n_max, sizeof *rows);
    int32_t *tokens = (int32_t *)malloc((size_t)n_max * sizeof(int32_t));
    const size_t esize = pd_dtype_size(o->act_dtype);
    int rc = -1;
    if (!logits || !pristine || !rows || !tokens) goto fail;
    BK_OP(o->sync(be->ctx));
    if (!opt->json)
        printf("\n## sample (rows of %d random logits in [-10, 10); logits restored before "
               "each call, not timed)\n%5s %-34s %10s %10s %9s\n", vocab, "rows", "mode",
               "us/call", "us/row", "GB/s");
    for (int mode = 0; mode < 2; mode++) {
        for (size_t c = 0; c < sizeof rows_n / sizeof rows_n[0]; c++) {
            const int32_t n = rows_n[c];
            for (int32_t i = 0; i < n; i++) {
                pd_sample_row *r = &rows[i];
                memset(r, 0, sizeof *r);
                r->temperature = mode ? 1.0f : 0.0f;
                r->top_p = mode ? 0.9f : 1.0f;
                r->min_p = 0.0f;
                r->repetition_penalty = 1.0f;
                r->top_k = mode ? 50 : 0;
                r->n_output = i;
                r->seed = 1000 + (uint64_t)i;
            }
            double t[20];
            int err = 0;
            for (int r = -3; r < 20 && !err; r++) {
                BK_CUDA(cudaMemcpy(logits, pristine, (size_t)n * vocab * esize,
                                   cudaMemcpyDeviceToDevice));
                BK_CUDA(cudaDeviceSynchronize());
                const double t0 = now_s();
                err = o->sample(be->ctx, logits, n, vocab, rows, NULL, 0, tokens, NULL, NULL);
                if (r >= 0) t[r] = now_s() - t0;
            }
            const char *mname = mode ? "temperature 1, top-p 0.9, top-k 50" : "greedy";
            if (err) {
                if (opt->json)
                    printf("{\"bench\":\"sample\",\"rows\":%d,\"mode\":\"%s\",\"us\":null,"
                           "\"error\":\"%s\"}\n", n, mname, pd_strerror(err));
                else
                    printf("%5d %-34s n/a (%s)\n", n, mname, pd_strerror(err));
                continue;
            }
            const double tm = median(t, 20);
            const double gbps = (double)n * vocab * esize / tm / 1e9;
            if (opt->json)
                printf("{\"bench\":\"sample\",\"rows\":%d,\"mode\":\"%s\",\"us\":%.2f,"
                       "\"us_per_row\":%.2f,\"logits_gbps\":%.1f}\n", n, mname, tm * 1e6,
                       tm * 1e6 / n, gbps);
            else
                printf("%5d %-34s %10.2f %10.2f %9.1f\n", n, mname, tm * 1e6, tm * 1e6 / n, gbps);
            fflush(stdout);
        }
    }
    rc = 0;
fail:
    o->free(be->ctx, logits);
    o->free(be->ctx, pristine);
    free(rows);
    free(tokens);
    return rc;
}

/* ---- the communicator (--all-reduce) ---- */

typedef struct {
    pd_backend *be;
    pd_comm *comm;
    int32_t rank;
    void *buf;
    size_t n;                   /* elements this case */
    int calls;                  /* all-reduces per timed batch */
    bool graph;                 /* captured (else direct calls) */
    pthread_barrier_t *bar;     /* all ranks start each batch together */
    double secs;                /* out: median seconds per call */
    int rc;                     /* out */
} ar_rank;

static void *ar_thread(void *arg)
{
    ar_rank *a = (ar_rank *)arg;
    const pd_backend_ops *o = a->be->ops;
    const pd_comm_ops *c = a->comm->ops;
    const pd_dtype t = o->act_dtype;
    void *g = NULL;
    double tm[REPEATS];
    int rc = 0;
    if (a->graph) {
        rc = o->graph_begin(a->be->ctx);
        for (int i = 0; i < a->calls && rc == 0; i++)
            rc = c->all_reduce_sum(a->comm->ctx, a->rank, a->buf, t, a->n);
        const int end = rc == 0 ? o->graph_end(a->be->ctx, &g) : 0;
        if (rc == 0) rc = end;
    }
    /* Every rank runs every batch, failed or not, so that no rank waits at the barrier for a
     * rank that left (a failure is reported at the end). */
    for (int r = -1; r < REPEATS; r++) {
        pthread_barrier_wait(a->bar);
        if (rc == 0) rc = o->sync(a->be->ctx);
        pthread_barrier_wait(a->bar);
        const double t0 = now_s();
        if (rc == 0 && a->graph) rc = o->graph_launch(a->be->ctx, g);
        for (int i = 0; i < a->calls && rc == 0 && !a->graph; i++)
            rc = c->all_reduce_sum(a->comm->ctx, a->rank, a->buf, t, a->n);
        if (rc == 0) rc = o->sync(a->be->ctx);
        if (rc != 0) c->abort(a->comm->ctx); /* the other ranks would wait for this one */
        if (r >= 0) tm[r] = (now_s() - t0) / a->calls;
    }
    if (g) o->graph_destroy(a->be->ctx, g);
    a->secs = median(tm, REPEATS);
    a->rc = rc;
    return NULL;
}

static int bench_all_reduce(const bk_opts *opt)
{
    enum { MAX_R = 16 };
    const int32_t R = opt->all_reduce;
    int ndev = 0;
    if (R < 2 || R > MAX_R) {
        fprintf(stderr, "pdserve-bench-kernels: --all-reduce needs 2 .. %d ranks\n", MAX_R);
        return -1;
    }
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < R) {
        fprintf(stderr, "pdserve-bench-kernels: --all-reduce %d: %d CUDA devices here\n", R, ndev);
        return -1;
    }
    /* bytes of bf16: 4 KiB (a 2048-hidden row) .. 256 MiB; 16 KiB is one decode row of a
     * 8192-hidden model (Llama-3-70B), 8 KiB of a 4096-hidden one (Llama-3-8B) */
    static const size_t sizes[] = {4096, 8192, 16384, 65536, 262144, 1048576, 4194304,
                                   16777216, 67108864, 268435456};
    const size_t n_sizes = sizeof sizes / sizeof sizes[0];
    pd_backend *be[MAX_R] = {NULL};
    void *buf[MAX_R] = {NULL};
    pd_comm *comm = NULL;
    char err[PD_ERR_LEN] = "";
    int rc = -1;
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)R);
    for (int32_t r = 0; r < R; r++) {
        pd_backend_params bp = pd_backend_default_params();
        bp.device = r;
        if (pd_backend_create("cuda", &bp, &be[r], err) < 0) {
            fprintf(stderr, "pdserve-bench-kernels: device %d: %s\n", r, err);
            goto fail;
        }
        buf[r] = rand_buf(be[r], be[r]->ops->act_dtype, sizes[n_sizes - 1] / 2, 700 + (uint64_t)r,
                          -1.0f, 1.0f);
        if (!buf[r]) goto fail;
    }
    if (pd_comm_create(be, R, &comm, err) < 0) {
        fprintf(stderr, "pdserve-bench-kernels: the communicator: %s\n", err);
        goto fail;
    }
    if (!opt->json)
        printf("\n## all_reduce_sum, bf16, %d ranks (%s; the slowest rank's median of %d "
               "batches)\n%10s %12s %12s %12s %12s\n", R, comm->ops->name, REPEATS, "bytes",
               "eager us", "eager busbw", "graph us", "graph busbw");
    for (size_t s = 0; s < n_sizes; s++) {
        const size_t bytes = sizes[s], n = bytes / 2;
        /* about 1 GiB of buffers a batch, 20 .. 200 calls (the graph holds them all) */
        int calls = (int)(((size_t)1 << 30) / bytes);
        if (calls > 200) calls = 200;
        if (calls < 20) calls = 20;
        double us[2] = {0, 0};
        for (int gmode = 0; gmode < 2; gmode++) {
            ar_rank a[MAX_R];
            pthread_t th[MAX_R];
            for (int32_t r = 0; r < R; r++) {
                a[r] = ar_rank{be[r], comm, r, buf[r], n, calls, gmode == 1, &bar, 0.0, 0};
                if (r > 0) pthread_create(&th[r], NULL, ar_thread, &a[r]);
            }
            ar_thread(&a[0]);
            for (int32_t r = 1; r < R; r++) pthread_join(th[r], NULL);
            double worst = 0;
            for (int32_t r = 0; r < R; r++) {
                if (a[r].rc != 0) {
                    fprintf(stderr, "pdserve-bench-kernels: all_reduce_sum of %zu bytes (%s) "
                            "failed on rank %d: %s\n", bytes, gmode ? "graph" : "eager", r,
                            pd_strerror(a[r].rc));
                    goto fail;
                }
                if (a[r].secs > worst) worst = a[r].secs;
            }
            us[gmode] = worst * 1e6;
        }
        const double f = 2.0 * (R - 1) / R;
        if (opt->json)
            printf("{\"bench\":\"all_reduce\",\"ranks\":%d,\"bytes\":%zu,\"eager_us\":%.2f,"
                   "\"eager_busbw_gbps\":%.2f,\"graph_us\":%.2f,\"graph_busbw_gbps\":%.2f}\n",
                   R, bytes, us[0], f * bytes / us[0] / 1e3, us[1], f * bytes / us[1] / 1e3);
        else
            printf("%10zu %12.2f %12.2f %12.2f %12.2f\n", bytes, us[0], f * bytes / us[0] / 1e3,
                   us[1], f * bytes / us[1] / 1e3);
        fflush(stdout);
    }
    rc = 0;
fail:
    pd_comm_destroy(comm);
    for (int32_t r = 0; r < R; r++) {
        if (buf[r]) be[r]->ops->free(be[r]->ctx, buf[r]);
        pd_backend_destroy(be[r]);
    }
    pthread_barrier_destroy(&bar);
    return rc;
}

int main(int argc, char **argv)
{
    bk_opts opt;
    memset(&opt, 0, sizeof opt);
    bool any = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--floor")) {
            opt.floor = any = true;
        } else if (!strcmp(a, "--linear")) {
            opt.linear = any = true;
        } else if (!strcmp(a, "--attention")) {
            opt.attention = any = true;
        } else if (!strcmp(a, "--kv-fp8")) {
            opt.kv_fp8 = any = true;
        } else if (!strcmp(a, "--prefill-attention")) {
            opt.prefill = any = true;
        } else if (!strcmp(a, "--sample")) {
            opt.sample = any = true;
        } else if (!strcmp(a, "--fp8")) {
            opt.fp8 = any = true;
        } else if (!strcmp(a, "--all")) {
            opt.floor = opt.linear = opt.attention = opt.sample = any = true;
        } else if (!strcmp(a, "--all-reduce") && i + 1 < argc) {
            char *end = NULL;
            const long r = strtol(argv[++i], &end, 10);
            if (!*argv[i] || *end || r < 2 || r > 16) {
                fprintf(stderr, "pdserve-bench-kernels: bad --all-reduce '%s' (2 .. 16 ranks)\n",
                        argv[i]);
                return 2;
            }
            opt.all_reduce = (int)r;
            any = true;
        } else if (!strcmp(a, "--json")) {
            opt.json = true;
        } else if (!strcmp(a, "--device") && i + 1 < argc) {
            char *end = NULL;
            const long d = strtol(argv[++i], &end, 10);
            if (!*argv[i] || *end || d < 0 || d > 1024) {
                fprintf(stderr, "pdserve-bench-kernels: bad --device '%s'\n", argv[i]);
                return 2;
            }
            opt.device = (int)d;
        } else {
            fprintf(stderr, "pdserve-bench-kernels: unknown argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!any) opt.floor = opt.linear = opt.attention = opt.sample = true;

    char err[PD_ERR_LEN] = "";
    pd_backend_params bp = pd_backend_default_params();
    bp.device = opt.device;
    pd_backend *be = NULL;
    if (pd_backend_create("cuda", &bp, &be, err) < 0) {
        fprintf(stderr, "pdserve-bench-kernels: %s\n", err);
        return 1;
    }
    cudaDeviceProp prop;
    int driver = 0, runtime = 0;
    if (cudaGetDeviceProperties(&prop, opt.device) != cudaSuccess ||
        cudaDriverGetVersion(&driver) != cudaSuccess ||
        cudaRuntimeGetVersion(&runtime) != cudaSuccess) {
        fprintf(stderr, "pdserve-bench-kernels: cannot read device %d's properties\n",
                opt.device);
        pd_backend_destroy(be);
        return 1;
    }
    if (opt.json)
        printf("{\"bench\":\"device\",\"name\":\"%s\",\"sm\":\"%d.%d\",\"sms\":%d,"
               "\"l2_bytes\":%d,\"mem_bytes\":%zu,\"driver\":%d,\"runtime\":%d}\n",
               prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize,
               prop.totalGlobalMem, driver, runtime);
    else
        printf("device %d: %s (sm_%d%d, %d SMs, %.0f MB L2, %.1f GiB), driver %d, runtime %d\n",
               opt.device, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
               prop.l2CacheSize / 1e6, (double)prop.totalGlobalMem / (1 << 30), driver, runtime);

    int rc = 0;
    bk_floor fl = {0, 0};
    if (bench_floor(&opt, be, &fl) != 0) rc = 1;
    if (rc == 0 && opt.linear && bench_linear(&opt, be, &fl) != 0) rc = 1;
    if (rc == 0 && opt.attention && bench_attention(&opt, be, &fl) != 0) rc = 1;
    if (rc == 0 && opt.kv_fp8 && bench_attention_kv8(&opt, be, &fl) != 0) rc = 1;
    if (rc == 0 && opt.prefill && bench_prefill_attention(&opt, be, &fl) != 0) rc = 1;
    if (rc == 0 && opt.sample && bench_sample(&opt, be) != 0) rc = 1;
    if (rc == 0 && opt.fp8 && bench_fp8(&opt, be, &fl) != 0) rc = 1;
    if (rc == 0 && opt.all_reduce && bench_all_reduce(&opt) != 0) rc = 1;
    if (fl.copy_gbps > 0) printf("FLOOR copy_gbps=%.1f gemm_tflops=%.1f\n", fl.copy_gbps,
                                 fl.gemm_tflops);
    pd_backend_destroy(be);
    return rc;
}
