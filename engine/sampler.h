/* sampler.h -- Turns one sequence's logits into its next token: penalties, temperature,
 * top-k, top-p, min-p and a seeded draw. The draw for output position n of a request depends
 * only on (seed, n), so a request gets the same tokens whatever else is in the batch and
 * after a preemption by recompute. Host-side reference; a backend's sample op
 * (kernels/backend.h) does the same where the logits are, from the row and penalty list that
 * smp_sample_row and smp_penalty_list build here. */
#ifndef PD_SAMPLER_H
#define PD_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "text/request_params.h"


/* Scratch space for smp_sample, sized for a vocabulary. Create once, reuse every step. */
typedef struct smp_scratch smp_scratch;
int smp_scratch_create(int32_t vocab, smp_scratch **out);
void smp_scratch_destroy(smp_scratch *s); /* NULL is a no-op */

/* Samples the next token from logits[vocab] (modified in place: penalties, scaling).
 * prompt/output are the sequence's tokens so far (penalties read them); n_output is also the
 * position used for the seeded draw. The candidates that survive top-k, top-p and min-p are
 * walked in ascending token id order against u = smp_uniform(seed, n_output) times their
 * mass, so the pick does not depend on how they were ranked. If logprob is not NULL it
 * receives the log-probability of the chosen token under the final (filtered,
 * temperature-scaled) distribution, or under the penalized softmax for greedy. Returns the
 * token id. */
int32_t smp_sample(const smp_params *p, float *logits, int32_t vocab, const int32_t *prompt,
                   int32_t n_prompt, const int32_t *output, int32_t n_output, smp_scratch *s,
                   float *logprob);

/* The log-probabilities a request's logprobs report: under the raw model distribution, the
 * log-softmax of logits[vocab] as the model produced them (before penalties, temperature and
 * the top-k / top-p / min-p filters; vLLM's default). *logprob (not NULL) receives token's;
 * top[0..n) the n_top best tokens (0 <= n_top <= PD_MAX_TOP_LOGPROBS), largest logit first,
 * ties by ascending id, among the tokens whose logit is above -inf (NaN never). The sums are
 * in double. Every logit -inf or NaN: *logprob is -inf and no token is listed. Reads logits
 * only; allocates nothing. Returns n, the entries written (n_top, or fewer when fewer tokens
 * qualify). */
int32_t smp_logprobs(const float *logits, int32_t vocab, int32_t token, int32_t n_top,
                     float *logprob, pd_top_logprob *top);

/* The uniform number in [0, 1) used for the draw at output position n under seed. */
double smp_uniform(uint64_t seed, int64_t n);

/* Whether any of the three penalties is on (a penalty list is needed). */
bool smp_penalized(const smp_params *p);

/* The sample op's row (kernels/backend.h) for a sequence sampled with p that has generated
 * n_output tokens, whose penalty entries are [pen_off, pen_off + pen_n) of the call's list
 * (see smp_penalty_list; 0, 0 when it has none). Its n_top is -1 (no log-probabilities). */
pd_sample_row smp_sample_row(const smp_params *p, int32_t n_output, int32_t pen_off,
                             int32_t pen_n);

/* Writes into out the penalty list of one sequence for the sample op: each distinct token of
 * output (and of prompt, when the repetition penalty is on) once, with its number of
 * occurrences in output (0 = in the prompt only), in order of first appearance, output first.
 * Token ids outside [0, vocab) are skipped, as smp_sample skips them. out must have room for
 * min(n_prompt + n_output, vocab) entries. Uses s's marks: O(n_prompt + n_output), no
 * allocation. Returns the number of entries written; 0 when every penalty is off. */
int32_t smp_penalty_list(const smp_params *p, const int32_t *prompt, int32_t n_prompt,
                         const int32_t *output, int32_t n_output, int32_t vocab,
                         smp_scratch *s, pd_penalty_tok *out);

#endif
