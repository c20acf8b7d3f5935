#!/usr/bin/env bash
# test_generate_cli.sh -- pdserve-generate end to end: golden greedy output as JSON, dummy
# weights, and every bad input giving a clear message and a non-zero exit (never a crash).
# usage: test_generate_cli.sh PATH/TO/pdserve-generate SHARED_DIR
set -u
GEN=$1
SHARED=$2
STORIES=$SHARED/models/stories260k
[ -d "$STORIES" ] || { echo "no shared data: skip"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0

# expect_fail NAME SUBSTRING ARGS... : the command must exit 1..125 (not a signal) and
# print SUBSTRING on stderr.
expect_fail() {
    local name=$1 want=$2; shift 2
    ${PRE:-} "$GEN" "$@" >"$TMP/out" 2>"$TMP/err"
    local rc=$?
    if [ $rc -eq 0 ] || [ $rc -ge 126 ]; then
        echo "FAIL $name: exit $rc (want a clean non-zero exit)"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    if ! grep -qF -- "$want" "$TMP/err"; then
        echo "FAIL $name: stderr lacks '$want':"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    echo "ok   $name"
}

# 1. Golden: greedy from [1] reproduces the reference story (with its stop token).
"$GEN" --model "$STORIES" --prompt-ids 1 --max-tokens 400 --temperature 0 --json >"$TMP/gold.json" 2>"$TMP/err" \
    || { echo "FAIL golden run"; cat "$TMP/err"; fails=$((fails+1)); }
python3 - "$TMP/gold.json" "$STORIES/golden.json" <<'PY' || fails=$((fails+1))
import json, sys
got = json.loads(open(sys.argv[1]).readline())
ref = json.load(open(sys.argv[2]))["cases"][0]["greedy_ids"]
assert got["token_ids"] == ref, f"token ids differ: {got['token_ids'][:10]} vs {ref[:10]}"
assert got["finish_reason"] == "eos", got["finish_reason"]
want = json.load(open(sys.argv[2]))["cases"][0]["greedy_text"]
assert got["text"] == want, f"text differs: {got['text'][:60]!r} vs {want[:60]!r}"
print("ok   golden story token ids, text and finish_reason")
PY
grep -q "tok/s" "$TMP/err" && echo "ok   tokens/s reported" || { echo "FAIL no tok/s on stderr"; fails=$((fails+1)); }
# A text prompt goes through the tokenizer; the completion comes back as text.
"$GEN" --model "$STORIES" --prompt "Once upon a time" --max-tokens 80 --temperature 0 --json >"$TMP/t.json" 2>"$TMP/err2" \
    || { echo "FAIL text prompt"; cat "$TMP/err2"; fails=$((fails+1)); }
python3 - "$TMP/t.json" "$STORIES/golden.json" <<'PY' || fails=$((fails+1))
import json, sys
got = json.loads(open(sys.argv[1]).readline())
case = json.load(open(sys.argv[2]))["cases"][1]
assert got["token_ids"] == case["greedy_ids"], "ids differ"
assert got["text"].strip() == case["greedy_text"].strip(), f"{got['text'][:50]!r} vs {case['greedy_text'][:50]!r}"
print("ok   --prompt text reproduces the golden continuation")
PY
expect_fail "invalid UTF-8 prompt" "UTF-8" --model "$STORIES" --prompt $'\xff\xfe' --max-tokens 2

# 2. Several prompts in one batch, JSON line per prompt.
"$GEN" --model "$STORIES" --prompt-ids 1 --prompt-ids 1,403,407 --max-tokens 5 --temperature 0 --json >"$TMP/two" 2>/dev/null
[ "$(wc -l <"$TMP/two")" -eq 2 ] && echo "ok   two prompts, two lines" || { echo "FAIL two prompts"; fails=$((fails+1)); }

# 3. Dummy weights from a config alone (no safetensors).
mkdir -p "$TMP/dummy"
cat >"$TMP/dummy/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
 "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
 "rope_theta": 1000000, "tie_word_embeddings": true, "eos_token_id": 2}
JSON
"$GEN" --model "$TMP/dummy" --load-format dummy --random-prompt-len 20 --max-tokens 8 --ignore-eos --json >"$TMP/d" 2>"$TMP/err" \
    && python3 -c "import json,sys; d=json.loads(open('$TMP/d').read()); assert len(d['token_ids'])==8" \
    && echo "ok   dummy weights" || { echo "FAIL dummy"; cat "$TMP/err"; fails=$((fails+1)); }
