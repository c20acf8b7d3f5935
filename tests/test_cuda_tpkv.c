/* test_cuda_tpkv.c -- The KV transfer of tensor-parallel instances on CUDA GPUs (docs/
 * kvtransfer.md, "Tensor-parallel instances").
 * 1. The copyq_rows op (kernels/cuda/cuda_copy_rows.cu) against the CPU backend's, the
 *    ranks on devices r % (GPUs present): the gather of every rank's KV heads into a pinned
 *    host slot (replicas not read) and the scatter back into every rank, for divided and
 *    replicated heads, copies whose words are 16, 8, 4, 2 and 1 bytes, with the copy
 *    kernel and with PDSERVE_KV_COPY=memcpy (cudaMemcpy2DAsync); kvt_tp_gather /
 *    kvt_tp_scatter agree; a copy ordered after an event waits for the compute stream's
 *    write of its source (queued behind 40 fills of 256 MiB).
 * 2. stories260k at TP 2 (and TP 4 with 4 GPUs) through the services' staged pool
 *    (svc_kvdev.c): stage_out / stage_in of a layer's K and V against kvt_tp_gather /
 *    kvt_tp_scatter of the ranks' caches, and a prefill forward whose layer hook gathers each
 *    layer ordered after every rank's own event (svc_kv_layer_ready): the gathered bytes are
 *    the forward's K and V, never the 0xff bytes the caches held before it.
 * Exits 77 (skipped) without a CUDA device; part 2 needs 2 GPUs and NCCL. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "svc/svc.h"
#include "tests/nccl_probe.h"
#include "tests/svc_tp_util.h"
#include "tests/test_util.h"

#define NB 11     /* blocks of a rank's region in part 1 */
#define MAX_DEV 4

static pd_backend *g_cpu;
static pd_backend *g_dev[MAX_DEV];
static int32_t g_n_dev;
static uint64_t g_rng = 0x2545f4914f6cdd1dull;

static void fill_random(void *p, size_t n) { svc_tp_fill_random(p, n, &g_rng); }

/* Page-aligned host memory pinned (mapped, portable) through be: a ring slot. */
static void *pinned(pd_backend *be, size_t bytes)
{
    void *p = NULL;
    bytes = (bytes + 4095) & ~(size_t)4095;
    if (posix_memalign(&p, 4096, bytes) != 0) return NULL;
    memset(p, 0, bytes);
    if (be->ops->host_register(be->ctx, p, bytes) < 0) {
        free(p);
        return NULL;
    }
    return p;
}

static void unpin(pd_backend *be, void *p)
{
    if (!p) return;
    be->ops->host_unregister(be->ctx, p);
    free(p);
}

