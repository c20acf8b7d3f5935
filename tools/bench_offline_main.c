/* bench_offline_main.c -- pdserve-bench-offline: offline throughput of the engine on N
 * requests with random prompts and lengths (nano-vllm's workload by default: 256 requests,
 * input and output lengths uniform in [100, 1024], ignore EOS). Real or dummy weights.
 *
 * Besides the rates it counts what the run had to move and compute, from what every step
 * reported (it drives eng_step itself): the bytes the decode rows had to read (the weights once
 * per step that has decode rows, plus the KV of every context token of every decode row) and
 * the FLOPs of the prompt tokens. Given the device's measured bandwidth and matrix rate it
 * turns them into floor times and says how far the run is from them. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "engine/tp.h"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: pdserve-bench-offline --model DIR [options]\n"
        "\n"
        "Runs N requests with random token prompts through the engine (continuous batching,\n"
        "EOS ignored) and reports throughput, batch sizes, KV usage and host overhead, and the\n"
        "bytes and FLOPs the run needed (with --bandwidth-gbs / --gemm-tflops: floor times).\n"
        "\n"
        "  --model DIR                 HuggingFace model directory (config.json at least)\n"
        "  --load-format FMT           safetensors (default) or dummy (random weights)\n"
        "  --backend NAME              auto (default), cpu or cuda\n"
        "  --threads N                 CPU threads for matrix products (default: all cores)\n"
        "  --quantization Q            auto (the checkpoint's; default), none, or fp8 (linears\n"
        "                              quantized per channel at load; with dummy weights too)\n"
        "  --kv-cache-dtype T          auto (default), bf16 (the backend's own) or fp8\n"
        "  --tensor-parallel N         split the model over N ranks (threads; on cuda GPUs 0 ..\n"
        "                              N - 1): the byte and FLOP floors are then per rank\n"
        "                              (rank 0's shard, which also holds the LM head)\n"
        "  --num-requests N            default 256\n"
        "  --input-len A:B             prompt lengths uniform in [A, B] (default 100:1024)\n"
        "  --output-len A:B            output lengths uniform in [A, B] (default 100:1024)\n"
        "  --shared-prefix N           the first N prompt tokens are the same for all requests\n"
        "  --seed S                    workload seed (default 0)\n"
        "  --block-size N              tokens per KV block (default 16)\n"
        "  --kv-cache-mb N             KV cache size in MiB; 0 = from device memory (see below;\n"
        "                              needs a GPU). Default: on a GPU 0, on the CPU 2048\n"
        "  --gpu-memory-utilization F  with --kv-cache-mb 0: share of the GPU's memory to fill\n"
        "                              (weights, workspace, KV cache), (0, 1] (default 0.9)\n"
        "  --max-num-batched-tokens N  tokens per step (default 2048)\n"
        "  --max-num-seqs N            sequences per step (default 256)\n"
        "  --no-prefix-cache           disable prefix caching\n"
        "  --no-chunked-prefill        disable chunked prefill\n"
        "  --enforce-eager             run decode steps op by op, not as CUDA graphs\n"

        "  --max-seconds S             stop stepping after S seconds and report what was done\n"
        "                              (marked partial); 0 = run to the end (default)\n"
        "  --no-warmup                 skip the untimed warm-up request (one prompt of the\n"
        "                              longest input length, 2 output tokens) run first\n"
        "  --bandwidth-gbs X           device memory bandwidth in GB/s (a measured copy rate,\n"
        "                              bytes read + written): prints the bandwidth floor of the\n"
        "                              decode work and the achieved share of it\n"
        "  --gemm-tflops X             device matrix rate in TFLOP/s (a measured large GEMM):\n"
        "                              prints the compute floor of the prompt tokens\n"
        "  --null-model                no forward pass at all (measures the engine's host-side\n"
        "                              cost: scheduling, batch metadata, sampling)\n"
        "  --json                      print the result as one JSON object on stdout\n"
        "  -h, --help                  this help\n");
}

static int range_arg(const char *flag, const char *s, int32_t *lo, int32_t *hi)
{
    char *end;
    errno = 0;
    long a = strtol(s, &end, 10), b = a;
    if (!errno && *end == ':') b = strtol(end + 1, &end, 10);
    if (errno || *end || a < 1 || b < a || b > 1 << 20) {
        fprintf(stderr, "pdserve-bench-offline: invalid value for %s: '%s' (expected N or A:B "
                "with 1 <= A <= B)\n", flag, s);
        return -1;
    }
    *lo = (int32_t)a;
    *hi = (int32_t)b;
    return 0;
}

static int int_arg(const char *flag, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "pdserve-bench-offline: invalid value for %s: '%s' (expected an integer "
                "in [%ld, %ld])\n", flag, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

/* A positive finite number (or, with allow_zero, 0). */
static int num_arg(const char *flag, const char *s, bool allow_zero, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v > 0 || (allow_zero && v == 0)) || v > 1e12) {
        fprintf(stderr, "pdserve-bench-offline: invalid value for %s: '%s' (expected a %s "
                "number)\n", flag, s, allow_zero ? "non-negative" : "positive");
        return -1;
    }
    *out = v;
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The null model: no computation, every logits row the same flat distribution. */
static int null_forward(void *ctx, const mr_batch *b, float *logits, char *err)
{
    const mc_config *cfg = ctx;
    (void)err;
    memset(logits, 0, (size_t)b->n_logits * (size_t)cfg->vocab_size * sizeof(float));
    return 0;
}

