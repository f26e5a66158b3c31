#!/bin/bash
# pagecache-dropper.sh - drop the clean page cache while a glmspark rank loads its weights
# (replaces the reference deployment's cache_dropper.sh). On unified memory (GB10) the page
# cache of the safetensors files competes with the weights for the same RAM; the loader
# already calls posix_fadvise(DONTNEED) behind itself (engine/model/checkpoint.c), and this is the
# second line: every GLMSPARK_DROP_INTERVAL s (5), while GLMSPARK_RUN_DIR/loading exists
# (ops/launch-cluster.sh creates it on every node and removes it when the rank is ready) or
# always with --always, when the page cache ("Cached" minus shared memory) exceeds
# GLMSPARK_DROP_ABOVE_MB (4096), write 1 to /proc/sys/vm/drop_caches (clean pages only:
# nothing dirty is lost, nothing is synced). Runs as root, as the unit
# glmspark-pagecache-dropper.service. --once: one pass, then exit (tests).
set -uo pipefail
interval=${GLMSPARK_DROP_INTERVAL:-5}
above_mb=${GLMSPARK_DROP_ABOVE_MB:-4096}
run=${GLMSPARK_RUN_DIR:-/var/lib/glmspark/run}
target=${GLMSPARK_DROP_CACHES_FILE:-/proc/sys/vm/drop_caches}
meminfo=${GLMSPARK_MEMINFO:-/proc/meminfo}
once=0 always=0
for a in "$@"; do
    case $a in
    --once) once=1 ;;
    --always) always=1 ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done
say() { echo "pagecache-dropper: $*" >&2; }
cache_mb() { awk '/^Cached:/ {c = $2} /^Shmem:/ {s = $2} END {print int((c - s) / 1024)}' "$meminfo"; }

pass() {
    [ "$always" = 1 ] || [ -e "$run/loading" ] || return 0
    local before
    before=$(cache_mb)
    [ "$before" -gt "$above_mb" ] || return 0
    if echo 1 >"$target" 2>/dev/null; then
        say "page cache ${before} MiB > ${above_mb} MiB: dropped, now $(cache_mb) MiB"
    else
        say "cannot write $target (not root? a container?)"
    fi
}

echo -900 >/proc/self/oom_score_adj 2>/dev/null || true
say "active while $run/loading exists$([ "$always" = 1 ] && echo ' (and --always)'); threshold ${above_mb} MiB"
while :; do
    pass
    [ "$once" = 1 ] && exit 0
    sleep "$interval"
done
