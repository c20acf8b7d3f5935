#!/usr/bin/env python3
"""make_golden_moe.py -- Makes the tiny mixture-of-experts golden checkpoints (issue #39) with HF
transformers, in the format of ../shared/testdata/golden (see its README.md): config.json,
generation_config.json, model.safetensors (bf16, the tensor names of the published
checkpoints: `mlp.gate` / `mlp.experts.E.{gate,up,down}_proj` for Qwen3-MoE,
`block_sparse_moe.gate` / `block_sparse_moe.experts.E.w{1,2,3}` for Mixtral) and golden.json
(transformers in float64 on the CPU from the bf16 weights: greedy ids with full recompute and
their margins, the last position's logits, every position's logits for short prompts) plus,
for MoE, each short prompt's router logits and top-k experts per layer and position.

Models (random weights, seeded):
  qwen3-moe-tiny  Qwen3MoeForCausalLM: 8 experts, top 4, renormalised top-k
                  (norm_topk_prob), layer 1 a dense MLP (mlp_only_layers), head_dim 32 with
                  per-head q/k norms, GQA 2, untied head.
  qwen3-moe-tiny-step2  the same with decoder_sparse_step 2 (layers 1 and 3 sparse), no
                  renormalisation (norm_topk_prob false), tied embeddings.
  mixtral-tiny    MixtralForCausalLM: 4 experts, top 2, GQA 2, untied head.
In every model, the first sparse layer's router rows of experts 0 and 1 are equal (so are their logits):
the top-k choice with ties is in the references (torch.topk takes the lower index first).

Run where torch and transformers are installed (the lent GPU machine has them):
  python3 tools/make_golden_moe.py OUT_DIR
(`--fix-config DIR` rewrites only the configs of DIR's models as below.) It checks that the written checkpoint, loaded back by transformers, gives the same logits.
"""
import json
import os
import sys



KINDS = ("qwen3-moe-tiny", "qwen3-moe-tiny-step2", "mixtral-tiny")
PROMPT_LENS = (1, 7, 16, 33, 100, 300)
GREEDY_NEW = 24
ALL_LOGITS_MAX = 33
VOCAB = 512


