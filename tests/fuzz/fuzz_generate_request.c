/* fuzz_generate_request.c -- Fuzzes the public GenerateRequest as far as the router's checks
 * are reachable outside router_main.c: protobuf-c unpack, the exactly-one-prompt rule,
 * svc_sampling_from_proto / svc_stopping_from_proto (as the router calls them), the stop
 * strings (at most 16, none empty) run over the prompt text with the stop-string matcher, and
 * the prompt encoded with the stories260k tokenizer (PD_SHARED_DIR/models/stories260k, loaded
 * once; skipped when absent) or its token ids decoded with it. The matcher must release a
 * prefix of its input that holds no stop string, and stop exactly at one. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "pdserve/v1/generation.pb-c.h"
#include "svc/svc.h"
#include "text/stopstr.h"
#include "text/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const tok_tokenizer *tokenizer(void)
{
    static tok_tokenizer *t;
    static bool tried;
    if (!tried) {
        char err[PD_ERR_LEN];
        tried = true;
        if (tok_load(PD_SHARED_DIR "/models/stories260k", &t, err) < 0) t = NULL;
    }
    return t;
}

/* Whether s[0..len) contains one of the n stop strings. */
static bool has_stop(const char *s, size_t len, char *const *stops, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memmem(s, len, stops[i], strlen(stops[i]))) return true;
    return false;
}

/* Pushes text through a matcher in chunks of `chunk` bytes and checks what it releases. */
static void check_stops(char *const *stops, size_t n, const char *text, size_t len, size_t chunk)
{
    stopstr *s;
    if (stopstr_create((const char *const *)stops, (int)n, &s) < 0) return;
    char *shown = malloc(len + 1);
    size_t n_shown = 0;
    bool stopped = false;
    for (size_t at = 0; shown && at < len && !stopped; at += chunk) {
        const char *out;
        size_t out_len;
        size_t take = len - at < chunk ? len - at : chunk;
        if (stopstr_push(s, text + at, take, &out, &out_len, &stopped) < 0) break;
        if (n_shown + out_len > len) abort();
        memcpy(shown + n_shown, out, out_len);
        n_shown += out_len;
    }
    if (shown && !stopped) {
        const char *out;
        size_t out_len;
        stopstr_flush(s, &out, &out_len);
        if (n_shown + out_len > len) abort();
        memcpy(shown + n_shown, out, out_len);
        n_shown += out_len;
    }
    if (shown) {
        if (memcmp(shown, text, n_shown) != 0) abort();    /* a prefix of the text */
        if (has_stop(shown, n_shown, stops, n)) abort();   /* with no stop string in it */
        if (!stopped && n_shown != len) abort();           /* all of it without a stop */
        if (stopped) {                                     /* else up to a stop string */
            bool at_stop = false;
            for (size_t i = 0; i < n && !at_stop; i++) {
                size_t sl = strlen(stops[i]);
                at_stop = sl <= len - n_shown && memcmp(text + n_shown, stops[i], sl) == 0;
            }
            if (!at_stop) abort();
        }
    }
    free(shown);
    stopstr_destroy(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    Pdserve__V1__GenerateRequest *q = pdserve__v1__generate_request__unpack(NULL, size, data);
    if (!q) return 0;
    char err[PD_ERR_LEN];
    smp_params sp;
    seq_stopping ss;
    bool has_text = q->prompt && q->prompt[0], has_ids = q->n_prompt_token_ids > 0;
    if (has_text == has_ids) goto done;
    if (svc_sampling_from_proto(q->sampling, &sp, err) < 0 ||
        svc_stopping_from_proto(q->stopping, 1, &ss, err) < 0)
        goto done;
    size_t n_stop = q->stopping ? q->stopping->n_stop : 0;
    if (n_stop > 16) goto done;
    for (size_t i = 0; i < n_stop; i++)
        if (!q->stopping->stop[i] || !q->stopping->stop[i][0]) goto done;

    const tok_tokenizer *t = tokenizer();
    if (has_text) {
        size_t len = strlen(q->prompt);
        if (n_stop) {
            check_stops(q->stopping->stop, n_stop, q->prompt, len, 1);
            check_stops(q->stopping->stop, n_stop, q->prompt, len, 7);
        }
        int32_t *ids = NULL, n = 0;
        if (t && tok_encode(t, q->prompt, len, true, &ids, &n, err) == 0) {
            for (int32_t i = 0; i < n; i++)
                if (ids[i] < 0 || ids[i] >= tok_vocab_size(t)) abort();
            free(ids);
        }
    } else if (t) {
        int32_t *ids = malloc(q->n_prompt_token_ids * sizeof *ids);
        if (ids) {
            for (size_t i = 0; i < q->n_prompt_token_ids; i++)
                ids[i] = q->prompt_token_ids[i] > (uint32_t)INT32_MAX
                             ? -1 : (int32_t)q->prompt_token_ids[i];
            char *text = NULL;
            size_t len = 0;
            int32_t n = q->n_prompt_token_ids > (size_t)INT32_MAX
                            ? INT32_MAX : (int32_t)q->n_prompt_token_ids;
            if (tok_decode(t, ids, n, true, &text, &len, err) == 0) {
                if (n_stop) check_stops(q->stopping->stop, n_stop, text, len, 3);
                free(text);
            }
            free(ids);
        }
    }
done:
    pdserve__v1__generate_request__free_unpacked(q, NULL);
    return 0;
}
