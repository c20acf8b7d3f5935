/* cuda_backend.h -- The CUDA backend's public entry points, for C code (kernels/backend.c and
 * tests). bf16 weights, activations and KV cache with fp32 accumulation, matrix products
 * through cuBLAS. This header pulls in no CUDA header: streams and handles stay inside. */
#ifndef PD_CUDA_BACKEND_H
#define PD_CUDA_BACKEND_H

#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/backend.h"

/* Number of CUDA devices the runtime sees; 0 when there is no driver or no device (never an
 * error: callers use it to decide whether "auto" means cuda). */
int pd_backend_cuda_device_count(void);

/* Creates the CUDA backend on device p->device (p may be NULL: device 0). Owns one stream, one
 * cuBLAS handle and a pinned staging buffer; every op is queued on that stream, and only
 * download_f32, kv_blocks_to_host, kv_blocks_from_host and sync wait for it. Returns 0,
 * PD_ENOTFOUND (no such device; err says why), PD_ENOMEM or PD_EBACKEND. Free with
 * pd_backend_destroy. */
int pd_backend_cuda_create(const pd_backend_params *p, pd_backend **out, char *err);

#ifdef __cplusplus
}
#endif

#endif
