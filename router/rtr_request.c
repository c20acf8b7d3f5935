/* rtr_request.c -- pdserve-router's requests: the public pdserve.v1.Generation API. Validates and
 * tokenizes each request, reserves KV blocks on a decode instance (Decode stream), has a
 * prefill instance compute the prompt and push its KV there (Prefill call), streams the first
 * token as soon as prefill returns it and then the decode tokens, detokenized incrementally
 * with stop strings applied; the last message carries the finish reason and usage. With no
 * prefill instances (or a colocated decode instance) the decode instance computes the prompt.
 * A request's whole life, the public call, its internal calls, the prefill gate and the
 * stall watch, is kept in this one file so that the locking below reads in one place;
 * router_main.c has the flags, setup and metrics.
 *
 * A request (rreq) is touched by a gRPC worker (the handler, the cancel callback) and by the
 * completion threads of two client calls; its mutex serializes them. It is freed when the
 * public call is finished and both client calls have ended.
 *
 * Lock order: the public call's cancel callback (on_cancel) takes the request's mutex, and
 * rpc_stream_finish waits for a running cancel callback; so the public call is never finished
 * under the mutex. finish_locked only decides (marks the request finished, records the status)
 * and rreq_unlock sends the status after releasing the mutex. Every path that may finish
 * unlocks through rreq_unlock.
 *
 * Stop strings are matched here. A choice of several that ends at one while others go on is
 * ended on the decode instance too, by a unary Decode.EndChoice call named by the Decode
 * call's end_key (a random key per call): started under the mutex like the other internal
 * calls, never waited for, and holding no reference to the request (its callback touches
 * nothing), so the request may end (naturally, cancelled, past its deadline) while the call
 * is in flight; the decode instance ignores a call or choice that has ended by then.
 *
 * Metrics: the outcome, latencies (TTFT from arrival to the first token sent, TPOT as the
 * mean gap between later tokens, end to end) and token counts of every public call are
 * recorded once, where the call is finished (finish_locked, on_cancel, reject); the
 * instances' load comes from the registry at scrape time. */
#include <stdarg.h>
#include <time.h>

#include "common/random.h"
#include "pdserve/internal/v1/decode.pb-c.h"
#include "pdserve/internal/v1/prefill.pb-c.h"
#include "router/rtr_errors.h"
#include "text/block_hash.h"
#include "text/stopstr.h"

#include "router/rtr_impl.h"

/* One choice of a request (GenerateRequest.n): its own detokenizer, stop strings and end. */
typedef struct {
    tok_stream *detok;
    stopstr *stops;
    uint32_t completion;             /* tokens emitted */
    bool ended;                      /* its last message was sent (or decided) */
    uint32_t *held;                  /* decode tokens that arrived before the first token */
    Pdserve__V1__TokenLogprob **held_lp; /* their logprobs ([cap_held]; copies, freed once
                                        sent; NULL where a burst had none) */
    size_t n_held, cap_held;
    int held_finish;                 /* finish reason that arrived with held tokens */
    Pdserve__V1__Usage held_usage;
    bool have_held_usage;
    uint32_t *sent;                  /* the tokens sent to the client ([n_sent]): a migration
                                        resumes the choice from them */
    size_t n_sent, cap_sent;
    bool sent_lost;                  /* out of memory recording them: not resumable */
} rchoice;

typedef struct rreq {
    atomic_int refs;                 /* public call side + decode call + prefill call */
    pthread_mutex_t mu;
    rpc_call *call;                  /* the public call (our reference until finished) */
    char request_id[129];            /* at most 128 bytes (validated), NUL-terminated */
    int32_t *prompt;
    int32_t n_prompt;
    Pdserve__V1__SamplingParams sampling;   /* normalized (seed filled) */
    Pdserve__V1__StoppingCriteria stopping; /* copy without strings */
    uint32_t logprobs;
    uint64_t prefix_key;
    rtr_instance *dec, *pre;
    rpc_client_call *dcall, *pcall;
    uint64_t end_key;                /* DecodeRequest.end_key of the Decode call (n > 1), for
                                        EndChoice; 0 = none */
    bool local_prefill;
    int prefill_tries;               /* Prefill calls made (retries on another instance) */
    int decode_tries;                /* Decode calls made */
    bool decode_answered;            /* the decode call sent a message (no retry after it) */
    double t_arrival, t_first, t_last; /* monotonic s: handler start, first and last token sent */
    int finish_reason;               /* FinishReason of an OK end */
    Pdserve__Internal__V1__KvTarget *kv; /* the reservation's target (copy, for retries) */
    bool first_sent;                 /* first token emitted to the client */
    bool finished;                   /* public call finished (or decided: see fin_pending) */
    bool fin_pending;                /* finish_locked decided; rreq_unlock sends the status */
    int fin_code;                    /* rpc_status_code to send */
    char fin_msg[PD_ERR_LEN];        /* its details ("" = none) */
    int migrations;                  /* restarts on another instance (--max-migrations) */
    bool resume;                     /* the next Decode call resumes the choices from their
                                        sent tokens (local prefill) */
    bool force_local;                /* the next Decode call computes the prompt itself */
    int32_t n_choices;               /* GenerateRequest.n, 1 .. 16 */
    int32_t n_ended;                 /* choices whose last message was sent */
    rchoice *ch;                     /* [n_choices] */
    uint32_t cached_tokens;          /* from prefill */
    uint32_t completion;             /* tokens emitted, all choices */
    uint32_t max_completion;         /* of the longest choice (TPOT) */
    bool where_counted;              /* the prefill decision went into the metric */
    bool gate_passed;                /* admitted by the prefill gate (mu) */
    struct rreq *live_next, *live_prev; /* the list of live requests (g_live.mu) */
    /* The prefill gate's (under g_gate.mu): */
    struct rreq *gate_next, *gate_prev;
    bool gate_queued;                /* in the waiting list (holding a reference) */
    int64_t gate_tokens;             /* prompt tokens counted as admitted */
    double t_gate;                   /* when it began to wait */
} rreq;

/* Waits on cv (mu held) at most ms (< 1000) milliseconds. */
static void cond_wait_ms(pthread_cond_t *cv, pthread_mutex_t *mu, long ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += ms * 1000000;
    if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
    pthread_cond_timedwait(cv, mu, &ts);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Records a finished public call (mu held; exactly once per request). */
/* ---- reserve late: the prefill gate ----
 * A request whose prompt goes to a prefill instance reserves its decode blocks only once the
 * prefill pool has room for it: at most --prefill-queue-tokens prompt tokens per prefill
 * instance are admitted (reserved on decode and sent to prefill) and not yet prefilled; the
 * others wait here, in arrival order, holding nothing on any instance. So a prefill backlog
 * cannot strand decode memory, and a request cancelled or past its deadline while it waits
 * costs nothing. A dispatcher thread admits waiting requests as prefills complete.
 *
 * Lock order: a request's mutex, then g_gate.mu (start_decode and on_cancel take the gate's
 * mutex with the request's held); the dispatcher never holds g_gate.mu while it takes a
 * request's mutex. Admitted tokens are released when the Prefill call ends (or the request
 * is freed first). */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rreq *head, *tail;
    int64_t n_waiting, admitted;
    int64_t waiting_tokens;          /* prompt tokens of the waiting requests */
    bool stop, started;
    pthread_t th;
} g_gate = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static int64_t gate_budget(void)
{
    int np = 0, nd = 0, nh = 0;
    rtr_registry_counts(g.reg, &np, &nd, &nh);
    return g.prefill_queue_tokens * (np > 0 ? np : 1);
}

/* r->mu held. Admits r (true) or queues it (false; the queue takes a reference). */
static bool gate_admit(rreq *r)
{
    pthread_mutex_lock(&g_gate.mu);
    bool ok = !g_gate.head && g_gate.admitted < gate_budget();
    if (ok) {
        g_gate.admitted += r->n_prompt;
        r->gate_tokens = r->n_prompt;
    } else {
        atomic_fetch_add(&r->refs, 1);
        r->gate_queued = true;
        r->t_gate = now_s();
        r->gate_next = NULL;
        r->gate_prev = g_gate.tail;
        if (g_gate.tail) g_gate.tail->gate_next = r;
        else g_gate.head = r;
        g_gate.tail = r;
        g_gate.n_waiting++;
        g_gate.waiting_tokens += r->n_prompt;
    }
    pthread_mutex_unlock(&g_gate.mu);
    return ok;
}

