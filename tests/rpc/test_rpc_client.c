/* test_rpc_client.c -- Our C client (common/rpc/) against the pdserve-rpc-testserver process:
 * unary and streaming calls, replies from the server's worker thread, client cancel
 * mid-stream (the server sees it and frees the call), deadlines, unknown methods, malformed
 * and oversized requests, health, 1,000 concurrent streams with the callback client, and
 * shutdown under load. Every server must exit 0 with no live call and no sanitizer report.
 *
 * usage: test_rpc_client PATH-TO-pdserve-rpc-testserver */
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/rpc/rpc.h"
#include "grpc/health/v1/health.pb-c.h"
#include "pdserve/v1/generation.pb-c.h"
#include "rpctest.pb-c.h"
#include "tests/test_util.h"

#define GEN "/pdserve.v1.Generation/"
#define GEN_RESP (&pdserve__v1__generate_response__descriptor)

extern char **environ;
static const char *g_server_bin;

typedef struct {
    pid_t pid;
    int port;
    char target[64];
    char err_path[64];      /* the server's stderr */
} server_proc;

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* Starts the test server with extra args (NULL-terminated) and reads its port. */
static int server_start(server_proc *s, const char *const *extra)
{
    memset(s, 0, sizeof *s);
    snprintf(s->err_path, sizeof s->err_path, "/tmp/pd_rpc_srv_XXXXXX");
    int efd = mkstemp(s->err_path);
    int pfd[2];
    if (efd < 0 || pipe(pfd) != 0) return -1;
    const char *argv[16] = {g_server_bin, "--listen", "127.0.0.1:0"};
    int n = 3;
    for (int i = 0; extra && extra[i] && n < 15; i++) argv[n++] = extra[i];
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pfd[1], 1);
    posix_spawn_file_actions_adddup2(&fa, efd, 2);
    posix_spawn_file_actions_addclose(&fa, pfd[0]);
    int rc = posix_spawn(&s->pid, g_server_bin, &fa, NULL, (char *const *)argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(pfd[1]);
    close(efd);
    if (rc != 0) {
        close(pfd[0]);
        return -1;
    }
    FILE *f = fdopen(pfd[0], "r");
    char line[128] = "";
    if (!f || !fgets(line, sizeof line, f) || sscanf(line, "PORT %d", &s->port) != 1) {
        fprintf(stderr, "server did not start: \"%s\"\n", line);
        if (f) fclose(f);
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
        return -1;
    }
    fclose(f);
    snprintf(s->target, sizeof s->target, "127.0.0.1:%d", s->port);
    return 0;
}

/* SIGTERM (unless already sent), waits, checks a clean exit; returns the exit code. */
static int server_stop(server_proc *s, bool signal_it)
{
    if (signal_it) kill(s->pid, SIGTERM);
    int status = 0;
    for (int i = 0; i < 6000 && waitpid(s->pid, &status, WNOHANG) == 0; i++) sleep_ms(10);
    if (waitpid(s->pid, &status, WNOHANG) == 0 && kill(s->pid, 0) == 0) {
        fprintf(stderr, "server hung at shutdown\n");
        kill(s->pid, SIGKILL);
        waitpid(s->pid, &status, 0);
    }
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    static char text[1 << 16];
    FILE *f = fopen(s->err_path, "r");
    size_t n = f ? fread(text, 1, sizeof text - 1, f) : 0;
    text[n] = '\0';
    if (f) fclose(f);
    unlink(s->err_path);
    CHECK_EQ_INT(code, 0);
    CHECK_STR_CONTAINS(text, "live_calls=0");
    CHECK(!strstr(text, "Sanitizer") && !strstr(text, "runtime error:"));
    if (code != 0 || strstr(text, "Sanitizer")) fprintf(stderr, "server stderr:\n%s\n", text);
    return code;
}

