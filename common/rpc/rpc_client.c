/* rpc_client.c -- Client side of the gRPC layer: channels, blocking unary calls, blocking
 * server-stream readers and blocking bidi streams. Each blocking call or stream has its own pluck completion queue, so
 * any number of threads can use one channel at once (core allows only a few pluckers per
 * queue). The callback-based calls are in rpc_client_async.c. */
#include "common/rpc/rpc_client_impl.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>

#include "common/log.h"

rpc_channel_params rpc_channel_default_params(void)
{
    rpc_channel_params p;
    memset(&p, 0, sizeof p);
    p.target = NULL;
    p.max_recv_msg_bytes = 64 << 20;
    p.max_send_msg_bytes = -1;
    p.wait_for_ready = false;
    return p;
}

int rpc_channel_create(const rpc_channel_params *p, rpc_channel **out, char *err)
{
    *out = NULL;
    if (!p->target || !*p->target) return pd_errf(err, PD_EINVAL, "rpc channel: empty target");
    if (p->max_recv_msg_bytes == 0 || p->max_recv_msg_bytes < -1 || p->max_send_msg_bytes == 0 ||
        p->max_send_msg_bytes < -1)
        return pd_errf(err, PD_EINVAL, "rpc channel: message size limits must be > 0 or -1");
    rpc_channel *ch = calloc(1, sizeof *ch);
    if (!ch) return pd_errf(err, PD_ENOMEM, "rpc channel: out of memory");
    ch->p = *p;
    ch->p.target = NULL;
    pthread_mutex_init(&ch->mu, NULL);
    pthread_cond_init(&ch->cv, NULL);
    rpc__global_init();
    grpc_init();
    memset(&ch->p.tls, 0, sizeof ch->p.tls); /* only needed at create, like target */
    grpc_channel_credentials *creds = NULL;
    int rc = rpc__tls_channel_creds(&p->tls, &creds, err);
    if (rc != 0) {
        rpc_channel_destroy(ch);
        return rc;
    }
    grpc_arg args[3];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = p->max_recv_msg_bytes;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = p->max_send_msg_bytes;
    size_t n_args = 2;
    if (p->tls.server_name && *p->tls.server_name) {
        args[2].type = GRPC_ARG_STRING;
        args[2].key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        args[2].value.string = (char *)p->tls.server_name; /* copied by core */
        n_args = 3;
    }
    grpc_channel_args cargs = {n_args, args};
    ch->ch = grpc_channel_create(p->target, creds, &cargs);
    grpc_channel_credentials_release(creds);
    if (!ch->ch) {
        rpc_channel_destroy(ch);
        return pd_errf(err, PD_EINVAL, "rpc channel: cannot create a channel to %s", p->target);
    }
    *out = ch;
    return 0;
}

static void channel_destroy_now(rpc_channel *ch)
{
    rpc__channel_stop_async(ch);
    if (ch->ch) grpc_channel_destroy(ch->ch);
    pthread_mutex_destroy(&ch->mu);
    pthread_cond_destroy(&ch->cv);
    free(ch);
    grpc_shutdown();
}

static void *channel_destroy_thread(void *arg)
{
    channel_destroy_now(arg);
    return NULL;
}

void rpc_channel_destroy(rpc_channel *ch)
{
    if (!ch) return;
    if (rpc__on_channel_thread(ch)) {
        /* the completion thread cannot join itself: a detached thread destroys the channel
         * once the callback in progress has returned (stop_async waits for it) */
        pthread_attr_t at;
        pthread_t t;
        int rc = pthread_attr_init(&at);
        if (rc == 0) {
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            rc = pthread_create(&t, &at, channel_destroy_thread, ch);
            pthread_attr_destroy(&at);
        }
        if (rc != 0) /* no thread: the channel is leaked rather than joined from itself */
            PD_LOGE("rpc client: cannot start a thread to destroy a channel from its own "
                    "callback (%s); the channel is leaked", strerror(rc));
        return;
    }
    channel_destroy_now(ch);
}

int rpc__md_build(const rpc_call_opts *opts, rpc__md *out, char *err)
{
    out->md = NULL;
    out->n = 0;
    if (!opts || opts->n_md == 0) return 0;
    if (!opts->md) return pd_errf(err, PD_EINVAL, "rpc client: n_md > 0 with md NULL");
    out->md = calloc(opts->n_md, sizeof *out->md);
    if (!out->md) return pd_errf(err, PD_ENOMEM, "rpc client: out of memory");
    for (size_t i = 0; i < opts->n_md; i++) {
        const rpc_metadata *m = &opts->md[i];
        if (!m->key || !m->value) {
            rpc__md_free(out);
            return pd_errf(err, PD_EINVAL, "rpc client: metadata %zu has a NULL key or value",
                           i);
        }
        out->md[i].key = grpc_slice_from_copied_string(m->key);
        out->md[i].value = grpc_slice_from_copied_string(m->value);
        out->n++;
        if (!grpc_header_key_is_legal(out->md[i].key) ||
            (!grpc_is_binary_header(out->md[i].key) &&
             !grpc_header_nonbin_value_is_legal(out->md[i].value))) {
            rpc__md_free(out);
            return pd_errf(err, PD_EINVAL,
                           "rpc client: illegal metadata \"%s\" (keys are lowercase ASCII; "
                           "values printable ASCII unless the key ends in -bin)", m->key);
        }
    }
    return 0;
}

