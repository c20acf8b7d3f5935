/* chat_template.c -- HF chat templates: finds a model's template and special tokens the way
 * transformers does (tokenizer_config.json, chat_template.jinja, special_tokens_map.json) and
 * renders conversations with text/jinja.h in transformers' environment. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/error.h"
#include "text/chat_template.h"
#include "text/jinja.h"

static const char *const token_keys[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                         "pad_token", "cls_token", "mask_token"};
enum { N_TOKEN_KEYS = sizeof token_keys / sizeof token_keys[0] };

struct chat_template {
    jinja_template *tmpl;
    char *tokens[N_TOKEN_KEYS]; /* NULL: not set (undefined in the template) */
    char **extra;               /* additional_special_tokens */
    int n_extra;
};

/* A special token's text: a string, or an AddedToken object's "content"; NULL when unset. */
static const char *token_text(const json_t *v)
{
    if (json_is_object(v)) v = json_object_get(v, "content");
    return json_is_string(v) && json_string_length(v) ? json_string_value(v) : NULL;
}

/* HF's configs hold integers beyond 64 bits (model_max_length 1e30): read them as reals. */
static int load_json(const char *path, json_t **out, char *err)
{
    json_error_t je;
    *out = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je);
    if (*out) return 0;
    if (je.line < 0) return pd_errf(err, PD_EIO, "cannot read %s: %s", path, je.text);
    return pd_errf(err, PD_EFORMAT, "%s: malformed JSON at line %d column %d: %s", path, je.line,
                   je.column, je.text);
}

