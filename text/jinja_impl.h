/* jinja_impl.h -- Internals shared by text/jinja_*.c: values (refcounted, Python-like),
 * the AST, the template and the render context. Not for use outside the jinja files.
 *
 * Ownership rule for values: a jv returned through an out-parameter is a new reference (the
 * caller releases it with jinja__decref); a jv passed as an argument is borrowed unless the
 * function says "takes". Objects with rc < 0 are immortal: they belong to a template (its
 * constants and names), are never freed by a render and so may be shared by threads. */
#ifndef PD_JINJA_IMPL_H
#define PD_JINJA_IMPL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "text/jinja.h"

/* ---- values ---- */
typedef enum {
    JV_UNDEF, /* jinja2's default Undefined; u.hint names what was missing (may be NULL) */
    JV_NONE,
    JV_BOOL,
    JV_INT, /* int64; Python's big integers are not offered: overflow is an error */
    JV_FLOAT,
    JV_STR,  /* u.s */
    JV_LIST, /* u.l: list, tuple, dict view or generator (jlist.kind) */
    JV_DICT, /* u.d: insertion-ordered */
    JV_NS,   /* u.d: a namespace() object, its attributes in a dict */
    JV_FUNC, /* u.fn: macro, caller, global function or bound method */
    JV_LOOP, /* u.lp: a for loop's `loop` */
} jv_type;

enum { JVF_UNSAFE = 1 };        /* undefined from a sandbox-blocked attribute (list.append) */
enum { JV_DEPTH_MAX = 200 };    /* nesting of lists and dicts in one value */

typedef struct jstr jstr;
typedef struct jlist jlist;
typedef struct jdict jdict;
typedef struct jfunc jfunc;
typedef struct jloop jloop;

typedef struct jv {
    uint8_t t;     /* jv_type */
    uint8_t flags; /* JVF_* */
    union {
        bool b;
        int64_t i;
        double f;
        jstr *s;
        jlist *l;
        jdict *d;
        jfunc *fn;
        jloop *lp;
        int32_t *rc;      /* any heap object: its refcount is the first field */
        const char *hint; /* JV_UNDEF: NUL-terminated name for messages, or NULL */
    } u;
} jv;

struct jstr {
    int32_t rc;   /* < 0: immortal */
    int32_t pad;
    size_t len;   /* bytes, without the NUL */
    size_t ncp;   /* code points (== len for ASCII) */
    char s[];     /* len bytes + NUL */
};

typedef enum { JL_LIST, JL_TUPLE, JL_KEYS, JL_VALUES, JL_ITEMS, JL_GEN } jl_kind;

struct jlist {
    int32_t rc;
    uint8_t kind;   /* jl_kind; JL_GEN is a one-shot iterator (what select, map, ... return) */
    uint16_t depth; /* 1 + deepest item's depth */
    size_t pos;     /* JL_GEN: items before pos were consumed */
    size_t n, cap;
    jv *v;
};

struct jdict {
    int32_t rc;
    uint16_t depth;
    size_t n, cap;
    jv *k, *v;
};

typedef enum { FN_GLOBAL, FN_MACRO, FN_CALLER, FN_METHOD } jfn_kind;

struct jfunc {
    int32_t rc;
    uint8_t kind;             /* jfn_kind */
    int id;                   /* FN_GLOBAL: global id; FN_METHOD: method id */
    const struct jnode *node; /* FN_MACRO / FN_CALLER: the definition */
    struct jscope *scope;     /* FN_CALLER: the call block's scope; NULL once it ended */
    jv self;                  /* FN_METHOD: the bound object (owned) */
};

struct jloop {
    int32_t rc;
    int64_t index0, length;
    jlist *items; /* the iterated items (owned) */
};


#define JV_IS_HEAP(v) ((v).t >= JV_STR)
static inline jv jv_undef(const char *hint)
{
    jv v = {.t = JV_UNDEF};
    v.u.hint = hint;
    return v;
}
static inline jv jv_none(void) { return (jv){.t = JV_NONE}; }
static inline jv jv_bool(bool b)
{
    jv v = {.t = JV_BOOL};
    v.u.b = b;
    return v;
}
static inline jv jv_int(int64_t i)
{
    jv v = {.t = JV_INT};
    v.u.i = i;
    return v;
}
static inline jv jv_float(double f)
{
    jv v = {.t = JV_FLOAT};
    v.u.f = f;
    return v;
}

