#!/usr/bin/python3
"""test_cancel_storm.py -- Cancellations and deadlines by the hundred never hang the router
or crash an instance (issue #26). Against a disaggregated stack (prefill + decode + router)
and a colocated one (decode --colocated + router), each round sends, from many client threads
of Python grpcio at once:
  - short streams (max_tokens 1 - 3) cancelled at a random time, so that many cancels land
    next to their completion (the router deadlock: a finish waiting for the cancel callback
    while holding the request's mutex);
  - streams of 3 - 8 tokens cancelled at a random time (the decode instance's use after free);
  - streams of 1 - 64 tokens with random deadlines;
  - streams of n = 4 choices of 4 - 48 tokens with stop strings that end choices at different
    tokens (the router ends each such choice on the decode instance, Decode.EndChoice, while
    the others go on), cancelled at a random time, with a random deadline, or read to the end
    (then every choice ends with exactly one final message).
  Times are log-uniform in [1 ms, STORM_SPAN_MS (default 500 ms)].
After every round: a new request through the router completes within 1 s, the router's
requests in flight return to 0, every KV block is free and every reservation gone on every
instance, no process died, and no process logged an error of kvtransfer's block ownership
("is held by request"). At the end the decode instance has ended choices early
(pdserve_engine_choices_ended_total). Rounds: STORM_ROUNDS (default 3); STORM_REQUESTS per
round (default 400). The soak in docs/services.md runs STORM_ROUNDS=1000.

usage: test_cancel_storm.py BIN_DIR SHARED_DIR PROTO_DIR"""
import math, os, random, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv, log_level="warn")
pb, pbg = H.pb, H.pbg
import grpc

ROUNDS = int(os.environ.get("STORM_ROUNDS", "3"))
N_REQ = int(os.environ.get("STORM_REQUESTS", "400"))
THREADS = 48
SPAN = float(os.environ.get("STORM_SPAN_MS", "500")) / 1000.0
# Stop strings of the n = 4 streams: some end a choice within a token or two, some rarely.
STOPS = [["e"], ["a", "o"], [" the"], ["."], ["he", "!"], ["and"]]

def storm(stub, rng):
    """One round of N_REQ requests; returns a dict of outcome counts."""
    lock = threading.Lock()
    outcomes = {}
    jobs = []
    for i in range(N_REQ):
        kind = rng.random()
        prompt = [1] + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 40))]
        # Log-uniform times, so that cancels land before, at and after completion whatever
        # the machine's speed (about half the requests complete on 2 cores).
        t = math.exp(rng.uniform(math.log(0.001), math.log(SPAN)))
        if kind < 0.34:   # ends right next to the cancel
            jobs.append((prompt, rng.randint(1, 3), "cancel", t, 1, []))
        elif kind < 0.64:
            jobs.append((prompt, rng.randint(3, 8), "cancel", t, 1, []))
        elif kind < 0.85:
            jobs.append((prompt, rng.randint(1, 64), "deadline", t, 1, []))
        else:             # n = 4, choices ending at stop strings while the others go on
            jobs.append((prompt, rng.randint(4, 48), rng.choice(["cancel", "deadline", "end"]), t,
                         4, rng.choice(STOPS)))
    it = iter(jobs)

    def worker():
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            prompt, max_tokens, how, t, n, stop = job
            req = pb.GenerateRequest(prompt_token_ids=prompt, n=n,
                                     sampling=pb.SamplingParams(temperature=0.8),
                                     stopping=pb.StoppingCriteria(max_tokens=max_tokens,
                                                                  ignore_eos=True, stop=stop))
            finals = {}
            try:
                if how == "cancel":
                    call = stub.Generate(req, timeout=30)
                    threading.Timer(t, call.cancel).start()
                else:
                    call = stub.Generate(req, timeout=30 if how == "end" else t)
                for r in call:
                    if r.finish_reason:
                        finals[r.index] = finals.get(r.index, 0) + 1
                code = "OK"
                if n > 1 and finals != {i: 1 for i in range(n)}:
                    code = "OK_BAD_FINALS"  # a choice without exactly one final message
            except grpc.RpcError as e:
                code = e.code().name
            if n > 1:
                code = "n4_" + code
            with lock:
                outcomes[code] = outcomes.get(code, 0) + 1

    ths = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return outcomes

