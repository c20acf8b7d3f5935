/* kvt_ctx.c -- The kvtransfer context: UCX context and worker setup (with the checks that keep
 * a same-host transfer off a silent tcp fallback), the progress / arm / wait loop, deadline
 * ticks, the UCX operation records and the delivery of terminal events. */
#include "kvtransfer/kvt_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"

#define KVT_OP_CHUNK 256
#define KVT_TICK_NS 1000000000ll /* rescan at least this often while transfers are active */
/* A deadline check that runs this much later than planned means this process itself was
 * frozen (SIGSTOP, a stopped VM) or starved: not its peers' fault. Deadlines then wait
 * KVT_GRACE_NS more, so that what the peers sent meanwhile (aborts, completions, the router's
 * cancels) is read before any of them is blamed. */
#define KVT_LATE_NS 1000000000ll
#define KVT_GRACE_NS 2000000000ll

kvt_params kvt_default_params(void)
{
    kvt_params p;
    memset(&p, 0, sizeof p);
    p.path = KVT_PATH_AUTO;
    p.deadline_slack = 4.0;
    p.deadline_min_ms = 2000;
    p.connect_timeout_ms = 5000;
    p.compute_timeout_ms = 30000;
    p.start_timeout_ms = 60000;
    p.window = 64;
    p.max_op_kib = 1024;
    p.am_max_kib = 256;
    p.am_staging_slots = 32;
    p.keepalive_ms = 1000;
    p.spin_us = 100;
    return p;
}

const char *kvt_path_name(kvt_path p)
{
    switch (p) {
    case KVT_PATH_AUTO: return "auto";
    case KVT_PATH_PUT: return "put";
    case KVT_PATH_AM: return "am";
    case KVT_PATH_DEVICE: return "device";
    }
    return "?";
}

const char *kvt_transport_name(kvt_transport t)
{
    switch (t) {
    case KVT_TRANSPORT_SELF: return "self";
    case KVT_TRANSPORT_SHM: return "shm";
    case KVT_TRANSPORT_TCP: return "tcp";
    case KVT_TRANSPORT_RDMA: return "rdma";
    case KVT_TRANSPORT_UNKNOWN: break;
    }
    return "unknown";
}

int64_t kvt__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

int64_t kvt__budget_ns(const kvt_ctx *ctx, const kvt__peer *peer, uint64_t bytes)
{
    double bw = ctx->p.bw_gbps;
    if (bw <= 0) {
        kvt_transport t = peer ? peer->transport : KVT_TRANSPORT_UNKNOWN;
        bw = (t == KVT_TRANSPORT_SHM || t == KVT_TRANSPORT_RDMA || t == KVT_TRANSPORT_SELF)
                 ? 2.0 : 0.25;
    }
    /* bytes / (GB/s) is nanoseconds. */
    return (int64_t)ctx->p.deadline_min_ms * 1000000ll +
           (int64_t)(ctx->p.deadline_slack * (double)bytes / bw);
}

int kvt__pd_status(ucs_status_t s)
{
    switch (s) {
    case UCS_OK: return 0;
    case UCS_ERR_NO_MEMORY: return PD_ENOMEM;
    case UCS_ERR_CANCELED: return PD_ECANCELED;
    case UCS_ERR_TIMED_OUT: return PD_ETIMEDOUT;
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED: return PD_EUNAVAILABLE;
    case UCS_ERR_INVALID_PARAM: return PD_EINVAL;
    default: return PD_EIO;
    }
}

/* ---------------------------------------------------------------- ops */

kvt__op *kvt__op_get(kvt_ctx *ctx, int kind)
{
    if (!ctx->op_free) {
        void **chunks = realloc(ctx->op_chunks, sizeof *chunks * (size_t)(ctx->n_op_chunks + 1));
        if (!chunks) return NULL;
        ctx->op_chunks = chunks;
        kvt__op *c = calloc(KVT_OP_CHUNK, sizeof *c);
        if (!c) return NULL;
        chunks[ctx->n_op_chunks++] = c;
        for (int i = KVT_OP_CHUNK - 1; i >= 0; i--) {
            c[i].next_free = ctx->op_free;
            ctx->op_free = &c[i];
        }
    }
    kvt__op *op = ctx->op_free;
    ctx->op_free = op->next_free;
    op->next_free = NULL;
    op->ctx = ctx;
    op->kind = kind;
    op->peer = NULL;
    op->send = NULL;
    op->resv = NULL;
    op->bytes = 0;
    op->ring = NULL;
    op->phase = 0;
    op->req = NULL;
    op->stage = -1;
    return op;
}

char kvt__req_owned;

