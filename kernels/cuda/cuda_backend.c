/* cuda_backend.c -- The CUDA backend's op table and constructor. Plain C: the ops themselves
 * live one per .cu file (see cuda_ops.h); this file only wires them into pd_backend_ops. */
#include "kernels/cuda/cuda_backend.h"

#include <stdlib.h>

#include "common/error.h"
#include "kernels/cuda/cuda_ops.h"

/* The FP8 weight op set (cuda_fp8_linear.cu): e4m3 weights with f32 scales, products through
 * cuBLASLt's FP8 GEMM (large n) or a weight-streaming kernel (decode). */
static const pd_wq_ops k_cuda_fp8_ops = {
    .name = "fp8",
    .weight_create = pd_cuda__fp8_weight_create,
    .weight_destroy = pd_cuda__fp8_weight_destroy,
    .weight_bytes = pd_cuda__fp8_weight_bytes,
    .linear_fused = pd_cuda__fp8_linear_fused,
    .linear_pair = pd_cuda__fp8_linear_pair,
    .moe_experts = pd_cuda__fp8_moe_experts,
};

/* The FP8 KV cache's ops: the cache holds e4m3 bytes (alloc takes PD_DTYPE_F8E4M3). */
static const pd_kv_ops k_cuda_kv_fp8 = {
    .name = "fp8",
    .dtype = PD_DTYPE_F8E4M3,
    .rope_store_kv = pd_cuda__rope_store_kv_fp8,
    .attention_prefill = pd_cuda__attention_fp8,
    .attention_decode = pd_cuda__attention_decode_fp8,
};

static const pd_backend_ops k_cuda_ops = {
    .name = "cuda",
    .act_dtype = PD_DTYPE_BF16,
    .destroy = pd_cuda__ctx_destroy,
    .alloc = pd_cuda__alloc,
    .free = pd_cuda__free,
    .upload = pd_cuda__upload,
    .download_f32 = pd_cuda__download_f32,
    .fill_uniform = pd_cuda__fill_uniform,
    .sync = pd_cuda__sync,
    .embedding = pd_cuda__embedding,
    .rmsnorm = pd_cuda__rmsnorm,
    .head_rmsnorm = pd_cuda__head_rmsnorm,
    .linear = pd_cuda__linear,
    .rope_store_kv = pd_cuda__rope_store_kv,
    .attention_prefill = pd_cuda__attention,
    .attention_decode = pd_cuda__attention_decode,
    .swiglu = pd_cuda__swiglu,
    .linear_fused = pd_cuda__linear_fused,
    .gather_rows = pd_cuda__gather_rows,
    .moe_route = pd_cuda__moe_route,
    .moe_combine = pd_cuda__moe_combine,
    .moe_experts = pd_cuda__moe_experts,
    .kv_blocks_to_host = pd_cuda__kv_blocks_to_host,
    .kv_blocks_from_host = pd_cuda__kv_blocks_from_host,
    .kv_blocks_copy = pd_cuda__kv_blocks_copy,
    .kv_blocks_clone = pd_cuda__kv_blocks_clone,
    .host_register = pd_cuda__host_register,
    .host_unregister = pd_cuda__host_unregister,
    .mem_info = pd_cuda__mem_info,
    .decode_layers = pd_cuda__decode_layers,
    .sample = pd_cuda__sample,
    .sample_launch = pd_cuda__sample_launch,
    .sample_collect = pd_cuda__sample_collect,
    .host_alloc = pd_cuda__host_alloc,
    .host_free = pd_cuda__host_free,
    .upload_rows = pd_cuda__upload_rows,
    .upload_rows_overlap = pd_cuda__upload_rows_overlap,
    .graph_begin = pd_cuda__graph_begin,
    .graph_end = pd_cuda__graph_end,
    .graph_launch = pd_cuda__graph_launch,
    .graph_destroy = pd_cuda__graph_destroy,
    .dev_export = pd_cuda__dev_export,
    .dev_open = pd_cuda__dev_open,
    .dev_close = pd_cuda__dev_close,
    .event_record = pd_cuda__event_record,
    .event_query = pd_cuda__event_query,
    .event_release = pd_cuda__event_release,
    .copyq_create = pd_cuda__copyq_create,
    .copyq_destroy = pd_cuda__copyq_destroy,
    .copyq_blocks = pd_cuda__copyq_blocks,
    .copyq_rows = pd_cuda__copyq_rows,
    .comm_create = pd_cuda__comm_create,
    .fp8 = &k_cuda_fp8_ops,
    .kv_fp8 = &k_cuda_kv_fp8,
};

int pd_backend_cuda_create(const pd_backend_params *p, pd_backend **out, char *err)
{
    *out = NULL;
    const int32_t device = p ? p->device : 0;
    pd_backend *b = calloc(1, sizeof *b);
    if (!b) return pd_errf(err, PD_ENOMEM, "out of memory creating the cuda backend");
    int rc = pd_cuda__ctx_create(device, &b->ctx, err);
    if (rc < 0) {
        free(b);
        return rc;
    }
    b->ops = &k_cuda_ops;
    *out = b;
    return 0;
}
