/* kvt_send.c -- The sending (prefill) side: one transfer per request, START, layer-by-layer
 * posting of block groups through one of two data paths (RMA put, or active messages received
 * zero-copy into the slots), a window of operations in flight, flush, DONE and the wait for
 * the ACK, with a deadline on each phase and a two-phase end (event only after the last
 * operation has completed, so the source blocks are free when the caller hears of it). */
#include "kvtransfer/kvt_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"

#define KVT_GROUPS_PER_TURN 16 /* groups one send posts before the next send's turn */

kvt_send_params kvt_send_default_params(void)
{
    kvt_send_params p;
    memset(&p, 0, sizeof p);
    return p;
}

/* ---------------------------------------------------------------- data paths */

/* A data path posts one group of blocks (consecutive positions of the request list) of one
 * (layer, kv) region and says how many positions it took. */
typedef struct {
    const char *name;
    /* Posts the group at pos; returns the positions it took and the UCX request (or NULL
     * when complete, or an error pointer). */
    int32_t (*post)(kvt_send *s, kvt__op *op, int32_t layer, int kv, int32_t pos, void **req);
    /* Whether a group can be posted now (resources); NULL = always. */
    bool (*can_post)(kvt_send *s);
} kvt__path_ops;

static void data_cb(void *request, ucs_status_t status, void *user_data)
{
    kvt__op *op = user_data;
    kvt__op_complete(op->ctx, op, status);
    ucp_request_free(request);
}

static ucp_request_param_t data_param(kvt_send *s, kvt__op *op)
{
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = data_cb,
        .user_data = op,
    };
    if (s->t->src->mem_type == KVT_MEM_CUDA) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        prm.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    return prm;
}

static int32_t put_post(kvt_send *s, kvt__op *op, int32_t layer, int kv, int32_t pos, void **req)
{
    kvt_target *t = s->t;
    kvt_pool *src = t->src;
    size_t bb = src->bb, max = (size_t)s->ctx->p.max_op_kib * 1024;
    int32_t n = 1;
    while (pos + n < s->n && s->src[pos + n] == s->src[pos] + n &&
           s->dst[pos + n] == s->dst[pos] + n && (size_t)(n + 1) * bb <= max)
        n++;
    int r = 2 * layer + kv;
    op->bytes = (size_t)n * bb;
    if (t->lptr) { /* shm: our mapping of the remote region */
        memcpy(t->lptr[r] + (size_t)s->dst[pos] * bb, src->base[r] + (size_t)s->src[pos] * bb,
               op->bytes);
        *req = NULL;
        return n;
    }
    ucp_request_param_t prm = data_param(s, op);
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    prm.memh = src->mh[src->region_mh[r]];
    *req = ucp_put_nbx(s->peer->ep, src->base[r] + (size_t)s->src[pos] * bb, op->bytes,
                       t->raddr[r] + (uint64_t)s->dst[pos] * bb, t->rkeys[t->rkey_idx[r]], &prm);
    return n;
}

/* Allocates the AM staging slots at first use. Returns false when there are none. */
static bool stage_init(kvt_ctx *ctx)
{
    if (ctx->stage_mh) return true;
    if (ctx->stage_failed || ctx->p.am_staging_slots == 0) return false;
    ctx->stage_failed = true;
    size_t slot = (size_t)ctx->p.am_max_kib * 1024, n = (size_t)ctx->p.am_staging_slots;
    ctx->stage_free = malloc(sizeof *ctx->stage_free * n);
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        .address = NULL,
        .length = slot * n,
        .flags = UCP_MEM_MAP_ALLOCATE,
    };
    ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
    if (!ctx->stage_free || ucp_mem_map(ctx->uctx, &mp, &ctx->stage_mh) != UCS_OK) {
        ctx->stage_mh = NULL;
        PD_LOGW("kvt[%s]: no AM staging memory; sending scattered blocks as iov", ctx->name);
        return false;
    }
    if (ucp_mem_query(ctx->stage_mh, &ma) != UCS_OK) {
        ucp_mem_unmap(ctx->uctx, ctx->stage_mh);
        ctx->stage_mh = NULL;
        return false;
    }
    ctx->stage_base = ma.address;
    ctx->stage_slot = slot;
    for (size_t i = 0; i < n; i++) ctx->stage_free[i] = (int32_t)(n - 1 - i);
    ctx->n_stage_free = (int)n;
    ctx->stage_failed = false;
    return true;
}

/* Whether the AM path can post now: a scattered group needs a free staging slot. */
static bool am_can_post(kvt_send *s)
{
    kvt_ctx *ctx = s->ctx;
    return ctx->p.am_staging_slots == 0 || ctx->stage_failed || s->t->src->mem_type != KVT_MEM_HOST ||
           !ctx->stage_mh || ctx->n_stage_free > 0;
}

