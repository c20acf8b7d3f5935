/* tokenizer.h -- HuggingFace tokenizer.json (BPE models) in C: encode and decode give the same
 * ids and text as HF tokenizers, and tok_stream turns a token stream into complete UTF-8 text.
 * A loaded tokenizer is read-only and may be shared by any number of threads; a tok_stream
 * belongs to one thread.
 *
 * Supported (anything else in tokenizer.json is a load error naming the component):
 *   model          BPE: byte-level (GPT-2, Qwen2/3, Llama-3 with ignore_merges) and
 *                  SentencePiece-style (byte_fallback, fuse_unk, unk_token); no dropout
 *   normalizer     NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence
 *   pre_tokenizer  ByteLevel, Split (String or Regex; every behavior; invert), Digits,
 *                  Metaspace, Sequence
 *   post_processor TemplateProcessing (single sequences), ByteLevel, Sequence
 *   decoder        ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence
 *   added_tokens   matched in the raw text before normalization (normalized=false) or in the
 *                  normalized text (normalized=true), with special, lstrip, rstrip, single_word
 * Not supported (load errors): models WordPiece, Unigram, WordLevel; BPE dropout; normalizers
 * Lowercase, Strip, StripAccents, BertNormalizer, Precompiled, NMT, ByteLevel; pre-tokenizers
 * Whitespace, WhitespaceSplit, Punctuation, BertPreTokenizer, UnicodeScripts,
 * CharDelimiterSplit, FixedLength, and any pre-tokenizer after ByteLevel; decoders BPEDecoder,
 * WordPiece, CTC, ByteFallback after ByteLevel/Fuse, and Replace after ByteLevel/Fuse with a
 * pattern longer than one character; post-processors BertProcessing,
 * RobertaProcessing. Truncation and padding settings are ignored (lengths are the server's
 * business); pair sequences and offsets are not offered.
 * tokenizer_config.json (optional) gives bos_token, eos_token and add_bos_token. */
#ifndef PD_TOKENIZER_H
#define PD_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tok_tokenizer tok_tokenizer; /* opaque, read-only after load */
typedef struct tok_stream tok_stream;       /* opaque, one per decoding sequence */

/* Loads dir/tokenizer.json and, when present, dir/tokenizer_config.json. Returns 0 and a new
 * tokenizer in *out (free with tok_destroy); PD_EIO if tokenizer.json cannot be read,
 * PD_EFORMAT if it is malformed or truncated (err names the file and the position or key) or
 * gives a token an id of 2^24 or more,
 * PD_EUNSUPPORTED if it uses a component listed above as unsupported (err names it),
 * PD_ENOMEM. On error *out is NULL. */
int tok_load(const char *dir, tok_tokenizer **out, char *err);

/* Like tok_load, from tokenizer.json text in memory (json, json_len bytes) and optional
 * tokenizer_config.json text (config may be NULL). Neither buffer is kept. */
int tok_load_buffer(const char *json, size_t json_len, const char *config, size_t config_len,
                    tok_tokenizer **out, char *err);

void tok_destroy(tok_tokenizer *t); /* NULL is a no-op */

/* Encodes len bytes of UTF-8 text (NUL bytes are ordinary characters). add_special applies
 * the post-processor's template (e.g. a leading BOS), like HF's add_special_tokens.
 * Returns 0 with *ids (caller frees with free(); NULL when *n is 0) and *n; PD_EINVAL if the
 * text is not valid UTF-8 (err gives the byte offset); PD_ENOMEM. Thread-safe. */
int tok_encode(const tok_tokenizer *t, const char *text, size_t len, bool add_special,
               int32_t **ids, int32_t *n, char *err);

/* Reusable encoding memory with a cache of recent words (256 KiB), for a thread that
 * encodes often: tok_encode_scratch with it gives the same ids as tok_encode, faster and
 * without allocating scratch each call. One thread uses a scratch at a time; it may be used
 * with several tokenizers. Returns 0 or PD_ENOMEM. */
typedef struct tok_scratch tok_scratch;
int tok_scratch_create(tok_scratch **out);
void tok_scratch_destroy(tok_scratch *s); /* NULL is a no-op */
int tok_encode_scratch(const tok_tokenizer *t, tok_scratch *s, const char *text, size_t len,
                       bool add_special, int32_t **ids, int32_t *n, char *err);

/* Decodes n ids to text, as HF's decode(ids, skip_special_tokens). Returns 0 with *text
 * (NUL-terminated, caller frees with free()) and, if len is not NULL, its length in bytes
 * (the text may contain NUL); PD_EINVAL if an id is not in the vocabulary (err names it);
 * PD_ENOMEM. Invalid byte sequences decode to U+FFFD as in HF. Thread-safe. */
int tok_decode(const tok_tokenizer *t, const int32_t *ids, int32_t n, bool skip_special,
               char **text, size_t *len, char *err);

/* Number of ids: one more than the largest id of the model vocabulary and added tokens. */
int32_t tok_vocab_size(const tok_tokenizer *t);
/* BOS / EOS ids from tokenizer_config.json (bos_token, eos_token), or -1 when not given. */
int32_t tok_bos_id(const tok_tokenizer *t);
int32_t tok_eos_id(const tok_tokenizer *t);
/* Whether prompts should start with BOS: tokenizer_config.json's add_bos_token when given,
 * else whether the post-processor template starts with the BOS token. */
bool tok_add_bos(const tok_tokenizer *t);
/* The id of a token string (an added token first, then the model vocabulary), or -1. */
int32_t tok_token_to_id(const tok_tokenizer *t, const char *s, size_t len);
/* The token string of id as stored in tokenizer.json (byte-level tokens in their GPT-2
 * alphabet form), borrowed from t; NULL for an unknown id. *len receives its length. */
const char *tok_id_to_token(const tok_tokenizer *t, int32_t id, size_t *len);
/* Whether id is a special token (skipped by skip_special). */
bool tok_is_special(const tok_tokenizer *t, int32_t id);

/* Creates an incremental detokenizer over t (borrowed; must outlive the stream). Tokens are
 * pushed one at a time; each push returns only text that is complete UTF-8: the bytes of a
 * character split over byte-level tokens are held until it is complete, a run of
 * byte-fallback tokens (<0xE4><0xBD><0xA0>) until the run ends (HF decodes a run as a whole
 * and replaces every byte of an invalid run with U+FFFD), and decoder rules tied to the start
 * of the sequence (Strip of the first leading space, Metaspace's first token) apply only
 * there. The concatenation of every piece returned by push and flush equals tok_decode of the
 * whole sequence. Returns 0 or PD_ENOMEM. */
int tok_stream_create(const tok_tokenizer *t, bool skip_special, tok_stream **out);
void tok_stream_destroy(tok_stream *s); /* NULL is a no-op */

/* Pushes one id. Returns 0 with *piece and *len set to the newly complete text (possibly empty;
 * borrowed, valid until the next call on s, NUL-terminated); PD_EINVAL for an unknown id
 * (the stream is unchanged); PD_ENOMEM. */
int tok_stream_push(tok_stream *s, int32_t id, const char **piece, size_t *len, char *err);

/* Ends the sequence: returns whatever is still held (an incomplete character becomes U+FFFD,
 * as in tok_decode) and resets the stream for a new sequence. Same ownership as push. */
int tok_stream_flush(tok_stream *s, const char **piece, size_t *len, char *err);

/* Drops anything held and starts a new sequence. */
void tok_stream_reset(tok_stream *s);

#endif
