/* scheduler.h -- Continuous-batching scheduler: waiting and running queues, a per-step token
 * budget and sequence cap, chunked prefill (a long prompt is split over steps and shares them
 * with other sequences' decodes), preemption by recompute when KV blocks run out. Pure
 * bookkeeping over pd_seq and the block manager; it runs nothing. */
#ifndef PD_SCHEDULER_H
#define PD_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/block_manager.h"
#include "engine/sequence.h"

typedef struct {
    int32_t max_num_batched_tokens; /* tokens per step (prompt chunks + decodes), > 0 */
    int32_t max_num_seqs;           /* sequences per step, > 0 */
    bool enable_chunked_prefill;    /* split prompts longer than the remaining budget */
} sched_params;

sched_params sched_default_params(void);

/* One scheduled sequence: compute its tokens [n_computed, n_computed + n_new); sample the next
 * token if that reaches the end of its known tokens. */
typedef struct {
    pd_seq *seq;
    int32_t n_new;
    bool sample;
} sched_item;

typedef struct {
    sched_item *items;   /* borrowed; valid until the next sched_schedule */
    int32_t n_items;
    int32_t n_tokens;    /* sum of n_new */
    int32_t n_preempted; /* sequences preempted while building this step */
    int64_t n_admitted_tokens; /* tokens of sequences admitted from waiting this step */
    int64_t n_cached_tokens;   /* of those, tokens found in the prefix cache */
} sched_out;

typedef struct sched sched; /* opaque */

/* Creates a scheduler over the block manager bm (borrowed; must outlive it). */
int sched_create(const sched_params *p, bm *blocks, sched **out);
void sched_destroy(sched *s); /* NULL is a no-op; does not touch the queued sequences */

/* Appends s (status WAITING, no blocks) to the waiting queue. */
void sched_add_waiting(sched *s, pd_seq *seq);
/* Appends s (status RUNNING, holding blocks for its computed tokens) to the running queue. */
void sched_add_running(sched *s, pd_seq *seq);
/* Takes seq out of whichever queue holds it (no-op if none); does not free its blocks. */
void sched_remove(sched *s, pd_seq *seq);

/* Builds the next step. Running sequences go first, oldest first, each getting its remaining
 * tokens (1 when decoding) within the budget; when a running sequence needs a block and none is
 * free, the newest running sequences are preempted (blocks freed, back to the front of the
 * waiting queue, to be recomputed). Then waiting sequences are admitted in order while blocks,
 * budget and sequence slots last (none after a preemption in the same step). Full blocks the
 * step will complete are registered in the prefix cache (bm_commit), so later admissions in
 * the same step can share them. Returns 0. */
int sched_schedule(sched *s, sched_out *out);

int32_t sched_n_waiting(const sched *s);
int32_t sched_n_running(const sched *s);
int64_t sched_n_preemptions(const sched *s); /* since creation */

#endif
