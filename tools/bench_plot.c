/* bench_plot.c -- pdserve-bench's plots as self-written SVG (no plotting dependency): SLO
 * attainment against the offered rate (one point per probe, with the target and the goodput
 * marked) and the CDFs of TTFT and TPOT (one line per probe, with the SLO marked). */
#include "tools/bench.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/error.h"

#define W 760
#define H 460
#define ML 72   /* margins, pixels */
#define MR 190
#define MT 44
#define MB 58

static const char *const palette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                      "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
#define N_PALETTE ((int)(sizeof palette / sizeof palette[0]))

typedef struct {
    double x0, x1, y0, y1;      /* data range */
} frame;

static double px(const frame *fr, double x)
{
    return ML + (x - fr->x0) / (fr->x1 - fr->x0) * (W - ML - MR);
}

static double py(const frame *fr, double y)
{
    return H - MB - (y - fr->y0) / (fr->y1 - fr->y0) * (H - MT - MB);
}

/* A round tick step (1, 2 or 5 times a power of ten) giving about n ticks over range. */
static double nice_step(double range, int n)
{
    double raw = range / n, p = pow(10, floor(log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

static void text(FILE *f, double x, double y, const char *anchor, int size, const char *color,
                 const char *s)
{
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" font-size=\"%d\" fill=\"%s\">",
            x, y, anchor, size, color);
    for (const char *p = s; *p; p++) {
        if (*p == '<') fputs("&lt;", f);
        else if (*p == '>') fputs("&gt;", f);
        else if (*p == '&') fputs("&amp;", f);
        else fputc(*p, f);
    }
    fputs("</text>\n", f);
}

/* Opens the document and draws the axes, grid, ticks and labels. */
static void axes(FILE *f, const frame *fr, const char *title, const char *xlabel,
                 const char *ylabel, double yscale)
{
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n"
               "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H, W, H);
    text(f, (ML + W - MR) / 2.0, 24, "middle", 15, "black", title);
    char buf[64];
    double sx = nice_step(fr->x1 - fr->x0, 8), sy = nice_step(fr->y1 - fr->y0, 5);
    for (double x = ceil(fr->x0 / sx) * sx; x <= fr->x1 + 1e-9 * sx; x += sx) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#e0e0e0\"/>\n",
                px(fr, x), MT, px(fr, x), H - MB);
        snprintf(buf, sizeof buf, "%g", fabs(x) < 1e-12 ? 0 : x);
        text(f, px(fr, x), H - MB + 16, "middle", 11, "black", buf);
    }
    for (double y = ceil(fr->y0 / sy) * sy; y <= fr->y1 + 1e-9 * sy; y += sy) {
        fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#e0e0e0\"/>\n", ML,
                py(fr, y), W - MR, py(fr, y));
        snprintf(buf, sizeof buf, "%g", y * yscale);
        text(f, ML - 6, py(fr, y) + 4, "end", 11, "black", buf);
    }
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"black\"/>\n",
            ML, MT, W - ML - MR, H - MT - MB);
    text(f, (ML + W - MR) / 2.0, H - 16, "middle", 12, "black", xlabel);
    fprintf(f, "<text x=\"18\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"12\" "
               "transform=\"rotate(-90 18 %.1f)\">%s</text>\n", (MT + H - MB) / 2.0,
            (MT + H - MB) / 2.0, ylabel);
}

static void hline(FILE *f, const frame *fr, double y, const char *color, const char *label)
{
    fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"%s\" "
               "stroke-dasharray=\"6 4\"/>\n", ML, py(fr, y), W - MR, py(fr, y), color);
    text(f, W - MR - 6, py(fr, y) - 5, "end", 11, color, label);
}

static void vline(FILE *f, const frame *fr, double x, const char *color, const char *label)
{
    if (x < fr->x0 || x > fr->x1) return;
    fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"%s\" "
               "stroke-dasharray=\"6 4\"/>\n", px(fr, x), MT, px(fr, x), H - MB, color);
    bool right = px(fr, x) > (ML + W - MR) / 2.0; /* keep the label inside the frame */
    text(f, px(fr, x) + (right ? -4 : 4), MT + 14, right ? "end" : "start", 11, color, label);
}

