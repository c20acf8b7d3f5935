/* kvt_impl.h -- Internal structures of kvtransfer shared by its files: the context, peers
 * (one UCX endpoint per remote context), pools, targets, transfers on both sides, the UCX
 * operation records and the wire messages. Nothing here is part of the public API. */
#ifndef PD_KVT_IMPL_H
#define PD_KVT_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <ucp/api/ucp.h>

#include "kvtransfer/kvt_desc.h"
#include "kvtransfer/kvtransfer.h"

/* ---------------------------------------------------------------- intrusive lists */

typedef struct kvt__list {
    struct kvt__list *prev, *next;
} kvt__list;

static inline void kvt__list_init(kvt__list *h) { h->prev = h->next = h; }
static inline int kvt__list_empty(const kvt__list *h) { return h->next == h; }
static inline void kvt__list_add(kvt__list *h, kvt__list *n)
{
    n->prev = h->prev;
    n->next = h;
    h->prev->next = n;
    h->prev = n;
}
static inline void kvt__list_del(kvt__list *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = n;
}
#define KVT_CONTAINER(ptr, type, member) ((type *)(void *)((char *)(ptr) - offsetof(type, member)))
#define KVT_LIST_EACH_SAFE(it, nx, head) \
    for ((it) = (head)->next, (nx) = (it)->next; (it) != (head); (it) = (nx), (nx) = (it)->next)

/* ---------------------------------------------------------------- wire messages */

/* Active-message ids. Every message is a fixed little-endian header (both ends are x86-64 or
 * aarch64, little-endian; the descriptor's magic would expose anything else). */
enum {
    KVT_AM_HELLO = 0x4b10,  /* sender -> receiver: open a connection; data = worker address */
    KVT_AM_HELLO_ACK,       /* receiver -> sender: connection accepted (or refused) */
    KVT_AM_START,           /* sender -> receiver: a transfer begins */
    KVT_AM_BLOCK,           /* sender -> receiver: a group of blocks (AM data path) */
    KVT_AM_DONE,            /* sender -> receiver: all bytes are in place */
    KVT_AM_ACK,             /* receiver -> sender: transfer accepted, or failed/cancelled */
    KVT_AM_ABORT,           /* sender -> receiver: transfer failed or cancelled */
    KVT_AM_COUNT = 7
};

#define KVT_WIRE_VERSION 3u /* 2: the handshake may authenticate; 3: DONE carries up to
                             * KVT_MAX_FIRST_TOKENS first tokens (n > 1 choices) */

/* The handshake. Without secrets: HELLO(1) -> HELLO_ACK(1), both ready. With a secret on
 * both sides, each proves it knows it by a MAC over the other's random nonce:
 * HELLO(1){nonce_s} -> HELLO_ACK(1){nonce_r, proof_r} -> HELLO(2){proof_s} -> HELLO_ACK(2),
 * where proof_r = HMAC(secret, "accept" | nonce_s | nonce_r | ids | gen) and proof_s the same
 * with "open" and the nonces swapped; the receiver takes no transfer before HELLO(2) verified
 * and the sender sends none before HELLO_ACK(2). A side that has a secret refuses a peer that
 * has none (or a wrong one) with status PD_EPERM. */
#define KVT_HELLO_AUTH 1u /* flags: the side has a secret and authenticates */

typedef struct {
    uint64_t src_ctx, dst_ctx; /* sender's and receiver's context ids */
    uint32_t gen;              /* connection generation, chosen by the sender */
    uint32_t version;          /* KVT_WIRE_VERSION */
    uint32_t phase;            /* 1 = open (data: worker address), 2 = proof */
    int32_t status;            /* phase 2: 0, or the sender refuses the receiver (PD_EPERM) */
    uint32_t flags;            /* KVT_HELLO_AUTH */
    uint32_t pad;
    uint8_t nonce[KVT_MAC_LEN]; /* phase 1 with AUTH: the sender's challenge */
    uint8_t proof[KVT_MAC_LEN]; /* phase 2: proof_s */
} kvt__msg_hello;

