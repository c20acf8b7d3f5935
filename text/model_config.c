/* model_config.c -- Parses HuggingFace config.json / generation_config.json into mc_config and
 * computes RoPE inverse frequencies (same formulas as transformers' rope init functions). */
#include "text/model_config.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/error.h"
#include "common/json_util.h"

static const struct {
    const char *name;
    mc_arch arch;
    const char *model_type;
} k_archs[] = {
    {"LlamaForCausalLM", MC_ARCH_LLAMA, "llama"},
    {"MistralForCausalLM", MC_ARCH_MISTRAL, "mistral"},
    {"Qwen2ForCausalLM", MC_ARCH_QWEN2, "qwen2"},
    {"Qwen3ForCausalLM", MC_ARCH_QWEN3, "qwen3"},
    {"Qwen3MoeForCausalLM", MC_ARCH_QWEN3_MOE, "qwen3_moe"},
    {"MixtralForCausalLM", MC_ARCH_MIXTRAL, "mixtral"},
};
#define N_ARCHS ((int)(sizeof k_archs / sizeof k_archs[0]))

/* Size limits of check_sizes (powers of two far above the largest released models). */
#define MC_MAX_WIDTH (1 << 24)   /* hidden, MLP and attention widths, vocabulary */
#define MC_MAX_LAYERS (1 << 16)
#define MC_MAX_PARAMS 0x1p48

static int parse_arch(const json_t *root, mc_config *c, const char *path, char *err)
{
    json_t *archs = json_object_get(root, "architectures");
    if (archs && !json_is_array(archs))
        return pd_errf(err, PD_EFORMAT, "%s: \"architectures\" must be a list of strings", path);
    if (archs && json_array_size(archs) > 0) {
        json_t *a = json_array_get(archs, 0);
        if (!json_is_string(a))
            return pd_errf(err, PD_EFORMAT, "%s: \"architectures\" must be a list of strings",
                           path);
        for (int i = 0; i < N_ARCHS; i++) {
            if (strcmp(json_string_value(a), k_archs[i].name) == 0) {
                c->arch = k_archs[i].arch;
                snprintf(c->arch_name, sizeof c->arch_name, "%s", k_archs[i].name);
                return 0;
            }
        }
        return pd_errf(err, PD_EUNSUPPORTED,
                       "%s: architecture \"%s\" is not supported (supported: LlamaForCausalLM, "
                       "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                       "Qwen3MoeForCausalLM, MixtralForCausalLM)",
                       path, json_string_value(a));
    }
    /* No architectures list: fall back on model_type. */
    json_t *mt = json_object_get(root, "model_type");
    if (json_is_string(mt)) {
        for (int i = 0; i < N_ARCHS; i++) {
            if (strcmp(json_string_value(mt), k_archs[i].model_type) == 0) {
                c->arch = k_archs[i].arch;
                snprintf(c->arch_name, sizeof c->arch_name, "%s", k_archs[i].name);
                return 0;
            }
        }
        return pd_errf(err, PD_EUNSUPPORTED, "%s: model_type \"%s\" is not supported", path,
                       json_string_value(mt));
    }
    return pd_errf(err, PD_EFORMAT, "%s: neither \"architectures\" nor \"model_type\" is given",
                   path);
}

/* Reads a required positive int32 field. */
static int req_pos(const json_t *root, const char *key, int32_t *out, const char *path, char *err)
{
    int rc = pd_json_get_i32(root, key, out, path, err);
    if (rc < 0) return rc;
    if (rc == 1) return pd_errf(err, PD_EFORMAT, "%s: required key \"%s\" is missing", path, key);
    if (*out <= 0) return pd_errf(err, PD_EFORMAT, "%s: \"%s\" must be > 0 (got %d)", path, key, *out);
    return 0;
}

