/* cpu_moe.c -- The CPU backend's mixture-of-experts ops: moe_route (softmax over the experts,
 * the top k, the choices grouped by expert) and moe_combine (the experts' outputs weighted
 * and summed back into token order). The experts' products themselves are the backend's
 * gather_rows and linear_fused, called by engine/moe.c.
 *
 * Which k experts a row takes when probabilities tie: the references (transformers on the
 * CPU) take torch.topk's choice, and torch's CPU topk is libstdc++'s std::nth_element (or,
 * when k * 64 <= n, std::partial_sort) over (probability, index) pairs laid out in index
 * order, followed by std::sort of the first k - 1. Neither is stable, so the expert a tie
 * goes to depends on every comparison and swap those algorithms make: tie_select below
 * replays them step for step (introselect with a median-of-three pivot and an unguarded
 * partition, insertion sort under four elements, heap select at the depth limit), so that a
 * tie goes where it went in the references. The choice among distinct probabilities is the
 * plain top k either way. */
#include "kernels/cpu/cpu_backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

/* A candidate expert: its probability and index. */
typedef struct {
    double p;
    int32_t e;
} cand;

/* torch's "largest" comparator: x goes before y (NaN first, as numpy sorts). */
static bool before(const cand *x, const cand *y)
{
    return (isnan(x->p) && !isnan(y->p)) || x->p > y->p;
}

static void swap_c(cand *c, int32_t i, int32_t j)
{
    const cand t = c[i];
    c[i] = c[j];
    c[j] = t;
}

/* libstdc++'s __insertion_sort of c[f, l). */
static void insertion_sort(cand *c, int32_t f, int32_t l)
{
    for (int32_t i = f + 1; i < l; i++) {
        const cand v = c[i];
        if (before(&v, &c[f])) {
            memmove(&c[f + 1], &c[f], (size_t)(i - f) * sizeof *c);
            c[f] = v;
        } else {
            int32_t j = i;
            for (; before(&v, &c[j - 1]); j--) c[j] = c[j - 1];
            c[j] = v;
        }
    }
}

/* __move_median_to_first: the median of c[a], c[b], c[d] swapped into c[r]. */
static void median_to_first(cand *c, int32_t r, int32_t a, int32_t b, int32_t d)
{
    int32_t m;
    if (before(&c[a], &c[b]))
        m = before(&c[b], &c[d]) ? b : before(&c[a], &c[d]) ? d : a;
    else
        m = before(&c[a], &c[d]) ? a : before(&c[b], &c[d]) ? d : b;
    swap_c(c, r, m);
}

/* __unguarded_partition of c[f, l) around c[pivot]. */
static int32_t unguarded_partition(cand *c, int32_t f, int32_t l, int32_t pivot)
{
    for (;;) {
        while (before(&c[f], &c[pivot])) f++;
        l--;
        while (before(&c[pivot], &c[l])) l--;
        if (!(f < l)) return f;
        swap_c(c, f, l);
        f++;
    }
}

/* The heap of h[0, len) as libstdc++ keeps it: __push_heap, __adjust_heap, __make_heap,
 * __pop_heap. */