expect_fail "dummy model without weights needs --load-format dummy" "model.safetensors" --model "$TMP/dummy" --prompt-ids 1

# 4. Bad command lines.
expect_fail "no model" "--model DIR is required" --prompt-ids 1
expect_fail "no prompt" "give a prompt" --model "$STORIES"
expect_fail "bad ids" "invalid value for --prompt-ids" --model "$STORIES" --prompt-ids 1,,2
expect_fail "non-numeric max-tokens" "invalid value for --max-tokens" --model "$STORIES" --prompt-ids 1 --max-tokens abc
expect_fail "zero max-tokens" "invalid value for --max-tokens" --model "$STORIES" --prompt-ids 1 --max-tokens 0
expect_fail "negative temperature" "temperature" --model "$STORIES" --prompt-ids 1 --temperature -1
expect_fail "top-p 0" "top_p" --model "$STORIES" --prompt-ids 1 --top-p 0
expect_fail "top-p 1.5" "top_p" --model "$STORIES" --prompt-ids 1 --top-p 1.5
expect_fail "min-p 2" "min_p" --model "$STORIES" --prompt-ids 1 --min-p 2
expect_fail "repetition 0" "repetition_penalty" --model "$STORIES" --prompt-ids 1 --repetition-penalty 0
expect_fail "unknown flag" "Try 'pdserve-generate --help'" --model "$STORIES" --prompt-ids 1 --bogus
expect_fail "unknown backend" "unknown backend" --model "$STORIES" --prompt-ids 1 --backend tpu
expect_fail "bad load format" "unknown --load-format" --model "$STORIES" --prompt-ids 1 --load-format gguf
expect_fail "token id out of range" "out of range" --model "$STORIES" --prompt-ids 1,512
expect_fail "negative token id" "out of range" --model "$STORIES" --prompt-ids 1,-3
long=$(python3 -c "print(','.join(['1']*600))")
expect_fail "prompt longer than the model maximum" "maximum length of 512" --model "$STORIES" --prompt-ids "$long"
"$GEN" --help | grep -q -- "--max-tokens" && echo "ok   --help" || { echo "FAIL --help"; fails=$((fails+1)); }

# 5. Bad model directories.
expect_fail "missing directory" "config.json" --model "$TMP/nope" --prompt-ids 1
mk() { mkdir -p "$TMP/$1"; cp "$STORIES/config.json" "$STORIES/generation_config.json" "$TMP/$1/"; }
mk malformed; printf '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,' >"$TMP/malformed/config.json"
expect_fail "malformed config.json" "malformed JSON" --model "$TMP/malformed" --prompt-ids 1
mk arch; sed -i 's/LlamaForCausalLM/GPT2LMHeadModel/' "$TMP/arch/config.json"; ln -s "$STORIES/model.safetensors" "$TMP/arch/"
expect_fail "unknown architecture" "GPT2LMHeadModel" --model "$TMP/arch" --prompt-ids 1
mk trunc; head -c 500000 "$STORIES/model.safetensors" >"$TMP/trunc/model.safetensors"
expect_fail "truncated safetensors" "truncated" --model "$TMP/trunc" --prompt-ids 1
# Rewrite the stories header: a misshapen tensor, a missing tensor, an unsupported dtype.
python3 - "$STORIES/model.safetensors" "$TMP" <<'PY'
import json, os, struct, sys
src, tmp = sys.argv[1], sys.argv[2]
raw = open(src, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n]); data = raw[8 + n:]
def write(name, h):
    os.makedirs(f"{tmp}/{name}", exist_ok=True)
    b = json.dumps(h).encode(); b += b" " * (-len(b) % 8)
    open(f"{tmp}/{name}/model.safetensors", "wb").write(struct.pack("<Q", len(b)) + b + data)
    for f in ("config.json", "generation_config.json"):
        open(f"{tmp}/{name}/{f}", "w").write(open(os.path.join(os.path.dirname(src), f)).read())
