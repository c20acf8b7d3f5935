/* engine.c -- The engine loop: request validation and bookkeeping, step = schedule -> build
 * the batch -> run -> sample and stop -> report. All per-step buffers are allocated once. */
#include "engine/engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/env.h"
#include "common/error.h"
#include "common/log.h"
#include "common/random.h"

/* Open-addressing map from request id to sequence, grown by doubling. */
typedef struct {
    uint64_t *keys;
    pd_seq **vals; /* NULL = empty */
    uint32_t mask;
    uint32_t n;
} id_map;

struct eng {
    eng_params p;
    mc_config cfg;
    eng_executor exec;
    bm *blocks;
    sched *sch;
    id_map map;
    smp_scratch *scratch;
    /* per-step buffers */
    int32_t *ids, *pos, *slots, *cu_q, *ctx, *bt, *rows;
    pd_seq **row_seq;
    int32_t *row_choice;    /* a forking sequence's rows: which choice each samples for */
    float *logits;          /* host sampling: [max_num_seqs][vocab] */
    pd_sample_row *srows;   /* sampling where the logits are: each logits row's parameters */
    pd_penalty_tok *pen;    /* their penalty entries, grown on demand */
    int32_t cap_pen;
    int32_t *s_tokens;
    float *s_logprobs;
    pd_top_logprob *top;    /* [max_num_seqs][PD_MAX_TOP_LOGPROBS]: a step's alternatives */
    float *lp_row;          /* host sampling with logprobs: [vocab], a row's raw logits (the
                               sampler changes the row in place) */
    eng_output *outs;
    int32_t max_blocks;     /* blocks of the longest allowed sequence */
    pd_seq **finished;      /* sequences to free at the start of the next step
                             * [max_num_seqs * (ENG_MAX_CHOICES + 1)] */
    int32_t n_finished;
    eng_kv_listener kvl;    /* prefill-only: layer-by-layer KV news */
    bool has_kvl;
    uint64_t *kvl_ids;      /* [max_num_seqs] scratch for on_prompt_step */
    const int32_t **kvl_blocks;
    int32_t *kvl_n;
    pd_seq **pending;       /* sequences that finished between steps, reported at the start
                             * of the next: decode-only admissions that ended on their first
                             * token, choices ended by eng_end_choice */
    int32_t n_pending, cap_pending;
    /* Pipelined decode steps (exec.launch): between eng_step calls at most one launched step
     * is not yet collected; during a call a second may be launched before the first is
     * collected. */
    bool async;
    struct eng_flight {
        int32_t n;          /* rows (every row a decode row with logits) */
        pd_seq **seq;       /* [max_num_seqs] */
        int32_t *tokens;    /* [max_num_seqs]: filled by the collect */
        float *logprobs;
        pd_top_logprob *top; /* [max_num_seqs][PD_MAX_TOP_LOGPROBS] */
        bool want_lp;
        double t_launch;
    } fl[2];
    int32_t n_fl, fl_head;  /* launched, not collected; fl[fl_head] the oldest */
    double t_collected;     /* when the last collect returned */
    pd_seq **limbo;         /* finished or aborted while a launched step holds a row of them:
                             * blocks and memory released once none does */
    int32_t n_limbo;
    eng_stats st;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void note_peak_blocks(eng *e)
{
    const int32_t used = bm_n_used(e->blocks);
    if (used > e->st.peak_blocks_used) e->st.peak_blocks_used = used;
}

/* Row k of the step's block tables (width entries): s's blocks, then zeros. */
static void put_table(eng *e, int32_t k, int32_t width, const pd_seq *s)
{
    int32_t *row = e->bt + (size_t)k * width;
    memcpy(row, s->block_table, (size_t)s->n_blocks * sizeof(int32_t));
    for (int32_t j = s->n_blocks; j < width; j++) row[j] = 0;
}


/* ---- id map ---- */

static uint32_t id_slot(uint64_t id, uint32_t mask)
{
    id ^= id >> 33;
    id *= 0xff51afd7ed558ccdull;
    id ^= id >> 33;
    return (uint32_t)id & mask;
}

static int map_init(id_map *m, uint32_t cap)
{
    m->keys = calloc(cap, sizeof *m->keys);
    m->vals = calloc(cap, sizeof *m->vals);
    m->mask = cap - 1;
    m->n = 0;
    return m->keys && m->vals ? 0 : PD_ENOMEM;
}

static pd_seq *map_get(const id_map *m, uint64_t id)
{
    for (uint32_t i = id_slot(id, m->mask);; i = (i + 1) & m->mask) {
        if (!m->vals[i]) return NULL;
        if (m->keys[i] == id) return m->vals[i];
    }
}

static void map_put_nogrow(id_map *m, uint64_t id, pd_seq *s)
{
    uint32_t i = id_slot(id, m->mask);
    while (m->vals[i]) i = (i + 1) & m->mask;
    m->keys[i] = id;
    m->vals[i] = s;
    m->n++;
}

static int map_put(id_map *m, uint64_t id, pd_seq *s)
{
    if (2 * (m->n + 1) > m->mask + 1) {
        id_map g;
        if (map_init(&g, 2 * (m->mask + 1)) < 0) {
            free(g.keys);
            free(g.vals);
            return PD_ENOMEM;
        }
        for (uint32_t i = 0; i <= m->mask; i++)
            if (m->vals[i]) map_put_nogrow(&g, m->keys[i], m->vals[i]);
        free(m->keys);
        free(m->vals);
        *m = g;
    }
    map_put_nogrow(m, id, s);
    return 0;
}

static void map_del(id_map *m, uint64_t id)
{
    uint32_t i = id_slot(id, m->mask);
    while (m->vals[i] && m->keys[i] != id) i = (i + 1) & m->mask;
    if (!m->vals[i]) return;
    uint32_t hole = i;
    for (uint32_t j = (i + 1) & m->mask; m->vals[j]; j = (j + 1) & m->mask) {
        uint32_t home = id_slot(m->keys[j], m->mask);
        bool between = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!between) {
            m->keys[hole] = m->keys[j];
            m->vals[hole] = m->vals[j];
            hole = j;
        }
    }
    m->vals[hole] = NULL;
    m->n--;
}

static void map_set(id_map *m, uint64_t id, pd_seq *s)
{
    for (uint32_t i = id_slot(id, m->mask); m->vals[i]; i = (i + 1) & m->mask)
        if (m->keys[i] == id) {
            m->vals[i] = s;
            return;
        }
}

/* The map names a request by one of its live choices: s leaves the request's ring of
 * choices, and the map points at another choice or, when s was the last, forgets the id.
 * Harmless on a sequence that already left (or was never mapped). */
static void unmap(eng *e, pd_seq *s)
{
    pd_seq *next = s->sib_next;
    const bool mapped = map_get(&e->map, s->id) == s;
    if (next && next != s) {
        next->sib_prev = s->sib_prev;
        s->sib_prev->sib_next = next;
        if (mapped) map_set(&e->map, s->id, next);
    } else if (mapped) {
        map_del(&e->map, s->id);
    }
    s->sib_next = s->sib_prev = s;
}

/* ---- lifecycle ---- */

static int runner_forward(void *ctx, const mr_batch *b, float *logits, char *err)
{
    return mr_forward(ctx, b, logits, err);
}

static int runner_forward_sample(void *ctx, const mr_batch *b, const mr_sampling *s, char *err)
{
    return mr_forward_sample(ctx, b, s, err);
}

static void runner_set_hook(void *ctx, mr_layer_fn fn, void *arg)
{
    mr_set_layer_hook(ctx, fn, arg);
}

static int runner_launch(void *ctx, const mr_batch *b, const mr_sampling *s, bool ids_from_last,
                         char *err)
{
    return mr_launch(ctx, b, s, ids_from_last, err);
}

static int runner_collect(void *ctx, char *err) { return mr_collect(ctx, err); }

static int runner_clone(void *ctx, const int32_t *src, const int32_t *dst, int32_t n, char *err)
{
    return mr_clone_blocks(ctx, src, dst, n, err);
}

