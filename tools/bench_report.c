/* bench_report.c -- pdserve-bench's reports: the human-readable table, one line per probe of
 * the goodput search, the JSON summary (--json) and the per-request CSV (--csv). The JSON
 * fields are listed in docs/benchmarking.md. */
#include "tools/bench.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#include "common/error.h"
#include "common/rpc/rpc.h"

const char *bench_status_name(int code)
{
    return code < 0 ? "IN_FLIGHT" : rpc_status_name(code);
}

/* Writes the non-zero error counts as "NAME n, NAME n" into buf. */
static void errors_line(const bench_summary *s, char *buf, size_t len)
{
    size_t o = 0;
    buf[0] = 0;
    for (int c = 1; c < BENCH_N_CODES && o < len; c++)
        if (s->errors_by_code[c])
            o += (size_t)snprintf(buf + o, len - o, "%s%s %lld", o ? ", " : "",
                                  rpc_status_name(c), (long long)s->errors_by_code[c]);
}

static void slo_line(const bench_slo *slo, char *buf, size_t len)
{
    char a[48] = "", b[48] = "";
    if (slo->ttft_ms > 0) snprintf(a, sizeof a, "TTFT <= %g ms", slo->ttft_ms);
    if (slo->tpot_ms > 0) snprintf(b, sizeof b, "TPOT <= %g ms", slo->tpot_ms);
    if (!a[0] && !b[0])
        snprintf(buf, len, "none (a request meets it when it ends OK)");
    else
        snprintf(buf, len, "%s%s%s", a, a[0] && b[0] ? " and " : "", b);
}

static void dist_row(FILE *f, const char *name, const bench_dist *d, int prec)
{
    if (d->n == 0) {
        fprintf(f, "  %-14s %9s\n", name, "-");
        return;
    }
    fprintf(f, "  %-14s %9.*f %9.*f %9.*f %9.*f %9.*f %9.*f\n", name, prec, d->mean, prec, d->p50,
            prec, d->p90, prec, d->p95, prec, d->p99, prec, d->max);
}

void bench_print_probe(FILE *f, int i, const bench_summary *s, const bench_slo *slo)
{
    char errs[256], ttft[32] = "-", tpot[32] = "-";
    errors_line(s, errs, sizeof errs);
    if (s->ttft.n) snprintf(ttft, sizeof ttft, "%.1f", s->ttft.p90);
    if (s->tpot.n) snprintf(tpot, sizeof tpot, "%.2f", s->tpot.p90);
    fprintf(f, "probe %2d: rate %8.3f req/s -> SLO attainment %5.1f%% (TTFT %5.1f%%, TPOT %5.1f%%), "
               "TTFT p90 %s ms, TPOT p90 %s ms, %lld requests%s%s%s -> %s\n",
            i + 1, s->rate, 100 * s->attained, 100 * s->attained_ttft, 100 * s->attained_tpot,
            ttft, tpot, (long long)s->n, errs[0] ? " (errors: " : "", errs,
            errs[0] ? ")" : "", s->n_interrupted ? "interrupted" : s->pass ? "PASS" : "fail");
    fflush(f);
}

