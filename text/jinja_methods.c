/* jinja_methods.c -- What templates call: the global functions (range, namespace, dict,
 * raise_exception, strftime_now), the methods of str, dict, list and loop objects that
 * jinja2's immutable sandbox allows (its mutating methods are refused as it refuses them),
 * Python's printf-style formatting, and argument binding for all builtins. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "text/jinja_impl.h"

const char jinja__missing[] = "";

int jinja__bind(jx *x, const char *fname, const jargs *a, const char *const *params, int np,
                jv *slots)
{
    for (int i = 0; i < np; i++) slots[i] = jv_undef(jinja__missing);
    if (a->npos > np)
        return jinja__fail(x, PD_EINVAL, "%s() takes at most %d argument(s) (%d given)", fname,
                           np, a->npos);
    for (int i = 0; i < a->npos; i++) slots[i] = a->pos[i];
    for (int k = 0; k < a->nkw; k++) {
        int i = 0;
        while (i < np && strcmp(params[i], a->kwn[k]->s) != 0) i++;
        if (i == np)
            return jinja__fail(x, PD_EINVAL, "%s() got an unexpected keyword argument '%s'", fname,
                               a->kwn[k]->s);
        if (!JARG_MISSING(slots[i]))
            return jinja__fail(x, PD_EINVAL, "%s() got multiple values for argument '%s'", fname,
                               params[i]);
        slots[i] = a->kwv[k];
    }
    return 0;
}

static int need_str(jx *x, const char *what, jv v)
{
    if (v.t == JV_STR) return 0;
    if (v.t == JV_UNDEF && !JARG_MISSING(v) && v.u.hint)
        return jinja__fail(x, PD_EINVAL, "'%s' is undefined", v.u.hint);
    return jinja__fail(x, PD_EINVAL, "%s must be str, not %s", what, jinja__type_name(v));
}

static int need_int(jx *x, const char *what, jv v, int64_t *i)
{
    *i = 0;
    if (v.t == JV_INT) *i = v.u.i;
    else if (v.t == JV_BOOL) *i = v.u.b;
    else
        return jinja__fail(x, PD_EINVAL, "%s must be an integer, not %s", what,
                           jinja__type_name(v));
    return 0;
}

/* ---- string helpers ---- */
static int str_out(jx *x, jbuf *b, int rc, jv *out)
{
    if (rc) {
        jinja__buf_free(x, b);
        return rc;
    }
    return jinja__str_from_buf(x, b, out);
}

static int put_cp(jx *x, jbuf *b, uint32_t cp)
{
    char u[4];
    return jinja__buf_put(x, b, u, jinja__u8_put(u, cp));
}

int jinja__str_case(jx *x, const jstr *s, int mode, jv *out)
{
    jbuf b = {0};
    int rc = 0;
    bool first = true, prev_cased = false, word_start = true;
    for (size_t i = 0; i < s->len && !rc;) {
        uint32_t cp = jinja__u8_next(s->s, s->len, &i), r = cp;
        switch (mode) {
        case JCASE_UPPER: r = jinja__cp_upper(cp); break;
        case JCASE_LOWER: r = jinja__cp_lower(cp); break;
        case JCASE_CAPITALIZE: r = first ? jinja__cp_title(cp) : jinja__cp_lower(cp); break;
        case JCASE_TITLE: /* str.title(): a cased letter after an uncased character starts a word */
            r = prev_cased ? jinja__cp_lower(cp) : jinja__cp_title(cp);
            prev_cased = jinja__cp_is_cased(cp);
            break;
        case JCASE_JINJA_TITLE: /* jinja2's title filter: words start after [-\s({[<] */
            r = word_start ? jinja__cp_upper(cp) : jinja__cp_lower(cp);
            word_start = cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' ||
                         jinja__is_space(cp);
            break;
        case JCASE_SWAP:
            r = jinja__cp_is_upper(cp) ? jinja__cp_lower(cp) : jinja__cp_is_lower(cp) ? jinja__cp_upper(cp) : cp;
            break;
        }
        first = false;
        rc = put_cp(x, &b, r);
    }
    return str_out(x, &b, rc, out);
}

static bool in_chars(const jstr *chars, uint32_t cp)
{
    if (!chars) return jinja__is_space(cp);
    for (size_t i = 0; i < chars->len;)
        if (jinja__u8_next(chars->s, chars->len, &i) == cp) return true;
    return false;
}

int jinja__str_strip(jx *x, const jstr *s, const jstr *chars, int mode, jv *out)
{
    size_t a = 0, b = s->len;
    if (mode & 1)
        while (a < b) {
            size_t j = a;
            if (!in_chars(chars, jinja__u8_next(s->s, b, &j))) break;
            a = j;
        }
    if (mode & 2)
        while (b > a) { /* back over the last code point */
            size_t st = b - 1;
            while (st > a && ((unsigned char)s->s[st] & 0xC0) == 0x80) st--;
            size_t j = st;
            uint32_t cp = jinja__u8_next(s->s, b, &j);
            if (j != b || !in_chars(chars, cp)) break; /* (a stray byte ends the strip too) */
            b = st;
        }
    if (a == 0 && b == s->len) {
        *out = (jv){.t = JV_STR};
        out->u.s = (jstr *)s;
        jinja__incref(*out);
        return 0;
    }
    return jinja__str_new(x, s->s + a, b - a, out);
}

int jinja__str_replace(jx *x, const jstr *s, const jstr *old, const jstr *rep, int64_t count,
                       jv *out)
{
    jbuf b = {0};
    int rc = 0;
    if (count < 0) count = INT64_MAX;
    if (old->len == 0) { /* Python inserts rep before every character and at the end */
        size_t i = 0;
        int64_t done = 0;
        while (!rc && done < count) {
            rc = jinja__buf_put(x, &b, rep->s, rep->len);
            done++;
            if (i >= s->len) break;
            size_t j = i;
            jinja__u8_next(s->s, s->len, &j);
            if (!rc) rc = jinja__buf_put(x, &b, s->s + i, j - i);
            i = j;
        }
        if (!rc) rc = jinja__buf_put(x, &b, s->s + i, s->len - i);
        return str_out(x, &b, rc, out);
    }
    size_t i = 0;
    for (int64_t done = 0; done < count && !rc; done++) {
        const char *hit = memmem(s->s + i, s->len - i, old->s, old->len);
        if (!hit) break;
        size_t at = (size_t)(hit - s->s);
        rc = jinja__buf_put(x, &b, s->s + i, at - i);
        if (!rc) rc = jinja__buf_put(x, &b, rep->s, rep->len);
        i = at + old->len;
    }
    if (!rc) rc = jinja__buf_put(x, &b, s->s + i, s->len - i);
    return str_out(x, &b, rc, out);
}

