/* backend.h -- The compute backend interface: a table of operations over buffers that live
 * wherever the backend keeps its memory (host for "cpu", device for "cuda"), with a void *ctx.
 * The engine's forward pass is a sequence of calls into this table; no backend header is
 * needed by engine code. All sizes are element counts, never bytes, unless named *_bytes. */
#ifndef PD_BACKEND_H
#define PD_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "text/request_params.h"

/* Paged attention over a batch of sequences with different lengths.
 * Sequence s owns query rows [cu_q[s], cu_q[s+1]) of q; its total context (cached prefix plus
 * these new tokens) is ctx_lens[s] tokens, so query row i of s sits at absolute position
 * ctx_lens[s] - (cu_q[s+1] - cu_q[s]) + i and attends causally to positions 0..that position.
 * Key/value of position p of s live in block block_tables[s * max_blocks_per_seq + p / block_size]
 * at offset p % block_size. All pointers are backend buffers. */
typedef struct {
    const void *q;               /* [n_tokens][q_row_stride], head h at column h * head_dim */
    int64_t q_row_stride;        /* elements between consecutive query rows */
    const void *k_cache;         /* [n_blocks][block_size][n_kv_heads][head_dim] */
    const void *v_cache;         /* same layout as k_cache */
    void *out;                   /* [n_tokens][n_heads * head_dim] */
    const int32_t *cu_q;         /* [n_seqs + 1] prefix sums of query lengths, cu_q[0] = 0 */
    const int32_t *ctx_lens;     /* [n_seqs] total context length per sequence */
    const int32_t *block_tables; /* [n_seqs][max_blocks_per_seq] */
    int32_t n_seqs;              /* sequences in the batch */
    int32_t n_tokens;            /* query rows, = cu_q[n_seqs] */
    int32_t max_q_len;           /* longest query length in the batch (1 for pure decode) */
    int32_t max_ctx_len;         /* longest context length in the batch; 0 in a decode batch
                                  * = unknown (a CUDA graph replayed with other contexts): the
                                  * kernel sizes its work from the batch alone and reads each
                                  * context from ctx_lens, where 0 marks a padding row (its
                                  * output is zeros) */
    int32_t max_blocks_per_seq;  /* row length of block_tables */
    int32_t n_heads;             /* query heads */
    int32_t n_kv_heads;          /* key/value heads; n_heads % n_kv_heads == 0 (GQA) */
    int32_t head_dim;            /* elements per head */
    int32_t block_size;          /* tokens per KV block */
    int32_t sliding_window;      /* attend only to the last this-many positions; 0 = unlimited */
    float scale;                 /* softmax scale, usually 1/sqrt(head_dim) */
    int32_t n_decode;            /* a hint for a mixed batch: its first n_decode sequences have
                                  * one query row each (0 = none or not known), which a backend
                                  * may run as a decode batch; 0 <= n_decode <= n_seqs */
    float k_scale, v_scale;      /* an FP8 cache's (pd_kv_ops): key = e4m3 * k_scale; value =
                                  * e4m3 * v_scale; unused by the other ops */
} pd_attn_args;

/* RoPE on the q and k parts of a fused qkv buffer, then store k and v by slot mapping. With
 * q_norm and k_norm set (Qwen3), each q and k head is first RMS-normalised in place as
 * head_rmsnorm does (with these weights and norm_eps), the op fusing the three. */
typedef struct {
    void *qkv;                   /* [n_tokens][(n_heads + 2 * n_kv_heads) * head_dim]: q | k | v */
    const int32_t *positions;    /* [n_tokens] absolute positions */
    const int32_t *slot_mapping; /* [n_tokens] block_id * block_size + offset; < 0 = don't store */
    const float *inv_freq;       /* [head_dim / 2] rotary inverse frequencies (backend buffer) */
    void *k_cache;               /* [n_blocks][block_size][n_kv_heads][head_dim] */
    void *v_cache;               /* same layout */
    int32_t n_tokens;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    float attn_factor;           /* multiplies cos and sin (YaRN's mscale); 1 otherwise */
    const void *q_norm;          /* [head_dim] weights, or NULL: no head norm */
    const void *k_norm;          /* [head_dim] weights (set together with q_norm) */
    float norm_eps;
    float k_scale, v_scale;      /* an FP8 cache's (pd_kv_ops): stores e4m3(k / k_scale) and
                                  * e4m3(v / v_scale), saturating; unused by the other ops */
} pd_rope_args;

/* A linear with the fusions around it in a transformer layer (the linear_fused op):
 *   out = f(norm(x) . w^T + bias)
 * where norm(x) is the RMSNorm of each x row with weights norm_w (as rmsnorm without a
 * residual) when norm_w is set, else x; and f writes the product (accumulate false), adds it to
 * out (accumulate true: the residual add), or, with swiglu, takes w as 2m rows (m gate rows,
 * then m up rows; bias 2m) and writes silu(gate) * up as the swiglu op does. */
typedef struct {
    const void *x;               /* [n][k] */
    const void *w;               /* [m][k]; [2m][k] with swiglu */
    const void *bias;            /* [m] ([2m] with swiglu) or NULL */
    void *out;                   /* [n][m]; must not alias x */
    int32_t n, k, m;
    const void *norm_w;          /* [k] RMSNorm weights, or NULL: x as it is */
    float norm_eps;
    bool swiglu;
    bool accumulate;             /* not together with swiglu */
    void *tmp_x;                 /* scratch of [n][k] the op may overwrite (norm_w set) */
    void *tmp_out;               /* scratch of [n][2m] the op may overwrite (swiglu set) */
} pd_linear_args;

