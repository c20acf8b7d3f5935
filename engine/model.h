/* model.h -- A model's weights in backend memory: loaded from safetensors (q/k/v and
 * gate/up fused into one matrix each at load time) or filled with random values of the
 * configured shapes (--load-format dummy). */
#ifndef PD_MODEL_H
#define PD_MODEL_H

#include <stdint.h>

#include "engine/model_config.h"
#include "kernels/backend.h"

typedef enum {
    PD_LOAD_SAFETENSORS = 0, /* real weights from the model directory */
    PD_LOAD_DUMMY,           /* uniform random values, for benchmarking shapes */
} pd_load_format;

typedef struct {
    void *attn_norm;  /* [hidden] */
    void *qkv;        /* [(n_heads + 2 n_kv_heads) head_dim][hidden]: q rows, then k, then v */
    void *qkv_bias;   /* [(n_heads + 2 n_kv_heads) head_dim] or NULL */
    void *q_norm;     /* [head_dim] or NULL (Qwen3) */
    void *k_norm;     /* [head_dim] or NULL (Qwen3) */
    void *o_proj;     /* [hidden][n_heads head_dim] */
    void *o_bias;     /* [hidden] or NULL */
    void *mlp_norm;   /* [hidden] post_attention_layernorm */
    void *gate_up;    /* [2 intermediate][hidden]: gate rows, then up rows */
    void *down;       /* [hidden][intermediate] */
} pd_layer_weights;

typedef struct {
    mc_config cfg;             /* copy of the model's config */
    pd_backend *be;            /* borrowed; must outlive the model */
    void *embed;               /* [vocab][hidden] */
    void *final_norm;          /* [hidden] */
    void *lm_head;             /* [vocab][hidden]; == embed when tied */
    pd_layer_weights *layers;  /* [n_layers] */
    int64_t n_params;          /* elements held */
} pd_model;

/* Loads the weights of the model in dir (whose config is cfg) into backend memory. Every
 * expected tensor must exist with the expected shape; a missing or misshapen tensor is
 * PD_EFORMAT naming it. With PD_LOAD_DUMMY nothing is read and weights are uniform in
 * [-scale, scale) from seed (norm weights around 1). Returns 0 and *out (free with
 * pd_model_destroy), or an error with err set. */
int pd_model_load(const mc_config *cfg, const char *dir, pd_load_format fmt, uint64_t seed,
                  pd_backend *be, pd_model **out, char *err);
void pd_model_destroy(pd_model *m); /* NULL is a no-op */

#endif
