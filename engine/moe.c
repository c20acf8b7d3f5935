/* moe.c -- The mixture-of-experts feed-forward block (moe.h): the router's product, the
 * backend's routing, the experts' MLPs expert by expert over the rows routed to each, and the
 * weighted combination, every step a backend op so that another backend runs the same
 * sequence. Quantized experts run their op set's moe_experts, or where they are each their own
 * weights its linear_fused, as dense layers do. */
#include "engine/moe.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/be_call.h"

struct moe_ws {
    const pd_model *m;
    pd_backend *be;
    int32_t max_rows;
    int32_t n_experts, k, hidden, inter; /* inter: the shard's columns of an expert */
    /* backend memory */
    void *logits;                 /* [max_rows][n_experts] the router's product */
    int32_t *ids, *rows, *pos;    /* [max_rows * k] moe_route's outputs */
    int32_t *d_offsets;           /* [n_experts + 1] the groups' bounds for moe_experts */
    float *weights;               /* [max_rows * k] */
    void *xe;                     /* [max_rows][hidden] one expert's rows gathered */
    void *gu;                     /* [max_rows][2 inter] its gate/up product */
    void *act;                    /* [max_rows][inter] its SwiGLU (moe_experts: every
                                   * choice's, [max_rows * k][inter]) */
    void *y;                      /* [max_rows * k][hidden] every choice's expert output */
    /* host memory */
    int32_t *offsets;             /* [n_experts + 1] the experts' groups in rows */
    moe_router_fn hook;
    void *hook_arg;
    float *h_logits, *h_ids;      /* the hook's copies */
    int32_t *h_ids_i;
};

#define CALL(expr) PD_BE_CALL(expr)

