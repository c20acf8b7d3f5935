/* metrics.h -- A Prometheus metrics registry: counters, gauges and histograms with fixed
 * buckets, grouped in families (one name, help and type; series told apart by labels), and
 * rendering in the Prometheus text exposition format 0.0.4. No I/O here: the HTTP endpoint
 * lives in svc/svc_http.h.
 *
 * Threading. Updates (pd_metric_add, _set, _observe) are lock-free atomics (histograms take
 * the series' own mutex) and may come from any thread. Creating a family or a series takes
 * the registry mutex; series are never freed before the registry, so a pointer to one stays
 * valid while the registry lives. A collector (pd_metrics_set_collector) runs at the start of
 * every render, on the rendering thread, to sample gauges (queue lengths, KV blocks). */
#ifndef PD_METRICS_H
#define PD_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    PD_METRIC_COUNTER = 0,  /* only goes up; the name ends in _total */
    PD_METRIC_GAUGE,        /* any value */
    PD_METRIC_HISTOGRAM,    /* observations counted in fixed cumulative buckets, plus sum */
} pd_metric_type;

typedef struct pd_metrics pd_metrics; /* opaque: the registry */
typedef struct pd_mfamily pd_mfamily; /* opaque: one metric name */
typedef struct pd_metric pd_metric;   /* opaque: one series (a family with one label set) */

/* Called at the start of every pd_metrics_render with the registry (which it may update). */
typedef void (*pd_metrics_collect_fn)(pd_metrics *m, void *arg);

/* Creates an empty registry. Returns 0 or PD_ENOMEM. */
int pd_metrics_create(pd_metrics **out);
/* Frees the registry with every family and series. NULL is a no-op. */
void pd_metrics_destroy(pd_metrics *m);

/* Sets the collector (fn NULL removes it); arg is borrowed and must outlive the registry's
 * last render. */
void pd_metrics_set_collector(pd_metrics *m, pd_metrics_collect_fn fn, void *arg);

/* Returns the family called name, creating it with type t, help and, for histograms, the
 * bucket upper bounds (bounds[n_bounds], strictly increasing, copied; +Inf is implicit).
 * name must match [a-zA-Z_:][a-zA-Z0-9_:]*; counters must end in "_total". A second call with
 * the same name returns the first family (its type must match). Returns NULL on a bad name or
 * type, mismatched type, or out of memory. Families render in creation order. */
pd_mfamily *pd_metrics_family(pd_metrics *m, pd_metric_type t, const char *name,
                              const char *help, const double *bounds, int n_bounds);

/* Returns the series of family f with the given labels, creating it (value 0) if needed.
 * labels is the inside of the braces, already formatted and escaped (`outcome="ok"`,
 * `role="prefill",addr="10.0.0.1:7001"`), or NULL / "" for none; use pd_metrics_label() to
 * build it from arbitrary values. Returns NULL when out of memory (updates on NULL are
 * no-ops). A hidden series (pd_mfamily_hide_all) becomes visible again. */
pd_metric *pd_mfamily_series(pd_mfamily *f, const char *labels);

/* Hides every series of f from rendering until it is updated or looked up again: for
 * families a collector rebuilds at every scrape (one series per live instance), so that
 * series of instances gone do not linger. Nothing is freed. */
void pd_mfamily_hide_all(pd_mfamily *f);

/* Shorthands: family + series in one call (labels as for pd_mfamily_series). */
pd_metric *pd_metrics_counter(pd_metrics *m, const char *name, const char *labels, const char *help);
pd_metric *pd_metrics_gauge(pd_metrics *m, const char *name, const char *labels, const char *help);
pd_metric *pd_metrics_histogram(pd_metrics *m, const char *name, const char *labels,
                                const char *help, const double *bounds, int n_bounds);

/* Counters and gauges: adds v (a counter ignores v < 0). Gauges: sets v. Histograms: counts
 * one observation of v. NULL is a no-op for all three. */
void pd_metric_add(pd_metric *s, double v);
void pd_metric_set(pd_metric *s, double v);
void pd_metric_observe(pd_metric *s, double v);
/* The current value of a counter or gauge, or the observation count of a histogram. */
double pd_metric_value(const pd_metric *s);

/* Appends `key="value"` (value escaped: backslash, double quote, newline) to buf (size n,
 * NUL-terminated), with a comma first when buf is not empty. Returns 0 or PD_ERANGE when it
 * does not fit (buf unchanged). */
int pd_metrics_label(char *buf, size_t n, const char *key, const char *value);

/* Runs the collector, then renders every visible series in the text format 0.0.4 (HELP and
 * TYPE lines, histogram _bucket{le=...} / _sum / _count). *out receives a NUL-terminated
 * buffer that the caller frees with free(); *len its length. Returns 0 or PD_ENOMEM. */
int pd_metrics_render(pd_metrics *m, char **out, size_t *len);

/* The Content-Type of the rendered text. */
#define PD_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* Bucket bounds used by pdserve's services (seconds unless said otherwise). */
extern const double pd_metrics_latency_buckets[];  /* 1 ms .. 80 s: TTFT, queue time */
extern const int pd_metrics_n_latency_buckets;
extern const double pd_metrics_token_buckets[];    /* 1 ms .. 2.5 s: TPOT */
extern const int pd_metrics_n_token_buckets;
extern const double pd_metrics_request_buckets[];  /* 10 ms .. 480 s: end-to-end latency */
extern const int pd_metrics_n_request_buckets;
extern const double pd_metrics_step_buckets[];     /* 0.1 ms .. 2.5 s: engine step, KV transfer */
extern const int pd_metrics_n_step_buckets;
extern const double pd_metrics_batch_buckets[];    /* 1 .. 1024 (a count): batch size */
extern const int pd_metrics_n_batch_buckets;

#endif