static int parse_dtype(const json_t *root, mc_config *c, const char *path, char *err)
{
    c->dtype = PD_DTYPE_F32;
    json_t *d = json_object_get(root, "dtype");
    if (!d || json_is_null(d)) d = json_object_get(root, "torch_dtype");
    if (!d || json_is_null(d)) return 0;
    if (!json_is_string(d)) return pd_errf(err, PD_EFORMAT, "%s: \"dtype\" must be a string", path);
    const char *s = json_string_value(d);
    if (strcmp(s, "bfloat16") == 0) c->dtype = PD_DTYPE_BF16;
    else if (strcmp(s, "float16") == 0) c->dtype = PD_DTYPE_F16;
    else if (strcmp(s, "float32") == 0) c->dtype = PD_DTYPE_F32;
    else return pd_errf(err, PD_EUNSUPPORTED, "%s: dtype \"%s\" is not supported (bfloat16, "
                        "float16, float32)", path, s);
    return 0;
}

/* Reads the rope settings object (rope_parameters, or old-style rope_scaling). */
static int parse_rope_obj(const json_t *o, mc_config *c, const char *path, char *err)
{
    int rc;
    double theta = c->rope_theta;
    if ((rc = pd_json_get_double(o, "rope_theta", &theta, path, err)) < 0) return rc;
    c->rope_theta = theta;
    json_t *t = json_object_get(o, "rope_type");
    if (!t || json_is_null(t)) t = json_object_get(o, "type");
    const char *type = "default";
    if (t && !json_is_null(t)) {
        if (!json_is_string(t))
            return pd_errf(err, PD_EFORMAT, "%s: \"rope_type\" must be a string", path);
        type = json_string_value(t);
    }
    if ((rc = pd_json_get_double(o, "factor", &c->rope_factor, path, err)) < 0) return rc;
    if (strcmp(type, "default") == 0) {
        c->rope_type = MC_ROPE_DEFAULT;
    } else if (strcmp(type, "linear") == 0) {
        c->rope_type = MC_ROPE_LINEAR;
    } else if (strcmp(type, "llama3") == 0) {
        c->rope_type = MC_ROPE_LLAMA3;
        if ((rc = pd_json_get_double(o, "low_freq_factor", &c->rope_low_freq_factor, path, err)) < 0 ||
            (rc = pd_json_get_double(o, "high_freq_factor", &c->rope_high_freq_factor, path, err)) < 0)
            return rc;
        if (!(c->rope_low_freq_factor > 0) ||
            c->rope_high_freq_factor <= c->rope_low_freq_factor)
            return pd_errf(err, PD_EFORMAT, "%s: llama3 rope needs high_freq_factor > "
                           "low_freq_factor > 0", path);
    } else if (strcmp(type, "yarn") == 0) {
        c->rope_type = MC_ROPE_YARN;
        double af = -1;
        if ((rc = pd_json_get_double(o, "beta_fast", &c->rope_beta_fast, path, err)) < 0 ||
            (rc = pd_json_get_double(o, "beta_slow", &c->rope_beta_slow, path, err)) < 0 ||
            (rc = pd_json_get_double(o, "attention_factor", &af, path, err)) < 0)
            return rc;
        /* the correction range takes log(max_pos / (beta * 2 pi)): betas must be positive */
        if (!(c->rope_beta_fast > 0) || !(c->rope_beta_slow > 0))
            return pd_errf(err, PD_EFORMAT, "%s: yarn rope needs beta_fast and beta_slow > 0",
                           path);
        if (af > 0) c->rope_attn_factor = af;
        else c->rope_attn_factor = c->rope_factor > 1 ? 0.1 * log(c->rope_factor) + 1.0 : 1.0;
    } else {
        return pd_errf(err, PD_EUNSUPPORTED, "%s: rope type \"%s\" is not supported (default, "
                       "linear, llama3, yarn)", path, type);
    }
    int32_t omp = c->rope_orig_max_position;
    if ((rc = pd_json_get_i32(o, "original_max_position_embeddings", &omp, path, err)) < 0) return rc;
    c->rope_orig_max_position = omp;
    if (c->rope_orig_max_position <= 0)
        return pd_errf(err, PD_EFORMAT, "%s: rope original_max_position_embeddings must be > 0",
                       path);
    /* A factor below 1 would shrink the context and, near 0, turn frequencies infinite
     * (transformers warns about it too). */
    if (c->rope_type != MC_ROPE_DEFAULT && !(c->rope_factor >= 1))
        return pd_errf(err, PD_EFORMAT, "%s: rope \"factor\" must be >= 1 (got %g)", path,
                       c->rope_factor);
    return 0;
}

