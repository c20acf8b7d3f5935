/* kvtransfer.h -- Ships KV-cache blocks from a prefill process to a decode process over UCX
 * (one-sided RMA put on shm/RDMA, active-message rendezvous on tcp), layer by layer, with a
 * deadline on every phase and every failure ending with all blocks and requests released.
 *
 * Model. A process creates one kvt_ctx (a UCX context + worker) and drives it from its event
 * loop: poll kvt_fd() for POLLIN with timeout kvt_timeout_ms(), call kvt_progress(), and call
 * kvt_arm() before sleeping (see kvt_wait() for the whole loop in one call). Everything of one
 * ctx is single-threaded: call its functions from the thread that progresses it. Outcomes are
 * delivered as kvt_event through the ctx's callback, always from inside kvt_progress() (or
 * kvt_wait()) and never from inside a UCX callback, so the callback may call any kvt function
 * except kvt_ctx_destroy().
 *
 * Memory. A kvt_pool is a registered KV layout: per layer a K and a V region, each
 * [n_blocks][block_bytes] -- the engine's [n_blocks][block_size][n_kv_heads][head_dim] -- either
 * the caller's memory (e.g. the CPU backend's KV cache, or pinned host staging buffers filled
 * from the GPU) or memory kvt allocates through UCX (which on one host gives real one-sided shm
 * puts). A decode process exports its pool as a descriptor (opaque bytes for the control plane);
 * a prefill process opens a kvt_target on that descriptor with its own pool as the source.
 *
 * One request. Decode: kvt_recv_expect(pool, req_id, dst block ids). Prefill:
 * kvt_send_begin(target, req_id, src ids, dst ids) -> kvt_send_layer_ready(layer) as each layer
 * of the prefill finishes -> kvt_send_finish(first_token). Prefill then gets KVT_EV_SEND_DONE
 * once decode has acknowledged; decode gets KVT_EV_RECV_DONE (with the first token) once every
 * byte has landed. Any failure (peer death, a deadline, cancellation on either side, a checksum
 * or layout mismatch) ends in KVT_EV_SEND_FAILED / KVT_EV_RECV_FAILED on both sides, and only
 * after the transfer's last UCX operation has completed, so the source blocks may be reused and
 * the reserved destination blocks are free again when the event arrives. */
#ifndef PD_KVTRANSFER_H
#define PD_KVTRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

typedef struct kvt_ctx kvt_ctx;       /* opaque: UCX context + worker, one per progress thread */
typedef struct kvt_pool kvt_pool;     /* opaque: registered KV block memory (source or landing) */
typedef struct kvt_target kvt_target; /* opaque: a connection to a remote pool (sender side) */
typedef struct kvt_send kvt_send;     /* opaque: one outgoing request transfer */

/* How block bytes move. */
typedef enum {
    KVT_PATH_AUTO = 0, /* put where the peer's transport does native RMA into the pool, else AM */
    KVT_PATH_PUT,      /* RMA into the remote pool, then flush: on shm a copy into the mapped
                          segment, on RDMA ucp_put_nbx; emulated by UCX over tcp (slow) */
    KVT_PATH_AM,       /* active message per group of blocks, rendezvous zero-copy into slots */
    KVT_PATH_DEVICE,   /* device to device through kvt_params.device (e.g. CUDA IPC over
                          NVLink): the bytes go from the sender's device memory straight into
                          the memory behind the receiver pool's device_export; UCX carries only
                          the control messages */
} kvt_path;

/* The device copy engine (kvt_params.device): the sender's device path (open, close,
 * copy_layer; all or none) and, on either side, the copies of staged pools (stage_out,
 * stage_in). kvt keeps the protocol (START, DONE, ACK, ABORT, deadlines, peer failure); these
 * move the bytes. poll and release are required. Called on the ctx's thread only; none may
 * block for long. */
