#!/usr/bin/python3
"""test_health.py -- The router's health tells the truth (issue #38 item 4), on the CPU stack with
stories260k: gRPC grpc.health.v1 Check and HTTP /health agree: SERVING / 200 while a decode
instance is up; after kill -9 of the only decode instance both say NOT_SERVING / 503 within
the load reports' timeout plus a poll (bounded here at 10 s, no sleeps to tune); a decode
instance started again on the same address brings both back; every process exits 0 after
SIGTERM. (NOT_SERVING while draining: test_drain.py.)

usage: test_health.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, signal, socket, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
check = H.check

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

def grpc_state(r):
    try:
        return H.hpb.HealthCheckResponse.ServingStatus.Name(H.health(r))
    except Exception as e:  # noqa: BLE001 -- an unreachable router is a failed check
        return "error: %s" % e

try:
    dport = free_port()
    dec_args = ["--model", H.model, "--backend", "cpu", "--listen", "127.0.0.1:%d" % dport,
                "--metrics-port", "0", "--kv-cache-mb", "16", "--colocated"]
    dec = H.start("pdserve-decode", *dec_args, tag="decode-1")
    r = H.start("pdserve-router", "--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                "--decode", "127.0.0.1:%d" % dport, "--load-poll-ms", "100", "--http-listen", "127.0.0.1:0",
                tag="router")
    line = r.p.stdout.readline()
    check(line.startswith("HTTP_PORT "), "the router prints its HTTP port (%r)" % line)
    hport = int(line.split()[1])
    both = lambda: (grpc_state(r), eu.http_get(hport, "/health")[0])
    check(eu.wait_until(lambda: both() == ("SERVING", 200), 10),
          "a decode instance up: gRPC SERVING and HTTP 200 (%s)" % (both(),))
    dec.p.send_signal(signal.SIGKILL)
    dec.p.wait()
    check(eu.wait_until(lambda: both() == ("NOT_SERVING", 503), 10),
          "the only decode instance killed: gRPC NOT_SERVING and HTTP 503 (%s)" % (both(),))
    dec2 = H.start("pdserve-decode", *dec_args, tag="decode-2")
    check(eu.wait_until(lambda: both() == ("SERVING", 200), 15),
          "a decode instance back on the address: gRPC SERVING and HTTP 200 again (%s)" % (both(),))
    H.stop([r, dec2])  # (the first decode instance was killed on purpose)
except Exception:
    H.kill_all()
    raise
H.finish()
