#!/usr/bin/python3
"""test_engine_failure.py -- Health comes from the engine (issue #26). An instance whose engine
steps fail (a sticky device error, injected with PDSERVE_FAULT_FAIL_STEPS_AFTER) must not stay
SERVING and keep attracting work:
  - the failed step's requests end UNAVAILABLE on the instance (counted so in its /metrics),
    and the router moves them to the healthy instance (issue #38): every client succeeds with
    all its tokens, and the router counts the migrations or retries;
  - the instance's grpc.health.v1 Check says NOT_SERVING, its load report says failed (and
    draining, for routers that predate the field), /metrics counts the step failures;
  - the router stops routing to it: every later request succeeds on the healthy instance;
  - the same for a prefill instance.

usage: test_engine_failure.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, hpb, check, load, health = H.pb, H.pbg, H.hpb, H.check, H.load, H.health
import grpc

def gen(stub, k):
    try:
        ids, _, fin, _ = eu.generate(pb, stub, timeout=20, prompt_token_ids=[1, 100 + k, 200, 300],
                                     sampling=pb.SamplingParams(temperature=0),
                                     stopping=pb.StoppingCriteria(max_tokens=6, ignore_eos=True))
        return "OK", len(ids), ""
    except grpc.RpcError as e:
        return e.code().name, 0, e.details()

def scenario(label, bad, good_list, rtr):
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rtr.port))
    results = [gen(stub, k) for k in range(12)]
    codes = [c for c, _, _ in results]
    print("%s: %s" % (label, codes))
    check(all(c == "OK" and n == 6 for c, n, _ in results),
          "%s: every request succeeds, those of the failed step moved elsewhere (%s)"
          % (label, [d for c, _, d in results if c != "OK"][:2]))
    lost = eu.Scrape(bad.mport).get("pdserve_requests_total", outcome="unavailable")
    check(lost >= 1, "%s: the failed step's requests end UNAVAILABLE on the instance, not "
          "CANCELLED or INTERNAL (%d)" % (label, lost))
    m = eu.Scrape(rtr.mport)
    moved = m.get("pdserve_router_migrations_total") + m.get("pdserve_router_retries_total")
    check(moved >= 1, "%s: the router counts the requests it moved (%d)" % (label, moved))
    check(health(bad) == hpb.HealthCheckResponse.NOT_SERVING, "%s: health says NOT_SERVING" % label)
    l = load(bad)
    check(l.failed and l.draining, "%s: the load report says failed" % label)
    check(eu.Scrape(bad.mport).get("pdserve_engine_step_failures_total") >= 1,
          "%s: /metrics counts the step failures" % label)
    for g in good_list:
        check(health(g) == hpb.HealthCheckResponse.SERVING, "%s: the healthy instance stays SERVING" % label)
    time.sleep(0.5)  # a load poll or two
    later = [gen(stub, 100 + k) for k in range(10)]
    check(all(c == "OK" and n == 6 for c, n, _ in later),
          "%s: the router routes every later request to the healthy instance (%s)"
          % (label, [c for c, _, _ in later]))
    check(bad.p.poll() is None, "%s: the failed instance did not crash" % label)

try:
    MODEL, ENV = H.model, H.env
    common = ["--model", MODEL, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    # Colocated: instance A fails every forward after its 5th.
    bad = H.start("pdserve-decode", *common, "--colocated", tag="colocated-bad",
                env=dict(ENV, PDSERVE_FAULT_FAIL_STEPS_AFTER="5"))
    good = H.start("pdserve-decode", *common, "--colocated", tag="colocated-good")
    rtr = H.start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                "--decode", "127.0.0.1:%d,127.0.0.1:%d" % (bad.port, good.port),
                "--load-poll-ms", "100", tag="router-colocated")
    scenario("colocated", bad, [good], rtr)

    # Disaggregated: a failing prefill instance next to a healthy one.
    dec = H.start("pdserve-decode", *common, tag="decode")
    pbad = H.start("pdserve-prefill", *common, tag="prefill-bad",
                 env=dict(ENV, PDSERVE_FAULT_FAIL_STEPS_AFTER="2"))
    pgood = H.start("pdserve-prefill", *common, tag="prefill-good")
    rtr2 = H.start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                 "--prefill", "127.0.0.1:%d,127.0.0.1:%d" % (pbad.port, pgood.port),
                 "--decode", "127.0.0.1:%d" % dec.port, "--load-poll-ms", "100", tag="router-disagg")
    scenario("prefill", pbad, [pgood, dec], rtr2)
    check(eu.wait_until(lambda: eu.Scrape(dec.mport).get("pdserve_kv_cache_used_blocks") == 0 and
                        eu.Scrape(pbad.mport).get("pdserve_kv_transfers_active", direction="send") == 0, 5),
          "prefill: every decode KV block is free afterwards, and no transfer of the failed "
          "prefill instance lingers")
    H.stop()
finally:
    H.kill_all()
H.finish()
