/* test_chat_template.c -- text/chat_template.h: every chat vector of tests/chat/vectors.json
 * (the templates of ../shared/testdata/tokenizers and tests/chat/templates over a set of
 * conversations, rendered by Python's jinja2 as transformers renders them) renders to the same
 * bytes or fails as it fails (raise_exception's message verbatim); models without a template
 * give a clear PD_ENOTFOUND; how the template and special tokens are found (list form,
 * chat_template.jinja, AddedToken objects, special_tokens_map.json); bad input. Also runs
 * tests/chat/gen_vectors.py --check, when Python's jinja2 is importable, to see that the
 * committed vectors are what jinja2 renders now. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/error.h"
#include "test_util.h"
#include "text/chat_template.h"

static char tmp_root[256];

static void write_file(const char *dir, const char *name, const char *text)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    CHECK_MSG(f != NULL, "cannot write %s", path);
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

/* A fresh model directory under tmp_root with the given files (NULL = absent). */
static const char *model_dir(const char *name, const char *config, const char *jinja,
                             const char *map)
{
    static char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", tmp_root, name);
    mkdir(dir, 0700);
    if (config) write_file(dir, "tokenizer_config.json", config);
    if (jinja) write_file(dir, "chat_template.jinja", jinja);
    if (map) write_file(dir, "special_tokens_map.json", map);
    return dir;
}

static int render1(const chat_template *t, const char *role, const char *content, bool agp,
                   char **out, char *err)
{
    chat_message m = {role, content};
    return chat_template_render(t, &m, 1, agp, out, err);
}

/* ---- the vectors ---- */
typedef struct {
    char *model;
    chat_template *t;
    int rc;
} loaded;

static chat_template *load_model(loaded *cache, int *n_cache, const json_t *c, int *rc_out)
{
    const char *model = json_string_value(json_object_get(c, "model"));
    for (int i = 0; i < *n_cache; i++)
        if (!strcmp(cache[i].model, model)) {
            *rc_out = cache[i].rc;
            return cache[i].t;
        }
    char dir[1024], err[PD_ERR_LEN];
    if (!strncmp(model, "tokenizers/", 11)) {
        snprintf(dir, sizeof dir, "%s/testdata/%s", pd_test_shared_dir(), model);
    } else {
        /* tests/chat/templates/X.jinja inside a tokenizer_config.json, with its tokens */
        char src_path[1024];
        snprintf(src_path, sizeof src_path, "%s/tests/chat/%s", PD_SOURCE_DIR, model);
        json_t *cfg = json_deep_copy(json_object_get(c, "special_tokens"));
        FILE *f = fopen(src_path, "rb");
        CHECK_MSG(f != NULL, "cannot open %s", src_path);
        char *src = calloc(1, 1 << 20);
        size_t n = f ? fread(src, 1, (1 << 20) - 1, f) : 0;
        if (f) fclose(f);
        json_object_set_new(cfg, "chat_template", json_stringn(src, n));
        free(src);
        char name[256];
        snprintf(name, sizeof name, "m%d", *n_cache);
        char *text = json_dumps(cfg, JSON_INDENT(1));
        snprintf(dir, sizeof dir, "%s", model_dir(name, text, NULL, NULL));
        free(text);
        json_decref(cfg);
    }
    loaded *l = &cache[(*n_cache)++];
    l->model = strdup(model);
    l->rc = chat_template_load(dir, &l->t, err);
    CHECK_MSG(l->rc == 0, "%s: %s", model, err);
    *rc_out = l->rc;
    return l->t;
}

