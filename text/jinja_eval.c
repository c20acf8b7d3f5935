/* jinja_eval.c -- The Jinja evaluator: walks the AST with jinja2's semantics (scopes: a for
 * loop's body gets a fresh scope every iteration, `if` none, macros see the template's
 * top-level variables; Python operators; attribute and item lookup as jinja2's sandbox does
 * it; macros, call blocks, loop controls) and counts every step, byte and call against the
 * render's limits. Entry point: jinja_render. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/jinja_impl.h"

enum { JX_BREAK = 1, JX_CONTINUE = 2 };
enum { MAX_RECURSION = 1200 }; /* C frames of eval/exec nested, whatever the template */

int jinja__fail(jx *x, int code, const char *fmt, ...)
{
    if (x->failed) return code;
    x->failed = true;
    char msg[PD_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pd_errf(x->err, code, "line %d: %s", x->line, msg);
    return code;
}

int jinja__raise(jx *x, const char *msg, size_t len)
{
    if (x->failed) return PD_EINVAL;
    x->failed = true;
    len = strnlen(msg, len); /* the message ends at an embedded NUL, as the error text does */
    if (!len) /* raise_exception("") or of an undefined value: still a message that says so */
        return pd_errf(x->err, PD_EINVAL, "the template raised an exception with an empty message");
    pd_errf(x->err, PD_EINVAL, "%.*s", (int)(len > PD_ERR_LEN - 1 ? PD_ERR_LEN - 1 : len), msg);
    return PD_EINVAL;
}

static int fail_undef(jx *x, jv u)
{
    if (u.flags & JVF_UNSAFE)
        return jinja__fail(x, PD_EINVAL, "access to attribute '%s' is unsafe (the sandbox blocks it)",
                           u.u.hint ? u.u.hint : "?");
    if (u.u.hint) return jinja__fail(x, PD_EINVAL, "'%s' is undefined", u.u.hint);
    return jinja__fail(x, PD_EINVAL, "an undefined value was used");
}

int jinja__charge(jx *x, uint64_t n)
{
    x->steps += n;
    if (x->steps > x->max_steps)
        return jinja__fail(x, PD_EINVAL, "the template took more than %llu steps",
                           (unsigned long long)x->max_steps);
    return 0;
}

static int step(jx *x, const jnode *n)
{
    x->line = n->line;
    return jinja__charge(x, 1);
}

/* ---- scopes ---- */
static const jv *scope_find(const jscope *s, const jstr *k)
{
    for (; s; s = s->parent)
        for (int i = s->n - 1; i >= 0; i--)
            if (s->k[i] == k) return &s->v[i];
    return NULL;
}

/* Binds k to v in s (takes v). */
static int scope_set(jx *x, jscope *s, const jstr *k, jv v)
{
    for (int i = 0; i < s->n; i++)
        if (s->k[i] == k) {
            jinja__decref(x, s->v[i]);
            s->v[i] = v;
            return 0;
        }
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 8;
        const jstr **nk = jinja__alloc(x, (size_t)cap * sizeof *nk);
        jv *nv = nk ? jinja__alloc(x, (size_t)cap * sizeof *nv) : NULL;
        if (!nv) {
            jinja__free(x, nk, (size_t)cap * sizeof *nk);
            jinja__decref(x, v);
            return PD_EINVAL;
        }
        if (s->n) {
            memcpy(nk, s->k, (size_t)s->n * sizeof *nk);
            memcpy(nv, s->v, (size_t)s->n * sizeof *nv);
        }
        jinja__free(x, s->k, (size_t)s->cap * sizeof *s->k);
        jinja__free(x, s->v, (size_t)s->cap * sizeof *s->v);
        s->k = nk;
        s->v = nv;
        s->cap = cap;
    }
    s->k[s->n] = k;
    s->v[s->n++] = v;
    return 0;
}

static void scope_clear(jx *x, jscope *s)
{
    for (int i = 0; i < s->n; i++) jinja__decref(x, s->v[i]);
    s->n = 0;
}

static void scope_free(jx *x, jscope *s)
{
    scope_clear(x, s);
    jinja__free(x, s->k, (size_t)s->cap * sizeof *s->k);
    jinja__free(x, s->v, (size_t)s->cap * sizeof *s->v);
    s->k = NULL;
    s->v = NULL;
    s->cap = 0;
}

/* ---- lookups ---- */
static int make_method(jx *x, int id, jv self, jv *out)
{
    int rc = jinja__func_new(x, FN_METHOD, id, NULL, out);
    if (rc) return rc;
    jinja__incref(self);
    out->u.fn->self = self;
    return 0;
}

static jv unsafe_undef(const char *hint)
{
    jv u = jv_undef(hint);
    u.flags = JVF_UNSAFE;
    return u;
}

static int loop_attr(jx *x, jloop *lp, const char *name, size_t len, const char *hint, jv *out)
{
#define IS(s) (len == sizeof(s) - 1 && memcmp(name, s, len) == 0)
    int64_t i = lp->index0, n = lp->length;
    if (IS("index")) *out = jv_int(i + 1);
    else if (IS("index0")) *out = jv_int(i);
    else if (IS("revindex")) *out = jv_int(n - i);
    else if (IS("revindex0")) *out = jv_int(n - i - 1);
    else if (IS("first")) *out = jv_bool(i == 0);
    else if (IS("last")) *out = jv_bool(i == n - 1);
    else if (IS("length")) *out = jv_int(n);
    else if (IS("depth")) *out = jv_int(1);
    else if (IS("depth0")) *out = jv_int(0);
    else if (IS("previtem") || IS("nextitem")) {
        int64_t k = IS("previtem") ? i - 1 : i + 1;
        if (k < 0 || k >= n) {
            *out = jv_undef(hint);
        } else {
            *out = lp->items->v[k];
            jinja__incref(*out);
        }
    } else {
        bool unsafe;
        jv self = {.t = JV_LOOP};
        self.u.lp = lp;
        int id = jinja__method_id(JV_LOOP, name, len, &unsafe);
        if (id >= 0) return make_method(x, id, self, out);
        *out = jv_undef(hint);
    }
    return 0;
#undef IS
}

