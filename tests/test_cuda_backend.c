/* test_cuda_backend.c -- Every op of the CUDA backend against the CPU backend (the oracle) on
 * the same random inputs (never zeros), rounded to bf16 first so that both backends see
 * identical values. Outputs are poisoned (NaN) before each op, so an unwritten element fails;
 * regions an op must leave alone hold a sentinel. Each comparison prints its relative L2 error
 * and max abs error; tolerances are per op, for bf16 storage with fp32 accumulation.
 * Exits 77 (skipped) when the CUDA backend is not built in or no device is present. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/error.h"
#include "kernels/backend.h"
#include "tests/test_util.h"
#define PD_TEST_SEED 0x243f6a8885a308d3ull
#include "tests/test_rand.h"

#define SENTINEL 1000.0f /* exact in bf16, far outside the data: memory an op must leave alone */
#define TOL_BF16 1e-2   /* relative L2 error of an op whose output is rounded to bf16 */

static pd_backend *g_cpu, *g_gpu;

static float *hmalloc(size_t n)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    if (!p) abort();
    return p;
}

/* n random values of magnitude in [0.1, 1) * amp with random signs, rounded to bf16. */
static float *hrand(size_t n, double amp)
{
    float *x = hmalloc(n);
    for (size_t i = 0; i < n; i++) {
        double m = (0.1 + 0.9 * urand()) * amp;
        x[i] = bf16_round((float)(urand() < 0.5 ? -m : m));
    }
    return x;
}

static float *hconst(size_t n, float v)
{
    float *x = hmalloc(n);
    for (size_t i = 0; i < n; i++) x[i] = v;
    return x;
}

/* The same logical buffer on both backends: f32 on the CPU, act_dtype (bf16) or I32 on the
 * GPU. */
typedef struct {
    void *c, *g;
    size_t n;
    pd_dtype gt; /* GPU dtype */
} pair;

static void *alloc_on(pd_backend *be, pd_dtype t, size_t n)
{
    void *b = NULL;
    int rc = be->ops->alloc(be->ctx, t, n, &b);
    if (rc != 0 || !b) {
        fprintf(stderr, "alloc of %zu elements on %s failed: %d\n", n, be->ops->name, rc);
        abort();
    }
    return b;
}

static void pair_set(pair *p, const float *host)
{
    CHECK_EQ_INT(g_cpu->ops->upload(g_cpu->ctx, p->c, PD_DTYPE_F32, 0, host, PD_DTYPE_F32, p->n), 0);
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, p->g, p->gt, 0, host, PD_DTYPE_F32, p->n), 0);
}

static pair pair_new(const float *host, size_t n) /* activation buffer; host may be NULL */
{
    pair p = {alloc_on(g_cpu, PD_DTYPE_F32, n), alloc_on(g_gpu, g_gpu->ops->act_dtype, n), n,
              g_gpu->ops->act_dtype};
    if (host) pair_set(&p, host);
    return p;
}

static pair pair_f32(const float *host, size_t n) /* an F32 buffer on both */
{
    pair p = {alloc_on(g_cpu, PD_DTYPE_F32, n), alloc_on(g_gpu, PD_DTYPE_F32, n), n, PD_DTYPE_F32};
    pair_set(&p, host);
    return p;
}

static pair pair_i32(const int32_t *host, size_t n)
{
    pair p = {alloc_on(g_cpu, PD_DTYPE_I32, n), alloc_on(g_gpu, PD_DTYPE_I32, n), n, PD_DTYPE_I32};
    CHECK_EQ_INT(g_cpu->ops->upload(g_cpu->ctx, p.c, PD_DTYPE_I32, 0, host, PD_DTYPE_I32, n), 0);
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, p.g, PD_DTYPE_I32, 0, host, PD_DTYPE_I32, n), 0);
    return p;
}

static pair pair_poisoned(size_t n)
{
    float *h = hconst(n, NAN);
    pair p = pair_new(h, n);
    free(h);
    return p;
}

static void pair_fill(pair *p, float v)
{
    float *h = hconst(p->n, v);
    pair_set(p, h);
    free(h);
}

static void pair_free(pair *p)
{
    g_cpu->ops->free(g_cpu->ctx, p->c);
    g_gpu->ops->free(g_gpu->ctx, p->g);
    p->c = p->g = NULL;
}

/* Downloads both sides into fresh host arrays (caller frees). */
static void pair_get(const pair *p, float **cpu, float **gpu)
{
    *cpu = hmalloc(p->n);
    *gpu = hmalloc(p->n);
    CHECK_EQ_INT(g_cpu->ops->download_f32(g_cpu->ctx, *cpu, p->c, PD_DTYPE_F32, 0, p->n), 0);
    CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, *gpu, p->g, p->gt, 0, p->n), 0);
}

/* Compares got (GPU) with ref (CPU): both must have NaN exactly where the other has (a NaN
 * only on the GPU side is an unwritten output), relative L2 error <= tol. Prints the errors. */
static void compare(const char *what, const float *got, const float *ref, size_t n, double tol)
{
    size_t unwritten = 0, extra = 0;
    double num = 0, den = 0, max_abs = 0, max_ref = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(ref[i]) || isnan(got[i])) {
            if (!isnan(ref[i])) unwritten++;
            else if (!isnan(got[i])) extra++;
            continue;
        }
        double d = (double)got[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
        if (fabs(d) > max_abs) max_abs = fabs(d);
        if (fabs(ref[i]) > max_ref) max_ref = fabs(ref[i]);
    }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    printf("  %-44s n=%-9zu rel_l2 %.2e  max_abs %.2e  (max |ref| %.3g, tol %.0e)\n", what, n,
           rel, max_abs, max_ref, tol);
    CHECK_MSG(unwritten == 0, "%s: %zu of %zu elements not written (NaN) on the GPU", what,
              unwritten, n);
    CHECK_MSG(extra == 0, "%s: %zu elements written on the GPU that the CPU leaves NaN", what, extra);
    CHECK_MSG(den > 0, "%s: reference is all zero", what);
    CHECK_MSG(rel <= tol, "%s: relative L2 error %.3g > %.3g (max abs %.3g)", what, rel, tol,
              max_abs);
}

static void compare_pair(const char *what, const pair *p, double tol)
{
    float *c, *g;
    pair_get(p, &c, &g);
    compare(what, g, c, p->n, tol);
    free(c);
    free(g);
}

static int sync_both(void)
{
    int a = g_cpu->ops->sync(g_cpu->ctx), b = g_gpu->ops->sync(g_gpu->ctx);
    return a ? a : b;
}

/* ---- memory ---- */

static void test_memory(void)
{
    const pd_backend_ops *o = g_gpu->ops;
    CHECK_EQ_INT(o->act_dtype, PD_DTYPE_BF16);
    const pd_dtype types[3] = {PD_DTYPE_BF16, PD_DTYPE_F32, PD_DTYPE_I32};
    for (int i = 0; i < 3; i++) {
        const size_t n = 1001;
        void *b = alloc_on(g_gpu, types[i], n);
        float *h = hconst(n, 5.0f);
        CHECK_EQ_INT(o->download_f32(g_gpu->ctx, h, b, types[i], 0, n), 0);
        size_t nz = 0;
        for (size_t j = 0; j < n; j++) nz += h[j] != 0.0f;
        CHECK_MSG(nz == 0, "alloc(%s): %zu of %zu elements not zero", pd_dtype_name(types[i]), nz, n);
        free(h);
        o->free(g_gpu->ctx, b);
    }
    void *b = NULL;
    CHECK(o->alloc(g_gpu->ctx, PD_DTYPE_F16, 4, &b) == PD_EINVAL && b == NULL);
    o->free(g_gpu->ctx, NULL);
}

/* Upload from every source type into every buffer type, at an offset, and back. */
static void test_upload_download(void)
{
    const pd_backend_ops *o = g_gpu->ops;
    enum { N = 3001, OFF = 17 };
    float *src = hmalloc(N);
    for (int i = 0; i < N; i++) src[i] = (float)((urand() - 0.5) * 200.0);
    uint16_t *s_bf = malloc(N * 2), *s_f16 = malloc(N * 2);
    int32_t *s_i = malloc(N * 4);
    for (int i = 0; i < N; i++) {
        s_bf[i] = pd_f32_to_bf16(src[i]);
        s_f16[i] = pd_f32_to_f16(src[i]);
        s_i[i] = (int32_t)lrintf(src[i] * 1000.0f);
    }
    const void *srcs[4] = {src, s_bf, s_f16, s_i};
    const pd_dtype st[4] = {PD_DTYPE_F32, PD_DTYPE_BF16, PD_DTYPE_F16, PD_DTYPE_I32};
    const pd_dtype dt[3] = {PD_DTYPE_BF16, PD_DTYPE_F32, PD_DTYPE_I32};
    float *want = hmalloc(N), *got = hmalloc(N + OFF);
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 4; s++) {
            void *b = alloc_on(g_gpu, dt[d], N + OFF);
            int rc = o->upload(g_gpu->ctx, b, dt[d], OFF, srcs[s], st[s], N);
            if (dt[d] == PD_DTYPE_I32 && st[s] != PD_DTYPE_I32) {
                CHECK_EQ_INT(rc, PD_EINVAL);
                o->free(g_gpu->ctx, b);
                continue;
            }
            CHECK_EQ_INT(rc, 0);
            pd_convert_to_f32(want, srcs[s], st[s], N);
            if (dt[d] == PD_DTYPE_BF16)
                for (int i = 0; i < N; i++) want[i] = bf16_round(want[i]);
            CHECK_EQ_INT(o->download_f32(g_gpu->ctx, got, b, dt[d], 0, N + OFF), 0);
            size_t bad = 0, head = 0;
            for (int i = 0; i < OFF; i++) head += got[i] != 0.0f;
            for (int i = 0; i < N; i++) bad += got[OFF + i] != want[i];
            CHECK_MSG(bad == 0 && head == 0, "upload %s -> %s: %zu wrong, %zu before the offset",
                      pd_dtype_name(st[s]), pd_dtype_name(dt[d]), bad, head);
            /* download from an offset */
            CHECK_EQ_INT(o->download_f32(g_gpu->ctx, got, b, dt[d], OFF + 5, 10), 0);
            for (int i = 0; i < 10; i++) CHECK(got[i] == want[5 + i]);
            o->free(g_gpu->ctx, b);
        }
    printf("  upload/download: 4 source types x 3 buffer types exact\n");
    /* a transfer larger than the staging buffer (16 MiB) */
    const size_t big = (size_t)9 << 20;
    float *h = hmalloc(big), *back = hmalloc(big);
    for (size_t i = 0; i < big; i++) h[i] = bf16_round((float)(i % 1000) - 500.25f);
    void *b = alloc_on(g_gpu, PD_DTYPE_BF16, big);
    CHECK_EQ_INT(o->upload(g_gpu->ctx, b, PD_DTYPE_BF16, 0, h, PD_DTYPE_F32, big), 0);
    CHECK_EQ_INT(o->download_f32(g_gpu->ctx, back, b, PD_DTYPE_BF16, 0, big), 0);
    size_t bad = 0;
    for (size_t i = 0; i < big; i++) bad += back[i] != h[i];
    CHECK_MSG(bad == 0, "large upload/download: %zu of %zu wrong", bad, big);
    o->free(g_gpu->ctx, b);
    free(h);
    free(back);
    free(src); free(s_bf); free(s_f16); free(s_i); free(want); free(got);
}

