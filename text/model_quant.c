/* model_quant.c -- config.json's quantization_config: which FP8 checkpoint formats pdserve
 * reads (compressed-tensors float-quantized, block-wise quant_method "fp8"), how their weights
 * and activations are scaled, and which modules they leave unquantized. Everything else is
 * refused naming what was found (docs/quantization.md). */
#include "text/model_config.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "common/error.h"

static const char *str_of(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* An integer member, or def when absent or null; -1 when of another type. */
static int64_t int_of(const json_t *o, const char *key, int64_t def)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return def;
    return json_is_integer(v) ? (int64_t)json_integer_value(v) : -1;
}

static bool bool_of(const json_t *o, const char *key, bool def)
{
    const json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : def;
}

/* A [128, 128] array (weight_block_size, block_structure). */
static bool is_block_128(const json_t *v)
{
    return json_is_array(v) && json_array_size(v) == 2 &&
           json_integer_value(json_array_get(v, 0)) == 128 &&
           json_integer_value(json_array_get(v, 1)) == 128;
}

static int add_ignores(const json_t *list, mc_quant *q, const char *key, const char *path,
                       char *err)
{
    if (!list || json_is_null(list)) return 0;
    if (!json_is_array(list))
        return pd_errf(err, PD_EFORMAT, "%s: quantization_config.%s is not a list", path, key);
    size_t i;
    const json_t *e;
    json_array_foreach(list, i, e) {
        const char *s = json_string_value(e);
        if (!s) return pd_errf(err, PD_EFORMAT, "%s: quantization_config.%s[%zu] is not a string",
                               path, key, i);
        if (q->n_ignore == MC_MAX_IGNORE || strlen(s) >= MC_IGNORE_LEN)
            return pd_errf(err, PD_EUNSUPPORTED, "%s: quantization_config.%s: more than %d "
                           "entries or one longer than %d bytes", path, key, MC_MAX_IGNORE,
                           MC_IGNORE_LEN - 1);
        if (strncmp(s, "re:", 3) == 0) { /* checked now, not at the first match */
            int ec;
            PCRE2_SIZE eo;
            pcre2_code *re = pcre2_compile((PCRE2_SPTR)(s + 3), PCRE2_ZERO_TERMINATED, 0, &ec,
                                           &eo, NULL);
            if (!re) return pd_errf(err, PD_EFORMAT, "%s: quantization_config.%s: bad regular "
                                    "expression \"%s\" at offset %zu", path, key, s, (size_t)eo);
            pcre2_code_free(re);
        }
        snprintf(q->ignore[q->n_ignore++], MC_IGNORE_LEN, "%s", s);
    }
    return 0;
}

