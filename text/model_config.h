/* model_config.h -- A model's shape and behaviour, read from a HuggingFace config.json and
 * generation_config.json: architecture, sizes, RoPE (both the rope_theta/rope_scaling and the
 * rope_parameters styles; default, linear, llama3 and yarn types), biases, tied embeddings,
 * mixture-of-experts layers, stop token ids. */
#ifndef PD_MODEL_CONFIG_H
#define PD_MODEL_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

#define MC_MAX_EOS 16
#define MC_MAX_IGNORE 64      /* modules a quantization_config may leave unquantized */
#define MC_IGNORE_LEN 160     /* bytes of one such name or pattern, NUL included */
#define MC_MAX_MLP_ONLY 256   /* entries of a Qwen3-MoE mlp_only_layers list */
#define MC_MAX_EXPERTS 4096   /* routed experts of a sparse layer */

typedef enum {
    MC_ARCH_LLAMA = 0,   /* LlamaForCausalLM */
    MC_ARCH_MISTRAL,     /* MistralForCausalLM */
    MC_ARCH_QWEN2,       /* Qwen2ForCausalLM: q/k/v bias */
    MC_ARCH_QWEN3,       /* Qwen3ForCausalLM: per-head q/k RMSNorm */
    MC_ARCH_QWEN3_MOE,   /* Qwen3MoeForCausalLM: Qwen3 attention, sparse MoE layers */
    MC_ARCH_MIXTRAL,     /* MixtralForCausalLM: Mistral attention, every layer sparse */
} mc_arch;

typedef enum {
    MC_ROPE_DEFAULT = 0,
    MC_ROPE_LINEAR,      /* positions divided by factor */
    MC_ROPE_LLAMA3,      /* Llama 3.1 frequency-dependent scaling */
    MC_ROPE_YARN,        /* YaRN ramp + attention factor */
} mc_rope_type;

/* How the checkpoint's linear weights are quantized (quantization_config in config.json, or
 * --quantization; docs/quantization.md). Everything but the decoder layers' q/k/v/o and
 * gate/up/down projections (and what `ignore` names) stays in the checkpoint's dtype. */
typedef enum {
    MC_QUANT_NONE = 0,
    MC_QUANT_CT_FP8,       /* compressed-tensors, format float-quantized: F8_E4M3 weights with
                            * weight_scale per tensor or per output channel (or per 128 x 128
                            * block: strategy block) */
    MC_QUANT_FP8_BLOCK,    /* quant_method "fp8" with weight_block_size [128, 128]: F8_E4M3
                            * weights, weight_scale_inv per 128 x 128 block */
    MC_QUANT_FP8_AT_LOAD,  /* --quantization fp8 on an unquantized checkpoint: per-channel
                            * weights quantized at load, activations dynamic per token */
} mc_quant_method;

typedef struct {
    mc_quant_method method;
    int32_t weight_group;        /* 0: a scale per output channel (a per-tensor scale is
                                  * repeated on every row); 128: per 128 x 128 block */
    bool weight_per_tensor;      /* the checkpoint has one weight_scale per tensor */
    pd_act_quant act;            /* how each linear's input rows are quantized */
    int32_t n_ignore;            /* modules left unquantized: */
    char ignore[MC_MAX_IGNORE][MC_IGNORE_LEN]; /* names, or "re:" + a regular expression
                                  * matched from the name's start (compressed-tensors); */
    bool ignore_substring;       /* names matched as substrings (modules_to_not_convert) */
    bool kv_scales;              /* kv_cache_scheme: per-layer k_scale / v_scale tensors */
    char name[32];               /* "compressed-tensors", "fp8", "fp8 (at load)", "" */
} mc_quant;

typedef struct {
    mc_arch arch;
    char arch_name[64];          /* as in config.json "architectures"[0] */
    int32_t hidden_size;         /* model width */
    int32_t intermediate_size;   /* MLP width */
    int32_t n_layers;
    int32_t n_heads;             /* query heads */
    int32_t n_kv_heads;          /* key/value heads (GQA); = n_heads when absent */
    int32_t head_dim;            /* may differ from hidden_size / n_heads (Qwen3) */
    int32_t vocab_size;
    int32_t max_position;        /* max_position_embeddings: longest sequence accepted */
    float rms_eps;
    int32_t sliding_window;      /* attention window in tokens; 0 = full attention */
    pd_dtype dtype;              /* torch_dtype / dtype in the file (F32 when absent) */

    mc_rope_type rope_type;
    double rope_theta;           /* base */
    double rope_factor;          /* linear / llama3 / yarn factor */
    double rope_low_freq_factor; /* llama3 */
    double rope_high_freq_factor;/* llama3 */
    int32_t rope_orig_max_position; /* llama3 / yarn original_max_position_embeddings */
    double rope_beta_fast;       /* yarn, default 32 */
    double rope_beta_slow;       /* yarn, default 1 */
    double rope_attn_factor;     /* yarn mscale applied to cos/sin; 1 otherwise */

    int32_t bos_token_id;        /* -1 when unknown */
    int32_t eos_token_ids[MC_MAX_EOS]; /* generation_config.json first, else config.json */
    int32_t n_eos;

    bool tie_word_embeddings;    /* lm_head shares embed_tokens */
    bool qkv_bias;               /* q/k/v projections have biases (Qwen2, attention_bias) */
    bool o_bias;                 /* o_proj has a bias (Llama attention_bias) */
    bool qk_norm;                /* per-head q/k RMSNorm (Qwen3) */

    /* Mixture of experts (docs/engine.md "Mixture of experts"); n_experts 0: every layer has
     * the dense MLP of intermediate_size. Which layers are sparse: mc_layer_sparse. */
    int32_t n_experts;           /* routed experts of a sparse layer (num_experts, or
                                  * num_local_experts), 1..MC_MAX_EXPERTS */
    int32_t n_experts_per_tok;   /* experts each token runs (top k), 1..n_experts */
    int32_t moe_intermediate;    /* an expert's MLP width (moe_intermediate_size; Mixtral:
                                  * intermediate_size) */
    int32_t decoder_sparse_step; /* Qwen3-MoE: every this-many-th layer is sparse; >= 1 */
    int32_t n_mlp_only;          /* mlp_only_layers: layers that keep the dense MLP */
    int32_t mlp_only[MC_MAX_MLP_ONLY];
    bool norm_topk_prob;         /* the top k routing weights renormalised to sum 1 (Mixtral
                                  * always) */
    mc_quant quant;              /* quantization_config (MC_QUANT_NONE when absent) */
} mc_config;

