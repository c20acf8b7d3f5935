/* jinja_lex.h -- Tokens of the Jinja lexer (text/jinja_lex.c) and the template arena, for
 * the parser. Internal to text/jinja*.c. */
#ifndef PD_JINJA_LEX_H
#define PD_JINJA_LEX_H

#include "text/jinja_impl.h"

typedef enum {
    TK_EOF,
    TK_DATA,
    TK_VAR_BEGIN,
    TK_VAR_END,
    TK_BLOCK_BEGIN,
    TK_BLOCK_END,
    TK_NAME,
    TK_STRING,
    TK_INT,
    TK_FLOAT,
    TK_OP,
} jtok_type;

typedef struct jtok {
    uint8_t type; /* jtok_type */
    uint8_t op;   /* TK_OP: jop */
    int32_t line;
    size_t off;    /* byte offset in the normalised source */
    const char *s; /* TK_DATA, TK_NAME: into the source; TK_STRING: the decoded text */
    size_t len;
    const jstr *str; /* TK_STRING: the decoded text as an immortal string */
    int64_t i;
    double f;
} jtok;

typedef struct jlexed {
    char *src; /* the normalised source (owned) */
    size_t len;
    jtok *toks; /* owned */
    size_t n, cap;
    jarena_chunk **arena; /* where string literals go (the template's) */
    char *err;            /* PD_ERR_LEN, for messages */
} jlexed;

/* Tokenises src into out; string literals go to *arena. Returns 0, PD_EFORMAT (err says
 * where) or PD_ENOMEM; free out with jinja__lexed_free either way. */
int jinja__lex(const char *src, size_t len, const jinja_parse_params *pp, jarena_chunk **arena,
               char *err, jlexed *out);
void jinja__lexed_free(jlexed *t);
/* Formats "line L column C: ..." for the byte offset off of src into err; returns
 * PD_EFORMAT. */
int jinja__lex_err(const char *src, size_t len, size_t off, char *err, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

void *jinja__arena_alloc(jarena_chunk **a, size_t n); /* zeroed, 16-byte aligned, or NULL */
void jinja__arena_free(jarena_chunk *a);

#endif
