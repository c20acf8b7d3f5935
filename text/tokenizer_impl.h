/* tokenizer_impl.h -- Internal structures of the tokenizer (text/tokenizer*.c): the loaded
 * pipeline (normalizers, pre-tokenizers, BPE tables, post-processor, decoders), per-call
 * scratch memory, and the helpers the files share. Not part of the public API. */
#ifndef PD_TOKENIZER_IMPL_H
#define PD_TOKENIZER_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "text/tokenizer.h"

#define TOK__MAX_STAGES 16 /* pre-tokenizers or decoders after flattening Sequences */

/* ---- growable byte buffer and id vector ---- */

typedef struct {
    char *p;    /* NUL-terminated whenever cap > 0 */
    size_t len; /* bytes used, excluding the NUL */
    size_t cap; /* bytes allocated */
} tok__buf;

int tok__buf_reserve(tok__buf *b, size_t extra); /* room for extra more bytes + NUL */
int tok__buf_put(tok__buf *b, const void *s, size_t n);
void tok__buf_free(tok__buf *b);

typedef struct {
    int32_t *v;
    size_t n, cap;
} tok__ids;

int tok__ids_push(tok__ids *a, int32_t id);

/* ---- UTF-8 and Unicode classes (tokenizer_text.c) ---- */

/* Returns len if s is valid UTF-8 (no surrogates, overlongs or values > U+10FFFF), else the
 * offset of the first invalid byte. */
size_t tok__utf8_check(const char *s, size_t len);
/* Decodes the character at s (valid UTF-8, at least one byte left); *n gets its length. */
uint32_t tok__utf8_next(const char *s, size_t *n);
/* Encodes cp into out (4 bytes), returns the length. */
size_t tok__utf8_put(uint32_t cp, char *out);
/* Length (0-3) of the trailing bytes of s that are a valid but unfinished character. */
size_t tok__utf8_partial_tail(const char *s, size_t len);
/* Appends s to out with every maximal invalid subsequence replaced by U+FFFD (Rust's
 * String::from_utf8_lossy). */
int tok__utf8_lossy(tok__buf *out, const char *s, size_t len);
bool tok__is_space(uint32_t cp);   /* Unicode White_Space (Rust char::is_whitespace) */
bool tok__is_word(uint32_t cp);    /* regex \w: letters, marks, Nd, Pc, Nl, joiners */
bool tok__is_numeric(uint32_t cp); /* Rust char::is_numeric: Nd, Nl, No */

/* ---- patterns: a literal string or a PCRE2 regex with Unicode properties ---- */

typedef struct {
    char *lit;      /* literal pattern (Split/Replace "String"); NULL for a regex */
    size_t lit_len; /* bytes of lit */
    pcre2_code *re; /* compiled regex (UTF + UCP), JIT-compiled when jit */
    bool jit;       /* pcre2_jit_compile succeeded */
} tok__pat;

/* Compiles a pattern from tokenizer.json's {"String": s} or {"Regex": s}. Regex \s and \S are
 * rewritten to Unicode White_Space (Oniguruma's meaning, which HF uses). Returns 0, PD_EFORMAT
 * (bad regex; err names `what`) or PD_ENOMEM. */
int tok__pat_init(tok__pat *p, const char *s, size_t len, bool regex, const char *what, char *err);
void tok__pat_free(tok__pat *p);

/* Match scratch for tok__pat_find: one per thread and call. */
typedef struct {
    pcre2_match_data *md;
    pcre2_match_context *mctx; /* with a large JIT stack, created on first need */
    pcre2_jit_stack *jstack;
} tok__matcher;

void tok__matcher_free(tok__matcher *m);

/* Finds the first match in s[start, len). Returns 1 and [*ms, *me), 0 when none, or a
 * negative error (PD_ENOMEM, PD_EINVAL for a regex engine failure). */
int tok__pat_find(const tok__pat *p, tok__matcher *m, const char *s, size_t len, size_t start,
                  size_t *ms, size_t *me);

/* A split of a string: [s, e) and whether it is a pattern match. */
typedef struct {
    size_t s, e;
    bool match;
} tok__span;

typedef struct {
    tok__span *v;
    size_t n, cap;
} tok__spans;

int tok__spans_push(tok__spans *a, size_t s, size_t e, bool match);

/* HF's Pattern::find_matches: covers s[0, len) with alternating non-match/match spans. */
int tok__pat_find_all(const tok__pat *p, tok__matcher *m, const char *s, size_t len,
                      tok__spans *out);

