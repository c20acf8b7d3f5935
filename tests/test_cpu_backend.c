/* test_cpu_backend.c -- Runs every op of the CPU backend against naive double-precision
 * references written here, on random inputs, with outputs poisoned (NaN) beforehand so that
 * every element is checked to have been written. Buffers go through the op table (alloc,
 * upload, download_f32) as engine code would use them. The mixture-of-experts routing is also
 * checked against the choices libstdc++ (what torch.topk calls) makes among tied values. */
#include <math.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/error.h"
#include "kernels/backend.h"
#include "tests/test_util.h"

#define TOL 1e-5       /* fp32 vs double: max abs error relative to max |ref| */
#define SENTINEL 777.25f /* marks memory an op must leave untouched */

static pd_backend *g_be;
static uint64_t g_rng = 0x243f6a8885a308d3ull;

static double urand(void) /* [0, 1) */
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) * (1.0 / 9007199254740992.0);
}

/* Random value of magnitude in [0.1, 1) * amp and random sign: never zero. */
static float rnz(double amp)
{
    double m = (0.1 + 0.9 * urand()) * amp;
    return (float)(urand() < 0.5 ? -m : m);
}

static void fill_rand(float *x, size_t n, double amp)
{
    for (size_t i = 0; i < n; i++) x[i] = rnz(amp);
}

static float *hmalloc(size_t n) /* host f32 array */
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    if (!p) abort();
    return p;
}

static void *dev_alloc(pd_dtype t, size_t n)
{
    void *b = NULL;
    int rc = g_be->ops->alloc(g_be->ctx, t, n, &b);
    if (rc != 0 || !b) abort();
    return b;
}

static void *dev_f32(const float *host, size_t n) /* alloc + upload */
{
    void *b = dev_alloc(PD_DTYPE_F32, n);
    CHECK_EQ_INT(g_be->ops->upload(g_be->ctx, b, PD_DTYPE_F32, 0, host, PD_DTYPE_F32, n), 0);
    return b;
}

static int32_t *dev_i32(const int32_t *host, size_t n)
{
    int32_t *b = dev_alloc(PD_DTYPE_I32, n);
    CHECK_EQ_INT(g_be->ops->upload(g_be->ctx, b, PD_DTYPE_I32, 0, host, PD_DTYPE_I32, n), 0);
    return b;
}

static void dev_set(void *b, float v, size_t n) /* fill a device buffer with one value */
{
    float *h = hmalloc(n);
    for (size_t i = 0; i < n; i++) h[i] = v;
    CHECK_EQ_INT(g_be->ops->upload(g_be->ctx, b, PD_DTYPE_F32, 0, h, PD_DTYPE_F32, n), 0);
    free(h);
}

static void *dev_poisoned(size_t n)
{
    void *b = dev_alloc(PD_DTYPE_F32, n);
    dev_set(b, NAN, n);
    return b;
}

static float *dl(const void *b, size_t n) /* download into a fresh host array */
{
    float *h = hmalloc(n);
    CHECK_EQ_INT(g_be->ops->download_f32(g_be->ctx, h, b, PD_DTYPE_F32, 0, n), 0);
    return h;
}

static void dev_free(void *b) { g_be->ops->free(g_be->ctx, b); }

/* Frees a list of device buffers / host arrays. */
static void free_list(void *const *p, size_t n, int device)
{
    for (size_t i = 0; i < n; i++) device ? dev_free(p[i]) : free(p[i]);
}
#define PTRS(...) (void *const[]){__VA_ARGS__}
#define DEV_FREE(...) free_list(PTRS(__VA_ARGS__), sizeof PTRS(__VA_ARGS__) / sizeof(void *), 1)
#define HOST_FREE(...) free_list(PTRS(__VA_ARGS__), sizeof PTRS(__VA_ARGS__) / sizeof(void *), 0)

/* All elements written (finite) and max |got - ref| <= TOL * max |ref|. */
static void check_close(const char *what, const float *got, const double *ref, size_t n)
{
    size_t bad = 0;
    double max_ref = 0, max_err = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) {
            bad++;
            continue;
        }
        if (fabs(ref[i]) > max_ref) max_ref = fabs(ref[i]);
        if (fabs(got[i] - ref[i]) > max_err) max_err = fabs(got[i] - ref[i]);
    }
    CHECK_MSG(bad == 0, "%s: %zu of %zu elements not written", what, bad, n);
    CHECK_MSG(max_ref > 0, "%s: reference is all zero", what);
    CHECK_MSG(max_err <= TOL * max_ref, "%s: max abs err %.3g vs max |ref| %.3g", what, max_err,
              max_ref);
}

static void test_create_and_memory(void)
{
    char err[PD_ERR_LEN] = "";
    pd_backend *b = (pd_backend *)1;
    pd_backend_params p = pd_backend_default_params();
    CHECK_EQ_INT(pd_backend_create("cpu", &p, &b, err), 0);
    CHECK(b && b->ops && strcmp(b->ops->name, "cpu") == 0 && b->ops->act_dtype == PD_DTYPE_F32);
    pd_backend_destroy(b);
    b = (pd_backend *)1;
    CHECK_EQ_INT(pd_backend_create("no-such-backend", NULL, &b, err), PD_ENOTFOUND);
    CHECK(b == NULL);
    CHECK_STR_CONTAINS(err, "no-such-backend");
    pd_backend_destroy(NULL);

    const pd_backend_ops *o = g_be->ops;
    CHECK_EQ_INT(o->sync(g_be->ctx), 0);
    o->free(g_be->ctx, NULL);
    /* alloc returns zeroed memory, for f32 and i32, including after a dirty free. */
    for (int round = 0; round < 2; round++) {
        float *f = dev_alloc(PD_DTYPE_F32, 1000);
        int32_t *iv = dev_alloc(PD_DTYPE_I32, 333);
        size_t nz = 0;
        for (size_t i = 0; i < 1000; i++) nz += f[i] != 0.0f || signbit(f[i]);
        for (size_t i = 0; i < 333; i++) nz += iv[i] != 0;
        CHECK_EQ_INT(nz, 0);
        memset(f, 0xab, 1000 * sizeof(float));
        memset(iv, 0xcd, 333 * sizeof(int32_t));
        DEV_FREE(f, iv);
    }
}

