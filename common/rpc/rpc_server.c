/* rpc_server.c -- The gRPC server: parameters, method registry, start (listen, worker threads
 * polling one completion queue, request slots per method plus the catch-all slot that answers
 * UNIMPLEMENTED), the health service, and the graceful shutdown sequence. The per-call state
 * machine is in rpc_call.c. */
#include "common/rpc/rpc_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/grpc_security.h>

#include "common/log.h"
#include "grpc/health/v1/health.pb-c.h"

#define HEALTH_SERVICE "grpc.health.v1.Health"

rpc_server_params rpc_server_default_params(void)
{
    rpc_server_params p;
    memset(&p, 0, sizeof p);
    p.listen_addr = "0.0.0.0:50051";
    p.n_threads = 2;
    p.max_recv_msg_bytes = 4 << 20;
    p.max_send_msg_bytes = -1;
    p.max_concurrent_streams = 0;
    p.stream_queue_max = 64;
    p.requests_per_method = 8;
    p.health_drain_ms = 0;
    p.shutdown_grace_ms = 5000;
    p.handshake_timeout_ms = 10000;
    p.reuse_port = false;
    return p;
}

static void on_health_check(rpc_call *call, const ProtobufCMessage *req, void *user);

static char *dup_str(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* Whether a listen address names a port gRPC will bind as written: "host:port" with port
 * 0..65535 (an IPv6 host in brackets), or "unix:path". gRPC itself takes "localhost" as port
 * 443 and an out-of-range port as "any free port". */
static bool listen_addr_ok(const char *a)
{
    if (!strncmp(a, "unix:", 5)) return a[5] != 0;
    const char *c = strrchr(a, ':');
    if (!c || c == a) return false;
    if (strchr(a, ':') != c && !(a[0] == '[' && c > a && c[-1] == ']')) return false;
    size_t n = strlen(c + 1);
    if (n == 0 || n > 5 || strspn(c + 1, "0123456789") != n) return false;
    return atol(c + 1) <= 65535;
}

int rpc_server_create(const rpc_server_params *p, rpc_server **out, char *err)
{
    *out = NULL;
    if (!p->listen_addr || !*p->listen_addr)
        return pd_errf(err, PD_EINVAL, "rpc server: listen_addr is empty");
    if (!listen_addr_ok(p->listen_addr))
        return pd_errf(err, PD_EINVAL, "rpc server: listen address '%s' needs host:port with a "
                       "port in 0..65535 (0 = any free port; IPv6 as [::1]:port)",
                       p->listen_addr);
    if (p->n_threads < 1 || p->n_threads > 256)
        return pd_errf(err, PD_EINVAL, "rpc server: n_threads %d not in [1, 256]", p->n_threads);
    if (p->stream_queue_max < 1)
        return pd_errf(err, PD_EINVAL, "rpc server: stream_queue_max %d < 1",
                       p->stream_queue_max);
    if (p->requests_per_method < 1)
        return pd_errf(err, PD_EINVAL, "rpc server: requests_per_method %d < 1",
                       p->requests_per_method);
    if (p->max_recv_msg_bytes == 0 || p->max_recv_msg_bytes < -1 || p->max_send_msg_bytes == 0 ||
        p->max_send_msg_bytes < -1)
        return pd_errf(err, PD_EINVAL, "rpc server: message size limits must be > 0 or -1");
    if (p->health_drain_ms < 0 || p->shutdown_grace_ms < 0 || p->max_concurrent_streams < 0)
        return pd_errf(err, PD_EINVAL, "rpc server: negative time or stream limit");
    if (p->handshake_timeout_ms < 1)
        return pd_errf(err, PD_EINVAL, "rpc server: handshake_timeout_ms %d < 1",
                       p->handshake_timeout_ms);
    rpc__tls_server *tls = NULL;
    int trc = rpc__tls_server_create(&p->tls, &tls, err);
    if (trc != 0) return trc;

    rpc_server *s = calloc(1, sizeof *s);
    if (!s) {
        rpc__tls_server_free(tls);
        return pd_errf(err, PD_ENOMEM, "rpc server: out of memory");
    }
    s->p = *p;
    memset(&s->p.tls, 0, sizeof s->p.tls); /* the paths live in s->tls */
    s->tls = tls;
    s->listen_addr = dup_str(p->listen_addr);
    if (!s->listen_addr) {
        rpc__tls_server_free(tls);
        free(s);
        return pd_errf(err, PD_ENOMEM, "rpc server: out of memory");
    }
    s->p.listen_addr = s->listen_addr;
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    atomic_init(&s->serving, false);
    s->shutdown_tag = (rpc__tag){RPC__TAG_SHUTDOWN, s};
    rpc__global_init();
    grpc_init();

    int rc = rpc_server_register(s, &grpc__health__v1__health__descriptor, "Check", RPC_UNARY,
                                 on_health_check, s, err);
    if (rc != 0) {
        rpc_server_destroy(s);
        return rc;
    }
    *out = s;
    return 0;
}

static int add_service_name(rpc_server *s, const char *name)
{
    for (int i = 0; i < s->n_services; i++)
        if (strcmp(s->services[i], name) == 0) return 0;
    char **v = realloc(s->services, (size_t)(s->n_services + 1) * sizeof *v);
    if (!v) return PD_ENOMEM;
    s->services = v;
    if (!(v[s->n_services] = dup_str(name))) return PD_ENOMEM;
    s->n_services++;
    return 0;
}

int rpc_server_register_path(rpc_server *s, const char *path, const char *service_name,
                             const ProtobufCMessageDescriptor *request, rpc_method_kind kind,
                             rpc_handler_fn handler, void *user, char *err)
{
    if (s->started) return pd_errf(err, PD_ESTATE, "rpc server: register %s after start", path);
    if (!path || path[0] != '/' || !request || !handler ||
        (kind != RPC_UNARY && kind != RPC_SERVER_STREAMING && kind != RPC_BIDI_STREAMING))
        return pd_errf(err, PD_EINVAL, "rpc server: bad method registration (%s)",
                       path ? path : "NULL");
    for (int i = 0; i < s->n_methods; i++)
        if (strcmp(s->methods[i]->path, path) == 0)
            return pd_errf(err, PD_EINVAL, "rpc server: %s registered twice", path);
    if (service_name && add_service_name(s, service_name) != 0)
        return pd_errf(err, PD_ENOMEM, "rpc server: out of memory");
    rpc__method **v = realloc(s->methods, (size_t)(s->n_methods + 1) * sizeof *v);
    if (!v) return pd_errf(err, PD_ENOMEM, "rpc server: out of memory");
    s->methods = v;
    rpc__method *m = calloc(1, sizeof *m);
    if (!m || !(m->path = dup_str(path))) {
        free(m);
        return pd_errf(err, PD_ENOMEM, "rpc server: out of memory");
    }
    m->req_desc = request;
    m->kind = kind;
    m->handler = handler;
    m->user = user;
    v[s->n_methods++] = m;
    return 0;
}

int rpc_server_register(rpc_server *s, const ProtobufCServiceDescriptor *svc,
                        const char *method, rpc_method_kind kind, rpc_handler_fn handler,
                        void *user, char *err)
{
    for (unsigned i = 0; i < svc->n_methods; i++) {
        if (strcmp(svc->methods[i].name, method) != 0) continue;
        char path[512];
        snprintf(path, sizeof path, "/%s/%s", svc->name, method);
        return rpc_server_register_path(s, path, svc->name, svc->methods[i].input, kind,
                                        handler, user, err);
    }
    return pd_errf(err, PD_ENOTFOUND, "rpc server: service %s has no method %s", svc->name,
                   method);
}

/* ---- health ---- */

static void on_health_check(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    rpc_server *s = user;
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    bool known = r->service[0] == '\0';
    for (int i = 0; !known && i < s->n_services; i++)
        known = strcmp(s->services[i], r->service) == 0;
    if (!known) {
        rpc_stream_finish(call, RPC_STATUS_NOT_FOUND, "unknown service \"%s\"", r->service);
        return;
    }
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = atomic_load(&s->serving)
                      ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    rpc_call_reply(call, &resp.base);
}

void rpc_server_set_serving(rpc_server *s, bool serving) { atomic_store(&s->serving, serving); }

/* ---- request slots and counters (called from rpc_call.c) ---- */

void rpc__server_post(rpc_server *s, const rpc__method *m)
{
    pthread_mutex_lock(&s->mu);
    if (s->shutting_down || !s->server) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    rpc_call *c = rpc__call_alloc(s, m);
    if (!c) {
        pthread_mutex_unlock(&s->mu);
        PD_LOGE("rpc: out of memory posting a request slot for %s", m ? m->path : "*");
        return;
    }
    grpc_call_error e;
    if (m) /* bidi calls arrive without a request: they read theirs (rpc__call_on_recv) */
        e = grpc_server_request_registered_call(
            s->server, m->handle, &c->call, &c->deadline, &c->md,
            m->kind == RPC_BIDI_STREAMING ? NULL : &c->payload, s->cq, s->cq, &c->tag_new);
    else
        e = grpc_server_request_call(s->server, &c->call, &c->details, &c->md, s->cq, s->cq,
                                     &c->tag_new);
    if (e == GRPC_CALL_OK) s->pending++;
    pthread_mutex_unlock(&s->mu);
    if (e != GRPC_CALL_OK) {
        PD_LOGE("rpc: request slot for %s refused (grpc_call_error %d)", m ? m->path : "*",
                (int)e);
        rpc__call_free_unused(c);
    }
}

void rpc__server_slot_done(rpc_server *s)
{
    pthread_mutex_lock(&s->mu);
    s->pending--;
    if (s->pending == 0) pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void rpc__server_call_delivered(rpc_server *s)
{
    pthread_mutex_lock(&s->mu);
    s->live++;
    if (s->live > s->live_peak) s->live_peak = s->live;
    pthread_mutex_unlock(&s->mu);
}

void rpc__server_call_freed(rpc_server *s)
{
    pthread_mutex_lock(&s->mu);
    s->live--;
    PD_ASSERT(s->live >= 0, "rpc server: live call count below zero");
    if (s->live == 0) pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---- workers ---- */

static void *worker_main(void *arg)
{
    rpc_server *s = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                   NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        rpc__tag *t = ev.tag;
        switch (t->kind) {
        case RPC__TAG_NEW: rpc__call_on_new(t->obj, ev.success != 0); break;
        case RPC__TAG_CLOSE: rpc__call_on_close(t->obj, ev.success != 0); break;
        case RPC__TAG_SEND: rpc__call_on_send(t->obj, ev.success != 0); break;
        case RPC__TAG_RECV: rpc__call_on_recv(t->obj, ev.success != 0); break;
        case RPC__TAG_SHUTDOWN:
            pthread_mutex_lock(&s->mu);
            s->shutdown_tag_done = true;
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&s->mu);
            break;
        }
    }
    return NULL;
}

/* Stops the workers and frees the completion queue (the server object is gone already). */
static void stop_workers(rpc_server *s)
{
    if (s->cq) {
        grpc_completion_queue_shutdown(s->cq);
        for (int i = 0; i < s->n_threads_started; i++) pthread_join(s->threads[i], NULL);
        if (s->n_threads_started == 0) { /* no worker ever ran: drain here */
            for (;;) {
                grpc_event ev = grpc_completion_queue_next(
                    s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
                if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
            }
        }
        grpc_completion_queue_destroy(s->cq);
        s->cq = NULL;
    }
    s->n_threads_started = 0;
    free(s->threads);
    s->threads = NULL;
}

int rpc_server_start(rpc_server *s, char *err)
{
    if (s->started) return pd_errf(err, PD_ESTATE, "rpc server: already started");
    int rc = 0;
    grpc_arg args[5];
    int n = 0;
    args[n].type = GRPC_ARG_INTEGER;
    args[n].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[n++].value.integer = s->p.max_recv_msg_bytes;
    args[n].type = GRPC_ARG_INTEGER;
    args[n].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[n++].value.integer = s->p.max_send_msg_bytes;
    args[n].type = GRPC_ARG_INTEGER;
    args[n].key = GRPC_ARG_ALLOW_REUSEPORT;
    args[n++].value.integer = s->p.reuse_port ? 1 : 0;
    args[n].type = GRPC_ARG_INTEGER;
    args[n].key = GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS;
    args[n++].value.integer = s->p.handshake_timeout_ms;
    if (s->p.max_concurrent_streams > 0) {
        args[n].type = GRPC_ARG_INTEGER;
        args[n].key = GRPC_ARG_MAX_CONCURRENT_STREAMS;
        args[n++].value.integer = s->p.max_concurrent_streams;
    }
    grpc_channel_args cargs = {(size_t)n, args};
    s->server = grpc_server_create(&cargs, NULL);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    s->threads = calloc((size_t)s->p.n_threads, sizeof *s->threads);
    if (!s->server || !s->cq || !s->threads) {
        rc = pd_errf(err, PD_ENOMEM, "rpc server: out of memory");
        goto fail;
    }
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    for (int i = 0; i < s->n_methods; i++) {
        rpc__method *m = s->methods[i];
        grpc_server_register_method_payload_handling ph =
            m->kind == RPC_BIDI_STREAMING ? GRPC_SRM_PAYLOAD_NONE
                                          : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER;
        m->handle = grpc_server_register_method(s->server, m->path, NULL, ph, 0);
        if (!m->handle) {
            rc = pd_errf(err, PD_EINVAL, "rpc server: grpc refused method %s", m->path);
            goto fail;
        }
    }
    grpc_server_credentials *creds = NULL;
    if (s->tls) {
        rc = rpc__tls_server_creds(s->tls, &creds, err);
        if (rc != 0) goto fail;
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    s->port = grpc_server_add_http2_port(s->server, s->listen_addr, creds);
    grpc_server_credentials_release(creds);
    if (s->port == 0) {
        rc = pd_errf(err, PD_EIO, "rpc server: cannot listen on %s (address in use or invalid)",
                     s->listen_addr);
        goto fail;
    }
    for (int i = 0; i < s->p.n_threads; i++) {
        if (pthread_create(&s->threads[i], NULL, worker_main, s) != 0) {
            rc = pd_errf(err, PD_ENOMEM, "rpc server: cannot start a worker thread: %s",
                         strerror(errno));
            goto fail;
        }
        s->n_threads_started++;
    }
    grpc_server_start(s->server);
    pthread_mutex_lock(&s->mu);
    s->started = true;
    pthread_mutex_unlock(&s->mu);
    for (int k = 0; k < s->p.requests_per_method; k++) {
        for (int i = 0; i < s->n_methods; i++) rpc__server_post(s, s->methods[i]);
        rpc__server_post(s, NULL);
    }
    atomic_store(&s->serving, true);
    PD_LOGI("rpc: listening on %s (port %d, %s), %d worker threads, %d methods", s->listen_addr,
            s->port, s->tls ? "TLS" : "plaintext", s->p.n_threads, s->n_methods);
    return 0;

fail:
    if (s->server) grpc_server_destroy(s->server); /* never started: no calls exist */
    s->server = NULL;
    stop_workers(s);
    s->port = 0;
    return rc;
}

int rpc_server_port(const rpc_server *s) { return s->started ? s->port : 0; }

int64_t rpc_server_live_calls(const rpc_server *s)
{
    rpc_server *m = (rpc_server *)s;
    pthread_mutex_lock(&m->mu);
    int64_t n = m->live;
    pthread_mutex_unlock(&m->mu);
    return n;
}

void rpc_server_stats_get(const rpc_server *s, rpc_server_stats *out)
{
    rpc_server *m = (rpc_server *)s;
    out->calls_started = atomic_load(&m->n_started);
    out->calls_cancelled = atomic_load(&m->n_cancelled);
    out->calls_unimplemented = atomic_load(&m->n_unimplemented);
    out->calls_bad_request = atomic_load(&m->n_bad_request);
    out->msgs_sent = atomic_load(&m->n_msgs_sent);
    out->tls_reloads = rpc__tls_server_reloads(m->tls);
    pthread_mutex_lock(&m->mu);
    out->live_calls_peak = m->live_peak;
    pthread_mutex_unlock(&m->mu);
}

/* ---- shutdown ---- */

static struct timespec mono_after_ms(int64_t ms)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

int rpc_server_shutdown(rpc_server *s)
{
    pthread_mutex_lock(&s->mu);
    if (!s->started || s->shutting_down) {
        /* Not started, or another thread shuts down: wait for it to finish. */
        while (s->started && !s->shut_down) pthread_cond_wait(&s->cv, &s->mu);
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    pthread_mutex_unlock(&s->mu);

    atomic_store(&s->serving, false);
    if (s->p.health_drain_ms > 0) {
        PD_LOGI("rpc: health NOT_SERVING; closing the listener in %d ms", s->p.health_drain_ms);
        struct timespec d = {s->p.health_drain_ms / 1000,
                             (long)(s->p.health_drain_ms % 1000) * 1000000L};
        while (nanosleep(&d, &d) != 0 && errno == EINTR) {
        }
    }

    pthread_mutex_lock(&s->mu);
    s->shutting_down = true;
    int64_t live0 = s->live;
    pthread_mutex_unlock(&s->mu);
    PD_LOGI("rpc: shutting down: %lld calls in flight, grace %d ms", (long long)live0,
            s->p.shutdown_grace_ms);
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);

    int n_cancelled = 0;
    struct timespec until = mono_after_ms(s->p.shutdown_grace_ms);
    pthread_mutex_lock(&s->mu);
    while (!s->shutdown_tag_done) {
        if (pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT) break;
    }
    if (!s->shutdown_tag_done) {
        n_cancelled = (int)s->live;
        pthread_mutex_unlock(&s->mu);
        PD_LOGW("rpc: grace period over; cancelling %d calls", n_cancelled);
        grpc_server_cancel_all_calls(s->server);
        pthread_mutex_lock(&s->mu);
    }
    /* Core is done once the tag completes; our own references (calls still held by the
     * application, request slots) must go too before the server can be destroyed. */
    for (int waited_s = 0; !s->shutdown_tag_done || s->live > 0 || s->pending > 0;) {
        until = mono_after_ms(1000);
        if (pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT && ++waited_s % 5 == 0)
            PD_LOGW("rpc: shutdown waits for %lld calls still referenced%s", (long long)s->live,
                    s->shutdown_tag_done ? "" : " (core not done)");
    }
    pthread_mutex_unlock(&s->mu);

    grpc_server_destroy(s->server);
    s->server = NULL;
    stop_workers(s);

    pthread_mutex_lock(&s->mu);
    s->shut_down = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    PD_LOGI("rpc: server stopped (%d calls cancelled at the end of the grace period)",
            n_cancelled);
    return n_cancelled;
}

void rpc_server_destroy(rpc_server *s)
{
    if (!s) return;
    if (s->started) rpc_server_shutdown(s);
    for (int i = 0; i < s->n_methods; i++) {
        free(s->methods[i]->path);
        free(s->methods[i]);
    }
    free(s->methods);
    for (int i = 0; i < s->n_services; i++) free(s->services[i]);
    free(s->services);
    rpc__fds_free(s->reflection);
    free(s->listen_addr);
    rpc__tls_server_free(s->tls); /* the grpc_server (and its fetcher) is gone */
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    grpc_shutdown();
}