/* ---- pipeline components ---- */

enum {
    TOK__NORM_NFC,
    TOK__NORM_NFD,
    TOK__NORM_NFKC,
    TOK__NORM_NFKD,
    TOK__NORM_PREPEND,
    TOK__NORM_REPLACE,
};

typedef struct {
    int kind;  /* TOK__NORM_* */
    char *str; /* Prepend: text to prepend; Replace: replacement content */
    size_t str_len;
    tok__pat pat; /* Replace: what to replace */
} tok__norm;

enum { TOK__PRE_SPLIT, TOK__PRE_BYTELEVEL, TOK__PRE_DIGITS, TOK__PRE_METASPACE };
/* HF's SplitDelimiterBehavior */
enum {
    TOK__SPLIT_REMOVED,
    TOK__SPLIT_ISOLATED,
    TOK__SPLIT_MERGED_PREV,
    TOK__SPLIT_MERGED_NEXT,
    TOK__SPLIT_CONTIGUOUS,
};
enum { TOK__PREPEND_ALWAYS, TOK__PREPEND_FIRST, TOK__PREPEND_NEVER };

typedef struct {
    int kind;              /* TOK__PRE_* */
    tok__pat pat;          /* Split: pattern; ByteLevel with use_regex: the GPT-2 regex */
    int behavior;          /* Split: TOK__SPLIT_* */
    char repl[4];          /* Metaspace: replacement character, UTF-8 */
    size_t repl_len;       /* bytes of repl */
    int prepend_scheme;    /* Metaspace: TOK__PREPEND_* */
    bool invert;           /* Split: the pattern matches the pieces, not the delimiters */
    bool add_prefix_space; /* ByteLevel: prepend ' ' to a piece not starting with one */
    bool use_regex;        /* ByteLevel: split with the GPT-2 regex */
    bool individual;       /* Digits: every digit alone (else runs of digits) */
    bool split;            /* Metaspace: split on the replacement (MergedWithNext) */
} tok__pretok;

enum {
    TOK__DEC_BYTELEVEL,
    TOK__DEC_REPLACE,
    TOK__DEC_BYTEFALLBACK,
    TOK__DEC_FUSE,
    TOK__DEC_STRIP,
    TOK__DEC_METASPACE,
};

typedef struct {
    int kind;      /* TOK__DEC_* */
    tok__pat pat;  /* Replace: pattern */
    char *content; /* Replace: replacement */
    size_t content_len;
    char ch[4];         /* Strip: content char; Metaspace: replacement, UTF-8 */
    size_t ch_len;      /* bytes of ch */
    size_t start, stop; /* Strip: at most this many chars stripped at each end */
    int prepend_scheme; /* Metaspace: TOK__PREPEND_* */
    bool joined;        /* an earlier stage (ByteLevel, Fuse) joined all tokens into one */
} tok__dec;

typedef struct {
    int32_t id;
    char *content; /* as in tokenizer.json */
    size_t len;
    char *norm; /* normalized content (normalized tokens; NULL when unchanged) */
    size_t norm_len;
    bool special, normalized, lstrip, rstrip, single_word;
} tok__added;

/* A byte trie over added-token strings for leftmost-longest matching. */
typedef struct {
    uint32_t first_edge; /* index of the node's first edge in edge_byte/edge_node */
    uint16_t n_edges;
    int32_t added; /* index into t->added of the token ending here, or -1 */
} tok__trie_node;

typedef struct {
    tok__trie_node *nodes;
    uint8_t *edge_byte; /* sorted per node */
    uint32_t *edge_node;
    uint32_t n_nodes, n_edges;
    uint8_t root_has[32]; /* bitmap: bytes that start some token */
} tok__trie;

typedef struct {
    uint64_t key;  /* (uint64)left << 32 | right; UINT64_MAX = empty slot */
    uint32_t rank; /* position in the merges list */
    int32_t id;    /* id of the merged token */
} tok__merge;

typedef struct {
    uint32_t hash; /* tok__hash of the token; 0 = empty slot */
    int32_t id;
    uint32_t off; /* the token string in arena */
    uint32_t len;
} tok__vslot;

enum { TOK__F_SPECIAL = 1, TOK__F_ADDED = 2 };

