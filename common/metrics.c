/* metrics.c -- The Prometheus registry (see metrics.h): families in a list, series per family
 * in a list, values as atomic doubles (bit patterns in a uint64 with a CAS loop), histogram
 * buckets under a per-series mutex so that a scrape sees count, sum and buckets agree. */
#include "common/metrics.h"

#include <math.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

const double pd_metrics_latency_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                             0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                             5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
const int pd_metrics_n_latency_buckets = sizeof pd_metrics_latency_buckets / sizeof(double);
const double pd_metrics_token_buckets[] = {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02,
                                           0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                                           0.3, 0.4, 0.5, 0.75, 1.0, 2.5};
const int pd_metrics_n_token_buckets = sizeof pd_metrics_token_buckets / sizeof(double);
const double pd_metrics_request_buckets[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                             10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                                             240.0, 480.0};
const int pd_metrics_n_request_buckets = sizeof pd_metrics_request_buckets / sizeof(double);
const double pd_metrics_step_buckets[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                          0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5};
const int pd_metrics_n_step_buckets = sizeof pd_metrics_step_buckets / sizeof(double);
const double pd_metrics_batch_buckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
const int pd_metrics_n_batch_buckets = sizeof pd_metrics_batch_buckets / sizeof(double);

struct pd_metric {
    pd_mfamily *fam;
    char *labels;                  /* "" when none */
    _Atomic uint64_t bits;         /* counter / gauge value as double bits */
    atomic_bool hidden;
    pthread_mutex_t mu;            /* histograms: buckets, count, sum */
    uint64_t *buckets;             /* [n_bounds] non-cumulative counts (+Inf is count - sum) */
    uint64_t count;
    double sum;
    pd_metric *next;
};

struct pd_mfamily {
    pd_metrics *reg;
    pd_metric_type type;
    char *name, *help;
    double *bounds;
    int n_bounds;
    pd_metric *head, *tail;        /* guarded by the registry mutex (appends only) */
    pd_mfamily *next;
};

struct pd_metrics {
    pthread_mutex_t mu;            /* families and series lists */
    pd_mfamily *head, *tail;
    pd_metrics_collect_fn collect;
    void *collect_arg;
};

static double bits_to_d(uint64_t b)
{
    double d;
    memcpy(&d, &b, sizeof d);
    return d;
}

static uint64_t d_to_bits(double d)
{
    uint64_t b;
    memcpy(&b, &d, sizeof b);
    return b;
}

int pd_metrics_create(pd_metrics **out)
{
    *out = NULL;
    pd_metrics *m = calloc(1, sizeof *m);
    if (!m) return PD_ENOMEM;
    pthread_mutex_init(&m->mu, NULL);
    *out = m;
    return 0;
}

void pd_metrics_destroy(pd_metrics *m)
{
    if (!m) return;
    for (pd_mfamily *f = m->head; f;) {
        pd_mfamily *fn = f->next;
        for (pd_metric *s = f->head; s;) {
            pd_metric *sn = s->next;
            pthread_mutex_destroy(&s->mu);
            free(s->labels);
            free(s->buckets);
            free(s);
            s = sn;
        }
        free(f->name);
        free(f->help);
        free(f->bounds);
        free(f);
        f = fn;
    }
    pthread_mutex_destroy(&m->mu);
    free(m);
}

void pd_metrics_set_collector(pd_metrics *m, pd_metrics_collect_fn fn, void *arg)
{
    pthread_mutex_lock(&m->mu);
    m->collect = fn;
    m->collect_arg = arg;
    pthread_mutex_unlock(&m->mu);
}

