/* kvt_pool.c -- KV block pools: layout checks and fingerprints, memory registration (the
 * caller's regions or a UCX allocation), and the descriptor a receiver exports (signed when
 * the ctx has a secret; kvt_desc.c parses it on the sender). */
#include "kvtransfer/kvt_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH64_state_t on the stack */
#include <xxhash.h>

#include "common/error.h"
#include "common/log.h"

kvt_pool_params kvt_pool_default_params(void)
{
    kvt_pool_params p;
    memset(&p, 0, sizeof p);
    p.layout.dtype = PD_DTYPE_BF16;
    p.layout.block_size = 16;
    p.mem_type = KVT_MEM_HOST;
    return p;
}

/* kvt_layout_block_bytes and kvt_layout_fingerprint live in kvt_desc.c (UCX-free). */

static void le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

uint64_t kvt__meta_sum(uint64_t req_id, uint64_t pool_id, int32_t n_layers, size_t bb,
                       int32_t n, const int32_t *dst)
{
    XXH64_state_t st;
    XXH64_reset(&st, 0x6d657461);
    uint64_t hdr[4] = {req_id, pool_id, (uint64_t)n_layers, (uint64_t)bb};
    XXH64_update(&st, hdr, sizeof hdr);
    XXH64_update(&st, &n, sizeof n);
    XXH64_update(&st, dst, sizeof *dst * (size_t)n);
    return XXH64_digest(&st);
}

uint64_t kvt__layer_sum(const kvt_pool *pool, int32_t layer, int32_t n, const int32_t *ids)
{
    XXH3_state_t *st = XXH3_createState();
    if (!st) return 0;
    XXH3_64bits_reset(st);
    for (int kv = 0; kv < 2; kv++) {
        const uint8_t *base = pool->base[2 * layer + kv];
        for (int32_t i = 0; i < n; i++) XXH3_64bits_update(st, base + (size_t)ids[i] * pool->bb, pool->bb);
    }
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
}

uint64_t kvt__data_sum(const uint64_t *layer_sums, int32_t n_layers)
{
    return XXH3_64bits(layer_sums, sizeof *layer_sums * (size_t)n_layers);
}

kvt_pool *kvt__pool_find(kvt_ctx *ctx, uint64_t pool_id)
{
    for (kvt__list *it = ctx->pools.next; it != &ctx->pools; it = it->next) {
        kvt_pool *p = KVT_CONTAINER(it, kvt_pool, link);
        if (p->id == pool_id) return p;
    }
    return NULL;
}

/* ---------------------------------------------------------------- create / destroy */

static int map_mem(kvt_pool *pool, void *addr, size_t len, bool allocate, ucp_mem_h *mh,
                   char *err)
{
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = addr,
        .length = len,
    };
    if (allocate) {
        mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
        mp.flags = UCP_MEM_MAP_ALLOCATE;
    }
    if (pool->mem_type == KVT_MEM_CUDA) {
        mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        mp.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    ucs_status_t st = ucp_mem_map(pool->ctx->uctx, &mp, mh);
    if (st != UCS_OK)
        return pd_errf(err, st == UCS_ERR_NO_MEMORY ? PD_ENOMEM : PD_EIO,
                       "kvt: ucp_mem_map of %zu bytes: %s", len, ucs_status_string(st));
    return 0;
}

static int cmp_region(const void *a, const void *b, void *arg)
{
    uint8_t **base = arg;
    uintptr_t x = (uintptr_t)base[*(const int *)a], y = (uintptr_t)base[*(const int *)b];
    return x < y ? -1 : x > y;
}

