/* tokenize_main.c -- pdserve-tokenize: encode text to ids or decode ids to text with a
 * HuggingFace tokenizer.json, printing JSON; render a conversation with the model's chat
 * template and encode it; plus a single-thread encode benchmark. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "common/error.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pdserve-tokenize --tokenizer DIR (--text STR | --text-file FILE) [options]\n"
            "       pdserve-tokenize --tokenizer DIR --decode 1,2,3 [--skip-special-tokens]\n"
            "       pdserve-tokenize --tokenizer DIR --chat FILE.json [--add-generation-prompt]\n"
            "       pdserve-tokenize --tokenizer DIR --bench FILE [--repeat N]\n"
            "\n"
            "Encodes text to token ids ({\"ids\": [...]}) or decodes ids to text ({\"text\": "
            "\"...\"})\n"
            "exactly as HuggingFace tokenizers does with DIR/tokenizer.json.\n"
            "\n"
            "  --tokenizer DIR          directory with tokenizer.json (and tokenizer_config.json)\n"
            "  --text STR               text to encode\n"
            "  --text-file FILE         encode the contents of FILE\n"
            "  --add-special-tokens     apply the post-processor template (e.g. a leading BOS)\n"
            "  --decode LIST            comma-separated ids to decode\n"
            "  --skip-special-tokens    leave special tokens out of the decoded text\n"
            "  --chat FILE.json         render {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}\n"
            "                           (- = stdin) with DIR's chat template as HF's\n"
            "                           apply_chat_template does, and encode the text without\n"
            "                           added special tokens: {\"text\": \"...\", \"ids\": [...]}\n"
            "                           (--plain: the text only)\n"
            "  --add-generation-prompt  end the rendered chat with the assistant's turn opener\n"
            "  --json                   JSON output (the default)\n"
            "  --plain                  plain output: ids as 1,2,3 or the raw decoded text\n"
            "  --bench FILE             encode FILE's paragraphs (split at blank lines) on one\n"
            "                           thread and print {\"mb_per_s\": ...} with load time\n"
            "  --repeat N               benchmark passes after one warm-up pass (default 3)\n"
            "  --no-scratch             benchmark tok_encode (no reused scratch, no word cache)\n"
            "  -h, --help               this help\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void put_json_string(FILE *f, const char *s, size_t len)
{
    fputc('"', f);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        case '\n': fputs("\\n", f); break;
        case '\r': fputs("\\r", f); break;
        case '\t': fputs("\\t", f); break;
        case '\b': fputs("\\b", f); break;
        case '\f': fputs("\\f", f); break;
        default:
            if (c < 0x20 || c == 0x7F) fprintf(f, "\\u%04x", c);
            else fputc(c, f);
        }
    }
    fputc('"', f);
}

static int read_file(const char *path, char **data, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "pdserve-tokenize: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 1 << 16, n = 0, got;
    char *buf = malloc(cap);
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *b = realloc(buf, cap *= 2);
            if (!b) {
                free(buf);
                buf = NULL;
            }
            buf = b;
        }
    }
    fclose(f);
    if (!buf) {
        fprintf(stderr, "pdserve-tokenize: out of memory reading %s\n", path);
        return -1;
    }
    *data = buf;
    *len = n;
    return 0;
}

/* Parses "1,2,3" (spaces and surrounding brackets allowed). */
static int parse_ids(const char *s, int32_t **ids, int32_t *n)
{
    size_t cap = 16;
    int32_t *v = malloc(cap * sizeof *v);
    *n = 0;
    if (!v) return -1;
    while (*s == ' ' || *s == '[') s++;
    while (*s && *s != ']') {
        char *end;
        errno = 0;
        long long x = strtoll(s, &end, 10);
        if (end == s || errno || x < INT32_MIN || x > INT32_MAX) {
            fprintf(stderr, "pdserve-tokenize: --decode: bad id at \"%s\"\n", s);
            free(v);
            return -1;
        }
        if ((size_t)*n == cap) {
            int32_t *w = realloc(v, (cap *= 2) * sizeof *v);
            if (!w) {
                free(v);
                return -1;
            }
            v = w;
        }
        v[(*n)++] = (int32_t)x;
        s = end;
        while (*s == ' ') s++;
        if (*s == ',') s++;
        else if (*s && *s != ']') {
            fprintf(stderr, "pdserve-tokenize: --decode: expected ',' at \"%s\"\n", s);
            free(v);
            return -1;
        }
        while (*s == ' ') s++;
    }
    *ids = v;
    return 0;
}

