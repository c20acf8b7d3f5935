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
#             A deployment named with "-fp8" (GOODPUT_DEPS="disagg disagg-fp8 colocated-fp8")
#             runs every instance with --quantization fp8 --kv-cache-dtype fp8 (issue #37)
#   goodputL  the same search for a long-output workload (input U[512,4096], output
#             U[128,512], TTFT <= 1500 ms, TPOT <= 20 ms): the decode KV pool binds
#   goodputS  the same search for a shared-prefix workload (8 prefixes of 1024 tokens, then
#             256 - 1024 tokens each, out U[64,256], TTFT <= 300 ms, TPOT <= 15 ms): prefix
#             caches on both sides and decode-side prefix reuse; prints the caches' counters
#   policy    conditional disaggregation: workload A disaggregated with
#             PDSERVE_PREFILL_BUSY_TOKENS=$BUSY_TOKENS (4096), and 64-token prompts computed
#             remotely vs on the decode instance (TTFT, TPOT at 2 req/s)
#   plan      pdserve-plan over every GPU of the host (PLAN_WORKLOAD B, A, S, L or B70; PLAN_* below)
#   kill      faults mid-transfer (tools/gpu_faults.py kill): stories260k on --gpus 0,1, device
#             path, every prompt through prefill (--prefill-policy remote); 16 closed-loop
#             clients (pdserve-bench), then kill -9 of the prefill process while a transfer is in
#             flight on it (its pdserve_kv_transfers_active{direction="send"} polled): the decode
#             instance must survive, stay SERVING and come back to rest (KV blocks in use back to
#             the pre-load value, no transfer, reservation, sequence or request left) within 10 s;
#             requests that ended before the kill all OK, none hangs (none DEADLINE_EXCEEDED, each
#             in flight at the kill OK, or failed within 10 s), those started after it OK or UNAVAILABLE
#             within 5 s; then the same with kill -9 of the decode process mid-receive (recv
#             transfers in flight), the prefill instance surviving. Lines "== kill-prefill:" and
#             "== kill-decode:"; logs in $OUT/kill/ and $OUT/up-kill-*/
#   storm     a cancel storm during transfers (tools/gpu_faults.py storm), same stack: for
#             STORM_S (20) s, pdserve-bench runs with deadlines of 2 ms to 1 s, pdserve-bench runs
#             interrupted (SIGINT cancels every call) or killed at random times, pdserve-cli calls
#             with random deadlines or killed at random times; then every client ended in time,
#             every process is alive and SERVING, a request through the router succeeds, and
#             every process is at rest (KV blocks in use on both sides back to 0, nothing in
#             flight) within 10 s; logs in $OUT/storm/
#   migrate   issue #38: kill -9 of one of two colocated Llama-3-8B-shape instances under
#             workload A at 80% of its goodput: every request completes (see the step)
#   itl       decode ITL with and without transfers landing (tools/gpu_faults.py itl): Llama-3-8B
#             shape (dummy, --kv-cache-mb 16384) on --gpus 0,1, device path, every prompt through
#             prefill; A: 32 streams of 128 tokens in, 512 out, started at once, alone; B: the
#             same with 4 req/s of 2048-token prompts (1 token out) whose KV lands on the same
#             decode instance; ITL_ROUNDS (3) rounds A, B alternately; PASS when the median ITL
#             p99 of B is within 10% of A's; logs in $OUT/itl/
# Modes (arguments): any of the step names; none = all up to stack and ttft (kill, storm, itl,
# goodput*, policy and plan only when named). Exit 0 when every step passed.
# PD_KV_CPU=DIR: no GPU: the binaries of build folder DIR (e.g. build-dev), stories260k on the
# CPU for kill, storm and itl (itl shrunk: ITL_* knobs), KV through the host; a check of the
# scripts' logic on a development machine, e.g. PD_KV_CPU=build-dev tools/gpu_kv.sh kill storm.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ -n "${PD_KV_CPU:-}" ]; then
    G=$(cd "$PD_KV_CPU" && pwd)
    OUT=${OUT:-/tmp/pd-kv-cpu}
    mkdir -p "$OUT"
    export PDSERVE_SHARED=${PDSERVE_SHARED:-$(cd .. && pwd)/shared}
    export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
else
    . tools/gpu_env.sh
