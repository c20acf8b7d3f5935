/* safetensors_write.c -- The safetensors writer: a file's header is built from the declared
 * tensors and written before any data, then the data section is streamed through a buffered
 * stream that checks every byte against the declared sizes. A checkpoint splits the tensors
 * into shards and writes the index; its files carry a temporary suffix until committed. */
#include "engine/safetensors_write.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"

/* The stream buffer of a file being written. */
#define STW_BUF_BYTES ((size_t)1 << 20)

typedef struct {
    char *name;                 /* owned */
    pd_dtype dtype;
    int32_t n_dims;
    int64_t shape[ST_MAX_DIMS];
    uint64_t nbytes;            /* elements * dtype size */
    uint64_t end;               /* offset of its last byte + 1 in its file's data section */
} stw__tensor;

/* A growable list of declared tensors with a hash of their names (duplicates refused). */
typedef struct {
    stw__tensor *v;
    int32_t n, cap;
    int32_t *slots;             /* indices into v by name hash, -1 = empty */
    size_t n_slots;             /* power of two, > 2 * n */
} stw__list;

struct stw_file {
    char *path;                 /* owned */
    FILE *fp;                   /* NULL before create succeeded or after close */
    char *buf;                  /* the stream's buffer (owned) */
    stw__list list;
    int32_t cur;                /* tensor the next data byte belongs to (n when done) */
    uint64_t written;           /* data bytes written so far */
    bool begun;
    bool complete;              /* closed with every byte written */
};

struct stw_ckpt {
    char *dir;                  /* owned copy */
    char *suffix;               /* owned copy */
    uint64_t shard_max;
    stw__list list;
    uint64_t total;             /* data bytes of all tensors */
    int32_t n_shards;           /* after begin */
    int32_t *shard_first;       /* n_shards + 1: first tensor of each shard, then list.n */
    uint64_t *shard_end;        /* n_shards: cumulative data bytes at each shard's end */
    int32_t n_files;            /* shards plus the index when sharded */
    char **final;               /* n_files full final paths */
    char **tmp;                 /* n_files full temporary paths */
    const char **base;          /* n_files names without the directory (into final) */
    bool *made;                 /* file i was created (and not yet renamed) */
    int32_t shard;              /* shard being written; n_shards when all are closed */
    stw_file *cur;              /* its writer */
    uint64_t written;           /* data bytes written so far over all shards */
    bool begun, finished, committed;
};

