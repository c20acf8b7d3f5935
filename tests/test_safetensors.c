/* test_safetensors.c -- Tests for the safetensors reader: valid single and sharded models
 * written into a temporary directory, every kind of malformed input, and the shared models. */
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/dtype.h"
#include "common/error.h"
#include "engine/safetensors.h"
#include "tests/test_util.h"

static char g_root[64]; /* mkdtemp directory holding everything the tests write */

/* Returns g_root/rel in a static buffer (one of four, so a few can be live at once). */
static const char *tmp_path(const char *rel)
{
    static char bufs[4][512];
    static int next = 0;
    char *b = bufs[next++ & 3];
    snprintf(b, sizeof bufs[0], "%s/%s", g_root, rel);
    return b;
}

/* Writes n bytes of buf to g_root/rel. */
static void write_bytes(const char *rel, const void *buf, size_t n)
{
    FILE *f = fopen(tmp_path(rel), "wb");
    CHECK_MSG(f != NULL, "cannot create %s", tmp_path(rel));
    if (!f) return;
    CHECK(fwrite(buf, 1, n, f) == n);
    fclose(f);
}

static void make_dir(const char *rel)
{
    CHECK_MSG(mkdir(tmp_path(rel), 0700) == 0, "mkdir %s", tmp_path(rel));
}

/* Writes a safetensors file: the header padded with spaces so that the data starts 8-aligned,
 * then data. keep < 0 writes everything, otherwise only the first keep bytes. hlen, when not
 * 0, replaces the header length written in the first 8 bytes. */
static void write_st_ex(const char *rel, const char *header, const void *data, size_t n_data,
                        long keep, uint64_t hlen)
{
    size_t n_hdr = strlen(header);
    size_t padded = (n_hdr + 7) & ~(size_t)7;
    size_t total = 8 + padded + n_data;
    uint8_t *buf = malloc(total);
    CHECK(buf != NULL);
    if (!buf) return;
    uint64_t len = hlen ? hlen : padded;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(len >> (8 * i));
    memcpy(buf + 8, header, n_hdr);
    memset(buf + 8 + n_hdr, ' ', padded - n_hdr);
    if (n_data) memcpy(buf + 8 + padded, data, n_data);
    write_bytes(rel, buf, keep < 0 ? total : (size_t)keep);
    free(buf);
}

static void write_st(const char *rel, const char *header, const void *data, size_t n_data)
{
    write_st_ex(rel, header, data, n_data, -1, 0);
}

/* Data and header of the valid test file: F32 [2,3], BF16 [4], F16 [2,2], F32 scalar, and an
 * empty F32 [0,3]. */
static const float k_f32[6] = {0.0f, 1.5f, -2.0f, 3.0f, 4.25f, -5.0f};
static const float k_bf16[4] = {1.0f, -2.0f, 0.5f, 3.0f};
static const float k_f16[4] = {1.0f, -1.0f, 0.25f, 1024.0f};
static const char *k_header =
    "{\"__metadata__\": {\"format\": \"pt\"},"
    " \"w.f32\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 24]},"
    " \"w.bf16\": {\"dtype\": \"BF16\", \"shape\": [4], \"data_offsets\": [24, 32]},"
    " \"w.f16\": {\"dtype\": \"F16\", \"shape\": [2, 2], \"data_offsets\": [32, 40]},"
    " \"w.scalar\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [40, 44]},"
    " \"w.empty\": {\"dtype\": \"F32\", \"shape\": [0, 3], \"data_offsets\": [44, 44]}}";

static void make_data(uint8_t *data /* 44 bytes */)
{
    memcpy(data, k_f32, 24);
    for (int i = 0; i < 4; i++) {
        uint16_t b = pd_f32_to_bf16(k_bf16[i]), h = pd_f32_to_f16(k_f16[i]);
        memcpy(data + 24 + 2 * i, &b, 2);
        memcpy(data + 32 + 2 * i, &h, 2);
    }
    float s = 7.0f;
    memcpy(data + 40, &s, 4);
}

static void check_shape(const st_tensor *t, pd_dtype dtype, int32_t n_dims, const int64_t *shape)
{
    CHECK(t != NULL);
    if (!t) return;
    CHECK_EQ_INT(t->dtype, dtype);
    CHECK_EQ_INT(t->n_dims, n_dims);
    int64_t n = 1;
    for (int32_t i = 0; i < n_dims && i < t->n_dims; i++) {
        CHECK_EQ_INT(t->shape[i], shape[i]);
        n *= shape[i];
    }
    CHECK_EQ_INT(t->n_elems, n);
    CHECK_EQ_INT(t->nbytes, (size_t)n * pd_dtype_size(dtype));
}

