/* testserver_main.c -- pdserve-rpc-testserver: the public pdserve.v1.Generation API over a
 * trivial backend, for tests and benchmarks of the gRPC layer only. Generate streams the
 * prompt's token ids back one per message (or max_tokens counter tokens when set), Tokenize
 * returns the prompt's bytes as ids, GetModelInfo fixed values. Streams (and delayed unary
 * replies) are produced by a worker thread, as an engine thread would, which exercises the
 * cross-thread send path, backpressure and cancellation. The test service's RpcTest.Echo
 * (bidirectional) answers every request at once and ends OK at the half-close.
 *
 * Per-call knobs (request metadata): "x-delay-ms" (delay between stream messages, or before a
 * Tokenize reply); "x-barrier" N (a stream starts only once N calls are held by the worker,
 * so that tests can have N streams open at once without depending on timing). Prints "PORT <n>" on stdout when listening; SIGTERM/SIGINT shut it down
 * gracefully; exits 0 only if no call is left alive. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>

#include "common/log.h"
#include "common/rpc/rpc.h"
#include "rpctest.pb-c.h" /* generated from testserver/rpctest.proto */
#include "pdserve/v1/generation.pb-c.h"

typedef enum { JOB_STREAM = 0, JOB_TOKENIZE } job_kind;

/* One call the worker thread is producing for. */
typedef struct job {
    job_kind kind;
    rpc_call *call;         /* referenced until the job is dropped */
    uint32_t *ids;          /* [n_ids] echo source / Tokenize answer */
    size_t n_ids;
    uint32_t n_total;       /* messages with a token to send */
    uint32_t next;          /* next token index */
    bool counter;           /* tokens are 0, 1, 2, ... (max_tokens set) */
    bool text_bytes;        /* text is the token as a byte (prompt given as text) */
    uint32_t logprobs;      /* top-n asked */
    int64_t delay_us;
    int64_t due_us;         /* monotonic time of the next message */
    int64_t barrier;        /* start once this many jobs are active (0 = at once) */
    char request_id[64];
    struct job *next_job;
} job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *incoming;          /* handed over by handlers, under mu */
    bool stop;
    pthread_t thread;
    rpc_server *srv;
    int64_t default_delay_us;
    atomic_llong cancel_callbacks, streams_completed, jobs_active;
} backend;

static int64_t now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

static void job_free(backend *b, job *j)
{
    rpc_stream_finish(j->call, RPC_STATUS_INTERNAL, "dropped"); /* no-op unless unfinished */
    rpc_call_unref(j->call);
    free(j->ids);
    free(j);
    atomic_fetch_sub(&b->jobs_active, 1);
}

