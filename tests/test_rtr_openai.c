/* test_rtr_openai.c -- The OpenAI request parser and response formatter of the router's HTTP
 * front (router/rtr_openai.c): every field onto GenerateRequest (n's seeds, logprobs, chat's
 * max_completion_tokens), prompt forms, wrong types and unsupported features as 400 naming the
 * field, unknown model 404; chat messages (content parts, roles) onto GenerateRequest.messages
 * (501 in a build without chat templates), FAILED_PRECONDITION as a missing template; response
 * bodies, stream chunks, usage and error shapes, statuses; OpenAI's ranges of temperature,
 * top_p and the penalties; content parts (text joined, other types refused by name);
 * system_fingerprint in every body and chunk, usage null in every chunk but the usage chunk,
 * and rtr_http_system_fingerprint over copies of stories260k. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "router/rtr_http_impl.h"
#include "tests/test_util.h"

static oai_ctx ctx;

/* Parses body; returns the status (0 = ok); e and job for inspection (caller frees job). */
static int parse(int kind, const char *body, oai_job *job, oai_err *e)
{
    memset(e, 0, sizeof *e);
    return oai_parse(&ctx, kind, body, strlen(body), job, e);
}

/* The "type" of e's error body. */
static const char *err_type_of(const oai_err *e)
{
    static char type[64];
    char *b = oai_error_body(e);
    json_t *o = b ? json_loads(b, 0, NULL) : NULL;
    const char *t = json_string_value(json_object_get(json_object_get(o, "error"), "type"));
    snprintf(type, sizeof type, "%s", t ? t : "?");
    json_decref(o);
    free(b);
    return type;
}

static void expect_error(int kind, const char *body, int status, const char *param)
{
    oai_job job;
    oai_err e;
    int rc = parse(kind, body, &job, &e);
    CHECK_MSG(rc == status && e.status == status, "%s: got %d (%s), want %d", body, rc, e.message, status);
    if (param) CHECK_MSG(!strcmp(e.param, param), "%s: param '%s', want '%s'", body, e.param, param);
    CHECK_MSG(e.message[0], "%s: no message", body);
    oai_job_free(&job);
}