/* Options with the test server's x-delay-ms (and x-barrier when not NULL); md[2]. */
static rpc_call_opts opts_delay(int64_t timeout_ms, const char *delay_ms, rpc_metadata *md)
{
    md[0].key = "x-delay-ms";
    md[0].value = delay_ms;
    return (rpc_call_opts){.timeout_ms = timeout_ms, .md = delay_ms ? md : NULL,
                           .n_md = delay_ms ? 1 : 0};
}

static Pdserve__Rpctest__V1__StatsResponse stats_get(rpc_channel *ch)
{
    Pdserve__Rpctest__V1__StatsRequest req = PDSERVE__RPCTEST__V1__STATS_REQUEST__INIT;
    Pdserve__Rpctest__V1__StatsResponse out = PDSERVE__RPCTEST__V1__STATS_RESPONSE__INIT;
    ProtobufCMessage *m = NULL;
    rpc_call_opts o = {.timeout_ms = 5000};
    if (rpc_unary_call_opts(ch, "/pdserve.rpctest.v1.RpcTest/Stats", &req.base,
                       &pdserve__rpctest__v1__stats_response__descriptor, &o, &m, NULL) == 0) {
        out = *(Pdserve__Rpctest__V1__StatsResponse *)m;
        protobuf_c_message_free_unpacked(m, NULL);
    }
    return out;
}

/* Waits until the server holds nothing but the Stats call; returns the last stats. */
static Pdserve__Rpctest__V1__StatsResponse wait_idle(rpc_channel *ch)
{
    Pdserve__Rpctest__V1__StatsResponse st = stats_get(ch);
    for (int i = 0; i < 500 && (st.live_calls != 1 || st.jobs_active != 0); i++) {
        sleep_ms(10);
        st = stats_get(ch);
    }
    CHECK_EQ_INT(st.live_calls, 1);
    CHECK_EQ_INT(st.jobs_active, 0);
    return st;
}

/* Reads a whole Generate stream; returns the status; ids[] receives the tokens. */
static int gen_read(rpc_channel *ch, const Pdserve__V1__GenerateRequest *req,
                    const rpc_call_opts *o, uint32_t *ids, int cap, int *n, rpc_status *st)
{
    rpc_client_stream *s;
    char err[PD_ERR_LEN];
    *n = 0;
    if (rpc_client_stream_open_opts(ch, GEN "Generate", &req->base, GEN_RESP, o, &s, err) != 0)
        return -1;
    ProtobufCMessage *m;
    while (rpc_client_stream_next(s, &m) == 1) {
        const Pdserve__V1__GenerateResponse *g = (const void *)m;
        for (size_t i = 0; i < g->n_token_ids; i++)
            if (*n < cap) ids[(*n)++] = g->token_ids[i];
        protobuf_c_message_free_unpacked(m, NULL);
    }
    int code = rpc_client_stream_status(s, st);
    rpc_client_stream_close(s);
    return code;
}

