#!/usr/bin/python3
"""test_migrate.py -- Nothing lost when a decode instance dies or freezes (issue #38), on the CPU
stack with stories260k: one prefill and two decode instances (every step slowed by
PDSERVE_FAULT_STEP_DELAY_MS, so that streams are long), a router with --max-migrations.

The same 200 gRPC streams (greedy and seeded, some with n = 2, logprobs or a stop string) and
a few OpenAI HTTP streams run once unfaulted, then again while one decode instance is
  - killed with SIGKILL once every stream has its first token ("kill"), or
  - frozen with SIGSTOP for 10 s ("stop"; the router must see the stall by itself: its load
    reports stop, and migrate the streams), then continued with SIGCONT;
The same for the only prefill instance ("prefill-kill", "prefill-stop"; prefill slowed and
fed 256 tokens a step, so that prompts wait there at the fault): the prompts move to the
decode instances (the prefill pool is down); after SIGCONT a prefill instance that had
transfers in flight blames no peer for its own freeze (its deadlines wait: "ran ... late").
Every stream must complete with exactly the unfaulted tokens, text, finish reason and usage
(the client sees one stream: nothing missing or repeated), the router must count the
migrations, and afterwards every KV block is free on the surviving instances (a SIGCONT'ed
instance frees the requests the router cancelled on it). The largest gap between two messages
of a stream is printed (not asserted: no timing in tests).

usage: test_migrate.py BIN_DIR SHARED_DIR PROTO_DIR [kill|stop|prefill-kill|prefill-stop ...]"""
import http.client, json, os, signal, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv[:4])
pb, pbg, check = H.pb, H.pbg, H.check
import grpc

SCENARIOS = sys.argv[4:] or ["kill", "stop", "prefill-kill", "prefill-stop"]
N = 200
N_HTTP = 8
MAX_TOKENS = 40

def request(i):
    prompt = [1 + (i * 37 + k * 11) % 500 for k in range(4 + i % 60)]
    seeded = i % 2 == 1
    kw = dict(prompt_token_ids=prompt,
              sampling=pb.SamplingParams(temperature=0.9 if seeded else 0.0,
                                         **({"seed": 1000 + i} if seeded else {})),
              stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True,
                                           stop=["Tim"] if i % 9 == 0 else []),
              n=2 if i % 10 == 3 else 1, logprobs=2 if i % 7 == 0 else 0)
    return kw

def run_stream(stub, i, out, progress):
    """out[i] = (per-choice token ids, texts, finish reasons, completion tokens, logprob
    lists, largest gap between messages) or ("error", code, details)."""
    ids, text, fin, comp, lps = {}, {}, {}, {}, {}
    gap, t_last = 0.0, None
    try:
        for r in stub.Generate(pb.GenerateRequest(**request(i)), timeout=120):
            t = time.time()
            if t_last is not None and r.token_ids:
                gap = max(gap, t - t_last)
            if r.token_ids:
                t_last = t
            c = r.index
            ids.setdefault(c, []).extend(r.token_ids)
            text[c] = text.get(c, "") + r.text
            lps.setdefault(c, []).extend(l.logprob for l in r.logprobs)
            if r.finish_reason:
                fin[c], comp[c] = r.finish_reason, r.usage.completion_tokens
            progress[i] = sum(len(v) for v in ids.values())
        out[i] = (ids, text, fin, comp, lps, gap)
    except grpc.RpcError as e:
        out[i] = ("error", e.code().name, e.details())
    progress[i] = -1  # over

