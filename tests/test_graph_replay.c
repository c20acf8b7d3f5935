/* test_graph_replay.c -- The model runner's decode-graph path, on the CPU: a backend that is the
 * CPU backend plus graph ops that record the compute ops queued between graph_begin and
 * graph_end and replay them on graph_launch (what CUDA graphs do with kernels), plus pinned
 * host memory and row uploads as plain host memory. A runner on it captures its decode graphs
 * and replays them for decode steps, padded to the bucket; its logits must equal those of an
 * eager CPU runner on the same weights, step after step, as the batch shrinks from 5 sequences
 * (bucket 8) to 3 (bucket 4) to 1 (bucket 1), and steps that cannot replay a graph (prompt
 * chunks, logits of a subset of rows) must run eagerly. So CI, without a GPU, covers the
 * runner's padding, bucket choice, metadata layout and graph bookkeeping. With a split sample
 * op (greedy, on the host) it also runs pipelined steps (mr_launch / mr_collect) against the
 * same steps one at a time. Tensor parallelism too: a runner of 2 and 4 ranks on the
 * recording backend, whose communicator's all-reduces are recorded into the graphs (each rank
 * records on its own thread, as CUDA captures NCCL calls on the rank's stream) and replayed by
 * every rank at once, against the eager runner at TP 1. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "engine/tp.h"
#include "kernels/backend.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"
#include "text/model_config.h"

/* ---- the recording backend ---- */

typedef enum {
    R_EMB, R_RMS, R_LIN, R_LINF, R_ROPE, R_ATTN, R_SWIGLU, R_GATHER, R_ALL_REDUCE, R_ALL_GATHER
} rec_kind;

typedef struct {
    rec_kind k;
    const void *x, *w, *bias, *table;
    void *res, *out;
    const int32_t *ids;
    int32_t n, k2, m, dim;
    float eps;
    pd_rope_args rope;
    pd_attn_args attn;
    pd_linear_args lin;
    pd_comm *comm;               /* R_ALL_REDUCE / R_ALL_GATHER: the CPU communicator, rank,
                                  * count (R_ALL_GATHER: x sent, out received) */
    int32_t rank;
    size_t count;
} rec;

typedef struct {
    rec *r;
    int n, cap;
} graph;

static const pd_backend_ops *g_cpu;  /* the CPU backend's own table */
static pd_backend_ops g_ops;         /* its copy with the wrappers below */
static _Thread_local graph *g_rec;   /* the graph this thread records, or NULL (a rank a thread) */
static _Atomic int g_replays;

/* Appends a record when recording; returns 1 if it did (the op must not run now). */
static int record(const rec *r)
{
    if (!g_rec) return 0;
    if (g_rec->n == g_rec->cap) {
        int cap = g_rec->cap ? 2 * g_rec->cap : 64;
        rec *p = realloc(g_rec->r, (size_t)cap * sizeof *p);
        if (!p) abort();
        g_rec->r = p;
        g_rec->cap = cap;
    }
    g_rec->r[g_rec->n++] = *r;
    return 1;
}

static int w_embedding(void *ctx, const int32_t *ids, int32_t n, const void *table, int32_t dim,
                       void *out)
{
    rec r = {.k = R_EMB, .ids = ids, .n = n, .table = table, .dim = dim, .out = out};
    return record(&r) ? 0 : g_cpu->embedding(ctx, ids, n, table, dim, out);
}

static int w_rmsnorm(void *ctx, const void *x, void *res, const void *w, int32_t n, int32_t dim,
                     float eps, void *out)
{
    rec r = {.k = R_RMS, .x = x, .res = res, .w = w, .n = n, .dim = dim, .eps = eps, .out = out};
    return record(&r) ? 0 : g_cpu->rmsnorm(ctx, x, res, w, n, dim, eps, out);
}

static int w_linear(void *ctx, const void *x, const void *w, const void *bias, int32_t n,
                    int32_t k, int32_t m, void *out)
{
    rec r = {.k = R_LIN, .x = x, .w = w, .bias = bias, .n = n, .k2 = k, .m = m, .out = out};
    return record(&r) ? 0 : g_cpu->linear(ctx, x, w, bias, n, k, m, out);
}

