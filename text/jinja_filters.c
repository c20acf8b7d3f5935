/* jinja_filters.c -- jinja2's builtin filters and tests as chat templates use them, with
 * jinja2's argument names and edge cases (undefined inputs, generators from select / map /
 * unique / reverse that are one-shot and always true, Python's round and int parsing), and
 * transformers' tojson in place of jinja2's. Filters jinja2 has that are not offered here fail
 * when reached ("not supported"), so that a template using them elsewhere still renders. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/jinja_impl.h"

typedef int (*filter_fn)(jx *x, jv in, const jargs *a, jv *out);
typedef int (*test_fn)(jx *x, jv in, const jargs *a, bool *out);

static int list_out(jx *x, int rc, jv *out)
{
    if (rc && out->t == JV_LIST) {
        jinja__decref(x, *out);
        *out = jv_undef(NULL);
    }
    return rc;
}

static void release_list(jx *x, jlist *l)
{
    jv v = {.t = JV_LIST};
    v.u.l = l;
    jinja__decref(x, v);
}

static int want_int(jx *x, const char *what, jv v, int64_t *i)
{
    *i = 0;
    if (v.t == JV_INT) *i = v.u.i;
    else if (v.t == JV_BOOL) *i = v.u.b;
    else return jinja__fail(x, PD_EINVAL, "%s must be an integer, not %s", what, jinja__type_name(v));
    return 0;
}

static bool arg_true(jv v) { return !JARG_MISSING(v) && jinja__truthy(v); }

/* jinja2's make_attrgetter: "a.b.0" looks up a, then b, then item 0, as subscripts do. */
static int attr_get(jx *x, jv item, jv attr, jv dflt, jv *out)
{
    jinja__incref(item);
    jv cur = item;
    if (attr.t != JV_STR) {
        int rc = jinja__getitem(x, cur, attr, out);
        jinja__decref(x, cur);
        return rc;
    }
    const jstr *s = attr.u.s;
    size_t i = 0;
    do {
        const char *dot = memchr(s->s + i, '.', s->len - i);
        size_t end = dot ? (size_t)(dot - s->s) : s->len;
        bool digits = end > i;
        int64_t idx = 0;
        for (size_t k = i; k < end; k++) {
            if (s->s[k] < '0' || s->s[k] > '9' || idx > INT64_MAX / 10 - 10) digits = false;
            else idx = idx * 10 + (s->s[k] - '0');
        }
        jv key, next;
        int rc = digits ? (key = jv_int(idx), 0) : jinja__str_new(x, s->s + i, end - i, &key);
        if (!rc) rc = jinja__getitem(x, cur, key, &next);
        jinja__decref(x, key);
        jinja__decref(x, cur);
        if (rc) return rc;
        cur = next;
        if (!JARG_MISSING(dflt) && dflt.t != JV_NONE && cur.t == JV_UNDEF) {
            cur = dflt;
            jinja__incref(cur);
        }
        i = end + 1;
    } while (i <= s->len);
    *out = cur;
    return 0;
}

/* ---- tests ---- */
static bool is_seq_list(jv v)
{
    return v.t == JV_LIST && (v.u.l->kind == JL_LIST || v.u.l->kind == JL_TUPLE);
}

static int num_arg(jx *x, const jargs *a, jv *v)
{
    *v = jv_none();
    if (a->npos < 1) return jinja__fail(x, PD_EINVAL, "the test needs an argument");
    *v = a->pos[0];
    return 0;
}

static int t_defined(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t != JV_UNDEF; return 0; }
static int t_undefined(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_UNDEF; return 0; }
static int t_none(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_NONE; return 0; }
static int t_boolean(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_BOOL; return 0; }
static int t_false(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_BOOL && !in.u.b; return 0; }
static int t_true(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_BOOL && in.u.b; return 0; }
static int t_integer(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_INT; return 0; }
static int t_float(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_FLOAT; return 0; }
static int t_number(jx *x, jv in, const jargs *a, bool *o)
{
    (void)x, (void)a;
    *o = in.t == JV_INT || in.t == JV_FLOAT || in.t == JV_BOOL;
    return 0;
}
static int t_string(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_STR; return 0; }
static int t_mapping(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_DICT; return 0; }
static int t_iterable(jx *x, jv in, const jargs *a, bool *o)
{
    (void)x, (void)a;
    *o = in.t == JV_UNDEF || in.t == JV_STR || in.t == JV_LIST || in.t == JV_DICT;
    return 0;
}
static int t_sequence(jx *x, jv in, const jargs *a, bool *o)
{
    (void)x, (void)a; /* has len() and __getitem__ */
    *o = in.t == JV_UNDEF || in.t == JV_STR || in.t == JV_DICT || is_seq_list(in);
    return 0;
}
static int t_callable(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a; *o = in.t == JV_FUNC; return 0; }
static int t_escaped(jx *x, jv in, const jargs *a, bool *o) { (void)x, (void)a, (void)in; *o = false; return 0; }

static int t_odd_even(jx *x, jv in, bool odd, bool *o)
{
    jv two = jv_int(2), r;
    int rc = jinja__binop(x, JOP_MOD, in, two, &r);
    if (rc) return rc;
    bool eq;
    rc = jinja__eq(x, r, jv_int(odd ? 1 : 0), &eq);
    jinja__decref(x, r);
    *o = eq;
    return rc;
}
static int t_odd(jx *x, jv in, const jargs *a, bool *o) { (void)a; return t_odd_even(x, in, true, o); }
static int t_even(jx *x, jv in, const jargs *a, bool *o) { (void)a; return t_odd_even(x, in, false, o); }
static int t_divisibleby(jx *x, jv in, const jargs *a, bool *o)
{
    jv n, r;
    int rc = num_arg(x, a, &n);
    if (rc || (rc = jinja__binop(x, JOP_MOD, in, n, &r))) return rc;
    rc = jinja__eq(x, r, jv_int(0), o);
    jinja__decref(x, r);
    return rc;
}
static int t_sameas(jx *x, jv in, const jargs *a, bool *o)
{
    jv n;
    int rc = num_arg(x, a, &n);
    if (rc) return rc;
    if (in.t != n.t) *o = false;
    else if (JV_IS_HEAP(in)) *o = in.u.rc == n.u.rc;
    else if (in.t == JV_INT) *o = in.u.i == n.u.i && in.u.i >= -5 && in.u.i <= 256; /* CPython's small ints */
    else if (in.t == JV_BOOL) *o = in.u.b == n.u.b;
    else *o = in.t == JV_NONE;
    return 0;
}
static int t_in(jx *x, jv in, const jargs *a, bool *o)
{
    jv n;
    int rc = num_arg(x, a, &n);
    return rc ? rc : jinja__contains(x, n, in, o);
}
static int t_case(jx *x, jv in, bool upper, bool *o)
{
    jv s;
    int rc = jinja__to_str(x, in, &s);
    if (rc) return rc;
    bool any = false, ok = true;
    for (size_t i = 0; i < s.u.s->len;) {
        uint32_t cp = jinja__u8_next(s.u.s->s, s.u.s->len, &i);
        if (upper ? jinja__cp_is_lower(cp) : jinja__cp_is_upper(cp)) ok = false;
        if (jinja__cp_is_cased(cp)) any = true;
    }
    *o = ok && any;
    jinja__decref(x, s);
    return 0;
}
static int t_lower(jx *x, jv in, const jargs *a, bool *o) { (void)a; return t_case(x, in, false, o); }
static int t_upper(jx *x, jv in, const jargs *a, bool *o) { (void)a; return t_case(x, in, true, o); }