/* ---- AST ---- */
typedef enum {
    /* statements */
    N_BODY,    /* kids: statements */
    N_DATA,    /* str: text to output */
    N_PRINT,   /* a: expression to output */
    N_IF,      /* kids: test, body, test, body, ... (if, elif, ...); d: else body or NULL */
    N_FOR,     /* names: targets (op 1 = tuple), a: iterable, b: filter or NULL, c: body, d: else */
    N_SET,     /* op: SET_*; names: targets; str: attribute (SET_NS); a: value, or NULL with
                  c: body and b: filter chain (or NULL) for the block form */
    N_MACRO,   /* str: name, names: params, kw: defaults (NULL = none), c: body, op: MACRO_USES_* */
    N_CALLBLK, /* a: N_CALL, names: caller params, kw: defaults, c: body */
    N_FILTBLK, /* b: filter chain whose innermost input is NULL (the body), c: body */
    N_WITH,    /* names: targets, kids: values, c: body */
    N_BREAK,
    N_CONTINUE,
    /* expressions */
    N_CONST,   /* cval (immortal) */
    N_NAME,    /* str: interned name, id: global id or -1 */
    N_GETATTR, /* a: object, str: attribute */
    N_GETITEM, /* a: object, b: key or N_SLICE */
    N_SLICE,   /* a, b, c: start, stop, step (NULL = none) */
    N_CALL,    /* a: callee, kids: positional args, names + kw: keyword args */
    N_FILTER,  /* a: input (NULL in a filter block), id: filter id, str: name, args as N_CALL */
    N_TEST,    /* a: input, id: test id, str: name, args as N_CALL */
    N_NOT,     /* a */
    N_NEG,     /* a */
    N_POS,     /* a */
    N_BINOP,   /* op: JOP_*, a, b */
    N_AND,     /* a, b */
    N_OR,      /* a, b */
    N_CONCAT,  /* kids */
    N_COMPARE, /* a: first operand, kids: N_OPERAND each with op and a */
    N_OPERAND,
    N_COND,    /* a: test, b: value when true, c: value when false or NULL (undefined) */
    N_LIST,    /* kids */
    N_TUPLE,   /* kids */
    N_DICT,    /* kids: key, value, key, value, ... */
} jnode_kind;

/* operators (tokens and N_BINOP / N_OPERAND ops) */
typedef enum {
    JOP_NONE,
    JOP_ADD, JOP_SUB, JOP_MUL, JOP_DIV, JOP_FLOORDIV, JOP_MOD, JOP_POW, JOP_TILDE,
    JOP_LBRACKET, JOP_RBRACKET, JOP_LPAREN, JOP_RPAREN, JOP_LBRACE, JOP_RBRACE,
    JOP_EQ, JOP_NE, JOP_LT, JOP_LE, JOP_GT, JOP_GE, JOP_ASSIGN, JOP_DOT, JOP_COLON,
    JOP_PIPE, JOP_COMMA, JOP_SEMICOLON,
    JOP_IN, JOP_NOTIN, /* compare operands only */
} jop;

enum { SET_NAME, SET_NS, SET_TUPLE };
enum { MACRO_USES_VARARGS = 1, MACRO_USES_KWARGS = 2, MACRO_USES_CALLER = 4 };

/* filter / test ids that fail when reached (jinja2 knows the name; this subset does not, or
 * nobody knows it and it sits where jinja2 checks only at run time) */
enum { JID_UNSUPPORTED = -2, JID_UNKNOWN = -3 };

typedef struct jnode {
    uint8_t kind; /* jnode_kind */
    uint8_t op;
    uint16_t depth; /* expressions: 1 + the deepest child's depth (bounded at parse time) */
    int32_t line;
    int32_t id;
    int32_t n_kids, n_names;
    struct jnode *a, *b, *c, *d;
    struct jnode **kids;
    struct jnode **kw;       /* parallel to names where the node has keyword values */
    const jstr **names;      /* interned */
    const jstr *str;
    jv cval;
} jnode;

/* ---- template ---- */
typedef struct jarena_chunk jarena_chunk;

struct jinja_template {
    jarena_chunk *arena; /* every node, name and constant */
    jnode *root;         /* N_BODY */
    const jstr **atoms;  /* interned names, open addressing (n_atoms_cap slots) */
    size_t n_atoms, cap_atoms;
    const jstr *a_loop, *a_varargs, *a_kwargs, *a_caller; /* well-known names */
};

/* Interned name of t equal to s, or NULL when the template never names it. */
const jstr *jinja__atom_find(const jinja_template *t, const char *s, size_t len);

/* ---- render context ---- */
typedef struct jscope {
    struct jscope *parent;
    int n, cap;
    const jstr **k; /* interned names */
    jv *v;          /* owned */
} jscope;

typedef struct jbuf {
    char *p;
    size_t n, cap;
} jbuf;

