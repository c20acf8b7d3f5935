/* cuda_fp8_linear.cu -- The CUDA backend's FP8 weight op set (pd_wq_ops "fp8"): weights kept as
 * e4m3 bytes with f32 scales on the device, and linear_fused over them. The input rows (normed
 * first when norm_w is set) are quantized by pd_fp8_quant_row's rule (cuda_fp8_quant.cu), then:
 *   n <= PD_FP8_GEMV_MAX_N (decode): the weight-streaming kernel (cuda_fp8_gemv.cu), with the
 *     bias, residual add and SwiGLU in its one launch; weight-only (PD_ACT_NONE) weights take
 *     the bf16 rows as they are;
 *   larger n: cuBLASLt's FP8 GEMM (e4m3 x e4m3, f32 accumulation, bf16 out; both operands
 *     K-major), scales per output channel x per token (OUTER_VEC_32F, group k) or 128 x 128
 *     weight blocks x 1 x 128 input groups (BLK128x128_32F x VEC128_32F, group 128); where it
 *     refuses a product (shape, alignment, a scale mode the library or GPU has not), the tiled
 *     kernel of cuda_fp8_gemv.cu, logged once. Weight-only weights are dequantized to bf16
 *     into a workspace and go through the backend's bf16 linear_fused.
 * Nothing in linear_fused synchronises or allocates once its workspaces are large enough:
 * weight_create reserves them for WS_ROWS input rows (and the dequantized weight); a larger n
 * outside a capture grows them (after the stream's queued work), inside a capture it fails. */
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_fp8.cuh"
#include "kernels/cuda/cuda_fp8_moe.cuh"

#define LT_WS_BYTES ((size_t)32 << 20) /* cuBLASLt's workspace (its Hopper recommendation) */
#define WS_ROWS 512                     /* input rows the quantized-input workspace starts at */
#define WS_MOE_ROWS 4096                /* ... for stacked experts: choices (n k) */

/* The op set's per-context state (pd_cuda_ctx.fp8_state). */
typedef struct {
    cublasLtHandle_t lt;
    void *lt_ws;           /* LT_WS_BYTES */
    uint8_t *xq;           /* quantized input rows [n][k] */
    size_t xq_bytes;
    float *xs;             /* their scales [ng][n] */
    size_t xs_bytes;
    bf16 *wdq;             /* a weight-only weight dequantized [m][k] */
    size_t wdq_bytes;
    /* Workspaces outgrown: kept until the context goes, as a CUDA graph captured before the
     * growth (a decode step's) still names them and reads them at every replay. */
    void *retired[64];
    int n_retired;
} fp8_state;

extern "C" void pd_cuda__fp8_free(void *state)
{
    fp8_state *st = (fp8_state *)state;
    if (!st) return;
    if (st->lt) (void)cublasLtDestroy(st->lt);
    if (st->lt_ws) (void)cudaFree(st->lt_ws);
    if (st->xq) (void)cudaFree(st->xq);
    if (st->xs) (void)cudaFree(st->xs);
    if (st->wdq) (void)cudaFree(st->wdq);
    for (int i = 0; i < st->n_retired; i++) (void)cudaFree(st->retired[i]);
    free(st);
}

static int state_get(pd_cuda_ctx *c, fp8_state **out)
{
    if (c->fp8_state) {
        *out = (fp8_state *)c->fp8_state;
        return 0;
    }
    fp8_state *st = (fp8_state *)calloc(1, sizeof *st);
    if (!st) return PD_ENOMEM;
    cublasStatus_t s = cublasLtCreate(&st->lt);
    cudaError_t e = cudaSuccess;
    if (s == CUBLAS_STATUS_SUCCESS) e = cudaMalloc(&st->lt_ws, LT_WS_BYTES);
    if (s != CUBLAS_STATUS_SUCCESS || e != cudaSuccess) {
        if (s != CUBLAS_STATUS_SUCCESS)
            pd_cuda__report("cublasLtCreate", cublasGetStatusString(s), __FILE__, __LINE__);
        else
            pd_cuda__report("cudaMalloc(lt_ws)", cudaGetErrorString(e), __FILE__, __LINE__);
        pd_cuda__fp8_free(st);
        return e == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EBACKEND;
    }
    c->fp8_state = st;
    *out = st;
    return 0;
}

