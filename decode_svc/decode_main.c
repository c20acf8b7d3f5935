/* decode_main.c -- pdserve-decode: the decode instance. Serves the internal Decode RPC:
 * reserves KV blocks for a request, lands its KV from a prefill instance over kvtransfer,
 * decodes it with continuous batching and streams the tokens; with --colocated (or a
 * request's local_prefill) it computes the prompt itself. Also LoadReport and health.
 *
 * Threads: gRPC workers run the handlers; the engine thread owns the engine (engine/worker.h)
 * and runs the output callbacks, which stream to the calls; the kvt thread owns the UCX
 * context and runs the transfer events. A request (dreq) is reference counted by whoever may
 * still reach it: the engine (until its terminal callback) and kvtransfer (until its event).
 *
 * EndChoice (the router ends one choice of n at a stop string) finds a request by the end_key
 * its Decode call carried, in a table whose mutex is a leaf lock: a lookup takes a reference
 * only while the count is above zero, and the last unref removes the request under the same
 * mutex before freeing it, so a lookup never revives a request being freed. The engine thread
 * then ends the choice by id (ew_end_choice), which ignores ids and choices that have ended:
 * whichever comes first of the choice's own end, the call's end, a cancel, a deadline or the
 * EndChoice, the choice ends once and its blocks are freed once. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"
#include "pdserve/internal/v1/decode.pb-c.h"
#include "svc/svc.h"
#include "svc/svc_auth.h"
#include "svc/svc_kvt.h"
#include "svc/svc_metrics.h"
#include "svc/svc_serve.h"

/* A token's log-probabilities while it waits to be sent. */
typedef struct {
    float lp;
    int32_t n_top;
    pd_top_logprob top[PD_MAX_TOP_LOGPROBS];
} pend_lp;

typedef struct dreq {
    atomic_int refs;
    rpc_call *call;             /* our reference, dropped when the request is freed: a send
                                   after the call was finished is refused (PD_ESTATE), never
                                   a use after free */
    uint64_t id;                /* engine and kvtransfer request id */
    int32_t n_prompt;
    bool local_prefill;
    bool want_logprobs;
    int32_t n_top;              /* alternatives asked per token (with want_logprobs) */
    bool queue_seen;            /* its queue time was observed (engine thread) */
    pthread_mutex_t mu;
    bool finished;              /* the call got its status */
    int err_code;               /* rpc status to end with after an abort (0 = CANCELLED) */
    char err_msg[PD_ERR_LEN];
    /* kvt thread only: */
    bool kv_expected;           /* a kvt reservation exists and has not ended */
    bool cancelled;             /* the call was cancelled: no reservation starts any more */
    /* Reservation limits (guarded by g.resv_mu): */
    int32_t resv_blocks;        /* blocks counted against the limits; 0 = none held */
    int resv_caller;            /* its slot in g.callers */
    int32_t n_choices;          /* DecodeRequest.n (>= 1): each choice streams its own bursts */
    /* EndChoice (under g.keys_mu): */
    uint64_t end_key;           /* DecodeRequest.end_key; 0 = not in the table */
    char peer[64];              /* the Decode caller's host: only it may end choices */
    char who[SVC_IDENTITY_LEN]; /* the caller's identity (svc_auth.h): its reservation share */
    struct dreq *key_next;      /* its bucket's chain */
    struct dchoice {            /* engine thread only */
        uint32_t *pend;         /* tokens not yet sent (the stream queue was full) */
        pend_lp *pend_lp;       /* their logprobs (when asked) */
        size_t n_pend, cap_pend;
    } ch[ENG_MAX_CHOICES];
} dreq;

/* Buckets of the end_key table (a chain each). */
#define KEY_BUCKETS 1024

/* Reserved blocks per caller (its identity: svc_auth.h), for the per-caller limit. */
#define MAX_CALLERS 256
typedef struct {
    char host[SVC_IDENTITY_LEN]; /* the caller's identity (svc_auth_identity) */
    int64_t blocks;             /* blocks of this caller's reservations waiting for KV */
    int64_t n;                  /* those reservations */
} caller_slot;

typedef struct {
    svc_model model;
    ew *worker;
    svc_kvt *kvt;
    kvt_pool *pool;             /* kvt thread only */
    void *desc;                 /* exported pool descriptor */
    size_t desc_len;
    rpc_server *server;
    svc_instance inst;
    svc_metrics *metrics;
    pd_metric *m_resv_refused;
    atomic_uint_fast64_t next_id;
    int64_t default_max_tokens;
    bool colocated;
    bool auth_secret;           /* --kv-secret-file: callers identify with signed tokens */
    /* Admission of reservations (--max-reserved-share*, --reservation-timeout-ms). */
    double resv_share, resv_share_caller;
    int64_t resv_timeout_ms;
    pthread_mutex_t resv_mu;
    int64_t resv_total;         /* blocks of all reservations waiting for KV */
    caller_slot callers[MAX_CALLERS];
    /* Requests by DecodeRequest.end_key, for EndChoice (a leaf lock: see the top). */
    pthread_mutex_t keys_mu;
    struct dreq *keys[KEY_BUCKETS];
} dsvc;