void kvt__op_put(kvt_ctx *ctx, kvt__op *op)
{
    op->kind = 0;
    op->req = NULL;
    op->next_free = ctx->op_free;
    ctx->op_free = op;
}

void kvt__op_complete(kvt_ctx *ctx, kvt__op *op, ucs_status_t status)
{
    ctx->ops_in_flight--;
    if (op->peer) op->peer->inflight--;
    switch (op->kind) {
    case KVT_OP_DATA:
    case KVT_OP_FLUSH: {
        kvt_send *s = op->send;
        s->inflight--;
        if (op->kind == KVT_OP_DATA) ctx->data_inflight--;
        if (op->stage >= 0 && op->ring) kvt__ring_put(op->ring, op->stage);
        else if (op->stage >= 0) ctx->stage_free[ctx->n_stage_free++] = op->stage;
        op->stage = -1;
        if (status == UCS_OK) {
            s->t_last = kvt__now_ns();
            if (op->kind == KVT_OP_DATA) s->bytes_done += op->bytes;
            else s->flush_done = true;
        } else if (s->state < KVT_SEND_ENDING) {
            kvt__send_fail(s, kvt__pd_status(status), true, "%s failed: %s",
                           op->kind == KVT_OP_DATA ? "block write" : "flush",
                           ucs_status_string(status));
        }
        break;
    }
    case KVT_OP_DEVICE: {
        kvt_send *s = op->send;
        s->inflight--;
        if (status == UCS_OK) {
            s->t_last = kvt__now_ns();
            s->bytes_done += op->bytes;
        } else if (s->state < KVT_SEND_ENDING) {
            kvt__send_fail(s, PD_EBACKEND, true, "device copy failed");
        }
        break;
    }
    case KVT_OP_RECV: {
        kvt__resv *r = op->resv;
        r->inflight--;
        if (op->stage >= 0) kvt__ring_put(op->ring, op->stage), op->stage = -1;
        if (status == UCS_OK) r->bytes_landed += op->bytes;
        else if (r->state < KVT_RESV_ENDING)
            kvt__resv_fail(r, kvt__pd_status(status), true, "block receive failed: %s",
                           ucs_status_string(status));
        if (kvt__list_empty(&r->dirty)) kvt__list_add(&ctx->dirty_resvs, &r->dirty);
        break;
    }
    case KVT_OP_CTRL:
        if (status != UCS_OK && op->peer && op->peer->state <= KVT_PEER_READY)
            kvt__peer_fail(op->peer, kvt__pd_status(status), "control message failed: %s",
                           ucs_status_string(status));
        break;
    default: PD_ASSERT(0, "kvt: completion of an unknown op");
    }
    if (op->peer && op->peer->state >= KVT_PEER_FAILED) kvt__peer_mark_dirty(op->peer);
    kvt__op_put(ctx, op);
}

static void ctrl_cb(void *request, ucs_status_t status, void *user_data)
{
    kvt__op *op = user_data;
    kvt__op_complete(op->ctx, op, status);
    ucp_request_free(request);
}

int kvt__send_ctrl(kvt_ctx *ctx, kvt__peer *peer, kvt__op *op, unsigned am_id, size_t hlen,
                   const void *data, size_t dlen)
{
    op->peer = peer;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = ctrl_cb,
        .user_data = op,
        .flags = UCP_AM_SEND_FLAG_EAGER,
    };
    ctx->ops_in_flight++;
    peer->inflight++;
    void *req = ucp_am_send_nbx(peer->ep, am_id, &op->hdr, hlen, data, dlen, &prm);
    if (req == NULL) {
        kvt__op_complete(ctx, op, UCS_OK);
        return 0;
    }
    if (UCS_PTR_IS_ERR(req)) {
        ucs_status_t st = UCS_PTR_STATUS(req);
        kvt__op_complete(ctx, op, st);
        return kvt__pd_status(st);
    }
    op->req = req;
    return 0;
}

/* ---------------------------------------------------------------- events */

void kvt__event_queue(kvt_ctx *ctx, kvt__evq *q, int kind, kvt_event_type type)
{
    PD_ASSERT(q->kind == 0, "kvt: a transfer's event queued twice");
    q->kind = kind;
    q->type = type;
    kvt__list_add(&ctx->events, &q->link);
}

