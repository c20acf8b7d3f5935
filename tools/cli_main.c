/* cli_main.c -- pdserve-cli: a command-line client of the public API.
 *   pdserve-cli generate [--addr HOST:PORT] [flags] "prompt"   streams the completion's text
 *                                                               (--n choices, --logprobs, --json:
 *                                                               see generate_summary)
 *   pdserve-cli info [--addr HOST:PORT]                         model information
 *   pdserve-cli health [--addr HOST:PORT]                       exit 0 when SERVING */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/flags.h"
#include "common/rpc/rpc.h"
#include "grpc/health/v1/health.pb-c.h"
#include "pdserve/v1/generation.pb-c.h"

static rpc_client_tls g_tls; /* --tls-ca, --tls-cert, --tls-key, --tls-server-name */

static const char *finish_name(int f)
{
    switch (f) {
    case PDSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case PDSERVE__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case PDSERVE__V1__FINISH_REASON__FINISH_REASON_EOS: return "eos";
    case PDSERVE__V1__FINISH_REASON__FINISH_REASON_CANCELLED: return "cancelled";
    case PDSERVE__V1__FINISH_REASON__FINISH_REASON_ERROR: return "error";
    default: return "unspecified";
    }
}

static int cmd_info(const char *addr)
{
    char err[PD_ERR_LEN];
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = addr;
    cp.tls = g_tls;
    rpc_channel *ch = NULL;
    if (rpc_channel_create(&cp, &ch, err) < 0) {
        fprintf(stderr, "pdserve-cli: %s\n", err);
        return 1;
    }
    Pdserve__V1__GetModelInfoRequest q = PDSERVE__V1__GET_MODEL_INFO_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st;
    int rc = rpc_unary_call(ch, "/pdserve.v1.Generation/GetModelInfo", &q.base,
                            &pdserve__v1__get_model_info_response__descriptor, 10000, &resp, &st);
    if (rc == 0) {
        const Pdserve__V1__GetModelInfoResponse *m = (const void *)resp;
        printf("{\"model_name\": \"%s\", \"architecture\": \"%s\", \"max_model_len\": %u, "
               "\"vocab_size\": %u}\n", m->model_name, m->architecture, m->max_model_len, m->vocab_size);
        protobuf_c_message_free_unpacked(resp, NULL);
    } else {
        fprintf(stderr, "pdserve-cli: %s: %s\n", rpc_status_name(st.code), st.details);
    }
    rpc_channel_destroy(ch);
    return rc == 0 ? 0 : 1;
}

static int cmd_health(const char *addr)
{
    char err[PD_ERR_LEN];
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = addr;
    cp.tls = g_tls;
    rpc_channel *ch = NULL;
    if (rpc_channel_create(&cp, &ch, err) < 0) {
        fprintf(stderr, "pdserve-cli: %s\n", err);
        return 1;
    }
    Grpc__Health__V1__HealthCheckRequest q = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st;
    int rc = rpc_unary_call(ch, "/grpc.health.v1.Health/Check", &q.base,
                            &grpc__health__v1__health_check_response__descriptor, 3000, &resp, &st);
    int serving = rc == 0 && ((const Grpc__Health__V1__HealthCheckResponse *)resp)->status ==
                                 GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    printf("%s\n", rc != 0 ? rpc_status_name(st.code) : serving ? "SERVING" : "NOT_SERVING");
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    rpc_channel_destroy(ch);
    return serving ? 0 : 1;
}

/* Most choices a call may ask for (GenerateRequest.n) and alternatives per token (logprobs). */
#define CLI_MAX_CHOICES 16
#define CLI_MAX_TOP 20

/* One token's log-probabilities as the server sent them. */
typedef struct {
    uint32_t id;
    float logprob;
    int n_top;
    uint32_t top_id[CLI_MAX_TOP];
    float top_lp[CLI_MAX_TOP];
} cli_lp;

/* One choice of the stream, gathered over its messages. */
typedef struct {
    char *text;
    size_t tlen;
    uint32_t *ids;
    size_t n_ids;
    cli_lp *lps;                     /* [n_lps]: one per token when asked */
    size_t n_lps;
    int finish;
    Pdserve__V1__Usage usage;
} cli_choice;

