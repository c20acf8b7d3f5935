/* kvt_peer.c -- Connections between contexts and the targets built on them: endpoint creation
 * with peer-failure detection, the HELLO handshake (which also gives the receiver its own
 * endpoint back to the sender, and with a shared secret authenticates both sides), detection
 * and logging of the transport actually in use, failure and two-phase close, and opening a
 * target from a pool descriptor (checked by kvt__desc_parse before UCX sees any of it). */
#include "kvtransfer/kvt_impl.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"

static void peer_free(kvt__peer *peer);

kvt__peer *kvt__peer_find(kvt_ctx *ctx, uint64_t remote_id)
{
    for (kvt__list *it = ctx->peers.next; it != &ctx->peers; it = it->next) {
        kvt__peer *p = KVT_CONTAINER(it, kvt__peer, link);
        if (p->remote_id == remote_id && p->initiator && p->state <= KVT_PEER_READY) return p;
    }
    return NULL;
}

static kvt__peer *find_accepted(kvt_ctx *ctx, uint64_t remote_id)
{
    for (kvt__list *it = ctx->peers.next; it != &ctx->peers; it = it->next) {
        kvt__peer *p = KVT_CONTAINER(it, kvt__peer, link);
        if (p->remote_id == remote_id && !p->initiator && p->state <= KVT_PEER_READY) return p;
    }
    return NULL;
}

void kvt__peer_mark_dirty(kvt__peer *peer)
{
    if (kvt__list_empty(&peer->dirty)) kvt__list_add(&peer->ctx->dirty_peers, &peer->dirty);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    kvt__peer *peer = arg;
    (void)ep;
    peer->ucx_error = true;
    if (peer->refused) /* a refused peer going away: the refusal is the cause */
        kvt__peer_fail(peer, PD_EPERM, "connection from %016llx refused: %s",
                       (unsigned long long)peer->remote_id, peer->refuse_detail);
    else
        kvt__peer_fail(peer, kvt__pd_status(status), "connection to %016llx lost: %s",
                       (unsigned long long)peer->remote_id, ucs_status_string(status));
}

static kvt__peer *peer_new(kvt_ctx *ctx, uint64_t remote_id, bool initiator)
{
    kvt__peer *peer = calloc(1, sizeof *peer);
    if (!peer) return NULL;
    peer->ctx = ctx;
    peer->remote_id = remote_id;
    peer->initiator = initiator;
    peer->t_created = kvt__now_ns();
    kvt__list_init(&peer->dirty);
    kvt__list_add(&ctx->peers, &peer->link);
    return peer;
}

/* Zero bytes after a copy of a UCX blob: ucp_ep_create and ucp_ep_rkey_unpack take no length,
 * and a transport's key unpacker reads its own fixed-size record (or a NUL-terminated path):
 * even where the checked structure is right but a record is short, UCX reads zeros of ours. */
#define KVT_UCX_PAD 256

/* A copy of a checked UCX blob followed by KVT_UCX_PAD zero bytes (caller frees), or NULL. */
static void *ucx_blob_copy(const void *p, size_t len)
{
    uint8_t *c = calloc(1, len + KVT_UCX_PAD);
    if (c) memcpy(c, p, len);
    return c;
}

/* Whether a SysV segment id exists here and we may attach it (what UCX's sysv key unpacker
 * does next, unguarded: see kvt__ucx_rkey_filter_sysv). */
static bool sysv_segment_exists(uint32_t shmid, void *arg)
{
    (void)arg;
    struct shmid_ds ds;
    return shmctl((int)shmid, IPC_STAT, &ds) == 0;
}

/* Creates the endpoint to a worker address of len bytes (already checked by
 * kvt__ucx_addr_check). */
static int ep_create(kvt__peer *peer, const void *addr, size_t len, char *err)
{
    void *copy = ucx_blob_copy(addr, len);
    if (!copy) return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = copy,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_err_cb, .arg = peer},
    };
    ucs_status_t st = ucp_ep_create(peer->ctx->worker, &ep, &peer->ep);
    free(copy); /* UCX unpacks the address during the call */
    if (st != UCS_OK) {
        peer->ep = NULL;
        return pd_errf(err, PD_EUNAVAILABLE, "kvt: cannot reach %016llx: ucp_ep_create: %s",
                       (unsigned long long)peer->remote_id, ucs_status_string(st));
    }
    return 0;
}

int kvt__peer_connect(kvt_ctx *ctx, uint64_t remote_id, const void *addr, size_t len,
                      bool same_host, kvt__peer **out, char *err)
{
    kvt__peer *peer = kvt__peer_find(ctx, remote_id);
    int rc0;
    if (peer) {
        *out = peer;
        return 0;
    }
    if ((rc0 = kvt__ucx_addr_check(addr, len, NULL, err)) < 0) return rc0;
    peer = peer_new(ctx, remote_id, true);
    if (!peer) return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    peer->same_host = same_host;
    peer->gen = ctx->next_gen++;
    peer->state = KVT_PEER_CONNECTING;
    peer->deadline = kvt__now_ns() + (int64_t)ctx->p.connect_timeout_ms * 1000000ll;
    int rc = ep_create(peer, addr, len, err);
    if (rc == 0 && ctx->secret && kvt__random(peer->nonce_local, KVT_MAC_LEN) < 0)
        rc = pd_errf(err, PD_EIO, "kvt: no random bytes for the handshake");
    kvt__op *op = rc < 0 ? NULL : kvt__op_get(ctx, KVT_OP_CTRL);
    if (rc == 0 && !op) rc = pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    if (rc == 0) {
        op->hdr.hello = (kvt__msg_hello){.src_ctx = ctx->id, .dst_ctx = remote_id,
                                         .gen = peer->gen, .version = KVT_WIRE_VERSION,
                                         .phase = 1, .flags = ctx->secret ? KVT_HELLO_AUTH : 0};
        memcpy(op->hdr.hello.nonce, peer->nonce_local, KVT_MAC_LEN);
        rc = kvt__send_ctrl(ctx, peer, op, KVT_AM_HELLO, sizeof op->hdr.hello, ctx->addr,
                            ctx->addr_len);
        if (rc < 0) pd_errf(err, rc, "kvt: cannot send the handshake to %016llx",
                            (unsigned long long)remote_id);
    }
    if (rc < 0) {
        if (peer->state < KVT_PEER_FAILED)
            kvt__peer_fail(peer, rc, "%s", err ? err : "connect failed");
        return rc;
    }
    kvt__rescan(ctx); /* include the connect deadline */
    *out = peer;
    return 0;
}

