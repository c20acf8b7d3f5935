/* random.c -- A process-wide splitmix64 stream seeded from the OS (see random.h). */
#include "common/random.h"

#include <stdatomic.h>
#include <stdint.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define GOLDEN 0x9e3779b97f4a7c15ull

static _Atomic uint64_t g_state; /* 0 = not seeded yet */

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t os_seed(void)
{
    uint64_t s = 0;
    if (getrandom(&s, sizeof s, 0) != (ssize_t)sizeof s) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        s = mix64((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
            mix64((uint64_t)getpid() ^ (uint64_t)(uintptr_t)&s);
    }
    return s ? s : GOLDEN;
}

uint64_t pd_random_u64(void)
{
    uint64_t s = atomic_load(&g_state);
    if (s == 0) {
        /* Racing first callers each draw a seed; one wins and every caller uses its stream. */
        uint64_t zero = 0;
        atomic_compare_exchange_strong(&g_state, &zero, os_seed());
    }
    return mix64(atomic_fetch_add(&g_state, GOLDEN) + GOLDEN);
}
