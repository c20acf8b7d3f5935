/* test_tokenizer.c -- Tokenizer unit tests: pre-tokenizer, normalizer, added-token and decoder
 * semantics on small tokenizer.json files built here (expected values from HF tokenizers' own
 * tests), streaming detokenization (held-back characters, leading space, random sequences),
 * bad inputs (invalid UTF-8, unknown ids, malformed, truncated or unsupported tokenizer.json),
 * stories260k's golden prompts, and encoding from several threads at once. */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "test_util.h"
#include "text/tokenizer.h"

/* ---- building small tokenizers ---- */

typedef struct {
    char *p;
    size_t len, cap;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s)
{
    sb_put(b, s, strlen(s));
}

static void sb_json_string(sbuf *b, const char *s)
{
    sb_str(b, "\"");
    for (; *s; s++) {
        char tmp[8];
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            tmp[0] = '\\';
            tmp[1] = (char)c;
            sb_put(b, tmp, 2);
        } else if (c < 0x20) {
            snprintf(tmp, sizeof tmp, "\\u%04x", c);
            sb_str(b, tmp);
        } else {
            sb_put(b, (const char *)&c, 1);
        }
    }
    sb_str(b, "\"");
}

/* A BPE tokenizer.json whose vocab is every printable ASCII character (or, with byte_level,
 * every GPT-2 byte character), then words[] (NULL-terminated); no merges and ignore_merges,
 * so that a pre-token found in the vocab comes out as one token and anything else as single
 * characters. The other arguments are JSON values spliced in as they are. */
static char *synth_json(const char *normalizer, const char *pre, const char *decoder,
                        const char *added, const char *model_extra, const char **words,
                        bool byte_level)
{
    sbuf b = {0};
    sb_str(&b, "{\"version\": \"1.0\", \"added_tokens\": ");
    sb_str(&b, added ? added : "[]");
    sb_str(&b, ", \"normalizer\": ");
    sb_str(&b, normalizer ? normalizer : "null");
    sb_str(&b, ", \"pre_tokenizer\": ");
    sb_str(&b, pre ? pre : "null");
    sb_str(&b, ", \"post_processor\": null, \"decoder\": ");
    sb_str(&b, decoder ? decoder : "null");
    sb_str(&b, ", \"model\": {\"type\": \"BPE\", \"ignore_merges\": true, \"merges\": []");
    if (model_extra) sb_str(&b, model_extra);
    sb_str(&b, ", \"vocab\": {");
    int id = 0;
    char tmp[32];
    for (int c = 0; c < 256; c++) {
        char ch[8] = {0};
        if (byte_level) {
            unsigned cp = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174 ? (unsigned)c
                          : c <= 32  ? 256u + (unsigned)c
                          : c <= 160 ? 289u + (unsigned)(c - 127)
                                     : 323u;
            if (cp < 0x80) ch[0] = (char)cp;
            else ch[0] = (char)(0xC0 | (cp >> 6)), ch[1] = (char)(0x80 | (cp & 0x3F));
        } else {
            if (c < 32 || c > 126) continue;
            ch[0] = (char)c;
        }
        if (id) sb_str(&b, ", ");
        sb_json_string(&b, ch);
        snprintf(tmp, sizeof tmp, ": %d", id++);
        sb_str(&b, tmp);
    }
    for (size_t i = 0; words && words[i]; i++) {
        sb_str(&b, ", ");
        sb_json_string(&b, words[i]);
        snprintf(tmp, sizeof tmp, ": %d", id++);
        sb_str(&b, tmp);
    }
    sb_str(&b, "}}}");
    return b.p;
}

static tok_tokenizer *synth(const char *normalizer, const char *pre, const char *decoder,
                            const char *added, const char **words, bool byte_level)
{
    char *json = synth_json(normalizer, pre, decoder, added, NULL, words, byte_level);
    char err[PD_ERR_LEN] = "";
    tok_tokenizer *t = NULL;
    int rc = tok_load_buffer(json, strlen(json), NULL, 0, &t, err);
    CHECK_MSG(rc == 0, "synthetic tokenizer: %s", err);
    free(json);
    return t;
}

/* Encodes text and returns its tokens joined by '|' (caller frees). */
static char *pieces(const tok_tokenizer *t, const char *text)
{
    char err[PD_ERR_LEN] = "";
    int32_t *ids = NULL, n = 0;
    sbuf b = {0};
    sb_str(&b, "");
    if (!t || tok_encode(t, text, strlen(text), false, &ids, &n, err)) {
        sb_str(&b, "<encode failed>");
        return b.p;
    }
    for (int32_t i = 0; i < n; i++) {
        size_t len;
        const char *s = tok_id_to_token(t, ids[i], &len);
        if (i) sb_str(&b, "|");
        sb_put(&b, s ? s : "?", s ? len : 1);
    }
    free(ids);
    return b.p;
}

