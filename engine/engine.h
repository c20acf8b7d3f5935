/* engine.h -- The serving engine: requests in, one step at a time (schedule -> run ->
 * postprocess), new tokens out per step so a caller can stream. One thread owns an engine.
 *
 * Modes: colocated (prefill and decode here), prefill-only (compute the prompt, sample the
 * first token, hand the block ids out, keep the blocks until eng_release), decode-only (reserve
 * blocks for a prompt whose KV arrives from outside, then eng_admit with the first token). */
#ifndef PD_ENGINE_H
#define PD_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model_runner.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "text/model_config.h"

/* Most choices (samples of one prompt sharing its KV) a request may ask for. */
#define ENG_MAX_CHOICES 16

typedef enum {
    ENG_MODE_COLOCATED = 0,
    ENG_MODE_PREFILL,
    ENG_MODE_DECODE,
} eng_mode;

/* What runs a forward: the model runner, or a fake in tests. */
typedef struct {
    int (*forward)(void *ctx, const mr_batch *b, float *logits, char *err);
    void *ctx;
    /* Optional: installs (fn != NULL) or removes a per-layer KV-ready hook for the next
     * forwards (see mr_set_layer_hook). */
    void (*set_layer_hook)(void *ctx, mr_layer_fn fn, void *arg);
    /* Optional: a forward that samples the logits rows where they are (mr_forward_sample);
     * when set the engine uses it instead of forward + the host sampler. */
    int (*forward_sample)(void *ctx, const mr_batch *b, const mr_sampling *s, char *err);
    /* Optional, with forward_sample (both or neither): pipelined steps, as mr_launch and
     * mr_collect (engine/model_runner.h). launch queues a forward that samples and returns at
     * once, PD_EUNSUPPORTED when it queued nothing (the engine then runs the step with
     * forward_sample); with ids_from_last each row's input token is what the launch before
     * sampled for the same row. collect waits for the oldest launch not yet collected. */
    int (*launch)(void *ctx, const mr_batch *b, const mr_sampling *s, bool ids_from_last,
                  char *err);
    int (*collect)(void *ctx, char *err);
    /* Optional: copies KV blocks src[i] over dst[i] (n pairs, host arrays) in order with the
     * forwards (mr_clone_blocks): the copy on write of a forked choice's partial prompt block.
     * NULL (or an error): such a choice recomputes its context instead, as after a
     * preemption (its full prompt blocks then come from the prefix cache, if on). */
    int (*clone_blocks)(void *ctx, const int32_t *src, const int32_t *dst, int32_t n,
                        char *err);
} eng_executor;

/* The executor that runs r (borrowed; must outlive the engine). */
eng_executor eng_executor_runner(mr *r);

typedef struct {
    eng_mode mode;
    int32_t n_blocks;               /* KV blocks (must match the executor's pool), > 0 */
    int32_t block_size;             /* tokens per block (must match the executor's), > 0 */
    int32_t max_num_batched_tokens; /* tokens per step (<= the runner's), > 0 */
    int32_t max_num_seqs;           /* sequences per step (<= the runner's), > 0 */
    int32_t max_model_len;          /* longest sequence; 0 = the model's max_position */
    bool enable_prefix_cache;       /* reuse cached full blocks of earlier prompts */
    bool enable_chunked_prefill;    /* split long prompts over steps */
    bool async_steps;               /* with an executor that launches: while the host reads a
                                     * decode step's tokens, the next step (the same sequences,
                                     * one token on) already runs (default on;
                                     * PDSERVE_ASYNC_STEPS=0 turns it off) */
} eng_params;

/* Defaults for a runner: its pool, block size and step sizes; prefix cache and chunked
 * prefill on; colocated. */
/* Pipelined decode steps by default: true unless PDSERVE_ASYNC_STEPS=0. */
bool eng_async_steps_default(void);
eng_params eng_default_params(const mr *r);

typedef struct {
    uint64_t id;                    /* caller's id, unique among live requests */
    const int32_t *prompt;          /* [n_prompt], copied */
    int32_t n_prompt;               /* >= 1 */
    smp_params sampling;
    seq_stopping stop;
    bool logprobs;                  /* report each token's log-probability under the raw
                                       model distribution (costs a log-softmax a token) */
    int32_t top_logprobs;           /* with logprobs: also each token's best alternatives,
                                       0..PD_MAX_TOP_LOGPROBS */
    int32_t n;                      /* choices: samples of the prompt, 0 or 1 = one, at most
                                       ENG_MAX_CHOICES (and max_num_seqs). The prompt is
                                       computed once; at its first token the request forks into
                                       n sequences that share its full blocks (reference counts)
                                       and copy its last partial block. Choice i draws from seed
                                       + i when sampling.has_seed, else from a seed of its own;
                                       each choice's tokens carry their own logprobs and top */
    /* Resuming a request that another engine began (the router's migration after its decode
     * instance died or froze): n_resume > 0 lists the choices that go on, each with the tokens
     * it already generated (prompt stays the request's prompt). Each becomes a sequence of
     * its own (no fork) that computes prompt + its tokens (their full blocks shared through
     * the prefix cache, when on) and continues exactly as choice c of the request would have:
     * seed + c, the draw at output position len, penalties and min/max_tokens counting the
     * tokens given. The request is done when those choices are. */
    int32_t n_resume;               /* choices resumed, 0 = a new request; <= max(n, 1) */
    const int32_t *resume_choice;   /* [n_resume] distinct choice indices, each < max(n, 1) */
    const int32_t *resume_len;      /* [n_resume] tokens each generated, 0 <= len < max_tokens */
    const int32_t *resume_tokens;   /* those tokens, choice after choice (sum of resume_len) */
} eng_request;