static int dispatch_events(kvt_ctx *ctx)
{
    int n = 0;
    while (!kvt__list_empty(&ctx->events) && !ctx->destroying) {
        kvt__evq *q = KVT_CONTAINER(ctx->events.next, kvt__evq, link);
        kvt__list_del(&q->link);
        kvt_event ev;
        memset(&ev, 0, sizeof ev);
        ev.type = q->type;
        ev.first_token = -1;
        int32_t firsts[KVT_MAX_FIRST_TOKENS];
        char detail[160];
        if (q->kind == 1) {
            kvt_send *s = KVT_CONTAINER(q, kvt_send, ev);
            q->kind = 0;
            ev.status = s->status;
            ev.req_id = s->req_id;
            ev.send = s;
            ev.user = s->user;
            ev.n_blocks = s->n;
            if (s->status == 0) {
                ev.first_token = s->first_tokens[0];
                ev.first_tokens = s->first_tokens;
                ev.n_first_tokens = s->n_first;
            }
            ev.bytes = s->bytes_done;
            ev.elapsed_ns = s->t_end - s->t_begin;
            ev.path = s->path;
            snprintf(detail, sizeof detail, "%s", s->detail);
            if (s->status == 0) ctx->st.sends_done++, ctx->st.bytes_sent += s->bytes_done;
            else ctx->st.sends_failed++;
        } else {
            kvt__resv *r = KVT_CONTAINER(q, kvt__resv, ev);
            q->kind = 0;
            ev.status = r->status;
            ev.req_id = r->req_id;
            ev.pool = r->pool;
            ev.user = r->user;
            ev.n_blocks = r->n;
            ev.bytes = r->bytes_expected;
            ev.elapsed_ns = r->t_start ? kvt__now_ns() - r->t_start : 0;
            ev.path = (kvt_path)r->path;
            snprintf(detail, sizeof detail, "%s", r->detail);
            if (q->type == KVT_EV_RECV_DONE) {
                ev.first_token = firsts[0] = r->done.first_token;
                int32_t nf = r->done.n_first;
                if (nf < 1 || nf > KVT_MAX_FIRST_TOKENS) nf = 1; /* (checked at DONE) */
                for (int32_t i = 1; i < nf; i++) firsts[i] = r->done.more[i - 1];
                ev.first_tokens = firsts;
                ev.n_first_tokens = nf;
                ctx->st.recvs_done++;
                ctx->st.bytes_received += r->bytes_expected;
            } else {
                ctx->st.recvs_failed++;
                kvt__resv_free(r); /* the slots are free when the event arrives */
            }
        }
        ev.detail = detail;
        ctx->p.on_event(ctx->p.on_event_arg, &ev);
        n++;
    }
    return n;
}

/* ---------------------------------------------------------------- progress */

/* Fires expired deadlines and computes the next one exactly (INT64_MAX when nothing has a
 * deadline, so that an idle process sleeps until the fd wakes it). Whatever adds or moves a
 * deadline earlier calls kvt__rescan(). */
static void check_deadlines(kvt_ctx *ctx, int64_t now)
{
    int64_t next = INT64_MAX;
    kvt__peers_deadlines(ctx, now, &next);
    kvt__resvs_deadlines(ctx, now, &next);
    kvt__sends_deadlines(ctx, now, &next);
    if ((ctx->st.sends_active > 0 || ctx->st.recvs_active > 0) && next > now + KVT_TICK_NS)
        next = now + KVT_TICK_NS;
    ctx->next_deadline_check = next;
}

void kvt__rescan(kvt_ctx *ctx) { ctx->next_deadline_check = 0; }

int kvt_progress(kvt_ctx *ctx)
{
    int total = 0;
    if (ctx->next_deadline_check != INT64_MAX) {
        int64_t now = kvt__now_ns();
        if (ctx->next_deadline_check > 0 && now - ctx->next_deadline_check > KVT_LATE_NS) {
            PD_LOGW("kvt[%s]: this process ran %.1f s late (frozen or starved): its transfer "
                    "deadlines wait %.0f s more before blaming a peer", ctx->name,
                    (double)(now - ctx->next_deadline_check) / 1e9, (double)KVT_GRACE_NS / 1e9);
            ctx->grace_until = now + KVT_GRACE_NS;
            ctx->st.late_wakeups++;
        }
        if (now >= ctx->next_deadline_check) {
            if (now < ctx->grace_until) ctx->next_deadline_check = ctx->grace_until;
            else check_deadlines(ctx, now);
        }
    }
    for (int round = 0; round < 64; round++) {
        int n = 0;
        unsigned k;
        int spins = 0;
        while ((k = ucp_worker_progress(ctx->worker)) != 0 && spins++ < 4096) n += (int)k;
        n += kvt__peers_process(ctx);
        n += kvt__resvs_process(ctx);
        n += kvt__sends_pump(ctx);
        if (!kvt__list_empty(&ctx->dev_ops)) n += kvt__dev_ops_poll(ctx);
        total += n;
        if (n == 0) break;
    }
    if (ctx->n_prefault > 0) total += kvt__targets_prefault(ctx);
    total += dispatch_events(ctx);
    if (total > 0) ctx->last_activity = kvt__now_ns();
    return total;
}

