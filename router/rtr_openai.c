/* rtr_openai.c -- OpenAI's completions and chat completions as pdserve Generate calls: the
 * request body checked field by field (wrong types and values outside OpenAI's ranges are 400
 * naming the field, unsupported features are 400 rather than silently ignored, unknown fields
 * are ignored) and mapped onto GenerateRequest; responses, stream chunks, usage, errors and the
 * system_fingerprint in OpenAI's JSON shapes. */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "router/rtr_http_impl.h"
#include "svc/svc_core.h"

#ifndef PD_VERSION
#define PD_VERSION "unknown"
#endif

/* ---- errors ---- */

int oai_errf(oai_err *e, int status, const char *param, const char *code, const char *fmt, ...)
{
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return status;
}

static const char *err_type(int status)
{
    if (status == 429) return "rate_limit_error";
    if (status == 504) return "timeout_error";
    if (status >= 500) return "server_error";
    return "invalid_request_error";
}

/* Cuts s (NUL-terminated) at the last complete UTF-8 character: vsnprintf may have cut one. */
static void utf8_trim(char *s)
{
    size_t n = strlen(s), i = n;
    while (i > 0 && ((unsigned char)s[i - 1] & 0xC0) == 0x80) i--;
    if (i == 0) return;
    unsigned char lead = (unsigned char)s[i - 1];
    size_t want = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    if (n - (i - 1) < want) s[i - 1] = 0;
}

char *oai_error_body(const oai_err *e)
{
    char msg[PD_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", e->message);
    utf8_trim(msg);
    json_t *err = json_object();
    json_t *m = json_string(msg);
    json_object_set_new(err, "message", m ? m : json_string("error"));
    json_object_set_new(err, "type", json_string(err_type(e->status)));
    json_object_set_new(err, "param", e->param[0] ? json_string(e->param) : json_null());
    json_object_set_new(err, "code", e->code ? json_string(e->code) : json_null());
    json_t *root = json_pack("{s:o}", "error", err);
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    return s;
}

int oai_http_status(int code)
{
    switch (code) {
    case RPC_STATUS_OK: return 200;
    case RPC_STATUS_INVALID_ARGUMENT:
    case RPC_STATUS_OUT_OF_RANGE:
    case RPC_STATUS_FAILED_PRECONDITION: return 400;
    case RPC_STATUS_UNAUTHENTICATED: return 401;
    case RPC_STATUS_PERMISSION_DENIED: return 403;
    case RPC_STATUS_NOT_FOUND: return 404;
    case RPC_STATUS_ALREADY_EXISTS:
    case RPC_STATUS_ABORTED: return 409;
    case RPC_STATUS_RESOURCE_EXHAUSTED: return 429;
    case RPC_STATUS_UNIMPLEMENTED: return 501;
    case RPC_STATUS_CANCELLED:
    case RPC_STATUS_UNAVAILABLE: return 503;
    case RPC_STATUS_DEADLINE_EXCEEDED: return 504;
    default: return 500; /* UNKNOWN, INTERNAL, DATA_LOSS */
    }
}

/* ---- field access ---- */

static const char *jtype(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a decimal";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

static int type_err(oai_err *e, const char *key, const char *want, const json_t *v)
{
    return oai_errf(e, 400, key, NULL, "Invalid type for '%s': expected %s, but got %s instead.",
                    key, want, jtype(v));
}

/* The member key of o, or NULL when it is absent or null (OpenAI's "not given"). */
static json_t *opt(const json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return v && !json_is_null(v) ? v : NULL;
}

static int get_number(const json_t *o, const char *key, bool *has, double *out, oai_err *e)
{
    json_t *v = opt(o, key);
    *has = v != NULL;
    if (!v) return 0;
    if (!json_is_number(v)) return type_err(e, key, "a number", v);
    *out = json_number_value(v);
    return 0;
}

/* A number in [lo, hi] (OpenAI's documented range of the field). */
static int get_number_in(const json_t *o, const char *key, double lo, double hi, bool *has,
                         double *out, oai_err *e)
{
    if (get_number(o, key, has, out, e)) return e->status;
    if (*has && !(*out >= lo && *out <= hi))
        return oai_errf(e, 400, key, NULL, "'%s' must be in [%g, %g] (got %g)", key, lo, hi, *out);
    return 0;
}

/* An integer (a decimal with an integral value counts) in [lo, hi]. */
static int get_int(const json_t *o, const char *key, int64_t lo, int64_t hi, bool *has,
                   int64_t *out, oai_err *e)
{
    json_t *v = opt(o, key);
    *has = v != NULL;
    if (!v) return 0;
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (d != floor(d) || d < -9.2e18 || d > 9.2e18) return type_err(e, key, "an integer", v);
        *out = (int64_t)d;
    } else if (json_is_integer(v)) {
        *out = json_integer_value(v);
    } else {
        return type_err(e, key, "an integer", v);
    }
    if (*out < lo || *out > hi)
        return oai_errf(e, 400, key, NULL, "'%s' must be in [%" PRId64 ", %" PRId64 "] (got %" PRId64 ")",
                        key, lo, hi, *out);
    return 0;
}

static int get_bool(const json_t *o, const char *key, bool *has, bool *out, oai_err *e)
{
    json_t *v = opt(o, key);
    *has = v != NULL;
    if (!v) return 0;
    if (!json_is_boolean(v)) return type_err(e, key, "a boolean", v);
    *out = json_is_true(v);
    return 0;
}

/* ---- requests ---- */

void oai_job_free_inputs(oai_job *job)
{
    for (int i = 0; job->ids && i < job->n_prompts; i++) free(job->ids[i]);
    free(job->ids);
    free(job->n_ids);
    free(job->texts);
    free(job->stop);
    free(job->stop_ids);
    for (size_t i = 0; i < job->n_msgs; i++)
        if (job->msgs[i].content != protobuf_c_empty_string) free(job->msgs[i].content);
    free(job->msgs);
    free(job->msgp);
    json_decref(job->root);
    job->ids = NULL;
    job->n_ids = NULL;
    job->texts = NULL;
    job->stop = NULL;
    job->stop_ids = NULL;
    job->root = NULL;
    job->msgs = NULL;
    job->msgp = NULL;
    job->n_msgs = 0;
}

void oai_job_free(oai_job *job) { oai_job_free_inputs(job); }

static int alloc_prompts(oai_job *job, int n, oai_err *e)
{
    job->n_prompts = n;
    job->texts = calloc((size_t)n, sizeof *job->texts);
    job->ids = calloc((size_t)n, sizeof *job->ids);
    job->n_ids = calloc((size_t)n, sizeof *job->n_ids);
    if (!job->texts || !job->ids || !job->n_ids) return oai_errf(e, 500, NULL, NULL, "out of memory");
    return 0;
}

/* A list of token ids (v an array of integers) into ids[i]. */
static int token_list(oai_job *job, int i, const json_t *v, const char *param, oai_err *e)
{
    size_t n = json_array_size(v);
    if (n == 0) return oai_errf(e, 400, param, NULL, "'%s' must not be empty", param);
    job->ids[i] = malloc(n * sizeof *job->ids[i]);
    if (!job->ids[i]) return oai_errf(e, 500, NULL, NULL, "out of memory");
    job->n_ids[i] = n;
    for (size_t k = 0; k < n; k++) {
        json_t *t = json_array_get(v, k);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > UINT32_MAX)
            return oai_errf(e, 400, param, NULL, "'%s' must be a string, a list of strings, a "
                            "list of token ids or a list of token id lists (item %zu is %s)",
                            param, k, json_is_integer(t) ? "a negative or too large integer" : jtype(t));
        job->ids[i][k] = (uint32_t)json_integer_value(t);
    }
    return 0;
}

