/* test_cuda_sample.c -- The CUDA backend's sample op against the host sampler (smp_sample) on
 * the same logits: random bf16-representable values (flat, peaked and heavily tied rows, each
 * with some -inf and a NaN) uploaded as bf16, the host sampling the f32 copy. Greedy picks
 * must be identical; sampled picks identical in at least 99.5% of draws, every mismatch a
 * boundary case (the GPU's token is in the host's kept set; printed). Log-probabilities are
 * of the raw distribution (smp_logprobs on the f32 copy): the pick's and each row's top-n
 * alternatives (n from 0 to 20, some rows none) within 1e-3, the same ids in the same order.
 * Also: a row gives the same bits alone, inside larger batches (other cluster sizes) and on
 * every call; bad arguments are refused; and the op is timed. Exits 77 (skipped) when the
 * CUDA backend is not built in or no device is present. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/dtype.h"
#include "common/error.h"
#include "engine/sampler.h"
#include "kernels/backend.h"
#include "tests/sampler_ref.h"
#include "tests/test_util.h"

#define MAX_ROWS 256
#define MAX_TOKS 512 /* prompt or output tokens of one row */

static pd_backend *g_gpu;
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

static double urand(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }

static float bf16r(float x) { return pd_bf16_to_f32(pd_f32_to_bf16(x)); }

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) abort();
    return p;
}

/* One row of logits, bf16-representable, never all zeros. kind 0: flat (sd ~1.5); 1: peaked
 * (a few tokens 6..12 above the rest); 2: values from a small set (many exact ties, the best
 * value shared by several tokens). Each row also gets some -inf and one NaN. */
static void gen_row(float *x, int32_t V, int kind)
{
    for (int32_t i = 0; i < V; i++) {
        double g = (urand() + urand() + urand() - 1.5) * 3.0;
        float v;
        if (kind == 2) v = (float)(floor(g * 4.0) / 4.0);
        else v = (float)g;
        if (v == 0.0f) v = 0.125f;
        x[i] = bf16r(v);
    }
    if (kind == 1) {
        int n = V < 40 ? 2 : 30;
        for (int i = 0; i < n; i++) x[rnd() % (uint64_t)V] = bf16r((float)(6.0 + 6.0 * urand()));
    }
    if (kind == 2 && V > 8) {
        for (int i = 0; i < 5; i++) x[rnd() % (uint64_t)V] = 9.0f; /* tied best */
    }
    int32_t n_inf = V / 1000 + 1;
    for (int32_t i = 0; i < n_inf; i++) x[rnd() % (uint64_t)V] = -INFINITY;
    if (V > 2) x[rnd() % (uint64_t)V] = NAN;
}

typedef struct {
    const char *name;
    smp_params p;
} param_set;

static smp_params mk(float temp, int32_t top_k, float top_p, float min_p, float rep, float freq,
                     float pres)
{
    smp_params p = smp_default_params();
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repetition_penalty = rep;
    p.frequency_penalty = freq;
    p.presence_penalty = pres;
    p.has_seed = true;
    return p;
}

/* A batch: logits and the per-row prompt/output tokens and seeds. */
typedef struct {
    int32_t V, n;
    float *logits;      /* [n][V] host f32 (bf16 values) */
    void *dev;          /* [n][V] act_dtype on the GPU */
    int32_t *prompt;    /* [n][MAX_TOKS] */
    int32_t *output;    /* [n][MAX_TOKS] */
    int32_t n_prompt[MAX_ROWS], n_output[MAX_ROWS];
    uint64_t seed[MAX_ROWS];
} batch;

static void batch_init(batch *b, int32_t V, int32_t n)
{
    memset(b, 0, sizeof *b);
    b->V = V;
    b->n = n;
    b->logits = xmalloc((size_t)n * V * sizeof(float));
    b->prompt = xmalloc((size_t)n * MAX_TOKS * sizeof(int32_t));
    b->output = xmalloc((size_t)n * MAX_TOKS * sizeof(int32_t));
    int rc = g_gpu->ops->alloc(g_gpu->ctx, g_gpu->ops->act_dtype, (size_t)n * V, &b->dev);
    if (rc != 0) {
        fprintf(stderr, "alloc of %d x %d logits failed: %d\n", n, V, rc);
        abort();
    }
    for (int32_t r = 0; r < n; r++) {
        gen_row(b->logits + (size_t)r * V, V, (int)(r % 3));
        /* Tokens from a small pool (repeats), in no order, some near the vocabulary's end. */
        int32_t pool[24];
        for (int i = 0; i < 24; i++)
            pool[i] = i < 4 ? V - 1 - (int32_t)(rnd() % (uint64_t)(V < 4 ? V : 4))
                            : (int32_t)(rnd() % (uint64_t)V);
        b->n_prompt[r] = (int32_t)(rnd() % 200);
        b->n_output[r] = (int32_t)(rnd() % 300);
        for (int32_t i = 0; i < MAX_TOKS; i++)
            b->prompt[(size_t)r * MAX_TOKS + i] =
                rnd() % 4 ? pool[rnd() % 24] : (int32_t)(rnd() % (uint64_t)V);
        for (int32_t i = 0; i < MAX_TOKS; i++) /* n_output may be changed later */
            b->output[(size_t)r * MAX_TOKS + i] =
                rnd() % 3 ? pool[rnd() % 24] : (int32_t)(rnd() % (uint64_t)V);
        b->seed[r] = rnd();
    }
}

