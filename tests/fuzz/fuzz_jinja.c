/* fuzz_jinja.c -- Fuzzes the Jinja interpreter (text/jinja.h): the input is template source,
 * optionally followed by a NUL byte and a JSON object of variables (otherwise a fixed chat:
 * messages of every kind, tools, special tokens). The input's length picks the whitespace
 * mode (odd: transformers' trim_blocks + lstrip_blocks). A template that parses is rendered
 * twice under small limits: both renders must agree (a render never changes the shared
 * template), a failure must come with a message, and the text must be valid UTF-8. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/jinja.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char default_vars[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    " {\"role\": \"user\", \"content\": \"Grüße 😀 <think>a</think>b\\n\"},"
    " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call00001\","
    "  \"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"x\": 1.5, \"y\": [true, null]}}}]},"
    " {\"role\": \"tool\", \"content\": \"42\"}, {\"role\": \"assistant\", \"content\": \"\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}}],"
    " \"documents\": null, \"add_generation_prompt\": true, \"bos_token\": \"<s>\","
    " \"eos_token\": \"</s>\", \"n\": 3, \"f\": -0.5}";

static bool valid_utf8(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t k = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (!k || i + k > n) return false;
        uint32_t cp = k == 1 ? c : c & (0xFFu >> (k + 1));
        for (size_t j = 1; j < k; j++) {
            if (((unsigned char)s[i + j] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | ((unsigned char)s[i + j] & 0x3F);
        }
        if ((k == 2 && cp < 0x80) || (k == 3 && cp < 0x800) || (k == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += k;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data;
    const char *nul = memchr(text, '\0', size);
    size_t src_len = nul ? (size_t)(nul - text) : size;
    char err[PD_ERR_LEN] = "";
    jinja_parse_params pp = jinja_default_parse_params();
    pp.trim_blocks = pp.lstrip_blocks = size & 1;
    jinja_template *t;
    int rc = jinja_parse(text, src_len, &pp, &t, err);
    if (rc) {
        if (rc != PD_EFORMAT && rc != PD_ENOMEM) abort();
        if (!err[0]) abort();
        return 0;
    }
    json_error_t je;
    json_t *vars = nul ? json_loadb(nul + 1, size - src_len - 1, 0, &je)
                       : json_loads(default_vars, 0, &je);
    if (!vars) vars = json_loads(default_vars, 0, &je);
    if (!json_is_object(vars)) {
        json_decref(vars);
        vars = json_object();
    }
    jinja_render_params rp = jinja_default_render_params();
    rp.max_output = 1 << 20;
    rp.max_memory = 64 << 20;
    rp.max_steps = 200000;
    rp.now = 1700000000;
    char *out[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    int rcs[2];
    for (int i = 0; i < 2; i++) {
        err[0] = 0;
        rcs[i] = jinja_render(t, vars, &rp, &out[i], &len[i], err);
        if (rcs[i] && (out[i] || !err[0] || (rcs[i] != PD_EINVAL && rcs[i] != PD_ENOMEM))) abort();
        if (!rcs[i] && (!out[i] || out[i][len[i]] != 0 || !valid_utf8(out[i], len[i]))) abort();
    }
    if (rcs[0] != rcs[1] || len[0] != len[1] || (!rcs[0] && memcmp(out[0], out[1], len[0]) != 0))
        abort();
    free(out[0]);
    free(out[1]);
    json_decref(vars);
    jinja_destroy(t);
    return 0;
}