fi
rc=0
has() { [ -z "$MODES" ] && return 0; case " $MODES " in *" $1 "*) return 0 ;; esac; return 1; }
MODES="$*"
if [ -n "${PD_KV_CPU:-}" ]; then
    [ -n "$MODES" ] || MODES="kill storm itl"
    for m in $MODES; do
        case $m in kill|storm|itl) ;; *) echo "PD_KV_CPU: only kill, storm and itl run on the CPU"; exit 2 ;; esac
    done
fi
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

# Stacks: up starts pdserve-up in a session (process group) of its own, so that down, and the
# EXIT trap whatever happened (a failed step, Ctrl-C), can end all of it: pdserve-up first (it
# stops its processes, router first), then, after DOWN_S (90) s, whatever is left of its group
# by SIGKILL.
UPS=() # pdserve-up pids not stopped yet
running() { # running PID: alive and not a zombie
    local s
    s=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$s" ] && [ "$s" != Z ] && [ "$s" != X ]
}
pgid() { cut -d' ' -f5 "/proc/$1/stat" 2>/dev/null; } # pgid PID: its process group
stop_up() { # stop_up PID [S]: stops that pdserve-up and its process group; 1 when it took SIGKILL
    local u=$1 lim=${2:-${DOWN_S:-90}} pg i r=0
    pg=$(pgid "$u")
    kill -TERM "$u" 2>/dev/null
    kill -CONT "$u" 2>/dev/null # stopped by the kill mode
    for ((i = 0; i < lim * 10; i++)); do running "$u" || break; sleep 0.1; done
    if running "$u"; then
        echo "== pdserve-up (pid $u) did not stop its processes in $lim s (one hangs in its" \
             "drain? see its logs); SIGKILL to its group"
        r=1
    fi
    # Only a group of its own (never this script's).
    if [ -n "$pg" ] && [ "$pg" = "$u" ] && [ "$pg" != "$(pgid $$)" ]; then
        kill -KILL -- "-$pg" 2>/dev/null
    fi
    wait "$u" 2>/dev/null
    local keep=() p
    for p in "${UPS[@]}"; do [ "$p" = "$u" ] || keep+=("$p"); done
    UPS=("${keep[@]}")
    return $r
}
# shellcheck disable=SC2317 # (run by the trap)
cleanup() {
    local p
    if [ -n "${FPID:-}" ] && running "$FPID"; then
        kill -TERM "$FPID" 2>/dev/null
        wait "$FPID" 2>/dev/null
    fi
    for p in "${UPS[@]}"; do stop_up "$p"; done
}
trap cleanup EXIT
trap 'echo "== gpu_kv: interrupted"; exit 130' INT TERM
SETSID=$(command -v setsid || true)

