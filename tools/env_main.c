/* env_main.c -- pdserve-env: the environment knobs (common/env.h). With --markdown it writes
 * docs/env.md; without, it lists each knob with the value a process would take from the
 * current environment (a bad value shows its warning and the default). */
#include <stdio.h>
#include <string.h>

#include "common/env.h"

static void usage(FILE *out)
{
    fprintf(out, "usage: pdserve-env [--markdown]\n"
                 "  (no option)  each PDSERVE_* knob and the value it takes from this "
                 "environment\n"
                 "  --markdown   the table of knobs as docs/env.md\n");
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--markdown")) {
        pd_env_write_markdown(stdout);
        return 0;
    }
    if (argc == 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        usage(stdout);
        return 0;
    }
    if (argc != 1) {
        usage(stderr);
        return 2;
    }
    for (int i = 0; i < pd_env_count(); i++) {
        const pd_env_knob *k = pd_env_knob_at(i);
        const char *raw = pd_env_raw(k->name);
        printf("%-36s ", k->name);
        switch (k->type) {
        case PD_ENV_BOOL: printf("%-14s", pd_env_bool(k->name) ? "1" : "0"); break;
        case PD_ENV_INT: printf("%-14lld", (long long)pd_env_int(k->name)); break;
        case PD_ENV_DOUBLE: printf("%-14g", pd_env_double(k->name)); break;
        case PD_ENV_STRING: printf("%-14s", *pd_env_str(k->name) ? pd_env_str(k->name) : "(unset)"); break;
        }
        printf(" %s\n", raw ? "(set)" : "(default)");
    }
    return 0;
}