static void test_completions(void)
{
    oai_job job;
    oai_err e;
    int rc = parse(OAI_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":5,\"temperature\":0.5,"
                   "\"top_p\":0.9,\"seed\":42,\"n\":3,\"stop\":\"x\",\"logprobs\":2,\"presence_penalty\":0.5,"
                   "\"frequency_penalty\":-0.5,\"user\":\"u\",\"future_field\":{\"a\":1},\"top_k\":4,"
                   "\"ignore_eos\":true,\"min_tokens\":2,\"stop_token_ids\":[7,8],\"echo\":false,"
                   "\"best_of\":3,\"logit_bias\":{},\"suffix\":null}", &job, &e);
    CHECK_MSG(rc == 0, "%s", e.message);
    CHECK_EQ_INT(job.n, 3);
    CHECK_EQ_INT(job.n_prompts, 1);
    CHECK_EQ_INT(job.logprobs, 2);
    CHECK(!job.stream);
    Pdserve__V1__GenerateRequest q;
    Pdserve__V1__SamplingParams s;
    oai_job_request(&job, 0, &q, &s);
    CHECK(q.prompt && !strcmp(q.prompt, "hi") && q.n_prompt_token_ids == 0);
    CHECK_EQ_INT(q.logprobs, 2);
    CHECK_EQ_INT(q.n, 3); /* one call, three choices (the router gives choice j seed + j) */
    CHECK(s.seed_set_case == PDSERVE__V1__SAMPLING_PARAMS__SEED_SET_SEED);
    CHECK_EQ_INT(s.seed, 42);
    CHECK_NEAR(s.temperature, 0.5, 1e-6);
    CHECK_NEAR(s.top_p, 0.9, 1e-6);
    CHECK_NEAR(s.presence_penalty, 0.5, 1e-6);
    CHECK_NEAR(s.frequency_penalty, -0.5, 1e-6);
    CHECK_EQ_INT(s.top_k, 4);
    CHECK(q.stopping->max_tokens_set_case && q.stopping->max_tokens == 5);
    CHECK(q.stopping->n_stop == 1 && !strcmp(q.stopping->stop[0], "x"));
    CHECK(q.stopping->n_stop_token_ids == 2 && q.stopping->stop_token_ids[1] == 8);
    CHECK(q.stopping->ignore_eos && q.stopping->min_tokens == 2);
    oai_job_free(&job);

    /* Defaults: nothing set means the server's defaults (no seed, no max_tokens). */
    rc = parse(OAI_COMPLETIONS, "{\"prompt\":\"hi\",\"temperature\":null,\"stream\":true,"
               "\"stream_options\":{\"include_usage\":true}}", &job, &e);
    CHECK_MSG(rc == 0, "%s", e.message);
    oai_job_request(&job, 0, &q, &s);
    CHECK(!s.seed_set_case && !s.temperature_set_case && !q.stopping->max_tokens_set_case);
    CHECK(job.stream && job.include_usage && job.logprobs == -1 && q.logprobs == 0);
    oai_job_free(&job);
    /* logprobs 0: the chosen token's logprob only (the router sends it for logprobs >= 1). */
    rc = parse(OAI_COMPLETIONS, "{\"prompt\":\"hi\",\"logprobs\":0}", &job, &e);
    oai_job_request(&job, 0, &q, &s);
    CHECK(rc == 0 && job.logprobs == 0 && q.logprobs == 1);
    oai_job_free(&job);

    /* Prompt forms. */
    rc = parse(OAI_COMPLETIONS, "{\"prompt\":[1,2,3]}", &job, &e);
    oai_job_request(&job, 0, &q, &s);
    CHECK(rc == 0 && job.n_prompts == 1 && !q.prompt[0] && q.n_prompt_token_ids == 3 && q.prompt_token_ids[2] == 3);
    oai_job_free(&job);
    rc = parse(OAI_COMPLETIONS, "{\"prompt\":[\"a\",\"b\"],\"n\":2}", &job, &e);
    CHECK(rc == 0 && job.n_prompts == 2);
    oai_job_request(&job, 1, &q, &s);
    CHECK(q.prompt && !strcmp(q.prompt, "b") && !s.seed_set_case && q.n == 2);
    oai_job_free(&job);
    rc = parse(OAI_COMPLETIONS, "{\"prompt\":[[1],[2,3]]}", &job, &e);
    oai_job_request(&job, 1, &q, &s);
    CHECK(rc == 0 && job.n_prompts == 2 && q.n_prompt_token_ids == 2 && q.prompt_token_ids[0] == 2);
    oai_job_free(&job);
    rc = parse(OAI_COMPLETIONS, "{\"prompt\":[\"only\"]}", &job, &e);
    CHECK(rc == 0 && job.n_prompts == 1);
    oai_job_free(&job);

    /* Errors. */
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":\"5\"}", 400, "max_tokens");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":1.5}", 400, "max_tokens");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":0}", 400, "max_tokens");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":-3}", 400, "max_tokens");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "temperature");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":[1]}", 400, "top_p");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"seed\":1.5}", 400, "seed");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":0}", 400, "n");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":17}", 400, "n");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":[\"a\",\"b\"],\"n\":9}", 400, "n");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":[\"a\",1]}", 400, "prompt");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":[]}", 400, "prompt");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"\"}", 400, "prompt");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":[-1]}", 400, "prompt");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":[[]]}", 400, "prompt");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":{}}", 400, "prompt");
    expect_error(OAI_COMPLETIONS, "{}", 400, "prompt");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"model\":\"other\"}", 404, "model");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"model\":5}", 400, "model");
    expect_error(OAI_COMPLETIONS, "[1]", 400, NULL);
    /* OpenAI's ranges: temperature [0, 2], top_p [0, 1], penalties [-2, 2]. */
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":2.5}", 400, "temperature");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":-0.1}", 400, "temperature");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":3}", 400,
                 "temperature");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":1.01}", 400, "top_p");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":-0.5}", 400, "top_p");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"presence_penalty\":2.5}", 400, "presence_penalty");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"frequency_penalty\":-2.01}", 400, "frequency_penalty");
    {
        oai_err e2;
        oai_job j2;
        CHECK_EQ_INT(parse(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":2.5}", &j2, &e2), 400);
        CHECK_MSG(!strcmp(err_type_of(&e2), "invalid_request_error"), "%s", err_type_of(&e2));
        CHECK_STR_CONTAINS(e2.message, "'temperature' must be in [0, 2] (got 2.5)");
        oai_job_free(&j2);
    }
    /* The bounds themselves are valid; top_p 0 (allowed by OpenAI) keeps the likeliest token. */
    rc = parse(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":2,\"top_p\":0,\"presence_penalty\":-2,"
               "\"frequency_penalty\":2}", &job, &e);
    CHECK_MSG(rc == 0, "%s", e.message);
    oai_job_request(&job, 0, &q, &s);
    CHECK_NEAR(s.temperature, 2, 0);
    CHECK_MSG(s.top_p_set_case && s.top_p > 0 && s.top_p < 1e-30, "top_p %g", (double)s.top_p);
    CHECK_NEAR(s.presence_penalty, -2, 0);
    CHECK_NEAR(s.frequency_penalty, 2, 0);
    oai_job_free(&job);
    rc = parse(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":0,\"top_p\":1}", &job, &e);
    oai_job_request(&job, 0, &q, &s);
    CHECK(rc == 0 && s.temperature == 0 && s.top_p == 1);
    oai_job_free(&job);
    expect_error(OAI_COMPLETIONS, "nul", 400, NULL);
    expect_error(OAI_COMPLETIONS, "", 400, NULL);
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"prompt\":\"y\"}", 400, NULL);
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"a\\u0000b\"}", 400, NULL);
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", 400, "stream_options");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":1}}", 400, "include_usage");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream\":\"yes\"}", 400, "stream");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":[1]}", 400, "stop");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":5}", 400, "stop");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop_token_ids\":[-1]}", 400, "stop_token_ids");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logprobs\":true}", 400, "logprobs");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logprobs\":21}", 400, "logprobs");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"echo\":true}", 400, "echo");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"best_of\":2}", 400, "best_of");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"1\":2}}", 400, "logit_bias");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"suffix\":\"end\"}", 400, "suffix");
    expect_error(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"ignore_eos\":1}", 400, "ignore_eos");
}

