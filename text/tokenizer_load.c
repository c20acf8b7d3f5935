/* tokenizer_load.c -- Reads tokenizer.json (and tokenizer_config.json) into a tok_tokenizer:
 * the BPE vocabulary and merge tables, added tokens with HF's id assignment, the special
 * tokens of tokenizer_config.json, and the order of it all (pipeline components are read by
 * tokenizer_pipeline.c). */
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/tokenizer_impl.h"

#define ERR_FORMAT(...) pd_errf(err, PD_EFORMAT, __VA_ARGS__)
#define ERR_UNSUPPORTED(...) pd_errf(err, PD_EUNSUPPORTED, __VA_ARGS__)

/* ---- model vocabulary and merges (read by tokenizer_json.c's parsers) ---- */

typedef struct {
    tok__buf arena; /* token strings back to back */
    uint32_t *off;  /* [n] offset of each token */
    uint32_t *len;  /* [n] */
    int32_t *id;    /* [n] */
    size_t n, cap;
    int64_t max_id;
} vocab_tmp;

/* Ids at or above this are refused: the per-id tables are sized by the largest id, so one
 * token with id 10^9 would cost gigabytes (the largest real vocabularies are near 2^18). */
#define TOK_MAX_ID (1 << 24)

static int vocab_add(void *ctx, const char *key, size_t len, int64_t id, char *err)
{
    vocab_tmp *v = ctx;
    if (id >= TOK_MAX_ID)
        return ERR_FORMAT("model.vocab: id %lld of token \"%.*s\" is not below %d",
                          (long long)id, (int)(len > 100 ? 100 : len), key, TOK_MAX_ID);
    if (v->arena.len + len >= UINT32_MAX / 2) return ERR_UNSUPPORTED("model.vocab: too large");
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 1024;
        uint32_t *o = realloc(v->off, cap * sizeof *o);
        if (o) v->off = o;
        uint32_t *l = realloc(v->len, cap * sizeof *l);
        if (l) v->len = l;
        int32_t *d = realloc(v->id, cap * sizeof *d);
        if (d) v->id = d;
        if (!o || !l || !d) return PD_ENOMEM;
        v->cap = cap;
    }
    v->off[v->n] = (uint32_t)v->arena.len;
    v->len[v->n] = (uint32_t)len;
    v->id[v->n++] = (int32_t)id;
    if (id > v->max_id) v->max_id = id;
    return tok__buf_put(&v->arena, key, len);
}

static int load_vocab(tok_tokenizer *t, const char *json, const tok__json_model *jm, char *err)
{
    if (!jm->vocab_e) return ERR_FORMAT("model: \"vocab\" must be an object");
    vocab_tmp v = {.max_id = -1};
    int rc = tok__json_vocab(json, jm->vocab_s, jm->vocab_e, vocab_add, &v, err);
    if (!rc && tok__buf_reserve(&v.arena, 0)) rc = PD_ENOMEM;
    if (!rc) {
        t->n_ids = (int32_t)(v.max_id + 1);
        t->vocab_count = (int32_t)v.n;
        t->arena = v.arena.p;
        t->arena_len = v.arena.len;
        v.arena.p = NULL;
        t->model_off = malloc(((size_t)t->n_ids + 1) * sizeof *t->model_off);
        t->model_len = malloc(((size_t)t->n_ids + 1) * sizeof *t->model_len);
        if (!t->model_off || !t->model_len) rc = PD_ENOMEM;
    }
    for (int32_t i = 0; !rc && i < t->n_ids; i++) t->model_off[i] = UINT32_MAX, t->model_len[i] = 0;
    for (size_t i = 0; !rc && i < v.n; i++) {
        int32_t id = v.id[i];
        if (t->model_off[id] != UINT32_MAX) {
            rc = ERR_FORMAT("model.vocab: id %d is given to two tokens", id);
            break;
        }
        t->model_off[id] = v.off[i];
        t->model_len[id] = v.len[i];
    }
    tok__buf_free(&v.arena);
    free(v.off);
    free(v.len);
    free(v.id);
    return rc ? rc : tok__vocab_index(t);
}

typedef struct {
    tok_tokenizer *t;
    tok__buf buf;      /* the merged token */
    int64_t id_offset; /* merged id - rank of the previous merge: usually constant */
} merge_ctx;

