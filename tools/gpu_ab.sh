#!/usr/bin/env bash
# gpu_ab.sh -- A/B timing of decode variants on the lent GPU machine, over packages that
# tools/gpu_package.sh made (unpacked by tools/gpu_run.sh or by this script). Each variant is
# a package folder and environment settings; the variants run alternately, ROUNDS times, so
# that drift of the machine falls on all of them alike, and the medians are printed last.
#   tools/gpu_ab.sh [-r ROUNDS] [-p PROMPT_LEN] [-t TOKENS] [-m SHAPE] 'LABEL|PKG|ENV ...' ...
#     LABEL    a name for the table
#     PKG      package folder (e.g. .gpu, .gpu-B)
#     ENV      VAR=VALUE settings for the run (may be empty)
# Each run: pdserve-generate on tools/shapes/SHAPE (default qwen3-0.6b), dummy weights, a
# random prompt of PROMPT_LEN tokens (default 128), TOKENS greedy tokens (default 256), EOS
# ignored; the figure is its decode tok/s. Logs in $OUT/ab/ (default /tmp/pd-gpu/ab).
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=3 PLEN=128 NTOK=256 SHAPE=qwen3-0.6b
while getopts "r:p:t:m:" o; do
    case $o in
    r) ROUNDS=$OPTARG ;; p) PLEN=$OPTARG ;; t) NTOK=$OPTARG ;; m) SHAPE=$OPTARG ;;
    *) sed -n '2,14p' "$0"; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { sed -n '2,14p' "$0"; exit 2; }
OUT=${OUT:-/tmp/pd-gpu}
D=$OUT/ab
mkdir -p "$D"
RES=$(mktemp -p "$D" results.XXXX)
LIB=/tmp/pd-gpu-lib
export LD_LIBRARY_PATH="$LIB/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for v in "$@"; do # unpack what is still packed
    IFS='|' read -r _ pkg _ <<<"$v"
    if [ ! -x "$pkg/bin/pdserve-generate" ]; then
        [ -f "$pkg/bin.tar.xz" ] || { echo "gpu_ab: no package in $pkg"; exit 2; }
        tar -xJf "$pkg/bin.tar.xz" -C "$pkg" || exit 2
    fi
    if [ ! -d "$LIB/lib" ] && [ -f "$pkg/lib.tar.xz" ]; then # one package's libraries do
        mkdir -p "$LIB" && tar -xJf "$pkg/lib.tar.xz" -C "$LIB" || exit 2
    fi
done
[ -d "$LIB/lib" ] || { echo "gpu_ab: no package holds lib.tar.xz"; exit 2; }
for ((r = 1; r <= ROUNDS; r++)); do
    i=0
    for v in "$@"; do
        IFS='|' read -r label pkg envs <<<"$v"
        log="$RES-$i-$r.log"
        # shellcheck disable=SC2086
        env $envs "$pkg/bin/pdserve-generate" --model "tools/shapes/$SHAPE" --load-format dummy \
            --backend cuda --kv-cache-mb 4096 --random-prompt-len "$PLEN" --max-tokens "$NTOK" \
            --ignore-eos --temperature 0 >"$log" 2>&1
        t=$(sed -n 's/.*decode \([0-9.]*\) tok\/s.*/\1/p' "$log" | tail -n 1)
        echo "$i|$label|${t:-FAIL}" >>"$RES"
        echo "round $r  $label: ${t:-FAIL (see $log)}"
        i=$((i + 1))
    done
done
echo "== $SHAPE, prompt $PLEN, $NTOK tokens: decode tok/s, median of $ROUNDS (all runs)"
python3 - "$RES" <<'PY'
import sys
rows = [l.rstrip("\n").split("|") for l in open(sys.argv[1])]
by = {}
for i, label, t in rows:
    by.setdefault((int(i), label), []).append(t)
base = None
for (i, label), ts in sorted(by.items()):
    ok = sorted(float(t) for t in ts if t != "FAIL")
    med = ok[len(ok) // 2] if ok else 0.0
    base = base or med
    rel = "%+.1f%%" % (100.0 * (med / base - 1.0)) if base and med else ""
    print("  %-28s %9.1f  %7s   (%s)" % (label, med, rel, " ".join(ts)))
PY