typedef struct {
    double elapsed_s;           /* first step to last */
    int64_t prompt_tokens;      /* sum of prompt lengths of the requests added */
    int64_t generated_tokens;
    int64_t finished;           /* requests that ran to their end */
    bool partial;               /* stopped by the time limit */
    eng_stats eng;
    /* What the forwards had to read and compute, from each step's outputs. A token with
     * n_output >= 2 came from a decode row: that row read its whole context (prompt + earlier
     * outputs + itself: n_prompt + n_output - 1 tokens) of KV, and the step read every weight
     * once for all its decode rows. A first token ends a prompt: its n_prompt - n_cached rows
     * were computed (over one or more steps), row p attending causally to p + 1 keys. (A
     * sequence recomputed after a preemption counts as a decode row; the run reports
     * preemptions, and the default workload has none.) */
    int64_t steps_with_decode;  /* steps with at least one decode row */
    int64_t decode_rows;
    int64_t kv_tokens_read;     /* sum over decode rows of their context length */
    int64_t prompt_rows;        /* prompt tokens computed (not from the prefix cache) */
    double attn_pairs;          /* causal (query, key) pairs of those rows */
} run_result;

/* Runs reqs[n] to completion (or until max_s seconds of stepping have passed, when > 0) on a
 * fresh engine built from ep over x, and fills *out. Returns 0 or an error (err set). */
static int run_engine(const eng_params *ep, const mc_config *cfg, eng_executor x,
                      const eng_request *reqs, int32_t n, double max_s, bool progress,
                      run_result *out, char *err)
{
    memset(out, 0, sizeof *out);
    eng *e = NULL;
    int rc = eng_create(ep, cfg, x, &e, err);
    if (rc < 0) return rc;
    int64_t total_max = 0;
    for (int32_t i = 0; i < n; i++) {
        char e2[PD_ERR_LEN];
        if ((rc = eng_add_request(e, &reqs[i], e2)) < 0) {
            pd_errf(err, rc, "request %d: %s", i, e2);
            eng_destroy(e);
            return rc;
        }
        out->prompt_tokens += reqs[i].n_prompt;
        total_max += reqs[i].stop.max_tokens;
    }
    bool tty = progress && isatty(2);
    double t0 = now_s(), last_print = t0, t = t0;
    while (eng_has_work(e)) {
        const eng_output *outs;
        int32_t k;
        if ((rc = eng_step(e, &outs, &k, err)) < 0) break;
        int64_t dec = 0;
        for (int32_t j = 0; j < k; j++) {
            const eng_output *o = &outs[j];
            if (o->finish != SEQ_FINISH_NONE) out->finished++;
            if (o->token < 0) continue;
            out->generated_tokens++;
            if (o->n_output >= 2) {
                dec++;
                out->kv_tokens_read += (int64_t)o->n_prompt + o->n_output - 1;
            } else {
                double pn = o->n_prompt, pc = o->n_cached;
                out->prompt_rows += o->n_prompt - o->n_cached;
                out->attn_pairs += (pn * (pn + 1) - pc * (pc + 1)) / 2;
            }
        }
        out->decode_rows += dec;
        out->steps_with_decode += dec > 0;
        t = now_s();
        if (max_s > 0 && t - t0 >= max_s && eng_has_work(e)) {
            out->partial = true;
            break;
        }
        if (progress && t - last_print > (tty ? 0.2 : 5.0)) {
            last_print = t;
            fprintf(stderr, "%sprogress: %lld/%lld tokens, %d running, %d waiting, %.1f s%s",
                    tty ? "\r" : "", (long long)out->generated_tokens, (long long)total_max,
                    eng_n_running(e), eng_n_waiting(e), t - t0, tty ? "   " : "\n");
        }
    }
    if (tty) fprintf(stderr, "\r%60s\r", "");
    out->elapsed_s = t - t0;
    out->eng = *eng_stats_get(e);
    eng_destroy(e); /* drops what a time limit left unfinished */
    return rc;
}