static int32_t lookup_or_fail(const tok_tokenizer *t, const char *s, size_t len, size_t rank,
                              char *err)
{
    int32_t id = tok__vocab_get(t, s, len);
    if (id < 0)
        ERR_FORMAT("model.merges[%zu]: token \"%.*s\" is not in the vocabulary", rank,
                   (int)(len > 100 ? 100 : len), s);
    return id;
}

static int merge_add(void *ctx, size_t i, const char *a, size_t a_len, const char *b, size_t b_len,
                     char *err)
{
    merge_ctx *c = ctx;
    tok_tokenizer *t = c->t;
    if (!b) { /* legacy "a b": exactly one space */
        const char *sp = memchr(a, ' ', a_len);
        if (!sp || memchr(sp + 1, ' ', a_len - (size_t)(sp + 1 - a)))
            return ERR_FORMAT("model.merges[%zu]: \"%.*s\" is not two tokens", i,
                              (int)(a_len > 100 ? 100 : a_len), a);
        b = sp + 1;
        b_len = a_len - (size_t)(b - a);
        a_len = (size_t)(sp - a);
    }
    int32_t ia = lookup_or_fail(t, a, a_len, i, err);
    int32_t ib = ia < 0 ? -1 : lookup_or_fail(t, b, b_len, i, err);
    if (ia < 0 || ib < 0) return PD_EFORMAT;
    size_t skip = b_len >= t->cont_prefix_len ? t->cont_prefix_len : 0;
    c->buf.len = 0;
    if (tok__buf_put(&c->buf, a, a_len) || tok__buf_put(&c->buf, b + skip, b_len - skip))
        return PD_ENOMEM;
    /* merged tokens mostly follow the merge order: try the id the last merge suggests */
    int64_t guess = (int64_t)i + c->id_offset;
    int32_t im = guess >= 0 && guess < t->n_ids && t->model_len[guess] == c->buf.len &&
                         !memcmp(t->arena + t->model_off[guess], c->buf.p, c->buf.len)
                     ? (int32_t)guess
                     : lookup_or_fail(t, c->buf.p, c->buf.len, i, err);
    if (im < 0) return PD_EFORMAT;
    c->id_offset = (int64_t)im - (int64_t)i;
    tok__merges_put(t, ia, ib, (uint32_t)i, im);
    return 0;
}

static int load_merges(tok_tokenizer *t, const char *json, const tok__json_model *jm, char *err)
{
    if (!jm->merges_e) return ERR_FORMAT("model: \"merges\" must be an array");
    if (tok__merges_reserve(t, tok__json_count(json, jm->merges_s, jm->merges_e))) return PD_ENOMEM;
    merge_ctx c = {t, {0}, 0};
    int rc = tok__json_merges(json, jm->merges_s, jm->merges_e, merge_add, &c, err);
    tok__buf_free(&c.buf);
    return rc;
}

