/* quantize_main.c -- pdserve-quantize: turns a bf16/f16/f32 HuggingFace checkpoint into an
 * FP8 (e4m3fn) one that pdserve, vLLM and transformers load: per-channel compressed-tensors
 * (W8A8 with dynamic per-token activations, or weight-only W8A16), or 128 x 128 block-wise
 * ("fp8", the DeepSeek-V3 / Qwen3-FP8 layout). See docs/quantization.md. */
#include <dirent.h>
#include <errno.h>
#include <float.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "common/dtype.h"
#include "common/error.h"
#include "common/json_util.h"
#include "engine/safetensors.h"
#include "engine/safetensors_write.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian: scales are written as the host's floats"
#endif

#define PROG "pdserve-quantize"
/* Files being written carry this suffix until the whole checkpoint is complete. */
#define TMP_SUFFIX ".pdserve-tmp"
/* The compressed-tensors release whose config format the compressed-tensors schemes follow
 * (QuantizationConfig / QuantizationArgs); loaders read it as information only. */
#define CT_FORMAT_VERSION "0.10.2"
#define BLOCK 128
/* Models smaller than this are done too soon for progress lines to help. */
#define PROGRESS_MIN_BYTES ((uint64_t)256 << 20)

typedef enum { SCHEME_FP8_DYNAMIC, SCHEME_FP8_WEIGHT_ONLY, SCHEME_FP8_BLOCK } q_scheme;

static const char *const k_scheme_names[] = {"fp8-dynamic", "fp8-weight-only", "fp8-block"};

/* The projections of a decoder layer that are quantized (`<module>.weight`, 2-D). */
static const char *const k_targets[] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                        "gate_proj", "up_proj", "down_proj"};

typedef struct {
    const char *model;          /* input directory */
    const char *out;            /* output directory */
    q_scheme scheme;
    char **ignore;              /* module names left unquantized (owned strings) */
    int32_t n_ignore;
    bool *ignore_used;          /* n_ignore: the name matched a quantizable module */
    uint64_t shard_max;         /* bytes per shard; 0 = 5 GB */
    bool force;                 /* write into a non-empty --out */
    bool quiet;                 /* no progress lines */
} q_args;

/* What happens to one input tensor. */
typedef struct {
    const st_tensor *t;
    bool quantize;
} q_item;

typedef struct {
    uint64_t done, total;       /* input bytes processed / in all */
    int32_t tensors_done, n_tensors; /* tensors begun / in all */
    int last_pct;               /* last percent printed */
    double t0;
    bool quiet, tty;
} q_progress;

