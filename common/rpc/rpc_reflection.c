/* rpc_reflection.c -- gRPC server reflection (grpc.reflection.v1 and v1alpha
 * ServerReflection/ServerReflectionInfo, a bidi stream) over a FileDescriptorSet indexed by
 * rpc_descriptors.c: every request is answered by one response, in order. The two versions
 * have the same wire format, so both are decoded and answered with the v1 types. */
#include "common/rpc/rpc_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "grpc/reflection/v1/reflection.pb-c.h"

#define REFL_METHOD "ServerReflectionInfo"

typedef Grpc__Reflection__V1__ServerReflectionRequest refl_req;
typedef Grpc__Reflection__V1__ServerReflectionResponse refl_resp;

static const char *const k_services[] = {"grpc.reflection.v1.ServerReflection",
                                         "grpc.reflection.v1alpha.ServerReflection"};

/* Fills resp with an error_response. */
static void set_error(refl_resp *resp, Grpc__Reflection__V1__ErrorResponse *e, int code,
                      char *msg)
{
    e->error_code = code;
    e->error_message = msg;
    resp->message_response_case =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
    resp->error_response = e;
}

/* Sends the answer to one request; a failure to queue it ends the call. */
static void send_or_end(rpc_call *call, refl_resp *resp)
{
    int rc = rpc_stream_send(call, &resp->base);
    if (rc == PD_ENOSPC)
        rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED,
                          "reflection: too many responses queued; read them before asking more");
    else if (rc == PD_EINVAL)
        rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED,
                          "reflection: the response is larger than the server's send limit");
    else if (rc == PD_ENOMEM)
        rpc_stream_finish(call, RPC_STATUS_RESOURCE_EXHAUSTED, "reflection: out of memory");
}

/* A file_descriptor_response with file and its imports; or a NOT_FOUND / out-of-memory
 * error_response. Sends it. */
static void answer_file(rpc_call *call, const rpc__fds *f, int file, refl_resp *resp,
                        char *why)
{
    Grpc__Reflection__V1__ErrorResponse e = GRPC__REFLECTION__V1__ERROR_RESPONSE__INIT;
    Grpc__Reflection__V1__FileDescriptorResponse fr =
        GRPC__REFLECTION__V1__FILE_DESCRIPTOR_RESPONSE__INIT;
    int n_files = rpc__fds_n_files(f);
    int *order = file >= 0 ? malloc((size_t)n_files * sizeof *order) : NULL;
    ProtobufCBinaryData *blobs = file >= 0 ? malloc((size_t)n_files * sizeof *blobs) : NULL;
    int n = order && blobs ? rpc__fds_closure(f, file, order) : PD_ENOMEM;
    if (file < 0) {
        set_error(resp, &e, RPC_STATUS_NOT_FOUND, why);
    } else if (n < 0) {
        set_error(resp, &e, RPC_STATUS_RESOURCE_EXHAUSTED, "reflection: out of memory");
    } else {
        for (int i = 0; i < n; i++) blobs[i].data = (uint8_t *)rpc__fds_file(f, order[i], NULL,
                                                                              &blobs[i].len);
        fr.n_file_descriptor_proto = (size_t)n;
        fr.file_descriptor_proto = blobs;
        resp->message_response_case = GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE;
        resp->file_descriptor_response = &fr;
    }
    send_or_end(call, resp);
    free(order);
    free(blobs);
}

static void answer_list(rpc_call *call, const rpc_server *s, refl_resp *resp)
{
    Grpc__Reflection__V1__ListServiceResponse lr = GRPC__REFLECTION__V1__LIST_SERVICE_RESPONSE__INIT;
    Grpc__Reflection__V1__ServiceResponse *items = calloc((size_t)s->n_services, sizeof *items);
    Grpc__Reflection__V1__ServiceResponse **ptrs = calloc((size_t)s->n_services, sizeof *ptrs);
    Grpc__Reflection__V1__ErrorResponse e = GRPC__REFLECTION__V1__ERROR_RESPONSE__INIT;
    if (!items || !ptrs) {
        set_error(resp, &e, RPC_STATUS_RESOURCE_EXHAUSTED, "reflection: out of memory");
    } else {
        /* The services registered on the server (names fixed since it started). */
        for (int i = 0; i < s->n_services; i++) {
            grpc__reflection__v1__service_response__init(&items[i]);
            items[i].name = s->services[i];
            ptrs[i] = &items[i];
        }
        lr.n_service = (size_t)s->n_services;
        lr.service = ptrs;
        resp->message_response_case =
            GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE;
        resp->list_services_response = &lr;
    }
    send_or_end(call, resp);
    free(items);
    free(ptrs);
}

