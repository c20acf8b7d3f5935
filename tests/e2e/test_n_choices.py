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
  - a choice that ends early at a stop string stops on the decode instance too (the router's
    Decode.EndChoice): n = 4, 64 tokens each, a stop string that only choice 0's text holds,
    within its first tokens: while the other three go on, the decode instance runs 3
    sequences, it counts one ended choice (pdserve_engine_choices_ended_total), and it decodes
    about 3 x 63 tokens where the same call without the stop decodes 4 x 63; the other
    choices' tokens are those of the call without the stop
  - pdserve-cli generate --n 3 --json: one JSON line per choice; greedy, each equals the n = 1
    output; seeded temperature, choice i equals pdserve-cli --n 1 --seed s + i (tokens, text,
    logprobs with --logprobs 2); text mode prints "[choice i] " and the text per choice
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
import json, os, subprocess, sys, threading, time

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


def cli(router, *args):
    """pdserve-cli generate against router; returns (exit code, stdout, stderr)."""
    r = subprocess.run([os.path.join(H.bin, "pdserve-cli"), "generate", "--addr",
                        "127.0.0.1:%d" % router.port] + list(args) + [PROMPT],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def cli_json(router, *args):
    """pdserve-cli generate --json: the list of its JSON lines (one per choice)."""
    rc, out, err = cli(router, "--json", *args)
    if rc != 0:
        print("pdserve-cli failed: %s" % err[-500:])
        return []
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def test_cli(label, router):
    """pdserve-cli --n: one JSON line per choice, the n = 1 rule for seeds, text mode."""
    one = cli_json(router, "--temperature", "0", "--max-tokens", "16", "--ignore-eos")
    three = cli_json(router, "--temperature", "0", "--max-tokens", "16", "--ignore-eos", "--n", "3")
    check(len(one) == 1 and one[0]["index"] == 0 and len(one[0]["token_ids"]) == 16 and
          [c.get("index") for c in three] == [0, 1, 2] and
          all(c["token_ids"] == one[0]["token_ids"] and c["text"] == one[0]["text"] and
              c["finish_reason"] == "length" and c["completion_tokens"] == 16 for c in three),
          "%s: pdserve-cli --n 3 --json greedy: three lines, each the --n 1 output (%r)" %
          (label, one[0]["text"][:30] if one else None))
    s = 77
    args = ["--temperature", "1", "--max-tokens", "16", "--ignore-eos", "--logprobs", "2"]
    three = cli_json(router, *args, "--n", "3", "--seed", str(s))
    singles = [cli_json(router, *args, "--seed", str(s + i)) for i in range(3)]
    same_lps = lambda a, b: len(a) == len(b) == 16 and all(
        x["token_id"] == y["token_id"] and abs(x["logprob"] - y["logprob"]) < 1e-4 and
        [t["token_id"] for t in x["top"]] == [t["token_id"] for t in y["top"]] and
        len(x["top"]) == 2
        for x, y in zip(a, b))
    check(len(three) == 3 and all(len(x) == 1 for x in singles) and
          all(three[i]["token_ids"] == singles[i][0]["token_ids"] and
              three[i]["text"] == singles[i][0]["text"] and
              same_lps(three[i]["logprobs"], singles[i][0]["logprobs"]) for i in range(3)) and
          len({tuple(x[0]["token_ids"]) for x in singles}) > 1,
          "%s: pdserve-cli --n 3 --seed %d --logprobs 2: choice i equals --n 1 --seed %d + i "
          "(tokens, text, logprobs and alternatives)" % (label, s, s))
    rc, out, err = cli(router, *args[:-2], "--n", "3", "--seed", str(s))
    check(rc == 0 and out == "".join("[choice %d] %s\n" % (i, three[i]["text"]) for i in range(3))
          and all("[choice %d: finish length" % i in err for i in range(3)),
          "%s: pdserve-cli --n 3 in text mode: '[choice i] ' and each choice's text, a summary "
          "line each on stderr" % label)


def test_stop_ends_choice(label, stub, dec):
    """A choice ended by a stop string stops decoding on the decode instance."""
    s, mt = 31, 64
    samp = pb.SamplingParams(temperature=1.0, seed=s)
    longer = pb.StoppingCriteria(max_tokens=mt, ignore_eos=True)
    g0 = eu.Scrape(dec.mport).get("pdserve_engine_generation_tokens_total")
    base = gen_n(stub, prompt=PROMPT, sampling=samp, stopping=longer, n=4)
    base_tokens = eu.Scrape(dec.mport).get("pdserve_engine_generation_tokens_total") - g0
    # a piece of choice 0's first 40 characters that no other choice's text holds
    text0, others = base[0]["text"], [base[i]["text"] for i in (1, 2, 3)]
    stop = next((text0[a:a + n] for a in range(4, 40) for n in (6, 8, 10, 12)
                 if text0[a:a + n].strip() and len(text0[a:a + n]) == n and
                 all(text0[a:a + n] not in o for o in others)), None)
    check(stop is not None, "%s: a stop string early in choice 0 only: %r" % (label, stop))
    if stop is None:
        return
    m0 = eu.Scrape(dec.mport)
    e0 = m0.get("pdserve_engine_choices_ended_total")
    g0 = m0.get("pdserve_engine_generation_tokens_total")
    out, three_running, others_going = {}, False, False
    req = pb.GenerateRequest(prompt=PROMPT, sampling=samp, n=4, stopping=pb.StoppingCriteria(
        max_tokens=mt, ignore_eos=True, stop=[stop]))
    for r in stub.Generate(req, timeout=120):
        c = out.setdefault(r.index, {"ids": [], "text": "", "fin": 0})
        c["ids"] += list(r.token_ids)
        c["text"] += r.text
        if r.finish_reason:
            c["fin"] = r.finish_reason
        if r.index == 0 and r.finish_reason:
            # the three others go on (about 50 tokens at >= 15 ms a step); the decode instance
            # runs only them from now on
            three_running = eu.wait_until(
                lambda: eu.Scrape(dec.mport).get("pdserve_sequences_running") == 3, 10)
            others_going = not any(out.get(i, {}).get("fin") for i in (1, 2, 3))
    m1 = eu.Scrape(dec.mport)
    ended, tokens = m1.get("pdserve_engine_choices_ended_total") - e0, \
        m1.get("pdserve_engine_generation_tokens_total") - g0
    k0 = len(out.get(0, {}).get("ids", []))
    check(out.get(0, {}).get("fin") == pb.FINISH_REASON_STOP and stop not in out[0]["text"] and
          text0.startswith(out[0]["text"] + stop) and k0 < 24,
          "%s: choice 0 ends at the stop string %r after %d tokens" % (label, stop, k0))
    check(all(out.get(i, {}).get("ids") == base[i]["ids"] and len(base[i]["ids"]) == mt and
              out[i]["fin"] == pb.FINISH_REASON_LENGTH for i in (1, 2, 3)),
          "%s: choices 1 - 3 give the tokens of the call without the stop" % label)
    check(three_running and others_going,
          "%s: once choice 0 stopped, the decode instance runs the 3 other choices only, while "
          "they go on" % label)
    check(ended == 1 and tokens <= 3 * (mt - 1) + k0 + 20 and tokens < base_tokens - 20,
          "%s: the decode instance ended one choice (pdserve_engine_choices_ended_total +%g) and "
          "decoded %g tokens (without the stop: %g)" % (label, ended, tokens, base_tokens))


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

    test_stop_ends_choice(label, stub, dec)
    test_cli(label, router)

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
