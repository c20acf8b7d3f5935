/* block_manager.h -- Paged KV-cache block allocator with prefix reuse. Pure bookkeeping over
 * block ids: no device memory is touched here.
 *
 * Blocks have reference counts. A full block whose KV has been computed is registered in the
 * prefix cache under its chained hash (text/block_hash.h); when its last user frees it, it
 * stays cached and reusable, and is evicted only when a fresh block is needed, least recently
 * freed first. Equal hashes are also checked against the stored token ids before any reuse. */
#ifndef PD_BLOCK_MANAGER_H
#define PD_BLOCK_MANAGER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/sequence.h"
#include "text/block_hash.h"

typedef struct {
    int32_t n_blocks;          /* total KV blocks in the pool, > 0 */
    int32_t block_size;        /* tokens per block, > 0 */
    bool enable_prefix_cache;  /* reuse full blocks by content hash */
} bm_params;

bm_params bm_default_params(void);

typedef struct bm bm; /* opaque */

int bm_create(const bm_params *p, bm **out);       /* 0, or PD_ENOMEM / PD_EINVAL */
void bm_destroy(bm *m);                            /* NULL is a no-op */

/* Admission of a sequence that holds no blocks: counts the leading full blocks of its tokens
 * that are in the prefix cache (at most (n_tokens - 1) / block_size, so that at least one
 * token is always computed) and the blocks it needs to hold its first `n_reserve` tokens
 * (>= n_tokens: room for later steps). Returns the number of cached tokens (>= 0) or
 * PD_ENOSPC if the free blocks do not suffice now. Changes nothing. */
int bm_can_allocate(const bm *m, const pd_seq *s, int32_t n_reserve);
/* Allocates as bm_can_allocate counted: cached blocks are shared (ref + 1), the rest taken
 * from the free list (evicting their old cache entries). Sets s->block_table, n_blocks,
 * n_computed = n_cached = cached tokens, n_hashed and last_hash. Returns cached tokens or
 * PD_ENOSPC (nothing changed). */
int bm_allocate(bm *m, pd_seq *s, int32_t n_reserve);
/* True if s can grow to hold n_total tokens with the free blocks available now. */
bool bm_can_append(const bm *m, const pd_seq *s, int32_t n_total);
/* Grows s's block table to hold n_total tokens. Returns 0 or PD_ENOSPC (nothing changed). */
int bm_append(bm *m, pd_seq *s, int32_t n_total);
/* Forks child (holding no blocks) from parent: child's first n_shared blocks are parent's
 * (ref + 1: blocks shared by reference count, such as the full prompt blocks of an n > 1
 * request's choices), then n_fresh blocks from the free list (for copies of parent's
 * partial block: the caller copies the KV). Returns 0 or PD_ENOSPC (nothing changed). */
int bm_fork(bm *m, const pd_seq *parent, pd_seq *child, int32_t n_shared, int32_t n_fresh);
/* Registers in the prefix cache every full block among the first n_ready tokens of s that is
 * not yet registered. n_ready counts tokens whose KV is in the cache, or will be once the
 * current step's forward has run: a forward stores every token's KV before any attention
 * reads it, so a sequence admitted in the same step may already share these blocks. */
void bm_commit(bm *m, pd_seq *s, int32_t n_ready);
/* Forgets every prefix-cache entry (after a failed forward left blocks unwritten). */
void bm_drop_cache(bm *m);
/* Releases all of s's blocks (ref - 1; cached blocks stay reusable) and clears its table. */
void bm_free(bm *m, pd_seq *s);

int32_t bm_n_free(const bm *m);          /* blocks not referenced by any sequence */
int32_t bm_n_used(const bm *m);          /* blocks referenced by at least one sequence */
int32_t bm_block_size(const bm *m);
int32_t bm_n_blocks(const bm *m);
int64_t bm_n_cached_blocks(const bm *m); /* blocks currently registered in the prefix cache */
int32_t bm_ref(const bm *m, int32_t block); /* reference count of a block (tests) */
/* Checks internal invariants (free list vs ref counts, hash table vs blocks). Returns 0 or -1
 * and prints what is wrong (tests). */
int bm_check(const bm *m);

#endif
