/* stopstr.h -- Stop strings over streamed text: text is pushed as it is detokenized; what can
 * be shown is released at once, except a tail that could still be the start of a stop string,
 * which is held back. When a stop string appears, the text before it is released and the rest
 * is dropped (the stop string itself is not shown, as in vLLM and OpenAI's API). */
#ifndef PD_STOPSTR_H
#define PD_STOPSTR_H

#include <stdbool.h>
#include <stddef.h>

typedef struct stopstr stopstr; /* opaque */

/* Copies the n stop strings. Returns 0, PD_EINVAL (an empty string), PD_ENOMEM. */
int stopstr_create(const char *const *stops, int n, stopstr **out);
void stopstr_destroy(stopstr *s); /* NULL is a no-op */

/* Feeds len bytes of new text. *out / *out_len receive the text that may be shown now
 * (borrowed; valid until the next call). *stopped becomes true when a stop string was found;
 * later pushes release nothing. Returns 0 or PD_ENOMEM. */
int stopstr_push(stopstr *s, const char *text, size_t len, const char **out, size_t *out_len,
                 bool *stopped);
/* End of stream without a stop: releases the held-back tail. */
void stopstr_flush(stopstr *s, const char **out, size_t *out_len);

#endif
