/* test_rpc_inproc.c -- The gRPC layer with server and clients in one process, so that the
 * sanitizers watch both sides: parameters, unary replies inline and from another thread,
 * deadlines, streams with backpressure, errors mid-stream, dropped calls, double finish,
 * client cancel seen by the server, unknown methods, malformed requests, health, the
 * callback-based client with many concurrent streams, and shutdown with calls still held by
 * application threads. Ends with zero live calls. */
#include <pthread.h>
#include <stdint.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/rpc/rpc.h"
#include "grpc/health/v1/health.pb-c.h"
#include "pdserve/v1/generation.pb-c.h"
#include "tests/test_util.h"

#define GEN "/pdserve.v1.Generation/"

static atomic_int g_producers;       /* application threads holding a call */
static atomic_int g_cancel_cbs;      /* cancel callbacks seen */
static atomic_int g_enospc;          /* rpc_stream_send refusals (queue full) */
static atomic_int g_max_pending;     /* largest rpc_stream_pending seen */
static atomic_int g_second_finish;   /* result of finishing a call twice */
static atomic_int g_saw_cancel_flag; /* producers that stopped on rpc_call_is_cancelled */

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static int64_t wait_live_zero(rpc_server *s, int ms)
{
    for (int i = 0; i < ms / 5 && (rpc_server_live_calls(s) > 0 || atomic_load(&g_producers));
         i++)
        sleep_ms(5);
    return rpc_server_live_calls(s) + atomic_load(&g_producers);
}

/* ---- server side ---- */

static void on_tokenize(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    const Pdserve__V1__TokenizeRequest *r = (const void *)req;
    uint32_t ids[64];
    size_t n = strlen(r->text);
    if (n > 64) n = 64;
    for (size_t i = 0; i < n; i++) ids[i] = (uint8_t)r->text[i];
    Pdserve__V1__TokenizeResponse resp = PDSERVE__V1__TOKENIZE_RESPONSE__INIT;
    resp.n_token_ids = n;
    resp.token_ids = ids;
    CHECK_EQ_INT(rpc_call_reply(call, &resp.base), 0);
    CHECK_EQ_INT(rpc_call_reply(call, &resp.base), PD_ESTATE);
    CHECK_EQ_INT(rpc_stream_send(call, &resp.base), PD_ESTATE); /* not a stream */
}

typedef struct {
    rpc_call *call;
    int delay_ms;
} deferred;

static void on_cancel(rpc_call *call, void *user)
{
    (void)call;
    atomic_fetch_add(&g_cancel_cbs, 1);
    atomic_store((atomic_bool *)user, true);
}

static void *deferred_main(void *arg)
{
    deferred *d = arg;
    for (int t = 0; t < d->delay_ms && !rpc_call_is_cancelled(d->call); t += 5) sleep_ms(5);
    Pdserve__V1__GetModelInfoResponse r = PDSERVE__V1__GET_MODEL_INFO_RESPONSE__INIT;
    r.model_name = "deferred";
    r.max_model_len = 77;
    int rc = rpc_call_reply(d->call, &r.base);
    if (rpc_call_is_cancelled(d->call)) {
        CHECK_EQ_INT(rc, PD_ESTATE);
        atomic_fetch_add(&g_saw_cancel_flag, 1);
    } else {
        CHECK_EQ_INT(rc, 0);
    }
    rpc_call_unref(d->call);
    free(d);
    atomic_fetch_sub(&g_producers, 1);
    return NULL;
}

/* GetModelInfo: answered from another thread after (intptr_t)user ms. */
static void on_model_info(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    deferred *d = calloc(1, sizeof *d);
    char buf[16];
    d->call = call;
    d->delay_ms = (int)(intptr_t)user;
    CHECK_EQ_INT(rpc_call_metadata(call, "no-such-key", buf, sizeof buf), PD_ENOTFOUND);
    rpc_call_ref(call);
    atomic_fetch_add(&g_producers, 1);
    pthread_t t;
    pthread_create(&t, NULL, deferred_main, d);
    pthread_detach(t);
}

