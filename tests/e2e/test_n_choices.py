#!/usr/bin/python3
"""test_n_choices.py -- GenerateRequest.n (issue #30): several samples of one prompt that share
its KV. Through router -> prefill -> decode and through a colocated decode instance
(stories260k, the real services on loopback, Python grpcio as the client):

  - n = 3 greedy: three choices, each equal to the single request (n = 1) of the same prompt;
    every message names its choice (index), each choice ends with one message that carries
    its finish reason and its own usage
  - n = 3, temperature 1, seed s: choice i equals the single request with seed s + i (tokens,
    finish, per-token logprobs); with a stop string, each choice ends at it on its own
  - n = 2 with logprobs 3: each choice's tokens carry the logprobs and alternatives of the
    single request with seed s + i, its first token's (sampled where the prompt was computed)
    included
  - sharing: on decode instances without a prefix cache (so that only the fork shares), the
    KV blocks in use while an n = 3 request of a 200-token prompt runs (decode steps slowed
    with PDSERVE_FAULT_STEP_DELAY_MS) stay below those of 3 separate requests of the same
    prompt run at the same time, by about two copies of the prompt's full blocks; the
    decode instance counts the fork and the copied partial blocks (/metrics)
  - cancelling an n = 3 call mid-stream frees every block: the instances' KV blocks in use go
    back to 0 (metrics and load reports)
  - n = 17 is INVALID_ARGUMENT naming n; n = 0 is one choice; every process exits 0 after
    SIGTERM (leak-free under ASan)

usage: test_n_choices.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv, log_level="warn")
pb, pbg, check = H.pb, H.pbg, H.check
import grpc

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def gen_n(stub, **kw):
    """One Generate call; returns {index: {ids, text, fin, usage, lps, n_final}}."""
    out = {}
    for r in stub.Generate(pb.GenerateRequest(**kw), timeout=120):
        c = out.setdefault(r.index, {"ids": [], "text": "", "fin": 0, "usage": None, "lps": [],
                                     "tops": [], "n_final": 0, "after_final": 0})
        if c["fin"]:
            c["after_final"] += 1
        c["ids"] += list(r.token_ids)
        c["text"] += r.text
        c["lps"] += [lp.logprob for lp in r.logprobs]
        c["tops"] += [[(t.token_id, t.logprob) for t in lp.top] for lp in r.logprobs]
        if r.finish_reason:
            c["fin"], c["usage"] = r.finish_reason, r.usage
            c["n_final"] += 1
    return out


def used_blocks(p):
    return eu.Scrape(p.mport).get("pdserve_kv_cache_used_blocks")


def peak_while(p, fn):
    """Runs fn() in a thread and samples p's KV blocks in use until it returns; the peak."""
    peak, done = [0], threading.Event()
    err = []

    def run():
        try:
            fn()
        except Exception as e:  # reported below
            err.append(e)
        finally:
            done.set()
    t = threading.Thread(target=run)
    t.start()
    while not done.is_set():
        peak[0] = max(peak[0], used_blocks(p))
        time.sleep(0.01)
    t.join()
    if err:
        raise err[0]
    return peak[0]


def idle(ps):
    return all(used_blocks(p) == 0 and H.load(p).free_blocks == H.load(p).total_blocks for p in ps)


