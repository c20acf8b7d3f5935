/* model_runner.h -- The forward pass of a decoder-only transformer over a paged KV cache, for
 * one batch of sequences of different lengths per call: any mix of prompt chunks (with or
 * without an already-cached prefix) and single-token decode steps. The runner owns the KV
 * cache and the activation workspace, all allocated once at creation. */
#ifndef PD_MODEL_RUNNER_H
#define PD_MODEL_RUNNER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model.h"
#include "engine/moe.h"

/* The KV cache's element type (--kv-cache-dtype). */
typedef enum {
    MR_KV_AUTO = 0,   /* FP8 when the checkpoint has a kv_cache_scheme, else as MR_KV_NATIVE */
    MR_KV_NATIVE,     /* the backend's activation type (bf16 on CUDA, f32 on the CPU) */
    MR_KV_FP8,        /* e4m3 with the checkpoint's per-layer k_scale / v_scale, else 1
                       * (the backend's kv_fp8 op set; docs/quantization.md) */
} mr_kv_type;

typedef struct {
    int32_t max_num_batched_tokens; /* query rows one forward may hold; default 2048 */
    int32_t max_num_seqs;           /* sequences one forward may hold; default 256 */
    int32_t block_size;             /* tokens per KV block; default 16 */
    int32_t n_blocks;               /* KV blocks in the pool; 0 = from kv_cache_bytes */
    int64_t kv_cache_bytes;         /* KV pool size when n_blocks = 0; default 256 MiB; 0 = from
                                     * gpu_memory_utilization (backends with mem_info only) */
    double gpu_memory_utilization;  /* when n_blocks = 0 and kv_cache_bytes = 0: the KV pool
                                     * takes this share of the device's total memory minus what
                                     * this process's backend uses once the weights and the
                                     * runner's workspace are allocated, at most what is free
                                     * (so two processes can share a device, e.g. 0.45 each);
                                     * in (0, 1], default 0.9 */
    int32_t max_graph_batch;        /* decode steps of up to this many sequences replay graphs
                                     * captured at creation (backends with graph ops, i.e.
                                     * CUDA graphs), one per batch-size bucket, the batch padded
                                     * to its bucket; 0 = every step runs op by op (eager);
                                     * default 256 (capped at max_num_seqs and
                                     * max_num_batched_tokens) */
    mr_kv_type kv_dtype;         /* the KV cache's element type; default MR_KV_AUTO */
} mr_params;

/* Parses --kv-cache-dtype: "auto", "bf16" (and "native", "f32": MR_KV_NATIVE) or "fp8"
 * (and "fp8_e4m3"). Returns 0 or PD_EINVAL. */
int mr_kv_dtype_parse(const char *s, mr_kv_type *out);
/* The element type a runner with kv_dtype would give m's KV cache on its backend
 * (PD_EUNSUPPORTED: FP8 on a backend without the kv_fp8 op set). */
int mr_kv_dtype_resolve(mr_kv_type kv_dtype, const pd_model *m, pd_dtype *out);

mr_params mr_default_params(void);

/* One forward's batch, in host memory (borrowed for the call). Sequence s owns token rows
 * [cu_q[s], cu_q[s+1]); its context after this step is ctx_lens[s] tokens, so its rows are at
 * positions ctx_lens[s] - q_len .. ctx_lens[s] - 1 and the KV of earlier positions must already
 * be in its blocks (a cached prefix, or earlier chunks and steps). */
typedef struct {
    int32_t n_tokens;             /* rows, 1..max_num_batched_tokens */
    const int32_t *input_ids;     /* [n_tokens] */
    const int32_t *positions;     /* [n_tokens] absolute positions */
    const int32_t *slot_mapping;  /* [n_tokens] block * block_size + offset where KV is stored */
    int32_t n_seqs;               /* 1..max_num_seqs */
    const int32_t *cu_q;          /* [n_seqs + 1] */
    const int32_t *ctx_lens;      /* [n_seqs] */
    const int32_t *block_tables;  /* [n_seqs][max_blocks_per_seq] */
    int32_t max_blocks_per_seq;   /* row length of block_tables, <= mr_max_blocks_per_seq() */
    int32_t n_logits;             /* rows whose logits are wanted, 0..max_num_batched_tokens */
    const int32_t *logits_rows;   /* [n_logits] token rows (e.g. each sequence's last row; a
                                     row may repeat: an n > 1 request's choices) */
} mr_batch;