static void test_valid(void)
{
    uint8_t data[44];
    make_data(data);
    make_dir("single");
    write_st("single/model.safetensors", k_header, data, sizeof data);
    char err[PD_ERR_LEN] = "";
    st_model *m = NULL;
    int rc = st_open(tmp_path("single"), &m, err);
    CHECK_MSG(rc == 0, "st_open: %s", err);
    if (rc) return;
    CHECK_EQ_INT(st_count(m), 5);

    const st_tensor *t = st_find(m, "w.f32");
    check_shape(t, PD_DTYPE_F32, 2, (const int64_t[]){2, 3});
    if (t) {
        float v[6];
        memcpy(v, t->data, sizeof v);
        for (int i = 0; i < 6; i++) CHECK_NEAR(v[i], k_f32[i], 0);
        CHECK_STR_CONTAINS(t->file, "single/model.safetensors");
        CHECK_EQ_INT(((uintptr_t)t->data) % 8, 0);
    }
    t = st_find(m, "w.bf16");
    check_shape(t, PD_DTYPE_BF16, 1, (const int64_t[]){4});
    if (t) {
        float v[4];
        pd_convert_to_f32(v, t->data, t->dtype, 4);
        for (int i = 0; i < 4; i++) CHECK_NEAR(v[i], k_bf16[i], 0);
    }
    t = st_find(m, "w.f16");
    check_shape(t, PD_DTYPE_F16, 2, (const int64_t[]){2, 2});
    if (t) {
        float v[4];
        pd_convert_to_f32(v, t->data, t->dtype, 4);
        for (int i = 0; i < 4; i++) CHECK_NEAR(v[i], k_f16[i], 0);
    }
    t = st_find(m, "w.scalar");
    check_shape(t, PD_DTYPE_F32, 0, NULL);
    if (t) {
        float s;
        memcpy(&s, t->data, 4);
        CHECK_NEAR(s, 7.0, 0);
    }
    check_shape(st_find(m, "w.empty"), PD_DTYPE_F32, 2, (const int64_t[]){0, 3});
    CHECK(st_find(m, "__metadata__") == NULL);
    CHECK(st_find(m, "w.f3") == NULL);
    CHECK(st_find(m, "missing") == NULL);

    /* st_get visits every tensor exactly once, and st_find finds each of them. */
    int found = 0;
    for (int32_t i = 0; i < st_count(m); i++) {
        const st_tensor *g = st_get(m, i);
        CHECK(g != NULL);
        if (g && st_find(m, g->name) == g) found++;
    }
    CHECK_EQ_INT(found, 5);
    CHECK(st_get(m, -1) == NULL);
    CHECK(st_get(m, 5) == NULL);
    st_close(m);

    m = NULL;
    rc = st_open_file(tmp_path("single/model.safetensors"), &m, err);
    CHECK_MSG(rc == 0, "st_open_file: %s", err);
    CHECK_EQ_INT(st_count(m), 5);
    st_close(m);
    st_close(NULL);
    CHECK_EQ_INT(st_count(NULL), 0);
    CHECK(st_find(NULL, "w.f32") == NULL);
}

/* Writes the two shards used by the sharded tests into dir: w.f32 and w.bf16 in shard 1,
 * w.f16 in shard 2. */
static void write_shards(const char *dir)
{
    uint8_t data[44];
    make_data(data);
    char rel[128];
    make_dir(dir);
    snprintf(rel, sizeof rel, "%s/model-00001-of-00002.safetensors", dir);
    write_st(rel,
             "{\"w.f32\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 24]},"
             " \"w.bf16\": {\"dtype\": \"BF16\", \"shape\": [4], \"data_offsets\": [24, 32]}}",
             data, 32);
    snprintf(rel, sizeof rel, "%s/model-00002-of-00002.safetensors", dir);
    write_st(rel, "{\"w.f16\": {\"dtype\": \"F16\", \"shape\": [2, 2], \"data_offsets\": [0, 8]}}",
             data + 32, 8);
}

