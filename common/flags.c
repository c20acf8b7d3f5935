/* flags.c -- Flag parsing for services and tools (see flags.h). */
#include "common/flags.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static char **g_joined;  /* buffers made for repeated LIST flags */
static int g_n_joined;

void pd_flags_free(void)
{
    for (int i = 0; i < g_n_joined; i++) free(g_joined[i]);
    free(g_joined);
    g_joined = NULL;
    g_n_joined = 0;
}

static void env_name(const char *name, char *out, size_t n)
{
    size_t j = (size_t)snprintf(out, n, "PDSERVE_");
    for (const char *p = name; *p && j + 1 < n; p++) out[j++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    out[j] = 0;
}

static const char *type_name(pd_flag_type t)
{
    switch (t) {
    case PD_FLAG_STRING: return "STR";
    case PD_FLAG_INT: return "N";
    case PD_FLAG_DOUBLE: return "X";
    case PD_FLAG_BOOL: return "";
    case PD_FLAG_LIST: return "A,B";
    }
    return "";
}

/* Stores value into flag f; src names where it came from for errors. */
static int set(pd_flag *f, const char *value, bool repeated, const char *src)
{
    char *end;
    switch (f->type) {
    case PD_FLAG_STRING:
        *(const char **)f->ptr = value;
        return 0;
    case PD_FLAG_LIST: {
        const char *old = *(const char **)f->ptr;
        if (!repeated || !old || !*old) {
            *(const char **)f->ptr = value;
            return 0;
        }
        size_t n = strlen(old) + strlen(value) + 2;
        char *j = malloc(n);
        char **nj = realloc(g_joined, (size_t)(g_n_joined + 1) * sizeof *nj);
        if (!j || !nj) {
            free(j);
            if (nj) g_joined = nj;
            fprintf(stderr, "out of memory\n");
            return -1;
        }
        g_joined = nj;
        snprintf(j, n, "%s,%s", old, value);
        g_joined[g_n_joined++] = j;
        *(const char **)f->ptr = j;
        return 0;
    }
    case PD_FLAG_INT: {
        errno = 0;
        long long v = strtoll(value, &end, 10);
        if (errno || end == value || *end || (f->min <= f->max && (v < f->min || v > f->max))) {
            if (f->min <= f->max)
                fprintf(stderr, "invalid value '%s' for %s: expected an integer in [%.0f, %.0f]\n",
                        value, src, f->min, f->max);
            else
                fprintf(stderr, "invalid value '%s' for %s: expected an integer\n", value, src);
            return -1;
        }
        *(int64_t *)f->ptr = v;
        return 0;
    }
    case PD_FLAG_DOUBLE: {
        errno = 0;
        double v = strtod(value, &end);
        if (errno || end == value || *end || !isfinite(v) ||
            (f->min <= f->max && (v < f->min || v > f->max))) {
            if (f->min <= f->max)
                fprintf(stderr, "invalid value '%s' for %s: expected a number in [%g, %g]\n",
                        value, src, f->min, f->max);
            else
                fprintf(stderr, "invalid value '%s' for %s: expected a number\n", value, src);
            return -1;
        }
        *(double *)f->ptr = v;
        return 0;
    }
    case PD_FLAG_BOOL:
        if (!strcmp(value, "1") || !strcmp(value, "true") || !strcmp(value, "yes") || !strcmp(value, "on"))
            *(bool *)f->ptr = true;
        else if (!strcmp(value, "0") || !strcmp(value, "false") || !strcmp(value, "no") || !strcmp(value, "off"))
            *(bool *)f->ptr = false;
        else {
            fprintf(stderr, "invalid value '%s' for %s: expected true or false\n", value, src);
            return -1;
        }
        return 0;
    }
    return -1;
}

void pd_flags_print_help(FILE *out, const pd_flag *flags, int n, const char *prog, const char *summary)
{
    fprintf(out, "usage: %s [flags]\n\n%s\n\nflags (each also as the environment variable shown):\n",
            prog, summary);
    for (int i = 0; i < n; i++) {
        const pd_flag *f = &flags[i];
        char lhs[96], env[96], def[96] = "";
        snprintf(lhs, sizeof lhs, "--%s%s%s", f->name, f->type == PD_FLAG_BOOL ? "" : " ",
                 type_name(f->type));
        env_name(f->name, env, sizeof env);
        switch (f->type) {
        case PD_FLAG_STRING:
        case PD_FLAG_LIST: {
            const char *s = *(const char **)f->ptr;
            if (s && *s) snprintf(def, sizeof def, " (default %s)", s);
            break;
        }
        case PD_FLAG_INT: snprintf(def, sizeof def, " (default %lld)", (long long)*(int64_t *)f->ptr); break;
        case PD_FLAG_DOUBLE: snprintf(def, sizeof def, " (default %g)", *(double *)f->ptr); break;
        case PD_FLAG_BOOL: snprintf(def, sizeof def, " (default %s)", *(bool *)f->ptr ? "true" : "false"); break;
        }
        fprintf(out, "  %-30s %s%s\n  %-30s [%s]\n", lhs, f->help, def, "", env);
    }
    fprintf(out, "  %-30s this help\n", "-h, --help");
}

/* The flag called name[0, len), or -1. */
static int find_name(const pd_flag *flags, int n, const char *name, size_t len)
{
    for (int i = 0; i < n; i++)
        if (strlen(flags[i].name) == len && !strncmp(flags[i].name, name, len)) return i;
    return -1;
}

int pd_flags_find(const pd_flag *flags, int n, const char *arg)
{
    if (strncmp(arg, "--", 2) != 0) return -1;
    const char *name = arg + 2, *eq = strchr(name, '=');
    return find_name(flags, n, name, eq ? (size_t)(eq - name) : strlen(name));
}

void pd_flags_print_unknown(const pd_flag *flags, int n, const char *prog, const char *arg)
{
    const char *name = strncmp(arg, "--", 2) ? arg : arg + 2, *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    /* --max_tokens for --max-tokens: the spelling of the API's JSON fields. */
    char dashed[128];
    int k = -1;
    if (len < sizeof dashed && memchr(name, '_', len)) {
        for (size_t i = 0; i < len; i++) dashed[i] = name[i] == '_' ? '-' : name[i];
        k = find_name(flags, n, dashed, len);
    }
    if (k >= 0)
        fprintf(stderr, "%s: unknown flag --%.*s (did you mean --%s?)\n", prog, (int)len, name,
                flags[k].name);
    else
        fprintf(stderr, "%s: unknown flag --%.*s (try --help)\n", prog, (int)len, name);
}

int pd_flags_parse(pd_flag *flags, int n, int argc, char **argv, const char *prog, const char *summary)
{
    char env[96], src[128];
    for (int i = 0; i < n; i++) {
        env_name(flags[i].name, env, sizeof env);
        const char *v = getenv(env);
        if (v && set(&flags[i], v, false, env) < 0) return -1;
    }
    bool *seen = calloc((size_t)n, sizeof *seen);
    if (!seen) return -1;
    int rc = 0;
    for (int a = 1; a < argc && rc == 0; a++) {
        const char *arg = argv[a];
        if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) {
            pd_flags_print_help(stdout, flags, n, prog, summary);
            rc = 1;
            break;
        }
        if (strncmp(arg, "--", 2) != 0) {
            fprintf(stderr, "%s: unexpected argument '%s' (try --help)\n", prog, arg);
            rc = -1;
            break;
        }
        const char *eq = strchr(arg + 2, '=');
        int k = pd_flags_find(flags, n, arg);
        if (k < 0) {
            pd_flags_print_unknown(flags, n, prog, arg);
            rc = -1;
            break;
        }
        const char *value = eq ? eq + 1 : NULL;
        if (!value && flags[k].type == PD_FLAG_BOOL) value = "true";
        if (!value) {
            if (a + 1 >= argc) {
                fprintf(stderr, "%s: flag --%s needs a value\n", prog, flags[k].name);
                rc = -1;
                break;
            }
            value = argv[++a];
        }
        snprintf(src, sizeof src, "--%s", flags[k].name);
        if (set(&flags[k], value, seen[k], src) < 0) rc = -1;
        seen[k] = true;
    }
    free(seen);
    return rc;
}