/* FNV-1a, 64-bit. */
static uint64_t stw__hash(const char *s)
{
    uint64_t h = 14695981039346656037ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static void stw__list_free(stw__list *l)
{
    for (int32_t i = 0; i < l->n; i++) free(l->v[i].name);
    free(l->v);
    free(l->slots);
    memset(l, 0, sizeof *l);
}

/* Rebuilds the name hash with n_slots slots. Returns 0 or PD_ENOMEM. */
static int stw__rehash(stw__list *l, size_t n_slots)
{
    int32_t *slots = malloc(n_slots * sizeof *slots);
    if (!slots) return PD_ENOMEM;
    for (size_t i = 0; i < n_slots; i++) slots[i] = -1;
    for (int32_t i = 0; i < l->n; i++) {
        size_t h = (size_t)stw__hash(l->v[i].name) & (n_slots - 1);
        while (slots[h] >= 0) h = (h + 1) & (n_slots - 1);
        slots[h] = i;
    }
    free(l->slots);
    l->slots = slots;
    l->n_slots = n_slots;
    return 0;
}

/* Validates a declaration and appends it to l (name copied). Returns 0, PD_EINVAL (err names
 * the tensor and `where`) or PD_ENOMEM. */
static int stw__list_add(stw__list *l, const char *name, pd_dtype dtype, int32_t n_dims,
                         const int64_t *shape, const char *where, char *err)
{
    if (!name || !*name) return pd_errf(err, PD_EINVAL, "%s: a tensor needs a name", where);
    if (dtype != PD_DTYPE_F32 && dtype != PD_DTYPE_BF16 && dtype != PD_DTYPE_F16 &&
        dtype != PD_DTYPE_F8E4M3 && dtype != PD_DTYPE_I32)
        return pd_errf(err, PD_EINVAL, "%s: tensor %s has an unknown dtype %d", where, name,
                       (int)dtype);
    if (n_dims < 0 || n_dims > ST_MAX_DIMS || (n_dims > 0 && !shape))
        return pd_errf(err, PD_EINVAL, "%s: tensor %s has %d dims (0..%d)", where, name,
                       (int)n_dims, ST_MAX_DIMS);
    const uint64_t esize = pd_dtype_size(dtype);
    uint64_t n_elems = 1;
    for (int32_t i = 0; i < n_dims; i++) {
        if (shape[i] < 0)
            return pd_errf(err, PD_EINVAL, "%s: tensor %s has a negative dim %lld", where,
                           name, (long long)shape[i]);
        if (shape[i] && n_elems > (uint64_t)INT64_MAX / esize / (uint64_t)shape[i])
            return pd_errf(err, PD_EINVAL, "%s: tensor %s is too large", where, name);
        n_elems *= (uint64_t)shape[i];
    }
    if ((size_t)(l->n + 1) * 2 >= l->n_slots) {
        int rc = stw__rehash(l, l->n_slots ? l->n_slots * 2 : 64);
        if (rc) return pd_errf(err, rc, "%s: out of memory", where);
    }
    size_t h = (size_t)stw__hash(name) & (l->n_slots - 1);
    for (; l->slots[h] >= 0; h = (h + 1) & (l->n_slots - 1))
        if (strcmp(l->v[l->slots[h]].name, name) == 0)
            return pd_errf(err, PD_EINVAL, "%s: tensor %s is declared twice", where, name);
    if (l->n == l->cap) {
        int32_t cap = l->cap ? l->cap * 2 : 64;
        stw__tensor *v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) return pd_errf(err, PD_ENOMEM, "%s: out of memory", where);
        l->v = v;
        l->cap = cap;
    }
    stw__tensor *t = &l->v[l->n];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name) return pd_errf(err, PD_ENOMEM, "%s: out of memory", where);
    t->dtype = dtype;
    t->n_dims = n_dims;
    for (int32_t i = 0; i < n_dims; i++) t->shape[i] = shape[i];
    t->nbytes = n_elems * esize;
    t->end = (l->n ? l->v[l->n - 1].end : 0) + t->nbytes;
    l->slots[h] = l->n++;
    return 0;
}

/* ---- one file ---- */

int stw_file_create(const char *path, stw_file **out, char *err)
{
    *out = NULL;
    stw_file *f = calloc(1, sizeof *f);
    if (!f) return pd_errf(err, PD_ENOMEM, "out of memory creating %s", path);
    f->path = strdup(path);
    f->buf = malloc(STW_BUF_BYTES);
    if (!f->path || !f->buf) {
        free(f->path);
        free(f->buf);
        free(f);
        return pd_errf(err, PD_ENOMEM, "out of memory creating %s", path);
    }
    f->fp = fopen(path, "wb");
    if (!f->fp) {
        int rc = pd_errf(err, PD_EIO, "cannot create %s: %s", path, strerror(errno));
        free(f->path);
        free(f->buf);
        free(f);
        return rc;
    }
    setvbuf(f->fp, f->buf, _IOFBF, STW_BUF_BYTES);
    *out = f;
    return 0;
}

int stw_file_add(stw_file *f, const char *name, pd_dtype dtype, int32_t n_dims,
                 const int64_t *shape, char *err)
{
    if (f->begun)
        return pd_errf(err, PD_EINVAL, "%s: tensor %s declared after the header was written",
                       f->path, name ? name : "(null)");
    return stw__list_add(&f->list, name, dtype, n_dims, shape, f->path, err);
}