static void batch_upload(batch *b)
{
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, b->dev, g_gpu->ops->act_dtype, 0, b->logits,
                                    PD_DTYPE_F32, (size_t)b->n * b->V),
                 0);
}

static void batch_free(batch *b)
{
    g_gpu->ops->free(g_gpu->ctx, b->dev);
    free(b->logits);
    free(b->prompt);
    free(b->output);
}

/* The op's inputs for rows [0, n) of b under per-row params ps[r]. */
static int32_t build_rows(const batch *b, const smp_params *ps, smp_scratch *s,
                          pd_sample_row *rows, pd_penalty_tok *pen)
{
    int32_t n_pen = 0;
    for (int32_t r = 0; r < b->n; r++) {
        smp_params p = ps[r];
        p.seed = b->seed[r];
        int32_t k = smp_penalty_list(&p, b->prompt + (size_t)r * MAX_TOKS, b->n_prompt[r],
                                     b->output + (size_t)r * MAX_TOKS, b->n_output[r], b->V, s,
                                     pen + n_pen);
        rows[r] = smp_sample_row(&p, b->n_output[r], n_pen, k);
        /* log-probabilities: none for every fourth row, else 0..20 alternatives */
        rows[r].n_top = r % 4 == 3 ? -1 : (r * 7) % (PD_MAX_TOP_LOGPROBS + 1);
        n_pen += k;
    }
    return n_pen;
}

/* The host's kept set of a sampled row, from the scaled logits smp_sample left in v:
 * kept[t] = 1 for kept tokens. Returns the number kept. */
static int32_t host_kept(const smp_params *p, const float *v, int32_t V, unsigned char *kept)
{
    int32_t *idx = xmalloc((size_t)V * sizeof *idx);
    float m;
    int32_t c = ref_kept_set(p, v, V, idx, kept, &m);
    free(idx);
    return c;
}

typedef struct {
    long greedy, greedy_same, sampled, sampled_same, lp_checked, top_checked;
    double lp_max_err;
} tally;

/* The GPU's raw log-probabilities of row r (its pick tok, its list top[0..n_top)) against
 * smp_logprobs on the host's f32 copy of the row. */
static void check_logprobs(const float *x, int32_t V, int32_t r, const pd_sample_row *row,
                           int32_t tok, float lp, const pd_top_logprob *top, const char *name,
                           tally *t)
{
    if (row->n_top < 0) {
        CHECK_MSG(lp == 0.0f, "%s V=%d row %d: no logprobs asked, got %g", name, V, r,
                  (double)lp);
        return;
    }
    pd_top_logprob ht[PD_MAX_TOP_LOGPROBS];
    float hlp = 0.0f;
    const int32_t n = smp_logprobs(x, V, tok, row->n_top, &hlp, ht);
    if (isinf(hlp) || isinf(lp)) {
        CHECK_MSG(hlp == lp, "%s V=%d row %d logprob of %d: host %g gpu %g", name, V, r, tok,
                  (double)hlp, (double)lp);
    } else {
        const double e = fabs((double)hlp - (double)lp);
        t->lp_checked++;
        if (e > t->lp_max_err) t->lp_max_err = e;
        CHECK_MSG(e <= 1e-3, "%s V=%d row %d logprob of %d: host %.7g gpu %.7g", name, V, r, tok,
                  (double)hlp, (double)lp);
    }
    for (int32_t j = 0; j < row->n_top; j++) {
        const int32_t want = j < n ? ht[j].token : -1;
        CHECK_MSG(top[j].token == want, "%s V=%d row %d top %d of %d: host token %d, gpu %d",
                  name, V, r, j, row->n_top, want, top[j].token);
        if (j >= n || top[j].token != want) continue;
        const double e = fabs((double)ht[j].logprob - (double)top[j].logprob);
        t->top_checked++;
        if (e > t->lp_max_err) t->lp_max_err = e;
        CHECK_MSG(e <= 1e-3, "%s V=%d row %d top %d (token %d): host %.7g gpu %.7g", name, V, r,
                  j, want, (double)ht[j].logprob, (double)top[j].logprob);
    }
}