typedef struct jx {
    const jinja_template *t;
    size_t mem, max_mem;    /* bytes held by values and buffers */
    size_t max_out;         /* bytes of any one output or string */
    uint64_t steps, max_steps;
    int depth, max_depth;   /* macro / caller nesting */
    int64_t now;
    jscope *root, *scope;   /* template-level scope; innermost scope */
    jbuf *out;              /* where output goes now */
    jdict **nss;            /* every namespace() made (owned), cleared at the end */
    size_t n_nss, cap_nss;
    int line;               /* line of the node being evaluated, for messages */
    int rdepth;             /* C recursion of the evaluator */
    jv block_input;         /* the body text a filter block or set block filters (borrowed) */
    bool failed;
    char *err;              /* PD_ERR_LEN */
} jx;

/* Sets err (prefixed with "line N: ") once and returns code (PD_EINVAL / PD_ENOMEM). */
int jinja__fail(jx *x, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The error of raise_exception: err is msg verbatim. */
int jinja__raise(jx *x, const char *msg, size_t len);

/* Counts n more steps of work (bulk work: bytes copied or scanned, 256 a step; items made);
 * PD_EINVAL once over max_steps. */
int jinja__charge(jx *x, uint64_t n);

/* memory: every allocation of a render goes through these (counted against max_mem) */
void *jinja__alloc(jx *x, size_t n);
void *jinja__realloc(jx *x, void *p, size_t old_n, size_t new_n);
void jinja__free(jx *x, void *p, size_t n);

/* ---- values (jinja_value.c) ---- */
static inline void jinja__incref(jv v)
{
    if (JV_IS_HEAP(v) && *v.u.rc >= 0) ++*v.u.rc;
}
void jinja__decref(jx *x, jv v);
const char *jinja__type_name(jv v); /* Python's: 'str', 'int', 'NoneType', ... */

int jinja__str_new(jx *x, const char *s, size_t len, jv *out);
int jinja__str_from_buf(jx *x, jbuf *b, jv *out); /* frees b's memory */
/* rc == 0: jinja__str_from_buf(b) into *out; else frees b and returns rc (the end of a
 * builder that may have failed). */
int jinja__buf_result(jx *x, jbuf *b, int rc, jv *out);
int jinja__list_new(jx *x, uint8_t kind, size_t cap, jv *out);
int jinja__list_push(jx *x, jlist *l, jv v); /* takes v (also on error) */
int jinja__dict_new(jx *x, jv *out, bool ns);
int jinja__dict_set(jx *x, jdict *d, jv k, jv v); /* takes k and v (also on error) */
/* The value of key k in d (borrowed), or NULL. */
const jv *jinja__dict_get(jx *x, const jdict *d, jv k);
const jv *jinja__dict_get_str(const jdict *d, const char *s, size_t len);
int jinja__func_new(jx *x, uint8_t kind, int id, const jnode *node, jv *out);

bool jinja__truthy(jv v);
/* Python ==; sets *eq. Errors only on values nested too deeply. */
int jinja__eq(jx *x, jv a, jv b, bool *eq);
/* Python's ordering (<): *c is -1, 0 or 1; TypeError for unorderable types. */
int jinja__cmp(jx *x, jv a, jv b, int *c);
/* str(v) / repr(v) appended to b. */
int jinja__put_str(jx *x, jbuf *b, jv v);
int jinja__put_repr(jx *x, jbuf *b, jv v, int depth);
/* str(v) as a new string value (v itself, incref'ed, when it is one). */
int jinja__to_str(jx *x, jv v, jv *out);
/* transformers' tojson: json.dumps(v, ensure_ascii, indent (<0: None), separators, sort_keys).
 * item_sep / key_sep NULL = json.dumps' defaults; indent_str overrides indent when not NULL. */
int jinja__put_json(jx *x, jbuf *b, jv v, bool ensure_ascii, int indent, const char *indent_str,
                    const char *item_sep, const char *key_sep, bool sort_keys, int depth);
void jinja__put_float(char *buf, size_t n, double f); /* Python's repr(float) */
int jinja__from_json(jx *x, const json_t *j, jv *out, int depth);

int jinja__buf_put(jx *x, jbuf *b, const char *s, size_t n);
void jinja__buf_free(jx *x, jbuf *b);

/* ---- text (jinja_text.c): UTF-8 code points, Python's character classes ---- */
uint32_t jinja__u8_next(const char *s, size_t len, size_t *i); /* lenient: bad byte = itself */
size_t jinja__u8_put(char *dst, uint32_t cp);                  /* 1..4 bytes */
size_t jinja__u8_count(const char *s, size_t len);
bool jinja__is_space(uint32_t cp); /* Python's str.isspace() */
/* byte offset of code point index i in s (s->ncp when i >= ncp) */
size_t jinja__u8_offset(const jstr *s, size_t i);
bool jinja__u8_valid(const char *s, size_t len, size_t *bad);
uint32_t jinja__cp_upper(uint32_t cp);
uint32_t jinja__cp_lower(uint32_t cp);
uint32_t jinja__cp_title(uint32_t cp);
bool jinja__cp_is_alpha(uint32_t cp);
bool jinja__cp_is_cased(uint32_t cp);
bool jinja__cp_is_upper(uint32_t cp);
bool jinja__cp_is_lower(uint32_t cp);
bool jinja__cp_is_digit(uint32_t cp);
bool jinja__cp_printable(uint32_t cp);

/* ---- evaluation (jinja_eval.c), used by the builtins ---- */
int jinja__eval(jx *x, const jnode *n, jv *out);
/* Keeps a namespace() alive until the end of the render (which empties it first, breaking
 * cycles such as ns.self = ns). */
int jinja__ns_register(jx *x, jv ns);
/* obj.name as jinja2's sandbox resolves it (method, then key; undefined when missing). hint
 * names the attribute in later messages and must outlive the render (NULL = none). */
int jinja__getattr(jx *x, jv obj, const char *name, size_t len, const char *hint, jv *out);
/* obj[key] (key, then attribute for string keys; undefined when missing). */
int jinja__getitem(jx *x, jv obj, jv key, jv *out);
int jinja__binop(jx *x, int op, jv a, jv b, jv *out);
int jinja__contains(jx *x, jv container, jv item, bool *in);
/* Calls a callable value (macro, caller, global, method). */
int jinja__call(jx *x, jv fn, const jv *args, int nargs, const jstr *const *kwn, const jv *kwv,
                int nkw, jv *out);
/* The items of an iterable as a list (a new reference; a list itself is shared, a generator
 * is consumed): str -> characters, dict -> keys, undefined -> empty; TypeError otherwise. */
int jinja__iter_list(jx *x, jv v, jlist **out);

/* ---- builtins (jinja_builtins.c) ---- */
typedef struct jargs {
    const jv *pos;
    int npos;
    const jstr *const *kwn;
    const jv *kwv;
    int nkw;
} jargs;

int jinja__filter_id(const char *name, size_t len); /* >= 0, or JID_UNSUPPORTED / JID_UNKNOWN */
int jinja__test_id(const char *name, size_t len);
int jinja__global_id(const char *name, size_t len); /* >= 0 or -1 */
int jinja__method_id(uint8_t type, const char *name, size_t len, bool *unsafe); /* or -1 */
const char *jinja__global_name(int id);
const char *jinja__method_name(int id);
int jinja__filter(jx *x, int id, const char *name, jv in, const jargs *a, jv *out);
int jinja__test(jx *x, int id, const char *name, jv in, const jargs *a, bool *out);
int jinja__call_global(jx *x, int id, const jargs *a, jv *out);
int jinja__call_method(jx *x, int id, jv self, const jargs *a, jv *out);
/* The test or filter named by a string value at run time (select('odd'), map('upper')). */
int jinja__test_by_name(jx *x, jv name, jv in, const jargs *a, bool *out);
int jinja__filter_by_name(jx *x, jv name, jv in, const jargs *a, jv *out);

/* Arguments bound to parameter names: slots[i] is borrowed, JARG_MISSING when not given.
 * Returns PD_EINVAL for too many arguments or an unknown keyword. */
extern const char jinja__missing[];
#define JARG_MISSING(v) ((v).t == JV_UNDEF && (v).u.hint == jinja__missing)
int jinja__bind(jx *x, const char *fname, const jargs *a, const char *const *params, int np,
                jv *slots);

/* ---- strings (jinja_methods.c), shared with the filters ---- */
enum { JCASE_UPPER, JCASE_LOWER, JCASE_CAPITALIZE, JCASE_TITLE, JCASE_JINJA_TITLE, JCASE_SWAP };
int jinja__str_case(jx *x, const jstr *s, int mode, jv *out);
/* strip (mode 3), lstrip (1), rstrip (2) of chars, or of whitespace when chars is NULL */
int jinja__str_strip(jx *x, const jstr *s, const jstr *chars, int mode, jv *out);
int jinja__str_replace(jx *x, const jstr *s, const jstr *old, const jstr *rep, int64_t count,
                       jv *out);
/* str.splitlines(keepends) as a new list */
int jinja__splitlines(jx *x, const jstr *s, bool keepends, jv *out);
/* Python's fmt % args (printf-style formatting). */
int jinja__format_percent(jx *x, jv fmt, jv args, jv *out);

/* the lexer and parser (jinja_parse.c) use these to build immortal constants */
jstr *jinja__arena_str(jarena_chunk **arena, const char *s, size_t len);

#endif