static int parse_rope(const json_t *root, mc_config *c, const char *path, char *err)
{
    int rc;
    c->rope_theta = 10000.0;
    c->rope_type = MC_ROPE_DEFAULT;
    c->rope_factor = 1.0;
    c->rope_low_freq_factor = 1.0;
    c->rope_high_freq_factor = 4.0;
    c->rope_orig_max_position = c->max_position;
    c->rope_beta_fast = 32.0;
    c->rope_beta_slow = 1.0;
    c->rope_attn_factor = 1.0;
    if ((rc = pd_json_get_double(root, "rope_theta", &c->rope_theta, path, err)) < 0) return rc;
    json_t *rp = json_object_get(root, "rope_parameters");
    if (rp && !json_is_null(rp)) {
        if (!json_is_object(rp))
            return pd_errf(err, PD_EFORMAT, "%s: \"rope_parameters\" must be an object", path);
        /* Per-layer-type form: {"full_attention": {...}}. */
        json_t *full = json_object_get(rp, "full_attention");
        if (json_is_object(full)) rp = full;
        if ((rc = parse_rope_obj(rp, c, path, err)) < 0) return rc;
    } else {
        json_t *rs = json_object_get(root, "rope_scaling");
        if (rs && !json_is_null(rs)) {
            if (!json_is_object(rs))
                return pd_errf(err, PD_EFORMAT, "%s: \"rope_scaling\" must be an object or null",
                               path);
            if ((rc = parse_rope_obj(rs, c, path, err)) < 0) return rc;
        }
    }
    /* frequencies are theta^(-2i/d): theta <= 1 gives none that fall, and yarn divides by
     * log(theta) */
    if (!(c->rope_theta > 1))
        return pd_errf(err, PD_EFORMAT, "%s: \"rope_theta\" must be > 1 (got %g)", path,
                       c->rope_theta);
    double partial = 1.0;
    if ((rc = pd_json_get_double(root, "partial_rotary_factor", &partial, path, err)) < 0) return rc;
    if (partial != 1.0)
        return pd_errf(err, PD_EUNSUPPORTED, "%s: partial_rotary_factor %g is not supported", path,
                       partial);
    return 0;
}

/* Reads an id or a list of ids into ids[]; returns the count (0 when absent) or an error. */
static int parse_ids(const json_t *root, const char *key, int32_t *ids, int max, const char *path,
                     char *err)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return 0;
    if (json_is_integer(v)) {
        if (json_integer_value(v) < INT32_MIN || json_integer_value(v) > INT32_MAX)
            return pd_errf(err, PD_EFORMAT, "%s: \"%s\" is out of range", path, key);
        ids[0] = (int32_t)json_integer_value(v);
        return 1;
    }
    if (!json_is_array(v))
        return pd_errf(err, PD_EFORMAT, "%s: \"%s\" must be an integer or a list", path, key);
    int n = 0;
    size_t i;
    json_t *e;
    json_array_foreach(v, i, e) {
        if (!json_is_integer(e) || json_integer_value(e) < INT32_MIN ||
            json_integer_value(e) > INT32_MAX)
            return pd_errf(err, PD_EFORMAT, "%s: \"%s\" must hold int32 integers", path, key);
        if (n == max)
            return pd_errf(err, PD_EFORMAT, "%s: \"%s\" lists more than %d ids", path, key, max);
        ids[n++] = (int32_t)json_integer_value(e);
    }
    return n;
}

/* Rejects shapes far beyond any real model, so that the engine's size arithmetic (int32
 * widths, int64 element and parameter counts) cannot overflow: every width at most
 * MC_MAX_WIDTH, at most MC_MAX_LAYERS layers, at most MC_MAX_PARAMS parameters. */