/* Runs every row of b under ps on the GPU and on the host; compares. */
static void compare_batch(batch *b, const smp_params *ps, const char *name, smp_scratch *s,
                          tally *t)
{
    const int32_t V = b->V, n = b->n;
    pd_sample_row rows[MAX_ROWS];
    pd_penalty_tok *pen = xmalloc((size_t)n * 2 * MAX_TOKS * sizeof *pen);
    int32_t tok[MAX_ROWS];
    float lp[MAX_ROWS];
    pd_top_logprob *top = xmalloc((size_t)n * PD_MAX_TOP_LOGPROBS * sizeof *top);
    int32_t n_pen = build_rows(b, ps, s, rows, pen);
    batch_upload(b);
    for (int32_t r = 0; r < n; r++) tok[r] = -77;
    int rc = g_gpu->ops->sample(g_gpu->ctx, b->dev, n, V, rows, pen, n_pen, tok, lp, top);
    CHECK_EQ_INT(rc, 0);
    float *work = xmalloc((size_t)V * sizeof *work);
    unsigned char *kept = xmalloc((size_t)V);
    for (int32_t r = 0; r < n && rc == 0; r++) {
        smp_params p = ps[r];
        p.seed = b->seed[r];
        memcpy(work, b->logits + (size_t)r * V, (size_t)V * sizeof *work);
        int32_t h = smp_sample(&p, work, V, b->prompt + (size_t)r * MAX_TOKS, b->n_prompt[r],
                               b->output + (size_t)r * MAX_TOKS, b->n_output[r], s, NULL);
        const bool greedy = !(p.temperature >= 1e-5f);
        if (greedy) {
            t->greedy++;
            t->greedy_same += h == tok[r];
            CHECK_MSG(h == tok[r], "%s V=%d row %d greedy: host %d, gpu %d", name, V, r, h,
                      tok[r]);
        } else {
            t->sampled++;
            if (h == tok[r]) {
                t->sampled_same++;
            } else {
                int32_t nk = host_kept(&p, work, V, kept);
                bool in = tok[r] >= 0 && tok[r] < V && kept[tok[r]];
                float m = -INFINITY;
                for (int32_t i = 0; i < V; i++)
                    if (work[i] > m) m = work[i];
                printf("  mismatch %s V=%d row %d n_output %d: host %d (v %.9g p %.9g), gpu %d "
                       "(v %.9g p %.9g), kept set %d, gpu token %s\n",
                       name, V, r, b->n_output[r], h, work[h], expf(work[h] - m), tok[r],
                       in ? work[tok[r]] : NAN, in ? expf(work[tok[r]] - m) : NAN, nk,
                       in ? "kept" : "NOT KEPT");
                CHECK_MSG(in, "%s V=%d row %d: gpu token %d outside the host's kept set", name,
                          V, r, tok[r]);
            }
        }
        check_logprobs(b->logits + (size_t)r * V, V, r, &rows[r], tok[r], lp[r],
                       top + (size_t)r * PD_MAX_TOP_LOGPROBS, name, t);
    }
    free(work);
    free(kept);
    free(pen);
    free(top);
}

/* PD_TEST_QUICK=1 (e.g. under compute-sanitizer): the small vocabularies only, no timing. */
static bool g_quick;

