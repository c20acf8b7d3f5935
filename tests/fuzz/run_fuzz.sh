#!/usr/bin/env bash
# run_fuzz.sh -- Runs one libFuzzer target for a bounded time (the CTest tests fuzz_<name>):
# run_fuzz.sh BINARY CORPUS_DIR SECONDS ARTIFACT_DIR [libFuzzer flags...]
# tests/fuzz/<binary name>.dict, when present, is the libFuzzer dictionary.
# New inputs go to a fresh temporary corpus (the first, writable corpus directory); CORPUS_DIR,
# the seeds in the repository, is only read. A crash, leak, timeout or sanitizer report exits
# non-zero, and the input that caused it is written under ARTIFACT_DIR and named in the output.
set -euo pipefail
bin=$1 corpus=$2 seconds=$3 artifacts=$4
shift 4
work=$(mktemp -d "${TMPDIR:-/tmp}/pdfuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$artifacts"
seeds=()
[ -d "$corpus" ] && seeds=("$corpus")
name=$(basename "$bin")
dict=()
[ -f "$(dirname "$0")/$name.dict" ] && dict=(-dict="$(dirname "$0")/$name.dict")
rc=0
"$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
  -artifact_prefix="$artifacts/$name-" "${dict[@]}" "$@" "$work" "${seeds[@]}" || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "run_fuzz: $name failed (exit $rc); the input is the file named after 'Test unit written to'" \
       "above (in $artifacts); reproduce with: $bin <file>" >&2
  exit 1 # not libFuzzer's 77, which CTest setups may read as "skipped"
fi
