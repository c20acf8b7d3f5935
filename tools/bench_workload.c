/* bench_workload.c -- pdserve-bench's random numbers, arrival processes and workloads: random
 * token-id prompts, a JSONL dataset of text prompts, and groups of prompts sharing a prefix
 * (for the prefix cache). Everything is reproducible from a seed. */
#include "tools/bench.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

/* ---- random numbers ---- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void bench_rng_seed(bench_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t bench_rng_next(bench_rng *r)
{
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double bench_rng_uniform(bench_rng *r)
{
    return (double)(bench_rng_next(r) >> 11) * 0x1.0p-53;
}

int64_t bench_rng_range(bench_rng *r, int64_t lo, int64_t hi)
{
    if (hi <= lo) return lo;
    return lo + (int64_t)(bench_rng_next(r) % (uint64_t)(hi - lo + 1));
}

/* ---- arrivals ---- */

const char *bench_arrival_name(bench_arrival a)
{
    switch (a) {
    case BENCH_ARRIVAL_POISSON: return "poisson";
    case BENCH_ARRIVAL_GAMMA: return "gamma";
    case BENCH_ARRIVAL_CONSTANT: return "constant";
    case BENCH_ARRIVAL_CLOSED: return "closed";
    }
    return "?";
}

int bench_arrival_parse(const char *s, bench_arrival *out)
{
    static const bench_arrival all[] = {BENCH_ARRIVAL_POISSON, BENCH_ARRIVAL_GAMMA,
                                        BENCH_ARRIVAL_CONSTANT, BENCH_ARRIVAL_CLOSED};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (!strcmp(s, bench_arrival_name(all[i]))) {
            *out = all[i];
            return 0;
        }
    return PD_EINVAL;
}

static double std_normal(bench_rng *r)
{
    double u1 = 1.0 - bench_rng_uniform(r), u2 = bench_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

/* Gamma(shape k, scale 1) by Marsaglia and Tsang; k < 1 through Gamma(k + 1) * U^(1/k). */
static double gamma_draw(double k, bench_rng *r)
{
    if (k < 1.0) return gamma_draw(k + 1.0, r) * pow(1.0 - bench_rng_uniform(r), 1.0 / k);
    double d = k - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = std_normal(r), v = 1.0 + c * x;
        if (v <= 0) continue;
        v = v * v * v;
        double u = 1.0 - bench_rng_uniform(r);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v)) return d * v;
    }
}

double bench_arrival_gap_s(bench_arrival a, double rate, double burstiness, bench_rng *r)
{
    switch (a) {
    case BENCH_ARRIVAL_POISSON: return -log(1.0 - bench_rng_uniform(r)) / rate;
    case BENCH_ARRIVAL_GAMMA: return gamma_draw(burstiness, r) / (burstiness * rate);
    case BENCH_ARRIVAL_CONSTANT: return 1.0 / rate;
    case BENCH_ARRIVAL_CLOSED: return 0;
    }
    return 0;
}

/* ---- dataset ---- */

void bench_dataset_free(bench_dataset *d)
{
    if (!d) return;
    for (int64_t i = 0; i < d->n; i++) free(d->e[i].prompt);
    free(d->e);
    d->e = NULL;
    d->n = 0;
}

/* Parses one line into e. Returns 0, 1 (blank line), PD_EFORMAT (err says why), PD_ENOMEM. */
static int parse_line(const char *line, bench_dataset_entry *e, char *why)
{
    const char *p = line;
    while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
    if (!*p) return 1;
    json_error_t je;
    json_t *o = json_loads(line, 0, &je);
    if (!o) return pd_errf(why, PD_EFORMAT, "not JSON (%s, column %d)", je.text, je.column);
    int rc = 0;
    json_t *pr = json_object_get(o, "prompt");
    json_t *ol = json_object_get(o, "output_len");
    if (!ol) ol = json_object_get(o, "expected_output_len");
    if (!json_is_object(o)) {
        rc = pd_errf(why, PD_EFORMAT, "not a JSON object");
    } else if (!json_is_string(pr) || json_string_length(pr) == 0) {
        rc = pd_errf(why, PD_EFORMAT, "\"prompt\" must be a non-empty string");
    } else if (!json_is_integer(ol) || json_integer_value(ol) < 1 ||
               json_integer_value(ol) > 1000000) {
        rc = pd_errf(why, PD_EFORMAT, "\"output_len\" must be an integer in [1, 1000000]");
    } else {
        e->prompt = strdup(json_string_value(pr));
        e->output_len = (int32_t)json_integer_value(ol);
        if (!e->prompt) rc = pd_errf(why, PD_ENOMEM, "out of memory");
    }
    json_decref(o);
    return rc;
}

