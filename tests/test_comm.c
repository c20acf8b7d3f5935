/* test_comm.c -- The CPU communicator (tensor parallelism's collectives), one thread per rank:
 * all_reduce_sum gives every rank the same bits, equal to the sum in rank order computed here
 * (so the result does not depend on the threads' timing), for 1 to 8 ranks and sizes from 0 to
 * 65,537 elements over repeated calls; all_gather puts every rank's data in rank order (F32
 * and I32); a barrier lets no rank past before every rank arrived; ranks that disagree on the
 * size all get PD_EINVAL and the communicator stays usable; an abort wakes a rank waiting for
 * a peer that never comes; pd_comm_create picks the backend's communicator. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "common/error.h"
#include "kernels/backend.h"
#include "tests/test_util.h"

#define MAX_RANKS 8
#define ITERS 12

typedef struct {
    pd_comm *c;
    int32_t rank;
    size_t n;
    int fails;              /* checks failed on this thread (CHECK is not thread-safe) */
    float *out;             /* [ITERS][n]: what all_reduce_sum left, for the cross-rank check */
} job;

/* The value rank r contributes at element i of iteration it: a spread of magnitudes, so that
 * a different summation order would change low bits. */
static float val(int32_t r, int it, size_t i)
{
    uint64_t z = (uint64_t)r * 0x9e3779b97f4a7c15ull ^ (uint64_t)it * 0xbf58476d1ce4e5b9ull ^ i;
    z = (z ^ (z >> 31)) * 0x94d049bb133111ebull;
    z ^= z >> 29;
    float f = (float)(z & 0xffffff) / 16777216.0f - 0.5f;
    return f * (float)(1u << (z >> 60)); /* scale 1 .. 2^15 */
}

static void *reduce_thread(void *arg)
{
    job *j = arg;
    const int32_t R = j->c->n_ranks;
    float *buf = malloc((j->n ? j->n : 1) * sizeof(float));
    for (int it = 0; it < ITERS; it++) {
        for (size_t i = 0; i < j->n; i++) buf[i] = val(j->rank, it, i);
        int rc = j->c->ops->all_reduce_sum(j->c->ctx, j->rank, buf, PD_DTYPE_F32, j->n);
        if (rc != 0) {
            fprintf(stderr, "rank %d: all_reduce_sum returned %d\n", j->rank, rc);
            j->fails++;
            break;
        }
        for (size_t i = 0; i < j->n; i++) {
            float want = val(0, it, i);
            for (int32_t r = 1; r < R; r++) want += val(r, it, i);
            if (memcmp(&want, &buf[i], sizeof want) != 0) {
                if (j->fails++ < 3)
                    fprintf(stderr, "rank %d of %d, n %zu, iter %d, element %zu: %.9g, want "
                            "%.9g\n", j->rank, R, j->n, it, i, buf[i], want);
            }
        }
        memcpy(j->out + (size_t)it * j->n, buf, j->n * sizeof(float));
    }
    free(buf);
    return NULL;
}

static void run_threads(int32_t R, void *(*fn)(void *), job *jobs)
{
    pthread_t th[MAX_RANKS];
    for (int32_t r = 1; r < R; r++) pthread_create(&th[r], NULL, fn, &jobs[r]);
    fn(&jobs[0]); /* rank 0 on this thread, as the model runner does */
    for (int32_t r = 1; r < R; r++) pthread_join(th[r], NULL);
}

static void test_all_reduce(void)
{
    const int32_t ranks[] = {1, 2, 3, 4, 8};
    const size_t sizes[] = {0, 1, 5, 1000, 65537};
    char err[PD_ERR_LEN];
    for (size_t a = 0; a < sizeof ranks / sizeof ranks[0]; a++) {
        const int32_t R = ranks[a];
        pd_comm *c = NULL;
        CHECK_MSG(pd_comm_cpu_create(R, &c, err) == 0, "%s", err);
        if (!c) continue;
        CHECK_EQ_INT(c->n_ranks, R);
        for (size_t b = 0; b < sizeof sizes / sizeof sizes[0]; b++) {
            job jobs[MAX_RANKS];
            for (int32_t r = 0; r < R; r++)
                jobs[r] = (job){.c = c, .rank = r, .n = sizes[b],
                                .out = malloc((sizes[b] ? sizes[b] : 1) * ITERS * sizeof(float))};
            run_threads(R, reduce_thread, jobs);
            for (int32_t r = 0; r < R; r++) {
                CHECK_MSG(jobs[r].fails == 0, "%d ranks, %zu elements: rank %d failed %d checks",
                          R, sizes[b], r, jobs[r].fails);
                CHECK(memcmp(jobs[r].out, jobs[0].out, sizes[b] * ITERS * sizeof(float)) == 0);
            }
            for (int32_t r = 0; r < R; r++) free(jobs[r].out);
        }
        pd_comm_destroy(c);
    }
}

