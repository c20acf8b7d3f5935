/* model.c -- Weight loading: maps HuggingFace tensor names onto pd_model's fused layout,
 * checking every shape, and uploads (converting) into backend memory. */
#include "engine/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "engine/safetensors.h"

typedef struct {
    const pd_model *m;
    const st_model *st;       /* NULL for dummy weights */
    uint64_t seed;
    char *err;
} loader;

static int alloc_w(pd_model *m, size_t n, void **out, char *err)
{
    int rc = m->be->ops->alloc(m->be->ctx, m->be->ops->act_dtype, n, out);
    if (rc < 0) return pd_errf(err, rc, "cannot allocate %zu weight elements on the %s backend",
                               n, m->be->ops->name);
    m->n_params += (int64_t)n;
    return 0;
}

/* Copies tensor `name` (expected shape rows x cols; cols = 0 for a vector) into dst at row
 * offset row_off, or fills those rows randomly for dummy weights (around `center`). */
static int put(pd_model *m, const loader *L, const char *name, int64_t rows, int64_t cols,
               void *dst, int64_t row_off, float center)
{
    const int64_t width = cols ? cols : 1;
    const size_t n = (size_t)(rows * width);
    pd_backend *be = m->be;
    if (!L->st) {
        /* Dummy: a different stream per tensor, derived from its name. */
        uint64_t h = L->seed ^ 0xcbf29ce484222325ull;
        for (const char *p = name; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
        char *base = (char *)dst + (size_t)(row_off * width) * pd_dtype_size(be->ops->act_dtype);
        int rc = be->ops->fill_uniform(be->ctx, base, be->ops->act_dtype, n, h, center - 0.02f,
                                       center + 0.02f);
        return rc < 0 ? pd_errf(L->err, rc, "cannot fill dummy tensor %s", name) : 0;
    }
    const st_tensor *t = st_find(L->st, name);
    if (!t) return pd_errf(L->err, PD_EFORMAT, "tensor %s is missing from the checkpoint", name);
    bool ok = cols ? (t->n_dims == 2 && t->shape[0] == rows && t->shape[1] == cols)
                   : (t->n_dims == 1 && t->shape[0] == rows);
    if (!ok) {
        char got[128] = "", *p = got;
        for (int i = 0; i < t->n_dims && p < got + sizeof got - 24; i++)
            p += sprintf(p, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        if (cols)
            return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s has shape [%s], expected [%lld, %lld]",
                           name, t->file, got, (long long)rows, (long long)cols);
        return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s has shape [%s], expected [%lld]", name,
                       t->file, got, (long long)rows);
    }
    int rc = be->ops->upload(be->ctx, dst, be->ops->act_dtype, (size_t)(row_off * width), t->data,
                             t->dtype, n);
    if (rc < 0) return pd_errf(L->err, rc, "cannot upload tensor %s to the %s backend", name,
                               be->ops->name);
    return 0;
}

