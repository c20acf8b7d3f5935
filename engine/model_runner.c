/* model_runner.c -- Batched forward pass over the paged KV cache as a sequence of backend ops.
 * Residual stream: buffer A holds the residual, B each sub-layer's output; the fused
 * add+RMSNorm folds B into A and normalises into H.
 * A step's metadata (ids, positions, slots, logits rows, cu_q, contexts, block tables) is
 * packed into one host buffer (pinned where the backend offers it) and goes to one backend
 * buffer of the same layout in two copies; block tables sit there at the fixed pitch
 * max_blocks_per_seq whatever the batch's width, so the kernels' arguments depend only on
 * the row and sequence counts. That is what lets a decode step replay a graph captured at
 * creation for its batch-size bucket (the batch padded with rows of context 0 that store
 * nothing), with only the metadata copied in before the launch. */
#include "engine/model_runner.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/env.h"
#include "common/error.h"
#include "common/log.h"
#include "engine/be_call.h"
#include "engine/moe.h"
#include "engine/tp.h"

#define LOGITS_CHUNK 64 /* rows of logits computed per lm_head product (eager steps) */
#define MAX_GRAPHS 64   /* batch-size buckets */

struct mr {
    mr_params p;
    const pd_model *m;
    pd_backend *be;
    int32_t max_blocks_per_seq;
    int32_t qkv_dim;              /* (n_heads + 2 n_kv_heads) head_dim */
    float attn_factor;
    size_t kv_layer_elems;        /* elements in one layer's K (or V) cache */
    pd_dtype kv_dtype;            /* the cache's element type */
    const pd_kv_ops *kv_ops;      /* the FP8 cache's op set, or NULL: the backend's own ops */
    bool fused_ok;                /* decode_layers may be asked (a bf16 KV cache, each layer's
                                   * products of one precision: pd_layer_args.wq); it may still
                                   * answer PD_EUNSUPPORTED */
    void *kv;                     /* the whole pool: [n_layers][K, V][n_blocks][block elems] */
    void **k_cache, **v_cache;    /* [n_layers] pointers into kv */
    pd_layer_args *dl;            /* [n_layers]: weights and caches for decode_layers */
    /* tensor parallelism: the communicator's handle for this rank's fused decode steps
     * (pd_decode_args.tp), and the step sizes n (bit n) for which every rank's decode_layers
     * takes them, decided once for the group (mr_create_tp): 0 = op by op */
    void *tp_fused;
    uint32_t tp_fused_ns;
    /* workspace (backend memory) */
    void *a, *h, *qkv, *attn, *gate_up, *act, *lh, *logits;
    /* a vocabulary-split head (tensor parallelism, pd_model.head_rows < vocab): this rank's
     * part of the rows' logits, the gathered parts [rank][row][part] and the rows of that
     * transposition: for B rows, idx[b * N + q] = q * B + b from element N * B * (B - 1) / 2 */
    void *logits_part, *logits_gather;
    int32_t *d_head_tr;
    /* step metadata: a backend buffer and its host twin, same layout (see meta_layout); with
     * pipelined steps two of each, the launches alternating between them. d_meta and the d_*
     * pointers name the one in use (meta_use): buffer 0, but while mr_launch queues a launch of
     * slot 1 (and while capture_graphs captures its graphs). */
    int32_t *d_metas[2], *d_meta, *h_meta;
    bool h_meta_pinned;           /* h_meta is backend host memory (async uploads) */
    bool meta_inflight;           /* an upload from h_meta may still be reading it */
    size_t meta_head;             /* elements before the block tables */
    int32_t *d_ids, *d_pos, *d_slots, *d_rows, *d_cu_q, *d_ctx, *d_bt; /* into d_meta */
    int32_t *d_tag;
    int32_t *d_ids_next;          /* the other buffer's ids: where a step's picks go */
    size_t o_ids, o_pos, o_slots, o_rows, o_cu_q, o_ctx, o_tag;        /* offsets */
    float *inv_freq;
    moe_ws *moe;                  /* the sparse layers' workspace (engine/moe.c), or NULL */
    /* decode graphs: graph_bs[i] rows, ascending; graphs[k][i] reads metadata buffer k */
    int32_t n_graphs;
    int32_t graph_bs[MAX_GRAPHS];
    void *graphs[2][MAX_GRAPHS];
    int64_t graph_steps;
    /* pipelined steps (mr_launch / mr_collect): a second pinned metadata buffer (launches
     * alternate between the two, and between d_metas), and the launches not yet collected,
     * oldest first */
    int32_t *h_meta2;
    int64_t n_launches;
    int32_t n_out;                /* 0..2 outstanding */
    struct {
        int slot;
        int32_t *tokens;
        float *logprobs;
        pd_top_logprob *top;
    } out[2];
    mr_layer_fn layer_fn;         /* optional per-layer KV-ready hook */
    void *layer_arg;
    /* tensor parallelism (docs/tensor-parallel.md): a runner of n ranks holds none of the
     * above but p, m and be (rank 0's) and fans every call out to one runner a rank, rank 0
     * on the caller's thread; a rank's runner runs its shard and sums partial products with
     * the communicator */
    pd_comm *comm;                /* a rank's: the communicator (borrowed); NULL: one rank */
    int32_t rank;                 /* a rank's: its rank */
    int32_t n_ranks;              /* the group's: ranks[n_ranks]; 0 in a rank's runner */
    mr **ranks;
    tp_pool *pool;
    char (*rank_err)[PD_ERR_LEN]; /* [n_ranks] each rank's error of the last call */
    bool broken;                  /* a rank failed inside a forward (communicator aborted) */
    int64_t forwards;             /* group forwards started (the engine thread's) */
    /* Diagnostics (PDSERVE_TP_DEBUG_SKIP_ALLREDUCE=1): a rank leaves its all-reduces out, so
     * that a timing shows what they and the ranks' waits for each other cost. Wrong results. */
    bool debug_skip_ar;
    /* Diagnostics (PDSERVE_TP_DEBUG_OP_TIMING=1 with eager steps, max_graph_batch 0): each op
     * of a tensor-parallel forward synchronised and timed on the host clock, summed by kind;
     * rank 0 logs the table when destroyed. Slows every step. */
    bool debug_op_timing;
    double op_s[8];
    int64_t op_n[8];
    /* The launch gate (a group's; its ranks point to it): every rank of a forward meets there
     * after its host work (checks, metadata upload) and before it queues anything that holds
     * a collective, and learns whether every rank got there. A rank that failed before it
     * makes every rank return without launching, so that no rank is left in a collective
     * waiting for it (the communicator's abort, whose NCCL kind can wait forever for kernels
     * already spinning, is needed only for failures after the gate). */
    struct mr_gate *gate;
    bool gate_met;                /* a rank's: it met the gate in this forward */
    bool gate_failed;             /* a rank's: ... and learnt there that another rank failed */
    /* Testing (PDSERVE_FAULT_TP_RANK=R:N[:after]): rank R fails the group's N-th forward at
     * the gate (as a failed upload would), or with ":after" half-way through its layers (as
     * a device error between two collectives would; eager steps only), or in a fused decode
     * step after the gate without launching (as a failed launch would) (-1: off). */
    int32_t fault_rank;
    int64_t fault_forward;
    bool fault_after;
    bool fault_now;               /* a rank's: fail half-way through this forward's layers */
    tp_lsync *lsync;              /* the group's, shared by its ranks (borrowed there): each
                                   * layer's KV events while hooked (mr_layer_events) */
    pd_backend **rank_be;         /* the group's: [n_ranks] the ranks' backends */
};

struct mr_gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t n, arrived;
    int64_t gen;
    bool failed, result;          /* this round's; the last round's (true: a rank failed) */
};

/* A rank meets the gate (ok: its host work succeeded). Returns 0 when every rank got there
 * ok, PD_EBACKEND when one did not (every rank then returns without launching). */
static int gate_meet(mr *r, bool ok, char *err)
{
    struct mr_gate *G = r->gate;
    r->gate_met = true;
    pthread_mutex_lock(&G->mu);
    if (!ok) G->failed = true;
    if (++G->arrived == G->n) {
        G->result = G->failed;
        G->failed = false;
        G->arrived = 0;
        G->gen++;
        pthread_cond_broadcast(&G->cv);
    } else {
        const int64_t gen = G->gen;
        while (G->gen == gen) pthread_cond_wait(&G->cv, &G->mu);
    }
    const bool failed = G->result;
    pthread_mutex_unlock(&G->mu);
    r->gate_failed = failed && ok;
    if (failed && ok)
        return pd_errf(err, PD_EBACKEND, "another rank failed before this forward's launch");
    return failed ? PD_EBACKEND : 0;
}

static void meta_layout(mr *r);
static int capture_graphs(mr *r);
static void drop_graphs(mr *r);

mr_params mr_default_params(void)
{
    mr_params p = {
        .max_num_batched_tokens = 2048,
        .max_num_seqs = 256,
        .block_size = 16,
        .n_blocks = 0,
        .kv_cache_bytes = 256ll << 20,
        .gpu_memory_utilization = 0.9,
        .max_graph_batch = 256,
    };
    return p;
}

static void meta_use(mr *r, int k);

static int be_alloc(mr *r, pd_dtype t, size_t n, void **out, char *err)
{
    int rc = r->be->ops->alloc(r->be->ctx, t, n, out);
    if (rc < 0)
        return pd_errf(err, rc, "cannot allocate %zu elements on the %s backend", n,
                       r->be->ops->name);
    return 0;
}

/* The KV pool's bytes from device memory: utilization x total minus what this process's
 * backend took so far (weights, this runner's workspace, libraries), capped at what is free
 * now less a margin for allocations made later (cuBLAS's workspace on first use). Other
 * processes' memory is theirs: two processes at 0.45 each share one device. */
