/* tokenizer_decode.c -- Decoding ids to text through the decoder chain (ByteLevel, Replace,
 * ByteFallback, Fuse, Strip, Metaspace), for a whole sequence (tok_decode, as HF's decode)
 * and one token at a time (tok_stream). Both run the same stage code: in streaming mode a
 * stage that follows a joining stage (ByteLevel, Fuse) sees each token's part of the joined
 * text as a chunk, and keeps what it needs (a byte-fallback character in progress, how many
 * leading characters Strip may still remove, trailing characters Strip may remove at the
 * end) in a small per-stage state. Bytes that are not yet a whole character wait in the
 * stream until the next token completes them; a run of byte-fallback tokens waits until it
 * ends, because HF decodes such a run as a whole. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/tokenizer_impl.h"

/* A list of byte strings stored back to back. */
typedef struct {
    tok__buf b;
    size_t *end; /* end offset in b of each item */
    size_t n, cap;
} items_t;

static void items_free(items_t *it)
{
    tok__buf_free(&it->b);
    free(it->end);
    memset(it, 0, sizeof *it);
}

static void items_clear(items_t *it)
{
    it->b.len = 0;
    it->n = 0;
}

/* Starts a new item holding s. */
static int items_push(items_t *it, const char *s, size_t len)
{
    if (it->n == it->cap) {
        size_t cap = it->cap ? it->cap * 2 : 16;
        size_t *e = realloc(it->end, cap * sizeof *e);
        if (!e) return PD_ENOMEM;
        it->end = e;
        it->cap = cap;
    }
    if (tok__buf_put(&it->b, s, len)) return PD_ENOMEM;
    it->end[it->n++] = it->b.len;
    return 0;
}

/* Appends s to the last item. */
static int items_extend(items_t *it, const char *s, size_t len)
{
    if (tok__buf_put(&it->b, s, len)) return PD_ENOMEM;
    it->end[it->n - 1] = it->b.len;
    return 0;
}

static inline const char *item(const items_t *it, size_t i, size_t *len)
{
    size_t s = i ? it->end[i - 1] : 0;
    *len = it->end[i] - s;
    return it->b.p + s;
}

/* Per-stage streaming state. */
typedef struct {
    tok__buf run;      /* ByteFallback: the bytes of the current run of byte tokens */
    size_t strip_left; /* Strip after a join: leading characters it may still remove */
    size_t held;       /* Strip after a join: trailing content characters not yet passed on */
    uint64_t seen;     /* Metaspace: items seen (the first one is special) */
} dec_state;