/* prompt: a string, a list of token ids, or a list (batch) of strings or of token id lists. */
static int parse_prompt(oai_job *job, const json_t *root, oai_err *e)
{
    json_t *p = opt(root, "prompt");
    if (!p) return oai_errf(e, 400, "prompt", NULL, "'prompt' is required");
    if (json_is_string(p)) {
        if (json_string_length(p) == 0) return oai_errf(e, 400, "prompt", NULL, "'prompt' must not be empty");
        if (alloc_prompts(job, 1, e)) return e->status;
        job->texts[0] = json_string_value(p);
        return 0;
    }
    if (!json_is_array(p)) return type_err(e, "prompt", "a string or an array", p);
    size_t n = json_array_size(p);
    if (n == 0) return oai_errf(e, 400, "prompt", NULL, "'prompt' must not be empty");
    json_t *first = json_array_get(p, 0);
    if (json_is_integer(first)) { /* one prompt of token ids */
        if (alloc_prompts(job, 1, e)) return e->status;
        return token_list(job, 0, p, "prompt", e);
    }
    if (n > 1024) return oai_errf(e, 400, "prompt", NULL, "at most 1024 prompts per request");
    if (alloc_prompts(job, (int)n, e)) return e->status;
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(p, i);
        if (json_is_string(first) && json_is_string(x)) {
            if (json_string_length(x) == 0)
                return oai_errf(e, 400, "prompt", NULL, "'prompt' item %zu is empty", i);
            job->texts[i] = json_string_value(x);
        } else if (json_is_array(first) && json_is_array(x)) {
            if (token_list(job, (int)i, x, "prompt", e)) return e->status;
        } else {
            return oai_errf(e, 400, "prompt", NULL, "'prompt' must be a string, a list of strings, a "
                            "list of token ids or a list of token id lists (item %zu is %s)", i, jtype(x));
        }
    }
    return 0;
}

/* The text of a chat message's content: a string, or a list of {"type": "text", "text"}
 * parts (the OpenAI SDKs' multi-part input; joined with newlines, as vLLM does: OpenAI does
 * not say how it joins them); a part of another type (image_url, input_audio, file, ...) is
 * a 400 naming it. null counts as "" for assistant messages. */
