/* test_cuda_golden.c -- Whole-model check of the CUDA backend: the golden tiny models (and
 * stories260k) loaded on the CPU and the CUDA backend, one batched prefill of three prompts
 * over shuffled KV blocks and then decode steps fed the same tokens on both; every logits row
 * is compared. Tolerances for bf16 against fp32: for checkpoints stored in bf16 (the golden
 * models: both backends hold the same weights) max |diff| < 0.1, and the same argmax wherever
 * the CPU's top-1 leads its top-2 by more than 0.1; stories260k is stored in f32, so the GPU
 * runs a bf16-rounded copy of it: max |diff| < 0.6 and argmax checked above a 0.5 margin.
 * Every row also needs a relative L2 error under 5e-2. Exits 77 (skipped) without a CUDA
 * device. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/model_runner.h"
#include "kernels/backend.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

#define REL_L2_TOL 5e-2 /* per logits row */
#define N_SEQS 3
#define N_DECODE 24
#define BLOCK_SIZE 16
#define N_BLOCKS 64

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(uint32_t n)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)((g_rng >> 11) % n);
}

static int side_open(const char *backend, const char *dir, bool eager, tg_model *s, char *err)
{
    memset(s, 0, sizeof *s);
    mr_params mp = mr_default_params();
    if (eager) mp.max_graph_batch = 0;
    mp.block_size = BLOCK_SIZE;
    mp.n_blocks = N_BLOCKS;
    mp.max_num_batched_tokens = 512;
    mp.max_num_seqs = 8;
    pd_backend *be = NULL;
    int rc = pd_backend_create(backend, NULL, &be, err);
    return rc < 0 ? rc : tg_open_on(dir, &mp, be, s, err);
}

typedef struct {
    double max_abs, worst_rel, max_ref;
    int rows, argmax_checked, argmax_wrong;
} stats;

/* Compares n_rows rows of logits; updates st. */
static void compare_rows(const char *what, const float *gpu, const float *cpu, int n_rows,
                         int32_t V, double abs_tol, double margin_min, stats *st)
{
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
        CHECK_MSG(finite, "%s row %d: non-finite logits on the GPU", what, r);
        double rel = den > 0 ? sqrt(num / den) : 0;
        CHECK_MSG(mx < abs_tol, "%s row %d: max |logit diff| %.3g >= %g", what, r, mx, abs_tol);
        CHECK_MSG(rel < REL_L2_TOL, "%s row %d: relative L2 error %.3g >= %g", what, r, rel,
                  REL_L2_TOL);
        if (c[c1] - c2 > margin_min) {
            st->argmax_checked++;
            if (g1 != c1) st->argmax_wrong++;
            CHECK_MSG(g1 == c1, "%s row %d: argmax %d on the GPU, %d on the CPU (margin %.3g)",
                      what, r, g1, c1, c[c1] - c2);
        }
        if (mx > st->max_abs) st->max_abs = mx;
        if (rel > st->worst_rel) st->worst_rel = rel;
        st->rows++;
    }
}

static int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* Compares the GPU's logits with the CPU's for a prefill and decode steps. The GPU side
 * replays decode graphs, or with eager runs every step op by op. */
static void run_model(const char *dir, const char *name, double abs_tol, double margin_min,
                      bool eager)
{
    char err[PD_ERR_LEN] = "";
    tg_model cpu = {0}, gpu = {0};
    if (side_open("cpu", dir, false, &cpu, err) < 0 ||
        side_open("cuda", dir, eager, &gpu, err) < 0) {
        CHECK_MSG(0, "%s: %s", name, err);
        tg_close(&cpu);
        tg_close(&gpu);
        return;
    }
    const int32_t V = cpu.m->cfg.vocab_size;
    const int32_t q_lens[N_SEQS] = {37, 5, 70};
    const int32_t width = mr_max_blocks_per_seq(cpu.r);
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
    stats pre = {0}, dec = {0};
    int rc1 = mr_forward(cpu.r, &b, lc, err);
    CHECK_MSG(rc1 == 0, "%s cpu prefill: %s", name, err);
    int rc2 = mr_forward(gpu.r, &b, lg, err);
    CHECK_MSG(rc2 == 0, "%s cuda prefill: %s", name, err);
    if (rc1 == 0 && rc2 == 0) {
        char what[96];
        snprintf(what, sizeof what, "%s prefill", name);
        compare_rows(what, lg, lc, T, V, abs_tol, margin_min, &pre);
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
            if (mr_forward(cpu.r, &d, lc, err) < 0 || mr_forward(gpu.r, &d, lg, err) < 0) {
                CHECK_MSG(0, "%s decode step %d: %s", name, step, err);
                break;
            }
            snprintf(what, sizeof what, "%s decode step %d", name, step);
            compare_rows(what, lg, lc, N_SEQS, V, abs_tol, margin_min, &dec);
            for (int s = 0; s < N_SEQS; s++) last[s] = argmax(lc + (size_t)s * V, V);
        }
    }
    /* The decode steps (3 sequences: bucket 4, one padding row) replayed graphs or not. */
    CHECK_MSG(mr_graph_steps(gpu.r) == (eager ? 0 : N_DECODE), "%s: %lld of %d decode steps "
              "ran as graphs (%s)", name, (long long)mr_graph_steps(gpu.r), N_DECODE,
              eager ? "eager" : "graphs on");
    printf("  %-12s %-6s (max |logit| %.1f) prefill %3d rows: max |diff| %.3g, worst row rel L2 %.2e, "
           "argmax %d/%d | decode %3d rows: max |diff| %.3g, worst rel L2 %.2e, argmax %d/%d\n",
           name, eager ? "eager" : "graphs", pre.max_ref > dec.max_ref ? pre.max_ref : dec.max_ref, pre.rows, pre.max_abs, pre.worst_rel, pre.argmax_checked - pre.argmax_wrong,
           pre.argmax_checked, dec.rows, dec.max_abs, dec.worst_rel,
           dec.argmax_checked - dec.argmax_wrong, dec.argmax_checked);
    CHECK(pre.rows == T && dec.rows == N_DECODE * N_SEQS);
    free(bt); free(ids); free(pos); free(slots); free(rows); free(lc); free(lg);
    tg_close(&cpu);
    tg_close(&gpu);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    pd_backend *probe = NULL;
    if (pd_backend_create("cuda", NULL, &probe, err) < 0) {
        fprintf(stderr, "test_cuda_golden: skipped: %s\n", err);
        return 77;
    }
    pd_backend_destroy(probe);
    const struct {
        const char *path;
        double abs_tol, margin_min;
    } models[4] = {{"testdata/golden/qwen3-tiny", 0.1, 0.1},
                   {"testdata/golden/qwen2-tiny", 0.1, 0.1},
                   {"testdata/golden/llama-tiny", 0.1, 0.1},
                   {"models/stories260k", 0.6, 0.5}};
    printf("test_cuda_golden: logits on cuda against cpu\n");
    for (int i = 0; i < 4; i++) {
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/%s", pd_test_shared_dir(), models[i].path);
        for (int eager = 0; eager < 2; eager++)
            run_model(dir, strrchr(models[i].path, '/') + 1, models[i].abs_tol,
                      models[i].margin_min, eager);
    }
    return pd_test_result("test_cuda_golden");
}