static void gate_unlink_locked(rreq *r)
{
    if (r->gate_prev) r->gate_prev->gate_next = r->gate_next;
    else g_gate.head = r->gate_next;
    if (r->gate_next) r->gate_next->gate_prev = r->gate_prev;
    else g_gate.tail = r->gate_prev;
    r->gate_next = r->gate_prev = NULL;
    r->gate_queued = false;
    g_gate.n_waiting--;
    g_gate.waiting_tokens -= r->n_prompt;
}

/* Removes r from the waiting list (r->mu held). Returns true when it was there: the caller
 * then drops the list's reference, after unlocking. */
static bool gate_withdraw(rreq *r)
{
    pthread_mutex_lock(&g_gate.mu);
    bool was = r->gate_queued;
    if (was) gate_unlink_locked(r);
    pthread_mutex_unlock(&g_gate.mu);
    return was;
}

/* Releases r's admitted tokens (idempotent; any lock state). */
static void gate_release(rreq *r)
{
    pthread_mutex_lock(&g_gate.mu);
    if (r->gate_tokens) {
        g_gate.admitted -= r->gate_tokens;
        r->gate_tokens = 0;
        pthread_cond_signal(&g_gate.cv);
    }
    pthread_mutex_unlock(&g_gate.mu);
}

static bool start_decode(rreq *r, const rtr_instance *exclude);
static void rreq_unref(rreq *r);
static void rreq_unlock(rreq *r);
static void finish_locked(rreq *r, rpc_status_code code, const char *detail);

static void *gate_loop(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_gate.mu);
    while (!g_gate.stop) {
        if (g_gate.head && g_gate.admitted < gate_budget()) {
            rreq *r = g_gate.head;
            gate_unlink_locked(r);
            g_gate.admitted += r->n_prompt;
            r->gate_tokens = r->n_prompt;
            double waited = now_s() - r->t_gate;
            pthread_mutex_unlock(&g_gate.mu);
            pd_metric_observe(g.m_gate_wait, waited);
            pthread_mutex_lock(&r->mu);
            if (!r->finished) {
                r->gate_passed = true;
                if (!start_decode(r, NULL))
                    finish_locked(r, RPC_STATUS_UNAVAILABLE, "no decode instance is available");
            }
            bool done = r->finished && !r->pcall;
            rreq_unlock(r);
            if (done) gate_release(r); /* ended while it waited: nothing was admitted */
            rreq_unref(r);             /* the list's reference */
            pthread_mutex_lock(&g_gate.mu);
            continue;
        }
        /* Woken by a release; the timeout covers instances coming back (the budget grows). */
        cond_wait_ms(&g_gate.cv, &g_gate.mu, 20);
    }
    pthread_mutex_unlock(&g_gate.mu);
    return NULL;
}

static void account_locked(rreq *r, int code)
{
    svc_metrics_request(g.metrics, code);
    pd_metric_add(g.m_prompt, r->n_prompt);
    pd_metric_add(g.m_completion, r->completion);
    if (code != RPC_STATUS_OK) return;
    double t = now_s();
    static const char *const reasons[] = {"unspecified", "length", "eos", "stop", "cancelled"};
    int fr = r->finish_reason >= 0 && r->finish_reason < 5 ? r->finish_reason : 0;
    char l[64] = "";
    pd_metrics_label(l, sizeof l, "finish_reason", reasons[fr]);
    pd_metric_add(pd_mfamily_series(g.m_success, l), 1);
    pd_metric_observe(g.m_e2e, t - r->t_arrival);
    double ttft = (r->t_first > 0 ? r->t_first : t) - r->t_arrival, tpot = 0;
    pd_metric_observe(g.m_ttft, ttft);
    if (r->max_completion >= 2) { /* choices decode side by side: per token of one */
        tpot = (r->t_last - r->t_first) / (double)(r->max_completion - 1);
        pd_metric_observe(g.m_tpot, tpot);
        if (r->dec) rtr_instance_note_tpot(g.reg, r->dec, tpot);
    }
    if ((g.slo_ttft_s <= 0 || ttft <= g.slo_ttft_s) && (g.slo_tpot_s <= 0 || tpot <= g.slo_tpot_s))
        pd_metric_add(g.m_slo, 1);
}