void kvt__peer_fail(kvt__peer *peer, int status, const char *fmt, ...)
{
    if (peer->state >= KVT_PEER_FAILED) return;
    kvt_ctx *ctx = peer->ctx;
    bool was_ready = peer->state == KVT_PEER_READY;
    peer->state = KVT_PEER_FAILED;
    peer->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(peer->detail, sizeof peer->detail, fmt, ap);
    va_end(ap);
    if (was_ready) ctx->peers_by_transport[peer->transport]--;
    /* Users learn it now; the endpoint is closed outside of UCX callbacks. */
    int users = kvt__sends_peer_failed(ctx, peer) + kvt__resvs_peer_failed(ctx, peer);
    if (!ctx->destroying)
        pd_log(users > 0 || status == PD_ETIMEDOUT || status == PD_EPERM ? PD_LOG_WARN
                                                                           : PD_LOG_INFO,
               "kvt[%s]: %s (%s; %d transfers affected)", ctx->name, peer->detail,
               pd_err_name(status), users);
    kvt__peer_mark_dirty(peer); /* targets drop it from their cache there */
}

void kvt__peer_unref(kvt__peer *peer)
{
    PD_ASSERT(peer->refs > 0, "kvt: peer reference count underflow");
    if (--peer->refs == 0 && peer->state == KVT_PEER_CLOSED && peer->inflight == 0)
        peer_free(peer);
}

static void peer_free(kvt__peer *peer)
{
    kvt__list_del(&peer->link);
    kvt__list_del(&peer->dirty);
    free(peer->remote_addr);
    free(peer);
}

/* ---------------------------------------------------------------- transport detection */

static kvt_transport classify(const char *name)
{
    static const char *shm[] = {"sysv", "posix", "cma", "knem", "xpmem"};
    for (size_t i = 0; i < sizeof shm / sizeof *shm; i++)
        if (!strncmp(name, shm[i], strlen(shm[i]))) return KVT_TRANSPORT_SHM;
    if (!strncmp(name, "tcp", 3)) return KVT_TRANSPORT_TCP;
    if (!strncmp(name, "self", 4)) return KVT_TRANSPORT_SELF;
    if (!strncmp(name, "rc", 2) || !strncmp(name, "ud", 2) || !strncmp(name, "dc", 2) ||
        !strncmp(name, "mlx", 3))
        return KVT_TRANSPORT_RDMA;
    return KVT_TRANSPORT_UNKNOWN;
}

/* Reads the endpoint's lanes from ucp_ep_print_info (UCX 1.13 has no query for them): the
 * first lane that carries active messages names the transport, and a "put[" protocol line
 * means a native RMA lane exists. */
static void detect_transport(kvt__peer *peer)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    snprintf(peer->tname, sizeof peer->tname, "unknown");
    peer->transport = KVT_TRANSPORT_UNKNOWN;
    peer->has_put_lane = false;
    if (!f) return;
    ucp_ep_print_info(peer->ep, f);
    fclose(f);
    bool named = false;
    for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
        char *lane = strstr(line, "lane[");
        if (lane && !named) {
            char *colon = strchr(lane + 5, ':');
            if (colon) colon = strchr(colon + 1, ':');
            if (colon) {
                char *name = colon + 1;
                size_t n = strcspn(name, " ");
                char tmp[48];
                snprintf(tmp, sizeof tmp, "%.*s", (int)n, name);
                char *dot = strrchr(tmp, '.');
                if (dot) *dot = 0;
                snprintf(peer->tname, sizeof peer->tname, "%s", tmp);
                peer->transport = classify(tmp);
                named = true;
            }
        }
        if (strstr(line, "put[")) peer->has_put_lane = true;
    }
    free(buf);
}

static void peer_ready(kvt__peer *peer)
{
    kvt_ctx *ctx = peer->ctx;
    peer->state = KVT_PEER_READY;
    detect_transport(peer);
    ctx->peers_by_transport[peer->transport]++;
    ctx->st.last_transport = peer->transport;
    snprintf(ctx->st.last_transport_name, sizeof ctx->st.last_transport_name, "%s", peer->tname);
    double ms = (double)(kvt__now_ns() - peer->t_created) / 1e6;
    PD_LOGI("kvt[%s]: %s %016llx over %s (%s) in %.1f ms", ctx->name,
            peer->initiator ? "connected to" : "accepted", (unsigned long long)peer->remote_id,
            peer->tname, kvt_transport_name(peer->transport), ms);
    if (peer->transport == KVT_TRANSPORT_TCP && peer->same_host && !ctx->p.net_only && ctx->has_shm)
        PD_LOGW("kvt[%s]: peer %016llx is on this host but reached over %s: shared memory is "
                "not in use (check UCX_TLS and UCX_MM_ERROR_HANDLING)", ctx->name,
                (unsigned long long)peer->remote_id, peer->tname);
    for (kvt__list *it = ctx->targets.next; it != &ctx->targets; it = it->next) {
        kvt_target *t = KVT_CONTAINER(it, kvt_target, link);
        if (t->peer == peer) kvt__target_decide_path(t);
    }
}

/* ---------------------------------------------------------------- handshake */

/* proof = HMAC(secret, label | nonce_a | nonce_b | sender ctx | receiver ctx | gen): "accept"
 * with (nonce_s, nonce_r) from the receiver, "open" with (nonce_r, nonce_s) from the sender, so
 * that neither proof can be replayed as the other or on another connection. */