static int32_t am_post(kvt_send *s, kvt__op *op, int32_t layer, int kv, int32_t pos, void **req)
{
    kvt_target *t = s->t;
    kvt_pool *src = t->src;
    kvt_ctx *ctx = s->ctx;
    size_t bb = src->bb, am_max = (size_t)ctx->p.am_max_kib * 1024;
    int32_t n = 1;
    int32_t max_n = t->remote_staged ? kvt_stage_slot_blocks(bb) : KVT_MAX_IOV;
    while (pos + n < s->n && n < max_n && (size_t)(n + 1) * bb <= am_max) n++;
    int r = 2 * layer + kv;
    int niov = 0;
    for (int32_t i = 0; i < n; i++) {
        uint8_t *p = src->base[r] + (size_t)s->src[pos + i] * bb;
        if (niov && (uint8_t *)op->iov[niov - 1].buffer + op->iov[niov - 1].length == p) {
            op->iov[niov - 1].length += bb;
        } else {
            op->iov[niov].buffer = p;
            op->iov[niov].length = bb;
            niov++;
        }
    }
    op->hdr.block = (kvt__msg_block){.req_id = s->req_id, .xfer_id = s->xfer_id,
                                     .pool_id = t->pool_id, .layer = layer, .kv = kv,
                                     .first = pos, .n = n};
    op->bytes = (size_t)n * bb;
    ucp_request_param_t prm = data_param(s, op);
    if (t->remote_cuda || t->remote_staged) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        prm.flags = UCP_AM_SEND_FLAG_RNDV;
    }
    void *buf = op->iov;
    size_t count = (size_t)niov;
    if (niov > 1 && op->bytes <= (size_t)ctx->p.am_max_kib * 1024 &&
        src->mem_type == KVT_MEM_HOST && stage_init(ctx) && ctx->n_stage_free > 0) {
        /* Gather into a staging slot: one contiguous buffer goes zero-copy. */
        op->stage = ctx->stage_free[--ctx->n_stage_free];
        uint8_t *dst = ctx->stage_base + (size_t)op->stage * ctx->stage_slot;
        for (int i = 0; i < niov; i++) {
            memcpy(dst, op->iov[i].buffer, op->iov[i].length);
            dst += op->iov[i].length;
        }
        buf = ctx->stage_base + (size_t)op->stage * ctx->stage_slot;
        count = op->bytes;
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = ctx->stage_mh;
    } else if (niov == 1) {
        buf = op->iov[0].buffer;
        count = op->bytes;
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = src->mh[src->region_mh[r]];
    } else {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        prm.datatype = ucp_dt_make_iov();
    }
    *req = ucp_am_send_nbx(s->peer->ep, KVT_AM_BLOCK, &op->hdr.block, sizeof op->hdr.block, buf,
                           count, &prm);
    return n;
}

/* A staged source pool: a group (up to a ring slot of consecutive positions) is gathered from
 * the device into a free slot of the pool's ring, on the copy stream after the layer's
 * readiness (the first group of a layer waits for it; the stream orders the rest); the op
 * waits in ctx->dev_ops until the copy completed, then kvt__staged_send_post sends the slot. */
static bool staged_can_post(kvt_send *s)
{
    return s->t->src->ring_n_free > 0;
}

static int32_t staged_post(kvt_send *s, kvt__op *op, int32_t layer, int kv, int32_t pos,
                           void **req)
{
    kvt_target *t = s->t;
    kvt_pool *src = t->src;
    kvt_ctx *ctx = s->ctx;
    int32_t n = s->n - pos < src->ring_blocks ? s->n - pos : src->ring_blocks;
    op->hdr.block = (kvt__msg_block){.req_id = s->req_id, .xfer_id = s->xfer_id,
                                     .pool_id = t->pool_id, .layer = layer, .kv = kv,
                                     .first = pos, .n = n};
    op->bytes = (size_t)n * src->bb;
    op->stage = kvt__ring_get(src);
    op->ring = src;
    void *after = kv == 0 && pos == 0 ? s->layer_after[layer] : NULL;
    void *token = NULL;
    int rc = ctx->device.stage_out(ctx->device.arg, layer, kv, s->src + pos, n, after,
                                   kvt__ring_ptr(src, op->stage), &token);
    if (after) {
        ctx->device.release(ctx->device.arg, after);
        s->layer_after[layer] = NULL;
    }
    if (rc < 0) {
        *req = UCS_STATUS_PTR(UCS_ERR_IO_ERROR);
        return n;
    }
    *req = KVT_REQ_OWNED;
    if (!token) { /* the copy completed at once */
        kvt__staged_send_post(ctx, op, true);
        return n;
    }
    op->phase = 1;
    op->req = token; /* the copy's token until it completes */
    kvt__list_add(&ctx->dev_ops, &op->dev_link);
    return n;
}