static double kv_mib(const mr *r)
{
    void *base;
    size_t bytes;
    mr_kv_pool(r, &base, &bytes);
    return (double)bytes / 1048576.0;
}

/* The bytes the experts of m (a rank's shard) hold, every sparse layer's, as loaded: act_dtype
 * elements of esize bytes, or a weight op set's weights (their bytes and scales). */
static double experts_bytes(const pd_model *m, size_t esize)
{
    const double lin = (double)m->cfg.hidden_size * m->shard.moe_intermediate * (double)esize;
    void *ctx = m->be->ctx;
    double b = 0;
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        const pd_layer_weights *w = &m->layers[l];
        if (!w->experts) continue;
        if (w->experts_ops) {
            b += (double)w->experts_ops->weight_bytes(ctx, w->experts_gate_up) +
                 (double)w->experts_ops->weight_bytes(ctx, w->experts_down);
            continue;
        }
        for (int32_t e = 0; e < m->cfg.n_experts; e++) {
            const pd_expert *x = &w->experts[e];
            b += x->gate_up_ops ? (double)x->gate_up_ops->weight_bytes(ctx, x->gate_up) : 2 * lin;
            b += x->down_ops ? (double)x->down_ops->weight_bytes(ctx, x->down) : lin;
        }
    }
    return b;
}