static int t_cmp(jx *x, jv in, const jargs *a, int op, bool *o)
{
    jv n;
    int rc = num_arg(x, a, &n), c;
    if (rc) return rc;
    if (op == JOP_EQ || op == JOP_NE) {
        rc = jinja__eq(x, in, n, o);
        if (op == JOP_NE) *o = !*o;
        return rc;
    }
    if ((rc = jinja__cmp(x, in, n, &c))) return rc;
    *o = op == JOP_LT ? c < 0 : op == JOP_LE ? c <= 0 : op == JOP_GT ? c > 0 : c >= 0;
    return 0;
}
static int t_eq(jx *x, jv in, const jargs *a, bool *o) { return t_cmp(x, in, a, JOP_EQ, o); }
static int t_ne(jx *x, jv in, const jargs *a, bool *o) { return t_cmp(x, in, a, JOP_NE, o); }
static int t_lt(jx *x, jv in, const jargs *a, bool *o) { return t_cmp(x, in, a, JOP_LT, o); }
static int t_le(jx *x, jv in, const jargs *a, bool *o) { return t_cmp(x, in, a, JOP_LE, o); }
static int t_gt(jx *x, jv in, const jargs *a, bool *o) { return t_cmp(x, in, a, JOP_GT, o); }
static int t_ge(jx *x, jv in, const jargs *a, bool *o) { return t_cmp(x, in, a, JOP_GE, o); }

static int t_filter(jx *x, jv in, const jargs *a, bool *o);
static int t_test(jx *x, jv in, const jargs *a, bool *o);

static const struct {
    const char *name;
    test_fn fn;
} tests[] = {
    {"defined", t_defined},   {"undefined", t_undefined}, {"none", t_none},
    {"boolean", t_boolean},   {"false", t_false},         {"true", t_true},
    {"integer", t_integer},   {"float", t_float},         {"number", t_number},
    {"string", t_string},     {"mapping", t_mapping},     {"iterable", t_iterable},
    {"sequence", t_sequence}, {"callable", t_callable},   {"escaped", t_escaped},
    {"odd", t_odd},           {"even", t_even},           {"divisibleby", t_divisibleby},
    {"sameas", t_sameas},     {"in", t_in},               {"lower", t_lower},
    {"upper", t_upper},       {"eq", t_eq},               {"equalto", t_eq},
    {"==", t_eq},             {"ne", t_ne},               {"!=", t_ne},
    {"lt", t_lt},             {"lessthan", t_lt},         {"<", t_lt},
    {"le", t_le},             {"<=", t_le},               {"gt", t_gt},
    {"greaterthan", t_gt},    {">", t_gt},                {"ge", t_ge},
    {">=", t_ge},             {"filter", t_filter},       {"test", t_test},
};
enum { N_TESTS = sizeof tests / sizeof tests[0] };

int jinja__test_id(const char *name, size_t len)
{
    for (int i = 0; i < N_TESTS; i++)
        if (strlen(tests[i].name) == len && memcmp(tests[i].name, name, len) == 0) return i;
    return JID_UNKNOWN;
}

int jinja__test(jx *x, int id, const char *name, jv in, const jargs *a, bool *out)
{
    if (id < 0 || id >= N_TESTS) return jinja__fail(x, PD_EINVAL, "No test named '%s' found.", name);
    return tests[id].fn(x, in, a, out);
}

int jinja__test_by_name(jx *x, jv name, jv in, const jargs *a, bool *out)
{
    if (name.t != JV_STR) return jinja__fail(x, PD_EINVAL, "a test name must be a string");
    int id = jinja__test_id(name.u.s->s, name.u.s->len);
    return jinja__test(x, id, name.u.s->s, in, a, out);
}

/* ---- filters ---- */
static int f_abs(jx *x, jv in, const jargs *a, jv *o)
{
    (void)a;
    if (in.t == JV_FLOAT) *o = jv_float(fabs(in.u.f));
    else if (in.t == JV_INT || in.t == JV_BOOL) {
        int64_t i = in.t == JV_INT ? in.u.i : in.u.b;
        if (i == INT64_MIN) return jinja__fail(x, PD_EINVAL, "integer overflow");
        *o = jv_int(i < 0 ? -i : i);
    } else {
        return jinja__fail(x, PD_EINVAL, "bad operand type for abs(): '%s'", jinja__type_name(in));
    }
    return 0;
}

static int f_attr(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"name"};
    jv v[1];
    int rc = jinja__bind(x, "attr", a, ps, 1, v);
    if (rc) return rc;
    if (v[0].t != JV_STR) return jinja__fail(x, PD_EINVAL, "attribute name must be string");
    if (in.t == JV_DICT) { /* a dict's keys are not attributes */
        bool unsafe;
        if (jinja__method_id(JV_DICT, v[0].u.s->s, v[0].u.s->len, &unsafe) < 0 && !unsafe) {
            *o = jv_undef(NULL);
            return 0;
        }
    }
    return jinja__getattr(x, in, v[0].u.s->s, v[0].u.s->len, NULL, o);
}

static int f_str_case(jx *x, jv in, int mode, jv *o)
{
    jv s;
    int rc = jinja__to_str(x, in, &s);
    if (rc) return rc;
    rc = jinja__str_case(x, s.u.s, mode, o);
    jinja__decref(x, s);
    return rc;
}
static int f_capitalize(jx *x, jv in, const jargs *a, jv *o) { (void)a; return f_str_case(x, in, JCASE_CAPITALIZE, o); }
static int f_lower(jx *x, jv in, const jargs *a, jv *o) { (void)a; return f_str_case(x, in, JCASE_LOWER, o); }
static int f_upper(jx *x, jv in, const jargs *a, jv *o) { (void)a; return f_str_case(x, in, JCASE_UPPER, o); }
static int f_title(jx *x, jv in, const jargs *a, jv *o) { (void)a; return f_str_case(x, in, JCASE_JINJA_TITLE, o); }

