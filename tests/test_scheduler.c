/* test_scheduler.c -- Unit tests for the continuous-batching scheduler over a real block
 * manager: FCFS admission within the sequence cap and token budget, chunked prefill, decodes
 * before prompts, preemption by recompute, removal, and a random run that emulates the engine
 * (a forward writes every scheduled token's KV, then reads each sequence's whole context)
 * against a shadow model of the KV blocks. */
#include <stdbool.h>
#include <stdint.h>

#include "common/error.h"
#include "engine/block_manager.h"
#include "engine/scheduler.h"
#include "test_util.h"

#define T_CAP 96
#define T_MAXB 96

/* A hand-built sequence: pd_seq plus the storage it points into. Never copied after init. */
typedef struct {
    pd_seq s;
    int32_t tok[T_CAP];
    int32_t bt[T_MAXB];
} tseq;

/* Prompt t[0..n), room for max_tokens more, block table sized for the whole capacity. */
static void tseq_init(tseq *t, uint64_t id, const int32_t *tokens, int32_t n, int32_t max_tokens,
                      int32_t block_size)
{
    memset(t, 0, sizeof *t);
    if (n > 0) memcpy(t->tok, tokens, (size_t)n * sizeof(int32_t));
    t->s.id = id;
    t->s.tokens = t->tok;
    t->s.block_table = t->bt;
    t->s.n_tokens = n;
    t->s.n_prompt = n;
    t->s.cap = n + max_tokens;
    t->s.max_blocks = (t->s.cap + block_size - 1) / block_size;
    t->s.stop.max_tokens = max_tokens;
    t->s.status = SEQ_WAITING;
}

/* Prompt of n tokens base, base + 1, ... */
static void tseq_seq(tseq *t, uint64_t id, int32_t base, int32_t n, int32_t max_tokens,
                     int32_t block_size)
{
    int32_t tok[T_CAP];
    for (int32_t i = 0; i < n; i++) tok[i] = base + i;
    tseq_init(t, id, tok, n, max_tokens, block_size);
}

typedef struct {
    bm *m;
    sched *s;
} rig;

static rig make_rig(int32_t n_blocks, int32_t block_size, bool cache, int32_t budget,
                    int32_t max_seqs, bool chunked)
{
    rig r = {NULL, NULL};
    bm_params bp = bm_default_params();
    bp.n_blocks = n_blocks;
    bp.block_size = block_size;
    bp.enable_prefix_cache = cache;
    CHECK_EQ_INT(bm_create(&bp, &r.m), 0);
    sched_params sp = sched_default_params();
    sp.max_num_batched_tokens = budget;
    sp.max_num_seqs = max_seqs;
    sp.enable_chunked_prefill = chunked;
    CHECK_EQ_INT(sched_create(&sp, r.m, &r.s), 0);
    return r;
}

static void free_rig(rig *r)
{
    sched_destroy(r->s);
    bm_destroy(r->m);
}

/* What the engine does after a forward: advance, and append a sampled token. */
static void apply(const sched_out *o, int32_t next_token)
{
    for (int32_t i = 0; i < o->n_items; i++) {
        pd_seq *s = o->items[i].seq;
        s->n_computed += o->items[i].n_new;
        if (o->items[i].sample && s->n_tokens < s->cap) s->tokens[s->n_tokens++] = next_token;
    }
}

/* Finishes s as the engine's retire() does. */
static void finish(rig *r, pd_seq *s)
{
    sched_remove(r->s, s);
    if (s->n_blocks) bm_free(r->m, s);
    s->status = SEQ_FINISHED;
}

static int32_t item_of(const sched_out *o, const pd_seq *s)
{
    for (int32_t i = 0; i < o->n_items; i++)
        if (o->items[i].seq == s) return i;
    return -1;
}

/* ---- create ---- */

static void test_create(void)
{
    bm *m = NULL;
    bm_params bp = bm_default_params();
    CHECK_EQ_INT(bm_create(&bp, &m), 0);
    sched_params sp = sched_default_params();
    CHECK(sp.max_num_batched_tokens > 0);
    CHECK(sp.max_num_seqs > 0);
    sched *s = (sched *)1;
    sp.max_num_seqs = 0;
    CHECK_EQ_INT(sched_create(&sp, m, &s), PD_EINVAL);
    CHECK(s == NULL);
    sp = sched_default_params();
    sp.max_num_batched_tokens = 0;
    CHECK_EQ_INT(sched_create(&sp, m, &s), PD_EINVAL);
    sched_destroy(NULL);
    bm_destroy(m);
}

/* ---- empty steps ---- */

static void test_empty(void)
{
    rig r = make_rig(16, 4, true, 32, 4, true);
    sched_out o;
    memset(&o, 0x5a, sizeof o);
    CHECK_EQ_INT(sched_schedule(r.s, &o), 0);
    CHECK_EQ_INT(o.n_items, 0);
    CHECK_EQ_INT(o.n_tokens, 0);
    CHECK_EQ_INT(o.n_preempted, 0);
    CHECK_EQ_INT(o.n_admitted_tokens, 0);
    CHECK_EQ_INT(o.n_cached_tokens, 0);
    CHECK_EQ_INT(sched_n_waiting(r.s), 0);
    CHECK_EQ_INT(sched_n_running(r.s), 0);
    CHECK_EQ_INT(sched_n_preemptions(r.s), 0);

    /* A running sequence with nothing to compute (all tokens computed) is skipped. */
    static tseq a;
    tseq_seq(&a, 1, 10, 5, 4, 4);
    CHECK_EQ_INT(bm_allocate(r.m, &a.s, 5), 0);
    a.s.n_computed = 5;
    sched_add_running(r.s, &a.s);
    CHECK_EQ_INT(a.s.status, SEQ_RUNNING);
    CHECK_EQ_INT(sched_n_running(r.s), 1);
    CHECK_EQ_INT(sched_schedule(r.s, &o), 0);
    CHECK_EQ_INT(o.n_items, 0);
    CHECK_EQ_INT(o.n_tokens, 0);
    CHECK_EQ_INT(a.s.n_blocks, 2);
    finish(&r, &a.s);
    CHECK_EQ_INT(sched_n_running(r.s), 0);
    CHECK_EQ_INT(bm_n_free(r.m), 16);
    free_rig(&r);
}