typedef struct {
    rpc_call *call;
    char mode[16];
    uint32_t n;
    atomic_bool cancelled;
} producer;

static int send_counter(rpc_call *call, uint32_t i)
{
    Pdserve__V1__GenerateResponse r = PDSERVE__V1__GENERATE_RESPONSE__INIT;
    r.n_token_ids = 1;
    r.token_ids = &i;
    int rc = rpc_stream_send(call, &r.base);
    int p = rpc_stream_pending(call);
    if (p > atomic_load(&g_max_pending)) atomic_store(&g_max_pending, p);
    return rc;
}

static void *producer_main(void *arg)
{
    producer *p = arg;
    rpc_call *c = p->call;
    if (strcmp(p->mode, "slow") == 0) { /* until cancelled */
        for (uint32_t i = 0; !rpc_call_is_cancelled(c); i++) {
            if (send_counter(c, i) == PD_ESTATE) break;
            sleep_ms(5);
        }
        CHECK(atomic_load(&p->cancelled));
        atomic_fetch_add(&g_saw_cancel_flag, 1);
        CHECK_EQ_INT(rpc_stream_finish(c, RPC_STATUS_OK, NULL), PD_ESTATE);
    } else if (strcmp(p->mode, "error") == 0) {
        CHECK_EQ_INT(send_counter(c, 0), 0);
        CHECK_EQ_INT(send_counter(c, 1), 0);
        CHECK_EQ_INT(rpc_stream_finish(c, RPC_STATUS_RESOURCE_EXHAUSTED, "busy: %d", 42), 0);
    } else { /* as fast as the queue allows */
        for (uint32_t i = 0; i < p->n;) {
            int rc = send_counter(c, i);
            if (rc == PD_ENOSPC) {
                atomic_fetch_add(&g_enospc, 1);
                CHECK(rpc_stream_wait_writable(c, 5000) != PD_ESTATE);
                continue;
            }
            CHECK_EQ_INT(rc, 0);
            if (rc != 0) break;
            i++;
        }
        CHECK_EQ_INT(rpc_stream_finish(c, RPC_STATUS_OK, NULL), 0);
        if (strcmp(p->mode, "twice") == 0)
            atomic_store(&g_second_finish, rpc_stream_finish(c, RPC_STATUS_INTERNAL, "x"));
        CHECK_EQ_INT(rpc_stream_send(c, NULL), PD_EINVAL);
        CHECK_EQ_INT(send_counter(c, 0), PD_ESTATE);
    }
    rpc_call_unref(c);
    free(p);
    atomic_fetch_sub(&g_producers, 1);
    return NULL;
}

/* Generate: prompt selects a behaviour; max_tokens counter messages otherwise. */
static void on_generate(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    const Pdserve__V1__GenerateRequest *r = (const void *)req;
    CHECK(rpc_call_remaining_ms(call) > 0);
    CHECK_STR_CONTAINS(rpc_call_path(call), "Generate");
    if (strcmp(r->prompt, "drop") == 0) return; /* forgets the call: INTERNAL */
    if (strcmp(r->prompt, "inline") == 0) {      /* everything from the handler */
        for (uint32_t i = 0; i < 3; i++) CHECK_EQ_INT(send_counter(call, i), 0);
        CHECK_EQ_INT(rpc_stream_finish(call, RPC_STATUS_OK, NULL), 0);
        return;
    }
    producer *p = calloc(1, sizeof *p);
    p->call = call;
    snprintf(p->mode, sizeof p->mode, "%s", r->prompt);
    p->n = r->stopping ? r->stopping->max_tokens : 10;
    atomic_init(&p->cancelled, false);
    rpc_call_ref(call);
    rpc_call_set_cancel_cb(call, on_cancel, &p->cancelled);
    atomic_fetch_add(&g_producers, 1);
    pthread_t t;
    pthread_create(&t, NULL, producer_main, p);
    pthread_detach(t);
}

/* ---- client side ---- */

