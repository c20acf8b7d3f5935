/* moe_select.h -- A mixture-of-experts row's choice of its k experts, as torch.topk on the CPU
 * makes it, for every backend's moe_route op (C and CUDA device code alike: one definition, so
 * that the backends resolve equal probabilities identically).
 *
 * Why replayed and not "the lower index first": the references (transformers on the CPU) take
 * torch.topk's choice, and torch's CPU topk is libstdc++'s std::nth_element (or, when
 * k * 64 <= n, std::partial_sort) over (probability, index) pairs laid out in index order,
 * followed by std::sort of the first k - 1. Neither is stable, so the expert a tie goes to
 * depends on every comparison and swap those algorithms make: moe_tie_select replays them
 * step for step (introselect with a median-of-three pivot and an unguarded partition,
 * insertion sort under four elements, heap select at the depth limit). The choice among
 * distinct probabilities is the plain top k either way. Written from the algorithms'
 * descriptions (the C++ standard library's documented behaviour), not from their source. */
#ifndef PD_MOE_SELECT_H
#define PD_MOE_SELECT_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __CUDACC__
#define PD_MOE_FN static __host__ __device__ __forceinline__
#else
#define PD_MOE_FN static inline
#endif

/* A candidate expert: its probability and index. */
typedef struct {
    double p;
    int32_t e;
} pd_moe_cand;

/* torch's "largest" comparator: x goes before y (NaN first, as numpy sorts). */
PD_MOE_FN bool pd_moe_before(const pd_moe_cand *x, const pd_moe_cand *y)
{
    return (isnan(x->p) && !isnan(y->p)) || x->p > y->p;
}

PD_MOE_FN void pd_moe_swap(pd_moe_cand *c, int32_t i, int32_t j)
{
    const pd_moe_cand t = c[i];
    c[i] = c[j];
    c[j] = t;
}

/* __insertion_sort of c[f, l). */
PD_MOE_FN void pd_moe_insertion_sort(pd_moe_cand *c, int32_t f, int32_t l)
{
    for (int32_t i = f + 1; i < l; i++) {
        const pd_moe_cand v = c[i];
        if (pd_moe_before(&v, &c[f])) {
            for (int32_t j = i; j > f; j--) c[j] = c[j - 1];
            c[f] = v;
        } else {
            int32_t j = i;
            for (; pd_moe_before(&v, &c[j - 1]); j--) c[j] = c[j - 1];
            c[j] = v;
        }
    }
}

/* __move_median_to_first: the median of c[a], c[b], c[d] swapped into c[r]. */
PD_MOE_FN void pd_moe_median_to_first(pd_moe_cand *c, int32_t r, int32_t a, int32_t b,
                                      int32_t d)
{
    int32_t m;
    if (pd_moe_before(&c[a], &c[b]))
        m = pd_moe_before(&c[b], &c[d]) ? b : pd_moe_before(&c[a], &c[d]) ? d : a;
    else
        m = pd_moe_before(&c[a], &c[d]) ? a : pd_moe_before(&c[b], &c[d]) ? d : b;
    pd_moe_swap(c, r, m);
}

/* __unguarded_partition of c[f, l) around c[pivot]. */
PD_MOE_FN int32_t pd_moe_partition(pd_moe_cand *c, int32_t f, int32_t l, int32_t pivot)
{
    for (;;) {
        while (pd_moe_before(&c[f], &c[pivot])) f++;
        l--;
        while (pd_moe_before(&c[pivot], &c[l])) l--;
        if (!(f < l)) return f;
        pd_moe_swap(c, f, l);
        f++;
    }
}

/* The heap of h[0, len) as libstdc++ keeps it: __push_heap, __adjust_heap, __make_heap,
 * __pop_heap. */
