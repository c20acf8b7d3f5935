/* rpc_call.c -- One server-side call: its state machine (arrival, request decode, handler,
 * outbound queue with one send in flight, status, close, cancellation) and the thread-safe
 * functions handlers and engine threads use on it.
 *
 * Life of a call: the NEW tag completes (core filled call, deadline, metadata, payload); we
 * post RECV_CLOSE_ON_SERVER alone (it completes when the call is over, with cancelled=1 on a
 * client cancel, deadline or server cancel), decode the request and run the handler. Replies
 * go through a ring of serialized messages: one SEND batch at a time (initial metadata rides
 * with the first, the status with the last). A call is freed when its reference count drops to
 * 0: holders (the dispatch, the application) plus core batches in flight.
 *
 * Bidi calls (RPC_BIDI_STREAMING) arrive without a request: we post one RECV_MESSAGE at a time
 * and run the handler for each message that arrives, then post the next one once the handler
 * returned and the outbound queue has room (else rpc__call_on_send posts it when a send
 * completes); a NULL message (the client half-closed) runs the handler once more with req
 * NULL. The dispatch holder stays with the call as the "reader" until then, so that a call
 * between two requests is not taken for dropped. Reading stops for good when the call is
 * finished or cancelled; a handler never starts after that, and rpc_stream_finish waits for
 * one that runs on another thread. */
#include "common/rpc/rpc_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>

#include "common/log.h"

static atomic_ullong g_call_ids = 1;

rpc_call *rpc__call_alloc(rpc_server *s, const rpc__method *m)
{
    rpc_call *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->q_cap = (m && m->kind != RPC_UNARY) ? s->p.stream_queue_max : 1;
    c->q = calloc((size_t)c->q_cap, sizeof *c->q);
    if (!c->q) {
        free(c);
        return NULL;
    }
    c->srv = s;
    c->m = m;
    c->id = atomic_fetch_add(&g_call_ids, 1);
    c->tag_new = (rpc__tag){RPC__TAG_NEW, c};
    c->tag_close = (rpc__tag){RPC__TAG_CLOSE, c};
    c->tag_send = (rpc__tag){RPC__TAG_SEND, c};
    c->tag_recv = (rpc__tag){RPC__TAG_RECV, c};
    c->status_details = grpc_empty_slice();
    grpc_metadata_array_init(&c->md);
    if (!m) grpc_call_details_init(&c->details);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    atomic_init(&c->cancelled, false);
    return c;
}

/* Frees the memory of a call object (no grpc_call attached, or already unref'd). */
static void call_free_mem(rpc_call *c)
{
    grpc_metadata_array_destroy(&c->md);
    if (!c->m) grpc_call_details_destroy(&c->details);
    if (c->payload) grpc_byte_buffer_destroy(c->payload);
    if (c->req) protobuf_c_message_free_unpacked(c->req, NULL);
    if (c->recv_bb) grpc_byte_buffer_destroy(c->recv_bb);
    if (c->data_free) c->data_free(c->data);
    for (int i = 0; i < c->q_len; i++)
        grpc_byte_buffer_destroy(c->q[(c->q_head + i) % c->q_cap]);
    if (c->inflight) grpc_byte_buffer_destroy(c->inflight);
    grpc_slice_unref(c->status_details);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c->path);
    free(c->q);
    free(c);
}

void rpc__call_free_unused(rpc_call *c) { call_free_mem(c); }

static void call_free(rpc_call *c)
{
    rpc_server *s = c->srv;
    grpc_call_unref(c->call);
    c->call = NULL;
    call_free_mem(c);
    rpc__server_call_freed(s);
}

/* Drops n references; frees the call at 0. Caller holds no lock. */
static void call_release(rpc_call *c, int n)
{
    pthread_mutex_lock(&c->mu);
    c->refs -= n;
    PD_ASSERT(c->refs >= 0, "rpc call reference count below zero");
    bool last = c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) call_free(c);
}

static void start_batch_or_die(rpc_call *c, const grpc_op *ops, size_t n, rpc__tag *tag)
{
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    if (e != GRPC_CALL_OK) {
        char msg[96];
        snprintf(msg, sizeof msg, "grpc_call_start_batch failed with grpc_call_error %d", (int)e);
        PD_ASSERT(e == GRPC_CALL_OK, msg);
    }
}