/* Registers the caller's regions, one memory handle per run of adjacent regions. */
static int map_user_regions(kvt_pool *pool, char *err)
{
    int nr = 2 * pool->n_layers;
    size_t rlen = (size_t)pool->n_blocks * pool->bb;
    int *order = malloc(sizeof *order * (size_t)nr);
    pool->mh = calloc((size_t)nr, sizeof *pool->mh);
    if (!order || !pool->mh) {
        free(order);
        return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    }
    for (int i = 0; i < nr; i++) order[i] = i;
    qsort_r(order, (size_t)nr, sizeof *order, cmp_region, pool->base);
    int rc = 0;
    for (int i = 0; i < nr;) {
        uint8_t *start = pool->base[order[i]];
        int j = i + 1;
        while (j < nr && pool->base[order[j]] == pool->base[order[j - 1]] + rlen) j++;
        if (j < nr && pool->base[order[j]] < pool->base[order[j - 1]] + rlen) {
            rc = pd_errf(err, PD_EINVAL, "kvt: pool regions overlap");
            break;
        }
        if ((rc = map_mem(pool, start, (size_t)(j - i) * rlen, false, &pool->mh[pool->n_mh],
                          err)) < 0)
            break;
        for (int k = i; k < j; k++) pool->region_mh[order[k]] = pool->n_mh;
        pool->n_mh++;
        i = j;
    }
    free(order);
    return rc;
}

static int check_layout(const kvt_layout *l, char *err)
{
    if (!memchr(l->model_id, 0, sizeof l->model_id))
        return pd_errf(err, PD_EINVAL, "kvt: layout model_id is not NUL-terminated");
    if (l->n_layers <= 0 || l->n_layers > 4096 || l->block_size <= 0 || l->n_kv_heads <= 0 ||
        l->head_dim <= 0 || (int)l->dtype < 0 || l->dtype > PD_DTYPE_F8E4M3)
        return pd_errf(err, PD_EINVAL, "kvt: bad layout (layers %d, block size %d, kv heads %d, "
                       "head dim %d, dtype %d)", l->n_layers, l->block_size, l->n_kv_heads,
                       l->head_dim, (int)l->dtype);
    return 0;
}

int32_t kvt_stage_slot_blocks(size_t block_bytes)
{
    size_t n = block_bytes ? (size_t)(1u << 20) / block_bytes : 1;
    return n < 1 ? 1 : n > KVT_MAX_IOV ? KVT_MAX_IOV : (int32_t)n;
}

int32_t kvt__ring_get(kvt_pool *pool)
{
    return pool->ring_n_free > 0 ? pool->ring_free[--pool->ring_n_free] : -1;
}

void kvt__ring_put(kvt_pool *pool, int32_t slot)
{
    PD_ASSERT(slot >= 0 && slot < pool->ring_n && pool->ring_n_free < pool->ring_n,
              "kvt: ring slot returned twice");
    pool->ring_free[pool->ring_n_free++] = slot;
}

void kvt_pool_ring(const kvt_pool *pool, int32_t *n_slots, int32_t *n_free)
{
    if (n_slots) *n_slots = pool->staged ? pool->ring_n : 0;
    if (n_free) *n_free = pool->staged ? pool->ring_n_free : 0;
}

/* A staged pool's ring: page-aligned host memory, pinned by the device engine when it can,
 * registered with UCX (rendezvous data lands in it and leaves from it zero-copy). */
static int ring_create(kvt_pool *pool, size_t bytes, char *err)
{
    kvt_ctx *ctx = pool->ctx;
    pool->ring_blocks = kvt_stage_slot_blocks(pool->bb);
    pool->ring_slot = (size_t)pool->ring_blocks * pool->bb;
    size_t n = (bytes ? bytes : (size_t)256 << 20) / pool->ring_slot;
    if (n < 4) n = 4;
    if (n > 1u << 20) return pd_errf(err, PD_EINVAL, "kvt: staging ring of %zu slots", n);
    pool->ring_n = (int32_t)n;
    size_t len = n * pool->ring_slot;
    pool->ring_free = malloc(sizeof *pool->ring_free * n);
    if (!pool->ring_free || posix_memalign((void **)&pool->ring, 4096, len) != 0) {
        pool->ring = NULL;
        return pd_errf(err, PD_ENOMEM, "kvt: cannot allocate a staging ring of %.1f MiB",
                       (double)len / 1048576.0);
    }
    memset(pool->ring, 0, len);
    for (size_t i = 0; i < n; i++) pool->ring_free[i] = (int32_t)(n - 1 - i);
    pool->ring_n_free = (int32_t)n;
    if (ctx->device.host_pin) {
        if (ctx->device.host_pin(ctx->device.arg, pool->ring, len) == 0) pool->ring_pinned = true;
        else PD_LOGW("kvt[%s]: cannot pin the staging ring; device copies go through pageable "
                     "memory", ctx->name);
    }
    int rc = map_mem(pool, pool->ring, len, false, &pool->ring_mh, err);
    if (rc < 0) pool->ring_mh = NULL;
    return rc;
}

