#!/usr/bin/env bash
# test_plan.sh -- pdserve-plan end to end on the CPU (issue #28): two "GPUs" (the CPU backend
# ignores --device), the 1P1D split and 2 colocated instances of stories260k, each started with
# pdserve-up and searched with pdserve-bench --find-goodput (small and bounded); the table must
# have both rows with a goodput, a recommendation and its Kubernetes replica counts, and
# plan.json / plan.svg must be written and well formed; the routers get the SLO of --bench-args,
# every instance's metrics are kept after its search. FP8 weights and KV cache on every instance
# (--quantization / --kv-cache-dtype), recorded in plan.json.
# usage: test_plan.sh BIN_DIR SHARED_DIR
set -uo pipefail
BIN=$1 SHARED=$2
MODEL=$SHARED/models/stories260k
[ -d "$MODEL" ] || { echo "no shared data: skip"; exit 77; }
OUT=$(mktemp -d /tmp/pdserve-plan-test.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
export UCX_WARN_UNUSED_ENV_VARS=n PDSERVE_LOG_LEVEL=warn
fail=0
check() { if eval "$1"; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }
PDSERVE_METRICS_PORT=0 timeout 240 "$BIN/pdserve-plan" --model "$MODEL" --gpus 0,1 --out "$OUT/plan" \
    --quantization fp8 --kv-cache-dtype fp8 \
    --instance-args "--backend cpu --threads 1 --kv-cache-mb 32" \
    --bench-args "--input-len 16:32 --output-len 8:16 --rate 10 --num-requests 24 --warmup-requests 2 --slo-ttft-ms 500 --slo-tpot-ms 50 --max-probes 3 --goodput-tolerance 0.3 --seed 1" \
    >"$OUT/stdout" 2>"$OUT/stderr"
rc=$?
cat "$OUT/stdout"
check "[ $rc -eq 0 ]" "pdserve-plan exits 0 (got $rc)"
check "grep -Eq '^1P1D +(>=)?[0-9.]+ req/s' '$OUT/stdout'" "the 1P1D row has a goodput"
check "grep -Eq '^colocated-x2 +(>=)?[0-9.]+ req/s' '$OUT/stdout'" "the colocated x2 row has a goodput"
check "grep -q '^deploy: ' '$OUT/stdout'" "a recommendation"
check "grep -Eq '^kubernetes: ' '$OUT/stdout'" "its Kubernetes replica counts"
check "python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d[\"gpus\"]==2 and len(d[\"deployments\"])==2 and d[\"best\"] and d[\"quantization\"]==\"fp8\" and d[\"kv_cache_dtype\"]==\"fp8\"' '$OUT/plan/plan.json'" "plan.json is well formed, with the quantization and KV dtype"
check "grep -q 'pdserve_model_info{.*quantization=\"fp8 (at load)\",kv_cache_dtype=\"F8_E4M3\"' '$OUT/plan/1P1D/metrics/prefill-0.prom' && grep -q 'quantization=\"fp8 (at load)\",kv_cache_dtype=\"F8_E4M3\"' '$OUT/plan/1P1D/metrics/decode-0.prom'" "the instances ran FP8 weights and KV cache (pdserve_model_info)"
"$BIN/pdserve-plan" --model "$MODEL" --gpus 0,1 --kv-cache-dtype fp4 >"$OUT/bad" 2>&1
check "[ $? -eq 2 ] && grep -q 'kv-cache-dtype fp4' '$OUT/bad'" "a bad --kv-cache-dtype is refused naming it"
"$BIN/pdserve-plan" --model "$MODEL" --gpus 0,1,2 --tensor-parallel 2 >"$OUT/bad2" 2>&1
check "[ $? -eq 2 ] && grep -q 'at least 4 GPUs' '$OUT/bad2'" "tensor-parallel degrees that do not fit the GPUs are refused"
"$BIN/pdserve-plan" --model "$MODEL" --gpus 0,1,2,3 --prefill-tp 2 --splits 2:1 >"$OUT/bad3" 2>&1
check "[ $? -eq 2 ] && grep -q 'split 2:1 needs' '$OUT/bad3'" "a split that needs more GPUs at its degrees is refused"
check "python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d[\"tensor_parallel\"]=={\"prefill\": 1, \"decode\": 1}' '$OUT/plan/plan.json'" "plan.json records the tensor-parallel degrees"
check "python3 -c 'import sys, xml.dom.minidom as m; m.parse(sys.argv[1])' '$OUT/plan/plan.svg'" "plan.svg is well-formed XML"
check "[ -f '$OUT/plan/1P1D/result.json' ] && [ -f '$OUT/plan/colocated-x2/result.json' ]" "each search's JSON is kept"
# The routers ran with the searches' objectives, and every instance's metrics were kept.
for d in 1P1D colocated-x2; do
    check "grep -q '^pdserve_slo_ttft_seconds 0.5$' '$OUT/plan/$d/metrics/router.prom' && grep -Eq '^pdserve_slo_tpot_seconds 0.05' '$OUT/plan/$d/metrics/router.prom'" "$d: the router had the SLO of --bench-args"
done
check "[ -s '$OUT/plan/1P1D/metrics/prefill-0.prom' ] && [ -s '$OUT/plan/1P1D/metrics/decode-0.prom' ]" "1P1D: each instance's metrics after the search"
check "grep -q 'prefill decisions: .*where=\"local\",why=\"colocated\"' '$OUT/stderr'" "the router's prefill decisions are printed"
[ $fail -eq 0 ] || tail -20 "$OUT/stderr"
exit $fail
