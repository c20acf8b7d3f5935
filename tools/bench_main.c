/* bench_main.c -- pdserve-bench: an SLO-driven load generator for the public Generation API.
 * Sends Generate calls at an open-loop rate (Poisson, gamma, constant) or with a fixed
 * concurrency, measures TTFT / TPOT / ITL / E2E per request, reports throughput, percentiles
 * and SLO attainment, and with --find-goodput searches the highest rate at which the target
 * share of requests meets both SLOs (bracketing, then bisection). Writes a table on stdout
 * and optionally JSON, CSV and SVG plots. Guide: docs/benchmarking.md.
 * Exit: 0 done, 1 runtime failure (server unreachable, write error), 2 bad options,
 * 130 interrupted (Ctrl-C; the partial report is still written). */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/flags.h"
#include "common/rpc/rpc.h"
#include "pdserve/v1/generation.pb-c.h"
#include "tools/bench.h"

#define PROG "pdserve-bench"
#define MAX_PROBES 64

static volatile sig_atomic_t g_stop;

static void on_signal(int sig)
{
    if (g_stop) _exit(130); /* a second Ctrl-C: no report */
    g_stop = 1;
}

/* All options, after parsing. */
typedef struct {
    const char *addr, *arrival, *workload, *input_len, *output_len, *dataset;
    const char *json, *csv, *plot_dir;
    double rate, burstiness, duration_s, max_rate, min_rate, tolerance;
    int64_t concurrency, num_requests, warmup, max_inflight, timeout_ms, channels;
    int64_t connect_timeout_ms, prefix_groups, prefix_len, seed, token_lo, max_probes;
    bench_slo slo;
    bool find_goodput, quiet;
} options;

/* Parses "A" or "A:B" (1 <= A <= B). Returns 0 or -1. */
static int parse_range(const char *s, int32_t *lo, int32_t *hi)
{
    char *end;
    long a = strtol(s, &end, 10), b = a;
    if (end == s) return -1;
    if (*end == ':') {
        const char *t = end + 1;
        b = strtol(t, &end, 10);
        if (end == t) return -1;
    }
    if (*end || a < 1 || b < a || b > 10000000) return -1;
    *lo = (int32_t)a;
    *hi = (int32_t)b;
    return 0;
}

static int bad(const char *fmt, const char *flag, double v)
{
    fprintf(stderr, PROG ": ");
    fprintf(stderr, fmt, flag, v);
    fprintf(stderr, " (try --help)\n");
    return -1;
}

/* Checks what the flag table cannot. Returns 0, or -1 after printing why. */
static int validate(const options *o, bench_arrival arrival)
{
    if (arrival != BENCH_ARRIVAL_CLOSED && !(o->rate > 0))
        return bad("%s must be > 0 requests per second, got %g", "--rate", o->rate);
    if (!(o->burstiness > 0))
        return bad("%s must be > 0 (1 = Poisson, < 1 burstier), got %g", "--burstiness", o->burstiness);
    if (!(o->slo.attainment > 0 && o->slo.attainment <= 1))
        return bad("%s must be in (0, 1] (the share of requests that must meet the SLO, "
                   "e.g. 0.9), got %g", "--slo-attainment", o->slo.attainment);
    if (o->slo.ttft_ms < 0) return bad("%s must be >= 0 (0 = no TTFT SLO), got %g", "--slo-ttft-ms", o->slo.ttft_ms);
    if (o->slo.tpot_ms < 0) return bad("%s must be >= 0 (0 = no TPOT SLO), got %g", "--slo-tpot-ms", o->slo.tpot_ms);
    if (o->duration_s < 0) return bad("%s must be >= 0 (0 = use --num-requests), got %g", "--duration-s", o->duration_s);
    if (o->num_requests < 1 && o->duration_s <= 0)
        return bad("%s must be >= 1 unless --duration-s is set, got %g", "--num-requests",
                   (double)o->num_requests);
    if (o->find_goodput) {
        if (arrival == BENCH_ARRIVAL_CLOSED) {
            fprintf(stderr, PROG ": --find-goodput searches an open-loop rate: use --arrival "
                            "poisson, gamma or constant\n");
            return -1;
        }
        if (o->slo.ttft_ms <= 0 && o->slo.tpot_ms <= 0) {
            fprintf(stderr, PROG ": --find-goodput needs an SLO: --slo-ttft-ms and/or --slo-tpot-ms\n");
            return -1;
        }
        if (!(o->min_rate > 0) || !(o->max_rate >= o->min_rate)) {
            fprintf(stderr, PROG ": need 0 < --min-rate <= --max-rate (got %g and %g)\n",
                    o->min_rate, o->max_rate);
            return -1;
        }
        if (!(o->tolerance > 0 && o->tolerance < 1))
            return bad("%s must be in (0, 1) (relative width of the final bracket), got %g",
                       "--goodput-tolerance", o->tolerance);
    }
    return 0;
}

