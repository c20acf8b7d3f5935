#!/usr/bin/python3
"""test_drain.py -- SIGTERM under load loses no request (grpcio client). A stack of two
prefill, two decode instances and a router; while streams run: a decode instance is told to
drain (its streams finish, new requests go to the other one), then a prefill instance, then
the router itself. Every client gets its complete answer (token for token what the same
request gave on an idle stack), every drained process exits 0 well within its grace period
with no call cancelled, and health says NOT_SERVING during the drain. Last, a router whose
grace period is too short for its streams cancels them, frees every KV block on the decode
side, and still exits 0.

usage: test_drain.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, signal, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

BIN, SHARED, PROTO = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = os.path.join(SHARED, "models", "stories260k")
if not os.path.isdir(MODEL):
    eu.skip("no shared data")
TMP, pb, pbg, ipb, ipbg, hpb = eu.setup(PROTO)
import grpc

ENV = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PDSERVE_LOG_LEVEL="info",
           PDSERVE_PREFILL_POLICY="remote")  # the transfer path even for short prompts
GRACE_MS = 20000
failures = 0
procs = []

def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures += 1

def start(name, *args, tag=None):
    p = eu.start(BIN, TMP, name, list(args), ENV, tag=tag)
    procs.append(p)
    return p

def load(p):
    ch = grpc.insecure_channel("127.0.0.1:%d" % p.port)
    try:
        return ipbg.InstanceStub(ch).LoadReport(ipb.LoadReportRequest(), timeout=5)
    finally:
        ch.close()

def health(port):
    ch = grpc.insecure_channel("127.0.0.1:%d" % port)
    try:
        h = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=hpb.HealthCheckRequest.SerializeToString,
                           response_deserializer=hpb.HealthCheckResponse.FromString)
        return h(hpb.HealthCheckRequest(service=""), timeout=2).status
    except grpc.RpcError as e:
        return e.code()
    finally:
        ch.close()

def wait_until(cond, seconds):
    t0 = time.time()
    while time.time() - t0 < seconds:
        if cond():
            return True
        time.sleep(0.01)
    return cond()

PROMPTS = [[1] + [200 + (k * 31 + j * 17) % 250 for j in range(5 + 20 * k)] for k in range(4)]
def req(k, max_tokens=160):
    return dict(prompt_token_ids=PROMPTS[k % 4], sampling=pb.SamplingParams(temperature=0),
                stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))

class Load:
    """Runs requests on threads; .results[i] = token ids or the RpcError; .started counts the
    streams that received their first message (the server has them)."""
    def __init__(self, stub):
        self.stub, self.results, self.threads, self.started = stub, {}, [], set()
    def add(self, i, **kw):
        def run():
            try:
                ids = []
                for r in self.stub.Generate(pb.GenerateRequest(**kw), timeout=60):
                    self.started.add(i)
                    ids += list(r.token_ids)
                self.results[i] = ids
            except grpc.RpcError as e:
                self.results[i] = "%s: %s" % (e.code(), e.details())
        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)
    def join(self):
        for t in self.threads:
            t.join(90)

def drain_and_time(p):
    t0 = time.time()
    p.p.send_signal(signal.SIGTERM)
    return t0

try:
    common = ["--model", MODEL, "--listen", "127.0.0.1:0", "--kv-cache-mb", "32",
              "--health-drain-ms", "600", "--shutdown-grace-ms", str(GRACE_MS)]
    p1, p2 = start("pdserve-prefill", *common, tag="p1"), start("pdserve-prefill", *common, tag="p2")
    d1, d2 = start("pdserve-decode", *common, tag="d1"), start("pdserve-decode", *common, tag="d2")
    rtr = start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0", "--load-poll-ms", "100",
                "--prefill", "127.0.0.1:%d,127.0.0.1:%d" % (p1.port, p2.port),
                "--decode", "127.0.0.1:%d,127.0.0.1:%d" % (d1.port, d2.port),
                "--health-drain-ms", "300", "--shutdown-grace-ms", str(GRACE_MS), tag="router")
    chan = grpc.insecure_channel("127.0.0.1:%d" % rtr.port)
    stub = pbg.GenerationStub(chan)
    ref = [eu.generate(pb, stub, **req(k))[0] for k in range(4)]
    check(all(len(r) == 160 for r in ref), "references: 4 prompts, 160 greedy tokens each")

    def verify(ld, n, what):
        bad = [i for i in range(n) if not isinstance(ld.results.get(i), list) or ld.results[i] != ref[i % 4]]
        check(not bad, "%s: %d of %d streams complete and exact%s" %
              (what, n - len(bad), n, "" if not bad else " (bad: %s)" % [str(ld.results.get(i))[:200] for i in bad[:3]]))

    # 1. A decode instance drains under load.
    ld = Load(stub)
    for i in range(16):
        ld.add(i, **req(i))
    check(wait_until(lambda: load(d1).running_seqs > 0 and load(d2).running_seqs > 0, 10),
          "decode drain: both decode instances are running streams")
    t0 = drain_and_time(d1)
    time.sleep(0.05)
    check(health(d1.port) == hpb.HealthCheckResponse.NOT_SERVING, "decode drain: d1 health NOT_SERVING")
    check(load(d1).draining, "decode drain: d1 reports draining in its load report")
    for i in range(16, 24):  # new work during the drain goes elsewhere
        ld.add(i, **req(i))
        time.sleep(0.03)
    ld.join()
    rc = d1.p.wait(GRACE_MS / 1000 + 5)
    dt = time.time() - t0
    verify(ld, 24, "decode drain")
    log = open(d1.log).read()
    check(rc == 0 and dt < GRACE_MS / 1000 and "drained; 0 calls cancelled" in log,
          "decode drain: d1 exits %d after %.1f s, 0 calls cancelled" % (rc, dt))

    # 2. A prefill instance drains under load (long prompts keep it busy).
    ld = Load(stub)
    for i in range(16):
        ld.add(i, **req(i))
    time.sleep(0.02)
    t0 = drain_and_time(p1)
    for i in range(16, 24):
        ld.add(i, **req(i))
        time.sleep(0.03)
    ld.join()
    rc = p1.p.wait(GRACE_MS / 1000 + 5)
    dt = time.time() - t0
    verify(ld, 24, "prefill drain")
    check(rc == 0 and dt < GRACE_MS / 1000 and "drained; 0 calls cancelled" in open(p1.log).read(),
          "prefill drain: p1 exits %d after %.1f s, 0 calls cancelled" % (rc, dt))

    # 3. The router drains under load: its streams finish, then it exits 0.
    ld = Load(stub)
    for i in range(16):
        ld.add(i, **req(i))
    # Every stream must have reached the router before it stops listening (a call that arrives
    # after that is refused, which is what a drain means; that is not under test here).
    check(wait_until(lambda: len(ld.started) == 16, 20), "router drain: streams running")
    t0 = drain_and_time(rtr)
    time.sleep(0.05)
    check(health(rtr.port) == hpb.HealthCheckResponse.NOT_SERVING, "router drain: health NOT_SERVING")
    ld.join()
    rc = rtr.p.wait(GRACE_MS / 1000 + 5)
    dt = time.time() - t0
    verify(ld, 16, "router drain")
    check(rc == 0 and dt < GRACE_MS / 1000 and "drained; 0 calls cancelled" in open(rtr.log).read(),
          "router drain: exits %d after %.1f s, 0 calls cancelled" % (rc, dt))
    chan.close()
    check(wait_until(lambda: load(d2).free_blocks == load(d2).total_blocks and load(d2).running_seqs == 0, 2),
          "after the drains every KV block on d2 is free")

    # 4. A grace period too short: the rest is cancelled, blocks freed, exit 0 all the same.
    r2 = start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0", "--load-poll-ms", "100",
               "--prefill", "127.0.0.1:%d" % p2.port, "--decode", "127.0.0.1:%d" % d2.port,
               "--shutdown-grace-ms", "100", tag="router-short")
    chan2 = grpc.insecure_channel("127.0.0.1:%d" % r2.port)
    ld = Load(pbg.GenerationStub(chan2))
    for i in range(8):
        ld.add(i, **req(i, max_tokens=480 - len(PROMPTS[i % 4])))
    check(wait_until(lambda: load(d2).running_seqs > 0, 10), "short grace: streams running")
    t0 = drain_and_time(r2)
    ld.join()
    rc = r2.p.wait(10)
    dt = time.time() - t0
    n_done = sum(1 for v in ld.results.values() if isinstance(v, list))
    n_err = sum(1 for v in ld.results.values() if isinstance(v, str))  # "CODE: details"
    check(rc == 0 and dt < 5 and n_done + n_err == 8,
          "short grace: exit %d after %.1f s; %d complete, %d ended with an error, none hung" % (rc, dt, n_done, n_err))
    chan2.close()
    check(wait_until(lambda: load(d2).free_blocks == load(d2).total_blocks and load(d2).running_seqs == 0, 3),
          "short grace: every KV block on d2 is free again")
    for p in (p2, d2):
        p.p.send_signal(signal.SIGTERM)
    check(all(p.p.wait(20) == 0 for p in (p2, d2)), "remaining instances exit 0")
finally:
    for p in procs:
        if p.p.poll() is None:
            p.p.kill()
            p.p.wait()
    if failures:
        for f in sorted(os.listdir(TMP)):
            if f.endswith(".log"):
                print("--- " + f)
                print(open(os.path.join(TMP, f)).read()[-2500:])

print("%d failures" % failures)
sys.exit(1 if failures else 0)
