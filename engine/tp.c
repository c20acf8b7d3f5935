/* tp.c -- Rank threads (a generation counter under one mutex: a run publishes its job and
 * wakes them; each runs it and counts itself done), each layer's KV readiness on every rank
 * (a counter a rank under one mutex) and the loading of a model on n ranks. */
#include "engine/tp.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"

struct tp_pool {
    int32_t n_ranks;
    pthread_t *threads;          /* [n_ranks]; [0] unused (rank 0 is the caller) */
    int32_t n_started;           /* threads running */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t generation;         /* jobs published */
    int32_t n_done;              /* ranks 1.. that finished the current job */
    bool stop;
    tp_fn fn;
    void *arg;
    int *rc;                     /* [n_ranks] the current job's returns */
};

typedef struct {
    tp_pool *p;
    int32_t rank;
} worker_arg;

static void *worker(void *a)
{
    worker_arg w = *(worker_arg *)a;
    free(a);
    tp_pool *p = w.p;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->go, &p->mu);
        if (p->stop) break;
        seen = p->generation;
        tp_fn fn = p->fn;
        void *arg = p->arg;
        pthread_mutex_unlock(&p->mu);
        int rc = fn(arg, w.rank);
        pthread_mutex_lock(&p->mu);
        p->rc[w.rank] = rc;
        if (++p->n_done == p->n_ranks - 1) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int tp_pool_create(int32_t n_ranks, tp_pool **out, char *err)
{
    *out = NULL;
    if (n_ranks < 1 || n_ranks > 1024)
        return pd_errf(err, PD_EINVAL, "tensor parallel: %d ranks (allowed 1..1024)", n_ranks);
    tp_pool *p = calloc(1, sizeof *p);
    if (!p) return pd_errf(err, PD_ENOMEM, "out of memory");
    p->n_ranks = n_ranks;
    p->threads = calloc((size_t)n_ranks, sizeof *p->threads);
    p->rc = calloc((size_t)n_ranks, sizeof *p->rc);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    if (!p->threads || !p->rc) {
        tp_pool_destroy(p);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    for (int32_t r = 1; r < n_ranks; r++) {
        worker_arg *w = malloc(sizeof *w);
        if (w) *w = (worker_arg){p, r};
        if (!w || pthread_create(&p->threads[r], NULL, worker, w) != 0) {
            free(w);
            tp_pool_destroy(p);
            return pd_errf(err, PD_ENOMEM, "tensor parallel: cannot start the thread of rank %d",
                           r);
        }
        p->n_started++;
    }
    *out = p;
    return 0;
}

void tp_pool_destroy(tp_pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int32_t r = 1; r <= p->n_started; r++) pthread_join(p->threads[r], NULL);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->go);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p->rc);
    free(p);
}

int32_t tp_pool_size(const tp_pool *p) { return p->n_ranks; }