static void usage(FILE *f)
{
    fprintf(f,
        "usage: " PROG " --model DIR --out DIR --scheme SCHEME [--ignore NAME,...] [--force]\n"
        "\n"
        "Quantizes the linear layers of a bf16/f16/f32 HuggingFace checkpoint to FP8 (e4m3fn)\n"
        "and writes a checkpoint that pdserve, vLLM and transformers load. Quantized: every\n"
        "2-D model.layers.*.{q,k,v,o,gate,up,down}_proj.weight; embeddings, norms, biases\n"
        "and lm_head are copied unchanged, as are the tokenizer and other non-weight files.\n"
        "\n"
        "  --model DIR             input: config.json and model.safetensors (or shards with\n"
        "                          model.safetensors.index.json)\n"
        "  --out DIR               output directory (created; must be empty unless --force)\n"
        "  --scheme SCHEME         fp8-dynamic      compressed-tensors, weights per output\n"
        "                                           channel, activations per token at run\n"
        "                                           time (W8A8)\n"
        "                          fp8-weight-only  the same weights, activations left in\n"
        "                                           16 bits (W8A16)\n"
        "                          fp8-block        quant_method \"fp8\", 128 x 128 weight\n"
        "                                           blocks (weight_scale_inv), activations in\n"
        "                                           groups of 128 at run time\n"
        "  --ignore NAME,...       more modules to leave unquantized, by module name (e.g.\n"
        "                          model.layers.0.mlp.down_proj); repeatable\n"
        "  --force                 write into a non-empty --out (replacing its checkpoint)\n"
        "  --max-shard-size N      largest shard in bytes (suffix K, M, G: powers of 1000;\n"
        "                          default 5G); one model.safetensors when all fits\n"
        "  --quiet                 no progress lines on stderr (printed for models of\n"
        "                          256 MiB and more)\n"
        "  -h, --help              this help\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Parses a byte count with an optional K/M/G suffix (powers of 1000). Returns 0 or -1. */
static int parse_bytes(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *s == '-') return -1;
    uint64_t mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1000, end++;
    else if (*end == 'M' || *end == 'm') mul = 1000000, end++;
    else if (*end == 'G' || *end == 'g') mul = 1000000000, end++;
    if (*end == 'B' || *end == 'b') end++;
    if (*end || v == 0 || v > UINT64_MAX / mul) return -1;
    *out = (uint64_t)v * mul;
    return 0;
}

/* Appends the comma-separated names of list to a->ignore. Returns 0 or -1 (out of memory). */
static int add_ignore(q_args *a, const char *list)
{
    const char *p = list;
    while (*p) {
        size_t n = strcspn(p, ",");
        if (n > 0) {
            char **v = realloc(a->ignore, (size_t)(a->n_ignore + 1) * sizeof *v);
            if (!v) return -1;
            a->ignore = v;
            if (!(a->ignore[a->n_ignore] = strndup(p, n))) return -1;
            a->n_ignore++;
        }
        p += n + (p[n] == ',');
    }
    return 0;
}

static void free_args(q_args *a)
{
    for (int32_t i = 0; i < a->n_ignore; i++) free(a->ignore[i]);
    free(a->ignore);
    free(a->ignore_used);
}

enum { OPT_MODEL = 256, OPT_OUT, OPT_SCHEME, OPT_IGNORE, OPT_FORCE, OPT_SHARD, OPT_QUIET };

static const struct option k_opts[] = {
    {"model", required_argument, NULL, OPT_MODEL},
    {"out", required_argument, NULL, OPT_OUT},
    {"scheme", required_argument, NULL, OPT_SCHEME},
    {"ignore", required_argument, NULL, OPT_IGNORE},
    {"force", no_argument, NULL, OPT_FORCE},
    {"max-shard-size", required_argument, NULL, OPT_SHARD},
    {"quiet", no_argument, NULL, OPT_QUIET},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* Returns 0, 1 after --help, or -1 after printing what is wrong. */
static int parse_args(int argc, char **argv, q_args *a)
{
    int c;
    bool have_scheme = false;
    while ((c = getopt_long(argc, argv, "h", k_opts, NULL)) != -1) {
        switch (c) {
        case 'h': usage(stdout); return 1;
        case OPT_MODEL: a->model = optarg; break;
        case OPT_OUT: a->out = optarg; break;
        case OPT_SCHEME: {
            int k = -1;
            for (int i = 0; i < 3; i++)
                if (strcmp(optarg, k_scheme_names[i]) == 0) k = i;
            if (k < 0) {
                fprintf(stderr, PROG ": unknown --scheme '%s' (fp8-dynamic, fp8-weight-only, "
                        "fp8-block)\n", optarg);
                return -1;
            }
            a->scheme = (q_scheme)k;
            have_scheme = true;
            break;
        }
        case OPT_IGNORE:
            if (add_ignore(a, optarg)) {
                fprintf(stderr, PROG ": out of memory\n");
                return -1;
            }
            break;
        case OPT_FORCE: a->force = true; break;
        case OPT_SHARD:
            if (parse_bytes(optarg, &a->shard_max)) {
                fprintf(stderr, PROG ": invalid value for --max-shard-size: '%s' (bytes, "
                        "e.g. 5G or 500M)\n", optarg);
                return -1;
            }
            break;
        case OPT_QUIET: a->quiet = true; break;
        default: fprintf(stderr, "Try '" PROG " --help'.\n"); return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, PROG ": unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (!a->model) {
        fprintf(stderr, PROG ": --model DIR is required (try --help)\n");
        return -1;
    }
    if (!a->out) {
        fprintf(stderr, PROG ": --out DIR is required (try --help)\n");
        return -1;
    }
    if (!have_scheme) {
        fprintf(stderr, PROG ": --scheme is required: fp8-dynamic, fp8-weight-only or "
                "fp8-block (try --help)\n");
        return -1;
    }
    a->ignore_used = calloc((size_t)a->n_ignore + 1, sizeof *a->ignore_used);
    if (!a->ignore_used) {
        fprintf(stderr, PROG ": out of memory\n");
        return -1;
    }
    return 0;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

/* Whether name is `model.layers.<i>. ... .<target>.weight` for one of k_targets. */
static bool is_target_name(const char *name)
{
    if (strncmp(name, "model.layers.", 13) != 0 || !ends_with(name, ".weight")) return false;
    size_t n = strlen(name) - 7; /* without ".weight" */
    for (size_t i = 0; i < sizeof k_targets / sizeof k_targets[0]; i++) {
        size_t k = strlen(k_targets[i]);
        if (n > k && name[n - k - 1] == '.' && memcmp(name + n - k, k_targets[i], k) == 0)
            return true;
    }
    return false;
}

/* Index of the --ignore entry naming the module of `<module>.weight`, or -1. */
static int32_t ignore_index(const q_args *a, const char *name)
{
    size_t n = strlen(name) - 7;
    for (int32_t i = 0; i < a->n_ignore; i++)
        if (strlen(a->ignore[i]) == n && memcmp(a->ignore[i], name, n) == 0) return i;
    return -1;
}

/* Counts bytes of input processed and prints a progress line when the percentage moves on
 * (every 10% into a log, every percent on a terminal). */
static void progress(q_progress *p, uint64_t bytes)
{
    p->done += bytes;
    if (p->quiet) return;
    int pct = p->total ? (int)(p->done * 100 / p->total) : 100;
    if (pct == p->last_pct || (!p->tty && pct / 10 == p->last_pct / 10 && pct != 100)) return;
    p->last_pct = pct;
    fprintf(stderr, "%s" PROG ": tensor %d/%d, %.2f/%.2f GB (%d%%), %.0f s%s",
            p->tty ? "\r" : "", (int)p->tensors_done, (int)p->n_tensors, (double)p->done / 1e9,
            (double)p->total / 1e9, pct, now_s() - p->t0, p->tty && pct < 100 ? "" : "\n");
}

/* Converts n elements of t starting at element `first` to f32, refusing NaN and infinities
 * (a scale made from them would be meaningless). Returns 0 or -1 after printing. */
static int load_f32(const st_tensor *t, int64_t first, float *dst, size_t n)
{
    const uint8_t *src = (const uint8_t *)t->data + (size_t)first * pd_dtype_size(t->dtype);
    pd_convert_to_f32(dst, src, t->dtype, n);
    for (size_t i = 0; i < n; i++)
        if (!isfinite(dst[i])) {
            int64_t e = first + (int64_t)i;
            fprintf(stderr, PROG ": tensor %s in %s: element [%lld, %lld] is %s; cannot "
                    "quantize it\n", t->name, t->file, (long long)(e / t->shape[1]),
                    (long long)(e % t->shape[1]), isnan(dst[i]) ? "NaN" : "infinite");
            return -1;
        }
    return 0;
}

/* The scale of values whose largest magnitude is amax: amax / 448 (f32 division), so that
 * the largest becomes +-448 exactly. An all-zero row or block gets 1 (any scale gives back
 * zeros; 1 keeps it a normal number for kernels that take reciprocals); a scale that would
 * be subnormal (f32 inputs below 448 * FLT_MIN) is raised to FLT_MIN. */
static float fp8_scale(float amax)
{
    if (amax == 0.0f) return 1.0f;
    float s = amax / PD_FP8_MAX;
    return s < FLT_MIN ? FLT_MIN : s;
}

static void quantize_span(const float *x, uint8_t *q, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) q[i] = pd_f32_to_e4m3(x[i] / scale);
}

static int write_out(stw_ckpt *w, const void *data, size_t n)
{
    char err[PD_ERR_LEN];
    if (stw_ckpt_write(w, data, n, err) == 0) return 0;
    fprintf(stderr, PROG ": %s\n", err);
    return -1;
}

/* Per output channel: each row r gets scale[r] = amax(row) / 448; writes the e4m3 weight, then
 * the scales (F32 [out, 1]). */
static int quantize_channel(const st_tensor *t, stw_ckpt *w, q_progress *pr)
{
    const int64_t rows = t->shape[0], cols = t->shape[1];
    float *x = malloc((size_t)cols * sizeof *x), *scale = malloc((size_t)rows * sizeof *scale);
    uint8_t *q = malloc((size_t)cols);
    int rc = -1;
    if (!x || !scale || !q) {
        fprintf(stderr, PROG ": out of memory quantizing %s\n", t->name);
        goto done;
    }
    const size_t in_row = (size_t)cols * pd_dtype_size(t->dtype);
    for (int64_t r = 0; r < rows; r++) {
        if (load_f32(t, r * cols, x, (size_t)cols)) goto done;
        float amax = 0.0f;
        for (int64_t c = 0; c < cols; c++) amax = fmaxf(amax, fabsf(x[c]));
        scale[r] = fp8_scale(amax);
        quantize_span(x, q, (size_t)cols, scale[r]);
        if (write_out(w, q, (size_t)cols)) goto done;
        progress(pr, in_row);
    }
    rc = write_out(w, scale, (size_t)rows * sizeof *scale);
done:
    free(x);
    free(scale);
    free(q);
    return rc;
}

/* 128 x 128 blocks (partial at the right and bottom edges): each gets scale_inv =
 * amax(block) / 448; writes the e4m3 weight, a stripe of 128 rows at a time, then the scales
 * (F32 [ceil(out / 128), ceil(in / 128)], row-major). */
static int quantize_block(const st_tensor *t, stw_ckpt *w, q_progress *pr)
{
    const int64_t rows = t->shape[0], cols = t->shape[1];
    const int64_t nbr = (rows + BLOCK - 1) / BLOCK, nbc = (cols + BLOCK - 1) / BLOCK;
    float *x = malloc((size_t)BLOCK * (size_t)cols * sizeof *x);
    float *scale = malloc((size_t)(nbr * nbc) * sizeof *scale);
    uint8_t *q = malloc((size_t)BLOCK * (size_t)cols);
    int rc = -1;
    if (!x || !scale || !q) {
        fprintf(stderr, PROG ": out of memory quantizing %s\n", t->name);
        goto done;
    }
    for (int64_t br = 0; br < nbr; br++) {
        const int64_t r0 = br * BLOCK, nr = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        if (load_f32(t, r0 * cols, x, (size_t)(nr * cols))) goto done;
        for (int64_t bc = 0; bc < nbc; bc++) {
            const int64_t c0 = bc * BLOCK, nc = cols - c0 < BLOCK ? cols - c0 : BLOCK;
            float amax = 0.0f;
            for (int64_t r = 0; r < nr; r++)
                for (int64_t c = 0; c < nc; c++) amax = fmaxf(amax, fabsf(x[r * cols + c0 + c]));
            const float s = fp8_scale(amax);
            scale[br * nbc + bc] = s;
            for (int64_t r = 0; r < nr; r++)
                quantize_span(x + r * cols + c0, q + r * cols + c0, (size_t)nc, s);
        }
        if (write_out(w, q, (size_t)(nr * cols))) goto done;
        progress(pr, (size_t)(nr * cols) * pd_dtype_size(t->dtype));
    }
    rc = write_out(w, scale, (size_t)(nbr * nbc) * sizeof *scale);
done:
    free(x);
    free(scale);
    free(q);
    return rc;
}

/* Copies a tensor's bytes unchanged, in pieces so that progress moves on big embeddings. */
static int copy_tensor(const st_tensor *t, stw_ckpt *w, q_progress *pr)
{
    const size_t piece = (size_t)64 << 20;
    for (size_t off = 0; off < t->nbytes; off += piece) {
        size_t n = t->nbytes - off < piece ? t->nbytes - off : piece;
        if (write_out(w, (const uint8_t *)t->data + off, n)) return -1;
        progress(pr, n);
    }
    return 0;
}

/* Adds `name` to the JSON array list unless it is there. Returns 0 or -1. */
static int list_add_unique(json_t *list, const char *name)
{
    size_t i;
    json_t *v;
    json_array_foreach(list, i, v)
        if (strcmp(json_string_value(v), name) == 0) return 0;
    return json_array_append_new(list, json_string(name)) ? -1 : 0;
}

/* One compressed-tensors QuantizationArgs object for 8-bit floats. */
static json_t *ct_args(const char *strategy, bool dynamic)
{
    return json_pack("{s:i, s:s, s:b, s:n, s:s, s:n, s:b, s:n, s:o, s:{}}", "num_bits", 8,
                     "type", "float", "symmetric", 1, "group_size", "strategy", strategy,
                     "block_structure", "dynamic", dynamic, "actorder", "observer",
                     dynamic ? json_null() : json_string("minmax"), "observer_kwargs");
}

/* Builds the quantization_config for the scheme, with `ignore` (the modules left in their
 * dtype) as the scheme's format names them. Returns a new reference or NULL. */
static json_t *quant_config(q_scheme scheme, json_t *ignore)
{
    if (scheme == SCHEME_FP8_BLOCK)
        return json_pack("{s:s, s:s, s:s, s:[i,i], s:O}", "quant_method", "fp8", "fmt", "e4m3",
                         "activation_scheme", "dynamic", "weight_block_size", BLOCK, BLOCK,
                         "modules_to_not_convert", ignore);
    json_t *input = scheme == SCHEME_FP8_DYNAMIC ? ct_args("token", true) : json_null();
    json_t *weights = ct_args("channel", false);
    if (!input || !weights) {
        json_decref(input);
        json_decref(weights);
        return NULL;
    }
    return json_pack("{s:{s:{s:o, s:n, s:[s], s:o}}, s:s, s:n, s:O, s:n, s:s, s:s, s:s}",
                     "config_groups", "group_0", "input_activations", input,
                     "output_activations", "targets", "Linear", "weights", weights,
                     "format", "float-quantized", "global_compression_ratio", "ignore", ignore,
                     "kv_cache_scheme", "quant_method", "compressed-tensors",
                     "quantization_status", "compressed", "version", CT_FORMAT_VERSION);
}

/* Whether a file of the model directory is copied to the output as it is: everything but
 * the weights (rewritten), config.json (rewritten), hidden files and weights in other
 * formats. */
static bool copied_file(const char *name)
{
    static const char *const skip_ext[] = {".safetensors", ".bin", ".pt", ".pth", ".ckpt",
                                           ".h5", ".msgpack", ".gguf", ".onnx", TMP_SUFFIX};
    if (name[0] == '.' || strcmp(name, "config.json") == 0 ||
        strcmp(name, "model.safetensors.index.json") == 0)
        return false;
    for (size_t i = 0; i < sizeof skip_ext / sizeof skip_ext[0]; i++)
        if (ends_with(name, skip_ext[i])) return false;
    return true;
}

/* Copies src to dst. Returns 0 or -1 after printing. */
static int copy_file(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb"), *out = in ? fopen(dst, "wb") : NULL;
    char buf[1 << 16];
    size_t n;
    int rc = 0;
    if (!in || !out) {
        fprintf(stderr, PROG ": cannot %s %s: %s\n", in ? "create" : "read", in ? dst : src,
                strerror(errno));
        rc = -1;
    }
    while (rc == 0 && (n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) rc = -1;
    if (rc == 0 && ferror(in)) rc = -1;
    if (out && (fflush(out) != 0 || fsync(fileno(out)) != 0)) rc = -1;
    if (out && fclose(out) != 0) rc = -1;
    if (in) fclose(in);
    if (rc && in && out) fprintf(stderr, PROG ": cannot copy %s to %s: %s\n", src, dst,
                                 strerror(errno));
    return rc;
}

static char *path_join(const char *dir, const char *name, const char *suffix)
{
    size_t n = strlen(dir) + strlen(name) + strlen(suffix) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s%s", dir, name, suffix);
    return p;
}

/* The files written beside the weights: copies, then config.json (renamed last, so that an
 * output without it is visibly unfinished). */
typedef struct {
    char **names;               /* file names (owned) */
    int32_t n;
    bool *made;                 /* the temporary file exists */
} q_extra;

static void extra_free(q_extra *x, const char *out)
{
    for (int32_t i = 0; i < x->n; i++) {
        if (x->made[i]) {
            char *p = path_join(out, x->names[i], TMP_SUFFIX);
            if (p) unlink(p);
            free(p);
        }
        free(x->names[i]);
    }
    free(x->names);
    free(x->made);
}

static int extra_push(q_extra *x, const char *name)
{
    char **names = realloc(x->names, (size_t)(x->n + 1) * sizeof *names);
    if (names) x->names = names;
    bool *made = realloc(x->made, (size_t)(x->n + 1) * sizeof *made);
    if (made) x->made = made;
    if (!names || !made || !(x->names[x->n] = strdup(name))) return -1;
    x->made[x->n++] = false;
    return 0;
}

/* Copies the model directory's other files into out under temporary names. */
static int copy_extras(const q_args *a, q_extra *x)
{
    DIR *d = opendir(a->model);
    if (!d) {
        fprintf(stderr, PROG ": cannot list %s: %s\n", a->model, strerror(errno));
        return -1;
    }
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d))) {
        if (!copied_file(e->d_name)) continue;
        char *src = path_join(a->model, e->d_name, ""), *dst = path_join(a->out, e->d_name,
                                                                          TMP_SUFFIX);
        struct stat sb;
        if (!src || !dst || extra_push(x, e->d_name)) {
            fprintf(stderr, PROG ": out of memory\n");
            rc = -1;
        } else if (stat(src, &sb) != 0 || !S_ISREG(sb.st_mode)) {
            x->n--; /* a folder (or a dangling link): not part of the checkpoint's files */
            free(x->names[x->n]);
            if (!a->quiet) fprintf(stderr, PROG ": skipping %s (not a regular file)\n", src);
        } else {
            x->made[x->n - 1] = true;
            rc = copy_file(src, dst);
        }
        free(src);
        free(dst);
    }
    closedir(d);
    return rc;
}

/* Writes config.json (the input's, with quantization_config) under its temporary name. */
static int write_config(const q_args *a, json_t *config, json_t *qc, q_extra *x)
{
    if (json_object_set(config, "quantization_config", qc) || extra_push(x, "config.json")) {
        fprintf(stderr, PROG ": out of memory\n");
        return -1;
    }
    char *p = path_join(a->out, "config.json", TMP_SUFFIX);
    x->made[x->n - 1] = true;
    int rc = 0;
    FILE *f = p ? fopen(p, "w") : NULL;
    if (!f || json_dumpf(config, f, JSON_INDENT(2) | JSON_PRESERVE_ORDER) != 0 ||
        fputc('\n', f) == EOF || fflush(f) != 0 || fsync(fileno(f)) != 0) {
        fprintf(stderr, PROG ": cannot write %s: %s\n", p ? p : "config.json", strerror(errno));
        rc = -1;
    }
    if (f) fclose(f);
    free(p);
    return rc;
}

/* Creates dir and any missing folders above it (as mkdir -p). Returns 0 or -1 (errno). */
static int mkdir_parents(const char *dir)
{
    char *p = strdup(dir);
    if (!p) return -1;
    int rc = 0;
    for (char *s = p + 1; rc == 0 && *s; s++)
        if (*s == '/') {
            *s = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST) rc = -1;
            *s = '/';
        }
    if (rc == 0 && mkdir(p, 0755) != 0) rc = -1;
    int saved = errno;
    free(p);
    errno = saved;
    return rc;
}

