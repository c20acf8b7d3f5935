#!/usr/bin/env bash
# bench_tokenizer.sh -- Single-thread encode throughput (MB/s) of pdserve's tokenizer and of HF
# tokenizers 0.23.2 (its Node binding), side by side on the same few MB of mixed text, for the
# qwen3 and llama3 tokenizers; also checks that both give the same ids (count and FNV-1a hash).
# Columns: ours = tok_encode_scratch (reused scratch with a word cache), ours-noscr = plain
# tok_encode, HF = one awaited encode() per paragraph, HF batch = encodeBatch on one thread;
# all MB/s of UTF-8 input, best of 3 passes after a warm-up.
#
# usage: tools/bench_tokenizer.sh [BUILD_DIR]     (default: build-tokrel, a Release build)
# env:   PDSERVE_SHARED  shared data dir (default: ../shared beside the repository)
#        TOKBENCH_DIR    work dir for the corpus and node_modules (default: /tmp/tokbench)
#        TOKBENCH_MB     corpus size in MB (default 4)
#        TOKENIZERS      tokenizers to run (default: "qwen3 llama3")
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build-tokrel}
SHARED=${PDSERVE_SHARED:-$ROOT/../shared}
WORK=${TOKBENCH_DIR:-/tmp/tokbench}
MB=${TOKBENCH_MB:-4}
TOKS=${TOKENIZERS:-qwen3 llama3}
BIN=$BUILD/bin/pdserve-tokenize
[ -x "$BIN" ] || { echo "no $BIN: build it first (cmake -DCMAKE_BUILD_TYPE=Release)" >&2; exit 1; }
mkdir -p "$WORK"

# The corpus: paragraphs of English prose (the system's licence texts), source code (C headers
# from /usr/include, Python's standard library) and CJK / multilingual text (Python's CJK codec
# test texts, the tokenizer test strings), shuffled with a fixed seed and repeated up to the
# wanted size. Only files of the system image are used, so the corpus does not change with
# this repository.
python3 - "$ROOT" "$SHARED" "$MB" > "$WORK/corpus.txt" <<'PY'
import glob, json, os, random, sys
root, shared, mb = sys.argv[1], sys.argv[2], float(sys.argv[3])
def read(p):
    try:
        return open(p, encoding='utf-8').read()
    except (OSError, UnicodeDecodeError):
        return ''
groups = {
    'prose': sorted(glob.glob('/usr/share/common-licenses/*')),
    'code': sorted(glob.glob('/usr/include/*.h'))[:150] + sorted(glob.glob(os.path.dirname(os.__file__) + '/*.py'))[:60],
    'cjk': sorted(glob.glob(os.path.dirname(os.__file__) + '/test/cjkencodings/*-utf8.txt')),
}
paras = {}
for g, files in groups.items():
    ps = []
    for f in files:
        ps += [p.strip('\n') + '\n\n' for p in read(f).split('\n\n') if p.strip()]
    paras[g] = ps
try:
    vec = json.load(open(shared + '/testdata/tokenizers/vectors.json'))
    texts = [c['text'] for c in vec['tokenizers']['qwen3']['cases'] if c['text'].strip()]
    paras['cjk'] += [' '.join(texts[i:i + 6]) + '\n\n' for i in range(0, len(texts), 6)]
except (OSError, KeyError, ValueError):
    pass
rng = random.Random(1234)
share = {'prose': 0.45, 'code': 0.35, 'cjk': 0.20}
out, size, want = [], {g: 0 for g in share}, mb * 1e6
while sum(size.values()) < want:
    g = min(share, key=lambda k: size[k] / share[k])  # the group furthest below its share
    if not paras[g]:
        share.pop(g)
        continue
    p = rng.choice(paras[g])
    out.append(p)
    size[g] += len(p.encode())
sys.stdout.write(''.join(out))
sys.stderr.write('corpus: %.2f MB (%s)\n' % (sum(size.values()) / 1e6,
                 ', '.join('%s %.0f%%' % (g, 100 * size[g] / sum(size.values())) for g in size)))
PY

if [ ! -d "$WORK/node_modules/tokenizers" ]; then
    (cd "$WORK" && npm install --no-save --no-package-lock tokenizers@0.23.2 >/dev/null)
fi

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//') ($(nproc) cores)"
printf '%-8s %10s %10s %10s %10s %10s %10s  %s\n' tokenizer "ours" "ours-noscr" "HF" "HF batch" "ours load" "HF load" "ids"
for tok in $TOKS; do
    dir=$SHARED/testdata/tokenizers/$tok
    ours=$("$BIN" --tokenizer "$dir" --bench "$WORK/corpus.txt" --repeat 3)
    plain=$("$BIN" --tokenizer "$dir" --bench "$WORK/corpus.txt" --repeat 3 --no-scratch)
    hf=$(NODE_PATH="$WORK/node_modules" RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
         node "$ROOT/tools/bench_tokenizer_hf.js" "$dir/tokenizer.json" "$WORK/corpus.txt" 3)
    python3 - "$tok" "$ours" "$hf" "$plain" <<'PY'
import json, sys
tok, a, b, p = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
same = a['tokens'] == b['tokens'] == p['tokens'] and a['ids_fnv1a'] == b['ids_fnv1a'] == p['ids_fnv1a']
print('%-8s %10.1f %10.1f %10.1f %10.1f %8.0fms %8.0fms  %s (%d tokens)' % (
    tok, a['mb_per_s'], p['mb_per_s'], b['encode_mb_per_s'], b['batch_mb_per_s'], a['load_ms'], b['load_ms'],
    'identical' if same else 'DIFFERENT (ours %d %d, HF %d %d)' % (a['tokens'], a['ids_fnv1a'], b['tokens'], b['ids_fnv1a']),
    a['tokens']))
PY
done
