/* cuda_comm.cu -- The CUDA backend's communicator: NCCL, one GPU a rank, every rank in this
 * process. ncclCommInitAll makes the ranks' communicators at once from one thread; then each
 * rank's thread queues its collectives on its own backend's stream, so that a decode graph
 * captured on that stream holds them (NCCL collectives are capturable), in the same order on
 * every rank. NCCL is loaded at run time (dlopen of $PDSERVE_NCCL_LIB, else libnccl.so.2):
 * the binaries start where it is absent, and only a tensor-parallel instance on CUDA needs it.
 * NCCL's all-reduce gives every rank the same bits (each chunk is reduced once and then
 * copied), which keeps the ranks' replicated residual streams identical. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cuda/cuda_common.cuh"

#if __has_include(<nccl.h>)
#include <nccl.h>
#define PD_HAVE_NCCL_H 1
#endif

#ifdef PD_HAVE_NCCL_H

/* The NCCL entry points used here, resolved from the library at first use. */
typedef struct {
    ncclResult_t (*comm_init_all)(ncclComm_t *, int, const int *);
    ncclResult_t (*comm_destroy)(ncclComm_t);
    ncclResult_t (*comm_abort)(ncclComm_t);
    ncclResult_t (*all_reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                               ncclComm_t, cudaStream_t);
    ncclResult_t (*all_gather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                               cudaStream_t);
    const char *(*error_string)(ncclResult_t);
    ncclResult_t (*get_version)(int *);
    int version;
} nccl_api;

static nccl_api g_nccl;
static int g_nccl_state; /* 0 not tried, 1 loaded, -1 failed (g_nccl_err says why) */
static char g_nccl_err[256];
static pthread_mutex_t g_nccl_mu = PTHREAD_MUTEX_INITIALIZER;

static bool nccl_load(void)
{
    pthread_mutex_lock(&g_nccl_mu);
    if (g_nccl_state == 0) {
        const char *path = pd_env_str("PDSERVE_NCCL_LIB");
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            snprintf(g_nccl_err, sizeof g_nccl_err, "cannot load NCCL (%s): %s; set "
                     "PDSERVE_NCCL_LIB to libnccl.so.2's path", path, dlerror());
            g_nccl_state = -1;
        } else {
#define SYM(field, name) *(void **)&g_nccl.field = dlsym(h, name)
            SYM(comm_init_all, "ncclCommInitAll");
            SYM(comm_destroy, "ncclCommDestroy");
            SYM(comm_abort, "ncclCommAbort");
            SYM(all_reduce, "ncclAllReduce");
            SYM(all_gather, "ncclAllGather");
            SYM(error_string, "ncclGetErrorString");
            SYM(get_version, "ncclGetVersion");
#undef SYM
            if (!g_nccl.comm_init_all || !g_nccl.comm_destroy || !g_nccl.comm_abort ||
                !g_nccl.all_reduce || !g_nccl.all_gather || !g_nccl.error_string ||
                !g_nccl.get_version) {
                snprintf(g_nccl_err, sizeof g_nccl_err, "%s lacks an NCCL entry point", path);
                g_nccl_state = -1; /* the handle stays open: harmless */
            } else {
                (void)g_nccl.get_version(&g_nccl.version);
                g_nccl_state = 1;
            }
        }
    }
    bool ok = g_nccl_state == 1;
    pthread_mutex_unlock(&g_nccl_mu);
    return ok;
}

#define PD_NCCL_CHECK(call)                                                            \
    do {                                                                               \
        ncclResult_t r_ = (call);                                                      \
        if (r_ != ncclSuccess) {                                                       \
            pd_cuda__report(#call, g_nccl.error_string(r_), __FILE__, __LINE__);       \
            return PD_EBACKEND;                                                        \
        }                                                                              \
    } while (0)

typedef struct {
    int32_t n;
    ncclComm_t *comms;     /* [n] rank r's, on devices[r] */
    int *devices;          /* [n] */
    cudaStream_t *streams; /* [n] the rank backends' streams (borrowed) */
    float **one;           /* [n] a float on each device: barrier's all-reduce */
    int aborted;           /* set once by abort (read with __atomic) */
    /* the fused ops' peer memory (tp_setup), or NULL: [n] handles, each rank's area, and the
     * abort word (pinned host memory mapped on every GPU) */
    pd_cuda_tp *tp;
    void **tp_area;
    uint32_t *tp_abort;
} nccl_comm;

static bool aborted(const nccl_comm *c) { return __atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE); }

