/* safetensors.c -- Maps safetensors files read-only and validates their JSON headers, so that
 * every tensor handed out has a supported dtype and lies wholly inside its file. Sharded models
 * are opened through model.safetensors.index.json; lookups go through an open-addressing hash. */
#include "engine/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/json_util.h"

/* Headers longer than this are rejected as absurd rather than handed to the JSON parser. */
#define ST_HEADER_MAX ((uint64_t)100 << 20)

typedef struct {
    char *path;         /* owned; st_tensor.file points here */
    const uint8_t *map; /* the whole file, PROT_READ, MAP_PRIVATE (or a borrowed buffer) */
    size_t size;        /* bytes mapped (the file size, >= 8) */
    bool borrowed;      /* map is the caller's buffer (st_open_buffer): not unmapped */
} st_file;

struct st_model {
    st_tensor *tensors; /* n_tensors entries, names owned (strdup) */
    int32_t n_tensors;
    int32_t cap_tensors;
    st_file *files;     /* n_files mapped files */
    int32_t n_files;
    int32_t cap_files;
    int32_t *slots;     /* hash of tensor indices by name, -1 = empty; NULL until built */
    size_t n_slots;     /* power of two, >= 2 * n_tensors */
};

/* Known safetensors dtypes that pdserve does not load, so that they are reported as
 * unsupported rather than malformed. */
static const char *const st_other_dtypes[] = {
    "BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F64",
    "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64",
};

/* Returns dir + "/" + name in a new string (caller frees), or NULL when out of memory. */
static char *st__join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* Formats shape as "[d0, d1, ...]" into buf (always terminated, truncated if too small). */
static void st__fmt_shape(char *buf, size_t len, const int64_t *shape, size_t n_dims)
{
    size_t used = (size_t)snprintf(buf, len, "[");
    for (size_t i = 0; i < n_dims && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, "%s%lld", i ? ", " : "",
                                 (long long)shape[i]);
    if (used < len) snprintf(buf + used, len - used, "]");
}

/* Maps path read-only and appends it to m->files, storing its index in *fi. The descriptor
 * is closed at once: the mapping keeps the file alive until st_close. Returns 0, PD_EIO,
 * PD_EFORMAT (shorter than the 8-byte length prefix) or PD_ENOMEM. */
static int st__map(st_model *m, const char *path, int32_t *fi, char *err)
{
    int rc = 0, fd = -1;
    char *copy = NULL;
    if (m->n_files == m->cap_files) {
        int32_t cap = m->cap_files ? m->cap_files * 2 : 4;
        st_file *files = realloc(m->files, (size_t)cap * sizeof *files);
        if (!files) return pd_errf(err, PD_ENOMEM, "out of memory mapping %s", path);
        m->files = files;
        m->cap_files = cap;
    }
    copy = strdup(path);
    if (!copy) return pd_errf(err, PD_ENOMEM, "out of memory mapping %s", path);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = pd_errf(err, PD_EIO, "cannot open %s: %s", path, strerror(errno));
        goto fail;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        rc = pd_errf(err, PD_EIO, "cannot stat %s: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = pd_errf(err, PD_EIO, "%s is not a regular file", path);
        goto fail;
    }
    if (sb.st_size < 8) {
        rc = pd_errf(err, PD_EFORMAT, "%s is truncated: %lld bytes, less than the 8-byte header "
                     "length", path, (long long)sb.st_size);
        goto fail;
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        rc = pd_errf(err, PD_EIO, "cannot mmap %s: %s", path, strerror(errno));
        goto fail;
    }
    close(fd);
    m->files[m->n_files] = (st_file){.path = copy, .map = map, .size = (size_t)sb.st_size};
    *fi = m->n_files++;
    return 0;
fail:
    if (fd >= 0) close(fd);
    free(copy);
    return rc;
}

/* Maps a dtype string to a pd_dtype. Returns 0, PD_EUNSUPPORTED for a known safetensors dtype
 * other than F32/BF16/F16/F8_E4M3, PD_EFORMAT for a string that is no safetensors dtype. */