static const char *CHAT_OK = "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                             "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hello\"},"
                             "{\"type\":\"text\",\"text\":\"there\"}]},{\"role\":\"assistant\",\"content\":null},"
                             "{\"role\":\"user\",\"content\":\"Again\"}],\"max_tokens\":5,"
                             "\"max_completion_tokens\":7,\"logprobs\":true,\"top_logprobs\":3}";

static void test_chat_errors(void)
{
    expect_error(OAI_CHAT, "{\"messages\":[]}", 400, "messages");
    expect_error(OAI_CHAT, "{\"messages\":\"hi\"}", 400, "messages");
    expect_error(OAI_CHAT, "{}", 400, "messages");
    expect_error(OAI_CHAT, "{\"messages\":[5]}", 400, "messages[0]");
    expect_error(OAI_CHAT, "{\"messages\":[{\"content\":\"x\"}]}", 400, "messages[0].role");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"\",\"content\":\"x\"}]}", 400, "messages[0].role");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, "messages[0].content");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\"}]}", 400, "messages[0].content");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", 400,
                 "messages[0].content");
    /* A part that is not text: 400 naming its type and where it is. */
    static const char *const other[][2] = {
        {"{\"type\":\"image_url\",\"image_url\":{\"url\":\"https://x/y.png\"}}", "image_url"},
        {"{\"type\":\"input_audio\",\"input_audio\":{\"data\":\"AAAA\",\"format\":\"wav\"}}", "input_audio"},
        {"{\"type\":\"file\",\"file\":{\"file_id\":\"f\"}}", "file"},
    };
    for (size_t i = 0; i < sizeof other / sizeof other[0]; i++) {
        char body[512], want[128];
        snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":"
                 "\"user\",\"content\":[{\"type\":\"text\",\"text\":\"look:\"},%s]}]}", other[i][0]);
        oai_job j2;
        oai_err e2;
        CHECK_EQ_INT(parse(OAI_CHAT, body, &j2, &e2), 400);
        CHECK_MSG(!strcmp(e2.param, "messages[1].content"), "%s", e2.param);
        snprintf(want, sizeof want, "'messages[1].content' item 1 is a content part of type '%s'", other[i][1]);
        CHECK_STR_CONTAINS(e2.message, want);
        CHECK_MSG(e2.code && !strcmp(e2.code, "unsupported_content_part"), "%s", e2.code ? e2.code : "null");
        oai_job_free(&j2);
    }
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[\"hi\"]}]}", 400, "messages[0].content");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"hi\"}]}]}", 400,
                 "messages[0].content");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":5}]}]}",
                 400, "messages[0].content");
    /* Text parts in order, newline-joined (an empty part keeps its place); an empty list is "". */
    {
        oai_job j2;
        oai_err e2;
        int r2 = parse(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
                       "\"text\":\"\"},{\"type\":\"text\",\"text\":\"b\"},{\"type\":\"text\",\"text\":\"c\"}]},"
                       "{\"role\":\"assistant\",\"content\":[]}]}", &j2, &e2);
        CHECK_MSG(r2 == 0, "%s", e2.message);
        if (r2 == 0) {
            CHECK_MSG(!strcmp(j2.msgs[0].content, "\nb\nc"), "'%s'", j2.msgs[0].content);
            CHECK_MSG(!strcmp(j2.msgs[1].content, ""), "'%s'", j2.msgs[1].content);
        }
        oai_job_free(&j2);
    }
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", 400, "top_logprobs");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":2}", 400, "logprobs");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{}]}", 400, "tools");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"auto\"}", 400, "tool_choice");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":"
                 "{\"type\":\"json_object\"}}", 400, "response_format");
    expect_error(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":\"7\"}", 400,
                 "max_completion_tokens");
    oai_job job;
    oai_err e;
    int rc = parse(OAI_CHAT, CHAT_OK, &job, &e);
    /* The conversation goes to the router as GenerateRequest.messages (it renders them). */
    CHECK_MSG(rc == 0, "%s", e.message);
    if (rc == 0) {
        Pdserve__V1__GenerateRequest q;
        Pdserve__V1__SamplingParams s;
        oai_job_request(&job, 0, &q, &s);
        CHECK(!q.prompt[0] && q.n_prompt_token_ids == 0 && q.n_messages == 4);
        CHECK(!strcmp(q.messages[0]->role, "system") && !strcmp(q.messages[0]->content, "Be brief."));
        CHECK_MSG(!strcmp(q.messages[1]->content, "Hello\nthere"), "%s", q.messages[1]->content);
        CHECK(!strcmp(q.messages[2]->role, "assistant") && !strcmp(q.messages[2]->content, ""));
        CHECK(!strcmp(q.messages[3]->content, "Again"));
        CHECK_EQ_INT(q.stopping->max_tokens, 7); /* max_completion_tokens wins */
        CHECK_EQ_INT(job.logprobs, 3);
        CHECK_EQ_INT(q.logprobs, 3);
    }
    oai_job_free(&job);
    /* The router's FAILED_PRECONDITION for a chat request: the model has no template. */
    static hreq r;
    oai_choice c;
    memset(&c, 0, sizeof c);
    r.ctx = &ctx;
    r.job.kind = OAI_CHAT;
    CHECK(oai_call_error(&r, &c, RPC_STATUS_FAILED_PRECONDITION, "no chat_template", &e));
    CHECK_MSG(e.status == 400 && e.code && !strcmp(e.code, "chat_template_missing"), "%d %s", e.status, e.message);
    CHECK_STR_CONTAINS(e.message, "no chat_template");
    r.job.kind = OAI_COMPLETIONS;
    CHECK(oai_call_error(&r, &c, RPC_STATUS_FAILED_PRECONDITION, "x", &e) && e.status == 400 && !e.code);
    CHECK(oai_call_error(&r, &c, RPC_STATUS_OK, "", &e) && e.status == 500); /* no finish reason */
    c.finish = PDSERVE__V1__FINISH_REASON__FINISH_REASON_EOS;
    CHECK(!oai_call_error(&r, &c, RPC_STATUS_OK, "", &e));
}

