/* rtr_http_impl.h -- Internals shared by rtr_http.c (the HTTP server, one request's calls and
 * events), rtr_http_watch.c (request deadlines, hang-ups of suspended connections) and
 * rtr_openai.c (OpenAI request parsing and response JSON). Not for use outside router/. */
#ifndef PD_ROUTER_RTR_HTTP_IMPL_H
#define PD_ROUTER_RTR_HTTP_IMPL_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "common/metrics.h"
#include "common/rpc/rpc.h"
#include "pdserve/v1/generation.pb-c.h"
#include "router/rtr_http.h"
#include "text/tokenizer.h"

enum { OAI_COMPLETIONS = 1, OAI_CHAT = 2 };

/* What the parser and the formatters read about the served model. */
typedef struct {
    char model_name[256];
    const tok_tokenizer *tok;       /* borrowed; NULL = none */
    int max_choices;
    int32_t max_model_len;
    int64_t created;                /* start time (Unix seconds), /v1/models */
    char system_fingerprint[RTR_HTTP_FINGERPRINT_LEN]; /* responses' and chunks'; "" = null */
} oai_ctx;

/* A request error in OpenAI's shape: {"error": {message, type, param, code}}. */
typedef struct {
    int status;                     /* HTTP status */
    char message[PD_ERR_LEN];
    char param[64];                 /* "" = null */
    const char *code;               /* NULL = null */
} oai_err;

/* A parsed generation request: the settings the responses need and the inputs of its
 * Generate calls (valid until oai_job_free_inputs). */
typedef struct {
    int kind;                       /* OAI_COMPLETIONS or OAI_CHAT */
    bool stream, include_usage;
    int n;                          /* choices per prompt, >= 1 */
    int n_prompts;                  /* >= 1 */
    int logprobs;                   /* -1 = none; completions: logprobs; chat: top_logprobs */
    /* Inputs: */
    json_t *root;                   /* the parsed body (owns the strings below) */
    const char **texts;             /* [n_prompts]: text prompt (tokenized by the router) or
                                       NULL for token ids or messages */
    uint32_t **ids;                 /* [n_prompts]: token ids (owned) or NULL */
    size_t *n_ids;                  /* [n_prompts] */
    Pdserve__V1__SamplingParams sampling;   /* seed_set as the request said */
    Pdserve__V1__StoppingCriteria stopping; /* stop / stop_token_ids point into the arrays */
    char **stop;                    /* [stopping.n_stop], borrowed from root */
    uint32_t *stop_ids;             /* owned */
    uint32_t req_logprobs;          /* GenerateRequest.logprobs */
    Pdserve__V1__ChatMessage *msgs; /* [n_msgs] chat: the conversation (roles borrowed from
                                       root, contents owned) */
    Pdserve__V1__ChatMessage **msgp;/* [n_msgs] pointers into msgs */
    size_t n_msgs;
} oai_job;

/* One choice of a request: choice j of prompt p has index p * n + j. A prompt's n choices
 * come from one Generate call (GenerateRequest.n), held by its choice j = 0. */
typedef struct oai_choice {
    struct hreq *r;                 /* back pointer (the call's user data: choice j = 0) */
    int index;
    rpc_client_call *call;          /* j = 0: the prompt's call, released when the request is
                                       freed; NULL for the others */
    /* MHD's thread only: */
    bool done;                      /* its call ended (status processed) */
    int finish;                     /* FinishReason of its last message, 0 until then */
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
    bool role_sent;                 /* chat stream: the first delta (role) went out */
    char *text;                     /* not streamed: the completion so far */
    size_t text_len, text_cap;
    json_t *lp;                     /* not streamed: logprobs so far (NULL = none asked) */
    size_t text_offset;             /* completions logprobs: offset of the next token */
    tok_stream *lp_stream;          /* logprobs: the tokens' text pieces (NULL until asked) */
    bool lp_has_prev;               /* logprobs: a token was given a text, the last one */
    int32_t lp_prev;                /*   (the context of the next position's alternatives) */
} oai_choice;

/* An event from a call's completion thread: a response (msg) or the end (msg NULL). */
typedef struct oai_event {
    struct oai_event *next;
    int choice;                     /* msg: its choice (p * n + index); end: the call's first */
    ProtobufCMessage *msg;          /* owned; NULL = the call ended with code / detail */
    int code;
    char detail[PD_ERR_LEN];
} oai_event;

struct hw_conn;

/* One HTTP request (MHD's per-request state). Freed when the last reference goes: MHD's (the
 * request-completed callback), a streamed response's, one per call not yet ended, and the
 * watcher's while it reports a hang-up. While its connection is suspended (nothing to send
 * yet) MHD does not call it; the calls' callbacks and the watcher resume it. */
typedef struct hreq {
    atomic_int refs;
    struct rtr_http *h;
    const oai_ctx *ctx;
    pthread_mutex_t mu;             /* guards the event list, n_live, gone, ev_oom, hup and
                                       suspended */
    oai_event *head, *tail;
    int n_live;                     /* calls whose on_done has not run */
    bool gone;                      /* the request ended (client gone, stop): drop events */
    bool ev_oom;                    /* a callback could not queue an event */
    bool hup;                       /* the client hung up (the watcher saw it): close */
    bool suspended;                 /* the connection is suspended: whoever clears this
                                       resumes it (MHD_resume_connection), exactly once */
    /* MHD's thread only: */
    struct MHD_Connection *conn;
    struct hw_conn *hc;             /* the connection's watcher slot (NULL = none) */
    int endpoint;                   /* EP_* of rtr_http.c */
    char *body;
    size_t body_len, body_cap;
    bool too_large;
    bool started;                   /* the calls started: MHD calls again after a resume */
    bool watched;                   /* the watcher looks for a hang-up (until completed) */
    oai_job job;
    char id[48];                    /* cmpl-... / chatcmpl-... */
    int64_t created;
    int n_choices, n_done;
    oai_choice *choices;
    bool failed;                    /* a choice failed: err holds the first error */
    oai_err err;
    bool headers_sent;              /* a streamed response was queued (errors become events) */
    bool sse_closed;                /* [DONE] appended */
    char *out;                      /* streamed bytes not yet handed to MHD */
    size_t out_len, out_off, out_cap;
    bool oom;                       /* out of memory while formatting */
} hreq;

