/* rpc.h -- pdserve's gRPC layer on the gRPC C core (grpc/grpc.h) with protobuf-c messages:
 * a server with registered unary, server-streaming and bidirectional-streaming handlers, the
 * standard health service and server reflection, and client helpers (blocking and
 * callback-based) for the same call shapes (bidi: blocking only).
 *
 * Server model. Worker threads poll one completion queue. When a call arrives its request is
 * decoded and the method's handler runs on a worker thread with a borrowed reference to the
 * call. The handler answers at once (rpc_call_reply / rpc_stream_send + rpc_stream_finish),
 * or takes a reference (rpc_call_ref) and answers later from any thread (the engine thread),
 * then drops it (rpc_call_unref). Every call is finished exactly once; a call whose last
 * reference is dropped unfinished is finished with INTERNAL. Outbound messages queue per call
 * with one send in flight; the queue is bounded (backpressure). Cancellation (client cancel,
 * deadline, shutdown) is visible as a flag and through a callback.
 *
 * No grpc header is needed to use this one; protobuf-c's is. */
#ifndef PD_RPC_H
#define PD_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "common/error.h"
#include "common/flags.h"

/* gRPC status codes (the values are gRPC's). */
typedef enum {
    RPC_STATUS_OK = 0,
    RPC_STATUS_CANCELLED = 1,
    RPC_STATUS_UNKNOWN = 2,
    RPC_STATUS_INVALID_ARGUMENT = 3,
    RPC_STATUS_DEADLINE_EXCEEDED = 4,
    RPC_STATUS_NOT_FOUND = 5,
    RPC_STATUS_ALREADY_EXISTS = 6,
    RPC_STATUS_PERMISSION_DENIED = 7,
    RPC_STATUS_RESOURCE_EXHAUSTED = 8,
    RPC_STATUS_FAILED_PRECONDITION = 9,
    RPC_STATUS_ABORTED = 10,
    RPC_STATUS_OUT_OF_RANGE = 11,
    RPC_STATUS_UNIMPLEMENTED = 12,
    RPC_STATUS_INTERNAL = 13,
    RPC_STATUS_UNAVAILABLE = 14,
    RPC_STATUS_DATA_LOSS = 15,
    RPC_STATUS_UNAUTHENTICATED = 16,
} rpc_status_code;

/* Returns the code's name ("DEADLINE_EXCEEDED"), or "UNKNOWN_CODE" for other values. */
const char *rpc_status_name(int code);

/* A call's final status as a client sees it. */
typedef struct {
    int code;                       /* rpc_status_code */
    char details[PD_ERR_LEN];       /* the server's message (or core's), "" when none */
} rpc_status;

typedef enum {
    RPC_UNARY = 0,                  /* one request, one response */
    RPC_SERVER_STREAMING = 1,       /* one request, zero or more responses */
    RPC_BIDI_STREAMING = 2,         /* a stream of requests and a stream of responses, both
                                       open at once (the handler runs per request; see
                                       rpc_handler_fn) */
} rpc_method_kind;

/* ------------------------------------------------------------------------------------------
 * Server
 * ---------------------------------------------------------------------------------------- */

typedef struct rpc_server rpc_server; /* opaque */
typedef struct rpc_call rpc_call;     /* opaque; one server-side call, reference counted */

/* Runs on a server worker thread when a call of the method arrives with a request that
 * decoded. call is borrowed for the duration of the handler (take a reference with
 * rpc_call_ref to keep it); req belongs to the call and stays valid while the call is
 * referenced. The handler must not block for long: it shares the worker threads with every
 * other call.
 *
 * Bidirectional-streaming methods (RPC_BIDI_STREAMING) differ. The call arrives before any
 * request, and the handler runs once per request message, in order and never two at once for
 * one call; req is borrowed for that run only (copy what must outlive it). The next request
 * is read once the run returned and the call's outbound queue has room for a message, so a
 * client that sends faster than it reads is held back by HTTP/2 flow control instead of being
 * refused (a run that sends more than one response may still meet PD_ENOSPC). When the client
 * half-closes (sends no more), the handler runs once more with req NULL; it then finishes the
 * call with rpc_stream_finish, or takes a reference and finishes it later from another thread
 * (a call unfinished and unreferenced when that run returns is finished with INTERNAL).
 * Responses go out with rpc_stream_send, from a run or from any thread that holds a
 * reference; the call may be finished at any time (at once in the first run, if the method
 * answers a prefix of the stream), and then later requests are dropped unread. Between two
 * runs the layer keeps the call alive: no reference is needed just to wait for the next
 * request. The handler never runs for a call that is finished or cancelled, and once
 * rpc_stream_finish returned on any thread no run is in progress (it waits for one on another
 * thread; see its lock-order rule). A cancelled call (client cancel, deadline, shutdown) gets
 * no run with req NULL: its cancel callback says so. A request message that does not decode
 * (or holds a bad string: rpc_validate_strings) ends the call with INVALID_ARGUMENT as a
 * server-side cancel: rpc_call_is_cancelled turns true and the cancel callback runs.
 * rpc_call_set_data keeps per-call state between runs. */