void rpc__md_free(rpc__md *m)
{
    for (size_t i = 0; i < m->n; i++) {
        grpc_slice_unref(m->md[i].key);
        grpc_slice_unref(m->md[i].value);
    }
    free(m->md);
    m->md = NULL;
    m->n = 0;
}

grpc_call *rpc__channel_new_call(rpc_channel *ch, grpc_completion_queue *cq, const char *path,
                                 const rpc_call_opts *opts)
{
    grpc_slice method = grpc_slice_from_copied_string(path);
    grpc_call *call =
        grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method, NULL,
                                 rpc__deadline_from_ms(opts ? opts->timeout_ms : 0), NULL);
    grpc_slice_unref(method);
    return call;
}

void rpc__fill_status(rpc_status *st, grpc_status_code code, grpc_slice details,
                      const char *error_string)
{
    st->code = (int)code;
    rpc__copy_slice(st->details, sizeof st->details, details);
    if (!st->details[0] && error_string && code != GRPC_STATUS_OK)
        snprintf(st->details, sizeof st->details, "%s", error_string);
}

static void destroy_pluck_cq(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

static void set_local_status(rpc_status *st, int code, const char *msg)
{
    if (!st) return;
    st->code = code;
    snprintf(st->details, sizeof st->details, "%s", msg);
}

int rpc_unary_call(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                   ProtobufCMessage **resp, rpc_status *st)
{
    rpc_call_opts o = {.timeout_ms = timeout_ms};
    return rpc_unary_call_opts(ch, path, req, resp_desc, &o, resp, st);
}

int rpc__request_prepare(rpc_channel *ch, const rpc_call_opts *opts, const ProtobufCMessage *req,
                         const char *what, rpc__md *md, grpc_byte_buffer **bb, char *err)
{
    int rc = rpc__md_build(opts, md, err);
    if (rc != 0) return rc;
    rc = rpc__encode(req, ch->p.max_send_msg_bytes, bb);
    if (rc != 0) {
        rpc__md_free(md);
        return pd_errf(err, rc, "%s: cannot encode the request (%s)", what,
                       rc == PD_EINVAL ? "larger than max_send_msg_bytes" : "out of memory");
    }
    return 0;
}

void rpc__request_ops(const rpc_channel *ch, const rpc__md *md, grpc_byte_buffer *bb,
                      grpc_metadata_array *init_md, grpc_op *ops)
{
    memset(ops, 0, 4 * sizeof *ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = ch->p.wait_for_ready ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
    ops[0].data.send_initial_metadata.count = md->n;
    ops[0].data.send_initial_metadata.metadata = md->md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = init_md;
}

int rpc_unary_call_opts(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                        const ProtobufCMessageDescriptor *resp_desc, const rpc_call_opts *opts,
                        ProtobufCMessage **resp, rpc_status *st)
{
    *resp = NULL;
    if (!path || !req || !resp_desc) return PD_EINVAL;
    char err[PD_ERR_LEN];
    rpc__md md;
    int rc = rpc__md_build(opts, &md, err);
    if (rc != 0) {
        set_local_status(st, RPC_STATUS_INVALID_ARGUMENT, err);
        return RPC_STATUS_INVALID_ARGUMENT;
    }
    grpc_byte_buffer *send_bb = NULL;
    rc = rpc__encode(req, ch->p.max_send_msg_bytes, &send_bb);
    if (rc != 0) {
        rpc__md_free(&md);
        set_local_status(st, RPC_STATUS_RESOURCE_EXHAUSTED,
                         rc == PD_EINVAL ? "the request is larger than max_send_msg_bytes"
                                         : "out of memory");
        return RPC_STATUS_RESOURCE_EXHAUSTED;
    }
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = rpc__channel_new_call(ch, cq, path, opts);
    grpc_metadata_array init_md, trail_md;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    grpc_byte_buffer *recv_bb = NULL;
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    const char *error_string = NULL;

    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    rpc__request_ops(ch, &md, send_bb, &init_md, ops);
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;
    ops[5].data.recv_status_on_client.error_string = &error_string;
    void *tag = &ops[0];
    grpc_call_error e = grpc_call_start_batch(call, ops, 6, tag, NULL);
    PD_ASSERT(e == GRPC_CALL_OK, "rpc_unary_call: grpc_call_start_batch failed");
    grpc_completion_queue_pluck(cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);

    rpc_status local;
    rpc_status *s = st ? st : &local;
    rpc__fill_status(s, status, details, error_string);
    if (status == GRPC_STATUS_OK) {
        if (!recv_bb) {
            set_local_status(s, RPC_STATUS_INTERNAL, "the server sent no response message");
        } else if (rpc__decode(recv_bb, resp_desc, resp) != 0) {
            char msg[PD_ERR_LEN];
            snprintf(msg, sizeof msg, "the response is not a valid %s", resp_desc->name);
            set_local_status(s, RPC_STATUS_INTERNAL, msg);
        }
    }
    if (recv_bb) grpc_byte_buffer_destroy(recv_bb);
    grpc_byte_buffer_destroy(send_bb);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trail_md);
    grpc_slice_unref(details);
    gpr_free((void *)error_string);
    grpc_call_unref(call);
    destroy_pluck_cq(cq);
    rpc__md_free(&md);
    return s->code;
}

/* ---- blocking stream reader ---- */

struct rpc_client_stream {
    rpc_channel *ch;
    grpc_completion_queue *cq;          /* pluck, this stream's own */
    grpc_call *call;
    const ProtobufCMessageDescriptor *desc;
    grpc_byte_buffer *send_bb, *recv_bb;
    rpc__md md;                         /* request metadata */
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const char *error_string;
    bool start_done, status_done, eos;
    bool bad_response;
    bool bidi, send_closed;             /* bidi: requests go through rpc_client_stream_send */
    char tag_start, tag_status, tag_msg, tag_send; /* distinct addresses used as tags */
};

/* Posts the stream's RECV_STATUS_ON_CLIENT (completes at tag_status with the final status). */
static void post_recv_status(rpc_client_stream *s)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op.data.recv_status_on_client.trailing_metadata = &s->trail_md;
    op.data.recv_status_on_client.status = &s->status;
    op.data.recv_status_on_client.status_details = &s->details;
    op.data.recv_status_on_client.error_string = &s->error_string;
    grpc_call_error e = grpc_call_start_batch(s->call, &op, 1, &s->tag_status, NULL);
    PD_ASSERT(e == GRPC_CALL_OK, "rpc stream: grpc_call_start_batch failed");
}

