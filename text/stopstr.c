/* stopstr.c -- Stop-string matching with a held-back tail (see stopstr.h). */
#include "text/stopstr.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"

struct stopstr {
    char **stops;
    size_t *lens;
    int n;
    size_t max_len;
    char *buf;       /* held-back tail + new text */
    size_t len, cap;
    char *out;       /* released text */
    size_t out_cap;
    bool stopped;
};

int stopstr_create(const char *const *stops, int n, stopstr **out)
{
    *out = NULL;
    stopstr *s = calloc(1, sizeof *s);
    if (!s) return PD_ENOMEM;
    s->stops = calloc((size_t)(n > 0 ? n : 1), sizeof *s->stops);
    s->lens = calloc((size_t)(n > 0 ? n : 1), sizeof *s->lens);
    if (!s->stops || !s->lens) {
        stopstr_destroy(s);
        return PD_ENOMEM;
    }
    for (int i = 0; i < n; i++) {
        if (!stops[i] || !stops[i][0]) {
            stopstr_destroy(s);
            return PD_EINVAL;
        }
        s->stops[i] = strdup(stops[i]);
        if (!s->stops[i]) {
            stopstr_destroy(s);
            return PD_ENOMEM;
        }
        s->n = i + 1;
        s->lens[i] = strlen(stops[i]);
        if (s->lens[i] > s->max_len) s->max_len = s->lens[i];
    }
    *out = s;
    return 0;
}

void stopstr_destroy(stopstr *s)
{
    if (!s) return;
    for (int i = 0; i < s->n; i++) free(s->stops[i]);
    free(s->stops);
    free(s->lens);
    free(s->buf);
    free(s->out);
    free(s);
}

static int reserve(char **p, size_t *cap, size_t need)
{
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    char *q = realloc(*p, c);
    if (!q) return PD_ENOMEM;
    *p = q;
    *cap = c;
    return 0;
}

/* Length of the longest suffix of buf[0..len) that is a proper prefix of a stop string. */
static size_t held_tail(const stopstr *s, const char *buf, size_t len)
{
    size_t best = 0;
    for (int i = 0; i < s->n; i++) {
        size_t m = s->lens[i] - 1 < len ? s->lens[i] - 1 : len;
        for (size_t k = m; k > best; k--)
            if (memcmp(buf + len - k, s->stops[i], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

int stopstr_push(stopstr *s, const char *text, size_t len, const char **out, size_t *out_len,
                 bool *stopped)
{
    *out = s->out;
    *out_len = 0;
    *stopped = s->stopped;
    if (s->stopped) return 0;
    if (reserve(&s->buf, &s->cap, s->len + len + 1) < 0) return PD_ENOMEM;
    memcpy(s->buf + s->len, text, len);
    s->len += len;
    /* The earliest stop occurrence; only positions that a new byte can complete need a look,
     * but the buffer is short (held tail + new text), so scan it all. */
    size_t hit = s->len;
    for (int i = 0; i < s->n; i++) {
        if (s->lens[i] > s->len) continue;
        for (size_t p = 0; p + s->lens[i] <= s->len && p < hit; p++)
            if (memcmp(s->buf + p, s->stops[i], s->lens[i]) == 0) {
                hit = p;
                break;
            }
    }
    size_t emit;
    if (hit < s->len) {
        s->stopped = true;
        *stopped = true;
        emit = hit;
    } else {
        emit = s->len - held_tail(s, s->buf, s->len);
    }
    if (reserve(&s->out, &s->out_cap, emit + 1) < 0) return PD_ENOMEM;
    memcpy(s->out, s->buf, emit);
    s->out[emit] = 0;
    *out = s->out;
    *out_len = emit;
    if (s->stopped) {
        s->len = 0;
    } else {
        memmove(s->buf, s->buf + emit, s->len - emit);
        s->len -= emit;
    }
    return 0;
}

void stopstr_flush(stopstr *s, const char **out, size_t *out_len)
{
    *out = s->buf ? s->buf : "";
    *out_len = s->stopped ? 0 : s->len;
    s->len = 0;
}
