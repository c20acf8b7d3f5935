/* bench_offline_main.c -- pdserve-bench-offline: offline throughput of the engine on N
 * requests with random prompts and lengths (nano-vllm's workload by default: 256 requests,
 * input and output lengths uniform in [100, 1024], ignore EOS). Real or dummy weights. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "engine/generate.h"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: pdserve-bench-offline --model DIR [options]\n"
        "\n"
        "Runs N requests with random token prompts through the engine (continuous batching,\n"
        "EOS ignored) and reports throughput, batch sizes, KV usage and host overhead.\n"
        "\n"
        "  --model DIR                 HuggingFace model directory (config.json at least)\n"
        "  --load-format FMT           safetensors (default) or dummy (random weights)\n"
        "  --backend NAME              auto (default), cpu or cuda\n"
        "  --threads N                 CPU threads for matrix products (default: all cores)\n"
        "  --num-requests N            default 256\n"
        "  --input-len A:B             prompt lengths uniform in [A, B] (default 100:1024)\n"
        "  --output-len A:B            output lengths uniform in [A, B] (default 100:1024)\n"
        "  --shared-prefix N           the first N prompt tokens are the same for all requests\n"
        "  --seed S                    workload seed (default 0)\n"
        "  --block-size N              tokens per KV block (default 16)\n"
        "  --kv-cache-mb N             KV cache size in MiB (default: on a GPU, from\n"
        "                              --gpu-memory-utilization; on the CPU, 2048)\n"
        "  --gpu-memory-utilization F  share of the GPU's memory to fill (weights, workspace, KV\n"
        "                              cache) when --kv-cache-mb is not given, (0, 1] (default 0.9)\n"
        "  --max-num-batched-tokens N  tokens per step (default 2048)\n"
        "  --max-num-seqs N            sequences per step (default 256)\n"
        "  --no-prefix-cache           disable prefix caching\n"
        "  --no-chunked-prefill        disable chunked prefill\n"
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

/* The null model: no computation, every logits row the same flat distribution. */
static int null_forward(void *ctx, const mr_batch *b, float *logits, char *err)
{
    const mc_config *cfg = ctx;
    (void)err;
    memset(logits, 0, (size_t)b->n_logits * (size_t)cfg->vocab_size * sizeof(float));
    return 0;
}

static double kv_mib(const mr *r)
{
    void *base;
    size_t bytes;
    mr_kv_pool(r, &base, &bytes);
    return (double)bytes / 1048576.0;
}

