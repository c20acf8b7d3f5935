/* fuzz_wire_strings.c -- Fuzzes rpc_validate_strings, the check every server runs on a
 * request's bytes before protobuf-c decodes them, over the GenerateRequest, PrefillRequest and
 * DecodeRequest descriptors. Invariants: it never reads out of bounds (ASan), it always
 * answers 0, PD_EINVAL or PD_EFORMAT with a message on failure, and what it calls malformed
 * protobuf-c refuses too (the check turns away no request the decoder would take as valid). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/rpc/rpc.h"
#include "pdserve/internal/v1/decode.pb-c.h"
#include "pdserve/internal/v1/prefill.pb-c.h"
#include "pdserve/v1/generation.pb-c.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const ProtobufCMessageDescriptor *const descs[] = {
        &pdserve__v1__generate_request__descriptor,
        &pdserve__internal__v1__prefill_request__descriptor,
        &pdserve__internal__v1__decode_request__descriptor,
    };
    for (size_t i = 0; i < sizeof descs / sizeof descs[0]; i++) {
        char err[PD_ERR_LEN];
        err[0] = 0;
        int rc = rpc_validate_strings(descs[i], data, size, err);
        if (rc != 0 && rc != PD_EINVAL && rc != PD_EFORMAT) abort();
        if (rc != 0 && (err[0] == 0 || !memchr(err, 0, sizeof err))) abort();
        if (rpc_validate_strings(descs[i], data, size, NULL) != rc) abort(); /* err optional */
        if (rc == PD_EFORMAT) {
            ProtobufCMessage *m = protobuf_c_message_unpack(descs[i], NULL, size, data);
            if (m) abort();
        }
    }
    return 0;
}
