/* test_model_config.c -- Tests for text/model_config: parsing the shared tiny checkpoints'
 * config.json files, old- and new-style RoPE settings, every rejected input (code and message),
 * RoPE inverse frequencies against independent re-implementations, the parameter count, and
 * the mixture-of-experts settings (which layers are sparse, the refused features). */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/json_util.h"
#include "test_util.h"
#include "text/model_config.h"

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

static char g_dir[64];          /* mkdtemp directory the synthetic configs are written to */
static char g_cfg_path[128];    /* g_dir/config.json */
static char g_gen_path[128];    /* g_dir/generation_config.json */

/* A valid Llama config; each test copies it and changes or deletes keys. */
static const char *k_base =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\","
    " \"hidden_size\": 128, \"intermediate_size\": 256, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 1000,"
    " \"max_position_embeddings\": 2048, \"rms_norm_eps\": 1e-5, \"rope_theta\": 10000.0,"
    " \"hidden_act\": \"silu\", \"tie_word_embeddings\": false, \"bos_token_id\": 1,"
    " \"eos_token_id\": 2, \"torch_dtype\": \"bfloat16\"}";

static json_t *base_cfg(void)
{
    json_error_t je;
    json_t *o = json_loads(k_base, 0, &je);
    if (!o) {
        fprintf(stderr, "base config does not parse: %s\n", je.text);
        abort();
    }
    return o;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
        abort();
    }
}

/* Writes cfg (takes ownership; NULL = leave no config.json) and gen_text (raw
 * generation_config.json; NULL = none) into g_dir, then runs mc_load on it. */
static int load_cfg(json_t *cfg, const char *gen_text, mc_config *c, char *err)
{
    unlink(g_cfg_path);
    unlink(g_gen_path);
    if (cfg) {
        if (json_dump_file(cfg, g_cfg_path, JSON_INDENT(1)) != 0) {
            fprintf(stderr, "cannot write %s\n", g_cfg_path);
            abort();
        }
        json_decref(cfg);
    }
    if (gen_text) write_text(g_gen_path, gen_text);
    err[0] = '\0';
    return mc_load(g_dir, c, err);
}

/* Loads base_cfg() with one key set to the JSON text val (NULL = key deleted). */
static int load_with(const char *key, const char *val, mc_config *c, char *err)
{
    json_t *o = base_cfg();
    if (val) {
        json_error_t je;
        json_t *v = json_loads(val, JSON_DECODE_ANY, &je);
        if (!v) {
            fprintf(stderr, "bad test value %s: %s\n", val, je.text);
            abort();
        }
        json_object_set_new(o, key, v);
    } else {
        json_object_del(o, key);
    }
    return load_cfg(o, NULL, c, err);
}

static double default_inv_freq(double theta, int i, int dim)
{
    return 1.0 / pow(theta, (double)(2 * i) / dim);
}

/* ------------------------------------------------------------------ real configs */

static void test_real_configs(void)
{
    mc_config c;
    char err[PD_ERR_LEN], dir[1024];
    const char *sh = pd_test_shared_dir();

    snprintf(dir, sizeof dir, "%s/testdata/golden/qwen3-tiny", sh);
    int rc = mc_load(dir, &c, err);
    CHECK_MSG(rc == 0, "%s: %s", dir, err);
    if (rc == 0) {
        CHECK_EQ_INT(c.arch, MC_ARCH_QWEN3);
        CHECK(strcmp(c.arch_name, "Qwen3ForCausalLM") == 0);
        CHECK_EQ_INT(c.hidden_size, 64);
        CHECK_EQ_INT(c.n_heads, 4);
        CHECK_EQ_INT(c.head_dim, 32); /* explicit, not 64 / 4 */
        CHECK_EQ_INT(c.n_kv_heads, 2);
        CHECK_EQ_INT(c.intermediate_size, 160);
        CHECK_EQ_INT(c.n_layers, 2);
        CHECK_EQ_INT(c.vocab_size, 512);
        CHECK_EQ_INT(c.max_position, 4096);
        CHECK(c.tie_word_embeddings);
        CHECK(c.qk_norm);
        CHECK(!c.qkv_bias);
        CHECK(!c.o_bias);
        CHECK_EQ_INT(c.sliding_window, 0);
        CHECK_EQ_INT(c.dtype, PD_DTYPE_BF16);
        CHECK_EQ_INT(c.rope_type, MC_ROPE_DEFAULT);
        CHECK_NEAR(c.rope_theta, 1e6, 0);
        CHECK_NEAR(c.rms_eps, 1e-6, 1e-12);
        CHECK_EQ_INT(c.bos_token_id, 1);
        CHECK_EQ_INT(c.n_eos, 1);
        CHECK_EQ_INT(c.eos_token_ids[0], 2);
    }

    snprintf(dir, sizeof dir, "%s/testdata/golden/llama-tiny", sh);
    rc = mc_load(dir, &c, err);
    CHECK_MSG(rc == 0, "%s: %s", dir, err);
    if (rc == 0) {
        CHECK_EQ_INT(c.arch, MC_ARCH_LLAMA);
        CHECK_EQ_INT(c.hidden_size, 96);
        CHECK_EQ_INT(c.n_heads, 6);
        CHECK_EQ_INT(c.head_dim, 16);
        CHECK_EQ_INT(c.n_kv_heads, 2);
        CHECK_EQ_INT(c.max_position, 131072);
        CHECK(!c.tie_word_embeddings);
        CHECK(!c.qkv_bias);
        CHECK(!c.o_bias);
        CHECK(!c.qk_norm);
        CHECK_EQ_INT(c.rope_type, MC_ROPE_LLAMA3);
        CHECK_NEAR(c.rope_factor, 8.0, 0);
        CHECK_NEAR(c.rope_low_freq_factor, 1.0, 0);
        CHECK_NEAR(c.rope_high_freq_factor, 4.0, 0);
        CHECK_EQ_INT(c.rope_orig_max_position, 8192);
        CHECK_NEAR(c.rope_theta, 500000.0, 0);
        CHECK_NEAR(c.rms_eps, 1e-5, 1e-11);
    }

    snprintf(dir, sizeof dir, "%s/testdata/golden/qwen2-tiny", sh);
    rc = mc_load(dir, &c, err);
    CHECK_MSG(rc == 0, "%s: %s", dir, err);
    if (rc == 0) {
        CHECK_EQ_INT(c.arch, MC_ARCH_QWEN2);
        CHECK_EQ_INT(c.head_dim, 16); /* no head_dim key: hidden_size / heads */
        CHECK_EQ_INT(c.n_kv_heads, 4);
        CHECK(c.tie_word_embeddings);
        CHECK(c.qkv_bias);
        CHECK(!c.o_bias);
        CHECK(!c.qk_norm);
        CHECK_EQ_INT(c.sliding_window, 0);
        CHECK_EQ_INT(c.rope_type, MC_ROPE_DEFAULT);
        CHECK_NEAR(c.rope_theta, 1e6, 0);
    }

    snprintf(dir, sizeof dir, "%s/models/stories260k", sh);
    rc = mc_load(dir, &c, err);
    CHECK_MSG(rc == 0, "%s: %s", dir, err);
    if (rc == 0) {
        CHECK_EQ_INT(c.arch, MC_ARCH_LLAMA);
        CHECK_EQ_INT(c.hidden_size, 64);
        CHECK_EQ_INT(c.head_dim, 8);
        CHECK_EQ_INT(c.n_heads, 8);
        CHECK_EQ_INT(c.n_kv_heads, 4);
        CHECK_EQ_INT(c.n_layers, 5);
        CHECK(c.tie_word_embeddings);
        CHECK_EQ_INT(c.dtype, PD_DTYPE_F32); /* from torch_dtype */
        CHECK_EQ_INT(c.rope_type, MC_ROPE_DEFAULT); /* rope_scaling: null */
        CHECK_NEAR(c.rope_theta, 10000.0, 0);
        /* generation_config.json's list [1, 2] replaces config.json's single 2. */
        CHECK_EQ_INT(c.n_eos, 2);
        CHECK_EQ_INT(c.eos_token_ids[0], 1);
        CHECK_EQ_INT(c.eos_token_ids[1], 2);
        CHECK(mc_is_eos(&c, 1));
        CHECK(mc_is_eos(&c, 2));
        CHECK(!mc_is_eos(&c, 0));
        CHECK(!mc_is_eos(&c, 3));
        CHECK_EQ_INT(c.bos_token_id, 1);
    }
}

