#!/usr/bin/env bash
# test_quantize_cli.sh -- pdserve-quantize end to end: the tiny llama and qwen3 goldens in each
# scheme (one file and shards), checked by a reader of its own written here in Python (the
# safetensors layout parsed by hand, e4m3 decoded from its bit layout and encoded again with
# round-to-nearest-even): codes, scales, untouched tensors, config.json and copied files; then
# every bad input giving a clear message, a non-zero exit and no checkpoint left behind.
# With PATH/TO/pdserve-generate: every scheme of stories260k loads and generates on the CPU, and
# fp8-dynamic gives the tokens of the bf16 checkpoint quantized at load (--quantization fp8:
# the same per-channel rule).
# usage: test_quantize_cli.sh PATH/TO/pdserve-quantize SHARED_DIR [PATH/TO/pdserve-generate]
set -u
Q=$1
GEN=${3:-}
SHARED=$(cd "$2" && pwd)
PY=/usr/bin/python3
GOLDEN=$SHARED/testdata/golden
[ -d "$GOLDEN/llama-tiny" ] || { echo "no shared data: skip"; exit 77; }
$PY -c "import numpy" 2>/dev/null || { echo "no python3-numpy (tools/install_deps.sh): skip"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0

# expect_fail NAME SUBSTRING ARGS... : a clean non-zero exit with SUBSTRING on stderr.
expect_fail() {
    local name=$1 want=$2; shift 2
    "$Q" "$@" >"$TMP/stdout" 2>"$TMP/err"
    local rc=$?
    if [ $rc -eq 0 ] || [ $rc -ge 126 ]; then
        echo "FAIL $name: exit $rc (want a clean non-zero exit)"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    if ! grep -qF -- "$want" "$TMP/err"; then
        echo "FAIL $name: stderr lacks '$want':"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    echo "ok   $name"
}

# An input directory: the golden's config and weights (a symlink, as in the HF cache) plus the
# files a Hub checkpoint carries beside them, and some that must not be copied.
mkinput() {
    local src=$GOLDEN/$1 dst=$TMP/in-$1
    mkdir -p "$dst/original"
    cp "$src/config.json" "$src/generation_config.json" "$dst/"
    ln -s "$src/model.safetensors" "$dst/model.safetensors"
    cp "$SHARED/models/stories260k/tokenizer.json" "$SHARED/models/stories260k/tokenizer_config.json" "$dst/"
    echo '{"bos_token": "<s>", "eos_token": "</s>"}' >"$dst/special_tokens_map.json"
    echo '{% for m in messages %}{{ m.content }}{% endfor %}' >"$dst/chat_template.jinja"
    printf 'a\nb\n' >"$dst/merges.txt"
    head -c 300 /dev/urandom >"$dst/tokenizer.model"
    echo "skip me" >"$dst/pytorch_model.bin"
    echo "skip me" >"$dst/.gitattributes"
    echo "skip me" >"$dst/original/params.json"
}
mkinput llama-tiny
mkinput qwen3-tiny

cat >"$TMP/verify.py" <<'PY'
# verify.py IN OUT SCHEME IGNORE_JSON [N_FILES]: checks OUT against IN independently of
# pdserve's code (plain json + numpy).
import json, os, struct, sys
import numpy as np

src, out, scheme, ignore = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
want_files = int(sys.argv[5]) if len(sys.argv) > 5 else 1
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

def read_file(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    assert n % 8 == 0, f"{path}: header length {n} is not a multiple of 8"
    text = raw[8:8 + n].decode()
    assert text.rstrip(" ").endswith("}") and len(text) - len(text.rstrip(" ")) < 8, path
    hdr = json.loads(text)
    assert hdr.pop("__metadata__") == {"format": "pt"}, path
    data, pos, tensors = raw[8 + n:], 0, {}
    for name, e in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, end = e["data_offsets"]
        assert b == pos, f"{path}: {name} begins at {b}, want {pos} (holes or overlaps)"
        tensors[name] = (e["dtype"], e["shape"], data[b:end])
        pos = end
    assert pos == len(data), f"{path}: {len(data) - pos} bytes after the last tensor"
    return tensors

def read_ckpt(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(idx):
        return read_file(os.path.join(d, "model.safetensors")), 1
    index = json.load(open(idx))
    wm, tensors = index["weight_map"], {}
    files = sorted(set(wm.values()))
    for i, f in enumerate(files):
        assert f == f"model-{i + 1:05d}-of-{len(files):05d}.safetensors", f
        part = read_file(os.path.join(d, f))
        assert all(wm[k] == f for k in part), f"{f}: tensors the index places elsewhere"
        tensors.update(part)
    assert set(tensors) == set(wm), "index and shards name different tensors"
    total = sum(len(t[2]) for t in tensors.values())
    assert index["metadata"]["total_size"] == total, (index["metadata"], total)
    for f in files:
        assert os.path.getsize(os.path.join(d, f)) < 5e9
    return tensors, len(files) + 1

def to_f32(dtype, shape, b):
    if dtype == "BF16":
        return (np.frombuffer(b, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if dtype == "F16":
        return np.frombuffer(b, "<f2").astype(np.float32).reshape(shape)
    assert dtype == "F32", dtype
    return np.frombuffer(b, "<f4").reshape(shape)

# e4m3fn from its bit layout: sign, 4 exponent bits (bias 7), 3 mantissa bits; e=0 subnormal.
E4M3 = np.empty(256)
for c in range(256):
    e, m = (c >> 3) & 15, c & 7
    v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    E4M3[c] = np.nan if (e, m) == (15, 7) else (-v if c & 0x80 else v)
POS = E4M3[:127]  # codes 0..126: increasing, 0 .. 448

def encode(x):
    """f32 -> e4m3fn codes: nearest, ties to the even code, beyond 448 saturating."""
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(POS, a), 1, 126)
    lo = hi - 1
    dlo, dhi = a - POS[lo], POS[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= 448, 126, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)

def scales_of(amax):
    s = (amax.astype(np.float32) / np.float32(448)).astype(np.float32)
    return np.where(amax == 0, np.float32(1), s).astype(np.float32)

inp = read_file(os.path.join(src, "model.safetensors"))
got, n_files = read_ckpt(out)
assert n_files == want_files, f"{n_files} files, want {want_files}"
block = scheme == "fp8-block"
sname = "weight_scale_inv" if block else "weight_scale"
ign = set(ignore)
expect_names, n_quant = set(), 0
for name, (dtype, shape, b) in inp.items():
    expect_names.add(name)
    mod = name[:-len(".weight")]
    quant = (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2
             and mod.split(".")[-1] in TARGETS and mod not in ign)
    if not quant:
        assert got[name] == (dtype, shape, b), f"{name} is not byte-identical to the input"
        continue
    n_quant += 1
    expect_names.add(f"{mod}.{sname}")
    w = to_f32(dtype, shape, b)
    qd, qs, qb = got[name]
    assert qd == "F8_E4M3" and qs == shape, (name, qd, qs)
    sd, ss, sb = got[f"{mod}.{sname}"]
    rows, cols = shape
    if block:
        nbr, nbc = -(-rows // 128), -(-cols // 128)
        assert sd == "F32" and ss == [nbr, nbc], (name, sd, ss)
        amax = np.zeros((nbr, nbc), np.float32)
        for i in range(nbr):
            for j in range(nbc):
                amax[i, j] = np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max()
        want_s = scales_of(amax)
        s_full = np.repeat(np.repeat(want_s, 128, 0), 128, 1)[:rows, :cols]
    else:
        assert sd == "F32" and ss == [rows, 1], (name, sd, ss)
        want_s = scales_of(np.abs(w).max(axis=1)).reshape(rows, 1)
        s_full = np.broadcast_to(want_s, (rows, cols))
    s = np.frombuffer(sb, "<f4").reshape(ss)
    assert np.array_equal(s.view(np.uint32), want_s.view(np.uint32)), \
        f"{name}: scales differ from amax / 448 (f32): {s.ravel()[:4]} vs {want_s.ravel()[:4]}"
    codes = np.frombuffer(qb, np.uint8).reshape(shape)
    want_codes = encode((w / s_full.astype(np.float32)).astype(np.float32))
    bad = np.argwhere(codes != want_codes)
    assert len(bad) == 0, f"{name}: {len(bad)} codes differ, first at {bad[0]}: " \
        f"{codes[tuple(bad[0])]:#x} vs {want_codes[tuple(bad[0])]:#x}"
    deq = E4M3[codes] * s_full
    err = np.abs(deq - w)
    tol = np.maximum(np.abs(w) * 2.0 ** -4, s_full * 2.0 ** -10) * (1 + 1e-6)
    assert (err <= tol).all(), f"{name}: dequantized off by {err.max()} (> half an e4m3 step)"
assert set(got) == expect_names, f"tensors: extra {set(got) - expect_names}, missing {expect_names - set(got)}"

ci, co = json.load(open(os.path.join(src, "config.json"))), json.load(open(os.path.join(out, "config.json")))
qc = co.pop("quantization_config")
assert co == ci, "config.json changed beyond quantization_config"
if block:
    want = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": ignore}
else:
    def args(strategy, dynamic):
        return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                "strategy": strategy, "block_structure": None, "dynamic": dynamic,
                "actorder": None, "observer": None if dynamic else "minmax", "observer_kwargs": {}}
    want = {"config_groups": {"group_0": {
                "targets": ["Linear"], "weights": args("channel", False), "output_activations": None,
                "input_activations": args("token", True) if scheme == "fp8-dynamic" else None}},
            "format": "float-quantized", "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "version": "0.10.2"}
assert qc == want, f"quantization_config:\n{json.dumps(qc, indent=1)}\nwant:\n{json.dumps(want, indent=1)}"

copied = ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "chat_template.jinja", "merges.txt", "tokenizer.model"]
for f in copied:
    assert open(os.path.join(src, f), "rb").read() == open(os.path.join(out, f), "rb").read(), f
weights = {"model.safetensors", "model.safetensors.index.json"} | {
    f for f in os.listdir(out) if f.startswith("model-") and f.endswith(".safetensors")}
extra = set(os.listdir(out)) - set(copied) - weights - {"config.json"}
assert not extra, f"unexpected files in the output: {extra}"
print(f"ok   {os.path.basename(src)} {scheme}: {n_quant} weights quantized, {len(got)} tensors, "
      f"{n_files} file(s)")
PY

verify() { $PY "$TMP/verify.py" "$@" || fails=$((fails+1)); }

# 1. Every scheme on both models.
for m in llama-tiny qwen3-tiny; do
    for s in fp8-dynamic fp8-weight-only fp8-block; do
        "$Q" --model "$TMP/in-$m" --out "$TMP/out/$m-$s" --scheme $s 2>"$TMP/err" \
            || { echo "FAIL $m $s"; cat "$TMP/err"; fails=$((fails+1)); continue; }
        grep -q "quantized, $s" "$TMP/err" || { echo "FAIL $m $s: no summary line"; fails=$((fails+1)); }
        verify "$TMP/in-$m" "$TMP/out/$m-$s" $s '["lm_head"]'
    done
done

# 2. Shards with the index (100 kB shards: the llama's 0.5 MB in 6), and --ignore.
"$Q" --model "$TMP/in-llama-tiny" --out "$TMP/out/sharded" --scheme fp8-dynamic --max-shard-size 100K 2>"$TMP/err" \
    || { echo "FAIL sharded"; cat "$TMP/err"; fails=$((fails+1)); }
verify "$TMP/in-llama-tiny" "$TMP/out/sharded" fp8-dynamic '["lm_head"]' 7
"$Q" --model "$TMP/in-qwen3-tiny" --out "$TMP/out/ignore" --scheme fp8-block \
    --ignore model.layers.1.mlp.down_proj --ignore model.layers.0.self_attn.q_proj,model.layers.0.self_attn.k_proj 2>"$TMP/err" \
    || { echo "FAIL --ignore"; cat "$TMP/err"; fails=$((fails+1)); }
verify "$TMP/in-qwen3-tiny" "$TMP/out/ignore" fp8-block \
    '["lm_head", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]'
"$Q" --model "$TMP/in-qwen3-tiny" --out "$TMP/out/ignore2" --scheme fp8-dynamic --ignore model.layers.9.nope 2>"$TMP/err" \
    && grep -q "warning: --ignore model.layers.9.nope matches no quantizable module" "$TMP/err" \
    && echo "ok   an --ignore that matches nothing is warned about" || { echo "FAIL unmatched --ignore"; cat "$TMP/err"; fails=$((fails+1)); }

# 3. --force over a sharded checkpoint: one file now, the stale shards and index removed, and
# the temporary files of an interrupted run.
echo partial >"$TMP/out/sharded/model-00009-of-00012.safetensors.pdserve-tmp"
"$Q" --model "$TMP/in-llama-tiny" --out "$TMP/out/sharded" --scheme fp8-weight-only --force 2>"$TMP/err" \
    || { echo "FAIL --force"; cat "$TMP/err"; fails=$((fails+1)); }
verify "$TMP/in-llama-tiny" "$TMP/out/sharded" fp8-weight-only '["lm_head"]' 1

# 4. Bad command lines.
expect_fail "no --model" "--model DIR is required" --out "$TMP/x" --scheme fp8-dynamic
expect_fail "no --out" "--out DIR is required" --model "$TMP/in-llama-tiny" --scheme fp8-dynamic
expect_fail "no --scheme" "--scheme is required" --model "$TMP/in-llama-tiny" --out "$TMP/x"
expect_fail "bad scheme" "unknown --scheme 'int8'" --model "$TMP/in-llama-tiny" --out "$TMP/x" --scheme int8
expect_fail "bad shard size" "invalid value for --max-shard-size" --model "$TMP/in-llama-tiny" --out "$TMP/x" --scheme fp8-block --max-shard-size 5Q
expect_fail "unknown flag" "Try 'pdserve-quantize --help'" --model "$TMP/in-llama-tiny" --out "$TMP/x" --scheme fp8-block --bogus
"$Q" --help | grep -q -- "--scheme" && echo "ok   --help" || { echo "FAIL --help"; fails=$((fails+1)); }
[ ! -e "$TMP/x" ] && echo "ok   no output made by bad command lines" || { echo "FAIL $TMP/x exists"; fails=$((fails+1)); }

# 5. Bad directories and inputs: nothing is left in a new --out.
expect_fail "missing model" "config.json" --model "$TMP/nope" --out "$TMP/x" --scheme fp8-dynamic
expect_fail "existing --out" "is not empty (give --force" --model "$TMP/in-llama-tiny" --out "$TMP/out/llama-tiny-fp8-block" --scheme fp8-dynamic
expect_fail "--out is --model" "is the input model directory" --model "$TMP/in-llama-tiny" --out "$TMP/in-llama-tiny/" --scheme fp8-dynamic --force
touch "$TMP/file"
expect_fail "--out is a file" "is not a directory" --model "$TMP/in-llama-tiny" --out "$TMP/file" --scheme fp8-dynamic
expect_fail "already quantized (compressed-tensors)" 'already quantized (quantization_config with quant_method "compressed-tensors")' \
    --model "$TMP/out/llama-tiny-fp8-dynamic" --out "$TMP/x" --scheme fp8-dynamic
expect_fail "already quantized (fp8)" 'quant_method "fp8"' --model "$TMP/out/qwen3-tiny-fp8-block" --out "$TMP/x" --scheme fp8-block
# an F8 tensor with no quantization_config: named with its file
mkdir -p "$TMP/f8"; cp "$TMP/out/llama-tiny-fp8-dynamic/model.safetensors" "$TMP/f8/"
$PY -c "import json; c = json.load(open('$TMP/out/llama-tiny-fp8-dynamic/config.json')); del c['quantization_config']; json.dump(c, open('$TMP/f8/config.json', 'w'))"
expect_fail "F8 input" "model.layers.0.mlp.down_proj.weight in $TMP/f8/model.safetensors is already F8_E4M3" --model "$TMP/f8" --out "$TMP/x" --scheme fp8-dynamic
# a NaN in a weight, found half-way: refused, naming the element; no --out left behind
mkdir -p "$TMP/nan"; cp "$GOLDEN/llama-tiny/config.json" "$TMP/nan/"
$PY - "$GOLDEN/llama-tiny/model.safetensors" "$TMP/nan/model.safetensors" <<'PY'
import json, struct, sys
raw = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", raw[:8])[0]
e = json.loads(raw[8:8 + n])["model.layers.2.mlp.up_proj.weight"]
at = 8 + n + e["data_offsets"][0] + 2 * (5 * 96 + 7)
raw[at:at + 2] = b"\xc0\x7f"  # bf16 NaN at [5, 7]
open(sys.argv[2], "wb").write(raw)
PY
expect_fail "NaN weight" "tensor model.layers.2.mlp.up_proj.weight in $TMP/nan/model.safetensors: element [5, 7] is NaN" \
    --model "$TMP/nan" --out "$TMP/x" --scheme fp8-dynamic
[ ! -e "$TMP/x" ] && echo "ok   a failed run leaves no --out" || { echo "FAIL $TMP/x left behind:"; ls -la "$TMP/x"; fails=$((fails+1)); }
# failing into an existing empty --out: it stays empty (no temporary files)
mkdir -p "$TMP/empty"
expect_fail "NaN weight into an empty --out" "is NaN" --model "$TMP/nan" --out "$TMP/empty" --scheme fp8-block
[ -z "$(ls -A "$TMP/empty")" ] && echo "ok   the empty --out stays empty" || { echo "FAIL left in --out:"; ls -A "$TMP/empty"; fails=$((fails+1)); }
# weights with nothing to quantize
mkdir -p "$TMP/nolayers"; echo '{"architectures": ["LlamaForCausalLM"]}' >"$TMP/nolayers/config.json"
$PY - "$TMP/nolayers/model.safetensors" <<'PY'
import json, struct, sys
h = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<2f", 1, 2))
PY
expect_fail "nothing to quantize" "to quantize" --model "$TMP/nolayers" --out "$TMP/x" --scheme fp8-dynamic
[ ! -e "$TMP/x" ] && echo "ok   still no --out" || { echo "FAIL $TMP/x left behind"; fails=$((fails+1)); }

if [ -n "$GEN" ]; then
    S=$SHARED/models/stories260k
    gen() { "$GEN" --backend cpu --prompt "Once upon a time" --max-tokens 48 --temperature 0 --json "$@" 2>"$TMP/gen.err"; }
    want=$(gen --model "$S" --quantization fp8)
    for scheme in fp8-dynamic fp8-weight-only fp8-block; do
        "$Q" --model "$S" --out "$TMP/st-$scheme" --scheme $scheme --quiet 2>"$TMP/q.err" ||
            { echo "FAIL quantize stories260k $scheme:"; cat "$TMP/q.err"; fails=$((fails+1)); continue; }
        got=$(gen --model "$TMP/st-$scheme")
        n=$(printf '%s' "$got" | $PY -c 'import json,sys; d=json.loads(sys.stdin.read()); print(len(d["token_ids"]))' 2>/dev/null)
        if [ "${n:-0}" -eq 48 ]; then echo "ok   stories260k $scheme loads in pdserve and generates 48 tokens"
        else echo "FAIL stories260k $scheme: pdserve-generate gave '$got'"; cat "$TMP/gen.err"; fails=$((fails+1)); fi
        if [ $scheme = fp8-dynamic ]; then
            [ -n "$want" ] && [ "$got" = "$want" ] && echo "ok   fp8-dynamic = the bf16 checkpoint with --quantization fp8 (48 greedy tokens)" ||
                { echo "FAIL fp8-dynamic '$got' vs --quantization fp8 '$want'"; fails=$((fails+1)); }
        fi
    done
fi

if [ $fails -ne 0 ]; then echo "$fails failures"; exit 1; fi
echo "all quantize CLI checks passed"