void bench_print_table(FILE *f, const bench_report_info *in, const bench_summary *s)
{
    char errs[256], slo[128];
    errors_line(s, errs, sizeof errs);
    slo_line(&in->slo, slo, sizeof slo);
    fprintf(f, "\n== pdserve-bench: %s, model %s (vocab %u, max length %u)%s\n", in->target,
            in->model_name, in->vocab_size, in->max_model_len,
            in->interrupted ? " -- INTERRUPTED, partial results" : "");
    fprintf(f, "workload     %s\n", in->workload_desc);
    fprintf(f, "arrivals     %s\n", in->arrival_desc);
    if (s->rate > 0) fprintf(f, "rate         %.3f req/s offered\n", s->rate);
    fprintf(f, "requests     %lld measured: %lld OK, %lld failed%s%s%s", (long long)s->n,
            (long long)s->n_ok, (long long)s->n_errors, errs[0] ? " (" : "", errs,
            errs[0] ? ")" : "");
    if (s->n_interrupted) fprintf(f, ", %lld cancelled by Ctrl-C (not counted)", (long long)s->n_interrupted);
    fprintf(f, "\nwall time    %.2f s (first measured send to last end)\n", s->wall_s);
    fprintf(f, "throughput   %.2f req/s, %.1f input tok/s, %.1f output tok/s", s->req_per_s,
            s->in_tok_per_s, s->out_tok_per_s);
    if (s->cached_tokens) fprintf(f, " (prefix cache: %lld of %lld prompt tokens)",
                                  (long long)s->cached_tokens, (long long)s->in_tokens);
    fprintf(f, "\n\n  %-14s %9s %9s %9s %9s %9s %9s\n", "OK requests", "mean", "p50", "p90",
            "p95", "p99", "max");
    dist_row(f, "TTFT (ms)", &s->ttft, 2);
    dist_row(f, "TPOT (ms)", &s->tpot, 3);
    dist_row(f, "ITL (ms)", &s->itl, 3);
    dist_row(f, "E2E (ms)", &s->e2e, 1);
    dist_row(f, "output tokens", &s->out_len, 1);
    if (s->lag.n) fprintf(f, "  client lag (send - schedule): p99 %.2f ms, max %.2f ms%s\n",
                          s->lag.p99, s->lag.max,
                          s->lag.p99 > 5 ? "  (the client fell behind: rates are not exact)" : "");
    fprintf(f, "\nSLO          %s; target %.1f%% of requests\n", slo, 100 * in->slo.attainment);
    fprintf(f, "attainment   %.1f%% met the SLO (TTFT alone %.1f%%, TPOT alone %.1f%%): %s; "
               "%.2f req/s within the SLO\n", 100 * s->attained, 100 * s->attained_ttft,
            100 * s->attained_tpot, s->pass ? "PASS" : "FAIL", s->met_per_s);
    if (in->find_goodput) {
        if (!in->goodput_found)
            fprintf(f, "goodput      none: no probed rate met the SLO%s\n",
                    in->interrupted ? " (the search was interrupted)" : "");
        else if (in->goodput_bracketed)
            fprintf(f, "goodput      %.3f req/s (highest rate meeting the SLO; %.3f req/s did not)\n",
                    in->goodput_rps, in->goodput_fail_rps);
        else if (in->interrupted)
            fprintf(f, "goodput      >= %.3f req/s (the search was interrupted)\n", in->goodput_rps);
        else
            fprintf(f, "goodput      >= %.3f req/s (every probed rate met the SLO; raise "
                       "--max-rate)\n", in->goodput_rps);
    }
    fflush(f);
}

/* ---- JSON ---- */

static void jnum(FILE *f, double v)
{
    if (isnan(v) || isinf(v)) fputs("null", f);
    else fprintf(f, "%.6g", v);
}

static void jstr(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
        else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}

static void jdist(FILE *f, const char *name, const bench_dist *d)
{
    fprintf(f, "\"%s\": {\"n\": %lld, \"mean\": ", name, (long long)d->n);
    jnum(f, d->mean);
    const double v[] = {d->min, d->p50, d->p90, d->p95, d->p99, d->max};
    const char *k[] = {"min", "p50", "p90", "p95", "p99", "max"};
    for (int i = 0; i < 6; i++) {
        fprintf(f, ", \"%s\": ", k[i]);
        jnum(f, v[i]);
    }
    fputc('}', f);
}

static void jsummary(FILE *f, const bench_summary *s)
{
    fprintf(f, "{\"rate_rps\": ");
    jnum(f, s->rate);
    fprintf(f, ", \"requests\": %lld, \"ok\": %lld, \"errors\": %lld, \"interrupted\": %lld, "
               "\"errors_by_code\": {", (long long)s->n, (long long)s->n_ok,
            (long long)s->n_errors, (long long)s->n_interrupted);
    bool first = true;
    for (int c = 1; c < BENCH_N_CODES; c++)
        if (s->errors_by_code[c]) {
            fprintf(f, "%s\"%s\": %lld", first ? "" : ", ", rpc_status_name(c),
                    (long long)s->errors_by_code[c]);
            first = false;
        }
    fprintf(f, "}, \"wall_s\": ");
    jnum(f, s->wall_s);
    fprintf(f, ", \"throughput\": {\"requests_per_s\": ");
    jnum(f, s->req_per_s);
    fprintf(f, ", \"input_tokens_per_s\": ");
    jnum(f, s->in_tok_per_s);
    fprintf(f, ", \"output_tokens_per_s\": ");
    jnum(f, s->out_tok_per_s);
    fprintf(f, "}, \"input_tokens\": %lld, \"output_tokens\": %lld, \"cached_prompt_tokens\": %lld,\n    ",
            (long long)s->in_tokens, (long long)s->out_tokens, (long long)s->cached_tokens);
    jdist(f, "ttft_ms", &s->ttft);
    fprintf(f, ",\n    ");
    jdist(f, "tpot_ms", &s->tpot);
    fprintf(f, ",\n    ");
    jdist(f, "itl_ms", &s->itl);
    fprintf(f, ",\n    ");
    jdist(f, "e2e_ms", &s->e2e);
    fprintf(f, ",\n    ");
    jdist(f, "output_len", &s->out_len);
    fprintf(f, ",\n    ");
    jdist(f, "client_lag_ms", &s->lag);
    fprintf(f, ",\n    \"slo_met\": %lld, \"slo_attainment\": ", (long long)s->n_met);
    jnum(f, s->attained);
    fprintf(f, ", \"slo_attainment_ttft\": ");
    jnum(f, s->attained_ttft);
    fprintf(f, ", \"slo_attainment_tpot\": ");
    jnum(f, s->attained_tpot);
    fprintf(f, ", \"slo_met_per_s\": ");
    jnum(f, s->met_per_s);
    fprintf(f, ", \"pass\": %s}", s->pass ? "true" : "false");
}