/* Reads dir/config.json and, if present, dir/generation_config.json. Returns 0, PD_EIO (no
 * config.json), PD_EFORMAT (malformed JSON, missing or mistyped key, inconsistent sizes, sizes
 * beyond any real model: a width (hidden, intermediate, vocabulary, heads * head_dim) over
 * 2^24, more than 2^16 layers or 2^48 parameters; RoPE settings that give no usable
 * frequencies: rope_theta <= 1, a scaling factor < 1, non-positive yarn betas, llama3
 * low_freq_factor or original_max_position_embeddings),
 * PD_EUNSUPPORTED (architecture, activation, rope type, sliding-window mode, MLP bias not
 * supported; mixture-of-experts features beyond plain top-k softmax routing: shared experts,
 * another scoring function, grouped routing, a routed scaling factor). err names the file and
 * key. Mixture-of-experts configs need num_experts (or num_local_experts),
 * num_experts_per_tok and, for Qwen3-MoE, moe_intermediate_size. */
int mc_load(const char *dir, mc_config *out, char *err);

/* Parses config.json text held in memory (json, len bytes; not kept) into *out, with mc_load's
 * checks and errors (err names "config.json" and the key). mc_load reads the file and calls
 * this. Returns 0, PD_EFORMAT or PD_EUNSUPPORTED. */
int mc_parse_json(const char *json, size_t len, mc_config *out, char *err);

/* Applies generation_config.json text held in memory (len bytes; not kept) to a parsed *cfg:
 * its eos_token_id (an id or a list) replaces cfg's stop ids, its bos_token_id cfg's. Returns 0
 * or PD_EFORMAT (malformed JSON, not an object, mistyped key). */
int mc_parse_generation_json(const char *json, size_t len, mc_config *cfg, char *err);

/* Fills inv_freq[head_dim / 2] with the rotary inverse frequencies of cfg's RoPE settings
 * (scaling applied) and returns the cos/sin multiplier (YaRN attention factor, else 1). */
float mc_rope_inv_freq(const mc_config *cfg, float *inv_freq);

/* Whether layer li is a sparse (mixture-of-experts) layer, as transformers' Qwen3-MoE decides:
 * li not in mlp_only_layers, n_experts > 0 and (li + 1) % decoder_sparse_step == 0. Mixtral:
 * every layer. A dense model: none. */
bool mc_layer_sparse(const mc_config *cfg, int32_t li);

/* True when tok is one of the model's end-of-sequence ids. */
bool mc_is_eos(const mc_config *cfg, int32_t tok);

/* Parses a quantization_config object (config.json's, borrowed) into *q. Supported:
 * compressed-tensors float-quantized FP8 (one config group targeting Linear; weights 8-bit
 * float, strategy tensor, channel or block [128, 128]; input activations null, dynamic per
 * token, static per tensor, or dynamic in groups of 128 with block weights) and quant_method
 * "fp8" with e4m3, dynamic activations and weight_block_size [128, 128]. Anything else is
 * PD_EUNSUPPORTED with err naming what was found (path names the file). */
int mc_parse_quant(const void *json_obj, mc_quant *q, const char *path, char *err);

/* Applies --quantization: "auto" or "" (the checkpoint's), "none" (refuses a quantized
 * checkpoint: PD_EINVAL), "fp8" (the checkpoint's FP8 when it has one, else
 * MC_QUANT_FP8_AT_LOAD). Returns 0, PD_EINVAL (an unknown value) with err. */
int mc_set_quantization(mc_config *cfg, const char *value, char *err);

/* Whether module (e.g. "model.layers.3.mlp.down_proj") stays unquantized under q. */
bool mc_quant_ignored(const mc_quant *q, const char *module);

/* Parameters, in elements, of a model of this shape (embeddings counted once when tied). */
int64_t mc_param_count(const mc_config *cfg);

/* The parameters one token's forward pass reads: mc_param_count with each sparse layer's
 * experts counted n_experts_per_tok times instead of n_experts (its router whole); equal to
 * mc_param_count for a dense model. */
int64_t mc_active_param_count(const mc_config *cfg);

#endif