/* Independent IEEE half decoder. */
static double half_ref(uint16_t h)
{
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

static void test_upload_download(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { N = 64, OFF = 7, TOTAL = N + 2 * OFF };
    float src32[N];
    uint16_t srcb[N], srch[N];
    double ref32[N], refb[N], refh[N];
    fill_rand(src32, N, 3.0);
    const uint16_t fixed_h[] = {0x0001, 0x03ff, 0x0400, 0x3c00, 0xc000, 0x7bff, 0x7c00, 0xfc00};
    for (int i = 0; i < N; i++) {
        ref32[i] = src32[i];
        uint32_t bits;
        memcpy(&bits, &src32[i], 4);
        srcb[i] = (uint16_t)(bits >> 16); /* truncated bf16: exact upper half of the f32 */
        bits = (uint32_t)srcb[i] << 16;
        float bf;
        memcpy(&bf, &bits, 4);
        refb[i] = bf;
        uint16_t hh = (uint16_t)(urand() * 65536.0);
        if (((hh >> 10) & 31) == 31) hh &= 0xbfff; /* no NaN/inf from the random draws */
        srch[i] = i < 8 ? fixed_h[i] : hh;
        refh[i] = half_ref(srch[i]);
    }
    const void *srcs[3] = {src32, srcb, srch};
    const double *refs[3] = {ref32, refb, refh};
    const pd_dtype types[3] = {PD_DTYPE_F32, PD_DTYPE_BF16, PD_DTYPE_F16};
    for (int t = 0; t < 3; t++) {
        float *buf = dev_alloc(PD_DTYPE_F32, TOTAL);
        dev_set(buf, SENTINEL, TOTAL);
        CHECK_EQ_INT(o->upload(g_be->ctx, buf, PD_DTYPE_F32, OFF, srcs[t], types[t], N), 0);
        float got[TOTAL];
        CHECK_EQ_INT(o->download_f32(g_be->ctx, got, buf, PD_DTYPE_F32, 0, TOTAL), 0);
        int untouched = 1, exact = 1;
        for (int i = 0; i < TOTAL; i++)
            if (i < OFF || i >= OFF + N) untouched &= got[i] == SENTINEL;
            else exact &= (double)got[i] == refs[t][i - OFF];
        CHECK_MSG(untouched, "upload from %s wrote outside [off, off+n)", pd_dtype_name(types[t]));
        CHECK_MSG(exact, "upload from %s converted wrongly", pd_dtype_name(types[t]));
        /* download with an offset */
        float part[N];
        for (int i = 0; i < N; i++) part[i] = NAN;
        CHECK_EQ_INT(o->download_f32(g_be->ctx, part, buf, PD_DTYPE_F32, OFF + 5, N - 5), 0);
        exact = 1;
        for (int i = 0; i < N - 5; i++) exact &= (double)part[i] == refs[t][i + 5];
        CHECK(exact && isnan(part[N - 5]));
        dev_free(buf);
    }
    /* I32 buffers: upload raw, download_f32 converts by value */
    int32_t iv[10] = {0, -1, 2, 123456, -7654321, 16777216, 5, 6, 7, 8};
    int32_t *ib = dev_i32(iv, 10);
    float fv[8];
    CHECK_EQ_INT(o->download_f32(g_be->ctx, fv, ib, PD_DTYPE_I32, 1, 8), 0);
    for (int i = 0; i < 8; i++) CHECK_EQ_INT((int32_t)fv[i], iv[i + 1]);
    dev_free(ib);
}

static void test_fill_uniform(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { N = 10001 };
    float *a = dev_poisoned(N), *b = dev_poisoned(N), *c = dev_poisoned(N);
    const float lo = -0.3f, hi = 0.7f;
    CHECK_EQ_INT(o->fill_uniform(g_be->ctx, a, PD_DTYPE_F32, N, 42, lo, hi), 0);
    CHECK_EQ_INT(o->fill_uniform(g_be->ctx, b, PD_DTYPE_F32, N, 42, lo, hi), 0);
    CHECK_EQ_INT(o->fill_uniform(g_be->ctx, c, PD_DTYPE_F32, N, 43, lo, hi), 0);
    float *ha = dl(a, N), *hb = dl(b, N), *hc = dl(c, N);
    size_t out_of_range = 0, diff_seed = 0;
    double mn = INFINITY, mx = -INFINITY, sum = 0;
    for (size_t i = 0; i < N; i++) {
        out_of_range += !(ha[i] >= lo && ha[i] < hi);
        diff_seed += ha[i] != hc[i];
        mn = fmin(mn, ha[i]);
        mx = fmax(mx, ha[i]);
        sum += ha[i];
    }
    CHECK_EQ_INT(out_of_range, 0);
    CHECK(memcmp(ha, hb, N * sizeof(float)) == 0);
    CHECK(diff_seed > N / 2);
    CHECK(mn < lo + 0.01 && mx > hi - 0.01);
    CHECK_NEAR(sum / N, 0.2, 0.02);
    /* hi is excluded even when rounding lo + u * (hi - lo) would land on it: a one-ulp range
     * leaves only lo. */
    const float lo1 = 1.0f, hi1 = nextafterf(1.0f, 2.0f);
    CHECK_EQ_INT(o->fill_uniform(g_be->ctx, a, PD_DTYPE_F32, 1000, 7, lo1, hi1), 0);
    free(ha);
    ha = dl(a, 1000);
    out_of_range = 0;
    for (size_t i = 0; i < 1000; i++) out_of_range += !(ha[i] >= lo1 && ha[i] < hi1);
    CHECK_EQ_INT(out_of_range, 0);
    DEV_FREE(a, b, c);
    HOST_FREE(ha, hb, hc);
}

static void test_embedding_gather_swiglu(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { V = 7, D = 5, N = 6, F = 11 };
    float table[V * D];
    fill_rand(table, V * D, 1.0);
    const int32_t ids[N] = {3, 0, 6, 3, 1, 5};
    void *t = dev_f32(table, V * D), *out = dev_poisoned(N * D);
    int32_t *di = dev_i32(ids, N);
    CHECK_EQ_INT(o->embedding(g_be->ctx, di, N, t, D, out), 0);
    double ref[N * 2 * F];
    for (int i = 0; i < N; i++)
        for (int j = 0; j < D; j++) ref[i * D + j] = table[ids[i] * D + j];
    float *got = dl(out, N * D);
    check_close("embedding", got, ref, N * D);
    free(got);

    /* gather_rows: repeated and unordered indices, fewer rows than the source */
    const int32_t idx[4] = {4, 0, 4, 2};
    int32_t *dx = dev_i32(idx, 4);
    dev_set(out, NAN, N * D);
    CHECK_EQ_INT(o->gather_rows(g_be->ctx, t, dx, 4, D, out), 0);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < D; j++) ref[i * D + j] = table[idx[i] * D + j];
    got = dl(out, N * D);
    check_close("gather_rows", got, ref, 4 * D);
    CHECK(isnan(got[4 * D])); /* rows past n_idx untouched */
    free(got);

    /* swiglu */
    float gu[N * 2 * F];
    fill_rand(gu, N * 2 * F, 4.0);
    void *dgu = dev_f32(gu, N * 2 * F), *so = dev_poisoned(N * F);
    CHECK_EQ_INT(o->swiglu(g_be->ctx, dgu, N, F, so), 0);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < F; j++) {
            double g = gu[i * 2 * F + j], u = gu[i * 2 * F + F + j];
            ref[i * F + j] = g / (1.0 + exp(-g)) * u;
        }
    got = dl(so, N * F);
    check_close("swiglu", got, ref, N * F);
    DEV_FREE(t, out, di, dx, dgu, so);
    HOST_FREE(got);
}

static void rmsnorm_ref(const double *x, const float *w, int dim, double eps, double *out)
{
    double ss = 0;
    for (int j = 0; j < dim; j++) ss += x[j] * x[j];
    double r = 1.0 / sqrt(ss / dim + eps);
    for (int j = 0; j < dim; j++) out[j] = x[j] * r * w[j];
}