typedef struct mr mr; /* opaque */

/* Creates a runner for model m (borrowed; must outlive the runner) and allocates its
 * workspace, then its KV cache, on m's backend (the workspace first, so that a pool sized from
 * free device memory counts it). Returns 0, PD_EINVAL (bad params, or a pool sized from device
 * memory on a backend without mem_info or with no memory left), PD_ENOMEM. */
int mr_create(const mr_params *p, const pd_model *m, mr **out, char *err);
void mr_destroy(mr *r); /* NULL is a no-op */

/* A tensor-parallel runner over n_ranks shards (shards[r] is rank r's, pd_model_load_shard;
 * borrowed, must outlive the runner, as must comm, their communicator). It starts a thread
 * for each rank but 0 and runs every forward on all ranks at once, rank 0 on the caller's
 * thread; rank 0 makes the logits and samples. Each rank holds its KV heads of every block
 * (the same block ids on every rank). kv_cache_bytes is the pool over all ranks; a pool
 * sized from device memory takes the smallest rank's. Decode graphs as mr_create's (captured
 * on every rank at once); no pipelined launches (mr_can_launch is false), no decode_layers.
 * One rank without comm is mr_create. Returns 0, PD_EINVAL, PD_ENOMEM. A rank that fails
 * inside a forward aborts the communicator: that forward and every later one fail. */
int mr_create_tp(const mr_params *p, const pd_model *const *shards, int32_t n_ranks,
                 pd_comm *comm, mr **out, char *err);
/* The tensor-parallel degree (1 for mr_create's runner). */
int32_t mr_n_ranks(const mr *r);

/* Runs one forward. Stores every row's K/V at its slot and writes the logits of the requested
 * rows to logits[n_logits][vocab] (host memory, may be NULL when n_logits = 0). The batch is
 * validated first (ids, positions, lengths, block ids, slots): PD_EINVAL with err set, and
 * nothing is computed. */
int mr_forward(mr *r, const mr_batch *b, float *logits, char *err);

/* Sampling on the backend (see mr_forward_sample). rows[n_logits] are the logits rows'
 * parameters in the batch's logits_rows order; pen[n_pen] their penalty entries (host memory,
 * borrowed for the call); tokens[n_logits] receive the picks, and logprobs[n_logits] and
 * top[n_logits][PD_MAX_TOP_LOGPROBS] (each may be NULL) the raw log-probabilities of the rows
 * whose n_top is >= 0, as the backend's sample op writes them. */
typedef struct {
    const pd_sample_row *rows;
    const pd_penalty_tok *pen;
    int32_t n_pen;
    int32_t *tokens;
    float *logprobs;
    pd_top_logprob *top;
} mr_sampling;

/* True when the backend samples where the logits are (it has the sample op). */
bool mr_samples_on_backend(const mr *r);

/* mr_forward, except that the logits rows are sampled on the backend and only the tokens
 * (and log-probabilities) come back. PD_EINVAL when the backend has no sample op. */
int mr_forward_sample(mr *r, const mr_batch *b, const mr_sampling *s, char *err);

/* Pipelined steps: mr_launch queues what mr_forward_sample does and returns at once;
 * mr_collect waits for the oldest launch not yet collected and writes its tokens, logprobs and top
 * where its mr_sampling said (those buffers must live until then). With ids_from_last, each
 * row's input token is the token the launch before sampled for the same row, taken on the
 * backend (b->input_ids are not read): the host can queue step N + 1 before step N's tokens
 * come back. At most two launches are outstanding. Only pure decode batches that replay a
 * graph are launched: PD_EUNSUPPORTED (nothing queued) for the others, and always when
 * mr_can_launch is false (no graphs, or a backend without the split sample op). */
bool mr_can_launch(const mr *r);
int mr_launch(mr *r, const mr_batch *b, const mr_sampling *s, bool ids_from_last, char *err);
int mr_collect(mr *r, char *err);