#define KV_MARGIN ((int64_t)256 << 20)
static int size_from_device(mr *r, int64_t *bytes, char *err)
{
    size_t free_b = 0, total_b = 0, used_b = 0;
    int rc = r->be->ops->mem_info(r->be->ctx, &free_b, &total_b, &used_b);
    if (rc < 0) return pd_errf(err, rc, "cannot read the %s device's memory", r->be->ops->name);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const double share = r->p.gpu_memory_utilization * (double)total_b;
    double want = share - (double)used_b;
    const double cap = (double)free_b - (double)KV_MARGIN;
    if (want > cap) want = cap;
    if (want < 1.0)
        return pd_errf(err, PD_EINVAL, "no device memory left for the KV cache: %.2f x %.2f GiB "
                       "is %.2f GiB, this process uses %.2f GiB already (weights, workspace) "
                       "and %.2f GiB are free", r->p.gpu_memory_utilization,
                       (double)total_b / gib, share / gib, (double)used_b / gib,
                       (double)free_b / gib);
    *bytes = (int64_t)want;
    PD_LOGI("model runner: KV cache %.2f GiB = %.2f x %.2f GiB device memory - %.2f GiB used by "
            "this process%s (%.2f GiB free)", want / gib, r->p.gpu_memory_utilization,
            (double)total_b / gib, (double)used_b / gib,
            want >= cap ? ", capped at the free memory" : "", (double)free_b / gib);
    return 0;
}

/* Creates one rank's runner (comm NULL: the whole model, alone), capturing its decode
 * graphs unless capture is false (a group captures on every rank at once). */
static int create_rank(const mr_params *p, const pd_model *m, pd_comm *comm, bool capture,
                       mr **out, char *err)
{
    *out = NULL;
    const mc_config *c = &m->cfg;
    if (p->max_num_batched_tokens <= 0 || p->max_num_seqs <= 0 || p->block_size <= 0 ||
        p->n_blocks < 0 || (p->n_blocks == 0 && p->kv_cache_bytes < 0))
        return pd_errf(err, PD_EINVAL, "model runner: sizes must be positive");
    if (p->n_blocks == 0 && p->kv_cache_bytes == 0) {
        if (!m->be->ops->mem_info)
            return pd_errf(err, PD_EINVAL, "model runner: the %s backend cannot size the KV "
                           "cache from device memory: give its size", m->be->ops->name);
        if (!(p->gpu_memory_utilization > 0) || p->gpu_memory_utilization > 1)
            return pd_errf(err, PD_EINVAL, "model runner: gpu_memory_utilization %g is not in "
                           "(0, 1]", p->gpu_memory_utilization);
    }
    mr *r = calloc(1, sizeof *r);
    if (!r) return pd_errf(err, PD_ENOMEM, "out of memory");
    r->p = *p;
    r->m = m;
    r->be = m->be;
    r->comm = comm;
    r->rank = m->shard.rank;
    if (comm && comm->ops->fused_handle) r->tp_fused = comm->ops->fused_handle(comm->ctx, r->rank);
    const pd_shard *sh = &m->shard; /* this rank's heads and MLP columns */
    const pd_dtype act = r->be->ops->act_dtype;
    int rc = mr_kv_dtype_resolve(p->kv_dtype, m, &r->kv_dtype);
    if (rc < 0) {
        free(r);
        return pd_errf(err, rc, "model runner: the %s backend has no FP8 KV cache",
                       m->be->ops->name);
    }
    if (r->kv_dtype == PD_DTYPE_F8E4M3) r->kv_ops = r->be->ops->kv_fp8;
    r->fused_ok = !r->kv_ops; /* (and the layers' products alike: below) */
    const size_t es = pd_dtype_size(r->kv_dtype);
    const size_t T = (size_t)p->max_num_batched_tokens, S = (size_t)p->max_num_seqs;
    const size_t hs = (size_t)c->hidden_size, hd = (size_t)c->head_dim;
    r->qkv_dim = (sh->n_heads + 2 * sh->n_kv_heads) * c->head_dim;
    r->max_blocks_per_seq = (c->max_position + p->block_size - 1) / p->block_size;
    size_t block_elems = (size_t)p->block_size * (size_t)sh->n_kv_heads * hd;
    const int64_t per_block = (int64_t)(block_elems * es) * 2 * c->n_layers;
    r->k_cache = calloc((size_t)c->n_layers, sizeof(void *));
    r->v_cache = calloc((size_t)c->n_layers, sizeof(void *));
    r->dl = calloc((size_t)c->n_layers, sizeof *r->dl);
    float *host_freq = malloc(hd / 2 * sizeof(float));
    if (!r->k_cache || !r->v_cache || !r->dl || !host_freq) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    /* The workspace first: a pool sized from free device memory must count it. */
    int32_t gmax = p->max_graph_batch;
    /* (a sparse layer whose experts run one by one brings its groups' sizes to the host:
     * no graphs) */
    if (!r->be->ops->graph_begin || gmax < 0 || !moe_without_host(m)) gmax = 0;
    if (gmax > p->max_num_seqs) gmax = p->max_num_seqs;
    if (gmax > p->max_num_batched_tokens) gmax = p->max_num_batched_tokens;
    r->p.max_graph_batch = gmax;
    /* logits rows: a graph's whole batch, or an eager step's chunk */
    const size_t chunk = (size_t)(gmax > LOGITS_CHUNK ? gmax : LOGITS_CHUNK);
    meta_layout(r);
    const size_t meta_n = r->meta_head + S * (size_t)r->max_blocks_per_seq;
    if ((rc = be_alloc(r, act, T * hs, &r->a, err)) < 0 ||
        (rc = be_alloc(r, act, T * hs, &r->h, err)) < 0 ||
        (rc = be_alloc(r, act, T * (size_t)r->qkv_dim, &r->qkv, err)) < 0 ||
        (rc = be_alloc(r, act, T * (size_t)sh->n_heads * hd, &r->attn, err)) < 0 ||
        (rc = be_alloc(r, act, T * 2 * (size_t)sh->intermediate, &r->gate_up, err)) < 0 ||
        (rc = be_alloc(r, act, T * (size_t)sh->intermediate, &r->act, err)) < 0 ||
        (rc = be_alloc(r, act, LOGITS_CHUNK * hs, &r->lh, err)) < 0 ||
        (rc = be_alloc(r, act, chunk * (size_t)c->vocab_size, &r->logits, err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_I32, meta_n, (void **)&r->d_metas[0], err)) < 0 ||
        (rc = be_alloc(r, PD_DTYPE_F32, hd / 2, (void **)&r->inv_freq, err)) < 0 ||
        (rc = moe_ws_create(m, p->max_num_batched_tokens, &r->moe, err)) < 0)
        goto fail;
    if (r->be->ops->host_alloc && r->be->ops->upload_rows &&
        r->be->ops->host_alloc(r->be->ctx, meta_n * sizeof(int32_t), (void **)&r->h_meta) == 0) {
        r->h_meta_pinned = true;
        if (r->be->ops->sample_launch && r->be->ops->sample_collect &&
            r->be->ops->host_alloc(r->be->ctx, meta_n * sizeof(int32_t), (void **)&r->h_meta2) != 0)
            r->h_meta2 = NULL; /* no pipelined steps */
        if (r->h_meta2 && r->be->ops->alloc(r->be->ctx, PD_DTYPE_I32, meta_n,
                                            (void **)&r->d_metas[1]) < 0) {
            r->be->ops->host_free(r->be->ctx, r->h_meta2);
            r->h_meta2 = NULL;
        }
    } else {
        r->h_meta = malloc(meta_n * sizeof(int32_t));
        if (!r->h_meta) {
            rc = pd_errf(err, PD_ENOMEM, "out of memory");
            goto fail;
        }
    }
    meta_use(r, 0);
    if (m->head_rows < c->vocab_size) {
        const int32_t N = sh->n_ranks, B = (int32_t)chunk;
        const size_t n_tr = (size_t)N * (size_t)B * (size_t)(B + 1) / 2;
        int32_t *tr = malloc(n_tr * sizeof *tr);
        if (!tr) {
            rc = pd_errf(err, PD_ENOMEM, "out of memory");
            goto fail;
        }
        for (int32_t b = 1, off = 0; b <= B; off += N * b, b++)
            for (int32_t i = 0; i < b; i++)
                for (int32_t q = 0; q < N; q++) tr[off + i * N + q] = q * b + i;
        if ((rc = be_alloc(r, act, chunk * (size_t)m->head_rows, &r->logits_part, err)) < 0 ||
            (rc = be_alloc(r, act, chunk * (size_t)c->vocab_size, &r->logits_gather, err)) < 0 ||
            (rc = be_alloc(r, PD_DTYPE_I32, n_tr, (void **)&r->d_head_tr, err)) < 0 ||
            (rc = r->be->ops->upload(r->be->ctx, r->d_head_tr, PD_DTYPE_I32, 0, tr, PD_DTYPE_I32,
                                     n_tr)) < 0) {
            if (rc == 0 || !err[0]) pd_errf(err, rc, "cannot upload the head's transposition");
            free(tr);
            goto fail;
        }
        free(tr);
    }
    if (r->p.n_blocks == 0) {
        /* kv_cache_bytes is the instance's, over every rank; a pool sized from the device
         * is this rank's (a group takes its ranks' smallest) */
        int64_t bytes = p->kv_cache_bytes, nb;
        if (bytes == 0) {
            if ((rc = size_from_device(r, &bytes, err)) < 0) goto fail;
            nb = bytes / per_block;
        } else {
            nb = bytes / (per_block * sh->n_ranks);
        }
        if (nb < 1) {
            rc = pd_errf(err, PD_EINVAL, "KV cache of %lld bytes holds no block (%lld bytes "
                         "per block)", (long long)bytes, (long long)per_block);
            goto fail;
        }
        r->p.n_blocks = nb > INT32_MAX / p->block_size ? INT32_MAX / p->block_size : (int32_t)nb;
    }
    r->kv_layer_elems = (size_t)r->p.n_blocks * block_elems;
    /* One allocation for every layer's K and V, so that the KV transfer can register (and a
     * peer can address) the whole pool as one region. */
    if ((rc = be_alloc(r, r->kv_dtype, r->kv_layer_elems * 2 * (size_t)c->n_layers, &r->kv,
                       err)) < 0)
        goto fail;
    for (int32_t l = 0; l < c->n_layers; l++) {
        r->k_cache[l] = (char *)r->kv + (size_t)(2 * l) * r->kv_layer_elems * es;
        r->v_cache[l] = (char *)r->kv + (size_t)(2 * l + 1) * r->kv_layer_elems * es;
        const pd_layer_weights *w = &m->layers[l];
        r->dl[l] = (pd_layer_args){
            .attn_norm = w->attn_norm, .qkv = w->qkv, .qkv_bias = w->qkv_bias,
            .q_norm = w->q_norm, .k_norm = w->k_norm, .o_proj = w->o_proj, .o_bias = w->o_bias,
            .mlp_norm = w->mlp_norm, .gate_up = w->gate_up, .down = w->down,
            .k_cache = r->k_cache[l], .v_cache = r->v_cache[l], .wq = w->qkv_ops};
        /* the fused step takes a layer's four products of one precision only */
        if (w->o_ops != w->qkv_ops || w->gate_up_ops != w->qkv_ops || w->down_ops != w->qkv_ops ||
            w->experts) /* (and no sparse layers) */
            r->fused_ok = false;
    }
    r->attn_factor = mc_rope_inv_freq(c, host_freq);
    if ((rc = r->be->ops->upload(r->be->ctx, r->inv_freq, PD_DTYPE_F32, 0, host_freq,
                                 PD_DTYPE_F32, hd / 2)) < 0) {
        pd_errf(err, rc, "cannot upload rope frequencies");
        goto fail;
    }
    free(host_freq);
    host_freq = NULL;
    if (capture) (void)capture_graphs(r);
    PD_LOGD("model runner: %d KV blocks of %d tokens (%.1f MiB), %d tokens x %d seqs per step",
            r->p.n_blocks, p->block_size,
            (double)r->kv_layer_elems * es * 2 * c->n_layers / 1048576.0,
            p->max_num_batched_tokens, p->max_num_seqs);
    *out = r;
    return 0;
fail:
    free(host_freq);
    mr_destroy(r);
    return rc;
}