def run_http(port, k, out):
    """An OpenAI streaming completion: its concatenated text and finish reason."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"prompt": [1 + (k * 13 + j) % 400 for j in range(10 + k)], "max_tokens": MAX_TOKENS,
                "temperature": 0.7, "seed": 77 + k, "stream": True, "ignore_eos": True}
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = c.getresponse()
        text, fin = "", None
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            text += ch.get("text", "")
            fin = ch.get("finish_reason") or fin
        out[k] = (resp.status, text, fin)
    except Exception as e:  # noqa: BLE001 -- reported as a failed stream
        out[k] = ("error", str(e), None)

def run_all(rtr_port, http_port, fault=None, early=False):
    """Runs every stream at once; fault(progress) is called once every gRPC stream has its
    first token (or ended), or with early once any has. Returns (grpc results, http results,
    what fault returned)."""
    ch = grpc.insecure_channel("127.0.0.1:%d" % rtr_port)
    stub = pbg.GenerationStub(ch)
    out, progress, hout = [None] * N, [0] * N, [None] * N_HTTP
    ths = [threading.Thread(target=run_stream, args=(stub, i, out, progress)) for i in range(N)]
    ths += [threading.Thread(target=run_http, args=(http_port, k, hout)) for k in range(N_HTTP)]
    for t in ths:
        t.start()
    got = None
    if fault:
        eu.wait_until(lambda: any(p != 0 for p in progress) if early
                      else all(p != 0 for p in progress), 60)
        got = fault(progress)
    for t in ths:
        t.join(180)
    ch.close()
    return out, hout, got

def free_blocks_back(procs):
    return all(eu.Scrape(p.mport).get("pdserve_kv_cache_used_blocks") == 0 for p in procs)

def scenario(name):
    fails0 = H.failures
    try:
        run_scenario(name)
    finally:
        if H.failures > fails0:  # the logs say why
            for f in sorted(os.listdir(H.tmp)):
                if f.endswith(".log") and name in f:
                    lines = [l for l in open(os.path.join(H.tmp, f)) if " W request " not in l]
                    print("--- %s (tail)\n%s" % (f, "".join(lines[-30:])))

def run_scenario(name):
    common = ["--model", H.model, "--backend", "cpu", "--listen", "127.0.0.1:0", "--metrics-port", "0",
              "--kv-cache-mb", "64"]
    slow = dict(H.env, PDSERVE_FAULT_STEP_DELAY_MS="40")
    on_prefill = name.startswith("prefill")
    pre = H.start("pdserve-prefill", *common,
                  *(["--max-num-batched-tokens", "256"] if on_prefill else []), tag="prefill-" + name,
                  env=dict(H.env, PDSERVE_FAULT_STEP_DELAY_MS="300") if on_prefill else None)
    victim = pre if on_prefill else None
    d1 = H.start("pdserve-decode", *common, tag="decode1-" + name, env=slow)
    d2 = H.start("pdserve-decode", *common, tag="decode2-" + name, env=slow)
    victim = victim or d1
    frozen = name.endswith("stop")
    rtr = H.start("pdserve-router", "--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                  "--prefill", "127.0.0.1:%d" % pre.port,
                  "--decode", "127.0.0.1:%d,127.0.0.1:%d" % (d1.port, d2.port),
                  "--load-poll-ms", "100", "--max-migrations", "3", "--http-listen", "127.0.0.1:0",
                  tag="router-" + name)
    line = rtr.p.stdout.readline()
    http_port = int(line.split()[1])
    ref, href, _ = run_all(rtr.port, http_port)
    bad = [i for i in range(N) if ref[i] is None or ref[i][0] == "error"]
    check(not bad, "%s: unfaulted, every stream completes (%s)" % (name, [ref[i] for i in bad[:3]]))
    check(all(h and h[0] == 200 for h in href), "%s: unfaulted, every HTTP stream completes (%s)"
          % (name, href[:2]))

    def fault(progress):
        running = sum(1 for p in progress if p > 0)
        waiting = sum(1 for p in progress if p == 0)
        if frozen:
            victim.p.send_signal(signal.SIGSTOP)
        else:
            victim.p.send_signal(signal.SIGKILL)
            victim.p.wait()
        return running, waiting, time.time()

    out, hout, (running, waiting, t_fault) = run_all(rtr.port, http_port, fault, early=on_prefill)
    print("%s: at the fault %d streams had tokens and were going, %d had none yet"
          % (name, running, waiting))
    if frozen:
        # the frozen instance's work went elsewhere while it slept: continue it
        time.sleep(max(0.0, 10 - (time.time() - t_fault)))
        victim.p.send_signal(signal.SIGCONT)
    errs = [(i, out[i]) for i in range(N) if out[i] is None or out[i][0] == "error"]
    check(not errs, "%s: all %d streams complete (%d failed: %s)" % (name, N, len(errs), errs[:3]))
    def same(a, b):
        # tokens, text, finish reasons and usage exactly; logprobs to 1e-3 (a resumed stream's
        # context is computed as a prompt there: the same model, another summation order)
        return a[:4] == b[:4] and a[4].keys() == b[4].keys() and all(
            len(a[4][c]) == len(b[4][c]) and all(abs(x - y) <= 1e-3 for x, y in zip(a[4][c], b[4][c]))
            for c in a[4])
    diff = [i for i in range(N) if out[i] and out[i][0] != "error" and ref[i][0] != "error"
            and not same(out[i], ref[i])]
    check(not diff, "%s: every stream equals the unfaulted run: tokens, text, finish reason, "
          "usage, logprobs (%d differ: %s)" % (name, len(diff),
                                                [(i, out[i][:5], ref[i][:5]) for i in diff[:2]]))
    check(hout == href, "%s: every OpenAI HTTP stream equals the unfaulted run (%s vs %s)"
          % (name, hout[:1], href[:1]))
    m = eu.Scrape(rtr.mport)
    moved = sum(v for _, v in m.series("pdserve_router_migrations_total"))
    print("%s: %d migrations %s; largest gap between tokens of a stream: %.3f s" % (
        name, moved, m.series("pdserve_router_migrations_total"),
        max(o[5] for o in out if o and o[0] != "error")))
    check(moved >= 1, "%s: the router counts the streams it moved (pdserve_router_migrations_total "
          "= %d)" % (name, moved))
    survivors = [p for p in (pre, d1, d2) if frozen or p is not victim]
    check(eu.wait_until(lambda: free_blocks_back(survivors), 20),
          "%s: every KV block is free afterwards on %d instances" % (name, len(survivors)))
    if frozen:
        check(victim.p.poll() is None, "%s: the frozen instance runs on after SIGCONT" % name)
        ok = eu.generate(pb, pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rtr.port)),
                         timeout=60, **request(4))[0]
        check(ok == ref[4][0][0], "%s: the router serves again after SIGCONT" % name)
    if name == "prefill-stop":  # (only when a transfer was in flight at the SIGSTOP)
        late = "late (frozen or starved)" in open(victim.log).read()
        print("prefill-stop: the prefill instance %s its own freeze" % ("noticed" if late else
                                                                        "had no transfer deadline at"))
    H.stop([rtr] + survivors)

try:
    for s in SCENARIOS:
        scenario(s)
except Exception:
    H.kill_all()
    raise
H.finish()
