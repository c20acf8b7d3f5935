/* test_safetensors_write.c -- Tests for the safetensors writer: files of every dtype read back
 * through st_open, the header's exact layout, data streamed in pieces of any size, sharded
 * checkpoints with their index, temporary names until commit, and every misuse refused. */
#include <dirent.h>
#include <ftw.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/dtype.h"
#include "common/error.h"
#include "engine/safetensors.h"
#include "engine/safetensors_write.h"
#include "tests/test_util.h"

static char g_root[64]; /* mkdtemp directory holding everything the tests write */

static const char *tmp_path(const char *rel)
{
    static char bufs[4][512];
    static int next = 0;
    char *b = bufs[next++ & 3];
    snprintf(b, sizeof bufs[0], "%s/%s", g_root, rel);
    return b;
}

static bool exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* Number of entries of dir other than . and .. */
static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

/* A tensor to write: bytes filled from a seed so that every tensor's data differs. */
typedef struct {
    const char *name;
    pd_dtype dtype;
    int32_t n_dims;
    int64_t shape[4];
} spec;

static size_t spec_bytes(const spec *s)
{
    size_t n = pd_dtype_size(s->dtype);
    for (int32_t i = 0; i < s->n_dims; i++) n *= (size_t)s->shape[i];
    return n;
}

static uint8_t *spec_data(const spec *s, uint32_t seed)
{
    size_t n = spec_bytes(s);
    uint8_t *p = malloc(n ? n : 1);
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        p[i] = (uint8_t)(x >> 24);
        /* keep e4m3 bytes off the NaN codes: st_open does not care, but be a real tensor */
        if (s->dtype == PD_DTYPE_F8E4M3 && (p[i] & 0x7f) == 0x7f) p[i] = 0x7e;
    }
    return p;
}

static const spec k_specs[] = {
    {"model.embed_tokens.weight", PD_DTYPE_BF16, 2, {7, 5}},
    {"a.f32", PD_DTYPE_F32, 3, {2, 3, 4}},
    {"a.f16", PD_DTYPE_F16, 1, {9}},
    {"layer.q_proj.weight", PD_DTYPE_F8E4M3, 2, {5, 13}}, /* 65 bytes: odd offsets after */
    {"layer.q_proj.weight_scale", PD_DTYPE_F32, 2, {5, 1}},
    {"scalar", PD_DTYPE_F32, 0, {0}},
    {"empty", PD_DTYPE_BF16, 2, {0, 4}},
    {"name with \"quotes\", \\ and \xc3\xa9", PD_DTYPE_F16, 1, {3}},
    {"big", PD_DTYPE_BF16, 2, {1024, 700}},  /* over the 1 MiB stream buffer */
};
#define N_SPECS ((int)(sizeof k_specs / sizeof k_specs[0]))

/* Checks that m holds exactly k_specs (in order when ordered) with their data. */
static void check_model(const st_model *m, bool ordered)
{
    CHECK_EQ_INT(st_count(m), N_SPECS);
    for (int i = 0; i < N_SPECS; i++) {
        const spec *s = &k_specs[i];
        const st_tensor *t = st_find(m, s->name);
        CHECK_MSG(t != NULL, "tensor %s missing", s->name);
        if (!t) continue;
        if (ordered) CHECK_MSG(st_get(m, i) == t, "tensor %s not at %d", s->name, i);
        CHECK_EQ_INT(t->dtype, s->dtype);
        CHECK_EQ_INT(t->n_dims, s->n_dims);
        for (int32_t d = 0; d < s->n_dims; d++) CHECK_EQ_INT(t->shape[d], s->shape[d]);
        CHECK_EQ_INT(t->nbytes, spec_bytes(s));
        uint8_t *want = spec_data(s, (uint32_t)i);
        CHECK_MSG(t->nbytes == 0 || memcmp(t->data, want, t->nbytes) == 0, "%s data differs",
                  s->name);
        free(want);
    }
}

/* One file: every dtype, written in pieces of `piece` bytes (0 = a call per tensor, and the
 * two small tensors after the F8 one in one call). */
