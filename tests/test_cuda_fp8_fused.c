/* test_cuda_fp8_fused.c -- The CUDA backend's fused decode step (decode_layers) on FP8 weights
 * against the same steps op by op: small Llama shapes decode_layers takes, loaded twice with
 * the same dummy weights quantized at load (--quantization fp8: per-channel scales, dynamic
 * per-token activations; and weight-only), once on a backend whose decode_layers is counted and
 * once on one without it. The same prompts go through both, then decode steps of n = 1, 2, 4
 * and 8 sequences (PDSERVE_CUDA_FUSED_DECODE=8), each fed the op-by-op side's argmax; every
 * logits row is compared (max |diff| under 0.1 + 2% of the largest logit, relative L2 under
 * 5e-2, the same argmax where the top-1 leads by more than 0.1), with decode graphs and eager.
 * Both sides quantize the same bf16 rows; they differ by the norms' scale (float against
 * double), f32 accumulation order and the bf16 roundings that follow. Exits 77 (skipped)
 * without a CUDA device. `test_cuda_fp8_fused SHAPE` runs one shape (dynamic activations). */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "kernels/backend.h"
#include "tests/cuda_golden_util.h"
#include "tests/test_util.h"
#include "text/model_config.h"

#define MAX_N 8
#define PROMPT 21 /* tokens a sequence's prompt (decode steps then start past a block) */
#define STEPS 12  /* decode steps a batch size */

/* The fused side's decode_layers, counted: calls that ran (0) and those refused. */
static int (*g_dl)(void *ctx, const pd_decode_args *a);
static long g_fused_ok, g_fused_refused;

static int counted_dl(void *ctx, const pd_decode_args *a)
{
    const int rc = g_dl(ctx, a);
    if (!a->check_only) {
        if (rc == 0) g_fused_ok++;
        else g_fused_refused++;
    }
    return rc;
}

typedef struct {
    pd_backend *be;
    pd_backend_ops ops; /* the backend's, with decode_layers counted or removed */
    pd_model *m;
    mr *r;
} side;

static void side_close(side *s)
{
    mr_destroy(s->r);
    pd_model_destroy(s->m);
    pd_backend_destroy(s->be);
    memset(s, 0, sizeof *s);
}

static int side_open(const mc_config *cfg, const char *dir, bool fused, bool eager, side *s,
                     char *err)
{
    memset(s, 0, sizeof *s);
    int rc = pd_backend_create("cuda", NULL, &s->be, err);
    if (rc < 0) return rc;
    s->ops = *s->be->ops;
    if (fused) {
        g_dl = s->ops.decode_layers;
        s->ops.decode_layers = counted_dl;
    } else {
        s->ops.decode_layers = NULL; /* op by op */
    }
    s->be->ops = &s->ops;
    mr_params mp = cg_params(eager);
    rc = pd_model_load(cfg, dir, PD_LOAD_DUMMY, 7, s->be, &s->m, err);
    if (rc == 0) rc = mr_create(&mp, s->m, &s->r, err);
    return rc;
}

/* n sequences: a prefill of their prompts on both sides, then STEPS decode steps fed the op
 * side's argmax; every logits row compared. */
