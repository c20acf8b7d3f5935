/* cuda_fp8_moe.cuh -- Internal to the FP8 op set's experts (cuda_fp8_linear.cu's moe_experts
 * and cuda_fp8_moe.cu): the launchers cuda_fp8.cuh does not declare. Never included by C
 * code. */
#ifndef PD_CUDA_FP8_MOE_CUH
#define PD_CUDA_FP8_MOE_CUH

#include "kernels/cuda/cuda_fp8.cuh"

/* moe_experts' down product and combination at n = 1 in one launch (cuda_fp8_moe.cu): out
 * (+)= sum over j of wts[j] * (act[pos[j]] . w's rows of expert ids[j]), the bits of
 * pd_cuda__fp8_launch_moe and the combination. k <= 8 (else cudaErrorInvalidValue). */
cudaError_t pd_cuda__fp8_launch_moe_down_combine(const pd_fp8_weight *w, const bf16 *act,
                                                 const int32_t *ids, const int32_t *pos,
                                                 const float *wts, int32_t k, int32_t M,
                                                 bool accumulate, bf16 *out, cudaStream_t stream);

#endif
