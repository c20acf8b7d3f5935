/* test_cuda_comm.c -- The CUDA backend's communicator (NCCL, one GPU a rank, one thread a rank)
 * on 2 GPUs, and on 4 and 8 where the machine has them: all_reduce_sum of f32 (within 1e-6 of
 * the sum in double, relative to the sum of magnitudes) and of bf16 buffers (within the bf16
 * rounding of the inputs and the result), the same bits on every rank, sizes from 1 to 4M
 * elements, repeated; all_gather in rank order; barrier; and an all-reduce captured in a graph
 * on every rank (graph_begin / graph_end) and replayed twice over new data. Exits 77 (skipped)
 * with fewer than 2 CUDA devices or without NCCL. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#include "common/error.h"
#include "kernels/backend.h"
#include "tests/nccl_probe.h"
#include "tests/test_util.h"

#define MAX_RANKS 8

typedef struct {
    pd_backend *be;
    pd_comm *c;
    int32_t rank;
    int fails;
    float *got;       /* host: what the all-reduce left, for the cross-rank check */
    size_t n;
    pd_dtype dtype;
} job;

static float val(int32_t r, int it, size_t i)
{
    uint64_t z = ((uint64_t)r * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)it << 40) ^ i;
    z = (z ^ (z >> 31)) * 0x94d049bb133111ebull;
    z ^= z >> 29;
    return (float)(z & 0xffffff) / 16777216.0f - 0.5f;
}