static int auth_proof(const kvt_ctx *ctx, const char *label, const uint8_t *na,
                      const uint8_t *nb, uint64_t s_ctx, uint64_t r_ctx, uint32_t gen,
                      uint8_t out[KVT_MAC_LEN])
{
    const void *parts[] = {label, na, nb, &s_ctx, &r_ctx, &gen};
    size_t lens[] = {strlen(label) + 1, KVT_MAC_LEN, KVT_MAC_LEN, 8, 8, 4};
    return kvt__hmac(ctx->secret, 6, parts, lens, out);
}

/* Whether proof is what a peer knowing our secret computes. */
static bool auth_check(const kvt_ctx *ctx, const char *label, const uint8_t *na,
                       const uint8_t *nb, uint64_t s_ctx, uint64_t r_ctx, uint32_t gen,
                       const uint8_t *proof)
{
    uint8_t want[KVT_MAC_LEN];
    if (auth_proof(ctx, label, na, nb, s_ctx, r_ctx, gen, want) < 0) return false;
    return kvt__mac_equal(want, proof);
}

/* Receiver: refuses an accepted peer. It is told (status PD_EPERM in the next answer) and failed
 * at its handshake deadline, or sooner when it closes the connection. */
static void peer_refuse(kvt__peer *peer, const char *why)
{
    kvt_ctx *ctx = peer->ctx;
    peer->refused = PD_EPERM;
    snprintf(peer->refuse_detail, sizeof peer->refuse_detail, "%s", why);
    PD_LOGW("kvt[%s]: refusing the connection from %016llx: %s", ctx->name,
            (unsigned long long)peer->remote_id, why);
}

/* The HELLO of a connection in the second phase (the sender's proof, or its refusal). */
static void hello_proof(kvt_ctx *ctx, const kvt__msg_hello *h)
{
    kvt__peer *peer = find_accepted(ctx, h->src_ctx);
    if (!peer || peer->gen != h->gen || peer->state != KVT_PEER_AUTH || peer->refused ||
        peer->authed)
        return;
    if (h->status != 0) {
        kvt__peer_fail(peer, PD_EPERM, "%016llx refused this side: it could not verify our "
                       "proof (the KV secrets of decode and prefill differ)",
                       (unsigned long long)h->src_ctx);
        return;
    }
    if (auth_check(ctx, "open", peer->nonce_local, peer->nonce_remote, peer->remote_id, ctx->id,
                   peer->gen, h->proof))
        peer->authed = true;
    else
        peer_refuse(peer, "its proof does not verify: the KV secrets of decode and prefill "
                    "differ");
    peer->proof_pending = true; /* answer (HELLO_ACK phase 2) from the main loop */
    kvt__peer_mark_dirty(peer);
}

ucs_status_t kvt__am_hello(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param)
{
    kvt_ctx *ctx = arg;
    (void)param;
    kvt__msg_hello h;
    if (hlen != sizeof h || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        PD_LOGW("kvt[%s]: handshake message of %zu bytes ignored (a different kvtransfer "
                "version?)", ctx->name, hlen);
        return UCS_OK;
    }
    memcpy(&h, hdr, sizeof h);
    if (h.dst_ctx != ctx->id || h.version != KVT_WIRE_VERSION) {
        PD_LOGW("kvt[%s]: handshake from %016llx for context %016llx version %u ignored (this is "
                "%016llx version %u)", ctx->name, (unsigned long long)h.src_ctx,
                (unsigned long long)h.dst_ctx, h.version, (unsigned long long)ctx->id,
                KVT_WIRE_VERSION);
        return UCS_OK;
    }
    if (h.phase == 2) {
        hello_proof(ctx, &h);
        return UCS_OK;
    }
    char err[PD_ERR_LEN];
    if (h.phase != 1 || kvt__ucx_addr_check(data, len, NULL, err) < 0) {
        PD_LOGW("kvt[%s]: malformed handshake from %016llx ignored: %s", ctx->name,
                (unsigned long long)h.src_ctx, h.phase != 1 ? "unknown phase" : err);
        return UCS_OK;
    }
    kvt__peer *old = find_accepted(ctx, h.src_ctx);
    if (old && old->gen == h.gen) return UCS_OK; /* duplicate */
    if (old)
        kvt__peer_fail(old, PD_EUNAVAILABLE, "connection from %016llx replaced by a new one",
                       (unsigned long long)h.src_ctx);
    kvt__peer *peer = peer_new(ctx, h.src_ctx, false);
    if (!peer || !(peer->remote_addr = malloc(len))) {
        if (peer) peer_free(peer);
        PD_LOGE("kvt[%s]: out of memory accepting %016llx", ctx->name,
                (unsigned long long)h.src_ctx);
        return UCS_OK;
    }
    memcpy(peer->remote_addr, data, len);
    peer->remote_addr_len = len;
    peer->gen = h.gen;
    peer->remote_flags = h.flags;
    memcpy(peer->nonce_remote, h.nonce, KVT_MAC_LEN);
    peer->state = KVT_PEER_ACCEPTING;
    peer->ack_pending = true;
    kvt__peer_mark_dirty(peer);
    return UCS_OK;
}