static ProtobufCMessage *gen_req(Pdserve__V1__GenerateRequest *r, Pdserve__V1__StoppingCriteria *s,
                                 const char *prompt, uint32_t n)
{
    pdserve__v1__generate_request__init(r);
    pdserve__v1__stopping_criteria__init(s);
    r->prompt = (char *)prompt;
    s->max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
    s->max_tokens = n;
    r->stopping = s;
    return &r->base;
}

/* Reads a whole stream; returns the status code, *n the messages, checks they count up. */
static int read_stream(rpc_channel *ch, const char *prompt, uint32_t n, int64_t timeout_ms,
                       int *n_got, rpc_status *st)
{
    Pdserve__V1__GenerateRequest r;
    Pdserve__V1__StoppingCriteria s;
    rpc_client_stream *cs;
    char err[PD_ERR_LEN];
    CHECK_EQ_INT(rpc_client_stream_open(ch, GEN "Generate", gen_req(&r, &s, prompt, n),
                                        &pdserve__v1__generate_response__descriptor, timeout_ms,
                                        &cs, err), 0);
    ProtobufCMessage *m;
    *n_got = 0;
    while (rpc_client_stream_next(cs, &m) == 1) {
        const Pdserve__V1__GenerateResponse *g = (const void *)m;
        CHECK_EQ_INT(g->n_token_ids, 1);
        if (g->n_token_ids == 1) CHECK_EQ_INT(g->token_ids[0], *n_got);
        (*n_got)++;
        protobuf_c_message_free_unpacked(m, NULL);
    }
    int code = rpc_client_stream_status(cs, st);
    rpc_client_stream_close(cs);
    return code;
}

typedef struct {
    atomic_int msgs, done, ok;
    atomic_int last_code;
} async_state;

static void on_async_msg(rpc_client_call *c, ProtobufCMessage *m, void *user)
{
    atomic_fetch_add(&((async_state *)user)->msgs, 1);
    protobuf_c_message_free_unpacked(m, NULL);
}

static void on_async_done(rpc_client_call *c, const rpc_status *st, void *user)
{
    async_state *a = user;
    if (st->code == 0) atomic_fetch_add(&a->ok, 1);
    atomic_store(&a->last_code, st->code);
    atomic_fetch_add(&a->done, 1);
    rpc_client_call_release(c); /* releasing from on_done is allowed */
}