/* Skips the zero-byte tensors at the write position. */
static void stw__file_advance(stw_file *f)
{
    while (f->cur < f->list.n && f->list.v[f->cur].end == f->written) f->cur++;
}

int stw_file_begin(stw_file *f, char *err)
{
    if (f->begun) return pd_errf(err, PD_ESTATE, "%s: header already written", f->path);
    int rc = PD_ENOMEM;
    char *text = NULL;
    /* json_object_set_new and json_array_append_new take the value even when they fail, so
     * each value is attached before it is filled (its pointer stays borrowed) */
    json_t *root = json_object(), *meta = json_object();
    if (!root || json_object_set_new(root, "__metadata__", meta) ||
        json_object_set_new(meta, "format", json_string("pt")))
        goto fail;
    for (int32_t i = 0; i < f->list.n; i++) {
        const stw__tensor *t = &f->list.v[i];
        json_t *e = json_object();
        if (json_object_set_new(root, t->name, e) ||
            json_object_set_new(e, "dtype", json_string(pd_dtype_name(t->dtype))) ||
            json_object_set_new(e, "shape", json_array()) ||
            json_object_set_new(e, "data_offsets", json_array()))
            goto fail;
        json_t *shape = json_object_get(e, "shape"), *offs = json_object_get(e, "data_offsets");
        for (int32_t d = 0; d < t->n_dims; d++)
            if (json_array_append_new(shape, json_integer((json_int_t)t->shape[d]))) goto fail;
        if (json_array_append_new(offs, json_integer((json_int_t)(t->end - t->nbytes))) ||
            json_array_append_new(offs, json_integer((json_int_t)t->end)))
            goto fail;
    }
    text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    if (!text) goto fail;
    size_t n = strlen(text), padded = (n + 7) & ~(size_t)7;
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    bool ok = fwrite(len, 1, 8, f->fp) == 8 && fwrite(text, 1, n, f->fp) == n;
    for (size_t i = n; ok && i < padded; i++) ok = fputc(' ', f->fp) != EOF;
    if (!ok) {
        rc = pd_errf(err, PD_EIO, "cannot write %s: %s", f->path, strerror(errno));
        goto done;
    }
    f->begun = true;
    stw__file_advance(f);
    rc = 0;
    goto done;
fail:
    rc = pd_errf(err, PD_ENOMEM, "out of memory building the header of %s", f->path);
done:
    free(text);
    json_decref(root);
    return rc;
}

int stw_file_write(stw_file *f, const void *data, size_t n, char *err)
{
    if (!f->begun)
        return pd_errf(err, PD_ESTATE, "%s: data written before the header", f->path);
    const uint8_t *p = data;
    while (n > 0) {
        if (f->cur >= f->list.n)
            return pd_errf(err, PD_ESTATE, "%s: %zu bytes more than its tensors hold", f->path,
                           n);
        const stw__tensor *t = &f->list.v[f->cur];
        size_t take = t->end - f->written < n ? (size_t)(t->end - f->written) : n;
        if (fwrite(p, 1, take, f->fp) != take)
            return pd_errf(err, PD_EIO, "cannot write tensor %s to %s: %s", t->name, f->path,
                           strerror(errno));
        p += take;
        n -= take;
        f->written += take;
        stw__file_advance(f);
    }
    return 0;
}

const char *stw_file_current(const stw_file *f)
{
    return f->cur < f->list.n ? f->list.v[f->cur].name : NULL;
}

/* Frees f's memory (the stream must be closed). */
static void stw__file_free(stw_file *f)
{
    stw__list_free(&f->list);
    free(f->buf);
    free(f->path);
    free(f);
}

