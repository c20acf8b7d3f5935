/* cuda_decode_layers.cu -- decode_layers: every layer of a small decode step in one persistent
 * kernel (sm_90), for the latency-bound batches (n <= DL_MAX_N single-token sequences).
 *
 * A step of one sequence through a 0.6B-parameter model reads 1.2 GB of weights; op by op that
 * is six launches a layer of 1 - 12 MB each, and each launch pays its start, the latency of its
 * first loads and its tail, which together took several times the time of the bytes
 * (docs/perf-history.md, issue #8's fourth pass).
 * Here one block per SM runs the whole stack. Its products are spread over all blocks by output
 * rows; a stage that needs other blocks' results waits for exactly those (flagged lines,
 * below), with no grid barrier:
 *
 *   S1  x = rmsnorm(resid) * attn_norm;  qkv = x . Wqkv^T (+ bias)
 *   S2  per (sequence, KV head, key split): q / k head norms and RoPE, the new k / v into the
 *       cache, attention over the split's keys; split 0 merges the others' partials
 *   S3  resid += attn . Wo^T (+ bias)
 *   S4  x = rmsnorm(resid) * mlp_norm;  act = silu(x . Wgate^T) * (x . Wup^T)
 *   S5  resid += act . Wdown^T
 *
 * The weights never depend on the activations, so a producer warp streams each block's share
 * of them, stage after stage and layer after layer, into a ring of shared-memory slots with
 * bulk asynchronous copies (cp.async.bulk, completion counted on an mbarrier per slot, under
 * an evict-first L2 policy) without ever waiting for another block: while the 8 consumer
 * warps wait for inputs, or attend, the next stages' weights keep arriving, paced where a
 * layer is latency-bound (pace_of: a burst of refills slows the grid's exchanges). A slot
 * holds a 1024-k slice of 8 weight rows; the consumer warps split its k between them on the
 * tensor cores (the n rows of x, in shared memory, as the A operand), then hand the slot back.
 *
 * Stage outputs go from block to block as flagged lines (ll_store / ll_copy): no fence, counter
 * or barrier, each reader polls the lines it needs. Grid barriers were a large share of a step
 * (their fence waited behind the weight stream's loads); the lines, the residual columns kept
 * per block and the split merge on flagged partials took the Qwen3-0.6B batch-1 step to issue
 * #8's goal, twice its weight-bytes floor, on one of the two chips tried (docs/perf-history.md,
 * issue #8's sixth pass). Batches of 2 and 4 gain too, but lost against the op-by-op graphs
 * after long prompts (the attention stage has fewer splits a sequence), hence n = 1 by default
 * with bf16 weights, 2 with FP8 ones (fused_max_n; PDSERVE_CUDA_FUSED_DECODE=N: up to N).
 *
 * The grid is cooperative (every block resident, so that polling blocks never wait for one
 * that is not running); the last block out resets the done counter and moves the epoch.
 *
 * FP8 weights (pd_layer_args.wq: this backend's pd_fp8_weight with a scale per output row,
 * act PD_ACT_DYNAMIC or PD_ACT_NONE; the kernel's WQ, instances apart from the bf16 ones): a
 * slot holds the same 16 KiB, so twice the k, and the stream moves the same bytes in flight
 * for half the step. The products are what the FP8 op set's linear_fused computes: with
 * dynamic activations each stage's input rows (the bf16 rows the op path would write) are
 * quantized per token in shared memory (quant_rows, kept as the codes' f16 values) and each
 * weight code becomes its f16 value for the f16 mma (exact, f32 sums: the e4m3 mma is not
 * native on sm_90); weight-only, each code becomes its bf16 value and meets the bf16 rows; either
 * way the sums are scaled once by the row's weight scale (times the token's). The head and
 * the embedding stay bf16; group 128, static activations and tensor parallelism are refused.
 *
 * Tensor parallelism (pd_decode_args.tp): every rank of a group runs this kernel on its GPU
 * with its shard, the same grid on every GPU, so block b makes the same residual columns on
 * every rank. S3's and S5's products are then partial sums: block b sends its columns' partial
 * sums (in float) as flagged lines into every other rank's receive area through peer memory
 * and adds the ranks' sums in rank order (tp_sum): the all-reduce of a layer's two products is
 * an exchange between the blocks that need it, with no launch, no barrier and no bf16 rounding
 * of the parts (the op-by-op path's NCCL all-reduce sums in bf16). Each rank's epoch moves
 * with its launches: every rank launches it as many times (a group decides for all its ranks,
 * engine/model_runner.c), so the flags match. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_decode_layers.cuh"

/* ---- host ---- */

