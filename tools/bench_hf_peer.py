#!/usr/bin/env python3
"""bench_hf_peer.py -- The offline throughput workload of pdserve-bench-offline run on HF
transformers, as a peer measured on the same GPU in the same run (issue #8).

The model is built from a shape's config.json with random weights (no download: the GPU
machine reaches nothing), bf16 on CUDA. The requests are the first N of pdserve-bench-offline's
workload for the same --seed and lengths (its xorshift generator is reproduced here), so the
two rates compare like with like: random prompt ids, output lengths drawn per request, greedy,
EOS never stops a request. Two methods:
  cb        transformers' continuous batching (init_continuous_batching: a paged KV cache and
            per-request max_new_tokens), when the installed version has it;
  generate  padded model.generate() over batches of the largest size that fits, every request
            of a batch run to the batch's longest output (min_new_tokens = max_new_tokens);
            only each request's own output length counts as useful tokens.
The run is bounded by --time-budget (generation time; no new work starts after it) and by
--num-requests. Prints the method, requests done, output tokens and tokens/s; --json prints
one JSON object as the last line.

  python3 tools/bench_hf_peer.py --model tools/shapes/qwen3-0.6b --num-requests 64
"""
import argparse
import inspect
import json
import os
import sys
import time

M64 = (1 << 64) - 1


def workload(n, in_lo, in_hi, out_lo, out_hi, seed, vocab):
    """The first n requests of pdserve-bench-offline --seed seed: [(prompt ids, output len)]."""
    rs = (seed * 0x9E3779B97F4A7C15 + 0x1234567) & M64

    def rnd():
        nonlocal rs
        rs ^= (rs << 13) & M64
        rs ^= rs >> 7
        rs ^= (rs << 17) & M64
        return rs

    reqs = []
    for _ in range(n):
        n_prompt = in_lo + rnd() % (in_hi - in_lo + 1)
        prompt = [rnd() % vocab for _ in range(n_prompt)]
        n_out = out_lo + rnd() % (out_hi - out_lo + 1)
        reqs.append((prompt, n_out))
    return reqs


def span(s):
    a, _, b = s.partition(":")
    lo, hi = int(a), int(b or a)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError("expected N or A:B with 1 <= A <= B")
    return lo, hi


def log(*a):
    print("bench_hf_peer:", *a, file=sys.stderr, flush=True)


def build_model(shape_dir, torch, transformers):
    """Random bf16 weights of the shape on the GPU, initialised there (fast, no host copy)."""
    cfg = transformers.AutoConfig.from_pretrained(shape_dir)
    # EOS must never end a request: the workload ignores it.
    cfg.eos_token_id = None
    torch.manual_seed(0)
    kw = {"attn_implementation": "sdpa"}
    with torch.device("cuda"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, **kw)
        except TypeError:  # transformers 4.x names it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, **kw)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return model, cfg


def gen_config(transformers, max_new, **extra):
    return transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new,
                                         eos_token_id=None, pad_token_id=0, **extra)


def cb_manager(model, gc, n_prompt_max, n_new_max):
    """The continuous-batching manager, warmed up (CUDA graphs captured: setup, not timed) and
    started. Through continuous_batching_context_manager where the version has it (the path
    generate_batch takes: workload hints size the cache and the batch, then warm-up), else
    init_continuous_batching. Returns (context or None, manager)."""
    cm = getattr(model, "continuous_batching_context_manager", None)
    if cm is not None:
        params = inspect.signature(cm).parameters
        kw = {"generation_config": gc}
        for k, v in (("block", True), ("timeout", 10), ("warmup", True)):
            if k in params:
                kw[k] = v
        if "workload_hints" in params:
            try:
                from transformers.generation.continuous_batching.utils import WorkloadHints
                kw["workload_hints"] = WorkloadHints(max_prompt_length=n_prompt_max,
                                                     max_generated_length=n_new_max)
            except (ImportError, TypeError):
                pass
        ctx = cm(**kw)
        return ctx, ctx.__enter__()
    mgr = model.init_continuous_batching(generation_config=gc)
    if hasattr(mgr, "warmup"):
        mgr.warmup()
    mgr.start()
    return None, mgr


def cb_describe(mgr):
    """What the manager chose (cache blocks, tokens per batch), where the version exposes it."""
    bp = getattr(mgr, "batch_processor", None)
    cache = getattr(bp, "cache", None)
    out = []
    for name in ("num_blocks", "block_size", "max_batch_tokens"):
        v = getattr(cache, name, None)
        if isinstance(v, int):
            out.append("%s %d" % (name, v))
    return ", ".join(out) or "cache size not exposed"


