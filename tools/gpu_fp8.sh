#!/usr/bin/env bash
# gpu_fp8.sh -- The FP8 kernels' A/B runs on the lent GPU machine (issue #37), over what
# tools/gpu_package.sh packed (PD_GPU_DIR): test_cuda_fp8 (and test_cuda_fp8_fused, when
# packed) and test_cuda_golden; pdserve-bench-kernels --fp8 as it is, with programmatic
# dependent launches (PDSERVE_CUDA_PDL=1) and without cuBLASLt's FP8 fast accumulation
# (PDSERVE_CUDA_FP8_FAST_ACCUM_MAX_K=0), and --prefill-attention with the wgmma kernel and
# without (PDSERVE_CUDA_FLASH_WGMMA=0); the Llama-3-8B shape (dummy) batch-1 decode at bf16 and
# with FP8 weights (as it is and with PDL), and FP8 prefill of 2k-token prompts with and
# without fast accumulation and without the quantization fused into RMSNorm / SwiGLU
# (PDSERVE_CUDA_FP8_FUSED_QUANT=0), with the FP8 KV cache too, and bf16 / FP8 with the prefill
# attention on mma.sync, each next to the floors of this run; "profile": the GPU time of
# each kernel of one 2048-token prefill at bf16 and FP8 (ncu, when it reads the counters);
# "profile_decode": the same for 8 decode steps of 64 sequences op by op (bf16; FP8 weights + KV).
# "decomp": the batch-1 FP8 and bf16 decode steps with parts of the persistent kernel off
# (PDSERVE_CUDA_DL_DEBUG; DECOMP_VARIANTS="QUANT BITS [INFLIGHT|-];..." replaces the list).
# "stalls": where the batch-1 persistent kernel's warps wait (ncu's warp states, bank conflicts
# and the stall samples of each SASS instruction, FP8 and bf16; STALLS_QUANT picks, an entry
# QUANT@BITS with PDSERVE_CUDA_DL_DEBUG=BITS).
# Logs in $OUT/fp8ab/ and $OUT/fp8ab.tgz; a summary at the end. FP8AB_SKIP="tests kernels 8b
# profile profile_decode decomp stalls" leaves parts out.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
. tools/gpu_env.sh
F="$OUT/fp8ab"
mkdir -p "$F"
rc=0
# ncu, for the parts "profile", "profile_decode" and "stalls"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
skip() { case " ${FP8AB_SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
run() { # run NAME [ENV=V ...] COMMAND...: output in $F/NAME.log
    local name=$1 r
    shift
    echo "== $name: $*"
    env "$@" >"$F/$name.log" 2>&1
    r=$?
    grep -E 'FAILED|passed|cases|exit|error' "$F/$name.log" | tail -n 4
    [ "$r" -eq 0 ] || { echo "== $name: exit $r"; rc=1; }
}
if ! skip tests; then
    run test_cuda_fp8 "$G/bin/test_cuda_fp8"
    [ -x "$G/bin/test_cuda_fp8_fused" ] && run test_cuda_fp8_fused "$G/bin/test_cuda_fp8_fused"
    run test_cuda_golden "$G/bin/test_cuda_golden"
fi
if ! skip kernels; then
    run kernels "$G/bin/pdserve-bench-kernels" --floor --fp8
    run kernels_pdl PDSERVE_CUDA_PDL=1 "$G/bin/pdserve-bench-kernels" --fp8
    run kernels_promote PDSERVE_CUDA_FP8_FAST_ACCUM_MAX_K=0 "$G/bin/pdserve-bench-kernels" --fp8
    grep -E 'llama3-8b' "$F/kernels.log" | awk '$5 <= 8 || $5 == 2048'
    echo "-- with PDSERVE_CUDA_PDL=1"
    grep -E 'llama3-8b' "$F/kernels_pdl.log" | awk '$5 <= 8'
    echo "-- with PDSERVE_CUDA_FP8_FAST_ACCUM_MAX_K=0"
    grep -E 'llama3-8b' "$F/kernels_promote.log" | awk '$5 == 2048'
    run prefill_attn "$G/bin/pdserve-bench-kernels" --prefill-attention
    run prefill_attn_mma PDSERVE_CUDA_FLASH_WGMMA=0 "$G/bin/pdserve-bench-kernels" --prefill-attention
    echo "-- prefill attention alone (wgmma, then mma.sync: PDSERVE_CUDA_FLASH_WGMMA=0)"
    grep -A 7 '^## attention_prefill' "$F/prefill_attn.log" | tail -n 7
    grep -A 7 '^## attention_prefill' "$F/prefill_attn_mma.log" | tail -n 7
fi
if ! skip 8b; then
    BW=$(sed -n 's/.*FLOOR copy_gbps=\([0-9.]*\).*/\1/p' "$F/kernels.log" | tail -n 1)
    TF=$(sed -n 's/.*FLOOR.*gemm_tflops=\([0-9.]*\).*/\1/p' "$F/kernels.log" | tail -n 1)
    FL=()
    [ -n "$BW" ] && FL+=(--bandwidth-gbs "$BW")
    [ -n "$TF" ] && FL+=(--gemm-tflops "$TF")
    L8=tools/shapes/llama3-8b
    DEC=(--model "$L8" --load-format dummy --backend cuda --kv-cache-mb 4096 --num-requests 1
         --input-len 128 --output-len 256 --max-num-seqs 1 "${FL[@]}" --json)
    PRE=(--model "$L8" --load-format dummy --backend cuda --kv-cache-mb 8192 --num-requests 8
         --input-len 2048 --output-len 1 --max-num-batched-tokens 2048 "${FL[@]}" --json)
    run decode_bf16 "$G/bin/pdserve-bench-offline" "${DEC[@]}"
    run decode_fp8 "$G/bin/pdserve-bench-offline" "${DEC[@]}" --quantization fp8
    run decode_fp8_pdl PDSERVE_CUDA_PDL=1 "$G/bin/pdserve-bench-offline" "${DEC[@]}" --quantization fp8
    run decode_fp8_ops PDSERVE_CUDA_FUSED_DECODE=0 "$G/bin/pdserve-bench-offline" "${DEC[@]}" --quantization fp8
    run prefill_bf16 "$G/bin/pdserve-bench-offline" "${PRE[@]}"
    run prefill_fp8 "$G/bin/pdserve-bench-offline" "${PRE[@]}" --quantization fp8
    run prefill_fp8_promote PDSERVE_CUDA_FP8_FAST_ACCUM_MAX_K=0 "$G/bin/pdserve-bench-offline" "${PRE[@]}" --quantization fp8
    run prefill_fp8_unfused PDSERVE_CUDA_FP8_FUSED_QUANT=0 "$G/bin/pdserve-bench-offline" "${PRE[@]}" --quantization fp8
    run prefill_fp8_kv "$G/bin/pdserve-bench-offline" "${PRE[@]}" --quantization fp8 --kv-cache-dtype fp8
    run prefill_bf16_mma PDSERVE_CUDA_FLASH_WGMMA=0 "$G/bin/pdserve-bench-offline" "${PRE[@]}"
    run prefill_fp8_mma PDSERVE_CUDA_FLASH_WGMMA=0 "$G/bin/pdserve-bench-offline" "${PRE[@]}" --quantization fp8
    echo "== summary (Llama-3-8B shape; copy $BW GB/s, GEMM $TF TFLOP/s in this run)"
    for f in decode_bf16 decode_fp8 decode_fp8_pdl decode_fp8_ops prefill_bf16 prefill_fp8 prefill_fp8_promote prefill_fp8_unfused prefill_fp8_kv prefill_bf16_mma prefill_fp8_mma; do
        env -u LD_LIBRARY_PATH python3 -c '
import json, sys
try:
    d = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
except Exception:
    print("%-18s (no result)" % sys.argv[2]); sys.exit(0)
if sys.argv[2].startswith("decode"):
    ms = 1e3 / d["decode_tok_s"]
    if d.get("bandwidth_gbs"):
        fl = d["weight_bytes_per_step"] / (d["bandwidth_gbs"] * 1e9) * 1e3
        print("%-18s %.3f ms/token, weights at the copy rate %.3f ms: %.2fx" % (sys.argv[2], ms, fl, ms / fl))
    else:
        print("%-18s %.3f ms/token, %d weight bytes a step (no floor: kernels skipped)" % (sys.argv[2], ms, d["weight_bytes_per_step"]))
else:
    print("%-18s %.0f prompt tok/s" % (sys.argv[2], d["prefill_tok_s"]))' "$F/$f.log" "$f"
    done
fi
summarize() { # summarize NCU_LOG: the kernels' GPU time, largest first
    env -u LD_LIBRARY_PATH python3 tools/ncu_summary.py "$1"
}
if ! skip profile; then
    for q in none fp8; do
        "$NCU" --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
            "$G/bin/pdserve-generate" --model tools/shapes/llama3-8b --load-format dummy \
            --backend cuda --kv-cache-mb 4096 --quantization "$q" --random-prompt-len 2048 \
            --max-tokens 1 --ignore-eos --temperature 0 >"$F/profile_$q.log" 2>&1
        echo "== profile $q (one 2048-token prefill; kernel, calls, total us)"
        summarize "$F/profile_$q.log"
    done
fi
if ! skip profile_decode; then
    # decode steps of 64 sequences op by op (the goodput workloads' decode batches): 64
    # prompts of 128 tokens, 8 steps; the fill and prefill kernels are listed too
    for q in none fp8; do
        kv=auto; [ "$q" = fp8 ] && kv=fp8
        "$NCU" --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
            "$G/bin/pdserve-bench-offline" --model tools/shapes/llama3-8b --load-format dummy \
            --backend cuda --kv-cache-mb 4096 --quantization "$q" --kv-cache-dtype "$kv" \
            --num-requests 64 --input-len 128 --output-len 9 --max-num-seqs 64 \
            --enforce-eager >"$F/profile_decode_$q.log" 2>&1
        echo "== profile decode $q (64 sequences, 8 steps op by op + their prefill; kernel, calls, total us)"
        summarize "$F/profile_decode_$q.log"
    done
fi
if ! skip decomp; then
    # where the batch-1 FP8 decode step's time goes (the persistent kernel's debug bits,
    # PDSERVE_CUDA_DL_DEBUG: 1 no arithmetic, 2 no FP8 input quantization, 8 no weight stream;
    # timing only, wrong tokens) and the weight stream's slots in flight; bf16 beside
    DEC1=(--model tools/shapes/llama3-8b --load-format dummy --backend cuda --kv-cache-mb 4096
          --num-requests 1 --input-len 128 --output-len 256 --max-num-seqs 1 --json)
    echo "== decomposition (Llama-3-8B shape, batch 1; ms/token)"
    IFS=';' read -ra VARIANTS <<<"${DECOMP_VARIANTS:-fp8 0;fp8 1;fp8 2;fp8 8;fp8 9;fp8 11;bf16 0;bf16 1;bf16 8;bf16 9}"
    for v in "${VARIANTS[@]}"; do
        set -- $v
        q=$1 dbg=$2 inf=${3:--}
        a=("${DEC1[@]}")
        [ "$q" = fp8 ] && a+=(--quantization fp8)
        e=(PDSERVE_CUDA_DL_DEBUG=$dbg)
        name="decomp_${q}_${dbg}"
        [ "$inf" != - ] && e+=(PDSERVE_CUDA_DL_INFLIGHT=$inf) && name+="_i$inf"
        env "${e[@]}" "$G/bin/pdserve-bench-offline" "${a[@]}" >"$F/$name.log" 2>&1
        env -u LD_LIBRARY_PATH python3 -c '
import json, sys
try:
    d = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
    print("%-22s %.3f" % (sys.argv[2], 1e3 / d["decode_tok_s"]))
except Exception:
    print("%-22s (no result)" % sys.argv[2])' "$F/$name.log" "$name"
    done
fi
if ! skip stalls; then
    # where the batch-1 persistent decode kernel's warps wait (ncu: one launch, eager, after
    # 8 steps; the warp states, the scheduler, shared-memory bank conflicts, and the stall
    # samples of each SASS instruction); STALLS_QUANT="fp8 none" by default
    for v in ${STALLS_QUANT:-fp8 none}; do
        q=${v%@*} dbg=0 # an entry QUANT@BITS runs with PDSERVE_CUDA_DL_DEBUG=BITS
        [ "$v" != "$q" ] && dbg=${v#*@}
        v=${q}_$dbg
        PDSERVE_CUDA_DL_DEBUG=$dbg "$NCU" --clock-control none -k regex:decode_layers_kernel \
            --launch-skip 8 --launch-count 1 --import-source no --section WarpStateStats \
            --section SourceCounters --section SchedulerStats --section LaunchStats \
            --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
            --section InstructionStats --metrics \
            l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed_op_shared_ld.sum \
            -f -o "$F/stalls_$v" "$G/bin/pdserve-bench-offline" --model tools/shapes/llama3-8b \
            --load-format dummy --backend cuda --kv-cache-mb 4096 --quantization "$q" \
            --num-requests 1 --input-len 128 --output-len 16 --max-num-seqs 1 \
            --enforce-eager >"$F/stalls_$v.log" 2>&1
        "$NCU" -i "$F/stalls_$v.ncu-rep" --page details >"$F/stalls_${v}_details.txt" 2>&1
        "$NCU" -i "$F/stalls_$v.ncu-rep" --page source --csv --print-source sass \
            >"$F/stalls_${v}_sass.csv" 2>&1
        echo "== stalls $v: $(wc -l <"$F/stalls_${v}_sass.csv") SASS lines"
        grep -E "Duration|Bank|bank|Warp Cycles Per Issued|Issued Warp|No Eligible|Stall" \
            "$F/stalls_${v}_details.txt" | head -n 30
    done
fi
tar -czf "$OUT/fp8ab.tgz" -C "$OUT" fp8ab 2>/dev/null
exit $rc
