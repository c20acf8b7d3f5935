#!/usr/bin/env bash
# test.sh -- Sets up a fresh Debian machine and passes every test: installs dependencies,
# builds pdserve normally (build/) and with ASan+UBSan (build-asan/), and runs CTest in both;
# then builds the fuzz targets with clang (build-fuzz/) and fuzzes each for a bounded time.
# GPU tests (label "gpu") skip themselves where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

bash tools/install_deps.sh

echo "== normal build =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPD_WERROR=ON >/dev/null
cmake --build build -j "$JOBS"
ctest --test-dir build --output-on-failure -j "$JOBS"

echo "== ASan + UBSan build =="
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DPD_SANITIZE=ON -DPD_WERROR=ON >/dev/null
cmake --build build-asan -j "$JOBS"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS"
echo "== fuzz =="
# libFuzzer targets (tests/fuzz): clang with ASan + UBSan, each fuzzes PD_FUZZ_SECONDS (20 s)
# from its corpus in tests/fuzz/corpus; only the fuzz targets are built here.
CC=clang cmake -S . -B build-fuzz -DPD_FUZZ=ON -DPD_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build-fuzz --target fuzz -j "$JOBS"
ctest --test-dir build-fuzz -L fuzz --output-on-failure -j "$JOBS"
echo "== all tests passed =="