/* A fake response message of one token. */
static void apply(hreq *r, int ci, uint32_t id, const char *text, float lp, int finish)
{
    Pdserve__V1__GenerateResponse m = PDSERVE__V1__GENERATE_RESPONSE__INIT;
    Pdserve__V1__TokenLogprob l = PDSERVE__V1__TOKEN_LOGPROB__INIT, *lpp = &l;
    Pdserve__V1__Usage u = PDSERVE__V1__USAGE__INIT;
    m.n_token_ids = 1;
    m.token_ids = &id;
    m.text = (char *)text;
    l.token_id = id;
    l.logprob = lp;
    m.n_logprobs = 1;
    m.logprobs = &lpp;
    if (finish) {
        m.finish_reason = (Pdserve__V1__FinishReason)finish;
        u.prompt_tokens = 4;
        u.completion_tokens = 2;
        u.cached_prompt_tokens = 1;
        m.usage = &u;
    }
    oai_apply(r, ci, &m);
}

/* Checks every "data: {...}" event of the SSE text s: object, system_fingerprint (ctx's),
 * and usage: null in all but a final usage chunk ("choices": [], usage an object), which
 * there must be exactly when usage_chunk. Returns the number of chunks. */
static int check_chunks(const char *s, const char *object, bool usage_chunk)
{
    int n = 0, n_usage = 0;
    for (const char *p = strstr(s, "data: {"); p; p = strstr(p + 1, "data: {")) {
        const char *end = strstr(p, "\n\n");
        json_error_t je;
        json_t *o = end ? json_loadb(p + 6, (size_t)(end - p - 6), 0, &je) : NULL;
        CHECK_MSG(o != NULL, "chunk %d: %.200s", n, p);
        if (!o) break;
        n++;
        json_t *u = json_object_get(o, "usage"), *fp = json_object_get(o, "system_fingerprint");
        CHECK_MSG(!strcmp(json_string_value(json_object_get(o, "object")), object), "chunk %d: %.200s", n, p);
        CHECK_MSG(json_is_string(fp) && !strcmp(json_string_value(fp), ctx.system_fingerprint),
                  "chunk %d: system_fingerprint: %.300s", n, p);
        if (json_is_object(u)) {
            n_usage++;
            CHECK_MSG(json_array_size(json_object_get(o, "choices")) == 0 && !strstr(end, "data: {"),
                      "the usage chunk is the last and has no choices: %.300s", p);
        } else {
            CHECK_MSG(u && json_is_null(u), "chunk %d: usage must be null: %.300s", n, p);
        }
        json_decref(o);
    }
    CHECK_EQ_INT(n_usage, usage_chunk ? 1 : 0);
    return n;
}