/* One layer of a decode_layers call: its weights as pd_layer_weights names them
 * (engine/model.h), and its KV cache. */
typedef struct {
    const void *attn_norm, *qkv, *qkv_bias, *q_norm, *k_norm;
    const void *o_proj, *o_bias, *mlp_norm, *gate_up, *down;
    void *k_cache, *v_cache;
    /* NULL: qkv, o_proj, gate_up and down are act_dtype buffers; else all four are weights of
     * this op set of the backend's (pd_backend_ops.fp8: weight_create results), computed as
     * its linear_fused computes them. A backend whose decode_layers does not take them (or
     * not with their group or act) answers PD_EUNSUPPORTED. */
    const struct pd_wq_ops *wq;
} pd_layer_args;

/* Every layer of a decode step in one op (the decode_layers op): n single-token sequences, row
 * i of sequence i. For each layer it computes what this sequence of the other ops does:
 *   linear_fused(resid, attn_norm, qkv, qkv_bias) -> qkv;  rope_store_kv (q_norm / k_norm);
 *   attention_decode -> attn;  linear_fused(attn, o_proj, o_bias, accumulate) -> resid;
 *   linear_fused(resid, mlp_norm, gate_up, swiglu) -> act;  linear_fused(act, down, accumulate)
 * (and optionally the final norm and lm_head, below), the metadata meaning what pd_rope_args'
 * and pd_attn_args' do (a row of context 0 is padding: attention output zeros, nothing
 * stored). */
typedef struct {
    const pd_layer_args *layers; /* [n_layers], host memory */
    int32_t n_layers;
    void *resid;                 /* [n][hidden]: the embeddings in (unless embed is set), the
                                  * last layer's stream out */
    void *qkv, *attn, *act;      /* scratch: [n][(n_heads + 2 n_kv_heads) head_dim], [n][n_heads
                                  * head_dim], [n][intermediate] */
    int32_t n, hidden, intermediate, n_heads, n_kv_heads, head_dim;
    float norm_eps;
    const int32_t *positions, *slot_mapping, *ctx_lens; /* [n] each */
    const int32_t *block_tables; /* [n][max_blocks_per_seq] */
    int32_t max_blocks_per_seq, block_size, sliding_window;
    float scale;                 /* softmax scale */
    const float *inv_freq;       /* [head_dim / 2] */
    float attn_factor;
    /* Optional, with lm_head set: the head too, logits = rmsnorm(resid, final_norm) . lm_head^T
     * (resid then holds the last layer's stream as without). */
    const void *final_norm;      /* [hidden] */
    const void *lm_head;         /* [vocab][hidden], or NULL: no head */
    void *logits;                /* [n][vocab] */
    int32_t vocab;
    /* Optional, with lm_head: each row's greedy pick too (its first largest logit, NaN never:
     * the sample op's pick at temperature 0) into pick_ids[n] (backend memory: the next step's
     * input ids), and for the backend's sample ops into their slot *pick_slot (backend memory:
     * 0 or 1 for sample_launch's slots, PD_SAMPLE_SYNC_SLOT for sample). The sample op of
     * that slot, given these logits, rows that are all greedy without penalties, no
     * log-probabilities and ids_out NULL or pick_ids, may then take them instead of sampling
     * (if no other forward came between). NULL: no picks; a backend may ignore them. */
    int32_t *pick_ids;
    const int32_t *pick_slot;
    /* Optional: the embedding op fused, the rows start as embed[ids[i]] (resid's contents on
     * entry are not read). A backend that cannot takes PD_EUNSUPPORTED, nothing queued. */
    const int32_t *ids;          /* [n] */
    const void *embed;           /* [vocab][hidden], or NULL: the rows come in resid */
    /* Optional, tensor parallelism: the communicator's handle for this rank
     * (pd_comm_ops.fused_handle), NULL for none. Every rank of the group makes the same call at
     * once with its shard (n_heads, n_kv_heads and intermediate are the rank's, o_proj's bias
     * on one rank only): o_proj's and down's products are then the rank's partial sums, which
     * the op sums over the ranks (in rank order, in float: every rank the same bits) before
     * adding them to the residual stream. No lm_head with it. A backend or a handle that
     * cannot takes PD_EUNSUPPORTED (nothing queued), and as a rank that does not make its
     * call leaves the others waiting, a group decides before (check_only) on every rank. */
    void *tp;
    /* Optional: only the checks; returns what the call would (0, PD_EUNSUPPORTED, PD_EINVAL)
     * without queuing anything or touching the device. */
    bool check_only;
} pd_decode_args;

/* The routing of a mixture-of-experts layer (the moe_route op), for n token rows, each
 * choosing k of n_experts experts:
 *   p = softmax(logits[t]) over all the experts (in float or wider);
 *   the k experts of the largest p, chosen as torch.topk on the CPU chooses them (so that
 *   equal probabilities resolve as in the references: kernels/cpu/cpu_moe.c says how);
 *   their weights = their p, divided by the k values' sum when renormalize.
 * Then the n * k choices grouped by expert for the experts' products: rows[] lists the token
 * row of every choice, expert by expert ascending and within an expert by ascending row;
 * expert e's choices are rows[offsets[e] .. offsets[e + 1]); pos[t * k + j] is where choice
 * j of row t sits in rows. An expert appears at most once in a row's choices. */
