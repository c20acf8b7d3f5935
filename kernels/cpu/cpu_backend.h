/* cpu_backend.h -- Internal declarations shared by the CPU backend's files. */
#ifndef PD_CPU_BACKEND_H
#define PD_CPU_BACKEND_H

#include "kernels/backend.h"

#include <stddef.h>

typedef struct {
    int32_t n_threads;   /* BLAS threads; 0 = library default */
    float *scratch;      /* attention scores + accumulator, grown on demand (rarely) */
    size_t scratch_cap;  /* elements in scratch */
    float *qx;           /* FP8 linears' quantized input rows, grown on demand */
    size_t qx_cap;       /* elements in qx */
    void *moe;           /* moe_route's candidates and cursors, grown on demand */
    size_t moe_cap;      /* bytes in moe */
    float *moe_x;        /* moe_experts' gathered rows and gate/up products, grown on demand */
    size_t moe_x_cap;    /* elements in moe_x */
} pd_cpu_ctx;

/* Paged causal attention on fp32 buffers; serves both prefill and decode batches. */
int pd_cpu__attention(void *ctx, const pd_attn_args *a);
/* The same over an FP8 cache (pd_kv_ops): keys e4m3 * k_scale, values e4m3 * v_scale. */
int pd_cpu__attention_fp8(void *ctx, const pd_attn_args *a);
/* rope_store_kv; with fp8 the cache is e4m3 (pd_kv_ops). */
int pd_cpu__rope_store(void *ctx, const pd_rope_args *a, bool fp8);
/* The backend's rmsnorm op. */
int pd_cpu__rmsnorm(void *ctx, const void *x, void *residual, const void *w, int32_t n,
                    int32_t dim, float eps, void *out);
/* The backend's linear_fused (fp32 weights). */
int pd_cpu__linear_fused(void *ctx, const pd_linear_args *a);

/* cpu_moe.c: the mixture-of-experts ops (backend.h's moe_route, moe_combine, moe_experts). */
int pd_cpu__moe_route(void *ctx, const pd_moe_route_args *a);
int pd_cpu__moe_combine(void *ctx, const pd_moe_combine_args *a);
int pd_cpu__moe_experts(void *ctx, const pd_moe_experts_args *a);
/* How a product's input rows are quantized (pd_fp8_quant_row's arguments). */
typedef struct {
    int32_t group;
    pd_act_quant act;
    float in_scale;
} pd_cpu_rowq;
/* moe_experts over the f32 weights gate_up and down (a's are not read), each expert's gathered
 * rows quantized as qgu says and its SwiGLU rows as qdn says (NULL: not quantized). */
int pd_cpu__moe_experts_q(void *ctx, const pd_moe_experts_args *a, const float *gate_up,
                          const float *down, const pd_cpu_rowq *qgu, const pd_cpu_rowq *qdn);

/* cpu_fp8.c: the FP8 weight and KV-cache op sets. */
extern const pd_wq_ops pd_cpu__fp8_ops;
extern const pd_kv_ops pd_cpu__kv_fp8_ops;

#endif
