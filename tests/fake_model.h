/* fake_model.h -- A fake model for engine tests that reads the KV cache: every token's "KV"
 * records (token, position) at its slot, and each row's logits are a hash of the whole context
 * read back through the block table (block size 4). A request that sees another's block, a
 * stale block or a lost one gets different tokens than when run alone. Header-only. */
#ifndef PD_FAKE_MODEL_H
#define PD_FAKE_MODEL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "engine/engine.h"
#include "engine/sampler.h"

#define V 48

typedef struct {
    int64_t *kv;     /* [n_slots] (position << 16 | token) + 1; 0 = never written */
    int64_t n_slots;
    int64_t corrupt; /* rows whose context read back something unexpected */
    int32_t delay_us;/* sleep per forward (to keep requests alive in thread tests) */
} fake;

static inline uint64_t fake_mix(uint64_t h, uint64_t x)
{
    h ^= x + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 29);
}

static inline int fake_forward(void *ctx, const mr_batch *b, float *logits, char *err)
{
    fake *f = ctx;
    (void)err;
    if (f->delay_us > 0) {
        struct timespec ts = {0, (long)f->delay_us * 1000};
        nanosleep(&ts, NULL);
    }
    for (int32_t i = 0; i < b->n_tokens; i++) {
        if (b->slot_mapping[i] < 0 || b->slot_mapping[i] >= f->n_slots) return PD_EINVAL;
        f->kv[b->slot_mapping[i]] = ((int64_t)b->positions[i] << 16 | b->input_ids[i]) + 1;
    }
    for (int32_t k = 0; k < b->n_logits; k++) {
        int32_t row = b->logits_rows[k], s = 0;
        while (b->cu_q[s + 1] <= row) s++;
        int32_t pos = b->positions[row];
        const int32_t *bt = b->block_tables + (size_t)s * b->max_blocks_per_seq;
        uint64_t h = 1469598103934665603ull;
        for (int32_t p = 0; p <= pos; p++) {
            int64_t slot = (int64_t)bt[p / 4] * 4 + p % 4; /* block size 4 in this test */
            int64_t v = f->kv[slot];
            if (v == 0 || ((v - 1) >> 16) != p) f->corrupt++;
            h = fake_mix(h, (uint64_t)v);
        }
        float *l = logits + (size_t)k * V;
        for (int32_t t = 0; t < V; t++) l[t] = (float)((h >> (t % 48)) & 7) * 0.7f;
        l[h % V] += 4.0f;
    }
    return 0;
}

/* The executor's forward_sample over the same fake logits: what a backend's sample op does,
 * done here from the engine's rows and penalty lists (the penalties applied from the list as
 * smp_sample applies them from the token lists, then smp_sample with the penalties off), so
 * an engine that builds the rows or lists wrongly samples differently from the host path. */