static void legend(FILE *f, int i, const char *color, const char *dash, const char *label)
{
    double y = MT + 10 + 18 * i;
    fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s%s%s/>\n",
            W - MR + 12, y, W - MR + 36, y, color, dash ? " stroke-dasharray=\"" : "",
            dash ? dash : "", dash ? "\"" : "");
    text(f, W - MR + 42, y + 4, "start", 11, "black", label);
}

static int cmp_idx_rate(const void *a, const void *b, void *ctx)
{
    const bench_probe *p = ctx;
    double x = p[*(const int *)a].sum.rate, y = p[*(const int *)b].sum.rate;
    return x < y ? -1 : x > y;
}

/* Probe indexes sorted by rate (caller frees). */
static int *by_rate(const bench_probe *probes, int n)
{
    int *idx = malloc((size_t)(n > 0 ? n : 1) * sizeof *idx);
    if (!idx) return NULL;
    for (int i = 0; i < n; i++) idx[i] = i;
    qsort_r(idx, (size_t)n, sizeof *idx, cmp_idx_rate, (void *)probes);
    return idx;
}

static void run_label(const bench_probe *p, char *buf, size_t len)
{
    if (p->sum.rate > 0) snprintf(buf, len, "%.3g req/s", p->sum.rate);
    else snprintf(buf, len, "closed loop");
}

static int plot_attainment(FILE *f, const bench_report_info *in, const bench_probe *pr, int n)
{
    int *idx = by_rate(pr, n);
    if (!idx) return PD_ENOMEM;
    double xmax = 0, amin = in->slo.attainment; /* the y axis starts below every point */
    for (int i = 0; i < n; i++) {
        xmax = fmax(xmax, pr[i].sum.rate);
        amin = fmin(amin, fmin(pr[i].sum.attained, fmin(pr[i].sum.attained_ttft, pr[i].sum.attained_tpot)));
    }
    frame fr = {0, xmax > 0 ? xmax * 1.08 : 1, fmax(0, floor(amin * 10 - 1) / 10), 1.0};
    axes(f, &fr, "SLO attainment vs offered rate", "offered rate (requests/s)",
         "requests meeting the SLO (%)", 100);
    char buf[96];
    snprintf(buf, sizeof buf, "target %.0f%%", 100 * in->slo.attainment);
    hline(f, &fr, in->slo.attainment, "#555555", buf);
    if (in->find_goodput && in->goodput_found) {
        snprintf(buf, sizeof buf, "goodput %.3g req/s", in->goodput_rps);
        vline(f, &fr, in->goodput_rps, "#2ca02c", buf);
    }
    struct { const char *name, *color, *dash; int which; } series[] = {
        {"both SLOs", "#1f77b4", NULL, 0},
        {"TTFT SLO alone", "#ff7f0e", "5 3", 1},
        {"TPOT SLO alone", "#9467bd", "2 3", 2},
    };
    for (int s = 0; s < 3; s++) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\"%s%s%s points=\"",
                series[s].color, s ? "1.5" : "2.5", series[s].dash ? " stroke-dasharray=\"" : "",
                series[s].dash ? series[s].dash : "", series[s].dash ? "\"" : "");
        for (int k = 0; k < n; k++) {
            const bench_summary *m = &pr[idx[k]].sum;
            double a = s == 0 ? m->attained : s == 1 ? m->attained_ttft : m->attained_tpot;
            if (m->rate > 0) fprintf(f, "%.1f,%.1f ", px(&fr, m->rate), py(&fr, a));
        }
        fputs("\"/>\n", f);
        legend(f, s, series[s].color, series[s].dash, series[s].name);
    }
    for (int k = 0; k < n; k++) {
        const bench_summary *m = &pr[idx[k]].sum;
        if (m->rate <= 0) continue;
        fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4.5\" fill=\"%s\" stroke=\"black\"/>\n",
                px(&fr, m->rate), py(&fr, m->attained), m->pass ? "#2ca02c" : "#d62728");
    }
    legend(f, 3, "#2ca02c", "1 0", "probe passed");
    legend(f, 4, "#d62728", "1 0", "probe failed");
    fputs("</svg>\n", f);
    free(idx);
    return 0;
}

