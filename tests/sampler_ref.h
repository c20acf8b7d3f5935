/* sampler_ref.h -- Brute-force reference of the sampler's filters for tests: rank every token
 * by (value desc, id asc) with qsort, take top-k, the shortest best-first prefix holding top_p
 * of that mass, then min-p, with smp_sample's float probabilities and double sums. Header-only;
 * not reentrant (qsort's comparator reads a file-scope pointer). */
#ifndef PD_SAMPLER_REF_H
#define PD_SAMPLER_REF_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "engine/sampler.h"

static const float *g_ref_rank_v;

static int ref_cmp_rank(const void *pa, const void *pb)
{
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    if (g_ref_rank_v[a] != g_ref_rank_v[b]) return g_ref_rank_v[a] > g_ref_rank_v[b] ? -1 : 1;
    return (a > b) - (a < b);
}

/* The kept set of temperature-scaled logits v[vocab] (NaN already -inf) under p's top-k, top-p
 * and min-p: kept[t] = 1 for kept tokens, 0 otherwise; idx is scratch of vocab entries; *max
 * receives the largest value. Returns the number kept. */
static inline int32_t ref_kept_set(const smp_params *p, const float *v, int32_t vocab,
                                   int32_t *idx, unsigned char *kept, float *max)
{
    float m = -INFINITY;
    for (int32_t i = 0; i < vocab; i++) {
        idx[i] = i;
        if (v[i] > m) m = v[i];
        kept[i] = 0;
    }
    g_ref_rank_v = v;
    qsort(idx, (size_t)vocab, sizeof *idx, ref_cmp_rank);
    int32_t n = p->top_k > 0 && p->top_k < vocab ? p->top_k : vocab;
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) total += expf(v[idx[i]] - m);
    if (p->top_p < 1.0f) {
        double cut = (double)p->top_p * total, cum = 0.0;
        for (int32_t i = 0; i < n; i++) {
            cum += expf(v[idx[i]] - m);
            if (cum >= cut) {
                n = i + 1;
                break;
            }
        }
    }
    int32_t c = 0;
    for (int32_t i = 0; i < n; i++) {
        if (p->min_p > 0.0f && !(expf(v[idx[i]] - m) >= p->min_p)) continue;
        kept[idx[i]] = 1;
        c++;
    }
    *max = m;
    return c;
}

#endif
