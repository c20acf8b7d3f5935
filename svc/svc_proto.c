/* svc_proto.c -- What every service shares, the router included, without the engine or
 * kvtransfer: the public request's conversions, the status of an error code, and signals. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "svc/svc.h"

int svc_sampling_from_proto(const Pdserve__V1__SamplingParams *m, smp_params *out, char *err)
{
    *out = smp_default_params();
    if (m) {
        if (m->temperature_set_case == PDSERVE__V1__SAMPLING_PARAMS__TEMPERATURE_SET_TEMPERATURE)
            out->temperature = m->temperature;
        if (m->top_p_set_case == PDSERVE__V1__SAMPLING_PARAMS__TOP_P_SET_TOP_P) out->top_p = m->top_p;
        out->top_k = m->top_k;
        out->min_p = m->min_p;
        if (m->repetition_penalty_set_case ==
            PDSERVE__V1__SAMPLING_PARAMS__REPETITION_PENALTY_SET_REPETITION_PENALTY)
            out->repetition_penalty = m->repetition_penalty;
        out->presence_penalty = m->presence_penalty;
        out->frequency_penalty = m->frequency_penalty;
        if (m->seed_set_case == PDSERVE__V1__SAMPLING_PARAMS__SEED_SET_SEED) {
            out->seed = m->seed;
            out->has_seed = true;
        }
    }
    char e2[PD_ERR_LEN];
    if (smp_validate(out, e2) < 0) return pd_errf(err, PD_EINVAL, "sampling: %s", e2);
    return 0;
}

void svc_sampling_to_proto(const smp_params *p, Pdserve__V1__SamplingParams *m)
{
    pdserve__v1__sampling_params__init(m);
    m->temperature_set_case = PDSERVE__V1__SAMPLING_PARAMS__TEMPERATURE_SET_TEMPERATURE;
    m->temperature = p->temperature;
    m->top_p_set_case = PDSERVE__V1__SAMPLING_PARAMS__TOP_P_SET_TOP_P;
    m->top_p = p->top_p;
    m->top_k = p->top_k;
    m->min_p = p->min_p;
    m->repetition_penalty_set_case = PDSERVE__V1__SAMPLING_PARAMS__REPETITION_PENALTY_SET_REPETITION_PENALTY;
    m->repetition_penalty = p->repetition_penalty;
    m->presence_penalty = p->presence_penalty;
    m->frequency_penalty = p->frequency_penalty;
    if (p->has_seed) {
        m->seed_set_case = PDSERVE__V1__SAMPLING_PARAMS__SEED_SET_SEED;
        m->seed = p->seed;
    }
}

int svc_stopping_from_proto(const Pdserve__V1__StoppingCriteria *m, int32_t default_max_tokens,
                            seq_stopping *out, char *err)
{
    memset(out, 0, sizeof *out);
    out->max_tokens = default_max_tokens;
    if (!m) return 0;
    if (m->max_tokens_set_case == PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS) {
        if (m->max_tokens == 0 || m->max_tokens > (uint32_t)INT32_MAX)
            return pd_errf(err, PD_EINVAL, "stopping.max_tokens must be >= 1 (got %u)", m->max_tokens);
        out->max_tokens = (int32_t)m->max_tokens;
    }
    if (m->min_tokens > (uint32_t)out->max_tokens)
        return pd_errf(err, PD_EINVAL, "stopping.min_tokens (%u) exceeds max_tokens (%d)",
                       m->min_tokens, out->max_tokens);
    out->min_tokens = (int32_t)m->min_tokens;
    const size_t cap = sizeof out->stop_ids / sizeof out->stop_ids[0];
    if (m->n_stop_token_ids > cap)
        return pd_errf(err, PD_EINVAL, "stopping.stop_token_ids: at most %zu ids (got %zu)", cap,
                       m->n_stop_token_ids);
    for (size_t i = 0; i < m->n_stop_token_ids; i++) {
        if (m->stop_token_ids[i] > (uint32_t)INT32_MAX)
            return pd_errf(err, PD_EINVAL, "stopping.stop_token_ids[%zu] is out of range", i);
        out->stop_ids[i] = (int32_t)m->stop_token_ids[i];
    }
    out->n_stop_ids = (int32_t)m->n_stop_token_ids;
    out->ignore_eos = m->ignore_eos;
    return 0;
}

rpc_status_code svc_status_for(int e)
{
    switch (e) {
    case PD_OK: return RPC_STATUS_OK;
    case PD_EINVAL: case PD_EFORMAT: case PD_ERANGE: return RPC_STATUS_INVALID_ARGUMENT;
    case PD_ENOSPC: case PD_ENOMEM: return RPC_STATUS_RESOURCE_EXHAUSTED;
    case PD_ENOTFOUND: return RPC_STATUS_NOT_FOUND;
    case PD_EUNSUPPORTED: return RPC_STATUS_UNIMPLEMENTED;
    case PD_ETIMEDOUT: return RPC_STATUS_DEADLINE_EXCEEDED;
    case PD_ECANCELED: return RPC_STATUS_CANCELLED;
    /* PD_EBACKEND: the engine failed a step (a broken device): this instance cannot serve,
     * the request can elsewhere (the router moves it) */
    case PD_EUNAVAILABLE: case PD_ESTATE: case PD_EBACKEND: return RPC_STATUS_UNAVAILABLE;
    case PD_EMISMATCH: return RPC_STATUS_FAILED_PRECONDITION;
    case PD_EPERM: return RPC_STATUS_PERMISSION_DENIED;
    default: return RPC_STATUS_INTERNAL;
    }
}