/* Prepares --out: created when absent; an existing one must be an empty directory unless
 * --force, and never the input directory. *created tells whether it was made here. */
static int prepare_out(const q_args *a, bool *created)
{
    *created = false;
    struct stat sb;
    if (stat(a->out, &sb) != 0) {
        if (errno != ENOENT || mkdir_parents(a->out) != 0) {
            fprintf(stderr, PROG ": cannot create %s: %s\n", a->out, strerror(errno));
            return -1;
        }
        *created = true;
        return 0;
    }
    if (!S_ISDIR(sb.st_mode)) {
        fprintf(stderr, PROG ": --out %s exists and is not a directory\n", a->out);
        return -1;
    }
    char in_real[PATH_MAX], out_real[PATH_MAX];
    if (realpath(a->model, in_real) && realpath(a->out, out_real) &&
        strcmp(in_real, out_real) == 0) {
        fprintf(stderr, PROG ": --out %s is the input model directory\n", a->out);
        return -1;
    }
    DIR *d = opendir(a->out);
    if (!d) {
        fprintf(stderr, PROG ": cannot list %s: %s\n", a->out, strerror(errno));
        return -1;
    }
    bool empty = true;
    struct dirent *e;
    while (empty && (e = readdir(d)))
        empty = strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0;
    closedir(d);
    if (!empty && !a->force) {
        fprintf(stderr, PROG ": --out %s exists and is not empty (give --force to replace its "
                "checkpoint)\n", a->out);
        return -1;
    }
    return 0;
}

