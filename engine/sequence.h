/* sequence.h -- One request's state inside the engine: its tokens (prompt, then output), how
 * many of them have KV in the cache, its block table, sampling and stopping settings, and its
 * place in the scheduler's queues. Plain data; the engine owns every pd_seq. */
#ifndef PD_SEQUENCE_H
#define PD_SEQUENCE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/sampler.h"
#include "text/request_params.h"

typedef enum {
    SEQ_WAITING = 0,   /* queued for (re)prefill; holds no blocks */
    SEQ_RUNNING,       /* holds blocks, scheduled every step until it finishes */
    SEQ_PREFILLED,     /* prefill-only mode: prompt done, blocks held until released */
    SEQ_RESERVED,      /* decode-only mode: blocks reserved, waiting for its KV to arrive */
    SEQ_FINISHED,
} seq_status;


typedef struct pd_seq {
    uint64_t id;               /* caller's request id, unique among live requests */
    seq_status status;
    seq_finish finish;
    int32_t *tokens;           /* [cap]: prompt, then output tokens */
    int32_t n_tokens;          /* prompt + output so far */
    int32_t n_prompt;
    int32_t cap;               /* n_prompt + max_tokens */
    int32_t n_computed;        /* leading tokens whose KV is in this sequence's blocks */
    int32_t n_cached;          /* prompt tokens found in the prefix cache at admission */
    int32_t n_hashed;          /* leading full blocks registered in the prefix cache */
    uint64_t last_hash;        /* chained hash of block n_hashed - 1 (0 if none) */
    int32_t *block_table;      /* [max_blocks] */
    int32_t n_blocks;
    int32_t max_blocks;
    smp_params sampling;
    seq_stopping stop;
    int32_t n_preempted;       /* times preempted by recompute */
    double t_arrival;          /* monotonic s: added (decode-only: admitted) */
    double t_scheduled;        /* monotonic s: first step that scheduled it; 0 before */
    bool want_logprob;         /* report the sampled token's log-probability */
    int32_t n_top;             /* with want_logprob: alternatives to report, 0..20 */
    bool skip_prefix_cache;    /* never map this sequence onto cached blocks (its KV is
                                  written from outside: decode-only reservations) */
    int32_t n_launched;        /* launched steps not yet collected that hold a row of it (the
                                  engine's pipelined steps): its blocks and memory stay until 0 */
    /* Choices (n > 1 samples of one prompt, forked after the prompt): */
    int32_t choice;            /* this sequence's index among its request's choices (0 first) */
    int32_t n_choices;         /* the request's choices, >= 1 */
    int32_t n_fork;            /* choices still to fork off at the first token: n_choices - 1
                                  until the prompt is done, then 0 (always 0 when n_choices 1) */
    uint64_t *choice_seeds;    /* [n_choices] while n_fork > 0 (NULL for one choice): each
                                  choice's seed */
    int32_t *first_tokens;     /* [n_choices] prefill-only, n_choices > 1: each choice's first
                                  token once sampled (same allocation as choice_seeds) */
    float *first_logprobs;     /* [n_choices] their log-probabilities */
    int32_t *first_n_top;      /* [n_choices] the entries of each one's alternatives */
    pd_top_logprob *first_top; /* [n_choices][PD_MAX_TOP_LOGPROBS] their alternatives (best
                                  first) when the request asked for some, else NULL */
    uint32_t end_mask;         /* choices the caller ended (eng_end_choice) before they were
                                  sequences of their own (before the fork, or a reservation's
                                  admission): bit c = choice c; each ends as soon as it has its
                                  first token */
    struct pd_seq *sib_next, *sib_prev; /* ring of the request's live choices (itself alone) */
    struct pd_seq *prev, *next; /* queue links */
} pd_seq;

static inline int32_t seq_n_output(const pd_seq *s) { return s->n_tokens - s->n_prompt; }

#endif
