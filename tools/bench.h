/* bench.h -- Internal interfaces of pdserve-bench, the SLO-driven load generator of the public
 * API: workloads and arrival processes (bench_workload.c), the load driver over the gRPC
 * callback client (bench_run.c), statistics and SLO attainment (bench_stats.c), reports as a
 * table, JSON and CSV (bench_report.c) and SVG plots (bench_plot.c). bench_main.c holds the
 * flags and the goodput search. Not a library: one program's modules. */
#ifndef PD_TOOLS_BENCH_H
#define PD_TOOLS_BENCH_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/* ---- random numbers (xoshiro256**; reproducible from a seed) ---- */

typedef struct {
    uint64_t s[4];
} bench_rng;

void bench_rng_seed(bench_rng *r, uint64_t seed);
uint64_t bench_rng_next(bench_rng *r);
double bench_rng_uniform(bench_rng *r);                  /* in [0, 1) */
int64_t bench_rng_range(bench_rng *r, int64_t lo, int64_t hi); /* uniform in [lo, hi] */

/* ---- arrivals ---- */

typedef enum {
    BENCH_ARRIVAL_POISSON = 0,  /* open loop, exponential gaps with mean 1/rate */
    BENCH_ARRIVAL_GAMMA,        /* open loop, gamma gaps: shape = burstiness, mean 1/rate */
    BENCH_ARRIVAL_CONSTANT,     /* open loop, a request every 1/rate seconds exactly */
    BENCH_ARRIVAL_CLOSED,       /* closed loop: `concurrency` requests always in flight */
} bench_arrival;

const char *bench_arrival_name(bench_arrival a);
/* Parses "poisson|gamma|constant|closed". Returns 0 or PD_EINVAL. */
int bench_arrival_parse(const char *s, bench_arrival *out);
/* Seconds to the next arrival of an open-loop process at rate (requests/s, > 0); burstiness
 * (> 0) is the gamma shape (1 = Poisson, < 1 burstier, > 1 smoother). */
double bench_arrival_gap_s(bench_arrival a, double rate, double burstiness, bench_rng *r);

/* ---- workloads ---- */

typedef enum {
    BENCH_WL_RANDOM = 0,        /* random token ids, lengths uniform in [min, max] */
    BENCH_WL_DATASET,           /* JSONL prompts with expected output lengths */
    BENCH_WL_SHARED_PREFIX,     /* random ids behind one of N common prefixes */
} bench_wl_kind;

typedef struct {
    char *prompt;               /* text, NUL-terminated (owned by the dataset) */
    int32_t output_len;         /* expected output tokens, >= 1 */
} bench_dataset_entry;

typedef struct {
    bench_dataset_entry *e;     /* [n] */
    int64_t n;
} bench_dataset;

/* Reads a JSONL dataset: one object per line, {"prompt": TEXT, "output_len": N}
 * ("expected_output_len" is accepted for output_len); blank lines are skipped. Returns 0,
 * PD_EIO (file unreadable), PD_EFORMAT (a bad line: err names file and line), PD_ENOMEM.
 * Caller frees with bench_dataset_free. */
int bench_dataset_load(const char *path, bench_dataset *out, char *err);
void bench_dataset_free(bench_dataset *d);

typedef struct {
    bench_wl_kind kind;
    int32_t input_min, input_max;   /* prompt tokens (random, shared-prefix suffix) */
    int32_t output_min, output_max; /* output tokens (random, shared-prefix) */
    int32_t prefix_groups;          /* shared-prefix: number of groups, >= 1 */
    int32_t prefix_len;             /* shared-prefix: tokens of each group's prefix */
    uint32_t token_lo, token_hi;    /* random ids are drawn from [token_lo, token_hi] */
    const bench_dataset *dataset;   /* borrowed; BENCH_WL_DATASET only */
    uint64_t seed;                  /* the same seed gives the same requests (see reset) */
} bench_workload_params;

typedef struct bench_workload bench_workload; /* opaque */

/* One request to send. Valid until the next bench_workload_next call. */
typedef struct {
    const char *prompt;         /* text prompt, or NULL when ids are given */
    const uint32_t *ids;        /* [n_ids] prompt token ids (when prompt is NULL) */
    int32_t n_ids;
    int32_t output_len;         /* max_tokens, sent with ignore_eos */
} bench_request_spec;

