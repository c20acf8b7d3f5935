/* test_cuda_fp8.c -- The CUDA backend's FP8 weight op set (pd_backend_ops.fp8) against a host
 * reference: the activation quantization kernel equals pd_fp8_quant_row bit for bit, and
 * linear_fused, over shapes (odd m, k off the 16 and 128 grids, Llama-3-8B sizes), groups (k,
 * 128), activation modes (none, dynamic, static), n (decode to prefill) and its fusions (norm,
 * bias, residual add, SwiGLU), equals the product in double of the pd_fp8_quant_row rows (of the
 * bf16-rounded, normed input) and the dequantized weight, to a tolerance relative to the
 * output's scale (see TOL_*). Also a capture of the op in a graph replays to the same bits.
 * Exits 77 (skipped) when the CUDA backend is not built in or no device is present. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/error.h"
#include "kernels/backend.h"
#ifdef PD_WITH_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif
#include "tests/test_util.h"
#define PD_TEST_SEED 0x9e3779b97f4a7c15ull
#include "tests/test_rand.h"

/* An element passes when |gpu - ref| <= TOL_SCALE * rms(ref over the case) + TOL_REL * |ref|,
 * and the case's relative L2 error is below TOL_L2. The sources of difference: the bf16
 * rounding of the output (2^-9 relative; twice with the residual add or SwiGLU's bf16 gate
 * and up), f32 accumulation in another order, and on the weight-only path of large n the
 * bf16 rounding of the dequantized weight (2^-9 of each element, summing to about 2^-9 of the
 * output's scale); a rare e4m3 rounding flip where the normed row's bf16 rounding differs
 * moves one term by one e4m3 step. A wrong scale, group or layout is off by O(1). */
#define TOL_SCALE 1e-2
#define TOL_REL (1.0 / 128)
/* With SwiGLU: gate and up are each rounded to bf16 before silu(gate) * up, so a product that
 * lands on the other side of a bf16 rounding boundary than the reference's moves the output
 * by one bf16 step of gate or up (2^-8), and silu's slope can double that: the H100 runs showed
 * up to 2.6 bf16 steps of the output (3184 vs 3141.75, 1.3%). */
#define TOL_REL_SWIGLU (1.0 / 32)
/* ... and 3 x TOL_SCALE of the output's rms: where silu(gate) is small but gate and up large
 * (gate -3, up 50), one step of gate moves the output by about up / 128 (seen: 0.93 at rms 55
 * on the cuBLASLt path of n = 600). */
#define TOL_L2 5e-3
#define SAMPLE_COLS 48 /* output columns checked per row for large products */

static pd_backend *g_gpu;

/* n bf16 values of magnitude (0.1 .. 1) * amp, random signs; every 37th times 20 (outliers:
 * the groups' maxima differ). */
static float *rand_bf16(size_t n, double amp)
{
    float *x = xmalloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) {
        double v = (0.1 + 0.9 * urand()) * amp * (i % 37 == 5 ? 20.0 : 1.0);
        x[i] = bf16_round((float)(urand() < 0.5 ? -v : v));
    }
    return x;
}

static void *dev_alloc(pd_dtype t, size_t n)
{
    void *b = NULL;
    int rc = g_gpu->ops->alloc(g_gpu->ctx, t, n, &b);
    if (rc != 0 || !b) {
        fprintf(stderr, "alloc of %zu elements failed: %d\n", n, rc);
        abort();
    }
    return b;
}

static void *dev_bf16(const float *host, size_t n)
{
    void *b = dev_alloc(PD_DTYPE_BF16, n);
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, b, PD_DTYPE_BF16, 0, host, PD_DTYPE_F32, n), 0);
    return b;
}

static void download(float *dst, const void *src, pd_dtype t, size_t n)
{
    CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, dst, src, t, 0, n), 0);
}

/* ---- the activation quantization, bit for bit ---- */