/* compressed-tensors: one config group of 8-bit float weights on Linear layers. */
static int parse_ct(const json_t *qc, mc_quant *q, const char *path, char *err)
{
    const char *fmt = str_of(qc, "format");
    if (!fmt || strcmp(fmt, "float-quantized") != 0)
        return pd_errf(err, PD_EUNSUPPORTED, "%s: compressed-tensors format \"%s\" is not "
                       "supported (float-quantized FP8 is)", path, fmt ? fmt : "(none)");
    const json_t *groups = json_object_get(qc, "config_groups");
    if (!json_is_object(groups) || json_object_size(groups) != 1)
        return pd_errf(err, PD_EUNSUPPORTED, "%s: compressed-tensors with %zu config_groups "
                       "(one group for every Linear is supported)", path,
                       json_is_object(groups) ? json_object_size(groups) : (size_t)0);
    const char *gname = json_object_iter_key(json_object_iter((json_t *)groups));
    const json_t *g = json_object_get(groups, gname);
    const json_t *targets = json_object_get(g, "targets");
    bool linear = false;
    size_t i;
    const json_t *t;
    if (json_is_array(targets))
        json_array_foreach(targets, i, t) linear |= json_is_string(t) &&
                                                    strcmp(json_string_value(t), "Linear") == 0;
    if (!linear || json_array_size(targets) != 1)
        return pd_errf(err, PD_EUNSUPPORTED, "%s: compressed-tensors group %s targets other "
                       "than [\"Linear\"]", path, gname);
    const json_t *w = json_object_get(g, "weights");
    const char *wtype = str_of(w, "type"), *wstrat = str_of(w, "strategy");
    if (!json_is_object(w) || int_of(w, "num_bits", 0) != 8 || !wtype ||
        strcmp(wtype, "float") != 0)
        return pd_errf(err, PD_EUNSUPPORTED, "%s: compressed-tensors weights of %lld bits of "
                       "type %s (8-bit float is supported)", path,
                       (long long)int_of(w, "num_bits", 0), wtype ? wtype : "(none)");
    if (!bool_of(w, "symmetric", true) || bool_of(w, "dynamic", false))
        return pd_errf(err, PD_EUNSUPPORTED, "%s: compressed-tensors weights asymmetric or "
                       "dynamic (symmetric static weights are supported)", path);
    if (wstrat && strcmp(wstrat, "tensor") == 0) {
        q->weight_per_tensor = true;
    } else if (wstrat && strcmp(wstrat, "channel") == 0) {
        q->weight_group = 0;
    } else if (wstrat && strcmp(wstrat, "block") == 0 &&
               is_block_128(json_object_get(w, "block_structure"))) {
        q->weight_group = 128;
    } else {
        return pd_errf(err, PD_EUNSUPPORTED, "%s: compressed-tensors weight strategy %s (tensor, "
                       "channel and block [128, 128] are supported)", path,
                       wstrat ? wstrat : "(none)");
    }
    const json_t *a = json_object_get(g, "input_activations");
    if (!a || json_is_null(a)) {
        q->act = PD_ACT_NONE;
    } else {
        const char *atype = str_of(a, "type"), *astrat = str_of(a, "strategy");
        const bool dyn = bool_of(a, "dynamic", false);
        if (int_of(a, "num_bits", 0) != 8 || !atype || strcmp(atype, "float") != 0 ||
            !bool_of(a, "symmetric", true))
            return pd_errf(err, PD_EUNSUPPORTED, "%s: compressed-tensors input activations "
                           "other than symmetric 8-bit float", path);
        if (dyn && astrat && strcmp(astrat, "token") == 0 && q->weight_group == 0)
            q->act = PD_ACT_DYNAMIC;
        else if (dyn && astrat && strcmp(astrat, "group") == 0 &&
                 int_of(a, "group_size", 0) == 128 && q->weight_group == 128)
            q->act = PD_ACT_DYNAMIC;
        else if (!dyn && astrat && strcmp(astrat, "tensor") == 0 && q->weight_group == 0)
            q->act = PD_ACT_STATIC;
        else
            return pd_errf(err, PD_EUNSUPPORTED, "%s: compressed-tensors input activations %s "
                           "%s with %s weights (supported: dynamic per token or static per "
                           "tensor with tensor / channel weights, dynamic groups of 128 with "
                           "block weights, or none)", path, dyn ? "dynamic" : "static",
                           astrat ? astrat : "(no strategy)", wstrat);
    }
    const json_t *kv = json_object_get(qc, "kv_cache_scheme");
    if (kv && !json_is_null(kv)) {
        const char *kt = str_of(kv, "type"), *ks = str_of(kv, "strategy");
        if (int_of(kv, "num_bits", 0) != 8 || !kt || strcmp(kt, "float") != 0 || !ks ||
            strcmp(ks, "tensor") != 0 || bool_of(kv, "dynamic", false))
            return pd_errf(err, PD_EUNSUPPORTED, "%s: kv_cache_scheme other than static 8-bit "
                           "float per tensor", path);
        q->kv_scales = true;
    }
    snprintf(q->name, sizeof q->name, "compressed-tensors");
    return add_ignores(json_object_get(qc, "ignore"), q, "ignore", path, err);
}