/* Whether a per-channel x per-token product of row length k takes cuBLASLt's FP8 fast
 * accumulation (the tensor cores' own accumulator throughout, without the periodic promotion
 * to f32: faster, as vLLM's Hopper FP8 GEMMs run, but its error grows with k):
 * k <= PDSERVE_CUDA_FP8_FAST_ACCUM_MAX_K (default 4096, read once; 0 never). At k 8192 and
 * 14336 it broke test_cuda_fp8's error bound (docs/perf-history.md, "FP8 prefill: the
 * activation quantization, fast accumulation"); block-wise products always promote (their
 * scales apply per k block). */
static int8_t fast_accum(int32_t k)
{
    static const int64_t max_k = pd_env_int("PDSERVE_CUDA_FP8_FAST_ACCUM_MAX_K");
    return (int8_t)(k <= max_k);
}

/* Makes the workspace *buf (*have bytes) at least `bytes`. Outside a capture only. The old
 * buffer is not freed but retired until the context goes: graphs captured before (decode
 * steps, whose rows are few) name it and read it at every replay, after this growth too
 * (freeing it was an illegal access at the next replay once a long prompt had grown it).
 * It at least doubles, so few are retired. Returns 0, PD_ENOMEM, PD_EBACKEND (inside a
 * capture, logged: run the shape once outside first). */
static int ws_grow(pd_cuda_ctx *c, fp8_state *st, void **buf, size_t *have, size_t bytes,
                   const char *what)
{
    if (bytes <= *have) return 0;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    PD_CUDA_CHECK(cudaStreamIsCapturing(c->stream, &cs));
    if (cs != cudaStreamCaptureStatusNone) {
        PD_LOGE("cuda fp8: the %s workspace (%zu bytes) would have to grow to %zu inside a graph "
                "capture; run this many rows once outside a capture first", what, *have, bytes);
        return PD_EBACKEND;
    }
    if (*buf && st->n_retired == (int)(sizeof st->retired / sizeof st->retired[0])) {
        PD_LOGE("cuda fp8: the %s workspace grew too often", what);
        return PD_ENOMEM;
    }
    if (bytes < 2 * *have) bytes = 2 * *have;
    void *nb = NULL;
    PD_CUDA_CHECK(cudaMalloc(&nb, bytes));
    if (*buf) st->retired[st->n_retired++] = *buf;
    *buf = nb;
    *have = bytes;
    return 0;
}

/* The quantized-input workspace for n rows of w's width. */
static int ws_input(pd_cuda_ctx *c, fp8_state *st, const pd_fp8_weight *w, int32_t n)
{
    int rc = ws_grow(c, st, (void **)&st->xq, &st->xq_bytes, (size_t)n * w->k, "input");
    if (rc < 0) return rc;
    return ws_grow(c, st, (void **)&st->xs, &st->xs_bytes, (size_t)n * w->ng * sizeof(float),
                   "input scale");
}

extern "C" void pd_cuda__fp8_weight_destroy(void *ctx, void *wp)
{
    pd_fp8_weight *w = (pd_fp8_weight *)wp;
    if (!w) return;
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    (void)cudaStreamSynchronize(c->stream); /* queued products may still read it */
    if (w->w8) (void)cudaFree(w->w8);
    if (w->scale) (void)cudaFree(w->scale);
    if (w->blk_scale) (void)cudaFree(w->blk_scale);
    free(w);
}

extern "C" size_t pd_cuda__fp8_weight_bytes(void *ctx, const void *w)
{
    (void)ctx;
    return w ? ((const pd_fp8_weight *)w)->bytes : 0;
}

/* Group 128: whether every 128-row band repeats its first row's scales (block-wise
 * checkpoints), and if so those rows as [ceil(m / 128)][ng] in *blk (caller frees). */