static void ring_destroy(kvt_pool *pool)
{
    kvt_ctx *ctx = pool->ctx;
    if (pool->ring_mh) ucp_mem_unmap(ctx->uctx, pool->ring_mh);
    if (pool->ring_pinned) ctx->device.host_unpin(ctx->device.arg, pool->ring);
    free(pool->ring);
    free(pool->ring_free);
}

int kvt_pool_create(kvt_ctx *ctx, const kvt_pool_params *p, kvt_pool **out, char *err)
{
    *out = NULL;
    int rc = check_layout(&p->layout, err);
    if (rc < 0) return rc;
    if (p->n_blocks <= 0 || (!p->k_base) != (!p->v_base))
        return pd_errf(err, PD_EINVAL, "kvt: pool needs n_blocks > 0 and both or neither of "
                       "k_base / v_base");
    if (p->staged && (p->k_base || p->mem_type != KVT_MEM_HOST))
        return pd_errf(err, PD_EINVAL, "kvt: a staged pool has no regions of its own");
    if (p->staged && (!ctx->device.stage_out || !ctx->device.stage_in))
        return pd_errf(err, PD_EINVAL, "kvt: a staged pool needs kvt_params.device with "
                       "stage_out and stage_in");
    if (p->mem_type == KVT_MEM_CUDA && !(ctx->mem_types & (1u << KVT_MEM_CUDA)))
        return pd_errf(err, PD_EUNSUPPORTED, "kvt: this UCX cannot access CUDA memory; hand in "
                       "pinned host staging buffers instead");
    if (p->mem_type != KVT_MEM_HOST && p->mem_type != KVT_MEM_CUDA)
        return pd_errf(err, PD_EINVAL, "kvt: bad memory type %d", (int)p->mem_type);
    kvt_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    pool->ctx = ctx;
    pool->id = ctx->next_pool_id++;
    pool->layout = p->layout;
    pool->fingerprint = kvt_layout_fingerprint(&p->layout);
    pool->n_layers = p->layout.n_layers;
    pool->n_blocks = p->n_blocks;
    pool->bb = kvt_layout_block_bytes(&p->layout);
    pool->mem_type = p->mem_type;
    if (p->device_export) {
        if (p->device_export_len == 0 || p->device_export_len > KVT_DESC_MAX_DEVICE ||
            !(pool->dev_export = malloc(p->device_export_len))) {
            free(pool);
            return pd_errf(err, PD_EINVAL, "kvt: device export of %zu bytes (1..%d)",
                           p->device_export_len, KVT_DESC_MAX_DEVICE);
        }
        memcpy(pool->dev_export, p->device_export, p->device_export_len);
        pool->dev_export_len = p->device_export_len;
    }
    kvt__list_init(&pool->resvs);
    kvt__list_init(&pool->link);
    kvt__list_init(&pool->pending);
    pool->staged = p->staged;
    int nr = 2 * pool->n_layers;
    pool->base = calloc((size_t)nr, sizeof *pool->base);
    pool->region_mh = calloc((size_t)nr, sizeof *pool->region_mh);
    pool->slot_busy = calloc((size_t)pool->n_blocks, 1);
    if (!pool->base || !pool->region_mh || !pool->slot_busy) {
        rc = pd_errf(err, PD_ENOMEM, "kvt: out of memory");
        goto fail;
    }
    pool->n_free = pool->n_blocks;
    size_t rlen = (size_t)pool->n_blocks * pool->bb;
    if (p->staged) {
        if ((rc = ring_create(pool, p->stage_ring_bytes, err)) < 0) goto fail;
        kvt__list_add(&ctx->pools, &pool->link);
        PD_LOGI("kvt[%s]: pool %016llx: %d layers x %d blocks x %zu B (K and V) in device "
                "memory, staged through a ring of %d x %.2f MiB %shost slots (%.1f MiB)",
                ctx->name, (unsigned long long)pool->id, pool->n_layers, pool->n_blocks,
                pool->bb, pool->ring_n, (double)pool->ring_slot / 1048576.0,
                pool->ring_pinned ? "pinned " : "",
                (double)pool->ring_slot * pool->ring_n / 1048576.0);
        *out = pool;
        return 0;
    }
    if (p->k_base) {
        for (int l = 0; l < pool->n_layers; l++) {
            pool->base[2 * l] = p->k_base[l];
            pool->base[2 * l + 1] = p->v_base[l];
            if (!p->k_base[l] || !p->v_base[l]) {
                rc = pd_errf(err, PD_EINVAL, "kvt: region of layer %d is NULL", l);
                goto fail;
            }
        }
        if ((rc = map_user_regions(pool, err)) < 0) goto fail;
    } else {
        pool->mh = calloc(1, sizeof *pool->mh);
        if (!pool->mh) {
            rc = pd_errf(err, PD_ENOMEM, "kvt: out of memory");
            goto fail;
        }
        if ((rc = map_mem(pool, NULL, rlen * (size_t)nr, true, &pool->mh[0], err)) < 0) goto fail;
        pool->n_mh = 1;
        pool->allocated = true;
        ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
        ucs_status_t st = ucp_mem_query(pool->mh[0], &ma);
        if (st != UCS_OK) {
            rc = pd_errf(err, PD_EIO, "kvt: ucp_mem_query: %s", ucs_status_string(st));
            goto fail;
        }
        for (int r = 0; r < nr; r++) pool->base[r] = (uint8_t *)ma.address + (size_t)r * rlen;
        /* Fault the pages in here rather than in the first transfer. */
        if (pool->mem_type == KVT_MEM_HOST) memset(ma.address, 0, rlen * (size_t)nr);
        /* UCX allocates from the first memory domain that can (sysv, then posix, by
         * default), so with a shm transport loaded the pool is a shm segment. */
        pool->shm_backed = ctx->has_shm && pool->mem_type == KVT_MEM_HOST;
    }
    kvt__list_add(&ctx->pools, &pool->link);
    PD_LOGI("kvt[%s]: pool %016llx: %d layers x %d blocks x %zu B (K and V), %.1f MiB, %s%s",
            ctx->name, (unsigned long long)pool->id, pool->n_layers, pool->n_blocks, pool->bb,
            (double)rlen * nr / 1048576.0, pool->allocated ? "allocated by UCX" : "caller memory",
            pool->shm_backed ? " (shm: one-sided puts)" : "");
    *out = pool;
    return 0;
fail:
    for (int i = 0; i < pool->n_mh; i++) ucp_mem_unmap(ctx->uctx, pool->mh[i]);
    if (pool->staged) ring_destroy(pool);
    free(pool->mh);
    free(pool->base);
    free(pool->region_mh);
    free(pool->slot_busy);
    free(pool->dev_export);
    free(pool);
    return rc;
}