/* Refuses a call before a request exists for it (counted as an outcome). */
static void reject(rpc_call *call, rpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void reject(rpc_call *call, rpc_status_code code, const char *fmt, ...)
{
    char msg[PD_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    svc_metrics_request(g.metrics, code);
    rpc_stream_finish(call, code, "%s", msg);
}

static void live_remove(rreq *r);

static void rreq_unref(rreq *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    live_remove(r); /* before the memory goes: the watcher may be looking at it */
    gate_release(r);
    rtr_instance_unref(r->dec);
    rtr_instance_unref(r->pre);
    rpc_client_call_release(r->dcall);
    rpc_client_call_release(r->pcall);
    if (r->kv) protobuf_c_message_free_unpacked(&r->kv->base, NULL);
    for (int32_t c = 0; r->ch && c < r->n_choices; c++) {
        tok_stream_destroy(r->ch[c].detok);
        stopstr_destroy(r->ch[c].stops);
        free(r->ch[c].held);
        for (size_t i = 0; i < r->ch[c].n_held && r->ch[c].held_lp; i++) free(r->ch[c].held_lp[i]);
        free(r->ch[c].held_lp);
        free(r->ch[c].sent);
    }
    free(r->ch);
    free(r->prompt);
    pthread_mutex_destroy(&r->mu);
    free(r);
    atomic_fetch_sub(&g.pending, 1);
}

/* Decides the end of the public call (mu held): accounts it, cancels the internal calls and
 * records the status and its details (may be NULL), which rreq_unlock sends once the mutex is
 * released (see the lock order at the top). */
static void finish_locked(rreq *r, rpc_status_code code, const char *detail)
{
    if (r->finished) return;
    r->finished = true;
    account_locked(r, code);
    r->fin_pending = true;
    r->fin_code = (int)code;
    snprintf(r->fin_msg, sizeof r->fin_msg, "%s", code != RPC_STATUS_OK && detail ? detail : "");
    if (r->dcall) rpc_client_call_cancel(r->dcall); /* never blocks */
    if (r->pcall) rpc_client_call_cancel(r->pcall);
}

/* Releases r->mu and then sends a status that finish_locked decided, and drops the public
 * call's reference. The caller holds a reference to r (the status is copied before the
 * unlock, so r is not touched after it). */
static void rreq_unlock(rreq *r)
{
    rpc_call *call = NULL;
    int code = 0;
    char msg[PD_ERR_LEN];
    if (r->fin_pending) {
        r->fin_pending = false;
        call = r->call;
        code = r->fin_code;
        snprintf(msg, sizeof msg, "%s", r->fin_msg);
    }
    pthread_mutex_unlock(&r->mu);
    if (!call) return;
    if (code == RPC_STATUS_OK) rpc_stream_finish(call, RPC_STATUS_OK, NULL);
    else rpc_stream_finish(call, (rpc_status_code)code, msg[0] ? "%s" : NULL, msg);
    rpc_call_unref(call);
}

/* A copy of an instance's TokenLogprob for token id with at most n_top alternatives, sorted
 * by logprob (largest first, ties by id) whatever order the instance sent them in; one
 * allocation (free()), NULL when out of memory. */
static Pdserve__V1__TokenLogprob *lp_copy(const Pdserve__V1__TokenLogprob *in, uint32_t id,
                                          uint32_t n_top)
{
    pd_top_logprob top[PD_MAX_TOP_LOGPROBS];
    int32_t n = 0;
    for (size_t i = 0; i < in->n_top && n < PD_MAX_TOP_LOGPROBS; i++) {
        if (!in->top[i]) continue;
        pd_top_logprob t = {(int32_t)in->top[i]->token_id, in->top[i]->logprob};
        int32_t j = n++;
        for (; j > 0 && (t.logprob > top[j - 1].logprob ||
                         (t.logprob == top[j - 1].logprob && t.token < top[j - 1].token));
             j--)
            top[j] = top[j - 1];
        top[j] = t;
    }
    if ((uint32_t)n > n_top) n = (int32_t)n_top;
    return svc_token_logprob_new(id, in->logprob, top, n);
}

static void end_choice_done(rpc_client_call *c, const rpc_status *st, void *user)
{
    (void)c;
    (void)user;
    if (st->code != RPC_STATUS_OK)
        PD_LOGD("EndChoice failed: %s: %s", rpc_status_name(st->code), st->details);
}

/* Choice c of r ended at a stop string here while other choices go on (mu held): the decode
 * instance stops decoding it and frees its blocks (Decode.EndChoice). Fire and forget: see
 * the top. */
static void end_choice_on_decode(rreq *r, int32_t c)
{
    if (!r->dec || !r->dcall || !r->end_key) return;
    Pdserve__Internal__V1__EndChoiceRequest q = PDSERVE__INTERNAL__V1__END_CHOICE_REQUEST__INIT;
    q.end_key = r->end_key;
    q.index = (uint32_t)c;
    rpc_client_callbacks cb = {NULL, end_choice_done, NULL};
    rpc_client_call *call = NULL;
    char err[PD_ERR_LEN];
    if (rpc_client_call_start(rtr_instance_channel(r->dec), "/pdserve.internal.v1.Decode/EndChoice",
                              &q.base, &pdserve__internal__v1__end_choice_response__descriptor,
                              10000, &cb, &call, err) < 0) {
        PD_LOGW("request %s: cannot end choice %d on %s: %s", r->request_id, c,
                rtr_instance_addr(r->dec), err);
        return;
    }
    rpc_client_call_release(call); /* the call runs on; its callback needs nothing */
}

/* Emits tokens of choice c to the client (mu held): detokenize, stop strings, one
 * GenerateResponse with index c. finish is a FinishReason (0 = not final: the choice's last
 * message otherwise); usage is for the final message. The call ends (OK) once every choice
 * ended. lps (may be NULL): each token's logprobs as the instance reported them for this
 * choice (the raw model distribution, with its top alternatives), sent when the request asked
 * for logprobs and every token has them. */
static void emit_locked(rreq *r, int32_t c, const uint32_t *ids,
                        Pdserve__V1__TokenLogprob *const *lps, size_t n, int finish,
                        const Pdserve__V1__Usage *usage_in)
{
    if (r->finished || c < 0 || c >= r->n_choices || r->ch[c].ended) return;
    rchoice *ch = &r->ch[c];
    const int finish_in = finish; /* the instance's end of the choice (0: it goes on there) */
    char *text = NULL;
    size_t tlen = 0, tcap = 0;
    char err[PD_ERR_LEN];
    bool stopped = false;
    size_t n_keep = n;
    for (size_t i = 0; i < n && !stopped; i++) {
        const char *piece;
        size_t plen;
        if (!ch->detok || tok_stream_push(ch->detok, (int32_t)ids[i], &piece, &plen, err) < 0) {
            piece = "";
            plen = 0;
        }
        const char *shown;
        size_t slen;
        if (stopstr_push(ch->stops, piece, plen, &shown, &slen, &stopped) < 0) slen = 0;
        if (tlen + slen + 1 > tcap) {
            tcap = (tlen + slen + 1) * 2;
            char *nt = realloc(text, tcap);
            if (!nt) break;
            text = nt;
        }
        memcpy(text + tlen, shown, slen);
        tlen += slen;
        if (stopped) n_keep = i + 1;
    }
    if (stopped) finish = PDSERVE__V1__FINISH_REASON__FINISH_REASON_STOP;
    if (finish && !stopped) { /* the end: release held-back text */
        const char *piece, *shown;
        size_t plen = 0, slen = 0;
        if (!ch->detok || tok_stream_flush(ch->detok, &piece, &plen, err) < 0) {
            piece = "";
            plen = 0;
        }
        bool st2;
        stopstr_push(ch->stops, piece, plen, &shown, &slen, &st2);
        const char *rest;
        size_t rlen = 0;
        if (!st2) stopstr_flush(ch->stops, &rest, &rlen);
        char *nt = realloc(text, tlen + slen + rlen + 1);
        if (nt) {
            text = nt;
            memcpy(text + tlen, shown, slen);
            tlen += slen;
            if (!st2) {
                memcpy(text + tlen, rest, rlen);
                tlen += rlen;
            }
        }
        if (st2) finish = PDSERVE__V1__FINISH_REASON__FINISH_REASON_STOP;
    }
    if (n_keep > 0 && ch->n_sent + n_keep > ch->cap_sent) {
        size_t cap = (ch->n_sent + n_keep) * 2 + 16;
        uint32_t *ns = realloc(ch->sent, cap * sizeof *ns);
        if (ns) {
            ch->sent = ns;
            ch->cap_sent = cap;
        }
    }
    if (ch->n_sent + n_keep <= ch->cap_sent) {
        if (n_keep) memcpy(ch->sent + ch->n_sent, ids, n_keep * sizeof *ids);
        ch->n_sent += n_keep;
    } else {
        ch->sent_lost = true; /* out of memory: this choice cannot be resumed */
    }
    r->completion += (uint32_t)n_keep;
    ch->completion += (uint32_t)n_keep;
    if (ch->completion > r->max_completion) r->max_completion = ch->completion;
    if (n_keep > 0) {
        r->t_last = now_s();
        if (r->t_first == 0) r->t_first = r->t_last;
    }
    if (finish) r->finish_reason = finish;
    Pdserve__V1__GenerateResponse m = PDSERVE__V1__GENERATE_RESPONSE__INIT;
    Pdserve__V1__Usage usage = PDSERVE__V1__USAGE__INIT;
    m.request_id = r->request_id;
    m.index = (uint32_t)c;
    m.n_token_ids = n_keep;
    m.token_ids = (uint32_t *)ids;
    if (!text) text = calloc(1, 1);
    if (text) text[tlen] = 0;
    m.text = text ? text : "";
    if (finish) {
        m.finish_reason = (Pdserve__V1__FinishReason)finish;
        usage.prompt_tokens = (uint32_t)r->n_prompt;
        usage.completion_tokens = ch->completion; /* the choice's own */
        usage.cached_prompt_tokens = r->cached_tokens;
        if (usage_in && r->local_prefill) usage.cached_prompt_tokens = usage_in->cached_prompt_tokens;
        m.usage = &usage;
    }
    Pdserve__V1__TokenLogprob **lpp = NULL;
    size_t n_lp = 0;
    if (r->logprobs > 0 && lps && n_keep > 0 && (lpp = calloc(n_keep, sizeof *lpp))) {
        for (; n_lp < n_keep && lps[n_lp]; n_lp++)
            if (!(lpp[n_lp] = lp_copy(lps[n_lp], ids[n_lp], r->logprobs))) break;
        if (n_lp == n_keep) { /* one per token, or none */
            m.n_logprobs = n_keep;
            m.logprobs = lpp;
        }
    }
    if (n_keep > 0 || tlen > 0 || finish) {
        int rc = rpc_stream_send(r->call, &m.base);
        if (rc == PD_ENOSPC) finish_locked(r, RPC_STATUS_RESOURCE_EXHAUSTED, "the client reads too slowly");
    }
    free(text);
    for (size_t i = 0; i < n_lp; i++) free(lpp[i]);
    free(lpp);
    if (finish) {
        ch->ended = true;
        /* The last choice ends the call (finish_locked cancels the Decode call); one that
         * ended at a stop string before then still runs on the decode instance: end it. */
        if (++r->n_ended == r->n_choices) finish_locked(r, RPC_STATUS_OK, NULL);
        else if (!finish_in && !r->finished) end_choice_on_decode(r, c);
    }
}

/* Every choice has ended or its end is held until the prefill answer (mu held). */
static bool all_choices_final(const rreq *r)
{
    for (int32_t c = 0; c < r->n_choices; c++)
        if (!r->ch[c].ended && !r->ch[c].held_finish) return false;
    return true;
}

/* Starts an internal call of r (mu held) on inst: the call holds a reference to r; on failure
 * the public call is finished with INTERNAL naming `what`. Returns true when started. */
static bool start_internal_call(rreq *r, rtr_instance *inst, const char *path,
                                const ProtobufCMessage *msg, const ProtobufCMessageDescriptor *resp,
                                const rpc_client_callbacks *cb, rpc_client_call **slot,
                                const char *what)
{
    char err[PD_ERR_LEN];
    atomic_fetch_add(&r->refs, 1);
    rpc_metadata md = {SVC_CALLER_MD, g.caller_token};
    rpc_call_opts opts = {.timeout_ms = g.call_timeout_ms, .md = g.caller_token[0] ? &md : NULL,
                          .n_md = g.caller_token[0] ? 1 : 0};
    if (rpc_client_call_start_opts(rtr_instance_channel(inst), path, msg, resp, &opts, cb, slot,
                                   err) < 0) {
        atomic_fetch_sub(&r->refs, 1);
        char detail[PD_ERR_LEN + 32];
        snprintf(detail, sizeof detail, "cannot call %s: %.400s", what, err);
        finish_locked(r, RPC_STATUS_INTERNAL, detail);
        return false;
    }
    return true;
}

/* ---- prefill call ---- */

static void start_prefill(rreq *r, const Pdserve__Internal__V1__KvTarget *kv, const rtr_instance *exclude);
static bool migrate_locked(rreq *r, const char *reason, const rtr_instance *exclude, bool local);

static void pre_on_message(rpc_client_call *c, ProtobufCMessage *msg, void *user)
{
    rreq *r = user;
    const Pdserve__Internal__V1__PrefillResponse *p = (const void *)msg;
    pthread_mutex_lock(&r->mu);
    if (c != r->pcall || r->finished) { /* abandoned (the request moved on) or over */
        rreq_unlock(r);
        protobuf_c_message_free_unpacked(msg, NULL);
        return;
    }
    r->cached_tokens = p->cached_prompt_tokens;
    r->first_sent = true;
    if (r->n_choices > 1 && p->n_first_token_ids != (size_t)r->n_choices) {
        finish_locked(r, RPC_STATUS_INTERNAL, "the prefill instance answered another number of "
                      "choices than asked");
        rreq_unlock(r);
        protobuf_c_message_free_unpacked(msg, NULL);
        return;
    }
    for (int32_t k = 0; k < r->n_choices; k++) {
        rchoice *ch = &r->ch[k];
        uint32_t first = r->n_choices > 1 ? p->first_token_ids[k] : p->first_token_id;
        /* choice k's first token's logprobs: its own alternatives (PrefillResponse) */
        Pdserve__V1__TokenLogprob *flp =
            r->n_choices == 1 ? p->first_logprob
                              : (p->n_first_logprobs == (size_t)r->n_choices ? p->first_logprobs[k] : NULL);
        emit_locked(r, k, &first, flp ? &flp : NULL, 1, 0, NULL);
        /* Decode tokens that overtook the prefill answer. */
        if (ch->n_held || ch->held_finish)
            emit_locked(r, k, ch->held, ch->held_lp, ch->n_held, ch->held_finish,
                        ch->have_held_usage ? &ch->held_usage : NULL);
        for (size_t i = 0; i < ch->n_held; i++) free(ch->held_lp[i]);
        ch->n_held = 0;
    }
    rreq_unlock(r);
    protobuf_c_message_free_unpacked(msg, NULL);
}

static void pre_on_done(rpc_client_call *c, const rpc_status *st, void *user)
{
    rreq *r = user;
    bool retried = false;
    pthread_mutex_lock(&r->mu);
    if (c != r->pcall) { /* abandoned by a migration: the request went on without it */
        rreq_unlock(r);
        rreq_unref(r);
        return;
    }
    if (st->code == RPC_STATUS_UNAVAILABLE && !r->finished && !r->first_sent && r->kv &&
        r->prefill_tries < 3) {
        /* The prefill instance is gone or refused before answering: the decode side's
         * reservation still waits, so another prefill instance can fill it. */
        rtr_instance_failed(r->pre);
        pd_metric_add(g.m_retry_prefill, 1);
        PD_LOGW("request %s: prefill on %s unavailable (%s); retrying elsewhere", r->request_id,
                rtr_instance_addr(r->pre), st->details);
        rpc_client_call_release(r->pcall);
        r->pcall = NULL;
        start_prefill(r, r->kv, r->pre);
        retried = true;
    } else if (st->code != RPC_STATUS_OK && !r->finished) {
        if (st->code == RPC_STATUS_UNAVAILABLE || st->code == RPC_STATUS_DEADLINE_EXCEEDED)
            rtr_instance_failed(r->pre);
        PD_LOGW("request %s: prefill on %s failed: %s: %s", r->request_id,
                rtr_instance_addr(r->pre), rpc_status_name(st->code), st->details);
        /* Before the first token, an instance's failure (not the request's) restarts it with
         * the prompt computed on a decode instance. */
        const bool restart = !r->first_sent && (st->code == RPC_STATUS_UNAVAILABLE ||
                                                st->code == RPC_STATUS_DEADLINE_EXCEEDED ||
                                                st->code == RPC_STATUS_CANCELLED);
        if (restart && migrate_locked(r, "prefill_failed", NULL, true)) {
            retried = true;
        } else {
            char pub[PD_ERR_LEN];
            rtr_public_detail(st->code, st->details, "prefill", pub, sizeof pub);
            finish_locked(r, st->code == RPC_STATUS_INVALID_ARGUMENT || st->code == RPC_STATUS_CANCELLED ||
                                     st->code == RPC_STATUS_INTERNAL
                                 ? (rpc_status_code)st->code : RPC_STATUS_UNAVAILABLE,
                          pub);
        }
    }
    rreq_unlock(r);
    if (!retried) gate_release(r); /* the prompt is no longer the prefill pool's */
    rreq_unref(r);
}

static void start_prefill(rreq *r, const Pdserve__Internal__V1__KvTarget *kv, const rtr_instance *exclude)
{
    rtr_instance *p = rtr_pick_prefill(g.reg, kv->layout, r->prefix_key, r->n_prompt, exclude);
    if (!p) {
        char why[512];
        if (rtr_prefill_layout_mismatch(g.reg, kv->layout, why, sizeof why)) {
            PD_LOGW("request %s: %s", r->request_id, why);
            finish_locked(r, RPC_STATUS_FAILED_PRECONDITION, why);
            return;
        }
        /* The prefill pool is down (none up: killed, frozen, draining): the prompt is
         * computed on a decode instance instead (issue #38). */
        if (!migrate_locked(r, "prefill_down", NULL, true))
            finish_locked(r, RPC_STATUS_UNAVAILABLE, "no prefill instance can serve this model now");
        return;
    }
    rtr_instance_unref(r->pre);
    r->pre = p;
    r->prefill_tries++;
    rtr_instance_add_load(p, 0, r->n_prompt);
    rtr_note_prefix(g.reg, r->prefix_key, p);
    Pdserve__Internal__V1__PrefillRequest q = PDSERVE__INTERNAL__V1__PREFILL_REQUEST__INIT;
    q.request_id = r->request_id;
    q.n_prompt_token_ids = (size_t)r->n_prompt;
    q.prompt_token_ids = (uint32_t *)r->prompt;
    q.sampling = &r->sampling;
    q.stopping = &r->stopping;
    q.logprobs = r->logprobs;
    q.n = (uint32_t)r->n_choices;
    q.kv_target = (Pdserve__Internal__V1__KvTarget *)kv;
    rpc_client_callbacks cb = {pre_on_message, pre_on_done, r};
    start_internal_call(r, p, "/pdserve.internal.v1.Prefill/Prefill", &q.base,
                        &pdserve__internal__v1__prefill_response__descriptor, &cb, &r->pcall,
                        "prefill");
}

/* ---- decode call ---- */

static void dec_on_message(rpc_client_call *c, ProtobufCMessage *msg, void *user)
{
    rreq *r = user;
    const Pdserve__Internal__V1__DecodeResponse *d = (const void *)msg;
    pthread_mutex_lock(&r->mu);
    if (c != r->dcall) { /* abandoned by a migration */
        rreq_unlock(r);
        protobuf_c_message_free_unpacked(msg, NULL);
        return;
    }
    r->decode_answered = true;
    if (r->finished) {
        /* nothing */
    } else if (d->kind_case == PDSERVE__INTERNAL__V1__DECODE_RESPONSE__KIND_RESERVATION) {
        if (d->reservation && d->reservation->kv_target && !r->local_prefill) {
            /* Keep a copy for retries on another prefill instance. */
            size_t len = protobuf_c_message_get_packed_size(&d->reservation->kv_target->base);
            uint8_t *buf = malloc(len ? len : 1);
            if (buf) {
                protobuf_c_message_pack(&d->reservation->kv_target->base, buf);
                r->kv = pdserve__internal__v1__kv_target__unpack(NULL, len, buf);
                free(buf);
            }
            start_prefill(r, d->reservation->kv_target, NULL);
        }
    } else if (d->kind_case == PDSERVE__INTERNAL__V1__DECODE_RESPONSE__KIND_TOKENS && d->tokens) {
        const Pdserve__Internal__V1__TokenBurst *b = d->tokens;
        const int32_t ci = b->index < (uint32_t)r->n_choices ? (int32_t)b->index : -1;
        rchoice *ch = ci >= 0 ? &r->ch[ci] : NULL;
        /* the burst's logprobs, one per token when asked */
        Pdserve__V1__TokenLogprob *const *lps =
            b->n_logprobs == b->n_token_ids && b->n_token_ids > 0 ? b->logprobs : NULL;
        if (!ch) {
            finish_locked(r, RPC_STATUS_INTERNAL, "the decode instance sent a choice index out "
                          "of range");
        } else if (r->first_sent || r->local_prefill) {
            r->first_sent = true;
            emit_locked(r, ci, b->token_ids, lps, b->n_token_ids, b->finish_reason, b->usage);
        } else { /* hold until the prefill answer with the first token */
            if (ch->n_held + b->n_token_ids > ch->cap_held) {
                size_t cap = (ch->n_held + b->n_token_ids) * 2 + 8;
                uint32_t *nh = realloc(ch->held, cap * sizeof *nh);
                if (nh) ch->held = nh;
                Pdserve__V1__TokenLogprob **nl = nh ? realloc(ch->held_lp, cap * sizeof *nl) : NULL;
                if (nl) ch->held_lp = nl;
                if (nh && nl) ch->cap_held = cap;
            }
            for (size_t i = 0; i < b->n_token_ids && ch->n_held < ch->cap_held; i++) {
                ch->held_lp[ch->n_held] = lps && lps[i] && r->logprobs > 0
                                              ? lp_copy(lps[i], b->token_ids[i], r->logprobs)
                                              : NULL;
                ch->held[ch->n_held++] = b->token_ids[i];
            }
            if (b->finish_reason) ch->held_finish = b->finish_reason;
            if (b->usage) {
                ch->held_usage = *b->usage;
                ch->have_held_usage = true;
            }
        }
    }
    rreq_unlock(r);
    protobuf_c_message_free_unpacked(msg, NULL);
}

static bool start_decode(rreq *r, const rtr_instance *exclude);

static void dec_on_done(rpc_client_call *c, const rpc_status *st, void *user)
{
    rreq *r = user;
    pthread_mutex_lock(&r->mu);
    if (c != r->dcall) { /* abandoned by a migration: the request went on without it */
        rreq_unlock(r);
        rreq_unref(r);
        return;
    }
    if (!r->finished && !r->decode_answered && r->decode_tries < 3 &&
        (st->code == RPC_STATUS_UNAVAILABLE || st->code == RPC_STATUS_RESOURCE_EXHAUSTED)) {
        /* Refused before it reserved anything (gone, draining, or full): nothing was sent
         * to the client and no prefill started, so another decode instance can take it. */
        if (st->code == RPC_STATUS_UNAVAILABLE) rtr_instance_failed(r->dec);
        PD_LOGW("request %s: decode on %s refused it (%s: %s); trying another instance",
                r->request_id, rtr_instance_addr(r->dec), rpc_status_name(st->code), st->details);
        rtr_instance *prev = r->dec;
        rtr_instance_ref(prev);
        rpc_client_call_release(r->dcall);
        r->dcall = NULL;
        pd_metric_add(g.m_retry_decode, 1);
        if (!start_decode(r, prev)) {
            char pub[PD_ERR_LEN];
            rtr_public_detail(st->code, st->details, "decode", pub, sizeof pub);
            finish_locked(r, (rpc_status_code)st->code, pub);
        }
        rtr_instance_unref(prev);
    } else if (!r->finished && !(st->code == RPC_STATUS_OK && all_choices_final(r))) {
        if (st->code == RPC_STATUS_OK) {
            finish_locked(r, RPC_STATUS_INTERNAL, "the decode stream ended without a finish reason");
        } else {
            if (st->code == RPC_STATUS_UNAVAILABLE) rtr_instance_failed(r->dec);
            PD_LOGW("request %s: decode on %s failed: %s: %s", r->request_id,
                    rtr_instance_addr(r->dec), rpc_status_name(st->code), st->details);
            /* The instance's failure, not the request's: gone or failed (UNAVAILABLE), or it
             * ended the call itself (CANCELLED: shutting down past its grace period; the
             * router's own cancels finish the request first). The stream moves elsewhere. */
            const char *why = st->code == RPC_STATUS_UNAVAILABLE ? "unavailable"
                              : st->code == RPC_STATUS_CANCELLED ? "cancelled" : NULL;
            rtr_instance *prev = r->dec;
            rtr_instance_ref(prev);
            if (!why || !migrate_locked(r, why, prev, false)) {
                char pub[PD_ERR_LEN];
                rtr_public_detail(st->code, st->details, "decode", pub, sizeof pub);
                finish_locked(r, (rpc_status_code)st->code, pub);
            }
            rtr_instance_unref(prev);
        }
    }
    rreq_unlock(r);
    rreq_unref(r);
}

/* ---- conditional disaggregation ---- */


/* Whether the prefill pool is busy, for the busy rule: with --slo-ttft-ms and
 * --prefill-busy-ttft-fraction, when a prompt sent now would wait at least that fraction of
 * the objective at every prefill instance (its backlog, plus its share of the requests
 * waiting at the gate, over the prefill rate it reported); else (no objective, or an
 * instance that has not measured its rate yet) when every prefill instance has at least
 * --prefill-busy-tokens queued. *backlog: the smallest backlog in tokens, with the gate's
 * share (INT64_MAX: no prefill instance). Takes g_gate.mu, then the registry's, one at a
 * time. */
static bool prefill_busy(int64_t *backlog)
{
    pthread_mutex_lock(&g_gate.mu);
    int64_t waiting = g_gate.waiting_tokens;
    pthread_mutex_unlock(&g_gate.mu);
    int np = 0, nd = 0, nh = 0;
    rtr_registry_counts(g.reg, &np, &nd, &nh);
    const int64_t extra = waiting / (np > 0 ? np : 1);
    int64_t b = rtr_prefill_backlog_min(g.reg);
    *backlog = b == INT64_MAX ? b : b + extra;
    if (b == INT64_MAX) return false;
    if (g.slo_ttft_s > 0 && g.busy_ttft_fraction > 0) {
        double wait = rtr_prefill_wait_min(g.reg, extra);
        if (wait >= 0) return wait >= g.busy_ttft_fraction * g.slo_ttft_s;
    }
    return *backlog >= g.prefill_busy_tokens;
}

/* Where r's prompt is computed when d decodes it: on d itself (local) or on a prefill
 * instance (remote), and why, for the metric. The policy (docs/services.md): no prefill
 * instance, or a colocated d: local. Forced by --prefill-policy. Auto: a prompt of at most
 * --local-prefill-max-tokens tokens is local (it costs d about one decode step, less than a
 * transfer, a reservation round trip and a second hop); and while the prefill pool is busy
 * (prefill_busy) and d has at most a quarter of the pool's backlog queued itself (its prompt
 * backlog, this prompt included), local too (the prefill pool is the bottleneck and d has
 * room), unless d's TPOT is near the objective. --prefill-busy-tokens 0 turns the busy rule
 * off. */
static bool prefill_local(const rreq *r, const rtr_instance *d, const char **why)
{
    if (!rtr_has_prefill(g.reg) || rtr_instance_colocated(d)) {
        *why = rtr_instance_colocated(d) ? "colocated" : "no_prefill";
        return true;
    }
    /* The prefill pool is down (none of its instances is up: killed, frozen past the load
     * reports' timeout, draining): the decode instance computes the prompt, whatever the
     * policy, rather than the request failing. */
    if (rtr_prefill_usable(g.reg) == 0) {
        *why = "prefill_down";
        return true;
    }
    if (g.prefill_policy != PREFILL_AUTO) {
        *why = "forced";
        return g.prefill_policy == PREFILL_LOCAL;
    }
    if (r->n_prompt <= g.local_max_tokens) {
        *why = "short";
        return true;
    }
    if (g.prefill_busy_tokens > 0) {
        int64_t backlog;
        const bool busy = prefill_busy(&backlog);
        const int64_t dq = rtr_instance_backlog(g.reg, d);
        /* A prompt computed on d stalls the sequences d decodes: not when their TPOT is
         * already near the objective. */
        const bool tpot_room = g.slo_tpot_s <= 0 ||
                               rtr_instance_tpot(g.reg, d) < g.busy_tpot_fraction * g.slo_tpot_s;
        if (busy && dq + r->n_prompt <= backlog / 4) {
            if (tpot_room) {
                *why = "prefill_busy";
                return true;
            }
            *why = "tpot_bound";
            return false;
        }
    }
    *why = "default";
    return false;
}

/* Picks a decode instance other than exclude and opens its Decode stream (mu held). Returns
 * false when no instance can take the request (nothing started); true otherwise (a failure
 * to start the call finishes the request). */
static bool start_decode(rreq *r, const rtr_instance *exclude)
{
    rtr_instance *d = rtr_pick_decode(g.reg, exclude);
    if (!d) return false;
    const char *why = "resume";
    if (r->force_local && !r->resume) why = "restart";
    r->local_prefill = r->resume || r->force_local || prefill_local(r, d, &why);
    if (!r->local_prefill && g.prefill_queue_tokens > 0 && !r->gate_passed) {
        if (!gate_admit(r)) { /* waits for the prefill pool, holding nothing */
            rtr_instance_unref(d);
            return true;
        }
        r->gate_passed = true;
    }
    if (r->local_prefill) gate_release(r); /* (admitted earlier, now computed on d) */
    rtr_instance_unref(r->dec);
    r->dec = d;
    r->decode_tries++;
    if (!r->where_counted) {
        r->where_counted = true;
        char l[96] = "";
        pd_metrics_label(l, sizeof l, "where", r->local_prefill ? "local" : "remote");
        pd_metrics_label(l, sizeof l, "why", why);
        pd_metric_add(pd_mfamily_series(g.m_where, l), 1);
    }
    /* the prompt's blocks are shared by its choices; each choice grows its own */
    rtr_instance_add_load(d, (r->n_prompt + (int64_t)r->n_choices * r->stopping.max_tokens + 15) / 16,
                          r->local_prefill ? r->n_prompt : 0);
    Pdserve__Internal__V1__DecodeRequest q = PDSERVE__INTERNAL__V1__DECODE_REQUEST__INIT;
    q.request_id = r->request_id;
    q.n_prompt_token_ids = (size_t)r->n_prompt;
    q.prompt_token_ids = (uint32_t *)r->prompt;
    q.sampling = &r->sampling;
    q.stopping = &r->stopping;
    q.logprobs = r->logprobs;
    q.local_prefill = r->local_prefill;
    q.n = (uint32_t)r->n_choices;
    r->end_key = 0;
    while (r->n_choices > 1 && !r->end_key) r->end_key = pd_random_u64(); /* a new one per call */
    q.end_key = r->end_key;
    /* A migration resumes every choice still going from the tokens it sent (see
     * migrate_locked): the choices that ended are over. */
    Pdserve__Internal__V1__ResumeChoice rc[RTR_MAX_CHOICES], *rcp[RTR_MAX_CHOICES];
    if (r->resume) {
        for (int32_t c = 0; c < r->n_choices; c++) {
            if (r->ch[c].ended) continue;
            Pdserve__Internal__V1__ResumeChoice *x = &rc[q.n_resume];
            pdserve__internal__v1__resume_choice__init(x);
            x->index = (uint32_t)c;
            x->n_token_ids = r->ch[c].n_sent;
            x->token_ids = r->ch[c].sent;
            rcp[q.n_resume++] = x;
        }
        q.resume = rcp;
    }
    rpc_client_callbacks cb = {dec_on_message, dec_on_done, r};
    start_internal_call(r, d, "/pdserve.internal.v1.Decode/Decode", &q.base,
                        &pdserve__internal__v1__decode_response__descriptor, &cb, &r->dcall,
                        "decode");
    return true;
}

/* Restarts r elsewhere after an instance failed it (mu held; r not finished): the calls in
 * flight are abandoned (cancelled; their callbacks find another call in their slot and only
 * drop their references), tokens held for the first one are dropped, and a new Decode call
 * starts on a decode instance other than exclude. When the client has tokens already, that
 * call resumes every choice still going from the tokens it was sent (DecodeRequest.resume,
 * the prompt computed there): the engine continues each exactly as it would have gone on
 * (same seed stream, output positions, penalties, limits), the detokenizers and stop-string
 * matchers here go on as they were, so the client sees one stream, nothing missing or
 * repeated. Before the first token the request simply starts again (local: on the decode
 * instance, whatever the policy). reason labels pdserve_router_migrations_total. Returns
 * false (nothing changed) past --max-migrations or when a choice cannot be resumed; true
 * otherwise (no decode instance to go to finishes the request UNAVAILABLE). */
static bool migrate_locked(rreq *r, const char *reason, const rtr_instance *exclude, bool local)
{
    if (r->finished || r->migrations >= g.max_migrations) return false;
    bool any_sent = r->first_sent;
    for (int32_t c = 0; c < r->n_choices; c++) {
        if (r->ch[c].sent_lost && !r->ch[c].ended) return false;
        any_sent |= r->ch[c].n_sent > 0;
    }
    r->migrations++;
    char l[96] = "";
    pd_metrics_label(l, sizeof l, "reason", reason);
    pd_metric_add(pd_mfamily_series(g.m_migrations, l), 1);
    PD_LOGW("request %s: %s on %s; %s (migration %d of at most %lld)", r->request_id, reason,
            exclude ? rtr_instance_addr(exclude) : r->pre ? rtr_instance_addr(r->pre) : "?",
            any_sent ? "resuming elsewhere from the tokens sent" : "starting again",
            r->migrations, (long long)g.max_migrations);
    if (r->dcall) {
        rpc_client_call_cancel(r->dcall);
        rpc_client_call_release(r->dcall);
        r->dcall = NULL;
    }
    if (r->pcall) {
        rpc_client_call_cancel(r->pcall);
        rpc_client_call_release(r->pcall);
        r->pcall = NULL;
    }
    gate_release(r);
    r->gate_passed = false;
    if (r->kv) protobuf_c_message_free_unpacked(&r->kv->base, NULL);
    r->kv = NULL;
    for (int32_t c = 0; c < r->n_choices; c++) {
        rchoice *ch = &r->ch[c];
        for (size_t i = 0; i < ch->n_held && ch->held_lp; i++) free(ch->held_lp[i]);
        ch->n_held = 0;
        ch->held_finish = 0;
        ch->have_held_usage = false;
    }
    r->decode_answered = false;
    r->decode_tries = 0;
    r->prefill_tries = 0;
    r->resume = any_sent;
    r->force_local = local;
    if (!start_decode(r, exclude))
        finish_locked(r, RPC_STATUS_UNAVAILABLE, "its decode instance failed and no other decode "
                      "instance is available");
    return true;
}

/* ---- stall watch ----
 * Every live request is in a list, so that when an instance stalls (no progress for
 * --stall-timeout-ms: frozen, unreachable, or its engine stuck; see the registry) the watcher
 * thread moves the requests it holds: a Decode stream resumes elsewhere (migrate_locked,
 * "stalled"), a prompt waiting on a stalled prefill instance starts again. The frozen
 * instance's calls are cancelled; when it runs again it frees what they held.
 *
 * Lock order: g_live.mu is a leaf. The watcher takes a reference to a listed request only
 * while its count is above zero, and the last unref removes the request under g_live.mu
 * before freeing it, so the watcher never revives a request being freed; it locks requests
 * one at a time, with g_live.mu released. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rreq *head;
    bool stop, started;
    pthread_t th;
} g_live = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void live_add(rreq *r)
{
    pthread_mutex_lock(&g_live.mu);
    r->live_prev = NULL;
    r->live_next = g_live.head;
    if (g_live.head) g_live.head->live_prev = r;
    g_live.head = r;
    pthread_mutex_unlock(&g_live.mu);
}

static void live_remove(rreq *r)
{
    pthread_mutex_lock(&g_live.mu);
    if (r->live_prev) r->live_prev->live_next = r->live_next;
    else if (g_live.head == r) g_live.head = r->live_next;
    if (r->live_next) r->live_next->live_prev = r->live_prev;
    r->live_next = r->live_prev = NULL;
    pthread_mutex_unlock(&g_live.mu);
}

/* Takes a reference unless the count already reached zero (the request is being freed). */
static bool try_ref(rreq *r)
{
    int n = atomic_load(&r->refs);
    while (n > 0)
        if (atomic_compare_exchange_weak(&r->refs, &n, n + 1)) return true;
    return false;
}

/* Moves r off a stalled instance (see above). */
static void unstall(rreq *r)
{
    pthread_mutex_lock(&r->mu);
    if (!r->finished && r->dcall && r->dec && rtr_instance_stalled(g.reg, r->dec)) {
        /* Only to a decode instance that can take it: with none, the stream waits for its
         * own to go on (a slow instance is not a dead one). */
        /* Past --max-migrations too: a stalled instance is not a failed one (a dead one
         * fails the call, and that ends the request). */
        if (rtr_decode_usable(g.reg, r->dec) > 0) {
            rtr_instance *prev = r->dec;
            rtr_instance_ref(prev);
            (void)migrate_locked(r, "stalled", prev, false);
            rtr_instance_unref(prev);
        }
    } else if (!r->finished && r->pcall && !r->first_sent && r->pre &&
               rtr_instance_stalled(g.reg, r->pre) && rtr_decode_usable(g.reg, NULL) > 0) {
        (void)migrate_locked(r, "stalled", NULL, false);
    }
    rreq_unlock(r);
}

static void *watch_loop(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_live.mu);
    while (!g_live.stop) {
        pthread_mutex_unlock(&g_live.mu);
        if (rtr_registry_stalled(g.reg) > 0) {
            /* the listed requests, referenced, then each on its own */
            size_t n = 0, cap = 0;
            rreq **v = NULL;
            pthread_mutex_lock(&g_live.mu);
            for (rreq *r = g_live.head; r; r = r->live_next) {
                if (n == cap) {
                    size_t nc = cap ? 2 * cap : 256;
                    rreq **nv = realloc(v, nc * sizeof *nv);
                    if (!nv) break; /* out of memory: the rest next time */
                    v = nv;
                    cap = nc;
                }
                if (try_ref(r)) v[n++] = r;
            }
            pthread_mutex_unlock(&g_live.mu);
            for (size_t i = 0; i < n; i++) {
                unstall(v[i]);
                rreq_unref(v[i]);
            }
            free(v);
        }
        pthread_mutex_lock(&g_live.mu);
        if (g_live.stop) break;
        cond_wait_ms(&g_live.cv, &g_live.mu, 100);
    }
    pthread_mutex_unlock(&g_live.mu);
    return NULL;
}

/* ---- public API ---- */

static void on_cancel(rpc_call *call, void *user)
{
    (void)call;
    rreq *r = user;
    pthread_mutex_lock(&r->mu);
    bool waited = false;
    if (!r->finished) {
        r->finished = true;
        account_locked(r, rpc_call_remaining_ms(call) <= 0 ? RPC_STATUS_DEADLINE_EXCEEDED
                                                             : RPC_STATUS_CANCELLED);
        rpc_call_unref(r->call);
        if (r->dcall) rpc_client_call_cancel(r->dcall);
        if (r->pcall) rpc_client_call_cancel(r->pcall);
        waited = gate_withdraw(r); /* cancelled while waiting for the prefill pool */
    }
    rreq_unlock(r);
    if (waited) rreq_unref(r); /* the waiting list's reference */
}

static uint64_t prefix_key(const int32_t *ids, int32_t n)
{
    /* The chained block hash of the first (up to 4) full blocks of 16 tokens: the same value
     * the instances' prefix caches compute for their first blocks (docs/kv-blocks.md). */
    const int32_t bs = 16;
    int32_t nb = (n - 1) / bs;
    if (nb > 4) nb = 4;
    uint64_t h = 0;
    for (int32_t i = 0; i < nb; i++) h = pd_block_hash(h, ids + i * bs, bs);
    return h;
}

/* GenerateRequest.messages: rendered with the model's chat template (with the assistant
 * turn's opening) and tokenized without added special tokens (the template writes them). */
static int render_chat(const Pdserve__V1__GenerateRequest *q, int32_t **ids, int32_t *n, char *err)
{
    chat_message *m = calloc(q->n_messages, sizeof *m);
    if (!m) return pd_errf(err, PD_ENOMEM, "out of memory");
    for (size_t i = 0; i < q->n_messages; i++) {
        m[i].role = q->messages[i]->role;
        m[i].content = q->messages[i]->content;
    }
    char *text = NULL, e2[PD_ERR_LEN];
    int rc = chat_template_render(g.chat, m, (int)q->n_messages, true, &text, e2);
    free(m);
    if (rc < 0) return pd_errf(err, PD_EINVAL, "messages: %s", e2);
    rc = tok_encode(g.tok, text, strlen(text), false, ids, n, err);
    free(text);
    return rc;
}

void rtr_handle_generate(rpc_call *call, const ProtobufCMessage *msg, void *user)
{
    (void)user;
    const Pdserve__V1__GenerateRequest *q = (const void *)msg;
    char err[PD_ERR_LEN];
    double t_arrival = now_s();
    bool has_text = q->prompt && q->prompt[0], has_ids = q->n_prompt_token_ids > 0;
    bool has_chat = q->n_messages > 0;
    if (has_text + has_ids + has_chat != 1) {
        reject(call, RPC_STATUS_INVALID_ARGUMENT, "give exactly one of prompt, prompt_token_ids "
               "and messages");
        return;
    }
    if (has_chat && q->n_messages > 1024) {
        reject(call, RPC_STATUS_INVALID_ARGUMENT, "messages: at most 1024 (got %zu)", q->n_messages);
        return;
    }
    for (size_t i = 0; has_chat && i < q->n_messages; i++)
        if (!q->messages[i] || !q->messages[i]->role || !q->messages[i]->role[0]) {
            reject(call, RPC_STATUS_INVALID_ARGUMENT, "messages[%zu].role is empty", i);
            return;
        }
    if (has_chat && !g.chat) { /* (the reason, with server paths, is in the router's log) */
        reject(call, RPC_STATUS_FAILED_PRECONDITION, "messages: the served model has no usable "
               "chat template (tokenizer_config.json chat_template)");
        return;
    }
    /* Strings arrive valid UTF-8 without NUL bytes (the rpc layer checks the wire). The checks
     * are the instances' (svc_request_check), in two steps here: the limits and conversions
     * now, before a pending slot is taken and a text or chat prompt tokenized, and
     * svc_prompt_check once the prompt is tokens. */
    if (svc_request_limits_check(q->request_id, q->stopping, q->logprobs, q->n,
                                 RTR_MAX_CHOICES, err) < 0) {
        reject(call, RPC_STATUS_INVALID_ARGUMENT, "%s", err);
        return;
    }
    smp_params sp;
    seq_stopping ss;
    if (svc_sampling_from_proto(q->sampling, &sp, err) < 0 ||
        svc_stopping_from_proto(q->stopping, 1, &ss, err) < 0) {
        reject(call, RPC_STATUS_INVALID_ARGUMENT, "%s", err);
        return;
    }
    if (atomic_fetch_add(&g.pending, 1) >= g.max_pending) {
        atomic_fetch_sub(&g.pending, 1);
        reject(call, RPC_STATUS_RESOURCE_EXHAUSTED, "the router has %lld requests in "
                          "flight (--max-pending); retry later", (long long)g.max_pending);
        return;
    }
    rreq *r = calloc(1, sizeof *r);
    if (!r) {
        atomic_fetch_sub(&g.pending, 1);
        reject(call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    atomic_init(&r->refs, 1);
    pthread_mutex_init(&r->mu, NULL);
    live_add(r);
    r->t_arrival = t_arrival;
    if (q->request_id && q->request_id[0]) snprintf(r->request_id, sizeof r->request_id, "%s", q->request_id);
    else snprintf(r->request_id, sizeof r->request_id, "req-%llu", (unsigned long long)atomic_fetch_add(&g.next_id, 1));
    int rc = 0;
    const char *bad = NULL;
    if ((has_text || has_chat) && !g.tok) {
        bad = "this model has no tokenizer; send prompt_token_ids";
    } else if (has_chat) {
        rc = render_chat(q, &r->prompt, &r->n_prompt, err);
        if (rc < 0) bad = err;
        else if (r->n_prompt == 0) bad = "the conversation renders to no tokens";
    } else if (has_text) {
        rc = tok_encode(g.tok, q->prompt, strlen(q->prompt), true, &r->prompt, &r->n_prompt, err);
        if (rc < 0) bad = err;
        else if (r->n_prompt == 0) bad = "the prompt encodes to no tokens";
    } else if (svc_prompt_check(q->prompt_token_ids, q->n_prompt_token_ids, g.cfg.vocab_size,
                                g.cfg.max_position, err) < 0) {
        bad = err; /* the instances' check of prompt ids (svc_request_check makes it too) */
    } else {
        r->n_prompt = (int32_t)q->n_prompt_token_ids;
        r->prompt = malloc(q->n_prompt_token_ids * sizeof *r->prompt);
        if (!r->prompt) bad = "out of memory";
        for (size_t i = 0; !bad && i < q->n_prompt_token_ids; i++)
            r->prompt[i] = (int32_t)q->prompt_token_ids[i];
    }
    /* A tokenized prompt (text or chat: its ids are the tokenizer's, in range) is held to the
     * length svc_prompt_check holds ids to. */
    if (!bad && r->n_prompt >= g.cfg.max_position) {
        snprintf(err, sizeof err, "the prompt has %d tokens; the model's maximum length is %d",
                 r->n_prompt, g.cfg.max_position);
        bad = err;
    }
    int64_t room = g.cfg.max_position - r->n_prompt;
    if (!bad && q->stopping && q->stopping->max_tokens_set_case && q->stopping->max_tokens > room) {
        snprintf(err, sizeof err, "prompt (%d tokens) + max_tokens (%u) exceeds the model's "
                 "maximum length of %d", r->n_prompt, q->stopping->max_tokens, g.cfg.max_position);
        bad = err;
    }
    if (bad) {
        reject(call, rc == PD_ENOMEM ? RPC_STATUS_RESOURCE_EXHAUSTED : RPC_STATUS_INVALID_ARGUMENT, "%s", bad);
        rreq_unref(r);
        return;
    }
    /* Normalized parameters for both instances: an unset seed gets one here, so that prefill
     * and decode draw from the same per-request stream. */
    if (!sp.has_seed) {
        sp.seed = pd_random_u64(); /* OS-seeded: differs across restarts and replicas */
        sp.has_seed = true;
    }
    svc_sampling_to_proto(&sp, &r->sampling);
    pdserve__v1__stopping_criteria__init(&r->stopping);
    r->stopping.max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
    r->stopping.max_tokens = (q->stopping && q->stopping->max_tokens_set_case)
                                 ? q->stopping->max_tokens
                                 : (uint32_t)(g.default_max_tokens < room ? g.default_max_tokens : room);
    r->stopping.min_tokens = (uint32_t)ss.min_tokens;
    r->stopping.ignore_eos = ss.ignore_eos;
    r->stopping.n_stop_token_ids = q->stopping ? q->stopping->n_stop_token_ids : 0;
    r->stopping.stop_token_ids = q->stopping ? q->stopping->stop_token_ids : NULL;
    r->logprobs = q->logprobs;
    r->prefix_key = prefix_key(r->prompt, r->n_prompt);
    r->n_choices = q->n > 1 ? (int32_t)q->n : 1;
    bool oom = !(r->ch = calloc((size_t)r->n_choices, sizeof *r->ch));
    for (int32_t c = 0; !oom && c < r->n_choices; c++)
        oom = (g.tok && tok_stream_create(g.tok, true, &r->ch[c].detok) < 0) ||
              stopstr_create(q->stopping ? (const char *const *)q->stopping->stop : NULL,
                             q->stopping ? (int)q->stopping->n_stop : 0, &r->ch[c].stops) < 0;
    if (oom) {
        reject(call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        rreq_unref(r);
        return;
    }
    r->call = call;
    rpc_call_ref(call);
    pthread_mutex_lock(&r->mu);
    if (!start_decode(r, NULL))
        finish_locked(r, RPC_STATUS_UNAVAILABLE, "no decode instance is available");
    rreq_unlock(r);
    rpc_call_set_cancel_cb(call, on_cancel, r);
    rreq_unref(r); /* the handler's reference; the calls hold theirs */
}

void rtr_handle_tokenize(rpc_call *call, const ProtobufCMessage *msg, void *user)
{
    (void)user;
    const Pdserve__V1__TokenizeRequest *q = (const void *)msg;
    int32_t *ids = NULL, n = 0;
    char err[PD_ERR_LEN];
    if (!g.tok) {
        rpc_stream_finish(call, RPC_STATUS_FAILED_PRECONDITION, "this model has no tokenizer");
        return;
    }
    int rc = tok_encode(g.tok, q->text ? q->text : "", q->text ? strlen(q->text) : 0,
                        q->add_special_tokens, &ids, &n, err);
    if (rc < 0) {
        rpc_stream_finish(call, svc_status_for(rc), "%s", err);
        return;
    }
    Pdserve__V1__TokenizeResponse resp = PDSERVE__V1__TOKENIZE_RESPONSE__INIT;
    resp.n_token_ids = (size_t)n;
    resp.token_ids = (uint32_t *)ids;
    rpc_call_reply(call, &resp.base);
    free(ids);
}

void rtr_handle_model_info(rpc_call *call, const ProtobufCMessage *msg, void *user)
{
    (void)msg;
    (void)user;
    Pdserve__V1__GetModelInfoResponse resp = PDSERVE__V1__GET_MODEL_INFO_RESPONSE__INIT;
    uint32_t eos[MC_MAX_EOS];
    for (int i = 0; i < g.cfg.n_eos; i++) eos[i] = (uint32_t)g.cfg.eos_token_ids[i];
    resp.model_name = g.model_name;
    resp.architecture = g.cfg.arch_name;
    resp.max_model_len = (uint32_t)g.cfg.max_position;
    resp.vocab_size = (uint32_t)g.cfg.vocab_size;
    resp.n_eos_token_ids = (size_t)g.cfg.n_eos;
    resp.eos_token_ids = eos;
    if (g.cfg.bos_token_id >= 0) {
        resp.bos_token_id_set_case = PDSERVE__V1__GET_MODEL_INFO_RESPONSE__BOS_TOKEN_ID_SET_BOS_TOKEN_ID;
        resp.bos_token_id = (uint32_t)g.cfg.bos_token_id;
    }
    rpc_call_reply(call, &resp.base);
}


/* ---- the threads ---- */

int rtr_requests_start(char *err)
{
    if (g.prefill_queue_tokens > 0) {
        if (pthread_create(&g_gate.th, NULL, gate_loop, NULL) != 0)
            return pd_errf(err, PD_ENOMEM, "cannot start the prefill gate's thread");
        g_gate.started = true;
    }
    if (pthread_create(&g_live.th, NULL, watch_loop, NULL) != 0)
        return pd_errf(err, PD_ENOMEM, "cannot start the stall watcher's thread");
    g_live.started = true;
    return 0;
}

void rtr_requests_stop(void)
{
    if (g_gate.started) {
        pthread_mutex_lock(&g_gate.mu);
        g_gate.stop = true;
        pthread_cond_signal(&g_gate.cv);
        pthread_mutex_unlock(&g_gate.mu);
        pthread_join(g_gate.th, NULL);
        g_gate.started = false;
    }
    if (g_live.started) {
        pthread_mutex_lock(&g_live.mu);
        g_live.stop = true;
        pthread_cond_signal(&g_live.cv);
        pthread_mutex_unlock(&g_live.mu);
        pthread_join(g_live.th, NULL);
        g_live.started = false;
    }
}

void rtr_gate_counts(int64_t *waiting, int64_t *admitted)
{
    pthread_mutex_lock(&g_gate.mu);
    *waiting = g_gate.n_waiting;
    *admitted = g_gate.admitted;
    pthread_mutex_unlock(&g_gate.mu);
}
