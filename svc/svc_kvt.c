/* svc_kvt.c -- KV-transfer thread: a poll loop over the kvt fd and an eventfd for posted
 * functions. */
#include "svc/svc_kvt.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"

typedef struct job {
    svc_kvt_fn fn;
    void *arg;
    struct job *next;
} job;

struct svc_kvt {
    kvt_params p;
    kvt_ctx *ctx;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *head, *tail;
    int evfd;
    bool stop, started, failed;
    char err[PD_ERR_LEN];
};

static void wake(svc_kvt *k)
{
    uint64_t one = 1;
    ssize_t r = write(k->evfd, &one, sizeof one);
    (void)r;
}

int svc_kvt_post(svc_kvt *k, svc_kvt_fn fn, void *arg)
{
    job *j = malloc(sizeof *j);
    if (!j) return PD_ENOMEM;
    j->fn = fn;
    j->arg = arg;
    j->next = NULL;
    pthread_mutex_lock(&k->mu);
    if (k->stop) {
        pthread_mutex_unlock(&k->mu);
        free(j);
        return PD_ESTATE;
    }
    if (k->tail) k->tail->next = j; else k->head = j;
    k->tail = j;
    pthread_mutex_unlock(&k->mu);
    wake(k);
    return 0;
}

typedef struct {
    svc_kvt_fn fn;
    void *arg;
    svc_kvt *k;
    bool done;
} call_box;

static void run_call(kvt_ctx *ctx, void *arg)
{
    call_box *b = arg;
    b->fn(ctx, b->arg);
    pthread_mutex_lock(&b->k->mu);
    b->done = true;
    pthread_cond_broadcast(&b->k->cv);
    pthread_mutex_unlock(&b->k->mu);
}

int svc_kvt_call(svc_kvt *k, svc_kvt_fn fn, void *arg)
{
    call_box b = {fn, arg, k, false};
    int rc = svc_kvt_post(k, run_call, &b);
    if (rc < 0) return rc;
    pthread_mutex_lock(&k->mu);
    while (!b.done) pthread_cond_wait(&k->cv, &k->mu);
    pthread_mutex_unlock(&k->mu);
    return 0;
}

static void read_stats(kvt_ctx *ctx, void *arg) { kvt_ctx_stats(ctx, arg); }

int svc_kvt_stats(svc_kvt *k, kvt_stats *out)
{
    memset(out, 0, sizeof *out);
    return svc_kvt_call(k, read_stats, out);
}

static void run_jobs(svc_kvt *k)
{
    pthread_mutex_lock(&k->mu);
    job *j = k->head;
    k->head = k->tail = NULL;
    pthread_mutex_unlock(&k->mu);
    while (j) {
        job *next = j->next;
        j->fn(k->ctx, j->arg);
        free(j);
        j = next;
    }
}

static void *loop(void *arg)
{
    svc_kvt *k = arg;
    int rc = kvt_ctx_create(&k->p, &k->ctx, k->err);
    pthread_mutex_lock(&k->mu);
    k->started = true;
    k->failed = rc < 0;
    pthread_cond_broadcast(&k->cv);
    pthread_mutex_unlock(&k->mu);
    if (rc < 0) return NULL;
    if (!k->p.secret_file)
        PD_LOGW("kvtransfer: the internal KV port is not authenticated (no --kv-secret-file): "
                "any process that reaches it can open transfers");
    for (;;) {
        run_jobs(k);
        pthread_mutex_lock(&k->mu);
        bool stop = k->stop && !k->head;
        pthread_mutex_unlock(&k->mu);
        if (stop) break;
        if (kvt_progress(k->ctx) > 0) continue;
        if (kvt_arm(k->ctx) != 0) continue;
        int timeout = kvt_timeout_ms(k->ctx);
        if (timeout < 0 || timeout > 1000) timeout = 1000;
        struct pollfd fds[2] = {{kvt_fd(k->ctx), POLLIN, 0}, {k->evfd, POLLIN, 0}};
        if (poll(fds, 2, timeout) > 0 && (fds[1].revents & POLLIN)) {
            uint64_t v;
            ssize_t r = read(k->evfd, &v, sizeof v);
            (void)r;
        }
    }
    kvt_ctx_destroy(k->ctx);
    k->ctx = NULL;
    return NULL;
}

int svc_kvt_create(const kvt_params *p, svc_kvt **out, char *err)
{
    *out = NULL;
    svc_kvt *k = calloc(1, sizeof *k);
    if (!k) return pd_errf(err, PD_ENOMEM, "out of memory");
    k->p = *p;
    k->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (k->evfd < 0) {
        free(k);
        return pd_errf(err, PD_EIO, "eventfd: %s", strerror(errno));
    }
    pthread_mutex_init(&k->mu, NULL);
    pthread_cond_init(&k->cv, NULL);
    if (pthread_create(&k->thread, NULL, loop, k) != 0) {
        close(k->evfd);
        free(k);
        return pd_errf(err, PD_EBACKEND, "cannot start the kvt thread");
    }
    pthread_mutex_lock(&k->mu);
    while (!k->started) pthread_cond_wait(&k->cv, &k->mu);
    pthread_mutex_unlock(&k->mu);
    if (k->failed) {
        pthread_join(k->thread, NULL);
        pd_errf(err, PD_EUNAVAILABLE, "%s", k->err);
        close(k->evfd);
        pthread_mutex_destroy(&k->mu);
        pthread_cond_destroy(&k->cv);
        free(k);
        return PD_EUNAVAILABLE;
    }
    *out = k;
    return 0;
}

void svc_kvt_destroy(svc_kvt *k)
{
    if (!k) return;
    pthread_mutex_lock(&k->mu);
    k->stop = true;
    pthread_mutex_unlock(&k->mu);
    wake(k);
    pthread_join(k->thread, NULL);
    close(k->evfd);
    pthread_mutex_destroy(&k->mu);
    pthread_cond_destroy(&k->cv);
    free(k);
}
