/* test_cuda_moe.c -- The CUDA backend's mixture-of-experts ops against the CPU backend's
 * (kernels/cpu/cpu_moe.c, itself checked against transformers by test_moe_golden):
 *   - moe_route on logits full of exact ties (values on a coarse grid, the same on both
 *     sides: the replayed selection) and on tie-free logits (the parallel top k) must choose
 *     the same experts in the same order, group them identically and weigh them alike (to the
 *     last bits of the double softmax), with the groups' bounds on the host or on the device
 *     only;
 *   - moe_combine must sum the same terms, to bf16 rounding;
 *   - moe_experts (every expert's MLP in one op) must compute the CPU's f32 products to bf16
 *     rounding, on the row-streaming kernel (few rows an expert, groups larger than its
 *     tile too) and the grouped wgmma GEMMs (many rows an expert, partial tiles in rows and
 *     columns), both fed by the device-side grouping.
 * Shapes from a tiny router to Qwen3-30B-A3B's 128 experts (top 8, the nth_element path) and
 * DeepSeek-like 256 (the heap-select path at k 4). Exits 77 (skipped) without a CUDA
 * device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/error.h"
#include "kernels/backend.h"
#include "tests/test_util.h"
#define PD_TEST_SEED 0x51ed270b4a3c9e1dull
#include "tests/test_rand.h"

static pd_backend *g_cpu, *g_gpu;

/* A buffer of n elements of type t on backend b, from host floats (NULL: zeros). */
static void *put(pd_backend *b, pd_dtype t, const float *h, size_t n)
{
    void *d = NULL;
    CHECK_EQ_INT(b->ops->alloc(b->ctx, t, n, &d), 0);
    if (h && d) CHECK_EQ_INT(b->ops->upload(b->ctx, d, t, 0, h, PD_DTYPE_F32, n), 0);
    return d;
}

static void get(pd_backend *b, float *h, const void *d, pd_dtype t, size_t n)
{
    CHECK_EQ_INT(b->ops->download_f32(b->ctx, h, d, t, 0, n), 0);
}

typedef struct {
    void *logits, *ids, *weights, *rows, *pos;
    int32_t *offsets;
} route_bufs;

static int route_on(pd_backend *b, const float *lg, int32_t n, int32_t E, int32_t k, bool renorm,
                    route_bufs *r)
{
    const size_t nk = (size_t)n * k;
    r->logits = put(b, b->ops->act_dtype, lg, (size_t)n * E);
    r->ids = put(b, PD_DTYPE_I32, NULL, nk);
    r->weights = put(b, PD_DTYPE_F32, NULL, nk);
    r->rows = put(b, PD_DTYPE_I32, NULL, nk);
    r->pos = put(b, PD_DTYPE_I32, NULL, nk);
    r->offsets = xmalloc(((size_t)E + 1) * sizeof *r->offsets);
    const pd_moe_route_args a = {.logits = r->logits, .n = n, .n_experts = E, .k = k,
                                 .renormalize = renorm, .ids = r->ids, .weights = r->weights,
                                 .rows = r->rows, .pos = r->pos, .offsets = r->offsets};
    return b->ops->moe_route(b->ctx, &a);
}

static void route_free(pd_backend *b, route_bufs *r)
{
    void *bufs[] = {r->logits, r->ids, r->weights, r->rows, r->pos};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) b->ops->free(b->ctx, bufs[i]);
    free(r->offsets);
}

