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
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

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
    const cg_run run = {name, label, gpu_side, abs_tol, margin_min, true, 0, 0};
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

/* Fused decode steps (decode_layers with the ranks' sums through peer memory) against the
 * same group's steps op by op with NCCL (PDSERVE_CUDA_TP_FUSED=0 when its communicator is
 * made): the same dummy shards (same seed, same degree), a Llama shape decode_layers takes
 * (the golden models are too small for it), decode steps of 3 sequences (PDSERVE_CUDA_FUSED_
 * DECODE=8, set in main) with graphs and eager. The tolerances are the golden models': both
 * sides round in bf16, the fused one sums the ranks' parts in float, NCCL in bf16. */
static void run_fused(int32_t n_tp, int32_t hidden, int32_t inter, int32_t heads,
                      int32_t kv_heads, bool eager)
{
    char err[PD_ERR_LEN] = "", dir[] = "/tmp/pdserve-tpfused-XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK_MSG(0, "mkdtemp failed");
        return;
    }
    char path[sizeof dir + 16];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) {
        CHECK_MSG(0, "cannot write %s", path);
        return;
    }
    fprintf(f, "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", "
               "\"hidden_size\": %d, \"intermediate_size\": %d, \"num_hidden_layers\": 3, "
               "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": 128, "
               "\"vocab_size\": 4096, \"max_position_embeddings\": 4096, "
               "\"rms_norm_eps\": 1e-05, \"rope_theta\": 500000.0, \"hidden_act\": \"silu\", "
               "\"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\"}\n",
            hidden, inter, heads, kv_heads);
    fclose(f);
    mc_config cfg;
    char name[64];
    snprintf(name, sizeof name, "llama-%d-%d-%d/%d", hidden, inter, heads, kv_heads);
    mr_params mp = cg_params(eager);
    tp_group_params gp = {.backend = "cuda", .bp = pd_backend_default_params(), .n_ranks = n_tp,
                          .cfg = &cfg, .dir = dir, .fmt = PD_LOAD_DUMMY, .seed = 7};
    tp_group *ga = NULL, *gb = NULL;
    mr *fused = NULL, *ops = NULL;
    int rc = mc_load(dir, &cfg, err);
    if (rc == 0) rc = tp_group_load(&gp, &ga, err);
    if (rc == 0) rc = mr_create_tp(&mp, (const pd_model *const *)ga->models, n_tp, ga->comm,
                                   &fused, err);
    pd_env_set("PDSERVE_CUDA_TP_FUSED", "0"); /* read when a communicator is made */
    if (rc == 0) rc = tp_group_load(&gp, &gb, err);
    pd_env_set("PDSERVE_CUDA_TP_FUSED", NULL);
    if (rc == 0) rc = mr_create_tp(&mp, (const pd_model *const *)gb->models, n_tp, gb->comm,
                                   &ops, err);
    CHECK_MSG(rc == 0, "%s TP %d: %s", name, n_tp, err);
    if (rc == 0) {
        const uint32_t ns = mr_tp_fused_sizes(fused);
        CHECK_MSG((ns >> 1 & 1u) && (ns >> N_SEQS & 1u) && mr_tp_fused_sizes(ops) == 0,
                  "%s TP %d: fused step sizes %#x (want 1 and %d), op by op %#x", name, n_tp,
                  ns, N_SEQS, mr_tp_fused_sizes(ops));
        char label[96], side[32];
        snprintf(label, sizeof label, "%s TP %d fused", name, n_tp);
        snprintf(side, sizeof side, "cuda TP %d fused", n_tp);
        const cg_run run = {name, label, side, 0.1, 0.1, true, 0, 0};
        cg_stats pre = {0}, dec = {0};
        const int32_t T = cg_compare_model(ops, fused, cfg.vocab_size, &run, &pre, &dec);
        CHECK_MSG(mr_graph_steps(fused) == (eager ? 0 : N_DECODE), "%s: %lld of %d decode "
                  "steps replayed graphs", label, (long long)mr_graph_steps(fused), N_DECODE);
        printf("  %-22s TP %d %-6s fused against op by op: prefill %3d rows max |diff| %.3g | "
               "decode %3d rows: max |diff| %.3g, rel L2 %.2e, argmax %d/%d\n", name, n_tp,
               eager ? "eager" : "graphs", pre.rows, pre.max_abs, dec.rows, dec.max_abs,
               dec.worst_rel, dec.argmax_checked - dec.argmax_wrong, dec.argmax_checked);
        CHECK(pre.rows == T && dec.rows == N_DECODE * N_SEQS);
    }
    mr_destroy(fused);
    mr_destroy(ops);
    tp_group_destroy(ga);
    tp_group_destroy(gb);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    /* decode steps of up to 8 sequences fused (run_fused's 3); the golden models' shapes are
     * not fused at all */
    setenv("PDSERVE_CUDA_FUSED_DECODE", "8", 1);
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
    for (int32_t n_tp = 2; n_tp <= 4 && n_tp <= n_dev; n_tp *= 2)
        for (int eager = 0; eager < 2; eager++) {
            run_fused(n_tp, 1024, 3072, 16, 8, eager);  /* GQA 2 */
            run_fused(n_tp, 2048, 4096, 32, 4, eager);  /* GQA 8; TP 4: one KV head a rank */
        }
    return pd_test_result("test_cuda_tp");
}