/* Starts the next outbound batch if none is in flight: initial metadata with the first
 * message, the status with the last one (or alone). Caller holds c->mu. */
static void call_kick_locked(rpc_call *c)
{
    if (c->send_inflight || c->status_sent || atomic_load(&c->cancelled)) return;
    bool has_msg = c->q_len > 0;
    bool do_status = c->finish_queued && c->q_len <= 1;
    if (!has_msg && !do_status) return;
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!c->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[n].data.send_initial_metadata.count = 0;
        n++;
        c->md_sent = true;
    }
    if (has_msg) {
        c->inflight = c->q[c->q_head];
        c->q_head = (c->q_head + 1) % c->q_cap;
        c->q_len--;
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->inflight;
        n++;
    }
    if (do_status) {
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.trailing_metadata_count = 0;
        ops[n].data.send_status_from_server.status = (grpc_status_code)c->status_code;
        ops[n].data.send_status_from_server.status_details = &c->status_details;
        n++;
        c->status_sent = true;
    }
    c->send_inflight = true;
    c->refs++;
    start_batch_or_die(c, ops, n, &c->tag_send);
}

/* Posts a bidi call's next RECV_MESSAGE (one at a time). Caller holds c->mu. */
static void call_post_recv_locked(rpc_call *c)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_bb;
    c->refs++;
    start_batch_or_die(c, &op, 1, &c->tag_recv);
}

/* Marks the call cancelled and drops its queue. Returns true when this is news that the
 * application must hear (it had not finished the call). Caller holds c->mu. */
static bool call_mark_cancelled_locked(rpc_call *c)
{
    if (atomic_load(&c->cancelled)) return false;
    atomic_store(&c->cancelled, true);
    for (int i = 0; i < c->q_len; i++)
        grpc_byte_buffer_destroy(c->q[(c->q_head + i) % c->q_cap]);
    c->q_len = 0;
    pthread_cond_broadcast(&c->cv);
    if (c->finish_queued) return false;
    atomic_fetch_add(&c->srv->n_cancelled, 1);
    return true;
}

