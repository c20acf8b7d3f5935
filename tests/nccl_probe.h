/* nccl_probe.h -- for the GPU tests that need NCCL (test_cuda_comm, test_cuda_tp): whether a
 * communicator over the first two CUDA devices can be created. */
#ifndef PD_TESTS_NCCL_PROBE_H
#define PD_TESTS_NCCL_PROBE_H

#include "common/error.h"
#include "kernels/backend.h"

/* Creates CUDA backends on devices 0 and 1 and a communicator over them, then destroys all.
 * Returns pd_comm_create's result: PD_EUNSUPPORTED (with err set) when NCCL cannot be loaded.
 * Needs two devices. */
static inline int nccl_probe(char *err)
{
    pd_backend *be[2] = {NULL, NULL};
    pd_comm *c = NULL;
    for (int r = 0; r < 2; r++) {
        pd_backend_params bp = pd_backend_default_params();
        bp.device = r;
        (void)pd_backend_create("cuda", &bp, &be[r], err);
    }
    int rc = pd_comm_create(be, 2, &c, err);
    pd_comm_destroy(c);
    for (int r = 0; r < 2; r++) pd_backend_destroy(be[r]);
    return rc;
}

#endif