static int message_text(const json_t *m, size_t i, const char *role, char **out, oai_err *e)
{
    char param[64];
    snprintf(param, sizeof param, "messages[%zu].content", i);
    json_t *c = json_object_get(m, "content");
    size_t want = 0; /* the text's length (shorter: it held a NUL) */
    *out = NULL;
    if (!c || json_is_null(c)) {
        if (strcmp(role, "assistant"))
            return oai_errf(e, 400, param, NULL, "'%s' is required for role '%s'", param, role);
        *out = strdup("");
    } else if (json_is_string(c)) {
        *out = strdup(json_string_value(c));
        want = json_string_length(c);
    } else if (json_is_array(c)) {
        size_t len = 0, k;
        json_t *part;
        json_array_foreach(c, k, part) {
            json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
            if (!json_is_object(part))
                return oai_errf(e, 400, param, NULL, "'%s' item %zu must be a content part (an "
                                "object with a 'type'), not %s", param, k, jtype(part));
            if (!json_is_string(type))
                return oai_errf(e, 400, param, NULL, "'%s' item %zu has no 'type' (a string): "
                                "only text parts ({\"type\": \"text\", \"text\": ...}) are "
                                "supported", param, k);
            if (strcmp(json_string_value(type), "text"))
                return oai_errf(e, 400, param, "unsupported_content_part", "'%s' item %zu is a "
                                "content part of type '%s': this model takes text only (parts of "
                                "type 'text')", param, k, json_string_value(type));
            if (!json_is_string(text)) return type_err(e, param, "a text part with a string 'text'", text ? text : part);
            len += json_string_length(text) + 1;
        }
        *out = malloc(len + 1);
        if (*out) {
            size_t pos = 0;
            json_array_foreach(c, k, part) {
                json_t *text = json_object_get(part, "text");
                if (k) (*out)[pos++] = '\n';
                memcpy(*out + pos, json_string_value(text), json_string_length(text));
                pos += json_string_length(text);
            }
            (*out)[pos] = 0;
            want = pos;
        }
    } else {
        return type_err(e, param, "a string or an array of content parts", c);
    }
    if (!*out) return oai_errf(e, 500, NULL, NULL, "out of memory");
    if (strlen(*out) != want)
        return oai_errf(e, 400, param, NULL, "'%s' contains a NUL character", param);
    return 0;
}

/* messages -> GenerateRequest.messages: the router renders them with the model's chat
 * template and tokenizes the text without added special tokens, as for a gRPC client. */
static int parse_messages(oai_job *job, const json_t *root, oai_err *e)
{
    json_t *msgs = opt(root, "messages");
    if (!msgs) return oai_errf(e, 400, "messages", NULL, "'messages' is required");
    if (!json_is_array(msgs)) return type_err(e, "messages", "an array", msgs);
    size_t n = json_array_size(msgs);
    if (n == 0) return oai_errf(e, 400, "messages", NULL, "'messages' must not be empty");
    if (n > 1024) return oai_errf(e, 400, "messages", NULL, "at most 1024 messages (got %zu)", n);
    job->msgs = calloc(n, sizeof *job->msgs);
    job->msgp = calloc(n, sizeof *job->msgp);
    if (!job->msgs || !job->msgp) return oai_errf(e, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(msgs, i), *role = json_object_get(m, "role");
        char param[64];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(m)) return type_err(e, param, "an object", m);
        snprintf(param, sizeof param, "messages[%zu].role", i);
        if (!role) return oai_errf(e, 400, param, NULL, "'%s' is required", param);
        if (!json_is_string(role) || !json_string_length(role))
            return type_err(e, param, "a non-empty string", role);
        pdserve__v1__chat_message__init(&job->msgs[i]);
        job->msgp[i] = &job->msgs[i];
        job->n_msgs = i + 1; /* (contents so far are freed with the job) */
        job->msgs[i].role = (char *)json_string_value(role);
        char *text = NULL;
        if (message_text(m, i, json_string_value(role), &text, e)) {
            job->msgs[i].content = text;
            return e->status;
        }
        job->msgs[i].content = text;
    }
    return alloc_prompts(job, 1, e);
}

/* stop: a string or a list of strings; stop_token_ids (vLLM's): a list of ids. */
static int parse_stop(oai_job *job, const json_t *root, oai_err *e)
{
    json_t *s = opt(root, "stop");
    if (s) {
        size_t n = json_is_string(s) ? 1 : json_is_array(s) ? json_array_size(s) : 0;
        if (!json_is_string(s) && !json_is_array(s))
            return type_err(e, "stop", "a string or an array of strings", s);
        job->stop = calloc(n ? n : 1, sizeof *job->stop);
        if (!job->stop) return oai_errf(e, 500, NULL, NULL, "out of memory");
        for (size_t i = 0; i < n; i++) {
            json_t *x = json_is_string(s) ? s : json_array_get(s, i);
            if (!json_is_string(x)) return type_err(e, "stop", "a string or an array of strings", x);
            if (strlen(json_string_value(x)) != json_string_length(x))
                return oai_errf(e, 400, "stop", NULL, "'stop' item %zu contains a NUL character", i);
            job->stop[i] = (char *)json_string_value(x);
        }
        job->stopping.n_stop = n;
        job->stopping.stop = job->stop;
    }
    json_t *t = opt(root, "stop_token_ids");
    if (t) {
        if (!json_is_array(t)) return type_err(e, "stop_token_ids", "an array of integers", t);
        size_t n = json_array_size(t);
        job->stop_ids = calloc(n ? n : 1, sizeof *job->stop_ids);
        if (!job->stop_ids) return oai_errf(e, 500, NULL, NULL, "out of memory");
        for (size_t i = 0; i < n; i++) {
            json_t *x = json_array_get(t, i);
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > UINT32_MAX)
                return oai_errf(e, 400, "stop_token_ids", NULL, "'stop_token_ids' must be token ids");
            job->stop_ids[i] = (uint32_t)json_integer_value(x);
        }
        job->stopping.n_stop_token_ids = n;
        job->stopping.stop_token_ids = job->stop_ids;
    }
    return 0;
}

