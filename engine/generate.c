/* generate.c -- Offline batched generation (see generate.h): fixed block ranges per request,
 * chunked batched prefill, then batched decode with host-side sampling. */
#include "engine/generate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"

const char *gen_finish_name(gen_finish f)
{
    switch (f) {
    case GEN_FINISH_LENGTH: return "length";
    case GEN_FINISH_EOS: return "eos";
    case GEN_FINISH_STOP: return "stop";
    default: return "none";
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    const gen_request *rq;
    int32_t *out;        /* generated tokens, capacity max_tokens */
    int32_t n_out;
    int32_t n_done;      /* prompt tokens prefilled so far */
    int32_t first_block; /* contiguous block range of this request */
    int32_t max_tokens;  /* clamped to the model's maximum length */
    smp_params sp;
    gen_finish finish;
} gen_seq;

/* Batch assembly buffers, sized once. */
typedef struct {
    int32_t *ids, *pos, *slots, *cu_q, *ctx, *bt, *rows, *seq_of_row;
    float *logits;
    int32_t width;
} gen_buf;

static void seq_finish_check(gen_seq *s, const pd_model *m, int32_t tok)
{
    const gen_request *q = s->rq;
    if (s->n_out >= q->min_tokens) {
        if (!q->ignore_eos && mc_is_eos(&m->cfg, tok)) {
            s->finish = GEN_FINISH_EOS;
            return;
        }
        for (int32_t i = 0; i < q->n_stop_ids; i++)
            if (q->stop_ids[i] == tok) {
                s->finish = GEN_FINISH_STOP;
                return;
            }
    }
    if (s->n_out >= s->max_tokens) s->finish = GEN_FINISH_LENGTH;
}

static void fill_table(const gen_seq *s, int32_t *row, int32_t width, int32_t n_blocks_seq)
{
    for (int32_t i = 0; i < width; i++) row[i] = i < n_blocks_seq ? s->first_block + i : 0;
}

int gen_run(mr *r, const pd_model *m, const gen_request *reqs, int32_t n, gen_result *res,
            gen_stats *stats, char *err)
{
    const mc_config *c = &m->cfg;
    const mr_params *mp = mr_params_get(r);
    const int32_t bs = mp->block_size, V = c->vocab_size;
    int rc = 0;
    memset(res, 0, sizeof *res * (size_t)n);
    if (n <= 0) return pd_errf(err, PD_EINVAL, "no requests");
    gen_seq *seqs = calloc((size_t)n, sizeof *seqs);
    gen_buf B = {0};
    smp_scratch *scr = NULL;
    if (!seqs) return pd_errf(err, PD_ENOMEM, "out of memory");

    int32_t next_block = 0, width = 1;
    for (int32_t i = 0; i < n; i++) {
        const gen_request *q = &reqs[i];
        gen_seq *s = &seqs[i];
        s->rq = q;
        if (q->n_prompt <= 0) { rc = pd_errf(err, PD_EINVAL, "request %d: empty prompt", i); goto out; }
        if (q->max_tokens <= 0) {
            rc = pd_errf(err, PD_EINVAL, "request %d: max_tokens must be >= 1 (got %d)", i, q->max_tokens);
            goto out;
        }
        if (q->min_tokens < 0 || q->min_tokens > q->max_tokens) {
            rc = pd_errf(err, PD_EINVAL, "request %d: min_tokens %d must be in [0, max_tokens]", i,
                         q->min_tokens);
            goto out;
        }
        if (q->n_prompt >= c->max_position) {
            rc = pd_errf(err, PD_EINVAL, "request %d: prompt of %d tokens leaves no room under the "
                         "model's maximum length of %d", i, q->n_prompt, c->max_position);
            goto out;
        }
        for (int32_t j = 0; j < q->n_prompt; j++)
            if (q->prompt[j] < 0 || q->prompt[j] >= V) {
                rc = pd_errf(err, PD_EINVAL, "request %d: token id %d at position %d is out of "
                             "range [0, %d)", i, q->prompt[j], j, V);
                goto out;
            }
        char e2[PD_ERR_LEN];
        if (smp_validate(&q->sampling, e2) < 0) {
            rc = pd_errf(err, PD_EINVAL, "request %d: %s", i, e2);
            goto out;
        }
        s->sp = q->sampling;
        if (!s->sp.has_seed) { /* a fixed key per request keeps runs reproducible */
            s->sp.seed = 0x5eed0000ull + (uint64_t)i;
            s->sp.has_seed = true;
        }
        s->max_tokens = q->max_tokens;
        if (q->n_prompt + s->max_tokens > c->max_position) s->max_tokens = c->max_position - q->n_prompt;
        int32_t nb = (q->n_prompt + s->max_tokens + bs - 1) / bs;
        s->first_block = next_block;
        if (nb > mr_n_blocks(r) - next_block) {
            rc = pd_errf(err, PD_ENOSPC, "KV cache too small: the requests need more than its %d "
                         "blocks of %d tokens (raise the KV cache size or lower max_tokens)",
                         mr_n_blocks(r), bs);
            goto out;
        }
        next_block += nb;
        if (nb > width) width = nb;
        s->out = malloc((size_t)s->max_tokens * sizeof(int32_t));
        if (!s->out) { rc = pd_errf(err, PD_ENOMEM, "out of memory"); goto out; }
    }
    const int32_t T = mp->max_num_batched_tokens, S = mp->max_num_seqs;
    B.width = width;
    B.ids = malloc((size_t)T * sizeof(int32_t));
    B.pos = malloc((size_t)T * sizeof(int32_t));
    B.slots = malloc((size_t)T * sizeof(int32_t));
    B.rows = malloc((size_t)T * sizeof(int32_t));
    B.seq_of_row = malloc((size_t)T * sizeof(int32_t));
    B.cu_q = malloc(((size_t)S + 1) * sizeof(int32_t));
    B.ctx = malloc((size_t)S * sizeof(int32_t));
    B.bt = malloc((size_t)S * width * sizeof(int32_t));
    B.logits = malloc((size_t)S * V * sizeof(float));
    if (!B.ids || !B.pos || !B.slots || !B.rows || !B.seq_of_row || !B.cu_q || !B.ctx || !B.bt ||
        !B.logits || smp_scratch_create(V, &scr) < 0) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto out;
    }

    /* Prefill: pack prompt chunks until the token or sequence budget is full. */
    double t0 = now_s();
    int32_t cur = 0;
    while (cur < n) {
        int32_t nt = 0, ns = 0, nl = 0;
        B.cu_q[0] = 0;
        for (int32_t i = cur; i < n && nt < T && ns < S; i++) {
            gen_seq *s = &seqs[i];
            int32_t take = s->rq->n_prompt - s->n_done;
            if (take > T - nt) take = T - nt;
            for (int32_t j = 0; j < take; j++) {
                int32_t p = s->n_done + j;
                B.ids[nt + j] = s->rq->prompt[p];
                B.pos[nt + j] = p;
                B.slots[nt + j] = (s->first_block + p / bs) * bs + p % bs;
            }
            s->n_done += take;
            B.ctx[ns] = s->n_done;
            fill_table(s, B.bt + (size_t)ns * width, width, (s->rq->n_prompt + s->max_tokens + bs - 1) / bs);
            nt += take;
            B.cu_q[++ns] = nt;
            if (s->n_done == s->rq->n_prompt) {
                B.rows[nl] = nt - 1;
                B.seq_of_row[nl++] = i;
            }
        }
        mr_batch bt = {nt, B.ids, B.pos, B.slots, ns, B.cu_q, B.ctx, B.bt, width, nl, B.rows};
        if ((rc = mr_forward(r, &bt, B.logits, err)) < 0) goto out;
        for (int32_t k = 0; k < nl; k++) {
            gen_seq *s = &seqs[B.seq_of_row[k]];
            int32_t tok = smp_sample(&s->sp, B.logits + (size_t)k * V, V, s->rq->prompt,
                                     s->rq->n_prompt, s->out, 0, scr, NULL);
            s->out[s->n_out++] = tok;
            seq_finish_check(s, m, tok);
        }
        while (cur < n && seqs[cur].n_done == seqs[cur].rq->n_prompt) cur++;
    }
    double t1 = now_s();

    /* Decode: every unfinished sequence advances one token per step. */
    int32_t steps = 0;
    for (;;) {
        int32_t ns = 0;
        B.cu_q[0] = 0;
        for (int32_t i = 0; i < n; i++) {
            gen_seq *s = &seqs[i];
            if (s->finish != GEN_FINISH_NONE) continue;
            int32_t p = s->rq->n_prompt + s->n_out - 1; /* position of the last sampled token */
            B.ids[ns] = s->out[s->n_out - 1];
            B.pos[ns] = p;
            B.slots[ns] = (s->first_block + p / bs) * bs + p % bs;
            B.ctx[ns] = p + 1;
            fill_table(s, B.bt + (size_t)ns * width, width, (s->rq->n_prompt + s->max_tokens + bs - 1) / bs);
            B.rows[ns] = ns;
            B.seq_of_row[ns] = i;
            B.cu_q[ns + 1] = ns + 1;
            if (++ns == S || ns == T) break;
        }
        if (ns == 0) break;
        mr_batch bt = {ns, B.ids, B.pos, B.slots, ns, B.cu_q, B.ctx, B.bt, width, ns, B.rows};
        if ((rc = mr_forward(r, &bt, B.logits, err)) < 0) goto out;
        steps++;
        for (int32_t k = 0; k < ns; k++) {
            gen_seq *s = &seqs[B.seq_of_row[k]];
            int32_t tok = smp_sample(&s->sp, B.logits + (size_t)k * V, V, s->rq->prompt,
                                     s->rq->n_prompt, s->out, s->n_out, scr, NULL);
            s->out[s->n_out++] = tok;
            seq_finish_check(s, m, tok);
        }
    }
    double t2 = now_s();
    if (stats) {
        memset(stats, 0, sizeof *stats);
        stats->prefill_s = t1 - t0;
        stats->decode_s = t2 - t1;
        stats->decode_steps = steps;
        for (int32_t i = 0; i < n; i++) {
            stats->prompt_tokens += seqs[i].rq->n_prompt;
            stats->generated_tokens += seqs[i].n_out;
        }
    }
    for (int32_t i = 0; i < n; i++) {
        res[i].tokens = seqs[i].out;
        res[i].n_tokens = seqs[i].n_out;
        res[i].finish = seqs[i].finish;
        seqs[i].out = NULL;
    }
out:
    for (int32_t i = 0; i < n; i++) free(seqs[i].out);
    free(seqs);
    free(B.ids); free(B.pos); free(B.slots); free(B.rows); free(B.seq_of_row);
    free(B.cu_q); free(B.ctx); free(B.bt); free(B.logits);
    smp_scratch_destroy(scr);
    return rc;
}

void gen_results_free(gen_result *res, int32_t n)
{
    if (!res) return;
    for (int32_t i = 0; i < n; i++) {
        free(res[i].tokens);
        res[i].tokens = NULL;
    }
}
