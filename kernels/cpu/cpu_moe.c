/* cpu_moe.c -- The CPU backend's mixture-of-experts ops: moe_route (softmax over the experts,
 * the top k as torch.topk on the CPU chooses them, kernels/moe_select.h; the choices grouped by
 * expert), moe_combine (the experts' outputs weighted and summed back into token order) and
 * moe_experts (each expert's MLP over its group, composed of the backend's own row gather and
 * linear_fused: what engine/moe.c runs expert by expert when a backend has no moe_experts; the
 * FP8 op set's, cpu_fp8.c, with the input rows quantized as its linear_fused quantizes them). */
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
    if (!a || a->n < 0 || a->n_experts < 1 || a->k < 1 || a->k > a->n_experts ||
        (!a->offsets && !a->dev_offsets) ||
        (a->n > 0 && (!a->logits || !a->ids || !a->weights || !a->rows || !a->pos)))
        return PD_EINVAL;
    const int32_t n = a->n, E = a->n_experts, k = a->k;
    int32_t *off = a->offsets ? a->offsets : a->dev_offsets; /* (host memory either way) */
    pd_cpu_ctx *x = ctx;
    if (moe_scratch(x, (size_t)E * (sizeof(pd_moe_cand) + sizeof(int32_t))) < 0) return PD_ENOMEM;
    pd_moe_cand *c = x->moe;
    int32_t *cursor = (int32_t *)(c + E);
    for (int32_t t = 0; t < n; t++)
        pd_moe_route_row((const float *)a->logits + (size_t)t * E, E, k, a->renormalize, c,
                         a->ids + (size_t)t * k, a->weights + (size_t)t * k);
    pd_moe_group(a->ids, n, k, E, off, cursor, a->rows, a->pos);
    if (a->offsets && a->dev_offsets) memcpy(a->dev_offsets, off, (size_t)(E + 1) * sizeof *off);
    return 0;
}

int pd_cpu__moe_experts_q(void *ctx, const pd_moe_experts_args *a, const float *gate_up,
                          const float *down, const pd_cpu_rowq *qgu, const pd_cpu_rowq *qdn)
{
    if (!a || a->n < 0 || a->k < 1 || a->n_experts < 1 || a->hidden < 1 || a->inter < 1 ||
        (a->n > 0 && (!a->x || !a->rows || !a->offsets || !gate_up || !down || !a->act ||
                      !a->y)) ||
        (a->n > 0 && a->out && (!a->pos || !a->weights)))
        return PD_EINVAL;
    if (a->n == 0) return 0;
    const int32_t E = a->n_experts, H = a->hidden, F = a->inter;
    const int64_t nk = (int64_t)a->n * a->k;
    const int32_t *off = a->offsets;
    if (off[0] != 0 || off[E] != nk) return PD_EINVAL;
    for (int32_t e = 0; e < E; e++)
        if (off[e + 1] < off[e] || off[e + 1] - off[e] > a->n) return PD_EINVAL;
    for (int64_t i = 0; i < nk; i++)
        if (a->rows[i] < 0 || a->rows[i] >= a->n) return PD_EINVAL;
    /* scratch: a group's gathered rows and gate/up products (a group holds at most n rows) */
    pd_cpu_ctx *c = ctx;
    const size_t need = (size_t)a->n * ((size_t)H + 2 * (size_t)F);
    if (need > c->moe_x_cap) {
        float *p = realloc(c->moe_x, need * sizeof *p);
        if (!p) return PD_ENOMEM;
        c->moe_x = p;
        c->moe_x_cap = need;
    }
    float *xe = c->moe_x, *gu = c->moe_x + (size_t)a->n * H;
    for (int32_t e = 0; e < E; e++) {
        const int32_t r0 = off[e], ne = off[e + 1] - r0;
        if (ne == 0) continue;
        for (int32_t i = 0; i < ne; i++) {
            float *xr = xe + (size_t)i * H;
            memcpy(xr, (const float *)a->x + (size_t)a->rows[r0 + i] * H,
                   (size_t)H * sizeof(float));
            if (qgu) pd_fp8_quant_row(xr, xr, H, qgu->group, qgu->act, qgu->in_scale);
        }
        float *act = (float *)a->act + (size_t)r0 * F;
        const pd_linear_args g = {.x = xe, .w = gate_up + (size_t)e * 2 * F * H, .out = act,
                                  .n = ne, .k = H, .m = F, .swiglu = true, .tmp_out = gu};
        const pd_linear_args d = {.x = act, .w = down + (size_t)e * H * F,
                                  .out = (float *)a->y + (size_t)r0 * H, .n = ne, .k = F,
                                  .m = H};
        int rc = pd_cpu__linear_fused(ctx, &g);
        if (rc < 0) return rc;
        for (int32_t i = 0; qdn && i < ne; i++) /* (act is scratch: quantized in place) */
            pd_fp8_quant_row(act + (size_t)i * F, act + (size_t)i * F, F, qdn->group, qdn->act,
                             qdn->in_scale);
        if ((rc = pd_cpu__linear_fused(ctx, &d)) < 0) return rc;
    }
    if (!a->out) return 0;
    const pd_moe_combine_args ca = {.y = a->y, .pos = a->pos, .weights = a->weights, .n = a->n,
                                    .k = a->k, .dim = H, .accumulate = a->accumulate,
                                    .out = a->out};
    return pd_cpu__moe_combine(ctx, &ca);
}

int pd_cpu__moe_experts(void *ctx, const pd_moe_experts_args *a)
{
    return pd_cpu__moe_experts_q(ctx, a, a ? a->gate_up : NULL, a ? a->down : NULL, NULL, NULL);
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