static void test_vectors(void)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/chat/vectors.json", PD_SOURCE_DIR);
    json_error_t je;
    json_t *doc = json_load_file(path, 0, &je);
    CHECK_MSG(doc != NULL, "cannot read %s: %s", path, je.text);
    if (!doc) return;
    loaded cache[64];
    int n_cache = 0, ok = 0;
    json_t *cases = json_object_get(doc, "chat"), *c;
    CHECK(json_array_size(cases) >= 100);
    size_t i;
    json_array_foreach(cases, i, c) {
        if (n_cache == 64) break;
        int rc;
        chat_template *t = load_model(cache, &n_cache, c, &rc);
        if (rc) continue;
        json_t *jm = json_object_get(c, "messages");
        size_t n = json_array_size(jm);
        chat_message *m = calloc(n + 1, sizeof *m);
        for (size_t k = 0; k < n; k++) {
            json_t *e = json_array_get(jm, k);
            m[k].role = json_string_value(json_object_get(e, "role"));
            m[k].content = json_string_value(json_object_get(e, "content")); /* null -> NULL */
        }
        bool agp = json_is_true(json_object_get(c, "add_generation_prompt"));
        char *text, err[PD_ERR_LEN] = "";
        rc = chat_template_render(t, m, (int)n, agp, &text, err);
        const char *label = json_string_value(json_object_get(c, "model"));
        const char *conv = json_string_value(json_object_get(c, "conversation"));
        json_t *want = json_object_get(c, "output");
        if (want) {
            bool same = rc == 0 && !strcmp(text, json_string_value(want));
            CHECK_MSG(same, "%s / %s / agp=%d:\n  got  [%s]\n  want [%s]", label, conv, agp,
                      rc ? err : text, json_string_value(want));
            ok += same;
        } else {
            const char *msg = json_string_value(json_object_get(c, "error"));
            bool raised = json_is_true(json_object_get(c, "raised"));
            bool same = rc == PD_EINVAL && (!raised || !strcmp(err, msg));
            CHECK_MSG(same, "%s / %s / agp=%d: jinja2 fails (%s), we give %s [%s]", label, conv,
                      agp, msg, pd_err_name(rc), rc ? err : text);
            ok += same;
        }
        free(text);
        free(m);
    }
    fprintf(stderr, "test_chat_template: %d of %zu chat vectors agree with jinja2 (%d templates)\n",
            ok, json_array_size(cases), n_cache);
    for (int k = 0; k < n_cache; k++) {
        chat_template_destroy(cache[k].t);
        free(cache[k].model);
    }
    /* the models without a template say so */
    json_t *none = json_object_get(doc, "no_template");
    CHECK(json_array_size(none) >= 1);
    json_array_foreach(none, i, c) {
        char dir[1024], err[PD_ERR_LEN] = "";
        chat_template *t = (chat_template *)1;
        snprintf(dir, sizeof dir, "%s/testdata/tokenizers/%s", pd_test_shared_dir(), json_string_value(c));
        CHECK_EQ_INT(chat_template_load(dir, &t, err), PD_ENOTFOUND);
        CHECK(t == NULL);
        CHECK_STR_CONTAINS(err, "ships no chat template");
        CHECK_STR_CONTAINS(err, json_string_value(c));
    }
    json_decref(doc);
}