/* The largest n the fused kernel takes for layers of weights wq: PDSERVE_CUDA_FUSED_DECODE=N
 * when set (0 = off, at most DL_MAX_N); unset, 1 with bf16 layers (against the op-by-op
 * graphs, batch 1 was faster after short and long prompts, 2 and 4 only after short ones:
 * docs/perf-history.md, issue #8's sixth pass) and 2 with FP8 ones (faster than the FP8 ops at
 * 1 and 2 after short and long prompts, at 4 barely after long ones: docs/perf-history.md,
 * "FP8 batch-1 decode: the products on f16"). */
static int fused_max_n(int wq)
{
    static int v = -2; /* -1: not set (racy first reads all get the same value) */
    if (v == -2) {
        const int64_t x = pd_env_int("PDSERVE_CUDA_FUSED_DECODE");
        v = !pd_env_raw("PDSERVE_CUDA_FUSED_DECODE") ? -1
            : (int)(x < 0 ? 0 : x > DL_MAX_N ? DL_MAX_N : x);
    }
    return v >= 0 ? v : wq == DL_W_BF16 ? 1 : 2;
}

/* PDSERVE_CUDA_DL_DEBUG: parts of the kernel off, for timing breakdowns only (the results are
 * wrong): 1 the products' arithmetic, 2 the FP8 input quantization, 8 the weight stream; 16
 * stage timing (in a -DPD_DL_TIMING=1 build); A/B switches (results right): 32 the weight
 * stream without its evict-first L2 policy, 128 no L2 prefetch of the small vectors. */
static int debug_bits(void)
{
    static int v = -1; /* racy first reads all get the same value */
    if (v < 0) {
        const int64_t x = pd_env_int("PDSERVE_CUDA_DL_DEBUG");
        v = x > 0 && x <= INT32_MAX ? (int)x : 0;
    }
    return v;
}

/* Debug bit 16 (eager steps only: it synchronizes): per stage of the kernel, averaged over
 * layers and launches, where its time goes; printed to stderr every 64 launches. Per stage:
 * span (first block's start to the last block's end), the mean block's prologue (its
 * inputs' wait included) / body / epilogue, the slowest block's start to end, and the gap
 * from the last end to the next stage's first start (stages overlap: mostly 0). */
static unsigned long long *ts_dev;
static size_t ts_cap;