ucs_status_t kvt__am_hello_ack(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                               const ucp_am_recv_param_t *param)
{
    kvt_ctx *ctx = arg;
    (void)data, (void)len, (void)param;
    kvt__msg_hello_ack h;
    if (hlen != sizeof h) return UCS_OK;
    memcpy(&h, hdr, sizeof h);
    kvt__peer *peer = kvt__peer_find(ctx, h.src_ctx);
    if (!peer || peer->gen != h.gen || peer->state != KVT_PEER_CONNECTING || h.dst_ctx != ctx->id)
        return UCS_OK;
    if (h.status == PD_EPERM) {
        kvt__peer_fail(peer, PD_EPERM, "%016llx refused the connection: %s",
                       (unsigned long long)h.src_ctx,
                       h.phase == 2 ? "our proof does not verify there (the KV secrets of "
                                      "decode and prefill differ)"
                       : ctx->secret ? "this side authenticates with a KV secret and the "
                                       "decode side has none (set the same --kv-secret-file "
                                       "on both)"
                                     : "the decode side requires a KV secret and this side "
                                       "has none (set the same --kv-secret-file on both)");
        return UCS_OK;
    }
    if (h.status != 0) {
        kvt__peer_fail(peer, h.status, "%016llx refused the connection: %s",
                       (unsigned long long)h.src_ctx, pd_strerror(h.status));
        return UCS_OK;
    }
    if (h.phase == 2) { /* our proof verified: ready */
        if (!ctx->secret || peer->proof_pending || !peer->authed) return UCS_OK;
        peer->ack_pending = true;
        kvt__peer_mark_dirty(peer);
        return UCS_OK;
    }
    if (h.phase != 1 || peer->authed || peer->proof_pending) return UCS_OK;
    if (!ctx->secret && !(h.flags & KVT_HELLO_AUTH)) {
        peer->ack_pending = true; /* "became ready": handled in the main loop */
    } else if (!ctx->secret) {
        kvt__peer_fail(peer, PD_EPERM, "%016llx wants to authenticate and this side has no KV "
                       "secret", (unsigned long long)h.src_ctx);
        return UCS_OK;
    } else if (!(h.flags & KVT_HELLO_AUTH) ||
               !auth_check(ctx, "accept", peer->nonce_local, h.nonce, ctx->id, peer->remote_id,
                           peer->gen, h.proof)) {
        /* Tell it (best effort) and give up: it is not who the descriptor said. */
        peer->proof_pending = true;
    } else {
        memcpy(peer->nonce_remote, h.nonce, KVT_MAC_LEN);
        peer->authed = true;
        peer->proof_pending = true; /* send our proof from the main loop */
    }
    kvt__peer_mark_dirty(peer);
    return UCS_OK;
}

/* Sender: sends HELLO phase 2 (our proof, or PD_EPERM when the receiver's did not verify). */
static void send_proof(kvt__peer *peer)
{
    kvt_ctx *ctx = peer->ctx;
    peer->proof_pending = false;
    kvt__op *op = kvt__op_get(ctx, KVT_OP_CTRL);
    int rc = op ? 0 : PD_ENOMEM;
    if (op) {
        op->hdr.hello = (kvt__msg_hello){.src_ctx = ctx->id, .dst_ctx = peer->remote_id,
                                         .gen = peer->gen, .version = KVT_WIRE_VERSION,
                                         .phase = 2, .flags = KVT_HELLO_AUTH,
                                         .status = peer->authed ? 0 : PD_EPERM};
        if (peer->authed &&
            auth_proof(ctx, "open", peer->nonce_remote, peer->nonce_local, ctx->id,
                       peer->remote_id, peer->gen, op->hdr.hello.proof) < 0)
            op->hdr.hello.status = PD_EIO;
        rc = kvt__send_ctrl(ctx, peer, op, KVT_AM_HELLO, sizeof op->hdr.hello, NULL, 0);
    }
    if (!peer->authed)
        kvt__peer_fail(peer, PD_EPERM, "%016llx failed authentication: it does not know this "
                       "side's KV secret (the secrets of decode and prefill differ, or it has "
                       "none)", (unsigned long long)peer->remote_id);
    else if (rc < 0 && peer->state < KVT_PEER_FAILED)
        kvt__peer_fail(peer, rc, "cannot send the handshake proof to %016llx",
                       (unsigned long long)peer->remote_id);
}

/* Receiver: a new connection's endpoint and answer (HELLO_ACK phase 1). */
static void accept_peer(kvt__peer *peer)
{
    kvt_ctx *ctx = peer->ctx;
    char err[PD_ERR_LEN];
    int rc = ep_create(peer, peer->remote_addr, peer->remote_addr_len, err);
    free(peer->remote_addr);
    peer->remote_addr = NULL;
    kvt__op *op = rc < 0 ? NULL : kvt__op_get(ctx, KVT_OP_CTRL);
    if (rc == 0 && !op) rc = pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    bool theirs = (peer->remote_flags & KVT_HELLO_AUTH) != 0, auth = false;
    if (rc == 0) {
        op->hdr.hello_ack = (kvt__msg_hello_ack){.src_ctx = ctx->id, .dst_ctx = peer->remote_id,
                                                 .gen = peer->gen, .phase = 1};
        if (ctx->secret && !theirs) {
            peer_refuse(peer, "it has no KV secret and this side requires one (set the same "
                        "--kv-secret-file on decode and prefill)");
        } else if (!ctx->secret && theirs) {
            peer_refuse(peer, "it authenticates with a KV secret and this side has none (set "
                        "the same --kv-secret-file on decode and prefill)");
        } else if (ctx->secret) {
            auth = true;
            op->hdr.hello_ack.flags = KVT_HELLO_AUTH;
            if (kvt__random(peer->nonce_local, KVT_MAC_LEN) < 0 ||
                auth_proof(ctx, "accept", peer->nonce_remote, peer->nonce_local, peer->remote_id,
                           ctx->id, peer->gen, op->hdr.hello_ack.proof) < 0)
                rc = pd_errf(err, PD_EIO, "kvt: libcrypto failed in the handshake");
            memcpy(op->hdr.hello_ack.nonce, peer->nonce_local, KVT_MAC_LEN);
        }
        op->hdr.hello_ack.status = peer->refused;
        peer->ack_pending = false;
        if (rc == 0)
            rc = kvt__send_ctrl(ctx, peer, op, KVT_AM_HELLO_ACK, sizeof op->hdr.hello_ack,
                                NULL, 0);
        else
            kvt__op_put(ctx, op);
    }
    if (rc < 0) {
        kvt__peer_fail(peer, rc, "cannot answer %016llx: %s", (unsigned long long)peer->remote_id,
                       err);
    } else if (peer->state == KVT_PEER_ACCEPTING) {
        if (!auth && !peer->refused) {
            peer_ready(peer);
        } else {
            peer->state = KVT_PEER_AUTH;
            peer->deadline = kvt__now_ns() + (int64_t)ctx->p.connect_timeout_ms * 1000000ll;
            kvt__rescan(ctx);
        }
    }
}