/* The n * k int32 (or float) outputs of both sides, as floats. */
static size_t count_diff(pd_backend *pc, const void *c, pd_backend *pg, const void *g,
                         pd_dtype t, size_t n, double tol)
{
    float *hc = xmalloc(n * sizeof *hc), *hg = xmalloc(n * sizeof *hg);
    get(pc, hc, c, t, n);
    get(pg, hg, g, t, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += !(fabs((double)hc[i] - hg[i]) <= tol) && !(isnan(hc[i]) && isnan(hg[i]));
    free(hc);
    free(hg);
    return bad;
}

enum { LG_DISTINCT, LG_TIES, LG_SPECIAL };

/* LG_TIES: logits on a grid of quarters in [-3, 3] (exact in bf16 and f32, many ties a row);
 * LG_DISTINCT: bf16 values in [-4, 4] (ties rare; a row with one among its top k + 1 is
 * replayed); LG_SPECIAL: the values whose order as bf16 bits and as probabilities can part
 * (+0 and -0, -inf, logits so far below the largest that their exponentials are equal or
 * zero, huge ones) and, in one row of three, a NaN. */
static float *make_logits(int32_t n, int32_t E, int mode)
{
    static const float special[] = {0.0f, -0.0f, -INFINITY, 1e-30f, -1e-30f, 2e-30f, 3.0f,
                                    -3.0f, 60.0f, -60.0f, 1e30f, -1e30f};
    float *lg = xmalloc((size_t)n * E * sizeof *lg);
    for (size_t i = 0; i < (size_t)n * E; i++) {
        if (mode == LG_TIES) lg[i] = (float)((int)(urand() * 25) - 12) / 4.0f;
        else if (mode == LG_DISTINCT || urand() < 0.3)
            lg[i] = bf16_round((float)(8.0 * urand() - 4.0));
        else lg[i] = bf16_round(special[(int)(urand() * 12) % 12]);
    }
    for (size_t r = 0; mode == LG_SPECIAL && r < (size_t)n; r += 3)
        lg[r * E + (size_t)(urand() * E) % (size_t)E] = NAN;
    return lg;
}

static void run_case(int32_t n, int32_t E, int32_t k, bool renorm, int32_t dim, int ties)
{
    float *lg = make_logits(n, E, ties);
    route_bufs rc = {0}, rg = {0};
    CHECK_EQ_INT(route_on(g_cpu, lg, n, E, k, renorm, &rc), 0);
    CHECK_EQ_INT(route_on(g_gpu, lg, n, E, k, renorm, &rg), 0);
    CHECK_EQ_INT(g_gpu->ops->sync(g_gpu->ctx), 0);
    const size_t nk = (size_t)n * k;
    size_t bad_off = 0;
    for (int32_t e = 0; e <= E; e++) bad_off += rc.offsets[e] != rg.offsets[e];
    const size_t bad_ids = count_diff(g_cpu, rc.ids, g_gpu, rg.ids, PD_DTYPE_I32, nk, 0);
    const size_t bad_rows = count_diff(g_cpu, rc.rows, g_gpu, rg.rows, PD_DTYPE_I32, nk, 0);
    const size_t bad_pos = count_diff(g_cpu, rc.pos, g_gpu, rg.pos, PD_DTYPE_I32, nk, 0);
    const size_t bad_w = count_diff(g_cpu, rc.weights, g_gpu, rg.weights, PD_DTYPE_F32, nk, 1e-6);
    CHECK_MSG(bad_off == 0 && bad_ids == 0 && bad_rows == 0 && bad_pos == 0 && bad_w == 0,
              "moe_route n %d E %d k %d renorm %d ties %d: offsets %zu, ids %zu, rows %zu, pos "
              "%zu, weights %zu of %zu differ", n, E, k, renorm, ties, bad_off, bad_ids, bad_rows,
              bad_pos, bad_w, nk);

    /* combine: the same expert outputs, routing and residual on both sides */
    float *y = xmalloc(nk * dim * sizeof *y), *res = xmalloc((size_t)n * dim * sizeof *res);
    for (size_t i = 0; i < nk * dim; i++) y[i] = bf16_round((float)(4.0 * urand() - 2.0));
    for (size_t i = 0; i < (size_t)n * dim; i++) res[i] = bf16_round((float)(2.0 * urand() - 1.0));
    double worst = 0;
    for (int acc = 0; acc < 2 && ties != LG_SPECIAL; acc++) { /* (NaN weights: not combined) */
        void *yc = put(g_cpu, g_cpu->ops->act_dtype, y, nk * dim);
        void *yg = put(g_gpu, g_gpu->ops->act_dtype, y, nk * dim);
        void *oc = put(g_cpu, g_cpu->ops->act_dtype, res, (size_t)n * dim);
        void *og = put(g_gpu, g_gpu->ops->act_dtype, res, (size_t)n * dim);
        pd_moe_combine_args ca = {.y = yc, .pos = rc.pos, .weights = rc.weights, .n = n,
                                  .k = k, .dim = dim, .accumulate = acc, .out = oc};
        CHECK_EQ_INT(g_cpu->ops->moe_combine(g_cpu->ctx, &ca), 0);
        ca.y = yg;
        ca.pos = rg.pos;
        ca.weights = rg.weights;
        ca.out = og;
        CHECK_EQ_INT(g_gpu->ops->moe_combine(g_gpu->ctx, &ca), 0);
        float *hc = xmalloc((size_t)n * dim * sizeof *hc), *hg = xmalloc((size_t)n * dim * sizeof *hg);
        get(g_cpu, hc, oc, g_cpu->ops->act_dtype, (size_t)n * dim);
        get(g_gpu, hg, og, g_gpu->ops->act_dtype, (size_t)n * dim);
        size_t bad = 0;
        for (size_t i = 0; i < (size_t)n * dim; i++) {
            /* the GPU rounds the result to bf16 once (the CPU keeps f32): half a bf16 step,
             * and f32 sums in another precision */
            const double e = fabs((double)hc[i] - hg[i]), tol = 4e-3 * fabs(hc[i]) + 1e-3;
            bad += !(e <= tol);
            if (e > worst) worst = e;
        }
        CHECK_MSG(bad == 0, "moe_combine n %d k %d dim %d accumulate %d: %zu of %zu differ",
                  n, k, dim, acc, bad, (size_t)n * dim);
        free(hc);
        free(hg);
        void *bufs_c[] = {yc, oc}, *bufs_g[] = {yg, og};
        for (int i = 0; i < 2; i++) {
            g_cpu->ops->free(g_cpu->ctx, bufs_c[i]);
            g_gpu->ops->free(g_gpu->ctx, bufs_g[i]);
        }
    }
    printf("  n %4d E %3d k %d renorm %d ties %d: routing equal (%zu choices), combine max "
           "|diff| %.3g\n", n, E, k, renorm, ties, nk, worst);
    route_free(g_cpu, &rc);
    route_free(g_gpu, &rg);
    free(lg);
    free(y);
    free(res);
}

/* moe_experts on both backends over the same routing (the GPU's grouped on the device only,
 * its bounds then compared with the CPU's), random bf16 weights and rows. */
static void run_experts(int32_t n, int32_t E, int32_t k, int32_t H, int32_t F)
{
    float *lg = make_logits(n, E, LG_DISTINCT);
    const size_t nk = (size_t)n * k;
    route_bufs rc = {0};
    CHECK_EQ_INT(route_on(g_cpu, lg, n, E, k, true, &rc), 0);
    /* the GPU's routing with its bounds on the device only (no synchronisation) */
    void *glg = put(g_gpu, g_gpu->ops->act_dtype, lg, (size_t)n * E);
    void *gids = put(g_gpu, PD_DTYPE_I32, NULL, nk), *gw = put(g_gpu, PD_DTYPE_F32, NULL, nk);
    void *grows = put(g_gpu, PD_DTYPE_I32, NULL, nk), *gpos = put(g_gpu, PD_DTYPE_I32, NULL, nk);
    void *goff = put(g_gpu, PD_DTYPE_I32, NULL, (size_t)E + 1);
    const pd_moe_route_args ra = {.logits = glg, .n = n, .n_experts = E, .k = k,
                                  .renormalize = true, .ids = gids, .weights = gw, .rows = grows,
                                  .pos = gpos, .dev_offsets = goff};
    CHECK_EQ_INT(g_gpu->ops->moe_route(g_gpu->ctx, &ra), 0);
    float *hoff = xmalloc(((size_t)E + 1) * sizeof *hoff);
    get(g_gpu, hoff, goff, PD_DTYPE_I32, (size_t)E + 1);
    size_t bad_off = 0;
    int32_t most = 0;
    for (int32_t e = 0; e <= E; e++) {
        bad_off += (int32_t)hoff[e] != rc.offsets[e];
        const int32_t ne = e < E ? rc.offsets[e + 1] - rc.offsets[e] : 0;
        if (ne > most) most = ne;
    }
    const size_t bad_rows = count_diff(g_cpu, rc.rows, g_gpu, grows, PD_DTYPE_I32, nk, 0);
    CHECK_MSG(bad_off == 0 && bad_rows == 0, "moe_route (device bounds) n %d E %d k %d: "
              "offsets %zu, rows %zu differ", n, E, k, bad_off, bad_rows);
    /* weights and rows: bf16 values, products of unit scale */
    const size_t ngu = (size_t)E * 2 * F * H, ndn = (size_t)E * H * F;
    float *wgu = xmalloc(ngu * sizeof *wgu), *wdn = xmalloc(ndn * sizeof *wdn);
    float *x = xmalloc((size_t)n * H * sizeof *x);
    const double sg = 2.0 * sqrt(3.0 / H), sd = 2.0 * sqrt(3.0 / F);
    for (size_t i = 0; i < ngu; i++) wgu[i] = bf16_round((float)(sg * (urand() - 0.5)));
    for (size_t i = 0; i < ndn; i++) wdn[i] = bf16_round((float)(sd * (urand() - 0.5)));
    for (size_t i = 0; i < (size_t)n * H; i++) x[i] = bf16_round((float)(4.0 * urand() - 2.0));
    float *res = xmalloc((size_t)n * H * sizeof *res);
    for (size_t i = 0; i < (size_t)n * H; i++) res[i] = bf16_round((float)(2.0 * urand() - 1.0));
    float *out[2];
    pd_backend *bk[2] = {g_cpu, g_gpu};
    for (int b = 0; b < 2; b++) {
        pd_backend *be = bk[b];
        const pd_dtype t = be->ops->act_dtype;
        void *dx = put(be, t, x, (size_t)n * H), *dgu = put(be, t, wgu, ngu);
        void *ddn = put(be, t, wdn, ndn), *dact = put(be, t, NULL, nk * F);
        void *dy = put(be, t, NULL, nk * H);
        const pd_moe_experts_args ea = {
            .x = dx, .n = n, .k = k, .n_experts = E, .hidden = H, .inter = F,
            .rows = b ? grows : rc.rows, .offsets = b ? goff : rc.offsets, .gate_up = dgu,
            .down = ddn, .act = dact, .y = dy};
        CHECK_EQ_INT(be->ops->moe_experts(be->ctx, &ea), 0);
        out[b] = xmalloc(nk * H * sizeof *out[b]);
        get(be, out[b], dy, t, nk * H);
        /* the combination inside moe_experts (on the GPU at n = 1 one fused launch) makes
         * moe_combine's bits */
        for (int acc = 0; acc < 2; acc++) {
            void *o1 = put(be, t, res, (size_t)n * H), *o2 = put(be, t, res, (size_t)n * H);
            const pd_moe_combine_args ca = {.y = dy, .pos = b ? gpos : rc.pos,
                                            .weights = b ? gw : rc.weights, .n = n, .k = k,
                                            .dim = H, .accumulate = acc, .out = o1};
            CHECK_EQ_INT(be->ops->moe_combine(be->ctx, &ca), 0);
            pd_moe_experts_args eb = ea;
            eb.ids = b ? gids : rc.ids;
            eb.pos = ca.pos;
            eb.weights = ca.weights;
            eb.out = o2;
            eb.accumulate = acc;
            CHECK_EQ_INT(be->ops->moe_experts(be->ctx, &eb), 0);
            float *h1 = xmalloc((size_t)n * H * sizeof *h1), *h2 = xmalloc((size_t)n * H * sizeof *h2);
            get(be, h1, o1, t, (size_t)n * H);
            get(be, h2, o2, t, (size_t)n * H);
            size_t differ = 0;
            for (size_t i = 0; i < (size_t)n * H; i++) differ += memcmp(&h1[i], &h2[i], sizeof *h1) != 0;
            CHECK_MSG(differ == 0, "moe_experts with the combination on %s, n %d k %d hidden %d "
                      "accumulate %d: %zu of %zu differ from moe_combine's", be->ops->name, n, k,
                      H, acc, differ, (size_t)n * H);
            free(h1);
            free(h2);
            be->ops->free(be->ctx, o1);
            be->ops->free(be->ctx, o2);
        }
        void *bufs[] = {dx, dgu, ddn, dact, dy};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->ops->free(be->ctx, bufs[i]);
    }
    /* the GPU rounds the gate/up products, the SwiGLU rows and the outputs to bf16 */
    double ss = 0, se = 0, worst = 0;
    size_t bad = 0;
    for (size_t i = 0; i < nk * H; i++) ss += (double)out[0][i] * out[0][i];
    const double rms = sqrt(ss / (double)(nk * H));
    for (size_t i = 0; i < nk * H; i++) {
        const double e = fabs((double)out[0][i] - out[1][i]);
        se += e * e;
        bad += !(e <= 2e-2 * fabs(out[0][i]) + 4e-2 * rms);
        if (e > worst) worst = e;
    }
    const double rel = sqrt(se / ss);
    CHECK_MSG(bad == 0 && rel < 1e-2, "moe_experts n %d E %d k %d hidden %d inter %d: %zu of "
              "%zu outside the bound, relative error %.3g", n, E, k, H, F, bad, nk * H, rel);
    printf("  moe_experts n %4d E %3d k %d hidden %4d inter %4d (largest group %d): relative "
           "error %.3g, max |diff| %.3g (rms %.3g)\n", n, E, k, H, F, most, rel, worst, rms);
    void *gb[] = {glg, gids, gw, grows, gpos, goff};
    for (size_t i = 0; i < sizeof gb / sizeof gb[0]; i++) g_gpu->ops->free(g_gpu->ctx, gb[i]);
    route_free(g_cpu, &rc);
    free(out[0]);
    free(out[1]);
    free(hoff);
    free(wgu);
    free(wdn);
    free(x);
    free(res);
    free(lg);
}

/* One stage of the FP8 check: |gpu - ref| <= rel |ref| + sc rms(ref) for every element, and
 * the relative L2 error under 5e-3. */
static void check_stage(const char *what, const float *gpu, const double *ref, size_t n,
                        double rel, double sc, const char *shape)
{
    double ss = 0, se = 0, worst = 0;
    for (size_t i = 0; i < n; i++) ss += ref[i] * ref[i];
    const double rms = sqrt(ss / (double)n);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs(gpu[i] - ref[i]);
        se += e * e;
        bad += !(e <= rel * fabs(ref[i]) + sc * rms);
        if (e > worst) worst = e;
    }
    CHECK_MSG(bad == 0 && sqrt(se / ss) < 5e-3, "fp8 moe_experts %s (%s): %zu of %zu outside "
              "the bound, relative L2 error %.3g", what, shape, bad, n, sqrt(se / ss));
    printf("  fp8 moe_experts %s %s: relative error %.3g, max |diff| %.3g (rms %.3g)\n", what,
           shape, sqrt(se / ss), worst, rms);
}

