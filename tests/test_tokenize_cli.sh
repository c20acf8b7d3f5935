#!/usr/bin/env bash
# test_tokenize_cli.sh -- pdserve-tokenize end to end: ids and decoded text as JSON match HF's
# vectors, JSON string escaping round-trips, --chat renders conversations as HF's chat
# templates do (tests/chat/vectors.json) and encodes them, and every bad input gives a clear
# message and a non-zero exit (never a crash).
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
expect_fail "text and chat" 2 "exactly one of" --tokenizer "$TOKS/gpt2" --text hi --chat x.json
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

# 5. --chat: the model's chat template rendered as HF renders it (tests/chat/vectors.json),
#    encoded without added special tokens: the template's special tokens are single ids (one
#    BOS for Llama 3, not two), and the ids decode back to the text
python3 - "$BIN" "$TOKS" "$(dirname "$0")/chat/vectors.json" "$TMP" <<'PY' || fails=$((fails+1))
import json, subprocess, sys
bin_, toks, vectors, tmp = sys.argv[1:5]
vec = json.load(open(vectors))
special = {'llama3': {'<|begin_of_text|>': 128000, '<|start_header_id|>': 128006,
                      '<|end_header_id|>': 128007, '<|eot_id|>': 128009},
           'qwen3': {'<|im_start|>': 151644, '<|im_end|>': 151645}}
bad = n = 0
for c in vec['chat']:
    model = c['model'].split('/')[-1]
    if not c['model'].startswith('tokenizers/') or 'output' not in c or c['conversation'] not in (
            'system_user', 'multi_turn', 'unicode', 'special_tokens_in_content'):
        continue
    path = '%s/chat_%d.json' % (tmp, n)
    json.dump({'messages': c['messages']}, open(path, 'w'))
    args = [bin_, '--tokenizer', toks + '/' + model, '--chat', path]
    if c['add_generation_prompt']:
        args.append('--add-generation-prompt')
    r = subprocess.run(args, capture_output=True, text=True)
    n += 1
    try:
        out = json.loads(r.stdout)
    except ValueError:
        out = {}
    text, ids = out.get('text'), out.get('ids', [])
    problems = []
    if r.returncode != 0 or text != c['output']:
        problems.append('text %r, want %r (%s)' % (text, c['output'], r.stderr.strip()))
    for tok, tid in special[model].items():
        if text is None or ids.count(tid) != text.count(tok):
            problems.append('%s: %d ids %d for %d in the text' % (tok, ids.count(tid), tid,
                                                                  (text or '').count(tok)))
    if model == 'llama3' and ids[:2] != [128000, 128006]:
        problems.append('llama3 ids start %s, want one BOS 128000 then 128006' % ids[:2])
    if c['add_generation_prompt']:  # (one of the two is enough: each run loads the tokenizer)
        r2 = subprocess.run([bin_, '--tokenizer', toks + '/' + model, '--text', text or '',
                             '--json'], capture_output=True, text=True)
        if r2.returncode != 0 or json.loads(r2.stdout)['ids'] != ids:
            problems.append('--text of the same text gives other ids')
        r3 = subprocess.run([bin_, '--tokenizer', toks + '/' + model, '--decode',
                             ','.join(map(str, ids))], capture_output=True, text=True)
        if r3.returncode != 0 or json.loads(r3.stdout)['text'] != text:
            problems.append('the ids do not decode to the text')
    if problems:
        bad += 1
        print('FAIL --chat', c['model'], c['conversation'], c['add_generation_prompt'], problems)
print('%s  %d --chat renderings of llama3 and qwen3 match jinja2, one id per special token'
      % ('ok  ' if not bad and n >= 16 else 'FAIL', n))
sys.exit(1 if bad or n < 16 else 0)
PY
printf '{"messages": [{"role": "user", "content": "hi"}]}' >"$TMP/chat.json"
"$BIN" --tokenizer "$TOKS/qwen3" --chat "$TMP/chat.json" --plain >"$TMP/out" 2>"$TMP/err" \
    && [ "$(cat "$TMP/out")" = "$(printf '<|im_start|>user\nhi<|im_end|>')" ] && echo "ok   --chat --plain" \
    || { echo "FAIL --chat --plain"; cat "$TMP/out" "$TMP/err"; fails=$((fails+1)); }
"$BIN" --tokenizer "$TOKS/qwen3" --chat - --add-generation-prompt <"$TMP/chat.json" >"$TMP/out" 2>"$TMP/err" \
    && grep -qF '"ids": [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]' "$TMP/out" \
    && echo "ok   --chat - (stdin)" || { echo "FAIL --chat -"; cat "$TMP/out" "$TMP/err"; fails=$((fails+1)); }
expect_fail "chat without a template" 1 "ships no chat template" --tokenizer "$TOKS/mistral" --chat "$TMP/chat.json"
expect_fail "chat without a template (stories260k)" 1 "ships no chat template" --tokenizer "$TOKS/stories260k" --chat "$TMP/chat.json"
expect_fail "chat file missing" 1 "--chat $TMP/nope.json" --tokenizer "$TOKS/qwen3" --chat "$TMP/nope.json"
printf '{"messages": [{"content": "no role"}]}' >"$TMP/norole.json"
expect_fail "chat message without role" 1 'needs a string "role"' --tokenizer "$TOKS/qwen3" --chat "$TMP/norole.json"
printf '{"msgs": []}' >"$TMP/nomsgs.json"
expect_fail "chat without messages" 1 'expected {"messages"' --tokenizer "$TOKS/qwen3" --chat "$TMP/nomsgs.json"
expect_fail "generation prompt without chat" 2 "goes with --chat" --tokenizer "$TOKS/qwen3" --text hi --add-generation-prompt
mkdir -p "$TMP/raising"
ln -s "$(cd "$TOKS/llama3" && pwd)/tokenizer.json" "$TMP/raising/tokenizer.json"
printf '%s' '{"chat_template": "{% if messages[0].role != \"user\" %}{{ raise_exception(\"Conversation must start with a user message\") }}{% endif %}"}' \
    >"$TMP/raising/tokenizer_config.json"
printf '{"messages": [{"role": "assistant", "content": "x"}]}' >"$TMP/asst.json"
expect_fail "chat template raises" 1 "Conversation must start with a user message" --tokenizer "$TMP/raising" --chat "$TMP/asst.json"

[ $fails -eq 0 ] && echo "all passed" || echo "$fails FAILED"
[ $fails -eq 0 ]