void kvt__staged_send_post(kvt_ctx *ctx, kvt__op *op, bool ok)
{
    kvt_send *s = op->send;
    op->phase = 0;
    op->req = NULL;
    if (!ok || s->state >= KVT_SEND_ENDING) {
        /* A failed copy fails the send; after a failure nothing more is sent. */
        kvt__op_complete(ctx, op, ok ? UCS_ERR_CANCELED : UCS_ERR_IO_ERROR);
        return;
    }
    ucp_request_param_t prm = data_param(s, op);
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMH;
    prm.flags = UCP_AM_SEND_FLAG_RNDV; /* the receiver picks where it lands */
    prm.memh = op->ring->ring_mh;
    void *req = ucp_am_send_nbx(s->peer->ep, KVT_AM_BLOCK, &op->hdr.block, sizeof op->hdr.block,
                                kvt__ring_ptr(op->ring, op->stage), op->bytes, &prm);
    if (req == NULL) kvt__op_complete(ctx, op, UCS_OK);
    else if (UCS_PTR_IS_ERR(req)) kvt__op_complete(ctx, op, UCS_PTR_STATUS(req));
    else op->req = req;
}

static const kvt__path_ops path_put = {"put", put_post, NULL};
static const kvt__path_ops path_am = {"am", am_post, am_can_post};
static const kvt__path_ops path_staged = {"staged", staged_post, staged_can_post};

/* ---------------------------------------------------------------- begin / signals / end */

int kvt_send_begin(kvt_target *t, const kvt_send_params *p, kvt_send **out, char *err)
{
    *out = NULL;
    kvt_ctx *ctx = t->ctx;
    if (!t->src) return pd_errf(err, PD_ESTATE, "kvt: the target's source pool was destroyed");
    if (!t->peer || t->peer->state >= KVT_PEER_FAILED)
        return pd_errf(err, PD_EUNAVAILABLE, "kvt: connection to the decode side failed: %s",
                       t->peer ? t->peer->detail : "none");
    kvt_pool *src = t->src;
    if (p->n_blocks <= 0 || !p->src_ids || !p->dst_ids || p->compute_timeout_ms < 0)
        return pd_errf(err, PD_EINVAL, "kvt: a transfer needs n_blocks > 0 and both id lists");
    for (int32_t i = 0; i < p->n_blocks; i++) {
        if (p->src_ids[i] < 0 || p->src_ids[i] >= src->n_blocks)
            return pd_errf(err, PD_EINVAL, "kvt: source block %d outside 0..%d", p->src_ids[i],
                           src->n_blocks - 1);
        if (p->dst_ids[i] < 0 || p->dst_ids[i] >= t->n_blocks)
            return pd_errf(err, PD_EINVAL, "kvt: destination block %d outside 0..%d",
                           p->dst_ids[i], t->n_blocks - 1);
    }
    for (kvt__list *it = ctx->sends.next; it != &ctx->sends; it = it->next) {
        kvt_send *o = KVT_CONTAINER(it, kvt_send, link);
        if (o->req_id == p->req_id && o->t->pool_id == t->pool_id && o->state < KVT_SEND_ENDING)
            return pd_errf(err, PD_ESTATE, "kvt: request %llu is already being sent",
                           (unsigned long long)p->req_id);
    }
    int32_t L = src->n_layers;
    kvt_send *s = calloc(1, sizeof *s);
    if (!s) return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    s->src = malloc(sizeof *s->src * (size_t)p->n_blocks);
    s->dst = malloc(sizeof *s->dst * (size_t)p->n_blocks);
    s->layer_ready = calloc((size_t)L, 1);
    s->layer_after = calloc((size_t)L, sizeof *s->layer_after);
    s->queue = malloc(sizeof *s->queue * (size_t)L);
    s->layer_sum = p->checksum_data ? calloc((size_t)L, sizeof *s->layer_sum) : NULL;
    if (!s->src || !s->dst || !s->layer_ready || !s->layer_after || !s->queue ||
        (p->checksum_data && !s->layer_sum)) {
        free(s->src), free(s->dst), free(s->layer_ready), free(s->queue), free(s->layer_sum);
        free(s->layer_after);
        free(s);
        return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    }
    if (p->checksum_data &&
        (src->mem_type != KVT_MEM_HOST || t->dev_remote || src->staged || t->remote_staged)) {
        free(s->src), free(s->dst), free(s->layer_ready), free(s->queue), free(s->layer_sum);
        free(s->layer_after);
        free(s);
        return pd_errf(err, PD_EUNSUPPORTED, "kvt: data checksums need host memory");
    }
    memcpy(s->src, p->src_ids, sizeof *s->src * (size_t)p->n_blocks);
    memcpy(s->dst, p->dst_ids, sizeof *s->dst * (size_t)p->n_blocks);
    s->ctx = ctx;
    s->t = t;
    t->refs++;
    s->peer = t->peer;
    s->peer->refs++;
    s->req_id = p->req_id;
    s->xfer_id = ctx->next_xfer_id++;
    s->user = p->user;
    s->n = p->n_blocks;
    s->n_layers = L;
    s->checksum = p->checksum_data;
    s->state = KVT_SEND_WAIT_CONN;
    s->cur_layer = -1;
    s->first_tokens[0] = -1;
    s->n_first = 1;
    s->bytes_total = (uint64_t)s->n * (uint64_t)L * 2u * src->bb;
    s->meta_sum = kvt__meta_sum(s->req_id, t->pool_id, L, src->bb, s->n, s->dst);
    s->t_begin = s->t_last = kvt__now_ns();
    /* The compute budget is how long the caller may take to signal every layer. */
    int32_t compute = p->compute_timeout_ms ? p->compute_timeout_ms : ctx->p.compute_timeout_ms;
    s->deadline_total = (int64_t)compute * 1000000ll; /* made absolute at START */
    kvt__list_init(&s->ev.link);
    kvt__list_add(&ctx->sends, &s->link);
    ctx->st.sends_active++;
    ctx->pump_more = true;
    *out = s;
    return 0;
}