typedef struct {
    /* Opens the receiver's export (the device_export bytes its pool was created with).
     * Returns 0 with *remote, PD_EUNSUPPORTED when this process cannot reach that memory
     * (kvt then uses the pool's host path, unless device_required; err says why), or another
     * error. */
    int (*open)(void *arg, const void *blob, size_t len, void **remote, char *err);
    void (*close)(void *arg, void *remote);
    /* Queues the copy of layer's K and V blocks src_ids[i] -> dst_ids[i] (i < n) into remote,
     * ordered after `after` (the layer's readiness given to kvt_send_layer_ready_after; NULL
     * = none). *token receives a handle for poll. Returns 0 or an error. */
    int (*copy_layer)(void *arg, void *remote, int32_t layer, const int32_t *src_ids,
                      const int32_t *dst_ids, int32_t n, void *after, void **token);
    /* 1 when the copies behind token are complete (written at the receiver), 0 while they
     * run, < 0 when they failed. */
    int (*poll)(void *arg, void *token);
    /* Releases a token or an `after` handle. */
    void (*release)(void *arg, void *handle);
    void *arg;
    /* Staged pools (kvt_pool_params.staged: the pool's blocks are this process's device
     * memory, which kvt moves through the pool's ring of host slots). Queued on the same copy
     * stream as copy_layer, in call order. stage_out: gathers layer's K (kv 0) or V (kv 1)
     * blocks ids[0..n) into host (contiguous, n block sizes), after `after` (NULL = none;
     * not consumed). stage_in: scatters host into the blocks ids[0..n) of layer's K or V.
     * *token as for copy_layer. host_pin / host_unpin (optional): page-lock the ring. */
    int (*stage_out)(void *arg, int32_t layer, int kv, const int32_t *ids, int32_t n,
                     void *after, void *host, void **token);
    int (*stage_in)(void *arg, int32_t layer, int kv, const int32_t *ids, int32_t n,
                    const void *host, void **token);
    int (*host_pin)(void *arg, void *p, size_t bytes);
    void (*host_unpin)(void *arg, void *p);
} kvt_device_ops;

/* The kind of transport a connection actually uses (for logs and metrics). */
typedef enum {
    KVT_TRANSPORT_UNKNOWN = 0,
    KVT_TRANSPORT_SELF,  /* same worker (loopback inside one process) */
    KVT_TRANSPORT_SHM,   /* sysv / posix / cma / knem / xpmem */
    KVT_TRANSPORT_TCP,
    KVT_TRANSPORT_RDMA,  /* verbs: rc / ud / dc */
} kvt_transport;

/* Memory kinds a pool may live in. */
typedef enum {
    KVT_MEM_HOST = 0, /* ordinary or pinned host memory */
    KVT_MEM_CUDA = 1, /* device memory; only where kvt_ctx_mem_types() reports it */
} kvt_mem_type;

typedef enum {
    KVT_EV_SEND_DONE = 1, /* sender: decode acknowledged every byte; source blocks reusable */
    KVT_EV_SEND_FAILED,   /* sender: status says why; source blocks reusable */
    KVT_EV_RECV_DONE,     /* receiver: all blocks landed and checked; first_token is valid */
    KVT_EV_RECV_FAILED,   /* receiver: status says why; the reservation is already released */
} kvt_event_type;

/* One transfer outcome, delivered through kvt_params.on_event. */
typedef struct {
    kvt_event_type type;
    int status;           /* 0, or PD_ETIMEDOUT / PD_ECANCELED / PD_EUNAVAILABLE / PD_EIO / ... */
    uint64_t req_id;      /* the request the transfer belongs to */
    kvt_send *send;       /* sender events: the handle (still valid until kvt_send_destroy) */
    kvt_pool *pool;       /* receiver events: the landing pool */
    void *user;           /* sender: kvt_send_params.user; receiver: kvt_recv_params.user */
    int32_t n_blocks;     /* blocks of the request */
    int32_t first_token;  /* RECV_DONE / SEND_DONE: the first sampled token; else -1 */
    const int32_t *first_tokens; /* RECV_DONE / SEND_DONE: every first token the sender gave
                                    (kvt_send_finish_n; [0] = first_token), valid during the
                                    callback; else NULL */
    int32_t n_first_tokens;      /* their number (1 unless kvt_send_finish_n gave more) */
    uint64_t bytes;       /* payload bytes moved (all layers, K and V) */
    int64_t elapsed_ns;   /* sender: begin -> ACK; receiver: START -> DONE */
    kvt_path path;        /* the data path the transfer used (KVT_PATH_DEVICE: the bytes are
                             in the memory behind the pool's device_export, not in the pool) */
    const char *detail;   /* human-readable cause ("" on success); valid during the callback */
} kvt_event;

typedef void (*kvt_event_fn)(void *arg, const kvt_event *ev);

/* Settings of a context. Deadline of a phase moving B bytes:
 * deadline_min_ms + deadline_slack * B / bandwidth. */
