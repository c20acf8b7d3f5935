/* test_rpc_reflection.c -- Server reflection (rpc_server_add_reflection) and the descriptor
 * set index under it (rpc_descriptors.c): symbols of the embedded public set (services,
 * methods, messages, fields, oneofs, enums and their values, nested ones), hand-built sets
 * (imports closed transitively, extensions, missing imports, files and symbols there twice),
 * every truncation and a few thousand corruptions of the real set (an error, never a crash),
 * the v1 and v1alpha protos kept wire-identical, and the service itself over the C bidi
 * client on both paths: list, file by name, file by symbol, extensions, unknown names, empty
 * requests, pipelined requests answered in order, half-close. Ends with zero live calls. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rpc/rpc_impl.h"
#include "grpc/reflection/v1/reflection.pb-c.h"
#include "grpc/reflection/v1alpha/reflection.pb-c.h"
#include "pdserve/public_descriptors.h"
#include "pdserve/v1/generation.pb-c.h"
#include "tests/test_util.h"

#define V1 "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
#define V1ALPHA "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

/* ---- a tiny protobuf writer for hand-built descriptor sets ---- */

typedef struct {
    uint8_t b[4096];
    size_t n;
} buf;

static void put_varint(buf *o, uint64_t v)
{
    do {
        uint8_t c = v & 0x7f;
        v >>= 7;
        o->b[o->n++] = (uint8_t)(c | (v ? 0x80 : 0));
    } while (v);
}

static void put_bytes(buf *o, uint32_t field, const void *p, size_t n)
{
    put_varint(o, (uint64_t)field << 3 | 2);
    put_varint(o, n);
    memcpy(o->b + o->n, p, n);
    o->n += n;
}

static void put_str(buf *o, uint32_t field, const char *s) { put_bytes(o, field, s, strlen(s)); }
static void put_buf(buf *o, uint32_t field, const buf *m) { put_bytes(o, field, m->b, m->n); }

static void put_int(buf *o, uint32_t field, uint64_t v)
{
    put_varint(o, (uint64_t)field << 3);
    put_varint(o, v);
}

/* FileDescriptorProto{name, package, dependency..., message_type{name, field{name}}} */
static void make_file(buf *o, const char *name, const char *pkg, const char *msg,
                      const char *dep1, const char *dep2)
{
    buf m = {.n = 0}, fld = {.n = 0};
    memset(o, 0, sizeof *o);
    put_str(o, 1, name);
    if (pkg) put_str(o, 2, pkg);
    if (dep1) put_str(o, 3, dep1);
    if (dep2) put_str(o, 3, dep2);
    if (msg) {
        put_str(&fld, 1, "f");
        put_int(&fld, 3, 1);
        put_str(&m, 1, msg);
        put_buf(&m, 2, &fld);
        put_buf(o, 4, &m);
    }
}

static int make_set(const buf *const *files, int n, buf *set, char *err)
{
    memset(set, 0, sizeof *set);
    for (int i = 0; i < n; i++) put_buf(set, 1, files[i]);
    rpc__fds *f = NULL;
    int rc = rpc__fds_create(set->b, set->n, &f, err);
    rpc__fds_free(f);
    return rc;
}

/* ---- the index ---- */

