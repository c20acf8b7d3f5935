/* fuzz_tokenizer_json.c -- Fuzzes the tokenizer.json loader (text/tokenizer.h): the input is
 * tokenizer.json text, optionally followed by a NUL byte and tokenizer_config.json text. When
 * it loads, a few fixed strings are encoded and decoded with it, and the properties the header
 * promises are checked (ids inside the vocabulary, the scratch encoder equal to the plain one,
 * the streamed pieces equal to tok_decode); a broken promise aborts, so that it is reported. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Streams ids through a tok_stream and checks that the pieces add up to want (want_len bytes). */
static void check_stream(const tok_tokenizer *t, const int32_t *ids, int32_t n, bool skip,
                         const char *want, size_t want_len)
{
    char err[PD_ERR_LEN];
    tok_stream *s;
    if (tok_stream_create(t, skip, &s) < 0) return;
    char *got = malloc(want_len + 1);
    size_t got_len = 0;
    bool ok = got != NULL;
    for (int32_t i = 0; ok && i <= n; i++) {
        const char *piece;
        size_t len;
        int rc = i < n ? tok_stream_push(s, ids[i], &piece, &len, err)
                       : tok_stream_flush(s, &piece, &len, err);
        if (rc < 0) abort(); /* every id came from the encoder */
        if (got_len + len > want_len || memcmp(want + got_len, piece, len) != 0) abort();
        memcpy(got + got_len, piece, len);
        got_len += len;
    }
    if (ok && got_len != want_len) abort();
    free(got);
    tok_stream_destroy(s);
}

static void check_text(const tok_tokenizer *t, tok_scratch *scratch, const char *text,
                       bool add_special)
{
    char err[PD_ERR_LEN];
    size_t len = strlen(text);
    int32_t *ids = NULL, *ids2 = NULL, n = 0, n2 = 0;
    if (tok_encode(t, text, len, add_special, &ids, &n, err) < 0) return;
    const int32_t vocab = tok_vocab_size(t);
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) abort();
    if (scratch && tok_encode_scratch(t, scratch, text, len, add_special, &ids2, &n2, err) == 0) {
        if (n2 != n || (n && memcmp(ids, ids2, (size_t)n * sizeof *ids) != 0)) abort();
        free(ids2);
    }
    for (int skip = 0; skip < 2; skip++) {
        char *out = NULL;
        size_t out_len = 0;
        if (tok_decode(t, ids, n, skip, &out, &out_len, err) < 0) continue;
        check_stream(t, ids, n, skip, out, out_len);
        free(out);
    }
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char *const k_texts[] = {
        "Hello world",
        "  Once upon a time, there was a little girl named Lily.\n\nShe said: \"Hi!\"",
        "numbers 1234567 and 3.14, code: x+=1; // ok",
        "\xc3\xbc" "n" "\xc3\xaf" "c" "\xc3\xb6" "d" "\xc3\xa9"
        " \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x99\x82",
        "<s>x</s><unk><|endoftext|><|im_start|>user<|im_end|>",
        "\t \r\n  \n",
        "",
    };
    const char *text = (const char *)data;
    const char *nul = memchr(text, '\0', size);
    size_t json_len = nul ? (size_t)(nul - text) : size;
    char err[PD_ERR_LEN];
    tok_tokenizer *t;
    if (tok_load_buffer(text, json_len, nul ? nul + 1 : NULL, nul ? size - json_len - 1 : 0, &t,
                        err) < 0)
        return 0;
    tok_scratch *scratch = NULL;
    (void)tok_scratch_create(&scratch);
    for (size_t i = 0; i < sizeof k_texts / sizeof k_texts[0]; i++) {
        check_text(t, scratch, k_texts[i], false);
        check_text(t, scratch, k_texts[i], true);
    }
    /* Every id of a small vocabulary decodes; the first out-of-range id is refused. */
    int32_t vocab = tok_vocab_size(t);
    for (int32_t id = 0; id < vocab && id < 300; id++) {
        char *out = NULL;
        if (tok_decode(t, &id, 1, false, &out, NULL, err) == 0) free(out);
        size_t len;
        (void)tok_id_to_token(t, id, &len);
        (void)tok_is_special(t, id);
    }
    char *out = NULL;
    if (tok_decode(t, &vocab, 1, false, &out, NULL, err) == 0) abort();
    (void)tok_bos_id(t);
    (void)tok_eos_id(t);
    (void)tok_add_bos(t);
    tok_scratch_destroy(scratch);
    tok_destroy(t);
    return 0;
}