static void test_rmsnorm(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { N = 3, D = 37 };
    float x[N * D], res[N * D], w[D];
    fill_rand(x, N * D, 2.0);
    fill_rand(res, N * D, 2.0);
    fill_rand(w, D, 1.5);
    double in[N * D], ref[N * D], rref[N * D];
    void *dw = dev_f32(w, D);
    /* mode 0: no residual; 1: residual, separate out; 2: residual, out aliases x;
     * 3: no residual, out aliases x */
    for (int mode = 0; mode < 4; mode++) {
        const int use_res = mode == 1 || mode == 2, alias = mode >= 2;
        const float eps = mode % 2 ? 0.05f : 1e-6f; /* a large eps must show in the result */
        void *dx = dev_f32(x, N * D), *dr = use_res ? dev_f32(res, N * D) : NULL;
        void *dout = alias ? dx : dev_poisoned(N * D);
        for (int i = 0; i < N * D; i++) in[i] = use_res ? (double)res[i] + x[i] : x[i];
        for (int i = 0; i < N * D; i++) rref[i] = (double)(float)in[i];
        for (int i = 0; i < N; i++) rmsnorm_ref(rref + i * D, w, D, eps, ref + i * D);
        CHECK_EQ_INT(o->rmsnorm(g_be->ctx, dx, dr, dw, N, D, eps, dout), 0);
        char what[64];
        snprintf(what, sizeof what, "rmsnorm mode %d", mode);
        float *got = dl(dout, N * D);
        check_close(what, got, ref, N * D);
        free(got);
        if (use_res) { /* residual += x, exactly as fp32 adds */
            got = dl(dr, N * D);
            int exact = 1;
            for (int i = 0; i < N * D; i++) exact &= got[i] == res[i] + x[i];
            CHECK_MSG(exact, "rmsnorm mode %d: residual not updated to residual + x", mode);
            DEV_FREE(dr);
            HOST_FREE(got);
        }
        if (!alias) dev_free(dout);
        dev_free(dx);
    }
    dev_free(dw);
}

static void test_head_rmsnorm(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { N = 3, H = 3, HD = 8, STRIDE = H * HD + 2 * 2 * HD + 5 };
    const float eps = 0.05f;
    float x[N * STRIDE], w[HD];
    fill_rand(x, N * STRIDE, 3.0);
    fill_rand(w, HD, 1.5);
    void *dx = dev_f32(x, N * STRIDE), *dw = dev_f32(w, HD);
    CHECK_EQ_INT(o->head_rmsnorm(g_be->ctx, dx, N, STRIDE, H, HD, dw, eps), 0);
    float *got = dl(dx, N * STRIDE);
    double ref[N * H * HD], v[HD];
    float g[N * H * HD];
    int untouched = 1;
    for (int i = 0; i < N; i++) {
        for (int h = 0; h < H; h++) {
            for (int j = 0; j < HD; j++) v[j] = x[i * STRIDE + h * HD + j];
            rmsnorm_ref(v, w, HD, eps, ref + (i * H + h) * HD);
            memcpy(g + (i * H + h) * HD, got + i * STRIDE + h * HD, HD * sizeof(float));
        }
        for (int j = H * HD; j < STRIDE; j++) untouched &= got[i * STRIDE + j] == x[i * STRIDE + j];
    }
    check_close("head_rmsnorm", g, ref, N * H * HD);
    CHECK_MSG(untouched, "head_rmsnorm changed columns past n_heads * head_dim");
    DEV_FREE(dx, dw);
    HOST_FREE(got);
}

static void test_linear(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { K = 13, M = 7, NMAX = 5 };
    float x[NMAX * K], w[M * K], bias[M];
    fill_rand(w, M * K, 1.0);
    fill_rand(bias, M, 1.0);
    void *dw = dev_f32(w, M * K), *db = dev_f32(bias, M);
    const int ns[2] = {1, NMAX};
    for (int t = 0; t < 4; t++) {
        const int n = ns[t / 2], with_bias = t % 2;
        fill_rand(x, (size_t)n * K, 1.0);
        void *dx = dev_f32(x, (size_t)n * K), *out = dev_poisoned((size_t)n * M + 1);
        CHECK_EQ_INT(o->linear(g_be->ctx, dx, dw, with_bias ? db : NULL, n, K, M, out), 0);
        double ref[NMAX * M];
        for (int i = 0; i < n; i++)
            for (int j = 0; j < M; j++) {
                double s = with_bias ? bias[j] : 0.0;
                for (int l = 0; l < K; l++) s += (double)x[i * K + l] * w[j * K + l];
                ref[i * M + j] = s;
            }
        float *got = dl(out, (size_t)n * M + 1);
        char what[64];
        snprintf(what, sizeof what, "linear n=%d bias=%d", n, with_bias);
        check_close(what, got, ref, (size_t)n * M);
        CHECK_MSG(isnan(got[n * M]), "%s wrote past n * m", what);
        DEV_FREE(dx, out);
        HOST_FREE(got);
    }
    DEV_FREE(dw, db);
}

/* linear_fused against a double reference: every combination of norm, SwiGLU (2m weight
 * rows), residual add and bias the op allows, n = 1 and several rows; the bad combinations. */
static void test_linear_fused(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { K = 13, M = 7, N = 4 };
    float x[N * K], w[2 * M * K], bias[2 * M], nw[K], init[N * M];
    fill_rand(x, N * K, 2.0);
    fill_rand(w, 2 * M * K, 1.0);
    fill_rand(bias, 2 * M, 1.0);
    fill_rand(nw, K, 1.5);
    fill_rand(init, N * M, 3.0);
    void *dx = dev_f32(x, N * K), *dw = dev_f32(w, 2 * M * K), *db = dev_f32(bias, 2 * M);
    void *dn = dev_f32(nw, K), *tx = dev_poisoned(N * K), *to = dev_poisoned(N * 2 * M);
    for (int mode = 0; mode < 16; mode++) {
        const int norm = mode & 1, swiglu = (mode >> 1) & 1, acc = (mode >> 2) & 1;
        const int with_bias = (mode >> 3) & 1;
        if (swiglu && acc) continue;
        for (int n = 1; n <= N; n += N - 1) {
            void *out = acc ? dev_f32(init, N * M) : dev_poisoned(N * M);
            pd_linear_args a = {.x = dx, .w = dw, .bias = with_bias ? db : NULL, .out = out,
                                .n = n, .k = K, .m = M, .norm_w = norm ? dn : NULL,
                                .norm_eps = 0.01f, .swiglu = swiglu, .accumulate = acc,
                                .tmp_x = tx, .tmp_out = to};
            CHECK_EQ_INT(o->linear_fused(g_be->ctx, &a), 0);
            double ref[N * M];
            for (int i = 0; i < n; i++) {
                double xi[K], xn[K];
                for (int l = 0; l < K; l++) xi[l] = x[i * K + l];
                if (norm) rmsnorm_ref(xi, nw, K, 0.01, xn);
                else memcpy(xn, xi, sizeof xn);
                for (int j = 0; j < M; j++) {
                    double y[2];
                    for (int h = 0; h < 2; h++) {
                        const int row = j + h * M;
                        y[h] = with_bias ? bias[row] : 0.0;
                        for (int l = 0; l < K; l++) y[h] += xn[l] * w[row * K + l];
                    }
                    ref[i * M + j] = swiglu ? y[0] / (1.0 + exp(-y[0])) * y[1]
                                            : y[0] + (acc ? init[i * M + j] : 0.0);
                }
            }
            float *got = dl(out, N * M);
            char what[64];
            snprintf(what, sizeof what, "linear_fused mode %d n=%d", mode, n);
            check_close(what, got, ref, (size_t)n * M);
            if (!acc && n < N) CHECK_MSG(isnan(got[n * M]), "%s wrote past n * m", what);
            DEV_FREE(out);
            HOST_FREE(got);
        }
    }
    pd_linear_args bad = {.x = dx, .w = dw, .out = tx, .n = 1, .k = K, .m = M, .swiglu = true,
                          .accumulate = true, .tmp_out = to};
    CHECK_EQ_INT(o->linear_fused(g_be->ctx, &bad), PD_EINVAL);
    bad.swiglu = false;
    bad.norm_w = dn; /* no tmp_x */
    CHECK_EQ_INT(o->linear_fused(g_be->ctx, &bad), PD_EINVAL);
    DEV_FREE(dx, dw, db, dn, tx, to);
}