int kvt_timeout_ms(const kvt_ctx *ctx)
{
    if (ctx->next_deadline_check == INT64_MAX) return -1;
    int64_t d = ctx->next_deadline_check - kvt__now_ns();
    if (d <= 0) return 0;
    return (int)((d + 999999) / 1000000);
}

int kvt_arm(kvt_ctx *ctx)
{
    if (!kvt__list_empty(&ctx->events) || !kvt__list_empty(&ctx->dirty_peers) ||
        !kvt__list_empty(&ctx->dirty_resvs) || ctx->pump_more || ctx->n_prefault > 0 ||
        !kvt__list_empty(&ctx->dev_ops) || ctx->n_pending > 0)
        return 1; /* (device copies complete without a wakeup: poll them) */
    if (ctx->p.spin_us > 0 && (ctx->st.sends_active > 0 || ctx->st.recvs_active > 0) &&
        kvt__now_ns() - ctx->last_activity < (int64_t)ctx->p.spin_us * 1000)
        return 1; /* poll a little longer: the next message is likely close */
    ucs_status_t st = ucp_worker_arm(ctx->worker);
    if (st == UCS_OK) return 0;
    if (st != UCS_ERR_BUSY) PD_LOGW("kvt[%s]: ucp_worker_arm: %s", ctx->name, ucs_status_string(st));
    return 1;
}

int kvt_wait(kvt_ctx *ctx, int max_ms)
{
    int n = kvt_progress(ctx);
    if (n > 0 || max_ms == 0) return n;
    if (kvt_arm(ctx) != 0) return kvt_progress(ctx);
    int to = kvt_timeout_ms(ctx);
    if (to < 0 || to > max_ms) to = max_ms;
    struct pollfd pfd = {.fd = ctx->efd, .events = POLLIN};
    if (poll(&pfd, 1, to) < 0 && errno != EINTR)
        PD_LOGW("kvt[%s]: poll: %s", ctx->name, strerror(errno));
    return kvt_progress(ctx);
}

int kvt_fd(const kvt_ctx *ctx) { return ctx->efd; }

uint32_t kvt_ctx_mem_types(const kvt_ctx *ctx) { return ctx->mem_types; }

void kvt_ctx_stats(const kvt_ctx *ctx, kvt_stats *out)
{
    *out = ctx->st;
    out->ops_in_flight = ctx->ops_in_flight;
    int n = 0;
    for (const kvt__list *it = ctx->peers.next; it != &ctx->peers; it = it->next) {
        const kvt__peer *p = KVT_CONTAINER(it, kvt__peer, link);
        if (p->state == KVT_PEER_READY) n++;
    }
    out->peers = n;
    for (const kvt__list *it = ctx->pools.next; it != &ctx->pools; it = it->next) {
        const kvt_pool *pool = KVT_CONTAINER(it, kvt_pool, link);
        if (!pool->staged) continue;
        out->ring_slots += pool->ring_n;
        out->ring_free += pool->ring_n_free;
    }
    out->ring_waiting = ctx->n_pending;
    memcpy(out->peers_by_transport, ctx->peers_by_transport, sizeof out->peers_by_transport);
}

/* ---------------------------------------------------------------- create / destroy */

/* Lists the context's UCX resources ("tcp/lo sysv/memory ...") from ucp_context_print_info. */
static void list_resources(ucp_context_h uctx, char *out, size_t cap, bool *has_shm,
                           bool *has_tcp)
{
    out[0] = 0;
    *has_shm = *has_tcp = false;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return;
    ucp_context_print_info(uctx, f);
    fclose(f);
    size_t used = 0;
    for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strstr(line, "resource")) continue;
        char *dash = strstr(line, "-- ");
        if (!dash) continue;
        char *name = dash + 3;
        if (!strncmp(name, "sysv", 4) || !strncmp(name, "posix", 5) || !strncmp(name, "cma", 3) ||
            !strncmp(name, "xpmem", 5) || !strncmp(name, "knem", 4))
            *has_shm = true;
        if (!strncmp(name, "tcp", 3)) *has_tcp = true;
        int w = snprintf(out + used, cap - used, "%s%s", used ? " " : "", name);
        if (w < 0 || (size_t)w >= cap - used) break;
        used += (size_t)w;
    }
    free(buf);
}

static uint64_t random_u64(void)
{
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) v = 0;
        close(fd);
    }
    if (!v) v = (uint64_t)kvt__now_ns() ^ ((uint64_t)getpid() << 32);
    return v;
}