#define CHECK_PIECES(t, text, want)                                                                \
    do {                                                                                           \
        char *got_ = pieces((t), (text));                                                          \
        CHECK_MSG(strcmp(got_, (want)) == 0, "pieces of \"%s\": got \"%s\", want \"%s\"", (text),  \
                  got_, (want));                                                                   \
        free(got_);                                                                                \
    } while (0)

/* ---- pre-tokenizers (expected splits from HF's split.rs, digits.rs, metaspace.rs) ---- */

static void test_split_behaviors(void)
{
    static const char *words[] = {"How",  "are",  "you",  "doing",  "doing?", "How ", "are ",
                                  "you ", " are", " you", " doing", "Hey,",   "man!", NULL};
    static const struct {
        const char *behavior, *want;
    } cases[] = {
        {"Removed", "How|are|you|doing|?"},
        {"Isolated", "How| |are| |you| |doing|?"},
        {"MergedWithPrevious", "How |are |you |doing|?"},
        {"MergedWithNext", "How| are| you| doing|?"},
        {"Contiguous", "How| |are| |you| |doing?"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char pre[256];
        snprintf(pre, sizeof pre,
                 "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"\\\\w+|[^\\\\w\\\\s]+\"}, "
                 "\"behavior\": \"%s\", \"invert\": true}",
                 cases[i].behavior);
        tok_tokenizer *t = synth(NULL, pre, NULL, NULL, words, false);
        CHECK_PIECES(t, "How are you doing?", cases[i].want);
        tok_destroy(t);
    }
    /* a String pattern, and "invert" on a String */
    tok_tokenizer *t = synth(NULL,
                             "{\"type\": \"Split\", \"pattern\": {\"String\": \" \"}, "
                             "\"behavior\": \"Removed\", \"invert\": false}",
                             NULL, NULL, words, false);
    CHECK_PIECES(t, "Hey, man!", "Hey,|man!");
    tok_destroy(t);
    static const char *hello[] = {"Hello", NULL};
    t = synth(NULL,
              "{\"type\": \"Split\", \"pattern\": {\"String\": \"Hello\"}, "
              "\"behavior\": \"Removed\", \"invert\": true}",
              NULL, NULL, hello, false);
    CHECK_PIECES(t, "Hello Hello Hello", "Hello|Hello|Hello");
    tok_destroy(t);
}

static void test_digits_metaspace(void)
{
    static const char *words[] = {"Hey ", "123", " friend!", NULL};
    tok_tokenizer *t = synth(NULL, "{\"type\": \"Digits\", \"individual_digits\": false}", NULL,
                             NULL, words, false);
    CHECK_PIECES(t, "Hey 123 friend!", "Hey |123| friend!");
    tok_destroy(t);
    t = synth(NULL, "{\"type\": \"Digits\", \"individual_digits\": true}", NULL, NULL, words,
              false);
    CHECK_PIECES(t, "Hey 123 friend!", "Hey |1|2|3| friend!");
    tok_destroy(t);

    static const char *mwords[] = {"\xe2\x96\x81",
                                   "\xe2\x96\x81Hey",
                                   "\xe2\x96\x81"
                                   "friend!",
                                   "\xe2\x96\x81Hey\xe2\x96\x81my\xe2\x96\x81"
                                   "friend\xe2\x96\x81",
                                   "how\xe2\x96\x81"
                                   "are\xe2\x96\x81you",
                                   NULL};
    t = synth(NULL,
              "{\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", "
              "\"prepend_scheme\": \"always\", \"split\": true}",
              NULL, NULL, mwords, false);
    CHECK_PIECES(t, "Hey   friend!",
                 "\xe2\x96\x81Hey|\xe2\x96\x81|\xe2\x96\x81|\xe2\x96\x81"
                 "friend!");
    tok_destroy(t);
    /* prepend_scheme "first": only the piece at the very start gets the prefix */
    t = synth(NULL,
              "{\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", "
              "\"prepend_scheme\": \"first\", \"split\": false}",
              NULL,
              "[{\"id\": 400, \"content\": \"<s>\", \"single_word\": false, \"lstrip\": false, "
              "\"rstrip\": false, \"normalized\": false, \"special\": true}]",
              mwords, false);
    CHECK_PIECES(t,
                 "Hey my friend <s>how\xe2\x96\x81"
                 "are you",
                 "\xe2\x96\x81Hey\xe2\x96\x81my\xe2\x96\x81"
                 "friend\xe2\x96\x81|<s>|how\xe2\x96\x81"
                 "are\xe2\x96\x81you");
    tok_destroy(t);
}

static void test_bytelevel_prefix(void)
{
    static const char *words[] = {"\xc4\xa0Hello", "\xc4\xa0world", NULL}; /* ĠHello Ġworld */
    tok_tokenizer *t = synth(NULL,
                             "{\"type\": \"ByteLevel\", \"add_prefix_space\": true, "
                             "\"trim_offsets\": true, \"use_regex\": true}",
                             "{\"type\": \"ByteLevel\"}", NULL, words, true);
    CHECK_PIECES(t, "Hello world", "\xc4\xa0Hello|\xc4\xa0world");
    CHECK_PIECES(t, " world", "\xc4\xa0world");
    tok_destroy(t);
}

static void test_normalizers(void)
{
    static const char *words[] = {"\xc3\xa9t\xc3\xa9", "fi", "e\xcc\x81", NULL};
    tok_tokenizer *t = synth("{\"type\": \"NFC\"}", NULL, NULL, NULL, words, false);
    CHECK_PIECES(t, "e\xcc\x81te\xcc\x81", "\xc3\xa9t\xc3\xa9"); /* e + U+0301 composes */
    tok_destroy(t);
    t = synth("{\"type\": \"NFKC\"}", NULL, NULL, NULL, words, false);
    CHECK_PIECES(t, "\xef\xac\x81", "fi"); /* U+FB01 ligature */
    tok_destroy(t);
    t = synth("{\"type\": \"NFD\"}", NULL, NULL, NULL, words, false);
    CHECK_PIECES(t, "\xc3\xa9", "e\xcc\x81");
    tok_destroy(t);
    static const char *w2[] = {"_a_b", NULL};
    t = synth(
        "{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": \"_\"}, "
        "{\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"_\"}]}",
        NULL, NULL, NULL, w2, false);
    CHECK_PIECES(t, "a b", "_a_b");
    CHECK_PIECES(t, "", "");
    tok_destroy(t);
}

/* ---- added tokens (from HF's added_vocabulary.rs tests, without the Lowercase normalizer) ---- */

#define ADDED(content, lstrip, rstrip, single, normalized, special)                                \
    "{\"id\": 1000, \"content\": \"" content "\", \"single_word\": " #single                       \
    ", \"lstrip\": " #lstrip ", \"rstrip\": " #rstrip ", \"normalized\": " #normalized             \
    ", \"special\": " #special "}"

static void test_added_tokens(void)
{
    static const char *words[] = {" is anthony ", " my name ", " a<mask> <mask>ony ",
                                  "hi",           "there",     NULL};
    tok_tokenizer *t =
        synth(NULL, NULL, NULL,
              "[" ADDED("my", true, true, false, true, false) "," ADDED(
                  "name", false, false, false, true,
                  false) "," ADDED("ony", false, false, true, true,
                                   false) "," ADDED("[CLS]", false, false, false, false,
                                                    true) "," ADDED("[SEP]", false, false, false,
                                                                    false, true) "]",
              words, false);
    CHECK_PIECES(t, "[CLS] my name is anthony [SEP]", "[CLS]|my|name| is anthony |[SEP]");
    /* added ids follow HF's assignment: after the model vocab, in order */
    CHECK_EQ_INT(tok_token_to_id(t, "my", 2), 95 + 5);
    CHECK_EQ_INT(tok_token_to_id(t, "[SEP]", 5), 95 + 9);
    CHECK(tok_is_special(t, 95 + 9) && !tok_is_special(t, 95 + 5));
    tok_destroy(t);

    t = synth(NULL, NULL, NULL, "[" ADDED("<mask>", false, false, true, true, false) "]", words,
              false);
    CHECK_PIECES(t, "<mask> my name <mask> a<mask> <mask>ony <mask>",
                 "<mask>| my name |<mask>| a<mask> <mask>ony |<mask>");
    tok_destroy(t);

    t = synth(NULL, NULL, NULL, "[" ADDED("<mask>", true, true, true, true, false) "]", words,
              false);
    CHECK_PIECES(t, "hi <mask> there\t<mask>\t<mask>\xe2\x80\x80", "hi|<mask>|there|<mask>|<mask>");
    tok_destroy(t);
}

/* ---- decoders ---- */

static char *decode_str(const tok_tokenizer *t, const char **toks, bool skip)
{
    int32_t ids[16];
    int32_t n = 0;
    for (; toks[n]; n++) ids[n] = tok_token_to_id(t, toks[n], strlen(toks[n]));
    char err[PD_ERR_LEN] = "", *text = NULL;
    size_t len;
    if (tok_decode(t, ids, n, skip, &text, &len, err)) {
        fprintf(stderr, "decode failed: %s\n", err);
        return strdup("<decode failed>");
    }
    return text;
}

/* Streams the tokens and returns the concatenated pieces (length in *out_len if not NULL). */
static char *stream_str(const tok_tokenizer *t, const int32_t *ids, int32_t n, bool skip,
                        size_t *out_len)
{
    tok_stream *s;
    char err[PD_ERR_LEN] = "";
    sbuf b = {0};
    sb_str(&b, "");
    if (tok_stream_create(t, skip, &s)) return b.p;
    for (int32_t i = 0; i <= n; i++) {
        const char *piece;
        size_t len;
        int rc = i < n ? tok_stream_push(s, ids[i], &piece, &len, err)
                       : tok_stream_flush(s, &piece, &len, err);
        CHECK_MSG(rc == 0, "stream: %s", err);
        if (!rc) sb_put(&b, piece, len);
    }
    tok_stream_destroy(s);
    if (out_len) *out_len = b.len;
    return b.p;
}

static void check_decode_both(const tok_tokenizer *t, const char **toks, const char *want)
{
    int32_t ids[16];
    int32_t n = 0;
    for (; toks[n]; n++) ids[n] = tok_token_to_id(t, toks[n], strlen(toks[n]));
    char *full = decode_str(t, toks, false), *streamed = stream_str(t, ids, n, false, NULL);
    CHECK_MSG(strcmp(full, want) == 0, "decode: got \"%s\", want \"%s\"", full, want);
    CHECK_MSG(strcmp(streamed, want) == 0, "stream: got \"%s\", want \"%s\"", streamed, want);
    free(full);
    free(streamed);
}

static void test_decoders(void)
{
    static const char *words[] = {"Hey",
                                  " friend!",
                                  "HHH",
                                  "<0x61>",
                                  "<0xE5>",
                                  "<0x8F>",
                                  "<0xAB>",
                                  "\xe2\x96\x81Hey",
                                  "\xe2\x96\x81"
                                  "friend",
                                  "\xe2\x96\x81",
                                  NULL};
    tok_tokenizer *t =
        synth(NULL, NULL, "{\"type\": \"Strip\", \"content\": \"H\", \"start\": 1, \"stop\": 0}",
              NULL, words, false);
    check_decode_both(t, (const char *[]){"Hey", " friend!", "HHH", NULL}, "ey friend!HH");
    tok_destroy(t);

    t = synth(NULL, NULL, "{\"type\": \"ByteFallback\"}", NULL, words, false);
    check_decode_both(t, (const char *[]){"<0x61>", NULL}, "a");
    check_decode_both(t, (const char *[]){"<0xE5>", NULL}, "\xef\xbf\xbd");
    check_decode_both(t, (const char *[]){"<0xE5>", "<0x8F>", NULL}, "\xef\xbf\xbd\xef\xbf\xbd");
    check_decode_both(t, (const char *[]){"<0xE5>", "<0x8F>", "<0xAB>", NULL}, "\xe5\x8f\xab");
    check_decode_both(t, (const char *[]){"<0xE5>", "<0x8F>", "<0xAB>", "a", NULL},
                      "\xe5\x8f\xab"
                      "a");
    check_decode_both(t, (const char *[]){"<0xE5>", "<0x8F>", "a", NULL},
                      "\xef\xbf\xbd\xef\xbf\xbd"
                      "a");
    tok_destroy(t);

    /* Metaspace decoder: the first token loses its replacement characters */
    t = synth(NULL, NULL,
              "{\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", "
              "\"prepend_scheme\": \"always\", \"split\": true}",
              NULL, words, false);
    check_decode_both(t,
                      (const char *[]){"\xe2\x96\x81Hey",
                                       "\xe2\x96\x81"
                                       "friend",
                                       NULL},
                      "Hey friend");
    tok_destroy(t);

    /* no decoder: HF joins tokens with spaces */
    t = synth(NULL, NULL, NULL, NULL, words, false);
    check_decode_both(t, (const char *[]){"Hey", "HHH", "a", NULL}, "Hey HHH a");
    tok_destroy(t);

    /* Strip at both ends after Fuse: only the sequence's ends are stripped */
    t = synth(NULL, NULL,
              "{\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", "
              "\"pattern\": {\"String\": \"\\u2581\"}, \"content\": \" \"}, {\"type\": \"Fuse\"}, "
              "{\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 2}]}",
              NULL, words, false);
    check_decode_both(t,
                      (const char *[]){"\xe2\x96\x81", "\xe2\x96\x81Hey", "\xe2\x96\x81",
                                       "\xe2\x96\x81", "\xe2\x96\x81",
                                       "\xe2\x96\x81"
                                       "friend",
                                       "\xe2\x96\x81", "\xe2\x96\x81", "\xe2\x96\x81", NULL},
                      " Hey    friend ");
    tok_destroy(t);
}

/* ---- streaming on real tokenizers ---- */

static tok_tokenizer *load_shared(const char *name)
{
    char path[4096], err[PD_ERR_LEN] = "";
    snprintf(path, sizeof path, "%s/testdata/tokenizers/%s", pd_test_shared_dir(), name);
    tok_tokenizer *t = NULL;
    if (access(path, R_OK) != 0) return NULL;
    int rc = tok_load(path, &t, err);
    CHECK_MSG(rc == 0, "load %s: %s", name, err);
    return t;
}

/* Pushes the encoding of text token by token: nothing may come out before the first piece
 * starts with want_first_piece (a character split over several tokens comes out whole), the
 * pieces add up to the text, and the flush has nothing left. */
static void check_holdback(const tok_tokenizer *t, const char *text, const char *want_first_piece)
{
    char err[PD_ERR_LEN] = "";
    int32_t *ids = NULL, n = 0;
    CHECK_EQ_INT(tok_encode(t, text, strlen(text), false, &ids, &n, err), 0);
    tok_stream *s;
    CHECK_EQ_INT(tok_stream_create(t, true, &s), 0);
    sbuf b = {0};
    sb_str(&b, "");
    bool first_seen = false;
    for (int32_t i = 0; i < n; i++) {
        const char *piece;
        size_t len;
        CHECK_EQ_INT(tok_stream_push(s, ids[i], &piece, &len, err), 0);
        if (len && !first_seen) {
            CHECK_MSG(strncmp(piece, want_first_piece, strlen(want_first_piece)) == 0,
                      "first piece of \"%s\": \"%s\" does not start with \"%s\"", text, piece,
                      want_first_piece);
            first_seen = true;
        }
        sb_put(&b, piece, len);
    }
    const char *piece;
    size_t len;
    CHECK_EQ_INT(tok_stream_flush(s, &piece, &len, err), 0);
    CHECK_EQ_INT(len, 0);
    CHECK_MSG(strcmp(b.p, text) == 0, "streamed \"%s\" != \"%s\"", b.p, text);
    free(b.p);
    free(ids);
    tok_stream_destroy(s);
}

/* Random id sequences, biased towards the n_bytes lowest ids (byte tokens, whose runs make
 * partial and invalid characters): the streamed text must equal tok_decode's, always. */
static void check_random_stream(const tok_tokenizer *t, int32_t n_bytes)
{
    char err[PD_ERR_LEN] = "";
    uint64_t rng = 12345;
    for (int round = 0; round < 400; round++) {
        int32_t seq[24];
        int32_t len_seq = 1 + round % 24;
        for (int32_t i = 0; i < len_seq; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            seq[i] = (rng >> 40) % 4 ? (int32_t)((rng >> 33) % (uint64_t)n_bytes)
                                     : (int32_t)((rng >> 33) % (uint64_t)tok_vocab_size(t));
        }
        for (int skip = 0; skip < 2; skip++) {
            char *text = NULL;
            size_t tl, sl;
            CHECK_EQ_INT(tok_decode(t, seq, len_seq, skip, &text, &tl, err), 0);
            char *streamed = stream_str(t, seq, len_seq, skip, &sl);
            CHECK_MSG(text && sl == tl && memcmp(streamed, text, tl) == 0,
                      "round %d skip %d: stream and decode differ", round, skip);
            free(text);
            free(streamed);
        }
    }
}

static void test_stream_real(void)
{
    tok_tokenizer *gpt2 = load_shared("gpt2"), *st = load_shared("stories260k");
    if (!gpt2 || !st) {
        fprintf(stderr, "shared tokenizers missing: streaming tests skipped\n");
        tok_destroy(gpt2);
        tok_destroy(st);
        return;
    }
    /* byte-level: 😀 is several tokens, nothing comes out before its last byte */
    check_holdback(gpt2, "\xf0\x9f\x98\x80", "\xf0\x9f\x98\x80");
    check_holdback(gpt2, "\xe6\xb7\xb1\xe5\xba\xa6 ok", "\xe6\xb7\xb1");
    /* byte fallback: 你好 is six <0x..> tokens in stories260k, held until the run ends; and
     * the leading space of the first word is stripped only at the start */
    check_holdback(st, "\xe4\xbd\xa0\xe5\xa5\xbd ok", "\xe4\xbd\xa0\xe5\xa5\xbd");
    check_holdback(st, "Hello world", "He"); /* "▁He" loses its space */
    char err[PD_ERR_LEN] = "";
    int32_t *ids, n;
    CHECK_EQ_INT(tok_encode(st, "a b", 3, false, &ids, &n, err), 0);
    char *s1 = stream_str(st, ids, n, false, NULL);
    CHECK_MSG(strcmp(s1, "a b") == 0, "stream \"%s\"", s1);
    free(s1);
    /* a stream that is reset starts a new sequence: its first space is stripped again */
    tok_stream *s;
    const char *piece;
    size_t len;
    CHECK_EQ_INT(tok_stream_create(st, false, &s), 0);
    CHECK_EQ_INT(tok_stream_push(s, ids[n - 1], &piece, &len, err), 0); /* "▁b" */
    CHECK_MSG(strcmp(piece, "b") == 0, "first piece \"%s\"", piece);
    CHECK_EQ_INT(tok_stream_push(s, ids[n - 1], &piece, &len, err), 0);
    CHECK_MSG(strcmp(piece, " b") == 0, "second piece \"%s\"", piece);
    tok_stream_reset(s);
    CHECK_EQ_INT(tok_stream_push(s, ids[n - 1], &piece, &len, err), 0);
    CHECK_MSG(strcmp(piece, "b") == 0, "piece after reset \"%s\"", piece);
    /* an unfinished character at the end comes out as U+FFFD, as in tok_decode */
    int32_t e4 = tok_token_to_id(st, "<0xE4>", 6);
    CHECK(e4 >= 0);
    CHECK_EQ_INT(tok_stream_push(s, e4, &piece, &len, err), 0);
    CHECK_EQ_INT(len, 0);
    CHECK_EQ_INT(tok_stream_flush(s, &piece, &len, err), 0);
    CHECK_MSG(strcmp(piece, "\xef\xbf\xbd") == 0, "flushed \"%s\"", piece);
    tok_stream_destroy(s);
    free(ids);

    check_random_stream(gpt2, 256);
    check_random_stream(st, 259);
    tok_destroy(gpt2);
    tok_destroy(st);
}

/* ---- stories260k golden prompts ---- */

static void test_stories_golden(void)
{
    tok_tokenizer *t = load_shared("stories260k");
    if (!t) return;
    CHECK_EQ_INT(tok_bos_id(t), 1);
    CHECK_EQ_INT(tok_eos_id(t), 2);
    CHECK(tok_add_bos(t));
    CHECK_EQ_INT(tok_vocab_size(t), 512);
    static const struct {
        const char *text;
        int32_t ids[12];
        int32_t n;
    } cases[] = {
        {"", {1}, 1},
        {"Once upon a time", {1, 403, 407, 261, 378}, 5},
        {"The dog", {1, 291, 400, 428}, 4},
        {"Zoo", {1, 410, 469, 347}, 4},
    };
    char err[PD_ERR_LEN] = "";
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int32_t *ids = NULL, n = 0;
        CHECK_EQ_INT(tok_encode(t, cases[i].text, strlen(cases[i].text), true, &ids, &n, err), 0);
        bool same = n == cases[i].n;
        for (int32_t k = 0; same && k < n; k++) same = ids[k] == cases[i].ids[k];
        CHECK_MSG(same, "golden prompt \"%s\"", cases[i].text);
        free(ids);
    }
    /* the start of the BOS-only golden story */
    int32_t story[] = {403, 407, 261, 378, 432, 383, 286, 261,
                       376, 298, 315, 421, 395, 317, 426, 2};
    char *text = NULL;
    CHECK_EQ_INT(tok_decode(t, story, 16, true, &text, NULL, err), 0);
    CHECK_STR_CONTAINS(text, "Once upon a time, there was a little girl named Lily");
    CHECK(text && text[strlen(text) - 1] == '.');
    CHECK(text && strncmp(text, "Once", 4) == 0);
    free(text);
    tok_destroy(t);
}

