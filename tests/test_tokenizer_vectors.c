/* test_tokenizer_vectors.c -- The tokenizer against HF tokenizers' own output
 * (testdata/tokenizers/vectors.json: qwen3, llama3, mistral, gpt2, stories260k): ids with
 * and without special tokens, decoded text with and without special tokens, and the
 * incremental detokenizer fed one token at a time giving the same text as a full decode. */
#include <jansson.h>
#include <stdbool.h>

#include "common/error.h"
#include "common/json_util.h"
#include "test_util.h"
#include "text/tokenizer.h"

static void print_ids(const char *what, const int32_t *v, size_t n)
{
    fprintf(stderr, "    %s:", what);
    for (size_t i = 0; i < n; i++) fprintf(stderr, " %d", v[i]);
    fprintf(stderr, "\n");
}

/* Strict UTF-8 check (every piece a stream hands out must be whole characters). */
static bool utf8_ok(const char *str, size_t len)
{
    const unsigned char *s = (const unsigned char *)str;
    for (size_t i = 0; i < len;) {
        unsigned c = s[i];
        size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (n == 0 || i + n > len || (n == 2 && c < 0xC2)) return false;
        for (size_t k = 1; k < n; k++)
            if ((s[i + k] & 0xC0) != 0x80) return false;
        i += n;
    }
    return true;
}

/* One scratch (with its word cache) shared by every tokenizer and case: its results must be
 * the same as tok_encode's. */
static tok_scratch *g_scratch;

/* Compares our encoding of text with the JSON id array want, with and without a scratch. */
static void check_encode(const tok_tokenizer *t, const char *name, size_t idx, const char *text,
                         size_t len, bool add_special, const json_t *want)
{
    char err[PD_ERR_LEN] = "";
    int32_t *ids = NULL, n = 0;
    for (int pass = 0; pass < 2; pass++) { /* the second pass finds the words cached */
        int32_t *sids = NULL, sn = 0;
        int src = tok_encode_scratch(t, g_scratch, text, len, add_special, &sids, &sn, err);
        bool ok = src == 0 && (size_t)sn == json_array_size(want);
        for (int32_t i = 0; ok && i < sn; i++)
            ok = sids[i] == (int32_t)json_integer_value(json_array_get(want, i));
        CHECK_MSG(ok, "%s case %zu: tok_encode_scratch differs (pass %d)", name, idx, pass);
        free(sids);
    }
    int rc = tok_encode(t, text, len, add_special, &ids, &n, err);
    CHECK_MSG(rc == 0, "%s case %zu: encode failed: %s", name, idx, err);
    size_t wn = json_array_size(want);
    bool same = rc == 0 && (size_t)n == wn;
    for (size_t i = 0; same && i < wn; i++)
        same = ids[i] == (int32_t)json_integer_value(json_array_get(want, i));
    CHECK_MSG(same, "%s case %zu (%s): ids differ for \"%.60s\"", name, idx,
              add_special ? "with special" : "no special", text);
    if (!same) {
        int32_t *w = malloc((wn ? wn : 1) * sizeof *w);
        for (size_t i = 0; w && i < wn; i++)
            w[i] = (int32_t)json_integer_value(json_array_get(want, i));
        print_ids("got ", ids, (size_t)n);
        if (w) print_ids("want", w, wn);
        free(w);
    }
    free(ids);
}

/* Feeds ids one at a time and checks that the pieces add up to tok_decode's text. */
static void check_stream(const tok_tokenizer *t, const char *name, size_t idx, const int32_t *ids,
                         size_t n, bool skip, const char *full, size_t full_len)
{
    char err[PD_ERR_LEN] = "";
    tok_stream *s = NULL;
    CHECK_EQ_INT(tok_stream_create(t, skip, &s), 0);
    if (!s) return;
    char *acc = malloc(full_len + 4096);
    size_t acc_len = 0;
    bool ok = acc != NULL;
    for (size_t i = 0; ok && i <= n; i++) {
        const char *piece;
        size_t len;
        int rc = i < n ? tok_stream_push(s, ids[i], &piece, &len, err)
                       : tok_stream_flush(s, &piece, &len, err);
        if (rc || acc_len + len > full_len + 4000) {
            ok = false;
            break;
        }
        CHECK_MSG(utf8_ok(piece, len), "%s case %zu: piece %zu is not whole UTF-8", name, idx, i);
        memcpy(acc + acc_len, piece, len);
        acc_len += len;
    }
    CHECK_MSG(ok && acc_len == full_len && memcmp(acc, full, full_len) == 0,
              "%s case %zu: streamed text (skip=%d) \"%.*s\" != decode \"%s\"", name, idx, skip,
              ok ? (int)acc_len : 0, acc ? acc : "", full);
    free(acc);
    tok_stream_destroy(s);
}

