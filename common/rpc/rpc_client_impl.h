/* rpc_client_impl.h -- Internal structures of the client half of the gRPC layer: the channel
 * (shared by blocking and asynchronous calls) and helpers between rpc_client.c and
 * rpc_client_async.c. Not for use outside common/rpc/. */
#ifndef PD_RPC_CLIENT_IMPL_H
#define PD_RPC_CLIENT_IMPL_H

#include "common/rpc/rpc_impl.h"

struct rpc_channel {
    rpc_channel_params p;               /* target not kept (only needed at create) */
    grpc_channel *ch;

    /* Asynchronous calls: one completion queue and one thread, started by the first call. */
    pthread_mutex_t mu;                 /* guards the fields below */
    pthread_cond_t cv;                  /* signalled when n_async drops */
    grpc_completion_queue *cq;
    pthread_t thread;
    bool thread_started;
    int64_t n_async;                    /* calls started and not yet done */
    rpc_client_call *live;              /* list of those calls (for cancel at destroy) */
};

/* Request metadata copied from rpc_call_opts, alive until the call's batches are done. */
typedef struct {
    grpc_metadata *md;                  /* [n], slices owned */
    size_t n;
} rpc__md;

/* Copies opts' metadata (opts may be NULL). Returns 0, PD_EINVAL (illegal key or value; err
 * says which), PD_ENOMEM. */
int rpc__md_build(const rpc_call_opts *opts, rpc__md *out, char *err);
void rpc__md_free(rpc__md *m);

/* The request side of a new client call: opts' metadata into *md and req encoded into *bb
 * (at most ch's max_send_msg_bytes). Returns 0, or an error with err naming `what` (then
 * nothing is left to free). */
int rpc__request_prepare(rpc_channel *ch, const rpc_call_opts *opts, const ProtobufCMessage *req,
                         const char *what, rpc__md *md, grpc_byte_buffer **bb, char *err);

/* The four ops that open every client call: send md (wait-for-ready as ch says), send bb,
 * close the sending side, receive the initial metadata into init_md. Fills ops[0..3]; the
 * caller appends its receive ops from ops[4]. */
void rpc__request_ops(const rpc_channel *ch, const rpc__md *md, grpc_byte_buffer *bb,
                      grpc_metadata_array *init_md, grpc_op *ops);

/* Creates a call of path on ch bound to cq with opts' deadline (opts may be NULL). */
grpc_call *rpc__channel_new_call(rpc_channel *ch, grpc_completion_queue *cq, const char *path,
                                 const rpc_call_opts *opts);
/* Fills st from what RECV_STATUS_ON_CLIENT returned (details, else core's error string). */
void rpc__fill_status(rpc_status *st, grpc_status_code code, grpc_slice details,
                      const char *error_string);
/* Cancels the asynchronous calls still running, waits for them and stops the thread. */
void rpc__channel_stop_async(rpc_channel *ch);
/* Whether the calling thread is ch's completion thread (its callbacks run there). */
bool rpc__on_channel_thread(rpc_channel *ch);

#endif