static int set_handlers(kvt_ctx *ctx, char *err)
{
    static ucp_am_recv_callback_t cbs[KVT_AM_COUNT] = {
        kvt__am_hello, kvt__am_hello_ack, kvt__am_start, kvt__am_block,
        kvt__am_done,  kvt__am_ack,       kvt__am_abort,
    };
    for (unsigned i = 0; i < KVT_AM_COUNT; i++) {
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
            .id = KVT_AM_HELLO + i,
            .flags = UCP_AM_FLAG_WHOLE_MSG,
            .cb = cbs[i],
            .arg = ctx,
        };
        ucs_status_t st = ucp_worker_set_am_recv_handler(ctx->worker, &hp);
        if (st != UCS_OK)
            return pd_errf(err, PD_EUNAVAILABLE, "ucp_worker_set_am_recv_handler: %s",
                           ucs_status_string(st));
    }
    return 0;
}

static int config_set(ucp_config_t *cfg, const char *key, const char *val, char *err)
{
    ucs_status_t st = ucp_config_modify(cfg, key, val);
    if (st != UCS_OK)
        return pd_errf(err, PD_EINVAL, "UCX setting %s=%s: %s", key, val, ucs_status_string(st));
    return 0;
}

/* Whether UCX_TLS (the parameter, else the environment) can select a shm transport, so that
 * setting MM_ERROR_HANDLING does not draw UCX's "invalid configuration" warning. */
static bool tls_may_have_shm(const char *tls)
{
    if (!tls) tls = getenv("UCX_TLS");
    if (!tls || tls[0] == '^') return true;
    static const char *names[] = {"sysv", "posix", "mm", "sm", "all"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (strstr(tls, names[i])) return true;
    return false;
}

static void read_boot_id(char out[40])
{
    out[0] = 0;
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f) return;
    if (!fgets(out, 40, f)) out[0] = 0;
    fclose(f);
    out[strcspn(out, "\n")] = 0;
}