static bool valid_name(const char *n)
{
    if (!n || !*n) return false;
    for (const char *p = n; *p; p++) {
        bool alpha = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || *p == '_' || *p == ':';
        bool digit = *p >= '0' && *p <= '9';
        if (!alpha && !(digit && p != n)) return false;
    }
    return true;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

pd_mfamily *pd_metrics_family(pd_metrics *m, pd_metric_type t, const char *name,
                              const char *help, const double *bounds, int n_bounds)
{
    if (!valid_name(name) || t < PD_METRIC_COUNTER || t > PD_METRIC_HISTOGRAM) return NULL;
    if (t == PD_METRIC_COUNTER && !ends_with(name, "_total")) return NULL;
    if (t == PD_METRIC_HISTOGRAM) {
        if (!bounds || n_bounds < 1) return NULL;
        for (int i = 1; i < n_bounds; i++)
            if (!(bounds[i] > bounds[i - 1])) return NULL;
    }
    pthread_mutex_lock(&m->mu);
    pd_mfamily *f;
    for (f = m->head; f; f = f->next)
        if (!strcmp(f->name, name)) break;
    if (f) {
        pthread_mutex_unlock(&m->mu);
        return f->type == t ? f : NULL;
    }
    f = calloc(1, sizeof *f);
    if (!f) goto fail;
    f->reg = m;
    f->type = t;
    f->name = strdup(name);
    f->help = strdup(help ? help : "");
    if (!f->name || !f->help) goto fail;
    if (t == PD_METRIC_HISTOGRAM) {
        f->bounds = malloc((size_t)n_bounds * sizeof *f->bounds);
        if (!f->bounds) goto fail;
        memcpy(f->bounds, bounds, (size_t)n_bounds * sizeof *f->bounds);
        f->n_bounds = n_bounds;
    }
    if (m->tail) m->tail->next = f; else m->head = f;
    m->tail = f;
    pthread_mutex_unlock(&m->mu);
    return f;
fail:
    if (f) {
        free(f->name);
        free(f->help);
        free(f->bounds);
        free(f);
    }
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

pd_metric *pd_mfamily_series(pd_mfamily *f, const char *labels)
{
    if (!f) return NULL;
    if (!labels) labels = "";
    pd_metrics *m = f->reg;
    pthread_mutex_lock(&m->mu);
    pd_metric *s;
    for (s = f->head; s; s = s->next)
        if (!strcmp(s->labels, labels)) break;
    if (s) {
        atomic_store(&s->hidden, false);
        pthread_mutex_unlock(&m->mu);
        return s;
    }
    s = calloc(1, sizeof *s);
    if (s) s->labels = strdup(labels);
    if (s && s->labels && f->type == PD_METRIC_HISTOGRAM)
        s->buckets = calloc((size_t)f->n_bounds, sizeof *s->buckets);
    if (!s || !s->labels || (f->type == PD_METRIC_HISTOGRAM && !s->buckets)) {
        if (s) {
            free(s->labels);
            free(s);
        }
        pthread_mutex_unlock(&m->mu);
        return NULL;
    }
    s->fam = f;
    atomic_init(&s->bits, d_to_bits(0.0));
    atomic_init(&s->hidden, false);
    pthread_mutex_init(&s->mu, NULL);
    if (f->tail) f->tail->next = s; else f->head = s;
    f->tail = s;
    pthread_mutex_unlock(&m->mu);
    return s;
}

void pd_mfamily_hide_all(pd_mfamily *f)
{
    if (!f) return;
    pthread_mutex_lock(&f->reg->mu);
    for (pd_metric *s = f->head; s; s = s->next) atomic_store(&s->hidden, true);
    pthread_mutex_unlock(&f->reg->mu);
}

pd_metric *pd_metrics_counter(pd_metrics *m, const char *name, const char *labels, const char *help)
{
    return pd_mfamily_series(pd_metrics_family(m, PD_METRIC_COUNTER, name, help, NULL, 0), labels);
}

pd_metric *pd_metrics_gauge(pd_metrics *m, const char *name, const char *labels, const char *help)
{
    return pd_mfamily_series(pd_metrics_family(m, PD_METRIC_GAUGE, name, help, NULL, 0), labels);
}

pd_metric *pd_metrics_histogram(pd_metrics *m, const char *name, const char *labels,
                                const char *help, const double *bounds, int n_bounds)
{
    return pd_mfamily_series(pd_metrics_family(m, PD_METRIC_HISTOGRAM, name, help, bounds, n_bounds),
                             labels);
}

void pd_metric_add(pd_metric *s, double v)
{
    if (!s || s->fam->type == PD_METRIC_HISTOGRAM) return;
    if (s->fam->type == PD_METRIC_COUNTER && !(v >= 0)) return;
    uint64_t old = atomic_load(&s->bits);
    while (!atomic_compare_exchange_weak(&s->bits, &old, d_to_bits(bits_to_d(old) + v))) {
    }
    atomic_store(&s->hidden, false);
}

void pd_metric_set(pd_metric *s, double v)
{
    if (!s || s->fam->type == PD_METRIC_HISTOGRAM) return;
    atomic_store(&s->bits, d_to_bits(v));
    atomic_store(&s->hidden, false);
}

void pd_metric_observe(pd_metric *s, double v)
{
    if (!s || s->fam->type != PD_METRIC_HISTOGRAM || isnan(v)) return;
    const pd_mfamily *f = s->fam;
    int i = 0; /* first bucket with v <= bound; n_bounds = +Inf */
    while (i < f->n_bounds && v > f->bounds[i]) i++;
    pthread_mutex_lock(&s->mu);
    if (i < f->n_bounds) s->buckets[i]++;
    s->count++;
    s->sum += v;
    pthread_mutex_unlock(&s->mu);
    atomic_store(&s->hidden, false);
}

double pd_metric_value(const pd_metric *s)
{
    if (!s) return 0;
    if (s->fam->type != PD_METRIC_HISTOGRAM) return bits_to_d(atomic_load(&s->bits));
    pthread_mutex_lock((pthread_mutex_t *)&s->mu);
    double n = (double)s->count;
    pthread_mutex_unlock((pthread_mutex_t *)&s->mu);
    return n;
}

int pd_metrics_label(char *buf, size_t n, const char *key, const char *value)
{
    size_t len = strlen(buf), need = len + (len ? 1 : 0) + strlen(key) + 3;
    for (const char *p = value; *p; p++) need += (*p == '\\' || *p == '"' || *p == '\n') ? 2 : 1;
    if (need + 1 > n) return PD_ERANGE;
    char *w = buf + len;
    if (len) *w++ = ',';
    w += sprintf(w, "%s=\"", key);
    for (const char *p = value; *p; p++) {
        if (*p == '\\' || *p == '"') {
            *w++ = '\\';
            *w++ = *p;
        } else if (*p == '\n') {
            *w++ = '\\';
            *w++ = 'n';
        } else {
            *w++ = *p;
        }
    }
    *w++ = '"';
    *w = 0;
    return 0;
}

/* ---- rendering ---- */

typedef struct {
    char *p;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(sbuf *b, const char *fmt, ...)
{
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n + 1;
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
}

/* A sample value as Prometheus reads it: integers without exponent, +Inf / -Inf / NaN. */
static void fmt_value(char *out, size_t n, double v)
{
    if (isnan(v)) snprintf(out, n, "NaN");
    else if (isinf(v)) snprintf(out, n, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 1e15) snprintf(out, n, "%.0f", v);
    else snprintf(out, n, "%.17g", v);
}

/* HELP text escaping: backslash and newline. */
static void sb_help(sbuf *b, const char *h)
{
    for (const char *p = h; *p; p++) {
        if (*p == '\\') sb_printf(b, "\\\\");
        else if (*p == '\n') sb_printf(b, "\\n");
        else sb_printf(b, "%c", *p);
    }
}

static void render_series(sbuf *b, const pd_mfamily *f, pd_metric *s)
{
    char v[64];
    const char *l = s->labels;
    if (f->type != PD_METRIC_HISTOGRAM) {
        fmt_value(v, sizeof v, bits_to_d(atomic_load(&s->bits)));
        if (*l) sb_printf(b, "%s{%s} %s\n", f->name, l, v);
        else sb_printf(b, "%s %s\n", f->name, v);
        return;
    }
    pthread_mutex_lock(&s->mu);
    uint64_t count = s->count, cum = 0;
    double sum = s->sum;
    for (int i = 0; i < f->n_bounds; i++) {
        cum += s->buckets[i];
        char le[64];
        fmt_value(le, sizeof le, f->bounds[i]);
        if (f->bounds[i] != floor(f->bounds[i])) snprintf(le, sizeof le, "%g", f->bounds[i]);
        sb_printf(b, "%s_bucket{%s%sle=\"%s\"} %llu\n", f->name, l, *l ? "," : "", le,
                  (unsigned long long)cum);
    }
    pthread_mutex_unlock(&s->mu);
    sb_printf(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", f->name, l, *l ? "," : "",
              (unsigned long long)count);
    fmt_value(v, sizeof v, sum);
    if (*l) {
        sb_printf(b, "%s_sum{%s} %s\n", f->name, l, v);
        sb_printf(b, "%s_count{%s} %llu\n", f->name, l, (unsigned long long)count);
    } else {
        sb_printf(b, "%s_sum %s\n", f->name, v);
        sb_printf(b, "%s_count %llu\n", f->name, (unsigned long long)count);
    }
}

int pd_metrics_render(pd_metrics *m, char **out, size_t *len)
{
    *out = NULL;
    *len = 0;
    pthread_mutex_lock(&m->mu);
    pd_metrics_collect_fn fn = m->collect;
    void *arg = m->collect_arg;
    pthread_mutex_unlock(&m->mu);
    if (fn) fn(m, arg);
    sbuf b = {malloc(4096), 0, 4096, false};
    if (!b.p) return PD_ENOMEM;
    b.p[0] = 0;
    static const char *const type_name[] = {"counter", "gauge", "histogram"};
    pthread_mutex_lock(&m->mu);
    for (pd_mfamily *f = m->head; f; f = f->next) {
        bool any = false;
        for (pd_metric *s = f->head; s && !any; s = s->next) any = !atomic_load(&s->hidden);
        if (!any) continue;
        sb_printf(&b, "# HELP %s ", f->name);
        sb_help(&b, f->help);
        sb_printf(&b, "\n# TYPE %s %s\n", f->name, type_name[f->type]);
        for (pd_metric *s = f->head; s; s = s->next)
            if (!atomic_load(&s->hidden)) render_series(&b, f, s);
    }
    pthread_mutex_unlock(&m->mu);
    if (b.oom) {
        free(b.p);
        return PD_ENOMEM;
    }
    *out = b.p;
    *len = b.len;
    return 0;
}
