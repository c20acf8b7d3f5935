/* svc_kvdev.c -- kvtransfer's device path over the backend's dev_* / copyq ops (see svc.h):
 * the decode side's export of its device KV cache, and the prefill side's copy engine
 * (kvt_device_ops) that maps an export and copies each layer's K and V blocks into it on a
 * copy stream, ordered after the layer's event; and the staged pool's copies between the
 * cache and the ring's host slots, which on a tensor-parallel instance gather every rank's
 * KV heads into the whole layout and scatter them back, each rank on its own backend and
 * copy queue (copyq_rows), ordered after that rank's own event of the layer.
 *
 * Export format (little-endian, checked field by field before the backend sees a byte):
 *   u32 magic "PDKX" | u32 version 1 | u8 handle[PD_DEV_EXPORT_BYTES] | char bus_id[32]
 *   | u64 allocation bytes | u64 block bytes | u32 n_blocks | u32 n_layers
 *   | n_layers x (u64 K offset | u64 V offset) from the allocation's base. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/log.h"
#include "svc/svc.h"

#define KX_MAGIC 0x584b4450u /* "PDKX" */
#define KX_VERSION 1u
#define KX_HEAD (8 + PD_DEV_EXPORT_BYTES + PD_BUS_ID_LEN + 8 + 8 + 4 + 4)

/* Bytes of one block of one region (K or V of a layer). */
static size_t block_bytes(const svc_model *m)
{
    kvt_layout l;
    svc_kv_layout(m, &l);
    return kvt_layout_block_bytes(&l);
}

extern const char *svc__kv_transport;

typedef struct {
    svc_model *m;
    void *copyq[KVT_TP_MAX]; /* rank r's copy queue (on its backend), made on the kvt thread
                              * at first use; [0] the only one of a single-rank instance */
    kvt_device_ops ops;
} kvdev;

/* A tensor-parallel instance's handles (a layer's readiness, a slot's copies): one event a
 * rank, rank r's of its own backend (NULL: nothing on that rank), shared by refs holders. A
 * single-rank instance's handles are its backend's events themselves. */
typedef struct {
    atomic_int refs;
    int32_t n;       /* ranks */
    void *ev[];      /* [n] */
} kx_set;

typedef struct {
    void *base;      /* the peer's allocation, mapped here */
    int32_t n_layers;
    uint64_t *off;   /* [2 n_layers] region offsets from base */
} kvdev_remote;

static uint64_t rd64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static uint32_t rd32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static void wr64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void wr32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

bool svc_kv_stage_ops(const svc_model *m)
{
    const pd_backend_ops *o = m->be->ops;
    return o->event_record && o->event_query && o->event_release && o->copyq_create &&
           o->copyq_destroy && o->copyq_blocks && (mr_n_ranks(m->runner) == 1 || o->copyq_rows);
}

/* ---- tensor parallelism's handles ---- */

static bool is_tp(const svc_model *m) { return mr_n_ranks(m->runner) > 1; }

static kx_set *set_new(int32_t n)
{
    kx_set *s = calloc(1, sizeof *s + (size_t)n * sizeof(void *));
    if (!s) return NULL;
    atomic_init(&s->refs, 1);
    s->n = n;
    return s;
}

/* 1 when every rank's event has happened, 0 while one has not, < 0 when one failed. */
static int set_poll(const svc_model *m, const kx_set *s)
{
    for (int32_t r = 0; r < s->n; r++) {
        if (!s->ev[r]) continue;
        const pd_backend *b = m->tp->be[r];
        int rc = b->ops->event_query(b->ctx, s->ev[r]);
        if (rc != 1) return rc;
    }
    return 1;
}

static void set_unref(const svc_model *m, kx_set *s)
{
    if (atomic_fetch_sub(&s->refs, 1) != 1) return;
    for (int32_t r = 0; r < s->n; r++)
        if (s->ev[r]) m->tp->be[r]->ops->event_release(m->tp->be[r]->ctx, s->ev[r]);
    free(s);
}