/* ------------------------------------------------------------------ synthetic configs */

static void test_base_and_defaults(void)
{
    mc_config c;
    char err[PD_ERR_LEN];
    int rc = load_cfg(base_cfg(), NULL, &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.head_dim, 32);
    CHECK_EQ_INT(c.dtype, PD_DTYPE_BF16);
    CHECK_EQ_INT(c.rope_type, MC_ROPE_DEFAULT);
    CHECK_NEAR(c.rope_attn_factor, 1.0, 0);
    CHECK_EQ_INT(c.rope_orig_max_position, 2048); /* defaults to max_position */
    CHECK_EQ_INT(c.n_eos, 1);
    CHECK_EQ_INT(c.eos_token_ids[0], 2);

    /* Absent optional keys take their defaults. */
    json_t *o = base_cfg();
    json_object_del(o, "num_key_value_heads");
    json_object_del(o, "torch_dtype");
    json_object_del(o, "rope_theta");
    json_object_del(o, "eos_token_id");
    json_object_del(o, "bos_token_id");
    json_object_del(o, "max_position_embeddings");
    rc = load_cfg(o, NULL, &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.n_kv_heads, 4);
    CHECK_EQ_INT(c.dtype, PD_DTYPE_F32);
    CHECK_NEAR(c.rope_theta, 10000.0, 0);
    CHECK_EQ_INT(c.n_eos, 0);
    CHECK_EQ_INT(c.bos_token_id, -1);
    CHECK_EQ_INT(c.max_position, 2048);
    CHECK(!mc_is_eos(&c, 2));

    /* "dtype" (new name) wins over torch_dtype; model_type alone identifies the arch. */
    o = base_cfg();
    json_object_set_new(o, "dtype", json_string("float16"));
    json_object_del(o, "architectures");
    json_object_set_new(o, "model_type", json_string("qwen2"));
    rc = load_cfg(o, NULL, &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.dtype, PD_DTYPE_F16);
    CHECK_EQ_INT(c.arch, MC_ARCH_QWEN2);

    /* Llama attention_bias gives q/k/v and o biases. */
    rc = load_with("attention_bias", "true", &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK(c.qkv_bias);
    CHECK(c.o_bias);

    /* eos ids from generation_config.json (scalar form) replace config.json's. */
    rc = load_cfg(base_cfg(), "{\"eos_token_id\": 7, \"bos_token_id\": 5}", &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.n_eos, 1);
    CHECK_EQ_INT(c.eos_token_ids[0], 7);
    CHECK_EQ_INT(c.bos_token_id, 5);
    /* ... and a generation_config.json without eos_token_id keeps config.json's. */
    rc = load_cfg(base_cfg(), "{\"do_sample\": true}", &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.n_eos, 1);
    CHECK_EQ_INT(c.eos_token_ids[0], 2);
}

static void test_rope_styles(void)
{
    mc_config c;
    char err[PD_ERR_LEN];

    /* Old style: top-level rope_theta + rope_scaling with "rope_type". */
    json_t *o = base_cfg();
    json_object_set_new(o, "rope_theta", json_real(500000.0));
    json_object_set_new(o, "rope_scaling",
                        json_pack("{s:s, s:f, s:f, s:f, s:i}", "rope_type", "llama3", "factor",
                                  8.0, "low_freq_factor", 1.0, "high_freq_factor", 4.0,
                                  "original_max_position_embeddings", 8192));
    int rc = load_cfg(o, NULL, &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.rope_type, MC_ROPE_LLAMA3);
    CHECK_NEAR(c.rope_theta, 500000.0, 0);
    CHECK_NEAR(c.rope_factor, 8.0, 0);
    CHECK_NEAR(c.rope_low_freq_factor, 1.0, 0);
    CHECK_NEAR(c.rope_high_freq_factor, 4.0, 0);
    CHECK_EQ_INT(c.rope_orig_max_position, 8192);

    /* Old style with the legacy "type" key. */
    rc = load_with("rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0}", &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.rope_type, MC_ROPE_LINEAR);
    CHECK_NEAR(c.rope_factor, 2.0, 0);
    CHECK_NEAR(c.rope_theta, 10000.0, 0);

    /* rope_scaling: null is plain RoPE. */
    rc = load_with("rope_scaling", "null", &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.rope_type, MC_ROPE_DEFAULT);
    CHECK_NEAR(c.rope_factor, 1.0, 0);

    /* New style: rope_parameters carries theta and type; it beats top-level rope_theta. */
    rc = load_with("rope_parameters",
                   "{\"rope_theta\": 1000000.0, \"rope_type\": \"linear\", \"factor\": 4}", &c,
                   err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.rope_type, MC_ROPE_LINEAR);
    CHECK_NEAR(c.rope_theta, 1e6, 0);
    CHECK_NEAR(c.rope_factor, 4.0, 0);

    /* Per-layer-type form of rope_parameters. */
    rc = load_with("rope_parameters",
                   "{\"full_attention\": {\"rope_theta\": 20000.0, \"rope_type\": \"default\"}}",
                   &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.rope_type, MC_ROPE_DEFAULT);
    CHECK_NEAR(c.rope_theta, 20000.0, 0);

    /* YaRN: betas default to 32 / 1, attention factor to 0.1 * ln(factor) + 1. */
    rc = load_with("rope_parameters",
                   "{\"rope_theta\": 10000.0, \"rope_type\": \"yarn\", \"factor\": 4.0,"
                   " \"original_max_position_embeddings\": 512}",
                   &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.rope_type, MC_ROPE_YARN);
    CHECK_NEAR(c.rope_factor, 4.0, 0);
    CHECK_NEAR(c.rope_beta_fast, 32.0, 0);
    CHECK_NEAR(c.rope_beta_slow, 1.0, 0);
    CHECK_EQ_INT(c.rope_orig_max_position, 512);
    CHECK_NEAR(c.rope_attn_factor, 0.1 * log(4.0) + 1.0, 1e-12);
    CHECK_NEAR(c.rope_attn_factor, 1.138629436, 1e-9);

    /* YaRN with explicit betas and attention_factor. */
    rc = load_with("rope_scaling",
                   "{\"rope_type\": \"yarn\", \"factor\": 2.0, \"beta_fast\": 16,"
                   " \"beta_slow\": 2, \"attention_factor\": 0.75}",
                   &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.rope_type, MC_ROPE_YARN);
    CHECK_NEAR(c.rope_beta_fast, 16.0, 0);
    CHECK_NEAR(c.rope_beta_slow, 2.0, 0);
    CHECK_NEAR(c.rope_attn_factor, 0.75, 0);
    CHECK_EQ_INT(c.rope_orig_max_position, 2048);
}

/* Loads a config expecting code, and checks err names config.json plus every string in want. */
#define EXPECT_FAIL(call, code, ...)                                                    \
    do {                                                                               \
        mc_config c_;                                                                  \
        char e_[PD_ERR_LEN] = "";                                                      \
        int rc_ = (call);                                                              \
        CHECK_MSG(rc_ == (code), "%s: got %s (%s), want %s", #call, pd_err_name(rc_), e_, \
                  pd_err_name(code));                                                  \
        const char *want_[] = {__VA_ARGS__};                                           \
        for (size_t k_ = 0; k_ < sizeof want_ / sizeof want_[0]; k_++)                 \
            CHECK_STR_CONTAINS(e_, want_[k_]);                                         \
    } while (0)

static void test_bad_inputs(void)
{
    EXPECT_FAIL(load_with("hidden_size", NULL, &c_, e_), PD_EFORMAT, "config.json",
                "hidden_size");
    EXPECT_FAIL(load_with("hidden_size", "\"128\"", &c_, e_), PD_EFORMAT, "config.json",
                "hidden_size");
    EXPECT_FAIL(load_with("hidden_size", "128.5", &c_, e_), PD_EFORMAT, "hidden_size");
    EXPECT_FAIL(load_with("hidden_size", "1e300", &c_, e_), PD_EFORMAT, "hidden_size");
    EXPECT_FAIL(load_with("hidden_size", "4294967424", &c_, e_), PD_EFORMAT, "hidden_size");
    EXPECT_FAIL(load_with("vocab_size", "-5", &c_, e_), PD_EFORMAT, "config.json",
                "vocab_size");
    EXPECT_FAIL(load_with("num_key_value_heads", "3", &c_, e_), PD_EFORMAT, "config.json",
                "num_key_value_heads");
    EXPECT_FAIL(load_with("num_key_value_heads", "0", &c_, e_), PD_EFORMAT,
                "num_key_value_heads");
    EXPECT_FAIL(load_with("head_dim", "33", &c_, e_), PD_EFORMAT, "config.json", "head_dim");
    json_t *o = base_cfg(); /* 128 / 3 with no head_dim */
    json_object_set_new(o, "num_attention_heads", json_integer(3));
    json_object_set_new(o, "num_key_value_heads", json_integer(1));
    EXPECT_FAIL(load_cfg(o, NULL, &c_, e_), PD_EFORMAT, "hidden_size", "num_attention_heads");
    EXPECT_FAIL(load_with("architectures", "[\"GPT2LMHeadModel\"]", &c_, e_), PD_EUNSUPPORTED,
                "config.json", "GPT2LMHeadModel");
    EXPECT_FAIL(load_with("architectures", "\"LlamaForCausalLM\"", &c_, e_), PD_EFORMAT,
                "architectures");
    EXPECT_FAIL(load_with("hidden_act", "\"gelu\"", &c_, e_), PD_EUNSUPPORTED, "config.json",
                "hidden_act", "gelu");
    EXPECT_FAIL(load_with("mlp_bias", "true", &c_, e_), PD_EUNSUPPORTED, "config.json",
                "mlp_bias");
    EXPECT_FAIL(load_with("attention_bias", "1", &c_, e_), PD_EFORMAT, "attention_bias");
    EXPECT_FAIL(load_with("rope_scaling", "{\"rope_type\": \"dynamic\", \"factor\": 2.0}", &c_, e_),
                PD_EUNSUPPORTED, "config.json", "dynamic");
    EXPECT_FAIL(load_with("rope_parameters", "{\"rope_type\": \"longrope\"}", &c_, e_),
                PD_EUNSUPPORTED, "longrope");
    EXPECT_FAIL(load_with("rope_scaling", "{\"type\": \"linear\", \"factor\": 0}", &c_, e_),
                PD_EFORMAT, "factor");
    EXPECT_FAIL(load_with("rope_scaling", "[1, 2]", &c_, e_), PD_EFORMAT, "rope_scaling");
    EXPECT_FAIL(load_with("rope_theta", "-1.0", &c_, e_), PD_EFORMAT, "rope_theta");
    EXPECT_FAIL(load_with("partial_rotary_factor", "0.5", &c_, e_), PD_EUNSUPPORTED,
                "partial_rotary_factor");
    EXPECT_FAIL(load_with("torch_dtype", "\"int8\"", &c_, e_), PD_EUNSUPPORTED, "config.json",
                "int8");
    EXPECT_FAIL(load_with("eos_token_id", "\"</s>\"", &c_, e_), PD_EFORMAT, "config.json",
                "eos_token_id");
    EXPECT_FAIL(load_with("eos_token_id", "[2, \"x\"]", &c_, e_), PD_EFORMAT, "eos_token_id");
    /* An id that does not fit int32 must not wrap around to a small valid id (2^32 + 2). */
    EXPECT_FAIL(load_with("eos_token_id", "4294967298", &c_, e_), PD_EFORMAT, "eos_token_id");
    EXPECT_FAIL(load_with("eos_token_id", "[4294967298]", &c_, e_), PD_EFORMAT, "eos_token_id");
    EXPECT_FAIL(load_with("eos_token_id",
                          "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]", &c_, e_),
                PD_EFORMAT, "eos_token_id");

    /* use_sliding_window=true is unsupported for Qwen2 (per-layer windows). */
    o = base_cfg();
    json_object_set_new(o, "architectures", json_pack("[s]", "Qwen2ForCausalLM"));
    json_object_set_new(o, "use_sliding_window", json_true());
    json_object_set_new(o, "sliding_window", json_integer(1024));
    EXPECT_FAIL(load_cfg(o, NULL, &c_, e_), PD_EUNSUPPORTED, "config.json",
                "use_sliding_window");

    /* Malformed JSON: the message names the file and the line. */
    write_text(g_cfg_path, "{\n  \"hidden_size\": 128,\n  \"vocab_size\": ,\n}\n");
    EXPECT_FAIL(mc_load(g_dir, &c_, e_), PD_EFORMAT, "config.json", "line 3");
    unlink(g_cfg_path);

    /* Missing config.json. */
    EXPECT_FAIL(load_cfg(NULL, NULL, &c_, e_), PD_EIO, "config.json");

    /* Malformed or mistyped generation_config.json. */
    EXPECT_FAIL(load_cfg(base_cfg(), "{\"eos_token_id\": [1, 2", &c_, e_), PD_EFORMAT,
                "generation_config.json", "line");
    EXPECT_FAIL(load_cfg(base_cfg(), "[1, 2]", &c_, e_), PD_EFORMAT, "generation_config.json");
    EXPECT_FAIL(load_cfg(base_cfg(), "{\"eos_token_id\": \"2\"}", &c_, e_), PD_EFORMAT,
                "generation_config.json", "eos_token_id");
    EXPECT_FAIL(load_cfg(base_cfg(), "{\"bos_token_id\": 1.5}", &c_, e_), PD_EFORMAT,
                "generation_config.json", "bos_token_id");
}

static void test_mistral_window(void)
{
    mc_config c;
    char err[PD_ERR_LEN];
    json_t *o = base_cfg();
    json_object_set_new(o, "architectures", json_pack("[s]", "MistralForCausalLM"));
    json_object_set_new(o, "max_position_embeddings", json_integer(32768));
    json_object_set_new(o, "sliding_window", json_integer(4096));
    int rc = load_cfg(o, NULL, &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.arch, MC_ARCH_MISTRAL);
    CHECK_EQ_INT(c.sliding_window, 4096);
    CHECK_EQ_INT(c.max_position, 32768);

    o = base_cfg();
    json_object_set_new(o, "architectures", json_pack("[s]", "MistralForCausalLM"));
    json_object_set_new(o, "max_position_embeddings", json_integer(32768));
    json_object_set_new(o, "sliding_window", json_null());
    rc = load_cfg(o, NULL, &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.sliding_window, 0);

    /* A window covering every position is full attention. */
    o = base_cfg();
    json_object_set_new(o, "architectures", json_pack("[s]", "MistralForCausalLM"));
    json_object_set_new(o, "sliding_window", json_integer(2048));
    rc = load_cfg(o, NULL, &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.sliding_window, 0);

    /* Non-Mistral models ignore sliding_window unless use_sliding_window asks for it. */
    rc = load_with("sliding_window", "4096", &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.sliding_window, 0);
}

/* ------------------------------------------------------------------ fuzz findings */

/* Loads base_cfg() with several keys replaced: keys[i] gets the JSON text vals[i]. */
static int load_with_n(const char *const *keys, const char *const *vals, int n, mc_config *c,
                       char *err)
{
    json_t *o = base_cfg();
    for (int i = 0; i < n; i++) {
        json_error_t je;
        json_t *v = json_loads(vals[i], JSON_DECODE_ANY, &je);
        if (!v) {
            fprintf(stderr, "bad test value %s: %s\n", vals[i], je.text);
            abort();
        }
        json_object_set_new(o, keys[i], v);
    }
    return load_cfg(o, NULL, c, err);
}

/* Configs found by tests/fuzz/fuzz_config_json that used to load and then gave the engine NaN
 * or infinite RoPE frequencies, or sizes whose parameter count overflows int64. */
static void test_fuzz_regressions(void)
{
    /* yarn divides by log(rope_theta): theta 1 gave NaN frequencies */
    EXPECT_FAIL(load_with_n((const char *[]){"rope_theta", "rope_scaling"},
                            (const char *[]){"1.0", "{\"type\": \"yarn\", \"factor\": 4.0}"}, 2,
                            &c_, e_),
                PD_EFORMAT, "config.json", "rope_theta");
    EXPECT_FAIL(load_with("rope_theta", "0.5", &c_, e_), PD_EFORMAT, "rope_theta");
    /* llama3 divides by low_freq_factor */
    EXPECT_FAIL(load_with("rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8.0, "
                          "\"low_freq_factor\": 0, \"high_freq_factor\": 4.0}", &c_, e_),
                PD_EFORMAT, "low_freq_factor");
    /* yarn takes the log of original_max_position_embeddings / beta */
    EXPECT_FAIL(load_with("rope_scaling", "{\"type\": \"yarn\", \"factor\": 4.0, "
                          "\"beta_fast\": 0}", &c_, e_),
                PD_EFORMAT, "beta_fast");
    EXPECT_FAIL(load_with("rope_scaling", "{\"type\": \"yarn\", \"factor\": 4.0, "
                          "\"beta_slow\": -1}", &c_, e_),
                PD_EFORMAT, "beta_slow");
    EXPECT_FAIL(load_with("rope_scaling", "{\"type\": \"yarn\", \"factor\": 4.0, "
                          "\"original_max_position_embeddings\": 0}", &c_, e_),
                PD_EFORMAT, "original_max_position_embeddings");
    /* a factor near 0 made every linear frequency infinite */
    EXPECT_FAIL(load_with("rope_scaling", "{\"type\": \"linear\", \"factor\": 1e-300}", &c_, e_),
                PD_EFORMAT, "factor");
    EXPECT_FAIL(load_with("rope_scaling", "{\"type\": \"linear\", \"factor\": 0.5}", &c_, e_),
                PD_EFORMAT, "factor");

    /* Sizes whose products overflow: n_heads + 2 * n_kv_heads overflowed int in
     * mc_param_count, and the parameter count int64. */
    EXPECT_FAIL(load_with_n((const char *[]){"num_attention_heads", "num_key_value_heads",
                                             "head_dim", "hidden_size"},
                            (const char *[]){"2147483646", "1073741823", "2", "2147483646"}, 4,
                            &c_, e_),
                PD_EFORMAT, "config.json", "hidden_size");
    EXPECT_FAIL(load_with_n((const char *[]){"num_attention_heads", "num_key_value_heads",
                                             "head_dim"},
                            (const char *[]){"1073741824", "1073741824", "2"}, 3, &c_, e_),
                PD_EFORMAT, "num_attention_heads * head_dim");
    EXPECT_FAIL(load_with("vocab_size", "2147483647", &c_, e_), PD_EFORMAT, "vocab_size");
    EXPECT_FAIL(load_with("num_hidden_layers", "2147483647", &c_, e_), PD_EFORMAT,
                "num_hidden_layers");
    EXPECT_FAIL(load_with_n((const char *[]){"hidden_size", "intermediate_size",
                                             "num_hidden_layers"},
                            (const char *[]){"16777216", "16777216", "65536"}, 3, &c_, e_),
                PD_EFORMAT, "parameters");

    /* The largest real shapes still load (Llama-3.1-405B) and count right. */
    mc_config c;
    char err[PD_ERR_LEN];
    int rc = load_with_n((const char *[]){"hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads",
                                          "vocab_size"},
                         (const char *[]){"16384", "53248", "126", "128", "8", "128256"}, 6, &c,
                         err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK(mc_param_count(&c) > 400000000000LL && mc_param_count(&c) < 410000000000LL);

    /* The in-memory entry points read what mc_load reads. */
    mc_config from_file;
    rc = load_cfg(base_cfg(), NULL, &from_file, err);
    CHECK_MSG(rc == 0, "%s", err);
    rc = mc_parse_json(k_base, strlen(k_base), &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.hidden_size, from_file.hidden_size);
    CHECK_EQ_INT(c.n_kv_heads, from_file.n_kv_heads);
    CHECK_EQ_INT(c.dtype, from_file.dtype);
    CHECK_NEAR(c.rms_eps, from_file.rms_eps, 0);
    CHECK_EQ_INT(c.n_eos, 1);
    const char *gen = "{\"eos_token_id\": [7, 8], \"bos_token_id\": 5}";
    rc = mc_parse_generation_json(gen, strlen(gen), &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(c.n_eos, 2);
    CHECK_EQ_INT(c.eos_token_ids[1], 8);
    CHECK_EQ_INT(c.bos_token_id, 5);
    EXPECT_FAIL(mc_parse_json(k_base, strlen(k_base) - 1, &c_, e_), PD_EFORMAT, "config.json",
                "malformed");
    EXPECT_FAIL(mc_parse_generation_json("[1]", 3, &c_, e_), PD_EFORMAT,
                "generation_config.json");
}

/* ------------------------------------------------------------------ RoPE frequencies */

/* Independent transcription of transformers' _compute_llama3_parameters, in double. */
static void ref_llama3(double theta, int dim, double factor, double low_ff, double high_ff,
                       double old_ctx, double *out)
{
    double low_wavelen = old_ctx / low_ff, high_wavelen = old_ctx / high_ff;
    for (int i = 0; i < dim / 2; i++) {
        double inv = 1.0 / pow(theta, (double)(2 * i) / dim);
        double wavelen = 2.0 * M_PI / inv;
        double llama = wavelen > low_wavelen ? inv / factor : inv;
        double smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff);
        double smoothed = (1.0 - smooth) * llama / factor + smooth * llama;
        bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        out[i] = medium ? smoothed : llama;
    }
}

static void test_inv_freq(void)
{
    mc_config c;
    char err[PD_ERR_LEN], dir[1024];
    float f[64];

    /* Default: 1 / theta^(2i/d), for two real configs. */
    const char *defaults[] = {"testdata/golden/qwen3-tiny", "models/stories260k"};
    for (int k = 0; k < 2; k++) {
        snprintf(dir, sizeof dir, "%s/%s", pd_test_shared_dir(), defaults[k]);
        if (mc_load(dir, &c, err) != 0) {
            CHECK_MSG(0, "%s", err);
            continue;
        }
        CHECK_NEAR(mc_rope_inv_freq(&c, f), 1.0, 0);
        for (int i = 0; i < c.head_dim / 2; i++) {
            double want = default_inv_freq(c.rope_theta, i, c.head_dim);
            CHECK_NEAR(f[i] / want, 1.0, 1e-6);
        }
        CHECK_NEAR(f[0], 1.0, 0);
    }

    /* Linear: every frequency divided by the factor. */
    CHECK(load_with("rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0}", &c, err) == 0);
    CHECK_NEAR(mc_rope_inv_freq(&c, f), 1.0, 0);
    for (int i = 0; i < c.head_dim / 2; i++)
        CHECK_NEAR(f[i] / (default_inv_freq(10000.0, i, c.head_dim) / 2.0), 1.0, 1e-6);

    /* Llama 3 on llama-tiny (head_dim 16, theta 5e5, factor 8, low 1, high 4, orig 8192):
     * wavelengths 2*pi*5e5^(i/8) are < 2048 for i <= 3 (kept), in [2048, 8192] for i = 4
     * (smoothed), > 8192 for i >= 5 (divided by 8). */
    snprintf(dir, sizeof dir, "%s/testdata/golden/llama-tiny", pd_test_shared_dir());
    if (mc_load(dir, &c, err) == 0) {
        double ref[8];
        CHECK_EQ_INT(c.head_dim, 16);
        CHECK_NEAR(mc_rope_inv_freq(&c, f), 1.0, 0);
        ref_llama3(500000.0, 16, 8.0, 1.0, 4.0, 8192.0, ref);
        for (int i = 0; i < 8; i++) {
            double d = default_inv_freq(500000.0, i, 16);
            CHECK_NEAR(f[i] / ref[i], 1.0, 1e-6);
            if (i <= 3) CHECK_NEAR(f[i] / d, 1.0, 1e-6);
            if (i >= 5) CHECK_NEAR(f[i] / (d / 8.0), 1.0, 1e-6);
            if (i == 4) CHECK_MSG(f[i] > d / 8.0 * 1.01 && f[i] < d * 0.99, "f[4] = %g, d = %g",
                                  f[i], d);
        }
    } else {
        CHECK_MSG(0, "%s", err);
    }

    /* YaRN, head_dim 64, theta 1e4, orig 4096, factor 4: the correction range is
     * [floor(10.47), ceil(22.51)] = [10, 23], so i < 10 keeps the frequency, i >= 23 divides
     * it by 4, and dims in between ramp linearly. */
    json_t *o = base_cfg();
    json_object_set_new(o, "head_dim", json_integer(64));
    json_object_set_new(o, "rope_scaling",
                        json_pack("{s:s, s:f, s:i}", "rope_type", "yarn", "factor", 4.0,
                                  "original_max_position_embeddings", 4096));
    int rc = load_cfg(o, NULL, &c, err);
    CHECK_MSG(rc == 0, "%s", err);
    if (rc == 0) {
        CHECK_NEAR(mc_rope_inv_freq(&c, f), 0.1 * log(4.0) + 1.0, 1e-6);
        for (int i = 0; i < 32; i++) {
            double d = default_inv_freq(10000.0, i, 64);
            double ramp = i <= 10 ? 0.0 : i >= 23 ? 1.0 : (i - 10) / 13.0;
            double want = d * (1.0 - ramp) + d / 4.0 * ramp;
            CHECK_NEAR(f[i] / want, 1.0, 1e-6);
        }
    }
}

/* ------------------------------------------------------------------ parameter count */

static void test_param_count(void)
{
    /* Qwen3-0.6B, tied embeddings, q/k norm, no biases. Per layer:
     *   q_proj 1024 x (16*128) = 2,097,152   k_proj, v_proj 1024 x (8*128) = 1,048,576 each
     *   o_proj (16*128) x 1024 = 2,097,152   -> attention 6,291,456
     *   gate/up/down 3 x 1024 x 3072 = 9,437,184
     *   input/post-attention RMSNorm 2 x 1024 = 2,048; q_norm + k_norm 2 x 128 = 256
     *   -> 15,730,944 per layer, x 28 = 440,466,432
     * embed_tokens 151,936 x 1,024 = 155,582,464 (shared with lm_head); final norm 1,024.
     * Total 440,466,432 + 155,582,464 + 1,024 = 596,049,920. */
    mc_config c;
    memset(&c, 0, sizeof c);
    c.arch = MC_ARCH_QWEN3;
    c.hidden_size = 1024;
    c.n_layers = 28;
    c.n_heads = 16;
    c.n_kv_heads = 8;
    c.head_dim = 128;
    c.intermediate_size = 3072;
    c.vocab_size = 151936;
    c.tie_word_embeddings = true;
    c.qk_norm = true;
    CHECK_EQ_INT(mc_param_count(&c), 596049920LL);

    /* Untied: lm_head adds another 155,582,464. */
    c.tie_word_embeddings = false;
    CHECK_EQ_INT(mc_param_count(&c), 596049920LL + 155582464LL);

    /* attention_bias: q/k/v biases (2048 + 1024 + 1024) and o_proj bias (1024) per layer. */
    c.tie_word_embeddings = true;
    c.qkv_bias = c.o_bias = true;
    CHECK_EQ_INT(mc_param_count(&c), 596049920LL + 28LL * (4096 + 1024));

    /* Qwen2 style: q/k/v biases only. */
    c.o_bias = false;
    CHECK_EQ_INT(mc_param_count(&c), 596049920LL + 28LL * 4096);
}

/* quantization_config: the published FP8 formats parse into what the loader needs; anything
 * else is refused naming what was found. */
static void test_quantization(void)
{
    mc_config c;
    char err[PD_ERR_LEN];
    /* compressed-tensors FP8_DYNAMIC as llm-compressor writes it */
    const char *ct =
        "{\"config_groups\": {\"group_0\": {\"input_activations\": {\"actorder\": null, "
        "\"block_structure\": null, \"dynamic\": true, \"group_size\": null, \"num_bits\": 8, "
        "\"observer\": null, \"observer_kwargs\": {}, \"strategy\": \"token\", \"symmetric\": true, "
        "\"type\": \"float\"}, \"output_activations\": null, \"targets\": [\"Linear\"], "
        "\"weights\": {\"actorder\": null, \"block_structure\": null, \"dynamic\": false, "
        "\"group_size\": null, \"num_bits\": 8, \"observer\": \"minmax\", \"observer_kwargs\": {}, "
        "\"strategy\": \"channel\", \"symmetric\": true, \"type\": \"float\"}}}, "
        "\"format\": \"float-quantized\", \"global_compression_ratio\": 1.46, "
        "\"ignore\": [\"lm_head\", \"re:.*layers\\\\.1\\\\..*down_proj\"], \"kv_cache_scheme\": null, "
        "\"quant_method\": \"compressed-tensors\", \"quantization_status\": \"compressed\"}";
    CHECK_EQ_INT(load_with("quantization_config", ct, &c, err), 0);
    CHECK_EQ_INT(c.quant.method, MC_QUANT_CT_FP8);
    CHECK_EQ_INT(c.quant.weight_group, 0);
    CHECK(!c.quant.weight_per_tensor && !c.quant.kv_scales);
    CHECK_EQ_INT(c.quant.act, PD_ACT_DYNAMIC);
    CHECK(mc_quant_ignored(&c.quant, "lm_head"));
    CHECK(mc_quant_ignored(&c.quant, "model.layers.1.mlp.down_proj"));
    CHECK(!mc_quant_ignored(&c.quant, "model.layers.11.mlp.down_proj"));
    CHECK(!mc_quant_ignored(&c.quant, "model.layers.1.mlp.up_proj"));
    CHECK(!mc_quant_ignored(&c.quant, "model.layers.0.self_attn.q_proj"));
    /* static per-tensor weights and activations, an FP8 KV cache */
    const char *st =
        "{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
        "\"config_groups\": {\"g\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 8, "
        "\"type\": \"float\", \"strategy\": \"tensor\", \"symmetric\": true, \"dynamic\": false}, "
        "\"input_activations\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"tensor\", "
        "\"symmetric\": true, \"dynamic\": false}}}, \"kv_cache_scheme\": {\"num_bits\": 8, "
        "\"type\": \"float\", \"strategy\": \"tensor\", \"dynamic\": false, \"symmetric\": true}}";
    CHECK_EQ_INT(load_with("quantization_config", st, &c, err), 0);
    CHECK(c.quant.weight_per_tensor && c.quant.kv_scales);
    CHECK_EQ_INT(c.quant.act, PD_ACT_STATIC);
    CHECK(!mc_quant_ignored(&c.quant, "lm_head")); /* nothing ignored: the loader keeps the head */
    /* weight-only */
    const char *wo =
        "{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
        "\"config_groups\": {\"g\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 8, "
        "\"type\": \"float\", \"strategy\": \"channel\"}, \"input_activations\": null}}}";
    CHECK_EQ_INT(load_with("quantization_config", wo, &c, err), 0);
    CHECK_EQ_INT(c.quant.act, PD_ACT_NONE);
    /* block-wise: Qwen3-*-FP8 / DeepSeek-V3, and compressed-tensors FP8_BLOCK */
    const char *bw = "{\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", \"quant_method\": "
                     "\"fp8\", \"weight_block_size\": [128, 128], \"modules_to_not_convert\": "
                     "[\"gate\"]}";
    CHECK_EQ_INT(load_with("quantization_config", bw, &c, err), 0);
    CHECK_EQ_INT(c.quant.method, MC_QUANT_FP8_BLOCK);
    CHECK_EQ_INT(c.quant.weight_group, 128);
    CHECK_EQ_INT(c.quant.act, PD_ACT_DYNAMIC);
    CHECK(mc_quant_ignored(&c.quant, "model.layers.2.mlp.gate")); /* substring */
    CHECK(mc_quant_ignored(&c.quant, "model.layers.2.mlp.gate_proj")); /* (substring, as HF) */
    CHECK(!mc_quant_ignored(&c.quant, "model.layers.2.mlp.down_proj"));
    const char *cb =
        "{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
        "\"config_groups\": {\"g\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 8, "
        "\"type\": \"float\", \"strategy\": \"block\", \"block_structure\": [128, 128]}, "
        "\"input_activations\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"group\", "
        "\"group_size\": 128, \"dynamic\": true}}}}";
    CHECK_EQ_INT(load_with("quantization_config", cb, &c, err), 0);
    CHECK_EQ_INT(c.quant.weight_group, 128);
    /* refusals name what they found */
    static const struct {
        const char *qc, *needle;
    } bad[] = {
        {"{\"quant_method\": \"gptq\", \"bits\": 4}", "quant_method gptq"},
        {"{\"quant_method\": \"awq\"}", "quant_method awq"},
        {"{\"quant_method\": \"fbgemm_fp8\", \"activation_scale_ub\": 1200}", "fbgemm_fp8"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"pack-quantized\"}", "pack-quantized"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
         "\"config_groups\": {\"g\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 4, "
         "\"type\": \"int\", \"strategy\": \"group\"}}}}", "4 bits of type int"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
         "\"config_groups\": {\"g\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 8, "
         "\"type\": \"float\", \"strategy\": \"channel\"}, \"input_activations\": {\"num_bits\": 8, "
         "\"type\": \"float\", \"strategy\": \"tensor\", \"dynamic\": true}}}}", "dynamic tensor"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
         "\"config_groups\": {\"a\": {\"targets\": [\"Linear\"]}, \"b\": {\"targets\": "
         "[\"Linear\"]}}}", "2 config_groups"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
         "\"config_groups\": {\"g\": {\"targets\": [\"re:.*mlp.*\"], \"weights\": {\"num_bits\": 8, "
         "\"type\": \"float\", \"strategy\": \"channel\"}}}}", "targets other than"},
        {"{\"quant_method\": \"fp8\", \"activation_scheme\": \"static\", \"weight_block_size\": "
         "[128, 128]}", "activation_scheme static"},
        {"{\"quant_method\": \"fp8\", \"activation_scheme\": \"dynamic\"}", "weight_block_size"},
        {"{\"quant_method\": \"fp8\", \"fmt\": \"e5m2\", \"activation_scheme\": \"dynamic\", "
         "\"weight_block_size\": [128, 128]}", "fmt e5m2"},
        {"{\"quant_method\": \"fp8\", \"activation_scheme\": \"dynamic\", \"weight_block_size\": "
         "[64, 64]}", "weight_block_size"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = load_with("quantization_config", bad[i].qc, &c, err);
        CHECK_MSG(rc == PD_EUNSUPPORTED && strstr(err, bad[i].needle),
                  "case %zu: rc %d, err \"%s\", want \"%s\"", i, rc, err, bad[i].needle);
    }
    CHECK_EQ_INT(load_with("quantization_config", "[1]", &c, err), PD_EFORMAT);
    CHECK_EQ_INT(load_with("quantization_config",
                           "{\"quant_method\": \"fp8\", \"activation_scheme\": \"dynamic\", "
                           "\"weight_block_size\": [128, 128], \"modules_to_not_convert\": 3}",
                           &c, err), PD_EFORMAT);
    CHECK_EQ_INT(load_with("quantization_config",
                           "{\"quant_method\": \"compressed-tensors\", \"format\": "
                           "\"float-quantized\", \"ignore\": [\"re:(\"], \"config_groups\": "
                           "{\"g\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 8, "
                           "\"type\": \"float\", \"strategy\": \"channel\"}}}}", &c, err),
                 PD_EFORMAT);
    CHECK(strstr(err, "regular expression") != NULL);
    /* --quantization */
    CHECK_EQ_INT(load_with("quantization_config", NULL, &c, err), 0);
    CHECK_EQ_INT(c.quant.method, MC_QUANT_NONE);
    CHECK(mc_quant_ignored(&c.quant, "model.layers.0.mlp.down_proj"));
    CHECK_EQ_INT(mc_set_quantization(&c, "auto", err), 0);
    CHECK_EQ_INT(c.quant.method, MC_QUANT_NONE);
    CHECK_EQ_INT(mc_set_quantization(&c, "none", err), 0);
    CHECK_EQ_INT(mc_set_quantization(&c, "int4", err), PD_EINVAL);
    CHECK(strstr(err, "int4") != NULL);
    CHECK_EQ_INT(mc_set_quantization(&c, "fp8", err), 0);
    CHECK_EQ_INT(c.quant.method, MC_QUANT_FP8_AT_LOAD);
    CHECK_EQ_INT(c.quant.act, PD_ACT_DYNAMIC);
    CHECK(mc_quant_ignored(&c.quant, "lm_head"));
    CHECK(!mc_quant_ignored(&c.quant, "model.layers.0.mlp.down_proj"));
    CHECK_EQ_INT(load_with("quantization_config", bw, &c, err), 0);
    CHECK_EQ_INT(mc_set_quantization(&c, "fp8", err), 0); /* already FP8: kept */
    CHECK_EQ_INT(c.quant.method, MC_QUANT_FP8_BLOCK);
    CHECK_EQ_INT(mc_set_quantization(&c, "none", err), PD_EINVAL);
}

/* The MoE goldens' configs (tests/data/golden-moe), both spellings of the expert count and of
 * RoPE, which layers are sparse, the parameter count (the checkpoints' element counts), and
 * every refusal naming its key. */
static void test_moe_configs(void)
{
    mc_config c;
    char err[PD_ERR_LEN], dir[1200];
    static const struct {
        const char *name;
        mc_arch arch;
        int32_t layers, experts, k, inter, step;
        bool renorm, tied;
        double theta;
        const char *sparse; /* per layer: 's' sparse, 'd' dense */
        int64_t params;     /* elements in model.safetensors */
    } k_want[] = {
        {"qwen3-moe-tiny", MC_ARCH_QWEN3_MOE, 3, 8, 4, 48, 1, true, false, 1e4, "sds", 319104},
        {"qwen3-moe-tiny-step2", MC_ARCH_QWEN3_MOE, 4, 8, 4, 48, 2, false, true, 1e4, "dsds",
         341824},
        {"mixtral-tiny", MC_ARCH_MIXTRAL, 2, 4, 2, 96, 1, true, false, 1e6, "ss", 238400},
    };
    for (size_t i = 0; i < sizeof k_want / sizeof k_want[0]; i++) {
        snprintf(dir, sizeof dir, "%s/tests/data/golden-moe/%s", PD_SOURCE_DIR, k_want[i].name);
        int rc = mc_load(dir, &c, err);
        CHECK_MSG(rc == 0, "%s: %s", dir, err);
        if (rc < 0) continue;
        CHECK_EQ_INT(c.arch, k_want[i].arch);
        CHECK_EQ_INT(c.n_layers, k_want[i].layers);
        CHECK_EQ_INT(c.n_experts, k_want[i].experts);
        CHECK_EQ_INT(c.n_experts_per_tok, k_want[i].k);
        CHECK_EQ_INT(c.moe_intermediate, k_want[i].inter);
        CHECK_EQ_INT(c.decoder_sparse_step, k_want[i].step);
        CHECK(c.norm_topk_prob == k_want[i].renorm);
        CHECK(c.tie_word_embeddings == k_want[i].tied);
        CHECK(c.qk_norm == (k_want[i].arch == MC_ARCH_QWEN3_MOE));
        CHECK_NEAR(c.rope_theta, k_want[i].theta, 0);
        for (int32_t l = 0; l < c.n_layers; l++)
            CHECK_MSG(mc_layer_sparse(&c, l) == (k_want[i].sparse[l] == 's'), "%s layer %d",
                      k_want[i].name, l);
        CHECK_EQ_INT(mc_param_count(&c), k_want[i].params);
    }
    /* the goldens' active parameters: the experts of every sparse layer counted k times */
    for (size_t i = 0; i < sizeof k_want / sizeof k_want[0]; i++) {
        snprintf(dir, sizeof dir, "%s/tests/data/golden-moe/%s", PD_SOURCE_DIR, k_want[i].name);
        if (mc_load(dir, &c, err) < 0) continue;
        int64_t n_sparse = 0;
        for (int32_t l = 0; l < c.n_layers; l++) n_sparse += mc_layer_sparse(&c, l);
        const int64_t idle = n_sparse * (c.n_experts - c.n_experts_per_tok) * 3 *
                             (int64_t)c.hidden_size * c.moe_intermediate;
        CHECK_EQ_INT(mc_active_param_count(&c), k_want[i].params - idle);
    }
    /* the benchmark shapes (tools/shapes) against their model cards' totals (to 1%) and active
     * parameters (to 2%: the cards give two digits, 3.3B for Qwen3-30B-A3B's 3.35B) */
    static const struct {
        const char *name;
        double total, active;
    } k_cards[] = {{"qwen3-30b-a3b", 30.5e9, 3.3e9}, {"mixtral-8x7b", 46.7e9, 12.9e9},
                   {"llama3-8b", 8.03e9, 8.03e9}};
    for (size_t i = 0; i < sizeof k_cards / sizeof k_cards[0]; i++) {
        snprintf(dir, sizeof dir, "%s/tools/shapes/%s", PD_SOURCE_DIR, k_cards[i].name);
        const int rc = mc_load(dir, &c, err);
        CHECK_MSG(rc == 0, "%s: %s", dir, err);
        if (rc < 0) continue;
        const double tot = (double)mc_param_count(&c), act = (double)mc_active_param_count(&c);
        CHECK_MSG(fabs(tot / k_cards[i].total - 1.0) < 0.01 &&
                      fabs(act / k_cards[i].active - 1.0) < 0.02,
                  "%s: %.4g parameters, %.4g active (the card: %.3g, %.3g)", k_cards[i].name,
                  tot, act, k_cards[i].total, k_cards[i].active);
    }
    /* transformers' rule: not in mlp_only_layers, and (i + 1) % step == 0 */
    memset(&c, 0, sizeof c);
    c.n_experts = 4;
    c.decoder_sparse_step = 3;
    c.n_mlp_only = 1;
    c.mlp_only[0] = 5;
    const char *want = "ddsddddds"; /* layer 5 would be sparse but is listed */
    for (int32_t l = 0; l < 9; l++) CHECK(mc_layer_sparse(&c, l) == (want[l] == 's'));
    c.n_experts = 0;
    CHECK(!mc_layer_sparse(&c, 2));

    /* refusals, each on the Qwen3-MoE golden's config with one key changed */
    static const struct {
        const char *key, *val;
        int code;
        const char *msg;
    } k_bad[] = {
        {"num_experts", NULL, PD_EFORMAT, "num_experts"},
        {"num_local_experts", "6", PD_EFORMAT, "differ"},
        {"num_experts", "-2", PD_EFORMAT, "num_experts"},
        {"num_experts", "5000", PD_EFORMAT, "num_experts"},
        {"num_experts_per_tok", "9", PD_EFORMAT, "num_experts_per_tok"},
        {"num_experts_per_tok", NULL, PD_EFORMAT, "num_experts_per_tok"},
        {"moe_intermediate_size", NULL, PD_EFORMAT, "moe_intermediate_size"},
        {"decoder_sparse_step", "0", PD_EFORMAT, "decoder_sparse_step"},
        {"mlp_only_layers", "[1, \"2\"]", PD_EFORMAT, "mlp_only_layers"},
        {"mlp_only_layers", "3", PD_EFORMAT, "mlp_only_layers"},
        {"norm_topk_prob", "1", PD_EFORMAT, "norm_topk_prob"},
        {"shared_expert_intermediate_size", "64", PD_EUNSUPPORTED,
         "shared_expert_intermediate_size"},
        {"n_shared_experts", "1", PD_EUNSUPPORTED, "n_shared_experts"},
        {"n_group", "4", PD_EUNSUPPORTED, "n_group"},
        {"routed_scaling_factor", "2.5", PD_EUNSUPPORTED, "routed_scaling_factor"},
        {"scoring_func", "\"sigmoid\"", PD_EUNSUPPORTED, "scoring_func"},
        {"architectures", "[\"Qwen2MoeForCausalLM\"]", PD_EUNSUPPORTED, "Qwen2MoeForCausalLM"},
    };
    char path[1300];
    snprintf(path, sizeof path, "%s/tests/data/golden-moe/qwen3-moe-tiny/config.json",
             PD_SOURCE_DIR);
    for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i++) {
        json_t *o = NULL;
        if (pd_json_load_file(path, &o, err) < 0) {
            CHECK_MSG(0, "%s", err);
            return;
        }
        if (k_bad[i].val) json_object_set_new(o, k_bad[i].key, json_loads(k_bad[i].val,
                                                                           JSON_DECODE_ANY, NULL));
        else json_object_del(o, k_bad[i].key);
        EXPECT_FAIL(load_cfg(o, NULL, &c_, e_), k_bad[i].code, "config.json", k_bad[i].msg);
    }
    /* neutral values of the refused keys, and a training-only one, are accepted */
    json_t *o = NULL;
    if (pd_json_load_file(path, &o, err) < 0) return;
    json_object_set_new(o, "n_shared_experts", json_integer(0));
    json_object_set_new(o, "routed_scaling_factor", json_real(1.0));
    json_object_set_new(o, "scoring_func", json_string("softmax"));
    json_object_set_new(o, "router_jitter_noise", json_real(0.1));
    int rc = load_cfg(o, NULL, &c, err);
    CHECK_MSG(rc == 0, "%s", err);
}

int main(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/pd_test_mc_XXXXXX");
    if (!mkdtemp(g_dir)) {
        fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    snprintf(g_cfg_path, sizeof g_cfg_path, "%s/config.json", g_dir);
    snprintf(g_gen_path, sizeof g_gen_path, "%s/generation_config.json", g_dir);

    test_real_configs();
    test_base_and_defaults();
    test_rope_styles();
    test_bad_inputs();
    test_mistral_window();
    test_fuzz_regressions();
    test_inv_freq();
    test_param_count();
    test_quantization();
    test_moe_configs();

    unlink(g_cfg_path);
    unlink(g_gen_path);
    if (rmdir(g_dir) != 0) CHECK_MSG(0, "rmdir %s: %s", g_dir, strerror(errno));
    return pd_test_result("test_model_config");
}