/* Creates a workload generator; p is copied (the dataset stays borrowed). Returns 0,
 * PD_EINVAL (err says why), PD_ENOMEM. */
int bench_workload_create(const bench_workload_params *p, bench_workload **out, char *err);
void bench_workload_destroy(bench_workload *w); /* NULL is a no-op */
/* Restarts the sequence of requests (and the shared prefixes) from seed. Probes reset with
 * different seeds so that a server's prefix cache does not serve one probe's prompts to the
 * next; a dataset's prompts repeat whatever the seed (only their order changes). */
void bench_workload_reset(bench_workload *w, uint64_t seed);
void bench_workload_next(bench_workload *w, bench_request_spec *out);

/* ---- one run at one rate ---- */

typedef struct rpc_channel rpc_channel;

/* Everything measured about one request. Times in microseconds since the run's start. */
typedef struct {
    int64_t index;              /* order of issue within the run, from 0 */
    bool warmup;                /* excluded from every statistic */
    bool interrupted;           /* cancelled by us (Ctrl-C): excluded from every statistic */
    int status;                 /* rpc_status_code; -1 while in flight */
    int finish_reason;          /* the last message's FinishReason */
    int32_t n_in;               /* prompt tokens (usage.prompt_tokens, else ids sent) */
    int32_t n_out_expected;     /* max_tokens asked */
    int32_t n_out;              /* token ids received */
    int32_t n_cached;           /* usage.cached_prompt_tokens */
    int64_t t_sched_us;         /* when the arrival process wanted it sent */
    int64_t t_start_us;         /* when it was sent */
    int64_t t_first_us;         /* first message with a token; -1 = none */
    int64_t t_last_us;          /* last message with a token; -1 = none */
    int64_t t_end_us;           /* final status */
    float *itl_ms;              /* [n_itl] inter-token latencies (see bench_run.c) */
    int32_t n_itl, cap_itl;
} bench_req;

typedef struct {
    bench_arrival arrival;
    double rate;                /* requests/s (open loop) */
    double burstiness;          /* gamma shape */
    int64_t concurrency;        /* closed loop: requests in flight */
    int64_t num_requests;       /* measured requests; 0 = until duration_s */
    double duration_s;          /* measured arrivals for this long (when num_requests is 0) */
    int64_t warmup_requests;    /* sent first, excluded */
    int64_t max_inflight;       /* open loop: arrivals wait while this many are in flight */
    int64_t timeout_ms;         /* per-request deadline */
    uint64_t seed;              /* arrival process seed */
    uint64_t workload_seed;     /* the workload restarts from this seed */
    const char *label;          /* progress-line prefix and request-id part ("probe 3");
                                   NULL = none */
    bool progress;              /* draw a progress line on stderr */
} bench_run_params;

typedef struct {
    bench_req *reqs;            /* [n_reqs], in issue order (warm-up included) */
    int64_t n_reqs;
    double rate;                /* offered rate (0 for closed loop) */
    double wall_s;              /* from the first send to the last end */
    bool interrupted;           /* stopped by Ctrl-C */
} bench_run;

/* Runs one load test over the channels (round robin) with workload w: sends the requests at
 * the arrival process's times, waits for all of them, and fills *out (caller frees with
 * bench_run_free). stop (may be NULL) is polled: when it becomes non-zero no more requests
 * are sent, those in flight are cancelled and marked interrupted. Returns 0, PD_ENOMEM, or
 * PD_EIO when a call could not be started (err says why). */
int bench_run_once(rpc_channel **chans, int n_chans, bench_workload *w,
                   const bench_run_params *p, volatile sig_atomic_t *stop, bench_run *out,
                   char *err);
void bench_run_free(bench_run *r);

/* ---- statistics ---- */

typedef struct {
    int64_t n;                  /* values; 0 = the fields below are NaN */
    double mean, min, p50, p90, p95, p99, max;
} bench_dist;

/* Percentile q (0..100) of sorted v[n] by linear interpolation between closest ranks (numpy's
 * default). NaN when n is 0. */
double bench_percentile(const double *sorted, int64_t n, double q);

typedef struct {
    double ttft_ms;             /* SLO on TTFT; 0 = none */
    double tpot_ms;             /* SLO on TPOT; 0 = none */
    double attainment;          /* share of requests that must meet the SLO, (0, 1] */
} bench_slo;

