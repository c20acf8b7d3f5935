/* rpc_descriptors.c -- An index over a serialized google.protobuf.FileDescriptorSet for server
 * reflection (rpc_reflection.c): its files (name, bytes, imports) and the fully-qualified
 * symbols they define (messages and nested messages, fields, oneofs, enums, enum values,
 * services, methods, extensions), read with a small wire-format reader: no protobuf runtime
 * and no descriptor.proto are needed. Only the fields that name things are read:
 * FileDescriptorProto 1 name, 2 package, 3 dependency, 4 message_type, 5 enum_type,
 * 6 service, 7 extension; DescriptorProto 1 name, 2 field, 3 nested_type, 4 enum_type,
 * 6 extension, 8 oneof_decl; EnumDescriptorProto 1 name, 2 value; ServiceDescriptorProto
 * 1 name, 2 method; FieldDescriptorProto 1 name, 2 extendee, 3 number. Everything else is
 * skipped, so options and source info never matter. */
#include "common/rpc/rpc_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64 /* message nesting; protoc's own limit is far above any real file */

typedef struct {
    char *name;                 /* "pdserve/v1/generation.proto" */
    const uint8_t *bytes;       /* the serialized FileDescriptorProto, inside fds->data */
    size_t len;
    char **dep_names;           /* [n_deps] its imports, as written */
    int *deps;                  /* [n_deps] their file indices */
    int n_deps;
} fds_file;

typedef struct {
    char *name;                 /* fully-qualified, no leading dot */
    int file;
    bool is_message;
} fds_symbol;

typedef struct {
    char *extendee;             /* fully-qualified message name, no leading dot */
    int32_t number;
    int file;
} fds_ext;

struct rpc__fds {
    uint8_t *data;              /* a copy of the set */
    size_t len;
    fds_file *files;
    int n_files, cap_files;
    fds_symbol *syms;           /* sorted by name once built */
    int n_syms, cap_syms;
    fds_ext *exts;
    int n_exts, cap_exts;
};

/* ---- wire format ---- */

typedef struct {
    const uint8_t *p, *end;
} wire;

typedef struct {
    uint32_t num;               /* field number */
    int type;                   /* wire type: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32 */
    const uint8_t *val;         /* type 2: the bytes */
    size_t len;
    uint64_t v;                 /* type 0: the value */
} wire_field;

static bool wire_varint(wire *w, uint64_t *v)
{
    uint64_t x = 0;
    for (int shift = 0; shift < 64 && w->p < w->end; shift += 7) {
        uint8_t b = *w->p++;
        x |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = x;
            return true;
        }
    }
    return false;
}

/* Reads the next field. Returns 1, 0 at the end, -1 when malformed (a truncated varint or
 * value, field number 0, a group or an unknown wire type: descriptors use none). */
static int wire_next(wire *w, wire_field *f)
{
    if (w->p >= w->end) return 0;
    uint64_t tag, n;
    if (!wire_varint(w, &tag) || (tag >> 3) == 0 || (tag >> 3) > 0x1fffffff) return -1;
    f->num = (uint32_t)(tag >> 3);
    f->type = (int)(tag & 7);
    switch (f->type) {
    case 0: return wire_varint(w, &f->v) ? 1 : -1;
    case 1: n = 8; break;
    case 5: n = 4; break;
    case 2:
        if (!wire_varint(w, &n) || n > (uint64_t)(w->end - w->p)) return -1;
        f->val = w->p;
        f->len = (size_t)n;
        w->p += n;
        return 1;
    default: return -1;
    }
    if ((uint64_t)(w->end - w->p) < n) return -1;
    w->p += n;
    return 1;
}

/* ---- building ---- */

typedef struct {
    rpc__fds *f;
    int file;                   /* the file being read */
    char *err;
} ctx;

static int bad(ctx *c, const char *what)
{
    const char *file = c->file >= 0 && c->file < c->f->n_files && c->f->files[c->file].name
                           ? c->f->files[c->file].name : "?";
    return pd_errf(c->err, PD_EFORMAT, "descriptor set: %s (file #%d, %s)", what, c->file, file);
}

static int oom(ctx *c) { return pd_errf(c->err, PD_ENOMEM, "descriptor set: out of memory"); }

static bool grow(void **v, int *cap, int n, size_t elem)
{
    if (n < *cap) return true;
    int nc = *cap ? *cap * 2 : 16;
    void *p = realloc(*v, (size_t)nc * elem);
    if (!p) return false;
    *v = p;
    *cap = nc;
    return true;
}

/* A NUL-terminated copy of a string field; NULL (with *rc set) when it holds a NUL byte or
 * memory runs out. */
