/* cpu_comm.c -- The CPU communicator: the ranks of a tensor-parallel instance are threads of
 * this process and their buffers host memory, so a collective is a barrier, a pass over the
 * other ranks' buffers and a barrier. all_reduce_sum splits the elements among the ranks;
 * each sums its share over the ranks in rank order and writes the sum into every rank's
 * buffer, so every rank gets the same bits whatever the threads' timing. */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "kernels/backend.h"

enum { OP_REDUCE = 1, OP_GATHER = 2 };

typedef struct {
    void *buf;                /* all_reduce_sum's buffer, all_gather's recv */
    const void *send;         /* all_gather's */
    pd_dtype dtype;
    size_t n;
    int op;
} slot;

typedef struct {
    int32_t n_ranks;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t waiting;          /* ranks in the current barrier */
    uint64_t generation;      /* barriers completed */
    bool aborted;
    slot *slots;              /* [n_ranks]: what each rank passed to the current op */
} cpu_comm;

/* Waits until every rank arrived. Returns 0, or PD_EBACKEND once aborted. */
static int barrier_wait(cpu_comm *c)
{
    int rc = 0;
    pthread_mutex_lock(&c->mu);
    if (c->aborted) {
        rc = PD_EBACKEND;
    } else if (++c->waiting == c->n_ranks) {
        c->waiting = 0;
        c->generation++;
        pthread_cond_broadcast(&c->cv);
    } else {
        const uint64_t gen = c->generation;
        while (gen == c->generation && !c->aborted) pthread_cond_wait(&c->cv, &c->mu);
        if (gen == c->generation) rc = PD_EBACKEND; /* woken by abort */
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* Publishes rank's arguments and waits for every rank's; then checks that they agree (every
 * rank sees the same slots, so every rank gives the same answer). */
static int enter(cpu_comm *c, int32_t rank, int op, void *buf, const void *send, pd_dtype dtype,
                 size_t n)
{
    if (rank < 0 || rank >= c->n_ranks) return PD_EINVAL; /* a caller's bug: no one waits */
    c->slots[rank] = (slot){.buf = buf, .send = send, .dtype = dtype, .n = n, .op = op};
    int rc = barrier_wait(c);
    if (rc < 0) return rc;
    for (int32_t r = 1; r < c->n_ranks; r++)
        if (c->slots[r].op != op || c->slots[r].n != n || c->slots[r].dtype != c->slots[0].dtype)
            rc = PD_EINVAL;
    if (rc == 0 && dtype != PD_DTYPE_F32 &&
        !(op == OP_GATHER && dtype == PD_DTYPE_I32))
        rc = PD_EINVAL;
    if (rc < 0) {
        /* nobody may publish the next op's slot before every rank has read these */
        int rc2 = barrier_wait(c);
        return rc2 < 0 ? rc2 : rc;
    }
    return 0;
}

static int comm_all_reduce_sum(void *ctx, int32_t rank, void *buf, pd_dtype dtype, size_t n)
{
    cpu_comm *c = ctx;
    int rc = enter(c, rank, OP_REDUCE, buf, NULL, dtype, n);
    if (rc < 0) return rc;
    const int32_t R = c->n_ranks;
    const size_t lo = n * (size_t)rank / (size_t)R, hi = n * (size_t)(rank + 1) / (size_t)R;
    float *b0 = c->slots[0].buf;
    for (size_t i = lo; i < hi; i++) {
        float s = b0[i];
        for (int32_t r = 1; r < R; r++) s += ((const float *)c->slots[r].buf)[i];
        for (int32_t r = 0; r < R; r++) ((float *)c->slots[r].buf)[i] = s;
    }
    return barrier_wait(c); /* every share is written before any rank reads its buffer */
}

static int comm_all_gather(void *ctx, int32_t rank, const void *send, void *recv, pd_dtype dtype,
                           size_t n)
{
    cpu_comm *c = ctx;
    int rc = enter(c, rank, OP_GATHER, recv, send, dtype, n);
    if (rc < 0) return rc;
    const size_t bytes = n * pd_dtype_size(dtype);
    for (int32_t r = 0; r < c->n_ranks; r++)
        if (bytes) memcpy((char *)recv + (size_t)r * bytes, c->slots[r].send, bytes);
    return barrier_wait(c); /* no rank reuses its send buffer before every rank copied it */
}

static int comm_barrier(void *ctx, int32_t rank)
{
    cpu_comm *c = ctx;
    if (rank < 0 || rank >= c->n_ranks) return PD_EINVAL;
    return barrier_wait(c);
}

static void comm_abort(void *ctx)
{
    cpu_comm *c = ctx;
    pthread_mutex_lock(&c->mu);
    c->aborted = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void comm_destroy(void *ctx)
{
    cpu_comm *c = ctx;
    if (!c) return;
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c->slots);
    free(c);
}

static const pd_comm_ops k_cpu_comm_ops = {
    .name = "cpu",
    .destroy = comm_destroy,
    .all_reduce_sum = comm_all_reduce_sum,
    .all_gather = comm_all_gather,
    .barrier = comm_barrier,
    .abort = comm_abort,
};

int pd_comm_cpu_create(int32_t n_ranks, pd_comm **out, char *err)
{
    *out = NULL;
    if (n_ranks < 1 || n_ranks > 1024)
        return pd_errf(err, PD_EINVAL, "cpu communicator: %d ranks (allowed 1..1024)", n_ranks);
    pd_comm *pc = calloc(1, sizeof *pc);
    cpu_comm *c = calloc(1, sizeof *c);
    slot *s = calloc((size_t)n_ranks, sizeof *s);
    if (!pc || !c || !s) {
        free(pc);
        free(c);
        free(s);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    c->n_ranks = n_ranks;
    c->slots = s;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pc->ops = &k_cpu_comm_ops;
    pc->ctx = c;
    pc->n_ranks = n_ranks;
    *out = pc;
    return 0;
}
