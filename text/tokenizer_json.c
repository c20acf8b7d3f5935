/* tokenizer_json.c -- A fast path through tokenizer.json's two big values, model.vocab (an
 * object of token -> id) and model.merges (an array), which hold almost all of an 11 MB file:
 * they are located with a string-aware scanner, read by the small parsers here, and blanked
 * out (same length, newlines kept) so that jansson only builds the small rest of the file. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/tokenizer_impl.h"

/* Line and column (1-based) of offset pos, for messages. */
static void line_col(const char *s, size_t pos, int *line, int *col)
{
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < pos; i++) {
        if (s[i] == '\n') {
            (*line)++;
            *col = 1;
        } else {
            (*col)++;
        }
    }
}

static int syntax(const char *s, size_t pos, const char *what, char *err)
{
    int line, col;
    line_col(s, pos, &line, &col);
    return pd_errf(err, PD_EFORMAT, "tokenizer.json: malformed JSON at line %d column %d: %s", line,
                   col, what);
}

static inline size_t skip_ws(const char *s, size_t len, size_t i)
{
    while (i < len && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) i++;
    return i;
}

static int hex4(const char *s, uint32_t *v)
{
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return -1;
        *v = *v * 16 + (uint32_t)d;
    }
    return 0;
}

/* Reads the string starting at the quote s[*pos]. With out == NULL it is only skipped;
 * otherwise out receives the unescaped bytes (out->len reset first). */
static int read_string(const char *s, size_t len, size_t *pos, tok__buf *out, char *err)
{
    size_t i = *pos + 1, run = i;
    if (out) out->len = 0;
    for (;;) {
        while (i < len && s[i] != '"' && s[i] != '\\' && (uint8_t)s[i] >= 0x20) i++;
        if (i >= len) return syntax(s, *pos, "unterminated string", err);
        if ((uint8_t)s[i] < 0x20) return syntax(s, i, "control character in string", err);
        if (out && tok__buf_put(out, s + run, i - run)) return PD_ENOMEM;
        if (s[i] == '"') break;
        if (i + 1 >= len) return syntax(s, i, "unterminated string", err);
        char e = s[i + 1], c = 0;
        i += 2;
        switch (e) {
        case '"': c = '"'; break;
        case '\\': c = '\\'; break;
        case '/': c = '/'; break;
        case 'b': c = '\b'; break;
        case 'f': c = '\f'; break;
        case 'n': c = '\n'; break;
        case 'r': c = '\r'; break;
        case 't': c = '\t'; break;
        case 'u': {
            uint32_t cp, lo;
            if (i + 4 > len || hex4(s + i, &cp)) return syntax(s, i, "bad \\u escape", err);
            i += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) { /* a surrogate pair */
                if (i + 6 > len || s[i] != '\\' || s[i + 1] != 'u' || hex4(s + i + 2, &lo) ||
                    lo < 0xDC00 || lo > 0xDFFF)
                    return syntax(s, i, "invalid surrogate pair", err);
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                i += 6;
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                return syntax(s, i, "invalid surrogate", err);
            }
            char u[4];
            if (out && tok__buf_put(out, u, tok__utf8_put(cp, u))) return PD_ENOMEM;
            run = i;
            continue;
        }
        default: return syntax(s, i - 1, "bad escape", err);
        }
        if (out && tok__buf_put(out, &c, 1)) return PD_ENOMEM;
        run = i;
    }
    if (out) {
        if (tok__buf_reserve(out, 0)) return PD_ENOMEM;
        if (tok__utf8_check(out->p, out->len) != out->len)
            return syntax(s, *pos, "string is not valid UTF-8", err);
    }
    *pos = i + 1;
    return 0;
}

/* Skips one value at s[*pos] (after white space), checking brackets and strings only: what
 * is skipped is parsed by jansson afterwards. */
static int skip_value(const char *s, size_t len, size_t *pos, char *err)
{
    char stack[512];
    int depth = 0;
    size_t i = skip_ws(s, len, *pos);
    if (i >= len) return syntax(s, i, "unexpected end of input", err);
    do {
        char c = s[i];
        if (c == '"') {
            int rc = read_string(s, len, &i, NULL, err);
            if (rc) return rc;
        } else if (c == '{' || c == '[') {
            if (depth == (int)sizeof stack) return syntax(s, i, "too deeply nested", err);
            stack[depth++] = c == '{' ? '}' : ']';
            i++;
        } else if (c == '}' || c == ']') {
            if (!depth || stack[depth - 1] != c) return syntax(s, i, "unbalanced brackets", err);
            depth--;
            i++;
        } else if (c == ',' || c == ':') {
            if (!depth) return syntax(s, i, "unexpected character", err);
            i++;
        } else { /* number, true, false, null */
            while (i < len && !strchr(",:{}[]\" \t\r\n", s[i])) i++;
        }
        if (depth) {
            i = skip_ws(s, len, i);
            if (i >= len) return syntax(s, len, "unexpected end of input", err);
        }
    } while (depth);
    *pos = i;
    return 0;
}