static int compress_blocks(const pd_qweight_desc *d, int32_t ng, float **blk)
{
    *blk = NULL;
    const int32_t bands = (d->m + 127) / 128;
    for (int32_t i = 0; i < d->m; i++)
        for (int32_t g = 0; g < ng; g++)
            if (d->scale[(size_t)i * ng + g] != d->scale[(size_t)(i / 128 * 128) * ng + g])
                return 0;
    float *b = (float *)malloc((size_t)bands * ng * sizeof(float));
    if (!b) return PD_ENOMEM;
    for (int32_t r = 0; r < bands; r++)
        for (int32_t g = 0; g < ng; g++)
            b[(size_t)r * ng + g] = d->scale[(size_t)r * 128 * ng + g];
    *blk = b;
    return 0;
}

extern "C" int pd_cuda__fp8_weight_create(void *ctx, const pd_qweight_desc *d, void **out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!out) return PD_EINVAL;
    *out = NULL;
    if (!d || !d->w8 || !d->scale || d->m <= 0 || d->k <= 0 || d->group <= 0 ||
        (d->act != PD_ACT_NONE && d->act != PD_ACT_DYNAMIC && d->act != PD_ACT_STATIC) ||
        (d->act == PD_ACT_STATIC && !(d->in_scale > 0.0f && isfinite(d->in_scale))))
        return PD_EINVAL;
    const int32_t ng = (d->k + d->group - 1) / d->group;
    const size_t n_scale = (size_t)d->m * ng;
    for (size_t i = 0; i < n_scale; i++)
        if (!(d->scale[i] > 0.0f && isfinite(d->scale[i]))) return PD_EINVAL;
    fp8_state *st = NULL;
    int rc = state_get(c, &st);
    if (rc < 0) return rc;

    float *blk = NULL;
    pd_fp8_weight *w = (pd_fp8_weight *)calloc(1, sizeof *w);
    if (!w) return PD_ENOMEM;
    w->m = d->m;
    w->k = d->k;
    w->group = d->group;
    w->ng = ng;
    w->act = d->act;
    w->in_scale = d->in_scale;
    const size_t wbytes = (size_t)d->m * d->k, sbytes = n_scale * sizeof(float);
    cudaError_t e = cudaMalloc((void **)&w->w8, wbytes);
    if (e == cudaSuccess) e = cudaMalloc((void **)&w->scale, sbytes);
    if (e == cudaSuccess) e = cudaMemcpy(w->w8, d->w8, wbytes, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(w->scale, d->scale, sbytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) goto cuda_fail;
    w->bytes = wbytes + sbytes;
    if (d->group == 128 && ng > 1) {
        rc = compress_blocks(d, ng, &blk);
        if (rc < 0) goto fail;
        if (blk) {
            const size_t bb = (size_t)((d->m + 127) / 128) * ng * sizeof(float);
            e = cudaMalloc((void **)&w->blk_scale, bb);
            if (e == cudaSuccess) e = cudaMemcpy(w->blk_scale, blk, bb, cudaMemcpyHostToDevice);
            if (e != cudaSuccess) goto cuda_fail;
            w->bytes += bb;
        } else {
            PD_LOGI("cuda fp8: a %d x %d weight's 128-row bands have unequal scales: its "
                    "products of large n take the tiled kernel, not cuBLASLt", d->m, d->k);
        }
    }
    /* the workspaces its products need, so that captures find them large enough */
    if (d->experts > 0) /* moe_experts' grouped GEMMs: as many choice rows as decode
                         * batches make */
        rc = d->act == PD_ACT_NONE ? 0 : ws_input(c, st, w, WS_MOE_ROWS);
    else if (d->act == PD_ACT_NONE)
        rc = ws_grow(c, st, (void **)&st->wdq, &st->wdq_bytes, wbytes * sizeof(bf16), "dequant");
    else
        rc = ws_input(c, st, w, WS_ROWS);
    if (rc < 0) goto fail;
    free(blk);
    *out = w;
    return 0;
cuda_fail:
    pd_cuda__report("pd_cuda__fp8_weight_create", cudaGetErrorString(e), __FILE__, __LINE__);
    rc = e == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EBACKEND;
fail:
    free(blk);
    pd_cuda__fp8_weight_destroy(ctx, w);
    return rc;
}