/* ---- bad inputs ---- */

static void test_invalid_utf8(void)
{
    tok_tokenizer *t = load_shared("qwen3");
    if (!t) t = synth(NULL, NULL, NULL, NULL, NULL, false);
    static const char *bad[] = {"abc\x80",          "\xc0\x80", "\xed\xa0\x80",     "ok \xe4\xbd",
                                "\xf5\x80\x80\x80", "\xff",     "\xf4\x90\x80\x80", "\xe0\x80\xaf"};
    char err[PD_ERR_LEN];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int32_t *ids = (int32_t *)1, n = 7;
        err[0] = '\0';
        int rc = tok_encode(t, bad[i], strlen(bad[i]), false, &ids, &n, err);
        CHECK_EQ_INT(rc, PD_EINVAL);
        CHECK_STR_CONTAINS(err, "not valid UTF-8");
        CHECK(ids == NULL && n == 0);
    }
    /* NUL is a character, and an empty text gives no ids */
    int32_t *ids = NULL, n = -1;
    CHECK_EQ_INT(tok_encode(t, "a\0b", 3, false, &ids, &n, err), 0);
    CHECK(n >= 2);
    free(ids);
    CHECK_EQ_INT(tok_encode(t, "", 0, false, &ids, &n, err), 0);
    CHECK(n == 0 && ids == NULL);
    tok_destroy(t);
}

