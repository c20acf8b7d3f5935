/* error.c -- Messages and names for the pdserve error table, and the assert handler. */
#include "common/error.h"

#include <stdio.h>
#include <stdlib.h>

const char *pd_strerror(int err)
{
    if (err == PD_OK) return "success";
    switch (err) {
#define PD_X_MSG(name, val, msg) case val: return msg;
        PD_ERRNO_MAP(PD_X_MSG)
#undef PD_X_MSG
    default: return "unknown error";
    }
}

const char *pd_err_name(int err)
{
    if (err == PD_OK) return "PD_OK";
    switch (err) {
#define PD_X_NAME(name, val, msg) case val: return "PD_" #name;
        PD_ERRNO_MAP(PD_X_NAME)
#undef PD_X_NAME
    default: return "PD_E?";
    }
}

int pd_errf(char *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, PD_ERR_LEN, fmt, ap);
        va_end(ap);
    }
    return code;
}

void pd__assert_fail(const char *expr, const char *file, int line, const char *msg)
{
    fprintf(stderr, "pdserve: assertion failed at %s:%d: %s (%s)\n", file, line,
            msg ? msg : "", expr);
    fflush(stderr);
    abort();
}
