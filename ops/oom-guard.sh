#!/bin/bash
# oom-guard.sh - keep a glmspark node reachable under memory pressure (replaces the reference
# deployment's oom_fixer.sh). Every GLMSPARK_OOM_INTERVAL s (5):
#   1. sshd and journald get oom_score_adj -1000 (never OOM victims: a node without sshd
#      needs a power cycle); the control plane - postgres, glmspark-fcgi, nginx, this guard -
#      gets -900;
#   2. engine ranks (glmspark-engine, glmspark) get +500: if the kernel must kill, it kills
#      the engine, whose jobs resume from PostgreSQL after a restart;
#   3. when MemAvailable falls below GLMSPARK_OOM_FLOOR_MB (4096), the ranks named by the pid
#      files in GLMSPARK_RUN_DIR get SIGTERM (their whole session), and SIGKILL if memory is
#      still below the floor 10 s later: a clean stop before the kernel thrashes the node
#      into unreachability. Nothing is killed by name.
# Processes are matched by /proc/PID/comm (GLMSPARK_OOM_PROTECT, GLMSPARK_OOM_CONTROL and
# GLMSPARK_OOM_VICTIMS override the lists). Runs as root, as the unit
# glmspark-oom-guard.service. --once: one pass, then exit (tests).
set -uo pipefail
interval=${GLMSPARK_OOM_INTERVAL:-5}
floor_mb=${GLMSPARK_OOM_FLOOR_MB:-4096}
run=${GLMSPARK_RUN_DIR:-/var/lib/glmspark/run}
protect=" ${GLMSPARK_OOM_PROTECT:-sshd systemd-journal} "
control=" ${GLMSPARK_OOM_CONTROL:-postgres glmspark-fcgi nginx oom-guard.sh} "
victims=" ${GLMSPARK_OOM_VICTIMS:-glmspark-engine glmspark} "
once=0
[ "${1:-}" = --once ] && once=1
say() { echo "oom-guard: $*" >&2; }

set_adj() {  # set_adj PID VALUE COMM: only when different (the write is cheap, the log is not)
    local f=/proc/$1/oom_score_adj cur
    { read -r cur <"$f"; } 2>/dev/null || return 0
    [ "$cur" = "$2" ] && return 0
    if { echo "$2" >"$f"; } 2>/dev/null; then
        say "pid $1 ($3): oom_score_adj $cur -> $2"
    fi
}

starttime() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f20; }

# stop_ranks SIGNAL: signal every live rank of the pid files (session-wide for group ones).
stop_ranks() {
    local f pid start kind
    for f in "$run"/rank*.pid; do
        [ -f "$f" ] || continue
        read -r pid start kind <"$f" || continue
        if [ -z "$pid" ] || [ "$(starttime "$pid")" != "$start" ]; then continue; fi
        say "memory below ${floor_mb} MiB: SIG$1 to rank pid $pid ($f)"
        if [ "$kind" = group ]; then kill "-$1" -- "-$pid" 2>/dev/null
        else kill "-$1" "$pid" 2>/dev/null; fi
    done
}

pass() {
    local d pid comm
    for d in /proc/[0-9]*; do
        pid=${d#/proc/}
        { read -r comm <"$d/comm"; } 2>/dev/null || continue  # a builtin: no fork per process
        case $protect in *" $comm "*) set_adj "$pid" -1000 "$comm"; continue ;; esac
        case $control in *" $comm "*) set_adj "$pid" -900 "$comm"; continue ;; esac
        case $victims in *" $comm "*) set_adj "$pid" 500 "$comm" ;; esac
    done
    local avail_mb
    avail_mb=$(( $(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) / 1024 ))
    if [ "$avail_mb" -lt "$floor_mb" ]; then
        stop_ranks TERM
        [ "$once" = 1 ] && return 0
        sleep 10
        avail_mb=$(( $(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) / 1024 ))
        [ "$avail_mb" -lt "$floor_mb" ] && stop_ranks KILL
    fi
}

echo -900 >/proc/self/oom_score_adj 2>/dev/null || true
say "protecting:${protect}(-1000),${control}(-900); victims:${victims}(+500); floor ${floor_mb} MiB"
while :; do
    pass
    [ "$once" = 1 ] && exit 0
    sleep "$interval"
done
