/* kvt_recv.c -- The receiving (decode) side: slot reservations per request, the handlers of
 * the sender's messages (START, BLOCK, DONE, ABORT), zero-copy landing of active-message data
 * into the reserved slots, verification, the ACK, deadlines, and the release of every slot on
 * every failure path (only after the last receive into it has finished). */
#include "kvtransfer/kvt_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"

kvt_recv_params kvt_recv_default_params(void)
{
    kvt_recv_params p;
    memset(&p, 0, sizeof p);
    return p;
}

kvt__resv *kvt__resv_find(kvt_pool *pool, uint64_t req_id)
{
    for (kvt__list *it = pool->resvs.next; it != &pool->resvs; it = it->next) {
        kvt__resv *r = KVT_CONTAINER(it, kvt__resv, link);
        if (r->req_id == req_id) return r;
    }
    return NULL;
}

static void mark_dirty(kvt__resv *r)
{
    if (kvt__list_empty(&r->dirty)) kvt__list_add(&r->pool->ctx->dirty_resvs, &r->dirty);
}

/* Describes who holds a slot, for the error of a conflicting reservation. */
static int slot_conflict(kvt_pool *pool, const int32_t *ids, int32_t i, char *err)
{
    for (int32_t j = 0; j < i; j++)
        if (ids[j] == ids[i])
            return pd_errf(err, PD_EINVAL, "kvt: block %d appears twice in the list", ids[i]);
    for (kvt__list *it = pool->resvs.next; it != &pool->resvs; it = it->next) {
        kvt__resv *r = KVT_CONTAINER(it, kvt__resv, link);
        for (int32_t j = 0; j < r->n; j++)
            if (r->ids[j] == ids[i])
                return pd_errf(err, PD_ESTATE, "kvt: block %d is held by request %llu", ids[i],
                               (unsigned long long)r->req_id);
    }
    return pd_errf(err, PD_ESTATE, "kvt: block %d is busy", ids[i]);
}

int kvt_recv_expect(kvt_pool *pool, const kvt_recv_params *p, char *err)
{
    kvt_ctx *ctx = pool->ctx;
    if (p->n_blocks <= 0 || p->n_blocks > pool->n_blocks)
        return pd_errf(err, PD_EINVAL, "kvt: request needs %d blocks, pool has %d", p->n_blocks,
                       pool->n_blocks);
    if (kvt__resv_find(pool, p->req_id))
        return pd_errf(err, PD_ESTATE, "kvt: request %llu already has a reservation",
                       (unsigned long long)p->req_id);
    if (!p->block_ids && p->n_blocks > pool->n_free)
        return pd_errf(err, PD_ENOSPC, "kvt: %d free blocks, request needs %d", pool->n_free,
                       p->n_blocks);
    kvt__resv *r = calloc(1, sizeof *r);
    int32_t *ids = malloc(sizeof *ids * (size_t)p->n_blocks);
    if (!r || !ids) {
        free(r);
        free(ids);
        return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    }
    if (p->block_ids) {
        for (int32_t i = 0; i < p->n_blocks; i++) {
            int32_t b = p->block_ids[i];
            int rc = 0;
            if (b < 0 || b >= pool->n_blocks)
                rc = pd_errf(err, PD_EINVAL, "kvt: block id %d outside the pool (0..%d)", b,
                             pool->n_blocks - 1);
            else if (pool->slot_busy[b])
                rc = slot_conflict(pool, p->block_ids, i, err);
            if (rc < 0) {
                for (int32_t j = 0; j < i; j++) pool->slot_busy[ids[j]] = 0;
                free(r);
                free(ids);
                return rc;
            }
            pool->slot_busy[b] = 1;
            ids[i] = b;
        }
    } else {
        for (int32_t i = 0; i < p->n_blocks; i++) {
            while (pool->slot_busy[pool->cursor]) pool->cursor = (pool->cursor + 1) % pool->n_blocks;
            ids[i] = pool->cursor;
            pool->slot_busy[pool->cursor] = 1;
        }
    }
    pool->n_free -= p->n_blocks;
    r->pool = pool;
    r->req_id = p->req_id;
    r->user = p->user;
    r->n = p->n_blocks;
    r->ids = ids;
    r->state = KVT_RESV_EXPECT;
    r->bytes_expected = (uint64_t)r->n * (uint64_t)pool->n_layers * 2u * pool->bb;
    r->t_expect = kvt__now_ns();
    int32_t to = p->start_timeout_ms == 0 ? ctx->p.start_timeout_ms : p->start_timeout_ms;
    r->start_timeout_ms = to > 0 ? to : 0;
    r->deadline = to > 0 ? r->t_expect + (int64_t)to * 1000000ll : 0;
    kvt__list_init(&r->dirty);
    kvt__list_init(&r->ev.link);
    kvt__list_add(&pool->resvs, &r->link);
    pool->n_resv++;
    ctx->st.recvs_active++;
    if (r->deadline) kvt__rescan(ctx);
    return 0;
}