static void push_heap(cand *h, int32_t hole, int32_t top, cand v)
{
    int32_t parent = (hole - 1) / 2;
    while (hole > top && before(&h[parent], &v)) {
        h[hole] = h[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    h[hole] = v;
}

static void adjust_heap(cand *h, int32_t hole, int32_t len, cand v)
{
    const int32_t top = hole;
    int32_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(&h[child], &h[child - 1])) child--;
        h[hole] = h[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        h[hole] = h[child - 1];
        hole = child - 1;
    }
    push_heap(h, hole, top, v);
}

static void make_heap(cand *h, int32_t len)
{
    for (int32_t parent = (len - 2) / 2; len >= 2; parent--) {
        adjust_heap(h, parent, len, h[parent]);
        if (parent == 0) return;
    }
}

static void pop_heap(cand *h, int32_t len, int32_t result)
{
    const cand v = h[result];
    h[result] = h[0];
    adjust_heap(h, 0, len, v);
}

/* __heap_select: the mid best of h[0, len) into h[0, mid), a heap. */
static void heap_select(cand *h, int32_t mid, int32_t len)
{
    make_heap(h, mid);
    for (int32_t i = mid; i < len; i++)
        if (before(&h[i], &h[0])) pop_heap(h, mid, i);
}

static int32_t floor_log2(int32_t n)
{
    int32_t k = 0;
    while (n > 1) {
        n >>= 1;
        k++;
    }
    return k;
}

/* std::nth_element(c, c + nth, c + n) (introselect). */
static void nth_element(cand *c, int32_t n, int32_t nth)
{
    int32_t f = 0, l = n, depth = 2 * floor_log2(n);
    while (l - f > 3) {
        if (depth == 0) {
            heap_select(c + f, nth + 1 - f, l - f);
            swap_c(c, f, nth);
            return;
        }
        depth--;
        median_to_first(c, f, f + 1, f + (l - f) / 2, l - 1);
        const int32_t cut = unguarded_partition(c, f + 1, l, f);
        if (cut <= nth) f = cut;
        else l = cut;
    }
    insertion_sort(c, f, l);
}

/* The k best of c[0, n) into c[0, k), most probable first, as torch's CPU topk arranges them
 * (the file's header). std::sort of up to 16 elements is an insertion sort; beyond that
 * (k > 17) the order among equal probabilities may differ from torch's, the set not. */
static void tie_select(cand *c, int32_t n, int32_t k)
{
    if ((int64_t)k * 64 <= n) { /* std::partial_sort: heap select, then sort_heap */
        heap_select(c, k, n);
        for (int32_t len = k; len > 1;) {
            len--;
            pop_heap(c, len, len);
        }
        return;
    }
    nth_element(c, n, k - 1);
    insertion_sort(c, 0, k - 1);
}

/* Grows the context's routing scratch to hold bytes. */
static int moe_scratch(pd_cpu_ctx *x, size_t bytes)
{
    if (bytes <= x->moe_cap) return 0;
    void *p = realloc(x->moe, bytes);
    if (!p) return PD_ENOMEM;
    x->moe = p;
    x->moe_cap = bytes;
    return 0;
}

/* Row t's k choices: softmax in double over the experts, the top k, their weights. */
static void route_row(const float *lg, int32_t E, int32_t k, bool renorm, cand *c, int32_t *ids,
                      float *w)
{
    double mx = lg[0], sum = 0;
    for (int32_t e = 1; e < E; e++)
        if (lg[e] > mx) mx = lg[e];
    for (int32_t e = 0; e < E; e++) {
        c[e].p = exp((double)lg[e] - mx);
        c[e].e = e;
        sum += c[e].p;
    }
    for (int32_t e = 0; e < E; e++) c[e].p /= sum;
    tie_select(c, E, k);
    double top = 0;
    for (int32_t j = 0; j < k; j++) top += c[j].p;
    for (int32_t j = 0; j < k; j++) {
        ids[j] = c[j].e;
        w[j] = (float)(renorm ? c[j].p / top : c[j].p);
    }
}

int pd_cpu__moe_route(void *ctx, const pd_moe_route_args *a)
{
    if (!a || a->n < 0 || a->n_experts < 1 || a->k < 1 || a->k > a->n_experts || !a->offsets ||
        (a->n > 0 && (!a->logits || !a->ids || !a->weights || !a->rows || !a->pos)))
        return PD_EINVAL;
    const int32_t n = a->n, E = a->n_experts, k = a->k;
    pd_cpu_ctx *x = ctx;
    if (moe_scratch(x, (size_t)E * (sizeof(cand) + sizeof(int32_t))) < 0) return PD_ENOMEM;
    cand *c = x->moe;
    int32_t *cursor = (int32_t *)(c + E);
    for (int32_t t = 0; t < n; t++)
        route_row((const float *)a->logits + (size_t)t * E, E, k, a->renormalize, c,
                  a->ids + (size_t)t * k, a->weights + (size_t)t * k);
    /* grouped by expert (a counting sort; rows ascending within an expert) */
    memset(a->offsets, 0, (size_t)(E + 1) * sizeof *a->offsets);
    for (int64_t i = 0; i < (int64_t)n * k; i++) a->offsets[a->ids[i] + 1]++;
    for (int32_t e = 0; e < E; e++) {
        a->offsets[e + 1] += a->offsets[e];
        cursor[e] = a->offsets[e];
    }
    for (int32_t t = 0; t < n; t++)
        for (int32_t j = 0; j < k; j++) {
            const int32_t p = cursor[a->ids[(size_t)t * k + j]]++;
            a->rows[p] = t;
            a->pos[(size_t)t * k + j] = p;
        }
    return 0;
}

int pd_cpu__moe_combine(void *ctx, const pd_moe_combine_args *a)
{
    (void)ctx;
    if (!a || a->n < 0 || a->k < 1 || a->dim < 1 ||
        (a->n > 0 && (!a->y || !a->pos || !a->weights || !a->out)))
        return PD_EINVAL;
    const int64_t n_choices = (int64_t)a->n * a->k;
    for (int64_t i = 0; i < n_choices; i++)
        if (a->pos[i] < 0 || a->pos[i] >= n_choices) return PD_EINVAL;
    const float *y = a->y;
    for (int32_t t = 0; t < a->n; t++) {
        float *o = (float *)a->out + (size_t)t * a->dim;
        const int32_t *pos = a->pos + (size_t)t * a->k;
        const float *w = a->weights + (size_t)t * a->k;
        for (int32_t d = 0; d < a->dim; d++) {
            /* the experts' sum first, then the residual: as transformers adds the block's
             * output to the stream */
            double s = 0;
            for (int32_t j = 0; j < a->k; j++) s += (double)w[j] * y[(size_t)pos[j] * a->dim + d];
            o[d] = a->accumulate ? o[d] + (float)s : (float)s;
        }
    }
    return 0;
}
