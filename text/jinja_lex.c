/* jinja_lex.c -- The Jinja lexer: template source to tokens, with jinja2's exact whitespace
 * rules (newline normalisation, `-`/`+` tag modifiers, trim_blocks, lstrip_blocks,
 * keep_trailing_newline, raw blocks) and its expression tokens (names, Python string literals
 * with their escapes, integers and floats with `_` separators, operators; tag ends count only
 * where brackets balance). Also the template arena, shared with the parser. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/jinja_lex.h"

/* ---- arena ---- */
struct jarena_chunk {
    jarena_chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void *jinja__arena_alloc(jarena_chunk **a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (!*a || (*a)->cap - (*a)->used < n) {
        size_t cap = n > 32768 ? n : 32768;
        jarena_chunk *c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->next = *a;
        c->used = 0;
        c->cap = cap;
        *a = c;
    }
    void *p = (*a)->data + (*a)->used;
    (*a)->used += n;
    memset(p, 0, n);
    return p;
}

void jinja__arena_free(jarena_chunk *a)
{
    while (a) {
        jarena_chunk *next = a->next;
        free(a);
        a = next;
    }
}

jstr *jinja__arena_str(jarena_chunk **arena, const char *s, size_t len)
{
    jstr *r = jinja__arena_alloc(arena, sizeof *r + len + 1);
    if (!r) return NULL;
    r->rc = -1;
    r->len = len;
    r->ncp = jinja__u8_count(s, len);
    if (len) memcpy(r->s, s, len);
    r->s[len] = 0;
    return r;
}

/* ---- lexer ---- */
typedef struct lx {
    jlexed *out;
    const jinja_parse_params *pp;
    const char *s;
    size_t len, pos;
    int line;          /* line of pos */
    size_t line_at;    /* where `line` was counted up to */
    bool line_starting;
    char stack[128];   /* open brackets inside a tag */
    int depth;
} lx;

static int line_of(lx *l, size_t pos)
{
    for (; l->line_at < pos; l->line_at++)
        if (l->s[l->line_at] == '\n') l->line++;
    return l->line;
}

int jinja__lex_err(const char *src, size_t len, size_t off, char *err, const char *fmt, ...)
{
    int line = 1;
    size_t bol = 0;
    for (size_t i = 0; i < off && i < len; i++)
        if (src[i] == '\n') {
            line++;
            bol = i + 1;
        }
    size_t col = 1 + jinja__u8_count(src + bol, (off < len ? off : len) - bol);
    char msg[PD_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return pd_errf(err, PD_EFORMAT, "line %d column %zu: %s", line, col, msg);
}

static int push_tok(lx *l, jtok t)
{
    jlexed *o = l->out;
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 256;
        jtok *v = realloc(o->toks, cap * sizeof *v);
        if (!v) return PD_ENOMEM;
        o->toks = v;
        o->cap = cap;
    }
    t.line = line_of(l, t.off);
    o->toks[o->n++] = t;
    return 0;
}

/* Python's \s at i (one code point); its length in *n, or false. */
static bool space_at(const char *s, size_t len, size_t i, size_t *n)
{
    size_t j = i;
    uint32_t cp = jinja__u8_next(s, len, &j);
    *n = j - i;
    return jinja__is_space(cp);
}

static size_t skip_space(const char *s, size_t len, size_t i)
{
    size_t n;
    while (i < len && space_at(s, len, i, &n)) i += n;
    return i;
}

/* End of [a, b) without its trailing whitespace (Python's rstrip). */
static size_t rstrip_end(const char *s, size_t a, size_t b)
{
    size_t end = a, i = a, n;
    while (i < b) {
        if (!space_at(s, b, i, &n)) end = i + n;
        i += n;
    }
    return end;
}

/* Emits the text [a, b) before a tag, applying the tag's modifier: '-' strips all whitespace
 * before the tag; otherwise lstrip_blocks (block and comment tags, not '+') strips the
 * whitespace between the last line start and the tag. */
static int emit_text(lx *l, size_t a, size_t b, char sign, bool lstrip_ok)
{
    if (sign == '-') {
        b = rstrip_end(l->s, a, b);
    } else if (sign != '+' && lstrip_ok && l->pp->lstrip_blocks) {
        size_t lpos = a;
        bool nl = false;
        for (size_t i = b; i > a; i--)
            if (l->s[i - 1] == '\n') {
                lpos = i;
                nl = true;
                break;
            }
        if ((nl || l->line_starting) && lpos < b && skip_space(l->s, b, lpos) == b) b = lpos;
    }
    if (b > a) return push_tok(l, (jtok){.type = TK_DATA, .off = a, .s = l->s + a, .len = b - a});
    return 0;
}

/* A block end at i ("+%}", "-%}" + whitespace, "%}" + one newline under trim_blocks): returns
 * the position after it, or 0 when there is none. */
static size_t block_end_at(lx *l, size_t i, char close, bool trim)
{
    const char *s = l->s;
    size_t len = l->len;
    if (i + 2 < len + 0 && (s[i] == '+' || s[i] == '-') && s[i + 1] == close && s[i + 2] == '}') {
        if (s[i] == '+') return i + 3;
        return skip_space(s, len, i + 3);
    }
    if (i + 1 < len && s[i] == close && s[i + 1] == '}') {
        i += 2;
        if (trim && i < len && s[i] == '\n') i++;
        return i;
    }
    return 0;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_name_start(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c >= 0x80;
}
static bool is_name_char(unsigned char c) { return is_name_start(c) || is_digit((char)c); }

/* (\d+_)*\d+ at i: returns the end, or i when there are no digits. */
static size_t digits(const char *s, size_t len, size_t i)
{
    size_t j = i;
    while (j < len && is_digit(s[j])) {
        while (j < len && is_digit(s[j])) j++;
        if (j + 1 < len && s[j] == '_' && is_digit(s[j + 1])) j++;
    }
    return j;
}

/* float_re: digits ((\.digits)? e[+-]?digits | \.digits), not preceded by '.' */
static size_t float_at(const char *s, size_t len, size_t i)
{
    if (i > 0 && s[i - 1] == '.') return 0;
    size_t j = digits(s, len, i);
    if (j == i) return 0;
    size_t k = j;
    if (k + 1 < len && s[k] == '.' && is_digit(s[k + 1])) k = digits(s, len, k + 1);
    if (k < len && (s[k] == 'e' || s[k] == 'E')) {
        size_t e = k + 1;
        if (e < len && (s[e] == '+' || s[e] == '-')) e++;
        size_t f = digits(s, len, e);
        if (f > e) return f;
    }
    return k > j ? k : 0;
}

static int lex_number(lx *l, size_t i, size_t *next)
{
    const char *s = l->s;
    char buf[128];
    size_t n = 0, end = float_at(s, l->len, i);
    if (end) {
        for (size_t k = i; k < end && n + 1 < sizeof buf; k++)
            if (s[k] != '_') buf[n++] = s[k];
        buf[n] = 0;
        *next = end;
        return push_tok(l, (jtok){.type = TK_FLOAT, .off = i, .f = strtod(buf, NULL)});
    }
    int base = 10;
    size_t j = i;
    if (s[i] == '0' && i + 1 < l->len) {
        char c = (char)(s[i + 1] | 32);
        base = c == 'b' ? 2 : c == 'o' ? 8 : c == 'x' ? 16 : 10;
    }
    uint64_t v = 0;
    bool over = false, any = false;
    if (base != 10) {
        j = i + 2;
        for (;;) {
            size_t k = j;
            if (k < l->len && s[k] == '_') k++;
            int d = -1;
            if (k < l->len) {
                char c = (char)(s[k] | 32);
                d = is_digit(s[k]) ? s[k] - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
            }
            if (d < 0 || d >= base) break;
            over |= v > (UINT64_MAX - (uint64_t)d) / (uint64_t)base;
            v = v * (uint64_t)base + (uint64_t)d;
            any = true;
            j = k + 1;
        }
        if (!any) { /* "0x" without digits: the integer 0, then a name */
            base = 10;
            j = i;
        }
    }
    if (base == 10) {
        if (s[i] == '0') { /* 0(_?0)* */
            j = i + 1;
            while (j < l->len && (s[j] == '0' || (s[j] == '_' && j + 1 < l->len && s[j + 1] == '0')))
                j += s[j] == '_' ? 2 : 1;
        } else {
            j = digits(s, l->len, i);
            for (size_t k = i; k < j; k++) {
                if (s[k] == '_') continue;
                over |= v > (UINT64_MAX - 9) / 10;
                v = v * 10 + (uint64_t)(s[k] - '0');
            }
        }
    }
    if (over || v > (uint64_t)INT64_MAX)
        return jinja__lex_err(s, l->len, i, l->out->err, "integer literal too large");
    *next = j;
    return push_tok(l, (jtok){.type = TK_INT, .off = i, .i = (int64_t)v});
}

static int hexval(char c)
{
    if (is_digit(c)) return c - '0';
    c = (char)(c | 32);
    return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* A Python string literal at i (quote q) decoded as "unicode-escape" does. */
static int lex_string(lx *l, size_t i, size_t *next)
{
    const char *s = l->s;
    char q = s[i];
    size_t j = i + 1;
    while (j < l->len && s[j] != q) j += s[j] == '\\' ? 2 : 1;
    if (j >= l->len) return jinja__lex_err(s, l->len, i, l->out->err, "unexpected char '%c'", q);
    char *buf = malloc(j - i + 1);
    if (!buf) return PD_ENOMEM;
    size_t n = 0;
    for (size_t k = i + 1; k < j;) {
        if (s[k] != '\\') {
            buf[n++] = s[k++];
            continue;
        }
        char c = s[k + 1];
        k += 2;
        uint32_t cp;
        int digits_n = 0;
        switch (c) {
        case '\n': continue;
        case '\\': buf[n++] = '\\'; continue;
        case '\'': buf[n++] = '\''; continue;
        case '"': buf[n++] = '"'; continue;
        case 'a': buf[n++] = '\a'; continue;
        case 'b': buf[n++] = '\b'; continue;
        case 'f': buf[n++] = '\f'; continue;
        case 'n': buf[n++] = '\n'; continue;
        case 'r': buf[n++] = '\r'; continue;
        case 't': buf[n++] = '\t'; continue;
        case 'v': buf[n++] = '\v'; continue;
        case 'x': digits_n = 2; break;
        case 'u': digits_n = 4; break;
        case 'U': digits_n = 8; break;
        default:
            if (c >= '0' && c <= '7') {
                cp = (uint32_t)(c - '0');
                for (int d = 0; d < 2 && k < j && s[k] >= '0' && s[k] <= '7'; d++)
                    cp = cp * 8 + (uint32_t)(s[k++] - '0');
                n += jinja__u8_put(buf + n, cp);
                continue;
            }
            buf[n++] = '\\';
            k--; /* unknown escape: kept as written */
            continue;
        }
        cp = 0;
        for (int d = 0; d < digits_n; d++) {
            int h = k < j ? hexval(s[k]) : -1;
            if (h < 0) {
                free(buf);
                return jinja__lex_err(s, l->len, i, l->out->err, "truncated \\%c escape", c);
            }
            cp = cp * 16 + (uint32_t)h;
            k++;
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
            free(buf);
            return jinja__lex_err(s, l->len, i, l->out->err,
                                  "string escape of U+%X is not a character", cp);
        }
        n += jinja__u8_put(buf + n, cp);
    }
    jstr *str = jinja__arena_str(l->out->arena, buf, n);
    free(buf);
    if (!str) return PD_ENOMEM;
    *next = j + 1;
    return push_tok(l, (jtok){.type = TK_STRING, .off = i, .s = str->s, .len = n, .str = str});
}

static const struct {
    const char *s;
    uint8_t op;
} ops2[] = {{"//", JOP_FLOORDIV}, {"**", JOP_POW}, {"==", JOP_EQ},
            {"!=", JOP_NE},       {"<=", JOP_LE},  {">=", JOP_GE}};
static const char ops1_chars[] = "+-/*%~[](){}=.:|,;<>";
static const uint8_t ops1[] = {JOP_ADD,      JOP_SUB,      JOP_DIV,    JOP_MUL,      JOP_MOD,
                               JOP_TILDE,    JOP_LBRACKET, JOP_RBRACKET, JOP_LPAREN, JOP_RPAREN,
                               JOP_LBRACE,   JOP_RBRACE,   JOP_ASSIGN, JOP_DOT,      JOP_COLON,
                               JOP_PIPE,     JOP_COMMA,    JOP_SEMICOLON, JOP_LT,    JOP_GT};

/* Tokens of a {% %} or {{ }} tag from i up to its end; returns the position after the end. */
static int lex_tag(lx *l, size_t i, char close, size_t *next)
{
    const char *s = l->s;
    int rc;
    l->depth = 0;
    for (;;) {
        if (i >= l->len)
            return jinja__lex_err(s, l->len, i, l->out->err,
                                  "unexpected end of template: the tag is not closed");
        if (l->depth == 0) {
            size_t e = block_end_at(l, i, close, close == '%' && l->pp->trim_blocks);
            if (close == '}' && e && s[i] == '+') e = 0; /* no "+}}" */
            if (e) {
                if ((rc = push_tok(l, (jtok){.type = close == '%' ? TK_BLOCK_END : TK_VAR_END,
                                             .off = i})))
                    return rc;
                l->line_starting = s[e - 1] == '\n';
                *next = e;
                return 0;
            }
        }
        size_t n;
        if (space_at(s, l->len, i, &n)) {
            i = skip_space(s, l->len, i);
            continue;
        }
        unsigned char c = (unsigned char)s[i];
        if (is_digit((char)c)) {
            if ((rc = lex_number(l, i, &i))) return rc;
            continue;
        }
        if (is_name_start(c)) {
            size_t j = i;
            while (j < l->len && is_name_char((unsigned char)s[j])) j++;
            if ((rc = push_tok(l, (jtok){.type = TK_NAME, .off = i, .s = s + i, .len = j - i})))
                return rc;
            i = j;
            continue;
        }
        if (c == '\'' || c == '"') {
            if ((rc = lex_string(l, i, &i))) return rc;
            continue;
        }
        uint8_t op = 0;
        size_t oplen = 2;
        for (size_t k = 0; k < sizeof ops2 / sizeof ops2[0] && i + 1 < l->len; k++)
            if (s[i] == ops2[k].s[0] && s[i + 1] == ops2[k].s[1]) op = ops2[k].op;
        if (!op) {
            const char *p = c ? strchr(ops1_chars, c) : NULL;
            if (!p) {
                size_t clen = i;
                jinja__u8_next(s, l->len, &clen);
                return jinja__lex_err(s, l->len, i, l->out->err, "unexpected char '%.*s'",
                                      (int)(clen - i), s + i);
            }
            op = ops1[p - ops1_chars];
            oplen = 1;
        }
        if (op == JOP_LBRACE || op == JOP_LPAREN || op == JOP_LBRACKET) {
            if (l->depth == (int)sizeof l->stack)
                return jinja__lex_err(s, l->len, i, l->out->err, "brackets nested too deeply");
            l->stack[l->depth++] = op == JOP_LBRACE ? '}' : op == JOP_LPAREN ? ')' : ']';
        } else if (op == JOP_RBRACE || op == JOP_RPAREN || op == JOP_RBRACKET) {
            if (l->depth == 0)
                return jinja__lex_err(s, l->len, i, l->out->err, "unexpected '%c'", c);
            char want = l->stack[--l->depth];
            if (want != (char)c)
                return jinja__lex_err(s, l->len, i, l->out->err, "unexpected '%c', expected '%c'",
                                      c, want);
        }
        if ((rc = push_tok(l, (jtok){.type = TK_OP, .op = op, .off = i}))) return rc;
        i += oplen;
    }
}

/* "{%" [-+]? \s* "raw" \s* ("-%}" \s* | "%}") at i: the end, or 0. */
static size_t raw_begin_at(lx *l, size_t i)
{
    const char *s = l->s;
    size_t j = i + 2;
    if (j < l->len && (s[j] == '-' || s[j] == '+')) j++;
    j = skip_space(s, l->len, j);
    if (j + 3 > l->len || memcmp(s + j, "raw", 3) != 0) return 0;
    j = skip_space(s, l->len, j + 3);
    if (j + 2 < l->len && s[j] == '-' && s[j + 1] == '%' && s[j + 2] == '}')
        return skip_space(s, l->len, j + 3);
    if (j + 1 < l->len && s[j] == '%' && s[j + 1] == '}') return j + 2;
    return 0;
}

/* The raw block's body from i: text up to "{%" [-+]? \s* "endraw" \s* (tag end). */
static int lex_raw(lx *l, size_t i, size_t *next)
{
    const char *s = l->s;
    for (size_t k = i; k + 1 < l->len; k++) {
        if (s[k] != '{' || s[k + 1] != '%') continue;
        size_t j = k + 2;
        char sign = 0;
        if (j < l->len && (s[j] == '-' || s[j] == '+')) sign = s[j++];
        j = skip_space(s, l->len, j);
        if (j + 6 > l->len || memcmp(s + j, "endraw", 6) != 0) continue;
        j = skip_space(s, l->len, j + 6);
        size_t e = block_end_at(l, j, '%', l->pp->trim_blocks);
        if (!e) continue;
        int rc = emit_text(l, i, k, sign, true);
        if (rc) return rc;
        l->line_starting = s[e - 1] == '\n';
        *next = e;
        return 0;
    }
    return jinja__lex_err(s, l->len, i, l->out->err, "missing end of raw directive");
}

int jinja__lex(const char *src, size_t len, const jinja_parse_params *pp, jarena_chunk **arena,
               char *err, jlexed *out)
{
    memset(out, 0, sizeof *out);
    out->arena = arena;
    out->err = err;
    /* newlines: \r\n and \r become \n; a single trailing newline goes unless kept */
    char *s = malloc(len + 1);
    if (!s) return PD_ENOMEM;
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (!pp->keep_trailing_newline && n > 0 && s[n - 1] == '\n') n--;
    s[n] = 0;
    out->src = s;
    out->len = n;
    lx l = {.out = out, .pp = pp, .s = s, .len = n, .line = 1, .line_starting = true};
    size_t pos = 0;
    int rc = 0;
    while (pos < n) {
        size_t q = pos;
        while (q + 1 < n && !(s[q] == '{' && (s[q + 1] == '{' || s[q + 1] == '%' || s[q + 1] == '#')))
            q++;
        if (q + 1 >= n) { /* the rest is text */
            if ((rc = push_tok(&l, (jtok){.type = TK_DATA, .off = pos, .s = s + pos, .len = n - pos})))
                return rc;
            break;
        }
        char kind = s[q + 1];
        char sign = q + 2 < n && (s[q + 2] == '-' || s[q + 2] == '+') ? s[q + 2] : 0;
        size_t raw_end = kind == '%' ? raw_begin_at(&l, q) : 0;
        if ((rc = emit_text(&l, pos, q, sign, kind != '{'))) return rc;
        size_t body = q + 2 + (sign ? 1 : 0);
        if (raw_end) {
            if ((rc = lex_raw(&l, raw_end, &pos))) return rc;
        } else if (kind == '#') {
            size_t e = body;
            while (e + 1 < n && !(s[e] == '#' && s[e + 1] == '}')) e++;
            if (e + 1 >= n)
                return jinja__lex_err(s, n, q, out->err, "missing end of comment tag");
            char esign = e > body && (s[e - 1] == '-' || s[e - 1] == '+') ? s[e - 1] : 0;
            size_t end = e + 2;
            if (esign == '-') end = skip_space(s, n, end);
            else if (!esign && pp->trim_blocks && end < n && s[end] == '\n') end++;
            l.line_starting = s[end - 1] == '\n';
            pos = end;
        } else {
            uint8_t t = kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN;
            if ((rc = push_tok(&l, (jtok){.type = t, .off = q}))) return rc;
            if ((rc = lex_tag(&l, body, kind == '%' ? '%' : '}', &pos))) return rc;
        }
    }
    return push_tok(&l, (jtok){.type = TK_EOF, .off = n});
}

void jinja__lexed_free(jlexed *t)
{
    free(t->toks);
    free(t->src);
    t->toks = NULL;
    t->src = NULL;
}