static int pump_one(kvt_send *s, int budget, bool *freed);

int kvt_send_layer_ready(kvt_send *s, int32_t layer)
{
    return kvt_send_layer_ready_after(s, layer, NULL);
}

/* Releases a layer's readiness handle (the device engine's). */
static void release_after(kvt_send *s, int32_t layer)
{
    if (s->layer_after[layer]) {
        s->ctx->device.release(s->ctx->device.arg, s->layer_after[layer]);
        s->layer_after[layer] = NULL;
    }
}

int kvt_send_layer_ready_after(kvt_send *s, int32_t layer, void *after)
{
    if (s->state >= KVT_SEND_ENDING || layer < 0 || layer >= s->n_layers ||
        s->layer_ready[layer] || s->finish_called) {
        if (after && s->ctx->device.release) s->ctx->device.release(s->ctx->device.arg, after);
        return s->state >= KVT_SEND_ENDING ? PD_ESTATE : PD_EINVAL;
    }
    s->layer_after[layer] = after;
    s->layer_ready[layer] = 1;
    s->queue[s->q_tail++] = layer;
    if (s->checksum) s->layer_sum[layer] = kvt__layer_sum(s->t->src, layer, s->n, s->src);
    bool freed;
    pump_one(s, KVT_GROUPS_PER_TURN, &freed);
    s->ctx->pump_more = true;
    return 0;
}

int kvt_send_finish(kvt_send *s, int32_t first_token)
{
    return kvt_send_finish_n(s, &first_token, 1);
}

int kvt_send_finish_n(kvt_send *s, const int32_t *first_tokens, int32_t n)
{
    if (n < 1 || n > KVT_MAX_FIRST_TOKENS) return PD_EINVAL;
    if (s->state >= KVT_SEND_ENDING || s->finish_called || s->q_tail != s->n_layers)
        return PD_ESTATE;
    s->finish_called = true;
    memcpy(s->first_tokens, first_tokens, (size_t)n * sizeof *first_tokens);
    s->n_first = n;
    bool freed;
    pump_one(s, KVT_GROUPS_PER_TURN, &freed);
    s->ctx->pump_more = true;
    return 0;
}

void kvt__send_fail(kvt_send *s, int status, bool tell_peer, const char *fmt, ...)
{
    if (s->state >= KVT_SEND_ENDING) return;
    kvt_ctx *ctx = s->ctx;
    s->state = KVT_SEND_ENDING;
    s->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->detail, sizeof s->detail, fmt, ap);
    va_end(ap);
    s->tell_peer = tell_peer && s->start_sent && s->peer->state == KVT_PEER_READY;
    s->t_last = kvt__now_ns();
    kvt__rescan(ctx);
    if (!ctx->destroying && !s->orphan)
        pd_log(status == PD_ECANCELED ? PD_LOG_INFO : PD_LOG_WARN,
               "kvt[%s]: send of request %llu %s: %s (%s)", ctx->name,
               (unsigned long long)s->req_id, status == PD_ECANCELED ? "ended" : "failed",
               s->detail, pd_err_name(status));
    ctx->pump_more = true;
}