int kvt_ctx_create(const kvt_params *p, kvt_ctx **out, char *err)
{
    *out = NULL;
    if (!p || !p->on_event) return pd_errf(err, PD_EINVAL, "kvt: on_event is required");
    if (p->window < 1 || p->deadline_min_ms < 1 || p->deadline_slack < 1 || p->bw_gbps < 0 ||
        p->connect_timeout_ms < 1 || p->compute_timeout_ms < 1 || p->start_timeout_ms < 0 ||
        p->max_op_kib < 1 || p->am_max_kib < 1 || p->am_max_kib > (1 << 20) ||
        p->am_staging_slots < 0 || p->am_staging_slots > 4096 ||
        p->keepalive_ms < 0 || p->spin_us < 0 || p->spin_us > 1000000 || p->path > KVT_PATH_AM)
        return pd_errf(err, PD_EINVAL, "kvt: a parameter is out of range");
    kvt_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    ctx->p = *p;
    snprintf(ctx->name, sizeof ctx->name, "%s", p->name ? p->name : "kvt");
    ctx->p.name = ctx->name;
    ctx->p.ucx_tls = ctx->p.ucx_net_devices = NULL;
    ctx->p.secret_file = NULL;
    ctx->efd = -1;
    kvt__list_init(&ctx->pools);
    kvt__list_init(&ctx->targets);
    kvt__list_init(&ctx->peers);
    kvt__list_init(&ctx->sends);
    kvt__list_init(&ctx->dirty_peers);
    kvt__list_init(&ctx->dirty_resvs);
    kvt__list_init(&ctx->events);
    kvt__list_init(&ctx->nacks);
    kvt__list_init(&ctx->dev_ops);
    if (p->device) {
        const kvt_device_ops *d = p->device;
        bool path = d->open && d->close && d->copy_layer, none = !d->open && !d->close &&
                                                                 !d->copy_layer;
        bool stage = d->stage_out && d->stage_in, no_stage = !d->stage_out && !d->stage_in;
        if (!(path || none) || !(stage || no_stage) || (none && no_stage) || !d->poll ||
            !d->release || (!d->host_pin) != (!d->host_unpin)) {
            free(ctx);
            return pd_errf(err, PD_EINVAL, "kvt: kvt_params.device needs every function");
        }
        ctx->device = *p->device;
    }
    ctx->p.device = NULL; /* (copied into ctx->device) */
    ctx->id = random_u64();
    ctx->next_xfer_id = random_u64() >> 16;
    ctx->next_gen = (uint32_t)random_u64();
    ctx->next_pool_id = random_u64();
    read_boot_id(ctx->boot_id);

    int rc = 0;
    ucp_config_t *cfg = NULL;
    if (p->secret_file) {
        if (!(ctx->secret = malloc(sizeof *ctx->secret))) {
            rc = pd_errf(err, PD_ENOMEM, "kvt: out of memory");
            goto fail;
        }
        if ((rc = kvt__secret_load(p->secret_file, ctx->secret, err)) < 0) goto fail;
    }
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        rc = pd_errf(err, PD_EUNAVAILABLE, "ucp_config_read: %s", ucs_status_string(st));
        goto fail;
    }
    bool shm_eh = false;
    if (p->ucx_tls && (rc = config_set(cfg, "TLS", p->ucx_tls, err)) < 0) goto fail_cfg;
    if (p->ucx_net_devices && (rc = config_set(cfg, "NET_DEVICES", p->ucx_net_devices, err)) < 0)
        goto fail_cfg;
    /* Peer-failure mode removes shm transports unless they handle errors: turn that on, or a
     * same-host pair silently falls back to tcp (the UCX default is off). */
    const char *mm_env = getenv("UCX_MM_ERROR_HANDLING");
    if (!p->no_shm_error_handling && !mm_env && !getenv("UCX_SYSV_ERROR_HANDLING") &&
        !getenv("UCX_POSIX_ERROR_HANDLING") && tls_may_have_shm(p->ucx_tls)) {
        if ((rc = config_set(cfg, "MM_ERROR_HANDLING", "y", err)) < 0) goto fail_cfg;
        shm_eh = true;
    } else if (mm_env) {
        shm_eh = (mm_env[0] == 'y' || mm_env[0] == 'Y' || mm_env[0] == '1');
    }
    if (p->keepalive_ms > 0 && !getenv("UCX_KEEPALIVE_INTERVAL")) {
        char v[32];
        snprintf(v, sizeof v, "%dms", p->keepalive_ms);
        if ((rc = config_set(cfg, "KEEPALIVE_INTERVAL", v, err)) < 0) goto fail_cfg;
    }
    ucp_params_t up = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .name = ctx->name,
    };
    st = ucp_init(&up, cfg, &ctx->uctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        rc = pd_errf(err, PD_EUNAVAILABLE, "ucp_init: %s", ucs_status_string(st));
        goto fail;
    }
    ucp_context_attr_t ca = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
    if (ucp_context_query(ctx->uctx, &ca) == UCS_OK) {
        ctx->mem_types = 1u << KVT_MEM_HOST;
        if (ca.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) ctx->mem_types |= 1u << KVT_MEM_CUDA;
    }
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
    };
    st = ucp_worker_create(ctx->uctx, &wp, &ctx->worker);
    if (st != UCS_OK) {
        rc = pd_errf(err, PD_EUNAVAILABLE, "ucp_worker_create: %s", ucs_status_string(st));
        goto fail;
    }
    st = ucp_worker_get_efd(ctx->worker, &ctx->efd);
    if (st != UCS_OK) {
        rc = pd_errf(err, PD_EUNAVAILABLE, "ucp_worker_get_efd: %s", ucs_status_string(st));
        goto fail;
    }
    ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS};
    if (p->net_only) {
        wa.field_mask |= UCP_WORKER_ATTR_FIELD_ADDRESS_FLAGS;
        wa.address_flags = UCP_WORKER_ADDRESS_FLAG_NET_ONLY;
    }
    st = ucp_worker_query(ctx->worker, &wa);
    if (st != UCS_OK) {
        rc = pd_errf(err, PD_EUNAVAILABLE, "ucp_worker_query: %s", ucs_status_string(st));
        goto fail;
    }
    ctx->addr = malloc(wa.address_length);
    if (!ctx->addr) {
        ucp_worker_release_address(ctx->worker, wa.address);
        rc = pd_errf(err, PD_ENOMEM, "kvt: out of memory");
        goto fail;
    }
    memcpy(ctx->addr, wa.address, wa.address_length);
    ctx->addr_len = wa.address_length;
    ucp_worker_release_address(ctx->worker, wa.address);
    if ((rc = set_handlers(ctx, err)) < 0) goto fail;

    char res[512];
    bool has_shm, has_tcp;
    list_resources(ctx->uctx, res, sizeof res, &has_shm, &has_tcp);
    ctx->has_shm = has_shm;
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    if (maj != 1 || min < 13 || min > 16)
        PD_LOGW("kvt[%s]: UCX %u.%u: descriptor checks know the address and key formats of "
                "1.13-1.16 only; descriptors in another format are refused", ctx->name, maj, min);
    PD_LOGI("kvt[%s]: UCX %u.%u.%u; transports: %s; memory: host%s; shm peer-failure handling "
            "%s; data path %s; keepalive %s; address %zu B%s; peers %s",
            ctx->name, maj, min, rel, res[0] ? res : "(none)",
            (ctx->mem_types & (1u << KVT_MEM_CUDA)) ? "+cuda" : " only (GPU KV is staged)",
            shm_eh ? "on" : "off", kvt_path_name(p->path),
            getenv("UCX_KEEPALIVE_INTERVAL") ? getenv("UCX_KEEPALIVE_INTERVAL") : "set by kvt",
            ctx->addr_len, p->net_only ? " (network only)" : "",
            ctx->secret ? "authenticated (shared secret)" : "not authenticated");
    if (has_shm && !shm_eh)
        PD_LOGW("kvt[%s]: shared memory cannot detect peer failure without "
                "UCX_MM_ERROR_HANDLING=y; same-host peers will fall back to tcp", ctx->name);
    if (!has_shm && !p->net_only)
        PD_LOGW("kvt[%s]: no shared-memory transport (UCX_TLS=%s): same-host peers use the "
                "network", ctx->name, getenv("UCX_TLS") ? getenv("UCX_TLS") : "default");
    *out = ctx;
    return 0;