static void test_unknown_id(void)
{
    tok_tokenizer *t = synth(NULL, NULL, NULL, NULL, NULL, false);
    if (!t) return;
    char err[PD_ERR_LEN] = "", *text = (char *)1;
    int32_t bad[] = {tok_vocab_size(t), -1, 1 << 30};
    for (int i = 0; i < 3; i++) {
        int32_t ids[2] = {1, bad[i]};
        CHECK_EQ_INT(tok_decode(t, ids, 2, false, &text, NULL, err), PD_EINVAL);
        CHECK(text == NULL);
        CHECK_STR_CONTAINS(err, "unknown token id");
    }
    tok_stream *s;
    const char *piece;
    size_t len;
    CHECK_EQ_INT(tok_stream_create(t, false, &s), 0);
    CHECK_EQ_INT(tok_stream_push(s, -5, &piece, &len, err), PD_EINVAL);
    CHECK_EQ_INT(tok_stream_push(s, 33, &piece, &len, err), 0); /* the stream still works */
    CHECK(len == 1 && piece[0] == 'A');
    tok_stream_destroy(s);
    CHECK(tok_id_to_token(t, -1, &len) == NULL);
    CHECK(tok_id_to_token(t, tok_vocab_size(t), &len) == NULL);
    tok_destroy(t);
    tok_destroy(NULL);
    tok_stream_destroy(NULL);
}

