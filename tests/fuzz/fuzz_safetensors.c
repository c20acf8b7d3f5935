/* fuzz_safetensors.c -- Fuzzes the safetensors header parser (engine/safetensors.h): the input
 * is a whole .safetensors file (8-byte header length, JSON header, data). Every tensor of a
 * file that opens must lie inside the input, have the byte size its dtype and shape give, and
 * be found again by name; its first and last bytes are read (ASan checks the bounds). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/error.h"
#include "engine/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* A copy of exactly size bytes, so that ASan sees any read past the end. */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    char err[PD_ERR_LEN];
    st_model *m;
    if (st_open_buffer(buf, size, "fuzz.safetensors", &m, err) < 0) {
        free(buf);
        return 0;
    }
    volatile uint8_t sink = 0;
    for (int32_t i = 0; i < st_count(m); i++) {
        const st_tensor *t = st_get(m, i);
        if (!t || !t->name || t->n_dims < 0 || t->n_dims > ST_MAX_DIMS) abort();
        int64_t n = 1;
        for (int32_t d = 0; d < t->n_dims; d++)
            if (t->shape[d] == 0) n = 0;
        for (int32_t d = 0; d < t->n_dims && n; d++)
            if (__builtin_mul_overflow(n, t->shape[d], &n)) abort();
        if (n != t->n_elems || t->n_elems < 0) abort();
        if ((uint64_t)t->n_elems * pd_dtype_size(t->dtype) != t->nbytes) abort();
        const uint8_t *p = t->data;
        if (p < buf + 8 || p > buf + size || t->nbytes > (size_t)(buf + size - p)) abort();
        if (t->nbytes) sink ^= p[0] ^ p[t->nbytes - 1];
        if (st_find(m, t->name) != t) abort();
    }
    (void)sink;
    st_close(m);
    free(buf);
    return 0;
}