typedef struct {
    const void *logits;          /* [n][n_experts] act_dtype: the router's product */
    int32_t n;                   /* token rows, >= 0 */
    int32_t n_experts;           /* >= 1 */
    int32_t k;                   /* 1..n_experts */
    bool renormalize;            /* the k weights divided by their sum */
    int32_t *ids;                /* [n][k] out: the experts chosen, most probable first */
    float *weights;              /* [n][k] out (F32): their routing weights */
    int32_t *rows;               /* [n * k] out: token rows grouped by expert */
    int32_t *pos;                /* [n][k] out: each choice's index into rows */
    int32_t *offsets;            /* [n_experts + 1] out, HOST memory, or NULL: the groups'
                                  * bounds; when given, the op returns once they are written
                                  * (a device backend synchronises: the caller sizes the
                                  * experts' products by them) */
    int32_t *dev_offsets;        /* [n_experts + 1] out, backend memory, or NULL: the same
                                  * bounds where moe_experts reads them, written in stream
                                  * order (no synchronisation: a graph may hold the call).
                                  * At least one of offsets and dev_offsets is given. */
} pd_moe_route_args;

/* The experts' MLPs of a mixture-of-experts layer over moe_route's grouped choices (the
 * moe_experts op): for every choice p in expert e's group [offsets[e], offsets[e + 1]),
 *   act[p] = swiglu(gate_up[e] x[rows[p]])   (the product rounded to act_dtype, then
 *                                             linear_fused's swiglu rule)
 *   y[p]   = down[e] act[p]                   (rounded to act_dtype)
 * each product summed in f32 or wider, as linear_fused computes one expert's rows. Every
 * expert's weights sit in one buffer: gate_up [n_experts][2 inter][hidden] (each expert's
 * gate rows, then its up rows) and down [n_experts][hidden][inter], act_dtype. The groups'
 * bounds are read from backend memory (moe_route's dev_offsets), so a device backend runs
 * the whole block without the host. With out given, the op also makes moe_combine's result
 * from y, pos and weights (bit for bit what moe_combine would make), and y is then scratch
 * that a backend may leave unwritten (a device backend fuses the two at batch 1). */
typedef struct {
    const void *x;               /* [n][hidden] act_dtype: the normed token rows */
    int32_t n;                   /* token rows, >= 0 */
    int32_t k;                   /* choices a row: the groups hold n * k rows in all */
    int32_t n_experts, hidden, inter;
    const int32_t *rows;         /* [n * k] moe_route's */
    const int32_t *offsets;      /* [n_experts + 1] backend memory (moe_route's dev_offsets) */
    const void *gate_up;         /* [n_experts][2 inter][hidden] */
    const void *down;            /* [n_experts][hidden][inter] */
    void *act;                   /* [n * k][inter] act_dtype: scratch (the SwiGLU rows) */
    void *y;                     /* [n * k][hidden] act_dtype out, in the grouped order */
    /* the combination, optional (out NULL: none): moe_route's outputs, as moe_combine takes
     * them */
    const int32_t *ids;          /* [n][k] each choice's expert */
    const int32_t *pos;          /* [n][k] each choice's index into y */
    const float *weights;        /* [n][k] F32 */
    void *out;                   /* [n][hidden] act_dtype, or NULL */
    bool accumulate;             /* out += the weighted sum (else out =) */
} pd_moe_experts_args;

/* The experts' outputs weighted and summed back into token order (the moe_combine op):
 *   out[t] = (out[t] +) sum over j < k of weights[t * k + j] * y[pos[t * k + j]]
 * for each of n rows, the terms added in j order. With moe_route's pos and weights, y's rows
 * in its grouped order. */
typedef struct {
    const void *y;               /* [n * k][dim] act_dtype */
    const int32_t *pos;          /* [n][k] */
    const float *weights;        /* [n][k] F32 */
    int32_t n, k, dim;
    bool accumulate;             /* add to out (the residual stream) rather than write it */
    void *out;                   /* [n][dim] act_dtype; must not overlap y */
} pd_moe_combine_args;

/* pd_decode_args' pick_slot for a step sampled by the sample op (not sample_launch). */
#define PD_SAMPLE_SYNC_SLOT 2


/* One row's parameters for the optional sample op. The fields mean what smp_params's do
 * (engine/sampler.h); the op picks the token smp_sample would pick from the same logits (up to
 * the rounding of sums at a boundary). */
typedef struct {
    float temperature;           /* < 1e-5 (or NaN) = greedy */
    float top_p;                 /* (0, 1]; 1 = off */
    float min_p;                 /* [0, 1]; 0 = off */
    float repetition_penalty;    /* 1 = off */
    float presence_penalty;      /* 0 = off */
    float frequency_penalty;     /* 0 = off */
    int32_t top_k;               /* <= 0 or >= vocab = off */
    int32_t n_output;            /* output tokens so far: the position keying the draw */
    uint64_t seed;               /* the draw is smp_uniform(seed, n_output) */
    int32_t pen_off;             /* this row's entries in the penalty list: [pen_off, */
    int32_t pen_n;               /*   pen_off + pen_n); none when the penalties are off */
    int32_t n_top;               /* when the op is asked for log-probabilities: < 0 = none for
                                  * this row; else the pick's and this many alternatives
                                  * (0..PD_MAX_TOP_LOGPROBS) */
} pd_sample_row;

/* A distinct token of a row's prompt or output, for the penalties. */
typedef struct {
    int32_t token;               /* in [0, vocab) */
    int32_t count;               /* occurrences in the output; 0 = in the prompt only */
} pd_penalty_tok;

