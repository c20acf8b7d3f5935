/* bench_fake_server.c -- pdserve-bench-fakeserver: a pdserve.v1.Generation server with
 * scripted latencies, the ground truth for pdserve-bench's tests. A Generate call gets its
 * first token TTFT ms after it starts being served and one more token every TPOT ms, up to
 * stopping.max_tokens (--max-tokens when unset); the last message carries finish LENGTH and
 * usage. TTFT, TPOT and an optional failure are chosen by the prompt's length (token ids, or
 * bytes of a text prompt) through --script; other lengths get --ttft-ms / --tpot-ms.
 *
 * With --slots K at most K calls are served at once and the others wait in arrival order, so
 * that a call's TTFT includes its wait: a deterministic K-server queue whose capacity is
 * K / (TTFT + (n - 1) * TPOT) requests/s, which gives the goodput search a known answer.
 * Each call's schedule is fixed when it arrives (from the slots' theoretical free times), and
 * messages are sent at those absolute times, so delivery jitter never accumulates.
 * Prints "PORT <n>" once listening; SIGINT/SIGTERM stop it. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/flags.h"
#include "common/rpc/rpc.h"
#include "pdserve/v1/generation.pb-c.h"

#define PROG "pdserve-bench-fakeserver"
#define MAX_RULES 64
#define MAX_SLOTS 4096

/* One --script entry. */
typedef struct {
    int64_t prompt_len;         /* matches prompts of exactly this length */
    int64_t ttft_us, tpot_us;
    int code;                   /* 0 = succeed, else fail with this gRPC status */
    int64_t fail_after;         /* tokens sent before the failure */
} rule;

/* One call being served. */
typedef struct job {
    rpc_call *call;             /* referenced until the job is dropped */
    int64_t start_us;           /* when service starts (monotonic) */
    int64_t ttft_us, tpot_us;
    uint32_t n_out;             /* tokens to send (before a failure: fail_after) */
    uint32_t next;              /* next token index */
    uint32_t n_prompt;
    int code;                   /* final status */
    char request_id[96];
    struct job *next_job;
} job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* CLOCK_MONOTONIC */
    job *incoming;              /* under mu */
    bool stop;                  /* under mu */
    rule rules[MAX_RULES];
    int n_rules;
    int64_t ttft_us, tpot_us, max_tokens, vocab, max_len;
    int64_t *slot_free_us;      /* [n_slots] theoretical time each slot frees; under mu */
    int64_t n_slots;            /* 0 = unlimited */
    const char *model_name;
} fake;

static int64_t mono_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

static int code_parse(const char *s)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (end != s && !*end) return v > 0 && v <= 16 ? (int)v : -1;
    for (int c = 1; c <= 16; c++)
        if (!strcmp(s, rpc_status_name(c))) return c;
    return -1;
}

/* Parses "LEN:TTFT_MS:TPOT_MS[:STATUS[:AFTER_TOKENS]]" entries, comma-separated. */
static int script_parse(fake *f, const char *s)
{
    char *buf = strdup(s), *save = NULL;
    if (!buf) return -1;
    int rc = 0;
    for (char *e = strtok_r(buf, ",", &save); e && rc == 0; e = strtok_r(NULL, ",", &save)) {
        if (f->n_rules == MAX_RULES) {
            fprintf(stderr, PROG ": --script: more than %d entries\n", MAX_RULES);
            rc = -1;
            break;
        }
        char *fld[5] = {0}, *s2 = NULL;
        int n = 0;
        for (char *t = strtok_r(e, ":", &s2); t && n < 5; t = strtok_r(NULL, ":", &s2)) fld[n++] = t;
        rule *r = &f->rules[f->n_rules];
        memset(r, 0, sizeof *r);
        if (n < 3) {
            rc = -1;
        } else {
            r->prompt_len = atoll(fld[0]);
            r->ttft_us = (int64_t)(atof(fld[1]) * 1000);
            r->tpot_us = (int64_t)(atof(fld[2]) * 1000);
            if (n >= 4 && (r->code = code_parse(fld[3])) < 0) rc = -1;
            if (n >= 5) r->fail_after = atoll(fld[4]);
            if (r->prompt_len < 0 || r->ttft_us < 0 || r->tpot_us < 0 || r->fail_after < 0) rc = -1;
        }
        if (rc != 0)
            fprintf(stderr, PROG ": --script entry '%s': expected LEN:TTFT_MS:TPOT_MS[:STATUS[:AFTER]]\n", e);
        f->n_rules++;
    }
    free(buf);
    return rc;
}

