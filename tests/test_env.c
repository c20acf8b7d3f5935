/* test_env.c -- The environment knobs (common/env.h): every default parses, values are
 * validated (a bad one gives the default), read once and re-read after pd_env_set. */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/env.h"
#include "common/log.h"
#include "tests/test_util.h"

#define CHECK_EQ_STR(a, b)                                                                 \
    do {                                                                                   \
        const char *pd_a_ = (a), *pd_b_ = (b);                                             \
        CHECK_MSG(pd_a_ && pd_b_ && !strcmp(pd_a_, pd_b_), "%s = \"%s\", %s = \"%s\"", #a,  \
                  pd_a_ ? pd_a_ : "(null)", #b, pd_b_ ? pd_b_ : "(null)");                 \
    } while (0)

/* Every entry is well formed and every knob's default reads (as its own type). */
static void test_table(void)
{
    CHECK(pd_env_count() >= 29);
    for (int i = 0; i < pd_env_count(); i++) {
        const pd_env_knob *k = pd_env_knob_at(i);
        CHECK(!strncmp(k->name, "PDSERVE_", 8));
        CHECK(k->desc && *k->desc && !strchr(k->desc, '|'));
        CHECK(k->component && *k->component);
        for (int j = 0; j < i; j++) CHECK(strcmp(pd_env_knob_at(j)->name, k->name) != 0);
        pd_env_set(k->name, NULL);
        switch (k->type) {
        case PD_ENV_BOOL: (void)pd_env_bool(k->name); break;
        case PD_ENV_INT: {
            const int64_t v = pd_env_int(k->name);
            CHECK(v >= k->min && v <= k->max);
            break;
        }
        case PD_ENV_DOUBLE: (void)pd_env_double(k->name); break;
        case PD_ENV_STRING: CHECK_EQ_STR(pd_env_str(k->name), k->def); break;
        }
        CHECK(pd_env_raw(k->name) == NULL);
    }
}

static void test_bool(void)
{
    const char *name = "PDSERVE_CUDA_SPLIT_KV"; /* default on */
    static const char *on[] = {"1", "true", "YES", "on"}, *off[] = {"0", "False", "no", "OFF"};
    for (int i = 0; i < 4; i++) {
        pd_env_set(name, on[i]);
        CHECK(pd_env_bool(name));
        pd_env_set(name, off[i]);
        CHECK(!pd_env_bool(name));
        CHECK_EQ_STR(pd_env_raw(name), off[i]);
    }
    pd_env_set(name, "maybe"); /* a warning, and the default */
    CHECK(pd_env_bool(name));
    pd_env_set(name, ""); /* empty is unset */
    CHECK(pd_env_bool(name));
    CHECK(pd_env_raw(name) == NULL);
    pd_env_set(name, NULL);
    CHECK(pd_env_bool(name));
}

/* Read once: a change to the environment is not seen until pd_env_set. */
static void test_cached(void)
{
    const char *name = "PDSERVE_ASYNC_STEPS";
    pd_env_set(name, "0");
    CHECK(!pd_env_bool(name));
    setenv(name, "1", 1);
    CHECK(!pd_env_bool(name));
    pd_env_set(name, NULL);
    CHECK(pd_env_bool(name));
}

static void test_int(void)
{
    const char *name = "PDSERVE_CUDA_DECODE_STAGES"; /* 0 .. 4, default 2 */
    pd_env_set(name, "4");
    CHECK_EQ_INT(pd_env_int(name), 4);
    pd_env_set(name, "0");
    CHECK_EQ_INT(pd_env_int(name), 0);
    static const char *bad[] = {"5", "-1", "3x", "x", " ", "99999999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pd_env_set(name, bad[i]);
        CHECK_EQ_INT(pd_env_int(name), 2);
    }
    pd_env_set(name, NULL);
    CHECK_EQ_INT(pd_env_int(name), 2);
    /* unbounded, clamped by the reader */
    pd_env_set("PDSERVE_CUDA_GEMV_MAX_N", "-7");
    CHECK_EQ_INT(pd_env_int("PDSERVE_CUDA_GEMV_MAX_N"), -7);
    pd_env_set("PDSERVE_CUDA_GEMV_MAX_N", NULL);
    CHECK_EQ_INT(pd_env_int("PDSERVE_CUDA_GEMV_MAX_N"), 32);
    pd_env_set("PDSERVE_FAULT_FAIL_STEPS_AFTER", NULL);
    CHECK_EQ_INT(pd_env_int("PDSERVE_FAULT_FAIL_STEPS_AFTER"), -1);
}

static void test_str(void)
{
    pd_env_set("PDSERVE_KV_COPY", "memcpy");
    CHECK_EQ_STR(pd_env_str("PDSERVE_KV_COPY"), "memcpy");
    pd_env_set("PDSERVE_KV_COPY", "memcp"); /* not a choice */
    CHECK_EQ_STR(pd_env_str("PDSERVE_KV_COPY"), "kernel");
    CHECK_EQ_STR(pd_env_raw("PDSERVE_KV_COPY"), "memcp");
    pd_env_set("PDSERVE_KV_COPY", NULL);
    CHECK_EQ_STR(pd_env_str("PDSERVE_NCCL_LIB"), "libnccl.so.2");
    pd_env_set("PDSERVE_FAULT_TP_RANK", "1:3");
    CHECK_EQ_STR(pd_env_str("PDSERVE_FAULT_TP_RANK"), "1:3");
    pd_env_set("PDSERVE_FAULT_TP_RANK", NULL);
    CHECK_EQ_STR(pd_env_str("PDSERVE_FAULT_TP_RANK"), "");
}

/* The logger reads its level through the table; a bad level warns (through the logger). */
static void test_log_level(void)
{
    pd_env_set("PDSERVE_LOG_LEVEL", "loud");
    CHECK_EQ_STR(pd_env_str("PDSERVE_LOG_LEVEL"), "info");
    pd_env_set("PDSERVE_LOG_LEVEL", "warn");
    pd_log_level l = PD_LOG_DEBUG;
    CHECK_EQ_INT(pd_log_parse_level(pd_env_str("PDSERVE_LOG_LEVEL"), &l), 0);
    CHECK_EQ_INT(l, PD_LOG_WARN);
    pd_env_set("PDSERVE_LOG_LEVEL", NULL);
}

static void test_markdown(void)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    CHECK(f != NULL);
    if (!f) return;
    pd_env_write_markdown(f);
    fclose(f);
    CHECK(strstr(buf, "| `PDSERVE_CUDA_DECODE_STAGES` | int (0 .. 4) | 2 | kernels/cuda |"));
    CHECK(strstr(buf, "| `PDSERVE_KV_COPY` | one of: kernel, memcpy | kernel |"));
    free(buf);
}

/* A name not in the table, or read as another type, is a programming error: the process
 * aborts. */
static void test_unknown_aborts(void)
{
    for (int c = 0; c < 2; c++) {
        fflush(NULL);
        const pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            if (c == 0) (void)pd_env_bool("PDSERVE_NO_SUCH_KNOB");
            else (void)pd_env_int("PDSERVE_CUDA_SPLIT_KV");
            _exit(0);
        }
        int st = 0;
        CHECK(waitpid(pid, &st, 0) == pid);
        CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "case %d: status %d", c, st);
    }
}

int main(void)
{
    test_table();
    test_bool();
    test_cached();
    test_int();
    test_str();
    test_log_level();
    test_markdown();
    test_unknown_aborts();
    return pd_test_result("test_env");
}