/* Features that would change the answer if ignored: refused instead. */
static int refuse_unsupported(const json_t *root, int kind, int n, oai_err *e)
{
    json_t *v;
    if ((v = opt(root, "echo")) && !json_is_false(v))
        return oai_errf(e, 400, "echo", NULL, "'echo' is not supported");
    if ((v = opt(root, "suffix")) && !(json_is_string(v) && json_string_length(v) == 0))
        return oai_errf(e, 400, "suffix", NULL, "'suffix' is not supported");
    if ((v = opt(root, "best_of")) && !(json_is_integer(v) && json_integer_value(v) == n))
        return oai_errf(e, 400, "best_of", NULL, "'best_of' is not supported (leave it unset or equal to n)");
    if ((v = opt(root, "logit_bias")) && !(json_is_object(v) && json_object_size(v) == 0))
        return oai_errf(e, 400, "logit_bias", NULL, "'logit_bias' is not supported");
    if (kind != OAI_CHAT) return 0;
    if ((v = opt(root, "tools")) && !(json_is_array(v) && json_array_size(v) == 0))
        return oai_errf(e, 400, "tools", NULL, "'tools' (function calling) is not supported");
    if ((v = opt(root, "functions")) && !(json_is_array(v) && json_array_size(v) == 0))
        return oai_errf(e, 400, "functions", NULL, "'functions' (function calling) is not supported");
    if ((v = opt(root, "tool_choice")) && !(json_is_string(v) && !strcmp(json_string_value(v), "none")))
        return oai_errf(e, 400, "tool_choice", NULL, "'tool_choice' is not supported");
    if ((v = opt(root, "response_format"))) {
        json_t *t = json_object_get(v, "type");
        if (!json_is_object(v) || !json_is_string(t) || strcmp(json_string_value(t), "text"))
            return oai_errf(e, 400, "response_format", NULL, "'response_format' other than "
                            "{\"type\": \"text\"} is not supported");
    }
    return 0;
}