static void expect_load_error(const char *json, int code, const char *needle)
{
    char err[PD_ERR_LEN] = "";
    tok_tokenizer *t = (tok_tokenizer *)1;
    int rc = tok_load_buffer(json, strlen(json), NULL, 0, &t, err);
    CHECK_MSG(rc == code, "load: rc %d (%s), want %d, for %.80s", rc, err, code, json);
    CHECK(t == NULL);
    CHECK_STR_CONTAINS(err, needle);
}

/* Loads json from a copy that ends exactly at a page whose next page is unmapped, so that a
 * read one byte past the end crashes even without ASan. */
static int load_at_page_end(const char *json, char *err)
{
    size_t len = strlen(json), page = (size_t)sysconf(_SC_PAGESIZE);
    size_t span = (len + page - 1) / page * page;
    char *map = mmap(NULL, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    CHECK(map != MAP_FAILED);
    if (map == MAP_FAILED) return PD_ENOMEM;
    CHECK(mprotect(map + span, page, PROT_NONE) == 0);
    char *copy = map + span - len;
    memcpy(copy, json, len);
    tok_tokenizer *t = NULL;
    int rc = tok_load_buffer(copy, len, NULL, 0, &t, err);
    tok_destroy(t);
    munmap(map, span + page);
    return rc;
}

/* Found by tests/fuzz/fuzz_tokenizer_json: input ending right after a key's ':' made the
 * locator read the byte past the buffer (the value's first byte). */
static void test_truncated_after_key(void)
{
    static const char *const k_cut[] = {
        "{\"model\":",
        "{\"model\": ",
        "{\"version\": \"1.0\", \"model\":\n",
        "{\"model\": {\"vocab\":",
        "{\"model\": {\"type\": \"BPE\", \"merges\": ",
        "{\"added_tokens\":",
    };
    for (size_t i = 0; i < sizeof k_cut / sizeof k_cut[0]; i++) {
        char err[PD_ERR_LEN] = "";
        int rc = load_at_page_end(k_cut[i], err);
        CHECK_MSG(rc == PD_EFORMAT, "%s: rc %d (%s)", k_cut[i], rc, err);
        CHECK_STR_CONTAINS(err, "malformed JSON");
    }
}

static void test_bad_json(void)
{
    expect_load_error("{", PD_EFORMAT, "malformed JSON");
    expect_load_error("[1, 2]", PD_EFORMAT, "top level");
    expect_load_error("{\"version\": \"1.0\"}", PD_EFORMAT, "model");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": [], \"merges\": []}}", PD_EFORMAT,
                      "vocab");
    expect_load_error(
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a b\"]}}",
        PD_EFORMAT, "not in the vocabulary");
    expect_load_error(
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a a a\"]}}",
        PD_EFORMAT, "merges[0]");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -3}, \"merges\": []}}",
                      PD_EFORMAT, "bad id");
    /* Found by tests/fuzz/fuzz_tokenizer_json: one large id sized the per-id tables by it
     * (10^9 took 8 GB and seconds of filling); ids of 2^24 and above are refused. */
    expect_load_error(
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 16777216}, \"merges\": []}}",
        PD_EFORMAT, "16777216");
    expect_load_error(
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 1000000000}, \"merges\": []}}",
        PD_EFORMAT, "is not below");

    /* unsupported components are named */
    char *j;
    static const struct {
        const char *norm, *pre, *dec, *extra, *needle;
    } un[] = {
        {"{\"type\": \"Lowercase\"}", NULL, NULL, NULL, "normalizer \"Lowercase\""},
        {"{\"type\": \"BertNormalizer\"}", NULL, NULL, NULL, "BertNormalizer"},
        {NULL, "{\"type\": \"Whitespace\"}", NULL, NULL, "pre_tokenizer \"Whitespace\""},
        {NULL,
         "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"ByteLevel\"}, "
         "{\"type\": \"Digits\"}]}",
         NULL, NULL, "after ByteLevel"},
        {NULL, NULL, "{\"type\": \"WordPiece\"}", NULL, "decoder \"WordPiece\""},
        {NULL, NULL, "{\"type\": \"CTC\"}", NULL, "CTC"},
        {NULL, NULL, NULL, ", \"dropout\": 0.1", "dropout"},
        {NULL, NULL,
         "{\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Fuse\"}, {\"type\": "
         "\"Replace\", \"pattern\": {\"String\": \"ab\"}, \"content\": \"c\"}]}",
         NULL, "longer than one character"},
    };
    for (size_t i = 0; i < sizeof un / sizeof un[0]; i++) {
        j = synth_json(un[i].norm, un[i].pre, un[i].dec, NULL, un[i].extra, NULL, false);
        expect_load_error(j, PD_EUNSUPPORTED, un[i].needle);
        free(j);
    }
    expect_load_error("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", PD_EUNSUPPORTED,
                      "model \"WordPiece\"");
    expect_load_error("{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", PD_EUNSUPPORTED,
                      "Unigram");
    expect_load_error(
        "{\"post_processor\": {\"type\": \"RobertaProcessing\"}, \"model\": {\"type\": "
        "\"BPE\", \"vocab\": {}, \"merges\": []}}",
        PD_EUNSUPPORTED, "RobertaProcessing");
    expect_load_error("{\"version\": \"2.0\", \"model\": {}}", PD_EUNSUPPORTED, "version");
}

