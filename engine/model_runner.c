/* model_runner.c -- Batched forward pass over the paged KV cache as a sequence of backend ops.
 * Residual stream: buffer A holds the residual, B each sub-layer's output; the fused
 * add+RMSNorm folds B into A and normalises into H. */
#include "engine/model_runner.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"

#define LOGITS_CHUNK 64 /* rows of logits computed per lm_head product */

struct mr {
    mr_params p;
    const pd_model *m;
    pd_backend *be;
    int32_t max_blocks_per_seq;
    int32_t qkv_dim;              /* (n_heads + 2 n_kv_heads) head_dim */
    float attn_factor;
    size_t kv_layer_elems;        /* elements in one layer's K (or V) cache */
    void *kv;                     /* the whole pool: [n_layers][K, V][n_blocks][block elems] */
    void **k_cache, **v_cache;    /* [n_layers] pointers into kv */
    /* workspace (backend memory) */
    void *a, *b, *h, *qkv, *attn, *gate_up, *act, *lh, *logits;
    int32_t *d_ids, *d_pos, *d_slots, *d_cu_q, *d_ctx, *d_bt, *d_rows;
    float *inv_freq;
    mr_layer_fn layer_fn;         /* optional per-layer KV-ready hook */
    void *layer_arg;
};

mr_params mr_default_params(void)
{
    mr_params p = {
        .max_num_batched_tokens = 2048,
        .max_num_seqs = 256,
        .block_size = 16,
        .n_blocks = 0,
        .kv_cache_bytes = 256ll << 20,
        .gpu_memory_utilization = 0.9,
    };
    return p;
}

static int be_alloc(mr *r, pd_dtype t, size_t n, void **out, char *err)
{
    int rc = r->be->ops->alloc(r->be->ctx, t, n, out);
    if (rc < 0)
        return pd_errf(err, rc, "cannot allocate %zu elements on the %s backend", n,
                       r->be->ops->name);
    return 0;
}

/* The KV pool's bytes from device memory: utilization x total minus what this process's
 * backend took so far (weights, this runner's workspace, libraries), capped at what is free
 * now less a margin for allocations made later (cuBLAS's workspace on first use). Other
 * processes' memory is theirs: two processes at 0.45 each share one device. */
#define KV_MARGIN ((int64_t)256 << 20)
static int size_from_device(mr *r, int64_t *bytes, char *err)
{
    size_t free_b = 0, total_b = 0, used_b = 0;
    int rc = r->be->ops->mem_info(r->be->ctx, &free_b, &total_b, &used_b);
    if (rc < 0) return pd_errf(err, rc, "cannot read the %s device's memory", r->be->ops->name);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const double share = r->p.gpu_memory_utilization * (double)total_b;
    double want = share - (double)used_b;
    const double cap = (double)free_b - (double)KV_MARGIN;
    if (want > cap) want = cap;
    if (want < 1.0)
        return pd_errf(err, PD_EINVAL, "no device memory left for the KV cache: %.2f x %.2f GiB "
                       "is %.2f GiB, this process uses %.2f GiB already (weights, workspace) "
                       "and %.2f GiB are free", r->p.gpu_memory_utilization,
                       (double)total_b / gib, share / gib, (double)used_b / gib,
                       (double)free_b / gib);
    *bytes = (int64_t)want;
    PD_LOGI("model runner: KV cache %.2f GiB = %.2f x %.2f GiB device memory - %.2f GiB used by "
            "this process%s (%.2f GiB free)", want / gib, r->p.gpu_memory_utilization,
            (double)total_b / gib, (double)used_b / gib,
            want >= cap ? ", capped at the free memory" : "", (double)free_b / gib);
    return 0;
}

