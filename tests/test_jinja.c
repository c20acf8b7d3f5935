/* test_jinja.c -- text/jinja.h: every language case of tests/chat/vectors.json (rendered by
 * Python's jinja2 in transformers' environment) renders to the same bytes, or fails as jinja2
 * fails (a syntax error at parse time, raise_exception with its message); plus what only C
 * can check: parse errors name line and column, every limit (output, memory, steps, call
 * depth, nesting) ends a hostile template with an error instead of a crash, renders of one
 * template from several threads agree, nothing leaks. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "test_util.h"
#include "text/jinja.h"

static int render_str(const char *src, const char *vars_json, const jinja_render_params *rp,
                      bool hf, char **out, char *err)
{
    jinja_parse_params pp = jinja_default_parse_params();
    pp.trim_blocks = pp.lstrip_blocks = hf;
    jinja_template *t;
    *out = NULL;
    int rc = jinja_parse(src, strlen(src), &pp, &t, err);
    if (rc) return rc;
    json_t *vars = NULL;
    if (vars_json) {
        json_error_t je;
        vars = json_loads(vars_json, 0, &je);
        if (!vars) {
            jinja_destroy(t);
            return pd_errf(err, PD_EFORMAT, "bad test JSON: %s", je.text);
        }
    }
    rc = jinja_render(t, vars, rp, out, NULL, err);
    json_decref(vars);
    jinja_destroy(t);
    return rc;
}

/* Renders src (transformers' whitespace) and checks the output. */
#define CHECK_RENDER(src, vars, want)                                                  \
    do {                                                                               \
        char *out_, err_[PD_ERR_LEN] = "";                                             \
        int rc_ = render_str((src), (vars), NULL, true, &out_, err_);                  \
        CHECK_MSG(rc_ == 0 && strcmp(out_, (want)) == 0, "%s: got %s [%s], want [%s]", \
                  (src), pd_err_name(rc_), rc_ ? err_ : out_, (want));                 \
        free(out_);                                                                    \
    } while (0)

/* Expects the error code and a substring of the message. */
#define CHECK_FAIL(src, vars, rp, code, needle)                                        \
    do {                                                                               \
        char *out_, err_[PD_ERR_LEN] = "";                                             \
        int rc_ = render_str((src), (vars), (rp), true, &out_, err_);                  \
        CHECK_MSG(rc_ == (code) && out_ == NULL && strstr(err_, (needle)) != NULL,     \
                  "%.80s: got %s [%s], want %s [%s]", (src), pd_err_name(rc_), err_,   \
                  pd_err_name(code), (needle));                                        \
        free(out_);                                                                    \
    } while (0)