int mr_create(const mr_params *p, const pd_model *m, mr **out, char *err)
{
    if (m->shard.n_ranks != 1)
        return pd_errf(err, PD_EINVAL, "model runner: a shard of %d needs mr_create_tp",
                       m->shard.n_ranks);
    return create_rank(p, m, NULL, true, out, err);
}

void mr_destroy(mr *r)
{
    if (!r) return;
    if (r->ranks) { /* a group: its threads first, then the ranks' runners */
        tp_pool_destroy(r->pool);
        tp_lsync_destroy(r->lsync); /* (its events before the ranks' backends go) */
        free(r->rank_be);
        for (int32_t k = 0; k < r->n_ranks; k++) mr_destroy(r->ranks[k]);
        if (r->gate) {
            pthread_mutex_destroy(&r->gate->mu);
            pthread_cond_destroy(&r->gate->cv);
            free(r->gate);
        }
        free(r->ranks);
        free(r->rank_err);
        free(r);
        return;
    }
    pd_backend *be = r->be;
    if (r->debug_op_timing && r->rank == 0 && r->op_n[0] > 0) {
        static const char *const names[8] = {"rmsnorm", "qkv", "rope_store_kv", "attention",
                                             "o_proj", "gate_up+swiglu", "down", "all_reduce"};
        for (int k = 0; k < 8; k++)
            PD_LOGI("tp op timing (rank 0, eager, synchronised): %-15s %8lld calls %10.2f us "
                    "each, %9.3f s in all", names[k], (long long)r->op_n[k],
                    r->op_n[k] ? r->op_s[k] * 1e6 / (double)r->op_n[k] : 0.0, r->op_s[k]);
    }
#define FREE(x) be->ops->free(be->ctx, (x))
    if (r->meta_inflight || r->n_out) (void)be->ops->sync(be->ctx);
    drop_graphs(r);
    FREE(r->kv);
    free(r->k_cache);
    free(r->v_cache);
    free(r->dl);
    FREE(r->a); FREE(r->h); FREE(r->qkv); FREE(r->attn); FREE(r->gate_up);
    FREE(r->act); FREE(r->lh); FREE(r->logits); FREE(r->d_metas[0]);
    if (r->logits_part) FREE(r->logits_part);
    if (r->logits_gather) FREE(r->logits_gather);
    if (r->d_head_tr) FREE(r->d_head_tr);
    if (r->d_metas[1]) FREE(r->d_metas[1]);
    FREE(r->inv_freq);
#undef FREE
    moe_ws_destroy(r->moe);
    if (r->h_meta_pinned) be->ops->host_free(be->ctx, r->h_meta);
    else free(r->h_meta);
    if (r->h_meta2) be->ops->host_free(be->ctx, r->h_meta2);
    free(r);
}

int mr_set_router_hook(mr *r, moe_router_fn fn, void *arg)
{
    mr *r0 = r->ranks ? r->ranks[0] : r;
    return r0->moe ? moe_set_router_hook(r0->moe, fn, arg) : PD_EINVAL;
}

void mr_set_layer_hook(mr *r, mr_layer_fn fn, void *arg)
{
    r->layer_fn = fn;
    r->layer_arg = arg;
    /* every rank takes the same path (no graphs while hooked); rank 0 calls it */
    for (int32_t k = 0; r->ranks && k < r->n_ranks; k++) mr_set_layer_hook(r->ranks[k], fn, arg);
}

int32_t mr_n_blocks(const mr *r) { return r->p.n_blocks; }
int32_t mr_block_size(const mr *r) { return r->p.block_size; }
int32_t mr_max_blocks_per_seq(const mr *r) { return r->max_blocks_per_seq; }
const mr_params *mr_params_get(const mr *r) { return &r->p; }

void mr_kv_pool(const mr *r, void **base, size_t *bytes)
{
    if (r->ranks) r = r->ranks[0];
    *base = r->kv;
    *bytes = r->kv_layer_elems * 2 * (size_t)r->m->cfg.n_layers * pd_dtype_size(r->kv_dtype);
}

pd_dtype mr_kv_dtype(const mr *r)
{
    return r->ranks ? r->ranks[0]->kv_dtype : r->kv_dtype;
}

int mr_kv_dtype_parse(const char *s, mr_kv_type *out)
{
    if (!s || !*s || strcmp(s, "auto") == 0) *out = MR_KV_AUTO;
    else if (strcmp(s, "bf16") == 0 || strcmp(s, "native") == 0 || strcmp(s, "f32") == 0)
        *out = MR_KV_NATIVE;
    else if (strcmp(s, "fp8") == 0 || strcmp(s, "fp8_e4m3") == 0) *out = MR_KV_FP8;
    else return PD_EINVAL;
    return 0;
}

int mr_kv_dtype_resolve(mr_kv_type kv_dtype, const pd_model *m, pd_dtype *out)
{
    const pd_backend_ops *o = m->be->ops;
    *out = o->act_dtype;
    if (kv_dtype == MR_KV_FP8 || (kv_dtype == MR_KV_AUTO && m->cfg.quant.kv_scales)) {
        if (!o->kv_fp8) return PD_EUNSUPPORTED;
        *out = o->kv_fp8->dtype;
    }
    return 0;
}

/* One runner's copy (a rank's, or the only one's): its own pool, its own heads' bytes. */
static int clone_blocks_one(mr *r, const int32_t *src, const int32_t *dst, int32_t n, char *err)
{
    const pd_backend_ops *o = r->be->ops;
    if (!o->kv_blocks_clone)
        return pd_errf(err, PD_EUNSUPPORTED, "%s backend: no kv_blocks_clone op", o->name);
    const size_t es = pd_dtype_size(r->kv_dtype);
    const size_t block_bytes = r->kv_layer_elems / (size_t)r->p.n_blocks * es;
    int rc = o->kv_blocks_clone(r->be->ctx, r->kv, r->kv_layer_elems * es,
                                2 * r->m->cfg.n_layers, src, dst, n, block_bytes);
    if (rc < 0) return pd_errf(err, rc, "%s backend: kv_blocks_clone failed", o->name);
    return 0;
}

typedef struct {
    mr *g;
    const int32_t *src, *dst;
    int32_t n;
} clone_arg;

static int rank_clone(void *arg, int32_t rank)
{
    clone_arg *a = arg;
    return clone_blocks_one(a->g->ranks[rank], a->src, a->dst, a->n, a->g->rank_err[rank]);
}

int mr_clone_blocks(mr *r, const int32_t *src, const int32_t *dst, int32_t n, char *err)
{
    if (n == 0) return 0;
    if (!r->ranks) return clone_blocks_one(r, src, dst, n, err);
    /* A group: every rank copies its own KV heads of the blocks (the same block ids on every
     * rank), on its own thread, so that the copy is queued in order with that rank's
     * forwards. No collective is involved: a rank that fails leaves the communicator alone,
     * and the engine lets the choices recompute instead. */
    if (r->broken)
        return pd_errf(err, PD_EBACKEND, "tensor parallel: a rank failed in an earlier forward");
    clone_arg a = {r, src, dst, n};
    int32_t bad = -1;
    int rc = tp_pool_run(r->pool, rank_clone, &a, &bad);
    if (rc < 0)
        return pd_errf(err, rc, "tensor parallel rank %d: %s", bad, bad >= 0 ? r->rank_err[bad] : "");
    return 0;
}

int mr_layer_events(mr *r, int32_t layer, void **ev)
{
    if (!r->ranks || !r->layer_fn) return PD_EINVAL;
    return tp_lsync_take(r->lsync, layer, ev);
}

void mr_kv_cache_rank(const mr *r, int32_t rank, int32_t layer, void **k, void **v)
{
    if (r->ranks) r = r->ranks[rank];
    *k = r->k_cache[layer];
    *v = r->v_cache[layer];
}

void mr_kv_cache(const mr *r, int32_t layer, void **k, void **v)
{
    if (r->ranks) r = r->ranks[0];
    *k = r->k_cache[layer];
    *v = r->v_cache[layer];
}

