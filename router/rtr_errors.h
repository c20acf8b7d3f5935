/* rtr_errors.h -- What a public client is told when one of the router's internal calls
 * (Prefill, Decode) fails: an actionable sentence per status code instead of the internal
 * text (transport errors such as "recvmsg:Connection reset by peer", gRPC core strings,
 * addresses), which belongs in the router's log. */
#ifndef PD_ROUTER_RTR_ERRORS_H
#define PD_ROUTER_RTR_ERRORS_H

#include <stddef.h>

/* Writes into out (len bytes, NUL-terminated, truncated at a UTF-8 character boundary) the
 * public status details for an internal call that ended with code (an rpc_status_code) and
 * internal_detail (the instance's or gRPC core's message; may be NULL). what names the
 * instance kind in the sentence ("prefill", "decode"; NULL = "internal"). Only
 * INVALID_ARGUMENT passes internal_detail through: those are the instances' own validation
 * messages, written for clients. Every other code gets a fixed sentence ("the decode
 * instance became unavailable; retry", "internal error in the prefill instance (logged)");
 * the caller logs internal_detail. Nothing is allocated; out may be the same buffer for
 * every call. len 0 writes nothing. */
void rtr_public_detail(int code, const char *internal_detail, const char *what, char *out,
                       size_t len);

#endif
