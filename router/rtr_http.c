/* rtr_http.c -- The OpenAI-compatible HTTP server of the router (see rtr_http.h): libmicrohttpd's
 * event loop on a few threads (MHD_OPTION_THREAD_POOL_SIZE), no thread per connection. A
 * generation request starts one Generate call per prompt (its n choices: GenerateRequest.n) on
 * the loopback channel; the calls' callbacks (the channel's completion thread) only queue their
 * messages on the request and resume its connection, and MHD's thread turns them into JSON or
 * SSE chunks. With nothing to send the connection is suspended (MHD_suspend_connection: out of
 * the event loop, not subject to the idle timeout), from the access handler before the response
 * exists and from the content reader of a stream. A suspended socket is not polled by MHD, so
 * the watcher (rtr_http_watch.c) looks for hang-ups (EPOLLRDHUP) on it and resumes it; MHD then
 * closes the connection and the request-completed callback cancels the calls. The watcher also
 * closes connections that have not sent a complete request by a deadline (slow headers or body),
 * while MHD closes idle ones (MHD_OPTION_CONNECTION_TIMEOUT) and limits connections in all and
 * per client address.
 *
 * A request (hreq) is freed when its last reference goes: MHD's (dropped in the request-
 * completed callback), a streamed response's (its free callback), one per call until its
 * on_done ran, and the watcher's while it reports a hang-up. The calls' handles are released
 * then. Lock order: a request's mu, then the watcher's, then MHD's own (suspend and resume
 * take the daemon's cleanup mutex; MHD holds a response's mutex while it calls the content
 * reader, which takes the request's). Whoever clears hreq.suspended under mu resumes. */
#include "router/rtr_http.h"

#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>

#include "common/log.h"
#include "common/net.h"
#include "common/random.h"
#include "router/rtr_http_impl.h"

enum { EP_OTHER = 0, EP_COMPLETIONS, EP_CHAT, EP_MODELS, EP_MODEL, EP_HEALTH, EP_N };
static const char *const ep_names[EP_N] = {"other", "/v1/completions", "/v1/chat/completions",
                                           "/v1/models", "/v1/models/{id}", "/health"};

struct rtr_http {
    oai_ctx ctx;
    struct MHD_Daemon *d;
    hwatch *w;
    rpc_channel *ch;
    int port;
    int64_t timeout_ms, max_body;
    atomic_int draining, stopping;
    int (*instances_up)(void *user);
    void *user;
    pd_mfamily *m_req;              /* pdserve_http_requests_total{endpoint,code} */
    pd_metric *m_live;              /* pdserve_http_requests_in_flight */
    pd_metric *m_conns;             /* pdserve_http_connections */
    pd_metric *m_timeouts;          /* pdserve_http_request_timeouts_total */
};

/* File descriptors kept for the rest of the router (instance channels, logs, /metrics) when
 * the connection limit is fitted to RLIMIT_NOFILE. */
enum { FD_RESERVE = 256 };

static const char GEN_PATH[] = "/pdserve.v1.Generation/Generate";

rtr_http_params rtr_http_default_params(void)
{
    rtr_http_params p;
    memset(&p, 0, sizeof p);
    p.timeout_ms = 600000;
    p.max_body_bytes = 4 << 20;
    p.max_connections = 4096;
    p.per_ip_connections = 1024;
    p.n_threads = 2;
    p.idle_timeout_s = 30;
    p.request_timeout_s = 10;
    p.max_choices = 16;
    return p;
}

/* ---- requests ---- */

static hreq *hreq_new(rtr_http *h, struct MHD_Connection *c)
{
    hreq *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    atomic_init(&r->refs, 1);
    r->h = h;
    r->ctx = &h->ctx;
    r->conn = c;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    r->hc = ci ? ci->socket_context : NULL;
    r->job.logprobs = -1;
    pthread_mutex_init(&r->mu, NULL);
    pd_metric_add(h->m_live, 1);
    return r;
}