static size_t cp_index(const jstr *s, size_t byte_off) { return jinja__u8_count(s->s, byte_off); }

/* [start, end) of a str method's optional start/end arguments, as byte offsets */
static int str_range(jx *x, const jstr *s, jv st, jv en, size_t *a, size_t *b)
{
    int64_t n = (int64_t)s->ncp, i = 0, j = n;
    if (!JARG_MISSING(st) && st.t != JV_NONE && need_int(x, "start", st, &i)) return PD_EINVAL;
    if (!JARG_MISSING(en) && en.t != JV_NONE && need_int(x, "end", en, &j)) return PD_EINVAL;
    if (i < 0) i = i + n < 0 ? 0 : i + n;
    if (j < 0) j = j + n < 0 ? 0 : j + n;
    if (i > n) i = n + 1; /* an empty range past the end */
    if (j > n) j = n;
    *a = i > n ? s->len + 1 : jinja__u8_offset(s, (size_t)i);
    *b = jinja__u8_offset(s, (size_t)j);
    return 0;
}

static bool affix_at(const jstr *s, size_t a, size_t b, const jstr *p, bool end)
{
    if (a > b || b - a < p->len) return false;
    return memcmp(s->s + (end ? b - p->len : a), p->s, p->len) == 0;
}

static int m_affix(jx *x, const jstr *s, const jargs *args, bool end, jv *out)
{
    static const char *const ps[] = {"prefix", "start", "end"};
    jv a[3];
    int rc = jinja__bind(x, end ? "endswith" : "startswith", args, ps, 3, a);
    if (rc) return rc;
    size_t lo, hi;
    if ((rc = str_range(x, s, a[1], a[2], &lo, &hi))) return rc;
    bool r = false;
    if (a[0].t == JV_LIST && a[0].u.l->kind == JL_TUPLE) {
        for (size_t i = 0; i < a[0].u.l->n && !r; i++) {
            jv p = a[0].u.l->v[i];
            if ((rc = need_str(x, "a tuple item", p))) return rc;
            r = affix_at(s, lo, hi, p.u.s, end);
        }
    } else {
        if (a[0].t != JV_STR)
            return jinja__fail(x, PD_EINVAL, "%s first arg must be str or a tuple of str, not %s",
                               end ? "endswith" : "startswith", jinja__type_name(a[0]));
        r = affix_at(s, lo, hi, a[0].u.s, end);
    }
    *out = jv_bool(r);
    return 0;
}

static int push_str(jx *x, jlist *l, const char *s, size_t n)
{
    jv v;
    int rc = jinja__str_new(x, s, n, &v);
    return rc ? rc : jinja__list_push(x, l, v);
}

/* str.split / str.rsplit */
static int m_split(jx *x, const jstr *s, const jargs *args, bool right, jv *out)
{
    static const char *const ps[] = {"sep", "maxsplit"};
    jv a[2];
    int64_t max = -1;
    int rc = jinja__bind(x, right ? "rsplit" : "split", args, ps, 2, a);
    if (rc || (!JARG_MISSING(a[1]) && (rc = need_int(x, "maxsplit", a[1], &max)))) return rc;
    if (max < 0) max = INT64_MAX;
    bool ws = JARG_MISSING(a[0]) || a[0].t == JV_NONE;
    if (!ws && (rc = need_str(x, "sep", a[0]))) return rc;
    if (!ws && a[0].u.s->len == 0) return jinja__fail(x, PD_EINVAL, "empty separator");
    if ((rc = jinja__list_new(x, JL_LIST, 0, out))) return rc;
    jlist *l = out->u.l;
    /* pieces as byte ranges; for rsplit collected from the right, then reversed */
    const char *p = s->s;
    size_t n = s->len;
    int64_t splits = 0;
    if (!ws) {
        const jstr *sep = a[0].u.s;
        if (!right) {
            size_t i = 0;
            for (;;) {
                const char *hit = splits < max ? memmem(p + i, n - i, sep->s, sep->len) : NULL;
                if (!hit) {
                    rc = push_str(x, l, p + i, n - i);
                    break;
                }
                if ((rc = push_str(x, l, p + i, (size_t)(hit - p) - i))) break;
                i = (size_t)(hit - p) + sep->len;
                splits++;
            }
        } else {
            size_t end = n;
            for (;;) {
                const char *hit = NULL;
                if (splits < max && end >= sep->len)
                    for (size_t k = end - sep->len + 1; k-- > 0;)
                        if (memcmp(p + k, sep->s, sep->len) == 0) {
                            hit = p + k;
                            break;
                        }
                if (!hit) {
                    rc = push_str(x, l, p, end);
                    break;
                }
                size_t at = (size_t)(hit - p);
                if ((rc = push_str(x, l, p + at + sep->len, end - at - sep->len))) break;
                end = at;
                splits++;
            }
        }
    } else if (!right) {
        size_t i = 0;
        while (!rc) {
            while (i < n) { /* skip whitespace */
                size_t j = i;
                if (!jinja__is_space(jinja__u8_next(p, n, &j))) break;
                i = j;
            }
            if (i >= n) break;
            if (splits >= max) { /* the rest as it is */
                rc = push_str(x, l, p + i, n - i);
                break;
            }
            size_t j = i;
            while (j < n) {
                size_t k = j;
                if (jinja__is_space(jinja__u8_next(p, n, &k))) break;
                j = k;
            }
            rc = push_str(x, l, p + i, j - i);
            splits++;
            i = j;
        }
    } else {
        /* rsplit on whitespace: split the code points from the right */
        size_t *offs = jinja__alloc(x, (s->ncp + 1) * sizeof *offs);
        if (!offs) rc = PD_EINVAL;
        size_t m = 0;
        for (size_t i = 0; !rc && i < n;) {
            offs[m++] = i;
            jinja__u8_next(p, n, &i);
        }
        if (!rc) offs[m] = n;
        int64_t k = (int64_t)m; /* code point index: pieces end here */
        while (!rc) {
            while (k > 0) {
                size_t t = offs[k - 1];
                if (!jinja__is_space(jinja__u8_next(p, n, &t))) break;
                k--;
            }
            if (k == 0) break;
            int64_t e = k;
            if (splits >= max) { /* the rest as it is */
                rc = push_str(x, l, p, offs[e]);
                break;
            }
            while (k > 0) {
                size_t t = offs[k - 1];
                if (jinja__is_space(jinja__u8_next(p, n, &t))) break;
                k--;
            }
            rc = push_str(x, l, p + offs[k], offs[e] - offs[k]);
            splits++;
        }
        if (offs) jinja__free(x, offs, (s->ncp + 1) * sizeof *offs);
    }
    if (!rc && right) /* collected right to left */
        for (size_t i = 0; i < l->n / 2; i++) {
            jv t = l->v[i];
            l->v[i] = l->v[l->n - 1 - i];
            l->v[l->n - 1 - i] = t;
        }
    if (rc) jinja__decref(x, *out);
    return rc;
}