int jinja__getattr(jx *x, jv obj, const char *name, size_t len, const char *hint, jv *out)
{
    if (obj.t == JV_UNDEF) return fail_undef(x, obj);
    if (obj.t == JV_LOOP) return loop_attr(x, obj.u.lp, name, len, hint, out);
    bool unsafe = false;
    int id = jinja__method_id(obj.t == JV_LIST ? JV_LIST : obj.t, name, len, &unsafe);
    if (id >= 0) return make_method(x, id, obj, out);
    if (unsafe || (len >= 2 && name[0] == '_' && name[1] == '_')) {
        *out = unsafe_undef(hint);
        return 0;
    }
    if (obj.t == JV_DICT || obj.t == JV_NS) {
        const jv *v = jinja__dict_get_str(obj.u.d, name, len);
        if (v) {
            *out = *v;
            jinja__incref(*out);
            return 0;
        }
    }
    *out = jv_undef(hint);
    return 0;
}

static bool as_index(jv k, int64_t *i)
{
    if (k.t == JV_INT) *i = k.u.i;
    else if (k.t == JV_BOOL) *i = k.u.b;
    else return false;
    return true;
}

int jinja__getitem(jx *x, jv obj, jv key, jv *out)
{
    if (obj.t == JV_UNDEF) return fail_undef(x, obj);
    const char *hint = key.t == JV_STR && key.u.s->rc < 0 ? key.u.s->s : NULL;
    int64_t i;
    if (obj.t == JV_LIST && (obj.u.l->kind == JL_LIST || obj.u.l->kind == JL_TUPLE) &&
        as_index(key, &i)) {
        jlist *l = obj.u.l;
        if (i < 0) i += (int64_t)l->n;
        if (i < 0 || i >= (int64_t)l->n) {
            *out = jv_undef(NULL);
        } else {
            *out = l->v[i];
            jinja__incref(*out);
        }
        return 0;
    }
    if (obj.t == JV_STR && as_index(key, &i)) {
        const jstr *s = obj.u.s;
        if (i < 0) i += (int64_t)s->ncp;
        if (i < 0 || i >= (int64_t)s->ncp) {
            *out = jv_undef(NULL);
            return 0;
        }
        size_t a = jinja__u8_offset(s, (size_t)i), b = a;
        jinja__u8_next(s->s, s->len, &b);
        return jinja__str_new(x, s->s + a, b - a, out);
    }
    if (obj.t == JV_DICT) {
        const jv *v = jinja__dict_get(x, obj.u.d, key);
        if (x->failed) return PD_EINVAL;
        if (v) {
            *out = *v;
            jinja__incref(*out);
            return 0;
        }
    }
    if (key.t == JV_STR) return jinja__getattr(x, obj, key.u.s->s, key.u.s->len, hint, out);
    *out = jv_undef(NULL);
    return 0;
}

/* Python's slice index adjustment (PySlice_AdjustIndices). */
static int64_t slice_len(int64_t len, int64_t *start, int64_t *stop, int64_t step)
{
    if (*start < 0) {
        *start += len;
        if (*start < 0) *start = step < 0 ? -1 : 0;
    } else if (*start >= len) {
        *start = step < 0 ? len - 1 : len;
    }
    if (*stop < 0) {
        *stop += len;
        if (*stop < 0) *stop = step < 0 ? -1 : 0;
    } else if (*stop >= len) {
        *stop = step < 0 ? len - 1 : len;
    }
    if (step < 0) return *stop < *start ? (*start - *stop - 1) / (-step) + 1 : 0;
    return *start < *stop ? (*stop - *start - 1) / step + 1 : 0;
}

static int do_slice(jx *x, jv obj, jv lo, jv hi, jv st, jv *out)
{
    int64_t start = 0, stop = 0, step = 1;
    bool ok = (lo.t == JV_NONE || as_index(lo, &start)) && (hi.t == JV_NONE || as_index(hi, &stop)) &&
              (st.t == JV_NONE || as_index(st, &step));
    bool seq = obj.t == JV_STR ||
               (obj.t == JV_LIST && (obj.u.l->kind == JL_LIST || obj.u.l->kind == JL_TUPLE));
    if (obj.t == JV_UNDEF) return fail_undef(x, obj);
    if (!ok || !seq) {
        *out = jv_undef(NULL);
        return 0;
    }
    if (step == 0) return jinja__fail(x, PD_EINVAL, "slice step cannot be zero");
    if (step == INT64_MIN) step = -INT64_MAX;
    int64_t len = obj.t == JV_STR ? (int64_t)obj.u.s->ncp : (int64_t)obj.u.l->n;
    if (lo.t == JV_NONE) start = step < 0 ? INT64_MAX : 0;
    if (hi.t == JV_NONE) stop = step < 0 ? INT64_MIN : INT64_MAX;
    if (start < -len - 1) start = -len - 1;
    if (stop < -len - 1) stop = -len - 1;
    int64_t n = slice_len(len, &start, &stop, step);
    if (obj.t == JV_LIST) {
        int rc = jinja__list_new(x, obj.u.l->kind, (size_t)n, out);
        for (int64_t k = 0; k < n && !rc; k++) {
            jv e = obj.u.l->v[start + k * step];
            jinja__incref(e);
            rc = jinja__list_push(x, out->u.l, e);
        }
        if (rc && out->t == JV_LIST) jinja__decref(x, *out);
        return rc;
    }
    const jstr *s = obj.u.s;
    if (step == 1) {
        size_t a = jinja__u8_offset(s, (size_t)start), b = jinja__u8_offset(s, (size_t)(start + n));
        return jinja__str_new(x, s->s + a, b - a, out);
    }
    /* offsets of every code point, then pick */
    size_t *offs = jinja__alloc(x, (s->ncp + 1) * sizeof *offs);
    if (!offs) return PD_EINVAL;
    size_t i = 0, k = 0;
    while (i < s->len) {
        offs[k++] = i;
        jinja__u8_next(s->s, s->len, &i);
    }
    offs[k] = s->len;
    jbuf b = {0};
    int rc = 0;
    for (int64_t m = 0; m < n && !rc; m++) {
        int64_t c = start + m * step;
        rc = jinja__buf_put(x, &b, s->s + offs[c], offs[c + 1] - offs[c]);
    }
    jinja__free(x, offs, (s->ncp + 1) * sizeof *offs);
    if (rc) {
        jinja__buf_free(x, &b);
        return rc;
    }
    return jinja__str_from_buf(x, &b, out);
}