/* Waits for a copy's event (polling, as the kvt thread does); returns the last query. */
static int wait_event(pd_backend *be, void *ev)
{
    int rc;
    while ((rc = be->ops->event_query(be->ctx, ev)) == 0) {
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    return rc;
}

/* A region's bytes between a device buffer and host memory (one raw block, synchronous). */
static int region_io(pd_backend *be, void *dev, void *host, size_t bytes, bool to_host)
{
    const int32_t zero = 0;
    return be->ops->kv_blocks_copy(be->ctx, dev, &zero, 1, bytes, host, to_host);
}

/* ---- part 1: the op ---- */

static void check_mapping(int32_t H, int32_t N, int32_t T, int32_t hd, pd_dtype dt, bool memcpy_mode)
{
    kvt_layout l = {.dtype = dt, .n_layers = 1, .block_size = T, .n_kv_heads = H, .head_dim = hd};
    const int32_t ids[6] = {9, 2, 5, 0, 10, 3};
    const int32_t n = 6;
    const size_t whole = kvt_layout_block_bytes(&l);
    pd_backend *be[8];
    void *q[8] = {0}, *dev[8] = {0}, *host[8] = {0}, *ref[8] = {0};
    size_t bytes[8];
    kvt_tp_part part[8];
    uint8_t *slot = pinned(g_dev[0], n * whole), *want = malloc(n * whole);
    char what[160];
    snprintf(what, sizeof what, "%d heads on %d ranks (%d GPUs), %d rows of %d x %zu bytes%s", H,
             N, g_n_dev, T, hd, pd_dtype_size(dt), memcpy_mode ? ", memcpy" : "");
    CHECK_MSG(slot && want, "%s: no pinned slot", what);
    bool ok = slot && want;
    for (int32_t r = 0; ok && r < N; r++) {
        be[r] = g_dev[r % g_n_dev];
        ok = kvt_tp_part_of(&l, N, r, &part[r]) == 0;
        bytes[r] = NB * part[r].rank_block_bytes;
        host[r] = malloc(bytes[r]);
        ref[r] = malloc(bytes[r]);
        ok = ok && host[r] && ref[r] &&
             be[r]->ops->alloc(be[r]->ctx, PD_DTYPE_I32, (bytes[r] + 3) / 4, &dev[r]) == 0 &&
             be[r]->ops->copyq_create(be[r]->ctx, &q[r]) == 0;
        if (!ok) break;
        fill_random(host[r], bytes[r]);
        memcpy(ref[r], host[r], bytes[r]);
        ok = region_io(be[r], dev[r], host[r], bytes[r], false) == 0;
    }
    CHECK_MSG(ok, "%s: setup failed", what);
    if (ok) {
        /* gather: every rank's copy on its own device's queue, then all complete */
        memset(slot, 0xee, n * whole);
        void *done[8] = {0};
        for (int32_t r = 0; r < N; r++) {
            if (!part[r].gathered) continue;
            pd_copy_rows a = svc_kv_tp_rows(&part[r], dev[r], ids, slot, n, true);
            CHECK_EQ_INT(be[r]->ops->copyq_rows(be[r]->ctx, q[r], NULL, &a, &done[r]), 0);
        }
        for (int32_t r = 0; r < N; r++)
            if (done[r]) {
                CHECK_EQ_INT(wait_event(be[r], done[r]), 1);
                be[r]->ops->event_release(be[r]->ctx, done[r]);
                done[r] = NULL;
            }
        /* the CPU op (the reference) over the host copies */
        memset(want, 0x11, n * whole);
        for (int32_t r = 0; r < N; r++) {
            if (!part[r].gathered) continue;
            pd_copy_rows a = svc_kv_tp_rows(&part[r], host[r], ids, want, n, true);
            void *cq = NULL, *d = NULL;
            g_cpu->ops->copyq_create(g_cpu->ctx, &cq);
            CHECK_EQ_INT(g_cpu->ops->copyq_rows(g_cpu->ctx, cq, NULL, &a, &d), 0);
            g_cpu->ops->copyq_destroy(g_cpu->ctx, cq);
        }
        CHECK_MSG(!memcmp(slot, want, n * whole), "%s: gather differs from the CPU's", what);
        uint8_t *kv = malloc(n * whole);
        kvt_tp_gather(&l, N, (const void *const *)host, NB, ids, n, kv);
        CHECK_MSG(kv && !memcmp(kv, want, n * whole), "%s: the CPU's gather differs from "
                  "kvt_tp_gather", what);
        free(kv);
        /* scatter into every rank (replicas too) */
        fill_random(slot, n * whole);
        for (int32_t r = 0; r < N; r++) {
            pd_copy_rows a = svc_kv_tp_rows(&part[r], dev[r], ids, slot, n, false);
            CHECK_EQ_INT(be[r]->ops->copyq_rows(be[r]->ctx, q[r], NULL, &a, &done[r]), 0);
        }
        kvt_tp_scatter(&l, N, ref, NB, ids, n, slot);
        for (int32_t r = 0; r < N; r++) {
            if (done[r]) {
                CHECK_EQ_INT(wait_event(be[r], done[r]), 1);
                be[r]->ops->event_release(be[r]->ctx, done[r]);
            }
            CHECK_EQ_INT(region_io(be[r], dev[r], host[r], bytes[r], true), 0);
            CHECK_MSG(!memcmp(host[r], ref[r], bytes[r]), "%s: scatter into rank %d differs "
                      "from kvt_tp_scatter", what, r);
        }
    }
    for (int32_t r = 0; r < N; r++) {
        if (q[r]) be[r]->ops->copyq_destroy(be[r]->ctx, q[r]);
        if (dev[r]) be[r]->ops->free(be[r]->ctx, dev[r]);
        free(host[r]);
        free(ref[r]);
    }
    unpin(g_dev[0], slot);
    free(want);
}

/* Rows of 5 bytes, 7 apart from offset 1 in blocks of 23 bytes, from the last device into
 * rows 5 apart in blocks of 15 of a pinned slot, and back: every size and offset odd. */
static void check_odd(bool memcpy_mode)
{
    pd_backend *be = g_dev[g_n_dev - 1];
    const int32_t ids[3] = {4, 0, 2}, pos[3] = {0, 1, 2};
    uint8_t host[5 * 23], back[5 * 23], want[5 * 23], *slot = pinned(g_dev[0], 45);
    uint8_t ref[45];
    void *dev = NULL, *q = NULL, *done = NULL, *cq = NULL, *d = NULL;
    bool ok = slot && be->ops->alloc(be->ctx, PD_DTYPE_I32, 30, &dev) == 0 &&
              be->ops->copyq_create(be->ctx, &q) == 0;
    CHECK_MSG(ok, "odd copy: setup failed");
    if (ok) {
        fill_random(host, sizeof host);
        CHECK_EQ_INT(region_io(be, dev, host, sizeof host, false), 0);
        pd_copy_rows a = {.dst = slot, .src = dev, .dst_ids = pos, .src_ids = ids, .n = 3,
                          .rows = 3, .row_bytes = 5, .dst_block_bytes = 15,
                          .src_block_bytes = 23, .dst_pitch = 5, .src_pitch = 7,
                          .src_offset = 1};
        CHECK_EQ_INT(be->ops->copyq_rows(be->ctx, q, NULL, &a, &done), 0);
        CHECK_EQ_INT(wait_event(be, done), 1);
        be->ops->event_release(be->ctx, done);
        a.dst = ref;
        a.src = host;
        g_cpu->ops->copyq_create(g_cpu->ctx, &cq);
        CHECK_EQ_INT(g_cpu->ops->copyq_rows(g_cpu->ctx, cq, NULL, &a, &d), 0);
        CHECK_MSG(!memcmp(slot, ref, 45), "odd copy%s: gather differs from the CPU's",
                  memcpy_mode ? " (memcpy)" : "");
        /* and back, into other blocks */
        const int32_t back_ids[3] = {1, 3, 4};
        pd_copy_rows b = {.dst = dev, .src = slot, .dst_ids = back_ids, .src_ids = pos, .n = 3,
                          .rows = 3, .row_bytes = 5, .dst_block_bytes = 23,
                          .src_block_bytes = 15, .dst_pitch = 7, .src_pitch = 5,
                          .dst_offset = 1};
        CHECK_EQ_INT(be->ops->copyq_rows(be->ctx, q, NULL, &b, &done), 0);
        CHECK_EQ_INT(wait_event(be, done), 1);
        be->ops->event_release(be->ctx, done);
        memcpy(want, host, sizeof want);
        b.dst = want;
        b.src = ref;
        CHECK_EQ_INT(g_cpu->ops->copyq_rows(g_cpu->ctx, cq, NULL, &b, &d), 0);
        CHECK_EQ_INT(region_io(be, dev, back, sizeof back, true), 0);
        CHECK_MSG(!memcmp(back, want, sizeof back), "odd copy%s: scatter differs from the "
                  "CPU's", memcpy_mode ? " (memcpy)" : "");
        g_cpu->ops->copyq_destroy(g_cpu->ctx, cq);
    }
    if (q) be->ops->copyq_destroy(be->ctx, q);
    if (dev) be->ops->free(be->ctx, dev);
    unpin(g_dev[0], slot);
}

static void test_mappings(bool memcpy_mode)
{
    /* the copy queues read PDSERVE_KV_COPY when they are made */
    if (memcpy_mode) pd_env_set("PDSERVE_KV_COPY", "memcpy");
    else pd_env_set("PDSERVE_KV_COPY", NULL);
    const int32_t heads[] = {1, 2, 4, 8}, ranks[] = {2, 4, 8};
    int32_t n = 0;
    for (int hi = 0; hi < 4; hi++)
        for (int ri = 0; ri < 3; ri++) {
            check_mapping(heads[hi], ranks[ri], 16, 64, PD_DTYPE_BF16, memcpy_mode); /* words 16 */
            check_mapping(heads[hi], ranks[ri], 4, 4, PD_DTYPE_BF16, memcpy_mode);   /* 8 */
            check_mapping(heads[hi], ranks[ri], 3, 3, PD_DTYPE_BF16, memcpy_mode);   /* 2 */
            n += 3;
        }
    check_mapping(3, 1, 5, 3, PD_DTYPE_F32, memcpy_mode); /* 4-byte words */
    check_odd(memcpy_mode);                                 /* 1-byte words */
    pd_env_set("PDSERVE_KV_COPY", NULL);
    printf("  copyq_rows (%s): %d mappings of 1 - 8 heads on 1 - 8 ranks and an odd-sized "
           "copy, gather and scatter equal to the CPU's\n",
           memcpy_mode ? "cudaMemcpy2DAsync" : "kernel", n + 1);
}

/* A copy ordered after an event waits for the compute stream's write of its source. */
static void test_ordering(void)
{
    for (int32_t d = 0; d < g_n_dev; d++) {
        pd_backend *be = g_dev[d];
        const size_t big = (size_t)64 << 20; /* floats: 256 MiB */
        const size_t rb = 16 * 128 * 2, bytes = 4 * rb;
        void *buf = NULL, *reg = NULL, *q = NULL, *src = NULL, *ev = NULL, *done = NULL;
        uint8_t *slot = pinned(be, bytes), *want = malloc(bytes);
        bool ok = slot && want && be->ops->alloc(be->ctx, PD_DTYPE_F32, big, &buf) == 0 &&
                  be->ops->alloc(be->ctx, PD_DTYPE_I32, bytes / 4, &reg) == 0 &&
                  be->ops->copyq_create(be->ctx, &q) == 0 &&
                  be->ops->host_alloc(be->ctx, bytes, &src) == 0;
        CHECK_MSG(ok, "GPU %d: ordering setup failed", d);
        if (ok) {
            memset(slot, 0, bytes);
            fill_random(src, bytes);
            memcpy(want, src, bytes);
            const int32_t zero = 0;
            uint8_t *old = calloc(1, bytes); /* the region holds zeros before the write */
            CHECK_EQ_INT(be->ops->kv_blocks_copy(be->ctx, reg, &zero, 1, bytes, old, false), 0);
            free(old);
            for (int k = 0; k < 40; k++)
                CHECK_EQ_INT(be->ops->fill_uniform(be->ctx, buf, PD_DTYPE_F32, big, (uint64_t)k,
                                                   -1.0f, 1.0f), 0);
            CHECK_EQ_INT(be->ops->upload_rows(be->ctx, reg, bytes, src, bytes, bytes, 1), 0);
            CHECK_EQ_INT(be->ops->event_record(be->ctx, &ev), 0);
            /* the region's 4 blocks, one row each, into the slot */
            const int32_t ids[4] = {0, 1, 2, 3};
            pd_copy_rows a = {.dst = slot, .src = reg, .dst_ids = ids, .src_ids = ids, .n = 4,
                              .rows = 1, .row_bytes = rb, .dst_block_bytes = rb,
                              .src_block_bytes = rb, .dst_pitch = rb, .src_pitch = rb};
            CHECK_EQ_INT(be->ops->copyq_rows(be->ctx, q, ev, &a, &done), 0);
            const int early = be->ops->event_query(be->ctx, done);
            CHECK_EQ_INT(wait_event(be, done), 1);
            CHECK_MSG(!memcmp(slot, want, bytes), "GPU %d: the copy ordered after the event did "
                      "not see the compute stream's write", d);
            printf("  GPU %d: a copy after an event waits for the compute stream (%s when "
                   "queued)\n", d, early ? "already done" : "pending");
            be->ops->event_release(be->ctx, done);
            be->ops->event_release(be->ctx, ev);
            be->ops->sync(be->ctx);
        }
        if (src) be->ops->host_free(be->ctx, src);
        if (q) be->ops->copyq_destroy(be->ctx, q);
        if (reg) be->ops->free(be->ctx, reg);
        if (buf) be->ops->free(be->ctx, buf);
        unpin(be, slot);
        free(want);
    }
}

/* ---- part 2: a stories260k instance ---- */

/* The ranks' regions of layer's K or V downloaded into host[r] (malloc'ed). */
static void download(svc_model *m, int32_t layer, int kv, void **host)
{
    void *reg[8];
    size_t bytes[8];
    svc_tp_regions(m, layer, kv, reg, bytes);
    for (int32_t r = 0; r < mr_n_ranks(m->runner); r++) {
        host[r] = malloc(bytes[r]);
        CHECK_EQ_INT(region_io(m->tp->be[r], reg[r], host[r], bytes[r], true), 0);
    }
}

typedef struct {
    svc_model *m;
    const kvt_device_ops *ops;
    uint8_t *slots;     /* [n_layers][2 (K, V)][2 blocks] whole-layout blocks, pinned */
    void *tok[64][2];
    int32_t calls, bad;
} hook_state;

/* The layer hook: the layer's K and V of blocks 0 and 1 gathered into the layer's slots,
 * ordered after every rank's own event of the layer. */
static void hook(void *arg, int32_t layer)
{
    hook_state *h = arg;
    kvt_layout l;
    svc_kv_layout(h->m, &l);
    const size_t whole = kvt_layout_block_bytes(&l);
    const int32_t ids[2] = {0, 1};
    void *after[2];
    h->calls++;
    if (layer >= 64 || svc_kv_layer_ready(h->m, layer, 2, after) != 0) {
        h->bad++;
        return;
    }
    for (int kv = 0; kv < 2; kv++) {
        uint8_t *slot = h->slots + ((size_t)layer * 2 + (size_t)kv) * 2 * whole;
        if (h->ops->stage_out(h->ops->arg, layer, kv, ids, 2, after[kv], slot,
                              &h->tok[layer][kv]) != 0)
            h->bad++;
        h->ops->release(h->ops->arg, after[kv]);
    }
}

static void test_instance(int32_t n_tp)
{
    char err[PD_ERR_LEN];
    svc_model m;
    int rc = svc_tp_open_stories("cuda", n_tp, 16, 0, &m, err);
    CHECK_MSG(rc == 0, "stories260k TP %d: %s", n_tp, err);
    if (rc < 0) return;
    CHECK(svc_kv_staged(&m) && svc_kv_stage_ops(&m) && !svc_kv_device_on(&m));
    kvt_params kp = kvt_default_params();
    svc_kv_device_params(&m, &kp);
    const kvt_device_ops *ops = kp.device;
    CHECK(ops && ops->stage_out && ops->stage_in && ops->host_pin);
    if (!ops) {
        svc_model_close(&m);
        return;
    }
    kvt_layout l;
    svc_kv_layout(&m, &l);
    const int32_t nb = mr_n_blocks(m.runner), L = l.n_layers;
    const size_t whole = kvt_layout_block_bytes(&l);
    const size_t slots_bytes = ((size_t)L * 4 * whole + 4095) & ~(size_t)4095;
    uint8_t *slots = NULL;
    CHECK(posix_memalign((void **)&slots, 4096, slots_bytes) == 0);
    CHECK_EQ_INT(ops->host_pin(ops->arg, slots, slots_bytes), 0); /* as kvt pins its ring */
    uint8_t *want = malloc(slots_bytes);
    /* stage_out / stage_in of layer 0 and the last */
    const int32_t ids[4] = {nb - 1, 3, 0, 7};
    for (int32_t layer = 0; layer < L; layer += L - 1)
        for (int kv = 0; kv < 2; kv++) {
            void *reg[8], *host[8], *tok = NULL;
            size_t bytes[8];
            svc_tp_regions(&m, layer, kv, reg, bytes);
            for (int32_t r = 0; r < n_tp; r++) {
                host[r] = malloc(bytes[r]);
                fill_random(host[r], bytes[r]);
                CHECK_EQ_INT(region_io(m.tp->be[r], reg[r], host[r], bytes[r], false), 0);
            }
            CHECK_EQ_INT(ops->stage_out(ops->arg, layer, kv, ids, 4, NULL, slots, &tok), 0);
            while ((rc = ops->poll(ops->arg, tok)) == 0) {}
            CHECK_EQ_INT(rc, 1);
            ops->release(ops->arg, tok);
            kvt_tp_gather(&l, n_tp, (const void *const *)host, nb, ids, 4, want);
            CHECK_MSG(!memcmp(slots, want, 4 * whole), "TP %d layer %d %s: stage_out differs "
                      "from kvt_tp_gather", n_tp, layer, kv ? "V" : "K");
            fill_random(slots, 4 * whole);
            kvt_tp_scatter(&l, n_tp, host, nb, ids, 4, slots);
            CHECK_EQ_INT(ops->stage_in(ops->arg, layer, kv, ids, 4, slots, &tok), 0);
            while ((rc = ops->poll(ops->arg, tok)) == 0) {}
            CHECK_EQ_INT(rc, 1);
            ops->release(ops->arg, tok);
            void *got[8];
            download(&m, layer, kv, got);
            for (int32_t r = 0; r < n_tp; r++) {
                CHECK_MSG(!memcmp(got[r], host[r], bytes[r]), "TP %d layer %d %s: stage_in of "
                          "rank %d differs from kvt_tp_scatter", n_tp, layer, kv ? "V" : "K", r);
                free(got[r]);
                free(host[r]);
            }
        }
    /* a prefill forward of 24 tokens into blocks 0 and 1 whose caches held 0xff bytes: the
     * hook's gathers must read the forward's K and V */
    for (int32_t layer = 0; layer < L; layer++)
        for (int kv = 0; kv < 2; kv++) {
            void *reg[8];
            size_t bytes[8];
            svc_tp_regions(&m, layer, kv, reg, bytes);
            for (int32_t r = 0; r < n_tp; r++) {
                void *ff = malloc(bytes[r]);
                memset(ff, 0xff, bytes[r]);
                CHECK_EQ_INT(region_io(m.tp->be[r], reg[r], ff, bytes[r], false), 0);
                free(ff);
            }
        }
    memset(slots, 0, slots_bytes);
    hook_state hs = {.m = &m, .ops = ops, .slots = slots};
    mr_set_layer_hook(m.runner, hook, &hs);
    enum { NT = 24 };
    int32_t tok_ids[NT], pos[NT], slot_map[NT], cu[2] = {0, NT}, ctx[1] = {NT}, bt[2] = {0, 1};
    int32_t rows[1] = {NT - 1};
    for (int32_t i = 0; i < NT; i++) {
        tok_ids[i] = (i * 37 + 5) % m.cfg.vocab_size;
        pos[i] = i;
        slot_map[i] = i;
    }
    const int32_t T = l.block_size;
    mr_batch b = {NT, tok_ids, pos, slot_map, 1, cu, ctx, bt, 2, 1, rows};
    float *logits = malloc((size_t)m.cfg.vocab_size * sizeof *logits);
    rc = mr_forward(m.runner, &b, logits, err);
    CHECK_MSG(rc == 0, "TP %d forward: %s", n_tp, err);
    mr_set_layer_hook(m.runner, NULL, NULL);
    CHECK_EQ_INT(hs.calls, L);
    CHECK_EQ_INT(hs.bad, 0);
    int32_t stale = 0;
    for (int32_t layer = 0; layer < L && layer < 64; layer++)
        for (int kv = 0; kv < 2; kv++) {
            if (!hs.tok[layer][kv]) continue;
            while ((rc = ops->poll(ops->arg, hs.tok[layer][kv])) == 0) {}
            CHECK_EQ_INT(rc, 1);
            ops->release(ops->arg, hs.tok[layer][kv]);
            void *host[8];
            download(&m, layer, kv, host);
            const int32_t two[2] = {0, 1};
            kvt_tp_gather(&l, n_tp, (const void *const *)host, nb, two, 2, want);
            const uint8_t *got = slots + ((size_t)layer * 2 + (size_t)kv) * 2 * whole;
            /* tokens 0 .. NT - 1: the first NT rows of the two blocks */
            const size_t row = whole / (size_t)T, used = (size_t)NT * row;
            if (memcmp(got, want, used)) stale++;
            for (int32_t r = 0; r < n_tp; r++) free(host[r]);
        }
    CHECK_MSG(stale == 0, "TP %d: %d of %d layer gathers in the hook read other bytes than the "
              "forward's K / V (ordering)", n_tp, stale, 2 * L);
    printf("  stories260k TP %d: stage_out / stage_in exact; %d layers gathered in the hook "
           "after every rank's event, %d stale\n", n_tp, L, stale);
    free(logits);
    free(want);
    ops->host_unpin(ops->arg, slots);
    free(slots);
    svc_kv_device_free(&m);
    svc_model_close(&m);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = 1;
    if (pd_backend_create("cpu", &bp, &g_cpu, err) < 0) {
        fprintf(stderr, "cpu backend: %s\n", err);
        return 1;
    }
    for (; g_n_dev < MAX_DEV; g_n_dev++) {
        pd_backend_params p = pd_backend_default_params();
        p.device = g_n_dev;
        if (pd_backend_create("cuda", &p, &g_dev[g_n_dev], err) < 0) break;
    }
    if (g_n_dev == 0) {
        fprintf(stderr, "test_cuda_tpkv: skipped: no CUDA device (%s)\n", err);
        pd_backend_destroy(g_cpu);
        return 77;
    }
    printf("test_cuda_tpkv: tensor-parallel KV copies on %d GPU%s against the CPU\n", g_n_dev,
           g_n_dev > 1 ? "s" : "");
    test_mappings(false);
    test_mappings(true);
    test_ordering();
    bool nccl = g_n_dev >= 2 && nccl_probe(err) != PD_EUNSUPPORTED;
    for (int32_t r = 0; r < g_n_dev; r++) pd_backend_destroy(g_dev[r]);
    if (!nccl) {
        printf("  stories260k instances: skipped (%s)\n",
               g_n_dev < 2 ? "2 GPUs needed" : err);
    } else {
        for (int32_t n_tp = 2; n_tp <= g_n_dev; n_tp *= 2) test_instance(n_tp);
    }
    pd_backend_destroy(g_cpu);
    return pd_test_result("test_cuda_tpkv");
}
