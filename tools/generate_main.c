/* generate_main.c -- pdserve-generate: offline generation on one engine, for checking a
 * model end to end and for measuring CPU/GPU throughput without the services. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/log.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "engine/tp.h"
#include "text/model_config.h"
#include "text/tokenizer.h"

#define MAX_PROMPTS 4096

static void usage(FILE *f)
{
    fprintf(f,
        "usage: pdserve-generate --model DIR (--prompt-ids 1,2,3 ... | --prompt TEXT) [options]\n"
        "\n"
        "Generates a completion for each prompt (all prompts run together in one batch) and\n"
        "prints its text (token ids when the model has no tokenizer). Throughput goes to stderr.\n"
        "\n"
        "model:\n"
        "  --model DIR                 HuggingFace model directory (config.json, *.safetensors)\n"
        "  --load-format FMT           safetensors (default) or dummy (random weights)\n"
        "  --backend NAME              auto (default), cpu or cuda\n"
        "  --threads N                 CPU threads for matrix products (default: all cores)\n"
        "  --quantization Q            auto (the checkpoint's; default), none, or fp8 (the\n"
        "                              linears quantized per channel at load)\n"
        "  --kv-cache-dtype T          auto (default), bf16 (the backend's own) or fp8\n"
        "  --tensor-parallel N         split the model over N ranks (one thread each; on cuda\n"
        "                              GPUs 0 .. N - 1 with NCCL); heads and MLP must divide\n"
        "prompts:\n"
        "  --prompt-ids LIST           comma-separated token ids; repeat for more prompts\n"
        "  --prompt TEXT               text prompt (tokenized with the model's tokenizer.json,\n"
        "                              BOS added as its config says); repeat for more prompts\n"
        "  --random-prompt-len N       add one prompt of N random token ids (benchmarks)\n"
        "  --repeat N                  run every prompt N times in the batch (default 1)\n"
        "sampling and stopping:\n"
        "  --max-tokens N              new tokens per prompt (default 64)\n"
        "  --min-tokens N              ignore EOS and stop ids before N tokens (default 0)\n"
        "  --temperature T             0 = greedy (default 1.0)\n"
        "  --top-p P                   nucleus mass in (0, 1] (default 1)\n"
        "  --top-k K                   keep the K most likely tokens; 0 = off (default)\n"
        "  --min-p P                   drop tokens below P * p_max (default 0)\n"
        "  --repetition-penalty R      > 0, 1 = off (default)\n"
        "  --presence-penalty X        [-2, 2] (default 0)\n"
        "  --frequency-penalty X       [-2, 2] (default 0)\n"
        "  --seed S                    sampling seed (per prompt i: S + i)\n"
        "  --stop-token-ids LIST       extra stop ids\n"
        "  --ignore-eos                don't stop at the model's EOS ids\n"
        "engine:\n"
        "  --block-size N              tokens per KV block (default 16)\n"
        "  --kv-cache-mb N             KV cache size in MiB (default: on a GPU, from\n"
        "                              --gpu-memory-utilization; on the CPU, what the batch needs)\n"
        "  --gpu-memory-utilization F  share of the GPU's memory to fill (weights, workspace, KV\n"
        "                              cache) when --kv-cache-mb is not given, (0, 1] (default 0.9)\n"
        "  --max-num-batched-tokens N  tokens per forward (default 2048)\n"
        "  --max-num-seqs N            sequences per forward (default 256)\n"
        "  --enforce-eager             run decode steps op by op, not as CUDA graphs\n"
        "output:\n"
        "  --json                      one JSON object per prompt: {\"token_ids\": [...], ...}\n"
        "  --quiet                     no progress lines on stderr\n"
        "  -h, --help                  this help\n");
}

static int parse_i64(const char *flag, const char *s, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "pdserve-generate: invalid value for %s: '%s' (expected an integer in "
                "[%lld, %lld])\n", flag, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_f(const char *flag, const char *s, float *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) {
        fprintf(stderr, "pdserve-generate: invalid value for %s: '%s' (expected a number)\n",
                flag, s);
        return -1;
    }
    *out = (float)v;
    return 0;
}

/* Parses "1,2,3" into a new array (caller frees). Returns the count or -1. */
static int parse_ids(const char *flag, const char *s, int32_t **out)
{
    int cap = 16, n = 0;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    if (!v) return -1;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long long x = strtoll(p, &end, 10);
        if (errno || end == p || x < INT32_MIN || x > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "pdserve-generate: invalid value for %s: '%s' (expected comma-"
                    "separated integers)\n", flag, s);
            free(v);
            return -1;
        }
        if (n == cap) {
            int32_t *nv = realloc(v, (size_t)(cap *= 2) * sizeof *v);
            if (!nv) { free(v); return -1; }
            v = nv;
        }
        v[n++] = (int32_t)x;
        p = *end ? end + 1 : end;
        if (*end == ',' && !*p) { /* trailing comma */
            fprintf(stderr, "pdserve-generate: invalid value for %s: '%s'\n", flag, s);
            free(v);
            return -1;
        }
    }
    if (n == 0) {
        fprintf(stderr, "pdserve-generate: %s needs at least one token id\n", flag);
        free(v);
        return -1;
    }
    *out = v;
    return n;
}