/* e4m3 codes of values spread over the format's range (no NaN code), and per-row scales of
 * ng groups (equal on 128-row bands when banded: block-wise checkpoints). */
static void fp8_weight(size_t m, int32_t k, int32_t ng, bool banded, uint8_t *w8, float *sc)
{
    for (size_t i = 0; i < m * (size_t)k; i++)
        w8[i] = pd_f32_to_e4m3((float)((urand() - 0.5) * 2.0 * (urand() < 0.1 ? 400 : 40)));
    for (size_t r = 0; r < m; r++)
        for (int32_t g = 0; g < ng; g++)
            sc[r * ng + g] = banded && r % 128 ? sc[(r - r % 128) * ng + g]
                                               : (float)((0.5 + urand()) / (40.0 * sqrt(k)));
}

/* The FP8 op set's moe_experts (every expert's gate/up rows in one weight, its down rows in
 * another; a scale a row or per 128 x 128 block; input rows dynamic, static or not quantized)
 * against the product in double of pd_fp8_quant_row's rows and the dequantized weights, one
 * stage at a time: the SwiGLU rows (gate and up rounded to bf16 first, the tolerance of
 * test_cuda_fp8's SwiGLU) from x, then the down rows from the GPU's own SwiGLU rows (bf16
 * output rounding, f32 sums). The combination inside the op equals moe_combine's bits. Few
 * rows an expert take the row-streaming kernel, many the grouped GEMMs (on sm_90a). */