const int32_t *kvt_recv_block_ids(const kvt_pool *pool, uint64_t req_id, int32_t *n)
{
    kvt__resv *r = kvt__resv_find((kvt_pool *)pool, req_id);
    if (!r) return NULL;
    if (n) *n = r->n;
    return r->ids;
}

void kvt__resv_free(kvt__resv *r)
{
    kvt_pool *pool = r->pool;
    kvt__list_del(&r->link);
    kvt__list_del(&r->dirty);
    if (r->ev.kind) {
        kvt__list_del(&r->ev.link);
        r->ev.kind = 0;
    }
    for (int32_t i = 0; i < r->n; i++) pool->slot_busy[r->ids[i]] = 0;
    pool->n_free += r->n;
    pool->n_resv--;
    if (--pool->ctx->st.recvs_active == 0) kvt__rescan(pool->ctx); /* maybe idle now */
    if (r->peer) kvt__peer_unref(r->peer);
    free(r->ids);
    free(r);
}

int kvt_recv_release(kvt_pool *pool, uint64_t req_id)
{
    kvt__resv *r = kvt__resv_find(pool, req_id);
    if (!r) return PD_ENOTFOUND;
    if (r->state == KVT_RESV_HELD) {
        kvt__resv_free(r);
    } else if (r->state == KVT_RESV_ENDING) {
        r->released = true;
        if (r->inflight == 0) kvt__resv_free(r);
    } else {
        if (r->state == KVT_RESV_EXPECT) { /* its START may still come */
            pool->cancelled[pool->cancel_next] = req_id;
            pool->cancel_next = (pool->cancel_next + 1) % 32;
            if (pool->n_cancelled < 32) pool->n_cancelled++;
        }
        kvt__resv_fail(r, PD_ECANCELED, true, "request %llu cancelled by the receiver",
                       (unsigned long long)req_id);
    }
    return 0;
}

int kvt_recv_cancel(kvt_pool *pool, uint64_t req_id)
{
    kvt__resv *r = kvt__resv_find(pool, req_id);
    if (!r) return PD_ENOTFOUND;
    if (r->state == KVT_RESV_HELD) return PD_ESTATE;
    if (r->state == KVT_RESV_ENDING) return 0; /* already failing: its event follows */
    return kvt_recv_release(pool, req_id);
}

void kvt__resv_fail(kvt__resv *r, int status, bool tell_peer, const char *fmt, ...)
{
    if (r->state == KVT_RESV_ENDING || r->state == KVT_RESV_HELD) return;
    kvt_ctx *ctx = r->pool->ctx;
    r->state = KVT_RESV_ENDING;
    r->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->detail, sizeof r->detail, fmt, ap);
    va_end(ap);
    bool was_started = r->peer != NULL;
    r->ack_pending = tell_peer && r->peer && r->peer->state == KVT_PEER_READY;
    /* One-sided writes cannot be refused here: keep the slots until the sender confirms that
     * it stopped, so that they cannot be reused under its last writes. */
    /* One-sided writes (put, device copies) can land until the sender says it stopped. */
    r->await_stop = r->ack_pending && was_started &&
                    (r->path == KVT_PATH_PUT || r->path == KVT_PATH_DEVICE);
    r->deadline = kvt__now_ns() + (int64_t)ctx->p.deadline_min_ms * 1000000ll;
    kvt__rescan(ctx);
    if (!ctx->destroying)
        (status == PD_ECANCELED ? pd_log(PD_LOG_INFO, "kvt[%s]: receive of request %llu ended: "
                                         "%s", ctx->name, (unsigned long long)r->req_id, r->detail)
                                : pd_log(PD_LOG_WARN, "kvt[%s]: receive of request %llu failed: "
                                         "%s (%s)", ctx->name, (unsigned long long)r->req_id,
                                         r->detail, pd_err_name(status)));
    mark_dirty(r);
}