static int w_linear_fused(void *ctx, const pd_linear_args *a)
{
    rec r = {.k = R_LINF, .lin = *a};
    return record(&r) ? 0 : g_cpu->linear_fused(ctx, a);
}

static int w_rope(void *ctx, const pd_rope_args *a)
{
    rec r = {.k = R_ROPE, .rope = *a};
    return record(&r) ? 0 : g_cpu->rope_store_kv(ctx, a);
}

static int w_attention(void *ctx, const pd_attn_args *a)
{
    rec r = {.k = R_ATTN, .attn = *a};
    return record(&r) ? 0 : g_cpu->attention_decode(ctx, a);
}

static int w_swiglu(void *ctx, const void *gate_up, int32_t n, int32_t f, void *out)
{
    rec r = {.k = R_SWIGLU, .x = gate_up, .n = n, .dim = f, .out = out};
    return record(&r) ? 0 : g_cpu->swiglu(ctx, gate_up, n, f, out);
}

static int w_gather_rows(void *ctx, const void *x, const int32_t *idx, int32_t n_idx,
                         int32_t dim, void *out)
{
    rec r = {.k = R_GATHER, .x = x, .ids = idx, .n = n_idx, .dim = dim, .out = out};
    return record(&r) ? 0 : g_cpu->gather_rows(ctx, x, idx, n_idx, dim, out);
}

/* Anything else queued while recording cannot be in a graph: the capture fails. */
static int w_sync(void *ctx) { return g_rec ? PD_EBACKEND : g_cpu->sync(ctx); }

/* test_capture_failure: the backend context whose graph_begin fails, and after how many more
 * calls (tp_side_open sets the context of rank g_fail_rank). */
static int32_t g_fail_rank = -1;
static void *g_fail_ctx;
static int g_fail_left;

static int w_graph_begin(void *ctx)
{
    if (ctx == g_fail_ctx && --g_fail_left == 0) return PD_EBACKEND;
    if (g_rec) return PD_EBACKEND;
    g_rec = calloc(1, sizeof *g_rec);
    return g_rec ? 0 : PD_ENOMEM;
}

static int w_graph_end(void *ctx, void **out)
{
    (void)ctx;
    *out = g_rec;
    g_rec = NULL;
    return *out ? 0 : PD_EBACKEND;
}

static int w_graph_launch(void *ctx, void *gp)
{
    const graph *g = gp;
    g_replays++;
    for (int i = 0; i < g->n; i++) {
        const rec *r = &g->r[i];
        int rc = 0;
        switch (r->k) {
        case R_EMB: rc = g_cpu->embedding(ctx, r->ids, r->n, r->table, r->dim, r->out); break;
        case R_RMS: rc = g_cpu->rmsnorm(ctx, r->x, r->res, r->w, r->n, r->dim, r->eps, r->out); break;
        case R_LIN: rc = g_cpu->linear(ctx, r->x, r->w, r->bias, r->n, r->k2, r->m, r->out); break;
        case R_LINF: rc = g_cpu->linear_fused(ctx, &r->lin); break;
        case R_ROPE: rc = g_cpu->rope_store_kv(ctx, &r->rope); break;
        case R_ATTN: rc = g_cpu->attention_decode(ctx, &r->attn); break;
        case R_SWIGLU: rc = g_cpu->swiglu(ctx, r->x, r->n, r->dim, r->out); break;
        case R_GATHER: rc = g_cpu->gather_rows(ctx, r->x, r->ids, r->n, r->dim, r->out); break;
        case R_ALL_REDUCE:
            rc = r->comm->ops->all_reduce_sum(r->comm->ctx, r->rank, r->out, PD_DTYPE_F32,
                                              r->count);
            break;
        case R_ALL_GATHER:
            rc = r->comm->ops->all_gather(r->comm->ctx, r->rank, r->x, r->out, PD_DTYPE_F32,
                                          r->count);
            break;
        }
        if (rc < 0) return rc;
    }
    return 0;
}

static void w_graph_destroy(void *ctx, void *gp)
{
    (void)ctx;
    graph *g = gp;
    if (!g) return;
    free(g->r);
    free(g);
}

static int w_host_alloc(void *ctx, size_t bytes, void **out)
{
    (void)ctx;
    *out = malloc(bytes);
    return *out ? 0 : PD_ENOMEM;
}