static dsvc g;

/* Counts n blocks of a new reservation from caller host against the limits: every caller's
 * reservations together may hold resv_share of the pool, one caller's resv_share_caller (a
 * caller that holds nothing may always reserve one request, so that a long prompt is never
 * refused forever). Returns 0, or PD_ENOSPC with a message in err. */
static int resv_take(dreq *r, const char *host, int32_t n, char *err)
{
    const int64_t pool = g.model.ep.n_blocks;
    const int64_t lim_all = (int64_t)(g.resv_share * (double)pool);
    const int64_t lim_one = (int64_t)(g.resv_share_caller * (double)pool);
    int rc = 0;
    pthread_mutex_lock(&g.resv_mu);
    int slot = -1, free_slot = -1;
    for (int i = 0; i < MAX_CALLERS && slot < 0; i++) {
        if (g.callers[i].n > 0 && !strcmp(g.callers[i].host, host)) slot = i;
        else if (g.callers[i].n == 0 && free_slot < 0) free_slot = i;
    }
    if (slot < 0 && free_slot < 0) {
        rc = pd_errf(err, PD_ENOSPC, "reservations from %d callers are waiting for KV; retry "
                     "later", MAX_CALLERS);
    } else if (slot < 0) {
        slot = free_slot;
        snprintf(g.callers[slot].host, sizeof g.callers[slot].host, "%s", host);
        g.callers[slot].blocks = 0;
    }
    if (rc == 0 && g.resv_total > 0 && g.resv_total + n > lim_all)
        rc = pd_errf(err, PD_ENOSPC, "reservations waiting for KV hold %lld of %lld KV blocks "
                     "(--max-reserved-share %.2f); retry later or elsewhere",
                     (long long)g.resv_total, (long long)pool, g.resv_share);
    else if (rc == 0 && g.callers[slot].blocks > 0 && g.callers[slot].blocks + n > lim_one)
        rc = pd_errf(err, PD_ENOSPC, "this caller's reservations waiting for KV hold %lld of "
                     "%lld KV blocks (--max-reserved-share-per-caller %.2f); retry later or "
                     "elsewhere", (long long)g.callers[slot].blocks, (long long)pool,
                     g.resv_share_caller);
    if (rc == 0) {
        g.callers[slot].blocks += n;
        g.callers[slot].n++;
        g.resv_total += n;
        r->resv_blocks = n;
        r->resv_caller = slot;
        atomic_fetch_add(&g.inst.reserved_blocks, n);
        atomic_fetch_add(&g.inst.reservations, 1);
    }
    pthread_mutex_unlock(&g.resv_mu);
    return rc;
}

/* The reservation no longer waits for KV (landed, failed, cancelled): its blocks stop
 * counting against the limits. Idempotent; any thread. */
static void resv_put(dreq *r)
{
    pthread_mutex_lock(&g.resv_mu);
    if (r->resv_blocks > 0) {
        caller_slot *c = &g.callers[r->resv_caller];
        c->blocks -= r->resv_blocks;
        c->n--;
        g.resv_total -= r->resv_blocks;
        atomic_fetch_sub(&g.inst.reserved_blocks, r->resv_blocks);
        atomic_fetch_sub(&g.inst.reservations, 1);
        r->resv_blocks = 0;
    }
    pthread_mutex_unlock(&g.resv_mu);
}

/* ---- the end_key table ---- */

static struct dreq **key_bucket(uint64_t key)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return &g.keys[key % KEY_BUCKETS];
}

/* Enters r (whose end_key is set) into the table, unless a live request has the same key
 * (then r keeps end_key 0: its choices cannot be ended one by one). */
static void keys_add(dreq *r)
{
    pthread_mutex_lock(&g.keys_mu);
    struct dreq **b = key_bucket(r->end_key);
    bool dup = false;
    for (dreq *x = *b; x && !dup; x = x->key_next) dup = x->end_key == r->end_key;
    if (dup) {
        PD_LOGW("decode request %llu: its end_key is in use; its choices cannot be ended early",
                (unsigned long long)r->id);
        r->end_key = 0;
    } else {
        r->key_next = *b;
        *b = r;
    }
    pthread_mutex_unlock(&g.keys_mu);
}

/* The request with end_key key whose Decode call came from host, with a reference for the
 * caller (dreq_unref), or NULL. A request whose count reached zero is being freed: skipped. */