void kvt_send_cancel(kvt_send *s)
{
    if (s && s->state < KVT_SEND_ENDING)
        kvt__send_fail(s, PD_ECANCELED, true, "cancelled by the sender");
}

void kvt__send_free(kvt_send *s)
{
    kvt__list_del(&s->link);
    if (s->ev.kind) {
        kvt__list_del(&s->ev.link);
        s->ev.kind = 0;
    }
    if (s->state != KVT_SEND_ENDED) s->ctx->st.sends_active--;
    for (int32_t l = 0; l < s->n_layers; l++) release_after(s, l);
    kvt__peer_unref(s->peer);
    kvt__target_unref(s->t);
    free(s->src);
    free(s->dst);
    free(s->layer_ready);
    free(s->layer_after);
    free(s->queue);
    free(s->layer_sum);
    free(s);
}

void kvt_send_destroy(kvt_send *s)
{
    if (!s) return;
    if (s->state == KVT_SEND_ENDED) {
        kvt__send_free(s);
        return;
    }
    s->orphan = true;
    if (s->state < KVT_SEND_ENDING)
        kvt__send_fail(s, PD_ECANCELED, true, "handle destroyed before the transfer ended");
}

/* ---------------------------------------------------------------- the pump */

static int post_ctrl_done(kvt_send *s)
{
    kvt_ctx *ctx = s->ctx;
    kvt__op *op = kvt__op_get(ctx, KVT_OP_CTRL);
    if (!op) return PD_ENOMEM;
    kvt__msg_done *d = &op->hdr.done;
    memset(d, 0, sizeof *d);
    d->req_id = s->req_id;
    d->xfer_id = s->xfer_id;
    d->pool_id = s->t->pool_id;
    d->meta_sum = s->meta_sum;
    d->bytes = s->bytes_total;
    d->n_blocks = s->n;
    d->first_token = s->first_tokens[0];
    d->n_first = s->n_first;
    for (int32_t i = 1; i < s->n_first; i++) d->more[i - 1] = s->first_tokens[i];
    if (s->checksum) {
        d->flags = 1;
        d->data_sum = kvt__data_sum(s->layer_sum, s->n_layers);
    }
    return kvt__send_ctrl(ctx, s->peer, op, KVT_AM_DONE, sizeof *d, NULL, 0);
}

static int post_start(kvt_send *s)
{
    kvt_ctx *ctx = s->ctx;
    kvt__op *op = kvt__op_get(ctx, KVT_OP_CTRL);
    if (!op) return PD_ENOMEM;
    int64_t budget = s->deadline_total + kvt__budget_ns(ctx, s->peer, s->bytes_total);
    s->deadline_total = kvt__now_ns() + budget;
    kvt__rescan(ctx);
    op->hdr.start = (kvt__msg_start){
        .src_ctx = ctx->id, .req_id = s->req_id, .xfer_id = s->xfer_id,
        .pool_id = s->t->pool_id, .fingerprint = s->t->src->fingerprint,
        .meta_sum = s->meta_sum, .bytes = s->bytes_total, .gen = s->peer->gen, .n_blocks = s->n,
        .n_layers = s->n_layers, .deadline_ms = (uint32_t)(budget / 1000000ll),
        .path = (uint32_t)s->path};
    return kvt__send_ctrl(ctx, s->peer, op, KVT_AM_START, sizeof op->hdr.start, NULL, 0);
}

static void flush_cb(void *request, ucs_status_t status, void *user_data)
{
    kvt__op *op = user_data;
    kvt__op_complete(op->ctx, op, status);
    ucp_request_free(request);
}

static void post_flush(kvt_send *s)
{
    kvt_ctx *ctx = s->ctx;
    kvt__op *op = kvt__op_get(ctx, KVT_OP_FLUSH);
    if (!op) {
        kvt__send_fail(s, PD_ENOMEM, true, "out of memory");
        return;
    }
    op->send = s;
    op->peer = s->peer;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = flush_cb,
        .user_data = op,
    };
    if (s->inflight == 0) s->t_last = kvt__now_ns(), kvt__rescan(ctx);
    ctx->ops_in_flight++;
    s->peer->inflight++;
    s->inflight++;
    s->flush_posted = true;
    void *req = ucp_ep_flush_nbx(s->peer->ep, &prm);
    if (req == NULL) kvt__op_complete(ctx, op, UCS_OK);
    else if (UCS_PTR_IS_ERR(req)) kvt__op_complete(ctx, op, UCS_PTR_STATUS(req));
    else op->req = req;
}