typedef struct {
    uint64_t src_ctx, dst_ctx; /* receiver's and sender's context ids */
    uint32_t gen;              /* echoed */
    int32_t status;            /* 0 or a PD_E* refusal */
    uint32_t phase;            /* 1 = accepted (challenge), 2 = the sender's proof verified */
    uint32_t flags;            /* KVT_HELLO_AUTH */
    uint8_t nonce[KVT_MAC_LEN]; /* phase 1 with AUTH: the receiver's challenge */
    uint8_t proof[KVT_MAC_LEN]; /* phase 1 with AUTH: proof_r */
} kvt__msg_hello_ack;

typedef struct {
    uint64_t src_ctx;     /* sender context */
    uint64_t req_id, xfer_id, pool_id;
    uint64_t fingerprint; /* sender's layout fingerprint */
    uint64_t meta_sum;    /* as in DONE: checked before the data is accepted */
    uint64_t bytes;       /* payload the transfer moves */
    uint32_t gen;         /* connection generation */
    int32_t n_blocks, n_layers;
    uint32_t deadline_ms; /* START -> DONE budget the sender promises */
    uint32_t path;        /* kvt_path actually used */
    uint32_t pad;
} kvt__msg_start;

typedef struct {
    uint64_t req_id, xfer_id, pool_id;
    int32_t layer;
    int32_t kv;    /* 0 = K, 1 = V */
    int32_t first; /* first position in the request's block list */
    int32_t n;     /* consecutive positions carried */
} kvt__msg_block;

typedef struct {
    uint64_t req_id, xfer_id, pool_id;
    uint64_t meta_sum; /* xxh64 over the request's shape and destination ids */
    uint64_t data_sum; /* xxh3 over all bytes in request order, if flags & 1 */
    uint64_t bytes;
    int32_t n_blocks;
    int32_t first_token;
    uint32_t flags; /* bit 0: data_sum present */
    uint32_t pad;
    int32_t n_first;     /* first tokens carried, 1 .. KVT_MAX_FIRST_TOKENS */
    int32_t more[KVT_MAX_FIRST_TOKENS - 1]; /* first tokens 1 .. n_first - 1 */
} kvt__msg_done;

typedef struct {
    uint64_t req_id, xfer_id;
    int32_t status; /* ACK: 0 = accepted, < 0 = failed; ABORT: why */
    uint32_t pad;
    char detail[96]; /* NUL-terminated reason for humans */
} kvt__msg_ack;

/* Reads an ACK or ABORT header of hlen bytes into *out (zeroed first; a header may end before
 * the whole detail), its detail NUL-terminated whatever arrived. Returns false for a header too
 * short to carry the ids and the status, which the handlers ignore. */
static inline bool kvt__msg_ack_read(const void *hdr, size_t hlen, kvt__msg_ack *out)
{
    if (hlen < offsetof(kvt__msg_ack, detail)) return false;
    memset(out, 0, sizeof *out);
    memcpy(out, hdr, hlen < sizeof *out ? hlen : sizeof *out);
    out->detail[sizeof out->detail - 1] = 0;
    return true;
}

/* A queued terminal event, embedded in the transfer it reports (no allocation). */
typedef struct {
    kvt__list link; /* ctx->events */
    int kind;       /* 0 = not queued, 1 = kvt_send, 2 = kvt__resv */
    kvt_event_type type;
} kvt__evq;

/* ---------------------------------------------------------------- UCX operations */

enum { KVT_OP_DATA = 1, KVT_OP_FLUSH, KVT_OP_CTRL, KVT_OP_RECV, KVT_OP_DEVICE };

#define KVT_MAX_IOV 64

/* One posted UCX request (or one about to be posted). Lives in a per-ctx free list; the
 * completion callback finds it through user_data. AM headers live here until completion,
 * as UCX 1.13 reads them late. */