/* tok_load on a directory: a truncated copy of a real tokenizer.json, a missing file. */
static void test_load_files(void)
{
    char src[4096], dir[] = "/tmp/pd_tok_test_XXXXXX", path[4200];
    char err[PD_ERR_LEN] = "";
    tok_tokenizer *t = NULL;
    snprintf(src, sizeof src, "%s/testdata/tokenizers/stories260k/tokenizer.json",
             pd_test_shared_dir());
    FILE *f = fopen(src, "rb");
    if (!f || !mkdtemp(dir)) {
        if (f) fclose(f);
        return;
    }
    char *data = malloc(1 << 20);
    size_t n = fread(data, 1, 1 << 20, f);
    fclose(f);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    size_t cuts[] = {n / 2, n - 3, 1};
    for (size_t i = 0; i < 3; i++) {
        f = fopen(path, "wb");
        fwrite(data, 1, cuts[i], f);
        fclose(f);
        int rc = tok_load(dir, &t, err);
        CHECK_EQ_INT(rc, PD_EFORMAT);
        CHECK_STR_CONTAINS(err, "malformed JSON");
        CHECK_STR_CONTAINS(err, dir);
        CHECK(t == NULL);
    }
    f = fopen(path, "wb");
    fwrite(data, 1, n, f);
    fclose(f);
    CHECK_EQ_INT(tok_load(dir, &t, err), 0); /* whole file, no tokenizer_config.json */
    CHECK_EQ_INT(tok_bos_id(t), -1);
    tok_destroy(t);
    unlink(path);
    CHECK_EQ_INT(tok_load(dir, &t, err), PD_EIO);
    CHECK_STR_CONTAINS(err, "tokenizer.json");
    rmdir(dir);
    free(data);
}

