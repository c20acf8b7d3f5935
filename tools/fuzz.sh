#!/usr/bin/env bash
# fuzz.sh -- Runs one fuzz target of tests/fuzz by hand, longer than CI does:
#   tools/fuzz.sh NAME [SECONDS] [libFuzzer flags...]      e.g. tools/fuzz.sh safetensors 600
# Configures build-fuzz (CC=clang, -DPD_FUZZ=ON) when needed, builds fuzz_NAME and fuzzes for
# SECONDS (default 300) from tests/fuzz/corpus/NAME. Inputs it finds are kept between runs in
# build-fuzz/fuzz-work/NAME (never in the repository); crashes land in
# build-fuzz/tests/fuzz/artifacts/. tests/fuzz/README.md says how to keep one as a regression.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: tools/fuzz.sh NAME [SECONDS] [libFuzzer flags...]; NAME is one of:" >&2
  ls tests/fuzz/fuzz_*.c | sed 's|.*/fuzz_||; s|\.c$||' >&2
  exit 2
fi
name=$1
seconds=${2:-300}
shift $(( $# >= 2 ? 2 : 1 ))
JOBS=${JOBS:-2}
BUILD=${BUILD:-build-fuzz}
[ -f "tests/fuzz/fuzz_$name.c" ] || { echo "fuzz.sh: no tests/fuzz/fuzz_$name.c" >&2; exit 2; }
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  CC=clang cmake -S . -B "$BUILD" -DPD_FUZZ=ON -DPD_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
fi
cmake --build "$BUILD" --target "fuzz_$name" -j "$JOBS"
work="$BUILD/fuzz-work/$name"
mkdir -p "$work"
dict=()
[ -f "tests/fuzz/fuzz_$name.dict" ] && dict=(-dict="tests/fuzz/fuzz_$name.dict")
mkdir -p "$BUILD/tests/fuzz/artifacts"
exec "$BUILD/bin/fuzz_$name" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$BUILD/tests/fuzz/artifacts/fuzz_$name-" "${dict[@]}" \
  "$@" "$work" "tests/fuzz/corpus/$name"