/* A strided copy of blocks (the copyq_rows op): for each i < n, `rows` rows of row_bytes from
 * block src_ids[i] of src to block dst_ids[i] of dst, row t going from
 *   src + src_ids[i] * src_block_bytes + src_offset + t * src_pitch  to
 *   dst + dst_ids[i] * dst_block_bytes + dst_offset + t * dst_pitch.
 * A tensor-parallel rank's KV heads of a whole-layout block ([block_size][heads][head_dim]) are
 * such rows: block_size runs of its heads' bytes at the whole row's pitch, from its first
 * head's offset (kvtransfer's gather and scatter, svc/svc_kvdev.c). The rows of a block
 * must lie inside it on both sides: offset + (rows - 1) * pitch + row_bytes <= block_bytes,
 * pitch >= row_bytes. */
typedef struct {
    void *dst;                   /* backend memory, or host memory pinned with host_register */
    const void *src;             /* the same */
    const int32_t *dst_ids;      /* [n] host memory, >= 0 */
    const int32_t *src_ids;      /* [n] host memory, >= 0 */
    int32_t n;                   /* blocks, >= 0 */
    size_t rows;                 /* rows a block, >= 1 */
    size_t row_bytes;            /* bytes a row, >= 1 */
    size_t dst_block_bytes;      /* bytes from one dst block to the next */
    size_t src_block_bytes;      /* bytes from one src block to the next */
    size_t dst_pitch;            /* bytes from one row to the next in a dst block */
    size_t src_pitch;            /* the same in a src block */
    size_t dst_offset;           /* bytes from a dst block's start to its row 0 */
    size_t src_offset;           /* the same in a src block */
} pd_copy_rows;

/* Whether a describes rows inside their blocks on both sides (pd_copy_rows' rule; the ids are
 * checked by the op as it reads them). Every backend's copyq_rows checks this first. */
static inline bool pd_copy_rows_valid(const pd_copy_rows *a)
{
    if (!a || a->n < 0 || a->rows < 1 || a->row_bytes < 1) return false;
    if (a->n > 0 && (!a->dst || !a->src || !a->dst_ids || !a->src_ids)) return false;
    if (a->dst_pitch < a->row_bytes || a->src_pitch < a->row_bytes) return false;
    /* offset + (rows - 1) * pitch + row_bytes <= block_bytes, without overflow */
    const size_t span_d = a->dst_pitch * (a->rows - 1), span_s = a->src_pitch * (a->rows - 1);
    if (a->rows > 1 && (span_d / (a->rows - 1) != a->dst_pitch ||
                        span_s / (a->rows - 1) != a->src_pitch))
        return false;
    return a->dst_offset <= a->dst_block_bytes && a->src_offset <= a->src_block_bytes &&
           span_d <= a->dst_block_bytes - a->dst_offset &&
           span_s <= a->src_block_bytes - a->src_offset &&
           a->row_bytes <= a->dst_block_bytes - a->dst_offset - span_d &&
           a->row_bytes <= a->src_block_bytes - a->src_offset - span_s;
}

/* ---- quantized weights: the weight op sets (docs/quantization.md) ----
 * A backend offers one op set per weight precision besides its own (act_dtype) ops; the model
 * loader picks each linear's op set from the checkpoint's quantization_config at load, and the
 * model runner calls that set's linear_fused for the linear (no format test inside a kernel). */

/* A quantized matrix [m][k] as a weight op set's weight_create takes it (host memory, copied):
 * element (i, j) is e4m3(w8[i * k + j]) * scale[i * n_groups + j / group], n_groups =
 * ceil(k / group). group == k: a scale a row (per output channel; a per-tensor scale repeated
 * on every row); group 128: block-wise checkpoints (a 128 x 128 block's scale repeated on its
 * rows). The input rows are quantized as act says (pd_fp8_quant_row in common/dtype.h, the
 * reference every backend's op equals), and the product is
 *   out[r][i] = sum_j q(x)[r][j] * deq(w)[i][j]   (f32 accumulation, or better). */
typedef struct {
    const uint8_t *w8;           /* [m][k] e4m3fn bytes */
    const float *scale;          /* [m][ceil(k / group)], finite, > 0 */
    int32_t m, k;                /* output rows, input columns; > 0 */
    int32_t group;               /* columns a scale covers: k, or 128 (block-wise) */
    pd_act_quant act;            /* how the input rows are quantized */
    float in_scale;              /* PD_ACT_STATIC's scale (> 0); else unused */
    int32_t experts;             /* > 0: the rows of that many experts stacked, for the op
                                  * set's moe_experts only (linear_fused need not take it); 0:
                                  * a linear */
} pd_qweight_desc;

/* One KV-cache precision's ops (the KV op sets): the cache holds e4m3(k / k_scale) and
 * e4m3(v / v_scale) of each layer (pd_rope_args' and pd_attn_args' k_scale and v_scale), and
 * attention reads e4m3 * scale; everything else as the backend's own ops of those names.
 * The model runner picks the set once, from --kv-cache-dtype. */
typedef struct pd_kv_ops {
    const char *name;            /* "fp8" */
    pd_dtype dtype;              /* the cache's element type: PD_DTYPE_F8E4M3 */
    int (*rope_store_kv)(void *ctx, const pd_rope_args *a);
    int (*attention_prefill)(void *ctx, const pd_attn_args *a);
    int (*attention_decode)(void *ctx, const pd_attn_args *a);
} pd_kv_ops;