/* upload_rows / upload_rows_overlap (the runner's step metadata): rows of bytes at pitches,
 * from pinned memory (small ones by a kernel that reads it, larger ones by the copy engine)
 * and from ordinary memory; each checked against the same copy made on the host, the rest of
 * the buffer untouched. Sources keep every int's top byte 0, so that the ints come back through
 * download_f32 exactly. */
static void test_upload_rows(void)
{
    const pd_backend_ops *o = g_gpu->ops;
    if (!o->upload_rows || !o->host_alloc || !o->host_free) return;
    enum { NI = 40000 }; /* ints in the device buffer (156 KiB) */
    const size_t nb = (size_t)NI * 4, sb = (size_t)100 << 10;
    unsigned char *pinned = NULL, *plain = malloc(sb), *model = malloc(nb);
    int32_t *mi = malloc(nb);
    float *got = hmalloc(NI);
    CHECK_EQ_INT(o->host_alloc(g_gpu->ctx, sb, (void **)&pinned), 0);
    if (!pinned || !plain || !model || !mi || !got) goto out;
    for (size_t i = 0; i < sb; i++)
        pinned[i] = plain[i] = i % 4 == 3 ? 0 : (unsigned char)(1 + (i * 37 + i / 251) % 250);
    for (size_t i = 0; i < nb; i++) model[i] = i % 4 == 3 ? 0 : (unsigned char)(i % 13);
    memcpy(mi, model, nb);
    void *b = alloc_on(g_gpu, PD_DTYPE_I32, NI);
    CHECK_EQ_INT(o->upload(g_gpu->ctx, b, PD_DTYPE_I32, 0, mi, PD_DTYPE_I32, NI), 0);
    /* dst offset, dst pitch, src offset, src pitch, row bytes, rows, from ordinary memory, by
     * upload_rows_overlap */
    static const size_t cases[][8] = {
        {8, 0, 4, 0, 4 * 37, 1, 0, 0},         /* one row, ints */
        {400, 32, 40, 40, 24, 5, 0, 1},        /* rows at pitches, ints */
        {1200, 16, 12, 12, 6, 7, 0, 0},        /* rows of 6 bytes: bytes */
        {0, 0, 0, 0, (size_t)80 << 10, 1, 0, 0}, /* past 64 KiB: the copy engine */
        {2000, 64, 8, 48, 40, 9, 0, 1},        /* pitches, by upload_rows_overlap */
        {3000, 20, 0, 28, 20, 4, 1, 0},        /* from ordinary memory */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const size_t *c = cases[k];
        const size_t dpitch = c[1] ? c[1] : c[4], spitch = c[3] ? c[3] : c[4];
        const unsigned char *src = (c[6] ? plain : pinned) + c[2];
        int (*up)(void *, void *, size_t, const void *, size_t, size_t, size_t) =
            c[7] && o->upload_rows_overlap ? o->upload_rows_overlap : o->upload_rows;
        CHECK_EQ_INT(up(g_gpu->ctx, (char *)b + c[0], dpitch, src, spitch, c[4], c[5]), 0);
        for (size_t r = 0; r < c[5]; r++) memcpy(model + c[0] + r * dpitch, src + r * spitch, c[4]);
        CHECK_EQ_INT(o->sync(g_gpu->ctx), 0);
        memcpy(mi, model, nb);
        CHECK_EQ_INT(o->download_f32(g_gpu->ctx, got, b, PD_DTYPE_I32, 0, NI), 0);
        size_t bad = 0;
        for (size_t i = 0; i < NI; i++) bad += got[i] != (float)mi[i];
        CHECK_MSG(bad == 0, "upload_rows case %zu (%zu rows of %zu bytes): %zu ints wrong", k,
                  c[5], c[4], bad);
    }
    CHECK_EQ_INT(o->upload_rows(g_gpu->ctx, b, 4, pinned, 4, 8, 1), PD_EINVAL); /* pitch < row */
    printf("  upload_rows: 6 cases exact (ints, bytes, pitches, past 64 KiB, ordinary memory)\n");
    o->free(g_gpu->ctx, b);
out:
    o->host_free(g_gpu->ctx, pinned);
    free(plain); free(model); free(mi); free(got);
}

/* fill_uniform: the CUDA stream is the CPU's stream, bit for bit (rounded to bf16). */
static void test_fill_uniform(void)
{
    const size_t ns[3] = {1, 4097, 1000003};
    for (int k = 0; k < 3; k++) {
        const size_t n = ns[k];
        const uint64_t seed = 0x1234567ull * (k + 1);
        const float lo = -0.02f, hi = 0.05f;
        float *c = hmalloc(n), *g = hmalloc(n), *g32 = hmalloc(n);
        void *bc = alloc_on(g_cpu, PD_DTYPE_F32, n), *bg = alloc_on(g_gpu, PD_DTYPE_BF16, n);
        void *bg32 = alloc_on(g_gpu, PD_DTYPE_F32, n);
        CHECK_EQ_INT(g_cpu->ops->fill_uniform(g_cpu->ctx, bc, PD_DTYPE_F32, n, seed, lo, hi), 0);
        CHECK_EQ_INT(g_gpu->ops->fill_uniform(g_gpu->ctx, bg, PD_DTYPE_BF16, n, seed, lo, hi), 0);
        CHECK_EQ_INT(g_gpu->ops->fill_uniform(g_gpu->ctx, bg32, PD_DTYPE_F32, n, seed, lo, hi), 0);
        CHECK_EQ_INT(g_cpu->ops->download_f32(g_cpu->ctx, c, bc, PD_DTYPE_F32, 0, n), 0);
        CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, g, bg, PD_DTYPE_BF16, 0, n), 0);
        CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, g32, bg32, PD_DTYPE_F32, 0, n), 0);
        size_t bad = 0, bad32 = 0, out = 0;
        double mean = 0;
        for (size_t i = 0; i < n; i++) {
            bad += g[i] != bf16_round(c[i]);
            bad32 += g32[i] != c[i];
            out += !(g32[i] >= lo && g32[i] < hi);
            mean += g32[i];
        }
        CHECK_MSG(bad == 0 && bad32 == 0 && out == 0,
                  "fill_uniform n=%zu: %zu bf16 and %zu f32 values differ from the CPU's, %zu "
                  "out of range", n, bad, bad32, out);
        printf("  fill_uniform n=%-8zu identical to the CPU stream (mean %.4f)\n", n, mean / n);
        g_cpu->ops->free(g_cpu->ctx, bc);
        g_gpu->ops->free(g_gpu->ctx, bg);
        g_gpu->ops->free(g_gpu->ctx, bg32);
        free(c); free(g); free(g32);
    }
}

/* ---- row ops ---- */

static void test_embedding_gather(void)
{
    enum { V = 1000, DIM = 200, N = 37, NIDX = 9 };
    float *table = hrand((size_t)V * DIM, 1.0);
    int32_t ids[N], rows[NIDX];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)(urand() * V);
    ids[0] = V - 1;
    for (int i = 0; i < NIDX; i++) rows[i] = (int32_t)(urand() * N);
    pair t = pair_new(table, (size_t)V * DIM), id = pair_i32(ids, N), rw = pair_i32(rows, NIDX);
    pair out = pair_poisoned((size_t)N * DIM), g = pair_poisoned((size_t)NIDX * DIM);
    CHECK_EQ_INT(g_cpu->ops->embedding(g_cpu->ctx, id.c, N, t.c, DIM, out.c), 0);
    CHECK_EQ_INT(g_gpu->ops->embedding(g_gpu->ctx, id.g, N, t.g, DIM, out.g), 0);
    compare_pair("embedding (exact)", &out, 0.0);
    CHECK_EQ_INT(g_cpu->ops->gather_rows(g_cpu->ctx, out.c, rw.c, NIDX, DIM, g.c), 0);
    CHECK_EQ_INT(g_gpu->ops->gather_rows(g_gpu->ctx, out.g, rw.g, NIDX, DIM, g.g), 0);
    compare_pair("gather_rows (exact)", &g, 0.0);
    pair_free(&t); pair_free(&id); pair_free(&rw); pair_free(&out); pair_free(&g);
    free(table);
}

static void test_swiglu(void)
{
    /* 8 a thread (f % 8 == 0) and one at a time (172, 36) */
    const int32_t shapes[4][2] = {{5, 172}, {33, 3072}, {1024, 3072}, {7, 36}};
    for (int s = 0; s < 4; s++) {
        const int32_t n = shapes[s][0], f = shapes[s][1];
        float *gu = hrand((size_t)n * 2 * f, 4.0);
        pair in = pair_new(gu, (size_t)n * 2 * f), out = pair_poisoned((size_t)n * f);
        CHECK_EQ_INT(g_cpu->ops->swiglu(g_cpu->ctx, in.c, n, f, out.c), 0);
        CHECK_EQ_INT(g_gpu->ops->swiglu(g_gpu->ctx, in.g, n, f, out.g), 0);
        char what[64];
        snprintf(what, sizeof what, "swiglu n=%d f=%d", n, f);
        compare_pair(what, &out, TOL_BF16);
        pair_free(&in); pair_free(&out);
        free(gu);
    }
}