/* Waits until a set's copies are over (complete or failed): a slot whose copies failed on
 * one rank is reused only after the other ranks' copies stopped touching it. */
static void set_wait(const svc_model *m, const kx_set *s)
{
    while (set_poll(m, s) == 0) {
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

int svc_kv_layer_ready(svc_model *m, int32_t layer, int32_t n, void **after)
{
    for (int32_t i = 0; i < n; i++) after[i] = NULL;
    if (n < 1) return 0;
    const pd_backend_ops *o = m->be->ops;
    if (!is_tp(m)) {
        int32_t bad = 0;
        for (int32_t i = 0; i < n; i++)
            if (o->event_record(m->be->ctx, &after[i]) < 0) {
                after[i] = NULL;
                bad++;
            }
        if (bad) PD_LOGE("KV transfer: cannot record layer %d's event", layer);
        return bad;
    }
    /* every rank's own event, recorded on its thread after its store (mr_layer_events) */
    kx_set *s = set_new(mr_n_ranks(m->runner));
    if (!s || mr_layer_events(m->runner, layer, s->ev) < 0) {
        PD_LOGE("KV transfer: layer %d's events are missing on a tensor-parallel rank", layer);
        free(s);
        return n;
    }
    atomic_store(&s->refs, n);
    for (int32_t i = 0; i < n; i++) after[i] = s;
    return 0;
}

void svc_kv_ready_release(svc_model *m, void *h)
{
    if (!h) return;
    if (is_tp(m)) set_unref(m, h);
    else m->be->ops->event_release(m->be->ctx, h);
}

bool svc_kv_device_on(const svc_model *m)
{
    const pd_backend_ops *o = m->be->ops;
    /* a tensor-parallel instance's heads are on several devices: the staged path only */
    return mr_n_ranks(m->runner) == 1 && svc_kv_stage_ops(m) && o->dev_export && o->dev_open && o->dev_close &&
           strcmp(svc__kv_transport, "host") != 0;
}

int svc_kv_device_export(const svc_model *m, void **blob, size_t *len, char *err)
{
    *blob = NULL;
    *len = 0;
    if (!svc_kv_device_on(m)) return 0;
    const int32_t L = m->cfg.n_layers;
    void *base;
    size_t bytes;
    mr_kv_pool(m->runner, &base, &bytes);
    uint8_t *b = calloc(1, KX_HEAD + (size_t)L * 16);
    if (!b) return pd_errf(err, PD_ENOMEM, "out of memory");
    char bus[PD_BUS_ID_LEN] = "";
    int rc = m->be->ops->dev_export(m->be->ctx, base, b + 8, bus);
    if (rc < 0) {
        free(b);
        return pd_errf(err, rc, "cannot export the KV cache for device-to-device transfer");
    }
    wr32(b, KX_MAGIC);
    wr32(b + 4, KX_VERSION);
    memcpy(b + 8 + PD_DEV_EXPORT_BYTES, bus, PD_BUS_ID_LEN);
    uint8_t *q = b + 8 + PD_DEV_EXPORT_BYTES + PD_BUS_ID_LEN;
    wr64(q, bytes);
    wr64(q + 8, (uint64_t)block_bytes(m));
    wr32(q + 16, (uint32_t)mr_n_blocks(m->runner));
    wr32(q + 20, (uint32_t)L);
    for (int32_t l = 0; l < L; l++) {
        void *k, *v;
        mr_kv_cache(m->runner, l, &k, &v);
        wr64(b + KX_HEAD + (size_t)l * 16, (uint64_t)((uint8_t *)k - (uint8_t *)base));
        wr64(b + KX_HEAD + (size_t)l * 16 + 8, (uint64_t)((uint8_t *)v - (uint8_t *)base));
    }
    PD_LOGI("KV device path: the KV cache (%.1f MiB on GPU %s) is exported for device-to-device "
            "transfer", (double)bytes / 1048576.0, bus);
    *blob = b;
    *len = KX_HEAD + (size_t)L * 16;
    return 0;
}

/* ---- the sender's engine (kvt thread) ---- */

static int kx_open(void *arg, const void *blobv, size_t len, void **remote, char *err)
{
    kvdev *d = arg;
    svc_model *m = d->m;
    const uint8_t *b = blobv;
    const int32_t L = m->cfg.n_layers;
    const uint64_t bb = (uint64_t)block_bytes(m);
    if (len < KX_HEAD || rd32(b) != KX_MAGIC || rd32(b + 4) != KX_VERSION)
        return pd_errf(err, PD_EFORMAT, "not a device export of this version");
    const uint8_t *q = b + 8 + PD_DEV_EXPORT_BYTES + PD_BUS_ID_LEN;
    uint64_t bytes = rd64(q), xbb = rd64(q + 8);
    uint32_t nb = rd32(q + 16), nl = rd32(q + 20);
    if (nl != (uint32_t)L || len != KX_HEAD + (size_t)L * 16 || xbb != bb || nb == 0)
        return pd_errf(err, PD_EFORMAT, "device export of %u layers, %llu-byte blocks does not "
                       "match this model (%d layers, %llu-byte blocks)", nl,
                       (unsigned long long)xbb, L, (unsigned long long)bb);
    char bus[PD_BUS_ID_LEN];
    memcpy(bus, b + 8 + PD_DEV_EXPORT_BYTES, PD_BUS_ID_LEN);
    if (!memchr(bus, 0, PD_BUS_ID_LEN)) return pd_errf(err, PD_EFORMAT, "bad bus id");
    kvdev_remote *r = calloc(1, sizeof *r);
    uint64_t *off = calloc((size_t)(2 * L), sizeof *off);
    if (!r || !off) {
        free(r);
        free(off);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    const uint64_t region = bb * nb;
    for (int32_t i = 0; i < 2 * L; i++) {
        off[i] = rd64(b + KX_HEAD + (size_t)i * 8);
        if (off[i] > bytes || bytes - off[i] < region) {
            free(r);
            free(off);
            return pd_errf(err, PD_EFORMAT, "device export: region %d outside the allocation", i);
        }
    }
    int rc = m->be->ops->dev_open(m->be->ctx, b + 8, bus, &r->base, err);
    if (rc < 0) {
        free(r);
        free(off);
        return rc;
    }
    r->n_layers = L;
    r->off = off;
    PD_LOGI("KV device path: mapped the decode KV cache on GPU %s (%.1f MiB)", bus,
            (double)bytes / 1048576.0);
    *remote = r;
    return 0;
}

static void kx_close(void *arg, void *remote)
{
    kvdev *d = arg;
    kvdev_remote *r = remote;
    if (!r) return;
    d->m->be->ops->dev_close(d->m->be->ctx, r->base);
    free(r->off);
    free(r);
}

/* Rank r's copy queue, on its backend (made on the kvt thread at first use). */
static int kx_queue(kvdev *d, int32_t r)
{
    const pd_backend *b = d->m->tp->be[r];
    return d->copyq[r] ? 0 : b->ops->copyq_create(b->ctx, &d->copyq[r]);
}

static int kx_copy(void *arg, void *remote, int32_t layer, const int32_t *src_ids,
                   const int32_t *dst_ids, int32_t n, void *after, void **token)
{
    kvdev *d = arg;
    kvdev_remote *r = remote;
    svc_model *m = d->m;
    const pd_backend_ops *o = m->be->ops;
    if (layer < 0 || layer >= r->n_layers) return PD_EINVAL;
    int rc = kx_queue(d, 0);
    if (rc < 0) return rc;
    void *k, *v;
    mr_kv_cache(m->runner, layer, &k, &v);
    void *dst[2] = {(uint8_t *)r->base + r->off[2 * layer], (uint8_t *)r->base + r->off[2 * layer + 1]};
    const void *src[2] = {k, v};
    return o->copyq_blocks(m->be->ctx, d->copyq[0], after, dst, src, 2, dst_ids, src_ids, n,
                           block_bytes(m), token);
}

/* Staged pools: a run of blocks of one region between the KV cache and a contiguous host
 * slot (positions 0..n-1 of the slot), on the same copy queue. */
static const int32_t g_iota[64] = {
    0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
    22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
    44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};

pd_copy_rows svc_kv_tp_rows(const kvt_tp_part *p, void *region, const int32_t *ids, void *slot,
                            int32_t n, bool gather)
{
    if (n > 64) n = -1; /* more than a slot: the op refuses it (PD_EINVAL) */
    /* the gather: from the rank's blocks ids[i] into whole block i of the slot */
    pd_copy_rows a = {.dst = slot, .src = region, .dst_ids = g_iota, .src_ids = ids, .n = n,
                      .rows = p->rows, .row_bytes = p->row_bytes,
                      .dst_block_bytes = p->whole_block_bytes,
                      .src_block_bytes = p->rank_block_bytes, .dst_pitch = p->whole_pitch,
                      .src_pitch = p->row_bytes, .dst_offset = p->whole_offset};
    if (gather) return a;
    /* the scatter: the same copy the other way */
    return (pd_copy_rows){.dst = region, .src = slot, .dst_ids = ids, .src_ids = g_iota, .n = n,
                          .rows = a.rows, .row_bytes = a.row_bytes,
                          .dst_block_bytes = a.src_block_bytes,
                          .src_block_bytes = a.dst_block_bytes, .dst_pitch = a.src_pitch,
                          .src_pitch = a.dst_pitch, .src_offset = a.dst_offset};
}

/* A tensor-parallel instance's slot: blocks ids[0..n) of layer's K or V between every rank's
 * heads and the whole-layout slot at host (block i at host + i * whole block bytes). Each
 * rank copies its heads (block_size runs of its heads' bytes, at the whole row's pitch from
 * its first head) on its own backend and copy queue, ordered after its own event of the
 * layer (after->ev[r], the handle svc_kv_layer_ready made; NULL: the KV is final, as after a
 * forward returned). The gather reads a replicated head from the first rank holding it; the
 * scatter writes every replica. *token: the ranks' copies' events. */
static int kx_stage_tp(kvdev *d, int32_t layer, int kv, const int32_t *ids, int32_t n,
                       const kx_set *after, void *host, bool out, void **token)
{
    svc_model *m = d->m;
    const int32_t nr = mr_n_ranks(m->runner), nb = mr_n_blocks(m->runner);
    kvt_layout l;
    svc_kv_layout(m, &l);
    if (nr > KVT_TP_MAX || (after && after->n != nr)) return PD_EINVAL;
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= nb) return PD_EINVAL;
    kx_set *done = set_new(nr);
    if (!done) return PD_ENOMEM;
    int rc = 0;
    for (int32_t r = 0; r < nr && rc == 0; r++) {
        kvt_tp_part p;
        if ((rc = kvt_tp_part_of(&l, nr, r, &p)) < 0) break;
        if (out && !p.gathered) continue; /* a replica: the first one is read */
        if ((rc = kx_queue(d, r)) < 0) break;
        void *c[2];
        mr_kv_cache_rank(m->runner, r, layer, &c[0], &c[1]);
        const pd_copy_rows a = svc_kv_tp_rows(&p, c[kv], ids, host, n, out);
        const pd_backend *b = m->tp->be[r];
        rc = b->ops->copyq_rows(b->ctx, d->copyq[r], after ? after->ev[r] : NULL, &a,
                                &done->ev[r]);
        if (rc < 0) done->ev[r] = NULL;
    }
    if (rc < 0) {
        set_wait(m, done); /* the ranks queued before: their copies end before the slot is free */
        set_unref(m, done);
        return rc;
    }
    *token = done;
    return 0;
}

static int kx_stage(kvdev *d, int32_t layer, int kv, const int32_t *ids, int32_t n, void *after,
                    void *host, bool out, void **token)
{
    svc_model *m = d->m;
    if (layer < 0 || layer >= m->cfg.n_layers || kv < 0 || kv > 1 || n < 1 || n > 64)
        return PD_EINVAL;
    if (is_tp(m)) return kx_stage_tp(d, layer, kv, ids, n, after, host, out, token);
    int rc = kx_queue(d, 0);
    if (rc < 0) return rc;
    void *cache[2];
    mr_kv_cache(m->runner, layer, &cache[0], &cache[1]);
    void *dst = out ? host : cache[kv];
    const void *src = out ? cache[kv] : host;
    return m->be->ops->copyq_blocks(m->be->ctx, d->copyq[0], after, &dst, &src, 1,
                                    out ? g_iota : ids, out ? ids : g_iota, n, block_bytes(m),
                                    token);
}

static int kx_stage_out(void *arg, int32_t layer, int kv, const int32_t *ids, int32_t n,
                        void *after, void *host, void **token)
{
    return kx_stage(arg, layer, kv, ids, n, after, host, true, token);
}

static int kx_stage_in(void *arg, int32_t layer, int kv, const int32_t *ids, int32_t n,
                       const void *host, void **token)
{
    return kx_stage(arg, layer, kv, ids, n, NULL, (void *)host, false, token);
}

static int kx_pin(void *arg, void *p, size_t bytes)
{
    kvdev *d = arg;
    return d->m->be->ops->host_register(d->m->be->ctx, p, bytes);
}

static void kx_unpin(void *arg, void *p)
{
    kvdev *d = arg;
    d->m->be->ops->host_unregister(d->m->be->ctx, p);
}

static int kx_poll(void *arg, void *token)
{
    kvdev *d = arg;
    if (is_tp(d->m)) return set_poll(d->m, token);
    return d->m->be->ops->event_query(d->m->be->ctx, token);
}

static void kx_release(void *arg, void *h)
{
    kvdev *d = arg;
    svc_kv_ready_release(d->m, h);
}

void svc_kv_device_params(svc_model *m, kvt_params *kp)
{
    bool path = svc_kv_device_on(m), staged = svc_kv_staged(m) && svc_kv_stage_ops(m);
    if (!path && !staged) return;
    kvdev *d = m->kvdev;
    if (!d) {
        d = calloc(1, sizeof *d);
        if (!d) return; /* (svc_kv_pool_create then fails: a staged pool needs the ops) */
        d->m = m;
        d->ops = (kvt_device_ops){.poll = kx_poll, .release = kx_release, .arg = d};
        if (path) d->ops.open = kx_open, d->ops.close = kx_close, d->ops.copy_layer = kx_copy;
        if (staged) d->ops.stage_out = kx_stage_out, d->ops.stage_in = kx_stage_in;
        if (m->be->ops->host_register && m->be->ops->host_unregister)
            d->ops.host_pin = kx_pin, d->ops.host_unpin = kx_unpin;
        m->kvdev = d;
    }
    kp->device = &d->ops;
    kp->device_required = !strcmp(svc__kv_transport, "device");
}

void svc_kv_device_free(svc_model *m)
{
    kvdev *d = m->kvdev;
    if (!d) return;
    for (int32_t r = 0; r < mr_n_ranks(m->runner) && r < KVT_TP_MAX; r++)
        if (d->copyq[r]) m->tp->be[r]->ops->copyq_destroy(m->tp->be[r]->ctx, d->copyq[r]);
    free(d);
    m->kvdev = NULL;
}
