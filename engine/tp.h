/* tp.h -- Tensor parallelism's plumbing: the rank threads a tensor-parallel model runner fans
 * its work out to, and a model loaded on n ranks (one backend, one weight shard a rank, and
 * the communicator among them). One process, one thread a rank: rank 0 runs on the caller's
 * thread (the engine thread), ranks 1 .. n - 1 on threads of their own. See
 * docs/tensor-parallel.md. */
#ifndef PD_TP_H
#define PD_TP_H

#include <stdint.h>

#include "engine/model.h"
#include "kernels/backend.h"

/* ---- rank threads ---- */

typedef struct tp_pool tp_pool; /* opaque */

/* What a rank runs: returns 0 or a negative error. */
typedef int (*tp_fn)(void *arg, int32_t rank);

/* Starts n_ranks - 1 threads (none for one rank). Returns 0, PD_EINVAL (n_ranks < 1),
 * PD_ENOMEM. Free with tp_pool_destroy (NULL is a no-op), which joins them. */
int tp_pool_create(int32_t n_ranks, tp_pool **out, char *err);
void tp_pool_destroy(tp_pool *p);
int32_t tp_pool_size(const tp_pool *p);

/* Runs fn(arg, r) for every rank r at once (rank 0 on the calling thread) and returns when
 * every rank's call returned: 0, or the error of the lowest rank that failed (rank_out, may be
 * NULL, receives that rank, -1 when none). One call at a time; not reentrant. */
int tp_pool_run(tp_pool *p, tp_fn fn, void *arg, int32_t *rank_out);

/* ---- each layer's KV readiness on every rank (a layer hook's events) ----
 * While a tensor-parallel runner has a layer hook (mr_set_layer_hook), every rank, on its own
 * thread, records an event on its own stream right after it queued a layer's KV store and
 * marks the layer stored here; rank 0 waits until every rank has before it calls the hook,
 * which may take the events (mr_layer_events). The wait is for the other threads to have
 * queued the store, never for a device: rank 0 gets there after the layer's attention
 * all-reduce, which on the CPU is a barrier that every rank entered after its store (no
 * wait at all), and on GPUs is queued without waiting for the others' threads. */

typedef struct tp_lsync tp_lsync; /* opaque */

/* For n_ranks ranks of n_layers layers; be[r] (borrowed; must outlive it) records rank r's
 * events (its event_record; a backend without one records none: NULL events). Returns 0,
 * PD_EINVAL, PD_ENOMEM. Free with tp_lsync_destroy (NULL is a no-op), which releases the
 * events nobody took. */
int tp_lsync_create(int32_t n_ranks, int32_t n_layers, pd_backend *const *be, tp_lsync **out,
                    char *err);
void tp_lsync_destroy(tp_lsync *s);
/* Before a forward, while no rank runs: releases the events left untaken and marks nothing
 * stored, no rank failed. */
void tp_lsync_reset(tp_lsync *s);
/* Rank `rank`'s thread, after it queued layer's KV store: records its event and marks the
 * layer stored (a failed record leaves the event NULL, logged). */
void tp_lsync_stored(tp_lsync *s, int32_t rank, int32_t layer);
/* Rank 0's thread: returns true once every rank marked layer stored, false as soon as a rank
 * failed in this forward (tp_lsync_fail). */
bool tp_lsync_wait(tp_lsync *s, int32_t layer);
/* A rank failed in this forward: every wait returns false from now until the next reset. */
void tp_lsync_fail(tp_lsync *s);
/* After tp_lsync_wait(layer) returned true: moves the ranks' events of layer into ev[n_ranks]
 * (each released with its rank's backend's event_release). Returns 0 when every rank's is
 * there; PD_EBACKEND, with every ev[r] NULL and nothing held, when one is missing (not
 * recorded, or taken before); PD_EINVAL for a layer out of range. */
int tp_lsync_take(tp_lsync *s, int32_t layer, void **ev);

/* ---- a model on n ranks ---- */

typedef struct {
    const char *backend;         /* auto, cpu or cuda (pd_backend_create) */
    pd_backend_params bp;        /* for rank r the device is bp.device + r */
    int32_t n_ranks;             /* tensor-parallel degree, >= 1 */
    const mc_config *cfg;        /* the model (borrowed for the call) */
    const char *dir;             /* its directory (safetensors) */
    pd_load_format fmt;
    uint64_t seed;               /* dummy weights */
} tp_group_params;

typedef struct {
    int32_t n_ranks;
    pd_backend **be;             /* [n_ranks] rank r's backend */
    pd_model **models;           /* [n_ranks] rank r's shard, on be[r] */
    pd_comm *comm;               /* among be[], NULL with one rank */
} tp_group;

/* Creates the ranks' backends, loads each rank's shard (pd_model_load_shard) and creates the
 * communicator. Returns 0, or an error with err: PD_EINVAL (the model does not divide, or
 * its backend has no communicator), a backend's or the loader's error. Free with
 * tp_group_destroy (NULL is a no-op). */
int tp_group_load(const tp_group_params *p, tp_group **out, char *err);
void tp_group_destroy(tp_group *g);

#endif