static void test_responses(void)
{
    static hreq r; /* zeroed; hreq_out grows r.out */
    oai_choice ch[2];
    memset(ch, 0, sizeof ch);
    r.ctx = &ctx;
    r.choices = ch;
    r.n_choices = 2;
    r.job.kind = OAI_COMPLETIONS;
    r.job.n = 2;
    r.job.logprobs = 0;
    snprintf(r.id, sizeof r.id, "cmpl-test");
    r.created = 1234;
    apply(&r, 0, 5, "Hel", -0.5f, 0);
    apply(&r, 0, 6, "lo", -INFINITY, PDSERVE__V1__FINISH_REASON__FINISH_REASON_EOS);
    apply(&r, 1, 7, "x", -0.25f, PDSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    char *body = oai_final_body(&r);
    json_error_t je;
    json_t *o = json_loads(body, 0, &je);
    CHECK_MSG(o != NULL, "%s", body);
    CHECK(!strcmp(json_string_value(json_object_get(o, "object")), "text_completion"));
    CHECK(json_integer_value(json_object_get(o, "created")) == 1234);
    CHECK_MSG(json_is_string(json_object_get(o, "system_fingerprint")) &&
              !strcmp(json_string_value(json_object_get(o, "system_fingerprint")), ctx.system_fingerprint),
              "%s", body);
    json_t *c0 = json_array_get(json_object_get(o, "choices"), 0), *c1 = json_array_get(json_object_get(o, "choices"), 1);
    CHECK(!strcmp(json_string_value(json_object_get(c0, "text")), "Hello"));
    CHECK(!strcmp(json_string_value(json_object_get(c0, "finish_reason")), "stop"));
    CHECK(!strcmp(json_string_value(json_object_get(c1, "finish_reason")), "length"));
    json_t *lp = json_object_get(c0, "logprobs");
    CHECK(json_array_size(json_object_get(lp, "tokens")) == 2);
    CHECK_NEAR(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), 1)), -9999.0, 1e-9); /* -inf */
    CHECK(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 1)) ==
          (json_int_t)json_string_length(json_array_get(json_object_get(lp, "tokens"), 0)));
    json_t *u = json_object_get(o, "usage");
    /* n = 2 choices of one prompt: its 4 prompt tokens count once. */
    CHECK_EQ_INT(json_integer_value(json_object_get(u, "prompt_tokens")), 4);
    CHECK_EQ_INT(json_integer_value(json_object_get(u, "completion_tokens")), 4);
    CHECK_EQ_INT(json_integer_value(json_object_get(u, "total_tokens")), 8);
    json_decref(o);
    free(body);
    for (int i = 0; i < 2; i++) {
        free(ch[i].text);
        json_decref(ch[i].lp);
        tok_stream_destroy(ch[i].lp_stream);
    }

    /* Streamed chat: the role first, then content deltas, the finish in the last chunk. */
    memset(ch, 0, sizeof ch);
    r.n_choices = 1;
    r.job.n = 1;
    r.job.kind = OAI_CHAT;
    r.job.stream = true;
    r.job.include_usage = true;
    r.job.logprobs = -1;
    apply(&r, 0, 5, "Hi", -0.1f, 0);
    apply(&r, 0, 6, "", -0.1f, PDSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    oai_stream_end(&r);
    hreq_out(&r, "", 1);
    const char *s = r.out;
    CHECK_STR_CONTAINS(s, "data: {\"id\":\"cmpl-test\",\"object\":\"chat.completion.chunk\"");
    CHECK_STR_CONTAINS(s, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"}");
    CHECK_STR_CONTAINS(s, "\"delta\":{\"content\":\"Hi\"},\"logprobs\":null,\"finish_reason\":null");
    CHECK_STR_CONTAINS(s, "\"delta\":{},\"logprobs\":null,\"finish_reason\":\"length\"");
    CHECK_STR_CONTAINS(s, "\"choices\":[],\"usage\":{");
    size_t n = strlen(s);
    CHECK_MSG(n > 16 && !strcmp(s + n - 16, "\n\ndata: [DONE]\n\n"), "%s", s);
    CHECK_EQ_INT(check_chunks(s, "chat.completion.chunk", true), 4); /* role, Hi, finish, usage */
    free(r.out);
    for (int i = 0; i < 1; i++) tok_stream_destroy(ch[i].lp_stream);

    /* Streamed completions, no include_usage: every chunk has usage null, no usage chunk;
     * a chat request the same; the final chat body has the fingerprint too. */
    for (int kind = OAI_COMPLETIONS; kind <= OAI_CHAT; kind++) {
        memset(ch, 0, sizeof ch);
        r.out = NULL;
        r.out_len = r.out_cap = 0;
        r.job.kind = kind;
        r.job.include_usage = false;
        apply(&r, 0, 5, "Hi", -0.1f, 0);
        apply(&r, 0, 6, " you", -0.1f, PDSERVE__V1__FINISH_REASON__FINISH_REASON_STOP);
        oai_stream_end(&r);
        hreq_out(&r, "", 1);
        CHECK_EQ_INT(check_chunks(r.out, kind == OAI_CHAT ? "chat.completion.chunk" : "text_completion", false),
                     kind == OAI_CHAT ? 3 : 2);
        free(r.out);
        r.out = NULL;
        r.out_len = r.out_cap = 0;
        tok_stream_destroy(ch[0].lp_stream);
    }
    memset(ch, 0, sizeof ch);
    r.job.stream = false;
    r.job.kind = OAI_CHAT;
    apply(&r, 0, 5, "Hi", -0.1f, PDSERVE__V1__FINISH_REASON__FINISH_REASON_STOP);
    body = oai_final_body(&r);
    o = json_loads(body, 0, &je);
    CHECK_MSG(o && !strcmp(json_string_value(json_object_get(o, "object")), "chat.completion") &&
              !strcmp(json_string_value(json_object_get(o, "system_fingerprint")), ctx.system_fingerprint),
              "%s", body);
    json_decref(o);
    free(body);
    /* No fingerprint given: null (the field is still there, as OpenAI's may be null). */
    oai_ctx bare = ctx;
    bare.system_fingerprint[0] = 0;
    r.ctx = &bare;
    body = oai_final_body(&r);
    o = json_loads(body, 0, &je);
    CHECK_MSG(o && json_is_null(json_object_get(o, "system_fingerprint")), "%s", body);
    json_decref(o);
    free(body);
    free(ch[0].text); /* after the last body that reads it */
    r.ctx = &ctx;

    /* Error shape and status mapping. */
    oai_err e;
    oai_errf(&e, 429, NULL, "rate_limit_exceeded", "busy \xc3");
    char *eb = oai_error_body(&e);
    o = json_loads(eb, 0, &je);
    json_t *err = json_object_get(o, "error");
    CHECK_MSG(o && json_object_size(err) == 4, "%s", eb);
    CHECK(!strcmp(json_string_value(json_object_get(err, "type")), "rate_limit_error"));
    CHECK(json_is_null(json_object_get(err, "param")));
    CHECK(!strcmp(json_string_value(json_object_get(err, "message")), "busy ")); /* cut UTF-8 */
    json_decref(o);
    free(eb);
    CHECK_EQ_INT(oai_http_status(RPC_STATUS_INVALID_ARGUMENT), 400);
    CHECK_EQ_INT(oai_http_status(RPC_STATUS_RESOURCE_EXHAUSTED), 429);
    CHECK_EQ_INT(oai_http_status(RPC_STATUS_UNAVAILABLE), 503);
    CHECK_EQ_INT(oai_http_status(RPC_STATUS_DEADLINE_EXCEEDED), 504);
    CHECK_EQ_INT(oai_http_status(RPC_STATUS_INTERNAL), 500);
    char *mb = oai_models_body(&ctx, NULL);
    CHECK_STR_CONTAINS(mb, "\"data\":[{\"id\":\"m\",\"object\":\"model\"");
    free(mb);
    CHECK(oai_models_body(&ctx, "nope") == NULL);
}

