/* jinja.h -- A Jinja2 subset interpreter in C: lexer, parser to an AST, evaluator. It renders
 * the chat templates models ship exactly as Python's jinja2 does in HF transformers'
 * environment (ImmutableSandboxedEnvironment with the loopcontrols extension, transformers'
 * tojson, raise_exception and strftime_now). docs/chat.md lists the supported subset.
 *
 * A parsed template is read-only: any number of threads may render it at once. Every render
 * is bounded (output bytes, memory held by values, evaluation steps, call depth), so that no
 * template, however hostile, can crash, hang or exhaust the process: it fails with an error. */
#ifndef PD_JINJA_H
#define PD_JINJA_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct jinja_template jinja_template; /* opaque, read-only after jinja_parse */

typedef struct {
    bool trim_blocks;           /* drop the first newline after a block or comment tag */
    bool lstrip_blocks;         /* drop spaces and tabs from a line's start to a block tag */
    bool keep_trailing_newline; /* keep a single newline at the end of the source */
} jinja_parse_params;

/* jinja2's own defaults: every flag false. (HF chat templates use trim_blocks and
 * lstrip_blocks: chat_template.h sets them.) */
jinja_parse_params jinja_default_parse_params(void);

typedef struct {
    size_t max_output;  /* bytes of rendered text (also bounds any one string); 0 = 16 MiB */
    size_t max_memory;  /* bytes held by values and buffers during a render; 0 = 256 MiB */
    uint64_t max_steps; /* expression and statement evaluations; 0 = 20,000,000 */
    int max_depth;      /* nested macro and caller() calls; 0 = 64 */
    int64_t now;        /* seconds since the epoch that strftime_now formats (local time);
                           -1 = the clock */
} jinja_render_params;

/* Zero limits (the defaults above) and now = -1. */
jinja_render_params jinja_default_render_params(void);

/* Parses len bytes of template source (UTF-8; p NULL = jinja_default_parse_params()).
 * Returns 0 and a new template in *out (free with jinja_destroy); PD_EFORMAT when the source
 * is not valid UTF-8 or not a valid template, or uses a statement this subset lacks (extends,
 * include, import, block, recursive loops): err says what and where ("line L column C: ...");
 * PD_ENOMEM. On error *out is NULL. The source is not kept. */
int jinja_parse(const char *src, size_t len, const jinja_parse_params *p, jinja_template **out,
                char *err);

void jinja_destroy(jinja_template *t); /* NULL is a no-op */

/* Renders t with the variables of the JSON object vars (NULL = none; objects become dicts in
 * their key order, arrays lists, null none; a key that is absent is undefined) under the
 * limits p (NULL = defaults). Returns 0 with *out (NUL-terminated, caller frees with free())
 * and, when out_len is not NULL, its length; PD_EINVAL when the template fails: a
 * raise_exception() call (err is its message, verbatim), an error jinja2 would raise as well
 * ("line L: 'x' is undefined", a type error, ...), an unsupported filter or feature reached at
 * run time, or a limit of p exceeded (err names it); PD_ENOMEM. On error *out is NULL.
 * Thread-safe. */
int jinja_render(const jinja_template *t, const json_t *vars, const jinja_render_params *p,
                 char **out, size_t *out_len, char *err);

#endif