eng_executor eng_executor_runner(mr *r)
{
    const bool smp = mr_samples_on_backend(r), pipe = smp && mr_can_launch(r);
    eng_executor x = {runner_forward, r, runner_set_hook, smp ? runner_forward_sample : NULL,
                      pipe ? runner_launch : NULL, pipe ? runner_collect : NULL, runner_clone};
    return x;
}

bool eng_async_steps_default(void)
{
    return pd_env_bool("PDSERVE_ASYNC_STEPS");
}

eng_params eng_default_params(const mr *r)
{
    const mr_params *mp = mr_params_get(r);
    eng_params p = {
        .mode = ENG_MODE_COLOCATED,
        .n_blocks = mr_n_blocks(r),
        .block_size = mr_block_size(r),
        .max_num_batched_tokens = mp->max_num_batched_tokens,
        .max_num_seqs = mp->max_num_seqs,
        .max_model_len = 0,
        .enable_prefix_cache = true,
        .enable_chunked_prefill = true,
        .async_steps = eng_async_steps_default(),
    };
    return p;
}

int eng_create(const eng_params *p, const mc_config *cfg, eng_executor exec, eng **out, char *err)
{
    *out = NULL;
    if (p->n_blocks <= 0 || p->block_size <= 0 || p->max_num_batched_tokens <= 0 ||
        p->max_num_seqs <= 0 || p->max_model_len < 0)
        return pd_errf(err, PD_EINVAL, "engine: block and batch sizes must be positive");
    eng *e = calloc(1, sizeof *e);
    if (!e) return pd_errf(err, PD_ENOMEM, "out of memory");
    e->p = *p;
    e->cfg = *cfg;
    e->exec = exec;
    if (e->p.max_model_len == 0 || e->p.max_model_len > cfg->max_position)
        e->p.max_model_len = cfg->max_position;
    e->max_blocks = (e->p.max_model_len + p->block_size - 1) / p->block_size;
    bm_params bp = {p->n_blocks, p->block_size, p->enable_prefix_cache};
    sched_params sp = {p->max_num_batched_tokens, p->max_num_seqs, p->enable_chunked_prefill};
    const size_t T = (size_t)p->max_num_batched_tokens, S = (size_t)p->max_num_seqs;
    int rc = PD_ENOMEM;
    if (bm_create(&bp, &e->blocks) < 0 || sched_create(&sp, e->blocks, &e->sch) < 0 ||
        map_init(&e->map, 64) < 0 || smp_scratch_create(cfg->vocab_size, &e->scratch) < 0)
        goto fail;
    e->ids = malloc(T * sizeof(int32_t));
    e->pos = malloc(T * sizeof(int32_t));
    e->slots = malloc(T * sizeof(int32_t));
    e->cu_q = malloc((S + 1) * sizeof(int32_t));
    e->ctx = malloc(S * sizeof(int32_t));
    e->bt = malloc(S * (size_t)e->max_blocks * sizeof(int32_t));
    e->rows = malloc(S * sizeof(int32_t));
    e->row_seq = malloc(S * sizeof(pd_seq *));
    e->row_choice = malloc(S * sizeof(int32_t));
    if (exec.forward_sample) { /* the logits stay with the executor */
        e->srows = malloc(S * sizeof *e->srows);
        e->s_tokens = malloc(S * sizeof *e->s_tokens);
        e->s_logprobs = malloc(S * sizeof *e->s_logprobs);
        if (!e->srows || !e->s_tokens || !e->s_logprobs) goto fail;
    } else if (!(e->logits = malloc(S * (size_t)cfg->vocab_size * sizeof(float))) ||
               !(e->lp_row = malloc((size_t)cfg->vocab_size * sizeof(float)))) {
        goto fail;
    }
    if (!(e->top = malloc(S * PD_MAX_TOP_LOGPROBS * sizeof *e->top))) goto fail;
    e->async = p->async_steps && exec.forward_sample && exec.launch && exec.collect;
    for (int k = 0; k < 2 && e->async; k++) {
        e->fl[k].seq = malloc(S * sizeof(pd_seq *));
        e->fl[k].tokens = malloc(S * sizeof(int32_t));
        e->fl[k].logprobs = malloc(S * sizeof(float));
        e->fl[k].top = malloc(S * PD_MAX_TOP_LOGPROBS * sizeof(pd_top_logprob));
        if (!e->fl[k].seq || !e->fl[k].tokens || !e->fl[k].logprobs || !e->fl[k].top) goto fail;
    }
    /* limbo: sequences held by the (at most two) launched steps */
    if (e->async && !(e->limbo = malloc(S * 2 * sizeof(pd_seq *)))) goto fail;
    /* a step reports decode-only admissions that finished (up to S), then its rows (up to S) */
    e->outs = malloc(2 * S * sizeof(eng_output));
    /* a step retires the pending sequences it reports (up to S), then its rows, or when it
     * fails its requests with every choice of theirs */
    e->finished = malloc(S * (ENG_MAX_CHOICES + 1) * sizeof(pd_seq *));
    e->kvl_ids = malloc(S * sizeof *e->kvl_ids);
    e->kvl_blocks = malloc(S * sizeof *e->kvl_blocks);
    e->kvl_n = malloc(S * sizeof *e->kvl_n);
    if (!e->kvl_ids || !e->kvl_blocks || !e->kvl_n || !e->ids || !e->pos || !e->slots || !e->cu_q || !e->ctx || !e->bt || !e->rows ||
        !e->row_seq || !e->row_choice || !e->outs || !e->finished)
        goto fail;
    *out = e;
    return 0;
fail:
    eng_destroy(e);
    return pd_errf(err, rc, "out of memory creating the engine");
}

static void seq_free(pd_seq *s)
{
    if (!s) return;
    free(s->tokens);
    free(s->block_table);
    free(s->choice_seeds);
    free(s);
}

/* Forgets s entirely: queues, blocks, map, memory. */
static void seq_drop(eng *e, pd_seq *s)
{
    sched_remove(e->sch, s);
    if (s->n_blocks) bm_free(e->blocks, s);
    unmap(e, s);
    seq_free(s);
}

/* The live choices of the request that s belongs to (s first), at most ENG_MAX_CHOICES. */
static int32_t ring_list(pd_seq *s, pd_seq **out)
{
    int32_t n = 0;
    pd_seq *x = s;
    do {
        out[n++] = x;
        x = x->sib_next;
    } while (x != s && n < ENG_MAX_CHOICES);
    return n;
}

void eng_destroy(eng *e)
{
    if (!e) return;
    char err[PD_ERR_LEN];
    for (; e->n_fl > 0; e->n_fl--) /* launched steps may still write their buffers */
        (void)e->exec.collect(e->exec.ctx, err);
    for (int32_t i = 0; i < e->n_limbo; i++) seq_free(e->limbo[i]);
    free(e->limbo);
    for (int k = 0; k < 2; k++) {
        free(e->fl[k].seq);
        free(e->fl[k].tokens);
        free(e->fl[k].logprobs);
        free(e->fl[k].top);
    }
    if (e->map.vals) {
        for (uint32_t i = 0; i <= e->map.mask; i++) {
            if (!e->map.vals[i]) continue;
            pd_seq *ring[ENG_MAX_CHOICES];
            const int32_t n = ring_list(e->map.vals[i], ring);
            for (int32_t j = 0; j < n; j++) seq_free(ring[j]);
        }
    }
    for (int32_t i = 0; i < e->n_finished; i++) seq_free(e->finished[i]);
    free(e->map.keys);
    free(e->map.vals);
    sched_destroy(e->sch);
    bm_destroy(e->blocks);
    smp_scratch_destroy(e->scratch);
    free(e->ids); free(e->pos); free(e->slots); free(e->cu_q); free(e->ctx); free(e->bt);
    free(e->rows); free(e->row_seq); free(e->row_choice); free(e->logits); free(e->outs); free(e->finished);
    free(e->srows); free(e->pen); free(e->s_tokens); free(e->s_logprobs);
    free(e->top); free(e->lp_row);
    free(e->pending);
    free(e->kvl_ids);
    free(e->kvl_blocks);
    free(e->kvl_n);
    free(e);
}