static void test_against_host(smp_scratch *s)
{
    static const int32_t vocabs[4] = {151936, 32000, 4097, 7};
    tally all = {0};
    for (int vi = g_quick ? 2 : 0; vi < 4; vi++) {
        const int32_t V = vocabs[vi];
        const int32_t n = V > 100000 ? 32 : 64;
        param_set sets[] = {
            {"greedy", mk(0.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"greedy+penalties", mk(0.0f, 0, 1.0f, 0.0f, 1.3f, 0.5f, 0.4f)},
            {"temperature 1", mk(1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"temperature 0.7", mk(0.7f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"temperature 0.05", mk(0.05f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"top-k 1", mk(1.0f, 1, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"top-k 40", mk(0.8f, 40, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"top-k vocab-1", mk(1.0f, V - 1, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"top-p 0.05", mk(1.0f, 0, 0.05f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"top-p 0.9", mk(1.0f, 0, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"min-p 0.1", mk(1.0f, 0, 1.0f, 0.1f, 1.0f, 0.0f, 0.0f)},
            {"top-k 50 top-p 0.9", mk(0.9f, 50, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f)},
            {"top-k 40 top-p 0.5 min-p 0.05", mk(1.2f, 40, 0.5f, 0.05f, 1.0f, 0.0f, 0.0f)},
            {"top-p 0.8 min-p 0.02", mk(0.6f, 0, 0.8f, 0.02f, 1.0f, 0.0f, 0.0f)},
            {"repetition 1.3", mk(1.0f, 0, 1.0f, 0.0f, 1.3f, 0.0f, 0.0f)},
            {"repetition 0.8", mk(1.0f, 20, 1.0f, 0.0f, 0.8f, 0.0f, 0.0f)},
            {"frequency 0.7", mk(1.0f, 0, 1.0f, 0.0f, 1.0f, 0.7f, 0.0f)},
            {"presence 1", mk(1.0f, 0, 0.95f, 0.0f, 1.0f, 0.0f, 1.0f)},
            {"presence -0.8", mk(0.9f, 0, 1.0f, 0.0f, 1.0f, 0.0f, -0.8f)},
            {"all penalties top-k 100 top-p 0.9", mk(0.8f, 100, 0.9f, 0.0f, 1.2f, 0.3f, 0.5f)},
        };
        const int n_sets = (int)(sizeof sets / sizeof sets[0]);
        batch b;
        batch_init(&b, V, n);
        smp_params ps[MAX_ROWS];
        tally t = {0};
        for (int si = 0; si < n_sets; si++) {
            for (int32_t r = 0; r < n; r++) ps[r] = sets[si].p;
            compare_batch(&b, ps, sets[si].name, s, &t);
            /* Other seeds and positions for the same logits. */
            for (int32_t r = 0; r < n; r++) {
                b.seed[r] = rnd();
                b.n_output[r] = (int32_t)(rnd() % 300);
            }
        }
        /* Every parameter set in one batch, row by row. */
        for (int32_t r = 0; r < n; r++) ps[r] = sets[r % n_sets].p;
        compare_batch(&b, ps, "mixed", s, &t);
        printf("V=%6d: greedy %ld/%ld identical, sampled %ld/%ld identical, logprob max err "
               "%.3g over %ld picks and %ld alternatives\n",
               V, t.greedy_same, t.greedy, t.sampled_same, t.sampled, t.lp_max_err,
               t.lp_checked, t.top_checked);
        all.greedy += t.greedy;
        all.greedy_same += t.greedy_same;
        all.sampled += t.sampled;
        all.sampled_same += t.sampled_same;
        batch_free(&b);
    }
    double rate = all.sampled ? (double)all.sampled_same / (double)all.sampled : 0.0;
    printf("all: greedy %ld/%ld identical, sampled %ld/%ld identical (%.4f)\n", all.greedy_same,
           all.greedy, all.sampled_same, all.sampled, rate);
    CHECK_EQ_INT(all.greedy_same, all.greedy);
    CHECK_MSG(rate >= 0.995, "sampled draws identical in %.4f < 0.995", rate);
}

/* One row alone, inside a batch of 65 and again: the same token and logprob bits. */
static void test_batch_invariance(smp_scratch *s)
{
    const int32_t V = 151936, n = 65;
    batch b;
    batch_init(&b, V, n);
    smp_params ps[MAX_ROWS];
    for (int32_t r = 0; r < n; r++) {
        switch (r % 5) {
        case 0: ps[r] = mk(0.0f, 0, 1.0f, 0.0f, 1.2f, 0.2f, 0.1f); break;
        case 1: ps[r] = mk(0.9f, 50, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f); break;
        case 2: ps[r] = mk(1.0f, 0, 0.7f, 0.05f, 1.1f, 0.3f, 0.2f); break;
        case 3: ps[r] = mk(1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f); break;
        default: ps[r] = mk(0.6f, V - 1, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f); break;
        }
    }
    pd_sample_row rows[MAX_ROWS];
    pd_penalty_tok *pen = xmalloc((size_t)n * 2 * MAX_TOKS * sizeof *pen);
    int32_t n_pen = build_rows(&b, ps, s, rows, pen);
    batch_upload(&b);
    int32_t tok[MAX_ROWS], tok2[MAX_ROWS];
    float lp[MAX_ROWS], lp2[MAX_ROWS];
    const size_t tb = (size_t)PD_MAX_TOP_LOGPROBS * sizeof(pd_top_logprob); /* a row's list */
    pd_top_logprob *top = xmalloc(n * tb), *top2 = xmalloc(n * tb);
    memset(top, 0, n * tb);
    memset(top2, 0, n * tb);
    CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, b.dev, n, V, rows, pen, n_pen, tok, lp, top), 0);
    CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, b.dev, n, V, rows, pen, n_pen, tok2, lp2, top2),
                 0);
    CHECK(memcmp(tok, tok2, (size_t)n * sizeof *tok) == 0);
    CHECK(memcmp(lp, lp2, (size_t)n * sizeof *lp) == 0);
    for (int32_t r = 0; r < n; r++)
        CHECK_MSG(rows[r].n_top < 0 || memcmp(top + (size_t)r * PD_MAX_TOP_LOGPROBS,
                                              top2 + (size_t)r * PD_MAX_TOP_LOGPROBS,
                                              (size_t)rows[r].n_top * sizeof *top) == 0,
                  "row %d: the alternatives differ between two calls", r);
    const size_t es = pd_dtype_size(g_gpu->ops->act_dtype);
    int same = 0;
    for (int32_t r = 0; r < n; r++) {
        int32_t t1 = -1;
        float l1 = 0.0f;
        pd_top_logprob t1top[PD_MAX_TOP_LOGPROBS];
        void *row = (char *)b.dev + (size_t)r * V * es;
        CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, row, 1, V, &rows[r], pen, n_pen, &t1, &l1,
                                        t1top),
                     0);
        bool eq = t1 == tok[r] && memcmp(&l1, &lp[r], sizeof l1) == 0 &&
                  (rows[r].n_top < 0 ||
                   memcmp(t1top, top + (size_t)r * PD_MAX_TOP_LOGPROBS,
                          (size_t)rows[r].n_top * sizeof *top) == 0);
        same += eq;
        CHECK_MSG(eq, "row %d alone: token %d logprob %.9g; in the batch: %d %.9g", r, t1,
                  (double)l1, tok[r], (double)lp[r]);
    }
    /* The first 8 rows again as a batch of 8 in reverse order (other slots, cluster size). */
    pd_sample_row rev[8];
    for (int i = 0; i < 8; i++) rev[i] = rows[7 - i];
    void *tmp = NULL;
    CHECK_EQ_INT(g_gpu->ops->alloc(g_gpu->ctx, g_gpu->ops->act_dtype, (size_t)8 * V, &tmp), 0);
    float *host8 = xmalloc((size_t)8 * V * sizeof *host8);
    for (int i = 0; i < 8; i++)
        memcpy(host8 + (size_t)i * V, b.logits + (size_t)(7 - i) * V, (size_t)V * sizeof *host8);
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, tmp, g_gpu->ops->act_dtype, 0, host8,
                                    PD_DTYPE_F32, (size_t)8 * V),
                 0);
    int32_t t8[8];
    float l8[8];
    CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, tmp, 8, V, rev, pen, n_pen, t8, l8, NULL), 0);
    for (int i = 0; i < 8; i++)
        CHECK_MSG(t8[i] == tok[7 - i] && memcmp(&l8[i], &lp[7 - i], sizeof *l8) == 0,
                  "row %d reversed: %d %.9g vs %d %.9g", 7 - i, t8[i], (double)l8[i], tok[7 - i],
                  (double)lp[7 - i]);
    /* The split op (sample_launch / sample_collect, the pipelined steps'), rows without
     * penalties: the same tokens, logprobs and lists as the op in one call, from either slot. */
    if (g_gpu->ops->sample_launch) {
        pd_sample_row np[MAX_ROWS];
        int32_t sk1[MAX_ROWS], sk2[MAX_ROWS];
        float sl1[MAX_ROWS], sl2[MAX_ROWS];
        pd_top_logprob *st1 = xmalloc(n * tb), *st2 = xmalloc(n * tb);
        memset(st1, 0, n * tb);
        for (int32_t r = 0; r < n; r++) {
            np[r] = rows[r];
            np[r].pen_off = np[r].pen_n = 0;
            np[r].repetition_penalty = 1.0f;
            np[r].presence_penalty = np[r].frequency_penalty = 0.0f;
        }
        CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, b.dev, n, V, np, pen, 0, sk1, sl1, st1), 0);
        for (int slot = 0; slot < 2; slot++) {
            memset(st2, 0, n * tb);
            CHECK_EQ_INT(g_gpu->ops->sample_launch(g_gpu->ctx, b.dev, n, V, np, pen, 0, true,
                                                   NULL, slot),
                         0);
            CHECK_EQ_INT(g_gpu->ops->sample_collect(g_gpu->ctx, slot, sk2, sl2, st2), 0);
            bool eq = memcmp(sk1, sk2, (size_t)n * sizeof *sk1) == 0 &&
                      memcmp(sl1, sl2, (size_t)n * sizeof *sl1) == 0;
            for (int32_t r = 0; r < n && eq; r++)
                eq = np[r].n_top < 0 || memcmp(st1 + (size_t)r * PD_MAX_TOP_LOGPROBS,
                                               st2 + (size_t)r * PD_MAX_TOP_LOGPROBS,
                                               (size_t)np[r].n_top * sizeof *st1) == 0;
            CHECK_MSG(eq, "slot %d: launch / collect differs from the op in one call", slot);
        }
        /* a launch without logprobs cannot be collected with them */
        CHECK_EQ_INT(g_gpu->ops->sample_launch(g_gpu->ctx, b.dev, n, V, np, pen, 0, false, NULL, 0),
                     0);
        CHECK_EQ_INT(g_gpu->ops->sample_collect(g_gpu->ctx, 0, sk2, NULL, st2), PD_EINVAL);
        CHECK_EQ_INT(g_gpu->ops->sample_collect(g_gpu->ctx, 0, sk2, NULL, NULL), 0);
        free(st1);
        free(st2);
    }
    /* Without logprobs: the same tokens. */
    int32_t t3[MAX_ROWS];
    CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, b.dev, n, V, rows, pen, n_pen, t3, NULL, NULL),
                 0);
    CHECK(memcmp(tok, t3, (size_t)n * sizeof *tok) == 0);
    printf("batch invariance: %d/%d rows identical alone and in a batch of %d\n", same, n, n);
    g_gpu->ops->free(g_gpu->ctx, tmp);
    free(host8);
    free(pen);
    free(top);
    free(top2);
    batch_free(&b);
}