def run_stack(label, router, dec, insts):
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % router.port))
    prompt_ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=True)).token_ids)
    stop24 = pb.StoppingCriteria(max_tokens=24, ignore_eos=True)

    # greedy: three identical choices, each the single request
    one = gen_n(stub, prompt=PROMPT, sampling=pb.SamplingParams(temperature=0), stopping=stop24)
    three = gen_n(stub, prompt=PROMPT, sampling=pb.SamplingParams(temperature=0), stopping=stop24, n=3)
    check(sorted(one) == [0] and sorted(three) == [0, 1, 2],
          "%s: n = 3 streams choices 0, 1, 2 (n = 1: only index 0)" % label)
    check(all(three.get(i, {}).get("ids") == one[0]["ids"] and len(one[0]["ids"]) == 24 and
              three[i]["text"] == one[0]["text"] for i in range(3)),
          "%s: n = 3 greedy: every choice equals the single request (%r)" % (label, one[0]["text"][:40]))
    check(all(c["n_final"] == 1 and c["after_final"] == 0 and c["fin"] == pb.FINISH_REASON_LENGTH and
              c["usage"].completion_tokens == 24 and c["usage"].prompt_tokens == len(prompt_ids)
              for c in three.values()),
          "%s: each choice ends with one final message with its own usage (%d + 24 tokens)" %
          (label, len(prompt_ids)))

    # temperature 1, seed s: choice i = the single request with seed s + i
    s = 1234
    samp = lambda seed: pb.SamplingParams(temperature=1.0, seed=seed)
    three = gen_n(stub, prompt=PROMPT, sampling=samp(s), stopping=stop24, n=3, logprobs=1)
    singles = [gen_n(stub, prompt=PROMPT, sampling=samp(s + i), stopping=stop24, logprobs=1)[0]
               for i in range(3)]
    check(all(three.get(i, {}).get("ids") == singles[i]["ids"] and three[i]["text"] == singles[i]["text"]
              for i in range(3)),
          "%s: n = 3, seed %d: choice i equals the single request with seed %d + i" % (label, s, s))
    check(all(len(three[i]["lps"]) == 24 and
              all(abs(a - b) < 1e-4 for a, b in zip(three[i]["lps"], singles[i]["lps"])) for i in range(3)),
          "%s: n = 3: each choice's logprobs equal its single request's" % label)
    check(len({tuple(c["ids"]) for c in singles}) > 1, "%s: the three seeds give different samples" % label)
    # logprobs with alternatives: n = 2, logprobs 3: each choice's tokens (the first one, from
    # the instance that computed the prompt, included) carry the logprob and the 3 alternatives
    # of the request alone with seed + i
    two = gen_n(stub, prompt=PROMPT, sampling=samp(21), stopping=stop24, n=2, logprobs=3)
    alone = [gen_n(stub, prompt=PROMPT, sampling=samp(21 + i), stopping=stop24, logprobs=3)[0]
             for i in range(2)]
    same_tops = lambda a, b: len(a) == len(b) and all(
        len(x) == 3 and [t for t, _ in x] == [t for t, _ in y] and
        all(abs(u - v) < 1e-4 for (_, u), (_, v) in zip(x, y)) for x, y in zip(a, b))
    check(sorted(two) == [0, 1] and
          all(two[i]["ids"] == alone[i]["ids"] and len(two[i]["lps"]) == 24 and
              all(abs(a - b) < 1e-4 for a, b in zip(two[i]["lps"], alone[i]["lps"])) and
              same_tops(two[i]["tops"], alone[i]["tops"]) for i in range(2)),
          "%s: n = 2, logprobs 3: each choice's logprobs and alternatives (first token included) "
          "equal the request alone with seed 21 + i" % label)
    check(two[0]["ids"] != two[1]["ids"] and same_tops(two[0]["tops"][:1], two[1]["tops"][:1]),
          "%s: n = 2: the choices differ; their first tokens share one distribution (the same "
          "alternatives)" % label)
    # stop strings end each choice on its own
    stop = pb.StoppingCriteria(max_tokens=48, stop=[" the"])
    three = gen_n(stub, prompt=PROMPT, sampling=samp(7), stopping=stop, n=3)
    singles = [gen_n(stub, prompt=PROMPT, sampling=samp(7 + i), stopping=stop)[0] for i in range(3)]
    check(all(three.get(i, {}).get("text") == singles[i]["text"] and three[i]["fin"] == singles[i]["fin"] and
              " the" not in three[i]["text"] for i in range(3)),
          "%s: n = 3 with a stop string: each choice ends where its single request does (%s)" %
          (label, [pb.FinishReason.Name(c["fin"]) for c in singles]))

    # sharing: a 200-token prompt, n = 3 against 3 separate requests at the same time
    long_ids = (prompt_ids * 20)[:200]
    slow = pb.StoppingCriteria(max_tokens=48, ignore_eos=True)
    forks0 = eu.Scrape(dec.mport).get("pdserve_engine_forks_total")
    copies0 = eu.Scrape(dec.mport).get("pdserve_engine_fork_copied_blocks_total")
    got = {}
    peak_n3 = peak_while(dec, lambda: got.update(gen_n(stub, prompt_token_ids=long_ids, sampling=samp(5),
                                                       stopping=slow, n=3)))
    sep = {}

    def separate():
        ts = [threading.Thread(target=lambda i=i: sep.update({i: gen_n(
            stub, prompt_token_ids=long_ids, sampling=samp(5 + i), stopping=slow)[0]})) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    peak_sep = peak_while(dec, separate)
    full = 200 // 16  # the prompt's full blocks (block size 16), shared by the choices
    check(all(got.get(i, {}).get("ids") == sep.get(i, {}).get("ids") and len(got[i]["ids"]) == 48
              for i in range(3)),
          "%s: the long prompt: n = 3 gives the three separate requests' tokens" % label)
    check(peak_sep >= 2 * (full + 1) and peak_n3 <= peak_sep - 2 * full + 2,
          "%s: KV blocks in use on the decode instance: n = 3 peaks at %d, 3 separate requests at %d "
          "(the prompt's %d full blocks held once instead of three times)" % (label, peak_n3, peak_sep, full))
    d = eu.Scrape(dec.mport)
    check(d.get("pdserve_engine_forks_total") - forks0 >= 1 and
          d.get("pdserve_engine_fork_copied_blocks_total") - copies0 >= 2,
          "%s: the decode instance forked the request and copied the partial block for choices 1 "
          "and 2 (pdserve_engine_forks_total, pdserve_engine_fork_copied_blocks_total)" % label)

    # cancel mid-stream: every block freed
    it = stub.Generate(pb.GenerateRequest(prompt_token_ids=long_ids, sampling=samp(9), n=3,
                                          stopping=pb.StoppingCriteria(max_tokens=250, ignore_eos=True)),
                       timeout=120)
    seen = set()
    for r in it:
        seen.add(r.index)
        if len(seen) == 3 and used_blocks(dec) > 0:
            break
    busy = used_blocks(dec)
    it.cancel()
    check(eu.wait_until(lambda: idle(insts), 10),
          "%s: cancelling an n = 3 call mid-stream (%d blocks in use) frees every block" % (label, busy))

    # bounds
    try:
        gen_n(stub, prompt=PROMPT, n=17)
        check(False, "%s: n = 17 is refused" % label)
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "n" in e.details(),
              "%s: n = 17 -> INVALID_ARGUMENT (%s)" % (label, e.details()))
    zero = gen_n(stub, prompt=PROMPT, sampling=pb.SamplingParams(temperature=0), stopping=stop24, n=0)
    check(sorted(zero) == [0] and zero[0]["ids"] == one[0]["ids"], "%s: n = 0 is one choice" % label)
    check(eu.wait_until(lambda: idle(insts), 10), "%s: afterwards no block is held" % label)


try:
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    slow_env = dict(H.env, PDSERVE_FAULT_STEP_DELAY_MS="15")
    # No prefix cache on the decode side: blocks are shared only by the fork.
    dec = H.start("pdserve-decode", *common, "--no-prefix-cache", tag="decode", env=slow_env)
    pre = H.start("pdserve-prefill", *common, tag="prefill")
    router = H.start("pdserve-router", *common, "--prefill", "127.0.0.1:%d" % pre.port,
                     "--decode", "127.0.0.1:%d" % dec.port, "--prefill-policy", "remote", tag="router")
    colo = H.start("pdserve-decode", *common, "--colocated", "--no-prefix-cache", tag="colocated",
                   env=slow_env)
    crouter = H.start("pdserve-router", *common, "--decode", "127.0.0.1:%d" % colo.port,
                      tag="router-colocated")
    run_stack("disaggregated", router, dec, (dec, pre))
    run_stack("colocated", crouter, colo, (colo,))
    H.stop()
finally:
    H.kill_all()
H.finish()