typedef void (*rpc_handler_fn)(rpc_call *call, const ProtobufCMessage *req, void *user);

/* Runs once when a call is cancelled before it finished (client cancel or disconnect,
 * deadline, server shutdown), on a worker thread, with no lock held. It must not block: set a
 * flag, queue an abort for the engine thread. */
typedef void (*rpc_cancel_fn)(rpc_call *call, void *user);

/* A server's TLS settings: PEM files, read when the server starts and read again when they
 * change (checked by modification time, size and inode at each new connection, so that a
 * Kubernetes Secret or cert-manager renewal takes effect without a restart; connections
 * already open keep their certificate). A half-updated pair (a key that does not match the
 * certificate, a file that does not parse) is not taken: the previous pair stays in use and a
 * warning is logged, until the files are consistent again. */
typedef struct {
    const char *cert_file;          /* certificate chain (leaf first); NULL or "" = no TLS,
                                       plaintext (then key_file and client_ca_file must be
                                       unset too) */
    const char *key_file;           /* the certificate's private key (PEM, unencrypted);
                                       required with cert_file */
    const char *client_ca_file;     /* CA certificates that client certificates must chain to;
                                       NULL or "" = clients are not asked for certificates */
    bool require_client_cert;       /* with client_ca_file: refuse clients without a valid
                                       certificate (mutual TLS); false = verify one only if
                                       the client sends it */
} rpc_server_tls;

typedef struct {
    const char *listen_addr;        /* "host:port"; port 0 picks a free one (rpc_server_port);
                                       default "0.0.0.0:50051" */
    int n_threads;                  /* completion-queue worker threads, >= 1; default 2 */
    int max_recv_msg_bytes;         /* largest request accepted, bytes; -1 = unlimited;
                                       default 4 MiB (larger: RESOURCE_EXHAUSTED) */
    int max_send_msg_bytes;         /* largest response sent, bytes; -1 = unlimited (default) */
    int max_concurrent_streams;     /* calls per HTTP/2 connection; 0 = gRPC's default */
    int stream_queue_max;           /* responses queued per call before rpc_stream_send
                                       refuses (PD_ENOSPC); >= 1; default 64 */
    int requests_per_method;        /* calls pre-requested from core per method; default 8 */
    int health_drain_ms;            /* shutdown: time health reports NOT_SERVING before the
                                       listener closes (probe period); default 0 */
    int shutdown_grace_ms;          /* shutdown: time in-flight calls get to finish before
                                       they are cancelled; default 5000 */
    int handshake_timeout_ms;       /* a connection that has not finished its TLS and HTTP/2
                                       handshake (client SETTINGS) this long after it was
                                       accepted is closed, ms, >= 1; default 10000 (gRPC's own
                                       default is 120 s) */
    rpc_server_tls tls;             /* transport security; default off (plaintext) */
    bool reuse_port;                /* SO_REUSEPORT; default false, so that a second server
                                       on a busy port fails instead of sharing it */
} rpc_server_params;

rpc_server_params rpc_server_default_params(void);

/* Creates a server (not listening yet). p is copied. Returns 0, PD_EINVAL (bad params),
 * PD_ENOMEM; err (PD_ERR_LEN, may be NULL) says why. */
int rpc_server_create(const rpc_server_params *p, rpc_server **out, char *err);

