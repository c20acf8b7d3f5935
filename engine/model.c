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

/* A window of a tensor: rows [r0, r0 + nr) and columns [c0, c0 + nc) of the rows x cols
 * tensor (cols 0: a vector, c0 = 0 and nc = 0), the part a shard holds. */
typedef struct {
    int64_t r0, nr, c0, nc;
} window;

static window whole(int64_t rows, int64_t cols) { return (window){0, rows, 0, cols}; }

/* Copies the window w of tensor `name` (expected shape rows x cols; cols = 0 for a vector)
 * into dst at row offset row_off (rows of w.nc elements), or fills those rows randomly for
 * dummy weights (around `center`; a part of a split tensor from a stream of its own). */
static int put_part(pd_model *m, const loader *L, const char *name, int64_t rows, int64_t cols,
                    window w, void *dst, int64_t row_off, float center)
{
    const int64_t width = cols ? w.nc : 1;
    const size_t n = (size_t)(w.nr * width);
    pd_backend *be = m->be;
    const bool part = w.nr != rows || (cols && w.nc != cols);
    if (!L->st) {
        /* Dummy: a different stream per tensor, derived from its name (and for a part of a
         * split tensor from the part); replicated tensors are the same on every rank. */
        uint64_t h = L->seed ^ 0xcbf29ce484222325ull;
        for (const char *p = name; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
        if (part) h = (h ^ (uint64_t)(w.r0 * 131 + w.c0 + 1)) * 0x100000001b3ull;
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
    const size_t es = pd_dtype_size(t->dtype), full = (size_t)(cols ? cols : 1);
    const char *src = (const char *)t->data + (size_t)w.r0 * full * es + (size_t)w.c0 * es;
    void *tmp = NULL;
    if (cols && w.nc != cols) { /* a column window: gather its rows into one upload */
        tmp = malloc(n * es);
        if (!tmp) return pd_errf(L->err, PD_ENOMEM, "out of memory");
        for (int64_t i = 0; i < w.nr; i++)
            memcpy((char *)tmp + (size_t)i * (size_t)w.nc * es, src + (size_t)i * full * es,
                   (size_t)w.nc * es);
        src = tmp;
    }
    int rc = be->ops->upload(be->ctx, dst, be->ops->act_dtype, (size_t)(row_off * width), src,
                             t->dtype, n);
    free(tmp);
    if (rc < 0) return pd_errf(L->err, rc, "cannot upload tensor %s to the %s backend", name,
                               be->ops->name);
    return 0;
}

/* A whole tensor. */
static int put(pd_model *m, const loader *L, const char *name, int64_t rows, int64_t cols,
               void *dst, int64_t row_off, float center)
{
    return put_part(m, L, name, rows, cols, whole(rows, cols), dst, row_off, center);
}

int pd_shard_of(const mc_config *c, int32_t rank, int32_t n_ranks, pd_shard *out, char *err)
{
    memset(out, 0, sizeof *out);
    if (n_ranks < 1 || rank < 0 || rank >= n_ranks)
        return pd_errf(err, PD_EINVAL, "tensor parallel: rank %d of %d", rank, n_ranks);
    if (c->n_heads % n_ranks != 0)
        return pd_errf(err, PD_EINVAL, "tensor parallel %d: the model's %d attention heads do "
                       "not divide among %d ranks", n_ranks, c->n_heads, n_ranks);
    if (c->n_kv_heads % n_ranks != 0 && n_ranks % c->n_kv_heads != 0)
        return pd_errf(err, PD_EINVAL, "tensor parallel %d: the model's %d KV heads neither "
                       "divide among %d ranks nor divide them (for replication)", n_ranks,
                       c->n_kv_heads, n_ranks);
    if (c->intermediate_size % n_ranks != 0)
        return pd_errf(err, PD_EINVAL, "tensor parallel %d: the model's intermediate size %d "
                       "does not divide among %d ranks", n_ranks, c->intermediate_size, n_ranks);
    out->rank = rank;
    out->n_ranks = n_ranks;
    out->n_heads = c->n_heads / n_ranks;
    out->q_head0 = rank * out->n_heads;
    if (c->n_kv_heads >= n_ranks) {
        out->n_kv_heads = c->n_kv_heads / n_ranks;
        out->kv_head0 = rank * out->n_kv_heads;
    } else { /* replicated: n_ranks / n_kv_heads ranks share each KV head */
        out->n_kv_heads = 1;
        out->kv_head0 = rank / (n_ranks / c->n_kv_heads);
    }
    out->intermediate = c->intermediate_size / n_ranks;
    out->ff0 = rank * out->intermediate;
    return 0;
}

static int load_layer(pd_model *m, const loader *L, int32_t li, char *err)
{
    const mc_config *c = &m->cfg;
    const pd_shard *sh = &m->shard;
    pd_layer_weights *w = &m->layers[li];
    const int64_t h = c->hidden_size, hd = c->head_dim, f = c->intermediate_size;
    const int64_t nq = (int64_t)c->n_heads * hd, nkv = (int64_t)c->n_kv_heads * hd;
    /* this rank's rows of q, k and v, and columns of the MLP */
    const int64_t q0 = (int64_t)sh->q_head0 * hd, nql = (int64_t)sh->n_heads * hd;
    const int64_t k0 = (int64_t)sh->kv_head0 * hd, nkl = (int64_t)sh->n_kv_heads * hd;
    const int64_t f0 = sh->ff0, fl = sh->intermediate;
    const window wq = {q0, nql, 0, h}, wk = {k0, nkl, 0, h}, wf = {f0, fl, 0, h};
    const window bq = {q0, nql, 0, 0}, bk = {k0, nkl, 0, 0};
    char name[256];
    int rc;
#define NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d." suffix, li), name)
    if ((rc = alloc_w(m, (size_t)h, &w->attn_norm, err)) < 0 ||
        (rc = put(m, L, NAME("input_layernorm.weight"), h, 0, w->attn_norm, 0, 1.0f)) < 0)
        return rc;
    if ((rc = alloc_w(m, (size_t)((nql + 2 * nkl) * h), &w->qkv, err)) < 0 ||
        (rc = put_part(m, L, NAME("self_attn.q_proj.weight"), nq, h, wq, w->qkv, 0, 0)) < 0 ||
        (rc = put_part(m, L, NAME("self_attn.k_proj.weight"), nkv, h, wk, w->qkv, nql, 0)) < 0 ||
        (rc = put_part(m, L, NAME("self_attn.v_proj.weight"), nkv, h, wk, w->qkv, nql + nkl, 0)) < 0)
        return rc;
    if (c->qkv_bias) {
        if ((rc = alloc_w(m, (size_t)(nql + 2 * nkl), &w->qkv_bias, err)) < 0 ||
            (rc = put_part(m, L, NAME("self_attn.q_proj.bias"), nq, 0, bq, w->qkv_bias, 0, 0)) < 0 ||
            (rc = put_part(m, L, NAME("self_attn.k_proj.bias"), nkv, 0, bk, w->qkv_bias, nql, 0)) < 0 ||
            (rc = put_part(m, L, NAME("self_attn.v_proj.bias"), nkv, 0, bk, w->qkv_bias, nql + nkl,
                           0)) < 0)
            return rc;
    }
    if (c->qk_norm) {
        if ((rc = alloc_w(m, (size_t)hd, &w->q_norm, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.q_norm.weight"), hd, 0, w->q_norm, 0, 1.0f)) < 0 ||
            (rc = alloc_w(m, (size_t)hd, &w->k_norm, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.k_norm.weight"), hd, 0, w->k_norm, 0, 1.0f)) < 0)
            return rc;
    }
    if ((rc = alloc_w(m, (size_t)(h * nql), &w->o_proj, err)) < 0 ||
        (rc = put_part(m, L, NAME("self_attn.o_proj.weight"), h, nq, (window){0, h, q0, nql},
                       w->o_proj, 0, 0)) < 0)
        return rc;
    if (c->o_bias && sh->rank == 0) { /* the sum of the ranks' products adds it once */
        if ((rc = alloc_w(m, (size_t)h, &w->o_bias, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.o_proj.bias"), h, 0, w->o_bias, 0, 0)) < 0)
            return rc;
    }
    if ((rc = alloc_w(m, (size_t)h, &w->mlp_norm, err)) < 0 ||
        (rc = put(m, L, NAME("post_attention_layernorm.weight"), h, 0, w->mlp_norm, 0, 1.0f)) < 0 ||
        (rc = alloc_w(m, (size_t)(2 * fl * h), &w->gate_up, err)) < 0 ||
        (rc = put_part(m, L, NAME("mlp.gate_proj.weight"), f, h, wf, w->gate_up, 0, 0)) < 0 ||
        (rc = put_part(m, L, NAME("mlp.up_proj.weight"), f, h, wf, w->gate_up, fl, 0)) < 0 ||
        (rc = alloc_w(m, (size_t)(h * fl), &w->down, err)) < 0 ||
        (rc = put_part(m, L, NAME("mlp.down_proj.weight"), h, f, (window){0, h, f0, fl}, w->down,
                       0, 0)) < 0)
        return rc;
#undef NAME
    return 0;
}

int pd_model_load(const mc_config *cfg, const char *dir, pd_load_format fmt, uint64_t seed,
                  pd_backend *be, pd_model **out, char *err)
{
    return pd_model_load_shard(cfg, dir, fmt, seed, be, 0, 1, out, err);
}

int pd_model_load_shard(const mc_config *cfg, const char *dir, pd_load_format fmt, uint64_t seed,
                        pd_backend *be, int32_t rank, int32_t n_ranks, pd_model **out,
                        char *err)
{
    *out = NULL;
    int rc;
    st_model *st = NULL;
    pd_shard shard;
    if ((rc = pd_shard_of(cfg, rank, n_ranks, &shard, err)) < 0) return rc;
    pd_model *m = calloc(1, sizeof *m);
    if (!m) return pd_errf(err, PD_ENOMEM, "out of memory");
    m->cfg = *cfg;
    m->shard = shard;
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
    m->head_row0 = 0;
    m->head_rows = (int32_t)v;
    if (cfg->tie_word_embeddings) {
        m->lm_head = m->embed;
    } else if (n_ranks > 1 && v % n_ranks == 0) {
        /* split by vocabulary rows: each rank makes its part of every row's logits and the
         * parts are gathered (docs/tensor-parallel.md) */
        m->head_rows = (int32_t)(v / n_ranks);
        m->head_row0 = rank * m->head_rows;
        const window wh = {m->head_row0, m->head_rows, 0, h};
        if ((rc = alloc_w(m, (size_t)m->head_rows * (size_t)h, &m->lm_head, err)) < 0 ||
            (rc = put_part(m, &L, "lm_head.weight", v, h, wh, m->lm_head, 0, 0)) < 0)
            goto fail;
    } else if (rank > 0) {
        m->lm_head = NULL; /* rank 0 computes the logits */
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
    if (m->lm_head && m->lm_head != m->embed) FREE(m->lm_head);
    FREE(m->embed);
    FREE(m->final_norm);
#undef FREE
    free(m);
}