static void hreq_unref(hreq *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    for (int i = 0; i < r->n_choices; i++) {
        rpc_client_call_release(r->choices[i].call);
        free(r->choices[i].text);
        json_decref(r->choices[i].lp);
        tok_stream_destroy(r->choices[i].lp_stream);
    }
    free(r->choices);
    for (oai_event *e = r->head, *n; e; e = n) {
        n = e->next;
        if (e->msg) protobuf_c_message_free_unpacked(e->msg, NULL);
        free(e);
    }
    oai_job_free(&r->job);
    pd_metric_add(r->h->m_live, -1);
    free(r->body);
    free(r->out);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

void hreq_out(hreq *r, const char *s, size_t len)
{
    if (r->out_len + len > r->out_cap) {
        size_t cap = (r->out_len + len) * 2 + 256;
        char *n = realloc(r->out, cap);
        if (!n) {
            r->oom = true;
            return;
        }
        r->out = n;
        r->out_cap = cap;
    }
    memcpy(r->out + r->out_len, s, len);
    r->out_len += len;
}

/* Resumes the request's connection when it is suspended; r->mu held. MHD then calls the
 * access handler or the content reader again. */
static void wake(hreq *r)
{
    if (!r->suspended) return;
    r->suspended = false;
    MHD_resume_connection(r->conn);
}

/* Marks the request over and cancels its calls that still run (their events are dropped);
 * r->mu held. */
static void cancel_locked(hreq *r)
{
    r->gone = true;
    for (int i = 0; i < r->n_choices; i++)
        if (r->choices[i].call) rpc_client_call_cancel(r->choices[i].call); /* never blocks */
}

static void hreq_cancel(hreq *r)
{
    pthread_mutex_lock(&r->mu);
    cancel_locked(r);
    pthread_mutex_unlock(&r->mu);
}

/* ---- the watcher's callbacks (rtr_http_watch.c) ---- */

static void watch_ref(void *obj) { atomic_fetch_add(&((hreq *)obj)->refs, 1); }

/* The client of a watched request hung up: cancel its calls now, and let MHD close the
 * connection (resumed, the handler or the reader sees hup). */
static void watch_hangup(void *obj)
{
    hreq *r = obj;
    pthread_mutex_lock(&r->mu);
    r->hup = true;
    cancel_locked(r);
    wake(r);
    pthread_mutex_unlock(&r->mu);
    hreq_unref(r); /* the watcher's */
}

/* rtr_http_stop: no connection may stay suspended when MHD stops (stopping is set, so none
 * suspends again). */
static void stop_resume(void *obj)
{
    hreq *r = obj;
    pthread_mutex_lock(&r->mu);
    wake(r);
    pthread_mutex_unlock(&r->mu);
    hreq_unref(r);
}

/* ---- the calls' callbacks (the channel's completion thread; they never block) ---- */

static void push_event(hreq *r, oai_event *e)
{
    e->next = NULL;
    if (r->tail) r->tail->next = e;
    else r->head = e;
    r->tail = e;
    wake(r);
}

static void cb_message(rpc_client_call *call, ProtobufCMessage *msg, void *user)
{
    (void)call;
    oai_choice *c = user;
    hreq *r = c->r;
    const uint32_t j = ((const Pdserve__V1__GenerateResponse *)msg)->index;
    if (j >= (uint32_t)r->job.n) { /* not one of the prompt's choices: dropped */
        protobuf_c_message_free_unpacked(msg, NULL);
        return;
    }
    oai_event *e = calloc(1, sizeof *e);
    pthread_mutex_lock(&r->mu);
    if (!r->gone && e) {
        e->choice = c->index + (int)j;
        e->msg = msg;
        push_event(r, e);
        e = NULL;
        msg = NULL;
    } else if (!e) {
        r->ev_oom = true;
        wake(r);
        rpc_client_call_cancel(call);
    }
    pthread_mutex_unlock(&r->mu);
    free(e);
    if (msg) protobuf_c_message_free_unpacked(msg, NULL);
}

static void cb_done(rpc_client_call *call, const rpc_status *st, void *user)
{
    (void)call;
    oai_choice *c = user;
    hreq *r = c->r;
    oai_event *e = calloc(1, sizeof *e);
    pthread_mutex_lock(&r->mu);
    r->n_live--;
    if (e && !r->gone) {
        e->choice = c->index;
        e->code = st->code;
        snprintf(e->detail, sizeof e->detail, "%s", st->details);
        push_event(r, e);
        e = NULL;
    } else {
        if (!e) r->ev_oom = true;
        wake(r); /* (a request whose events are dropped is not suspended: wake for safety) */
    }
    pthread_mutex_unlock(&r->mu);
    free(e);
    hreq_unref(r); /* the call's reference */
}

/* ---- MHD's threads ---- */

static bool all_done(const hreq *r) { return r->n_done == r->n_choices; }

/* Records the first failure; a streamed response carries it as an event. Cancels the other
 * choices. */
static void fail(hreq *r, const oai_err *e)
{
    if (r->failed) return;
    r->failed = true;
    r->err = *e;
    if (r->headers_sent) oai_stream_error(r);
    hreq_cancel(r);
}

/* Turns the queued events into JSON (r->out or the choices). */
static void process_events(hreq *r)
{
    pthread_mutex_lock(&r->mu);
    oai_event *e = r->head;
    r->head = r->tail = NULL;
    bool oom = r->ev_oom;
    int live = r->n_live;
    pthread_mutex_unlock(&r->mu);
    while (e) {
        oai_event *next = e->next;
        if (e->msg) {
            if (!r->failed) oai_apply(r, e->choice, (const Pdserve__V1__GenerateResponse *)e->msg);
            protobuf_c_message_free_unpacked(e->msg, NULL);
        } else {
            for (int j = 0; j < r->job.n; j++) { /* the call's end ends the prompt's choices */
                oai_choice *c = &r->choices[e->choice + j];
                if (c->done) continue;
                c->done = true;
                r->n_done++;
                oai_err err;
                if (oai_call_error(r, c, e->code, e->detail, &err)) fail(r, &err);
            }
        }
        free(e);
        e = next;
    }
    if ((oom || r->oom || (live == 0 && !all_done(r))) && !r->failed) {
        oai_err err; /* (every call ended, yet not every end arrived: only out of memory) */
        oai_errf(&err, 500, NULL, NULL, "out of memory");
        fail(r, &err);
    }
}

/* True when the client hung up or the server stops: the connection is to be closed. */
static bool hreq_gone(hreq *r)
{
    pthread_mutex_lock(&r->mu);
    const bool hup = r->hup;
    pthread_mutex_unlock(&r->mu);
    return hup || atomic_load(&r->h->stopping);
}

/* Suspends the connection until an event arrives (a callback resumes it), unless one is
 * queued already, the calls are over, the client hung up or the server stops. Returns true
 * when it suspended. Called from the access handler or the content reader only (MHD's rule). */
static bool hreq_suspend(hreq *r)
{
    bool ok = false;
    pthread_mutex_lock(&r->mu);
    if (!r->head && !r->ev_oom && r->n_live > 0 && !r->hup && !atomic_load(&r->h->stopping)) {
        r->suspended = true;
        MHD_suspend_connection(r->conn);
        ok = true;
    }
    pthread_mutex_unlock(&r->mu);
    return ok;
}

static enum MHD_Result reply(hreq *r, unsigned status, const char *type, char *body)
{
    /* (A response queued before the body is in makes MHD read no more of the connection.) */
    hw_conn_serving(r->h->w, r->hc);
    if (!body) {
        static char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                            "\"param\":null,\"code\":null}}";
        status = 500;
        body = strdup(oom);
        if (!body) return MHD_NO;
    }
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (status == 405)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW,
                                r->endpoint == EP_COMPLETIONS || r->endpoint == EP_CHAT ? "POST" : "GET, HEAD");
    char l[96] = "", code[8];
    snprintf(code, sizeof code, "%u", status);
    pd_metrics_label(l, sizeof l, "endpoint", ep_names[r->endpoint]);
    pd_metrics_label(l, sizeof l, "code", code);
    pd_metric_add(pd_mfamily_series(r->h->m_req, l), 1);
    enum MHD_Result rc = MHD_queue_response(r->conn, status, resp);
    MHD_destroy_response(resp);
    return rc;
}