int main(int argc, char **argv)
{
    enum { O_MODEL = 256, O_FMT, O_BACKEND, O_THREADS, O_N, O_IN, O_OUT, O_SHARED, O_SEED, O_BS,
           O_KV, O_GPU_UTIL, O_MBT, O_MS, O_NOPC, O_NOCP, O_JSON, O_NULL };
    static const struct option opts[] = {
        {"model", 1, 0, O_MODEL}, {"load-format", 1, 0, O_FMT}, {"backend", 1, 0, O_BACKEND},
        {"threads", 1, 0, O_THREADS}, {"num-requests", 1, 0, O_N}, {"input-len", 1, 0, O_IN},
        {"output-len", 1, 0, O_OUT}, {"shared-prefix", 1, 0, O_SHARED}, {"seed", 1, 0, O_SEED},
        {"block-size", 1, 0, O_BS}, {"kv-cache-mb", 1, 0, O_KV},
        {"gpu-memory-utilization", 1, 0, O_GPU_UTIL},
        {"max-num-batched-tokens", 1, 0, O_MBT}, {"max-num-seqs", 1, 0, O_MS},
        {"no-prefix-cache", 0, 0, O_NOPC}, {"no-chunked-prefill", 0, 0, O_NOCP},
        {"json", 0, 0, O_JSON}, {"null-model", 0, 0, O_NULL}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    const char *model_dir = NULL, *backend = "auto";
    pd_load_format fmt = PD_LOAD_SAFETENSORS;
    long n_req = 256, threads = 0, shared = 0, seed = 0, v;
    int32_t in_lo = 100, in_hi = 1024, out_lo = 100, out_hi = 1024;
    bool json = false, null_model = false;
    mr_params mp = mr_default_params();
    mp.kv_cache_bytes = 0; /* not given: set once the backend is known */
    gen_options go = gen_default_options();
    go.progress = true;
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
        case O_THREADS: if (int_arg("--threads", optarg, 0, 1024, &threads)) return 1; break;
        case O_N: if (int_arg("--num-requests", optarg, 1, 1 << 20, &n_req)) return 1; break;
        case O_IN: if (range_arg("--input-len", optarg, &in_lo, &in_hi)) return 1; break;
        case O_OUT: if (range_arg("--output-len", optarg, &out_lo, &out_hi)) return 1; break;
        case O_SHARED: if (int_arg("--shared-prefix", optarg, 0, 1 << 20, &shared)) return 1; break;
        case O_SEED: if (int_arg("--seed", optarg, 0, 1L << 62, &seed)) return 1; break;
        case O_BS: if (int_arg("--block-size", optarg, 1, 1024, &v)) return 1; mp.block_size = (int32_t)v; break;
        case O_KV: if (int_arg("--kv-cache-mb", optarg, 1, 1 << 24, &v)) return 1; mp.kv_cache_bytes = (int64_t)v << 20; break;
        case O_GPU_UTIL: {
            char *end;
            double u = strtod(optarg, &end);
            if (end == optarg || *end || !(u > 0 && u <= 1)) {
                fprintf(stderr, "pdserve-bench-offline: --gpu-memory-utilization must be in (0, 1]\n");
                return 1;
            }
            mp.gpu_memory_utilization = u;
            break;
        }
        case O_MBT: if (int_arg("--max-num-batched-tokens", optarg, 1, 1 << 20, &v)) return 1; mp.max_num_batched_tokens = (int32_t)v; break;
        case O_MS: if (int_arg("--max-num-seqs", optarg, 1, 1 << 16, &v)) return 1; mp.max_num_seqs = (int32_t)v; break;
        case O_NOPC: go.enable_prefix_cache = false; break;
        case O_NOCP: go.enable_chunked_prefill = false; break;
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
    if (mc_load(model_dir, &cfg, err) < 0) {
        fprintf(stderr, "pdserve-bench-offline: %s\n", err);
        return 1;
    }
    if (in_hi + out_hi > cfg.max_position) {
        fprintf(stderr, "pdserve-bench-offline: input + output lengths up to %d exceed the model's "
                "maximum length %d\n", in_hi + out_hi, cfg.max_position);
        return 1;
    }
    int status = 1;
    pd_backend *be = NULL;
    pd_model *m = NULL;
    mr *r = NULL;
    gen_request *reqs = calloc((size_t)n_req, sizeof *reqs);
    gen_result *res = calloc((size_t)n_req, sizeof *res);
    int32_t *tokens = malloc((size_t)n_req * (size_t)in_hi * sizeof(int32_t));
    if (!reqs || !res || !tokens) goto out;
    uint64_t rs = (uint64_t)seed * 0x9e3779b97f4a7c15ull + 0x1234567;
#define RND() (rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17, rs)
    for (long i = 0; i < n_req; i++) {
        gen_request *q = &reqs[i];
        int32_t *p = tokens + (size_t)i * in_hi;
        q->n_prompt = in_lo + (int32_t)(RND() % (uint64_t)(in_hi - in_lo + 1));
        uint64_t ps = 0xabcdef;
        for (int32_t j = 0; j < q->n_prompt; j++) {
            if (j < shared) { ps ^= ps << 13; ps ^= ps >> 7; ps ^= ps << 17; p[j] = (int32_t)(ps % (uint64_t)cfg.vocab_size); }
            else p[j] = (int32_t)(RND() % (uint64_t)cfg.vocab_size);
        }
        q->prompt = p;
        q->max_tokens = out_lo + (int32_t)(RND() % (uint64_t)(out_hi - out_lo + 1));
        q->ignore_eos = true;
        q->sampling = smp_default_params();
        q->sampling.temperature = 0;
    }
    gen_stats st;
    int32_t n_blocks, block_size = mp.block_size;
    if (null_model) {
        if (mp.kv_cache_bytes == 0) mp.kv_cache_bytes = 2048ll << 20;
        /* Same pool size as the real KV cache would have; the forward writes flat logits. */
        int64_t per_block = (int64_t)block_size * cfg.n_kv_heads * cfg.head_dim * 4 * 2 * cfg.n_layers;
        n_blocks = (int32_t)(mp.kv_cache_bytes / per_block);
        eng_params ep = {ENG_MODE_COLOCATED, n_blocks, block_size, mp.max_num_batched_tokens,
                         mp.max_num_seqs, 0, go.enable_prefix_cache, go.enable_chunked_prefill};
        fprintf(stderr, "pdserve-bench-offline: null model of %s's shape; %ld requests, input "
                "%d..%d, output %d..%d; KV pool %d blocks of %d\n", model_dir, n_req, in_lo,
                in_hi, out_lo, out_hi, n_blocks, block_size);
        eng_executor x = {null_forward, &cfg, NULL};
        if (gen_run_engine(&ep, &cfg, x, reqs, (int32_t)n_req, &go, res, &st, err) < 0) {
            fprintf(stderr, "pdserve-bench-offline: %s\n", err);
            goto out;
        }
    } else {
        pd_backend_params bp = pd_backend_default_params();
        bp.n_threads = (int32_t)threads;
        if (pd_backend_create(backend, &bp, &be, err) < 0) {
            fprintf(stderr, "pdserve-bench-offline: %s\n", err);
            goto out;
        }
        /* --kv-cache-mb not given: from device memory where the backend reports it (the
         * runner measures after the weights and its workspace), else 2048 MiB. */
        if (mp.kv_cache_bytes == 0 && !be->ops->mem_info) mp.kv_cache_bytes = 2048ll << 20;
        if (pd_model_load(&cfg, model_dir, fmt, 42, be, &m, err) < 0 ||
            mr_create(&mp, m, &r, err) < 0) {
            fprintf(stderr, "pdserve-bench-offline: %s\n", err);
            goto out;
        }
        n_blocks = mr_n_blocks(r);
        fprintf(stderr, "pdserve-bench-offline: %s (%s, %.1fM params) on %s; %ld requests, input "
                "%d..%d, output %d..%d; KV pool %d blocks of %d (%.1f MiB)\n", model_dir,
                cfg.arch_name, (double)m->n_params / 1e6, be->ops->name, n_req, in_lo, in_hi,
                out_lo, out_hi, n_blocks, block_size, kv_mib(r));
        if (gen_run_opts(r, m, reqs, (int32_t)n_req, &go, res, &st, err) < 0) {
            fprintf(stderr, "pdserve-bench-offline: %s\n", err);
            goto out;
        }
    }
    const eng_stats *es = &st.eng;
    double out_tps = st.generated_tokens / st.elapsed_s;
    double prefill_tps = es->prefill_model_s > 0 ? es->prompt_tokens_computed / es->prefill_model_s : 0;
    double decode_tps = es->decode_model_s > 0 ? es->decode_tokens / es->decode_model_s : 0;
    double mean_batch = es->steps ? (double)es->batch_seqs_sum / es->steps : 0;
    double hit = st.prompt_tokens ? (double)es->cached_tokens / (double)es->admitted_prompt_tokens : 0;
    double host_us = es->steps ? (es->host_s - es->sample_s) / es->steps * 1e6 : 0;
    double sample_us = es->steps ? es->sample_s / es->steps * 1e6 : 0;
    if (json) {
        printf("{\"requests\": %ld, \"prompt_tokens\": %lld, \"output_tokens\": %lld, "
               "\"elapsed_s\": %.4f, \"output_tok_s\": %.2f, \"prefill_tok_s\": %.2f, "
               "\"decode_tok_s\": %.2f, \"steps\": %lld, \"mean_batch\": %.2f, "
               "\"peak_kv_blocks\": %d, \"kv_blocks\": %d, \"prefix_hit_rate\": %.4f, "
               "\"preemptions\": %lld, \"host_us_per_step\": %.2f, \"sample_us_per_step\": %.2f}\n",
               n_req, (long long)st.prompt_tokens, (long long)st.generated_tokens, st.elapsed_s,
               out_tps, prefill_tps, decode_tps, (long long)es->steps, mean_batch,
               es->peak_blocks_used, n_blocks, hit, (long long)es->preemptions, host_us,
               sample_us);
    } else {
        printf("requests            %ld\n", n_req);
        printf("prompt tokens       %lld\n", (long long)st.prompt_tokens);
        printf("output tokens       %lld\n", (long long)st.generated_tokens);
        printf("elapsed             %.3f s\n", st.elapsed_s);
        printf("output throughput   %.1f tok/s\n", out_tps);
        printf("prefill throughput  %.1f tok/s (model time of steps with prompt tokens)\n", prefill_tps);
        printf("decode throughput   %.1f tok/s (model time of decode-only steps)\n", decode_tps);
        printf("steps               %lld (mean batch %.1f sequences)\n", (long long)es->steps, mean_batch);
        printf("peak KV blocks      %d of %d\n", es->peak_blocks_used, n_blocks);
        printf("prefix cache hits   %.1f%% of admitted prompt tokens\n", 100 * hit);
        printf("preemptions         %lld\n", (long long)es->preemptions);
        printf("host time per step  %.1f us bookkeeping + %.1f us sampling\n", host_us, sample_us);
    }
    status = 0;
out:
    if (res) gen_results_free(res, (int32_t)n_req);
    free(res);
    free(reqs);
    free(tokens);
    mr_destroy(r);
    pd_model_destroy(m);
    pd_backend_destroy(be);
    return status;
}