typedef struct kvt__op {
    struct kvt__op *next_free;
    kvt_ctx *ctx;
    int kind;
    struct kvt__peer *peer;
    struct kvt_send *send;  /* DATA / FLUSH / sender control messages */
    struct kvt__resv *resv; /* RECV / receiver control messages */
    uint64_t bytes;
    void *req; /* the UCX request while one is outstanding; KVT_OP_DEVICE: the copy's token */
    kvt__list dev_link; /* KVT_OP_DEVICE: ctx->dev_ops while the copy runs */
    int stage; /* staging slot the data was gathered into, or -1 */
    struct kvt_pool *ring; /* the staged pool whose ring slot `stage` is (NULL: ctx's slots) */
    int phase; /* staged DATA / RECV op: 1 = its device copy runs (in ctx->dev_ops) */
    union {
        kvt__msg_hello hello;
        kvt__msg_hello_ack hello_ack;
        kvt__msg_start start;
        kvt__msg_block block;
        kvt__msg_done done;
        kvt__msg_ack ack;
    } hdr;
    ucp_dt_iov_t iov[KVT_MAX_IOV];
} kvt__op;

/* ---------------------------------------------------------------- peers */

typedef enum {
    KVT_PEER_CONNECTING = 1, /* sender: ep made, HELLO sent, waiting for HELLO_ACK */
    KVT_PEER_ACCEPTING,      /* receiver: HELLO seen, ep and HELLO_ACK still to do */
    KVT_PEER_AUTH,           /* receiver: HELLO_ACK sent, waiting for the sender's proof (or
                                refused: waiting for the sender to go, then failed) */
    KVT_PEER_READY,
    KVT_PEER_FAILED,  /* error seen; users being failed, ep still to close */
    KVT_PEER_CLOSING, /* ucp_ep_close_nbx in flight */
    KVT_PEER_CLOSED,
} kvt__peer_state;

/* One connection to a remote context, shared by every target and transfer with it. */
typedef struct kvt__peer {
    kvt__list link;  /* ctx->peers */
    kvt__list dirty; /* ctx->dirty_peers while work is pending */
    kvt_ctx *ctx;
    uint64_t remote_id;
    uint32_t gen;
    kvt__peer_state state;
    bool initiator;      /* we connected (sender); else we accepted (receiver) */
    bool ack_pending;    /* receiver: HELLO_ACK still to send */
    bool ucx_error;      /* the error came from UCX (the ep is dead) */
    ucp_ep_h ep;
    void *close_req;
    void *remote_addr; /* receiver: the sender's worker address until the ep exists */
    size_t remote_addr_len;
    int refs;          /* targets, sends and reservations bound to it */
    int32_t inflight;  /* ops posted on ep */
    int64_t deadline;  /* connect / close deadline, ns */
    int64_t t_created;
    int status;        /* failure code */
    char detail[160];
    kvt_transport transport;
    char tname[48];
    bool has_put_lane; /* the ep has a native RMA lane */
    bool same_host;    /* descriptor came from this host (boot id) */
    /* Authentication (see kvt__msg_hello). */
    uint32_t remote_flags;              /* KVT_HELLO_AUTH of the peer's first message */
    uint8_t nonce_local[KVT_MAC_LEN];   /* our challenge */
    uint8_t nonce_remote[KVT_MAC_LEN];  /* the peer's challenge */
    bool proof_pending;  /* sender: HELLO(2) to send; receiver: HELLO_ACK(2) to send */
    bool authed;         /* the peer proved it knows the secret */
    int refused;         /* receiver: PD_EPERM sent to the peer; fail it at the deadline */
    char refuse_detail[160];
} kvt__peer;

/* ---------------------------------------------------------------- pools */

