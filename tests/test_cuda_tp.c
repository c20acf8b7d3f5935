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
#include "tests/cuda_golden_util.h"
#include "tests/golden_util.h"
#include "tests/nccl_probe.h"
#include "tests/test_util.h"

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
    mr_params mp = cg_params(eager);
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
    char label[64], gpu_side[32];
    snprintf(label, sizeof label, "%s TP %d", name, n_tp);
    snprintf(gpu_side, sizeof gpu_side, "cuda TP %d", n_tp);
    const cg_run run = {name, label, gpu_side, abs_tol, margin_min, true};
    cg_stats pre = {0}, dec = {0};
    int32_t T = cg_compare_model(cpu.r, gpu, cfg.vocab_size, &run, &pre, &dec);
    CHECK_MSG(mr_graph_steps(gpu) == (eager ? 0 : N_DECODE), "%s TP %d: %lld of %d decode steps "
              "replayed graphs (%s)", name, n_tp, (long long)mr_graph_steps(gpu), N_DECODE,
              eager ? "eager" : "graphs on");
    printf("  %-12s TP %d %-6s prefill %3d rows: max |diff| %.3g, rel L2 %.2e, argmax %d/%d | "
           "decode %3d rows: max |diff| %.3g, rel L2 %.2e, argmax %d/%d\n", name, n_tp,
           eager ? "eager" : "graphs", pre.rows, pre.max_abs, pre.worst_rel,
           pre.argmax_checked - pre.argmax_wrong, pre.argmax_checked, dec.rows, dec.max_abs,
           dec.worst_rel, dec.argmax_checked - dec.argmax_wrong, dec.argmax_checked);
    CHECK(pre.rows == T && dec.rows == N_DECODE * N_SEQS);
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
    if (nccl_probe(err) == PD_EUNSUPPORTED) { /* NCCL present? */
        fprintf(stderr, "test_cuda_tp: skipped: %s\n", err);
        return 77;
    }
    printf("test_cuda_tp: tensor parallel on %d GPUs against the CPU at TP 1\n", n_dev);
    for (int32_t n_tp = 2; n_tp <= 4 && n_tp <= n_dev; n_tp *= 2)
        for (int i = 0; i < CG_N_MODELS; i++) {
            char dir[1024];
            snprintf(dir, sizeof dir, "%s/%s", pd_test_shared_dir(), cg_models[i].path);
            for (int eager = 0; eager < 2; eager++)
                run_model(dir, strrchr(cg_models[i].path, '/') + 1, n_tp, cg_models[i].abs_tol,
                          cg_models[i].margin_min, eager);
        }
    return pd_test_result("test_cuda_tp");
}