static void test_quant_exact(void)
{
#ifdef PD_WITH_CUDA
    static const struct { int32_t n, k, group; pd_act_quant act; float in_scale; } cases[] = {
        {5, 96, 96, PD_ACT_DYNAMIC, 0},      {9, 4096, 4096, PD_ACT_DYNAMIC, 0},
        {7, 14336, 128, PD_ACT_DYNAMIC, 0},  {3, 200, 128, PD_ACT_DYNAMIC, 0},
        {4, 1000, 1000, PD_ACT_DYNAMIC, 0},  {6, 384, 384, PD_ACT_STATIC, 0.004f},
        {6, 384, 128, PD_ACT_STATIC, 1e-5f}, {33, 640, 128, PD_ACT_DYNAMIC, 0},
    };
    int n_bad_total = 0;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int32_t n = cases[ci].n, k = cases[ci].k, group = cases[ci].group;
        const size_t total = (size_t)n * k;
        /* rows of very different magnitudes, one all zeros, one of subnormal-range values */
        float *x = rand_bf16(total, 1.0);
        for (int32_t r = 0; r < n; r++) {
            const double amp = r == 1 ? 0.0 : r == 2 ? 1e-6 : pow(10.0, (double)(r % 5) - 2);
            for (int32_t j = 0; j < k; j++)
                x[(size_t)r * k + j] = bf16_round((float)(x[(size_t)r * k + j] * amp));
        }
        void *dx = dev_bf16(x, total);
        float *dout = dev_alloc(PD_DTYPE_F32, total);
        CHECK_EQ_INT(pd_cuda__fp8_quant_rows_f32(g_gpu->ctx, dx, n, k, group, cases[ci].act,
                                                 cases[ci].in_scale, dout), 0);
        float *got = xmalloc(total * sizeof *got), *want = xmalloc(total * sizeof *want);
        download(got, dout, PD_DTYPE_F32, total);
        int n_bad = 0;
        for (int32_t r = 0; r < n; r++)
            pd_fp8_quant_row(x + (size_t)r * k, want + (size_t)r * k, k, group, cases[ci].act,
                             cases[ci].in_scale);
        for (size_t i = 0; i < total; i++) {
            if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
                if (n_bad++ < 5)
                    fprintf(stderr, "quant n %d k %d group %d: element %zu (x %.9g): gpu %.9g, "
                            "pd_fp8_quant_row %.9g\n", n, k, group, i, x[i], got[i], want[i]);
            }
        }
        CHECK_MSG(n_bad == 0, "quant case %zu: %d of %zu elements differ", ci, n_bad, total);
        n_bad_total += n_bad;
        free(got);
        free(want);
        free(x);
        g_gpu->ops->free(g_gpu->ctx, dx);
        g_gpu->ops->free(g_gpu->ctx, dout);
    }
    printf("  activation quantization: %zu cases, %d elements differ from pd_fp8_quant_row\n",
           sizeof cases / sizeof cases[0], n_bad_total);
#endif
}

/* ---- linear_fused against the host ---- */

/* A random FP8 weight of mw rows: codes of uniform values in [-448, 448] (never NaN), scales
 * per row (group k) or per 128-row band and 128-column block (group 128; with band_uniform
 * false each row its own). */
typedef struct {
    uint8_t *w8;
    float *scale;
    int32_t m, k, group, ng;
} host_weight;

static host_weight make_weight(int32_t mw, int32_t k, int32_t group, bool band_uniform)
{
    host_weight h = {NULL, NULL, mw, k, group, (k + group - 1) / group};
    h.w8 = xmalloc((size_t)mw * k);
    h.scale = xmalloc((size_t)mw * h.ng * sizeof(float));
    for (size_t i = 0; i < (size_t)mw * k; i++)
        h.w8[i] = pd_f32_to_e4m3((float)((2.0 * urand() - 1.0) * 448.0));
    for (int32_t i = 0; i < mw; i++)
        for (int32_t g = 0; g < h.ng; g++) {
            float s;
            if (group != k && band_uniform && i % 128 != 0)
                s = h.scale[(size_t)(i / 128 * 128) * h.ng + g];
            else
                s = (float)((0.5 + 1.5 * urand()) * 1e-3);
            h.scale[(size_t)i * h.ng + g] = s;
        }
    return h;
}

