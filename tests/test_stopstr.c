/* test_stopstr.c -- Stop strings over text streamed in arbitrary pieces. */
#include <stdlib.h>

#include "common/error.h"
#include "tests/test_util.h"
#include "text/stopstr.h"

/* Streams text in pieces of `step` bytes; returns the shown text (caller frees). */
static char *stream(const char *const *stops, int n, const char *text, size_t step, bool *stopped)
{
    stopstr *s;
    CHECK(stopstr_create(stops, n, &s) == 0);
    size_t len = strlen(text), got = 0;
    char *shown = calloc(len + 1, 1);
    *stopped = false;
    for (size_t i = 0; i < len && !*stopped; i += step) {
        const char *o;
        size_t ol;
        size_t k = len - i < step ? len - i : step;
        CHECK(stopstr_push(s, text + i, k, &o, &ol, stopped) == 0);
        memcpy(shown + got, o, ol);
        got += ol;
    }
    if (!*stopped) {
        const char *o;
        size_t ol;
        stopstr_flush(s, &o, &ol);
        memcpy(shown + got, o, ol);
        got += ol;
    }
    shown[got] = 0;
    stopstr_destroy(s);
    return shown;
}

int main(void)
{
    const char *stops[] = {"\n\n", "THE END", "abcab"};
    const char *text = "Once upon a time.\nThe dog abcaXabcab ran. THE END and more";
    for (size_t step = 1; step <= 9; step++) {
        bool stopped;
        char *shown = stream(stops, 3, text, step, &stopped);
        CHECK(stopped);
        CHECK_MSG(strcmp(shown, "Once upon a time.\nThe dog abcaX") == 0, "step %zu: '%s'", step, shown);
        free(shown);
    }
    /* No stop: everything is shown, the held tail comes out at the flush. */
    for (size_t step = 1; step <= 5; step++) {
        bool stopped;
        char *shown = stream(stops, 3, "ends with THE EN", step, &stopped);
        CHECK(!stopped);
        CHECK(strcmp(shown, "ends with THE EN") == 0);
        free(shown);
    }
    /* Held back while ambiguous, released as soon as it cannot be a stop. */
    stopstr *s;
    const char *o;
    size_t ol;
    bool st;
    CHECK(stopstr_create(stops, 3, &s) == 0);
    CHECK(stopstr_push(s, "x THE", 5, &o, &ol, &st) == 0);
    CHECK_EQ_INT(ol, 2); /* "x " shown; "THE" held: it may begin "THE END" */
    CHECK(stopstr_push(s, " EXIT", 5, &o, &ol, &st) == 0);
    CHECK(!st);
    CHECK(ol == 7 && strncmp(o, "THE EXI", ol) == 0); /* the final "T" may begin "THE END" */
    stopstr_destroy(s);
    /* Multi-byte text is never split inside a character by the held tail. */
    const char *u[] = {"é!"};
    bool stopped;
    char *shown = stream(u, 1, "café au lait é!", 2, &stopped);
    CHECK(stopped);
    CHECK(strcmp(shown, "café au lait ") == 0);
    free(shown);
    /* No stop strings: a pass-through. */
    shown = stream(NULL, 0, "plain text", 3, &stopped);
    CHECK(!stopped && strcmp(shown, "plain text") == 0);
    free(shown);
    const char *bad[] = {""};
    CHECK_EQ_INT(stopstr_create(bad, 1, &s), PD_EINVAL);
    return pd_test_result("test_stopstr");
}
