/* prefill_main.c -- pdserve-prefill: the prefill instance. Serves the internal Prefill RPC:
 * computes a prompt (batched, chunked, prefix-cached) in a prefill-only engine, samples the
 * first token, pushes the prompt's KV into the blocks a decode instance reserved (kvtransfer),
 * and answers with the first token once the decode side acknowledged the KV. Also LoadReport
 * and health.
 *
 * Threads as in pdserve-decode: gRPC workers, the engine thread, the kvt thread. A request
 * (preq) is referenced by the engine until its terminal callback and by kvtransfer until its
 * event; the call is answered exactly once. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


#include "common/error.h"
#include "common/log.h"
#include "pdserve/internal/v1/prefill.pb-c.h"
#include "svc/svc.h"
#include "svc/svc_kvt.h"
#include "svc/svc_metrics.h"
#include "svc/svc_serve.h"

typedef struct preq {
    atomic_int refs;
    rpc_call *call;
    uint64_t id;
    int32_t n_prompt;
    bool want_logprobs;
    uint64_t reservation_id;       /* decode side's id for the transfer */
    void *desc;                    /* decode pool descriptor (copy) */
    size_t desc_len;
    int32_t *dst_ids;              /* decode block ids (copy) */
    int32_t n_dst;
    int32_t n_skip;                /* leading blocks the decode side holds (its prefix cache):
                                      not sent */
    pthread_mutex_t mu;
    bool answered;
    bool prefilled;                /* the engine holds the blocks until ew_release */
    kvt_send *send;                /* kvt thread only */
    bool layered;                  /* the push began before the forward (layer by layer) */
    int begin_rc;                  /* kvt thread: kvt_send_begin's error, 0 if fine */
    char begin_err[PD_ERR_LEN];
    struct preq *next_in_map;
    int32_t first_token;
    float first_logprob;
    int32_t firsts[ENG_MAX_CHOICES]; /* every choice's first token ([0] = first_token) */
    float first_lps[ENG_MAX_CHOICES];
    int32_t n_first;               /* choices (PrefillRequest.n), >= 1 */
    int32_t n_top;                 /* alternatives asked per token (with want_logprobs) */
    int32_t first_n_top[ENG_MAX_CHOICES]; /* each choice's first token's alternatives: how
                                             many first_top holds */
    pd_top_logprob first_top[ENG_MAX_CHOICES][PD_MAX_TOP_LOGPROBS];
    int32_t n_cached;
    double t_recv, t_prefilled;
} preq;

typedef struct {
    svc_model model;
    ew *worker;
    svc_kvt *kvt;
    kvt_pool *pool;                /* kvt thread only: the engine's KV cache as source */
    rpc_server *server;
    svc_instance inst;
    svc_metrics *metrics;
    atomic_uint_fast64_t next_id;
    int64_t default_max_tokens;
} psvc;

static psvc g;

/* ---- live requests by engine id (the layer hooks name requests by id) ---- */

#define MAP_BUCKETS 1024
static preq *g_map[MAP_BUCKETS];
static pthread_mutex_t g_map_mu = PTHREAD_MUTEX_INITIALIZER;

static void map_add(preq *r)
{
    pthread_mutex_lock(&g_map_mu);
    r->next_in_map = g_map[r->id % MAP_BUCKETS];
    g_map[r->id % MAP_BUCKETS] = r;
    pthread_mutex_unlock(&g_map_mu);
}

static void map_del(preq *r)
{
    pthread_mutex_lock(&g_map_mu);
    for (preq **pp = &g_map[r->id % MAP_BUCKETS]; *pp; pp = &(*pp)->next_in_map)
        if (*pp == r) {
            *pp = r->next_in_map;
            break;
        }
    pthread_mutex_unlock(&g_map_mu);
}

/* Returns the request with a new reference, or NULL. */
static preq *map_get(uint64_t id)
{
    pthread_mutex_lock(&g_map_mu);
    preq *r = g_map[id % MAP_BUCKETS];
    while (r && r->id != id) r = r->next_in_map;
    if (r) atomic_fetch_add(&r->refs, 1);
    pthread_mutex_unlock(&g_map_mu);
    return r;
}