static void w_host_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static int w_upload_rows(void *ctx, void *dst, size_t dst_pitch, const void *src,
                         size_t src_pitch, size_t row_bytes, size_t rows)
{
    (void)ctx;
    if (g_rec) return PD_EBACKEND; /* the runner uploads before a launch, never inside */
    for (size_t i = 0; i < rows; i++)
        memcpy((char *)dst + i * dst_pitch, (const char *)src + i * src_pitch, row_bytes);
    return 0;
}

/* The split sample op (sample_launch / sample_collect), greedy rows only: the queue is the CPU,
 * so a launch picks at once; its picks wait in the slot for the collect, and go to ids_out as
 * the op's contract says. A launch over a slot not yet collected is an error. */
static struct {
    int32_t n;
    int32_t tok[64];
} g_slot[2];
static int g_pipe_launches;

static int w_sample_launch(void *ctx, void *logits, int32_t n, int32_t vocab,
                           const pd_sample_row *rows, const pd_penalty_tok *pen, int32_t n_pen,
                           bool logprobs, int32_t *ids_out, int slot)
{
    (void)ctx;
    (void)pen;
    if (g_rec || slot < 0 || slot > 1 || g_slot[slot].n || n <= 0 || n > 64 || n_pen ||
        logprobs)
        return PD_EINVAL;
    for (int32_t i = 0; i < n; i++) {
        if (rows[i].temperature > 0.0f) return PD_EINVAL; /* greedy only */
        const float *l = (const float *)logits + (size_t)i * vocab;
        int32_t b = 0;
        for (int32_t t = 1; t < vocab; t++)
            if (l[t] > l[b]) b = t;
        g_slot[slot].tok[i] = b;
        if (ids_out) ids_out[i] = b; /* backend memory is host memory here */
    }
    g_slot[slot].n = n;
    g_pipe_launches++;
    return 0;
}

static int w_sample_collect(void *ctx, int slot, int32_t *tokens, float *logprobs,
                            pd_top_logprob *top)
{
    (void)ctx;
    if (slot < 0 || slot > 1 || !g_slot[slot].n || logprobs || top) return PD_EINVAL;
    memcpy(tokens, g_slot[slot].tok, (size_t)g_slot[slot].n * sizeof *tokens);
    g_slot[slot].n = 0;
    return 0;
}

static int open_backend(bool graphs, pd_backend **out, char *err)
{
    int rc = pd_backend_create("cpu", NULL, out, err);
    if (rc < 0 || !graphs) return rc;
    g_cpu = (*out)->ops;
    g_ops = *g_cpu;
    g_ops.name = "cpu-graphs";
    g_ops.embedding = w_embedding;
    g_ops.rmsnorm = w_rmsnorm;
    g_ops.linear = w_linear;
    g_ops.linear_fused = w_linear_fused;
    g_ops.rope_store_kv = w_rope;
    g_ops.attention_decode = w_attention;
    g_ops.swiglu = w_swiglu;
    g_ops.gather_rows = w_gather_rows;
    g_ops.sync = w_sync;
    g_ops.graph_begin = w_graph_begin;
    g_ops.graph_end = w_graph_end;
    g_ops.graph_launch = w_graph_launch;
    g_ops.graph_destroy = w_graph_destroy;
    g_ops.host_alloc = w_host_alloc;
    g_ops.host_free = w_host_free;
    g_ops.upload_rows = w_upload_rows;
    g_ops.upload_rows_overlap = w_upload_rows; /* everything here runs in order */
    g_ops.sample_launch = w_sample_launch;
    g_ops.sample_collect = w_sample_collect;
    (*out)->ops = &g_ops;
    return 0;
}

/* The CPU communicator with its all-reduce and all-gather recorded while the calling rank's thread records a
 * graph (ctx: the CPU communicator). */
static int wc_all_reduce(void *ctx, int32_t rank, void *buf, pd_dtype t, size_t n)
{
    pd_comm *c = ctx;
    rec r = {.k = R_ALL_REDUCE, .comm = c, .rank = rank, .out = buf, .count = n};
    return record(&r) ? 0 : c->ops->all_reduce_sum(c->ctx, rank, buf, t, n);
}

