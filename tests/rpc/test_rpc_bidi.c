/* test_rpc_bidi.c -- Bidirectional-streaming calls (RPC_BIDI_STREAMING) with server and
 * client in one process, so that the sanitizers watch both sides: requests answered in order,
 * interleaved and pipelined (a client that sends without reading is held back, never
 * refused), half-close then finish OK, an empty stream, finishing from the first runs or from
 * another thread (no handler run after a finish), a handler that drops the call, bad request
 * messages mid-stream, client cancel, deadline, concurrent streams, and server shutdown with
 * bidi calls open (one held by an application thread). Per-call state lives in
 * rpc_call_set_data and must be freed with every call. Ends with zero live calls. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/rpc/rpc.h"
#include "grpc/health/v1/health.pb-c.h"
#include "rpctest.pb-c.h"
#include "tests/test_util.h"

#define ECHO "/pdserve.rpctest.v1.RpcTest/Echo"
#define PAD_MAX 16384

static atomic_int g_states;            /* echo_state alive (freed with their call) */
static atomic_int g_cancel_cbs;        /* cancel callbacks seen */
static atomic_int g_overlaps;          /* runs of one call that overlapped (must stay 0) */
static atomic_int g_runs_after_finish; /* runs that started after a finish (must stay 0) */
static atomic_int g_send_fail;         /* rpc_stream_send refusals in runs (must stay 0) */
static atomic_int g_x_runs;            /* runs for requests sent after a finish (must stay 0) */
static atomic_int g_holders;           /* application threads holding a call */
static uint8_t g_pad[PAD_MAX];

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static int64_t wait_live_zero(rpc_server *s, int ms)
{
    for (int i = 0; i < ms / 5 && (rpc_server_live_calls(s) > 0 || atomic_load(&g_holders));
         i++)
        sleep_ms(5);
    return rpc_server_live_calls(s) + atomic_load(&g_holders);
}

/* ---- server side: the echo handler ---- */

typedef struct {
    uint64_t seq;           /* requests answered */
    atomic_int in_run;      /* runs in progress */
    atomic_bool finished;   /* the application finished the call */
    bool drop_at_end;       /* "drop": leave the call unfinished at the half-close */
    bool defer_end;         /* "defer": finish from another thread after the half-close */
} echo_state;

typedef struct {
    rpc_call *call;
    echo_state *st;
    int mode;               /* 0 = finish after 30 ms, 1 = finish after 20 ms, 2 = until
                               cancelled */
} holder;

static void echo_state_free(void *p)
{
    free(p);
    atomic_fetch_sub(&g_states, 1);
}

static void on_echo_cancel(rpc_call *call, void *user)
{
    (void)call;
    (void)user;
    atomic_fetch_add(&g_cancel_cbs, 1);
}

static void *holder_main(void *arg)
{
    holder *h = arg;
    if (h->mode == 2) {
        while (!rpc_call_is_cancelled(h->call)) sleep_ms(5);
        Pdserve__Rpctest__V1__EchoResponse r = PDSERVE__RPCTEST__V1__ECHO_RESPONSE__INIT;
        r.text = "late";
        CHECK_EQ_INT(rpc_stream_send(h->call, &r.base), PD_ESTATE);
        CHECK_EQ_INT(rpc_stream_finish(h->call, RPC_STATUS_OK, NULL), PD_ESTATE);
    } else {
        sleep_ms(h->mode == 0 ? 30 : 20);
        int rc = h->mode == 0 /* after the half-close: no run touches seq any more */
                     ? rpc_stream_finish(h->call, RPC_STATUS_OK, "deferred %llu",
                                         (unsigned long long)h->st->seq)
                     : rpc_stream_finish(h->call, RPC_STATUS_OK, "finished by a thread");
        atomic_store(&h->st->finished, true); /* no run may start from here on */
        CHECK_EQ_INT(rc, 0);
    }
    rpc_call_unref(h->call);
    free(h);
    atomic_fetch_sub(&g_holders, 1);
    return NULL;
}

