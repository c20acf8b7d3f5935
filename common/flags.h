/* flags.h -- Declarative command-line flags for pdserve's programs: each flag is also read
 * from the environment as PDSERVE_<NAME> (upper case, '-' -> '_'); the command line wins.
 * --help prints every flag with its type, default and environment variable. */
#ifndef PD_FLAGS_H
#define PD_FLAGS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef enum {
    PD_FLAG_STRING = 0, /* const char ** (points into argv / environ, or the default) */
    PD_FLAG_INT,        /* int64_t * */
    PD_FLAG_DOUBLE,     /* double * */
    PD_FLAG_BOOL,       /* bool *; "--name" sets true, "--name=false" / env "0|false|no" false */
    PD_FLAG_LIST,       /* const char ** holding a comma-separated list (repeats append) */
} pd_flag_type;

typedef struct {
    const char *name;   /* long name without dashes, e.g. "max-num-seqs" */
    pd_flag_type type;
    void *ptr;          /* destination; holds the default before pd_flags_parse */
    const char *help;   /* one line */
    double min, max;    /* range for INT / DOUBLE (min > max = unchecked) */
} pd_flag;

/* Parses environment then argv into the flags' destinations. Returns 0; 1 if --help was
 * printed (the caller exits 0); -1 after printing an error naming the flag or variable (the
 * caller exits non-zero). prog and summary are used for --help. Strings from LIST flags given
 * several times are joined into a buffer owned by the flags module (freed by pd_flags_free). */
int pd_flags_parse(pd_flag *flags, int n_flags, int argc, char **argv, const char *prog,
                   const char *summary);
void pd_flags_print_help(FILE *f, const pd_flag *flags, int n_flags, const char *prog,
                         const char *summary);
/* The index in flags of the flag that arg ("--name" or "--name=value") names, or -1 (also
 * when arg does not start with "--"). */
int pd_flags_find(const pd_flag *flags, int n_flags, const char *arg);
/* Prints "PROG: unknown flag --NAME" for arg ("--name" or "--name=value") on stderr, followed
 * by "(did you mean --other-name?)" when NAME with every '_' as '-' is a flag, else by
 * "(try --help)". pd_flags_parse says this of an unknown flag; a program that scans its
 * arguments itself calls it for the same message. */
void pd_flags_print_unknown(const pd_flag *flags, int n_flags, const char *prog, const char *arg);
/* Frees buffers made by pd_flags_parse for repeated LIST flags. */
void pd_flags_free(void);

#endif
