/* generate.c -- Offline generation on the engine (see generate.h). */
#include "engine/generate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

gen_options gen_default_options(void)
{
    gen_options o = {.enable_prefix_cache = true, .enable_chunked_prefill = true};
    return o;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static gen_finish map_finish(seq_finish f)
{
    switch (f) {
    case SEQ_FINISH_LENGTH: return GEN_FINISH_LENGTH;
    case SEQ_FINISH_EOS: return GEN_FINISH_EOS;
    case SEQ_FINISH_STOP: return GEN_FINISH_STOP;
    default: return GEN_FINISH_NONE;
    }
}

int gen_run_opts(mr *r, const pd_model *m, const gen_request *reqs, int32_t n,
                 const gen_options *opt, gen_result *res, gen_stats *stats, char *err)
{
    gen_options o = opt ? *opt : gen_default_options();
    eng_params ep = eng_default_params(r);
    ep.enable_prefix_cache = o.enable_prefix_cache;
    ep.enable_chunked_prefill = o.enable_chunked_prefill;
    if (o.max_num_batched_tokens > 0 && o.max_num_batched_tokens < ep.max_num_batched_tokens)
        ep.max_num_batched_tokens = o.max_num_batched_tokens;
    if (o.max_num_seqs > 0 && o.max_num_seqs < ep.max_num_seqs) ep.max_num_seqs = o.max_num_seqs;
    return gen_run_engine(&ep, &m->cfg, eng_executor_runner(r), reqs, n, &o, res, stats, err);
}

int gen_run_engine(const eng_params *ep, const mc_config *cfg, eng_executor x,
                   const gen_request *reqs, int32_t n, const gen_options *opt, gen_result *res,
                   gen_stats *stats, char *err)
{
    gen_options o = opt ? *opt : gen_default_options();
    memset(res, 0, sizeof *res * (size_t)(n > 0 ? n : 0));
    if (n <= 0) return pd_errf(err, PD_EINVAL, "no requests");
    eng *e = NULL;
    int rc = eng_create(ep, cfg, x, &e, err);
    if (rc < 0) return rc;
    const int32_t L = cfg->max_position;
    int64_t prompt_tokens = 0, generated = 0, total_max = 0;
    for (int32_t i = 0; i < n && rc == 0; i++) {
        const gen_request *q = &reqs[i];
        eng_request er = {.id = (uint64_t)i, .prompt = q->prompt, .n_prompt = q->n_prompt,
                          .sampling = q->sampling};
        er.stop.max_tokens = q->max_tokens;
        if (q->n_prompt < L && q->n_prompt + (int64_t)q->max_tokens > L)
            er.stop.max_tokens = L - q->n_prompt; /* offline: stop at the model's length */
        er.stop.min_tokens = q->min_tokens < er.stop.max_tokens ? q->min_tokens : er.stop.max_tokens;
        if (q->n_stop_ids > 16) {
            rc = pd_errf(err, PD_EINVAL, "request %d: at most 16 stop token ids", i);
            break;
        }
        er.stop.n_stop_ids = q->n_stop_ids;
        if (q->n_stop_ids > 0) memcpy(er.stop.stop_ids, q->stop_ids, (size_t)q->n_stop_ids * sizeof(int32_t));
        er.stop.ignore_eos = q->ignore_eos;
        if (q->max_tokens > 0) {
            res[i].tokens = malloc((size_t)er.stop.max_tokens * sizeof(int32_t) + 1);
            if (!res[i].tokens) rc = pd_errf(err, PD_ENOMEM, "out of memory");
        }
        char e2[PD_ERR_LEN];
        if (rc == 0 && (rc = eng_add_request(e, &er, e2)) < 0) pd_errf(err, rc, "request %d: %s", i, e2);
        prompt_tokens += q->n_prompt;
        total_max += er.stop.max_tokens;
    }
    double t0 = now_s(), last_print = t0;
    bool tty = o.progress && isatty(2);
    while (rc == 0 && eng_has_work(e)) {
        const eng_output *outs;
        int32_t k;
        if ((rc = eng_step(e, &outs, &k, err)) < 0) break;
        for (int32_t j = 0; j < k; j++) {
            const eng_output *ox = &outs[j];
            gen_result *g = &res[ox->id];
            if (ox->token >= 0) {
                g->tokens[g->n_tokens++] = ox->token;
                generated++;
            }
            if (ox->finish != SEQ_FINISH_NONE) g->finish = map_finish(ox->finish);
        }
        double t = now_s();
        if (o.progress && t - last_print > (tty ? 0.2 : 5.0)) {
            last_print = t;
            fprintf(stderr, "%sprogress: %lld/%lld tokens, %d running, %d waiting, %.1f s%s",
                    tty ? "\r" : "", (long long)generated, (long long)total_max,
                    eng_n_running(e), eng_n_waiting(e), t - t0, tty ? "   " : "\n");
        }
    }
    if (tty && o.progress) fprintf(stderr, "\r%60s\r", "");
    if (stats) {
        memset(stats, 0, sizeof *stats);
        stats->elapsed_s = now_s() - t0;
        stats->prompt_tokens = prompt_tokens;
        stats->generated_tokens = generated;
        stats->eng = *eng_stats_get(e);
    }
    eng_destroy(e);
    if (rc < 0) gen_results_free(res, n);
    return rc;
}

int gen_run(mr *r, const pd_model *m, const gen_request *reqs, int32_t n, gen_result *res,
            gen_stats *stats, char *err)
{
    return gen_run_opts(r, m, reqs, n, NULL, res, stats, err);
}

void gen_results_free(gen_result *res, int32_t n)
{
    if (!res) return;
    for (int32_t i = 0; i < n; i++) {
        free(res[i].tokens);
        res[i].tokens = NULL;
    }
}