int rpc_client_stream_open(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                           const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                           rpc_client_stream **out, char *err)
{
    rpc_call_opts o = {.timeout_ms = timeout_ms};
    return rpc_client_stream_open_opts(ch, path, req, resp_desc, &o, out, err);
}

int rpc_client_stream_open_opts(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                                const ProtobufCMessageDescriptor *resp_desc,
                                const rpc_call_opts *opts, rpc_client_stream **out, char *err)
{
    *out = NULL;
    if (!path || !req || !resp_desc) return pd_errf(err, PD_EINVAL, "rpc stream: bad arguments");
    rpc_client_stream *s = calloc(1, sizeof *s);
    if (!s) return pd_errf(err, PD_ENOMEM, "rpc stream: out of memory");
    int rc = rpc__request_prepare(ch, opts, req, "rpc stream", &s->md, &s->send_bb, err);
    if (rc != 0) {
        free(s);
        return rc;
    }
    s->ch = ch;
    s->desc = resp_desc;
    s->details = grpc_empty_slice();
    s->status = GRPC_STATUS_UNKNOWN;
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trail_md);
    s->cq = grpc_completion_queue_create_for_pluck(NULL);
    s->call = rpc__channel_new_call(ch, s->cq, path, opts);

    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    rpc__request_ops(ch, &s->md, s->send_bb, &s->init_md, ops);
    grpc_call_error e = grpc_call_start_batch(s->call, ops, 4, &s->tag_start, NULL);
    PD_ASSERT(e == GRPC_CALL_OK, "rpc stream: grpc_call_start_batch failed");
    post_recv_status(s);
    *out = s;
    return 0;
}

static bool stream_pluck(rpc_client_stream *s, void *tag)
{
    return grpc_completion_queue_pluck(s->cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL)
               .success != 0;
}

