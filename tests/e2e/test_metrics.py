#!/usr/bin/python3
"""test_metrics.py -- /metrics of the three services during an end-to-end run (grpcio client):
the text parses (our parser and prometheus_client's), names follow the conventions, and the
counters and histograms move exactly as the traffic says: requests by outcome, tokens in and
out equal to what the client sent and received, one TTFT/E2E observation per request, goodput
against the router's SLO flags, decode steps = output tokens - 1 per request, KV bytes on both
sides = blocks x per-block bytes from the model's config, prefix-cache hits = the cached tokens
the client was told, queue and step histograms consistent with the step counters, gauges
showing a running sequence mid-stream and an idle engine afterwards, per-instance gauges on
the router, pdserve_draining = 1 while the router drains after SIGTERM, and the process_*
families of every service equal to what /proc says of its process.

usage: test_metrics.py BIN_DIR SHARED_DIR PROTO_DIR"""
import json, math, os, re, signal, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

BIN, SHARED, PROTO = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = os.path.join(SHARED, "models", "stories260k")
if not os.path.isdir(MODEL):
    eu.skip("no shared data")
TMP, pb, pbg, ipb, ipbg, hpb = eu.setup(PROTO)
import grpc

ENV = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PDSERVE_LOG_LEVEL="warn",
           PDSERVE_PREFILL_POLICY="remote")  # the transfer path even for short prompts
failures = 0
procs = []

def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures += 1

def start(name, *args, tag=None):
    p = eu.start(BIN, TMP, name, list(args) + ["--metrics-port", "0"], ENV, tag=tag, want_metrics=True)
    procs.append(p)
    return p

def hist_ok(s, name, **labels):
    """Buckets cumulative and non-decreasing, +Inf == _count, _sum >= 0."""
    b = sorted(((float(l["le"]), v) for l, v in s.series(name + "_bucket")
                if all(l.get(k) == w for k, w in labels.items())), key=lambda x: x[0])
    if not b or b[-1][0] != math.inf:
        return False
    mono = all(b[i][1] <= b[i + 1][1] for i in range(len(b) - 1))
    return mono and b[-1][1] == s.get(name + "_count", **labels) and s.get(name + "_sum", **labels) >= 0

PROCESS = {"process_cpu_seconds_total": "counter", "process_resident_memory_bytes": "gauge",
           "process_virtual_memory_bytes": "gauge", "process_open_fds": "gauge",
           "process_max_fds": "gauge", "process_start_time_seconds": "gauge"}

def check_process(p, name, t_before):
    """p's process_* families against /proc/<pid> (the service runs here): types, the soft
    descriptor limit, a start time about after t_before and not later than now, descriptors and
    memory within what /proc shows of the process."""
    s = eu.Scrape(p.mport)
    pid = p.p.pid
    soft = next(l.split()[3] for l in open("/proc/%d/limits" % pid) if l.startswith("Max open files"))
    n_fds = len(os.listdir("/proc/%d/fd" % pid))
    vm = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/%d/status" % pid)
          if l.startswith(("VmRSS", "VmSize", "VmHWM", "VmPeak"))}
    types_ok = all(s.types.get(n) == t for n, t in PROCESS.items())
    check(types_ok, "%s: the process_* families with their types %s" % (name, {n: s.types.get(n) for n in PROCESS}))
    if not types_ok:
        return
    fds = s.get("process_open_fds")
    check(s.get("process_max_fds") == (2.0 ** 64 - 1 if soft == "unlimited" else float(soft)),
          "%s: process_max_fds %g == soft limit %s" % (name, s.get("process_max_fds"), soft))
    check(0 < fds <= s.get("process_max_fds") and abs(fds - n_fds) <= 16,
          "%s: process_open_fds %d (/proc/%d/fd lists %d now)" % (name, fds, pid, n_fds))
    # (boot time + ticks since boot: /proc/stat's btime is whole seconds, and the clock may have
    # been stepped since the boot, so a few seconds' slack)
    check(t_before - 5 <= s.get("process_start_time_seconds") <= time.time() + 5,
          "%s: process_start_time_seconds %.2f after the test started (%.2f)" %
          (name, s.get("process_start_time_seconds"), t_before))
    rss, vsz = s.get("process_resident_memory_bytes"), s.get("process_virtual_memory_bytes")
    check(0 < rss <= vm["VmHWM"] and rss <= vsz <= vm["VmPeak"],
          "%s: process_resident_memory_bytes %d <= peak %d, virtual %d <= peak %d" %
          (name, rss, vm["VmHWM"], vsz, vm["VmPeak"]))
    check(s.get("process_cpu_seconds_total") > 0, "%s: process_cpu_seconds_total %.2f" %
          (name, s.get("process_cpu_seconds_total")))