static int wc_all_gather(void *ctx, int32_t rank, const void *send, void *recv, pd_dtype t,
                         size_t n)
{
    pd_comm *c = ctx;
    rec r = {.k = R_ALL_GATHER, .comm = c, .rank = rank, .x = send, .out = recv, .count = n};
    return record(&r) ? 0 : c->ops->all_gather(c->ctx, rank, send, recv, t, n);
}

static int wc_barrier(void *ctx, int32_t rank)
{
    pd_comm *c = ctx;
    return g_rec ? PD_EBACKEND : c->ops->barrier(c->ctx, rank);
}

static void wc_abort(void *ctx)
{
    pd_comm *c = ctx;
    c->ops->abort(c->ctx);
}

static void wc_destroy(void *ctx) { pd_comm_destroy(ctx); }

static const pd_comm_ops k_wc_ops = {"cpu-graphs", wc_destroy, wc_all_reduce, wc_all_gather,
                                     wc_barrier, wc_abort, NULL};

/* A model on n ranks of the recording backend (a tp_group made by hand: tp_group_load would
 * make plain CPU backends), its runner in tg_model-like fields. */
typedef struct {
    tp_group g;
    pd_backend *be[4];
    pd_model *ms[4];
    mr *r;
} tp_side;

static int tp_side_open(const char *dir, int32_t n, const mr_params *mp, tp_side *t, char *err)
{
    memset(t, 0, sizeof *t);
    mc_config cfg;
    pd_comm *inner = NULL;
    int rc = mc_load(dir, &cfg, err);
    if (rc < 0 || (rc = pd_comm_cpu_create(n, &inner, err)) < 0) return rc;
    t->g = (tp_group){.n_ranks = n, .be = t->be, .models = t->ms,
                      .comm = calloc(1, sizeof(pd_comm))};
    if (!t->g.comm) {
        pd_comm_destroy(inner);
        return PD_ENOMEM;
    }
    *t->g.comm = (pd_comm){.ops = &k_wc_ops, .ctx = inner, .n_ranks = n};
    for (int32_t k = 0; k < n; k++)
        if ((rc = open_backend(true, &t->be[k], err)) < 0 ||
            (rc = pd_model_load_shard(&cfg, dir, PD_LOAD_SAFETENSORS, 0, t->be[k], k, n,
                                      &t->ms[k], err)) < 0)
            return rc;
    if (g_fail_rank >= 0 && g_fail_rank < n) g_fail_ctx = t->be[g_fail_rank]->ctx;
    return mr_create_tp(mp, (const pd_model *const *)t->ms, n, t->g.comm, &t->r, err);
}

static void tp_side_close(tp_side *t)
{
    mr_destroy(t->r);
    for (int32_t k = 0; k < 4; k++) pd_model_destroy(t->ms[k]);
    pd_comm_destroy(t->g.comm);
    for (int32_t k = 0; k < 4; k++) pd_backend_destroy(t->be[k]);
    memset(t, 0, sizeof *t);
}

/* ---- the test ---- */

enum { N_SEQS = 5, N_BLOCKS = 96, BS = 16, N_STEPS = 12 };

static mr_params side_params(bool graphs)
{
    mr_params mp = mr_default_params();
    mp.block_size = BS;
    mp.n_blocks = N_BLOCKS;
    mp.max_num_batched_tokens = 256;
    mp.max_num_seqs = 8;
    mp.max_graph_batch = graphs ? 8 : 0;
    return mp;
}

static int side_open(const char *dir, bool graphs, tg_model *s, char *err)
{
    memset(s, 0, sizeof *s);
    mr_params mp = side_params(graphs);
    pd_backend *be = NULL;
    int rc = open_backend(graphs, &be, err);
    return rc < 0 ? rc : tg_open_on(dir, &mp, be, s, err);
}

static int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* Largest |a - b| over n values, and the largest |b|. */
static void diff(const float *a, const float *b, size_t n, double *max_diff, double *max_ref)
{
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > *max_diff || isnan(d)) *max_diff = isnan(d) ? INFINITY : d;
        if (fabs(b[i]) > *max_ref) *max_ref = fabs(b[i]);
    }
}