static void start_holder(rpc_call *call, echo_state *st, int mode)
{
    holder *h = calloc(1, sizeof *h);
    h->call = call;
    h->st = st;
    h->mode = mode;
    rpc_call_ref(call);
    atomic_fetch_add(&g_holders, 1);
    pthread_t t;
    pthread_create(&t, NULL, holder_main, h);
    pthread_detach(t);
}

static void on_echo(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    (void)user;
    echo_state *st = rpc_call_data(call);
    if (!st) { /* the first run of the call */
        st = calloc(1, sizeof *st);
        atomic_fetch_add(&g_states, 1);
        rpc_call_set_data(call, st, echo_state_free);
        rpc_call_set_cancel_cb(call, on_echo_cancel, st);
    }
    if (atomic_fetch_add(&st->in_run, 1) != 0) atomic_fetch_add(&g_overlaps, 1);
    if (atomic_load(&st->finished)) atomic_fetch_add(&g_runs_after_finish, 1);
    if (!req) { /* the client half-closed */
        if (st->defer_end) {
            start_holder(call, st, 0);
        } else if (!st->drop_at_end) {
            atomic_store(&st->finished, true);
            CHECK_EQ_INT(rpc_stream_finish(call, RPC_STATUS_OK, "echoed %llu",
                                           (unsigned long long)st->seq), 0);
        }
        atomic_fetch_sub(&st->in_run, 1);
        return;
    }
    const Pdserve__Rpctest__V1__EchoRequest *r = (const void *)req;
    if (strcmp(r->text, "x") == 0) atomic_fetch_add(&g_x_runs, 1);
    Pdserve__Rpctest__V1__EchoResponse resp = PDSERVE__RPCTEST__V1__ECHO_RESPONSE__INIT;
    resp.text = r->text;
    resp.seq = st->seq++;
    resp.pad.len = r->pad_bytes < PAD_MAX ? r->pad_bytes : PAD_MAX;
    resp.pad.data = g_pad;
    if (strcmp(r->text, "reply") == 0) CHECK_EQ_INT(rpc_call_reply(call, &resp.base), PD_ESTATE);
    if (rpc_stream_send(call, &resp.base) != 0) atomic_fetch_add(&g_send_fail, 1);
    if (strcmp(r->text, "abort") == 0) {
        atomic_store(&st->finished, true);
        CHECK_EQ_INT(rpc_stream_finish(call, RPC_STATUS_ABORTED, "stopped after %llu",
                                       (unsigned long long)st->seq), 0);
        CHECK_EQ_INT(rpc_stream_send(call, &resp.base), PD_ESTATE);
    } else if (strcmp(r->text, "drop") == 0) {
        st->drop_at_end = true;
    } else if (strcmp(r->text, "defer") == 0) {
        st->defer_end = true;
    } else if (strcmp(r->text, "fin-later") == 0) {
        start_holder(call, st, 1);
    } else if (strcmp(r->text, "hold") == 0) {
        start_holder(call, st, 2);
    }
    atomic_fetch_sub(&st->in_run, 1);
}

/* ---- client side ---- */

static rpc_client_stream *echo_open(rpc_channel *ch, int64_t timeout_ms)
{
    rpc_call_opts o = {.timeout_ms = timeout_ms};
    rpc_client_stream *s = NULL;
    char err[PD_ERR_LEN] = "";
    CHECK_EQ_INT(rpc_client_bidi_open(ch, ECHO, &pdserve__rpctest__v1__echo_response__descriptor,
                                      &o, &s, err), 0);
    return s;
}

static int echo_send(rpc_client_stream *s, const char *text, uint32_t pad)
{
    Pdserve__Rpctest__V1__EchoRequest r = PDSERVE__RPCTEST__V1__ECHO_REQUEST__INIT;
    r.text = (char *)text;
    r.pad_bytes = pad;
    return rpc_client_stream_send(s, &r.base);
}

