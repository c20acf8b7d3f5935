#!/usr/bin/env bash
# test_tokenize_cli.sh -- pdserve-tokenize end to end: ids and decoded text as JSON match HF's
# vectors, JSON string escaping round-trips, and every bad input gives a clear message and a
# non-zero exit (never a crash).
# usage: test_tokenize_cli.sh PATH/TO/pdserve-tokenize SHARED_DIR
set -u
BIN=$1
SHARED=$2
TOKS=$SHARED/testdata/tokenizers
[ -f "$TOKS/vectors.json" ] || { echo "no shared data: skip"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0

# expect_fail NAME WANT_RC SUBSTRING ARGS... : exit code WANT_RC and SUBSTRING on stderr.
expect_fail() {
    local name=$1 want_rc=$2 want=$3; shift 3
    "$BIN" "$@" >"$TMP/out" 2>"$TMP/err"
    local rc=$?
    if [ $rc -ne "$want_rc" ]; then
        echo "FAIL $name: exit $rc, want $want_rc"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    if ! grep -qF -- "$want" "$TMP/err"; then
        echo "FAIL $name: stderr lacks '$want':"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    echo "ok   $name"
}

# 1. a few cases of every tokenizer in vectors.json through the CLI (test_tokenizer_vectors
#    checks them all through the library)
python3 - "$BIN" "$TOKS" <<'PY' || fails=$((fails+1))
import json, subprocess, sys
bin_, toks = sys.argv[1], sys.argv[2]
vec = json.load(open(toks + '/vectors.json'))
bad = 0
n = 0
for name, entry in vec['tokenizers'].items():
    d = toks + '/' + name
    for c in [entry['cases'][i] for i in (0, 8, 19, 20, 21)]:
        for extra, key in (([], 'ids'), (['--add-special-tokens'], 'ids_with_special')):
            r = subprocess.run([bin_, '--tokenizer', d, '--text', c['text'], '--json'] + extra,
                               capture_output=True, text=True)
            if r.returncode != 0 or json.loads(r.stdout)['ids'] != c[key]:
                bad += 1
                print('FAIL encode', name, repr(c['text'])[:40], key, r.stdout[:200], r.stderr[:200])
        ids = ','.join(map(str, c['ids']))
        for extra, key in (([], 'decoded'), (['--skip-special-tokens'], 'decoded_skip_special')):
            r = subprocess.run([bin_, '--tokenizer', d, '--decode', ids] + extra,
                               capture_output=True, text=True)
            if r.returncode != 0 or json.loads(r.stdout)['text'] != c[key]:
                bad += 1
                print('FAIL decode', name, repr(c['text'])[:40], key, r.stdout[:200], r.stderr[:200])
        n += 1
print('%s  %d vector cases through the CLI' % ('ok  ' if not bad else 'FAIL', n))
sys.exit(1 if bad else 0)
PY

# 2. JSON escaping round-trips: quotes, backslashes, control characters, NUL-free text
python3 - "$BIN" "$TOKS/gpt2" <<'PY' || fails=$((fails+1))
import json, subprocess, sys
bin_, d = sys.argv[1], sys.argv[2]
text = 'say "hi"\\n\t\\ end\x01\x1f\x7f é 😀\r\n'
r = subprocess.run([bin_, '--tokenizer', d, '--text', text], capture_output=True, text=True, check=True)
ids = json.loads(r.stdout)['ids']
r = subprocess.run([bin_, '--tokenizer', d, '--decode', '[' + ', '.join(map(str, ids)) + ']'],
                   capture_output=True, text=True, check=True)
got = json.loads(r.stdout)['text']
assert got == text, (got, text)
r = subprocess.run([bin_, '--tokenizer', d, '--text', 'Hello, world!', '--plain'],
                   capture_output=True, text=True, check=True)
assert r.stdout == '15496,11,995,0\n', r.stdout
r = subprocess.run([bin_, '--tokenizer', d, '--decode', '15496,11,995,0', '--plain'],
                   capture_output=True, text=True, check=True)
assert r.stdout == 'Hello, world!\n', r.stdout
print('ok   JSON escaping round-trip and --plain')
PY

# 3. --help and the benchmark mode
"$BIN" --help >"$TMP/out" 2>&1 && grep -q "usage: pdserve-tokenize" "$TMP/out" \
    && echo "ok   --help" || { echo "FAIL --help"; fails=$((fails+1)); }
printf 'one paragraph\n\nanother one, 12345\n\n' >"$TMP/corpus.txt"
"$BIN" --tokenizer "$TOKS/stories260k" --bench "$TMP/corpus.txt" --repeat 1 >"$TMP/out" 2>"$TMP/err" \
    && grep -q '"mb_per_s"' "$TMP/out" && echo "ok   --bench" \
    || { echo "FAIL --bench"; cat "$TMP/err"; fails=$((fails+1)); }

# 4. bad inputs: clear message, non-zero exit
expect_fail "no arguments" 2 "need --tokenizer" 
expect_fail "two modes" 2 "exactly one of" --tokenizer "$TOKS/gpt2" --text hi --decode 1
expect_fail "unknown option" 2 "usage" --tokenizer "$TOKS/gpt2" --frobnicate
expect_fail "missing directory" 1 "cannot open" --tokenizer "$TMP/nope" --text hi
expect_fail "invalid UTF-8" 1 "not valid UTF-8" --tokenizer "$TOKS/gpt2" --text $'ab\xff'
expect_fail "unknown id" 1 "unknown token id 99999999" --tokenizer "$TOKS/gpt2" --decode 1,99999999
expect_fail "negative id" 1 "unknown token id -4" --tokenizer "$TOKS/gpt2" --decode=-4
expect_fail "bad id list" 2 "bad id" --tokenizer "$TOKS/gpt2" --decode 1,x
mkdir -p "$TMP/trunc" "$TMP/unsup"
head -c 2000 "$TOKS/stories260k/tokenizer.json" >"$TMP/trunc/tokenizer.json"
expect_fail "truncated tokenizer.json" 1 "malformed JSON" --tokenizer "$TMP/trunc" --text hi
python3 -c "
import json,sys
d=json.load(open('$TOKS/stories260k/tokenizer.json')); d['normalizer']={'type':'Lowercase'}
json.dump(d, open('$TMP/unsup/tokenizer.json','w'))"
expect_fail "unsupported normalizer" 1 'normalizer "Lowercase" is not supported' --tokenizer "$TMP/unsup" --text hi

[ $fails -eq 0 ] && echo "all passed" || echo "$fails FAILED"
[ $fails -eq 0 ]