static int f_length(jx *x, jv in, const jargs *a, jv *o)
{
    (void)a;
    switch (in.t) {
    case JV_UNDEF: *o = jv_int(0); return 0;
    case JV_STR: *o = jv_int((int64_t)in.u.s->ncp); return 0;
    case JV_DICT: *o = jv_int((int64_t)in.u.d->n); return 0;
    case JV_LIST:
        if (in.u.l->kind != JL_GEN) {
            *o = jv_int((int64_t)in.u.l->n);
            return 0;
        }
        break;
    default: break;
    }
    return jinja__fail(x, PD_EINVAL, "object of type '%s' has no len()", jinja__type_name(in));
}

static int f_default(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"default_value", "boolean"};
    jv v[2];
    int rc = jinja__bind(x, "default", a, ps, 2, v);
    if (rc) return rc;
    if (in.t == JV_UNDEF || (arg_true(v[1]) && !jinja__truthy(in))) {
        if (JARG_MISSING(v[0])) return jinja__str_new(x, "", 0, o);
        *o = v[0];
    } else {
        *o = in;
    }
    jinja__incref(*o);
    return 0;
}

static int f_escape(jx *x, jv in, const jargs *a, jv *o)
{
    (void)a;
    jv s;
    int rc = jinja__to_str(x, in, &s);
    if (rc) return rc;
    jbuf b = {0};
    const jstr *t = s.u.s;
    size_t run = 0;
    for (size_t i = 0; i < t->len && !rc; i++) {
        const char *e = t->s[i] == '&' ? "&amp;" : t->s[i] == '<' ? "&lt;" : t->s[i] == '>' ? "&gt;"
                        : t->s[i] == '"' ? "&#34;" : t->s[i] == '\'' ? "&#39;" : NULL;
        if (!e) continue;
        rc = jinja__buf_put(x, &b, t->s + run, i - run);
        if (!rc) rc = jinja__buf_put(x, &b, e, strlen(e));
        run = i + 1;
    }
    if (!rc) rc = jinja__buf_put(x, &b, t->s + run, t->len - run);
    jinja__decref(x, s);
    return jinja__buf_result(x, &b, rc, o);
}

static int f_first(jx *x, jv in, const jargs *a, jv *o)
{
    (void)a;
    if (in.t == JV_LIST && in.u.l->kind == JL_GEN) {
        jlist *l = in.u.l;
        if (l->pos >= l->n) {
            *o = jv_undef(NULL);
            return 0;
        }
        *o = l->v[l->pos++];
        jinja__incref(*o);
        return 0;
    }
    jlist *l;
    int rc = jinja__iter_list(x, in, &l);
    if (rc) return rc;
    *o = l->n ? l->v[0] : jv_undef(NULL);
    jinja__incref(*o);
    release_list(x, l);
    return 0;
}

static int f_last(jx *x, jv in, const jargs *a, jv *o)
{
    (void)a;
    if (in.t == JV_LIST && in.u.l->kind == JL_GEN)
        return jinja__fail(x, PD_EINVAL, "'generator' object is not reversible");
    jlist *l;
    int rc = jinja__iter_list(x, in, &l);
    if (rc) return rc;
    *o = l->n ? l->v[l->n - 1] : jv_undef(NULL);
    jinja__incref(*o);
    release_list(x, l);
    return 0;
}

/* Python's float(str): surrounding whitespace, '_' between digits, inf / nan */
static bool parse_float(const jstr *s, double *f)
{
    size_t a = 0, b = s->len;
    while (a < b && (unsigned char)s->s[a] < 0x80 && jinja__is_space((unsigned char)s->s[a])) a++;
    while (b > a && (unsigned char)s->s[b - 1] < 0x80 && jinja__is_space((unsigned char)s->s[b - 1])) b--;
    if (a == b || b - a > 300) return false;
    char buf[320];
    size_t n = 0;
    for (size_t i = a; i < b; i++) {
        char c = s->s[i];
        if (c == '_') {
            if (i == a || i + 1 == b || !(s->s[i - 1] >= '0' && s->s[i - 1] <= '9') ||
                !(s->s[i + 1] >= '0' && s->s[i + 1] <= '9'))
                return false;
            continue;
        }
        if (!((c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-' ||
              ((c | 32) >= 'a' && (c | 32) <= 'z')))
            return false;
        buf[n++] = c;
    }
    buf[n] = 0;
    const char *p = buf + (buf[0] == '+' || buf[0] == '-');
    if (!strcasecmp(p, "inf") || !strcasecmp(p, "infinity") || !strcasecmp(p, "nan")) {
        *f = strtod(buf, NULL);
        return true;
    }
    for (const char *q = p; *q; q++) /* no hex floats, no other words */
        if (((*q | 32) >= 'a' && (*q | 32) <= 'z') && (*q | 32) != 'e') return false;
    char *end;
    errno = 0;
    *f = strtod(buf, &end);
    return *end == 0 && end != buf;
}

/* Python's int(str, base) */
static bool parse_int(const jstr *s, int64_t base, int64_t *out)
{
    size_t a = 0, b = s->len;
    while (a < b && (unsigned char)s->s[a] < 0x80 && jinja__is_space((unsigned char)s->s[a])) a++;
    while (b > a && (unsigned char)s->s[b - 1] < 0x80 && jinja__is_space((unsigned char)s->s[b - 1])) b--;
    bool neg = false;
    if (a < b && (s->s[a] == '+' || s->s[a] == '-')) neg = s->s[a++] == '-';
    if (base == 0 || base == 16 || base == 8 || base == 2) {
        if (b - a > 2 && s->s[a] == '0') {
            char c = (char)(s->s[a + 1] | 32);
            int64_t pb = c == 'x' ? 16 : c == 'o' ? 8 : c == 'b' ? 2 : 0;
            if (pb && (base == 0 || base == pb)) {
                base = pb;
                a += 2;
                if (a < b && s->s[a] == '_') a++;
            }
        }
        if (base == 0) base = 10;
    }
    if (base < 2 || base > 36 || a == b) return false;
    uint64_t v = 0;
    for (size_t i = a; i < b; i++) {
        char c = s->s[i];
        if (c == '_' && i > a && i + 1 < b && s->s[i - 1] != '_') continue;
        int d = c >= '0' && c <= '9' ? c - '0' : ((c | 32) >= 'a' && (c | 32) <= 'z') ? (c | 32) - 'a' + 10 : 99;
        if (d >= base) return false;
        if (v > (UINT64_MAX - (uint64_t)d) / (uint64_t)base) return false;
        v = v * (uint64_t)base + (uint64_t)d;
    }
    if (v > (uint64_t)INT64_MAX + neg) return false;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return true;
}

static int f_int(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"default", "base"};
    jv v[2];
    int64_t base = 10, i;
    double f;
    int rc = jinja__bind(x, "int", a, ps, 2, v);
    if (rc || (!JARG_MISSING(v[1]) && (rc = want_int(x, "base", v[1], &base)))) return rc;
    if (in.t == JV_INT || in.t == JV_BOOL) {
        *o = jv_int(in.t == JV_INT ? in.u.i : in.u.b);
        return 0;
    }
    bool ok = false;
    if (in.t == JV_FLOAT) {
        f = in.u.f;
        ok = !isnan(f) && !isinf(f);
    } else if (in.t == JV_STR) {
        if (parse_int(in.u.s, base, &i)) {
            *o = jv_int(i);
            return 0;
        }
        ok = parse_float(in.u.s, &f) && !isnan(f) && !isinf(f);
    }
    if (ok) {
        if (f >= 9.2233720368547758e18 || f < -9.2233720368547758e18)
            return jinja__fail(x, PD_EINVAL, "integer overflow");
        *o = jv_int((int64_t)f);
        return 0;
    }
    *o = JARG_MISSING(v[0]) ? jv_int(0) : v[0];
    jinja__incref(*o);
    return 0;
}