static void *gather_thread(void *arg)
{
    job *j = arg;
    const int32_t R = j->c->n_ranks;
    const size_t n = j->n;
    float *send = malloc((n ? n : 1) * sizeof(float)), *recv = malloc((n ? n : 1) * R * sizeof(float));
    int32_t *isend = malloc((n ? n : 1) * sizeof(int32_t));
    int32_t *irecv = malloc((n ? n : 1) * R * sizeof(int32_t));
    for (int it = 0; it < ITERS; it++) {
        for (size_t i = 0; i < n; i++) {
            send[i] = val(j->rank, it, i);
            isend[i] = j->rank * 1000003 + it * 7 + (int32_t)i;
        }
        if (j->c->ops->all_gather(j->c->ctx, j->rank, send, recv, PD_DTYPE_F32, n) != 0 ||
            j->c->ops->all_gather(j->c->ctx, j->rank, isend, irecv, PD_DTYPE_I32, n) != 0) {
            j->fails++;
            break;
        }
        for (int32_t r = 0; r < R; r++)
            for (size_t i = 0; i < n; i++) {
                if (recv[(size_t)r * n + i] != val(r, it, i) ||
                    irecv[(size_t)r * n + i] != r * 1000003 + it * 7 + (int32_t)i) {
                    if (j->fails++ < 3)
                        fprintf(stderr, "rank %d: gathered element %zu of rank %d wrong\n",
                                j->rank, i, r);
                }
            }
    }
    free(send);
    free(recv);
    free(isend);
    free(irecv);
    return NULL;
}

static void test_all_gather(void)
{
    const int32_t ranks[] = {1, 2, 4, 5};
    const size_t sizes[] = {0, 3, 4099};
    char err[PD_ERR_LEN];
    for (size_t a = 0; a < sizeof ranks / sizeof ranks[0]; a++) {
        pd_comm *c = NULL;
        CHECK_MSG(pd_comm_cpu_create(ranks[a], &c, err) == 0, "%s", err);
        if (!c) continue;
        for (size_t b = 0; b < sizeof sizes / sizeof sizes[0]; b++) {
            job jobs[MAX_RANKS];
            for (int32_t r = 0; r < ranks[a]; r++) jobs[r] = (job){.c = c, .rank = r, .n = sizes[b]};
            run_threads(ranks[a], gather_thread, jobs);
            for (int32_t r = 0; r < ranks[a]; r++)
                CHECK_MSG(jobs[r].fails == 0, "%d ranks, %zu elements: rank %d", ranks[a],
                          sizes[b], r);
        }
        pd_comm_destroy(c);
    }
}

/* Barrier: each rank bumps its counter for phase k, then after the barrier every counter must
 * have reached k + 1. */
static atomic_int g_phase[MAX_RANKS];

static void *barrier_thread(void *arg)
{
    job *j = arg;
    const int32_t R = j->c->n_ranks;
    for (int k = 0; k < 200; k++) {
        atomic_fetch_add(&g_phase[j->rank], 1);
        if (j->c->ops->barrier(j->c->ctx, j->rank) != 0) {
            j->fails++;
            break;
        }
        for (int32_t r = 0; r < R; r++)
            if (atomic_load(&g_phase[r]) < k + 1) j->fails++;
        /* nobody starts phase k + 1 before everyone checked phase k */
        if (j->c->ops->barrier(j->c->ctx, j->rank) != 0) {
            j->fails++;
            break;
        }
    }
    return NULL;
}

static void test_barrier(void)
{
    char err[PD_ERR_LEN];
    pd_comm *c = NULL;
    CHECK_MSG(pd_comm_cpu_create(4, &c, err) == 0, "%s", err);
    if (!c) return;
    job jobs[MAX_RANKS];
    for (int32_t r = 0; r < 4; r++) {
        atomic_store(&g_phase[r], 0);
        jobs[r] = (job){.c = c, .rank = r};
    }
    run_threads(4, barrier_thread, jobs);
    for (int32_t r = 0; r < 4; r++) CHECK_EQ_INT(jobs[r].fails, 0);
    pd_comm_destroy(c);
}