struct kvt_pool {
    kvt__list link; /* ctx->pools */
    kvt_ctx *ctx;
    uint64_t id;
    kvt_layout layout;
    uint64_t fingerprint;
    int32_t n_layers, n_blocks;
    size_t bb;          /* bytes per block per region */
    kvt_mem_type mem_type;
    uint8_t **base;     /* [2 * n_layers] region bases, index 2 * layer + kv */
    int *region_mh;     /* [2 * n_layers] index into mh */
    ucp_mem_h *mh;      /* [n_mh] */
    int n_mh;
    bool allocated;     /* kvt owns the memory (ucp_mem_map ALLOCATE) */
    bool shm_backed;    /* a shm rkey exists (remote puts are one-sided) */
    uint8_t *slot_busy; /* [n_blocks] 1 = held by a reservation */
    int32_t n_free;
    int32_t cursor;     /* next slot kvt tries when it picks slots */
    kvt__list resvs;    /* kvt__resv */
    int32_t n_resv;
    int src_refs;       /* targets using it as source */
    uint64_t cancelled[32]; /* recently cancelled request ids: a late START gets ECANCELED */
    int n_cancelled, cancel_next;
    uint8_t *dev_export;    /* receiver: the device export put in the descriptor, or NULL */
    size_t dev_export_len;
    /* Staged pools: the blocks are device memory; data moves through a ring of host slots. */
    bool staged;
    uint8_t *ring;          /* [ring_n][ring_slot] page-aligned host memory */
    size_t ring_slot;       /* bytes per slot (ring_blocks blocks) */
    int32_t ring_n, ring_blocks;
    int32_t *ring_free;     /* stack of free slots */
    int32_t ring_n_free;
    ucp_mem_h ring_mh;
    bool ring_pinned;
    kvt__list pending;      /* kvt__pending: received blocks waiting for a free slot */
};

/* A staged pool's incoming block message that found no free ring slot: its data (a
 * rendezvous descriptor, or eager data UCX keeps) is received when a slot frees. Counts in
 * its reservation's inflight. */
typedef struct {
    kvt__list link; /* pool->pending */
    struct kvt__resv *resv;
    kvt__msg_block hdr;
    void *data;
    size_t len;
    bool rndv;
} kvt__pending;

/* ---------------------------------------------------------------- receiver transfers */

typedef enum {
    KVT_RESV_EXPECT = 1, /* waiting for START */
    KVT_RESV_ACTIVE,     /* data arriving */
    KVT_RESV_LANDING,    /* DONE seen, AM data still landing */
    KVT_RESV_HELD,       /* RECV_DONE delivered, slots held until release */
    KVT_RESV_ENDING,     /* failed; waiting for receives into the slots to finish */
} kvt__resv_state;

typedef struct kvt__resv {
    kvt__list link;  /* pool->resvs */
    kvt__list dirty; /* ctx->dirty_resvs */
    kvt_pool *pool;
    uint64_t req_id;
    void *user;
    int32_t n;
    int32_t *ids;
    kvt__resv_state state;
    kvt__peer *peer; /* bound at START */
    uint64_t xfer_id;
    int32_t inflight; /* RECV ops writing the slots */
    uint64_t bytes_expected, bytes_landed;
    int64_t t_expect, t_start, deadline;
    kvt__msg_done done;
    uint32_t path;      /* kvt_path of the sender (from START) */
    bool have_done;
    bool ack_pending;   /* an ACK (ok or failure) must be sent to the peer */
    bool tell_peer;     /* on failure, tell the sender (ACK with status) */
    bool released;      /* the user released it while it was ending: no event */
    bool await_stop;    /* ending: hold the slots until the sender confirms it stopped
                           writing (put path) or the drain deadline passes */
    int32_t start_timeout_ms;
    int status;
    char detail[160];
    kvt__evq ev;
} kvt__resv;

/* ---------------------------------------------------------------- targets and sends */