/* Checks everything the kernels index with, so that a bad batch is an error, not a crash. */
static int validate(const mr *r, const mr_batch *b, int32_t *max_q, int32_t *max_ctx, char *err)
{
    const mc_config *c = &r->m->cfg;
    if (b->n_tokens <= 0 || b->n_tokens > r->p.max_num_batched_tokens)
        return pd_errf(err, PD_EINVAL, "batch has %d tokens (allowed 1..%d)", b->n_tokens,
                       r->p.max_num_batched_tokens);
    if (b->n_seqs <= 0 || b->n_seqs > r->p.max_num_seqs)
        return pd_errf(err, PD_EINVAL, "batch has %d sequences (allowed 1..%d)", b->n_seqs,
                       r->p.max_num_seqs);
    if (b->max_blocks_per_seq <= 0 || b->max_blocks_per_seq > r->max_blocks_per_seq)
        return pd_errf(err, PD_EINVAL, "block table width %d (allowed 1..%d)",
                       b->max_blocks_per_seq, r->max_blocks_per_seq);
    /* A row may be asked for more than once (the choices of an n > 1 request sample its
     * last prompt row each with their own seed): at most a step's rows in all. */
    if (b->n_logits < 0 || b->n_logits > r->p.max_num_batched_tokens)
        return pd_errf(err, PD_EINVAL, "%d logits rows requested (allowed 0..%d)", b->n_logits,
                       r->p.max_num_batched_tokens);
    if (b->cu_q[0] != 0 || b->cu_q[b->n_seqs] != b->n_tokens)
        return pd_errf(err, PD_EINVAL, "cu_q must start at 0 and end at n_tokens");
    const int64_t n_slots = (int64_t)r->p.n_blocks * r->p.block_size;
    *max_q = 0;
    *max_ctx = 0;
    for (int32_t s = 0; s < b->n_seqs; s++) {
        int32_t q_len = b->cu_q[s + 1] - b->cu_q[s], ctx = b->ctx_lens[s];
        if (q_len <= 0) return pd_errf(err, PD_EINVAL, "sequence %d has no query tokens", s);
        if (ctx < q_len || ctx > c->max_position)
            return pd_errf(err, PD_EINVAL, "sequence %d: context %d is shorter than its %d new "
                           "tokens or longer than the model maximum %d", s, ctx, q_len,
                           c->max_position);
        int32_t need = (ctx + r->p.block_size - 1) / r->p.block_size;
        if (need > b->max_blocks_per_seq)
            return pd_errf(err, PD_EINVAL, "sequence %d needs %d blocks, table holds %d", s,
                           need, b->max_blocks_per_seq);
        const int32_t *bt = b->block_tables + (size_t)s * b->max_blocks_per_seq;
        for (int32_t i = 0; i < need; i++)
            if (bt[i] < 0 || bt[i] >= r->p.n_blocks)
                return pd_errf(err, PD_EINVAL, "sequence %d: block id %d out of range [0, %d)",
                               s, bt[i], r->p.n_blocks);
        for (int32_t i = b->cu_q[s]; i < b->cu_q[s + 1]; i++) {
            int32_t want = ctx - q_len + (i - b->cu_q[s]);
            if (b->positions[i] != want)
                return pd_errf(err, PD_EINVAL, "token row %d: position %d, expected %d", i,
                               b->positions[i], want);
        }
        if (q_len > *max_q) *max_q = q_len;
        if (ctx > *max_ctx) *max_ctx = ctx;
    }
    for (int32_t i = 0; i < b->n_tokens; i++) {
        if (b->input_ids[i] < 0 || b->input_ids[i] >= c->vocab_size)
            return pd_errf(err, PD_EINVAL, "token id %d at row %d is out of range [0, %d)",
                           b->input_ids[i], i, c->vocab_size);
        if (b->slot_mapping[i] >= n_slots)
            return pd_errf(err, PD_EINVAL, "slot %d at row %d is out of range", b->slot_mapping[i], i);
    }
    for (int32_t i = 0; i < b->n_logits; i++)
        if (b->logits_rows[i] < 0 || b->logits_rows[i] >= b->n_tokens)
            return pd_errf(err, PD_EINVAL, "logits row %d out of range", b->logits_rows[i]);
    return 0;
}

#define CALL(expr) PD_BE_CALL(expr)

/* Metadata offsets (elements): ids, positions, slots and logits rows (T each), cu_q (S + 1),
 * contexts (S), the step's sample slot (1: decode_layers' pick_slot), then the block tables
 * [S][max_blocks_per_seq]. */
static void meta_layout(mr *r)
{
    const size_t T = (size_t)r->p.max_num_batched_tokens, S = (size_t)r->p.max_num_seqs;
    r->o_ids = 0;
    r->o_pos = T;
    r->o_slots = 2 * T;
    r->o_rows = 3 * T;
    r->o_cu_q = 4 * T;
    r->o_ctx = 4 * T + S + 1;
    r->o_tag = 4 * T + 2 * S + 1;
    r->meta_head = 4 * T + 2 * S + 2;
}

/* The d_* pointers into metadata buffer k (1 only with pipelined steps). A step's greedy
 * picks go to the ids of the other buffer, which the next launch, of the other slot, reads. */
static void meta_use(mr *r, int k)
{
    if (!r->d_metas[k]) k = 0;
    int32_t *m = r->d_metas[k];
    r->d_meta = m;
    r->d_ids = m + r->o_ids;
    r->d_pos = m + r->o_pos;
    r->d_slots = m + r->o_slots;
    r->d_rows = m + r->o_rows;
    r->d_cu_q = m + r->o_cu_q;
    r->d_ctx = m + r->o_ctx;
    r->d_tag = m + r->o_tag;
    r->d_bt = m + r->meta_head;
    r->d_ids_next = (r->d_metas[k ^ 1] ? r->d_metas[k ^ 1] : m) + r->o_ids;
}

/* Packs a batch of T rows and S sequences into h_meta (block tables at the batch's width w,
 * packed, or for a few sequences at the full pitch) and copies it to d_meta (block tables at
 * the full pitch). Rows past b->n_tokens and
 * sequences past b->n_seqs are padding: token 0, position 0, no KV store, context 0 (a padding
 * sequence owns one row). b may be NULL: all padding. */
static int upload_meta_from(mr *r, int32_t *h, bool skip_ids, int tag, const mr_batch *b,
                            int32_t T, int32_t S, char *err)
{
    pd_backend *be = r->be;
    const pd_backend_ops *o = be->ops;
    const int32_t nt = b ? b->n_tokens : 0, ns = b ? b->n_seqs : 0, nl = b ? b->n_logits : 0;
    const int32_t w = b ? b->max_blocks_per_seq : 1;
    const size_t ib = sizeof(int32_t);
    if (nt) {
        memcpy(h + r->o_ids, b->input_ids, (size_t)nt * ib);
        memcpy(h + r->o_pos, b->positions, (size_t)nt * ib);
        memcpy(h + r->o_slots, b->slot_mapping, (size_t)nt * ib);
        memcpy(h + r->o_cu_q, b->cu_q, ((size_t)ns + 1) * ib);
        memcpy(h + r->o_ctx, b->ctx_lens, (size_t)ns * ib);
    }
    /* A few sequences' tables go at the full pitch, so that everything is one copy (a copy costs
     * its API call and latency, more than 16 KiB more of it: docs/perf-history.md, issue #8's
     * ninth pass); more go packed at width w and through a copy of their own. */
    const size_t pitch_n = (size_t)r->max_blocks_per_seq;
    const bool one_copy = o->upload_rows && ns > 0 && (size_t)(ns - 1) * pitch_n + w <= 4096;
    if (one_copy)
        for (int32_t s = 0; s < ns; s++)
            memcpy(h + r->meta_head + (size_t)s * pitch_n, b->block_tables + (size_t)s * w,
                   (size_t)w * ib);
    else if (ns)
        memcpy(h + r->meta_head, b->block_tables, (size_t)ns * (size_t)w * ib);
    if (nl) memcpy(h + r->o_rows, b->logits_rows, (size_t)nl * ib); /* graphs read none */
    for (int32_t i = nt; i < T; i++) {
        h[r->o_ids + i] = 0;
        h[r->o_pos + i] = 0;
        h[r->o_slots + i] = -1;
    }
    h[r->o_tag] = tag;
    if (ns == 0) h[r->o_cu_q] = 0;
    for (int32_t s = ns; s < S; s++) { /* padding sequences take the padding rows one each */
        h[r->o_cu_q + s + 1] = h[r->o_cu_q + s] + 1;
        h[r->o_ctx + s] = 0;
    }
    const size_t pitch = pitch_n * ib;
    /* skip_ids (a pipelined launch): the ids are already in d_meta (the step before put its
     * picks there), and nothing queued reads or writes the rest of this buffer (the launch
     * that used it last was collected), so the copies may run beside the step before */
    const size_t o0 = skip_ids ? r->o_pos : 0;
    int (*up)(void *, void *, size_t, const void *, size_t, size_t, size_t) =
        skip_ids && o->upload_rows_overlap ? o->upload_rows_overlap : o->upload_rows;
    if (one_copy) {
        const size_t n = r->meta_head + (size_t)(ns - 1) * pitch_n + (size_t)w - o0;
        CALL(up(be->ctx, r->d_meta + o0, n * ib, h + o0, n * ib, n * ib, 1));
        r->meta_inflight = r->h_meta_pinned;
        return 0;
    }
    if (o->upload_rows) {
        /* Everything before the block tables in one copy (the unused tails of the T- and
         * S-sized arrays go along: one copy beats three), then the tables' used columns. */
        const size_t n = r->meta_head - o0;
        CALL(up(be->ctx, r->d_meta + o0, n * ib, h + o0, n * ib, n * ib, 1));
        if (ns) CALL(up(be->ctx, r->d_bt, pitch, h + r->meta_head, (size_t)w * ib, (size_t)w * ib,
                        (size_t)ns));
        r->meta_inflight = r->h_meta_pinned;
        return 0;
    }
    CALL(o->upload(be->ctx, r->d_meta, PD_DTYPE_I32, 0, h, PD_DTYPE_I32, r->meta_head));
    for (int32_t s = 0; s < ns; s++)
        CALL(o->upload(be->ctx, r->d_bt, PD_DTYPE_I32, (size_t)s * r->max_blocks_per_seq,
                       h + r->meta_head + (size_t)s * w, PD_DTYPE_I32, (size_t)w));
    return 0;
}