int stw_file_close(stw_file *f, char *err)
{
    int rc = 0;
    if (!f->begun) {
        rc = pd_errf(err, PD_ESTATE, "%s: closed before its header was written", f->path);
    } else if (f->cur < f->list.n) {
        const stw__tensor *t = &f->list.v[f->cur];
        rc = pd_errf(err, PD_ESTATE, "%s: tensor %s has %llu of its %llu bytes", f->path,
                     t->name, (unsigned long long)(f->written - (t->end - t->nbytes)),
                     (unsigned long long)t->nbytes);
    } else if (fflush(f->fp) != 0 || fsync(fileno(f->fp)) != 0) {
        rc = pd_errf(err, PD_EIO, "cannot write %s: %s", f->path, strerror(errno));
    }
    if (fclose(f->fp) != 0 && rc == 0)
        rc = pd_errf(err, PD_EIO, "cannot close %s: %s", f->path, strerror(errno));
    f->fp = NULL;
    if (rc) unlink(f->path);
    else f->complete = true;
    stw__file_free(f);
    return rc;
}

void stw_file_destroy(stw_file *f)
{
    if (!f) return;
    if (f->fp) fclose(f->fp);
    if (!f->complete) unlink(f->path);
    stw__file_free(f);
}

/* ---- a checkpoint ---- */

stw_params stw_default_params(void)
{
    return (stw_params){.dir = NULL, .shard_bytes_max = 0, .tmp_suffix = NULL};
}

int stw_ckpt_create(const stw_params *p, stw_ckpt **out, char *err)
{
    *out = NULL;
    if (!p || !p->dir || !*p->dir)
        return pd_errf(err, PD_EINVAL, "safetensors writer: no output directory");
    stw_ckpt *w = calloc(1, sizeof *w);
    if (!w) return pd_errf(err, PD_ENOMEM, "out of memory");
    w->dir = strdup(p->dir);
    w->suffix = strdup(p->tmp_suffix ? p->tmp_suffix : ".pdtmp");
    w->shard_max = p->shard_bytes_max ? p->shard_bytes_max : STW_SHARD_BYTES_DEFAULT;
    if (!w->dir || !w->suffix) {
        stw_ckpt_destroy(w);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    *out = w;
    return 0;
}

int stw_ckpt_add(stw_ckpt *w, const char *name, pd_dtype dtype, int32_t n_dims,
                 const int64_t *shape, char *err)
{
    if (w->begun)
        return pd_errf(err, PD_EINVAL, "%s: tensor %s declared after writing began", w->dir,
                       name ? name : "(null)");
    int rc = stw__list_add(&w->list, name, dtype, n_dims, shape, w->dir, err);
    if (rc == 0) w->total += w->list.v[w->list.n - 1].nbytes;
    return rc;
}

/* Returns dir/name + suffix in a new string, or NULL when out of memory. */
static char *stw__path(const char *dir, const char *name, const char *suffix)
{
    size_t n = strlen(dir) + strlen(name) + strlen(suffix) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s%s", dir, name, suffix);
    return p;
}

/* Creates shard s's file under its temporary name and writes its header. */
static int stw__open_shard(stw_ckpt *w, int32_t s, char *err)
{
    stw_file *f;
    int rc = stw_file_create(w->tmp[s], &f, err);
    if (rc) return rc;
    w->made[s] = true;
    for (int32_t i = w->shard_first[s]; rc == 0 && i < w->shard_first[s + 1]; i++) {
        const stw__tensor *t = &w->list.v[i];
        rc = stw_file_add(f, t->name, t->dtype, t->n_dims, t->shape, err);
    }
    if (rc == 0) rc = stw_file_begin(f, err);
    if (rc) {
        stw_file_destroy(f);
        return rc;
    }
    w->cur = f;
    w->shard = s;
    return 0;
}

int stw_ckpt_begin(stw_ckpt *w, char *err)
{
    if (w->begun) return pd_errf(err, PD_ESTATE, "%s: writing already began", w->dir);
    if (w->list.n == 0) return pd_errf(err, PD_ESTATE, "%s: no tensors to write", w->dir);
    /* Shards in order: a new one starts before a tensor with bytes that would take the
     * current one past the limit, so that every shard but an all-empty checkpoint's first
     * begins with data. */
    int32_t n_shards = 1;
    uint64_t in_shard = 0;
    for (int32_t i = 0; i < w->list.n; i++) {
        uint64_t b = w->list.v[i].nbytes;
        if (b > 0 && in_shard > 0 && in_shard + b > w->shard_max) {
            n_shards++;
            in_shard = 0;
        }
        in_shard += b;
    }
    if (n_shards > 99999)
        return pd_errf(err, PD_EINVAL, "%s: %d shards are too many; raise the shard size",
                       w->dir, (int)n_shards);
    w->n_shards = n_shards;
    w->n_files = n_shards + (n_shards > 1);
    w->shard_first = malloc((size_t)(n_shards + 1) * sizeof *w->shard_first);
    w->shard_end = malloc((size_t)n_shards * sizeof *w->shard_end);
    w->final = calloc((size_t)w->n_files, sizeof *w->final);
    w->tmp = calloc((size_t)w->n_files, sizeof *w->tmp);
    w->base = calloc((size_t)w->n_files, sizeof *w->base);
    w->made = calloc((size_t)w->n_files, sizeof *w->made);
    if (!w->shard_first || !w->shard_end || !w->final || !w->tmp || !w->base || !w->made)
        return pd_errf(err, PD_ENOMEM, "%s: out of memory", w->dir);
    int32_t s = 0;
    uint64_t cum = 0;
    in_shard = 0;
    w->shard_first[0] = 0;
    for (int32_t i = 0; i < w->list.n; i++) {
        uint64_t b = w->list.v[i].nbytes;
        if (b > 0 && in_shard > 0 && in_shard + b > w->shard_max) {
            w->shard_end[s] = cum;
            w->shard_first[++s] = i;
            in_shard = 0;
        }
        in_shard += b;
        cum += b;
    }
    w->shard_end[s] = cum;
    w->shard_first[n_shards] = w->list.n;
    for (int32_t f = 0; f < w->n_files; f++) {
        char name[64];
        if (n_shards == 1) snprintf(name, sizeof name, "model.safetensors");
        else if (f < n_shards)
            snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", (int)f + 1,
                     (int)n_shards);
        else snprintf(name, sizeof name, "model.safetensors.index.json");
        w->final[f] = stw__path(w->dir, name, "");
        w->tmp[f] = stw__path(w->dir, name, w->suffix);
        if (!w->final[f] || !w->tmp[f]) return pd_errf(err, PD_ENOMEM, "%s: out of memory", w->dir);
        w->base[f] = w->final[f] + strlen(w->dir) + 1;
    }
    w->begun = true;
    return stw__open_shard(w, 0, err);
}