/* Reads one response; it must be text's answer with sequence number seq. */
static void echo_expect(rpc_client_stream *s, const char *text, uint64_t seq, uint32_t pad)
{
    ProtobufCMessage *m = NULL;
    CHECK_EQ_INT(rpc_client_stream_next(s, &m), 1);
    if (!m) return;
    const Pdserve__Rpctest__V1__EchoResponse *r = (const void *)m;
    CHECK_MSG(strcmp(r->text, text) == 0, "got \"%s\", want \"%s\"\n", r->text, text);
    CHECK_EQ_INT(r->seq, seq);
    CHECK_EQ_INT(r->pad.len, pad);
    protobuf_c_message_free_unpacked(m, NULL);
}

static int echo_end(rpc_client_stream *s, rpc_status *st)
{
    ProtobufCMessage *m = NULL;
    CHECK_EQ_INT(rpc_client_stream_next(s, &m), 0);
    if (m) protobuf_c_message_free_unpacked(m, NULL);
    return rpc_client_stream_status(s, st);
}

static void test_order(rpc_channel *ch)
{
    rpc_client_stream *s = echo_open(ch, 10000);
    char t[16];
    for (int i = 0; i < 5; i++) {
        snprintf(t, sizeof t, "m%d", i);
        CHECK_EQ_INT(echo_send(s, t, 0), 0);
    }
    for (int i = 0; i < 5; i++) {
        snprintf(t, sizeof t, "m%d", i);
        echo_expect(s, t, (uint64_t)i, 0);
    }
    for (int i = 5; i < 8; i++) { /* one at a time */
        snprintf(t, sizeof t, "m%d", i);
        CHECK_EQ_INT(echo_send(s, t, 0), 0);
        echo_expect(s, t, (uint64_t)i, 0);
    }
    CHECK_EQ_INT(echo_send(s, "reply", 0), 0); /* rpc_call_reply refused on a bidi call */
    echo_expect(s, "reply", 8, 0);
    CHECK_EQ_INT(rpc_client_stream_close_send(s), 0);
    CHECK_EQ_INT(rpc_client_stream_close_send(s), 0);          /* idempotent */
    CHECK_EQ_INT(echo_send(s, "after", 0), PD_ESTATE);         /* sending side closed */
    CHECK_EQ_INT(rpc_client_stream_send(s, NULL), PD_EINVAL);
    rpc_status st;
    CHECK_EQ_INT(echo_end(s, &st), RPC_STATUS_OK);
    CHECK_MSG(strcmp(st.details, "echoed 9") == 0, "got \"%s\"\n", st.details);
    rpc_client_stream_close(s);

    /* No request at all: the half-close alone. */
    s = echo_open(ch, 10000);
    CHECK_EQ_INT(rpc_client_stream_close_send(s), 0);
    CHECK_EQ_INT(echo_end(s, &st), RPC_STATUS_OK);
    CHECK_MSG(strcmp(st.details, "echoed 0") == 0, "got \"%s\"\n", st.details);
    rpc_client_stream_close(s);
}

/* 200 requests of 16 KiB answers sent before reading any: the server's queue (4) fills, it
 * stops reading until the client reads; every request is still answered, in order. */
static void test_pipelined(rpc_channel *ch)
{
    enum { N = 200 };
    rpc_client_stream *s = echo_open(ch, 30000);
    for (int i = 0; i < N; i++) CHECK_EQ_INT(echo_send(s, "p", PAD_MAX), 0);
    CHECK_EQ_INT(rpc_client_stream_close_send(s), 0);
    for (int i = 0; i < N; i++) echo_expect(s, "p", (uint64_t)i, PAD_MAX);
    rpc_status st;
    CHECK_EQ_INT(echo_end(s, &st), RPC_STATUS_OK);
    CHECK_MSG(strcmp(st.details, "echoed 200") == 0, "got \"%s\"\n", st.details);
    rpc_client_stream_close(s);
    CHECK_EQ_INT(atomic_load(&g_send_fail), 0);
}

