/* tokenizer_pretok.c -- Normalizers (NFC/NFD/NFKC/NFKD through utf8proc, Prepend, Replace)
 * and pre-tokenizers (Split, ByteLevel, Digits, Metaspace). Pre-tokenization runs depth
 * first: each piece a stage produces goes through the later stages and the model before the
 * next piece, which gives the same token order as HF's stage-by-stage processing. */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/error.h"
#include "text/tokenizer_impl.h"

/* ---- normalizers ---- */

/* True when NFC cannot change s: no combining marks, nothing that composes with what
 * precedes it, no canonical decompositions (which may be excluded from composition) and no
 * conjoining jamo. Most text (ASCII, CJK, Cyrillic, emoji) passes and skips utf8proc. */
static bool nfc_quick_yes(const char *s, size_t len)
{
    for (size_t i = 0; i < len;) {
        if ((uint8_t)s[i] < 0x80) {
            i++;
            continue;
        }
        size_t n;
        uint32_t c = tok__utf8_next(s + i, &n);
        i += n;
        if (c < 0x300) {
            if (c >= 0xC0) return false; /* Latin-1 letters with decompositions */
            continue;
        }
        if ((c >= 0x1100 && c <= 0x11FF) || (c >= 0xA960 && c <= 0xA97F) ||
            (c >= 0xD7B0 && c <= 0xD7FF))
            return false;
        const utf8proc_property_t *p = utf8proc_get_property((utf8proc_int32_t)c);
        if (p->combining_class != 0) return false;
        if (p->comb_index != UINT16_MAX && p->comb_index >= 0x8000) return false;
        if (p->decomp_seqindex != UINT16_MAX && p->decomp_type == 0) return false;
    }
    return true;
}

static bool all_ascii(const char *s, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if ((uint8_t)s[i] >= 0x80) return false;
    return true;
}

static int unicode_normalize(int kind, const char *s, size_t len, tok__buf *dst, bool *same)
{
    *same = all_ascii(s, len) || (kind == TOK__NORM_NFC && nfc_quick_yes(s, len));
    if (*same) return 0;
    utf8proc_option_t opt = UTF8PROC_STABLE;
    if (kind == TOK__NORM_NFC || kind == TOK__NORM_NFKC) opt |= UTF8PROC_COMPOSE;
    else opt |= UTF8PROC_DECOMPOSE;
    if (kind == TOK__NORM_NFKC || kind == TOK__NORM_NFKD) opt |= UTF8PROC_COMPAT;
    utf8proc_uint8_t *res = NULL;
    utf8proc_ssize_t n =
        utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &res, opt);
    if (n < 0) {
        free(res);
        return n == UTF8PROC_ERROR_NOMEM ? PD_ENOMEM : PD_EINVAL;
    }
    int rc = tok__buf_put(dst, res, (size_t)n);
    free(res);
    return rc;
}

static int replace_all(tok__work *w, const tok__pat *pat, const char *rep, size_t rep_len,
                       const char *s, size_t len, tok__buf *dst)
{
    size_t pos = 0, ms, me;
    int rc;
    while ((rc = tok__pat_find(pat, &w->m, s, len, pos, &ms, &me)) == 1) {
        if (tok__buf_put(dst, s + pos, ms - pos) || tok__buf_put(dst, rep, rep_len))
            return PD_ENOMEM;
        if (me == ms) { /* empty match: keep the next character and go on */
            if (ms >= len) {
                pos = len;
                break;
            }
            size_t n;
            tok__utf8_next(s + ms, &n);
            if (tok__buf_put(dst, s + ms, n)) return PD_ENOMEM;
            me = ms + n;
        }
        pos = me;
    }
    if (rc < 0) return rc;
    return tok__buf_put(dst, s + pos, len - pos);
}

int tok__normalize(const tok_tokenizer *t, tok__work *w, const char *s, size_t len,
                   const char **out, size_t *out_len)
{
    const char *cur = s;
    size_t cur_len = len;
    int which = 0;
    for (int i = 0; i < t->n_norms; i++) {
        const tok__norm *nm = &t->norms[i];
        tok__buf *dst = &w->norm[which];
        dst->len = 0;
        int rc = 0;
        bool same = false;
        switch (nm->kind) {
        case TOK__NORM_NFC:
        case TOK__NORM_NFD:
        case TOK__NORM_NFKC:
        case TOK__NORM_NFKD: rc = unicode_normalize(nm->kind, cur, cur_len, dst, &same); break;
        case TOK__NORM_PREPEND:
            same = cur_len == 0;
            if (!same)
                rc = tok__buf_put(dst, nm->str, nm->str_len) || tok__buf_put(dst, cur, cur_len)
                         ? PD_ENOMEM
                         : 0;
            break;
        case TOK__NORM_REPLACE:
            rc = replace_all(w, &nm->pat, nm->str, nm->str_len, cur, cur_len, dst);
            break;
        }
        if (rc) return rc;
        if (same) continue;
        if (tok__buf_reserve(dst, 0)) return PD_ENOMEM;
        cur = dst->p;
        cur_len = dst->len;
        which ^= 1;
    }
    *out = cur;
    *out_len = cur_len;
    return 0;
}

/* ---- pre-tokenizers ---- */

/* HF's find_matches for a one-character predicate: every matching character is a span. */
static int find_chars(const char *s, size_t len, bool digits, const char *ch, size_t ch_len,
                      tok__spans *sp)
{
    sp->n = 0;
    size_t last = 0;
    for (size_t i = 0; i < len;) {
        size_t n;
        uint32_t c = tok__utf8_next(s + i, &n);
        bool hit = digits ? tok__is_numeric(c) : (n == ch_len && memcmp(s + i, ch, n) == 0);
        if (hit) {
            if (last < i && tok__spans_push(sp, last, i, false)) return PD_ENOMEM;
            if (tok__spans_push(sp, i, i + n, true)) return PD_ENOMEM;
            last = i + n;
        }
        i += n;
    }
    if (last < len && tok__spans_push(sp, last, len, false)) return PD_ENOMEM;
    return 0;
}

