#!/usr/bin/python3
"""test_health.py -- The router's health tells the truth (issue #38 item 4), on the CPU stack with
stories260k: gRPC grpc.health.v1 Check and HTTP /health agree: SERVING / 200 while a decode
instance is up; after kill -9 of the only decode instance both say NOT_SERVING / 503 within
the load reports' timeout plus a poll (bounded here at 10 s, no sleeps to tune); a decode
instance started again on the same address brings both back; every process exits 0 after
SIGTERM. (NOT_SERVING while draining: test_drain.py.)
And the prefill pool down (issue #38 item 2): with every prompt sent remote (--prefill-policy
remote), kill -9 of the only prefill instance; once the router sees it down, 100-token prompts
are computed on the decode instance (pdserve_router_prefill_decisions_total{why="prefill_down"})
and give the tokens they gave through the prefill instance; health stays SERVING.

usage: test_health.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, signal, socket, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
check = H.check
import grpc

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

    # The prefill pool down: prompts fall back to the decode instance.
    common = ["--model", H.model, "--backend", "cpu", "--listen", "127.0.0.1:0", "--metrics-port", "0",
              "--kv-cache-mb", "16"]
    pre = H.start("pdserve-prefill", *common, tag="prefill")
    dec3 = H.start("pdserve-decode", *common, tag="decode-3")
    r2 = H.start("pdserve-router", "--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                 "--prefill", "127.0.0.1:%d" % pre.port, "--decode", "127.0.0.1:%d" % dec3.port,
                 "--load-poll-ms", "100", "--prefill-policy", "remote", tag="router-2")
    stub = H.pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % r2.port))
    prompts = [[1] + [(37 * k + 11 * i) % 500 + 3 for i in range(100)] for k in range(3)]
    def gen(ids):
        return eu.generate(H.pb, stub, timeout=30, prompt_token_ids=ids,
                           sampling=H.pb.SamplingParams(temperature=0),
                           stopping=H.pb.StoppingCriteria(max_tokens=8, ignore_eos=True))[0]
    before = [gen(p) for p in prompts]
    dec_remote = lambda: eu.Scrape(r2.mport).get("pdserve_router_prefill_decisions_total",
                                                 where="remote", why="forced") or 0
    check(dec_remote() >= 3, "prompts computed by the prefill instance first (%s)" % dec_remote())
    pre.p.send_signal(signal.SIGKILL)
    pre.p.wait()
    down = lambda: (eu.Scrape(r2.mport).get("pdserve_router_instance_up", role="prefill") or 0) == 0
    check(eu.wait_until(down, 10), "the router sees the prefill instance down")
    after = [gen(p) for p in prompts]
    n_down = eu.Scrape(r2.mport).get("pdserve_router_prefill_decisions_total", where="local",
                                     why="prefill_down") or 0
    check(after == before and n_down >= 3,
          "the prefill pool down: the decode instance computes the prompts, the same tokens "
          "(%d decisions prefill_down)" % n_down)
    check(grpc_state(r2) == "SERVING", "health stays SERVING (a decode instance can serve)")
    H.stop([r2, dec3])
except Exception:
    H.kill_all()
    raise
H.finish()