/* Runs the cancel callback once, unless the application finished the call or removed it. */
static void call_fire_cancel(rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    if (!c->cancel_fn || c->cancel_fired || c->finish_queued) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    rpc_cancel_fn fn = c->cancel_fn;
    void *user = c->cancel_user;
    c->cancel_fired = true;
    c->cb_running = true;
    c->cb_thread = pthread_self();
    pthread_mutex_unlock(&c->mu);
    fn(c, user);
    pthread_mutex_lock(&c->mu);
    c->cb_running = false;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* Waits until no cancel callback runs on another thread. Caller holds c->mu. */
static void call_wait_cb_locked(rpc_call *c)
{
    while (c->cb_running && !pthread_equal(c->cb_thread, pthread_self()))
        pthread_cond_wait(&c->cv, &c->mu);
}

/* Waits, before the call is finished, until neither its cancel callback nor (bidi) its
 * handler runs on another thread: nothing of the application's runs for a finished call. The
 * cancel callback's own thread waits for neither (a handler may be waiting for that callback
 * in rpc_call_set_cancel_cb). Caller holds c->mu. */
static void call_wait_finish_locked(rpc_call *c)
{
    for (;;) {
        bool in_cb = c->cb_running && pthread_equal(c->cb_thread, pthread_self());
        bool wait_cb = c->cb_running && !in_cb;
        bool wait_h = c->h_running && !in_cb && !pthread_equal(c->h_thread, pthread_self());
        if (!wait_cb && !wait_h) return;
        pthread_cond_wait(&c->cv, &c->mu);
    }
}

/* Queues the final status (caller holds c->mu; the call is not finished). */
static void call_finish_locked(rpc_call *c, rpc_status_code code, const char *details)
{
    c->finish_queued = true;
    c->cancel_fn = NULL;
    c->status_code = (int)code;
    grpc_slice_unref(c->status_details);
    c->status_details = details && *details ? grpc_slice_from_copied_string(details)
                                            : grpc_empty_slice();
    call_kick_locked(c);
}

/* Finishes a call the application never saw (bad request, unknown method). */
static void call_finish_internal(rpc_call *c, rpc_status_code code, const char *details)
{
    pthread_mutex_lock(&c->mu);
    if (!c->finish_queued && !atomic_load(&c->cancelled)) call_finish_locked(c, code, details);
    pthread_mutex_unlock(&c->mu);
}

void rpc__call_on_new(rpc_call *c, bool ok)
{
    rpc_server *s = c->srv;
    if (!ok) { /* the server is shutting down: this request slot died unused */
        call_free_mem(c);
        rpc__server_slot_done(s);
        return;
    }
    rpc__server_call_delivered(s); /* live before the slot is gone: shutdown counts both */
    rpc__server_slot_done(s);
    rpc__server_post(s, c->m);     /* keep a slot open for the next call of this method */
    atomic_fetch_add(&s->n_started, 1);

    if (!c->m) { /* before RECV_CLOSE: its completion may log the path on another thread */
        c->deadline = c->details.deadline;
        size_t n = GRPC_SLICE_LENGTH(c->details.method);
        c->path = malloc(n + 1);
        if (c->path) rpc__copy_slice(c->path, n + 1, c->details.method);
    }
    c->refs = 2; /* the dispatch holder + the RECV_CLOSE batch */
    c->holders = 1;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    pthread_mutex_lock(&c->mu);
    start_batch_or_die(c, &op, 1, &c->tag_close);
    if (c->m && c->m->kind == RPC_BIDI_STREAMING) {
        /* No request yet: read the first one; the dispatch holder stays as the reader. */
        c->reading = true;
        call_post_recv_locked(c);
        pthread_mutex_unlock(&c->mu);
        return;
    }
    pthread_mutex_unlock(&c->mu);

    if (!c->m) {
        char msg[PD_ERR_LEN];
        snprintf(msg, sizeof msg, "unknown method %s", c->path ? c->path : "?");
        PD_LOGD("rpc: call %llu: %s", (unsigned long long)c->id, msg);
        atomic_fetch_add(&s->n_unimplemented, 1);
        call_finish_internal(c, RPC_STATUS_UNIMPLEMENTED, msg);
    } else {
        /* Strings are checked on the wire first (valid UTF-8, no NUL: rpc_validate.c). */
        char msg[PD_ERR_LEN];
        int rc = rpc__decode_request(c->payload, c->m, &c->req, msg);
        if (c->payload) grpc_byte_buffer_destroy(c->payload);
        c->payload = NULL;
        if (rc != 0) {
            atomic_fetch_add(&s->n_bad_request, 1);
            call_finish_internal(c, RPC_STATUS_INVALID_ARGUMENT, msg);
        } else {
            c->m->handler(c, c->req, c->m->user);
        }
    }
    rpc_call_unref(c); /* the dispatch holder */
}

void rpc__call_on_close(rpc_call *c, bool ok)
{
    pthread_mutex_lock(&c->mu);
    bool news = false;
    if (c->close_cancelled || !ok) news = call_mark_cancelled_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (news) {
        PD_LOGD("rpc: call %llu (%s) cancelled", (unsigned long long)c->id, rpc_call_path(c));
        call_fire_cancel(c);
    }
    call_release(c, 1);
}

void rpc__call_on_send(rpc_call *c, bool ok)
{
    pthread_mutex_lock(&c->mu);
    grpc_byte_buffer *bb = c->inflight;
    c->inflight = NULL;
    c->send_inflight = false;
    bool news = false;
    if (!ok) {
        news = call_mark_cancelled_locked(c);
    } else {
        if (bb) atomic_fetch_add(&c->srv->n_msgs_sent, 1);
        call_kick_locked(c);
    }
    /* Wake a blocked producer only once half the queue drained: it then refills in a burst
     * instead of waking once per message. */
    if (c->n_writers_waiting > 0 && (c->q_len <= c->q_cap / 2 || c->status_sent || !ok))
        pthread_cond_broadcast(&c->cv);
    /* A bidi call whose reading waits for room: read on, or stop reading for good. */
    bool drop_reader = false;
    if (c->recv_paused) {
        if (!ok || c->finish_queued || atomic_load(&c->cancelled)) {
            c->recv_paused = false;
            c->reading = false;
            drop_reader = true;
        } else if (c->q_len < c->q_cap) {
            c->recv_paused = false;
            call_post_recv_locked(c);
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (bb) grpc_byte_buffer_destroy(bb);
    if (news) call_fire_cancel(c);
    call_release(c, 1);                  /* the SEND batch; the reader holder keeps c */
    if (drop_reader) rpc_call_unref(c);
}

void rpc__call_on_recv(rpc_call *c, bool ok)
{
    pthread_mutex_lock(&c->mu); /* orders this read after the post on another worker */
    grpc_byte_buffer *bb = c->recv_bb;
    c->recv_bb = NULL;
    pthread_mutex_unlock(&c->mu);
    /* No message is the half-close only when the stream did not fail (a client cancel ends
     * the pending read with ok and no message too). */
    if (ok && !bb && grpc_call_failed_before_recv_message(c->call)) ok = false;
    bool got_msg = ok && bb;             /* else: the half-close (ok) or a broken stream */
    ProtobufCMessage *req = NULL;
    char msg[PD_ERR_LEN] = "";
    int drc = got_msg ? rpc__decode_request(bb, c->m, &req, msg) : 0;
    if (bb) grpc_byte_buffer_destroy(bb);

    pthread_mutex_lock(&c->mu);
    bool news = false, run = false, bad = false;
    rpc_cancel_fn bad_fn = NULL;
    void *bad_user = NULL;
    if (!ok) { /* client cancel or reset, deadline, shutdown, a request over the size limit */
        if (!c->finish_queued) news = call_mark_cancelled_locked(c);
    } else if (c->finish_queued || c->app_finished || atomic_load(&c->cancelled)) {
        /* finished or cancelled meanwhile: the message is dropped, no handler runs */
    } else if (drc != 0) {
        /* A bad message ends the call with INVALID_ARGUMENT, but after the replies to the
         * messages before it that are queued already: the status is queued behind them (a
         * cancel would drop them; the client then saw the error without the replies it was
         * owed). The application hears of it through its cancel callback, once; its later
         * sends are refused (PD_ESTATE). */
        bad = true;
        if (c->cancel_fn && !c->cancel_fired) {
            bad_fn = c->cancel_fn;
            bad_user = c->cancel_user;
            c->cancel_fired = true;
            c->cb_running = true;
            c->cb_thread = pthread_self();
        }
        call_finish_locked(c, RPC_STATUS_INVALID_ARGUMENT, msg);
    } else {
        run = true;
        c->h_running = true;
        c->h_thread = pthread_self();
    }
    pthread_mutex_unlock(&c->mu);

    if (bad) {
        atomic_fetch_add(&c->srv->n_bad_request, 1);
        PD_LOGD("rpc: call %llu: %s", (unsigned long long)c->id, msg);
        if (bad_fn) {
            bad_fn(c, bad_user);
            pthread_mutex_lock(&c->mu);
            c->cb_running = false;
            pthread_cond_broadcast(&c->cv);
            pthread_mutex_unlock(&c->mu);
        }
    }
    if (news) call_fire_cancel(c);
    if (run) c->m->handler(c, req, c->m->user); /* req NULL: the client half-closed */
    if (req) protobuf_c_message_free_unpacked(req, NULL);

    pthread_mutex_lock(&c->mu);
    if (run) {
        c->h_running = false;
        pthread_cond_broadcast(&c->cv);
    }
    bool drop_reader = false;
    if (run && got_msg && !c->finish_queued && !atomic_load(&c->cancelled)) {
        if (c->q_len < c->q_cap) {
            call_post_recv_locked(c);
        } else { /* a send is in flight (the queue is not empty): its completion reads on */
            PD_ASSERT(c->send_inflight, "rpc: bidi call paused with no send in flight");
            c->recv_paused = true;
        }
    } else {
        c->reading = false;
        drop_reader = true;
    }
    pthread_mutex_unlock(&c->mu);
    call_release(c, 1);                  /* the RECV batch; the reader holder keeps c */
    if (drop_reader) rpc_call_unref(c);  /* unfinished and unreferenced: INTERNAL */
}

/* ---- public, thread-safe ---- */

void rpc_call_ref(rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    PD_ASSERT(c->holders > 0, "rpc_call_ref on a call nobody holds");
    c->refs++;
    c->holders++;
    pthread_mutex_unlock(&c->mu);
}

void rpc_call_unref(rpc_call *c)
{
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->holders--;
    c->refs--;
    PD_ASSERT(c->holders >= 0 && c->refs >= 0, "rpc_call_unref without a reference");
    if (c->holders == 0 && !c->finish_queued && !atomic_load(&c->cancelled)) {
        PD_LOGW("rpc: call %llu (%s) dropped without a status; finishing it with INTERNAL",
                (unsigned long long)c->id, rpc_call_path(c));
        call_finish_locked(c, RPC_STATUS_INTERNAL, "the server dropped the call");
    }
    bool last = c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) call_free(c);
}

/* Serializes msg and appends it to the queue. */
static int call_enqueue(rpc_call *c, const ProtobufCMessage *msg, bool finish)
{
    if (!msg) return PD_EINVAL;
    grpc_byte_buffer *bb = NULL;
    int rc = rpc__encode(msg, c->srv->p.max_send_msg_bytes, &bb);
    if (rc != 0) return rc;
    pthread_mutex_lock(&c->mu);
    if (finish) call_wait_finish_locked(c);
    if (c->finish_queued || atomic_load(&c->cancelled)) {
        rc = PD_ESTATE;
    } else if (c->q_len >= c->q_cap) {
        rc = PD_ENOSPC;
    } else {
        c->q[(c->q_head + c->q_len) % c->q_cap] = bb;
        c->q_len++;
        bb = NULL;
        if (finish) call_finish_locked(c, RPC_STATUS_OK, NULL);
        else call_kick_locked(c);
    }
    if (finish) {
        c->cancel_fn = NULL;
        c->app_finished = true;
    }
    pthread_mutex_unlock(&c->mu);
    if (bb) grpc_byte_buffer_destroy(bb);
    return rc;
}

int rpc_call_reply(rpc_call *c, const ProtobufCMessage *resp)
{
    if (!c->m || c->m->kind != RPC_UNARY) return PD_ESTATE;
    return call_enqueue(c, resp, true);
}

int rpc_stream_send(rpc_call *c, const ProtobufCMessage *msg)
{
    if (!c->m || c->m->kind == RPC_UNARY) return PD_ESTATE;
    return call_enqueue(c, msg, false);
}

int rpc_stream_finish(rpc_call *c, rpc_status_code code, const char *fmt, ...)
{
    char details[PD_ERR_LEN] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(details, sizeof details, fmt, ap);
        va_end(ap);
    }
    if (code == RPC_STATUS_OK && c->m && c->m->kind == RPC_UNARY) {
        code = RPC_STATUS_INTERNAL;
        snprintf(details, sizeof details, "the server finished a unary call without a reply");
    }
    pthread_mutex_lock(&c->mu);
    call_wait_finish_locked(c);
    int rc = 0;
    if (c->finish_queued || atomic_load(&c->cancelled)) rc = PD_ESTATE;
    else call_finish_locked(c, code, details);
    c->cancel_fn = NULL;
    c->app_finished = true;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

int rpc_stream_wait_writable(rpc_call *c, int timeout_ms)
{
    struct timespec until;
    if (timeout_ms >= 0) {
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += timeout_ms / 1000;
        until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    int rc = 0;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (c->finish_queued || atomic_load(&c->cancelled)) {
            rc = PD_ESTATE;
            break;
        }
        if (c->q_len < c->q_cap) break;
        c->n_writers_waiting++;
        int w = timeout_ms < 0 ? pthread_cond_wait(&c->cv, &c->mu)
                               : pthread_cond_timedwait(&c->cv, &c->mu, &until);
        c->n_writers_waiting--;
        if (w != 0) {
            rc = c->q_len < c->q_cap ? 0 : 1;
            break;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

int rpc_stream_pending(rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    int n = c->q_len + (c->inflight ? 1 : 0);
    pthread_mutex_unlock(&c->mu);
    return n;
}

void rpc_call_set_cancel_cb(rpc_call *c, rpc_cancel_fn fn, void *user)
{
    pthread_mutex_lock(&c->mu);
    call_wait_cb_locked(c);
    /* Once the application finished the call (even a call that was cancelled first, whose
     * finish sent nothing) its user data may be gone: never arm a callback then. */
    c->cancel_fn = (c->finish_queued || c->app_finished) ? NULL : fn;
    c->cancel_user = user;
    bool run_now = c->cancel_fn && atomic_load(&c->cancelled) && !c->cancel_fired;
    if (run_now) {
        c->cancel_fired = true;
        c->cb_running = true;
        c->cb_thread = pthread_self();
    }
    pthread_mutex_unlock(&c->mu);
    if (run_now) {
        fn(c, user);
        pthread_mutex_lock(&c->mu);
        c->cb_running = false;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
}

bool rpc_call_is_cancelled(const rpc_call *c) { return atomic_load(&c->cancelled); }

void rpc_call_set_data(rpc_call *c, void *data, void (*free_fn)(void *))
{
    pthread_mutex_lock(&c->mu);
    c->data = data;
    c->data_free = free_fn;
    pthread_mutex_unlock(&c->mu);
}

void *rpc_call_data(const rpc_call *c)
{
    rpc_call *m = (rpc_call *)c;
    pthread_mutex_lock(&m->mu);
    void *d = m->data;
    pthread_mutex_unlock(&m->mu);
    return d;
}

int64_t rpc_call_remaining_ms(const rpc_call *c)
{
    if (gpr_time_cmp(c->deadline, gpr_inf_future(c->deadline.clock_type)) == 0) return INT64_MAX;
    gpr_timespec left = gpr_time_sub(c->deadline, gpr_now(c->deadline.clock_type));
    return (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
}

const char *rpc_call_path(const rpc_call *c)
{
    if (c->m) return c->m->path;
    return c->path ? c->path : "?";
}

int rpc_call_metadata(const rpc_call *c, const char *key, char *buf, size_t len)
{
    size_t klen = strlen(key);
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_metadata *m = &c->md.metadata[i];
        if (GRPC_SLICE_LENGTH(m->key) == klen &&
            memcmp(GRPC_SLICE_START_PTR(m->key), key, klen) == 0) {
            if (buf) rpc__copy_slice(buf, len, m->value);
            return (int)GRPC_SLICE_LENGTH(m->value);
        }
    }
    return PD_ENOTFOUND;
}

uint64_t rpc_call_id(const rpc_call *c) { return c->id; }

int rpc_call_peer(const rpc_call *c, char *buf, size_t len)
{
    char *peer = c->call ? grpc_call_get_peer(c->call) : NULL;
    if (!peer) return PD_ENOTFOUND;
    /* "ipv4:10.0.0.5:51234", "ipv6:[::1]:51234", "unix:/path": drop the scheme and the port. */
    const char *h = strchr(peer, ':');
    h = h ? h + 1 : peer;
    size_t n = strlen(h);
    const char *colon = strrchr(h, ':');
    if (strncmp(peer, "unix", 4) != 0 && colon) n = (size_t)(colon - h);
    if (n > 0 && h[0] == '[' && h[n - 1] == ']') {
        h++;
        n -= 2;
    }
    if (len > 0) snprintf(buf, len, "%.*s", (int)n, h);
    gpr_free(peer);
    return (int)n;
}

int rpc_call_peer_identity(const rpc_call *c, char *buf, size_t len)
{
    if (len > 0) buf[0] = 0;
    grpc_auth_context *ctx = c->call ? grpc_call_auth_context(c->call) : NULL;
    if (!ctx) return 0;
    int n = 0;
    if (grpc_auth_context_peer_is_authenticated(ctx)) {
        /* the verified client certificate's identity (its SAN, else its common name) */
        grpc_auth_property_iterator it = grpc_auth_context_peer_identity(ctx);
        const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
        if (p && p->value && p->value_length > 0) {
            n = (int)p->value_length;
            if (len > 0) snprintf(buf, len, "%.*s", n, p->value);
        }
    }
    grpc_auth_context_release(ctx);
    return n;
}