def quiet(router, instances):
    """Everything returned to rest: in flight 0, KV blocks free, no reservations."""
    s = eu.Scrape(router.mport)
    if s.get("pdserve_requests_in_flight") != 0:
        return False
    for p in instances:
        m = eu.Scrape(p.mport)
        if m.get("pdserve_kv_cache_used_blocks") != 0 or m.get("pdserve_sequences_running") != 0:
            return False
        if m.get("pdserve_sequences_waiting") != 0 or m.get("pdserve_kv_transfers_active") != 0:
            return False
        if m.has("pdserve_kv_reservations") and m.get("pdserve_kv_reservations") != 0:
            return False
    return True

def describe(router, instances):
    s = eu.Scrape(router.mport)
    out = ["router in flight %g" % s.get("pdserve_requests_in_flight")]
    for p in instances:
        m = eu.Scrape(p.mport)
        out.append("port %d: used %g running %g waiting %g xfers %g reservations %g" % (
            p.port, m.get("pdserve_kv_cache_used_blocks"), m.get("pdserve_sequences_running"),
            m.get("pdserve_sequences_waiting"), m.get("pdserve_kv_transfers_active"),
            m.get("pdserve_kv_reservations")))
    return "; ".join(out)

def run(label, router, instances, seed):
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % router.port))
    probe = pb.GenerateRequest(prompt_token_ids=[1, 400, 300, 200],
                               sampling=pb.SamplingParams(temperature=0),
                               stopping=pb.StoppingCriteria(max_tokens=2, ignore_eos=True))
    rng = random.Random(seed)
    clean = 0
    for k in range(ROUNDS):
        t0 = time.time()
        out = storm(stub, rng)
        dt = time.time() - t0
        # The router still answers, at once.
        t1 = time.time()
        try:
            n = sum(len(r.token_ids) for r in stub.Generate(probe, timeout=1.0))
            answered = n == 2
        except grpc.RpcError as e:
            answered, n = False, e.code().name
        t_probe = time.time() - t1
        rest = eu.wait_until(lambda: quiet(router, instances), 15)
        alive = all(p.p.poll() is None for p in [router] + instances)
        bad_logs = [p.log for p in [router] + instances if "is held by request" in open(p.log).read()]
        bad_finals = out.get("n4_OK_BAD_FINALS", 0)
        ok = answered and rest and alive and not bad_logs and not bad_finals
        clean += ok
        if not ok or k == 0 or k == ROUNDS - 1 or (k + 1) % 50 == 0:
            print("%s round %d: %d requests in %.1f s %s; probe %s in %.3f s; at rest %s; "
                  "alive %s" % (label, k + 1, N_REQ, dt, sorted(out.items()), n, t_probe, rest,
                                alive), flush=True)
        if not ok:
            if not rest:
                try:
                    print("  not at rest: " + describe(router, instances))
                except Exception as e:  # a process that died has no /metrics
                    print("  not at rest; cannot scrape: %s" % e)
            for l in bad_logs:
                print("  %s logged a block held by another request" % l)
            if bad_finals:
                print("  %d n = 4 calls ended OK without one final message per choice" % bad_finals)
            break
    H.check(clean == ROUNDS, "%s: %d of %d storm rounds clean (the router answered within 1 s, "
          "nothing in flight, every KV block free, no process died, every n = 4 call that ended "
          "OK had one final message per choice)" % (label, clean, ROUNDS))
    dec = instances[0]
    ended = eu.Scrape(dec.mport).get("pdserve_engine_choices_ended_total")
    H.check(ended > 0, "%s: the decode instance ended %g choices early (stop strings, "
            "Decode.EndChoice) amid the cancels" % (label, ended))

try:
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    dec = H.start("pdserve-decode", *common, "--kv-cache-mb", "16", tag="decode")
    pre = H.start("pdserve-prefill", *common, tag="prefill")
    rtr = H.start("pdserve-router", *common[:4], "--metrics-port", "0", "--prefill",
                  "127.0.0.1:%d" % pre.port, "--decode", "127.0.0.1:%d" % dec.port,
                  "--shutdown-grace-ms", "5000", tag="router")
    run("disaggregated", rtr, [dec, pre], 1)
    H.stop([rtr, pre, dec])
    col = H.start("pdserve-decode", *common, "--colocated", "--kv-cache-mb", "16", tag="colocated")
    rtr2 = H.start("pdserve-router", *common[:4], "--metrics-port", "0", "--decode",
                   "127.0.0.1:%d" % col.port, "--shutdown-grace-ms", "5000", tag="router2")
    run("colocated", rtr2, [col], 2)
    H.stop([rtr2, col])
finally:
    H.kill_all()
H.finish()