static void test_params(void)
{
    rpc_server_params p = rpc_server_default_params();
    rpc_server *s = NULL;
    char err[PD_ERR_LEN] = "";
    p.n_threads = 0;
    CHECK_EQ_INT(rpc_server_create(&p, &s, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "n_threads");
    /* Listen addresses gRPC would bind other than written (issue #30): refused. */
    const char *bad[] = {"localhost", "127.0.0.1:99999", "127.0.0.1:", "::1:50", "host:5x",
                         ":50051", "127.0.0.1:123456"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        p = rpc_server_default_params();
        p.listen_addr = bad[i];
        CHECK_EQ_INT(rpc_server_create(&p, &s, err), PD_EINVAL);
        CHECK_STR_CONTAINS(err, "host:port");
    }
    const char *good[] = {"[::1]:0", "0.0.0.0:50051", "localhost:0"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        p = rpc_server_default_params();
        p.listen_addr = good[i];
        CHECK_EQ_INT(rpc_server_create(&p, &s, err), 0);
        rpc_server_destroy(s);
        s = NULL;
    }
    p = rpc_server_default_params();
    p.listen_addr = "127.0.0.1:0";
    CHECK_EQ_INT(rpc_server_create(&p, &s, err), 0);
    CHECK_EQ_INT(rpc_server_register(s, &pdserve__v1__generation__descriptor, "Nope", RPC_UNARY,
                                     on_tokenize, NULL, err), PD_ENOTFOUND);
    CHECK_EQ_INT(rpc_server_register(s, &pdserve__v1__generation__descriptor, "Tokenize",
                                     RPC_UNARY, on_tokenize, NULL, err), 0);
    CHECK_EQ_INT(rpc_server_register(s, &pdserve__v1__generation__descriptor, "Tokenize",
                                     RPC_UNARY, on_tokenize, NULL, err), PD_EINVAL);
    CHECK_EQ_INT(rpc_server_port(s), 0);
    rpc_server_destroy(s); /* never started */
    rpc_server_destroy(NULL);
    rpc_channel_destroy(NULL);
    rpc_client_stream_close(NULL);
    rpc_client_call_release(NULL);
    CHECK(strcmp(rpc_status_name(4), "DEADLINE_EXCEEDED") == 0);
    CHECK(strcmp(rpc_status_name(99), "UNKNOWN_CODE") == 0);
}

static void test_unary(rpc_channel *ch)
{
    Pdserve__V1__TokenizeRequest tr = PDSERVE__V1__TOKENIZE_REQUEST__INIT;
    tr.text = "hey";
    ProtobufCMessage *resp = NULL;
    rpc_status st;
    CHECK_EQ_INT(rpc_unary_call(ch, GEN "Tokenize", &tr.base,
                                &pdserve__v1__tokenize_response__descriptor, 5000, &resp, &st), 0);
    const Pdserve__V1__TokenizeResponse *t = (const void *)resp;
    CHECK(t && t->n_token_ids == 3 && t->token_ids[0] == 'h' && t->token_ids[2] == 'y');
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);

    /* Empty request (0 bytes on the wire): fine. */
    tr.text = "";
    CHECK_EQ_INT(rpc_unary_call(ch, GEN "Tokenize", &tr.base,
                                &pdserve__v1__tokenize_response__descriptor, 5000, &resp, &st), 0);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);

    /* Reply from another thread. */
    Pdserve__V1__GetModelInfoRequest mr = PDSERVE__V1__GET_MODEL_INFO_REQUEST__INIT;
    CHECK_EQ_INT(rpc_unary_call(ch, GEN "GetModelInfo", &mr.base,
                                &pdserve__v1__get_model_info_response__descriptor, 5000, &resp,
                                &st), 0);
    const Pdserve__V1__GetModelInfoResponse *mi = (const void *)resp;
    CHECK(mi && mi->max_model_len == 77 && strcmp(mi->model_name, "deferred") == 0);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);

    /* Unknown method. */
    CHECK_EQ_INT(rpc_unary_call(ch, "/no.Such/Method", &mr.base,
                                &pdserve__v1__get_model_info_response__descriptor, 5000, &resp,
                                &st), RPC_STATUS_UNIMPLEMENTED);
    CHECK(resp == NULL);
    CHECK_STR_CONTAINS(st.details, "/no.Such/Method");

    /* Bytes that are not a TokenizeRequest (field 1 as a varint instead of a string). */
    Grpc__Health__V1__HealthCheckResponse junk = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    junk.status = 1;
    CHECK_EQ_INT(rpc_unary_call(ch, GEN "Tokenize", &junk.base,
                                &pdserve__v1__tokenize_response__descriptor, 5000, &resp, &st),
                 RPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR_CONTAINS(st.details, "not a valid pdserve.v1.TokenizeRequest");
}

static void test_unary_deadline(rpc_channel *ch, rpc_server *srv)
{
    int flags0 = atomic_load(&g_saw_cancel_flag);
    Pdserve__V1__GetModelInfoRequest mr = PDSERVE__V1__GET_MODEL_INFO_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st;
    /* /test.Slow/Unary answers after 3 s from another thread; the deadline comes first. */
    CHECK_EQ_INT(rpc_unary_call(ch, "/test.Slow/Unary", &mr.base,
                                &pdserve__v1__get_model_info_response__descriptor, 200, &resp,
                                &st), RPC_STATUS_DEADLINE_EXCEEDED);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    CHECK_EQ_INT(atomic_load(&g_saw_cancel_flag), flags0 + 1);
}