static int st__dtype(const char *s, const char *name, const char *path, pd_dtype *out,
                     char *err)
{
    if (strcmp(s, "F32") == 0) *out = PD_DTYPE_F32;
    else if (strcmp(s, "BF16") == 0) *out = PD_DTYPE_BF16;
    else if (strcmp(s, "F16") == 0) *out = PD_DTYPE_F16;
    else if (strcmp(s, "F8_E4M3") == 0) *out = PD_DTYPE_F8E4M3;
    else {
        for (size_t i = 0; i < sizeof st_other_dtypes / sizeof st_other_dtypes[0]; i++)
            if (strcmp(s, st_other_dtypes[i]) == 0)
                return pd_errf(err, PD_EUNSUPPORTED, "tensor %s in %s has dtype %s; "
                               "supported: F32, BF16, F16, F8_E4M3", name, path, s);
        return pd_errf(err, PD_EFORMAT, "tensor %s in %s has unknown dtype \"%s\"", name,
                       path, s);
    }
    return 0;
}

/* Validates one header entry and fills *t (name left NULL) with a pointer into data, the data
 * section of data_size bytes. Returns 0, PD_EFORMAT or PD_EUNSUPPORTED with err naming the
 * tensor and the file. */
static int st__entry(const char *name, const json_t *v, const char *path, const uint8_t *data,
                     size_t data_size, st_tensor *t, char *err)
{
    memset(t, 0, sizeof *t);
    t->file = path;
    if (!json_is_object(v))
        return pd_errf(err, PD_EFORMAT, "tensor %s in %s: header entry is not an object", name,
                       path);
    const json_t *jd = json_object_get(v, "dtype");
    const json_t *js = json_object_get(v, "shape");
    const json_t *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd))
        return pd_errf(err, PD_EFORMAT, "tensor %s in %s: \"dtype\" is missing or not a string",
                       name, path);
    if (!json_is_array(js))
        return pd_errf(err, PD_EFORMAT, "tensor %s in %s: \"shape\" is missing or not an array",
                       name, path);
    if (!json_is_array(jo) || json_array_size(jo) != 2 ||
        !json_is_integer(json_array_get(jo, 0)) || !json_is_integer(json_array_get(jo, 1)))
        return pd_errf(err, PD_EFORMAT, "tensor %s in %s: \"data_offsets\" must be an array "
                       "[begin, end] of integers", name, path);
    int rc = st__dtype(json_string_value(jd), name, path, &t->dtype, err);
    if (rc) return rc;

    size_t n_dims = json_array_size(js);
    if (n_dims > ST_MAX_DIMS)
        return pd_errf(err, PD_EUNSUPPORTED, "tensor %s in %s has %zu dims; at most %d are "
                       "supported", name, path, n_dims, ST_MAX_DIMS);
    bool has_zero = false;
    for (size_t i = 0; i < n_dims; i++) {
        const json_t *jdim = json_array_get(js, i);
        if (!json_is_integer(jdim))
            return pd_errf(err, PD_EFORMAT, "tensor %s in %s: shape[%zu] is not an integer",
                           name, path, i);
        int64_t d = (int64_t)json_integer_value(jdim);
        if (d < 0)
            return pd_errf(err, PD_EFORMAT, "tensor %s in %s: shape[%zu] = %lld is negative",
                           name, path, i, (long long)d);
        t->shape[i] = d;
        has_zero |= d == 0;
    }
    t->n_dims = (int32_t)n_dims;
    char shape[200]; /* 8 dims of up to 19 digits fit */
    st__fmt_shape(shape, sizeof shape, t->shape, n_dims);
    /* The byte count must fit in int64: bound the element count by INT64_MAX / esize. */
    int64_t esize = (int64_t)pd_dtype_size(t->dtype), limit = INT64_MAX / esize;
    int64_t n_elems = has_zero ? 0 : 1;
    for (size_t i = 0; i < n_dims && n_elems; i++) {
        if (n_elems > limit / t->shape[i])
            return pd_errf(err, PD_EFORMAT, "tensor %s in %s: shape %s is too large", name,
                           path, shape);
        n_elems *= t->shape[i];
    }
    t->n_elems = n_elems;

    int64_t begin = (int64_t)json_integer_value(json_array_get(jo, 0));
    int64_t end = (int64_t)json_integer_value(json_array_get(jo, 1));
    if (begin < 0 || end < begin)
        return pd_errf(err, PD_EFORMAT, "tensor %s in %s: data_offsets [%lld, %lld] are not a "
                       "valid range", name, path, (long long)begin, (long long)end);
    if ((uint64_t)end > data_size)
        return pd_errf(err, PD_EFORMAT, "%s is truncated: tensor %s has data_offsets [%lld, "
                       "%lld] but the data section has %zu bytes", path, name,
                       (long long)begin, (long long)end, data_size);
    if (end - begin != n_elems * esize)
        return pd_errf(err, PD_EFORMAT, "tensor %s in %s: %s shape %s needs %lld bytes but "
                       "data_offsets give %lld", name, path, pd_dtype_name(t->dtype), shape,
                       (long long)(n_elems * esize), (long long)(end - begin));
    t->data = data + begin;
    t->nbytes = (size_t)(end - begin);
    return 0;
}