static bool nccl_type(pd_dtype t, ncclDataType_t *out)
{
    switch (t) {
    case PD_DTYPE_F32: *out = ncclFloat32; return true;
    case PD_DTYPE_BF16: *out = ncclBfloat16; return true;
    case PD_DTYPE_F16: *out = ncclFloat16; return true;
    case PD_DTYPE_I32: *out = ncclInt32; return true;
    default: return false;
    }
}

/* The fused ops' peer memory (pd_cuda_tp): when every pair of the group's GPUs has peer
 * access (enabled here both ways: a copy over a one-way mapping runs staged, at a tenth of
 * the link: notes/cuda-ipc.md), the GPUs have one SM count and compute capability 9+, each
 * rank gets a receive area on its GPU that every other rank's kernels write into. Otherwise
 * (or PDSERVE_CUDA_TP_FUSED=0) none, and decode steps run op by op with NCCL's all-reduce. */
/* Frees what tp_setup made (none: a no-op); the fused ops are then off. */
static void tp_free(nccl_comm *c)
{
    for (int32_t r = 0; c->tp_area && r < c->n; r++)
        if (c->tp_area[r]) {
            (void)cudaSetDevice(c->devices[r]);
            (void)cudaFree(c->tp_area[r]);
        }
    if (c->tp_abort) (void)cudaFreeHost(c->tp_abort);
    free(c->tp_area);
    free(c->tp);
    c->tp_area = NULL;
    c->tp = NULL;
    c->tp_abort = NULL;
}

static void tp_setup(nccl_comm *c, pd_backend *const *ranks)
{
    if (!pd_env_bool("PDSERVE_CUDA_TP_FUSED")) {
        PD_LOGI("tensor parallel: fused decode steps off (PDSERVE_CUDA_TP_FUSED=0)");
        return;
    }
    if (c->n < 2 || c->n > PD_CUDA_TP_MAX) return;
    const pd_cuda_ctx *x0 = (const pd_cuda_ctx *)ranks[0]->ctx;
    for (int32_t r = 0; r < c->n; r++) {
        const pd_cuda_ctx *x = (const pd_cuda_ctx *)ranks[r]->ctx;
        if (x->cc_major < 9 || x->sm_count != x0->sm_count) {
            PD_LOGI("tensor parallel: fused decode steps off (GPU %d: compute capability %d, "
                    "%d SMs; GPU %d: %d SMs)", x->device, x->cc_major, x->sm_count,
                    x0->device, x0->sm_count);
            return;
        }
    }
    for (int32_t i = 0; i < c->n; i++)
        for (int32_t j = 0; j < c->n; j++) {
            int ok = 0;
            if (i == j) continue;
            if (cudaDeviceCanAccessPeer(&ok, c->devices[i], c->devices[j]) != cudaSuccess || !ok) {
                (void)cudaGetLastError();
                PD_LOGI("tensor parallel: fused decode steps off (GPU %d cannot reach GPU %d's "
                        "memory)", c->devices[i], c->devices[j]);
                return;
            }
        }
    for (int32_t i = 0; i < c->n; i++) {
        if (cudaSetDevice(c->devices[i]) != cudaSuccess) return;
        for (int32_t j = 0; j < c->n; j++) {
            if (i == j) continue;
            const cudaError_t e = cudaDeviceEnablePeerAccess(c->devices[j], 0);
            if (e != cudaSuccess) (void)cudaGetLastError();
            if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
                PD_LOGW("tensor parallel: fused decode steps off (peer access GPU %d -> %d: "
                        "%s)", c->devices[i], c->devices[j], cudaGetErrorString(e));
                return;
            }
        }
    }
    const size_t bytes = (size_t)16 * c->n * PD_CUDA_TP_MAX_ROWS * PD_CUDA_TP_MAX_HIDDEN;
    c->tp_area = (void **)calloc((size_t)c->n, sizeof *c->tp_area);
    c->tp = (pd_cuda_tp *)calloc((size_t)c->n, sizeof *c->tp);
    void *dev_abort = NULL;
    bool ok = c->tp_area && c->tp &&
              cudaHostAlloc((void **)&c->tp_abort, sizeof *c->tp_abort,
                            cudaHostAllocMapped | cudaHostAllocPortable) == cudaSuccess;
    if (ok) {
        *(volatile uint32_t *)c->tp_abort = 0;
        ok = cudaHostGetDevicePointer(&dev_abort, c->tp_abort, 0) == cudaSuccess;
    }
    for (int32_t r = 0; ok && r < c->n; r++)
        ok = cudaSetDevice(c->devices[r]) == cudaSuccess &&
             cudaMalloc(&c->tp_area[r], bytes) == cudaSuccess &&
             cudaMemset(c->tp_area[r], 0, bytes) == cudaSuccess &&
             cudaDeviceSynchronize() == cudaSuccess;
    if (!ok) {
        (void)cudaGetLastError();
        PD_LOGW("tensor parallel: fused decode steps off (cannot allocate %zu MiB a GPU for "
                "the ranks' sums)", bytes >> 20);
        tp_free(c);
        return;
    }
    for (int32_t r = 0; r < c->n; r++) {
        pd_cuda_tp *t = &c->tp[r];
        t->rank = r;
        t->n = c->n;
        t->sm_count = x0->sm_count;
        for (int32_t k = 0; k < c->n; k++) t->recv[k] = c->tp_area[k];
        t->recv_bytes = bytes;
        t->abort = (const volatile uint32_t *)dev_abort;
        t->abort_host = c->tp_abort;
    }
    PD_LOGI("tensor parallel: small decode steps may run fused, the ranks' sums through peer "
            "memory (%zu MiB a GPU)", bytes >> 20);
}