/* ---- threads ---- */

typedef struct {
    const tok_tokenizer *t;
    const char *text;
    int32_t *want;
    int32_t n_want;
    int bad;
} thread_arg;

static void *encode_thread(void *p)
{
    thread_arg *a = p;
    char err[PD_ERR_LEN];
    for (int i = 0; i < 50; i++) {
        int32_t *ids, n;
        if (tok_encode(a->t, a->text, strlen(a->text), true, &ids, &n, err) || n != a->n_want ||
            memcmp(ids, a->want, (size_t)n * sizeof *ids))
            a->bad++;
        free(ids);
    }
    return NULL;
}

static void test_threads(void)
{
    tok_tokenizer *t = load_shared("qwen3");
    if (!t) return;
    const char *text =
        "<|im_start|>user\nThreads share one tokenizer: 深度学习, café, 1234567!<|im_end|>";
    char err[PD_ERR_LEN];
    thread_arg a[4];
    pthread_t th[4];
    int32_t *want, n;
    CHECK_EQ_INT(tok_encode(t, text, strlen(text), true, &want, &n, err), 0);
    for (int i = 0; i < 4; i++) {
        a[i] = (thread_arg){t, text, want, n, 0};
        pthread_create(&th[i], NULL, encode_thread, &a[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK_EQ_INT(a[i].bad, 0);
    }
    free(want);
    tok_destroy(t);
}

int main(void)
{
    test_split_behaviors();
    test_digits_metaspace();
    test_bytelevel_prefix();
    test_normalizers();
    test_added_tokens();
    test_decoders();
    test_stream_real();
    test_stories_golden();
    test_invalid_utf8();
    test_unknown_id();
    test_bad_json();
    test_truncated_after_key();
    test_load_files();
    test_threads();
    return pd_test_result("test_tokenizer");
}
