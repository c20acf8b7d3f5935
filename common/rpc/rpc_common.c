/* rpc_common.c -- Pieces shared by the server and client halves of the gRPC layer: status
 * names, protobuf-c <-> grpc_byte_buffer conversion, deadlines, and routing gRPC's own log
 * lines into common/log.h. */
#include "common/rpc/rpc_impl.h"

#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>
#include <grpc/support/log.h>

#include "common/log.h"

_Static_assert(RPC_STATUS_OK == (int)GRPC_STATUS_OK, "status codes");
_Static_assert(RPC_STATUS_DEADLINE_EXCEEDED == (int)GRPC_STATUS_DEADLINE_EXCEEDED, "codes");
_Static_assert(RPC_STATUS_RESOURCE_EXHAUSTED == (int)GRPC_STATUS_RESOURCE_EXHAUSTED, "codes");
_Static_assert(RPC_STATUS_UNIMPLEMENTED == (int)GRPC_STATUS_UNIMPLEMENTED, "codes");
_Static_assert(RPC_STATUS_UNAUTHENTICATED == (int)GRPC_STATUS_UNAUTHENTICATED, "codes");

const char *rpc_status_name(int code)
{
    static const char *names[] = {
        "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
        "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
        "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
        "UNAUTHENTICATED"};
    if (code < 0 || code >= (int)(sizeof names / sizeof names[0])) return "UNKNOWN_CODE";
    return names[code];
}

static void grpc_log_to_pd(gpr_log_func_args *a)
{
    pd_log_level l = a->severity == GPR_LOG_SEVERITY_ERROR  ? PD_LOG_ERROR
                     : a->severity == GPR_LOG_SEVERITY_INFO ? PD_LOG_INFO
                                                            : PD_LOG_DEBUG;
    const char *file = a->file ? strrchr(a->file, '/') : NULL;
    pd_log(l, "grpc: %s (%s:%d)", a->message, file ? file + 1 : a->file, a->line);
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void global_init_once(void) { gpr_set_log_function(grpc_log_to_pd); }

void rpc__global_init(void) { pthread_once(&g_once, global_init_once); }

int rpc__encode(const ProtobufCMessage *msg, int max_bytes, grpc_byte_buffer **out)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    if (max_bytes > 0 && n > (size_t)max_bytes) return PD_EINVAL;
    grpc_slice s = grpc_slice_malloc(n);
    if (n) protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    *out = grpc_raw_byte_buffer_create(&s, 1); /* takes its own reference */
    grpc_slice_unref(s);
    return *out ? 0 : PD_ENOMEM;
}

int rpc__decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc,
                ProtobufCMessage **out)
{
    *out = NULL;
    if (!bb) return PD_EINVAL;
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb)) return PD_EFORMAT;
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    /* Small slices are inlined: START_PTR points into s, which lives until the unref. */
    *out = protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    grpc_byte_buffer_reader_destroy(&r);
    return *out ? 0 : PD_EFORMAT;
}

gpr_timespec rpc__deadline_from_ms(int64_t timeout_ms)
{
    if (timeout_ms <= 0) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

void rpc__copy_slice(char *dst, size_t len, grpc_slice s)
{
    if (!len) return;
    size_t n = GRPC_SLICE_LENGTH(s);
    if (n >= len) n = len - 1;
    memcpy(dst, GRPC_SLICE_START_PTR(s), n);
    dst[n] = '\0';
}
