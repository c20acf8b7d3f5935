/* bench_run.c -- pdserve-bench's load driver: sends Generate calls at the times of an arrival
 * process (or keeps a fixed number in flight), and timestamps every response on the channel's
 * completion thread as it arrives.
 *
 * Timing rules (docs/benchmarking.md): TTFT = first message carrying a token minus the send;
 * TPOT = (last token's message - first token's message) / (output tokens - 1); ITL = the gap
 * between two messages carrying tokens, split evenly over the later message's tokens (so that
 * a request's ITLs add up to its decode time); E2E = final status minus the send. */
#include "tools/bench.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/rpc/rpc.h"
#include "pdserve/v1/generation.pb-c.h"

#define GENERATE_PATH "/pdserve.v1.Generation/Generate"

typedef struct run_state run_state;

/* One request in flight: written by the completion thread until `done` (under rs->mu). */
typedef struct {
    bench_req q;
    rpc_client_call *call;      /* released when the run ends */
    run_state *rs;
    bool done;                  /* on_done ran (under rs->mu) */
} req_ctx;

struct run_state {
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* CLOCK_MONOTONIC; signalled at every on_done */
    int64_t t0_us;              /* run start, monotonic */
    int64_t n_done, n_err;      /* under mu */
    int64_t n_issued;           /* under mu */
    int64_t last_progress_us;   /* dispatcher only */
};

static int64_t mono_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

static void push_itl(bench_req *q, float v)
{
    if (q->n_itl == q->cap_itl) {
        int32_t nc = q->cap_itl ? q->cap_itl * 2 : 64;
        float *n = realloc(q->itl_ms, (size_t)nc * sizeof *n);
        if (!n) return; /* an ITL sample lost; TTFT/TPOT are unaffected */
        q->itl_ms = n;
        q->cap_itl = nc;
    }
    q->itl_ms[q->n_itl++] = v;
}

static void on_message(rpc_client_call *c, ProtobufCMessage *msg, void *user)
{
    req_ctx *x = user;
    bench_req *q = &x->q;
    int64_t t = mono_us() - x->rs->t0_us;
    const Pdserve__V1__GenerateResponse *r = (const void *)msg;
    int32_t n = (int32_t)r->n_token_ids;
    if (n > 0) {
        if (q->t_first_us < 0) {
            q->t_first_us = t;
        } else {
            float gap = (float)(t - q->t_last_us) / 1000.0f / (float)n;
            for (int32_t i = 0; i < n; i++) push_itl(q, gap);
        }
        q->t_last_us = t;
        q->n_out += n;
    }
    if (r->finish_reason != PDSERVE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED) {
        q->finish_reason = (int)r->finish_reason;
        if (r->usage) {
            if (r->usage->prompt_tokens > 0) q->n_in = (int32_t)r->usage->prompt_tokens;
            q->n_cached = (int32_t)r->usage->cached_prompt_tokens;
        }
    }
    protobuf_c_message_free_unpacked(msg, NULL);
}

static void on_done(rpc_client_call *c, const rpc_status *st, void *user)
{
    req_ctx *x = user;
    run_state *rs = x->rs;
    x->q.t_end_us = mono_us() - rs->t0_us;
    pthread_mutex_lock(&rs->mu);
    x->q.status = st->code;
    x->done = true;
    rs->n_done++;
    if (st->code != RPC_STATUS_OK) rs->n_err++;
    pthread_cond_broadcast(&rs->cv);
    pthread_mutex_unlock(&rs->mu);
}

/* Waits on rs->cv (rs->mu held) until the monotonic time until_us, at most 50 ms, so that
 * the caller can poll the stop flag and draw progress. */