static void on_cancel(rpc_call *call, void *user)
{
    backend *b = user;
    atomic_fetch_add(&b->cancel_callbacks, 1);
    pthread_mutex_lock(&b->mu); /* wake the worker so that it drops the job now */
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

static void backend_submit(backend *b, job *j)
{
    rpc_call_ref(j->call);
    atomic_fetch_add(&b->jobs_active, 1);
    rpc_call_set_cancel_cb(j->call, on_cancel, b);
    pthread_mutex_lock(&b->mu);
    j->next_job = b->incoming;
    b->incoming = j;
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

/* Sends the job's next token message. Returns rpc_stream_send's result. */
static int send_token(job *j)
{
    Pdserve__V1__GenerateResponse r = PDSERVE__V1__GENERATE_RESPONSE__INIT;
    Pdserve__V1__Usage usage = PDSERVE__V1__USAGE__INIT;
    Pdserve__V1__TokenLogprob lp = PDSERVE__V1__TOKEN_LOGPROB__INIT;
    Pdserve__V1__TokenLogprob *lps[1] = {&lp};
    Pdserve__V1__TopLogprob top[20];
    Pdserve__V1__TopLogprob *tops[20];
    uint32_t tok = 0;
    char text[16] = "";
    bool last = j->next + 1 >= j->n_total;
    r.request_id = j->request_id;
    if (j->n_total > 0) {
        tok = j->counter ? j->next : j->ids[j->next];
        r.n_token_ids = 1;
        r.token_ids = &tok;
        if (j->text_bytes && !j->counter) {
            text[0] = (char)tok;
            text[1] = '\0';
        } else {
            snprintf(text, sizeof text, "%" PRIu32 " ", tok);
        }
        r.text = text;
        if (j->logprobs > 0) {
            lp.token_id = tok;
            lp.logprob = -0.25f;
            for (uint32_t k = 0; k < j->logprobs && k < 20; k++) {
                pdserve__v1__top_logprob__init(&top[k]);
                top[k].token_id = tok + k;
                top[k].logprob = -0.25f - (float)k;
                tops[k] = &top[k];
            }
            lp.n_top = j->logprobs;
            lp.top = tops;
            r.n_logprobs = 1;
            r.logprobs = lps;
        }
    }
    if (last) {
        r.finish_reason = j->counter ? PDSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH
                                     : PDSERVE__V1__FINISH_REASON__FINISH_REASON_EOS;
        usage.prompt_tokens = (uint32_t)j->n_ids;
        usage.completion_tokens = j->n_total;
        r.usage = &usage;
    }
    return rpc_stream_send(j->call, &r.base);
}

/* Advances one job. Returns 1 when it is done (drop it), 0 otherwise; *blocked is set when
 * its queue was full. */
static int job_step(backend *b, job *j, int64_t now, bool *blocked)
{
    if (rpc_call_is_cancelled(j->call)) return 1;
    if (j->kind == JOB_TOKENIZE) {
        if (j->due_us > now) return 0;
        Pdserve__V1__TokenizeResponse r = PDSERVE__V1__TOKENIZE_RESPONSE__INIT;
        r.n_token_ids = j->n_ids;
        r.token_ids = j->ids;
        rpc_call_reply(j->call, &r.base);
        return 1;
    }
    if (j->barrier > 0) {
        if (atomic_load(&b->jobs_active) < j->barrier) {
            j->due_us = now + 1000; /* look again in 1 ms */
            return 0;
        }
        j->barrier = 0;
        j->due_us = now;
    }
    uint32_t n_msgs = j->n_total ? j->n_total : 1; /* an empty completion still ends */
    while (j->next < n_msgs && j->due_us <= now) {
        int rc = send_token(j);
        if (rc == PD_ENOSPC) {
            *blocked = true;
            return 0;
        }
        if (rc != 0) return 1; /* cancelled meanwhile */
        j->next++;
        j->due_us += j->delay_us;
    }
    if (j->next < n_msgs) return 0;
    if (rpc_stream_finish(j->call, RPC_STATUS_OK, NULL) == 0)
        atomic_fetch_add(&b->streams_completed, 1);
    return 1;
}

static void *worker_main(void *arg)
{
    backend *b = arg;
    job *active = NULL;
    for (;;) {
        pthread_mutex_lock(&b->mu);
        while (b->incoming) {
            job *j = b->incoming;
            b->incoming = j->next_job;
            j->next_job = active;
            active = j;
        }
        bool stop = b->stop;
        pthread_mutex_unlock(&b->mu);
        if (stop && !active) break;

        /* Never hold b->mu while calling rpc_*: a cancel callback takes it. */
        int64_t now = now_us(), next_due = INT64_MAX;
        job *blocked = NULL;
        for (job **pj = &active; *pj;) {
            job *j = *pj;
            bool blk = false;
            if (job_step(b, j, now, &blk)) {
                *pj = j->next_job;
                job_free(b, j);
                continue;
            }
            if (blk && !blocked) blocked = j;
            else if (!blk && j->due_us < next_due) next_due = j->due_us;
            pj = &j->next_job;
        }
        if (blocked) {
            rpc_stream_wait_writable(blocked->call, 1);
            continue;
        }
        pthread_mutex_lock(&b->mu);
        if (!b->incoming && !b->stop) {
            if (next_due == INT64_MAX) {
                pthread_cond_wait(&b->cv, &b->mu);
            } else if (next_due > now_us()) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                int64_t wait_us = next_due - now_us();
                if (wait_us > 0) {
                    int64_t ns = ts.tv_nsec + (wait_us % 1000000) * 1000;
                    ts.tv_sec += (time_t)(wait_us / 1000000 + ns / 1000000000);
                    ts.tv_nsec = (long)(ns % 1000000000);
                    pthread_cond_timedwait(&b->cv, &b->mu, &ts);
                }
            }
        }
        pthread_mutex_unlock(&b->mu);
    }
    return NULL;
}

static int64_t call_delay_us(const backend *b, rpc_call *call)
{
    char buf[32];
    if (rpc_call_metadata(call, "x-delay-ms", buf, sizeof buf) >= 0)
        return (int64_t)(strtod(buf, NULL) * 1000.0);
    return b->default_delay_us;
}

static int64_t call_barrier(rpc_call *call)
{
    char buf[32];
    return rpc_call_metadata(call, "x-barrier", buf, sizeof buf) >= 0 ? atoll(buf) : 0;
}

/* ---- handlers (run on the server's worker threads) ---- */

static void on_generate(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    backend *b = user;
    const Pdserve__V1__GenerateRequest *r = (const void *)req;
    bool has_text = r->prompt[0] != '\0', has_ids = r->n_prompt_token_ids > 0;
    if (has_text == has_ids) {
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT,
                          "exactly one of prompt and prompt_token_ids must be set");
        return;
    }
    if (r->sampling && r->sampling->temperature_set_case ==
                           PDSERVE__V1__SAMPLING_PARAMS__TEMPERATURE_SET_TEMPERATURE &&
        !(r->sampling->temperature >= 0.0f)) {
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT,
                          "sampling.temperature must be >= 0 (got %g)",
                          (double)r->sampling->temperature);
        return;
    }
    if (r->logprobs > 20) {
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT, "logprobs %u > 20", r->logprobs);
        return;
    }
    job *j = calloc(1, sizeof *j);
    size_t n = has_ids ? r->n_prompt_token_ids : strlen(r->prompt);
    if (!j || !(j->ids = malloc((n ? n : 1) * sizeof *j->ids))) {
        free(j);
        rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    for (size_t i = 0; i < n; i++)
        j->ids[i] = has_ids ? r->prompt_token_ids[i] : (uint8_t)r->prompt[i];
    j->kind = JOB_STREAM;
    j->call = call;
    j->n_ids = n;
    j->text_bytes = has_text;
    j->counter = r->stopping && r->stopping->max_tokens_set_case ==
                                    PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
    j->n_total = j->counter ? r->stopping->max_tokens : (uint32_t)n;
    j->logprobs = r->logprobs;
    j->delay_us = call_delay_us(b, call);
    j->due_us = now_us();
    j->barrier = call_barrier(call);
    if (r->request_id[0])
        snprintf(j->request_id, sizeof j->request_id, "%s", r->request_id);
    else
        snprintf(j->request_id, sizeof j->request_id, "req-%" PRIu64, rpc_call_id(call));
    backend_submit(b, j);
}