static int load_model(tok_tokenizer *t, const json_t *m, const char *json,
                      const tok__json_model *jm, char *err)
{
    if (!json_is_object(m)) return ERR_FORMAT("missing \"model\"");
    const char *type = tok__json_type(m);
    if (type && strcmp(type, "BPE"))
        return ERR_UNSUPPORTED("model \"%s\" is not supported (only BPE)", type);
    if (!type && !json_object_get(m, "merges"))
        return ERR_UNSUPPORTED("model without \"type\" and \"merges\" is not supported (only BPE)");
    json_t *dropout = json_object_get(m, "dropout");
    if (dropout && !json_is_null(dropout) &&
        (!json_is_number(dropout) || json_number_value(dropout) > 0.0))
        return ERR_UNSUPPORTED("model: BPE dropout is not supported");
    const char *s;
    size_t len;
    int rc;
    if ((rc = tok__json_str(m, "continuing_subword_prefix", &s, &len, "model", err)) < 0) return rc;
    if (rc == 0 && len) {
        if (!(t->cont_prefix = tok__strdup(s, len))) return PD_ENOMEM;
        t->cont_prefix_len = len;
    }
    if ((rc = tok__json_str(m, "end_of_word_suffix", &s, &len, "model", err)) < 0) return rc;
    if (rc == 0 && len) {
        if (!(t->eow_suffix = tok__strdup(s, len))) return PD_ENOMEM;
        t->eow_suffix_len = len;
    }
    if (tok__json_bool(m, "fuse_unk", &t->fuse_unk, "model", err) < 0 ||
        tok__json_bool(m, "byte_fallback", &t->byte_fallback, "model", err) < 0 ||
        tok__json_bool(m, "ignore_merges", &t->ignore_merges, "model", err) < 0)
        return PD_EFORMAT;
    if ((rc = load_vocab(t, json, jm, err))) return rc;
    if ((rc = load_merges(t, json, jm, err))) return rc;
    t->unk_id = -1;
    if ((rc = tok__json_str(m, "unk_token", &s, &len, "model", err)) < 0) return rc;
    if (rc == 0) {
        t->unk_id = tok__vocab_get(t, s, len);
        if (t->unk_id < 0) t->unk_id = -2; /* HF fails when it is needed */
    }
    for (int b = 0; b < 256; b++) {
        char key[8];
        size_t n = tok__utf8_put(tok__byte_char((uint8_t)b), key);
        t->byte_ids[b] = tok__vocab_get(t, key, n);
        snprintf(key, sizeof key, "<0x%02X>", b);
        t->fallback_ids[b] = tok__vocab_get(t, key, 6);
        if (b < 128) {
            key[0] = (char)b;
            t->ascii_ids[b] = tok__vocab_get(t, key, 1);
        }
    }
    return 0;
}

/* ---- added tokens, following AddedVocabulary::add_tokens ---- */

static int added_find(const tok_tokenizer *t, const char *s, size_t len)
{
    for (int32_t i = 0; i < t->n_added; i++)
        if (t->added[i].len == len && memcmp(t->added[i].content, s, len) == 0) return i;
    return -1;
}

static int load_added(tok_tokenizer *t, const json_t *list, char *err)
{
    if (!list || json_is_null(list)) return 0;
    if (!json_is_array(list)) return ERR_FORMAT("\"added_tokens\" must be an array");
    size_t n = json_array_size(list);
    t->added = calloc(n ? n : 1, sizeof *t->added);
    if (!t->added) return PD_ENOMEM;
    int32_t next_id = t->vocab_count;
    tok__work w = {0};
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        json_t *o = json_array_get(list, i);
        tok__added a = {0};
        const char *s;
        a.normalized = true;
        if (!json_is_object(o) || tok__json_str(o, "content", &s, &a.len, "added_tokens", err)) {
            rc = ERR_FORMAT("added_tokens[%zu]: needs \"content\"", i);
            break;
        }
        if (tok__json_bool(o, "special", &a.special, "added_tokens", err) < 0 ||
            tok__json_bool(o, "normalized", &a.normalized, "added_tokens", err) < 0 ||
            tok__json_bool(o, "lstrip", &a.lstrip, "added_tokens", err) < 0 ||
            tok__json_bool(o, "rstrip", &a.rstrip, "added_tokens", err) < 0 ||
            tok__json_bool(o, "single_word", &a.single_word, "added_tokens", err) < 0) {
            rc = PD_EFORMAT;
            break;
        }
        if (a.len == 0) continue;
        int prev = added_find(t, s, a.len);
        if (prev >= 0) { /* same content again: HF keeps the id and takes the new flags */
            tok__added *p = &t->added[prev];
            p->special |= a.special;
            p->normalized = a.normalized;
            p->lstrip = a.lstrip;
            p->rstrip = a.rstrip;
            p->single_word = a.single_word;
            continue;
        }
        int32_t id = tok__vocab_get(t, s, a.len);
        a.id = id >= 0 ? id : next_id++;
        if (!(a.content = tok__strdup(s, a.len))) {
            rc = PD_ENOMEM;
            break;
        }
        t->added[t->n_added++] = a;
    }
    for (int32_t i = 0; i < t->n_added && !rc;
         i++) { /* normalized forms, for matching and decoding */
        tok__added *a = &t->added[i];
        if (!a->normalized || !t->n_norms) continue;
        const char *ns;
        size_t nl;
        if ((rc = tok__normalize(t, &w, a->content, a->len, &ns, &nl))) break;
        if (nl != a->len || memcmp(ns, a->content, nl)) {
            if (!(a->norm = tok__strdup(ns, nl))) rc = PD_ENOMEM;
            a->norm_len = nl;
        }
    }
    tok__work_free(&w);
    return rc;
}