static void write_file(const char *path, size_t piece)
{
    char err[PD_ERR_LEN] = "";
    stw_file *f;
    CHECK_EQ_INT(stw_file_create(path, &f, err), 0);
    if (!f) return;
    for (int i = 0; i < N_SPECS; i++)
        CHECK_EQ_INT(stw_file_add(f, k_specs[i].name, k_specs[i].dtype, k_specs[i].n_dims,
                                  k_specs[i].shape, err), 0);
    CHECK_EQ_INT(stw_file_begin(f, err), 0);
    /* all data as one stream, then fed in pieces */
    size_t total = 0;
    for (int i = 0; i < N_SPECS; i++) total += spec_bytes(&k_specs[i]);
    uint8_t *all = malloc(total), *p = all;
    for (int i = 0; i < N_SPECS; i++) {
        uint8_t *d = spec_data(&k_specs[i], (uint32_t)i);
        memcpy(p, d, spec_bytes(&k_specs[i]));
        p += spec_bytes(&k_specs[i]);
        free(d);
    }
    CHECK(strcmp(stw_file_current(f), k_specs[0].name) == 0);
    if (piece == 0) {
        size_t off = 0;
        for (int i = 0; i < N_SPECS; i++) {
            size_t n = spec_bytes(&k_specs[i]);
            if (i == 4) n += spec_bytes(&k_specs[5]) + spec_bytes(&k_specs[6]), i += 2;
            CHECK_EQ_INT(stw_file_write(f, all + off, n, err), 0);
            off += n;
        }
    } else {
        int rc = 0;
        for (size_t off = 0; rc == 0 && off < total; off += piece)
            rc = stw_file_write(f, all + off, total - off < piece ? total - off : piece, err);
        CHECK_MSG(rc == 0, "piece %zu: %s", piece, err);
    }
    CHECK(stw_file_current(f) == NULL);
    CHECK_MSG(stw_file_close(f, err) == 0, "%s", err);
    free(all);
}

/* The raw layout: 8-byte little-endian length, a multiple of 8, space padding, the metadata
 * first, offsets contiguous in the order added. */
static void check_layout(const char *path)
{
    FILE *fp = fopen(path, "rb");
    CHECK(fp != NULL);
    if (!fp) return;
    fseek(fp, 0, SEEK_END);
    long size = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)size);
    CHECK(fread(buf, 1, (size_t)size, fp) == (size_t)size);
    fclose(fp);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | buf[i];
    CHECK_EQ_INT(n % 8, 0);
    CHECK(strncmp((const char *)buf + 8, "{\"__metadata__\":{\"format\":\"pt\"},", 32) == 0);
    size_t end = n;
    while (end > 0 && buf[8 + end - 1] == ' ') end--;
    CHECK(buf[8 + end - 1] == '}');
    CHECK(n - end < 8);
    json_error_t je;
    json_t *h = json_loadb((const char *)buf + 8, (size_t)n, JSON_REJECT_DUPLICATES, &je);
    CHECK(h != NULL);
    uint64_t expect = 0;
    int i = 0;
    const char *key;
    json_t *v;
    json_object_foreach(h, key, v) {
        if (strcmp(key, "__metadata__") == 0) continue;
        CHECK_MSG(i < N_SPECS && strcmp(key, k_specs[i].name) == 0, "key %d is %s", i, key);
        json_t *offs = json_object_get(v, "data_offsets");
        CHECK_EQ_INT(json_integer_value(json_array_get(offs, 0)), expect);
        expect += spec_bytes(&k_specs[i]);
        CHECK_EQ_INT(json_integer_value(json_array_get(offs, 1)), expect);
        i++;
    }
    CHECK_EQ_INT(i, N_SPECS);
    CHECK_EQ_INT((uint64_t)size, 8 + n + expect);
    json_decref(h);
    free(buf);
}

static void test_file_round_trip(void)
{
    const size_t pieces[] = {0, 1, 7, 4096, (size_t)1 << 22};
    for (size_t k = 0; k < sizeof pieces / sizeof pieces[0]; k++) {
        const char *path = tmp_path("one.safetensors");
        write_file(path, pieces[k]);
        check_layout(path);
        char err[PD_ERR_LEN] = "";
        st_model *m = NULL;
        CHECK_MSG(st_open_file(path, &m, err) == 0, "piece %zu: %s", pieces[k], err);
        if (m) check_model(m, true);
        st_close(m);
        unlink(path);
    }
}