static void test_rmsnorm(void)
{
    /* the register kernel of 256 threads up to 4096 elements a row, of 1024 up to 16384, the
     * looping one above; from as many rows as SMs (an H100 has 132) with rows of a multiple of
     * 8, the 16-byte one (1, 2, 4 and 8 accesses a thread; 600 x 8 shorter than a block) */
    const int32_t shapes[13][2] = {{3, 64},    {17, 1024},  {5, 4000},   {2, 4096},
                                   {3, 8193},  {1, 8192},   {2, 16384},  {2, 16390},
                                   {300, 8192}, {200, 1000}, {140, 4096}, {133, 16384},
                                   {600, 8}};
    for (int s = 0; s < 13; s++) {
        const int32_t n = shapes[s][0], dim = shapes[s][1];
        const size_t sz = (size_t)n * dim;
        float *x = hrand(sz, 3.0), *res = hrand(sz, 3.0), *w = hrand((size_t)dim, 1.5);
        pair px = pair_new(x, sz), pr = pair_new(res, sz), pw = pair_new(w, (size_t)dim);
        pair out = pair_poisoned(sz);
        char what[96];
        /* plain */
        CHECK_EQ_INT(g_cpu->ops->rmsnorm(g_cpu->ctx, px.c, NULL, pw.c, n, dim, 1e-6f, out.c), 0);
        CHECK_EQ_INT(g_gpu->ops->rmsnorm(g_gpu->ctx, px.g, NULL, pw.g, n, dim, 1e-6f, out.g), 0);
        snprintf(what, sizeof what, "rmsnorm n=%d dim=%d", n, dim);
        compare_pair(what, &out, TOL_BF16);
        /* fused residual add */
        pair_fill(&out, NAN);
        CHECK_EQ_INT(g_cpu->ops->rmsnorm(g_cpu->ctx, px.c, pr.c, pw.c, n, dim, 1e-5f, out.c), 0);
        CHECK_EQ_INT(g_gpu->ops->rmsnorm(g_gpu->ctx, px.g, pr.g, pw.g, n, dim, 1e-5f, out.g), 0);
        snprintf(what, sizeof what, "rmsnorm+residual n=%d dim=%d: out", n, dim);
        compare_pair(what, &out, TOL_BF16);
        snprintf(what, sizeof what, "rmsnorm+residual n=%d dim=%d: residual", n, dim);
        compare_pair(what, &pr, TOL_BF16);
        /* out aliasing x, with a residual */
        pair_set(&pr, res);
        CHECK_EQ_INT(g_cpu->ops->rmsnorm(g_cpu->ctx, px.c, pr.c, pw.c, n, dim, 1e-5f, px.c), 0);
        CHECK_EQ_INT(g_gpu->ops->rmsnorm(g_gpu->ctx, px.g, pr.g, pw.g, n, dim, 1e-5f, px.g), 0);
        snprintf(what, sizeof what, "rmsnorm+residual out=x n=%d dim=%d", n, dim);
        compare_pair(what, &px, TOL_BF16);
        /* out aliasing x, no residual */
        pair_set(&px, x);
        CHECK_EQ_INT(g_cpu->ops->rmsnorm(g_cpu->ctx, px.c, NULL, pw.c, n, dim, 1e-5f, px.c), 0);
        CHECK_EQ_INT(g_gpu->ops->rmsnorm(g_gpu->ctx, px.g, NULL, pw.g, n, dim, 1e-5f, px.g), 0);
        snprintf(what, sizeof what, "rmsnorm out=x n=%d dim=%d", n, dim);
        compare_pair(what, &px, TOL_BF16);
        pair_free(&px); pair_free(&pr); pair_free(&pw); pair_free(&out);
        free(x); free(res); free(w);
    }
}

static void test_head_rmsnorm(void)
{
    const int32_t cases[2][4] = {/* n, n_heads, n_kv_heads, head_dim */
                                 {7, 16, 8, 128}, {3, 4, 2, 32}};
    for (int s = 0; s < 2; s++) {
        const int32_t n = cases[s][0], nh = cases[s][1], nkv = cases[s][2], hd = cases[s][3];
        const int64_t stride = (int64_t)(nh + 2 * nkv) * hd;
        float *qkv = hrand((size_t)n * stride, 2.0), *wq = hrand((size_t)hd, 1.2);
        float *wk = hrand((size_t)hd, 1.2);
        pair p = pair_new(qkv, (size_t)n * stride), pq = pair_new(wq, (size_t)hd);
        pair pk = pair_new(wk, (size_t)hd);
        /* q heads at offset 0, k heads after them; v must stay as it was */
        const size_t koff_c = (size_t)nh * hd * 4, koff_g = (size_t)nh * hd * 2;
        CHECK_EQ_INT(g_cpu->ops->head_rmsnorm(g_cpu->ctx, p.c, n, stride, nh, hd, pq.c, 1e-6f), 0);
        CHECK_EQ_INT(g_gpu->ops->head_rmsnorm(g_gpu->ctx, p.g, n, stride, nh, hd, pq.g, 1e-6f), 0);
        CHECK_EQ_INT(g_cpu->ops->head_rmsnorm(g_cpu->ctx, (char *)p.c + koff_c, n, stride, nkv,
                                              hd, pk.c, 1e-6f), 0);
        CHECK_EQ_INT(g_gpu->ops->head_rmsnorm(g_gpu->ctx, (char *)p.g + koff_g, n, stride, nkv,
                                              hd, pk.g, 1e-6f), 0);
        float *c, *g;
        pair_get(&p, &c, &g);
        char what[96];
        snprintf(what, sizeof what, "head_rmsnorm n=%d heads=%d+%d hd=%d", n, nh, nkv, hd);
        compare(what, g, c, p.n, TOL_BF16);
        size_t v_changed = 0;
        for (int32_t i = 0; i < n; i++)
            for (int64_t j = (int64_t)(nh + nkv) * hd; j < stride; j++)
                v_changed += g[i * stride + j] != qkv[i * stride + j];
        CHECK_MSG(v_changed == 0, "head_rmsnorm changed %zu v elements", v_changed);
        free(c); free(g);
        pair_free(&p); pair_free(&pq); pair_free(&pk);
        free(qkv); free(wq); free(wk);
    }
}

static void test_linear(void)
{
    const int32_t shapes[6][3] = {/* n, k, m */
                                  {1, 64, 96}, {7, 172, 64}, {1, 1024, 3072},
                                  {33, 1024, 4096}, {128, 3072, 1024}, {5, 100, 151}};
    for (int s = 0; s < 6; s++) {
        const int32_t n = shapes[s][0], k = shapes[s][1], m = shapes[s][2];
        float *x = hrand((size_t)n * k, 1.0), *w = hrand((size_t)m * k, 0.1);
        float *b = hrand((size_t)m, 0.5);
        pair px = pair_new(x, (size_t)n * k), pw = pair_new(w, (size_t)m * k);
        pair pb = pair_new(b, (size_t)m), out = pair_poisoned((size_t)n * m);
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            if (with_bias) pair_fill(&out, NAN);
            CHECK_EQ_INT(g_cpu->ops->linear(g_cpu->ctx, px.c, pw.c, with_bias ? pb.c : NULL, n, k,
                                            m, out.c), 0);
            CHECK_EQ_INT(g_gpu->ops->linear(g_gpu->ctx, px.g, pw.g, with_bias ? pb.g : NULL, n, k,
                                            m, out.g), 0);
            char what[96];
            snprintf(what, sizeof what, "linear n=%d k=%d m=%d%s", n, k, m,
                     with_bias ? " +bias" : "");
            compare_pair(what, &out, TOL_BF16);
        }
        pair_free(&px); pair_free(&pw); pair_free(&pb); pair_free(&out);
        free(x); free(w); free(b);
    }
}

/* Downloads rows [r0, r0 + rows) of a GPU [.][m] bf16 buffer. */
static float *gpu_rows(const void *buf, int64_t r0, int32_t rows, int32_t m)
{
    float *h = hmalloc((size_t)rows * m);
    CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, h, buf, g_gpu->ops->act_dtype,
                                          (size_t)r0 * m, (size_t)rows * m), 0);
    return h;
}

/* The decode shapes, n = 1 .. 33 around the streaming kernel's crossover to cuBLAS (32 rows
 * by default, PDSERVE_CUDA_GEMV_MAX_N moves it): Qwen3-0.6B's and Llama-3-8B's products
 * (lm_head excepted: the same k as qkv; the kernel takes only m <= 2048 up to 8 MiB, the
 * others check cuBLAS at small n), and odd ones (m not a multiple of the kernel's 8 rows, k
 * below one warp step of 32 or not a multiple of it, k % 8 != 0 and misaligned operands for
 * the cuBLAS fallback). Besides the CPU comparison: a second call gives the same bits, and,
 * where the kernel takes the product at the default crossover, a row of an n <= 8 row product
 * is bit for bit that row computed alone (the kernel's summation order does not depend on n). */
static void test_linear_small(void)
{
    static const struct { int32_t k, m; int full; } shapes[] = {
        {1024, 4096, 1},  {2048, 1024, 1}, {1024, 6144, 1}, {3072, 1024, 1},
        {4096, 6144, 0},  {14336, 4096, 0}, {8, 1, 1},      {24, 37, 1},
        {40, 1001, 1},    {264, 77, 1},     {2056, 129, 1}, {100, 151, 0},
    };
    static const int32_t n_full[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                     17, 24, 32, 33};
    static const int32_t n_some[] = {1, 2, 8, 9, 16, 17, 32, 33};
    const int32_t n_max = 33;
    const int default_crossover = pd_env_raw("PDSERVE_CUDA_GEMV_MAX_N") == NULL;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int32_t k = shapes[s].k, m = shapes[s].m;
        const int32_t *ns = shapes[s].full ? n_full : n_some;
        const size_t n_ns = shapes[s].full ? sizeof n_full / sizeof n_full[0]
                                           : sizeof n_some / sizeof n_some[0];
        /* one spare element each, for the misaligned case at the end */
        float *x = hrand((size_t)n_max * k + 1, 1.0), *w = hrand((size_t)m * k + 1, 0.1);
        float *b = hrand((size_t)m, 0.5);
        pair px = pair_new(x, (size_t)n_max * k + 1), pw = pair_new(w, (size_t)m * k + 1);
        pair pb = pair_new(b, (size_t)m), out = pair_poisoned((size_t)n_max * m);
        void *one = alloc_on(g_gpu, g_gpu->ops->act_dtype, (size_t)m);
        /* the kernel's shapes (cuda_linear.cu's gemv_takes) */
        const int invariance = default_crossover && k % 8 == 0 && m <= 2048 &&
                               (size_t)m * k * 2 <= ((size_t)8 << 20);
        for (size_t i = 0; i < n_ns; i++) {
            const int32_t n = ns[i];
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                if (!shapes[s].full && with_bias != (int)(i & 1)) continue;
                const void *bc = with_bias ? pb.c : NULL, *bg = with_bias ? pb.g : NULL;
                pair_fill(&out, NAN);
                CHECK_EQ_INT(g_cpu->ops->linear(g_cpu->ctx, px.c, pw.c, bc, n, k, m, out.c), 0);
                CHECK_EQ_INT(g_gpu->ops->linear(g_gpu->ctx, px.g, pw.g, bg, n, k, m, out.g), 0);
                char what[96];
                snprintf(what, sizeof what, "linear n=%d k=%d m=%d%s", n, k, m,
                         with_bias ? " +bias" : "");
                compare_pair(what, &out, TOL_BF16);
                if (n > 16) continue;
                float *all = gpu_rows(out.g, 0, n, m);
                if (n == 5) { /* deterministic: the same bits again */
                    CHECK_EQ_INT(g_gpu->ops->linear(g_gpu->ctx, px.g, pw.g, bg, n, k, m, out.g), 0);
                    float *again = gpu_rows(out.g, 0, n, m);
                    size_t diff = 0;
                    for (size_t e = 0; e < (size_t)n * m; e++) diff += again[e] != all[e];
                    CHECK_MSG(diff == 0, "%s: %zu of %zu elements differ between two calls", what,
                              diff, (size_t)n * m);
                    free(again);
                }
                /* rows 0 and n - 1 alone */
                if (invariance && n > 1 && n <= 8) {
                    for (int32_t r = 0; r < n; r += n - 1) {
                        const char *xr = (const char *)px.g + (size_t)r * k * 2;
                        CHECK_EQ_INT(g_gpu->ops->linear(g_gpu->ctx, xr, pw.g, bg, 1, k, m, one), 0);
                        float *alone = gpu_rows(one, 0, 1, m);
                        size_t diff = 0;
                        for (int32_t j = 0; j < m; j++) diff += alone[j] != all[(size_t)r * m + j];
                        CHECK_MSG(diff == 0, "%s: row %d alone differs in %zu of %d columns", what,
                                  r, diff, m);
                        free(alone);
                    }
                }
                free(all);
            }
        }
        if (shapes[s].full) { /* x and w one element off 16-byte alignment: cuBLAS's path */
            const int32_t n = 3;
            pair_fill(&out, NAN);
            CHECK_EQ_INT(g_cpu->ops->linear(g_cpu->ctx, (const float *)px.c + 1,
                                            (const float *)pw.c + 1, pb.c, n, k, m, out.c), 0);
            CHECK_EQ_INT(g_gpu->ops->linear(g_gpu->ctx, (const char *)px.g + 2,
                                            (const char *)pw.g + 2, pb.g, n, k, m, out.g), 0);
            char what[96];
            snprintf(what, sizeof what, "linear n=%d k=%d m=%d +bias misaligned", n, k, m);
            compare_pair(what, &out, TOL_BF16);
        }
        g_gpu->ops->free(g_gpu->ctx, one);
        pair_free(&px); pair_free(&pw); pair_free(&pb); pair_free(&out);
        free(x); free(w); free(b);
    }
}