static dreq *keys_find(uint64_t key, const char *host)
{
    dreq *found = NULL;
    pthread_mutex_lock(&g.keys_mu);
    for (dreq *x = *key_bucket(key); x && !found; x = x->key_next) {
        if (x->end_key != key || strcmp(x->peer, host)) continue;
        int n = atomic_load(&x->refs);
        while (n > 0 && !atomic_compare_exchange_weak(&x->refs, &n, n + 1)) {
        }
        if (n > 0) found = x;
    }
    pthread_mutex_unlock(&g.keys_mu);
    return found;
}

static void keys_remove(dreq *r)
{
    if (!r->end_key) return;
    pthread_mutex_lock(&g.keys_mu);
    for (struct dreq **p = key_bucket(r->end_key); *p; p = &(*p)->key_next)
        if (*p == r) {
            *p = r->key_next;
            break;
        }
    pthread_mutex_unlock(&g.keys_mu);
}

static void dreq_unref(dreq *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    keys_remove(r); /* before the memory goes: keys_find may be looking at it */
    resv_put(r);
    rpc_call_unref(r->call);
    pthread_mutex_destroy(&r->mu);
    for (int i = 0; i < ENG_MAX_CHOICES; i++) {
        free(r->ch[i].pend);
        free(r->ch[i].pend_lp);
    }
    free(r);
}

/* Ends the call once (status OK = normal end). The call reference stays until the request is
 * freed. */
static void finish_call(dreq *r, rpc_status_code code, const char *msg)
{
    pthread_mutex_lock(&r->mu);
    bool already = r->finished;
    r->finished = true;
    pthread_mutex_unlock(&r->mu);
    if (already) return;
    svc_metrics_request(g.metrics, code);
    rpc_stream_finish(r->call, code, msg && *msg ? "%s" : NULL, msg);
}

/* Sends choice c's pending tokens (and its final fields when o is its last output). Engine
 * thread. */
static void flush_burst(dreq *r, int32_t c, const eng_output *o)
{
    struct dchoice *ch = &r->ch[c];
    bool terminal = o && o->finish != SEQ_FINISH_NONE;
    if (ch->n_pend == 0 && !terminal) return;
    Pdserve__Internal__V1__TokenBurst b = PDSERVE__INTERNAL__V1__TOKEN_BURST__INIT;
    Pdserve__V1__Usage usage = PDSERVE__V1__USAGE__INIT;
    Pdserve__V1__TokenLogprob **lpp = NULL;
    size_t n_lp = 0;
    b.index = (uint32_t)c;
    b.n_token_ids = ch->n_pend;
    b.token_ids = ch->pend;
    if (r->want_logprobs && ch->n_pend && (lpp = calloc(ch->n_pend, sizeof *lpp))) {
        for (; n_lp < ch->n_pend; n_lp++) {
            const pend_lp *p = &ch->pend_lp[n_lp];
            if (!(lpp[n_lp] = svc_token_logprob_new(ch->pend[n_lp], p->lp, p->top, p->n_top)))
                break;
        }
        if (n_lp == ch->n_pend) { /* all or none: one per token */
            b.n_logprobs = n_lp;
            b.logprobs = lpp;
        }
    }
    if (terminal) {
        b.finish_reason = svc_finish_reason(o->finish);
        usage.prompt_tokens = (uint32_t)o->n_prompt;
        usage.completion_tokens = (uint32_t)o->n_output;
        usage.cached_prompt_tokens = (uint32_t)o->n_cached;
        b.usage = &usage;
    }
    Pdserve__Internal__V1__DecodeResponse m = PDSERVE__INTERNAL__V1__DECODE_RESPONSE__INIT;
    m.kind_case = PDSERVE__INTERNAL__V1__DECODE_RESPONSE__KIND_TOKENS;
    m.tokens = &b;
    int rc = rpc_stream_send(r->call, &m.base);
    if (rc == 0) ch->n_pend = 0;
    else if (rc == PD_ENOSPC && terminal)
        finish_call(r, RPC_STATUS_RESOURCE_EXHAUSTED, "the client reads too slowly");
    for (size_t i = 0; i < n_lp; i++) free(lpp[i]);
    free(lpp);
    /* PD_ENOSPC (not terminal): keep the tokens; the next output retries. PD_ESTATE: the call
     * is gone (cancelled); the abort is on its way. */
}

