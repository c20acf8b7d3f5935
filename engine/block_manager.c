/* block_manager.c -- Block pool with reference counts, an LRU free list and a prefix-cache
 * hash table (open addressing, linear probing, backward-shift deletion). */
#include "engine/block_manager.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

typedef struct {
    int32_t ref;        /* sequences holding the block */
    int32_t prev, next; /* free-list links (-1 = none) */
    bool in_free;
    bool hashed;        /* registered in the prefix cache under `hash` */
    uint64_t hash;
} blk;

struct bm {
    bm_params p;
    blk *b;
    int32_t *tokens;    /* [n_blocks][block_size] token ids of hashed blocks */
    int32_t free_head, free_tail, n_free;
    uint64_t *ht_key;   /* hash table: key = block hash, val = block id or -1 */
    int32_t *ht_val;
    uint32_t ht_mask;
    int64_t n_cached;
    int32_t *scratch;   /* candidate hit blocks during allocation [n_blocks] */
};

bm_params bm_default_params(void)
{
    bm_params p = {.n_blocks = 1024, .block_size = 16, .enable_prefix_cache = true};
    return p;
}


/* ---- hash table ---- */

static uint32_t ht_slot(const bm *m, uint64_t key) { return (uint32_t)(key ^ (key >> 32)) & m->ht_mask; }

static int32_t ht_get(const bm *m, uint64_t key)
{
    for (uint32_t i = ht_slot(m, key);; i = (i + 1) & m->ht_mask) {
        if (m->ht_val[i] < 0) return -1;
        if (m->ht_key[i] == key) return m->ht_val[i];
    }
}

static void ht_put(bm *m, uint64_t key, int32_t val)
{
    uint32_t i = ht_slot(m, key);
    while (m->ht_val[i] >= 0) i = (i + 1) & m->ht_mask;
    m->ht_key[i] = key;
    m->ht_val[i] = val;
}

static void ht_del(bm *m, uint64_t key)
{
    uint32_t i = ht_slot(m, key);
    while (m->ht_val[i] >= 0 && m->ht_key[i] != key) i = (i + 1) & m->ht_mask;
    if (m->ht_val[i] < 0) return;
    /* Backward-shift: move later entries of the probe run into the hole. */
    uint32_t hole = i;
    for (uint32_t j = (i + 1) & m->ht_mask; m->ht_val[j] >= 0; j = (j + 1) & m->ht_mask) {
        uint32_t home = ht_slot(m, m->ht_key[j]);
        /* j's entry may move to hole if home is not in (hole, j] cyclically. */
        bool between = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!between) {
            m->ht_key[hole] = m->ht_key[j];
            m->ht_val[hole] = m->ht_val[j];
            hole = j;
        }
    }
    m->ht_val[hole] = -1;
}

/* ---- free list ---- */

static void free_unlink(bm *m, int32_t id)
{
    blk *x = &m->b[id];
    if (x->prev >= 0) m->b[x->prev].next = x->next; else m->free_head = x->next;
    if (x->next >= 0) m->b[x->next].prev = x->prev; else m->free_tail = x->prev;
    x->prev = x->next = -1;
    x->in_free = false;
    m->n_free--;
}

static void free_push(bm *m, int32_t id, bool front)
{
    blk *x = &m->b[id];
    x->in_free = true;
    if (front) {
        x->prev = -1;
        x->next = m->free_head;
        if (m->free_head >= 0) m->b[m->free_head].prev = id; else m->free_tail = id;
        m->free_head = id;
    } else {
        x->next = -1;
        x->prev = m->free_tail;
        if (m->free_tail >= 0) m->b[m->free_tail].next = id; else m->free_head = id;
        m->free_tail = id;
    }
    m->n_free++;
}

static void uncache(bm *m, int32_t id)
{
    blk *x = &m->b[id];
    if (!x->hashed) return;
    ht_del(m, x->hash);
    x->hashed = false;
    m->n_cached--;
}

/* Takes the least recently freed block, dropping its cache entry. */
static int32_t take_fresh(bm *m)
{
    int32_t id = m->free_head;
    free_unlink(m, id);
    uncache(m, id);
    m->b[id].ref = 1;
    return id;
}

