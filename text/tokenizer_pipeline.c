/* tokenizer_pipeline.c -- Reads the pipeline components of tokenizer.json (normalizer,
 * pre_tokenizer, decoder, post_processor) into a tok_tokenizer, flattening Sequences; an
 * unknown or unsupported component is an error that names it. Also the small JSON field
 * helpers the loader shares. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/tokenizer_impl.h"

#define ERR_FORMAT(...) pd_errf(err, PD_EFORMAT, __VA_ARGS__)
#define ERR_UNSUPPORTED(...) pd_errf(err, PD_EUNSUPPORTED, __VA_ARGS__)

/* ---- JSON field helpers (see tokenizer_impl.h) ---- */

int tok__json_str(const json_t *o, const char *key, const char **s, size_t *len, const char *what,
                  char *err)
{
    *s = "";
    *len = 0;
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 1;
    if (!json_is_string(v)) return ERR_FORMAT("%s: \"%s\" must be a string", what, key);
    *s = json_string_value(v);
    *len = json_string_length(v);
    return 0;
}

int tok__json_bool(const json_t *o, const char *key, bool *b, const char *what, char *err)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 1;
    if (!json_is_boolean(v)) return ERR_FORMAT("%s: \"%s\" must be true or false", what, key);
    *b = json_is_true(v);
    return 0;
}

static int get_size(const json_t *o, const char *key, size_t *n, const char *what, char *err)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 1;
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return ERR_FORMAT("%s: \"%s\" must be a non-negative integer", what, key);
    *n = (size_t)json_integer_value(v);
    return 0;
}

const char *tok__json_type(const json_t *o)
{
    json_t *v = json_object_get(o, "type");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

char *tok__strdup(const char *s, size_t len)
{
    char *p = malloc(len + 1);
    if (p) {
        memcpy(p, s, len);
        p[len] = '\0';
    }
    return p;
}

/* A pattern object {"String": s} or {"Regex": s}. */
static int load_pattern(const json_t *o, tok__pat *pat, const char *what, char *err)
{
    json_t *p = json_object_get(o, "pattern");
    const char *s;
    size_t len;
    if (!json_is_object(p)) return ERR_FORMAT("%s: \"pattern\" must be an object", what);
    if (tok__json_str(p, "String", &s, &len, what, err) == 0)
        return tok__pat_init(pat, s, len, false, what, err);
    if (tok__json_str(p, "Regex", &s, &len, what, err) == 0)
        return tok__pat_init(pat, s, len, true, what, err);
    return ERR_FORMAT("%s: \"pattern\" needs \"String\" or \"Regex\"", what);
}

/* One character (Metaspace replacement, Strip content) into out[4]. */
static int load_char(const json_t *o, const char *key, char *out, size_t *out_len, const char *what,
                     char *err)
{
    const char *s;
    size_t len, n;
    if (tok__json_str(o, key, &s, &len, what, err) != 0)
        return ERR_FORMAT("%s: \"%s\" must be a one-character string", what, key);
    if (len == 0 || len > 4 || tok__utf8_check(s, len) != len || (tok__utf8_next(s, &n), n != len))
        return ERR_FORMAT("%s: \"%s\" must be a one-character string", what, key);
    memcpy(out, s, len);
    *out_len = len;
    return 0;
}

static int load_prepend_scheme(const json_t *o, int *scheme, const char *what, char *err)
{
    const char *s;
    size_t len;
    bool aps;
    *scheme = TOK__PREPEND_ALWAYS;
    int rc = tok__json_str(o, "prepend_scheme", &s, &len, what, err);
    if (rc < 0) return rc;
    if (rc == 0) {
        if (!strcmp(s, "first")) *scheme = TOK__PREPEND_FIRST;
        else if (!strcmp(s, "never")) *scheme = TOK__PREPEND_NEVER;
        else if (strcmp(s, "always"))
            return ERR_FORMAT("%s: unknown prepend_scheme \"%s\"", what, s);
    }
    if (tok__json_bool(o, "add_prefix_space", &aps, what, err) == 0 && !aps)
        *scheme = TOK__PREPEND_NEVER; /* legacy field */
    return 0;
}

/* ---- normalizer ---- */

int tok__load_normalizer(tok_tokenizer *t, const json_t *n, char *err)
{
    if (!n || json_is_null(n)) return 0;
    const char *type = tok__json_type(n);
    if (!type) return ERR_FORMAT("normalizer: missing \"type\"");
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list)) return ERR_FORMAT("normalizer: Sequence needs \"normalizers\"");
        for (size_t i = 0; i < json_array_size(list); i++) {
            int rc = tok__load_normalizer(t, json_array_get(list, i), err);
            if (rc) return rc;
        }
        return 0;
    }
    tok__norm nm = {0};
    if (!strcmp(type, "NFC")) nm.kind = TOK__NORM_NFC;
    else if (!strcmp(type, "NFD")) nm.kind = TOK__NORM_NFD;
    else if (!strcmp(type, "NFKC")) nm.kind = TOK__NORM_NFKC;
    else if (!strcmp(type, "NFKD")) nm.kind = TOK__NORM_NFKD;
    else if (!strcmp(type, "Prepend")) nm.kind = TOK__NORM_PREPEND;
    else if (!strcmp(type, "Replace")) nm.kind = TOK__NORM_REPLACE;
    else return ERR_UNSUPPORTED("normalizer \"%s\" is not supported", type);
    const char *s = "";
    size_t len = 0;
    if (nm.kind == TOK__NORM_PREPEND &&
        tok__json_str(n, "prepend", &s, &len, "normalizer Prepend", err))
        return ERR_FORMAT("normalizer Prepend: \"prepend\" must be a string");
    if (nm.kind == TOK__NORM_REPLACE) {
        if (tok__json_str(n, "content", &s, &len, "normalizer Replace", err))
            return ERR_FORMAT("normalizer Replace: \"content\" must be a string");
        int rc = load_pattern(n, &nm.pat, "normalizer Replace", err);
        if (rc) return rc;
    }
    nm.str = tok__strdup(s, len);
    nm.str_len = len;
    tok__norm *v = realloc(t->norms, (size_t)(t->n_norms + 1) * sizeof *v);
    if (!nm.str || !v) {
        free(nm.str);
        tok__pat_free(&nm.pat);
        if (v) t->norms = v;
        return PD_ENOMEM;
    }
    t->norms = v;
    t->norms[t->n_norms++] = nm;
    return 0;
}