static char *copy_str(ctx *c, const uint8_t *s, size_t n, int *rc)
{
    if (memchr(s, 0, n)) {
        *rc = bad(c, "a name holds a NUL byte");
        return NULL;
    }
    char *d = malloc(n + 1);
    if (!d) {
        *rc = oom(c);
        return NULL;
    }
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

/* Finds string field 1 (the name of every descriptor message). */
static int find_name(ctx *c, const uint8_t *p, size_t n, const uint8_t **name, size_t *len)
{
    wire w = {p, p + n};
    wire_field fl = {0};
    int r;
    *name = NULL;
    *len = 0;
    while ((r = wire_next(&w, &fl)) == 1) {
        if (fl.num == 1 && fl.type == 2) {
            *name = fl.val;
            *len = fl.len;
        }
    }
    if (r < 0) return bad(c, "malformed wire format");
    if (!*name || *len == 0) return bad(c, "a definition without a name");
    return 0;
}

/* Adds scope.name (name alone at the top of a file without a package) as a symbol of the
 * file being read. *full (may be NULL) receives the stored name. */
static int add_symbol(ctx *c, const char *scope, const uint8_t *name, size_t n, bool is_message,
                      const char **full)
{
    if (memchr(name, 0, n) || memchr(name, '.', n)) return bad(c, "a name holds a NUL or a dot");
    rpc__fds *f = c->f;
    if (!grow((void **)&f->syms, &f->cap_syms, f->n_syms, sizeof *f->syms)) return oom(c);
    size_t sl = strlen(scope);
    char *s = malloc(sl + 1 + n + 1);
    if (!s) return oom(c);
    size_t k = 0;
    if (sl) {
        memcpy(s, scope, sl);
        s[sl] = '.';
        k = sl + 1;
    }
    memcpy(s + k, name, n);
    s[k + n] = 0;
    f->syms[f->n_syms++] = (fds_symbol){s, c->file, is_message};
    if (full) *full = s;
    return 0;
}

/* FieldDescriptorProto, OneofDescriptorProto, EnumValueDescriptorProto, MethodDescriptorProto:
 * a name in scope. */
static int read_named(ctx *c, const char *scope, const uint8_t *p, size_t n)
{
    const uint8_t *name;
    size_t len = 0;
    int rc = find_name(c, p, n, &name, &len);
    return rc ? rc : add_symbol(c, scope, name, len, false, NULL);
}

/* An extension (FieldDescriptorProto with extendee and number): a symbol in scope and an
 * entry of the extension table. */
static int read_extension(ctx *c, const char *scope, const uint8_t *p, size_t n)
{
    int rc = read_named(c, scope, p, n);
    if (rc) return rc;
    wire w = {p, p + n};
    wire_field fl;
    const uint8_t *ext = NULL;
    size_t ext_len = 0;
    int64_t number = -1;
    while (wire_next(&w, &fl) == 1) { /* well-formed: read_named walked it */
        if (fl.num == 2 && fl.type == 2) {
            ext = fl.val;
            ext_len = fl.len;
        } else if (fl.num == 3 && fl.type == 0) {
            number = (int64_t)(int32_t)fl.v;
        }
    }
    if (!ext || ext_len == 0 || number < 1) return bad(c, "an extension without extendee or number");
    if (ext[0] == '.') {
        ext++;
        ext_len--;
    }
    rpc__fds *f = c->f;
    if (!grow((void **)&f->exts, &f->cap_exts, f->n_exts, sizeof *f->exts)) return oom(c);
    char *e = copy_str(c, ext, ext_len, &rc);
    if (!e) return rc;
    f->exts[f->n_exts++] = (fds_ext){e, (int32_t)number, c->file};
    return 0;
}

/* EnumDescriptorProto in scope: the enum, and its values as siblings of the enum (protobuf's
 * C++ scoping: "pkg.VALUE", not "pkg.Enum.VALUE"). */
static int read_enum(ctx *c, const char *scope, const uint8_t *p, size_t n)
{
    const uint8_t *name;
    size_t len = 0;
    int rc = find_name(c, p, n, &name, &len);
    if (rc || (rc = add_symbol(c, scope, name, len, false, NULL))) return rc;
    wire w = {p, p + n};
    wire_field fl;
    while (wire_next(&w, &fl) == 1)
        if (fl.num == 2 && fl.type == 2 && (rc = read_named(c, scope, fl.val, fl.len))) return rc;
    return 0;
}

/* DescriptorProto in scope, with what it nests. */
static int read_message(ctx *c, const char *scope, const uint8_t *p, size_t n, int depth)
{
    if (depth > MAX_DEPTH) return bad(c, "messages nested too deep");
    const uint8_t *name;
    size_t len = 0;
    const char *full;
    int rc = find_name(c, p, n, &name, &len);
    if (rc || (rc = add_symbol(c, scope, name, len, true, &full))) return rc;
    wire w = {p, p + n};
    wire_field fl;
    while (wire_next(&w, &fl) == 1) {
        if (fl.type != 2) continue;
        switch (fl.num) {
        case 2: /* field */
        case 8: rc = read_named(c, full, fl.val, fl.len); break; /* oneof_decl */
        case 3: rc = read_message(c, full, fl.val, fl.len, depth + 1); break;
        case 4: rc = read_enum(c, full, fl.val, fl.len); break;
        case 6: rc = read_extension(c, full, fl.val, fl.len); break;
        default: break;
        }
        if (rc) return rc;
    }
    return 0;
}

/* ServiceDescriptorProto in the package: the service and its methods. */
static int read_service(ctx *c, const char *scope, const uint8_t *p, size_t n)
{
    const uint8_t *name;
    size_t len = 0;
    const char *full;
    int rc = find_name(c, p, n, &name, &len);
    if (rc || (rc = add_symbol(c, scope, name, len, false, &full))) return rc;
    wire w = {p, p + n};
    wire_field fl;
    while (wire_next(&w, &fl) == 1)
        if (fl.num == 2 && fl.type == 2 && (rc = read_named(c, full, fl.val, fl.len))) return rc;
    return 0;
}

static int read_file(ctx *c, const uint8_t *p, size_t n)
{
    rpc__fds *f = c->f;
    if (!grow((void **)&f->files, &f->cap_files, f->n_files, sizeof *f->files)) return oom(c);
    c->file = f->n_files++;
    fds_file *fi = &f->files[c->file];
    memset(fi, 0, sizeof *fi);
    fi->bytes = p;
    fi->len = n;
    /* First pass: name, package, imports. */
    wire w = {p, p + n};
    wire_field fl;
    const uint8_t *name = NULL, *pkg = (const uint8_t *)"";
    size_t name_len = 0, pkg_len = 0;
    int r, rc = 0, cap_deps = 0;
    while ((r = wire_next(&w, &fl)) == 1) {
        if (fl.type != 2) continue;
        if (fl.num == 1) {
            name = fl.val;
            name_len = fl.len;
        } else if (fl.num == 2) {
            pkg = fl.val;
            pkg_len = fl.len;
        } else if (fl.num == 3) {
            if (!grow((void **)&fi->dep_names, &cap_deps, fi->n_deps, sizeof *fi->dep_names))
                return oom(c);
            if (!(fi->dep_names[fi->n_deps] = copy_str(c, fl.val, fl.len, &rc))) return rc;
            fi->n_deps++;
        }
    }
    if (r < 0) return bad(c, "malformed wire format");
    if (!name || name_len == 0) return bad(c, "a file without a name");
    if (!(fi->name = copy_str(c, name, name_len, &rc))) return rc;
    char *package = copy_str(c, pkg, pkg_len, &rc);
    if (!package) return rc;
    /* Second pass: what the file defines. */
    w = (wire){p, p + n};
    while (rc == 0 && wire_next(&w, &fl) == 1) {
        if (fl.type != 2) continue;
        switch (fl.num) {
        case 4: rc = read_message(c, package, fl.val, fl.len, 0); break;
        case 5: rc = read_enum(c, package, fl.val, fl.len); break;
        case 6: rc = read_service(c, package, fl.val, fl.len); break;
        case 7: rc = read_extension(c, package, fl.val, fl.len); break;
        default: break;
        }
    }
    free(package);
    return rc;
}

static int cmp_symbol(const void *a, const void *b)
{
    return strcmp(((const fds_symbol *)a)->name, ((const fds_symbol *)b)->name);
}

int rpc__fds_create(const void *set, size_t len, rpc__fds **out, char *err)
{
    *out = NULL;
    rpc__fds *f = calloc(1, sizeof *f);
    if (!f || !(f->data = malloc(len ? len : 1))) {
        free(f);
        return pd_errf(err, PD_ENOMEM, "descriptor set: out of memory");
    }
    if (len) memcpy(f->data, set, len);
    f->len = len;
    ctx c = {f, -1, err};
    int rc = 0, r;
    wire w = {f->data, f->data + len};
    wire_field fl;
    while (rc == 0 && (r = wire_next(&w, &fl)) == 1) {
        if (fl.num != 1) continue; /* not a file: skip */
        rc = fl.type == 2 ? read_file(&c, fl.val, fl.len) : bad(&c, "field 1 is not a message");
    }
    if (rc == 0 && r < 0) rc = pd_errf(err, PD_EFORMAT, "descriptor set: malformed wire format");
    /* Every import is in the set (protoc --include_imports), and no file is there twice. */
    for (int i = 0; rc == 0 && i < f->n_files; i++) {
        fds_file *fi = &f->files[i];
        c.file = i;
        for (int j = 0; rc == 0 && j < i; j++)
            if (strcmp(f->files[j].name, fi->name) == 0) rc = bad(&c, "the file is there twice");
        if (rc == 0 && fi->n_deps && !(fi->deps = calloc((size_t)fi->n_deps, sizeof *fi->deps)))
            rc = oom(&c);
        for (int d = 0; rc == 0 && d < fi->n_deps; d++) {
            fi->deps[d] = rpc__fds_find_file(f, fi->dep_names[d]);
            if (fi->deps[d] < 0)
                rc = pd_errf(err, PD_EFORMAT, "descriptor set: %s imports %s, which is not in the "
                             "set (protoc --include_imports puts it there)", fi->name,
                             fi->dep_names[d]);
        }
    }
    if (rc == 0 && f->n_syms > 1) {
        qsort(f->syms, (size_t)f->n_syms, sizeof *f->syms, cmp_symbol);
        for (int i = 1; rc == 0 && i < f->n_syms; i++)
            if (strcmp(f->syms[i - 1].name, f->syms[i].name) == 0)
                rc = pd_errf(err, PD_EFORMAT, "descriptor set: %s is defined twice (in %s and %s)",
                             f->syms[i].name, f->files[f->syms[i - 1].file].name,
                             f->files[f->syms[i].file].name);
    }
    if (rc != 0) {
        rpc__fds_free(f);
        return rc;
    }
    *out = f;
    return 0;
}

void rpc__fds_free(rpc__fds *f)
{
    if (!f) return;
    for (int i = 0; i < f->n_files; i++) {
        for (int d = 0; d < f->files[i].n_deps; d++) free(f->files[i].dep_names[d]);
        free(f->files[i].dep_names);
        free(f->files[i].deps);
        free(f->files[i].name);
    }
    for (int i = 0; i < f->n_syms; i++) free(f->syms[i].name);
    for (int i = 0; i < f->n_exts; i++) free(f->exts[i].extendee);
    free(f->files);
    free(f->syms);
    free(f->exts);
    free(f->data);
    free(f);
}

/* ---- queries ---- */

int rpc__fds_n_files(const rpc__fds *f) { return f->n_files; }

const uint8_t *rpc__fds_file(const rpc__fds *f, int file, const char **name, size_t *len)
{
    if (name) *name = f->files[file].name;
    *len = f->files[file].len;
    return f->files[file].bytes;
}

int rpc__fds_find_file(const rpc__fds *f, const char *name)
{
    for (int i = 0; i < f->n_files; i++)
        if (f->files[i].name && strcmp(f->files[i].name, name) == 0) return i;
    return -1;
}

int rpc__fds_find_symbol(const rpc__fds *f, const char *name, bool *is_message)
{
    if (name[0] == '.') name++;
    fds_symbol key = {(char *)name, 0, false};
    const fds_symbol *s = f->n_syms ? bsearch(&key, f->syms, (size_t)f->n_syms, sizeof *f->syms,
                                              cmp_symbol) : NULL;
    if (is_message) *is_message = s && s->is_message;
    return s ? s->file : -1;
}

int rpc__fds_find_extension(const rpc__fds *f, const char *extendee, int32_t number)
{
    if (extendee[0] == '.') extendee++;
    for (int i = 0; i < f->n_exts; i++)
        if (f->exts[i].number == number && strcmp(f->exts[i].extendee, extendee) == 0)
            return f->exts[i].file;
    return -1;
}

int rpc__fds_extension_numbers(const rpc__fds *f, const char *extendee, int32_t *out, int max)
{
    if (extendee[0] == '.') extendee++;
    int n = 0;
    for (int i = 0; i < f->n_exts; i++)
        if (strcmp(f->exts[i].extendee, extendee) == 0) {
            if (n < max) out[n] = f->exts[i].number;
            n++;
        }
    return n;
}

static int closure(const rpc__fds *f, int file, bool *seen, int *order, int n)
{
    if (seen[file]) return n;
    seen[file] = true;
    order[n++] = file;
    for (int d = 0; d < f->files[file].n_deps; d++)
        n = closure(f, f->files[file].deps[d], seen, order, n);
    return n;
}

int rpc__fds_closure(const rpc__fds *f, int file, int *order)
{
    bool *seen = calloc((size_t)f->n_files, sizeof *seen);
    if (!seen) return PD_ENOMEM;
    int n = closure(f, file, seen, order, 0);
    free(seen);
    return n;
}