/* Greedy rows without penalties or log-probabilities (the op's greedy-only kernel): the host's
 * pick and the general path's, on the generated rows plus rows all -inf, all NaN, ties between
 * the first and the last token, the best last; batches of 1, 3 and 64 (other blocks a row). */
static void test_greedy_only(smp_scratch *s)
{
    static const int32_t vocabs[4] = {151936, 32000, 4097, 7};
    long same = 0, total = 0;
    for (int vi = g_quick ? 2 : 0; vi < 4; vi++) {
        const int32_t V = vocabs[vi], n = 64;
        batch b;
        batch_init(&b, V, n);
        float *x = b.logits;
        for (int32_t i = 0; i < V; i++) {
            x[(size_t)0 * V + i] = -INFINITY;
            x[(size_t)1 * V + i] = NAN;
            x[(size_t)2 * V + i] = i == 0 || i == V - 1 ? 3.0f : bf16r((float)(urand() - 0.5));
            x[(size_t)3 * V + i] = i == V - 1 ? 5.0f : (i % 2 ? NAN : -INFINITY);
        }
        batch_upload(&b);
        smp_params ps[MAX_ROWS];
        pd_sample_row rows[MAX_ROWS];
        pd_penalty_tok pen[1];
        for (int32_t r = 0; r < n; r++) ps[r] = mk(0.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
        CHECK_EQ_INT(build_rows(&b, ps, s, rows, pen), 0);
        int32_t fast[MAX_ROWS], gen[MAX_ROWS];
        float lp[MAX_ROWS];
        CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, b.dev, n, V, rows, pen, 0, gen, lp, NULL), 0);
        const int32_t ns[3] = {1, 3, 64};
        float *work = xmalloc((size_t)V * sizeof *work);
        for (int k = 0; k < 3; k++) {
            for (int32_t r = 0; r < n; r++) fast[r] = -5;
            CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, b.dev, ns[k], V, rows, pen, 0, fast,
                                            NULL, NULL),
                         0);
            for (int32_t r = 0; r < ns[k]; r++) {
                memcpy(work, x + (size_t)r * V, (size_t)V * sizeof *work);
                const int32_t h = smp_sample(&ps[r], work, V, NULL, 0, NULL, 0, s, NULL);
                CHECK_MSG(fast[r] == h && fast[r] == gen[r],
                          "greedy only V=%d n=%d row %d: %d, host %d, general path %d", V, ns[k],
                          r, fast[r], h, gen[r]);
                same += fast[r] == h && fast[r] == gen[r];
                total++;
            }
            CHECK(ns[k] == n || fast[ns[k]] == -5); /* nothing past the batch */
        }
        CHECK_MSG(fast[0] == 0 && fast[1] == 0 && fast[2] == 0 && fast[3] == V - 1,
                  "greedy only V=%d special rows: %d %d %d %d", V, fast[0], fast[1], fast[2],
                  fast[3]);
        free(work);
        batch_free(&b);
    }
    printf("greedy only: %ld/%ld picks as the host's and the general path's\n", same, total);
}