int kvt__resvs_peer_failed(kvt_ctx *ctx, kvt__peer *peer)
{
    int n = 0;
    for (kvt__list *pi = ctx->pools.next; pi != &ctx->pools; pi = pi->next) {
        kvt_pool *pool = KVT_CONTAINER(pi, kvt_pool, link);
        for (kvt__list *it = pool->resvs.next; it != &pool->resvs; it = it->next) {
            kvt__resv *r = KVT_CONTAINER(it, kvt__resv, link);
            if (r->peer == peer && r->state < KVT_RESV_HELD) {
                kvt__resv_fail(r, peer->status == PD_ETIMEDOUT ? PD_ETIMEDOUT : PD_EUNAVAILABLE,
                               false, "sender: %s", peer->detail);
                n++;
            }
        }
    }
    return n;
}

/* ---------------------------------------------------------------- message handlers */

static kvt__peer *find_sender(kvt_ctx *ctx, uint64_t id, uint32_t gen)
{
    for (kvt__list *it = ctx->peers.next; it != &ctx->peers; it = it->next) {
        kvt__peer *p = KVT_CONTAINER(it, kvt__peer, link);
        /* With a secret, only a peer that proved it knows it (READY) may start a transfer. */
        if (p->remote_id == id && !p->initiator && p->gen == gen &&
            (p->state == KVT_PEER_READY || (!ctx->secret && p->state < KVT_PEER_READY)))
            return p;
    }
    return NULL;
}

