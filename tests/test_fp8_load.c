/* test_fp8_load.c -- Loading FP8 checkpoints (engine/model.c with text/model_quant.c) on the
 * CPU backend: tiny Llama checkpoints written here (engine/safetensors_write.h) in the
 * compressed-tensors and block-wise layouts, loaded whole and as tensor-parallel shards, and
 * every malformed variant refused with the error code and a message naming the tensor. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "engine/safetensors_write.h"
#include "kernels/backend.h"
#include "test_util.h"

enum { H = 64, NH = 4, KVH = 2, HD = 16, F = 384, V = 32 };

static char g_dir[64];
static pd_backend *g_be;

/* What a variant changes of the valid channel-wise checkpoint. */
typedef struct {
    const char *qc;          /* quantization_config JSON, or NULL for none */
    bool block;              /* weight_scale_inv per 128 x 128 block (quant_method fp8) */
    const char *drop;        /* a tensor left out */
    const char *bf16;        /* a linear written as BF16 instead of FP8 */
    const char *zero_scale;  /* a module whose scale is 0 */
    bool input_scales;       /* static activations: <module>.input_scale */
    bool kv_scales;          /* self_attn.k_scale / v_scale */
} variant;

static const char *const k_lin[7] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                     "mlp.down_proj"};
static const int64_t k_rows[7] = {NH * HD, KVH * HD, KVH * HD, H, F, F, H};
static const int64_t k_cols[7] = {H, H, H, NH * HD, H, H, F};

typedef struct {
    char name[96];
    pd_dtype dt;
    int32_t nd;
    int64_t shape[2];
    void *data;
    size_t bytes;
} tens;

static tens g_t[64];
static int g_n;

