/* request_params.h -- What a request asks of the engine, as plain data every layer from here
 * up shares (the router, which links no engine, included): its sampling parameters, its
 * stopping criteria, how a sequence finished, and the shape of a reported log-probability.
 * engine/sampler.h samples by these parameters; kernels/backend.h's sample op reports top
 * log-probabilities in this shape. */
#ifndef PD_REQUEST_PARAMS_H
#define PD_REQUEST_PARAMS_H

#include <stdbool.h>
#include <stdint.h>

/* ---- sampling ---- */

typedef struct {
    float temperature;        /* 0 = greedy; > 0 scales logits; default 1.0 */
    float top_p;              /* nucleus mass in (0, 1]; 1 = off */
    int32_t top_k;            /* keep the k most likely; 0 or -1 = off */
    float min_p;              /* drop tokens with p < min_p * p_max; in [0, 1]; 0 = off */
    float repetition_penalty; /* > 0; 1 = off; HF rule over prompt and output tokens */
    float presence_penalty;   /* [-2, 2]; subtracted once per token present in the output */
    float frequency_penalty;  /* [-2, 2]; subtracted per occurrence in the output */
    uint64_t seed;            /* draw key; meaningful when has_seed, else the engine picks one */
    bool has_seed;            /* seed was given by the caller */
} smp_params;

smp_params smp_default_params(void);

/* Checks ranges (temperature >= 0 and finite, 0 < top_p <= 1, top_k >= -1, 0 <= min_p <= 1,
 * repetition_penalty > 0, |presence|, |frequency| <= 2). Returns 0 or PD_EINVAL with err
 * naming the field and value. */
int smp_validate(const smp_params *p, char *err);

/* ---- stopping and finishing ---- */

typedef enum {
    SEQ_FINISH_NONE = 0,
    SEQ_FINISH_LENGTH,     /* max_tokens, or the model's maximum length */
    SEQ_FINISH_EOS,        /* a model EOS id */
    SEQ_FINISH_STOP,       /* a caller stop token id */
    SEQ_FINISH_ABORTED,    /* aborted by the caller */
    SEQ_FINISH_PREFILLED,  /* prefill-only: first token sampled, blocks handed out */
    SEQ_FINISH_CANCELLED,  /* this choice was ended by the caller (eng_end_choice); the
                              request's other choices go on */
} seq_finish;

const char *seq_finish_name(seq_finish f); /* "length", "eos", "stop", "abort", ... */

typedef struct {
    int32_t max_tokens;        /* new tokens at most, >= 1 */
    int32_t min_tokens;        /* EOS / stop ids do not stop before this many new tokens */
    int32_t stop_ids[16];      /* extra stop token ids */
    int32_t n_stop_ids;
    bool ignore_eos;           /* don't stop at the model's EOS ids */
} seq_stopping;

/* ---- log-probabilities ---- */

/* Alternatives reported per token at most (GenerateRequest.logprobs). */
#define PD_MAX_TOP_LOGPROBS 20

/* One of a row's best tokens under the raw model distribution (see the sample op). */
typedef struct {
    int32_t token;               /* token id; -1 ends a row's list early */
    float logprob;               /* log-softmax of its raw logit */
} pd_top_logprob;

#endif