/* One weight precision's ops. */
typedef struct pd_wq_ops {
    const char *name;            /* "fp8" */
    /* Makes the backend's form of the matrix d describes (it may keep e4m3 bytes and scales,
     * or dequantize; the product is the same). Returns 0, PD_EINVAL (d breaks its rules),
     * PD_EUNSUPPORTED (a group or shape this backend takes not), PD_ENOMEM, PD_EBACKEND. */
    int (*weight_create)(void *ctx, const pd_qweight_desc *d, void **out);
    void (*weight_destroy)(void *ctx, void *w); /* NULL is a no-op */
    /* Bytes the backend holds for w (weights and scales), for reports. */
    size_t (*weight_bytes)(void *ctx, const void *w);
    /* The backend's linear_fused with a->w a weight_create result (a->m and a->k its m and k,
     * [2m] rows with swiglu): the input rows (normed, when norm_w is set) are quantized as the
     * weight's act says, then multiplied as pd_qweight_desc says; the bias, accumulate and
     * swiglu as in pd_linear_args. Returns 0, PD_EINVAL, PD_EBACKEND. */
    int (*linear_fused)(void *ctx, const pd_linear_args *a);
    /* Optional (NULL: the caller makes the two linear_fused calls): an MLP's two products of
     * this op set's weights, gate_up (with swiglu) then down (its x gate_up's out, k gate_up's
     * m, the same n), computing exactly what linear_fused(gate_up); linear_fused(down)
     * computes, the intermediate in the op set's own form (gate_up->out, and its tmp_out, are
     * scratch: their contents afterwards are unspecified). Returns as linear_fused. */
    int (*linear_pair)(void *ctx, const pd_linear_args *gate_up, const pd_linear_args *down);
    /* Optional (NULL: a model keeps each expert's linears as weights of their own, and the
     * engine runs them expert by expert): the moe_experts op (pd_moe_experts_args) over this
     * op set's weights. gate_up is one weight_create result of every expert's gate and up rows
     * stacked, [n_experts * 2 inter][hidden] (expert e's gate rows, then its up rows, from row
     * 2 inter e), down one of [n_experts * hidden][inter]; each product is what linear_fused
     * computes for one expert's rows (its input rows quantized as the weight's act says, the
     * gate/up product with swiglu), the combination as moe_experts'. Returns 0, PD_EINVAL,
     * PD_EBACKEND. */
    int (*moe_experts)(void *ctx, const pd_moe_experts_args *a);
} pd_wq_ops;

struct pd_backend;
struct pd_comm;