static void timed_wait(run_state *rs, int64_t until_us)
{
    int64_t now = mono_us(), limit = now + 50000;
    if (until_us > limit) until_us = limit;
    if (until_us <= now) return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = ts.tv_nsec + (until_us - now) * 1000;
    ts.tv_sec += (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    pthread_cond_timedwait(&rs->cv, &rs->mu, &ts);
}

/* Draws the progress line at most 4 times a second (rs->mu held). */
static void progress(run_state *rs, const bench_run_params *p, int64_t planned, bool force)
{
    if (!p->progress) return;
    int64_t now = mono_us();
    if (!force && now - rs->last_progress_us < 250000) return;
    rs->last_progress_us = now;
    char total[32] = "";
    if (planned > 0) snprintf(total, sizeof total, "/%lld", (long long)planned);
    char what[48];
    if (p->arrival == BENCH_ARRIVAL_CLOSED)
        snprintf(what, sizeof what, "concurrency %lld", (long long)p->concurrency);
    else
        snprintf(what, sizeof what, "%.2f req/s", p->rate);
    fprintf(stderr, "\r\033[K%s%s%s | sent %lld%s | done %lld | errors %lld | in flight %lld | %.1f s",
            p->label ? p->label : "", p->label ? ": " : "", what, (long long)rs->n_issued, total,
            (long long)rs->n_done, (long long)rs->n_err, (long long)(rs->n_issued - rs->n_done),
            (double)(now - rs->t0_us) / 1e6);
    fflush(stderr);
}

/* Starts request number idx. Returns 0 or an error from the RPC layer. */
static int issue(rpc_channel *ch, bench_workload *w, const bench_run_params *p, run_state *rs,
                 req_ctx *x, int64_t idx, int64_t sched_us, char *err)
{
    bench_request_spec spec;
    bench_workload_next(w, &spec);
    Pdserve__V1__GenerateRequest q = PDSERVE__V1__GENERATE_REQUEST__INIT;
    Pdserve__V1__SamplingParams sp = PDSERVE__V1__SAMPLING_PARAMS__INIT;
    Pdserve__V1__StoppingCriteria st = PDSERVE__V1__STOPPING_CRITERIA__INIT;
    char id[96];
    snprintf(id, sizeof id, "bench-%s-%lld", p->label ? p->label : "run", (long long)idx);
    for (char *c = id; *c; c++)
        if (*c == ' ') *c = '-';
    q.request_id = id;
    if (spec.prompt) {
        q.prompt = (char *)spec.prompt;
    } else {
        q.n_prompt_token_ids = (size_t)spec.n_ids;
        q.prompt_token_ids = (uint32_t *)spec.ids;
    }
    sp.temperature_set_case = PDSERVE__V1__SAMPLING_PARAMS__TEMPERATURE_SET_TEMPERATURE;
    sp.temperature = 0.0f; /* greedy: the cheapest sampling; lengths are fixed anyway */
    st.max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
    st.max_tokens = (uint32_t)spec.output_len;
    st.ignore_eos = true;
    q.sampling = &sp;
    q.stopping = &st;

    x->rs = rs;
    x->q.index = idx;
    x->q.warmup = idx < p->warmup_requests;
    x->q.status = -1;
    x->q.n_in = spec.prompt ? 0 : spec.n_ids;
    x->q.n_out_expected = spec.output_len;
    x->q.t_first_us = x->q.t_last_us = -1;
    x->q.t_sched_us = sched_us;
    x->q.t_start_us = mono_us() - rs->t0_us;
    rpc_client_callbacks cb = {on_message, on_done, x};
    return rpc_client_call_start(ch, GENERATE_PATH, &q.base,
                                 &pdserve__v1__generate_response__descriptor, p->timeout_ms,
                                 &cb, &x->call, err);
}

void bench_run_free(bench_run *r)
{
    if (!r) return;
    for (int64_t i = 0; i < r->n_reqs; i++) free(r->reqs[i].itl_ms);
    free(r->reqs);
    memset(r, 0, sizeof *r);
}

int bench_run_once(rpc_channel **chans, int n_chans, bench_workload *w,
                   const bench_run_params *p, volatile sig_atomic_t *stop, bench_run *out,
                   char *err)
{
    memset(out, 0, sizeof *out);
    out->rate = p->arrival == BENCH_ARRIVAL_CLOSED ? 0 : p->rate;
    run_state rs = {0};
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&rs.cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&rs.mu, NULL);
    bench_rng rng;
    bench_rng_seed(&rng, p->seed);
    bench_workload_reset(w, p->workload_seed);

    req_ctx **xs = NULL;
    int64_t n = 0, cap = 0;
    int rc = 0;
    bool closed = p->arrival == BENCH_ARRIVAL_CLOSED;
    int64_t planned = p->num_requests > 0 ? p->warmup_requests + p->num_requests : 0;
    double next_s = 0;                /* open loop: the next arrival, seconds from t0 */
    int64_t measure_start_us = -1;    /* duration mode: the first measured arrival */
    rs.t0_us = mono_us();

    pthread_mutex_lock(&rs.mu);
    for (;;) {
        if (stop && *stop) break;
        if (planned > 0 && n >= planned) break;
        int64_t sched_us;
        if (closed) {
            if (n - rs.n_done >= p->concurrency) {
                timed_wait(&rs, INT64_MAX);
                progress(&rs, p, planned, false);
                continue;
            }
            sched_us = mono_us() - rs.t0_us;
        } else {
            sched_us = (int64_t)llround(next_s * 1e6);
            int64_t now = mono_us() - rs.t0_us;
            if (now < sched_us || n - rs.n_done >= p->max_inflight) {
                timed_wait(&rs, rs.t0_us + sched_us);
                progress(&rs, p, planned, false);
                continue;
            }
        }
        if (planned == 0 && n >= p->warmup_requests) { /* duration mode */
            if (measure_start_us < 0) measure_start_us = sched_us;
            if ((double)(sched_us - measure_start_us) >= p->duration_s * 1e6) break;
        }
        if (n == cap) {
            int64_t nc = cap ? cap * 2 : 256;
            req_ctx **nx = realloc(xs, (size_t)nc * sizeof *nx);
            if (!nx) {
                rc = pd_errf(err, PD_ENOMEM, "out of memory");
                break;
            }
            xs = nx;
            cap = nc;
        }
        req_ctx *x = calloc(1, sizeof *x);
        if (!x) {
            rc = pd_errf(err, PD_ENOMEM, "out of memory");
            break;
        }
        /* Unlocked while starting the call: on_done of other calls must not wait on us. */
        pthread_mutex_unlock(&rs.mu);
        rc = issue(chans[n % n_chans], w, p, &rs, x, n, sched_us, err);
        pthread_mutex_lock(&rs.mu);
        if (rc != 0) {
            free(x);
            rc = PD_EIO;
            break;
        }
        xs[n++] = x;
        rs.n_issued = n;
        if (!closed) next_s += bench_arrival_gap_s(p->arrival, p->rate, p->burstiness, &rng);
        progress(&rs, p, planned, false);
    }
    /* Every request sent: wait for the rest; a stop cancels what is still in flight. */
    bool cancelled = false;
    while (rs.n_done < n) {
        if (stop && *stop && !cancelled) {
            for (int64_t i = 0; i < n; i++) xs[i]->q.interrupted = !xs[i]->done;
            pthread_mutex_unlock(&rs.mu); /* on_done takes it */
            for (int64_t i = 0; i < n; i++)
                if (xs[i]->q.interrupted) rpc_client_call_cancel(xs[i]->call);
            pthread_mutex_lock(&rs.mu);
            cancelled = true;
        }
        timed_wait(&rs, INT64_MAX);
        progress(&rs, p, planned, false);
    }
    progress(&rs, p, planned, true);
    pthread_mutex_unlock(&rs.mu);
    if (p->progress) fprintf(stderr, "\r\033[K");
    out->interrupted = stop && *stop;

    out->reqs = n ? calloc((size_t)n, sizeof *out->reqs) : NULL;
    if (n && !out->reqs && rc == 0) rc = pd_errf(err, PD_ENOMEM, "out of memory");
    int64_t t_min = INT64_MAX, t_max = 0;
    for (int64_t i = 0; i < n; i++) {
        rpc_client_call_release(xs[i]->call);
        if (out->reqs) {
            out->reqs[i] = xs[i]->q;
            if (xs[i]->q.t_start_us < t_min) t_min = xs[i]->q.t_start_us;
            if (xs[i]->q.t_end_us > t_max) t_max = xs[i]->q.t_end_us;
        } else {
            free(xs[i]->q.itl_ms);
        }
        free(xs[i]);
    }
    free(xs);
    out->n_reqs = out->reqs ? n : 0;
    out->wall_s = n ? (double)(t_max - t_min) / 1e6 : 0;
    pthread_cond_destroy(&rs.cv);
    pthread_mutex_destroy(&rs.mu);
    return rc;
}