/* Sizes the per-id tables to cover added ids and fills the decoder strings and flags. */
static int build_id_tables(tok_tokenizer *t)
{
    int32_t n = t->n_ids;
    size_t extra = 0;
    for (int32_t i = 0; i < t->n_added; i++) {
        if (t->added[i].id >= n) n = t->added[i].id + 1;
        extra += t->added[i].norm ? t->added[i].norm_len : t->added[i].len;
    }
    size_t cap = (size_t)n + 1; /* never 0: realloc(p, 0) frees */
    uint32_t *mo = realloc(t->model_off, cap * sizeof *mo);
    if (mo) t->model_off = mo;
    uint32_t *ml = realloc(t->model_len, cap * sizeof *ml);
    if (ml) t->model_len = ml;
    char *ar = realloc(t->arena, t->arena_len + extra + 1);
    if (ar) t->arena = ar;
    t->dec_off = malloc(cap * sizeof *t->dec_off);
    t->dec_len = malloc(cap * sizeof *t->dec_len);
    t->flags = calloc(cap, 1);
    if (!mo || !ml || !ar || !t->dec_off || !t->dec_len || !t->flags) return PD_ENOMEM;
    for (int32_t i = t->n_ids; i < n; i++) t->model_off[i] = UINT32_MAX, t->model_len[i] = 0;
    t->n_ids = n;
    for (int32_t i = 0; i < n; i++)
        t->dec_off[i] = t->model_off[i], t->dec_len[i] = t->model_len[i];
    for (int32_t i = 0; i < t->n_added; i++) {
        const tok__added *a = &t->added[i];
        const char *s = a->norm ? a->norm : a->content;
        size_t len = a->norm ? a->norm_len : a->len;
        memcpy(t->arena + t->arena_len, s, len);
        t->dec_off[a->id] = (uint32_t)t->arena_len;
        t->dec_len[a->id] = (uint32_t)len;
        t->arena_len += len;
        t->flags[a->id] |= TOK__F_ADDED;
    }
    /* HF skips a token when its decoder string is the content of a special added token */
    for (int32_t i = 0; i < t->n_added; i++) {
        const tok__added *a = &t->added[i];
        if (!a->special) continue;
        for (int32_t j = 0; j < t->n_added; j++) {
            const tok__added *b = &t->added[j];
            if (t->dec_len[b->id] == a->len &&
                !memcmp(t->arena + t->dec_off[b->id], a->content, a->len))
                t->flags[b->id] |= TOK__F_SPECIAL;
        }
        int32_t id = tok__vocab_get(t, a->content, a->len);
        if (id >= 0 && !(t->flags[id] & TOK__F_ADDED)) t->flags[id] |= TOK__F_SPECIAL;
    }
    return 0;
}

/* ---- tokenizer_config.json ---- */

static int32_t config_token(const tok_tokenizer *t, const json_t *cfg, const char *key)
{
    json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!json_is_string(v)) return -1;
    return tok_token_to_id(t, json_string_value(v), json_string_length(v));
}

static int load_config(tok_tokenizer *t, const char *config, size_t config_len, char *err)
{
    t->bos_id = t->eos_id = -1;
    json_t *cfg = NULL;
    if (config) {
        json_error_t je;
        cfg = json_loadb(config, config_len, JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL, &je);
        if (!cfg)
            return ERR_FORMAT("tokenizer_config.json: malformed JSON at line %d column %d: %s",
                              je.line, je.column, je.text);
        t->bos_id = config_token(t, cfg, "bos_token");
        t->eos_id = config_token(t, cfg, "eos_token");
    }
    bool add_bos = false;
    if (cfg && json_is_boolean(json_object_get(cfg, "add_bos_token"))) {
        tok__json_bool(cfg, "add_bos_token", &add_bos, "tokenizer_config.json", err);
    } else {
        add_bos = t->bos_id >= 0 && t->n_tmpl_pre > 0 && t->tmpl_pre[0] == t->bos_id;
    }
    t->add_bos = add_bos;
    json_decref(cfg);
    return 0;
}

/* ---- entry points ---- */