/* ---- finding the template and the tokens ---- */
static void test_loading(void)
{
    char err[PD_ERR_LEN], *out;
    chat_template *t;
    const char *tpl = "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
                      "{{ eos_token }}|{{ pad_token is defined }}|{{ unk_token }}|{{ additional_special_tokens }}";
    /* the list form: "default" is taken */
    json_t *cfg = json_pack("{s:[{s:s,s:s},{s:s,s:s}],s:{s:s,s:b},s:s,s:n,s:[s,{s:s}]}",
                            "chat_template", "name", "tool_use", "template", "TOOLS",
                            "name", "default", "template", tpl,
                            "bos_token", "content", "<B>", "lstrip", 0,
                            "eos_token", "<E>", "pad_token", "additional_special_tokens",
                            "<x>", "content", "<y>");
    char *text = json_dumps(cfg, 0);
    const char *dir = model_dir("list", text, NULL, "{\"unk_token\": \"<U>\", \"eos_token\": \"<nope>\"}");
    free(text);
    json_decref(cfg);
    CHECK_EQ_INT(chat_template_load(dir, &t, err), 0);
    CHECK(render1(t, "user", "hi", false, &out, err) == 0 &&
          !strcmp(out, "<B>[user:hi]<E>|False|<U>|['<x>', '<y>']"));
    free(out);
    CHECK(render1(t, "user", NULL, false, &out, err) == 0 && strstr(out, "[user:None]"));
    free(out);
    chat_template_destroy(t);

    /* no default among several */
    dir = model_dir("nodefault", "{\"chat_template\": [{\"name\": \"a\", \"template\": \"x\"}, "
                                 "{\"name\": \"b\", \"template\": \"y\"}]}", NULL, NULL);
    CHECK_EQ_INT(chat_template_load(dir, &t, err), PD_ENOTFOUND);
    CHECK_STR_CONTAINS(err, "several chat templates (a, b)");

    /* chat_template.jinja wins over the config's, and works without a config */
    dir = model_dir("jinjafile", "{\"chat_template\": \"config\", \"bos_token\": \"<s>\"}",
                    "{{ bos_token }}file {{ messages[0].content }}\n", NULL);
    CHECK_EQ_INT(chat_template_load(dir, &t, err), 0);
    CHECK(render1(t, "user", "x", false, &out, err) == 0 && !strcmp(out, "<s>file x"));
    free(out);
    chat_template_destroy(t);
    dir = model_dir("jinjaonly", NULL, "only {{ messages|length }}", NULL);
    CHECK_EQ_INT(chat_template_load(dir, &t, err), 0);
    CHECK(render1(t, "user", "x", true, &out, err) == 0 && !strcmp(out, "only 1"));
    free(out);
    chat_template_destroy(t);

    /* errors */
    char missing[512];
    snprintf(missing, sizeof missing, "%s/does-not-exist", tmp_root);
    CHECK_EQ_INT(chat_template_load(missing, &t, err), PD_ENOTFOUND);
    CHECK_STR_CONTAINS(err, "ships no chat template");
    dir = model_dir("nochat", "{\"bos_token\": \"<s>\"}", NULL, NULL);
    CHECK_EQ_INT(chat_template_load(dir, &t, err), PD_ENOTFOUND);
    CHECK_STR_CONTAINS(err, "has no chat_template");
    dir = model_dir("badjson", "{\"chat_template\": ", NULL, NULL);
    CHECK_EQ_INT(chat_template_load(dir, &t, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "tokenizer_config.json");
    dir = model_dir("badtype", "{\"chat_template\": 5}", NULL, NULL);
    CHECK_EQ_INT(chat_template_load(dir, &t, err), PD_EFORMAT);
    dir = model_dir("badtpl", "{\"chat_template\": \"ok\\n{% for m in messages %}\\n{{ m.content + }}{% endfor %}\"}",
                    NULL, NULL);
    CHECK_EQ_INT(chat_template_load(dir, &t, err), PD_EFORMAT);
    CHECK(t == NULL);
    CHECK_STR_CONTAINS(err, "tokenizer_config.json: the chat template does not parse: line 3 column");
    chat_template_destroy(NULL);
}

static void test_render_errors(void)
{
    char err[PD_ERR_LEN], *out;
    chat_template *t;
    const char *dir = model_dir("plain", "{\"chat_template\": \"{% for m in messages %}{{ m.role }}{% endfor %}\"}",
                                NULL, NULL);
    CHECK_EQ_INT(chat_template_load(dir, &t, err), 0);
    chat_message bad_role[] = {{"user", "a"}, {NULL, "b"}};
    CHECK_EQ_INT(chat_template_render(t, bad_role, 2, false, &out, err), PD_EINVAL);
    CHECK(out == NULL);
    CHECK_STR_CONTAINS(err, "message 1 has no role");
    CHECK_EQ_INT(render1(t, "user", "caf\xc3", false, &out, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "not valid UTF-8");
    CHECK_EQ_INT(chat_template_render(t, NULL, -1, false, &out, err), PD_EINVAL);
    CHECK_EQ_INT(chat_template_render(t, NULL, 0, false, &out, err), 0);
    CHECK(out && out[0] == 0);
    free(out);
    chat_template_destroy(t);
}

/* ---- the committed vectors are what jinja2 renders now ---- */
static void test_generator_current(void)
{
    const char *pythons[] = {"python3", "/usr/bin/python3"};
    for (int i = 0; i < 2; i++) {
        char cmd[2048];
        snprintf(cmd, sizeof cmd, "%s %s/tests/chat/gen_vectors.py --check --shared %s >&2",
                 pythons[i], PD_SOURCE_DIR, pd_test_shared_dir());
        int st = system(cmd);
        int code = st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st);
        if (code == 77 || code == 127) continue; /* no jinja2 (or no python) there */
        CHECK_MSG(code == 0, "tests/chat/vectors.json is not current: run tests/chat/gen_vectors.py");
        return;
    }
    fprintf(stderr, "test_chat_template: skip the vectors check: no python3 with jinja2 "
                    "(Debian: python3-jinja2)\n");
}

int main(void)
{
    char shared[1024];
    snprintf(shared, sizeof shared, "%s/testdata/tokenizers", pd_test_shared_dir());
    if (access(shared, R_OK) != 0) {
        fprintf(stderr, "test_chat_template: no %s: skip\n", shared);
        return 77;
    }
    snprintf(tmp_root, sizeof tmp_root, "/tmp/pd_chat_XXXXXX");
    if (!mkdtemp(tmp_root)) return 1;
    test_vectors();
    test_loading();
    test_render_errors();
    test_generator_current();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", tmp_root);
    return pd_test_result("test_chat_template");
}