static const char FFFD[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

/* ---- stages ---- */

/* ByteLevel: each token's characters back to bytes (a token with a character outside the
 * GPT-2 alphabet stays as it is), all joined into one item. */
static int dec_bytelevel(const items_t *in, items_t *out, bool stream)
{
    if (stream && in->n == 0) return 0;
    if (items_push(out, "", 0)) return PD_ENOMEM;
    for (size_t i = 0; i < in->n; i++) {
        size_t len, n;
        const char *s = item(in, i, &len);
        bool all = true;
        for (size_t k = 0; k < len && all; k += n)
            all = tok__char_byte(tok__utf8_next(s + k, &n)) >= 0;
        if (!all) {
            if (items_extend(out, s, len)) return PD_ENOMEM;
            continue;
        }
        if (tok__buf_reserve(&out->b, len)) return PD_ENOMEM;
        for (size_t k = 0; k < len; k += n)
            out->b.p[out->b.len++] = (char)tok__char_byte(tok__utf8_next(s + k, &n));
        out->b.p[out->b.len] = '\0';
        out->end[out->n - 1] = out->b.len;
    }
    return 0;
}

static int dec_fuse(const items_t *in, items_t *out, bool stream)
{
    if (stream && in->n == 0) return 0;
    return items_push(out, in->b.p ? in->b.p : "", in->b.len);
}

/* The byte of a "<0xXX>" token, or -1 (Rust's u8::from_str_radix, which takes a '+'). */
static int byte_token(const char *s, size_t len)
{
    if (len != 6 || memcmp(s, "<0x", 3) || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        if (i == 3 && c == '+') continue;
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

static int push_fffd(items_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (items_push(out, FFFD, 3)) return PD_ENOMEM;
    return 0;
}

static int end_run(items_t *out, tok__buf *run);

/* ByteFallback over a whole sequence: a run of byte tokens becomes one item when it is valid
 * UTF-8, else one U+FFFD per byte token. */
static int dec_bytefallback_full(const items_t *in, items_t *out)
{
    tok__buf run = {0};
    int rc = 0;
    for (size_t i = 0; i <= in->n && !rc; i++) {
        size_t len = 0;
        const char *s = i < in->n ? item(in, i, &len) : NULL;
        int b = s ? byte_token(s, len) : -1;
        if (b >= 0) {
            char c = (char)b;
            rc = tok__buf_put(&run, &c, 1);
            continue;
        }
        rc = end_run(out, &run);
        if (s && !rc) rc = items_push(out, s, len);
    }
    tok__buf_free(&run);
    return rc;
}

/* Ends a run of byte tokens as HF does: one item if it is valid UTF-8, else one U+FFFD per
 * byte token. */
static int end_run(items_t *out, tok__buf *run)
{
    int rc = 0;
    if (run->len)
        rc = tok__utf8_check(run->p, run->len) == run->len ? items_push(out, run->p, run->len)
                                                           : push_fffd(out, run->len);
    run->len = 0;
    return rc;
}

/* ByteFallback one token at a time. HF judges a run of byte tokens as a whole (one invalid
 * byte turns every byte of the run into U+FFFD), so a run is held until a token that is not a
 * byte ends it, or the sequence ends. */
static int dec_bytefallback_stream(const items_t *in, items_t *out, dec_state *st, bool final)
{
    for (size_t i = 0; i < in->n; i++) {
        size_t len;
        const char *s = item(in, i, &len);
        int b = byte_token(s, len);
        if (b >= 0) {
            char c = (char)b;
            if (tok__buf_put(&st->run, &c, 1)) return PD_ENOMEM;
            continue;
        }
        if (end_run(out, &st->run) || items_push(out, s, len)) return PD_ENOMEM;
    }
    return final ? end_run(out, &st->run) : 0;
}

static int dec_replace(tok__matcher *m, const tok__dec *d, const items_t *in, items_t *out)
{
    for (size_t i = 0; i < in->n; i++) {
        size_t len, pos = 0, ms, me;
        const char *s = item(in, i, &len);
        if (items_push(out, "", 0)) return PD_ENOMEM;
        int rc = 0;
        while (pos < len && (rc = tok__pat_find(&d->pat, m, s, len, pos, &ms, &me)) == 1) {
            if (me == ms) break; /* patterns used here never match empty */
            if (items_extend(out, s + pos, ms - pos) ||
                items_extend(out, d->content, d->content_len))
                return PD_ENOMEM;
            pos = me;
        }
        if (pos < len && rc < 0) return rc;
        if (items_extend(out, s + pos, len - pos)) return PD_ENOMEM;
    }
    return 0;
}

/* Number of leading (or trailing) copies of ch in s, at most max. */
static size_t count_ch(const char *s, size_t len, const char *ch, size_t ch_len, size_t max,
                       bool trailing)
{
    size_t k = 0;
    while (k < max && (k + 1) * ch_len <= len &&
           memcmp(trailing ? s + len - (k + 1) * ch_len : s + k * ch_len, ch, ch_len) == 0)
        k++;
    return k;
}

static int dec_strip(const tok__dec *d, const items_t *in, items_t *out, dec_state *st, bool final)
{
    size_t cl = d->ch_len;
    if (!st || !d->joined) { /* per item, as HF */
        for (size_t i = 0; i < in->n; i++) {
            size_t len;
            const char *s = item(in, i, &len);
            size_t a = count_ch(s, len, d->ch, cl, d->start, false) * cl;
            size_t z = count_ch(s + a, len - a, d->ch, cl, d->stop, true) * cl;
            if (items_push(out, s + a, len - a - z)) return PD_ENOMEM;
        }
        return 0;
    }
    /* a chunk of the one joined item */
    if (in->n == 0 && !final) return 0;
    if (items_push(out, "", 0)) return PD_ENOMEM;
    for (size_t i = 0; i < in->n; i++) {
        size_t len;
        const char *s = item(in, i, &len);
        if (st->strip_left && len) {
            size_t a = count_ch(s, len, d->ch, cl, st->strip_left, false);
            st->strip_left = a * cl < len ? 0 : st->strip_left - a;
            s += a * cl;
            len -= a * cl;
        }
        if (d->stop == 0) {
            if (items_extend(out, s, len)) return PD_ENOMEM;
            continue;
        }
        size_t z = count_ch(s, len, d->ch, cl, d->stop, true);
        if (z * cl < len) { /* something else came: the held copies were not trailing */
            for (; st->held; st->held--)
                if (items_extend(out, d->ch, cl)) return PD_ENOMEM;
            if (items_extend(out, s, len - z * cl)) return PD_ENOMEM;
            st->held = z;
        } else { /* all content chars: keep at most stop of them back */
            st->held += z;
            for (; st->held > d->stop; st->held--)
                if (items_extend(out, d->ch, cl)) return PD_ENOMEM;
        }
    }
    if (final) st->held = 0; /* the end of the sequence: these were trailing */
    return 0;
}

static int dec_metaspace(const tok__dec *d, const items_t *in, items_t *out, dec_state *st)
{
    for (size_t i = 0; i < in->n; i++) {
        size_t len;
        const char *s = item(in, i, &len);
        bool first = st ? (d->joined || st->seen++ == 0) : i == 0;
        bool drop = first && d->prepend_scheme != TOK__PREPEND_NEVER;
        if (items_push(out, "", 0)) return PD_ENOMEM;
        size_t pos = 0;
        for (size_t k = 0; k + d->ch_len <= len; k++) {
            if (memcmp(s + k, d->ch, d->ch_len)) continue;
            if (items_extend(out, s + pos, k - pos) || (!drop && items_extend(out, " ", 1)))
                return PD_ENOMEM;
            pos = k + d->ch_len;
            k = pos - 1;
        }
        if (items_extend(out, s + pos, len - pos)) return PD_ENOMEM;
    }
    return 0;
}

/* Runs the decoder chain on the items in *a (using *b as scratch; both are left in an
 * unspecified state) and appends the raw joined bytes to out. st is NULL for a whole
 * sequence, else the stream's per-stage state; final marks the end of the sequence. */
static int run_chain(const tok_tokenizer *t, tok__matcher *m, dec_state *st, uint64_t *n_joined,
                     bool final, items_t *a, items_t *b, tok__buf *out)
{
    items_t *in = a, *tmp = b;
    for (int k = 0; k < t->n_decs; k++) {
        const tok__dec *d = &t->decs[k];
        dec_state *s = st ? &st[k] : NULL;
        items_clear(tmp);
        int rc = 0;
        switch (d->kind) {
        case TOK__DEC_BYTELEVEL: rc = dec_bytelevel(in, tmp, st != NULL); break;
        case TOK__DEC_FUSE: rc = dec_fuse(in, tmp, st != NULL); break;
        case TOK__DEC_BYTEFALLBACK:
            rc = s ? dec_bytefallback_stream(in, tmp, s, final) : dec_bytefallback_full(in, tmp);
            break;
        case TOK__DEC_REPLACE: rc = dec_replace(m, d, in, tmp); break;
        case TOK__DEC_STRIP: rc = dec_strip(d, in, tmp, s, final); break;
        case TOK__DEC_METASPACE: rc = dec_metaspace(d, in, tmp, s); break;
        }
        if (rc) return rc;
        items_t *x = in;
        in = tmp;
        tmp = x;
    }
    for (size_t i = 0; i < in->n; i++) {
        size_t len;
        const char *s = item(in, i, &len);
        bool sep = !t->has_decoder && (st ? (*n_joined)++ > 0 : i > 0); /* HF: join(" ") */
        if ((sep && tok__buf_put(out, " ", 1)) || tok__buf_put(out, s, len)) return PD_ENOMEM;
    }
    return 0;
}

static int check_id(const tok_tokenizer *t, int32_t id, char *err)
{
    if (id < 0 || id >= t->n_ids || t->dec_off[id] == UINT32_MAX)
        return pd_errf(err, PD_EINVAL, "unknown token id %d (vocabulary size %d)", id, t->n_ids);
    return 0;
}

int tok_decode(const tok_tokenizer *t, const int32_t *ids, int32_t n, bool skip_special,
               char **text, size_t *len, char *err)
{
    *text = NULL;
    if (len) *len = 0;
    if (n < 0 || (n > 0 && !ids)) return pd_errf(err, PD_EINVAL, "bad id array");
    items_t a = {0}, b = {0};
    tok__buf raw = {0}, res = {0};
    tok__matcher m = {0};
    int rc = 0;
    for (int32_t i = 0; i < n && !rc; i++) {
        if ((rc = check_id(t, ids[i], err))) break;
        if (skip_special && (t->flags[ids[i]] & TOK__F_SPECIAL)) continue;
        rc = items_push(&a, t->arena + t->dec_off[ids[i]], t->dec_len[ids[i]]);
    }
    if (!rc) rc = run_chain(t, &m, NULL, NULL, true, &a, &b, &raw);
    if (!rc) rc = tok__utf8_lossy(&res, raw.p ? raw.p : "", raw.len);
    if (!rc) rc = tok__buf_reserve(&res, 0);
    items_free(&a);
    items_free(&b);
    tok__buf_free(&raw);
    tok__matcher_free(&m);
    if (rc) {
        tok__buf_free(&res);
        return rc == PD_ENOMEM ? pd_errf(err, rc, "out of memory decoding") : rc;
    }
    *text = res.p;
    if (len) *len = res.len;
    return 0;
}

/* ---- streaming ---- */

struct tok_stream {
    const tok_tokenizer *t;
    bool skip_special;
    dec_state st[TOK__MAX_STAGES];
    uint64_t n_joined; /* no decoder: items joined so far */
    tok__matcher m;
    items_t a, b;
    tok__buf raw;     /* chain output for this call */
    tok__buf pending; /* bytes of an unfinished character */
    tok__buf out;     /* the piece handed out */
};

void tok_stream_reset(tok_stream *s)
{
    for (int k = 0; k < TOK__MAX_STAGES; k++) {
        tok__buf run = s->st[k].run; /* keep the memory */
        run.len = 0;
        memset(&s->st[k], 0, sizeof s->st[k]);
        s->st[k].run = run;
        if (k < s->t->n_decs && s->t->decs[k].kind == TOK__DEC_STRIP)
            s->st[k].strip_left = s->t->decs[k].start;
    }
    s->n_joined = 0;
    s->pending.len = 0;
}

int tok_stream_create(const tok_tokenizer *t, bool skip_special, tok_stream **out)
{
    tok_stream *s = calloc(1, sizeof *s);
    *out = NULL;
    if (!s) return PD_ENOMEM;
    s->t = t;
    s->skip_special = skip_special;
    if (tok__buf_reserve(&s->out, 64) || tok__buf_reserve(&s->pending, 8)) {
        tok_stream_destroy(s);
        return PD_ENOMEM;
    }
    tok_stream_reset(s);
    *out = s;
    return 0;
}

void tok_stream_destroy(tok_stream *s)
{
    if (!s) return;
    for (int k = 0; k < TOK__MAX_STAGES; k++) tok__buf_free(&s->st[k].run);
    items_free(&s->a);
    items_free(&s->b);
    tok__matcher_free(&s->m);
    tok__buf_free(&s->raw);
    tok__buf_free(&s->pending);
    tok__buf_free(&s->out);
    free(s);
}

/* Runs the chain on s->a and moves every finished character to s->out. */
static int stream_step(tok_stream *s, bool final, const char **piece, size_t *len, char *err)
{
    s->raw.len = 0;
    int rc = run_chain(s->t, &s->m, s->st, &s->n_joined, final, &s->a, &s->b, &s->raw);
    if (!rc) rc = tok__buf_put(&s->pending, s->raw.p, s->raw.len);
    if (!rc) {
        size_t keep = final ? 0 : tok__utf8_partial_tail(s->pending.p, s->pending.len);
        size_t done = s->pending.len - keep;
        rc = tok__utf8_lossy(&s->out, s->pending.p, done);
        memmove(s->pending.p, s->pending.p + done, keep);
        s->pending.len = keep;
    }
    if (rc) return pd_errf(err, rc, "out of memory decoding");
    *piece = s->out.p;
    *len = s->out.len;
    return 0;
}

int tok_stream_push(tok_stream *s, int32_t id, const char **piece, size_t *len, char *err)
{
    s->out.len = 0;
    s->out.p[0] = '\0';
    *piece = s->out.p;
    *len = 0;
    int rc = check_id(s->t, id, err);
    if (rc) return rc;
    if (s->skip_special && (s->t->flags[id] & TOK__F_SPECIAL)) return 0;
    items_clear(&s->a);
    if (items_push(&s->a, s->t->arena + s->t->dec_off[id], s->t->dec_len[id]))
        return pd_errf(err, PD_ENOMEM, "out of memory decoding");
    return stream_step(s, false, piece, len, err);
}

int tok_stream_flush(tok_stream *s, const char **piece, size_t *len, char *err)
{
    s->out.len = 0;
    s->out.p[0] = '\0';
    items_clear(&s->a);
    int rc = stream_step(s, true, piece, len, err);
    tok_stream_reset(s);
    return rc;
}
