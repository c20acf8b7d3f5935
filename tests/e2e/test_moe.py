#!/usr/bin/python3
"""test_moe.py -- Mixture-of-experts models through the services on the CPU backend (issue #39),
with the goldens of tests/data/golden-moe (no tokenizer: prompts as ids):
  - disaggregated (every prompt computed by the prefill instance, its KV pushed over UCX to the
    decode instance), each golden prompt's greedy tokens are HF transformers' up to the first
    step whose reference top-1/top-2 margin is under 0.01 (the goldens' margin rule);
  - a colocated instance at tensor parallel degree 2 gives the same tokens;
  - every KV block is free afterwards and the instances exit 0 on SIGTERM.

usage: test_moe.py BIN_DIR SHARED_DIR PROTO_DIR"""
import json, os, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, check, load = H.pb, H.pbg, H.check, H.load
import grpc

GOLD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "golden-moe")


def run_cases(stub, cases):
    """Each case's prompt alone, greedy, as many tokens as the reference has."""
    out = []
    for c in cases:
        ids, _, _, _ = eu.generate(pb, stub, timeout=120, prompt_token_ids=c["prompt_ids"],
                                   sampling=pb.SamplingParams(temperature=0),
                                   stopping=pb.StoppingCriteria(max_tokens=len(c["greedy_ids"]),
                                                                ignore_eos=True))
        out.append(ids)
    return out


def margin_ok(got, cases):
    """Returns (tokens compared, first difference or None) under the margin rule."""
    compared = 0
    for k, (ids, c) in enumerate(zip(got, cases)):
        if len(ids) != len(c["greedy_ids"]):
            return compared, "prompt %d: %d tokens" % (k, len(ids))
        for i, (a, b) in enumerate(zip(ids, c["greedy_ids"])):
            if c["greedy_margins"][i] < 0.01:
                break
            if a != b:
                return compared, "prompt %d step %d: %d, reference %d" % (k, i, a, b)
            compared += 1
    return compared, None


def router(model, tag, *extra, **kw):
    args = ["--model", model, "--listen", "127.0.0.1:0", "--metrics-port", "0",
            "--load-poll-ms", "100", *extra]
    for k, p in kw.items():
        args += ["--" + k, "127.0.0.1:%d" % p.port]
    r = H.start("pdserve-router", *args, tag=tag)
    return r, pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % r.port))


try:
    for name in ("qwen3-moe-tiny", "mixtral-tiny"):
        model = os.path.join(GOLD, name)
        cases = json.load(open(os.path.join(model, "golden.json")))["cases"]
        common = ["--model", model, "--backend", "cpu", "--listen", "127.0.0.1:0",
                  "--metrics-port", "0", "--kv-cache-mb", "16"]
        pre = H.start("pdserve-prefill", *common, tag="prefill-" + name)
        dec = H.start("pdserve-decode", *common, tag="decode-" + name)
        r, s = router(model, "router-" + name, "--prefill-policy", "remote", prefill=pre, decode=dec)
        got = run_cases(s, cases)
        n, bad = margin_ok(got, cases)
        check(bad is None and n > 0,
              "%s disaggregated: greedy tokens as HF's (%d compared) %s" % (name, n, bad or ""))
        lp, ld = load(pre), load(dec)
        check(eu.wait_until(lambda: load(pre).free_blocks == lp.total_blocks and
                            load(dec).free_blocks == ld.total_blocks, 5),
              "%s disaggregated: every KV block free afterwards" % name)
        H.stop([r, pre, dec])

        col = H.start("pdserve-decode", *common, "--colocated", "--tensor-parallel", "2",
                      tag="colocated-tp2-" + name)
        rc, sc = router(model, "router-colocated-" + name, decode=col)
        check(run_cases(sc, cases) == got,
              "%s colocated at TP 2: the disaggregated tokens" % name)
        H.stop([rc, col])
except Exception:
    H.kill_all()
    raise
H.finish()
