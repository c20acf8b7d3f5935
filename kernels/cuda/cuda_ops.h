/* cuda_ops.h -- Internal: the CUDA backend's op entry points, one per .cu file, shared between
 * the op table (cuda_backend.c) and the files that implement them. Each has the signature of
 * its pd_backend_ops slot and validates its arguments before launching. No CUDA header here. */
#ifndef PD_CUDA_OPS_H
#define PD_CUDA_OPS_H

#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/backend.h"

/* cuda_context.cu: context (device, stream, cuBLAS handle, pinned staging) and memory. */
int pd_cuda__ctx_create(int32_t device, void **out, char *err);
void pd_cuda__ctx_destroy(void *ctx);
int pd_cuda__alloc(void *ctx, pd_dtype dtype, size_t n, void **out);
void pd_cuda__free(void *ctx, void *buf);
int pd_cuda__sync(void *ctx);
int pd_cuda__mem_info(void *ctx, size_t *free_bytes, size_t *total_bytes, size_t *used_bytes);

/* cuda_transfer.cu */
int pd_cuda__upload(void *ctx, void *dst, pd_dtype dst_type, size_t dst_off, const void *src,
                    pd_dtype src_type, size_t n);
int pd_cuda__download_f32(void *ctx, float *dst, const void *src, pd_dtype src_type,
                          size_t src_off, size_t n);
/* cuda_fill.cu */
int pd_cuda__fill_uniform(void *ctx, void *dst, pd_dtype dtype, size_t n, uint64_t seed,
                          float lo, float hi);
/* cuda_embedding.cu */
int pd_cuda__embedding(void *ctx, const int32_t *ids, int32_t n, const void *table, int32_t dim,
                       void *out);
/* cuda_rmsnorm.cu */
int pd_cuda__rmsnorm(void *ctx, const void *x, void *residual, const void *w, int32_t n,
                     int32_t dim, float eps, void *out);
/* cuda_head_rmsnorm.cu */
int pd_cuda__head_rmsnorm(void *ctx, void *x, int32_t n, int64_t row_stride, int32_t n_heads,
                          int32_t head_dim, const void *w, float eps);
/* cuda_linear.cu */
int pd_cuda__linear(void *ctx, const void *x, const void *w, const void *bias, int32_t n,
                    int32_t k, int32_t m, void *out);
/* cuda_rope.cu */
int pd_cuda__rope_store_kv(void *ctx, const pd_rope_args *a);
/* The FP8 KV cache's ops (the kv_fp8 op set, pd_kv_ops): each the template instance of its bf16
 * op above or below, in the same file, for e4m3 cache elements. */
int pd_cuda__rope_store_kv_fp8(void *ctx, const pd_rope_args *a);
int pd_cuda__attention_fp8(void *ctx, const pd_attn_args *a);
int pd_cuda__attention_prefill_fp8(void *ctx, const pd_attn_args *a);
int pd_cuda__attention_decode_fp8(void *ctx, const pd_attn_args *a);
/* cuda_attention.cu: prefill and decode batches (block per query row and head). */
int pd_cuda__attention(void *ctx, const pd_attn_args *a);
/* cuda_attention_prefill.cu: prefill batches on the tensor cores, called by
 * pd_cuda__attention on validated arguments; 1 = not a shape it takes (nothing launched). */
int pd_cuda__attention_prefill(void *ctx, const pd_attn_args *a);
/* cuda_attention_decode.cu: decode batches, split-KV (falls back to pd_cuda__attention). */
int pd_cuda__attention_decode(void *ctx, const pd_attn_args *a);
/* cuda_decode_layers.cu: every layer of a small decode step in one persistent kernel. */
int pd_cuda__decode_layers(void *ctx, const pd_decode_args *a);
/* cuda_swiglu.cu */
int pd_cuda__linear_fused(void *ctx, const pd_linear_args *a);
int pd_cuda__swiglu(void *ctx, const void *gate_up, int32_t n, int32_t f, void *out);
/* cuda_moe.cu: the mixture-of-experts ops (backend.h's moe_route, moe_combine, moe_experts) */
int pd_cuda__moe_route(void *ctx, const pd_moe_route_args *a);
int pd_cuda__moe_combine(void *ctx, const pd_moe_combine_args *a);
int pd_cuda__moe_experts(void *ctx, const pd_moe_experts_args *a);
/* cuda_gather_rows.cu */
int pd_cuda__gather_rows(void *ctx, const void *x, const int32_t *idx, int32_t n_idx,
                         int32_t dim, void *out);
/* cuda_kv_blocks.cu */
int pd_cuda__kv_blocks_to_host(void *ctx, const void *cache, const int32_t *ids, int32_t n,
                               size_t block_elems, float *host);
int pd_cuda__kv_blocks_from_host(void *ctx, void *cache, const int32_t *ids, int32_t n,
                                 size_t block_elems, const float *host);
int pd_cuda__kv_blocks_copy(void *ctx, void *cache, const int32_t *ids, int32_t n,
                            size_t block_bytes, void *host, bool to_host);
