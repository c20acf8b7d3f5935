/* test_rpc_validate.c -- rpc_validate_strings over hand-built wire bytes: valid messages with
 * unknown fields, invalid UTF-8 in nested and repeated strings, overlong encodings,
 * surrogates, code points above U+10FFFF, NUL bytes, truncated varints and fields, wrong wire
 * types, groups, nesting deeper than the limit; and that whatever it calls malformed,
 * protobuf-c refuses too. */
#include <stdint.h>
#include <string.h>

#include "common/rpc/rpc.h"
#include "pdserve/internal/v1/decode.pb-c.h"
#include "pdserve/internal/v1/prefill.pb-c.h"
#include "pdserve/v1/generation.pb-c.h"
#include "tests/test_util.h"

#define GEN_DESC (&pdserve__v1__generate_request__descriptor)

/* A tiny wire writer. */
typedef struct {
    uint8_t b[4096];
    size_t n;
} wbuf;

static void put_varint(wbuf *w, uint64_t v)
{
    while (v >= 0x80) {
        w->b[w->n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    w->b[w->n++] = (uint8_t)v;
}

static void put_bytes(wbuf *w, uint32_t field, const void *p, size_t len)
{
    put_varint(w, (uint64_t)field << 3 | 2);
    put_varint(w, len);
    memcpy(w->b + w->n, p, len);
    w->n += len;
}

static void put_str(wbuf *w, uint32_t field, const char *s) { put_bytes(w, field, s, strlen(s)); }

/* Validates w as a GenerateRequest; returns the code and leaves the message in err. */
static int check_gen(const wbuf *w, char *err)
{
    err[0] = 0;
    return rpc_validate_strings(GEN_DESC, w->b, w->n, err);
}

/* A GenerateRequest whose stopping.stop[1] is s (len bytes). */
static void gen_with_stop(wbuf *w, const char *s, size_t len)
{
    wbuf stop = {.n = 0};
    put_str(&stop, 3, "fine");
    put_bytes(&stop, 3, s, len);
    w->n = 0;
    put_str(w, 1, "req-1");
    put_str(w, 2, "Once upon a time");
    put_bytes(w, 5, stop.b, stop.n);
}

static void test_valid(void)
{
    /* What protobuf-c packs, with every string set and non-ASCII text. */
    Pdserve__V1__StoppingCriteria st = PDSERVE__V1__STOPPING_CRITERIA__INIT;
    char *stops[] = {"\n\n", "fin \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", "\xed\x9f\xbf\xee\x80\x80\xf4\x8f\xbf\xbf"};
    st.n_stop = 3;
    st.stop = stops;
    Pdserve__V1__SamplingParams sp = PDSERVE__V1__SAMPLING_PARAMS__INIT;
    sp.temperature_set_case = PDSERVE__V1__SAMPLING_PARAMS__TEMPERATURE_SET_TEMPERATURE;
    sp.temperature = 0.5f;
    sp.seed_set_case = PDSERVE__V1__SAMPLING_PARAMS__SEED_SET_SEED;
    sp.seed = UINT64_MAX;
    Pdserve__V1__GenerateRequest q = PDSERVE__V1__GENERATE_REQUEST__INIT;
    q.request_id = "r\xc3\xa9q";
    q.prompt = "Il \xc3\xa9tait une fois";
    q.sampling = &sp;
    q.stopping = &st;
    uint32_t ids[3] = {1, 300, 70000};
    q.n_prompt_token_ids = 3;
    q.prompt_token_ids = ids;
    wbuf w = {.n = 0};
    w.n = protobuf_c_message_pack(&q.base, w.b);
    char err[PD_ERR_LEN];
    CHECK_EQ_INT(check_gen(&w, err), 0);
    CHECK_EQ_INT(rpc_validate_strings(GEN_DESC, NULL, 0, err), 0); /* empty message */

    /* Unknown fields of every wire type are skipped, whatever their bytes. */
    put_varint(&w, 99u << 3 | 0);
    put_varint(&w, UINT64_MAX);
    put_varint(&w, 100u << 3 | 1);
    memset(w.b + w.n, 0xff, 8);
    w.n += 8;
    put_varint(&w, 101u << 3 | 5);
    memset(w.b + w.n, 0, 4);
    w.n += 4;
    put_bytes(&w, 0x1FFFFFFF, "\xff\x00\xc0", 3);
    CHECK_EQ_INT(check_gen(&w, err), 0);
    CHECK_MSG(err[0] == 0, "%s", err);

    /* Bytes fields are not strings: KvTarget.kv_descriptor may hold anything. */
    wbuf kv = {.n = 0};
    put_bytes(&kv, 1, "\xff\x00\xfe", 3);
    wbuf pre = {.n = 0};
    put_bytes(&pre, 6, kv.b, kv.n); /* kv_target */
    CHECK_EQ_INT(rpc_validate_strings(&pdserve__internal__v1__prefill_request__descriptor, pre.b,
                                      pre.n, err), 0);
    /* ... while its decode_instance_id (field 3) is a string. */
    put_str(&kv, 3, "dec\xff");
    pre.n = 0;
    put_bytes(&pre, 6, kv.b, kv.n);
    CHECK_EQ_INT(rpc_validate_strings(&pdserve__internal__v1__prefill_request__descriptor, pre.b,
                                      pre.n, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "kv_target.decode_instance_id: not valid UTF-8 (at byte offset 3)");
}

/* Each of these must be refused in a nested repeated string, naming it. */
static void test_bad_utf8(void)
{
    static const struct {
        const char *s;
        size_t len, off;
        const char *what;
    } bad[] = {
        {"a\xff" "b", 3, 1, "invalid byte 0xff"},
        {"\x80", 1, 0, "lone continuation byte"},
        {"ok\xc0\xaf", 4, 2, "overlong '/' (2 bytes, C0)"},
        {"\xc1\xbf", 2, 0, "overlong (C1)"},
        {"\xe0\x80\xaf", 3, 0, "overlong '/' (3 bytes)"},
        {"\xe0\x9f\xbf", 3, 0, "overlong U+07FF (3 bytes)"},
        {"\xf0\x80\x80\xaf", 4, 0, "overlong '/' (4 bytes)"},
        {"\xf0\x8f\xbf\xbf", 4, 0, "overlong U+FFFF (4 bytes)"},
        {"x\xed\xa0\x80", 4, 1, "high surrogate U+D800"},
        {"\xed\xbf\xbf", 3, 0, "low surrogate U+DFFF"},
        {"\xed\xa0\xbd\xed\xb8\x80", 6, 0, "CESU-8 surrogate pair"},
        {"\xf4\x90\x80\x80", 4, 0, "U+110000"},
        {"\xf5\x80\x80\x80", 4, 0, "F5 lead byte"},
        {"\xfe", 1, 0, "FE"},
        {"abc\xe2\x82", 5, 3, "truncated at the end"},
        {"\xe2\x28\xa1", 3, 0, "bad continuation"},
        {"\xf0\x9f\x98", 3, 0, "truncated 4-byte sequence"},
    };
    char err[PD_ERR_LEN], want[128];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        wbuf w;
        gen_with_stop(&w, bad[i].s, bad[i].len);
        CHECK_MSG(check_gen(&w, err) == PD_EINVAL, "%s: %s", bad[i].what, err);
        snprintf(want, sizeof want, "stopping.stop[1]: not valid UTF-8 (at byte offset %zu)",
                 bad[i].off);
        CHECK_MSG(!strcmp(err, want), "%s: got '%s', want '%s'", bad[i].what, err, want);
    }
    /* Top-level fields name themselves. */
    wbuf w = {.n = 0};
    put_str(&w, 1, "id-\xc3");
    CHECK_EQ_INT(check_gen(&w, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "request_id: not valid UTF-8");
    /* Internal requests are checked the same way. */
    w.n = 0;
    put_str(&w, 1, "\xed\xa0\x80");
    CHECK_EQ_INT(rpc_validate_strings(&pdserve__internal__v1__decode_request__descriptor, w.b, w.n,
                                      err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "request_id: not valid UTF-8");
}

static void test_nul(void)
{
    char err[PD_ERR_LEN];
    wbuf w = {.n = 0};
    put_str(&w, 1, "req");
    put_bytes(&w, 2, "Once upon a\0 time", 17);
    CHECK_EQ_INT(check_gen(&w, err), PD_EINVAL);
    CHECK_MSG(!strcmp(err, "prompt: contains a NUL byte at offset 11"), "%s", err);
    gen_with_stop(&w, "stop\0", 5);
    CHECK_EQ_INT(check_gen(&w, err), PD_EINVAL);
    CHECK_MSG(!strcmp(err, "stopping.stop[1]: contains a NUL byte at offset 4"), "%s", err);
    /* The first problem is the one reported. */
    gen_with_stop(&w, "\xff\0", 2);
    CHECK_EQ_INT(check_gen(&w, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "not valid UTF-8 (at byte offset 0)");
    /* NULL err is allowed. */
    CHECK_EQ_INT(rpc_validate_strings(GEN_DESC, w.b, w.n, NULL), PD_EINVAL);
}

static void test_malformed(void)
{
    static const struct {
        const char *b;
        size_t n;
        const char *what, *msg;
    } bad[] = {
        {"\x08", 1, "varint field without a value", "truncated or overlong varint at byte 0"},
        {"\x08\x80", 2, "truncated varint", "truncated or overlong varint"},
        {"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12, "11-byte varint", "overlong varint"},
        {"\x80", 1, "truncated tag", "field tag at byte 0"},
        {"\x0a\x05" "ab", 4, "length past the end", "truncated length-delimited field"},
        {"\x0a\x80", 2, "truncated length", "truncated length-delimited field"},
        {"\x0a", 1, "length missing", "truncated length-delimited field"},
        {"\x09\x01\x02", 3, "truncated fixed64", "truncated fixed-size field"},
        {"\x25\x01", 2, "truncated fixed32 (unknown field 4)", "truncated fixed-size field"},
        {"\x10\x01", 2, "prompt as a varint", "prompt: wire type 0 where a string is expected"},
        {"\x25\x00\x00\x80\x3f", 5, "sampling as a fixed32", "sampling: wire type 5 where a message"},
        {"\x0b\x0c", 2, "group", "unsupported wire type 3"},
        {"\x0e", 1, "wire type 6", "unsupported wire type 6"},
        {"\x02\x00", 2, "field number 0", "field number 0"},
        {"\x88\x80\x80\x80\x80\x00\x01", 7, "6-byte tag", "overlong field tag"},
        {"\x2a\x02\x1a\x05", 4, "nested field past its message", "stopping: truncated length"},
    };
    char err[PD_ERR_LEN];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        int rc = rpc_validate_strings(GEN_DESC, bad[i].b, bad[i].n, err);
        CHECK_MSG(rc == PD_EFORMAT, "%s: rc %d (%s)", bad[i].what, rc, err);
        CHECK_MSG(strstr(err, bad[i].msg) != NULL, "%s: got '%s', want '%s'", bad[i].what, err,
                  bad[i].msg);
        /* protobuf-c refuses them too: the check never turns away what it would accept. */
        ProtobufCMessage *m = protobuf_c_message_unpack(GEN_DESC, NULL, bad[i].n,
                                                        (const uint8_t *)bad[i].b);
        CHECK_MSG(m == NULL, "%s: protobuf-c accepted it", bad[i].what);
        if (m) protobuf_c_message_free_unpacked(m, NULL);
    }
}

/* A message type that contains itself (field 1) and a string (field 2), for depth. */
static const ProtobufCMessageDescriptor self_desc;
static const ProtobufCFieldDescriptor self_fields[2] = {
    {"child", 1, PROTOBUF_C_LABEL_NONE, PROTOBUF_C_TYPE_MESSAGE, 0, 0, &self_desc, NULL, 0, 0, NULL, NULL},
    {"name", 2, PROTOBUF_C_LABEL_NONE, PROTOBUF_C_TYPE_STRING, 0, 0, NULL, NULL, 0, 0, NULL, NULL},
};
static const unsigned self_by_name[2] = {0, 1};
static const ProtobufCIntRange self_ranges[2] = {{1, 0}, {0, 2}};
static const ProtobufCMessageDescriptor self_desc = {
    PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC, "t.Self", "Self", "Self", "t", sizeof(ProtobufCMessage),
    2, self_fields, self_by_name, 1, self_ranges, NULL, NULL, NULL, NULL};

/* depth messages nested through field 1, the innermost holding name. */
static size_t nest(uint8_t *out, int depth, const char *name)
{
    wbuf *w = calloc(2, sizeof *w);
    put_str(&w[0], 2, name);
    for (int d = 0; d < depth; d++) {
        w[1].n = 0;
        put_bytes(&w[1], 1, w[0].b, w[0].n);
        w[0] = w[1];
    }
    size_t n = w[0].n;
    memcpy(out, w[0].b, n);
    free(w);
    return n;
}

static void test_depth(void)
{
    uint8_t b[4096];
    char err[PD_ERR_LEN];
    size_t n = nest(b, 64, "ok");
    CHECK_EQ_INT(rpc_validate_strings(&self_desc, b, n, err), 0);
    n = nest(b, 64, "bad\xc0");
    CHECK_EQ_INT(rpc_validate_strings(&self_desc, b, n, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "child.child.child.");
    CHECK_STR_CONTAINS(err, "not valid UTF-8");
    n = nest(b, 65, "ok");
    CHECK_EQ_INT(rpc_validate_strings(&self_desc, b, n, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "nested more than 64 deep");
    n = nest(b, 1000, "ok");
    CHECK_EQ_INT(rpc_validate_strings(&self_desc, b, n, err), PD_EFORMAT);
}

/* Random corruptions of a valid request: whatever the check calls malformed, protobuf-c
 * refuses too (the check turns nothing away as malformed that the decoder would take). */
static void test_mutations(void)
{
    Pdserve__V1__StoppingCriteria st = PDSERVE__V1__STOPPING_CRITERIA__INIT;
    char *stops[] = {"\n\n", "end"};
    st.n_stop = 2;
    st.stop = stops;
    Pdserve__V1__GenerateRequest q = PDSERVE__V1__GENERATE_REQUEST__INIT;
    q.request_id = "request-42";
    q.prompt = "Once upon a time \xe2\x82\xac";
    q.stopping = &st;
    uint8_t base[256], b[256];
    size_t n = protobuf_c_message_pack(&q.base, base);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    int n_format = 0, n_ok = 0;
    for (int it = 0; it < 20000; it++) {
        memcpy(b, base, n);
        size_t len = n;
        int k = 1 + (int)(x % 3);
        for (int j = 0; j < k; j++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            b[(x >> 8) % n] = (uint8_t)(x >> 40);
        }
        if (x & 1) len = (size_t)((x >> 20) % (n + 1)); /* truncated too */
        int rc = rpc_validate_strings(GEN_DESC, b, len, NULL);
        Pdserve__V1__GenerateRequest *m = pdserve__v1__generate_request__unpack(NULL, len, b);
        if (rc == PD_EFORMAT) {
            n_format++;
            CHECK_MSG(m == NULL, "iteration %d: called malformed, protobuf-c accepted", it);
        }
        if (rc == 0 && m) n_ok++;
        if (m) pdserve__v1__generate_request__free_unpacked(m, NULL);
    }
    CHECK(n_format > 100);
    CHECK(n_ok > 100);
}

int main(void)
{
    test_valid();
    test_bad_utf8();
    test_nul();
    test_malformed();
    test_depth();
    test_mutations();
    return pd_test_result("test_rpc_validate");
}