/* Registers a handler for method `method` (e.g. "Generate") of the protobuf-c service svc
 * (e.g. &pdserve__v1__generation__descriptor); the request type comes from svc, the path is
 * "/<svc->name>/<method>", and svc->name becomes a service the health check knows. kind must
 * match the .proto (protobuf-c does not record streaming). user is borrowed and must outlive
 * the server's shutdown. Before rpc_server_start only.
 * Returns 0, PD_ENOTFOUND (no such method), PD_EINVAL (duplicate path), PD_ESTATE (started),
 * PD_ENOMEM. */
int rpc_server_register(rpc_server *s, const ProtobufCServiceDescriptor *svc,
                        const char *method, rpc_method_kind kind, rpc_handler_fn handler,
                        void *user, char *err);

/* The same with an explicit path and request type (for services without a descriptor).
 * service_name (may be NULL) is added to the names the health check knows. */
int rpc_server_register_path(rpc_server *s, const char *path, const char *service_name,
                             const ProtobufCMessageDescriptor *request, rpc_method_kind kind,
                             rpc_handler_fn handler, void *user, char *err);

/* Binds the listen address, starts the worker threads and begins taking calls; health says
 * SERVING. With TLS the files are read and checked first (readable, PEM that parses, the key
 * matches the certificate). Returns 0, PD_EIO (bind failed: address in use or invalid; a TLS
 * file cannot be read), PD_EFORMAT (a TLS file is not what it should be; err names the file
 * and the reason), PD_ESTATE (already started), PD_EINVAL (gRPC refused a method path),
 * PD_ENOMEM. On failure the server can only be destroyed. */
int rpc_server_start(rpc_server *s, char *err);

/* The bound port (after rpc_server_start), or 0. */
int rpc_server_port(const rpc_server *s);

/* Serves gRPC server reflection: grpc.reflection.v1.ServerReflection and
 * grpc.reflection.v1alpha.ServerReflection (most tools still call v1alpha), bidi method
 * ServerReflectionInfo, from descriptor_set: len bytes of a serialized
 * google.protobuf.FileDescriptorSet holding every file to describe and the files they import
 * (protoc --descriptor_set_out=F --include_imports), copied here. file_by_filename and
 * file_containing_symbol (messages, fields, oneofs, enums, enum values, services, methods,
 * extensions) answer the file and the files it imports, each once, the file first;
 * file_containing_extension and all_extension_numbers_of_type answer from the extensions the
 * set defines (a known message type without any: an empty list); list_services answers the
 * services registered on the server (health and reflection included), whether or not the
 * set describes them. Unknown names get an error_response NOT_FOUND, a request that asks
 * nothing INVALID_ARGUMENT; each request of a stream gets one response, in order, and the
 * call ends OK when the client half-closes. Before rpc_server_start only. Returns 0;
 * PD_EFORMAT (the bytes are not a FileDescriptorSet, a file imports one that is not in it,
 * a file or a symbol is there twice; err says which); PD_EINVAL (a reflection path is
 * registered already); PD_ESTATE (started, or reflection added already); PD_ENOMEM (then
 * the server can only be destroyed). */
int rpc_server_add_reflection(rpc_server *s, const void *descriptor_set, size_t len, char *err);

/* Sets what grpc.health.v1.Health/Check answers for "" and every registered service:
 * SERVING (true) or NOT_SERVING (false). Unknown service names get NOT_FOUND. Thread-safe. */
void rpc_server_set_serving(rpc_server *s, bool serving);

/* Graceful shutdown: health NOT_SERVING for health_drain_ms, stop accepting calls, give
 * in-flight calls shutdown_grace_ms to finish, cancel the rest, wait until every call is
 * freed (every application reference dropped), stop the workers. Idempotent; call it from a
 * thread that is not a worker (not from a handler or callback). Returns the number of calls
 * still alive when the grace period ended, which were cancelled (>= 0). */
int rpc_server_shutdown(rpc_server *s);

/* Shuts down if needed and frees the server. NULL is a no-op. */
void rpc_server_destroy(rpc_server *s);

/* Calls delivered to the server and not yet freed (includes calls that the application still
 * references). Must be 0 after rpc_server_shutdown. */
int64_t rpc_server_live_calls(const rpc_server *s);

