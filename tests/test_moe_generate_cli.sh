#!/usr/bin/env bash
# test_moe_generate_cli.sh -- pdserve-generate end to end on the mixture-of-experts goldens
# (tests/data/golden-moe, no tokenizer: prompts as ids): every case's prompt in one batch gives
# HF's greedy ids up to the first step whose reference margin is under 0.01 (the dense
# goldens' margin rule), on one rank and at --tensor-parallel 2; --quantization fp8 and dummy
# weights run; what cannot run is refused with a clear message and a clean exit.
# usage: test_moe_generate_cli.sh PATH/TO/pdserve-generate SOURCE_DIR
set -u
GEN=$1
GOLD=$2/tests/data/golden-moe
[ -f "$GOLD/mixtral-tiny/golden.json" ] || { echo "no MoE goldens: skip"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0

# prompt_args MODEL: --prompt-ids for each case of the model's golden.json
prompt_args() {
    python3 - "$GOLD/$1/golden.json" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["cases"]:
    print("--prompt-ids " + ",".join(map(str, c["prompt_ids"])), end=" ")
PY
}

# check_greedy MODEL OUT: OUT's JSON lines against the golden greedy ids by the margin rule
check_greedy() {
    python3 - "$GOLD/$1/golden.json" "$2" <<'PY'
import json, sys
cases = json.load(open(sys.argv[1]))["cases"]
got = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
assert len(got) == len(cases), f"{len(got)} results for {len(cases)} prompts"
compared = 0
for g in got:
    c = cases[g["index"]]
    assert len(g["token_ids"]) == len(c["greedy_ids"]), g
    for i, (a, b) in enumerate(zip(g["token_ids"], c["greedy_ids"])):
        if c["greedy_margins"][i] < 0.01:
            break
        assert a == b, f"prompt {g['index']} step {i}: {a}, reference {b}"
        compared += 1
print(f"{compared} tokens")
PY
}

for m in qwen3-moe-tiny qwen3-moe-tiny-step2 mixtral-tiny; do
    for tp in 1 2; do
        # shellcheck disable=SC2046
        if ! "$GEN" --model "$GOLD/$m" --backend cpu --tensor-parallel $tp $(prompt_args $m) \
                --max-tokens 24 --temperature 0 --ignore-eos --json >"$TMP/out" 2>"$TMP/err"; then
            echo "FAIL $m TP $tp: exit $?"; cat "$TMP/err"; fails=$((fails+1)); continue
        fi
        if r=$(check_greedy $m "$TMP/out"); then
            echo "ok   $m TP $tp: greedy ids as HF's ($r compared)"
        else
            echo "FAIL $m TP $tp: $r"; fails=$((fails+1))
        fi
    done
done

# FP8 at load (the experts through the FP8 op set) and dummy weights of a MoE shape run.
for args in "--quantization fp8" "--load-format dummy"; do
    # shellcheck disable=SC2086
    if "$GEN" --model "$GOLD/qwen3-moe-tiny" --backend cpu $args --prompt-ids 57,106,302 \
            --max-tokens 8 --temperature 0 --ignore-eos --json >"$TMP/out" 2>"$TMP/err" &&
        python3 -c "import json,sys; assert len(json.loads(open(sys.argv[1]).readline())['token_ids']) == 8" "$TMP/out"; then
        echo "ok   $args runs"
    else
        echo "FAIL $args"; cat "$TMP/err"; fails=$((fails+1))
    fi
done

# expect_fail NAME SUBSTRING ARGS...: a clean non-zero exit (no signal) naming the problem
expect_fail() {
    local name=$1 want=$2; shift 2
    "$GEN" "$@" >"$TMP/out" 2>"$TMP/err"
    local rc=$?
    if [ $rc -eq 0 ] || [ $rc -ge 126 ]; then
        echo "FAIL $name: exit $rc"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    if ! grep -qF -- "$want" "$TMP/err"; then
        echo "FAIL $name: stderr lacks '$want':"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    echo "ok   $name"
}
expect_fail "TP 3 (heads do not divide)" "do not divide" --model "$GOLD/qwen3-moe-tiny" \
    --backend cpu --tensor-parallel 3 --prompt-ids 1,2 --max-tokens 2
expect_fail "text prompt without a tokenizer" "--prompt-ids" --model "$GOLD/mixtral-tiny" \
    --backend cpu --prompt "hello" --max-tokens 2
mkdir -p "$TMP/shared"
sed 's/"num_experts_per_tok": 4/"num_experts_per_tok": 4, "shared_expert_intermediate_size": 32/' \
    "$GOLD/qwen3-moe-tiny/config.json" >"$TMP/shared/config.json"
expect_fail "shared experts refused" "shared_expert_intermediate_size" --model "$TMP/shared" \
    --backend cpu --load-format dummy --prompt-ids 1,2 --max-tokens 2

[ $fails -eq 0 ] && echo "all passed" || echo "$fails failed"
[ $fails -eq 0 ]