/* Appends t to m, taking a copy of name. Returns 0 or PD_ENOMEM. */
static int st__push(st_model *m, const st_tensor *t, const char *name, char *err)
{
    if (m->n_tensors == m->cap_tensors) {
        if (m->cap_tensors > INT32_MAX / 2)
            return pd_errf(err, PD_EFORMAT, "%s: too many tensors", t->file);
        int32_t cap = m->cap_tensors ? m->cap_tensors * 2 : 64;
        st_tensor *ts = realloc(m->tensors, (size_t)cap * sizeof *ts);
        if (!ts) return pd_errf(err, PD_ENOMEM, "out of memory reading %s", t->file);
        m->tensors = ts;
        m->cap_tensors = cap;
    }
    char *copy = strdup(name);
    if (!copy) return pd_errf(err, PD_ENOMEM, "out of memory reading %s", t->file);
    m->tensors[m->n_tensors] = *t;
    m->tensors[m->n_tensors].name = copy;
    m->n_tensors++;
    return 0;
}

/* Parses and validates the header of mapped file fi, appending its tensors to m. */
static int st__parse(st_model *m, int32_t fi, char *err)
{
    const st_file *f = &m->files[fi];
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | f->map[i];
    if (n > ST_HEADER_MAX && n > f->size - 8)
        return pd_errf(err, PD_EFORMAT, "%s: header length %llu is absurd (file has %zu bytes)",
                       f->path, (unsigned long long)n, f->size);
    if (n > f->size - 8)
        return pd_errf(err, PD_EFORMAT, "%s is truncated: header length %llu but only %zu "
                       "bytes follow", f->path, (unsigned long long)n, f->size - 8);
    if (n > ST_HEADER_MAX)
        return pd_errf(err, PD_EFORMAT, "%s: header length %llu exceeds the %llu-byte limit",
                       f->path, (unsigned long long)n, (unsigned long long)ST_HEADER_MAX);
    json_error_t je;
    json_t *root = json_loadb((const char *)f->map + 8, (size_t)n, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return pd_errf(err, PD_EFORMAT, "%s: malformed JSON header at line %d column %d: %s",
                       f->path, je.line, je.column, je.text);
    int rc = 0;
    if (!json_is_object(root)) {
        rc = pd_errf(err, PD_EFORMAT, "%s: header is not a JSON object", f->path);
        goto done;
    }
    const uint8_t *data = f->map + 8 + n;
    size_t data_size = f->size - 8 - (size_t)n;
    const char *name;
    json_t *v;
    json_object_foreach(root, name, v) {
        if (strcmp(name, "__metadata__") == 0) continue;
        st_tensor t;
        rc = st__entry(name, v, f->path, data, data_size, &t, err);
        if (rc) goto done;
        rc = st__push(m, &t, name, err);
        if (rc) goto done;
    }
done:
    json_decref(root);
    return rc;
}

/* Maps path and adds its tensors to m. */
static int st__add_file(st_model *m, const char *path, char *err)
{
    int32_t fi;
    int rc = st__map(m, path, &fi, err);
    return rc ? rc : st__parse(m, fi, err);
}

/* FNV-1a, 64-bit. */
static uint64_t st__hash(const char *s)
{
    uint64_t h = 14695981039346656037ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* Builds the name hash over all tensors. Returns 0, PD_EFORMAT (a name appears twice, which
 * can only happen across shards) or PD_ENOMEM. */
static int st__build_index(st_model *m, char *err)
{
    size_t n = 16;
    while (n < 2 * (size_t)m->n_tensors) n <<= 1;
    int32_t *slots = malloc(n * sizeof *slots);
    if (!slots) return pd_errf(err, PD_ENOMEM, "out of memory indexing tensors");
    for (size_t i = 0; i < n; i++) slots[i] = -1;
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const st_tensor *t = &m->tensors[i];
        size_t h = (size_t)st__hash(t->name) & (n - 1);
        for (; slots[h] >= 0; h = (h + 1) & (n - 1)) {
            const st_tensor *o = &m->tensors[slots[h]];
            if (strcmp(o->name, t->name) == 0) {
                free(slots);
                return pd_errf(err, PD_EFORMAT, "tensor %s appears in both %s and %s", t->name,
                               o->file, t->file);
            }
        }
        slots[h] = i;
    }
    m->slots = slots;
    m->n_slots = n;
    return 0;
}

int st_open_buffer(const void *data, size_t size, const char *name, st_model **out, char *err)
{
    *out = NULL;
    if (size < 8)
        return pd_errf(err, PD_EFORMAT, "%s is truncated: %zu bytes, less than the 8-byte header "
                       "length", name, size);
    st_model *m = calloc(1, sizeof *m);
    char *copy = strdup(name);
    st_file *files = malloc(sizeof *files);
    int rc;
    if (!m || !copy || !files) {
        free(m);
        free(copy);
        free(files);
        return pd_errf(err, PD_ENOMEM, "out of memory opening %s", name);
    }
    files[0] = (st_file){.path = copy, .map = data, .size = size, .borrowed = true};
    m->files = files;
    m->n_files = m->cap_files = 1;
    rc = st__parse(m, 0, err);
    if (rc) goto fail;
    rc = st__build_index(m, err);
    if (rc) goto fail;
    *out = m;
    return 0;
fail:
    st_close(m);
    return rc;
}

int st_open_file(const char *path, st_model **out, char *err)
{
    *out = NULL;
    st_model *m = calloc(1, sizeof *m);
    if (!m) return pd_errf(err, PD_ENOMEM, "out of memory opening %s", path);
    int rc = st__add_file(m, path, err);
    if (rc) goto fail;
    rc = st__build_index(m, err);
    if (rc) goto fail;
    *out = m;
    return 0;
fail:
    st_close(m);
    return rc;
}

/* Opens the shards named by the index file at index_path (inside dir) and checks that every
 * tensor it lists lives in the shard it names. */
static int st__open_index(const char *dir, const char *index_path, st_model **out, char *err)
{
    st_model *m = NULL;
    char *shard_path = NULL;
    json_t *root = NULL;
    int rc = pd_json_load_file(index_path, &root, err);
    if (rc) goto fail;
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm)) {
        rc = pd_errf(err, PD_EFORMAT, "%s: \"weight_map\" is missing or not an object",
                     index_path);
        goto fail;
    }
    m = calloc(1, sizeof *m);
    if (!m) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory opening %s", index_path);
        goto fail;
    }
    const char *name;
    json_t *v;
    /* Pass 1: map each distinct shard once. */
    json_object_foreach(wm, name, v) {
        const char *shard = json_string_value(v);
        if (!shard) {
            rc = pd_errf(err, PD_EFORMAT, "%s: weight_map entry for tensor %s is not a string",
                         index_path, name);
            goto fail;
        }
        if (!shard[0] || strchr(shard, '/') || strstr(shard, "..")) {
            rc = pd_errf(err, PD_EFORMAT, "%s: tensor %s names shard \"%s\"; a shard must be a "
                         "plain file name in %s", index_path, name, shard, dir);
            goto fail;
        }
        shard_path = st__join(dir, shard);
        if (!shard_path) {
            rc = pd_errf(err, PD_ENOMEM, "out of memory opening %s", index_path);
            goto fail;
        }
        bool seen = false;
        for (int32_t i = 0; i < m->n_files && !seen; i++)
            seen = strcmp(m->files[i].path, shard_path) == 0;
        if (!seen && access(shard_path, R_OK) != 0) {
            rc = pd_errf(err, PD_EIO, "%s names shard %s for tensor %s, but it cannot be read: "
                         "%s", index_path, shard, name, strerror(errno));
            goto fail;
        }
        if (!seen && (rc = st__add_file(m, shard_path, err)) != 0) goto fail;
        free(shard_path);
        shard_path = NULL;
    }
    rc = st__build_index(m, err);
    if (rc) goto fail;
    /* Pass 2: every listed tensor must be in the shard the index names. */
    json_object_foreach(wm, name, v) {
        const char *shard = json_string_value(v);
        const st_tensor *t = st_find(m, name);
        const char *base = t ? strrchr(t->file, '/') : NULL;
        if (!t || strcmp(base ? base + 1 : t->file, shard) != 0) {
            rc = pd_errf(err, PD_EFORMAT, "tensor %s is listed in %s under shard %s but is not "
                         "in that shard%s%s", name, index_path, shard, t ? "; it is in " : "",
                         t ? t->file : "");
            goto fail;
        }
    }
    json_decref(root);
    *out = m;
    return 0;