/* A response of one token (id, logprob lp) with alternatives top[0..n_top). */
static void apply_top(hreq *r, uint32_t id, float lp, const uint32_t *top_ids, const float *top_lps,
                      size_t n_top)
{
    Pdserve__V1__GenerateResponse m = PDSERVE__V1__GENERATE_RESPONSE__INIT;
    Pdserve__V1__TokenLogprob l = PDSERVE__V1__TOKEN_LOGPROB__INIT, *lpp = &l;
    Pdserve__V1__TopLogprob t[4], *tp[4];
    for (size_t j = 0; j < n_top; j++) {
        pdserve__v1__top_logprob__init(&t[j]);
        t[j].token_id = top_ids[j];
        t[j].logprob = top_lps[j];
        tp[j] = &t[j];
    }
    m.n_token_ids = 1;
    m.token_ids = &id;
    m.text = "";
    l.token_id = id;
    l.logprob = lp;
    l.n_top = n_top;
    l.top = tp;
    m.n_logprobs = 1;
    m.logprobs = &lpp;
    oai_apply(r, 0, &m);
}

/* Alternatives with a real tokenizer (stories260k, SentencePiece-style: a word's token starts
 * with its space): "Once upon a time" token by token, each position's top 3 the chosen token,
 * the next position's token and "▁time"; completions' dict keys and chat's lists carry the
 * texts the tokens would add there (" time" after the first token, "Once"-style without the
 * space at the start), the chosen token's text is its own, the counts are the request's. */
