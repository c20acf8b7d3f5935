/* env.c -- The table of environment knobs and their accessors: each knob read once, on
 * first use, validated, cached (common/env.h). The only place that reads PDSERVE_* knobs
 * from the environment (ctest test_env checks that). */
#include "common/env.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/error.h"
#include "common/log.h"

#define I64_MIN INT64_MIN
#define I64_MAX INT64_MAX

/* Sorted by component, then name. Defaults are text, parsed like a value (a unit test reads
 * every knob unset); ranges only where a value outside them is refused, not clamped (the
 * readers that clamp say so in the description). No '|' in the descriptions (Markdown). */
static const pd_env_knob k_knobs[] = {
    {"PDSERVE_LOG_LEVEL", PD_ENV_STRING, "info", 0, 0, "error|warn|info|debug",
     "common (every program)",
     "The least severe log lines written (error, warn, info or debug); pd_log_set_level() "
     "overrides it."},

    {"PDSERVE_ASYNC_STEPS", PD_ENV_BOOL, "1", 0, 0, NULL, "engine",
     "Pipelined engine steps (the next step queued before this one's tokens are read, "
     "docs/engine.md): the default of eng_params.async_steps; 0 runs steps one after another."},
    {"PDSERVE_FAULT_TP_RANK", PD_ENV_STRING, "", 0, 0, NULL, "engine",
     "Fault injection (testing): RANK:FORWARD makes that tensor-parallel rank fail the "
     "group's FORWARDth forward at the gate; RANK:FORWARD:after half-way through its layers "
     "(docs/tensor-parallel.md)."},
    {"PDSERVE_TP_DEBUG_OP_TIMING", PD_ENV_BOOL, "0", 0, 0, NULL, "engine",
     "Tensor parallelism, diagnosis: each rank times its ops, eager and synchronised (only "
     "without CUDA graphs, --enforce-eager)."},
    {"PDSERVE_TP_DEBUG_SKIP_ALLREDUCE", PD_ENV_BOOL, "0", 0, 0, NULL, "engine",
     "Tensor parallelism, diagnosis: the ranks skip their all-reduces (the results are wrong; "
     "for timing only)."},

    {"PDSERVE_FAULT_FAIL_STEPS_AFTER", PD_ENV_INT, "-1", -1, I64_MAX, NULL, "svc",
     "Fault injection (testing): every forward after the first N fails as a device failure "
     "would (-1: off)."},
    {"PDSERVE_FAULT_STEP_DELAY_MS", PD_ENV_INT, "0", 0, I64_MAX, NULL, "svc",
     "Fault injection (testing): every forward takes this many milliseconds longer."},
    {"PDSERVE_KV_STAGING", PD_ENV_BOOL, "0", 0, 0, NULL, "svc",
     "The staged KV path (a ring of host slots, the backend's copy queue) on the CPU backend "
     "too (tests; the GPU backends always stage or go device to device)."},
    {"PDSERVE_KV_UCX_CUDA", PD_ENV_BOOL, "1", 0, 0, NULL, "svc",
     "Where UCX moves CUDA memory, register the device KV cache as the pool; 0 keeps the "
     "staging ring (docs/kvtransfer.md)."},

    {"PDSERVE_CUDA_DECODE_BLOCKS_PER_SM", PD_ENV_INT, "0", 0, 64, NULL, "kernels/cuda",
     "Decode attention's split target in blocks per SM, for A/B runs (0: auto)."},
    {"PDSERVE_CUDA_DECODE_MMA", PD_ENV_INT, "2", 0, 4, NULL, "kernels/cuda",
     "Pipeline stages of the tensor-core decode attention kernel (0 .. 4), for A/B runs."},
    {"PDSERVE_CUDA_DECODE_STAGES", PD_ENV_INT, "2", 0, 4, NULL, "kernels/cuda",
     "Pipeline stages of the decode attention kernel (0 .. 4), for A/B runs."},
    {"PDSERVE_CUDA_DL_DEBUG", PD_ENV_INT, "0", I64_MIN, I64_MAX, NULL, "kernels/cuda",
     "decode_layers debug bits (values <= 0: none): 1 the products' arithmetic off, 2 the "
     "FP8 layers' input quantization off, 8 the weight stream off (1, 2, 8: wrong results, "
     "timing only), 16 stage timing (-DPD_DL_TIMING=1 builds), 32 no evict-first L2 policy on "
     "the weight stream, 128 no L2 prefetch of the small vectors."},
    {"PDSERVE_CUDA_DL_INFLIGHT", PD_ENV_INT, "-1", I64_MIN, I64_MAX, NULL, "kernels/cuda",
     "decode_layers' weight-stream slots a block may have in flight (unset: chosen per shape; "
     "values <= 0: none held back)."},
    {"PDSERVE_CUDA_DL_PICK", PD_ENV_BOOL, "1", 0, 0, NULL, "kernels/cuda",
     "decode_layers makes the greedy picks with the head; 0: the sample op samples as without "
     "them."},
    {"PDSERVE_CUDA_FLASH_PREFILL", PD_ENV_BOOL, "1", 0, 0, NULL, "kernels/cuda",
     "The tensor-core prefill attention kernel; 0: the general kernel, for A/B runs."},
    {"PDSERVE_CUDA_FLASH_ROWS", PD_ENV_INT, "0", 0, 128, NULL, "kernels/cuda",
     "The tensor-core prefill attention's tile height for A/B runs: 64 or 128 rows always; "
     "0 (or another value): chosen per batch."},
    {"PDSERVE_CUDA_FLASH_WGMMA", PD_ENV_BOOL, "1", 0, 0, NULL, "kernels/cuda",
     "The tensor-core prefill attention's products on wgmma (compute capability 9.0, an sm_90a "
     "build); 0: on mma.sync, for A/B runs."},
    {"PDSERVE_CUDA_FP8_FAST_ACCUM_MAX_K", PD_ENV_INT, "4096", 0, INT32_MAX, NULL,
     "kernels/cuda",
     "cuBLASLt's FP8 fast accumulation (no periodic promotion to f32, as vLLM's Hopper FP8 "
     "GEMMs) for per-channel x per-token products of k up to this (0: never). Longer k "
     "promotes: at k 8192 and 14336 fast accumulation broke test_cuda_fp8's error bound."},
    {"PDSERVE_CUDA_FP8_FUSED_QUANT", PD_ENV_BOOL, "1", 0, 0, NULL, "kernels/cuda",
     "The FP8 products' activation quantization fused into the RMSNorm and SwiGLU kernels "
     "that make their input rows (prefill sizes; the same bits); 0: separate kernels, for A/B "
     "runs."},
    {"PDSERVE_CUDA_FP8_GEMV_MAX_N", PD_ENV_INT, "8", I64_MIN, I64_MAX, NULL, "kernels/cuda",
     "The FP8 products' crossover in n to the large-n paths (clamped to 0 .. 8; 0: never the "
     "small-n kernel)."},
    {"PDSERVE_CUDA_FP8_MOE_GEMM_ROWS", PD_ENV_INT, "1", 0, I64_MAX, NULL, "kernels/cuda",
     "FP8 experts' products (quantized input rows) run as grouped e4m3 wgmma GEMMs (compute "
     "capability 9.0, an sm_90a build) when a layer's choices average at least this many "
     "token rows an expert, else on the row-streaming kernel that reads each chosen expert's "
     "weights once for up to 8 of its rows; 0: the row-streaming kernel always, for A/B runs."},
    {"PDSERVE_CUDA_FUSED_DECODE", PD_ENV_INT, "-1", I64_MIN, I64_MAX, NULL, "kernels/cuda",
     "The most sequences a decode step runs as one decode_layers kernel (clamped to 0 .. 8; "
     "values <= 0: off; unset: 1 with bf16 weights, 2 with FP8 weights)."},
    {"PDSERVE_CUDA_GEMV_FUSED_MAX_MB", PD_ENV_INT, "16", 0, 1024, NULL, "kernels/cuda",
     "The largest product (MiB of bf16 weights) that the streaming kernel takes with its input "
     "norm or SwiGLU fused at n <= 8; larger ones run the norm and cuBLAS (0: none past the "
     "kernel's own size rule)."},
    {"PDSERVE_CUDA_GEMV_MAX_MB", PD_ENV_INT, "8", 0, 1024, NULL, "kernels/cuda",
     "The largest product (MiB of bf16 weights, m <= 2048) that the streaming kernel takes "
     "without a fusion; larger ones run on cuBLAS."},
    {"PDSERVE_CUDA_GEMV_MAX_N", PD_ENV_INT, "32", I64_MIN, I64_MAX, NULL, "kernels/cuda",
     "The bf16 products' crossover in n from the streaming kernel to cuBLAS (clamped to "
     "0 .. 32; 0: always cuBLAS)."},
    {"PDSERVE_CUDA_MOE_GEMM_BM", PD_ENV_INT, "0", 0, 128, NULL, "kernels/cuda",
     "The mixture-of-experts grouped GEMMs' tile height for A/B runs: 64 or 128 token rows "
     "always; 0 (or another value): 128 when a layer's choices average 64 rows an expert or "
     "more, else 64."},
    {"PDSERVE_CUDA_MOE_GEMM_ROWS", PD_ENV_INT, "1", 0, I64_MAX, NULL, "kernels/cuda",
     "The mixture-of-experts experts' products run as grouped wgmma GEMMs (compute capability "
     "9.0, an sm_90a build) when a layer's choices average at least this many token rows an "
     "expert (n k / n_experts), else on the row-streaming kernel that reads each chosen "
     "expert's weights once (decode); 0: the row-streaming kernel always, for A/B runs."},
    {"PDSERVE_CUDA_OVERLAP_UPLOAD", PD_ENV_BOOL, "1", 0, 0, NULL, "kernels/cuda",
     "A pipelined step's metadata uploaded on a side stream beside the step before; 0: in "
     "order, for A/B runs."},
    {"PDSERVE_CUDA_PDL", PD_ENV_BOOL, "1", 0, 0, NULL, "kernels/cuda",
     "Programmatic dependent launch for small grids (sm_90; 0: every kernel launched plainly)."},
    {"PDSERVE_CUDA_ROPE_VEC", PD_ENV_BOOL, "1", 0, 0, NULL, "kernels/cuda",
     "rope_store_kv's block-a-token kernel (angles once a token, 16-byte accesses) for head "
     "sizes 64, 128 and 256; 0: the warp-a-head kernel, for A/B runs."},
    {"PDSERVE_CUDA_SAMPLE_CLUSTER", PD_ENV_INT, "0", I64_MIN, I64_MAX, NULL, "kernels/cuda",
     "Caps the sample kernel's blocks per row (a cluster) at 1, 2, 4 or 8, for A/B runs (the "
     "same results; values < 1: no cap)."},
    {"PDSERVE_CUDA_SPLIT_KV", PD_ENV_BOOL, "1", 0, 0, NULL, "kernels/cuda",
     "Split-KV decode attention; 0 forces the unsplit fallback, for A/B runs."},
    {"PDSERVE_CUDA_STEP_TIMING", PD_ENV_BOOL, "0", 0, 0, NULL, "kernels/cuda",
     "Where a decode step's time goes: events at its stages, printed to stderr."},
    {"PDSERVE_CUDA_TP_FUSED", PD_ENV_BOOL, "1", 0, 0, NULL, "kernels/cuda",
     "A tensor-parallel instance's small decode steps as one kernel a GPU; 0: op by op "
     "(read when a communicator is made)."},
    {"PDSERVE_KV_COPY", PD_ENV_STRING, "kernel", 0, 0, "kernel|memcpy", "kernels/cuda",
     "How a copy queue moves KV block runs: one kernel, or memcpy (one cudaMemcpyAsync per "
     "run)."},
    {"PDSERVE_NCCL_LIB", PD_ENV_STRING, "libnccl.so.2", 0, 0, NULL, "kernels/cuda",
     "The NCCL library loaded (dlopen) for tensor parallelism across GPUs."},

    {"PDSERVE_SHARED", PD_ENV_STRING, "", 0, 0, NULL, "tests",
     "The shared test data folder (unset: ../shared beside the repository)."},
};
#define N_KNOBS ((int)(sizeof k_knobs / sizeof k_knobs[0]))

