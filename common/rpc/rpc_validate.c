/* rpc_validate.c -- Checks the strings of an encoded protobuf message before protobuf-c
 * decodes it: proto3 strings must be valid UTF-8, and protobuf-c hands them out as
 * NUL-terminated char *, so a NUL inside one would silently cut it. The wire format is walked
 * with the message descriptor (nested messages recursively, unknown fields skipped). The
 * server decodes every request through rpc__decode_request, which runs the check first. */
#include "common/rpc/rpc_impl.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>

#define MAX_DEPTH 64          /* nesting deeper than this is refused (stack bound) */
#define MAX_COUNTED 64        /* fields whose occurrences are numbered in paths ("stop[2]") */
#define PATH_LEN 256

typedef struct {
    char *err;                /* PD_ERR_LEN, may be NULL */
    char path[PATH_LEN];      /* dotted path of the field being checked */
} walker;

/* Returns the offset of the first byte that breaks UTF-8 (RFC 3629: no overlong forms, no
 * surrogates, nothing above U+10FFFF, no truncated sequence), or len when s is valid. */
static size_t utf8_bad_offset(const uint8_t *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t n;
        uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
        if (c >= 0xC2 && c <= 0xDF) {
            n = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 3;
            if (c == 0xE0) lo = 0xA0;      /* overlong */
            else if (c == 0xED) hi = 0x9F; /* surrogates U+D800..U+DFFF */
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 4;
            if (c == 0xF0) lo = 0x90;      /* overlong */
            else if (c == 0xF4) hi = 0x8F; /* above U+10FFFF */
        } else {
            return i;                      /* continuation byte, C0/C1 (overlong), F5..FF */
        }
        if (len - i < n) return i;
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k < n; k++)
            if ((s[i + k] & 0xC0) != 0x80) return i;
        i += n;
    }
    return len;
}

/* Reads a varint at *p (< end); advances *p. Returns 0, or -1 when truncated or longer than
 * 10 bytes. */
static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (*p >= end) return -1;
        uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7F) << (shift < 64 ? shift : 63);
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* Formats "<path>: <message>" into w->err and returns code. */
static int fail(walker *w, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int fail(walker *w, int code, const char *fmt, ...)
{
    if (w->err) {
        char m[PD_ERR_LEN - PATH_LEN - 8];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m, sizeof m, fmt, ap);
        va_end(ap);
        pd_errf(w->err, code, "%s%s%s", w->path, w->path[0] ? ": " : "", m);
    }
    return code;
}