/* ---- cuBLASLt ----
 * Row-major to column-major as cuda_linear.cu's: out[n][m] is the column-major m x n matrix
 * D = W . X^T with A = the weight ([m][k] read column-major: k x m, op T, lda k) and B = the
 * quantized rows (k x n, op N, ldb k): both K-major, the layout FP8 GEMMs need. A's scales
 * are the weight's (OUTER_VEC: a float per row of op(A) = output channel; BLK128x128: [m / 128]
 * bands x [k / 128] blocks with the k blocks consecutive, the weight's own order), B's the
 * input's ([ng][n]: OUTER_VEC a float per token, VEC128 one per 128 k of each token, tokens
 * consecutive). */

/* The descriptors of one product, destroyed on every way out. */
struct lt_objs {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    ~lt_objs()
    {
        if (pref) (void)cublasLtMatmulPreferenceDestroy(pref);
        if (d) (void)cublasLtMatrixLayoutDestroy(d);
        if (b) (void)cublasLtMatrixLayoutDestroy(b);
        if (a) (void)cublasLtMatrixLayoutDestroy(a);
        if (op) (void)cublasLtMatmulDescDestroy(op);
    }
};

/* Whether a scale mode was refused, for its log line (once a process). */
static int g_lt_refused_logged[2];

static uint32_t ptr_align(const void *p)
{
    const uintptr_t u = (uintptr_t)p;
    uint32_t a = 256;
    while (a > 1 && (u & (a - 1))) a >>= 1;
    return a;
}

/* out (d, [n][m]) = x . w^T (+ d when accumulate) through cuBLASLt. Returns 0 (queued), 1 (not
 * taken: nothing queued; the caller uses the tiled kernel), PD_ENOMEM, PD_EBACKEND. */
static int lt_product(pd_cuda_ctx *c, fp8_state *st, pd_fp8_weight *w, const uint8_t *xq,
                      const float *xs, int32_t n, bf16 *d, bool accumulate)
{
    int32_t amode, bmode;
    const float *ascale;
    int which;
    if (w->ng == 1) {
        amode = bmode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        ascale = w->scale;
        which = 0;
    } else if (w->group == 128 && w->blk_scale && w->k % 128 == 0 && w->ng % 4 == 0) {
        /* (ng % 4: the scale tensor's rows need no padding whichever rule the library has) */
        amode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        bmode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        ascale = w->blk_scale;
        which = 1;
    } else {
        return 1;
    }
    /* FP8 operands: 16-byte leading dimensions; the bf16 output's too */
    if (w->lt_off || w->k % 16 != 0 || w->m % 8 != 0 || ((uintptr_t)d & 15) != 0) return 1;

    lt_objs o;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const void *ap = ascale, *bp = xs;
    const uint32_t align = ptr_align(d);
    const uint64_t ws = LT_WS_BYTES;
    PD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&o.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                                   sizeof ta));
    PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                                   sizeof tb));
    const int8_t fast = which == 0 ? fast_accum(w->k) : 0;
    PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                                   sizeof fast));
    PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                   &amode, sizeof amode));
    PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                   &bmode, sizeof bmode));
    PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                   &ap, sizeof ap));
    PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                   &bp, sizeof bp));
    PD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&o.a, CUDA_R_8F_E4M3, w->k, w->m, w->k));
    PD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&o.b, CUDA_R_8F_E4M3, w->k, n, w->k));
    PD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&o.d, CUDA_R_16BF, w->m, n, w->m));
    if (w->lt_n != n || w->lt_align != align) {
        PD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&o.pref));
        PD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
            o.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
        PD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
            o.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align, sizeof align));
        PD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
            o.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align, sizeof align));
        cublasLtMatmulHeuristicResult_t h;
        int got = 0;
        const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(st->lt, o.op, o.a, o.b, o.d, o.d,
                                                                 o.pref, 1, &h, &got);
        if (s != CUBLAS_STATUS_SUCCESS || got < 1) {
            if (!g_lt_refused_logged[which]) {
                g_lt_refused_logged[which] = 1;
                PD_LOGW("cuda fp8: cuBLASLt has no FP8 GEMM for %s scales (%s, m %d k %d n %d): "
                        "such products take the tiled kernel (slower)",
                        which ? "BLK128x128 x VEC128" : "OUTER_VEC x OUTER_VEC",
                        s != CUBLAS_STATUS_SUCCESS ? cublasGetStatusString(s) : "no algorithm",
                        w->m, w->k, n);
            }
            w->lt_off = true;
            return 1;
        }
        w->lt_algo = h.algo;
        w->lt_n = n;
        w->lt_align = align;
    }
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    const cublasStatus_t s = cublasLtMatmul(st->lt, o.op, &alpha, w->w8, o.a, xq, o.b, &beta, d,
                                            o.d, d, o.d, &w->lt_algo, st->lt_ws, LT_WS_BYTES,
                                            c->stream);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED) { /* checked before anything is queued */
        PD_LOGW("cuda fp8: cublasLtMatmul refused an FP8 GEMM (m %d k %d n %d): the tiled "
                "kernel takes this weight's products", w->m, w->k, n);
        w->lt_off = true;
        return 1;
    }
    PD_CUBLAS_CHECK(s);
    return 0;
}