/* linear_fused against the CPU's composition: the input norm, SwiGLU, the residual add and
 * the bias in the combinations a layer uses and more, at n on both sides of the fused kernel's
 * limits (cuda_linear.cu: n <= 32 for small products, n <= 8 where a norm or SwiGLU is fused
 * into a larger one, up to 32 MiB of weights; the rest is composed from separate launches). */
static void test_linear_fused(void)
{
    enum { NORM = 1, SWIGLU = 2, ACC = 4, BIAS = 8 };
    static const struct { int32_t k, m; } shapes[] = {
        {1024, 4096}, {2048, 1024}, {1024, 3072}, {3072, 1024}, {2048, 2048}, {4096, 2560},
        {40, 1001},   {264, 77},    {24, 37},
    };
    static const int modes[] = {NORM,   NORM | BIAS, SWIGLU | NORM, SWIGLU,
                                ACC,    ACC | BIAS,  NORM | ACC,    SWIGLU | NORM | BIAS};
    static const int32_t ns[] = {1, 3, 8, 9, 17, 32, 33};
    const int32_t n_max = 33;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int32_t k = shapes[s].k, m = shapes[s].m;
        float *x = hrand((size_t)n_max * k, 1.5), *w = hrand((size_t)2 * m * k, 0.1);
        float *b = hrand((size_t)2 * m, 0.5), *nw = hrand((size_t)k, 0.5);
        float *init = hrand((size_t)n_max * m, 2.0);
        for (int32_t i = 0; i < k; i++) nw[i] += 1.0f;
        pair px = pair_new(x, (size_t)n_max * k), pw = pair_new(w, (size_t)2 * m * k);
        pair pb = pair_new(b, (size_t)2 * m), pn = pair_new(nw, (size_t)k);
        pair out = pair_poisoned((size_t)n_max * m), tx = pair_poisoned((size_t)n_max * k);
        pair to = pair_poisoned((size_t)n_max * 2 * m);
        for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++) {
            const int md = modes[mi];
            for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
                const int32_t n = ns[i];
                if ((s + i + mi) % 2 && n != 1 && n != 9) continue; /* a sample of the grid */
                if (md & ACC) pair_set(&out, init);
                else pair_fill(&out, NAN);
                pd_linear_args a = {.n = n, .k = k, .m = m, .norm_eps = 1e-6f,
                                    .swiglu = (md & SWIGLU) != 0, .accumulate = (md & ACC) != 0};
                a.x = px.c; a.w = pw.c; a.out = out.c; a.tmp_x = tx.c; a.tmp_out = to.c;
                a.bias = md & BIAS ? pb.c : NULL;
                a.norm_w = md & NORM ? pn.c : NULL;
                CHECK_EQ_INT(g_cpu->ops->linear_fused(g_cpu->ctx, &a), 0);
                a.x = px.g; a.w = pw.g; a.out = out.g; a.tmp_x = tx.g; a.tmp_out = to.g;
                a.bias = md & BIAS ? pb.g : NULL;
                a.norm_w = md & NORM ? pn.g : NULL;
                CHECK_EQ_INT(g_gpu->ops->linear_fused(g_gpu->ctx, &a), 0);
                char what[96];
                snprintf(what, sizeof what, "linear_fused n=%d k=%d m=%d%s%s%s%s", n, k, m,
                         md & NORM ? " norm" : "", md & SWIGLU ? " swiglu" : "",
                         md & ACC ? " +=" : "", md & BIAS ? " +bias" : "");
                /* rows past n stay as they were: compare the first n only */
                float *cpu = hmalloc((size_t)n * m);
                CHECK_EQ_INT(g_cpu->ops->download_f32(g_cpu->ctx, cpu, out.c, PD_DTYPE_F32, 0,
                                                      (size_t)n * m), 0);
                float *gpu = gpu_rows(out.g, 0, n, m);
                compare(what, gpu, cpu, (size_t)n * m, TOL_BF16);
                free(cpu);
                free(gpu);
            }
        }
        pd_linear_args bad = {.x = px.g, .w = pw.g, .out = out.g, .n = 1, .k = k, .m = m,
                              .swiglu = true, .accumulate = true, .tmp_out = to.g};
        CHECK_EQ_INT(g_gpu->ops->linear_fused(g_gpu->ctx, &bad), PD_EINVAL);
        bad.accumulate = false;
        bad.norm_w = pn.g; /* a norm without its scratch */
        CHECK_EQ_INT(g_gpu->ops->linear_fused(g_gpu->ctx, &bad), PD_EINVAL);
        pair_free(&px); pair_free(&pw); pair_free(&pb); pair_free(&pn);
        pair_free(&out); pair_free(&tx); pair_free(&to);
        free(x); free(w); free(b); free(nw); free(init);
    }
}

static void test_rope_store_kv(void)
{
    const int32_t cases[5][3] = {/* heads, kv heads, head_dim: the first, fourth and fifth
                                  * take the warp-per-head kernel */
                                 {16, 8, 128}, {4, 2, 32}, {8, 4, 8}, {3, 1, 64}, {4, 4, 256}};
    for (int s = 0; s < 5; s++) {
        const int32_t H = cases[s][0], KVH = cases[s][1], HD = cases[s][2], HALF = HD / 2;
        enum { T = 6, BS = 4, NB = 5 };
        const size_t row = (size_t)(H + 2 * KVH) * HD, kvrow = (size_t)KVH * HD;
        const size_t cache = (size_t)NB * BS * kvrow;
        const int32_t pos[T] = {0, 5, 17, 123, 4095, 40000}, slots[T] = {3, 9, -1, 14, 0, 19};
        float *inv = hmalloc((size_t)HALF);
        for (int i = 0; i < HALF; i++) inv[i] = (float)pow(1e6, -2.0 * i / HD);
        pair pf = pair_f32(inv, (size_t)HALF), pp = pair_i32(pos, T), ps = pair_i32(slots, T);
        const float factors[2] = {1.0f, 1.37f};
        float *qn = hrand((size_t)HD, 1.5), *kn = hrand((size_t)HD, 1.5);
        pair pqn = pair_new(qn, (size_t)HD), pkn = pair_new(kn, (size_t)HD);
        for (int fi = 0; fi < 4; fi++) { /* factor 1 / 1.37, without / with the head norms */
            const bool norm = fi >= 2;
            float *qkv = hrand(T * row, 2.0);
            pair pq = pair_new(qkv, T * row), kc = pair_new(NULL, cache), vc = pair_new(NULL, cache);
            pair_fill(&kc, SENTINEL);
            pair_fill(&vc, SENTINEL);
            pd_rope_args a = {.positions = pp.c, .slot_mapping = ps.c, .inv_freq = pf.c,
                              .qkv = pq.c, .k_cache = kc.c, .v_cache = vc.c, .n_tokens = T,
                              .n_heads = H, .n_kv_heads = KVH, .head_dim = HD,
                              .attn_factor = factors[fi & 1], .q_norm = norm ? pqn.c : NULL,
                              .k_norm = norm ? pkn.c : NULL, .norm_eps = 1e-6f};
            CHECK_EQ_INT(g_cpu->ops->rope_store_kv(g_cpu->ctx, &a), 0);
            a.positions = pp.g;
            a.slot_mapping = ps.g;
            a.inv_freq = pf.g;
            a.qkv = pq.g;
            a.k_cache = kc.g;
            a.v_cache = vc.g;
            a.q_norm = norm ? pqn.g : NULL;
            a.k_norm = norm ? pkn.g : NULL;
            CHECK_EQ_INT(g_gpu->ops->rope_store_kv(g_gpu->ctx, &a), 0);
            char what[96];
            snprintf(what, sizeof what, "rope qkv H=%d KVH=%d HD=%d factor=%g%s", H, KVH, HD,
                     factors[fi & 1], norm ? " +qk norm" : "");
            compare_pair(what, &pq, TOL_BF16);
            snprintf(what, sizeof what, "rope k_cache H=%d KVH=%d HD=%d factor=%g%s", H, KVH, HD,
                     factors[fi & 1], norm ? " +qk norm" : "");
            compare_pair(what, &kc, TOL_BF16);
            /* v is copied: exact; untouched slots keep the sentinel on both */
            float *c, *g;
            pair_get(&vc, &c, &g);
            size_t bad = 0;
            for (size_t i = 0; i < cache; i++) bad += c[i] != g[i];
            CHECK_MSG(bad == 0, "rope v_cache: %zu of %zu differ", bad, cache);
            free(c); free(g);
            pair_get(&kc, &c, &g);
            bad = 0;
            for (size_t i = 0; i < cache; i++) bad += (c[i] == SENTINEL) != (g[i] == SENTINEL);
            CHECK_MSG(bad == 0, "rope k_cache: %zu elements written on one side only", bad);
            free(c); free(g);
            pair_free(&pq); pair_free(&kc); pair_free(&vc);
            free(qkv);
        }
        pair_free(&pf); pair_free(&pp); pair_free(&ps); pair_free(&pqn); pair_free(&pkn);
        free(inv); free(qn); free(kn);
    }
}

/* ---- attention ---- */

typedef struct {
    int32_t n_heads, n_kv_heads, head_dim, block_size, window;
} attn_shape;