/* The CDF of one metric (0 = TTFT, 1 = TPOT) for every probe. */
static int plot_cdf(FILE *f, const bench_report_info *in, const bench_probe *pr, int n, int which)
{
    int *idx = by_rate(pr, n);
    if (!idx) return PD_ENOMEM;
    double slo = which == 0 ? in->slo.ttft_ms : in->slo.tpot_ms, xmax = 0;
    for (int i = 0; i < n; i++) {
        const bench_dist *d = which == 0 ? &pr[i].sum.ttft : &pr[i].sum.tpot;
        if (d->n) xmax = fmax(xmax, d->p99);
    }
    if (slo > 0) xmax = fmax(xmax, slo * 1.25);
    if (!(xmax > 0)) xmax = 1;
    frame fr = {0, xmax, 0, 1.0};
    const char *name = which == 0 ? "TTFT" : "TPOT";
    char title[96], xlabel[96], buf[96];
    snprintf(title, sizeof title, "%s CDF per offered rate (OK requests; x axis to the largest p99)", name);
    snprintf(xlabel, sizeof xlabel, "%s (ms)", name);
    axes(f, &fr, title, xlabel, "share of requests (%)", 100);
    hline(f, &fr, in->slo.attainment, "#555555", "target share");
    if (slo > 0) {
        snprintf(buf, sizeof buf, "SLO %g ms", slo);
        vline(f, &fr, slo, "#d62728", buf);
    }
    int shown = 0;
    for (int k = 0; k < n; k++) {
        const bench_probe *p = &pr[idx[k]];
        const double *v = which == 0 ? p->ttft_sorted : p->tpot_sorted;
        int64_t m = which == 0 ? p->n_ttft : p->n_tpot;
        if (m == 0 || !v) continue;
        const char *color = palette[shown % N_PALETTE];
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\" points=\"", color);
        int64_t step = m > 600 ? m / 600 : 1;
        double prev_y = 0;
        fprintf(f, "%.1f,%.1f ", px(&fr, fmin(v[0], xmax)), py(&fr, 0));
        for (int64_t i = step - 1;; i += step) { /* a staircase, clipped at xmax */
            if (i >= m) i = m - 1;
            if (v[i] > xmax) {
                fprintf(f, "%.1f,%.1f", px(&fr, xmax), py(&fr, prev_y));
                break;
            }
            double y = (double)(i + 1) / (double)m;
            fprintf(f, "%.1f,%.1f %.1f,%.1f ", px(&fr, v[i]), py(&fr, prev_y), px(&fr, v[i]), py(&fr, y));
            prev_y = y;
            if (i == m - 1) break;
        }
        fputs("\"/>\n", f);
        run_label(p, buf, sizeof buf);
        if (shown < 20) legend(f, shown, color, NULL, buf);
        shown++;
    }
    if (shown == 0) text(f, (ML + W - MR) / 2.0, H / 2.0, "middle", 13, "#777777", "no data");
    fputs("</svg>\n", f);
    free(idx);
    return 0;
}

/* mkdir -p. Returns 0 or -1 with errno set. */
static int make_dirs(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(path, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(path, 0755) != 0 && errno != EEXIST) return -1;
    return 0;
}

int bench_write_plots(const char *dir, const bench_report_info *in, const bench_probe *probes,
                      int n_probes, char *err)
{
    if (make_dirs(dir) != 0)
        return pd_errf(err, PD_EIO, "cannot create plot folder '%s': %s", dir, strerror(errno));
    static const char *const names[] = {"slo_attainment_vs_rate.svg", "ttft_cdf.svg", "tpot_cdf.svg"};
    for (int i = 0; i < 3; i++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        FILE *f = fopen(path, "w");
        if (!f) return pd_errf(err, PD_EIO, "cannot write '%s': %s", path, strerror(errno));
        int rc = i == 0 ? plot_attainment(f, in, probes, n_probes)
                        : plot_cdf(f, in, probes, n_probes, i - 1);
        int bad = ferror(f);
        if (fclose(f) != 0 || bad || rc != 0)
            return pd_errf(err, rc ? rc : PD_EIO, "error writing '%s'", path);
    }
    return 0;
}