int rpc_client_bidi_open(rpc_channel *ch, const char *path,
                         const ProtobufCMessageDescriptor *resp_desc, const rpc_call_opts *opts,
                         rpc_client_stream **out, char *err)
{
    *out = NULL;
    if (!ch || !path || !resp_desc) return pd_errf(err, PD_EINVAL, "rpc bidi: bad arguments");
    rpc_client_stream *s = calloc(1, sizeof *s);
    if (!s) return pd_errf(err, PD_ENOMEM, "rpc bidi: out of memory");
    int rc = rpc__md_build(opts, &s->md, err);
    if (rc != 0) {
        free(s);
        return rc;
    }
    s->ch = ch;
    s->desc = resp_desc;
    s->bidi = true;
    s->details = grpc_empty_slice();
    s->status = GRPC_STATUS_UNKNOWN;
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trail_md);
    s->cq = grpc_completion_queue_create_for_pluck(NULL);
    s->call = rpc__channel_new_call(ch, s->cq, path, opts);

    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = ch->p.wait_for_ready ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
    ops[0].data.send_initial_metadata.count = s->md.n;
    ops[0].data.send_initial_metadata.metadata = s->md.md;
    ops[1].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[1].data.recv_initial_metadata.recv_initial_metadata = &s->init_md;
    grpc_call_error e = grpc_call_start_batch(s->call, ops, 2, &s->tag_start, NULL);
    PD_ASSERT(e == GRPC_CALL_OK, "rpc bidi: grpc_call_start_batch failed");
    post_recv_status(s);
    *out = s;
    return 0;
}

int rpc_client_stream_send(rpc_client_stream *s, const ProtobufCMessage *msg)
{
    if (!msg) return PD_EINVAL;
    if (!s->bidi || s->send_closed) return PD_ESTATE; /* a call that ended fails the batch */
    grpc_byte_buffer *bb = NULL;
    int rc = rpc__encode(msg, s->ch->p.max_send_msg_bytes, &bb);
    if (rc != 0) return rc;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    grpc_call_error e = grpc_call_start_batch(s->call, &op, 1, &s->tag_send, NULL);
    PD_ASSERT(e == GRPC_CALL_OK, "rpc bidi: grpc_call_start_batch failed");
    bool ok = stream_pluck(s, &s->tag_send);
    grpc_byte_buffer_destroy(bb);
    return ok ? 0 : PD_ESTATE;
}

int rpc_client_stream_close_send(rpc_client_stream *s)
{
    if (!s->bidi) return PD_ESTATE;
    if (s->send_closed) return 0;
    s->send_closed = true;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    grpc_call_error e = grpc_call_start_batch(s->call, &op, 1, &s->tag_send, NULL);
    PD_ASSERT(e == GRPC_CALL_OK, "rpc bidi: grpc_call_start_batch failed");
    return stream_pluck(s, &s->tag_send) ? 0 : PD_ESTATE;
}

int rpc_client_stream_next(rpc_client_stream *s, ProtobufCMessage **msg)
{
    *msg = NULL;
    if (s->eos) return 0;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &s->recv_bb;
    grpc_call_error e = grpc_call_start_batch(s->call, &op, 1, &s->tag_msg, NULL);
    PD_ASSERT(e == GRPC_CALL_OK, "rpc stream: grpc_call_start_batch failed");
    stream_pluck(s, &s->tag_msg);
    if (!s->recv_bb) {
        s->eos = true;
        return 0;
    }
    int rc = rpc__decode(s->recv_bb, s->desc, msg);
    grpc_byte_buffer_destroy(s->recv_bb);
    s->recv_bb = NULL;
    if (rc != 0) {
        s->bad_response = true;
        s->eos = true;
        grpc_call_cancel_with_status(s->call, GRPC_STATUS_INTERNAL, "bad response message",
                                     NULL);
        return 0;
    }
    return 1;
}

void rpc_client_stream_cancel(rpc_client_stream *s) { grpc_call_cancel(s->call, NULL); }

int rpc_client_stream_status(rpc_client_stream *s, rpc_status *st)
{
    ProtobufCMessage *m;
    while (rpc_client_stream_next(s, &m) == 1) protobuf_c_message_free_unpacked(m, NULL);
    if (!s->status_done) {
        stream_pluck(s, &s->tag_status);
        s->status_done = true;
    }
    rpc__fill_status(st, s->status, s->details, s->error_string);
    if (s->bad_response) {
        st->code = RPC_STATUS_INTERNAL;
        snprintf(st->details, sizeof st->details, "the response is not a valid %s",
                 s->desc->name);
    }
    return st->code;
}

void rpc_client_stream_close(rpc_client_stream *s)
{
    if (!s) return;
    if (!s->status_done) {
        grpc_call_cancel(s->call, NULL);
        stream_pluck(s, &s->tag_status);
        s->status_done = true;
    }
    if (!s->start_done) {
        stream_pluck(s, &s->tag_start);
        s->start_done = true;
    }
    grpc_call_unref(s->call);
    destroy_pluck_cq(s->cq);
    if (s->recv_bb) grpc_byte_buffer_destroy(s->recv_bb);
    if (s->send_bb) grpc_byte_buffer_destroy(s->send_bb);
    rpc__md_free(&s->md);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    grpc_slice_unref(s->details);
    gpr_free((void *)s->error_string);
    free(s);
}