static void write_index(const char *dir, const char *weight_map)
{
    char rel[128], buf[1024];
    snprintf(rel, sizeof rel, "%s/model.safetensors.index.json", dir);
    int n = snprintf(buf, sizeof buf, "{\"metadata\": {\"total_size\": 40}, \"weight_map\": %s}",
                     weight_map);
    write_bytes(rel, buf, (size_t)n);
}

#define SHARD1 "\"model-00001-of-00002.safetensors\""
#define SHARD2 "\"model-00002-of-00002.safetensors\""

static void test_sharded(void)
{
    write_shards("sharded");
    write_index("sharded", "{\"w.f32\": " SHARD1 ", \"w.bf16\": " SHARD1 ", \"w.f16\": " SHARD2
                           "}");
    char err[PD_ERR_LEN] = "";
    st_model *m = NULL;
    int rc = st_open(tmp_path("sharded"), &m, err);
    CHECK_MSG(rc == 0, "st_open sharded: %s", err);
    if (rc) return;
    CHECK_EQ_INT(st_count(m), 3);
    const st_tensor *t = st_find(m, "w.f32");
    check_shape(t, PD_DTYPE_F32, 2, (const int64_t[]){2, 3});
    if (t) {
        CHECK_STR_CONTAINS(t->file, "model-00001-of-00002.safetensors");
        float v[6];
        memcpy(v, t->data, sizeof v);
        for (int i = 0; i < 6; i++) CHECK_NEAR(v[i], k_f32[i], 0);
    }
    t = st_find(m, "w.f16");
    check_shape(t, PD_DTYPE_F16, 2, (const int64_t[]){2, 2});
    if (t) {
        CHECK_STR_CONTAINS(t->file, "model-00002-of-00002.safetensors");
        float v[4];
        pd_convert_to_f32(v, t->data, t->dtype, 4);
        for (int i = 0; i < 4; i++) CHECK_NEAR(v[i], k_f16[i], 0);
    }
    check_shape(st_find(m, "w.bf16"), PD_DTYPE_BF16, 1, (const int64_t[]){4});
    st_close(m);
}

/* Opens g_root/rel with st_open_file (is_dir 0) or st_open (is_dir 1) and checks that it fails
 * with want, leaving *out NULL, with a message naming rel and containing both needles. */
static void expect_fail(const char *rel, int is_dir, int want, const char *needle1,
                        const char *needle2)
{
    char err[PD_ERR_LEN] = "";
    st_model *m = (st_model *)&err; /* must be reset to NULL */
    int rc = is_dir ? st_open(tmp_path(rel), &m, err) : st_open_file(tmp_path(rel), &m, err);
    CHECK_MSG(rc == want, "%s: got %s, want %s (%s)", rel, pd_err_name(rc), pd_err_name(want),
              err);
    CHECK(m == NULL);
    if (rc == 0) st_close(m);
    CHECK_STR_CONTAINS(err, rel);
    if (needle1) CHECK_STR_CONTAINS(err, needle1);
    if (needle2) CHECK_STR_CONTAINS(err, needle2);
}

/* A one-tensor header named "bad.weight" with the given dtype, shape and offsets. */
static void write_one(const char *rel, const char *entry, size_t n_data)
{
    static const uint8_t zeros[64];
    char hdr[512];
    snprintf(hdr, sizeof hdr, "{\"bad.weight\": %s}", entry);
    write_st(rel, hdr, zeros, n_data);
}