/* n prompts of q_lens[s] random ids (an LCG from seed), each sequence its own blocks,
 * interleaved (block b of sequence s is s + n b), room for `steps` more tokens: fills bt
 * (width a row), the batch's rows (ids, pos, slots), cu, ctx and rows (every sequence's last
 * row); returns the row count. */
static int32_t make_prompts(int n, const int32_t *q_lens, int steps, int32_t width, int32_t V,
                            uint32_t seed, int32_t *bt, int32_t *ids, int32_t *pos,
                            int32_t *slots, int32_t *cu, int32_t *ctx, int32_t *rows)
{
    for (int s = 0; s < n; s++)
        for (int b = 0; b < (q_lens[s] + steps + BS - 1) / BS; b++) bt[s * width + b] = s + n * b;
    int32_t T = 0;
    uint32_t rs = seed;
    cu[0] = 0;
    for (int s = 0; s < n; s++) {
        cu[s + 1] = cu[s] + q_lens[s];
        ctx[s] = q_lens[s];
        rows[s] = cu[s + 1] - 1;
        for (int i = 0; i < q_lens[s]; i++, T++) {
            rs = rs * 1664525u + 1013904223u;
            ids[T] = (int32_t)(rs % (uint32_t)V);
            pos[T] = i;
            slots[T] = bt[s * width + i / BS] * BS + i % BS;
        }
    }
    return T;
}

/* Two runners on golden model `name`: a with graphs, b with graphs when b_graphs. False (a
 * failed check, both closed) when either does not open. */
static bool open_pair(const char *name, bool b_graphs, tg_model *a, tg_model *b)
{
    char dir[1024], err[PD_ERR_LEN] = "";
    snprintf(dir, sizeof dir, "%s/testdata/golden/%s", pd_test_shared_dir(), name);
    memset(a, 0, sizeof *a);
    memset(b, 0, sizeof *b);
    if (side_open(dir, true, a, err) < 0 || side_open(dir, b_graphs, b, err) < 0) {
        CHECK_MSG(0, "%s: %s", name, err);
        tg_close(a);
        tg_close(b);
        return false;
    }
    return true;
}