static void test_finish_early(rpc_channel *ch, rpc_server *srv)
{
    rpc_status st;
    /* Finished by the second run: later requests reach no handler. */
    rpc_client_stream *s = echo_open(ch, 10000);
    CHECK_EQ_INT(echo_send(s, "a", 0), 0);
    echo_expect(s, "a", 0, 0);
    CHECK_EQ_INT(echo_send(s, "abort", 0), 0);
    for (int i = 0; i < 5; i++) echo_send(s, "x", 0); /* 0, or PD_ESTATE once it ended */
    echo_expect(s, "abort", 1, 0);
    CHECK_EQ_INT(echo_end(s, &st), RPC_STATUS_ABORTED);
    CHECK_MSG(strcmp(st.details, "stopped after 2") == 0, "got \"%s\"\n", st.details);
    rpc_client_stream_close(s);

    /* Finished by another thread while requests keep coming. */
    s = echo_open(ch, 10000);
    CHECK_EQ_INT(echo_send(s, "fin-later", 0), 0);
    int sent = 1;
    for (int i = 0; i < 40 && echo_send(s, "y", 0) == 0; i++, sent++) sleep_ms(2);
    CHECK(sent > 1);
    ProtobufCMessage *m;
    int got = 0;
    while (rpc_client_stream_next(s, &m) == 1) {
        got++;
        protobuf_c_message_free_unpacked(m, NULL);
    }
    CHECK(got >= 1 && got <= sent);
    CHECK_EQ_INT(rpc_client_stream_status(s, &st), RPC_STATUS_OK);
    CHECK_STR_CONTAINS(st.details, "finished by a thread");
    rpc_client_stream_close(s);

    /* Finished from another thread after the half-close. */
    s = echo_open(ch, 10000);
    CHECK_EQ_INT(echo_send(s, "defer", 0), 0);
    echo_expect(s, "defer", 0, 0);
    CHECK_EQ_INT(rpc_client_stream_close_send(s), 0);
    CHECK_EQ_INT(echo_end(s, &st), RPC_STATUS_OK);
    CHECK_MSG(strcmp(st.details, "deferred 1") == 0, "got \"%s\"\n", st.details);
    rpc_client_stream_close(s);

    /* Not finished, not referenced at the half-close: INTERNAL. */
    s = echo_open(ch, 10000);
    CHECK_EQ_INT(echo_send(s, "drop", 0), 0);
    echo_expect(s, "drop", 0, 0);
    CHECK_EQ_INT(rpc_client_stream_close_send(s), 0);
    CHECK_EQ_INT(echo_end(s, &st), RPC_STATUS_INTERNAL);
    rpc_client_stream_close(s);

    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    CHECK_EQ_INT(atomic_load(&g_x_runs), 0);
    CHECK_EQ_INT(atomic_load(&g_runs_after_finish), 0);
}