typedef struct {
    char *raw;        /* the variable as read, NULL when unset or empty */
    bool b;
    int64_t i;
    double d;
    const char *s; /* raw or the table's default */
} env_val;

static env_val g_val[N_KNOBS];
static atomic_int g_ready[N_KNOBS]; /* 1 once g_val[k] holds knob k's value */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

int pd_env_count(void) { return N_KNOBS; }

const pd_env_knob *pd_env_knob_at(int i)
{
    PD_ASSERT(i >= 0 && i < N_KNOBS, "pd_env_knob_at: index out of range");
    return &k_knobs[i];
}

const char *pd_env_type_name(pd_env_type t)
{
    switch (t) {
    case PD_ENV_BOOL: return "bool";
    case PD_ENV_INT: return "int";
    case PD_ENV_DOUBLE: return "double";
    case PD_ENV_STRING: return "string";
    }
    return "?";
}

static int find(const char *name)
{
    for (int k = 0; k < N_KNOBS; k++)
        if (!strcmp(k_knobs[k].name, name)) return k;
    PD_LOGE("environment knob %s is not in common/env.c's table", name ? name : "(null)");
    PD_ASSERT(0, "unknown environment knob (add it to common/env.c's table)");
    return -1;
}

static int parse_bool(const char *s, bool *out)
{
    static const char *on[] = {"1", "true", "yes", "on"}, *off[] = {"0", "false", "no", "off"};
    for (int j = 0; j < 4; j++) {
        if (!strcasecmp(s, on[j])) return *out = true, 0;
        if (!strcasecmp(s, off[j])) return *out = false, 0;
    }
    return -1;
}