static int f_float(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"default"};
    jv v[1];
    int rc = jinja__bind(x, "float", a, ps, 1, v);
    if (rc) return rc;
    double f;
    if (in.t == JV_FLOAT || in.t == JV_INT || in.t == JV_BOOL) {
        *o = jv_float(in.t == JV_FLOAT ? in.u.f : in.t == JV_INT ? (double)in.u.i : in.u.b);
    } else if (in.t == JV_STR && parse_float(in.u.s, &f)) {
        *o = jv_float(f);
    } else {
        *o = JARG_MISSING(v[0]) ? jv_float(0.0) : v[0];
        jinja__incref(*o);
    }
    return 0;
}

static int f_format(jx *x, jv in, const jargs *a, jv *o)
{
    if (a->npos && a->nkw)
        return jinja__fail(x, PD_EINVAL, "can't handle positional and keyword arguments at the same time");
    jv s, args = jv_none();
    int rc = jinja__to_str(x, in, &s);
    if (rc) return rc;
    if (a->nkw) {
        rc = jinja__dict_new(x, &args, false);
        for (int i = 0; i < a->nkw && !rc; i++) {
            jv k = {.t = JV_STR};
            k.u.s = (jstr *)a->kwn[i];
            jinja__incref(a->kwv[i]);
            rc = jinja__dict_set(x, args.u.d, k, a->kwv[i]);
        }
    } else {
        rc = jinja__list_new(x, JL_TUPLE, (size_t)a->npos, &args);
        for (int i = 0; i < a->npos && !rc; i++) {
            jinja__incref(a->pos[i]);
            rc = jinja__list_push(x, args.u.l, a->pos[i]);
        }
    }
    if (!rc) rc = jinja__format_percent(x, s, args, o);
    if (args.t == JV_LIST || args.t == JV_DICT) jinja__decref(x, args);
    jinja__decref(x, s);
    return rc;
}

static int f_indent(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"width", "first", "blank"};
    jv v[3], s, lines;
    int rc = jinja__bind(x, "indent", a, ps, 3, v);
    if (rc) return rc;
    jbuf ind = {0}, b = {0};
    if (!JARG_MISSING(v[0]) && v[0].t == JV_STR) {
        rc = jinja__buf_put(x, &ind, v[0].u.s->s, v[0].u.s->len);
    } else {
        int64_t w = 4;
        if (!JARG_MISSING(v[0]) && (rc = want_int(x, "width", v[0], &w))) return rc;
        for (int64_t i = 0; i < w && !rc; i++) rc = jinja__buf_put(x, &ind, " ", 1);
    }
    if (!rc) rc = jinja__put_str(x, &b, in);
    if (!rc) rc = jinja__buf_put(x, &b, "\n", 1); /* jinja2 appends one, for splitlines */
    if (rc || (rc = jinja__str_from_buf(x, &b, &s))) {
        jinja__buf_free(x, &ind);
        jinja__buf_free(x, &b);
        return rc;
    }
    rc = jinja__splitlines(x, s.u.s, false, &lines);
    jinja__decref(x, s);
    if (rc) {
        jinja__buf_free(x, &ind);
        return rc;
    }
    const char *is = ind.p ? ind.p : "";
    bool blank = arg_true(v[2]);
    jlist *l = lines.u.l;
    if (arg_true(v[1])) rc = jinja__buf_put(x, &b, is, ind.n);
    for (size_t i = 0; i < l->n && !rc; i++) {
        const jstr *line = l->v[i].u.s;
        if (i) {
            rc = jinja__buf_put(x, &b, "\n", 1);
            if (!rc && (blank || line->len)) rc = jinja__buf_put(x, &b, is, ind.n);
        }
        if (!rc) rc = jinja__buf_put(x, &b, line->s, line->len);
    }
    jinja__decref(x, lines);
    jinja__buf_free(x, &ind);
    return jinja__buf_result(x, &b, rc, o);
}

static int f_items(jx *x, jv in, const jargs *a, jv *o)
{
    (void)a;
    if (in.t == JV_UNDEF) return jinja__list_new(x, JL_GEN, 0, o);
    if (in.t != JV_DICT) return jinja__fail(x, PD_EINVAL, "Can only get item pairs from a mapping.");
    jv fn;
    int rc = jinja__getattr(x, in, "items", 5, NULL, &fn);
    if (rc) return rc;
    rc = jinja__call(x, fn, NULL, 0, NULL, NULL, 0, o);
    jinja__decref(x, fn);
    if (!rc) o->u.l->kind = JL_GEN;
    return rc;
}