/* A batch with the given query and context lengths over a shuffled paged cache; runs the
 * decode entry when every query has length 1 (and decode is set), else prefill. decode 2 passes
 * max_ctx_len 0 (as a replayed graph does: the kernel reads each context, 0 = padding row). */
static void run_attention(const char *what, const attn_shape *sh, int n_seqs,
                          const int32_t *q_lens, const int32_t *ctx_lens, int decode)
{
    const int32_t H = sh->n_heads, KVH = sh->n_kv_heads, HD = sh->head_dim, BS = sh->block_size;
    int32_t n_tokens = 0, max_q = 0, max_ctx = 0, n_blocks = 0;
    for (int s = 0; s < n_seqs; s++) {
        n_tokens += q_lens[s];
        if (q_lens[s] > max_q) max_q = q_lens[s];
        if (ctx_lens[s] > max_ctx) max_ctx = ctx_lens[s];
        n_blocks += (ctx_lens[s] + BS - 1) / BS;
    }
    n_blocks += 3; /* spare blocks nobody references */
    const int32_t mbps = (max_ctx + BS - 1) / BS + 1;
    int32_t *perm = malloc((size_t)n_blocks * 4), *bt = malloc((size_t)n_seqs * mbps * 4);
    int32_t *cu = malloc((size_t)(n_seqs + 1) * 4);
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = (int)(urand() * (i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int next = 0;
    cu[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        cu[s + 1] = cu[s] + q_lens[s];
        const int need = (ctx_lens[s] + BS - 1) / BS;
        for (int b = 0; b < mbps; b++) bt[s * mbps + b] = b < need ? perm[next++] : -1;
    }
    const int64_t qstride = (int64_t)(H + 2 * KVH) * HD;
    const size_t cache = (size_t)n_blocks * BS * KVH * HD;
    float *q = hrand((size_t)n_tokens * qstride, 1.5), *k = hrand(cache, 1.5);
    float *v = hrand(cache, 1.0);
    pair pq = pair_new(q, (size_t)n_tokens * qstride), pk = pair_new(k, cache);
    pair pv = pair_new(v, cache), out = pair_poisoned((size_t)n_tokens * H * HD);
    pair pcu = pair_i32(cu, (size_t)n_seqs + 1), pctx = pair_i32(ctx_lens, (size_t)n_seqs);
    pair pbt = pair_i32(bt, (size_t)n_seqs * mbps);
    pd_attn_args a = {.q_row_stride = qstride, .n_seqs = n_seqs, .n_tokens = n_tokens,
                      .max_q_len = max_q, .max_ctx_len = decode == 2 ? 0 : max_ctx,
                      .max_blocks_per_seq = mbps,
                      .n_heads = H, .n_kv_heads = KVH, .head_dim = HD, .block_size = BS,
                      .sliding_window = sh->window, .scale = (float)(1.0 / sqrt((double)HD))};
    a.q = pq.c; a.k_cache = pk.c; a.v_cache = pv.c; a.out = out.c;
    a.cu_q = pcu.c; a.ctx_lens = pctx.c; a.block_tables = pbt.c;
    CHECK_EQ_INT((decode ? g_cpu->ops->attention_decode : g_cpu->ops->attention_prefill)(g_cpu->ctx, &a), 0);
    a.q = pq.g; a.k_cache = pk.g; a.v_cache = pv.g; a.out = out.g;
    a.cu_q = pcu.g; a.ctx_lens = pctx.g; a.block_tables = pbt.g;
    if (!decode) /* the leading one-row sequences, as the model runner tells them */
        while (a.n_decode < n_seqs && q_lens[a.n_decode] == 1) a.n_decode++;
    CHECK_EQ_INT((decode ? g_gpu->ops->attention_decode : g_gpu->ops->attention_prefill)(g_gpu->ctx, &a), 0);
    CHECK_EQ_INT(sync_both(), 0);
    char name[160];
    snprintf(name, sizeof name, "%s H=%d/%d HD=%d bs=%d win=%d", what, H, KVH, HD, BS, sh->window);
    compare_pair(name, &out, TOL_BF16);
    pair_free(&pq); pair_free(&pk); pair_free(&pv); pair_free(&out);
    pair_free(&pcu); pair_free(&pctx); pair_free(&pbt);
    free(q); free(k); free(v); free(perm); free(bt); free(cu);
}

/* Prefill batches of the shapes the tensor-core kernel takes (cuda_attention_prefill.cu: head
 * size 64 or 128, 1 to 8 query heads per KV head; tiles of 64 or 128 rows of (token, head),
 * keys in tiles of 64). */
static void test_attention_flash(void)
{
    const attn_shape shapes[7] = {
        {16, 8, 128, 16, 0},   /* Qwen3-0.6B: 2 query heads per KV head */
        {8, 8, 64, 16, 0},     /* no GQA */
        {16, 4, 128, 24, 0},   /* 4 per KV head, block size not a power of two */
        {8, 1, 128, 16, 0},    /* 8 per KV head */
        {12, 4, 64, 12, 0},    /* 3 per KV head: tile rows not a multiple of the group */
        {16, 2, 64, 16, 100},  /* 8 per KV head, sliding window */
        {16, 8, 128, 10, 300}, /* sliding window, block size 10 */
    };
    /* one batch: a one-token prompt, a prompt of several tiles plus a few rows, chunks after
     * cached prefixes (short and long), a prompt one row past a tile, an exact tile */
    const int32_t q[6] = {1, 500, 33, 2, 129, 64}, c[6] = {1, 500, 100, 2000, 129, 101};
    for (int s = 0; s < 7; s++) run_attention("prefill flash", &shapes[s], 6, q, c, 0);
    /* contexts up to 8192: a chunk at the end of a long cached prefix among short ones,
     * without and with a window */
    const int32_t lq[3] = {40, 300, 7}, lc[3] = {8192, 300, 4000};
    run_attention("prefill flash long", &shapes[0], 3, lq, lc, 0);
    const attn_shape win = {16, 8, 128, 16, 1000};
    run_attention("prefill flash long", &win, 3, lq, lc, 0);
    /* mixed: running decodes first (the decode kernel takes them), then prompts and a
     * one-token chunk among them (the prefill kernel); with a window too */
    const int32_t xq[7] = {1, 1, 1, 1, 300, 1, 70}, xc[7] = {700, 5, 2000, 64, 300, 129, 170};
    run_attention("prefill flash mixed", &shapes[0], 7, xq, xc, 0);
    run_attention("prefill flash mixed", &shapes[5], 7, xq, xc, 0);
    run_attention("prefill flash mixed", &win, 7, xq, xc, 0);
    /* enough rows for the 128-row tiles (several blocks per SM): 36 sequences of 20 to 169
     * new tokens, a third of them after a cached prefix; then 32 heads without GQA, window */
    enum { NM = 36 };
    int32_t mq[NM], mc[NM];
    for (int s = 0; s < NM; s++) {
        mq[s] = 20 + (s * 37) % 150;
        mc[s] = mq[s] + (s % 3 ? 0 : 11 * s);
    }
    run_attention("prefill flash many", &shapes[0], NM, mq, mc, 0);
    const attn_shape wide = {32, 32, 64, 16, 64};
    run_attention("prefill flash many", &wide, 20, mq, mc, 0);
}

static void test_attention(void)
{
    const attn_shape shapes[5] = {
        {16, 8, 128, 16, 0}, /* Qwen3-0.6B */
        {4, 2, 32, 16, 0},   /* qwen3-tiny */
        {8, 4, 8, 16, 0},    /* stories260k */
        {8, 1, 256, 8, 0},   /* MQA, widest head */
        {6, 2, 64, 16, 37},  /* sliding window */
    };
    for (int s = 0; s < 5; s++) {
        const attn_shape *sh = &shapes[s];
        /* prefill: a fresh prompt, a chunk after a cached prefix, a one-token sequence */
        const int32_t pq[3] = {45, 20, 1}, pc[3] = {45, 83, 9};
        run_attention("prefill mixed", sh, 3, pq, pc, 0);
        /* decodes first, then a prompt (the attention op's n_decode hint set) */
        const int32_t mq[3] = {1, 1, 30}, mc[3] = {300, 17, 40};
        run_attention("prefill after decodes", sh, 3, mq, mc, 0);
        /* decode: several sequences, one query each, short and long contexts */
        const int32_t dq[5] = {1, 1, 1, 1, 1}, dc[5] = {1, 16, 17, 300, 1500};
        run_attention("decode", sh, 5, dq, dc, 1);
    }
    /* one long prompt (no N x N matrix anywhere) */
    const int32_t lq[1] = {2100}, lc[1] = {2100};
    run_attention("prefill long", &shapes[1], 1, lq, lc, 0);
    /* decode shapes for the split-KV kernel's edges and its fallback: 3 query heads per KV
     * head, a head size it does not take (80), 16 query heads per KV head (more than it takes) */
    const attn_shape more[3] = {{12, 4, 64, 16, 0}, {12, 4, 80, 16, 0}, {32, 2, 128, 16, 0}};
    for (int s = 0; s < 3; s++) {
        const int32_t dq[5] = {1, 1, 1, 1, 1}, dc[5] = {3, 33, 250, 700, 1100};
        run_attention("decode", &more[s], 5, dq, dc, 1);
    }
    /* long contexts: two sequences (many splits each), then 64 sequences of 8192 down to 191
     * tokens (a grid that fills the GPU without splitting), Qwen3-0.6B's heads */
    enum { NL = 64 };
    int32_t lq2[NL], lc2[NL];
    for (int s = 0; s < NL; s++) {
        lq2[s] = 1;
        lc2[s] = 8192 - 127 * s;
    }
    const int32_t lc1[2] = {8192, 5003};
    run_attention("decode long", &shapes[0], 2, lq2, lc1, 1);
    run_attention("decode long batch 64", &shapes[0], NL, lq2, lc2, 1);
    const attn_shape win = {16, 8, 128, 16, 1000};
    run_attention("decode long", &win, 2, lq2, lc1, 1);
    test_attention_flash();
}

/* Every decode kernel (cuda_attention_decode.cu: the tensor-core one with rings of 3 and 4
 * slots, PDSERVE_CUDA_DECODE_MMA, default 2; with it off the cp.async ring of 2 or 4 slots and
 * the register kernel, PDSERVE_CUDA_DECODE_STAGES) on a backend of their own, with known and
 * unknown longest contexts, padding rows, contexts around the rings' tiles, head sizes 64 and
 * 128 and GQA 1 to 8; up to 128 splits combined by their last block. */
static void test_decode_kernels(void)
{
    /* {mma, stages}; the default (2, 2) is test_attention's */
    static const char *const kern[][2] = {{"3", "2"}, {"4", "2"}, {"0", "0"}, {"0", "2"},
                                          {"0", "4"}};
    const attn_shape shapes[4] = {
        {16, 8, 128, 16, 0}, {8, 8, 64, 16, 0}, {32, 4, 128, 24, 0}, {16, 2, 64, 16, 200},
    };
    const int32_t dq[7] = {1, 1, 1, 1, 1, 1, 1};
    const int32_t dc[7] = {1, 15, 16, 17, 49, 300, 2900}, pad[7] = {5, 0, 64, 0, 1000, 0, 33};
    pd_backend *saved = g_gpu;
    for (size_t i = 0; i < sizeof kern / sizeof kern[0]; i++) {
        char err[PD_ERR_LEN] = "";
        pd_backend_params p = pd_backend_default_params();
        pd_backend *b = NULL;
        pd_env_set("PDSERVE_CUDA_DECODE_MMA", kern[i][0]);
        pd_env_set("PDSERVE_CUDA_DECODE_STAGES", kern[i][1]);
        const int rc = pd_backend_create("cuda", &p, &b, err);
        pd_env_set("PDSERVE_CUDA_DECODE_MMA", NULL);
        pd_env_set("PDSERVE_CUDA_DECODE_STAGES", NULL);
        CHECK_EQ_INT(rc, 0);
        if (rc != 0) continue;
        g_gpu = b;
        printf("  decode kernel, PDSERVE_CUDA_DECODE_MMA=%s PDSERVE_CUDA_DECODE_STAGES=%s\n",
               kern[i][0], kern[i][1]);
        for (int s = 0; s < 4; s++) {
            run_attention("decode", &shapes[s], 7, dq, dc, 1);
            run_attention("decode graph", &shapes[s], 7, dq, dc, 2);
            run_attention("decode graph padded", &shapes[s], 7, dq, pad, 2);
        }
        /* one KV head, one long context: the most splits (128) */
        const attn_shape mqa = {8, 1, 128, 16, 0};
        const int32_t one[1] = {1}, ctx8k[1] = {8192};
        run_attention("decode many splits", &mqa, 1, one, ctx8k, 1);
        run_attention("decode many splits graph", &mqa, 1, one, ctx8k, 2);
        g_gpu = saved;
        pd_backend_destroy(b);
    }
}

/* decode_layers (cuda_decode_layers.cu: a decode step's layers in one persistent kernel)
 * against the CPU running the ops it stands for, layer after layer: the residual stream after
 * three layers, the last layer's scratch outputs, the logits of the fused head (final norm
 * and lm_head), and the K / V each layer stored, for batches of
 * 1, 2, 3 and 8 sequences over a shuffled paged cache (a padding row of context 0 among them),
 * with and without Qwen3's head norms, biases, a sliding window; GQA 2, 3 and 8; with `embed`
 * the rows come from an embedding table by token id (the embedding op fused), the GPU's
 * residual stream poisoned on entry. */
typedef struct {
    int32_t hidden, inter, heads, kv_heads, hd, window;
    bool qk_norm, bias;
} dl_shape;

enum { DL_LAYERS = 3, DL_BS = 16 };

static void run_decode_layers(const dl_shape *sh, int32_t n, const int32_t *ctx, bool embed)
{
    const int32_t H = sh->hidden, F = sh->inter, HD = sh->hd, NQ = sh->heads * HD;
    const int32_t QKV = (sh->heads + 2 * sh->kv_heads) * HD, KVR = sh->kv_heads * HD;
    int32_t max_ctx = 1, n_blocks = 3;
    for (int32_t s = 0; s < n; s++) {
        if (ctx[s] > max_ctx) max_ctx = ctx[s];
        n_blocks += (ctx[s] + DL_BS - 1) / DL_BS;
    }
    const int32_t mbps = (max_ctx + DL_BS - 1) / DL_BS + 1;
    int32_t *perm = malloc((size_t)n_blocks * 4), *bt = malloc((size_t)n * mbps * 4);
    int32_t pos[8], slot[8];
    for (int32_t i = 0; i < n_blocks; i++) perm[i] = i;
    for (int32_t i = n_blocks - 1; i > 0; i--) {
        int32_t j = (int32_t)(urand() * (i + 1)), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int32_t next = 0;
    for (int32_t s = 0; s < n; s++) {
        const int32_t need = (ctx[s] + DL_BS - 1) / DL_BS;
        for (int32_t b = 0; b < mbps; b++) bt[s * mbps + b] = b < need ? perm[next++] : -1;
        pos[s] = ctx[s] > 0 ? ctx[s] - 1 : 0;
        slot[s] = ctx[s] > 0 ? bt[s * mbps + pos[s] / DL_BS] * DL_BS + pos[s] % DL_BS : -1;
    }
    const size_t cache = (size_t)n_blocks * DL_BS * KVR;
    float *inv = hmalloc((size_t)HD / 2);
    for (int32_t i = 0; i < HD / 2; i++) inv[i] = (float)pow(1e6, -2.0 * i / HD);
    pair pf = pair_f32(inv, (size_t)HD / 2), pp = pair_i32(pos, (size_t)n);
    pair ps = pair_i32(slot, (size_t)n), pctx = pair_i32(ctx, (size_t)n);
    pair pbt = pair_i32(bt, (size_t)n * mbps);
    int32_t cu[9];
    for (int32_t i = 0; i <= n; i++) cu[i] = i;
    pair pcu = pair_i32(cu, (size_t)n + 1);
    /* weights: attn_norm, qkv, qkv_bias, q_norm, k_norm, o, o_bias, mlp_norm, gate_up, down */
    const size_t wn[10] = {(size_t)H, (size_t)QKV * H, (size_t)QKV, (size_t)HD, (size_t)HD,
                           (size_t)H * NQ, (size_t)H, (size_t)H, (size_t)2 * F * H,
                           (size_t)H * F};
    const double amp[10] = {0.5, 0.06, 0.3, 0.5, 0.5, 0.04, 0.3, 0.5, 0.06, 0.03};
    pair w[DL_LAYERS][10], kc[DL_LAYERS], vc[DL_LAYERS];
    pd_layer_args lg[DL_LAYERS];
    for (int32_t l = 0; l < DL_LAYERS; l++) {
        for (int i = 0; i < 10; i++) {
            float *h = hrand(wn[i], amp[i]);
            if (i == 0 || i == 3 || i == 4 || i == 7)
                for (size_t j = 0; j < wn[i]; j++) h[j] = bf16_round(h[j] + 1.0f);
            w[l][i] = pair_new(h, wn[i]);
            free(h);
        }
        float *k = hrand(cache, 1.5), *v = hrand(cache, 1.0);
        kc[l] = pair_new(k, cache);
        vc[l] = pair_new(v, cache);
        free(k);
        free(v);
    }
    float *x0 = hrand((size_t)n * H, 1.0);
    pair resid = pair_new(x0, (size_t)n * H), qkv = pair_poisoned((size_t)n * QKV);
    /* the fused embedding: row s of the table's row ids[s] (distinct ids), the rest random */
    enum { VT = 50 };
    int32_t ids[8];
    pair table = {0}, pids = {0};
    if (embed) {
        float *t = hrand((size_t)VT * H, 1.0);
        for (int32_t s = 0; s < n; s++) {
            ids[s] = (7 * s + 3) % VT;
            memcpy(t + (size_t)ids[s] * H, x0 + (size_t)s * H, (size_t)H * sizeof *t);
        }
        table = pair_new(t, (size_t)VT * H);
        pids = pair_i32(ids, (size_t)n);
        free(t);
        float *nan = hconst((size_t)n * H, NAN);
        CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, resid.g, g_gpu->ops->act_dtype, 0, nan,
                                        PD_DTYPE_F32, (size_t)n * H), 0);
        free(nan);
    }
    pair attn = pair_poisoned((size_t)n * NQ), act = pair_poisoned((size_t)n * F);
    pair tx = pair_poisoned((size_t)n * H), tgu = pair_poisoned((size_t)n * 2 * F);
    const float scale = (float)(1.0 / sqrt((double)HD));
    /* the CPU: the ops decode_layers stands for */
    for (int32_t l = 0; l < DL_LAYERS; l++) {
        void *cx = g_cpu->ctx;
        pd_linear_args a1 = {.x = resid.c, .w = w[l][1].c, .bias = sh->bias ? w[l][2].c : NULL,
                             .out = qkv.c, .n = n, .k = H, .m = QKV, .norm_w = w[l][0].c,
                             .norm_eps = 1e-6f, .tmp_x = tx.c};
        CHECK_EQ_INT(g_cpu->ops->linear_fused(cx, &a1), 0);
        pd_rope_args ra = {.qkv = qkv.c, .positions = pp.c, .slot_mapping = ps.c,
                           .inv_freq = pf.c, .k_cache = kc[l].c, .v_cache = vc[l].c,
                           .n_tokens = n, .n_heads = sh->heads, .n_kv_heads = sh->kv_heads,
                           .head_dim = HD, .attn_factor = 1.0f,
                           .q_norm = sh->qk_norm ? w[l][3].c : NULL,
                           .k_norm = sh->qk_norm ? w[l][4].c : NULL, .norm_eps = 1e-6f};
        CHECK_EQ_INT(g_cpu->ops->rope_store_kv(cx, &ra), 0);
        pd_attn_args aa = {.q = qkv.c, .q_row_stride = QKV, .k_cache = kc[l].c,
                           .v_cache = vc[l].c, .out = attn.c, .cu_q = pcu.c, .ctx_lens = pctx.c,
                           .block_tables = pbt.c, .n_seqs = n, .n_tokens = n, .max_q_len = 1,
                           .max_ctx_len = 0, .max_blocks_per_seq = mbps,
                           .n_heads = sh->heads, .n_kv_heads = sh->kv_heads, .head_dim = HD,
                           .block_size = DL_BS, .sliding_window = sh->window, .scale = scale};
        CHECK_EQ_INT(g_cpu->ops->attention_decode(cx, &aa), 0);
        pd_linear_args a2 = {.x = attn.c, .w = w[l][5].c, .bias = sh->bias ? w[l][6].c : NULL,
                             .out = resid.c, .n = n, .k = NQ, .m = H, .accumulate = true};
        CHECK_EQ_INT(g_cpu->ops->linear_fused(cx, &a2), 0);
        pd_linear_args a3 = {.x = resid.c, .w = w[l][8].c, .out = act.c, .n = n, .k = H,
                             .m = F, .norm_w = w[l][7].c, .norm_eps = 1e-6f, .swiglu = true,
                             .tmp_x = tx.c, .tmp_out = tgu.c};
        CHECK_EQ_INT(g_cpu->ops->linear_fused(cx, &a3), 0);
        pd_linear_args a4 = {.x = act.c, .w = w[l][9].c, .out = resid.c, .n = n, .k = F, .m = H,
                             .accumulate = true};
        CHECK_EQ_INT(g_cpu->ops->linear_fused(cx, &a4), 0);
        lg[l] = (pd_layer_args){
            .attn_norm = w[l][0].g, .qkv = w[l][1].g, .qkv_bias = sh->bias ? w[l][2].g : NULL,
            .q_norm = sh->qk_norm ? w[l][3].g : NULL, .k_norm = sh->qk_norm ? w[l][4].g : NULL,
            .o_proj = w[l][5].g, .o_bias = sh->bias ? w[l][6].g : NULL, .mlp_norm = w[l][7].g,
            .gate_up = w[l][8].g, .down = w[l][9].g, .k_cache = kc[l].g, .v_cache = vc[l].g};
    }
    /* the head (final norm, lm_head) too, except at n = 3 */
    const bool head = n != 3;
    enum { V = 1000 };
    float *fn = hrand((size_t)H, 0.5), *lm = hrand((size_t)V * H, 0.05);
    for (int32_t i = 0; i < H; i++) fn[i] = bf16_round(fn[i] + 1.0f);
    /* lm_head's odd rows repeat the even ones: every logit is tied with its neighbour, and the
     * greedy pick must be the lower (even) id */
    for (int32_t v = 1; v < V; v += 2) memcpy(lm + (size_t)v * H, lm + (size_t)(v - 1) * H, (size_t)H * 4);
    pair pfn = pair_new(fn, (size_t)H), plm = pair_new(lm, (size_t)V * H);
    pair logits = pair_poisoned((size_t)n * V), hn = pair_poisoned((size_t)n * H);
    if (head) {
        CHECK_EQ_INT(g_cpu->ops->rmsnorm(g_cpu->ctx, resid.c, NULL, pfn.c, n, H, 1e-6f, hn.c), 0);
        CHECK_EQ_INT(g_cpu->ops->linear(g_cpu->ctx, hn.c, plm.c, NULL, n, H, V, logits.c), 0);
    }
    pd_decode_args da = {.layers = lg, .n_layers = DL_LAYERS, .resid = resid.g, .qkv = qkv.g,
                         .attn = attn.g, .act = act.g, .n = n, .hidden = H, .intermediate = F,
                         .n_heads = sh->heads, .n_kv_heads = sh->kv_heads, .head_dim = HD,
                         .norm_eps = 1e-6f, .positions = pp.g, .slot_mapping = ps.g,
                         .ctx_lens = pctx.g, .block_tables = pbt.g, .max_blocks_per_seq = mbps,
                         .block_size = DL_BS, .sliding_window = sh->window, .scale = scale,
                         .inv_freq = pf.g, .attn_factor = 1.0f};
    if (embed) {
        da.ids = pids.g;
        da.embed = table.g;
    }
    /* with the head, the greedy picks too, for the sample op (poisoned first) */
    int32_t pk0[8], pslot = PD_SAMPLE_SYNC_SLOT;
    for (int i = 0; i < 8; i++) pk0[i] = -7;
    pair pk = pair_i32(pk0, (size_t)n), psl = pair_i32(&pslot, 1);
    if (head) {
        da.final_norm = pfn.g;
        da.lm_head = plm.g;
        da.logits = logits.g;
        da.vocab = V;
        da.pick_ids = pk.g;
        da.pick_slot = psl.g;
    }
    int rc = g_gpu->ops->decode_layers(g_gpu->ctx, &da);
    CHECK_EQ_INT(rc, 0);
    CHECK_EQ_INT(sync_both(), 0);
    if (rc == 0 && head && g_gpu->ops->sample) {
        /* the sample op takes the picks (greedy rows), then, picks used, samples: both give
         * each row's first largest logit, which is what went to pick_ids */
        pd_sample_row rows[8];
        memset(rows, 0, sizeof rows);
        for (int i = 0; i < 8; i++) {
            rows[i].top_p = 1.0f;
            rows[i].repetition_penalty = 1.0f;
        }
        int32_t t1[8], t2[8];
        CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, logits.g, n, V, rows, NULL, 0, t1, NULL, NULL),
                     0);
        CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, logits.g, n, V, rows, NULL, 0, t2, NULL, NULL),
                     0);
        float *gl = hmalloc((size_t)n * V), *gp = hmalloc((size_t)n);
        CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, gl, logits.g, logits.gt, 0,
                                              (size_t)n * V), 0);
        CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, gp, pk.g, PD_DTYPE_I32, 0, (size_t)n), 0);
        for (int32_t q = 0; q < n; q++) {
            int32_t best = 0;
            for (int32_t v = 1; v < V; v++)
                if (gl[(size_t)q * V + v] > gl[(size_t)q * V + best]) best = v;
            CHECK_MSG(t1[q] == best && t2[q] == best && (int32_t)gp[q] == best && best % 2 == 0,
                      "decode_layers n=%d row %d: greedy pick %d (fused), %d (sampled), %d "
                      "(pick_ids), first largest logit %d", n, q, t1[q], t2[q], (int)gp[q], best);
        }
        free(gl);
        free(gp);
    }
    char what[128];
    snprintf(what, sizeof what, "decode_layers n=%d H=%d/%d HD=%d%s%s win=%d%s", n, sh->heads,
             sh->kv_heads, HD, sh->qk_norm ? " qknorm" : "", sh->bias ? " bias" : "",
             sh->window, embed ? " embed" : "");
    if (rc == 0) {
        compare_pair(what, &resid, 2e-2);
        compare_pair("  last layer's attention", &attn, 2e-2);
        compare_pair("  last layer's swiglu", &act, 2e-2);
        if (head) compare_pair("  logits (final norm, lm_head)", &logits, 2e-2);
        /* each layer's stored K and V at the new slots; the rest of the cache untouched */
        for (int32_t l = 0; l < DL_LAYERS; l++)
            for (int kv = 0; kv < 2; kv++) {
                float *c, *g;
                pair_get(kv ? &vc[l] : &kc[l], &c, &g);
                size_t differ = 0;
                for (size_t i = 0; i < cache; i++) {
                    const int32_t sl = (int32_t)(i / KVR);
                    bool fresh = false;
                    for (int32_t s = 0; s < n; s++) fresh |= slot[s] == sl;
                    if (!fresh) differ += c[i] != g[i];
                }
                CHECK_MSG(differ == 0, "%s: %zu cache elements changed outside the new slots",
                          what, differ);
                float *cs = hmalloc((size_t)n * KVR), *gs = hmalloc((size_t)n * KVR);
                int32_t m = 0;
                for (int32_t s = 0; s < n; s++) {
                    if (slot[s] < 0) continue;
                    memcpy(cs + (size_t)m * KVR, c + (size_t)slot[s] * KVR, (size_t)KVR * 4);
                    memcpy(gs + (size_t)m * KVR, g + (size_t)slot[s] * KVR, (size_t)KVR * 4);
                    m++;
                }
                char kw[64];
                snprintf(kw, sizeof kw, "  layer %d new %s", l, kv ? "V" : "K");
                compare(kw, gs, cs, (size_t)m * KVR, 2e-2);
                free(cs); free(gs); free(c); free(g);
            }
    }
    pair_free(&resid); pair_free(&qkv); pair_free(&attn); pair_free(&act); pair_free(&tx);
    pair_free(&tgu); pair_free(&pf); pair_free(&pp); pair_free(&ps); pair_free(&pctx);
    pair_free(&pbt); pair_free(&pcu);
    for (int32_t l = 0; l < DL_LAYERS; l++) {
        for (int i = 0; i < 10; i++) pair_free(&w[l][i]);
        pair_free(&kc[l]);
        pair_free(&vc[l]);
    }
    pair_free(&pfn); pair_free(&plm); pair_free(&logits); pair_free(&hn);
    pair_free(&pk); pair_free(&psl);
    if (embed) {
        pair_free(&table);
        pair_free(&pids);
    }
    free(fn); free(lm);
    free(x0); free(inv); free(perm); free(bt);
}