int jinja__iter_list(jx *x, jv v, jlist **out)
{
    jv l;
    int rc;
    switch (v.t) {
    case JV_UNDEF:
        if ((rc = jinja__list_new(x, JL_LIST, 0, &l))) return rc;
        *out = l.u.l;
        return 0;
    case JV_LIST:
        if (v.u.l->kind != JL_GEN) {
            jinja__incref(v);
            *out = v.u.l;
            return 0;
        }
        if ((rc = jinja__list_new(x, JL_LIST, v.u.l->n - v.u.l->pos, &l))) return rc;
        for (size_t i = v.u.l->pos; i < v.u.l->n && !rc; i++) {
            jinja__incref(v.u.l->v[i]);
            rc = jinja__list_push(x, l.u.l, v.u.l->v[i]);
        }
        v.u.l->pos = v.u.l->n;
        break;
    case JV_STR: {
        const jstr *s = v.u.s;
        if ((rc = jinja__list_new(x, JL_LIST, s->ncp, &l))) return rc;
        for (size_t i = 0; i < s->len && !rc;) {
            size_t j = i;
            jinja__u8_next(s->s, s->len, &j);
            jv c;
            if (!(rc = jinja__str_new(x, s->s + i, j - i, &c))) rc = jinja__list_push(x, l.u.l, c);
            i = j;
        }
        break;
    }
    case JV_DICT:
        if ((rc = jinja__list_new(x, JL_LIST, v.u.d->n, &l))) return rc;
        for (size_t i = 0; i < v.u.d->n && !rc; i++) {
            jinja__incref(v.u.d->k[i]);
            rc = jinja__list_push(x, l.u.l, v.u.d->k[i]);
        }
        break;
    default:
        return jinja__fail(x, PD_EINVAL, "'%s' object is not iterable", jinja__type_name(v));
    }
    if (rc) {
        jinja__decref(x, l);
        return rc;
    }
    *out = l.u.l;
    return 0;
}

int jinja__contains(jx *x, jv c, jv item, bool *in)
{
    *in = false;
    if (c.t == JV_STR) {
        if (jinja__charge(x, c.u.s->len / 256)) return PD_EINVAL;
        if (item.t != JV_STR) {
            if (item.t == JV_UNDEF) return fail_undef(x, item);
            return jinja__fail(x, PD_EINVAL, "'in <string>' requires string as left operand, not %s",
                               jinja__type_name(item));
        }
        *in = item.u.s->len == 0 ||
              memmem(c.u.s->s, c.u.s->len, item.u.s->s, item.u.s->len) != NULL;
        return 0;
    }
    if (c.t == JV_DICT) {
        const jv *v = jinja__dict_get(x, c.u.d, item);
        if (x->failed) return PD_EINVAL;
        *in = v != NULL;
        return 0;
    }
    if (c.t == JV_UNDEF) return 0;
    if (c.t != JV_LIST)
        return jinja__fail(x, PD_EINVAL, "argument of type '%s' is not iterable",
                           jinja__type_name(c));
    jlist *l = c.u.l;
    for (size_t i = l->kind == JL_GEN ? l->pos : 0; i < l->n; i++) {
        int rc = jinja__eq(x, l->v[i], item, in);
        if (rc) return rc;
        if (*in) {
            if (l->kind == JL_GEN) l->pos = i + 1;
            return 0;
        }
    }
    if (l->kind == JL_GEN) l->pos = l->n;
    return 0;
}

/* ---- operators ---- */
static bool is_num(jv v) { return v.t == JV_BOOL || v.t == JV_INT || v.t == JV_FLOAT; }
static double fnum(jv v) { return v.t == JV_FLOAT ? v.u.f : v.t == JV_INT ? (double)v.u.i : v.u.b; }
static int64_t inum(jv v) { return v.t == JV_INT ? v.u.i : v.u.b; }

static int type_error(jx *x, int op, jv a, jv b)
{
    static const char *const names[] = {[JOP_ADD] = "+", [JOP_SUB] = "-", [JOP_MUL] = "*",
                                        [JOP_DIV] = "/", [JOP_FLOORDIV] = "//", [JOP_MOD] = "%",
                                        [JOP_POW] = "**"};
    if (a.t == JV_UNDEF) return fail_undef(x, a);
    if (b.t == JV_UNDEF) return fail_undef(x, b);
    return jinja__fail(x, PD_EINVAL, "unsupported operand type(s) for %s: '%s' and '%s'",
                       op > 0 && op <= JOP_POW ? names[op] : "?", jinja__type_name(a),
                       jinja__type_name(b));
}

static int overflow(jx *x) { return jinja__fail(x, PD_EINVAL, "integer overflow"); }

/* s * n for strings and lists */
static int repeat(jx *x, jv s, int64_t n, jv *out)
{
    if (n < 0) n = 0;
    if (s.t == JV_STR) {
        if (n && s.u.s->len > x->max_out / (uint64_t)n)
            return jinja__fail(x, PD_EINVAL, "a string of the template is larger than %zu bytes",
                               x->max_out);
        jbuf b = {0};
        int rc = 0;
        for (int64_t i = 0; i < n && !rc; i++) rc = jinja__buf_put(x, &b, s.u.s->s, s.u.s->len);
        if (rc) {
            jinja__buf_free(x, &b);
            return rc;
        }
        return jinja__str_from_buf(x, &b, out);
    }
    jlist *l = s.u.l;
    if (n && l->n > (x->max_out / sizeof(jv)) / (uint64_t)n)
        return jinja__fail(x, PD_EINVAL, "a list of the template is too long");
    int rc = jinja__list_new(x, l->kind, l->n * (size_t)n, out);
    for (int64_t i = 0; i < n && !rc; i++)
        for (size_t k = 0; k < l->n && !rc; k++) {
            jinja__incref(l->v[k]);
            rc = jinja__list_push(x, out->u.l, l->v[k]);
        }
    if (rc && out->t == JV_LIST) jinja__decref(x, *out);
    return rc;
}

static int float_divmod(jx *x, double a, double b, double *div, double *mod)
{
    if (b == 0) return jinja__fail(x, PD_EINVAL, "float division by zero");
    double m = fmod(a, b), d = (a - m) / b;
    if (m != 0) {
        if ((b < 0) != (m < 0)) {
            m += b;
            d -= 1.0;
        }
    } else {
        m = copysign(0.0, b);
    }
    double f;
    if (d != 0) {
        f = floor(d);
        if (d - f > 0.5) f += 1.0;
    } else {
        f = copysign(0.0, a / b);
    }
    *div = f;
    *mod = m;
    return 0;
}