static void run_experts_fp8(int32_t n, int32_t E, int32_t k, int32_t H, int32_t F, bool block,
                            pd_act_quant act)
{
    const pd_wq_ops *ops = g_gpu->ops->fp8;
    char shape[160];
    snprintf(shape, sizeof shape, "n %d E %d k %d hidden %d inter %d %s act %d", n, E, k, H, F,
             block ? "block 128" : "per row", (int)act);
    float *lg = make_logits(n, E, LG_DISTINCT);
    const size_t nk = (size_t)n * k;
    route_bufs rc = {0};
    CHECK_EQ_INT(route_on(g_cpu, lg, n, E, k, true, &rc), 0);
    float *hrows = xmalloc(nk * sizeof *hrows);
    get(g_cpu, hrows, rc.rows, PD_DTYPE_I32, nk);
    void *glg = put(g_gpu, g_gpu->ops->act_dtype, lg, (size_t)n * E);
    void *gids = put(g_gpu, PD_DTYPE_I32, NULL, nk), *gw = put(g_gpu, PD_DTYPE_F32, NULL, nk);
    void *grows = put(g_gpu, PD_DTYPE_I32, NULL, nk), *gpos = put(g_gpu, PD_DTYPE_I32, NULL, nk);
    void *goff = put(g_gpu, PD_DTYPE_I32, NULL, (size_t)E + 1);
    const pd_moe_route_args ra = {.logits = glg, .n = n, .n_experts = E, .k = k,
                                  .renormalize = true, .ids = gids, .weights = gw, .rows = grows,
                                  .pos = gpos, .dev_offsets = goff};
    CHECK_EQ_INT(g_gpu->ops->moe_route(g_gpu->ctx, &ra), 0);
    const int32_t gg = block ? 128 : H, gd = block ? 128 : F;
    const int32_t ngg = (H + gg - 1) / gg, ngd = (F + gd - 1) / gd;
    const size_t mgu = (size_t)E * 2 * F, mdn = (size_t)E * H;
    uint8_t *wgu = xmalloc(mgu * H), *wdn = xmalloc(mdn * F);
    float *sgu = xmalloc(mgu * ngg * sizeof *sgu), *sdn = xmalloc(mdn * ngd * sizeof *sdn);
    fp8_weight(mgu, H, ngg, block, wgu, sgu);
    fp8_weight(mdn, F, ngd, block, wdn, sdn);
    const float in_scale = 2.5f / 448.0f; /* static: the larger elements saturate */
    const pd_qweight_desc dg = {wgu, sgu, (int32_t)mgu, H, gg, act, in_scale, E};
    const pd_qweight_desc dd = {wdn, sdn, (int32_t)mdn, F, gd, act, in_scale, E};
    void *qg = NULL, *qd = NULL;
    CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &dg, &qg), 0);
    CHECK_EQ_INT(ops->weight_create(g_gpu->ctx, &dd, &qd), 0);
    float *x = xmalloc((size_t)n * H * sizeof *x), *res = xmalloc((size_t)n * H * sizeof *res);
    for (size_t i = 0; i < (size_t)n * H; i++)
        x[i] = bf16_round((float)((4.0 * urand() - 2.0) * (i % 41 == 7 ? 8.0 : 1.0)));
    for (size_t i = 0; i < (size_t)n * H; i++) res[i] = bf16_round((float)(2.0 * urand() - 1.0));
    const pd_dtype t = g_gpu->ops->act_dtype;
    void *dx = put(g_gpu, t, x, (size_t)n * H), *dact = put(g_gpu, t, NULL, nk * F);
    void *dy = put(g_gpu, t, NULL, nk * H);
    pd_moe_experts_args ea = {.x = dx, .n = n, .k = k, .n_experts = E, .hidden = H, .inter = F,
                              .rows = grows, .offsets = goff, .gate_up = qg, .down = qd,
                              .act = dact, .y = dy};
    if (!qg || !qd || ops->moe_experts(g_gpu->ctx, &ea) != 0) {
        CHECK_MSG(0, "fp8 moe_experts (%s) failed", shape);
        goto out;
    }
    float *hact = xmalloc(nk * F * sizeof *hact), *hy = xmalloc(nk * H * sizeof *hy);
    get(g_gpu, hact, dact, t, nk * F);
    get(g_gpu, hy, dy, t, nk * H);
    double *ract = xmalloc(nk * F * sizeof *ract), *ry = xmalloc(nk * H * sizeof *ry);
    float *q = xmalloc((size_t)(H > F ? H : F) * sizeof *q);
    for (int32_t e = 0; e < E; e++)
        for (int32_t p = rc.offsets[e]; p < rc.offsets[e + 1]; p++) {
            pd_fp8_quant_row(x + (size_t)hrows[p] * H, q, H, gg, act, in_scale);
            for (int32_t i = 0; i < F; i++) {
                double gu[2] = {0, 0};
                for (int h = 0; h < 2; h++) {
                    const size_t row = (size_t)e * 2 * F + (size_t)h * F + i;
                    for (int32_t j = 0; j < H; j++)
                        gu[h] += (double)q[j] * pd_e4m3_to_f32(wgu[row * H + j]) *
                                 sgu[row * ngg + j / gg];
                }
                const double gt = bf16_round((float)gu[0]), up = bf16_round((float)gu[1]);
                ract[(size_t)p * F + i] = gt / (1.0 + exp(-gt)) * up;
            }
            pd_fp8_quant_row(hact + (size_t)p * F, q, F, gd, act, in_scale);
            for (int32_t o = 0; o < H; o++) {
                const size_t row = (size_t)e * H + o;
                double d = 0;
                for (int32_t j = 0; j < F; j++)
                    d += (double)q[j] * pd_e4m3_to_f32(wdn[row * F + j]) * sdn[row * ngd + j / gd];
                ry[(size_t)p * H + o] = d;
            }
        }
    check_stage("gate/up + SwiGLU", hact, ract, nk * F, 1.0 / 32, 3e-2, shape);
    check_stage("down", hy, ry, nk * H, 1.0 / 128, 1e-2, shape);
    /* the combination inside the op: moe_combine's bits */
    for (int acc = 0; acc < 2; acc++) {
        void *o1 = put(g_gpu, t, res, (size_t)n * H), *o2 = put(g_gpu, t, res, (size_t)n * H);
        const pd_moe_combine_args ca = {.y = dy, .pos = gpos, .weights = gw, .n = n, .k = k,
                                        .dim = H, .accumulate = acc, .out = o1};
        CHECK_EQ_INT(g_gpu->ops->moe_combine(g_gpu->ctx, &ca), 0);
        pd_moe_experts_args eb = ea;
        eb.ids = gids;
        eb.pos = gpos;
        eb.weights = gw;
        eb.out = o2;
        eb.accumulate = acc;
        CHECK_EQ_INT(ops->moe_experts(g_gpu->ctx, &eb), 0);
        float *h1 = xmalloc((size_t)n * H * sizeof *h1), *h2 = xmalloc((size_t)n * H * sizeof *h2);
        get(g_gpu, h1, o1, t, (size_t)n * H);
        get(g_gpu, h2, o2, t, (size_t)n * H);
        CHECK_MSG(memcmp(h1, h2, (size_t)n * H * sizeof *h1) == 0, "fp8 moe_experts with the "
                  "combination (%s, accumulate %d) differs from moe_combine's", shape, acc);
        free(h1);
        free(h2);
        g_gpu->ops->free(g_gpu->ctx, o1);
        g_gpu->ops->free(g_gpu->ctx, o2);
    }
    free(hact);
    free(hy);
    free(ract);
    free(ry);
    free(q);