def run_cb(model, reqs, budget, torch, transformers):
    """Continuous batching through the manager API. Returns (done, tokens, seconds, note)."""
    gc = gen_config(transformers, max(n for _, n in reqs))
    t = time.perf_counter()
    ctx, mgr = cb_manager(model, gc, max(len(p) for p, _ in reqs), max(n for _, n in reqs))
    params = inspect.signature(mgr.add_request).parameters
    if "max_new_tokens" not in params:
        raise RuntimeError("this version's add_request takes no max_new_tokens")
    t0 = time.perf_counter()
    log("cb: manager ready in %.1f s (%s)" % (t0 - t, "context manager" if ctx else "init"))
    ids = []
    for i, (prompt, n_out) in enumerate(reqs):
        kw = {"request_id": "r%d" % i, "max_new_tokens": n_out}
        if "eos_token_id" in params:
            kw["eos_token_id"] = -1
        ids.append(mgr.add_request(prompt, **kw))
    done, tokens, t_last, short, last_log = set(), 0, t0, 0, t0
    while len(done) < len(reqs):
        now = time.perf_counter()
        if now - t0 > budget:
            break
        if now - last_log > 10:
            last_log = now
            log("cb: %.0f s, %d requests done, %d tokens (%s)" % (now - t0, len(done), tokens,
                                                                  cb_describe(mgr)))
        r = mgr.get_result(timeout=0.5)
        if r is None:
            if hasattr(mgr, "is_running") and not mgr.is_running():
                raise RuntimeError("the generation thread stopped")
            continue
        if getattr(r, "error", None):
            raise RuntimeError("request %s failed: %s" % (r.request_id, r.error))
        finished = r.is_finished() if hasattr(r, "is_finished") else True
        if finished and r.request_id not in done:
            done.add(r.request_id)
            n = len(getattr(r, "generated_tokens", None) or [])
            short += n < reqs[int(str(r.request_id).lstrip("r"))][1]
            tokens += n
            t_last = time.perf_counter()
    log("cb: %s" % cb_describe(mgr))
    note = "" if len(done) == len(reqs) else "partial: time budget reached"
    if short:
        note += ("; " if note else "") + "%d requests ended early" % short
    for rid in ids:
        if rid not in done:
            mgr.cancel_request(rid)
    if ctx is not None:
        ctx.__exit__(None, None, None)
    else:
        try:
            mgr.stop(block=True, timeout=10)
        except TypeError:
            mgr.stop()
    torch.cuda.synchronize()
    return len(done), tokens, (t_last if done else time.perf_counter()) - t0, note


def run_generate(model, cfg, reqs, budget, max_batch, torch, transformers):
    """Padded generate() in batches. Returns (done, useful tokens, seconds, note)."""
    if max_batch <= 0:
        # KV of a full batch at the longest lengths in bf16 within half of the free memory (the
        # rest for activations, the attention's padded masks and the allocator's slack).
        free, _ = torch.cuda.mem_get_info()
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        per_seq = 2 * cfg.num_hidden_layers * kvh * hd * 2 * max(len(p) + n for p, n in reqs)
        max_batch = max(1, min(len(reqs), int(0.5 * free // per_seq)))
    log("generate: batches of %d" % max_batch)
    done, tokens, padded = 0, 0, 0
    t0 = time.perf_counter()
    for b in range(0, len(reqs), max_batch):
        if time.perf_counter() - t0 > budget:
            break
        batch = reqs[b:b + max_batch]
        width = max(len(p) for p, _ in batch)
        n_new = max(n for _, n in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        gc = gen_config(transformers, n_new, min_new_tokens=n_new)
        out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), generation_config=gc)
        torch.cuda.synchronize()
        got = out.shape[1] - width
        done += len(batch)
        tokens += sum(min(n, got) for _, n in batch)
        padded += got * len(batch)
    note = "" if done == len(reqs) else "partial: time budget reached"
    note += ("; " if note else "") + "%d tokens generated, %d useful" % (padded, tokens)
    return done, tokens, time.perf_counter() - t0, note


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="shape directory with config.json")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=span, default=(100, 1024))
    ap.add_argument("--output-len", type=span, default=(100, 1024))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=60.0,
                    help="seconds of generation; no new work starts after (default 60)")
    ap.add_argument("--method", choices=("auto", "cb", "generate"), default="auto",
                    help="auto: continuous batching if the installed transformers has it")
    ap.add_argument("--max-batch", type=int, default=0, help="generate: batch size (0 = fit)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import torch
    import transformers

    t = time.perf_counter()
    model, cfg = build_model(a.model, torch, transformers)
    reqs = workload(a.num_requests, *a.input_len, *a.output_len, a.seed, cfg.vocab_size)
    has_cb = hasattr(model, "init_continuous_batching")
    log("transformers %s, torch %s, %s; model built in %.1f s; init_continuous_batching: %s, "
        "generate_batch: %s" % (transformers.__version__, torch.__version__,
                                torch.cuda.get_device_name(), time.perf_counter() - t,
                                has_cb, hasattr(model, "generate_batch")))
    method, res, errors = None, None, []
    if a.method in ("auto", "cb") and has_cb:
        try:
            res = run_cb(model, reqs, a.time_budget, torch, transformers)
            method = "cb (continuous batching manager)"
        except Exception as e:  # noqa: BLE001 -- any failure of the peer's API: fall back
            errors.append("cb: %s: %s" % (type(e).__name__, str(e)[:300]))
            log(errors[-1])
            if a.method == "cb":
                raise
    if res is None:
        res = run_generate(model, cfg, reqs, a.time_budget, a.max_batch, torch, transformers)
        method = "generate (padded batches)"
    done, tokens, secs, note = res
    rate = tokens / secs if secs > 0 else 0.0
    print("HF peer: %s; %d of %d requests, %d output tokens in %.2f s: %.1f output tok/s%s" %
          (method, done, len(reqs), tokens, secs, rate, " (" + note + ")" if note else ""))
    if a.json:
        print(json.dumps({"method": method, "requests": len(reqs), "requests_done": done,
                          "output_tokens": tokens, "elapsed_s": round(secs, 4),
                          "output_tok_s": round(rate, 2), "note": note, "errors": errors,
                          "transformers": transformers.__version__, "torch": torch.__version__,
                          "device": torch.cuda.get_device_name()}))
    sys.stdout.flush()
    sys.stderr.flush()
    # A continuous-batching thread left behind by a time limit must not keep the process alive.
    os._exit(0)


if __name__ == "__main__":
    main()
