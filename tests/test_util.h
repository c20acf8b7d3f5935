/* test_util.h -- Minimal assertion macros for pdserve's CTest executables. Every failed check
 * prints both sides with file and line; main returns pd_test_result(). Exit 77 = skipped. */
#ifndef PD_TEST_UTIL_H
#define PD_TEST_UTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/env.h"

static int pd_test_failures = 0;
static int pd_test_checks = 0;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        pd_test_checks++;                                                            \
        if (!(cond)) {                                                               \
            pd_test_failures++;                                                      \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                            \
    } while (0)

#define CHECK_MSG(cond, ...)                                                         \
    do {                                                                             \
        pd_test_checks++;                                                            \
        if (!(cond)) {                                                               \
            pd_test_failures++;                                                      \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                            \
            fputc('\n', stderr);                                                     \
        }                                                                            \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                                 \
    do {                                                                                   \
        long long pd_a_ = (long long)(a), pd_b_ = (long long)(b);                          \
        pd_test_checks++;                                                                  \
        if (pd_a_ != pd_b_) {                                                              \
            pd_test_failures++;                                                            \
            fprintf(stderr, "%s:%d: CHECK_EQ_INT failed: %s = %lld, %s = %lld\n", __FILE__, \
                    __LINE__, #a, pd_a_, #b, pd_b_);                                       \
        }                                                                                  \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                                 \
    do {                                                                                      \
        double pd_a_ = (double)(a), pd_b_ = (double)(b);                                      \
        pd_test_checks++;                                                                     \
        if (!(fabs(pd_a_ - pd_b_) <= (tol))) {                                                \
            pd_test_failures++;                                                               \
            fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s = %.9g, %s = %.9g (tol %g)\n",     \
                    __FILE__, __LINE__, #a, pd_a_, #b, pd_b_, (double)(tol));                 \
        }                                                                                     \
    } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                                     \
    do {                                                                                    \
        const char *pd_h_ = (hay), *pd_n_ = (needle);                                       \
        pd_test_checks++;                                                                   \
        if (!pd_h_ || !strstr(pd_h_, pd_n_)) {                                              \
            pd_test_failures++;                                                             \
            fprintf(stderr, "%s:%d: expected \"%s\" to contain \"%s\"\n", __FILE__, __LINE__, \
                    pd_h_ ? pd_h_ : "(null)", pd_n_);                                       \
        }                                                                                   \
    } while (0)

static inline int pd_test_result(const char *name)
{
    if (pd_test_failures) {
        fprintf(stderr, "%s: %d of %d checks FAILED\n", name, pd_test_failures, pd_test_checks);
        return 1;
    }
    fprintf(stderr, "%s: all %d checks passed\n", name, pd_test_checks);
    return 0;
}

/* Directory with the shared test data (../shared beside the repository, or $PDSERVE_SHARED). */
static inline const char *pd_test_shared_dir(void)
{
    const char *env = pd_env_raw("PDSERVE_SHARED");
    return env ? env : PD_SHARED_DIR;
}

#endif