static void add(const char *name, pd_dtype dt, int32_t nd, int64_t r, int64_t c, const variant *v)
{
    if (v->drop && strcmp(v->drop, name) == 0) return;
    tens *t = &g_t[g_n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dt = dt;
    t->nd = nd;
    t->shape[0] = r;
    t->shape[1] = c;
    const size_t n = (size_t)r * (size_t)(nd == 2 ? c : 1);
    t->bytes = n * pd_dtype_size(dt);
    t->data = malloc(t->bytes);
    uint64_t st = 0x9e37u + (uint64_t)g_n * 7919u;
    for (size_t i = 0; i < n; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        const float u = (float)((double)(st >> 11) / 9007199254740992.0 - 0.5);
        if (dt == PD_DTYPE_F32) ((float *)t->data)[i] = strstr(name, "norm") ? 1 + u / 8 : u / 4;
        else if (dt == PD_DTYPE_BF16) ((uint16_t *)t->data)[i] = pd_f32_to_bf16(u / 4);
        else ((uint8_t *)t->data)[i] = pd_f32_to_e4m3(u * 400);
    }
}

static void scale(const char *name, int64_t n, int64_t c, float v, const variant *var)
{
    add(name, PD_DTYPE_F32, c ? 2 : 1, n, c ? c : 1, var);
    if (g_n && strcmp(g_t[g_n - 1].name, name) == 0)
        for (int64_t i = 0; i < n * (c ? c : 1); i++) ((float *)g_t[g_n - 1].data)[i] = v;
}

/* Writes config.json and model.safetensors of variant v into g_dir. */
static void write_ckpt(const variant *v)
{
    char path[256], err[PD_ERR_LEN];
    snprintf(path, sizeof path, "%s/config.json", g_dir);
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": %d, "
               "\"intermediate_size\": %d, \"num_hidden_layers\": 1, \"num_attention_heads\": %d, "
               "\"num_key_value_heads\": %d, \"vocab_size\": %d, \"max_position_embeddings\": 256, "
               "\"rms_norm_eps\": 1e-5, \"rope_theta\": 10000.0, \"tie_word_embeddings\": false%s%s}",
            H, F, NH, KVH, V, v->qc ? ", \"quantization_config\": " : "", v->qc ? v->qc : "");
    fclose(f);
    g_n = 0;
    add("model.embed_tokens.weight", PD_DTYPE_F32, 2, V, H, v);
    add("model.norm.weight", PD_DTYPE_F32, 1, H, 0, v);
    add("lm_head.weight", PD_DTYPE_F32, 2, V, H, v);
    add("model.layers.0.input_layernorm.weight", PD_DTYPE_F32, 1, H, 0, v);
    add("model.layers.0.post_attention_layernorm.weight", PD_DTYPE_F32, 1, H, 0, v);
    for (int i = 0; i < 7; i++) {
        char n[96];
        snprintf(n, sizeof n, "model.layers.0.%s.weight", k_lin[i]);
        const bool bf = v->bf16 && strcmp(v->bf16, k_lin[i]) == 0;
        add(n, bf ? PD_DTYPE_BF16 : PD_DTYPE_F8E4M3, 2, k_rows[i], k_cols[i], v);
        const float s = v->zero_scale && strcmp(v->zero_scale, k_lin[i]) == 0 ? 0.0f : 1.0f / 1024;
        if (v->block) {
            snprintf(n, sizeof n, "model.layers.0.%s.weight_scale_inv", k_lin[i]);
            scale(n, (k_rows[i] + 127) / 128, (k_cols[i] + 127) / 128, s, v);
        } else {
            snprintf(n, sizeof n, "model.layers.0.%s.weight_scale", k_lin[i]);
            scale(n, k_rows[i], 1, s, v);
        }
        if (v->input_scales) {
            snprintf(n, sizeof n, "model.layers.0.%s.input_scale", k_lin[i]);
            scale(n, 1, 0, 0.01f * (float)(i + 1), v);
        }
    }
    if (v->kv_scales) {
        scale("model.layers.0.self_attn.k_scale", 1, 0, 0.5f, v);
        scale("model.layers.0.self_attn.v_scale", 1, 0, 0.25f, v);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", g_dir);
    stw_file *w = NULL;
    int rc = stw_file_create(path, &w, err);
    for (int i = 0; rc == 0 && i < g_n; i++)
        rc = stw_file_add(w, g_t[i].name, g_t[i].dt, g_t[i].nd, g_t[i].shape, err);
    if (rc == 0) rc = stw_file_begin(w, err);
    for (int i = 0; rc == 0 && i < g_n; i++) rc = stw_file_write(w, g_t[i].data, g_t[i].bytes, err);
    if (rc == 0) rc = stw_file_close(w, err);
    else stw_file_destroy(w);
    if (rc != 0) {
        fprintf(stderr, "cannot write the checkpoint: %s\n", err);
        abort();
    }
    for (int i = 0; i < g_n; i++) free(g_t[i].data);
}

/* Loads g_dir as rank of n_ranks; returns the code, err the message; *out the model or NULL. */
static int load(int32_t rank, int32_t n_ranks, pd_model **out, char *err)
{
    mc_config cfg;
    *out = NULL;
    err[0] = 0;
    int rc = mc_load(g_dir, &cfg, err);
    if (rc < 0) return rc;
    return pd_model_load_shard(&cfg, g_dir, PD_LOAD_SAFETENSORS, 0, g_be, rank, n_ranks, out, err);
}

static const char *k_ct =
    "{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
    "\"config_groups\": {\"g\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 8, "
    "\"type\": \"float\", \"strategy\": \"channel\"}, \"input_activations\": {\"num_bits\": 8, "
    "\"type\": \"float\", \"strategy\": \"token\", \"dynamic\": true}}}%s}";

static void expect(const variant *v, int32_t n_ranks, int want, const char *needle)
{
    write_ckpt(v);
    char err[PD_ERR_LEN];
    pd_model *m = NULL;
    int rc = 0;
    for (int32_t r = 0; r < n_ranks && rc == 0; r++) {
        rc = load(r, n_ranks, &m, err);
        pd_model_destroy(m);
    }
    CHECK_MSG(rc == want && (!needle || strstr(err, needle)), "rc %d (want %d), err \"%s\" (want \"%s\")",
              rc, want, err, needle ? needle : "");
}

int main(void)
{
    char err[PD_ERR_LEN];
    snprintf(g_dir, sizeof g_dir, "/tmp/pd_test_fp8_XXXXXX");
    if (!mkdtemp(g_dir) || pd_backend_create("cpu", NULL, &g_be, err) != 0) {
        fprintf(stderr, "setup: %s %s\n", strerror(errno), err);
        return 1;
    }
    char qc[1024];
    snprintf(qc, sizeof qc, k_ct, ", \"ignore\": [\"lm_head\"]");

    /* the valid checkpoint: every linear quantized, the head not; a forward runs */
    variant ok = {.qc = qc};
    write_ckpt(&ok);
    pd_model *m = NULL;
    CHECK_EQ_INT(load(0, 1, &m, err), 0);
    if (m) {
        const pd_layer_weights *w = &m->layers[0];
        CHECK(m->quantized && w->qkv_ops == g_be->ops->fp8 && w->o_ops && w->gate_up_ops &&
              w->down_ops);
        CHECK(w->k_scale == 1.0f && w->v_scale == 1.0f);
        /* weight bytes: the head and embedding in f32, the linears as the CPU holds them */
        CHECK(m->weight_bytes > (int64_t)(2 * V * H * 4));
        mr_params mp = mr_default_params();
        mp.n_blocks = 8;
        mp.max_graph_batch = 0;
        mr *r = NULL;
        CHECK_EQ_INT(mr_create(&mp, m, &r, err), 0);
        if (r) {
            const int32_t ids[3] = {1, 5, 9}, pos[3] = {0, 1, 2}, slots[3] = {0, 1, 2};
            const int32_t cu[2] = {0, 3}, ctx[1] = {3}, bt[16] = {0}, rows[1] = {2};
            mr_batch b = {.n_tokens = 3, .input_ids = ids, .positions = pos, .slot_mapping = slots,
                          .n_seqs = 1, .cu_q = cu, .ctx_lens = ctx, .block_tables = bt,
                          .max_blocks_per_seq = mr_max_blocks_per_seq(r), .n_logits = 1,
                          .logits_rows = rows};
            float logits[V];
            CHECK_EQ_INT(mr_forward(r, &b, logits, err), 0);
            bool finite = true;
            for (int i = 0; i < V; i++) finite &= isfinite(logits[i]);
            CHECK(finite);
            mr_destroy(r);
        }
        pd_model_destroy(m);
    }
    /* as two tensor-parallel shards, and dummy weights with --quantization fp8 */
    expect(&ok, 2, 0, NULL);
    {
        mc_config cfg;
        CHECK_EQ_INT(mc_load(g_dir, &cfg, err), 0);
        CHECK_EQ_INT(pd_model_load(&cfg, g_dir, PD_LOAD_DUMMY, 1, g_be, &m, err), 0);
        CHECK(m && m->quantized);
        pd_model_destroy(m);
    }

    /* FP8 tensors without a quantization_config */
    expect(&(variant){0}, 1, PD_EFORMAT, "has no quantization_config");
    /* a fused group quantized in part */
    snprintf(qc, sizeof qc, k_ct, ", \"ignore\": [\"lm_head\", \"model.layers.0.self_attn.k_proj\"]");
    expect(&(variant){.qc = qc}, 1, PD_EUNSUPPORTED, "are fused");
    snprintf(qc, sizeof qc, k_ct, ", \"ignore\": [\"lm_head\"]");
    /* a missing scale, a zero scale, a BF16 linear where the config says FP8 */
    expect(&(variant){.qc = qc, .drop = "model.layers.0.mlp.down_proj.weight_scale"}, 1, PD_EFORMAT,
           "model.layers.0.mlp.down_proj.weight_scale is missing");
    expect(&(variant){.qc = qc, .zero_scale = "mlp.up_proj"}, 1, PD_EFORMAT, "must be finite and > 0");
    expect(&(variant){.qc = qc, .bf16 = "self_attn.o_proj"}, 1, PD_EFORMAT,
           "self_attn.o_proj.weight in");
    /* an FP8 tensor the ignore list leaves unquantized */
    snprintf(qc, sizeof qc, k_ct, ", \"ignore\": [\"lm_head\", \"model.layers.0.mlp.down_proj\"]");
    expect(&(variant){.qc = qc}, 1, PD_EFORMAT, "leaves it unquantized");
    /* static activations: the input scales, the largest of a fused group */
    static const char *k_static =
        "{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
        "\"config_groups\": {\"g\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 8, "
        "\"type\": \"float\", \"strategy\": \"channel\"}, \"input_activations\": {\"num_bits\": 8, "
        "\"type\": \"float\", \"strategy\": \"tensor\", \"dynamic\": false}}}, "
        "\"kv_cache_scheme\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"tensor\", "
        "\"dynamic\": false}}";
    expect(&(variant){.qc = k_static, .input_scales = true, .kv_scales = true}, 1, 0, NULL);
    CHECK_EQ_INT(load(0, 1, &m, err), 0);
    if (m) {
        CHECK(m->layers[0].k_scale == 0.5f && m->layers[0].v_scale == 0.25f);
        pd_dtype kd;
        CHECK_EQ_INT(mr_kv_dtype_resolve(MR_KV_AUTO, m, &kd), 0); /* the scheme: FP8 KV */
        CHECK_EQ_INT(kd, PD_DTYPE_F8E4M3);
        CHECK_EQ_INT(mr_kv_dtype_resolve(MR_KV_NATIVE, m, &kd), 0);
        CHECK_EQ_INT(kd, PD_DTYPE_F32);
        pd_model_destroy(m);
    }
    expect(&(variant){.qc = k_static, .input_scales = true,
                      .drop = "model.layers.0.mlp.gate_proj.input_scale", .kv_scales = true},
           1, PD_EFORMAT, "gate_proj.input_scale is missing");
    expect(&(variant){.qc = k_static, .input_scales = true}, 1, PD_EFORMAT,
           "self_attn.k_scale is missing");
    /* block-wise: whole, and at a degree whose column shards miss the 128-column blocks */
    static const char *k_block = "{\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
                                 "\"activation_scheme\": \"dynamic\", \"weight_block_size\": [128, 128]}";
    expect(&(variant){.qc = k_block, .block = true}, 1, 0, NULL);
    /* at TP 2, down_proj's rank 1 takes columns 192 .. 383: its first group of 128 (192 ..
     * 319) lies across the blocks 1 and 2 (o_proj's 32-column shards lie inside block 0) */
    expect(&(variant){.qc = k_block, .block = true}, 2, PD_EUNSUPPORTED, "columns 192 .. 319");
    expect(&(variant){.qc = k_block}, 1, PD_EFORMAT, "weight_scale_inv is missing");

    char path[128];
    snprintf(path, sizeof path, "%s/config.json", g_dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", g_dir);
    unlink(path);
    rmdir(g_dir);
    pd_backend_destroy(g_be);
    return pd_test_result("test_fp8_load");
}