/* Appends message r's tokens, text and logprobs to ch. Returns 0 or -1 (out of memory). */
static int choice_add(cli_choice *ch, const Pdserve__V1__GenerateResponse *r)
{
    size_t l = strlen(r->text);
    char *nt = realloc(ch->text, ch->tlen + l + 1);
    if (!nt) return -1;
    ch->text = nt;
    memcpy(ch->text + ch->tlen, r->text, l);
    ch->tlen += l;
    ch->text[ch->tlen] = 0;
    uint32_t *ni = realloc(ch->ids, (ch->n_ids + r->n_token_ids + 1) * sizeof *ni);
    if (!ni) return -1;
    ch->ids = ni;
    memcpy(ch->ids + ch->n_ids, r->token_ids, r->n_token_ids * sizeof *ni);
    ch->n_ids += r->n_token_ids;
    if (r->n_logprobs) {
        cli_lp *nl = realloc(ch->lps, (ch->n_lps + r->n_logprobs) * sizeof *nl);
        if (!nl) return -1;
        ch->lps = nl;
        for (size_t i = 0; i < r->n_logprobs; i++) {
            const Pdserve__V1__TokenLogprob *t = r->logprobs[i];
            cli_lp *x = &ch->lps[ch->n_lps++];
            memset(x, 0, sizeof *x);
            if (!t) continue;
            x->id = t->token_id;
            x->logprob = t->logprob;
            for (size_t k = 0; k < t->n_top && x->n_top < CLI_MAX_TOP; k++) {
                if (!t->top[k]) continue;
                x->top_id[x->n_top] = t->top[k]->token_id;
                x->top_lp[x->n_top++] = t->top[k]->logprob;
            }
        }
    }
    if (r->finish_reason) {
        ch->finish = r->finish_reason;
        if (r->usage) ch->usage = *r->usage;
    }
    return 0;
}

/* Writes s[0, n) as the body of a JSON string (quotes, backslashes and control bytes
 * escaped; other bytes, UTF-8 included, as they are). */
static void json_str(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c == '\n') printf("\\n");
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
}

/* Prints choice i as one line of JSON (see the generate summary). */
static void choice_print_json(const cli_choice *ch, int i, bool with_lps)
{
    printf("{\"index\": %d, \"token_ids\": [", i);
    for (size_t k = 0; k < ch->n_ids; k++) printf("%s%u", k ? ", " : "", ch->ids[k]);
    printf("], \"text\": \"");
    json_str(ch->text ? ch->text : "", ch->tlen);
    printf("\", \"finish_reason\": \"%s\", \"prompt_tokens\": %u, \"completion_tokens\": %u, "
           "\"cached_prompt_tokens\": %u", finish_name(ch->finish), ch->usage.prompt_tokens,
           ch->usage.completion_tokens, ch->usage.cached_prompt_tokens);
    if (with_lps) {
        printf(", \"logprobs\": [");
        for (size_t k = 0; k < ch->n_lps; k++) {
            const cli_lp *x = &ch->lps[k];
            printf("%s{\"token_id\": %u, \"logprob\": %.9g, \"top\": [", k ? ", " : "", x->id,
                   (double)x->logprob);
            for (int t = 0; t < x->n_top; t++)
                printf("%s{\"token_id\": %u, \"logprob\": %.9g}", t ? ", " : "", x->top_id[t],
                       (double)x->top_lp[t]);
            printf("]}");
        }
        printf("]");
    }
    printf("}\n");
}

/* Text mode, --logprobs: choice i's tokens on stderr, one a line. */
static void choice_print_lps(const cli_choice *ch, int i)
{
    for (size_t k = 0; k < ch->n_lps; k++) {
        const cli_lp *x = &ch->lps[k];
        fprintf(stderr, "[choice %d] %u %.4f |", i, x->id, (double)x->logprob);
        for (int t = 0; t < x->n_top; t++)
            fprintf(stderr, " %u:%.4f", x->top_id[t], (double)x->top_lp[t]);
        fputc('\n', stderr);
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: pdserve-cli generate [--addr HOST:PORT] [flags] \"prompt\"\n"
                    "       pdserve-cli info [--addr HOST:PORT]\n"
                    "       pdserve-cli health [--addr HOST:PORT]\n"
                    "'pdserve-cli generate --help' lists the generation flags.\n");
}

static const char generate_summary[] =
    "Streams a completion from a pdserve router.\n"
    "\n"
    "Text mode: the text streams to stdout, then a summary line (finish reason, tokens) goes\n"
    "to stderr. With --n > 1 the choices are printed once the call ends, in index order, each\n"
    "as \"[choice i] \" followed by its text and a newline on stdout and its summary line on\n"
    "stderr. With --logprobs, one line per token on stderr after that: \"[choice i] token_id\n"
    "logprob | alt_id:logprob ...\".\n"
    "\n"
    "--json: one JSON object per choice, one a line, in index order (JSON Lines; a single\n"
    "object with --n 1): index, token_ids, text, finish_reason, prompt_tokens,\n"
    "completion_tokens (the choice's own), cached_prompt_tokens and, with --logprobs, logprobs:\n"
    "a list of {token_id, logprob, top: [{token_id, logprob}, ...]}, one per token.\n"
    "\n"
    "Choice i of a seeded call (--seed S) is the call with --seed S+i and --n 1.";

