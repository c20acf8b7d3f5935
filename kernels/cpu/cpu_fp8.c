/* cpu_fp8.c -- The CPU backend's FP8 op sets: the reference every FP8 kernel is tested against.
 * Weights are kept dequantized (e4m3 * scale, one f32 product each: exactly the values a
 * dequantized checkpoint holds), input rows are quantized by pd_fp8_quant_row, and the product
 * is the backend's f32 BLAS one; the FP8 KV cache stores e4m3 bytes (cpu_attention.c reads
 * them). */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "kernels/cpu/cpu_backend.h"

typedef struct {
    float *w;               /* [m][k] dequantized */
    int32_t m, k, group;
    pd_act_quant act;
    float in_scale;
} cpu_qweight;

static int fp8_weight_create(void *ctx, const pd_qweight_desc *d, void **out)
{
    (void)ctx;
    *out = NULL;
    if (!d || !d->w8 || !d->scale || d->m <= 0 || d->k <= 0 || d->group <= 0 ||
        (d->group != d->k && d->group != 128) ||
        (d->act == PD_ACT_STATIC && !(d->in_scale > 0)))
        return PD_EINVAL;
    const int32_t G = (d->k + d->group - 1) / d->group;
    cpu_qweight *q = calloc(1, sizeof *q);
    if (!q) return PD_ENOMEM;
    q->w = malloc((size_t)d->m * (size_t)d->k * sizeof *q->w);
    if (!q->w) {
        free(q);
        return PD_ENOMEM;
    }
    for (int64_t i = 0; i < d->m; i++)
        for (int32_t j = 0; j < d->k; j++)
            q->w[i * d->k + j] =
                pd_e4m3_to_f32(d->w8[i * d->k + j]) * d->scale[i * G + j / d->group];
    q->m = d->m;
    q->k = d->k;
    q->group = d->group;
    q->act = d->act;
    q->in_scale = d->in_scale;
    *out = q;
    return 0;
}

static void fp8_weight_destroy(void *ctx, void *w)
{
    (void)ctx;
    cpu_qweight *q = w;
    if (!q) return;
    free(q->w);
    free(q);
}

static size_t fp8_weight_bytes(void *ctx, const void *w)
{
    (void)ctx;
    const cpu_qweight *q = w;
    return (size_t)q->m * (size_t)q->k * sizeof(float);
}

/* The norm (into tmp_x), the rows quantized (into the context's qx), then the backend's own
 * fused linear on the dequantized weights. */
static int fp8_linear_fused(void *ctx, const pd_linear_args *a)
{
    pd_cpu_ctx *c = ctx;
    if (!a || !a->w || a->n < 0) return PD_EINVAL;
    const cpu_qweight *q = a->w;
    if (q->k != a->k || q->m != (a->swiglu ? 2 * a->m : a->m)) return PD_EINVAL;
    if (a->n == 0) return 0;
    pd_linear_args b = *a;
    b.w = q->w;
    if (q->act != PD_ACT_NONE) {
        const size_t need = (size_t)a->n * (size_t)a->k;
        if (need > c->qx_cap) {
            float *p = realloc(c->qx, need * sizeof *p);
            if (!p) return PD_ENOMEM;
            c->qx = p;
            c->qx_cap = need;
        }
        const float *x = a->x;
        if (a->norm_w) { /* the norm first, then its rows quantized in place */
            int rc = pd_cpu__rmsnorm(ctx, a->x, NULL, a->norm_w, a->n, a->k, a->norm_eps, c->qx);
            if (rc < 0) return rc;
            x = c->qx;
        }
        for (int32_t i = 0; i < a->n; i++)
            pd_fp8_quant_row(x + (size_t)i * a->k, c->qx + (size_t)i * a->k, a->k, q->group,
                             q->act, q->in_scale);
        b.x = c->qx;
        b.norm_w = NULL;
    }
    return pd_cpu__linear_fused(ctx, &b);
}

/* Every expert's MLP over the stacked weights (pd_wq_ops.moe_experts): cpu_moe.c's on the
 * dequantized rows, each product's input rows quantized as fp8_linear_fused quantizes them. */
static int fp8_moe_experts(void *ctx, const pd_moe_experts_args *a)
{
    if (!a || !a->gate_up || !a->down) return PD_EINVAL;
    const cpu_qweight *g = a->gate_up, *d = a->down;
    const int64_t E = a->n_experts;
    if (g->k != a->hidden || (int64_t)g->m != E * 2 * a->inter || d->k != a->inter ||
        (int64_t)d->m != E * a->hidden)
        return PD_EINVAL;
    const pd_cpu_rowq qg = {g->group, g->act, g->in_scale}, qd = {d->group, d->act, d->in_scale};
    return pd_cpu__moe_experts_q(ctx, a, g->w, d->w, g->act != PD_ACT_NONE ? &qg : NULL,
                                 d->act != PD_ACT_NONE ? &qd : NULL);
}

const pd_wq_ops pd_cpu__fp8_ops = {
    .name = "fp8",
    .weight_create = fp8_weight_create,
    .weight_destroy = fp8_weight_destroy,
    .weight_bytes = fp8_weight_bytes,
    .linear_fused = fp8_linear_fused,
    .moe_experts = fp8_moe_experts,
};

static int kv_fp8_rope_store(void *ctx, const pd_rope_args *a)
{
    if (!(a->k_scale > 0) || !(a->v_scale > 0)) return PD_EINVAL;
    return pd_cpu__rope_store(ctx, a, true);
}

static int kv_fp8_attention(void *ctx, const pd_attn_args *a)
{
    if (!(a->k_scale > 0) || !(a->v_scale > 0)) return PD_EINVAL;
    return pd_cpu__attention_fp8(ctx, a);
}

const pd_kv_ops pd_cpu__kv_fp8_ops = {
    .name = "fp8",
    .dtype = PD_DTYPE_F8E4M3,
    .rope_store_kv = kv_fp8_rope_store,
    .attention_prefill = kv_fp8_attention,
    .attention_decode = kv_fp8_attention,
};