/* ---- linear_fused ---- */

/* The crossover in n to the large-n paths: PDSERVE_CUDA_FP8_GEMV_MAX_N (0 .. 8, 0 = never the
 * small-n kernel, for A/B runs), read once. */
static int gemv_max_n(void)
{
    static const int v = [] {
        const int64_t x = pd_env_int("PDSERVE_CUDA_FP8_GEMV_MAX_N"); /* default 8 */
        return (int)(x < 0 ? 0 : x > PD_FP8_GEMV_MAX_N ? PD_FP8_GEMV_MAX_N : x);
    }();
    return v;
}

/* Whether the quantization is fused into the kernels that make its input rows (the norm of a
 * linear with norm_w, the SwiGLU of linear_pair): PDSERVE_CUDA_FP8_FUSED_QUANT (default 1; 0 for
 * A/B runs), read once. The same bits either way. */
static bool fused_quant(void)
{
    static const bool v = pd_env_bool("PDSERVE_CUDA_FP8_FUSED_QUANT");
    return v;
}

static int check_args(const pd_linear_args *a)
{
    if (!a || a->n < 0 || a->k <= 0 || a->m <= 0 || !a->x || !a->w || !a->out ||
        (a->norm_w && !a->tmp_x) || (a->swiglu && (!a->tmp_out || a->accumulate)) ||
        (a->swiglu && a->m > INT32_MAX / 2))
        return PD_EINVAL;
    const pd_fp8_weight *w = (const pd_fp8_weight *)a->w;
    return w->k == a->k && w->m == (a->swiglu ? 2 * a->m : a->m) ? 0 : PD_EINVAL;
}

/* The quantized input of a linear of large n (w->act not PD_ACT_NONE) into st->xq / xs: its
 * rows a->x, normed first when a->norm_w is set (in one kernel with the quantization where
 * that fits, else the norm op into a->tmp_x). */
static int quant_input(pd_cuda_ctx *c, fp8_state *st, const pd_fp8_weight *w,
                       const pd_linear_args *a)
{
    int rc = ws_input(c, st, w, a->n);
    if (rc < 0) return rc;
    const void *x = a->x;
    if (a->norm_w) {
        if (fused_quant() && pd_rmsnorm_vec_fits(a->n, a->k, c->sm_count) &&
            pd_cuda__fp8_fused_quant_fits(a->k, w->group, x, st->xq) &&
            ((uintptr_t)a->norm_w & 15) == 0) {
            PD_CUDA_CHECK(pd_cuda__fp8_launch_norm_quant(
                (const bf16 *)x, (const bf16 *)a->norm_w, a->n, a->k, a->norm_eps, w->group,
                w->act, w->in_scale, st->xq, st->xs, c->stream));
            return 0;
        }
        rc = pd_cuda__rmsnorm(c, x, NULL, a->norm_w, a->n, a->k, a->norm_eps, a->tmp_x);
        if (rc < 0) return rc;
        x = a->tmp_x;
    }
    PD_CUDA_CHECK(pd_cuda__fp8_launch_quant((const bf16 *)x, a->n, a->k, w->group, w->act,
                                            w->in_scale, st->xq, st->xs, c->stream));
    return 0;
}

