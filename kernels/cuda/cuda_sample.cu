/* cuda_sample.cu -- The sample op (being written: not offered in the op table yet). */
#include "kernels/cuda/cuda_common.cuh"

extern "C" int pd_cuda__sample(void *ctx, void *logits, int32_t n, int32_t vocab,
                               const pd_sample_row *rows, const pd_penalty_tok *pen,
                               int32_t n_pen, int32_t *tokens, float *logprobs)
{
    (void)pd_cuda__ctx(ctx);
    (void)logits; (void)n; (void)vocab; (void)rows; (void)pen; (void)n_pen; (void)tokens;
    (void)logprobs;
    return PD_EINVAL;
}

extern "C" void pd_cuda__sample_free(void *state) { (void)state; }