/* One sequence's news from a step. A request of n choices has one sequence per choice: its
 * outputs carry the choice index, and every choice ends with an output whose finish is set;
 * `done` marks the request's last output (every choice finished). */
typedef struct {
    uint64_t id;
    int32_t choice;                 /* index of the choice, 0 .. n - 1 (0 for one choice) */
    bool done;                      /* the request's last output: every choice finished */
    int32_t token;                  /* the new token, or -1 when none (abort) */
    float logprob;                  /* when the request asked for logprobs: log-probability
                                       of token under the raw model distribution (the
                                       log-softmax of the model's logits, before penalties,
                                       temperature and filters; smp_logprobs), else 0 */
    const pd_top_logprob *top;      /* with logprobs: the request's top_logprobs best tokens
                                       under that distribution, best first (borrowed until
                                       the next eng_step); NULL when n_top is 0 */
    int32_t n_top;                  /* entries of top (fewer than asked only when fewer
                                       tokens have a logit above -inf) */
    seq_finish finish;              /* SEQ_FINISH_NONE while running */
    int32_t n_prompt;
    int32_t n_cached;               /* prompt tokens taken from the prefix cache */
    int32_t n_output;               /* output tokens so far, including this one */
    double queue_s;                 /* seconds from arrival (decode-only: admission) to the
                                       first step that scheduled it (0 if never) */
    const int32_t *block_ids;       /* prefill-only, finish PREFILLED: its blocks (borrowed
                                       until eng_release) */
    int32_t n_blocks;
    int32_t n_choices;              /* the request's choices (>= 1) */
    const int32_t *choice_tokens;   /* prefill-only, PREFILLED with n_choices > 1: each choice's
                                       first token ([n_choices], [0] = token; borrowed until
                                       eng_release), else NULL */
    const float *choice_logprobs;   /* their log-probabilities (as logprob), or NULL */
    const pd_top_logprob *choice_top; /* with choice_logprobs and top_logprobs > 0: choice c's
                                       alternatives at [c * PD_MAX_TOP_LOGPROBS], best first
                                       (as top), else NULL */
    const int32_t *choice_n_top;    /* [n_choices] entries of each choice's list (as n_top), or
                                       NULL with choice_top */
} eng_output;

typedef struct {
    int64_t steps;
    int64_t prompt_tokens_computed; /* prompt (and recompute) tokens run through the model */
    int64_t decode_tokens;          /* tokens run as single-token decode steps */
    int64_t cached_tokens;          /* prompt tokens served by the prefix cache */
    int64_t admitted_prompt_tokens; /* prompt tokens of admitted sequences */
    int64_t reserved_prompt_tokens; /* decode: prompt tokens of reservations */
    int64_t reserved_cached_tokens; /* decode: of those, shared from the prefix cache (their KV
                                       was not transferred) */
    int64_t preemptions;
    int64_t forks;                  /* n > 1 requests forked into their choices */
    int64_t fork_cloned_blocks;     /* partial prompt blocks copied for forked choices */
    int64_t fork_recomputed;        /* forked choices that recompute instead (no free block, or
                                       no clone op) */
    int64_t choices_ended;          /* choices ended by the caller while their request's other
                                       choices went on (eng_end_choice) */
    int64_t batch_seqs_sum;         /* sum over steps of sequences in the step */
    int32_t peak_blocks_used;
    double model_s;                 /* time inside the executor */
    double prefill_model_s;         /* executor time of steps with any prompt tokens */
    double decode_model_s;          /* executor time of steps with only decode tokens */
    int64_t decode_steps;           /* steps with only decode tokens */
    double host_s;                  /* time in scheduling, batch building and postprocess */
    double sample_s;                /* of host_s, time in the host sampler */
} eng_stats;

typedef struct eng eng; /* opaque */

/* Prefill-only engines: news for pushing KV layer by layer while the prompt is computed.
 * Both run on the engine thread. */
typedef struct {
    /* Before the forward of a step in which n requests compute their last prompt tokens:
     * their ids and block tables (borrowed for the call; the blocks stay held until
     * eng_release). */
    void (*on_prompt_step)(void *arg, const uint64_t *ids, const int32_t *const *block_ids,
                           const int32_t *n_blocks, int32_t n);
    /* During that forward: layer `layer`'s KV of those requests is final. */
    void (*on_layer)(void *arg, int32_t layer);
    void *arg;
} eng_kv_listener;