static int f_join(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"d", "attribute"};
    jv v[2];
    int rc = jinja__bind(x, "join", a, ps, 2, v);
    if (rc) return rc;
    jlist *l;
    if ((rc = jinja__iter_list(x, in, &l))) return rc;
    jbuf b = {0};
    for (size_t i = 0; i < l->n && !rc; i++) {
        if (i && !JARG_MISSING(v[0])) rc = jinja__put_str(x, &b, v[0]);
        if (rc) break;
        if (JARG_MISSING(v[1]) || v[1].t == JV_NONE) {
            rc = jinja__put_str(x, &b, l->v[i]);
        } else {
            jv e;
            if (!(rc = attr_get(x, l->v[i], v[1], jv_undef(jinja__missing), &e))) {
                rc = jinja__put_str(x, &b, e);
                jinja__decref(x, e);
            }
        }
    }
    release_list(x, l);
    return jinja__buf_result(x, &b, rc, o);
}

static int f_list(jx *x, jv in, const jargs *a, jv *o)
{
    (void)a;
    jlist *l;
    int rc = jinja__iter_list(x, in, &l);
    if (rc) return rc;
    rc = jinja__list_new(x, JL_LIST, l->n, o);
    for (size_t i = 0; i < l->n && !rc; i++) {
        jinja__incref(l->v[i]);
        rc = jinja__list_push(x, o->u.l, l->v[i]);
    }
    release_list(x, l);
    return list_out(x, rc, o);
}

/* select / reject / selectattr / rejectattr */
static int select_common(jx *x, jv in, const jargs *a, bool want, bool by_attr, jv *o)
{
    if (a->nkw) return jinja__fail(x, PD_EINVAL, "select filters take no keyword arguments");
    int rc = jinja__list_new(x, JL_GEN, 0, o);
    if (rc || !jinja__truthy(in)) return rc;
    int off = by_attr ? 1 : 0;
    if (by_attr && a->npos < 1) {
        jinja__decref(x, *o);
        return jinja__fail(x, PD_EINVAL, "Missing parameter for attribute name");
    }
    jlist *l;
    if ((rc = jinja__iter_list(x, in, &l))) {
        jinja__decref(x, *o);
        return rc;
    }
    jargs targs = {.pos = a->pos + off + 1, .npos = a->npos > off + 1 ? a->npos - off - 1 : 0};
    for (size_t i = 0; i < l->n && !rc; i++) {
        jv item = l->v[i], val = item;
        bool r;
        if (by_attr && (rc = attr_get(x, item, a->pos[0], jv_undef(jinja__missing), &val))) break;
        if (!by_attr) jinja__incref(val);
        if (a->npos > off) rc = jinja__test_by_name(x, a->pos[off], val, &targs, &r);
        else r = jinja__truthy(val);
        jinja__decref(x, val);
        if (!rc && r == want) {
            jinja__incref(item);
            rc = jinja__list_push(x, o->u.l, item);
        }
    }
    release_list(x, l);
    return list_out(x, rc, o);
}
static int f_select(jx *x, jv in, const jargs *a, jv *o) { return select_common(x, in, a, true, false, o); }
static int f_reject(jx *x, jv in, const jargs *a, jv *o) { return select_common(x, in, a, false, false, o); }
static int f_selectattr(jx *x, jv in, const jargs *a, jv *o) { return select_common(x, in, a, true, true, o); }
static int f_rejectattr(jx *x, jv in, const jargs *a, jv *o) { return select_common(x, in, a, false, true, o); }

static int f_map(jx *x, jv in, const jargs *a, jv *o)
{
    int rc = jinja__list_new(x, JL_GEN, 0, o);
    if (rc || !jinja__truthy(in)) return rc;
    jv attr = jv_undef(jinja__missing), dflt = jv_undef(jinja__missing);
    if (!a->npos) { /* map(attribute=..., default=...); else map('filter', args...) */
        for (int k = 0; k < a->nkw; k++)
            if (!strcmp(a->kwn[k]->s, "attribute")) attr = a->kwv[k];
        if (JARG_MISSING(attr)) rc = jinja__fail(x, PD_EINVAL, "map requires a filter argument");
        for (int k = 0; k < a->nkw && !rc; k++) {
            if (!strcmp(a->kwn[k]->s, "default")) dflt = a->kwv[k];
            else if (strcmp(a->kwn[k]->s, "attribute"))
                rc = jinja__fail(x, PD_EINVAL, "Unexpected keyword argument '%s'", a->kwn[k]->s);
        }
    }
    jlist *l = NULL;
    if (!rc) rc = jinja__iter_list(x, in, &l);
    jargs fargs = {.pos = a->pos + 1, .npos = a->npos ? a->npos - 1 : 0, .kwn = a->kwn, .kwv = a->kwv,
                   .nkw = a->nkw};
    for (size_t i = 0; !rc && i < l->n; i++) {
        jv r;
        if (a->npos) rc = jinja__filter_by_name(x, a->pos[0], l->v[i], &fargs, &r);
        else rc = attr_get(x, l->v[i], attr, dflt, &r);
        if (!rc) rc = jinja__list_push(x, o->u.l, r);
    }
    if (l) release_list(x, l);
    return list_out(x, rc, o);
}

/* the sort key of an item: attribute(s), lowercased strings unless case-sensitive */
static int sort_key(jx *x, jv item, jv attr, bool multi, bool cs, jv *key)
{
    int rc;
    if (JARG_MISSING(attr) || attr.t == JV_NONE) {
        *key = item;
        jinja__incref(item);
    } else if (multi && attr.t == JV_STR && memchr(attr.u.s->s, ',', attr.u.s->len)) {
        if ((rc = jinja__list_new(x, JL_LIST, 0, key))) return rc;
        const jstr *s = attr.u.s;
        for (size_t i = 0; i <= s->len && !rc;) {
            const char *c = memchr(s->s + i, ',', s->len - i);
            size_t end = c ? (size_t)(c - s->s) : s->len;
            jv part, v, lk;
            if ((rc = jinja__str_new(x, s->s + i, end - i, &part))) break;
            rc = attr_get(x, item, part, jv_undef(jinja__missing), &v);
            jinja__decref(x, part);
            if (rc) break;
            if (!cs && v.t == JV_STR) {
                rc = jinja__str_case(x, v.u.s, JCASE_LOWER, &lk);
                jinja__decref(x, v);
                v = lk;
                if (rc) break;
            }
            rc = jinja__list_push(x, key->u.l, v);
            i = end + 1;
        }
        if (rc) jinja__decref(x, *key);
        return rc;
    } else if ((rc = attr_get(x, item, attr, jv_undef(jinja__missing), key))) {
        return rc;
    }
    if (!cs && key->t == JV_STR) {
        jv lk;
        rc = jinja__str_case(x, key->u.s, JCASE_LOWER, &lk);
        jinja__decref(x, *key);
        *key = lk;
        return rc;
    }
    return 0;
}