static void nack(kvt_ctx *ctx, kvt__peer *peer, uint64_t req, uint64_t xfer, int status,
                 const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void nack(kvt_ctx *ctx, kvt__peer *peer, uint64_t req, uint64_t xfer, int status,
                 const char *fmt, ...)
{
    kvt__nack *n = calloc(1, sizeof *n);
    if (!n) return; /* the sender's deadline covers a lost refusal */
    n->peer = peer;
    peer->refs++;
    n->msg.req_id = req;
    n->msg.xfer_id = xfer;
    n->msg.status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(n->msg.detail, sizeof n->msg.detail, fmt, ap);
    va_end(ap);
    PD_LOGW("kvt[%s]: refused request %llu: %s", ctx->name, (unsigned long long)req,
            n->msg.detail);
    kvt__list_add(&ctx->nacks, &n->link);
}

ucs_status_t kvt__am_start(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param)
{
    kvt_ctx *ctx = arg;
    (void)data, (void)len, (void)param;
    kvt__msg_start h;
    if (hlen != sizeof h) return UCS_OK;
    memcpy(&h, hdr, sizeof h);
    kvt__peer *peer = find_sender(ctx, h.src_ctx, h.gen);
    if (!peer) {
        PD_LOGW("kvt[%s]: transfer of request %llu from an unknown connection ignored", ctx->name,
                (unsigned long long)h.req_id);
        return UCS_OK;
    }
    kvt_pool *pool = kvt__pool_find(ctx, h.pool_id);
    kvt__resv *r = pool ? kvt__resv_find(pool, h.req_id) : NULL;
    for (int i = 0; pool && !r && i < 32; i++)
        if (pool->cancelled[i] == h.req_id && i < pool->n_cancelled) {
            nack(ctx, peer, h.req_id, h.xfer_id, PD_ECANCELED, "request %llu was cancelled by "
                 "the receiver", (unsigned long long)h.req_id);
            return UCS_OK;
        }
    if (!r) {
        nack(ctx, peer, h.req_id, h.xfer_id, PD_ENOTFOUND, "%s %016llx has no reservation for "
             "request %llu", pool ? "pool" : "no pool", (unsigned long long)h.pool_id,
             (unsigned long long)h.req_id);
        return UCS_OK;
    }
    if (r->state == KVT_RESV_ENDING && r->xfer_id != h.xfer_id) {
        nack(ctx, peer, h.req_id, h.xfer_id, r->status, "request %llu: %s",
             (unsigned long long)h.req_id, r->detail);
        return UCS_OK;
    }
    if (r->state != KVT_RESV_EXPECT) {
        if (r->xfer_id != h.xfer_id)
            nack(ctx, peer, h.req_id, h.xfer_id, PD_ESTATE, "request %llu is already being "
                 "received from another transfer", (unsigned long long)h.req_id);
        return UCS_OK;
    }
    r->peer = peer;
    peer->refs++;
    r->xfer_id = h.xfer_id;
    r->path = h.path;
    r->t_start = kvt__now_ns();
    r->state = KVT_RESV_ACTIVE;
    if (h.path > KVT_PATH_DEVICE || h.path == KVT_PATH_AUTO ||
        (h.path == KVT_PATH_DEVICE && !pool->dev_export) ||
        (h.path == KVT_PATH_PUT && pool->staged)) {
        kvt__resv_fail(r, PD_EINVAL, true, "sender's data path %u is not one this pool takes",
                       h.path);
    } else if (h.fingerprint != pool->fingerprint) {
        kvt__resv_fail(r, PD_EMISMATCH, true, "sender's KV layout (fingerprint %016llx) differs "
                       "from this pool's (%016llx)", (unsigned long long)h.fingerprint,
                       (unsigned long long)pool->fingerprint);
    } else if (h.meta_sum != kvt__meta_sum(r->req_id, pool->id, pool->n_layers, pool->bb, r->n,
                                          r->ids)) {
        kvt__resv_fail(r, PD_EINVAL, true, "sender's destination block list differs from the "
                       "reservation of request %llu", (unsigned long long)r->req_id);
    } else if (h.n_blocks != r->n || h.n_layers != pool->n_layers || h.bytes != r->bytes_expected) {
        kvt__resv_fail(r, PD_EINVAL, true, "sender moves %d blocks x %d layers (%llu B), "
                       "reservation has %d x %d (%llu B)", h.n_blocks, h.n_layers,
                       (unsigned long long)h.bytes, r->n, pool->n_layers,
                       (unsigned long long)r->bytes_expected);
    } else {
        /* The sender promised DONE within deadline_ms; allow one more minimum for transit. */
        r->deadline = r->t_start + (int64_t)h.deadline_ms * 1000000ll +
                      (int64_t)ctx->p.deadline_min_ms * 1000000ll;
        kvt__rescan(ctx);
    }
    return UCS_OK;
}

static kvt__resv *find_active(kvt_ctx *ctx, uint64_t pool_id, uint64_t req, uint64_t xfer)
{
    kvt_pool *pool = kvt__pool_find(ctx, pool_id);
    kvt__resv *r = pool ? kvt__resv_find(pool, req) : NULL;
    if (!r || r->xfer_id != xfer || !r->peer) return NULL;
    return r;
}

static void recv_cb(void *request, ucs_status_t status, size_t length, void *user_data)
{
    kvt__op *op = user_data;
    (void)length;
    kvt__op_complete(op->ctx, op, status);
    ucp_request_free(request);
}

/* ---- staged pools: block messages land in a ring slot, then a device copy scatters them */

static void staged_recv_cb(void *request, ucs_status_t status, size_t length, void *user_data)
{
    kvt__op *op = user_data;
    (void)length;
    op->req = NULL;
    ucp_request_free(request);
    kvt__staged_recv_landed(op->ctx, op, status);
}

void kvt__staged_recv_landed(kvt_ctx *ctx, kvt__op *op, ucs_status_t status)
{
    kvt__resv *r = op->resv;
    if (status != UCS_OK || (r->state != KVT_RESV_ACTIVE && r->state != KVT_RESV_LANDING)) {
        /* Failed, or the reservation ended: its device blocks get no more writes. */
        kvt__op_complete(ctx, op, status != UCS_OK ? status : UCS_ERR_CANCELED);
        return;
    }
    const kvt__msg_block *h = &op->hdr.block;
    void *token = NULL;
    int rc = ctx->device.stage_in(ctx->device.arg, h->layer, h->kv, r->ids + h->first, h->n,
                                  kvt__ring_ptr(op->ring, op->stage), &token);
    if (rc < 0 || !token) {
        kvt__op_complete(ctx, op, rc < 0 ? UCS_ERR_IO_ERROR : UCS_OK);
        return;
    }
    op->phase = 1; /* dev_ops poll completes it once the blocks are written */
    op->req = token;
    kvt__list_add(&ctx->dev_ops, &op->dev_link);
}

/* Receives one block message of r into a free ring slot (the caller checked there is one):
 * rendezvous data zero-copy, eager data by a copy. */
static void staged_start(kvt_ctx *ctx, kvt__resv *r, const kvt__msg_block *h, void *data,
                         size_t len, bool rndv)
{
    kvt_pool *pool = r->pool;
    kvt__op *op = kvt__op_get(ctx, KVT_OP_RECV);
    if (!op) {
        kvt__resv_fail(r, PD_ENOMEM, true, "out of memory receiving blocks");
        if (rndv) ucp_am_data_release(ctx->worker, data);
        return;
    }
    op->resv = r;
    op->bytes = len;
    op->ring = pool;
    op->stage = kvt__ring_get(pool);
    op->hdr.block = *h;
    ctx->ops_in_flight++;
    r->inflight++;
    uint8_t *slot = kvt__ring_ptr(pool, op->stage);
    if (!rndv) {
        memcpy(slot, data, len);
        kvt__staged_recv_landed(ctx, op, UCS_OK);
        return;
    }
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_MEMH,
        .cb.recv_am = staged_recv_cb,
        .user_data = op,
        .memh = pool->ring_mh,
    };
    void *req = ucp_am_recv_data_nbx(ctx->worker, data, slot, len, &prm);
    if (req == NULL) kvt__staged_recv_landed(ctx, op, UCS_OK);
    else if (UCS_PTR_IS_ERR(req)) kvt__staged_recv_landed(ctx, op, UCS_PTR_STATUS(req));
    else op->req = req;
}