/* Releases a layer's readiness that was not handed on (svc_kv_layer_ready's handle). */
static void release_event(void *ev)
{
    svc_kv_ready_release(&g.model, ev);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void preq_unref(preq *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    pthread_mutex_destroy(&r->mu);
    free(r->desc);
    free(r->dst_ids);
    free(r);
}

/* Answers the call once: with the first token when code is OK, else the error. */
static void answer(preq *r, rpc_status_code code, const char *msg)
{
    pthread_mutex_lock(&r->mu);
    bool already = r->answered;
    r->answered = true;
    pthread_mutex_unlock(&r->mu);
    if (already) return;
    map_del(r);
    svc_metrics_request(g.metrics, code);
    if (code == RPC_STATUS_OK) {
        Pdserve__Internal__V1__PrefillResponse resp = PDSERVE__INTERNAL__V1__PREFILL_RESPONSE__INIT;
        Pdserve__Internal__V1__PrefillTiming tm = PDSERVE__INTERNAL__V1__PREFILL_TIMING__INIT;
        Pdserve__V1__TokenLogprob *lp = NULL, *lpp[ENG_MAX_CHOICES] = {0};
        bool oom = false;
        resp.first_token_id = (uint32_t)r->first_token;
        resp.cached_prompt_tokens = (uint32_t)r->n_cached;
        if (r->want_logprobs) {
            lp = svc_token_logprob_new((uint32_t)r->first_token, r->first_logprob, r->first_top[0],
                                       r->first_n_top[0]);
            resp.first_logprob = lp;
            oom |= !lp;
        }
        uint32_t ids[ENG_MAX_CHOICES];
        if (r->n_first > 1) { /* n choices: each one's first token, with its own logprobs */
            for (int32_t i = 0; i < r->n_first; i++) {
                ids[i] = (uint32_t)r->firsts[i];
                if (r->want_logprobs &&
                    !(lpp[i] = svc_token_logprob_new(ids[i], r->first_lps[i], r->first_top[i],
                                                     r->first_n_top[i])))
                    oom = true;
            }
            resp.n_first_token_ids = (size_t)r->n_first;
            resp.first_token_ids = ids;
            if (r->want_logprobs) {
                resp.n_first_logprobs = (size_t)r->n_first;
                resp.first_logprobs = lpp;
            }
        }
        double t = now_s();
        tm.compute_us = (uint64_t)((r->t_prefilled - r->t_recv) * 1e6);
        tm.transfer_us = (uint64_t)((t - r->t_prefilled) * 1e6);
        tm.total_us = (uint64_t)((t - r->t_recv) * 1e6);
        resp.timing = &tm;
        if (oom)
            rpc_stream_finish(r->call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        else if (rpc_call_reply(r->call, &resp.base) < 0)
            rpc_stream_finish(r->call, RPC_STATUS_INTERNAL, "cannot send the response");
        free(lp);
        for (int32_t i = 0; i < ENG_MAX_CHOICES; i++) free(lpp[i]);
    } else {
        rpc_stream_finish(r->call, code, msg && *msg ? "%s" : NULL, msg);
    }
    rpc_call_unref(r->call);
}

/* ---- kvtransfer (kvt thread) ---- */

typedef struct {
    preq *r;
    int32_t n;
    int32_t src[];
} push_job;

/* Opens the decode side's pool and pushes the prompt's blocks (every layer is ready: the
 * prompt was computed whole), then DONE with the first token. */
static void do_push(kvt_ctx *ctx, void *arg)
{
    (void)ctx;
    push_job *j = arg;
    preq *r = j->r;
    char err[PD_ERR_LEN];
    kvt_target *t = NULL;
    int rc = kvt_target_open(ctx, g.pool, r->desc, r->desc_len, &t, err);
    if (rc == 0) {
        kvt_send_params sp = kvt_send_default_params();
        sp.req_id = r->reservation_id;
        sp.n_blocks = j->n - r->n_skip; /* the decode side has the cached prefix */
        sp.src_ids = j->src + r->n_skip;
        sp.dst_ids = r->dst_ids + r->n_skip;
        sp.user = r;
        rc = kvt_send_begin(t, &sp, &r->send, err);
        kvt_target_close(t);
    }
    if (rc == 0) {
        atomic_fetch_add(&r->refs, 1); /* the transfer's own reference: its event drops it */
        for (int32_t l = 0; l < g.model.cfg.n_layers && rc == 0; l++)
            rc = kvt_send_layer_ready(r->send, l);
        if (rc == 0) rc = kvt_send_finish_n(r->send, r->firsts, r->n_first);
        /* On a failure here the transfer's SEND_FAILED event follows and finishes the work. */
        preq_unref(r); /* the engine's reference, carried by this job */
        free(j);
        return;
    }
    PD_LOGW("request %llu: KV push failed: %s", (unsigned long long)r->id, err);
    ew_release(g.worker, r->id);
    answer(r, svc_status_for(rc), err);
    preq_unref(r);
    free(j);
}

/* Layer-by-layer path. begin: before the forward that completes the prompt. */
typedef struct {
    preq *r;
    int32_t n;
    int32_t src[];
} begin_job;

static void do_begin(kvt_ctx *ctx, void *arg)
{
    begin_job *j = arg;
    preq *r = j->r;
    kvt_target *t = NULL;
    r->begin_rc = kvt_target_open(ctx, g.pool, r->desc, r->desc_len, &t, r->begin_err);
    if (r->begin_rc == 0 && j->n != r->n_dst) {
        r->begin_rc = pd_errf(r->begin_err, PD_EINVAL, "kv_target has %d block ids; the prompt "
                              "needs %d", r->n_dst, j->n);
    }
    if (r->begin_rc == 0) {
        kvt_send_params sp = kvt_send_default_params();
        sp.req_id = r->reservation_id;
        sp.n_blocks = j->n - r->n_skip; /* the decode side has the cached prefix */
        sp.src_ids = j->src + r->n_skip;
        sp.dst_ids = r->dst_ids + r->n_skip;
        sp.user = r;
        r->begin_rc = kvt_send_begin(t, &sp, &r->send, r->begin_err);
        if (r->begin_rc == 0) atomic_fetch_add(&r->refs, 1); /* the transfer's own reference */
    }
    kvt_target_close(t);
    preq_unref(r);
    free(j);
}

typedef struct {
    int32_t layer, n;
    uint64_t *ids;   /* [n] requests whose layer is ready */
    void **after;    /* [n] the layer's event (staged KV: the copies wait on it), or NULL */
} layer_job;

static void layer_job_free(layer_job *j)
{
    for (int32_t i = 0; i < j->n; i++) release_event(j->after[i]);
    free(j);
}

static void do_layer(kvt_ctx *ctx, void *arg)
{
    (void)ctx;
    layer_job *j = arg;
    for (int32_t i = 0; i < j->n; i++) {
        preq *r = map_get(j->ids[i]);
        if (r && r->send) { /* failures come as events; kvt owns the event from here */
            kvt_send_layer_ready_after(r->send, j->layer, j->after[i]);
            j->after[i] = NULL;
        }
        if (r) preq_unref(r);
    }
    layer_job_free(j);
}

/* The engine's callbacks for the layered path (engine thread). */
static uint64_t g_step_ids[4096];
static int32_t g_step_n;
static bool g_staged; /* the KV is device memory: each layer's readiness is an event */

static void on_prompt_step(void *arg, const uint64_t *ids, const int32_t *const *blocks,
                           const int32_t *n_blocks, int32_t n)
{
    (void)arg;
    g_step_n = 0;
    for (int32_t i = 0; i < n; i++) {
        preq *r = map_get(ids[i]);
        if (!r) continue;
        begin_job *j = malloc(sizeof *j + (size_t)n_blocks[i] * sizeof(int32_t));
        if (!j) {
            preq_unref(r);
            continue; /* falls back to the whole-prompt push after the forward */
        }
        j->r = r; /* the map's reference passes to the job */
        j->n = n_blocks[i];
        memcpy(j->src, blocks[i], (size_t)n_blocks[i] * sizeof(int32_t));
        r->layered = true;
        if (svc_kvt_post(g.kvt, do_begin, j) < 0) {
            r->layered = false;
            free(j);
            preq_unref(r);
            continue;
        }
        if (g_step_n < (int32_t)(sizeof g_step_ids / sizeof g_step_ids[0]))
            g_step_ids[g_step_n++] = ids[i];
        PD_LOGD("request %llu: pushing KV layer by layer during its last prompt step",
                (unsigned long long)ids[i]);
    }
}

static void on_layer(void *arg, int32_t layer)
{
    (void)arg;
    if (g_step_n == 0) return;
    layer_job *j = calloc(1, sizeof *j + (size_t)g_step_n * (sizeof(uint64_t) + sizeof(void *)));
    if (!j) return; /* that layer is then missing: its transfer fails by its deadline */
    j->layer = layer;
    j->n = g_step_n;
    j->ids = (uint64_t *)(j + 1);
    j->after = (void **)(j->ids + g_step_n);
    memcpy(j->ids, g_step_ids, (size_t)g_step_n * sizeof(uint64_t));
    /* GPU KV (device path or the staging ring) and tensor parallelism: an event after the
     * layer's store (every rank's own, with tensor parallelism); the copies wait on the
     * device, nothing waits here. (A single-rank CPU pool's KV is final when this runs.) */
    if (g_staged && svc_kv_layer_ready(&g.model, layer, g_step_n, j->after) > 0)
        for (int32_t i = 0; i < g_step_n; i++)
            if (!j->after[i]) j->ids[i] = 0; /* its transfer then fails by its deadline */
    if (svc_kvt_post(g.kvt, do_layer, j) < 0) layer_job_free(j);
}

/* After the forward: every layer was handed over; send DONE with the first token. Carries the
 * engine's reference. The transfer may already have ended (its event came early, e.g. the
 * decode side cancelled): then the blocks are released and the answer given here. */
static void do_finish(kvt_ctx *ctx, void *arg)
{
    (void)ctx;
    preq *r = arg;
    if (r->send) {
        if (kvt_send_finish_n(r->send, r->firsts, r->n_first) != 0)
            kvt_send_cancel(r->send); /* its SEND_FAILED event answers and releases */
    } else {
        ew_release(g.worker, r->id);
        if (r->begin_rc != 0)
            PD_LOGW("request %llu: KV push failed: %s", (unsigned long long)r->id, r->begin_err);
        answer(r, r->begin_rc ? svc_status_for(r->begin_rc) : RPC_STATUS_UNAVAILABLE,
               r->begin_rc ? r->begin_err : "the KV transfer ended early");
    }
    preq_unref(r);
}

/* Client cancel after the prompt was done (consumes the caller's extra reference). */
static void do_cancel_send(kvt_ctx *ctx, void *arg)
{
    (void)ctx;
    preq *r = arg;
    if (r->send) kvt_send_cancel(r->send); /* SEND_FAILED follows: it answers and unrefs */
    preq_unref(r);
}

/* The engine aborted a request whose layered push began (consumes the engine's reference). */
static void do_abort_push(kvt_ctx *ctx, void *arg)
{
    (void)ctx;
    preq *r = arg;
    if (r->send) {
        kvt_send_cancel(r->send); /* its SEND_FAILED event answers */
    } else {
        ew_release(g.worker, r->id);
        answer(r, RPC_STATUS_CANCELLED, "request cancelled");
    }
    preq_unref(r); /* the engine's reference */
}

static void on_kvt_event(void *arg, const kvt_event *ev)
{
    (void)arg;
    preq *r = ev->user;
    if (!r) return;
    ew_release(g.worker, r->id); /* the source blocks may be reused now */
    if (ev->type == KVT_EV_SEND_DONE) {
        PD_LOGD("request %llu: KV pushed (%llu bytes, %.2f ms)", (unsigned long long)r->id,
                (unsigned long long)ev->bytes, ev->elapsed_ns / 1e6);
        svc_metrics_kv_transfer(g.metrics, (double)ev->elapsed_ns * 1e-9);
        svc_metrics_kv_path(g.metrics, kvt_path_name(ev->path));
        if (r->t_prefilled > 0) svc_metrics_kv_tail(g.metrics, now_s() - r->t_prefilled);
        answer(r, RPC_STATUS_OK, NULL);
    } else {
        char msg[PD_ERR_LEN];
        snprintf(msg, sizeof msg, "KV transfer to the decode instance failed: %.400s", ev->detail);
        answer(r, ev->status == PD_ECANCELED ? RPC_STATUS_CANCELLED : svc_status_for(ev->status), msg);
    }
    kvt_send_destroy(r->send);
    r->send = NULL;
    preq_unref(r); /* the transfer's reference */
}

/* ---- engine callbacks (engine thread) ---- */

static void on_output(void *user, const eng_output *o)
{
    preq *r = user;
    if (o->finish != SEQ_FINISH_PREFILLED) {
        /* Aborted (client gone, or the forward failed) before the prompt was done. */
        if (r->layered) { /* a push began: cancel it; its event answers */
            if (svc_kvt_post(g.kvt, do_abort_push, r) == 0) return;
        }
        answer(r, RPC_STATUS_CANCELLED, "request cancelled");
        preq_unref(r);
        return;
    }
    svc_metrics_queue_time(g.metrics, o->queue_s);
    r->first_token = r->firsts[0] = o->token;
    r->first_logprob = r->first_lps[0] = o->logprob;
    r->first_n_top[0] = o->n_top < r->n_top ? o->n_top : r->n_top;
    if (r->first_n_top[0] > 0)
        memcpy(r->first_top[0], o->top, (size_t)r->first_n_top[0] * sizeof *o->top);
    if (o->choice_tokens && o->n_choices == r->n_first) { /* n choices: one token each */
        memcpy(r->firsts, o->choice_tokens, (size_t)r->n_first * sizeof *r->firsts);
        if (o->choice_logprobs)
            memcpy(r->first_lps, o->choice_logprobs, (size_t)r->n_first * sizeof *r->first_lps);
        for (int32_t c = 0; c < r->n_first; c++) { /* and its own alternatives */
            const int32_t n = o->choice_n_top ? o->choice_n_top[c] : 0;
            r->first_n_top[c] = n < r->n_top ? n : r->n_top;
            if (r->first_n_top[c] > 0)
                memcpy(r->first_top[c], o->choice_top + (size_t)c * PD_MAX_TOP_LOGPROBS,
                       (size_t)r->first_n_top[c] * sizeof *o->choice_top);
        }
    }
    r->n_cached = o->n_cached;
    r->t_prefilled = now_s();
    if (r->layered) {
        pthread_mutex_lock(&r->mu);
        r->prefilled = true;
        pthread_mutex_unlock(&r->mu);
        if (svc_kvt_post(g.kvt, do_finish, r) == 0) return; /* the engine's reference moves */
        ew_release(g.worker, r->id);
        answer(r, RPC_STATUS_UNAVAILABLE, "shutting down");
        preq_unref(r);
        return;
    }
    if (o->n_blocks != r->n_dst) {
        ew_release(g.worker, r->id);
        char msg[128];
        snprintf(msg, sizeof msg, "kv_target has %d block ids; the prompt needs %d", r->n_dst, o->n_blocks);
        answer(r, RPC_STATUS_INVALID_ARGUMENT, msg);
        preq_unref(r);
        return;
    }
    push_job *j = malloc(sizeof *j + (size_t)o->n_blocks * sizeof(int32_t));
    if (!j) {
        ew_release(g.worker, r->id);
        answer(r, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        preq_unref(r);
        return;
    }
    pthread_mutex_lock(&r->mu);
    r->prefilled = true;
    pthread_mutex_unlock(&r->mu);
    j->r = r;
    j->n = o->n_blocks;
    memcpy(j->src, o->block_ids, (size_t)o->n_blocks * sizeof(int32_t));
    /* The engine's reference passes to the push job (and then to kvtransfer's event). */
    if (svc_kvt_post(g.kvt, do_push, j) < 0) {
        free(j);
        ew_release(g.worker, r->id);
        answer(r, RPC_STATUS_UNAVAILABLE, "shutting down");
        preq_unref(r);
    }
}

static void on_error(void *user, int code, const char *msg)
{
    preq *r = user;
    answer(r, svc_status_for(code), msg);
    preq_unref(r);
}

static void on_cancel(rpc_call *call, void *user)
{
    (void)call;
    preq *r = user;
    pthread_mutex_lock(&r->mu);
    bool prefilled = r->prefilled;
    pthread_mutex_unlock(&r->mu);
    if (!prefilled) {
        ew_abort(g.worker, r->id);
        return;
    }
    atomic_fetch_add(&r->refs, 1);
    if (svc_kvt_post(g.kvt, do_cancel_send, r) < 0) preq_unref(r);
}

static bool layout_matches(const Pdserve__Internal__V1__KvLayout *l, char *msg, size_t n)
{
    Pdserve__Internal__V1__KvLayout mine;
    svc_kv_layout_to_proto(&g.model, &mine);
    if (!l) {
        snprintf(msg, n, "kv_target.layout is missing");
        return false;
    }
    if (l->block_size != mine.block_size || l->dtype != mine.dtype ||
        l->num_layers != mine.num_layers || l->num_kv_heads != mine.num_kv_heads ||
        l->head_dim != mine.head_dim || l->model_fingerprint != mine.model_fingerprint) {
        snprintf(msg, n, "KV layout mismatch: decode has block %u, dtype %s, %u layers, %u kv "
                 "heads, head dim %u, model %016llx; this prefill instance has %u, %s, %u, %u, "
                 "%u, %016llx%s", l->block_size, svc_kv_dtype_name(l->dtype), l->num_layers,
                 l->num_kv_heads, l->head_dim, (unsigned long long)l->model_fingerprint,
                 mine.block_size, svc_kv_dtype_name(mine.dtype), mine.num_layers,
                 mine.num_kv_heads, mine.head_dim, (unsigned long long)mine.model_fingerprint,
                 l->dtype != mine.dtype ? " (the KV dtype is --kv-cache-dtype on the backend's "
                 "type: prefill and decode must run the same --backend and the same "
                 "--kv-cache-dtype, e.g. both cuda with fp8)" : "");
        return false;
    }
    /* the degrees need not match (the whole layout moves, each side converts to its ranks),
     * but the decode side's head mapping must be one this instance knows */
    if (svc_kv_layout_check_peer(l, msg, n) < 0) return false;
    return true;
}

static void handle_prefill(rpc_call *call, const ProtobufCMessage *msg, void *user)
{
    (void)user;
    const Pdserve__Internal__V1__PrefillRequest *q = (const Pdserve__Internal__V1__PrefillRequest *)msg;
    char err[PD_ERR_LEN];
    eng_request er;
    memset(&er, 0, sizeof er);
    if (svc_instance_refuse_failed(&g.inst, call)) return;
    /* the public API's checks and limits (an internal port is no way around them) */
    const svc_request_fields f = {q->request_id, q->prompt_token_ids, q->n_prompt_token_ids,
                                  q->sampling, q->stopping, q->logprobs, q->n};
    if (svc_request_check(&f, g.model.cfg.vocab_size, g.model.cfg.max_position, ENG_MAX_CHOICES,
                          (int32_t)g.default_max_tokens, &er.sampling, &er.stop, err) < 0) {
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT, "%s", err);
        return;
    }
    if (!q->kv_target || q->kv_target->kv_descriptor.len == 0 || q->kv_target->n_block_ids == 0) {
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT, "kv_target (descriptor and block ids) is required");
        return;
    }
    if (q->kv_target->cached_blocks >= q->kv_target->n_block_ids) {
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT, "kv_target.cached_blocks (%u) must "
                          "be less than its %zu block ids", q->kv_target->cached_blocks,
                          q->kv_target->n_block_ids);
        return;
    }
    if (!layout_matches(q->kv_target->layout, err, sizeof err)) {
        rpc_stream_finish(call, RPC_STATUS_FAILED_PRECONDITION, "%s", err);
        return;
    }
    preq *r = calloc(1, sizeof *r);
    int32_t *prompt = malloc(q->n_prompt_token_ids * sizeof *prompt);
    if (r) {
        r->desc = malloc(q->kv_target->kv_descriptor.len);
        r->dst_ids = malloc(q->kv_target->n_block_ids * sizeof *r->dst_ids);
    }
    if (!r || !prompt || !r->desc || !r->dst_ids) {
        if (r) {
            free(r->desc);
            free(r->dst_ids);
        }
        free(r);
        free(prompt);
        rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    for (size_t i = 0; i < q->n_prompt_token_ids; i++) {
        uint32_t t = q->prompt_token_ids[i];
        prompt[i] = t > (uint32_t)INT32_MAX ? -1 : (int32_t)t;
    }
    memcpy(r->desc, q->kv_target->kv_descriptor.data, q->kv_target->kv_descriptor.len);
    r->desc_len = q->kv_target->kv_descriptor.len;
    for (size_t i = 0; i < q->kv_target->n_block_ids; i++)
        r->dst_ids[i] = q->kv_target->block_ids[i] > (uint32_t)INT32_MAX ? -1 : (int32_t)q->kv_target->block_ids[i];
    r->n_dst = (int32_t)q->kv_target->n_block_ids;
    r->n_skip = (int32_t)q->kv_target->cached_blocks;
    r->reservation_id = q->kv_target->reservation_id;
    atomic_init(&r->refs, 2); /* the engine's reference + this handler's */
    pthread_mutex_init(&r->mu, NULL);
    r->id = atomic_fetch_add(&g.next_id, 1);
    r->call = call;
    r->n_prompt = (int32_t)q->n_prompt_token_ids;
    r->want_logprobs = q->logprobs > 0;
    r->n_top = (int32_t)q->logprobs;
    r->n_first = q->n > 1 ? (int32_t)q->n : 1;
    r->t_recv = now_s();
    rpc_call_ref(call);
    map_add(r);
    er.id = r->id;
    er.prompt = prompt;
    er.n_prompt = r->n_prompt;
    er.logprobs = r->want_logprobs;
    er.top_logprobs = r->n_top;
    er.n = r->n_first;
    int rc = ew_submit(g.worker, &er, r);
    free(prompt);
    if (rc < 0) {
        answer(r, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        preq_unref(r);
        preq_unref(r);
        return;
    }
    /* r is alive here (this handler's reference) even if the engine already answered: then
     * no callback is armed (the call was finished). */
    rpc_call_set_cancel_cb(call, on_cancel, r);
    preq_unref(r);
}

int main(int argc, char **argv)
{
    svc_block_signals();
    svc_model_flags mf;
    svc_model_flags_init(&mf);
    svc_server_flags sf;
    svc_server_flags_init(&sf, "0.0.0.0:50071");
    int64_t metrics_port = -1;
    pd_flag flags[48];
    int n = 0;
    svc_model_flags_add(&mf, flags, &n);
    svc_server_flags_add(&sf, flags, &n, "prefill");
    svc_metrics_flag_add(&metrics_port, flags, &n);
    int prc = pd_flags_parse(flags, n, argc, argv, "pdserve-prefill",
                             "The prefill instance of pdserve: computes prompts and pushes their "
                             "KV to decode instances (internal Prefill RPC).");
    if (prc != 0) {
        pd_flags_free();
        return prc > 0 ? 0 : 2;
    }
    svc_server_flags_apply(&sf);
    const char *listen = sf.listen;
    char err[PD_ERR_LEN];
    int status = 1;
    g.default_max_tokens = sf.default_max_tokens;
    atomic_init(&g.next_id, 1);
    svc_metrics_params mp = {"prefill", "send", listen, metrics_port};
    if (svc_metrics_create(&mp, &g.metrics, err) < 0) {
        fprintf(stderr, "pdserve-prefill: %s\n", err);
        goto out;
    }
    if (svc_model_open(&mf, ENG_MODE_PREFILL, &g.model, err) < 0) {
        fprintf(stderr, "pdserve-prefill: %s\n", err);
        goto out;
    }
    svc_model_info_metric(&g.model, svc_metrics_registry(g.metrics));
    g_staged = svc_kv_staged(&g.model);
    eng_kv_listener kl = {on_prompt_step, on_layer, NULL};
    g.inst.metrics = g.metrics;
    ew_callbacks cb = {.on_output = on_output, .on_error = on_error,
                       .on_step = svc_instance_on_step,
                       .on_step_failed = svc_instance_on_step_failed, .step_arg = &g.inst};
    if (svc_engine_start(&g.model, ENG_MODE_PREFILL, &kl, &cb, &g.worker, err) < 0 ||
        svc_kvt_start("prefill", on_kvt_event, NULL, &g.model, &g.kvt, &g.pool, err) < 0) {
        fprintf(stderr, "pdserve-prefill: %s\n", err);
        goto out;
    }
    g.inst.role = PDSERVE__INTERNAL__V1__ROLE__ROLE_PREFILL;
    g.inst.model = &g.model;
    g.inst.worker = g.worker;
    svc_serve_params vp = {"prefill", NULL, &sf, &pdserve__internal__v1__prefill__descriptor,
                           "Prefill", RPC_UNARY, handle_prefill, 0, NULL, NULL};
    if (svc_serve(&vp, &g.inst, g.metrics, g.kvt, &g.server, err) < 0) {
        fprintf(stderr, "pdserve-prefill: %s\n", err);
        goto out;
    }
    status = 0;
out:
    svc_metrics_stop(g.metrics); /* before its sources go */
    rpc_server_destroy(g.server);
    ew_destroy(g.worker);
    svc_kvt_stop(g.kvt, &g.model, &g.pool);
    svc_metrics_destroy(g.metrics); /* after the engine thread (its step hook) */
    svc_model_close(&g.model);
    pd_flags_free();
    return status;
}