/* Block-wise FP8 (DeepSeek-V3, Qwen3-*-FP8). */
static int parse_fp8(const json_t *qc, mc_quant *q, const char *path, char *err)
{
    const char *fmt = str_of(qc, "fmt"), *as = str_of(qc, "activation_scheme");
    if (fmt && strcmp(fmt, "e4m3") != 0)
        return pd_errf(err, PD_EUNSUPPORTED, "%s: quant_method fp8 with fmt %s (e4m3 is "
                       "supported)", path, fmt);
    if (!as || strcmp(as, "dynamic") != 0)
        return pd_errf(err, PD_EUNSUPPORTED, "%s: quant_method fp8 with activation_scheme %s "
                       "(dynamic is supported)", path, as ? as : "(none)");
    if (!is_block_128(json_object_get(qc, "weight_block_size")))
        return pd_errf(err, PD_EUNSUPPORTED, "%s: quant_method fp8 without weight_block_size "
                       "[128, 128] (per-tensor FP8 checkpoints are not supported; block-wise "
                       "ones are)", path);
    q->weight_group = 128;
    q->act = PD_ACT_DYNAMIC;
    q->ignore_substring = true;
    snprintf(q->name, sizeof q->name, "fp8");
    int rc = add_ignores(json_object_get(qc, "modules_to_not_convert"), q,
                         "modules_to_not_convert", path, err);
    if (rc == 0)
        rc = add_ignores(json_object_get(qc, "ignored_layers"), q, "ignored_layers", path, err);
    return rc;
}

int mc_parse_quant(const void *json_obj, mc_quant *q, const char *path, char *err)
{
    const json_t *qc = json_obj;
    memset(q, 0, sizeof *q);
    if (!json_is_object(qc))
        return pd_errf(err, PD_EFORMAT, "%s: quantization_config is not an object", path);
    const char *m = str_of(qc, "quant_method");
    if (m && strcmp(m, "compressed-tensors") == 0) {
        q->method = MC_QUANT_CT_FP8;
        return parse_ct(qc, q, path, err);
    }
    if (m && strcmp(m, "fp8") == 0) {
        q->method = MC_QUANT_FP8_BLOCK;
        return parse_fp8(qc, q, path, err);
    }
    return pd_errf(err, PD_EUNSUPPORTED, "%s: quantization_config.quant_method %s is not "
                   "supported (compressed-tensors float-quantized FP8 and block-wise fp8 are; "
                   "docs/quantization.md)", path, m ? m : "(none)");
}

int mc_set_quantization(mc_config *cfg, const char *value, char *err)
{
    if (!value || !*value || strcmp(value, "auto") == 0) return 0;
    if (strcmp(value, "none") == 0) {
        if (cfg->quant.method != MC_QUANT_NONE)
            return pd_errf(err, PD_EINVAL, "--quantization none: the checkpoint is quantized "
                           "(%s); load it as it is (auto)", cfg->quant.name);
        return 0;
    }
    if (strcmp(value, "fp8") == 0) {
        if (cfg->quant.method != MC_QUANT_NONE) return 0; /* already FP8 */
        memset(&cfg->quant, 0, sizeof cfg->quant);
        cfg->quant.method = MC_QUANT_FP8_AT_LOAD;
        cfg->quant.act = PD_ACT_DYNAMIC;
        snprintf(cfg->quant.ignore[0], MC_IGNORE_LEN, "lm_head");
        cfg->quant.n_ignore = 1;
        snprintf(cfg->quant.name, sizeof cfg->quant.name, "fp8 (at load)");
        return 0;
    }
    return pd_errf(err, PD_EINVAL, "--quantization %s: expected auto, none or fp8", value);
}

bool mc_quant_ignored(const mc_quant *q, const char *module)
{
    if (q->method == MC_QUANT_NONE) return true;
    for (int32_t i = 0; i < q->n_ignore; i++) {
        const char *e = q->ignore[i];
        if (strncmp(e, "re:", 3) == 0) {
            int ec;
            PCRE2_SIZE eo;
            pcre2_code *re = pcre2_compile((PCRE2_SPTR)(e + 3), PCRE2_ZERO_TERMINATED,
                                           PCRE2_ANCHORED, &ec, &eo, NULL);
            if (!re) continue; /* checked at parse time */
            pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
            const int hit = md ? pcre2_match(re, (PCRE2_SPTR)module, PCRE2_ZERO_TERMINATED, 0, 0,
                                             md, NULL) : -1;
            pcre2_match_data_free(md);
            pcre2_code_free(re);
            if (hit >= 0) return true;
        } else if (q->ignore_substring ? strstr(module, e) != NULL : strcmp(module, e) == 0) {
            return true;
        }
    }
    return false;
}
