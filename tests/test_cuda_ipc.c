/* test_cuda_ipc.c -- The device path of KV transfer on the CUDA backend, across two processes
 * as prefill and decode run it: this process (the decode side) allocates a pool, exports it
 * (dev_export) and starts itself again as the prefill side, which maps it (dev_open, on the
 * second GPU when there is one: peer to peer), fills its own pool with a pattern, records an
 * event on its compute stream and copies scattered blocks of two regions (a layer's K and V)
 * with a copy queue ordered after that event, once with the kernel and once with
 * PDSERVE_KV_COPY=memcpy. Back here every destination block must hold its source block's
 * bytes and every other block must be untouched. Exits 77 without a GPU.
 *
 * --bench (on the GPU machine): the Llama-3-8B pattern (32 layers, K and V, 32 KiB blocks, a
 * 2048-token prompt = 128 scattered blocks a region) moved layer by layer, next to the same
 * bytes as one contiguous copy per region (the peer-copy floor) in the same run.
 *
 * Both modes then check the staged path's copies (staged_copies, below). */
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "common/error.h"
#include "kernels/backend.h"
#include "tests/test_util.h"

extern char **environ;

typedef struct {
    int32_t n_blocks;   /* blocks per region */
    int32_t n_regions;  /* regions of the pool (layers x 2) */
    size_t block_bytes;
} shape;

static size_t pool_bytes(const shape *s) { return (size_t)s->n_regions * s->n_blocks * s->block_bytes; }