int bm_create(const bm_params *p, bm **out)
{
    *out = NULL;
    if (p->n_blocks <= 0 || p->block_size <= 0 || p->block_size > 4096) return PD_EINVAL;
    bm *m = calloc(1, sizeof *m);
    if (!m) return PD_ENOMEM;
    m->p = *p;
    uint32_t cap = 16;
    while (cap < 2u * (uint32_t)p->n_blocks) cap <<= 1;
    m->ht_mask = cap - 1;
    m->b = calloc((size_t)p->n_blocks, sizeof *m->b);
    m->tokens = malloc((size_t)p->n_blocks * (size_t)p->block_size * sizeof(int32_t));
    m->ht_key = calloc(cap, sizeof *m->ht_key);
    m->ht_val = malloc(cap * sizeof *m->ht_val);
    m->scratch = malloc((size_t)p->n_blocks * sizeof *m->scratch);
    if (!m->b || !m->tokens || !m->ht_key || !m->ht_val || !m->scratch) {
        bm_destroy(m);
        return PD_ENOMEM;
    }
    for (uint32_t i = 0; i < cap; i++) m->ht_val[i] = -1;
    m->free_head = m->free_tail = -1;
    for (int32_t i = 0; i < p->n_blocks; i++) free_push(m, i, false);
    *out = m;
    return 0;
}

void bm_destroy(bm *m)
{
    if (!m) return;
    free(m->b);
    free(m->tokens);
    free(m->ht_key);
    free(m->ht_val);
    free(m->scratch);
    free(m);
}

/* Finds the leading cached blocks of s (ids into m->scratch). Returns their count and sets
 * *n_free_hits to how many of them are currently unreferenced, *last to the last hit's hash. */
static int32_t find_hits(const bm *m, const pd_seq *s, int32_t *n_free_hits, uint64_t *last)
{
    *n_free_hits = 0;
    *last = 0;
    if (!m->p.enable_prefix_cache || s->skip_prefix_cache) return 0;
    const int32_t bs = m->p.block_size, max_hit = (s->n_tokens - 1) / bs;
    uint64_t h = 0;
    int32_t n = 0;
    for (; n < max_hit; n++) {
        const int32_t *t = s->tokens + (size_t)n * bs;
        h = pd_block_hash(h, t, bs);
        int32_t id = ht_get(m, h);
        if (id < 0 || memcmp(m->tokens + (size_t)id * bs, t, (size_t)bs * sizeof(int32_t)) != 0)
            break;
        m->scratch[n] = id;
        if (m->b[id].ref == 0) (*n_free_hits)++;
        *last = h;
    }
    return n;
}

int bm_can_allocate(const bm *m, const pd_seq *s, int32_t n_reserve)
{
    const int32_t bs = m->p.block_size;
    if (n_reserve < s->n_tokens) n_reserve = s->n_tokens;
    int32_t need = (n_reserve + bs - 1) / bs, free_hits;
    uint64_t last;
    if (need > s->max_blocks) return PD_EINVAL;
    int32_t hits = find_hits(m, s, &free_hits, &last);
    if (need - hits + free_hits > m->n_free) return PD_ENOSPC;
    return hits * bs;
}

int bm_allocate(bm *m, pd_seq *s, int32_t n_reserve)
{
    PD_ASSERT(s->n_blocks == 0, "bm_allocate on a sequence that holds blocks");
    const int32_t bs = m->p.block_size;
    if (n_reserve < s->n_tokens) n_reserve = s->n_tokens;
    int32_t need = (n_reserve + bs - 1) / bs, free_hits;
    uint64_t last;
    if (need > s->max_blocks) return PD_EINVAL;
    int32_t hits = find_hits(m, s, &free_hits, &last);
    if (need - hits + free_hits > m->n_free) return PD_ENOSPC;
    for (int32_t i = 0; i < hits; i++) {
        int32_t id = m->scratch[i];
        if (m->b[id].in_free) free_unlink(m, id);
        m->b[id].ref++;
        s->block_table[i] = id;
    }
    for (int32_t i = hits; i < need; i++) s->block_table[i] = take_fresh(m);
    s->n_blocks = need;
    s->n_cached = s->n_computed = hits * bs;
    s->n_hashed = hits;
    s->last_hash = last;
    return hits * bs;
}

bool bm_can_append(const bm *m, const pd_seq *s, int32_t n_total)
{
    const int32_t bs = m->p.block_size, need = (n_total + bs - 1) / bs - s->n_blocks;
    if ((n_total + bs - 1) / bs > s->max_blocks) return false;
    return need <= m->n_free;
}

int bm_append(bm *m, pd_seq *s, int32_t n_total)
{
    if (!bm_can_append(m, s, n_total)) return PD_ENOSPC;
    const int32_t bs = m->p.block_size, want = (n_total + bs - 1) / bs;
    while (s->n_blocks < want) s->block_table[s->n_blocks++] = take_fresh(m);
    return 0;
}