cfg = json.load(open(os.path.join(MODEL, "config.json")))
heads = cfg["num_attention_heads"]
KV_BLOCK_BYTES = 2 * cfg["num_hidden_layers"] * 16 * cfg.get("num_key_value_heads", heads) * \
    (cfg["hidden_size"] // heads) * 4  # K and V, every layer, 16 tokens, f32 on the CPU

T_START = time.time()
try:
    common = ["--model", MODEL, "--listen", "127.0.0.1:0", "--kv-cache-mb", "32"]
    pre = start("pdserve-prefill", *common)
    dec = start("pdserve-decode", *common)
    inst = "--prefill", "127.0.0.1:%d" % pre.port, "--decode", "127.0.0.1:%d" % dec.port
    rtr = start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0", *inst,
                "--load-poll-ms", "100", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
                "--health-drain-ms", "1500", tag="router")
    # A second router with an objective nobody meets: its requests are never within the SLO.
    rtr2 = start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0", *inst,
                 "--slo-tpot-ms", "0.000001", tag="router2")
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rtr.port))
    stub2 = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rtr2.port))

    # The endpoint itself.
    status, ctype, text = eu.http_get(rtr.mport)
    check(status == 200 and ctype.startswith("text/plain; version=0.0.4"), "GET /metrics: 200, %s" % ctype)
    check(eu.http_get(rtr.mport, "/nope")[0] == 404, "GET /nope: 404")
    for p in (pre, dec, rtr):
        s = eu.Scrape(p.mport)
        names = set(s.types)
        bad = [n for n in names if not n.startswith("pdserve_") and n not in PROCESS]
        bad += [n for n, t in s.types.items() if (t == "counter") != n.endswith("_total")]
        bad += [n for n in names if re.search(r"_(ms|milliseconds|bytes_total_total)$", n)]
        check(not bad, "%s: %d families, pdserve_ prefix, _total exactly on counters %s" %
              (os.path.basename(p.log), len(names), bad or ""))

    b_r, b_r2, b_p, b_d = (eu.Scrape(p.mport) for p in (rtr, rtr2, pre, dec))

    # Traffic: 8 concurrent greedy requests of mixed sizes (ignore EOS: finish = length), the
    # same 40-token prompt twice one after the other (prefix cache), 3 on the second router.
    reqs = [dict(prompt_token_ids=[1] + [300 + (i * 11 + j * 7) % 150 for j in range(3 + i * 9)],
                 sampling=pb.SamplingParams(temperature=0),
                 stopping=pb.StoppingCriteria(max_tokens=1 + i * 13, ignore_eos=True)) for i in range(8)]
    results = [None] * 8
    def work(i):
        results[i] = eu.generate(pb, stub, **reqs[i])
    th = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in th]
    [t.join() for t in th]
    same = dict(prompt_token_ids=[1] + list(range(100, 140)), sampling=pb.SamplingParams(temperature=0),
                stopping=pb.StoppingCriteria(max_tokens=5, ignore_eos=True))
    results.append(eu.generate(pb, stub, **same))
    results.append(eu.generate(pb, stub, **same))
    r2 = [eu.generate(pb, stub2, prompt="Once upon a time", sampling=pb.SamplingParams(temperature=0),
                      stopping=pb.StoppingCriteria(max_tokens=12, ignore_eos=True)) for _ in range(3)]
    N, N2 = len(results), len(r2)
    allr = results + r2
    check(all(r[2] == pb.FINISH_REASON_LENGTH for r in allr), "%d requests finished (length)" % (N + N2))
    check(results[-1][3].cached_prompt_tokens >= 32, "the repeated prompt hit the prefix cache (%d tokens)"
          % results[-1][3].cached_prompt_tokens)

    time.sleep(0.3)  # one load-report period for the router's view
    a_r, a_r2, a_p, a_d = (eu.Scrape(p.mport) for p in (rtr, rtr2, pre, dec))
    d = lambda a, b, name, **l: a.get(name, **l) - b.get(name, **l)
    n_tok = sum(len(r[0]) for r in results)
    n_prompt = sum(r[3].prompt_tokens for r in results)
    check(d(a_r, b_r, "pdserve_requests_total", outcome="ok") == N and
          d(a_r, b_r, "pdserve_request_success_total", finish_reason="length") == N,
          "router: requests_total{ok} and success{length} +%d" % N)
    check(d(a_r, b_r, "pdserve_completion_tokens_total") == n_tok,
          "router: completion tokens +%d == tokens the client received" %
          d(a_r, b_r, "pdserve_completion_tokens_total"))
    check(d(a_r, b_r, "pdserve_prompt_tokens_total") == n_prompt,
          "router: prompt tokens +%d == usage.prompt_tokens" % n_prompt)
    for h in ("pdserve_time_to_first_token_seconds", "pdserve_e2e_request_latency_seconds"):
        check(d(a_r, b_r, h + "_count") == N and hist_ok(a_r, h), "router: %s +%d observations, buckets sane" % (h, N))
    n_multi = sum(1 for r in results if len(r[0]) >= 2)
    check(d(a_r, b_r, "pdserve_time_per_output_token_seconds_count") == n_multi and
          hist_ok(a_r, "pdserve_time_per_output_token_seconds"),
          "router: TPOT observed for the %d requests with 2+ tokens" % n_multi)
    check(a_r.get("pdserve_time_to_first_token_seconds_sum") <= a_r.get("pdserve_e2e_request_latency_seconds_sum"),
          "router: sum TTFT <= sum E2E")
    check(d(a_r, b_r, "pdserve_requests_within_slo_total") == N and a_r.get("pdserve_slo_ttft_seconds") == 60,
          "router: all %d within the loose SLO (goodput counter)" % N)
    check(d(a_r2, b_r2, "pdserve_requests_total", outcome="ok") == N2 and
          d(a_r2, b_r2, "pdserve_requests_within_slo_total") == 0,
          "router2: %d ok, 0 within an impossible TPOT objective" % N2)
    check(a_r.get("pdserve_requests_in_flight") == 0, "router: nothing in flight afterwards")
    ups = a_r.series("pdserve_router_instance_up")
    check(len(ups) == 2 and all(v == 1 for _, v in ups) and
          {l["role"] for l, _ in ups} == {"prefill", "decode"}, "router: per-instance up gauges %s" % ups)
    free = {l["role"]: v for l, v in a_r.series("pdserve_router_instance_free_kv_blocks")}
    cap = {l["role"]: v for l, v in a_r.series("pdserve_router_instance_capacity_kv_blocks")}
    check(free == cap and cap["decode"] > 0, "router: instances report every KV block free when idle")
    check(d(a_r, b_r, "pdserve_router_routed_requests_total", role="decode") == N and
          d(a_r, b_r, "pdserve_router_routed_requests_total", role="prefill") == N,
          "router: %d routed to each pool" % N)

    # Instances: outcomes, KV transfer on both sides, engine counters.
    check(d(a_p, b_p, "pdserve_requests_total", outcome="ok") == N + N2 and
          d(a_d, b_d, "pdserve_requests_total", outcome="ok") == N + N2,
          "prefill and decode: requests_total{ok} +%d" % (N + N2))
    # Decode-side prefix reuse: blocks the decode instance already held do not move.
    reused = d(a_d, b_d, "pdserve_kv_prefix_reused_tokens_total")
    check(reused % 16 == 0 and
          d(a_d, b_d, "pdserve_kv_reserved_prompt_tokens_total") == sum(r[3].prompt_tokens for r in allr),
          "decode: reserved prompt tokens counted, %d reused (whole blocks)" % reused)
    want_bytes = (sum((r[3].prompt_tokens + 15) // 16 for r in allr) - reused // 16) * KV_BLOCK_BYTES
    sb = d(a_p, b_p, "pdserve_kv_transfer_bytes_total", direction="send")
    rb = d(a_d, b_d, "pdserve_kv_transfer_bytes_total", direction="recv")
    check(sb == rb == want_bytes, "KV bytes sent %d == received %d == (blocks - reused blocks) x "
          "%d B" % (sb, rb, KV_BLOCK_BYTES))
    check(d(a_p, b_p, "pdserve_kv_transfers_total", direction="send") == N + N2 and
          d(a_d, b_d, "pdserve_kv_transfers_total", direction="recv") == N + N2 and
          d(a_p, b_p, "pdserve_kv_transfer_failures_total") == 0 and
          d(a_d, b_d, "pdserve_kv_transfer_duration_seconds_count") == N + N2 and
          d(a_p, b_p, "pdserve_kv_transfer_exposed_tail_seconds_count") == N + N2 and
          d(a_p, b_p, "pdserve_kv_transfers_by_path_total") == N + N2,
          "KV transfers: %d on each side, none failed, durations, exposed tails and paths "
          "observed" % (N + N2))
    info = a_d.series("pdserve_kv_transport_info")
    check(len(info) == 1 and info[0][0]["transport"] in ("shm", "tcp", "self", "rdma") and
          a_p.get("pdserve_kv_transfer_peers") >= 1, "KV transport exported: %s" % info)
    gen = d(a_d, b_d, "pdserve_engine_generation_tokens_total")
    check(gen == sum(len(r[0]) - 1 for r in allr), "decode: %d decode-step tokens == output - 1 per request" % gen)
    hit = d(a_p, b_p, "pdserve_prefix_cache_hit_tokens_total")
    query = d(a_p, b_p, "pdserve_prefix_cache_query_tokens_total")
    computed = d(a_p, b_p, "pdserve_engine_prompt_tokens_total")
    all_prompt = sum(r[3].prompt_tokens for r in allr)
    check(hit == sum(r[3].cached_prompt_tokens for r in allr) and hit > 0 and query == all_prompt and
          computed == query - hit, "prefill: prefix-cache hits %d of %d, computed %d" % (hit, query, computed))
    for name, a, b in (("prefill", a_p, b_p), ("decode", a_d, b_d)):
        check(d(a, b, "pdserve_request_queue_time_seconds_count") == N + N2 and
              hist_ok(a, "pdserve_request_queue_time_seconds"), "%s: queue time observed per request" % name)
        check(d(a, b, "pdserve_engine_step_duration_seconds_count") == d(a, b, "pdserve_engine_steps_total") > 0 and
              d(a, b, "pdserve_engine_batch_sequences_count") == d(a, b, "pdserve_engine_steps_total") and
              hist_ok(a, "pdserve_engine_step_duration_seconds") and hist_ok(a, "pdserve_engine_batch_sequences"),
              "%s: one step-time and batch-size observation per engine step" % name)
        check(a.get("pdserve_sequences_running") == 0 and a.get("pdserve_kv_cache_used_blocks") == 0 and
              a.get("pdserve_kv_cache_usage_ratio") == 0 and a.get("pdserve_kv_cache_free_blocks") ==
              a.get("pdserve_kv_cache_capacity_blocks") > 0, "%s: idle gauges" % name)

    for p, name in ((pre, "prefill"), (dec, "decode"), (rtr, "router")):
        check_process(p, name, T_START)

    # Mid-stream gauges, then a cancel and a bad request counted by outcome.
    it = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 5, 6], sampling=pb.SamplingParams(temperature=0),
                                          stopping=pb.StoppingCriteria(max_tokens=480, ignore_eos=True)))
    for _ in range(5):
        next(it)
    m_d, m_r = eu.Scrape(dec.mport), eu.Scrape(rtr.mport)
    check(m_d.get("pdserve_sequences_running") == 1 and m_d.get("pdserve_kv_cache_used_blocks") > 0 and
          m_r.get("pdserve_requests_in_flight") == 1, "mid-stream: 1 running (%d), KV blocks used (%d), 1 in "
          "flight (%d)" % (m_d.get("pdserve_sequences_running"), m_d.get("pdserve_kv_cache_used_blocks"),
                           m_r.get("pdserve_requests_in_flight")))
    it.cancel()
    try:
        eu.generate(pb, stub, prompt_token_ids=[1, 99999])
    except grpc.RpcError:
        pass
    time.sleep(0.5)
    c_r, c_d = eu.Scrape(rtr.mport), eu.Scrape(dec.mport)
    check(d(c_r, a_r, "pdserve_requests_total", outcome="cancelled") == 1 and
          d(c_r, a_r, "pdserve_requests_total", outcome="invalid_argument") == 1,
          "router: one cancelled, one invalid_argument")
    check(d(c_d, a_d, "pdserve_requests_total", outcome="cancelled") == 1 and c_d.get("pdserve_sequences_running") == 0,
          "decode: the cancel counted and its sequence gone")

    # Drain: pdserve_draining is 1 while health says NOT_SERVING, then the router exits 0.
    check(eu.Scrape(rtr.mport).get("pdserve_draining") == 0, "router: not draining")
    rtr.p.send_signal(signal.SIGTERM)
    time.sleep(0.4)
    check(eu.Scrape(rtr.mport).get("pdserve_draining") == 1, "router: pdserve_draining 1 after SIGTERM")
    check(rtr.p.wait(20) == 0, "router: exit 0 after the drain")
    for p in (rtr2, pre, dec):
        p.p.send_signal(signal.SIGTERM)
    check(all(p.p.wait(20) == 0 for p in (rtr2, pre, dec)), "every service exits 0 on SIGTERM")
finally:
    for p in procs:
        if p.p.poll() is None:
            p.p.kill()
            p.p.wait()
    if failures:
        for f in sorted(os.listdir(TMP)):
            if f.endswith(".log"):
                print("--- " + f)
                print(open(os.path.join(TMP, f)).read()[-3000:])

print("%d failures" % failures)
sys.exit(1 if failures else 0)
