/* worker.h -- The engine thread: one thread owns an engine and runs its steps; other threads
 * (gRPC I/O) hand it commands through a queue and get results through callbacks that run on
 * the engine thread. This is the only way services touch an engine.
 *
 * Callback contract: for every request submitted with ew_submit (or ew_reserve), exactly one
 * terminal callback happens: an output with done set (its last choice finished: for a request
 * of one choice the output with finish != SEQ_FINISH_NONE), or on_error. After it
 * the worker never mentions that request's `user` pointer again, so the caller may free it.
 * ew_abort of a live request produces a terminal output with SEQ_FINISH_ABORTED. */
#ifndef PD_WORKER_H
#define PD_WORKER_H

#include <stdint.h>

#include "engine/engine.h"

typedef struct {
    /* A step produced news for a request (a token, a finish). Runs on the engine thread. */
    void (*on_output)(void *user, const eng_output *o);
    /* A request was refused (validation, no room) or failed; code is a PD_E* error and msg a
     * human-readable reason. Terminal. Runs on the engine thread. */
    void (*on_error)(void *user, int code, const char *msg);
    /* Decode-only: blocks were reserved for a request (ew_reserve): the prompt's blocks in
     * position order, the first n_cached of them shared from the prefix cache (their KV is
     * there: nothing may write them). block_ids is borrowed for the call. Not terminal. Runs
     * on the engine thread. */
    void (*on_reserved)(void *user, const int32_t *block_ids, int32_t n_blocks, int32_t n_cached);
    /* Optional (metrics): after every step that ran a forward, with its wall time in seconds
     * (eng_step as a whole) and the number of sequences in its batch. Runs on the engine
     * thread; step_arg is passed through. */
    void (*on_step)(void *step_arg, double seconds, int32_t n_seqs);
    /* Optional: a step failed (msg says why); the requests it carried get on_error with
     * PD_EBACKEND (not a cancellation). A failed step usually means a broken device (a sticky
     * CUDA error): services mark themselves unhealthy. Runs on the engine thread with
     * step_arg. */
    void (*on_step_failed)(void *step_arg, const char *msg);
    void *step_arg;
} ew_callbacks;

/* A snapshot of the engine's load, refreshed after every step (for load reports). */
typedef struct {
    int32_t n_running;
    int32_t n_waiting;
    int32_t n_free_blocks;
    int32_t n_blocks;
    int64_t queued_prompt_tokens; /* prompt tokens submitted but not yet computed */
    int64_t n_step_failures;      /* engine steps that failed since start */
    double prefill_tok_per_s;     /* prompt tokens per second of recent steps that computed
                                     at least 64 of them (token-weighted moving average;
                                     0 = none yet) */
    eng_stats stats;
} ew_load;

typedef struct ew ew; /* opaque */

/* Starts the engine thread. e is taken over (destroyed by ew_destroy); cb is copied.
 * Returns 0 or PD_ENOMEM / PD_EBACKEND (thread creation failed). */
int ew_create(eng *e, const ew_callbacks *cb, ew **out);
/* Stops the thread: requests still live get on_error(PD_ESTATE, "shutting down"); then the
 * engine is destroyed. NULL is a no-op. */
void ew_destroy(ew *w);

/* Queues a request (prompt copied). Thread-safe. Returns 0 or PD_ENOMEM; validation happens
 * on the engine thread and failures arrive through on_error. */
int ew_submit(ew *w, const eng_request *r, void *user);
/* Decode-only: queues a reservation; on_reserved or on_error follows. Thread-safe. */
int ew_reserve(ew *w, const eng_request *r, void *user);
/* Decode-only: the reserved request's KV has arrived; it joins the batch. Thread-safe. */
int ew_admit(ew *w, uint64_t id, int32_t first_token);
/* Runs on the engine thread right before a reserved request is admitted (ew_admit_ex), e.g.
 * to copy its landed KV into the engine's cache. A negative return (a PD_E* error, message in
 * err) refuses the admission: the request is aborted and gets on_error with it. */
typedef int (*ew_admit_fn)(void *arg, eng *e, char *err);
/* ew_admit, with fn(arg, ...) run on the engine thread first (fn may be NULL). fn runs only if
 * the request is still live (not aborted meanwhile); arg stays the caller's either way.
 * Thread-safe. */
int ew_admit_ex(ew *w, uint64_t id, int32_t first_token, ew_admit_fn fn, void *arg);
/* Decode-only, n choices: ew_admit with each choice's first token (first_tokens[n], copied;
 * n is the request's eng_request.n, 1 .. ENG_MAX_CHOICES). Thread-safe. Returns 0,
 * PD_EINVAL or PD_ENOMEM. */
int ew_admit_n(ew *w, uint64_t id, const int32_t *first_tokens, int32_t n);
/* Prefill-only: the request's blocks may be reused (its KV was shipped). Thread-safe. */
int ew_release(ew *w, uint64_t id);
/* Aborts a live request (a terminal SEQ_FINISH_ABORTED output follows; unknown ids are
 * ignored). Thread-safe. */
int ew_abort(ew *w, uint64_t id);
/* Ends one choice of a live request while its other choices go on (eng_end_choice): the
 * choice's last output (SEQ_FINISH_CANCELLED, `done` when it was the last choice) follows
 * through on_output. Unknown requests and choices that already ended are ignored, so it may
 * race with the request's own end or an abort. Thread-safe. Returns 0, PD_EINVAL (choice out
 * of 0 .. ENG_MAX_CHOICES - 1) or PD_ENOMEM. */
int ew_end_choice(ew *w, uint64_t id, int32_t choice);
/* Copies the latest load snapshot. Thread-safe. */
void ew_load_get(ew *w, ew_load *out);

#endif