static void test_bad_files(void)
{
    uint8_t data[44];
    make_data(data);
    make_dir("bad");

    /* Cut in the middle of the data: the last tensor that ends past the cut is named. */
    write_st_ex("bad/cut_data.safetensors", k_header, data, sizeof data,
                (long)(8 + ((strlen(k_header) + 7) & ~(size_t)7) + 30), 0);
    expect_fail("bad/cut_data.safetensors", 0, PD_EFORMAT, "truncated", "w.");
    /* Header length says 4096 but the file ends inside the header. */
    write_st_ex("bad/cut_header.safetensors", k_header, data, sizeof data, 40, 4096);
    expect_fail("bad/cut_header.safetensors", 0, PD_EFORMAT, "truncated", "4096");
    /* Shorter than the length prefix itself. */
    write_bytes("bad/tiny.safetensors", "\x10\0\0", 3);
    expect_fail("bad/tiny.safetensors", 0, PD_EFORMAT, "truncated", NULL);
    write_bytes("bad/empty.safetensors", "", 0);
    expect_fail("bad/empty.safetensors", 0, PD_EFORMAT, "truncated", NULL);
    /* Absurd header length, far beyond the file. */
    write_st_ex("bad/huge_len.safetensors", k_header, data, sizeof data, -1, (uint64_t)1 << 40);
    expect_fail("bad/huge_len.safetensors", 0, PD_EFORMAT, "header length", "absurd");
    write_st_ex("bad/max_len.safetensors", k_header, data, sizeof data, -1, UINT64_MAX);
    expect_fail("bad/max_len.safetensors", 0, PD_EFORMAT, "header length", NULL);
    /* Header length within the file but past the header: the JSON sees data bytes. */
    write_st_ex("bad/long_len.safetensors", k_header, data, sizeof data, -1,
                ((strlen(k_header) + 7) & ~(size_t)7) + 44);
    expect_fail("bad/long_len.safetensors", 0, PD_EFORMAT, "malformed JSON", NULL);
    /* Malformed and non-object headers. */
    write_st("bad/malformed.safetensors", "{\"w\": {\"dtype\": \"F32\", ", NULL, 0);
    expect_fail("bad/malformed.safetensors", 0, PD_EFORMAT, "malformed JSON", NULL);
    write_st("bad/array.safetensors", "[1, 2, 3]", NULL, 0);
    expect_fail("bad/array.safetensors", 0, PD_EFORMAT, "not a JSON object", NULL);
    write_st("bad/dup.safetensors",
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
             " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
             data, 4);
    expect_fail("bad/dup.safetensors", 0, PD_EFORMAT, "duplicate", NULL);

    /* Per-entry errors, each naming bad.weight. */
    static const struct {
        const char *file, *entry;
        size_t n_data;
        int want;
        const char *needle;
    } cases[] = {
        {"i64", "{\"dtype\": \"I64\", \"shape\": [2], \"data_offsets\": [0, 16]}", 16,
         PD_EUNSUPPORTED, "has dtype I64; supported: F32, BF16, F16, F8_E4M3"},
        {"f8_e5m2", "{\"dtype\": \"F8_E5M2\", \"shape\": [2], \"data_offsets\": [0, 2]}", 2,
         PD_EUNSUPPORTED, "F8_E5M2"},
        {"unknown_dtype", "{\"dtype\": \"Q4\", \"shape\": [2], \"data_offsets\": [0, 2]}", 2,
         PD_EFORMAT, "unknown dtype"},
        {"mismatch", "{\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 20]}", 24,
         PD_EFORMAT, "shape [2, 3] needs 24 bytes but data_offsets give 20"},
        {"beyond", "{\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 24]}", 16,
         PD_EFORMAT, "truncated"},
        {"beyond_huge", "{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": "
         "[9223372036854775800, 9223372036854775804]}", 16, PD_EFORMAT, "truncated"},
        {"reversed", "{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 4]}", 16,
         PD_EFORMAT, "data_offsets"},
        {"neg_offset", "{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}", 16,
         PD_EFORMAT, "data_offsets"},
        {"neg_dim", "{\"dtype\": \"F32\", \"shape\": [2, -3], \"data_offsets\": [0, 8]}", 16,
         PD_EFORMAT, "negative"},
        {"float_dim", "{\"dtype\": \"F32\", \"shape\": [2.5], \"data_offsets\": [0, 8]}", 16,
         PD_EFORMAT, "shape[0]"},
        {"overflow", "{\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296, 4], "
         "\"data_offsets\": [0, 0]}", 16, PD_EFORMAT, "too large"},
        {"overflow_bytes", "{\"dtype\": \"F32\", \"shape\": [4611686018427387904], "
         "\"data_offsets\": [0, 0]}", 16, PD_EFORMAT, "too large"},
        {"many_dims", "{\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1], "
         "\"data_offsets\": [0, 4]}", 16, PD_EUNSUPPORTED, "9 dims"},
        {"no_dtype", "{\"shape\": [1], \"data_offsets\": [0, 4]}", 16, PD_EFORMAT, "dtype"},
        {"int_dtype", "{\"dtype\": 3, \"shape\": [1], \"data_offsets\": [0, 4]}", 16,
         PD_EFORMAT, "dtype"},
        {"no_shape", "{\"dtype\": \"F32\", \"data_offsets\": [0, 4]}", 16, PD_EFORMAT, "shape"},
        {"no_offsets", "{\"dtype\": \"F32\", \"shape\": [1]}", 16, PD_EFORMAT, "data_offsets"},
        {"short_offsets", "{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}", 16,
         PD_EFORMAT, "data_offsets"},
        {"str_offsets", "{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [\"0\", 4]}",
         16, PD_EFORMAT, "data_offsets"},
        {"not_object", "[1, 2]", 16, PD_EFORMAT, "not an object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "bad/%s.safetensors", cases[i].file);
        write_one(rel, cases[i].entry, cases[i].n_data);
        expect_fail(rel, 0, cases[i].want, "bad.weight", cases[i].needle);
    }
    /* A shape with a zero dim after a huge one is empty, not an overflow. */
    write_one("bad/zero_after_huge.safetensors",
              "{\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296, 4294967296, 0], "
              "\"data_offsets\": [0, 0]}", 0);
    char err[PD_ERR_LEN] = "";
    st_model *m = NULL;
    int rc = st_open_file(tmp_path("bad/zero_after_huge.safetensors"), &m, err);
    CHECK_MSG(rc == 0, "%s", err);
    if (m) CHECK_EQ_INT(st_find(m, "bad.weight")->n_elems, 0);
    st_close(m);

    expect_fail("bad/does_not_exist.safetensors", 0, PD_EIO, NULL, NULL);
    make_dir("bad/a_dir.safetensors");
    expect_fail("bad/a_dir.safetensors", 0, PD_EIO, NULL, NULL);
}

static void test_bad_dirs(void)
{
    make_dir("nothing");
    expect_fail("nothing", 1, PD_EIO, "no model.safetensors or model.safetensors.index.json",
                NULL);
    expect_fail("no_such_dir", 1, PD_EIO, "no model.safetensors", NULL);

    write_shards("missing_shard");
    write_index("missing_shard", "{\"w.f32\": " SHARD1 ", \"lm_head.weight\": "
                                 "\"model-00003-of-00003.safetensors\"}");
    expect_fail("missing_shard", 1, PD_EIO, "model-00003-of-00003.safetensors", "lm_head.weight");

    write_shards("ghost");
    write_index("ghost", "{\"w.f32\": " SHARD1 ", \"ghost.weight\": " SHARD2 "}");
    expect_fail("ghost", 1, PD_EFORMAT, "ghost.weight", "model-00002-of-00002.safetensors");

    write_shards("wrong_shard");
    write_index("wrong_shard", "{\"w.f32\": " SHARD1 ", \"w.f16\": " SHARD1 "}");
    expect_fail("wrong_shard", 1, PD_EFORMAT, "w.f16", "model-00001-of-00002.safetensors");
    write_shards("moved");
    write_index("moved", "{\"w.f32\": " SHARD1 ", \"w.bf16\": " SHARD2 ", \"w.f16\": " SHARD2
                         "}");
    expect_fail("moved", 1, PD_EFORMAT, "w.bf16", "it is in");

    write_shards("escape");
    write_index("escape", "{\"w.f32\": \"../single/model.safetensors\"}");
    expect_fail("escape", 1, PD_EFORMAT, "w.f32", "../single/model.safetensors");
    write_shards("slash");
    write_index("slash", "{\"w.f32\": \"/etc/passwd\"}");
    expect_fail("slash", 1, PD_EFORMAT, "w.f32", "/etc/passwd");
    write_shards("nonstring");
    write_index("nonstring", "{\"w.f32\": 1}");
    expect_fail("nonstring", 1, PD_EFORMAT, "w.f32", "not a string");
    write_shards("no_map");
    write_index("no_map", "[]");
    expect_fail("no_map", 1, PD_EFORMAT, "weight_map", NULL);
    make_dir("bad_index");
    write_bytes("bad_index/model.safetensors.index.json", "{\"weight_map\": ", 15);
    expect_fail("bad_index", 1, PD_EFORMAT, "model.safetensors.index.json", "malformed JSON");

    /* The same tensor in two shards. */
    uint8_t data[44];
    make_data(data);
    write_shards("dup");
    write_st("dup/model-00003-of-00003.safetensors",
             "{\"w.f32\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 24]}}",
             data, 24);
    write_index("dup", "{\"w.f32\": " SHARD1 ", \"w.f16\": " SHARD2 ", \"x\": "
                       "\"model-00003-of-00003.safetensors\"}");
    expect_fail("dup", 1, PD_EFORMAT, "w.f32", "model-00003-of-00003.safetensors");

    /* A bad shard reports the shard's own error. */
    write_shards("bad_shard");
    write_st_ex("bad_shard/model-00002-of-00002.safetensors", "{}", NULL, 0, 5, 0);
    write_index("bad_shard", "{\"w.f32\": " SHARD1 ", \"w.f16\": " SHARD2 "}");
    expect_fail("bad_shard", 1, PD_EFORMAT, "model-00002-of-00002.safetensors", "truncated");
}

static void test_shared_models(void)
{
    char path[1024], err[PD_ERR_LEN] = "";
    snprintf(path, sizeof path, "%s/models/stories260k/model.safetensors", pd_test_shared_dir());
    if (access(path, R_OK) == 0) {
        st_model *m = NULL;
        int rc = st_open_file(path, &m, err);
        CHECK_MSG(rc == 0, "%s", err);
        check_shape(st_find(m, "model.embed_tokens.weight"), PD_DTYPE_F32, 2,
                    (const int64_t[]){512, 64});
        CHECK(st_count(m) > 1);
        st_close(m);
    } else {
        fprintf(stderr, "skipping %s: not found\n", path);
    }
    snprintf(path, sizeof path, "%s/testdata/golden/qwen3-tiny", pd_test_shared_dir());
    if (access(path, R_OK) == 0) {
        st_model *m = NULL;
        int rc = st_open(path, &m, err);
        CHECK_MSG(rc == 0, "%s", err);
        check_shape(st_find(m, "model.layers.0.self_attn.q_norm.weight"), PD_DTYPE_BF16, 1,
                    (const int64_t[]){32});
        for (int32_t i = 0; i < st_count(m); i++)
            CHECK_EQ_INT(st_get(m, i)->dtype, PD_DTYPE_BF16);
        st_close(m);
    } else {
        fprintf(stderr, "skipping %s: not found\n", path);
    }
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(path);
}

/* st_open_buffer: the same checks on a file held in memory (the fuzz target's entry). */
static void test_buffer(void)
{
    uint8_t data[44];
    make_data(data);
    size_t n_hdr = strlen(k_header), padded = (n_hdr + 7) & ~(size_t)7;
    size_t total = 8 + padded + sizeof data;
    uint8_t *buf = malloc(total);
    CHECK(buf != NULL);
    if (!buf) return;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, k_header, n_hdr);
    memset(buf + 8 + n_hdr, ' ', padded - n_hdr);
    memcpy(buf + 8 + padded, data, sizeof data);

    char err[PD_ERR_LEN] = "";
    st_model *m = NULL;
    int rc = st_open_buffer(buf, total, "mem.safetensors", &m, err);
    CHECK_MSG(rc == 0, "st_open_buffer: %s", err);
    CHECK_EQ_INT(st_count(m), 5);
    const st_tensor *t = st_find(m, "w.f32");
    check_shape(t, PD_DTYPE_F32, 2, (const int64_t[]){2, 3});
    if (t) {
        CHECK(t->data == buf + 8 + padded);
        CHECK_STR_CONTAINS(t->file, "mem.safetensors");
    }
    st_close(m);

    /* Cut anywhere before the end: an error naming the buffer, never a read past it. */
    for (size_t cut = 0; cut < total; cut += 5) {
        m = (st_model *)1;
        err[0] = '\0';
        rc = st_open_buffer(buf, cut, "mem.safetensors", &m, err);
        CHECK_MSG(rc == PD_EFORMAT, "cut at %zu: %s (%s)", cut, pd_err_name(rc), err);
        CHECK(m == NULL);
        CHECK_STR_CONTAINS(err, "mem.safetensors");
    }
    free(buf);
}

int main(void)
{
    snprintf(g_root, sizeof g_root, "/tmp/pd_test_safetensors_XXXXXX");
    if (!mkdtemp(g_root)) {
        perror("mkdtemp");
        return 1;
    }
    test_valid();
    test_sharded();
    test_bad_files();
    test_buffer();
    test_bad_dirs();
    test_shared_models();
    CHECK(nftw(g_root, remove_entry, 16, FTW_DEPTH | FTW_PHYS) == 0);
    return pd_test_result("test_safetensors");
}
