#!/usr/bin/env bash
# run.sh -- Sets up a fresh Debian machine and runs pdserve's main job: builds pdserve and
# generates a story with the tiny real model ../shared/models/stories260k (greedy, on the CPU;
# the GPU is used when a CUDA build finds one). Extra arguments go to pdserve-generate.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${PDSERVE_MODEL:-../shared/models/stories260k}

bash tools/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)" --target pdserve-generate
./build/bin/pdserve-generate --model "$MODEL" --prompt-ids 1 --max-tokens 256 --temperature 0 "$@"