int main(int argc, char **argv)
{
    enum { O_MODEL = 256, O_FMT, O_BACKEND, O_THREADS, O_N, O_IN, O_OUT, O_SHARED, O_SEED, O_BS,
           O_KV, O_GPU_UTIL, O_MBT, O_MS, O_NOPC, O_NOCP, O_JSON, O_NULL, O_MAX_S, O_NOWARM,
           O_BW, O_TFLOPS, O_EAGER, O_TP, O_QUANT, O_KVD };
    static const struct option opts[] = {
        {"model", 1, 0, O_MODEL}, {"load-format", 1, 0, O_FMT}, {"backend", 1, 0, O_BACKEND},
        {"threads", 1, 0, O_THREADS}, {"num-requests", 1, 0, O_N}, {"input-len", 1, 0, O_IN},
        {"output-len", 1, 0, O_OUT}, {"shared-prefix", 1, 0, O_SHARED}, {"seed", 1, 0, O_SEED},
        {"block-size", 1, 0, O_BS}, {"kv-cache-mb", 1, 0, O_KV},
        {"gpu-memory-utilization", 1, 0, O_GPU_UTIL},
        {"max-num-batched-tokens", 1, 0, O_MBT}, {"max-num-seqs", 1, 0, O_MS},
        {"no-prefix-cache", 0, 0, O_NOPC}, {"no-chunked-prefill", 0, 0, O_NOCP},
        {"max-seconds", 1, 0, O_MAX_S}, {"no-warmup", 0, 0, O_NOWARM},
        {"bandwidth-gbs", 1, 0, O_BW}, {"gemm-tflops", 1, 0, O_TFLOPS},
        {"enforce-eager", 0, 0, O_EAGER}, {"tensor-parallel", 1, 0, O_TP},
        {"quantization", 1, 0, O_QUANT}, {"kv-cache-dtype", 1, 0, O_KVD},
        {"json", 0, 0, O_JSON}, {"null-model", 0, 0, O_NULL}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    const char *model_dir = NULL, *backend = "auto", *quant = "auto";
    pd_load_format fmt = PD_LOAD_SAFETENSORS;
    long n_req = 256, threads = 0, shared = 0, seed = 0, v, kv_mb = -1; /* -1: not given */
    long n_tp = 1;
    int32_t in_lo = 100, in_hi = 1024, out_lo = 100, out_hi = 1024;
    double max_s = 0, bw_gbs = 0, gemm_tflops = 0;
    bool json = false, null_model = false, warmup = true, prefix_cache = true, chunked = true;
    mr_params mp = mr_default_params();
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'h': usage(stdout); return 0;
        case O_MODEL: model_dir = optarg; break;
        case O_FMT:
            if (strcmp(optarg, "dummy") == 0) fmt = PD_LOAD_DUMMY;
            else if (strcmp(optarg, "safetensors") == 0) fmt = PD_LOAD_SAFETENSORS;
            else { fprintf(stderr, "pdserve-bench-offline: unknown --load-format '%s'\n", optarg); return 1; }
            break;
        case O_BACKEND: backend = optarg; break;
        case O_QUANT: quant = optarg; break;
        case O_KVD:
            if (mr_kv_dtype_parse(optarg, &mp.kv_dtype) < 0) {
                fprintf(stderr, "pdserve-bench-offline: unknown --kv-cache-dtype '%s'\n", optarg);
                return 1;
            }
            break;
        case O_THREADS: if (int_arg("--threads", optarg, 0, 1024, &threads)) return 1; break;
        case O_TP: if (int_arg("--tensor-parallel", optarg, 1, 64, &n_tp)) return 1; break;
        case O_N: if (int_arg("--num-requests", optarg, 1, 1 << 20, &n_req)) return 1; break;
        case O_IN: if (range_arg("--input-len", optarg, &in_lo, &in_hi)) return 1; break;
        case O_OUT: if (range_arg("--output-len", optarg, &out_lo, &out_hi)) return 1; break;
        case O_SHARED: if (int_arg("--shared-prefix", optarg, 0, 1 << 20, &shared)) return 1; break;
        case O_SEED: if (int_arg("--seed", optarg, 0, 1L << 62, &seed)) return 1; break;
        case O_BS: if (int_arg("--block-size", optarg, 1, 1024, &v)) return 1; mp.block_size = (int32_t)v; break;
        case O_KV: if (int_arg("--kv-cache-mb", optarg, 0, 1 << 24, &kv_mb)) return 1; break;
        case O_GPU_UTIL: {
            double u;
            if (num_arg("--gpu-memory-utilization", optarg, false, &u)) return 1;
            if (u > 1) {
                fprintf(stderr, "pdserve-bench-offline: --gpu-memory-utilization must be in (0, 1]\n");
                return 1;
            }
            mp.gpu_memory_utilization = u;
            break;
        }
        case O_MBT: if (int_arg("--max-num-batched-tokens", optarg, 1, 1 << 20, &v)) return 1; mp.max_num_batched_tokens = (int32_t)v; break;
        case O_MS: if (int_arg("--max-num-seqs", optarg, 1, 1 << 16, &v)) return 1; mp.max_num_seqs = (int32_t)v; break;
        case O_NOPC: prefix_cache = false; break;
        case O_NOCP: chunked = false; break;
        case O_MAX_S: if (num_arg("--max-seconds", optarg, true, &max_s)) return 1; break;
        case O_NOWARM: warmup = false; break;
        case O_EAGER: mp.max_graph_batch = 0; break;
        case O_BW: if (num_arg("--bandwidth-gbs", optarg, false, &bw_gbs)) return 1; break;
        case O_TFLOPS: if (num_arg("--gemm-tflops", optarg, false, &gemm_tflops)) return 1; break;
        case O_JSON: json = true; break;
        case O_NULL: null_model = true; break;
        default: fprintf(stderr, "Try 'pdserve-bench-offline --help'.\n"); return 1;
        }
    }
    if (optind < argc || !model_dir) {
        fprintf(stderr, "pdserve-bench-offline: %s (try --help)\n",
                model_dir ? "unexpected argument" : "--model DIR is required");
        return 1;
    }
    char err[PD_ERR_LEN];
    mc_config cfg;
    if (mc_load(model_dir, &cfg, err) < 0 || mc_set_quantization(&cfg, quant, err) < 0) {
        fprintf(stderr, "pdserve-bench-offline: %s\n", err);
        return 1;
    }
    if (in_hi + out_hi > cfg.max_position) {
        fprintf(stderr, "pdserve-bench-offline: input + output lengths up to %d exceed the model's "
                "maximum length %d\n", in_hi + out_hi, cfg.max_position);
        return 1;
    }
    int status = 1;
    tp_group *grp = NULL;
    pd_backend *be = NULL;      /* rank 0's */
    pd_model *m = NULL;         /* rank 0's shard */
    mr *r = NULL;
    eng_request *reqs = calloc((size_t)n_req, sizeof *reqs);
    int32_t *tokens = malloc(((size_t)n_req + 1) * (size_t)in_hi * sizeof(int32_t));
    if (!reqs || !tokens) {
        fprintf(stderr, "pdserve-bench-offline: out of memory\n");
        goto out;
    }
    uint64_t rs = (uint64_t)seed * 0x9e3779b97f4a7c15ull + 0x1234567;
