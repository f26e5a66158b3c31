#!/bin/bash
# prefuzz.sh BIN_DIR [SECONDS] [PROCS] - fuzz every target on a big machine and merge what
# adds coverage into the committed corpora, so that CI's short runs start from there.
#
# Runs PROCS (default 2) libFuzzer processes per target, all targets at once (8 targets x 2
# = 16 cores), for SECONDS (default 120), each process fuzzing into a shared scratch corpus
# seeded from tests/fuzz/corpus/<parser>/; then `-merge=1` copies into the committed corpus
# only the inputs that add coverage (features). Crash, leak, timeout and OOM inputs land in
# $PREFUZZ_WORK/<parser>/crashes/ (default work dir /tmp/glmspark-prefuzz) and are listed;
# the exit status is 1 when there is one. BIN_DIR holds the fuzz_* binaries of a clang
# FUZZ=ON build. libFuzzer re-runs argv[0] for -merge, so the binaries must start by
# themselves: on another machine, point LD_LIBRARY_PATH at copies of the shared libraries
# they need (ldd), leaving glibc out.
set -u
bins=$1 seconds=${2:-120} procs=${3:-2}
src=$(cd "$(dirname "$0")/../.." && pwd)
work=${PREFUZZ_WORK:-/tmp/glmspark-prefuzz}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
rm -rf "$work"
for b in "$bins"/fuzz_*; do
    p=${b##*/fuzz_}
    mkdir -p "$work/$p/new" "$work/$p/crashes"
    dict=()
    [ -f "$src/tests/fuzz/dict/$p.dict" ] && dict=(-dict="$src/tests/fuzz/dict/$p.dict")
    for j in $(seq "$procs"); do
        "$b" -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=10 -print_final_stats=1 \
            -seed=$((j * 7919)) "${dict[@]}" -artifact_prefix="$work/$p/crashes/" \
            "$work/$p/new" "$src/tests/fuzz/corpus/$p" >"$work/$p/log$j" 2>&1 &
    done
done
wait
for b in "$bins"/fuzz_*; do
    p=${b##*/fuzz_}
    timeout 300 "$b" -merge=1 -rss_limit_mb=4096 -timeout=10 "$src/tests/fuzz/corpus/$p" \
        "$work/$p/new" >"$work/$p/merge.log" 2>&1 &
done
wait
status=0
for b in "$bins"/fuzz_*; do
    p=${b##*/fuzz_}
    runs=$(grep -h 'stat::number_of_executed_units' "$work/$p"/log* | awk '{s += $2} END {print s}')
    last=$(grep -h -E '^#[0-9]+[[:space:]]+DONE' "$work/$p/log1" | sed -E 's/.*(cov: [0-9]+ ft: [0-9]+).*/\1/')
    added=$(grep -o -E '[0-9]+ new files with [0-9]+ new features' "$work/$p/merge.log" | tail -1)
    echo "$p: $runs runs, $last, merge: ${added:-FAILED, see $work/$p/merge.log}"
    for f in "$work/$p/crashes"/*; do
        [ -e "$f" ] || continue
        echo "  CRASH: $f (log: $work/$p/log*)"
        status=1
    done
done
exit $status