h = json.loads(json.dumps(hdr)); h["model.layers.2.mlp.up_proj.weight"]["shape"] = [64, 172]; write("shape", h)
h = json.loads(json.dumps(hdr)); del h["model.layers.3.self_attn.k_proj.weight"]; write("missing", h)
h = json.loads(json.dumps(hdr)); t = h["model.norm.weight"]; t["dtype"] = "I32"; write("dtype", h)
h = json.loads(json.dumps(hdr)); t = h["model.norm.weight"]; t["dtype"] = "F64"; t["shape"] = [32]; write("dtype64", h)
PY
expect_fail "misshapen tensor" "model.layers.2.mlp.up_proj.weight" --model "$TMP/shape" --prompt-ids 1
expect_fail "missing tensor" "model.layers.3.self_attn.k_proj.weight is missing" --model "$TMP/missing" --prompt-ids 1
expect_fail "unsupported dtype I32" "I32" --model "$TMP/dtype" --prompt-ids 1
expect_fail "unsupported dtype F64" "F64" --model "$TMP/dtype64" --prompt-ids 1

# 6. Tensor parallelism (ranks as threads on the CPU): the golden story at TP 2 and 4, a batch
# of text prompts at TP 2 equal to TP 1, dummy weights, what does not divide refused.
for tp in 2 4; do
    "$GEN" --model "$STORIES" --prompt-ids 1 --max-tokens 400 --temperature 0 --json --tensor-parallel $tp \
        >"$TMP/tp$tp.json" 2>"$TMP/err" || { echo "FAIL TP $tp run"; cat "$TMP/err"; fails=$((fails+1)); }
    python3 - "$TMP/tp$tp.json" "$STORIES/golden.json" $tp <<'PY' || fails=$((fails+1))
import json, sys
got = json.loads(open(sys.argv[1]).readline())
case = json.load(open(sys.argv[2]))["cases"][0]
assert got["token_ids"] == case["greedy_ids"], f"TP {sys.argv[3]}: ids differ: {got['token_ids'][:10]}"
assert got["text"] == case["greedy_text"] and got["finish_reason"] == "eos"
print(f"ok   --tensor-parallel {sys.argv[3]}: golden story token ids, text and finish_reason")
PY
done
args=(--model "$STORIES" --prompt "Once upon a time" --prompt "The cat" --prompt-ids 1,403,407 --max-tokens 60 --temperature 0 --json)
"$GEN" "${args[@]}" >"$TMP/b1" 2>/dev/null && "$GEN" "${args[@]}" --tensor-parallel 2 >"$TMP/b2" 2>/dev/null \
    && [ "$(wc -l <"$TMP/b2")" -eq 3 ] && cmp -s "$TMP/b1" "$TMP/b2" \
    && echo "ok   --tensor-parallel 2: a batch of three prompts as TP 1" || { echo "FAIL TP 2 batch"; diff "$TMP/b1" "$TMP/b2"; fails=$((fails+1)); }
"$GEN" --model "$TMP/dummy" --load-format dummy --random-prompt-len 20 --max-tokens 8 --ignore-eos --json --tensor-parallel 2 >"$TMP/d2" 2>"$TMP/err" \
    && python3 -c "import json,sys; d=json.loads(open('$TMP/d2').read()); assert len(d['token_ids'])==8" \
    && echo "ok   dummy weights at TP 2" || { echo "FAIL dummy TP 2"; cat "$TMP/err"; fails=$((fails+1)); }
expect_fail "MLP does not divide" "intermediate size 172 does not divide among 8 ranks" --model "$STORIES" --prompt-ids 1 --tensor-parallel 8
expect_fail "heads do not divide" "6 attention heads do not divide among 4 ranks" --model "$SHARED/testdata/golden/llama-tiny" --prompt-ids 1 --tensor-parallel 4
expect_fail "TP 0" "invalid value for --tensor-parallel" --model "$STORIES" --prompt-ids 1 --tensor-parallel 0
expect_fail "misshapen tensor at TP 2" "model.layers.2.mlp.up_proj.weight" --model "$TMP/shape" --prompt-ids 1 --tensor-parallel 2
# A rank failing between collectives (a device error): the run ends with the rank's error, no
# rank left waiting in a collective (timeout: a hang fails the check with exit 124).
# Before the launch gate (the others launch nothing) and, with ":after", half-way through the
# layers (the communicator is aborted).
for fr in 1:3 0:2 3:5 1:1:after 0:1:after; do
    PRE="timeout 60 env PDSERVE_FAULT_TP_RANK=$fr"
    expect_fail "rank failure $fr at TP 4" "tensor parallel rank ${fr%%:*}: injected rank failure" \
        --model "$STORIES" --prompt-ids 1 --max-tokens 16 --temperature 0 --tensor-parallel 4
done
PRE=

if [ $fails -ne 0 ]; then echo "$fails failures"; exit 1; fi
echo "all CLI checks passed"
