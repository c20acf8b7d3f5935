/* test_fingerprint.c -- svc_model_fingerprint over copies of stories260k: the same files give
 * the same value wherever they live; a changed safetensors header or one tensor's changed
 * bytes (a fine-tune of the same architecture) give another; --load-format dummy has its own
 * value, which ignores the weights. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "svc/svc.h"
#include "tests/test_util.h"

#define SRC PD_SHARED_DIR "/models/stories260k"

static unsigned char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(len > 0 ? (size_t)len : 1);
    *n = b ? fread(b, 1, (size_t)len, f) : 0;
    fclose(f);
    return b;
}

static void write_all(const char *dir, const char *name, const unsigned char *b, size_t n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (!f) return;
    CHECK(fwrite(b, 1, n, f) == n);
    fclose(f);
}

static void remove_dir(const char *dir)
{
    char path[4096];
    const char *names[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
}

/* A model directory with config.json and the given model.safetensors bytes. */
static void make_dir(char *dir, const unsigned char *cfg, size_t n_cfg, const unsigned char *st,
                     size_t n_st)
{
    strcpy(dir, "/tmp/pd_fp_XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    write_all(dir, "config.json", cfg, n_cfg);
    write_all(dir, "model.safetensors", st, n_st);
}

int main(void)
{
    size_t n_cfg = 0, n_st = 0;
    unsigned char *cfg = read_all(SRC "/config.json", &n_cfg);
    unsigned char *st = read_all(SRC "/model.safetensors", &n_st);
    if (!cfg || !st) {
        fprintf(stderr, "SKIP: %s not found\n", SRC);
        free(cfg);
        free(st);
        return 77;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | st[i];
    CHECK(hlen > 0 && hlen + 8 <= n_st);
    char *header = strndup((const char *)st + 8, (size_t)hlen);
    char a[32], a2[32], b[32], c[32];
    make_dir(a, cfg, n_cfg, st, n_st);
    make_dir(a2, cfg, n_cfg, st, n_st);

    /* b: the header says something else (same length: only its bytes differ). */
    unsigned char *sb = malloc(n_st);
    memcpy(sb, st, n_st);
    char *fmt = strstr(header, "\"format\":\"pt\"");
    CHECK(fmt != NULL);
    if (fmt) sb[8 + (size_t)(fmt - header) + 11] = 'u'; /* "pt" -> "pu" */
    make_dir(b, cfg, n_cfg, sb, n_st);

    /* c: one tensor's bytes changed within its header-declared region, header untouched. */
    unsigned char *sc = malloc(n_st);
    memcpy(sc, st, n_st);
    char *emb = strstr(header, "\"model.embed_tokens.weight\"");
    char *offs = emb ? strstr(emb, "\"data_offsets\":[") : NULL;
    unsigned long long lo = 0, hi = 0;
    CHECK(offs && sscanf(offs, "\"data_offsets\":[%llu,%llu]", &lo, &hi) == 2);
    CHECK(hi > lo && 8 + hlen + hi <= n_st);
    for (uint64_t k = 8 + hlen + lo; k < 8 + hlen + hi && k < n_st; k += 4)
        sc[k] ^= 0x01; /* the lowest mantissa bit of each f32: a "fine-tune" */
    make_dir(c, cfg, n_cfg, sc, n_st);

    uint64_t fa = svc_model_fingerprint(a, "safetensors", PD_DTYPE_F32, "");
    CHECK(fa != 0);
    CHECK(fa == svc_model_fingerprint(a, "safetensors", PD_DTYPE_F32, "")); /* stable */
    CHECK(fa == svc_model_fingerprint(a2, "safetensors", PD_DTYPE_F32, "")); /* path-free */
    CHECK(fa == svc_model_fingerprint(SRC, "safetensors", PD_DTYPE_F32, ""));
    CHECK_MSG(fa != svc_model_fingerprint(b, "safetensors", PD_DTYPE_F32, ""), "changed header");
    CHECK_MSG(fa != svc_model_fingerprint(c, "safetensors", PD_DTYPE_F32, ""), "changed tensor");
    CHECK(fa != svc_model_fingerprint(a, "safetensors", PD_DTYPE_BF16, ""));
    CHECK(fa != svc_model_fingerprint(a, "safetensors", PD_DTYPE_F8E4M3, ""));
    CHECK_MSG(fa != svc_model_fingerprint(a, "safetensors", PD_DTYPE_F32, "fp8 (at load)"),
              "weights quantized at load");
    /* dummy: its own value, the same for every copy of the config whatever the weights. */
    uint64_t fd = svc_model_fingerprint(a, "dummy", PD_DTYPE_F32, "");
    CHECK(fd != fa);
    CHECK(fd == svc_model_fingerprint(c, "dummy", PD_DTYPE_F32, ""));
    CHECK(fd == svc_model_fingerprint(b, "dummy", PD_DTYPE_F32, ""));

    remove_dir(a);
    remove_dir(a2);
    remove_dir(b);
    remove_dir(c);
    free(header);
    free(sb);
    free(sc);
    free(cfg);
    free(st);
    return pd_test_result("test_fingerprint");
}