static void *comm_fused_handle(void *ctx, int32_t rank)
{
    nccl_comm *c = (nccl_comm *)ctx;
    if (!c->tp || rank < 0 || rank >= c->n) return NULL;
    return &c->tp[rank];
}

static int comm_all_reduce_sum(void *ctx, int32_t rank, void *buf, pd_dtype dtype, size_t n)
{
    nccl_comm *c = (nccl_comm *)ctx;
    ncclDataType_t t;
    if (rank < 0 || rank >= c->n || !nccl_type(dtype, &t)) return PD_EINVAL;
    if (aborted(c)) return PD_EBACKEND;
    if (n == 0) return 0;
    PD_CUDA_CHECK(cudaSetDevice(c->devices[rank]));
    PD_NCCL_CHECK(g_nccl.all_reduce(buf, buf, n, t, ncclSum, c->comms[rank], c->streams[rank]));
    return 0;
}

static int comm_all_gather(void *ctx, int32_t rank, const void *send, void *recv, pd_dtype dtype,
                           size_t n)
{
    nccl_comm *c = (nccl_comm *)ctx;
    ncclDataType_t t;
    if (rank < 0 || rank >= c->n || !nccl_type(dtype, &t)) return PD_EINVAL;
    if (aborted(c)) return PD_EBACKEND;
    if (n == 0) return 0;
    PD_CUDA_CHECK(cudaSetDevice(c->devices[rank]));
    PD_NCCL_CHECK(g_nccl.all_gather(send, recv, n, t, c->comms[rank], c->streams[rank]));
    return 0;
}

/* An all-reduce of one float, then the stream drained: every rank got here and every op
 * queued before completed. Not inside a graph capture (it synchronises). */
static int comm_barrier(void *ctx, int32_t rank)
{
    nccl_comm *c = (nccl_comm *)ctx;
    if (rank < 0 || rank >= c->n) return PD_EINVAL;
    if (aborted(c)) return PD_EBACKEND;
    PD_CUDA_CHECK(cudaSetDevice(c->devices[rank]));
    PD_NCCL_CHECK(g_nccl.all_reduce(c->one[rank], c->one[rank], 1, ncclFloat32, ncclSum,
                                    c->comms[rank], c->streams[rank]));
    PD_CUDA_CHECK(cudaStreamSynchronize(c->streams[rank]));
    return aborted(c) ? PD_EBACKEND : 0;
}

