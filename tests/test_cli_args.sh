#!/usr/bin/env bash
# test_cli_args.sh -- pdserve-cli's argument errors, before any connection (no server needed):
# an unknown --flag is named as such (with the dashed spelling suggested for --max_tokens),
# not mistaken for a prompt; a second bare argument asks to quote the prompt; --help works
# after the command.
# usage: test_cli_args.sh PATH/TO/pdserve-cli
set -u
CLI=$1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0

# expect RC NAME SUBSTRING ARGS... : the command must exit RC and print SUBSTRING on stderr
# (SUBSTRING "" = anything); "!SUBSTRING" means stderr must not contain it.
expect() {
    local want_rc=$1 name=$2 want=$3; shift 3
    "$CLI" "$@" >"$TMP/out" 2>"$TMP/err"
    local rc=$?
    if [ $rc -ne "$want_rc" ]; then
        echo "FAIL $name: exit $rc, want $want_rc"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    if [ "${want#!}" != "$want" ]; then
        if grep -qF -- "${want#!}" "$TMP/err"; then
            echo "FAIL $name: stderr has '${want#!}':"; cat "$TMP/err"; fails=$((fails+1)); return
        fi
    elif [ -n "$want" ] && ! grep -qF -- "$want" "$TMP/err"; then
        echo "FAIL $name: stderr lacks '$want':"; cat "$TMP/err"; fails=$((fails+1)); return
    fi
    echo "ok   $name"
}

# The papercut of issue #40: the value and the prompt after an unknown flag.
expect 2 "--max_tokens named, --max-tokens suggested" \
    "unknown flag --max_tokens (did you mean --max-tokens?)" generate --max_tokens 5 "hi"
expect 2 "--max_tokens: not 'quote the prompt'" "!quote the prompt" generate --max_tokens 5 "hi"
expect 2 "--top_p=0.5 (with '=')" "unknown flag --top_p (did you mean --top-p?)" generate --top_p=0.5 "hi"
expect 2 "--ignore_eos (a boolean flag)" "did you mean --ignore-eos?" generate --ignore_eos "hi"
expect 2 "--tls_ca (a TLS flag)" "did you mean --tls-ca?" health --tls_ca x
expect 2 "unknown flag without a near name" "unknown flag --bogus (try --help)" generate --bogus 1 "hi"
expect 2 "--no_such_flag: no suggestion" "unknown flag --no_such_flag (try --help)" info --no_such_flag
expect 2 "two bare arguments" "unexpected argument 'there' (quote the prompt)" generate hi there
expect 2 "a known flag's bad value" "invalid value 'x' for --max-tokens" generate --max-tokens x "hi"
expect 0 "generate --help" "" generate --help
grep -qF -- "--max-tokens" "$TMP/out" || { echo "FAIL generate --help lacks --max-tokens"; fails=$((fails+1)); }
expect 0 "generate -h" "" generate -h
expect 2 "unknown command" "unknown command 'gen'" gen "hi"

echo "$fails failures"
[ $fails -eq 0 ]