static enum MHD_Result reply_error(hreq *r, const oai_err *e)
{
    return reply(r, (unsigned)e->status, "application/json", oai_error_body(e));
}

static enum MHD_Result reply_errf(hreq *r, int status, const char *param, const char *code,
                                  const char *msg)
{
    oai_err e;
    oai_errf(&e, status, param, code, "%s", msg);
    return reply_error(r, &e);
}

/* The content reader of a streamed response: hands out r->out; with nothing to hand out it
 * suspends the connection and returns 0 (a callback resumes it, and MHD calls again). */
static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    hreq *r = cls;
    for (;;) {
        if (r->out_off < r->out_len) {
            size_t n = r->out_len - r->out_off;
            if (n > max) n = max;
            memcpy(buf, r->out + r->out_off, n);
            r->out_off += n;
            if (r->out_off == r->out_len) r->out_off = r->out_len = 0;
            return (ssize_t)n;
        }
        if (r->sse_closed) return MHD_CONTENT_READER_END_OF_STREAM;
        if (all_done(r) || r->failed) {
            oai_stream_end(r);
            r->sse_closed = true;
            continue;
        }
        if (hreq_gone(r)) {
            hreq_cancel(r);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        process_events(r);
        if (r->out_len > 0 || all_done(r) || r->failed) continue;
        if (hreq_suspend(r)) return 0;
    }
}