/* The device path: every ready layer's copies queued at once with the device engine, after
 * the layer's readiness handle (no window: they wait on the device, not here). Their
 * completion is polled by kvt__dev_ops_poll. Returns how many layers it queued. */
static int pump_device(kvt_send *s)
{
    kvt_ctx *ctx = s->ctx;
    int n = 0;
    while (s->state == KVT_SEND_ACTIVE && s->q_head < s->q_tail) {
        int32_t layer = s->queue[s->q_head++];
        kvt__op *op = kvt__op_get(ctx, KVT_OP_DEVICE);
        if (!op) {
            kvt__send_fail(s, PD_ENOMEM, true, "out of memory");
            break;
        }
        void *token = NULL;
        int rc = ctx->device.copy_layer(ctx->device.arg, s->t->dev_remote, layer, s->src, s->dst,
                                        s->n, s->layer_after[layer], &token);
        release_after(s, layer);
        if (rc < 0) {
            kvt__op_put(ctx, op);
            kvt__send_fail(s, rc, true, "cannot queue the device copy of layer %d", layer);
            break;
        }
        op->send = s;
        op->req = token;
        op->bytes = 2u * (uint64_t)s->n * s->t->src->bb;
        s->bytes_posted += op->bytes;
        if (s->inflight == 0) s->t_last = kvt__now_ns(), kvt__rescan(ctx);
        ctx->ops_in_flight++;
        s->inflight++;
        kvt__list_add(&ctx->dev_ops, &op->dev_link);
        s->layer_ready[layer] = 2;
        s->n_posted_layers++;
        n++;
    }
    return n;
}

/* Posts up to budget groups of s and moves it through its phases. Returns how many things
 * happened; *freed says that s ended as an orphan and is gone. */