/* ---- admission ---- */

static void test_fcfs_admission(void)
{
    static tseq q[5];
    sched_out o;

    /* Sequence cap: 3 of 5 admitted, in order. */
    rig r = make_rig(64, 4, true, 100, 3, true);
    for (int32_t i = 0; i < 5; i++) {
        tseq_seq(&q[i], (uint64_t)i, 100 * (i + 1), 10, 8, 4);
        sched_add_waiting(r.s, &q[i].s);
        CHECK_EQ_INT(q[i].s.status, SEQ_WAITING);
    }
    CHECK_EQ_INT(sched_n_waiting(r.s), 5);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 3);
    CHECK_EQ_INT(o.n_tokens, 30);
    CHECK_EQ_INT(o.n_preempted, 0);
    CHECK_EQ_INT(o.n_admitted_tokens, 30);
    CHECK_EQ_INT(o.n_cached_tokens, 0);
    for (int32_t i = 0; i < 3; i++) {
        CHECK(o.items[i].seq == &q[i].s);
        CHECK_EQ_INT(o.items[i].n_new, 10);
        CHECK(o.items[i].sample);
        CHECK_EQ_INT(q[i].s.status, SEQ_RUNNING);
        CHECK_EQ_INT(q[i].s.n_blocks, 3);
        CHECK_EQ_INT(q[i].s.n_computed, 0); /* the engine advances it after the forward */
    }
    for (int32_t i = 3; i < 5; i++) {
        CHECK_EQ_INT(q[i].s.status, SEQ_WAITING);
        CHECK_EQ_INT(q[i].s.n_blocks, 0);
    }
    CHECK_EQ_INT(sched_n_waiting(r.s), 2);
    CHECK_EQ_INT(sched_n_running(r.s), 3);
    CHECK_EQ_INT(bm_n_used(r.m), 9);
    CHECK_EQ_INT(bm_n_cached_blocks(r.m), 6); /* 2 full blocks each, registered at schedule */
    CHECK_EQ_INT(bm_check(r.m), 0);
    apply(&o, 7);
    /* Next step: 3 decodes; the cap leaves no slot for the waiting ones. */
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 3);
    CHECK_EQ_INT(o.n_tokens, 3);
    CHECK_EQ_INT(o.n_admitted_tokens, 0);
    for (int32_t i = 0; i < 3; i++) {
        CHECK(o.items[i].seq == &q[i].s);
        CHECK_EQ_INT(o.items[i].n_new, 1);
        CHECK(o.items[i].sample);
    }
    apply(&o, 7);
    /* One finishes: the oldest waiting one takes its slot. */
    finish(&r, &q[1].s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 3);
    CHECK(o.items[0].seq == &q[0].s);
    CHECK(o.items[1].seq == &q[2].s);
    CHECK(o.items[2].seq == &q[3].s);
    CHECK_EQ_INT(o.items[2].n_new, 10);
    CHECK_EQ_INT(o.n_tokens, 12);
    CHECK_EQ_INT(sched_n_waiting(r.s), 1);
    for (int32_t i = 0; i < 5; i++)
        if (q[i].s.status != SEQ_FINISHED) finish(&r, &q[i].s);
    CHECK_EQ_INT(bm_n_free(r.m), 64);
    free_rig(&r);

    /* Token budget, chunking off: 10 + 10 fit in 25, the third waits, and so does a small
     * fourth behind it (first come, first served). */
    r = make_rig(64, 4, true, 25, 8, false);
    for (int32_t i = 0; i < 3; i++) tseq_seq(&q[i], (uint64_t)i, 100 * (i + 1), 10, 8, 4);
    tseq_seq(&q[3], 3, 900, 2, 8, 4);
    for (int32_t i = 0; i < 4; i++) sched_add_waiting(r.s, &q[i].s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    CHECK_EQ_INT(o.n_tokens, 20);
    CHECK_EQ_INT(q[2].s.status, SEQ_WAITING);
    CHECK_EQ_INT(q[2].s.n_blocks, 0);
    CHECK_EQ_INT(q[3].s.status, SEQ_WAITING);
    CHECK_EQ_INT(sched_n_waiting(r.s), 2);
    apply(&o, 7);
    /* 2 decodes leave 23: the third (10) and fourth (2) now fit. */
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 4);
    CHECK_EQ_INT(o.n_tokens, 14);
    CHECK(o.items[2].seq == &q[2].s);
    CHECK_EQ_INT(o.items[2].n_new, 10);
    CHECK(o.items[3].seq == &q[3].s);
    CHECK_EQ_INT(o.items[3].n_new, 2);
    for (int32_t i = 0; i < 4; i++) finish(&r, &q[i].s);
    free_rig(&r);

    /* Same with chunking on: the third gets the remaining 5 tokens, without sampling. */
    r = make_rig(64, 4, true, 25, 8, true);
    for (int32_t i = 0; i < 3; i++) {
        tseq_seq(&q[i], (uint64_t)i, 100 * (i + 1), 10, 8, 4);
        sched_add_waiting(r.s, &q[i].s);
    }
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 3);
    CHECK_EQ_INT(o.n_tokens, 25);
    CHECK_EQ_INT(o.items[2].n_new, 5);
    CHECK(!o.items[2].sample);
    CHECK_EQ_INT(q[2].s.n_blocks, 3); /* blocks for the whole prompt at admission */
    CHECK_EQ_INT(o.n_admitted_tokens, 30);
    for (int32_t i = 0; i < 3; i++) finish(&r, &q[i].s);
    CHECK_EQ_INT(bm_n_free(r.m), 64);
    free_rig(&r);

    /* Blocks: a prompt that does not fit in the pool waits, and so does everything behind it. */
    r = make_rig(5, 4, true, 100, 8, true);
    tseq_seq(&q[0], 0, 100, 12, 8, 4); /* 3 blocks */
    tseq_seq(&q[1], 1, 200, 12, 8, 4); /* 3 blocks: only 2 left */
    tseq_seq(&q[2], 2, 300, 4, 8, 4);  /* 1 block: would fit */
    for (int32_t i = 0; i < 3; i++) sched_add_waiting(r.s, &q[i].s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 1);
    CHECK(o.items[0].seq == &q[0].s);
    CHECK_EQ_INT(sched_n_waiting(r.s), 2);
    CHECK_EQ_INT(bm_n_free(r.m), 2);
    apply(&o, 7);
    finish(&r, &q[0].s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    CHECK(o.items[0].seq == &q[1].s);
    CHECK(o.items[1].seq == &q[2].s);
    finish(&r, &q[1].s);
    finish(&r, &q[2].s);
    CHECK_EQ_INT(bm_n_free(r.m), 5);
    CHECK_EQ_INT(bm_check(r.m), 0);
    free_rig(&r);
}