/* ---- the worker thread: sends every job's messages at their times ---- */

/* Sends the job's next token. Returns rpc_stream_send's result. */
static int send_token(const fake *f, job *j)
{
    Pdserve__V1__GenerateResponse r = PDSERVE__V1__GENERATE_RESPONSE__INIT;
    Pdserve__V1__Usage usage = PDSERVE__V1__USAGE__INIT;
    uint32_t tok = (uint32_t)(3 + j->next % (uint64_t)(f->vocab > 3 ? f->vocab - 3 : 1));
    char text[16];
    snprintf(text, sizeof text, "t%u ", tok);
    r.request_id = j->request_id;
    r.n_token_ids = 1;
    r.token_ids = &tok;
    r.text = text;
    if (j->code == 0 && j->next + 1 == j->n_out) {
        r.finish_reason = PDSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        usage.prompt_tokens = j->n_prompt;
        usage.completion_tokens = j->n_out;
        r.usage = &usage;
    }
    return rpc_stream_send(j->call, &r.base);
}

static int64_t due_of(const job *j)
{
    return j->start_us + j->ttft_us + (int64_t)j->next * j->tpot_us;
}

/* Advances a job to now. Returns 1 when it is done (drop it), 0 otherwise. */
static int job_step(const fake *f, job *j, int64_t now)
{
    if (rpc_call_is_cancelled(j->call)) return 1;
    while (j->next < j->n_out && due_of(j) <= now) {
        int rc = send_token(f, j);
        if (rc == PD_ENOSPC) return 0; /* the client is slow: try again at the next wake */
        if (rc != 0) return 1;
        j->next++;
    }
    if (j->next < j->n_out) return 0;
    if (!j->code) { /* right after the last token */
        rpc_stream_finish(j->call, RPC_STATUS_OK, NULL);
        return 1;
    }
    if (due_of(j) > now) return 0; /* a failure comes one TPOT after the last token sent */
    rpc_stream_finish(j->call, (rpc_status_code)j->code, "scripted failure");
    return 1;
}

static void job_free(job *j)
{
    rpc_stream_finish(j->call, RPC_STATUS_INTERNAL, "dropped"); /* no-op once finished */
    rpc_call_unref(j->call);
    free(j);
}