static void answer_ext_numbers(rpc_call *call, const rpc__fds *f, const char *type,
                               refl_resp *resp)
{
    Grpc__Reflection__V1__ErrorResponse e = GRPC__REFLECTION__V1__ERROR_RESPONSE__INIT;
    Grpc__Reflection__V1__ExtensionNumberResponse xr =
        GRPC__REFLECTION__V1__EXTENSION_NUMBER_RESPONSE__INIT;
    char msg[PD_ERR_LEN];
    bool is_message = false;
    int32_t *nums = NULL;
    if (rpc__fds_find_symbol(f, type, &is_message) < 0 || !is_message) {
        snprintf(msg, sizeof msg, "message type \"%s\" not found", type);
        set_error(resp, &e, RPC_STATUS_NOT_FOUND, msg);
    } else {
        /* A known type: its extension numbers, none for proto3 types (as gRPC's servers). */
        int n = rpc__fds_extension_numbers(f, type, NULL, 0);
        if (n > 0 && !(nums = malloc((size_t)n * sizeof *nums))) {
            set_error(resp, &e, RPC_STATUS_RESOURCE_EXHAUSTED, "reflection: out of memory");
        } else {
            if (n > 0) rpc__fds_extension_numbers(f, type, nums, n);
            xr.base_type_name = (char *)(type[0] == '.' ? type + 1 : type);
            xr.n_extension_number = (size_t)n;
            xr.extension_number = nums;
            resp->message_response_case = GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ALL_EXTENSION_NUMBERS_RESPONSE;
            resp->all_extension_numbers_response = &xr;
        }
    }
    send_or_end(call, resp);
    free(nums);
}

/* One request of the stream (req NULL: the client is done; the call ends OK). */
static void on_reflection_info(rpc_call *call, const ProtobufCMessage *msg, void *user)
{
    rpc_server *s = user;
    const rpc__fds *f = s->reflection;
    if (!msg) {
        rpc_stream_finish(call, RPC_STATUS_OK, NULL);
        return;
    }
    const refl_req *req = (const void *)msg;
    refl_resp resp = GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__INIT;
    resp.valid_host = req->host;
    resp.original_request = (refl_req *)req;
    Grpc__Reflection__V1__ErrorResponse e = GRPC__REFLECTION__V1__ERROR_RESPONSE__INIT;
    char why[PD_ERR_LEN];
    switch (req->message_request_case) {
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_BY_FILENAME:
        snprintf(why, sizeof why, "file \"%s\" not found", req->file_by_filename);
        answer_file(call, f, rpc__fds_find_file(f, req->file_by_filename), &resp, why);
        return;
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_SYMBOL:
        snprintf(why, sizeof why, "symbol \"%s\" not found", req->file_containing_symbol);
        answer_file(call, f, rpc__fds_find_symbol(f, req->file_containing_symbol, NULL), &resp,
                    why);
        return;
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_EXTENSION: {
        const Grpc__Reflection__V1__ExtensionRequest *x = req->file_containing_extension;
        const char *type = x && x->containing_type ? x->containing_type : "";
        int32_t number = x ? x->extension_number : 0;
        snprintf(why, sizeof why, "extension %d of \"%s\" not found", (int)number, type);
        answer_file(call, f, rpc__fds_find_extension(f, type, number), &resp, why);
        return;
    }
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_ALL_EXTENSION_NUMBERS_OF_TYPE:
        answer_ext_numbers(call, f, req->all_extension_numbers_of_type, &resp);
        return;
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES:
        answer_list(call, s, &resp);
        return;
    default:
        snprintf(why, sizeof why, "the request sets none of file_by_filename, "
                 "file_containing_symbol, file_containing_extension, "
                 "all_extension_numbers_of_type, list_services");
        set_error(&resp, &e, RPC_STATUS_INVALID_ARGUMENT, why);
        send_or_end(call, &resp);
        return;
    }
}

int rpc_server_add_reflection(rpc_server *s, const void *descriptor_set, size_t len, char *err)
{
    if (s->started) return pd_errf(err, PD_ESTATE, "rpc server: reflection added after start");
    if (s->reflection) return pd_errf(err, PD_ESTATE, "rpc server: reflection added twice");
    if (!descriptor_set && len) return pd_errf(err, PD_EINVAL, "rpc server: no descriptor set");
    char path[2][128];
    for (int i = 0; i < 2; i++) {
        snprintf(path[i], sizeof path[i], "/%s/" REFL_METHOD, k_services[i]);
        for (int j = 0; j < s->n_methods; j++)
            if (strcmp(s->methods[j]->path, path[i]) == 0)
                return pd_errf(err, PD_EINVAL, "rpc server: %s registered twice", path[i]);
    }
    int rc = rpc__fds_create(descriptor_set, len, &s->reflection, err);
    if (rc != 0) return rc;
    /* The index stays with the server from here on (a method registered before an
     * out-of-memory failure of the next one still answers from it). */
    for (int i = 0; i < 2 && rc == 0; i++)
        rc = rpc_server_register_path(s, path[i], k_services[i],
                                      &grpc__reflection__v1__server_reflection_request__descriptor,
                                      RPC_BIDI_STREAMING, on_reflection_info, s, err);
    if (rc == 0) PD_LOGD("rpc: reflection serves %d files", rpc__fds_n_files(s->reflection));
    return rc;
}