typedef struct pd_backend_ops {
    const char *name;            /* "cpu", "cuda" */
    pd_dtype act_dtype;          /* storage type of activations, weights and KV cache */

    void (*destroy)(void *ctx);

    /* Memory. alloc returns a zeroed buffer of n elements of dtype (act_dtype, F32 or I32). */
    int (*alloc)(void *ctx, pd_dtype dtype, size_t n, void **out);
    void (*free)(void *ctx, void *buf); /* NULL is a no-op */
    /* Host -> backend: converts n elements of src_type at src into dst (a buffer of dst_type),
     * starting at element dst_off. */
    int (*upload)(void *ctx, void *dst, pd_dtype dst_type, size_t dst_off, const void *src,
                  pd_dtype src_type, size_t n);
    /* Backend -> host f32: n elements of src (a buffer of src_type) from element src_off. */
    int (*download_f32)(void *ctx, float *dst, const void *src, pd_dtype src_type,
                        size_t src_off, size_t n);
    /* Fills a buffer of dtype with uniform values in [lo, hi) from a seeded generator (dummy
     * weights are made where they live). */
    int (*fill_uniform)(void *ctx, void *dst, pd_dtype dtype, size_t n, uint64_t seed, float lo,
                        float hi);
    /* Waits until all queued work is done (a no-op on the CPU). */
    int (*sync)(void *ctx);

    /* out[i] = table[ids[i]]; ids is an I32 buffer of n entries, rows have dim elements. */
    int (*embedding)(void *ctx, const int32_t *ids, int32_t n, const void *table, int32_t dim,
                     void *out);
    /* RMSNorm with the residual add fused: if residual is not NULL, residual += x first and
     * the norm is taken of residual; out = norm(.) * w. out may alias x. [n][dim] rows. */
    int (*rmsnorm)(void *ctx, const void *x, void *residual, const void *w, int32_t n,
                   int32_t dim, float eps, void *out);
    /* In-place RMSNorm of each head_dim vector of n_heads consecutive heads per row
     * (Qwen3's q_norm / k_norm). x rows are row_stride apart. */
    int (*head_rmsnorm)(void *ctx, void *x, int32_t n, int64_t row_stride, int32_t n_heads,
                        int32_t head_dim, const void *w, float eps);
    /* out[n][m] = x[n][k] . w[m][k]^T (+ bias[m] if bias is not NULL). */
    int (*linear)(void *ctx, const void *x, const void *w, const void *bias, int32_t n,
                  int32_t k, int32_t m, void *out);
    /* The fused linear above; a backend may compose it from its other ops (the scratch
     * buffers are for that). Returns 0, PD_EINVAL, PD_EBACKEND. */
    int (*linear_fused)(void *ctx, const pd_linear_args *a);
    int (*rope_store_kv)(void *ctx, const pd_rope_args *a);
    /* Attention for batches containing prompt chunks (query length >= 1). */
    int (*attention_prefill)(void *ctx, const pd_attn_args *a);
    /* Attention for batches where every sequence has query length 1. */
    int (*attention_decode)(void *ctx, const pd_attn_args *a);
    /* out[n][f] = silu(gate_up[n][0:f]) * gate_up[n][f:2f]. */
    int (*swiglu)(void *ctx, const void *gate_up, int32_t n, int32_t f, void *out);
    /* out[i] = x[idx[i]] for n_idx rows of dim elements; idx is an I32 buffer. */
    int (*gather_rows)(void *ctx, const void *x, const int32_t *idx, int32_t n_idx, int32_t dim,
                       void *out);
    /* Optional (NULL = not offered): mixture-of-experts routing and combination
     * (pd_moe_route_args, pd_moe_combine_args above), both or neither; the experts' products
     * are moe_experts, or gather_rows and linear_fused. A model with sparse layers is refused
     * at load on a backend without them. Return 0, PD_EINVAL, PD_EBACKEND. */
    int (*moe_route)(void *ctx, const pd_moe_route_args *a);
    int (*moe_combine)(void *ctx, const pd_moe_combine_args *a);
    /* Optional (NULL: the engine runs each expert's products as above, with the groups'
     * bounds on the host): every expert's MLP in one op (pd_moe_experts_args), for experts
     * held in one buffer each (unquantized; a weight op set's moe_experts takes its own).
     * Returns 0, PD_EINVAL, PD_EBACKEND. */
    int (*moe_experts)(void *ctx, const pd_moe_experts_args *a);
    /* KV blocks to / from host memory (for transfer staging). For each i, block ids[i] of a
     * cache laid out [n_blocks][block_elems] is copied to / from host + i * block_elems,
     * converted to / from f32. ids is host memory. */
    int (*kv_blocks_to_host)(void *ctx, const void *cache, const int32_t *ids, int32_t n,
                             size_t block_elems, float *host);
    int (*kv_blocks_from_host)(void *ctx, void *cache, const int32_t *ids, int32_t n,
                               size_t block_elems, const float *host);
    /* Optional (NULL = not offered). Whole KV blocks as raw bytes, no dtype conversion,
     * between a cache laid out [n_blocks][block_bytes] (backend memory) and a host region laid
     * out the same way (a full host mirror: block ids[i] at host + ids[i] * block_bytes), in
     * the direction to_host (cache -> host) or not (host -> cache). Returns when the copy is
     * complete. ids is host memory. Returns 0, PD_EINVAL, PD_EBACKEND. */
    int (*kv_blocks_copy)(void *ctx, void *cache, const int32_t *ids, int32_t n,
                          size_t block_bytes, void *host, bool to_host);
    /* Optional (NULL = not offered): whole KV blocks copied within the pool (the copy on
     * write of a forked sequence's partial block, n > 1 choices), in stream order: after the
     * work queued before, before the work queued after, without waiting. For each region r <
     * n_regions (at pool + r * region_bytes: one layer's K or V) and each i < n, block src[i]
     * is copied over block dst[i] (block_bytes each). src and dst are host memory; a dst id
     * may not also be a src id. Returns 0, PD_EINVAL, PD_EBACKEND. */
    int (*kv_blocks_clone)(void *ctx, void *pool, size_t region_bytes, int32_t n_regions,
                           const int32_t *src, const int32_t *dst, int32_t n, size_t block_bytes);
    /* Optional: pin / unpin host memory for fast kv_blocks_copy (a no-op on the CPU). A range
     * registered must be unregistered before it is freed. Return 0 or PD_EBACKEND. */
    int (*host_register)(void *ctx, void *p, size_t bytes);
    int (*host_unregister)(void *ctx, void *p);
    /* Optional (NULL = not offered, as on the CPU): the device's free and total memory in
     * bytes (free counts every process's allocations), and used_bytes: how much of the
     * device's memory this backend has taken since it was created (weights, workspace,
     * libraries' own; counted from the free memory then, so another process allocating at the
     * same moment makes it larger). Returns 0 or PD_EBACKEND. */
    int (*mem_info)(void *ctx, size_t *free_bytes, size_t *total_bytes, size_t *used_bytes);

    /* Optional: sampling where the logits are. logits is [n][vocab] of act_dtype (backend
     * memory, may be overwritten); rows[n] and pen[n_pen] are host memory; writes tokens[n]
     * and returns once they are written. When logprobs is not NULL, each row r with
     * rows[r].n_top >= 0 also gets the log-probability of its pick under the raw model
     * distribution (the log-softmax of the logits as given: before penalties, temperature and
     * filters; smp_logprobs in engine/sampler.h is the reference) in logprobs[r], and, when
     * top is not NULL, its rows[r].n_top best tokens under that distribution in
     * top[r * PD_MAX_TOP_LOGPROBS ...] (largest first, ties by ascending id, only tokens
     * whose logit is above -inf: token -1 ends a shorter list); other rows get logprob 0. All
     * of it is computed where the logits are; only those values come back. Returns 0,
     * PD_EINVAL, PD_ENOMEM, PD_EBACKEND. */
    int (*sample)(void *ctx, void *logits, int32_t n, int32_t vocab, const pd_sample_row *rows,
                  const pd_penalty_tok *pen, int32_t n_pen, int32_t *tokens, float *logprobs,
                  pd_top_logprob *top);
    /* Optional, with sample (both or neither): the same op split for pipelined steps.
     * sample_launch queues it and returns at once; the results go to slot `slot` (0 or 1) of
     * the op's own buffers, and with ids_out (backend memory, [n] int32) the tokens also go
     * there in queue order (the next step's input ids, without a round trip). sample_collect
     * waits for the slot's launch and writes its tokens, and its logprobs and top
     * alternatives (each may be NULL) when the launch asked for them, as sample does. A slot
     * is launched again only after it was collected. Returns 0, PD_EINVAL, PD_ENOMEM,
     * PD_EBACKEND. */
    int (*sample_launch)(void *ctx, void *logits, int32_t n, int32_t vocab,
                         const pd_sample_row *rows, const pd_penalty_tok *pen, int32_t n_pen,
                         bool logprobs, int32_t *ids_out, int slot);
    int (*sample_collect)(void *ctx, int slot, int32_t *tokens, float *logprobs,
                          pd_top_logprob *top);
    /* Optional (NULL = not offered): decode_layers above, for the shapes the backend fuses;
     * PD_EUNSUPPORTED (nothing queued) for the others, which the caller composes from the ops
     * it names. Returns 0, PD_EUNSUPPORTED, PD_EINVAL, PD_EBACKEND. */
    int (*decode_layers)(void *ctx, const pd_decode_args *a);
    /* Optional: pinned host memory, from which upload_rows copies without blocking. */
    int (*host_alloc)(void *ctx, size_t bytes, void **out);
    void (*host_free)(void *ctx, void *p); /* NULL is a no-op */
    /* Optional: raw bytes host -> backend, `rows` rows of row_bytes each, src_pitch bytes apart
     * at src and dst_pitch apart at dst. Queued in order with the ops; when src is host_alloc
     * memory it must stay unchanged until the next sync. Returns 0, PD_EINVAL, PD_EBACKEND. */
    int (*upload_rows)(void *ctx, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                       size_t row_bytes, size_t rows);
    /* Optional: upload_rows ordered after nothing queued before it (it may run beside them:
     * the caller knows that none of them reads or writes dst); the ops queued after this call
     * wait for it. For a pipelined step's metadata, into a buffer no queued step reads, while
     * the step before runs. Same returns. */
    int (*upload_rows_overlap)(void *ctx, void *dst, size_t dst_pitch, const void *src,
                               size_t src_pitch, size_t row_bytes, size_t rows);
    /* Optional: graphs (CUDA graphs). The ops queued between graph_begin and graph_end are
     * recorded, not run (none of them may synchronise or copy to or from host memory);
     * graph_launch replays them, reading whatever the buffers they name hold then. Returns 0,
     * PD_ENOMEM, PD_EBACKEND (an op that cannot be recorded: the graph is abandoned). */
    int (*graph_begin)(void *ctx);
    int (*graph_end)(void *ctx, void **graph);
    int (*graph_launch)(void *ctx, void *graph);
    void (*graph_destroy)(void *ctx, void *graph); /* NULL is a no-op */

    /* ---- KV blocks device to device between processes (kvtransfer's device path) ----
     * Optional. The event_* ops and copyq_create / copyq_destroy / copyq_blocks: all or
     * none (the CPU offers them, done at once, for tests of the staged path); copyq_rows
     * only with them; dev_export / dev_open / dev_close: all or none, and only with the
     * former (NULL = not offered, as on the CPU). The export / open pair maps
     * one process's allocation into another's address space (CUDA IPC); the copy queue moves
     * blocks into it on a stream of its own, ordered after an event recorded on the compute
     * stream, so that no thread waits: the engine thread records, the transfer thread
     * queues copies and polls their completion. Only event_record runs on the engine thread
     * (the thread that queues this backend's forwards: a tensor-parallel rank's own thread);
     * the others may run on any one other thread (they touch nothing the ops above use). */
    /* Exports the allocation p (the base of an alloc of this backend): writes
     * PD_DEV_EXPORT_BYTES opaque bytes into export_bytes and the device's PCI bus id
     * ("0000:3b:00.0", NUL-terminated) into bus_id[PD_BUS_ID_LEN]. Returns 0, PD_EINVAL,
     * PD_EBACKEND. */
    int (*dev_export)(void *ctx, void *p, void *export_bytes, char *bus_id);
    /* Maps a peer's export for copies from this backend's device: finds the device by bus_id,
     * checks that this device can reach it and enables peer access in both directions (a
     * copy without it is staged by the driver at a tenth of the link rate), then opens the
     * mapping. *base receives the peer allocation's base in this process. Returns 0,
     * PD_EUNSUPPORTED (the device is not visible here, or not reachable peer to peer: use
     * another path; err says which), PD_EBACKEND. */
    int (*dev_open)(void *ctx, const void *export_bytes, const char *bus_id, void **base,
                    char *err);
    void (*dev_close)(void *ctx, void *base); /* NULL is a no-op */
    /* Records an event on the compute stream after everything queued so far (engine thread).
     * *ev is released with event_release, from any thread. Returns 0, PD_ENOMEM, PD_EBACKEND. */
    int (*event_record)(void *ctx, void **ev);
    /* 1 when the work before ev has completed, 0 while it runs, PD_EBACKEND. */
    int (*event_query)(void *ctx, void *ev);
    void (*event_release)(void *ctx, void *ev); /* NULL is a no-op */
    /* A copy queue (its own stream) for one transfer thread. */
    int (*copyq_create)(void *ctx, void **q);
    void (*copyq_destroy)(void *ctx, void *q); /* waits for its copies; NULL is a no-op */
    /* On q: waits for after (NULL: nothing), then for each of the n_regions regions r and
     * each i < n copies block_bytes from src[r] + src_ids[i] * block_bytes to dst[r] +
     * dst_ids[i] * block_bytes (dst may be a dev_open mapping, and either side may be
     * host memory pinned with host_register: the staged path's ring), then records an event into
     * *done (released with event_release). ids are host memory, copied before it returns.
     * Returns 0, PD_EINVAL, PD_ENOMEM, PD_EBACKEND. */
    int (*copyq_blocks)(void *ctx, void *q, void *after, void *const *dst,
                        const void *const *src, int32_t n_regions, const int32_t *dst_ids,
                        const int32_t *src_ids, int32_t n, size_t block_bytes, void **done);
    /* Optional, with the copy queue (NULL = not offered): on q, waits for after (NULL:
     * nothing), then copies the rows a describes (pd_copy_rows above), then records an event
     * into *done, as copyq_blocks. A tensor-parallel instance's staged KV transfer takes each
     * rank's KV heads out of and into the whole-layout ring slots with it, on that rank's
     * backend and copy queue. Returns 0, PD_EINVAL (a row outside its block, a negative id),
     * PD_ENOMEM, PD_EBACKEND. */
    int (*copyq_rows)(void *ctx, void *q, void *after, const pd_copy_rows *a, void **done);

    /* ---- tensor parallelism ----
     * Optional (NULL = this backend runs no tensor-parallel instance): creates the
     * communicator (pd_comm below) among n_ranks backends of this kind, rank r being ranks[r]
     * (borrowed; must outlive the communicator). The CPU's: rank threads over shared memory;
     * CUDA's: NCCL, one GPU per rank. Free with pd_comm_destroy. Returns 0, PD_EINVAL,
     * PD_ENOMEM, PD_EBACKEND (err says why). */
    int (*comm_create)(struct pd_backend *const *ranks, int32_t n_ranks, struct pd_comm **out,
                       char *err);

    /* ---- other precisions ----
     * Optional (NULL = not offered): the FP8 weight op set and the FP8 KV-cache op set
     * (pd_wq_ops, pd_kv_ops above). */
    const pd_wq_ops *fp8;
    const pd_kv_ops *kv_fp8;
} pd_backend_ops;

