/* bench_stats.c -- pdserve-bench's statistics: per-request TTFT / TPOT / E2E, percentiles,
 * throughput and SLO attainment of one run. Only measured requests count (no warm-up, nothing
 * cancelled by Ctrl-C); latencies come from requests that ended OK, while failed requests
 * count as requests that missed the SLO. */
#include "tools/bench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/rpc/rpc.h"

double bench_percentile(const double *v, int64_t n, double q)
{
    if (n <= 0) return NAN;
    double pos = q / 100.0 * (double)(n - 1);
    int64_t lo = (int64_t)floor(pos);
    if (lo >= n - 1) return v[n - 1];
    double f = pos - (double)lo;
    return v[lo] + (v[lo + 1] - v[lo]) * f;
}

double bench_req_ttft_ms(const bench_req *q)
{
    return q->t_first_us < 0 ? NAN : (double)(q->t_first_us - q->t_start_us) / 1000.0;
}

double bench_req_tpot_ms(const bench_req *q)
{
    if (q->n_out < 2 || q->t_first_us < 0) return NAN;
    return (double)(q->t_last_us - q->t_first_us) / 1000.0 / (double)(q->n_out - 1);
}

double bench_req_e2e_ms(const bench_req *q)
{
    return (double)(q->t_end_us - q->t_start_us) / 1000.0;
}

bool bench_req_meets(const bench_req *q, const bench_slo *slo, bool *ttft_ok, bool *tpot_ok)
{
    bool ok = q->status == RPC_STATUS_OK;
    double ttft = bench_req_ttft_ms(q), tpot = bench_req_tpot_ms(q);
    bool a = ok && (slo->ttft_ms <= 0 || (!isnan(ttft) && ttft <= slo->ttft_ms));
    bool b = ok && (slo->tpot_ms <= 0 || isnan(tpot) || tpot <= slo->tpot_ms);
    if (ttft_ok) *ttft_ok = a;
    if (tpot_ok) *tpot_ok = b;
    return a && b;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Sorts v[n] and fills d. */
static void dist_of(double *v, int64_t n, bench_dist *d)
{
    memset(d, 0, sizeof *d);
    d->n = n;
    if (n == 0) {
        d->mean = d->min = d->p50 = d->p90 = d->p95 = d->p99 = d->max = NAN;
        return;
    }
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += v[i];
    d->mean = s / (double)n;
    d->min = v[0];
    d->max = v[n - 1];
    d->p50 = bench_percentile(v, n, 50);
    d->p90 = bench_percentile(v, n, 90);
    d->p95 = bench_percentile(v, n, 95);
    d->p99 = bench_percentile(v, n, 99);
}

int bench_summarize(const bench_run *r, const bench_slo *slo, bench_summary *s,
                    double **ttft_sorted, int64_t *n_ttft, double **tpot_sorted,
                    int64_t *n_tpot)
{
    memset(s, 0, sizeof *s);
    s->rate = r->rate;
    int64_t n_itl = 0;
    for (int64_t i = 0; i < r->n_reqs; i++) n_itl += r->reqs[i].n_itl;
    size_t nr = (size_t)r->n_reqs + 1;
    double *ttft = malloc(nr * sizeof *ttft), *tpot = malloc(nr * sizeof *tpot);
    double *e2e = malloc(nr * sizeof *e2e), *olen = malloc(nr * sizeof *olen);
    double *lag = malloc(nr * sizeof *lag), *itl = malloc(((size_t)n_itl + 1) * sizeof *itl);
    if (!ttft || !tpot || !e2e || !olen || !lag || !itl) {
        free(ttft), free(tpot), free(e2e), free(olen), free(lag), free(itl);
        return PD_ENOMEM;
    }
    int64_t nt = 0, np = 0, ne = 0, nl = 0, ni = 0;
    int64_t t_min = INT64_MAX, t_max = INT64_MIN;
    for (int64_t i = 0; i < r->n_reqs; i++) {
        const bench_req *q = &r->reqs[i];
        if (q->warmup) continue;
        if (q->interrupted) {
            s->n_interrupted++;
            continue;
        }
        s->n++;
        lag[nl++] = (double)(q->t_start_us - q->t_sched_us) / 1000.0;
        if (q->t_start_us < t_min) t_min = q->t_start_us;
        if (q->t_end_us > t_max) t_max = q->t_end_us;
        bool a, b;
        if (bench_req_meets(q, slo, &a, &b)) s->n_met++;
        s->n_met_ttft += a;
        s->n_met_tpot += b;
        if (q->status != RPC_STATUS_OK) {
            s->n_errors++;
            if (q->status >= 0 && q->status < BENCH_N_CODES) s->errors_by_code[q->status]++;
            continue;
        }
        s->n_ok++;
        s->in_tokens += q->n_in;
        s->out_tokens += q->n_out;
        s->cached_tokens += q->n_cached;
        double t1 = bench_req_ttft_ms(q), t2 = bench_req_tpot_ms(q);
        if (!isnan(t1)) ttft[nt++] = t1;
        if (!isnan(t2)) tpot[np++] = t2;
        e2e[ne] = bench_req_e2e_ms(q);
        olen[ne++] = q->n_out;
        for (int32_t k = 0; k < q->n_itl; k++) itl[ni++] = q->itl_ms[k];
    }
    s->wall_s = s->n ? (double)(t_max - t_min) / 1e6 : 0;
    if (s->wall_s > 0) {
        s->req_per_s = (double)s->n_ok / s->wall_s;
        s->in_tok_per_s = (double)s->in_tokens / s->wall_s;
        s->out_tok_per_s = (double)s->out_tokens / s->wall_s;
        s->met_per_s = (double)s->n_met / s->wall_s;
    }
    if (s->n > 0) {
        s->attained = (double)s->n_met / (double)s->n;
        s->attained_ttft = (double)s->n_met_ttft / (double)s->n;
        s->attained_tpot = (double)s->n_met_tpot / (double)s->n;
    }
    s->pass = s->n > 0 && s->attained >= slo->attainment - 1e-12;
    dist_of(ttft, nt, &s->ttft);
    dist_of(tpot, np, &s->tpot);
    dist_of(e2e, ne, &s->e2e);
    dist_of(olen, ne, &s->out_len);
    dist_of(lag, nl, &s->lag);
    dist_of(itl, ni, &s->itl);
    free(e2e), free(olen), free(lag), free(itl);
    if (ttft_sorted) {
        *ttft_sorted = ttft;
        *n_ttft = nt;
    } else {
        free(ttft);
    }
    if (tpot_sorted) {
        *tpot_sorted = tpot;
        *n_tpot = np;
    } else {
        free(tpot);
    }
    return 0;
}
