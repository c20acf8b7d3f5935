/* tokenizer_text.c -- Text helpers for the tokenizer: growable buffers, strict and lossy
 * UTF-8, the Unicode classes HF's Rust code relies on (White_Space, \w, is_numeric), and
 * literal/regex patterns with HF's find_matches semantics on top of PCRE2 (UTF + UCP, JIT). */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/error.h"
#include "text/tokenizer_impl.h"

/* ---- buffers ---- */

int tok__buf_reserve(tok__buf *b, size_t extra)
{
    size_t need = b->len + extra + 1;
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return PD_ENOMEM;
    b->p = p;
    b->cap = cap;
    return 0;
}

int tok__buf_put(tok__buf *b, const void *s, size_t n)
{
    if (tok__buf_reserve(b, n)) return PD_ENOMEM;
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

void tok__buf_free(tok__buf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

int tok__ids_push(tok__ids *a, int32_t id)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        int32_t *v = realloc(a->v, cap * sizeof *v);
        if (!v) return PD_ENOMEM;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = id;
    return 0;
}

int tok__spans_push(tok__spans *a, size_t s, size_t e, bool match)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        tok__span *v = realloc(a->v, cap * sizeof *v);
        if (!v) return PD_ENOMEM;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = (tok__span){s, e, match};
    return 0;
}

/* ---- UTF-8 ---- */

/* For a lead byte: number of continuation bytes and the allowed range of the first one
 * (Unicode table 3-7); need = -1 for a byte that cannot start a character. */
static inline int utf8_lead(uint8_t b, uint8_t *lo, uint8_t *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (b < 0x80) return 0;
    if (b >= 0xC2 && b <= 0xDF) return 1;
    if (b == 0xE0) {
        *lo = 0xA0;
        return 2;
    }
    if (b == 0xED) {
        *hi = 0x9F;
        return 2;
    }
    if (b >= 0xE1 && b <= 0xEF) return 2;
    if (b == 0xF0) {
        *lo = 0x90;
        return 3;
    }
    if (b >= 0xF1 && b <= 0xF3) return 3;
    if (b == 0xF4) {
        *hi = 0x8F;
        return 3;
    }
    return -1;
}

/* Length of the valid prefix of the character starting at s[i] (1 + good continuation
 * bytes), and whether it is complete. */
static inline size_t utf8_scan(const uint8_t *s, size_t len, size_t i, bool *complete)
{
    uint8_t lo, hi;
    int need = utf8_lead(s[i], &lo, &hi);
    if (need < 0) {
        *complete = false;
        return 0;
    }
    size_t j = i + 1;
    for (int k = 0; k < need; k++, j++) {
        if (j >= len || s[j] < lo || s[j] > hi) {
            *complete = false;
            return j - i;
        }
        lo = 0x80;
        hi = 0xBF;
    }
    *complete = true;
    return j - i;
}

size_t tok__utf8_check(const char *str, size_t len)
{
    const uint8_t *s = (const uint8_t *)str;
    size_t i = 0;
    while (i < len) {
        /* eight ASCII bytes at a time */
        while (i + 8 <= len) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ull) break;
            i += 8;
        }
        if (i >= len) break;
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        bool ok;
        size_t n = utf8_scan(s, len, i, &ok);
        if (!ok) return i;
        i += n;
    }
    return len;
}