fail:
    free(shard_path);
    json_decref(root);
    st_close(m);
    return rc;
}

int st_open(const char *dir, st_model **out, char *err)
{
    *out = NULL;
    int rc;
    char *index_path = st__join(dir, "model.safetensors.index.json");
    char *single_path = st__join(dir, "model.safetensors");
    if (!index_path || !single_path)
        rc = pd_errf(err, PD_ENOMEM, "out of memory opening %s", dir);
    else if (access(index_path, F_OK) == 0)
        rc = st__open_index(dir, index_path, out, err);
    else if (access(single_path, F_OK) == 0)
        rc = st_open_file(single_path, out, err);
    else
        rc = pd_errf(err, PD_EIO, "no model.safetensors or model.safetensors.index.json in %s",
                     dir);
    free(index_path);
    free(single_path);
    return rc;
}

void st_close(st_model *m)
{
    if (!m) return;
    for (int32_t i = 0; i < m->n_tensors; i++) free((char *)m->tensors[i].name);
    for (int32_t i = 0; i < m->n_files; i++) {
        if (!m->files[i].borrowed) munmap((void *)m->files[i].map, m->files[i].size);
        free(m->files[i].path);
    }
    free(m->tensors);
    free(m->files);
    free(m->slots);
    free(m);
}

const st_tensor *st_find(const st_model *m, const char *name)
{
    if (!m || !name || !m->slots) return NULL;
    size_t mask = m->n_slots - 1;
    for (size_t h = (size_t)st__hash(name) & mask; m->slots[h] >= 0; h = (h + 1) & mask) {
        const st_tensor *t = &m->tensors[m->slots[h]];
        if (strcmp(t->name, name) == 0) return t;
    }
    return NULL;
}

int32_t st_count(const st_model *m)
{
    return m ? m->n_tensors : 0;
}

const st_tensor *st_get(const st_model *m, int32_t i)
{
    if (!m || i < 0 || i >= m->n_tensors) return NULL;
    return &m->tensors[i];
}