/* round to bf16 (nearest even), as the upload converts */
static float bf16r(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static void run(int32_t R, void *(*fn)(void *), job *jobs)
{
    pthread_t th[MAX_RANKS];
    for (int32_t r = 1; r < R; r++) pthread_create(&th[r], NULL, fn, &jobs[r]);
    fn(&jobs[0]);
    for (int32_t r = 1; r < R; r++) pthread_join(th[r], NULL);
}

static void *reduce_thread(void *arg)
{
    job *j = arg;
    const pd_backend_ops *o = j->be->ops;
    void *x = j->be->ctx;
    const int32_t R = j->c->n_ranks;
    float *h = malloc(j->n * sizeof(float));
    void *buf = NULL;
    if (o->alloc(x, j->dtype, j->n, &buf) < 0) {
        j->fails++;
        free(h);
        return NULL;
    }
    for (int it = 0; it < 3; it++) {
        for (size_t i = 0; i < j->n; i++) h[i] = val(j->rank, it, i);
        if (o->upload(x, buf, j->dtype, 0, h, PD_DTYPE_F32, j->n) < 0 ||
            j->c->ops->all_reduce_sum(j->c->ctx, j->rank, buf, j->dtype, j->n) < 0 ||
            o->download_f32(x, h, buf, j->dtype, 0, j->n) < 0) {
            j->fails++;
            break;
        }
        const bool bf = j->dtype == PD_DTYPE_BF16;
        for (size_t i = 0; i < j->n; i++) {
            double want = 0, mag = 0;
            for (int32_t r = 0; r < R; r++) {
                float v = bf ? bf16r(val(r, it, i)) : val(r, it, i);
                want += v;
                mag += fabs(v);
            }
            /* f32: summation order; bf16: the partial sums and the result are bf16 too */
            double tol = bf ? mag * (R + 1) * 0x1p-8 : mag * 1e-6 + 1e-30;
            if (!(fabs(h[i] - want) <= tol) && j->fails++ < 3)
                fprintf(stderr, "rank %d of %d, %s, n %zu, element %zu: %.8g, want %.8g\n",
                        j->rank, R, bf ? "bf16" : "f32", j->n, i, h[i], want);
        }
    }
    memcpy(j->got, h, j->n * sizeof(float));
    o->free(x, buf);
    free(h);
    return NULL;
}

static void *gather_thread(void *arg)
{
    job *j = arg;
    const pd_backend_ops *o = j->be->ops;
    void *x = j->be->ctx;
    const int32_t R = j->c->n_ranks;
    const size_t n = j->n;
    float *h = malloc(n * R * sizeof(float));
    void *send = NULL, *recv = NULL;
    if (o->alloc(x, PD_DTYPE_F32, n, &send) < 0 || o->alloc(x, PD_DTYPE_F32, n * R, &recv) < 0) {
        j->fails++;
    } else {
        for (size_t i = 0; i < n; i++) h[i] = val(j->rank, 9, i);
        if (o->upload(x, send, PD_DTYPE_F32, 0, h, PD_DTYPE_F32, n) < 0 ||
            j->c->ops->all_gather(j->c->ctx, j->rank, send, recv, PD_DTYPE_F32, n) < 0 ||
            j->c->ops->barrier(j->c->ctx, j->rank) < 0 ||
            o->download_f32(x, h, recv, PD_DTYPE_F32, 0, n * R) < 0) {
            j->fails++;
        } else {
            for (int32_t r = 0; r < R; r++)
                for (size_t i = 0; i < n; i++)
                    if (h[(size_t)r * n + i] != val(r, 9, i) && j->fails++ < 3)
                        fprintf(stderr, "rank %d: gathered element %zu of rank %d wrong\n",
                                j->rank, i, r);
        }
    }
    o->free(x, send);
    o->free(x, recv);
    free(h);
    return NULL;
}

/* An all-reduce captured in a graph on every rank at once, replayed over new data. */
static void *graph_thread(void *arg)
{
    job *j = arg;
    const pd_backend_ops *o = j->be->ops;
    void *x = j->be->ctx;
    const int32_t R = j->c->n_ranks;
    const size_t n = j->n;
    float *h = malloc(n * sizeof(float));
    void *buf = NULL, *g = NULL;
    if (!o->graph_begin || o->alloc(x, PD_DTYPE_F32, n, &buf) < 0) {
        j->fails++;
        free(h);
        return NULL;
    }
    int rc = o->graph_begin(x);
    if (rc == 0) rc = j->c->ops->all_reduce_sum(j->c->ctx, j->rank, buf, PD_DTYPE_F32, n);
    int rc2 = o->graph_end(x, &g);
    if (rc < 0 || rc2 < 0 || !g) {
        fprintf(stderr, "rank %d: capturing the all-reduce failed (%d, %d)\n", j->rank, rc, rc2);
        j->fails++;
    }
    for (int it = 20; g && it < 22; it++) {
        for (size_t i = 0; i < n; i++) h[i] = val(j->rank, it, i);
        if (o->upload(x, buf, PD_DTYPE_F32, 0, h, PD_DTYPE_F32, n) < 0 || o->graph_launch(x, g) < 0 ||
            o->download_f32(x, h, buf, PD_DTYPE_F32, 0, n) < 0) {
            j->fails++;
            break;
        }
        for (size_t i = 0; i < n; i++) {
            double want = 0, mag = 0;
            for (int32_t r = 0; r < R; r++) {
                want += val(r, it, i);
                mag += fabs(val(r, it, i));
            }
            if (!(fabs(h[i] - want) <= mag * 1e-6 + 1e-30) && j->fails++ < 3)
                fprintf(stderr, "rank %d: replay %d element %zu: %.8g, want %.8g\n", j->rank,
                        it - 20, i, h[i], want);
        }
    }
    if (g) o->graph_destroy(x, g);
    o->free(x, buf);
    free(h);
    return NULL;
}

static void test_ranks(int32_t R)
{
    char err[PD_ERR_LEN];
    pd_backend *be[MAX_RANKS] = {0};
    for (int32_t r = 0; r < R; r++) {
        pd_backend_params bp = pd_backend_default_params();
        bp.device = r;
        CHECK_MSG(pd_backend_create("cuda", &bp, &be[r], err) == 0, "%s", err);
    }
    pd_comm *c = NULL;
    int rc = pd_comm_create(be, R, &c, err);
    CHECK_MSG(rc == 0, "%d GPUs: %s", R, err);
    if (rc == 0) {
        CHECK(!strcmp(c->ops->name, "nccl") && c->n_ranks == R);
        const size_t sizes[] = {1, 1000, (size_t)4 << 20};
        for (int t = 0; t < 2; t++)
            for (size_t s = 0; s < 3; s++) {
                job jobs[MAX_RANKS];
                for (int32_t r = 0; r < R; r++)
                    jobs[r] = (job){.be = be[r], .c = c, .rank = r, .n = sizes[s],
                                    .dtype = t ? PD_DTYPE_BF16 : PD_DTYPE_F32,
                                    .got = malloc(sizes[s] * sizeof(float))};
                run(R, reduce_thread, jobs);
                for (int32_t r = 0; r < R; r++) {
                    CHECK_MSG(jobs[r].fails == 0, "%d GPUs, %s, %zu elements: rank %d", R,
                              t ? "bf16" : "f32", sizes[s], r);
                    CHECK_MSG(memcmp(jobs[r].got, jobs[0].got, sizes[s] * sizeof(float)) == 0,
                              "%d GPUs: rank %d's sum differs from rank 0's", R, r);
                }
                for (int32_t r = 0; r < R; r++) free(jobs[r].got);
            }
        job jobs[MAX_RANKS];
        for (int32_t r = 0; r < R; r++) jobs[r] = (job){.be = be[r], .c = c, .rank = r, .n = 4099};
        run(R, gather_thread, jobs);
        for (int32_t r = 0; r < R; r++) CHECK_MSG(jobs[r].fails == 0, "all_gather rank %d", r);
        for (int32_t r = 0; r < R; r++) jobs[r] = (job){.be = be[r], .c = c, .rank = r, .n = 65536};
        run(R, graph_thread, jobs);
        for (int32_t r = 0; r < R; r++) CHECK_MSG(jobs[r].fails == 0, "graph rank %d", r);
        printf("  %d GPUs: all_reduce_sum f32 / bf16, all_gather, barrier, captured all-reduce ok\n", R);
    }
    pd_comm_destroy(c);
    for (int32_t r = 0; r < R; r++) pd_backend_destroy(be[r]);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    int32_t n_dev = 0;
    for (; n_dev < MAX_RANKS; n_dev++) { /* the devices this process can open */
        pd_backend *probe = NULL;
        pd_backend_params bp = pd_backend_default_params();
        bp.device = n_dev;
        if (pd_backend_create("cuda", &bp, &probe, err) < 0) break;
        pd_backend_destroy(probe);
    }
    if (n_dev < 2) {
        fprintf(stderr, "test_cuda_comm: skipped: %d CUDA devices (2 needed)%s%s\n", n_dev,
                n_dev ? "" : ": ", n_dev ? "" : err);
        return 77;
    }
    if (nccl_probe(err) == PD_EUNSUPPORTED) { /* NCCL present? */
        fprintf(stderr, "test_cuda_comm: skipped: %s\n", err);
        return 77;
    }
    printf("test_cuda_comm: NCCL on %d GPUs\n", n_dev);
    for (int32_t R = 2; R <= n_dev; R *= 2) test_ranks(R);
    return pd_test_result("test_cuda_comm");
}