/* A staged pool's block message: into a free slot now, or kept (UCS_INPROGRESS) until one
 * frees, in arrival order. */
static ucs_status_t staged_block(kvt_ctx *ctx, kvt__resv *r, const kvt__msg_block *h,
                                 void *data, size_t len, const ucp_am_recv_param_t *param)
{
    kvt_pool *pool = r->pool;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    bool keep = rndv || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA);
    if (pool->ring_n_free > 0 && kvt__list_empty(&pool->pending)) {
        staged_start(ctx, r, h, data, len, rndv);
        return UCS_OK;
    }
    kvt__pending *p = keep ? malloc(sizeof *p) : NULL;
    if (!p) {
        kvt__resv_fail(r, keep ? PD_ENOMEM : PD_EFORMAT, true, keep
                       ? "out of memory queueing a block message" : "an eager block message "
                       "arrived with the staging ring full (senders must use rendezvous)");
        return rndv ? UCS_ERR_NO_MEMORY : UCS_OK;
    }
    *p = (kvt__pending){.resv = r, .hdr = *h, .data = data, .len = len, .rndv = rndv};
    kvt__list_add(&pool->pending, &p->link);
    ctx->n_pending++;
    r->inflight++;
    return UCS_INPROGRESS;
}

static void pending_free(kvt_ctx *ctx, kvt__pending *p)
{
    kvt__list_del(&p->link);
    ctx->n_pending--;
    p->resv->inflight--;
    mark_dirty(p->resv);
    free(p);
}

int kvt__pending_process(kvt_ctx *ctx)
{
    if (ctx->n_pending == 0) return 0;
    int n = 0;
    for (kvt__list *pi = ctx->pools.next; pi != &ctx->pools; pi = pi->next) {
        kvt_pool *pool = KVT_CONTAINER(pi, kvt_pool, link);
        kvt__list *it, *nx;
        KVT_LIST_EACH_SAFE(it, nx, &pool->pending)
        {
            kvt__pending *p = KVT_CONTAINER(it, kvt__pending, link);
            kvt__resv *r = p->resv;
            bool live = r->state == KVT_RESV_ACTIVE || r->state == KVT_RESV_LANDING;
            if (live && pool->ring_n_free == 0) continue; /* (an ended one behind may go) */
            if (live) staged_start(ctx, r, &p->hdr, p->data, p->len, p->rndv);
            if (!live || !p->rndv) ucp_am_data_release(ctx->worker, p->data);
            pending_free(ctx, p);
            n++;
        }
    }
    return n;
}

void kvt__pending_drop_all(kvt_pool *pool)
{
    kvt_ctx *ctx = pool->ctx;
    while (!kvt__list_empty(&pool->pending)) {
        kvt__pending *p = KVT_CONTAINER(pool->pending.next, kvt__pending, link);
        ucp_am_data_release(ctx->worker, p->data);
        pending_free(ctx, p);
    }
}