static int pump_one(kvt_send *s, int budget, bool *freed)
{
    kvt_ctx *ctx = s->ctx;
    int n = 0;
    *freed = false;
    if (s->state == KVT_SEND_WAIT_CONN) {
        if (s->peer->state != KVT_PEER_READY) return 0;
        s->path = s->t->path;
        s->state = KVT_SEND_ACTIVE;
        s->start_sent = true;
        int rc = post_start(s);
        if (rc < 0) kvt__send_fail(s, rc, false, "cannot send START");
        n++;
    }
    if (s->path == KVT_PATH_DEVICE) n += pump_device(s);
    const kvt__path_ops *path = s->path == KVT_PATH_PUT ? &path_put
                                : s->t->src->staged    ? &path_staged
                                                       : &path_am;
    bool direct = s->path == KVT_PATH_PUT && s->t->lptr;
    /* A process that was frozen must not resume writing past its deadline (the receiver may
     * have reused the slots); checked once per turn of at most budget groups. */
    int64_t now = 0;
    if (s->state == KVT_SEND_ACTIVE && (s->cur_layer >= 0 || s->q_head < s->q_tail)) {
        now = kvt__now_ns();
        if (now >= s->deadline_total)
            kvt__send_fail(s, PD_ETIMEDOUT, true, "deadline passed with layers still to write");
    }
    while (s->path != KVT_PATH_DEVICE && s->state == KVT_SEND_ACTIVE && budget > 0 &&
           ctx->data_inflight < ctx->p.window) {
        if (s->cur_layer < 0 && s->q_head == s->q_tail) break;
        if (path->can_post && !path->can_post(s)) break; /* a completion frees resources */
        if (s->cur_layer < 0) {
            int32_t next = s->queue[s->q_head];
            void *after = s->layer_after[next];
            if (after && !s->t->src->staged) {
                /* UCX reads the source itself (put, AM; a CUDA pool): the layer's KV must be
                 * final first. Polled, never waited for; the staged path orders its copies
                 * after the event on the copy stream instead. */
                int ready = ctx->device.poll(ctx->device.arg, after);
                if (ready == 0) {
                    ctx->pump_more = true;
                    break;
                }
                release_after(s, next);
                if (ready < 0) {
                    kvt__send_fail(s, PD_EBACKEND, true, "layer %d's readiness failed", next);
                    break;
                }
            }
            s->cur_layer = s->queue[s->q_head++];
            s->cur_kv = 0;
            s->cur_pos = 0;
        }
        int32_t took;
        if (direct) {
            /* shm: a copy into our mapping of the receiver's segment, complete at once. */
            kvt__op tmp;
            void *req;
            took = put_post(s, &tmp, s->cur_layer, s->cur_kv, s->cur_pos, &req);
            s->bytes_posted += tmp.bytes;
            s->bytes_done += tmp.bytes;
            s->t_last = now;
        } else {
            kvt__op *op = kvt__op_get(ctx, KVT_OP_DATA);
            if (!op) {
                kvt__send_fail(s, PD_ENOMEM, true, "out of memory");
                break;
            }
            op->send = s;
            op->peer = s->peer;
            if (s->inflight == 0) s->t_last = now, kvt__rescan(ctx);
            ctx->ops_in_flight++;
            ctx->data_inflight++;
            s->peer->inflight++;
            s->inflight++;
            void *req = NULL;
            took = path->post(s, op, s->cur_layer, s->cur_kv, s->cur_pos, &req);
            s->bytes_posted += op->bytes;
            if (req == KVT_REQ_OWNED) {
                /* the path completes it */
            } else if (req == NULL) kvt__op_complete(ctx, op, UCS_OK);
            else if (UCS_PTR_IS_ERR(req)) kvt__op_complete(ctx, op, UCS_PTR_STATUS(req));
            else op->req = req;
        }
        s->cur_pos += took;
        if (s->cur_pos == s->n && ++s->cur_kv == 2) {
            s->layer_ready[s->cur_layer] = 2;
            s->n_posted_layers++;
            s->cur_layer = -1;
        } else if (s->cur_pos == s->n) {
            s->cur_pos = 0;
        }
        budget--;
        n++;
    }
    if (budget == 0 && s->state == KVT_SEND_ACTIVE && (s->cur_layer >= 0 || s->q_head < s->q_tail))
        ctx->pump_more = true; /* more to post without waiting for UCX */
    if (s->state == KVT_SEND_ACTIVE && s->finish_called && s->n_posted_layers == s->n_layers) {
        s->state = KVT_SEND_FLUSHING;
        if (s->path == KVT_PATH_PUT) post_flush(s);
        n++;
    }
    if (s->state == KVT_SEND_FLUSHING && s->inflight == 0 &&
        (s->path != KVT_PATH_PUT || s->flush_done)) {
        /* Flush (put) or every AM send completing (rendezvous: data delivered) orders DONE
         * after the data. */
        s->state = KVT_SEND_WAIT_ACK;
        s->t_done_sent = kvt__now_ns();
        if (s->t->lptr) __atomic_thread_fence(__ATOMIC_SEQ_CST); /* direct copies before DONE */
        kvt__rescan(ctx);
        PD_LOGD("kvt[%s]: request %llu: all data written %.3f ms after begin, DONE sent",
                ctx->name, (unsigned long long)s->req_id, (double)(s->t_done_sent - s->t_begin) / 1e6);
        int rc = post_ctrl_done(s);
        if (rc < 0) kvt__send_fail(s, rc, false, "cannot send DONE");
        n++;
    }
    if (s->state == KVT_SEND_ENDING && s->inflight == 0 && s->tell_peer &&
        s->path == KVT_PATH_PUT && !s->abort_flush && s->peer->state == KVT_PEER_READY) {
        /* Tell the receiver only once every write is complete at its side. */
        s->abort_flush = true;
        post_flush(s);
    }
    if (s->state == KVT_SEND_ENDING && s->inflight == 0) {
        if (s->tell_peer) {
            s->tell_peer = false;
            kvt__op *op = kvt__op_get(ctx, KVT_OP_CTRL);
            if (op && s->peer->state == KVT_PEER_READY) {
                memset(&op->hdr.ack, 0, sizeof op->hdr.ack);
                op->hdr.ack.req_id = s->req_id;
                op->hdr.ack.xfer_id = s->xfer_id;
                op->hdr.ack.status = s->status;
                snprintf(op->hdr.ack.detail, sizeof op->hdr.ack.detail, "%.95s", s->detail);
                kvt__send_ctrl(ctx, s->peer, op, KVT_AM_ABORT, sizeof op->hdr.ack, NULL, 0);
            } else if (op) {
                kvt__op_put(ctx, op);
            }
            n++;
        }
        if (s->inflight == 0) {
            s->state = KVT_SEND_ENDED;
            s->t_end = kvt__now_ns();
            if (--ctx->st.sends_active == 0) kvt__rescan(ctx); /* maybe idle now */
            if (s->orphan) kvt__send_free(s), *freed = true;
            else kvt__event_queue(ctx, &s->ev, 1, s->status ? KVT_EV_SEND_FAILED : KVT_EV_SEND_DONE);
            return n + 1;
        }
    }
    return n;
}

int kvt__sends_pump(kvt_ctx *ctx)
{
    int n = 0;
    ctx->pump_more = false;
    kvt__list *it, *nx;
    KVT_LIST_EACH_SAFE(it, nx, &ctx->sends)
    {
        kvt_send *s = KVT_CONTAINER(it, kvt_send, link);
        if (s->state == KVT_SEND_ENDED) continue;
        bool freed;
        n += pump_one(s, KVT_GROUPS_PER_TURN, &freed);
    }
    return n;
}

