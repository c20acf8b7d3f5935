/* cpu_moe.c -- The CPU backend's mixture-of-experts ops: moe_route (softmax over the experts,
 * the top k as torch.topk on the CPU chooses them, kernels/moe_select.h; the choices grouped by
 * expert) and moe_combine (the experts' outputs weighted and summed back into token order).
 * The experts' products themselves are the backend's gather_rows and linear_fused, called by
 * engine/moe.c. */
#include "kernels/cpu/cpu_backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "kernels/moe_select.h"

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

int pd_cpu__moe_route(void *ctx, const pd_moe_route_args *a)
{
    if (!a || a->n < 0 || a->n_experts < 1 || a->k < 1 || a->k > a->n_experts || !a->offsets ||
        (a->n > 0 && (!a->logits || !a->ids || !a->weights || !a->rows || !a->pos)))
        return PD_EINVAL;
    const int32_t n = a->n, E = a->n_experts, k = a->k;
    pd_cpu_ctx *x = ctx;
    if (moe_scratch(x, (size_t)E * (sizeof(pd_moe_cand) + sizeof(int32_t))) < 0) return PD_ENOMEM;
    pd_moe_cand *c = x->moe;
    int32_t *cursor = (int32_t *)(c + E);
    for (int32_t t = 0; t < n; t++)
        pd_moe_route_row((const float *)a->logits + (size_t)t * E, E, k, a->renormalize, c,
                         a->ids + (size_t)t * k, a->weights + (size_t)t * k);
    pd_moe_group(a->ids, n, k, E, a->offsets, cursor, a->rows, a->pos);
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