/* Receiver: the verdict on the sender's proof (HELLO_ACK phase 2); ready if it verified. */
static void send_verdict(kvt__peer *peer)
{
    kvt_ctx *ctx = peer->ctx;
    peer->proof_pending = false;
    kvt__op *op = kvt__op_get(ctx, KVT_OP_CTRL);
    int rc = op ? 0 : PD_ENOMEM;
    if (op) {
        op->hdr.hello_ack = (kvt__msg_hello_ack){.src_ctx = ctx->id, .dst_ctx = peer->remote_id,
                                                 .gen = peer->gen, .phase = 2,
                                                 .flags = KVT_HELLO_AUTH,
                                                 .status = peer->authed ? 0 : PD_EPERM};
        rc = kvt__send_ctrl(ctx, peer, op, KVT_AM_HELLO_ACK, sizeof op->hdr.hello_ack, NULL, 0);
    }
    if (rc < 0 && peer->state < KVT_PEER_FAILED)
        kvt__peer_fail(peer, rc, "cannot answer %016llx", (unsigned long long)peer->remote_id);
    else if (peer->authed && peer->state == KVT_PEER_AUTH)
        peer_ready(peer);
}

static void close_cb(void *request, ucs_status_t status, void *user_data)
{
    kvt__peer *peer = user_data;
    (void)status;
    peer->state = KVT_PEER_CLOSED;
    peer->close_req = NULL;
    peer->ep = NULL;
    ucp_request_free(request);
    kvt__peer_mark_dirty(peer);
}

static void peer_close(kvt__peer *peer)
{
    kvt_ctx *ctx = peer->ctx;
    if (!peer->ep) {
        peer->state = KVT_PEER_CLOSED;
        return;
    }
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA,
        .flags = UCP_EP_CLOSE_FLAG_FORCE,
        .cb.send = close_cb,
        .user_data = peer,
    };
    peer->state = KVT_PEER_CLOSING;
    peer->deadline = kvt__now_ns() + 5000000000ll;
    void *req = ucp_ep_close_nbx(peer->ep, &prm);
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        peer->state = KVT_PEER_CLOSED;
        peer->ep = NULL;
    } else {
        peer->close_req = req;
    }
    kvt__rescan(ctx);
}

/* Whether receives of a reservation bound to peer are outstanding. */
static bool peer_has_recvs(kvt_ctx *ctx, const kvt__peer *peer)
{
    for (kvt__list *pi = ctx->pools.next; pi != &ctx->pools; pi = pi->next) {
        kvt_pool *pool = KVT_CONTAINER(pi, kvt_pool, link);
        for (kvt__list *it = pool->resvs.next; it != &pool->resvs; it = it->next) {
            const kvt__resv *r = KVT_CONTAINER(it, kvt__resv, link);
            if (r->peer == peer && r->inflight > 0) return true;
        }
    }
    return false;
}

int kvt__peers_process(kvt_ctx *ctx)
{
    int n = 0;
    while (!kvt__list_empty(&ctx->dirty_peers)) {
        kvt__peer *peer = KVT_CONTAINER(ctx->dirty_peers.next, kvt__peer, dirty);
        kvt__list_del(&peer->dirty);
        n++;
        if (peer->state == KVT_PEER_ACCEPTING) {
            accept_peer(peer);
        } else if (peer->state == KVT_PEER_AUTH && peer->proof_pending) {
            send_verdict(peer);
        } else if (peer->state == KVT_PEER_CONNECTING && peer->proof_pending) {
            send_proof(peer);
        } else if (peer->state == KVT_PEER_CONNECTING && peer->ack_pending) {
            peer->ack_pending = false;
            peer_ready(peer);
        }
        if (peer->state == KVT_PEER_FAILED) {
            kvt__list *it, *nx;
            KVT_LIST_EACH_SAFE(it, nx, &ctx->targets)
            {
                kvt_target *t = KVT_CONTAINER(it, kvt_target, link);
                if (t->peer != peer) continue;
                if (t->pf_region >= 0) t->pf_region = -1, ctx->n_prefault--;
                free(t->lptr); /* the mapping goes with the keys */
                t->lptr = NULL;
                for (int i = 0; i < t->n_rkeys; i++)
                    if (t->rkeys[i]) ucp_rkey_destroy(t->rkeys[i]), t->rkeys[i] = NULL;
                kvt__target_uncache(t); /* may free it */
            }
            peer_close(peer);
        }
        if (peer->state == KVT_PEER_CLOSED && (peer->inflight > 0 || peer_has_recvs(ctx, peer)))
            kvt__ops_release_peer(ctx, peer); /* the endpoint is gone: nothing ends them now */
        if (peer->state == KVT_PEER_CLOSED && peer->refs == 0 && peer->inflight == 0)
            peer_free(peer);
    }
    return n;
}

void kvt__peers_deadlines(kvt_ctx *ctx, int64_t now, int64_t *next)
{
    kvt__list *it, *nx;
    KVT_LIST_EACH_SAFE(it, nx, &ctx->peers)
    {
        kvt__peer *p = KVT_CONTAINER(it, kvt__peer, link);
        if (p->state == KVT_PEER_CONNECTING) {
            if (now >= p->deadline)
                kvt__peer_fail(p, PD_ETIMEDOUT, "no handshake answer from %016llx within %d ms",
                               (unsigned long long)p->remote_id, ctx->p.connect_timeout_ms);
            else if (p->deadline < *next) *next = p->deadline;
        } else if (p->state == KVT_PEER_AUTH) {
            if (now >= p->deadline)
                kvt__peer_fail(p, PD_EPERM, "connection from %016llx %s%s", (unsigned long long)
                               p->remote_id, p->refused ? "refused: " : "",
                               p->refused ? p->refuse_detail : "did not authenticate in time");
            else if (p->deadline < *next) *next = p->deadline;
        } else if (p->state == KVT_PEER_CLOSING && now >= p->deadline) {
            PD_LOGW("kvt[%s]: closing the connection to %016llx did not finish", ctx->name,
                    (unsigned long long)p->remote_id);
            /* Releasing the request is allowed before completion; UCX frees it later. */
            ucp_request_free(p->close_req);
            p->close_req = NULL;
            p->ep = NULL;
            p->state = KVT_PEER_CLOSED;
            kvt__peer_mark_dirty(p);
        }
    }
}

