/* tokenizer_bpe.c -- The BPE model: vocabulary and merge-rank hash tables, the GPT-2 byte
 * alphabet, and merging one pre-token with a priority queue of candidate pairs (lowest merge
 * rank first, then leftmost), the same order as HF's Word::merge_all, in O(n log n). */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/error.h"
#include "text/tokenizer_impl.h"

uint32_t tok__hash(const char *s, size_t len)
{
    uint32_t h = (uint32_t)XXH3_64bits(s, len);
    return h ? h : 1;
}

/* ---- vocabulary: string -> id ---- */

int32_t tok__vocab_get(const tok_tokenizer *t, const char *s, size_t len)
{
    if (!t->vocab_slots) return -1;
    uint32_t h = tok__hash(s, len);
    for (uint32_t i = h & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
        const tok__vslot *v = &t->vocab_slots[i];
        if (!v->hash) return -1;
        if (v->hash == h && v->len == len && memcmp(t->arena + v->off, s, len) == 0) return v->id;
    }
}

int tok__vocab_index(tok_tokenizer *t)
{
    uint32_t cap = 16;
    while (cap < (uint32_t)t->vocab_count + (uint32_t)t->vocab_count / 2u + 16u) cap *= 2;
    free(t->vocab_slots);
    t->vocab_slots = calloc(cap, sizeof *t->vocab_slots);
    if (!t->vocab_slots) return PD_ENOMEM;
    t->vocab_mask = cap - 1;
    for (int32_t id = 0; id < t->n_ids; id++) {
        if (t->model_off[id] == UINT32_MAX) continue;
        const char *s = t->arena + t->model_off[id];
        uint32_t h = tok__hash(s, t->model_len[id]);
        uint32_t i = h & t->vocab_mask;
        while (t->vocab_slots[i].hash) i = (i + 1) & t->vocab_mask;
        t->vocab_slots[i] = (tok__vslot){h, id, t->model_off[id], t->model_len[id]};
    }
    return 0;
}

/* ---- merges: (left id, right id) -> (rank, merged id) ---- */

static inline uint32_t merge_slot(uint64_t key, uint32_t mask)
{
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & mask;
}

int tok__merges_reserve(tok_tokenizer *t, size_t n)
{
    uint32_t cap = 16;
    while (cap < n + n / 2 + 16) cap *= 2; /* load <= 2/3: small enough to stay in cache */
    t->merges = malloc((size_t)cap * sizeof *t->merges);
    if (!t->merges) return PD_ENOMEM;
    for (uint32_t i = 0; i < cap; i++) t->merges[i].key = UINT64_MAX;
    t->merge_mask = cap - 1;
    return 0;
}

void tok__merges_put(tok_tokenizer *t, int32_t a, int32_t b, uint32_t rank, int32_t id)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t i = merge_slot(key, t->merge_mask);
    while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key) i = (i + 1) & t->merge_mask;
    t->merges[i] = (tok__merge){key, rank, id};
}

static inline const tok__merge *merge_get(const tok_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (uint32_t i = merge_slot(key, t->merge_mask);; i = (i + 1) & t->merge_mask) {
        const tok__merge *m = &t->merges[i];
        if (m->key == key) return m;
        if (m->key == UINT64_MAX) return NULL;
    }
}

/* ---- GPT-2 byte alphabet: printable Latin-1 bytes map to themselves, the other 68 bytes
 * to U+0100.. in byte order ---- */

uint32_t tok__byte_char(uint8_t b)
{
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174) return b;
    if (b <= 32) return 256u + b;
    if (b <= 160) return 256u + 33u + (b - 127u);
    return 256u + 67u; /* 173 */
}

int tok__char_byte(uint32_t cp)
{
    if ((cp >= 33 && cp <= 126) || (cp >= 161 && cp <= 172) || (cp >= 174 && cp <= 255))
        return (int)cp;
    if (cp >= 256 && cp <= 288) return (int)(cp - 256);
    if (cp >= 289 && cp <= 322) return (int)(cp - 289 + 127);
    if (cp == 323) return 173;
    return -1;
}

/* ---- merging ---- */

typedef struct {
    int32_t id;         /* token id of the symbol */
    int32_t prev, next; /* neighbours, -1 at the ends */
    uint32_t len;       /* 0 = merged into its left neighbour */
} sym_t;

typedef struct {
    uint64_t key; /* rank << 32 | position: lowest first */
    int32_t id;   /* merged id expected when popped (stale entries are skipped) */
} qent_t;

void tok__work_free(tok__work *w)
{
    tok__matcher_free(&w->m);
    tok__buf_free(&w->norm[0]);
    tok__buf_free(&w->norm[1]);
    for (int i = 0; i < TOK__MAX_STAGES; i++) {
        tok__buf_free(&w->content[i]);
        free(w->spans[i].v);
    }
    tok__buf_free(&w->word);
    tok__buf_free(&w->mapped);
    free(w->sym);
    free(w->heap);
    free(w->cache);
    memset(w, 0, sizeof *w);
}