static void test_decode_layers(void)
{
    if (!g_gpu->ops->decode_layers) return;
    const dl_shape shapes[3] = {
        {1024, 3072, 16, 8, 128, 0, true, false}, /* Qwen3-0.6B's layer */
        {768, 2048, 12, 4, 64, 40, false, true},  /* GQA 3, biases, a window */
        {512, 1536, 16, 2, 64, 0, true, true},    /* GQA 8 */
    };
    /* 520 keys: in 32 splits of 17 (GQA 8: 2 KV heads, 32 splits on a 132-SM GPU) the last
     * would have none */
    const int32_t c1[1] = {300}, c1b[1] = {520}, c2[2] = {129, 31}, c3[3] = {1, 17, 700};
    const int32_t c8[8] = {5, 0, 64, 33, 1000, 16, 2, 129};
    for (int s = 0; s < 3; s++) {
        run_decode_layers(&shapes[s], 1, c1, false);
        run_decode_layers(&shapes[s], 1, c1, true);
        run_decode_layers(&shapes[s], 1, c1b, false);
        run_decode_layers(&shapes[s], 2, c2, false);
        run_decode_layers(&shapes[s], 3, c3, s == 1);
        run_decode_layers(&shapes[s], 8, c8, s == 2);
    }
    /* shapes it leaves to the ops: nothing queued, PD_EUNSUPPORTED; bad arguments: PD_EINVAL */
    pd_layer_args none[1] = {{0}};
    pd_decode_args a = {.layers = none, .n_layers = 1, .n = 9, .hidden = 256, .intermediate = 256,
                        .n_heads = 4, .n_kv_heads = 1, .head_dim = 64, .block_size = 16,
                        .max_blocks_per_seq = 1};
    CHECK_EQ_INT(g_gpu->ops->decode_layers(g_gpu->ctx, &a), PD_EINVAL); /* NULL buffers */
    void *buf = alloc_on(g_gpu, PD_DTYPE_BF16, 1 << 16);
    a.resid = a.qkv = a.attn = a.act = buf;
    a.positions = a.slot_mapping = a.ctx_lens = a.block_tables = buf;
    a.inv_freq = buf;
    CHECK_EQ_INT(g_gpu->ops->decode_layers(g_gpu->ctx, &a), PD_EUNSUPPORTED); /* n = 9 */
    a.n = 1;
    a.embed = buf; /* an embedding table without the ids */
    CHECK_EQ_INT(g_gpu->ops->decode_layers(g_gpu->ctx, &a), PD_EINVAL);
    a.embed = NULL;
    a.hidden = 320; /* k % 256 != 0 */
    CHECK_EQ_INT(g_gpu->ops->decode_layers(g_gpu->ctx, &a), PD_EUNSUPPORTED);
    a.hidden = 256;
    a.intermediate = 256;
    a.head_dim = 80;
    CHECK_EQ_INT(g_gpu->ops->decode_layers(g_gpu->ctx, &a), PD_EUNSUPPORTED);
    a.head_dim = 64;
    a.n_heads = 3; /* not a multiple of the KV heads... */
    a.n_kv_heads = 2;
    CHECK_EQ_INT(g_gpu->ops->decode_layers(g_gpu->ctx, &a), PD_EINVAL);
    a.n_heads = 4;
    a.n_kv_heads = 1;
    CHECK_EQ_INT(g_gpu->ops->decode_layers(g_gpu->ctx, &a), PD_EINVAL); /* layer 0 all NULL */
    g_gpu->ops->free(g_gpu->ctx, buf);
    CHECK_EQ_INT(g_gpu->ops->sync(g_gpu->ctx), 0);
}

