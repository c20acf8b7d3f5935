#!/usr/bin/env bash
# gpu_moe.sh -- The mixture-of-experts runs of issue #39 on the lent GPU machine, over what
# tools/gpu_package.sh packed (PD_GPU_DIR): test_cuda_moe (the CUDA routing and combination
# against the CPU's) and test_cuda_golden (the MoE goldens' logits on cuda against cpu), then
# the Qwen3-30B-A3B shape (dummy weights) next to the floors of this run
# (pdserve-bench-kernels --floor): batch-1 decode against its active weights + KV at the copy
# rate, batch-64 decode tokens/s beside the dense Llama-3-8B's, and 2k-token prefill against
# the GEMM rate over active FLOPs. Logs in $OUT/moe/ and $OUT/moe.tgz; a summary at the end.
# Part "ab": batch-64 decode with the experts on the row-streaming kernel only
# (PDSERVE_CUDA_MOE_GEMM_ROWS=0) and on the GEMMs (=1), and the prefill on the GEMMs' 128-row
# tiles (PDSERVE_CUDA_MOE_GEMM_BM=128), beside the defaults. Part "profile": ncu's GPU
# time a kernel for one 2048-token prefill and two batch-1 decode steps (eager), each run cut
# at MOE_PROFILE_S seconds (240), with MOE_PROFILE_ARGS added to both (e.g. "--quantization
# fp8").
# Part "decode1ab": batch-1 decode under each of MOE_DECODE1_VARIANTS (space-separated; each a
# comma-separated list of VAR=VALUE, e.g. "PDSERVE_CUDA_PDL=1,PDSERVE_CUDA_GEMV_MAX_MB=16"),
# beside the defaults; skipped when that list is empty.
# Part "fp8": the same three runs with the experts (and every other linear) in FP8
# (--quantization fp8: per-channel weights, activations per token), the floor of batch-1 decode
# then the FP8 active bytes.
# MOE_SKIP="tests 30b fp8 8b ab decode1ab profile" leaves parts out; MOE_MODEL replaces the shape (e.g.
# tools/shapes/mixtral-8x7b).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
. tools/gpu_env.sh
F="$OUT/moe"
mkdir -p "$F"
rc=0
skip() { case " ${MOE_SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
run() { # run NAME COMMAND...: output in $F/NAME.log
    local name=$1 r
    shift
    echo "== $name: $*"
    "$@" >"$F/$name.log" 2>&1
    r=$?
    grep -E 'FAILED|passed|routing equal|moe' "$F/$name.log" | tail -n 6
    [ "$r" -eq 0 ] || { echo "== $name: exit $r"; rc=1; }
}
if ! skip tests; then
    run test_cuda_moe "$G/bin/test_cuda_moe"
    run test_cuda_golden "$G/bin/test_cuda_golden"
fi
"$G/bin/pdserve-bench-kernels" --floor >"$F/floor.log" 2>&1
BW=$(sed -n 's/.*FLOOR copy_gbps=\([0-9.]*\).*/\1/p' "$F/floor.log" | tail -n 1)
TF=$(sed -n 's/.*FLOOR.*gemm_tflops=\([0-9.]*\).*/\1/p' "$F/floor.log" | tail -n 1)
FL=()
[ -n "$BW" ] && FL+=(--bandwidth-gbs "$BW")
[ -n "$TF" ] && FL+=(--gemm-tflops "$TF")
M=${MOE_MODEL:-tools/shapes/qwen3-30b-a3b}
bench() { # bench NAME MODEL [ENV=V ...] ARGS...: pdserve-bench-offline --json
    local name=$1 model=$2 e=()
    shift 2
    while [ $# -gt 0 ] && [[ $1 == *=* && $1 != --* ]]; do e+=("$1"); shift; done
    run "$name" env "${e[@]}" "$G/bin/pdserve-bench-offline" --model "$model" \
        --load-format dummy --backend cuda --kv-cache-mb 8192 "${FL[@]}" --json "$@"
}
if ! skip 30b; then
    bench moe_decode1 "$M" --num-requests 1 --input-len 128 --output-len 256 --max-num-seqs 1
    bench moe_decode64 "$M" --num-requests 64 --input-len 1024 --output-len 256 --max-num-seqs 64
    bench moe_prefill "$M" --num-requests 8 --input-len 2048 --output-len 1 \
        --max-num-batched-tokens 2048
fi
if ! skip fp8; then
    bench moe_fp8_decode1 "$M" --quantization fp8 --num-requests 1 --input-len 128 \
        --output-len 256 --max-num-seqs 1
    bench moe_fp8_decode64 "$M" --quantization fp8 --num-requests 64 --input-len 1024 \
        --output-len 256 --max-num-seqs 64
    bench moe_fp8_prefill "$M" --quantization fp8 --num-requests 8 --input-len 2048 \
        --output-len 1 --max-num-batched-tokens 2048
fi
if ! skip ab; then
    bench moe_decode64_rows "$M" PDSERVE_CUDA_MOE_GEMM_ROWS=0 --num-requests 64 \
        --input-len 1024 --output-len 256 --max-num-seqs 64
    bench moe_decode64_gemm "$M" PDSERVE_CUDA_MOE_GEMM_ROWS=1 --num-requests 64 \
        --input-len 1024 --output-len 256 --max-num-seqs 64
    bench moe_prefill_bm128 "$M" PDSERVE_CUDA_MOE_GEMM_BM=128 --num-requests 8 \
        --input-len 2048 --output-len 1 --max-num-batched-tokens 2048
fi
D1AB=()
if ! skip decode1ab && [ -n "${MOE_DECODE1_VARIANTS:-}" ]; then
    i=0
    for v in $MOE_DECODE1_VARIANTS; do
        i=$((i + 1))
        IFS=, read -r -a ev <<<"$v"
        echo "== moe_decode1_v$i: $v"
        bench "moe_decode1_v$i" "$M" "${ev[@]}" --num-requests 1 --input-len 128 \
            --output-len 256 --max-num-seqs 1
        D1AB+=("moe_decode1_v$i")
    done
fi
if ! skip profile; then
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    if [ -n "$NCU" ]; then
        # (the dummy weights' fill kernels, thousands of them, are not profiled)
        NK=(--clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel
            --kernel-name-base function --kernel-name "regex:^(?!fill_kernel)")
        timeout "${MOE_PROFILE_S:-240}" "$NCU" "${NK[@]}" "$G/bin/pdserve-bench-offline" \
            --model "$M" --load-format dummy --backend cuda --kv-cache-mb 4096 \
            --num-requests 1 --input-len 2048 --output-len 1 --max-num-batched-tokens 2048 \
            --enforce-eager ${MOE_PROFILE_ARGS:-} >"$F/profile_prefill.log" 2>&1
        echo "== profile: one 2048-token prefill (kernel, calls, total us)"
        env -u LD_LIBRARY_PATH python3 tools/ncu_summary.py "$F/profile_prefill.log" 24
        timeout "${MOE_PROFILE_S:-240}" "$NCU" "${NK[@]}" "$G/bin/pdserve-generate" \
            --model "$M" --load-format dummy --backend cuda --kv-cache-mb 4096 \
            --random-prompt-len 128 --max-tokens 3 --ignore-eos --temperature 0 --enforce-eager \
            ${MOE_PROFILE_ARGS:-} >"$F/profile_decode.log" 2>&1
        echo "== profile: batch 1, a 128-token prompt and 2 decode steps eager" \
             "(kernel, calls, total us)"
        env -u LD_LIBRARY_PATH python3 tools/ncu_summary.py "$F/profile_decode.log" 24
    else
        echo "== profile: no ncu on this machine"
    fi
fi
if ! skip 8b; then
    bench dense_decode64 tools/shapes/llama3-8b --num-requests 64 --input-len 1024 \
        --output-len 256 --max-num-seqs 64
fi
echo "== summary ($M; copy $BW GB/s, GEMM $TF TFLOP/s in this run)"
for f in moe_decode1 "${D1AB[@]}" moe_decode64 moe_decode64_rows moe_decode64_gemm moe_prefill \
    moe_prefill_bm128 moe_fp8_decode1 moe_fp8_decode64 moe_fp8_prefill dense_decode64; do
    [ -f "$F/$f.log" ] || continue
    env -u LD_LIBRARY_PATH python3 -c '
import json, sys
try:
    d = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
except Exception:
    print("%-15s (no result)" % sys.argv[2]); sys.exit(0)
n = sys.argv[2]
if n.startswith("moe_decode1") or n.startswith("moe_fp8_decode1"):
    ms = 1e3 / d["decode_tok_s"]
    fl = d["weight_bytes_per_step"] / (d["bandwidth_gbs"] * 1e9) * 1e3 if d.get("bandwidth_gbs") else float("nan")
    print("%-16s %.3f ms/token, active weights at the copy rate %.3f ms: %.2fx" % (n, ms, fl, ms / fl))
elif "decode64" in n:
    print("%-15s %.0f decode tok/s (mean batch %.1f)" % (n, d["decode_tok_s"], d["mean_batch"]))
else:
    print("%-15s %.0f prompt tok/s, %.0f%% of the GEMM rate over active FLOPs" % (n, d["prefill_tok_s"], 100 * d.get("prefill_floor_ratio", 0)))' "$F/$f.log" "$f"
done
tar -czf "$OUT/moe.tgz" -C "$OUT" moe 2>/dev/null
exit $rc