static inline int fake_forward_sample(void *ctx, const mr_batch *b, const mr_sampling *smp,
                                      char *err)
{
    float *l = malloc(((size_t)b->n_logits + 1) * V * sizeof(float));
    smp_scratch *sc = NULL;
    if (!l || smp_scratch_create(V, &sc) < 0) {
        free(l);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    int rc = fake_forward(ctx, b, l, err);
    for (int32_t k = 0; rc == 0 && k < b->n_logits; k++) {
        const pd_sample_row *row = &smp->rows[k];
        float *lk = l + (size_t)k * V;
        /* the raw distribution's log-probabilities, before the penalties change the row: the
         * last row of l is the copy */
        float *raw = l + (size_t)b->n_logits * V;
        memcpy(raw, lk, V * sizeof(float));
        for (int32_t i = 0; i < row->pen_n; i++) {
            const pd_penalty_tok *t = &smp->pen[row->pen_off + i];
            float *x = &lk[t->token];
            if (row->repetition_penalty != 1.0f)
                *x = *x > 0.0f ? *x / row->repetition_penalty : *x * row->repetition_penalty;
            if (t->count > 0) {
                *x -= row->frequency_penalty * (float)t->count;
                *x -= row->presence_penalty;
            }
        }
        smp_params p = smp_default_params();
        p.temperature = row->temperature;
        p.top_p = row->top_p;
        p.top_k = row->top_k;
        p.min_p = row->min_p;
        p.seed = row->seed;
        p.has_seed = true;
        float lp = 0.0f;
        int32_t *none = calloc((size_t)row->n_output + 1, sizeof *none); /* penalties are off */
        if (!none) {
            rc = pd_errf(err, PD_ENOMEM, "out of memory");
            break;
        }
        smp->tokens[k] = smp_sample(&p, lk, V, NULL, 0, none, row->n_output, sc, NULL);
        free(none);
        if (smp->logprobs && row->n_top >= 0) {
            pd_top_logprob top[PD_MAX_TOP_LOGPROBS];
            int32_t n = smp_logprobs(raw, V, smp->tokens[k], row->n_top, &lp, top);
            smp->logprobs[k] = lp;
            for (int32_t j = 0; smp->top && j < row->n_top; j++) {
                pd_top_logprob t = {-1, 0.0f};
                smp->top[(size_t)k * PD_MAX_TOP_LOGPROBS + j] = j < n ? top[j] : t;
            }
        } else if (smp->logprobs) {
            smp->logprobs[k] = 0.0f;
        }
    }
    smp_scratch_destroy(sc);
    free(l);
    return rc;
}

/* The executor's clone_blocks over the fake KV: block src[i]'s 4 slots over dst[i]'s. Counts
 * the blocks copied; a dst that is also a src is misuse (PD_EINVAL). */
static int64_t fake_clones;
static inline int fake_clone_blocks(void *ctx, const int32_t *src, const int32_t *dst, int32_t n,
                                    char *err)
{
    fake *f = ctx;
    for (int32_t i = 0; i < n; i++) {
        for (int32_t j = 0; j < n; j++)
            if (dst[i] == src[j]) return pd_errf(err, PD_EINVAL, "clone onto a source block");
        if (src[i] < 0 || dst[i] < 0 || (int64_t)dst[i] * 4 + 4 > f->n_slots ||
            (int64_t)src[i] * 4 + 4 > f->n_slots)
            return pd_errf(err, PD_EINVAL, "clone: block out of range");
        memcpy(f->kv + (size_t)dst[i] * 4, f->kv + (size_t)src[i] * 4, 4 * sizeof(int64_t));
        fake_clones++;
    }
    return 0;
}

static inline mc_config fake_cfg(void)
{
    mc_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = V;
    c.max_position = 256;
    c.eos_token_ids[0] = 0;
    c.n_eos = 1;
    return c;
}

/* A pipelined executor over the same fake model (eng_executor's launch / collect): a launch
 * runs its forward at once (what a queue runs in launch order) and keeps the picks until they
 * are collected; with ids_from_last each row's input is the previous launch's pick for the
 * same row, so an engine that lines the rows up wrongly gets other tokens. Misuse of the
 * protocol (three outstanding, chaining onto nothing or onto a launch of another row count,
 * a collect of nothing) is counted. Batches over FP_ROWS rows are PD_EUNSUPPORTED. */
#define FP_ROWS 64
typedef struct {
    fake *f;
    int32_t n_out, head;
    struct {
        int32_t n;
        int32_t tok[FP_ROWS];
        float lp[FP_ROWS];
        pd_top_logprob top[FP_ROWS * PD_MAX_TOP_LOGPROBS];
        int32_t *dst;
        float *dst_lp;
        pd_top_logprob *dst_top;
    } q[2];
    int32_t last[FP_ROWS], n_last; /* the latest launch's picks */
    int64_t misuse, launches, chained;
} fake_pipe;

static inline int fake_pipe_launch(void *ctx, const mr_batch *b, const mr_sampling *s,
                                   bool ids_from_last, char *err)
{
    fake_pipe *p = ctx;
    if (b->n_tokens > FP_ROWS || b->n_logits != b->n_tokens) return PD_EUNSUPPORTED;
    if (p->n_out == 2 || (ids_from_last && (p->n_out == 0 || p->n_last != b->n_tokens))) {
        p->misuse++;
        return pd_errf(err, PD_ESTATE, "fake pipe: launch out of order");
    }
    int32_t ids[FP_ROWS];
    for (int32_t i = 0; i < b->n_tokens; i++) ids[i] = ids_from_last ? p->last[i] : b->input_ids[i];
    mr_batch c = *b;
    c.input_ids = ids;
    const int k = (p->head + p->n_out) % 2;
    mr_sampling t = *s;
    t.tokens = p->q[k].tok;
    t.logprobs = s->logprobs ? p->q[k].lp : NULL;
    t.top = s->logprobs && s->top ? p->q[k].top : NULL;
    int rc = fake_forward_sample(p->f, &c, &t, err);
    if (rc < 0) return rc;
    p->q[k].n = b->n_logits;
    p->q[k].dst = s->tokens;
    p->q[k].dst_lp = s->logprobs;
    p->q[k].dst_top = s->logprobs ? s->top : NULL;
    memcpy(p->last, p->q[k].tok, (size_t)b->n_logits * sizeof(int32_t));
    p->n_last = b->n_logits;
    p->n_out++;
    p->launches++;
    p->chained += ids_from_last;
    return 0;
}

static inline int fake_pipe_collect(void *ctx, char *err)
{
    fake_pipe *p = ctx;
    if (p->n_out == 0) {
        p->misuse++;
        return pd_errf(err, PD_ESTATE, "fake pipe: nothing to collect");
    }
    const int k = p->head;
    memcpy(p->q[k].dst, p->q[k].tok, (size_t)p->q[k].n * sizeof(int32_t));
    if (p->q[k].dst_lp) memcpy(p->q[k].dst_lp, p->q[k].lp, (size_t)p->q[k].n * sizeof(float));
    if (p->q[k].dst_top)
        memcpy(p->q[k].dst_top, p->q[k].top,
               (size_t)p->q[k].n * PD_MAX_TOP_LOGPROBS * sizeof(pd_top_logprob));
    p->head = (p->head + 1) % 2;
    p->n_out--;
    return 0;
}

static inline int fake_pipe_forward(void *ctx, const mr_batch *b, float *logits, char *err)
{
    return fake_forward(((fake_pipe *)ctx)->f, b, logits, err);
}

static inline int fake_pipe_clone_blocks(void *ctx, const int32_t *src, const int32_t *dst,
                                         int32_t n, char *err)
{
    return fake_clone_blocks(((fake_pipe *)ctx)->f, src, dst, n, err);
}

static inline int fake_pipe_forward_sample(void *ctx, const mr_batch *b, const mr_sampling *s,
                                           char *err)
{
    fake_pipe *p = ctx;
    if (p->n_out) {
        p->misuse++; /* a step run at once while launched ones are outstanding */
        return pd_errf(err, PD_ESTATE, "fake pipe: forward while launches are outstanding");
    }
    return fake_forward_sample(p->f, b, s, err);
}

#endif