/* The steps that run one at a time upload from h_meta, waiting for the last upload first. */
static int upload_meta(mr *r, const mr_batch *b, int32_t T, int32_t S, char *err)
{
    pd_backend *be = r->be;
    if (r->meta_inflight) CALL(be->ops->sync(be->ctx)); /* the last upload may still read h_meta */
    return upload_meta_from(r, r->h_meta, false, PD_SAMPLE_SYNC_SLOT, b, T, S, err);
}

/* A linear's op: its weights' op set's (quantized), else the backend's own. */
#define LIN(ops) ((ops) ? (ops)->linear_fused : o->linear_fused)

/* A layer's MLP products, gate_up (swiglu) then down: in one call of their op set's
 * linear_pair where both are of a set that has one (its intermediate in the set's own form),
 * else the two linear ops. */
static int mlp_products(const pd_backend *be, const pd_layer_weights *w, pd_linear_args *gu,
                        pd_linear_args *dn)
{
    const pd_backend_ops *o = be->ops;
    gu->w = w->gate_up;
    dn->w = w->down;
    if (w->gate_up_ops && w->gate_up_ops == w->down_ops && w->gate_up_ops->linear_pair)
        return w->gate_up_ops->linear_pair(be->ctx, gu, dn);
    const int rc = LIN(w->gate_up_ops)(be->ctx, gu);
    return rc < 0 ? rc : LIN(w->down_ops)(be->ctx, dn);
}

static double mr_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The decode_layers arguments of a step of T one-token sequences on this runner's (or rank's)
 * workspace, metadata and layers, the embedding fused; no head. */
static pd_decode_args decode_args(const mr *r, int32_t T)
{
    const mc_config *c = &r->m->cfg;
    const pd_shard *sh = &r->m->shard;
    return (pd_decode_args){
        .layers = r->dl, .n_layers = c->n_layers, .resid = r->a, .qkv = r->qkv,
        .attn = r->attn, .act = r->act, .n = T, .hidden = c->hidden_size,
        .intermediate = sh->intermediate, .n_heads = sh->n_heads, .n_kv_heads = sh->n_kv_heads,
        .head_dim = c->head_dim, .norm_eps = c->rms_eps, .positions = r->d_pos,
        .slot_mapping = r->d_slots, .ctx_lens = r->d_ctx, .block_tables = r->d_bt,
        .max_blocks_per_seq = r->max_blocks_per_seq, .block_size = r->p.block_size,
        .sliding_window = c->sliding_window, .scale = (float)(1.0 / sqrt((double)c->head_dim)),
        .inv_freq = r->inv_freq, .attn_factor = r->attn_factor, .ids = r->d_ids,
        .embed = r->m->embed,
    };
}

/* A decode step of T sequences on a rank of a group whose every rank's decode_layers takes it
 * with the ranks' sums inside (tp_fused_ns): one kernel a step, as at TP 1, then (final) the
 * final norm into r->h where the logits are made. Every rank decides alike (the same T, the
 * same group-wide switches), so no rank runs this while another runs the ops with NCCL. */
static int run_layers_tp_fused(mr *r, int32_t T, bool final, char *err)
{
    pd_backend *be = r->be;
    const mc_config *c = &r->m->cfg;
    /* the after-the-gate fault: this rank fails without launching, as a failed launch would;
     * the others' kernels wait for its sums until the abort word stops them */
    if (r->fault_now)
        return pd_errf(err, PD_EBACKEND, "injected rank failure after the launch gate, before "
                       "its fused step (PDSERVE_FAULT_TP_RANK)");
    pd_decode_args da = decode_args(r, T);
    da.tp = r->tp_fused;
    const int rc = be->ops->decode_layers(be->ctx, &da);
    if (rc < 0)
        return pd_errf(err, rc, "%s backend: decode_layers (tensor parallel rank %d) failed: %s",
                       be->ops->name, r->rank, pd_strerror(rc));
    if (final && (r->rank == 0 || r->m->head_rows < c->vocab_size))
        CALL(be->ops->rmsnorm(be->ctx, r->a, NULL, r->m->final_norm, T, c->hidden_size,
                              c->rms_eps, r->h));
    return 0;
}

/* run_layers on a rank of a tensor-parallel group: the same stack on this rank's heads and
 * MLP columns. o_proj and down give partial products of the whole rows, into r->h, which the
 * all-reduce sums (the same bits on every rank); the residual add is then fused with the next
 * norm (rmsnorm with a residual), so the residual stream r->a stays the same on every rank.
 * The KV hook (rank 0) runs after the attention block's all-reduce, which every rank reaches
 * only after its layer's KV store, and once every rank's thread recorded its event after its
 * store (tp_lsync: on GPUs the ranks' threads queue their work without waiting for each
 * other). decode_layers is not offered (it has no all-reduce). */
static int run_layers_tp(mr *r, int32_t T, pd_linear_args *lqkv, pd_rope_args *ra,
                         pd_attn_args *aa, int (*attention)(void *, const pd_attn_args *),
                         int (*rope_store)(void *, const pd_rope_args *), bool final, char *err)
{
    pd_backend *be = r->be;
    void *x = be->ctx;
    const pd_backend_ops *o = be->ops;
    const mc_config *c = &r->m->cfg;
    const pd_shard *sh = &r->m->shard;
    const int32_t hs = c->hidden_size, nq = sh->n_heads * c->head_dim, f = sh->intermediate;
    const size_t n_sum = (size_t)T * (size_t)hs;
    pd_comm *cm = r->comm;
    pd_linear_args lo = {.x = r->attn, .out = r->h, .n = T, .k = nq, .m = hs};
    pd_linear_args lgu = {.x = r->h, .out = r->act, .n = T, .k = hs, .m = f, .swiglu = true,
                          .tmp_out = r->gate_up};
    pd_linear_args ld = {.x = r->act, .out = r->h, .n = T, .k = f, .m = hs};
    lqkv->x = r->h; /* the norm is done before: rmsnorm(h + a) */
    lqkv->norm_w = NULL;
    const bool skip_ar = r->debug_skip_ar;
    double t_op = 0;
#define TCALL(k, expr)                                                                      \
    do {                                                                                    \
        if (r->debug_op_timing) { CALL(o->sync(x)); t_op = mr_now_s(); }                    \
        CALL(expr);                                                                         \
        if (r->debug_op_timing) {                                                           \
            CALL(o->sync(x));                                                               \
            r->op_s[k] += mr_now_s() - t_op;                                                \
            r->op_n[k]++;                                                                   \
        }                                                                                   \
    } while (0)
    CALL(o->embedding(x, r->d_ids, T, r->m->embed, hs, r->a));
    for (int32_t l = 0; l < c->n_layers; l++) {
        const pd_layer_weights *w = &r->m->layers[l];
        /* attention block: the previous block's sum into the residual, then its norm */
        if (l == 0) TCALL(0, o->rmsnorm(x, r->a, NULL, w->attn_norm, T, hs, c->rms_eps, r->h));
        else TCALL(0, o->rmsnorm(x, r->h, r->a, w->attn_norm, T, hs, c->rms_eps, r->h));
        lqkv->w = w->qkv;
        lqkv->bias = w->qkv_bias;
        TCALL(1, LIN(w->qkv_ops)(x, lqkv));
        ra->q_norm = w->q_norm;
        ra->k_norm = w->k_norm;
        ra->k_cache = r->k_cache[l];
        ra->v_cache = r->v_cache[l];
        aa->k_cache = r->k_cache[l];
        aa->v_cache = r->v_cache[l];
        ra->k_scale = aa->k_scale = w->k_scale;
        ra->v_scale = aa->v_scale = w->v_scale;
        TCALL(2, rope_store(x, ra));
        /* hooked: this rank's event after its store, on its own stream (tp.h) */
        if (r->layer_fn) tp_lsync_stored(r->lsync, r->rank, l);
        TCALL(3, attention(x, aa));
        lo.w = w->o_proj;
        lo.bias = w->o_bias; /* rank 0's only */
        TCALL(4, LIN(w->o_ops)(x, &lo));
        if (r->fault_now && l == c->n_layers / 2)
            return pd_errf(err, PD_EBACKEND, "injected rank failure after the launch gate "
                           "(PDSERVE_FAULT_TP_RANK)");
        if (!skip_ar)
            TCALL(7, cm->ops->all_reduce_sum(cm->ctx, r->rank, r->h, o->act_dtype, n_sum));
        if (r->layer_fn && r->rank == 0) {
            /* once every rank queued its store (their threads may lag rank 0's) */
            if (!tp_lsync_wait(r->lsync, l))
                return pd_errf(err, PD_EBACKEND, "tensor parallel: another rank failed before "
                               "its KV store of layer %d", l);
            r->layer_fn(r->layer_arg, l);
        }
        /* MLP block (a sparse layer's: this rank's columns of every expert, engine/moe.c) */
        TCALL(0, o->rmsnorm(x, r->h, r->a, w->mlp_norm, T, hs, c->rms_eps, r->h));
        if (w->experts) {
            const int rc = moe_ffn(r->moe, w, l, r->h, T, r->h, false, err);
            if (rc < 0) return rc;
        } else if (r->debug_op_timing) { /* each product's time of its own */
            lgu.w = w->gate_up;
            TCALL(5, LIN(w->gate_up_ops)(x, &lgu));
            ld.w = w->down;
            TCALL(6, LIN(w->down_ops)(x, &ld));
        } else {
            CALL(mlp_products(be, w, &lgu, &ld));
        }
        if (!skip_ar)
            TCALL(7, cm->ops->all_reduce_sum(cm->ctx, r->rank, r->h, o->act_dtype, n_sum));
    }
#undef TCALL
    /* the last block's sum; the final norm only where the logits are made */
    if (final && (r->rank == 0 || r->m->head_rows < c->vocab_size))
        CALL(o->rmsnorm(x, r->h, r->a, r->m->final_norm, T, hs, c->rms_eps, r->h));
    return 0;
}

/* Embedding, every layer and, when `final` is set, the final norm into r->h, for T rows of S
 * sequences whose metadata is in d_meta, the first n_decode of them one row each (the
 * attention op's hint). max_ctx 0 = not known (a graph body). With `head`
 * (and final) the backend may also write every row's logits into r->logits: returns 1 when it
 * did (r->h is then not written), 0 when the caller must. */