static void sse_free(void *cls) { hreq_unref(cls); }

/* The deadline of the request's calls: the server's, or the client's X-Stainless-Timeout
 * (seconds; the openai SDKs send it) when that is shorter. */
static int64_t request_timeout_ms(hreq *r)
{
    int64_t t = r->h->timeout_ms;
    const char *v = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "X-Stainless-Timeout");
    if (v) {
        char *end;
        double s = strtod(v, &end);
        if (end != v && s > 0 && s * 1000.0 < (double)t) t = (int64_t)(s * 1000.0) > 0 ? (int64_t)(s * 1000.0) : 1;
    }
    return t;
}

static void make_id(hreq *r, const char *prefix)
{
    uint64_t a = pd_random_u64(), b = pd_random_u64();
    snprintf(r->id, sizeof r->id, "%s%016llx%08llx", prefix, (unsigned long long)a,
             (unsigned long long)(b >> 32));
    r->created = (int64_t)time(NULL);
}

static enum MHD_Result respond(hreq *r);

/* POST /v1/completions and /v1/chat/completions (the body is complete). */
static enum MHD_Result generate(hreq *r, int kind)
{
    rtr_http *h = r->h;
    if (atomic_load(&h->draining))
        return reply_errf(r, 503, NULL, NULL, "the server is shutting down; retry on another replica");
    if (!r->hc) /* (never: on_connection shuts a connection without a slot down) */
        return reply_errf(r, 503, NULL, NULL, "the server is out of connection slots; retry");
    oai_err e;
    if (oai_parse(&h->ctx, kind, r->body ? r->body : "", r->body_len, &r->job, &e) != 0)
        return reply_error(r, &e);
    r->n_choices = r->job.n_prompts * r->job.n;
    r->choices = calloc((size_t)r->n_choices, sizeof *r->choices);
    if (!r->choices) return reply(r, 500, "application/json", NULL);
    make_id(r, kind == OAI_CHAT ? "chatcmpl-" : "cmpl-");
    rpc_call_opts opts = {.timeout_ms = request_timeout_ms(r)};
    for (int i = 0; i < r->n_choices; i++) {
        r->choices[i].r = r;
        r->choices[i].index = i;
    }
    for (int p = 0; p < r->job.n_prompts; p++) { /* one call per prompt: its n choices */
        oai_choice *c = &r->choices[p * r->job.n];
        Pdserve__V1__GenerateRequest q;
        Pdserve__V1__SamplingParams s;
        oai_job_request(&r->job, p, &q, &s);
        char rid[80], err[PD_ERR_LEN];
        snprintf(rid, sizeof rid, "%s-%d", r->id, p);
        q.request_id = rid;
        rpc_client_callbacks cb = {cb_message, cb_done, c};
        pthread_mutex_lock(&r->mu);
        r->n_live++;
        pthread_mutex_unlock(&r->mu);
        atomic_fetch_add(&r->refs, 1);
        if (rpc_client_call_start_opts(h->ch, GEN_PATH, &q.base,
                                       &pdserve__v1__generate_response__descriptor, &opts, &cb,
                                       &c->call, err) < 0) {
            pthread_mutex_lock(&r->mu);
            r->n_live--;
            pthread_mutex_unlock(&r->mu);
            atomic_fetch_sub(&r->refs, 1);
            PD_LOGW("http %s: cannot start a Generate call: %s", r->id, err);
            oai_errf(&e, 500, NULL, NULL, "cannot start the generation: %s", err);
            hreq_cancel(r);
            return reply_error(r, &e);
        }
    }
    oai_job_free_inputs(&r->job);
    r->started = true;
    /* Watched until completed: hang-ups, and rtr_http_stop resumes it. (Should epoll fail,
     * a hang-up is noticed when a write fails or the calls end.) */
    if (hw_watch(h->w, r->hc, r) == PD_EIO) PD_LOGW("http %s: cannot watch for a hang-up", r->id);
    r->watched = true;
    return respond(r);
}