static int check_sizes(const mc_config *c, const char *path, char *err)
{
    const struct {
        const char *what;
        int64_t v;
    } widths[] = {
        {"hidden_size", c->hidden_size},
        {"intermediate_size", c->intermediate_size},
        {"vocab_size", c->vocab_size},
        {"num_attention_heads * head_dim", (int64_t)c->n_heads * c->head_dim},
        {"moe_intermediate_size", c->moe_intermediate},
    };
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++)
        if (widths[i].v > MC_MAX_WIDTH)
            return pd_errf(err, PD_EFORMAT, "%s: %s = %lld is larger than %d", path,
                           widths[i].what, (long long)widths[i].v, MC_MAX_WIDTH);
    if (c->n_layers > MC_MAX_LAYERS)
        return pd_errf(err, PD_EFORMAT, "%s: num_hidden_layers = %d is larger than %d", path,
                       c->n_layers, MC_MAX_LAYERS);
    /* an upper bound of mc_param_count, in double so that it cannot overflow */
    double h = c->hidden_size, hd = c->head_dim;
    double mlp = 3.0 * h * c->intermediate_size;
    double moe = (double)c->n_experts * (3.0 * h * c->moe_intermediate + h);
    double per_layer = h * ((double)c->n_heads + 2.0 * c->n_kv_heads) * hd +
                       (double)c->n_heads * hd * h + (mlp > moe ? mlp : moe) + 4.0 * h +
                       2.0 * hd;
    double params = c->n_layers * per_layer + 2.0 * c->vocab_size * h + h;
    if (params > MC_MAX_PARAMS)
        return pd_errf(err, PD_EFORMAT, "%s: the sizes give %.3g parameters, more than %.3g",
                       path, params, MC_MAX_PARAMS);
    return 0;
}

/* Mixture-of-experts fields that ask for more than plain top-k softmax routing over routed
 * experts (shared experts as Qwen2-MoE's, DeepSeek's grouped routing and scaling): refused
 * when present with anything but their neutral value. */
static int refuse_moe_extras(const json_t *root, const char *path, char *err)
{
    static const char *const k_counts[] = {"shared_expert_intermediate_size", "n_shared_experts",
                                           "num_shared_experts", "n_group", "topk_group"};
    for (size_t i = 0; i < sizeof k_counts / sizeof k_counts[0]; i++) {
        const json_t *v = json_object_get(root, k_counts[i]);
        if (!v || json_is_null(v)) continue;
        const bool neutral = json_is_integer(v) && json_integer_value(v) <=
                             (strstr(k_counts[i], "group") ? 1 : 0);
        if (!neutral)
            return pd_errf(err, PD_EUNSUPPORTED, "%s: \"%s\" is not supported (shared experts "
                           "and grouped routing are not implemented)", path, k_counts[i]);
    }
    double scale = 1.0;
    int rc = pd_json_get_double(root, "routed_scaling_factor", &scale, path, err);
    if (rc < 0) return rc;
    if (scale != 1.0)
        return pd_errf(err, PD_EUNSUPPORTED, "%s: \"routed_scaling_factor\" %g is not supported "
                       "(1 only)", path, scale);
    const json_t *sf = json_object_get(root, "scoring_func");
    if (sf && !json_is_null(sf) &&
        (!json_is_string(sf) || strcmp(json_string_value(sf), "softmax") != 0))
        return pd_errf(err, PD_EUNSUPPORTED, "%s: \"scoring_func\" %s is not supported (softmax)",
                       path, json_is_string(sf) ? json_string_value(sf) : "(non-string)");
    return 0;
}

/* Qwen3-MoE's mlp_only_layers: a list of layer indices (absent or null: none). */
static int parse_mlp_only(const json_t *root, mc_config *c, const char *path, char *err)
{
    const json_t *v = json_object_get(root, "mlp_only_layers");
    if (!v || json_is_null(v)) return 0;
    if (!json_is_array(v))
        return pd_errf(err, PD_EFORMAT, "%s: \"mlp_only_layers\" must be a list of layer indices",
                       path);
    size_t i;
    const json_t *e;
    json_array_foreach(v, i, e) {
        if (!json_is_integer(e) || json_integer_value(e) < 0 ||
            json_integer_value(e) > INT32_MAX)
            return pd_errf(err, PD_EFORMAT, "%s: \"mlp_only_layers\" must hold layer indices "
                           ">= 0", path);
        if (c->n_mlp_only == MC_MAX_MLP_ONLY)
            return pd_errf(err, PD_EUNSUPPORTED, "%s: \"mlp_only_layers\" lists more than %d "
                           "layers", path, MC_MAX_MLP_ONLY);
        c->mlp_only[c->n_mlp_only++] = (int32_t)json_integer_value(e);
    }
    return 0;
}