int bench_write_json(const char *path, const bench_report_info *in, const bench_probe *probes,
                     int n_probes, char *err)
{
    FILE *f = fopen(path, "w");
    if (!f) return pd_errf(err, PD_EIO, "cannot write '%s': %s", path, strerror(errno));
    fprintf(f, "{\"tool\": \"pdserve-bench\", \"target\": ");
    jstr(f, in->target);
    fprintf(f, ", \"model\": {\"name\": ");
    jstr(f, in->model_name);
    fprintf(f, ", \"vocab_size\": %u, \"max_model_len\": %u},\n \"workload\": ", in->vocab_size,
            in->max_model_len);
    jstr(f, in->workload_desc);
    fprintf(f, ", \"arrivals\": ");
    jstr(f, in->arrival_desc);
    fprintf(f, ",\n \"slo\": {\"ttft_ms\": ");
    jnum(f, in->slo.ttft_ms > 0 ? in->slo.ttft_ms : NAN);
    fprintf(f, ", \"tpot_ms\": ");
    jnum(f, in->slo.tpot_ms > 0 ? in->slo.tpot_ms : NAN);
    fprintf(f, ", \"attainment\": ");
    jnum(f, in->slo.attainment);
    fprintf(f, "},\n \"interrupted\": %s, \"find_goodput\": %s,\n \"goodput\": ",
            in->interrupted ? "true" : "false", in->find_goodput ? "true" : "false");
    if (!in->find_goodput) {
        fputs("null", f);
    } else {
        fprintf(f, "{\"found\": %s, \"rate_rps\": ", in->goodput_found ? "true" : "false");
        jnum(f, in->goodput_found ? in->goodput_rps : NAN);
        fprintf(f, ", \"bracketed\": %s, \"lowest_failing_rate_rps\": ",
                in->goodput_bracketed ? "true" : "false");
        jnum(f, in->goodput_bracketed ? in->goodput_fail_rps : NAN);
        fputc('}', f);
    }
    fprintf(f, ",\n \"best_run\": %d,\n \"runs\": [", in->best);
    for (int i = 0; i < n_probes; i++) {
        fprintf(f, "%s\n  ", i ? "," : "");
        jsummary(f, &probes[i].sum);
    }
    fprintf(f, "\n ]\n}\n");
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) return pd_errf(err, PD_EIO, "error writing '%s'", path);
    return 0;
}

/* ---- CSV ---- */

static void cnum(FILE *f, double v, int prec)
{
    if (!isnan(v)) fprintf(f, "%.*f", prec, v);
}

int bench_write_csv(const char *path, const bench_probe *probes, int n_probes,
                    const bench_slo *slo, char *err)
{
    FILE *f = fopen(path, "w");
    if (!f) return pd_errf(err, PD_EIO, "cannot write '%s': %s", path, strerror(errno));
    fprintf(f, "run,rate_rps,index,warmup,interrupted,status,finish_reason,input_tokens,"
               "output_tokens,cached_tokens,ttft_ms,tpot_ms,e2e_ms,sched_ms,start_ms,slo_met\n");
    for (int i = 0; i < n_probes; i++) {
        const bench_run *r = &probes[i].run;
        for (int64_t k = 0; k < r->n_reqs; k++) {
            const bench_req *q = &r->reqs[k];
            fprintf(f, "%d,%.6g,%lld,%d,%d,%s,%d,%d,%d,%d,", i, r->rate, (long long)q->index,
                    q->warmup, q->interrupted, bench_status_name(q->status), q->finish_reason,
                    q->n_in, q->n_out, q->n_cached);
            cnum(f, bench_req_ttft_ms(q), 3);
            fputc(',', f);
            cnum(f, bench_req_tpot_ms(q), 4);
            fputc(',', f);
            cnum(f, bench_req_e2e_ms(q), 3);
            fprintf(f, ",%.3f,%.3f,%d\n", (double)q->t_sched_us / 1000.0,
                    (double)q->t_start_us / 1000.0, bench_req_meets(q, slo, NULL, NULL));
        }
    }
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) return pd_errf(err, PD_EIO, "error writing '%s'", path);
    return 0;
}
