/* fuzz_internal_msgs.c -- Fuzzes the internal messages as the services decode them: the first
 * input byte picks a message type (PrefillRequest, DecodeRequest, LoadReport request and
 * response, KvTarget, KvLayout, DecodeResponse, PrefillResponse, health check), the rest is
 * unpacked with protobuf-c and, when it unpacks, run through the checks and conversions the
 * services apply (svc_sampling_from_proto, svc_stopping_from_proto, the KvTarget / KvLayout
 * fields prefill reads), packed again and freed. Converting validated sampling settings back
 * to a message and in again must give the same settings. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "grpc/health/v1/health.pb-c.h"
#include "pdserve/internal/v1/decode.pb-c.h"
#include "pdserve/internal/v1/instance.pb-c.h"
#include "pdserve/internal/v1/kv.pb-c.h"
#include "pdserve/internal/v1/prefill.pb-c.h"
#include "svc/svc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The services' conversions of SamplingParams and StoppingCriteria, with the round trip. */
static void check_request(const Pdserve__V1__SamplingParams *sp,
                          const Pdserve__V1__StoppingCriteria *sc)
{
    char err[PD_ERR_LEN];
    smp_params p, p2;
    if (svc_sampling_from_proto(sp, &p, err) == 0) {
        Pdserve__V1__SamplingParams m;
        svc_sampling_to_proto(&p, &m);
        if (svc_sampling_from_proto(&m, &p2, err) != 0 || p2.temperature != p.temperature ||
            p2.top_p != p.top_p || p2.top_k != p.top_k || p2.min_p != p.min_p ||
            p2.repetition_penalty != p.repetition_penalty ||
            p2.presence_penalty != p.presence_penalty ||
            p2.frequency_penalty != p.frequency_penalty || p2.has_seed != p.has_seed ||
            (p.has_seed && p2.seed != p.seed))
            abort();
    }
    static const int32_t k_default_max[] = {1, 16, 4096, INT32_MAX};
    for (size_t i = 0; i < sizeof k_default_max / sizeof k_default_max[0]; i++) {
        seq_stopping st;
        if (svc_stopping_from_proto(sc, k_default_max[i], &st, err) != 0) continue;
        if (st.max_tokens < 1 || st.min_tokens < 0 || st.min_tokens > st.max_tokens ||
            st.n_stop_ids < 0 ||
            (size_t)st.n_stop_ids > sizeof st.stop_ids / sizeof st.stop_ids[0])
            abort();
        for (int32_t j = 0; j < st.n_stop_ids; j++)
            if (st.stop_ids[j] < 0) abort();
    }
}

/* What prefill reads of a KvTarget before it accepts a request. */
static void check_kv_target(const Pdserve__Internal__V1__KvTarget *t)
{
    if (!t) return;
    volatile uint64_t sink = t->reservation_id;
    if (t->kv_descriptor.len) sink += t->kv_descriptor.data[t->kv_descriptor.len - 1];
    for (size_t i = 0; i < t->n_block_ids; i++) sink += t->block_ids[i];
    if (t->decode_instance_id) sink += strlen(t->decode_instance_id);
    if (t->layout) sink += strlen(svc_kv_dtype_name(t->layout->dtype));
    (void)sink;
}

static void check_tokens(const uint32_t *ids, size_t n)
{
    volatile uint64_t sink = 0;
    for (size_t i = 0; i < n; i++) sink += ids[i];
    (void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const ProtobufCMessageDescriptor *const k_types[] = {
        &pdserve__internal__v1__prefill_request__descriptor,
        &pdserve__internal__v1__decode_request__descriptor,
        &pdserve__internal__v1__load_report_request__descriptor,
        &pdserve__internal__v1__load_report_response__descriptor,
        &pdserve__internal__v1__kv_target__descriptor,
        &pdserve__internal__v1__kv_layout__descriptor,
        &pdserve__internal__v1__decode_response__descriptor,
        &pdserve__internal__v1__prefill_response__descriptor,
        &grpc__health__v1__health_check_request__descriptor,
    };
    const size_t n_types = sizeof k_types / sizeof k_types[0];
    if (size < 1) return 0;
    const ProtobufCMessageDescriptor *d = k_types[data[0] % n_types];
    ProtobufCMessage *msg = protobuf_c_message_unpack(d, NULL, size - 1, data + 1);
    if (!msg) return 0;

    if (d == &pdserve__internal__v1__prefill_request__descriptor) {
        const Pdserve__Internal__V1__PrefillRequest *q = (const void *)msg;
        check_tokens(q->prompt_token_ids, q->n_prompt_token_ids);
        check_kv_target(q->kv_target);
        check_request(q->sampling, q->stopping);
    } else if (d == &pdserve__internal__v1__decode_request__descriptor) {
        const Pdserve__Internal__V1__DecodeRequest *q = (const void *)msg;
        check_tokens(q->prompt_token_ids, q->n_prompt_token_ids);
        check_request(q->sampling, q->stopping);
    } else if (d == &pdserve__internal__v1__load_report_response__descriptor) {
        const Pdserve__Internal__V1__LoadReportResponse *r = (const void *)msg;
        if (r->kv_layout) (void)svc_kv_dtype_name(r->kv_layout->dtype);
        if (r->instance_id) (void)strlen(r->instance_id);
        if (r->model_name) (void)strlen(r->model_name);
    } else if (d == &pdserve__internal__v1__kv_target__descriptor) {
        check_kv_target((const void *)msg);
    } else if (d == &pdserve__internal__v1__kv_layout__descriptor) {
        char m[256];
        (void)svc_kv_dtype_name(((const Pdserve__Internal__V1__KvLayout *)msg)->dtype);
        (void)svc_kv_layout_check_peer((const Pdserve__Internal__V1__KvLayout *)msg, m, sizeof m);
    } else if (d == &pdserve__internal__v1__decode_response__descriptor) {
        const Pdserve__Internal__V1__DecodeResponse *r = (const void *)msg;
        if (r->kind_case == PDSERVE__INTERNAL__V1__DECODE_RESPONSE__KIND_RESERVATION &&
            r->reservation)
            check_kv_target(r->reservation->kv_target);
        if (r->kind_case == PDSERVE__INTERNAL__V1__DECODE_RESPONSE__KIND_TOKENS && r->tokens)
            check_tokens(r->tokens->token_ids, r->tokens->n_token_ids);
    }

    /* Whatever unpacked packs again into exactly the size it reports (the router copies a
     * KvTarget this way). The copy need not unpack: protobuf-c 1.4 accepts an over-long
     * encoding of field number 0 as an unknown field and packs it back as a plain 0 tag,
     * which it then refuses (corpus/internal_msgs/regress_field_zero.bin). */
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf) {
        if (protobuf_c_message_pack(msg, buf) != n) abort();
        ProtobufCMessage *again = protobuf_c_message_unpack(d, NULL, n, buf);
        if (again) protobuf_c_message_free_unpacked(again, NULL);
        free(buf);
    }
    protobuf_c_message_free_unpacked(msg, NULL);
    return 0;
}