/* Rank r passes n + r elements once (a caller's bug), then agrees: the first call fails on
 * every rank with PD_EINVAL, the next works. */
static void *mismatch_thread(void *arg)
{
    job *j = arg;
    float buf[16];
    for (int i = 0; i < 16; i++) buf[i] = 1.0f;
    int rc = j->c->ops->all_reduce_sum(j->c->ctx, j->rank, buf, PD_DTYPE_F32, 8 + (size_t)j->rank);
    if (rc != PD_EINVAL) j->fails++;
    rc = j->c->ops->all_reduce_sum(j->c->ctx, j->rank, buf, PD_DTYPE_BF16, 8);
    if (rc != PD_EINVAL) j->fails++; /* the CPU holds f32 */
    rc = j->c->ops->all_reduce_sum(j->c->ctx, j->rank, buf, PD_DTYPE_F32, 8);
    if (rc != 0 || buf[0] != (float)j->c->n_ranks || buf[7] != (float)j->c->n_ranks) j->fails++;
    return NULL;
}

static void test_mismatch(void)
{
    char err[PD_ERR_LEN];
    pd_comm *c = NULL;
    CHECK_MSG(pd_comm_cpu_create(3, &c, err) == 0, "%s", err);
    if (!c) return;
    job jobs[MAX_RANKS];
    for (int32_t r = 0; r < 3; r++) jobs[r] = (job){.c = c, .rank = r};
    run_threads(3, mismatch_thread, jobs);
    for (int32_t r = 0; r < 3; r++) CHECK_EQ_INT(jobs[r].fails, 0);
    pd_comm_destroy(c);
}

static void *lonely_thread(void *arg)
{
    job *j = arg;
    float buf[4] = {1, 2, 3, 4};
    j->fails = j->c->ops->all_reduce_sum(j->c->ctx, 0, buf, PD_DTYPE_F32, 4); /* the rc */
    return NULL;
}

/* Rank 1 never comes: the abort releases rank 0, and every later op fails at once. */
static void test_abort(void)
{
    char err[PD_ERR_LEN];
    pd_comm *c = NULL;
    CHECK_MSG(pd_comm_cpu_create(2, &c, err) == 0, "%s", err);
    if (!c) return;
    job j = {.c = c, .rank = 0};
    pthread_t th;
    pthread_create(&th, NULL, lonely_thread, &j);
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
    c->ops->abort(c->ctx);
    pthread_join(th, NULL);
    CHECK_EQ_INT(j.fails, PD_EBACKEND);
    float buf[1] = {0};
    CHECK_EQ_INT(c->ops->all_reduce_sum(c->ctx, 1, buf, PD_DTYPE_F32, 1), PD_EBACKEND);
    CHECK_EQ_INT(c->ops->barrier(c->ctx, 0), PD_EBACKEND);
    CHECK_EQ_INT(c->ops->barrier(c->ctx, 5), PD_EINVAL);
    pd_comm_destroy(c);
    pd_comm_destroy(NULL);
}

static void test_create(void)
{
    char err[PD_ERR_LEN];
    pd_backend *be[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++) CHECK(pd_backend_create("cpu", NULL, &be[i], err) == 0);
    pd_comm *c = NULL;
    CHECK_MSG(pd_comm_create(be, 3, &c, err) == 0, "%s", err);
    CHECK(c && c->n_ranks == 3 && !strcmp(c->ops->name, "cpu"));
    pd_comm_destroy(c);
    c = NULL;
    CHECK_EQ_INT(pd_comm_create(be, 0, &c, err), PD_EINVAL);
    CHECK_EQ_INT(pd_comm_cpu_create(0, &c, err), PD_EINVAL);
    CHECK(c == NULL);
    pd_backend *bad[2] = {be[0], NULL};
    CHECK_EQ_INT(pd_comm_create(bad, 2, &c, err), PD_EINVAL);
    for (int i = 0; i < 3; i++) pd_backend_destroy(be[i]);
}

int main(void)
{
    test_all_reduce();
    test_all_gather();
    test_barrier();
    test_mismatch();
    test_abort();
    test_create();
    return pd_test_result("test_comm");
}