enum {
    OPT_MODEL = 256, OPT_LOAD_FORMAT, OPT_BACKEND, OPT_THREADS, OPT_PROMPT_IDS, OPT_PROMPT,
    OPT_RANDOM_LEN, OPT_REPEAT, OPT_MAX_TOKENS, OPT_MIN_TOKENS, OPT_TEMP, OPT_TOP_P, OPT_TOP_K,
    OPT_MIN_P, OPT_REP_PEN, OPT_PRES_PEN, OPT_FREQ_PEN, OPT_SEED, OPT_STOP_IDS, OPT_IGNORE_EOS,
    OPT_BLOCK_SIZE, OPT_KV_MB, OPT_GPU_UTIL, OPT_MAX_BT, OPT_MAX_SEQS, OPT_EAGER, OPT_JSON, OPT_QUIET,
    OPT_TP, OPT_QUANT, OPT_KV_DTYPE,
};

static const struct option k_opts[] = {
    {"model", required_argument, 0, OPT_MODEL},
    {"load-format", required_argument, 0, OPT_LOAD_FORMAT},
    {"backend", required_argument, 0, OPT_BACKEND},
    {"threads", required_argument, 0, OPT_THREADS},
    {"tensor-parallel", required_argument, 0, OPT_TP},
    {"quantization", required_argument, 0, OPT_QUANT},
    {"kv-cache-dtype", required_argument, 0, OPT_KV_DTYPE},
    {"prompt-ids", required_argument, 0, OPT_PROMPT_IDS},
    {"prompt", required_argument, 0, OPT_PROMPT},
    {"random-prompt-len", required_argument, 0, OPT_RANDOM_LEN},
    {"repeat", required_argument, 0, OPT_REPEAT},
    {"max-tokens", required_argument, 0, OPT_MAX_TOKENS},
    {"min-tokens", required_argument, 0, OPT_MIN_TOKENS},
    {"temperature", required_argument, 0, OPT_TEMP},
    {"top-p", required_argument, 0, OPT_TOP_P},
    {"top-k", required_argument, 0, OPT_TOP_K},
    {"min-p", required_argument, 0, OPT_MIN_P},
    {"repetition-penalty", required_argument, 0, OPT_REP_PEN},
    {"presence-penalty", required_argument, 0, OPT_PRES_PEN},
    {"frequency-penalty", required_argument, 0, OPT_FREQ_PEN},
    {"seed", required_argument, 0, OPT_SEED},
    {"stop-token-ids", required_argument, 0, OPT_STOP_IDS},
    {"ignore-eos", no_argument, 0, OPT_IGNORE_EOS},
    {"block-size", required_argument, 0, OPT_BLOCK_SIZE},
    {"kv-cache-mb", required_argument, 0, OPT_KV_MB},
    {"gpu-memory-utilization", required_argument, 0, OPT_GPU_UTIL},
    {"max-num-batched-tokens", required_argument, 0, OPT_MAX_BT},
    {"max-num-seqs", required_argument, 0, OPT_MAX_SEQS},
    {"enforce-eager", no_argument, 0, OPT_EAGER},
    {"json", no_argument, 0, OPT_JSON},
    {"quiet", no_argument, 0, OPT_QUIET},
    {"help", no_argument, 0, 'h'},
    {0, 0, 0, 0},
};