typedef struct {
    const char *name;           /* shown in logs; NULL = "kvt" (copied) */
    kvt_event_fn on_event;      /* required: receives every kvt_event */
    void *on_event_arg;         /* passed to on_event */
    kvt_path path;              /* data path; default KVT_PATH_AUTO */
    const char *ucx_tls;        /* UCX_TLS for this ctx; NULL = environment / UCX default */
    const char *ucx_net_devices; /* UCX_NET_DEVICES; NULL = environment / UCX default */
    double bw_gbps;             /* expected bandwidth in GB/s for deadlines; 0 = by transport
                                   (shm 2, rdma 2, tcp 0.25) */
    double deadline_slack;      /* multiplier on bytes / bandwidth; default 4 */
    int32_t deadline_min_ms;    /* floor of every phase deadline; default 2000 */
    int32_t connect_timeout_ms; /* connect + handshake; default 5000 */
    int32_t compute_timeout_ms; /* default for kvt_send_params.compute_timeout_ms; 30000 */
    int32_t start_timeout_ms;   /* receiver: expect -> first message of the sender; default
                                   60000; 0 = wait until cancelled */
    int32_t window;             /* data operations in flight per ctx; default 64 */
    int32_t max_op_kib;         /* put path: largest put in KiB when blocks adjacent on both
                                   sides are merged; default 1024 */
    int32_t am_max_kib;         /* AM path: largest message in KiB (always at least one
                                   block, at most 64 blocks); default 256 (best on tcp here) */
    int32_t am_staging_slots;   /* AM path: slots of am_max_kib into which scattered source
                                   blocks are gathered so that each AM leaves one contiguous
                                   buffer (UCX 1.13 sends iov data by copying fragments, much
                                   slower: docs/perf-history.md, "KV transfer"); default 32;
                                   0 = send iov */
    int32_t keepalive_ms;       /* UCX keepalive interval when UCX_KEEPALIVE_INTERVAL is
                                   not set; default 1000; 0 = UCX default (20 s) */
    const char *secret_file;    /* file holding the shared KV secret (16 to 4096 bytes, one
                                   trailing newline ignored; read once, copied): descriptors
                                   are signed (HMAC-SHA256) and both sides of a connection
                                   prove they know it; a peer without it, or with another,
                                   is refused with PD_EPERM. NULL = no authentication */
    int32_t spin_us;            /* while transfers are active, kvt_arm() reports work for
                                   this long after the last progress, so that a loop polls
                                   instead of sleeping between closely spaced messages (a
                                   wakeup costs tens of us); default 100; 0 = always sleep.
                                   Never spins when no transfer is active. */
    const kvt_device_ops *device; /* the device copy engine (copied): the sender's device
                                   path, and the copies of staged pools; NULL = neither */
    bool device_required;       /* sender: a target whose pool offers a device export this
                                   ctx cannot open is an error, not a host-path fallback */
    bool net_only;              /* publish a network-only address (tcp even on one host) */
    bool no_shm_error_handling; /* do not turn on UCX_MM_ERROR_HANDLING (then shm cannot be
                                   used with peer failure detection and UCX picks tcp) */
} kvt_params;

kvt_params kvt_default_params(void);

/* Creates the UCX context and worker, logs the UCX version, the transports found and the
 * memory types supported, and checks that shm is usable with peer failure detection. Returns
 * 0, PD_EINVAL (bad params, or a secret file of the wrong size), PD_EIO (secret file
 * unreadable), PD_EUNAVAILABLE (UCX init failed) or PD_ENOMEM. */
int kvt_ctx_create(const kvt_params *p, kvt_ctx **out, char *err);
/* Fails every transfer still active (no events are delivered any more), force-closes every
 * connection, waits for UCX to release every request, destroys every pool, target and send
 * still open (their handles become invalid) and releases UCX. NULL is a no-op. */
void kvt_ctx_destroy(kvt_ctx *ctx);

/* File descriptor that becomes readable when the ctx has work; poll it for POLLIN. */
int kvt_fd(const kvt_ctx *ctx);
/* Progresses communication, posts queued blocks, fires expired deadlines and delivers events.
 * Never blocks. Returns how many things happened (0 = idle). */
int kvt_progress(kvt_ctx *ctx);
/* Prepares to sleep on kvt_fd(). Returns 0 when the caller may block, 1 when work is pending
 * or transfers are active and the last progress was less than spin_us ago (call
 * kvt_progress() again first). */