int bench_dataset_load(const char *path, bench_dataset *out, char *err)
{
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "r");
    if (!f) return pd_errf(err, PD_EIO, "cannot read dataset '%s': %s", path, strerror(errno));
    char *line = NULL, why[PD_ERR_LEN];
    size_t cap = 0;
    int64_t lineno = 0, cap_e = 0;
    int rc = 0;
    while (getline(&line, &cap, f) >= 0) {
        lineno++;
        bench_dataset_entry e = {0};
        int r = parse_line(line, &e, why);
        if (r == 1) continue;
        if (r < 0) {
            rc = pd_errf(err, r, "dataset %s, line %lld: %s", path, (long long)lineno, why);
            break;
        }
        if (out->n == cap_e) {
            int64_t nc = cap_e ? cap_e * 2 : 64;
            bench_dataset_entry *ne = realloc(out->e, (size_t)nc * sizeof *ne);
            if (!ne) {
                free(e.prompt);
                rc = pd_errf(err, PD_ENOMEM, "out of memory");
                break;
            }
            out->e = ne;
            cap_e = nc;
        }
        out->e[out->n++] = e;
    }
    if (rc == 0 && ferror(f)) rc = pd_errf(err, PD_EIO, "error reading dataset '%s'", path);
    if (rc == 0 && out->n == 0)
        rc = pd_errf(err, PD_EFORMAT, "dataset '%s' has no entries", path);
    free(line);
    fclose(f);
    if (rc != 0) bench_dataset_free(out);
    return rc;
}

/* ---- workloads ---- */

struct bench_workload {
    bench_workload_params p;
    bench_rng rng;
    uint32_t *ids;              /* [prefix_len + input_max] the current prompt */
    uint32_t *prefixes;         /* [prefix_groups * prefix_len] shared-prefix groups */
    int64_t *order;             /* [dataset->n] the current pass's permutation */
    int64_t pos;                /* next entry of order */
};

void bench_workload_destroy(bench_workload *w)
{
    if (!w) return;
    free(w->ids);
    free(w->prefixes);
    free(w->order);
    free(w);
}

static uint32_t random_id(bench_workload *w)
{
    return (uint32_t)bench_rng_range(&w->rng, w->p.token_lo, w->p.token_hi);
}

void bench_workload_reset(bench_workload *w, uint64_t seed)
{
    bench_rng_seed(&w->rng, seed);
    if (w->prefixes)
        for (int64_t i = 0; i < (int64_t)w->p.prefix_groups * w->p.prefix_len; i++)
            w->prefixes[i] = random_id(w);
    w->pos = w->p.dataset ? w->p.dataset->n : 0; /* a shuffle at the first request */
}

int bench_workload_create(const bench_workload_params *p, bench_workload **out, char *err)
{
    *out = NULL;
    if (p->kind == BENCH_WL_DATASET && (!p->dataset || p->dataset->n == 0))
        return pd_errf(err, PD_EINVAL, "the dataset workload needs a dataset");
    if (p->kind != BENCH_WL_DATASET &&
        (p->input_min < 1 || p->input_max < p->input_min || p->output_min < 1 ||
         p->output_max < p->output_min || p->token_hi < p->token_lo))
        return pd_errf(err, PD_EINVAL, "bad workload lengths or token range");
    if (p->kind == BENCH_WL_SHARED_PREFIX && (p->prefix_groups < 1 || p->prefix_len < 1))
        return pd_errf(err, PD_EINVAL, "the shared-prefix workload needs groups >= 1 and a "
                                       "prefix length >= 1");
    bench_workload *w = calloc(1, sizeof *w);
    if (!w) goto fail;
    w->p = *p;
    if (p->kind != BENCH_WL_DATASET) {
        int64_t n = (int64_t)p->input_max + (p->kind == BENCH_WL_SHARED_PREFIX ? p->prefix_len : 0);
        w->ids = malloc((size_t)n * sizeof *w->ids);
        if (!w->ids) goto fail;
    }
    if (p->kind == BENCH_WL_SHARED_PREFIX) {
        w->prefixes = malloc((size_t)p->prefix_groups * (size_t)p->prefix_len * sizeof *w->prefixes);
        if (!w->prefixes) goto fail;
    }
    if (p->kind == BENCH_WL_DATASET) {
        w->order = malloc((size_t)p->dataset->n * sizeof *w->order);
        if (!w->order) goto fail;
    }
    bench_workload_reset(w, p->seed);
    *out = w;
    return 0;
fail:
    bench_workload_destroy(w);
    return pd_errf(err, PD_ENOMEM, "out of memory");
}

void bench_workload_next(bench_workload *w, bench_request_spec *out)
{
    memset(out, 0, sizeof *out);
    if (w->p.kind == BENCH_WL_DATASET) {
        const bench_dataset *d = w->p.dataset;
        if (w->pos >= d->n) { /* a new pass over the dataset, in a new random order */
            for (int64_t i = 0; i < d->n; i++) w->order[i] = i;
            for (int64_t i = d->n - 1; i > 0; i--) {
                int64_t j = bench_rng_range(&w->rng, 0, i), t = w->order[i];
                w->order[i] = w->order[j];
                w->order[j] = t;
            }
            w->pos = 0;
        }
        const bench_dataset_entry *e = &d->e[w->order[w->pos++]];
        out->prompt = e->prompt;
        out->output_len = e->output_len;
        return;
    }
    int32_t n = 0;
    if (w->p.kind == BENCH_WL_SHARED_PREFIX) {
        int64_t g = bench_rng_range(&w->rng, 0, w->p.prefix_groups - 1);
        memcpy(w->ids, w->prefixes + g * w->p.prefix_len, (size_t)w->p.prefix_len * sizeof *w->ids);
        n = w->p.prefix_len;
    }
    int32_t len = (int32_t)bench_rng_range(&w->rng, w->p.input_min, w->p.input_max);
    for (int32_t i = 0; i < len; i++) w->ids[n++] = random_id(w);
    out->ids = w->ids;
    out->n_ids = n;
    out->output_len = (int32_t)bench_rng_range(&w->rng, w->p.output_min, w->p.output_max);
}
