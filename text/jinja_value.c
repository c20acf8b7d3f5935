/* jinja_value.c -- Values of the Jinja interpreter with Python's semantics: refcounted
 * strings, lists, dicts, namespaces, functions; memory counted against the render's limit;
 * truth, equality and ordering as Python; str() and repr() text as Python prints it (floats
 * included); transformers' tojson (json.dumps); conversion from JSON variables. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/jinja_impl.h"

/* ---- memory ---- */
void *jinja__alloc(jx *x, size_t n)
{
    if (n > x->max_mem - x->mem) {
        jinja__fail(x, PD_EINVAL, "the template used more than %zu bytes of memory", x->max_mem);
        return NULL;
    }
    void *p = malloc(n ? n : 1);
    if (!p) {
        jinja__fail(x, PD_ENOMEM, "out of memory");
        return NULL;
    }
    x->mem += n;
    return p;
}

void *jinja__realloc(jx *x, void *p, size_t old_n, size_t new_n)
{
    if (new_n > old_n && new_n - old_n > x->max_mem - x->mem) {
        jinja__fail(x, PD_EINVAL, "the template used more than %zu bytes of memory", x->max_mem);
        return NULL;
    }
    void *q = realloc(p, new_n ? new_n : 1);
    if (!q) {
        jinja__fail(x, PD_ENOMEM, "out of memory");
        return NULL;
    }
    x->mem = x->mem - old_n + new_n;
    return q;
}

void jinja__free(jx *x, void *p, size_t n)
{
    if (!p) return;
    x->mem -= n;
    free(p);
}

