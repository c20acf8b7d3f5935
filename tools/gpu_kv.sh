#!/usr/bin/env bash
# gpu_kv.sh -- Issue #27 on a lent host with two GPUs (kind nvidia-h100-x2), over what
# tools/gpu_package.sh packed (PD_GPU_EXTRA="test_cuda_ipc pdserve-bench"): the KV's device
# path between processes and what it does to serving. Steps, each logged in $OUT:
#   topo      nvidia-smi topo -m (NVLink between the two?)
#   ipc       test_cuda_ipc: a pool exported by one process, written by another from the other
#             GPU (kernel and memcpy modes), every byte checked
#   ipcbench  test_cuda_ipc --bench: the Llama-3-8B pattern (32 layers, K and V, 32 KiB blocks,
#             128 scattered blocks a region) moved layer by layer, next to the same bytes as one
#             contiguous peer copy per region (the floor), same run
#   stack     stories260k on --gpus 0,1 (prefill on GPU 0, decode on GPU 1) with --kv-transport
#             device: the greedy story must match the golden one (first 64 tokens), and the KV
#             must have gone device to device (pdserve_kv_transfers_by_path_total{path="device"})
#   ttft      Llama-3-8B shape (dummy weights, --kv-cache-mb 16384): 2048-token prompts, 32
#             tokens out, 1 request/s: TTFT and TPOT of disaggregated with the device path, with
#             the host path, and colocated on one GPU, all in this run
#   goodputA, goodputB  the issue's goodput searches (Llama-3-8B shape, dummy, --kv-cache-mb
#             16384): disaggregated (1 prefill on GPU 0, 1 decode on GPU 1, device path) and
#             colocated (one colocated instance per GPU), same seed, workload and SLO, 120
#             requests a probe: A: input U[256,2048], output U[64,256], TTFT <= 300 ms, TPOT
#             <= 15 ms; B: input U[1024,3072], output U[64,256], TTFT <= 1000 ms, TPOT <= 10 ms
#   policy    conditional disaggregation: workload A disaggregated with
#             PDSERVE_PREFILL_BUSY_TOKENS=$BUSY_TOKENS (4096), and 64-token prompts computed
#             remotely vs on the decode instance (TTFT, TPOT at 2 req/s)
#   plan      pdserve-plan over every GPU of the host (PLAN_WORKLOAD B or A)
# Modes (arguments): any of the step names; none = all. Exit 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
rc=0
has() { [ -z "$MODES" ] && return 0; case " $MODES " in *" $1 "*) return 0 ;; esac; return 1; }
MODES="$*"
export UCX_WARN_UNUSED_ENV_VARS=n

if has topo; then
    nvidia-smi topo -m 2>&1 | head -12
fi
if has ipc; then
    "$G/bin/test_cuda_ipc" >"$OUT/ipc.log" 2>&1
    r=$?
    tail -5 "$OUT/ipc.log"
    echo "== ipc: exit $r"
    [ $r -eq 0 ] || rc=1
fi
if has ipcbench; then
    "$G/bin/test_cuda_ipc" --bench >"$OUT/ipcbench.log" 2>&1
    r=$?
    grep -E 'BENCH|FAIL|error' "$OUT/ipcbench.log"
    echo "== ipcbench: exit $r"
    [ $r -eq 0 ] || rc=1
fi