static void check_decode(const tok_tokenizer *t, const char *name, size_t idx, const json_t *jids,
                         bool skip, const char *want)
{
    char err[PD_ERR_LEN] = "";
    size_t n = json_array_size(jids);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    for (size_t i = 0; i < n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(jids, i));
    char *text = NULL;
    size_t len = 0;
    int rc = tok_decode(t, ids, (int32_t)n, skip, &text, &len, err);
    CHECK_MSG(rc == 0, "%s case %zu: decode failed: %s", name, idx, err);
    if (rc == 0) {
        CHECK_MSG(len == strlen(want) && memcmp(text, want, len) == 0,
                  "%s case %zu: decode (skip=%d) \"%s\" != \"%s\"", name, idx, skip, text, want);
        check_stream(t, name, idx, ids, n, skip, text, len);
    }
    free(text);
    free(ids);
}

/* The stream over ids_with_special must also add up to tok_decode of them. */
static void check_stream_special(const tok_tokenizer *t, const char *name, size_t idx,
                                 const json_t *jids)
{
    char err[PD_ERR_LEN] = "";
    size_t n = json_array_size(jids);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    for (size_t i = 0; i < n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(jids, i));
    for (int skip = 0; skip < 2; skip++) {
        char *text = NULL;
        size_t len = 0;
        CHECK_EQ_INT(tok_decode(t, ids, (int32_t)n, skip, &text, &len, err), 0);
        if (text) check_stream(t, name, idx, ids, n, skip, text, len);
        free(text);
    }
    free(ids);
}

int main(void)
{
    char path[4096], err[PD_ERR_LEN] = "";
    snprintf(path, sizeof path, "%s/testdata/tokenizers/vectors.json", pd_test_shared_dir());
    json_t *root = NULL;
    if (pd_json_load_file(path, &root, err)) {
        fprintf(stderr, "skip: %s\n", err);
        return 77;
    }
    json_t *toks = json_object_get(root, "tokenizers");
    CHECK_EQ_INT(tok_scratch_create(&g_scratch), 0);
    const char *name;
    json_t *entry;
    int n_tok = 0, n_cases = 0;
    json_object_foreach(toks, name, entry)
    {
        snprintf(path, sizeof path, "%s/testdata/tokenizers/%s", pd_test_shared_dir(), name);
        tok_tokenizer *t = NULL;
        int rc = tok_load(path, &t, err);
        CHECK_MSG(rc == 0, "load %s: %s", name, err);
        if (rc) continue;
        n_tok++;
        json_t *cases = json_object_get(entry, "cases");
        for (size_t i = 0; i < json_array_size(cases); i++) {
            json_t *c = json_array_get(cases, i);
            json_t *jt = json_object_get(c, "text");
            const char *text = json_string_value(jt);
            size_t len = json_string_length(jt);
            check_encode(t, name, i, text, len, false, json_object_get(c, "ids"));
            check_encode(t, name, i, text, len, true, json_object_get(c, "ids_with_special"));
            check_decode(t, name, i, json_object_get(c, "ids"), false,
                         json_string_value(json_object_get(c, "decoded")));
            check_decode(t, name, i, json_object_get(c, "ids"), true,
                         json_string_value(json_object_get(c, "decoded_skip_special")));
            check_stream_special(t, name, i, json_object_get(c, "ids_with_special"));
            n_cases++;
        }
        tok_destroy(t);
    }
    fprintf(stderr, "%d tokenizers, %d cases\n", n_tok, n_cases);
    CHECK(n_tok == 5);
    json_decref(root);
    tok_scratch_destroy(g_scratch);
    return pd_test_result("test_tokenizer_vectors");
}