static void test_public_set(void)
{
    rpc__fds *f = NULL;
    char err[PD_ERR_LEN] = "";
    CHECK_EQ_INT(rpc__fds_create(pd_public_descriptor_set, pd_public_descriptor_set_len, &f, err),
                 0);
    if (!f) return;
    CHECK_EQ_INT(rpc__fds_n_files(f), 4);
    int gen = rpc__fds_find_file(f, "pdserve/v1/generation.proto");
    int health = rpc__fds_find_file(f, "grpc/health/v1/health.proto");
    int v1 = rpc__fds_find_file(f, "grpc/reflection/v1/reflection.proto");
    int v1a = rpc__fds_find_file(f, "grpc/reflection/v1alpha/reflection.proto");
    CHECK(gen >= 0 && health >= 0 && v1 >= 0 && v1a >= 0);
    CHECK_EQ_INT(rpc__fds_find_file(f, "pdserve/internal/v1/decode.proto"), -1);
    CHECK_EQ_INT(rpc__fds_find_file(f, "generation.proto"), -1);
    struct {
        const char *sym;
        int file;
        bool is_message;
    } cases[] = {
        {"pdserve.v1.Generation", gen, false},
        {"pdserve.v1.Generation.Generate", gen, false},
        {"pdserve.v1.Generation.GetModelInfo", gen, false},
        {"pdserve.v1.GenerateRequest", gen, true},
        {".pdserve.v1.GenerateRequest", gen, true},
        {"pdserve.v1.GenerateRequest.prompt", gen, false},
        {"pdserve.v1.SamplingParams.temperature_set", gen, false}, /* a oneof */
        {"pdserve.v1.FinishReason", gen, false},
        {"pdserve.v1.FINISH_REASON_EOS", gen, false},              /* enum values: siblings */
        {"grpc.health.v1.Health.Watch", health, false},
        {"grpc.health.v1.HealthCheckResponse.ServingStatus", health, false}, /* nested enum */
        {"grpc.health.v1.HealthCheckResponse.SERVING", health, false},
        {"grpc.reflection.v1.ServerReflection.ServerReflectionInfo", v1, false},
        {"grpc.reflection.v1alpha.ServerReflectionRequest", v1a, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bool is_msg = !cases[i].is_message;
        int got = rpc__fds_find_symbol(f, cases[i].sym, &is_msg);
        CHECK_MSG(got == cases[i].file && is_msg == cases[i].is_message, "%s: file %d (want %d)\n",
                  cases[i].sym, got, cases[i].file);
    }
    const char *unknown[] = {"pdserve.v1", "pdserve", "pdserve.v1.Nope", "Generation",
                             "pdserve.v1.FinishReason.FINISH_REASON_EOS", "",
                             "pdserve.internal.v1.Decode", "pdserve.v1.Generation.Generate.x"};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++)
        CHECK_MSG(rpc__fds_find_symbol(f, unknown[i], NULL) == -1, "%s\n", unknown[i]);
    int order[4];
    CHECK_EQ_INT(rpc__fds_closure(f, gen, order), 1); /* it imports nothing */
    CHECK_EQ_INT(order[0], gen);
    CHECK_EQ_INT(rpc__fds_extension_numbers(f, "pdserve.v1.GenerateRequest", NULL, 0), 0);
    CHECK_EQ_INT(rpc__fds_find_extension(f, "pdserve.v1.GenerateRequest", 100), -1);
    rpc__fds_free(f);
    rpc__fds_free(NULL);
}