/* ---- pre-tokenizer ---- */

static const char GPT2_REGEX[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

int tok__load_pretok(tok_tokenizer *t, const json_t *p, char *err)
{
    if (!p || json_is_null(p)) return 0;
    const char *type = tok__json_type(p);
    if (!type) return ERR_FORMAT("pre_tokenizer: missing \"type\"");
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(p, "pretokenizers");
        if (!json_is_array(list))
            return ERR_FORMAT("pre_tokenizer: Sequence needs \"pretokenizers\"");
        for (size_t i = 0; i < json_array_size(list); i++) {
            int rc = tok__load_pretok(t, json_array_get(list, i), err);
            if (rc) return rc;
        }
        return 0;
    }
    if (t->n_pretoks == TOK__MAX_STAGES) return ERR_UNSUPPORTED("pre_tokenizer: too many stages");
    if (t->byte_level)
        return ERR_UNSUPPORTED("pre_tokenizer \"%s\" after ByteLevel is not supported", type);
    tok__pretok *k = &t->pretoks[t->n_pretoks];
    memset(k, 0, sizeof *k);
    int rc = 0;
    if (!strcmp(type, "Split")) {
        k->kind = TOK__PRE_SPLIT;
        const char *b;
        size_t len;
        if (tok__json_str(p, "behavior", &b, &len, "pre_tokenizer Split", err))
            return ERR_FORMAT("pre_tokenizer Split: missing \"behavior\"");
        if (!strcmp(b, "Removed")) k->behavior = TOK__SPLIT_REMOVED;
        else if (!strcmp(b, "Isolated")) k->behavior = TOK__SPLIT_ISOLATED;
        else if (!strcmp(b, "MergedWithPrevious")) k->behavior = TOK__SPLIT_MERGED_PREV;
        else if (!strcmp(b, "MergedWithNext")) k->behavior = TOK__SPLIT_MERGED_NEXT;
        else if (!strcmp(b, "Contiguous")) k->behavior = TOK__SPLIT_CONTIGUOUS;
        else return ERR_FORMAT("pre_tokenizer Split: unknown behavior \"%s\"", b);
        if (tok__json_bool(p, "invert", &k->invert, "pre_tokenizer Split", err) < 0)
            return PD_EFORMAT;
        rc = load_pattern(p, &k->pat, "pre_tokenizer Split", err);
    } else if (!strcmp(type, "ByteLevel")) {
        k->kind = TOK__PRE_BYTELEVEL;
        k->add_prefix_space = true;
        k->use_regex = true;
        if (tok__json_bool(p, "add_prefix_space", &k->add_prefix_space, "pre_tokenizer ByteLevel",
                           err) < 0 ||
            tok__json_bool(p, "use_regex", &k->use_regex, "pre_tokenizer ByteLevel", err) < 0)
            return PD_EFORMAT;
        if (k->use_regex)
            rc = tok__pat_init(&k->pat, GPT2_REGEX, sizeof GPT2_REGEX - 1, true, "ByteLevel", err);
        t->byte_level = true;
    } else if (!strcmp(type, "Digits")) {
        k->kind = TOK__PRE_DIGITS;
        if (tok__json_bool(p, "individual_digits", &k->individual, "pre_tokenizer Digits", err) < 0)
            return PD_EFORMAT;
    } else if (!strcmp(type, "Metaspace")) {
        k->kind = TOK__PRE_METASPACE;
        k->split = true;
        if ((rc = load_char(p, "replacement", k->repl, &k->repl_len, "pre_tokenizer Metaspace",
                            err)) ||
            (rc = load_prepend_scheme(p, &k->prepend_scheme, "pre_tokenizer Metaspace", err)))
            return rc;
        if (tok__json_bool(p, "split", &k->split, "pre_tokenizer Metaspace", err) < 0)
            return PD_EFORMAT;
    } else {
        return ERR_UNSUPPORTED("pre_tokenizer \"%s\" is not supported", type);
    }
    if (rc) return rc;
    t->n_pretoks++;
    return 0;
}