static double deq(const host_weight *h, int32_t i, int32_t j)
{
    return (double)pd_e4m3_to_f32(h->w8[(size_t)i * h->k + j]) *
           (double)h->scale[(size_t)i * h->ng + j / h->group];
}

enum { F_NORM = 1, F_BIAS = 2, F_ACC = 4, F_SWIGLU = 8 };
static const int k_variants[] = {0, F_BIAS, F_NORM, F_ACC | F_BIAS, F_SWIGLU,
                                 F_NORM | F_SWIGLU | F_BIAS, F_NORM | F_ACC};
#define N_VARIANTS ((int)(sizeof k_variants / sizeof k_variants[0]))

typedef struct {
    double max_err_rel; /* worst |err| / rms over the cases */
    int n_cases, n_failed;
} lin_stats;

/* One call: y = linear_fused(x, w) with the fusions of `flags`, against the reference on all
 * columns (small products) or SAMPLE_COLS of them. */
static void run_case(void *wdev, const host_weight *h, pd_act_quant act, float in_scale,
                     int32_t m, int32_t n, int flags, lin_stats *st, const char *shape)
{
    const int32_t k = h->k, mw = h->m;
    const bool swiglu = flags & F_SWIGLU, acc = flags & F_ACC;
    float *x = rand_bf16((size_t)n * k, 1.0);
    float *norm_w = rand_bf16(k, 1.0), *bias = rand_bf16(mw, 0.5);
    float *init = rand_bf16((size_t)n * m, 2.0);
    for (int32_t j = 0; j < k; j++) norm_w[j] = bf16_round(1.0f + 0.25f * norm_w[j]);
    void *dx = dev_bf16(x, (size_t)n * k), *dnw = dev_bf16(norm_w, k), *db = dev_bf16(bias, mw);
    void *dout, *dtx = dev_alloc(PD_DTYPE_BF16, (size_t)n * k);
    void *dto = dev_alloc(PD_DTYPE_BF16, (size_t)n * mw);
    if (acc) {
        dout = dev_bf16(init, (size_t)n * m);
    } else { /* poisoned: an unwritten element fails */
        float *nan = xmalloc((size_t)n * m * sizeof *nan);
        for (size_t i = 0; i < (size_t)n * m; i++) nan[i] = NAN;
        dout = dev_bf16(nan, (size_t)n * m);
        free(nan);
    }
    pd_linear_args a = {0};
    a.x = dx;
    a.w = wdev;
    a.bias = flags & F_BIAS ? db : NULL;
    a.out = dout;
    a.n = n;
    a.k = k;
    a.m = m;
    a.norm_w = flags & F_NORM ? dnw : NULL;
    a.norm_eps = 1e-5f;
    a.swiglu = swiglu;
    a.accumulate = acc;
    a.tmp_x = dtx;
    a.tmp_out = dto;
    const int rc = g_gpu->ops->fp8->linear_fused(g_gpu->ctx, &a);
    CHECK_EQ_INT(rc, 0);
    float *got = xmalloc((size_t)n * m * sizeof *got);
    download(got, dout, PD_DTYPE_BF16, (size_t)n * m);

    /* the reference: the normed row as the backend's rmsnorm rounds it, quantized */
    float *xq = xmalloc((size_t)k * sizeof *xq);
    const bool all = (double)m * k <= (1 << 20);
    const int32_t n_cols = all ? m : SAMPLE_COLS;
    int32_t *cols = xmalloc((size_t)n_cols * sizeof *cols);
    for (int32_t c = 0; c < n_cols; c++)
        cols[c] = all ? c : c == 0 ? 0 : c == 1 ? m - 1 : (int32_t)(urand() * m);
    double *ref = xmalloc((size_t)n * n_cols * sizeof *ref);
    /* the dequantized weight rows of the checked columns (gate rows, then up rows) */
    const int32_t n_wr = swiglu ? 2 * n_cols : n_cols;
    double *wd = xmalloc((size_t)n_wr * k * sizeof *wd);
    for (int32_t c = 0; c < n_wr; c++) {
        const int32_t i = c < n_cols ? cols[c] : m + cols[c - n_cols];
        /* weight-only products of more rows than the small-n kernel takes run the bf16
         * product of the weight dequantized to bf16: the bf16-dequantized model, exactly */
        const bool bf16_w = act == PD_ACT_NONE && n > 8;
        for (int32_t t = 0; t < k; t++)
            wd[(size_t)c * k + t] = bf16_w ? bf16_round((float)deq(h, i, t)) : deq(h, i, t);
    }
    int n_nonfinite = 0;
    for (size_t i = 0; i < (size_t)n * m; i++) n_nonfinite += !isfinite(got[i]);
    double ss_ref = 0.0;
    for (int32_t r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * k;
        if (flags & F_NORM) {
            double ss = 0.0;
            for (int32_t j = 0; j < k; j++) ss += (double)xr[j] * xr[j];
            const float inv = (float)(1.0 / sqrt(ss / k + 1e-5f));
            for (int32_t j = 0; j < k; j++) xq[j] = bf16_round(norm_w[j] * (xr[j] * inv));
        } else {
            memcpy(xq, xr, (size_t)k * sizeof *xq);
        }
        pd_fp8_quant_row(xq, xq, k, h->group, act, in_scale);
        for (int32_t c = 0; c < n_cols; c++) {
            const int32_t j = cols[c];
            double v;
            if (swiglu) {
                double g = 0.0, u = 0.0;
                const double *wg = wd + (size_t)c * k, *wu = wd + (size_t)(n_cols + c) * k;
                for (int32_t t = 0; t < k; t++) {
                    g += (double)xq[t] * wg[t];
                    u += (double)xq[t] * wu[t];
                }
                if (flags & F_BIAS) {
                    g += bias[j];
                    u += bias[m + j];
                }
                g = bf16_round((float)g);
                u = bf16_round((float)u);
                v = g / (1.0 + exp(-g)) * u;
            } else {
                v = 0.0;
                const double *wr = wd + (size_t)c * k;
                for (int32_t t = 0; t < k; t++) v += (double)xq[t] * wr[t];
                if (flags & F_BIAS) v += bias[j];
                if (acc) v += init[(size_t)r * m + j];
            }
            ref[(size_t)r * n_cols + c] = v;
            ss_ref += v * v;
        }
    }
    const double rms = sqrt(ss_ref / ((double)n * n_cols)) + 1e-30;
    double se = 0.0, worst = 0.0;
    int n_bad = 0;
    for (int32_t r = 0; r < n; r++)
        for (int32_t c = 0; c < n_cols; c++) {
            const double rv = ref[(size_t)r * n_cols + c], gv = got[(size_t)r * m + cols[c]];
            const double e = fabs(gv - rv);
            se += e * e;
            if (!(e <= (swiglu ? 3 : 1) * TOL_SCALE * rms + (swiglu ? TOL_REL_SWIGLU : TOL_REL) * fabs(rv))) {
                if (n_bad++ < 3)
                    fprintf(stderr, "  %s n %d flags %d: out[%d][%d] = %.6g, reference %.6g "
                            "(rms %.3g)\n", shape, n, flags, r, cols[c], gv, rv, rms);
            }
            if (e / rms > worst) worst = e / rms;
        }
    const double l2 = sqrt(se / ((double)n * n_cols)) / rms;
    const bool ok = rc == 0 && n_bad == 0 && n_nonfinite == 0 && l2 < (swiglu ? 2 * TOL_L2 : TOL_L2);
    CHECK_MSG(ok, "%s act %d n %d flags %d: %d elements off, %d not finite, rel L2 %.3g", shape,
              (int)act, n, flags, n_bad, n_nonfinite, l2);
    st->n_cases++;
    st->n_failed += !ok;
    if (worst > st->max_err_rel) st->max_err_rel = worst;
    free(x);
    free(norm_w);
    free(bias);
    free(init);
    free(got);
    free(xq);
    free(cols);
    free(ref);
    free(wd);
    void *bufs[] = {dx, dnw, db, dout, dtx, dto};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) g_gpu->ops->free(g_gpu->ctx, bufs[i]);
}

