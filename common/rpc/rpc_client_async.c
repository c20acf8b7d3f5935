/* rpc_client_async.c -- Callback-based client calls (unary or server-streaming): one
 * completion queue and one thread per channel deliver each response to on_message and the end
 * to on_done. The next response is read only after on_message returns, which bounds memory
 * with a slow consumer. A call object is freed when both the caller's handle is released and
 * on_done has run (two-phase close). */
#include "common/rpc/rpc_client_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/support/alloc.h>

#include "common/log.h"

typedef enum { CTAG_MSG = 0, CTAG_STATUS } ctag_kind;

typedef struct {
    ctag_kind kind;
    rpc_client_call *c;
} ctag;

struct rpc_client_call {
    rpc_channel *ch;
    grpc_call *call;                    /* NULL once every batch is done (before on_done) */
    const ProtobufCMessageDescriptor *desc;
    rpc_client_callbacks cb;
    grpc_byte_buffer *send_bb, *recv_bb;
    rpc__md md;                         /* request metadata */
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const char *error_string;
    ctag tag_msg, tag_status;
    pthread_mutex_t mu;                 /* guards call and refs */
    int refs;                           /* the caller's handle + the call in progress */
    /* Touched by the channel thread only: */
    bool msgs_done, status_done, done, bad_response;
    rpc_client_call *prev, *next;       /* channel's live list, under ch->mu */
};

static void call_release(rpc_client_call *c)
{
    pthread_mutex_lock(&c->mu);
    bool last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (!last) return;
    if (c->recv_bb) grpc_byte_buffer_destroy(c->recv_bb);
    if (c->send_bb) grpc_byte_buffer_destroy(c->send_bb);
    rpc__md_free(&c->md);
    grpc_metadata_array_destroy(&c->init_md);
    grpc_metadata_array_destroy(&c->trail_md);
    grpc_slice_unref(c->details);
    gpr_free((void *)c->error_string);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static void post_recv_message(rpc_client_call *c)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_bb;
    grpc_call_error e = grpc_call_start_batch(c->call, &op, 1, &c->tag_msg, NULL);
    PD_ASSERT(e == GRPC_CALL_OK, "rpc client: grpc_call_start_batch failed");
}