int pd_cuda__host_register(void *ctx, void *p, size_t bytes);
/* cuda_kv_clone.cu: KV blocks copied within the pool (copy on write of forked choices). */
int pd_cuda__kv_blocks_clone(void *ctx, void *pool, size_t region_bytes, int32_t n_regions,
                             const int32_t *src, const int32_t *dst, int32_t n,
                             size_t block_bytes);
int pd_cuda__host_unregister(void *ctx, void *p);
/* cuda_graph.cu: pinned host memory, row uploads, graph capture and replay. */
int pd_cuda__host_alloc(void *ctx, size_t bytes, void **out);
void pd_cuda__host_free(void *ctx, void *p);
int pd_cuda__upload_rows(void *ctx, void *dst, size_t dst_pitch, const void *src,
                         size_t src_pitch, size_t row_bytes, size_t rows);
int pd_cuda__upload_rows_overlap(void *ctx, void *dst, size_t dst_pitch, const void *src,
                                 size_t src_pitch, size_t row_bytes, size_t rows);
int pd_cuda__graph_begin(void *ctx);
int pd_cuda__graph_end(void *ctx, void **graph);
int pd_cuda__graph_launch(void *ctx, void *graph);
void pd_cuda__graph_destroy(void *ctx, void *graph);
/* cuda_ipc.cu: KV blocks device to device between processes. */
int pd_cuda__dev_export(void *ctx, void *p, void *export_bytes, char *bus_id);
int pd_cuda__dev_open(void *ctx, const void *export_bytes, const char *bus_id, void **base,
                      char *err);
void pd_cuda__dev_close(void *ctx, void *base);
int pd_cuda__event_record(void *ctx, void **ev);
int pd_cuda__event_query(void *ctx, void *ev);
void pd_cuda__event_release(void *ctx, void *ev);
int pd_cuda__copyq_create(void *ctx, void **q);
void pd_cuda__copyq_destroy(void *ctx, void *q);
int pd_cuda__copyq_blocks(void *ctx, void *q, void *after, void *const *dst,
                          const void *const *src, int32_t n_regions, const int32_t *dst_ids,
                          const int32_t *src_ids, int32_t n, size_t block_bytes, void **done);
/* cuda_copy_rows.cu: strided block copies on a copy queue (a TP rank's KV heads). */
int pd_cuda__copyq_rows(void *ctx, void *q, void *after, const pd_copy_rows *a, void **done);
/* cuda_comm.cu: the NCCL communicator (pd_backend_ops.comm_create). */
int pd_cuda__comm_create(pd_backend *const *ranks, int32_t n_ranks, pd_comm **out, char *err);
/* cuda_sample.cu: the sample op; its per-context buffers are freed with the context. */
int pd_cuda__sample(void *ctx, void *logits, int32_t n, int32_t vocab, const pd_sample_row *rows,
                    const pd_penalty_tok *pen, int32_t n_pen, int32_t *tokens, float *logprobs,
                    pd_top_logprob *top);
int pd_cuda__sample_launch(void *ctx, void *logits, int32_t n, int32_t vocab,
                           const pd_sample_row *rows, const pd_penalty_tok *pen, int32_t n_pen,
                           bool logprobs, int32_t *ids_out, int slot);
int pd_cuda__sample_collect(void *ctx, int slot, int32_t *tokens, float *logprobs,
                            pd_top_logprob *top);
void pd_cuda__sample_free(void *state); /* NULL is a no-op */
/* cuda_fp8_linear.cu: the FP8 weight op set (pd_backend_ops.fp8, pd_wq_ops in
 * kernels/backend.h); its per-context state is freed with the context. */
int pd_cuda__fp8_weight_create(void *ctx, const pd_qweight_desc *d, void **out);
void pd_cuda__fp8_weight_destroy(void *ctx, void *w);
size_t pd_cuda__fp8_weight_bytes(void *ctx, const void *w);
int pd_cuda__fp8_linear_fused(void *ctx, const pd_linear_args *a);
int pd_cuda__fp8_linear_pair(void *ctx, const pd_linear_args *gate_up,
                            const pd_linear_args *down);
int pd_cuda__fp8_moe_experts(void *ctx, const pd_moe_experts_args *a);
void pd_cuda__fp8_free(void *state); /* NULL is a no-op */
/* cuda_fp8_quant.cu: the activation quantization of the FP8 set, for tests: the n bf16 rows
 * x[n][k] (device) quantized as pd_fp8_quant_row does (group, act, in_scale), by the kernel
 * linear_fused uses, and written dequantized (e4m3 * scale, f32) into out[n][k] (a device F32
 * buffer). Returns 0, PD_EINVAL, PD_EBACKEND. */
int pd_cuda__fp8_quant_rows_f32(void *ctx, const void *x, int32_t n, int32_t k, int32_t group,
                                pd_act_quant act, float in_scale, float *out);
/* cuda_fp8_quant.cu, for tests: the codes of pd_e4m3x2_div (the quantization's division by
 * the scale's reciprocal) against e4m3(x / s) by IEEE division, for every bf16 x and as many
 * floats of random low bits, over the n_s scales (host array); the codes that differ into
 * *mismatches. Returns 0, PD_EINVAL, PD_EBACKEND. */
int pd_cuda__fp8_div_check(void *ctx, const float *scales, int32_t n_s, uint64_t *mismatches);

#ifdef __cplusplus
}
#endif

#endif
