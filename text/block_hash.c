/* block_hash.c -- The chained block hash (text/block_hash.h). */
#include "text/block_hash.h"

#include <stdlib.h>
#include <xxhash.h>

uint64_t pd_block_hash(uint64_t prev, const int32_t *tokens, int32_t block_size)
{
    uint8_t buf[8 + 4 * 256];
    uint8_t *heap = NULL, *p = buf;
    size_t n = 8 + 4 * (size_t)block_size;
    if (block_size > 256) p = heap = malloc(n);
    if (!p) abort(); /* block sizes above 256 are not used in practice */
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(prev >> (8 * i));
    for (int32_t j = 0; j < block_size; j++) {
        uint32_t t = (uint32_t)tokens[j];
        for (int i = 0; i < 4; i++) p[8 + 4 * j + i] = (uint8_t)(t >> (8 * i));
    }
    uint64_t h = XXH64(p, n, 0);
    free(heap);
    return h;
}