/* Asks the server for its model. Returns 0, or 1 after printing why. */
static int model_info(rpc_channel *ch, const options *o, char *name, size_t len, uint32_t *vocab,
                      uint32_t *max_len)
{
    Pdserve__V1__GetModelInfoRequest q = PDSERVE__V1__GET_MODEL_INFO_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st;
    int rc = rpc_unary_call(ch, "/pdserve.v1.Generation/GetModelInfo", &q.base,
                            &pdserve__v1__get_model_info_response__descriptor,
                            o->connect_timeout_ms, &resp, &st);
    if (rc != 0) {
        fprintf(stderr, PROG ": cannot reach a pdserve server at %s: GetModelInfo failed with "
                        "%s: %s\n", o->addr, rpc_status_name(st.code), st.details);
        return 1;
    }
    const Pdserve__V1__GetModelInfoResponse *m = (const void *)resp;
    snprintf(name, len, "%s", m->model_name);
    *vocab = m->vocab_size;
    *max_len = m->max_model_len;
    protobuf_c_message_free_unpacked(resp, NULL);
    return 0;
}

typedef struct {
    const options *o;
    bench_arrival arrival;
    rpc_channel **chans;
    int n_chans;
    bench_workload *w;
    bench_probe probes[MAX_PROBES];
    int n_probes;
} search;

/* Runs one probe at rate and summarises it. Returns 0 (see probes[n_probes - 1]), 1 when
 * interrupted, or a negative error after printing it. */
static int probe(search *s, double rate)
{
    const options *o = s->o;
    if (s->n_probes >= MAX_PROBES) return PD_ENOSPC;
    char label[32], err[PD_ERR_LEN];
    snprintf(label, sizeof label, "probe %d", s->n_probes + 1);
    bench_run_params rp = {
        .arrival = s->arrival,
        .rate = rate,
        .burstiness = o->burstiness,
        .concurrency = o->concurrency,
        .num_requests = o->duration_s > 0 ? 0 : o->num_requests,
        .duration_s = o->duration_s,
        .warmup_requests = o->warmup,
        .max_inflight = o->max_inflight,
        .timeout_ms = o->timeout_ms,
        .seed = (uint64_t)o->seed * 0x9e3779b97f4a7c15ull + 1,
        .workload_seed = (uint64_t)o->seed + (uint64_t)s->n_probes,
        .progress = !o->quiet && isatty(STDERR_FILENO),
        .label = o->find_goodput ? label : NULL,
    };
    bench_probe *p = &s->probes[s->n_probes];
    memset(p, 0, sizeof *p);
    int rc = bench_run_once(s->chans, s->n_chans, s->w, &rp, &g_stop, &p->run, err);
    if (rc != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        bench_run_free(&p->run);
        return rc;
    }
    s->n_probes++;
    if (bench_summarize(&p->run, &o->slo, &p->sum, &p->ttft_sorted, &p->n_ttft, &p->tpot_sorted,
                        &p->n_tpot) != 0) {
        fprintf(stderr, PROG ": out of memory\n");
        return PD_ENOMEM;
    }
    if (o->find_goodput) bench_print_probe(stdout, s->n_probes - 1, &p->sum, &o->slo);
    return p->run.interrupted ? 1 : 0;
}

