#!/usr/bin/python3
"""test_stack.py -- The disaggregated stack end to end, driven by Python grpcio (a client
nobody here wrote): pdserve-prefill + pdserve-decode + pdserve-router on loopback, and a
colocated pdserve-decode behind a second router. Checks golden stories260k text through both,
concurrency, streaming order, stop strings, cancellation freeing KV blocks, bad input, instance
death, and SIGTERM drain.

usage: test_stack.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, signal, subprocess, sys, tempfile, threading, time, json

BIN, SHARED, PROTO = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = os.path.join(SHARED, "models", "stories260k")
if not os.path.isdir(MODEL):
    print("no shared data: skip"); sys.exit(77)
try:
    import grpc
except ImportError:
    print("python3-grpcio missing: skip"); sys.exit(77)

TMP = tempfile.mkdtemp(prefix="pdserve-e2e-")
subprocess.check_call(["protoc", "-I" + PROTO, "--python_out=" + TMP, "--grpc_python_out=" + TMP,
                       "--plugin=protoc-gen-grpc_python=" + subprocess.check_output(["which", "grpc_python_plugin"]).decode().strip(),
                       "pdserve/v1/generation.proto", "pdserve/internal/v1/kv.proto",
                       "pdserve/internal/v1/instance.proto", "grpc/health/v1/health.proto"], cwd=PROTO)
sys.path.insert(0, TMP)
from pdserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pbg
from pdserve.internal.v1 import instance_pb2 as ipb, instance_pb2_grpc as ipbg
import importlib.util
_spec = importlib.util.spec_from_file_location("pd_health_pb2", os.path.join(TMP, "grpc/health/v1/health_pb2.py"))
hpb = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(hpb)  # "grpc.health" would clash with grpcio

ENV = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PDSERVE_LOG_LEVEL="warn",
           PDSERVE_PREFILL_POLICY="remote")  # the transfer path even for short prompts
procs = []
failures = 0

def check(cond, what):
    global failures
    if cond:
        print("ok   " + what)
    else:
        failures += 1
        print("FAIL " + what)

def start(name, *args):
    log = open(os.path.join(TMP, "%s-%d.log" % (name, len(procs))), "w")
    p = subprocess.Popen([os.path.join(BIN, name)] + list(args), stdout=subprocess.PIPE,
                         stderr=log, env=ENV, text=True)
    line = p.stdout.readline()
    if not line.startswith("PORT "):
        raise SystemExit("%s did not start: %s" % (name, open(log.name).read()))
    procs.append(p)
    return p, int(line.split()[1])

def stop_all():
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()

def generate(stub, timeout=60, **kw):
    """Returns (token ids, text, finish reason, usage, number of messages)."""
    ids, text, fin, usage, n = [], "", 0, None, 0
    for r in stub.Generate(pb.GenerateRequest(**kw), timeout=timeout):
        ids += list(r.token_ids); text += r.text; n += 1
        if r.finish_reason:
            fin, usage = r.finish_reason, r.usage
    return ids, text, fin, usage, n

def status_of(fn):
    try:
        fn()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()

try:
    golden = json.load(open(os.path.join(MODEL, "golden.json")))["cases"]
    common = ["--model", MODEL, "--listen", "127.0.0.1:0", "--kv-cache-mb", "64"]
    if os.environ.get("PDSERVE_KV_STAGING") == "1":
        common += ["--log-level", "info"]
    pre, pport = start("pdserve-prefill", *common)
    pre2, pport2 = start("pdserve-prefill", *common)
    dec, dport = start("pdserve-decode", *common)
    dec2, dport2 = start("pdserve-decode", *common)
    col, cport = start("pdserve-decode", *(common + ["--colocated"]))
    rtr, rport = start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0",
                       "--prefill", "127.0.0.1:%d,127.0.0.1:%d" % (pport, pport2),
                       "--decode", "127.0.0.1:%d,127.0.0.1:%d" % (dport, dport2),
                       "--load-poll-ms", "100")
    rtr2, rport2 = start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0",
                         "--decode", "127.0.0.1:%d" % cport)
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rport))
    stub2 = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rport2))
    insts = [ipbg.InstanceStub(grpc.insecure_channel("127.0.0.1:%d" % p)) for p in (pport, pport2, dport, dport2)]
    def all_idle():
        """Every prefill and decode instance holds no block and runs nothing."""
        for s in insts:
            l = s.LoadReport(ipb.LoadReportRequest(), timeout=5)
            if l.running_seqs or l.waiting_seqs or l.free_blocks != l.total_blocks:
                return False
        return True
    def wait_idle(seconds=1.0):
        t0 = time.time()
        while time.time() - t0 < seconds:
            if all_idle():
                return True
            time.sleep(0.02)
        return all_idle()

    # Health on every process.
    for port in (pport, pport2, dport, dport2, cport, rport, rport2):
        h = grpc.insecure_channel("127.0.0.1:%d" % port).unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=hpb.HealthCheckRequest.SerializeToString,
            response_deserializer=hpb.HealthCheckResponse.FromString)
        check(h(hpb.HealthCheckRequest(service=""), timeout=5).status == hpb.HealthCheckResponse.SERVING,
              "health SERVING on port %d" % port)

    # Golden stories, disaggregated and colocated, token for token and as text.
    for name, s in (("disaggregated", stub), ("colocated", stub2)):
        for c in golden:
            kw = dict(sampling=pb.SamplingParams(temperature=0),
                      stopping=pb.StoppingCriteria(max_tokens=len(c["greedy_ids"])))
            if c["prompt"]:
                kw["prompt"] = c["prompt"]
            else:
                kw["prompt_token_ids"] = c["prompt_ids"]
            ids, text, fin, usage, n = generate(s, **kw)
            ok = ids == c["greedy_ids"] and text.strip() == c["greedy_text"].strip()
            check(ok, "%s golden %r: %d tokens, %d messages" % (name, c["prompt"], len(ids), n))
            if not ok:
                print("   got  ", ids[:12], repr(text[:80]))
                print("   want ", c["greedy_ids"][:12], repr(c["greedy_text"][:80]))
            check(usage is not None and usage.prompt_tokens == len(c["prompt_ids"]) and
                  usage.completion_tokens == len(ids), "%s usage counts" % name)

    if os.environ.get("PDSERVE_KV_STAGING") == "1":
        # The staged path (the GPU's, forced on the CPU): the decode pool is the engine's
        # cache behind a bounded ring of host slots, never a host copy of the whole cache.
        dlog = "".join(open(os.path.join(TMP, f)).read() for f in os.listdir(TMP)
                       if f.startswith("pdserve-decode-") or f.startswith("pdserve-prefill-"))
        check("staged through a ring of" in dlog and "mirror" not in dlog,
              "staged KV: the decode pool moves through a bounded ring (--kv-staging-mb)")

    # The golden tiny models (HF transformers references): disaggregated == colocated ==
    # pdserve-generate, and == the reference up to the first small top-1/top-2 margin.
    for gname in ("qwen3-tiny", "llama-tiny", "qwen2-tiny"):
        gdir = os.path.join(SHARED, "testdata", "golden", gname)
        gcases = json.load(open(os.path.join(gdir, "golden.json")))["cases"]
        gc = ["--model", gdir, "--listen", "127.0.0.1:0", "--kv-cache-mb", "32"]
        gp, gpp = start("pdserve-prefill", *gc)
        gd, gdp = start("pdserve-decode", *gc)
        gcol, gcp = start("pdserve-decode", *(gc + ["--colocated"]))
        gr, grp = start("pdserve-router", "--model", gdir, "--listen", "127.0.0.1:0",
                        "--prefill", "127.0.0.1:%d" % gpp, "--decode", "127.0.0.1:%d" % gdp)
        gr2, grp2 = start("pdserve-router", "--model", gdir, "--listen", "127.0.0.1:0",
                          "--decode", "127.0.0.1:%d" % gcp)
        gch, gch2 = grpc.insecure_channel("127.0.0.1:%d" % grp), grpc.insecure_channel("127.0.0.1:%d" % grp2)
        gs, gs2 = pbg.GenerationStub(gch), pbg.GenerationStub(gch2)
        args = [os.path.join(BIN, "pdserve-generate"), "--model", gdir, "--temperature", "0",
                "--max-tokens", "24", "--ignore-eos", "--json", "--quiet"]
        for cs in gcases:
            args += ["--prompt-ids", ",".join(map(str, cs["prompt_ids"]))]
        offline = [json.loads(l)["token_ids"] for l in subprocess.check_output(args, env=ENV, text=True).splitlines()]
        for k, cs in enumerate(gcases):
            kw = dict(prompt_token_ids=cs["prompt_ids"], sampling=pb.SamplingParams(temperature=0),
                      stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True))
            dis = generate(gs, **kw)[0]
            colo = generate(gs2, **kw)[0]
            n_ok = 0
            for i, m in enumerate(cs["greedy_margins"]):
                if m < 0.01:
                    break
                n_ok = i + 1
            ref_ok = dis[:n_ok] == cs["greedy_ids"][:n_ok]
            check(ref_ok and dis == colo == offline[k],
                  "%s prompt of %d tokens: disaggregated == colocated == pdserve-generate, "
                  "reference matched for %d steps" % (gname, len(cs["prompt_ids"]), n_ok))
        gch.close(); gch2.close()  # an idle open connection delays gRPC's server shutdown
        for p_ in (gr, gr2, gp, gd, gcol):
            p_.send_signal(signal.SIGTERM)
        check(all(p_.wait(20) == 0 for p_ in (gr, gr2, gp, gd, gcol)), "%s stack drains on SIGTERM, exit 0" % gname)

    # Tokenize matches the golden prompt ids (BOS added).
    t = stub.Tokenize(pb.TokenizeRequest(text="Once upon a time", add_special_tokens=True))
    check(list(t.token_ids) == golden[1]["prompt_ids"], "Tokenize with BOS")
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    check(info.max_model_len == 512 and info.vocab_size == 512 and list(info.eos_token_ids) == [1, 2],
          "GetModelInfo")

    # Stop strings: the text ends before the stop string, finish STOP.
    ids, text, fin, usage, n = generate(stub, prompt="Once upon a time", sampling=pb.SamplingParams(temperature=0),
                                        stopping=pb.StoppingCriteria(max_tokens=80, stop=["Lily"]))
    check(fin == pb.FINISH_REASON_STOP and text == ", there was a little girl named ",
          "stop string: %r" % text)

    # Concurrency: 24 seeded sampling requests at once equal the same requests one by one.
    reqs = [dict(prompt=p, sampling=pb.SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i),
                 stopping=pb.StoppingCriteria(max_tokens=40, ignore_eos=True))
            for i, p in enumerate(["Once upon a time", "The dog", "Lily and Tom went to the park", "Zoo"] * 6)]
    solo = [generate(stub, **r)[0] for r in reqs[:4]]
    results = [None] * len(reqs)
    def worker(i):
        results[i] = generate(stub, **reqs[i])[0]
    th = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    [x.start() for x in th]; [x.join() for x in th]
    check(all(results[i] == solo[i] for i in range(4)) and all(len(r) == 40 for r in results),
          "24 concurrent seeded requests equal their solo runs")
    check(len(set(tuple(r) for r in results)) > 4, "different seeds give different samples")

    # Cancellation mid-stream frees every block on prefill and decode within a second.
    check(wait_idle(), "idle before the cancel test")
    it = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], stopping=pb.StoppingCriteria(max_tokens=400, ignore_eos=True)))
    got = 0
    for r in it:
        got += 1
        if got == 5:
            it.cancel()
            break
    check(wait_idle(1.0), "cancel mid-stream: within 1 s no instance holds a block or runs it")
    # A deadline that passes mid-stream likewise.
    code, det = status_of(lambda: generate(stub, timeout=0.015, prompt_token_ids=[1],
                                           stopping=pb.StoppingCriteria(max_tokens=450, ignore_eos=True)))
    check(code == grpc.StatusCode.DEADLINE_EXCEEDED, "deadline mid-stream -> %s" % code)
    check(wait_idle(1.0), "deadline: within 1 s every block is free again")

    # 64 concurrent streams with mixed lengths.
    mixed = []
    for i in range(64):
        n = 1 + (i * 37) % 120
        mixed.append(dict(prompt_token_ids=[1] + [300 + (i * 7 + j * 13) % 200 for j in range(n)],
                          sampling=pb.SamplingParams(temperature=0),
                          stopping=pb.StoppingCriteria(max_tokens=1 + (i * 53) % 150, ignore_eos=True)))
    ref = {}
    for i in (0, 5, 17, 63):
        ref[i] = generate(stub2, **mixed[i])[0]
    res64 = [None] * 64
    def w64(i):
        try:
            res64[i] = generate(stub, **mixed[i])
        except grpc.RpcError as e:
            res64[i] = e
    th = [threading.Thread(target=w64, args=(i,)) for i in range(64)]
    [x.start() for x in th]; [x.join() for x in th]
    ok = all(not isinstance(r, grpc.RpcError) and len(r[0]) == mixed[i]["stopping"].max_tokens and
             r[2] == pb.FINISH_REASON_LENGTH for i, r in enumerate(res64))
    check(ok, "64 concurrent streams with mixed lengths complete")
    check(all(res64[i][0] == ref[i] for i in ref), "concurrent disaggregated results equal colocated ones")
    check(wait_idle(2.0), "after the 64 streams every block is free")

    # Bad input.
    bad = [
        ("both prompt and ids", dict(prompt="x", prompt_token_ids=[1])),
        ("neither prompt nor ids", dict()),
        ("negative temperature", dict(prompt="x", sampling=pb.SamplingParams(temperature=-1))),
        ("top_p 2", dict(prompt="x", sampling=pb.SamplingParams(top_p=2))),
        ("token id out of range", dict(prompt_token_ids=[1, 9999])),
        ("prompt longer than the model", dict(prompt_token_ids=[1] * 600)),
        ("max_tokens 0", dict(prompt="x", stopping=pb.StoppingCriteria(max_tokens=0))),
        ("max_tokens past the model length", dict(prompt="x", stopping=pb.StoppingCriteria(max_tokens=600))),
        ("empty stop string", dict(prompt="x", stopping=pb.StoppingCriteria(stop=[""]))),
        ("17 stop strings", dict(prompt="x", stopping=pb.StoppingCriteria(stop=["s%d" % i for i in range(17)]))),
        ("top_k -2", dict(prompt="x", sampling=pb.SamplingParams(top_k=-2))),
        ("min_p 2", dict(prompt="x", sampling=pb.SamplingParams(min_p=2))),
        ("presence_penalty 3", dict(prompt="x", sampling=pb.SamplingParams(presence_penalty=3))),
        ("repetition_penalty 0", dict(prompt="x", sampling=pb.SamplingParams(repetition_penalty=0))),
        ("empty prompt text", dict(prompt="")),
    ]
    for what, kw in bad:
        code, det = status_of(lambda: generate(stub, timeout=10, **kw))
        check(code == grpc.StatusCode.INVALID_ARGUMENT, "bad input (%s) -> %s %s" % (what, code, det))
    # Invalid UTF-8 in the prompt: raw bytes (field 2, length 3).
    raw = grpc.insecure_channel("127.0.0.1:%d" % rport).unary_stream(
        "/pdserve.v1.Generation/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    code, det = status_of(lambda: list(raw(b"\x12\x03a\xff\xfe", timeout=10)))
    check(code == grpc.StatusCode.INVALID_ARGUMENT, "invalid UTF-8 prompt -> %s %s" % (code, det))
    code, det = status_of(lambda: list(raw(b"\xff\xff\xff", timeout=10)))
    check(code == grpc.StatusCode.INVALID_ARGUMENT, "undecodable request -> %s" % code)
    unk = grpc.insecure_channel("127.0.0.1:%d" % rport).unary_unary("/pdserve.v1.Generation/Nope",
                                                                  request_serializer=lambda b: b, response_deserializer=lambda b: b)
    code, det = status_of(lambda: unk(b"", timeout=5))
    check(code == grpc.StatusCode.UNIMPLEMENTED, "unknown method -> UNIMPLEMENTED")

    # SIGTERM drains: an in-flight stream completes, the process exits 0.
    out, started = {}, threading.Event()
    def long_req():
        ids = []
        try:
            for r in stub2.Generate(pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(temperature=0),
                                                       stopping=pb.StoppingCriteria(max_tokens=300, ignore_eos=True)),
                                    timeout=60):
                ids += list(r.token_ids)
                started.set()
            out["r"] = (ids,)
        finally:
            started.set()
    t = threading.Thread(target=long_req); t.start()
    started.wait(30)  # the stream is in flight (its first tokens arrived) before the SIGTERM
    rtr2.send_signal(signal.SIGTERM)
    t.join(30)
    rc = rtr2.wait(30)
    check("r" in out and len(out["r"][0]) == 300 and rc == 0, "SIGTERM on the router drains the stream and exits 0")

    # A prefill instance killed: requests are retried on the other and succeed.
    pre.kill(); pre.wait()
    okp = True
    for i in range(4):
        ids, text, fin, usage, n = generate(stub, prompt="Once upon a time", sampling=pb.SamplingParams(temperature=0),
                                            stopping=pb.StoppingCriteria(max_tokens=80))
        okp = okp and ids == golden[1]["greedy_ids"]
    check(okp, "prefill killed: requests retried on the other prefill instance and correct")

    # A decode instance killed mid-stream: the stream moves to the other one (issue #38) and
    # completes, every token once.
    it = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(temperature=0),
                                          stopping=pb.StoppingCriteria(max_tokens=450, ignore_eos=True)), timeout=30)
    code, got, fin = None, [], 0
    try:
        for i, r in enumerate(it):
            got += list(r.token_ids)
            fin = r.finish_reason or fin
            if i == 3:  # kill the decode instance that serves this stream
                busy = [p for p, s in ((dec, insts[2]), (dec2, insts[3]))
                        if s.LoadReport(ipb.LoadReportRequest(), timeout=5).running_seqs > 0]
                (busy[0] if busy else dec).kill()
    except grpc.RpcError as e:
        code = e.code()
    ref = generate(stub, prompt_token_ids=[1], sampling=pb.SamplingParams(temperature=0),
                   stopping=pb.StoppingCriteria(max_tokens=450, ignore_eos=True))[0]
    check(code is None and len(got) == 450 and got == ref and fin == pb.FINISH_REASON_LENGTH,
          "decode killed mid-stream: the stream completes on the other instance, the same 450 "
          "tokens (%s, %d tokens)" % (code, len(got)))
    okd = True
    for i in range(3):
        ids = generate(stub, prompt="The dog", sampling=pb.SamplingParams(temperature=0),
                       stopping=pb.StoppingCriteria(max_tokens=80))[0]
        okd = okd and ids == golden[3]["greedy_ids"]
    check(okd, "after a decode instance died, the router serves from the other one")
finally:
    stop_all()
    for f in sorted(os.listdir(TMP)):
        if f.endswith(".log") and failures:
            print("--- " + f); print(open(os.path.join(TMP, f)).read()[-3000:])

print("%d failures" % failures)
sys.exit(1 if failures else 0)