typedef struct {
    const char *quant;       /* --quantization (NULL: auto) */
    const char *model_dir, *backend;
    pd_load_format fmt;
    int32_t threads;
    int32_t n_tp;                    /* --tensor-parallel */
    int32_t *prompts[MAX_PROMPTS];
    int32_t prompt_lens[MAX_PROMPTS];
    int32_t n_prompts;
    int32_t repeat;
    int32_t max_tokens, min_tokens;
    smp_params sp;
    int32_t *stop_ids;
    int32_t n_stop;
    bool ignore_eos, json, quiet;
    mr_params mp;
    long long kv_mb;
    long long random_lens[MAX_PROMPTS];
    int32_t n_random;
    const char *texts[MAX_PROMPTS];  /* --prompt TEXT, tokenized after loading */
    int32_t n_text;
    tok_tokenizer *tok;              /* NULL when the model has no tokenizer.json */
} cli;

static int parse_args(int argc, char **argv, cli *a)
{
    long long v;
    float f;
    int c;
    while ((c = getopt_long(argc, argv, "h", k_opts, NULL)) != -1) {
        const char *flag = k_opts[0].name;
        for (const struct option *o = k_opts; o->name; o++)
            if (o->val == c) flag = o->name;
        char fl[64];
        snprintf(fl, sizeof fl, "--%s", flag);
        switch (c) {
        case 'h': usage(stdout); exit(0);
        case OPT_MODEL: a->model_dir = optarg; break;
        case OPT_LOAD_FORMAT:
            if (strcmp(optarg, "dummy") == 0) a->fmt = PD_LOAD_DUMMY;
            else if (strcmp(optarg, "safetensors") == 0 || strcmp(optarg, "auto") == 0) a->fmt = PD_LOAD_SAFETENSORS;
            else {
                fprintf(stderr, "pdserve-generate: unknown --load-format '%s' (safetensors, dummy)\n", optarg);
                return -1;
            }
            break;
        case OPT_BACKEND: a->backend = optarg; break;
        case OPT_QUANT: a->quant = optarg; break;
        case OPT_KV_DTYPE:
            if (mr_kv_dtype_parse(optarg, &a->mp.kv_dtype) < 0) {
                fprintf(stderr, "pdserve-generate: unknown --kv-cache-dtype '%s' (auto, bf16, fp8)\n",
                        optarg);
                return -1;
            }
            break;
        case OPT_THREADS: if (parse_i64(fl, optarg, 0, 1024, &v)) return -1; a->threads = (int32_t)v; break;
        case OPT_TP: if (parse_i64(fl, optarg, 1, 64, &v)) return -1; a->n_tp = (int32_t)v; break;
        case OPT_PROMPT_IDS: {
            if (a->n_prompts + a->n_random >= MAX_PROMPTS) { fprintf(stderr, "pdserve-generate: too many prompts\n"); return -1; }
            int n = parse_ids(fl, optarg, &a->prompts[a->n_prompts]);
            if (n < 0) return -1;
            a->prompt_lens[a->n_prompts++] = n;
            break;
        }
        case OPT_PROMPT:
            if (a->n_prompts + a->n_random + a->n_text >= MAX_PROMPTS) { fprintf(stderr, "pdserve-generate: too many prompts\n"); return -1; }
            a->texts[a->n_text++] = optarg;
            break;
        case OPT_RANDOM_LEN:
            if (parse_i64(fl, optarg, 1, 1 << 20, &v)) return -1;
            if (a->n_prompts + a->n_random >= MAX_PROMPTS) { fprintf(stderr, "pdserve-generate: too many prompts\n"); return -1; }
            a->random_lens[a->n_random++] = v;
            break;
        case OPT_REPEAT: if (parse_i64(fl, optarg, 1, MAX_PROMPTS, &v)) return -1; a->repeat = (int32_t)v; break;
        case OPT_MAX_TOKENS: if (parse_i64(fl, optarg, 1, INT32_MAX, &v)) return -1; a->max_tokens = (int32_t)v; break;
        case OPT_MIN_TOKENS: if (parse_i64(fl, optarg, 0, INT32_MAX, &v)) return -1; a->min_tokens = (int32_t)v; break;
        case OPT_TEMP: if (parse_f(fl, optarg, &f)) return -1; a->sp.temperature = f; break;
        case OPT_TOP_P: if (parse_f(fl, optarg, &f)) return -1; a->sp.top_p = f; break;
        case OPT_TOP_K: if (parse_i64(fl, optarg, -1, INT32_MAX, &v)) return -1; a->sp.top_k = (int32_t)v; break;
        case OPT_MIN_P: if (parse_f(fl, optarg, &f)) return -1; a->sp.min_p = f; break;
        case OPT_REP_PEN: if (parse_f(fl, optarg, &f)) return -1; a->sp.repetition_penalty = f; break;
        case OPT_PRES_PEN: if (parse_f(fl, optarg, &f)) return -1; a->sp.presence_penalty = f; break;
        case OPT_FREQ_PEN: if (parse_f(fl, optarg, &f)) return -1; a->sp.frequency_penalty = f; break;
        case OPT_SEED:
            if (parse_i64(fl, optarg, 0, LLONG_MAX, &v)) return -1;
            a->sp.seed = (uint64_t)v;
            a->sp.has_seed = true;
            break;
        case OPT_STOP_IDS:
            free(a->stop_ids);
            a->stop_ids = NULL;
            if ((a->n_stop = parse_ids(fl, optarg, &a->stop_ids)) < 0) return -1;
            break;
        case OPT_IGNORE_EOS: a->ignore_eos = true; break;
        case OPT_BLOCK_SIZE: if (parse_i64(fl, optarg, 1, 1024, &v)) return -1; a->mp.block_size = (int32_t)v; break;
        case OPT_KV_MB: if (parse_i64(fl, optarg, 1, 1 << 24, &v)) return -1; a->kv_mb = v; break;
        case OPT_GPU_UTIL: {
            float u;
            if (parse_f(fl, optarg, &u)) return -1;
            if (!(u > 0 && u <= 1)) {
                fprintf(stderr, "pdserve-generate: %s must be in (0, 1]\n", fl);
                return -1;
            }
            a->mp.gpu_memory_utilization = u;
            break;
        }
        case OPT_MAX_BT: if (parse_i64(fl, optarg, 1, 1 << 20, &v)) return -1; a->mp.max_num_batched_tokens = (int32_t)v; break;
        case OPT_MAX_SEQS: if (parse_i64(fl, optarg, 1, 1 << 16, &v)) return -1; a->mp.max_num_seqs = (int32_t)v; break;
        case OPT_JSON: a->json = true; break;
        case OPT_QUIET: a->quiet = true; break;
        case OPT_EAGER: a->mp.max_graph_batch = 0; break;
        default:
            fprintf(stderr, "Try 'pdserve-generate --help'.\n");
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "pdserve-generate: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (!a->model_dir) {
        fprintf(stderr, "pdserve-generate: --model DIR is required (try --help)\n");
        return -1;
    }
    if (a->n_prompts + a->n_random + a->n_text == 0) {
        fprintf(stderr, "pdserve-generate: give a prompt with --prompt or --prompt-ids (try --help)\n");
        return -1;
    }
    return 0;
}

/* Prints s as a JSON string. */
static void json_string(const char *s, size_t n)
{
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') printf("\\%c", ch);
        else if (ch == '\n') printf("\\n");
        else if (ch == '\t') printf("\\t");
        else if (ch == '\r') printf("\\r");
        else if (ch < 0x20) printf("\\u%04x", ch);
        else putchar(ch);
    }
    putchar('"');
}