static bool line_break(uint32_t cp)
{
    return cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || cp == 0x1C || cp == 0x1D ||
           cp == 0x1E || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
}

int jinja__splitlines(jx *x, const jstr *s, bool keepends, jv *out)
{
    int rc = jinja__list_new(x, JL_LIST, 0, out);
    size_t start = 0, i = 0;
    while (!rc && i < s->len) {
        size_t j = i;
        uint32_t cp = jinja__u8_next(s->s, s->len, &j);
        if (!line_break(cp)) {
            i = j;
            continue;
        }
        if (cp == '\r' && j < s->len && s->s[j] == '\n') j++;
        rc = push_str(x, out->u.l, s->s + start, (keepends ? j : i) - start);
        start = i = j;
    }
    if (!rc && start < s->len) rc = push_str(x, out->u.l, s->s + start, s->len - start);
    if (rc && out->t == JV_LIST) jinja__decref(x, *out);
    return rc;
}

/* find / rfind / index / rindex / count */
static int m_find(jx *x, const jstr *s, const jargs *args, int kind, jv *out)
{
    static const char *const ps[] = {"sub", "start", "end"};
    static const char *const names[] = {"find", "rfind", "index", "rindex", "count"};
    jv a[3];
    int rc = jinja__bind(x, names[kind], args, ps, 3, a);
    if (rc || (rc = need_str(x, "the substring", a[0]))) return rc;
    size_t lo, hi;
    if ((rc = str_range(x, s, a[1], a[2], &lo, &hi))) return rc;
    const jstr *sub = a[0].u.s;
    if (kind == 4) {
        int64_t c = 0;
        if (lo <= hi) {
            if (!sub->len) {
                c = (int64_t)jinja__u8_count(s->s + lo, hi - lo) + 1;
            } else {
                for (size_t i = lo; hi - i >= sub->len;) {
                    const char *h = memmem(s->s + i, hi - i, sub->s, sub->len);
                    if (!h) break;
                    c++;
                    i = (size_t)(h - s->s) + sub->len;
                    if (i > hi) break;
                }
            }
        }
        *out = jv_int(c);
        return 0;
    }
    int64_t at = -1;
    if (lo <= hi && hi - lo >= sub->len) {
        if (kind == 0 || kind == 2) {
            const char *h = sub->len ? memmem(s->s + lo, hi - lo, sub->s, sub->len) : s->s + lo;
            if (h) at = (int64_t)cp_index(s, (size_t)(h - s->s));
        } else {
            for (size_t k = hi - sub->len + 1; k-- > lo;)
                if (memcmp(s->s + k, sub->s, sub->len) == 0) {
                    at = (int64_t)cp_index(s, k);
                    break;
                }
        }
    }
    if (at < 0 && kind >= 2) return jinja__fail(x, PD_EINVAL, "substring not found");
    *out = jv_int(at);
    return 0;
}

static int m_join(jx *x, const jstr *sep, jv items, jv *out)
{
    jlist *l;
    int rc = jinja__iter_list(x, items, &l);
    if (rc) return rc;
    jbuf b = {0};
    for (size_t i = 0; i < l->n && !rc; i++) {
        if (l->v[i].t != JV_STR) {
            rc = jinja__fail(x, PD_EINVAL, "sequence item %zu: expected str instance, %s found", i,
                             jinja__type_name(l->v[i]));
            break;
        }
        if (i) rc = jinja__buf_put(x, &b, sep->s, sep->len);
        if (!rc) rc = jinja__buf_put(x, &b, l->v[i].u.s->s, l->v[i].u.s->len);
    }
    jv lv = {.t = JV_LIST};
    lv.u.l = l;
    jinja__decref(x, lv);
    return str_out(x, &b, rc, out);
}

/* str.format: {} {0} {name} and {{ }}; no conversions beyond !s / !r, no format specs */
static int m_format(jx *x, const jstr *s, const jargs *a, jv *out)
{
    jbuf b = {0};
    int rc = 0, auto_i = 0;
    for (size_t i = 0; i < s->len && !rc;) {
        char c = s->s[i];
        if ((c == '{' || c == '}') && i + 1 < s->len && s->s[i + 1] == c) {
            rc = jinja__buf_put(x, &b, &c, 1);
            i += 2;
            continue;
        }
        if (c == '}') {
            rc = jinja__fail(x, PD_EINVAL, "Single '}' encountered in format string");
            break;
        }
        if (c != '{') {
            rc = jinja__buf_put(x, &b, &c, 1);
            i++;
            continue;
        }
        const char *close = memchr(s->s + i, '}', s->len - i);
        if (!close) {
            rc = jinja__fail(x, PD_EINVAL, "Single '{' encountered in format string");
            break;
        }
        const char *f = s->s + i + 1;
        size_t flen = (size_t)(close - f), nlen = flen;
        bool as_repr = false;
        const char *bang = memchr(f, '!', flen), *colon = memchr(f, ':', flen);
        if (colon || memchr(f, '.', flen) || memchr(f, '[', flen)) {
            rc = jinja__fail(x, PD_EINVAL, "str.format field '%.*s' is not supported", (int)flen, f);
            break;
        }
        if (bang) {
            nlen = (size_t)(bang - f);
            as_repr = bang + 1 < close && bang[1] == 'r';
        }
        const jv *v = NULL;
        if (nlen == 0) {
            if (auto_i < a->npos) v = &a->pos[auto_i++];
        } else if (f[0] >= '0' && f[0] <= '9') {
            int k = atoi(f);
            if (k < a->npos) v = &a->pos[k];
        } else {
            for (int k = 0; k < a->nkw; k++)
                if (a->kwn[k]->len == nlen && memcmp(a->kwn[k]->s, f, nlen) == 0) v = &a->kwv[k];
        }
        if (!v) {
            rc = jinja__fail(x, PD_EINVAL, "str.format: no argument for field '%.*s'", (int)flen, f);
            break;
        }
        rc = as_repr ? jinja__put_repr(x, &b, *v, 0) : jinja__put_str(x, &b, *v);
        i = (size_t)(close - s->s) + 1;
    }
    return str_out(x, &b, rc, out);
}