/* ---- chunked prefill ---- */

static void test_chunked_prefill(void)
{
    const int32_t bs = 4;
    rig r = make_rig(32, bs, true, 8, 4, true);
    static tseq a, b;
    sched_out o;
    tseq_seq(&a, 1, 50, 20, 4, bs);
    sched_add_waiting(r.s, &a.s);
    const int32_t want[3] = {8, 8, 4};
    for (int step = 0; step < 3; step++) {
        sched_schedule(r.s, &o);
        CHECK_EQ_INT(o.n_items, 1);
        CHECK(o.items[0].seq == &a.s);
        CHECK_EQ_INT(o.items[0].n_new, want[step]);
        CHECK_EQ_INT(o.n_tokens, want[step]);
        CHECK(o.items[0].sample == (step == 2));
        CHECK_EQ_INT(a.s.n_computed, 8 * step);
        CHECK_EQ_INT(a.s.n_blocks, 5);
        /* Full blocks of the chunk are registered when the step is built. */
        CHECK_EQ_INT(bm_n_cached_blocks(r.m), (8 * step + want[step]) / bs);
        CHECK_EQ_INT(a.s.n_hashed, (8 * step + want[step]) / bs);
        CHECK_EQ_INT(a.s.n_tokens, 20);
        CHECK_EQ_INT(o.n_admitted_tokens, step == 0 ? 20 : 0);
        apply(&o, 1000 + step);
    }
    CHECK_EQ_INT(a.s.n_computed, 20);
    CHECK_EQ_INT(a.s.n_tokens, 21);
    CHECK_EQ_INT(a.tok[20], 1002);
    /* Decoding: one token a step, a new block when the last one is full. */
    for (int step = 0; step < 3; step++) {
        sched_schedule(r.s, &o);
        CHECK_EQ_INT(o.n_items, 1);
        CHECK_EQ_INT(o.items[0].n_new, 1);
        CHECK(o.items[0].sample);
        CHECK_EQ_INT(a.s.n_blocks, (a.s.n_computed + 1 + bs - 1) / bs);
        apply(&o, 2000 + step);
    }
    CHECK_EQ_INT(a.s.n_computed, 23);
    CHECK_EQ_INT(a.s.n_tokens, 24);
    CHECK_EQ_INT(a.s.n_blocks, 6);
    CHECK_EQ_INT(bm_check(r.m), 0);

    /* A long prompt shares steps with decodes: the decode goes first, the chunk fills the
     * rest of the budget. */
    tseq_seq(&b, 2, 500, 30, 4, bs);
    sched_add_waiting(r.s, &b.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    CHECK(o.items[0].seq == &a.s);
    CHECK_EQ_INT(o.items[0].n_new, 1);
    CHECK(o.items[1].seq == &b.s);
    CHECK_EQ_INT(o.items[1].n_new, 7);
    CHECK(!o.items[1].sample);
    CHECK_EQ_INT(o.n_tokens, 8);
    apply(&o, 3000);
    finish(&r, &a.s); /* a reached its cap */
    CHECK_EQ_INT(a.s.n_tokens, 24);
    int32_t done = 7, steps = 0;
    while (b.s.n_computed < 30 && steps++ < 10) {
        sched_schedule(r.s, &o);
        CHECK_EQ_INT(o.n_items, 1);
        int32_t n = 30 - done < 8 ? 30 - done : 8;
        CHECK_EQ_INT(o.items[0].n_new, n);
        CHECK(o.items[0].sample == (done + n == 30));
        done += n;
        apply(&o, 4000);
    }
    CHECK_EQ_INT(b.s.n_computed, 30);
    CHECK_EQ_INT(b.s.n_tokens, 31);
    finish(&r, &b.s);
    CHECK_EQ_INT(bm_n_free(r.m), 32);
    CHECK_EQ_INT(bm_check(r.m), 0);
    free_rig(&r);
}

/* ---- decodes first ---- */

static void test_decodes_first(void)
{
    rig r = make_rig(64, 4, true, 16, 8, true);
    static tseq a, b, c;
    sched_out o;
    tseq_seq(&a, 1, 10, 6, 8, 4);
    tseq_seq(&b, 2, 20, 6, 8, 4);
    sched_add_waiting(r.s, &a.s);
    sched_add_waiting(r.s, &b.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    apply(&o, 5);
    tseq_seq(&c, 3, 30, 40, 8, 4);
    sched_add_waiting(r.s, &c.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 3);
    CHECK(o.items[0].seq == &a.s);
    CHECK(o.items[1].seq == &b.s);
    CHECK(o.items[2].seq == &c.s);
    CHECK_EQ_INT(o.items[0].n_new, 1);
    CHECK_EQ_INT(o.items[1].n_new, 1);
    CHECK_EQ_INT(o.items[2].n_new, 14);
    CHECK(!o.items[2].sample);
    apply(&o, 5);
    /* c is running now, with the oldest still first; its next chunk follows their decodes. */
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 3);
    CHECK(o.items[0].seq == &a.s);
    CHECK(o.items[1].seq == &b.s);
    CHECK(o.items[2].seq == &c.s);
    CHECK_EQ_INT(o.items[2].n_new, 14);
    apply(&o, 5);

    /* The sequence cap counts running sequences first: with a cap of 2 the newest waits. */
    finish(&r, &a.s);
    finish(&r, &b.s);
    finish(&r, &c.s);
    free_rig(&r);
    r = make_rig(64, 4, true, 100, 2, true);
    tseq_seq(&a, 1, 10, 6, 8, 4);
    tseq_seq(&b, 2, 20, 6, 8, 4);
    tseq_seq(&c, 3, 30, 6, 8, 4);
    sched_add_waiting(r.s, &a.s);
    sched_add_waiting(r.s, &b.s);
    sched_schedule(r.s, &o);
    apply(&o, 5);
    sched_add_waiting(r.s, &c.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    CHECK(item_of(&o, &c.s) < 0);
    CHECK_EQ_INT(c.s.status, SEQ_WAITING);
    apply(&o, 5);
    finish(&r, &a.s);
    finish(&r, &b.s);
    sched_remove(r.s, &c.s);
    CHECK_EQ_INT(sched_n_waiting(r.s), 0);
    CHECK_EQ_INT(bm_n_free(r.m), 64);
    free_rig(&r);
}

/* ---- preemption ---- */

static void test_preemption(void)
{
    const int32_t bs = 2;
    static tseq a, b, c;
    sched_out o;

    /* Pool of 4 blocks, two sequences of 3 tokens (2 blocks each). */
    rig r = make_rig(4, bs, true, 64, 8, true);
    tseq_seq(&a, 1, 10, 3, 8, bs);
    tseq_seq(&b, 2, 20, 3, 8, bs);
    sched_add_waiting(r.s, &a.s);
    sched_add_waiting(r.s, &b.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    CHECK_EQ_INT(bm_n_free(r.m), 0);
    apply(&o, 90); /* 4 tokens each, 3 computed */
    sched_schedule(r.s, &o); /* position 3 still fits in block 1 */
    CHECK_EQ_INT(o.n_items, 2);
    CHECK_EQ_INT(o.n_preempted, 0);
    apply(&o, 91); /* 5 tokens each, 4 computed */
    CHECK_EQ_INT(a.s.n_tokens, 5);

    /* a needs a third block: the newest running sequence (b) is preempted for it; c, which
     * would fit afterwards, is not admitted in this step. */
    tseq_seq(&c, 3, 30, 1, 8, bs);
    sched_add_waiting(r.s, &c.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 1);
    CHECK(o.items[0].seq == &a.s);
    CHECK_EQ_INT(o.items[0].n_new, 1);
    CHECK_EQ_INT(o.n_preempted, 1);
    CHECK_EQ_INT(o.n_admitted_tokens, 0);
    CHECK_EQ_INT(sched_n_preemptions(r.s), 1);
    CHECK_EQ_INT(b.s.status, SEQ_WAITING);
    CHECK_EQ_INT(b.s.n_computed, 0);
    CHECK_EQ_INT(b.s.n_blocks, 0);
    CHECK_EQ_INT(b.s.n_preempted, 1);
    CHECK_EQ_INT(b.s.n_tokens, 5); /* its output so far is kept, to be recomputed */
    CHECK_EQ_INT(c.s.status, SEQ_WAITING);
    CHECK_EQ_INT(sched_n_running(r.s), 1);
    CHECK_EQ_INT(sched_n_waiting(r.s), 2);
    CHECK_EQ_INT(a.s.n_blocks, 3);
    CHECK_EQ_INT(bm_n_free(r.m), 1);
    CHECK_EQ_INT(bm_check(r.m), 0);
    apply(&o, 92);

    /* b is at the front of the waiting queue: when a finishes it is admitted before c, with
     * whatever of its blocks is still cached, and recomputes the rest. */
    finish(&r, &a.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_preempted, 0);
    CHECK(o.n_items >= 1);
    CHECK(o.items[0].seq == &b.s);
    CHECK_EQ_INT(b.s.status, SEQ_RUNNING);
    CHECK_EQ_INT(o.items[0].n_new, 5 - b.s.n_computed);
    CHECK_EQ_INT(b.s.n_computed, b.s.n_cached);
    CHECK(b.s.n_computed <= 4);
    CHECK(o.items[0].sample);
    CHECK_EQ_INT(b.s.n_blocks, 3);
    CHECK_EQ_INT(o.n_cached_tokens, b.s.n_cached);
    CHECK_EQ_INT(o.n_items, 2);
    CHECK(o.items[1].seq == &c.s);
    CHECK_EQ_INT(sched_n_waiting(r.s), 0);
    apply(&o, 93);
    CHECK_EQ_INT(b.s.n_computed, 5);
    CHECK_EQ_INT(b.s.n_tokens, 6);
    finish(&r, &b.s);
    finish(&r, &c.s);
    CHECK_EQ_INT(bm_n_free(r.m), 4);
    CHECK_EQ_INT(bm_check(r.m), 0);
    free_rig(&r);

    /* The growing sequence is itself the newest: it preempts itself; the older one's decode,
     * already in the step, stays. */
    r = make_rig(5, bs, true, 64, 8, true);
    tseq_seq(&a, 1, 10, 3, 8, bs); /* 2 blocks */
    tseq_seq(&b, 2, 20, 6, 8, bs); /* 3 blocks */
    sched_add_waiting(r.s, &a.s);
    sched_add_waiting(r.s, &b.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    CHECK_EQ_INT(bm_n_free(r.m), 0);
    apply(&o, 90); /* a: 4 tokens, 3 computed; b: 7 tokens, 6 computed */
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 1);
    CHECK(o.items[0].seq == &a.s);
    CHECK_EQ_INT(o.n_tokens, 1);
    CHECK_EQ_INT(o.n_preempted, 1);
    CHECK_EQ_INT(sched_n_preemptions(r.s), 1);
    CHECK_EQ_INT(b.s.status, SEQ_WAITING);
    CHECK_EQ_INT(b.s.n_blocks, 0);
    CHECK_EQ_INT(b.s.n_computed, 0);
    CHECK_EQ_INT(b.s.n_preempted, 1);
    CHECK_EQ_INT(a.s.status, SEQ_RUNNING);
    CHECK_EQ_INT(bm_n_free(r.m), 3);
    CHECK_EQ_INT(bm_check(r.m), 0);
    apply(&o, 91);
    /* b (7 tokens, 4 blocks) cannot come back while a holds 3 of 5 blocks. */
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 1);
    CHECK_EQ_INT(a.s.n_blocks, 3);
    CHECK_EQ_INT(b.s.status, SEQ_WAITING);
    apply(&o, 92);
    finish(&r, &a.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 1);
    CHECK(o.items[0].seq == &b.s);
    CHECK_EQ_INT(o.items[0].n_new + b.s.n_computed, 7);
    CHECK_EQ_INT(b.s.n_blocks, 4);
    apply(&o, 93);
    finish(&r, &b.s);
    CHECK_EQ_INT(bm_n_free(r.m), 5);
    CHECK_EQ_INT(bm_check(r.m), 0);
    free_rig(&r);

    /* Several victims, newest first; they keep their relative order at the front of the
     * waiting queue, ahead of a sequence that was already waiting. */
    r = make_rig(6, bs, false, 64, 8, true);
    static tseq w;
    tseq_seq(&a, 1, 10, 4, 8, bs); /* 2 blocks, needs a third at its first decode */
    tseq_seq(&b, 2, 20, 3, 8, bs);
    tseq_seq(&c, 3, 30, 3, 8, bs);
    sched_add_waiting(r.s, &a.s);
    sched_add_waiting(r.s, &b.s);
    sched_add_waiting(r.s, &c.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 3);
    CHECK_EQ_INT(bm_n_free(r.m), 0);
    apply(&o, 90);
    a.s.n_tokens = a.s.n_computed + 5; /* a wants 5 more tokens now (3 more blocks) */
    for (int32_t i = 5; i < 9; i++) a.tok[i] = 1;
    tseq_seq(&w, 9, 70, 1, 8, bs);
    sched_add_waiting(r.s, &w.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_preempted, 2);
    CHECK_EQ_INT(o.n_items, 1);
    CHECK(o.items[0].seq == &a.s);
    CHECK_EQ_INT(o.items[0].n_new, 5);
    CHECK_EQ_INT(a.s.n_blocks, 5);
    CHECK_EQ_INT(b.s.status, SEQ_WAITING);
    CHECK_EQ_INT(c.s.status, SEQ_WAITING);
    CHECK_EQ_INT(sched_n_preemptions(r.s), 2);
    CHECK_EQ_INT(sched_n_waiting(r.s), 3);
    apply(&o, 91);
    finish(&r, &a.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 3);
    CHECK(o.items[0].seq == &b.s);
    CHECK(o.items[1].seq == &c.s);
    CHECK(o.items[2].seq == &w.s);
    finish(&r, &b.s);
    finish(&r, &c.s);
    finish(&r, &w.s);
    CHECK_EQ_INT(bm_n_free(r.m), 6);
    free_rig(&r);
}

/* ---- remove ---- */

static void test_remove(void)
{
    rig r = make_rig(64, 4, true, 100, 8, true);
    static tseq q[4];
    sched_out o;
    for (int32_t i = 0; i < 4; i++) {
        tseq_seq(&q[i], (uint64_t)i, 100 * (i + 1), 5, 8, 4);
        sched_add_waiting(r.s, &q[i].s);
    }
    sched_remove(r.s, &q[1].s); /* middle */
    CHECK_EQ_INT(sched_n_waiting(r.s), 3);
    /* Not queued (any more) although its status says WAITING: a no-op, the queue intact. */
    sched_remove(r.s, &q[1].s);
    CHECK_EQ_INT(sched_n_waiting(r.s), 3);
    static tseq lone;
    tseq_seq(&lone, 99, 0, 3, 4, 4);
    sched_remove(r.s, &lone.s);
    CHECK_EQ_INT(sched_n_waiting(r.s), 3);
    sched_remove(r.s, &q[0].s); /* head */
    sched_remove(r.s, &q[3].s); /* tail */
    CHECK_EQ_INT(sched_n_waiting(r.s), 1);
    sched_add_waiting(r.s, &q[3].s);
    sched_add_waiting(r.s, &q[0].s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 3);
    CHECK(o.items[0].seq == &q[2].s);
    CHECK(o.items[1].seq == &q[3].s);
    CHECK(o.items[2].seq == &q[0].s);
    CHECK(q[1].s.status == SEQ_WAITING && q[1].s.n_blocks == 0);
    apply(&o, 1);

    /* From running: the caller frees the blocks; the others keep going. */
    sched_remove(r.s, &q[3].s);
    CHECK_EQ_INT(sched_n_running(r.s), 2);
    CHECK_EQ_INT(q[3].s.n_blocks, 2); /* sched_remove does not free */
    bm_free(r.m, &q[3].s);
    q[3].s.status = SEQ_FINISHED;
    sched_remove(r.s, &q[3].s); /* not queued: no-op */
    CHECK_EQ_INT(sched_n_running(r.s), 2);
    q[3].s.status = SEQ_RUNNING; /* stale status, still not queued: no-op */
    sched_remove(r.s, &q[3].s);
    CHECK_EQ_INT(sched_n_running(r.s), 2);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    CHECK(o.items[0].seq == &q[2].s);
    CHECK(o.items[1].seq == &q[0].s);
    apply(&o, 1);
    sched_remove(r.s, &q[2].s); /* head of running */
    bm_free(r.m, &q[2].s);
    sched_remove(r.s, &q[0].s);
    bm_free(r.m, &q[0].s);
    CHECK_EQ_INT(sched_n_running(r.s), 0);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 0);
    /* A removed sequence can be queued again. */
    sched_add_waiting(r.s, &q[1].s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 1);
    CHECK(o.items[0].seq == &q[1].s);
    finish(&r, &q[1].s);
    CHECK_EQ_INT(bm_n_free(r.m), 64);
    CHECK_EQ_INT(bm_check(r.m), 0);
    free_rig(&r);
}

/* ---- same-step prefix sharing ---- */

/* ---- recompute longer than the step budget, chunking off ---- */

/* A prompt fits the budget (the engine checks that), but after preemption the sequence must
 * recompute prompt + output, which may not: it still has to come back. */
static void test_recompute_over_budget(void)
{
    const int32_t bs = 2;
    rig r = make_rig(10, bs, false, 8, 8, false);
    static tseq a, b, c;
    sched_out o;
    tseq_seq(&a, 1, 10, 4, 16, bs); /* 2 blocks */
    tseq_seq(&b, 2, 20, 4, 16, bs); /* 2 blocks */
    sched_add_waiting(r.s, &a.s);
    sched_add_waiting(r.s, &b.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    apply(&o, 90);
    /* Decode until the pool runs dry and b is preempted with more tokens than the budget. */
    int steps = 0;
    while (b.s.n_preempted == 0 && steps++ < 20) {
        sched_schedule(r.s, &o);
        apply(&o, 91);
    }
    CHECK_EQ_INT(b.s.n_preempted, 1);
    CHECK_EQ_INT(b.s.status, SEQ_WAITING);
    CHECK(b.s.n_tokens > 8);
    int32_t b_tokens = b.s.n_tokens;
    finish(&r, &a.s);
    /* c arrived later and fits; b comes first and must not block the queue for ever. */
    tseq_seq(&c, 3, 30, 2, 4, bs);
    sched_add_waiting(r.s, &c.s);
    int32_t computed = 0;
    steps = 0;
    while (b.s.n_tokens == b_tokens && steps++ < 10) {
        sched_schedule(r.s, &o);
        CHECK(o.n_tokens <= 8);
        int32_t k = item_of(&o, &b.s);
        if (k >= 0) computed += o.items[k].n_new;
        apply(&o, 92);
    }
    CHECK_MSG(b.s.n_tokens == b_tokens + 1, "b (%d tokens) never recomputed", b_tokens);
    CHECK_EQ_INT(computed, b_tokens);
    CHECK_EQ_INT(b.s.n_computed, b_tokens);
    CHECK_EQ_INT(c.s.status, SEQ_RUNNING);
    finish(&r, &b.s);
    finish(&r, &c.s);
    CHECK_EQ_INT(bm_n_free(r.m), 10);
    CHECK_EQ_INT(bm_check(r.m), 0);
    free_rig(&r);
}

static void test_same_step_sharing(void)
{
    const int32_t bs = 4;
    rig r = make_rig(32, bs, true, 64, 8, true);
    static tseq a, b;
    sched_out o;
    int32_t t[14];
    for (int32_t i = 0; i < 14; i++) t[i] = 7 * i;
    tseq_init(&a, 1, t, 12, 4, bs);
    tseq_init(&b, 2, t, 14, 4, bs);
    sched_add_waiting(r.s, &a.s);
    sched_add_waiting(r.s, &b.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.n_items, 2);
    CHECK_EQ_INT(o.items[0].n_new, 12);
    CHECK_EQ_INT(o.items[1].n_new, 2);
    CHECK_EQ_INT(o.n_tokens, 14);
    CHECK_EQ_INT(o.n_admitted_tokens, 26);
    CHECK_EQ_INT(o.n_cached_tokens, 12);
    CHECK_EQ_INT(b.s.n_computed, 12);
    for (int32_t i = 0; i < 3; i++) CHECK_EQ_INT(b.bt[i], a.bt[i]);
    CHECK_EQ_INT(bm_n_used(r.m), 4);
    apply(&o, 3);
    finish(&r, &a.s);
    finish(&r, &b.s);
    free_rig(&r);

    /* With the cache off nothing is shared. */
    r = make_rig(32, bs, false, 64, 8, true);
    tseq_init(&a, 1, t, 12, 4, bs);
    tseq_init(&b, 2, t, 14, 4, bs);
    sched_add_waiting(r.s, &a.s);
    sched_add_waiting(r.s, &b.s);
    sched_schedule(r.s, &o);
    CHECK_EQ_INT(o.items[1].n_new, 14);
    CHECK_EQ_INT(o.n_cached_tokens, 0);
    finish(&r, &a.s);
    finish(&r, &b.s);
    free_rig(&r);
}

/* ---- random run against a shadow KV model ---- */

#define R_SEQS 24
#define R_BLOCKS 40

static uint64_t rng_state = 0x2545f4914f6cdd1dULL;

static uint32_t rnd(uint32_t n)
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 33) % n;
}