/* Graph runner (n_tp ranks) against an eager one at TP 1. */
static void run(const char *name, int32_t n_tp)
{
    char err[PD_ERR_LEN] = "";
    tg_model gr, eg;
    tp_side tps;
    memset(&tps, 0, sizeof tps);
    if (n_tp == 1) {
        if (!open_pair(name, false, &gr, &eg)) return;
    } else {
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/testdata/golden/%s", pd_test_shared_dir(), name);
        mr_params mp = side_params(true);
        int rc = tp_side_open(dir, n_tp, &mp, &tps, err);
        if (rc < 0 || side_open(dir, false, &eg, err) < 0) {
            CHECK_MSG(0, "%s TP %d: %s", name, n_tp, err);
            tp_side_close(&tps);
            tg_close(&eg);
            return;
        }
        memset(&gr, 0, sizeof gr);
        gr.r = tps.r;
        gr.m = tps.ms[0];
    }
    CHECK_MSG(mr_n_graphs(gr.r) == 4, "%s: %d graphs captured, expected 4 (1, 2, 4, 8)", name,
              mr_n_graphs(gr.r));
    CHECK_EQ_INT(mr_n_graphs(eg.r), 0);
    const int32_t V = gr.m->cfg.vocab_size, width = mr_max_blocks_per_seq(gr.r);
    const int32_t q_lens[N_SEQS] = {9, 23, 5, 17, 31};
    int32_t *bt = calloc((size_t)N_SEQS * width, sizeof *bt);
    int32_t ids[128], pos[128], slots[128], rows[128], cu[N_SEQS + 1] = {0}, ctx[N_SEQS];
    int32_t *dbt = calloc((size_t)N_SEQS * width, sizeof *dbt); /* a step's tables */
    float *lg = malloc((size_t)128 * V * sizeof(float)), *le = malloc((size_t)128 * V * sizeof(float));
    const int32_t T = make_prompts(N_SEQS, q_lens, N_STEPS, width, V, 12345, bt, ids, pos, slots,
                                   cu, ctx, rows);
    /* The prompts, logits of every sequence's last row: eager on both. */
    mr_batch b = {T, ids, pos, slots, N_SEQS, cu, ctx, bt, width, N_SEQS, rows};
    CHECK(mr_forward(gr.r, &b, lg, err) == 0 && mr_forward(eg.r, &b, le, err) == 0);
    CHECK_EQ_INT((int)mr_graph_steps(gr.r), 0);
    double max_diff = 0, max_ref = 0;
    diff(lg, le, (size_t)N_SEQS * V, &max_diff, &max_ref);
    int32_t last[N_SEQS], live[N_SEQS];
    for (int s = 0; s < N_SEQS; s++) {
        last[s] = argmax(le + (size_t)s * V, V);
        live[s] = s;
    }
    /* Decode: 5 sequences (bucket 8), then 3 (bucket 4), then 1 (bucket 1); every step's
     * logits compared; the eager runner's argmax is fed to both. */
    int n_live = N_SEQS, expect_graph = 0;
    for (int step = 0; step < N_STEPS; step++) {
        if (step == 4) n_live = 3;
        if (step == 8) n_live = 1;
        int32_t dcu[N_SEQS + 1] = {0}, dctx[N_SEQS];
        for (int i = 0; i < n_live; i++) {
            const int s = live[i];
            ids[i] = last[s];
            pos[i] = ctx[s];
            slots[i] = bt[s * width + ctx[s] / BS] * BS + ctx[s] % BS;
            dctx[i] = ++ctx[s];
            dcu[i + 1] = i + 1;
            rows[i] = i;
            memcpy(dbt + i * width, bt + s * width, (size_t)width * sizeof *bt);
        }
        mr_batch d = {n_live, ids, pos, slots, n_live, dcu, dctx, dbt, width, n_live, rows};
        int rg = mr_forward(gr.r, &d, lg, err), re = mr_forward(eg.r, &d, le, err);
        CHECK_MSG(rg == 0 && re == 0, "%s step %d: %s", name, step, err);
        expect_graph++;
        diff(lg, le, (size_t)n_live * V, &max_diff, &max_ref);
        for (int i = 0; i < n_live; i++) last[live[i]] = argmax(le + (size_t)i * V, V);
    }
    CHECK_MSG(mr_graph_steps(gr.r) == expect_graph, "%s: %lld of %d decode steps replayed a graph",
              name, (long long)mr_graph_steps(gr.r), expect_graph);
    /* Logits of a subset of the rows: no graph (its logits rows are not the batch's rows). */
    {
        int32_t dcu[3] = {0, 1, 2}, dctx[2], one_row = 1;
        for (int i = 0; i < 2; i++) {
            const int s = i;
            ids[i] = last[s];
            pos[i] = ctx[s];
            slots[i] = bt[s * width + ctx[s] / BS] * BS + ctx[s] % BS;
            dctx[i] = ++ctx[s];
            memcpy(dbt + i * width, bt + s * width, (size_t)width * sizeof *bt);
        }
        mr_batch d = {2, ids, pos, slots, 2, dcu, dctx, dbt, width, 1, &one_row};
        CHECK(mr_forward(gr.r, &d, lg, err) == 0 && mr_forward(eg.r, &d, le, err) == 0);
        CHECK_MSG(mr_graph_steps(gr.r) == expect_graph, "%s: a subset-of-rows step replayed a "
                  "graph", name);
        diff(lg, le, (size_t)V, &max_diff, &max_ref);
    }
    printf("  %-11s TP %d: %d decode steps (5 / 3 / 1 sequences) replayed graphs: max |logit "
           "diff| %.3g (max |logit| %.3g)\n", name, n_tp, expect_graph, max_diff, max_ref);
    /* The same ops in the same order on the same rows: only BLAS blocking over a different
     * row count may move the last bits. */
    CHECK_MSG(max_diff <= 1e-4 * (max_ref > 1 ? max_ref : 1), "%s: graph and eager logits "
              "differ by %g", name, max_diff);
    free(bt);
    free(dbt);
    free(lg);
    free(le);
    if (n_tp == 1) tg_close(&gr);
    else tp_side_close(&tps);
    tg_close(&eg);
}