static int parse_int(const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = (int64_t)v;
    return 0;
}

static int parse_double(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

/* Whether s is one of choices ("a|b|c"; NULL: anything is). */
static bool is_choice(const char *s, const char *choices)
{
    if (!choices) return true;
    const size_t n = strlen(s);
    for (const char *c = choices; *c;) {
        const char *bar = strchr(c, '|');
        const size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && !strncmp(c, s, n)) return true;
        if (!bar) break;
        c = bar + 1;
    }
    return false;
}

/* Parses s as knob k's type into v; returns 0 or -1. */
static int parse(const pd_env_knob *k, const char *s, env_val *v)
{
    switch (k->type) {
    case PD_ENV_BOOL: return parse_bool(s, &v->b);
    case PD_ENV_INT: return parse_int(s, k->min, k->max, &v->i);
    case PD_ENV_DOUBLE: return parse_double(s, &v->d);
    case PD_ENV_STRING:
        if (!is_choice(s, k->choices)) return -1;
        v->s = s;
        return 0;
    }
    return -1;
}

/* What knob k accepts, in words, into buf: "bool", "int (0 .. 4)", "one of: a, b". */
static void describe(const pd_env_knob *k, char *buf, size_t len)
{
    if (k->type == PD_ENV_INT && k->min > I64_MIN && k->max < I64_MAX)
        snprintf(buf, len, "int (%lld .. %lld)", (long long)k->min, (long long)k->max);
    else if (k->type == PD_ENV_INT && k->min > I64_MIN)
        snprintf(buf, len, "int (>= %lld)", (long long)k->min);
    else if (k->type == PD_ENV_INT && k->max < I64_MAX)
        snprintf(buf, len, "int (<= %lld)", (long long)k->max);
    else if (k->type == PD_ENV_STRING && k->choices) {
        size_t j = (size_t)snprintf(buf, len, "one of: ");
        for (const char *c = k->choices; *c && j + 3 < len; c++) {
            if (*c == '|') buf[j++] = ',', buf[j++] = ' ';
            else buf[j++] = *c;
        }
        buf[j] = 0;
    } else {
        snprintf(buf, len, "%s", pd_env_type_name(k->type));
    }
}