static int run_layers(mr *r, int32_t T, int32_t S, int32_t max_q, int32_t max_ctx,
                      int32_t n_decode, bool final, bool head, char *err)
{
    pd_backend *be = r->be;
    void *x = be->ctx;
    const pd_backend_ops *o = be->ops;
    const mc_config *c = &r->m->cfg;
    const pd_shard *sh = &r->m->shard;
    const int32_t hs = c->hidden_size, hd = c->head_dim;
    const int32_t nq = sh->n_heads * hd, f = sh->intermediate;

    pd_attn_args aa = {
        .q = r->qkv, .q_row_stride = r->qkv_dim, .out = r->attn, .cu_q = r->d_cu_q,
        .ctx_lens = r->d_ctx, .block_tables = r->d_bt, .n_seqs = S, .n_tokens = T,
        .max_q_len = max_q, .max_ctx_len = max_ctx, .max_blocks_per_seq = r->max_blocks_per_seq,
        .n_heads = sh->n_heads, .n_kv_heads = sh->n_kv_heads, .head_dim = hd,
        .block_size = r->p.block_size, .sliding_window = c->sliding_window,
        .scale = (float)(1.0 / sqrt((double)hd)), .n_decode = n_decode,
    };
    pd_rope_args ra = {
        .qkv = r->qkv, .positions = r->d_pos, .slot_mapping = r->d_slots, .inv_freq = r->inv_freq,
        .n_tokens = T, .n_heads = sh->n_heads, .n_kv_heads = sh->n_kv_heads, .head_dim = hd,
        .attn_factor = r->attn_factor, .norm_eps = c->rms_eps,
    };
    const pd_kv_ops *kv = r->kv_ops; /* an FP8 cache's ops, else the backend's own */
    int (*attention)(void *, const pd_attn_args *) =
        max_q == 1 ? (kv ? kv->attention_decode : o->attention_decode)
                   : (kv ? kv->attention_prefill : o->attention_prefill);
    int (*rope_store)(void *, const pd_rope_args *) = kv ? kv->rope_store_kv : o->rope_store_kv;

    /* r->a is the residual stream: each block's input norm is fused into its first product,
     * the residual add into its last (accumulate). */
    pd_linear_args lqkv = {.x = r->a, .out = r->qkv, .n = T, .k = hs, .m = r->qkv_dim,
                           .norm_eps = c->rms_eps, .tmp_x = r->h};
    pd_linear_args lo = {.x = r->attn, .out = r->a, .n = T, .k = nq, .m = hs, .accumulate = true};
    pd_linear_args lgu = {.x = r->a, .out = r->act, .n = T, .k = hs, .m = f,
                          .norm_eps = c->rms_eps, .swiglu = true, .tmp_x = r->h,
                          .tmp_out = r->gate_up};
    pd_linear_args ld = {.x = r->act, .out = r->a, .n = T, .k = f, .m = hs, .accumulate = true};

    if (r->comm && max_q == 1 && T == S && T < 32 && (r->tp_fused_ns >> T & 1u) &&
        !r->layer_fn)
        return run_layers_tp_fused(r, T, final, err);
    if (r->comm) return run_layers_tp(r, T, &lqkv, &ra, &aa, attention, rope_store, final, err);
    if (max_q == 1 && T == S && o->decode_layers && r->fused_ok && !r->layer_fn) {
        /* a small decode step the backend runs whole, the embedding included
         * (PD_EUNSUPPORTED: op by op below) */
        pd_decode_args da = decode_args(r, T);
        if (final && head) {
            da.final_norm = r->m->final_norm;
            da.lm_head = r->m->lm_head;
            da.logits = r->logits;
            da.vocab = c->vocab_size;
            da.pick_ids = r->d_ids_next; /* the next step's ids, as the sample ops write them */
            da.pick_slot = r->d_tag;
        }
        int rc = o->decode_layers(x, &da);
        if (rc == 0 && da.lm_head) return 1;
        if (rc == 0) goto final_norm;
        if (rc != PD_EUNSUPPORTED)
            return pd_errf(err, rc, "%s backend: decode_layers failed: %s", be->ops->name,
                           pd_strerror(rc));
    }
    CALL(o->embedding(x, r->d_ids, T, r->m->embed, hs, r->a));
    for (int32_t l = 0; l < c->n_layers; l++) {
        const pd_layer_weights *w = &r->m->layers[l];
        /* attention block */
        lqkv.w = w->qkv;
        lqkv.bias = w->qkv_bias;
        lqkv.norm_w = w->attn_norm;
        CALL(LIN(w->qkv_ops)(x, &lqkv));
        ra.q_norm = w->q_norm; /* Qwen3's per-head norms, fused with the rotation */
        ra.k_norm = w->k_norm;
        ra.k_cache = r->k_cache[l];
        ra.v_cache = r->v_cache[l];
        ra.k_scale = aa.k_scale = w->k_scale;
        ra.v_scale = aa.v_scale = w->v_scale;
        CALL(rope_store(x, &ra));
        aa.k_cache = r->k_cache[l];
        aa.v_cache = r->v_cache[l];
        CALL(attention(x, &aa));
        if (r->layer_fn) /* this layer's KV store is queued: a transfer may take it now */
            r->layer_fn(r->layer_arg, l); /* (on the engine thread: it copies after the store
                                           * on the same stream, or records an event) */
        lo.w = w->o_proj;
        lo.bias = w->o_bias;
        CALL(LIN(w->o_ops)(x, &lo));
        /* MLP block (a sparse layer's: engine/moe.c) */
        if (w->experts) {
            CALL(o->rmsnorm(x, r->a, NULL, w->mlp_norm, T, hs, c->rms_eps, r->h));
            const int rc = moe_ffn(r->moe, w, l, r->h, T, r->a, true, err);
            if (rc < 0) return rc;
            continue;
        }
        lgu.norm_w = w->mlp_norm;
        CALL(mlp_products(be, w, &lgu, &ld));
    }
final_norm:
    if (final) CALL(o->rmsnorm(x, r->a, NULL, r->m->final_norm, T, hs, c->rms_eps, r->h));
    return 0;
}

/* The logits of n rows of x (final-normed hidden states) into rank 0's r->logits: there
 * with the whole head, or with a vocabulary-split head every rank's part gathered (one
 * all-gather; with n > 1 rows the parts [rank][row][part] transposed into rows). */
static int head_logits(mr *r, const void *x_rows, int32_t n, char *err)
{
    pd_backend *be = r->be;
    void *x = be->ctx;
    const pd_backend_ops *o = be->ops;
    const mc_config *c = &r->m->cfg;
    const int32_t hs = c->hidden_size, V = c->vocab_size, Vr = r->m->head_rows;
    if (Vr == V) {
        if (r->rank > 0) return 0;
        CALL(o->linear(x, x_rows, r->m->lm_head, NULL, n, hs, V, r->logits));
        return 0;
    }
    const int32_t N = r->m->shard.n_ranks;
    pd_comm *cm = r->comm;
    CALL(o->linear(x, x_rows, r->m->lm_head, NULL, n, hs, Vr, r->logits_part));
    void *recv = n == 1 ? r->logits : r->logits_gather; /* one row: the parts are the row */
    CALL(cm->ops->all_gather(cm->ctx, r->rank, r->logits_part, recv, o->act_dtype,
                             (size_t)n * (size_t)Vr));
    if (r->rank == 0 && n > 1)
        CALL(o->gather_rows(x, r->logits_gather, r->d_head_tr + (size_t)N * n * (n - 1) / 2,
                            n * N, Vr, r->logits));
    return 0;
}

/* A decode graph's body: B single-token sequences, every row's logits into r->logits. */
static int graph_body(mr *r, int32_t B, char *err)
{
    int rc = run_layers(r, B, B, 1, 0, B, true, true, err);
    if (rc != 0) return rc < 0 ? rc : 0; /* 1: the logits are written */
    return head_logits(r, r->h, B, err);
}

static void drop_graphs(mr *r)
{
    for (int k = 0; k < 2; k++)
        for (int32_t i = 0; i < MAX_GRAPHS; i++) {
            if (r->graphs[k][i]) r->be->ops->graph_destroy(r->be->ctx, r->graphs[k][i]);
            r->graphs[k][i] = NULL;
        }
    r->n_graphs = 0;
}

/* Batch-size buckets: 1, 2, 4, 8, then steps of 8 to 64, of 16 to 128, of 32 beyond; the
 * largest is max_graph_batch itself. */
static int32_t next_bucket(int32_t b)
{
    if (b < 8) return b * 2;
    if (b < 64) return b + 8;
    if (b < 128) return b + 16;
    return b + 32;
}

/* Captures one decode graph per bucket. Each body runs once eagerly first (libraries pick and
 * load their kernels then, outside the capture) on padding rows, which store no KV. A failure
 * leaves the runner eager: slower, never wrong. Returns 0, or PD_EBACKEND when this rank of a
 * group failed in an eager run and aborted the communicator (the group is then of no use). */