int jinja__buf_put(jx *x, jbuf *b, const char *s, size_t n)
{
    if (jinja__charge(x, n / 256)) return PD_EINVAL;
    if (n > x->max_out || b->n > x->max_out - n)
        return jinja__fail(x, PD_EINVAL, "the template's output is larger than %zu bytes",
                           x->max_out);
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = jinja__realloc(x, b->p, b->cap, cap);
        if (!p) return PD_EINVAL;
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static int buf_puts(jx *x, jbuf *b, const char *s) { return jinja__buf_put(x, b, s, strlen(s)); }

void jinja__buf_free(jx *x, jbuf *b)
{
    jinja__free(x, b->p, b->cap);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* ---- construction and release ---- */
static uint16_t depth_of(jv v)
{
    switch (v.t) {
    case JV_LIST: return v.u.l->depth;
    case JV_DICT: return v.u.d->depth;
    case JV_LOOP: return (uint16_t)(v.u.lp->items->depth + 1);
    case JV_FUNC: return v.u.fn->kind == FN_METHOD ? (uint16_t)(depth_of(v.u.fn->self) + 1) : 1;
    default: return 0; /* namespaces count as leaves: the render holds them and clears them */
    }
}

int jinja__str_new(jx *x, const char *s, size_t len, jv *out)
{
    *out = jv_undef(NULL);
    if (jinja__charge(x, 1 + len / 256)) return PD_EINVAL;
    if (len > x->max_out)
        return jinja__fail(x, PD_EINVAL, "a string of the template is larger than %zu bytes",
                           x->max_out);
    jstr *r = jinja__alloc(x, sizeof *r + len + 1);
    if (!r) return PD_EINVAL;
    r->rc = 1;
    r->len = len;
    r->ncp = jinja__u8_count(s, len);
    if (len) memcpy(r->s, s, len);
    r->s[len] = 0;
    *out = (jv){.t = JV_STR};
    out->u.s = r;
    return 0;
}

int jinja__str_from_buf(jx *x, jbuf *b, jv *out)
{
    int rc = jinja__str_new(x, b->p ? b->p : "", b->n, out);
    jinja__buf_free(x, b);
    return rc;
}

int jinja__buf_result(jx *x, jbuf *b, int rc, jv *out)
{
    if (rc) {
        jinja__buf_free(x, b);
        return rc;
    }
    return jinja__str_from_buf(x, b, out);
}

int jinja__list_new(jx *x, uint8_t kind, size_t cap, jv *out)
{
    *out = jv_undef(NULL);
    jlist *l = jinja__alloc(x, sizeof *l);
    if (!l) return PD_EINVAL;
    memset(l, 0, sizeof *l);
    l->rc = 1;
    l->kind = kind;
    l->depth = 1;
    if (cap && !(l->v = jinja__alloc(x, cap * sizeof(jv)))) {
        jinja__free(x, l, sizeof *l);
        return PD_EINVAL;
    }
    l->cap = cap;
    *out = (jv){.t = JV_LIST};
    out->u.l = l;
    return 0;
}

int jinja__list_push(jx *x, jlist *l, jv v)
{
    if (jinja__charge(x, 1)) {
        jinja__decref(x, v);
        return PD_EINVAL;
    }
    uint16_t d = depth_of(v);
    if (d + 1 > JV_DEPTH_MAX) {
        jinja__decref(x, v);
        return jinja__fail(x, PD_EINVAL, "a value is nested more than %d levels deep",
                           JV_DEPTH_MAX);
    }
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        jv *nv = jinja__realloc(x, l->v, l->cap * sizeof(jv), cap * sizeof(jv));
        if (!nv) {
            jinja__decref(x, v);
            return PD_EINVAL;
        }
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = v;
    if (d + 1 > l->depth) l->depth = (uint16_t)(d + 1);
    return 0;
}

int jinja__dict_new(jx *x, jv *out, bool ns)
{
    *out = jv_undef(NULL);
    jdict *d = jinja__alloc(x, sizeof *d);
    if (!d) return PD_EINVAL;
    memset(d, 0, sizeof *d);
    d->rc = 1;
    d->depth = 1;
    *out = (jv){.t = ns ? JV_NS : JV_DICT};
    out->u.d = d;
    return 0;
}

static bool hashable(jv k)
{
    if (k.t == JV_LIST) {
        if (k.u.l->kind != JL_TUPLE) return false;
        for (size_t i = 0; i < k.u.l->n; i++)
            if (!hashable(k.u.l->v[i])) return false;
        return true;
    }
    return k.t != JV_DICT;
}

const jv *jinja__dict_get(jx *x, const jdict *d, jv k)
{
    for (size_t i = 0; i < d->n; i++) {
        bool eq = false;
        if (k.t == JV_STR && d->k[i].t == JV_STR) {
            eq = k.u.s->len == d->k[i].u.s->len && memcmp(k.u.s->s, d->k[i].u.s->s, k.u.s->len) == 0;
        } else if (jinja__eq(x, k, d->k[i], &eq)) {
            return NULL;
        }
        if (eq) return &d->v[i];
    }
    return NULL;
}

const jv *jinja__dict_get_str(const jdict *d, const char *s, size_t len)
{
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == JV_STR && d->k[i].u.s->len == len && memcmp(d->k[i].u.s->s, s, len) == 0)
            return &d->v[i];
    return NULL;
}

int jinja__dict_set(jx *x, jdict *d, jv k, jv v)
{
    if (!hashable(k)) {
        int rc = jinja__fail(x, PD_EINVAL, "unhashable type: '%s'", jinja__type_name(k));
        jinja__decref(x, k);
        jinja__decref(x, v);
        return rc;
    }
    uint16_t dep = depth_of(v) > depth_of(k) ? depth_of(v) : depth_of(k);
    if (dep + 1 > JV_DEPTH_MAX) {
        jinja__decref(x, k);
        jinja__decref(x, v);
        return jinja__fail(x, PD_EINVAL, "a value is nested more than %d levels deep",
                           JV_DEPTH_MAX);
    }
    jv *old = (jv *)jinja__dict_get(x, d, k);
    if (x->failed) {
        jinja__decref(x, k);
        jinja__decref(x, v);
        return PD_EINVAL;
    }
    if (old) { /* Python keeps the first key object and its position */
        jinja__decref(x, k);
        jinja__decref(x, *old);
        *old = v;
    } else {
        if (d->n == d->cap) {
            size_t cap = d->cap ? d->cap * 2 : 4;
            jv *nk = jinja__alloc(x, cap * sizeof(jv));
            jv *nv = nk ? jinja__alloc(x, cap * sizeof(jv)) : NULL;
            if (!nv) {
                jinja__free(x, nk, cap * sizeof(jv));
                jinja__decref(x, k);
                jinja__decref(x, v);
                return PD_EINVAL;
            }
            if (d->n) {
                memcpy(nk, d->k, d->n * sizeof(jv));
                memcpy(nv, d->v, d->n * sizeof(jv));
            }
            jinja__free(x, d->k, d->cap * sizeof(jv));
            jinja__free(x, d->v, d->cap * sizeof(jv));
            d->k = nk;
            d->v = nv;
            d->cap = cap;
        }
        d->k[d->n] = k;
        d->v[d->n] = v;
        d->n++;
    }
    if (dep + 1 > d->depth) d->depth = (uint16_t)(dep + 1);
    return 0;
}

int jinja__func_new(jx *x, uint8_t kind, int id, const jnode *node, jv *out)
{
    *out = jv_undef(NULL);
    jfunc *f = jinja__alloc(x, sizeof *f);
    if (!f) return PD_EINVAL;
    memset(f, 0, sizeof *f);
    f->rc = 1;
    f->kind = kind;
    f->id = id;
    f->node = node;
    f->self = jv_none();
    *out = (jv){.t = JV_FUNC};
    out->u.fn = f;
    return 0;
}

void jinja__decref(jx *x, jv v)
{
    if (!JV_IS_HEAP(v) || *v.u.rc < 0 || --*v.u.rc > 0) return;
    switch (v.t) {
    case JV_STR: jinja__free(x, v.u.s, sizeof(jstr) + v.u.s->len + 1); break;
    case JV_LIST: {
        jlist *l = v.u.l;
        for (size_t i = 0; i < l->n; i++) jinja__decref(x, l->v[i]);
        jinja__free(x, l->v, l->cap * sizeof(jv));
        jinja__free(x, l, sizeof *l);
        break;
    }
    case JV_DICT:
    case JV_NS: {
        jdict *d = v.u.d;
        for (size_t i = 0; i < d->n; i++) {
            jinja__decref(x, d->k[i]);
            jinja__decref(x, d->v[i]);
        }
        jinja__free(x, d->k, d->cap * sizeof(jv));
        jinja__free(x, d->v, d->cap * sizeof(jv));
        jinja__free(x, d, sizeof *d);
        break;
    }
    case JV_FUNC:
        jinja__decref(x, v.u.fn->self);
        jinja__free(x, v.u.fn, sizeof(jfunc));
        break;
    case JV_LOOP: {
        jv items = {.t = JV_LIST};
        items.u.l = v.u.lp->items;
        jinja__decref(x, items);
        jinja__free(x, v.u.lp, sizeof(jloop));
        break;
    }
    default: break;
    }
}

const char *jinja__type_name(jv v)
{
    switch (v.t) {
    case JV_UNDEF: return "Undefined";
    case JV_NONE: return "NoneType";
    case JV_BOOL: return "bool";
    case JV_INT: return "int";
    case JV_FLOAT: return "float";
    case JV_STR: return "str";
    case JV_LIST:
        switch (v.u.l->kind) {
        case JL_TUPLE: return "tuple";
        case JL_KEYS: return "dict_keys";
        case JL_VALUES: return "dict_values";
        case JL_ITEMS: return "dict_items";
        case JL_GEN: return "generator";
        default: return "list";
        }
    case JV_DICT: return "dict";
    case JV_NS: return "Namespace";
    case JV_FUNC:
        return v.u.fn->kind == FN_MACRO || v.u.fn->kind == FN_CALLER ? "Macro"
               : v.u.fn->kind == FN_METHOD                           ? "builtin_function_or_method"
                                                                     : "function";
    case JV_LOOP: return "LoopContext";
    default: return "object";
    }
}

/* ---- truth, equality, order ---- */
bool jinja__truthy(jv v)
{
    switch (v.t) {
    case JV_UNDEF:
    case JV_NONE: return false;
    case JV_BOOL: return v.u.b;
    case JV_INT: return v.u.i != 0;
    case JV_FLOAT: return v.u.f != 0;
    case JV_STR: return v.u.s->len > 0;
    case JV_LIST: return v.u.l->kind == JL_GEN || v.u.l->n > 0;
    case JV_DICT: return v.u.d->n > 0;
    default: return true;
    }
}

static bool is_num(jv v) { return v.t == JV_BOOL || v.t == JV_INT || v.t == JV_FLOAT; }
static double num_f(jv v)
{
    return v.t == JV_FLOAT ? v.u.f : v.t == JV_INT ? (double)v.u.i : (double)v.u.b;
}
static int64_t num_i(jv v) { return v.t == JV_INT ? v.u.i : (int64_t)v.u.b; }

static int eq_depth(jx *x, jv a, jv b, bool *eq, int depth)
{
    if (depth > JV_DEPTH_MAX)
        return jinja__fail(x, PD_EINVAL, "values nested too deeply to compare");
    *eq = false;
    if (is_num(a) && is_num(b)) {
        if (a.t == JV_FLOAT || b.t == JV_FLOAT) *eq = num_f(a) == num_f(b);
        else *eq = num_i(a) == num_i(b);
        return 0;
    }
    if (a.t != b.t) return 0;
    switch (a.t) {
    case JV_UNDEF:
    case JV_NONE: *eq = true; return 0;
    case JV_STR:
        *eq = a.u.s == b.u.s ||
              (a.u.s->len == b.u.s->len && memcmp(a.u.s->s, b.u.s->s, a.u.s->len) == 0);
        return 0;
    case JV_LIST: {
        jlist *l = a.u.l, *m = b.u.l;
        if (l == m) {
            *eq = true;
            return 0;
        }
        bool la = l->kind == JL_LIST, lb = m->kind == JL_LIST;
        if (l->kind == JL_GEN || m->kind == JL_GEN || la != lb ||
            (l->kind == JL_TUPLE) != (m->kind == JL_TUPLE) || l->n != m->n)
            return 0;
        for (size_t i = 0; i < l->n; i++) {
            int rc = eq_depth(x, l->v[i], m->v[i], eq, depth + 1);
            if (rc || !*eq) return rc;
        }
        *eq = true;
        return 0;
    }
    case JV_DICT: {
        jdict *d = a.u.d, *e = b.u.d;
        if (d == e) {
            *eq = true;
            return 0;
        }
        if (d->n != e->n) return 0;
        for (size_t i = 0; i < d->n; i++) {
            const jv *w = jinja__dict_get(x, e, d->k[i]);
            if (x->failed) return PD_EINVAL;
            if (!w) return 0;
            int rc = eq_depth(x, d->v[i], *w, eq, depth + 1);
            if (rc || !*eq) return rc;
        }
        *eq = true;
        return 0;
    }
    default: *eq = a.u.rc == b.u.rc; return 0;
    }
}

int jinja__eq(jx *x, jv a, jv b, bool *eq) { return eq_depth(x, a, b, eq, 0); }

static int cmp_depth(jx *x, jv a, jv b, int *c, int depth)
{
    if (depth > JV_DEPTH_MAX)
        return jinja__fail(x, PD_EINVAL, "values nested too deeply to compare");
    if (a.t == JV_UNDEF || b.t == JV_UNDEF) {
        const char *h = a.t == JV_UNDEF ? a.u.hint : b.u.hint;
        if (h) return jinja__fail(x, PD_EINVAL, "'%s' is undefined", h);
        return jinja__fail(x, PD_EINVAL, "an undefined value cannot be compared");
    }
    if (is_num(a) && is_num(b)) {
        if (a.t == JV_FLOAT || b.t == JV_FLOAT) {
            double p = num_f(a), q = num_f(b);
            *c = p < q ? -1 : p > q ? 1 : 0; /* NaN: neither less nor greater */
        } else {
            int64_t p = num_i(a), q = num_i(b);
            *c = p < q ? -1 : p > q;
        }
        return 0;
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int r = memcmp(a.u.s->s, b.u.s->s, n);
        *c = r < 0 ? -1 : r > 0 ? 1 : a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len;
        return 0;
    }
    if (a.t == JV_LIST && b.t == JV_LIST && a.u.l->kind == b.u.l->kind &&
        (a.u.l->kind == JL_LIST || a.u.l->kind == JL_TUPLE)) {
        jlist *l = a.u.l, *m = b.u.l;
        for (size_t i = 0; i < l->n && i < m->n; i++) {
            bool eq;
            int rc = eq_depth(x, l->v[i], m->v[i], &eq, depth + 1);
            if (rc) return rc;
            if (!eq) return cmp_depth(x, l->v[i], m->v[i], c, depth + 1);
        }
        *c = l->n < m->n ? -1 : l->n > m->n;
        return 0;
    }
    return jinja__fail(x, PD_EINVAL, "'<' not supported between instances of '%s' and '%s'",
                       jinja__type_name(a), jinja__type_name(b));
}

int jinja__cmp(jx *x, jv a, jv b, int *c) { return cmp_depth(x, a, b, c, 0); }

/* ---- text forms ---- */
void jinja__put_float(char *buf, size_t n, double f)
{
    if (isnan(f)) {
        snprintf(buf, n, "nan");
        return;
    }
    if (isinf(f)) {
        snprintf(buf, n, f > 0 ? "inf" : "-inf");
        return;
    }
    if (f == 0) {
        snprintf(buf, n, signbit(f) ? "-0.0" : "0.0");
        return;
    }
    char tmp[48];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f) break;
    }
    /* tmp: [-]d[.ddd]e[+-]XX -> digits and the decimal exponent of the first digit */
    char digs[32];
    int nd = 0, exp10;
    const char *p = tmp;
    bool neg = *p == '-';
    if (neg) p++;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digs[nd++] = *p;
    exp10 = atoi(p + 1);
    while (nd > 1 && digs[nd - 1] == '0') nd--;
    char out[64];
    size_t k = 0;
    if (neg) out[k++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            out[k++] = '0';
            out[k++] = '.';
            for (int i = 0; i < -exp10 - 1; i++) out[k++] = '0';
            for (int i = 0; i < nd; i++) out[k++] = digs[i];
        } else {
            for (int i = 0; i <= exp10; i++) out[k++] = i < nd ? digs[i] : '0';
            out[k++] = '.';
            if (nd > exp10 + 1)
                for (int i = exp10 + 1; i < nd; i++) out[k++] = digs[i];
            else
                out[k++] = '0';
        }
        out[k] = 0;
    } else {
        out[k++] = digs[0];
        if (nd > 1) {
            out[k++] = '.';
            for (int i = 1; i < nd; i++) out[k++] = digs[i];
        }
        snprintf(out + k, sizeof out - k, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
    snprintf(buf, n, "%s", out);
}

static int put_repr_str(jx *x, jbuf *b, const jstr *s)
{
    bool has_sq = memchr(s->s, '\'', s->len) != NULL, has_dq = memchr(s->s, '"', s->len) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    int rc = jinja__buf_put(x, b, &q, 1);
    size_t i = 0, run = 0;
    while (!rc && i < s->len) {
        size_t j = i;
        uint32_t cp = jinja__u8_next(s->s, s->len, &j);
        char esc[16];
        const char *e = NULL;
        if (cp == (uint32_t)q || cp == '\\') {
            snprintf(esc, sizeof esc, "\\%c", (char)cp);
            e = esc;
        } else if (cp == '\n') {
            e = "\\n";
        } else if (cp == '\r') {
            e = "\\r";
        } else if (cp == '\t') {
            e = "\\t";
        } else if (!jinja__cp_printable(cp)) {
            snprintf(esc, sizeof esc, cp <= 0xFF ? "\\x%02x" : cp <= 0xFFFF ? "\\u%04x" : "\\U%08x", cp);
            e = esc;
        }
        if (e) {
            rc = jinja__buf_put(x, b, s->s + run, i - run);
            if (!rc) rc = buf_puts(x, b, e);
            run = j;
        }
        i = j;
    }
    if (!rc) rc = jinja__buf_put(x, b, s->s + run, s->len - run);
    if (!rc) rc = jinja__buf_put(x, b, &q, 1);
    return rc;
}

static int put_items(jx *x, jbuf *b, const jv *v, size_t n, int depth)
{
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        if (i) rc = buf_puts(x, b, ", ");
        if (!rc) rc = jinja__put_repr(x, b, v[i], depth + 1);
    }
    return rc;
}