/* ---------------------------------------------------------------- failures and deadlines */

int kvt__sends_peer_failed(kvt_ctx *ctx, kvt__peer *peer)
{
    int n = 0;
    for (kvt__list *it = ctx->sends.next; it != &ctx->sends; it = it->next) {
        kvt_send *s = KVT_CONTAINER(it, kvt_send, link);
        if (s->peer == peer && s->state < KVT_SEND_ENDING) {
            kvt__send_fail(s, peer->status == PD_ETIMEDOUT || peer->status == PD_ECANCELED ||
                                      peer->status == PD_EPERM
                                  ? peer->status : PD_EUNAVAILABLE,
                           false, "decode side: %s", peer->detail);
            n++;
        }
    }
    return n;
}

void kvt__sends_deadlines(kvt_ctx *ctx, int64_t now, int64_t *next)
{
    int64_t window_bytes = (int64_t)ctx->p.window * ctx->p.max_op_kib * 1024;
    kvt__list *it, *nx;
    KVT_LIST_EACH_SAFE(it, nx, &ctx->sends)
    {
        kvt_send *s = KVT_CONTAINER(it, kvt_send, link);
        if (s->state == KVT_SEND_WAIT_CONN || s->state == KVT_SEND_ENDED) continue;
        /* Operations in flight must keep completing (a frozen or cut-off peer stalls them).
         * Device copies wait for our own compute, not for the peer: the deadline bounds them. */
        if (s->inflight > 0 && s->path != KVT_PATH_DEVICE) {
            int64_t stall = s->t_last + kvt__budget_ns(ctx, s->peer, (uint64_t)window_bytes);
            if (now >= stall) {
                kvt__peer_fail(s->peer, PD_ETIMEDOUT, "writes to %016llx made no progress for "
                               "%.0f ms (request %llu, %.1f of %.1f MiB done)",
                               (unsigned long long)s->peer->remote_id, (double)(now - s->t_last) / 1e6,
                               (unsigned long long)s->req_id, (double)s->bytes_done / 1048576.0,
                               (double)s->bytes_total / 1048576.0);
                continue;
            }
            if (stall < *next) *next = stall;
        }
        if (s->state == KVT_SEND_ENDING) continue;
        if (s->state == KVT_SEND_WAIT_ACK) {
            int64_t ack = s->t_done_sent + (int64_t)ctx->p.deadline_min_ms * 1000000ll +
                          (s->checksum ? kvt__budget_ns(ctx, s->peer, s->bytes_total) : 0);
            if (now >= ack) {
                kvt__send_fail(s, PD_ETIMEDOUT, true, "no ACK from the decode side within %.0f ms "
                               "of DONE", (double)(now - s->t_done_sent) / 1e6);
                continue;
            }
            if (ack < *next) *next = ack;
        }
        if (now >= s->deadline_total) {
            kvt__send_fail(s, PD_ETIMEDOUT, true, "transfer did not finish within its deadline "
                           "(%.0f ms after START; layers ready %d of %d, %.1f of %.1f MiB done)",
                           (double)(now - s->t_begin) / 1e6, s->q_tail, s->n_layers,
                           (double)s->bytes_done / 1048576.0, (double)s->bytes_total / 1048576.0);
            continue;
        }
        if (s->deadline_total < *next) *next = s->deadline_total;
    }
}

ucs_status_t kvt__am_ack(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                         const ucp_am_recv_param_t *param)
{
    kvt_ctx *ctx = arg;
    (void)data, (void)len, (void)param;
    kvt__msg_ack h;
    if (!kvt__msg_ack_read(hdr, hlen, &h)) return UCS_OK;
    for (kvt__list *it = ctx->sends.next; it != &ctx->sends; it = it->next) {
        kvt_send *s = KVT_CONTAINER(it, kvt_send, link);
        if (s->xfer_id != h.xfer_id || s->req_id != h.req_id) continue;
        if (h.status < 0) {
            /* Answered with ABORT once our last write is complete (the receiver holds the
             * slots until then). */
            kvt__send_fail(s, h.status, true, "decode side: %s", h.detail);
        } else if (s->state == KVT_SEND_WAIT_ACK) {
            PD_LOGD("kvt[%s]: request %llu: ACK %.3f ms after DONE", ctx->name,
                    (unsigned long long)s->req_id, (double)(kvt__now_ns() - s->t_done_sent) / 1e6);
            s->acked = true;
            s->state = KVT_SEND_ENDING;
            s->status = 0;
            s->detail[0] = 0;
            ctx->pump_more = true;
        }
        break;
    }
    return UCS_OK;
}
