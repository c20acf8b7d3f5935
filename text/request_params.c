/* request_params.c -- Defaults and range checks of a request's sampling parameters; finish
 * reasons' names. */
#include "text/request_params.h"

#include <math.h>
#include <string.h>

#include "common/error.h"

smp_params smp_default_params(void)
{
    smp_params p;
    memset(&p, 0, sizeof p);
    p.temperature = 1.0f;
    p.top_p = 1.0f;
    p.top_k = 0;
    p.min_p = 0.0f;
    p.repetition_penalty = 1.0f;
    p.presence_penalty = 0.0f;
    p.frequency_penalty = 0.0f;
    p.seed = 0;
    p.has_seed = false;
    return p;
}

/* Every comparison is written so that NaN fails it, so NaN is rejected for every field. */
int smp_validate(const smp_params *p, char *err)
{
    if (!p) return pd_errf(err, PD_EINVAL, "sampling params missing");
    if (!(p->temperature >= 0.0f && isfinite(p->temperature)))
        return pd_errf(err, PD_EINVAL, "temperature must be >= 0 and finite (got %g)",
                       (double)p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return pd_errf(err, PD_EINVAL, "top_p must be in (0, 1] (got %g)", (double)p->top_p);
    if (p->top_k < -1)
        return pd_errf(err, PD_EINVAL, "top_k must be >= -1, 0 or -1 = off (got %d)",
                       (int)p->top_k);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return pd_errf(err, PD_EINVAL, "min_p must be in [0, 1] (got %g)", (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f && isfinite(p->repetition_penalty)))
        return pd_errf(err, PD_EINVAL, "repetition_penalty must be > 0 and finite (got %g)",
                       (double)p->repetition_penalty);
    if (!(fabsf(p->presence_penalty) <= 2.0f))
        return pd_errf(err, PD_EINVAL, "presence_penalty must be in [-2, 2] (got %g)",
                       (double)p->presence_penalty);
    if (!(fabsf(p->frequency_penalty) <= 2.0f))
        return pd_errf(err, PD_EINVAL, "frequency_penalty must be in [-2, 2] (got %g)",
                       (double)p->frequency_penalty);
    return 0;
}

const char *seq_finish_name(seq_finish f)
{
    switch (f) {
    case SEQ_FINISH_LENGTH: return "length";
    case SEQ_FINISH_EOS: return "eos";
    case SEQ_FINISH_STOP: return "stop";
    case SEQ_FINISH_ABORTED: return "abort";
    case SEQ_FINISH_PREFILLED: return "prefilled";
    case SEQ_FINISH_CANCELLED: return "cancelled";
    default: return "none";
    }
}
