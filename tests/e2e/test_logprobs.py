#!/usr/bin/python3
"""test_logprobs.py -- Logprobs end to end (issue #30): every GenerateResponse carries one
TokenLogprob per token id when the request asks (none when it does not), with the request's
number of alternatives; they describe the raw model distribution, so

- on the golden tiny models (HF transformers' float64 logits, ../shared/testdata/golden), the
  first token's logprob and its top 5 equal log_softmax(last_logits) within 1e-2 (ids and
  values), whether the first token comes from a prefill instance (router -> prefill ->
  decode) or from a colocated decode instance;
- every later token's logprob is consistent with its list: sorted, the greedy token first,
  the sampled token's entry equal to its logprob, no alternative likelier than the list's
  first; temperature and penalties do not change the values (the raw distribution);
- the same tokens and values wherever the prompt was computed (stories260k);
- logprobs above 20 is INVALID_ARGUMENT.

usage: test_logprobs.py BIN_DIR SHARED_DIR PROTO_DIR"""
import json, math, os, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, check = H.pb, H.pbg, H.check
import grpc

def run(router, logprobs, temperature=0.0, prompt=None, ids=None, max_tokens=20, **samp):
    """Returns (ids, [TokenLogprob], bad messages)."""
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % router.port))
    kw = dict(prompt_token_ids=ids) if ids is not None else dict(prompt=prompt or "Once upon a time")
    out, lps, bad = [], [], 0
    for r in stub.Generate(pb.GenerateRequest(logprobs=logprobs, **kw,
                                              sampling=pb.SamplingParams(temperature=temperature, seed=5, **samp),
                                              stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)),
                           timeout=60):
        if logprobs and (len(r.logprobs) != len(r.token_ids) or
                         any(lp.token_id != t or len(lp.top) != logprobs for lp, t in zip(r.logprobs, r.token_ids))):
            bad += 1
        out += list(r.token_ids)
        lps += list(r.logprobs)
    return out, lps, bad

def consistent(ids, lps, greedy):
    """Each token's list is sorted, its own entry (when listed) is its logprob, and a greedy
    token is the list's first. Returns the number of violations."""
    bad = 0
    for t, lp in zip(ids, lps):
        top = [(a.token_id, a.logprob) for a in lp.top]
        if any(top[i][1] < top[i + 1][1] for i in range(len(top) - 1)):
            bad += 1
        if not (math.isfinite(lp.logprob) and lp.logprob <= 1e-6):
            bad += 1
        for a, v in top:
            if a == t and v != lp.logprob:
                bad += 1
        if top and lp.logprob > top[0][1] + 1e-6:
            bad += 1
        if greedy and top and top[0][0] != t:
            bad += 1
    return bad

def log_softmax(xs):
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]

def first_matches(lp, ref, n=5, tol=1e-2):
    """The first token's TokenLogprob against the reference log-softmax: the chosen token's
    value, and the top n ids and values (an id may trade places with a neighbour whose
    reference value is within tol). Returns (ok, detail)."""
    order = sorted(range(len(ref)), key=lambda i: (-ref[i], i))[:n]
    top = [(a.token_id, a.logprob) for a in lp.top][:n]
    ok = len(top) == n and abs(lp.logprob - ref[lp.token_id]) <= tol
    for j, (a, v) in enumerate(top):
        want_id, want_v = order[j], ref[order[j]]
        ok = ok and abs(v - want_v) <= tol and abs(ref[a] - v) <= tol and \
            (a == want_id or abs(ref[a] - want_v) <= tol)
    return ok, "got %s chosen %d %.5f; reference %s" % (
        [(a, round(v, 5)) for a, v in top], lp.token_id, lp.logprob,
        [(i, round(ref[i], 5)) for i in order])