static int load_layer(pd_model *m, const loader *L, int32_t li, char *err)
{
    const mc_config *c = &m->cfg;
    pd_layer_weights *w = &m->layers[li];
    const int64_t h = c->hidden_size, hd = c->head_dim, f = c->intermediate_size;
    const int64_t nq = (int64_t)c->n_heads * hd, nkv = (int64_t)c->n_kv_heads * hd;
    char name[256];
    int rc;
#define NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d." suffix, li), name)
    if ((rc = alloc_w(m, (size_t)h, &w->attn_norm, err)) < 0 ||
        (rc = put(m, L, NAME("input_layernorm.weight"), h, 0, w->attn_norm, 0, 1.0f)) < 0)
        return rc;
    if ((rc = alloc_w(m, (size_t)((nq + 2 * nkv) * h), &w->qkv, err)) < 0 ||
        (rc = put(m, L, NAME("self_attn.q_proj.weight"), nq, h, w->qkv, 0, 0)) < 0 ||
        (rc = put(m, L, NAME("self_attn.k_proj.weight"), nkv, h, w->qkv, nq, 0)) < 0 ||
        (rc = put(m, L, NAME("self_attn.v_proj.weight"), nkv, h, w->qkv, nq + nkv, 0)) < 0)
        return rc;
    if (c->qkv_bias) {
        if ((rc = alloc_w(m, (size_t)(nq + 2 * nkv), &w->qkv_bias, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.q_proj.bias"), nq, 0, w->qkv_bias, 0, 0)) < 0 ||
            (rc = put(m, L, NAME("self_attn.k_proj.bias"), nkv, 0, w->qkv_bias, nq, 0)) < 0 ||
            (rc = put(m, L, NAME("self_attn.v_proj.bias"), nkv, 0, w->qkv_bias, nq + nkv, 0)) < 0)
            return rc;
    }
    if (c->qk_norm) {
        if ((rc = alloc_w(m, (size_t)hd, &w->q_norm, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.q_norm.weight"), hd, 0, w->q_norm, 0, 1.0f)) < 0 ||
            (rc = alloc_w(m, (size_t)hd, &w->k_norm, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.k_norm.weight"), hd, 0, w->k_norm, 0, 1.0f)) < 0)
            return rc;
    }
    if ((rc = alloc_w(m, (size_t)(h * nq), &w->o_proj, err)) < 0 ||
        (rc = put(m, L, NAME("self_attn.o_proj.weight"), h, nq, w->o_proj, 0, 0)) < 0)
        return rc;
    if (c->o_bias) {
        if ((rc = alloc_w(m, (size_t)h, &w->o_bias, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.o_proj.bias"), h, 0, w->o_bias, 0, 0)) < 0)
            return rc;
    }
    if ((rc = alloc_w(m, (size_t)h, &w->mlp_norm, err)) < 0 ||
        (rc = put(m, L, NAME("post_attention_layernorm.weight"), h, 0, w->mlp_norm, 0, 1.0f)) < 0 ||
        (rc = alloc_w(m, (size_t)(2 * f * h), &w->gate_up, err)) < 0 ||
        (rc = put(m, L, NAME("mlp.gate_proj.weight"), f, h, w->gate_up, 0, 0)) < 0 ||
        (rc = put(m, L, NAME("mlp.up_proj.weight"), f, h, w->gate_up, f, 0)) < 0 ||
        (rc = alloc_w(m, (size_t)(h * f), &w->down, err)) < 0 ||
        (rc = put(m, L, NAME("mlp.down_proj.weight"), h, f, w->down, 0, 0)) < 0)
        return rc;
#undef NAME
    return 0;
}

int pd_model_load(const mc_config *cfg, const char *dir, pd_load_format fmt, uint64_t seed,
                  pd_backend *be, pd_model **out, char *err)
{
    *out = NULL;
    int rc;
    st_model *st = NULL;
    pd_model *m = calloc(1, sizeof *m);
    if (!m) return pd_errf(err, PD_ENOMEM, "out of memory");
    m->cfg = *cfg;
    m->be = be;
    m->layers = calloc((size_t)cfg->n_layers, sizeof *m->layers);
    if (!m->layers) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    if (fmt == PD_LOAD_SAFETENSORS && (rc = st_open(dir, &st, err)) < 0) goto fail;
    loader L = {.m = m, .st = st, .seed = seed, .err = err};
    const int64_t h = cfg->hidden_size, v = cfg->vocab_size;
    if ((rc = alloc_w(m, (size_t)(v * h), &m->embed, err)) < 0 ||
        (rc = put(m, &L, "model.embed_tokens.weight", v, h, m->embed, 0, 0)) < 0)
        goto fail;
    for (int32_t i = 0; i < cfg->n_layers; i++)
        if ((rc = load_layer(m, &L, i, err)) < 0) goto fail;
    if ((rc = alloc_w(m, (size_t)h, &m->final_norm, err)) < 0 ||
        (rc = put(m, &L, "model.norm.weight", h, 0, m->final_norm, 0, 1.0f)) < 0)
        goto fail;
    if (cfg->tie_word_embeddings) {
        m->lm_head = m->embed;
    } else if ((rc = alloc_w(m, (size_t)(v * h), &m->lm_head, err)) < 0 ||
               (rc = put(m, &L, "lm_head.weight", v, h, m->lm_head, 0, 0)) < 0) {
        goto fail;
    }
    st_close(st);
    *out = m;
    return 0;
fail:
    st_close(st);
    pd_model_destroy(m);
    return rc;
}

void pd_model_destroy(pd_model *m)
{
    if (!m) return;
    pd_backend *be = m->be;
#define FREE(p) be->ops->free(be->ctx, (p))
    if (m->layers) {
        for (int32_t i = 0; i < m->cfg.n_layers; i++) {
            pd_layer_weights *w = &m->layers[i];
            FREE(w->attn_norm); FREE(w->qkv); FREE(w->qkv_bias); FREE(w->q_norm);
            FREE(w->k_norm); FREE(w->o_proj); FREE(w->o_bias); FREE(w->mlp_norm);
            FREE(w->gate_up); FREE(w->down);
        }
        free(m->layers);
    }
    if (m->lm_head != m->embed) FREE(m->lm_head);
    FREE(m->embed);
    FREE(m->final_norm);
#undef FREE
    free(m);
}