static int reserve_syms(tok__work *w, size_t n)
{
    if (n <= w->sym_cap) return 0;
    size_t cap = w->sym_cap ? w->sym_cap : 64;
    while (cap < n) cap *= 2;
    void *s = realloc(w->sym, cap * sizeof(sym_t));
    void *h = realloc(w->heap, cap * 3 * sizeof(qent_t));
    if (s) w->sym = s;
    if (h) w->heap = h;
    if (!s || !h) return PD_ENOMEM;
    w->sym_cap = cap;
    return 0;
}

static inline void sym_add(sym_t *sy, size_t *n, int32_t id, uint32_t len)
{
    size_t i = (*n)++;
    sy[i] = (sym_t){id, (int32_t)i - 1, -1, len};
    if (i) sy[i - 1].next = (int32_t)i;
}

static inline void heap_push(qent_t *h, size_t *n, qent_t e)
{
    size_t i = (*n)++;
    while (i) {
        size_t p = (i - 1) / 2;
        if (h[p].key <= e.key) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static inline qent_t heap_pop(qent_t *h, size_t *n)
{
    qent_t top = h[0], last = h[--*n];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && h[c + 1].key < h[c].key) c++;
        if (last.key <= h[c].key) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = last;
    return top;
}

static inline void queue_pair(const tok_tokenizer *t, const sym_t *sy, qent_t *h, size_t *nh,
                              int32_t pos)
{
    const tok__merge *m = merge_get(t, sy[pos].id, sy[sy[pos].next].id);
    if (m) heap_push(h, nh, (qent_t){(uint64_t)m->rank << 32 | (uint32_t)pos, m->id});
}

/* Applies merges to sy[0, n) in HF's order. The queue never holds more than 3n entries:
 * n - 1 at first, then at most two per merge, and there are fewer than n merges. */
static void merge_all(const tok_tokenizer *t, sym_t *sy, size_t n, qent_t *h)
{
    size_t nh = 0;
    /* the first lookups are independent: start all their memory loads at once */
    for (size_t i = 0; i + 1 < n && i < 64; i++) {
        uint64_t key = (uint64_t)(uint32_t)sy[i].id << 32 | (uint32_t)sy[i + 1].id;
        __builtin_prefetch(&t->merges[merge_slot(key, t->merge_mask)]);
    }
    for (size_t i = 0; i + 1 < n; i++) queue_pair(t, sy, h, &nh, (int32_t)i);
    while (nh) {
        qent_t top = heap_pop(h, &nh);
        int32_t pos = (int32_t)(uint32_t)top.key;
        sym_t *cur = &sy[pos];
        if (cur->len == 0 || cur->next < 0) continue;
        sym_t *right = &sy[cur->next];
        const tok__merge *m = merge_get(t, cur->id, right->id);
        if (!m || m->id != top.id) continue; /* stale entry */
        cur->id = top.id;
        cur->len += right->len;
        cur->next = right->next;
        right->len = 0;
        if (cur->next >= 0) sy[cur->next].prev = pos;
        if (cur->prev >= 0) queue_pair(t, sy, h, &nh, cur->prev);
        if (cur->next >= 0) queue_pair(t, sy, h, &nh, pos);
    }
}

/* Maps bytes to their GPT-2 characters into w->mapped. */
static int map_bytes(tok__work *w, const char *s, size_t len)
{
    w->mapped.len = 0;
    if (tok__buf_reserve(&w->mapped, len * 2)) return PD_ENOMEM;
    char *o = w->mapped.p;
    for (size_t i = 0; i < len; i++) o += tok__utf8_put(tok__byte_char((uint8_t)s[i]), o);
    w->mapped.len = (size_t)(o - w->mapped.p);
    w->mapped.p[w->mapped.len] = '\0';
    return 0;
}

/* HF's BPE::merge_word before merging: one symbol per character (with the subword prefix
 * and word suffix), byte-fallback tokens for characters not in the vocabulary, else the unk
 * token (consecutive ones fused with fuse_unk), else nothing. */
static int init_chars(const tok_tokenizer *t, tok__work *w, const char *s, size_t len,
                      size_t *n_out)
{
    sym_t *sy = w->sym;
    size_t n = 0;
    int32_t unk = -1;
    uint32_t unk_len = 0;
    for (size_t i = 0; i < len;) {
        size_t clen;
        tok__utf8_next(s + i, &clen);
        bool first = i == 0, last = i + clen == len;
        const char *key = s + i;
        size_t key_len = clen;
        int32_t id;
        if ((!first && t->cont_prefix) || (last && t->eow_suffix)) {
            w->word.len = 0;
            if ((!first && t->cont_prefix &&
                 tok__buf_put(&w->word, t->cont_prefix, t->cont_prefix_len)) ||
                tok__buf_put(&w->word, s + i, clen) ||
                (last && t->eow_suffix && tok__buf_put(&w->word, t->eow_suffix, t->eow_suffix_len)))
                return PD_ENOMEM;
            key = w->word.p;
            key_len = w->word.len;
            id = tok__vocab_get(t, key, key_len);
        } else if (clen == 1) {
            id = t->ascii_ids[(uint8_t)s[i]];
        } else {
            id = tok__vocab_get(t, key, key_len);
        }
        i += clen;
        if (id >= 0) {
            if (unk >= 0) sym_add(sy, &n, unk, unk_len);
            unk = -1;
            sym_add(sy, &n, id, (uint32_t)clen);
            continue;
        }
        if (t->byte_fallback) {
            bool all = true;
            for (size_t k = 0; k < key_len && all; k++) all = t->fallback_ids[(uint8_t)key[k]] >= 0;
            if (all) {
                if (reserve_syms(w, n + key_len + (len - i) + 1)) return PD_ENOMEM;
                sy = w->sym;
                for (size_t k = 0; k < key_len; k++)
                    sym_add(sy, &n, t->fallback_ids[(uint8_t)key[k]], 1);
                continue;
            }
        }
        if (t->unk_id == -2) return PD_EFORMAT; /* unk_token not in the vocabulary */
        if (t->unk_id >= 0) {
            if (unk >= 0 && t->fuse_unk) {
                unk_len += (uint32_t)clen;
            } else {
                if (unk >= 0) sym_add(sy, &n, unk, unk_len);
                unk = t->unk_id;
                unk_len = (uint32_t)clen;
            }
        }
    }
    if (unk >= 0) sym_add(sy, &n, unk, unk_len);
    *n_out = n;
    return 0;
}

static int bpe_word(const tok_tokenizer *t, tok__work *w, const char *s, size_t len, tok__ids *out);

int tok__bpe_encode(const tok_tokenizer *t, tok__work *w, const char *s, size_t len, tok__ids *out)
{
    if (len == 0) return 0;
    if (!w->cache || len > sizeof w->cache->word) return bpe_word(t, w, s, len, out);
    uint64_t h = XXH3_64bits(s, len);
    tok__cache_slot *c = &w->cache[h & (TOK__CACHE_SLOTS - 1)];
    if (c->gen == t->gen && c->hash == (uint32_t)(h >> 32) && c->len == len &&
        memcmp(c->word, s, len) == 0) {
        for (int i = 0; i < c->n; i++)
            if (tok__ids_push(out, c->ids[i])) return PD_ENOMEM;
        return 0;
    }
    size_t first = out->n;
    int rc = bpe_word(t, w, s, len, out);
    if (rc || out->n - first > sizeof c->ids / sizeof c->ids[0]) return rc;
    c->gen = t->gen;
    c->hash = (uint32_t)(h >> 32);
    c->len = (uint8_t)len;
    c->n = (uint8_t)(out->n - first);
    memcpy(c->word, s, len);
    memcpy(c->ids, out->v + first, c->n * sizeof *c->ids);
    return 0;
}

/* One pre-token through the model, without the cache. */
static int bpe_word(const tok_tokenizer *t, tok__work *w, const char *s, size_t len, tok__ids *out)
{
    bool fast = t->byte_level && !t->cont_prefix && !t->eow_suffix;
    const char *str = s;
    size_t slen = len;
    if (t->byte_level && (t->ignore_merges || !fast)) {
        if (map_bytes(w, s, len)) return PD_ENOMEM;
        str = w->mapped.p;
        slen = w->mapped.len;
    }
    if (t->ignore_merges) {
        int32_t id = tok__vocab_get(t, str, slen);
        if (id >= 0) return tok__ids_push(out, id);
    }
    if (reserve_syms(w, slen + 1)) return PD_ENOMEM;
    sym_t *sy = w->sym;
    size_t n = 0;
    if (fast) {
        for (size_t i = 0; i < len; i++) {
            int32_t id = t->byte_ids[(uint8_t)s[i]];
            if (id < 0) { /* the vocab lacks a byte character: take the general path */
                fast = false;
                break;
            }
            sym_add(sy, &n, id, 1);
        }
        if (!fast) {
            if (map_bytes(w, s, len) || reserve_syms(w, w->mapped.len + 1)) return PD_ENOMEM;
            str = w->mapped.p;
            slen = w->mapped.len;
        }
    }
    if (!fast) {
        int rc = init_chars(t, w, str, slen, &n);
        if (rc) return rc;
        sy = w->sym;
    }
    if (n > 1) merge_all(t, sy, n, w->heap);
    for (int32_t i = n ? 0 : -1; i >= 0; i = sy[i].next)
        if (tok__ids_push(out, sy[i].id)) return PD_ENOMEM;
    return 0;
}