static int put_dict(jx *x, jbuf *b, const jdict *d, int depth)
{
    int rc = buf_puts(x, b, "{");
    for (size_t i = 0; i < d->n && !rc; i++) {
        if (i) rc = buf_puts(x, b, ", ");
        if (!rc) rc = jinja__put_repr(x, b, d->k[i], depth + 1);
        if (!rc) rc = buf_puts(x, b, ": ");
        if (!rc) rc = jinja__put_repr(x, b, d->v[i], depth + 1);
    }
    return rc ? rc : buf_puts(x, b, "}");
}

int jinja__put_repr(jx *x, jbuf *b, jv v, int depth)
{
    if (depth > JV_DEPTH_MAX)
        return jinja__fail(x, PD_EINVAL, "a value is nested too deeply to print");
    if (v.t == JV_STR) return put_repr_str(x, b, v.u.s);
    if (v.t == JV_UNDEF) return buf_puts(x, b, "Undefined");
    if (v.t != JV_LIST && v.t != JV_DICT && v.t != JV_NS) return jinja__put_str(x, b, v);
    if (v.t == JV_DICT) return put_dict(x, b, v.u.d, depth);
    if (v.t == JV_NS) {
        int rc = buf_puts(x, b, "<Namespace ");
        if (!rc) rc = put_dict(x, b, v.u.d, depth);
        return rc ? rc : buf_puts(x, b, ">");
    }
    jlist *l = v.u.l;
    int rc;
    switch (l->kind) {
    case JL_TUPLE:
        rc = buf_puts(x, b, "(");
        if (!rc) rc = put_items(x, b, l->v, l->n, depth);
        if (!rc && l->n == 1) rc = buf_puts(x, b, ",");
        return rc ? rc : buf_puts(x, b, ")");
    case JL_GEN: return buf_puts(x, b, "<generator object>");
    case JL_LIST:
        rc = buf_puts(x, b, "[");
        if (!rc) rc = put_items(x, b, l->v, l->n, depth);
        return rc ? rc : buf_puts(x, b, "]");
    default:
        rc = buf_puts(x, b, l->kind == JL_KEYS ? "dict_keys([" : l->kind == JL_VALUES ? "dict_values([" : "dict_items([");
        if (!rc) rc = put_items(x, b, l->v, l->n, depth);
        return rc ? rc : buf_puts(x, b, "])");
    }
}

