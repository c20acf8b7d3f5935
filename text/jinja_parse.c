/* jinja_parse.c -- The Jinja parser: tokens to an AST, a recursive descent that follows
 * jinja2's parser.py rule for rule (precedence, tuples, tests with a bare argument, filters
 * binding tighter than operators, statements and their end tags), so that a template means
 * here what it means to jinja2. Unknown filters and tests are errors at parse time, except
 * where jinja2 defers them to run time (inside if statements and conditional expressions). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/jinja_lex.h"

enum { MAX_NEST = 100 };        /* parser recursion: nested expressions, nested statements */
enum { MAX_EXPR_DEPTH = 300 };  /* depth of one expression's tree (a+b+c+... grows it too) */

typedef struct jp {
    jinja_template *t;
    jlexed lx;
    size_t pos;
    char *err;
    int rc;
    int depth;
    int loop_depth;     /* for loops around the statement (macros start again at 0) */
    bool soft;          /* inside an if: unknown filters and tests fail only when reached */
    jnode *macro;       /* the macro whose body is being parsed, for MACRO_USES_* */
} jp;

typedef struct {
    jnode **v;
    int n, cap;
} nvec;

/* ---- names ---- */
static uint64_t hash_name(const char *s, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

const jstr *jinja__atom_find(const jinja_template *t, const char *s, size_t len)
{
    if (!t->cap_atoms) return NULL;
    size_t m = t->cap_atoms - 1;
    for (size_t i = hash_name(s, len) & m;; i = (i + 1) & m) {
        const jstr *a = t->atoms[i];
        if (!a) return NULL;
        if (a->len == len && memcmp(a->s, s, len) == 0) return a;
    }
}

static const jstr *intern(jp *p, const char *s, size_t len)
{
    jinja_template *t = p->t;
    const jstr *a = jinja__atom_find(t, s, len);
    if (a) return a;
    if (2 * (t->n_atoms + 1) > t->cap_atoms) {
        size_t cap = t->cap_atoms ? t->cap_atoms * 2 : 64;
        const jstr **v = calloc(cap, sizeof *v);
        if (!v) return NULL;
        for (size_t i = 0; i < t->cap_atoms; i++) {
            const jstr *x = t->atoms[i];
            if (!x) continue;
            size_t k = hash_name(x->s, x->len) & (cap - 1);
            while (v[k]) k = (k + 1) & (cap - 1);
            v[k] = x;
        }
        free(t->atoms);
        t->atoms = v;
        t->cap_atoms = cap;
    }
    jstr *n = jinja__arena_str(&t->arena, s, len);
    if (!n) return NULL;
    size_t k = hash_name(s, len) & (t->cap_atoms - 1);
    while (t->atoms[k]) k = (k + 1) & (t->cap_atoms - 1);
    t->atoms[k] = n;
    t->n_atoms++;
    return n;
}

/* ---- token stream ---- */
static const jtok *cur(jp *p) { return &p->lx.toks[p->pos]; }
static const jtok *look(jp *p)
{
    return &p->lx.toks[p->pos + (p->lx.toks[p->pos].type != TK_EOF)];
}
static void adv(jp *p)
{
    if (cur(p)->type != TK_EOF) p->pos++;
}
static bool tok_name(const jtok *t, const char *s)
{
    size_t n = strlen(s);
    return t->type == TK_NAME && t->len == n && memcmp(t->s, s, n) == 0;
}
static bool tok_op(const jtok *t, int op) { return t->type == TK_OP && t->op == op; }

static const char *op_text(int op)
{
    static const char *const s[] = {"",   "+", "-", "/", "//", "%",  "**", "~", "[", "]",
                                    "(",  ")", "{", "}", "==", "!=", "<",  "<=", ">", ">=",
                                    "=",  ".", ":", "|", ",",  ";",  "in", "not in"};
    return op >= 0 && op < (int)(sizeof s / sizeof s[0]) ? s[op] : "?";
}

static void describe(const jtok *t, char *buf, size_t n)
{
    switch (t->type) {
    case TK_EOF: snprintf(buf, n, "end of template"); break;
    case TK_DATA: snprintf(buf, n, "template data"); break;
    case TK_VAR_BEGIN: snprintf(buf, n, "begin of print statement"); break;
    case TK_VAR_END: snprintf(buf, n, "end of print statement"); break;
    case TK_BLOCK_BEGIN: snprintf(buf, n, "begin of statement block"); break;
    case TK_BLOCK_END: snprintf(buf, n, "end of statement block"); break;
    case TK_NAME: snprintf(buf, n, "%.*s", (int)(t->len > 60 ? 60 : t->len), t->s); break;
    case TK_STRING: snprintf(buf, n, "string"); break;
    case TK_INT: snprintf(buf, n, "integer"); break;
    case TK_FLOAT: snprintf(buf, n, "float"); break;
    default: snprintf(buf, n, "%s", op_text(t->op));
    }
}

static jnode *failf(jp *p, const jtok *t, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static jnode *failf(jp *p, const jtok *t, const char *fmt, ...)
{
    if (p->rc) return NULL;
    char msg[PD_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->rc = jinja__lex_err(p->lx.src, p->lx.len, t->off, p->err, "%s", msg);
    return NULL;
}

static jnode *oom(jp *p)
{
    if (!p->rc) p->rc = pd_errf(p->err, PD_ENOMEM, "out of memory parsing the template");
    return NULL;
}

static jnode *unexpected(jp *p)
{
    char d[80];
    describe(cur(p), d, sizeof d);
    return failf(p, cur(p), "unexpected '%s'", d);
}

static bool expect_op(jp *p, int op)
{
    if (tok_op(cur(p), op)) {
        adv(p);
        return true;
    }
    char d[80];
    describe(cur(p), d, sizeof d);
    failf(p, cur(p), "expected '%s', got '%s'", op_text(op), d);
    return false;
}

static bool expect_type(jp *p, int type, const char *what)
{
    if (cur(p)->type == type) {
        adv(p);
        return true;
    }
    char d[80];
    describe(cur(p), d, sizeof d);
    failf(p, cur(p), "expected %s, got '%s'", what, d);
    return false;
}

static jnode *mk(jp *p, int kind, const jtok *at)
{
    jnode *n = jinja__arena_alloc(&p->t->arena, sizeof *n);
    if (!n) return oom(p);
    n->kind = (uint8_t)kind;
    n->line = at->line;
    n->id = -1;
    return n;
}

static bool push(jp *p, nvec *v, jnode *x)
{
    if (v->n == v->cap) {
        int cap = v->cap ? v->cap * 2 : 4;
        jnode **nv = jinja__arena_alloc(&p->t->arena, (size_t)cap * sizeof *nv);
        if (!nv) return oom(p), false;
        if (v->n) memcpy(nv, v->v, (size_t)v->n * sizeof *nv);
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    return true;
}

static const jstr **names_array(jp *p, const jstr **tmp, int n)
{
    const jstr **v = jinja__arena_alloc(&p->t->arena, (size_t)(n ? n : 1) * sizeof *v);
    if (!v) return oom(p), NULL;
    memcpy(v, tmp, (size_t)n * sizeof *v);
    return v;
}

static int depth_of(const jnode *n) { return n ? n->depth : 0; }

/* Records n's depth once its children are set; refuses expressions deeper than
 * MAX_EXPR_DEPTH, so that nothing walking the tree recursively can exhaust the stack. */
static jnode *seal(jp *p, jnode *n)
{
    if (!n) return NULL;
    int d = depth_of(n->a);
    if (depth_of(n->b) > d) d = depth_of(n->b);
    if (depth_of(n->c) > d) d = depth_of(n->c);
    if (depth_of(n->d) > d) d = depth_of(n->d);
    for (int i = 0; i < n->n_kids; i++)
        if (depth_of(n->kids[i]) > d) d = depth_of(n->kids[i]);
    if (n->kw)
        for (int i = 0; i < n->n_names; i++)
            if (depth_of(n->kw[i]) > d) d = depth_of(n->kw[i]);
    if (d + 1 > MAX_EXPR_DEPTH)
        return failf(p, cur(p), "expression nested too deeply (over %d levels)", MAX_EXPR_DEPTH);
    n->depth = (uint16_t)(d + 1);
    return n;
}

static bool enter(jp *p)
{
    if (++p->depth > MAX_NEST) {
        failf(p, cur(p), "template nested too deeply (over %d levels)", MAX_NEST);
        return false;
    }
    return true;
}

/* ---- expressions ---- */
static jnode *parse_expression(jp *p, bool with_condexpr);
static jnode *parse_tuple(jp *p, bool simplified, bool with_condexpr, const char *extra_end,
                          bool explicit_parens);
static jnode *parse_unary(jp *p, bool with_filter);
static jnode *parse_primary(jp *p);
static jnode *parse_postfix(jp *p, jnode *n);
static jnode *parse_filter(jp *p, jnode *n, bool start_inline);

/* Marks the unknown filters and tests of an expression as deferred to run time. */
static void soften(jnode *n)
{
    if (!n) return;
    if ((n->kind == N_FILTER || n->kind == N_TEST) && n->id == JID_UNKNOWN) n->op = 1;
    soften(n->a);
    soften(n->b);
    soften(n->c);
    soften(n->d);
    for (int i = 0; i < n->n_kids; i++) soften(n->kids[i]);
    if (n->kw)
        for (int i = 0; i < n->n_names; i++) soften(n->kw[i]);
}

static jnode *parse_condexpr(jp *p)
{
    if (!enter(p)) return NULL;
    const jtok *at = cur(p);
    jnode *e1 = parse_expression(p, false);
    while (e1 && tok_name(cur(p), "if")) {
        adv(p);
        bool soft = p->soft;
        p->soft = true;
        soften(e1);
        jnode *n = mk(p, N_COND, at);
        jnode *e2 = parse_expression(p, false), *e3 = NULL;
        if (e2 && tok_name(cur(p), "else")) {
            adv(p);
            e3 = parse_condexpr(p);
            if (!e3) e2 = NULL;
        }
        p->soft = soft;
        if (!n || !e2) return NULL;
        n->a = e2;
        n->b = e1;
        n->c = e3;
        if (!(e1 = seal(p, n))) return NULL;
        at = cur(p);
    }
    p->depth--;
    return e1;
}

static jnode *parse_not(jp *p);
static jnode *parse_and(jp *p);

static jnode *parse_expression(jp *p, bool with_condexpr)
{
    if (with_condexpr) return parse_condexpr(p);
    /* or: and ('or' and)* ; and: not ('and' not)* */
    const jtok *at = cur(p);
    jnode *left = parse_and(p);
    while (left && tok_name(cur(p), "or")) {
        adv(p);
        jnode *r = parse_and(p), *n = mk(p, N_OR, at);
        if (!r || !n) return NULL;
        n->a = left;
        n->b = r;
        if (!(left = seal(p, n))) return NULL;
    }
    return left;
}

static jnode *parse_and(jp *p)
{
    const jtok *at = cur(p);
    jnode *left = parse_not(p);
    while (left && tok_name(cur(p), "and")) {
        adv(p);
        jnode *r = parse_not(p), *n = mk(p, N_AND, at);
        if (!r || !n) return NULL;
        n->a = left;
        n->b = r;
        if (!(left = seal(p, n))) return NULL;
    }
    return left;
}

static jnode *parse_math1(jp *p);

static jnode *parse_compare(jp *p)
{
    const jtok *at = cur(p);
    jnode *expr = parse_math1(p);
    if (!expr) return NULL;
    nvec ops = {0};
    for (;;) {
        const jtok *t = cur(p);
        int op = 0;
        if (t->type == TK_OP && t->op >= JOP_EQ && t->op <= JOP_GE) {
            op = t->op;
            adv(p);
        } else if (tok_name(t, "in")) {
            op = JOP_IN;
            adv(p);
        } else if (tok_name(t, "not") && tok_name(look(p), "in")) {
            op = JOP_NOTIN;
            adv(p);
            adv(p);
        } else {
            break;
        }
        jnode *o = mk(p, N_OPERAND, t), *r = parse_math1(p);
        if (!o || !r) return NULL;
        o->op = (uint8_t)op;
        o->a = r;
        if (!seal(p, o) || !push(p, &ops, o)) return NULL;
    }
    if (!ops.n) return expr;
    jnode *n = mk(p, N_COMPARE, at);
    if (!n) return NULL;
    n->a = expr;
    n->kids = ops.v;
    n->n_kids = ops.n;
    return seal(p, n);
}

static jnode *parse_not(jp *p)
{
    if (tok_name(cur(p), "not")) {
        const jtok *at = cur(p);
        adv(p);
        if (!enter(p)) return NULL;
        jnode *n = mk(p, N_NOT, at), *a = parse_not(p);
        p->depth--;
        if (!n || !a) return NULL;
        n->a = a;
        return seal(p, n);
    }
    return parse_compare(p);
}

static jnode *binop(jp *p, const jtok *at, int op, jnode *a, jnode *b)
{
    if (!a || !b) return NULL;
    jnode *n = mk(p, N_BINOP, at);
    if (!n) return NULL;
    n->op = (uint8_t)op;
    n->a = a;
    n->b = b;
    return seal(p, n);
}

static jnode *parse_pow(jp *p)
{
    const jtok *at = cur(p);
    jnode *left = parse_unary(p, true);
    while (left && tok_op(cur(p), JOP_POW)) {
        adv(p);
        left = binop(p, at, JOP_POW, left, parse_unary(p, true));
    }
    return left;
}

static jnode *parse_math2(jp *p)
{
    const jtok *at = cur(p);
    jnode *left = parse_pow(p);
    while (left && cur(p)->type == TK_OP &&
           (cur(p)->op == JOP_MUL || cur(p)->op == JOP_DIV || cur(p)->op == JOP_FLOORDIV ||
            cur(p)->op == JOP_MOD)) {
        int op = cur(p)->op;
        adv(p);
        left = binop(p, at, op, left, parse_pow(p));
    }
    return left;
}

static jnode *parse_concat(jp *p)
{
    const jtok *at = cur(p);
    jnode *first = parse_math2(p);
    if (!first || !tok_op(cur(p), JOP_TILDE)) return first;
    nvec args = {0};
    if (!push(p, &args, first)) return NULL;
    while (tok_op(cur(p), JOP_TILDE)) {
        adv(p);
        jnode *a = parse_math2(p);
        if (!a || !push(p, &args, a)) return NULL;
    }
    jnode *n = mk(p, N_CONCAT, at);
    if (!n) return NULL;
    n->kids = args.v;
    n->n_kids = args.n;
    return seal(p, n);
}

static jnode *parse_math1(jp *p)
{
    const jtok *at = cur(p);
    jnode *left = parse_concat(p);
    while (left && cur(p)->type == TK_OP && (cur(p)->op == JOP_ADD || cur(p)->op == JOP_SUB)) {
        int op = cur(p)->op;
        adv(p);
        left = binop(p, at, op, left, parse_concat(p));
    }
    return left;
}

/* ( args ) of a call, filter or test into n (kids, names + kw). */
static bool parse_call_args(jp *p, jnode *n)
{
    const jtok *at = cur(p);
    if (!expect_op(p, JOP_LPAREN)) return false;
    nvec args = {0}, kwv = {0};
    const jstr *kwn[64];
    int nkw = 0;
    bool need_comma = false;
    while (!tok_op(cur(p), JOP_RPAREN)) {
        if (need_comma) {
            if (!expect_op(p, JOP_COMMA)) return false;
            if (tok_op(cur(p), JOP_RPAREN)) break;
        }
        if (tok_op(cur(p), JOP_MUL) || tok_op(cur(p), JOP_POW)) {
            failf(p, cur(p), "*args and **kwargs in calls are not supported");
            return false;
        }
        if (cur(p)->type == TK_NAME && tok_op(look(p), JOP_ASSIGN)) {
            if (nkw == 64) {
                failf(p, cur(p), "too many keyword arguments");
                return false;
            }
            const jstr *name = intern(p, cur(p)->s, cur(p)->len);
            if (!name) return oom(p), false;
            adv(p);
            adv(p);
            jnode *v = parse_expression(p, true);
            if (!v || !push(p, &kwv, v)) return false;
            kwn[nkw++] = name;
        } else {
            if (nkw) {
                failf(p, at, "invalid syntax for function call expression");
                return false;
            }
            jnode *v = parse_expression(p, true);
            if (!v || !push(p, &args, v)) return false;
        }
        need_comma = true;
    }
    adv(p);
    n->kids = args.v;
    n->n_kids = args.n;
    n->kw = kwv.v;
    n->n_names = nkw;
    if (nkw && !(n->names = names_array(p, kwn, nkw))) return false;
    return true;
}

static jnode *parse_call(jp *p, jnode *callee)
{
    jnode *n = mk(p, N_CALL, cur(p));
    if (!n) return NULL;
    n->a = callee;
    if (!parse_call_args(p, n)) return NULL;
    return seal(p, n);
}

/* a dotted name after '|' or 'is' */
static bool dotted_name(jp *p, char *buf, size_t n, size_t *len)
{
    const jtok *t = cur(p);
    if (t->type != TK_NAME) {
        char d[80];
        describe(t, d, sizeof d);
        failf(p, t, "expected a name, got '%s'", d);
        return false;
    }
    size_t k = 0;
    for (;;) {
        t = cur(p);
        if (k + t->len + 2 > n) {
            failf(p, t, "name too long");
            return false;
        }
        memcpy(buf + k, t->s, t->len);
        k += t->len;
        adv(p);
        if (!tok_op(cur(p), JOP_DOT)) break;
        adv(p);
        if (cur(p)->type != TK_NAME) {
            failf(p, cur(p), "expected a name after '.'");
            return false;
        }
        buf[k++] = '.';
    }
    buf[k] = 0;
    *len = k;
    return true;
}

static jnode *parse_filter(jp *p, jnode *n, bool start_inline)
{
    while (tok_op(cur(p), JOP_PIPE) || start_inline) {
        if (!start_inline) adv(p);
        start_inline = false;
        const jtok *at = cur(p);
        char name[128];
        size_t len;
        if (!dotted_name(p, name, sizeof name, &len)) return NULL;
        jnode *f = mk(p, N_FILTER, at);
        if (!f || !(f->str = intern(p, name, len))) return oom(p);
        f->a = n;
        f->id = jinja__filter_id(name, len);
        f->op = p->soft;
        if (tok_op(cur(p), JOP_LPAREN) && !parse_call_args(p, f)) return NULL;
        if (!(n = seal(p, f))) return NULL;
    }
    return n;
}

static jnode *parse_test(jp *p, jnode *n)
{
    const jtok *at = cur(p);
    adv(p); /* is */
    bool negated = false;
    if (tok_name(cur(p), "not")) {
        adv(p);
        negated = true;
    }
    char name[128];
    size_t len;
    if (!dotted_name(p, name, sizeof name, &len)) return NULL;
    jnode *t = mk(p, N_TEST, at);
    if (!t || !(t->str = intern(p, name, len))) return oom(p);
    t->a = n;
    t->id = jinja__test_id(name, len);
    t->op = p->soft;
    const jtok *c = cur(p);
    if (tok_op(c, JOP_LPAREN)) {
        if (!parse_call_args(p, t)) return NULL;
    } else if ((c->type == TK_NAME || c->type == TK_STRING || c->type == TK_INT ||
                c->type == TK_FLOAT || tok_op(c, JOP_LPAREN) || tok_op(c, JOP_LBRACKET) ||
                tok_op(c, JOP_LBRACE)) &&
               !tok_name(c, "else") && !tok_name(c, "or") && !tok_name(c, "and")) {
        if (tok_name(c, "is")) return failf(p, c, "You cannot chain multiple tests with is");
        jnode *arg = parse_primary(p);
        if (!arg || !(arg = parse_postfix(p, arg))) return NULL;
        jnode **kids = jinja__arena_alloc(&p->t->arena, sizeof *kids);
        if (!kids) return oom(p);
        kids[0] = arg;
        t->kids = kids;
        t->n_kids = 1;
    }
    if (!seal(p, t)) return NULL;
    if (!negated) return t;
    jnode *no = mk(p, N_NOT, at);
    if (!no) return NULL;
    no->a = t;
    return seal(p, no);
}

static jnode *parse_filter_expr(jp *p, jnode *n)
{
    while (n) {
        if (tok_op(cur(p), JOP_PIPE)) n = parse_filter(p, n, false);
        else if (tok_name(cur(p), "is")) n = parse_test(p, n);
        else if (tok_op(cur(p), JOP_LPAREN)) n = parse_call(p, n);
        else break;
    }
    return n;
}

static jnode *parse_unary(jp *p, bool with_filter)
{
    if (!enter(p)) return NULL;
    const jtok *at = cur(p);
    jnode *n;
    if (tok_op(at, JOP_SUB) || tok_op(at, JOP_ADD)) {
        adv(p);
        n = mk(p, at->op == JOP_SUB ? N_NEG : N_POS, at);
        jnode *a = parse_unary(p, false);
        if (!n || !a) return NULL;
        n->a = a;
        if (!seal(p, n)) return NULL;
    } else {
        n = parse_primary(p);
    }
    n = parse_postfix(p, n);
    if (with_filter) n = parse_filter_expr(p, n);
    p->depth--;
    return n;
}

static jnode *mk_const(jp *p, const jtok *at, jv v)
{
    jnode *n = mk(p, N_CONST, at);
    if (n) n->cval = v;
    return n;
}

static jnode *parse_list_like(jp *p, int kind, int close)
{
    const jtok *at = cur(p);
    adv(p);
    nvec items = {0};
    while (!tok_op(cur(p), close)) {
        if (items.n && !expect_op(p, JOP_COMMA)) return NULL;
        if (tok_op(cur(p), close)) break;
        jnode *k = parse_expression(p, true);
        if (!k || !push(p, &items, k)) return NULL;
        if (kind == N_DICT) {
            if (!expect_op(p, JOP_COLON)) return NULL;
            jnode *v = parse_expression(p, true);
            if (!v || !push(p, &items, v)) return NULL;
        }
    }
    adv(p);
    jnode *n = mk(p, kind, at);
    if (!n) return NULL;
    n->kids = items.v;
    n->n_kids = items.n;
    return seal(p, n);
}

static jnode *parse_primary(jp *p)
{
    const jtok *t = cur(p);
    switch (t->type) {
    case TK_NAME: {
        adv(p);
        if (tok_name(t, "true") || tok_name(t, "True")) return mk_const(p, t, jv_bool(true));
        if (tok_name(t, "false") || tok_name(t, "False")) return mk_const(p, t, jv_bool(false));
        if (tok_name(t, "none") || tok_name(t, "None")) return mk_const(p, t, jv_none());
        jnode *n = mk(p, N_NAME, t);
        if (!n || !(n->str = intern(p, t->s, t->len))) return oom(p);
        n->id = jinja__global_id(t->s, t->len);
        if (p->macro) {
            if (n->str == p->t->a_varargs) p->macro->op |= MACRO_USES_VARARGS;
            if (n->str == p->t->a_kwargs) p->macro->op |= MACRO_USES_KWARGS;
            if (n->str == p->t->a_caller) p->macro->op |= MACRO_USES_CALLER;
        }
        return n;
    }
    case TK_STRING: {
        adv(p);
        if (cur(p)->type != TK_STRING) {
            jv v = {.t = JV_STR};
            v.u.s = (jstr *)t->str;
            return mk_const(p, t, v);
        }
        size_t total = 0;
        for (size_t i = p->pos - 1; p->lx.toks[i].type == TK_STRING; i++) total += p->lx.toks[i].len;
        char *buf = malloc(total + 1);
        if (!buf) return oom(p);
        size_t k = 0;
        for (const jtok *s = t; s->type == TK_STRING; s++) {
            memcpy(buf + k, s->s, s->len);
            k += s->len;
        }
        while (cur(p)->type == TK_STRING) adv(p);
        jstr *str = jinja__arena_str(&p->t->arena, buf, k);
        free(buf);
        if (!str) return oom(p);
        jv v = {.t = JV_STR};
        v.u.s = str;
        return mk_const(p, t, v);
    }
    case TK_INT: adv(p); return mk_const(p, t, jv_int(t->i));
    case TK_FLOAT: adv(p); return mk_const(p, t, jv_float(t->f));
    case TK_OP:
        if (t->op == JOP_LPAREN) {
            adv(p);
            jnode *n = parse_tuple(p, false, true, NULL, true);
            if (!n || !expect_op(p, JOP_RPAREN)) return NULL;
            return n;
        }
        if (t->op == JOP_LBRACKET) return parse_list_like(p, N_LIST, JOP_RBRACKET);
        if (t->op == JOP_LBRACE) return parse_list_like(p, N_DICT, JOP_RBRACE);
        break;
    default: break;
    }
    return unexpected(p);
}

static bool is_tuple_end(jp *p, const char *extra_end)
{
    const jtok *t = cur(p);
    if (t->type == TK_VAR_END || t->type == TK_BLOCK_END || tok_op(t, JOP_RPAREN)) return true;
    return extra_end && tok_name(t, extra_end);
}

static jnode *parse_tuple(jp *p, bool simplified, bool with_condexpr, const char *extra_end,
                          bool explicit_parens)
{
    const jtok *at = cur(p);
    nvec args = {0};
    bool is_tuple = false;
    for (;;) {
        if (args.n && !expect_op(p, JOP_COMMA)) return NULL;
        if (is_tuple_end(p, extra_end)) break;
        jnode *e = simplified ? parse_primary(p) : parse_expression(p, with_condexpr);
        if (!e || !push(p, &args, e)) return NULL;
        if (tok_op(cur(p), JOP_COMMA)) is_tuple = true;
        else break;
    }
    if (!is_tuple) {
        if (args.n) return args.v[0];
        if (!explicit_parens) {
            char d[80];
            describe(cur(p), d, sizeof d);
            return failf(p, cur(p), "Expected an expression, got '%s'", d);
        }
    }
    jnode *n = mk(p, N_TUPLE, at);
    if (!n) return NULL;
    n->kids = args.v;
    n->n_kids = args.n;
    return seal(p, n);
}

static jnode *parse_subscribed(jp *p)
{
    const jtok *at = cur(p);
    jnode *args[3] = {NULL, NULL, NULL};
    if (tok_op(cur(p), JOP_COLON)) {
        adv(p);
    } else {
        jnode *e = parse_expression(p, true);
        if (!e || !tok_op(cur(p), JOP_COLON)) return e;
        adv(p);
        args[0] = e;
    }
    if (!tok_op(cur(p), JOP_COLON) && !tok_op(cur(p), JOP_RBRACKET) && !tok_op(cur(p), JOP_COMMA))
        if (!(args[1] = parse_expression(p, true))) return NULL;
    if (tok_op(cur(p), JOP_COLON)) {
        adv(p);
        if (!tok_op(cur(p), JOP_RBRACKET) && !tok_op(cur(p), JOP_COMMA))
            if (!(args[2] = parse_expression(p, true))) return NULL;
    }
    jnode *n = mk(p, N_SLICE, at);
    if (!n) return NULL;
    n->a = args[0];
    n->b = args[1];
    n->c = args[2];
    return seal(p, n);
}

static jnode *parse_postfix(jp *p, jnode *n)
{
    while (n) {
        const jtok *t = cur(p);
        if (tok_op(t, JOP_DOT)) {
            adv(p);
            const jtok *a = cur(p);
            adv(p);
            if (a->type == TK_NAME) {
                jnode *g = mk(p, N_GETATTR, t);
                if (!g || !(g->str = intern(p, a->s, a->len))) return oom(p);
                g->a = n;
                if (!(n = seal(p, g))) return NULL;
            } else if (a->type == TK_INT) {
                jnode *g = mk(p, N_GETITEM, t), *k = mk_const(p, a, jv_int(a->i));
                if (!g || !k) return NULL;
                g->a = n;
                g->b = k;
                if (!(n = seal(p, g))) return NULL;
            } else {
                return failf(p, a, "expected name or number");
            }
        } else if (tok_op(t, JOP_LBRACKET)) {
            adv(p);
            nvec args = {0};
            while (!tok_op(cur(p), JOP_RBRACKET)) {
                if (args.n && !expect_op(p, JOP_COMMA)) return NULL;
                jnode *s = parse_subscribed(p);
                if (!s || !push(p, &args, s)) return NULL;
            }
            adv(p);
            jnode *g = mk(p, N_GETITEM, t);
            if (!g) return NULL;
            g->a = n;
            if (args.n == 1) {
                g->b = args.v[0];
            } else {
                jnode *tu = mk(p, N_TUPLE, t);
                if (!tu) return NULL;
                tu->kids = args.v;
                tu->n_kids = args.n;
                if (!(g->b = seal(p, tu))) return NULL;
            }
            if (!(n = seal(p, g))) return NULL;
        } else if (tok_op(t, JOP_LPAREN)) {
            n = parse_call(p, n);
        } else {
            break;
        }
    }
    return n;
}

/* ---- statements ---- */
static jnode *parse_body(jp *p, const char *const *ends);

/* the body of a statement: optional ':', '%}', statements up to an end tag (left current) */
static jnode *parse_statements(jp *p, const char *const *ends)
{
    if (tok_op(cur(p), JOP_COLON)) adv(p);
    if (!expect_type(p, TK_BLOCK_END, "end of statement block")) return NULL;
    return parse_body(p, ends);
}

/* parse_statements for a body that opens a new frame: unknown filters are load errors
 * there again, as in jinja2's compiler */
static jnode *parse_inner(jp *p, const char *const *ends)
{
    bool soft = p->soft;
    p->soft = false;
    jnode *b = parse_statements(p, ends);
    p->soft = soft;
    return b;
}

static bool end_tag(jp *p, const char *name)
{
    if (!tok_name(cur(p), name)) {
        failf(p, cur(p), "expected '%s'", name);
        return false;
    }
    adv(p);
    return true;
}

/* target names of for / set: name (',' name)* */
static bool parse_targets(jp *p, jnode *n, const char *extra_end)
{
    const jstr *names[32];
    int k = 0;
    bool tuple = false;
    for (;;) {
        if (k && !expect_op(p, JOP_COMMA)) return false;
        if (k && (cur(p)->type == TK_BLOCK_END || tok_op(cur(p), JOP_ASSIGN) ||
                  (extra_end && tok_name(cur(p), extra_end))))
            break;
        const jtok *t = cur(p);
        if (t->type != TK_NAME || tok_name(t, "true") || tok_name(t, "false") ||
            tok_name(t, "none") || tok_name(t, "True") || tok_name(t, "False") ||
            tok_name(t, "None")) {
            if (tok_op(t, JOP_LPAREN)) failf(p, t, "nested assignment targets are not supported");
            else failf(p, t, "can't assign to this target");
            return false;
        }
        if (k == 32) {
            failf(p, t, "too many assignment targets");
            return false;
        }
        if (!(names[k++] = intern(p, t->s, t->len))) return oom(p), false;
        adv(p);
        if (tok_op(cur(p), JOP_COMMA)) tuple = true;
        else break;
    }
    n->names = names_array(p, names, k);
    n->n_names = k;
    n->op = tuple;
    return n->names != NULL;
}

static jnode *parse_for(jp *p, const jtok *at)
{
    static const char *const ends[] = {"endfor", "else", NULL};
    static const char *const ends2[] = {"endfor", NULL};
    jnode *n = mk(p, N_FOR, at);
    if (!n || !parse_targets(p, n, "in")) return NULL;
    if (!end_tag(p, "in")) return NULL;
    if (!(n->a = parse_tuple(p, false, false, "recursive", false))) return NULL;
    bool soft = p->soft;
    p->soft = false;
    if (tok_name(cur(p), "if")) {
        adv(p);
        if (!(n->b = parse_expression(p, true))) return NULL;
    }
    if (tok_name(cur(p), "recursive")) return failf(p, cur(p), "recursive loops are not supported");
    p->loop_depth++;
    n->c = parse_statements(p, ends);
    p->loop_depth--;
    if (!n->c) return NULL;
    if (tok_name(cur(p), "else")) {
        adv(p);
        if (!(n->d = parse_statements(p, ends2))) return NULL;
    }
    p->soft = soft;
    adv(p); /* endfor */
    return n;
}

static jnode *parse_if(jp *p, const jtok *at)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    static const char *const ends2[] = {"endif", NULL};
    bool soft = p->soft;
    p->soft = true;
    jnode *n = mk(p, N_IF, at);
    nvec branches = {0}; /* test, body, test, body, ... (elif chains stay flat) */
    if (!n) return NULL;
    for (;;) {
        jnode *test = parse_tuple(p, false, false, NULL, false), *body;
        if (!test || !push(p, &branches, test)) return NULL;
        if (!(body = parse_statements(p, ends)) || !push(p, &branches, body)) return NULL;
        const jtok *t = cur(p);
        adv(p);
        if (tok_name(t, "elif")) continue;
        if (tok_name(t, "else")) {
            if (!(n->d = parse_statements(p, ends2))) return NULL;
            adv(p);
        }
        break;
    }
    n->kids = branches.v;
    n->n_kids = branches.n;
    p->soft = soft;
    return n;
}

static jnode *parse_set(jp *p, const jtok *at)
{
    static const char *const ends[] = {"endset", NULL};
    jnode *n = mk(p, N_SET, at);
    if (!n) return NULL;
    if (cur(p)->type == TK_NAME && tok_op(look(p), JOP_DOT)) {
        const jtok *ns = cur(p);
        adv(p);
        adv(p);
        if (cur(p)->type != TK_NAME) return failf(p, cur(p), "expected an attribute name");
        const jstr *nm = intern(p, ns->s, ns->len);
        if (!nm || !(n->str = intern(p, cur(p)->s, cur(p)->len)) ||
            !(n->names = names_array(p, &nm, 1)))
            return oom(p);
        n->n_names = 1;
        n->op = SET_NS;
        adv(p);
    } else {
        if (!parse_targets(p, n, NULL)) return NULL;
        n->op = n->op ? SET_TUPLE : SET_NAME;
    }
    if (tok_op(cur(p), JOP_ASSIGN)) {
        adv(p);
        n->a = parse_tuple(p, false, true, NULL, false);
        return n->a ? n : NULL;
    }
    if (n->op == SET_TUPLE) return failf(p, cur(p), "a block set assigns one name");
    if (tok_op(cur(p), JOP_PIPE) && !(n->b = parse_filter(p, NULL, false))) return NULL;
    if (!(n->c = parse_inner(p, ends))) return NULL;
    adv(p);
    return n;
}

/* ( name [= default], ... ) into n->names / n->kw */
static bool parse_signature(jp *p, jnode *n)
{
    if (!expect_op(p, JOP_LPAREN)) return false;
    const jstr *names[64];
    nvec defs = {0};
    int k = 0;
    bool any_default = false;
    while (!tok_op(cur(p), JOP_RPAREN)) {
        if (k && !expect_op(p, JOP_COMMA)) return false;
        const jtok *t = cur(p);
        if (t->type != TK_NAME) {
            failf(p, t, "expected a parameter name");
            return false;
        }
        if (k == 64) {
            failf(p, t, "too many parameters");
            return false;
        }
        if (!(names[k] = intern(p, t->s, t->len))) return oom(p), false;
        adv(p);
        jnode *d = NULL;
        if (tok_op(cur(p), JOP_ASSIGN)) {
            adv(p);
            if (!(d = parse_expression(p, true))) return false;
            any_default = true;
        } else if (any_default) {
            failf(p, t, "non-default argument follows default argument");
            return false;
        }
        if (!push(p, &defs, d)) return false;
        k++;
    }
    adv(p);
    n->names = names_array(p, names, k);
    n->n_names = k;
    n->kw = defs.v;
    return n->names != NULL;
}

static jnode *parse_macro(jp *p, const jtok *at)
{
    static const char *const ends[] = {"endmacro", NULL};
    jnode *n = mk(p, N_MACRO, at);
    if (!n) return NULL;
    if (cur(p)->type != TK_NAME) return failf(p, cur(p), "expected a macro name");
    if (!(n->str = intern(p, cur(p)->s, cur(p)->len))) return oom(p);
    adv(p);
    jnode *outer = p->macro;
    int loops = p->loop_depth;
    p->macro = n;
    p->loop_depth = 0;
    bool ok = parse_signature(p, n) && (n->c = parse_inner(p, ends)) != NULL;
    p->macro = outer;
    p->loop_depth = loops;
    if (!ok) return NULL;
    adv(p);
    return n;
}

static jnode *parse_call_block(jp *p, const jtok *at)
{
    static const char *const ends[] = {"endcall", NULL};
    jnode *n = mk(p, N_CALLBLK, at);
    if (!n) return NULL;
    jnode *outer = p->macro;
    int loops = p->loop_depth;
    if (tok_op(cur(p), JOP_LPAREN) && !parse_signature(p, n)) return NULL;
    const jtok *c = cur(p);
    if (!(n->a = parse_expression(p, true))) return NULL;
    if (n->a->kind != N_CALL) return failf(p, c, "expected call");
    p->macro = NULL;
    p->loop_depth = 0;
    n->c = parse_inner(p, ends);
    p->macro = outer;
    p->loop_depth = loops;
    if (!n->c) return NULL;
    adv(p);
    return n;
}

static jnode *parse_statement(jp *p)
{
    const jtok *t = cur(p);
    if (t->type != TK_NAME) return failf(p, t, "tag name expected");
    static const char *const end_filter[] = {"endfilter", NULL}, *const end_with[] = {"endwith", NULL},
                             *const end_gen[] = {"endgeneration", NULL};
    adv(p);
    if (tok_name(t, "for")) return parse_for(p, t);
    if (tok_name(t, "if")) return parse_if(p, t);
    if (tok_name(t, "set")) return parse_set(p, t);
    if (tok_name(t, "macro")) return parse_macro(p, t);
    if (tok_name(t, "call")) return parse_call_block(p, t);
    if (tok_name(t, "break") || tok_name(t, "continue")) {
        if (!p->loop_depth)
            return failf(p, t, "'%.*s' outside a for loop", (int)t->len, t->s);
        return mk(p, tok_name(t, "break") ? N_BREAK : N_CONTINUE, t);
    }
    if (tok_name(t, "filter")) {
        jnode *n = mk(p, N_FILTBLK, t);
        if (!n || !(n->b = parse_filter(p, NULL, true)) || !(n->c = parse_inner(p, end_filter)))
            return NULL;
        adv(p);
        return n;
    }
    if (tok_name(t, "with") || tok_name(t, "generation")) {
        /* with: a scope with assignments; generation (transformers' AssistantTracker): a
         * scope whose output is rendered in place */
        jnode *n = mk(p, N_WITH, t);
        if (!n) return NULL;
        if (tok_name(t, "with")) {
            const jstr *names[32];
            nvec vals = {0};
            int k = 0;
            while (cur(p)->type != TK_BLOCK_END) {
                if (k && !expect_op(p, JOP_COMMA)) return NULL;
                if (cur(p)->type != TK_NAME || k == 32) return failf(p, cur(p), "expected a name");
                if (!(names[k++] = intern(p, cur(p)->s, cur(p)->len))) return oom(p);
                adv(p);
                if (!expect_op(p, JOP_ASSIGN)) return NULL;
                jnode *v = parse_expression(p, true);
                if (!v || !push(p, &vals, v)) return NULL;
            }
            if (!(n->names = names_array(p, names, k))) return NULL;
            n->n_names = k;
            n->kids = vals.v;
            n->n_kids = vals.n;
        }
        if (!(n->c = parse_inner(p, tok_name(t, "with") ? end_with : end_gen))) return NULL;
        adv(p);
        return n;
    }
    if (tok_name(t, "print")) {
        jnode *body = mk(p, N_BODY, t);
        nvec kids = {0};
        if (!body) return NULL;
        while (cur(p)->type != TK_BLOCK_END) {
            if (kids.n && !expect_op(p, JOP_COMMA)) return NULL;
            jnode *e = parse_expression(p, true), *pr = mk(p, N_PRINT, t);
            if (!e || !pr) return NULL;
            pr->a = e;
            if (!push(p, &kids, pr)) return NULL;
        }
        body->kids = kids.v;
        body->n_kids = kids.n;
        return body;
    }
    static const char *const unsupported[] = {"extends", "include", "import", "from",
                                              "block", "autoescape", "trans", "do", NULL};
    for (int i = 0; unsupported[i]; i++)
        if (tok_name(t, unsupported[i]))
            return failf(p, t, "the '%s' statement is not supported", unsupported[i]);
    return failf(p, t, "Encountered unknown tag '%.*s'.", (int)(t->len > 60 ? 60 : t->len), t->s);
}

static jnode *parse_body(jp *p, const char *const *ends)
{
    if (!enter(p)) return NULL;
    jnode *body = mk(p, N_BODY, cur(p));
    nvec kids = {0};
    if (!body) return NULL;
    for (;;) {
        const jtok *t = cur(p);
        if (t->type == TK_EOF) {
            if (ends) {
                return failf(p, t, "unexpected end of template: expected {%% %s %%}", ends[0]);
            }
            break;
        }
        jnode *s;
        if (t->type == TK_DATA) {
            adv(p);
            s = mk(p, N_DATA, t);
            if (!s || !(s->str = jinja__arena_str(&p->t->arena, t->s, t->len))) return oom(p);
        } else if (t->type == TK_VAR_BEGIN) {
            adv(p);
            s = mk(p, N_PRINT, t);
            if (!s || !(s->a = parse_tuple(p, false, true, NULL, false))) return NULL;
            if (!expect_type(p, TK_VAR_END, "end of print statement")) return NULL;
        } else if (t->type == TK_BLOCK_BEGIN) {
            adv(p);
            if (ends)
                for (int i = 0; ends[i]; i++)
                    if (tok_name(cur(p), ends[i])) {
                        body->kids = kids.v;
                        body->n_kids = kids.n;
                        p->depth--;
                        return body;
                    }
            if (!(s = parse_statement(p))) return NULL;
            if (!expect_type(p, TK_BLOCK_END, "end of statement block")) return NULL;
        } else {
            return unexpected(p);
        }
        if (!push(p, &kids, s)) return NULL;
    }
    body->kids = kids.v;
    body->n_kids = kids.n;
    p->depth--;
    return body;
}

/* The first filter or test that jinja2 would refuse at compile time. */
static const jnode *find_unknown(const jnode *n)
{
    if (!n) return NULL;
    if ((n->kind == N_FILTER || n->kind == N_TEST) && n->id == JID_UNKNOWN && !n->op) return n;
    const jnode *r;
    if ((r = find_unknown(n->a)) || (r = find_unknown(n->b)) || (r = find_unknown(n->c)) ||
        (r = find_unknown(n->d)))
        return r;
    for (int i = 0; i < n->n_kids; i++)
        if ((r = find_unknown(n->kids[i]))) return r;
    if (n->kw)
        for (int i = 0; i < n->n_names; i++)
            if ((r = find_unknown(n->kw[i]))) return r;
    return NULL;
}

jinja_parse_params jinja_default_parse_params(void)
{
    return (jinja_parse_params){.trim_blocks = false, .lstrip_blocks = false,
                                .keep_trailing_newline = false};
}

int jinja_parse(const char *src, size_t len, const jinja_parse_params *pp, jinja_template **out,
                char *err)
{
    *out = NULL;
    jinja_parse_params def = jinja_default_parse_params();
    if (!pp) pp = &def;
    if (!src && len) return pd_errf(err, PD_EINVAL, "template source is NULL");
    size_t bad;
    if (!jinja__u8_valid(src, len, &bad))
        return jinja__lex_err(src, len, bad, err, "the template is not valid UTF-8");
    jinja_template *t = calloc(1, sizeof *t);
    if (!t) return pd_errf(err, PD_ENOMEM, "out of memory");
    jp p = {.t = t, .err = err};
    int rc = jinja__lex(src ? src : "", len, pp, &t->arena, err, &p.lx);
    if (rc) goto fail;
    if (!(t->a_loop = intern(&p, "loop", 4)) || !(t->a_varargs = intern(&p, "varargs", 7)) ||
        !(t->a_kwargs = intern(&p, "kwargs", 6)) || !(t->a_caller = intern(&p, "caller", 6))) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    t->root = parse_body(&p, NULL);
    if (!t->root) {
        rc = p.rc ? p.rc : pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    const jnode *u = find_unknown(t->root);
    if (u) {
        rc = pd_errf(err, PD_EFORMAT, "line %d: no %s named '%s'", u->line,
                     u->kind == N_FILTER ? "filter" : "test", u->str->s);
        goto fail;
    }
    jinja__lexed_free(&p.lx);
    *out = t;
    return 0;
fail:
    jinja__lexed_free(&p.lx);
    jinja_destroy(t);
    return rc;
}

void jinja_destroy(jinja_template *t)
{
    if (!t) return;
    jinja__arena_free(t->arena);
    free(t->atoms);
    free(t);
}