/* ---- KV blocks to and from the host ---- */

static void test_kv_blocks(void)
{
    enum { NB = 40, BS = 16, KVH = 8, HD = 128, N = 7 };
    const size_t be = (size_t)BS * KVH * HD, cache = (size_t)NB * be;
    float *init = hrand(cache, 2.0);
    void *c = alloc_on(g_gpu, PD_DTYPE_BF16, cache);
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, c, PD_DTYPE_BF16, 0, init, PD_DTYPE_F32, cache), 0);
    const int32_t ids[N] = {39, 0, 5, 17, 18, 3, 22}, ids2[N] = {1, 2, 38, 10, 11, 30, 31};
    float *host = hconst((size_t)N * be, NAN);
    CHECK_EQ_INT(g_gpu->ops->kv_blocks_to_host(g_gpu->ctx, c, ids, N, be, host), 0);
    size_t bad = 0;
    for (int i = 0; i < N; i++)
        for (size_t j = 0; j < be; j++) bad += host[i * be + j] != init[(size_t)ids[i] * be + j];
    CHECK_MSG(bad == 0, "kv_blocks_to_host: %zu of %zu wrong", bad, (size_t)N * be);
    /* back into other blocks; every other block unchanged */
    CHECK_EQ_INT(g_gpu->ops->kv_blocks_from_host(g_gpu->ctx, c, ids2, N, be, host), 0);
    float *after = hmalloc(cache);
    CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, after, c, PD_DTYPE_BF16, 0, cache), 0);
    bad = 0;
    for (int b = 0; b < NB; b++) {
        int slot = -1;
        for (int i = 0; i < N; i++)
            if (ids2[i] == b) slot = i;
        for (size_t j = 0; j < be; j++) {
            float want = slot >= 0 ? host[slot * be + j] : init[(size_t)b * be + j];
            bad += after[(size_t)b * be + j] != want;
        }
    }
    CHECK_MSG(bad == 0, "kv_blocks_from_host: %zu of %zu wrong", bad, cache);
    printf("  kv_blocks_to_host / from_host: %d blocks of %zu elements exact\n", N, be);
    g_gpu->ops->free(g_gpu->ctx, c);
    free(init); free(host); free(after);
}