/* ncclCommAbort ends the collectives in flight (a rank stuck in one returns with an error)
 * and frees the communicator. One thread a rank's communicator, all at once: aborted one after
 * the other, the first one's reclaim (which frees device memory, an implicit device
 * synchronisation) can wait forever for a kernel of a rank whose communicator is not aborted
 * yet, still spinning for the rank that failed (NVIDIA/nccl issues 564 and 829). The caller
 * waits for them up to ABORT_WAIT_S, then logs and leaves them running. */
#define ABORT_WAIT_S 20

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int left;              /* aborts not finished */
    int refs;              /* the caller + the abort threads alive */
} abort_state;

typedef struct {
    abort_state *st;
    ncclComm_t comm;
    int device;
} abort_job;

static void abort_state_unref(abort_state *st)
{
    /* called with st->mu held; frees st when the last reference goes */
    const bool last = --st->refs == 0;
    pthread_mutex_unlock(&st->mu);
    if (last) {
        pthread_mutex_destroy(&st->mu);
        pthread_cond_destroy(&st->cv);
        free(st);
    }
}

static void *abort_thread(void *arg)
{
    abort_job *j = (abort_job *)arg;
    (void)cudaSetDevice(j->device);
    (void)g_nccl.comm_abort(j->comm);
    abort_state *st = j->st;
    free(j);
    pthread_mutex_lock(&st->mu);
    st->left--;
    pthread_cond_broadcast(&st->cv);
    abort_state_unref(st);
    return NULL;
}