int mr_create(const mr_params *p, const pd_model *m, mr **out, char *err)
{
    *out = NULL;
    const mc_config *c = &m->cfg;
    if (p->max_num_batched_tokens <= 0 || p->max_num_seqs <= 0 || p->block_size <= 0 ||
        p->n_blocks < 0 || (p->n_blocks == 0 && p->kv_cache_bytes < 0))
        return pd_errf(err, PD_EINVAL, "model runner: sizes must be positive");
    if (p->n_blocks == 0 && p->kv_cache_bytes == 0) {
        if (!m->be->ops->mem_info)
            return pd_errf(err, PD_EINVAL, "model runner: the %s backend cannot size the KV "
                           "cache from device memory: give its size", m->be->ops->name);
        if (!(p->gpu_memory_utilization > 0) || p->gpu_memory_utilization > 1)
            return pd_errf(err, PD_EINVAL, "model runner: gpu_memory_utilization %g is not in "
                           "(0, 1]", p->gpu_memory_utilization);
    }
    mr *r = calloc(1, sizeof *r);
    if (!r) return pd_errf(err, PD_ENOMEM, "out of memory");
    r->p = *p;
    r->m = m;
    r->be = m->be;
    const pd_dtype act = r->be->ops->act_dtype;
    const size_t es = pd_dtype_size(act);
    const size_t T = (size_t)p->max_num_batched_tokens, S = (size_t)p->max_num_seqs;
    const size_t hs = (size_t)c->hidden_size, hd = (size_t)c->head_dim;
    r->qkv_dim = (c->n_heads + 2 * c->n_kv_heads) * c->head_dim;
    r->max_blocks_per_seq = (c->max_position + p->block_size - 1) / p->block_size;
    size_t block_elems = (size_t)p->block_size * (size_t)c->n_kv_heads * hd;
    const int64_t per_block = (int64_t)(block_elems * es) * 2 * c->n_layers;
    int rc;
    r->k_cache = calloc((size_t)c->n_layers, sizeof(void *));
    r->v_cache = calloc((size_t)c->n_layers, sizeof(void *));
    float *host_freq = malloc(hd / 2 * sizeof(float));
    if (!r->k_cache || !r->v_cache || !host_freq) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    /* The workspace first: a pool sized from free device memory must count it. */
    size_t chunk = LOGITS_CHUNK;
    if ((rc = be_alloc(r, act, T * hs, &r->a, err)) < 0 ||
        (rc = be_alloc(r, act, T * hs, &r->b, err)) < 0 ||
        (rc = be_alloc(r, act, T * hs, &r->h, err)) < 0 ||
        (rc = be_alloc(r, act, T * (size_t)r->qkv_dim, &r->qkv, err)) < 0 ||
        (rc = be_alloc(r, act, T * (size_t)c->n_heads * hd, &r->attn, err)) < 0 ||
        (rc = be_alloc(r, act, T * 2 * (size_t)c->intermediate_size, &r->gate_up, err)) < 0 ||
        (rc = be_alloc(r, act, T * (size_t)c->intermediate_size, &r->act, err)) < 0 ||
        (rc = be_alloc(r, act, chunk * hs, &r->lh, err)) < 0 ||
        (rc = be_alloc(r, act, chunk * (size_t)c->vocab_size, &r->logits, err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_I32, T, (void **)&r->d_ids, err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_I32, T, (void **)&r->d_pos, err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_I32, T, (void **)&r->d_slots, err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_I32, S + 1, (void **)&r->d_cu_q, err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_I32, S, (void **)&r->d_ctx, err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_I32, S * (size_t)r->max_blocks_per_seq, (void **)&r->d_bt, err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_I32, T, (void **)&r->d_rows, err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_F32, hd / 2, (void **)&r->inv_freq, err)) < 0)
        goto fail;
    if (r->p.n_blocks == 0) {
        int64_t bytes = p->kv_cache_bytes;
        if (bytes == 0 && (rc = size_from_device(r, &bytes, err)) < 0) goto fail;
        int64_t nb = bytes / per_block;
        if (nb < 1) {
            rc = pd_errf(err, PD_EINVAL, "KV cache of %lld bytes holds no block (%lld bytes "
                         "per block)", (long long)bytes, (long long)per_block);
            goto fail;
        }
        r->p.n_blocks = nb > INT32_MAX / p->block_size ? INT32_MAX / p->block_size : (int32_t)nb;
    }
    r->kv_layer_elems = (size_t)r->p.n_blocks * block_elems;
    /* One allocation for every layer's K and V, so that the KV transfer can register (and a
     * peer can address) the whole pool as one region. */
    if ((rc = be_alloc(r, act, r->kv_layer_elems * 2 * (size_t)c->n_layers, &r->kv, err)) < 0)
        goto fail;
    for (int32_t l = 0; l < c->n_layers; l++) {
        r->k_cache[l] = (char *)r->kv + (size_t)(2 * l) * r->kv_layer_elems * es;
        r->v_cache[l] = (char *)r->kv + (size_t)(2 * l + 1) * r->kv_layer_elems * es;
    }
    r->attn_factor = mc_rope_inv_freq(c, host_freq);
    if ((rc = r->be->ops->upload(r->be->ctx, r->inv_freq, PD_DTYPE_F32, 0, host_freq,
                                 PD_DTYPE_F32, hd / 2)) < 0) {
        pd_errf(err, rc, "cannot upload rope frequencies");
        goto fail;
    }
    free(host_freq);
    PD_LOGD("model runner: %d KV blocks of %d tokens (%.1f MiB), %d tokens x %d seqs per step",
            r->p.n_blocks, p->block_size,
            (double)r->kv_layer_elems * es * 2 * c->n_layers / 1048576.0,
            p->max_num_batched_tokens, p->max_num_seqs);
    *out = r;
    return 0;
fail:
    free(host_freq);
    mr_destroy(r);
    return rc;
}