int moe_ws_create(const pd_model *m, int32_t max_rows, moe_ws **out, char *err)
{
    *out = NULL;
    const mc_config *c = &m->cfg;
    bool sparse = false;
    for (int32_t l = 0; l < c->n_layers && !sparse; l++) sparse = m->layers[l].experts != NULL;
    if (!sparse) return 0;
    moe_ws *ws = calloc(1, sizeof *ws);
    if (!ws) return pd_errf(err, PD_ENOMEM, "out of memory");
    ws->m = m;
    ws->be = m->be;
    ws->max_rows = max_rows;
    ws->n_experts = c->n_experts;
    ws->k = c->n_experts_per_tok;
    ws->hidden = c->hidden_size;
    ws->inter = m->shard.moe_intermediate;
    const pd_backend_ops *o = m->be->ops;
    const pd_dtype act = o->act_dtype;
    const size_t T = (size_t)max_rows, TK = T * (size_t)ws->k, H = (size_t)ws->hidden;
    const size_t F = (size_t)ws->inter;
    struct {
        pd_dtype t;
        size_t n;
        void **p;
    } bufs[] = {
        {act, T * (size_t)ws->n_experts, &ws->logits}, {PD_DTYPE_I32, TK, (void **)&ws->ids},
        {PD_DTYPE_I32, TK, (void **)&ws->rows},        {PD_DTYPE_I32, TK, (void **)&ws->pos},
        {PD_DTYPE_F32, TK, (void **)&ws->weights},     {act, T * H, &ws->xe},
        {act, T * 2 * F, &ws->gu},                     {act, TK * F, &ws->act},
        {act, TK * H, &ws->y},
        {PD_DTYPE_I32, (size_t)ws->n_experts + 1, (void **)&ws->d_offsets},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        int rc = o->alloc(m->be->ctx, bufs[i].t, bufs[i].n, bufs[i].p);
        if (rc < 0) {
            moe_ws_destroy(ws);
            return pd_errf(err, rc, "cannot allocate the mixture-of-experts workspace (%zu "
                           "elements) on the %s backend", bufs[i].n, o->name);
        }
    }
    ws->offsets = calloc((size_t)ws->n_experts + 1, sizeof *ws->offsets);
    if (!ws->offsets) {
        moe_ws_destroy(ws);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    *out = ws;
    return 0;
}

void moe_ws_destroy(moe_ws *ws)
{
    if (!ws) return;
    pd_backend *be = ws->be;
    void *bufs[] = {ws->logits, ws->ids, ws->rows, ws->pos, ws->weights,
                    ws->xe,     ws->gu,  ws->act,  ws->y,   ws->d_offsets};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->ops->free(be->ctx, bufs[i]);
    free(ws->offsets);
    free(ws->h_logits);
    free(ws->h_ids);
    free(ws->h_ids_i);
    free(ws);
}

/* The op that runs a sparse layer's experts in one call: the backend's moe_experts, or their
 * weight op set's; NULL when the layer's experts are each their own weights. */
static int (*experts_op(const pd_backend *be, const pd_layer_weights *w))(void *,
                                                                     const pd_moe_experts_args *)
{
    if (!w->experts_gate_up) return NULL;
    return w->experts_ops ? w->experts_ops->moe_experts : be->ops->moe_experts;
}

bool moe_without_host(const pd_model *m)
{
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        if (m->layers[l].experts && !experts_op(m->be, &m->layers[l])) return false;
    return true;
}

int moe_set_router_hook(moe_ws *ws, moe_router_fn fn, void *arg)
{
    if (fn && !ws->h_logits) {
        const size_t T = (size_t)ws->max_rows, TK = T * (size_t)ws->k;
        ws->h_logits = malloc(T * (size_t)ws->n_experts * sizeof *ws->h_logits);
        ws->h_ids = malloc(TK * sizeof *ws->h_ids);
        ws->h_ids_i = malloc(TK * sizeof *ws->h_ids_i);
        if (!ws->h_logits || !ws->h_ids || !ws->h_ids_i) return PD_ENOMEM;
    }
    ws->hook = fn;
    ws->hook_arg = arg;
    return 0;
}

/* The hook's call: the layer's logits and choices copied to the host. */
static int report_routing(moe_ws *ws, int32_t layer, int32_t n, char *err)
{
    pd_backend *be = ws->be;
    const size_t NE = (size_t)n * (size_t)ws->n_experts, NK = (size_t)n * (size_t)ws->k;
    CALL(be->ops->download_f32(be->ctx, ws->h_logits, ws->logits, be->ops->act_dtype, 0, NE));
    CALL(be->ops->download_f32(be->ctx, ws->h_ids, ws->ids, PD_DTYPE_I32, 0, NK));
    for (size_t i = 0; i < NK; i++) ws->h_ids_i[i] = (int32_t)ws->h_ids[i];
    ws->hook(ws->hook_arg, layer, n, ws->n_experts, ws->k, ws->h_logits, ws->h_ids_i);
    return 0;
}

/* Expert e's MLP over its n_e rows, grouped from row r0 of moe_route's order: the rows of x
 * gathered, gate/up with SwiGLU, down into y's rows r0 .. r0 + n_e. */
static int expert_mlp(moe_ws *ws, const pd_expert *ex, const void *x, int32_t r0, int32_t n_e,
                      char *err)
{
    pd_backend *be = ws->be;
    void *ctx = be->ctx;
    const pd_backend_ops *o = be->ops;
    const size_t es = pd_dtype_size(o->act_dtype);
    int (*lin_gu)(void *, const pd_linear_args *) =
        ex->gate_up_ops ? ex->gate_up_ops->linear_fused : o->linear_fused;
    int (*lin_dn)(void *, const pd_linear_args *) =
        ex->down_ops ? ex->down_ops->linear_fused : o->linear_fused;
    const pd_linear_args gu = {.x = ws->xe, .w = ex->gate_up, .out = ws->act, .n = n_e,
                               .k = ws->hidden, .m = ws->inter, .swiglu = true,
                               .tmp_out = ws->gu};
    const pd_linear_args dn = {.x = ws->act, .w = ex->down,
                               .out = (char *)ws->y + (size_t)r0 * (size_t)ws->hidden * es,
                               .n = n_e, .k = ws->inter, .m = ws->hidden};
    CALL(o->gather_rows(ctx, x, ws->rows + r0, n_e, ws->hidden, ws->xe));
    CALL(lin_gu(ctx, &gu));
    CALL(lin_dn(ctx, &dn));
    return 0;
}

int moe_ffn(moe_ws *ws, const pd_layer_weights *w, int32_t layer, const void *x, int32_t n,
            void *out, bool accumulate, char *err)
{
    if (!ws || !w->experts || n < 0 || n > ws->max_rows)
        return pd_errf(err, PD_EINVAL, "mixture of experts: layer %d: %d rows (at most %d), "
                       "or not a sparse layer", layer, n, ws ? ws->max_rows : 0);
    if (n == 0) return 0;
    pd_backend *be = ws->be;
    void *ctx = be->ctx;
    const pd_backend_ops *o = be->ops;
    CALL(o->linear(ctx, x, w->router, NULL, n, ws->hidden, ws->n_experts, ws->logits));
    /* experts in one buffer each on a backend with moe_experts: the groups stay on the
     * backend (no synchronisation); else each expert's products, sized on the host */
    int (*const experts)(void *, const pd_moe_experts_args *) = experts_op(be, w);
    const bool one_op = experts != NULL;
    const pd_moe_route_args ra = {
        .logits = ws->logits, .n = n, .n_experts = ws->n_experts, .k = ws->k,
        .renormalize = ws->m->cfg.norm_topk_prob, .ids = ws->ids, .weights = ws->weights,
        .rows = ws->rows, .pos = ws->pos, .offsets = one_op ? NULL : ws->offsets,
        .dev_offsets = one_op ? ws->d_offsets : NULL,
    };
    CALL(o->moe_route(ctx, &ra));
    int rc;
    if (ws->hook && (rc = report_routing(ws, layer, n, err)) < 0) return rc;
    if (one_op) {
        /* the products and the combination in one op (a device backend fuses them) */
        const pd_moe_experts_args ea = {
            .x = x, .n = n, .k = ws->k, .n_experts = ws->n_experts, .hidden = ws->hidden,
            .inter = ws->inter, .rows = ws->rows, .offsets = ws->d_offsets,
            .gate_up = w->experts_gate_up, .down = w->experts_down, .act = ws->act, .y = ws->y,
            .ids = ws->ids, .pos = ws->pos, .weights = ws->weights, .out = out,
            .accumulate = accumulate,
        };
        CALL(experts(ctx, &ea));
        return 0;
    }
    for (int32_t e = 0; !one_op && e < ws->n_experts; e++) {
        const int32_t r0 = ws->offsets[e], n_e = ws->offsets[e + 1] - r0;
        if (n_e > 0 && (rc = expert_mlp(ws, &w->experts[e], x, r0, n_e, err)) < 0) return rc;
    }
    const pd_moe_combine_args ca = {
        .y = ws->y, .pos = ws->pos, .weights = ws->weights, .n = n, .k = ws->k,
        .dim = ws->hidden, .accumulate = accumulate, .out = out,
    };
    CALL(o->moe_combine(ctx, &ca));
    return 0;
}
