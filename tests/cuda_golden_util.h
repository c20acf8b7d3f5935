/* cuda_golden_util.h -- The whole-model comparison shared by test_cuda_golden and test_cuda_tp:
 * one batched prefill of N_SEQS prompts over shuffled KV blocks, then N_DECODE decode steps fed
 * the CPU's argmax, every logits row of a GPU runner compared with the CPU runner's under the
 * bf16 tolerances. Header-only (static inline), for test executables. */
#ifndef PD_CUDA_GOLDEN_UTIL_H
#define PD_CUDA_GOLDEN_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/error.h"
#include "engine/model_runner.h"
#include "tests/test_util.h"

#define REL_L2_TOL 5e-2 /* per logits row */
#define N_SEQS 3
#define N_DECODE 24
#define BLOCK_SIZE 16
#define N_BLOCKS 64

/* The models both tests run, with their tolerances: the golden tiny models are stored in bf16
 * (the GPU holds the same weights), stories260k in f32 (the GPU runs a bf16-rounded copy). */
typedef struct {
    const char *path;  /* under pd_test_shared_dir() */
    double abs_tol;    /* max |logit diff| per row */
    double margin_min; /* argmax compared where the CPU's top-1 leads its top-2 by more */
} cg_model;

#define CG_N_MODELS 4
static const cg_model cg_models[CG_N_MODELS] = {{"testdata/golden/qwen3-tiny", 0.1, 0.1},
                                                {"testdata/golden/qwen2-tiny", 0.1, 0.1},
                                                {"testdata/golden/llama-tiny", 0.1, 0.1},
                                                {"models/stories260k", 0.6, 0.5}};

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static inline uint32_t rnd(uint32_t n)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)((g_rng >> 11) % n);
}

/* Runner parameters for both sides; eager turns decode graphs off. */
static inline mr_params cg_params(bool eager)
{
    mr_params mp = mr_default_params();
    if (eager) mp.max_graph_batch = 0;
    mp.block_size = BLOCK_SIZE;
    mp.n_blocks = N_BLOCKS;
    mp.max_num_batched_tokens = 512;
    mp.max_num_seqs = 8;
    return mp;
}

typedef struct {
    double max_abs;   /* largest |logit diff| of any row */
    double worst_rel; /* largest relative L2 error of any row */
    double max_ref;   /* largest |logit| on the CPU */
    int rows, argmax_checked, argmax_wrong;
    int outliers; /* rows past the tolerances that outlier_frac let through */
} cg_stats;

/* One comparison's labels and tolerances. */
typedef struct {
    const char *name;     /* the model, in "<name> cpu prefill" */
    const char *label;    /* start of every row's label: the name, or "<name> TP 2" */
    const char *gpu_side; /* in "<name> <gpu_side> prefill": "cuda", or "cuda TP 2" */
    double abs_tol;       /* max |logit diff| per row */
    double margin_min;    /* argmax compared where the CPU's top-1 leads its top-2 by more */
    bool terse;           /* test_cuda_tp's shorter failure messages */
    /* > 0: rows past abs_tol or the relative L2 bound are counted in cg_stats.outliers (and
     * their argmax not compared) instead of failing, the caller checking the count against
     * this fraction of the rows: a mixture of experts whose router scores two experts within
     * bf16's rounding of each other takes the other one on the GPU for that token, a
     * different (equally valid) row */
    double outlier_frac;
    /* > 0: each row's relative L2 bound instead of REL_L2_TOL (quantized activations, whose
     * e4m3 codes flip where the GPU's bf16 rows and the CPU's f32 rows round apart) */
    double rel_l2;
} cg_run;

/* Compares n_rows rows of logits; updates st. */
static inline void cg_compare_rows(const cg_run *run, const char *what, const float *gpu,
                                   const float *cpu, int n_rows, int32_t V, cg_stats *st)
{
    const double abs_tol = run->abs_tol, margin_min = run->margin_min;
    for (int r = 0; r < n_rows; r++) {
        const float *g = gpu + (size_t)r * V, *c = cpu + (size_t)r * V;
        double num = 0, den = 0, mx = 0;
        int c1 = 0, g1 = 0, finite = 1;
        for (int32_t v = 0; v < V; v++) {
            if (!isfinite(g[v])) finite = 0;
            double d = fabs((double)g[v] - c[v]);
            if (d > mx) mx = d;
            num += d * d;
            den += (double)c[v] * c[v];
            if (fabs(c[v]) > st->max_ref) st->max_ref = fabs(c[v]);
            if (c[v] > c[c1]) c1 = v;
            if (g[v] > g[g1]) g1 = v;
        }
        float c2 = -INFINITY;
        for (int32_t v = 0; v < V; v++)
            if (v != c1 && c[v] > c2) c2 = c[v];
        double rel = den > 0 ? sqrt(num / den) : 0;
        const double rel_tol = run->rel_l2 > 0 ? run->rel_l2 : REL_L2_TOL;
        CHECK_MSG(finite, "%s row %d: non-finite logits%s", what, r,
                  run->terse ? "" : " on the GPU");
        if (run->outlier_frac > 0 && finite && !(mx < abs_tol && rel < rel_tol)) {
            printf("  %s row %d: max |logit diff| %.3g, relative L2 %.3g: an outlier\n", what, r,
                   mx, rel);
            st->outliers++;
            st->rows++;
            continue;
        }
        CHECK_MSG(mx < abs_tol, "%s row %d: max |logit diff| %.3g >= %g", what, r, mx, abs_tol);
        if (run->terse)
            CHECK_MSG(rel < rel_tol, "%s row %d: relative L2 %.3g", what, r, rel);
        else
            CHECK_MSG(rel < rel_tol, "%s row %d: relative L2 error %.3g >= %g", what, r, rel,
                      rel_tol);
        if (c[c1] - c2 > margin_min) {
            st->argmax_checked++;
            if (g1 != c1) st->argmax_wrong++;
            if (run->terse)
                CHECK_MSG(g1 == c1, "%s row %d: argmax %d, CPU %d (margin %.3g)", what, r, g1,
                          c1, c[c1] - c2);
            else
                CHECK_MSG(g1 == c1,
                          "%s row %d: argmax %d on the GPU, %d on the CPU (margin %.3g)", what,
                          r, g1, c1, c[c1] - c2);
        }
        if (mx > st->max_abs) st->max_abs = mx;
        if (rel > st->worst_rel) st->worst_rel = rel;
        st->rows++;
    }
}