/* Decode graphs captured at creation (0 when eager), and how many steps replayed one. */
int32_t mr_n_graphs(const mr *r);
int64_t mr_graph_steps(const mr *r);
/* A tensor-parallel group's decode step sizes that run fused (bit n: n sequences run as one
 * decode_layers kernel a rank, the ranks' sums inside it); 0 for none and for one rank. */
uint32_t mr_tp_fused_sizes(const mr *r);

/* Called during a forward after layer `layer`'s store of every token's K and V was queued on
 * the backend (not synchronized: the hook orders its use after the store, by an op on the
 * same stream such as kv_blocks_copy, which waits for it, or by event_record for a copy on
 * another stream). Set with mr_set_layer_hook; NULL fn removes it. Runs on the forward's
 * thread. A tensor-parallel runner calls it on rank 0 (the caller's thread) after the
 * layer's attention all-reduce and once every rank has queued its store of the layer, each
 * rank having recorded an event on its own stream right after it (mr_layer_events). */
typedef void (*mr_layer_fn)(void *arg, int32_t layer);
void mr_set_layer_hook(mr *r, mr_layer_fn fn, void *arg);

/* Tests: fn sees every sparse layer's router logits and chosen experts in each forward
 * (moe_router_fn; a tensor-parallel runner's rank 0's, on the caller's thread). NULL fn
 * removes it. Returns 0, PD_EINVAL (the model has no sparse layer), PD_ENOMEM. */
int mr_set_router_hook(mr *r, moe_router_fn fn, void *arg);

/* Inside the layer hook of a tensor-parallel runner: moves into ev[mr_n_ranks(r)] the events
 * each rank recorded on its own stream (its backend's event_record, on its thread) right
 * after it queued layer's KV store, so that a copy of rank k's heads on rank k's device
 * ordered after ev[k] reads the layer's final values without waiting for the other ranks.
 * ev[k] is of rank k's backend; the caller owns them (event_release on that backend); those
 * not taken are released after the forward. Returns 0; PD_EBACKEND (every ev[k] NULL) when a
 * rank's event is missing (its record failed, or taken before); PD_EINVAL outside a hook or
 * on a single-rank runner (whose hook records its own event). */
int mr_layer_events(mr *r, int32_t layer, void **ev);

/* Copies KV blocks src[i] over dst[i] (host arrays, n pairs) in every layer's K and V, in
 * order with the forwards (the backend's kv_blocks_clone): the copy on write of an n > 1
 * request's partial prompt block. A tensor-parallel runner copies on every rank (each its own
 * KV heads, on its rank's thread). Returns 0, PD_EUNSUPPORTED (the backend has no such op),
 * PD_EINVAL, PD_EBACKEND. */
int mr_clone_blocks(mr *r, const int32_t *src, const int32_t *dst, int32_t n, char *err);

int32_t mr_n_blocks(const mr *r);
/* The KV cache's element type (the backend's act_dtype, or PD_DTYPE_F8E4M3). */
pd_dtype mr_kv_dtype(const mr *r);
int32_t mr_block_size(const mr *r);
/* Longest block table a sequence can need: ceil(max_position / block_size). */
int32_t mr_max_blocks_per_seq(const mr *r);
const mr_params *mr_params_get(const mr *r);
/* The layer's K and V cache buffers ([n_blocks][block_size][n_kv_heads][head_dim], backend
 * memory; borrowed). A tensor-parallel runner's: rank 0's, of its shard's KV heads. */
void mr_kv_cache(const mr *r, int32_t layer, void **k, void **v);
/* The same for rank of a tensor-parallel runner (rank 0 of a single-rank one): its KV heads
 * ([n_blocks][block_size][its n_kv_heads][head_dim]). */
void mr_kv_cache_rank(const mr *r, int32_t rank, int32_t layer, void **k, void **v);
/* The whole KV pool as one region (backend memory; borrowed): layer l's K starts at
 * 2 l * layer bytes and its V at (2 l + 1) * layer bytes, where layer bytes = n_blocks *
 * block_size * n_kv_heads * head_dim * element size. */
void mr_kv_pool(const mr *r, void **base, size_t *bytes);

#endif