# up NAME ARGS...: starts pdserve-up with ARGS in the background; sets ADDR and UP (its pid).
up() {
    local name=$1
    shift
    local logs="$OUT/up-$name"
    mkdir -p "$logs"
    PDSERVE_LOG_DIR="$logs" "$G/bin/pdserve-up" --port 0 "$@" >"$logs/up.out" 2>"$logs/up.err" &
    UP=$!
    ADDR=""
    for _ in $(seq 1800); do
        grep -q '^ROUTER ' "$logs/up.out" 2>/dev/null && break
        kill -0 "$UP" 2>/dev/null || break
        sleep 0.1
    done
    ADDR=$(awk '/^ROUTER /{print $2; exit}' "$logs/up.out")
    if [ -z "$ADDR" ]; then
        echo "== $name: the stack did not start"
        tail -n 20 "$logs"/*.log "$logs/up.err" 2>/dev/null
        rc=1
        return 1
    fi
    grep -hE 'device path|KV staging|on GPU|target pool' "$logs"/*.log "$logs/up.err" 2>/dev/null | head -8
}
down() {
    kill -TERM "$UP" 2>/dev/null
    wait "$UP" 2>/dev/null
}
paths() { # paths LOGDIR: the instances' KV transfer counts by path
    for f in "$1"/*.out; do
        p=$(awk '/^METRICS_PORT /{print $2; exit}' "$f")
        [ -n "$p" ] && env -u LD_LIBRARY_PATH python3 -c 'import sys, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=5).read().decode())' "$p" |
            grep '^pdserve_kv_transfers_by_path_total' | sed "s|^|$(basename "$f" .out): |"
    done
}

if has stack; then
    M="$PDSERVE_SHARED/models/stories260k"
    if up stack --model "$M" --gpus 0,1 -- --backend cuda --kv-cache-mb 256 --kv-transport device \
        --metrics-port 0; then
        env -u LD_LIBRARY_PATH PD_LIBS="$LD_LIBRARY_PATH" python3 - "$G/bin/pdserve-cli" "$ADDR" \
            "$M/golden.json" <<'PY'
import json, os, subprocess, sys
cli, addr, golden = sys.argv[1:4]
env = dict(os.environ, LD_LIBRARY_PATH=os.environ["PD_LIBS"])
case = json.load(open(golden))["cases"][0]
want = case["greedy_ids"]
r = subprocess.run([cli, "generate", "--addr", addr, "--temperature", "0", "--max-tokens",
                    str(len(want)), "--prompt", case.get("prompt", ""), "--json"],
                   env=env, capture_output=True, text=True, timeout=120)
if r.returncode != 0:
    print("cli failed:", r.stderr[-400:]); sys.exit(1)
ids = json.loads(r.stdout)["token_ids"]
first = next((i for i in range(min(len(ids), len(want))) if ids[i] != want[i]), min(len(ids), len(want)))
print("stack: %d tokens, identical to the golden story for the first %d (first 64 %s)" %
      (len(ids), first, "MATCH" if ids[:64] == want[:64] else "DIFFER"))
sys.exit(0 if ids[:64] == want[:64] else 1)
PY
        r=$?
        [ $r -eq 0 ] || rc=1
        paths "$OUT/up-stack" | tee "$OUT/stack-paths.txt"
        grep -q 'path="device"' "$OUT/stack-paths.txt" || { echo "== stack: no device-path transfer"; rc=1; }
        down
    fi
fi

if has ttft; then
    L8=tools/shapes/llama3-8b
    bench() { # bench NAME: 20 requests of 2048 tokens in, 32 out, 1 per second
        env -u LD_LIBRARY_PATH LD_LIBRARY_PATH="$LD_LIBRARY_PATH" "$G/bin/pdserve-bench" \
            --addr "$ADDR" --rate 1 --num-requests 20 --warmup-requests 3 --input-len 2048 \
            --output-len 32 --arrival constant >"$OUT/ttft-$1.log" 2>&1
        grep -iE 'ttft|tpot|errors' "$OUT/ttft-$1.log" | head -6 | sed "s|^|$1: |"
    }
    COMMON=(--load-format dummy --backend cuda --kv-cache-mb 16384 --metrics-port 0)
    for kt in device host; do
        if up "ttft-$kt" --model "$L8" --gpus 0,1 -- "${COMMON[@]}" --kv-transport "$kt"; then
            bench "disagg-$kt"
            paths "$OUT/up-ttft-$kt"
            down
        fi
    done
    if up ttft-colocated --model "$L8" --colocated --gpus 0 -- "${COMMON[@]}"; then
        bench colocated
        down
    fi
fi
goodput() { # goodput WORKLOAD [DEPLOYMENTS...]: goodput searches (default: disagg colocated)
    local wl=$1 in slo rate
    shift
    local deps=("$@")
    [ ${#deps[@]} -gt 0 ] || deps=(disagg colocated)
    case $wl in
        A) in=256:2048 slo=(--slo-ttft-ms 300 --slo-tpot-ms 15) rate=24 ;;
        B) in=1024:3072 slo=(--slo-ttft-ms 1000 --slo-tpot-ms 10) rate=8 ;;
    esac
    local COMMON=(--load-format dummy --backend cuda --kv-cache-mb 16384 --metrics-port 0)
    for dep in "${deps[@]}"; do
        local args=(--model tools/shapes/llama3-8b --gpus 0,1)
        [ $dep = colocated ] && args+=(--colocated --decode 2)
        if up "gp$wl-$dep" "${args[@]}" -- "${COMMON[@]}"; then
            mkdir -p "$OUT/gp$wl-$dep"
            env -u LD_LIBRARY_PATH LD_LIBRARY_PATH="$LD_LIBRARY_PATH" "$G/bin/pdserve-bench" \
                --addr "$ADDR" --input-len "$in" --output-len 64:256 --rate "$rate" \
                --num-requests 120 --warmup-requests 10 --seed 1 --find-goodput "${slo[@]}" \
                --slo-attainment 0.9 --goodput-tolerance 0.1 --max-probes ${GOODPUT_PROBES:-6} \
                --json "$OUT/gp$wl-$dep/result.json" >"$OUT/gp$wl-$dep.log" 2>&1
            grep -E 'req/s.*(PASS|fail)|^goodput|TTFT \(ms\)|TPOT \(ms\)' "$OUT/gp$wl-$dep.log" |
                sed "s|^|$wl $dep: |"
            paths "$OUT/up-gp$wl-$dep"
            down
        fi
    done
}
has goodputA && [ -n "$MODES" ] && goodput A
has goodputB && [ -n "$MODES" ] && goodput B
if has policy && [ -n "$MODES" ]; then
    # Conditional disaggregation (issue #28): workload A with the router computing prompts on
    # the decode instance while the prefill backlog is deep; then short prompts (64 tokens in,
    # 64 out, 2 per second) computed remotely and locally.
    PDSERVE_PREFILL_BUSY_TOKENS=${BUSY_TOKENS:-4096} goodput A disagg
    for pol in remote local; do
        if PDSERVE_PREFILL_POLICY=$pol up "short-$pol" --model tools/shapes/llama3-8b --gpus 0,1 -- \
            --load-format dummy --backend cuda --kv-cache-mb 16384 --metrics-port 0; then
            env -u LD_LIBRARY_PATH LD_LIBRARY_PATH="$LD_LIBRARY_PATH" "$G/bin/pdserve-bench" \
                --addr "$ADDR" --rate 2 --num-requests 40 --warmup-requests 4 --input-len 64 \
                --output-len 64 --arrival constant >"$OUT/short-$pol.log" 2>&1
            grep -E 'TTFT \(ms\)|TPOT \(ms\)' "$OUT/short-$pol.log" | sed "s|^|short $pol: |"
            down
        fi
    done
fi
if has plan && [ -n "$MODES" ]; then
    # The placement planner on every GPU of the host, workload B (or PLAN_WORKLOAD=A).
    NG=$(nvidia-smi -L | wc -l)
    GL=$(seq -s, 0 $((NG - 1)))
    case ${PLAN_WORKLOAD:-B} in
        A) WL="--input-len 256:2048 --slo-ttft-ms 300 --slo-tpot-ms 15 --rate 24" ;;
        B) WL="--input-len 1024:3072 --slo-ttft-ms 1000 --slo-tpot-ms 10 --rate 16" ;;
    esac
    "$G/bin/pdserve-plan" --model tools/shapes/llama3-8b --gpus "$GL" --out "$OUT/plan" \
        --instance-args "--load-format dummy --backend cuda --kv-cache-mb 16384 --metrics-port 0" \
        --bench-args "$WL --output-len 64:256 --num-requests 120 --warmup-requests 10 --seed 1 --slo-attainment 0.9 --goodput-tolerance 0.1 --max-probes ${PLAN_PROBES:-5}" \
        2>&1 | grep -v '^$'
fi
echo "== gpu_kv: exit $rc"
exit $rc