int jinja__binop(jx *x, int op, jv a, jv b, jv *out)
{
    if (is_num(a) && is_num(b)) {
        bool fl = a.t == JV_FLOAT || b.t == JV_FLOAT;
        int64_t p = fl ? 0 : inum(a), q = fl ? 0 : inum(b), r;
        double f = fnum(a), g = fnum(b);
        switch (op) {
        case JOP_ADD:
            if (fl) *out = jv_float(f + g);
            else if (__builtin_add_overflow(p, q, &r)) return overflow(x);
            else *out = jv_int(r);
            return 0;
        case JOP_SUB:
            if (fl) *out = jv_float(f - g);
            else if (__builtin_sub_overflow(p, q, &r)) return overflow(x);
            else *out = jv_int(r);
            return 0;
        case JOP_MUL:
            if (fl) *out = jv_float(f * g);
            else if (__builtin_mul_overflow(p, q, &r)) return overflow(x);
            else *out = jv_int(r);
            return 0;
        case JOP_DIV:
            if (g == 0) return jinja__fail(x, PD_EINVAL, "division by zero");
            *out = jv_float(f / g);
            return 0;
        case JOP_FLOORDIV:
        case JOP_MOD:
            if (fl) {
                double d = 0, m = 0;
                if (float_divmod(x, f, g, &d, &m)) return PD_EINVAL;
                *out = jv_float(op == JOP_MOD ? m : d);
                return 0;
            }
            if (q == 0)
                return jinja__fail(x, PD_EINVAL, "integer division or modulo by zero");
            if (p == INT64_MIN && q == -1) {
                if (op == JOP_MOD) *out = jv_int(0);
                else return overflow(x);
                return 0;
            }
            r = p / q;
            if ((p % q != 0) && ((p < 0) != (q < 0))) r--;
            *out = jv_int(op == JOP_MOD ? p - r * q : r);
            return 0;
        case JOP_POW:
            if (!fl && q >= 0) {
                int64_t acc = 1, base = p;
                for (int64_t e = q; e > 0; e >>= 1) {
                    if ((e & 1) && __builtin_mul_overflow(acc, base, &acc)) return overflow(x);
                    if (e > 1 && __builtin_mul_overflow(base, base, &base)) return overflow(x);
                }
                *out = jv_int(acc);
                return 0;
            }
            if (f == 0 && g < 0)
                return jinja__fail(x, PD_EINVAL, "0.0 cannot be raised to a negative power");
            *out = jv_float(pow(f, g));
            if (isnan(out->u.f) && !isnan(f) && !isnan(g))
                return jinja__fail(x, PD_EINVAL, "a negative number raised to a fractional power");
            return 0;
        default: break;
        }
        return type_error(x, op, a, b);
    }
    if (op == JOP_ADD && a.t == JV_STR && b.t == JV_STR) {
        if (!b.u.s->len || !a.u.s->len) {
            *out = a.u.s->len ? a : b;
            jinja__incref(*out);
            return 0;
        }
        jbuf buf = {0};
        int rc = jinja__buf_put(x, &buf, a.u.s->s, a.u.s->len);
        if (!rc) rc = jinja__buf_put(x, &buf, b.u.s->s, b.u.s->len);
        if (rc) {
            jinja__buf_free(x, &buf);
            return rc;
        }
        return jinja__str_from_buf(x, &buf, out);
    }
    if (op == JOP_ADD && a.t == JV_LIST && b.t == JV_LIST && a.u.l->kind == b.u.l->kind &&
        (a.u.l->kind == JL_LIST || a.u.l->kind == JL_TUPLE)) {
        int rc = jinja__list_new(x, a.u.l->kind, a.u.l->n + b.u.l->n, out);
        for (size_t i = 0; i < a.u.l->n + b.u.l->n && !rc; i++) {
            jv e = i < a.u.l->n ? a.u.l->v[i] : b.u.l->v[i - a.u.l->n];
            jinja__incref(e);
            rc = jinja__list_push(x, out->u.l, e);
        }
        if (rc && out->t == JV_LIST) jinja__decref(x, *out);
        return rc;
    }
    if (op == JOP_MUL) {
        bool sa = a.t == JV_STR || (a.t == JV_LIST && (a.u.l->kind == JL_LIST || a.u.l->kind == JL_TUPLE));
        bool sb = b.t == JV_STR || (b.t == JV_LIST && (b.u.l->kind == JL_LIST || b.u.l->kind == JL_TUPLE));
        if (sa && (b.t == JV_INT || b.t == JV_BOOL)) return repeat(x, a, inum(b), out);
        if (sb && (a.t == JV_INT || a.t == JV_BOOL)) return repeat(x, b, inum(a), out);
    }
    if (op == JOP_MOD && a.t == JV_STR) return jinja__format_percent(x, a, b, out);
    return type_error(x, op, a, b);
}

/* ---- calls ---- */
static int exec_body(jx *x, const jnode *body);

/* Renders body in scope sc (its parent set by the caller) into a new string. */
static int render_in(jx *x, const jnode *body, jscope *sc, jv *out)
{
    jscope *saved_scope = x->scope;
    jbuf *saved_out = x->out;
    jbuf b = {0};
    x->scope = sc;
    x->out = &b;
    int rc = exec_body(x, body);
    x->scope = saved_scope;
    x->out = saved_out;
    if (rc < 0) {
        jinja__buf_free(x, &b);
        return rc;
    }
    return jinja__str_from_buf(x, &b, out);
}

static const jv *kw_find(const jstr *const *kwn, const jv *kwv, int nkw, const jstr *name)
{
    for (int i = 0; i < nkw; i++)
        if (kwn[i] == name || (kwn[i]->len == name->len && memcmp(kwn[i]->s, name->s, name->len) == 0))
            return &kwv[i];
    return NULL;
}

