/* rtr_errors.c -- Public status details for failed internal calls (see rtr_errors.h). */
#include "router/rtr_errors.h"

#include <stdio.h>
#include <string.h>

#include "common/rpc/rpc.h"

/* Copies s into out (len > 0), cutting before a UTF-8 character that would not fit whole. */
static void copy_utf8(char *out, size_t len, const char *s)
{
    size_t n = strlen(s);
    if (n >= len) {
        n = len - 1;
        while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80) n--; /* s[n] starts a character */
    }
    memcpy(out, s, n);
    out[n] = 0;
}

void rtr_public_detail(int code, const char *internal_detail, const char *what, char *out,
                       size_t len)
{
    if (!out || len == 0) return;
    const char *w = what && *what ? what : "internal";
    const char *fmt;
    switch (code) {
    case RPC_STATUS_OK:
        out[0] = 0;
        return;
    case RPC_STATUS_INVALID_ARGUMENT:
        if (internal_detail && *internal_detail) {
            copy_utf8(out, len, internal_detail);
            return;
        }
        fmt = "the %s instance refused the request as invalid";
        break;
    case RPC_STATUS_UNAVAILABLE:
        fmt = "the %s instance became unavailable; retry";
        break;
    case RPC_STATUS_DEADLINE_EXCEEDED:
        fmt = "the %s instance did not finish within the router's request timeout; retry later "
              "or ask for fewer tokens";
        break;
    case RPC_STATUS_RESOURCE_EXHAUSTED:
        fmt = "the %s instance is at capacity; retry later";
        break;
    case RPC_STATUS_CANCELLED:
        fmt = "the %s instance's work on the request was cancelled; retry";
        break;
    case RPC_STATUS_ABORTED:
        fmt = "the %s instance aborted the request; retry";
        break;
    case RPC_STATUS_FAILED_PRECONDITION:
        fmt = "the %s instance cannot serve this request: the deployment's instances do not "
              "match (model or KV layout; logged)";
        break;
    case RPC_STATUS_UNIMPLEMENTED:
        fmt = "the %s instance does not support this call (version mismatch; logged)";
        break;
    case RPC_STATUS_PERMISSION_DENIED:
    case RPC_STATUS_UNAUTHENTICATED:
        fmt = "authentication failed between the %s instance and its peer (TLS or the KV secret; logged)";
        break;
    default: /* INTERNAL, UNKNOWN, DATA_LOSS, and codes an instance does not send */
        /* A failed engine step (svc: the instance then reports NOT_SERVING): say so, the
         * client's retry goes elsewhere. */
        if (code == RPC_STATUS_INTERNAL && internal_detail &&
            strstr(internal_detail, "the engine failed a step"))
            fmt = "the %s instance's engine failed a step (a device error; the instance was "
                  "taken out of service); retry";
        else
            fmt = "internal error in the %s instance (logged)";
        break;
    }
    char buf[256];
    snprintf(buf, sizeof buf, fmt, w);
    copy_utf8(out, len, buf);
}