ucs_status_t kvt__am_block(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param)
{
    kvt_ctx *ctx = arg;
    kvt__msg_block h;
    if (hlen != sizeof h)
        return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? UCS_ERR_INVALID_PARAM : UCS_OK;
    memcpy(&h, hdr, sizeof h);
    /* A refused rendezvous fails the sender's operation; eager data is just dropped. */
    ucs_status_t refuse = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? UCS_ERR_CANCELED
                                                                          : UCS_OK;
    kvt__resv *r = find_active(ctx, h.pool_id, h.req_id, h.xfer_id);
    if (!r || (r->state != KVT_RESV_ACTIVE && r->state != KVT_RESV_LANDING)) return refuse;
    kvt_pool *pool = r->pool;
    if (h.layer < 0 || h.layer >= pool->n_layers || h.kv < 0 || h.kv > 1 || h.n < 1 ||
        h.first < 0 || h.n > r->n - h.first || h.n > KVT_MAX_IOV || len != (size_t)h.n * pool->bb) {
        kvt__resv_fail(r, PD_EFORMAT, true, "malformed block message (layer %d, blocks %d+%d, "
                       "%zu B)", h.layer, h.first, h.n, len);
        return refuse == UCS_OK ? UCS_OK : UCS_ERR_INVALID_PARAM;
    }
    if (pool->staged) {
        if (h.n > pool->ring_blocks) {
            kvt__resv_fail(r, PD_EFORMAT, true, "block message of %d blocks; a staging slot "
                           "holds %d", h.n, pool->ring_blocks);
            return refuse == UCS_OK ? UCS_OK : UCS_ERR_INVALID_PARAM;
        }
        return staged_block(ctx, r, &h, data, len, param);
    }
    uint8_t *base = pool->base[2 * h.layer + h.kv];
    const int32_t *ids = r->ids + h.first;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        for (int32_t i = 0; i < h.n; i++)
            memcpy(base + (size_t)ids[i] * pool->bb, (const uint8_t *)data + (size_t)i * pool->bb,
                   pool->bb);
        r->bytes_landed += len;
        return UCS_OK;
    }
    kvt__op *op = kvt__op_get(ctx, KVT_OP_RECV);
    if (!op) {
        kvt__resv_fail(r, PD_ENOMEM, true, "out of memory receiving blocks");
        return refuse == UCS_OK ? UCS_OK : UCS_ERR_NO_MEMORY;
    }
    op->resv = r;
    op->bytes = len;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.recv_am = recv_cb,
        .user_data = op,
    };
    void *buf;
    size_t count;
    int niov = 0;
    for (int32_t i = 0; i < h.n; i++) {
        uint8_t *dst = base + (size_t)ids[i] * pool->bb;
        if (niov && (uint8_t *)op->iov[niov - 1].buffer + op->iov[niov - 1].length == dst) {
            op->iov[niov - 1].length += pool->bb;
        } else {
            op->iov[niov].buffer = dst;
            op->iov[niov].length = pool->bb;
            niov++;
        }
    }
    if (niov == 1) {
        buf = op->iov[0].buffer;
        count = len;
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = pool->mh[pool->region_mh[2 * h.layer + h.kv]];
    } else {
        buf = op->iov;
        count = (size_t)niov;
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        prm.datatype = ucp_dt_make_iov();
    }
    if (pool->mem_type == KVT_MEM_CUDA) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        prm.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    ctx->ops_in_flight++;
    r->inflight++;
    void *req = ucp_am_recv_data_nbx(ctx->worker, data, buf, count, &prm);
    if (req == NULL) kvt__op_complete(ctx, op, UCS_OK);
    else if (UCS_PTR_IS_ERR(req)) kvt__op_complete(ctx, op, UCS_PTR_STATUS(req));
    else op->req = req;
    return UCS_OK;
}

ucs_status_t kvt__am_done(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                          const ucp_am_recv_param_t *param)
{
    kvt_ctx *ctx = arg;
    (void)data, (void)len, (void)param;
    kvt__msg_done h;
    if (hlen != sizeof h) return UCS_OK;
    memcpy(&h, hdr, sizeof h);
    kvt__resv *r = find_active(ctx, h.pool_id, h.req_id, h.xfer_id);
    if (!r || r->state != KVT_RESV_ACTIVE) return UCS_OK;
    r->done = h;
    r->have_done = true;
    r->state = KVT_RESV_LANDING;
    mark_dirty(r);
    return UCS_OK;
}