int jinja__put_str(jx *x, jbuf *b, jv v)
{
    char tmp[64];
    switch (v.t) {
    case JV_UNDEF: return 0;
    case JV_NONE: return buf_puts(x, b, "None");
    case JV_BOOL: return buf_puts(x, b, v.u.b ? "True" : "False");
    case JV_INT: snprintf(tmp, sizeof tmp, "%lld", (long long)v.u.i); return buf_puts(x, b, tmp);
    case JV_FLOAT: jinja__put_float(tmp, sizeof tmp, v.u.f); return buf_puts(x, b, tmp);
    case JV_STR: return jinja__buf_put(x, b, v.u.s->s, v.u.s->len);
    case JV_FUNC: {
        const jfunc *f = v.u.fn;
        if (f->kind == FN_MACRO) {
            int rc = buf_puts(x, b, "<Macro '");
            if (!rc) rc = jinja__buf_put(x, b, f->node->str->s, f->node->str->len);
            return rc ? rc : buf_puts(x, b, "'>");
        }
        if (f->kind == FN_CALLER) return buf_puts(x, b, "<Macro 'caller'>");
        if (f->kind == FN_METHOD) {
            snprintf(tmp, sizeof tmp, "<built-in method %s of %s object>",
                     jinja__method_name(f->id), jinja__type_name(f->self));
            return buf_puts(x, b, tmp);
        }
        snprintf(tmp, sizeof tmp, "<function %s>", jinja__global_name(f->id));
        return buf_puts(x, b, tmp);
    }
    case JV_LOOP:
        snprintf(tmp, sizeof tmp, "<LoopContext %lld/%lld>", (long long)(v.u.lp->index0 + 1),
                 (long long)v.u.lp->length);
        return buf_puts(x, b, tmp);
    default: return jinja__put_repr(x, b, v, 0);
    }
}