/* Sampling and stopping fields shared by both endpoints. */
static int parse_sampling(oai_job *job, const json_t *root, int kind, oai_err *e)
{
    Pdserve__V1__SamplingParams *s = &job->sampling;
    Pdserve__V1__StoppingCriteria *st = &job->stopping;
    bool has = false, b = false;
    double d = 0;
    int64_t i = 0;
    /* OpenAI's ranges: temperature [0, 2], top_p [0, 1], the penalties [-2, 2]. */
    if (get_number_in(root, "temperature", 0, 2, &has, &d, e)) return e->status;
    if (has) s->temperature_set_case = PDSERVE__V1__SAMPLING_PARAMS__TEMPERATURE_SET_TEMPERATURE, s->temperature = (float)d;
    if (get_number_in(root, "top_p", 0, 1, &has, &d, e)) return e->status;
    /* top_p 0 (OpenAI allows it) keeps the likeliest token only, as the smallest nucleus
     * does: SamplingParams wants top_p > 0. */
    if (has) s->top_p_set_case = PDSERVE__V1__SAMPLING_PARAMS__TOP_P_SET_TOP_P, s->top_p = d > 0 ? (float)d : FLT_MIN;
    if (get_int(root, "top_k", -1, INT32_MAX, &has, &i, e)) return e->status;
    if (has) s->top_k = (int32_t)i;
    if (get_number(root, "min_p", &has, &d, e)) return e->status;
    if (has) s->min_p = (float)d;
    if (get_number(root, "repetition_penalty", &has, &d, e)) return e->status;
    if (has) s->repetition_penalty_set_case = PDSERVE__V1__SAMPLING_PARAMS__REPETITION_PENALTY_SET_REPETITION_PENALTY, s->repetition_penalty = (float)d;
    if (get_number_in(root, "presence_penalty", -2, 2, &has, &d, e)) return e->status;
    if (has) s->presence_penalty = (float)d;
    if (get_number_in(root, "frequency_penalty", -2, 2, &has, &d, e)) return e->status;
    if (has) s->frequency_penalty = (float)d;
    if (get_int(root, "seed", INT64_MIN, INT64_MAX, &has, &i, e)) return e->status;
    if (has) s->seed_set_case = PDSERVE__V1__SAMPLING_PARAMS__SEED_SET_SEED, s->seed = (uint64_t)i;
    /* max_tokens (chat: max_completion_tokens first, max_tokens is its deprecated name) */
    const char *mt = kind == OAI_CHAT && opt(root, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    if (get_int(root, mt, 1, UINT32_MAX, &has, &i, e)) return e->status;
    if (has) st->max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS, st->max_tokens = (uint32_t)i;
    if (get_int(root, "min_tokens", 0, UINT32_MAX, &has, &i, e)) return e->status;
    if (has) st->min_tokens = (uint32_t)i;
    if (get_bool(root, "ignore_eos", &has, &b, e)) return e->status;
    if (has) st->ignore_eos = b;
    if (parse_stop(job, root, e)) return e->status;
    /* logprobs: completions' is how many alternatives; chat's a switch with top_logprobs. */
    job->logprobs = -1;
    if (kind == OAI_COMPLETIONS) {
        if (get_int(root, "logprobs", 0, 20, &has, &i, e)) return e->status;
        if (has) job->logprobs = (int)i;
    } else {
        bool on = false;
        if (get_bool(root, "logprobs", &has, &on, e)) return e->status;
        if (get_int(root, "top_logprobs", 0, 20, &has, &i, e)) return e->status;
        if (has && !on)
            return oai_errf(e, 400, "top_logprobs", NULL, "'top_logprobs' needs 'logprobs': true");
        if (on) job->logprobs = has ? (int)i : 0;
    }
    /* The router reports the chosen token's logprob whenever logprobs > 0. */
    job->req_logprobs = job->logprobs < 0 ? 0 : job->logprobs > 0 ? (uint32_t)job->logprobs : 1;
    return 0;
}

int oai_parse(const oai_ctx *ctx, int kind, const char *body, size_t len, oai_job *job, oai_err *e)
{
    memset(job, 0, sizeof *job);
    job->kind = kind;
    job->n = 1;
    job->logprobs = -1;
    pdserve__v1__sampling_params__init(&job->sampling);
    pdserve__v1__stopping_criteria__init(&job->stopping);
    json_error_t je;
    job->root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!job->root)
        return oai_errf(e, 400, NULL, NULL, "the body is not valid JSON: %s (line %d, column %d)",
                        je.text, je.line, je.column);
    const json_t *root = job->root;
    if (!json_is_object(root)) return oai_errf(e, 400, NULL, NULL, "the body must be a JSON object");
    json_t *model = opt(root, "model");
    if (model && !json_is_string(model)) return type_err(e, "model", "a string", model);
    if (model && strcmp(json_string_value(model), ctx->model_name))
        return oai_errf(e, 404, "model", "model_not_found", "The model `%s` does not exist; this "
                        "server serves `%s` (GET /v1/models).", json_string_value(model), ctx->model_name);
    bool has = false, b = false;
    int64_t i = 0;
    if (get_bool(root, "stream", &has, &b, e)) return e->status;
    job->stream = has && b;
    json_t *so = opt(root, "stream_options");
    if (so) {
        if (!json_is_object(so)) return type_err(e, "stream_options", "an object", so);
        if (!job->stream)
            return oai_errf(e, 400, "stream_options", NULL, "'stream_options' is only allowed with 'stream': true");
        if (get_bool(so, "include_usage", &has, &b, e)) return e->status;
        job->include_usage = has && b;
    }
    if (get_int(root, "n", 1, ctx->max_choices, &has, &i, e)) return e->status;
    if (has) job->n = (int)i;
    if (refuse_unsupported(root, kind, job->n, e)) return e->status;
    if (parse_sampling(job, root, kind, e)) return e->status;
    if (kind == OAI_CHAT ? parse_messages(job, root, e) : parse_prompt(job, root, e)) return e->status;
    if ((int64_t)job->n_prompts * job->n > ctx->max_choices)
        return oai_errf(e, 400, "n", NULL, "%d prompts x n = %d choices: at most %d per request",
                        job->n_prompts, job->n_prompts * job->n, ctx->max_choices);
    return 0;
}

void oai_job_request(const oai_job *job, int p, Pdserve__V1__GenerateRequest *q,
                     Pdserve__V1__SamplingParams *s)
{
    pdserve__v1__generate_request__init(q);
    if (job->n_msgs) {
        q->n_messages = job->n_msgs;
        q->messages = job->msgp;
    } else if (job->texts[p]) {
        q->prompt = (char *)job->texts[p];
    } else {
        q->n_prompt_token_ids = job->n_ids[p];
        q->prompt_token_ids = job->ids[p];
    }
    *s = job->sampling; /* (choice j draws from seed + j: the router's GenerateRequest.n) */
    q->sampling = s;
    q->n = (uint32_t)job->n;
    q->stopping = (Pdserve__V1__StoppingCriteria *)&job->stopping;
    q->logprobs = job->req_logprobs;
}

/* ---- responses ---- */

static const char *finish_name(int f)
{
    switch (f) {
    case PDSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case PDSERVE__V1__FINISH_REASON__FINISH_REASON_STOP:
    case PDSERVE__V1__FINISH_REASON__FINISH_REASON_EOS: return "stop";
    default: return NULL;
    }
}

static json_t *str_or_empty(const char *s, size_t len)
{
    json_t *v = json_stringn(s, len);
    return v ? v : json_string("");
}

/* The UTF-8 bytes of a string as a JSON array of integers. */
static json_t *bytes_json(const char *s, size_t len)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < len; i++) json_array_append_new(a, json_integer((unsigned char)s[i]));
    return a;
}

/* The text one token adds to the completion (the choice's own incremental detokenizer, so
 * that a leading space is kept and the pieces add up to the text; a token that ends inside a
 * multi-byte character adds "" and the next one the whole character), or "token_id:N"
 * without a tokenizer. Special tokens show (the completion text skips them). */