static void test_rope_store_kv(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { T = 4, H = 4, KVH = 2, HD = 8, HALF = HD / 2, ROW = (H + 2 * KVH) * HD };
    enum { BS = 4, NB = 4, KVROW = KVH * HD, CACHE = NB * BS * KVROW };
    const int32_t pos[T] = {0, 5, 17, 123}, slots[T] = {3, 9, -1, 14};
    float inv_freq[HALF];
    for (int i = 0; i < HALF; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / HD);
    void *dfreq = dev_f32(inv_freq, HALF);
    int32_t *dpos = dev_i32(pos, T), *dslots = dev_i32(slots, T);
    const float factors[2] = {1.0f, 1.37f};
    for (int fi = 0; fi < 2; fi++) {
        float qkv[T * ROW];
        fill_rand(qkv, T * ROW, 2.0);
        void *dqkv = dev_f32(qkv, T * ROW);
        float *kc = dev_alloc(PD_DTYPE_F32, CACHE), *vc = dev_alloc(PD_DTYPE_F32, CACHE);
        dev_set(kc, SENTINEL, CACHE);
        dev_set(vc, SENTINEL, CACHE);
        pd_rope_args a = {.qkv = dqkv, .positions = dpos, .slot_mapping = dslots,
                          .inv_freq = dfreq, .k_cache = kc, .v_cache = vc, .n_tokens = T,
                          .n_heads = H, .n_kv_heads = KVH, .head_dim = HD,
                          .attn_factor = factors[fi]};
        CHECK_EQ_INT(o->rope_store_kv(g_be->ctx, &a), 0);
        /* HF rotate-half; the angle is formed in fp32 (as transformers does), the rest in double */
        double ref[T * ROW];
        for (int t = 0; t < T; t++) {
            for (int j = 0; j < ROW; j++) ref[t * ROW + j] = qkv[t * ROW + j];
            for (int h = 0; h < H + KVH; h++) {
                const float *xv = qkv + t * ROW + h * HD;
                double *r = ref + t * ROW + h * HD;
                for (int i = 0; i < HALF; i++) {
                    double ang = (float)pos[t] * inv_freq[i];
                    double c = cos(ang) * factors[fi], s = sin(ang) * factors[fi];
                    r[i] = xv[i] * c - xv[i + HALF] * s;
                    r[i + HALF] = xv[i + HALF] * c + xv[i] * s;
                }
            }
        }
        float *got = dl(dqkv, T * ROW);
        char what[64];
        snprintf(what, sizeof what, "rope qkv attn_factor=%g", factors[fi]);
        check_close(what, got, ref, T * ROW);
        int v_same = 1;
        for (int t = 0; t < T; t++)
            for (int j = (H + KVH) * HD; j < ROW; j++)
                v_same &= got[t * ROW + j] == qkv[t * ROW + j];
        CHECK_MSG(v_same, "rope_store_kv changed v");
        /* caches: rotated k and raw v at the mapped slots; every other slot untouched */
        float *hk = dl(kc, CACHE), *hv = dl(vc, CACHE);
        int k_ok = 1, v_ok = 1, rest_ok = 1;
        for (int slot = 0; slot < NB * BS; slot++) {
            int t = -1;
            for (int u = 0; u < T; u++)
                if (slots[u] == slot) t = u;
            for (int j = 0; j < KVROW; j++) {
                float gk = hk[slot * KVROW + j], gv = hv[slot * KVROW + j];
                if (t < 0) {
                    rest_ok &= gk == SENTINEL && gv == SENTINEL;
                } else {
                    k_ok &= gk == got[t * ROW + H * HD + j];
                    v_ok &= gv == qkv[t * ROW + (H + KVH) * HD + j];
                }
            }
        }
        CHECK_MSG(k_ok && v_ok, "rope_store_kv stored wrong k (%d) or v (%d)", k_ok, v_ok);
        CHECK_MSG(rest_ok, "rope_store_kv wrote an unmapped slot (or the slot < 0 token)");
        DEV_FREE(dqkv, kc, vc);
        HOST_FREE(got, hk, hv);
    }
    DEV_FREE(dfreq, dpos, dslots);
}

/* Builds a batch with the given query and context lengths over a shuffled paged cache, runs
 * attention (decode or prefill entry) and compares with naive attention in double. */
static void run_attention(const char *what, int n_seqs, const int32_t *q_lens,
                          const int32_t *ctx_lens, int window, int decode)
{
    const pd_backend_ops *o = g_be->ops;
    enum { H = 4, KVH = 2, HD = 8, BS = 4, NB = 16, QSTRIDE = (H + 2 * KVH) * HD };
    enum { KVROW = KVH * HD, CACHE = NB * BS * KVROW, MAXS = 4, MAXBPS = 4 };
    int32_t cu[MAXS + 1] = {0}, bt[MAXS * MAXBPS], perm[NB];
    int32_t max_q = 0, max_ctx = 0;
    for (int s = 0; s < n_seqs; s++) {
        cu[s + 1] = cu[s] + q_lens[s];
        if (q_lens[s] > max_q) max_q = q_lens[s];
        if (ctx_lens[s] > max_ctx) max_ctx = ctx_lens[s];
    }
    const int n_tok = cu[n_seqs];
    for (int i = 0; i < NB; i++) perm[i] = i;
    for (int i = NB - 1; i > 0; i--) { /* shuffled, hence non-contiguous, block ids */
        int j = (int)(urand() * (i + 1)), tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    int used = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int b = 0; b < MAXBPS; b++)
            bt[s * MAXBPS + b] = b * BS < ctx_lens[s] ? perm[used++] : -1;
    if (used > NB) abort();
    float *q = hmalloc((size_t)n_tok * QSTRIDE), *kc = hmalloc(CACHE), *vc = hmalloc(CACHE);
    fill_rand(q, (size_t)n_tok * QSTRIDE, 2.0);
    fill_rand(kc, CACHE, 1.0);
    fill_rand(vc, CACHE, 1.0);
    void *dq = dev_f32(q, (size_t)n_tok * QSTRIDE), *dk = dev_f32(kc, CACHE);
    void *dv = dev_f32(vc, CACHE);
    void *dout = dev_poisoned((size_t)n_tok * H * HD);
    int32_t *dcu = dev_i32(cu, (size_t)n_seqs + 1), *dctx = dev_i32(ctx_lens, (size_t)n_seqs);
    int32_t *dbt = dev_i32(bt, (size_t)n_seqs * MAXBPS);
    const float scale = 1.0f / sqrtf((float)HD);
    pd_attn_args a = {.q = dq, .q_row_stride = QSTRIDE, .k_cache = dk, .v_cache = dv,
                      .out = dout, .cu_q = dcu, .ctx_lens = dctx, .block_tables = dbt,
                      .n_seqs = n_seqs, .n_tokens = n_tok, .max_q_len = max_q,
                      .max_ctx_len = max_ctx, .max_blocks_per_seq = MAXBPS, .n_heads = H,
                      .n_kv_heads = KVH, .head_dim = HD, .block_size = BS,
                      .sliding_window = window, .scale = scale};
    CHECK_EQ_INT((decode ? o->attention_decode : o->attention_prefill)(g_be->ctx, &a), 0);

    double *ref = calloc((size_t)n_tok * H * HD, sizeof(double));
    double *K = malloc(MAXBPS * BS * KVROW * sizeof(double));
    double *Vv = malloc(MAXBPS * BS * KVROW * sizeof(double));
    double sc[MAXBPS * BS];
    if (!ref || !K || !Vv) abort();
    for (int s = 0; s < n_seqs; s++) {
        for (int p = 0; p < ctx_lens[s]; p++) { /* gather contiguous K/V */
            int slot = bt[s * MAXBPS + p / BS] * BS + p % BS;
            for (int j = 0; j < KVROW; j++) {
                K[p * KVROW + j] = kc[slot * KVROW + j];
                Vv[p * KVROW + j] = vc[slot * KVROW + j];
            }
        }
        for (int i = 0; i < q_lens[s]; i++) {
            const int row = cu[s] + i, pos = ctx_lens[s] - q_lens[s] + i;
            const int start = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
            for (int h = 0; h < H; h++) {
                const int kvh = h / (H / KVH);
                double mx = -INFINITY, sum = 0;
                for (int p = start; p <= pos; p++) {
                    double d = 0;
                    for (int j = 0; j < HD; j++)
                        d += (double)q[row * QSTRIDE + h * HD + j] * K[p * KVROW + kvh * HD + j];
                    sc[p] = d * scale;
                    mx = fmax(mx, sc[p]);
                }
                for (int p = start; p <= pos; p++) sum += sc[p] = exp(sc[p] - mx);
                for (int p = start; p <= pos; p++)
                    for (int j = 0; j < HD; j++)
                        ref[(row * H + h) * HD + j] += sc[p] / sum * Vv[p * KVROW + kvh * HD + j];
            }
        }
    }
    float *got = dl(dout, (size_t)n_tok * H * HD);
    check_close(what, got, ref, (size_t)n_tok * H * HD);
    DEV_FREE(dq, dk, dv, dout, dcu, dctx, dbt);
    HOST_FREE(got, ref, K, Vv, q, kc, vc);
}