/* Pipelined decode steps (mr_launch / mr_collect) on a graph runner against the same steps run
 * one at a time on another: step k + 1 launched before step k is collected, its input ids
 * taken from step k's picks on the backend (the batch's own ids are 0, never read). The picks
 * must be the same tokens, step after step (the same graphs over the same data). Misuse is
 * PD_ESTATE, batches a graph does not take PD_EUNSUPPORTED. */
static void run_pipelined(const char *name)
{
    char err[PD_ERR_LEN] = "";
    tg_model gp, gs;
    if (!open_pair(name, true, &gp, &gs)) return;
    CHECK(mr_can_launch(gp.r));
    enum { NS = 3, STEPS = 10 };
    const int32_t V = gp.m->cfg.vocab_size, width = mr_max_blocks_per_seq(gp.r);
    const int32_t q_lens[NS] = {7, 19, 12};
    int32_t *bt = calloc((size_t)NS * width, sizeof *bt);
    float *lg = malloc((size_t)64 * V * sizeof(float));
    int32_t ids[64], pos[64], slots[64], rows[64], cu[NS + 1] = {0}, ctx[NS], last[NS];
    const int32_t T = make_prompts(NS, q_lens, STEPS + 2, width, V, 777, bt, ids, pos, slots, cu,
                                   ctx, rows);
    mr_batch b = {T, ids, pos, slots, NS, cu, ctx, bt, width, NS, rows};
    pd_sample_row srow[NS];
    memset(srow, 0, sizeof srow);
    for (int s = 0; s < NS; s++) srow[s].top_p = 1.0f; /* greedy */
    int32_t tk[2][NS], dummy[NS];
    mr_sampling smp = {srow, NULL, 0, tk[0], NULL, NULL};
    CHECK_EQ_INT(mr_launch(gp.r, &b, &smp, false, err), PD_EUNSUPPORTED); /* a prompt batch */
    CHECK(mr_forward(gp.r, &b, lg, err) == 0 && mr_forward(gs.r, &b, lg, err) == 0);
    for (int s = 0; s < NS; s++) last[s] = argmax(lg + (size_t)s * V, V);
    CHECK_EQ_INT(mr_collect(gp.r, err), PD_ESTATE); /* nothing launched */
    int32_t dcu[NS + 1], dctx[NS];
    /* step k's batch, its ids the host's picks (from_host) or 0 */
    #define STEP_BATCH(k, from_host)                                                        \
        for (int s = 0; s < NS; s++) {                                                     \
            const int32_t p = q_lens[s] + (k);                                             \
            ids[s] = (from_host) ? last[s] : 0;                                            \
            pos[s] = p;                                                                    \
            slots[s] = bt[s * width + p / BS] * BS + p % BS;                               \
            dctx[s] = p + 1;                                                               \
            dcu[s + 1] = s + 1;                                                            \
            rows[s] = s;                                                                   \
        }                                                                                  \
        dcu[0] = 0;
    mr_batch d = {NS, ids, pos, slots, NS, dcu, dctx, bt, width, NS, rows};
    STEP_BATCH(0, true);
    CHECK_EQ_INT(mr_launch(gp.r, &d, &smp, true, err), PD_ESTATE); /* nothing to chain onto */
    CHECK(mr_launch(gp.r, &d, &smp, false, err) == 0);
    int same = 0;
    for (int k = 0; k < STEPS; k++) {
        /* the one-at-a-time runner: step k with the true ids */
        STEP_BATCH(k, true);
        CHECK(mr_forward(gs.r, &d, lg, err) == 0);
        int32_t want[NS];
        for (int s = 0; s < NS; s++) want[s] = argmax(lg + (size_t)s * V, V);
        /* the pipelined one: step k + 1 launched before step k is collected */
        if (k + 1 < STEPS) {
            STEP_BATCH(k + 1, false);
            smp.tokens = tk[(k + 1) & 1];
            CHECK_MSG(mr_launch(gp.r, &d, &smp, true, err) == 0, "%s step %d: %s", name, k + 1, err);
            if (k == 0) {
                smp.tokens = dummy;
                CHECK_EQ_INT(mr_launch(gp.r, &d, &smp, true, err), PD_ESTATE); /* a third */
            }
        }
        CHECK_MSG(mr_collect(gp.r, err) == 0, "%s step %d: %s", name, k, err);
        for (int s = 0; s < NS; s++) {
            same += tk[k & 1][s] == want[s];
            last[s] = want[s];
        }
    }
    CHECK_EQ_INT(mr_collect(gp.r, err), PD_ESTATE);
    CHECK_MSG(same == NS * STEPS, "%s: %d of %d pipelined picks equal the one-at-a-time ones", name,
              same, NS * STEPS);
    printf("  %-11s %d pipelined decode steps of %d sequences: %d of %d picks as one at a time\n",
           name, STEPS, NS, same, NS * STEPS);
    #undef STEP_BATCH
    free(bt);
    free(lg);
    tg_close(&gp);
    tg_close(&gs);
}