static void test_alternatives(void)
{
    tok_tokenizer *tok = NULL;
    char err[PD_ERR_LEN];
    if (tok_load(PD_SHARED_DIR "/models/stories260k", &tok, err) < 0) {
        printf("test_alternatives: no stories260k tokenizer (%s): skipped\n", err);
        return;
    }
    int32_t *ids = NULL, n = 0;
    CHECK(tok_encode(tok, "Once upon a time", 16, false, &ids, &n, err) == 0 && n >= 4);
    const int32_t t_time = tok_token_to_id(tok, "\xe2\x96\x81time", 7);
    CHECK(t_time >= 0);
    oai_ctx c2 = ctx;
    c2.tok = tok;
    for (int kind = OAI_COMPLETIONS; kind <= OAI_CHAT && n >= 4 && t_time >= 0; kind++) {
        static hreq r;
        oai_choice ch[1];
        memset(&r, 0, sizeof r);
        memset(ch, 0, sizeof ch);
        r.ctx = &c2;
        r.choices = ch;
        r.n_choices = 1;
        r.job.kind = kind;
        r.job.n = 1;
        r.job.logprobs = 2; /* the instance sends 3: the router shows 2 */
        for (int32_t k = 0; k < n; k++) {
            const uint32_t next = (uint32_t)(k + 1 < n ? ids[k + 1] : ids[0]);
            const uint32_t top[3] = {next, (uint32_t)ids[k], (uint32_t)t_time};
            const float lps[3] = {-0.5f, -1.0f - (float)k, -3.0f};
            apply_top(&r, (uint32_t)ids[k], -1.0f - (float)k, top, lps, 3);
        }
        char *body = oai_final_body(&r);
        json_error_t je;
        json_t *o = json_loads(body, 0, &je);
        json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
        CHECK_MSG(lp != NULL, "%s", body);
        if (kind == OAI_COMPLETIONS) {
            json_t *toks = json_object_get(lp, "tokens"), *tops = json_object_get(lp, "top_logprobs");
            char joined[64] = "";
            for (size_t k = 0; k < json_array_size(toks); k++)
                strncat(joined, json_string_value(json_array_get(toks, k)), 63 - strlen(joined));
            CHECK_MSG(!strcmp(joined, "Once upon a time"), "%s", joined);
            CHECK_EQ_INT(json_array_size(tops), n);
            for (int32_t k = 0; k < n; k++) {
                json_t *d = json_array_get(tops, (size_t)k);
                const char *chosen = json_string_value(json_array_get(toks, (size_t)k));
                /* 2 alternatives (the next token and the chosen one) */
                CHECK_MSG(json_object_size(d) == 2, "position %d: %s", k, body);
                CHECK_NEAR(json_real_value(json_object_get(d, chosen)), -1.0 - k, 1e-6);
            }
            /* position 1's alternative "▁a"... is the token after it: " a" with its space */
            json_t *d1 = json_array_get(tops, 1);
            CHECK_MSG(json_object_get(d1, " a") != NULL, "%s", body);
            CHECK_NEAR(json_real_value(json_object_get(d1, " a")), -0.5, 1e-6);
        } else {
            json_t *content = json_object_get(lp, "content");
            CHECK_EQ_INT(json_array_size(content), n);
            for (int32_t k = 0; k < n; k++) {
                json_t *e = json_array_get(content, (size_t)k), *top = json_object_get(e, "top_logprobs");
                CHECK_MSG(json_array_size(top) == 2, "position %d: %s", k, body);
                json_t *a0 = json_array_get(top, 0), *a1 = json_array_get(top, 1);
                CHECK_NEAR(json_real_value(json_object_get(a0, "logprob")), -0.5, 1e-6);
                /* the chosen token in the list: its own text and bytes */
                CHECK(json_equal(json_object_get(a1, "token"), json_object_get(e, "token")));
                CHECK(json_equal(json_object_get(a1, "bytes"), json_object_get(e, "bytes")));
                const char *at = json_string_value(json_object_get(a0, "token"));
                json_t *b = json_object_get(a0, "bytes");
                CHECK(at && json_array_size(b) == strlen(at));
                for (size_t i = 0; at && i < json_array_size(b); i++)
                    CHECK(json_integer_value(json_array_get(b, i)) == (unsigned char)at[i]);
            }
            const char *a = json_string_value(
                json_object_get(json_array_get(json_object_get(json_array_get(content, 2), "top_logprobs"), 0), "token"));
            CHECK_MSG(a && !strcmp(a, " time"), "position 2's first alternative: %s", a ? a : "(null)");
        }
        json_decref(o);
        free(body);
        json_decref(ch[0].lp);
        tok_stream_destroy(ch[0].lp_stream);
        free(ch[0].text);
    }
    free(ids);
    tok_destroy(tok);
}

