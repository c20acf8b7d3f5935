/* svc_kvt.h -- The KV-transfer thread of a service: owns a kvt_ctx (everything of a ctx is
 * single-threaded), progresses it with poll() on its fd, and runs functions posted by other
 * threads (gRPC workers, the engine thread) in order between progress turns. kvt events are
 * delivered on this thread too. */
#ifndef PD_SVC_KVT_H
#define PD_SVC_KVT_H

#include "kvtransfer/kvtransfer.h"

typedef struct svc_kvt svc_kvt; /* opaque */

/* Runs on the kvt thread with the thread's context. */
typedef void (*svc_kvt_fn)(kvt_ctx *ctx, void *arg);

/* Starts the thread and creates the ctx on it with p (p->on_event runs on the thread).
 * Returns 0 or the kvt_ctx_create error with err. */
int svc_kvt_create(const kvt_params *p, svc_kvt **out, char *err);
/* Runs fn(ctx, arg) on the kvt thread soon. Thread-safe. Returns 0 or PD_ENOMEM / PD_ESTATE
 * (stopping: fn will not run). */
int svc_kvt_post(svc_kvt *k, svc_kvt_fn fn, void *arg);
/* Runs fn(ctx, arg) on the kvt thread and waits for it. Not from the kvt thread. */
int svc_kvt_call(svc_kvt *k, svc_kvt_fn fn, void *arg);
/* Copies the ctx's counters (kvt_ctx_stats, read on the kvt thread). Not from the kvt thread.
 * Returns 0 or PD_ESTATE (stopping). */
int svc_kvt_stats(svc_kvt *k, kvt_stats *out);
/* Stops the thread after the posted functions ran, destroys the ctx there. NULL: no-op. */
void svc_kvt_destroy(svc_kvt *k);

#endif