/* Binds a macro's (or caller's) parameters in sc as jinja2 does. */
static int bind_params(jx *x, const jnode *def, const char *what, jscope *sc, const jv *args,
                       int nargs, const jstr *const *kwn, const jv *kwv, int nkw, bool is_macro)
{
    int rc;
    for (int i = 0; i < def->n_names; i++) {
        const jstr *pn = def->names[i];
        const jv *kv = kw_find(kwn, kwv, nkw, pn);
        jv v;
        if (i < nargs) {
            if (kv)
                return jinja__fail(x, PD_EINVAL, "macro '%s' got multiple values for argument '%s'",
                                   what, pn->s);
            v = args[i];
            jinja__incref(v);
        } else if (kv) {
            v = *kv;
            jinja__incref(v);
        } else if (def->kw && def->kw[i]) {
            jscope *saved = x->scope;
            x->scope = sc;
            rc = jinja__eval(x, def->kw[i], &v);
            x->scope = saved;
            if (rc) return rc;
        } else {
            v = jv_undef(pn->s);
        }
        if ((rc = scope_set(x, sc, pn, v))) return rc;
    }
    uint8_t uses = is_macro ? def->op : (MACRO_USES_VARARGS | MACRO_USES_KWARGS);
    const jinja_template *t = x->t;
    if (nargs > def->n_names && !(uses & MACRO_USES_VARARGS))
        return jinja__fail(x, PD_EINVAL, "macro '%s' takes not more than %d argument(s)", what,
                           def->n_names);
    if (uses & MACRO_USES_VARARGS) {
        jv va;
        if ((rc = jinja__list_new(x, JL_TUPLE, 0, &va))) return rc;
        for (int i = def->n_names; i < nargs && !rc; i++) {
            jinja__incref(args[i]);
            rc = jinja__list_push(x, va.u.l, args[i]);
        }
        if (rc || (rc = scope_set(x, sc, t->a_varargs, va))) {
            if (rc && va.t == JV_LIST && !x->failed) jinja__decref(x, va);
            return rc;
        }
    }
    jv kd = jv_none();
    if (uses & MACRO_USES_KWARGS && (rc = jinja__dict_new(x, &kd, false))) return rc;
    for (int i = 0; i < nkw; i++) {
        if (kwn[i] == t->a_caller) continue;
        bool param = false;
        for (int k = 0; k < def->n_names; k++) param |= def->names[k] == kwn[i];
        if (param) continue;
        if (!(uses & MACRO_USES_KWARGS)) {
            return jinja__fail(x, PD_EINVAL, "macro '%s' takes no keyword argument '%s'", what,
                               kwn[i]->s);
        }
        jv k = {.t = JV_STR};
        k.u.s = (jstr *)kwn[i];
        jinja__incref(kwv[i]);
        if ((rc = jinja__dict_set(x, kd.u.d, k, kwv[i]))) {
            jinja__decref(x, kd);
            return rc;
        }
    }
    if (uses & MACRO_USES_KWARGS && (rc = scope_set(x, sc, t->a_kwargs, kd))) return rc;
    if (is_macro) {
        const jv *c = kw_find(kwn, kwv, nkw, t->a_caller);
        if (c) {
            jinja__incref(*c);
            if ((rc = scope_set(x, sc, t->a_caller, *c))) return rc;
        }
    }
    return 0;
}

static int call_def(jx *x, const jfunc *f, const jv *args, int nargs, const jstr *const *kwn,
                    const jv *kwv, int nkw, jv *out)
{
    bool macro = f->kind == FN_MACRO;
    if (!macro && !f->scope)
        return jinja__fail(x, PD_EINVAL, "caller() called after its call block ended");
    if (x->depth >= x->max_depth)
        return jinja__fail(x, PD_EINVAL, "macro calls nested deeper than %d", x->max_depth);
    x->depth++;
    const jnode *def = f->node;
    jscope sc = {.parent = macro ? x->root : f->scope};
    int rc = bind_params(x, def, macro ? def->str->s : "caller", &sc, args, nargs, kwn, kwv, nkw,
                         macro);
    if (!rc) rc = render_in(x, def->c, &sc, out);
    scope_free(x, &sc);
    x->depth--;
    return rc;
}

int jinja__call(jx *x, jv fn, const jv *args, int nargs, const jstr *const *kwn, const jv *kwv,
                int nkw, jv *out)
{
    jargs a = {.pos = args, .npos = nargs, .kwn = kwn, .kwv = kwv, .nkw = nkw};
    if (fn.t == JV_UNDEF) return fail_undef(x, fn);
    if (fn.t != JV_FUNC)
        return jinja__fail(x, PD_EINVAL, "'%s' object is not callable", jinja__type_name(fn));
    switch (fn.u.fn->kind) {
    case FN_GLOBAL: return jinja__call_global(x, fn.u.fn->id, &a, out);
    case FN_METHOD: return jinja__call_method(x, fn.u.fn->id, fn.u.fn->self, &a, out);
    default: return call_def(x, fn.u.fn, args, nargs, kwn, kwv, nkw, out);
    }
}

/* ---- expressions ---- */
typedef struct {
    jv pos[16];
    jv kw[16];
    jv *pv, *kv; /* pos / kw, or heap arrays for long argument lists */
    int npos, nkw;
} evargs;

static void args_free(jx *x, evargs *e)
{
    for (int i = 0; i < e->npos; i++) jinja__decref(x, e->pv[i]);
    for (int i = 0; i < e->nkw; i++) jinja__decref(x, e->kv[i]);
    if (e->pv != e->pos) free(e->pv);
    if (e->kv != e->kw) free(e->kv);
}

static int eval_args(jx *x, const jnode *n, evargs *e)
{
    e->pv = e->pos;
    e->kv = e->kw;
    e->npos = e->nkw = 0;
    if (n->n_kids > 16 && !(e->pv = malloc((size_t)n->n_kids * sizeof(jv))))
        return jinja__fail(x, PD_ENOMEM, "out of memory");
    if (n->n_names > 16 && !(e->kv = malloc((size_t)n->n_names * sizeof(jv))))
        return jinja__fail(x, PD_ENOMEM, "out of memory");
    for (int i = 0; i < n->n_kids; i++) {
        int rc = jinja__eval(x, n->kids[i], &e->pv[i]);
        if (rc) return rc;
        e->npos++;
    }
    for (int i = 0; i < n->n_names; i++) {
        int rc = jinja__eval(x, n->kw[i], &e->kv[i]);
        if (rc) return rc;
        e->nkw++;
    }
    return 0;
}

static int eval_compare(jx *x, const jnode *n, jv *out)
{
    jv left;
    int rc = jinja__eval(x, n->a, &left);
    if (rc) return rc;
    bool result = true;
    for (int i = 0; i < n->n_kids && result; i++) {
        const jnode *o = n->kids[i];
        jv right;
        if ((rc = jinja__eval(x, o->a, &right))) break;
        int c = 0;
        bool eq;
        switch (o->op) {
        case JOP_EQ: rc = jinja__eq(x, left, right, &result); break;
        case JOP_NE:
            rc = jinja__eq(x, left, right, &eq);
            result = !eq;
            break;
        case JOP_IN: rc = jinja__contains(x, right, left, &result); break;
        case JOP_NOTIN:
            rc = jinja__contains(x, right, left, &eq);
            result = !eq;
            break;
        default:
            rc = jinja__cmp(x, left, right, &c);
            if (!rc) {
                bool nan = (left.t == JV_FLOAT && isnan(left.u.f)) ||
                           (right.t == JV_FLOAT && isnan(right.u.f));
                result = nan ? false
                         : o->op == JOP_LT ? c < 0
                         : o->op == JOP_LE ? c <= 0
                         : o->op == JOP_GT ? c > 0
                                           : c >= 0;
            }
        }
        jinja__decref(x, left);
        left = right;
        if (rc) break;
    }
    jinja__decref(x, left);
    if (rc) return rc;
    *out = jv_bool(result);
    return 0;
}

