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
#include "engine/model_runner.h"
#include "kernels/backend.h"
#include "tests/cuda_golden_util.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"
#include "text/model_config.h"

static int side_open(const char *backend, const char *dir, const char *quant, bool eager,
                     tg_model *s, char *err)
{
    memset(s, 0, sizeof *s);
    mr_params mp = cg_params(eager);
    pd_backend *be = NULL;
    int rc = pd_backend_create(backend, NULL, &be, err);
    return rc < 0 ? rc : tg_open_quant(dir, quant, &mp, be, s, err);
}

/* Compares the GPU's logits with the CPU's for a prefill and decode steps. The GPU side
 * replays decode graphs, or with eager runs every step op by op. */
static void run_model(const char *dir, const char *name, const char *quant, double abs_tol,
                      double margin_min, bool eager, double outlier_frac, double rel_l2)
{
    char err[PD_ERR_LEN] = "";
    tg_model cpu = {0}, gpu = {0};
    if (side_open("cpu", dir, quant, false, &cpu, err) < 0 ||
        side_open("cuda", dir, quant, eager, &gpu, err) < 0) {
        CHECK_MSG(0, "%s: %s", name, err);
        tg_close(&cpu);
        tg_close(&gpu);
        return;
    }
    const int32_t V = cpu.m->cfg.vocab_size;
    const cg_run run = {name, name, "cuda", abs_tol, margin_min, false, outlier_frac, rel_l2};
    cg_stats pre = {0}, dec = {0};
    int32_t T = cg_compare_model(cpu.r, gpu.r, V, &run, &pre, &dec);
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
    CHECK_MSG(pre.outliers + dec.outliers <= outlier_frac * (pre.rows + dec.rows),
              "%s: %d of %d rows past the tolerances (at most %.0f%%)", name,
              pre.outliers + dec.outliers, pre.rows + dec.rows, 100 * outlier_frac);
    if (outlier_frac > 0)
        printf("  %-12s %d of %d rows past the tolerances (at most %.0f%%)\n", name,
               pre.outliers + dec.outliers, pre.rows + dec.rows, 100 * outlier_frac);
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
    printf("test_cuda_golden: logits on cuda against cpu\n");
    for (int i = 0; i < CG_N_MODELS; i++) {
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/%s", pd_test_shared_dir(), cg_models[i].path);
        for (int eager = 0; eager < 2; eager++)
            run_model(dir, strrchr(cg_models[i].path, '/') + 1, NULL, cg_models[i].abs_tol,
                      cg_models[i].margin_min, eager, 0, 0);
    }
    /* the mixture-of-experts goldens (no decode graphs: their routing sizes the experts'
     * products on the host), the tolerances of the dense goldens but for up to 5% of the rows:
     * the goldens' random routers score experts close together, and where bf16's rounding
     * reorders two of them at the top-k boundary the GPU's row takes the other expert (how
     * many did: docs/perf-history.md, "MoE on the GPU, first run") */
    static const char *const moe[] = {"qwen3-moe-tiny", "qwen3-moe-tiny-step2", "mixtral-tiny"};
    for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++) {
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/tests/data/golden-moe/%s", PD_SOURCE_DIR, moe[i]);
        run_model(dir, moe[i], NULL, 0.1, 0.1, true, 0.05, 0);
    }
    /* FP8 experts (--quantization fp8 on both backends: every linear per channel, activations
     * per token), the experts stacked for the op set's moe_experts and the decode steps
     * replayed as graphs (no host in a step). Every linear's input rows are quantized, and
     * where the GPU's bf16 rows and the CPU's f32 rows round to neighbouring e4m3 codes the
     * difference grows layer by layer: rows within 0.3 and a relative L2 error of 0.15 (the
     * dense bound's 0.1 and 0.05 measured 0.05 - 0.065 on mixtral-tiny's small logits, up to
     * 2.8), up to 10% of them past that (the routing's near-ties) */
    for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i += 2) {
        char dir[1024], name[64];
        snprintf(dir, sizeof dir, "%s/tests/data/golden-moe/%s", PD_SOURCE_DIR, moe[i]);
        snprintf(name, sizeof name, "%s-fp8", moe[i]);
        run_model(dir, name, "fp8", 0.3, 0.3, false, 0.1, 0.15);
    }
    return pd_test_result("test_cuda_golden");
}