static int m_pad(jx *x, const jstr *s, const jargs *args, int mode, jv *out)
{
    static const char *const ps[] = {"width", "fillchar"};
    jv a[2];
    int64_t w;
    int rc = jinja__bind(x, mode == 3 ? "zfill" : "pad", args, ps, mode == 3 ? 1 : 2, a);
    if (rc) return rc;
    if (JARG_MISSING(a[0])) return jinja__fail(x, PD_EINVAL, "a width argument is required");
    if ((rc = need_int(x, "width", a[0], &w))) return rc;
    uint32_t fill = mode == 3 ? '0' : ' ';
    if (mode != 3 && !JARG_MISSING(a[1])) {
        if ((rc = need_str(x, "fillchar", a[1]))) return rc;
        if (a[1].u.s->ncp != 1)
            return jinja__fail(x, PD_EINVAL, "The fill character must be exactly one character long");
        size_t k = 0;
        fill = jinja__u8_next(a[1].u.s->s, a[1].u.s->len, &k);
    }
    if (w > (int64_t)x->max_out) w = (int64_t)x->max_out + 1;
    int64_t pad = w - (int64_t)s->ncp, left = 0;
    if (pad < 0) pad = 0;
    if (mode == 0) left = pad / 2 + (pad & w & 1); /* center */
    else if (mode == 1) left = 0;                  /* ljust */
    else left = pad;                               /* rjust, zfill */
    jbuf b = {0};
    size_t start = 0;
    if (mode == 3 && s->len && (s->s[0] == '+' || s->s[0] == '-')) { /* the sign stays first */
        rc = jinja__buf_put(x, &b, s->s, 1);
        start = 1;
    }
    for (int64_t i = 0; i < left && !rc; i++) rc = put_cp(x, &b, fill);
    if (!rc) rc = jinja__buf_put(x, &b, s->s + start, s->len - start);
    for (int64_t i = left; i < pad && !rc; i++) rc = put_cp(x, &b, fill);
    return str_out(x, &b, rc, out);
}

/* ---- method table ---- */
enum {
    M_STARTSWITH, M_ENDSWITH, M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_RSPLIT, M_SPLITLINES,
    M_REPLACE, M_UPPER, M_LOWER, M_TITLE, M_CAPITALIZE, M_CASEFOLD, M_SWAPCASE, M_FIND, M_RFIND,
    M_INDEX, M_RINDEX, M_COUNT, M_JOIN, M_FORMAT, M_ISDIGIT, M_ISALPHA, M_ISALNUM, M_ISSPACE,
    M_ISUPPER, M_ISLOWER, M_REMOVEPREFIX, M_REMOVESUFFIX, M_CENTER, M_LJUST, M_RJUST, M_ZFILL,
    M_PARTITION, M_RPARTITION,
    M_ITEMS, M_KEYS, M_VALUES, M_GET, M_COPY,
    M_LIST_INDEX, M_LIST_COUNT, M_LIST_COPY,
    M_CYCLE,
};

static const struct {
    uint8_t type;
    const char *name;
    int id; /* -1: refused by the immutable sandbox */
} methods[] = {
    {JV_STR, "startswith", M_STARTSWITH}, {JV_STR, "endswith", M_ENDSWITH},
    {JV_STR, "strip", M_STRIP},           {JV_STR, "lstrip", M_LSTRIP},
    {JV_STR, "rstrip", M_RSTRIP},         {JV_STR, "split", M_SPLIT},
    {JV_STR, "rsplit", M_RSPLIT},         {JV_STR, "splitlines", M_SPLITLINES},
    {JV_STR, "replace", M_REPLACE},       {JV_STR, "upper", M_UPPER},
    {JV_STR, "lower", M_LOWER},           {JV_STR, "title", M_TITLE},
    {JV_STR, "capitalize", M_CAPITALIZE}, {JV_STR, "casefold", M_CASEFOLD},
    {JV_STR, "swapcase", M_SWAPCASE},     {JV_STR, "find", M_FIND},
    {JV_STR, "rfind", M_RFIND},           {JV_STR, "index", M_INDEX},
    {JV_STR, "rindex", M_RINDEX},         {JV_STR, "count", M_COUNT},
    {JV_STR, "join", M_JOIN},             {JV_STR, "format", M_FORMAT},
    {JV_STR, "isdigit", M_ISDIGIT},       {JV_STR, "isalpha", M_ISALPHA},
    {JV_STR, "isalnum", M_ISALNUM},       {JV_STR, "isspace", M_ISSPACE},
    {JV_STR, "isupper", M_ISUPPER},       {JV_STR, "islower", M_ISLOWER},
    {JV_STR, "removeprefix", M_REMOVEPREFIX}, {JV_STR, "removesuffix", M_REMOVESUFFIX},
    {JV_STR, "center", M_CENTER},         {JV_STR, "ljust", M_LJUST},
    {JV_STR, "rjust", M_RJUST},           {JV_STR, "zfill", M_ZFILL},
    {JV_STR, "partition", M_PARTITION},   {JV_STR, "rpartition", M_RPARTITION},
    {JV_DICT, "items", M_ITEMS},          {JV_DICT, "keys", M_KEYS},
    {JV_DICT, "values", M_VALUES},        {JV_DICT, "get", M_GET},
    {JV_DICT, "copy", M_COPY},            {JV_DICT, "pop", -1},
    {JV_DICT, "popitem", -1},             {JV_DICT, "setdefault", -1},
    {JV_DICT, "update", -1},              {JV_DICT, "clear", -1},
    {JV_LIST, "index", M_LIST_INDEX},     {JV_LIST, "count", M_LIST_COUNT},
    {JV_LIST, "copy", M_LIST_COPY},       {JV_LIST, "append", -1},
    {JV_LIST, "extend", -1},              {JV_LIST, "insert", -1},
    {JV_LIST, "pop", -1},                 {JV_LIST, "remove", -1},
    {JV_LIST, "reverse", -1},             {JV_LIST, "sort", -1},
    {JV_LIST, "clear", -1},               {JV_LOOP, "cycle", M_CYCLE},
};