static void ts_report(const unsigned long long *ts, int32_t n_stages, int grid)
{
    static double acc[6][9];
    static long cnt[6], launches;
    for (int32_t st = 0; st < n_stages; st++) {
        const unsigned long long *b = ts + (size_t)st * grid * 8;
        unsigned long long s0 = ~0ull, a1 = 0, nx = ~0ull;
        double pro = 0, body = 0, epi = 0, worst = 0, fw = 0, pw = 0, lead = 0;
        int np = 0, nb = 0, nl = 0;
        for (int i = 0; i < grid; i++) {
            const unsigned long long *t = b + (size_t)i * 8;
            if (!t[0] || !t[3]) continue;
            if (t[0] < s0) s0 = t[0];
            if (t[3] > a1) a1 = t[3];
            if ((double)(t[3] - t[0]) > worst) worst = (double)(t[3] - t[0]);
            fw += (double)t[4];
            pw += (double)t[6];
            if (t[7]) {
                lead += (double)t[7] - (double)t[0];
                nl++;
            }
            if (t[1] && t[2]) {
                pro += (double)(t[1] - t[0]);
                body += (double)(t[2] - t[1]);
                epi += (double)(t[3] - t[2]);
                np++;
            }
            nb++;
        }
        if (!nb) continue;
        if (st + 1 < n_stages)
            for (int i = 0; i < grid; i++) {
                const unsigned long long t0 = ts[((size_t)(st + 1) * grid + i) * 8];
                if (t0 && t0 < nx) nx = t0;
            }
        const int k = st == n_stages - 1 && n_stages % 5 == 1 ? 5 : st % 5;
        double *a = acc[k];
        a[0] += (double)(a1 - s0);
        if (np) {
            a[1] += pro / np;
            a[2] += body / np;
            a[3] += epi / np;
        }
        a[4] += worst;
        if (nx != ~0ull && nx > a1) a[5] += (double)(nx - a1);
        a[6] += fw / nb;
        a[7] += pw / nb;
        if (nl) a[8] += lead / nl;
        cnt[k]++;
    }
    if (++launches % 64) return;
    static const char *name[6] = {"S1 qkv", "S2 attn", "S3 o", "S4 gate/up", "S5 down", "head"};
    fprintf(stderr, "decode_layers stages (us, mean of %ld launches; per stage: span, block "
                    "prologue / body / epilogue, slowest block, gap; waits for full slots, "
                    "producer's waits for empty ones, its last issue after the stage start)\n",
            launches);
    for (int k = 0; k < 6; k++) {
        if (!cnt[k]) continue;
        const double d = 1e3 * (double)cnt[k];
        fprintf(stderr, "  %-10s %7.2f   %6.2f %6.2f %6.2f   %7.2f   %6.2f   %6.2f %6.2f %7.2f\n",
                name[k], acc[k][0] / d, acc[k][1] / d, acc[k][2] / d, acc[k][3] / d,
                acc[k][4] / d, acc[k][5] / d, acc[k][6] / d, acc[k][7] / d, acc[k][8] / d);
    }
    memset(acc, 0, sizeof acc);
    memset(cnt, 0, sizeof cnt);
}

/* How many of the layers' weight slots the producer keeps in flight, at most (0: as many as the
 * ring has free). Every block's bulk copies share the memory system with the chain of
 * exchanges between the blocks, and a stage's refill, issued all at once when its slots free,
 * lands during the next exchanges and slows their polls (a Qwen3-0.6B layer is latency-bound:
 * its chain takes about twice its weights' time at the copy rate). One slot a block in flight
 * paces the stream to a slot a round trip, smoothly; that suits a layer whose weights per
 * block fill about one ring (Qwen3-0.6B: 15 slots a block, 12 in the ring), which then still
 * arrive within the layer, and batch 1 gains after short and long prompts alike
 * (docs/perf-history.md, issue #8's twelfth pass). A layer of k rings a block gets k
 * slots in flight, and from DL_PACE_RINGS rings on (a stream-bound layer, e.g. Llama-3-8B's
 * 206 slots a block, or its 102 with FP8 weights) none is held back: one slot in flight cost
 * those shapes half their speed, and 9 slots of 11 in flight slowed the FP8 ones
 * (docs/perf-history.md, "FP8 batch-1 decode: the products on f16").
 * The head is never paced. PDSERVE_CUDA_DL_INFLIGHT=N sets it (0: none). */
#define DL_PACE_RINGS 4 /* a layer's weights a block, in rings, from which none is held back */
static int32_t pace_of(const dl_params &p, int32_t hd, int grid, int esz)
{
    static int v = -2; /* -1: not set (racy first reads all get the same value) */
    if (v == -2) {
        const int64_t x = pd_env_int("PDSERVE_CUDA_DL_INFLIGHT");
        v = !pd_env_raw("PDSERVE_CUDA_DL_INFLIGHT") ? -1 : x > 0 && x <= INT32_MAX ? (int)x : 0;
    }
    int64_t f = v;
    if (v < 0) {
        int64_t slots = 0; /* a layer's slots for the block with the most columns (stage_cols) */
        for (int st = 0; st < 4; st++) {
            const int64_t cols = 8 * (((int64_t)stage_m(p, st, hd) / 8 + grid - 1) / grid);
            const int64_t cpg = st == 2 ? 4 : 8, k = stage_k(p, st, hd), ks = slot_k(p, k, esz);
            slots += (cols + cpg - 1) / cpg * ((k + ks - 1) / ks);
        }
        f = slots / p.n_slots < 1 ? 1 : slots / p.n_slots;
        if (f >= DL_PACE_RINGS) f = 0;
    }
    /* a ring's worth in flight is no limit (and keeps the producer's count within a round) */
    return f >= p.n_slots ? 0 : (int32_t)f;
}