void kvt__peers_close_all(kvt_ctx *ctx)
{
    for (kvt__list *it = ctx->peers.next; it != &ctx->peers; it = it->next) {
        kvt__peer *p = KVT_CONTAINER(it, kvt__peer, link);
        if (p->state < KVT_PEER_FAILED)
            kvt__peer_fail(p, PD_ECANCELED, "closing the connection to %016llx",
                           (unsigned long long)p->remote_id);
    }
    kvt__peers_process(ctx);
}

/* ---------------------------------------------------------------- targets */

/* Puts into a shm pool are memory copies into our mapping of the receiver's segment; its page
 * tables start empty, and a fault per 4 KiB page halves the speed of the first transfers that
 * touch each block. They are populated (writable) once per target, a slice per progress turn so
 * that a large pool does not stall the loop. */
#define KVT_PREFAULT_SLICE (16u << 20)

int kvt__targets_prefault(kvt_ctx *ctx)
{
    for (kvt__list *it = ctx->targets.next; it != &ctx->targets; it = it->next) {
        kvt_target *t = KVT_CONTAINER(it, kvt_target, link);
        if (t->pf_region < 0) continue;
        size_t rlen = (size_t)t->n_blocks * t->bb, page = (size_t)sysconf(_SC_PAGESIZE);
        size_t done = 0;
        while (t->lptr && t->pf_region < 2 * t->layout.n_layers && done < KVT_PREFAULT_SLICE) {
            size_t len = rlen - t->pf_off;
            if (len > KVT_PREFAULT_SLICE - done) len = KVT_PREFAULT_SLICE - done;
            uintptr_t a = (uintptr_t)(t->lptr[t->pf_region] + t->pf_off) & ~(uintptr_t)(page - 1);
            uintptr_t e = ((uintptr_t)(t->lptr[t->pf_region] + t->pf_off + len) + page - 1) &
                          ~(uintptr_t)(page - 1);
            if (madvise((void *)a, e - a, MADV_POPULATE_WRITE) != 0) {
                PD_LOGD("kvt[%s]: madvise(MADV_POPULATE_WRITE): %s", ctx->name, strerror(errno));
                t->pf_region = 2 * t->layout.n_layers;
                break;
            }
            done += len;
            if ((t->pf_off += len) == rlen) t->pf_region++, t->pf_off = 0;
        }
        if (!t->lptr || t->pf_region >= 2 * t->layout.n_layers) {
            t->pf_region = -1;
            ctx->n_prefault--;
            PD_LOGI("kvt[%s]: mapped %.1f MiB of pool %016llx in %.1f ms", ctx->name,
                    (double)rlen * 2 * t->layout.n_layers / 1048576.0,
                    (unsigned long long)t->pool_id, (double)(kvt__now_ns() - t->pf_t0) / 1e6);
        }
        return 1;
    }
    return 0;
}

/* Whether every page of [p, p + len) is mapped in this process (msync fails with ENOMEM on a
 * hole and does no I/O with MS_ASYNC). */
static bool range_mapped(const void *p, size_t len)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)p & ~(page - 1), e = ((uintptr_t)p + len + page - 1) & ~(page - 1);
    return e > a && msync((void *)a, e - a, MS_ASYNC) == 0;
}

void kvt__target_decide_path(kvt_target *t)
{
    kvt_ctx *ctx = t->ctx;
    kvt__peer *peer = t->peer;
    bool native = false;
    if (peer->has_put_lane) {
        if (peer->transport == KVT_TRANSPORT_SHM) {
            /* One-sided only if the remote pool is a segment we can map. */
            native = t->remote_allocated;
            for (int r = 0; native && r < 2 * t->layout.n_layers; r++) {
                void *ptr;
                if (!t->rkeys[t->rkey_idx[r]] ||
                    ucp_rkey_ptr(t->rkeys[t->rkey_idx[r]], t->raddr[r], &ptr) != UCS_OK)
                    native = false;
            }
        } else if (peer->transport == KVT_TRANSPORT_RDMA || peer->transport == KVT_TRANSPORT_SELF) {
            native = true;
        }
    }
    /* A staged pool on either side has no memory a put could reach. */
    bool staged = t->remote_staged || t->src->staged;
    if (staged) native = false;
    t->put_native = native;
    t->path = ctx->p.path != KVT_PATH_AUTO ? ctx->p.path
              : t->dev_remote                ? KVT_PATH_DEVICE
              : native                       ? KVT_PATH_PUT
                                             : KVT_PATH_AM;
    if (staged && t->path == KVT_PATH_PUT) {
        PD_LOGW("kvt[%s]: pool %016llx: puts are impossible with a staged pool; using active "
                "messages", ctx->name, (unsigned long long)t->pool_id);
        t->path = KVT_PATH_AM;
    }
    ctx->st.last_path = t->path;
    if (t->path == KVT_PATH_DEVICE) {
        PD_LOGI("kvt[%s]: target pool %016llx at %016llx: device path (device to device), "
                "control over %s", ctx->name, (unsigned long long)t->pool_id,
                (unsigned long long)t->remote_ctx, peer->tname);
        return;
    }
    if (native && t->path == KVT_PATH_PUT && peer->transport == KVT_TRANSPORT_SHM &&
        t->src->mem_type == KVT_MEM_HOST && !t->lptr) {
        /* A put into a mapped segment is a memory copy: do it directly (what the shm
         * transport's put does, minus a UCX request per block). */
        t->lptr = calloc((size_t)(2 * t->layout.n_layers), sizeof *t->lptr);
        for (int r = 0; t->lptr && r < 2 * t->layout.n_layers; r++) {
            void *ptr;
            /* The region must lie inside the segment we mapped (a descriptor that claims more
             * blocks than the segment holds would otherwise make copies fault). */
            ucs_status_t st = ucp_rkey_ptr(t->rkeys[t->rkey_idx[r]], t->raddr[r], &ptr);
            if (st != UCS_OK || !range_mapped(ptr, (size_t)t->n_blocks * t->bb)) {
                if (st == UCS_OK)
                    PD_LOGW("kvt[%s]: region %d of pool %016llx is not inside the mapped "
                            "segment; using UCX puts", ctx->name, r,
                            (unsigned long long)t->pool_id);
                free(t->lptr);
                t->lptr = NULL;
                break;
            }
            t->lptr[r] = ptr;
        }
        if (t->lptr) t->pf_region = 0, t->pf_off = 0, t->pf_t0 = kvt__now_ns(), ctx->n_prefault++;
    }
    PD_LOGI("kvt[%s]: target pool %016llx at %016llx: %s over %s, put %s%s", ctx->name,
            (unsigned long long)t->pool_id, (unsigned long long)t->remote_ctx,
            kvt_path_name(t->path), peer->tname,
            t->lptr ? "native (direct copy into the mapped segment)"
            : staged ? "impossible" : native ? "native (one-sided)" : "emulated",
            staged ? ", staged through host rings" : "");
    if (t->path == KVT_PATH_PUT && !native)
        PD_LOGW("kvt[%s]: puts to pool %016llx over %s are emulated with active messages "
                "(slower, and the decode CPU copies); the AM path is faster here", ctx->name,
                (unsigned long long)t->pool_id, peer->tname);
}