int jinja__to_str(jx *x, jv v, jv *out)
{
    if (v.t == JV_STR) {
        jinja__incref(v);
        *out = v;
        return 0;
    }
    jbuf b = {0};
    int rc = jinja__put_str(x, &b, v);
    if (rc) {
        jinja__buf_free(x, &b);
        return rc;
    }
    return jinja__str_from_buf(x, &b, out);
}

/* ---- JSON ---- */
static int json_str(jx *x, jbuf *b, const char *s, size_t len, bool ascii)
{
    int rc = buf_puts(x, b, "\"");
    size_t i = 0, run = 0;
    while (!rc && i < len) {
        unsigned char c = (unsigned char)s[i];
        char esc[16];
        const char *e = NULL;
        size_t j = i + 1;
        if (c == '"') e = "\\\"";
        else if (c == '\\') e = "\\\\";
        else if (c == '\n') e = "\\n";
        else if (c == '\r') e = "\\r";
        else if (c == '\t') e = "\\t";
        else if (c == '\b') e = "\\b";
        else if (c == '\f') e = "\\f";
        else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            e = esc;
        } else if (c >= 0x80 && ascii) {
            j = i;
            uint32_t cp = jinja__u8_next(s, len, &j);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                snprintf(esc, sizeof esc, "\\u%04x", cp);
            }
            e = esc;
        }
        if (e) {
            rc = jinja__buf_put(x, b, s + run, i - run);
            if (!rc) rc = buf_puts(x, b, e);
            run = j;
        }
        i = j;
    }
    if (!rc) rc = jinja__buf_put(x, b, s + run, len - run);
    return rc ? rc : buf_puts(x, b, "\"");
}

