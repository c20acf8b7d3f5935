/* test_rtr_errors.c -- rtr_public_detail: every code gets a sentence for clients, transport
 * text never reaches them, the instances' INVALID_ARGUMENT messages pass through, truncation
 * keeps UTF-8 whole. */
#include <string.h>

#include "common/rpc/rpc.h"
#include "router/rtr_errors.h"
#include "tests/test_util.h"

int main(void)
{
    char out[512];
    const char *raw = "recvmsg:Connection reset by peer (10.0.0.7:50061)";
    rtr_public_detail(RPC_STATUS_UNAVAILABLE, raw, "decode", out, sizeof out);
    CHECK_MSG(!strcmp(out, "the decode instance became unavailable; retry"), "%s", out);
    rtr_public_detail(RPC_STATUS_INTERNAL, "Stream removed", "prefill", out, sizeof out);
    CHECK_MSG(!strcmp(out, "internal error in the prefill instance (logged)"), "%s", out);
    rtr_public_detail(RPC_STATUS_DEADLINE_EXCEEDED, "Deadline Exceeded", "decode", out, sizeof out);
    CHECK_STR_CONTAINS(out, "the decode instance did not finish within the router's request timeout");
    /* The instances' own validation messages are clean and actionable: passed through. */
    rtr_public_detail(RPC_STATUS_INVALID_ARGUMENT, "prompt_token_ids[3] = 99999 is out of range",
                      "prefill", out, sizeof out);
    CHECK_MSG(!strcmp(out, "prompt_token_ids[3] = 99999 is out of range"), "%s", out);
    rtr_public_detail(RPC_STATUS_INVALID_ARGUMENT, NULL, "decode", out, sizeof out);
    CHECK_STR_CONTAINS(out, "the decode instance refused the request as invalid");
    rtr_public_detail(RPC_STATUS_OK, "x", "decode", out, sizeof out);
    CHECK_MSG(out[0] == 0, "%s", out);

    /* No code leaks the internal text, and every one says something. */
    for (int code = 1; code <= 20; code++) {
        if (code == RPC_STATUS_INVALID_ARGUMENT) continue;
        rtr_public_detail(code, raw, NULL, out, sizeof out);
        CHECK_MSG(out[0] != 0, "code %d: empty", code);
        CHECK_MSG(!strstr(out, "recvmsg") && !strstr(out, "10.0.0.7"), "code %d: %s", code, out);
        CHECK_MSG(strstr(out, "internal instance") || strstr(out, "router"), "code %d: %s", code, out);
    }

    /* Truncation never splits a character ("é" is 2 bytes). */
    char small[6];
    rtr_public_detail(RPC_STATUS_INVALID_ARGUMENT, "abcd\xc3\xa9", "decode", small, sizeof small);
    CHECK_MSG(!strcmp(small, "abcd"), "%s", small);
    rtr_public_detail(RPC_STATUS_INVALID_ARGUMENT, "abc\xc3\xa9z", "decode", small, sizeof small);
    CHECK_MSG(!strcmp(small, "abc\xc3\xa9"), "%s", small);
    rtr_public_detail(RPC_STATUS_UNAVAILABLE, raw, "decode", small, 0); /* writes nothing */
    rtr_public_detail(RPC_STATUS_UNAVAILABLE, raw, "decode", NULL, 10);
    return pd_test_result("test_rtr_errors");
}