void eng_set_kv_listener(eng *e, const eng_kv_listener *l)
{
    e->has_kvl = l != NULL;
    if (l) e->kvl = *l;
}

/* ---- requests ---- */

/* The resumed choices of r (n_resume > 0): see eng_request. */
static int validate_resume(eng *e, const eng_request *r, char *err)
{
    const int32_t nc = r->n > 1 ? r->n : 1;
    if (r->n_resume == 0) return 0;
    if (r->n_resume < 0 || r->n_resume > nc || !r->resume_choice || !r->resume_len)
        return pd_errf(err, PD_EINVAL, "resume: %d choices of a request of %d", r->n_resume, nc);
    uint32_t seen = 0;
    int64_t off = 0;
    for (int32_t k = 0; k < r->n_resume; k++) {
        const int32_t c = r->resume_choice[k], len = r->resume_len[k];
        if (c < 0 || c >= nc || (seen >> c & 1u))
            return pd_errf(err, PD_EINVAL, "resume: choice %d is out of range [0, %d) or given "
                           "twice", c, nc);
        seen |= 1u << c;
        if (len < 0 || len >= r->stop.max_tokens)
            return pd_errf(err, PD_EINVAL, "resume: choice %d has %d tokens; it may have 0 to "
                           "max_tokens - 1 (%d)", c, len, r->stop.max_tokens - 1);
        for (int32_t i = 0; i < len; i++)
            if (!r->resume_tokens || r->resume_tokens[off + i] < 0 ||
                r->resume_tokens[off + i] >= e->cfg.vocab_size)
                return pd_errf(err, PD_EINVAL, "resume: choice %d's token %d is out of range "
                               "[0, %d)", c, i, e->cfg.vocab_size);
        off += len;
    }
    if (e->p.mode == ENG_MODE_PREFILL)
        return pd_errf(err, PD_ESTATE, "a prefill-only engine does not resume requests");
    return 0;
}

static int validate(eng *e, const eng_request *r, char *err)
{
    const int32_t V = e->cfg.vocab_size, L = e->p.max_model_len;
    if (map_get(&e->map, r->id))
        return pd_errf(err, PD_EINVAL, "request id %llu is already in use", (unsigned long long)r->id);
    if (r->n_prompt <= 0 || !r->prompt) return pd_errf(err, PD_EINVAL, "the prompt is empty");
    if (r->n_prompt >= L)
        return pd_errf(err, PD_ERANGE, "the prompt has %d tokens; the maximum length of %d "
                       "leaves no room for output", r->n_prompt, L);
    for (int32_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= V)
            return pd_errf(err, PD_EINVAL, "token id %d at position %d is out of range [0, %d)",
                           r->prompt[i], i, V);
    const seq_stopping *st = &r->stop;
    if (st->max_tokens <= 0)
        return pd_errf(err, PD_EINVAL, "max_tokens must be >= 1 (got %d)", st->max_tokens);
    if (st->min_tokens < 0 || st->min_tokens > st->max_tokens)
        return pd_errf(err, PD_EINVAL, "min_tokens (%d) must be in [0, max_tokens]", st->min_tokens);
    if ((int64_t)r->n_prompt + st->max_tokens > L)
        return pd_errf(err, PD_ERANGE, "prompt (%d tokens) + max_tokens (%d) exceeds the maximum "
                       "length of %d", r->n_prompt, st->max_tokens, L);
    if (st->n_stop_ids < 0 || st->n_stop_ids > (int32_t)(sizeof st->stop_ids / sizeof st->stop_ids[0]))
        return pd_errf(err, PD_EINVAL, "too many stop token ids (%d, at most 16)", st->n_stop_ids);
    int64_t need = ((int64_t)r->n_prompt + st->max_tokens + e->p.block_size - 1) / e->p.block_size;
    if (need > e->p.n_blocks)
        return pd_errf(err, PD_ERANGE, "prompt + max_tokens need %lld KV blocks but the cache "
                       "holds %d", (long long)need, e->p.n_blocks);
    if (!e->p.enable_chunked_prefill && r->n_prompt > e->p.max_num_batched_tokens)
        return pd_errf(err, PD_ERANGE, "the prompt (%d tokens) exceeds max_num_batched_tokens "
                       "(%d) and chunked prefill is off", r->n_prompt, e->p.max_num_batched_tokens);
    if (r->logprobs && (r->top_logprobs < 0 || r->top_logprobs > PD_MAX_TOP_LOGPROBS))
        return pd_errf(err, PD_EINVAL, "top logprobs must be in [0, %d] (got %d)",
                       PD_MAX_TOP_LOGPROBS, r->top_logprobs);
    if (r->n < 0 || r->n > ENG_MAX_CHOICES)
        return pd_errf(err, PD_EINVAL, "n (choices) must be in [1, %d] (got %d)", ENG_MAX_CHOICES,
                       r->n);
    if (r->n > e->p.max_num_seqs)
        return pd_errf(err, PD_ERANGE, "n (%d choices) exceeds max_num_seqs (%d)", r->n,
                       e->p.max_num_seqs);
    char e2[PD_ERR_LEN];
    if (smp_validate(&r->sampling, e2) < 0) return pd_errf(err, PD_EINVAL, "%s", e2);
    return validate_resume(e, r, err);
}

static int seq_new_mapped(eng *e, const eng_request *r, bool map, pd_seq **out, char *err);

static int seq_new(eng *e, const eng_request *r, pd_seq **out, char *err)
{
    return seq_new_mapped(e, r, true, out, err);
}