/* The mixture-of-experts settings of Qwen3MoeForCausalLM and MixtralForCausalLM (nothing for
 * the dense architectures). Both spellings of the expert count are read: num_experts (the
 * Hub's Qwen3-MoE configs) and num_local_experts (Mixtral's, and transformers 5's for both);
 * given both, they must agree. router_jitter_noise is read by nothing: transformers applies
 * it in training only. */
static int parse_moe(const json_t *root, mc_config *c, const char *path, char *err)
{
    if (c->arch != MC_ARCH_QWEN3_MOE && c->arch != MC_ARCH_MIXTRAL) return 0;
    int rc;
    int32_t ne = 0, nle = 0;
    if ((rc = pd_json_get_i32(root, "num_experts", &ne, path, err)) < 0 ||
        (rc = pd_json_get_i32(root, "num_local_experts", &nle, path, err)) < 0)
        return rc;
    if (ne && nle && ne != nle)
        return pd_errf(err, PD_EFORMAT, "%s: \"num_experts\" (%d) and \"num_local_experts\" (%d) "
                       "differ", path, ne, nle);
    c->n_experts = ne ? ne : nle;
    if (c->n_experts == 0)
        return pd_errf(err, PD_EFORMAT, "%s: required key \"num_experts\" (or "
                       "\"num_local_experts\") is missing", path);
    if (c->n_experts < 0 || c->n_experts > MC_MAX_EXPERTS)
        return pd_errf(err, PD_EFORMAT, "%s: \"num_experts\" must be in 1..%d (got %d)", path,
                       MC_MAX_EXPERTS, c->n_experts);
    if ((rc = req_pos(root, "num_experts_per_tok", &c->n_experts_per_tok, path, err)) < 0)
        return rc;
    if (c->n_experts_per_tok > c->n_experts)
        return pd_errf(err, PD_EFORMAT, "%s: \"num_experts_per_tok\" (%d) is more than the %d "
                       "experts", path, c->n_experts_per_tok, c->n_experts);
    if ((rc = refuse_moe_extras(root, path, err)) < 0) return rc;
    c->decoder_sparse_step = 1;
    if (c->arch == MC_ARCH_MIXTRAL) { /* every layer sparse, top k always renormalised */
        c->moe_intermediate = c->intermediate_size;
        c->norm_topk_prob = true;
        return 0;
    }
    if ((rc = req_pos(root, "moe_intermediate_size", &c->moe_intermediate, path, err)) < 0 ||
        (rc = pd_json_get_i32(root, "decoder_sparse_step", &c->decoder_sparse_step, path,
                              err)) < 0 ||
        (rc = pd_json_get_bool(root, "norm_topk_prob", &c->norm_topk_prob, path, err)) < 0)
        return rc;
    if (c->decoder_sparse_step < 1)
        return pd_errf(err, PD_EFORMAT, "%s: \"decoder_sparse_step\" must be >= 1 (got %d)", path,
                       c->decoder_sparse_step);
    return parse_mlp_only(root, c, path, err);
}

