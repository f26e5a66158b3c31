#!/bin/bash
# fuzz_run.sh BINARY CORPUS SCRATCH - a bounded libFuzzer run for ctest (label fuzz).
#
# Fuzzes for GLMSPARK_FUZZ_SECONDS (default 30; CI passes 150) into SCRATCH, seeded from the
# committed CORPUS, with tests/fuzz/dict/<parser>.dict when there is one. UBSan reports are
# fatal. Crash, leak, timeout and OOM inputs go to SCRATCH.crashes/ (outside the scratch
# corpus, so a rerun does not silently replay them); when the run fails, each one's path is
# printed with the command that reproduces it and its bytes in base64, then libFuzzer's report
# without its progress lines, and the exit status is non-zero. To keep a
# crash as a regression test: fix it, then copy the input into CORPUS.
set -u
bin=$1 corpus=$2 scratch=$3
parser=$(basename "$corpus")
crashes=$scratch.crashes
dict=$(dirname "$0")/../fuzz/dict/$parser.dict
mkdir -p "$scratch" "$crashes"
args=(-max_total_time="${GLMSPARK_FUZZ_SECONDS:-30}" -rss_limit_mb=4096 -timeout=10
      -print_final_stats=1 -artifact_prefix="$crashes/")
[ -f "$dict" ] && args+=(-dict="$dict")
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
log=$(mktemp)
# libFuzzer's progress lines (hundreds) go to the log only: a failing run's report must lead
# what ctest prints, since a CI summary shows the head of a failing test's output.
"$bin" "${args[@]}" "$scratch" "$corpus" >"$log" 2>&1
rc=$?
found=$(grep -o 'Test unit written to .*' "$log" | sed 's/^Test unit written to //')
stats=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)
if [ "$rc" -eq 0 ] && [ -z "$found" ]; then
    rm -f "$log"
    echo "fuzz $parser: ok, ${GLMSPARK_FUZZ_SECONDS:-30} s: ${stats:-no stats}"
    exit 0
fi
echo "FUZZ FAILED: $parser (libFuzzer exit status $rc)"
for f in $found; do
    echo "  input: $f ($(stat -c %s "$f") bytes)"
    echo "  reproduce: $bin $f"
    # The input itself, so that a run on another machine can be reproduced from its log:
    # base64 -d > input.
    echo "  base64: $(head -c 8192 "$f" | base64 -w0)"
done
[ -n "$found" ] || echo "  no input was written; see the report below"
echo "  fix the parser, then copy the input into $corpus/ as a regression test"
echo "== libFuzzer's report (progress lines left out; the whole log: $log)"
grep -vE '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse|RELOAD)' "$log" | tail -120
exit 1
