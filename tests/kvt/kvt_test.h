/* kvt_test.h -- Helpers of the kvtransfer tests: checks that print both sides, the small KV
 * layout the tests move, context settings with short deadlines, and an event log that a test
 * polls. Header-only (each test is one executable). */
#ifndef PD_KVT_TEST_H
#define PD_KVT_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "kvtransfer/kvt_harness.h"
#include "kvtransfer/kvtransfer.h"

#define KT_FAIL(...)                                                   \
    do {                                                               \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);           \
        fprintf(stderr, __VA_ARGS__);                                  \
        fprintf(stderr, "\n");                                         \
        exit(1);                                                       \
    } while (0)
#define KT_CHECK(cond)                                                 \
    do {                                                               \
        if (!(cond)) KT_FAIL("%s", #cond);                             \
    } while (0)
#define KT_EQ(a, b)                                                    \
    do {                                                               \
        long long ka_ = (long long)(a), kb_ = (long long)(b);          \
        if (ka_ != kb_) KT_FAIL("%s == %s: %lld vs %lld", #a, #b, ka_, kb_); \
    } while (0)
#define KT_OK(call, err)                                               \
    do {                                                               \
        int rc_ = (call);                                              \
        if (rc_ < 0) KT_FAIL("%s: %s (%s)", #call, (err), pd_err_name(rc_)); \
    } while (0)

/* The layout the tests move: small blocks so that many transfers fit in a few seconds. */
static inline kvt_layout kt_layout(void)
{
    kvt_layout l = {.model_id = "kvt-test-model", .dtype = PD_DTYPE_BF16, .n_layers = 4,
                    .block_size = 16, .n_kv_heads = 2, .head_dim = 64};
    return l;
}

#define KT_MAX_EVENTS 4096

/* Every event a context delivered, copied. */
typedef struct {
    kvt_event ev[KT_MAX_EVENTS];
    char detail[KT_MAX_EVENTS][160];
    int32_t firsts[KT_MAX_EVENTS][KVT_MAX_FIRST_TOKENS]; /* the events' first_tokens, copied */
    int n;
} kt_events;

static inline void kt_on_event(void *arg, const kvt_event *ev)
{
    kt_events *e = arg;
    if (e->n >= KT_MAX_EVENTS) KT_FAIL("too many events");
    e->ev[e->n] = *ev;
    snprintf(e->detail[e->n], sizeof e->detail[0], "%s", ev->detail);
    e->ev[e->n].detail = e->detail[e->n];
    if (ev->first_tokens && ev->n_first_tokens >= 1 && ev->n_first_tokens <= KVT_MAX_FIRST_TOKENS) {
        memcpy(e->firsts[e->n], ev->first_tokens, (size_t)ev->n_first_tokens * sizeof(int32_t));
        e->ev[e->n].first_tokens = e->firsts[e->n];
    }
    fprintf(stderr, "event %d: type %d req %llu status %s %s\n", e->n, (int)ev->type,
            (unsigned long long)ev->req_id, pd_err_name(ev->status), ev->detail);
    e->n++;
}

/* Context settings for tests: short deadlines (but generous enough for ASan on 2 busy cores). */
static inline kvt_params kt_params(const char *name, kt_events *ev)
{
    kvt_params p = kvt_default_params();
    p.name = name;
    p.on_event = kt_on_event;
    p.on_event_arg = ev;
    p.deadline_min_ms = 1000;
    /* Scenarios where no deadline should fire take longer ones (CMake sets it): a loaded CI
     * machine (ASan, other suites beside) has starved a receiver's ACK past 2.4 s. */
    const char *dl = getenv("KVT_TEST_DEADLINE_MIN_MS");
    if (dl && atoi(dl) > 0) p.deadline_min_ms = atoi(dl);
    p.connect_timeout_ms = 5000;
    p.compute_timeout_ms = 3000;
    p.start_timeout_ms = 10000;
    const char *staging = getenv("KVT_TEST_AM_STAGING"); /* 0: send scattered blocks as iov */
    if (staging) p.am_staging_slots = atoi(staging);
    const char *path = getenv("KVT_TEST_PATH");
    if (path) p.path = !strcmp(path, "put") ? KVT_PATH_PUT
                       : !strcmp(path, "am") ? KVT_PATH_AM : KVT_PATH_AUTO;
    return p;
}

/* Waits (progressing ctx, and watching fd if >= 0) until events->n > n_before or fd is
 * readable or timeout_ms passes. Returns 1 for an event, 2 for fd, 0 for timeout. */
static inline int kt_wait_event(kvt_ctx *ctx, kt_events *events, int n_before, int fd,
                                int timeout_ms)
{
    double end = kvh_ms() + timeout_ms;
    while (kvh_ms() < end) {
        if (events->n > n_before) return 1;
        if (kvh_loop(ctx, fd, 20)) return 2;
    }
    return events->n > n_before ? 1 : 0;
}

#endif