/* d [n][w->m] = the product of the quantized input in st->xq / xs (+ bias) (+ d when acc):
 * cuBLASLt, else the tiled kernel. */
static int product(pd_cuda_ctx *c, fp8_state *st, pd_fp8_weight *w, int32_t n,
                   const bf16 *bias, bf16 *d, bool acc)
{
    const int rc = lt_product(c, st, w, st->xq, st->xs, n, d, acc);
    if (rc < 0) return rc;
    if (rc == 0) {
        if (bias) PD_CUDA_CHECK(pd_cuda__fp8_launch_bias(d, bias, n, w->m, c->stream));
        return 0;
    }
    const pd_fp8_input in = {st->xq, st->xs, NULL};
    PD_CUDA_CHECK(pd_cuda__fp8_launch_tile(w, &in, bias, d, n, acc, c->stream));
    return 0;
}

extern "C" int pd_cuda__fp8_linear_fused(void *ctx, const pd_linear_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    int rc = check_args(a);
    if (rc < 0) return rc;
    pd_fp8_weight *w = (pd_fp8_weight *)a->w;
    const int32_t n = a->n, k = a->k, m = a->m, mw = a->swiglu ? 2 * m : m;
    if (n == 0) return 0;
    fp8_state *st = (fp8_state *)c->fp8_state; /* made by the weight's creation */
    const bf16 *bias = (const bf16 *)a->bias;
    bf16 *out = (bf16 *)a->out;
    const bool small = n <= gemv_max_n();
    if (w->act == PD_ACT_NONE || small) {
        const void *x = a->x;
        if (a->norm_w) {
            rc = pd_cuda__rmsnorm(ctx, x, NULL, a->norm_w, n, k, a->norm_eps, a->tmp_x);
            if (rc < 0) return rc;
            x = a->tmp_x;
        }
        pd_fp8_input in = {NULL, NULL, (const bf16 *)x};
        if (w->act != PD_ACT_NONE) {
            rc = ws_input(c, st, w, n);
            if (rc < 0) return rc;
            PD_CUDA_CHECK(pd_cuda__fp8_launch_quant((const bf16 *)x, n, k, w->group, w->act,
                                                    w->in_scale, st->xq, st->xs, c->stream));
            in.xq = st->xq;
            in.xs = st->xs;
        }
        if (small && pd_cuda__fp8_gemv_can(c, w, &in, n)) {
            PD_CUDA_CHECK(pd_cuda__fp8_launch_gemv(w, &in, bias, out, n, m, a->swiglu,
                                                   a->accumulate, c->stream));
            return 0;
        }
        if (w->act == PD_ACT_NONE) {
            /* weight-only, larger n: the bf16 product of the dequantized weight */
            rc = ws_grow(c, st, (void **)&st->wdq, &st->wdq_bytes,
                         (size_t)mw * k * sizeof(bf16), "dequant");
            if (rc < 0) return rc;
            PD_CUDA_CHECK(pd_cuda__fp8_launch_dequant(w, st->wdq, c->stream));
            pd_linear_args b = *a;
            b.x = x;
            b.w = st->wdq;
            b.norm_w = NULL;
            return pd_cuda__linear_fused(ctx, &b);
        }
    } else {
        rc = quant_input(c, st, w, a);
        if (rc < 0) return rc;
    }
    bf16 *d = a->swiglu ? (bf16 *)a->tmp_out : out;
    rc = product(c, st, w, n, bias, d, a->accumulate && !a->swiglu);
    if (rc < 0) return rc;
    return a->swiglu ? pd_cuda__swiglu(ctx, d, n, m, out) : 0;
}

/* pd_wq_ops.linear_pair: gate_up (with swiglu) then down (its x gate_up's out). For large n
 * with both weights' inputs quantized, the SwiGLU writes the down product's codes and scales
 * in one kernel (gate_up->out is not written); otherwise the two linear_fused calls. */