static void test_bad_requests(rpc_channel *ch, rpc_server *srv)
{
    rpc_server_stats s0, s1;
    rpc_server_stats_get(srv, &s0);
    int cancels0 = atomic_load(&g_cancel_cbs);
    rpc_status st;
    /* Field 1 as a varint where EchoRequest has a string. */
    rpc_client_stream *s = echo_open(ch, 10000);
    CHECK_EQ_INT(echo_send(s, "ok", 0), 0);
    echo_expect(s, "ok", 0, 0);
    Grpc__Health__V1__HealthCheckResponse junk = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    junk.status = 1;
    CHECK_EQ_INT(rpc_client_stream_send(s, &junk.base), 0);
    CHECK_EQ_INT(echo_end(s, &st), RPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR_CONTAINS(st.details, "not a valid pdserve.rpctest.v1.EchoRequest");
    rpc_client_stream_close(s);
    /* A string that is not UTF-8, as the first request. */
    s = echo_open(ch, 10000);
    CHECK_EQ_INT(echo_send(s, "\xff\xfe", 0), 0);
    CHECK_EQ_INT(echo_end(s, &st), RPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR_CONTAINS(st.details, "text: not valid UTF-8");
    rpc_client_stream_close(s);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    rpc_server_stats_get(srv, &s1);
    CHECK_EQ_INT(s1.calls_bad_request - s0.calls_bad_request, 2);
    CHECK_EQ_INT(atomic_load(&g_cancel_cbs), cancels0 + 1); /* the first call had one set */
}

static void test_cancel_deadline(rpc_channel *ch, rpc_server *srv)
{
    int cancels0 = atomic_load(&g_cancel_cbs);
    rpc_status st;
    /* Client cancel mid-stream. */
    rpc_client_stream *s = echo_open(ch, 10000);
    CHECK_EQ_INT(echo_send(s, "c0", 0), 0);
    CHECK_EQ_INT(echo_send(s, "c1", 0), 0);
    echo_expect(s, "c0", 0, 0);
    echo_expect(s, "c1", 1, 0);
    rpc_client_stream_cancel(s);
    CHECK_EQ_INT(rpc_client_stream_status(s, &st), RPC_STATUS_CANCELLED);
    CHECK_EQ_INT(echo_send(s, "c2", 0), PD_ESTATE);
    rpc_client_stream_close(s);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    CHECK_EQ_INT(atomic_load(&g_cancel_cbs), cancels0 + 1);

    /* Deadline with the requests left open. */
    s = echo_open(ch, 200);
    CHECK_EQ_INT(echo_send(s, "d", 0), 0);
    echo_expect(s, "d", 0, 0);
    CHECK_EQ_INT(rpc_client_stream_status(s, &st), RPC_STATUS_DEADLINE_EXCEEDED);
    rpc_client_stream_close(s);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    CHECK_EQ_INT(atomic_load(&g_cancel_cbs), cancels0 + 2);

    /* Closing a stream that is still open cancels it. */
    s = echo_open(ch, 10000);
    CHECK_EQ_INT(echo_send(s, "e", 0), 0);
    echo_expect(s, "e", 0, 0);
    rpc_client_stream_close(s);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    CHECK_EQ_INT(atomic_load(&g_cancel_cbs), cancels0 + 3);
}

typedef struct {
    rpc_channel *ch;
    int n_ok;
} conc_arg;

static void *conc_main(void *arg)
{
    conc_arg *a = arg;
    rpc_client_stream *s = echo_open(a->ch, 30000);
    char t[32];
    for (int i = 0; i < 50; i++) {
        snprintf(t, sizeof t, "%p-%d", (void *)a, i);
        CHECK_EQ_INT(echo_send(s, t, (uint32_t)(i * 37)), 0);
        if (i % 3 == 2) { /* read in bursts */
            for (int k = i - 2; k <= i; k++) {
                snprintf(t, sizeof t, "%p-%d", (void *)a, k);
                echo_expect(s, t, (uint64_t)k, (uint32_t)(k * 37));
            }
        }
    }
    CHECK_EQ_INT(rpc_client_stream_close_send(s), 0);
    snprintf(t, sizeof t, "%p-%d", (void *)a, 48);
    echo_expect(s, t, 48, 48 * 37);
    snprintf(t, sizeof t, "%p-%d", (void *)a, 49);
    echo_expect(s, t, 49, 49 * 37);
    rpc_status st;
    if (echo_end(s, &st) == RPC_STATUS_OK && strcmp(st.details, "echoed 50") == 0) a->n_ok = 1;
    rpc_client_stream_close(s);
    return NULL;
}

static void test_concurrent(rpc_channel *ch, rpc_server *srv)
{
    enum { T = 8 };
    pthread_t th[T];
    conc_arg a[T];
    for (int i = 0; i < T; i++) {
        a[i].ch = ch;
        a[i].n_ok = 0;
        pthread_create(&th[i], NULL, conc_main, &a[i]);
    }
    int ok = 0;
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        ok += a[i].n_ok;
    }
    CHECK_EQ_INT(ok, T);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    CHECK_EQ_INT(atomic_load(&g_overlaps), 0);
}

int main(void)
{
    rpc_server_params p = rpc_server_default_params();
    p.listen_addr = "127.0.0.1:0";
    p.n_threads = 4;
    p.stream_queue_max = 4;
    p.shutdown_grace_ms = 300;
    rpc_server *srv = NULL;
    char err[PD_ERR_LEN] = "";
    CHECK_EQ_INT(rpc_server_create(&p, &srv, err), 0);
    CHECK_EQ_INT(rpc_server_register(srv, &pdserve__rpctest__v1__rpc_test__descriptor, "Echo",
                                     RPC_BIDI_STREAMING, on_echo, NULL, err), 0);
    CHECK_EQ_INT(rpc_server_register_path(srv, "/x.Y/Z", NULL,
                                          &pdserve__rpctest__v1__echo_request__descriptor,
                                          (rpc_method_kind)3, on_echo, NULL, err), PD_EINVAL);
    CHECK_EQ_INT(rpc_server_start(srv, err), 0);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = addr;
    rpc_channel *ch = NULL;
    CHECK_EQ_INT(rpc_channel_create(&cp, &ch, err), 0);

    test_order(ch);
    test_pipelined(ch);
    test_finish_early(ch, srv);
    test_bad_requests(ch, srv);
    test_cancel_deadline(ch, srv);
    test_concurrent(ch, srv);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    CHECK_EQ_INT(atomic_load(&g_states), 0);

    /* Shutdown with two bidi calls open, one of them held by an application thread that
     * waits for the cancellation: both are cancelled after the grace period. */
    int cancels0 = atomic_load(&g_cancel_cbs);
    rpc_client_stream *s1 = echo_open(ch, 30000), *s2 = echo_open(ch, 30000);
    CHECK_EQ_INT(echo_send(s1, "open", 0), 0);
    echo_expect(s1, "open", 0, 0);
    CHECK_EQ_INT(echo_send(s2, "hold", 0), 0);
    echo_expect(s2, "hold", 0, 0);
    CHECK_EQ_INT(rpc_server_shutdown(srv), 2);
    CHECK_EQ_INT(rpc_server_live_calls(srv), 0);
    for (int i = 0; i < 500 && atomic_load(&g_holders); i++) sleep_ms(10);
    CHECK_EQ_INT(atomic_load(&g_holders), 0);
    CHECK_EQ_INT(atomic_load(&g_cancel_cbs), cancels0 + 2);
    rpc_status st;
    int c1 = rpc_client_stream_status(s1, &st);
    CHECK(c1 == RPC_STATUS_UNAVAILABLE || c1 == RPC_STATUS_CANCELLED);
    int c2 = rpc_client_stream_status(s2, &st);
    CHECK(c2 == RPC_STATUS_UNAVAILABLE || c2 == RPC_STATUS_CANCELLED);
    CHECK_EQ_INT(echo_send(s1, "gone", 0), PD_ESTATE);
    rpc_client_stream_close(s1);
    rpc_client_stream_close(s2);
    CHECK_EQ_INT(atomic_load(&g_states), 0);
    CHECK_EQ_INT(atomic_load(&g_overlaps), 0);
    CHECK_EQ_INT(atomic_load(&g_runs_after_finish), 0);

    rpc_channel_destroy(ch);
    rpc_server_destroy(srv);
    return pd_test_result("test_rpc_bidi");
}