static void target_free(kvt_target *t)
{
    kvt__list_del(&t->link);
    if (t->dev_remote) t->ctx->device.close(t->ctx->device.arg, t->dev_remote);
    if (t->pf_region >= 0) t->ctx->n_prefault--;
    free(t->lptr);
    for (int i = 0; i < t->n_rkeys; i++)
        if (t->rkeys && t->rkeys[i]) ucp_rkey_destroy(t->rkeys[i]);
    if (t->src) t->src->src_refs--;
    if (t->peer) kvt__peer_unref(t->peer);
    free(t->rkeys);
    free(t->raddr);
    free(t->rkey_idx);
    free(t->desc);
    free(t);
}

void kvt__target_unref(kvt_target *t)
{
    PD_ASSERT(t->refs > 0, "kvt: target reference count underflow");
    if (--t->refs == 0) target_free(t);
}

void kvt__target_uncache(kvt_target *t)
{
    if (!t->cached) return;
    t->cached = false;
    kvt__target_unref(t);
}

#define KVT_TARGET_CACHE 64 /* idle cached targets kept (least recently opened go first) */

static void cache_trim(kvt_ctx *ctx)
{
    int n = 0;
    for (kvt__list *it = ctx->targets.next; it != &ctx->targets; it = it->next)
        n += KVT_CONTAINER(it, kvt_target, link)->cached;
    for (kvt__list *it = ctx->targets.prev; it != &ctx->targets && n > KVT_TARGET_CACHE;) {
        kvt_target *t = KVT_CONTAINER(it, kvt_target, link);
        it = it->prev;
        if (t->cached && t->refs == 1) kvt__target_uncache(t), n--;
    }
}

/* Names every layout field that differs, for an error a person can act on. */
static int layout_mismatch(const kvt_layout *a, const kvt_layout *b, char *err)
{
    char msg[PD_ERR_LEN];
    size_t n = 0;
#define KVT_DIFF(cond, ...)                                                                 \
    if ((cond) && n < sizeof msg) n += (size_t)snprintf(msg + n, sizeof msg - n, __VA_ARGS__)
    KVT_DIFF(strcmp(a->model_id, b->model_id) != 0, " model_id '%s' vs '%s';", a->model_id,
             b->model_id);
    KVT_DIFF(a->dtype != b->dtype, " dtype %s vs %s;", pd_dtype_name(a->dtype),
             pd_dtype_name(b->dtype));
    KVT_DIFF(a->n_layers != b->n_layers, " layers %d vs %d;", a->n_layers, b->n_layers);
    KVT_DIFF(a->block_size != b->block_size, " block_size %d vs %d;", a->block_size,
             b->block_size);
    KVT_DIFF(a->n_kv_heads != b->n_kv_heads, " kv heads %d vs %d;", a->n_kv_heads, b->n_kv_heads);
    KVT_DIFF(a->head_dim != b->head_dim, " head_dim %d vs %d;", a->head_dim, b->head_dim);
#undef KVT_DIFF
    if (n == 0) return 0;
    return pd_errf(err, PD_EMISMATCH, "kvt: KV layout of this side (first) and of the decode "
                   "pool differ:%s refusing to transfer", msg);
}

