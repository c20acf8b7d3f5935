/* tokenizer.c -- Encoding (HF's encode: added tokens split out of the raw text, then per
 * piece normalizer, added tokens in the normalized text, pre-tokenizers and BPE, then the
 * post-processor template), the accessors, and freeing a tokenizer. Loading is in
 * tokenizer_load.c, decoding in tokenizer_decode.c. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/tokenizer_impl.h"

void tok__free_pipeline(tok_tokenizer *t)
{
    for (int i = 0; i < t->n_norms; i++) {
        free(t->norms[i].str);
        tok__pat_free(&t->norms[i].pat);
    }
    free(t->norms);
    t->norms = NULL;
    t->n_norms = 0;
    for (int i = 0; i < t->n_pretoks; i++) tok__pat_free(&t->pretoks[i].pat);
    t->n_pretoks = 0;
    for (int i = 0; i < t->n_decs; i++) {
        free(t->decs[i].content);
        tok__pat_free(&t->decs[i].pat);
    }
    t->n_decs = 0;
}

void tok_destroy(tok_tokenizer *t)
{
    if (!t) return;
    tok__free_pipeline(t);
    free(t->arena);
    free(t->model_off);
    free(t->model_len);
    free(t->vocab_slots);
    free(t->merges);
    free(t->cont_prefix);
    free(t->eow_suffix);
    free(t->dec_off);
    free(t->dec_len);
    free(t->flags);
    free(t->tmpl_pre);
    free(t->tmpl_post);
    for (int32_t i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        free(t->added[i].norm);
    }
    free(t->added);
    tok__trie_free(&t->trie_raw);
    tok__trie_free(&t->trie_norm);
    free(t);
}

/* Scratch of encoding. */
typedef struct {
    tok__work w;
    tok__spans raw_spans, norm_spans; /* added-token splits of the text and of a piece */
    tok__ids raw_which, norm_which;
} enc_t;

static void enc_free(enc_t *e)
{
    tok__work_free(&e->w);
    free(e->raw_spans.v);
    free(e->norm_spans.v);
    free(e->raw_which.v);
    free(e->norm_which.v);
    memset(e, 0, sizeof *e);
}

struct tok_scratch {
    enc_t e;
};

int tok_scratch_create(tok_scratch **out)
{
    tok_scratch *s = calloc(1, sizeof *s);
    *out = NULL;
    if (!s) return PD_ENOMEM;
    s->e.w.cache = calloc(TOK__CACHE_SLOTS, sizeof *s->e.w.cache);
    if (!s->e.w.cache) {
        free(s);
        return PD_ENOMEM;
    }
    *out = s;
    return 0;
}

void tok_scratch_destroy(tok_scratch *s)
{
    if (!s) return;
    enc_free(&s->e);
    free(s);
}

/* One piece of raw text between added tokens: normalize, split out normalized added tokens,
 * pre-tokenize and run the model. */
static int encode_piece(const tok_tokenizer *t, enc_t *e, const char *s, size_t len, bool at_start,
                        tok__ids *out)
{
    const char *ns;
    size_t nl;
    int rc = tok__normalize(t, &e->w, s, len, &ns, &nl);
    if (rc) return rc;
    if (!t->trie_norm.nodes) return tok__pretokenize(t, &e->w, 0, ns, nl, at_start, out);
    if ((rc = tok__added_split(t, &t->trie_norm, ns, nl, &e->norm_spans, &e->norm_which)))
        return rc;
    for (size_t i = 0; i < e->norm_spans.n && !rc; i++) {
        tok__span x = e->norm_spans.v[i];
        if (e->norm_which.v[i] >= 0) rc = tok__ids_push(out, e->norm_which.v[i]);
        else rc = tok__pretokenize(t, &e->w, 0, ns + x.s, x.e - x.s, at_start && x.s == 0, out);
    }
    return rc;
}