/* Whether a launch with the head makes the greedy picks (PDSERVE_CUDA_DL_PICK=0: no, the
 * sample op samples as without them). */
static bool picks_on(void)
{
    static int v = -1;
    return pd_cuda__switch_on("PDSERVE_CUDA_DL_PICK", &v);
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* The NMAX a launch of n rows is instantiated with. */
static int nmax_of(int32_t n) { return n <= 1 ? 1 : n <= 4 ? 4 : 8; }

/* The instance for head size hd and weights wq (tensor-parallel sums with bf16 weights only). */
static cudaError_t launch(const dl_params &p, int32_t hd, int wq, int grid, size_t smem,
                         cudaStream_t stream)
{
    const bool tp = p.tp_n > 1;
    if (hd == 64)
        return wq == DL_W_F8    ? dl_launch<64, false, DL_W_F8>(p, grid, smem, stream)
               : wq == DL_W_F8W ? dl_launch<64, false, DL_W_F8W>(p, grid, smem, stream)
               : tp             ? dl_launch<64, true, DL_W_BF16>(p, grid, smem, stream)
                                : dl_launch<64, false, DL_W_BF16>(p, grid, smem, stream);
    return wq == DL_W_F8    ? dl_launch<128, false, DL_W_F8>(p, grid, smem, stream)
           : wq == DL_W_F8W ? dl_launch<128, false, DL_W_F8W>(p, grid, smem, stream)
           : tp             ? dl_launch<128, true, DL_W_BF16>(p, grid, smem, stream)
                            : dl_launch<128, false, DL_W_BF16>(p, grid, smem, stream);
}

/* The layers' weights as the kernel's WQ takes them: DL_W_BF16 (every wq NULL), DL_W_F8 or
 * DL_W_F8W (every layer's four products this backend's FP8 weights with a scale per row, all
 * with the same act, of the step's shapes); -1: not taken (PD_EUNSUPPORTED: mixed layers,
 * group 128, static activations, another backend's op set). */
static int weights_of(const pd_decode_args *a)
{
    const int32_t hd = a->head_dim, nq = a->n_heads * hd;
    const int32_t dims[4][2] = {{(a->n_heads + 2 * a->n_kv_heads) * hd, a->hidden},
                                {a->hidden, nq},
                                {2 * a->intermediate, a->hidden},
                                {a->hidden, a->intermediate}}; /* m, k */
    int wq = -2;
    for (int32_t l = 0; l < a->n_layers; l++) {
        const pd_layer_args *L = &a->layers[l];
        int lw = DL_W_BF16;
        if (L->wq) {
            if (L->wq->linear_fused != pd_cuda__fp8_linear_fused) return -1;
            const void *ws[4] = {L->qkv, L->o_proj, L->gate_up, L->down};
            for (int st = 0; st < 4; st++) {
                const pd_fp8_weight *w = (const pd_fp8_weight *)ws[st];
                if (w->ng != 1 || w->m != dims[st][0] || w->k != dims[st][1] ||
                    (w->act != PD_ACT_DYNAMIC && w->act != PD_ACT_NONE) || !aligned16(w->w8))
                    return -1;
                const int kind = w->act == PD_ACT_DYNAMIC ? DL_W_F8 : DL_W_F8W;
                if (st && kind != lw) return -1;
                lw = kind;
            }
        }
        if (wq != -2 && lw != wq) return -1;
        wq = lw;
    }
    return wq;
}

extern "C" int pd_cuda__decode_layers(void *ctx, const pd_decode_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a || !a->layers || !a->resid || !a->qkv || !a->attn || !a->act || !a->positions ||
        !a->slot_mapping || !a->ctx_lens || !a->block_tables || !a->inv_freq || a->n < 0 ||
        a->n_layers < 0 || a->hidden <= 0 || a->intermediate <= 0 || a->n_heads <= 0 ||
        a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads || a->block_size <= 0 ||
        a->max_blocks_per_seq <= 0 || (a->embed && !a->ids))
        return PD_EINVAL;
    if (a->n == 0 || a->n_layers == 0) return 0;
    const int32_t G = a->n_heads / a->n_kv_heads, hd = a->head_dim;
    if (c->cc_major < 9 || a->n > DL_MAX_N || a->n_layers > DL_MAX_LAYERS ||
        (hd != 64 && hd != 128) || G > DL_MAX_G || a->hidden % 256 ||
        a->intermediate % 256 || (a->n_heads * hd) % 256)
        return PD_EUNSUPPORTED; /* a warp's 32 chunks of 8 in one weight row */
    for (int32_t l = 0; l < a->n_layers; l++) {
        const pd_layer_args *L = &a->layers[l];
        if (!L->attn_norm || !L->qkv || !L->o_proj || !L->mlp_norm || !L->gate_up || !L->down ||
            !L->k_cache || !L->v_cache || !L->q_norm != !L->k_norm)
            return PD_EINVAL;
        if (!L->wq && (!aligned16(L->qkv) || !aligned16(L->o_proj) || !aligned16(L->gate_up) ||
                       !aligned16(L->down)))
            return PD_EUNSUPPORTED;
        if (!aligned16(L->attn_norm) || !aligned16(L->mlp_norm)) return PD_EUNSUPPORTED;
    }
    if (!aligned16(a->attn) || !aligned16(a->act)) return PD_EUNSUPPORTED;
    if (a->lm_head && (!a->final_norm || !a->logits || a->vocab <= 0)) return PD_EINVAL;
    if (a->embed && !aligned16(a->embed)) return PD_EUNSUPPORTED;
    if (a->lm_head && (!aligned16(a->lm_head) || !aligned16(a->final_norm)))
        return PD_EUNSUPPORTED;
    const pd_cuda_tp *tp = (const pd_cuda_tp *)a->tp;
    if (tp && (tp->n < 1 || tp->n > PD_CUDA_TP_MAX || tp->rank < 0 || tp->rank >= tp->n))
        return PD_EINVAL;
    /* every rank's grid the same, so that block b sums the same columns on every rank */
    if (tp && (a->lm_head || tp->sm_count != c->sm_count ||
               (size_t)16 * tp->n * a->n * a->hidden > tp->recv_bytes))
        return PD_EUNSUPPORTED;
    /* FP8 layers: single-GPU, and rows of whole warp steps (64 k a lane group of 4) */
    const int wq = weights_of(a);
    if (wq >= 0 && a->n > fused_max_n(wq)) return PD_EUNSUPPORTED;
    if (wq < 0 || (wq != DL_W_BF16 && (tp || a->hidden % 512 || a->intermediate % 512 ||
                                       (a->n_heads * hd) % 512)))
        return PD_EUNSUPPORTED;

    const int32_t nq = a->n_heads * hd;
    int32_t kmax = a->hidden > nq ? a->hidden : nq;
    if (a->intermediate > kmax) kmax = a->intermediate;
    size_t x_bytes = (size_t)a->n * kmax * 2;
    if ((size_t)(a->n + 1) * a->hidden * 2 > x_bytes) /* norm_rows: the weights after the rows */
        x_bytes = (size_t)(a->n + 1) * a->hidden * 2;
    const size_t att_bytes =
        ((size_t)(DL_MAX_G + 2) * hd + 2 * DL_CW * G + (size_t)DL_CW * G * hd) * sizeof(float);
    if (att_bytes > x_bytes) x_bytes = att_bytes;
    x_bytes = (x_bytes + 127) & ~(size_t)127;
    const size_t slot = DL_SLOT_BYTES; /* 8 rows of 1024 k */
    const int grid = c->sm_count;
    /* the warps' sums, the rotations, the block's residual columns (at most 8 ceil(hidden / 8
     * / grid) of them, as stage_of splits) */
    const size_t own_cols = 8 * (size_t)((a->hidden / 8 + c->sm_count - 1) / c->sm_count);
    size_t tail_bytes = DL_WRED_FLOATS * sizeof(float) + (size_t)a->n * hd / 2 * 8 +
                        own_cols * nmax_of(a->n) * sizeof(float);
    if (wq != DL_W_BF16) { /* the x rows' scales, a stage's weight-row scales (f8_xsc) */
        const int64_t ms[4] = {(int64_t)(a->n_heads + 2 * a->n_kv_heads) * hd, a->hidden,
                               2 * (int64_t)a->intermediate, a->hidden};
        int64_t most = 0;
        for (int st = 0; st < 4; st++) { /* a block's columns at most (stage_cols) */
            const int64_t m = st == 2 ? ms[st] / 2 : ms[st];
            const int64_t cols = (st == 2 ? 2 : 1) * 8 * ((m / 8 + grid - 1) / grid);
            if (cols > most) most = cols;
        }
        tail_bytes += (DL_MAX_N + (size_t)most) * sizeof(float);
    }
    const size_t avail = (size_t)c->smem_optin - 2048; /* the static mbarriers and sums */
    if (x_bytes + tail_bytes + DL_MIN_SLOTS * slot > avail) return PD_EUNSUPPORTED;
    size_t n_slots = (avail - x_bytes - tail_bytes) / slot;
    if (n_slots > 64) n_slots = 64;

    int32_t splits = grid / (a->n * a->n_kv_heads);
    if (splits < 1) splits = 1;
    if (splits > DL_MAX_SPLITS) splits = DL_MAX_SPLITS;
    /* the splits' partials as flagged lines: 16 bytes an output element */
    if ((size_t)a->n * a->n_heads * splits * hd * 4 > c->attn_part_floats)
        return PD_EUNSUPPORTED;

    dl_params p;
    memset(&p, 0, sizeof p);
    p.resid = (bf16 *)a->resid;
    p.qkv = (bf16 *)a->qkv;
    p.attn = (bf16 *)a->attn;
    p.act = (bf16 *)a->act;
    p.part = c->attn_part;
    {
        /* the flagged lines: 4 bf16 in 16 bytes, rows [n][columns] */
        const size_t q4 = (size_t)a->n * 4, qkv_dim = (size_t)(a->n_heads + 2 * a->n_kv_heads) * hd;
        const size_t need = q4 * (qkv_dim + (size_t)nq + 2 * (size_t)a->hidden + a->intermediate);
        if (need > c->dl_ll_bytes) return PD_EUNSUPPORTED;
        char *ll = (char *)c->dl_ll;
        p.ll_qkv = (uint4 *)ll;
        p.ll_attn = (uint4 *)(ll += q4 * qkv_dim);
        p.ll_r3 = (uint4 *)(ll += q4 * nq);
        p.ll_r5 = (uint4 *)(ll += q4 * a->hidden);
        p.ll_act = (uint4 *)(ll += q4 * a->hidden);
    }
    if (a->check_only) return 0;
    /* an aborted group: the kernel would stop waiting at once and leave garbage */
    if (tp && *tp->abort_host) return PD_EBACKEND;
    p.tp_n = tp ? tp->n : 1;
    if (tp) {
        p.tp_rank = tp->rank;
        for (int32_t r = 0; r < tp->n; r++) p.tp_recv[r] = (uint4 *)tp->recv[r];
        p.tp_abort = tp->abort;
    }
    p.bar = c->dl_counters;
    p.positions = a->positions;
    p.slots = a->slot_mapping;
    p.ctx_lens = a->ctx_lens;
    p.block_tables = a->block_tables;
    p.inv_freq = a->inv_freq;
    p.ids = a->ids;
    p.embed = (const bf16 *)a->embed;
    p.final_norm = (const bf16 *)a->final_norm;
    p.lm_head = (const bf16 *)a->lm_head;
    p.logits = (bf16 *)a->logits;
    p.vocab = a->lm_head ? a->vocab : 0;
    p.n = a->n;
    p.hidden = a->hidden;
    p.inter = a->intermediate;
    p.n_heads = a->n_heads;
    p.n_kv_heads = a->n_kv_heads;
    p.n_layers = a->n_layers;
    p.max_blocks_per_seq = a->max_blocks_per_seq;
    p.block_size = a->block_size;
    p.sliding_window = a->sliding_window;
    p.splits = splits;
    p.eps = a->norm_eps;
    p.inv_hidden = 1.0f / (float)a->hidden;
    p.attn_factor = a->attn_factor;
    p.scale_log2 = a->scale * 1.4426950408889634f;
    p.slot_bytes = (int32_t)slot;
    p.n_slots = (int32_t)n_slots;
    p.x_bytes = (int32_t)x_bytes;
    p.debug = debug_bits();
    p.inflight = pace_of(p, hd, grid, wq == DL_W_BF16 ? 2 : 1);
    const bool picks = a->lm_head && a->pick_ids && a->pick_slot && c->pick_dev &&
                       a->n <= PD_PICK_ROWS && picks_on();
    if (picks) {
        p.pick_best = c->dl_best;
        p.pick_ids = a->pick_ids;
        p.pick_host = c->pick_dev;
        p.pick_slot = a->pick_slot;
    }
    for (int32_t l = 0; l < a->n_layers; l++) {
        const pd_layer_args *L = &a->layers[l];
        dl_layer &d = p.layer[l];
        d.attn_norm = (const bf16 *)L->attn_norm;
        d.qkv = L->qkv;
        d.qkv_bias = (const bf16 *)L->qkv_bias;
        d.q_norm = (const bf16 *)L->q_norm;
        d.k_norm = (const bf16 *)L->k_norm;
        d.o = L->o_proj;
        d.o_bias = (const bf16 *)L->o_bias;
        d.mlp_norm = (const bf16 *)L->mlp_norm;
        d.gate_up = L->gate_up;
        d.down = L->down;
        if (wq != DL_W_BF16) { /* the device bytes and scales of the FP8 weights */
            const pd_fp8_weight *w[4] = {(const pd_fp8_weight *)L->qkv,
                                         (const pd_fp8_weight *)L->o_proj,
                                         (const pd_fp8_weight *)L->gate_up,
                                         (const pd_fp8_weight *)L->down};
            d.qkv = w[0]->w8;
            d.o = w[1]->w8;
            d.gate_up = w[2]->w8;
            d.down = w[3]->w8;
            d.qkv_s = w[0]->scale;
            d.o_s = w[1]->scale;
            d.gate_up_s = w[2]->scale;
            d.down_s = w[3]->scale;
        }
        d.k_cache = (bf16 *)L->k_cache;
        d.v_cache = (bf16 *)L->v_cache;
    }
    const size_t smem = n_slots * slot + x_bytes + tail_bytes;
    const int32_t n_stages = a->n_layers * 5 + (a->lm_head ? 1 : 0);
    const size_t ts_need = (size_t)n_stages * grid * 8; /* timing words */
    /* a launch being captured: timing off, and its picks are the graph's (cap_pick) */
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    PD_CUDA_CHECK(cudaStreamIsCapturing(c->stream, &cap));
    if (DL_TIMED(p) && cap == cudaStreamCaptureStatusNone) {
        const size_t need = ts_need;
        if (need > ts_cap) {
            if (ts_dev) cudaFree(ts_dev);
            ts_dev = NULL;
            ts_cap = 0;
            PD_CUDA_CHECK(cudaMalloc((void **)&ts_dev, need * sizeof *ts_dev));
            ts_cap = need;
        }
        PD_CUDA_CHECK(cudaMemsetAsync(ts_dev, 0, need * sizeof *ts_dev, c->stream));
        p.ts = ts_dev;
    } else {
        p.debug &= ~16;
    }
    PD_CUDA_CHECK(launch(p, hd, wq, grid, smem, c->stream));
    {   /* the picks this launch (or the graph being captured) leaves for the sample ops */
        const pd_cuda_pick k = {picks, a->logits, a->n, a->vocab, a->pick_ids};
        if (cap == cudaStreamCaptureStatusActive) c->cap_pick = k;
        else c->pick = k;
    }
    if (DL_TIMED(p)) {
        const size_t need = ts_need;
        unsigned long long *h = (unsigned long long *)malloc(need * sizeof *h);
        if (!h) return PD_ENOMEM;
        const cudaError_t e = cudaMemcpyAsync(h, ts_dev, need * sizeof *h,
                                              cudaMemcpyDeviceToHost, c->stream);
        if (e == cudaSuccess && cudaStreamSynchronize(c->stream) == cudaSuccess)
            ts_report(h, n_stages, grid);
        free(h);
    }
    return 0;
}
