/* generate.h -- Offline batched generation on one model runner: every request's prompt is
 * prefilled (packed into chunks of up to max_num_batched_tokens, a long prompt split across
 * chunks), then all unfinished sequences are decoded together step by step. Each request gets
 * a fixed range of KV blocks for its prompt plus max_tokens; the continuous-batching engine
 * (block manager, scheduler) replaces this for serving. */
#ifndef PD_GENERATE_H
#define PD_GENERATE_H

#include <stdbool.h>
#include <stdint.h>

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
    int32_t max_tokens;          /* new tokens at most, >= 1 */
    int32_t min_tokens;          /* EOS/stop ids are ignored before this many tokens */
    const int32_t *stop_ids;     /* extra stop token ids, borrowed */
    int32_t n_stop_ids;
    bool ignore_eos;             /* don't stop on the model's EOS ids */
} gen_request;

typedef struct {
    int32_t *tokens;             /* [n_tokens] generated ids incl. the stop token; caller frees
                                    with free() */
    int32_t n_tokens;
    gen_finish finish;
} gen_result;

typedef struct {
    double prefill_s;            /* wall time of the prefill phase */
    double decode_s;             /* wall time of the decode phase */
    int64_t prompt_tokens;
    int64_t generated_tokens;
    int32_t decode_steps;
} gen_stats;

/* Validates every request (ids in the vocabulary, prompt + max_tokens within the model's
 * maximum, sampling values, KV blocks sufficient), then generates. Results are written to
 * res[n]; stats may be NULL. Returns 0 or an error with err naming the request. */
int gen_run(mr *r, const pd_model *m, const gen_request *reqs, int32_t n, gen_result *res,
            gen_stats *stats, char *err);

void gen_results_free(gen_result *res, int32_t n);

#endif