#define BENCH_N_CODES 17        /* gRPC status codes 0..16 */

/* The summary of one run (measured requests only). */
typedef struct {
    double rate;                /* offered rate, requests/s (0 = closed loop) */
    int64_t n;                  /* measured requests that finished */
    int64_t n_ok;               /* ... with status OK */
    int64_t n_errors;           /* ... with another status */
    int64_t n_interrupted;      /* cancelled by Ctrl-C (in no other count) */
    int64_t errors_by_code[BENCH_N_CODES];
    double wall_s;              /* first measured send to last measured end */
    double req_per_s, in_tok_per_s, out_tok_per_s; /* OK requests and their tokens */
    int64_t in_tokens, out_tokens, cached_tokens;  /* sums over OK requests */
    bench_dist ttft, tpot, itl, e2e, out_len;      /* OK requests only; ms or tokens */
    bench_dist lag;             /* send time minus scheduled time, ms (client lag) */
    int64_t n_met, n_met_ttft, n_met_tpot; /* requests meeting both / TTFT / TPOT SLOs */
    double attained;            /* n_met / n (0 when n is 0) */
    double attained_ttft, attained_tpot;
    double met_per_s;           /* requests meeting the SLO per second of wall time */
    bool pass;                  /* attained >= the SLO's attainment (and n > 0) */
} bench_summary;

/* True when the request finished OK within both SLOs (a TPOT SLO is met trivially by a
 * request with one output token). */
bool bench_req_meets(const bench_req *q, const bench_slo *slo, bool *ttft_ok, bool *tpot_ok);
double bench_req_ttft_ms(const bench_req *q);   /* NaN without a token */
double bench_req_tpot_ms(const bench_req *q);   /* NaN with fewer than 2 tokens */
double bench_req_e2e_ms(const bench_req *q);

/* Summarises r against slo. Returns 0 or PD_ENOMEM. For plots, *ttft_sorted and *tpot_sorted
 * (may be NULL) receive the sorted per-request values (caller frees). */
int bench_summarize(const bench_run *r, const bench_slo *slo, bench_summary *out,
                    double **ttft_sorted, int64_t *n_ttft, double **tpot_sorted,
                    int64_t *n_tpot);

/* ---- reports ---- */

/* One probe (or the single run) as reports see it. */
typedef struct {
    bench_run run;
    bench_summary sum;
    double *ttft_sorted, *tpot_sorted; /* [n_ttft], [n_tpot] (owned) */
    int64_t n_ttft, n_tpot;
} bench_probe;

typedef struct {
    const char *target;             /* server address */
    const char *model_name;
    uint32_t vocab_size, max_model_len;
    const char *workload_desc;      /* one line */
    const char *arrival_desc;       /* one line */
    bench_slo slo;
    bool find_goodput;
    bool goodput_found;             /* some probe passed */
    bool goodput_bracketed;         /* a failing probe bounds it from above */
    double goodput_rps;             /* highest passing rate */
    double goodput_fail_rps;        /* lowest failing rate above it (when bracketed) */
    int best;                       /* probe to show in full (-1 = none) */
    bool interrupted;
} bench_report_info;

void bench_print_table(FILE *f, const bench_report_info *info, const bench_summary *s);
/* Prints one line about a probe of the goodput search. */
void bench_print_probe(FILE *f, int i, const bench_summary *s, const bench_slo *slo);
/* Writes the JSON report (summaries of every probe and the goodput). Returns 0 or PD_EIO. */
int bench_write_json(const char *path, const bench_report_info *info, const bench_probe *probes,
                     int n_probes, char *err);
/* Writes one CSV row per request of every probe (warm-up rows flagged). 0 or PD_EIO. */
int bench_write_csv(const char *path, const bench_probe *probes, int n_probes,
                    const bench_slo *slo, char *err);
/* Writes dir/slo_attainment_vs_rate.svg, dir/ttft_cdf.svg and dir/tpot_cdf.svg (the folder
 * is created if needed). Returns 0 or PD_EIO. */
int bench_write_plots(const char *dir, const bench_report_info *info, const bench_probe *probes,
                      int n_probes, char *err);

const char *bench_status_name(int code);

#endif