/* Raw block copies between the device cache and a pinned host mirror (KV staging). */
static void test_kv_blocks_copy(void)
{
    enum { NB = 40, BS = 16, KVH = 8, HD = 128, N = 7 };
    const size_t be = (size_t)BS * KVH * HD, bb = be * 2, cache = (size_t)NB * be;
    float *init = hrand(cache, 2.0);
    void *c = alloc_on(g_gpu, PD_DTYPE_BF16, cache);
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, c, PD_DTYPE_BF16, 0, init, PD_DTYPE_F32, cache), 0);
    uint16_t *ref = malloc(cache * 2), *mirror = malloc(cache * 2), *want = malloc(cache * 2);
    for (size_t i = 0; i < cache; i++) ref[i] = pd_f32_to_bf16(init[i]); /* exact: init came back */
    memset(mirror, 0xCD, cache * 2);
    CHECK(g_gpu->ops->host_register && g_gpu->ops->host_unregister && g_gpu->ops->kv_blocks_copy);
    CHECK_EQ_INT(g_gpu->ops->host_register(g_gpu->ctx, mirror, cache * 2), 0);
    /* a run of consecutive ids (one copy), singles, the last block */
    const int32_t ids[N] = {17, 18, 19, 0, 5, 39, 21};
    CHECK_EQ_INT(g_gpu->ops->kv_blocks_copy(g_gpu->ctx, c, ids, N, bb, mirror, true), 0);
    memset(want, 0xCD, cache * 2);
    for (int i = 0; i < N; i++) memcpy(want + (size_t)ids[i] * be, ref + (size_t)ids[i] * be, bb);
    CHECK_MSG(memcmp(mirror, want, cache * 2) == 0, "kv_blocks_copy to host: wrong bytes");
    /* back: new bytes in some mirror blocks; only those device blocks change */
    for (size_t j = 0; j < 3 * be; j++) mirror[8 * be + j] = pd_f32_to_bf16((float)(j % 97) - 48.f);
    for (size_t j = 0; j < be; j++) mirror[30 * be + j] = pd_f32_to_bf16(0.5f * (float)(j % 13));
    const int32_t back[4] = {8, 9, 10, 30};
    CHECK_EQ_INT(g_gpu->ops->kv_blocks_copy(g_gpu->ctx, c, back, 4, bb, mirror, false), 0);
    memcpy(want, ref, cache * 2);
    for (int i = 0; i < 4; i++) memcpy(want + (size_t)back[i] * be, mirror + (size_t)back[i] * be, bb);
    uint16_t *after = malloc(cache * 2);
    CHECK_EQ_INT(g_gpu->ops->kv_blocks_copy(g_gpu->ctx, c, (const int32_t[1]){0}, 0, bb, after, true), 0);
    int32_t all[NB];
    for (int b = 0; b < NB; b++) all[b] = b;
    CHECK_EQ_INT(g_gpu->ops->kv_blocks_copy(g_gpu->ctx, c, all, NB, bb, after, true), 0);
    CHECK_MSG(memcmp(after, want, cache * 2) == 0, "kv_blocks_copy from host: wrong bytes");
    const int32_t neg[1] = {-3};
    CHECK_EQ_INT(g_gpu->ops->kv_blocks_copy(g_gpu->ctx, c, neg, 1, bb, mirror, true), PD_EINVAL);
    CHECK_EQ_INT(g_gpu->ops->host_unregister(g_gpu->ctx, mirror), 0);
    printf("  kv_blocks_copy to / from a pinned mirror: %d + 4 blocks of %zu bytes exact\n", N, bb);
    g_gpu->ops->free(g_gpu->ctx, c);
    free(init); free(ref); free(mirror); free(want); free(after);
}

/* kv_blocks_clone (copy on write of forked choices) on the device against the CPU op over
 * the same bytes: 70 pairs (two launches), 6 regions, an odd block size (the byte kernel). */
static void test_kv_blocks_clone(void)
{
    enum { NB = 160, NR = 6, N = 70 };
    CHECK(g_gpu->ops->kv_blocks_clone != NULL && g_cpu->ops->kv_blocks_clone != NULL);
    if (!g_gpu->ops->kv_blocks_clone || !g_cpu->ops->kv_blocks_clone) return;
    int32_t src[N], dst[N];
    for (int i = 0; i < N; i++) {
        src[i] = i % 9;       /* a few sources, each cloned many times */
        dst[i] = 20 + 2 * i;  /* unordered targets above every source */
    }
    dst[3] = 159;
    const size_t sizes[2] = {16 * 8 * 128 * 2, 4 * 3 * 5 * 2 + 2}; /* bf16 block; odd bytes */
    for (int t = 0; t < 2; t++) {
        const size_t bb = sizes[t], region = (size_t)NB * bb, total = region * NR;
        uint8_t *init = malloc(total), *want = malloc(total), *got = malloc(total);
        for (size_t i = 0; i < total; i++) init[i] = (uint8_t)(i * 2654435761u >> 13);
        memcpy(want, init, total);
        CHECK_EQ_INT(g_cpu->ops->kv_blocks_clone(g_cpu->ctx, want, region, NR, src, dst, N, bb), 0);
        void *d = alloc_on(g_gpu, PD_DTYPE_BF16, (total + 1) / 2);
        const int32_t all[1] = {0};
        /* the whole pool as one "block" through the raw copy op, both ways */
        CHECK_EQ_INT(g_gpu->ops->kv_blocks_copy(g_gpu->ctx, d, all, 1, total, init, false), 0);
        CHECK_EQ_INT(g_gpu->ops->kv_blocks_clone(g_gpu->ctx, d, region, NR, src, dst, N, bb), 0);
        CHECK_EQ_INT(g_gpu->ops->kv_blocks_copy(g_gpu->ctx, d, all, 1, total, got, true), 0);
        CHECK_MSG(memcmp(got, want, total) == 0, "kv_blocks_clone (block %zu bytes): cuda differs "
                  "from cpu", bb);
        const int32_t bad_dst[1] = {0}; /* a target that is also a source */
        CHECK_EQ_INT(g_gpu->ops->kv_blocks_clone(g_gpu->ctx, d, region, NR, src, bad_dst, 1, bb),
                     PD_EINVAL);
        const int32_t out_of_pool[1] = {NB};
        CHECK_EQ_INT(g_gpu->ops->kv_blocks_clone(g_gpu->ctx, d, region, NR, src, out_of_pool, 1, bb),
                     PD_EINVAL);
        g_gpu->ops->free(g_gpu->ctx, d);
        free(init); free(want); free(got);
    }
    printf("  kv_blocks_clone: %d pairs x %d regions equal to the cpu op\n", N, NR);
}

static void test_errors(void)
{
    /* arguments the entries reject before launching anything */
    pd_attn_args a = {.n_tokens = 1, .n_seqs = 1, .n_heads = 3, .n_kv_heads = 2, .head_dim = 8};
    CHECK(g_gpu->ops->attention_prefill(g_gpu->ctx, &a) == PD_EINVAL);
    pd_rope_args r = {.n_tokens = 1, .n_heads = 1, .n_kv_heads = 1, .head_dim = 7};
    CHECK(g_gpu->ops->rope_store_kv(g_gpu->ctx, &r) == PD_EINVAL);
    CHECK(g_gpu->ops->linear(g_gpu->ctx, NULL, NULL, NULL, 1, 1, 1, NULL) == PD_EINVAL);
    CHECK_EQ_INT(g_gpu->ops->sync(g_gpu->ctx), 0);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    setenv("PDSERVE_CUDA_FUSED_DECODE", "8", 0); /* decode_layers at every n it takes */
    pd_backend_params p = pd_backend_default_params();
    int rc = pd_backend_create("cuda", &p, &g_gpu, err);
    if (rc < 0) {
        fprintf(stderr, "test_cuda_backend: skipped: %s\n", err);
        return 77;
    }
    p.n_threads = 0;
    if (pd_backend_create("cpu", &p, &g_cpu, err) < 0) {
        fprintf(stderr, "cpu backend: %s\n", err);
        pd_backend_destroy(g_gpu);
        return 1;
    }
    printf("test_cuda_backend: every op on cuda against cpu\n");
    test_memory();
    test_upload_download();
    test_upload_rows();
    test_fill_uniform();
    test_embedding_gather();
    test_swiglu();
    test_rmsnorm();
    test_head_rmsnorm();
    test_linear();
    test_linear_small();
    test_linear_fused();
    test_rope_store_kv();
    test_attention();
    test_decode_kernels();
    test_decode_layers();
    test_kv_blocks();
    test_kv_blocks_copy();
    test_kv_blocks_clone();
    test_errors();
    pd_backend_destroy(g_cpu);
    pd_backend_destroy(g_gpu);
    return pd_test_result("test_cuda_backend");
}
