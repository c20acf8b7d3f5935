/* test_flags.c -- Flags from the command line and PDSERVE_* environment variables. */
#include <stdlib.h>

#include "common/flags.h"
#include "tests/test_util.h"

int main(void)
{
    const char *model = "m0", *peers = "";
    int64_t seqs = 256;
    double util = 0.9;
    bool colocated = false, drain = true;
    pd_flag flags[] = {
        {"model", PD_FLAG_STRING, &model, "model dir", 1, 0},
        {"max-num-seqs", PD_FLAG_INT, &seqs, "sequences per step", 1, 4096},
        {"gpu-memory-utilization", PD_FLAG_DOUBLE, &util, "share of memory", 0.05, 1.0},
        {"colocated", PD_FLAG_BOOL, &colocated, "prefill here too", 1, 0},
        {"drain", PD_FLAG_BOOL, &drain, "drain on SIGTERM", 1, 0},
        {"peer", PD_FLAG_LIST, &peers, "peers", 1, 0},
    };
    const int n = (int)(sizeof flags / sizeof flags[0]);
    setenv("PDSERVE_MAX_NUM_SEQS", "64", 1);
    setenv("PDSERVE_MODEL", "from-env", 1);
    setenv("PDSERVE_COLOCATED", "yes", 1);
    char *argv1[] = {"prog", "--model", "cli", "--gpu-memory-utilization=0.5", "--drain=false",
                     "--peer", "a:1", "--peer=b:2", NULL};
    CHECK_EQ_INT(pd_flags_parse(flags, n, 8, argv1, "prog", "test"), 0);
    CHECK(strcmp(model, "cli") == 0);          /* the command line wins over the environment */
    CHECK_EQ_INT(seqs, 64);                    /* from the environment */
    CHECK_NEAR(util, 0.5, 1e-12);
    CHECK(colocated);
    CHECK(!drain);
    CHECK(strcmp(peers, "a:1,b:2") == 0);      /* repeated list flags append */
    char *argv2[] = {"prog", "--max-num-seqs", "0", NULL};
    CHECK_EQ_INT(pd_flags_parse(flags, n, 3, argv2, "prog", "test"), -1); /* out of range */
    char *argv3[] = {"prog", "--bogus", NULL};
    CHECK_EQ_INT(pd_flags_parse(flags, n, 2, argv3, "prog", "test"), -1);
    char *argv4[] = {"prog", "--model", NULL};
    CHECK_EQ_INT(pd_flags_parse(flags, n, 2, argv4, "prog", "test"), -1); /* missing value */
    char *argv5[] = {"prog", "--gpu-memory-utilization", "abc", NULL};
    CHECK_EQ_INT(pd_flags_parse(flags, n, 3, argv5, "prog", "test"), -1);
    setenv("PDSERVE_COLOCATED", "maybe", 1);
    char *argv6[] = {"prog", NULL};
    CHECK_EQ_INT(pd_flags_parse(flags, n, 1, argv6, "prog", "test"), -1); /* bad env value */
    unsetenv("PDSERVE_COLOCATED");
    char *argv7[] = {"prog", "stray", NULL};
    CHECK_EQ_INT(pd_flags_parse(flags, n, 2, argv7, "prog", "test"), -1);
    /* pd_flags_find: "--name" and "--name=value"; '_' is not '-'. */
    CHECK_EQ_INT(pd_flags_find(flags, n, "--max-num-seqs"), 1);
    CHECK_EQ_INT(pd_flags_find(flags, n, "--peer=a:1"), 5);
    CHECK_EQ_INT(pd_flags_find(flags, n, "--max_num_seqs"), -1);
    CHECK_EQ_INT(pd_flags_find(flags, n, "--max-num"), -1);
    CHECK_EQ_INT(pd_flags_find(flags, n, "model"), -1);
    char *argv9[] = {"prog", "--max_num_seqs", "3", NULL};
    CHECK_EQ_INT(pd_flags_parse(flags, n, 3, argv9, "prog", "test"), -1);
    char *argv8[] = {"prog", "--help", NULL};
    FILE *saved = stdout;
    stdout = fopen("/dev/null", "w");
    CHECK_EQ_INT(pd_flags_parse(flags, n, 2, argv8, "prog", "test"), 1);
    fclose(stdout);
    stdout = saved;
    pd_flags_free();
    return pd_test_result("test_flags");
}
