#!/bin/bash
# cluster-lib.sh - shared by ops/launch-cluster.sh and ops/cleanup.sh (sourced, not run):
# reading the settings, running a script on a node, and the per-node stop script.
#
# Settings (ops/env.example): GLMSPARK_NODES, GLMSPARK_RUN_DIR, GLMSPARK_RSH (a command
# that takes HOST and a shell command string, as ssh does), GLMSPARK_RSH_ARGV=1 for
# transports that take HOST and argv instead (srun), GLMSPARK_STOP_TIMEOUT.
# shellcheck disable=SC2034,SC2016  # variables for the sourcing scripts; remote scripts

: "${cl_prog:=glmspark}"

cl_die() { echo "$cl_prog: $*" >&2; exit 1; }
cl_say() { echo "$cl_prog: $*" >&2; }

# cl_load_env FILE IS_EXPLICIT: source the settings (variables already set win).
cl_load_env() {
    local file=$1 explicit=$2
    if [ -f "$file" ]; then
        local saved
        saved=$(export -p)
        set -a
        # shellcheck disable=SC1090
        . "$file"
        set +a
        eval "$saved"
    elif [ "$explicit" = 1 ]; then
        cl_die "no settings file \"$file\""
    fi
    read -r -a cl_nodes <<<"${GLMSPARK_NODES:-}"
    [ "${#cl_nodes[@]}" -gt 0 ] || cl_die "GLMSPARK_NODES is empty (see ops/env.example)"
    cl_run=${GLMSPARK_RUN_DIR:-/var/lib/glmspark/run}
    cl_rsh=${GLMSPARK_RSH:-ssh -o BatchMode=yes -o ConnectTimeout=10}
    cl_stop_timeout=${GLMSPARK_STOP_TIMEOUT:-90}
}

# cl_remote HOST SCRIPT: run the bash script on HOST through the transport; its stdout and
# stderr are the caller's, its exit status the function's.
cl_remote() {
    local host=$1 script=$2
    local -a rsh
    read -r -a rsh <<<"$cl_rsh"
    if [ "${GLMSPARK_RSH_ARGV:-0}" = 1 ]; then
        "${rsh[@]}" "$host" bash -c "$script" </dev/null
    else
        "${rsh[@]}" "$host" "bash -c $(printf '%q' "$script")" </dev/null
    fi
}

# cl_vars NAME=VALUE...: shell assignments a remote script can start with.
cl_vars() {
    local kv
    for kv in "$@"; do printf '%s=%q\n' "${kv%%=*}" "${kv#*=}"; done
}

# The stop script run on every node (after cl_vars run=... timeout=...). A pid file holds
# "PID STARTTIME KIND": KIND group (a setsid session: the whole group is signalled) or
# single (under mpirun/srun). STARTTIME (field 22 of /proc/PID/stat) guards against a
# recycled pid: a file whose process is gone or different is stale and only removed.
# SIGTERM first (the engine finishes its step and hands its job back), SIGKILL after
# $timeout s; then every process still carrying a GLMSPARK_CLUSTER_ID of a pid file's
# cluster (all ranks export it) is reported and killed. Prints one summary line; exit 0
# only when nothing is left.
cl_stop_script='
set -u
starttime() { sed "s/^.*) //" "/proc/$1/stat" 2>/dev/null | cut -d" " -f20; }
alive() {  # alive PID START
    [ -n "$1" ] && [ -d "/proc/$1" ] && [ "$(starttime "$1")" = "$2" ]
}
n_stopped=0 n_stale=0
pids="" ids=""
for f in "$run"/rank*.pid "$run"/launcher.pid; do
    [ -f "$f" ] || continue
    read -r pid start kind <"$f" || true
    id=$(cat "${f%.pid}.cluster" 2>/dev/null || true)
    [ -n "$id" ] && ids="$ids $id"
    if ! alive "$pid" "$start"; then
        rm -f "$f"
        n_stale=$((n_stale + 1))
        continue
    fi
    if [ "$kind" = group ]; then kill -TERM -- "-$pid" 2>/dev/null || true
    else kill -TERM "$pid" 2>/dev/null || true; fi
    pids="$pids $pid:$start:$kind:$f"
done
deadline=$(($(date +%s) + timeout))
for entry in $pids; do
    IFS=: read -r pid start kind f <<<"$entry"
    while alive "$pid" "$start" && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.2; done
    if alive "$pid" "$start"; then
        echo "pid $pid did not stop in ${timeout}s after SIGTERM: SIGKILL" >&2
        if [ "$kind" = group ]; then kill -KILL -- "-$pid" 2>/dev/null || true
        else kill -KILL "$pid" 2>/dev/null || true; fi
        sleep 0.2
    fi
    if [ "$kind" = group ]; then  # the rest of its session (children that outlived it)
        for p in $(pgrep -s "$pid" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
    fi
    rm -f "$f"
    n_stopped=$((n_stopped + 1))
done
# Processes of this node only: same network namespace (one per machine; the three-"node"
# test on one machine separates its nodes by network namespace).
my_net=$(readlink /proc/self/ns/net)
left=""
for i in 1 2 3 4 5 6 7 8 9 10; do
    left=""
    for id in $ids; do
        for e in $(grep -lzx "GLMSPARK_CLUSTER_ID=$id" /proc/[0-9]*/environ 2>/dev/null); do
            p=${e#/proc/}
            p=${p%/environ}
            [ "$p" = "$$" ] && continue
            [ "$(readlink "/proc/$p/ns/net" 2>/dev/null)" = "$my_net" ] && left="$left $p"
        done
    done
    [ -z "$left" ] && break
    for p in $left; do kill -KILL "$p" 2>/dev/null || true; done
    [ "$i" = 1 ] && echo "killed leftover processes of the cluster:$left" >&2
    sleep 0.2
done
rm -f "$run"/rank*.cluster "$run"/launcher.cluster "$run"/loading
if [ -n "$left" ]; then
    echo "$(hostname): stopped $n_stopped, STILL RUNNING:$left"
    exit 1
fi
echo "$(hostname): stopped $n_stopped process group(s), $n_stale stale pid file(s); nothing left"
'

# cl_stop_all NODE...: run the stop script on every node at once; exit status 0 when every
# node answered and has nothing left.
cl_stop_all() {
    local host tmp status=0 i=0
    tmp=$(mktemp -d)
    local -a pids=()
    for host in "$@"; do
        cl_remote "$host" "$(cl_vars run="$cl_run" timeout="$cl_stop_timeout")$cl_stop_script" \
            >"$tmp/$i.out" 2>&1 &
        pids+=($!)
        i=$((i + 1))
    done
    i=0
    for host in "$@"; do
        if wait "${pids[$i]}"; then
            sed "s/^/  $host: /" "$tmp/$i.out" >&2
        else
            cl_say "$host: stop failed or processes are left:"
            sed "s/^/  $host: /" "$tmp/$i.out" >&2
            status=1
        fi
        i=$((i + 1))
    done
    rm -rf "$tmp"
    return $status
}