/* stable merge sort of idx by keys (Python's sorted: key compare with <, reverse keeps stability) */
static int msort(jx *x, size_t *idx, size_t *tmp, size_t n, const jv *keys, bool rev)
{
    if (n < 2) return 0;
    size_t h = n / 2;
    int rc = msort(x, idx, tmp, h, keys, rev);
    if (!rc) rc = msort(x, idx + h, tmp, n - h, keys, rev);
    if (rc) return rc;
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        int c; /* take from the right only when it must come strictly first */
        rc = rev ? jinja__cmp(x, keys[idx[i]], keys[idx[j]], &c)
                 : jinja__cmp(x, keys[idx[j]], keys[idx[i]], &c);
        if (rc) return rc;
        tmp[k++] = c < 0 ? idx[j++] : idx[i++];
    }
    while (i < h) tmp[k++] = idx[i++];
    while (j < n) tmp[k++] = idx[j++];
    memcpy(idx, tmp, n * sizeof *idx);
    return 0;
}

static int sorted_items(jx *x, jv in, jv attr, bool multi, bool cs, bool rev, jlist **items, size_t **order)
{
    int rc = jinja__iter_list(x, in, items);
    if (rc) return rc;
    size_t n = (*items)->n;
    jv *keys = jinja__alloc(x, (n ? n : 1) * sizeof *keys);
    size_t *idx = keys ? jinja__alloc(x, (n ? n : 1) * sizeof *idx) : NULL;
    size_t *tmp = idx ? jinja__alloc(x, (n ? n : 1) * sizeof *tmp) : NULL;
    size_t nk = 0;
    if (!tmp) rc = PD_EINVAL;
    for (; !rc && nk < n; nk++) {
        idx[nk] = nk;
        if ((rc = sort_key(x, (*items)->v[nk], attr, multi, cs, &keys[nk]))) break;
    }
    if (!rc) rc = msort(x, idx, tmp, n, keys, rev);
    for (size_t i = 0; i < nk; i++) jinja__decref(x, keys[i]);
    if (keys) jinja__free(x, keys, (n ? n : 1) * sizeof *keys);
    if (tmp) jinja__free(x, tmp, (n ? n : 1) * sizeof *tmp);
    if (rc) {
        if (idx) jinja__free(x, idx, (n ? n : 1) * sizeof *idx);
        release_list(x, *items);
        return rc;
    }
    *order = idx;
    return 0;
}

static int f_sort(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"reverse", "case_sensitive", "attribute"};
    jv v[3];
    int rc = jinja__bind(x, "sort", a, ps, 3, v);
    if (rc) return rc;
    jlist *l;
    size_t *idx;
    if ((rc = sorted_items(x, in, v[2], true, arg_true(v[1]), arg_true(v[0]), &l, &idx))) return rc;
    rc = jinja__list_new(x, JL_LIST, l->n, o);
    for (size_t i = 0; i < l->n && !rc; i++) {
        jinja__incref(l->v[idx[i]]);
        rc = jinja__list_push(x, o->u.l, l->v[idx[i]]);
    }
    jinja__free(x, idx, (l->n ? l->n : 1) * sizeof *idx);
    release_list(x, l);
    return list_out(x, rc, o);
}

static int f_dictsort(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"case_sensitive", "by", "reverse"};
    jv v[3], pairs;
    int rc = jinja__bind(x, "dictsort", a, ps, 3, v);
    if (rc) return rc;
    if (in.t != JV_DICT) return jinja__fail(x, PD_EINVAL, "dictsort needs a mapping");
    int pos = 0;
    if (!JARG_MISSING(v[1])) {
        if (v[1].t == JV_STR && !strcmp(v[1].u.s->s, "value")) pos = 1;
        else if (!(v[1].t == JV_STR && !strcmp(v[1].u.s->s, "key")))
            return jinja__fail(x, PD_EINVAL, "You can only sort by either \"key\" or \"value\"");
    }
    jv fn;
    if ((rc = jinja__getattr(x, in, "items", 5, NULL, &fn))) return rc;
    rc = jinja__call(x, fn, NULL, 0, NULL, NULL, 0, &pairs);
    jinja__decref(x, fn);
    if (rc) return rc;
    pairs.u.l->kind = JL_LIST;
    jlist *l;
    size_t *idx;
    jv attr = jv_int(pos);
    rc = sorted_items(x, pairs, attr, false, arg_true(v[0]), arg_true(v[2]), &l, &idx);
    jinja__decref(x, pairs);
    if (rc) return rc;
    rc = jinja__list_new(x, JL_LIST, l->n, o);
    for (size_t i = 0; i < l->n && !rc; i++) {
        jinja__incref(l->v[idx[i]]);
        rc = jinja__list_push(x, o->u.l, l->v[idx[i]]);
    }
    jinja__free(x, idx, (l->n ? l->n : 1) * sizeof *idx);
    release_list(x, l);
    return list_out(x, rc, o);
}

static int f_minmax(jx *x, jv in, const jargs *a, bool max, jv *o)
{
    static const char *const ps[] = {"case_sensitive", "attribute"};
    jv v[2];
    int rc = jinja__bind(x, max ? "max" : "min", a, ps, 2, v);
    if (rc) return rc;
    jlist *l;
    if ((rc = jinja__iter_list(x, in, &l))) return rc;
    if (!l->n) {
        release_list(x, l);
        *o = jv_undef(NULL);
        return 0;
    }
    size_t best = 0;
    jv bk = jv_none();
    rc = sort_key(x, l->v[0], v[1], false, arg_true(v[0]), &bk);
    if (rc) bk = jv_none();
    for (size_t i = 1; i < l->n && !rc; i++) {
        jv k;
        int c;
        if ((rc = sort_key(x, l->v[i], v[1], false, arg_true(v[0]), &k))) break;
        rc = jinja__cmp(x, k, bk, &c);
        if (!rc && (max ? c > 0 : c < 0)) {
            jinja__decref(x, bk);
            bk = k;
            best = i;
        } else {
            jinja__decref(x, k);
        }
    }
    jinja__decref(x, bk);
    if (!rc) {
        *o = l->v[best];
        jinja__incref(*o);
    }
    release_list(x, l);
    return rc;
}
static int f_max(jx *x, jv in, const jargs *a, jv *o) { return f_minmax(x, in, a, true, o); }
static int f_min(jx *x, jv in, const jargs *a, jv *o) { return f_minmax(x, in, a, false, o); }