/* Walks the members of the object at s[*pos] ('{'), calling visit for each key (raw bytes
 * between the quotes) with the offset of its value; visit must skip the value. */
typedef int (*member_fn)(void *ctx, const char *key, size_t key_len, size_t *pos, char *err);

static int walk_object(const char *s, size_t len, size_t *pos, member_fn visit, void *ctx,
                       char *err)
{
    size_t i = skip_ws(s, len, *pos);
    if (i >= len || s[i] != '{') return syntax(s, i, "expected an object", err);
    i = skip_ws(s, len, i + 1);
    if (i < len && s[i] == '}') {
        *pos = i + 1;
        return 0;
    }
    for (;;) {
        if (i >= len || s[i] != '"') return syntax(s, i, "expected a key", err);
        size_t k = i;
        int rc = read_string(s, len, &i, NULL, err);
        if (rc) return rc;
        i = skip_ws(s, len, i);
        if (i >= len || s[i] != ':') return syntax(s, i, "expected ':'", err);
        i = skip_ws(s, len, i + 1);
        /* visitors look at the value's first byte before skipping it */
        if (i >= len) return syntax(s, len, "unexpected end of input", err);
        if ((rc = visit(ctx, s + k + 1, i - k, &i, err))) return rc;
        i = skip_ws(s, len, i);
        if (i < len && s[i] == ',') {
            i = skip_ws(s, len, i + 1);
            continue;
        }
        if (i < len && s[i] == '}') break;
        return syntax(s, i, "expected ',' or '}'", err);
    }
    *pos = i + 1;
    return 0;
}

typedef struct {
    const char *s;
    size_t len;
    tok__json_model *m;
} locate_ctx;

static bool key_is(const char *key, size_t span, const char *want)
{
    /* span runs from the key's first byte to the value; the key ends at the last quote */
    size_t n = strlen(want);
    return span > n && memcmp(key, want, n) == 0 && key[n] == '"';
}

static int visit_model(void *ctx, const char *key, size_t span, size_t *pos, char *err)
{
    locate_ctx *c = ctx;
    size_t start = *pos;
    int rc = skip_value(c->s, c->len, pos, err);
    if (rc) return rc;
    if (key_is(key, span, "vocab") && c->s[start] == '{') {
        c->m->vocab_s = start;
        c->m->vocab_e = *pos;
    } else if (key_is(key, span, "merges") && c->s[start] == '[') {
        c->m->merges_s = start;
        c->m->merges_e = *pos;
    }
    return 0;
}

static int visit_top(void *ctx, const char *key, size_t span, size_t *pos, char *err)
{
    locate_ctx *c = ctx;
    if (key_is(key, span, "model") && c->s[*pos] == '{')
        return walk_object(c->s, c->len, pos, visit_model, ctx, err);
    return skip_value(c->s, c->len, pos, err);
}

int tok__json_locate(const char *s, size_t len, tok__json_model *m, char *err)
{
    memset(m, 0, sizeof *m);
    locate_ctx c = {s, len, m};
    size_t pos = skip_ws(s, len, 0);
    if (pos >= len || s[pos] != '{') return 0; /* let jansson say what is wrong */
    int rc = walk_object(s, len, &pos, visit_top, &c, err);
    if (rc) return rc;
    if (skip_ws(s, len, pos) != len) return syntax(s, pos, "end of file expected", err);
    return 0;
}

char *tok__json_without(const char *s, size_t len, const tok__json_model *m, size_t *out_len)
{
    size_t r[2][2] = {{m->vocab_s, m->vocab_e}, {m->merges_s, m->merges_e}};
    if (r[0][0] > r[1][0]) { /* in file order */
        size_t a = r[0][0], b = r[0][1];
        r[0][0] = r[1][0], r[0][1] = r[1][1], r[1][0] = a, r[1][1] = b;
    }
    char *o = malloc(len + 1);
    if (!o) return NULL;
    size_t n = 0, from = 0;
    for (int k = 0; k < 2; k++) {
        if (!r[k][1]) continue;
        memcpy(o + n, s + from, r[k][0] + 1 - from); /* up to and with the opening bracket */
        n += r[k][0] + 1 - from;
        for (size_t i = r[k][0] + 1; i + 1 < r[k][1]; i++) /* keep line numbers right */
            if (s[i] == '\n') o[n++] = '\n';
        from = r[k][1] - 1; /* the closing bracket */
    }
    memcpy(o + n, s + from, len - from);
    n += len - from;
    o[n] = '\0';
    *out_len = n;
    return o;
}

