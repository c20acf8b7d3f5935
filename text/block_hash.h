/* block_hash.h -- The chained hash of a sequence's KV blocks, which the router (prefix-aware
 * routing), prefill and decode (the prefix cache) agree on; see docs/kv-blocks.md:
 *   h(-1) = 0
 *   h(i)  = XXH64(le64(h(i-1)) || le32(t[i*B]) || ... || le32(t[i*B + B-1]), seed = 0)
 * where B is the block size and t the sequence's token ids: 8 bytes of the previous hash,
 * little-endian, then the block's B token ids as little-endian 32-bit integers. Equal hashes
 * mean equal whole prefixes (up to 64-bit collisions). */
#ifndef PD_BLOCK_HASH_H
#define PD_BLOCK_HASH_H

#include <stdint.h>

/* h(i) from prev = h(i - 1) and the block's block_size tokens. */
uint64_t pd_block_hash(uint64_t prev, const int32_t *tokens, int32_t block_size);

#endif