int kvt_arm(kvt_ctx *ctx);
/* Milliseconds until the next deadline (poll timeout), or -1 when no deadline is pending. */
int kvt_timeout_ms(const kvt_ctx *ctx);
/* One loop turn for a dedicated thread or a test: progress, and if idle arm and sleep on the
 * fd for at most max_ms (and not past the next deadline), then progress again. Returns what
 * kvt_progress() returned, summed. */
int kvt_wait(kvt_ctx *ctx, int max_ms);

/* Bit mask of (1u << kvt_mem_type) the UCX found at run time supports for pools. */
uint32_t kvt_ctx_mem_types(const kvt_ctx *ctx);

/* Counters for metrics. */
typedef struct {
    uint64_t sends_done, sends_failed;   /* terminal sender transfers */
    uint64_t recvs_done, recvs_failed;   /* terminal receiver transfers */
    uint64_t bytes_sent, bytes_received; /* payload bytes of finished transfers */
    int32_t sends_active, recvs_active;  /* transfers in progress (receivers: reservations) */
    int32_t ring_slots, ring_free;       /* staged pools' ring slots, and how many are free */
    int32_t ring_waiting;                /* block messages waiting for a free ring slot */
    int32_t peers;                       /* live connections */
    int32_t ops_in_flight;               /* UCX requests not yet completed */
    int32_t peers_by_transport[5];       /* live connections per kvt_transport value */
    kvt_transport last_transport;        /* of the most recently established connection */
    kvt_path last_path;                  /* sender: the data path of the newest target */
    char last_transport_name[64];        /* e.g. "sysv/memory" or "tcp/lo" */
    uint64_t late_wakeups;               /* deadline checks that ran > 1 s late: this process
                                            was frozen or starved, and its deadlines waited */
} kvt_stats;
void kvt_ctx_stats(const kvt_ctx *ctx, kvt_stats *out);

/* ---------------------------------------------------------------- pools and layout */

/* What both sides must agree on, checked before any byte moves. */
typedef struct {
    char model_id[64];  /* model fingerprint (e.g. name + config hash), NUL-terminated */
    pd_dtype dtype;     /* element type of the transferred K/V */
    int32_t n_layers;   /* transformer layers, > 0 */
    int32_t block_size; /* tokens per block, > 0 */
    int32_t n_kv_heads; /* > 0 */
    int32_t head_dim;   /* > 0 */
} kvt_layout;

/* Bytes of one block of K (or V) in one layer: block_size * n_kv_heads * head_dim * dtype. */
size_t kvt_layout_block_bytes(const kvt_layout *l);
/* 64-bit fingerprint of every field of the layout. */
uint64_t kvt_layout_fingerprint(const kvt_layout *l);

typedef struct {
    kvt_layout layout;      /* the KV layout of this pool */
    int32_t n_blocks;       /* blocks per layer region, > 0 */
    void *const *k_base;    /* [n_layers] caller's K region of each layer ([n_blocks][block
                               bytes]), borrowed: must outlive the pool; NULL = kvt allocates */
    void *const *v_base;    /* [n_layers] the same for V; NULL iff k_base is NULL */
    kvt_mem_type mem_type;  /* where the memory lives; CUDA only if kvt_ctx_mem_types() has it */
    const void *device_export; /* receiver: opaque bytes a sender's kvt_device_ops.open maps
                               (the device memory holding the same blocks, e.g. a CUDA IPC
                               handle), put in the descriptor (copied); NULL = none */
    size_t device_export_len;  /* 1 .. KVT_DESC_MAX_DEVICE (kvt_desc.h: 66,560) */
    bool staged;            /* the blocks are this process's device memory (no k_base /
                               v_base): kvt moves them through a ring of pinned host slots
                               with kvt_params.device's stage_out / stage_in (which the ctx
                               must have), pipelined with the network; never a host copy of
                               the whole pool. Remote puts into it are impossible: peers use
                               active messages (or the device path) */
    size_t stage_ring_bytes;   /* staged: bytes of the ring; 0 = 256 MiB. At least 4 slots
                                  of kvt_stage_slot_blocks() blocks are made */
} kvt_pool_params;

kvt_pool_params kvt_pool_default_params(void);