static void run_batch(side *fu, side *op, const char *label, int32_t n, int32_t V)
{
    char err[PD_ERR_LEN] = "";
    const int32_t width = mr_max_blocks_per_seq(op->r);
    const int32_t per = (PROMPT + STEPS + BLOCK_SIZE - 1) / BLOCK_SIZE;
    PD_ASSERT(n * per <= N_BLOCKS && per <= width, "test needs more blocks");
    int32_t *bt = calloc((size_t)MAX_N * width, sizeof(int32_t)), ctx[MAX_N], cu[MAX_N + 1] = {0};
    int32_t ids[MAX_N * PROMPT], pos[MAX_N * PROMPT], slots[MAX_N * PROMPT], rows[MAX_N];
    for (int32_t s = 0; s < n; s++)
        for (int32_t b = 0; b < per; b++) bt[s * width + b] = N_BLOCKS - 1 - (s * per + b);
    int32_t T = 0;
    for (int32_t s = 0; s < n; s++) {
        for (int32_t i = 0; i < PROMPT; i++, T++) {
            ids[T] = (int32_t)rnd((uint32_t)V);
            pos[T] = i;
            slots[T] = bt[s * width + i / BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE;
        }
        cu[s + 1] = T;
        ctx[s] = PROMPT;
        rows[s] = T - 1;
    }
    float *lf = malloc((size_t)MAX_N * V * sizeof(float));
    float *lo = malloc((size_t)MAX_N * V * sizeof(float));
    mr_batch b = {T, ids, pos, slots, n, cu, ctx, bt, width, n, rows};
    if (mr_forward(op->r, &b, lo, err) < 0 || mr_forward(fu->r, &b, lf, err) < 0) {
        CHECK_MSG(0, "%s n=%d prefill: %s", label, n, err);
        free(bt);
        free(lf);
        free(lo);
        return;
    }
    const long ok0 = g_fused_ok;
    cg_stats st = {0};
    for (int32_t step = 0; step < STEPS; step++) {
        int32_t dcu[MAX_N + 1] = {0};
        for (int32_t s = 0; s < n; s++) {
            const int32_t p = ctx[s];
            ids[s] = argmax(lo + (size_t)s * V, V);
            pos[s] = p;
            slots[s] = bt[s * width + p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE;
            ctx[s] = p + 1;
            dcu[s + 1] = s + 1;
            rows[s] = s;
        }
        mr_batch d = {n, ids, pos, slots, n, dcu, ctx, bt, width, n, rows};
        if (mr_forward(op->r, &d, lo, err) < 0 || mr_forward(fu->r, &d, lf, err) < 0) {
            CHECK_MSG(0, "%s n=%d decode step %d: %s", label, n, step, err);
            break;
        }
        double top = 0;
        for (size_t i = 0; i < (size_t)n * V; i++)
            if (fabs(lo[i]) > top) top = fabs(lo[i]);
        char what[128];
        snprintf(what, sizeof what, "%s n=%d decode step %d", label, n, step);
        const cg_run run = {label, label, "cuda fused", 0.1 + 0.02 * top, 0.1, false, 0, 0};
        cg_compare_rows(&run, what, lf, lo, n, V, &st);
    }
    /* eager: every step fused; with graphs at least the capture's */
    CHECK_MSG(g_fused_ok > ok0 || mr_graph_steps(fu->r) > 0,
              "%s n=%d: no decode step ran fused", label, n);
    printf("  %-34s n=%d: %3d rows, max |logit| %.2f, max |diff| %.3g, worst rel L2 %.2e, "
           "argmax %d/%d\n", label, n, st.rows, st.max_ref, st.max_abs, st.worst_rel,
           st.argmax_checked - st.argmax_wrong, st.argmax_checked);
    free(bt);
    free(lf);
    free(lo);
}

static void run_shape(int32_t hidden, int32_t inter, int32_t heads, int32_t kv_heads,
                      int32_t head_dim, pd_act_quant act, bool eager)
{
    char err[PD_ERR_LEN] = "", dir[] = "/tmp/pdserve-fp8fused-XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK_MSG(0, "mkdtemp failed");
        return;
    }
    char path[sizeof dir + 16];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) {
        CHECK_MSG(0, "cannot write %s", path);
        rmdir(dir);
        return;
    }
    fprintf(f, "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", "
               "\"hidden_size\": %d, \"intermediate_size\": %d, \"num_hidden_layers\": 3, "
               "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d, "
               "\"vocab_size\": 4096, \"max_position_embeddings\": 4096, "
               "\"rms_norm_eps\": 1e-05, \"rope_theta\": 500000.0, \"hidden_act\": \"silu\", "
               "\"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\"}\n",
            hidden, inter, heads, kv_heads, head_dim);
    fclose(f);
    char label[96];
    snprintf(label, sizeof label, "llama-%d-%d-%d/%d-hd%d %s %s", hidden, inter, heads,
             kv_heads, head_dim, act == PD_ACT_NONE ? "w-only" : "dynamic",
             eager ? "eager" : "graphs");
    mc_config cfg;
    side fu = {0}, op = {0};
    int rc = mc_load(dir, &cfg, err);
    if (rc == 0) rc = mc_set_quantization(&cfg, "fp8", err);
    cfg.quant.act = act;
    if (rc == 0) rc = side_open(&cfg, dir, true, eager, &fu, err);
    if (rc == 0) rc = side_open(&cfg, dir, false, eager, &op, err);
    CHECK_MSG(rc == 0, "%s: %s", label, err);
    if (rc == 0) {
        g_fused_refused = 0;
        const int32_t ns[4] = {1, 2, 4, 8};
        for (int i = 0; i < 4; i++) run_batch(&fu, &op, label, ns[i], cfg.vocab_size);
        CHECK_MSG(g_fused_refused == 0, "%s: decode_layers refused %ld steps", label,
                  g_fused_refused);
    }
    side_close(&fu);
    side_close(&op);
    unlink(path);
    rmdir(dir);
}