static json_t *token_json(const oai_ctx *ctx, oai_choice *c, uint32_t id, json_t **bytes)
{
    char err[PD_ERR_LEN], fallback[32];
    const char *s = fallback;
    size_t len = 0;
    if (ctx->tok && !c->lp_stream && tok_stream_create(ctx->tok, false, &c->lp_stream) < 0)
        c->lp_stream = NULL;
    if (!c->lp_stream || tok_stream_push(c->lp_stream, (int32_t)id, &s, &len, err) < 0) {
        s = fallback;
        len = (size_t)snprintf(fallback, sizeof fallback, "token_id:%u", id);
    }
    if (bytes) *bytes = bytes_json(s, len);
    return str_or_empty(s, len);
}

static json_t *lp_value(float lp) { return json_real(isfinite(lp) ? lp : -9999.0); }

/* The text of alternative id at a position whose previous token is prev (-1: the first
 * position), as its chosen token's text is made: what decode([prev, id]) adds to prev_text =
 * decode([prev]) when that is its prefix (so that a token keeps the leading space it has
 * inside the text), else decode([id]) (at the start, or when prev ends inside a character);
 * "token_id:N" without a tokenizer. Special tokens show. *bytes (when not NULL) gets its
 * UTF-8 bytes. */
static json_t *alt_json(const oai_ctx *ctx, int32_t prev, const char *prev_text,
                        size_t prev_len, uint32_t id, json_t **bytes)
{
    char err[PD_ERR_LEN], fallback[32];
    char *text = NULL;
    size_t len = 0, skip = 0;
    const int32_t ids[2] = {prev, (int32_t)id};
    if (ctx->tok && prev >= 0 && prev_text &&
        tok_decode(ctx->tok, ids, 2, false, &text, &len, err) == 0) {
        if (len >= prev_len && memcmp(text, prev_text, prev_len) == 0) {
            skip = prev_len;
        } else {
            free(text);
            text = NULL;
        }
    }
    if (!text && ctx->tok && tok_decode(ctx->tok, ids + 1, 1, false, &text, &len, err) < 0)
        text = NULL;
    const char *s = text ? text + skip : fallback;
    if (text) len -= skip;
    else len = (size_t)snprintf(fallback, sizeof fallback, "token_id:%u", id);
    if (bytes) *bytes = bytes_json(s, len);
    json_t *v = str_or_empty(s, len);
    free(text);
    return v;
}

/* An empty logprobs object of the request's kind. */
static json_t *lp_new(int kind)
{
    if (kind == OAI_CHAT) return json_pack("{s:[],s:n}", "content", "refusal");
    return json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

/* The logprobs of m's tokens: completions' four parallel lists (top_logprobs: the request's
 * number of alternatives and the chosen token, keyed by text; of tokens with the same text the
 * likeliest) or chat's content list (top_logprobs: the alternatives). The chosen token's text
 * is what it adds to the completion; an alternative's is made the same way in the context of
 * the token before it (alt_json), and the chosen token among them has its own text. */
static json_t *lp_fragment(const hreq *r, oai_choice *c, const Pdserve__V1__GenerateResponse *m)
{
    json_t *o = lp_new(r->job.kind);
    if (!o) return NULL;
    for (size_t k = 0; k < m->n_logprobs; k++) {
        const Pdserve__V1__TokenLogprob *t = m->logprobs[k];
        size_t n_alt = r->job.logprobs > 0 ? (size_t)r->job.logprobs : 0;
        if (n_alt > t->n_top) n_alt = t->n_top;
        char *prev_text = NULL, err[PD_ERR_LEN];
        size_t prev_len = 0;
        const int32_t prev = c->lp_has_prev ? c->lp_prev : -1;
        if (n_alt && prev >= 0 && r->ctx->tok &&
            tok_decode(r->ctx->tok, &prev, 1, false, &prev_text, &prev_len, err) < 0)
            prev_text = NULL;
        c->lp_has_prev = true;
        c->lp_prev = (int32_t)t->token_id;
        if (r->job.kind == OAI_CHAT) {
            json_t *bytes = NULL, *tok = token_json(r->ctx, c, t->token_id, &bytes);
            json_t *top = json_array();
            for (size_t j = 0; j < n_alt; j++) {
                const Pdserve__V1__TopLogprob *a = t->top[j];
                json_t *ab = NULL, *at;
                if (a->token_id == t->token_id) {
                    at = json_incref(tok);
                    ab = json_incref(bytes);
                } else {
                    at = alt_json(r->ctx, prev, prev_text, prev_len, a->token_id, &ab);
                }
                json_array_append_new(top, json_pack("{s:o,s:o,s:o}", "token", at, "logprob",
                                                     lp_value(a->logprob), "bytes", ab));
            }
            json_array_append_new(json_object_get(o, "content"),
                                  json_pack("{s:o,s:o,s:o,s:o}", "token", tok, "logprob",
                                            lp_value(t->logprob), "bytes", bytes, "top_logprobs", top));
        } else {
            json_t *tok = token_json(r->ctx, c, t->token_id, NULL);
            json_t *top = json_object();
            for (size_t j = 0; j < n_alt; j++) {
                const Pdserve__V1__TopLogprob *a = t->top[j];
                json_t *at = a->token_id == t->token_id
                                 ? json_incref(tok)
                                 : alt_json(r->ctx, prev, prev_text, prev_len, a->token_id, NULL);
                const char *key = json_string_value(at);
                if (key && !json_object_get(top, key))
                    json_object_set_new(top, key, lp_value(a->logprob));
                json_decref(at);
            }
            if (!json_object_get(top, json_string_value(tok)))
                json_object_set_new(top, json_string_value(tok), lp_value(t->logprob));
            json_array_append_new(json_object_get(o, "top_logprobs"), top);
            json_array_append_new(json_object_get(o, "token_logprobs"), lp_value(t->logprob));
            json_array_append_new(json_object_get(o, "text_offset"), json_integer((json_int_t)c->text_offset));
            c->text_offset += json_string_length(tok);
            json_array_append_new(json_object_get(o, "tokens"), tok);
        }
        free(prev_text);
    }
    return o;
}

/* Appends the arrays of fragment b to a's. */
static void lp_merge(json_t *a, json_t *b)
{
    const char *key;
    json_t *v;
    json_object_foreach(b, key, v) {
        if (json_is_array(v)) json_array_extend(json_object_get(a, key), v);
    }
}

/* {"id", "object", "created", "model", "system_fingerprint"} (null when the router was given
 * none) */
static json_t *envelope(const hreq *r, const char *object)
{
    const char *fp = r->ctx->system_fingerprint;
    return json_pack("{s:s,s:s,s:I,s:s,s:o}", "id", r->id, "object", object, "created",
                     (json_int_t)r->created, "model", r->ctx->model_name, "system_fingerprint",
                     fp[0] ? json_string(fp) : json_null());
}

static void emit_event(hreq *r, json_t *o)
{
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) {
        r->oom = true;
        return;
    }
    hreq_out(r, "data: ", 6);
    hreq_out(r, s, strlen(s));
    hreq_out(r, "\n\n", 2);
    free(s);
}

