/* rpc_impl.h -- Internal structures of the gRPC layer (common/rpc/): server, server call and
 * the helpers shared by its files. Not for use outside common/rpc/. */
#ifndef PD_RPC_IMPL_H
#define PD_RPC_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "common/rpc/rpc.h"

/* What a completion-queue tag stands for; every tag points at one of these. */
typedef enum {
    RPC__TAG_NEW = 0,   /* a requested call arrived (or the request died at shutdown) */
    RPC__TAG_CLOSE,     /* RECV_CLOSE_ON_SERVER completed: the call is over, maybe cancelled */
    RPC__TAG_SEND,      /* the outbound batch in flight completed */
    RPC__TAG_RECV,      /* a bidi call's RECV_MESSAGE completed (a request, or the half-close) */
    RPC__TAG_SHUTDOWN,  /* grpc_server_shutdown_and_notify completed */
} rpc__tag_kind;

typedef struct {
    rpc__tag_kind kind;
    void *obj;          /* rpc_call (NEW, CLOSE, SEND, RECV) or rpc_server (SHUTDOWN) */
} rpc__tag;

/* A registered method. */
typedef struct {
    char *path;                                 /* "/pkg.Svc/Method", owned */
    const ProtobufCMessageDescriptor *req_desc; /* request type */
    rpc_method_kind kind;
    rpc_handler_fn handler;
    void *user;
    void *handle;                               /* grpc_server_register_method's handle */
} rpc__method;

/* rpc_tls.c: a server's TLS files and the fetcher that reloads them. */
typedef struct rpc__tls_server rpc__tls_server;
/* Copies p's paths after checking that they go together; *out stays NULL without TLS.
 * Reads no file. Returns 0, PD_EINVAL, PD_ENOMEM with err. */
int rpc__tls_server_create(const rpc_server_tls *p, rpc__tls_server **out, char *err);
/* Reads and checks the files and makes server credentials on a fetcher over t (caller
 * releases *creds; t must outlive the grpc_server). Returns 0, PD_EIO, PD_EFORMAT, PD_ENOMEM
 * with err naming the file. */
int rpc__tls_server_creds(rpc__tls_server *t, grpc_server_credentials **creds, char *err);
/* After grpc_server_destroy. NULL is a no-op. */
void rpc__tls_server_free(rpc__tls_server *t);
int64_t rpc__tls_server_reloads(const rpc__tls_server *t); /* 0 for NULL */
/* Channel credentials for p: insecure without a CA file, else SSL with p's files (read and
 * checked here). Caller releases *creds. Returns 0, PD_EINVAL, PD_EIO, PD_EFORMAT, PD_ENOMEM
 * with err. */
int rpc__tls_channel_creds(const rpc_client_tls *p, grpc_channel_credentials **creds,
                           char *err);

/* rpc_descriptors.c: an index over a serialized FileDescriptorSet (server reflection). */
typedef struct rpc__fds rpc__fds;
/* Copies set[0, len) and indexes its files and symbols. Returns 0; PD_EFORMAT (malformed wire
 * format, a file or a definition without a name, a file there twice, an import missing from
 * the set, a symbol defined twice; err says which), PD_ENOMEM. */
int rpc__fds_create(const void *set, size_t len, rpc__fds **out, char *err);
void rpc__fds_free(rpc__fds *f); /* NULL is a no-op */
int rpc__fds_n_files(const rpc__fds *f);
/* File i's serialized FileDescriptorProto (borrowed from f; *len bytes) and name. */
const uint8_t *rpc__fds_file(const rpc__fds *f, int file, const char **name, size_t *len);
/* The index of the file named name, or -1. */
int rpc__fds_find_file(const rpc__fds *f, const char *name);
/* The index of the file that defines the fully-qualified symbol name (a leading dot is
 * ignored): message, field, oneof, enum, enum value ("pkg.VALUE"), service, method,
 * extension; or -1. *is_message (may be NULL) says whether it is a message type. */
int rpc__fds_find_symbol(const rpc__fds *f, const char *name, bool *is_message);
/* The index of the file that defines extension number of message extendee, or -1. */
int rpc__fds_find_extension(const rpc__fds *f, const char *extendee, int32_t number);
/* Writes the numbers of extendee's extensions to out[0, max); returns how many there are. */
int rpc__fds_extension_numbers(const rpc__fds *f, const char *extendee, int32_t *out, int max);
/* Writes file and, depth first, every file it imports directly or not into order (room for
 * rpc__fds_n_files), each once, file first. Returns their number, or PD_ENOMEM. */
int rpc__fds_closure(const rpc__fds *f, int file, int *order);

struct rpc_server {
    rpc_server_params p;
    char *listen_addr;                  /* owned copy of p.listen_addr */
    rpc__tls_server *tls;               /* NULL without TLS; freed after the grpc_server */
    rpc__method **methods;              /* [n_methods], owned */
    int n_methods;
    char **services;                    /* [n_services] names the health check knows, owned;
                                           also what reflection lists */
    int n_services;
    rpc__fds *reflection;               /* rpc_server_add_reflection's index, or NULL */

    grpc_server *server;                /* NULL until started and after shutdown */
    grpc_completion_queue *cq;          /* shared by every worker */
    pthread_t *threads;                 /* [n_threads_started] */
    int n_threads_started;
    int port;

