/* scheduler.c -- Step building for continuous batching (see scheduler.h). Queues are intrusive
 * doubly linked lists through pd_seq.prev/next. */
#include "engine/scheduler.h"

#include <stdlib.h>

#include "common/error.h"

typedef struct {
    pd_seq *head, *tail;
    int32_t n;
} seq_queue;

struct sched {
    sched_params p;
    bm *blocks;
    seq_queue waiting, running;
    sched_item *items; /* [max_num_seqs] */
    int64_t n_preemptions;
};

sched_params sched_default_params(void)
{
    sched_params p = {.max_num_batched_tokens = 2048, .max_num_seqs = 256,
                      .enable_chunked_prefill = true};
    return p;
}

static void q_push_back(seq_queue *q, pd_seq *s)
{
    s->next = NULL;
    s->prev = q->tail;
    if (q->tail) q->tail->next = s; else q->head = s;
    q->tail = s;
    q->n++;
}

static void q_push_front(seq_queue *q, pd_seq *s)
{
    s->prev = NULL;
    s->next = q->head;
    if (q->head) q->head->prev = s; else q->tail = s;
    q->head = s;
    q->n++;
}

static void q_unlink(seq_queue *q, pd_seq *s)
{
    if (s->prev) s->prev->next = s->next; else q->head = s->next;
    if (s->next) s->next->prev = s->prev; else q->tail = s->prev;
    s->prev = s->next = NULL;
    q->n--;
}

int sched_create(const sched_params *p, bm *blocks, sched **out)
{
    *out = NULL;
    if (p->max_num_batched_tokens <= 0 || p->max_num_seqs <= 0) return PD_EINVAL;
    sched *s = calloc(1, sizeof *s);
    if (!s) return PD_ENOMEM;
    s->items = malloc((size_t)p->max_num_seqs * sizeof *s->items);
    if (!s->items) {
        free(s);
        return PD_ENOMEM;
    }
    s->p = *p;
    s->blocks = blocks;
    *out = s;
    return 0;
}

void sched_destroy(sched *s)
{
    if (!s) return;
    free(s->items);
    free(s);
}

void sched_add_waiting(sched *s, pd_seq *seq)
{
    seq->status = SEQ_WAITING;
    q_push_back(&s->waiting, seq);
}

void sched_add_running(sched *s, pd_seq *seq)
{
    seq->status = SEQ_RUNNING;
    q_push_back(&s->running, seq);
}

void sched_remove(sched *s, pd_seq *seq)
{
    seq_queue *q = seq->status == SEQ_WAITING ? &s->waiting
                 : seq->status == SEQ_RUNNING ? &s->running : NULL;
    /* The status alone does not say the sequence is queued (removed already, never added):
     * unlinking one that is not would empty the queue. Unlinked sequences have prev NULL. */
    if (q && (seq->prev || q->head == seq)) q_unlink(q, seq);
}

static void preempt(sched *s, pd_seq *victim)
{
    q_unlink(&s->running, victim);
    bm_free(s->blocks, victim);
    victim->n_computed = 0;
    victim->n_preempted++;
    victim->status = SEQ_WAITING;
    q_push_front(&s->waiting, victim);
    s->n_preemptions++;
}

/* Logits rows an item of seq samples: one, or one per choice when the request forks at this
 * token (n > 1 choices: engine.h). They count against max_num_seqs like sequences. */
static int32_t rows_of(const pd_seq *seq, int32_t n_new)
{
    return seq->n_fork > 0 && seq->n_computed + n_new == seq->n_tokens ? seq->n_fork + 1 : 1;
}

int sched_schedule(sched *s, sched_out *out)
{
    int32_t budget = s->p.max_num_batched_tokens, n = 0, n_preempted = 0;
    int32_t rows = 0; /* logits rows (>= n): a forking request samples once per choice */
    out->n_admitted_tokens = out->n_cached_tokens = 0;
    /* 1. Running sequences, oldest first. */
    pd_seq *seq = s->running.head;
    while (seq && rows < s->p.max_num_seqs && budget > 0) {
        pd_seq *next = seq->next;
        int32_t n_new = seq->n_tokens - seq->n_computed;
        if (n_new <= 0) { /* nothing to compute (e.g. waiting for an external event) */
            seq = next;
            continue;
        }
        if (n_new > budget) {
            /* Without chunked prefill a sequence waits for a step with room, unless it can
             * never fit one (a recompute after preemption: prompt + output). */
            if (!s->p.enable_chunked_prefill && n_new <= s->p.max_num_batched_tokens) {
                seq = next;
                continue;
            }
            n_new = budget;
        }
        if (rows + rows_of(seq, n_new) > s->p.max_num_seqs) { /* its choices' rows: later */
            seq = next;
            continue;
        }
        bool self_preempted = false;
        while (!bm_can_append(s->blocks, seq, seq->n_computed + n_new)) {
            pd_seq *victim = s->running.tail;
            if (victim == seq) {
                preempt(s, seq);
                n_preempted++;
                self_preempted = true;
                break;
            }
            if (victim == next) next = NULL; /* the loop ends at seq now */
            preempt(s, victim);
            n_preempted++;
        }
        if (self_preempted) break;
        int rc = bm_append(s->blocks, seq, seq->n_computed + n_new);
        PD_ASSERT(rc == 0, "bm_append failed after bm_can_append");
        rows += rows_of(seq, n_new);
        s->items[n++] = (sched_item){seq, n_new, seq->n_computed + n_new == seq->n_tokens};
        bm_commit(s->blocks, seq, seq->n_computed + n_new);
        budget -= n_new;
        seq = next;
    }
    /* 2. Waiting sequences, in order, unless this step had to preempt. */
    while (n_preempted == 0 && s->waiting.head && rows < s->p.max_num_seqs && budget > 0) {
        seq = s->waiting.head;
        int cached = bm_can_allocate(s->blocks, seq, seq->n_tokens);
        if (cached < 0) break;
        int32_t n_new = seq->n_tokens - cached;
        if (n_new > budget) {
            if (!s->p.enable_chunked_prefill && n_new <= s->p.max_num_batched_tokens) break;
            n_new = budget;
        }
        const int32_t nr = seq->n_fork > 0 && n_new == seq->n_tokens - cached ? seq->n_fork + 1 : 1;
        if (rows + nr > s->p.max_num_seqs) break;
        rows += nr;
        cached = bm_allocate(s->blocks, seq, seq->n_tokens);
        PD_ASSERT(cached >= 0, "bm_allocate failed after bm_can_allocate");
        out->n_admitted_tokens += seq->n_tokens;
        out->n_cached_tokens += cached;
        q_unlink(&s->waiting, seq);
        seq->status = SEQ_RUNNING;
        q_push_back(&s->running, seq);
        s->items[n++] = (sched_item){seq, n_new, seq->n_computed + n_new == seq->n_tokens};
        bm_commit(s->blocks, seq, seq->n_computed + n_new);
        budget -= n_new;
    }
    out->items = s->items;
    out->n_items = n;
    out->n_tokens = s->p.max_num_batched_tokens - budget;
    out->n_preempted = n_preempted;
    return 0;
}

int32_t sched_n_waiting(const sched *s) { return s->waiting.n; }
int32_t sched_n_running(const sched *s) { return s->running.n; }
int64_t sched_n_preemptions(const sched *s) { return s->n_preemptions; }