/* ---- the language vectors ---- */
static void test_vectors(void)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/chat/vectors.json", PD_SOURCE_DIR);
    json_error_t je;
    json_t *doc = json_load_file(path, 0, &je);
    CHECK_MSG(doc != NULL, "cannot read %s: %s", path, je.text);
    if (!doc) return;
    json_t *cases = json_object_get(doc, "jinja");
    CHECK(json_array_size(cases) > 100);
    jinja_render_params rp = jinja_default_render_params();
    rp.now = json_integer_value(json_object_get(doc, "now"));
    size_t i, ok = 0;
    json_t *c;
    json_array_foreach(cases, i, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *src = json_string_value(json_object_get(c, "template"));
        json_t *want = json_object_get(c, "output");
        bool syntax = json_is_true(json_object_get(c, "syntax"));
        bool raised = json_is_true(json_object_get(c, "raised"));
        jinja_parse_params pp = jinja_default_parse_params();
        pp.trim_blocks = pp.lstrip_blocks = json_is_true(json_object_get(c, "hf_whitespace"));
        char err[PD_ERR_LEN] = "";
        jinja_template *t;
        int rc = jinja_parse(src, strlen(src), &pp, &t, err);
        if (syntax) {
            CHECK_MSG(rc == PD_EFORMAT, "%s: jinja2 refuses it at parse time (%s), we %s",
                      name, json_string_value(json_object_get(c, "error")),
                      rc ? pd_err_name(rc) : "parse it");
            ok += rc == PD_EFORMAT;
            if (!rc) jinja_destroy(t);
            continue;
        }
        CHECK_MSG(rc == 0, "%s: parse failed: %s", name, err);
        if (rc) continue;
        char *out = NULL;
        size_t len = 0;
        rc = jinja_render(t, json_object_get(c, "vars"), &rp, &out, &len, err);
        if (want) {
            const char *w = json_string_value(want);
            bool same = rc == 0 && len == json_string_length(want) && memcmp(out, w, len) == 0;
            CHECK_MSG(same, "%s: rendered %s\n  got  [%s]\n  want [%s]", name,
                      rc ? pd_err_name(rc) : "ok", rc ? err : out, w);
            ok += same;
        } else {
            const char *msg = json_string_value(json_object_get(c, "error"));
            bool same = rc == PD_EINVAL && (!raised || strcmp(err, msg) == 0);
            CHECK_MSG(same, "%s: jinja2 fails (%s); we give %s [%s]", name, msg,
                      pd_err_name(rc), rc ? err : out);
            ok += same;
        }
        free(out);
        jinja_destroy(t);
    }
    fprintf(stderr, "test_jinja: %zu of %zu language vectors agree with jinja2\n", ok,
            json_array_size(cases));
    json_decref(doc);
}