int jinja__method_id(uint8_t type, const char *name, size_t len, bool *unsafe)
{
    *unsafe = false;
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        if (methods[i].type == type && strlen(methods[i].name) == len &&
            memcmp(methods[i].name, name, len) == 0) {
            if (methods[i].id < 0) *unsafe = true;
            return methods[i].id;
        }
    return -1;
}

const char *jinja__method_name(int id)
{
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        if (methods[i].id == id) return methods[i].name;
    return "?";
}

static int no_args(jx *x, const char *name, const jargs *a)
{
    if (a->npos || a->nkw) return jinja__fail(x, PD_EINVAL, "%s() takes no arguments", name);
    return 0;
}

static int str_pred(jx *x, const jstr *s, int id, jv *out)
{
    bool r = s->len > 0, any_cased = false;
    for (size_t i = 0; i < s->len;) {
        uint32_t cp = jinja__u8_next(s->s, s->len, &i);
        switch (id) {
        case M_ISDIGIT: r &= jinja__cp_is_digit(cp); break;
        case M_ISALPHA: r &= jinja__cp_is_alpha(cp); break;
        case M_ISALNUM: r &= jinja__cp_is_alpha(cp) || jinja__cp_is_digit(cp); break;
        case M_ISSPACE: r &= jinja__is_space(cp); break;
        case M_ISUPPER: r &= !jinja__cp_is_lower(cp); any_cased |= jinja__cp_is_upper(cp); break;
        case M_ISLOWER: r &= !jinja__cp_is_upper(cp); any_cased |= jinja__cp_is_lower(cp); break;
        }
    }
    if (id == M_ISUPPER || id == M_ISLOWER) r = r && any_cased;
    (void)x;
    *out = jv_bool(r);
    return 0;
}

static int str_method(jx *x, int id, const jstr *s, const jargs *a, jv *out)
{
    if (jinja__charge(x, s->len / 256)) return PD_EINVAL;
    static const char *const ps_chars[] = {"chars"}, *const ps_rep[] = {"old", "new", "count"},
                             *const ps_keep[] = {"keepends"}, *const ps_one[] = {"arg"};
    jv v[3];
    int rc;
    switch (id) {
    case M_STARTSWITH:
    case M_ENDSWITH: return m_affix(x, s, a, id == M_ENDSWITH, out);
    case M_STRIP:
    case M_LSTRIP:
    case M_RSTRIP:
        if ((rc = jinja__bind(x, "strip", a, ps_chars, 1, v))) return rc;
        if (!JARG_MISSING(v[0]) && v[0].t != JV_NONE && (rc = need_str(x, "chars", v[0]))) return rc;
        return jinja__str_strip(x, s, JARG_MISSING(v[0]) || v[0].t == JV_NONE ? NULL : v[0].u.s,
                                id == M_STRIP ? 3 : id == M_LSTRIP ? 1 : 2, out);
    case M_SPLIT:
    case M_RSPLIT: return m_split(x, s, a, id == M_RSPLIT, out);
    case M_SPLITLINES:
        if ((rc = jinja__bind(x, "splitlines", a, ps_keep, 1, v))) return rc;
        return jinja__splitlines(x, s, !JARG_MISSING(v[0]) && jinja__truthy(v[0]), out);
    case M_REPLACE: {
        int64_t count = -1;
        if ((rc = jinja__bind(x, "replace", a, ps_rep, 3, v)) || (rc = need_str(x, "old", v[0])) ||
            (rc = need_str(x, "new", v[1])))
            return rc;
        if (!JARG_MISSING(v[2]) && (rc = need_int(x, "count", v[2], &count))) return rc;
        return jinja__str_replace(x, s, v[0].u.s, v[1].u.s, count, out);
    }
    case M_UPPER:
    case M_LOWER:
    case M_TITLE:
    case M_CAPITALIZE:
    case M_CASEFOLD:
    case M_SWAPCASE:
        if ((rc = no_args(x, jinja__method_name(id), a))) return rc;
        return jinja__str_case(x, s,
                               id == M_UPPER        ? JCASE_UPPER
                               : id == M_TITLE      ? JCASE_TITLE
                               : id == M_CAPITALIZE ? JCASE_CAPITALIZE
                               : id == M_SWAPCASE   ? JCASE_SWAP
                                                    : JCASE_LOWER,
                               out);
    case M_FIND: return m_find(x, s, a, 0, out);
    case M_RFIND: return m_find(x, s, a, 1, out);
    case M_INDEX: return m_find(x, s, a, 2, out);
    case M_RINDEX: return m_find(x, s, a, 3, out);
    case M_COUNT: return m_find(x, s, a, 4, out);
    case M_JOIN:
        if ((rc = jinja__bind(x, "join", a, ps_one, 1, v))) return rc;
        if (JARG_MISSING(v[0])) return jinja__fail(x, PD_EINVAL, "join() takes exactly one argument");
        return m_join(x, s, v[0], out);
    case M_FORMAT: return m_format(x, s, a, out);
    case M_ISDIGIT:
    case M_ISALPHA:
    case M_ISALNUM:
    case M_ISSPACE:
    case M_ISUPPER:
    case M_ISLOWER:
        if ((rc = no_args(x, jinja__method_name(id), a))) return rc;
        return str_pred(x, s, id, out);
    case M_REMOVEPREFIX:
    case M_REMOVESUFFIX: {
        if ((rc = jinja__bind(x, jinja__method_name(id), a, ps_one, 1, v)) ||
            (rc = need_str(x, "the argument", v[0])))
            return rc;
        const jstr *p = v[0].u.s;
        bool suf = id == M_REMOVESUFFIX;
        if (p->len && affix_at(s, 0, s->len, p, suf))
            return jinja__str_new(x, s->s + (suf ? 0 : p->len), s->len - p->len, out);
        *out = (jv){.t = JV_STR};
        out->u.s = (jstr *)s;
        jinja__incref(*out);
        return 0;
    }
    case M_CENTER: return m_pad(x, s, a, 0, out);
    case M_LJUST: return m_pad(x, s, a, 1, out);
    case M_RJUST: return m_pad(x, s, a, 2, out);
    case M_ZFILL: return m_pad(x, s, a, 3, out);
    case M_PARTITION:
    case M_RPARTITION: {
        if ((rc = jinja__bind(x, "partition", a, ps_one, 1, v)) || (rc = need_str(x, "sep", v[0])))
            return rc;
        const jstr *sep = v[0].u.s;
        if (!sep->len) return jinja__fail(x, PD_EINVAL, "empty separator");
        const char *h = NULL;
        if (id == M_PARTITION) {
            h = memmem(s->s, s->len, sep->s, sep->len);
        } else if (s->len >= sep->len) {
            for (size_t k = s->len - sep->len + 1; k-- > 0;)
                if (memcmp(s->s + k, sep->s, sep->len) == 0) {
                    h = s->s + k;
                    break;
                }
        }
        if ((rc = jinja__list_new(x, JL_TUPLE, 3, out))) return rc;
        size_t at = h ? (size_t)(h - s->s) : (id == M_PARTITION ? s->len : 0);
        if (!h && id == M_RPARTITION) {
            rc = push_str(x, out->u.l, "", 0);
            if (!rc) rc = push_str(x, out->u.l, "", 0);
            if (!rc) rc = push_str(x, out->u.l, s->s, s->len);
        } else {
            rc = push_str(x, out->u.l, s->s, at);
            if (!rc) rc = push_str(x, out->u.l, h ? sep->s : "", h ? sep->len : 0);
            if (!rc) rc = push_str(x, out->u.l, s->s + at + (h ? sep->len : 0),
                                   s->len - at - (h ? sep->len : 0));
        }
        if (rc) jinja__decref(x, *out);
        return rc;
    }
    default: return jinja__fail(x, PD_EINVAL, "unknown str method");
    }
}