void mr_destroy(mr *r)
{
    if (!r) return;
    pd_backend *be = r->be;
#define FREE(x) be->ops->free(be->ctx, (x))
    FREE(r->kv);
    free(r->k_cache);
    free(r->v_cache);
    FREE(r->a); FREE(r->b); FREE(r->h); FREE(r->qkv); FREE(r->attn); FREE(r->gate_up);
    FREE(r->act); FREE(r->lh); FREE(r->logits); FREE(r->d_ids); FREE(r->d_pos);
    FREE(r->d_slots); FREE(r->d_cu_q); FREE(r->d_ctx); FREE(r->d_bt); FREE(r->d_rows);
    FREE(r->inv_freq);
#undef FREE
    free(r);
}

void mr_set_layer_hook(mr *r, mr_layer_fn fn, void *arg)
{
    r->layer_fn = fn;
    r->layer_arg = arg;
}

int32_t mr_n_blocks(const mr *r) { return r->p.n_blocks; }
int32_t mr_block_size(const mr *r) { return r->p.block_size; }
int32_t mr_max_blocks_per_seq(const mr *r) { return r->max_blocks_per_seq; }
const mr_params *mr_params_get(const mr *r) { return &r->p; }

void mr_kv_pool(const mr *r, void **base, size_t *bytes)
{
    *base = r->kv;
    *bytes = r->kv_layer_elems * 2 * (size_t)r->m->cfg.n_layers *
             pd_dtype_size(r->be->ops->act_dtype);
}

void mr_kv_cache(const mr *r, int32_t layer, void **k, void **v)
{
    *k = r->k_cache[layer];
    *v = r->v_cache[layer];
}