static bool pool_busy(kvt_pool *pool)
{
    if (pool->n_resv > 0) return true;
    kvt_ctx *ctx = pool->ctx;
    for (kvt__list *it = ctx->sends.next; it != &ctx->sends; it = it->next) {
        kvt_send *s = KVT_CONTAINER(it, kvt_send, link);
        if (s->t && s->t->src == pool && (s->inflight > 0 || s->state < KVT_SEND_ENDING))
            return true;
    }
    return false;
}

void kvt_pool_destroy(kvt_pool *pool)
{
    if (!pool) return;
    kvt_ctx *ctx = pool->ctx;
    kvt__list *it, *nx;
    if (!ctx->destroying) {
        KVT_LIST_EACH_SAFE(it, nx, &pool->resvs)
        {
            kvt__resv *r = KVT_CONTAINER(it, kvt__resv, link);
            if (r->state == KVT_RESV_HELD) kvt__resv_free(r);
            else kvt__resv_fail(r, PD_ECANCELED, true, "landing pool destroyed");
        }
        KVT_LIST_EACH_SAFE(it, nx, &ctx->sends)
        {
            kvt_send *s = KVT_CONTAINER(it, kvt_send, link);
            if (s->t && s->t->src == pool && s->state < KVT_SEND_ENDING)
                kvt__send_fail(s, PD_ECANCELED, true, "source pool destroyed");
        }
        /* Wait (progressing, so events are delivered) until no UCX operation touches the
         * memory. Peers that hold operations up are force-closed, which completes them; as a
         * last resort the requests are released. */
        int64_t soft = kvt__now_ns() + (int64_t)ctx->p.deadline_min_ms * 1000000ll;
        int64_t hard = soft + 5000000000ll;
        while (pool_busy(pool) && kvt__now_ns() < hard) {
            kvt_wait(ctx, 10);
            if (kvt__now_ns() > soft) kvt__peers_close_all(ctx), soft = hard;
        }
        if (pool_busy(pool)) {
            PD_LOGE("kvt[%s]: operations on pool %016llx did not finish; releasing them",
                    ctx->name, (unsigned long long)pool->id);
            kvt__ops_release(ctx, pool);
            kvt_progress(ctx);
        }
    }
    kvt__pending_drop_all(pool);
    while (!kvt__list_empty(&pool->resvs))
        kvt__resv_free(KVT_CONTAINER(pool->resvs.next, kvt__resv, link));
    KVT_LIST_EACH_SAFE(it, nx, &ctx->targets)
    {
        kvt_target *t = KVT_CONTAINER(it, kvt_target, link);
        if (t->src == pool) {
            t->src->src_refs--;
            t->src = NULL;
            kvt__target_uncache(t); /* may free it */
        }
    }
    kvt__list_del(&pool->link);
    for (int i = 0; i < pool->n_mh; i++) ucp_mem_unmap(ctx->uctx, pool->mh[i]);
    if (pool->staged) ring_destroy(pool);
    free(pool->mh);
    free(pool->base);
    free(pool->region_mh);
    free(pool->slot_busy);
    free(pool->dev_export);
    free(pool);
}