static const char *chunk_object(const hreq *r)
{
    return r->job.kind == OAI_CHAT ? "chat.completion.chunk" : "text_completion";
}

/* Emits a stream chunk with choices (taken) and usage (taken; NULL = null: every chunk but
 * the usage chunk of stream_options.include_usage, as OpenAI sends them). */
static void emit_chunk(hreq *r, json_t *choices, json_t *usage)
{
    json_t *o = envelope(r, chunk_object(r));
    if (o) {
        json_object_set_new(o, "choices", choices);
        json_object_set_new(o, "usage", usage ? usage : json_null());
    } else {
        json_decref(choices);
        json_decref(usage);
    }
    emit_event(r, o);
}

void oai_apply(hreq *r, int ci, const Pdserve__V1__GenerateResponse *m)
{
    oai_choice *c = &r->choices[ci];
    if (m->finish_reason) {
        c->finish = m->finish_reason;
        if (m->usage) {
            c->prompt_tokens = m->usage->prompt_tokens;
            c->completion_tokens = m->usage->completion_tokens;
            c->cached_tokens = m->usage->cached_prompt_tokens;
        }
    }
    const char *text = m->text ? m->text : "";
    size_t tlen = strlen(text);
    json_t *lp = r->job.logprobs >= 0 ? lp_fragment(r, c, m) : NULL;
    if (!r->job.stream) {
        if (c->text_len + tlen + 1 > c->text_cap) {
            size_t cap = (c->text_len + tlen + 1) * 2;
            char *nt = realloc(c->text, cap);
            if (!nt) {
                r->oom = true;
                json_decref(lp);
                return;
            }
            c->text = nt;
            c->text_cap = cap;
        }
        memcpy(c->text + c->text_len, text, tlen);
        c->text_len += tlen;
        c->text[c->text_len] = 0;
        if (lp && !c->lp) c->lp = lp;
        else if (lp) {
            lp_merge(c->lp, lp);
            json_decref(lp);
        }
        return;
    }
    if (r->job.kind == OAI_CHAT && !c->role_sent) {
        c->role_sent = true;
        emit_chunk(r, json_pack("[{s:i,s:{s:s,s:s},s:n,s:n}]", "index", ci, "delta", "role",
                                "assistant", "content", "", "logprobs", "finish_reason"), NULL);
    }
    const char *fin = finish_name(c->finish);
    if (!tlen && !fin && !(lp && m->n_logprobs)) { /* tokens whose text is held back */
        json_decref(lp);
        return;
    }
    json_t *ch = json_pack("{s:i}", "index", ci);
    if (r->job.kind == OAI_CHAT) {
        json_t *delta = json_object();
        if (tlen) json_object_set_new(delta, "content", str_or_empty(text, tlen));
        json_object_set_new(ch, "delta", delta);
    } else {
        json_object_set_new(ch, "text", str_or_empty(text, tlen));
    }
    json_object_set_new(ch, "logprobs", lp && m->n_logprobs ? lp : json_null());
    if (lp && !m->n_logprobs) json_decref(lp);
    json_object_set_new(ch, "finish_reason", fin ? json_string(fin) : json_null());
    emit_chunk(r, json_pack("[o]", ch), NULL);
}