int stw_ckpt_write(stw_ckpt *w, const void *data, size_t n, char *err)
{
    if (!w->begun) return pd_errf(err, PD_ESTATE, "%s: data written before begin", w->dir);
    const uint8_t *p = data;
    while (n > 0) {
        uint64_t left = w->cur ? w->shard_end[w->shard] - w->written : 0;
        if (left == 0)
            return pd_errf(err, PD_ESTATE, "%s: %zu bytes more than the tensors hold", w->dir,
                           n);
        size_t take = left < n ? (size_t)left : n;
        int rc = stw_file_write(w->cur, p, take, err);
        if (rc) return rc;
        p += take;
        n -= take;
        w->written += take;
        if (w->written == w->shard_end[w->shard] && w->shard + 1 < w->n_shards) {
            stw_file *f = w->cur;
            w->cur = NULL;
            rc = stw_file_close(f, err);
            if (rc) return rc;
            rc = stw__open_shard(w, w->shard + 1, err);
            if (rc) return rc;
        }
    }
    return 0;
}

const char *stw_ckpt_current(const stw_ckpt *w)
{
    return w->cur ? stw_file_current(w->cur) : NULL;
}

/* Writes the index of a sharded checkpoint under its temporary name. */
static int stw__write_index(stw_ckpt *w, char *err)
{
    int32_t fi = w->n_shards;
    json_t *root = json_object(), *meta = json_object(), *map = json_object();
    int rc = 0;
    if (!root || !meta || !map) goto nomem;
    if (json_object_set_new(meta, "total_size", json_integer((json_int_t)w->total))) goto nomem;
    for (int32_t s = 0; s < w->n_shards; s++)
        for (int32_t i = w->shard_first[s]; i < w->shard_first[s + 1]; i++)
            if (json_object_set_new(map, w->list.v[i].name, json_string(w->base[s])))
                goto nomem;
    int set = json_object_set(root, "metadata", meta);
    set = set || json_object_set(root, "weight_map", map);
    if (set) goto nomem;
    w->made[fi] = true;
    if (json_dump_file(root, w->tmp[fi], JSON_INDENT(2) | JSON_PRESERVE_ORDER) != 0) {
        rc = pd_errf(err, PD_EIO, "cannot write %s: %s", w->tmp[fi], strerror(errno));
        goto done;
    }
    FILE *fp = fopen(w->tmp[fi], "ab");
    if (!fp || fputc('\n', fp) == EOF || fflush(fp) != 0 || fsync(fileno(fp)) != 0)
        rc = pd_errf(err, PD_EIO, "cannot write %s: %s", w->tmp[fi], strerror(errno));
    if (fp) fclose(fp);
    goto done;
nomem:
    rc = pd_errf(err, PD_ENOMEM, "out of memory writing the index of %s", w->dir);
done:
    json_decref(root);
    json_decref(meta);
    json_decref(map);
    return rc;
}