out:
    ops->weight_destroy(g_gpu->ctx, qg);
    ops->weight_destroy(g_gpu->ctx, qd);
    void *gb[] = {glg, gids, gw, grows, gpos, goff, dx, dact, dy};
    for (size_t i = 0; i < sizeof gb / sizeof gb[0]; i++) g_gpu->ops->free(g_gpu->ctx, gb[i]);
    route_free(g_cpu, &rc);
    free(hrows);
    free(wgu);
    free(wdn);
    free(sgu);
    free(sdn);
    free(x);
    free(res);
    free(lg);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    if (pd_backend_create("cuda", NULL, &g_gpu, err) < 0) {
        fprintf(stderr, "test_cuda_moe: skipped: %s\n", err);
        return 77;
    }
    if (pd_backend_create("cpu", NULL, &g_cpu, err) < 0) {
        fprintf(stderr, "test_cuda_moe: cpu backend: %s\n", err);
        return 1;
    }
    printf("test_cuda_moe: moe_route and moe_combine on cuda against cpu\n");
    CHECK(g_gpu->ops->moe_route && g_gpu->ops->moe_combine);
    if (g_gpu->ops->moe_route && g_gpu->ops->moe_combine) {
        for (int ties = 1; ties >= 0; ties--) {
            run_case(37, 8, 2, true, 64, ties);     /* Mixtral's routing */
            run_case(5, 8, 8, false, 32, ties);     /* every expert chosen */
            run_case(300, 128, 8, true, 96, ties);  /* Qwen3-30B-A3B's: nth_element */
            run_case(1, 128, 8, true, 2048, ties);  /* a decode row */
            run_case(64, 256, 4, false, 64, ties);  /* k * 64 <= E: the heap select */
        }
        run_case(2100, 16, 4, true, 32, LG_DISTINCT); /* more choices than the grouping's block */
        run_case(9, 16, 4, false, 30, LG_TIES);   /* rows of dim % 8 != 0: combine's scalar path */
        /* the routing kernel's register widths (E up to 128, 256, 512) and the one-thread
         * path past them; the values that part key order from probability order */
        for (int mode = LG_DISTINCT; mode <= LG_SPECIAL; mode++) {
            run_case(40, 512, 10, true, 32, mode);  /* Qwen3-Next's 512 experts, top 10 */
            run_case(20, 600, 8, true, 32, mode);   /* past 512: one thread's routing */
            run_case(60, 128, 8, true, 32, mode);
            run_case(60, 8, 2, true, 32, mode);
        }
        /* decode rows one at a time: the grouping inside the routing kernel */
        for (int i = 0; i < 24; i++) {
            run_case(1, 128, 8, true, 64, i % 3);
            run_case(1, 8, 2, false, 64, i % 3);
        }
        /* no rows: the groups empty, nothing queued */
        route_bufs r = {0};
        CHECK_EQ_INT(route_on(g_gpu, NULL, 0, 8, 2, true, &r), 0);
        for (int e = 0; e <= 8; e++) CHECK_EQ_INT(r.offsets[e], 0);
        route_free(g_gpu, &r);
        const pd_moe_route_args bad = {.n = 1, .n_experts = 4, .k = 5};
        CHECK_EQ_INT(g_gpu->ops->moe_route(g_gpu->ctx, &bad), PD_EINVAL);
    }
    CHECK(g_gpu->ops->moe_experts != NULL);
    if (g_gpu->ops->moe_experts) {
        printf("test_cuda_moe: moe_experts on cuda against cpu\n");
        run_experts(1, 128, 8, 256, 96);    /* a decode row: the row-streaming kernel */
        run_experts(1, 8, 2, 128, 64);      /* a Mixtral decode row: the fused down + combine */
        run_experts(1, 40, 12, 136, 48);    /* more choices than the fused kernel's warps */
        run_experts(6, 128, 8, 264, 40);    /* a small batch, odd sizes */
        run_experts(40, 8, 2, 128, 64);     /* groups past the streaming kernel's 8 rows */
        run_experts(512, 16, 4, 256, 96);   /* 128 rows an expert: the grouped GEMMs */
        run_experts(300, 8, 2, 320, 200);   /* partial row and column tiles, k not /64 */
        const pd_moe_experts_args bad = {.n = 1, .k = 1, .n_experts = 2, .hidden = 12,
                                         .inter = 8};
        CHECK_EQ_INT(g_gpu->ops->moe_experts(g_gpu->ctx, &bad), PD_EINVAL);
    }
    CHECK(g_gpu->ops->fp8 && g_gpu->ops->fp8->moe_experts);
    if (g_gpu->ops->fp8 && g_gpu->ops->fp8->moe_experts) {
        printf("test_cuda_moe: the FP8 op set's moe_experts against double\n");
        for (int act = PD_ACT_NONE; act <= PD_ACT_STATIC; act++) {
            run_experts_fp8(1, 128, 8, 256, 128, true, (pd_act_quant)act);  /* a decode row */
            run_experts_fp8(1, 8, 2, 272, 48, false, (pd_act_quant)act);    /* per row, odd k */
        }
        /* small batches on the row-streaming kernel (fewer choices than experts: 2, 4 and 8
         * rows a tile), then groups past its 8 rows */
        run_experts_fp8(2, 128, 8, 256, 128, false, PD_ACT_DYNAMIC);
        run_experts_fp8(3, 64, 2, 2048, 768, false, PD_ACT_DYNAMIC);
        run_experts_fp8(6, 64, 8, 384, 256, true, PD_ACT_DYNAMIC);
        run_experts_fp8(1, 128, 8, 2048, 768, false, PD_ACT_DYNAMIC); /* Qwen3-30B-A3B's */
        run_experts_fp8(1, 16, 8, 256, 4096, false, PD_ACT_DYNAMIC);  /* long SwiGLU rows */
        run_experts_fp8(40, 8, 2, 256, 128, false, PD_ACT_DYNAMIC);
        /* prefill's many rows an expert: the grouped e4m3 GEMMs (groups of 128 on 64-row
         * tiles; a scale a row on 128-row tiles, or 64 with fewer rows an expert, K off the
         * 128-code steps), weight-only on the row-streaming kernel */
        run_experts_fp8(300, 16, 4, 512, 384, true, PD_ACT_DYNAMIC);
        run_experts_fp8(300, 8, 2, 256, 128, false, PD_ACT_DYNAMIC);
        run_experts_fp8(200, 8, 2, 272, 48, false, PD_ACT_STATIC);
        run_experts_fp8(300, 16, 4, 256, 128, false, PD_ACT_NONE);
        /* a weight of the wrong shape, rows off 16 */
        const pd_moe_experts_args bad = {.n = 1, .k = 1, .n_experts = 2, .hidden = 24,
                                         .inter = 16};
        CHECK_EQ_INT(g_gpu->ops->fp8->moe_experts(g_gpu->ctx, &bad), PD_EINVAL);
    }
    pd_backend_destroy(g_cpu);
    pd_backend_destroy(g_gpu);
    return pd_test_result("test_cuda_moe");
}