static void on_output(void *user, const eng_output *o)
{
    dreq *r = user;
    const int32_t c = o->choice >= 0 && o->choice < r->n_choices ? o->choice : 0;
    struct dchoice *ch = &r->ch[c];
    if (!r->queue_seen && o->finish != SEQ_FINISH_ABORTED) {
        r->queue_seen = true;
        svc_metrics_queue_time(g.metrics, o->queue_s);
    }
    resv_put(r); /* admitted (or over): whatever it reserved no longer waits for KV */
    if (o->token >= 0) {
        if (ch->n_pend == ch->cap_pend) {
            size_t cap = ch->cap_pend ? 2 * ch->cap_pend : 8;
            uint32_t *np = realloc(ch->pend, cap * sizeof *np);
            pend_lp *nl = np ? realloc(ch->pend_lp, cap * sizeof *nl) : NULL;
            if (np) ch->pend = np;
            if (nl) ch->pend_lp = nl;
            if (np && nl) ch->cap_pend = cap;
        }
        if (ch->n_pend < ch->cap_pend) { /* the choice's own logprobs and alternatives */
            pend_lp *p = &ch->pend_lp[ch->n_pend];
            p->lp = o->logprob;
            p->n_top = o->n_top < r->n_top ? o->n_top : r->n_top;
            if (p->n_top > 0) memcpy(p->top, o->top, (size_t)p->n_top * sizeof *o->top);
            ch->pend[ch->n_pend++] = (uint32_t)o->token;
        }
    }
    if (o->finish == SEQ_FINISH_NONE) {
        flush_burst(r, c, NULL);
        return;
    }
    if (o->finish != SEQ_FINISH_ABORTED && !o->done) { /* one choice ends; others go on */
        flush_burst(r, c, o);
        return;
    }
    if (o->finish == SEQ_FINISH_ABORTED) {
        pthread_mutex_lock(&r->mu);
        int code = r->err_code ? r->err_code : RPC_STATUS_CANCELLED;
        char msg[PD_ERR_LEN];
        snprintf(msg, sizeof msg, "%s", r->err_code ? r->err_msg : "request cancelled");
        pthread_mutex_unlock(&r->mu);
        finish_call(r, (rpc_status_code)code, msg);
    } else {
        flush_burst(r, c, o);
        finish_call(r, RPC_STATUS_OK, NULL);
    }
    if (o->done) dreq_unref(r); /* the engine's reference (its last output) */
}

static void on_error(void *user, int code, const char *msg)
{
    dreq *r = user;
    resv_put(r);
    finish_call(r, svc_status_for(code), msg);
    dreq_unref(r);
}

/* ---- kvtransfer side (kvt thread) ----
 *
 * Block ownership: the engine frees a reservation's blocks when it aborts the request, and
 * another reservation may get them at once. So while kvtransfer holds a reservation (a sender
 * may be writing into its blocks), nothing aborts the request in the engine: a cancellation
 * goes to the kvt thread, which releases the kvt reservation, and the abort follows from its
 * KVT_EV_RECV_FAILED event, delivered once no UCX operation writes the blocks any more. The
 * kvt thread orders the cancellation against do_expect (r->cancelled, r->kv_expected). */

typedef struct {
    dreq *r;
    int32_t n;        /* the prompt's blocks */
    int32_t n_cached; /* of them, leading blocks shared from the prefix cache (not written) */
    int32_t ids[];
} expect_job;

static void do_expect(kvt_ctx *ctx, void *arg)
{
    (void)ctx;
    expect_job *j = arg;
    dreq *r = j->r;
    char err[PD_ERR_LEN];
    if (r->cancelled) { /* cancelled before its reservation reached kvtransfer */
        resv_put(r);
        ew_abort(g.worker, r->id);
        dreq_unref(r); /* the kvt reference taken for this job */
        free(j);
        return;
    }
    kvt_recv_params p = kvt_recv_default_params();
    p.req_id = r->id;
    p.n_blocks = j->n - j->n_cached; /* only the blocks after the cached prefix are written */
    p.block_ids = j->ids + j->n_cached;
    p.user = r;
    p.start_timeout_ms = g.resv_timeout_ms > 0 ? (int32_t)g.resv_timeout_ms : -1;
    int rc = kvt_recv_expect(g.pool, &p, err);
    if (rc < 0) {
        pthread_mutex_lock(&r->mu);
        r->err_code = RPC_STATUS_INTERNAL;
        snprintf(r->err_msg, sizeof r->err_msg, "cannot expect the KV transfer: %.400s", err);
        pthread_mutex_unlock(&r->mu);
        resv_put(r);
        ew_abort(g.worker, r->id);
        dreq_unref(r); /* the kvt reference taken for this job */
        free(j);
        return;
    }
    r->kv_expected = true; /* the job's reference now belongs to the reservation's event */
    /* Tell the router where the prefill side writes. */
    Pdserve__Internal__V1__KvLayout layout;
    svc_kv_layout_to_proto(&g.model, &layout);
    Pdserve__Internal__V1__KvTarget t = PDSERVE__INTERNAL__V1__KV_TARGET__INIT;
    t.kv_descriptor.data = g.desc;
    t.kv_descriptor.len = g.desc_len;
    uint32_t *ids = malloc((size_t)j->n * sizeof *ids);
    for (int32_t i = 0; ids && i < j->n; i++) ids[i] = (uint32_t)j->ids[i];
    t.n_block_ids = ids ? (size_t)j->n : 0;
    t.block_ids = ids;
    t.decode_instance_id = g.inst.instance_id;
    t.reservation_id = r->id;
    t.cached_blocks = (uint32_t)j->n_cached;
    t.layout = &layout;
    Pdserve__Internal__V1__DecodeReservation res = PDSERVE__INTERNAL__V1__DECODE_RESERVATION__INIT;
    res.kv_target = &t;
    Pdserve__Internal__V1__DecodeResponse m = PDSERVE__INTERNAL__V1__DECODE_RESPONSE__INIT;
    m.kind_case = PDSERVE__INTERNAL__V1__DECODE_RESPONSE__KIND_RESERVATION;
    m.reservation = &res;
    if (!ids || rpc_stream_send(r->call, &m.base) < 0) {
        /* The call is gone (cancelled) or out of memory: end the reservation; its
         * RECV_FAILED event aborts the request and drops the reference. */
        kvt_recv_cancel(g.pool, r->id);
    }
    free(ids);
    free(j);
}

