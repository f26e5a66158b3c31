#!/bin/sh
# node_test.sh ARGS... - `node --test --test-reporter=spec ARGS...`, counting skips honestly:
# when every test passed but some were skipped (node:test's `skip`), it names them and exits
# 77, which the ctest calling it reports as skipped (SKIP_RETURN_CODE), never as passed.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
node --test --test-reporter=spec "$@" >"$log" 2>&1
status=$?
cat "$log"
skipped=$(sed -n 's/^ℹ skipped \([0-9]*\)$/\1/p' "$log" | tail -1)
if [ "$status" -eq 0 ] && [ "${skipped:-0}" -gt 0 ]; then
    echo "SKIPPED: $skipped node tests did not run:"
    grep -E '# SKIP' "$log" | sed 's/^/  /'
    exit 77
fi
exit $status