/* Copies file name from src to dir; flip changes its last byte and every 512th of its second
 * half (the weights of a safetensors file, where a fine-tune differs). */
static void copy_file(const char *src, const char *dir, const char *name, bool flip)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", src, name);
    FILE *f = fopen(path, "rb");
    if (!f) return;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc(n > 0 ? (size_t)n : 1);
    size_t got = buf ? fread(buf, 1, (size_t)n, f) : 0;
    fclose(f);
    if (flip && got) {
        buf[got - 1] ^= 1;
        for (size_t i = got / 2; i < got; i += 512) buf[i] ^= 1;
    }
    snprintf(path, sizeof path, "%s/%s", dir, name);
    f = fopen(path, "wb");
    if (f && buf) fwrite(buf, 1, got, f);
    if (f) fclose(f);
    free(buf);
}

/* rtr_http_system_fingerprint: its form, stable, the directory's path not counting, and
 * changed by the tokenizer's files, the chat template, the config and the weights. */
static void test_fingerprint(void)
{
    const char *src = PD_SHARED_DIR "/models/stories260k";
    static const char *const files[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                        "generation_config.json", "model.safetensors"};
    enum { N = sizeof files / sizeof files[0] };
    char fa[RTR_HTTP_FINGERPRINT_LEN], fb[RTR_HTTP_FINGERPRINT_LEN];
    struct stat st;
    if (stat(src, &st) != 0) {
        printf("no %s: fingerprint test skipped\n", src);
        return;
    }
    char root[] = "/tmp/test_rtr_openai_XXXXXX";
    CHECK(mkdtemp(root) != NULL);
    char dirs[N + 1][256];
    for (int d = 0; d <= N; d++) { /* dirs[N]: a plain copy; dirs[i]: file i changed */
        snprintf(dirs[d], sizeof dirs[d], "%s/m%d", root, d);
        mkdir(dirs[d], 0700);
        for (int i = 0; i < N; i++) copy_file(src, dirs[d], files[i], i == d);
    }
    rtr_http_system_fingerprint(src, fa, sizeof fa);
    CHECK_MSG(!strncmp(fa, "pdserve-", 8) && strlen(fa) > 8 + 17 && strspn(fa + strlen(fa) - 16,
              "0123456789abcdef") == 16 && fa[strlen(fa) - 17] == '-', "%s", fa);
    rtr_http_system_fingerprint(src, fb, sizeof fb);
    CHECK_MSG(!strcmp(fa, fb), "not stable: %s, %s", fa, fb);
    rtr_http_system_fingerprint(dirs[N], fb, sizeof fb);
    CHECK_MSG(!strcmp(fa, fb), "a copy elsewhere differs: %s, %s", fa, fb);
    for (int i = 0; i < N; i++) {
        rtr_http_system_fingerprint(dirs[i], fb, sizeof fb);
        CHECK_MSG(strcmp(fa, fb), "%s changed, the fingerprint did not: %s", files[i], fb);
    }
    for (int d = 0; d <= N; d++) {
        char path[4096];
        for (int i = 0; i < N; i++) {
            snprintf(path, sizeof path, "%s/%s", dirs[d], files[i]);
            unlink(path);
        }
        rmdir(dirs[d]);
    }
    rmdir(root);
}

int main(void)
{
    snprintf(ctx.model_name, sizeof ctx.model_name, "m");
    snprintf(ctx.system_fingerprint, sizeof ctx.system_fingerprint, "pdserve-test-0123456789abcdef");
    ctx.max_choices = 16;
    ctx.max_model_len = 512;
    test_completions();
    test_chat_errors();
    test_responses();
    test_alternatives();
    test_fingerprint();
    return pd_test_result("test_rtr_openai");
}