static int parse_config(const json_t *root, mc_config *c, const char *path, char *err)
{
    int rc;
    if (!json_is_object(root)) return pd_errf(err, PD_EFORMAT, "%s: not a JSON object", path);
    if ((rc = parse_arch(root, c, path, err)) < 0) return rc;
    if ((rc = req_pos(root, "hidden_size", &c->hidden_size, path, err)) < 0 ||
        (rc = req_pos(root, "intermediate_size", &c->intermediate_size, path, err)) < 0 ||
        (rc = req_pos(root, "num_hidden_layers", &c->n_layers, path, err)) < 0 ||
        (rc = req_pos(root, "num_attention_heads", &c->n_heads, path, err)) < 0 ||
        (rc = req_pos(root, "vocab_size", &c->vocab_size, path, err)) < 0)
        return rc;
    c->n_kv_heads = c->n_heads;
    if ((rc = pd_json_get_i32(root, "num_key_value_heads", &c->n_kv_heads, path, err)) < 0) return rc;
    if (c->n_kv_heads <= 0 || c->n_heads % c->n_kv_heads != 0)
        return pd_errf(err, PD_EFORMAT, "%s: num_attention_heads (%d) must be a multiple of "
                       "num_key_value_heads (%d)", path, c->n_heads, c->n_kv_heads);
    c->head_dim = 0;
    if ((rc = pd_json_get_i32(root, "head_dim", &c->head_dim, path, err)) < 0) return rc;
    if (c->head_dim == 0) {
        if (c->hidden_size % c->n_heads != 0)
            return pd_errf(err, PD_EFORMAT, "%s: hidden_size %d is not divisible by "
                           "num_attention_heads %d and no head_dim is given", path,
                           c->hidden_size, c->n_heads);
        c->head_dim = c->hidden_size / c->n_heads;
    }
    if (c->head_dim <= 0 || c->head_dim % 2 != 0)
        return pd_errf(err, PD_EFORMAT, "%s: head_dim must be a positive even number (got %d)",
                       path, c->head_dim);
    if ((rc = parse_moe(root, c, path, err)) < 0) return rc;
    if ((rc = check_sizes(c, path, err)) < 0) return rc;
    c->max_position = 2048;
    if ((rc = pd_json_get_i32(root, "max_position_embeddings", &c->max_position, path, err)) < 0)
        return rc;
    if (c->max_position <= 0)
        return pd_errf(err, PD_EFORMAT, "%s: max_position_embeddings must be > 0", path);
    double eps = 1e-6;
    if ((rc = pd_json_get_double(root, "rms_norm_eps", &eps, path, err)) < 0) return rc;
    if (!(eps > 0)) return pd_errf(err, PD_EFORMAT, "%s: rms_norm_eps must be > 0", path);
    c->rms_eps = (float)eps;

    json_t *act = json_object_get(root, "hidden_act");
    if (act && !json_is_null(act)) {
        if (!json_is_string(act) || (strcmp(json_string_value(act), "silu") != 0 &&
                                     strcmp(json_string_value(act), "swish") != 0))
            return pd_errf(err, PD_EUNSUPPORTED, "%s: hidden_act %s is not supported (silu)",
                           path, json_is_string(act) ? json_string_value(act) : "(non-string)");
    }
    bool mlp_bias = false, attn_bias = false, use_sw = false;
    if ((rc = pd_json_get_bool(root, "mlp_bias", &mlp_bias, path, err)) < 0 ||
        (rc = pd_json_get_bool(root, "attention_bias", &attn_bias, path, err)) < 0 ||
        (rc = pd_json_get_bool(root, "tie_word_embeddings", &c->tie_word_embeddings, path, err)) < 0 ||
        (rc = pd_json_get_bool(root, "use_sliding_window", &use_sw, path, err)) < 0)
        return rc;
    if (mlp_bias) return pd_errf(err, PD_EUNSUPPORTED, "%s: mlp_bias=true is not supported", path);
    switch (c->arch) {
    case MC_ARCH_QWEN2:
        c->qkv_bias = true; /* Qwen2 always has q/k/v biases and no o_proj bias */
        break;
    case MC_ARCH_QWEN3:
    case MC_ARCH_QWEN3_MOE:
        c->qk_norm = true;
        c->qkv_bias = c->o_bias = attn_bias;
        break;
    default:
        c->qkv_bias = c->o_bias = attn_bias;
        break;
    }
    c->sliding_window = 0;
    if (c->arch == MC_ARCH_MISTRAL || c->arch == MC_ARCH_MIXTRAL) {
        if ((rc = pd_json_get_i32(root, "sliding_window", &c->sliding_window, path, err)) < 0) return rc;
        if (c->sliding_window < 0) c->sliding_window = 0;
        if (c->sliding_window >= c->max_position) c->sliding_window = 0;
    } else if (use_sw) {
        return pd_errf(err, PD_EUNSUPPORTED, "%s: use_sliding_window=true (per-layer sliding "
                       "window attention) is not supported", path);
    }
    if ((rc = parse_dtype(root, c, path, err)) < 0) return rc;
    if ((rc = parse_rope(root, c, path, err)) < 0) return rc;
    const json_t *qc = json_object_get(root, "quantization_config");
    if (qc && !json_is_null(qc) && (rc = mc_parse_quant(qc, &c->quant, path, err)) < 0) return rc;

    c->bos_token_id = -1;
    if ((rc = pd_json_get_i32(root, "bos_token_id", &c->bos_token_id, path, err)) < 0) return rc;
    if ((rc = parse_ids(root, "eos_token_id", c->eos_token_ids, MC_MAX_EOS, path, err)) < 0) return rc;
    c->n_eos = rc;
    return 0;
}