static int capture_graphs(mr *r)
{
    const int32_t gmax = r->p.max_graph_batch;
    if (gmax <= 0) return 0;
    bool aborted = false;
    pd_backend *be = r->be;
    char err[PD_ERR_LEN] = "";
    int rc = 0;
    int32_t b = 1, failed_b = 0;
    /* A group's ranks capture at once, each body run eagerly first (its collectives need every
     * rank): they meet at the gate before each eager run, and a rank that failed since the
     * last one stops them all there (a rank that left the loop alone would leave the others
     * waiting in a collective, or at the gate, forever). So every rank makes the same passes
     * of the loop until the gate says stop; a rank that failed goes on to the next gate
     * without capturing. */
    for (int32_t pass = 0; pass < MAX_GRAPHS; pass++, b = next_bucket(b)) {
        if (b > gmax) b = gmax;
        for (int k = 0; k < (r->d_metas[1] ? 2 : 1); k++) { /* one a buffer */
            meta_use(r, k);
            if (rc >= 0) rc = upload_meta(r, NULL, b, b, err);
            if (rc < 0 && !failed_b) failed_b = b;
            if (r->gate) {
                char ge[PD_ERR_LEN];
                if (gate_meet(r, rc >= 0, ge) < 0) {
                    if (rc >= 0) {
                        rc = PD_EBACKEND;
                        snprintf(err, sizeof err, "another rank's capture failed");
                        failed_b = b;
                    }
                    goto out;
                }
            } else if (rc < 0) {
                goto out;
            }
            if (rc < 0) continue; /* a rank that failed: to the next gate */
            if ((rc = graph_body(r, b, err)) < 0 || (rc = be->ops->sync(be->ctx)) < 0) {
                failed_b = b;
                /* between the collectives of the eager run: the others may be waiting in
                 * one for this rank (as rank_forward does after the gate) */
                if (r->gate && !aborted && r->comm->ops->abort) {
                    PD_LOGE("model runner: rank %d failed in its eager run of batch %d during "
                            "graph capture: %s", r->rank, b, err);
                    r->comm->ops->abort(r->comm->ctx);
                    aborted = true;
                }
                continue;
            }
            r->meta_inflight = false;
            if ((rc = be->ops->graph_begin(be->ctx)) < 0) {
                failed_b = b;
                continue;
            }
            rc = graph_body(r, b, err);
            void *g = NULL;
            int rc2 = be->ops->graph_end(be->ctx, &g);
            if (rc >= 0) rc = rc2;
            if (rc < 0) failed_b = b;
            r->graphs[k][r->n_graphs] = g; /* NULL on failure; drop_graphs takes any */
        }
        if (rc < 0 && !r->gate) break;
        if (rc >= 0) r->graph_bs[r->n_graphs++] = b;
        if (b == gmax) break;
    }
out:
    meta_use(r, 0);
    if (rc < 0) {
        PD_LOGW("model runner: decode graphs off (capturing batch %d failed: %s%s%s); steps run "
                "op by op", failed_b ? failed_b : b, pd_strerror(rc),
                err[0] ? ": " : "", err);
        drop_graphs(r);
        (void)be->ops->sync(be->ctx);
        r->meta_inflight = false;
        return aborted ? PD_EBACKEND : 0;
    }
    PD_LOGI("model runner: %d decode graphs captured (batch 1..%d)", r->n_graphs, gmax);
    return 0;
}

/* The graph for a pure decode batch whose logits rows are its rows in order, or -1. */
static int32_t pick_graph(const mr *r, const mr_batch *b, int32_t max_q)
{
    if (r->n_graphs == 0 || max_q != 1 || r->layer_fn || b->n_tokens != b->n_seqs ||
        b->n_seqs > r->p.max_graph_batch || b->n_logits != b->n_seqs)
        return -1;
    for (int32_t i = 0; i < b->n_logits; i++)
        if (b->logits_rows[i] != i) return -1;
    for (int32_t i = 0; i < r->n_graphs; i++)
        if (r->graph_bs[i] >= b->n_seqs) return i;
    return -1;
}

/* The logits of rows [i0, i0 + n) of the batch's logits rows, in r->logits rows [0, n): to
 * the host (logits) or sampled (s). */
static int finish_rows(mr *r, int32_t i0, int32_t n, float *logits, const mr_sampling *s,
                       char *err)
{
    pd_backend *be = r->be;
    const int32_t V = r->m->cfg.vocab_size;
    if (s) {
        CALL(be->ops->sample(be->ctx, r->logits, n, V, s->rows + i0, s->pen, s->n_pen,
                             s->tokens + i0, s->logprobs ? s->logprobs + i0 : NULL,
                             s->logprobs && s->top ? s->top + (size_t)i0 * PD_MAX_TOP_LOGPROBS
                                                   : NULL));
    } else {
        CALL(be->ops->download_f32(be->ctx, logits + (size_t)i0 * V, r->logits,
                                   be->ops->act_dtype, 0, (size_t)n * V));
    }
    r->meta_inflight = false; /* both wait for the queue */
    return 0;
}

static int forward(mr *r, const mr_batch *b, float *logits, const mr_sampling *smp, char *err)
{
    int32_t max_q = 0, max_ctx = 0;
    int rc = validate(r, b, &max_q, &max_ctx, err);
    if (rc < 0) return rc;
    pd_backend *be = r->be;
    void *x = be->ctx;
    const pd_backend_ops *o = be->ops;
    const mc_config *c = &r->m->cfg;
    const int32_t hs = c->hidden_size;

    const int32_t g = pick_graph(r, b, max_q);
    if (g >= 0) {
        const int32_t B = r->graph_bs[g];
        if ((rc = upload_meta(r, b, B, B, err)) < 0) return rc;
        if (r->gate && (rc = gate_meet(r, true, err)) < 0) return rc;
        CALL(o->graph_launch(x, r->graphs[0][g]));
        r->graph_steps++;
        if (r->rank > 0) return 0; /* rank 0 has the logits */
        return finish_rows(r, 0, b->n_logits, logits, smp, err);
    }
    if ((rc = upload_meta(r, b, b->n_tokens, b->n_seqs, err)) < 0) return rc;
    if (r->gate && (rc = gate_meet(r, true, err)) < 0) return rc;
    /* the leading one-row sequences (the scheduler puts running decodes first): a backend may
     * run their attention as a decode batch */
    int32_t n_decode = 0;
    while (n_decode < b->n_seqs && b->cu_q[n_decode + 1] - b->cu_q[n_decode] == 1) n_decode++;
    if ((rc = run_layers(r, b->n_tokens, b->n_seqs, max_q, max_ctx, n_decode, b->n_logits > 0,
                         false, err)) < 0)
        return rc;
    /* rank 0 has the logits; with a vocabulary-split head every rank makes its part */
    if (r->rank > 0 && r->m->head_rows == c->vocab_size) return 0;
    for (int32_t i0 = 0; i0 < b->n_logits; i0 += LOGITS_CHUNK) {
        int32_t n = b->n_logits - i0 < LOGITS_CHUNK ? b->n_logits - i0 : LOGITS_CHUNK;
        CALL(o->gather_rows(x, r->h, r->d_rows + i0, n, hs, r->lh));
        if ((rc = head_logits(r, r->lh, n, err)) < 0) return rc;
        if (r->rank == 0 && (rc = finish_rows(r, i0, n, logits, smp, err)) < 0) return rc;
    }
    return 0;
}

/* ---- tensor-parallel groups ---- */

typedef struct {
    mr *g;
    const mr_batch *b;
    float *logits;
    const mr_sampling *s;
    atomic_int first_bad;         /* the rank that failed first (-1: none) */
    int64_t forward_no;           /* the group's forwards, this one included */
} fan_arg;

/* A rank's forward; rank 0 makes the logits. A rank that fails after the group's checks
 * passed fails between collectives: the communicator is aborted so that no rank waits for it
 * forever. */
static int rank_forward(void *arg, int32_t rank)
{
    fan_arg *f = arg;
    mr *g = f->g;
    mr *r = g->ranks[rank];
    int rc;
    const bool fault = rank == g->fault_rank && f->forward_no == g->fault_forward;
    r->gate_met = r->gate_failed = false;
    r->fault_now = fault && g->fault_after;
    if (fault && !g->fault_after)
        rc = pd_errf(g->rank_err[rank], PD_EBACKEND, "injected rank failure "
                     "(PDSERVE_FAULT_TP_RANK=%d:%lld)", rank, (long long)g->fault_forward);
    else
        rc = forward(r, f->b, rank == 0 ? f->logits : NULL, rank == 0 ? f->s : NULL,
                     g->rank_err[rank]);
    if (rc < 0) tp_lsync_fail(g->lsync); /* rank 0 may wait for this rank's KV store */
    int none = -1;
    if (rc < 0 && !r->gate_met) {
        /* failed before the gate: the others learn it there and launch nothing */
        char ignored[PD_ERR_LEN];
        (void)gate_meet(r, false, ignored);
        (void)atomic_compare_exchange_strong(&f->first_bad, &none, rank);
    } else if (rc < 0 && !r->gate_failed &&
               atomic_compare_exchange_strong(&f->first_bad, &none, rank)) {
        /* failed after it, between collectives: no rank may wait for this one forever */
        if (r->comm->ops->abort) r->comm->ops->abort(r->comm->ctx);
    }
    return rc;
}

static int group_forward(mr *g, const mr_batch *b, float *logits, const mr_sampling *s,
                         char *err)
{
    if (g->broken)
        return pd_errf(err, PD_EBACKEND, "tensor parallel: a rank failed in an earlier forward");
    int32_t max_q = 0, max_ctx = 0;
    int rc = validate(g, b, &max_q, &max_ctx, err); /* every rank would refuse it alike */
    if (rc < 0) return rc;
    fan_arg f = {.g = g, .b = b, .logits = logits, .s = s, .forward_no = ++g->forwards};
    atomic_init(&f.first_bad, -1);
    tp_lsync_reset(g->lsync);
    rc = tp_pool_run(g->pool, rank_forward, &f, NULL);
    tp_lsync_reset(g->lsync); /* the events the hook did not take */
    if (rc < 0) {
        g->broken = true;
        const int32_t bad = atomic_load(&f.first_bad); /* not a rank woken by the abort */
        return pd_errf(err, rc, "tensor parallel rank %d: %s", bad, g->rank_err[bad]);
    }
    return 0;
}

static int rank_capture(void *arg, int32_t rank)
{
    mr *g = arg;
    return capture_graphs(g->ranks[rank]);
}