static uint64_t fp_step(uint64_t prev, int32_t tok)
{
    uint64_t z = prev ^ ((uint64_t)(uint32_t)tok + 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return (z ^ (z >> 31)) | 1; /* never 0: 0 marks an unwritten slot */
}

typedef struct {
    int32_t n_blocks; /* <= R_BLOCKS */
    int32_t bs;
    int32_t budget;
    int32_t max_seqs;
    bool chunked;
    bool cache;
} run_cfg;

static void random_run(run_cfg cfg, int n_steps)
{
    const int32_t bs = cfg.bs;
    const int32_t nb = cfg.n_blocks;
    rig r = make_rig(nb, bs, cfg.cache, cfg.budget, cfg.max_seqs, cfg.chunked);
    static tseq q[R_SEQS];
    static uint64_t kv[R_BLOCKS][16]; /* prefix fingerprint per block slot; 0 = unwritten */
    bool live[R_SEQS] = {false};
    int32_t old_blocks[R_SEQS];
    seq_status old_status[R_SEQS];
    uint64_t fp[T_CAP];
    int64_t n_sched = 0, n_preempt = 0, n_cached = 0, n_finished = 0, n_chunks = 0;
    uint64_t next_id = 1;
    /* Largest sequence: its blocks fit the pool; without chunking, its prompt fits the budget
     * (the engine checks both), but prompt + output need not. */
    const int32_t max_cap = nb * bs < 40 ? nb * bs : 40;
    int64_t n_long_recompute = 0;
    memset(kv, 0, sizeof kv);

    for (int step = 0; step < n_steps; step++) {
        bool draining = step >= n_steps - 600;
        if (draining) {
            bool any = false;
            for (int32_t i = 0; i < R_SEQS; i++) any = any || live[i];
            if (!any) break;
        }
        /* Arrivals: prompts over a tiny alphabet, mostly a shared pattern. */
        for (int32_t k = 0; !draining && k < 2; k++) {
            int32_t i = (int32_t)rnd(R_SEQS);
            if (live[i] || rnd(3) != 0) continue;
            int32_t max_tokens = 1 + (int32_t)rnd(12);
            int32_t n = 1 + (int32_t)rnd((uint32_t)(max_cap - max_tokens));
            if (!cfg.chunked && n > cfg.budget) n = 1 + (int32_t)rnd((uint32_t)cfg.budget);
            int32_t tok[T_CAP];
            for (int32_t p = 0; p < n; p++) tok[p] = rnd(5) ? p % 3 : (int32_t)rnd(3);
            tseq_init(&q[i], next_id++, tok, n, max_tokens, bs);
            sched_add_waiting(r.s, &q[i].s);
            live[i] = true;
        }
        /* Aborts, from either queue. */
        if (rnd(20) == 0) {
            int32_t i = (int32_t)rnd(R_SEQS);
            if (live[i]) {
                finish(&r, &q[i].s);
                live[i] = false;
            }
        }
        for (int32_t i = 0; i < R_SEQS; i++) {
            old_blocks[i] = q[i].s.n_blocks;
            old_status[i] = q[i].s.status;
        }
        sched_out o;
        CHECK_EQ_INT(sched_schedule(r.s, &o), 0);
        n_sched += o.n_items;
        n_preempt += o.n_preempted;
        n_cached += o.n_cached_tokens;

        /* The step's shape. */
        int32_t sum = 0, n_live = 0, n_wait = 0, n_run = 0;
        int64_t admitted = 0, cached = 0;
        bool seen_new = false;
        CHECK(o.n_items <= cfg.max_seqs);
        for (int32_t k = 0; k < o.n_items; k++) {
            const sched_item *it = &o.items[k];
            pd_seq *s = it->seq;
            int32_t i = (int32_t)((tseq *)s - q);
            CHECK(i >= 0 && i < R_SEQS && live[i]);
            for (int32_t j = 0; j < k; j++) CHECK(o.items[j].seq != s);
            CHECK_EQ_INT(s->status, SEQ_RUNNING);
            CHECK(it->n_new >= 1);
            CHECK(s->n_computed + it->n_new <= s->n_tokens);
            CHECK(it->sample == (s->n_computed + it->n_new == s->n_tokens));
            CHECK(s->n_blocks * bs >= s->n_computed + it->n_new);
            if (!cfg.chunked && s->n_tokens - s->n_computed <= cfg.budget)
                CHECK_EQ_INT(s->n_computed + it->n_new, s->n_tokens);
            if (!cfg.chunked && s->n_tokens - s->n_computed > cfg.budget) n_long_recompute++;
            if (!it->sample) n_chunks++;
            bool is_new = old_status[i] == SEQ_WAITING;
            if (is_new) {
                seen_new = true;
                admitted += s->n_tokens;
                cached += s->n_computed;
                CHECK_EQ_INT(s->n_computed, s->n_cached);
                CHECK_EQ_INT(s->n_computed % bs, 0);
                if (!cfg.cache) CHECK_EQ_INT(s->n_computed, 0);
            } else {
                CHECK_MSG(!seen_new, "step %d: running sequence after an admitted one", step);
            }
            /* Fresh blocks start unwritten in the shadow. */
            int32_t first_fresh = is_new ? s->n_computed / bs : old_blocks[i];
            for (int32_t j = first_fresh; j < s->n_blocks; j++)
                for (int32_t x = 0; x < bs; x++) kv[s->block_table[j]][x] = 0;
            sum += it->n_new;
        }
        CHECK_EQ_INT(sum, o.n_tokens);
        CHECK(o.n_tokens <= cfg.budget);
        CHECK_EQ_INT(admitted, o.n_admitted_tokens);
        CHECK_EQ_INT(cached, o.n_cached_tokens);
        if (o.n_preempted > 0) CHECK_EQ_INT(o.n_admitted_tokens, 0);
        int32_t preempted = 0, used[R_BLOCKS] = {0}, n_used = 0;
        for (int32_t i = 0; i < R_SEQS; i++) {
            if (!live[i]) continue;
            pd_seq *s = &q[i].s;
            n_live++;
            if (s->status == SEQ_WAITING) {
                n_wait++;
                CHECK_EQ_INT(s->n_blocks, 0);
                CHECK_EQ_INT(s->n_computed, 0);
                if (old_status[i] == SEQ_RUNNING) preempted++;
            } else {
                CHECK_EQ_INT(s->status, SEQ_RUNNING);
                n_run++;
            }
            for (int32_t j = 0; j < s->n_blocks; j++) used[s->block_table[j]]++;
        }
        for (int32_t b = 0; b < nb; b++) {
            CHECK_EQ_INT(bm_ref(r.m, b), used[b]);
            n_used += used[b] > 0;
        }
        CHECK_EQ_INT(bm_n_used(r.m), n_used);
        CHECK_EQ_INT(preempted, o.n_preempted);
        CHECK_EQ_INT(sched_n_waiting(r.s), n_wait);
        CHECK_EQ_INT(sched_n_running(r.s), n_run);
        CHECK_EQ_INT(sched_n_preemptions(r.s), n_preempt);
        int rc = bm_check(r.m);
        CHECK_MSG(rc == 0, "step %d", step);
        if (rc) break;

        /* The forward: every scheduled token's KV is stored, then each sequence attends over
         * its whole context, which must hold exactly its own prefix. */
        for (int32_t k = 0; k < o.n_items; k++) {
            pd_seq *s = o.items[k].seq;
            int32_t end = s->n_computed + o.items[k].n_new;
            uint64_t h = 0;
            for (int32_t p = 0; p < end; p++) fp[p] = h = fp_step(h, s->tokens[p]);
            for (int32_t p = s->n_computed; p < end; p++) {
                int32_t b = s->block_table[p / bs];
                CHECK_MSG(bm_ref(r.m, b) == 1 || kv[b][p % bs] == 0,
                          "step %d: overwriting shared block %d", step, b);
                kv[b][p % bs] = fp[p];
            }
        }
        for (int32_t k = 0; k < o.n_items; k++) {
            pd_seq *s = o.items[k].seq;
            int32_t end = s->n_computed + o.items[k].n_new;
            uint64_t h = 0;
            int bad = 0;
            for (int32_t p = 0; p < end; p++) {
                h = fp_step(h, s->tokens[p]);
                if (kv[s->block_table[p / bs]][p % bs] != h) bad++;
            }
            CHECK_MSG(bad == 0, "step %d: seq %llu reads %d wrong KV slots", step,
                      (unsigned long long)s->id, bad);
        }
        /* Postprocess: advance, sample, finish at the cap or by chance (EOS). */
        for (int32_t k = 0; k < o.n_items; k++) {
            pd_seq *s = o.items[k].seq;
            s->n_computed += o.items[k].n_new;
            if (!o.items[k].sample) continue;
            s->tokens[s->n_tokens++] = (int32_t)rnd(3);
            if (s->n_tokens == s->cap || rnd(16) == 0) {
                int32_t i = (int32_t)((tseq *)s - q);
                finish(&r, s);
                live[i] = false;
                n_finished++;
            }
        }
    }
    for (int32_t i = 0; i < R_SEQS; i++) CHECK_MSG(!live[i], "sequence %d never finished", i);
    CHECK_EQ_INT(sched_n_waiting(r.s), 0);
    CHECK_EQ_INT(sched_n_running(r.s), 0);
    CHECK_EQ_INT(bm_n_free(r.m), nb);
    CHECK_EQ_INT(bm_check(r.m), 0);
    fprintf(stderr,
            "random run (blocks %d, bs %d, budget %d, seqs %d, chunked %d, cache %d): %lld "
            "items, %lld finished, %lld preemptions, %lld cached tokens, %lld partial chunks, "
            "%lld long recomputes\n",
            nb, bs, cfg.budget, cfg.max_seqs, cfg.chunked, cfg.cache, (long long)n_sched,
            (long long)n_finished, (long long)n_preempt, (long long)n_cached, (long long)n_chunks,
            (long long)n_long_recompute);
    CHECK(n_finished > 50);
    CHECK(n_preempt > 0);
    if (cfg.cache) CHECK(n_cached > 0);
    if (cfg.chunked || n_long_recompute) CHECK(n_chunks > 0);
    free_rig(&r);
}

int main(void)
{
    test_create();
    test_empty();
    test_fcfs_admission();
    test_chunked_prefill();
    test_decodes_first();
    test_preemption();
    test_remove();
    test_same_step_sharing();
    test_recompute_over_budget();
    const run_cfg cfgs[] = {
        {40, 2, 16, 8, true, true},  {16, 4, 24, 6, true, true},   {20, 3, 7, 16, true, true},
        {40, 2, 40, 8, false, true}, {14, 4, 64, 32, false, true}, {24, 3, 16, 8, true, false},
        {30, 2, 12, 8, false, true}, {20, 3, 10, 4, false, false},
    };
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) random_run(cfgs[i], 3000);
    return pd_test_result("test_scheduler");
}
