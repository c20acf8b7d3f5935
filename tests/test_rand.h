/* test_rand.h -- The tests' seeded random numbers and checked allocation (header-only). A test
 * defines PD_TEST_SEED before including it to keep its own data. */
#ifndef PD_TEST_RAND_H
#define PD_TEST_RAND_H

#include <stdint.h>
#include <stdlib.h>

#include "common/dtype.h"

#ifndef PD_TEST_SEED
#define PD_TEST_SEED 0x9e3779b97f4a7c15ull
#endif

static uint64_t g_rng = PD_TEST_SEED;

/* Uniform in [0, 1), xorshift64. */
static inline double urand(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) * (1.0 / 9007199254740992.0);
}

/* malloc that aborts when out of memory (bytes 0 gives a valid pointer). */
static inline void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) abort();
    return p;
}

static inline float bf16_round(float x) { return pd_bf16_to_f32(pd_f32_to_bf16(x)); }

#endif