struct tok_tokenizer {
    uint64_t gen;  /* unique per loaded tokenizer (keys the word caches) */
    int32_t n_ids; /* max id + 1 over model vocab and added tokens */
    char *arena;   /* all token strings */
    size_t arena_len;
    /* model (BPE) */
    uint32_t *model_off;     /* [n_ids] offset of the model token string, or UINT32_MAX */
    uint32_t *model_len;     /* [n_ids] */
    tok__vslot *vocab_slots; /* open addressing over the model vocab */
    uint32_t vocab_mask;
    int32_t vocab_count; /* entries in the model vocab (HF's get_vocab_size) */
    tok__merge *merges;  /* open addressing on key */
    uint32_t merge_mask;
    int32_t unk_id;    /* -1 = no unk token */
    char *cont_prefix; /* continuing_subword_prefix, NULL when none or empty */
    size_t cont_prefix_len;
    char *eow_suffix; /* end_of_word_suffix, NULL when none or empty */
    size_t eow_suffix_len;
    int32_t byte_ids[256];     /* byte-level: id of the GPT-2 char of each byte, or -1 */
    int32_t ascii_ids[128];    /* id of each one-byte token, or -1 */
    int32_t fallback_ids[256]; /* byte_fallback: id of <0xXX>, or -1 */
    bool fuse_unk, byte_fallback, ignore_merges;
    bool byte_level; /* a ByteLevel pre-tokenizer maps bytes to the GPT-2 alphabet */
    /* decoding */
    uint32_t *dec_off; /* [n_ids] string fed to the decoder, or UINT32_MAX */
    uint32_t *dec_len;
    uint8_t *flags; /* [n_ids] TOK__F_* */
    /* pipeline */
    tok__norm *norms;
    int n_norms;
    tok__pretok pretoks[TOK__MAX_STAGES];
    int n_pretoks;
    tok__dec decs[TOK__MAX_STAGES];
    int n_decs;
    bool has_decoder; /* false: HF joins the tokens with spaces */
    /* post-processor template for one sequence, with add_special_tokens */
    int32_t *tmpl_pre, *tmpl_post;
    int32_t n_tmpl_pre, n_tmpl_post;
    /* added tokens */
    tok__added *added;
    int32_t n_added;
    tok__trie trie_raw;  /* normalized=false tokens, matched in the raw text */
    tok__trie trie_norm; /* normalized=true tokens, matched in normalized text */
    /* tokenizer_config.json */
    int32_t bos_id, eos_id;
    bool add_bos;
};

/* ---- BPE tables and merging (tokenizer_bpe.c) ---- */

uint32_t tok__hash(const char *s, size_t len);
/* Model vocab lookup: id or -1. */
int32_t tok__vocab_get(const tok_tokenizer *t, const char *s, size_t len);
/* Builds vocab_slots from model_off/model_len. */
int tok__vocab_index(tok_tokenizer *t);
/* Adds one merge (later duplicates win, as in HF's map). */
int tok__merges_reserve(tok_tokenizer *t, size_t n);
void tok__merges_put(tok_tokenizer *t, int32_t a, int32_t b, uint32_t rank, int32_t id);
/* Byte -> GPT-2 alphabet code point. */
uint32_t tok__byte_char(uint8_t b);
/* GPT-2 alphabet code point -> byte, or -1. */
int tok__char_byte(uint32_t cp);

/* A word cache entry: a short pre-token and its ids (64 bytes). */
typedef struct {
    uint64_t gen;  /* tokenizer generation; 0 = empty */
    uint32_t hash; /* high half of the word's hash */
    uint8_t len;   /* bytes of word */
    uint8_t n;     /* ids */
    char word[22];
    int32_t ids[7];
} tok__cache_slot;

#define TOK__CACHE_SLOTS 4096 /* direct-mapped, 256 KiB */

/* Scratch for encoding: per call, or kept in a tok_scratch with a word cache. */
typedef struct {
    tok__matcher m;
    tok__buf norm[2];                  /* normalizer ping-pong */
    tok__buf content[TOK__MAX_STAGES]; /* pre-tokenizer output per stage */
    tok__spans spans[TOK__MAX_STAGES]; /* pre-tokenizer splits per stage */
    tok__buf word;                     /* BPE key building */
    tok__buf mapped;                   /* BPE: a pre-token in the GPT-2 alphabet */
    void *sym;                         /* BPE symbols */
    size_t sym_cap;
    void *heap; /* BPE merge queue */
    size_t heap_cap;
    tok__cache_slot *cache; /* word -> ids, or NULL */
} tok__work;