void *kvt_pool_region(const kvt_pool *pool, int32_t layer, int kv)
{
    if (pool->staged || layer < 0 || layer >= pool->n_layers || kv < 0 || kv > 1) return NULL;
    return pool->base[2 * layer + kv];
}
int32_t kvt_pool_n_blocks(const kvt_pool *pool) { return pool->n_blocks; }
size_t kvt_pool_block_bytes(const kvt_pool *pool) { return pool->bb; }
const kvt_layout *kvt_pool_layout(const kvt_pool *pool) { return &pool->layout; }
int32_t kvt_pool_n_free(const kvt_pool *pool) { return pool->n_free; }
int32_t kvt_pool_n_reservations(const kvt_pool *pool) { return pool->n_resv; }
bool kvt_pool_shm_backed(const kvt_pool *pool) { return pool->shm_backed; }

/* ---------------------------------------------------------------- descriptor */

typedef struct {
    uint8_t *p;
    size_t len, cap;
    bool oom;
} wbuf;

static void put_bytes(wbuf *b, const void *src, size_t n)
{
    if (b->oom) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap < b->len + n) cap *= 2;
        uint8_t *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}
static void put_u32(wbuf *b, uint32_t v)
{
    uint8_t x[4];
    le32(x, v);
    put_bytes(b, x, 4);
}
static void put_u64(wbuf *b, uint64_t v)
{
    put_u32(b, (uint32_t)v);
    put_u32(b, (uint32_t)(v >> 32));
}