typedef struct {
    bool ascii, sort;
    int indent; /* < 0: none */
    const char *indent_str, *item_sep, *key_sep;
} jopts;

static int json_nl(jx *x, jbuf *b, const jopts *o, int level)
{
    int rc = buf_puts(x, b, "\n");
    for (int i = 0; i < level && !rc; i++) {
        if (o->indent_str) rc = buf_puts(x, b, o->indent_str);
        else
            for (int k = 0; k < o->indent && !rc; k++) rc = buf_puts(x, b, " ");
    }
    return rc;
}

static bool pretty(const jopts *o) { return o->indent_str || o->indent >= 0; }

static int json_val(jx *x, jbuf *b, jv v, const jopts *o, int level);

static int json_key(jx *x, jbuf *b, jv k, const jopts *o)
{
    char tmp[64];
    switch (k.t) {
    case JV_STR: return json_str(x, b, k.u.s->s, k.u.s->len, o->ascii);
    case JV_NONE: return buf_puts(x, b, "\"null\"");
    case JV_BOOL: return buf_puts(x, b, k.u.b ? "\"true\"" : "\"false\"");
    case JV_INT: snprintf(tmp, sizeof tmp, "\"%lld\"", (long long)k.u.i); return buf_puts(x, b, tmp);
    case JV_FLOAT:
        if (isnan(k.u.f)) return buf_puts(x, b, "\"NaN\"");
        if (isinf(k.u.f)) return buf_puts(x, b, k.u.f > 0 ? "\"Infinity\"" : "\"-Infinity\"");
        tmp[0] = '"';
        jinja__put_float(tmp + 1, sizeof tmp - 2, k.u.f);
        strcat(tmp, "\"");
        return buf_puts(x, b, tmp);
    default:
        return jinja__fail(x, PD_EINVAL, "keys must be str, int, float, bool or None, not %s",
                           jinja__type_name(k));
    }
}