static void on_tokenize(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    backend *b = user;
    const Pdserve__V1__TokenizeRequest *r = (const void *)req;
    size_t n = strlen(r->text), k = 0;
    uint32_t *ids = malloc((n + 1) * sizeof *ids);
    if (!ids) {
        rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    if (r->add_special_tokens) ids[k++] = 1; /* BOS */
    for (size_t i = 0; i < n; i++) ids[k++] = (uint8_t)r->text[i];
    int64_t delay = call_delay_us(b, call);
    if (delay > 0) { /* answer from the worker thread, later */
        job *j = calloc(1, sizeof *j);
        if (!j) {
            free(ids);
            rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
            return;
        }
        j->kind = JOB_TOKENIZE;
        j->call = call;
        j->ids = ids;
        j->n_ids = k;
        j->due_us = now_us() + delay;
        backend_submit(b, j);
        return;
    }
    Pdserve__V1__TokenizeResponse resp = PDSERVE__V1__TOKENIZE_RESPONSE__INIT;
    resp.n_token_ids = k;
    resp.token_ids = ids;
    rpc_call_reply(call, &resp.base);
    free(ids);
}

static void on_model_info(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    static uint32_t eos[] = {0, 2};
    Pdserve__V1__GetModelInfoResponse r = PDSERVE__V1__GET_MODEL_INFO_RESPONSE__INIT;
    r.model_name = "pdserve-rpc-testserver";
    r.architecture = "EchoForTesting";
    r.max_model_len = 4096;
    r.vocab_size = 256;
    r.n_eos_token_ids = 2;
    r.eos_token_ids = eos;
    r.bos_token_id_set_case = PDSERVE__V1__GET_MODEL_INFO_RESPONSE__BOS_TOKEN_ID_SET_BOS_TOKEN_ID;
    r.bos_token_id = 1;
    rpc_call_reply(call, &r.base);
}

/* RpcTest.Echo (bidirectional): one response per request with its index in the call; the
 * count lives in the call's data; the half-close finishes with "echoed N". */
static void on_echo(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    uint64_t *seq = rpc_call_data(call);
    if (!seq) {
        if (!(seq = calloc(1, sizeof *seq))) {
            rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
            return;
        }
        rpc_call_set_data(call, seq, free);
        rpc_call_set_cancel_cb(call, on_cancel, user); /* counts cancel_callbacks */
    }
    if (!req) {
        rpc_stream_finish(call, RPC_STATUS_OK, "echoed %" PRIu64, *seq);
        return;
    }
    const Pdserve__Rpctest__V1__EchoRequest *r = (const void *)req;
    static uint8_t pad[65536];
    Pdserve__Rpctest__V1__EchoResponse resp = PDSERVE__RPCTEST__V1__ECHO_RESPONSE__INIT;
    resp.text = r->text;
    resp.seq = (*seq)++;
    resp.pad.len = r->pad_bytes < sizeof pad ? r->pad_bytes : sizeof pad;
    resp.pad.data = pad;
    if (rpc_stream_send(call, &resp.base) == PD_ENOSPC) /* cannot happen: one per request */
        rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED, "response queue full");
}

