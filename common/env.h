/* env.h -- The environment knobs: every PDSERVE_* variable the code reads directly (A/B
 * switches, debugging aids, fault injection), in one table in env.c with its type, default,
 * a description and the component that reads it. docs/env.md is generated from that table
 * (`pdserve-env --markdown`). Command-line flags with an environment fallback
 * (common/flags.h) are not knobs.
 *
 * Each accessor looks the name up in the table (a name not in it, or asked for as another
 * type, is a programming error: the process aborts with a message), reads the variable once,
 * on first use, and validates it: an empty variable is the default, and a value that does
 * not parse or is out of range gets one warning and the default. Thread-safe. */
#ifndef PD_ENV_H
#define PD_ENV_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { PD_ENV_BOOL = 0, PD_ENV_INT, PD_ENV_DOUBLE, PD_ENV_STRING } pd_env_type;

/* A bool knob: 1/0, true/false, yes/no, on/off (any case). */
bool pd_env_bool(const char *name);
/* An int knob, within the table's range. */
int64_t pd_env_int(const char *name);
/* A double knob (finite). */
double pd_env_double(const char *name);
/* A string knob: its value, or the default ("" where the default is unset). Borrowed; valid
 * until pd_env_set(name, ...). */
const char *pd_env_str(const char *name);
/* Any knob's variable as it was read, NULL when unset or empty (for "is it set" and for
 * messages). Borrowed, as for pd_env_str. */
const char *pd_env_raw(const char *name);

/* For tests that change a knob between cases: sets the variable (value NULL unsets it) and
 * forgets the knob's cached value, so that its next read takes the new one. Must not race
 * with readers of the same knob; values cached by the readers themselves (function-local
 * statics in hot paths) keep theirs. */
void pd_env_set(const char *name, const char *value);

/* The table: n_knobs entries, for listing. */
typedef struct {
    const char *name;      /* "PDSERVE_..." */
    pd_env_type type;
    const char *def;       /* the default as text; "" = unset */
    int64_t min, max;      /* PD_ENV_INT: the accepted range */
    const char *choices;   /* PD_ENV_STRING: accepted values, "a|b|c"; NULL = any */
    const char *component; /* who reads it: "engine", "svc", "kernels/cuda", ... */
    const char *desc;      /* one line */
} pd_env_knob;
int pd_env_count(void);
const pd_env_knob *pd_env_knob_at(int i); /* 0 <= i < pd_env_count() */
const char *pd_env_type_name(pd_env_type t); /* "bool", "int", "double", "string" */

/* Writes the table as docs/env.md (Markdown). */
void pd_env_write_markdown(FILE *out);

#ifdef __cplusplus
}
#endif

#endif