int bm_fork(bm *m, const pd_seq *parent, pd_seq *child, int32_t n_shared, int32_t n_fresh)
{
    PD_ASSERT(child->n_blocks == 0, "bm_fork onto a sequence that holds blocks");
    PD_ASSERT(n_shared >= 0 && n_shared <= parent->n_blocks && n_fresh >= 0 &&
              n_shared + n_fresh <= child->max_blocks, "bm_fork: bad block counts");
    if (n_fresh > m->n_free) return PD_ENOSPC;
    for (int32_t i = 0; i < n_shared; i++) {
        const int32_t id = parent->block_table[i];
        m->b[id].ref++; /* held by the parent: never in the free list */
        child->block_table[i] = id;
    }
    for (int32_t i = 0; i < n_fresh; i++) child->block_table[n_shared + i] = take_fresh(m);
    child->n_blocks = n_shared + n_fresh;
    /* the shared blocks' hashes are the parent's (registered, or walked past with the cache
     * off); the fresh ones are registered as the child's tokens fill them */
    const bool same = parent->n_hashed <= n_shared; /* else: hashed again from the start */
    child->n_hashed = same ? parent->n_hashed : 0;
    child->last_hash = same ? parent->last_hash : 0;
    return 0;
}

void bm_commit(bm *m, pd_seq *s, int32_t n_ready)
{
    const int32_t bs = m->p.block_size;
    if (n_ready > s->n_tokens) n_ready = s->n_tokens; /* never hash tokens that don't exist */
    while ((s->n_hashed + 1) * bs <= n_ready && s->n_hashed < s->n_blocks) {
        const int32_t *t = s->tokens + (size_t)s->n_hashed * bs;
        uint64_t h = pd_block_hash(s->last_hash, t, bs);
        int32_t id = s->block_table[s->n_hashed];
        blk *x = &m->b[id];
        if (m->p.enable_prefix_cache && !x->hashed && ht_get(m, h) < 0) {
            x->hashed = true;
            x->hash = h;
            memcpy(m->tokens + (size_t)id * bs, t, (size_t)bs * sizeof(int32_t));
            ht_put(m, h, id);
            m->n_cached++;
        }
        s->last_hash = h;
        s->n_hashed++;
    }
}

void bm_drop_cache(bm *m)
{
    for (int32_t id = 0; id < m->p.n_blocks; id++) uncache(m, id);
}

void bm_free(bm *m, pd_seq *s)
{
    /* Last block first: a sequence's tail is evicted before its (more shareable) head. */
    for (int32_t i = s->n_blocks - 1; i >= 0; i--) {
        int32_t id = s->block_table[i];
        blk *x = &m->b[id];
        PD_ASSERT(x->ref > 0, "freeing a block that is not referenced");
        if (--x->ref == 0) free_push(m, id, !x->hashed); /* uncached blocks are reused first */
    }
    s->n_blocks = 0;
    s->n_hashed = 0;
    s->last_hash = 0;
}

int32_t bm_n_free(const bm *m) { return m->n_free; }
int32_t bm_n_used(const bm *m) { return m->p.n_blocks - m->n_free; }
int32_t bm_block_size(const bm *m) { return m->p.block_size; }
int32_t bm_n_blocks(const bm *m) { return m->p.n_blocks; }
int64_t bm_n_cached_blocks(const bm *m) { return m->n_cached; }
int32_t bm_ref(const bm *m, int32_t block) { return m->b[block].ref; }

int bm_check(const bm *m)
{
    int32_t n = 0;
    for (int32_t id = m->free_head; id >= 0; id = m->b[id].next) {
        if (!m->b[id].in_free || m->b[id].ref != 0) {
            fprintf(stderr, "bm_check: block %d in free list with ref %d\n", id, m->b[id].ref);
            return -1;
        }
        if (++n > m->p.n_blocks) {
            fprintf(stderr, "bm_check: free list has a cycle\n");
            return -1;
        }
    }
    if (n != m->n_free) {
        fprintf(stderr, "bm_check: free list length %d, counter %d\n", n, m->n_free);
        return -1;
    }
    int64_t hashed = 0;
    for (int32_t id = 0; id < m->p.n_blocks; id++) {
        const blk *x = &m->b[id];
        if (x->ref < 0 || (x->ref == 0) != x->in_free) {
            fprintf(stderr, "bm_check: block %d ref %d in_free %d\n", id, x->ref, x->in_free);
            return -1;
        }
        if (x->hashed) {
            hashed++;
            if (ht_get(m, x->hash) != id) {
                fprintf(stderr, "bm_check: block %d hashed but not found in the table\n", id);
                return -1;
            }
        }
    }
    if (hashed != m->n_cached) {
        fprintf(stderr, "bm_check: %lld hashed blocks, counter %lld\n", (long long)hashed,
                (long long)m->n_cached);
        return -1;
    }
    return 0;
}