bool oai_call_error(const hreq *r, const oai_choice *c, int code, const char *detail, oai_err *e)
{
    if (code == RPC_STATUS_FAILED_PRECONDITION && r->job.kind == OAI_CHAT) {
        oai_errf(e, 400, "messages", "chat_template_missing", "the model %s cannot do chat (%s); "
                 "use /v1/completions with a prompt", r->ctx->model_name,
                 detail && detail[0] ? detail : "no chat template");
        return true;
    }
    if (code != RPC_STATUS_OK) {
        oai_errf(e, oai_http_status(code), NULL,
                 code == RPC_STATUS_RESOURCE_EXHAUSTED ? "rate_limit_exceeded" : NULL, "%s",
                 detail && detail[0] ? detail : rpc_status_name(code));
        return true;
    }
    if (c->finish == PDSERVE__V1__FINISH_REASON__FINISH_REASON_CANCELLED) {
        oai_errf(e, 503, NULL, NULL, "the server cancelled the request (shutting down); retry");
        return true;
    }
    if (!finish_name(c->finish)) {
        oai_errf(e, 500, NULL, NULL, "the generation ended without a finish reason");
        return true;
    }
    return false;
}

static json_t *usage_json(const hreq *r)
{
    json_int_t prompt = 0, completion = 0, cached = 0;
    for (int i = 0; i < r->n_choices; i++) {
        const oai_choice *c = &r->choices[i];
        completion += c->completion_tokens;
        if (i % r->job.n == 0) { /* the prompt counts once however many choices it has */
            prompt += c->prompt_tokens;
            cached += c->cached_tokens;
        }
    }
    return json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", prompt, "completion_tokens", completion,
                     "total_tokens", prompt + completion, "prompt_tokens_details", "cached_tokens", cached);
}

void oai_stream_error(hreq *r)
{
    char *s = oai_error_body(&r->err);
    if (!s) {
        r->oom = true;
        return;
    }
    hreq_out(r, "data: ", 6);
    hreq_out(r, s, strlen(s));
    hreq_out(r, "\n\n", 2);
    free(s);
}

void oai_stream_end(hreq *r)
{
    if (r->job.include_usage && !r->failed) emit_chunk(r, json_array(), usage_json(r));
    hreq_out(r, "data: [DONE]\n\n", 14);
}

char *oai_final_body(const hreq *r)
{
    bool chat = r->job.kind == OAI_CHAT;
    json_t *o = envelope(r, chat ? "chat.completion" : "text_completion");
    json_t *choices = json_array();
    for (int i = 0; i < r->n_choices; i++) {
        const oai_choice *c = &r->choices[i];
        json_t *text = str_or_empty(c->text ? c->text : "", c->text_len);
        json_t *ch = json_pack("{s:i}", "index", i);
        if (chat) json_object_set_new(ch, "message", json_pack("{s:s,s:o}", "role", "assistant", "content", text));
        else json_object_set_new(ch, "text", text);
        json_t *lp = NULL;
        if (r->job.logprobs >= 0) lp = c->lp ? json_incref(c->lp) : lp_new(r->job.kind);
        json_object_set_new(ch, "logprobs", lp ? lp : json_null());
        const char *fin = finish_name(c->finish);
        json_object_set_new(ch, "finish_reason", json_string(fin ? fin : "stop"));
        json_array_append_new(choices, ch);
    }
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", usage_json(r));
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

char *oai_models_body(const oai_ctx *ctx, const char *id)
{
    if (id && strcmp(id, ctx->model_name)) return NULL;
    json_t *m = json_pack("{s:s,s:s,s:I,s:s,s:s,s:i}", "id", ctx->model_name, "object", "model",
                          "created", (json_int_t)ctx->created, "owned_by", "pdserve", "root",
                          ctx->model_name, "max_model_len", (int)ctx->max_model_len);
    json_t *o = id ? m : json_pack("{s:s,s:[o]}", "object", "list", "data", m);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

/* ---- system_fingerprint ---- */

/* Hashes a model file's name and contents into st (a missing file: its name only). */
static void hash_file(XXH64_state_t *st, const char *dir, const char *name)
{
    char path[4096], buf[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    XXH64_update(st, name, strlen(name) + 1);
    FILE *f = fopen(path, "rb");
    if (!f) return;
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) XXH64_update(st, buf, n);
    fclose(f);
}

void rtr_http_system_fingerprint(const char *model_dir, char *out, size_t len)
{
    static const char *const files[] = {"tokenizer.json", "tokenizer_config.json",
                                        "chat_template.jinja", "generation_config.json"};
    /* The router knows no KV dtype or quantization: fixed ones (the value is the router's,
     * not the instances' KvLayout fingerprint). */
    uint64_t model = svc_model_fingerprint(model_dir, "safetensors", PD_DTYPE_F32, "");
    uint64_t h = 0;
    XXH64_state_t *st = XXH64_createState();
    if (st) {
        XXH64_reset(st, 0x6f616966); /* "oaif" */
        XXH64_update(st, PD_VERSION, strlen(PD_VERSION) + 1);
        XXH64_update(st, &model, sizeof model);
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) hash_file(st, model_dir, files[i]);
        h = XXH64_digest(st);
        XXH64_freeState(st);
    }
    snprintf(out, len, "pdserve-%s-%016llx", PD_VERSION, (unsigned long long)h);
}
