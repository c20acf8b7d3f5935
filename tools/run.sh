#!/usr/bin/env bash
# run.sh -- Sets up a fresh Debian machine and runs pdserve's main job: builds pdserve, starts
# the disaggregated stack locally (pdserve-prefill + pdserve-decode + pdserve-router on
# loopback with pdserve-up, KV moving over UCX) on the tiny real model
# ../shared/models/stories260k (CPU; the GPU backend is used when a CUDA build finds one),
# streams a story through the public gRPC API with pdserve-cli, and stops the stack.
#   PDSERVE_MODEL=DIR   another model directory
#   extra arguments     go to pdserve-cli (e.g. --prompt "The dog" --max-tokens 64)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${PDSERVE_MODEL:-../shared/models/stories260k}

bash tools/install_deps.sh
# The CUDA backend only where a GPU is: compiling its kernels takes most of ten minutes on a
# small machine, for nothing without a GPU (nvcc alone does not make one).
CUDA=OFF
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then CUDA=AUTO; fi
echo "run.sh: building pdserve (CUDA backend: $([ $CUDA = OFF ] && echo 'off, no GPU found' || echo 'on if nvcc is found'))" >&2
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPD_CUDA=$CUDA >/dev/null
cmake --build build -j "$(nproc)" --target pdserve-prefill pdserve-decode pdserve-router pdserve-cli

LOG=$(mktemp)
# --prefill-policy remote: the prefill instance computes the prompt and ships its KV even for
# this short prompt (the router's default computes prompts of up to 64 tokens on the decode
# instance, which is faster but would leave the KV path idle here).
./build/bin/pdserve-up --model "$MODEL" --port 0 --router-args "--prefill-policy remote" >"$LOG" 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 600); do
    grep -q '^ROUTER ' "$LOG" && break
    kill -0 $UP 2>/dev/null || { cat "$LOG" >&2; exit 1; }
    sleep 0.1
done
ROUTER=$(awk '/^ROUTER /{print $2; exit}' "$LOG")
grep 'router listening' "$LOG" >&2
./build/bin/pdserve-cli generate --addr "$ROUTER" --temperature 0 --max-tokens 256 "$@"