/* The response of a generation whose calls started: called right after they started and
 * again after every resume. Streamed: waits for the first chunk (an error before it is an
 * ordinary HTTP error). Not streamed: waits for every choice. Waiting is a suspension. */
static enum MHD_Result respond(hreq *r)
{
    rtr_http *h = r->h;
    for (;;) {
        if (hreq_gone(r)) {
            hreq_cancel(r);
            return MHD_NO; /* the client is gone or the server stops: close */
        }
        process_events(r);
        if (r->failed || all_done(r) || (r->job.stream && r->out_len > 0)) break;
        if (hreq_suspend(r)) return MHD_YES; /* no response yet: MHD calls again on resume */
    }
    if (r->failed) return reply_error(r, &r->err);
    if (!r->job.stream) return reply(r, 200, "application/json", oai_final_body(r));
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_read, r, sse_free);
    if (!resp) {
        hreq_cancel(r);
        return MHD_NO;
    }
    atomic_fetch_add(&r->refs, 1); /* the response's, dropped by sse_free */
    r->headers_sent = true;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    char l[96] = "";
    pd_metrics_label(l, sizeof l, "endpoint", ep_names[r->endpoint]);
    pd_metrics_label(l, sizeof l, "code", "200");
    pd_metric_add(pd_mfamily_series(h->m_req, l), 1);
    enum MHD_Result rc = MHD_queue_response(r->conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return rc;
}

static int route(const char *url)
{
    if (!strcmp(url, "/v1/completions")) return EP_COMPLETIONS;
    if (!strcmp(url, "/v1/chat/completions")) return EP_CHAT;
    if (!strcmp(url, "/v1/models")) return EP_MODELS;
    if (!strncmp(url, "/v1/models/", 11) && url[11]) return EP_MODEL;
    if (!strcmp(url, "/health")) return EP_HEALTH;
    return EP_OTHER;
}