extern "C" int pd_cuda__fp8_linear_pair(void *ctx, const pd_linear_args *gu,
                                        const pd_linear_args *dn)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    int rc = check_args(gu);
    if (rc == 0) rc = check_args(dn);
    if (rc < 0) return rc;
    if (!gu->swiglu || dn->swiglu || dn->norm_w || dn->x != gu->out || dn->n != gu->n ||
        dn->k != gu->m)
        return PD_EINVAL;
    pd_fp8_weight *wg = (pd_fp8_weight *)gu->w, *wd = (pd_fp8_weight *)dn->w;
    const int32_t n = gu->n, f = gu->m;
    fp8_state *st = (fp8_state *)c->fp8_state;
    if (n == 0) return 0;
    if (!fused_quant() || n <= gemv_max_n() || wg->act == PD_ACT_NONE ||
        wd->act == PD_ACT_NONE || !pd_cuda__fp8_fused_quant_fits(f, wd->group, gu->tmp_out, st->xq)) {
        rc = pd_cuda__fp8_linear_fused(ctx, gu);
        return rc < 0 ? rc : pd_cuda__fp8_linear_fused(ctx, dn);
    }
    rc = quant_input(c, st, wg, gu);
    if (rc < 0) return rc;
    bf16 *gate_up = (bf16 *)gu->tmp_out;
    rc = product(c, st, wg, n, (const bf16 *)gu->bias, gate_up, false);
    if (rc == 0) rc = ws_input(c, st, wd, n); /* (a grown workspace: the old one is retired) */
    if (rc < 0) return rc;
    PD_CUDA_CHECK(pd_cuda__fp8_launch_swiglu_quant(gate_up, n, f, wd->group, wd->act,
                                                   wd->in_scale, st->xq, st->xs, c->stream));
    return product(c, st, wd, n, (const bf16 *)dn->bias, (bf16 *)dn->out, dn->accumulate);
}

/* Whether moe_experts' products run as grouped GEMMs: both weights taken by them and the
 * choices averaging PDSERVE_CUDA_FP8_MOE_GEMM_ROWS rows an expert or more (0: never); and the
 * quantized rows' workspace large enough for n token rows and nk choices, or grown to it
 * (outside a graph capture: inside one, too small a workspace keeps the row-streaming
 * kernel). */
static int moe_gemm(pd_cuda_ctx *c, fp8_state *st, const pd_fp8_weight *wg,
                    const pd_fp8_weight *wd, int32_t n, int64_t nk, int32_t E, bool *gemm)
{
    static const int64_t rows = pd_env_int("PDSERVE_CUDA_FP8_MOE_GEMM_ROWS");
    *gemm = rows > 0 && nk >= rows * (int64_t)E && pd_cuda__fp8_moe_gemm_can(c, wg) &&
            pd_cuda__fp8_moe_gemm_can(c, wd);
    if (!*gemm) return 0;
    const size_t qb = (size_t)n * wg->k > (size_t)nk * wd->k ? (size_t)n * wg->k
                                                             : (size_t)nk * wd->k;
    const size_t sb = ((size_t)n * wg->ng > (size_t)nk * wd->ng ? (size_t)n * wg->ng
                                                                : (size_t)nk * wd->ng) *
                      sizeof(float);
    if (qb > st->xq_bytes || sb > st->xs_bytes) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        PD_CUDA_CHECK(cudaStreamIsCapturing(c->stream, &cs));
        if (cs != cudaStreamCaptureStatusNone) {
            *gemm = false;
            return 0;
        }
    }
    int rc = ws_grow(c, st, (void **)&st->xq, &st->xq_bytes, qb, "input");
    return rc < 0 ? rc : ws_grow(c, st, (void **)&st->xs, &st->xs_bytes, sb, "input scale");
}

/* pd_wq_ops.moe_experts: the gate/up product with its SwiGLU into act, the down product into
 * y, then the combination. Few rows an expert: cuda_fp8_moe.cu's row-streaming kernel, each
 * launch quantizing its input rows itself; many: its grouped GEMMs over rows quantized first
 * (the token rows once, then the SwiGLU rows). */