#define PD_DEV_EXPORT_BYTES 64 /* an export's opaque bytes (a cudaIpcMemHandle_t) */
#define PD_BUS_ID_LEN 32       /* a PCI bus id with its NUL */

typedef struct pd_backend {
    const pd_backend_ops *ops;
    void *ctx;
} pd_backend;

typedef struct {
    int32_t n_threads; /* CPU threads for matrix products; 0 = all cores */
    int32_t device;    /* GPU ordinal for "cuda" */
} pd_backend_params;

pd_backend_params pd_backend_default_params(void);

/* ---- communicator (tensor parallelism) ----
 * The collectives among the ranks of one tensor-parallel instance: rank r calls them from its
 * own thread with buffers of its own backend, and every rank makes the same calls with the
 * same sizes in the same order. An op is queued in order with the rank backend's other ops
 * (CUDA: on its stream, so that a decode graph captures it; the CPU: done on return). The
 * result of all_reduce_sum has the same bits on every rank, and on the CPU it does not depend
 * on timing (the sum runs in rank order), so that a run is reproducible. */
typedef struct pd_comm_ops {
    const char *name;            /* "cpu", "nccl" */
    void (*destroy)(void *ctx);
    /* buf[n] (dtype: the backend's act_dtype or F32) := the element-wise sum of every
     * rank's buf. Returns 0, PD_EINVAL (n or dtype differ between ranks: every rank gets
     * it), PD_EBACKEND (aborted). */
    int (*all_reduce_sum)(void *ctx, int32_t rank, void *buf, pd_dtype dtype, size_t n);
    /* recv[n_ranks][n] := every rank's send[n], in rank order (recv must not overlap send).
     * Same returns. */
    int (*all_gather)(void *ctx, int32_t rank, const void *send, void *recv, pd_dtype dtype,
                      size_t n);
    /* Returns once every rank has called it and, on a device, every op a rank queued before
     * it has completed. Returns 0 or PD_EBACKEND. */
    int (*barrier)(void *ctx, int32_t rank);
    /* Gives up (a rank failed between collectives, so the others would wait for it forever):
     * every rank waiting in an op, and every later op, returns PD_EBACKEND. Any thread;
     * the communicator is of no further use but to be destroyed. */
    void (*abort)(void *ctx);
    /* Optional (NULL, or returning NULL: none): rank's handle for its backend's fused ops
     * that sum across the ranks themselves (pd_decode_args.tp). CUDA's: the GPUs' peer
     * memory, when every pair of them has peer access. abort ends those ops too. */
    void *(*fused_handle)(void *ctx, int32_t rank);
} pd_comm_ops;