ucs_status_t kvt__am_abort(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param)
{
    kvt_ctx *ctx = arg;
    (void)data, (void)len, (void)param;
    kvt__msg_ack h;
    if (!kvt__msg_ack_read(hdr, hlen, &h)) return UCS_OK;
    for (kvt__list *pi = ctx->pools.next; pi != &ctx->pools; pi = pi->next) {
        kvt_pool *pool = KVT_CONTAINER(pi, kvt_pool, link);
        kvt__resv *r = kvt__resv_find(pool, h.req_id);
        if (!r || r->xfer_id != h.xfer_id || !r->peer) continue;
        if (r->state < KVT_RESV_HELD)
            kvt__resv_fail(r, h.status < 0 ? h.status : PD_ECANCELED, false, "sender: %s",
                           h.detail);
        /* The sender's last write is complete: the slots may be released. */
        r->await_stop = false;
        mark_dirty(r);
    }
    return UCS_OK;
}

/* ---------------------------------------------------------------- main-loop work */

static int send_ack(kvt_ctx *ctx, kvt__peer *peer, uint64_t req, uint64_t xfer, int status,
                    const char *detail)
{
    if (!peer || peer->state != KVT_PEER_READY) return 0;
    kvt__op *op = kvt__op_get(ctx, KVT_OP_CTRL);
    if (!op) return PD_ENOMEM;
    memset(&op->hdr.ack, 0, sizeof op->hdr.ack);
    op->hdr.ack.req_id = req;
    op->hdr.ack.xfer_id = xfer;
    op->hdr.ack.status = status;
    snprintf(op->hdr.ack.detail, sizeof op->hdr.ack.detail, "%.95s", detail ? detail : "");
    return kvt__send_ctrl(ctx, peer, op, KVT_AM_ACK, sizeof op->hdr.ack, NULL, 0);
}

/* DONE has arrived: once every AM byte has landed, check and accept. */
static void try_complete(kvt__resv *r)
{
    kvt_pool *pool = r->pool;
    if (r->path == KVT_PATH_AM && (r->inflight > 0 || r->bytes_landed < r->bytes_expected)) return;
    const kvt__msg_done *d = &r->done;
    uint64_t meta = kvt__meta_sum(r->req_id, pool->id, pool->n_layers, pool->bb, r->n, r->ids);
    if (d->n_first < 1 || d->n_first > KVT_MAX_FIRST_TOKENS) {
        kvt__resv_fail(r, PD_EIO, true, "DONE carries %d first tokens (1 .. %d)", d->n_first,
                       KVT_MAX_FIRST_TOKENS);
        return;
    }
    if (d->n_blocks != r->n || d->bytes != r->bytes_expected || d->meta_sum != meta) {
        kvt__resv_fail(r, PD_EIO, true, "DONE does not match the reservation (blocks %d vs %d, "
                       "block list %s)", d->n_blocks, r->n, d->meta_sum == meta ? "same" : "differs");
        return;
    }
    if ((d->flags & 1u) && pool->staged) {
        kvt__resv_fail(r, PD_EUNSUPPORTED, true, "data checksums need host memory; this pool "
                       "is staged");
        return;
    }
    if (d->flags & 1u) {
        uint64_t *sums = malloc(sizeof *sums * (size_t)pool->n_layers);
        if (!sums) {
            kvt__resv_fail(r, PD_ENOMEM, true, "out of memory verifying the checksum");
            return;
        }
        for (int32_t l = 0; l < pool->n_layers; l++) sums[l] = kvt__layer_sum(pool, l, r->n, r->ids);
        uint64_t sum = kvt__data_sum(sums, pool->n_layers);
        free(sums);
        if (sum != d->data_sum) {
            kvt__resv_fail(r, PD_EIO, true, "data checksum mismatch (%016llx received, %016llx "
                           "sent)", (unsigned long long)sum, (unsigned long long)d->data_sum);
            return;
        }
    }
    r->state = KVT_RESV_HELD;
    r->ack_pending = true;
    PD_LOGD("kvt[%s]: request %llu landed %.3f ms after START", pool->ctx->name,
            (unsigned long long)r->req_id, (double)(kvt__now_ns() - r->t_start) / 1e6);
    kvt__event_queue(pool->ctx, &r->ev, 2, KVT_EV_RECV_DONE);
}