static void *worker_main(void *arg)
{
    fake *f = arg;
    job *active = NULL;
    pthread_mutex_lock(&f->mu);
    for (;;) {
        while (f->incoming) {
            job *j = f->incoming;
            f->incoming = j->next_job;
            j->next_job = active;
            active = j;
        }
        if (f->stop && !active) break;
        pthread_mutex_unlock(&f->mu); /* never hold mu in rpc_*: a cancel callback may take it */
        int64_t now = mono_us(), next_due = INT64_MAX;
        for (job **pj = &active; *pj;) {
            job *j = *pj;
            if (job_step(f, j, now)) {
                *pj = j->next_job;
                job_free(j);
                continue;
            }
            int64_t d = due_of(j);
            if (d < next_due) next_due = d;
            pj = &j->next_job;
        }
        pthread_mutex_lock(&f->mu);
        if (f->incoming || (f->stop && !active)) continue;
        int64_t wait = next_due == INT64_MAX ? 100000 : next_due - mono_us();
        if (wait > 100000) wait = 100000; /* look at cancellations now and then */
        if (wait > 0) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            int64_t ns = ts.tv_nsec + wait * 1000;
            ts.tv_sec += (time_t)(ns / 1000000000);
            ts.tv_nsec = (long)(ns % 1000000000);
            pthread_cond_timedwait(&f->cv, &f->mu, &ts);
        }
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

/* ---- handlers (gRPC worker threads) ---- */

static void on_cancel(rpc_call *call, void *user)
{
    fake *f = user;
    pthread_mutex_lock(&f->mu);
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static void on_generate(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    fake *f = user;
    const Pdserve__V1__GenerateRequest *r = (const void *)req;
    bool has_text = r->prompt[0] != '\0', has_ids = r->n_prompt_token_ids > 0;
    if (has_text == has_ids) {
        rpc_stream_finish(call, RPC_STATUS_INVALID_ARGUMENT,
                          "exactly one of prompt and prompt_token_ids must be set");
        return;
    }
    job *j = calloc(1, sizeof *j);
    if (!j) {
        rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    int64_t n_prompt = has_ids ? (int64_t)r->n_prompt_token_ids : (int64_t)strlen(r->prompt);
    int64_t n_out = f->max_tokens;
    if (r->stopping && r->stopping->max_tokens_set_case ==
                           PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS)
        n_out = r->stopping->max_tokens;
    if (n_out < 1) n_out = 1;
    j->call = call;
    j->n_prompt = (uint32_t)n_prompt;
    j->ttft_us = f->ttft_us;
    j->tpot_us = f->tpot_us;
    j->n_out = (uint32_t)n_out;
    for (int i = 0; i < f->n_rules; i++)
        if (f->rules[i].prompt_len == n_prompt) {
            j->ttft_us = f->rules[i].ttft_us;
            j->tpot_us = f->rules[i].tpot_us;
            j->code = f->rules[i].code;
            if (j->code) j->n_out = (uint32_t)(f->rules[i].fail_after < n_out ? f->rules[i].fail_after : n_out);
            break;
        }
    snprintf(j->request_id, sizeof j->request_id, "%s", r->request_id);
    rpc_call_ref(call);
    rpc_call_set_cancel_cb(call, on_cancel, f);
    int64_t now = mono_us();
    pthread_mutex_lock(&f->mu);
    j->start_us = now;
    if (f->n_slots > 0) { /* the slot that frees first serves it, from then on */
        int64_t best = 0;
        for (int64_t s = 1; s < f->n_slots; s++)
            if (f->slot_free_us[s] < f->slot_free_us[best]) best = s;
        if (f->slot_free_us[best] > now) j->start_us = f->slot_free_us[best];
        int64_t busy = j->ttft_us + (int64_t)(j->n_out > 0 ? j->n_out - 1 : 0) * j->tpot_us;
        if (j->code) busy = j->ttft_us + (int64_t)j->n_out * j->tpot_us;
        f->slot_free_us[best] = j->start_us + busy;
    }
    j->next_job = f->incoming;
    f->incoming = j;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static void on_model_info(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    fake *f = user;
    static uint32_t eos[] = {2};
    Pdserve__V1__GetModelInfoResponse r = PDSERVE__V1__GET_MODEL_INFO_RESPONSE__INIT;
    r.model_name = (char *)f->model_name;
    r.architecture = "ScriptedLatencyForTesting";
    r.max_model_len = (uint32_t)f->max_len;
    r.vocab_size = (uint32_t)f->vocab;
    r.n_eos_token_ids = 1;
    r.eos_token_ids = eos;
    rpc_call_reply(call, &r.base);
}

int main(int argc, char **argv)
{
    const char *listen = "127.0.0.1:0", *script = "", *model = "fake-scripted";
    double ttft_ms = 20, tpot_ms = 5;
    int64_t slots = 0, max_tokens = 16, vocab = 32000, max_len = 4096, threads = 2;
    pd_flag flags[] = {
        {"listen", PD_FLAG_STRING, &listen, "host:port (port 0 = a free one, printed as PORT n)", 1, 0},
        {"ttft-ms", PD_FLAG_DOUBLE, &ttft_ms, "time to the first token when no --script entry matches", 0, 1e7},
        {"tpot-ms", PD_FLAG_DOUBLE, &tpot_ms, "time between tokens when no --script entry matches", 0, 1e7},
        {"script", PD_FLAG_LIST, &script, "LEN:TTFT_MS:TPOT_MS[:STATUS[:AFTER]] per prompt length; STATUS (name or number) fails the call after AFTER tokens (default 0)", 1, 0},
        {"slots", PD_FLAG_INT, &slots, "calls served at once, the rest queue (0 = unlimited)", 0, MAX_SLOTS},
        {"max-tokens", PD_FLAG_INT, &max_tokens, "tokens when the request sets no max_tokens", 1, 1e6},
        {"vocab-size", PD_FLAG_INT, &vocab, "GetModelInfo's vocab_size", 4, 1e7},
        {"max-model-len", PD_FLAG_INT, &max_len, "GetModelInfo's max_model_len", 1, 1e8},
        {"model-name", PD_FLAG_STRING, &model, "GetModelInfo's model_name", 1, 0},
        {"threads", PD_FLAG_INT, &threads, "gRPC worker threads", 1, 64},
    };
    int prc = pd_flags_parse(flags, (int)(sizeof flags / sizeof flags[0]), argc, argv, PROG,
                             "A Generation server with scripted latencies, for testing pdserve-bench.");
    if (prc != 0) {
        pd_flags_free();
        return prc > 0 ? 0 : 2;
    }
    static fake f;
    f.ttft_us = (int64_t)(ttft_ms * 1000);
    f.tpot_us = (int64_t)(tpot_ms * 1000);
    f.max_tokens = max_tokens;
    f.vocab = vocab;
    f.max_len = max_len;
    f.n_slots = slots;
    f.model_name = model;
    int bad_script = script[0] ? script_parse(&f, script) : 0;
    pd_flags_free();
    if (bad_script) return 2;
    if (slots > 0 && !(f.slot_free_us = calloc((size_t)slots, sizeof *f.slot_free_us))) return 1;

    /* Block the signals before any thread exists (gRPC's inherit the mask); main sigwaits. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    pthread_mutex_init(&f.mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&f.cv, &ca);
    pthread_condattr_destroy(&ca);

    char err[PD_ERR_LEN];
    rpc_server_params p = rpc_server_default_params();
    p.listen_addr = listen;
    p.n_threads = (int)threads;
    p.shutdown_grace_ms = 200;
    rpc_server *srv = NULL;
    pthread_t worker;
    bool worker_started = false;
    const ProtobufCServiceDescriptor *gen = &pdserve__v1__generation__descriptor;
    int rc = rpc_server_create(&p, &srv, err);
    if (rc == 0) rc = rpc_server_register(srv, gen, "Generate", RPC_SERVER_STREAMING, on_generate, &f, err);
    if (rc == 0) rc = rpc_server_register(srv, gen, "GetModelInfo", RPC_UNARY, on_model_info, &f, err);
    if (rc == 0) {
        if (pthread_create(&worker, NULL, worker_main, &f) == 0) worker_started = true;
        else rc = pd_errf(err, PD_ENOMEM, "cannot start the worker thread");
    }
    if (rc == 0) rc = rpc_server_start(srv, err);
    if (rc == 0) {
        printf("PORT %d\n", rpc_server_port(srv));
        fflush(stdout);
        int sig = 0;
        sigwait(&sigs, &sig);
        rpc_server_shutdown(srv); /* the worker drops the calls it cancels */
    } else {
        fprintf(stderr, PROG ": %s\n", err);
    }
    if (worker_started) {
        pthread_mutex_lock(&f.mu);
        f.stop = true;
        pthread_cond_signal(&f.cv);
        pthread_mutex_unlock(&f.mu);
        pthread_join(worker, NULL);
    }
    rpc_server_destroy(srv);
    pthread_cond_destroy(&f.cv);
    pthread_mutex_destroy(&f.mu);
    free(f.slot_free_us);
    return rc == 0 ? 0 : 1;
}
