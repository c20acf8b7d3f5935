#!/usr/bin/env bash
# gpu_run.sh -- Runs on the lent GPU machine, in the repository root, over what
# tools/gpu_package.sh packed into .gpu/: the CUDA op and golden-model tests and a short
# generation on stories260k with --backend cuda. Extra modes, in any combination:
#   bench     decode throughput of the Qwen3-0.6B shape (dummy weights) at batch 1 and 32
#   profile   per-kernel GPU times of Qwen3-0.6B decode steps (ncu, batch 1)
#   sanitize  the CUDA tests again under compute-sanitizer memcheck
# Logs go to $OUT (default /tmp/pd-gpu). Exit status: 0 when every step passed.
#   tools/gpu_run.sh [bench] [profile] [sanitize]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pd-gpu}
G=$PWD/.gpu
mkdir -p "$OUT"
LIB=/tmp/pd-gpu-lib
rm -rf "$LIB" && mkdir -p "$LIB"
if ! tar -xJf "$G/lib.tar.xz" -C "$LIB" 2>/dev/null; then
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$G/lib.tar.xz" "$LIB" || { echo "cannot unpack $G/lib.tar.xz"; exit 1; }
fi
export LD_LIBRARY_PATH="$LIB/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# cuBLAS is not packed: when the toolkit's is missing, take a Python wheel's.
if ldd "$G/bin/test_cuda_backend" | grep -q 'not found'; then
    d=$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '/proc/*' 2>/dev/null | head -1)")
    [ -n "$d" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
    ldd "$G/bin/test_cuda_backend" | grep 'not found' && echo "libraries missing"
fi
export PDSERVE_SHARED="$G/shared"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader

rc=0
step() { # step NAME COMMAND...: runs COMMAND, log in $OUT/NAME.log, prints its tail
    local name=$1 r
    shift
    echo "== $name: $*"
    "$@" >"$OUT/$name.log" 2>&1
    r=$?
    tail -n "${TAIL:-60}" "$OUT/$name.log"
    echo "== $name: exit $r"
    [ "$r" -eq 0 ] || rc=1
}
step test_cuda_backend "$G/bin/test_cuda_backend"
step test_cuda_golden "$G/bin/test_cuda_golden"
TAIL=8 step generate "$G/bin/pdserve-generate" --model "$PDSERVE_SHARED/models/stories260k" \
    --backend cuda --prompt "Once upon a time" --max-tokens 96 --temperature 0

has() { case " $MODES " in *" $1 "*) return 0 ;; esac; return 1; }
MODES="$*"
S=tools/shapes/qwen3-0.6b
if has bench; then
    for n in 1 32; do
        echo "-- batch $n" >>"$OUT/bench.log"
        "$G/bin/pdserve-generate" --model "$S" --load-format dummy --backend cuda \
            --random-prompt-len 128 --repeat "$n" --max-tokens 256 --ignore-eos \
            --temperature 0 >/dev/null 2>>"$OUT/bench.log" || rc=1
    done
    grep -E '^-- batch|tok/s' "$OUT/bench.log"
fi
if has profile; then
    # Skips the weight fills and the prefill: what is left are decode steps (about 340
    # kernels each: 11 ops x 28 layers, the lm_head and cuBLAS's own).
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    TAIL=70 step profile "$NCU" --clock-control none --metrics gpu__time_duration.sum \
        --launch-skip 1400 --launch-count 680 --print-summary per-kernel \
        "$G/bin/pdserve-generate" --model "$S" --load-format dummy --backend cuda \
        --random-prompt-len 128 --max-tokens 12 --ignore-eos --temperature 0
fi
if has sanitize; then
    TAIL=6 step sanitize_backend compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$G/bin/test_cuda_backend"
    TAIL=12 step sanitize_golden compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$G/bin/test_cuda_golden"
fi
exit $rc