/* ---- decoder ---- */

int tok__load_decoder(tok_tokenizer *t, const json_t *d, bool *joined, char *err)
{
    if (!d || json_is_null(d)) return 0;
    const char *type = tok__json_type(d);
    if (!type) return ERR_FORMAT("decoder: missing \"type\"");
    t->has_decoder = true;
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(d, "decoders");
        if (!json_is_array(list)) return ERR_FORMAT("decoder: Sequence needs \"decoders\"");
        for (size_t i = 0; i < json_array_size(list); i++) {
            int rc = tok__load_decoder(t, json_array_get(list, i), joined, err);
            if (rc) return rc;
        }
        return 0;
    }
    if (t->n_decs == TOK__MAX_STAGES) return ERR_UNSUPPORTED("decoder: too many stages");
    tok__dec *k = &t->decs[t->n_decs];
    memset(k, 0, sizeof *k);
    k->joined = *joined;
    int rc = 0;
    if (!strcmp(type, "ByteLevel")) {
        k->kind = TOK__DEC_BYTELEVEL;
        *joined = true;
    } else if (!strcmp(type, "Fuse")) {
        k->kind = TOK__DEC_FUSE;
        *joined = true;
    } else if (!strcmp(type, "ByteFallback")) {
        k->kind = TOK__DEC_BYTEFALLBACK;
        if (*joined)
            return ERR_UNSUPPORTED("decoder ByteFallback after ByteLevel or Fuse is not supported");
    } else if (!strcmp(type, "Replace")) {
        const char *s;
        size_t len;
        k->kind = TOK__DEC_REPLACE;
        if (tok__json_str(d, "content", &s, &len, "decoder Replace", err))
            return ERR_FORMAT("decoder Replace: \"content\" must be a string");
        if (!(k->content = tok__strdup(s, len))) return PD_ENOMEM;
        k->content_len = len;
        rc = load_pattern(d, &k->pat, "decoder Replace", err);
        size_t n = 0;
        if (!rc && *joined && k->pat.lit_len) tok__utf8_next(k->pat.lit, &n);
        if (!rc && *joined && (!k->pat.lit || n != k->pat.lit_len)) {
            /* a longer match could span two tokens' text, which streaming sees apart */
            t->n_decs++;
            return ERR_UNSUPPORTED("decoder Replace after ByteLevel or Fuse with a pattern "
                                   "longer than one character is not supported");
        }
    } else if (!strcmp(type, "Strip")) {
        k->kind = TOK__DEC_STRIP;
        if ((rc = load_char(d, "content", k->ch, &k->ch_len, "decoder Strip", err))) return rc;
        if (get_size(d, "start", &k->start, "decoder Strip", err) < 0 ||
            get_size(d, "stop", &k->stop, "decoder Strip", err) < 0)
            return PD_EFORMAT;
    } else if (!strcmp(type, "Metaspace")) {
        k->kind = TOK__DEC_METASPACE;
        if ((rc = load_char(d, "replacement", k->ch, &k->ch_len, "decoder Metaspace", err)) ||
            (rc = load_prepend_scheme(d, &k->prepend_scheme, "decoder Metaspace", err)))
            return rc;
    } else {
        return ERR_UNSUPPORTED("decoder \"%s\" is not supported", type);
    }
    t->n_decs++; /* counted before rc so that tok__free_pipeline frees what was set */
    return rc;
}

