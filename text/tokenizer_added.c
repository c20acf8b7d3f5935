/* tokenizer_added.c -- Added tokens (<|im_start|>, <s>, ...): a byte trie over their strings
 * and the split of a text into added tokens and the text between them, with HF's
 * leftmost-longest matching and its single_word / lstrip / rstrip rules. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/tokenizer_impl.h"

typedef struct {
    const char *s;
    size_t len;
    int32_t added; /* index into the added-token array */
} pat_t;

static int pat_cmp(const void *a, const void *b)
{
    const pat_t *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->s, y->s, n);
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->added < y->added ? -1 : x->added > y->added;
}

/* Fills node `node` from the sorted patterns p[lo, hi) that share their first depth bytes. */
static void build_node(tok__trie *tr, const pat_t *p, size_t lo, size_t hi, size_t depth,
                       uint32_t node)
{
    tr->nodes[node].added = -1;
    while (lo < hi && p[lo].len == depth) {
        if (tr->nodes[node].added < 0) tr->nodes[node].added = p[lo].added;
        lo++;
    }
    uint32_t n_edges = 0;
    for (size_t i = lo; i < hi; i++)
        if (i == lo || p[i].s[depth] != p[i - 1].s[depth]) n_edges++;
    uint32_t first = tr->n_edges;
    tr->nodes[node].first_edge = first;
    tr->nodes[node].n_edges = (uint16_t)n_edges;
    tr->n_edges += n_edges;
    uint32_t e = first;
    for (size_t i = lo; i < hi;) {
        size_t j = i + 1;
        while (j < hi && p[j].s[depth] == p[i].s[depth]) j++;
        uint32_t child = tr->n_nodes++;
        tr->edge_byte[e] = (uint8_t)p[i].s[depth];
        tr->edge_node[e] = child;
        e++;
        build_node(tr, p, i, j, depth + 1, child);
        i = j;
    }
}

int tok__trie_build(tok__trie *tr, const tok__added *added, int32_t n_added, bool normalized)
{
    memset(tr, 0, sizeof *tr);
    pat_t *p = malloc((size_t)(n_added ? n_added : 1) * sizeof *p);
    if (!p) return PD_ENOMEM;
    size_t n = 0, bytes = 0;
    for (int32_t i = 0; i < n_added; i++) {
        const tok__added *a = &added[i];
        if (a->normalized != normalized || a->len == 0) continue;
        p[n].s = normalized && a->norm ? a->norm : a->content;
        p[n].len = normalized && a->norm ? a->norm_len : a->len;
        p[n].added = i;
        if (p[n].len == 0) continue;
        bytes += p[n].len;
        n++;
    }
    if (n == 0) {
        free(p);
        return 0;
    }
    qsort(p, n, sizeof *p, pat_cmp);
    tr->nodes = malloc((bytes + 1) * sizeof *tr->nodes);
    tr->edge_byte = malloc(bytes);
    tr->edge_node = malloc(bytes * sizeof *tr->edge_node);
    if (!tr->nodes || !tr->edge_byte || !tr->edge_node) {
        free(p);
        tok__trie_free(tr);
        return PD_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)p[i].s[0];
        tr->root_has[b >> 3] |= (uint8_t)(1u << (b & 7));
    }
    tr->n_nodes = 1;
    build_node(tr, p, 0, n, 0, 0);
    free(p);
    return 0;
}

void tok__trie_free(tok__trie *tr)
{
    free(tr->nodes);
    free(tr->edge_byte);
    free(tr->edge_node);
    memset(tr, 0, sizeof *tr);
}

/* Longest token starting at s[i]: returns its added index and end, or -1. */
static int32_t trie_longest(const tok__trie *tr, const char *s, size_t len, size_t i, size_t *end)
{
    int32_t best = -1;
    uint32_t node = 0;
    for (size_t j = i; j < len; j++) {
        const tok__trie_node *nd = &tr->nodes[node];
        uint8_t b = (uint8_t)s[j];
        const uint8_t *eb = tr->edge_byte + nd->first_edge;
        uint32_t lo = 0, hi = nd->n_edges;
        while (lo < hi) { /* edges are sorted by byte */
            uint32_t mid = (lo + hi) / 2;
            if (eb[mid] < b) lo = mid + 1;
            else hi = mid;
        }
        if (lo == nd->n_edges || eb[lo] != b) break;
        node = tr->edge_node[nd->first_edge + lo];
        if (tr->nodes[node].added >= 0) {
            best = tr->nodes[node].added;
            *end = j + 1;
        }
    }
    return best;
}

/* The character that ends at s[i] (i > 0). */
static uint32_t char_before(const char *s, size_t i, size_t *start)
{
    size_t k = i - 1;
    while (k > 0 && ((uint8_t)s[k] & 0xC0) == 0x80) k--;
    size_t n;
    *start = k;
    return tok__utf8_next(s + k, &n);
}

int tok__added_split(const tok_tokenizer *t, const tok__trie *tr, const char *s, size_t len,
                     tok__spans *spans, tok__ids *which)
{
    spans->n = 0;
    which->n = 0;
    size_t start_offset = 0, pos = 0;
    while (tr->nodes && pos < len) {
        size_t ms = 0, me = 0;
        int32_t a = -1;
        for (size_t i = pos; i < len; i++) {
            uint8_t b = (uint8_t)s[i];
            if (!(tr->root_has[b >> 3] & (1u << (b & 7)))) continue;
            if ((a = trie_longest(tr, s, len, i, &me)) >= 0) {
                ms = i;
                break;
            }
        }
        if (a < 0) break;
        pos = me; /* the matcher goes on after the raw match, whatever the stripping */
        const tok__added *tok = &t->added[a];
        size_t n, k;
        if (tok->single_word) {
            bool start_space = ms == 0 || !tok__is_word(char_before(s, ms, &k));
            bool stop_space = me == len || !tok__is_word(tok__utf8_next(s + me, &n));
            if (!start_space || !stop_space) continue;
        }
        size_t start = ms, stop = me;
        if (tok->lstrip) {
            size_t ns = start;
            while (ns > 0 && tok__is_space(char_before(s, ns, &k))) ns = k;
            start = ns > start_offset ? ns : start_offset;
        }
        if (tok->rstrip)
            while (stop < len && tok__is_space(tok__utf8_next(s + stop, &n))) stop += n;
        if (start_offset < start &&
            (tok__spans_push(spans, start_offset, start, false) || tok__ids_push(which, -1)))
            return PD_ENOMEM;
        if (tok__spans_push(spans, start, stop, true) || tok__ids_push(which, tok->id))
            return PD_ENOMEM;
        start_offset = stop;
    }
    if (start_offset < len &&
        (tok__spans_push(spans, start_offset, len, false) || tok__ids_push(which, -1)))
        return PD_ENOMEM;
    return 0;
}