struct kvt_target {
    kvt__list link; /* ctx->targets */
    kvt_ctx *ctx;
    kvt_pool *src;
    kvt__peer *peer;
    void *desc;
    size_t desc_len;
    uint64_t remote_ctx, pool_id;
    kvt_layout layout;
    int32_t n_blocks;
    size_t bb;
    uint64_t *raddr;     /* [2 * n_layers] remote region bases */
    int *rkey_idx;       /* [2 * n_layers] */
    ucp_rkey_h *rkeys;   /* [n_rkeys] */
    int n_rkeys;
    bool remote_allocated; /* the remote pool is UCX-allocated (shm keys present) */
    bool remote_cuda;      /* the remote pool is device memory (AM data must use rndv) */
    bool remote_staged;    /* the remote pool is staged (AM only, rndv, ring-sized messages) */
    kvt_path path;         /* decided at connect */
    uint8_t **lptr;        /* [2 * n_layers] shm: our mapping of each remote region (puts are
                              then plain copies, without a UCX request each); else NULL */
    bool put_native;
    void *dev_remote;      /* device path: the receiver's export opened by device->open */
    bool cached;           /* in the ctx's cache, which then holds one of the refs */
    int refs;              /* the cache + caller opens + sends */
    int pf_region;         /* shm: next region whose page tables to populate (-1 = done) */
    size_t pf_off;         /* offset in that region */
    int64_t pf_t0;         /* when populating began (for the log) */
};

typedef enum {
    KVT_SEND_WAIT_CONN = 1, /* connection not ready yet */
    KVT_SEND_ACTIVE,        /* START sent, posting layers */
    KVT_SEND_FLUSHING,      /* finish called, all posted, flush (put) or completions (am) */
    KVT_SEND_WAIT_ACK,      /* DONE sent */
    KVT_SEND_ENDING,        /* failed or done: waiting for in-flight ops, then event */
    KVT_SEND_ENDED,
} kvt__send_state;

struct kvt_send {
    kvt__list link; /* ctx->sends */
    kvt_ctx *ctx;
    kvt_target *t;
    kvt__peer *peer;
    uint64_t req_id, xfer_id;
    void *user;
    int32_t n;
    int32_t *src, *dst;
    kvt_path path;
    kvt__send_state state;
    int32_t n_layers;
    uint8_t *layer_ready; /* [n_layers] 0 = not yet, 1 = queued, 2 = posted */
    void **layer_after;   /* [n_layers] device path: each layer's readiness handle (owned
                             until its copies are queued), or NULL */
    int32_t *queue;       /* [n_layers] ready layers in signal order */
    int32_t q_head, q_tail;
    int32_t cur_layer, cur_kv, cur_pos; /* posting cursor; cur_layer -1 = none */
    int32_t n_posted_layers;
    bool finish_called, start_sent, flush_posted, flush_done, done_posted, acked;
    bool orphan;          /* destroyed by the user before the end: free silently */
    bool checksum;
    bool tell_peer;       /* on failure, send ABORT (after the last write completed) */
    bool abort_flush;     /* put path: a flush before ABORT is posted */
    int32_t first_tokens[KVT_MAX_FIRST_TOKENS];
    int32_t n_first;      /* entries of first_tokens (kvt_send_finish_n) */
    int32_t inflight;     /* DATA and FLUSH ops */
    uint64_t bytes_total, bytes_posted, bytes_done;
    uint64_t *layer_sum;  /* [n_layers] when checksum */
    uint64_t meta_sum;
    int64_t t_begin, deadline_total, t_last, t_done_sent, t_end;
    int status;
    char detail[160];
    kvt__evq ev;
};

/* A refusal of a message that matched no reservation, sent from the main loop. */
typedef struct {
    kvt__list link;
    kvt__peer *peer; /* holds a reference */
    kvt__msg_ack msg;
} kvt__nack;

/* ---------------------------------------------------------------- the context */