int main(int argc0, char **argv0)
{
    if (argc0 < 2 || argv0[1][0] == '-') {
        usage();
        return argc0 >= 2 && (!strcmp(argv0[1], "-h") || !strcmp(argv0[1], "--help")) ? 0 : 2;
    }
    const char *cmd = argv0[1];
    if (strcmp(cmd, "generate") && strcmp(cmd, "info") && strcmp(cmd, "health")) {
        fprintf(stderr, "pdserve-cli: unknown command '%s'\n", cmd);
        usage();
        return 2;
    }
    const char *addr = "127.0.0.1:50051", *prompt = "", *stop = "";
    int64_t max_tokens = 128, seed = -1, timeout_ms = 600000, n_choices = 1, logprobs = 0;
    double temperature = 1.0, top_p = 1.0;
    bool json = false, ignore_eos = false;
    pd_flag flags[] = {
        {"addr", PD_FLAG_STRING, &addr, "router address host:port", 1, 0},
        {"prompt", PD_FLAG_STRING, &prompt, "prompt text, also as the last argument (empty = just BOS)", 1, 0},
        {"max-tokens", PD_FLAG_INT, &max_tokens, "new tokens at most (per choice)", 1, 1 << 24},
        {"temperature", PD_FLAG_DOUBLE, &temperature, "0 = greedy", 0, 100},
        {"top-p", PD_FLAG_DOUBLE, &top_p, "nucleus mass", 0, 1},
        {"seed", PD_FLAG_INT, &seed, "sampling seed (-1 = none); choice i draws from seed + i",
         -1, 9.2e18},
        {"n", PD_FLAG_INT, &n_choices, "choices: samples of the prompt, sharing its KV", 1,
         CLI_MAX_CHOICES},
        {"logprobs", PD_FLAG_INT, &logprobs, "each token's log-probability and its K likeliest "
         "alternatives (0 = none)", 0, CLI_MAX_TOP},
        {"stop", PD_FLAG_LIST, &stop, "stop strings, comma-separated", 1, 0},
        {"ignore-eos", PD_FLAG_BOOL, &ignore_eos, "don't stop at EOS", 1, 0},
        {"timeout-ms", PD_FLAG_INT, &timeout_ms, "deadline of the call", 1, 86400000},
        {"json", PD_FLAG_BOOL, &json, "print one JSON object per choice (one a line) with ids, "
         "text, finish, usage, logprobs", 1, 0},
    };
    pd_flag all[sizeof flags / sizeof flags[0] + 4];
    int nf = 0;
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) all[nf++] = flags[i];
    rpc_client_tls_flags_add(&g_tls, all, &nf, false);
    /* argv without the command; a bare argument (not a flag's value) is the prompt. */
    char **argv = calloc((size_t)argc0 + 1, sizeof *argv);
    if (!argv) return 1;
    int argc = 0;
    argv[argc++] = argv0[0];
    for (int i = 2; i < argc0; i++) {
        const char *a = argv0[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            argv[argc++] = argv0[i];
        } else if (!strncmp(a, "--", 2)) {
            /* An unknown flag is named here: its value would otherwise be taken for the
             * prompt, and the prompt for a stray argument. */
            int k = pd_flags_find(all, nf, a);
            if (k < 0) {
                pd_flags_print_unknown(all, nf, "pdserve-cli", a);
                free(argv);
                return 2;
            }
            argv[argc++] = argv0[i];
            if (!strchr(a, '=') && all[k].type != PD_FLAG_BOOL && i + 1 < argc0) argv[argc++] = argv0[++i];
        } else if (!prompt[0]) {
            prompt = a;
        } else {
            fprintf(stderr, "pdserve-cli: unexpected argument '%s' (quote the prompt)\n", a);
            free(argv);
            return 2;
        }
    }
    int prc = pd_flags_parse(all, nf, argc, argv, "pdserve-cli generate", generate_summary);
    free(argv);
    if (prc != 0) return prc > 0 ? 0 : 2;
    if (!strcmp(cmd, "info")) return cmd_info(addr);
    if (!strcmp(cmd, "health")) return cmd_health(addr);
    Pdserve__V1__GenerateRequest q = PDSERVE__V1__GENERATE_REQUEST__INIT;
    Pdserve__V1__SamplingParams sp = PDSERVE__V1__SAMPLING_PARAMS__INIT;
    Pdserve__V1__StoppingCriteria st = PDSERVE__V1__STOPPING_CRITERIA__INIT;
    uint32_t bos = 1;
    char *stops_buf = strdup(stop), *stops[64];
    size_t n_stops = 0;
    for (char *s = strtok(stops_buf, ","); s && n_stops < 64; s = strtok(NULL, ",")) stops[n_stops++] = s;
    if (prompt[0]) {
        q.prompt = (char *)prompt;
    } else { /* an empty prompt: the model's BOS alone (id 1 for Llama-2-style vocabularies) */
        q.n_prompt_token_ids = 1;
        q.prompt_token_ids = &bos;
    }
    sp.temperature_set_case = PDSERVE__V1__SAMPLING_PARAMS__TEMPERATURE_SET_TEMPERATURE;
    sp.temperature = (float)temperature;
    sp.top_p_set_case = PDSERVE__V1__SAMPLING_PARAMS__TOP_P_SET_TOP_P;
    sp.top_p = (float)top_p;
    if (seed >= 0) {
        sp.seed_set_case = PDSERVE__V1__SAMPLING_PARAMS__SEED_SET_SEED;
        sp.seed = (uint64_t)seed;
    }
    st.max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
    st.max_tokens = (uint32_t)max_tokens;
    st.ignore_eos = ignore_eos;
    st.n_stop = n_stops;
    st.stop = stops;
    q.sampling = &sp;
    q.stopping = &st;
    q.n = (uint32_t)n_choices;
    q.logprobs = (uint32_t)logprobs;
    char err[PD_ERR_LEN];
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = addr;
    cp.tls = g_tls;
    rpc_channel *ch = NULL;
    rpc_client_stream *s = NULL;
    cli_choice chs[CLI_MAX_CHOICES];
    memset(chs, 0, sizeof chs);
    const int nc = (int)n_choices;
    int status = 1;
    if (!stops_buf) {
        fprintf(stderr, "pdserve-cli: out of memory\n");
        goto out;
    }
    if (rpc_channel_create(&cp, &ch, err) < 0 ||
        rpc_client_stream_open(ch, "/pdserve.v1.Generation/Generate", &q.base,
                               &pdserve__v1__generate_response__descriptor, timeout_ms, &s, err) < 0) {
        fprintf(stderr, "pdserve-cli: %s\n", err);
        goto out;
    }
    ProtobufCMessage *m;
    bool oom = false;
    while (rpc_client_stream_next(s, &m) == 1) {
        const Pdserve__V1__GenerateResponse *r = (const void *)m;
        if (r->index < (uint32_t)nc && choice_add(&chs[r->index], r) < 0) oom = true;
        if (!json && nc == 1) { /* one choice streams as it comes */
            fputs(r->text, stdout);
            fflush(stdout);
        }
        protobuf_c_message_free_unpacked(m, NULL);
    }
    rpc_status rs;
    rpc_client_stream_status(s, &rs);
    if (rs.code != RPC_STATUS_OK) {
        fprintf(stderr, "\npdserve-cli: %s: %s\n", rpc_status_name(rs.code), rs.details);
        goto out;
    }
    if (oom) {
        fprintf(stderr, "\npdserve-cli: out of memory\n");
        goto out;
    }
    for (int i = 0; i < nc; i++) {
        const cli_choice *c = &chs[i];
        if (json) {
            choice_print_json(c, i, logprobs > 0);
            continue;
        }
        if (nc > 1) {
            printf("[choice %d] ", i);
            fwrite(c->text ? c->text : "", 1, c->tlen, stdout);
            putchar('\n');
            fflush(stdout);
            fprintf(stderr, "[choice %d: finish %s, %u prompt + %u completion tokens]\n", i,
                    finish_name(c->finish), c->usage.prompt_tokens, c->usage.completion_tokens);
        } else {
            fprintf(stderr, "\n[finish: %s, %u prompt + %u completion tokens]\n",
                    finish_name(c->finish), c->usage.prompt_tokens, c->usage.completion_tokens);
        }
    }
    if (!json && logprobs > 0)
        for (int i = 0; i < nc; i++) choice_print_lps(&chs[i], i);
    status = 0;
out:
    for (int i = 0; i < CLI_MAX_CHOICES; i++) {
        free(chs[i].text);
        free(chs[i].ids);
        free(chs[i].lps);
    }
    rpc_client_stream_close(s);
    rpc_channel_destroy(ch);
    free(stops_buf);
    pd_flags_free();
    return status;
}