/* Parses len bytes of JSON text into a new reference in *root (caller frees with
 * json_decref). what names the file in messages. Returns 0 or PD_EFORMAT. */
static int parse_text(const char *json, size_t len, const char *what, json_t **root, char *err)
{
    json_error_t je;
    *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!*root)
        return pd_errf(err, PD_EFORMAT, "%s: malformed JSON at line %d column %d: %s", what,
                       je.line, je.column, je.text);
    return 0;
}

/* Reads the whole file at path into *data (caller frees with free()) and *len. Returns 0,
 * PD_EIO or PD_ENOMEM. */
static int read_text(const char *path, char **data, size_t *len, char *err)
{
    *data = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errf(err, PD_EIO, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 0, n = 0;
    char *buf = NULL;
    for (;;) {
        if (cap - n < 4096) {
            size_t ncap = cap ? cap * 2 : 65536;
            char *b = realloc(buf, ncap);
            if (!b) {
                free(buf);
                fclose(f);
                return pd_errf(err, PD_ENOMEM, "out of memory reading %s", path);
            }
            buf = b;
            cap = ncap;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return pd_errf(err, PD_EIO, "cannot read %s", path);
    }
    *data = buf;
    *len = n;
    return 0;
}

static int parse_config_text(const char *json, size_t len, mc_config *out, const char *what,
                             char *err)
{
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = parse_text(json, len, what, &root, err);
    if (rc < 0) return rc;
    rc = parse_config(root, out, what, err);
    json_decref(root);
    return rc;
}

static int parse_generation_text(const char *json, size_t len, mc_config *out, const char *what,
                                 char *err)
{
    json_t *root;
    int rc = parse_text(json, len, what, &root, err);
    if (rc < 0) return rc;
    if (!json_is_object(root)) {
        json_decref(root);
        return pd_errf(err, PD_EFORMAT, "%s: not a JSON object", what);
    }
    int32_t ids[MC_MAX_EOS];
    rc = parse_ids(root, "eos_token_id", ids, MC_MAX_EOS, what, err);
    if (rc > 0) {
        memcpy(out->eos_token_ids, ids, (size_t)rc * sizeof ids[0]);
        out->n_eos = rc;
    }
    if (rc >= 0) {
        int r2 = pd_json_get_i32(root, "bos_token_id", &out->bos_token_id, what, err);
        if (r2 < 0) rc = r2;
    }
    json_decref(root);
    return rc < 0 ? rc : 0;
}

int mc_parse_json(const char *json, size_t len, mc_config *out, char *err)
{
    return parse_config_text(json, len, out, "config.json", err);
}

int mc_parse_generation_json(const char *json, size_t len, mc_config *cfg, char *err)
{
    return parse_generation_text(json, len, cfg, "generation_config.json", err);
}

int mc_load(const char *dir, mc_config *out, char *err)
{
    memset(out, 0, sizeof *out);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text;
    size_t len;
    int rc = read_text(path, &text, &len, err);
    if (rc < 0) return rc;
    rc = parse_config_text(text, len, out, path, err);
    free(text);
    if (rc < 0) return rc;

    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    struct stat st;
    if (stat(path, &st) != 0) return 0; /* optional */
    if ((rc = read_text(path, &text, &len, err)) < 0) return rc;
    rc = parse_generation_text(text, len, out, path, err);
    free(text);
    return rc;
}

static double yarn_correction_dim(double n_rot, int dim, double base, double max_pos)
{
    return (dim * log(max_pos / (n_rot * 2.0 * M_PI))) / (2.0 * log(base));
}

float mc_rope_inv_freq(const mc_config *c, float *inv_freq)
{
    const int dim = c->head_dim, half = dim / 2;
    const double base = c->rope_theta;
    double lo = 0, hi = 0;
    if (c->rope_type == MC_ROPE_YARN) {
        lo = floor(yarn_correction_dim(c->rope_beta_fast, dim, base, c->rope_orig_max_position));
        hi = ceil(yarn_correction_dim(c->rope_beta_slow, dim, base, c->rope_orig_max_position));
        if (lo < 0) lo = 0;
        if (hi > dim - 1) hi = dim - 1;
        if (lo == hi) hi += 0.001;
    }
    for (int i = 0; i < half; i++) {
        /* transformers computes base ** (arange(0, dim, 2) / dim) in float32 then inverts. */
        double f = 1.0 / pow(base, (double)(2 * i) / dim);
        switch (c->rope_type) {
        case MC_ROPE_DEFAULT: break;
        case MC_ROPE_LINEAR: f /= c->rope_factor; break;
        case MC_ROPE_LLAMA3: {
            double old_ctx = c->rope_orig_max_position;
            double low_wl = old_ctx / c->rope_low_freq_factor;
            double high_wl = old_ctx / c->rope_high_freq_factor;
            double wl = 2.0 * M_PI / f;
            if (wl > low_wl) {
                f /= c->rope_factor;
            } else if (wl >= high_wl) { /* medium band: smooth interpolation */
                double s = (old_ctx / wl - c->rope_low_freq_factor) /
                           (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1.0 - s) * f / c->rope_factor + s * f;
            }
            break;
        }
        case MC_ROPE_YARN: {
            double ramp = ((double)i - lo) / (hi - lo);
            if (ramp < 0) ramp = 0;
            if (ramp > 1) ramp = 1;
            double extrap = 1.0 - ramp; /* share of the original frequency */
            f = (f / c->rope_factor) * (1.0 - extrap) + f * extrap;
            break;
        }
        }
        inv_freq[i] = (float)f;
    }
    return c->rope_type == MC_ROPE_YARN ? (float)c->rope_attn_factor : 1.0f;
}

bool mc_layer_sparse(const mc_config *c, int32_t li)
{
    if (c->n_experts <= 0 || c->decoder_sparse_step < 1) return false;
    for (int32_t i = 0; i < c->n_mlp_only; i++)
        if (c->mlp_only[i] == li) return false;
    return (li + 1) % c->decoder_sparse_step == 0;
}

bool mc_is_eos(const mc_config *c, int32_t tok)
{
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_token_ids[i] == tok) return true;
    return false;
}

/* The parameters with each sparse layer's experts counted `experts` times. */
static int64_t param_count(const mc_config *c, int64_t experts)
{
    int64_t h = c->hidden_size, hd = c->head_dim;
    int64_t qkv = ((int64_t)c->n_heads + 2 * (int64_t)c->n_kv_heads) * hd;
    int64_t per_layer = h * qkv + (int64_t)c->n_heads * hd * h + 2 * h;
    if (c->qkv_bias) per_layer += qkv;
    if (c->o_bias) per_layer += h;
    if (c->qk_norm) per_layer += 2 * hd;
    const int64_t dense = 3 * h * c->intermediate_size;
    /* a sparse layer: the router's [n_experts][hidden] and `experts` experts' three matrices */
    const int64_t sparse = experts * 3 * h * c->moe_intermediate + (int64_t)c->n_experts * h;
    int64_t mlps = 0;
    for (int32_t li = 0; li < c->n_layers; li++) mlps += mc_layer_sparse(c, li) ? sparse : dense;
    int64_t emb = (int64_t)c->vocab_size * h;
    return c->n_layers * per_layer + mlps + emb * (c->tie_word_embeddings ? 1 : 2) + h;
}

int64_t mc_param_count(const mc_config *c) { return param_count(c, c->n_experts); }

int64_t mc_active_param_count(const mc_config *c)
{
    return param_count(c, c->n_experts_per_tok);
}