static void on_kvt_event(void *arg, const kvt_event *ev)
{
    (void)arg;
    dreq *r = ev->user;
    if (!r) return;
    r->kv_expected = false;
    resv_put(r);
    if (ev->type == KVT_EV_RECV_DONE) {
        PD_LOGD("request %llu: KV landed (%llu bytes in %.2f ms)", (unsigned long long)r->id,
                (unsigned long long)ev->bytes, ev->elapsed_ns / 1e6);
        svc_metrics_kv_transfer(g.metrics, (double)ev->elapsed_ns * 1e-9);
        /* Every byte is in the engine's own cache (device to device, the staging ring's
         * copies completed, or CPU memory): the sequence just joins the batch, nothing is
         * copied or waited for on the engine thread. */
        if (r->cancelled) ew_abort(g.worker, r->id);
        else if (ev->first_tokens && ev->n_first_tokens > 1)
            ew_admit_n(g.worker, r->id, ev->first_tokens, ev->n_first_tokens); /* n choices */
        else ew_admit(g.worker, r->id, ev->first_token);
        svc_metrics_kv_path(g.metrics, kvt_path_name(ev->path));
        kvt_recv_release(g.pool, r->id);
    } else if (ev->type == KVT_EV_RECV_FAILED) {
        pthread_mutex_lock(&r->mu);
        if (!r->err_code) {
            r->err_code = ev->status == PD_ECANCELED ? RPC_STATUS_CANCELLED : RPC_STATUS_UNAVAILABLE;
            snprintf(r->err_msg, sizeof r->err_msg, "KV transfer failed: %.400s", ev->detail);
        }
        pthread_mutex_unlock(&r->mu);
        ew_abort(g.worker, r->id); /* the blocks are no longer written: the engine frees them */
    }
    dreq_unref(r);
}

/* The call was cancelled (kvt thread; carries a reference). */
static void do_cancel(kvt_ctx *ctx, void *arg)
{
    (void)ctx;
    dreq *r = arg;
    r->cancelled = true;
    /* With a reservation in kvt, its RECV_FAILED follows and aborts; without one (not yet,
     * or no more) the engine aborts now. */
    if (!r->kv_expected || kvt_recv_cancel(g.pool, r->id) != 0) ew_abort(g.worker, r->id);
    dreq_unref(r);
}

/* ---- handlers ---- */

static void on_reserved(void *user, const int32_t *ids, int32_t n, int32_t n_cached)
{
    dreq *r = user;
    expect_job *j = malloc(sizeof *j + (size_t)n * sizeof(int32_t));
    if (!j) {
        ew_abort(g.worker, r->id); /* nothing in kvt yet: the engine may free the blocks */
        return;
    }
    j->r = r;
    j->n = n;
    j->n_cached = n_cached;
    memcpy(j->ids, ids, (size_t)n * sizeof(int32_t));
    atomic_fetch_add(&r->refs, 1); /* kvtransfer's reference */
    if (svc_kvt_post(g.kvt, do_expect, j) < 0) {
        free(j);
        dreq_unref(r);
        ew_abort(g.worker, r->id);
    }
}

static void on_cancel(rpc_call *call, void *user)
{
    (void)call;
    dreq *r = user;
    if (r->local_prefill) { /* no kvtransfer reservation: the engine aborts at once */
        ew_abort(g.worker, r->id);
        return;
    }
    atomic_fetch_add(&r->refs, 1);
    if (svc_kvt_post(g.kvt, do_cancel, r) < 0) { /* shutting down */
        ew_abort(g.worker, r->id);
        dreq_unref(r);
    }
}