static uint32_t pattern(int32_t region, int32_t block, size_t word)
{
    uint64_t h = ((uint64_t)region * 1000003u + (uint64_t)block) * 0x9e3779b97f4a7c15ull + word;
    h ^= h >> 31;
    return (uint32_t)(h * 0xbf58476d1ce4e5b9ull >> 32) | 1u; /* never 0: 0 = untouched */
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int wait_event(pd_backend *b, void *ev)
{
    int rc;
    while ((rc = b->ops->event_query(b->ctx, ev)) == 0) {
    }
    return rc == 1 ? 0 : rc;
}

/* The test's scattered block lists: dst ids a stride walk, src ids another. */
static void ids_for(int32_t n, int32_t n_blocks, int32_t first, int32_t *dst, int32_t *src)
{
    for (int32_t i = 0; i < n; i++) {
        dst[i] = (int32_t)(((int64_t)(first + i) * 37 + 11) % n_blocks);
        src[i] = (int32_t)(((int64_t)(first + i) * 53 + 5) % n_blocks);
    }
}

static pd_backend *make_backend(int32_t device)
{
    pd_backend_params p = pd_backend_default_params();
    p.device = device;
    pd_backend *b = NULL;
    char err[PD_ERR_LEN];
    return pd_backend_create("cuda", &p, &b, err) < 0 ? NULL : b;
}

/* ---- the prefill side (a child process) ---- */

static int child(const char *hex, const char *bus, const shape *s, bool bench)
{
    pd_backend *b = make_backend(1); /* the second GPU: peer to peer */
    if (!b) b = make_backend(0);
    if (!b) return 2;
    uint8_t ex[PD_DEV_EXPORT_BYTES];
    for (int i = 0; i < PD_DEV_EXPORT_BYTES; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return 3;
        ex[i] = (uint8_t)v;
    }
    char err[PD_ERR_LEN] = "";
    void *remote = NULL, *src = NULL;
    if (b->ops->dev_open(b->ctx, ex, bus, &remote, err) < 0) {
        fprintf(stderr, "child: dev_open: %s\n", err);
        return 4;
    }
    const size_t words = pool_bytes(s) / 4, rb = (size_t)s->n_blocks * s->block_bytes;
    if (b->ops->alloc(b->ctx, PD_DTYPE_I32, words, &src) < 0) return 5;
    if (!bench) {
        uint32_t *h = malloc(pool_bytes(s));
        if (!h) return 5;
        const size_t bw = s->block_bytes / 4;
        for (int32_t r = 0; r < s->n_regions; r++)
            for (int32_t k = 0; k < s->n_blocks; k++)
                for (size_t w = 0; w < bw; w++)
                    h[((size_t)r * s->n_blocks + k) * bw + w] = pattern(r, k, w);
        if (b->ops->upload(b->ctx, src, PD_DTYPE_I32, 0, h, PD_DTYPE_I32, words) < 0) return 6;
        free(h);
    }
    void *after = NULL;
    if (b->ops->event_record(b->ctx, &after) < 0) return 7; /* after the upload, no sync */
    int status = 0;
    for (int mode = 0; mode < 2 && !bench; mode++) { /* kernel, then memcpy runs */
        if (mode == 1) pd_env_set("PDSERVE_KV_COPY", "memcpy");
        void *q = NULL, *done = NULL;
        if (b->ops->copyq_create(b->ctx, &q) < 0) return 8;
        int32_t n = s->n_blocks / 4, dst_ids[1024], src_ids[1024];
        ids_for(n, s->n_blocks, mode * n, dst_ids, src_ids);
        void *dst[2] = {(char *)remote, (char *)remote + rb};
        const void *srcs[2] = {(char *)src, (char *)src + rb};
        if (b->ops->copyq_blocks(b->ctx, q, after, dst, srcs, 2, dst_ids, src_ids, n,
                                 s->block_bytes, &done) < 0 ||
            wait_event(b, done) < 0)
            status = 9;
        b->ops->event_release(b->ctx, done);
        b->ops->copyq_destroy(b->ctx, q);
    }
    if (bench) { /* 32 layers of a 2048-token prompt: 128 blocks a region, 2 regions a layer */
        const int32_t n_layers = s->n_regions / 2, n = 128;
        int32_t dst_ids[128], src_ids[128], seq[128];
        ids_for(n, s->n_blocks, 0, dst_ids, src_ids);
        for (int32_t i = 0; i < n; i++) seq[i] = i;
        const double bytes = (double)n_layers * 2 * n * (double)s->block_bytes;
        for (int mode = 0; mode < 3; mode++) { /* scattered kernel, scattered memcpy, floor */
            pd_env_set("PDSERVE_KV_COPY", mode == 0 ? "kernel" : "memcpy");
            void *q = NULL;
            if (b->ops->copyq_create(b->ctx, &q) < 0) return 8;
            double best = 1e30;
            for (int rep = 0; rep < 6; rep++) {
                void *last = NULL;
                double t0 = now_s();
                for (int32_t l = 0; l < n_layers; l++) {
                    void *dst[2] = {(char *)remote + (size_t)(2 * l) * rb, (char *)remote + (size_t)(2 * l + 1) * rb};
                    const void *srcs[2] = {(char *)src + (size_t)(2 * l) * rb, (char *)src + (size_t)(2 * l + 1) * rb};
                    if (last) b->ops->event_release(b->ctx, last);
                    last = NULL;
                    if (b->ops->copyq_blocks(b->ctx, q, NULL, dst, srcs, 2, mode == 2 ? seq : dst_ids,
                                             mode == 2 ? seq : src_ids, n, s->block_bytes, &last) < 0)
                        return 9;
                }
                if (wait_event(b, last) < 0) return 9;
                double t = now_s() - t0;
                b->ops->event_release(b->ctx, last);
                if (rep > 0 && t < best) best = t; /* the first is a warm-up */
            }
            b->ops->copyq_destroy(b->ctx, q);
            printf("BENCH %s: %.1f MiB in %.3f ms = %.1f GB/s\n",
                   mode == 0 ? "scattered blocks, copy kernel" : mode == 1 ? "scattered blocks, memcpy runs"
                                                               : "contiguous (peer-copy floor)",
                   bytes / 1048576.0, best * 1e3, bytes / best / 1e9);
        }
    }
    b->ops->event_release(b->ctx, after);
    b->ops->free(b->ctx, src);
    b->ops->dev_close(b->ctx, remote);
    pd_backend_destroy(b);
    return status;
}

/* ---- the decode side ---- */

/* ---- the staged path's copies: device blocks <-> pinned host slots (one process) ----
 * A gather of scattered blocks of one region into a contiguous registered host slot, and a
 * scatter back into other blocks, with the kernel and with PDSERVE_KV_COPY=memcpy; every byte
 * checked. With bench: the Llama-3-8B pattern (64 regions x 128 scattered 32 KiB blocks)
 * gathered through a ring of 1 MiB slots, next to one contiguous device -> host copy of the
 * same bytes (the PCIe floor) and the same for the scatter, same run. */
static void staged_copies(pd_backend *b, bool bench)
{
    const pd_backend_ops *o = b->ops;
    const size_t bb = bench ? 32768 : 4096;
    const int32_t nb = bench ? 2048 : 256, regions = bench ? 64 : 2, per = bench ? 128 : 100;
    const int32_t slot_blocks = (int32_t)((1u << 20) / bb) > 64 ? 64 : (int32_t)((1u << 20) / bb);
    const size_t slot = (size_t)slot_blocks * bb, n_slots = bench ? 64 : 4;
    const size_t words = (size_t)regions * nb * bb / 4;
    void *dev = NULL;
    CHECK(o->alloc(b->ctx, PD_DTYPE_I32, words, &dev) == 0);
    uint32_t *h = malloc(words * 4);
    CHECK(h != NULL);
    for (int32_t r = 0; r < regions; r++)
        for (int32_t k = 0; k < nb; k++)
            for (size_t w = 0; w < bb / 4; w++) h[((size_t)r * nb + k) * (bb / 4) + w] = pattern(r, k, w);
    CHECK(o->upload(b->ctx, dev, PD_DTYPE_I32, 0, h, PD_DTYPE_I32, words) == 0);
    CHECK(o->sync(b->ctx) == 0);
    uint8_t *ring = NULL;
    CHECK(posix_memalign((void **)&ring, 4096, slot * n_slots) == 0);
    memset(ring, 0, slot * n_slots);
    CHECK(o->host_register(b->ctx, ring, slot * n_slots) == 0);
    int32_t iota[64], ids[2048], back[2048];
    for (int32_t i = 0; i < 64; i++) iota[i] = i;
    for (int32_t i = 0; i < per; i++) ids[i] = (int32_t)(((int64_t)i * 37 + 11) % nb);
    for (int32_t i = 0; i < per; i++) back[i] = (int32_t)(((int64_t)i * 53 + 7) % nb);
    for (int mode = 0; mode < 2; mode++) {
        pd_env_set("PDSERVE_KV_COPY", mode ? "memcpy" : "kernel");
        void *q = NULL;
        CHECK(o->copyq_create(b->ctx, &q) == 0);
        if (!bench) {
            /* Gather region 1's blocks ids[] into the slots, slot by slot; check the bytes. */
            int64_t bad = 0;
            for (int32_t i0 = 0; i0 < per; i0 += slot_blocks) {
                int32_t n = per - i0 < slot_blocks ? per - i0 : slot_blocks;
                uint8_t *hs = ring + (size_t)((i0 / slot_blocks) % (int32_t)n_slots) * slot;
                void *dst = hs;
                const void *src = (char *)dev + (size_t)nb * bb;
                void *ev = NULL;
                CHECK(o->copyq_blocks(b->ctx, q, NULL, &dst, &src, 1, iota, ids + i0, n, bb, &ev) == 0);
                CHECK(wait_event(b, ev) == 0);
                o->event_release(b->ctx, ev);
                for (int32_t i = 0; i < n; i++)
                    for (size_t w = 0; w < bb / 4; w++)
                        bad += ((uint32_t *)(hs + (size_t)i * bb))[w] != pattern(1, ids[i0 + i], w);
                /* ... and scatter the slot into region 0's blocks back[]. */
                void *d0 = dev;
                const void *s0 = hs;
                CHECK(o->copyq_blocks(b->ctx, q, NULL, &d0, &s0, 1, back + i0, iota, n, bb, &ev) == 0);
                CHECK(wait_event(b, ev) == 0);
                o->event_release(b->ctx, ev);
            }
            CHECK_EQ_INT(bad, 0);
            CHECK(o->download_f32 != NULL);
            uint32_t *g = malloc(words * 4);
            CHECK(g != NULL);
            int32_t all[256];
            for (int32_t i = 0; i < nb; i++) all[i] = i;
            CHECK(o->kv_blocks_copy(b->ctx, dev, all, nb, bb, g, true) == 0);
            int32_t src_of[256];
            for (int32_t i = 0; i < nb; i++) src_of[i] = -1;
            for (int32_t i = 0; i < per; i++) src_of[back[i]] = ids[i];
            for (int32_t k = 0; k < nb; k++)
                for (size_t w = 0; w < bb / 4; w++)
                    bad += g[(size_t)k * (bb / 4) + w] !=
                           (src_of[k] < 0 ? pattern(0, k, w) : pattern(1, src_of[k], w));
            CHECK_EQ_INT(bad, 0);
            free(g);
            /* Restore region 0 for the next mode. */
            CHECK(o->upload(b->ctx, dev, PD_DTYPE_I32, 0, h, PD_DTYPE_I32, (size_t)nb * bb / 4) == 0);
            CHECK(o->sync(b->ctx) == 0);
        } else {
            /* Every region's 128 blocks through the ring, slot after slot (a slot is reused
             * only after its copy completed, as kvt does). */
            void **evs = calloc(n_slots, sizeof *evs);
            for (int dir = 0; dir < 2; dir++) {
                double t0 = now_s();
                size_t k = 0;
                for (int32_t r = 0; r < regions; r++)
                    for (int32_t i0 = 0; i0 < per; i0 += slot_blocks, k++) {
                        size_t si = k % n_slots;
                        if (evs[si]) {
                            CHECK(wait_event(b, evs[si]) == 0);
                            o->event_release(b->ctx, evs[si]);
                        }
                        int32_t n = per - i0 < slot_blocks ? per - i0 : slot_blocks;
                        void *reg = (char *)dev + (size_t)r * nb * bb, *hs = ring + si * slot;
                        void *d = dir ? reg : hs;
                        const void *sr = dir ? hs : reg;
                        CHECK(o->copyq_blocks(b->ctx, q, NULL, &d, &sr, 1, dir ? ids + i0 : iota,
                                              dir ? iota : ids + i0, n, bb, &evs[si]) == 0);
                    }
                for (size_t si = 0; si < n_slots; si++)
                    if (evs[si]) {
                        CHECK(wait_event(b, evs[si]) == 0);
                        o->event_release(b->ctx, evs[si]);
                        evs[si] = NULL;
                    }
                double t = now_s() - t0;
                /* The floor: the same bytes as one contiguous copy (pinned host). */
                const size_t bytes = (size_t)regions * per * bb;
                uint8_t *big = NULL;
                CHECK(posix_memalign((void **)&big, 4096, bytes) == 0);
                CHECK(o->host_register(b->ctx, big, bytes) == 0);
                int32_t one = 0;
                CHECK(o->kv_blocks_copy(b->ctx, dev, &one, 1, bytes, big, !dir) == 0); /* warm */
                double f0 = now_s();
                CHECK(o->kv_blocks_copy(b->ctx, dev, &one, 1, bytes, big, !dir) == 0);
                double f = now_s() - f0;
                o->host_unregister(b->ctx, big);
                free(big);
                printf("BENCH staged %s (%s): %.1f MiB in %.3f ms = %.1f GB/s; one contiguous "
                       "copy of the same bytes: %.1f GB/s; ratio %.3f\n",
                       dir ? "scatter host->device" : "gather device->host",
                       mode ? "memcpy" : "kernel", bytes / 1048576.0, t * 1e3, bytes / t / 1e9,
                       bytes / f / 1e9, f / t);
            }
            free(evs);
        }
        o->copyq_destroy(b->ctx, q);
    }
    pd_env_set("PDSERVE_KV_COPY", NULL);
    o->host_unregister(b->ctx, ring);
    free(ring);
    free(h);
    o->free(b->ctx, dev);
}

int main(int argc, char **argv)
{
    shape s = {64, 2, 4096};
    bool bench = argc > 1 && !strcmp(argv[1], "--bench");
    if (bench) s = (shape){2048, 64, 32768};
    if (argc > 4 && !strcmp(argv[1], "--child")) {
        bench = argc > 5 && !strcmp(argv[5], "bench");
        if (bench) s = (shape){2048, 64, 32768};
        return child(argv[2], argv[3], &s, bench);
    }
    pd_backend *b = make_backend(0);
    if (!b) {
        fprintf(stderr, "test_cuda_ipc: skipped: no CUDA device\n");
        return 77;
    }
    if (!b->ops->dev_export) {
        pd_backend_destroy(b);
        return 77;
    }
    void *pool = NULL;
    const size_t words = pool_bytes(&s) / 4;
    CHECK(b->ops->alloc(b->ctx, PD_DTYPE_I32, words, &pool) == 0);
    uint32_t *h = calloc(words, 4);
    CHECK(h != NULL);
    CHECK(b->ops->upload(b->ctx, pool, PD_DTYPE_I32, 0, h, PD_DTYPE_I32, words) == 0);
    CHECK(b->ops->sync(b->ctx) == 0);
    uint8_t ex[PD_DEV_EXPORT_BYTES];
    char bus[PD_BUS_ID_LEN], hex[2 * PD_DEV_EXPORT_BYTES + 1];
    CHECK(b->ops->dev_export(b->ctx, pool, ex, bus) == 0);
    for (int i = 0; i < PD_DEV_EXPORT_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", ex[i]);
    /* A refusal that names the cause: a bus id no GPU has. */
    char err[PD_ERR_LEN] = "";
    void *dummy = NULL;
    CHECK(b->ops->dev_open(b->ctx, ex, "0000:ff:1f.7", &dummy, err) == PD_EUNSUPPORTED);
    CHECK(strstr(err, "not visible") != NULL);

    char *cargv[] = {argv[0], "--child", hex, bus, "x", bench ? "bench" : "test", NULL};
    pid_t pid;
    CHECK(posix_spawn(&pid, argv[0], NULL, NULL, cargv, environ) == 0);
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    if (!bench) {
        /* Every copied block holds its source block; the rest is untouched. */
        const size_t rb = (size_t)s.n_blocks * s.block_bytes, bw = s.block_bytes / 4;
        int32_t all[64];
        for (int32_t i = 0; i < s.n_blocks; i++) all[i] = i;
        for (int32_t r = 0; r < 2; r++)
            CHECK(b->ops->kv_blocks_copy(b->ctx, (char *)pool + r * rb, all, s.n_blocks,
                                         s.block_bytes, (char *)h + r * rb, true) == 0);
        int32_t src_of[64];
        for (int32_t i = 0; i < s.n_blocks; i++) src_of[i] = -1;
        int32_t n = s.n_blocks / 4, d[64], sids[64];
        ids_for(2 * n, s.n_blocks, 0, d, sids);
        for (int32_t i = 0; i < 2 * n; i++) src_of[d[i]] = sids[i];
        int64_t bad = 0, copied = 0;
        for (int32_t r = 0; r < 2; r++)
            for (int32_t k = 0; k < s.n_blocks; k++)
                for (size_t w = 0; w < bw; w++) {
                    uint32_t got = h[((size_t)r * s.n_blocks + k) * bw + w];
                    uint32_t want = src_of[k] < 0 ? 0 : pattern(r, src_of[k], w);
                    bad += got != want;
                    copied += src_of[k] >= 0;
                }
        CHECK_EQ_INT(bad, 0);
        CHECK(copied > 0);
    }
    free(h);
    b->ops->free(b->ctx, pool);
    staged_copies(b, bench);
    pd_backend_destroy(b);
    return pd_test_result("test_cuda_ipc");
}