/* A rank whose capture fails after the others' eager runs (its third graph_begin: batch 2's)
 * while they go on capturing: before the gate, the others ran on to the next bucket's eager
 * run and waited in its all-reduce for this rank forever. Now every rank stops at the next
 * gate, the graphs are off on all of them, and the group runs its steps eagerly, giving the
 * same logits as a group that never had graphs. */
static void test_capture_failure(const char *name, int32_t n_tp, int32_t fail_rank)
{
    char err[PD_ERR_LEN] = "", dir[1024];
    snprintf(dir, sizeof dir, "%s/testdata/golden/%s", pd_test_shared_dir(), name);
    tp_side a, b;
    mr_params mg = side_params(true), me = side_params(false);
    g_fail_rank = fail_rank;
    g_fail_left = 3;
    int rc = tp_side_open(dir, n_tp, &mg, &a, err);
    g_fail_rank = -1;
    g_fail_ctx = NULL;
    CHECK_MSG(rc == 0, "%s TP %d, rank %d's capture failing: %s", name, n_tp, fail_rank, err);
    if (rc == 0) CHECK_EQ_INT(mr_n_graphs(a.r), 0);
    int rc2 = tp_side_open(dir, n_tp, &me, &b, err);
    CHECK_MSG(rc2 == 0, "%s TP %d eager: %s", name, n_tp, err);
    if (rc == 0 && rc2 == 0) {
        const int32_t V = a.ms[0]->cfg.vocab_size, width = mr_max_blocks_per_seq(a.r);
        const int32_t q_lens[N_SEQS] = {9, 23, 5, 17, 31};
        int32_t *bt = calloc((size_t)N_SEQS * width, sizeof *bt);
        int32_t ids[128], pos[128], slots[128], rows[128], cu[N_SEQS + 1], ctx[N_SEQS];
        const int32_t T = make_prompts(N_SEQS, q_lens, 1, width, V, 7u, bt, ids, pos, slots, cu,
                                       ctx, rows);
        float *la = malloc((size_t)N_SEQS * V * sizeof *la), *lb = malloc((size_t)N_SEQS * V * sizeof *lb);
        mr_batch bb = {T, ids, pos, slots, N_SEQS, cu, ctx, bt, width, N_SEQS, rows};
        CHECK_EQ_INT(mr_forward(a.r, &bb, la, err), 0);
        CHECK_EQ_INT(mr_forward(b.r, &bb, lb, err), 0);
        double md = 0, mref = 0;
        diff(la, lb, (size_t)N_SEQS * V, &md, &mref);
        CHECK_MSG(md == 0, "%s TP %d: logits after a failed capture differ from eager (%.3g)",
                  name, n_tp, md);
        printf("  %s TP %d: rank %d's capture failed at batch 2: graphs off on every rank, "
               "prefill logits as a group without graphs\n", name, n_tp, fail_rank);
        free(la);
        free(lb);
        free(bt);
    }
    tp_side_close(&a);
    tp_side_close(&b);
}

int main(void)
{
    printf("test_graph_replay: decode graphs recorded and replayed on the CPU backend\n");
    run("qwen3-tiny", 1);
    run("llama-tiny", 1);
    run("qwen3-tiny", 2);
    run("qwen3-tiny", 4);
    run("llama-tiny", 2);
    run_pipelined("qwen3-tiny");
    run_pipelined("llama-tiny");
    test_capture_failure("qwen3-tiny", 2, 1);
    test_capture_failure("qwen3-tiny", 4, 0);
    CHECK(g_replays > 0);
    CHECK(g_pipe_launches > 0);
    return pd_test_result("test_graph_replay");
}
