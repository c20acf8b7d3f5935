#!/usr/bin/env bash
# gpu_run.sh -- Runs on the lent GPU machine, in the repository root, over what
# tools/gpu_package.sh packed into .gpu/: the CUDA op and golden-model tests and a short
# generation on stories260k with --backend cuda. Extra modes, in any combination:
#   bench     decode throughput of the Qwen3-0.6B shape (dummy weights) at batch 1 and 32,
#             with the split-KV decode attention and without (PDSERVE_CUDA_SPLIT_KV=0)
#   kvshare   two pdserve-generate processes at once on the one GPU, each sizing its KV cache
#             with --gpu-memory-utilization 0.45 (both must start and finish)
#   profile   per-kernel GPU times of Qwen3-0.6B decode steps (ncu, batch 1)
#   sanitize  the CUDA tests again under compute-sanitizer memcheck
#   services  the serving stack on the GPU: pdserve-up on stories260k with --backend cuda, once
#             disaggregated (1 prefill + 1 decode, KV through the pinned host mirrors) and once
#             colocated; a greedy completion streamed by pdserve-cli must match the golden
#             story (the first 64 tokens; bf16 may drift later) and TTFT / TPOT are timed
#             (client side, process start included); logs in $OUT/services-*/
# Logs go to $OUT (default /tmp/pd-gpu). PD_GPU_DIR names the package folder (default .gpu). Exit status: 0 when every step passed.
#   tools/gpu_run.sh [bench] [profile] [sanitize]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pd-gpu}
G=$PWD/${PD_GPU_DIR:-.gpu}
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
    for split in 1 0; do
        for n in 1 32; do
            echo "-- batch $n, PDSERVE_CUDA_SPLIT_KV=$split" >>"$OUT/bench.log"
            PDSERVE_CUDA_SPLIT_KV=$split "$G/bin/pdserve-generate" --model "$S" --load-format dummy \
                --backend cuda --random-prompt-len 128 --repeat "$n" --max-tokens 256 \
                --ignore-eos --temperature 0 >/dev/null 2>>"$OUT/bench.log" || rc=1
        done
    done
    grep -E '^-- batch|tok/s|KV cache' "$OUT/bench.log"
fi
if has kvshare; then
    for i in 1 2; do
        "$G/bin/pdserve-generate" --model "$S" --load-format dummy --backend cuda \
            --gpu-memory-utilization 0.45 --random-prompt-len 128 --repeat 8 --max-tokens 2000 \
            --ignore-eos --temperature 0 >/dev/null 2>"$OUT/kvshare-$i.log" &
        eval "kv$i=\$!"
        sleep 4 # the second one starts while the first holds its pool
    done
    wait "$kv1"; r1=$?
    wait "$kv2"; r2=$?
    [ "$r1" -eq 0 ] && [ "$r2" -eq 0 ] || rc=1
    grep -hE 'KV cache|tok/s|error|failed' "$OUT"/kvshare-*.log
    echo "== kvshare: exit $r1 $r2"
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
if has services; then
    M="$PDSERVE_SHARED/models/stories260k"
    services() { # services NAME [pdserve-up flags]
        local name=$1 logs="$OUT/services-$1" up addr
        shift
        mkdir -p "$logs"
        echo "== services $name: pdserve-up $* -- --backend cuda"
        # --kv-cache-mb: both instances share the GPU (the default sizes each pool from 0.9 of
        # the device's memory) and each mirrors its pool in host memory.
        PDSERVE_LOG_DIR="$logs" "$G/bin/pdserve-up" --model "$M" --port 0 "$@" -- --backend cuda \
            --kv-cache-mb 256 \
            >"$logs/up.out" 2>"$logs/up.err" &
        up=$!
        for _ in $(seq 900); do
            grep -q '^ROUTER ' "$logs/up.out" 2>/dev/null && break
            kill -0 "$up" 2>/dev/null || break
            sleep 0.1
        done
        addr=$(awk '/^ROUTER /{print $2; exit}' "$logs/up.out")
        if [ -z "$addr" ]; then
            echo "== services $name: the stack did not start"
            tail -n 30 "$logs"/*.log "$logs/up.err" 2>/dev/null
            kill -TERM "$up" 2>/dev/null; wait "$up" 2>/dev/null
            rc=1
            return
        fi
        # The check runs without the packed libraries (python links the system OpenSSL).
        env -u LD_LIBRARY_PATH PD_LIBS="$LD_LIBRARY_PATH" python3 - "$G/bin/pdserve-cli" "$addr" \
            "$M/golden.json" "$logs" <<'PY'
import json, os, subprocess, sys, time
cli, addr, golden, logs = sys.argv[1:5]
env = dict(os.environ, LD_LIBRARY_PATH=os.environ["PD_LIBS"])
case = json.load(open(golden))["cases"][0]
want = case["greedy_ids"]
base = [cli, "generate", "--addr", addr, "--temperature", "0", "--max-tokens", str(len(want)),
        "--prompt", case.get("prompt", "")]
r = subprocess.run(base + ["--json"], env=env, capture_output=True, text=True, timeout=120)
open(os.path.join(logs, "cli.json"), "w").write(r.stdout + r.stderr)
if r.returncode != 0:
    print("cli failed:", r.stderr.strip()[-500:]); sys.exit(1)
got = json.loads(r.stdout)
ids, text = got["token_ids"], got["text"]
first = next((i for i in range(min(len(ids), len(want))) if ids[i] != want[i]), min(len(ids), len(want)))
same64 = ids[:64] == want[:64]
gt = case["greedy_text"]
common = next((i for i in range(min(len(text), len(gt))) if text[i] != gt[i]), min(len(text), len(gt)))
print("tokens: %d generated, %d golden; identical for the first %d (first 64 %s); text: %d of %d "
      "golden chars identical" % (len(ids), len(want), first, "MATCH" if same64 else "DIFFER",
                                  common, len(gt)))
print("text: %r" % text[:160])
ttft, tpot = [], []
for k in range(5):  # streamed, client-side timing (includes the cli's start and connect)
    t0 = time.perf_counter()
    p = subprocess.Popen(base, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    tf = None
    while True:
        b = os.read(p.stdout.fileno(), 65536)
        if not b: break
        if tf is None: tf = time.perf_counter()
    t1 = time.perf_counter()
    p.wait()
    if tf is not None and len(ids) > 1:
        ttft.append((tf - t0) * 1e3); tpot.append((t1 - tf) * 1e3 / (len(ids) - 1))
if ttft:
    ttft.sort(); tpot.sort()
    print("timing over %d runs (median): TTFT %.2f ms, TPOT %.3f ms (%d tokens)" %
          (len(ttft), ttft[len(ttft) // 2], tpot[len(tpot) // 2], len(ids)))
sys.exit(0 if same64 else 1)
PY
        local r=$?
        grep -hE 'KV staging|model .* on |KV layout|error|ERROR|failed' "$logs"/*.log 2>/dev/null | head -n 12
        kill -TERM "$up" 2>/dev/null
        wait "$up" 2>/dev/null
        echo "== services $name: exit $r"
        [ "$r" -eq 0 ] || rc=1
    }
    services disagg
    services colocated --colocated
fi
exit $rc