/* The shapes: 0 and 1 with graphs and eager in either activation mode, 3 (every stage's k a
 * multiple of 2048: several whole FP8 slots a group, as the Llama-3-8B shape's) with graphs
 * and eager, 2 eager. */
static const struct {
    int32_t hidden, inter, heads, kv_heads, head_dim;
} k_shapes[] = {
    {1024, 3072, 16, 8, 64},  /* GQA 2, head 64 */
    {1024, 2048, 8, 2, 128},  /* GQA 4, head 128 */
    {512, 1536, 16, 2, 64},   /* GQA 8 */
    {2048, 4096, 16, 4, 128}, /* GQA 4, head 128, k 2048 / 4096 */
};

static void run_index(int i, pd_act_quant act, bool eager)
{
    run_shape(k_shapes[i].hidden, k_shapes[i].inter, k_shapes[i].heads, k_shapes[i].kv_heads,
              k_shapes[i].head_dim, act, eager);
}

/* test_cuda_fp8_fused [SHAPE]: all the shapes, or one of k_shapes (dynamic activations, graphs
 * and eager). */
int main(int argc, char **argv)
{
    char err[PD_ERR_LEN] = "";
    pd_backend *probe = NULL;
    if (pd_backend_create("cuda", NULL, &probe, err) < 0) {
        fprintf(stderr, "test_cuda_fp8_fused: skipped: %s\n", err);
        return 77;
    }
    pd_backend_destroy(probe);
    setenv("PDSERVE_CUDA_FUSED_DECODE", "8", 1); /* read at the first decode_layers call */
    printf("test_cuda_fp8_fused: FP8 decode steps fused against op by op\n");
    const int n_shapes = (int)(sizeof k_shapes / sizeof k_shapes[0]);
    if (argc > 1) {
        const int i = atoi(argv[1]);
        if (i < 0 || i >= n_shapes) {
            fprintf(stderr, "usage: test_cuda_fp8_fused [SHAPE 0..%d]\n", n_shapes - 1);
            return 2;
        }
        for (int eager = 0; eager < 2; eager++) run_index(i, PD_ACT_DYNAMIC, eager);
        return pd_test_result("test_cuda_fp8_fused");
    }
    for (int eager = 0; eager < 2; eager++) {
        const pd_act_quant acts[2] = {PD_ACT_DYNAMIC, PD_ACT_NONE};
        for (int a = 0; a < 2; a++) {
            run_index(0, acts[a], eager);
            run_index(1, acts[a], eager);
        }
        run_index(3, PD_ACT_DYNAMIC, eager);
    }
    run_index(2, PD_ACT_DYNAMIC, true);
    return pd_test_result("test_cuda_fp8_fused");
}
