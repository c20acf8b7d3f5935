/* model.h -- A model's weights in backend memory: loaded from safetensors (q/k/v and
 * gate/up fused into one matrix each at load time, a mixture-of-experts layer's router and
 * experts too) or filled with random values of the configured shapes (--load-format dummy). */
#ifndef PD_MODEL_H
#define PD_MODEL_H

#include <stdint.h>

#include "kernels/backend.h"
#include "text/model_config.h"

typedef enum {
    PD_LOAD_SAFETENSORS = 0, /* real weights from the model directory */
    PD_LOAD_DUMMY,           /* uniform random values, for benchmarking shapes */
} pd_load_format;

/* One rank's share of the model under tensor parallelism (Megatron-style, as vLLM): the
 * query heads, the KV heads and the MLP's intermediate columns are divided among the ranks;
 * q/k/v and gate/up are split by output rows, o_proj and down by input columns (their partial
 * products summed by an all-reduce); every expert of a sparse layer likewise (its own
 * intermediate columns divided), its router whole on every rank; norms, embedding and LM head
 * are whole on every rank.
 * When the ranks outnumber the KV heads each KV head is replicated on n_ranks / n_kv_heads
 * ranks (one head a rank). One rank: the whole model. */
typedef struct {
    int32_t rank, n_ranks;     /* this shard is rank of n_ranks */
    int32_t n_heads, q_head0;  /* query heads here, and the first one's index in the model */
    int32_t n_kv_heads, kv_head0; /* KV heads here (every rank the same number) and the first */
    int32_t intermediate, ff0; /* MLP columns here, and the first */
    int32_t moe_intermediate, moe_ff0; /* each expert's MLP columns here, and the first (0
                                * for a dense model) */
} pd_shard;

/* Fills *out with rank's shard of n_ranks. The model must divide: n_heads and
 * intermediate_size (and a mixture-of-experts model's moe_intermediate) by n_ranks, and
 * n_kv_heads by n_ranks or n_ranks by n_kv_heads.
 * Returns 0, or PD_EINVAL with err saying what does not divide. */
int pd_shard_of(const mc_config *cfg, int32_t rank, int32_t n_ranks, pd_shard *out, char *err);

/* One expert of a sparse layer: its MLP as the dense layer's gate_up and down (the shard's
 * moe_intermediate columns). */
typedef struct {
    void *gate_up;    /* [2 moe_intermediate][hidden]: gate rows, then up rows */
    void *down;       /* [hidden][moe_intermediate] */
    const pd_wq_ops *gate_up_ops, *down_ops; /* as pd_layer_weights' */
} pd_expert;

/* A layer's weights; head counts and intermediate are the shard's (pd_shard). */
typedef struct {
    void *attn_norm;  /* [hidden] */
    void *qkv;        /* [(n_heads + 2 n_kv_heads) head_dim][hidden]: q rows, then k, then v */
    void *qkv_bias;   /* [(n_heads + 2 n_kv_heads) head_dim] or NULL */
    void *q_norm;     /* [head_dim] or NULL (Qwen3) */
    void *k_norm;     /* [head_dim] or NULL (Qwen3) */
    void *o_proj;     /* [hidden][n_heads head_dim] */
    void *o_bias;     /* [hidden] or NULL (also on every rank but 0: added once) */
    void *mlp_norm;   /* [hidden] post_attention_layernorm */
    void *gate_up;    /* [2 intermediate][hidden]: gate rows, then up rows; NULL in a sparse
                       * layer */
    void *down;       /* [hidden][intermediate]; NULL in a sparse layer */
    void *router;     /* a sparse layer's (mc_layer_sparse): [n_experts][hidden]; else NULL */
    pd_expert *experts; /* a sparse layer's [n_experts] (host array); else NULL */
    /* Every expert's weights in one each, [n_experts][2 moe_intermediate][hidden] and
     * [n_experts][hidden][moe_intermediate]: unquantized, act_dtype buffers (each pd_expert
     * points into them); quantized, two weights of the op set experts_ops (its moe_experts
     * runs them; the pd_experts hold none). Else NULL: each expert's linears their own
     * weights. */
    void *experts_gate_up, *experts_down;
    const pd_wq_ops *experts_ops;
    /* The op set of each linear's weights: NULL = the backend's own (act_dtype buffers above);
     * else a quantized weight of that set (its weight_create result; docs/quantization.md). */
    const pd_wq_ops *qkv_ops, *o_ops, *gate_up_ops, *down_ops;
    float k_scale, v_scale; /* an FP8 KV cache's scales: the checkpoint's k_scale / v_scale,
                             * else 1 */
} pd_layer_weights;

typedef struct {
    mc_config cfg;             /* copy of the model's config (the whole model's shape) */
    pd_shard shard;            /* what this rank holds (rank 0 of 1: everything) */
    pd_backend *be;            /* borrowed; must outlive the model */
    void *embed;               /* [vocab][hidden] */
    void *final_norm;          /* [hidden] */
    void *lm_head;             /* [vocab][hidden]; == embed when tied (on rank 0; NULL on the
                                * others: rank 0 computes the logits); with head_rows < vocab
                                * this rank's rows [head_row0, head_row0 + head_rows) */
    int32_t head_row0, head_rows; /* the vocabulary split of an untied head among the ranks
                                * (tensor parallelism, when n_ranks divides the vocabulary);
                                * 0 and vocab: the whole head */
    pd_layer_weights *layers;  /* [n_layers] */
    int64_t n_params;          /* elements held */
    int64_t weight_bytes;      /* bytes held (quantized weights with their scales) */
    bool quantized;            /* some linear runs a quantized op set (cfg.quant) */
} pd_model;

/* Loads the weights of the model in dir (whose config is cfg) into backend memory. Every
 * expected tensor must exist with the expected shape; a missing or misshapen tensor is
 * PD_EFORMAT naming it. With cfg->quant set, the decoder layers' projections are loaded into
 * the backend's op set of that precision (PD_EUNSUPPORTED when it has none), with their
 * scales; the fused q/k/v and gate/up parts must be quantized alike; an F8_E4M3 tensor where
 * the config expects none is PD_EFORMAT. A model with sparse layers on a backend without the
 * mixture-of-experts ops (moe_route, moe_combine) is PD_EUNSUPPORTED. With PD_LOAD_DUMMY
 * nothing is read and weights are uniform in
 * [-scale, scale) from seed (norm weights around 1). Returns 0 and *out (free with
 * pd_model_destroy), or an error with err set. */
int pd_model_load(const mc_config *cfg, const char *dir, pd_load_format fmt, uint64_t seed,
                  pd_backend *be, pd_model **out, char *err);
/* pd_model_load for rank's shard of n_ranks (pd_shard_of; PD_EINVAL when the model does not
 * divide). Dummy weights of a shard are drawn from a stream of its own: they are not the
 * corresponding part of the whole model's dummy weights. */
int pd_model_load_shard(const mc_config *cfg, const char *dir, pd_load_format fmt, uint64_t seed,
                        pd_backend *be, int32_t rank, int32_t n_ranks, pd_model **out,
                        char *err);
void pd_model_destroy(pd_model *m); /* NULL is a no-op */

#endif