/* Registers (or allocates, through ucp_mem_map ALLOCATE) the pool's memory. Returns 0,
 * PD_EINVAL, PD_EUNSUPPORTED (CUDA memory with a host-only UCX), PD_ENOMEM. */
int kvt_pool_create(kvt_ctx *ctx, const kvt_pool_params *p, kvt_pool **out, char *err);
/* Fails every reservation and transfer that uses the pool (events are delivered before this
 * returns), waits until UCX no longer touches the memory, unregisters it (and frees it if kvt
 * allocated it). NULL is a no-op. */
void kvt_pool_destroy(kvt_pool *pool);

/* Base of the [n_blocks][block_bytes] region of (layer, kv) with kv 0 = K, 1 = V (NULL for a
 * staged pool: its blocks are device memory). */
void *kvt_pool_region(const kvt_pool *pool, int32_t layer, int kv);
int32_t kvt_pool_n_blocks(const kvt_pool *pool);
size_t kvt_pool_block_bytes(const kvt_pool *pool);
const kvt_layout *kvt_pool_layout(const kvt_pool *pool);
/* Blocks not held by any reservation. */
int32_t kvt_pool_n_free(const kvt_pool *pool);
/* Receiver transfers not yet ended (expected, in progress, or done and not yet released). */
int32_t kvt_pool_n_reservations(const kvt_pool *pool);
/* Whether a remote put into this pool is a real one-sided write on shm (UCX allocated it). */
bool kvt_pool_shm_backed(const kvt_pool *pool);
/* Blocks one staging slot holds (one message of a staged transfer) for a block size: 1 MiB
 * worth, at least 1, at most 64. Both sides derive it from the layout. */
int32_t kvt_stage_slot_blocks(size_t block_bytes);
/* Staged pools: the ring's slots, and how many are free now (0 and 0 for other pools). */
void kvt_pool_ring(const kvt_pool *pool, int32_t *n_slots, int32_t *n_free);

/* Writes the descriptor of the pool (worker address, remote keys, region addresses, layout)
 * into a buffer the caller frees with free(); it is what the control plane carries to the
 * prefill side. With kvt_params.secret_file it is signed (HMAC-SHA256). Returns 0, PD_ENOMEM
 * or PD_EIO. */
int kvt_pool_export(kvt_pool *pool, void **desc, size_t *len, char *err);

/* ---------------------------------------------------------------- receiver (decode) */

typedef struct {
    uint64_t req_id;          /* unique among the pool's live reservations */
    int32_t n_blocks;         /* blocks the request occupies, > 0 */
    const int32_t *block_ids; /* [n_blocks] destination slots (e.g. from eng_reserve), copied;
                                 NULL = kvt picks free slots (see kvt_recv_block_ids) */
    int32_t start_timeout_ms; /* expect -> sender's START; 0 = ctx default, -1 = none */
    void *user;               /* returned in this reservation's events */
} kvt_recv_params;

kvt_recv_params kvt_recv_default_params(void);

/* Reserves the slots for one request and starts waiting for its sender. Returns 0,
 * PD_EINVAL (bad ids), PD_ESTATE (req_id in use, or a slot held by another reservation),
 * PD_ENOSPC (kvt picks the slots and too few are free). */
int kvt_recv_expect(kvt_pool *pool, const kvt_recv_params *p, char *err);
/* The slots of a reservation, in request order ([n] borrowed until it is released), or NULL
 * when req_id is unknown. */
const int32_t *kvt_recv_block_ids(const kvt_pool *pool, uint64_t req_id, int32_t *n);
/* Ends a reservation in any state. Before KVT_EV_RECV_DONE this cancels the transfer: the
 * sender is told, the slots are released once no UCX operation writes them any more, and
 * KVT_EV_RECV_FAILED (PD_ECANCELED) follows. After KVT_EV_RECV_DONE it just releases the
 * slots. Returns 0 or PD_ENOTFOUND. */
int kvt_recv_release(kvt_pool *pool, uint64_t req_id);
/* Cancels a reservation whose KVT_EV_RECV_DONE has not been delivered, so that exactly one
 * KVT_EV_RECV_FAILED follows in every case: also when it is already failing on its own (then
 * this is a no-op; kvt_recv_release would instead free it without an event). Returns 0 (the
 * event follows), PD_ESTATE (RECV_DONE was delivered: release it), PD_ENOTFOUND. */
int kvt_recv_cancel(kvt_pool *pool, uint64_t req_id);

