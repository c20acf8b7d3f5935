/* svc_core.h -- What every service shares, the router included: protobuf <-> request
 * conversions with validation, error -> gRPC status mapping, the model fingerprint, and the
 * process lifecycle (signals). No engine, kvtransfer or kernels API: the router includes this,
 * not svc.h. */
#ifndef PD_SVC_CORE_H
#define PD_SVC_CORE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/rpc/rpc.h"
#include "pdserve/v1/generation.pb-c.h"
#include "text/request_params.h"

/* ---- conversions ---- */

/* Fills *out from a SamplingParams message (NULL = all defaults: temperature 1, top_p 1, ...)
 * and validates it. Returns 0, or PD_EINVAL with a message for the client in err. */
int svc_sampling_from_proto(const Pdserve__V1__SamplingParams *m, smp_params *out, char *err);
/* Copies *p into a message (the oneof presence fields set); strings none. */
void svc_sampling_to_proto(const smp_params *p, Pdserve__V1__SamplingParams *m);
/* Fills *out from StoppingCriteria (NULL = defaults) with max_tokens defaulting to
 * default_max_tokens when unset; stop strings are not copied (router business). Returns 0 or
 * PD_EINVAL with err. */
int svc_stopping_from_proto(const Pdserve__V1__StoppingCriteria *m, int32_t default_max_tokens,
                            seq_stopping *out, char *err);
/* The limits every request is held to, at the public API and at the internal ports alike:
 * request_id at most SVC_MAX_REQUEST_ID bytes, logprobs at most PD_MAX_TOP_LOGPROBS, n at most
 * max_choices, at most SVC_MAX_STOP stop strings, each non-empty and at most
 * SVC_MAX_STOP_BYTES bytes. stopping and request_id may be NULL. Returns 0, or PD_EINVAL with a
 * message for the client in err. */
#define SVC_MAX_REQUEST_ID 128
#define SVC_MAX_STOP 16
#define SVC_MAX_STOP_BYTES 256
int svc_request_limits_check(const char *request_id, const Pdserve__V1__StoppingCriteria *stopping,
                             uint32_t logprobs, uint32_t n, int32_t max_choices, char *err);

/* A request's fields that every service checks the same way (the public Generate once its
 * prompt is tokens, and the instances' Prefill and Decode, whose ports are no way around the
 * public limits). */
typedef struct {
    const char *request_id;
    const uint32_t *prompt_token_ids;
    size_t n_prompt_token_ids;
    const Pdserve__V1__SamplingParams *sampling;   /* NULL: defaults */
    const Pdserve__V1__StoppingCriteria *stopping; /* NULL: defaults */
    uint32_t logprobs, n;
} svc_request_fields;

/* The prompt ids every service checks, at the public API (a request that sends ids) and at the
 * internal ports alike: ids[0..n) non-empty, fewer than max_len of them (max_len 0: no bound
 * here), each below vocab. Returns 0, or PD_EINVAL with a message for the client in err. */
int svc_prompt_check(const uint32_t *ids, size_t n, int32_t vocab, int32_t max_len, char *err);
/* The one validator of those fields: svc_prompt_check on prompt_token_ids, then
 * svc_request_limits_check (n at most max_choices), svc_sampling_from_proto into *sampling and
 * svc_stopping_from_proto into *stop (max_tokens default_max_tokens when unset). Returns 0, or
 * PD_EINVAL with a message for the client in err. The router makes the same checks in two
 * steps (the limits and conversions before it takes a pending slot, svc_prompt_check once the
 * prompt is tokens), as a text or chat prompt is tokenized only after the cheap checks. */
int svc_request_check(const svc_request_fields *f, int32_t vocab, int32_t max_len,
                      int32_t max_choices, int32_t default_max_tokens, smp_params *sampling,
                      seq_stopping *stop, char *err);
/* A token's log-probabilities as a TokenLogprob message: token_id, logprob and top[0..n_top)
 * (best first, as the engine reports them), all in one allocation. Returns it (caller frees
 * with free()) or NULL when out of memory. */
Pdserve__V1__TokenLogprob *svc_token_logprob_new(uint32_t token, float logprob,
                                                 const pd_top_logprob *top, int32_t n_top);
/* The gRPC status for a pdserve error code. */
rpc_status_code svc_status_for(int pd_err);
/* The public finish reason for an engine finish. */
Pdserve__V1__FinishReason svc_finish_reason(seq_finish f);

/* ---- the model ---- */

/* The model fingerprint that KvLayout carries (prefill and decode must agree before KV moves):
 * a hash of dir's config.json, load_format, kv_dtype, quant (the weights' quantization as
 * loaded: mc_quant.name, "" for none) and, unless load_format is "dummy"
 * (whose weights are the same seeded values everywhere), the weights' identity read without a
 * full pass: model.safetensors.index.json when present and, for every *.safetensors file in
 * dir, its name, size, header and 32 chunks of 4 KiB spread over its data. Two fine-tunes of
 * one architecture differ; the same files under another directory give the same value.
 * (svc_fingerprint.c) */
uint64_t svc_model_fingerprint(const char *dir, const char *load_format, pd_dtype kv_dtype,
                               const char *quant);

/* ---- lifecycle ---- */

/* Blocks SIGINT/SIGTERM/SIGPIPE in the calling thread (call first in main, before any thread
 * starts, so that every thread inherits the mask). */
void svc_block_signals(void);
/* Waits for SIGINT or SIGTERM; returns the signal number. */
int svc_wait_signal(void);

#endif