/* I32 is written (the safetensors name is I32) though st_open does not load it. */
static void test_i32(void)
{
    char err[PD_ERR_LEN] = "";
    stw_file *f;
    const char *path = tmp_path("i32.safetensors");
    const int64_t shape[1] = {3};
    const int32_t v[3] = {1, -2, 3};
    CHECK_EQ_INT(stw_file_create(path, &f, err), 0);
    CHECK_EQ_INT(stw_file_add(f, "ids", PD_DTYPE_I32, 1, shape, err), 0);
    CHECK_EQ_INT(stw_file_begin(f, err), 0);
    CHECK_EQ_INT(stw_file_write(f, v, sizeof v, err), 0);
    CHECK_EQ_INT(stw_file_close(f, err), 0);
    st_model *m = NULL;
    CHECK_EQ_INT(st_open_file(path, &m, err), PD_EUNSUPPORTED);
    CHECK_STR_CONTAINS(err, "I32");
    st_close(m);
    unlink(path);
}

static void test_file_misuse(void)
{
    char err[PD_ERR_LEN] = "";
    stw_file *f;
    const char *path = tmp_path("bad.safetensors");
    const int64_t shape[2] = {2, 3}, neg[2] = {2, -1};
    uint8_t bytes[32] = {0};
    CHECK_EQ_INT(stw_file_create(tmp_path("no/such/dir/x.safetensors"), &f, err), PD_EIO);
    CHECK_STR_CONTAINS(err, "no/such/dir");
    CHECK_EQ_INT(stw_file_create(path, &f, err), 0);
    CHECK_EQ_INT(stw_file_write(f, bytes, 1, err), PD_ESTATE);
    CHECK_EQ_INT(stw_file_add(f, "", PD_DTYPE_F32, 2, shape, err), PD_EINVAL);
    CHECK_EQ_INT(stw_file_add(f, "x", PD_DTYPE_F32, 2, neg, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "negative");
    CHECK_EQ_INT(stw_file_add(f, "x", PD_DTYPE_F32, ST_MAX_DIMS + 1, shape, err), PD_EINVAL);
    CHECK_EQ_INT(stw_file_add(f, "x", (pd_dtype)99, 2, shape, err), PD_EINVAL);
    CHECK_EQ_INT(stw_file_add(f, "x", PD_DTYPE_BF16, 2, shape, err), 0);
    CHECK_EQ_INT(stw_file_add(f, "x", PD_DTYPE_BF16, 2, shape, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "declared twice");
    CHECK_EQ_INT(stw_file_add(f, "y", PD_DTYPE_F8E4M3, 2, shape, err), 0);
    CHECK_EQ_INT(stw_file_begin(f, err), 0);
    CHECK_EQ_INT(stw_file_begin(f, err), PD_ESTATE);
    CHECK_EQ_INT(stw_file_add(f, "z", PD_DTYPE_F32, 2, shape, err), PD_EINVAL);
    CHECK_EQ_INT(stw_file_write(f, bytes, 12 + 6 + 1, err), PD_ESTATE); /* one too many */
    CHECK_STR_CONTAINS(err, "more than");
    stw_file_destroy(f);
    CHECK_MSG(!exists(path), "an unfinished file stays behind");

    /* closed with bytes missing: refused, naming the tensor, and removed */
    CHECK_EQ_INT(stw_file_create(path, &f, err), 0);
    CHECK_EQ_INT(stw_file_add(f, "x", PD_DTYPE_BF16, 2, shape, err), 0);
    CHECK_EQ_INT(stw_file_add(f, "y", PD_DTYPE_F32, 2, shape, err), 0);
    CHECK_EQ_INT(stw_file_begin(f, err), 0);
    CHECK_EQ_INT(stw_file_write(f, bytes, 14, err), 0);
    CHECK_EQ_INT(stw_file_close(f, err), PD_ESTATE);
    CHECK_STR_CONTAINS(err, "tensor y has 2 of its 24 bytes");
    CHECK(!exists(path));
    stw_file_destroy(NULL);
}

/* Declares k_specs into a checkpoint writer with the given shard limit and writes all. */
static stw_ckpt *write_ckpt(const char *dir, uint64_t shard_max, bool finish)
{
    char err[PD_ERR_LEN] = "";
    stw_params p = stw_default_params();
    p.dir = dir;
    p.shard_bytes_max = shard_max;
    p.tmp_suffix = ".tmp";
    stw_ckpt *w = NULL;
    CHECK_EQ_INT(stw_ckpt_create(&p, &w, err), 0);
    if (!w) return NULL;
    uint64_t total = 0;
    for (int i = 0; i < N_SPECS; i++) {
        CHECK_EQ_INT(stw_ckpt_add(w, k_specs[i].name, k_specs[i].dtype, k_specs[i].n_dims,
                                  k_specs[i].shape, err), 0);
        total += spec_bytes(&k_specs[i]);
    }
    CHECK_EQ_INT(stw_ckpt_total_bytes(w), total);
    CHECK_EQ_INT(stw_ckpt_add(w, k_specs[0].name, PD_DTYPE_F32, 0, NULL, err), PD_EINVAL);
    CHECK_MSG(stw_ckpt_begin(w, err) == 0, "%s", err);
    for (int i = 0; i < N_SPECS; i++) {
        if (spec_bytes(&k_specs[i])) CHECK(strcmp(stw_ckpt_current(w), k_specs[i].name) == 0);
        uint8_t *d = spec_data(&k_specs[i], (uint32_t)i);
        /* in two halves, so that a shard boundary never coincides with a call's end alone */
        size_t n = spec_bytes(&k_specs[i]), h = n / 2;
        CHECK_EQ_INT(stw_ckpt_write(w, d, h, err), 0);
        CHECK_EQ_INT(stw_ckpt_write(w, d + h, n - h, err), 0);
        free(d);
    }
    CHECK(stw_ckpt_current(w) == NULL);
    if (finish) CHECK_MSG(stw_ckpt_finish(w, err) == 0, "%s", err);
    return w;
}

static void test_ckpt_single(void)
{
    char err[PD_ERR_LEN] = "";
    char dir[512];
    snprintf(dir, sizeof dir, "%s/single", g_root);
    CHECK(mkdir(dir, 0700) == 0);
    stw_ckpt *w = write_ckpt(dir, 0, true);
    CHECK_EQ_INT(stw_ckpt_n_files(w), 1);
    CHECK(strcmp(stw_ckpt_file_name(w, 0), "model.safetensors") == 0);
    CHECK(exists(tmp_path("single/model.safetensors.tmp")));
    CHECK(!exists(tmp_path("single/model.safetensors")));
    CHECK_EQ_INT(stw_ckpt_commit(w, err), 0);
    CHECK(!exists(tmp_path("single/model.safetensors.tmp")));
    stw_ckpt_destroy(w);
    CHECK_EQ_INT(count_entries(dir), 1);
    st_model *m = NULL;
    CHECK_MSG(st_open(dir, &m, err) == 0, "%s", err);
    if (m) check_model(m, true);
    st_close(m);
}

static void test_ckpt_sharded(void)
{
    char err[PD_ERR_LEN] = "";
    char dir[512];
    snprintf(dir, sizeof dir, "%s/sharded", g_root);
    CHECK(mkdir(dir, 0700) == 0);
    /* 200-byte shards: embed (70) + f32 (96) + f16 (18); q (65) + scale (20) + scalar (4)
     * + empty (0) + quotes (6); big (1,433,600) alone */
    stw_ckpt *w = write_ckpt(dir, 200, true);
    CHECK_EQ_INT(stw_ckpt_n_files(w), 4);
    const char *names[4] = {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                            "model-00003-of-00003.safetensors", "model.safetensors.index.json"};
    for (int i = 0; i < 4; i++) {
        CHECK(strcmp(stw_ckpt_file_name(w, i), names[i]) == 0);
        char rel[128];
        snprintf(rel, sizeof rel, "sharded/%s.tmp", names[i]);
        CHECK_MSG(exists(tmp_path(rel)), "%s missing before commit", rel);
    }
    CHECK_EQ_INT(stw_ckpt_commit(w, err), 0);
    stw_ckpt_destroy(w);
    CHECK_EQ_INT(count_entries(dir), 4);
    json_error_t je;
    json_t *idx = json_load_file(tmp_path("sharded/model.safetensors.index.json"), 0, &je);
    CHECK(idx != NULL);
    uint64_t total = 0;
    for (int i = 0; i < N_SPECS; i++) total += spec_bytes(&k_specs[i]);
    CHECK_EQ_INT(json_integer_value(json_object_get(json_object_get(idx, "metadata"),
                                                    "total_size")), total);
    json_t *map = json_object_get(idx, "weight_map");
    CHECK_EQ_INT(json_object_size(map), N_SPECS);
    const int shard_of[N_SPECS] = {0, 0, 0, 1, 1, 1, 1, 1, 2};
    for (int i = 0; i < N_SPECS; i++) {
        const char *file = json_string_value(json_object_get(map, k_specs[i].name));
        CHECK_MSG(file && strcmp(file, names[shard_of[i]]) == 0, "%s in %s", k_specs[i].name,
                  file ? file : "(none)");
    }
    json_decref(idx);
    st_model *m = NULL;
    CHECK_MSG(st_open(dir, &m, err) == 0, "%s", err);
    if (m) check_model(m, false);
    st_close(m);
    /* each shard alone is a valid file */
    for (int i = 0; i < 3; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "sharded/%s", names[i]);
        CHECK_EQ_INT(st_open_file(tmp_path(rel), &m, err), 0);
        st_close(m);
    }
}

/* Abandoned or failed writes leave nothing; misuse is refused. */
static void test_ckpt_cleanup(void)
{
    char err[PD_ERR_LEN] = "";
    char dir[512];
    snprintf(dir, sizeof dir, "%s/abandon", g_root);
    CHECK(mkdir(dir, 0700) == 0);
    stw_ckpt *w = write_ckpt(dir, 200, true); /* finished, never committed */
    CHECK(count_entries(dir) == 4);
    stw_ckpt_destroy(w);
    CHECK_EQ_INT(count_entries(dir), 0);

    stw_params p = stw_default_params();
    p.dir = dir;
    p.shard_bytes_max = 200;
    CHECK_EQ_INT(stw_ckpt_create(&p, &w, err), 0);
    const int64_t shape[2] = {10, 10};
    CHECK_EQ_INT(stw_ckpt_begin(w, err), PD_ESTATE); /* no tensors */
    CHECK_EQ_INT(stw_ckpt_add(w, "a", PD_DTYPE_F32, 2, shape, err), 0);
    CHECK_EQ_INT(stw_ckpt_add(w, "b", PD_DTYPE_F32, 2, shape, err), 0);
    CHECK_EQ_INT(stw_ckpt_begin(w, err), 0);
    CHECK_EQ_INT(stw_ckpt_commit(w, err), PD_ESTATE);
    uint8_t buf[512] = {0};
    CHECK_EQ_INT(stw_ckpt_write(w, buf, 450, err), 0); /* a (a shard), 50 bytes of b */
    CHECK_EQ_INT(count_entries(dir), 2);
    CHECK_EQ_INT(stw_ckpt_finish(w, err), PD_ESTATE);
    CHECK_STR_CONTAINS(err, "tensor b");
    CHECK_EQ_INT(stw_ckpt_write(w, buf, 351, err), PD_ESTATE);
    CHECK_STR_CONTAINS(err, "more than");
    stw_ckpt_destroy(w);
    CHECK_EQ_INT(count_entries(dir), 0);
    stw_ckpt_destroy(NULL);

    p = stw_default_params();
    CHECK_EQ_INT(stw_ckpt_create(&p, &w, err), PD_EINVAL);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(path);
}

int main(void)
{
    snprintf(g_root, sizeof g_root, "/tmp/pd_stw_XXXXXX");
    if (!mkdtemp(g_root)) {
        perror("mkdtemp");
        return 1;
    }
    test_file_round_trip();
    test_i32();
    test_file_misuse();
    test_ckpt_single();
    test_ckpt_sharded();
    test_ckpt_cleanup();
    CHECK(nftw(g_root, remove_entry, 16, FTW_DEPTH | FTW_PHYS) == 0);
    return pd_test_result("test_safetensors_write");
}