int jinja__eval(jx *x, const jnode *n, jv *out)
{
    int rc = step(x, n);
    if (rc) return rc;
    if (++x->rdepth > MAX_RECURSION) {
        x->rdepth--;
        return jinja__fail(x, PD_EINVAL, "the template recursed more than %d levels", MAX_RECURSION);
    }
    jv a = jv_undef(NULL), b = jv_undef(NULL);
    evargs ea = {.npos = 0, .nkw = 0};
    ea.pv = ea.pos;
    ea.kv = ea.kw;
    switch (n->kind) {
    case N_CONST: *out = n->cval; break;
    case N_NAME: {
        const jv *v = scope_find(x->scope, n->str);
        if (v) {
            *out = *v;
            jinja__incref(*out);
        } else if (n->id >= 0) {
            rc = jinja__func_new(x, FN_GLOBAL, n->id, NULL, out);
        } else {
            *out = jv_undef(n->str->s);
        }
        break;
    }
    case N_GETATTR:
        if (!(rc = jinja__eval(x, n->a, &a)))
            rc = jinja__getattr(x, a, n->str->s, n->str->len, n->str->s, out);
        break;
    case N_GETITEM:
        if ((rc = jinja__eval(x, n->a, &a))) break;
        if (n->b->kind == N_SLICE) {
            jv s[3] = {jv_none(), jv_none(), jv_none()};
            const jnode *parts[3] = {n->b->a, n->b->b, n->b->c};
            for (int i = 0; i < 3 && !rc; i++)
                if (parts[i]) rc = jinja__eval(x, parts[i], &s[i]);
            if (!rc) rc = do_slice(x, a, s[0], s[1], s[2], out);
            for (int i = 0; i < 3; i++) jinja__decref(x, s[i]);
        } else if (!(rc = jinja__eval(x, n->b, &b))) {
            rc = jinja__getitem(x, a, b, out);
        }
        break;
    case N_CALL:
        if ((rc = jinja__eval(x, n->a, &a)) || (rc = eval_args(x, n, &ea))) break;
        rc = jinja__call(x, a, ea.pv, ea.npos, n->names, ea.kv, ea.nkw, out);
        break;
    case N_FILTER: {
        if (n->a) rc = jinja__eval(x, n->a, &a);
        else {
            a = x->block_input;
            jinja__incref(a);
        }
        if (rc || (rc = eval_args(x, n, &ea))) break;
        jargs ja = {.pos = ea.pv, .npos = ea.npos, .kwn = n->names, .kwv = ea.kv, .nkw = ea.nkw};
        rc = jinja__filter(x, n->id, n->str->s, a, &ja, out);
        break;
    }
    case N_TEST: {
        bool r;
        if ((rc = jinja__eval(x, n->a, &a)) || (rc = eval_args(x, n, &ea))) break;
        jargs ja = {.pos = ea.pv, .npos = ea.npos, .kwn = n->names, .kwv = ea.kv, .nkw = ea.nkw};
        if (!(rc = jinja__test(x, n->id, n->str->s, a, &ja, &r))) *out = jv_bool(r);
        break;
    }
    case N_NOT:
        if (!(rc = jinja__eval(x, n->a, &a))) *out = jv_bool(!jinja__truthy(a));
        break;
    case N_NEG:
    case N_POS:
        if ((rc = jinja__eval(x, n->a, &a))) break;
        if (a.t == JV_FLOAT) *out = jv_float(n->kind == N_NEG ? -a.u.f : a.u.f);
        else if (a.t == JV_INT || a.t == JV_BOOL) {
            int64_t i = inum(a);
            if (n->kind == N_NEG && i == INT64_MIN) rc = overflow(x);
            else *out = jv_int(n->kind == N_NEG ? -i : i);
        } else if (a.t == JV_UNDEF) {
            rc = fail_undef(x, a);
        } else {
            rc = jinja__fail(x, PD_EINVAL, "bad operand type for unary %s: '%s'",
                             n->kind == N_NEG ? "-" : "+", jinja__type_name(a));
        }
        break;
    case N_BINOP:
        if (!(rc = jinja__eval(x, n->a, &a)) && !(rc = jinja__eval(x, n->b, &b)))
            rc = jinja__binop(x, n->op, a, b, out);
        break;
    case N_AND:
    case N_OR:
        if ((rc = jinja__eval(x, n->a, &a))) break;
        if (jinja__truthy(a) == (n->kind == N_OR)) {
            *out = a;
            a = jv_undef(NULL);
        } else {
            rc = jinja__eval(x, n->b, out);
        }
        break;
    case N_CONCAT: {
        jbuf buf = {0};
        for (int i = 0; i < n->n_kids && !rc; i++) {
            jv v;
            if ((rc = jinja__eval(x, n->kids[i], &v))) break;
            rc = jinja__put_str(x, &buf, v);
            jinja__decref(x, v);
        }
        if (rc) jinja__buf_free(x, &buf);
        else rc = jinja__str_from_buf(x, &buf, out);
        break;
    }
    case N_COMPARE: rc = eval_compare(x, n, out); break;
    case N_COND:
        if ((rc = jinja__eval(x, n->a, &a))) break;
        if (jinja__truthy(a)) rc = jinja__eval(x, n->b, out);
        else if (n->c) rc = jinja__eval(x, n->c, out);
        else *out = jv_undef(NULL);
        break;
    case N_LIST:
    case N_TUPLE:
        if ((rc = jinja__list_new(x, n->kind == N_LIST ? JL_LIST : JL_TUPLE, (size_t)n->n_kids, &a)))
            break;
        for (int i = 0; i < n->n_kids && !rc; i++) {
            jv v;
            if (!(rc = jinja__eval(x, n->kids[i], &v))) rc = jinja__list_push(x, a.u.l, v);
        }
        if (!rc) {
            *out = a;
            a = jv_undef(NULL);
        }
        break;
    case N_DICT:
        if ((rc = jinja__dict_new(x, &a, false))) break;
        for (int i = 0; i + 1 < n->n_kids && !rc; i += 2) {
            jv k, v;
            if ((rc = jinja__eval(x, n->kids[i], &k))) break;
            if ((rc = jinja__eval(x, n->kids[i + 1], &v))) {
                jinja__decref(x, k);
                break;
            }
            rc = jinja__dict_set(x, a.u.d, k, v);
        }
        if (!rc) {
            *out = a;
            a = jv_undef(NULL);
        }
        break;
    default: rc = jinja__fail(x, PD_EINVAL, "internal error: node %d is not an expression", n->kind);
    }
    args_free(x, &ea);
    jinja__decref(x, a);
    jinja__decref(x, b);
    x->rdepth--;
    if (rc) *out = jv_undef(NULL); /* whatever a failed callee left there is not ours */
    return rc;
}

