/* generate.h -- Offline generation: a list of requests run to completion on the engine
 * (continuous batching, prefix cache, chunked prefill, preemption), results collected per
 * request. Used by pdserve-generate, the offline bench and the tests. */
#ifndef PD_GENERATE_H
#define PD_GENERATE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"

typedef enum {
    GEN_FINISH_NONE = 0,
    GEN_FINISH_LENGTH,    /* max_tokens reached, or the model's maximum length */
    GEN_FINISH_EOS,       /* a model EOS id */
    GEN_FINISH_STOP,      /* a caller stop token id */
} gen_finish;

const char *gen_finish_name(gen_finish f); /* "length", "eos", "stop", "none" */

typedef struct {
    const int32_t *prompt;       /* [n_prompt] token ids, borrowed for the call */
    int32_t n_prompt;            /* >= 1 */
    smp_params sampling;
    int32_t max_tokens;          /* new tokens at most, >= 1 (clamped to the model maximum) */
    int32_t min_tokens;          /* EOS/stop ids are ignored before this many tokens */
    const int32_t *stop_ids;     /* extra stop token ids (at most 16), borrowed */
    int32_t n_stop_ids;
    bool ignore_eos;             /* don't stop on the model's EOS ids */
} gen_request;

typedef struct {
    int32_t *tokens;             /* [n_tokens] generated ids incl. the stop token; free with
                                    gen_results_free */
    int32_t n_tokens;
    gen_finish finish;
} gen_result;

typedef struct {
    double elapsed_s;            /* wall time from the first step to the last */
    int64_t prompt_tokens;       /* sum of prompt lengths */
    int64_t generated_tokens;
    eng_stats eng;               /* the engine's counters for this run */
} gen_stats;

typedef struct {
    bool enable_prefix_cache;    /* default true */
    bool enable_chunked_prefill; /* default true */
    int32_t max_num_batched_tokens; /* 0 = the runner's */
    int32_t max_num_seqs;        /* 0 = the runner's */
    bool progress;               /* a progress line on stderr while running */
} gen_options;

gen_options gen_default_options(void);

/* Runs every request to completion on a fresh engine over r (whose KV pool it uses) and
 * writes res[n]; stats may be NULL, opt may be NULL for defaults. Requests are validated
 * first (err names the request). Returns 0 or an error. */
int gen_run_opts(mr *r, const pd_model *m, const gen_request *reqs, int32_t n,
                 const gen_options *opt, gen_result *res, gen_stats *stats, char *err);
/* The same on an engine built from p over any executor (e.g. a null model that isolates the
 * host-side cost); p's step sizes are used as given. */
int gen_run_engine(const eng_params *p, const mc_config *cfg, eng_executor x,
                   const gen_request *reqs, int32_t n, const gen_options *opt, gen_result *res,
                   gen_stats *stats, char *err);
/* gen_run_opts with default options. */
int gen_run(mr *r, const pd_model *m, const gen_request *reqs, int32_t n, gen_result *res,
            gen_stats *stats, char *err);

void gen_results_free(gen_result *res, int32_t n);

#endif