    pthread_mutex_t mu;                 /* guards the fields below and the lifecycle */
    pthread_cond_t cv;                  /* signalled when live/pending drop, shutdown tag */
    int64_t live;                       /* calls delivered and not yet freed */
    int64_t pending;                    /* request slots posted to core, not completed */
    bool started, shutting_down, shut_down, shutdown_tag_done;
    rpc__tag shutdown_tag;

    atomic_bool serving;                /* health answer */
    atomic_llong n_started, n_cancelled, n_unimplemented, n_bad_request, n_msgs_sent;
    int64_t live_peak;                  /* under mu */
};

struct rpc_call {
    rpc_server *srv;
    const rpc__method *m;               /* NULL for calls of unknown methods */
    uint64_t id;

    /* Filled by core when the call arrives. */
    grpc_call *call;
    gpr_timespec deadline;              /* GPR_CLOCK_MONOTONIC, or infinite */
    grpc_metadata_array md;
    grpc_byte_buffer *payload;          /* unary and server-streaming calls: the request, may
                                           be NULL; bidi calls read theirs into recv_bb */
    grpc_call_details details;          /* unknown-method calls: the path */
    char *path;                         /* unknown-method calls: owned copy of the path */
    ProtobufCMessage *req;              /* decoded request, freed with the call (not bidi) */
    grpc_byte_buffer *recv_bb;          /* bidi: RECV_MESSAGE's out-parameter */

    rpc__tag tag_new, tag_close, tag_send, tag_recv;
    int close_cancelled;                /* RECV_CLOSE_ON_SERVER's out-parameter */

    pthread_mutex_t mu;                 /* guards everything below */
    pthread_cond_t cv;                  /* writable / cancel callback finished */
    int refs;                           /* holders + core batches in flight; freed at 0 */
    int holders;                        /* dispatch + application references */

    grpc_byte_buffer **q;               /* ring of queued responses [q_cap] */
    int q_head, q_len, q_cap;
    grpc_byte_buffer *inflight;         /* the SEND_MESSAGE buffer in flight */
    int n_writers_waiting;              /* threads in rpc_stream_wait_writable */
    bool md_sent, send_inflight, finish_queued, status_sent;
    atomic_bool cancelled;
    int status_code;
    grpc_slice status_details;          /* owned; unref'd when the call is freed */

    rpc_cancel_fn cancel_fn;
    void *cancel_user;
    bool cancel_fired;
    bool app_finished;                  /* the application finished the call (even if it was
                                           cancelled first): no cancel callback any more */
    bool cb_running;
    pthread_t cb_thread;

    /* Bidi calls. The layer holds one holder reference (the dispatch's) as the "reader" from
     * the call's arrival until the handler's half-close run returned, or the reading stopped
     * (cancelled, finished, a bad request). */
    bool reading;                       /* the reader holder is held */
    bool recv_paused;                   /* the next RECV_MESSAGE waits for room in the queue
                                           (posted by rpc__call_on_send) */
    bool h_running;                     /* the handler runs (on h_thread) */
    pthread_t h_thread;

    void *data;                         /* rpc_call_set_data */
    void (*data_free)(void *);
};

/* rpc_common.c */
void rpc__global_init(void); /* once per process: routes gRPC's log lines to common/log.h */
/* Serializes msg into a new byte buffer (caller destroys). Returns 0, PD_ENOMEM, or PD_EINVAL
 * when it is larger than max_bytes (> 0). */
int rpc__encode(const ProtobufCMessage *msg, int max_bytes, grpc_byte_buffer **out);
/* Decodes bb (NULL: PD_EINVAL) as desc. Returns 0 or PD_EFORMAT (not a valid message). */
int rpc__decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc,
                ProtobufCMessage **out);
/* rpc_validate.c: reads bb's bytes once, checks their strings (rpc_validate_strings) and
 * decodes them as m's request type into *out (the caller frees it). Returns 0; PD_EINVAL (bb
 * NULL, or a string that is not valid UTF-8 or holds a NUL) or PD_EFORMAT (not a valid
 * message), with the status details for the client in msg (PD_ERR_LEN). */
int rpc__decode_request(grpc_byte_buffer *bb, const rpc__method *m, ProtobufCMessage **out,
                        char *msg);
gpr_timespec rpc__deadline_from_ms(int64_t timeout_ms);
void rpc__copy_slice(char *dst, size_t len, grpc_slice s);

/* rpc_call.c: the per-call state machine, driven by the server's workers. */
void rpc__call_on_new(rpc_call *c, bool ok);
void rpc__call_on_close(rpc_call *c, bool ok);
void rpc__call_on_send(rpc_call *c, bool ok);
void rpc__call_on_recv(rpc_call *c, bool ok);
rpc_call *rpc__call_alloc(rpc_server *s, const rpc__method *m);
void rpc__call_free_unused(rpc_call *c);

/* rpc_server.c: called by rpc_call.c. */
/* Posts one request slot for method m (NULL: unknown methods) unless shutting down. */
void rpc__server_post(rpc_server *s, const rpc__method *m);
void rpc__server_call_delivered(rpc_server *s);
void rpc__server_call_freed(rpc_server *s);
void rpc__server_slot_done(rpc_server *s);

#endif