/* ---- statements ---- */
static int out_value(jx *x, jv v) { return jinja__put_str(x, x->out, v); }

static int unpack(jx *x, jscope *sc, const jnode *n, jv v)
{
    if (n->n_names == 1 && !n->op) {
        jinja__incref(v);
        return scope_set(x, sc, n->names[0], v);
    }
    jlist *l;
    int rc = jinja__iter_list(x, v, &l);
    if (rc) return rc;
    if ((int64_t)l->n != n->n_names) {
        rc = (int64_t)l->n > n->n_names
                 ? jinja__fail(x, PD_EINVAL, "too many values to unpack (expected %d)", n->n_names)
                 : jinja__fail(x, PD_EINVAL, "not enough values to unpack (expected %d, got %zu)",
                               n->n_names, l->n);
    }
    for (int i = 0; i < n->n_names && !rc; i++) {
        jinja__incref(l->v[i]);
        rc = scope_set(x, sc, n->names[i], l->v[i]);
    }
    jv lv = {.t = JV_LIST};
    lv.u.l = l;
    jinja__decref(x, lv);
    return rc;
}

static int exec_for(jx *x, const jnode *n)
{
    jv it;
    int rc = jinja__eval(x, n->a, &it);
    if (rc) return rc;
    jlist *items;
    rc = jinja__iter_list(x, it, &items);
    jinja__decref(x, it);
    if (rc) return rc;
    jv lv = {.t = JV_LIST};
    lv.u.l = items;
    jscope sc = {.parent = x->scope};
    if (n->b) { /* for ... if: the items that pass, with the targets bound */
        jv kept;
        if ((rc = jinja__list_new(x, JL_LIST, 0, &kept))) goto done;
        for (size_t i = 0; i < items->n && !rc; i++) {
            scope_clear(x, &sc);
            jv t;
            if ((rc = unpack(x, &sc, n, items->v[i]))) break;
            x->scope = &sc;
            rc = jinja__eval(x, n->b, &t);
            x->scope = sc.parent;
            if (rc) break;
            if (jinja__truthy(t)) {
                jinja__incref(items->v[i]);
                rc = jinja__list_push(x, kept.u.l, items->v[i]);
            }
            jinja__decref(x, t);
        }
        jinja__decref(x, lv);
        lv = kept;
        items = kept.u.l;
        if (rc) goto done;
    }
    if (items->n == 0) {
        if (n->d) {
            x->scope = &sc;
            rc = exec_body(x, n->d);
            x->scope = sc.parent;
        }
        goto done;
    }
    jloop *lp = jinja__alloc(x, sizeof *lp);
    if (!lp) {
        rc = PD_EINVAL;
        goto done;
    }
    lp->rc = 1;
    lp->index0 = 0;
    lp->length = (int64_t)items->n;
    lp->items = items;
    jinja__incref(lv);
    jv loopv = {.t = JV_LOOP};
    loopv.u.lp = lp;
    x->scope = &sc;
    for (size_t i = 0; i < items->n; i++) {
        scope_clear(x, &sc);
        lp->index0 = (int64_t)i;
        if ((rc = unpack(x, &sc, n, items->v[i]))) break;
        jinja__incref(loopv);
        if ((rc = scope_set(x, &sc, x->t->a_loop, loopv))) break;
        rc = exec_body(x, n->c);
        if (rc == JX_BREAK) {
            rc = 0;
            break;
        }
        if (rc == JX_CONTINUE) rc = 0;
        if (rc) break;
    }
    x->scope = sc.parent;
    jinja__decref(x, loopv);
done:
    scope_free(x, &sc);
    jinja__decref(x, lv);
    return rc;
}

/* Applies the filter chain f (innermost input NULL) to the text of a block. */
static int filter_block(jx *x, const jnode *f, jv text, jv *out)
{
    jv saved = x->block_input;
    x->block_input = text;
    int rc = jinja__eval(x, f, out);
    x->block_input = saved;
    return rc;
}

static int exec_set(jx *x, const jnode *n)
{
    jv v;
    int rc;
    if (n->a) {
        rc = jinja__eval(x, n->a, &v);
    } else { /* the body renders in a scope of its own, as jinja2's block frame */
        jscope sc = {.parent = x->scope};
        rc = render_in(x, n->c, &sc, &v);
        scope_free(x, &sc);
        if (rc) return rc;
        if (n->b) {
            jv f;
            rc = filter_block(x, n->b, v, &f);
            jinja__decref(x, v);
            v = f;
        }
    }
    if (rc) return rc;
    if (n->op == SET_NS) {
        const jv *ns = scope_find(x->scope, n->names[0]);
        if (!ns || ns->t != JV_NS) {
            jinja__decref(x, v);
            return jinja__fail(x, PD_EINVAL, "cannot assign attribute on non-namespace object");
        }
        jv k = {.t = JV_STR};
        k.u.s = (jstr *)n->str;
        return jinja__dict_set(x, ns->u.d, k, v);
    }
    rc = unpack(x, x->scope, n, v);
    jinja__decref(x, v);
    return rc;
}

static int exec_callblock(jx *x, const jnode *n)
{
    const jnode *call = n->a;
    jv fn, caller, res;
    evargs ea = {.npos = 0, .nkw = 0};
    ea.pv = ea.pos;
    ea.kv = ea.kw;
    int rc = jinja__eval(x, call->a, &fn);
    if (rc) return rc;
    if ((rc = jinja__func_new(x, FN_CALLER, -1, n, &caller))) {
        jinja__decref(x, fn);
        return rc;
    }
    caller.u.fn->scope = x->scope;
    if (!(rc = eval_args(x, call, &ea))) {
        int nkw = ea.nkw;
        const jstr *kwn[65];
        jv kwv[65];
        if (nkw > 64) {
            rc = jinja__fail(x, PD_EINVAL, "too many keyword arguments");
        } else {
            for (int i = 0; i < nkw; i++) {
                kwn[i] = call->names[i];
                kwv[i] = ea.kv[i];
            }
            kwn[nkw] = x->t->a_caller;
            kwv[nkw] = caller;
            rc = jinja__call(x, fn, ea.pv, ea.npos, kwn, kwv, nkw + 1, &res);
            if (!rc) {
                rc = out_value(x, res);
                jinja__decref(x, res);
            }
        }
    }
    caller.u.fn->scope = NULL;
    args_free(x, &ea);
    jinja__decref(x, caller);
    jinja__decref(x, fn);
    return rc;
}