/* The goodput search: brackets the highest passing rate by doubling or halving from --rate,
 * then bisects until the bracket is narrower than --goodput-tolerance (relative) or
 * --max-probes probes ran. Fills info's goodput fields. Returns 0, 1 (interrupted) or < 0. */
static int find_goodput(search *s, bench_report_info *info)
{
    const options *o = s->o;
    double lo = -1, hi = -1, r = fmin(fmax(o->rate, o->min_rate), o->max_rate);
    int rc = 0;
    int64_t budget = o->max_probes < MAX_PROBES ? o->max_probes : MAX_PROBES;
#define PROBE(rate_)                                                                       \
    do {                                                                                   \
        if (s->n_probes >= budget) goto done;                                              \
        rc = probe(s, (rate_));                                                            \
        if (rc != 0) goto done;                                                            \
    } while (0)
#define LAST_PASSED() (s->probes[s->n_probes - 1].sum.pass)
    PROBE(r);
    if (LAST_PASSED()) {
        lo = r;
        while (hi < 0 && r < o->max_rate) {
            r = fmin(r * 2, o->max_rate);
            PROBE(r);
            if (LAST_PASSED()) lo = r;
            else hi = r;
        }
    } else {
        hi = r;
        while (lo < 0 && r / 2 >= o->min_rate) {
            r /= 2;
            PROBE(r);
            if (LAST_PASSED()) lo = r;
            else hi = r;
        }
    }
    while (lo > 0 && hi > 0 && hi - lo > o->tolerance * hi) {
        double mid = (lo + hi) / 2;
        PROBE(mid);
        if (LAST_PASSED()) lo = mid;
        else hi = mid;
    }
#undef PROBE
#undef LAST_PASSED
done:
    info->goodput_found = lo > 0;
    info->goodput_rps = lo;
    info->goodput_bracketed = lo > 0 && hi > 0;
    info->goodput_fail_rps = hi;
    info->best = -1;
    for (int i = 0; i < s->n_probes; i++) /* the probe at the goodput, else the last one */
        if (!s->probes[i].run.interrupted && s->probes[i].sum.rate == lo) info->best = i;
    if (info->best < 0 && s->n_probes > 0) info->best = s->n_probes - 1;
    if (rc == 0 && s->n_probes >= budget && lo > 0 && hi > 0 && hi - lo > o->tolerance * hi)
        fprintf(stderr, PROG ": --max-probes reached before the bracket [%.3f, %.3f] req/s "
                        "closed to --goodput-tolerance\n", lo, hi);
    return rc;
}