static void test_attention(void)
{
    /* fresh prefill, chunk with a cached prefix (q_len < ctx_len), and a decode step */
    const int32_t ql[3] = {5, 3, 1}, cl[3] = {5, 10, 9};
    run_attention("attention_prefill mixed", 3, ql, cl, 0, 0);
    run_attention("attention_prefill mixed window=3", 3, ql, cl, 3, 0);
    run_attention("attention_prefill mixed window=6", 3, ql, cl, 6, 0);
    const int32_t dq[4] = {1, 1, 1, 1}, dc[4] = {1, 6, 13, 16};
    run_attention("attention_decode", 4, dq, dc, 0, 1);
    run_attention("attention_decode window=5", 4, dq, dc, 5, 1);
    /* a long context after short ones: the scratch must grow */
    const int32_t lq[2] = {2, 16}, lc[2] = {3, 16};
    run_attention("attention_prefill full chunk", 2, lq, lc, 0, 0);
}

static void test_kv_blocks_roundtrip(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { NB = 8, BE = 24, N = 3 };
    float cache[NB * BE];
    fill_rand(cache, NB * BE, 1.0);
    void *dc = dev_f32(cache, NB * BE), *dc2 = dev_alloc(PD_DTYPE_F32, NB * BE);
    dev_set(dc2, SENTINEL, NB * BE);
    const int32_t ids[N] = {5, 1, 6}, ids2[N] = {2, 7, 0};
    float host[N * BE + 1];
    for (int i = 0; i < N * BE + 1; i++) host[i] = NAN;
    CHECK_EQ_INT(o->kv_blocks_to_host(g_be->ctx, dc, ids, N, BE, host), 0);
    int exact = 1;
    for (int i = 0; i < N; i++)
        for (int j = 0; j < BE; j++) exact &= host[i * BE + j] == cache[ids[i] * BE + j];
    CHECK_MSG(exact && isnan(host[N * BE]), "kv_blocks_to_host copied wrong data");
    CHECK_EQ_INT(o->kv_blocks_from_host(g_be->ctx, dc2, ids2, N, BE, host), 0);
    float *got = dl(dc2, NB * BE);
    exact = 1;
    for (int b = 0; b < NB; b++) {
        int i = -1;
        for (int u = 0; u < N; u++)
            if (ids2[u] == b) i = u;
        for (int j = 0; j < BE; j++)
            exact &= got[b * BE + j] == (i < 0 ? SENTINEL : cache[ids[i] * BE + j]);
    }
    CHECK_MSG(exact, "kv_blocks_from_host roundtrip mismatch or wrote other blocks");
    DEV_FREE(dc, dc2);
    HOST_FREE(got);
}

/* The FP8 weight op set against its definition (backend.h pd_qweight_desc): rows quantized by
 * pd_fp8_quant_row (the rule, tested in test_common), weights dequantized, products in
 * double; with the norm, bias, accumulate and swiglu fusions. */