/* Encodes every paragraph of the file, `repeat` times after a warm-up. */
static int bench(const tok_tokenizer *t, const char *dir, const char *path, int repeat,
                 double load_ms, bool use_scratch)
{
    char *data;
    size_t len;
    if (read_file(path, &data, &len)) return 1;
    size_t n_docs = 0;
    long long n_tokens = 0;
    uint32_t ids_hash = 2166136261u; /* FNV-1a over the ids of the last pass */
    double best = 1e30, total = 0;
    char err[PD_ERR_LEN] = "";
    tok_scratch *scratch;
    if (tok_scratch_create(&scratch)) {
        fprintf(stderr, "pdserve-tokenize: out of memory\n");
        free(data);
        return 1;
    }
    for (int pass = 0; pass <= repeat; pass++) {
        double t0 = now_s();
        long long tokens = 0;
        size_t docs = 0;
        uint32_t h = 2166136261u;
        for (size_t i = 0; i < len;) {
            const char *end = memmem(data + i, len - i, "\n\n", 2);
            size_t j = end ? (size_t)(end - data) + 2 : len;
            int32_t *ids, n;
            int rc = use_scratch
                         ? tok_encode_scratch(t, scratch, data + i, j - i, false, &ids, &n, err)
                         : tok_encode(t, data + i, j - i, false, &ids, &n, err);
            if (rc) {
                fprintf(stderr, "pdserve-tokenize: %s\n", err);
                tok_scratch_destroy(scratch);
                free(data);
                return 1;
            }
            for (int32_t k = 0; k < n; k++) h = (h ^ (uint32_t)ids[k]) * 16777619u;
            free(ids);
            tokens += n;
            docs++;
            i = j;
        }
        double dt = now_s() - t0;
        if (pass == 0) continue; /* warm-up */
        total += dt;
        if (dt < best) best = dt;
        n_tokens = tokens;
        n_docs = docs;
        ids_hash = h;
    }
    tok_scratch_destroy(scratch);
    printf("{\"tokenizer\": ");
    put_json_string(stdout, dir, strlen(dir));
    printf(", \"scratch\": %s, \"bytes\": %zu, \"docs\": %zu, \"tokens\": %lld, \"ids_fnv1a\": %u, "
           "\"passes\": %d, \"best_s\": %.4f, \"mb_per_s\": %.2f, \"mean_mb_per_s\": %.2f, "
           "\"load_ms\": %.1f}\n",
           use_scratch ? "true" : "false", len, n_docs, n_tokens, ids_hash, repeat, best,
           (double)len / 1e6 / best, (double)len * repeat / 1e6 / total, load_ms);
    free(data);
    return 0;
}

/* Renders the conversation of path (or stdin for "-") with dir's chat template and prints
 * the text and its ids. Returns the exit status. */