static void handle_decode(rpc_call *call, const ProtobufCMessage *msg, void *user)
{
    (void)user;
    const Pdserve__Internal__V1__DecodeRequest *q = (const Pdserve__Internal__V1__DecodeRequest *)msg;
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
    /* Migration: the choices that go on and their tokens (the engine checks them too). */
    const int32_t n_choices = q->n > 1 ? (int32_t)q->n : 1;
    size_t n_resumed_tokens = 0;
    if (q->n_resume > 0 && !(q->local_prefill || g.colocated)) {
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT, "resume needs local_prefill");
        return;
    }
    if (q->n_resume > (size_t)n_choices) {
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT, "resume lists %zu choices of %d",
                          q->n_resume, n_choices);
        return;
    }
    for (size_t k = 0; k < q->n_resume; k++) {
        const Pdserve__Internal__V1__ResumeChoice *rc = q->resume[k];
        if (!rc || rc->index >= (uint32_t)n_choices ||
            rc->n_token_ids >= (size_t)er.stop.max_tokens) {
            rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT, "resume[%zu]: choice %u with %zu "
                              "tokens (choices 0 .. %d, fewer than max_tokens = %d tokens)", k,
                              rc ? rc->index : 0, rc ? rc->n_token_ids : 0, n_choices - 1,
                              er.stop.max_tokens);
            return;
        }
        for (size_t i = 0; i < rc->n_token_ids; i++)
            if (rc->token_ids[i] >= (uint32_t)g.model.cfg.vocab_size) {
                rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT, "resume[%zu].token_ids[%zu] "
                                  "= %u is out of range [0, %d)", k, i, rc->token_ids[i],
                                  g.model.cfg.vocab_size);
                return;
            }
        n_resumed_tokens += rc->n_token_ids;
    }
    int32_t *prompt = malloc((q->n_prompt_token_ids + 2 * q->n_resume + n_resumed_tokens) *
                             sizeof *prompt);
    dreq *r = calloc(1, sizeof *r);
    if (!prompt || !r) {
        free(prompt);
        free(r);
        rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    for (size_t i = 0; i < q->n_prompt_token_ids; i++) prompt[i] = (int32_t)q->prompt_token_ids[i];
    atomic_init(&r->refs, 2); /* the engine's reference + this handler's */
    pthread_mutex_init(&r->mu, NULL);
    r->id = atomic_fetch_add(&g.next_id, 1);
    r->call = call;
    rpc_call_ref(call);
    r->n_prompt = (int32_t)q->n_prompt_token_ids;
    r->local_prefill = q->local_prefill || g.colocated;
    r->want_logprobs = q->logprobs > 0;
    r->n_top = (int32_t)q->logprobs;
    r->n_choices = q->n > 1 ? (int32_t)q->n : 1;
    snprintf(r->peer, sizeof r->peer, "?");
    rpc_call_peer(call, r->peer, sizeof r->peer);
    /* Reservation shares by identity: a verified certificate or a caller token signed with
     * the shared secret has a share of its own; with the secret set, every caller without
     * one (any process that reaches the port) shares a single share, so none of them can
     * take an authenticated router's (issue #38). Without either, by host address. */
    svc_auth_identity(call, r->who, sizeof r->who);
    if (g.auth_secret && !strncmp(r->who, "addr:", 5)) snprintf(r->who, sizeof r->who, "anonymous");
    if (!r->local_prefill) {
        /* Admission: reservations hold blocks until a prefill instance fills them, so each
         * caller gets a bounded share of the pool (the prompt's blocks and the first token). */
        int32_t bs = g.model.ep.block_size;
        if (resv_take(r, r->who, (r->n_prompt + 1 + bs - 1) / bs, err) < 0) {
            pd_metric_add(g.m_resv_refused, 1);
            PD_LOGD("decode request %s from %s (%s) refused: %s", q->request_id, r->peer, r->who, err);
            finish_call(r, RPC_STATUS_RESOURCE_EXHAUSTED, err);
            free(prompt);
            dreq_unref(r);
            dreq_unref(r);
            return;
        }
    }
    er.id = r->id;
    er.prompt = prompt;
    er.n_prompt = r->n_prompt;
    er.logprobs = r->want_logprobs;
    er.top_logprobs = r->n_top;
    er.n = r->n_choices;
    if (q->n_resume > 0) { /* after the prompt in the same allocation */
        int32_t *rch = prompt + r->n_prompt, *rlen = rch + q->n_resume, *rtok = rlen + q->n_resume;
        size_t off = 0;
        for (size_t k = 0; k < q->n_resume; k++) {
            rch[k] = (int32_t)q->resume[k]->index;
            rlen[k] = (int32_t)q->resume[k]->n_token_ids;
            for (size_t i = 0; i < q->resume[k]->n_token_ids; i++)
                rtok[off++] = (int32_t)q->resume[k]->token_ids[i];
        }
        er.n_resume = (int32_t)q->n_resume;
        er.resume_choice = rch;
        er.resume_len = rlen;
        er.resume_tokens = rtok;
    }
    /* A local prefill has no reservation message: the tokens follow directly. */
    int rc = r->local_prefill ? ew_submit(g.worker, &er, r) : ew_reserve(g.worker, &er, r);
    free(prompt);
    if (rc < 0) {
        finish_call(r, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        dreq_unref(r);
        dreq_unref(r);
        return;
    }
    /* r is alive here (this handler's reference) even if the engine already finished it.
     * Its choices can be ended from now on (the engine knows its id). */
    if (q->end_key && r->n_choices > 1) {
        r->end_key = q->end_key;
        keys_add(r);
    }
    PD_LOGD("decode request %s -> %llu (%d prompt tokens%s)", q->request_id,
            (unsigned long long)r->id, r->n_prompt, r->local_prefill ? ", local prefill" : "");
    rpc_call_set_cancel_cb(call, on_cancel, r);
    dreq_unref(r);
}

/* EndChoice: ends one choice of a live request of this caller's (see the top). */
static void handle_end_choice(rpc_call *call, const ProtobufCMessage *msg, void *user)
{
    (void)user;
    const Pdserve__Internal__V1__EndChoiceRequest *q = (const void *)msg;
    Pdserve__Internal__V1__EndChoiceResponse resp =
        PDSERVE__INTERNAL__V1__END_CHOICE_RESPONSE__INIT;
    char host[64] = "?";
    rpc_call_peer(call, host, sizeof host);
    dreq *r = q->end_key ? keys_find(q->end_key, host) : NULL;
    if (r && q->index >= (uint32_t)r->n_choices) {
        const int32_t n = r->n_choices;
        dreq_unref(r);
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT, "index %u: the request has %d "
                          "choices", q->index, n);
        return;
    }
    if (r) {
        resp.found = ew_end_choice(g.worker, r->id, (int32_t)q->index) == 0;
        dreq_unref(r);
    }
    rpc_call_reply(call, &resp.base);
}