fail_cfg:
    ucp_config_release(cfg);
fail:
    if (ctx->worker) ucp_worker_destroy(ctx->worker);
    if (ctx->uctx) ucp_cleanup(ctx->uctx);
    if (ctx->secret) kvt__secret_wipe(ctx->secret);
    free(ctx->secret);
    free(ctx->addr);
    free(ctx);
    return rc;
}

void kvt__ops_release(kvt_ctx *ctx, const kvt_pool *only)
{
    for (int c = 0; c < ctx->n_op_chunks; c++) {
        kvt__op *ops = ctx->op_chunks[c];
        for (int i = 0; i < KVT_OP_CHUNK; i++) {
            kvt__op *op = &ops[i];
            if (!op->kind || !op->req) continue;
            if (only && !(op->resv && op->resv->pool == only) &&
                !(op->send && op->send->t && op->send->t->src == only))
                continue;
            void *req = op->req;
            op->req = NULL;
            if (op->kind == KVT_OP_DEVICE || op->phase) { /* a copy that never ended */
                kvt__list_del(&op->dev_link);
                ctx->device.release(ctx->device.arg, req);
            } else {
                ucp_request_free(req); /* no callback comes for it any more */
            }
            kvt__op_complete(ctx, op, UCS_ERR_CANCELED);
        }
    }
}

void kvt__ops_release_peer(kvt_ctx *ctx, const kvt__peer *peer)
{
    int n = 0;
    for (int c = 0; c < ctx->n_op_chunks; c++) {
        kvt__op *ops = ctx->op_chunks[c];
        for (int i = 0; i < KVT_OP_CHUNK; i++) {
            kvt__op *op = &ops[i];
            if (!op->kind || !op->req || op->kind == KVT_OP_DEVICE || op->phase) continue;
            if (op->peer != peer && !(op->kind == KVT_OP_RECV && op->resv && op->resv->peer == peer))
                continue;
            void *req = op->req;
            op->req = NULL;
            ucp_request_free(req); /* no callback comes for it any more */
            kvt__op_complete(ctx, op, UCS_ERR_CANCELED);
            n++;
        }
    }
    if (n > 0)
        PD_LOGW("kvt[%s]: %d operations with %016llx did not end when its connection closed; "
                "released", ctx->name, n, (unsigned long long)peer->remote_id);
}

int kvt__dev_ops_poll(kvt_ctx *ctx)
{
    int n = 0;
    kvt__list *it, *nx;
    KVT_LIST_EACH_SAFE(it, nx, &ctx->dev_ops)
    {
        kvt__op *op = KVT_CONTAINER(it, kvt__op, dev_link);
        int r = ctx->device.poll(ctx->device.arg, op->req);
        if (r == 0) continue;
        kvt__list_del(&op->dev_link);
        ctx->device.release(ctx->device.arg, op->req);
        op->req = NULL;
        op->phase = 0;
        if (op->kind == KVT_OP_DATA) kvt__staged_send_post(ctx, op, r > 0); /* gathered */
        else kvt__op_complete(ctx, op, r > 0 ? UCS_OK : UCS_ERR_IO_ERROR);
        ctx->pump_more = true;
        n++;
    }
    return n;
}

static bool draining(const kvt_ctx *ctx)
{
    if (!kvt__list_empty(&ctx->sends)) return true;
    for (const kvt__list *it = ctx->pools.next; it != &ctx->pools; it = it->next)
        if (KVT_CONTAINER(it, kvt_pool, link)->n_resv > 0) return true;
    return false;
}