static int chat(const tok_tokenizer *t, const char *dir, const char *path, bool agp, bool plain)
{
    char err[PD_ERR_LEN] = "";
    json_error_t je;
    json_t *doc = strcmp(path, "-") ? json_load_file(path, JSON_DECODE_INT_AS_REAL, &je)
                                    : json_loadf(stdin, JSON_DECODE_INT_AS_REAL, &je);
    if (!doc) {
        fprintf(stderr, "pdserve-tokenize: --chat %s: %s (line %d column %d)\n", path, je.text,
                je.line, je.column);
        return 1;
    }
    json_t *list = json_is_array(doc) ? doc : json_object_get(doc, "messages");
    if (!json_is_array(list)) {
        fprintf(stderr, "pdserve-tokenize: --chat %s: expected {\"messages\": [...]}\n", path);
        json_decref(doc);
        return 1;
    }
    size_t n = json_array_size(list);
    chat_message *m = calloc(n ? n : 1, sizeof *m);
    int status = 0;
    for (size_t i = 0; m && i < n && !status; i++) {
        json_t *e = json_array_get(list, i), *role = json_object_get(e, "role");
        json_t *content = json_object_get(e, "content");
        if (!json_is_string(role) || (content && !json_is_string(content) && !json_is_null(content))) {
            fprintf(stderr, "pdserve-tokenize: --chat %s: message %zu needs a string \"role\" and "
                            "a string or null \"content\"\n", path, i);
            status = 1;
            break;
        }
        m[i].role = json_string_value(role);
        m[i].content = content ? json_string_value(content) : NULL;
    }
    chat_template *ct = NULL;
    char *text = NULL;
    int32_t *ids = NULL, n_ids = 0;
    int rc;
    if (!m) {
        fprintf(stderr, "pdserve-tokenize: out of memory\n");
        status = 1;
    } else if (!status && (rc = chat_template_load(dir, &ct, err))) {
        fprintf(stderr, "pdserve-tokenize: %s (%s)\n", err, pd_err_name(rc));
        status = 1;
    } else if (!status && (rc = chat_template_render(ct, m, (int)n, agp, &text, err))) {
        fprintf(stderr, "pdserve-tokenize: the chat template failed: %s (%s)\n", err,
                pd_err_name(rc));
        status = 1;
    } else if (!status && (rc = tok_encode(t, text, strlen(text), false, &ids, &n_ids, err))) {
        fprintf(stderr, "pdserve-tokenize: %s (%s)\n", err, pd_err_name(rc));
        status = 1;
    } else if (!status) {
        if (plain) {
            fputs(text, stdout);
        } else {
            printf("{\"text\": ");
            put_json_string(stdout, text, strlen(text));
            printf(", \"ids\": [");
            for (int32_t i = 0; i < n_ids; i++) printf(i ? ", %d" : "%d", ids[i]);
            printf("]}\n");
        }
    }
    free(ids);
    free(text);
    chat_template_destroy(ct);
    free(m);
    json_decref(doc);
    return status;
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"tokenizer", required_argument, 0, 'k'},
        {"text", required_argument, 0, 't'},
        {"text-file", required_argument, 0, 'f'},
        {"add-special-tokens", no_argument, 0, 'a'},
        {"decode", required_argument, 0, 'd'},
        {"skip-special-tokens", no_argument, 0, 's'},
        {"json", no_argument, 0, 'j'},
        {"plain", no_argument, 0, 'p'},
        {"bench", required_argument, 0, 'b'},
        {"repeat", required_argument, 0, 'r'},
        {"no-scratch", no_argument, 0, 'n'},
        {"chat", required_argument, 0, 'c'},
        {"add-generation-prompt", no_argument, 0, 'g'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *dir = NULL, *text = NULL, *text_file = NULL, *decode = NULL, *bench_file = NULL,
               *chat_file = NULL;
    bool add_special = false, skip_special = false, plain = false, use_scratch = true,
         add_gen = false;
    int repeat = 3, c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'k': dir = optarg; break;
        case 't': text = optarg; break;
        case 'f': text_file = optarg; break;
        case 'a': add_special = true; break;
        case 'd': decode = optarg; break;
        case 's': skip_special = true; break;
        case 'j': plain = false; break;
        case 'p': plain = true; break;
        case 'b': bench_file = optarg; break;
        case 'n': use_scratch = false; break;
        case 'c': chat_file = optarg; break;
        case 'g': add_gen = true; break;
        case 'r':
            repeat = atoi(optarg);
            if (repeat < 1) {
                fprintf(stderr, "pdserve-tokenize: --repeat must be >= 1\n");
                return 2;
            }
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "pdserve-tokenize: unexpected argument \"%s\"\n", argv[optind]);
        return 2;
    }
    int modes = (text != NULL) + (text_file != NULL) + (decode != NULL) + (bench_file != NULL) +
                (chat_file != NULL);
    if (!dir || modes != 1) {
        fprintf(stderr, "pdserve-tokenize: need --tokenizer DIR and exactly one of --text, "
                        "--text-file, --decode, --chat, --bench (see --help)\n");
        return 2;
    }
    if (add_gen && !chat_file) {
        fprintf(stderr, "pdserve-tokenize: --add-generation-prompt goes with --chat\n");
        return 2;
    }
    char err[PD_ERR_LEN] = "";
    tok_tokenizer *t;
    double t0 = now_s();
    int rc = tok_load(dir, &t, err);
    double load_ms = (now_s() - t0) * 1e3;
    if (rc) {
        fprintf(stderr, "pdserve-tokenize: %s (%s)\n", err, pd_err_name(rc));
        return 1;
    }
    int status = 0;
    if (bench_file) {
        status = bench(t, dir, bench_file, repeat, load_ms, use_scratch);
    } else if (chat_file) {
        status = chat(t, dir, chat_file, add_gen, plain);
    } else if (decode) {
        int32_t *ids, n;
        char *out;
        size_t len;
        if (parse_ids(decode, &ids, &n)) {
            status = 2;
        } else if ((rc = tok_decode(t, ids, n, skip_special, &out, &len, err))) {
            fprintf(stderr, "pdserve-tokenize: %s (%s)\n", err, pd_err_name(rc));
            status = 1;
            free(ids);
        } else {
            if (plain) {
                fwrite(out, 1, len, stdout);
                fputc('\n', stdout);
            } else {
                printf("{\"text\": ");
                put_json_string(stdout, out, len);
                printf("}\n");
            }
            free(out);
            free(ids);
        }
    } else {
        char *data = NULL;
        size_t len = text ? strlen(text) : 0;
        int32_t *ids, n;
        if (text_file && read_file(text_file, &data, &len)) {
            status = 1;
        } else if ((rc = tok_encode(t, text ? text : data, len, add_special, &ids, &n, err))) {
            fprintf(stderr, "pdserve-tokenize: %s (%s)\n", err, pd_err_name(rc));
            status = 1;
        } else {
            fputs(plain ? "" : "{\"ids\": [", stdout);
            for (int32_t i = 0; i < n; i++) printf(i ? (plain ? ",%d" : ", %d") : "%d", ids[i]);
            fputs(plain ? "\n" : "]}\n", stdout);
            free(ids);
        }
        free(data);
    }
    tok_destroy(t);
    return status;
}
