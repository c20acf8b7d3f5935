/* error.h -- pdserve error codes, one X-macro table for codes, names and messages,
 * plus the invariant-check macro used everywhere. */
#ifndef PD_ERROR_H
#define PD_ERROR_H

#include <stdarg.h>
#include <stddef.h>

/* X(NAME, value, message). 0 is success; every error is negative. */
#define PD_ERRNO_MAP(X)                                              \
    X(EINVAL, -1, "invalid argument")                                \
    X(ENOMEM, -2, "out of memory")                                   \
    X(EIO, -3, "input/output error")                                 \
    X(EFORMAT, -4, "malformed data")                                 \
    X(EUNSUPPORTED, -5, "unsupported feature")                       \
    X(ERANGE, -6, "value out of range")                              \
    X(ENOSPC, -7, "no space left")                                   \
    X(ENOTFOUND, -8, "not found")                                    \
    X(EBACKEND, -9, "compute backend failure")                       \
    X(ESTATE, -10, "operation not valid in this state")              \
    X(ETIMEDOUT, -11, "deadline exceeded")                           \
    X(ECANCELED, -12, "cancelled")                                   \
    X(EUNAVAILABLE, -13, "peer unreachable or gone")                 \
    X(EMISMATCH, -14, "incompatible configuration between peers")  \
    X(EPERM, -15, "peer not authenticated")

enum {
    PD_OK = 0,
#define PD_X_ENUM(name, val, msg) PD_##name = (val),
    PD_ERRNO_MAP(PD_X_ENUM)
#undef PD_X_ENUM
};

/* Size of the caller-provided buffers that receive a human-readable error detail. */
#define PD_ERR_LEN 512

/* Returns a static message for an error code ("unknown error" for values not in the table). */
const char *pd_strerror(int err);
/* Returns the code's symbolic name, e.g. "PD_EINVAL"; "PD_OK" for 0. */
const char *pd_err_name(int err);

/* Formats a detail message into err (PD_ERR_LEN bytes; NULL is allowed and ignored) and
 * returns code, so that failures read `return pd_errf(err, PD_EINVAL, "bad %s", x);`. */
int pd_errf(char *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Aborts with file, line and message when an invariant is broken. Not for runtime errors. */
void pd__assert_fail(const char *expr, const char *file, int line, const char *msg)
    __attribute__((noreturn));
#define PD_ASSERT(cond, msg) \
    ((cond) ? (void)0 : pd__assert_fail(#cond, __FILE__, __LINE__, (msg)))

#endif
