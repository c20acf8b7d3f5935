/* chat_template.h -- A model's chat template (HF tokenizer_config.json "chat_template") rendered
 * as HF transformers' apply_chat_template(messages, tokenize=False) renders it: jinja2 with
 * trim_blocks and lstrip_blocks, transformers' globals and filters (text/jinja.h), the
 * tokenizer's special tokens as variables. A loaded template is read-only: any number of
 * threads may render it at once. docs/chat.md describes the supported Jinja subset. */
#ifndef PD_CHAT_TEMPLATE_H
#define PD_CHAT_TEMPLATE_H

#include <stdbool.h>

typedef struct {
    const char *role;    /* "system", "user", "assistant", ... (UTF-8) */
    const char *content; /* UTF-8 text; NULL = none (Python's None) */
} chat_message;

typedef struct chat_template chat_template; /* opaque */

/* Reads model_dir/tokenizer_config.json: chat_template (a string, or the list-of-{name,
 * template} form, of which "default" is taken), bos_token, eos_token, unk_token, pad_token,
 * sep_token, cls_token, mask_token (strings or {"content": ...} objects; those not set are
 * left undefined, as transformers does) and additional_special_tokens. A
 * model_dir/chat_template.jinja file, as newer transformers versions save, takes the place of
 * the config's chat_template; model_dir/special_tokens_map.json fills special tokens the
 * config does not set. Returns 0 and *out (free with chat_template_destroy); PD_ENOTFOUND when
 * the model ships no chat template (err says so and names the directory); PD_EIO when a file
 * cannot be read; PD_EFORMAT when a file is not JSON or the template does not parse (err names
 * the file and the template's line and column); PD_ENOMEM. On error *out is NULL. */
int chat_template_load(const char *model_dir, chat_template **out, char *err);

/* Renders the n messages (borrowed) with add_generation_prompt. The template also sees
 * tools = none, documents = none and the special tokens. Returns 0 with *text (NUL-terminated,
 * caller frees with free()); PD_EINVAL when a message has no role or is not valid UTF-8, when
 * the template raises (err is raise_exception's message verbatim, e.g. "Conversation roles
 * must alternate user/assistant/user/assistant/..."), fails as jinja2 would fail, or exceeds
 * the render limits (16 MiB of text); PD_ENOMEM. On error *text is NULL. Thread-safe. */
int chat_template_render(const chat_template *t, const chat_message *msgs, int n,
                         bool add_generation_prompt, char **text, char *err);

void chat_template_destroy(chat_template *t); /* NULL is a no-op */

#endif