static int dict_view(jx *x, const jdict *d, int id, jv *out)
{
    int rc = jinja__list_new(x, id == M_ITEMS ? JL_ITEMS : id == M_KEYS ? JL_KEYS : JL_VALUES, d->n, out);
    for (size_t i = 0; i < d->n && !rc; i++) {
        jv e;
        if (id == M_ITEMS) {
            if ((rc = jinja__list_new(x, JL_TUPLE, 2, &e))) break;
            jinja__incref(d->k[i]);
            jinja__incref(d->v[i]);
            if ((rc = jinja__list_push(x, e.u.l, d->k[i])) || (rc = jinja__list_push(x, e.u.l, d->v[i]))) {
                jinja__decref(x, e);
                break;
            }
        } else {
            e = id == M_KEYS ? d->k[i] : d->v[i];
            jinja__incref(e);
        }
        rc = jinja__list_push(x, out->u.l, e);
    }
    if (rc && out->t == JV_LIST) jinja__decref(x, *out);
    return rc;
}

int jinja__call_method(jx *x, int id, jv self, const jargs *a, jv *out)
{
    static const char *const ps_get[] = {"key", "default"}, *const ps_one[] = {"value"};
    jv v[2];
    int rc;
    if (self.t == JV_STR) return str_method(x, id, self.u.s, a, out);
    if (self.t == JV_DICT) {
        switch (id) {
        case M_ITEMS:
        case M_KEYS:
        case M_VALUES:
            if ((rc = no_args(x, jinja__method_name(id), a))) return rc;
            return dict_view(x, self.u.d, id, out);
        case M_GET: {
            if ((rc = jinja__bind(x, "get", a, ps_get, 2, v))) return rc;
            if (JARG_MISSING(v[0])) return jinja__fail(x, PD_EINVAL, "get expected at least 1 argument");
            const jv *r = jinja__dict_get(x, self.u.d, v[0]);
            if (x->failed) return PD_EINVAL;
            *out = r ? *r : JARG_MISSING(v[1]) ? jv_none() : v[1];
            jinja__incref(*out);
            return 0;
        }
        case M_COPY: {
            if ((rc = no_args(x, "copy", a)) || (rc = jinja__dict_new(x, out, false))) return rc;
            for (size_t i = 0; i < self.u.d->n && !rc; i++) {
                jinja__incref(self.u.d->k[i]);
                jinja__incref(self.u.d->v[i]);
                rc = jinja__dict_set(x, out->u.d, self.u.d->k[i], self.u.d->v[i]);
            }
            if (rc) jinja__decref(x, *out);
            return rc;
        }
        }
    }
    if (self.t == JV_LIST) {
        jlist *l = self.u.l;
        switch (id) {
        case M_LIST_INDEX:
        case M_LIST_COUNT: {
            if ((rc = jinja__bind(x, jinja__method_name(id), a, ps_one, 1, v))) return rc;
            int64_t c = 0;
            for (size_t i = 0; i < l->n; i++) {
                bool eq;
                if ((rc = jinja__eq(x, l->v[i], v[0], &eq))) return rc;
                if (eq && id == M_LIST_INDEX) {
                    *out = jv_int((int64_t)i);
                    return 0;
                }
                c += eq;
            }
            if (id == M_LIST_INDEX) return jinja__fail(x, PD_EINVAL, "value is not in list");
            *out = jv_int(c);
            return 0;
        }
        case M_LIST_COPY:
            if ((rc = no_args(x, "copy", a)) || (rc = jinja__list_new(x, JL_LIST, l->n, out))) return rc;
            for (size_t i = 0; i < l->n && !rc; i++) {
                jinja__incref(l->v[i]);
                rc = jinja__list_push(x, out->u.l, l->v[i]);
            }
            if (rc) jinja__decref(x, *out);
            return rc;
        }
    }
    if (self.t == JV_LOOP && id == M_CYCLE) {
        if (!a->npos) return jinja__fail(x, PD_EINVAL, "no items for cycling given");
        *out = a->pos[self.u.lp->index0 % a->npos];
        jinja__incref(*out);
        return 0;
    }
    return jinja__fail(x, PD_EINVAL, "internal error: method %d of %s", id, jinja__type_name(self));
}

/* ---- globals ---- */
enum { G_RANGE, G_NAMESPACE, G_DICT, G_RAISE, G_STRFTIME, G_CYCLER, G_JOINER, G_LIPSUM };
static const char *const globals[] = {"range",   "namespace", "dict",   "raise_exception",
                                      "strftime_now", "cycler", "joiner", "lipsum"};