static int json_val(jx *x, jbuf *b, jv v, const jopts *o, int level)
{
    char tmp[64];
    if (level > JV_DEPTH_MAX) return jinja__fail(x, PD_EINVAL, "a value is nested too deeply for tojson");
    switch (v.t) {
    case JV_NONE: return buf_puts(x, b, "null");
    case JV_BOOL: return buf_puts(x, b, v.u.b ? "true" : "false");
    case JV_INT: snprintf(tmp, sizeof tmp, "%lld", (long long)v.u.i); return buf_puts(x, b, tmp);
    case JV_FLOAT:
        if (isnan(v.u.f)) return buf_puts(x, b, "NaN");
        if (isinf(v.u.f)) return buf_puts(x, b, v.u.f > 0 ? "Infinity" : "-Infinity");
        jinja__put_float(tmp, sizeof tmp, v.u.f);
        return buf_puts(x, b, tmp);
    case JV_STR: return json_str(x, b, v.u.s->s, v.u.s->len, o->ascii);
    case JV_LIST:
        if (v.u.l->kind == JL_LIST || v.u.l->kind == JL_TUPLE) {
            jlist *l = v.u.l;
            if (!l->n) return buf_puts(x, b, "[]");
            int rc = buf_puts(x, b, "[");
            for (size_t i = 0; i < l->n && !rc; i++) {
                if (i) rc = buf_puts(x, b, o->item_sep);
                if (!rc && pretty(o)) rc = json_nl(x, b, o, level + 1);
                if (!rc) rc = json_val(x, b, l->v[i], o, level + 1);
            }
            if (!rc && pretty(o)) rc = json_nl(x, b, o, level);
            return rc ? rc : buf_puts(x, b, "]");
        }
        break;
    case JV_DICT: {
        jdict *d = v.u.d;
        if (!d->n) return buf_puts(x, b, "{}");
        size_t *order = jinja__alloc(x, d->n * sizeof *order);
        if (!order) return PD_EINVAL;
        for (size_t i = 0; i < d->n; i++) order[i] = i;
        int rc = 0;
        if (o->sort) /* insertion sort: stable, and dicts of templates are small */
            for (size_t i = 1; i < d->n && !rc; i++)
                for (size_t j = i; j > 0 && !rc; j--) {
                    int c;
                    rc = jinja__cmp(x, d->k[order[j]], d->k[order[j - 1]], &c);
                    if (rc || c >= 0) break;
                    size_t t = order[j];
                    order[j] = order[j - 1];
                    order[j - 1] = t;
                }
        if (!rc) rc = buf_puts(x, b, "{");
        for (size_t i = 0; i < d->n && !rc; i++) {
            size_t k = order[i];
            if (i) rc = buf_puts(x, b, o->item_sep);
            if (!rc && pretty(o)) rc = json_nl(x, b, o, level + 1);
            if (!rc) rc = json_key(x, b, d->k[k], o);
            if (!rc) rc = buf_puts(x, b, o->key_sep);
            if (!rc) rc = json_val(x, b, d->v[k], o, level + 1);
        }
        if (!rc && pretty(o)) rc = json_nl(x, b, o, level);
        if (!rc) rc = buf_puts(x, b, "}");
        jinja__free(x, order, d->n * sizeof *order);
        return rc;
    }
    default: break;
    }
    return jinja__fail(x, PD_EINVAL, "Object of type %s is not JSON serializable",
                       jinja__type_name(v));
}