/* ---------------------------------------------------------------- sender (prefill) */

/* Describes a target's connection (for logs and metrics). */
typedef struct {
    kvt_transport transport; /* what the connection uses */
    char transport_name[64]; /* UCX resource, e.g. "sysv/memory", "tcp/lo" */
    kvt_path path;           /* data path transfers to this target use */
    bool put_native;         /* a put is a real one-sided write (not AM emulation) */
    bool connected;          /* handshake finished */
    bool failed;             /* the connection failed; open the descriptor again */
    bool device;             /* the receiver's device memory is mapped: transfers to this
                                target take the device path (known at open, before the
                                connection is ready) */
} kvt_target_info;

/* Opens (or returns the cached) target for a pool descriptor, with src (borrowed; a target
 * whose source pool is destroyed fails) as the source of every send to it. Connection and handshake run in
 * the background (sends queue until they finish). Every field of the descriptor, and the
 * structure of the UCX address and keys in it, is checked before UCX sees any of it. Refuses a
 * layout that differs from src's with PD_EMISMATCH and a message naming the fields, before
 * anything is sent. Returns 0, PD_EFORMAT (malformed descriptor: err names the field),
 * PD_EPERM (with a secret: unsigned or the MAC does not verify; without one: signed),
 * PD_EMISMATCH, PD_EUNAVAILABLE (cannot reach the peer). A handshake that fails
 * authentication later fails the target's sends with PD_EPERM. */
int kvt_target_open(kvt_ctx *ctx, kvt_pool *src, const void *desc, size_t len,
                    kvt_target **out, char *err);
/* Drops the caller's reference. The target (connection, remote keys, mapping) stays cached
 * for the next kvt_target_open of the same descriptor until its connection fails, its source
 * pool is destroyed, or 64 newer targets pushed it out. NULL is a no-op. */
void kvt_target_close(kvt_target *t);
/* Fills *out; valid once connected (before that transport is KVT_TRANSPORT_UNKNOWN). */
void kvt_target_info_get(const kvt_target *t, kvt_target_info *out);

typedef struct {
    uint64_t req_id;            /* the request, as reserved on the receiver */
    int32_t n_blocks;           /* > 0 */
    const int32_t *src_ids;     /* [n_blocks] blocks of the source pool, copied */
    const int32_t *dst_ids;     /* [n_blocks] slots reserved on the receiver, copied */
    int32_t compute_timeout_ms; /* begin -> kvt_send_finish; 0 = ctx default */
    void *user;                 /* returned in this transfer's events */
    bool checksum_data;         /* hash every byte on both sides (xxh3) and compare */
} kvt_send_params;

kvt_send_params kvt_send_default_params(void);

/* Starts a transfer to target t. Nothing moves until layers are marked ready. Returns 0,
 * PD_EINVAL (bad ids), PD_EUNAVAILABLE (the target's connection has failed), PD_ESTATE (req_id
 * already being sent to that pool, or the source pool was destroyed), PD_ENOMEM. */
int kvt_send_begin(kvt_target *t, const kvt_send_params *p, kvt_send **out, char *err);
/* The source blocks of layer (K and V) hold their final values: push them now. Each layer
 * once, any order. Returns 0, PD_EINVAL, or PD_ESTATE (the transfer has already ended; its
 * event says why). */
int kvt_send_layer_ready(kvt_send *s, int32_t layer);
/* The same, with the layer's readiness as a device handle (an event recorded after the
 * layer's KV store): on the device path its copies are queued after it without anyone
 * waiting; on other paths it is released at once (the caller must then have waited). kvt
 * takes ownership of after (released through kvt_params.device->release). */
int kvt_send_layer_ready_after(kvt_send *s, int32_t layer, void *after);
/* Every layer is ready and the first token is known: flush, send DONE, wait for the ACK.
 * Returns 0, PD_ESTATE (layers missing, or already finished or ended). */
int kvt_send_finish(kvt_send *s, int32_t first_token);
/* kvt_send_finish with several first tokens (a request of n choices: each choice's first
 * token, choice i at i), 1 .. KVT_MAX_FIRST_TOKENS of them; the receiver's RECV_DONE carries
 * them all. Returns 0, PD_EINVAL (n out of range), PD_ESTATE. */
