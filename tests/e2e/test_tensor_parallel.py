#!/usr/bin/python3
"""test_tensor_parallel.py -- Tensor parallelism through the services (issue #29): a colocated
decode instance at --tensor-parallel 2 and one at 4 (ranks as threads on the CPU backend),
each behind its own router, driven by Python grpcio:
  - greedy from [1] reproduces stories260k's golden story (token ids and text);
  - eight prompts sent at once (batched prefill and decode) give the tokens of the TP 1
    instance, seeded sampling too;
  - n = 2 with logprobs 3 (the fork's copy of the partial prompt block on every rank): each
    choice equals the request alone with seed + i, tokens and logprobs, and TP 1's tokens;
  - the load report is one instance's: role colocated, the same KV pool as TP 1 (the pool of
    --kv-cache-mb is the instance's, split over the ranks), every block free afterwards;
  - what cannot run is refused at start with a message that says why and a non-zero exit:
    a model whose heads do not divide (prefill and decode-only instances at other degrees:
    test_tp_transfer.py);
  - SIGTERM: every instance exits 0.

usage: test_tensor_parallel.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, subprocess, sys, threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, check, load = H.pb, H.pbg, H.check, H.load
import grpc, json

def stack(tp):
    common = ["--model", H.model, "--backend", "cpu", "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    dec = H.start("pdserve-decode", *common, "--colocated", "--tensor-parallel", str(tp),
                  tag="colocated-tp%d" % tp)
    rtr = H.start("pdserve-router", "--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port",
                  "0", "--decode", "127.0.0.1:%d" % dec.port, tag="router-tp%d" % tp)
    return dec, pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rtr.port))

def batch(stub):
    """Eight requests at once; returns their token ids in order."""
    out = [None] * 8
    def one(k):
        sp = pb.SamplingParams(temperature=0) if k < 6 else pb.SamplingParams(temperature=0.8, seed=7 + k)
        ids, _, _, _ = eu.generate(pb, stub, timeout=60, prompt_token_ids=[1] + [(37 * k + 11 * i) % 500 + 3 for i in range(5 + 9 * k)],
                                   sampling=sp, stopping=pb.StoppingCriteria(max_tokens=40, ignore_eos=True))
        out[k] = ids
    ts = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in ts: t.start()
    for t in ts: t.join()
    return out

def choices(stub, n, seed):
    """One seeded call of n choices with logprobs 3 from a 21-token prompt (a full block of 16
    and a partial one): {index: (ids, [(logprob, [(alt id, alt logprob)])])}."""
    out = {}
    req = pb.GenerateRequest(prompt_token_ids=[1] + [(13 * i + 5) % 500 + 3 for i in range(20)], n=n,
                             logprobs=3, sampling=pb.SamplingParams(temperature=1.0, seed=seed),
                             stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True))
    for r in stub.Generate(req, timeout=60):
        ids, lps = out.setdefault(r.index, ([], []))
        ids += list(r.token_ids)
        lps += [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in r.logprobs]
    return out

def same_lps(a, b, tol=1e-4):
    return len(a) == len(b) and all(abs(x[0] - y[0]) < tol and [t for t, _ in x[1]] == [t for t, _ in y[1]]
                                    and all(abs(u - v) < tol for (_, u), (_, v) in zip(x[1], y[1]))
                                    for x, y in zip(a, b))

def refused(name, args, want):
    p = subprocess.run([os.path.join(H.bin, name)] + args, capture_output=True, text=True, timeout=60,
                       env=H.env)
    check(p.returncode not in (0,) and p.returncode < 126 and want in p.stderr,
          "%s %s refused (exit %d): %s" % (name, " ".join(args[-3:]), p.returncode, p.stderr.strip()[-160:]))

try:
    golden = json.load(open(os.path.join(H.model, "golden.json")))["cases"][0]
    d1, s1 = stack(1)
    want = batch(s1)
    check(all(len(x) == 40 for x in want), "TP 1: eight requests of 40 tokens")
    l1 = load(d1)
    want_n2 = choices(s1, 2, 11)
    for tp in (2, 4):
        dtp, stp = stack(tp)
        ids, text, fin, _ = eu.generate(pb, stp, timeout=60, prompt_token_ids=[1],
                                        sampling=pb.SamplingParams(temperature=0),
                                        stopping=pb.StoppingCriteria(max_tokens=400))
        check(ids == golden["greedy_ids"] and text == golden["greedy_text"],
              "TP %d: greedy from [1] is the golden story (%d tokens)" % (tp, len(ids)))
        got = batch(stp)
        check(got == want, "TP %d: eight concurrent requests give TP 1's tokens (greedy and seeded)" % tp)
        # n = 2 with logprobs: the partial prompt block is copied on every rank; each choice is
        # the request alone with seed + i (tokens, logprobs, alternatives), and TP 1's tokens
        got2 = choices(stp, 2, 11)
        alone = [choices(stp, 1, 11 + i).get(0, ([], [])) for i in range(2)]
        check(sorted(got2) == [0, 1] and all(len(got2[i][0]) == 24 and got2[i][0] == alone[i][0] and
                                            same_lps(got2[i][1], alone[i][1]) and len(got2[i][1]) == 24
                                            for i in range(2)),
              "TP %d: n = 2, logprobs 3: choice i equals the request alone with seed 11 + i" % tp)
        check(all(got2.get(i, ([],))[0] == want_n2.get(i, ([],))[0] for i in range(2)) and
              got2[0][0] != got2[1][0],
              "TP %d: n = 2 gives TP 1's two choices" % tp)
        l = load(dtp)
        check(l.role == H.ipb.ROLE_COLOCATED and l.total_blocks == l1.total_blocks and
              l.kv_layout.num_kv_heads == l1.kv_layout.num_kv_heads,
              "TP %d: one instance's load report, the TP 1 pool (%d blocks)" % (tp, l.total_blocks))
        check(eu.wait_until(lambda: load(dtp).free_blocks == l.total_blocks, 5),
              "TP %d: every KV block free afterwards" % tp)
    common = ["--model", H.model, "--backend", "cpu", "--listen", "127.0.0.1:0"]
    refused("pdserve-decode", common + ["--colocated", "--tensor-parallel", "3"],
            "8 attention heads do not divide among 3 ranks")
    H.stop()
except Exception:
    H.kill_all()
    raise
H.finish()