# up NAME ARGS...: starts pdserve-up with ARGS in the background; sets ADDR and UP (its pid).
up() {
    local name=$1
    shift
    local logs="$OUT/up-$name"
    rm -rf "$logs"
    mkdir -p "$logs"
    # Without job control a background job is no group leader, so setsid makes the session
    # without forking: $! is pdserve-up's pid and its group's id.
    PDSERVE_LOG_DIR="$logs" $SETSID "$G/bin/pdserve-up" --port 0 "$@" >"$logs/up.out" 2>"$logs/up.err" &
    UP=$!
    UPS+=("$UP")
    ADDR=""
    for _ in $(seq 1800); do
        grep -q '^ROUTER ' "$logs/up.out" 2>/dev/null && break
        running "$UP" || break
        sleep 0.1
    done
    ADDR=$(awk '/^ROUTER /{print $2; exit}' "$logs/up.out")
    if [ -z "$ADDR" ]; then
        echo "== $name: the stack did not start"
        tail -n 20 "$logs"/*.log "$logs/up.err" 2>/dev/null
        stop_up "$UP"
        rc=1
        return 1
    fi
    grep -hE 'device path|KV staging|on GPU|target pool' "$logs"/*.log "$logs/up.err" 2>/dev/null | head -8
    return 0
}
down() { # down [S]: stops the stack of the last up (SIGKILL after S s)
    stop_up "$UP" "$@"
}
fault_down() { # fault_down NAME: down, bounded (a drain that hangs after a fault fails NAME)
    # An instance drains for its grace period (30 s) at most, the router too.
    if ! down "${FAULT_DOWN_S:-75}"; then
        echo "== $1: FAIL (the stack did not shut down within ${FAULT_DOWN_S:-75} s of SIGTERM)"
        rc=1
    fi
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
    # Every prompt through prefill (the router computes short ones on decode by default).
    if up stack --model "$M" --gpus 0,1 --router-args "--prefill-policy remote" -- --backend cuda \
        --kv-cache-mb 256 --kv-transport device --metrics-port 0; then
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
    local wlargs=()
    case $wl in
        A) in=256:2048 slo=(--slo-ttft-ms 300 --slo-tpot-ms 15) rate=24 ;;
        B) in=1024:3072 slo=(--slo-ttft-ms 1000 --slo-tpot-ms 10) rate=8 ;;
        # S: shared prefixes (8 system prompts of 1024 tokens, then 256 - 1024 of their own):
        # prefix caches on both sides, decode-side prefix reuse.
        S) in=256:1024 slo=(--slo-ttft-ms 300 --slo-tpot-ms 15) rate=24
           wlargs=(--workload shared-prefix --prefix-groups 8 --prefix-len 1024) ;;
        L) in=512:4096 slo=(--slo-ttft-ms 1500 --slo-tpot-ms 20) rate=12
           wlargs=(--output-len 128:512) ;;
    esac
    for dep in "${deps[@]}"; do
        local COMMON=(--load-format dummy --backend cuda --kv-cache-mb 16384 --metrics-port 0)
        case $dep in *-fp8) COMMON+=(--quantization fp8 --kv-cache-dtype fp8) ;; esac
        # The router knows the objectives (goodput metric; the busy rule's TPOT bound).
        local args=(--model tools/shapes/llama3-8b --gpus 0,1 --router-args "${slo[*]}")
        case $dep in colocated*) args+=(--colocated --decode 2) ;; esac
        if up "gp$wl-$dep" "${args[@]}" -- "${COMMON[@]}"; then
            mkdir -p "$OUT/gp$wl-$dep"
            env -u LD_LIBRARY_PATH LD_LIBRARY_PATH="$LD_LIBRARY_PATH" "$G/bin/pdserve-bench" \
                --addr "$ADDR" --input-len "$in" --output-len 64:256 --rate "${GOODPUT_RATE:-$rate}" "${wlargs[@]}" \
                --num-requests 120 --warmup-requests 10 --seed 1 --find-goodput "${slo[@]}" \
                --slo-attainment 0.9 --goodput-tolerance 0.1 --max-probes ${GOODPUT_PROBES:-6} \
                --json "$OUT/gp$wl-$dep/result.json" --plot-dir "$OUT/gp$wl-$dep/plots" \
                >"$OUT/gp$wl-$dep.log" 2>&1
            grep -E 'req/s.*(PASS|fail)|^goodput|TTFT \(ms\)|TPOT \(ms\)' "$OUT/gp$wl-$dep.log" |
                sed "s|^|$wl $dep: |"
            paths "$OUT/up-gp$wl-$dep"
            for f in "$OUT/up-gp$wl-$dep"/*.out; do # prefix caches and decode-side reuse
                p=$(awk '/^METRICS_PORT /{print $2; exit}' "$f")
                [ -n "$p" ] && env -u LD_LIBRARY_PATH python3 -c 'import sys, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=5).read().decode())' "$p" |
                    grep -E '^pdserve_(prefix_cache_hit_ratio|kv_prefix_reused_tokens_total|kv_reserved_prompt_tokens_total|kv_transfer_bytes_total)' |
                    sed "s|^|$wl $dep $(basename "$f" .out): |"
            done
            down
        fi
    done
}
# GOODPUT_DEPS="disagg" (or "colocated") runs one deployment only.
# shellcheck disable=SC2086
has goodputA && [ -n "$MODES" ] && goodput A ${GOODPUT_DEPS:-}
# shellcheck disable=SC2086
has goodputB && [ -n "$MODES" ] && goodput B ${GOODPUT_DEPS:-}
# shellcheck disable=SC2086
has goodputS && [ -n "$MODES" ] && goodput S ${GOODPUT_DEPS:-}
# shellcheck disable=SC2086
has goodputL && [ -n "$MODES" ] && goodput L ${GOODPUT_DEPS:-}
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
    # The placement planner on every GPU of the host, workload B (or PLAN_WORKLOAD=A, S, L, B70).
    # PLAN_SPLITS (P:D,...; default every split), PLAN_NOCOLO=1 (no colocated run),
    # PLAN_DURATION_S (> 0: each probe sends for this long instead of 120 requests),
    # PLAN_RATE (first probe), PLAN_TOL (search tolerance, default 0.1), PLAN_PROBES (5),
    # PLAN_TAG (results in $OUT/plan$PLAN_TAG), PLAN_MODEL (a shape folder, default
    # tools/shapes/llama3-8b), PLAN_TP ("T" or "Tp.Td": --prefill-tp / --decode-tp),
    # PLAN_QUANT / PLAN_KV (--quantization / --kv-cache-dtype, default auto), PLAN_KV_MB (16384),
    # PLAN_GPU_UTIL (instead of PLAN_KV_MB: --gpu-memory-utilization, the pool an operator's
    # deployment would have), PLAN_GPUS (default every GPU). Workload B70: B with TTFT <= 1.5 s,
    # TPOT <= 30 ms (issue #37's 70B goal); L: goodputL's long outputs (input U[512,4096],
    # output U[128,512], TTFT <= 1.5 s, TPOT <= 20 ms). Every process serves /metrics (the
    # planner keeps a snapshot of each after its search).
    NG=$(nvidia-smi -L | wc -l)
    GL=${PLAN_GPUS:-$(seq -s, 0 $((NG - 1)))}
    OUTL=64:256
    case ${PLAN_WORKLOAD:-B} in
        L) WL="--input-len 512:4096 --slo-ttft-ms 1500 --slo-tpot-ms 20 --rate ${PLAN_RATE:-16}"
           OUTL=128:512 ;;
        B70) WL="--input-len 1024:3072 --slo-ttft-ms 1500 --slo-tpot-ms 30 --rate ${PLAN_RATE:-4}" ;;
        A) WL="--input-len 256:2048 --slo-ttft-ms 300 --slo-tpot-ms 15 --rate ${PLAN_RATE:-24}" ;;
        B) WL="--input-len 1024:3072 --slo-ttft-ms 1000 --slo-tpot-ms 10 --rate ${PLAN_RATE:-16}" ;;
        S) WL="--workload shared-prefix --prefix-groups 8 --prefix-len 1024 --input-len 256:1024 --slo-ttft-ms 300 --slo-tpot-ms 15 --rate ${PLAN_RATE:-24}" ;;
    esac
    if [ "${PLAN_DURATION_S:-0}" != 0 ]; then
        LEN="--duration-s $PLAN_DURATION_S --warmup-requests ${PLAN_WARMUP:-100}"
    else
        LEN="--num-requests 120 --warmup-requests 10"
    fi
    PX=()
    [ -n "${PLAN_SPLITS:-}" ] && PX+=(--splits "$PLAN_SPLITS")
    [ "${PLAN_NOCOLO:-0}" = 1 ] && PX+=(--no-colocated)
    if [ -n "${PLAN_TP:-}" ]; then
        PX+=(--prefill-tp "${PLAN_TP%.*}" --decode-tp "${PLAN_TP#*.}")
    fi
    PX+=(--quantization "${PLAN_QUANT:-auto}" --kv-cache-dtype "${PLAN_KV:-auto}")
    POOL="--kv-cache-mb ${PLAN_KV_MB:-16384}"
    [ -n "${PLAN_GPU_UTIL:-}" ] && POOL="--gpu-memory-utilization $PLAN_GPU_UTIL"
    PDSERVE_UP_START_S=300 PDSERVE_METRICS_PORT=0 "$G/bin/pdserve-plan" \
        --model "${PLAN_MODEL:-tools/shapes/llama3-8b}" --gpus "$GL" \
        --out "$OUT/plan${PLAN_TAG:-}" "${PX[@]}" \
        --instance-args "--load-format dummy --backend cuda $POOL" \
        --bench-args "$WL --output-len $OUTL $LEN --seed 1 --slo-attainment 0.9 --goodput-tolerance ${PLAN_TOL:-0.1} --max-probes ${PLAN_PROBES:-5}" \
        2>&1 | grep -v '^$'
    for d in "$OUT/plan${PLAN_TAG:-}"/*/; do # every probe of every search
        grep -h '^probe' "$d/bench.txt" 2>/dev/null | sed "s|^|$(basename "$d"): |"
        if [ ! -s "$d/bench.txt" ]; then # it did not start: say why
            tail -5 "$d/up.err" 2>/dev/null | sed "s|^|$(basename "$d") up: |"
            for l in "$d"/logs/*.log; do tail -4 "$l" 2>/dev/null | sed "s|^|$(basename "$l"): |"; done
        fi
        rm -rf "$d/logs" # keep what comes back small
    done
fi
if has migrate && [ -n "$MODES" ]; then
    # Issue #38: kill -9 of one of 2 decode instances under load. Two colocated instances of
    # the Llama-3-8B shape (GPUs 0 and 1), workload A (in U[256,2048], out U[64,256], TTFT <=
    # 300 ms, TPOT <= 15 ms) open-loop at MIGRATE_RATE (22 req/s: 80% of the 27 req/s
    # goodput measured for this deployment) for MIGRATE_N requests; once unfaulted ("base"),
    # once with kill -9 of the instance on GPU 1 MIGRATE_KILL_S (12) s into the load ("kill"):
    # every request must complete (its streams move to the survivor); the SLO attainment of
    # both runs says what the fault cost. Lines "== migrate-base:" and "== migrate-kill:".
    for run in ${MIGRATE_RUNS:-base kill}; do
        if up "mig-$run" --model tools/shapes/llama3-8b --gpus 0,1 --colocated --decode 2 \
            --router-args "--slo-ttft-ms 300 --slo-tpot-ms 15 --metrics-port 0" -- \
            --load-format dummy --backend cuda --kv-cache-mb 16384 --metrics-port 0; then
            env -u LD_LIBRARY_PATH LD_LIBRARY_PATH="$LD_LIBRARY_PATH" "$G/bin/pdserve-bench" \
                --addr "$ADDR" --input-len 256:2048 --output-len 64:256 --rate "${MIGRATE_RATE:-22}" \
                --num-requests "${MIGRATE_N:-660}" --warmup-requests 0 --seed 1 \
                --slo-ttft-ms 300 --slo-tpot-ms 15 --csv "$OUT/mig-$run.csv" >"$OUT/mig-$run.log" 2>&1 &
            BP=$!
            if [ "$run" = kill ]; then
                sleep "${MIGRATE_KILL_S:-12}"
                # pdserve-up stops the whole stack when one of its processes dies: its watch
                # loop is stopped until down (SIGTERM, SIGCONT).
                kill -STOP "$UP"
                VP=$(pgrep -P "$UP" -f 'pdserve-decode' | sort -n | tail -1)
                echo "migrate-kill: kill -9 of pid $VP ($(tr '\0' ' ' <"/proc/$VP/cmdline" 2>/dev/null | grep -oE -- '--device [0-9]+|--gpus? [0-9,]+' | head -1))"
                kill -9 "$VP"
            fi
            wait "$BP"
            brc=$?
            grep -E 'TTFT \(ms\)|TPOT \(ms\)|attainment|goodput|errors|failed' "$OUT/mig-$run.log" | head -8 | sed "s|^|migrate-$run: |"
            env -u LD_LIBRARY_PATH python3 - "$OUT/mig-$run.csv" "$run" "$brc" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
st = {}
for r in rows:
    st[r["status"]] = st.get(r["status"], 0) + 1
ok = st.get("OK", 0)
print("== migrate-%s: %s (%d requests: %s; bench exit %s)" % (
    sys.argv[2], "PASS" if rows and ok == len(rows) else "FAIL", len(rows),
    ", ".join("%s %d" % kv for kv in sorted(st.items())), sys.argv[3]))
sys.exit(0 if rows and ok == len(rows) else 1)
PY
            [ $? -eq 0 ] || rc=1
            for f in "$OUT/up-mig-$run"/*.out; do
                p=$(awk '/^METRICS_PORT /{print $2; exit}' "$f")
                [ -n "$p" ] && env -u LD_LIBRARY_PATH python3 -c 'import sys, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=5).read().decode())' "$p" 2>/dev/null |
                    grep -E '^pdserve_router_(migrations|retries)_total|^pdserve_requests_within_slo_total' |
                    sed "s|^|migrate-$run $(basename "$f" .out): |"
            done
            fault_down "migrate-$run"
        fi
    done
fi
# Issue #27's faults and interference (tools/gpu_faults.py; python3 without the packed
# libraries, the binaries it runs with them).
# It runs in the background so that a signal reaches this script's trap at once (bash runs a
# trap only after the foreground job), which ends it (SIGTERM: it ends its clients) before
# the stacks.
FPID=""
faults() { # faults SCENARIO ARGS...: the helper against the stack of the last up; its status
    env -u LD_LIBRARY_PATH PD_LIBS="$LD_LIBRARY_PATH" python3 tools/gpu_faults.py "$@" \
        --bin "$G/bin" --up "$UP" &
    FPID=$!
    wait "$FPID"
    local r=$?
    FPID=""
    return $r
}
if [ -n "${PD_KV_CPU:-}" ]; then
    FAULT_DEV=() FAULT_INST=(--backend cpu --threads 1)
else
    FAULT_DEV=(--gpus "0,1") FAULT_INST=(--backend cuda --kv-transport device)
fi
fault_stack() { # fault_stack NAME: stories260k disaggregated, every prompt through prefill
    up "$1" --model "$PDSERVE_SHARED/models/stories260k" "${FAULT_DEV[@]}" \
        --router-args "--prefill-policy remote --metrics-port 0" -- "${FAULT_INST[@]}" \
        --kv-cache-mb 256 --metrics-port 0
}
if has kill && [ -n "$MODES" ]; then
    for victim in prefill decode; do
        if fault_stack "kill-$victim"; then
            # pdserve-up stops the whole stack when one of its processes dies: its watch loop
            # is stopped (SIGSTOP) until down (SIGTERM, SIGCONT).
            kill -STOP "$UP"
            faults kill --victim "$victim" --logs "$OUT/up-kill-$victim" --out "$OUT/kill" \
                --concurrency "${KILL_CLIENTS:-16}" --duration-s "${KILL_LOAD_S:-6}" \
                --fast-s "${KILL_FAST_S:-5}" \
                --log "$OUT/kill-$victim.log" || rc=1
            fault_down "kill-$victim"
        fi
    done
fi
if has storm && [ -n "$MODES" ]; then
    if fault_stack storm; then
        faults storm --logs "$OUT/up-storm" --out "$OUT/storm" --duration-s "${STORM_S:-20}" \
            --cli-workers "${STORM_CLI:-4}" --interrupters "${STORM_INT:-2}" \
            --log "$OUT/storm.log" || rc=1
        fault_down storm
    fi
fi
if has itl && [ -n "$MODES" ]; then
    if [ -n "${PD_KV_CPU:-}" ]; then # the logic only, on stories260k (512 positions)
        ITL_MODEL=$PDSERVE_SHARED/models/stories260k
        ITL_INST=(--backend cpu --threads 1 --kv-cache-mb 256 --metrics-port 0)
        ITL_SHAPE=(--streams "${ITL_STREAMS:-4}" --prompt-len 32 --output-len "${ITL_OUT:-128}"
                   --bg-prompt-len 256 --bg-rate "${ITL_BG_RATE:-2}" --bg-output-len "${ITL_BG_OUT:-1}"
                   --rounds "${ITL_ROUNDS:-1}"
                   --max-ratio "${ITL_MAX_RATIO:-1.10}")
    else
        ITL_MODEL=tools/shapes/llama3-8b
        ITL_INST=(--load-format dummy --backend cuda --kv-cache-mb 16384 --metrics-port 0
                  --kv-transport device)
        ITL_SHAPE=(--streams "${ITL_STREAMS:-32}" --prompt-len 128 --output-len "${ITL_OUT:-512}"
                   --bg-prompt-len 2048 --bg-rate "${ITL_BG_RATE:-4}" --bg-output-len "${ITL_BG_OUT:-1}"
                   --rounds "${ITL_ROUNDS:-3}"
                   --max-ratio "${ITL_MAX_RATIO:-1.10}")
    fi
    if up itl --model "$ITL_MODEL" "${FAULT_DEV[@]}" \
        --router-args "--prefill-policy remote --metrics-port 0" -- "${ITL_INST[@]}"; then
        faults itl --logs "$OUT/up-itl" --out "$OUT/itl" "${ITL_SHAPE[@]}" --log "$OUT/itl.log" || rc=1
        [ -n "${PD_KV_CPU:-}" ] || paths "$OUT/up-itl"
        down
    fi
fi
echo "== gpu_kv: exit $rc"
exit $rc