/* Checks everything the kernels index with, so that a bad batch is an error, not a crash. */
static int validate(const mr *r, const mr_batch *b, int32_t *max_q, int32_t *max_ctx, char *err)
{
    const mc_config *c = &r->m->cfg;
    if (b->n_tokens <= 0 || b->n_tokens > r->p.max_num_batched_tokens)
        return pd_errf(err, PD_EINVAL, "batch has %d tokens (allowed 1..%d)", b->n_tokens,
                       r->p.max_num_batched_tokens);
    if (b->n_seqs <= 0 || b->n_seqs > r->p.max_num_seqs)
        return pd_errf(err, PD_EINVAL, "batch has %d sequences (allowed 1..%d)", b->n_seqs,
                       r->p.max_num_seqs);
    if (b->max_blocks_per_seq <= 0 || b->max_blocks_per_seq > r->max_blocks_per_seq)
        return pd_errf(err, PD_EINVAL, "block table width %d (allowed 1..%d)",
                       b->max_blocks_per_seq, r->max_blocks_per_seq);
    if (b->n_logits < 0 || b->n_logits > b->n_tokens)
        return pd_errf(err, PD_EINVAL, "%d logits rows requested for %d tokens", b->n_logits,
                       b->n_tokens);
    if (b->cu_q[0] != 0 || b->cu_q[b->n_seqs] != b->n_tokens)
        return pd_errf(err, PD_EINVAL, "cu_q must start at 0 and end at n_tokens");
    const int64_t n_slots = (int64_t)r->p.n_blocks * r->p.block_size;
    *max_q = 0;
    *max_ctx = 0;
    for (int32_t s = 0; s < b->n_seqs; s++) {
        int32_t q_len = b->cu_q[s + 1] - b->cu_q[s], ctx = b->ctx_lens[s];
        if (q_len <= 0) return pd_errf(err, PD_EINVAL, "sequence %d has no query tokens", s);
        if (ctx < q_len || ctx > c->max_position)
            return pd_errf(err, PD_EINVAL, "sequence %d: context %d is shorter than its %d new "
                           "tokens or longer than the model maximum %d", s, ctx, q_len,
                           c->max_position);
        int32_t need = (ctx + r->p.block_size - 1) / r->p.block_size;
        if (need > b->max_blocks_per_seq)
            return pd_errf(err, PD_EINVAL, "sequence %d needs %d blocks, table holds %d", s,
                           need, b->max_blocks_per_seq);
        const int32_t *bt = b->block_tables + (size_t)s * b->max_blocks_per_seq;
        for (int32_t i = 0; i < need; i++)
            if (bt[i] < 0 || bt[i] >= r->p.n_blocks)
                return pd_errf(err, PD_EINVAL, "sequence %d: block id %d out of range [0, %d)",
                               s, bt[i], r->p.n_blocks);
        for (int32_t i = b->cu_q[s]; i < b->cu_q[s + 1]; i++) {
            int32_t want = ctx - q_len + (i - b->cu_q[s]);
            if (b->positions[i] != want)
                return pd_errf(err, PD_EINVAL, "token row %d: position %d, expected %d", i,
                               b->positions[i], want);
        }
        if (q_len > *max_q) *max_q = q_len;
        if (ctx > *max_ctx) *max_ctx = ctx;
    }
    for (int32_t i = 0; i < b->n_tokens; i++) {
        if (b->input_ids[i] < 0 || b->input_ids[i] >= c->vocab_size)
            return pd_errf(err, PD_EINVAL, "token id %d at row %d is out of range [0, %d)",
                           b->input_ids[i], i, c->vocab_size);
        if (b->slot_mapping[i] >= n_slots)
            return pd_errf(err, PD_EINVAL, "slot %d at row %d is out of range", b->slot_mapping[i], i);
    }
    for (int32_t i = 0; i < b->n_logits; i++)
        if (b->logits_rows[i] < 0 || b->logits_rows[i] >= b->n_tokens)
            return pd_errf(err, PD_EINVAL, "logits row %d out of range", b->logits_rows[i]);
    return 0;
}