/* The quantization's division (pd_e4m3x2_div: a product by the scale's reciprocal, the
 * division only next to a rounding midpoint) gives e4m3(x / s)'s codes for every bf16 x and
 * random floats, over scales as the dynamic rule makes them (a bf16 amax / 448, floored),
 * random ones of every exponent, and the edges (the floor, 1, the largest float, infinity). */
static void test_div_exact(void)
{
#ifdef PD_WITH_CUDA
    enum { NS = 4096 };
    float *sc = xmalloc(NS * sizeof *sc);
    uint32_t z = 0x1234567u;
    for (int i = 0; i < NS; i++) {
        z = z * 1664525u + 1013904223u;
        float s;
        if (i % 2 == 0) { /* the dynamic rule's scales */
            const uint32_t u = (z >> 16 & 0x7fffu) << 16;
            float amax;
            memcpy(&amax, &u, sizeof amax);
            s = amax / PD_FP8_MAX;
        } else { /* any finite positive float */
            const uint32_t u = z & 0x7f7fffffu;
            memcpy(&s, &u, sizeof s);
        }
        sc[i] = s >= PD_FP8_MIN_SCALE ? s : PD_FP8_MIN_SCALE;
    }
    sc[0] = PD_FP8_MIN_SCALE;
    sc[1] = 1.0f;
    sc[2] = 3.4028235e38f;
    sc[3] = INFINITY;
    uint64_t bad = 1;
    CHECK_EQ_INT(pd_cuda__fp8_div_check(g_gpu->ctx, sc, NS, &bad), 0);
    CHECK_MSG(bad == 0, "pd_e4m3x2_div: %llu codes differ from the division's",
              (unsigned long long)bad);
    printf("  division by the reciprocal: %d scales x 131,072 values, %llu codes differ\n", NS,
           (unsigned long long)bad);
    free(sc);
#endif
}