int tok_load_buffer(const char *json, size_t json_len, const char *config, size_t config_len,
                    tok_tokenizer **out, char *err)
{
    *out = NULL;
    /* model.vocab and model.merges are read by tokenizer_json.c; jansson gets the rest */
    tok__json_model jm;
    int rc = tok__json_locate(json, json_len, &jm, err);
    if (rc) return rc;
    size_t rest_len;
    char *rest = tok__json_without(json, json_len, &jm, &rest_len);
    if (!rest) return pd_errf(err, PD_ENOMEM, "out of memory loading the tokenizer");
    json_error_t je;
    json_t *root = json_loadb(rest, rest_len, JSON_ALLOW_NUL, &je);
    free(rest);
    if (!root)
        return ERR_FORMAT("tokenizer.json: malformed JSON at line %d column %d: %s", je.line,
                          je.column, je.text);
    static atomic_uint_fast64_t generation = 0;
    tok_tokenizer *t = calloc(1, sizeof *t);
    rc = PD_ENOMEM;
    if (!t) goto fail;
    t->gen = (uint64_t)atomic_fetch_add(&generation, 1) + 1;
    rc = PD_EFORMAT;
    if (!json_is_object(root)) {
        ERR_FORMAT("tokenizer.json: the top level must be an object");
        goto fail;
    }
    const char *ver;
    size_t ver_len;
    if (tok__json_str(root, "version", &ver, &ver_len, "tokenizer.json", err) == 0 &&
        strcmp(ver, "1.0")) {
        rc = ERR_UNSUPPORTED("tokenizer.json: unknown version \"%s\"", ver);
        goto fail;
    }
    bool joined = false;
    if ((rc = tok__load_normalizer(t, json_object_get(root, "normalizer"), err)) ||
        (rc = tok__load_pretok(t, json_object_get(root, "pre_tokenizer"), err)) ||
        (rc = load_model(t, json_object_get(root, "model"), json, &jm, err)) ||
        (rc = load_added(t, json_object_get(root, "added_tokens"), err)) ||
        (rc = build_id_tables(t)) ||
        (rc = tok__load_decoder(t, json_object_get(root, "decoder"), &joined, err)) ||
        (rc = tok__load_post(t, json_object_get(root, "post_processor"), err)) ||
        (rc = tok__trie_build(&t->trie_raw, t->added, t->n_added, false)) ||
        (rc = tok__trie_build(&t->trie_norm, t->added, t->n_added, true)) ||
        (rc = load_config(t, config, config_len, err)))
        goto fail;
    json_decref(root);
    *out = t;
    return 0;
fail:
    if (rc == PD_ENOMEM) pd_errf(err, PD_ENOMEM, "out of memory loading the tokenizer");
    json_decref(root);
    tok_destroy(t);
    return rc;
}

static int read_file(const char *path, char **data, size_t *len, char *err)
{
    *data = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errf(err, PD_EIO, "cannot open %s", path);
    tok__buf b = {0};
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (tok__buf_put(&b, chunk, n)) {
            fclose(f);
            tok__buf_free(&b);
            return PD_ENOMEM;
        }
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        tok__buf_free(&b);
        return pd_errf(err, PD_EIO, "cannot read %s", path);
    }
    if (tok__buf_reserve(&b, 0)) return PD_ENOMEM;
    *data = b.p;
    *len = b.len;
    return 0;
}

int tok_load(const char *dir, tok_tokenizer **out, char *err)
{
    *out = NULL;
    size_t plen = strlen(dir) + 32;
    char *path = malloc(plen);
    if (!path) return PD_ENOMEM;
    char *json = NULL, *cfg = NULL;
    size_t json_len = 0, cfg_len = 0;
    snprintf(path, plen, "%s/tokenizer.json", dir);
    int rc = read_file(path, &json, &json_len, err);
    if (!rc) {
        snprintf(path, plen, "%s/tokenizer_config.json", dir);
        FILE *f = fopen(path, "rb");
        if (f) {
            fclose(f);
            rc = read_file(path, &cfg, &cfg_len, err);
        }
    }
    if (!rc) {
        char detail[PD_ERR_LEN] = "";
        rc = tok_load_buffer(json, json_len, cfg, cfg_len, out, detail);
        if (rc) pd_errf(err, rc, "%s: %s", dir, detail);
    }
    free(path);
    free(json);
    free(cfg);
    return rc;
}