static void test_fp8_linear(void)
{
    const pd_backend_ops *o = g_be->ops;
    const pd_wq_ops *q8 = o->fp8;
    CHECK(q8 != NULL);
    if (!q8) return;
    static const struct { int32_t m, k, group; } shapes[] = {{37, 200, 200}, {70, 300, 128},
                                                             {16, 96, 128}, {5, 7, 7}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int act = PD_ACT_NONE; act <= PD_ACT_STATIC; act++)
            for (int fuse = 0; fuse < 4; fuse++) { /* plain+bias, norm, accumulate, swiglu */
                const int32_t k = shapes[si].k, group = shapes[si].group, n = 5;
                const int32_t m = shapes[si].m, mw = fuse == 3 ? 2 * m : m;
                const int32_t G = (k + group - 1) / group;
                uint8_t *w8 = malloc((size_t)mw * k);
                float *sc = hmalloc((size_t)mw * G), *x = hmalloc((size_t)n * k);
                float *bias = hmalloc((size_t)mw), *nw = hmalloc((size_t)k);
                float *out0 = hmalloc((size_t)n * m);
                if (!w8) abort();
                for (int32_t i = 0; i < mw * k; i++) {
                    uint8_t b = (uint8_t)(urand() * 256);
                    w8[i] = (b & 0x7f) == 0x7f ? 0 : b;
                }
                for (int32_t i = 0; i < mw * G; i++) sc[i] = (float)(0.001 + 0.01 * urand());
                fill_rand(x, (size_t)n * k, 3.0);
                fill_rand(bias, (size_t)mw, 1.0);
                fill_rand(out0, (size_t)n * m, 1.0);
                for (int32_t j = 0; j < k; j++) nw[j] = (float)(0.5 + urand());
                const float in_scale = 0.004f;
                pd_qweight_desc d = {.w8 = w8, .scale = sc, .m = mw, .k = k, .group = group,
                                     .act = (pd_act_quant)act, .in_scale = in_scale};
                void *w = NULL;
                CHECK_EQ_INT(q8->weight_create(g_be->ctx, &d, &w), 0);
                if (!w) continue;
                CHECK(q8->weight_bytes(g_be->ctx, w) > 0);
                void *dx = dev_f32(x, (size_t)n * k), *dout = dev_f32(out0, (size_t)n * m);
                void *dbias = dev_f32(bias, (size_t)mw), *dnw = dev_f32(nw, (size_t)k);
                void *tmp_x = dev_alloc(PD_DTYPE_F32, (size_t)n * k);
                void *tmp_out = dev_alloc(PD_DTYPE_F32, (size_t)n * mw);
                pd_linear_args a = {.x = dx, .w = w, .bias = fuse == 0 ? dbias : NULL,
                                    .out = dout, .n = n, .k = k, .m = m,
                                    .norm_w = fuse == 1 ? dnw : NULL, .norm_eps = 1e-5f,
                                    .swiglu = fuse == 3, .accumulate = fuse == 2,
                                    .tmp_x = tmp_x, .tmp_out = tmp_out};
                CHECK_EQ_INT(q8->linear_fused(g_be->ctx, &a), 0);
                /* reference */
                float *xn = hmalloc((size_t)n * k), *xq = hmalloc((size_t)k);
                memcpy(xn, x, (size_t)n * k * sizeof *xn);
                if (fuse == 1) CHECK_EQ_INT(o->rmsnorm(g_be->ctx, x, NULL, nw, n, k, 1e-5f, xn), 0);
                double *ref = calloc((size_t)n * m, sizeof *ref);
                double *prod = calloc((size_t)mw, sizeof *prod);
                if (!ref || !prod) abort();
                for (int32_t r = 0; r < n; r++) {
                    pd_fp8_quant_row(xn + (size_t)r * k, xq, k, group, (pd_act_quant)act, in_scale);
                    for (int32_t i = 0; i < mw; i++) {
                        double acc = 0;
                        for (int32_t j = 0; j < k; j++)
                            acc += (double)xq[j] * ((double)pd_e4m3_to_f32(w8[(size_t)i * k + j]) *
                                                    (double)sc[(size_t)i * G + j / group]);
                        prod[i] = acc + (fuse == 0 ? bias[i] : 0);
                    }
                    for (int32_t i = 0; i < m; i++) {
                        double v = prod[i];
                        if (fuse == 3) v = prod[i] / (1 + exp(-prod[i])) * prod[m + i];
                        if (fuse == 2) v += out0[(size_t)r * m + i];
                        ref[(size_t)r * m + i] = v;
                    }
                }
                float *got = dl(dout, (size_t)n * m);
                char what[96];
                snprintf(what, sizeof what, "fp8 linear m %d k %d group %d act %d fuse %d", m, k,
                         group, act, fuse);
                check_close(what, got, ref, (size_t)n * m);
                q8->weight_destroy(g_be->ctx, w);
                DEV_FREE(dx, dout, dbias, dnw, tmp_x, tmp_out);
                HOST_FREE(sc, x, bias, nw, out0, xn, xq, got);
                free(ref);
                free(prod);
                free(w8);
            }
    /* what the op refuses */
    uint8_t b8[4] = {0};
    float s1[4] = {1, 1, 1, 1};
    void *w = NULL;
    pd_qweight_desc bad = {.w8 = b8, .scale = s1, .m = 2, .k = 2, .group = 3, .act = PD_ACT_NONE};
    CHECK_EQ_INT(q8->weight_create(g_be->ctx, &bad, &w), PD_EINVAL);
    bad.group = 2;
    bad.act = PD_ACT_STATIC; /* without its scale */
    CHECK_EQ_INT(q8->weight_create(g_be->ctx, &bad, &w), PD_EINVAL);
    bad.act = PD_ACT_NONE;
    CHECK_EQ_INT(q8->weight_create(g_be->ctx, &bad, &w), 0);
    pd_linear_args wrong = {.x = b8, .w = w, .out = s1, .n = 1, .k = 3, .m = 2};
    CHECK_EQ_INT(q8->linear_fused(g_be->ctx, &wrong), PD_EINVAL); /* k is not the weight's */
    q8->weight_destroy(g_be->ctx, w);
    q8->weight_destroy(g_be->ctx, NULL);
}

/* The FP8 KV cache's ops: the store writes e4m3(k / k_scale) of exactly what the f32 op
 * stores, and attention over it equals the f32 attention over the dequantized cache. */
static void test_fp8_kv(void)
{
    const pd_backend_ops *o = g_be->ops;
    const pd_kv_ops *kv = o->kv_fp8;
    CHECK(kv != NULL && kv->dtype == PD_DTYPE_F8E4M3);
    if (!kv) return;
    enum { T = 6, H = 4, KVH = 2, HD = 8, HALF = HD / 2, ROW = (H + 2 * KVH) * HD };
    enum { BS = 4, NB = 4, KVROW = KVH * HD, CACHE = NB * BS * KVROW };
    const int32_t pos[T] = {0, 1, 2, 3, 4, 5}, slots[T] = {4, 5, 6, 7, 8, 9};
    float inv_freq[HALF];
    for (int i = 0; i < HALF; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / HD);
    float qkv[T * ROW];
    fill_rand(qkv, T * ROW, 3.0);
    void *dfreq = dev_f32(inv_freq, HALF), *q1 = dev_f32(qkv, T * ROW), *q2 = dev_f32(qkv, T * ROW);
    int32_t *dpos = dev_i32(pos, T), *dslots = dev_i32(slots, T);
    float *kf = dev_alloc(PD_DTYPE_F32, CACHE), *vf = dev_alloc(PD_DTYPE_F32, CACHE);
    uint8_t *k8 = dev_alloc(PD_DTYPE_F8E4M3, CACHE), *v8 = dev_alloc(PD_DTYPE_F8E4M3, CACHE);
    const float ks = 0.002f, vs = 0.0031f;
    pd_rope_args a = {.qkv = q1, .positions = dpos, .slot_mapping = dslots, .inv_freq = dfreq,
                      .k_cache = kf, .v_cache = vf, .n_tokens = T, .n_heads = H,
                      .n_kv_heads = KVH, .head_dim = HD, .attn_factor = 1, .k_scale = ks,
                      .v_scale = vs};
    CHECK_EQ_INT(o->rope_store_kv(g_be->ctx, &a), 0);
    a.qkv = q2;
    a.k_cache = k8;
    a.v_cache = v8;
    CHECK_EQ_INT(kv->rope_store_kv(g_be->ctx, &a), 0);
    int bad = 0, sat = 0;
    for (int i = 0; i < CACHE; i++) {
        bad += k8[i] != pd_f32_to_e4m3(kf[i] / ks) || v8[i] != pd_f32_to_e4m3(vf[i] / vs);
        sat += (k8[i] & 0x7f) == 0x7e;
    }
    CHECK_MSG(bad == 0, "fp8 store: %d elements differ from e4m3(x / scale)", bad);
    CHECK(sat > 0); /* the scale is small enough that some saturate */
    a.k_scale = 0;
    CHECK_EQ_INT(kv->rope_store_kv(g_be->ctx, &a), PD_EINVAL);
    /* attention: the dequantized cache through the f32 op is the reference */
    for (int i = 0; i < CACHE; i++) {
        kf[i] = pd_e4m3_to_f32(k8[i]) * ks;
        vf[i] = pd_e4m3_to_f32(v8[i]) * vs;
    }
    const int32_t cu[3] = {0, 4, 6}, ctx[2] = {6, 10}, bt[2 * 3] = {1, 2, 0, 2, 0, 1};
    int32_t *dcu = dev_i32(cu, 3), *dctx = dev_i32(ctx, 2), *dbt = dev_i32(bt, 6);
    void *o1 = dev_alloc(PD_DTYPE_F32, T * H * HD), *o2 = dev_alloc(PD_DTYPE_F32, T * H * HD);
    pd_attn_args at = {.q = q1, .q_row_stride = ROW, .k_cache = kf, .v_cache = vf, .out = o1,
                       .cu_q = dcu, .ctx_lens = dctx, .block_tables = dbt, .n_seqs = 2,
                       .n_tokens = T, .max_q_len = 4, .max_ctx_len = 10,
                       .max_blocks_per_seq = 3, .n_heads = H, .n_kv_heads = KVH, .head_dim = HD,
                       .block_size = BS, .scale = 0.35f, .k_scale = ks, .v_scale = vs};
    CHECK_EQ_INT(o->attention_prefill(g_be->ctx, &at), 0);
    at.k_cache = k8;
    at.v_cache = v8;
    at.out = o2;
    CHECK_EQ_INT(kv->attention_prefill(g_be->ctx, &at), 0);
    const float *r1 = o1, *r2 = o2;
    int diff = 0;
    for (int i = 0; i < T * H * HD; i++) diff += r1[i] != r2[i];
    CHECK_MSG(diff == 0, "fp8 attention: %d outputs differ from f32 over the dequantized cache",
              diff);
    DEV_FREE(dfreq, q1, q2, dpos, dslots, kf, vf, k8, v8, dcu, dctx, dbt, o1, o2);
}