int jinja__global_id(const char *name, size_t len)
{
    for (int i = 0; i < (int)(sizeof globals / sizeof globals[0]); i++)
        if (strlen(globals[i]) == len && memcmp(globals[i], name, len) == 0) return i;
    return -1;
}

const char *jinja__global_name(int id)
{
    return id >= 0 && id < (int)(sizeof globals / sizeof globals[0]) ? globals[id] : "?";
}

/* dict(mapping, **kw) / namespace(mapping, **kw) */
static int make_dict(jx *x, const jargs *a, bool ns, jv *out)
{
    if (a->npos > 1)
        return jinja__fail(x, PD_EINVAL, "%s expected at most 1 argument, got %d",
                           ns ? "namespace" : "dict", a->npos);
    int rc = jinja__dict_new(x, out, ns);
    if (rc) return rc;
    if (a->npos == 1) {
        jv m = a->pos[0];
        if (m.t == JV_DICT || m.t == JV_NS) {
            for (size_t i = 0; i < m.u.d->n && !rc; i++) {
                jinja__incref(m.u.d->k[i]);
                jinja__incref(m.u.d->v[i]);
                rc = jinja__dict_set(x, out->u.d, m.u.d->k[i], m.u.d->v[i]);
            }
        } else {
            jlist *l = NULL;
            rc = jinja__iter_list(x, m, &l);
            for (size_t i = 0; !rc && i < l->n; i++) {
                jv p = l->v[i];
                if (p.t != JV_LIST || p.u.l->n != 2 || p.u.l->kind == JL_GEN) {
                    rc = jinja__fail(x, PD_EINVAL, "dictionary update sequence element #%zu has the wrong length", i);
                    break;
                }
                jinja__incref(p.u.l->v[0]);
                jinja__incref(p.u.l->v[1]);
                rc = jinja__dict_set(x, out->u.d, p.u.l->v[0], p.u.l->v[1]);
            }
            if (l) {
                jv lv = {.t = JV_LIST};
                lv.u.l = l;
                jinja__decref(x, lv);
            }
        }
    }
    for (int i = 0; i < a->nkw && !rc; i++) {
        jv k = {.t = JV_STR};
        k.u.s = (jstr *)a->kwn[i];
        jinja__incref(a->kwv[i]);
        rc = jinja__dict_set(x, out->u.d, k, a->kwv[i]);
    }
    if (!rc && ns) rc = jinja__ns_register(x, *out);
    if (rc) jinja__decref(x, *out);
    return rc;
}

int jinja__call_global(jx *x, int id, const jargs *a, jv *out)
{
    int rc;
    switch (id) {
    case G_RANGE: {
        int64_t v[3] = {0, 0, 1};
        if (a->nkw) return jinja__fail(x, PD_EINVAL, "range() takes no keyword arguments");
        if (a->npos < 1 || a->npos > 3)
            return jinja__fail(x, PD_EINVAL, "range expected 1 to 3 arguments, got %d", a->npos);
        for (int i = 0; i < a->npos; i++)
            if ((rc = need_int(x, "a range() argument", a->pos[i], &v[a->npos == 1 ? 1 : i]))) return rc;
        if (v[2] == 0) return jinja__fail(x, PD_EINVAL, "range() arg 3 must not be zero");
        double n = v[2] > 0 ? ceil(((double)v[1] - (double)v[0]) / (double)v[2])
                            : ceil(((double)v[0] - (double)v[1]) / -(double)v[2]);
        if (n < 0) n = 0;
        if (n > 100000)
            return jinja__fail(x, PD_EINVAL, "Range too big. The sandbox blocks ranges larger than "
                                             "MAX_RANGE (100000).");
        if ((rc = jinja__list_new(x, JL_LIST, (size_t)n, out))) return rc;
        for (int64_t i = 0; i < (int64_t)n && !rc; i++)
            rc = jinja__list_push(x, out->u.l, jv_int(v[0] + i * v[2]));
        if (rc) jinja__decref(x, *out);
        return rc;
    }
    case G_NAMESPACE: return make_dict(x, a, true, out);
    case G_DICT: return make_dict(x, a, false, out);
    case G_RAISE: {
        jv m;
        if (a->npos != 1 || a->nkw)
            return jinja__fail(x, PD_EINVAL, "raise_exception() takes exactly one argument");
        if ((rc = jinja__to_str(x, a->pos[0], &m))) return rc;
        rc = jinja__raise(x, m.u.s->s, m.u.s->len);
        jinja__decref(x, m);
        return rc;
    }
    case G_STRFTIME: {
        if (a->npos != 1 || a->nkw)
            return jinja__fail(x, PD_EINVAL, "strftime_now() takes exactly one argument");
        if ((rc = need_str(x, "format", a->pos[0]))) return rc;
        time_t now = x->now >= 0 ? (time_t)x->now : time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        const jstr *f = a->pos[0].u.s;
        if (f->len > 1000) return jinja__fail(x, PD_EINVAL, "strftime format too long");
        char fmt[1002], buf[4096];
        memcpy(fmt, f->s, f->len);
        fmt[f->len] = 0;
        if (memchr(f->s, 0, f->len)) return jinja__fail(x, PD_EINVAL, "embedded null character");
        size_t n = f->len ? strftime(buf, sizeof buf, fmt, &tm) : 0;
        return jinja__str_new(x, buf, n, out);
    }
    default:
        return jinja__fail(x, PD_EINVAL, "the global '%s' is not supported", jinja__global_name(id));
    }
}