extern "C" int pd_cuda__fp8_moe_experts(void *ctx, const pd_moe_experts_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a || a->n < 0 || a->k < 1 || a->n_experts < 1 || a->hidden < 16 || a->inter < 16 ||
        a->hidden % 16 != 0 || a->inter % 16 != 0 || !a->gate_up || !a->down ||
        (a->n > 0 && (!a->x || !a->rows || !a->offsets || !a->act || !a->y)) ||
        (a->n > 0 && a->out && (!a->ids || !a->pos || !a->weights)))
        return PD_EINVAL;
    const pd_fp8_weight *wg = (const pd_fp8_weight *)a->gate_up;
    const pd_fp8_weight *wd = (const pd_fp8_weight *)a->down;
    const int64_t E = a->n_experts;
    if (wg->k != a->hidden || wg->m != E * 2 * a->inter || wd->k != a->inter ||
        wd->m != E * a->hidden || wg->group % 16 != 0 || wd->group % 16 != 0)
        return PD_EINVAL;
    const uintptr_t bits = (uintptr_t)a->x | (uintptr_t)a->act | (uintptr_t)a->y;
    if (bits & 15) return PD_EINVAL; /* (16-byte rows: the kernels' loads) */
    if (a->n == 0) return 0;
    const int64_t nk = (int64_t)a->n * a->k;
    if (nk > INT32_MAX) return PD_EINVAL;
    fp8_state *st = (fp8_state *)c->fp8_state; /* made by the weights' creation */
    bool gemm = false;
    int rc = moe_gemm(c, st, wg, wd, a->n, nk, a->n_experts, &gemm);
    if (rc < 0) return rc;
    if (gemm) {
        PD_CUDA_CHECK(pd_cuda__fp8_launch_quant((const bf16 *)a->x, a->n, a->hidden, wg->group,
                                                wg->act, wg->in_scale, st->xq, st->xs,
                                                c->stream));
        PD_CUDA_CHECK(pd_cuda__fp8_launch_moe_gemm(wg, st->xq, st->xs, a->n, a->rows,
                                                   a->offsets, a->n_experts, nk, a->inter, true,
                                                   (bf16 *)a->act, c->stream));
        PD_CUDA_CHECK(pd_cuda__fp8_launch_quant((const bf16 *)a->act, (int32_t)nk, a->inter,
                                                wd->group, wd->act, wd->in_scale, st->xq,
                                                st->xs, c->stream));
        PD_CUDA_CHECK(pd_cuda__fp8_launch_moe_gemm(wd, st->xq, st->xs, (int32_t)nk, NULL,
                                                   a->offsets, a->n_experts, nk, a->hidden,
                                                   false, (bf16 *)a->y, c->stream));
    } else {
        PD_CUDA_CHECK(pd_cuda__fp8_launch_moe(wg, (const bf16 *)a->x, a->rows, a->offsets,
                                              a->n_experts, a->n, nk, a->inter, true,
                                              (bf16 *)a->act, c->stream));
        if (a->out && a->n == 1 && a->k <= 8) {
            /* a one-row step: the down products and the combination in one launch */
            PD_CUDA_CHECK(pd_cuda__fp8_launch_moe_down_combine(
                wd, (const bf16 *)a->act, a->ids, a->pos, a->weights, a->k, a->hidden,
                a->accumulate, (bf16 *)a->out, c->stream));
            return 0;
        }
        PD_CUDA_CHECK(pd_cuda__fp8_launch_moe(wd, (const bf16 *)a->act, NULL, a->offsets,
                                              a->n_experts, a->n, nk, a->hidden, false,
                                              (bf16 *)a->y, c->stream));
    }
    if (!a->out) return 0;
    const pd_moe_combine_args ca = {.y = a->y, .pos = a->pos, .weights = a->weights, .n = a->n,
                                    .k = a->k, .dim = a->hidden, .accumulate = a->accumulate,
                                    .out = a->out};
    return pd_cuda__moe_combine(ctx, &ca);
}