static bool closing(const kvt_ctx *ctx)
{
    if (ctx->ops_in_flight > 0) return true;
    for (const kvt__list *it = ctx->peers.next; it != &ctx->peers; it = it->next)
        if (KVT_CONTAINER(it, kvt__peer, link)->state != KVT_PEER_CLOSED) return true;
    return false;
}

void kvt_ctx_destroy(kvt_ctx *ctx)
{
    if (!ctx) return;
    ctx->destroying = true; /* no more events; ended transfers are freed silently */
    kvt__list *it, *nx;
    KVT_LIST_EACH_SAFE(it, nx, &ctx->sends)
    {
        kvt_send *s = KVT_CONTAINER(it, kvt_send, link);
        if (s->state == KVT_SEND_ENDED) {
            kvt__send_free(s);
            continue;
        }
        s->orphan = true;
        kvt__send_fail(s, PD_ECANCELED, true, "kvt context destroyed");
    }
    for (it = ctx->pools.next; it != &ctx->pools; it = it->next) {
        kvt_pool *pool = KVT_CONTAINER(it, kvt_pool, link);
        kvt__list *ri, *rn;
        KVT_LIST_EACH_SAFE(ri, rn, &pool->resvs)
        {
            kvt__resv *r = KVT_CONTAINER(ri, kvt__resv, link);
            if (r->state == KVT_RESV_HELD) kvt__resv_free(r);
            else kvt__resv_fail(r, PD_ECANCELED, true, "kvt context destroyed");
        }
    }
    /* Let aborts go out and in-flight operations finish; peers that hold them up are
     * force-closed, which completes them. */
    int64_t soft = kvt__now_ns() + 1000000000ll, hard = soft + 5000000000ll;
    while (draining(ctx) && kvt__now_ns() < hard) {
        kvt_wait(ctx, 10);
        if (kvt__now_ns() > soft) kvt__peers_close_all(ctx), soft = hard;
    }
    kvt__peers_close_all(ctx);
    hard = kvt__now_ns() + 5000000000ll;
    while (closing(ctx) && kvt__now_ns() < hard) kvt_wait(ctx, 10);
    if (ctx->ops_in_flight > 0) {
        /* The worker aborts on unreleased requests: release them by force. */
        PD_LOGE("kvt[%s]: %d UCX operations did not complete at destroy", ctx->name,
                ctx->ops_in_flight);
        kvt__ops_release(ctx, NULL);
        kvt_progress(ctx);
    }
    while (!kvt__list_empty(&ctx->sends))
        kvt__send_free(KVT_CONTAINER(ctx->sends.next, kvt_send, link));
    while (!kvt__list_empty(&ctx->targets)) {
        kvt_target *t = KVT_CONTAINER(ctx->targets.next, kvt_target, link);
        t->refs = 1;
        kvt__target_unref(t);
    }
    while (!kvt__list_empty(&ctx->nacks)) {
        kvt__nack *k = KVT_CONTAINER(ctx->nacks.next, kvt__nack, link);
        kvt__list_del(&k->link);
        free(k);
    }
    for (it = ctx->pools.next; it != &ctx->pools; it = it->next) {
        kvt_pool *pool = KVT_CONTAINER(it, kvt_pool, link);
        while (!kvt__list_empty(&pool->resvs))
            kvt__resv_free(KVT_CONTAINER(pool->resvs.next, kvt__resv, link));
    }
    while (!kvt__list_empty(&ctx->peers)) {
        kvt__peer *p = KVT_CONTAINER(ctx->peers.next, kvt__peer, link);
        if (p->close_req) ucp_request_free(p->close_req);
        kvt__list_del(&p->link);
        kvt__list_del(&p->dirty);
        free(p->remote_addr);
        free(p);
    }
    ucp_worker_destroy(ctx->worker);
    ctx->worker = NULL;
    /* Memory handles belong to the context: unmap after the worker can no longer write. */
    while (!kvt__list_empty(&ctx->pools))
        kvt_pool_destroy(KVT_CONTAINER(ctx->pools.next, kvt_pool, link));
    if (ctx->stage_mh) ucp_mem_unmap(ctx->uctx, ctx->stage_mh);
    free(ctx->stage_free);
    ucp_cleanup(ctx->uctx);
    for (int i = 0; i < ctx->n_op_chunks; i++) free(ctx->op_chunks[i]);
    free(ctx->op_chunks);
    if (ctx->secret) kvt__secret_wipe(ctx->secret);
    free(ctx->secret);
    free(ctx->addr);
    free(ctx);
}