static bool file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int read_text(const char *path, char **out, size_t *len, char *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errf(err, PD_EIO, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 4096, n = 0, got;
    char *buf = malloc(cap);
    while (buf && (got = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += got;
        if (n + 1 == cap) {
            char *b = cap < ((size_t)64 << 20) ? realloc(buf, cap *= 2) : NULL;
            if (!b) free(buf);
            buf = b;
        }
    }
    bool bad = ferror(f);
    fclose(f);
    if (!buf) return pd_errf(err, PD_ENOMEM, "%s: out of memory (or over 64 MiB)", path);
    if (bad) {
        free(buf);
        return pd_errf(err, PD_EIO, "cannot read %s", path);
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
}

/* The template source of cfg's "chat_template" (string or [{name, template}] form) into
 * *src (borrowed from cfg); PD_ENOTFOUND / PD_EFORMAT with err. */
static int config_template(const json_t *cfg, const char *path, const char **src, char *err)
{
    const json_t *ct = json_object_get(cfg, "chat_template");
    if (!ct || json_is_null(ct))
        return pd_errf(err, PD_ENOTFOUND, "%s has no chat_template: the model ships no chat "
                                          "template", path);
    if (json_is_string(ct)) {
        *src = json_string_value(ct);
        return 0;
    }
    if (json_is_array(ct)) {
        size_t i;
        const json_t *e;
        char names[256] = "";
        json_array_foreach(ct, i, e) {
            const char *name = json_string_value(json_object_get(e, "name"));
            const json_t *tt = json_object_get(e, "template");
            if (!name || !json_is_string(tt))
                return pd_errf(err, PD_EFORMAT, "%s: chat_template[%zu] is not a {\"name\", "
                                                "\"template\"} object", path, i);
            if (!strcmp(name, "default")) {
                *src = json_string_value(tt);
                return 0;
            }
            size_t k = strlen(names);
            snprintf(names + k, sizeof names - k, "%s%s", k ? ", " : "", name);
        }
        return pd_errf(err, PD_ENOTFOUND, "%s: the model has several chat templates (%s) and "
                                          "none named \"default\"", path, names);
    }
    return pd_errf(err, PD_EFORMAT, "%s: chat_template is neither a string nor a list", path);
}

static int set_tokens(chat_template *t, const json_t *cfg)
{
    for (int i = 0; i < N_TOKEN_KEYS; i++) {
        const char *s = t->tokens[i] ? NULL : token_text(json_object_get(cfg, token_keys[i]));
        if (s && !(t->tokens[i] = strdup(s))) return PD_ENOMEM;
    }
    const json_t *extra = json_object_get(cfg, "additional_special_tokens");
    if (t->extra || !json_is_array(extra) || !json_array_size(extra)) return 0;
    if (!(t->extra = calloc(json_array_size(extra), sizeof *t->extra))) return PD_ENOMEM;
    size_t i;
    const json_t *e;
    json_array_foreach(extra, i, e) {
        const char *s = token_text(e);
        if (s && !(t->extra[t->n_extra++] = strdup(s))) return PD_ENOMEM;
    }
    return 0;
}

int chat_template_load(const char *model_dir, chat_template **out, char *err)
{
    *out = NULL;
    char cfg_path[4096], jinja_path[4096], map_path[4096], perr[PD_ERR_LEN];
    snprintf(cfg_path, sizeof cfg_path, "%s/tokenizer_config.json", model_dir);
    snprintf(jinja_path, sizeof jinja_path, "%s/chat_template.jinja", model_dir);
    snprintf(map_path, sizeof map_path, "%s/special_tokens_map.json", model_dir);
    bool have_cfg = file_exists(cfg_path), have_jinja = file_exists(jinja_path);
    if (!have_cfg && !have_jinja)
        return pd_errf(err, PD_ENOTFOUND, "%s has no tokenizer_config.json (nor "
                                          "chat_template.jinja): the model ships no chat template",
                       model_dir);
    json_t *cfg = NULL, *map = NULL;
    char *file_src = NULL;
    const char *src = NULL, *src_name = jinja_path;
    size_t src_len = 0;
    int rc;
    chat_template *t = calloc(1, sizeof *t);
    if (!t) return pd_errf(err, PD_ENOMEM, "out of memory");
    if (have_cfg && (rc = load_json(cfg_path, &cfg, err))) goto fail;
    if (have_cfg && !json_is_object(cfg)) {
        rc = pd_errf(err, PD_EFORMAT, "%s is not a JSON object", cfg_path);
        goto fail;
    }
    if (have_jinja) {
        if ((rc = read_text(jinja_path, &file_src, &src_len, err))) goto fail;
        src = file_src;
    } else {
        if ((rc = config_template(cfg, cfg_path, &src, err))) goto fail;
        src_len = strlen(src);
        src_name = cfg_path;
    }
    if (cfg && (rc = set_tokens(t, cfg))) goto oom;
    if (file_exists(map_path)) {
        if ((rc = load_json(map_path, &map, err))) goto fail;
        if (json_is_object(map) && (rc = set_tokens(t, map))) goto oom;
    }
    jinja_parse_params pp = jinja_default_parse_params();
    pp.trim_blocks = true;
    pp.lstrip_blocks = true;
    if ((rc = jinja_parse(src, src_len, &pp, &t->tmpl, perr))) {
        if (rc == PD_ENOMEM) goto oom;
        rc = pd_errf(err, rc, "%s: the chat template does not parse: %s", src_name, perr);
        goto fail;
    }
    json_decref(cfg);
    json_decref(map);
    free(file_src);
    *out = t;
    return 0;
oom:
    rc = pd_errf(err, PD_ENOMEM, "out of memory loading the chat template of %s", model_dir);
fail:
    json_decref(cfg);
    json_decref(map);
    free(file_src);
    chat_template_destroy(t);
    return rc;
}

int chat_template_render(const chat_template *t, const chat_message *msgs, int n,
                         bool add_generation_prompt, char **text, char *err)
{
    *text = NULL;
    if (!t) return pd_errf(err, PD_EINVAL, "no chat template");
    if (n < 0 || (n > 0 && !msgs)) return pd_errf(err, PD_EINVAL, "bad message list");
    json_t *vars = json_object(), *list = json_array();
    if (!vars || !list || json_object_set_new(vars, "messages", list)) {
        json_decref(vars);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        if (!msgs[i].role) {
            rc = pd_errf(err, PD_EINVAL, "message %d has no role", i);
            break;
        }
        json_t *m = json_object(), *role = json_string(msgs[i].role);
        json_t *content = msgs[i].content ? json_string(msgs[i].content) : json_null();
        if (!role || !content) /* jansson refuses invalid UTF-8 */
            rc = pd_errf(err, PD_EINVAL, "message %d: the %s is not valid UTF-8", i,
                         role ? "content" : "role");
        else if (!m || json_object_set(m, "role", role) || json_object_set(m, "content", content) ||
                 json_array_append(list, m))
            rc = pd_errf(err, PD_ENOMEM, "out of memory");
        json_decref(role);
        json_decref(content);
        json_decref(m);
    }
    if (!rc) {
        bool fail = json_object_set_new(vars, "add_generation_prompt",
                                        json_boolean(add_generation_prompt)) ||
                    json_object_set_new(vars, "tools", json_null()) ||
                    json_object_set_new(vars, "documents", json_null());
        for (int i = 0; i < N_TOKEN_KEYS; i++)
            if (t->tokens[i]) fail |= json_object_set_new(vars, token_keys[i], json_string(t->tokens[i])) != 0;
        if (t->n_extra) {
            json_t *a = json_array();
            for (int i = 0; a && i < t->n_extra; i++) fail |= json_array_append_new(a, json_string(t->extra[i])) != 0;
            fail |= !a || json_object_set_new(vars, "additional_special_tokens", a) != 0;
        }
        if (fail) rc = pd_errf(err, PD_ENOMEM, "out of memory");
    }
    if (!rc) rc = jinja_render(t->tmpl, vars, NULL, text, NULL, err);
    json_decref(vars);
    return rc;
}

void chat_template_destroy(chat_template *t)
{
    if (!t) return;
    jinja_destroy(t->tmpl);
    for (int i = 0; i < N_TOKEN_KEYS; i++) free(t->tokens[i]);
    for (int i = 0; i < t->n_extra; i++) free(t->extra[i]);
    free(t->extra);
    free(t);
}
