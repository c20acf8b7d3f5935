/* test_cuda_tp.c -- Tensor parallelism on the CUDA backend (NCCL, one GPU a rank): the golden
 * tiny models and stories260k at TP 2, and at TP 4 where the machine has 4 GPUs and the
 * model's heads divide, against the CPU backend at TP 1: one batched prefill of three prompts
 * over shuffled KV blocks, then decode steps fed the CPU's argmax, every logits row compared
 * with test_cuda_golden's bf16 tolerances (max |diff| 0.1 for the bf16 checkpoints, 0.6 for
 * stories260k's f32 one; argmax where the CPU's margin exceeds 0.1 / 0.5; relative L2 under
 * 5e-2), once with decode graphs (the all-reduces captured inside; every decode step must
 * replay one) and once eager. Exits 77 (skipped) with fewer than 2 CUDA devices or without
 * NCCL. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "engine/tp.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

#define REL_L2_TOL 5e-2
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

static mr_params params(bool eager)
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
    double max_abs, worst_rel;
    int rows, argmax_checked, argmax_wrong;
} stats;

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
            if (c[v] > c[c1]) c1 = v;
            if (g[v] > g[g1]) g1 = v;
        }
        float c2 = -INFINITY;
        for (int32_t v = 0; v < V; v++)
            if (v != c1 && c[v] > c2) c2 = c[v];
        double rel = den > 0 ? sqrt(num / den) : 0;
        CHECK_MSG(finite, "%s row %d: non-finite logits", what, r);
        CHECK_MSG(mx < abs_tol, "%s row %d: max |logit diff| %.3g >= %g", what, r, mx, abs_tol);
        CHECK_MSG(rel < REL_L2_TOL, "%s row %d: relative L2 %.3g", what, r, rel);
        if (c[c1] - c2 > margin_min) {
            st->argmax_checked++;
            if (g1 != c1) st->argmax_wrong++;
            CHECK_MSG(g1 == c1, "%s row %d: argmax %d, CPU %d (margin %.3g)", what, r, g1, c1,
                      c[c1] - c2);
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

static void run_model(const char *dir, const char *name, int32_t n_tp, double abs_tol,
                      double margin_min, bool eager)
{
    char err[PD_ERR_LEN] = "";
    mc_config cfg;
    if (mc_load(dir, &cfg, err) < 0) {
        CHECK_MSG(0, "%s: %s", name, err);
        return;
    }
    pd_shard sh;
    if (pd_shard_of(&cfg, 0, n_tp, &sh, err) < 0) {
        printf("  %-12s TP %d: not divisible, skipped (%s)\n", name, n_tp, err);
        return;
    }
    mr_params mp = params(eager);
    tg_model cpu = {0};
    tp_group *g = NULL;
    mr *gpu = NULL;
    tp_group_params gp = {.backend = "cuda", .bp = pd_backend_default_params(), .n_ranks = n_tp,
                          .cfg = &cfg, .dir = dir, .fmt = PD_LOAD_SAFETENSORS};
    if (tg_open(dir, &mp, &cpu) < 0 || tp_group_load(&gp, &g, err) < 0 ||
        mr_create_tp(&mp, (const pd_model *const *)g->models, n_tp, g->comm, &gpu, err) < 0) {
        CHECK_MSG(0, "%s TP %d: %s", name, n_tp, err);
        mr_destroy(gpu);
        tp_group_destroy(g);
        tg_close(&cpu);
        return;
    }
    if (!eager)
        CHECK_MSG(mr_n_graphs(gpu) > 0, "%s TP %d: no decode graphs captured", name, n_tp);
    const int32_t V = cfg.vocab_size, width = mr_max_blocks_per_seq(cpu.r);
    const int32_t q_lens[N_SEQS] = {37, 5, 70};
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
    char what[96];
    int rc1 = mr_forward(cpu.r, &b, lc, err);
    CHECK_MSG(rc1 == 0, "%s cpu prefill: %s", name, err);
    int rc2 = mr_forward(gpu, &b, lg, err);
    CHECK_MSG(rc2 == 0, "%s cuda TP %d prefill: %s", name, n_tp, err);
    if (rc1 == 0 && rc2 == 0) {
        snprintf(what, sizeof what, "%s TP %d prefill", name, n_tp);
        compare_rows(what, lg, lc, T, V, abs_tol, margin_min, &pre);
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
            if (mr_forward(cpu.r, &d, lc, err) < 0 || mr_forward(gpu, &d, lg, err) < 0) {
                CHECK_MSG(0, "%s TP %d decode step %d: %s", name, n_tp, step, err);
                break;
            }
            snprintf(what, sizeof what, "%s TP %d decode step %d", name, n_tp, step);
            compare_rows(what, lg, lc, N_SEQS, V, abs_tol, margin_min, &dec);
            for (int s = 0; s < N_SEQS; s++) last[s] = argmax(lc + (size_t)s * V, V);
        }
    }
    CHECK_MSG(mr_graph_steps(gpu) == (eager ? 0 : N_DECODE), "%s TP %d: %lld of %d decode steps "
              "replayed graphs (%s)", name, n_tp, (long long)mr_graph_steps(gpu), N_DECODE,
              eager ? "eager" : "graphs on");
    printf("  %-12s TP %d %-6s prefill %3d rows: max |diff| %.3g, rel L2 %.2e, argmax %d/%d | "
           "decode %3d rows: max |diff| %.3g, rel L2 %.2e, argmax %d/%d\n", name, n_tp,
           eager ? "eager" : "graphs", pre.rows, pre.max_abs, pre.worst_rel,
           pre.argmax_checked - pre.argmax_wrong, pre.argmax_checked, dec.rows, dec.max_abs,
           dec.worst_rel, dec.argmax_checked - dec.argmax_wrong, dec.argmax_checked);
    CHECK(pre.rows == T && dec.rows == N_DECODE * N_SEQS);
    free(bt); free(ids); free(pos); free(slots); free(rows); free(lc); free(lg);
    mr_destroy(gpu);
    tp_group_destroy(g);
    tg_close(&cpu);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    int32_t n_dev = 0;
    for (; n_dev < 8; n_dev++) {
        pd_backend *probe = NULL;
        pd_backend_params bp = pd_backend_default_params();
        bp.device = n_dev;
        if (pd_backend_create("cuda", &bp, &probe, err) < 0) break;
        pd_backend_destroy(probe);
    }
    if (n_dev < 2) {
        fprintf(stderr, "test_cuda_tp: skipped: %d CUDA devices (2 needed)\n", n_dev);
        return 77;
    }
    {
        pd_backend *be[2] = {NULL, NULL};
        pd_comm *c = NULL;
        for (int r = 0; r < 2; r++) {
            pd_backend_params bp = pd_backend_default_params();
            bp.device = r;
            (void)pd_backend_create("cuda", &bp, &be[r], err);
        }
        int rc = pd_comm_create(be, 2, &c, err);
        pd_comm_destroy(c);
        for (int r = 0; r < 2; r++) pd_backend_destroy(be[r]);
        if (rc == PD_EUNSUPPORTED) {
            fprintf(stderr, "test_cuda_tp: skipped: %s\n", err);
            return 77;
        }
    }
    const struct {
        const char *path;
        double abs_tol, margin_min;
    } models[4] = {{"testdata/golden/qwen3-tiny", 0.1, 0.1},
                   {"testdata/golden/qwen2-tiny", 0.1, 0.1},
                   {"testdata/golden/llama-tiny", 0.1, 0.1},
                   {"models/stories260k", 0.6, 0.5}};
    printf("test_cuda_tp: tensor parallel on %d GPUs against the CPU at TP 1\n", n_dev);
    for (int32_t n_tp = 2; n_tp <= 4 && n_tp <= n_dev; n_tp *= 2)
        for (int i = 0; i < 4; i++) {
            char dir[1024];
            snprintf(dir, sizeof dir, "%s/%s", pd_test_shared_dir(), models[i].path);
            for (int eager = 0; eager < 2; eager++)
                run_model(dir, strrchr(models[i].path, '/') + 1, n_tp, models[i].abs_tol,
                          models[i].margin_min, eager);
        }
    return pd_test_result("test_cuda_tp");
}