PD_MOE_FN void pd_moe_push_heap(pd_moe_cand *h, int32_t hole, int32_t top, pd_moe_cand v)
{
    int32_t parent = (hole - 1) / 2;
    while (hole > top && pd_moe_before(&h[parent], &v)) {
        h[hole] = h[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    h[hole] = v;
}

PD_MOE_FN void pd_moe_adjust_heap(pd_moe_cand *h, int32_t hole, int32_t len, pd_moe_cand v)
{
    const int32_t top = hole;
    int32_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (pd_moe_before(&h[child], &h[child - 1])) child--;
        h[hole] = h[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        h[hole] = h[child - 1];
        hole = child - 1;
    }
    pd_moe_push_heap(h, hole, top, v);
}

PD_MOE_FN void pd_moe_make_heap(pd_moe_cand *h, int32_t len)
{
    for (int32_t parent = (len - 2) / 2; len >= 2; parent--) {
        pd_moe_adjust_heap(h, parent, len, h[parent]);
        if (parent == 0) return;
    }
}

PD_MOE_FN void pd_moe_pop_heap(pd_moe_cand *h, int32_t len, int32_t result)
{
    const pd_moe_cand v = h[result];
    h[result] = h[0];
    pd_moe_adjust_heap(h, 0, len, v);
}

/* __heap_select: the mid best of h[0, len) into h[0, mid), a heap. */
PD_MOE_FN void pd_moe_heap_select(pd_moe_cand *h, int32_t mid, int32_t len)
{
    pd_moe_make_heap(h, mid);
    for (int32_t i = mid; i < len; i++)
        if (pd_moe_before(&h[i], &h[0])) pd_moe_pop_heap(h, mid, i);
}

PD_MOE_FN int32_t pd_moe_floor_log2(int32_t n)
{
    int32_t k = 0;
    while (n > 1) {
        n >>= 1;
        k++;
    }
    return k;
}

/* std::nth_element(c, c + nth, c + n) (introselect). */
PD_MOE_FN void pd_moe_nth_element(pd_moe_cand *c, int32_t n, int32_t nth)
{
    int32_t f = 0, l = n, depth = 2 * pd_moe_floor_log2(n);
    while (l - f > 3) {
        if (depth == 0) {
            pd_moe_heap_select(c + f, nth + 1 - f, l - f);
            pd_moe_swap(c, f, nth);
            return;
        }
        depth--;
        pd_moe_median_to_first(c, f, f + 1, f + (l - f) / 2, l - 1);
        const int32_t cut = pd_moe_partition(c, f + 1, l, f);
        if (cut <= nth) f = cut;
        else l = cut;
    }
    pd_moe_insertion_sort(c, f, l);
}

/* The k best of c[0, n) into c[0, k), most probable first, as torch's CPU topk arranges them
 * (the file's header). std::sort of up to 16 elements is an insertion sort; beyond that
 * (k > 17) the order among equal probabilities may differ from torch's, the set not. */
PD_MOE_FN void pd_moe_tie_select(pd_moe_cand *c, int32_t n, int32_t k)
{
    if ((int64_t)k * 64 <= n) { /* std::partial_sort: heap select, then sort_heap */
        pd_moe_heap_select(c, k, n);
        for (int32_t len = k; len > 1;) {
            len--;
            pd_moe_pop_heap(c, len, len);
        }
        return;
    }
    pd_moe_nth_element(c, n, k - 1);
    pd_moe_insertion_sort(c, 0, k - 1);
}

/* The top k of the probabilities c[0, E) (candidates in expert order, as
 * pd_moe_route_probs leaves them): their ids and weights (divided by the k probabilities' sum
 * when renorm), c reordered by the selection (moe_tie_select). */
PD_MOE_FN void pd_moe_route_pick(pd_moe_cand *c, int32_t E, int32_t k, bool renorm,
                                 int32_t *ids, float *w)
{
    pd_moe_tie_select(c, E, k);
    double top = 0;
    for (int32_t j = 0; j < k; j++) top += c[j].p;
    for (int32_t j = 0; j < k; j++) {
        ids[j] = c[j].e;
        w[j] = (float)(renorm ? c[j].p / top : c[j].p);
    }
}

/* Row lg[0, E)'s routing: the softmax in double over the experts into c (the candidates, E
 * of them: exp(lg[e] - max) in expert order, summed in expert order, each divided by the
 * sum), then its top k (pd_moe_route_pick). */
PD_MOE_FN void pd_moe_route_row(const float *lg, int32_t E, int32_t k, bool renorm,
                                pd_moe_cand *c, int32_t *ids, float *w)
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
    pd_moe_route_pick(c, E, k, renorm, ids, w);
}

/* The n * k choices ids[n][k] grouped by expert (a counting sort, rows ascending within an
 * expert), as pd_moe_route_args says: offsets[E + 1], rows[n * k], pos[n][k]; cursor is
 * scratch of E. */
PD_MOE_FN void pd_moe_group(const int32_t *ids, int32_t n, int32_t k, int32_t E,
                            int32_t *offsets, int32_t *cursor, int32_t *rows, int32_t *pos)
{
    for (int32_t e = 0; e <= E; e++) offsets[e] = 0;
    for (int64_t i = 0; i < (int64_t)n * k; i++) offsets[ids[i] + 1]++;
    for (int32_t e = 0; e < E; e++) {
        offsets[e + 1] += offsets[e];
        cursor[e] = offsets[e];
    }
    for (int32_t t = 0; t < n; t++)
        for (int32_t j = 0; j < k; j++) {
            const int32_t p = cursor[ids[(size_t)t * k + j]]++;
            rows[p] = t;
            pos[(size_t)t * k + j] = p;
        }
}

#undef PD_MOE_FN
#endif