/* Server counters since start, for tests and metrics. */
typedef struct {
    int64_t tls_reloads;            /* certificate pairs taken after the first (files changed) */
    int64_t calls_started;          /* calls delivered to a handler or refused */
    int64_t calls_cancelled;        /* calls cancelled before they finished */
    int64_t calls_unimplemented;    /* unknown methods answered UNIMPLEMENTED */
    int64_t calls_bad_request;      /* requests missing or not decodable: INVALID_ARGUMENT */
    int64_t msgs_sent;              /* response messages the transport accepted */
    int64_t live_calls_peak;        /* most calls alive at once */
} rpc_server_stats;

void rpc_server_stats_get(const rpc_server *s, rpc_server_stats *out);

/* Checks the string fields of a message encoded as desc in buf[0, len) before it is decoded:
 * every string (nested messages included, found through the field descriptors; unknown
 * fields skipped) must be valid UTF-8 (RFC 3629: no overlong forms, surrogates or code points
 * above U+10FFFF) and contain no NUL byte (protobuf-c hands strings out NUL-terminated, so a
 * NUL would silently cut one). The server runs it on every request (rpc_validate.c).
 * Returns 0; PD_EINVAL when a string is bad; PD_EFORMAT when the wire format is malformed
 * (truncated varint or field, bad wire type, nesting deeper than 64). err (PD_ERR_LEN, may be
 * NULL) names the field path, e.g. "stopping.stop[1]: not valid UTF-8 (at byte offset 3)" or
 * "prompt: contains a NUL byte at offset 12". */
int rpc_validate_strings(const ProtobufCMessageDescriptor *desc, const void *buf, size_t len,
                         char *err);

/* ---- server calls (all thread-safe) ---- */

/* Takes a reference on the call: it (and its request) stays valid until the matching
 * rpc_call_unref. */
void rpc_call_ref(rpc_call *c);
/* Drops a reference. Dropping the last one of a call that was never finished finishes it with
 * INTERNAL. NULL is a no-op. */
void rpc_call_unref(rpc_call *c);

/* Unary calls: sends resp (serialized here; the caller keeps ownership) and status OK.
 * Returns 0, PD_ESTATE (already finished, cancelled, or not a unary call), PD_EINVAL (resp
 * larger than max_send_msg_bytes), PD_ENOMEM. */
int rpc_call_reply(rpc_call *c, const ProtobufCMessage *resp);

/* Server-streaming and bidi calls: queues msg (serialized here; the caller keeps ownership)
 * behind the messages already queued; it goes out when the one before it was accepted by the
 * transport. Never blocks. Returns 0; PD_ENOSPC when stream_queue_max messages are already
 * queued (nothing was queued: wait with rpc_stream_wait_writable, or coalesce and retry
 * later); PD_ESTATE when the call is finished or cancelled (stop producing) or is a unary
 * call; PD_EINVAL (msg NULL or larger than max_send_msg_bytes), PD_ENOMEM. */
int rpc_stream_send(rpc_call *c, const ProtobufCMessage *msg);

/* Ends any call with a status, after the messages already queued (an OK unary call needs
 * rpc_call_reply instead). fmt (printf-style, may be NULL) gives status details; keep them
 * actionable. Returns 0, or PD_ESTATE when already finished or cancelled (nothing is sent).
 * After it returns the cancel callback is not running and will not run (whatever it
 * returned), so the callback's user data may be freed; nor is a bidi call's handler (unless
 * called from the handler itself, or from the cancel callback).
 * Lock order: it waits for a cancel callback (and a bidi handler run) on another thread, so
 * never call it (nor rpc_call_reply, which waits the same way) while holding a lock that the
 * call's cancel callback or bidi handler takes: finish after unlocking. */