typedef struct pd_comm {
    const pd_comm_ops *ops;
    void *ctx;
    int32_t n_ranks;             /* ranks 0 .. n_ranks - 1 */
} pd_comm;

/* The communicator of ranks[0]'s backend kind among n_ranks >= 1 backends of that kind (its
 * comm_create): PD_EUNSUPPORTED when that backend has none, PD_EINVAL when the kinds differ.
 * Free with pd_comm_destroy (NULL is a no-op). */
int pd_comm_create(pd_backend *const *ranks, int32_t n_ranks, pd_comm **out, char *err);
void pd_comm_destroy(pd_comm *c);

/* The CPU communicator (kernels/cpu/cpu_comm.c): ranks are threads of this process; buffers
 * are host memory (F32 or I32 for all_gather, F32 for all_reduce_sum). */
int pd_comm_cpu_create(int32_t n_ranks, pd_comm **out, char *err);

/* Creates a backend by name: "cpu", "cuda", or "auto" (cuda when built with it and a device is
 * present, else cpu). Returns 0, PD_ENOTFOUND for an unknown or unavailable backend (err says
 * why), PD_ENOMEM. Free with pd_backend_destroy. */
int pd_backend_create(const char *name, const pd_backend_params *p, pd_backend **out, char *err);
void pd_backend_destroy(pd_backend *b); /* NULL is a no-op */

/* The CPU reference backend (fp32, BLAS). */
int pd_backend_cpu_create(const pd_backend_params *p, pd_backend **out, char *err);

#endif