int kvt_pool_export(kvt_pool *pool, void **desc, size_t *len, char *err)
{
    kvt_ctx *ctx = pool->ctx;
    *desc = NULL;
    *len = 0;
    wbuf b = {0};
    put_u32(&b, KVT_DESC_MAGIC);
    uint32_t flags = (pool->allocated ? KVT_DESC_ALLOCATED : 0) |
                     (pool->mem_type == KVT_MEM_CUDA ? KVT_DESC_CUDA : 0) |
                     (ctx->secret ? KVT_DESC_SIGNED : 0) |
                     (pool->dev_export ? KVT_DESC_DEVICE : 0) |
                     (pool->staged ? KVT_DESC_STAGED : 0);
    put_u32(&b, KVT_DESC_VERSION | flags << 16);
    put_u64(&b, ctx->id);
    put_u64(&b, pool->id);
    char boot[40] = {0};
    memcpy(boot, ctx->boot_id, sizeof boot);
    put_bytes(&b, boot, sizeof boot);
    put_bytes(&b, pool->layout.model_id, sizeof pool->layout.model_id);
    put_u32(&b, (uint32_t)pool->layout.dtype);
    put_u32(&b, (uint32_t)pool->layout.n_layers);
    put_u32(&b, (uint32_t)pool->layout.block_size);
    put_u32(&b, (uint32_t)pool->layout.n_kv_heads);
    put_u32(&b, (uint32_t)pool->layout.head_dim);
    put_u64(&b, pool->fingerprint);
    put_u32(&b, (uint32_t)pool->n_blocks);
    put_u64(&b, pool->bb);
    put_u32(&b, (uint32_t)ctx->addr_len);
    put_bytes(&b, ctx->addr, ctx->addr_len);
    put_u32(&b, (uint32_t)pool->n_mh);
    for (int i = 0; i < pool->n_mh; i++) {
        void *rk = NULL;
        size_t rkl = 0;
        ucs_status_t st = ucp_rkey_pack(ctx->uctx, pool->mh[i], &rk, &rkl);
        if (st != UCS_OK) {
            free(b.p);
            return pd_errf(err, PD_EIO, "kvt: ucp_rkey_pack: %s", ucs_status_string(st));
        }
        put_u32(&b, (uint32_t)rkl);
        put_bytes(&b, rk, rkl);
        ucp_rkey_buffer_release(rk);
    }
    for (int r = 0; !pool->staged && r < 2 * pool->n_layers; r++) { /* staged: no regions */
        put_u64(&b, (uint64_t)(uintptr_t)pool->base[r]);
        put_u32(&b, (uint32_t)pool->region_mh[r]);
    }
    if (pool->dev_export) {
        put_u32(&b, (uint32_t)pool->dev_export_len);
        put_bytes(&b, pool->dev_export, pool->dev_export_len);
    }
    if (!b.oom && ctx->secret) {
        /* Signed: the prefill side verifies the MAC before it reads anything else. */
        uint8_t mac[KVT_MAC_LEN];
        if (kvt__desc_mac(ctx->secret, b.p, b.len, mac) < 0) {
            free(b.p);
            return pd_errf(err, PD_EIO, "kvt: HMAC-SHA256 of the descriptor failed");
        }
        put_bytes(&b, mac, sizeof mac);
    }
    if (!b.oom) put_u64(&b, XXH64(b.p, b.len, 0));
    if (b.oom) {
        free(b.p);
        return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    }
    *desc = b.p;
    *len = b.len;
    return 0;
}
