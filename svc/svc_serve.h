/* svc_serve.h -- The serving half of a prefill or decode instance's main(), shared by both:
 * the gRPC server with the role's methods and the Instance service, the PORT line, the metrics
 * endpoint, and the SIGTERM drain. */
#ifndef PD_SVC_SERVE_H
#define PD_SVC_SERVE_H

#include "common/rpc/rpc.h"
#include "svc/svc.h"
#include "svc/svc_metrics.h"

typedef struct {
    const char *role;                          /* "decode", "prefill": default id <role>@<listen> */
    const char *mode;                          /* for the log line, e.g. "decode-only"; may be NULL */
    const svc_server_flags *sf;                /* listen address, threads, grace, drain, id */
    const ProtobufCServiceDescriptor *service;  /* the role's internal service */
    const char *method;                        /* its main method */
    rpc_method_kind kind;
    rpc_handler_fn handler;
    int stream_queue_max;                      /* streamed responses queued per call; 0 = default */
    const char *unary_method;                  /* optional: a unary method of the same service
                                                  (decode: EndChoice); NULL = none */
    rpc_handler_fn unary_handler;              /* its handler */
} svc_serve_params;

/* Creates the server (*server is set as soon as it exists: the caller destroys it, after
 * svc_metrics_stop and before the engine), registers the method(s) and inst's Instance service,
 * starts it, names inst (--instance-id or <role>@<listen>), prints "PORT <n>" on stdout, starts
 * the metrics endpoint watching server, inst's worker and kvt, then waits for SIGINT/SIGTERM,
 * marks inst draining and shuts the server down (the drain). Returns 0 after the drain, or an
 * error with err. */
int svc_serve(const svc_serve_params *p, svc_instance *inst, svc_metrics *sm, svc_kvt *kvt,
              rpc_server **server, char *err);

#endif