static void test_streams(rpc_channel *ch, rpc_server *srv)
{
    rpc_status st;
    int n;
    CHECK_EQ_INT(read_stream(ch, "fast", 2000, 30000, &n, &st), 0);
    CHECK_EQ_INT(n, 2000);
    CHECK(atomic_load(&g_enospc) > 0);          /* the producer outran the queue */
    CHECK(atomic_load(&g_max_pending) <= 4 + 1); /* queue_max + the one in flight */

    CHECK_EQ_INT(read_stream(ch, "inline", 0, 5000, &n, &st), 0);
    CHECK_EQ_INT(n, 3);

    CHECK_EQ_INT(read_stream(ch, "error", 0, 5000, &n, &st), RPC_STATUS_RESOURCE_EXHAUSTED);
    CHECK_EQ_INT(n, 2);
    CHECK(strcmp(st.details, "busy: 42") == 0);

    CHECK_EQ_INT(read_stream(ch, "drop", 0, 5000, &n, &st), RPC_STATUS_INTERNAL);
    CHECK_EQ_INT(n, 0);

    CHECK_EQ_INT(read_stream(ch, "twice", 5, 5000, &n, &st), 0);
    CHECK_EQ_INT(n, 5);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0); /* the producer is done */
    CHECK_EQ_INT(atomic_load(&g_second_finish), PD_ESTATE);

    /* Deadline on a stream that never ends. */
    int cancels0 = atomic_load(&g_cancel_cbs);
    CHECK_EQ_INT(read_stream(ch, "slow", 0, 100, &n, &st), RPC_STATUS_DEADLINE_EXCEEDED);
    CHECK(n >= 1);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    CHECK_EQ_INT(atomic_load(&g_cancel_cbs), cancels0 + 1);

    /* Client cancel mid-stream: the server's callback runs and the call is freed. */
    Pdserve__V1__GenerateRequest r;
    Pdserve__V1__StoppingCriteria s;
    rpc_client_stream *cs;
    CHECK_EQ_INT(rpc_client_stream_open(ch, GEN "Generate", gen_req(&r, &s, "slow", 0),
                                        &pdserve__v1__generate_response__descriptor, 30000, &cs,
                                        NULL), 0);
    ProtobufCMessage *m;
    for (int i = 0; i < 3; i++) {
        CHECK_EQ_INT(rpc_client_stream_next(cs, &m), 1);
        if (m) protobuf_c_message_free_unpacked(m, NULL);
    }
    rpc_client_stream_cancel(cs);
    while (rpc_client_stream_next(cs, &m) == 1) protobuf_c_message_free_unpacked(m, NULL);
    CHECK_EQ_INT(rpc_client_stream_status(cs, &st), RPC_STATUS_CANCELLED);
    rpc_client_stream_close(cs);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    CHECK_EQ_INT(atomic_load(&g_cancel_cbs), cancels0 + 2);

    /* Closing a stream without reading it cancels it. */
    CHECK_EQ_INT(rpc_client_stream_open(ch, GEN "Generate", gen_req(&r, &s, "slow", 0),
                                        &pdserve__v1__generate_response__descriptor, 30000, &cs,
                                        NULL), 0);
    CHECK_EQ_INT(rpc_client_stream_next(cs, &m), 1);
    if (m) protobuf_c_message_free_unpacked(m, NULL);
    rpc_client_stream_close(cs);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
}

static void test_health(rpc_channel *ch, rpc_server *srv)
{
    Grpc__Health__V1__HealthCheckRequest hr = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    const char *path = "/grpc.health.v1.Health/Check";
    const ProtobufCMessageDescriptor *d = &grpc__health__v1__health_check_response__descriptor;
    ProtobufCMessage *resp;
    rpc_status st;
    const char *names[] = {"", "pdserve.v1.Generation", "grpc.health.v1.Health"};
    for (int i = 0; i < 3; i++) {
        hr.service = (char *)names[i];
        CHECK_EQ_INT(rpc_unary_call(ch, path, &hr.base, d, 5000, &resp, &st), 0);
        CHECK(resp && ((Grpc__Health__V1__HealthCheckResponse *)resp)->status == 1);
        if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    }
    rpc_server_set_serving(srv, false);
    hr.service = "";
    CHECK_EQ_INT(rpc_unary_call(ch, path, &hr.base, d, 5000, &resp, &st), 0);
    CHECK(resp && ((Grpc__Health__V1__HealthCheckResponse *)resp)->status == 2);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    rpc_server_set_serving(srv, true);
    hr.service = "nope.Service";
    CHECK_EQ_INT(rpc_unary_call(ch, path, &hr.base, d, 5000, &resp, &st), RPC_STATUS_NOT_FOUND);
}