#define KVT_MAX_FIRST_TOKENS 16
int kvt_send_finish_n(kvt_send *s, const int32_t *first_tokens, int32_t n);
/* Cancels the transfer; KVT_EV_SEND_FAILED (PD_ECANCELED) follows once in-flight operations
 * have completed, and the receiver is told. No-op after the transfer ended. */
void kvt_send_cancel(kvt_send *s);
/* Frees the handle (the usual place: the SEND_DONE/SEND_FAILED callback). Before the transfer
 * has ended this cancels it and no event is delivered for it; kvt then frees it once its
 * operations completed, so the source blocks stay in use for a while the caller cannot observe:
 * to reuse them, call kvt_send_cancel() and wait for the event instead. NULL is a no-op. */
void kvt_send_destroy(kvt_send *s);

/* ---------------------------------------------------------------- tensor parallelism */

/* A tensor-parallel instance (docs/tensor-parallel.md) holds each block on every rank, rank r
 * with its KV heads only. What moves on the wire is always the whole layout (every KV head in
 * model order, as a single-rank pool holds it): such an instance's pool is staged
 * (kvt_pool_params.staged) and its stage_out / stage_in gather from and scatter to the ranks,
 * so any sender degree meets any receiver degree. The services do that with each rank's
 * backend (a strided copy a rank, placed by kvt_tp_part_of; svc/svc_kvdev.c);
 * kvt_tp_gather / kvt_tp_scatter below are the same moves in host memory (the reference). */
#define KVT_TP_MAX 64
/* The KV heads rank of n_ranks holds (the engine's rule, pd_shard_of): with n_ranks <=
 * n_kv_heads, n_kv_heads / n_ranks of them from rank * that; with more ranks, one head,
 * rank / (n_ranks / n_kv_heads), each head replicated on n_ranks / n_kv_heads ranks. Returns 0,
 * or PD_EINVAL when the counts do not divide or rank is out of range. */
int kvt_tp_heads(int32_t n_kv_heads, int32_t n_ranks, int32_t rank, int32_t *head0,
                 int32_t *n_heads);
/* Where rank's KV heads sit in its own blocks and in a whole-layout block of l: a block is
 * block_size token rows ([block_size][heads][head_dim]), so the rank's heads of a block are
 * `rows` runs of row_bytes, contiguous in its own block and whole_pitch apart from
 * whole_offset in the whole one (a strided copy: pd_copy_rows in kernels/backend.h). */
typedef struct {
    int32_t head0, n_heads;      /* the rank's KV heads (kvt_tp_heads) */
    size_t rows;                 /* token rows a block (block_size) */
    size_t row_bytes;            /* the rank's heads of one row */
    size_t rank_block_bytes;     /* a block of the rank's region: rows * row_bytes */
    size_t whole_block_bytes;    /* a whole-layout block (kvt_layout_block_bytes) */
    size_t whole_pitch;          /* a whole row: n_kv_heads * head bytes */
    size_t whole_offset;         /* the rank's first head in a whole row: head0 * head bytes */
    bool gathered;               /* the gather reads its heads from this rank: it is the first
                                  * rank holding them (replicas are not read) */
} kvt_tp_part;
/* Fills *out for rank of n_ranks. Returns 0, or PD_EINVAL (the counts do not divide, rank out
 * of range, a bad layout). */
int kvt_tp_part_of(const kvt_layout *l, int32_t n_ranks, int32_t rank, kvt_tp_part *out);
/* Gathers blocks ids[0..n) of one region (K or V of a layer) from the ranks' regions
 * rank_region[0..n_ranks) (each [n_blocks][block_size][its heads][head_dim]) into host as n
 * whole-layout blocks of l (l->n_kv_heads is the model's). A replicated head is read from the
 * first rank holding it. Returns 0 or PD_EINVAL (bad ids or counts). */
int kvt_tp_gather(const kvt_layout *l, int32_t n_ranks, const void *const *rank_region,
                  int32_t n_blocks, const int32_t *ids, int32_t n, void *host);
/* The reverse: the n whole-layout blocks at host into blocks ids[0..n) of every rank's
 * region, each rank its heads (replicas too). */
int kvt_tp_scatter(const kvt_layout *l, int32_t n_ranks, void *const *rank_region,
                   int32_t n_blocks, const int32_t *ids, int32_t n, const void *host);

/* Names for logs. */
const char *kvt_path_name(kvt_path p);
const char *kvt_transport_name(kvt_transport t);

#endif