/* moe_route's choice among tied probabilities, against what libstdc++'s nth_element /
 * partial_sort and sort (the calls torch's CPU topk makes) returned for these rows, recorded
 * with g++ 12 (libstdc++): logits (i a + b) % L, or (i a + b) / -L for L < 0, halved. */
static void test_moe_route_ties(void)
{
    static const struct {
        int32_t n, k, a, b, L;
        int32_t want[16];
    } k_cases[] = {
        {8, 4, 3, 1, 3, {6, 5, 4, 7}},
        {4, 2, 1, 0, 2, {1, 3}},
        {8, 2, 5, 0, 2, {1, 7}},
        {128, 2, 5, 2, 4, {5, 1}}, /* k * 64 <= n: partial_sort */
        {64, 8, 7, 3, 5, {43, 53, 13, 48, 18, 38, 33, 28}},
        {300, 10, 1, 0, -4, {299, 298, 297, 296, 295, 292, 293, 294, 288, 289}},
        {128, 8, 1, 0, -5, {127, 126, 125, 120, 121, 122, 124, 123}},
        {256, 3, 3, 1, -7, {254, 255, 253}},
        {16, 16, 1, 0, 2, {1, 15, 13, 11, 9, 7, 5, 3, 12, 0, 14, 2, 10, 4, 8, 6}},
    };
    const pd_backend_ops *o = g_be->ops;
    for (size_t c = 0; c < sizeof k_cases / sizeof k_cases[0]; c++) {
        const int32_t n = k_cases[c].n, k = k_cases[c].k, a = k_cases[c].a, b = k_cases[c].b;
        const int32_t L = k_cases[c].L;
        float *lg = hmalloc((size_t)n);
        for (int32_t i = 0; i < n; i++)
            lg[i] = 0.5f * (float)(L > 0 ? (i * a + b) % L : (i * a + b) / -L);
        void *dlg = dev_f32(lg, (size_t)n);
        int32_t *ids = dev_alloc(PD_DTYPE_I32, (size_t)k), *rows = dev_alloc(PD_DTYPE_I32, (size_t)k);
        int32_t *pos = dev_alloc(PD_DTYPE_I32, (size_t)k), offsets[301];
        float *w = dev_alloc(PD_DTYPE_F32, (size_t)k);
        const pd_moe_route_args ra = {.logits = dlg, .n = 1, .n_experts = n, .k = k,
                                      .renormalize = true, .ids = ids, .weights = w,
                                      .rows = rows, .pos = pos, .offsets = offsets};
        CHECK_EQ_INT(o->moe_route(g_be->ctx, &ra), 0);
        float *got = hmalloc((size_t)k);
        CHECK_EQ_INT(o->download_f32(g_be->ctx, got, ids, PD_DTYPE_I32, 0, (size_t)k), 0);
        for (int32_t j = 0; j < k; j++)
            CHECK_MSG((int32_t)got[j] == k_cases[c].want[j], "case %zu (n %d, k %d) choice %d: "
                      "expert %d, libstdc++ %d", c, n, k, j, (int)got[j], k_cases[c].want[j]);
        DEV_FREE(dlg, ids, rows, pos, w);
        HOST_FREE(lg, got);
    }
}

/* moe_route on distinct probabilities (the plain top k, weights against double) and its
 * grouping; moe_combine against double, writing and accumulating; bad arguments. */
static void test_moe_route_combine(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { N = 7, E = 6, K = 3, D = 5 };
    float lg[N * E];
    fill_rand(lg, N * E, 2.0);
    void *dlg = dev_f32(lg, N * E);
    int32_t *ids = dev_alloc(PD_DTYPE_I32, N * K), *rows = dev_alloc(PD_DTYPE_I32, N * K);
    int32_t *pos = dev_alloc(PD_DTYPE_I32, N * K), offsets[E + 1];
    float *w = dev_alloc(PD_DTYPE_F32, N * K);
    for (int renorm = 0; renorm < 2; renorm++) {
        pd_moe_route_args ra = {.logits = dlg, .n = N, .n_experts = E, .k = K,
                                .renormalize = renorm, .ids = ids, .weights = w, .rows = rows,
                                .pos = pos, .offsets = offsets};
        CHECK_EQ_INT(o->moe_route(g_be->ctx, &ra), 0);
        /* the CPU's buffers are host memory */
        double ref[N * K];
        for (int t = 0; t < N; t++) {
            double p[E], sum = 0, top = 0;
            for (int e = 0; e < E; e++) sum += p[e] = exp((double)lg[t * E + e]);
            for (int j = 0; j < K; j++) { /* j-th largest, by selection */
                int best = -1;
                for (int e = 0; e < E; e++) {
                    bool used = false;
                    for (int i = 0; i < j; i++) used |= ids[t * K + i] == e;
                    if (!used && (best < 0 || p[e] > p[best])) best = e;
                }
                CHECK_EQ_INT(ids[t * K + j], best);
                ref[t * K + j] = p[best] / sum;
                top += p[best] / sum;
            }
            for (int j = 0; renorm && j < K; j++) ref[t * K + j] /= top;
        }
        check_close("moe_route weights", w, ref, N * K);
        CHECK_EQ_INT(offsets[0], 0);
        CHECK_EQ_INT(offsets[E], N * K);
        for (int e = 0; e < E; e++)
            for (int32_t i = offsets[e]; i < offsets[e + 1]; i++) {
                CHECK(i == offsets[e] || rows[i] > rows[i - 1]); /* ascending, no repeat */
                bool chose = false;
                for (int j = 0; j < K; j++) chose |= ids[rows[i] * K + j] == e;
                CHECK(chose);
            }
        for (int t = 0; t < N; t++)
            for (int j = 0; j < K; j++) {
                const int32_t p = pos[t * K + j];
                CHECK(p >= offsets[ids[t * K + j]] && p < offsets[ids[t * K + j] + 1] &&
                      rows[p] == t);
            }
    }
    float y[N * K * D], base[N * D];
    fill_rand(y, N * K * D, 1.0);
    fill_rand(base, N * D, 1.0);
    void *dy = dev_f32(y, N * K * D), *out = dev_f32(base, N * D);
    for (int acc = 0; acc < 2; acc++) {
        pd_moe_combine_args ca = {.y = dy, .pos = pos, .weights = w, .n = N, .k = K, .dim = D,
                                  .accumulate = acc, .out = out};
        if (!acc) dev_set(out, NAN, N * D);
        else CHECK_EQ_INT(o->upload(g_be->ctx, out, PD_DTYPE_F32, 0, base, PD_DTYPE_F32, N * D), 0);
        CHECK_EQ_INT(o->moe_combine(g_be->ctx, &ca), 0);
        double ref[N * D];
        for (int t = 0; t < N; t++)
            for (int d = 0; d < D; d++) {
                ref[t * D + d] = acc ? base[t * D + d] : 0;
                for (int j = 0; j < K; j++)
                    ref[t * D + d] += (double)w[t * K + j] * y[pos[t * K + j] * D + d];
            }
        float *got = dl(out, N * D);
        check_close(acc ? "moe_combine accumulate" : "moe_combine", got, ref, N * D);
        free(got);
    }
    pd_moe_route_args bad = {.logits = dlg, .n = N, .n_experts = E, .k = E + 1, .ids = ids,
                             .weights = w, .rows = rows, .pos = pos, .offsets = offsets};
    CHECK_EQ_INT(o->moe_route(g_be->ctx, &bad), PD_EINVAL);
    pos[3] = N * K; /* past the choices */
    pd_moe_combine_args badc = {.y = dy, .pos = pos, .weights = w, .n = N, .k = K, .dim = D,
                                .out = out};
    CHECK_EQ_INT(o->moe_combine(g_be->ctx, &badc), PD_EINVAL);
    DEV_FREE(dlg, ids, rows, pos, w, dy, out);
}