int mr_create_tp(const mr_params *p, const pd_model *const *shards, int32_t n_ranks,
                 pd_comm *comm, mr **out, char *err)
{
    *out = NULL;
    if (n_ranks == 1 && !comm) return mr_create(p, shards[0], out, err);
    if (n_ranks < 1 || !comm || comm->n_ranks != n_ranks)
        return pd_errf(err, PD_EINVAL, "model runner: %d ranks need a communicator of as many",
                       n_ranks);
    for (int32_t k = 0; k < n_ranks; k++)
        if (shards[k]->shard.rank != k || shards[k]->shard.n_ranks != n_ranks)
            return pd_errf(err, PD_EINVAL, "model runner: shard %d is rank %d of %d", k,
                           shards[k]->shard.rank, shards[k]->shard.n_ranks);
    mr *g = calloc(1, sizeof *g);
    if (!g) return pd_errf(err, PD_ENOMEM, "out of memory");
    g->n_ranks = n_ranks;
    g->m = shards[0];
    g->be = shards[0]->be;
    g->ranks = calloc((size_t)n_ranks, sizeof *g->ranks);
    g->rank_err = calloc((size_t)n_ranks, sizeof *g->rank_err);
    int rc;
    if (!g->ranks || !g->rank_err) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    const bool skip = pd_env_bool("PDSERVE_TP_DEBUG_SKIP_ALLREDUCE");
    for (int32_t k = 0; k < n_ranks; k++) {
        if ((rc = create_rank(p, shards[k], comm, false, &g->ranks[k], err)) < 0) goto fail;
        g->ranks[k]->debug_skip_ar = skip;
        g->ranks[k]->debug_op_timing =
            pd_env_bool("PDSERVE_TP_DEBUG_OP_TIMING") && p->max_graph_batch == 0;
    }
    if ((rc = tp_pool_create(n_ranks, &g->pool, err)) < 0) goto fail;
    if (!(g->gate = calloc(1, sizeof *g->gate))) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    pthread_mutex_init(&g->gate->mu, NULL);
    pthread_cond_init(&g->gate->cv, NULL);
    g->gate->n = n_ranks;
    for (int32_t k = 0; k < n_ranks; k++) g->ranks[k]->gate = g->gate;
    g->fault_rank = -1;
    const char *fault = pd_env_str("PDSERVE_FAULT_TP_RANK");
    if (*fault) {
        int fr = -1;
        long long fn = 0;
        char when[8] = "";
        int got = sscanf(fault, "%d:%lld:%7s", &fr, &fn, when);
        if (got >= 2 && fr >= 0 && fr < n_ranks && fn >= 1 &&
            (got == 2 || !strcmp(when, "after"))) {
            g->fault_rank = fr;
            g->fault_forward = fn;
            g->fault_after = got == 3;
            PD_LOGW("PDSERVE_FAULT_TP_RANK=%s: rank %d fails forward %lld (testing)", fault, fr,
                    fn);
        } else {
            PD_LOGW("PDSERVE_FAULT_TP_RANK=%s ignored: want RANK:FORWARD[:after], a rank below "
                    "%d and a forward from 1", fault, n_ranks);
        }
    }
    g->rank_be = calloc((size_t)n_ranks, sizeof *g->rank_be);
    if (!g->rank_be) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    for (int32_t k = 0; k < n_ranks; k++) g->rank_be[k] = shards[k]->be;
    if ((rc = tp_lsync_create(n_ranks, shards[0]->cfg.n_layers, g->rank_be, &g->lsync, err)) < 0)
        goto fail;
    for (int32_t k = 0; k < n_ranks; k++) g->ranks[k]->lsync = g->lsync;
    /* The ranks' pools were sized alike unless from each device's free memory: the group
     * uses the smallest (the others' extra blocks stay unused). */
    g->p = g->ranks[0]->p;
    for (int32_t k = 1; k < n_ranks; k++)
        if (g->ranks[k]->p.n_blocks < g->p.n_blocks) g->p.n_blocks = g->ranks[k]->p.n_blocks;
    g->max_blocks_per_seq = g->ranks[0]->max_blocks_per_seq;
    /* Fused decode steps: the step sizes every rank's decode_layers takes with the ranks'
     * sums inside (its checks only: nothing runs), so that every rank decides alike. Not with
     * the diagnostics of the ops (PDSERVE_TP_DEBUG_*). */
    uint32_t ns = 0;
    const bool diag = g->ranks[0]->debug_skip_ar || g->ranks[0]->debug_op_timing;
    for (int32_t n = 1; n < 32 && !diag; n++) {
        bool all = n <= p->max_num_seqs && n <= p->max_num_batched_tokens;
        for (int32_t k = 0; all && k < n_ranks; k++) {
            mr *rk = g->ranks[k];
            pd_decode_args da = decode_args(rk, n);
            da.tp = rk->tp_fused;
            da.check_only = true;
            all = rk->tp_fused && rk->fused_ok && rk->be->ops->decode_layers &&
                  rk->be->ops->decode_layers(rk->be->ctx, &da) == 0;
        }
        if (all) ns |= 1u << n;
    }
    for (int32_t k = 0; k < n_ranks; k++) g->ranks[k]->tp_fused_ns = ns;
    if (ns) {
        int32_t lo = 1, hi = 31;
        while (!(ns >> lo & 1u)) lo++;
        while (!(ns >> hi & 1u)) hi--;
        PD_LOGI("tensor parallel: decode steps of %d .. %d sequences run fused (one kernel a "
                "rank, the sums through peer memory)", lo, hi);
    }
    /* Graphs: every rank captures at once (an eager run of each body first, whose all-reduces
     * need every rank); a rank that captured other buckets turns them off everywhere. */
    int32_t bad = -1;
    if (tp_pool_run(g->pool, rank_capture, g, &bad) < 0) {
        rc = pd_errf(err, PD_EBACKEND, "tensor parallel: rank %d failed in an eager run while "
                     "capturing the decode graphs (the communicator was aborted)", bad);
        goto fail;
    }
    for (int32_t k = 1; k < n_ranks; k++)
        if (g->ranks[k]->n_graphs != g->ranks[0]->n_graphs) {
            PD_LOGW("model runner: decode graphs off (rank %d captured %d, rank 0 %d)", k,
                    g->ranks[k]->n_graphs, g->ranks[0]->n_graphs);
            for (int32_t j = 0; j < n_ranks; j++) drop_graphs(g->ranks[j]);
            break;
        }
    *out = g;
    return 0;
fail:
    mr_destroy(g);
    return rc;
}

int32_t mr_n_ranks(const mr *r) { return r->ranks ? r->n_ranks : 1; }

uint32_t mr_tp_fused_sizes(const mr *r) { return r->ranks ? r->ranks[0]->tp_fused_ns : 0; }

int mr_forward(mr *r, const mr_batch *b, float *logits, char *err)
{
    if (r->ranks) return group_forward(r, b, logits, NULL, err);
    return forward(r, b, logits, NULL, err);
}

bool mr_samples_on_backend(const mr *r) { return r->be->ops->sample != NULL; }

int mr_forward_sample(mr *r, const mr_batch *b, const mr_sampling *s, char *err)
{
    if (!r->be->ops->sample)
        return pd_errf(err, PD_EINVAL, "the %s backend does not sample", r->be->ops->name);
    if (!s || (b->n_logits > 0 && (!s->rows || !s->tokens)) || s->n_pen < 0 ||
        (s->n_pen > 0 && !s->pen))
        return pd_errf(err, PD_EINVAL, "model runner: sampling arguments missing");
    if (r->ranks) return group_forward(r, b, NULL, s, err);
    return forward(r, b, NULL, s, err);
}

bool mr_can_launch(const mr *r) { return r->h_meta2 != NULL && r->n_graphs > 0; }

int mr_launch(mr *r, const mr_batch *b, const mr_sampling *s, bool ids_from_last, char *err)
{
    pd_backend *be = r->be;
    const pd_backend_ops *o = be->ops;
    if (!mr_can_launch(r)) return PD_EUNSUPPORTED;
    if (r->n_out == 2)
        return pd_errf(err, PD_ESTATE, "model runner: two launches are already outstanding");
    if (!s || !s->rows || !s->tokens || s->n_pen < 0 || (s->n_pen > 0 && !s->pen))
        return pd_errf(err, PD_EINVAL, "model runner: sampling arguments missing");
    if (ids_from_last && r->n_out == 0)
        return pd_errf(err, PD_ESTATE, "model runner: no launch to take the input ids from");
    int32_t max_q = 0, max_ctx = 0;
    int rc = validate(r, b, &max_q, &max_ctx, err);
    if (rc < 0) return rc;
    const int32_t g = pick_graph(r, b, max_q);
    if (g < 0) return PD_EUNSUPPORTED; /* nothing queued: run it with mr_forward_sample */
    /* Launches alternate between the two metadata buffers: the one before this may still be
     * reading its own (it is queued behind the step before it); the one before that was
     * collected, so its upload is done. */
    const int slot = (int)(r->n_launches & 1);
    meta_use(r, slot);
    rc = upload_meta_from(r, slot ? r->h_meta2 : r->h_meta, ids_from_last, slot, b,
                          r->graph_bs[g], r->graph_bs[g], err);
    int32_t *ids_next = r->d_ids_next;
    meta_use(r, 0);
    if (rc < 0) return rc;
    r->meta_inflight = false; /* a collect waits for the queue past it */
    CALL(o->graph_launch(be->ctx, r->graphs[slot][g]));
    CALL(o->sample_launch(be->ctx, r->logits, b->n_logits, r->m->cfg.vocab_size, s->rows, s->pen,
                          s->n_pen, s->logprobs != NULL, ids_next, slot));
    r->graph_steps++;
    r->n_launches++;
    r->out[r->n_out].slot = slot;
    r->out[r->n_out].tokens = s->tokens;
    r->out[r->n_out].logprobs = s->logprobs;
    r->out[r->n_out].top = s->logprobs ? s->top : NULL;
    r->n_out++;
    return 0;
}

int mr_collect(mr *r, char *err)
{
    pd_backend *be = r->be;
    if (r->n_out == 0) return pd_errf(err, PD_ESTATE, "model runner: nothing launched to collect");
    const int slot = r->out[0].slot;
    int32_t *tokens = r->out[0].tokens;
    float *logprobs = r->out[0].logprobs;
    pd_top_logprob *top = r->out[0].top;
    r->out[0] = r->out[1];
    r->n_out--;
    CALL(be->ops->sample_collect(be->ctx, slot, tokens, logprobs, top));
    return 0;
}

int32_t mr_n_graphs(const mr *r) { return r->ranks ? r->ranks[0]->n_graphs : r->n_graphs; }
int64_t mr_graph_steps(const mr *r)
{
    return r->ranks ? r->ranks[0]->graph_steps : r->graph_steps;
}