static void test_async(rpc_channel *ch, rpc_server *srv)
{
    enum { N = 300 };
    async_state a;
    memset(&a, 0, sizeof a);
    rpc_client_callbacks cb = {on_async_msg, on_async_done, &a};
    Pdserve__V1__GenerateRequest r;
    Pdserve__V1__StoppingCriteria s;
    char err[PD_ERR_LEN];
    for (int i = 0; i < N; i++) {
        rpc_client_call *c;
        CHECK_EQ_INT(rpc_client_call_start(ch, GEN "Generate", gen_req(&r, &s, "fast", 20),
                                           &pdserve__v1__generate_response__descriptor, 30000,
                                           &cb, &c, err), 0);
    }
    for (int i = 0; i < 2000 && atomic_load(&a.done) < N; i++) sleep_ms(10);
    CHECK_EQ_INT(atomic_load(&a.done), N);
    CHECK_EQ_INT(atomic_load(&a.ok), N);
    CHECK_EQ_INT(atomic_load(&a.msgs), N * 20);
    CHECK_EQ_INT(rpc_channel_live_calls(ch), 0);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);

    /* Cancel one; its on_done says CANCELLED. */
    memset(&a, 0, sizeof a);
    rpc_client_call *c;
    rpc_client_callbacks cb2 = {on_async_msg, NULL, &a};
    CHECK_EQ_INT(rpc_client_call_start(ch, GEN "Generate", gen_req(&r, &s, "slow", 0),
                                       &pdserve__v1__generate_response__descriptor, 30000, &cb2,
                                       &c, err), 0);
    for (int i = 0; i < 500 && atomic_load(&a.msgs) < 2; i++) sleep_ms(10);
    rpc_client_call_cancel(c);
    for (int i = 0; i < 500 && rpc_channel_live_calls(ch) > 0; i++) sleep_ms(10);
    CHECK_EQ_INT(rpc_channel_live_calls(ch), 0);
    rpc_client_call_cancel(c); /* after the end: harmless */
    rpc_client_call_release(c);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
}