static void test_linear(void)
{
    static const struct { int32_t m, k; bool band_uniform; } shapes[] = {
        {96, 96, true},     {256, 96, true},      {255, 200, true},  {264, 384, true},
        {256, 512, false},  {4096, 4096, true},   {1024, 8192, true},   {1024, 14336, true},
    };
    static const int32_t ns[] = {1, 2, 7, 16, 133, 600};
    static const pd_act_quant acts[] = {PD_ACT_NONE, PD_ACT_DYNAMIC, PD_ACT_STATIC};
    const pd_wq_ops *ops = g_gpu->ops->fp8;
    lin_stats st = {0, 0, 0};
    int rot = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int32_t m = shapes[si].m, k = shapes[si].k;
        const bool big = (double)m * k > (1 << 20);
        for (int gi = 0; gi < 2; gi++) {
            const int32_t group = gi == 0 ? k : 128;
            if (!shapes[si].band_uniform && group == k) continue;
            /* the weight of every variant: 2m rows (SwiGLU's gate and up), the plain
             * products use its first m */
            host_weight h = make_weight(2 * m, k, group, shapes[si].band_uniform);
            for (size_t ai = 0; ai < sizeof acts / sizeof acts[0]; ai++) {
                const float in_scale = 0.6f / 448.0f; /* saturates the larger elements */
                void *w2 = NULL, *w1 = NULL;
                pd_qweight_desc d = {h.w8, h.scale, 2 * m, k, group, acts[ai], in_scale, 0};
                CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &d, &w2), 0);
                d.m = m;
                CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &d, &w1), 0);
                if (!w1 || !w2) continue;
                CHECK(ops->weight_bytes(g_gpu->ctx, w1) >= (size_t)m * k);
                char shape[96];
                snprintf(shape, sizeof shape, "m %d k %d group %d%s", m, k, group,
                         shapes[si].band_uniform ? "" : " (rows' own scales)");
                for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                    for (int vi = 0; vi < N_VARIANTS; vi++) {
                        /* large products: one variant per n, rotating */
                        if (big && vi != (rot % N_VARIANTS)) continue;
                        const int flags = k_variants[vi];
                        run_case(flags & F_SWIGLU ? w2 : w1, &h, acts[ai], in_scale, m, ns[ni],
                                 flags, &st, shape);
                    }
                    rot++;
                }
                ops->weight_destroy(g_gpu->ctx, w1);
                ops->weight_destroy(g_gpu->ctx, w2);
            }
            free(h.w8);
            free(h.scale);
        }
    }
    printf("  linear_fused: %d cases, %d failed, worst element error %.3g of the output rms\n",
           st.n_cases, st.n_failed, st.max_err_rel);
}

