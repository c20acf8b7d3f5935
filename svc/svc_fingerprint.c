/* svc_fingerprint.c -- The model fingerprint that prefill and decode compare before they
 * exchange KV (svc_model_fingerprint in svc_core.h): config, the weights' identity and the KV
 * dtype, computed without reading the weights in full. */
#include "svc/svc_core.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xxhash.h>

#define FP_SAMPLES 32             /* data chunks hashed per safetensors file */
#define FP_CHUNK 4096             /* bytes per chunk */
#define FP_HEADER_MAX (100u << 20) /* safetensors' own limit on the JSON header */

/* Hashes a whole (small) file, with its name; a missing file hashes as absent. */
static void fp_file(XXH64_state_t *st, const char *dir, const char *name)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    XXH64_update(st, name, strlen(name) + 1);
    if (!f) return;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) XXH64_update(st, buf, n);
    fclose(f);
}

/* Hashes what tells one safetensors file's weights from another's without a full read: its
 * name, size, header (tensor names, dtypes, shapes, offsets, metadata) and FP_SAMPLES chunks
 * spread evenly over the data (a fine-tune changes nearly every weight, so these differ). */
static void fp_safetensors(XXH64_state_t *st, const char *dir, const char *name)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    XXH64_update(st, name, strlen(name) + 1);
    FILE *f = fopen(path, "rb");
    if (!f) return;
    struct stat sb;
    unsigned char len8[8];
    if (fstat(fileno(f), &sb) != 0 || fread(len8, 1, 8, f) != 8) {
        fclose(f);
        return;
    }
    uint64_t size = (uint64_t)sb.st_size, hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len8[i];
    XXH64_update(st, &size, sizeof size);
    XXH64_update(st, len8, sizeof len8);
    if (hlen > FP_HEADER_MAX || hlen > size - 8) { /* not a safetensors file: size only */
        fclose(f);
        return;
    }
    unsigned char buf[FP_CHUNK];
    for (uint64_t done = 0; done < hlen;) {
        size_t want = hlen - done < sizeof buf ? (size_t)(hlen - done) : sizeof buf;
        size_t n = fread(buf, 1, want, f);
        if (n == 0) break;
        XXH64_update(st, buf, n);
        done += n;
    }
    uint64_t data0 = 8 + hlen, dlen = size - data0;
    for (int i = 0; i < FP_SAMPLES && dlen > 0; i++) {
        uint64_t off = dlen > FP_CHUNK ? (dlen - FP_CHUNK) / (FP_SAMPLES - 1) * (uint64_t)i : 0;
        size_t want = dlen < FP_CHUNK ? (size_t)dlen : FP_CHUNK;
        if (fseeko(f, (off_t)(data0 + off), SEEK_SET) != 0) break;
        size_t n = fread(buf, 1, want, f);
        XXH64_update(st, buf, n);
    }
    fclose(f);
}

static int is_safetensors(const struct dirent *d)
{
    size_t n = strlen(d->d_name);
    return n > 12 && !strcmp(d->d_name + n - 12, ".safetensors");
}

uint64_t svc_model_fingerprint(const char *dir, const char *load_format, pd_dtype kv_dtype,
                               const char *quant)
{
    XXH64_state_t *st = XXH64_createState();
    if (!st) return 0;
    XXH64_reset(st, 0x70d5e7e1);
    fp_file(st, dir, "config.json");
    XXH64_update(st, load_format, strlen(load_format) + 1);
    XXH64_update(st, &kv_dtype, sizeof kv_dtype);
    if (quant && *quant) XXH64_update(st, quant, strlen(quant));
    if (strcmp(load_format, "dummy") != 0) { /* dummy: the same seeded weights everywhere */
        fp_file(st, dir, "model.safetensors.index.json");
        struct dirent **ents = NULL;
        int n = scandir(dir, &ents, is_safetensors, alphasort);
        for (int i = 0; i < n; i++) {
            fp_safetensors(st, dir, ents[i]->d_name);
            free(ents[i]);
        }
        free(ents);
    }
    uint64_t h = XXH64_digest(st);
    XXH64_freeState(st);
    return h;
}