static int encode(const tok_tokenizer *t, enc_t *e, const char *text, size_t len, bool add_special,
                  int32_t **ids, int32_t *n, char *err)
{
    *ids = NULL;
    *n = 0;
    if (!text && len) return pd_errf(err, PD_EINVAL, "text is NULL");
    size_t bad = tok__utf8_check(text, len);
    if (bad != len)
        return pd_errf(err, PD_EINVAL, "text is not valid UTF-8 (byte %zu of %zu: 0x%02X)", bad,
                       len, (unsigned)(uint8_t)text[bad]);
    tok__ids out = {0};
    int rc = 0;
    out.cap = len / 3 + 16; /* most text needs fewer ids than that */
    if (!(out.v = malloc(out.cap * sizeof *out.v)))
        return pd_errf(err, PD_ENOMEM, "out of memory encoding");
    for (int32_t i = 0; add_special && i < t->n_tmpl_pre && !rc; i++)
        rc = tok__ids_push(&out, t->tmpl_pre[i]);
    if (!rc) rc = tok__added_split(t, &t->trie_raw, text, len, &e->raw_spans, &e->raw_which);
    for (size_t i = 0; i < e->raw_spans.n && !rc; i++) {
        tok__span x = e->raw_spans.v[i];
        if (e->raw_which.v[i] >= 0) rc = tok__ids_push(&out, e->raw_which.v[i]);
        else rc = encode_piece(t, e, text + x.s, x.e - x.s, x.s == 0, &out);
    }
    for (int32_t i = 0; add_special && i < t->n_tmpl_post && !rc; i++)
        rc = tok__ids_push(&out, t->tmpl_post[i]);
    if (!rc && out.n > INT32_MAX) rc = pd_errf(err, PD_ERANGE, "too many tokens");
    if (rc) {
        free(out.v);
        if (rc == PD_ENOMEM) return pd_errf(err, rc, "out of memory encoding");
        if (rc == PD_EFORMAT)
            return pd_errf(err, rc, "the model's unk_token is not in its vocabulary");
        if (rc == PD_EINVAL) return pd_errf(err, rc, "regex match failed");
        return rc;
    }
    if (out.n == 0) {
        free(out.v);
        return 0;
    }
    *ids = out.v;
    *n = (int32_t)out.n;
    return 0;
}

int tok_encode(const tok_tokenizer *t, const char *text, size_t len, bool add_special,
               int32_t **ids, int32_t *n, char *err)
{
    enc_t e;
    memset(&e, 0, sizeof e);
    int rc = encode(t, &e, text, len, add_special, ids, n, err);
    enc_free(&e);
    return rc;
}

int tok_encode_scratch(const tok_tokenizer *t, tok_scratch *s, const char *text, size_t len,
                       bool add_special, int32_t **ids, int32_t *n, char *err)
{
    return encode(t, &s->e, text, len, add_special, ids, n, err);
}

/* ---- accessors ---- */

int32_t tok_vocab_size(const tok_tokenizer *t)
{
    return t->n_ids;
}
int32_t tok_bos_id(const tok_tokenizer *t)
{
    return t->bos_id;
}
int32_t tok_eos_id(const tok_tokenizer *t)
{
    return t->eos_id;
}
bool tok_add_bos(const tok_tokenizer *t)
{
    return t->add_bos;
}

int32_t tok_token_to_id(const tok_tokenizer *t, const char *s, size_t len)
{
    for (int32_t i = 0; i < t->n_added; i++)
        if (t->added[i].len == len && memcmp(t->added[i].content, s, len) == 0)
            return t->added[i].id;
    return tok__vocab_get(t, s, len);
}

const char *tok_id_to_token(const tok_tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_ids) return NULL;
    for (int32_t i = 0; (t->flags[id] & TOK__F_ADDED) && i < t->n_added; i++)
        if (t->added[i].id == id) {
            *len = t->added[i].len;
            return t->added[i].content;
        }
    if (t->model_off[id] == UINT32_MAX) return NULL;
    *len = t->model_len[id];
    return t->arena + t->model_off[id];
}

bool tok_is_special(const tok_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_ids && (t->flags[id] & TOK__F_SPECIAL);
}