static void test_basic(rpc_channel *ch)
{
    rpc_call_opts o = {.timeout_ms = 10000};
    rpc_status st;
    ProtobufCMessage *m;
    Pdserve__V1__TokenizeRequest tr = PDSERVE__V1__TOKENIZE_REQUEST__INIT;
    tr.text = "abc";
    CHECK_EQ_INT(rpc_unary_call_opts(ch, GEN "Tokenize", &tr.base,
                                &pdserve__v1__tokenize_response__descriptor, &o, &m, &st), 0);
    const Pdserve__V1__TokenizeResponse *t = (const void *)m;
    CHECK(t && t->n_token_ids == 3 && t->token_ids[1] == 'b');
    if (m) protobuf_c_message_free_unpacked(m, NULL);

    rpc_metadata md[2];
    rpc_call_opts od = opts_delay(10000, "30", md); /* answered by the worker thread */
    CHECK_EQ_INT(rpc_unary_call_opts(ch, GEN "Tokenize", &tr.base,
                                &pdserve__v1__tokenize_response__descriptor, &od, &m, &st), 0);
    if (m) protobuf_c_message_free_unpacked(m, NULL);

    Pdserve__V1__GetModelInfoRequest mr = PDSERVE__V1__GET_MODEL_INFO_REQUEST__INIT;
    CHECK_EQ_INT(rpc_unary_call_opts(ch, GEN "GetModelInfo", &mr.base,
                                &pdserve__v1__get_model_info_response__descriptor, NULL, &m,
                                &st), 0);
    const Pdserve__V1__GetModelInfoResponse *mi = (const void *)m;
    CHECK(mi && mi->n_eos_token_ids == 2 && mi->bos_token_id_set_case ==
                    PDSERVE__V1__GET_MODEL_INFO_RESPONSE__BOS_TOKEN_ID_SET_BOS_TOKEN_ID);
    if (m) protobuf_c_message_free_unpacked(m, NULL);

    /* Streams: echo 1000 ids; counter with logprobs. */
    static uint32_t ids[1000], got[1000];
    for (int i = 0; i < 1000; i++) ids[i] = (uint32_t)(i * 7);
    Pdserve__V1__GenerateRequest g = PDSERVE__V1__GENERATE_REQUEST__INIT;
    g.n_prompt_token_ids = 1000;
    g.prompt_token_ids = ids;
    int n;
    CHECK_EQ_INT(gen_read(ch, &g, &o, got, 1000, &n, &st), 0);
    CHECK_EQ_INT(n, 1000);
    CHECK(memcmp(ids, got, sizeof ids) == 0);

    Pdserve__V1__StoppingCriteria sc = PDSERVE__V1__STOPPING_CRITERIA__INIT;
    sc.max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
    sc.max_tokens = 500;
    Pdserve__V1__GenerateRequest g2 = PDSERVE__V1__GENERATE_REQUEST__INIT;
    g2.prompt = "x";
    g2.stopping = &sc;
    g2.logprobs = 3;
    CHECK_EQ_INT(gen_read(ch, &g2, &o, got, 1000, &n, &st), 0);
    CHECK_EQ_INT(n, 500);
    CHECK_EQ_INT(got[499], 499);

    /* Validation error from the handler, with details. */
    Pdserve__V1__GenerateRequest bad = PDSERVE__V1__GENERATE_REQUEST__INIT;
    CHECK_EQ_INT(gen_read(ch, &bad, &o, got, 1000, &n, &st), RPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR_CONTAINS(st.details, "exactly one of prompt and prompt_token_ids");
}

static void test_errors(rpc_channel *ch)
{
    rpc_call_opts o = {.timeout_ms = 10000};
    rpc_status st;
    ProtobufCMessage *m = NULL;
    Pdserve__V1__GetModelInfoRequest mr = PDSERVE__V1__GET_MODEL_INFO_REQUEST__INIT;
    CHECK_EQ_INT(rpc_unary_call_opts(ch, GEN "Nope", &mr.base,
                                &pdserve__v1__get_model_info_response__descriptor, &o, &m, &st),
                 RPC_STATUS_UNIMPLEMENTED);

    /* Field 1 as a varint where TokenizeRequest has a string: not a valid message. */
    Grpc__Health__V1__HealthCheckResponse junk = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    junk.status = 2;
    CHECK_EQ_INT(rpc_unary_call_opts(ch, GEN "Tokenize", &junk.base,
                                &pdserve__v1__tokenize_response__descriptor, &o, &m, &st),
                 RPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR_CONTAINS(st.details, "not a valid");

    /* 5 MiB against the server's 4 MiB limit. */
    size_t big = 5u << 20;
    char *text = malloc(big + 1);
    memset(text, 'a', big);
    text[big] = '\0';
    Pdserve__V1__TokenizeRequest tr = PDSERVE__V1__TOKENIZE_REQUEST__INIT;
    tr.text = text;
    CHECK_EQ_INT(rpc_unary_call_opts(ch, GEN "Tokenize", &tr.base,
                                &pdserve__v1__tokenize_response__descriptor, &o, &m, &st),
                 RPC_STATUS_RESOURCE_EXHAUSTED);
    free(text);

    /* Illegal metadata is refused locally. */
    rpc_metadata md = {"X-Upper", "1"};
    rpc_call_opts om = {.timeout_ms = 1000, .md = &md, .n_md = 1};
    CHECK_EQ_INT(rpc_unary_call_opts(ch, GEN "GetModelInfo", &mr.base,
                                &pdserve__v1__get_model_info_response__descriptor, &om, &m, &st),
                 RPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR_CONTAINS(st.details, "X-Upper");

    /* Health. */
    Grpc__Health__V1__HealthCheckRequest hr = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    const ProtobufCMessageDescriptor *hd = &grpc__health__v1__health_check_response__descriptor;
    hr.service = "pdserve.v1.Generation";
    CHECK_EQ_INT(rpc_unary_call_opts(ch, "/grpc.health.v1.Health/Check", &hr.base, hd, &o, &m, &st),
                 0);
    CHECK(m && ((Grpc__Health__V1__HealthCheckResponse *)m)->status ==
                   GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
    if (m) protobuf_c_message_free_unpacked(m, NULL);
    hr.service = "x.Unknown";
    CHECK_EQ_INT(rpc_unary_call_opts(ch, "/grpc.health.v1.Health/Check", &hr.base, hd, &o, &m, &st),
                 RPC_STATUS_NOT_FOUND);
}

static void test_cancel_and_deadline(rpc_channel *ch)
{
    Pdserve__Rpctest__V1__StatsResponse st0 = wait_idle(ch);
    rpc_metadata md[2];
    rpc_call_opts od = opts_delay(30000, "5", md);
    Pdserve__V1__StoppingCriteria sc = PDSERVE__V1__STOPPING_CRITERIA__INIT;
    sc.max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
    sc.max_tokens = 1000000;
    Pdserve__V1__GenerateRequest g = PDSERVE__V1__GENERATE_REQUEST__INIT;
    g.prompt = "x";
    g.stopping = &sc;
    rpc_client_stream *s;
    CHECK_EQ_INT(rpc_client_stream_open_opts(ch, GEN "Generate", &g.base, GEN_RESP, &od, &s, NULL), 0);
    ProtobufCMessage *m;
    for (int i = 0; i < 3; i++) {
        CHECK_EQ_INT(rpc_client_stream_next(s, &m), 1);
        if (m) protobuf_c_message_free_unpacked(m, NULL);
    }
    rpc_client_stream_cancel(s);
    rpc_status st;
    CHECK_EQ_INT(rpc_client_stream_status(s, &st), RPC_STATUS_CANCELLED);
    rpc_client_stream_close(s);
    Pdserve__Rpctest__V1__StatsResponse st1 = wait_idle(ch);
    CHECK_EQ_INT(st1.cancel_callbacks, st0.cancel_callbacks + 1);
    CHECK_EQ_INT(st1.calls_cancelled, st0.calls_cancelled + 1);

    /* Deadline mid-stream. */
    rpc_call_opts od2 = opts_delay(300, "10", md);
    static uint32_t got[1000];
    int n;
    CHECK_EQ_INT(gen_read(ch, &g, &od2, got, 1000, &n, &st), RPC_STATUS_DEADLINE_EXCEEDED);
    CHECK(n > 0 && n < 1000);
    Pdserve__Rpctest__V1__StatsResponse st2 = wait_idle(ch);
    CHECK_EQ_INT(st2.cancel_callbacks, st1.cancel_callbacks + 1);
}

typedef struct {
    atomic_int msgs, done, ok, unavailable;
} async_state;

static void on_msg(rpc_client_call *c, ProtobufCMessage *m, void *user)
{
    const Pdserve__V1__GenerateResponse *g = (const void *)m;
    atomic_fetch_add(&((async_state *)user)->msgs, (int)g->n_token_ids);
    protobuf_c_message_free_unpacked(m, NULL);
}

static void on_done(rpc_client_call *c, const rpc_status *st, void *user)
{
    async_state *a = user;
    if (st->code == RPC_STATUS_OK) atomic_fetch_add(&a->ok, 1);
    if (st->code == RPC_STATUS_UNAVAILABLE) atomic_fetch_add(&a->unavailable, 1);
    atomic_fetch_add(&a->done, 1);
}

/* Starts n Generate streams of `tokens` tokens each with a delay; handles go to calls[]. */
static void start_many(rpc_channel *ch, int n, uint32_t tokens, const char *delay,
                       const char *barrier, async_state *a, rpc_client_call **calls)
{
    rpc_metadata md[2];
    rpc_call_opts od = opts_delay(120000, delay, md);
    if (barrier) {
        md[1] = (rpc_metadata){"x-barrier", barrier};
        od.n_md = 2;
    }
    Pdserve__V1__StoppingCriteria sc = PDSERVE__V1__STOPPING_CRITERIA__INIT;
    sc.max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
    sc.max_tokens = tokens;
    Pdserve__V1__GenerateRequest g = PDSERVE__V1__GENERATE_REQUEST__INIT;
    g.prompt = "x";
    g.stopping = &sc;
    rpc_client_callbacks cb = {on_msg, on_done, a};
    char err[PD_ERR_LEN];
    for (int i = 0; i < n; i++)
        CHECK_EQ_INT(rpc_client_call_start_opts(ch, GEN "Generate", &g.base, GEN_RESP, &od, &cb,
                                           &calls[i], err), 0);
}

static void test_many_streams(rpc_channel *ch)
{
    enum { N = 1000 };
    static rpc_client_call *calls[N];
    async_state a;
    memset(&a, 0, sizeof a);
    start_many(ch, N, 3, "10", "1000", &a, calls);
    for (int i = 0; i < 6000 && atomic_load(&a.done) < N; i++) sleep_ms(10);
    CHECK_EQ_INT(atomic_load(&a.done), N);
    CHECK_EQ_INT(atomic_load(&a.ok), N);
    CHECK_EQ_INT(atomic_load(&a.msgs), 3 * N);
    for (int i = 0; i < N; i++) rpc_client_call_release(calls[i]);
    CHECK_EQ_INT(rpc_channel_live_calls(ch), 0);
    Pdserve__Rpctest__V1__StatsResponse st = wait_idle(ch);
    CHECK_MSG(st.live_calls_peak >= N, "peak %lld", (long long)st.live_calls_peak);
}

/* A channel destroyed from one of its own on_done callbacks (the router's last reference to
 * an instance the registry let go, dropped by a request's completion): no self-join, no
 * hang, nothing used after free (ASan), the other calls' on_done still run. */
typedef struct {
    rpc_channel *ch;
    atomic_int done, destroyed;
} selfdestroy_state;

static void sd_on_done(rpc_client_call *c, const rpc_status *st, void *user)
{
    (void)c;
    (void)st;
    selfdestroy_state *s = user;
    if (atomic_fetch_add(&s->done, 1) == 0) { /* the first call to end destroys the channel */
        rpc_channel_destroy(s->ch);
        atomic_store(&s->destroyed, 1);
    }
}

static void test_destroy_from_callback(const char *target)
{
    for (int round = 0; round < 5; round++) {
        rpc_channel_params cp = rpc_channel_default_params();
        cp.target = target;
        static selfdestroy_state s;
        memset(&s, 0, sizeof s);
        CHECK_EQ_INT(rpc_channel_create(&cp, &s.ch, NULL), 0);
        enum { N = 8 };
        rpc_client_call *calls[N];
        Pdserve__V1__StoppingCriteria sc = PDSERVE__V1__STOPPING_CRITERIA__INIT;
        sc.max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
        Pdserve__V1__GenerateRequest g = PDSERVE__V1__GENERATE_REQUEST__INIT;
        g.prompt = "x";
        g.stopping = &sc;
        rpc_client_callbacks cb = {NULL, sd_on_done, &s};
        char err[PD_ERR_LEN];
        /* the long calls first, the short one last: it may end (and destroy the channel)
         * at once, and no call may start on a channel being destroyed */
        for (int i = N - 1; i >= 0; i--) {
            /* one short call, the others long: the destroy cancels them */
            sc.max_tokens = i == 0 ? 2 : 1000000;
            rpc_metadata md[2];
            rpc_call_opts od = opts_delay(60000, i == 0 ? "1" : "5", md);
            CHECK_EQ_INT(rpc_client_call_start_opts(s.ch, GEN "Generate", &g.base, GEN_RESP, &od,
                                                    &cb, &calls[i], err), 0);
        }
        for (int i = 0; i < 3000 && atomic_load(&s.done) < N; i++) sleep_ms(5);
        CHECK_EQ_INT(atomic_load(&s.destroyed), 1);
        CHECK_MSG(atomic_load(&s.done) == N, "round %d: %d of %d calls ended", round,
                  atomic_load(&s.done), N);
        for (int i = 0; i < N; i++) rpc_client_call_release(calls[i]);
        sleep_ms(50); /* the destroying thread finishes (LeakSanitizer would see the channel) */
    }
}

static void test_shutdown_under_load(void)
{
    server_proc sp;
    const char *extra[] = {"--grace-ms", "1000", NULL};
    CHECK_EQ_INT(server_start(&sp, extra), 0);
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = sp.target;
    rpc_channel *ch;
    CHECK_EQ_INT(rpc_channel_create(&cp, &ch, NULL), 0);
    enum { N = 50 };
    rpc_client_call *longs[N], *shorts[N];
    async_state al, as;
    memset(&al, 0, sizeof al);
    memset(&as, 0, sizeof as);
    const Pdserve__Rpctest__V1__StatsResponse st0 = stats_get(ch);
    start_many(ch, N, 1000000, "5", NULL, &al, longs);
    start_many(ch, N, 10, "10", NULL, &as, shorts);
    /* Every call in the server's hands before the signal: one that reaches it later is refused
     * (UNAVAILABLE), rightly, and on a loaded machine (ASan, 2 cores) some short ones did. Each
     * Stats call counts itself among the started. */
    for (int k = 1; k <= 1000; k++) {
        const Pdserve__Rpctest__V1__StatsResponse st = stats_get(ch);
        if (st.calls_started - st0.calls_started - k >= 2 * N) break;
        sleep_ms(5);
    }
    for (int i = 0; i < 1000 && atomic_load(&al.msgs) < N; i++) sleep_ms(5);
    kill(sp.pid, SIGTERM);
    for (int i = 0; i < 3000 && atomic_load(&al.done) + atomic_load(&as.done) < 2 * N; i++)
        sleep_ms(10);
    CHECK_EQ_INT(atomic_load(&as.ok), N);          /* finished within the grace period */
    CHECK_EQ_INT(atomic_load(&al.unavailable), N); /* cancelled at its end */
    server_stop(&sp, false);
    for (int i = 0; i < N; i++) {
        rpc_client_call_release(longs[i]);
        rpc_client_call_release(shorts[i]);
    }
    rpc_channel_destroy(ch);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH-TO-pdserve-rpc-testserver\n", argv[0]);
        return 2;
    }
    g_server_bin = argv[1];
    signal(SIGPIPE, SIG_IGN);
    server_proc sp;
    if (server_start(&sp, NULL) != 0) {
        fprintf(stderr, "cannot start %s\n", g_server_bin);
        return 1;
    }
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = sp.target;
    rpc_channel *ch = NULL;
    char err[PD_ERR_LEN];
    CHECK_EQ_INT(rpc_channel_create(&cp, &ch, err), 0);
    test_basic(ch);
    test_errors(ch);
    test_cancel_and_deadline(ch);
    test_many_streams(ch);
    test_destroy_from_callback(sp.target);
    rpc_channel_destroy(ch);
    server_stop(&sp, true);

    test_shutdown_under_load();
    return pd_test_result("test_rpc_client");
}