/* A new sequence for r; map: the id map names the request by it (else it joins a ring). */
static int seq_new_mapped(eng *e, const eng_request *r, bool map, pd_seq **out, char *err)
{
    pd_seq *s = calloc(1, sizeof *s);
    if (!s) return pd_errf(err, PD_ENOMEM, "out of memory");
    s->id = r->id;
    s->n_prompt = s->n_tokens = r->n_prompt;
    s->cap = r->n_prompt + r->stop.max_tokens;
    s->max_blocks = (s->cap + e->p.block_size - 1) / e->p.block_size;
    s->n_choices = r->n > 1 ? r->n : 1;
    s->n_fork = s->n_choices - 1;
    s->sib_next = s->sib_prev = s;
    s->tokens = malloc((size_t)s->cap * sizeof(int32_t));
    s->block_table = malloc((size_t)s->max_blocks * sizeof(int32_t));
    if (s->n_fork > 0) { /* seeds, then the prefill side's first tokens and logprobs */
        const size_t n = (size_t)s->n_choices;
        /* a prefill-only engine keeps each choice's alternatives until eng_release */
        const size_t n_alt = e->p.mode == ENG_MODE_PREFILL && r->logprobs && r->top_logprobs > 0
                                 ? n * PD_MAX_TOP_LOGPROBS : 0;
        s->choice_seeds = malloc(n * (sizeof(uint64_t) + 2 * sizeof(int32_t) + sizeof(float)) +
                                 n_alt * sizeof(pd_top_logprob));
        if (s->choice_seeds) {
            s->first_tokens = (int32_t *)(s->choice_seeds + n);
            s->first_logprobs = (float *)(s->first_tokens + n);
            s->first_n_top = (int32_t *)(s->first_logprobs + n);
            s->first_top = n_alt ? (pd_top_logprob *)(s->first_n_top + n) : NULL;
        }
    }
    if (!s->tokens || !s->block_table || (s->n_fork > 0 && !s->choice_seeds) ||
        (map && map_put(&e->map, s->id, s) < 0)) {
        seq_free(s);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    memcpy(s->tokens, r->prompt, (size_t)r->n_prompt * sizeof(int32_t));
    s->sampling = r->sampling;
    if (!s->sampling.has_seed) {
        /* Unseeded requests still draw from a per-request stream, so that batch company and
         * preemption never change their tokens; its seed comes from the OS-seeded process
         * stream, so that runs and processes differ (the clock's second did not). */
        s->sampling.seed = pd_random_u64();
        s->sampling.has_seed = true;
    }
    /* Choice i draws from seed + i (a request's own seed: choice i equals the same request
     * with seed + i and one choice), or from a seed of its own when the caller gave none. */
    for (int32_t i = 0; i < s->n_choices && s->choice_seeds; i++)
        s->choice_seeds[i] = r->sampling.has_seed || i == 0 ? s->sampling.seed + (uint64_t)i
                                                            : pd_random_u64();
    s->stop = r->stop;
    s->want_logprob = r->logprobs;
    s->n_top = r->logprobs ? r->top_logprobs : 0;
    s->t_arrival = now_s();
    *out = s;
    return 0;
}

/* A validated resumed request (n_resume > 0): a sequence per choice, the first mapped, the
 * others in its ring, each waiting to compute its context like a preempted sequence. */
static int add_resumed(eng *e, const eng_request *r, char *err)
{
    const int32_t nc = r->n > 1 ? r->n : 1;
    pd_seq *seqs[ENG_MAX_CHOICES];
    int64_t off = 0;
    int rc = 0;
    int32_t k = 0;
    for (; k < r->n_resume; k++) {
        const int32_t c = r->resume_choice[k], len = r->resume_len[k];
        eng_request one = *r;
        one.n = 1;
        /* choice c's stream, as seq_new gives a new request's choices */
        if (c > 0 && r->sampling.has_seed) one.sampling.seed += (uint64_t)c;
        else if (c > 0) one.sampling.has_seed = false;
        pd_seq *s;
        if ((rc = seq_new_mapped(e, &one, k == 0, &s, err)) < 0) break;
        memcpy(s->tokens + s->n_prompt, r->resume_tokens + off, (size_t)len * sizeof(int32_t));
        s->n_tokens += len;
        off += len;
        s->choice = c;
        s->n_choices = nc;
        if (k > 0) { /* into the ring, after the choices before it */
            pd_seq *h = seqs[0];
            s->sib_prev = h->sib_prev;
            s->sib_next = h;
            h->sib_prev->sib_next = s;
            h->sib_prev = s;
        }
        seqs[k] = s;
    }
    if (rc < 0) {
        while (k-- > 0) {
            unmap(e, seqs[k]);
            seq_free(seqs[k]);
        }
        return rc;
    }
    for (k = 0; k < r->n_resume; k++) sched_add_waiting(e->sch, seqs[k]);
    return 0;
}

int eng_add_request(eng *e, const eng_request *r, char *err)
{
    int rc = validate(e, r, err);
    if (rc < 0) return rc;
    if (r->n_resume > 0) return add_resumed(e, r, err);
    pd_seq *s;
    if ((rc = seq_new(e, r, &s, err)) < 0) return rc;
    sched_add_waiting(e->sch, s);
    return 0;
}

static void retire(eng *e, pd_seq *s);

int eng_abort(eng *e, uint64_t id)
{
    pd_seq *head = map_get(&e->map, id);
    if (!head) return PD_ENOTFOUND;
    pd_seq *ring[ENG_MAX_CHOICES];
    const int32_t n = ring_list(head, ring); /* every choice: running, waiting or finished */
    for (int32_t k = 0; k < n; k++) {
        pd_seq *s = ring[k];
        for (int32_t i = 0; i < e->n_pending; i++)
            if (e->pending[i] == s) e->pending[i--] = e->pending[--e->n_pending];
        if (s->n_launched > 0) { /* a launched step still writes its KV: released after it */
            s->finish = SEQ_FINISH_ABORTED;
            retire(e, s);
            continue;
        }
        seq_drop(e, s);
    }
    return 0;
}

int eng_release(eng *e, uint64_t id)
{
    pd_seq *s = map_get(&e->map, id);
    if (!s || s->status != SEQ_PREFILLED) return PD_ENOTFOUND;
    seq_drop(e, s);
    return 0;
}

int eng_reserve(eng *e, const eng_request *r, const int32_t **block_ids, int32_t *n_blocks,
                int32_t *n_cached_blocks, char *err)
{
    if (e->p.mode == ENG_MODE_PREFILL)
        return pd_errf(err, PD_ESTATE, "a prefill-only engine does not take reservations");
    int rc = validate(e, r, err);
    if (rc < 0) return rc;
    pd_seq *s;
    if ((rc = seq_new(e, r, &s, err)) < 0) return rc;
    /* The cached full blocks of the prompt's prefix are shared (bm_allocate matches at most
     * (n_prompt - 1) / block_size of them, so the last block always comes from outside); the
     * others will be overwritten from outside. */
    int cached = bm_allocate(e->blocks, s, r->n_prompt + 1);
    if (cached < 0) {
        unmap(e, s);
        seq_free(s);
        return pd_errf(err, PD_ENOSPC, "no free KV blocks for %d tokens now", r->n_prompt + 1);
    }
    s->status = SEQ_RESERVED;
    note_peak_blocks(e);
    *block_ids = s->block_table;
    *n_blocks = (r->n_prompt + e->p.block_size - 1) / e->p.block_size;
    *n_cached_blocks = cached / e->p.block_size;
    e->st.reserved_prompt_tokens += r->n_prompt;
    e->st.reserved_cached_tokens += cached;
    return 0;
}

/* Appends tok to s and decides whether s is done. */
static seq_finish append_token(eng *e, pd_seq *s, int32_t tok)
{
    s->tokens[s->n_tokens++] = tok;
    const int32_t n_out = seq_n_output(s);
    const seq_stopping *st = &s->stop;
    if (n_out >= st->min_tokens) {
        if (!st->ignore_eos && mc_is_eos(&e->cfg, tok)) return SEQ_FINISH_EOS;
        for (int32_t i = 0; i < st->n_stop_ids; i++)
            if (st->stop_ids[i] == tok) return SEQ_FINISH_STOP;
    }
    if (n_out >= st->max_tokens || s->n_tokens >= e->p.max_model_len) return SEQ_FINISH_LENGTH;
    return SEQ_FINISH_NONE;
}

/* ---- choices (n > 1): the fork after the prompt ---- */

/* x (choice x->choice of its request) has its first token: a choice that the caller ended
 * before it was a sequence of its own (bit x->choice of mask, the request's end_mask) ends
 * now, unless that token ended it anyway. */
static void end_if_marked(eng *e, pd_seq *x, uint32_t mask)
{
    if (x->finish == SEQ_FINISH_NONE && (mask >> x->choice & 1u)) {
        x->finish = SEQ_FINISH_CANCELLED;
        e->st.choices_ended++;
    }
}

/* A new sequence for choice c of parent s, whose prompt is computed: the prompt's tokens,
 * choice c's seed, no blocks yet; it joins the request's ring. NULL when out of memory. */
static pd_seq *seq_fork_new(pd_seq *s, int32_t c)
{
    pd_seq *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    x->tokens = malloc((size_t)s->cap * sizeof(int32_t));
    x->block_table = malloc((size_t)s->max_blocks * sizeof(int32_t));
    if (!x->tokens || !x->block_table) {
        seq_free(x);
        return NULL;
    }
    x->id = s->id;
    x->n_prompt = x->n_tokens = s->n_prompt;
    x->cap = s->cap;
    x->max_blocks = s->max_blocks;
    memcpy(x->tokens, s->tokens, (size_t)s->n_prompt * sizeof(int32_t));
    x->n_cached = s->n_cached;
    x->sampling = s->sampling;
    x->sampling.seed = s->choice_seeds[c];
    x->stop = s->stop;
    x->t_arrival = s->t_arrival;
    x->t_scheduled = s->t_scheduled;
    x->want_logprob = s->want_logprob;
    x->n_top = s->n_top;
    x->choice = c;
    x->n_choices = s->n_choices;
    x->sib_prev = s->sib_prev; /* into the ring, after the choices before it */
    x->sib_next = s;
    s->sib_prev->sib_next = x;
    s->sib_prev = x;
    return x;
}

/* Forks s (its prompt computed, n_fork > 0) into its choices: kids[0] = s and kids[c] a new
 * sequence per choice c, each given its first token toks[c]. Every choice that goes on shares
 * the prompt's full blocks (reference counts) and gets a copy of its last partial block (the
 * executor's clone_blocks); one that cannot (no free block, no clone op, a failed copy, out of
 * memory) holds nothing and recomputes its context later, as after a preemption. Nothing is
 * reported or queued here: kids[c]->finish says which choices already ended. Returns the
 * number of choices (n_fork + 1; fewer only when out of memory: the others never start, so
 * the request ends without their last outputs, which its caller reports as an error). */
static int32_t fork_choices(eng *e, pd_seq *s, const int32_t *toks, pd_seq **kids)
{
    const int32_t nc = s->n_fork + 1, bs = e->p.block_size;
    int32_t n = 1;
    kids[0] = s;
    for (int32_t c = 1; c < nc; c++) {
        pd_seq *x = seq_fork_new(s, c);
        if (!x) break; /* out of memory: these choices are lost */
        kids[n++] = x;
    }
    s->n_fork = 0;
    e->st.forks++;
    const int32_t full = s->n_prompt / bs, partial = s->n_prompt % bs ? 1 : 0;
    int32_t src[ENG_MAX_CHOICES], dst[ENG_MAX_CHOICES], n_clone = 0;
    for (int32_t c = 0; c < n; c++) {
        pd_seq *x = kids[c];
        x->finish = append_token(e, x, toks[c]);
        end_if_marked(e, x, s->end_mask);
        if (c == 0 || x->finish != SEQ_FINISH_NONE) continue; /* an ended choice needs no KV */
        if (bm_fork(e->blocks, s, x, full, partial) == 0) {
            x->n_computed = s->n_prompt;
            if (partial) {
                src[n_clone] = s->block_table[full];
                dst[n_clone++] = x->block_table[full];
            }
        }
    }
    char err[PD_ERR_LEN];
    bool cloned = n_clone == 0 ||
                  (e->exec.clone_blocks && e->exec.clone_blocks(e->exec.ctx, src, dst, n_clone, err) == 0);
    if (n_clone > 0 && e->exec.clone_blocks && !cloned)
        PD_LOGW("engine: copying %d forked KV blocks failed (%s); those choices recompute",
                n_clone, err);
    if (cloned) e->st.fork_cloned_blocks += n_clone;
    for (int32_t c = 1; c < n; c++) {
        pd_seq *x = kids[c];
        if (x->finish != SEQ_FINISH_NONE || (x->n_blocks > 0 && cloned)) continue;
        if (x->n_blocks) bm_free(e->blocks, x); /* its copy was never made */
        x->n_computed = 0;
        e->st.fork_recomputed++;
    }
    s->end_mask = 0;
    free(s->choice_seeds); /* (also the first-token arrays: prefill-only engines keep theirs) */
    s->choice_seeds = NULL;
    s->first_tokens = NULL;
    s->first_logprobs = NULL;
    s->first_n_top = NULL;
    s->first_top = NULL;
    note_peak_blocks(e);
    return n;
}

/* Queues a forked choice that goes on: running when it holds its KV, else waiting to
 * recompute it. */
static void queue_choice(eng *e, pd_seq *x)
{
    if (x->n_blocks > 0) sched_add_running(e->sch, x);
    else sched_add_waiting(e->sch, x);
}

/* Makes room for n more pending sequences. Returns 0 or PD_ENOMEM. */
static int pending_room(eng *e, int32_t n)
{
    if (e->cap_pending - e->n_pending >= n) return 0;
    int32_t cap = e->n_pending + n + 16;
    pd_seq **np = realloc(e->pending, (size_t)cap * sizeof *np);
    if (!np) return PD_ENOMEM;
    e->pending = np;
    e->cap_pending = cap;
    return 0;
}

/* Parks s, finished between steps (out of the scheduler's queues, its finish set), until the
 * next step reports it (pending_room made room). */
static void pending_add(eng *e, pd_seq *s)
{
    s->status = SEQ_FINISHED;
    e->pending[e->n_pending++] = s;
}

int eng_admit_n(eng *e, uint64_t id, const int32_t *first_tokens, int32_t n, char *err)
{
    pd_seq *s = map_get(&e->map, id);
    if (!s || s->status != SEQ_RESERVED)
        return pd_errf(err, PD_ENOTFOUND, "no reserved request %llu", (unsigned long long)id);
    if (n != s->n_choices)
        return pd_errf(err, PD_EINVAL, "request %llu has %d choices; got %d first tokens",
                       (unsigned long long)id, s->n_choices, n);
    for (int32_t c = 0; c < n; c++)
        if (first_tokens[c] < 0 || first_tokens[c] >= e->cfg.vocab_size)
            return pd_errf(err, PD_EINVAL, "first token %d is out of range [0, %d)",
                           first_tokens[c], e->cfg.vocab_size);
    if (pending_room(e, n) < 0) /* room to park every choice that ends at once */
        return pd_errf(err, PD_ENOMEM, "out of memory");
    s->n_computed = s->n_prompt;
    s->skip_prefix_cache = false;
    s->t_arrival = now_s(); /* decode-only queue time counts from the KV's arrival */
    bm_commit(e->blocks, s, s->n_prompt); /* the prompt's full blocks become reusable */
    pd_seq *kids[ENG_MAX_CHOICES];
    int32_t nk = 1;
    kids[0] = s;
    if (s->n_fork > 0) {
        nk = fork_choices(e, s, first_tokens, kids);
    } else {
        s->finish = append_token(e, s, first_tokens[0]);
        end_if_marked(e, s, s->end_mask);
        s->end_mask = 0;
    }
    for (int32_t c = 0; c < nk; c++) {
        pd_seq *x = kids[c];
        if (x->finish != SEQ_FINISH_NONE) pending_add(e, x); /* room was made */
        else queue_choice(e, x);
    }
    return 0;
}

int eng_end_choice(eng *e, uint64_t id, int32_t choice)
{
    if (e->p.mode == ENG_MODE_PREFILL) return PD_ESTATE;
    pd_seq *s = map_get(&e->map, id);
    if (!s) return PD_ENOTFOUND;
    if (choice < 0 || choice >= s->n_choices) return PD_EINVAL;
    const uint32_t bit = 1u << choice;
    if (s->n_fork > 0 || s->status == SEQ_RESERVED) {
        /* Not a sequence of its own yet (the prompt's one, or a reservation whose blocks
         * kvtransfer may be writing): it ends when it gets its first token. */
        if (s->end_mask & bit) return PD_ENOTFOUND;
        s->end_mask |= bit;
        return 0;
    }
    pd_seq *ring[ENG_MAX_CHOICES];
    const int32_t n = ring_list(s, ring);
    for (int32_t k = 0; k < n; k++) {
        pd_seq *x = ring[k];
        if (x->choice != choice) continue;
        /* finished (pending: its last output not reported yet) or ended already */
        if (x->status != SEQ_WAITING && x->status != SEQ_RUNNING) return PD_ENOTFOUND;
        if (pending_room(e, 1) < 0) return PD_ENOMEM;
        sched_remove(e->sch, x); /* (by its status: before pending_add changes it) */
        x->finish = SEQ_FINISH_CANCELLED;
        pending_add(e, x);
        e->st.choices_ended++;
        return 0;
    }
    return PD_ENOTFOUND; /* that choice finished and was reported */
}

int eng_admit(eng *e, uint64_t id, int32_t first_token, char *err)
{
    return eng_admit_n(e, id, &first_token, 1, err);
}

/* ---- step ---- */

/* The entries of a row's top list that name a token (the backend ends a short one with -1). */
static int32_t top_count(const pd_top_logprob *top, int32_t n)
{
    int32_t k = 0;
    while (k < n && top[k].token >= 0) k++;
    return k;
}

/* Logits row k's alternatives in a step (e->top, [max_num_seqs][PD_MAX_TOP_LOGPROBS]). */
static pd_top_logprob *row_top(eng *e, int32_t k)
{
    return e->top + (size_t)k * PD_MAX_TOP_LOGPROBS;
}

/* lp and top[0..n_top) (top may be NULL when n_top is 0) are the token's raw logprobs when s
 * asked for them. */
static void report(eng *e, int32_t *n_out, const pd_seq *s, int32_t tok, float lp,
                   const pd_top_logprob *top, int32_t n_top)
{
    eng_output *o = &e->outs[(*n_out)++];
    o->id = s->id;
    o->choice = s->choice;
    o->n_choices = s->n_choices;
    /* the last live choice of its request ends: the request is done */
    o->done = s->finish != SEQ_FINISH_NONE && s->sib_next == s;
    const bool firsts = s->finish == SEQ_FINISH_PREFILLED && s->n_choices > 1 && s->first_tokens;
    o->choice_tokens = firsts ? s->first_tokens : NULL;
    o->choice_logprobs = firsts ? s->first_logprobs : NULL;
    const bool ftops = firsts && s->want_logprob && s->n_top > 0;
    o->choice_top = ftops ? s->first_top : NULL;
    o->choice_n_top = ftops ? s->first_n_top : NULL;
    o->token = tok;
    o->logprob = lp;
    o->top = n_top > 0 ? top : NULL;
    o->n_top = n_top > 0 ? n_top : 0;
    o->finish = s->finish;
    o->n_prompt = s->n_prompt;
    o->n_cached = s->n_cached;
    o->n_output = seq_n_output(s);
    o->queue_s = s->t_scheduled > 0 ? s->t_scheduled - s->t_arrival : 0.0;
    o->block_ids = s->finish == SEQ_FINISH_PREFILLED ? s->block_table : NULL;
    o->n_blocks = s->finish == SEQ_FINISH_PREFILLED ? (s->n_prompt + e->p.block_size - 1) / e->p.block_size : 0;
}

/* Moves s out of the running set after it finished; memory is freed next step. */
static void retire(eng *e, pd_seq *s)
{
    sched_remove(e->sch, s);
    if (s->finish == SEQ_FINISH_PREFILLED) {
        s->status = SEQ_PREFILLED; /* keeps its blocks until eng_release */
        return;
    }
    if (s->n_launched > 0) { /* a launched step holds a row of it: see release_limbo */
        unmap(e, s);
        s->status = SEQ_FINISHED;
        e->limbo[e->n_limbo++] = s;
        return;
    }
    if (s->n_blocks) bm_free(e->blocks, s);
    unmap(e, s);
    s->status = SEQ_FINISHED;
    e->finished[e->n_finished++] = s;
}

/* Each logits row's sampling parameters and penalty entries for a forward that samples where
 * the logits are. The penalty list grows (rarely) to hold every penalized row's distinct
 * tokens. Returns 0 or PD_ENOMEM. */
static int sampling_rows(eng *e, int32_t nl, mr_sampling *smp)
{
    int32_t n_pen = 0;
    bool logprobs = false;
    for (int32_t k = 0; k < nl; k++) {
        const pd_seq *s = e->row_seq[k];
        logprobs |= s->want_logprob;
        const int32_t n_output = seq_n_output(s);
        pd_sample_row *row = &e->srows[k];
        smp_params sc = s->sampling;
        if (s->n_fork > 0) sc.seed = s->choice_seeds[e->row_choice[k]]; /* a choice's stream */
        *row = smp_sample_row(&sc, n_output, 0, 0);
        if (s->want_logprob) row->n_top = s->n_top;
        const smp_params *sp = &s->sampling;
        if (!smp_penalized(sp)) continue;
        const int32_t need = n_pen + s->n_tokens;
        if (need > e->cap_pen) {
            int32_t cap = e->cap_pen ? e->cap_pen : 1024;
            while (cap < need) cap = cap > INT32_MAX / 2 ? INT32_MAX : cap * 2;
            pd_penalty_tok *p = realloc(e->pen, (size_t)cap * sizeof *p);
            if (!p) return PD_ENOMEM;
            e->pen = p;
            e->cap_pen = cap;
        }
        row->pen_off = n_pen;
        row->pen_n = smp_penalty_list(sp, s->tokens, s->n_prompt, s->tokens + s->n_prompt,
                                      n_output, e->cfg.vocab_size, e->scratch, e->pen + n_pen);
        n_pen += row->pen_n;
    }
    smp->rows = e->srows;
    smp->pen = e->pen;
    smp->n_pen = n_pen;
    smp->tokens = e->s_tokens;
    smp->logprobs = logprobs ? e->s_logprobs : NULL; /* computed only when wanted */
    smp->top = logprobs ? e->top : NULL;
    return 0;
}

/* A failed step lost s: s is reported aborted, and the request's other choices (in the step
 * or not) end with it, unreported (the request's first aborted output ends it for the
 * caller). A choice already retired is left alone. */
static void fail_request(eng *e, int32_t *n_out, pd_seq *s)
{
    if (s->status == SEQ_FINISHED) return; /* retired with an earlier choice of its request */
    pd_seq *ring[ENG_MAX_CHOICES];
    const int32_t n = ring_list(s, ring);
    s->finish = SEQ_FINISH_ABORTED;
    report(e, n_out, s, -1, 0.0f, NULL, 0);
    for (int32_t k = 0; k < n; k++) {
        ring[k]->finish = SEQ_FINISH_ABORTED;
        for (int32_t i = 0; i < e->n_pending; i++)
            if (e->pending[i] == ring[k]) e->pending[i--] = e->pending[--e->n_pending];
        retire(e, ring[k]);
        ring[k]->status = SEQ_FINISHED;
    }
}

/* ---- pipelined decode steps ---- */

/* Frees the finished sequences that no launched step holds any more. */
static void release_limbo(eng *e)
{
    for (int32_t i = 0; i < e->n_limbo;) {
        pd_seq *s = e->limbo[i];
        if (s->n_launched > 0) {
            i++;
            continue;
        }
        if (s->n_blocks) bm_free(e->blocks, s);
        seq_free(s);
        e->limbo[i] = e->limbo[--e->n_limbo];
    }
}

/* Flight f launched: rows[0, n) are seqs, counted as held. */
static void flight_set(eng *e, struct eng_flight *f, pd_seq *const *seqs, int32_t n, bool want_lp)
{
    f->n = n;
    memcpy(f->seq, seqs, (size_t)n * sizeof *seqs);
    for (int32_t k = 0; k < n; k++) seqs[k]->n_launched++;
    f->want_lp = want_lp;
    f->t_launch = now_s();
    e->n_fl++;
    e->st.steps++;
    e->st.batch_seqs_sum += n;
}

/* Launches the step after F while F runs: the same sequences one token on, each row's input
 * the token F samples for it (taken where it is sampled). Only when nothing else wants the
 * step: no waiting or pending request, every running sequence in F, none with penalties (its
 * penalty list would lack F's token). A sequence that F finishes computes a wasted row; its
 * blocks stay until this step is collected (release_limbo). Returns whether it launched. */
static bool launch_next(eng *e, const struct eng_flight *F, struct eng_flight *N)
{
    if (sched_n_waiting(e->sch) > 0 || e->n_pending > 0 || F->n != sched_n_running(e->sch))
        return false;
    const int32_t bs = e->p.block_size, n = F->n;
    int32_t width = 1;
    bool want_lp = false;
    for (int32_t k = 0; k < n; k++) {
        pd_seq *s = F->seq[k];
        if (s->status != SEQ_RUNNING || smp_penalized(&s->sampling)) return false;
        /* F computes position n_computed; this step the one after it */
        if (bm_append(e->blocks, s, s->n_computed + 2) < 0) return false; /* kept: needed next */
        if (s->n_blocks > width) width = s->n_blocks;
    }
    e->cu_q[0] = 0;
    for (int32_t k = 0; k < n; k++) {
        pd_seq *s = F->seq[k];
        const int32_t p = s->n_computed + 1;
        e->ids[k] = 0; /* not read: F's pick */
        e->pos[k] = p;
        e->slots[k] = s->block_table[p / bs] * bs + p % bs;
        e->cu_q[k + 1] = k + 1;
        e->ctx[k] = p + 1;
        put_table(e, k, width, s);
        e->rows[k] = k;
        e->srows[k] = smp_sample_row(&s->sampling, seq_n_output(s) + 1, 0, 0);
        if (s->want_logprob) e->srows[k].n_top = s->n_top;
        want_lp |= s->want_logprob;
    }
    mr_batch b = {n, e->ids, e->pos, e->slots, n, e->cu_q, e->ctx, e->bt, width, n, e->rows};
    mr_sampling smp = {e->srows, NULL, 0, N->tokens, want_lp ? N->logprobs : NULL,
                       want_lp ? N->top : NULL};
    char err[PD_ERR_LEN];
    if (e->exec.launch(e->exec.ctx, &b, &smp, true, err) != 0) return false; /* run normally */
    flight_set(e, N, F->seq, n, want_lp);
    e->st.decode_tokens += n;
    note_peak_blocks(e);
    return true;
}

/* The step of a call that found a launched step F: launches the next one if it can, then
 * collects F and reports its tokens. */
static int pipe_step(eng *e, int32_t n_out, int32_t *n_outs, char *err)
{
    struct eng_flight *F = &e->fl[e->fl_head], *N = &e->fl[(e->fl_head + 1) % 2];
    const bool next = launch_next(e, F, N);
    int rc = e->exec.collect(e->exec.ctx, err);
    const double t = now_s(), t0 = F->t_launch > e->t_collected ? F->t_launch : e->t_collected;
    e->st.model_s += t - t0; /* the step's time once the one before was done */
    e->st.decode_model_s += t - t0;
    e->st.decode_steps++;
    e->t_collected = t;
    e->fl_head = (e->fl_head + 1) % 2;
    e->n_fl--;
    for (int32_t k = 0; k < F->n; k++) F->seq[k]->n_launched--;
    if (rc < 0) { /* the step is lost, and the one after it with it: fail their requests */
        if (next) {
            char e2[PD_ERR_LEN];
            (void)e->exec.collect(e->exec.ctx, e2);
            for (int32_t k = 0; k < N->n; k++) N->seq[k]->n_launched--;
            e->fl_head = (e->fl_head + 1) % 2;
            e->n_fl--;
        }
        bm_drop_cache(e->blocks);
        for (int32_t k = 0; k < F->n; k++)
            if (F->seq[k]->status == SEQ_RUNNING) fail_request(e, &n_out, F->seq[k]);
        release_limbo(e);
        *n_outs = n_out;
        return rc;
    }
    for (int32_t k = 0; k < F->n; k++) {
        pd_seq *s = F->seq[k];
        if (s->status != SEQ_RUNNING) continue; /* finished or aborted since the launch */
        s->n_computed++;
        const int32_t tok = F->tokens[k];
        const bool lp_on = s->want_logprob && F->want_lp;
        const float lp = lp_on ? F->logprobs[k] : 0.0f;
        const pd_top_logprob *top = F->top + (size_t)k * PD_MAX_TOP_LOGPROBS;
        s->finish = append_token(e, s, tok);
        report(e, &n_out, s, tok, lp, top, lp_on ? top_count(top, s->n_top) : 0);
        if (s->finish != SEQ_FINISH_NONE) retire(e, s);
        else if (s->n_launched > 0) bm_commit(e->blocks, s, s->n_tokens); /* N's token known */
    }
    release_limbo(e);
    *n_outs = n_out;
    return 0;
}

int eng_step(eng *e, const eng_output **outs, int32_t *n_outs, char *err)
{
    double t0 = now_s();
    for (int32_t i = 0; i < e->n_finished; i++) seq_free(e->finished[i]);
    e->n_finished = 0;
    int32_t n_out = 0;
    /* Sequences that finished between steps: decode-only admissions that ended on their first
     * token, choices ended by the caller (a launched step may still hold a row of one: retire
     * keeps its blocks until the step is collected). */
    while (e->n_pending > 0 && n_out < e->p.max_num_seqs) {
        pd_seq *s = e->pending[--e->n_pending];
        report(e, &n_out, s, -1, 0.0f, NULL, 0);
        retire(e, s);
    }
    *outs = e->outs;
    if (e->n_fl > 0) return pipe_step(e, n_out, n_outs, err); /* launched by the last call */
    sched_out so;
    sched_schedule(e->sch, &so);
    e->st.preemptions += so.n_preempted;
    e->st.cached_tokens += so.n_cached_tokens;
    e->st.admitted_prompt_tokens += so.n_admitted_tokens;
    for (int32_t i = 0; i < so.n_items; i++)
        if (so.items[i].seq->t_scheduled == 0) so.items[i].seq->t_scheduled = t0;
    if (so.n_items == 0) {
        *n_outs = n_out;
        e->st.host_s += now_s() - t0;
        return 0;
    }
    /* Batch: rows of each item's new tokens; compact block tables. */
    const int32_t bs = e->p.block_size;
    int32_t width = 1, nt = 0, nl = 0;
    bool all_decode = true;
    for (int32_t i = 0; i < so.n_items; i++)
        if (so.items[i].seq->n_blocks > width) width = so.items[i].seq->n_blocks;
    e->cu_q[0] = 0;
    for (int32_t i = 0; i < so.n_items; i++) {
        const sched_item *it = &so.items[i];
        pd_seq *s = it->seq;
        for (int32_t j = 0; j < it->n_new; j++) {
            int32_t p = s->n_computed + j;
            e->ids[nt + j] = s->tokens[p];
            e->pos[nt + j] = p;
            e->slots[nt + j] = s->block_table[p / bs] * bs + p % bs;
        }
        nt += it->n_new;
        e->cu_q[i + 1] = nt;
        e->ctx[i] = s->n_computed + it->n_new;
        put_table(e, i, width, s);
        if (it->sample) { /* a request that forks now: one row per choice, each its own seed */
            const int32_t nc = s->n_fork + 1;
            for (int32_t c = 0; c < nc; c++) {
                e->rows[nl] = nt - 1;
                e->row_choice[nl] = c;
                e->row_seq[nl++] = s;
            }
        }
        if (it->n_new == 1 && s->n_computed >= s->n_prompt) {
            e->st.decode_tokens++;
        } else {
            e->st.prompt_tokens_computed += it->n_new;
            all_decode = false;
        }
    }
    mr_batch b = {nt, e->ids, e->pos, e->slots, so.n_items, e->cu_q, e->ctx, e->bt, width, nl, e->rows};
    /* Prefill-only: requests whose prompt completes in this forward can ship each layer's KV
     * as soon as the layer is done. */
    bool hooked = false;
    if (e->p.mode == ENG_MODE_PREFILL && e->has_kvl) {
        int32_t n = 0;
        for (int32_t k = 0; k < nl; k++) {
            pd_seq *s = e->row_seq[k];
            if (seq_n_output(s) != 0 || e->row_choice[k] != 0) continue;
            e->kvl_ids[n] = s->id;
            e->kvl_blocks[n] = s->block_table;
            e->kvl_n[n++] = (s->n_prompt + bs - 1) / bs;
        }
        if (n > 0) {
            e->kvl.on_prompt_step(e->kvl.arg, e->kvl_ids, e->kvl_blocks, e->kvl_n, n);
            if (e->exec.set_layer_hook) {
                e->exec.set_layer_hook(e->exec.ctx, e->kvl.on_layer, e->kvl.arg);
                hooked = true;
            }
        }
    }
    mr_sampling smp = {0};
    if (e->exec.forward_sample && sampling_rows(e, nl, &smp) < 0)
        return pd_errf(err, PD_ENOMEM, "out of memory for the penalty lists");
    int rc = PD_EUNSUPPORTED;
    if (e->async && !hooked && all_decode && nt == so.n_items && nl == nt && smp.n_pen == 0) {
        /* a decode step without penalties: launched, then pipe_step */
        struct eng_flight *f = &e->fl[e->fl_head];
        const bool want_lp = smp.logprobs != NULL;
        mr_sampling fs = {smp.rows, NULL, 0, f->tokens, want_lp ? f->logprobs : NULL,
                          want_lp ? f->top : NULL};
        rc = e->exec.launch(e->exec.ctx, &b, &fs, false, err);
        if (rc == 0) {
            flight_set(e, f, e->row_seq, nl, want_lp);
            note_peak_blocks(e);
            e->st.host_s += now_s() - t0;
            return pipe_step(e, n_out, n_outs, err);
        }
    }
    double t1 = now_s();
    if (rc == PD_EUNSUPPORTED)
        rc = e->exec.forward_sample ? e->exec.forward_sample(e->exec.ctx, &b, &smp, err)
                                    : e->exec.forward(e->exec.ctx, &b, e->logits, err);
    double t2 = now_s();
    if (hooked) e->exec.set_layer_hook(e->exec.ctx, NULL, NULL);
    e->st.model_s += t2 - t1;
    e->st.steps++;
    if (nt == so.n_items && all_decode) {
        e->st.decode_model_s += t2 - t1;
        e->st.decode_steps++;
    } else {
        e->st.prefill_model_s += t2 - t1;
    }
    e->st.batch_seqs_sum += so.n_items;
    note_peak_blocks(e);
    if (rc < 0) { /* the step is lost: fail its requests cleanly */
        bm_drop_cache(e->blocks); /* blocks registered for this step were never written */
        for (int32_t i = 0; i < so.n_items; i++) fail_request(e, &n_out, so.items[i].seq);
        *n_outs = n_out;
        return rc;
    }
    /* Postprocess: advance, register full blocks, sample, stop. */
    for (int32_t i = 0; i < so.n_items; i++) {
        pd_seq *s = so.items[i].seq;
        s->n_computed += so.items[i].n_new;
    }
    const int32_t V = e->cfg.vocab_size;
    double t3 = now_s();
    int32_t toks[ENG_MAX_CHOICES], n_tops[ENG_MAX_CHOICES];
    float lps[ENG_MAX_CHOICES];
    for (int32_t k = 0; k < nl;) {
        pd_seq *s = e->row_seq[k];
        const int32_t k0 = k, nc = s->n_fork + 1; /* rows k .. k + nc - 1 are s's (its choices) */
        for (int32_t c = 0; c < nc; c++, k++) {
            pd_top_logprob *top = e->top + (size_t)k * PD_MAX_TOP_LOGPROBS;
            lps[c] = 0.0f;
            n_tops[c] = 0;
            if (e->exec.forward_sample) {
                toks[c] = smp.tokens[k];
                if (s->want_logprob) {
                    lps[c] = smp.logprobs[k];
                    n_tops[c] = top_count(top, s->n_top);
                }
            } else {
                float *row = e->logits + (size_t)k * V;
                smp_params sc = s->sampling;
                if (nc > 1) sc.seed = s->choice_seeds[c];
                /* the sampler changes the row: the raw distribution is read from a copy */
                if (s->want_logprob) memcpy(e->lp_row, row, (size_t)V * sizeof *row);
                toks[c] = smp_sample(&sc, row, V, s->tokens, s->n_prompt, s->tokens + s->n_prompt,
                                     seq_n_output(s), e->scratch, NULL);
                if (s->want_logprob)
                    n_tops[c] = smp_logprobs(e->lp_row, V, toks[c], s->n_top, &lps[c], top);
            }
        }
        if (nc > 1 && e->p.mode == ENG_MODE_PREFILL) { /* every choice's first token goes out */
            memcpy(s->first_tokens, toks, (size_t)nc * sizeof *toks);
            memcpy(s->first_logprobs, lps, (size_t)nc * sizeof *lps);
            memcpy(s->first_n_top, n_tops, (size_t)nc * sizeof *n_tops);
            for (int32_t c = 0; c < nc; c++)
                if (n_tops[c] > 0)
                    memcpy(s->first_top + (size_t)c * PD_MAX_TOP_LOGPROBS, row_top(e, k0 + c),
                           (size_t)n_tops[c] * sizeof *s->first_top);
        } else if (nc > 1) {
            pd_seq *kids[ENG_MAX_CHOICES];
            const int32_t nk = fork_choices(e, s, toks, kids);
            for (int32_t c = 0; c < nk; c++) {
                pd_seq *x = kids[c];
                report(e, &n_out, x, toks[c], lps[c], row_top(e, k0 + c), n_tops[c]);
                if (x->finish != SEQ_FINISH_NONE) retire(e, x);
                else if (c > 0) queue_choice(e, x);
            }
            continue;
        }
        s->finish = append_token(e, s, toks[0]);
        if (e->p.mode == ENG_MODE_PREFILL && seq_n_output(s) == 1) s->finish = SEQ_FINISH_PREFILLED;
        report(e, &n_out, s, toks[0], lps[0], row_top(e, k0), n_tops[0]);
        if (s->finish != SEQ_FINISH_NONE) retire(e, s);
    }
    *n_outs = n_out;
    double t4 = now_s();
    e->st.sample_s += t4 - t3;
    e->st.host_s += t4 - t0 - (t2 - t1);
    return 0;
}

bool eng_has_work(const eng *e)
{
    return sched_n_waiting(e->sch) > 0 || sched_n_running(e->sch) > 0 || e->n_pending > 0 ||
           e->n_fl > 0;
}

int32_t eng_n_waiting(const eng *e) { return sched_n_waiting(e->sch); }
int32_t eng_n_running(const eng *e) { return sched_n_running(e->sch); }
int32_t eng_n_free_blocks(const eng *e) { return bm_n_free(e->blocks); }

int64_t eng_queued_prompt_tokens(const eng *e)
{
    int64_t n = 0;
    for (uint32_t i = 0; i <= e->map.mask; i++) {
        if (!e->map.vals[i]) continue;
        pd_seq *ring[ENG_MAX_CHOICES];
        const int32_t nr = ring_list(e->map.vals[i], ring);
        for (int32_t k = 0; k < nr; k++) {
            const pd_seq *s = ring[k];
            if ((s->status == SEQ_WAITING || s->status == SEQ_RUNNING) && s->n_tokens - s->n_computed > 1)
                n += s->n_tokens - s->n_computed;
        }
    }
    return n;
}
const eng_stats *eng_stats_get(const eng *e) { return &e->st; }
const bm *eng_block_manager(const eng *e) { return e->blocks; }

int eng_check(const eng *e)
{
    if (bm_check(e->blocks) < 0) return -1;
    int32_t nb = bm_n_blocks(e->blocks);
    int32_t *refs = calloc((size_t)nb, sizeof *refs);
    if (!refs) return -1;
    int rc = 0;
    for (uint32_t i = 0; i <= e->map.mask; i++) {
        if (!e->map.vals[i]) continue;
        pd_seq *ring[ENG_MAX_CHOICES];
        const int32_t nr = ring_list(e->map.vals[i], ring);
        for (int32_t k = 0; k < nr; k++) {
            const pd_seq *s = ring[k];
            if (s->id != e->map.keys[i] || (s->sib_next->sib_prev != s)) {
                fprintf(stderr, "eng_check: request %llu: broken ring of choices\n",
                        (unsigned long long)e->map.keys[i]);
                rc = -1;
            }
            if (s->status == SEQ_WAITING && s->n_blocks != 0) {
                fprintf(stderr, "eng_check: waiting request %llu holds %d blocks\n",
                        (unsigned long long)s->id, s->n_blocks);
                rc = -1;
            }
            for (int32_t j = 0; j < s->n_blocks; j++) refs[s->block_table[j]]++;
        }
    }
    for (int32_t i = 0; i < e->n_limbo; i++) /* finished, blocks held for a launched step */
        for (int32_t j = 0; j < e->limbo[i]->n_blocks; j++) refs[e->limbo[i]->block_table[j]]++;
    for (int32_t b = 0; b < nb && rc == 0; b++) {
        if (refs[b] != bm_ref(e->blocks, b)) {
            fprintf(stderr, "eng_check: block %d has ref %d but %d holders\n", b,
                    bm_ref(e->blocks, b), refs[b]);
            rc = -1;
        }
    }
    free(refs);
    return rc;
}