uint32_t tok__utf8_next(const char *str, size_t *n)
{
    const uint8_t *s = (const uint8_t *)str;
    uint8_t b = s[0];
    if (b < 0x80) {
        *n = 1;
        return b;
    }
    if (b < 0xE0) {
        *n = 2;
        return ((uint32_t)(b & 0x1F) << 6) | (s[1] & 0x3F);
    }
    if (b < 0xF0) {
        *n = 3;
        return ((uint32_t)(b & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    }
    *n = 4;
    return ((uint32_t)(b & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
           ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
}

size_t tok__utf8_put(uint32_t cp, char *o)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t tok__utf8_partial_tail(const char *str, size_t len)
{
    const uint8_t *s = (const uint8_t *)str;
    for (size_t k = len < 3 ? len : 3; k >= 1; k--) {
        size_t i = len - k;
        if (s[i] < 0xC0) continue;
        bool ok;
        size_t n = utf8_scan(s, len, i, &ok);
        if (!ok && n == k) return k; /* every byte up to the end fits: unfinished */
    }
    return 0;
}

static const char REPLACEMENT[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

int tok__utf8_lossy(tok__buf *out, const char *str, size_t len)
{
    const uint8_t *s = (const uint8_t *)str;
    size_t i = 0, run = 0; /* run: start of pending valid bytes */
    if (tok__buf_reserve(out, len)) return PD_ENOMEM;
    while (i < len) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        bool ok;
        size_t n = utf8_scan(s, len, i, &ok);
        if (ok) {
            i += n;
            continue;
        }
        if (tok__buf_put(out, s + run, i - run) || tok__buf_put(out, REPLACEMENT, 3))
            return PD_ENOMEM;
        i += n ? n : 1;
        run = i;
    }
    return tok__buf_put(out, s + run, len - run);
}

/* ---- Unicode classes ---- */

bool tok__is_space(uint32_t c)
{
    if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
    if (c < 0x85) return false;
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
           c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool tok__is_word(uint32_t c)
{
    if (c < 0x80)
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
               c == '_';
    if (c == 0x200C || c == 0x200D) return true;
    if ((c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F189)) return true;
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC: return true;
    default: return false;
    }
}

bool tok__is_numeric(uint32_t c)
{
    if (c < 0x80) return c >= '0' && c <= '9';
    utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

/* ---- patterns ---- */

/* Unicode White_Space as a class body (what Oniguruma's \s matches; PCRE2's also has
 * U+180E). */
static const char WS_CLASS[] =
    "\\x{09}-\\x{0D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

/* Rewrites \s / \S so that PCRE2 matches what Oniguruma matches. */
static int regex_translate(const char *s, size_t len, tok__buf *o)
{
    bool in_class = false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        int rc = 0;
        if (c == '\\' && i + 1 < len) {
            char d = s[i + 1];
            if (d == 's' && in_class) {
                rc = tok__buf_put(o, WS_CLASS, sizeof WS_CLASS - 1);
            } else if (d == 's' || (d == 'S' && !in_class)) {
                rc = tok__buf_put(o, d == 's' ? "[" : "[^", d == 's' ? 1 : 2);
                if (!rc) rc = tok__buf_put(o, WS_CLASS, sizeof WS_CLASS - 1);
                if (!rc) rc = tok__buf_put(o, "]", 1);
            } else {
                rc = tok__buf_put(o, s + i, 2);
            }
            i++;
        } else if (in_class && c == '[' && i + 1 < len && s[i + 1] == ':') {
            const char *end = strstr(s + i, ":]"); /* POSIX class: copy whole */
            size_t n = end && (size_t)(end - s) < len ? (size_t)(end - s) + 2 - i : 1;
            rc = tok__buf_put(o, s + i, n);
            i += n - 1;
        } else if (!in_class && c == '[') {
            in_class = true;
            size_t n = 1;
            if (i + n < len && s[i + n] == '^') n++;
            if (i + n < len && s[i + n] == ']') n++; /* a leading ] is literal */
            rc = tok__buf_put(o, s + i, n);
            i += n - 1;
        } else {
            if (in_class && c == ']') in_class = false;
            rc = tok__buf_put(o, &c, 1);
        }
        if (rc) return rc;
    }
    return 0;
}

int tok__pat_init(tok__pat *p, const char *s, size_t len, bool regex, const char *what, char *err)
{
    memset(p, 0, sizeof *p);
    if (!regex) {
        p->lit = malloc(len + 1);
        if (!p->lit) return PD_ENOMEM;
        memcpy(p->lit, s, len);
        p->lit[len] = '\0';
        p->lit_len = len;
        return 0;
    }
    tok__buf src = {0};
    if (regex_translate(s, len, &src) || tok__buf_put(&src, "", 0)) {
        tok__buf_free(&src);
        return PD_ENOMEM;
    }
    int ec;
    PCRE2_SIZE eo;
    p->re = pcre2_compile((PCRE2_SPTR)src.p, src.len, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    tok__buf_free(&src);
    if (!p->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return pd_errf(err, PD_EFORMAT, "%s: bad regex \"%.*s\": %s", what,
                       (int)(len > 200 ? 200 : len), s, (const char *)msg);
    }
    p->jit = pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE) == 0;
    return 0;
}

void tok__pat_free(tok__pat *p)
{
    free(p->lit);
    if (p->re) pcre2_code_free(p->re);
    memset(p, 0, sizeof *p);
}

void tok__matcher_free(tok__matcher *m)
{
    if (m->md) pcre2_match_data_free(m->md);
    if (m->mctx) pcre2_match_context_free(m->mctx);
    if (m->jstack) pcre2_jit_stack_free(m->jstack);
    memset(m, 0, sizeof *m);
}

int tok__pat_find(const tok__pat *p, tok__matcher *m, const char *s, size_t len, size_t start,
                  size_t *ms, size_t *me)
{
    if (p->lit) {
        if (p->lit_len == 0 || start >= len) return 0;
        const char *f = memmem(s + start, len - start, p->lit, p->lit_len);
        if (!f) return 0;
        *ms = (size_t)(f - s);
        *me = *ms + p->lit_len;
        return 1;
    }
    if (!m->md && !(m->md = pcre2_match_data_create(16, NULL))) return PD_ENOMEM;
    int rc;
    if (p->jit && !m->mctx) rc = pcre2_jit_match(p->re, (PCRE2_SPTR)s, len, start, 0, m->md, NULL);
    else rc = pcre2_match(p->re, (PCRE2_SPTR)s, len, start, PCRE2_NO_UTF_CHECK, m->md, m->mctx);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !m->mctx) {
        /* deep backtracking on a long piece: retry with a large JIT stack */
        m->mctx = pcre2_match_context_create(NULL);
        m->jstack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, NULL);
        if (!m->mctx || !m->jstack) return PD_ENOMEM;
        pcre2_jit_stack_assign(m->mctx, NULL, m->jstack);
        rc = pcre2_match(p->re, (PCRE2_SPTR)s, len, start, PCRE2_NO_UTF_CHECK, m->md, m->mctx);
    }
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) return PD_EINVAL;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(m->md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}

int tok__pat_find_all(const tok__pat *p, tok__matcher *m, const char *s, size_t len,
                      tok__spans *out)
{
    out->n = 0;
    if (len == 0) return tok__spans_push(out, 0, 0, false);
    size_t prev = 0, pos = 0, last_match_end = SIZE_MAX;
    while (pos <= len) {
        size_t ms, me;
        int rc = tok__pat_find(p, m, s, len, pos, &ms, &me);
        if (rc < 0) return rc;
        if (rc == 0) break;
        if (ms == me && me == last_match_end) {
            /* Oniguruma's iterator: no empty match right after the previous match */
            if (ms >= len) break;
            size_t n;
            tok__utf8_next(s + ms, &n);
            pos = ms + n;
            continue;
        }
        if (prev != ms && tok__spans_push(out, prev, ms, false)) return PD_ENOMEM;
        if (tok__spans_push(out, ms, me, true)) return PD_ENOMEM;
        prev = me;
        last_match_end = me;
        pos = me;
    }
    if (prev != len && tok__spans_push(out, prev, len, false)) return PD_ENOMEM;
    return 0;
}