static void print_result(const cli *a, int32_t idx, const gen_result *r)
{
    char *text = NULL, err[PD_ERR_LEN];
    size_t len = 0;
    if (a->tok && tok_decode(a->tok, r->tokens, r->n_tokens, true, &text, &len, err) < 0) {
        fprintf(stderr, "pdserve-generate: cannot decode the output: %s\n", err);
        text = NULL;
    }
    if (a->json) {
        printf("{\"index\": %d, \"token_ids\": [", idx);
        for (int32_t i = 0; i < r->n_tokens; i++) printf("%s%d", i ? ", " : "", r->tokens[i]);
        printf("], \"text\": ");
        if (text) json_string(text, len);
        else printf("null");
        printf(", \"finish_reason\": \"%s\"}\n", gen_finish_name(r->finish));
    } else if (text) {
        fwrite(text, 1, len, stdout);
        printf("\n");
    } else {
        for (int32_t i = 0; i < r->n_tokens; i++) printf("%s%d", i ? "," : "", r->tokens[i]);
        printf("\n");
    }
    free(text);
}

int main(int argc, char **argv)
{
    cli a;
    memset(&a, 0, sizeof a);
    a.backend = "auto";
    a.n_tp = 1;
    a.repeat = 1;
    a.max_tokens = 64;
    a.sp = smp_default_params();
    a.mp = mr_default_params();
    int status = 1;
    char err[PD_ERR_LEN] = "";
    tp_group *grp = NULL;
    pd_backend *be = NULL;           /* rank 0's */
    pd_model *m = NULL;              /* rank 0's shard */
    mr *r = NULL;
    gen_request *reqs = NULL;
    gen_result *res = NULL;
    int32_t n = 0;

    if (parse_args(argc, argv, &a) < 0) goto out;
    if (smp_validate(&a.sp, err) < 0) {
        fprintf(stderr, "pdserve-generate: %s\n", err);
        goto out;
    }
    mc_config cfg;
    if (mc_load(a.model_dir, &cfg, err) < 0 || mc_set_quantization(&cfg, a.quant, err) < 0) {
        fprintf(stderr, "pdserve-generate: %s\n", err);
        goto out;
    }
    /* The tokenizer, when the model has one: text prompts in, text out. */
    char tpath[4096];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", a.model_dir);
    FILE *tf = fopen(tpath, "r");
    if (tf) {
        fclose(tf);
        if (tok_load(a.model_dir, &a.tok, err) < 0) {
            fprintf(stderr, "pdserve-generate: %s\n", err);
            goto out;
        }
    } else if (a.n_text > 0) {
        fprintf(stderr, "pdserve-generate: --prompt needs %s; pass token ids with --prompt-ids\n", tpath);
        goto out;
    }
    for (int32_t i = 0; i < a.n_text; i++) {
        int32_t *ids = NULL, nid = 0;
        if (tok_encode(a.tok, a.texts[i], strlen(a.texts[i]), true, &ids, &nid, err) < 0) {
            fprintf(stderr, "pdserve-generate: --prompt: %s\n", err);
            goto out;
        }
        if (nid == 0) {
            free(ids);
            fprintf(stderr, "pdserve-generate: --prompt '%s' encodes to no tokens\n", a.texts[i]);
            goto out;
        }
        a.prompts[a.n_prompts] = ids;
        a.prompt_lens[a.n_prompts++] = nid;
    }
    /* Random prompts (benchmarks) are drawn now that the vocabulary is known. */
    uint64_t rs = 0x9e3779b97f4a7c15ull;
    for (int32_t i = 0; i < a.n_random; i++) {
        int32_t len = (int32_t)a.random_lens[i];
        int32_t *p = malloc((size_t)len * sizeof *p);
        if (!p) goto out;
        for (int32_t j = 0; j < len; j++) {
            rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
            p[j] = (int32_t)(rs % (uint64_t)cfg.vocab_size);
        }
        a.prompts[a.n_prompts] = p;
        a.prompt_lens[a.n_prompts++] = len;
    }
    n = a.n_prompts * a.repeat;
    reqs = calloc((size_t)n, sizeof *reqs);
    res = calloc((size_t)n, sizeof *res);
    if (!reqs || !res) goto out;
    int64_t kv_tokens = 0;
    for (int32_t i = 0; i < n; i++) {
        gen_request *q = &reqs[i];
        q->prompt = a.prompts[i % a.n_prompts];
        q->n_prompt = a.prompt_lens[i % a.n_prompts];
        q->sampling = a.sp;
        if (a.sp.has_seed) q->sampling.seed = a.sp.seed + (uint64_t)i;
        q->max_tokens = a.max_tokens;
        q->min_tokens = a.min_tokens;
        q->stop_ids = a.stop_ids;
        q->n_stop_ids = a.n_stop;
        q->ignore_eos = a.ignore_eos;
        int64_t need = (int64_t)q->n_prompt + q->max_tokens;
        if (need > cfg.max_position) need = cfg.max_position;
        kv_tokens += (need + a.mp.block_size - 1) / a.mp.block_size * a.mp.block_size;
    }
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = a.threads;
    /* One backend and one weight shard a rank (--tensor-parallel; the whole model on one).
     * The backends come first: their kind decides how the KV pool is sized. */
    tp_group_params gp = {.backend = a.backend, .bp = bp, .n_ranks = a.n_tp, .cfg = &cfg,
                          .dir = a.model_dir, .fmt = a.fmt, .seed = 1234};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (tp_group_load(&gp, &grp, err) < 0) {
        fprintf(stderr, "pdserve-generate: %s\n", err);
        goto out;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    be = grp->be[0];
    m = grp->models[0];
    /* KV pool: --kv-cache-mb; else on a backend that reports device memory, the runner sizes
     * it from --gpu-memory-utilization once the weights and its workspace are allocated; else
     * what the batch needs. */
    if (a.kv_mb > 0) a.mp.kv_cache_bytes = a.kv_mb << 20;
    else if (be->ops->mem_info) a.mp.kv_cache_bytes = 0;
    else a.mp.n_blocks = (int32_t)(kv_tokens / a.mp.block_size);
    if (!a.quiet)
        fprintf(stderr, "pdserve-generate: %s (%s, %.1fM params%s, %d layers) loaded on %s%s in "
                "%.2f s\n", a.model_dir, cfg.arch_name, (double)m->n_params / 1e6,
                a.n_tp > 1 ? " on rank 0" : "", cfg.n_layers, be->ops->name,
                a.n_tp > 1 ? " (tensor parallel)" : "",
                (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9);
    if (mr_create_tp(&a.mp, (const pd_model *const *)grp->models, grp->n_ranks, grp->comm, &r,
                     err) < 0) {
        fprintf(stderr, "pdserve-generate: %s\n", err);
        goto out;
    }
    if (!a.quiet) {
        void *kv_base;
        size_t kv_bytes;
        mr_kv_pool(r, &kv_base, &kv_bytes);
        fprintf(stderr, "pdserve-generate: KV cache %d blocks of %d tokens (%.1f MiB%s)\n",
                mr_n_blocks(r), mr_block_size(r), (double)kv_bytes / 1048576.0,
                a.kv_mb > 0 ? "" : be->ops->mem_info ? ", from --gpu-memory-utilization"
                                                     : ", what the batch needs");
    }
    gen_stats st;
    if (gen_run(r, m, reqs, n, res, &st, err) < 0) {
        fprintf(stderr, "pdserve-generate: %s\n", err);
        goto out;
    }
    for (int32_t i = 0; i < n; i++) print_result(&a, i, &res[i]);
    if (!a.quiet) {
        const eng_stats *es = &st.eng;
        fprintf(stderr, "pdserve-generate: %d prompts, %lld prompt + %lld new tokens in %.3f s: "
                "%.1f new tok/s; prefill %.1f tok/s, decode %.1f tok/s (%lld steps, %lld decode "
                "steps as graphs)\n", n,
                (long long)st.prompt_tokens, (long long)st.generated_tokens, st.elapsed_s,
                st.elapsed_s > 0 ? st.generated_tokens / st.elapsed_s : 0.0,
                es->prefill_model_s > 0 ? es->prompt_tokens_computed / es->prefill_model_s : 0.0,
                es->decode_model_s > 0 ? es->decode_tokens / es->decode_model_s : 0.0,
                (long long)es->steps, (long long)mr_graph_steps(r));
    }
    status = 0;
out:
    if (res) gen_results_free(res, n);
    free(res);
    free(reqs);
    mr_destroy(r);
    tp_group_destroy(grp); /* m and be with it */
    for (int32_t i = 0; i < a.n_prompts; i++) free(a.prompts[i]);
    free(a.stop_ids);
    tok_destroy(a.tok);
    return status;
}