static void test_bad_args(void)
{
    void *buf = NULL;
    const int32_t V = 100;
    CHECK_EQ_INT(g_gpu->ops->alloc(g_gpu->ctx, g_gpu->ops->act_dtype, (size_t)2 * V, &buf), 0);
    smp_params p = smp_default_params();
    pd_sample_row rows[2] = {smp_sample_row(&p, 0, 0, 2), smp_sample_row(&p, 3, 2, 1)};
    pd_penalty_tok pen[3] = {{5, 1}, {7, 0}, {99, 2}};
    int32_t tok[2] = {-7, -7};
    float lp[2];
    const pd_backend_ops *o = g_gpu->ops;
#define BAD(...)                                                  \
    do {                                                          \
        CHECK_EQ_INT(o->sample(g_gpu->ctx, __VA_ARGS__, NULL), PD_EINVAL); \
        CHECK(tok[0] == -7 && tok[1] == -7);                      \
    } while (0)
    BAD(buf, 0, V, rows, pen, 3, tok, lp);
    BAD(buf, -1, V, rows, pen, 3, tok, lp);
    BAD(buf, 2, 0, rows, pen, 3, tok, lp);
    BAD(buf, 2, -5, rows, pen, 3, tok, lp);
    BAD(NULL, 2, V, rows, pen, 3, tok, lp);
    BAD(buf, 2, V, NULL, pen, 3, tok, lp);
    BAD(buf, 2, V, rows, pen, 3, NULL, lp);
    BAD(buf, 2, V, rows, NULL, 3, tok, lp);
    BAD(buf, 2, V, rows, pen, 2, tok, lp); /* row 1 reaches past the list */
    BAD(buf, 2, V, rows, pen, -1, tok, lp);
    rows[1].pen_off = -1;
    BAD(buf, 2, V, rows, pen, 3, tok, lp);
    rows[1].pen_off = 2;
    rows[1].pen_n = -1;
    BAD(buf, 2, V, rows, pen, 3, tok, lp);
    rows[1].pen_n = 1;
    pen[2].token = V; /* out of range */
    BAD(buf, 2, V, rows, pen, 3, tok, lp);
    pen[2].token = -1;
    BAD(buf, 2, V, rows, pen, 3, tok, lp);
    pen[2].token = 99;
    pen[1].count = -1;
    BAD(buf, 2, V, rows, pen, 3, tok, lp);
    pen[1].count = 0;
    pen[1].token = 5; /* the same token twice in row 0 */
    BAD(buf, 2, V, rows, pen, 3, tok, lp);
    pen[1].token = 7;
    /* The same list fixed is accepted, and a row may share entries with another. */
    rows[1].pen_off = 0;
    rows[1].pen_n = 3;
    /* n_top above the limit is refused */
    rows[0].n_top = PD_MAX_TOP_LOGPROBS + 1;
    BAD(buf, 2, V, rows, pen, 3, tok, lp);
    rows[0].n_top = 3;
    CHECK_EQ_INT(o->sample(g_gpu->ctx, buf, 2, V, rows, pen, 3, tok, lp, NULL), 0);
#undef BAD
    CHECK(tok[0] >= 0 && tok[0] < V && tok[1] >= 0 && tok[1] < V);
    g_gpu->ops->free(g_gpu->ctx, buf);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median wall time of the op (it returns after its stream sync) over 41 calls after 5. */
static double time_op(void *dev, int32_t n, int32_t V, const pd_sample_row *rows,
                      const pd_penalty_tok *pen, int32_t n_pen, int32_t *tok, float *lp)
{
    static pd_top_logprob top[MAX_ROWS * PD_MAX_TOP_LOGPROBS];
    pd_top_logprob *tp = lp ? top : NULL;
    double t[41];
    for (int i = 0; i < 5; i++)
        CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, dev, n, V, rows, pen, n_pen, tok, lp, tp),
                     0);
    for (int i = 0; i < 41; i++) {
        double t0 = now_s();
        int rc = g_gpu->ops->sample(g_gpu->ctx, dev, n, V, rows, pen, n_pen, tok, lp, tp);
        t[i] = now_s() - t0;
        CHECK_EQ_INT(rc, 0);
    }
    qsort(t, 41, sizeof *t, cmp_double);
    return t[20];
}