static int walk(walker *w, const ProtobufCMessageDescriptor *desc, const uint8_t *p,
                const uint8_t *end, int depth)
{
    if (depth > MAX_DEPTH)
        return fail(w, PD_EFORMAT, "messages nested more than %d deep", MAX_DEPTH);
    uint32_t seen[MAX_COUNTED] = {0};
    size_t path_len = strlen(w->path);
    const uint8_t *start = p;
    while (p < end) {
        size_t at = (size_t)(p - start);
        uint64_t tag;
        const uint8_t *tag_start = p;
        if (read_varint(&p, end, &tag) < 0 || p - tag_start > 5) /* protobuf-c reads <= 5 */
            return fail(w, PD_EFORMAT, "truncated or overlong field tag at byte %zu", at);
        /* The field number as protobuf-c computes it (32 bits; it sets no upper bound). */
        uint32_t num = (uint32_t)(tag >> 3);
        unsigned wt = (unsigned)(tag & 7);
        if ((*tag_start & 0xF8) == 0) /* field 0 in one byte (protobuf-c checks that byte only) */
            return fail(w, PD_EFORMAT, "field number 0 at byte %zu", at);
        const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(desc, num);
        uint64_t v, len = 0;
        const uint8_t *val = NULL; /* a length-delimited value: [val, val + len) */
        switch (wt) {
        case 0:
            if (read_varint(&p, end, &v) < 0)
                return fail(w, PD_EFORMAT, "truncated or overlong varint at byte %zu", at);
            break;
        case 1:
        case 5:
            if ((size_t)(end - p) < (wt == 1 ? 8u : 4u))
                return fail(w, PD_EFORMAT, "truncated fixed-size field at byte %zu", at);
            p += wt == 1 ? 8 : 4;
            break;
        case 2:
            if (read_varint(&p, end, &len) < 0 || len > (uint64_t)(end - p))
                return fail(w, PD_EFORMAT, "truncated length-delimited field at byte %zu", at);
            val = p;
            p += len;
            break;
        default: /* groups (3, 4: protobuf-c refuses them too) and 6, 7 */
            return fail(w, PD_EFORMAT, "unsupported wire type %u at byte %zu", wt, at);
        }
        bool is_str = f && f->type == PROTOBUF_C_TYPE_STRING;
        bool is_msg = f && f->type == PROTOBUF_C_TYPE_MESSAGE;
        if (!is_str && !is_msg) continue; /* scalars, bytes, packed arrays, unknown fields */
        if (wt != 2) {
            snprintf(w->path + path_len, PATH_LEN - path_len, "%s%s", path_len ? "." : "", f->name);
            return fail(w, PD_EFORMAT, "wire type %u where a %s is expected", wt,
                        is_str ? "string" : "message");
        }
        /* The field's path: "stopping.stop[2]" for repeated fields. */
        size_t idx = (size_t)(f - desc->fields);
        if (f->label == PROTOBUF_C_LABEL_REPEATED && idx < MAX_COUNTED)
            snprintf(w->path + path_len, PATH_LEN - path_len, "%s%s[%u]", path_len ? "." : "",
                     f->name, seen[idx]++);
        else
            snprintf(w->path + path_len, PATH_LEN - path_len, "%s%s", path_len ? "." : "", f->name);
        if (is_str) {
            const uint8_t *nul = memchr(val, 0, (size_t)len);
            size_t bad = utf8_bad_offset(val, (size_t)len);
            if (nul && (size_t)(nul - val) <= bad)
                return fail(w, PD_EINVAL, "contains a NUL byte at offset %zu", (size_t)(nul - val));
            if (bad < len)
                return fail(w, PD_EINVAL, "not valid UTF-8 (at byte offset %zu)", bad);
        } else {
            int rc = walk(w, f->descriptor, val, val + len, depth + 1);
            if (rc < 0) return rc;
        }
        w->path[path_len] = 0;
    }
    return 0;
}

int rpc_validate_strings(const ProtobufCMessageDescriptor *desc, const void *buf, size_t len,
                         char *err)
{
    if (!desc || (!buf && len)) return pd_errf(err, PD_EINVAL, "no descriptor or no bytes");
    walker w;
    w.err = err;
    w.path[0] = 0;
    const uint8_t *p = buf;
    return walk(&w, desc, p, p + len, 0);
}

int rpc__decode_request(grpc_byte_buffer *bb, const rpc__method *m, ProtobufCMessage **out,
                        char *msg)
{
    *out = NULL;
    if (!bb) return pd_errf(msg, PD_EINVAL, "%s: the request message is missing", m->path);
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return pd_errf(msg, PD_EFORMAT, "%s: the request is not a valid %s message", m->path,
                       m->req_desc->name);
    grpc_slice s = grpc_byte_buffer_reader_readall(&r); /* the bytes, read once */
    grpc_byte_buffer_reader_destroy(&r);
    const uint8_t *p = GRPC_SLICE_START_PTR(s);
    size_t n = GRPC_SLICE_LENGTH(s);
    char why[PD_ERR_LEN];
    int rc = rpc_validate_strings(m->req_desc, p, n, why);
    if (rc == PD_EINVAL) {
        pd_errf(msg, rc, "%s", why); /* "prompt: contains a NUL byte at offset 12" */
    } else if (rc < 0) {
        pd_errf(msg, rc, "%s: the request is not a valid %s message (%.300s)", m->path,
                m->req_desc->name, why);
    } else {
        *out = protobuf_c_message_unpack(m->req_desc, NULL, n, p);
        if (!*out)
            rc = pd_errf(msg, PD_EFORMAT, "%s: the request is not a valid %s message", m->path,
                         m->req_desc->name);
    }
    grpc_slice_unref(s);
    return rc;
}