Pdserve__V1__FinishReason svc_finish_reason(seq_finish f)
{
    switch (f) {
    case SEQ_FINISH_LENGTH: return PDSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    case SEQ_FINISH_EOS: return PDSERVE__V1__FINISH_REASON__FINISH_REASON_EOS;
    case SEQ_FINISH_STOP: return PDSERVE__V1__FINISH_REASON__FINISH_REASON_STOP;
    case SEQ_FINISH_ABORTED: return PDSERVE__V1__FINISH_REASON__FINISH_REASON_CANCELLED;
    case SEQ_FINISH_CANCELLED: return PDSERVE__V1__FINISH_REASON__FINISH_REASON_CANCELLED;
    default: return PDSERVE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    }
}

void svc_block_signals(void)
{
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGINT);
    sigaddset(&s, SIGTERM);
    sigaddset(&s, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &s, NULL);
}

int svc_wait_signal(void)
{
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGINT);
    sigaddset(&s, SIGTERM);
    int sig = 0;
    sigwait(&s, &sig);
    return sig;
}

Pdserve__V1__TokenLogprob *svc_token_logprob_new(uint32_t token, float logprob,
                                                 const pd_top_logprob *top, int32_t n_top)
{
    const size_t n = n_top > 0 ? (size_t)n_top : 0;
    /* the message, then its n pointers, then the n entries they point at */
    const size_t head = (sizeof(Pdserve__V1__TokenLogprob) + 15) & ~(size_t)15;
    const size_t ptrs = (n * sizeof(Pdserve__V1__TopLogprob *) + 15) & ~(size_t)15;
    unsigned char *mem = malloc(head + ptrs + n * sizeof(Pdserve__V1__TopLogprob));
    if (!mem) return NULL;
    Pdserve__V1__TokenLogprob *m = (Pdserve__V1__TokenLogprob *)mem;
    Pdserve__V1__TopLogprob **pp = (Pdserve__V1__TopLogprob **)(mem + head);
    Pdserve__V1__TopLogprob *t = (Pdserve__V1__TopLogprob *)(mem + head + ptrs);
    pdserve__v1__token_logprob__init(m);
    m->token_id = token;
    m->logprob = logprob;
    for (size_t i = 0; i < n; i++) {
        pdserve__v1__top_logprob__init(&t[i]);
        t[i].token_id = (uint32_t)top[i].token;
        t[i].logprob = top[i].logprob;
        pp[i] = &t[i];
    }
    m->n_top = n;
    m->top = n ? pp : NULL;
    return m;
}

int svc_prompt_check(const uint32_t *ids, size_t n, int32_t vocab, int32_t max_len, char *err)
{
    if (n == 0) return pd_errf(err, PD_EINVAL, "prompt_token_ids is empty");
    if (max_len > 0 && n >= (size_t)max_len)
        return pd_errf(err, PD_EINVAL, "the prompt has %zu tokens; the model's maximum length "
                       "is %d", n, max_len);
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= (uint32_t)vocab)
            return pd_errf(err, PD_EINVAL, "prompt_token_ids[%zu] = %u is out of range [0, %d)",
                           i, ids[i], vocab);
    return 0;
}

int svc_request_check(const svc_request_fields *f, int32_t vocab, int32_t max_len,
                      int32_t max_choices, int32_t default_max_tokens, smp_params *sampling,
                      seq_stopping *stop, char *err)
{
    int rc = svc_prompt_check(f->prompt_token_ids, f->n_prompt_token_ids, vocab, max_len, err);
    if (rc == 0)
        rc = svc_request_limits_check(f->request_id, f->stopping, f->logprobs, f->n, max_choices,
                                      err);
    if (rc == 0) rc = svc_sampling_from_proto(f->sampling, sampling, err);
    if (rc == 0) rc = svc_stopping_from_proto(f->stopping, default_max_tokens, stop, err);
    return rc;
}

int svc_request_limits_check(const char *request_id, const Pdserve__V1__StoppingCriteria *st,
                             uint32_t logprobs, uint32_t n, int32_t max_choices, char *err)
{
    const size_t id_len = request_id ? strlen(request_id) : 0;
    if (id_len > SVC_MAX_REQUEST_ID)
        return pd_errf(err, PD_EINVAL, "request_id: at most %d bytes (got %zu)",
                       SVC_MAX_REQUEST_ID, id_len);
    if (logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_errf(err, PD_EINVAL, "logprobs: at most %d (got %u)", PD_MAX_TOP_LOGPROBS,
                       logprobs);
    if (n > (uint32_t)max_choices)
        return pd_errf(err, PD_EINVAL, "n: at most %d choices (got %u)", max_choices, n);
    if (st && st->n_stop > SVC_MAX_STOP)
        return pd_errf(err, PD_EINVAL, "stopping.stop: at most %d stop strings (got %zu)",
                       SVC_MAX_STOP, st->n_stop);
    for (size_t i = 0; st && i < st->n_stop; i++) {
        const size_t len = st->stop[i] ? strlen(st->stop[i]) : 0;
        if (len == 0) return pd_errf(err, PD_EINVAL, "stopping.stop[%zu] is empty", i);
        if (len > SVC_MAX_STOP_BYTES)
            return pd_errf(err, PD_EINVAL, "stopping.stop[%zu]: at most %d bytes (got %zu)", i,
                           SVC_MAX_STOP_BYTES, len);
    }
    return 0;
}