static int exec_stmt(jx *x, const jnode *n)
{
    int rc = step(x, n);
    if (rc) return rc;
    jv v;
    switch (n->kind) {
    case N_BODY: return exec_body(x, n);
    case N_DATA: return jinja__buf_put(x, x->out, n->str->s, n->str->len);
    case N_PRINT:
        if ((rc = jinja__eval(x, n->a, &v))) return rc;
        rc = out_value(x, v);
        jinja__decref(x, v);
        return rc;
    case N_IF:
        for (int i = 0; i + 1 < n->n_kids; i += 2) {
            if ((rc = jinja__eval(x, n->kids[i], &v))) return rc;
            bool t = jinja__truthy(v);
            jinja__decref(x, v);
            if (t) return exec_body(x, n->kids[i + 1]);
        }
        return n->d ? exec_body(x, n->d) : 0;
    case N_FOR: return exec_for(x, n);
    case N_SET: return exec_set(x, n);
    case N_MACRO:
        if ((rc = jinja__func_new(x, FN_MACRO, -1, n, &v))) return rc;
        return scope_set(x, x->scope, n->str, v);
    case N_CALLBLK: return exec_callblock(x, n);
    case N_FILTBLK: {
        jscope sc = {.parent = x->scope};
        jv text, res;
        rc = render_in(x, n->c, &sc, &text);
        scope_free(x, &sc);
        if (rc) return rc;
        rc = filter_block(x, n->b, text, &res);
        jinja__decref(x, text);
        if (rc) return rc;
        rc = out_value(x, res);
        jinja__decref(x, res);
        return rc;
    }
    case N_WITH: {
        jscope sc = {.parent = x->scope};
        for (int i = 0; i < n->n_names && !rc; i++) {
            if (!(rc = jinja__eval(x, n->kids[i], &v))) rc = scope_set(x, &sc, n->names[i], v);
        }
        if (!rc) {
            x->scope = &sc;
            rc = exec_body(x, n->c);
            x->scope = sc.parent;
        }
        scope_free(x, &sc);
        return rc;
    }
    case N_BREAK: return JX_BREAK;
    case N_CONTINUE: return JX_CONTINUE;
    default: return jinja__fail(x, PD_EINVAL, "internal error: node %d is not a statement", n->kind);
    }
}

static int exec_body(jx *x, const jnode *body)
{
    if (++x->rdepth > MAX_RECURSION) {
        x->rdepth--;
        return jinja__fail(x, PD_EINVAL, "the template recursed more than %d levels", MAX_RECURSION);
    }
    int rc = 0;
    for (int i = 0; i < body->n_kids && !rc; i++) rc = exec_stmt(x, body->kids[i]);
    x->rdepth--;
    return rc;
}

/* ---- render ---- */
jinja_render_params jinja_default_render_params(void)
{
    return (jinja_render_params){.max_output = 0, .max_memory = 0, .max_steps = 0,
                                 .max_depth = 0, .now = -1};
}

int jinja__ns_register(jx *x, jv ns)
{
    if (x->n_nss == x->cap_nss) {
        size_t cap = x->cap_nss ? x->cap_nss * 2 : 8;
        jdict **v = jinja__realloc(x, x->nss, x->cap_nss * sizeof *v, cap * sizeof *v);
        if (!v) return PD_EINVAL;
        x->nss = v;
        x->cap_nss = cap;
    }
    jinja__incref(ns);
    x->nss[x->n_nss++] = ns.u.d;
    return 0;
}

int jinja_render(const jinja_template *t, const json_t *vars, const jinja_render_params *p,
                 char **out, size_t *out_len, char *err)
{
    *out = NULL;
    if (out_len) *out_len = 0;
    if (!t) return pd_errf(err, PD_EINVAL, "no template");
    if (vars && !json_is_object(vars)) return pd_errf(err, PD_EINVAL, "vars must be a JSON object");
    jinja_render_params def = jinja_default_render_params();
    if (!p) p = &def;
    char scratch[PD_ERR_LEN];
    jscope root = {0};
    jbuf ob = {0};
    jx x = {.t = t,
            .max_mem = p->max_memory ? p->max_memory : (size_t)256 << 20,
            .max_out = p->max_output ? p->max_output : (size_t)16 << 20,
            .max_steps = p->max_steps ? p->max_steps : 20000000,
            .max_depth = p->max_depth > 0 ? p->max_depth : 64,
            .now = p->now,
            .root = &root,
            .scope = &root,
            .out = &ob,
            .line = 1,
            .err = err ? err : scratch,
            .block_input = jv_undef(NULL)};
    int rc = 0;
    if (vars) {
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)vars, key, val) {
            const jstr *name = jinja__atom_find(t, key, strlen(key));
            if (!name) continue; /* the template never names it */
            jv v;
            if ((rc = jinja__from_json(&x, val, &v, 0)) || (rc = scope_set(&x, &root, name, v)))
                break;
        }
    }
    if (!rc) rc = exec_body(&x, t->root);
    if (rc > 0) rc = 0; /* break / continue outside a loop cannot parse */
    /* namespaces may hold themselves: empty them before anything is released */
    for (size_t i = 0; i < x.n_nss; i++) {
        jdict *d = x.nss[i];
        size_t n = d->n;
        d->n = 0;
        for (size_t k = 0; k < n; k++) {
            jinja__decref(&x, d->k[k]);
            jinja__decref(&x, d->v[k]);
        }
    }
    scope_free(&x, &root);
    for (size_t i = 0; i < x.n_nss; i++) {
        jv ns = {.t = JV_NS};
        ns.u.d = x.nss[i];
        jinja__decref(&x, ns);
    }
    jinja__free(&x, x.nss, x.cap_nss * sizeof *x.nss);
    if (!rc) {
        char *s = malloc(ob.n + 1);
        if (!s) {
            rc = pd_errf(err, PD_ENOMEM, "out of memory");
        } else {
            if (ob.n) memcpy(s, ob.p, ob.n);
            s[ob.n] = 0;
            *out = s;
            if (out_len) *out_len = ob.n;
        }
    }
    jinja__buf_free(&x, &ob);
#ifndef NDEBUG /* a refcount mistake: loud in debug and sanitizer builds, harmless otherwise */
    PD_ASSERT(x.mem == 0, "jinja: a render released less memory than it took");
#endif
    return rc;
}