/* Scrape time: the reservations waiting for KV. */
static pd_metric *g_m_resv_blocks, *g_m_resv_n;

static void collect(pd_metrics *m, void *arg)
{
    (void)m;
    (void)arg;
    pd_metric_set(g_m_resv_blocks, (double)atomic_load(&g.inst.reserved_blocks));
    pd_metric_set(g_m_resv_n, (double)atomic_load(&g.inst.reservations));
}

/* ---- setup ---- */

typedef struct {
    int rc;
    char err[PD_ERR_LEN];
} setup_box;

/* kvt thread: the pool's descriptor, which Decode responses hand to prefill instances. */
static void do_export_pool(kvt_ctx *ctx, void *arg)
{
    (void)ctx;
    setup_box *b = arg;
    b->rc = kvt_pool_export(g.pool, &g.desc, &g.desc_len, b->err);
}

int main(int argc, char **argv)
{
    svc_block_signals();
    svc_model_flags mf;
    svc_model_flags_init(&mf);
    svc_server_flags sf;
    svc_server_flags_init(&sf, "0.0.0.0:50061");
    int64_t metrics_port = -1;
    bool colocated = false;
    pd_flag flags[48];
    int n = 0;
    svc_model_flags_add(&mf, flags, &n);
    svc_server_flags_add(&sf, flags, &n, "decode");
    flags[n++] = (pd_flag){"colocated", PD_FLAG_BOOL, &colocated,
                           "compute prompts here too (no prefill instance)", 1, 0};
    double resv_share = 0.9, resv_share_caller = 0.5;
    int64_t resv_timeout_ms = 60000;
    flags[n++] = (pd_flag){"max-reserved-share", PD_FLAG_DOUBLE, &resv_share,
                           "share of the KV pool that reservations waiting for their KV may hold "
                           "(more: RESOURCE_EXHAUSTED, the router tries elsewhere)", 0.01, 1};
    flags[n++] = (pd_flag){"max-reserved-share-per-caller", PD_FLAG_DOUBLE, &resv_share_caller,
                           "the same for one caller (peer host), so that no caller of the internal "
                           "port can take the pool", 0.01, 1};
    flags[n++] = (pd_flag){"reservation-timeout-ms", PD_FLAG_INT, &resv_timeout_ms,
                           "a reservation whose KV has not started arriving by then is released "
                           "(0 = never)", 0, 86400000};
    svc_metrics_flag_add(&metrics_port, flags, &n);
    int prc = pd_flags_parse(flags, n, argc, argv, "pdserve-decode",
                             "The decode instance of pdserve: receives KV from prefill instances "
                             "and streams generated tokens (internal Decode RPC).");
    if (prc != 0) {
        pd_flags_free();
        return prc > 0 ? 0 : 2;
    }
    svc_server_flags_apply(&sf);
    const char *listen = sf.listen;
    char err[PD_ERR_LEN];
    int status = 1;
    if (svc_auth_load_secret(sf.kv_secret_file, err) < 0) {
        fprintf(stderr, "pdserve-decode: --kv-secret-file: %s\n", err);
        pd_flags_free();
        return 2;
    }
    g.auth_secret = sf.kv_secret_file && sf.kv_secret_file[0];
    g.colocated = colocated;
    g.default_max_tokens = sf.default_max_tokens;
    g.resv_share = resv_share;
    g.resv_share_caller = resv_share_caller;
    g.resv_timeout_ms = resv_timeout_ms;
    pthread_mutex_init(&g.resv_mu, NULL);
    pthread_mutex_init(&g.keys_mu, NULL);
    atomic_init(&g.next_id, 1);
    svc_metrics_params mp = {colocated ? "colocated" : "decode", "recv", listen, metrics_port};
    if (svc_metrics_create(&mp, &g.metrics, err) < 0) {
        fprintf(stderr, "pdserve-decode: %s\n", err);
        goto out;
    }
    if (svc_model_open(&mf, ENG_MODE_DECODE, &g.model, err) < 0) {
        fprintf(stderr, "pdserve-decode: %s\n", err);
        goto out;
    }
    svc_model_info_metric(&g.model, svc_metrics_registry(g.metrics));
    /* Decode-only requests come through reservations, colocated ones as plain requests (a
     * local prefill is an ordinary admission). */
    pd_metrics *reg = svc_metrics_registry(g.metrics);
    g.m_resv_refused = pd_metrics_counter(reg, "pdserve_kv_reservations_refused_total", NULL,
                                          "Decode reservations refused by the reservation limits "
                                          "(--max-reserved-share, --max-reserved-share-per-caller)");
    g_m_resv_blocks = pd_metrics_gauge(reg, "pdserve_kv_reserved_blocks", NULL,
                                       "KV blocks held by reservations waiting for their KV");
    g_m_resv_n = pd_metrics_gauge(reg, "pdserve_kv_reservations", NULL,
                                  "reservations waiting for their KV");
    svc_metrics_set_collector(g.metrics, collect, NULL);
    g.inst.metrics = g.metrics;
    ew_callbacks cb = {.on_output = on_output, .on_error = on_error, .on_reserved = on_reserved,
                       .on_step = svc_instance_on_step,
                       .on_step_failed = svc_instance_on_step_failed, .step_arg = &g.inst};
    if (svc_engine_start(&g.model, colocated ? ENG_MODE_COLOCATED : ENG_MODE_DECODE, NULL, &cb,
                         &g.worker, err) < 0 ||
        svc_kvt_start("decode", on_kvt_event, NULL, &g.model, &g.kvt, &g.pool, err) < 0) {
        fprintf(stderr, "pdserve-decode: %s\n", err);
        goto out;
    }
    setup_box sb = {0, ""};
    svc_kvt_call(g.kvt, do_export_pool, &sb);
    if (sb.rc < 0) {
        fprintf(stderr, "pdserve-decode: KV pool: %s\n", sb.err);
        goto out;
    }
    g.inst.role = colocated ? PDSERVE__INTERNAL__V1__ROLE__ROLE_COLOCATED
                            : PDSERVE__INTERNAL__V1__ROLE__ROLE_DECODE;
    g.inst.model = &g.model;
    g.inst.worker = g.worker;
    svc_serve_params vp = {"decode", colocated ? "colocated" : "decode-only", &sf,
                           &pdserve__internal__v1__decode__descriptor, "Decode",
                           RPC_SERVER_STREAMING, handle_decode, 4096, "EndChoice",
                           handle_end_choice};
    if (svc_serve(&vp, &g.inst, g.metrics, g.kvt, &g.server, err) < 0) {
        fprintf(stderr, "pdserve-decode: %s\n", err);
        goto out;
    }
    status = 0;
out:
    svc_metrics_stop(g.metrics); /* before its sources go */
    rpc_server_destroy(g.server); /* before the engine: calls reference requests */
    ew_destroy(g.worker);
    svc_kvt_stop(g.kvt, &g.model, &g.pool);
    free(g.desc);
    svc_metrics_destroy(g.metrics); /* after the engine thread (its step hook) */
    svc_model_close(&g.model);
    pd_flags_free();
    return status;
}
