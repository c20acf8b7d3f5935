/* be_call.h -- PD_BE_CALL(expr): in an engine function that returns an int error code, with
 * `pd_backend *be` and `char *err` in scope, evaluates the backend call expr and on a negative
 * result returns it at once, err naming the backend, the call and the error. */
#ifndef PD_ENGINE_BE_CALL_H
#define PD_ENGINE_BE_CALL_H

#include "common/error.h"

#define PD_BE_CALL(expr)                                                                   \
    do {                                                                                   \
        int rc_ = (expr);                                                                  \
        if (rc_ < 0) return pd_errf(err, rc_, "%s backend: %s failed: %s", be->ops->name,   \
                                    #expr, pd_strerror(rc_));                              \
    } while (0)

#endif