int tp_pool_run(tp_pool *p, tp_fn fn, void *arg, int32_t *rank_out)
{
    if (rank_out) *rank_out = -1;
    if (p->n_ranks > 1) {
        pthread_mutex_lock(&p->mu);
        p->fn = fn;
        p->arg = arg;
        p->n_done = 0;
        p->generation++;
        pthread_cond_broadcast(&p->go);
        pthread_mutex_unlock(&p->mu);
    }
    p->rc[0] = fn(arg, 0);
    if (p->n_ranks > 1) {
        pthread_mutex_lock(&p->mu);
        while (p->n_done < p->n_ranks - 1) pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    for (int32_t r = 0; r < p->n_ranks; r++)
        if (p->rc[r] < 0) {
            if (rank_out) *rank_out = r;
            return p->rc[r];
        }
    return 0;
}

struct tp_lsync {
    int32_t n_ranks, n_layers;
    pd_backend *const *be;       /* [n_ranks] (borrowed) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t *stored;             /* [n_ranks] layers rank r marked stored in this forward */
    bool failed;                 /* a rank failed in this forward */
    void **ev;                   /* [n_layers][n_ranks] rank r's event of the layer, or NULL */
};

int tp_lsync_create(int32_t n_ranks, int32_t n_layers, pd_backend *const *be, tp_lsync **out,
                    char *err)
{
    *out = NULL;
    if (n_ranks < 1 || n_layers < 1 || !be)
        return pd_errf(err, PD_EINVAL, "tensor parallel: %d ranks of %d layers", n_ranks,
                       n_layers);
    tp_lsync *s = calloc(1, sizeof *s);
    if (!s) return pd_errf(err, PD_ENOMEM, "out of memory");
    s->n_ranks = n_ranks;
    s->n_layers = n_layers;
    s->be = be;
    s->stored = calloc((size_t)n_ranks, sizeof *s->stored);
    s->ev = calloc((size_t)n_ranks * (size_t)n_layers, sizeof *s->ev);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (!s->stored || !s->ev) {
        tp_lsync_destroy(s);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    *out = s;
    return 0;
}

/* Releases the events nobody took (no rank running). */
static void lsync_drop(tp_lsync *s)
{
    for (int32_t l = 0; l < s->n_layers; l++)
        for (int32_t r = 0; r < s->n_ranks; r++) {
            void **e = &s->ev[(size_t)l * (size_t)s->n_ranks + (size_t)r];
            if (*e && s->be[r]->ops->event_release) s->be[r]->ops->event_release(s->be[r]->ctx, *e);
            *e = NULL;
        }
}

void tp_lsync_destroy(tp_lsync *s)
{
    if (!s) return;
    if (s->ev) lsync_drop(s);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s->stored);
    free(s->ev);
    free(s);
}

void tp_lsync_reset(tp_lsync *s)
{
    lsync_drop(s);
    memset(s->stored, 0, (size_t)s->n_ranks * sizeof *s->stored);
    s->failed = false;
}

void tp_lsync_stored(tp_lsync *s, int32_t rank, int32_t layer)
{
    if (rank < 0 || rank >= s->n_ranks || layer < 0 || layer >= s->n_layers) return;
    const pd_backend *b = s->be[rank];
    void *e = NULL;
    if (b->ops->event_record && b->ops->event_record(b->ctx, &e) < 0) {
        PD_LOGE("tensor parallel rank %d: cannot record layer %d's KV event", rank, layer);
        e = NULL;
    }
    pthread_mutex_lock(&s->mu);
    s->ev[(size_t)layer * (size_t)s->n_ranks + (size_t)rank] = e;
    s->stored[rank] = layer + 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

bool tp_lsync_wait(tp_lsync *s, int32_t layer)
{
    pthread_mutex_lock(&s->mu);
    for (;;) {
        int32_t r = 0;
        while (r < s->n_ranks && s->stored[r] > layer) r++;
        if (s->failed || r == s->n_ranks) break;
        pthread_cond_wait(&s->cv, &s->mu);
    }
    const bool ok = !s->failed;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

void tp_lsync_fail(tp_lsync *s)
{
    pthread_mutex_lock(&s->mu);
    s->failed = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

int tp_lsync_take(tp_lsync *s, int32_t layer, void **ev)
{
    if (layer < 0 || layer >= s->n_layers) return PD_EINVAL;
    pthread_mutex_lock(&s->mu);
    void **row = &s->ev[(size_t)layer * (size_t)s->n_ranks];
    bool all = true;
    for (int32_t r = 0; r < s->n_ranks; r++) {
        ev[r] = row[r];
        row[r] = NULL;
        all = all && ev[r];
    }
    pthread_mutex_unlock(&s->mu);
    if (all) return 0;
    for (int32_t r = 0; r < s->n_ranks; r++) {
        if (ev[r] && s->be[r]->ops->event_release) s->be[r]->ops->event_release(s->be[r]->ctx, ev[r]);
        ev[r] = NULL;
    }
    return PD_EBACKEND;
}

int tp_group_load(const tp_group_params *p, tp_group **out, char *err)
{
    *out = NULL;
    const int32_t R = p->n_ranks;
    int rc;
    pd_shard sh;
    if (R < 1) return pd_errf(err, PD_EINVAL, "tensor parallel: %d ranks", R);
    /* refused before any backend exists: a model that does not divide */
    if ((rc = pd_shard_of(p->cfg, 0, R, &sh, err)) < 0) return rc;
    tp_group *g = calloc(1, sizeof *g);
    if (!g) return pd_errf(err, PD_ENOMEM, "out of memory");
    g->n_ranks = R;
    g->be = calloc((size_t)R, sizeof *g->be);
    g->models = calloc((size_t)R, sizeof *g->models);
    if (!g->be || !g->models) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    for (int32_t r = 0; r < R; r++) {
        pd_backend_params bp = p->bp;
        bp.device = p->bp.device + r;
        if ((rc = pd_backend_create(p->backend, &bp, &g->be[r], err)) < 0) goto fail;
        if (r > 0 && g->be[r]->ops != g->be[0]->ops) { /* "auto" can't differ, but be sure */
            rc = pd_errf(err, PD_EINVAL, "tensor parallel: rank %d got the %s backend, rank 0 "
                         "the %s", r, g->be[r]->ops->name, g->be[0]->ops->name);
            goto fail;
        }
    }
    if (R > 1 && (rc = pd_comm_create(g->be, R, &g->comm, err)) < 0) goto fail;
    for (int32_t r = 0; r < R; r++)
        if ((rc = pd_model_load_shard(p->cfg, p->dir, p->fmt, p->seed, g->be[r], r, R,
                                      &g->models[r], err)) < 0)
            goto fail;
    if (R > 1)
        PD_LOGI("tensor parallel %d on %s: %d of %d query heads, %d of %d KV heads%s and %d of %d "
                "MLP columns a rank", R, g->be[0]->ops->name, sh.n_heads, p->cfg->n_heads,
                sh.n_kv_heads, p->cfg->n_kv_heads,
                p->cfg->n_kv_heads < R ? " (replicated)" : "", sh.intermediate,
                p->cfg->intermediate_size);
    if (R > 1 && p->cfg->n_experts > 0)
        PD_LOGI("tensor parallel %d: %d of %d columns of each of the %d experts a rank, the "
                "routers whole", R, sh.moe_intermediate, p->cfg->moe_intermediate,
                p->cfg->n_experts);
    *out = g;
    return 0;
fail:
    tp_group_destroy(g);
    return rc;
}

void tp_group_destroy(tp_group *g)
{
    if (!g) return;
    if (g->models)
        for (int32_t r = 0; r < g->n_ranks; r++) pd_model_destroy(g->models[r]);
    pd_comm_destroy(g->comm);
    if (g->be)
        for (int32_t r = 0; r < g->n_ranks; r++) pd_backend_destroy(g->be[r]);
    free(g->models);
    free(g->be);
    free(g);
}