/* Creates an engine for the model described by cfg (copied) that runs forwards with exec.
 * Returns 0, PD_EINVAL (bad params, err says which), PD_ENOMEM. */
int eng_create(const eng_params *p, const mc_config *cfg, eng_executor exec, eng **out,
               char *err);
void eng_destroy(eng *e); /* NULL is a no-op; drops every request */

/* Sets (copies) the KV listener of a prefill-only engine; NULL removes it. Layer news needs an
 * executor with set_layer_hook. */
void eng_set_kv_listener(eng *e, const eng_kv_listener *l);

/* Queues a request (any mode; a decode-only engine then computes the prompt itself). Checks
 * it first: non-empty prompt, ids in
 * the vocabulary, prompt + max_tokens within max_model_len and within the KV pool, sampling
 * values, a unique id. Returns 0 or PD_EINVAL / PD_ERANGE / PD_ENOMEM with err set. */
int eng_add_request(eng *e, const eng_request *r, char *err);
/* Aborts a request in any state (every choice of it) and frees its blocks at once; a block
 * shared by its choices is freed once the last choice drops it. Returns 0 or PD_ENOTFOUND. */
int eng_abort(eng *e, uint64_t id);
/* Ends one choice (0 .. n - 1) of a request of n choices while the others go on (the caller
 * matched a stop string in it): the choice finishes with SEQ_FINISH_CANCELLED, reported by the
 * next eng_step like any finish (its last output; `done` when no other choice is left), and
 * its blocks are freed then (a block its siblings share stays theirs; a launched step's row
 * keeps them until it is collected). A choice that is no sequence of its own yet (the prompt
 * is still being computed, or a decode-only reservation waits for its KV) is marked and ends
 * with its first token, at the fork or the admission: nothing a reservation holds is touched.
 * Returns 0; PD_ENOTFOUND when the request is unknown (ended, aborted) or that choice has
 * already finished or been ended; PD_EINVAL for a choice out of range; PD_ESTATE on a
 * prefill-only engine; PD_ENOMEM. */
int eng_end_choice(eng *e, uint64_t id, int32_t choice);

/* Runs one step. *outs receives one entry per sequence that got a token or finished this step
 * (borrowed; valid until the next eng_step). Returns 0 or an executor error (then every
 * request of the step is aborted and reported with SEQ_FINISH_ABORTED). */
int eng_step(eng *e, const eng_output **outs, int32_t *n_outs, char *err);
/* True while any request is waiting or running. */
bool eng_has_work(const eng *e);

/* Prefill-only: frees the blocks of a request that finished with SEQ_FINISH_PREFILLED (after
 * its KV was shipped). Returns 0 or PD_ENOTFOUND. */
int eng_release(eng *e, uint64_t id);

/* Decode (and colocated) modes, phase 1: checks r as eng_add_request does and reserves blocks for its prompt
 * (plus the first token). *block_ids (borrowed; valid until eng_admit / eng_abort) receives
 * the prompt's blocks in position order. With the prefix cache on, the leading full blocks
 * of the prompt that are cached are shared (decode-side prefix reuse): *n_cached_blocks of
 * them, always fewer than *n_blocks, hold their KV already and must not be written; the KV
 * of the others must be written from outside. Returns 0, PD_ENOSPC (no room now; try later
 * or elsewhere) or a validation error. */
int eng_reserve(eng *e, const eng_request *r, const int32_t **block_ids, int32_t *n_blocks,
                int32_t *n_cached_blocks, char *err);
/* Decode-only, phase 2: the prompt's KV is in the reserved blocks and first_token was sampled
 * by the prefill side; the sequence joins the running batch. Returns 0, PD_ENOTFOUND, or
 * PD_EINVAL (token out of range). If the first token already ends the request, it finishes at
 * the next step. */
int eng_admit(eng *e, uint64_t id, int32_t first_token, char *err);
/* eng_admit for a request of n choices: first_tokens[n] are the choices' first tokens
 * (sampled by the prefill side, choice i with its own seed). The request forks at once into
 * its n sequences (shared full blocks, a copy of the partial one). n must be the request's
 * n (PD_EINVAL otherwise). */
int eng_admit_n(eng *e, uint64_t id, const int32_t *first_tokens, int32_t n, char *err);

int32_t eng_n_waiting(const eng *e);
int32_t eng_n_running(const eng *e);
int32_t eng_n_free_blocks(const eng *e);
/* Prompt (or recompute) tokens of waiting and running requests not computed yet. */
int64_t eng_queued_prompt_tokens(const eng *e);
const eng_stats *eng_stats_get(const eng *e);
/* Checks that every block's reference count equals the number of live sequences holding it,
 * plus the block manager's own invariants. Returns 0 or -1 with a message on stderr (tests). */
int eng_check(const eng *e);
/* The block manager (for tests and metrics). */
const bm *eng_block_manager(const eng *e);

#endif