int kvt_target_open(kvt_ctx *ctx, kvt_pool *src, const void *desc, size_t len,
                    kvt_target **out, char *err)
{
    *out = NULL;
    if (!src || src->ctx != ctx) return pd_errf(err, PD_EINVAL, "kvt: source pool of another ctx");
    for (kvt__list *it = ctx->targets.next; it != &ctx->targets; it = it->next) {
        kvt_target *t = KVT_CONTAINER(it, kvt_target, link);
        if (t->cached && t->src == src && t->desc_len == len && !memcmp(t->desc, desc, len)) {
            t->refs++;
            kvt__list_del(&t->link); /* most recently used first */
            kvt__list_add(ctx->targets.next, &t->link);
            *out = t;
            return 0;
        }
    }
    /* Everything in the descriptor is checked before UCX sees any of it. */
    kvt__desc d;
    int rc = kvt__desc_parse(desc, len, ctx->secret, &d, err);
    if (rc < 0) return rc;
    if ((rc = layout_mismatch(&src->layout, &d.layout, err)) < 0) {
        kvt__desc_free(&d);
        return rc;
    }
    kvt_target *t = calloc(1, sizeof *t);
    if (!t) {
        kvt__desc_free(&d);
        return pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    }
    t->ctx = ctx;
    t->pf_region = -1;
    kvt__list_init(&t->link);
    t->remote_allocated = (d.flags & KVT_DESC_ALLOCATED) != 0;
    t->remote_cuda = (d.flags & KVT_DESC_CUDA) != 0;
    t->remote_ctx = d.remote_ctx;
    t->pool_id = d.pool_id;
    t->layout = d.layout;
    t->n_blocks = d.n_blocks;
    int nr = d.n_regions;
    t->remote_staged = (d.flags & KVT_DESC_STAGED) != 0;
    t->raddr = calloc((size_t)nr + 1, sizeof *t->raddr); /* (staged: none) */
    t->rkey_idx = calloc((size_t)nr + 1, sizeof *t->rkey_idx);
    t->rkeys = calloc((size_t)d.n_rkeys + 1, sizeof *t->rkeys);
    t->desc = malloc(len);
    if (!t->raddr || !t->rkey_idx || !t->rkeys || !t->desc)
        rc = pd_errf(err, PD_ENOMEM, "kvt: out of memory");
    if (rc == 0) {
        t->n_rkeys = d.n_rkeys;
        for (int r = 0; r < nr; r++) {
            int32_t k;
            kvt__desc_region(&d, r, &t->raddr[r], &k);
            t->rkey_idx[r] = k;
        }
        memcpy(t->desc, desc, len);
        t->desc_len = len;
        t->src = src;
        src->src_refs++;
        t->bb = src->bb;
        bool same_host = d.boot_id[0] && !strcmp(d.boot_id, ctx->boot_id);
        rc = kvt__peer_connect(ctx, t->remote_ctx, d.addr, d.addr_len, same_host, &t->peer, err);
    }
    if (rc == 0) {
        t->peer->refs++;
        for (int i = 0; i < t->n_rkeys && rc == 0; i++) {
            uint8_t *blob = ucx_blob_copy(d.buf + d.rkey_off[i], d.rkey_len[i]);
            if (blob && d.sysv_mds) {
                size_t n = kvt__ucx_rkey_filter_sysv(d.buf + d.rkey_off[i], d.rkey_len[i],
                                                     d.sysv_mds, sysv_segment_exists, NULL,
                                                     blob);
                if (n != d.rkey_len[i]) {
                    PD_LOGW("kvt[%s]: remote key %d of pool %016llx names a sysv segment that "
                            "does not exist on this host; ignoring that part of the key",
                            ctx->name, i, (unsigned long long)d.pool_id);
                    memset(blob + n, 0, d.rkey_len[i] - n);
                }
            }
            ucs_status_t st = blob ? ucp_ep_rkey_unpack(t->peer->ep, blob, &t->rkeys[i])
                                   : UCS_ERR_NO_MEMORY;
            free(blob);
            if (st != UCS_OK) {
                t->rkeys[i] = NULL;
                rc = pd_errf(err, st == UCS_ERR_NO_MEMORY ? PD_ENOMEM : PD_EFORMAT,
                             "kvt: remote key %d of the descriptor: %s", i,
                             ucs_status_string(st));
            }
        }
    }
    if (rc == 0 && d.device && ctx->device.open && d.boot_id[0] &&
        !strcmp(d.boot_id, ctx->boot_id)) {
        /* The device path: the decode side's device memory mapped here (same host only). */
        char derr[PD_ERR_LEN] = "";
        int drc = ctx->device.open(ctx->device.arg, d.device, d.device_len, &t->dev_remote, derr);
        if (drc < 0) {
            t->dev_remote = NULL;
            if (ctx->p.device_required)
                rc = pd_errf(err, drc, "kvt: the device path to pool %016llx is required but "
                             "unavailable: %s", (unsigned long long)d.pool_id, derr);
            else
                PD_LOGW("kvt[%s]: no device path to pool %016llx (%s); its KV goes through "
                        "host memory", ctx->name, (unsigned long long)d.pool_id, derr);
        }
    } else if (rc == 0 && ctx->p.device_required) {
        rc = pd_errf(err, PD_EUNSUPPORTED, "kvt: the device path to pool %016llx is required but "
                     "%s", (unsigned long long)d.pool_id,
                     !ctx->device.open ? "this side has no device copy engine"
                     : !d.device ? "the decode pool offers no device export (a CPU backend?)"
                                 : "the decode pool is on another host");
    }
    kvt__desc_free(&d);
    kvt__list_add(ctx->targets.next, &t->link);
    t->refs = 1;
    if (rc < 0) {
        target_free(t);
        return rc;
    }
    t->cached = true;
    t->refs++; /* the cache's */
    cache_trim(ctx);
    t->path = ctx->p.path == KVT_PATH_AUTO ? KVT_PATH_AM : ctx->p.path;
    if (t->peer->state == KVT_PEER_READY) kvt__target_decide_path(t);
    *out = t;
    return 0;
}

void kvt_target_close(kvt_target *t)
{
    if (!t) return;
    kvt__target_unref(t);
}

void kvt_target_info_get(const kvt_target *t, kvt_target_info *out)
{
    memset(out, 0, sizeof *out);
    const kvt__peer *p = t->peer;
    out->connected = p && p->state == KVT_PEER_READY;
    out->failed = !p || p->state >= KVT_PEER_FAILED || !t->src;
    out->path = t->path;
    out->put_native = t->put_native;
    out->device = t->dev_remote && t->ctx->p.path == KVT_PATH_AUTO;
    if (p && p->state >= KVT_PEER_READY) {
        out->transport = p->transport;
        snprintf(out->transport_name, sizeof out->transport_name, "%s", p->tname);
    }
}