static int f_replace(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"old", "new", "count"};
    jv v[3], s, old, rep;
    int64_t count = -1;
    int rc = jinja__bind(x, "replace", a, ps, 3, v);
    if (rc) return rc;
    if (JARG_MISSING(v[0]) || JARG_MISSING(v[1]))
        return jinja__fail(x, PD_EINVAL, "replace() needs old and new");
    if (!JARG_MISSING(v[2]) && v[2].t != JV_NONE && (rc = want_int(x, "count", v[2], &count))) return rc;
    if ((rc = jinja__to_str(x, in, &s))) return rc;
    if ((rc = jinja__to_str(x, v[0], &old))) goto out_s;
    if ((rc = jinja__to_str(x, v[1], &rep))) goto out_old;
    rc = jinja__str_replace(x, s.u.s, old.u.s, rep.u.s, count, o);
    jinja__decref(x, rep);
out_old:
    jinja__decref(x, old);
out_s:
    jinja__decref(x, s);
    return rc;
}

static int f_reverse(jx *x, jv in, const jargs *a, jv *o)
{
    (void)a;
    if (in.t == JV_STR) {
        int rc = 0;
        jbuf b = {0};
        const jstr *s = in.u.s;
        for (size_t e = s->len; e > 0 && !rc;) {
            size_t st = e - 1;
            while (st > 0 && ((unsigned char)s->s[st] & 0xC0) == 0x80) st--;
            rc = jinja__buf_put(x, &b, s->s + st, e - st);
            e = st;
        }
        if (rc) {
            jinja__buf_free(x, &b);
            return rc;
        }
        return jinja__str_from_buf(x, &b, o);
    }
    bool gen = in.t == JV_LIST && in.u.l->kind == JL_GEN;
    if (!(in.t == JV_LIST || in.t == JV_DICT || in.t == JV_UNDEF))
        return jinja__fail(x, PD_EINVAL, "argument must be iterable");
    jlist *l;
    int rc = jinja__iter_list(x, in, &l);
    if (rc) return rc;
    rc = jinja__list_new(x, gen ? JL_LIST : JL_GEN, l->n, o);
    for (size_t i = l->n; i > 0 && !rc; i--) {
        jinja__incref(l->v[i - 1]);
        rc = jinja__list_push(x, o->u.l, l->v[i - 1]);
    }
    release_list(x, l);
    return list_out(x, rc, o);
}

static int f_round(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"precision", "method"};
    jv v[2];
    int64_t prec = 0;
    int rc = jinja__bind(x, "round", a, ps, 2, v);
    if (rc || (!JARG_MISSING(v[0]) && (rc = want_int(x, "precision", v[0], &prec)))) return rc;
    const char *method = "common";
    if (!JARG_MISSING(v[1])) {
        if (v[1].t != JV_STR) return jinja__fail(x, PD_EINVAL, "method must be common, ceil or floor");
        method = v[1].u.s->s;
    }
    bool common = !strcmp(method, "common"), ceil_ = !strcmp(method, "ceil");
    if (!common && !ceil_ && strcmp(method, "floor"))
        return jinja__fail(x, PD_EINVAL, "method must be common, ceil or floor");
    if (in.t != JV_FLOAT && in.t != JV_INT && in.t != JV_BOOL)
        return jinja__fail(x, PD_EINVAL, "type %s doesn't define __round__ method", jinja__type_name(in));
    if (prec > 300) prec = 300;
    if (prec < -300) prec = -300;
    if (common && in.t != JV_FLOAT) { /* round(int, n) stays an int */
        int64_t i = in.t == JV_INT ? in.u.i : in.u.b;
        if (prec >= 0) {
            *o = jv_int(i);
            return 0;
        }
        double p = pow(10.0, (double)-prec), q = (double)i / p, r = nearbyint(q);
        if (fabs(q - trunc(q)) == 0.5) r = 2.0 * nearbyint(q / 2.0); /* half to even */
        *o = jv_int((int64_t)(r * p));
        return 0;
    }
    double f = in.t == JV_FLOAT ? in.u.f : (double)(in.t == JV_INT ? in.u.i : in.u.b);
    if (common) {
        if (isnan(f) || isinf(f)) {
            *o = jv_float(f);
            return 0;
        }
        if (prec >= 0) { /* correctly rounded, half to even on the exact binary value */
            char buf[400];
            snprintf(buf, sizeof buf, "%.*f", (int)(prec > 100 ? 100 : prec), f);
            *o = jv_float(strtod(buf, NULL));
        } else {
            double p = pow(10.0, (double)-prec), q = f / p, r = nearbyint(q);
            *o = jv_float(r * p);
        }
        return 0;
    }
    double p = pow(10.0, (double)prec);
    *o = jv_float((ceil_ ? ceil(f * p) : floor(f * p)) / p);
    return 0;
}

static int f_string(jx *x, jv in, const jargs *a, jv *o) { (void)a; return jinja__to_str(x, in, o); }

static int f_sum(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"attribute", "start"};
    jv v[2];
    int rc = jinja__bind(x, "sum", a, ps, 2, v);
    if (rc) return rc;
    jlist *l;
    if ((rc = jinja__iter_list(x, in, &l))) return rc;
    jv acc = JARG_MISSING(v[1]) ? jv_int(0) : v[1];
    if (acc.t == JV_STR) {
        release_list(x, l);
        return jinja__fail(x, PD_EINVAL, "sum() can't sum strings [use ''.join(seq) instead]");
    }
    jinja__incref(acc);
    for (size_t i = 0; i < l->n && !rc; i++) {
        jv e = l->v[i], r;
        if (!JARG_MISSING(v[0]) && v[0].t != JV_NONE) {
            if ((rc = attr_get(x, l->v[i], v[0], jv_undef(jinja__missing), &e))) break;
        } else {
            jinja__incref(e);
        }
        rc = jinja__binop(x, JOP_ADD, acc, e, &r);
        jinja__decref(x, e);
        jinja__decref(x, acc);
        acc = rc ? jv_none() : r;
    }
    release_list(x, l);
    if (rc) {
        jinja__decref(x, acc);
        return rc;
    }
    *o = acc;
    return 0;
}

/* transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
static int f_tojson(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"ensure_ascii", "indent", "separators", "sort_keys"};
    jv v[4];
    int rc = jinja__bind(x, "tojson", a, ps, 4, v);
    if (rc) return rc;
    int indent = -1;
    const char *indent_str = NULL, *item_sep = NULL, *key_sep = NULL;
    if (!JARG_MISSING(v[1]) && v[1].t != JV_NONE) {
        if (v[1].t == JV_STR) {
            indent_str = v[1].u.s->s;
        } else {
            int64_t i = 0;
            if ((rc = want_int(x, "indent", v[1], &i))) return rc;
            indent = i < 0 ? 0 : i > 1000 ? 1000 : (int)i;
        }
    }
    if (!JARG_MISSING(v[2]) && v[2].t != JV_NONE) {
        jv s = v[2];
        if (s.t != JV_LIST || s.u.l->n != 2 || s.u.l->kind == JL_GEN ||
            s.u.l->v[0].t != JV_STR || s.u.l->v[1].t != JV_STR)
            return jinja__fail(x, PD_EINVAL, "separators must be a pair of strings");
        item_sep = s.u.l->v[0].u.s->s;
        key_sep = s.u.l->v[1].u.s->s;
    }
    jbuf b = {0};
    rc = jinja__put_json(x, &b, in, arg_true(v[0]), indent, indent_str, item_sep, key_sep,
                         arg_true(v[3]), 0);
    return jinja__buf_result(x, &b, rc, o);
}

static int f_trim(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"chars"};
    jv v[1], s;
    int rc = jinja__bind(x, "trim", a, ps, 1, v);
    if (rc || (rc = jinja__to_str(x, in, &s))) return rc;
    const jstr *chars = NULL;
    if (!JARG_MISSING(v[0]) && v[0].t != JV_NONE) {
        if (v[0].t != JV_STR) {
            jinja__decref(x, s);
            return jinja__fail(x, PD_EINVAL, "strip arg must be None or str");
        }
        chars = v[0].u.s;
    }
    rc = jinja__str_strip(x, s.u.s, chars, 3, o);
    jinja__decref(x, s);
    return rc;
}

static int f_unique(jx *x, jv in, const jargs *a, jv *o)
{
    static const char *const ps[] = {"case_sensitive", "attribute"};
    jv v[2];
    int rc = jinja__bind(x, "unique", a, ps, 2, v);
    if (rc) return rc;
    jlist *l;
    if ((rc = jinja__iter_list(x, in, &l))) return rc;
    jv seen;
    if ((rc = jinja__list_new(x, JL_LIST, 0, &seen))) {
        release_list(x, l);
        return rc;
    }
    rc = jinja__list_new(x, JL_GEN, 0, o);
    for (size_t i = 0; i < l->n && !rc; i++) {
        jv k;
        bool dup = false;
        if ((rc = sort_key(x, l->v[i], v[1], false, arg_true(v[0]), &k))) break;
        for (size_t s = 0; s < seen.u.l->n && !rc && !dup; s++) rc = jinja__eq(x, seen.u.l->v[s], k, &dup);
        if (rc || dup) {
            jinja__decref(x, k);
            continue;
        }
        if ((rc = jinja__list_push(x, seen.u.l, k))) break;
        jinja__incref(l->v[i]);
        rc = jinja__list_push(x, o->u.l, l->v[i]);
    }
    jinja__decref(x, seen);
    release_list(x, l);
    return list_out(x, rc, o);
}

static int f_center(jx *x, jv in, const jargs *a, jv *o)
{
    jv s, fn;
    int rc = jinja__to_str(x, in, &s);
    if (rc) return rc;
    jv w = a->npos ? a->pos[0] : jv_int(80);
    if ((rc = jinja__getattr(x, s, "center", 6, NULL, &fn))) {
        jinja__decref(x, s);
        return rc;
    }
    rc = jinja__call(x, fn, &w, 1, NULL, NULL, 0, o);
    jinja__decref(x, fn);
    jinja__decref(x, s);
    return rc;
}

static const struct {
    const char *name;
    filter_fn fn; /* NULL: jinja2 has it, this subset does not */
} filters[] = {
    {"abs", f_abs},           {"attr", f_attr},
    {"capitalize", f_capitalize}, {"center", f_center},
    {"count", f_length},      {"d", f_default},
    {"default", f_default},   {"dictsort", f_dictsort},
    {"e", f_escape},          {"escape", f_escape},
    {"first", f_first},       {"float", f_float},
    {"format", f_format},     {"indent", f_indent},
    {"int", f_int},           {"items", f_items},
    {"join", f_join},         {"last", f_last},
    {"length", f_length},     {"list", f_list},
    {"lower", f_lower},       {"map", f_map},
    {"max", f_max},           {"min", f_min},
    {"reject", f_reject},     {"rejectattr", f_rejectattr},
    {"replace", f_replace},   {"reverse", f_reverse},
    {"round", f_round},       {"safe", f_string},
    {"select", f_select},     {"selectattr", f_selectattr},
    {"sort", f_sort},         {"string", f_string},
    {"sum", f_sum},           {"title", f_title},
    {"tojson", f_tojson},     {"trim", f_trim},
    {"unique", f_unique},     {"upper", f_upper},
    {"batch", NULL},          {"filesizeformat", NULL},
    {"forceescape", NULL},    {"groupby", NULL},
    {"pprint", NULL},         {"random", NULL},
    {"slice", NULL},          {"striptags", NULL},
    {"truncate", NULL},       {"urlencode", NULL},
    {"urlize", NULL},         {"wordcount", NULL},
    {"wordwrap", NULL},       {"xmlattr", NULL},
};
enum { N_FILTERS = sizeof filters / sizeof filters[0] };

int jinja__filter_id(const char *name, size_t len)
{
    for (int i = 0; i < N_FILTERS; i++)
        if (strlen(filters[i].name) == len && memcmp(filters[i].name, name, len) == 0) return i;
    return JID_UNKNOWN;
}

int jinja__filter(jx *x, int id, const char *name, jv in, const jargs *a, jv *out)
{
    if (id < 0 || id >= N_FILTERS)
        return jinja__fail(x, PD_EINVAL, "No filter named '%s' found.", name);
    if (!filters[id].fn)
        return jinja__fail(x, PD_EINVAL, "the filter '%s' is not supported", name);
    return filters[id].fn(x, in, a, out);
}

int jinja__filter_by_name(jx *x, jv name, jv in, const jargs *a, jv *out)
{
    if (name.t != JV_STR) return jinja__fail(x, PD_EINVAL, "a filter name must be a string");
    return jinja__filter(x, jinja__filter_id(name.u.s->s, name.u.s->len), name.u.s->s, in, a, out);
}

static int t_filter(jx *x, jv in, const jargs *a, bool *o)
{
    (void)x, (void)a;
    *o = in.t == JV_STR && jinja__filter_id(in.u.s->s, in.u.s->len) >= 0;
    return 0;
}

static int t_test(jx *x, jv in, const jargs *a, bool *o)
{
    (void)x, (void)a;
    *o = in.t == JV_STR && jinja__test_id(in.u.s->s, in.u.s->len) >= 0;
    return 0;
}