int jinja__put_json(jx *x, jbuf *b, jv v, bool ensure_ascii, int indent, const char *indent_str,
                    const char *item_sep, const char *key_sep, bool sort_keys, int depth)
{
    jopts o = {.ascii = ensure_ascii, .sort = sort_keys, .indent = indent,
               .indent_str = indent_str};
    o.item_sep = item_sep ? item_sep : pretty(&o) ? "," : ", ";
    o.key_sep = key_sep ? key_sep : ": ";
    return json_val(x, b, v, &o, depth);
}

int jinja__from_json(jx *x, const json_t *j, jv *out, int depth)
{
    if (depth > JV_DEPTH_MAX)
        return jinja__fail(x, PD_EINVAL, "a variable is nested more than %d levels deep",
                           JV_DEPTH_MAX);
    int rc;
    switch (json_typeof(j)) {
    case JSON_NULL: *out = jv_none(); return 0;
    case JSON_TRUE: *out = jv_bool(true); return 0;
    case JSON_FALSE: *out = jv_bool(false); return 0;
    case JSON_INTEGER: *out = jv_int((int64_t)json_integer_value(j)); return 0;
    case JSON_REAL: *out = jv_float(json_real_value(j)); return 0;
    case JSON_STRING: {
        /* jansson holds valid UTF-8 only: json_string() and its parser refuse anything else */
        return jinja__str_new(x, json_string_value(j), json_string_length(j), out);
    }
    case JSON_ARRAY: {
        if ((rc = jinja__list_new(x, JL_LIST, json_array_size(j), out))) return rc;
        for (size_t i = 0; i < json_array_size(j); i++) {
            jv e;
            if ((rc = jinja__from_json(x, json_array_get(j, i), &e, depth + 1)) ||
                (rc = jinja__list_push(x, out->u.l, e))) {
                jinja__decref(x, *out);
                return rc;
            }
        }
        return 0;
    }
    case JSON_OBJECT: {
        if ((rc = jinja__dict_new(x, out, false))) return rc;
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)j, key, val) {
            jv k, v;
            if ((rc = jinja__str_new(x, key, strlen(key), &k))) break;
            if ((rc = jinja__from_json(x, val, &v, depth + 1))) {
                jinja__decref(x, k);
                break;
            }
            if ((rc = jinja__dict_set(x, out->u.d, k, v))) break;
        }
        if (rc) jinja__decref(x, *out);
        return rc;
    }
    }
    return jinja__fail(x, PD_EINVAL, "unexpected JSON value");
}