/* Reads knob k into v (under g_mu); a bad value leaves a warning in warn. */
static void load(int k, env_val *v, char *warn, size_t warn_len)
{
    const pd_env_knob *kn = &k_knobs[k];
    const char *e = getenv(kn->name);
    free(v->raw);
    v->raw = e && *e ? strdup(e) : NULL;
    PD_ASSERT(parse(kn, kn->def, v) == 0, "an environment knob's default does not parse");
    if (!v->raw || parse(kn, v->raw, v) == 0) return;
    char want[128];
    describe(kn, want, sizeof want);
    snprintf(warn, warn_len, "%s=%s ignored (want %s%s); using the default%s%s", kn->name,
             v->raw, want, kn->type == PD_ENV_BOOL ? ": 1/0, true/false, yes/no or on/off" : "",
             *kn->def ? " " : "", kn->def);
}

/* The knob's value, read on first use. The warning goes out after g_mu is released: the
 * logger reads PDSERVE_LOG_LEVEL through here, and finds it cached by then. */
static const env_val *get(const char *name, pd_env_type want, bool any_type)
{
    const int k = find(name);
    PD_ASSERT(any_type || k_knobs[k].type == want,
              "environment knob read as another type than its table entry's");
    env_val *v = &g_val[k];
    if (atomic_load_explicit(&g_ready[k], memory_order_acquire)) return v;
    char warn[512] = "";
    pthread_mutex_lock(&g_mu);
    if (!atomic_load_explicit(&g_ready[k], memory_order_relaxed)) {
        load(k, v, warn, sizeof warn);
        atomic_store_explicit(&g_ready[k], 1, memory_order_release);
    }
    pthread_mutex_unlock(&g_mu);
    if (*warn) PD_LOGW("%s", warn);
    return v;
}