static void maybe_done(rpc_client_call *c)
{
    if (!c->msgs_done || !c->status_done || c->done) return;
    c->done = true;
    rpc_status st;
    rpc__fill_status(&st, c->status, c->details, c->error_string);
    if (c->bad_response) {
        st.code = RPC_STATUS_INTERNAL;
        snprintf(st.details, sizeof st.details, "the response is not a valid %s", c->desc->name);
    }
    pthread_mutex_lock(&c->mu);
    grpc_call_unref(c->call);
    c->call = NULL;
    pthread_mutex_unlock(&c->mu);
    if (c->cb.on_done) c->cb.on_done(c, &st, c->cb.user);

    rpc_channel *ch = c->ch;
    pthread_mutex_lock(&ch->mu);
    if (c->prev) c->prev->next = c->next;
    else ch->live = c->next;
    if (c->next) c->next->prev = c->prev;
    if (--ch->n_async == 0) pthread_cond_broadcast(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
    call_release(c); /* the call in progress */
}

static void on_msg(rpc_client_call *c, bool ok)
{
    if (c->send_bb) { /* the first batch (which sent the request) is done */
        grpc_byte_buffer_destroy(c->send_bb);
        c->send_bb = NULL;
    }
    if (!ok || !c->recv_bb) {
        c->msgs_done = true;
    } else {
        ProtobufCMessage *m = NULL;
        int rc = rpc__decode(c->recv_bb, c->desc, &m);
        grpc_byte_buffer_destroy(c->recv_bb);
        c->recv_bb = NULL;
        if (rc != 0) {
            c->bad_response = true;
            c->msgs_done = true;
            grpc_call_cancel_with_status(c->call, GRPC_STATUS_INTERNAL, "bad response", NULL);
        } else {
            if (c->cb.on_message) c->cb.on_message(c, m, c->cb.user);
            else protobuf_c_message_free_unpacked(m, NULL);
            post_recv_message(c);
        }
    }
    maybe_done(c);
}

static void *async_main(void *arg)
{
    rpc_channel *ch = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(ch->cq, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                   NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        ctag *t = ev.tag;
        if (t->kind == CTAG_MSG) {
            on_msg(t->c, ev.success != 0);
        } else {
            t->c->status_done = true;
            maybe_done(t->c);
        }
    }
    return NULL;
}

/* Starts the channel's completion thread if needed. Caller holds ch->mu. */
static int ensure_async_locked(rpc_channel *ch)
{
    if (ch->thread_started) return 0;
    ch->cq = grpc_completion_queue_create_for_next(NULL);
    if (!ch->cq) return PD_ENOMEM;
    if (pthread_create(&ch->thread, NULL, async_main, ch) != 0) {
        grpc_completion_queue_shutdown(ch->cq);
        grpc_completion_queue_destroy(ch->cq);
        ch->cq = NULL;
        return PD_ENOMEM;
    }
    ch->thread_started = true;
    return 0;
}

int rpc_client_call_start(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                          const rpc_client_callbacks *cb, rpc_client_call **out, char *err)
{
    rpc_call_opts o = {.timeout_ms = timeout_ms};
    return rpc_client_call_start_opts(ch, path, req, resp_desc, &o, cb, out, err);
}

int rpc_client_call_start_opts(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                               const ProtobufCMessageDescriptor *resp_desc,
                               const rpc_call_opts *opts, const rpc_client_callbacks *cb,
                               rpc_client_call **out, char *err)
{
    *out = NULL;
    if (!path || !req || !resp_desc || !cb)
        return pd_errf(err, PD_EINVAL, "rpc client: bad arguments");
    rpc_client_call *c = calloc(1, sizeof *c);
    if (!c) return pd_errf(err, PD_ENOMEM, "rpc client: out of memory");
    int rc = rpc__request_prepare(ch, opts, req, "rpc client", &c->md, &c->send_bb, err);
    if (rc != 0) {
        free(c);
        return rc;
    }
    c->ch = ch;
    c->desc = resp_desc;
    c->cb = *cb;
    c->details = grpc_empty_slice();
    c->status = GRPC_STATUS_UNKNOWN;
    c->tag_msg = (ctag){CTAG_MSG, c};
    c->tag_status = (ctag){CTAG_STATUS, c};
    c->refs = 2;
    grpc_metadata_array_init(&c->init_md);
    grpc_metadata_array_init(&c->trail_md);
    pthread_mutex_init(&c->mu, NULL);

    pthread_mutex_lock(&ch->mu);
    rc = ensure_async_locked(ch);
    if (rc != 0) {
        pthread_mutex_unlock(&ch->mu);
        c->refs = 1;
        call_release(c);
        return pd_errf(err, rc, "rpc client: cannot start the completion thread");
    }
    c->call = rpc__channel_new_call(ch, ch->cq, path, opts);
    c->next = ch->live;
    if (ch->live) ch->live->prev = c;
    ch->live = c;
    ch->n_async++;

    grpc_op ops[5];
    memset(ops, 0, sizeof ops);
    rpc__request_ops(ch, &c->md, c->send_bb, &c->init_md, ops);
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &c->recv_bb;
    grpc_call_error e1 = grpc_call_start_batch(c->call, ops, 5, &c->tag_msg, NULL);
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &c->trail_md;
    ops[0].data.recv_status_on_client.status = &c->status;
    ops[0].data.recv_status_on_client.status_details = &c->details;
    ops[0].data.recv_status_on_client.error_string = &c->error_string;
    grpc_call_error e2 = grpc_call_start_batch(c->call, ops, 1, &c->tag_status, NULL);
    pthread_mutex_unlock(&ch->mu);
    PD_ASSERT(e1 == GRPC_CALL_OK && e2 == GRPC_CALL_OK, "rpc client: start_batch failed");
    *out = c;
    return 0;
}

void rpc_client_call_cancel(rpc_client_call *c)
{
    pthread_mutex_lock(&c->mu);
    if (c->call) grpc_call_cancel(c->call, NULL);
    pthread_mutex_unlock(&c->mu);
}

void rpc_client_call_release(rpc_client_call *c)
{
    if (c) call_release(c);
}

int64_t rpc_channel_live_calls(const rpc_channel *ch)
{
    rpc_channel *m = (rpc_channel *)ch;
    pthread_mutex_lock(&m->mu);
    int64_t n = m->n_async;
    pthread_mutex_unlock(&m->mu);
    return n;
}

bool rpc__on_channel_thread(rpc_channel *ch)
{
    pthread_mutex_lock(&ch->mu);
    const bool on = ch->thread_started && pthread_equal(ch->thread, pthread_self());
    pthread_mutex_unlock(&ch->mu);
    return on;
}

void rpc__channel_stop_async(rpc_channel *ch)
{
    pthread_mutex_lock(&ch->mu);
    if (!ch->thread_started) {
        pthread_mutex_unlock(&ch->mu);
        return;
    }
    if (ch->n_async > 0) PD_LOGD("rpc client: cancelling %lld calls", (long long)ch->n_async);
    for (rpc_client_call *c = ch->live; c; c = c->next) rpc_client_call_cancel(c);
    while (ch->n_async > 0) pthread_cond_wait(&ch->cv, &ch->mu);
    pthread_mutex_unlock(&ch->mu);
    grpc_completion_queue_shutdown(ch->cq);
    pthread_join(ch->thread, NULL);
    grpc_completion_queue_destroy(ch->cq);
    ch->cq = NULL;
    ch->thread_started = false;
}