struct kvt_ctx {
    kvt_params p;
    char name[32];
    ucp_context_h uctx;
    ucp_worker_h worker;
    int efd;
    uint64_t id;
    void *addr; /* our worker address */
    size_t addr_len;
    uint32_t mem_types;
    char boot_id[40];
    kvt__list pools, targets, peers, sends;
    kvt__list dirty_peers, dirty_resvs;
    kvt__op *op_free;
    void **op_chunks;
    int n_op_chunks;
    int32_t ops_in_flight;  /* every op */
    int32_t data_inflight;  /* DATA ops (the window) */
    kvt__list events;       /* kvt__evq, delivered at the end of kvt_progress */
    kvt__list nacks;        /* kvt__nack: refusals to send outside of UCX callbacks */
    bool destroying;
    uint64_t next_xfer_id;
    uint32_t next_gen;
    uint64_t next_pool_id;
    int64_t next_deadline_check;
    int64_t grace_until;    /* ns: no deadline fires before (this process ran late) */
    kvt_stats st;
    int32_t peers_by_transport[5];
    bool has_shm;   /* a shared-memory transport is loaded */
    int n_prefault; /* targets whose mapping is still being populated */
    int64_t last_activity; /* ns of the last kvt_progress that did something (spin_us) */
    uint8_t *stage_base;  /* AM staging slots (allocated at first use) */
    ucp_mem_h stage_mh;
    size_t stage_slot;    /* bytes per slot (max_op_kib) */
    int32_t *stage_free;  /* stack of free slot indices (LIFO: the last used is cache-warm) */
    int n_stage_free;
    bool stage_failed;    /* allocation failed once: send iov */
    bool pump_more; /* the pump stopped with postable work and a free window */
    kvt__secret *secret; /* the shared KV secret; NULL = peers are not authenticated */
    kvt_device_ops device; /* the device path's copy engine (device.copy_layer NULL = none) */
    kvt__list dev_ops;     /* device copies that run (polled by progress): KVT_OP_DEVICE,
                              and staged DATA / RECV ops in phase 1 */
    int32_t n_pending;     /* kvt__pending entries of every pool */
};

/* ---------------------------------------------------------------- internal functions */

int64_t kvt__now_ns(void);
/* Makes the next kvt_progress rescan every deadline (after one was added or moved earlier). */
void kvt__rescan(kvt_ctx *ctx);
/* Phase budget in ns for moving bytes over a peer's transport (min + slack * bytes / bw). */
int64_t kvt__budget_ns(const kvt_ctx *ctx, const kvt__peer *peer, uint64_t bytes);

kvt__op *kvt__op_get(kvt_ctx *ctx, int kind);
void kvt__op_put(kvt_ctx *ctx, kvt__op *op);
/* Common completion of an op posted through UCX (status from the callback or immediate). */
void kvt__op_complete(kvt_ctx *ctx, kvt__op *op, ucs_status_t status);
/* Sends a small control message (header only) to peer; op holds the header. Returns 0 or a
 * negative code (the peer is then failed). */
int kvt__send_ctrl(kvt_ctx *ctx, kvt__peer *peer, kvt__op *op, unsigned am_id, size_t hlen,
                   const void *data, size_t dlen);
/* Queues the terminal event of a transfer (q embedded in a kvt_send or kvt__resv). */
void kvt__event_queue(kvt_ctx *ctx, kvt__evq *q, int kind, kvt_event_type type);
int kvt__pd_status(ucs_status_t s);
/* Releases every outstanding UCX request (of pool's transfers only, if pool is not NULL) and
 * completes its op as cancelled: the last resort when a peer does not let them finish. */
void kvt__ops_release(kvt_ctx *ctx, const kvt_pool *pool);
/* Releases the UCX requests still outstanding with peer after its endpoint closed (UCX 1.13
 * leaves a rendezvous send to a dead shm peer pending through a forced close) and completes
 * their ops with UCS_ERR_CANCELED, so that the transfers they belong to can end. */
void kvt__ops_release_peer(kvt_ctx *ctx, const struct kvt__peer *peer);

/* kvt_peer.c */
kvt__peer *kvt__peer_find(kvt_ctx *ctx, uint64_t remote_id);
int kvt__peer_connect(kvt_ctx *ctx, uint64_t remote_id, const void *addr, size_t len,
                      bool same_host, kvt__peer **out, char *err);