bool pd_env_bool(const char *name) { return get(name, PD_ENV_BOOL, false)->b; }
int64_t pd_env_int(const char *name) { return get(name, PD_ENV_INT, false)->i; }
double pd_env_double(const char *name) { return get(name, PD_ENV_DOUBLE, false)->d; }
const char *pd_env_str(const char *name) { return get(name, PD_ENV_STRING, false)->s; }
const char *pd_env_raw(const char *name) { return get(name, PD_ENV_STRING, true)->raw; }

void pd_env_set(const char *name, const char *value)
{
    const int k = find(name);
    pthread_mutex_lock(&g_mu);
    if (value) setenv(name, value, 1);
    else unsetenv(name);
    atomic_store_explicit(&g_ready[k], 0, memory_order_release);
    pthread_mutex_unlock(&g_mu);
}

void pd_env_write_markdown(FILE *out)
{
    fprintf(out,
            "# Environment knobs\n\n"
            "<!-- Generated by `pdserve-env --markdown` from common/env.c's table; do not edit "
            "(ctest test_env_doc fails when this file is stale). -->\n\n"
            "Every `PDSERVE_*` variable the code reads directly: A/B switches, diagnosis aids "
            "and fault injection, most for the CUDA backend. Each is read once, on first use "
            "(common/env.h): an empty variable is the default, and a value that does not parse "
            "gets one warning in the log and the default. `build/bin/pdserve-env` lists the "
            "values a process would take from the current environment.\n\n"
            "Command-line flags are not listed here: each also takes its value from a "
            "`PDSERVE_<FLAG>` variable (`--max-num-seqs` from `PDSERVE_MAX_NUM_SEQS`), shown "
            "by the program's `--help`.\n\n"
            "Bool values: 1/0, true/false, yes/no, on/off.\n\n"
            "| Variable | Type | Default | Read by | What it does |\n"
            "|---|---|---|---|---|\n");
    for (int k = 0; k < N_KNOBS; k++) {
        const pd_env_knob *kn = &k_knobs[k];
        char type[96];
        describe(kn, type, sizeof type);
        fprintf(out, "| `%s` | %s | %s | %s | %s |\n", kn->name, type,
                *kn->def ? kn->def : "unset", kn->component, kn->desc);
    }
}