static enum MHD_Result get(hreq *r, const char *url)
{
    rtr_http *h = r->h;
    if (r->endpoint == EP_HEALTH) {
        if (atomic_load(&h->draining))
            return reply_errf(r, 503, NULL, NULL, "the server is shutting down");
        if (h->instances_up && h->instances_up(h->user) <= 0)
            return reply_errf(r, 503, NULL, NULL, "no decode instance is up");
        return reply(r, 200, "application/json", strdup("{\"status\":\"ok\"}"));
    }
    if (r->endpoint == EP_MODELS) return reply(r, 200, "application/json", oai_models_body(&h->ctx, NULL));
    char *body = oai_models_body(&h->ctx, url + 11);
    if (!body)
        return reply_errf(r, 404, "model", "model_not_found", "The model does not exist (GET /v1/models).");
    return reply(r, 200, "application/json", body);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **state)
{
    (void)version;
    rtr_http *h = cls;
    hreq *r = *state;
    if (!r) { /* the headers: route now, refuse early when the body need not be read */
        if (!(r = hreq_new(h, conn))) return MHD_NO;
        *state = r;
        r->endpoint = route(url);
        bool post = r->endpoint == EP_COMPLETIONS || r->endpoint == EP_CHAT;
        if (r->endpoint == EP_OTHER)
            return reply_errf(r, 404, NULL, "not_found", "no such path; the API is POST "
                              "/v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health");
        if (post ? strcmp(method, MHD_HTTP_METHOD_POST)
                 : strcmp(method, MHD_HTTP_METHOD_GET) && strcmp(method, MHD_HTTP_METHOD_HEAD))
            return reply_errf(r, 405, NULL, "method_not_allowed",
                              post ? "use POST for this path" : "use GET for this path");
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > (unsigned long long)h->max_body) r->too_large = true;
        if (r->too_large) goto too_large;
        return MHD_YES;
    }
    if (r->started) return respond(r); /* resumed */
    if (*upload_size) { /* a piece of the body */
        size_t n = *upload_size;
        *upload_size = 0;
        if (r->too_large || r->body_len + n > (size_t)h->max_body) {
            r->too_large = true;
            return MHD_YES; /* discard; answered at the end */
        }
        if (r->body_len + n + 1 > r->body_cap) {
            size_t cap = (r->body_len + n + 1) * 2;
            if (cap > (size_t)h->max_body + 1) cap = (size_t)h->max_body + 1;
            char *b = realloc(r->body, cap);
            if (!b) return MHD_NO;
            r->body = b;
            r->body_cap = cap;
        }
        memcpy(r->body + r->body_len, upload, n);
        r->body_len += n;
        r->body[r->body_len] = 0;
        return MHD_YES;
    }
    hw_conn_serving(h->w, r->hc); /* the request is in: no deadline until it is answered */
    if (r->too_large) goto too_large;
    if (r->endpoint == EP_COMPLETIONS) return generate(r, OAI_COMPLETIONS);
    if (r->endpoint == EP_CHAT) return generate(r, OAI_CHAT);
    return get(r, url);
too_large:;
    char msg[128];
    snprintf(msg, sizeof msg, "the request body is larger than %lld bytes", (long long)h->max_body);
    return reply_errf(r, 413, NULL, "request_too_large", msg);
}

/* The request ended: answered, or the connection closes (the client went, a write failed,
 * the server stops). Its calls are cancelled; the connection may carry another request. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **state,
                         enum MHD_RequestTerminationCode toe)
{
    (void)conn;
    (void)toe;
    rtr_http *h = cls;
    hreq *r = *state;
    if (!r) return;
    *state = NULL;
    if (r->watched) hw_unwatch(h->w, r->hc);
    hw_conn_waiting(h->w, r->hc);
    hreq_cancel(r);
    hreq_unref(r); /* MHD's */
}