void kvt__peer_fail(kvt__peer *peer, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void kvt__peer_unref(kvt__peer *peer);
void kvt__peer_mark_dirty(kvt__peer *peer);
int kvt__peers_process(kvt_ctx *ctx);
void kvt__peers_deadlines(kvt_ctx *ctx, int64_t now, int64_t *next);
void kvt__peers_close_all(kvt_ctx *ctx);
ucs_status_t kvt__am_hello(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param);
ucs_status_t kvt__am_hello_ack(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                               const ucp_am_recv_param_t *param);

/* kvt_pool.c */
kvt_pool *kvt__pool_find(kvt_ctx *ctx, uint64_t pool_id);
kvt__resv *kvt__resv_find(kvt_pool *pool, uint64_t req_id);
uint64_t kvt__meta_sum(uint64_t req_id, uint64_t pool_id, int32_t n_layers, size_t bb,
                       int32_t n, const int32_t *dst);
/* Hash of one layer's blocks (K in list order, then V) and of a whole request. */
uint64_t kvt__layer_sum(const kvt_pool *pool, int32_t layer, int32_t n, const int32_t *ids);
uint64_t kvt__data_sum(const uint64_t *layer_sums, int32_t n_layers);

/* kvt_recv.c */
void kvt__resv_fail(kvt__resv *r, int status, bool tell_peer, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void kvt__resv_free(kvt__resv *r);
int kvt__resvs_process(kvt_ctx *ctx);
void kvt__resvs_deadlines(kvt_ctx *ctx, int64_t now, int64_t *next);
int kvt__resvs_peer_failed(kvt_ctx *ctx, kvt__peer *peer);
ucs_status_t kvt__am_start(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param);
ucs_status_t kvt__am_block(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param);
ucs_status_t kvt__am_done(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                          const ucp_am_recv_param_t *param);
ucs_status_t kvt__am_abort(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param);

/* kvt_send.c */
void kvt__send_fail(kvt_send *s, int status, bool tell_peer, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int kvt__sends_pump(kvt_ctx *ctx);
void kvt__sends_deadlines(kvt_ctx *ctx, int64_t now, int64_t *next);
int kvt__sends_peer_failed(kvt_ctx *ctx, kvt__peer *peer);
void kvt__send_free(kvt_send *s);
void kvt__target_decide_path(kvt_target *t);
void kvt__target_unref(kvt_target *t);
/* Drops the cache's reference (connection failed, source pool gone). */
void kvt__target_uncache(kvt_target *t);
/* Populates a slice of a new shm target's page tables. Returns 1 if it did some work. */
int kvt__targets_prefault(kvt_ctx *ctx);
/* Polls the device copies in flight and completes those that ended. Returns how many did. */
int kvt__dev_ops_poll(kvt_ctx *ctx);
/* A data path's post returns this as its request when it took charge of the op itself. */
extern char kvt__req_owned;
#define KVT_REQ_OWNED ((void *)&kvt__req_owned)
/* Staged pools' rings (kvt_pool.c): a free slot or -1; a slot back. */
int32_t kvt__ring_get(kvt_pool *pool);
void kvt__ring_put(kvt_pool *pool, int32_t slot);
static inline uint8_t *kvt__ring_ptr(const kvt_pool *pool, int32_t slot)
{
    return pool->ring + (size_t)slot * pool->ring_slot;
}
/* A staged send's gather into its ring slot finished (ok) or failed: post the message, or
 * complete the op with an error (kvt_send.c). */
void kvt__staged_send_post(kvt_ctx *ctx, kvt__op *op, bool ok);
/* A staged receive's data is in its ring slot (status from UCX): queue the scatter into the
 * device blocks, or complete the op with the error (kvt_recv.c). */
void kvt__staged_recv_landed(kvt_ctx *ctx, kvt__op *op, ucs_status_t status);
/* Starts the pending block messages of staged pools that a free slot can take, and releases
 * those of reservations that ended (kvt_recv.c). Returns how many it handled. */
int kvt__pending_process(kvt_ctx *ctx);
/* Releases every pending message of pool (teardown). */
void kvt__pending_drop_all(kvt_pool *pool);
ucs_status_t kvt__am_ack(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                         const ucp_am_recv_param_t *param);

#endif
