/* moe.h -- A sparse (mixture-of-experts) layer's feed-forward block as backend-op calls: the
 * router's product (linear), the routing (moe_route: softmax, top k, the choices grouped by
 * expert), the experts' MLPs over the rows routed to each (moe_experts, one op for them all;
 * or, for quantized experts or a backend without it, expert by expert: gather_rows,
 * linear_fused with SwiGLU, linear_fused) and the weighted sum back into token order
 * (moe_combine). The model
 * runner calls it for the layers mc_layer_sparse names; see docs/engine.md "Mixture of
 * experts". */
#ifndef PD_MOE_H
#define PD_MOE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model.h"

typedef struct moe_ws moe_ws; /* opaque: the block's workspace */

/* Called after each sparse layer's routing with its n rows' router logits
 * logits[n][n_experts] and chosen experts ids[n][k] (most probable first), host copies
 * borrowed for the call. For tests (the references' routing): it costs a copy a layer. */
typedef void (*moe_router_fn)(void *arg, int32_t layer, int32_t n, int32_t n_experts, int32_t k,
                              const float *logits, const int32_t *ids);

/* Allocates the workspace of model m (borrowed; must outlive it) on m's backend for steps of
 * up to max_rows token rows. *out is NULL when m has no sparse layer. Returns 0 or PD_ENOMEM
 * (err says what). Free with moe_ws_destroy (NULL is a no-op). */
int moe_ws_create(const pd_model *m, int32_t max_rows, moe_ws **out, char *err);
void moe_ws_destroy(moe_ws *ws);

/* Whether model m's sparse layers all run without the host between their ops (the
 * backend's moe_experts over experts held in one buffer each): what lets a decode step with
 * them be captured in a graph. True for a model without sparse layers. */
bool moe_without_host(const pd_model *m);

/* Sets the router hook (fn NULL removes it). Returns 0 or PD_ENOMEM (its host copies). */
int moe_set_router_hook(moe_ws *ws, moe_router_fn fn, void *arg);

/* The block of sparse layer `layer` (its weights w) on x[n][hidden], the normed rows
 * (backend memory): out[n][hidden] = (out +) the experts' outputs weighted by the routing.
 * x may be out (it is read before out is written). n <= the workspace's max_rows. Returns 0,
 * PD_EINVAL, or a backend op's error, with err set. */
int moe_ffn(moe_ws *ws, const pd_layer_weights *w, int32_t layer, const void *x, int32_t n,
            void *out, bool accumulate, char *err);

#endif