/* NormalizedString::split: turns match/non-match spans into pieces by behavior, in place.
 * Afterwards every span with match=true is to be removed. */
static void apply_behavior(tok__spans *sp, int behavior)
{
    tok__span *v = sp->v;
    size_t n = sp->n, k = 0;
    bool prev = false;
    switch (behavior) {
    case TOK__SPLIT_ISOLATED:
        for (size_t i = 0; i < n; i++) v[i].match = false;
        return;
    case TOK__SPLIT_REMOVED: return;
    case TOK__SPLIT_CONTIGUOUS:
    case TOK__SPLIT_MERGED_PREV:
        for (size_t i = 0; i < n; i++) {
            bool m = v[i].match;
            bool merge = behavior == TOK__SPLIT_CONTIGUOUS ? m == prev : (m && !prev);
            if (merge && k > 0) {
                v[k - 1].e = v[i].e;
            } else {
                v[k] = v[i];
                v[k++].match = false;
            }
            prev = m;
        }
        sp->n = k;
        return;
    case TOK__SPLIT_MERGED_NEXT:
        k = n; /* fill from the end */
        for (size_t i = n; i-- > 0;) {
            bool m = v[i].match;
            if (m && !prev && k < n) {
                v[k].s = v[i].s;
            } else {
                v[--k] = v[i];
                v[k].match = false;
            }
            prev = m;
        }
        memmove(v, v + k, (n - k) * sizeof *v);
        sp->n = n - k;
        return;
    }
}

/* Sends every kept span of s through the next stage. */
static int pretok_spans(const tok_tokenizer *t, tok__work *w, int stage, const char *s,
                        bool at_start, tok__ids *out)
{
    tok__spans *sp = &w->spans[stage];
    for (size_t i = 0; i < sp->n; i++) {
        tok__span x = sp->v[i];
        if (x.match || x.e == x.s) continue;
        int rc = tok__pretokenize(t, w, stage + 1, s + x.s, x.e - x.s, at_start && x.s == 0, out);
        if (rc) return rc;
    }
    return 0;
}

int tok__pretokenize(const tok_tokenizer *t, tok__work *w, int stage, const char *s, size_t len,
                     bool at_start, tok__ids *out)
{
    if (len == 0) return 0; /* HF drops empty pieces */
    if (stage == t->n_pretoks) return tok__bpe_encode(t, w, s, len, out);
    const tok__pretok *p = &t->pretoks[stage];
    tok__spans *sp = &w->spans[stage];
    tok__buf *buf = &w->content[stage];
    int rc;
    switch (p->kind) {
    case TOK__PRE_SPLIT:
        if ((rc = tok__pat_find_all(&p->pat, &w->m, s, len, sp))) return rc;
        if (p->invert)
            for (size_t i = 0; i < sp->n; i++) sp->v[i].match = !sp->v[i].match;
        apply_behavior(sp, p->behavior);
        return pretok_spans(t, w, stage, s, at_start, out);
    case TOK__PRE_BYTELEVEL:
        if (p->add_prefix_space && s[0] != ' ') {
            buf->len = 0;
            if (tok__buf_put(buf, " ", 1) || tok__buf_put(buf, s, len)) return PD_ENOMEM;
            s = buf->p;
            len = buf->len;
        }
        if (!p->use_regex) return tok__pretokenize(t, w, stage + 1, s, len, at_start, out);
        if ((rc = tok__pat_find_all(&p->pat, &w->m, s, len, sp))) return rc;
        apply_behavior(sp, TOK__SPLIT_ISOLATED);
        return pretok_spans(t, w, stage, s, at_start, out);
    case TOK__PRE_DIGITS:
        if ((rc = find_chars(s, len, true, NULL, 0, sp))) return rc;
        apply_behavior(sp, p->individual ? TOK__SPLIT_ISOLATED : TOK__SPLIT_CONTIGUOUS);
        return pretok_spans(t, w, stage, s, at_start, out);
    case TOK__PRE_METASPACE: {
        buf->len = 0;
        bool starts = s[0] == ' ' || (len >= p->repl_len && memcmp(s, p->repl, p->repl_len) == 0);
        bool prepend = !starts && (p->prepend_scheme == TOK__PREPEND_ALWAYS ||
                                   (p->prepend_scheme == TOK__PREPEND_FIRST && at_start));
        if (prepend && tok__buf_put(buf, p->repl, p->repl_len)) return PD_ENOMEM;
        for (size_t i = 0; i < len;) {
            size_t j = i;
            while (j < len && s[j] != ' ') j++;
            if (tok__buf_put(buf, s + i, j - i)) return PD_ENOMEM;
            if (j < len && tok__buf_put(buf, p->repl, p->repl_len)) return PD_ENOMEM;
            i = j + 1;
        }
        if (tok__buf_reserve(buf, 0)) return PD_ENOMEM;
        s = buf->p;
        len = buf->len;
        if (!p->split) return tok__pretokenize(t, w, stage + 1, s, len, at_start, out);
        if ((rc = find_chars(s, len, false, p->repl, p->repl_len, sp))) return rc;
        apply_behavior(sp, TOK__SPLIT_MERGED_NEXT);
        return pretok_spans(t, w, stage, s, at_start, out);
    }
    }
    return PD_EINVAL;
}