/* Downloads n bf16 of two device buffers and whether their bits are equal. */
static bool same_bits(const void *a, const void *b, size_t n)
{
    float *ha = xmalloc(n * sizeof *ha), *hb = xmalloc(n * sizeof *hb);
    download(ha, a, PD_DTYPE_BF16, n);
    download(hb, b, PD_DTYPE_BF16, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += memcmp(&ha[i], &hb[i], sizeof ha[i]) != 0;
    free(ha);
    free(hb);
    return bad == 0;
}

/* The fusions of the quantization into the kernels that make its rows change no bit:
 * linear_fused with norm_w equals the norm op followed by linear_fused without it, and
 * linear_pair (gate_up with SwiGLU, then down accumulating) equals the two linear_fused calls,
 * over n (decode sizes that take neither fusion, prefill sizes that take both), groups (a
 * scale a row, 128), dynamic and static activations, bias, and a row length off the 128 grid
 * (no fused form: the calls as they are). */
static void test_fusions_exact(void)
{
    static const struct { int32_t k, f; } shapes[] = {{256, 512}, {512, 200}, {4096, 14336}};
    static const int32_t ns[] = {7, 133, 600};
    static const pd_act_quant acts[] = {PD_ACT_DYNAMIC, PD_ACT_STATIC};
    const pd_wq_ops *ops = g_gpu->ops->fp8;
    int n_cases = 0;
    CHECK(ops->linear_pair != NULL);
    if (!ops->linear_pair) return;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int gi = 0; gi < 2; gi++)
            for (size_t ai = 0; ai < sizeof acts / sizeof acts[0]; ai++) {
                const int32_t k = shapes[si].k, f = shapes[si].f;
                const int32_t gg = gi ? 128 : k, gd = gi ? 128 : f;
                host_weight hg = make_weight(2 * f, k, gg, true), hd = make_weight(k, f, gd, true);
                const float in_scale = 0.6f / 448.0f;
                pd_qweight_desc d1 = {hg.w8, hg.scale, 2 * f, k, gg, acts[ai], in_scale, 0};
                pd_qweight_desc d2 = {hd.w8, hd.scale, k, f, gd, acts[ai], in_scale, 0};
                void *wg = NULL, *wd = NULL;
                CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &d1, &wg), 0);
                CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &d2, &wd), 0);
                for (size_t ni = 0; wg && wd && ni < sizeof ns / sizeof ns[0]; ni++) {
                    const int32_t n = ns[ni];
                    float *x = rand_bf16((size_t)n * k, 1.0), *nw = rand_bf16(k, 1.0);
                    float *bias = rand_bf16(2 * (size_t)f, 0.5), *init = rand_bf16((size_t)n * k, 2.0);
                    for (int32_t j = 0; j < k; j++) nw[j] = bf16_round(1.0f + 0.25f * nw[j]);
                    void *dx = dev_bf16(x, (size_t)n * k), *dnw = dev_bf16(nw, k);
                    void *db = dev_bf16(bias, 2 * (size_t)f);
                    void *o1 = dev_bf16(init, (size_t)n * k), *o2 = dev_bf16(init, (size_t)n * k);
                    void *tx = dev_alloc(PD_DTYPE_BF16, (size_t)n * k);
                    void *act = dev_alloc(PD_DTYPE_BF16, (size_t)n * f);
                    void *gu = dev_alloc(PD_DTYPE_BF16, (size_t)n * 2 * f);
                    void *q1 = dev_alloc(PD_DTYPE_BF16, (size_t)n * 2 * f);
                    void *q2 = dev_alloc(PD_DTYPE_BF16, (size_t)n * 2 * f);
                    pd_linear_args a = {.x = dx, .w = wg, .bias = db, .out = act, .n = n,
                                        .k = k, .m = f, .norm_w = dnw, .norm_eps = 1e-5f,
                                        .swiglu = true, .tmp_x = tx, .tmp_out = gu};
                    pd_linear_args b = {.x = act, .w = wd, .out = o1, .n = n, .k = f, .m = k,
                                        .accumulate = true};
                    /* the norm fused, and the norm op then the product without it */
                    a.out = q1;
                    CHECK_EQ_INT(ops->linear_fused(g_gpu->ctx, &a), 0);
                    CHECK_EQ_INT(g_gpu->ops->rmsnorm(g_gpu->ctx, dx, NULL, dnw, n, k, 1e-5f, tx), 0);
                    pd_linear_args a2 = a;
                    a2.x = tx;
                    a2.norm_w = NULL;
                    a2.out = q2;
                    CHECK_EQ_INT(ops->linear_fused(g_gpu->ctx, &a2), 0);
                    CHECK_MSG(same_bits(q1, q2, (size_t)n * f),
                              "k %d group %d act %d n %d: the fused norm's product differs "
                              "from the norm op's", k, gg, (int)acts[ai], n);
                    /* the pair, and the two calls */
                    a.out = act;
                    CHECK_EQ_INT(ops->linear_fused(g_gpu->ctx, &a), 0);
                    CHECK_EQ_INT(ops->linear_fused(g_gpu->ctx, &b), 0);
                    b.out = o2;
                    CHECK_EQ_INT(ops->linear_pair(g_gpu->ctx, &a, &b), 0);
                    CHECK_MSG(same_bits(o1, o2, (size_t)n * k),
                              "k %d f %d group %d act %d n %d: linear_pair differs from the two "
                              "linear_fused calls", k, f, gg, (int)acts[ai], n);
                    n_cases++;
                    free(x);
                    free(nw);
                    free(bias);
                    free(init);
                    void *bufs[] = {dx, dnw, db, o1, o2, tx, act, gu, q1, q2};
                    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
                        g_gpu->ops->free(g_gpu->ctx, bufs[i]);
                }
                ops->weight_destroy(g_gpu->ctx, wg);
                ops->weight_destroy(g_gpu->ctx, wd);
                free(hg.w8);
                free(hg.scale);
                free(hd.w8);
                free(hd.scale);
            }
    /* a pair whose down does not take gate_up's output is refused */
    pd_linear_args a = {.n = 1}, b = {.n = 2};
    CHECK_EQ_INT(ops->linear_pair(g_gpu->ctx, &a, &b), PD_EINVAL);
    printf("  fused norm and SwiGLU quantization: %d cases, equal bits to the unfused calls\n",
           n_cases);
}