int rpc_stream_finish(rpc_call *c, rpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Blocks until the call can take another message (fewer than stream_queue_max queued), the
 * call is finished or cancelled, or timeout_ms passes (< 0: no limit). Returns 0 (writable),
 * PD_ESTATE (finished or cancelled), 1 (timed out). Never call it on a worker thread (from a
 * handler or callback): the workers are what drains the queue. */
int rpc_stream_wait_writable(rpc_call *c, int timeout_ms);

/* Messages queued and not yet accepted by the transport (including one in flight). */
int rpc_stream_pending(rpc_call *c);

/* Sets the function run once if the call is cancelled before it finished; replaces any
 * earlier one; fn NULL removes it. If the call is already cancelled, fn runs now on the
 * calling thread. If the application already finished the call (rpc_stream_finish or
 * rpc_call_reply, even one that returned PD_ESTATE on a cancelled call), nothing is set and
 * fn never runs. After it returns, a previously set callback is not running and will not
 * run again. */
void rpc_call_set_cancel_cb(rpc_call *c, rpc_cancel_fn fn, void *user);

/* True once the call was cancelled (client cancel or disconnect, deadline, shutdown): stop
 * working on it. Cheap (one atomic load). */
bool rpc_call_is_cancelled(const rpc_call *c);

/* Attaches per-call application data (a bidi call's state between handler runs). free_fn
 * (may be NULL) takes ownership of data: it runs once when the call is freed (every reference
 * dropped, no handler or callback of the call running), on the thread that dropped the last
 * reference or a server worker. Setting again replaces data and free_fn without running the
 * old free_fn. */
void rpc_call_set_data(rpc_call *c, void *data, void (*free_fn)(void *));
/* The data set with rpc_call_set_data, or NULL. */
void *rpc_call_data(const rpc_call *c);

/* Milliseconds until the client's deadline (may be <= 0 once passed), or INT64_MAX when the
 * client set none. */
int64_t rpc_call_remaining_ms(const rpc_call *c);

/* The method's path ("/pdserve.v1.Generation/Generate"). Valid while the call is referenced. */
const char *rpc_call_path(const rpc_call *c);

/* Copies the first value of request metadata key (lowercase) into buf (NUL-terminated,
 * truncated to len - 1 bytes). Returns the value's full length (>= 0), or PD_ENOTFOUND. */
int rpc_call_metadata(const rpc_call *c, const char *key, char *buf, size_t len);

/* Copies the caller's host (the peer address without scheme and port: "10.0.0.5", "::1";
 * a unix socket's path) into buf (NUL-terminated, truncated to len - 1 bytes), for per-caller
 * limits and logs. Returns its full length (>= 0), or PD_ENOTFOUND. */
int rpc_call_peer(const rpc_call *c, char *buf, size_t len);
/* Copies the identity of a caller that presented a client certificate the server verified
 * (mutual TLS: the certificate's subject alternative name, else its common name) into buf
 * (NUL-terminated, truncated to len). Returns its length; 0 when the caller is not
 * authenticated that way (plaintext, or TLS without a client certificate). */
int rpc_call_peer_identity(const rpc_call *c, char *buf, size_t len);

/* A number unique to the call within the process (for logs). */
uint64_t rpc_call_id(const rpc_call *c);

/* ------------------------------------------------------------------------------------------
 * Client
 * ---------------------------------------------------------------------------------------- */

typedef struct rpc_channel rpc_channel;         /* opaque; one HTTP/2 connection (or more) */
typedef struct rpc_client_call rpc_client_call; /* opaque; an asynchronous call */
typedef struct rpc_client_stream rpc_client_stream; /* opaque; a blocking stream reader */

/* A channel's TLS settings (PEM files, read when the channel is created). */
typedef struct {
    const char *ca_file;            /* CA certificates that verify the server; NULL or "" = no
                                       TLS, plaintext (then the other fields must be unset) */
    const char *cert_file;          /* client certificate chain for mutual TLS; NULL or "" =
                                       none */
    const char *key_file;           /* its private key; required with cert_file */
    const char *server_name;        /* name the server's certificate must carry instead of the
                                       target's host (tests, or a DNS name for an address);
                                       NULL or "" = the target's host */
} rpc_client_tls;

typedef struct {
    const char *target;             /* "host:port" (or any gRPC target URI); required */
    int max_recv_msg_bytes;         /* largest response accepted, bytes; -1 = unlimited
                                       (default 64 MiB) */
    int max_send_msg_bytes;         /* largest request sent, bytes; -1 = unlimited (default) */
    rpc_client_tls tls;             /* transport security; default off (plaintext) */
    bool wait_for_ready;            /* calls wait for the server instead of failing fast with
                                       UNAVAILABLE while it is unreachable; default false */
} rpc_channel_params;

rpc_channel_params rpc_channel_default_params(void);

/* One request metadata entry: key lowercase ASCII ("x-request-id"; keys ending in "-bin"
 * carry binary values, others printable ASCII). */
typedef struct {
    const char *key;
    const char *value;              /* NUL-terminated */
} rpc_metadata;

/* Per-call options of the *_opts client functions; NULL means no deadline and no metadata.
 * The plain functions take just a timeout. */
typedef struct {
    int64_t timeout_ms;             /* deadline from now; <= 0 = none */
    const rpc_metadata *md;         /* [n_md] request metadata, copied; NULL if none */
    size_t n_md;
} rpc_call_opts;

/* Creates a channel (connects lazily). p is copied; with TLS its files are read and checked
 * here. Returns 0, PD_EINVAL, PD_EIO (a TLS file cannot be read), PD_EFORMAT (a TLS file is
 * not valid PEM of the right kind, or the key does not match the certificate; err names the
 * file), PD_ENOMEM. */
int rpc_channel_create(const rpc_channel_params *p, rpc_channel **out, char *err);

/* Cancels the channel's asynchronous calls that are still running, waits for their on_done,
 * and frees the channel. Blocking calls and streams must be closed first. NULL is a no-op.
 * From one of this channel's own on_message / on_done callbacks (its completion thread,
 * which the destruction joins: a router request that drops the last reference to an
 * instance the registry already let go) it returns at once and a thread of its own does
 * the rest once the callback has returned. */
void rpc_channel_destroy(rpc_channel *ch);

/* Blocking unary call of path with req; waits at most timeout_ms (<= 0: no deadline). On OK
 * *resp receives the decoded response (of type resp_desc; caller frees with
 * protobuf_c_message_free_unpacked(*resp, NULL)). st (may be NULL) receives the status.
 * Returns 0 (OK), the positive rpc_status_code of a failed call (*resp is NULL; local
 * failures such as a request over the size limit or bad metadata are reported as such codes
 * too), or PD_EINVAL for NULL arguments. Thread-safe: any number of threads may call at once
 * on one channel. */
int rpc_unary_call(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                   ProtobufCMessage **resp, rpc_status *st);
/* The same with options (deadline and request metadata; opts may be NULL). */
int rpc_unary_call_opts(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                        const ProtobufCMessageDescriptor *resp_desc, const rpc_call_opts *opts,
                        ProtobufCMessage **resp, rpc_status *st);

/* Opens a server-streaming call of path with req and a deadline timeout_ms from now (<= 0:
 * none), read with rpc_client_stream_next on one thread (cancel from any). Returns 0,
 * PD_EINVAL (bad arguments, request over the size limit, bad metadata), PD_ENOMEM. */
int rpc_client_stream_open(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                           const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                           rpc_client_stream **out, char *err);
/* The same with options (deadline and request metadata; opts may be NULL). */
int rpc_client_stream_open_opts(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                                const ProtobufCMessageDescriptor *resp_desc,
                                const rpc_call_opts *opts, rpc_client_stream **out, char *err);

/* Opens a bidirectional-streaming call of path with opts' deadline and metadata (opts may be
 * NULL); nothing is sent yet. Write requests with rpc_client_stream_send, end them with
 * rpc_client_stream_close_send, read responses with rpc_client_stream_next; one thread may
 * write while another reads (cancel from any). The rest of the rpc_client_stream functions
 * apply. Returns 0, PD_EINVAL (bad arguments or metadata), PD_ENOMEM. */
int rpc_client_bidi_open(rpc_channel *ch, const char *path,
                         const ProtobufCMessageDescriptor *resp_desc, const rpc_call_opts *opts,
                         rpc_client_stream **out, char *err);

/* Bidi calls: sends msg (serialized here; the caller keeps ownership) and blocks until the
 * transport took it (HTTP/2 flow control: until the server reads enough). Returns 0;
 * PD_ESTATE when the call ended (its status says why) or the sending side is closed, or the
 * stream is not a bidi call; PD_EINVAL (msg NULL or larger than max_send_msg_bytes),
 * PD_ENOMEM. */
int rpc_client_stream_send(rpc_client_stream *s, const ProtobufCMessage *msg);

/* Bidi calls: half-closes (the server's handler sees the end of the requests). Blocks until
 * the transport took it. Idempotent. Returns 0, or PD_ESTATE when the call already ended or
 * the stream is not a bidi call. */
int rpc_client_stream_close_send(rpc_client_stream *s);

/* Blocks for the next response. Returns 1 with *msg set (caller frees with
 * protobuf_c_message_free_unpacked), or 0 at the end of the stream (*msg NULL; the status
 * says whether it ended well: rpc_client_stream_status). */
int rpc_client_stream_next(rpc_client_stream *s, ProtobufCMessage **msg);

/* Cancels the call (the server sees it; the reader gets the end of stream and CANCELLED).
 * Thread-safe (e.g. while another thread waits in rpc_client_stream_next); idempotent; not
 * after rpc_client_stream_close. */
void rpc_client_stream_cancel(rpc_client_stream *s);

/* Waits for the call's final status (reads and discards the rest of the stream if needed;
 * a bidi call whose requests are not closed waits for the server to end it). Returns
 * st->code. */
int rpc_client_stream_status(rpc_client_stream *s, rpc_status *st);

/* Cancels the call unless it ended, waits for it, frees everything. NULL is a no-op. */
void rpc_client_stream_close(rpc_client_stream *s);

/* Callbacks of an asynchronous call; they run on the channel's completion thread, one at a
 * time, and must not block. */
typedef struct {
    /* A response arrived; takes ownership of msg (free with protobuf_c_message_free_unpacked).
     * The next response is read only after this returns (backpressure). May be NULL. */
    void (*on_message)(rpc_client_call *c, ProtobufCMessage *msg, void *user);
    /* The call ended (always called once, last). st is borrowed for the callback. */
    void (*on_done)(rpc_client_call *c, const rpc_status *st, void *user);
    void *user;
} rpc_client_callbacks;

/* Starts an asynchronous unary or server-streaming call of path with req (serialized here)
 * and a deadline timeout_ms from now (<= 0: none); the callbacks report its responses and
 * end. *out receives a handle that the caller owns and must release with
 * rpc_client_call_release (at any time, even before on_done; the call keeps running).
 * Returns 0, PD_EINVAL, PD_ENOMEM (then no callback runs). */
int rpc_client_call_start(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                          const rpc_client_callbacks *cb, rpc_client_call **out, char *err);
/* The same with options (deadline and request metadata; opts may be NULL). */
int rpc_client_call_start_opts(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                               const ProtobufCMessageDescriptor *resp_desc,
                               const rpc_call_opts *opts, const rpc_client_callbacks *cb,
                               rpc_client_call **out, char *err);

/* Cancels the call; on_done follows with CANCELLED unless it already ran. Thread-safe. */
void rpc_client_call_cancel(rpc_client_call *c);

/* Drops the caller's handle; the call is freed after on_done. NULL is a no-op. */
void rpc_client_call_release(rpc_client_call *c);

/* Asynchronous calls of this channel that have not yet run on_done. */
int64_t rpc_channel_live_calls(const rpc_channel *ch);

/* ------------------------------------------------------------------------------------------
 * TLS flags shared by the programs (each also PDSERVE_<NAME>, see common/flags.h)
 * ---------------------------------------------------------------------------------------- */

/* A server's: --tls-cert, --tls-key, --tls-client-ca (set: client certificates are required
 * and verified against it, mutual TLS), --handshake-timeout-ms. */
typedef struct {
    const char *cert;               /* PEM certificate chain; "" = plaintext */
    const char *key;                /* its private key */
    const char *client_ca;          /* CA of the clients' certificates; "" = none asked */
    int64_t handshake_timeout_ms;   /* see rpc_server_params; default 10000 */
} rpc_server_tls_flags;

void rpc_server_tls_flags_init(rpc_server_tls_flags *f);
/* Appends the 4 flag entries at flags[*n]; f is borrowed and must outlive the parse. */
void rpc_server_tls_flags_add(rpc_server_tls_flags *f, pd_flag *flags, int *n);
/* Copies the parsed flags into p (its tls and handshake_timeout_ms; strings borrowed). */
void rpc_server_tls_flags_apply(const rpc_server_tls_flags *f, rpc_server_params *p);

/* A client's, into t (fields "" until set; borrowed, must outlive the parse): --tls-ca (set:
 * TLS, verifying the server with it), --tls-cert and --tls-key (a client certificate, for
 * servers that require one), --tls-server-name. With internal, the same names prefixed
 * "internal-" (the router's channels to its instances). Appends 4 entries at flags[*n]. */
void rpc_client_tls_flags_add(rpc_client_tls *t, pd_flag *flags, int *n, bool internal);

#endif