static void test_timing(smp_scratch *s)
{
    const int32_t V = 151936;
    batch b;
    batch_init(&b, V, 256);
    batch_upload(&b);
    smp_params ps[MAX_ROWS];
    pd_sample_row rows[MAX_ROWS];
    int32_t tok[MAX_ROWS];
    float lp[MAX_ROWS];
    const int32_t ns[3] = {1, 32, 256};
    printf("sample op, vocab %d (median of 41 calls, host clock around the call):\n", V);
    for (int kind = 0; kind < 3; kind++) {
        const char *name = kind == 0 ? "greedy" : kind == 1 ? "top-k 50 + top-p 0.9"
                                                            : "top-k 50 + top-p 0.9 + penalties";
        for (int32_t r = 0; r < 256; r++)
            ps[r] = kind == 0 ? mk(0.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f)
                    : kind == 1 ? mk(0.8f, 50, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f)
                                : mk(0.8f, 50, 0.9f, 0.0f, 1.1f, 0.2f, 0.2f);
        pd_penalty_tok *pen = xmalloc((size_t)256 * 2 * MAX_TOKS * sizeof *pen);
        int32_t n_pen = build_rows(&b, ps, s, rows, pen);
        for (int32_t r = 0; r < 256; r++) rows[r].n_top = 5; /* what the timing pays for */
        for (int i = 0; i < 3; i++) {
            double ms = time_op(b.dev, ns[i], V, rows, pen, n_pen, tok, lp) * 1e3;
            printf("  %-34s %3d rows: %8.3f ms (%.2f us/row; logprobs, top 5)\n", name, ns[i],
                   ms, ms * 1e3 / ns[i]);
            ms = time_op(b.dev, ns[i], V, rows, pen, n_pen, tok, NULL) * 1e3;
            printf("  %-34s %3d rows: %8.3f ms (%.2f us/row; no logprobs)\n", name, ns[i], ms,
                   ms * 1e3 / ns[i]);
        }
        /* The 256-row batch (one block per row) against rows alone (clusters). */
        int32_t t1;
        float l1;
        const size_t es = pd_dtype_size(g_gpu->ops->act_dtype);
        CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, b.dev, 256, V, rows, pen, n_pen, tok, lp,
                                        NULL),
                     0);
        for (int32_t r = 0; r < 256; r += 17) {
            CHECK_EQ_INT(g_gpu->ops->sample(g_gpu->ctx, (char *)b.dev + (size_t)r * V * es, 1, V,
                                            &rows[r], pen, n_pen, &t1, &l1, NULL),
                         0);
            CHECK_MSG(t1 == tok[r] && memcmp(&l1, &lp[r], sizeof l1) == 0,
                      "%s row %d: alone %d %.9g, in 256: %d %.9g", name, r, t1, (double)l1,
                      tok[r], (double)lp[r]);
        }
        free(pen);
    }
    /* The host sampler on one row, for scale. */
    float *work = xmalloc((size_t)V * sizeof *work);
    const smp_params hp[2] = {mk(0.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f),
                              mk(0.8f, 50, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f)};
    for (int k = 0; k < 2; k++) {
        double t0 = now_s();
        for (int i = 0; i < 20; i++) {
            memcpy(work, b.logits + (size_t)(i % 256) * V, (size_t)V * sizeof *work);
            smp_sample(&hp[k], work, V, NULL, 0, NULL, 0, s, NULL);
        }
        printf("  host smp_sample %-22s 1 row: %8.3f ms\n", k ? "top-k 50 + top-p 0.9" : "greedy",
               (now_s() - t0) / 20 * 1e3);
    }
    free(work);
    batch_free(&b);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    setvbuf(stdout, NULL, _IOLBF, 0); /* the numbers survive a timeout */
    pd_backend_params bp = pd_backend_default_params();
    int rc = pd_backend_create("cuda", &bp, &g_gpu, err);
    if (rc < 0) {
        fprintf(stderr, "test_cuda_sample: skipped: %s\n", err);
        return 77;
    }
    CHECK(g_gpu->ops->sample != NULL);
    smp_scratch *s = NULL;
    CHECK_EQ_INT(smp_scratch_create(151936, &s), 0);
    g_quick = getenv("PD_TEST_QUICK") && atoi(getenv("PD_TEST_QUICK")) > 0;
    if (g_gpu->ops->sample && s) {
        test_bad_args();
        test_against_host(s);
        test_greedy_only(s);
        if (!g_quick) {
            test_batch_invariance(s);
            test_timing(s);
        }
    }
    smp_scratch_destroy(s);
    pd_backend_destroy(g_gpu);
    return pd_test_result("test_cuda_sample");
}