/* moe_route with the groups' bounds in backend memory only (dev_offsets) groups as with the
 * host's copy; moe_experts (every expert's MLP in one op, experts in one buffer each)
 * against double; bounds that do not add up are refused. */
static void test_moe_experts(void)
{
    const pd_backend_ops *o = g_be->ops;
    enum { N = 9, E = 5, K = 2, H = 12, F = 6 };
    float lg[N * E], x[N * H], gu[E * 2 * F * H], dn[E * H * F];
    fill_rand(lg, N * E, 2.0);
    fill_rand(x, N * H, 1.0);
    fill_rand(gu, E * 2 * F * H, 0.5);
    fill_rand(dn, E * H * F, 0.5);
    void *dlg = dev_f32(lg, N * E), *dx = dev_f32(x, N * H);
    void *dgu = dev_f32(gu, E * 2 * F * H), *ddn = dev_f32(dn, E * H * F);
    int32_t *ids = dev_alloc(PD_DTYPE_I32, N * K), *rows = dev_alloc(PD_DTYPE_I32, N * K);
    int32_t *pos = dev_alloc(PD_DTYPE_I32, N * K), *doff = dev_alloc(PD_DTYPE_I32, E + 1);
    int32_t offsets[E + 1], rows_host[N * K];
    float *w = dev_alloc(PD_DTYPE_F32, N * K), *act = dev_alloc(PD_DTYPE_F32, N * K * F);
    float *y = dev_alloc(PD_DTYPE_F32, N * K * H);
    pd_moe_route_args ra = {.logits = dlg, .n = N, .n_experts = E, .k = K, .renormalize = true,
                            .ids = ids, .weights = w, .rows = rows, .pos = pos,
                            .offsets = offsets};
    CHECK_EQ_INT(o->moe_route(g_be->ctx, &ra), 0);
    memcpy(rows_host, rows, sizeof rows_host);
    ra.offsets = NULL;
    ra.dev_offsets = doff;
    CHECK_EQ_INT(o->moe_route(g_be->ctx, &ra), 0);
    for (int e = 0; e <= E; e++) CHECK_EQ_INT(doff[e], offsets[e]);
    for (int i = 0; i < N * K; i++) CHECK_EQ_INT(rows[i], rows_host[i]);
    const pd_moe_experts_args ea = {.x = dx, .n = N, .k = K, .n_experts = E, .hidden = H,
                                    .inter = F, .rows = rows, .offsets = doff, .gate_up = dgu,
                                    .down = ddn, .act = act, .y = y};
    CHECK_EQ_INT(o->moe_experts(g_be->ctx, &ea), 0);
    double ref[N * K * H];
    for (int e = 0; e < E; e++)
        for (int32_t p = offsets[e]; p < offsets[e + 1]; p++) {
            const float *xr = x + rows[p] * H;
            double a[F];
            for (int f = 0; f < F; f++) {
                double g = 0, u = 0;
                for (int h = 0; h < H; h++) {
                    g += (double)gu[(e * 2 * F + f) * H + h] * xr[h];
                    u += (double)gu[(e * 2 * F + F + f) * H + h] * xr[h];
                }
                a[f] = g / (1.0 + exp(-g)) * u;
            }
            for (int h = 0; h < H; h++) {
                double v = 0;
                for (int f = 0; f < F; f++) v += (double)dn[(e * H + h) * F + f] * a[f];
                ref[p * H + h] = v;
            }
        }
    check_close("moe_experts", y, ref, N * K * H);
    /* with the combination: the weighted sum of the reference's rows added to a residual */
    float out[N * H];
    fill_rand(out, N * H, 1.0);
    double cref[N * H];
    for (int t = 0; t < N; t++)
        for (int h = 0; h < H; h++) {
            double s = 0;
            for (int j = 0; j < K; j++) s += (double)w[t * K + j] * ref[pos[t * K + j] * H + h];
            cref[t * H + h] = (double)out[t * H + h] + s;
        }
    float *dout = dev_f32(out, N * H);
    pd_moe_experts_args eb = ea;
    eb.ids = ids;
    eb.pos = pos;
    eb.weights = w;
    eb.out = dout;
    eb.accumulate = true;
    CHECK_EQ_INT(o->moe_experts(g_be->ctx, &eb), 0);
    check_close("moe_experts with the combination", dout, cref, N * H);
    eb.weights = NULL; /* a combination without its weights */
    CHECK_EQ_INT(o->moe_experts(g_be->ctx, &eb), PD_EINVAL);
    doff[E] = N * K - 1; /* the groups do not hold every choice */
    CHECK_EQ_INT(o->moe_experts(g_be->ctx, &ea), PD_EINVAL);
    ra.dev_offsets = NULL; /* neither copy of the bounds */
    CHECK_EQ_INT(o->moe_route(g_be->ctx, &ra), PD_EINVAL);
    DEV_FREE(dlg, dx, dgu, ddn, ids, rows, pos, doff, w, act, y, dout);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    if (pd_backend_create("cpu", NULL, &g_be, err) != 0) {
        fprintf(stderr, "cannot create cpu backend: %s\n", err);
        return 1;
    }
    test_create_and_memory();
    test_upload_download();
    test_fill_uniform();
    test_embedding_gather_swiglu();
    test_rmsnorm();
    test_head_rmsnorm();
    test_linear();
    test_linear_fused();
    test_rope_store_kv();
    test_attention();
    test_kv_blocks_roundtrip();
    test_fp8_linear();
    test_fp8_kv();
    test_moe_route_ties();
    test_moe_route_combine();
    test_moe_experts();
    pd_backend_destroy(g_be);
    return pd_test_result("test_cpu_backend");
}