/* ---- printf-style formatting: fmt % args ---- */
static int fmt_one(jx *x, jbuf *b, char conv, const char *flags, int width, int prec, jv v)
{
    char spec[64], tmp[512];
    int rc;
    if (conv == 's' || conv == 'r' || conv == 'a') {
        jbuf t = {0};
        rc = conv == 's' ? jinja__put_str(x, &t, v) : jinja__put_repr(x, &t, v, 0);
        if (rc) {
            jinja__buf_free(x, &t);
            return rc;
        }
        size_t n = t.n, ncp = jinja__u8_count(t.p ? t.p : "", t.n);
        if (prec >= 0 && (size_t)prec < ncp) { /* precision truncates to prec code points */
            size_t i = 0;
            for (int k = 0; k < prec; k++) jinja__u8_next(t.p, t.n, &i);
            n = i;
            ncp = (size_t)prec;
        }
        bool left = strchr(flags, '-') != NULL;
        for (int k = (int)ncp; !left && k < width && !rc; k++) rc = jinja__buf_put(x, b, " ", 1);
        if (!rc) rc = jinja__buf_put(x, b, t.p ? t.p : "", n);
        for (int k = (int)ncp; left && k < width && !rc; k++) rc = jinja__buf_put(x, b, " ", 1);
        jinja__buf_free(x, &t);
        return rc;
    }
    if (conv == 'c') {
        char u[4];
        if (v.t == JV_STR && v.u.s->ncp == 1) return jinja__buf_put(x, b, v.u.s->s, v.u.s->len);
        if (v.t != JV_INT || v.u.i < 0 || v.u.i > 0x10FFFF || (v.u.i >= 0xD800 && v.u.i <= 0xDFFF))
            return jinja__fail(x, PD_EINVAL, "%%c requires an int or a single character");
        return jinja__buf_put(x, b, u, jinja__u8_put(u, (uint32_t)v.u.i));
    }
    if (v.t != JV_INT && v.t != JV_FLOAT && v.t != JV_BOOL)
        return jinja__fail(x, PD_EINVAL, "%%%c format: a real number is required, not %s", conv,
                           jinja__type_name(v));
    if (width > 400) width = 400;
    if (prec > 100) prec = 100;
    char wbuf[16] = "", pbuf[16] = "";
    if (width >= 0) snprintf(wbuf, sizeof wbuf, "%d", width);
    if (prec >= 0) snprintf(pbuf, sizeof pbuf, ".%d", prec);
    if (conv == 'd' || conv == 'i' || conv == 'u' || conv == 'x' || conv == 'X' || conv == 'o') {
        int64_t i = v.t == JV_FLOAT ? (int64_t)v.u.f : v.t == JV_INT ? v.u.i : v.u.b;
        if (v.t == JV_FLOAT && (conv == 'x' || conv == 'X' || conv == 'o'))
            return jinja__fail(x, PD_EINVAL, "%%%c format: an integer is required, not float", conv);
        char c = conv == 'i' || conv == 'u' ? 'd' : conv;
        snprintf(spec, sizeof spec, "%%%s%s%sll%c", flags, wbuf, pbuf, c);
        if (c == 'd') snprintf(tmp, sizeof tmp, spec, (long long)i);
        else if (i < 0) { /* Python prints -0x.. for negatives */
            snprintf(spec, sizeof spec, "-%%%s%sll%c", flags, pbuf, c);
            snprintf(tmp, sizeof tmp, spec, (unsigned long long)-(uint64_t)i);
        } else snprintf(tmp, sizeof tmp, spec, (unsigned long long)i);
        return jinja__buf_put(x, b, tmp, strlen(tmp));
    }
    if (strchr("eEfFgG", conv)) {
        double f = v.t == JV_FLOAT ? v.u.f : (double)(v.t == JV_INT ? v.u.i : v.u.b);
        snprintf(spec, sizeof spec, "%%%s%s%s%c", flags, wbuf, pbuf, conv);
        snprintf(tmp, sizeof tmp, spec, f);
        return jinja__buf_put(x, b, tmp, strlen(tmp));
    }
    return jinja__fail(x, PD_EINVAL, "unsupported format character '%c'", conv);
}

int jinja__format_percent(jx *x, jv fmt, jv args, jv *out)
{
    const jstr *s = fmt.u.s;
    bool tuple = args.t == JV_LIST && args.u.l->kind == JL_TUPLE;
    size_t nargs = tuple ? args.u.l->n : 1, used = 0;
    bool mapping = args.t == JV_DICT;
    jbuf b = {0};
    int rc = 0;
    for (size_t i = 0; i < s->len && !rc;) {
        const char *pct = memchr(s->s + i, '%', s->len - i);
        size_t at = pct ? (size_t)(pct - s->s) : s->len;
        if ((rc = jinja__buf_put(x, &b, s->s + i, at - i)) || !pct) break;
        i = at + 1;
        jv v = jv_none();
        bool have = false;
        if (i < s->len && s->s[i] == '(') {
            const char *close = memchr(s->s + i, ')', s->len - i);
            if (!close || !mapping) {
                rc = jinja__fail(x, PD_EINVAL, close ? "format requires a mapping" : "incomplete format key");
                break;
            }
            const jv *r = jinja__dict_get_str(args.u.d, s->s + i + 1, (size_t)(close - s->s) - i - 1);
            if (!r) {
                rc = jinja__fail(x, PD_EINVAL, "format key '%.*s' not found", (int)((size_t)(close - s->s) - i - 1), s->s + i + 1);
                break;
            }
            v = *r;
            have = true;
            i = (size_t)(close - s->s) + 1;
        }
        char flags[8] = "";
        int nf = 0, width = -1, prec = -1;
        while (i < s->len && strchr("-+ #0", s->s[i]) && s->s[i] && nf < 6) flags[nf++] = s->s[i++];
        while (i < s->len && strchr("-+ #0", s->s[i]) && s->s[i]) i++;
        flags[nf] = 0;
        if (i < s->len && s->s[i] >= '0' && s->s[i] <= '9') {
            width = 0;
            while (i < s->len && s->s[i] >= '0' && s->s[i] <= '9' && width < 10000) width = width * 10 + (s->s[i++] - '0');
        }
        if (i < s->len && s->s[i] == '.') {
            i++;
            prec = 0;
            while (i < s->len && s->s[i] >= '0' && s->s[i] <= '9' && prec < 10000) prec = prec * 10 + (s->s[i++] - '0');
        }
        if (i >= s->len) {
            rc = jinja__fail(x, PD_EINVAL, "incomplete format");
            break;
        }
        char conv = s->s[i++];
        if (conv == '%') {
            rc = jinja__buf_put(x, &b, "%", 1);
            continue;
        }
        if (!have) {
            if (mapping && !tuple) {
                v = args;
            } else {
                if (used >= nargs) {
                    rc = jinja__fail(x, PD_EINVAL, "not enough arguments for format string");
                    break;
                }
                v = tuple ? args.u.l->v[used] : args;
            }
            used++;
        }
        rc = fmt_one(x, &b, conv, flags, width, prec, v);
    }
    if (!rc && !mapping && used < nargs)
        rc = jinja__fail(x, PD_EINVAL, "not all arguments converted during string formatting");
    return str_out(x, &b, rc, out);
}