/* With --force, once the new files have their final names: removes the weight files of an
 * earlier checkpoint in out that the new one did not replace (shards of another count), so
 * that no stale shard stays beside the index, and the temporary files of an interrupted
 * run. */
static void remove_stale(const q_args *a, const stw_ckpt *w)
{
    DIR *d = opendir(a->out);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!ends_with(e->d_name, ".safetensors") && !ends_with(e->d_name, TMP_SUFFIX) &&
            strcmp(e->d_name, "model.safetensors.index.json") != 0)
            continue;
        bool ours = false;
        for (int32_t i = 0; w && i < stw_ckpt_n_files(w); i++)
            ours |= strcmp(stw_ckpt_file_name(w, i), e->d_name) == 0;
        if (ours) continue;
        char *p = path_join(a->out, e->d_name, "");
        if (p && unlink(p) == 0 && !a->quiet)
            fprintf(stderr, PROG ": removed the stale %s\n", p);
        free(p);
    }
    closedir(d);
}

/* Checks the input, declares the output tensors and the ignore list. Returns 0 or -1. */
static int plan(q_args *a, const st_model *m, q_item *items, stw_ckpt *w, json_t *ignore,
                int32_t *n_quant, bool *partial_blocks)
{
    char err[PD_ERR_LEN];
    const int32_t n = st_count(m);
    *n_quant = 0;
    *partial_blocks = false;
    for (int32_t i = 0; i < n; i++) {
        const st_tensor *t = st_get(m, i);
        items[i] = (q_item){.t = t, .quantize = false};
        if (t->dtype == PD_DTYPE_F8E4M3) {
            fprintf(stderr, PROG ": tensor %s in %s is already F8_E4M3: the input must be a "
                    "bf16, f16 or f32 checkpoint\n", t->name, t->file);
            return -1;
        }
        if (ends_with(t->name, ".weight_scale") || ends_with(t->name, ".weight_scale_inv") ||
            ends_with(t->name, ".input_scale")) {
            fprintf(stderr, PROG ": tensor %s in %s is a quantization scale: the input is "
                    "already quantized\n", t->name, t->file);
            return -1;
        }
        const bool target = is_target_name(t->name);
        if (target && t->n_dims != 2) {
            fprintf(stderr, PROG ": tensor %s in %s has %d dims; a linear weight has 2\n",
                    t->name, t->file, (int)t->n_dims);
            return -1;
        }
        const int32_t ig = target ? ignore_index(a, t->name) : -1;
        if (ig >= 0) a->ignore_used[ig] = true;
        items[i].quantize = target && ig < 0 && t->n_elems > 0;
        int rc;
        if (items[i].quantize) {
            (*n_quant)++;
            *partial_blocks |= t->shape[0] % BLOCK != 0 || t->shape[1] % BLOCK != 0;
            rc = stw_ckpt_add(w, t->name, PD_DTYPE_F8E4M3, 2, t->shape, err);
            char sname[1024];
            const bool block = a->scheme == SCHEME_FP8_BLOCK;
            snprintf(sname, sizeof sname, "%.*s.%s", (int)(strlen(t->name) - 7), t->name,
                     block ? "weight_scale_inv" : "weight_scale");
            const int64_t sshape[2] = {
                block ? (t->shape[0] + BLOCK - 1) / BLOCK : t->shape[0],
                block ? (t->shape[1] + BLOCK - 1) / BLOCK : 1};
            if (rc == 0) rc = stw_ckpt_add(w, sname, PD_DTYPE_F32, 2, sshape, err);
        } else {
            rc = stw_ckpt_add(w, t->name, t->dtype, t->n_dims, t->shape, err);
            /* A 2-D layer weight left as it is (the --ignore'd, a MoE router) is a Linear
             * that a "Linear" target would otherwise claim: name it in the ignore list. */
            if (rc == 0 && t->n_dims == 2 && ends_with(t->name, ".weight") &&
                strncmp(t->name, "model.layers.", 13) == 0) {
                char mod[1024];
                snprintf(mod, sizeof mod, "%.*s", (int)(strlen(t->name) - 7), t->name);
                if (list_add_unique(ignore, mod)) rc = PD_ENOMEM;
            }
        }
        if (rc) {
            fprintf(stderr, PROG ": %s\n", rc == PD_ENOMEM ? "out of memory" : err);
            return -1;
        }
    }
    for (int32_t i = 0; i < a->n_ignore; i++)
        if (!a->ignore_used[i] && strcmp(a->ignore[i], "lm_head") != 0)
            fprintf(stderr, PROG ": warning: --ignore %s matches no quantizable module\n",
                    a->ignore[i]);
    if (*n_quant == 0) {
        fprintf(stderr, PROG ": %s has no model.layers.*.{q,k,v,o,gate,up,down}_proj.weight "
                "to quantize\n", a->model);
        return -1;
    }
    return 0;
}