int stw_ckpt_finish(stw_ckpt *w, char *err)
{
    if (!w->begun) return pd_errf(err, PD_ESTATE, "%s: finished before begin", w->dir);
    if (w->finished) return 0;
    if (!w->cur) return pd_errf(err, PD_ESTATE, "%s: an earlier write failed", w->dir);
    if (w->shard + 1 < w->n_shards || stw_file_current(w->cur)) {
        const char *name = stw_file_current(w->cur);
        return pd_errf(err, PD_ESTATE, "%s: tensor %s was not written in full", w->dir,
                       name ? name : w->list.v[w->shard_first[w->shard + 1]].name);
    }
    stw_file *f = w->cur;
    w->cur = NULL;
    int rc = stw_file_close(f, err);
    if (rc) return rc;
    w->shard = w->n_shards;
    if (w->n_shards > 1) {
        rc = stw__write_index(w, err);
        if (rc) return rc;
    }
    w->finished = true;
    return 0;
}

int stw_ckpt_commit(stw_ckpt *w, char *err)
{
    if (!w->finished) return pd_errf(err, PD_ESTATE, "%s: committed before finish", w->dir);
    for (int32_t f = 0; f < w->n_files; f++) {
        if (!w->made[f]) continue;
        if (rename(w->tmp[f], w->final[f]) != 0)
            return pd_errf(err, PD_EIO, "cannot rename %s to %s: %s", w->tmp[f], w->final[f],
                           strerror(errno));
        w->made[f] = false;
    }
    w->committed = true;
    return 0;
}

int32_t stw_ckpt_n_files(const stw_ckpt *w) { return w->n_files; }

const char *stw_ckpt_file_name(const stw_ckpt *w, int32_t i) { return w->base[i]; }

uint64_t stw_ckpt_total_bytes(const stw_ckpt *w) { return w->total; }

void stw_ckpt_destroy(stw_ckpt *w)
{
    if (!w) return;
    stw_file_destroy(w->cur);
    for (int32_t f = 0; f < w->n_files; f++) {
        if (w->made && w->made[f] && w->tmp && w->tmp[f]) unlink(w->tmp[f]);
        if (w->final) free(w->final[f]);
        if (w->tmp) free(w->tmp[f]);
    }
    free(w->final);
    free(w->tmp);
    free(w->base);
    free(w->made);
    free(w->shard_first);
    free(w->shard_end);
    stw__list_free(&w->list);
    free(w->dir);
    free(w->suffix);
    free(w);
}