int main(void)
{
    test_params();

    rpc_server_params p = rpc_server_default_params();
    p.listen_addr = "127.0.0.1:0";
    p.stream_queue_max = 4;
    p.shutdown_grace_ms = 300;
    rpc_server *srv = NULL;
    char err[PD_ERR_LEN] = "";
    const ProtobufCServiceDescriptor *g = &pdserve__v1__generation__descriptor;
    CHECK_EQ_INT(rpc_server_create(&p, &srv, err), 0);
    CHECK_EQ_INT(rpc_server_register(srv, g, "Tokenize", RPC_UNARY, on_tokenize, NULL, err), 0);
    CHECK_EQ_INT(rpc_server_register(srv, g, "GetModelInfo", RPC_UNARY, on_model_info,
                                     (void *)(intptr_t)20, err), 0);
    CHECK_EQ_INT(rpc_server_register_path(srv, "/test.Slow/Unary", "test.Slow",
                                          &pdserve__v1__get_model_info_request__descriptor,
                                          RPC_UNARY, on_model_info, (void *)(intptr_t)3000, err),
                 0);
    CHECK_EQ_INT(rpc_server_register(srv, g, "Generate", RPC_SERVER_STREAMING, on_generate,
                                     NULL, err), 0);
    CHECK_EQ_INT(rpc_server_start(srv, err), 0);
    int port = rpc_server_port(srv);
    CHECK(port > 0);
    CHECK_EQ_INT(rpc_server_start(srv, err), PD_ESTATE);

    /* SO_REUSEPORT off: a second server on the same port fails to start. */
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    rpc_server_params p2 = rpc_server_default_params();
    p2.listen_addr = addr;
    rpc_server *srv2 = NULL;
    CHECK_EQ_INT(rpc_server_create(&p2, &srv2, err), 0);
    CHECK_EQ_INT(rpc_server_start(srv2, err), PD_EIO);
    CHECK_STR_CONTAINS(err, "cannot listen");
    rpc_server_destroy(srv2);

    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = addr;
    rpc_channel *ch = NULL;
    CHECK_EQ_INT(rpc_channel_create(&cp, &ch, err), 0);

    test_unary(ch);
    test_unary_deadline(ch, srv);

    /* A response over the channel's receive limit. */
    rpc_channel_params small = cp;
    small.max_recv_msg_bytes = 16;
    rpc_channel *ch_small = NULL;
    CHECK_EQ_INT(rpc_channel_create(&small, &ch_small, err), 0);
    Pdserve__V1__TokenizeRequest big = PDSERVE__V1__TOKENIZE_REQUEST__INIT;
    big.text = "more than sixteen bytes of token ids";
    ProtobufCMessage *bresp = NULL;
    rpc_status bst;
    CHECK_EQ_INT(rpc_unary_call(ch_small, GEN "Tokenize", &big.base,
                                &pdserve__v1__tokenize_response__descriptor, 5000, &bresp, &bst),
                 RPC_STATUS_RESOURCE_EXHAUSTED);
    rpc_channel_destroy(ch_small);
    CHECK_EQ_INT(wait_live_zero(srv, 5000), 0);
    test_streams(ch, srv);
    test_health(ch, srv);
    test_async(ch, srv);

    /* Shutdown while a producer thread holds a stream: cancelled after the grace period. */
    Pdserve__V1__GenerateRequest r;
    Pdserve__V1__StoppingCriteria s;
    rpc_client_stream *cs;
    CHECK_EQ_INT(rpc_client_stream_open(ch, GEN "Generate", gen_req(&r, &s, "slow", 0),
                                        &pdserve__v1__generate_response__descriptor, 30000, &cs,
                                        NULL), 0);
    ProtobufCMessage *m;
    CHECK_EQ_INT(rpc_client_stream_next(cs, &m), 1);
    if (m) protobuf_c_message_free_unpacked(m, NULL);
    CHECK_EQ_INT(rpc_server_shutdown(srv), 1);
    CHECK_EQ_INT(rpc_server_live_calls(srv), 0);
    CHECK_EQ_INT(rpc_server_shutdown(srv), 0); /* idempotent */
    rpc_status st;
    CHECK_EQ_INT(rpc_client_stream_status(cs, &st), RPC_STATUS_UNAVAILABLE);
    rpc_client_stream_close(cs);
    for (int i = 0; i < 500 && atomic_load(&g_producers); i++) sleep_ms(10);
    CHECK_EQ_INT(atomic_load(&g_producers), 0);

    rpc_server_stats stats;
    rpc_server_stats_get(srv, &stats);
    CHECK(stats.calls_unimplemented >= 1);
    CHECK(stats.calls_bad_request >= 1);
    CHECK(stats.live_calls_peak >= 2);

    /* Calls to a server that is gone fail fast. */
    Pdserve__V1__TokenizeRequest tr = PDSERVE__V1__TOKENIZE_REQUEST__INIT;
    ProtobufCMessage *resp;
    CHECK_EQ_INT(rpc_unary_call(ch, GEN "Tokenize", &tr.base,
                                &pdserve__v1__tokenize_response__descriptor, 5000, &resp, &st),
                 RPC_STATUS_UNAVAILABLE);

    rpc_channel_destroy(ch);
    rpc_server_destroy(srv);
    return pd_test_result("test_rpc_inproc");
}