/* ---- post-processor ---- */

static int load_template(tok_tokenizer *t, const json_t *p, char *err)
{
    json_t *single = json_object_get(p, "single"), *specials = json_object_get(p, "special_tokens");
    if (!json_is_array(single) || !json_is_object(specials))
        return ERR_FORMAT(
            "post_processor TemplateProcessing: needs \"single\" and \"special_tokens\"");
    bool seen_a = false;
    for (size_t i = 0; i < json_array_size(single); i++) {
        json_t *piece = json_array_get(single, i);
        json_t *seq = json_object_get(piece, "Sequence"),
               *sp = json_object_get(piece, "SpecialToken");
        const char *id = NULL;
        size_t len;
        if (seq) {
            if (tok__json_str(seq, "id", &id, &len, "post_processor", err) || strcmp(id, "A") ||
                seen_a)
                return ERR_UNSUPPORTED("post_processor TemplateProcessing: single template "
                                       "must hold sequence A exactly once");
            seen_a = true;
            continue;
        }
        if (!sp || tok__json_str(sp, "id", &id, &len, "post_processor", err))
            return ERR_FORMAT("post_processor TemplateProcessing: bad piece %zu", i);
        json_t *ids = json_object_get(json_object_get(specials, id), "ids");
        if (!json_is_array(ids))
            return ERR_FORMAT("post_processor TemplateProcessing: special token \"%s\" has no ids",
                              id);
        for (size_t j = 0; j < json_array_size(ids); j++) {
            json_t *v = json_array_get(ids, j);
            if (!json_is_integer(v) || json_integer_value(v) < 0 ||
                json_integer_value(v) >= t->n_ids)
                return ERR_FORMAT("post_processor TemplateProcessing: bad id for \"%s\"", id);
            int32_t **arr = seen_a ? &t->tmpl_post : &t->tmpl_pre;
            int32_t *n = seen_a ? &t->n_tmpl_post : &t->n_tmpl_pre;
            int32_t *a = realloc(*arr, (size_t)(*n + 1) * sizeof *a);
            if (!a) return PD_ENOMEM;
            a[(*n)++] = (int32_t)json_integer_value(v);
            *arr = a;
        }
    }
    if (!seen_a) return ERR_UNSUPPORTED("post_processor TemplateProcessing: no sequence A");
    return 0;
}

int tok__load_post(tok_tokenizer *t, const json_t *p, char *err)
{
    if (!p || json_is_null(p)) return 0;
    const char *type = tok__json_type(p);
    if (!type) return ERR_FORMAT("post_processor: missing \"type\"");
    if (!strcmp(type, "ByteLevel")) return 0; /* offsets only */
    if (!strcmp(type, "TemplateProcessing")) {
        if (t->tmpl_pre || t->tmpl_post)
            return ERR_UNSUPPORTED("post_processor: more than one TemplateProcessing");
        return load_template(t, p, err);
    }
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(p, "processors");
        if (!json_is_array(list))
            return ERR_FORMAT("post_processor: Sequence needs \"processors\"");
        for (size_t i = 0; i < json_array_size(list); i++) {
            int rc = tok__load_post(t, json_array_get(list, i), err);
            if (rc) return rc;
        }
        return 0;
    }
    return ERR_UNSUPPORTED("post_processor \"%s\" is not supported", type);
}
