#!/bin/bash
# fuzz_run.sh BINARY CORPUS SCRATCH - a bounded libFuzzer run for ctest (label fuzz).
#
# Fuzzes for GLMSPARK_FUZZ_SECONDS (default 30; CI passes 150) into SCRATCH, seeded from the
# committed CORPUS, with tests/fuzz/dict/<parser>.dict when there is one. UBSan reports are
# fatal. Crash, leak, timeout and OOM inputs go to SCRATCH.crashes/ (outside the scratch
# corpus, so a rerun does not silently replay them); when the run fails, each one's path is
# printed with the command that reproduces it, and the exit status is non-zero. To keep a
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
"$bin" "${args[@]}" "$scratch" "$corpus" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
found=$(grep -o 'Test unit written to .*' "$log" | sed 's/^Test unit written to //')
stats=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)
rm -f "$log"
if [ "$rc" -eq 0 ] && [ -z "$found" ]; then
    echo "fuzz $parser: ok, ${GLMSPARK_FUZZ_SECONDS:-30} s: ${stats:-no stats}"
    exit 0
fi
echo "FUZZ FAILED: $parser (libFuzzer exit status $rc)"
for f in $found; do
    echo "  input: $f"
    echo "  reproduce: $bin $f"
done
[ -n "$found" ] || echo "  no input was written; see the log above"
echo "  fix the parser, then copy the input into $corpus/ as a regression test"
exit 1