/* ---- rtr_http_watch.c ---- */

/* The watcher: a thread that shuts down connections which have not sent a complete request
 * (headers and body) by their deadline, and reports clients that hang up (the peer closed or
 * reset the socket) while their request is watched. One slot per connection, allocated up
 * front. */
typedef struct hwatch hwatch;
typedef struct hw_conn hw_conn;     /* a connection's slot */

typedef struct {
    int max_conns;                  /* slots: connections open at once, at most */
    int64_t request_timeout_ms;     /* a connection's first request must be in (headers and
                                       body) this long after it opened; 0 = no deadline */
    int64_t idle_timeout_ms;        /* later requests: the previous one's end + this + the
                                       request timeout (MHD closes idle connections itself) */
    void (*ref)(void *obj);         /* takes a reference on a watched object; called with the
                                       watcher's lock held: must not block or lock */
    void (*hangup)(void *obj);      /* obj's client hung up; on the watcher's thread, holding
                                       the reference ref took (hangup drops it) */
    pd_metric *m_timeouts;          /* counter of deadline closes; borrowed, NULL = none */
} hw_params;

/* Starts the watcher's thread. Returns 0, PD_EINVAL, PD_ENOMEM or PD_EIO; err says why. */
int hw_create(const hw_params *p, hwatch **out, char *err);
/* Stops the thread and frees everything; every connection closed. NULL is a no-op. */
void hw_destroy(hwatch *w);
/* A new connection (MHD's NOTIFY_STARTED; fd borrowed until hw_conn_close): its request
 * deadline starts now. NULL when every slot is taken. */
hw_conn *hw_conn_open(hwatch *w, int fd);
/* The connection closes (NOTIFY_CLOSED, before MHD closes fd); ends its watch. NULL: no-op. */
void hw_conn_close(hwatch *w, hw_conn *c);
/* Its request was received in full: no deadline until hw_conn_waiting. */
void hw_conn_serving(hwatch *w, hw_conn *c);
/* Its request was answered: the next one's deadline starts (idle + request timeout). */
void hw_conn_waiting(hwatch *w, hw_conn *c);
/* Reports a hang-up of c's client to p.hangup(obj) (once) until hw_unwatch or the close;
 * obj must stay valid until then. Returns 0, PD_EINVAL (c NULL) or PD_EIO (epoll: obj is
 * watched, for hw_each_watched, but its hang-up is not noticed). */
int hw_watch(hwatch *w, hw_conn *c, void *obj);
void hw_unwatch(hwatch *w, hw_conn *c);
/* Calls fn(obj) for every watched object, holding a reference taken by p.ref (fn drops it). */
void hw_each_watched(hwatch *w, void (*fn)(void *obj));

/* ---- rtr_openai.c ---- */

/* Parses body (len bytes) as a request of kind. Returns 0 with job filled (free with
 * oai_job_free, also after an error), or an HTTP status with e filled. */
int oai_parse(const oai_ctx *ctx, int kind, const char *body, size_t len, oai_job *job,
              oai_err *e);
/* Fills q (initialized here) for prompt p with its n choices (GenerateRequest.n: one call
 * generates them all, choice j from seed + j when seeded), sampling copied into *s. q borrows
 * from job and s. */
void oai_job_request(const oai_job *job, int p, Pdserve__V1__GenerateRequest *q,
                     Pdserve__V1__SamplingParams *s);
/* Frees the inputs (once every call started); the settings stay. */
void oai_job_free_inputs(oai_job *job);
void oai_job_free(oai_job *job);

/* Applies one response of choice ci: streamed, appends a chunk to r->out; else accumulates. */
void oai_apply(hreq *r, int ci, const Pdserve__V1__GenerateResponse *m);
/* Fills e for a call of r that ended with code and detail (code OK with no finish reason, or
 * a finish reason of CANCELLED / ERROR, count as errors too; FAILED_PRECONDITION of a chat
 * request means the model has no chat template). Returns true when it is one. */
bool oai_call_error(const hreq *r, const oai_choice *c, int code, const char *detail, oai_err *e);
/* Streamed: appends an error event for r->err. */
void oai_stream_error(hreq *r);
/* Streamed: appends the usage chunk (when asked) and "data: [DONE]". */
void oai_stream_end(hreq *r);
/* Not streamed: the response body (caller frees with free), NULL when out of memory. */
char *oai_final_body(const hreq *r);

/* {"error": ...} for e (caller frees with free; NULL when out of memory). */
char *oai_error_body(const oai_err *e);
/* Fills e; type follows status. Returns e->status. */
int oai_errf(oai_err *e, int status, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* The HTTP status for a gRPC status code. */
int oai_http_status(int rpc_code);
/* /v1/models (id NULL) or /v1/models/{id}; NULL when out of memory or (with id) unknown. */
char *oai_models_body(const oai_ctx *ctx, const char *id);

/* Appends len bytes to r->out (sets r->oom on failure). */
void hreq_out(hreq *r, const char *s, size_t len);

#endif
