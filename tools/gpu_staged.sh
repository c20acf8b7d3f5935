#!/usr/bin/env bash
# gpu_staged.sh -- Issue #27's staged KV path on a lent host with two GPUs (kind
# nvidia-h100-x2), over what tools/gpu_package.sh packed (PD_GPU_EXTRA="test_cuda_ipc
# pdserve-bench"). Steps, each logged in $OUT:
#   stackhost  stories260k on --gpus 0,1 with --kv-transport host: the KV goes through the
#              staging rings (GPU -> pinned slot -> UCX -> pinned slot -> GPU); the greedy story
#              must match the golden one (first 64 tokens) and the transfers must have taken
#              the AM path (pdserve_kv_transfers_by_path_total{path="am"})
#   start      the Llama-3-8B shape (dummy weights) with the default --gpu-memory-utilization
#              0.9 (no --kv-cache-mb): a prefill instance on GPU 0 and a decode instance on
#              GPU 1 started at once; seconds until each serves, its KV pool and staging ring,
#              and its resident host memory (no host copy of a ~55 GiB pool any more)
# Modes (arguments): any of the step names; none = all. Exit 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
rc=0
MODES="$*"
has() { [ -z "$MODES" ] && return 0; case " $MODES " in *" $1 "*) return 0 ;; esac; return 1; }
export UCX_WARN_UNUSED_ENV_VARS=n

if has stackhost; then
    M="$PDSERVE_SHARED/models/stories260k"
    L="$OUT/up-stackhost"
    mkdir -p "$L"
    PDSERVE_LOG_DIR="$L" "$G/bin/pdserve-up" --port 0 --model "$M" --gpus 0,1 \
        --router-args "--prefill-policy remote" -- --backend cuda --kv-cache-mb 256 \
        --kv-transport host --metrics-port 0 >"$L/up.out" 2>"$L/up.err" &
    UP=$!
    for _ in $(seq 600); do grep -q '^ROUTER ' "$L/up.out" 2>/dev/null && break; sleep 0.1; done
    ADDR=$(awk '/^ROUTER /{print $2; exit}' "$L/up.out")
    if [ -z "$ADDR" ]; then
        echo "== stackhost: the stack did not start"
        tail -n 20 "$L"/*.log "$L/up.err"
        rc=1
    else
        grep -hE 'staged through|target pool' "$L"/*.log | head -4
        env -u LD_LIBRARY_PATH PD_LIBS="$LD_LIBRARY_PATH" python3 - "$G/bin/pdserve-cli" "$ADDR" \
            "$M/golden.json" <<'PY'
import json, os, subprocess, sys
cli, addr, golden = sys.argv[1:4]
env = dict(os.environ, LD_LIBRARY_PATH=os.environ["PD_LIBS"])
bad = 0
for case in json.load(open(golden))["cases"][:3]:
    want = case["greedy_ids"]
    r = subprocess.run([cli, "generate", "--addr", addr, "--temperature", "0", "--max-tokens",
                        str(len(want)), "--prompt", case.get("prompt", ""), "--json"],
                       env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        print("cli failed:", r.stderr[-400:]); bad += 1; continue
    ids = json.loads(r.stdout)["token_ids"]
    ok = ids[:64] == want[:64]
    bad += not ok
    print("stackhost %r: %d tokens, first 64 %s" % (case.get("prompt", "")[:24], len(ids),
                                                    "MATCH" if ok else "DIFFER"))
sys.exit(1 if bad else 0)
PY
        [ $? -eq 0 ] || rc=1
        for f in "$L"/*.out; do
            p=$(awk '/^METRICS_PORT /{print $2; exit}' "$f")
            [ -n "$p" ] && env -u LD_LIBRARY_PATH python3 -c 'import sys, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=5).read().decode())' "$p" |
                grep -E '^pdserve_kv_transfers_by_path_total|^pdserve_kv_staging_slots' | sed "s|^|$(basename "$f" .out): |"
        done | tee "$OUT/stackhost-paths.txt"
        grep -q 'path="am"' "$OUT/stackhost-paths.txt" || { echo "== stackhost: no staged (am) transfer"; rc=1; }
    fi
    kill -TERM "$UP" 2>/dev/null
    wait "$UP" 2>/dev/null
fi

if has start; then
    L8=tools/shapes/llama3-8b
    for role in prefill decode; do
        dev=0
        [ $role = decode ] && dev=1
        (
            t0=$(date +%s.%N)
            "$G/bin/pdserve-$role" --model "$L8" --load-format dummy --backend cuda --device $dev \
                --listen 127.0.0.1:0 --log-level info >"$OUT/start-$role.out" 2>"$OUT/start-$role.log" &
            pid=$!
            for _ in $(seq 1200); do grep -q '^PORT ' "$OUT/start-$role.out" 2>/dev/null && break; sleep 0.05; done
            t1=$(date +%s.%N)
            rss=$(awk '/VmRSS/{print $2}' /proc/$pid/status 2>/dev/null)
            lck=$(awk '/VmLck|VmPin/{s=s" "$1$2"kB"} END{print s}' /proc/$pid/status 2>/dev/null)
            if grep -q '^PORT ' "$OUT/start-$role.out"; then
                awk -v r=$role -v a="$t0" -v b="$t1" -v m="${rss:-0}" -v l="$lck" \
                    'BEGIN{printf "start %s: serving after %.1f s, RSS %.0f MiB,%s\n", r, b - a, m / 1024, l}'
            else
                echo "start $role: did not start"
                tail -5 "$OUT/start-$role.log"
            fi
            grep -hE 'KV blocks of|staged through' "$OUT/start-$role.log" | sed "s|^|  $role: |" | head -3
            kill -TERM $pid 2>/dev/null
            wait $pid 2>/dev/null
        ) &
    done
    wait
fi
echo "== gpu_staged: exit $rc"
exit $rc