static inline int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* Runs one batched prefill of N_SEQS prompts of random tokens (from rnd) on cpu and gpu, each
 * sequence over its own shuffled KV blocks, then N_DECODE decode steps on both fed the CPU's
 * argmax, comparing every logits row under run's tolerances. V is the vocabulary size; pre and
 * dec (zeroed by the caller) collect the prefill's and the decode steps' stats. Returns the
 * number of prefill rows. */
static inline int32_t cg_compare_model(mr *cpu, mr *gpu, int32_t V, const cg_run *run,
                                       cg_stats *pre, cg_stats *dec)
{
    char err[PD_ERR_LEN] = "";
    const int32_t q_lens[N_SEQS] = {37, 5, 70};
    const int32_t width = mr_max_blocks_per_seq(cpu);
    /* Each sequence gets its own shuffled blocks, enough for prompt + decode steps. */
    int32_t perm[N_BLOCKS];
    for (int i = 0; i < N_BLOCKS; i++) perm[i] = i;
    for (int i = N_BLOCKS - 1; i > 0; i--) {
        int j = (int)rnd((uint32_t)i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int32_t *bt = calloc((size_t)N_SEQS * width, sizeof(int32_t));
    int next = 0;
    for (int s = 0; s < N_SEQS; s++) {
        int need = (q_lens[s] + N_DECODE + BLOCK_SIZE - 1) / BLOCK_SIZE;
        for (int b = 0; b < need; b++) bt[s * width + b] = perm[next++];
    }
    PD_ASSERT(next <= N_BLOCKS, "test needs more blocks");
    int32_t T = 0;
    for (int s = 0; s < N_SEQS; s++) T += q_lens[s];
    int32_t *ids = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4);
    int32_t *slots = malloc((size_t)T * 4), *rows = malloc((size_t)T * 4);
    int32_t cu[N_SEQS + 1] = {0}, ctx[N_SEQS];
    float *lc = malloc((size_t)T * V * sizeof(float)), *lg = malloc((size_t)T * V * sizeof(float));
    for (int s = 0, t = 0; s < N_SEQS; s++) {
        cu[s + 1] = cu[s] + q_lens[s];
        ctx[s] = q_lens[s];
        for (int i = 0; i < q_lens[s]; i++, t++) {
            ids[t] = (int32_t)rnd((uint32_t)V);
            pos[t] = i;
            slots[t] = bt[s * width + i / BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE;
        }
    }
    for (int32_t i = 0; i < T; i++) rows[i] = i;
    mr_batch b = {T, ids, pos, slots, N_SEQS, cu, ctx, bt, width, T, rows};
    int rc1 = mr_forward(cpu, &b, lc, err);
    CHECK_MSG(rc1 == 0, "%s cpu prefill: %s", run->name, err);
    int rc2 = mr_forward(gpu, &b, lg, err);
    CHECK_MSG(rc2 == 0, "%s %s prefill: %s", run->name, run->gpu_side, err);
    if (rc1 == 0 && rc2 == 0) {
        char what[96];
        snprintf(what, sizeof what, "%s prefill", run->label);
        cg_compare_rows(run, what, lg, lc, T, V, pre);
        /* Decode: every sequence's next token is the CPU's argmax, fed to both. */
        int32_t last[N_SEQS];
        for (int s = 0; s < N_SEQS; s++) last[s] = argmax(lc + (size_t)(cu[s + 1] - 1) * V, V);
        for (int step = 0; step < N_DECODE; step++) {
            int32_t dcu[N_SEQS + 1] = {0};
            for (int s = 0; s < N_SEQS; s++) {
                int32_t p = ctx[s];
                ids[s] = last[s];
                pos[s] = p;
                slots[s] = bt[s * width + p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE;
                ctx[s] = p + 1;
                dcu[s + 1] = s + 1;
                rows[s] = s;
            }
            mr_batch d = {N_SEQS, ids, pos, slots, N_SEQS, dcu, ctx, bt, width, N_SEQS, rows};
            if (mr_forward(cpu, &d, lc, err) < 0 || mr_forward(gpu, &d, lg, err) < 0) {
                CHECK_MSG(0, "%s decode step %d: %s", run->label, step, err);
                break;
            }
            snprintf(what, sizeof what, "%s decode step %d", run->label, step);
            cg_compare_rows(run, what, lg, lc, N_SEQS, V, dec);
            for (int s = 0; s < N_SEQS; s++) last[s] = argmax(lc + (size_t)s * V, V);
        }
    }
    free(bt); free(ids); free(pos); free(slots); free(rows); free(lc); free(lg);
    return T;
}

#endif