/* The weight checks and NULL handling of the op set. */
static void test_weight_rules(void)
{
    const pd_wq_ops *ops = g_gpu->ops->fp8;
    uint8_t w8[64] = {0};
    float scale[4] = {1.0f, 1.0f, 0.0f, 1.0f};
    pd_qweight_desc d = {w8, scale, 4, 16, 16, PD_ACT_DYNAMIC, 0.0f, 0};
    void *w = NULL;
    CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &d, &w), PD_EINVAL); /* a zero scale */
    scale[2] = 1.0f;
    d.act = PD_ACT_STATIC;
    CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &d, &w), PD_EINVAL); /* no in_scale */
    d.act = PD_ACT_DYNAMIC;
    CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &d, &w), 0);
    CHECK(w != NULL);
    CHECK_EQ_INT(ops->weight_bytes(g_gpu->ctx, w), 64 + 4 * sizeof(float));
    ops->weight_destroy(g_gpu->ctx, w);
    ops->weight_destroy(g_gpu->ctx, NULL);
}

/* The op queued inside a graph capture replays to the bits of an eager call. */
static void test_graph(void)
{
    if (!g_gpu->ops->graph_begin) return;
    const pd_wq_ops *ops = g_gpu->ops->fp8;
    const int32_t m = 4096, k = 4096;
    static const struct { int32_t n, group; } cases[] = {{7, 4096}, {133, 4096}, {133, 128}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int32_t n = cases[ci].n;
        host_weight h = make_weight(m, k, cases[ci].group, true);
        pd_qweight_desc d = {h.w8, h.scale, m, k, cases[ci].group, PD_ACT_DYNAMIC, 0.0f, 0};
        void *w = NULL;
        CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &d, &w), 0);
        float *x = rand_bf16((size_t)n * k, 1.0);
        void *dx = dev_bf16(x, (size_t)n * k);
        void *o1 = dev_alloc(PD_DTYPE_BF16, (size_t)n * m), *o2 = dev_alloc(PD_DTYPE_BF16, (size_t)n * m);
        pd_linear_args a = {0};
        a.x = dx;
        a.w = w;
        a.out = o1;
        a.n = n;
        a.k = k;
        a.m = m;
        CHECK_EQ_INT(ops->linear_fused(g_gpu->ctx, &a), 0);
        void *graph = NULL;
        a.out = o2;
        CHECK_EQ_INT(g_gpu->ops->graph_begin(g_gpu->ctx), 0);
        const int rc = ops->linear_fused(g_gpu->ctx, &a);
        CHECK_EQ_INT(g_gpu->ops->graph_end(g_gpu->ctx, &graph), 0);
        CHECK_EQ_INT(rc, 0);
        if (graph) {
            CHECK_EQ_INT(g_gpu->ops->graph_launch(g_gpu->ctx, graph), 0);
            CHECK_EQ_INT(g_gpu->ops->sync(g_gpu->ctx), 0);
            float *g1 = xmalloc((size_t)n * m * sizeof *g1), *g2 = xmalloc((size_t)n * m * sizeof *g2);
            download(g1, o1, PD_DTYPE_BF16, (size_t)n * m);
            download(g2, o2, PD_DTYPE_BF16, (size_t)n * m);
            CHECK_MSG(memcmp(g1, g2, (size_t)n * m * sizeof *g1) == 0,
                      "graph replay of n %d group %d differs from the eager call", n,
                      cases[ci].group);
            free(g1);
            free(g2);
            g_gpu->ops->graph_destroy(g_gpu->ctx, graph);
        }
        ops->weight_destroy(g_gpu->ctx, w);
        g_gpu->ops->free(g_gpu->ctx, dx);
        g_gpu->ops->free(g_gpu->ctx, o1);
        g_gpu->ops->free(g_gpu->ctx, o2);
        free(x);
        free(h.w8);
        free(h.scale);
    }
    printf("  graph capture: %zu cases\n", sizeof cases / sizeof cases[0]);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    pd_backend_params p = pd_backend_default_params();
    int rc = pd_backend_create("cuda", &p, &g_gpu, err);
    if (rc < 0) {
        fprintf(stderr, "test_cuda_fp8: skipped: %s\n", err);
        return 77;
    }
    if (!g_gpu->ops->fp8) {
        fprintf(stderr, "test_cuda_fp8: the cuda backend offers no fp8 op set\n");
        pd_backend_destroy(g_gpu);
        return 1;
    }
    printf("test_cuda_fp8: the fp8 weight op set against the host reference\n");
    test_weight_rules();
    test_quant_exact();
    test_div_exact();
    test_linear();
    test_fusions_exact();
    test_graph();
    pd_backend_destroy(g_gpu);
    return pd_test_result("test_cuda_fp8");
}