int kvt__resvs_process(kvt_ctx *ctx)
{
    int n = kvt__pending_process(ctx);
    while (!kvt__list_empty(&ctx->nacks)) {
        kvt__nack *k = KVT_CONTAINER(ctx->nacks.next, kvt__nack, link);
        kvt__list_del(&k->link);
        send_ack(ctx, k->peer, k->msg.req_id, k->msg.xfer_id, k->msg.status, k->msg.detail);
        kvt__peer_unref(k->peer);
        free(k);
        n++;
    }
    while (!kvt__list_empty(&ctx->dirty_resvs)) {
        kvt__resv *r = KVT_CONTAINER(ctx->dirty_resvs.next, kvt__resv, dirty);
        kvt__list_del(&r->dirty);
        n++;
        if (r->state == KVT_RESV_LANDING) try_complete(r);
        if (r->ack_pending) {
            r->ack_pending = false;
            int st = r->state == KVT_RESV_HELD ? 0 : r->status;
            if (send_ack(ctx, r->peer, r->req_id, r->xfer_id, st, st ? r->detail : "") < 0 &&
                r->state == KVT_RESV_ENDING)
                PD_LOGW("kvt[%s]: could not tell the sender of request %llu", ctx->name,
                        (unsigned long long)r->req_id);
        }
        if (r->state == KVT_RESV_ENDING && r->inflight == 0 && !r->await_stop && !r->ev.kind) {
            if (r->released || ctx->destroying) kvt__resv_free(r);
            else kvt__event_queue(ctx, &r->ev, 2, KVT_EV_RECV_FAILED);
        }
    }
    return n;
}

void kvt__resvs_deadlines(kvt_ctx *ctx, int64_t now, int64_t *next)
{
    for (kvt__list *pi = ctx->pools.next; pi != &ctx->pools; pi = pi->next) {
        kvt_pool *pool = KVT_CONTAINER(pi, kvt_pool, link);
        kvt__list *it, *nx;
        KVT_LIST_EACH_SAFE(it, nx, &pool->resvs)
        {
            kvt__resv *r = KVT_CONTAINER(it, kvt__resv, link);
            if (!r->deadline || r->state == KVT_RESV_HELD) continue;
            if (now < r->deadline) {
                if (r->deadline < *next) *next = r->deadline;
                continue;
            }
            if (r->state == KVT_RESV_EXPECT) {
                kvt__resv_fail(r, PD_ETIMEDOUT, false, "no sender started request %llu within "
                               "%d ms", (unsigned long long)r->req_id, r->start_timeout_ms);
            } else if (r->state == KVT_RESV_ACTIVE || r->state == KVT_RESV_LANDING) {
                char prog[96];
                if (r->path == KVT_PATH_PUT || r->path == KVT_PATH_DEVICE)
                    snprintf(prog, sizeof prog, "one-sided writes, DONE %s",
                             r->have_done ? "seen" : "not seen");
                else
                    snprintf(prog, sizeof prog, "%.1f of %.1f MiB landed%s",
                             (double)r->bytes_landed / 1048576.0,
                             (double)r->bytes_expected / 1048576.0,
                             r->have_done ? ", DONE seen" : "");
                kvt__resv_fail(r, PD_ETIMEDOUT, true, "transfer of request %llu did not finish "
                               "within its deadline (%.0f ms after START; %s)",
                               (unsigned long long)r->req_id, (double)(now - r->t_start) / 1e6,
                               prog);
            } else if (r->state == KVT_RESV_ENDING && r->inflight == 0 && r->await_stop) {
                r->await_stop = false; /* no confirmation: the sender's deadline has passed */
                mark_dirty(r);
            } else if (r->state == KVT_RESV_ENDING && r->inflight > 0 && r->peer) {
                /* Receives into the slots do not finish: close the connection, which
                 * completes them, before the slots can be released. */
                kvt__peer_fail(r->peer, PD_ETIMEDOUT, "receives from %016llx stalled",
                               (unsigned long long)r->peer->remote_id);
                r->deadline = 0;
            }
        }
    }
}