/* Runs the whole conversion. Returns 0 or -1 after printing why; on failure nothing of the
 * new checkpoint stays in --out. */
static int run(q_args *a)
{
    char err[PD_ERR_LEN];
    int rc = -1;
    bool created = false;
    json_t *config = NULL, *ignore = json_array(), *qc = NULL;
    st_model *m = NULL;
    stw_ckpt *w = NULL;
    q_item *items = NULL;
    q_extra extra = {0};

    char *cfg_path = path_join(a->model, "config.json", "");
    if (!cfg_path || !ignore || list_add_unique(ignore, "lm_head")) {
        fprintf(stderr, PROG ": out of memory\n");
        goto done;
    }
    for (int32_t i = 0; i < a->n_ignore; i++)
        if (list_add_unique(ignore, a->ignore[i])) goto done;
    if (pd_json_load_file(cfg_path, &config, err) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        goto done;
    }
    if (!json_is_object(config)) {
        fprintf(stderr, PROG ": %s is not a JSON object\n", cfg_path);
        goto done;
    }
    const char *keys[] = {"quantization_config", "compression_config"};
    for (int k = 0; k < 2; k++) {
        const json_t *old = json_object_get(config, keys[k]);
        if (old && !json_is_null(old)) {
            const char *method = json_string_value(json_object_get(old, "quant_method"));
            fprintf(stderr, PROG ": %s: the checkpoint is already quantized (%s with quant_method "
                    "\"%s\"); quantize its unquantized original\n", cfg_path, keys[k],
                    method ? method : "?");
            goto done;
        }
    }
    if (st_open(a->model, &m, err) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        goto done;
    }
    const int32_t n = st_count(m);
    items = calloc((size_t)n + 1, sizeof *items);
    stw_params wp = stw_default_params();
    wp.dir = a->out;
    wp.shard_bytes_max = a->shard_max;
    wp.tmp_suffix = TMP_SUFFIX;
    if (!items || stw_ckpt_create(&wp, &w, err) != 0) {
        fprintf(stderr, PROG ": out of memory\n");
        goto done;
    }
    int32_t n_quant;
    bool partial;
    if (plan(a, m, items, w, ignore, &n_quant, &partial)) goto done;
    if (!(qc = quant_config(a->scheme, ignore))) {
        fprintf(stderr, PROG ": out of memory\n");
        goto done;
    }
    if (prepare_out(a, &created)) goto done;
    if (stw_ckpt_begin(w, err) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        goto done;
    }
    if (partial && a->scheme == SCHEME_FP8_BLOCK)
        fprintf(stderr, PROG ": note: some quantized weights have dims that are not multiples "
                "of %d (partial blocks at the edges); vLLM refuses those in merged layers\n",
                BLOCK);
    q_progress pr = {.n_tensors = n, .last_pct = -1, .t0 = now_s(), .tty = isatty(2)};
    for (int32_t i = 0; i < n; i++) pr.total += items[i].t->nbytes;
    pr.quiet = a->quiet || pr.total < PROGRESS_MIN_BYTES;
    for (int32_t i = 0; i < n; i++) {
        const st_tensor *t = items[i].t;
        pr.tensors_done = i + 1;
        int r = !items[i].quantize ? copy_tensor(t, w, &pr)
                : a->scheme == SCHEME_FP8_BLOCK ? quantize_block(t, w, &pr)
                : quantize_channel(t, w, &pr);
        if (r) goto done;
    }
    if (stw_ckpt_finish(w, err) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        goto done;
    }
    if (copy_extras(a, &extra) || write_config(a, config, qc, &extra)) goto done;
    /* commit: weights, copies, config.json last */
    if (stw_ckpt_commit(w, err) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        goto done;
    }
    for (int32_t i = 0; i < extra.n; i++) {
        char *tmp = path_join(a->out, extra.names[i], TMP_SUFFIX);
        char *fin = path_join(a->out, extra.names[i], "");
        int r = tmp && fin ? rename(tmp, fin) : -1;
        if (r) fprintf(stderr, PROG ": cannot rename %s: %s\n", tmp ? tmp : "?", strerror(errno));
        else extra.made[i] = false;
        free(tmp);
        free(fin);
        if (r) goto done;
    }
    if (a->force) remove_stale(a, w);
    uint64_t out_bytes = stw_ckpt_total_bytes(w);
    fprintf(stderr, PROG ": %s: %d tensors (%d quantized, %s), %.3f GB in %d file%s -> %s "
            "(%.1f s)\n", a->model, (int)n, (int)n_quant, k_scheme_names[a->scheme],
            (double)out_bytes / 1e9, (int)stw_ckpt_n_files(w),
            stw_ckpt_n_files(w) == 1 ? "" : "s", a->out, now_s() - pr.t0);
    rc = 0;
done:
    extra_free(&extra, a->out);
    stw_ckpt_destroy(w);
    if (rc && created) rmdir(a->out);
    free(items);
    st_close(m);
    json_decref(qc);
    json_decref(ignore);
    json_decref(config);
    free(cfg_path);
    return rc;
}

int main(int argc, char **argv)
{
    q_args a = {0};
    int rc = parse_args(argc, argv, &a);
    if (rc == 0) rc = run(&a);
    free_args(&a);
    return rc < 0 ? 1 : 0; /* 1 is --help */
}