static void on_stats(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    backend *b = user;
    rpc_server_stats st;
    rpc_server_stats_get(b->srv, &st);
    Pdserve__Rpctest__V1__StatsResponse r = PDSERVE__RPCTEST__V1__STATS_RESPONSE__INIT;
    r.live_calls = rpc_server_live_calls(b->srv);
    r.live_calls_peak = st.live_calls_peak;
    r.calls_started = st.calls_started;
    r.calls_cancelled = st.calls_cancelled;
    r.cancel_callbacks = atomic_load(&b->cancel_callbacks);
    r.jobs_active = atomic_load(&b->jobs_active);
    r.streams_completed = atomic_load(&b->streams_completed);
    r.msgs_sent = st.msgs_sent;
    r.calls_unimplemented = st.calls_unimplemented;
    r.calls_bad_request = st.calls_bad_request;
    rpc_call_reply(call, &r.base);
}

/* ---- main ---- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pdserve-rpc-testserver [options]\n"
            "  --listen ADDR          host:port (default 127.0.0.1:0 = a free port)\n"
            "  --port-file PATH       also write the bound port there\n"
            "  --threads N            gRPC worker threads (default 2)\n"
            "  --delay-ms X           default delay between stream messages (default 0)\n"
            "  --max-recv-bytes N     largest request accepted (default 4194304)\n"
            "  --queue-max N          responses queued per call (default 64)\n"
            "  --grace-ms N           shutdown grace period (default 5000)\n"
            "  --health-drain-ms N    NOT_SERVING time before the listener closes (default 0)\n"
            "Per call (metadata): x-delay-ms overrides --delay-ms; x-barrier N holds a\n"
            "stream until N calls are held by the worker thread.\n");
}

int main(int argc, char **argv)
{
    rpc_server_params p = rpc_server_default_params();
    p.listen_addr = "127.0.0.1:0";
    const char *port_file = NULL;
    double delay_ms = 0;
    static const struct option opts[] = {
        {"listen", required_argument, 0, 'l'},     {"port-file", required_argument, 0, 'f'},
        {"threads", required_argument, 0, 't'},    {"delay-ms", required_argument, 0, 'd'},
        {"max-recv-bytes", required_argument, 0, 'm'},
        {"queue-max", required_argument, 0, 'q'},  {"grace-ms", required_argument, 0, 'g'},
        {"health-drain-ms", required_argument, 0, 'h'},
        {"help", no_argument, 0, 'H'},             {0, 0, 0, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 'l': p.listen_addr = optarg; break;
        case 'f': port_file = optarg; break;
        case 't': p.n_threads = atoi(optarg); break;
        case 'd': delay_ms = atof(optarg); break;
        case 'm': p.max_recv_msg_bytes = atoi(optarg); break;
        case 'q': p.stream_queue_max = atoi(optarg); break;
        case 'g': p.shutdown_grace_ms = atoi(optarg); break;
        case 'h': p.health_drain_ms = atoi(optarg); break;
        case 'H': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }

    /* Block the signals before any thread exists (gRPC's inherit the mask); main sigwaits. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);

    backend b;
    memset(&b, 0, sizeof b);
    pthread_mutex_init(&b.mu, NULL);
    pthread_cond_init(&b.cv, NULL);
    b.default_delay_us = (int64_t)(delay_ms * 1000.0);

    char err[PD_ERR_LEN];
    rpc_server *srv = NULL;
    int rc = rpc_server_create(&p, &srv, err);
    const ProtobufCServiceDescriptor *gen = &pdserve__v1__generation__descriptor;
    if (rc == 0) rc = rpc_server_register(srv, gen, "Generate", RPC_SERVER_STREAMING,
                                          on_generate, &b, err);
    if (rc == 0) rc = rpc_server_register(srv, gen, "Tokenize", RPC_UNARY, on_tokenize, &b, err);
    if (rc == 0)
        rc = rpc_server_register(srv, gen, "GetModelInfo", RPC_UNARY, on_model_info, &b, err);
    if (rc == 0)
        rc = rpc_server_register(srv, &pdserve__rpctest__v1__rpc_test__descriptor, "Stats",
                                 RPC_UNARY, on_stats, &b, err);
    if (rc == 0)
        rc = rpc_server_register(srv, &pdserve__rpctest__v1__rpc_test__descriptor, "Echo",
                                 RPC_BIDI_STREAMING, on_echo, &b, err);
    b.srv = srv;
    if (rc == 0 && pthread_create(&b.thread, NULL, worker_main, &b) != 0)
        rc = pd_errf(err, PD_ENOMEM, "cannot start the worker thread");
    bool worker_started = rc == 0;
    if (rc == 0) rc = rpc_server_start(srv, err);
    if (rc != 0) {
        fprintf(stderr, "pdserve-rpc-testserver: %s\n", err);
        if (worker_started) {
            pthread_mutex_lock(&b.mu);
            b.stop = true;
            pthread_cond_signal(&b.cv);
            pthread_mutex_unlock(&b.mu);
            pthread_join(b.thread, NULL);
        }
        rpc_server_destroy(srv);
        return 1;
    }
    int port = rpc_server_port(srv);
    if (port_file) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", port_file);
        FILE *f = fopen(tmp, "w");
        if (!f || fprintf(f, "%d\n", port) < 0 || fclose(f) != 0 || rename(tmp, port_file) != 0)
            PD_LOGE("cannot write the port file %s: %s", port_file, strerror(errno));
    }
    printf("PORT %d\n", port);
    fflush(stdout);

    int sig = 0;
    sigwait(&sigs, &sig);
    PD_LOGI("testserver: signal %d, shutting down", sig);
    int n_cancelled = rpc_server_shutdown(srv);

    pthread_mutex_lock(&b.mu);
    b.stop = true;
    pthread_cond_signal(&b.cv);
    pthread_mutex_unlock(&b.mu);
    pthread_join(b.thread, NULL);

    int64_t live = rpc_server_live_calls(srv);
    rpc_server_stats st;
    rpc_server_stats_get(srv, &st);
    fprintf(stderr,
            "testserver: exit: live_calls=%" PRId64 " calls_started=%" PRId64
            " calls_cancelled=%" PRId64 " cancelled_at_shutdown=%d jobs_active=%lld\n",
            live, st.calls_started, st.calls_cancelled, n_cancelled,
            (long long)atomic_load(&b.jobs_active));
    rpc_server_destroy(srv);
    pthread_mutex_destroy(&b.mu);
    pthread_cond_destroy(&b.cv);
    return live == 0 && atomic_load(&b.jobs_active) == 0 ? 0 : 3;
}