void tok__work_free(tok__work *w);

/* Runs the BPE model on one pre-token and appends its ids. */
int tok__bpe_encode(const tok_tokenizer *t, tok__work *w, const char *s, size_t len, tok__ids *out);

/* ---- normalizers and pre-tokenizers (tokenizer_pretok.c) ---- */

/* Runs the normalizer chain on s; *out points to s or into w->norm. */
int tok__normalize(const tok_tokenizer *t, tok__work *w, const char *s, size_t len,
                   const char **out, size_t *out_len);
/* Runs the pre-tokenizers from stage on, then the model, appending ids. at_start: the piece
 * begins at offset 0 of the original text (Metaspace prepend_scheme "first"). */
int tok__pretokenize(const tok_tokenizer *t, tok__work *w, int stage, const char *s, size_t len,
                     bool at_start, tok__ids *out);

/* ---- added tokens (tokenizer_added.c) ---- */

int tok__trie_build(tok__trie *tr, const tok__added *added, int32_t n_added, bool normalized);
void tok__trie_free(tok__trie *tr);
/* Splits s at added tokens of trie as HF's AddedVocabulary::find_matches; spans with
 * match=true carry the added index in e's place via *ids (one per span, -1 for text). */
int tok__added_split(const tok_tokenizer *t, const tok__trie *tr, const char *s, size_t len,
                     tok__spans *spans, tok__ids *which);

/* ---- the fast path through tokenizer.json's vocab and merges (tokenizer_json.c) ---- */

typedef struct {
    size_t vocab_s, vocab_e;   /* model.vocab's object [s, e) in the text; 0, 0 = not found */
    size_t merges_s, merges_e; /* model.merges' array [s, e); 0, 0 = not found */
} tok__json_model;

/* Finds model.vocab and model.merges. Returns 0 (also when the text is not an object, for
 * jansson to report) or PD_EFORMAT with the line and column of a syntax error. */
int tok__json_locate(const char *s, size_t len, tok__json_model *m, char *err);
/* A copy of s without the insides of the located values (their newlines kept, so that line
 * numbers stay right); caller frees. NULL when out of memory. */
char *tok__json_without(const char *s, size_t len, const tok__json_model *m, size_t *out_len);
/* An upper bound on the entries of the object or array at [start, end). */
size_t tok__json_count(const char *s, size_t start, size_t end);

typedef int (*tok__vocab_fn)(void *ctx, const char *key, size_t len, int64_t id, char *err);
/* legacy "a b" merges come as (a = whole string, b = NULL) */
typedef int (*tok__merge_fn)(void *ctx, size_t idx, const char *a, size_t a_len, const char *b,
                             size_t b_len, char *err);
int tok__json_vocab(const char *s, size_t start, size_t end, tok__vocab_fn fn, void *ctx,
                    char *err);
int tok__json_merges(const char *s, size_t start, size_t end, tok__merge_fn fn, void *ctx,
                     char *err);

/* ---- loading (tokenizer_pipeline.c, tokenizer_load.c) and freeing (tokenizer.c) ---- */

/* JSON field readers: 0 = present, 1 = absent or null (out set to ""/0 or untouched),
 * PD_EFORMAT = wrong type (err names `what` and the key). */
int tok__json_str(const json_t *o, const char *key, const char **s, size_t *len, const char *what,
                  char *err);
int tok__json_bool(const json_t *o, const char *key, bool *b, const char *what, char *err);
const char *tok__json_type(const json_t *o);  /* the "type" string, or NULL */
char *tok__strdup(const char *s, size_t len); /* NUL-terminated copy; NULL when out of memory */

/* Each reads one component (null = none) into t, appending to its stage lists. Returns 0,
 * PD_EFORMAT, PD_EUNSUPPORTED (err names the component) or PD_ENOMEM. tok__load_decoder's
 * joined tracks whether an earlier decoder joined all tokens. */
int tok__load_normalizer(tok_tokenizer *t, const json_t *n, char *err);
int tok__load_pretok(tok_tokenizer *t, const json_t *p, char *err);
int tok__load_decoder(tok_tokenizer *t, const json_t *d, bool *joined, char *err);
int tok__load_post(tok_tokenizer *t, const json_t *p, char *err); /* after the id tables */

void tok__free_pipeline(tok_tokenizer *t);

#endif