def fix_config(d, kind):
    """config.json as the published checkpoints write it: `architectures` (saving a config
    alone leaves it out), and for qwen3-moe-tiny the names of Qwen3-30B-A3B's file
    (`num_experts`, a top-level `rope_theta`) where transformers 5 writes `num_local_experts`
    and `rope_parameters`; the other two keep transformers 5's names, so both forms are read."""
    p = os.path.join(d, "config.json")
    with open(p) as f:
        c = json.load(f)
    c["architectures"] = ["MixtralForCausalLM" if kind.startswith("mixtral")
                          else "Qwen3MoeForCausalLM"]
    if kind == "qwen3-moe-tiny":
        c["num_experts"] = c.pop("num_local_experts")
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
    with open(p, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")


def make(kind):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=1,
                  eos_token_id=2, initializer_range=0.08)
    if kind.startswith("qwen3-moe"):
        step2 = kind.endswith("step2")
        cfg = transformers.Qwen3MoeConfig(
            **common, head_dim=32, intermediate_size=160, moe_intermediate_size=48,
            num_hidden_layers=4 if step2 else 3, num_experts=8, num_experts_per_tok=4,
            norm_topk_prob=not step2, decoder_sparse_step=2 if step2 else 1,
            mlp_only_layers=[] if step2 else [1], tie_word_embeddings=step2,
            output_router_logits=False)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(
            **common, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
            num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None,
            output_router_logits=False)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed({"qwen3-moe-tiny": 11, "qwen3-moe-tiny-step2": 12}.get(kind, 13))
    model = cls(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name: # random norms too, so that a missing one shows
                p.copy_((1.0 + 0.2 * torch.randn_like(p, dtype=torch.float32)).to(p.dtype))
        g = next(gate_of(l) for l in model.model.layers if gate_of(l) is not None)
        g.weight[1].copy_(g.weight[0])
    return model, cfg


def gate_of(layer):
    moe = getattr(layer, "block_sparse_moe", None) or layer.mlp
    return getattr(moe, "gate", None) # None: a dense layer


def hub_state(model, kind):
    """The parameters under the published checkpoints' names, one tensor an expert (newer
    transformers keep the experts fused as [E, 2I, H] / [E, H, I] tensors)."""
    out = {}
    mixtral = kind.startswith("mixtral")
    for k, v in model.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                g, u = v[e, :inter], v[e, inter:]
                if mixtral:
                    out[pre + "%d.w1.weight" % e] = g.contiguous()
                    out[pre + "%d.w3.weight" % e] = u.contiguous()
                else:
                    out[pre + "%d.gate_proj.weight" % e] = g.contiguous()
                    out[pre + "%d.up_proj.weight" % e] = u.contiguous()
        elif k.endswith("experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[pre + ("%d.w2.weight" if mixtral else "%d.down_proj.weight") % e] = v[e].contiguous()
        else:
            out[k] = v.contiguous()
    if mixtral:
        out = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in out.items()}
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--fix-config": # the configs only (no torch)
        for kind in KINDS:
            fix_config(os.path.join(sys.argv[2], kind), kind)
        return
    global torch, transformers, save_file
    import torch
    import transformers
    from safetensors.torch import save_file
    root = sys.argv[1] if len(sys.argv) > 1 else "golden-moe"
    for kind in KINDS:
        model, cfg = make(kind)
        d = os.path.join(root, kind)
        os.makedirs(d, exist_ok=True)
        cfg.save_pretrained(d)
        model.generation_config.save_pretrained(d)
        state = hub_state(model, kind)
        save_file(state, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        ref = type(model).from_pretrained(d).double().eval() # bf16 -> f64 is exact
        for m in (ref, model): # the plain per-expert loop (the grouped kernels take no f64)
            if hasattr(m, "set_experts_implementation"):
                m.set_experts_implementation("eager")
        # the float64 reference of the bf16 weights, checked against the model in memory
        mem = model.double()
        gen = torch.Generator().manual_seed(5)
        probe = torch.randint(3, VOCAB, (9,), generator=gen).tolist()
        diff = (logits_of(ref, probe) - logits_of(mem, probe)).abs().max().item()
        # (not equal: the model in memory was cast to bf16 whole, RoPE's inverse frequencies
        # too, where a loaded one makes them in f32; a tensor misnamed or misplaced in the
        # checkpoint moves the logits by far more)
        if diff > 2e-3:
            sys.exit("%s: the written checkpoint's logits differ from the model's by %g" % (kind, diff))
        print("%s: checkpoint read back, logits within %.2g of the model in memory" % (kind, diff))
        # router logits per layer through hooks on the gates' inputs (their weight rows)
        captured = {}

        def hook(li):
            def f(mod, args, _out):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                captured[li] = x @ mod.weight.double().t()
            return f

        fix_config(d, kind)
        hooks = []
        for li, layer in enumerate(ref.model.layers):
            moe = getattr(layer, "block_sparse_moe", None) or layer.mlp
            if hasattr(moe, "gate"):
                hooks.append(moe.gate.register_forward_hook(hook(li)))
        k = cfg.num_experts_per_tok
        cases = []
        for n in PROMPT_LENS:
            ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
            captured.clear()
            lg = logits_of(ref, ids)
            case = {"prompt_ids": ids, "last_logits": [round(x, 6) for x in lg[-1].tolist()]}
            if n <= ALL_LOGITS_MAX:
                case["all_logits"] = [[round(x, 6) for x in row] for row in lg.tolist()]
                router = []
                for li in sorted(captured):
                    rl = captured[li]
                    top = torch.topk(torch.softmax(rl, dim=-1), k, dim=-1)
                    router.append({"layer": li,
                                   "logits": [[round(x, 6) for x in r] for r in rl.tolist()],
                                   "topk": top.indices.tolist()})
                case["router"] = router
            seq, greedy, margins = list(ids), [], []
            for _ in range(GREEDY_NEW):
                last = logits_of(ref, seq)[-1]
                t2 = torch.topk(last, 2)
                greedy.append(int(t2.indices[0]))
                margins.append(round(float(t2.values[0] - t2.values[1]), 6))
                seq.append(greedy[-1])
            case["greedy_ids"] = greedy
            case["greedy_margins"] = margins
            cases.append(case)
        for h in hooks:
            h.remove()
        with open(os.path.join(d, "golden.json"), "w") as f:
            json.dump({"model": kind,
                       "reference": "transformers %s, float64 on CPU from the bf16 checkpoint"
                                    % transformers.__version__,
                       "greedy_new_tokens": GREEDY_NEW,
                       "router_note": "router: for prompts of <= %d tokens, each sparse "
                                      "layer's router logits [position][expert] and top-k "
                                      "experts (torch.topk of the softmax, lower index first "
                                      "on ties); the first sparse layer's experts 0 and 1 "
                                      "have equal router rows" % ALL_LOGITS_MAX,
                       "cases": cases}, f)
        m = min(min(c["greedy_margins"]) for c in cases)
        print("%s: %d tensors, smallest greedy margin %.4f, keys e.g. %s" %
              (kind, len(state), m, sorted(state)[:3]))


if __name__ == "__main__":
    main()