static void comm_abort(void *ctx)
{
    nccl_comm *c = (nccl_comm *)ctx;
    int was = __atomic_exchange_n(&c->aborted, 1, __ATOMIC_ACQ_REL);
    if (was) return;
    if (c->tp_abort) { /* the fused ops stop waiting for the other ranks */
        __atomic_store_n(c->tp_abort, 1u, __ATOMIC_SEQ_CST);
    }
    PD_LOGE("nccl: aborting the communicator of %d GPUs (a rank failed)", c->n);
    abort_state *st = (abort_state *)calloc(1, sizeof *st);
    if (!st) { /* no memory for threads: one after the other, as a last resort */
        for (int32_t r = 0; r < c->n; r++)
            if (c->comms[r]) (void)g_nccl.comm_abort(c->comms[r]);
        return;
    }
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
    st->refs = 1;
    pthread_mutex_lock(&st->mu);
    for (int32_t r = 0; r < c->n; r++) {
        if (!c->comms[r]) continue;
        abort_job *j = (abort_job *)malloc(sizeof *j);
        pthread_t th;
        bool started = false;
        if (j) {
            *j = abort_job{st, c->comms[r], c->devices[r]};
            st->left++;
            st->refs++;
            pthread_attr_t at;
            pthread_attr_init(&at);
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            started = pthread_create(&th, &at, abort_thread, j) == 0;
            pthread_attr_destroy(&at);
            if (!started) {
                st->left--;
                st->refs--;
                free(j);
            }
        }
        if (!started) { /* no thread: abort it here (without the lock: it may take a while) */
            pthread_mutex_unlock(&st->mu);
            (void)g_nccl.comm_abort(c->comms[r]);
            pthread_mutex_lock(&st->mu);
        }
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += ABORT_WAIT_S;
    while (st->left > 0)
        if (pthread_cond_timedwait(&st->cv, &st->mu, &dl) != 0) break;
    if (st->left > 0)
        PD_LOGE("nccl: %d of %d communicators not aborted after %d s: their GPUs may be stuck "
                "in a collective; restart the process", st->left, c->n, ABORT_WAIT_S);
    abort_state_unref(st);
}

static void comm_destroy(void *ctx)
{
    nccl_comm *c = (nccl_comm *)ctx;
    if (!c) return;
    for (int32_t r = 0; c->comms && r < c->n; r++) {
        if (c->comms[r] && !aborted(c)) { /* abort freed them */
            (void)cudaSetDevice(c->devices[r]);
            (void)cudaStreamSynchronize(c->streams[r]);
            (void)g_nccl.comm_destroy(c->comms[r]);
        }
        if (c->one && c->one[r]) {
            (void)cudaSetDevice(c->devices[r]);
            (void)cudaFree(c->one[r]);
        }
    }
    tp_free(c);
    free(c->comms);
    free(c->devices);
    free(c->streams);
    free(c->one);
    free(c);
}

static const pd_comm_ops k_nccl_ops = {
    "nccl", comm_destroy, comm_all_reduce_sum, comm_all_gather, comm_barrier, comm_abort,
    comm_fused_handle,
};

extern "C" int pd_cuda__comm_create(pd_backend *const *ranks, int32_t n_ranks, pd_comm **out,
                                    char *err)
{
    *out = NULL;
    if (n_ranks < 1) return pd_errf(err, PD_EINVAL, "nccl: %d ranks", n_ranks);
    if (!nccl_load())
        return pd_errf(err, PD_EUNSUPPORTED, "tensor parallelism on cuda: %s", g_nccl_err);
    int rc = PD_ENOMEM;
    pd_comm *pc = (pd_comm *)calloc(1, sizeof *pc);
    nccl_comm *c = (nccl_comm *)calloc(1, sizeof *c);
    if (!pc || !c) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    c->n = n_ranks;
    c->comms = (ncclComm_t *)calloc((size_t)n_ranks, sizeof *c->comms);
    c->devices = (int *)calloc((size_t)n_ranks, sizeof *c->devices);
    c->streams = (cudaStream_t *)calloc((size_t)n_ranks, sizeof *c->streams);
    c->one = (float **)calloc((size_t)n_ranks, sizeof *c->one);
    if (!c->comms || !c->devices || !c->streams || !c->one) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    for (int32_t r = 0; r < n_ranks; r++) {
        const pd_cuda_ctx *x = (const pd_cuda_ctx *)ranks[r]->ctx;
        c->devices[r] = x->device;
        c->streams[r] = x->stream;
        for (int32_t q = 0; q < r; q++)
            if (c->devices[q] == x->device) {
                rc = pd_errf(err, PD_EINVAL, "nccl: ranks %d and %d are both on GPU %d (one GPU "
                             "a rank)", q, r, x->device);
                goto fail;
            }
        if (cudaSetDevice(x->device) != cudaSuccess ||
            cudaMalloc((void **)&c->one[r], sizeof(float)) != cudaSuccess ||
            cudaMemset(c->one[r], 0, sizeof(float)) != cudaSuccess) {
            (void)cudaGetLastError();
            rc = pd_errf(err, PD_ENOMEM, "nccl: cannot allocate on GPU %d", x->device);
            goto fail;
        }
    }
    {
        ncclResult_t nr = g_nccl.comm_init_all(c->comms, n_ranks, c->devices);
        if (nr != ncclSuccess) {
            memset(c->comms, 0, (size_t)n_ranks * sizeof *c->comms);
            rc = pd_errf(err, PD_EBACKEND, "nccl: ncclCommInitAll over %d GPUs failed: %s",
                         n_ranks, g_nccl.error_string(nr));
            goto fail;
        }
    }
    PD_LOGI("nccl %d.%d.%d: communicator of %d GPUs (%d .. %d)", g_nccl.version / 10000,
            g_nccl.version / 100 % 100, g_nccl.version % 100, n_ranks, c->devices[0],
            c->devices[n_ranks - 1]);
    tp_setup(c, ranks);
    pc->ops = &k_nccl_ops;
    pc->ctx = c;
    pc->n_ranks = n_ranks;
    *out = pc;
    return 0;
fail:
    comm_destroy(c);
    free(pc);
    return rc;
}

#else /* no nccl.h at build time */

extern "C" int pd_cuda__comm_create(pd_backend *const *ranks, int32_t n_ranks, pd_comm **out,
                                    char *err)
{
    (void)ranks;
    (void)n_ranks;
    *out = NULL;
    return pd_errf(err, PD_EUNSUPPORTED, "tensor parallelism on cuda: this build has no NCCL "
                   "(nccl.h was not found)");
}

#endif