try:
    # The golden tiny models: remote prefill (first token from the prefill instance) and
    # colocated (a decode instance computing the prompt itself).
    for gname in ("llama-tiny", "qwen3-tiny", "qwen2-tiny"):
        gdir = os.path.join(H.shared, "testdata", "golden", gname)
        cases = json.load(open(os.path.join(gdir, "golden.json")))["cases"]
        gc = ["--model", gdir, "--listen", "127.0.0.1:0", "--metrics-port", "0", "--kv-cache-mb", "32"]
        gd = H.start("pdserve-decode", *gc, tag=gname + "-decode")
        gp = H.start("pdserve-prefill", *gc, tag=gname + "-prefill")
        gcol = H.start("pdserve-decode", *gc, "--colocated", tag=gname + "-colocated")
        rc = ["--model", gdir, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
        rdis = H.start("pdserve-router", *rc, "--prefill", "127.0.0.1:%d" % gp.port,
                       "--decode", "127.0.0.1:%d" % gd.port, "--prefill-policy", "remote",
                       tag=gname + "-router")
        rcol = H.start("pdserve-router", *rc, "--decode", "127.0.0.1:%d" % gcol.port,
                       tag=gname + "-router-colocated")
        for k, cs in enumerate(cases):
            ref = log_softmax(cs["last_logits"])
            for where, router in (("router -> prefill -> decode", rdis), ("colocated", rcol)):
                ids, lps, bad = run(router, 5, ids=cs["prompt_ids"], max_tokens=8)
                ok, detail = first_matches(lps[0], ref) if lps else (False, "no logprobs")
                check(len(lps) == len(ids) == 8 and bad == 0 and ok,
                      "%s case %d (%d prompt tokens), %s: first token's logprob and top 5 = "
                      "log_softmax(reference logits) within 1e-2 (%s)" % (gname, k, len(cs["prompt_ids"]), where, detail))
                check(consistent(ids, lps, True) == 0,
                      "%s case %d, %s: greedy tokens first in their sorted lists, own entries equal" % (gname, k, where))
            # Sampling with temperature and penalties: the values are still the raw model's
            # (the first token's equal the reference; the lists stay consistent).
            ids, lps, bad = run(rdis, 20, temperature=1.3, ids=cs["prompt_ids"], max_tokens=8, top_k=5,
                                presence_penalty=1.5, repetition_penalty=1.4)
            ok, detail = first_matches(lps[0], ref) if lps else (False, "no logprobs")
            check(bad == 0 and ok and consistent(ids, lps, False) == 0,
                  "%s case %d: temperature 1.3, top-k 5 and penalties leave the logprobs raw; "
                  "20 alternatives, sampled tokens' entries equal (%s)" % (gname, k, detail))
        H.stop([rdis, rcol, gp, gd, gcol])

    # stories260k: the same tokens and values wherever the prompt was computed.
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    dec = H.start("pdserve-decode", *common, tag="decode")
    pre = H.start("pdserve-prefill", *common, tag="prefill")
    inst = ["--prefill", "127.0.0.1:%d" % pre.port, "--decode", "127.0.0.1:%d" % dec.port]
    remote = H.start("pdserve-router", *common, *inst, "--prefill-policy", "remote", tag="router-remote")
    local = H.start("pdserve-router", *common, *inst, "--prefill-policy", "local", tag="router-local")
    for temp in (0.0, 0.8):
        r_ids, r_lps, r_bad = run(remote, 3, temp)
        l_ids, l_lps, l_bad = run(local, 3, temp)
        check(len(r_ids) == 20 and len(r_lps) == 20 and r_bad == 0,
              "T=%.1f remote prefill: one logprob with 3 alternatives per token, in every message (%d of %d)" % (temp, len(r_lps), len(r_ids)))
        check(len(l_lps) == 20 and l_bad == 0, "T=%.1f local prefill: the same" % temp)
        check(consistent(r_ids, r_lps, temp == 0.0) == 0, "T=%.1f: consistent lists" % temp)
        same = r_ids == l_ids and all(abs(a.logprob - b.logprob) < 1e-4 and
                                      [t.token_id for t in a.top] == [t.token_id for t in b.top]
                                      for a, b in zip(r_lps, l_lps))
        check(same, "T=%.1f: the same tokens, logprobs and alternatives wherever the prompt was computed" % temp)
    ids, lps, _ = run(remote, 0)
    check(len(ids) == 20 and lps == [], "logprobs 0: none sent")
    ids, lps, bad = run(remote, 20, max_tokens=4)
    check(bad == 0 and len(lps) == 4 and all(len(l.top) == 20 for l in lps), "logprobs 20: 20 alternatives a token")
    try:
        run(remote, 21)
        check(False, "logprobs 21 is refused")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 20" in e.details(),
              "logprobs 21: INVALID_ARGUMENT (%s)" % e.details())
    H.stop([remote, local, pre, dec])
finally:
    H.kill_all()
H.finish()