int main(int argc, char **argv)
{
    options o = {
        .addr = "127.0.0.1:50051", .arrival = "poisson", .workload = "", .input_len = "128",
        .output_len = "64", .dataset = "", .json = "", .csv = "", .plot_dir = "",
        .rate = 1.0, .burstiness = 1.0, .max_rate = 1000, .min_rate = 0.01, .tolerance = 0.05,
        .concurrency = 8, .num_requests = 100, .max_inflight = 1024, .timeout_ms = 120000,
        .channels = 1, .connect_timeout_ms = 5000, .prefix_groups = 4, .prefix_len = 64,
        .token_lo = 3, .max_probes = 16, .slo = {0, 0, 0.9},
    };
    pd_flag flags[] = {
        {"addr", PD_FLAG_STRING, &o.addr, "server (router) address host:port", 1, 0},
        {"arrival", PD_FLAG_STRING, &o.arrival, "poisson | gamma | constant (open loop at --rate) | closed (--concurrency in flight)", 1, 0},
        {"rate", PD_FLAG_DOUBLE, &o.rate, "requests/s of an open-loop run; the first probe of --find-goodput", 1, 0},
        {"burstiness", PD_FLAG_DOUBLE, &o.burstiness, "gamma arrivals: shape factor (1 = Poisson, < 1 burstier)", 1, 0},
        {"concurrency", PD_FLAG_INT, &o.concurrency, "closed loop: requests kept in flight", 1, 1 << 20},
        {"num-requests", PD_FLAG_INT, &o.num_requests, "measured requests per run (or probe)", 0, 1e9},
        {"duration-s", PD_FLAG_DOUBLE, &o.duration_s, "> 0: send measured requests for this long instead of --num-requests", 1, 0},
        {"warmup-requests", PD_FLAG_INT, &o.warmup, "requests sent first at the same rate and left out of every statistic", 0, 1e9},
        {"workload", PD_FLAG_STRING, &o.workload, "random | dataset | shared-prefix (default: dataset when --dataset is set, else random)", 1, 0},
        {"input-len", PD_FLAG_STRING, &o.input_len, "prompt tokens, N or MIN:MAX (uniform); shared-prefix: tokens after the prefix", 1, 0},
        {"output-len", PD_FLAG_STRING, &o.output_len, "output tokens, N or MIN:MAX (uniform; sent as max_tokens with ignore_eos)", 1, 0},
        {"dataset", PD_FLAG_STRING, &o.dataset, "JSONL file, one {\"prompt\": TEXT, \"output_len\": N} per line", 1, 0},
        {"prefix-groups", PD_FLAG_INT, &o.prefix_groups, "shared-prefix: number of distinct prefixes", 1, 1e6},
        {"prefix-len", PD_FLAG_INT, &o.prefix_len, "shared-prefix: tokens of each prefix", 1, 1e7},
        {"token-lo", PD_FLAG_INT, &o.token_lo, "random prompt ids are drawn from [token-lo, vocab_size - 1]", 0, 1e9},
        {"seed", PD_FLAG_INT, &o.seed, "seed of prompts, lengths and arrivals (probe i draws its prompts from seed + i)", 0, 9e18},
        {"slo-ttft-ms", PD_FLAG_DOUBLE, &o.slo.ttft_ms, "TTFT SLO in ms (0 = none)", 1, 0},
        {"slo-tpot-ms", PD_FLAG_DOUBLE, &o.slo.tpot_ms, "TPOT SLO in ms (0 = none)", 1, 0},
        {"slo-attainment", PD_FLAG_DOUBLE, &o.slo.attainment, "share of requests that must meet both SLOs, in (0, 1]", 1, 0},
        {"find-goodput", PD_FLAG_BOOL, &o.find_goodput, "search the highest rate meeting the SLO (probes printed as they finish)", 1, 0},
        {"min-rate", PD_FLAG_DOUBLE, &o.min_rate, "goodput search: lowest rate probed", 1, 0},
        {"max-rate", PD_FLAG_DOUBLE, &o.max_rate, "goodput search: highest rate probed", 1, 0},
        {"goodput-tolerance", PD_FLAG_DOUBLE, &o.tolerance, "goodput search: stop when (fail - pass) / fail is below this", 1, 0},
        {"max-probes", PD_FLAG_INT, &o.max_probes, "goodput search: probes at most", 1, MAX_PROBES},
        {"max-inflight", PD_FLAG_INT, &o.max_inflight, "open loop: arrivals wait while this many requests are in flight", 1, 1 << 20},
        {"timeout-ms", PD_FLAG_INT, &o.timeout_ms, "deadline of each request (DEADLINE_EXCEEDED counts as an error)", 1, 86400000},
        {"connect-timeout-ms", PD_FLAG_INT, &o.connect_timeout_ms, "deadline of the first GetModelInfo call", 1, 600000},
        {"channels", PD_FLAG_INT, &o.channels, "gRPC channels used round robin (each with its own completion thread)", 1, 64},
        {"json", PD_FLAG_STRING, &o.json, "write the summary of every run as JSON to this file", 1, 0},
        {"csv", PD_FLAG_STRING, &o.csv, "write one row per request to this CSV file", 1, 0},
        {"plot-dir", PD_FLAG_STRING, &o.plot_dir, "write SVG plots here: slo_attainment_vs_rate, ttft_cdf, tpot_cdf", 1, 0},
        {"quiet", PD_FLAG_BOOL, &o.quiet, "no progress line (it is drawn only when stderr is a terminal)", 1, 0},
    };
    rpc_client_tls tls = {0}; /* --tls-ca, --tls-cert, --tls-key, --tls-server-name */
    pd_flag all[sizeof flags / sizeof flags[0] + 4];
    int n_all = 0;
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) all[n_all++] = flags[i];
    rpc_client_tls_flags_add(&tls, all, &n_all, false);
    int prc = pd_flags_parse(all, n_all, argc, argv, PROG,
                             "SLO-driven load generator and goodput finder for a pdserve router "
                             "(public Generation API). See docs/benchmarking.md.");
    if (prc != 0) return prc > 0 ? 0 : 2;

    bench_arrival arrival;
    if (bench_arrival_parse(o.arrival, &arrival) != 0) {
        fprintf(stderr, PROG ": --arrival must be poisson, gamma, constant or closed, got '%s'\n", o.arrival);
        return 2;
    }
    if (validate(&o, arrival) != 0) return 2;
    bench_workload_params wp = {.seed = (uint64_t)o.seed, .prefix_groups = (int32_t)o.prefix_groups,
                                .prefix_len = (int32_t)o.prefix_len};
    const char *wl = o.workload[0] ? o.workload : o.dataset[0] ? "dataset" : "random";
    if (!strcmp(wl, "random")) wp.kind = BENCH_WL_RANDOM;
    else if (!strcmp(wl, "dataset")) wp.kind = BENCH_WL_DATASET;
    else if (!strcmp(wl, "shared-prefix")) wp.kind = BENCH_WL_SHARED_PREFIX;
    else {
        fprintf(stderr, PROG ": --workload must be random, dataset or shared-prefix, got '%s'\n", wl);
        return 2;
    }
    if (wp.kind == BENCH_WL_DATASET && !o.dataset[0]) {
        fprintf(stderr, PROG ": --workload dataset needs --dataset FILE\n");
        return 2;
    }
    if (wp.kind != BENCH_WL_DATASET && o.dataset[0]) {
        fprintf(stderr, PROG ": --dataset is only used by --workload dataset\n");
        return 2;
    }
    if (parse_range(o.input_len, &wp.input_min, &wp.input_max) != 0 ||
        parse_range(o.output_len, &wp.output_min, &wp.output_max) != 0) {
        fprintf(stderr, PROG ": --input-len and --output-len take N or MIN:MAX with 1 <= MIN <= "
                        "MAX (got '%s' and '%s')\n", o.input_len, o.output_len);
        return 2;
    }
    char err[PD_ERR_LEN];
    bench_dataset ds = {0};
    if (wp.kind == BENCH_WL_DATASET) {
        if (bench_dataset_load(o.dataset, &ds, err) != 0) {
            fprintf(stderr, PROG ": %s\n", err);
            return 2;
        }
        wp.dataset = &ds;
    }

    int status = 1;
    search s = {.o = &o, .arrival = arrival, .n_chans = (int)o.channels};
    char model[128] = "";
    uint32_t vocab = 0, max_len = 0;
    s.chans = calloc((size_t)o.channels, sizeof *s.chans);
    if (!s.chans) goto out;
    for (int i = 0; i < s.n_chans; i++) {
        rpc_channel_params cp = rpc_channel_default_params();
        cp.target = o.addr;
        cp.tls = tls;
        if (rpc_channel_create(&cp, &s.chans[i], err) != 0) {
            fprintf(stderr, PROG ": --addr %s: %s\n", o.addr, err);
            status = 2;
            goto out;
        }
    }
    if (model_info(s.chans[0], &o, model, sizeof model, &vocab, &max_len) != 0) goto out;
    if (wp.kind != BENCH_WL_DATASET) {
        int64_t prompt = wp.input_max + (wp.kind == BENCH_WL_SHARED_PREFIX ? wp.prefix_len : 0);
        if (vocab <= (uint32_t)o.token_lo + 1 || o.token_lo < 0) {
            fprintf(stderr, PROG ": --token-lo %lld leaves no ids below the vocabulary size %u\n",
                    (long long)o.token_lo, vocab);
            status = 2;
            goto out;
        }
        if (max_len > 0 && prompt + wp.output_max > (int64_t)max_len) {
            fprintf(stderr, PROG ": prompts of up to %lld tokens plus up to %d output tokens exceed "
                            "the model's maximum length %u: lower --input-len / --output-len%s\n",
                    (long long)prompt, wp.output_max, max_len,
                    wp.kind == BENCH_WL_SHARED_PREFIX ? " / --prefix-len" : "");
            status = 2;
            goto out;
        }
        wp.token_lo = (uint32_t)o.token_lo;
        wp.token_hi = vocab - 1;
    }
    if (bench_workload_create(&wp, &s.w, err) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        status = 2;
        goto out;
    }

    char wdesc[256], adesc[256], count[96];
    if (wp.kind == BENCH_WL_DATASET)
        snprintf(wdesc, sizeof wdesc, "dataset %s (%lld prompts, text; output lengths from the "
                 "file, ignore_eos)", o.dataset, (long long)ds.n);
    else if (wp.kind == BENCH_WL_RANDOM)
        snprintf(wdesc, sizeof wdesc, "random token ids in [%u, %u]: input %s tokens, output %s "
                 "tokens (ignore_eos), greedy", wp.token_lo, wp.token_hi, o.input_len, o.output_len);
    else
        snprintf(wdesc, sizeof wdesc, "shared prefix: %d groups of a %d-token prefix + %s random "
                 "tokens, output %s tokens (ignore_eos), greedy", wp.prefix_groups, wp.prefix_len,
                 o.input_len, o.output_len);
    if (o.duration_s > 0) snprintf(count, sizeof count, "arrivals for %g s", o.duration_s);
    else snprintf(count, sizeof count, "%lld requests", (long long)o.num_requests);
    char shape[64] = "";
    if (arrival == BENCH_ARRIVAL_GAMMA) snprintf(shape, sizeof shape, " (burstiness %g)", o.burstiness);
    if (arrival == BENCH_ARRIVAL_CLOSED)
        snprintf(adesc, sizeof adesc, "closed loop, concurrency %lld; %s + %lld warm-up",
                 (long long)o.concurrency, count, (long long)o.warmup);
    else
        snprintf(adesc, sizeof adesc, "%s%s; %s + %lld warm-up per run", bench_arrival_name(arrival),
                 shape, count, (long long)o.warmup);
    bench_report_info info = {
        .target = o.addr, .model_name = model, .vocab_size = vocab, .max_model_len = max_len,
        .workload_desc = wdesc, .arrival_desc = adesc, .slo = o.slo,
        .find_goodput = o.find_goodput, .best = 0,
    };
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    int rc;
    if (o.find_goodput) {
        printf("pdserve-bench: searching the goodput at %s (%s; SLO attainment target %.1f%%)\n",
               o.addr, model, 100 * o.slo.attainment);
        fflush(stdout);
        rc = find_goodput(&s, &info);
    } else {
        rc = probe(&s, o.rate);
    }
    if (rc < 0 || s.n_probes == 0) goto out;
    info.interrupted = g_stop != 0;
    if (info.best >= 0) bench_print_table(stdout, &info, &s.probes[info.best].sum);
    status = info.interrupted ? 130 : 0;
    if (o.json[0] && bench_write_json(o.json, &info, s.probes, s.n_probes, err) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        status = 1;
    }
    if (o.csv[0] && bench_write_csv(o.csv, s.probes, s.n_probes, &o.slo, err) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        status = 1;
    }
    if (o.plot_dir[0] && bench_write_plots(o.plot_dir, &info, s.probes, s.n_probes, err) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        status = 1;
    }
out:
    for (int i = 0; i < s.n_probes; i++) {
        bench_run_free(&s.probes[i].run);
        free(s.probes[i].ttft_sorted);
        free(s.probes[i].tpot_sorted);
    }
    bench_workload_destroy(s.w);
    for (int i = 0; s.chans && i < s.n_chans; i++) rpc_channel_destroy(s.chans[i]);
    free(s.chans);
    bench_dataset_free(&ds);
    pd_flags_free();
    return status;
}