static void test_built_sets(void)
{
    char err[PD_ERR_LEN] = "";
    buf a, b, c, set;
    /* a imports b and c, b imports c: a's closure is a, b, c, each once. */
    make_file(&a, "a.proto", "p.a", "A", "b.proto", "c.proto");
    make_file(&b, "b.proto", "p.b", "B", "c.proto", NULL);
    make_file(&c, "c.proto", NULL, "C", NULL, NULL); /* no package */
    /* c also extends p.a.A with field 100 "ext" and 7 "seven" (p.a.A is a's, c imports a:
     * not realistic, but the index checks names, not types). */
    buf x = {.n = 0};
    put_str(&x, 1, "ext");
    put_str(&x, 2, ".p.a.A");
    put_int(&x, 3, 100);
    put_buf(&c, 7, &x);
    memset(&x, 0, sizeof x);
    put_str(&x, 1, "seven");
    put_str(&x, 2, "p.a.A");
    put_int(&x, 3, 7);
    put_buf(&c, 7, &x);
    const buf *files[] = {&c, &b, &a};
    CHECK_EQ_INT(make_set(files, 3, &set, err), 0);
    rpc__fds *f = NULL;
    CHECK_EQ_INT(rpc__fds_create(set.b, set.n, &f, err), 0);
    if (f) {
        int ia = rpc__fds_find_file(f, "a.proto"), ib = rpc__fds_find_file(f, "b.proto"),
            ic = rpc__fds_find_file(f, "c.proto");
        int order[3];
        CHECK_EQ_INT(rpc__fds_closure(f, ia, order), 3);
        CHECK(order[0] == ia && order[1] == ib && order[2] == ic);
        CHECK_EQ_INT(rpc__fds_closure(f, ib, order), 2);
        CHECK_EQ_INT(rpc__fds_find_symbol(f, "C", NULL), ic);
        CHECK_EQ_INT(rpc__fds_find_symbol(f, "C.f", NULL), ic);
        CHECK_EQ_INT(rpc__fds_find_symbol(f, "p.b.B.f", NULL), ib);
        CHECK_EQ_INT(rpc__fds_find_symbol(f, "ext", NULL), ic);
        CHECK_EQ_INT(rpc__fds_find_extension(f, "p.a.A", 100), ic);
        CHECK_EQ_INT(rpc__fds_find_extension(f, ".p.a.A", 7), ic);
        CHECK_EQ_INT(rpc__fds_find_extension(f, "p.a.A", 8), -1);
        int32_t nums[4] = {0};
        CHECK_EQ_INT(rpc__fds_extension_numbers(f, "p.a.A", nums, 4), 2);
        CHECK(nums[0] + nums[1] == 107);
        rpc__fds_free(f);
    }
    /* An import missing from the set. */
    const buf *no_c[] = {&b, &a};
    CHECK_EQ_INT(make_set(no_c, 2, &set, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "b.proto imports c.proto, which is not in the set");
    /* A file twice; a symbol twice. */
    const buf *twice[] = {&c, &c};
    CHECK_EQ_INT(make_set(twice, 2, &set, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "there twice");
    buf c2;
    make_file(&c2, "c2.proto", NULL, "C", NULL, NULL);
    const buf *dup[] = {&c, &c2};
    CHECK_EQ_INT(make_set(dup, 2, &set, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "C is defined twice (in c.proto and c2.proto)");
    /* A file without a name; a message without one; a name with a dot. */
    buf bad = {.n = 0};
    put_str(&bad, 2, "pkg");
    const buf *nameless[] = {&bad};
    CHECK_EQ_INT(make_set(nameless, 1, &set, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "a file without a name");
    make_file(&bad, "d.proto", "p", "D.E", NULL, NULL);
    CHECK_EQ_INT(make_set(nameless, 1, &set, err), PD_EFORMAT);
    /* Empty: nothing to serve, but a valid set. */
    CHECK_EQ_INT(make_set(NULL, 0, &set, err), 0);
    /* Field 1 as a varint. */
    uint8_t v[] = {0x08, 0x01};
    rpc__fds *g = NULL;
    CHECK_EQ_INT(rpc__fds_create(v, sizeof v, &g, err), PD_EFORMAT);
    CHECK(g == NULL);
}

static void test_corrupt_sets(void)
{
    char err[PD_ERR_LEN];
    const uint8_t *s = pd_public_descriptor_set;
    size_t n = pd_public_descriptor_set_len;
    int ok = 0, bad = 0, other = 0;
    for (size_t len = 0; len < n; len++) { /* every truncation */
        rpc__fds *f = NULL;
        int rc = rpc__fds_create(s, len, &f, err);
        if (rc == 0) ok++;
        else if (rc == PD_EFORMAT) bad++;
        else other++;
        rpc__fds_free(f);
    }
    CHECK_EQ_INT(other, 0);
    CHECK(ok >= 1 && bad > (int)n / 2); /* whole files are fine; cuts inside one are not */
    uint8_t *c = malloc(n);
    uint64_t r = 12345;
    for (int it = 0; it < 3000 && c; it++) { /* 1 to 4 random bytes changed */
        memcpy(c, s, n);
        for (int k = 0; k < 1 + it % 4; k++) {
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            c[(r >> 33) % n] = (uint8_t)(r >> 17);
        }
        rpc__fds *f = NULL;
        int rc = rpc__fds_create(c, n, &f, err);
        if (rc != 0 && rc != PD_EFORMAT) other++;
        rpc__fds_free(f);
    }
    CHECK_EQ_INT(other, 0);
    free(c);
}

/* The two versions must stay wire-identical (the server answers both with the v1 types). */
static void test_versions_match(void)
{
    const ProtobufCMessageDescriptor *v1[] = {
        &grpc__reflection__v1__server_reflection_request__descriptor,
        &grpc__reflection__v1__extension_request__descriptor,
        &grpc__reflection__v1__server_reflection_response__descriptor,
        &grpc__reflection__v1__file_descriptor_response__descriptor,
        &grpc__reflection__v1__extension_number_response__descriptor,
        &grpc__reflection__v1__list_service_response__descriptor,
        &grpc__reflection__v1__service_response__descriptor,
        &grpc__reflection__v1__error_response__descriptor};
    const ProtobufCMessageDescriptor *v1a[] = {
        &grpc__reflection__v1alpha__server_reflection_request__descriptor,
        &grpc__reflection__v1alpha__extension_request__descriptor,
        &grpc__reflection__v1alpha__server_reflection_response__descriptor,
        &grpc__reflection__v1alpha__file_descriptor_response__descriptor,
        &grpc__reflection__v1alpha__extension_number_response__descriptor,
        &grpc__reflection__v1alpha__list_service_response__descriptor,
        &grpc__reflection__v1alpha__service_response__descriptor,
        &grpc__reflection__v1alpha__error_response__descriptor};
    for (int i = 0; i < 8; i++) {
        CHECK(strcmp(v1[i]->short_name, v1a[i]->short_name) == 0);
        CHECK_EQ_INT(v1[i]->n_fields, v1a[i]->n_fields);
        for (unsigned k = 0; k < v1[i]->n_fields && k < v1a[i]->n_fields; k++) {
            const ProtobufCFieldDescriptor *a = &v1[i]->fields[k], *b = &v1a[i]->fields[k];
            CHECK_MSG(strcmp(a->name, b->name) == 0 && a->id == b->id && a->type == b->type &&
                      a->label == b->label && a->offset == b->offset,
                      "%s.%s\n", v1[i]->short_name, a->name);
        }
    }
    CHECK_EQ_INT(grpc__reflection__v1__server_reflection__descriptor.n_methods, 1);
    CHECK_EQ_INT(grpc__reflection__v1alpha__server_reflection__descriptor.n_methods, 1);
}

/* ---- the service ---- */

typedef Grpc__Reflection__V1__ServerReflectionRequest req_t;
typedef Grpc__Reflection__V1__ServerReflectionResponse resp_t;

static void on_tokenize(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    Pdserve__V1__TokenizeResponse r = PDSERVE__V1__TOKENIZE_RESPONSE__INIT;
    rpc_call_reply(call, &r.base);
}

static rpc_client_stream *refl_open(rpc_channel *ch, const char *path)
{
    rpc_call_opts o = {.timeout_ms = 10000};
    rpc_client_stream *s = NULL;
    CHECK_EQ_INT(rpc_client_bidi_open(ch, path,
                                      &grpc__reflection__v1__server_reflection_response__descriptor,
                                      &o, &s, NULL), 0);
    return s;
}

/* Sends a request: kind 3 file_by_filename, 4 file_containing_symbol, 6
 * all_extension_numbers_of_type, 7 list_services, 5 file_containing_extension (arg, 100), 0
 * nothing. */
static void refl_send(rpc_client_stream *s, int kind, const char *arg)
{
    req_t r = GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__INIT;
    Grpc__Reflection__V1__ExtensionRequest x = GRPC__REFLECTION__V1__EXTENSION_REQUEST__INIT;
    r.host = "localhost";
    r.message_request_case = kind;
    switch (kind) {
    case 3: r.file_by_filename = (char *)arg; break;
    case 4: r.file_containing_symbol = (char *)arg; break;
    case 5:
        x.containing_type = (char *)arg;
        x.extension_number = 100;
        r.file_containing_extension = &x;
        break;
    case 6: r.all_extension_numbers_of_type = (char *)arg; break;
    case 7: r.list_services = "*"; break;
    default: r.message_request_case = 0; break;
    }
    CHECK_EQ_INT(rpc_client_stream_send(s, &r.base), 0);
}

static resp_t *refl_next(rpc_client_stream *s)
{
    ProtobufCMessage *m = NULL;
    CHECK_EQ_INT(rpc_client_stream_next(s, &m), 1);
    resp_t *r = (resp_t *)m;
    if (r) {
        CHECK(strcmp(r->valid_host, "localhost") == 0);
        CHECK(r->original_request != NULL);
    }
    return r;
}

/* Expects one file_descriptor_response with the set's files named in want (in order). */
static void expect_files(resp_t *r, const rpc__fds *f, const char *const *want, int n)
{
    CHECK(r && r->message_response_case ==
                   GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE);
    if (!r || !r->file_descriptor_response) return;
    const Grpc__Reflection__V1__FileDescriptorResponse *fr = r->file_descriptor_response;
    CHECK_EQ_INT(fr->n_file_descriptor_proto, n);
    for (int i = 0; i < n && i < (int)fr->n_file_descriptor_proto; i++) {
        size_t len;
        const uint8_t *b = rpc__fds_file(f, rpc__fds_find_file(f, want[i]), NULL, &len);
        CHECK_MSG(fr->file_descriptor_proto[i].len == len &&
                  memcmp(fr->file_descriptor_proto[i].data, b, len) == 0, "%s\n", want[i]);
    }
}

static void expect_error(resp_t *r, int code, const char *text)
{
    CHECK(r && r->message_response_case ==
                   GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE);
    if (!r || !r->error_response) return;
    CHECK_EQ_INT(r->error_response->error_code, code);
    CHECK_STR_CONTAINS(r->error_response->error_message, text);
}

static void test_service(const char *path, rpc_channel *ch, const rpc__fds *f)
{
    rpc_client_stream *s = refl_open(ch, path);
    refl_send(s, 7, NULL);
    resp_t *r = refl_next(s);
    CHECK(r && r->message_response_case ==
                   GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE);
    if (r && r->list_services_response) {
        const char *want[] = {"grpc.health.v1.Health", "pdserve.v1.Generation",
                              "grpc.reflection.v1.ServerReflection",
                              "grpc.reflection.v1alpha.ServerReflection"};
        const Grpc__Reflection__V1__ListServiceResponse *l = r->list_services_response;
        CHECK_EQ_INT(l->n_service, 4);
        for (size_t i = 0; i < l->n_service && i < 4; i++)
            CHECK(strcmp(l->service[i]->name, want[i]) == 0);
    }
    if (r) protobuf_c_message_free_unpacked(&r->base, NULL);

    /* Pipelined: all sent before any is read; answered in order. */
    refl_send(s, 4, "pdserve.v1.Generation");
    refl_send(s, 4, "pdserve.v1.GenerateResponse.token_ids");
    refl_send(s, 3, "grpc/reflection/v1alpha/reflection.proto");
    refl_send(s, 4, "pdserve.v1.NoSuchThing");
    refl_send(s, 3, "pdserve/internal/v1/decode.proto");
    refl_send(s, 0, NULL);
    refl_send(s, 5, "pdserve.v1.GenerateRequest");
    refl_send(s, 6, "pdserve.v1.GenerateRequest");
    refl_send(s, 6, "pdserve.v1.Generation"); /* a service, not a message */
    const char *gen[] = {"pdserve/v1/generation.proto"};
    const char *v1a[] = {"grpc/reflection/v1alpha/reflection.proto"};
    resp_t *rs[9];
    for (int i = 0; i < 9; i++) rs[i] = refl_next(s);
    expect_files(rs[0], f, gen, 1);
    if (rs[0]) CHECK(strcmp(rs[0]->original_request->file_containing_symbol,
                            "pdserve.v1.Generation") == 0);
    expect_files(rs[1], f, gen, 1);
    expect_files(rs[2], f, v1a, 1);
    expect_error(rs[3], RPC_STATUS_NOT_FOUND, "symbol \"pdserve.v1.NoSuchThing\" not found");
    expect_error(rs[4], RPC_STATUS_NOT_FOUND, "file \"pdserve/internal/v1/decode.proto\"");
    expect_error(rs[5], RPC_STATUS_INVALID_ARGUMENT, "sets none of");
    expect_error(rs[6], RPC_STATUS_NOT_FOUND, "extension 100 of \"pdserve.v1.GenerateRequest\"");
    CHECK(rs[7] && rs[7]->message_response_case ==
                       GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ALL_EXTENSION_NUMBERS_RESPONSE);
    if (rs[7] && rs[7]->all_extension_numbers_response) {
        CHECK(strcmp(rs[7]->all_extension_numbers_response->base_type_name,
                     "pdserve.v1.GenerateRequest") == 0);
        CHECK_EQ_INT(rs[7]->all_extension_numbers_response->n_extension_number, 0);
    }
    expect_error(rs[8], RPC_STATUS_NOT_FOUND, "message type \"pdserve.v1.Generation\"");
    for (int i = 0; i < 9; i++)
        if (rs[i]) protobuf_c_message_free_unpacked(&rs[i]->base, NULL);

    CHECK_EQ_INT(rpc_client_stream_close_send(s), 0);
    ProtobufCMessage *m = NULL;
    CHECK_EQ_INT(rpc_client_stream_next(s, &m), 0);
    rpc_status st;
    CHECK_EQ_INT(rpc_client_stream_status(s, &st), RPC_STATUS_OK);
    rpc_client_stream_close(s);

    /* A request that is not a ServerReflectionRequest ends the call. */
    s = refl_open(ch, path);
    Pdserve__V1__TokenizeRequest junk = PDSERVE__V1__TOKENIZE_REQUEST__INIT;
    junk.text = "\xff"; /* field 1 (host) as a string that is not UTF-8 */
    CHECK_EQ_INT(rpc_client_stream_send(s, &junk.base), 0);
    CHECK_EQ_INT(rpc_client_stream_status(s, &st), RPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR_CONTAINS(st.details, "host: not valid UTF-8");
    rpc_client_stream_close(s);
}

int main(void)
{
    test_public_set();
    test_built_sets();
    test_corrupt_sets();
    test_versions_match();

    char err[PD_ERR_LEN] = "";
    rpc_server_params p = rpc_server_default_params();
    p.listen_addr = "127.0.0.1:0";
    rpc_server *srv = NULL;
    /* Malformed set: refused, nothing registered; then the real one; then twice. */
    CHECK_EQ_INT(rpc_server_create(&p, &srv, err), 0);
    CHECK_EQ_INT(rpc_server_register(srv, &pdserve__v1__generation__descriptor, "Tokenize",
                                     RPC_UNARY, on_tokenize, NULL, err), 0);
    CHECK_EQ_INT(rpc_server_add_reflection(srv, pd_public_descriptor_set, 100, err), PD_EFORMAT);
    CHECK_EQ_INT(rpc_server_add_reflection(srv, pd_public_descriptor_set,
                                           pd_public_descriptor_set_len, err), 0);
    CHECK_EQ_INT(rpc_server_add_reflection(srv, pd_public_descriptor_set,
                                           pd_public_descriptor_set_len, err), PD_ESTATE);
    CHECK_EQ_INT(rpc_server_start(srv, err), 0);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = addr;
    rpc_channel *ch = NULL;
    CHECK_EQ_INT(rpc_channel_create(&cp, &ch, err), 0);
    rpc__fds *f = NULL;
    CHECK_EQ_INT(rpc__fds_create(pd_public_descriptor_set, pd_public_descriptor_set_len, &f, err),
                 0);
    test_service(V1, ch, f);
    test_service(V1ALPHA, ch, f);
    rpc__fds_free(f);
    rpc_channel_destroy(ch);
    CHECK_EQ_INT(rpc_server_shutdown(srv), 0);
    CHECK_EQ_INT(rpc_server_live_calls(srv), 0);
    rpc_server_destroy(srv);

    /* A path taken already. */
    CHECK_EQ_INT(rpc_server_create(&p, &srv, err), 0);
    CHECK_EQ_INT(rpc_server_register_path(srv, V1ALPHA, NULL,
                                          &grpc__reflection__v1__server_reflection_request__descriptor,
                                          RPC_BIDI_STREAMING, on_tokenize, NULL, err), 0);
    CHECK_EQ_INT(rpc_server_add_reflection(srv, pd_public_descriptor_set,
                                           pd_public_descriptor_set_len, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "registered twice");
    rpc_server_destroy(srv);
    return pd_test_result("test_rpc_reflection");
}