/* A connection opens or closes (MHD calls CLOSED before it closes the socket): its watcher
 * slot. Without a slot (never: the slots are as many as the connection limit) it is shut
 * down at once. */
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    rtr_http *h = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        hw_conn *c = ci ? hw_conn_open(h->w, ci->connect_fd) : NULL;
        if (!c && ci) {
            PD_LOGW("http: no connection slot left: closing a new connection");
            shutdown(ci->connect_fd, SHUT_RDWR);
        }
        *socket_context = c;
        pd_metric_add(h->m_conns, 1);
    } else if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        hw_conn_close(h->w, *socket_context);
        *socket_context = NULL;
        pd_metric_add(h->m_conns, -1);
    }
}

/* ---- server ---- */

int rtr_http_split_hostport(const char *s, char *host, size_t host_len, int *port)
{
    const char *colon = strrchr(s, ':');
    if (!colon || !colon[1]) return PD_EINVAL;
    const char *h = s;
    size_t hl = (size_t)(colon - s);
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') h++, hl -= 2;
    else if (memchr(h, ':', hl)) return PD_EINVAL; /* a v6 address needs brackets */
    if (hl >= host_len) return PD_EINVAL;
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end || p < 0 || p > 65535) return PD_EINVAL;
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = (int)p;
    return 0;
}

int rtr_http_loopback_target(const char *grpc_listen, int port, char *out, size_t len)
{
    char host[256];
    int p;
    if (rtr_http_split_hostport(grpc_listen, host, sizeof host, &p) < 0) return PD_EINVAL;
    const char *h = host;
    bool v6 = strchr(host, ':') != NULL;
    if (!host[0] || !strcmp(host, "0.0.0.0")) h = "127.0.0.1", v6 = false;
    else if (!strcmp(host, "::")) h = "::1";
    int n = snprintf(out, len, v6 ? "[%s]:%d" : "%s:%d", h, port);
    return n > 0 && (size_t)n < len ? 0 : PD_EINVAL;
}