#define CALL(expr)                                                                     \
    do {                                                                               \
        int rc_ = (expr);                                                              \
        if (rc_ < 0) return pd_errf(err, rc_, "%s backend: %s failed: %s", be->ops->name, \
                                    #expr, pd_strerror(rc_));                          \
    } while (0)

int mr_forward(mr *r, const mr_batch *b, float *logits, char *err)
{
    int32_t max_q = 0, max_ctx = 0;
    int rc = validate(r, b, &max_q, &max_ctx, err);
    if (rc < 0) return rc;
    pd_backend *be = r->be;
    void *x = be->ctx;
    const pd_backend_ops *o = be->ops;
    const mc_config *c = &r->m->cfg;
    const int32_t T = b->n_tokens, S = b->n_seqs, hs = c->hidden_size, hd = c->head_dim;
    const int32_t nq = c->n_heads * hd, f = c->intermediate_size;
    const size_t es = pd_dtype_size(o->act_dtype);

    CALL(o->upload(x, r->d_ids, PD_DTYPE_I32, 0, b->input_ids, PD_DTYPE_I32, (size_t)T));
    CALL(o->upload(x, r->d_pos, PD_DTYPE_I32, 0, b->positions, PD_DTYPE_I32, (size_t)T));
    CALL(o->upload(x, r->d_slots, PD_DTYPE_I32, 0, b->slot_mapping, PD_DTYPE_I32, (size_t)T));
    CALL(o->upload(x, r->d_cu_q, PD_DTYPE_I32, 0, b->cu_q, PD_DTYPE_I32, (size_t)S + 1));
    CALL(o->upload(x, r->d_ctx, PD_DTYPE_I32, 0, b->ctx_lens, PD_DTYPE_I32, (size_t)S));
    CALL(o->upload(x, r->d_bt, PD_DTYPE_I32, 0, b->block_tables, PD_DTYPE_I32,
                   (size_t)S * b->max_blocks_per_seq));

    pd_attn_args aa = {
        .q = r->qkv, .q_row_stride = r->qkv_dim, .out = r->attn, .cu_q = r->d_cu_q,
        .ctx_lens = r->d_ctx, .block_tables = r->d_bt, .n_seqs = S, .n_tokens = T,
        .max_q_len = max_q, .max_ctx_len = max_ctx, .max_blocks_per_seq = b->max_blocks_per_seq,
        .n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = hd,
        .block_size = r->p.block_size, .sliding_window = c->sliding_window,
        .scale = (float)(1.0 / sqrt((double)hd)),
    };
    pd_rope_args ra = {
        .qkv = r->qkv, .positions = r->d_pos, .slot_mapping = r->d_slots, .inv_freq = r->inv_freq,
        .n_tokens = T, .n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = hd,
        .attn_factor = r->attn_factor,
    };
    int (*attention)(void *, const pd_attn_args *) =
        max_q == 1 ? o->attention_decode : o->attention_prefill;

    CALL(o->embedding(x, r->d_ids, T, r->m->embed, hs, r->a));
    for (int32_t l = 0; l < c->n_layers; l++) {
        const pd_layer_weights *w = &r->m->layers[l];
        /* attention block */
        if (l == 0) CALL(o->rmsnorm(x, r->a, NULL, w->attn_norm, T, hs, c->rms_eps, r->h));
        else CALL(o->rmsnorm(x, r->b, r->a, w->attn_norm, T, hs, c->rms_eps, r->h));
        CALL(o->linear(x, r->h, w->qkv, w->qkv_bias, T, hs, r->qkv_dim, r->qkv));
        if (w->q_norm) {
            CALL(o->head_rmsnorm(x, r->qkv, T, r->qkv_dim, c->n_heads, hd, w->q_norm, c->rms_eps));
            CALL(o->head_rmsnorm(x, (char *)r->qkv + (size_t)nq * es, T, r->qkv_dim,
                                 c->n_kv_heads, hd, w->k_norm, c->rms_eps));
        }
        ra.k_cache = r->k_cache[l];
        ra.v_cache = r->v_cache[l];
        CALL(o->rope_store_kv(x, &ra));
        aa.k_cache = r->k_cache[l];
        aa.v_cache = r->v_cache[l];
        CALL(attention(x, &aa));
        if (r->layer_fn) { /* this layer's KV is stored: a transfer may take it now */
            CALL(o->sync(x));
            r->layer_fn(r->layer_arg, l);
        }
        CALL(o->linear(x, r->attn, w->o_proj, w->o_bias, T, nq, hs, r->b));
        /* MLP block */
        CALL(o->rmsnorm(x, r->b, r->a, w->mlp_norm, T, hs, c->rms_eps, r->h));
        CALL(o->linear(x, r->h, w->gate_up, NULL, T, hs, 2 * f, r->gate_up));
        CALL(o->swiglu(x, r->gate_up, T, f, r->act));
        CALL(o->linear(x, r->act, w->down, NULL, T, f, hs, r->b));
    }
    if (b->n_logits == 0) return 0;
    CALL(o->rmsnorm(x, r->b, r->a, r->m->final_norm, T, hs, c->rms_eps, r->h));
    CALL(o->upload(x, r->d_rows, PD_DTYPE_I32, 0, b->logits_rows, PD_DTYPE_I32,
                   (size_t)b->n_logits));
    for (int32_t i0 = 0; i0 < b->n_logits; i0 += LOGITS_CHUNK) {
        int32_t n = b->n_logits - i0 < LOGITS_CHUNK ? b->n_logits - i0 : LOGITS_CHUNK;
        CALL(o->gather_rows(x, r->h, r->d_rows + i0, n, hs, r->lh));
        CALL(o->linear(x, r->lh, r->m->lm_head, NULL, n, hs, c->vocab_size, r->logits));
        CALL(o->download_f32(x, logits + (size_t)i0 * c->vocab_size, r->logits, o->act_dtype, 0,
                             (size_t)n * c->vocab_size));
    }
    return 0;
}