/* ---- API and messages ---- */
static void test_api(void)
{
    char err[PD_ERR_LEN] = "";
    jinja_template *t = (jinja_template *)1;
    jinja_destroy(NULL);
    CHECK_EQ_INT(jinja_parse("a\n  {{ x + }}", 12, NULL, &t, err), PD_EFORMAT);
    CHECK(t == NULL);
    CHECK_STR_CONTAINS(err, "line 2 column 10");
    CHECK_EQ_INT(jinja_parse("ok {{ 'caf\xc3", 12, NULL, &t, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "not valid UTF-8");
    CHECK_EQ_INT(jinja_parse("{% for x in y %}\n{% endif %}", 27, NULL, &t, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "line 2");
    CHECK_EQ_INT(jinja_parse("{% extends 'base' %}", 20, NULL, &t, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "'extends' statement is not supported");
    CHECK_EQ_INT(jinja_parse("{% for x in y recursive %}{% endfor %}", 38, NULL, &t, err),
                 PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "recursive loops are not supported");
    CHECK_EQ_INT(jinja_parse("", 0, NULL, &t, err), 0);
    char *out;
    size_t len = 99;
    CHECK_EQ_INT(jinja_render(t, NULL, NULL, &out, &len, err), 0);
    CHECK(out && out[0] == 0 && len == 0);
    free(out);
    json_t *arr = json_array();
    CHECK_EQ_INT(jinja_render(t, arr, NULL, &out, NULL, err), PD_EINVAL);
    CHECK(out == NULL);
    json_decref(arr);
    jinja_destroy(t);

    /* raise_exception: the message verbatim, nothing added */
    CHECK_FAIL("x{{ raise_exception('Roles must alternate: ' ~ 3) }}", NULL, NULL, PD_EINVAL,
               "Roles must alternate: 3");
    CHECK(render_str("{{ raise_exception('boom') }}", NULL, NULL, true, &out, err) == PD_EINVAL &&
          strcmp(err, "boom") == 0);
    /* an empty message (or an undefined one, a NUL first) still says what happened */
    CHECK_FAIL("{{ raise_exception('') }}", NULL, NULL, PD_EINVAL, "empty message");
    CHECK_FAIL("{{- raise_exception(nothing) -}}", NULL, NULL, PD_EINVAL, "empty message");
    CHECK_FAIL("{{ raise_exception('\\0after') }}", NULL, NULL, PD_EINVAL, "empty message");
    /* other errors name the line */
    CHECK_FAIL("\n\n{{ x.y }}", NULL, NULL, PD_EINVAL, "line 3: 'x' is undefined");
    CHECK_FAIL("{{ [1].append(2) }}", NULL, NULL, PD_EINVAL, "unsafe");
    CHECK_FAIL("{{ 'a' | wordwrap }}", NULL, NULL, PD_EINVAL, "'wordwrap' is not supported");
    /* variables: key order kept, null is none, absent is undefined */
    CHECK_RENDER("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ n is none }}{{ u is defined }}",
                 "{\"d\": {\"z\": 1, \"a\": [true, 1.5, \"s\"], \"m\": {}}, \"n\": null}",
                 "z=1;a=[True, 1.5, 's'];m={};TrueFalse");
    /* strftime_now formats the given time */
    setenv("TZ", "UTC", 1);
    tzset();
    jinja_render_params rp = jinja_default_render_params();
    rp.now = 86400 * 365;
    CHECK(render_str("{{ strftime_now('%Y-%m-%d') }}", NULL, &rp, true, &out, err) == 0 &&
          strcmp(out, "1971-01-01") == 0);
    free(out);
}

/* ---- limits: hostile templates end with an error ---- */
static void test_limits(void)
{
    jinja_render_params rp = jinja_default_render_params();
    rp.max_output = 1000;
    CHECK_FAIL("{% for i in range(1000) %}xxxxxxxxxx{% endfor %}", NULL, &rp, PD_EINVAL,
               "larger than 1000 bytes");
    CHECK_FAIL("{{ 'x' * 2000 }}", NULL, &rp, PD_EINVAL, "larger than 1000 bytes");
    CHECK_FAIL("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
               NULL, &rp, PD_EINVAL, "larger than 1000 bytes");

    rp = jinja_default_render_params();
    rp.max_steps = 100000;
    CHECK_FAIL("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
               NULL, &rp, PD_EINVAL, "more than 100000 steps");

    rp = jinja_default_render_params();
    rp.max_memory = 100000;
    CHECK_FAIL("{{ range(50000)|list|length }}", NULL, &rp, PD_EINVAL, "more than 100000 bytes");

    CHECK_FAIL("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, NULL, PD_EINVAL,
               "nested deeper than 64");
    rp = jinja_default_render_params();
    rp.max_depth = 5;
    CHECK_FAIL("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, &rp, PD_EINVAL,
               "nested deeper than 5");
    CHECK_FAIL("{% macro f() %}{% call f() %}x{% endcall %}{% endmacro %}{{ f() }}", NULL, NULL,
               PD_EINVAL, "nested deeper");
    CHECK_FAIL("{% set ns = namespace(x=1) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}",
               NULL, NULL, PD_EINVAL, "nested more than");
    CHECK_FAIL("{{ range(1000000) }}", NULL, NULL, PD_EINVAL, "Range too big");
    CHECK_FAIL("{{ 9223372036854775807 + 1 }}", NULL, NULL, PD_EINVAL, "integer overflow");

    /* deep nesting in the source: refused at parse time, without recursing the stack away */
    size_t n = 5000;
    char *src = malloc(2 * n + 16);
    strcpy(src, "{{ ");
    for (size_t i = 0; i < n; i++) strcat(src, "(");
    strcat(src, "1");
    for (size_t i = 0; i < n; i++) strcat(src, ")");
    strcat(src, " }}");
    char err[PD_ERR_LEN];
    jinja_template *t;
    CHECK_EQ_INT(jinja_parse(src, strlen(src), NULL, &t, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "brackets nested too deeply");
    src[0] = 0;
    for (size_t i = 0; i < 300; i++) strcat(src, "{% if 1 %}");
    CHECK_EQ_INT(jinja_parse(src, strlen(src), NULL, &t, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "nested too deeply");
    strcpy(src, "{{ ");
    for (size_t i = 0; i < 500; i++) strcat(src, "not ");
    strcat(src, "1 }}");
    CHECK_EQ_INT(jinja_parse(src, strlen(src), NULL, &t, err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "nested too deeply");
    free(src);
    /* long chains deepen the tree without deepening the parser: 1+1+...+1, x|trim|trim... */
    const char *chains[] = {"1+", "x.", "x|trim or ", "'a'~"};
    for (int c = 0; c < 4; c++) {
        size_t k = strlen(chains[c]);
        char *s = malloc(k * 100000 + 16), *q = s;
        q += sprintf(q, "{{ ");
        for (int i = 0; i < 100000; i++) q += sprintf(q, "%s", chains[c]);
        sprintf(q, "%s }}", c == 1 ? "y" : "1");
        int rc = jinja_parse(s, strlen(s), NULL, &t, err);
        if (c < 3) { /* ... while ~ is one flat node */
            CHECK_EQ_INT(rc, PD_EFORMAT);
            CHECK_STR_CONTAINS(err, "expression nested too deeply");
        } else {
            char *o = NULL;
            CHECK(rc == 0 && jinja_render(t, NULL, NULL, &o, NULL, err) == 0 && strlen(o) == 100001);
            free(o);
            if (!rc) jinja_destroy(t);
        }
        free(s);
    }
    /* while a long elif chain is flat: fine */
    char *s = malloc(40 * 20000 + 64), *q = s;
    q += sprintf(q, "{%% if x == 0 %%}zero");
    for (int i = 1; i < 20000; i++) q += sprintf(q, "{%% elif x == %d %%}%d", i, i);
    sprintf(q, "{%% else %%}big{%% endif %%}");
    char *out;
    CHECK(render_str(s, "{\"x\": 19999}", NULL, true, &out, err) == 0 && !strcmp(out, "19999"));
    free(out);
    free(s);

    /* a filter that fails inside a chain (fuzz_jinja found the chain freeing its input twice) */
    CHECK_FAIL("{{ messages|selectattr('role','equalto','user')|map(attributa='content')|join(',') }}",
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", NULL, PD_EINVAL,
               "map requires a filter argument");
    /* a big but legitimate render works under the default limits */
    CHECK(render_str("{% for i in range(20000) %}{{ '%05d,' % i }}{% endfor %}", NULL, NULL, true,
                     &out, err) == 0 && strlen(out) == 120000);
    free(out);
    /* namespaces holding themselves are released */
    CHECK_RENDER("{% set a = namespace() %}{% set b = namespace(a=a) %}{% set a.b = b %}{% set a.l = [a, b, {'x': a}] %}{{ a.b.a.l|length }}",
                 NULL, "3");
}

/* ---- threads share one template ---- */
typedef struct {
    const jinja_template *t;
    json_t *vars;
    const char *want;
    int bad;
} thread_arg;

static void *render_thread(void *p)
{
    thread_arg *a = p;
    for (int i = 0; i < 200; i++) {
        char *out, err[PD_ERR_LEN];
        if (jinja_render(a->t, a->vars, NULL, &out, NULL, err) || strcmp(out, a->want)) a->bad++;
        free(out);
    }
    return NULL;
}

static void test_threads(void)
{
    const char *src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                      "<{{ m.role|upper }}>{{ m.content|trim }}{% endfor %}{{ ns.n }}{{ 'é' * 2 }}";
    jinja_parse_params pp = jinja_default_parse_params();
    jinja_template *t;
    char err[PD_ERR_LEN];
    CHECK_EQ_INT(jinja_parse(src, strlen(src), &pp, &t, err), 0);
    json_error_t je;
    json_t *vars = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \" a \"}, "
                              "{\"role\": \"assistant\", \"content\": \"b\"}]}", 0, &je);
    const char *want = "<USER>a<ASSISTANT>b2éé";
    thread_arg a[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (thread_arg){.t = t, .vars = vars, .want = want};
        pthread_create(&th[i], NULL, render_thread, &a[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK_EQ_INT(a[i].bad, 0);
    }
    json_decref(vars);
    jinja_destroy(t);
}

int main(void)
{
    setenv("TZ", "UTC", 1);
    tzset();
    test_vectors();
    test_api();
    test_limits();
    test_threads();
    return pd_test_result("test_jinja");
}