int rtr_http_start(const rtr_http_params *p, rtr_http **out, char *err)
{
    *out = NULL;
    char host[256];
    int port;
    if (!p->listen || rtr_http_split_hostport(p->listen, host, sizeof host, &port) < 0)
        return pd_errf(err, PD_EINVAL, "--http-listen %s: give host:port ([v6]:port)",
                       p->listen ? p->listen : "(null)");
    if (!p->grpc_target || !p->grpc_target[0] || p->timeout_ms < 1 || p->max_body_bytes < 1 ||
        p->max_connections < 1 || p->per_ip_connections < 0 || p->n_threads < 1 ||
        p->idle_timeout_s < 1 || p->request_timeout_s < 0 || p->max_choices < 1)
        return pd_errf(err, PD_EINVAL, "http: bad parameters");
    /* Every connection holds a descriptor: fit the limit to what RLIMIT_NOFILE leaves. */
    int max_conns = p->max_connections;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        (rlim_t)max_conns + FD_RESERVE > rl.rlim_cur) {
        max_conns = rl.rlim_cur > (rlim_t)FD_RESERVE + 16 ? (int)(rl.rlim_cur - FD_RESERVE) : 16;
        PD_LOGW("http: %d connections need more file descriptors than RLIMIT_NOFILE (%llu) "
                "allows; serving at most %d (raise the limit: ulimit -n)", p->max_connections,
                (unsigned long long)rl.rlim_cur, max_conns);
    }
    if (max_conns < p->n_threads) max_conns = p->n_threads; /* (MHD: one per thread at least) */
    struct addrinfo *res = NULL;
    char why[PD_ERR_LEN];
    if (pd_net_listen_addr(host, port, &res, why) < 0)
        return pd_errf(err, PD_EINVAL, "--http-listen %s: %s", p->listen, why);
    rtr_http *h = calloc(1, sizeof *h);
    if (!h) {
        freeaddrinfo(res);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    snprintf(h->ctx.model_name, sizeof h->ctx.model_name, "%s", p->model_name ? p->model_name : "");
    h->ctx.tok = p->tok;
    snprintf(h->ctx.system_fingerprint, sizeof h->ctx.system_fingerprint, "%s",
             p->system_fingerprint ? p->system_fingerprint : "");
    h->ctx.max_choices = p->max_choices;
    h->ctx.max_model_len = p->max_model_len;
    h->ctx.created = (int64_t)time(NULL);
    h->timeout_ms = p->timeout_ms;
    h->max_body = p->max_body_bytes;
    h->instances_up = p->instances_up;
    h->user = p->user;
    atomic_init(&h->draining, 0);
    atomic_init(&h->stopping, 0);
    if (p->metrics) {
        h->m_req = pd_metrics_family(p->metrics, PD_METRIC_COUNTER, "pdserve_http_requests_total",
                                     "OpenAI-compatible HTTP requests answered, by endpoint and "
                                     "status code (a stream counts when its headers go out)", NULL, 0);
        h->m_live = pd_metrics_gauge(p->metrics, "pdserve_http_requests_in_flight", NULL,
                                     "OpenAI-compatible HTTP requests being served");
        h->m_conns = pd_metrics_gauge(p->metrics, "pdserve_http_connections", NULL,
                                      "open connections of the OpenAI-compatible HTTP server");
        h->m_timeouts = pd_metrics_counter(p->metrics, "pdserve_http_request_timeouts_total", NULL,
                                           "HTTP connections closed because their request "
                                           "(headers and body) was not in by its deadline");
    }
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = p->grpc_target;
    int rc = rpc_channel_create(&cp, &h->ch, err);
    if (rc < 0) {
        freeaddrinfo(res);
        rtr_http_stop(h);
        return rc;
    }
    hw_params wp = {.max_conns = max_conns,
                    .request_timeout_ms = (int64_t)p->request_timeout_s * 1000,
                    .idle_timeout_ms = (int64_t)p->idle_timeout_s * 1000,
                    .ref = watch_ref,
                    .hangup = watch_hangup,
                    .m_timeouts = h->m_timeouts};
    if ((rc = hw_create(&wp, &h->w, err)) < 0) {
        freeaddrinfo(res);
        rtr_http_stop(h);
        return rc;
    }
    /* MHD_USE_AUTO: epoll on Linux (no FD_SETSIZE bound). */
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_ALLOW_SUSPEND_RESUME;
    if (res->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    h->d = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, on_request, h,
                            MHD_OPTION_SOCK_ADDR, res->ai_addr,
                            MHD_OPTION_THREAD_POOL_SIZE, (unsigned)p->n_threads,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, h,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)p->idle_timeout_s,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)max_conns,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)p->per_ip_connections,
                            MHD_OPTION_LISTEN_BACKLOG_SIZE, (unsigned)1024,
                            MHD_OPTION_END);
    freeaddrinfo(res);
    if (!h->d) {
        rtr_http_stop(h);
        return pd_errf(err, PD_EIO, "cannot serve HTTP on %s (address in use?)", p->listen);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info ? info->port : port;
    PD_LOGI("http: serving on port %d: %d threads, at most %d connections (%d per client "
            "address), idle timeout %d s, request deadline %d s", h->port, p->n_threads,
            max_conns, p->per_ip_connections, p->idle_timeout_s, p->request_timeout_s);
    *out = h;
    return 0;
}

int rtr_http_port(const rtr_http *h) { return h ? h->port : 0; }

void rtr_http_drain(rtr_http *h)
{
    if (h) atomic_store(&h->draining, 1);
}

void rtr_http_stop(rtr_http *h)
{
    if (!h) return;
    atomic_store(&h->draining, 1);
    atomic_store(&h->stopping, 1);
    /* A suspended request is watched (from its calls' start): resume them all, for MHD
     * aborts when it stops with a connection suspended. One that would suspend later sees
     * stopping first. */
    hw_each_watched(h->w, stop_resume);
    if (h->d) MHD_stop_daemon(h->d); /* every request completed: their calls are cancelled */
    hw_destroy(h->w);                /* (after MHD: the connections' slots are back) */
    rpc_channel_destroy(h->ch);      /* waits for the calls' on_done: the last requests go */
    free(h);
}
