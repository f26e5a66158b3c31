#!/bin/bash
# cleanup.sh - stop glmspark's ranks on every node and verify that nothing is left.
#
#   ops/cleanup.sh [--env FILE] [--local]
#
# On every node of GLMSPARK_NODES, the head (rank 0) first, then the others at once
# (--local: this machine only, no transport): each pid file in GLMSPARK_RUN_DIR (rank*.pid,
# and launcher.pid of an mpirun/srun launch) whose process is still the one recorded (same
# start time) gets SIGTERM, to its whole session for ssh-launched ranks, so the engine
# finishes its step and hands its job back;
# GLMSPARK_STOP_TIMEOUT s (90) later, SIGKILL. Nothing is killed by name. Then every process
# that still carries the cluster's GLMSPARK_CLUSTER_ID (all ranks and their children do) is
# reported and killed, and the node reports "nothing left". Stale pid files are removed.
# Exit status 0 when every node answered and nothing is left, 1 otherwise (naming the host).
# Works the same after an mpirun/srun launch. Idempotent: a second run finds nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cl_prog=cleanup
# shellcheck source=ops/cluster-lib.sh
. "$here/cluster-lib.sh"

env_file=${GLMSPARK_ENV:-/etc/glmspark/env}
env_explicit=0
is_local=0
while [ $# -gt 0 ]; do
    case $1 in
    --env) [ $# -ge 2 ] || { echo "usage: ops/cleanup.sh [--env FILE] [--local]" >&2; exit 2; }
        env_file=$2; env_explicit=1; shift 2 ;;
    --local) is_local=1; shift ;;
    *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done
if [ "$is_local" = 1 ]; then
    GLMSPARK_NODES=${GLMSPARK_NODES:-localhost}
    cl_load_env "$env_file" "$env_explicit"
    run=$cl_run timeout=$cl_stop_timeout bash -c "run=\$run; timeout=\$timeout; $cl_stop_script"
    exit $?
fi
cl_load_env "$env_file" "$env_explicit"
# The head's launcher (mpirun/srun) first, when there is one: it takes its ranks down.
if [ -f "$cl_run/launcher.pid" ]; then
    run=$cl_run timeout=$cl_stop_timeout bash -c "run=\$run; timeout=\$timeout; $cl_stop_script" >&2 || true
fi
# Rank 0 (the head) first: it finishes its step and hands its jobs back while the pipeline
# is whole; then the other nodes at once (their ranks may have exited already).
status=0
cl_stop_all "${cl_nodes[0]}" || status=1
if [ ${#cl_nodes[@]} -gt 1 ]; then cl_stop_all "${cl_nodes[@]:1}" || status=1; fi
if [ "$status" = 0 ]; then
    cl_say "every node clean: ${cl_nodes[*]}"
else
    cl_say "FAILED: see the nodes above"
    exit 1
fi