int tok__json_vocab(const char *s, size_t start, size_t end, tok__vocab_fn fn, void *ctx, char *err)
{
    tok__buf key = {0};
    size_t i = skip_ws(s, end, start + 1);
    int rc = 0;
    if (i < end && s[i] == '}') i = end;
    while (i < end && !rc) {
        if (s[i] != '"') {
            rc = syntax(s, i, "model.vocab: expected a key", err);
            break;
        }
        if ((rc = read_string(s, end, &i, &key, err))) break;
        i = skip_ws(s, end, i);
        if (i >= end || s[i] != ':') {
            rc = syntax(s, i, "model.vocab: expected ':'", err);
            break;
        }
        i = skip_ws(s, end, i + 1);
        int64_t v = 0;
        size_t d = i;
        while (i < end && s[i] >= '0' && s[i] <= '9' && v < INT32_MAX) v = v * 10 + (s[i++] - '0');
        if (i == d || (i < end && (s[i] == '.' || s[i] == 'e' || s[i] == 'E' ||
                                   (s[i] >= '0' && s[i] <= '9')))) {
            rc = pd_errf(err, PD_EFORMAT, "model.vocab: bad id for token \"%.*s\"",
                         (int)(key.len > 100 ? 100 : key.len), key.p);
            break;
        }
        if ((rc = fn(ctx, key.p, key.len, v, err))) break;
        i = skip_ws(s, end, i);
        if (i < end && s[i] == ',') i = skip_ws(s, end, i + 1);
        else if (i < end && s[i] == '}') i = end;
        else rc = syntax(s, i, "model.vocab: expected ',' or '}'", err);
    }
    tok__buf_free(&key);
    return rc;
}

int tok__json_merges(const char *s, size_t start, size_t end, tok__merge_fn fn, void *ctx,
                     char *err)
{
    tok__buf a = {0}, b = {0};
    size_t i = skip_ws(s, end, start + 1), idx = 0;
    int rc = 0;
    if (i < end && s[i] == ']') i = end;
    while (i < end && !rc) {
        if (s[i] == '"') { /* legacy "a b" */
            if ((rc = read_string(s, end, &i, &a, err))) break;
            rc = fn(ctx, idx, a.p, a.len, NULL, 0, err);
        } else if (s[i] == '[') {
            i = skip_ws(s, end, i + 1);
            if (i >= end || s[i] != '"' || (rc = read_string(s, end, &i, &a, err))) {
                if (!rc)
                    rc = pd_errf(err, PD_EFORMAT,
                                 "model.merges[%zu]: must be \"a b\" or [\"a\", \"b\"]", idx);
                break;
            }
            i = skip_ws(s, end, i);
            if (i < end && s[i] == ',') i = skip_ws(s, end, i + 1);
            if (i >= end || s[i] != '"' || (rc = read_string(s, end, &i, &b, err))) {
                if (!rc)
                    rc = pd_errf(err, PD_EFORMAT,
                                 "model.merges[%zu]: must be \"a b\" or [\"a\", \"b\"]", idx);
                break;
            }
            i = skip_ws(s, end, i);
            if (i >= end || s[i] != ']') {
                rc = pd_errf(err, PD_EFORMAT,
                             "model.merges[%zu]: must be \"a b\" or [\"a\", \"b\"]", idx);
                break;
            }
            i++;
            rc = fn(ctx, idx, a.p, a.len, b.p, b.len, err);
        } else {
            rc = pd_errf(err, PD_EFORMAT, "model.merges[%zu]: must be \"a b\" or [\"a\", \"b\"]",
                         idx);
            break;
        }
        idx++;
        i = skip_ws(s, end, i);
        if (rc) break;
        if (i < end && s[i] == ',') i = skip_ws(s, end, i + 1);
        else if (i < end && s[i] == ']') i = end;
        else rc = syntax(s, i, "model.merges: expected ',' or ']'", err);
    }
    tok__buf_free(&a);
    tok__buf_free(&b);
    return rc;
}

size_t tok__json_count(const char *s, size_t start, size_t end)
{
    /* an upper bound on the number of entries: top-level commas + 1 */
    size_t n = 1;
    int depth = 0;
    for (size_t i = start + 1; i + 1 < end; i++) {
        char c = s[i];
        if (c == '"') {
            for (i++; i < end && s[i] != '"'; i++)
                if (s[i] == '\\') i++;
        } else if (c == '[' || c == '{') {
            depth++;
        } else if (c == ']' || c == '}') {
            depth--;
        } else if (c == ',' && depth == 0) {
            n++;
        }
    }
    return n;
}