#define RND() (rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17, rs)
    for (long i = 0; i < n_req; i++) {
        eng_request *q = &reqs[i];
        int32_t *p = tokens + (size_t)i * in_hi;
        q->id = (uint64_t)i;
        q->n_prompt = in_lo + (int32_t)(RND() % (uint64_t)(in_hi - in_lo + 1));
        uint64_t ps = 0xabcdef;
        for (int32_t j = 0; j < q->n_prompt; j++) {
            if (j < shared) { ps ^= ps << 13; ps ^= ps >> 7; ps ^= ps << 17; p[j] = (int32_t)(ps % (uint64_t)cfg.vocab_size); }
            else p[j] = (int32_t)(RND() % (uint64_t)cfg.vocab_size);
        }
        q->prompt = p;
        q->stop.max_tokens = out_lo + (int32_t)(RND() % (uint64_t)(out_hi - out_lo + 1));
        q->stop.ignore_eos = true;
        q->sampling = smp_default_params();
        q->sampling.temperature = 0;
    }
    /* The warm-up request: a prompt of the longest input length (up to one step's tokens)
     * from its own random stream, so that it shares no prefix-cache block with the workload. */
    eng_request wu = reqs[0];
    int32_t *wu_prompt = tokens + (size_t)n_req * in_hi;
    wu.id = (uint64_t)n_req;
    wu.n_prompt = in_hi < mp.max_num_batched_tokens ? in_hi : mp.max_num_batched_tokens;
    if (wu.n_prompt > cfg.max_position - 2) wu.n_prompt = cfg.max_position - 2;
    if (wu.n_prompt < 1) wu.n_prompt = 1;
    for (int32_t j = 0; j < wu.n_prompt; j++)
        wu_prompt[j] = (int32_t)(RND() % (uint64_t)cfg.vocab_size);
    wu.prompt = wu_prompt;
    wu.stop.max_tokens = cfg.max_position - wu.n_prompt < 2 ? 1 : 2;

    int32_t n_blocks, block_size = mp.block_size;
    eng_executor x;
    size_t esize;             /* bytes per element of weights and activations */
    size_t kv_esize;          /* bytes per element of the KV cache */
    double weight_bytes = 0;  /* bytes the weights hold (0: n_params elements of esize) */
    int64_t n_params;
    if (null_model) {
        int64_t kv_bytes = (kv_mb > 0 ? kv_mb : 2048) << 20;
        /* Same pool size as the real KV cache would have; the forward writes flat logits. */
        esize = kv_esize = 4;
        int64_t per_block = (int64_t)block_size * cfg.n_kv_heads * cfg.head_dim * 4 * 2 * cfg.n_layers;
        n_blocks = (int32_t)(kv_bytes / per_block);
        n_params = mc_param_count(&cfg);
        x = (eng_executor){.forward = null_forward, .ctx = &cfg};
        warmup = false; /* nothing to warm */
        fprintf(stderr, "pdserve-bench-offline: null model of %s's shape; %ld requests, input "
                "%d..%d, output %d..%d; KV pool %d blocks of %d\n", model_dir, n_req, in_lo,
                in_hi, out_lo, out_hi, n_blocks, block_size);
    } else {
        pd_backend_params bp = pd_backend_default_params();
        bp.n_threads = (int32_t)threads;
        /* one backend and one weight shard a rank (the whole model on one) */
        tp_group_params gp = {.backend = backend, .bp = bp, .n_ranks = (int32_t)n_tp,
                              .cfg = &cfg, .dir = model_dir, .fmt = fmt, .seed = 42};
        if (tp_group_load(&gp, &grp, err) < 0) {
            fprintf(stderr, "pdserve-bench-offline: %s\n", err);
            goto out;
        }
        be = grp->be[0];
        m = grp->models[0];
        /* KV pool: --kv-cache-mb N; 0, or not given on a backend that reports device memory:
         * the runner sizes it from --gpu-memory-utilization after the weights and its
         * workspace; not given elsewhere: 2048 MiB. */
        if (kv_mb == 0 && !be->ops->mem_info) {
            fprintf(stderr, "pdserve-bench-offline: --kv-cache-mb 0 (from device memory) needs a "
                    "backend that reports device memory; %s does not\n", be->ops->name);
            goto out;
        }
        mp.kv_cache_bytes = kv_mb > 0 ? (int64_t)kv_mb << 20
                          : kv_mb == 0 || be->ops->mem_info ? 0 : 2048ll << 20;
        if (mr_create_tp(&mp, (const pd_model *const *)grp->models, grp->n_ranks, grp->comm, &r,
                         err) < 0) {
            fprintf(stderr, "pdserve-bench-offline: %s\n", err);
            goto out;
        }
        n_blocks = mr_n_blocks(r);
        esize = pd_dtype_size(be->ops->act_dtype);
        kv_esize = pd_dtype_size(mr_kv_dtype(r));
        n_params = m->n_params;
        weight_bytes = (double)m->weight_bytes;
        x = eng_executor_runner(r);
        fprintf(stderr, "pdserve-bench-offline: %s (%s, %.1fM params%s) on %s; %ld requests, input "
                "%d..%d, output %d..%d; KV pool %d blocks of %d (%.1f MiB%s); %d decode graphs\n",
                model_dir, cfg.arch_name, (double)n_params / 1e6,
                n_tp > 1 ? " on rank 0 of the tensor-parallel ranks" : "", be->ops->name, n_req, in_lo,
                in_hi, out_lo, out_hi, n_blocks, block_size, kv_mib(r),
                mp.kv_cache_bytes ? "" : ", from --gpu-memory-utilization", mr_n_graphs(r));
    }
    eng_params ep = {ENG_MODE_COLOCATED, n_blocks, block_size, mp.max_num_batched_tokens,
                     mp.max_num_seqs, 0, prefix_cache, chunked, eng_async_steps_default()};
    run_result res;
    if (warmup) {
        /* cuBLAS picks its algorithms and the driver loads kernels on first use: keep that
         * out of the timed run (nano-vllm's bench warms up the same way). */
        if (run_engine(&ep, &cfg, x, &wu, 1, 0, false, &res, err) < 0) {
            fprintf(stderr, "pdserve-bench-offline: warm-up: %s\n", err);
            goto out;
        }
        fprintf(stderr, "pdserve-bench-offline: warm-up (%d prompt tokens, %d output) took "
                "%.3f s\n", wu.n_prompt, wu.stop.max_tokens, res.elapsed_s);
    }
    int64_t graph_steps = r ? mr_graph_steps(r) : 0;
    if (run_engine(&ep, &cfg, x, reqs, (int32_t)n_req, max_s, true, &res, err) < 0) {
        fprintf(stderr, "pdserve-bench-offline: %s\n", err);
        goto out;
    }
    graph_steps = r ? mr_graph_steps(r) - graph_steps : 0;
    if (res.partial)
        fprintf(stderr, "pdserve-bench-offline: --max-seconds %g reached: %lld of %ld requests "
                "finished; the figures cover the part that ran\n", max_s,
                (long long)res.finished, n_req);

    const eng_stats *es = &res.eng;
    double out_tps = res.elapsed_s > 0 ? res.generated_tokens / res.elapsed_s : 0;
    double prefill_tps = es->prefill_model_s > 0 ? es->prompt_tokens_computed / es->prefill_model_s : 0;
    double decode_tps = es->decode_model_s > 0 ? es->decode_tokens / es->decode_model_s : 0;
    double mean_batch = es->steps ? (double)es->batch_seqs_sum / es->steps : 0;
    double hit = es->admitted_prompt_tokens ? (double)es->cached_tokens / (double)es->admitted_prompt_tokens : 0;
    double host_us = es->steps ? (es->host_s - es->sample_s) / es->steps * 1e6 : 0;
    double sample_us = es->steps ? es->sample_s / es->steps * 1e6 : 0;

    /* Bytes a decode step must read at least: every weight once, except that an untied
     * embedding table is only looked up (its few rows are noise), and the KV of each decode
     * row's context: 2 (K, V) x layers x KV heads x head_dim elements per token. */
    int64_t emb = (int64_t)cfg.vocab_size * cfg.hidden_size;
    double w_bytes = weight_bytes > 0 /* quantized weights: the bytes held */
                         ? weight_bytes - (cfg.tie_word_embeddings ? 0 : (double)emb * esize)
                         : (double)(n_params - (cfg.tie_word_embeddings ? 0 : emb)) * (double)esize;
    /* A mixture of experts' step reads only the experts its rows chose: of E experts with k a
     * row, b rows choose E (1 - (1 - k / E)^b) distinct ones on average under uniform routing
     * (exactly k at batch 1), b the mean decode rows of a step. The others' bytes (as held:
     * FP8 experts one byte an element and their scales) come off w_bytes. */
    if (cfg.n_experts > 0 && res.steps_with_decode > 0 && m) {
        const double E = cfg.n_experts, k = cfg.n_experts_per_tok;
        const double b = (double)res.decode_rows / (double)res.steps_with_decode;
        const double touched = E * (1.0 - pow(1.0 - k / E, b));
        w_bytes -= (E - touched) * experts_bytes(m, esize) / E;
    }
    /* per rank with tensor parallelism: rank 0's KV heads and query heads */
    const int32_t kv_heads = m ? m->shard.n_kv_heads : cfg.n_kv_heads;
    const int32_t q_heads = m ? m->shard.n_heads : cfg.n_heads;
    double kv_tok_bytes = 2.0 * cfg.n_layers * kv_heads * cfg.head_dim * (double)kv_esize;
    double kv_bytes = (double)res.kv_tokens_read * kv_tok_bytes;
    double dec_bytes = w_bytes * (double)res.steps_with_decode + kv_bytes;
    double bw_floor_s = bw_gbs > 0 ? dec_bytes / (bw_gbs * 1e9) : 0;
    double bw_floor_tps = bw_floor_s > 0 ? res.generated_tokens / bw_floor_s : 0;
    double bw_ratio = bw_floor_s > 0 && res.elapsed_s > 0 ? bw_floor_s / res.elapsed_s : 0;
    /* FLOPs of the prompt rows: 2 per weight of every product a row runs (a mixture of
     * experts': its k experts) except the embedding lookup
     * (the lm_head runs on one row per prompt), plus the causal attention: 2 products
     * (QK^T, PV) of head_dim multiply-adds per (query, key) pair and query head. */
    double mm_params = (double)(mc_active_param_count(&cfg) - emb); /* (a row's experts) */
    double pf_flops = 2.0 * mm_params * (double)res.prompt_rows +
                      4.0 * q_heads * cfg.head_dim * res.attn_pairs;
    double pf_floor_s = gemm_tflops > 0 ? pf_flops / (gemm_tflops * 1e12) : 0;
    double pf_ratio = pf_floor_s > 0 && es->prefill_model_s > 0 ? pf_floor_s / es->prefill_model_s : 0;

    if (json) {
        printf("{\"requests\": %ld, \"finished_requests\": %lld, \"partial\": %s, "
               "\"prompt_tokens\": %lld, \"output_tokens\": %lld, "
               "\"elapsed_s\": %.4f, \"output_tok_s\": %.2f, \"prefill_tok_s\": %.2f, "
               "\"decode_tok_s\": %.2f, \"steps\": %lld, \"mean_batch\": %.2f, "
               "\"peak_kv_blocks\": %d, \"kv_blocks\": %d, \"prefix_hit_rate\": %.4f, "
               "\"preemptions\": %lld, \"host_us_per_step\": %.2f, \"sample_us_per_step\": %.2f, "
               "\"weight_bytes_per_step\": %.0f, \"kv_bytes_per_token\": %.0f, "
               "\"steps_with_decode\": %lld, \"decode_rows\": %lld, \"kv_tokens_read\": %lld, "
               "\"decode_bytes\": %.0f, \"bandwidth_gbs\": %.1f, \"floor_s\": %.4f, "
               "\"floor_tok_s\": %.1f, \"floor_ratio\": %.4f, \"prompt_rows\": %lld, "
               "\"prefill_flops\": %.4g, \"gemm_tflops\": %.1f, \"prefill_floor_s\": %.5f, "
               "\"prefill_model_s\": %.5f, \"prefill_floor_ratio\": %.4f, \"graph_steps\": %lld, "
               "\"tensor_parallel\": %ld}\n",
               n_req, (long long)res.finished, res.partial ? "true" : "false",
               (long long)res.prompt_tokens, (long long)res.generated_tokens, res.elapsed_s,
               out_tps, prefill_tps, decode_tps, (long long)es->steps, mean_batch,
               es->peak_blocks_used, n_blocks, hit, (long long)es->preemptions, host_us,
               sample_us, w_bytes, kv_tok_bytes, (long long)res.steps_with_decode,
               (long long)res.decode_rows, (long long)res.kv_tokens_read, dec_bytes, bw_gbs,
               bw_floor_s, bw_floor_tps, bw_ratio, (long long)res.prompt_rows, pf_flops,
               gemm_tflops, pf_floor_s, es->prefill_model_s, pf_ratio, (long long)graph_steps,
               n_tp);
    } else {
        printf("requests            %ld (%lld finished%s)\n", n_req, (long long)res.finished,
               res.partial ? ", stopped by --max-seconds" : "");
        if (n_tp > 1)
            printf("tensor parallel     %ld ranks (the bytes and FLOPs below are rank 0's)\n", n_tp);
        printf("prompt tokens       %lld\n", (long long)res.prompt_tokens);
        printf("output tokens       %lld\n", (long long)res.generated_tokens);
        printf("elapsed             %.3f s\n", res.elapsed_s);
        printf("output throughput   %.1f tok/s\n", out_tps);
        printf("prefill throughput  %.1f tok/s (model time of steps with prompt tokens)\n", prefill_tps);
        printf("decode throughput   %.1f tok/s (model time of decode-only steps)\n", decode_tps);
        printf("steps               %lld (mean batch %.1f sequences; %lld replayed a CUDA graph)\n",
               (long long)es->steps, mean_batch, (long long)graph_steps);
        printf("peak KV blocks      %d of %d\n", es->peak_blocks_used, n_blocks);
        printf("prefix cache hits   %.1f%% of admitted prompt tokens\n", 100 * hit);
        printf("preemptions         %lld\n", (long long)es->preemptions);
        printf("host time per step  %.1f us bookkeeping + %.1f us sampling\n", host_us, sample_us);
        printf("decode bytes        %.4g GB weights x %lld steps + %.4g GB KV (%lld context "
               "tokens x %.0f B) = %.4g GB\n", w_bytes / 1e9, (long long)res.steps_with_decode,
               kv_bytes / 1e9, (long long)res.kv_tokens_read, kv_tok_bytes, dec_bytes / 1e9);
        if (bw_gbs > 0)
            printf("bandwidth floor     %.4g s at %g GB/s = %.1f tok/s; achieved %.1f%% of it\n",
                   bw_floor_s, bw_gbs, bw_floor_tps, 100 * bw_ratio);
        printf("prompt FLOPs        %.4g TFLOP (%lld prompt rows)\n", pf_flops / 1e12,
               (long long)res.prompt_rows);
        if (gemm_tflops > 0)
            printf("prefill floor       %.4g s at %g TFLOP/s vs %.4g s model time of prompt "
                   "steps: %.1f%% of it\n", pf_floor_s, gemm_tflops, es->prefill_model_s,
                   100 * pf_ratio);
    }
    status = 0;
out:
    free(reqs);
    free(tokens);
    mr_destroy(r);
    tp_group_destroy(grp); /* m and be with it */
    return status;
}
