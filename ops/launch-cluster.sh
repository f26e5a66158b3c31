#!/bin/bash
# launch-cluster.sh - start glmspark on every node of the cluster, from the head node.
#
#   ops/launch-cluster.sh [--env FILE] [--recipe FILE] [--check-only] [--wait] [-- ARGS...]
#
# 1. Checks every node in GLMSPARK_NODES at once: reachable through the transport, the rank
#    binary present, the same model files as the head (sizes of every file and sha256 of
#    every *.json; GLMSPARK_CHECK_HASH=full hashes every file), enough available memory and
#    free disk, and no glmspark rank already running. Every failure is reported with its
#    host; nothing starts unless every node passes. --check-only stops here.
# 2. Starts one rank per node, node i being rank i: by default over ssh, each rank in its own
#    session (setsid) with a pid file, its log and its exit status in GLMSPARK_RUN_DIR on that
#    node; with GLMSPARK_LAUNCHER=mpirun or srun, one mpirun/srun on the head starts them all
#    (ranks then come from OMPI_COMM_WORLD_RANK / PMI_RANK / SLURM_PROCID).
#    Each rank runs GLMSPARK_RANK_CMD (default: glmspark-engine --model MODEL --recipe
#    RECIPE) plus --rank R --world N --master ADDR:PORT (ssh, more than one node), or
#    GLMSPARK_MASTER in its environment (mpirun/srun), plus ARGS; with the variables in
#    GLMSPARK_PASS_ENV and GLMSPARK_CLUSTER_ID (a fresh id that ops/cleanup.sh uses to
#    verify nothing is left). Rank 0 alone gets GLMSPARK_DB in its environment (the engine
#    reads it like --db; only rank 0 talks to PostgreSQL, and the conninfo stays out of ps).
# 3. Waits for readiness, printing progress as it changes: each rank's last log line, and
#    with GLMSPARK_READY=status (the default when the rank command is the engine's and
#    GLMSPARK_DB is set) the rank lines of `glmspark status` (state, layers, weights, load
#    %); ready is `glmspark status` exiting 0 for a boot newer than the launch (the engine
#    up, every rank up). With GLMSPARK_READY=log (the default for GLMSPARK_RANK_CMD), ready
#    is every rank's log matching GLMSPARK_READY_RE. A rank that dies or exits first, a node
#    silent for GLMSPARK_MAX_MISSED polls in a row (10; one missed answer is not a dead
#    node), or the recipe's load_timeout_s running out, is reported with its host, exit
#    status and last log lines, and every node is cleaned up. The marker file
#    GLMSPARK_RUN_DIR/loading exists on a node while its rank loads (ops/pagecache-dropper.sh
#    works while it is there).
# --wait then stays until every rank has exited, and exits 0 only when all exited 0 (for
#    batch commands and tests; SIGINT/SIGTERM stop the cluster). Without --wait the ranks
#    keep running after the script exits; stop them with ops/cleanup.sh.
#
# Settings: ops/env.example (default file /etc/glmspark/env, or GLMSPARK_ENV). Exit status:
# 0 ready (or, with --wait, all ranks succeeded), 1 anything else.
# shellcheck disable=SC2016,SC2317  # remote scripts in single quotes; trap handlers
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cl_prog=launch-cluster
# shellcheck source=ops/cluster-lib.sh
. "$here/cluster-lib.sh"

usage() { sed -n '2,37p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

env_file=${GLMSPARK_ENV:-/etc/glmspark/env}
env_explicit=0
recipe_arg=""
check_only=0
wait_all=0
extra=()
while [ $# -gt 0 ]; do
    case $1 in
    --env) [ $# -ge 2 ] || usage; env_file=$2; env_explicit=1; shift 2 ;;
    --recipe) [ $# -ge 2 ] || usage; recipe_arg=$2; shift 2 ;;
    --check-only) check_only=1; shift ;;
    --wait) wait_all=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) usage ;;
    *) echo "launch-cluster: unknown argument \"$1\"" >&2; usage ;;
    esac
done
cl_load_env "$env_file" "$env_explicit"
nodes=("${cl_nodes[@]}")
world=${#nodes[@]}
run=$cl_run
bin=${GLMSPARK_BIN:-/usr/local/bin}
local_bin=${GLMSPARK_LOCAL_BIN:-$bin}
recipe=${recipe_arg:-${GLMSPARK_RECIPE:-}}
launcher=${GLMSPARK_LAUNCHER:-ssh}
ready_re=${GLMSPARK_READY_RE:-engine: serving|(engine|pipeline) rank [0-9]+ of [0-9]+: layers}
poll_s=${GLMSPARK_POLL_S:-2}
case $launcher in ssh | mpirun | srun) ;; *) cl_die "GLMSPARK_LAUNCHER must be ssh, mpirun or srun" ;; esac

# The recipe, validated by the engine's own parser (errors name the key and the line).
declare -A rc=([pipeline_parallel]=$world [master_port]=29500 [load_timeout_s]=3600
               [min_free_memory_gb]=0 [model]="")
if [ -n "$recipe" ]; then
    [ -f "$recipe" ] || cl_die "no recipe \"$recipe\""
    out=$("$local_bin/glmspark-engine" --check-recipe "$recipe" 2>&1) \
        || cl_die "the recipe is invalid: $out"
    while IFS= read -r line; do
        k=${line%% = *}
        v=${line#* = }
        v=${v#\"}
        rc[$k]=${v%\"}
    done <<<"$out"
fi
[ "${rc[pipeline_parallel]}" = "$world" ] \
    || cl_die "the recipe wants pipeline_parallel = ${rc[pipeline_parallel]} but GLMSPARK_NODES lists $world node(s)"
model=${GLMSPARK_MODEL:-${rc[model]}}
[ -n "$model" ] || cl_die "no model: set GLMSPARK_MODEL or the recipe's model"
port=${GLMSPARK_MASTER_PORT:-${rc[master_port]}}
master=${GLMSPARK_MASTER_ADDR:-${nodes[0]}}:$port
load_timeout=${GLMSPARK_LOAD_TIMEOUT_S:-${rc[load_timeout_s]}}
min_mem_gb=${GLMSPARK_MIN_MEM_GB:-0}
awk "BEGIN { exit !(${rc[min_free_memory_gb]} > $min_mem_gb) }" && min_mem_gb=${rc[min_free_memory_gb]}
min_disk_gb=${GLMSPARK_MIN_DISK_GB:-1}

if [ -n "${GLMSPARK_RANK_CMD:-}" ]; then
    rank_cmd=$GLMSPARK_RANK_CMD
else
    rank_cmd=$(printf '%q --model %q' "$bin/glmspark-engine" "$model")
    [ -n "$recipe" ] && rank_cmd+=$(printf ' --recipe %q' "$recipe")
fi
# Readiness: `glmspark status` against rank 0's database, or the ranks' logs.
ready_mode=${GLMSPARK_READY:-}
if [ -z "$ready_mode" ]; then
    ready_mode=log
    [ -z "${GLMSPARK_RANK_CMD:-}" ] && [ -n "${GLMSPARK_DB:-}" ] && ready_mode=status
fi
case $ready_mode in
status)
    [ -n "${GLMSPARK_DB:-}" ] || cl_die "GLMSPARK_READY=status needs GLMSPARK_DB"
    [ -x "$local_bin/glmspark" ] || cl_die "GLMSPARK_READY=status needs $local_bin/glmspark (GLMSPARK_LOCAL_BIN)"
    ;;
log) ;;
*) cl_die "GLMSPARK_READY must be status or log" ;;
esac
# The conninfo reaches `glmspark status` through the environment, not argv (ps).
[ -n "${GLMSPARK_DB:-}" ] && export GLMSPARK_DB
status_cmd=("$local_bin/glmspark" status)
[ ${#extra[@]} -gt 0 ] && rank_cmd+=$(printf ' %q' "${extra[@]}")
read -r rank_bin _ <<<"$rank_cmd"
rank_bin=$(eval "printf '%s' $rank_bin")

# ---------------------------------------------------------------------------
# 1. Node checks, all nodes at once.

probe_script='
set -u
echo "host=$(hostname)"
if [ -x "$rank_bin" ]; then echo bin=ok; else echo bin=missing; fi
echo "mem_kb=$(awk "/^MemAvailable:/ {print \$2}" /proc/meminfo)"
mkdir -p "$run" 2>/dev/null && echo "disk_kb=$(df -Pk "$run" | awk "NR == 2 {print \$4}")"
if [ -d "$model" ]; then
    m=$(cd "$model" && {
        find . -type f -printf "%P %s\n" | LC_ALL=C sort
        if [ "$full" = 1 ]; then find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum
        else find . -maxdepth 1 -type f -name "*.json" -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum; fi
    } | sha256sum | cut -c1-16)
    echo "model=$m files=$(find "$model" -type f | wc -l)"
else
    echo model=missing
fi
starttime() { sed "s/^.*) //" "/proc/$1/stat" 2>/dev/null | cut -d" " -f20; }
for f in "$run"/rank*.pid "$run"/launcher.pid; do
    [ -f "$f" ] || continue
    read -r pid start _ <"$f" || true
    [ -n "$pid" ] && [ "$(starttime "$pid")" = "$start" ] && echo "running=$pid"
done
exit 0
'
tmp=$(mktemp -d)
cleanup_tmp() { rm -rf "$tmp"; }
trap cleanup_tmp EXIT

cl_say "checking ${world} node(s): ${nodes[*]}"
pids=()
for i in "${!nodes[@]}"; do
    cl_remote "${nodes[$i]}" "$(cl_vars run="$run" rank_bin="$rank_bin" model="$model" \
        full="$([ "${GLMSPARK_CHECK_HASH:-}" = full ] && echo 1 || echo 0)")$probe_script" \
        >"$tmp/probe$i" 2>"$tmp/probe$i.err" &
    pids+=($!)
done
failures=()
head_model=""
for i in "${!nodes[@]}"; do
    h=${nodes[$i]}
    if ! wait "${pids[$i]}" || ! grep -q '^host=' "$tmp/probe$i"; then
        failures+=("$h: unreachable through \"$cl_rsh\": $(tr '\n' ' ' <"$tmp/probe$i.err" | cut -c1-200)")
        continue
    fi
    declare -A p=()
    while IFS='=' read -r k v; do p[$k]=$v; done <"$tmp/probe$i"
    [ "${p[bin]:-}" = ok ] || failures+=("$h: no executable $rank_bin")
    mem_gb=$(( ${p[mem_kb]:-0} / 1048576 ))
    awk "BEGIN { exit !($mem_gb < $min_mem_gb) }" \
        && failures+=("$h: ${mem_gb} GiB of memory available, the recipe needs $min_mem_gb (ops/pagecache-dropper.sh, a reboot, or another process?)")
    disk_gb=$(( ${p[disk_kb]:-0} / 1048576 ))
    [ "$disk_gb" -ge "$min_disk_gb" ] || failures+=("$h: ${disk_gb} GiB free in $run, need $min_disk_gb")
    if [ "${p[model]:-missing}" = missing ]; then
        failures+=("$h: no model directory $model")
    else
        m=${p[model]%% *}
        if [ "$i" = 0 ]; then head_model=$m
        elif [ "$m" != "$head_model" ]; then
            failures+=("$h: the model files in $model differ from ${nodes[0]}'s (file sizes or *.json; manifest $m vs $head_model)")
        fi
    fi
    [ -z "${p[running]:-}" ] || failures+=("$h: a glmspark rank is already running (pid ${p[running]}): ops/cleanup.sh first")
    cl_say "  rank $i on $h (${p[host]}): ${mem_gb} GiB available, ${disk_gb} GiB free, model ${p[model]:-missing}"
    unset p
done
# Rank 0's database, and the engine boot already there (readiness wants a newer one).
boot_of() { sed -n 's/^boot \([0-9][0-9]*\) .*/\1/p'; }
boot_before=""
if [ "$ready_mode" = status ]; then
    code=0
    out=$("${status_cmd[@]}" 2>&1) || code=$?
    if [ "$code" = 2 ]; then
        failures+=("${nodes[0]}: rank 0's database (GLMSPARK_DB) does not answer: $(tr '\n' ' ' <<<"$out" | cut -c1-300)")
    else
        boot_before=$(boot_of <<<"$out")
    fi
fi
if [ ${#failures[@]} -gt 0 ]; then
    for f in "${failures[@]}"; do cl_say "FAILED $f"; done
    exit 1
fi
[ "$check_only" = 1 ] && { cl_say "every node passed"; exit 0; }

# ---------------------------------------------------------------------------
# 2. Start.

cluster_id=$(date +%s)-$$-$RANDOM
pass_vars=()
for v in ${GLMSPARK_PASS_ENV:-}; do
    [ -n "${!v+x}" ] && pass_vars+=("$v=${!v}")
done
# The per-rank start script: with ssh it forks the rank into its own session and returns;
# under mpirun/srun it execs in the foreground (the launcher owns the process).
rank_script='
set -u
if [ -z "${rank:-}" ]; then rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-}}}; fi
[ -n "$rank" ] || { echo "no rank: not started by mpirun or srun?" >&2; exit 12; }
mkdir -p "$run" || exit 10
log=$run/rank$rank.log
rm -f "$run/rank$rank.exit"
: >"$log"
touch "$run/loading"
echo "$cluster_id" >"$run/rank$rank.cluster"
export GLMSPARK_CLUSTER_ID=$cluster_id GLMSPARK_RANK=$rank
if [ "$rank" = 0 ] && [ -n "$db" ]; then export GLMSPARK_DB=$db; else unset GLMSPARK_DB; fi
wrapper='"'"'
starttime() { sed "s/^.*) //" "/proc/$1/stat" | cut -d" " -f20; }
echo "$$ $(starttime $$) $KIND" >"$RUN/rank$RANK.pid"
eval "$CMD"
code=$?
echo "$code" >"$RUN/rank$RANK.exit"
echo "rank $RANK exited with status $code" >&2
exit $code
'"'"'
if [ "$mode" = ssh ]; then
    flags=""
    [ "$world" -gt 1 ] && flags=" --rank $rank --world $world --master $master"
    RUN=$run RANK=$rank KIND=group CMD="$cmd$flags" setsid bash -c "$wrapper" </dev/null >>"$log" 2>&1 &
    for _ in $(seq 50); do [ -f "$run/rank$rank.pid" ] && break; sleep 0.1; done
    [ -f "$run/rank$rank.pid" ] || { echo "rank $rank did not start" >&2; exit 13; }
else
    export GLMSPARK_MASTER=$master
    RUN=$run RANK=$rank KIND=single CMD="exec $cmd" exec bash -c "$wrapper" </dev/null >>"$log" 2>&1
fi
'
start_vars() {  # start_vars RANK: the script's variables and the exported environment
    cl_vars run="$run" cluster_id="$cluster_id" cmd="$rank_cmd" world="$world" \
        master="$master" mode="$launcher" rank="$1" db="${GLMSPARK_DB:-}"
    local kv
    for kv in "${pass_vars[@]}"; do printf 'export %s=%q\n' "${kv%%=*}" "${kv#*=}"; done
}

cl_say "cluster $cluster_id: starting $world rank(s) with $launcher; rank command: $rank_cmd"
if [ "$launcher" = ssh ]; then
    for i in "${!nodes[@]}"; do
        if ! out=$(cl_remote "${nodes[$i]}" "$(start_vars "$i")$rank_script" 2>&1); then
            cl_say "FAILED rank $i on ${nodes[$i]} did not start: $out"
            cl_stop_all "${nodes[@]}" || true
            exit 1
        fi
    done
else
    mkdir -p "$run"
    script="$(start_vars "")$rank_script"
    hosts=$(IFS=,; echo "${nodes[*]}")
    read -r -a more <<<"${GLMSPARK_LAUNCHER_ARGS:-}"
    if [ "$launcher" = mpirun ]; then
        lcmd=(mpirun -np "$world" --host "$hosts" --map-by node)
        [ "$(id -u)" = 0 ] && lcmd+=(--allow-run-as-root)
    else
        lcmd=(srun --nodes="$world" --ntasks="$world" --ntasks-per-node=1 --nodelist="$hosts")
    fi
    lcmd+=("${more[@]}" bash -c "$script")
    echo "$cluster_id" >"$run/launcher.cluster"
    GLMSPARK_CLUSTER_ID=$cluster_id setsid "${lcmd[@]}" </dev/null >>"$run/launcher.log" 2>&1 &
    lpid=$!
    echo "$lpid $(sed 's/^.*) //' "/proc/$lpid/stat" | cut -d' ' -f20) group" >"$run/launcher.pid"
fi

# ---------------------------------------------------------------------------
# 3. Readiness, then (--wait) completion.

status_script='
set -u
r=$rank
starttime() { sed "s/^.*) //" "/proc/$1/stat" 2>/dev/null | cut -d" " -f20; }
log=$run/rank$r.log
# Files of an earlier cluster (mpirun/srun ranks start a moment later) do not count.
if [ "$(cat "$run/rank$r.cluster" 2>/dev/null)" != "$cluster_id" ]; then
    echo "starting 0"
    exit 0
fi
last=$(grep -v "^$" "$log" 2>/dev/null | tail -1 | cut -c1-160)
if [ -f "$run/rank$r.exit" ]; then state="exited:$(cat "$run/rank$r.exit")"
elif [ -f "$run/rank$r.pid" ]; then
    read -r pid start _ <"$run/rank$r.pid"
    if [ "$(starttime "$pid")" = "$start" ]; then state=running; else state=dead; fi
else state=starting
fi
ready=0
grep -Eq "$ready_re" "$log" 2>/dev/null && ready=1
[ "$ready" = 1 ] && [ "$final" = 1 ] && rm -f "$run/loading"
echo "$state $ready $last"
'
rank_status() {  # rank_status I FINAL -> "state ready lastline"
    cl_remote "${nodes[$1]}" "$(cl_vars run="$run" rank="$1" ready_re="$ready_re" final="$2" cluster_id="$cluster_id")$status_script" 2>/dev/null \
        || echo "unreachable 0 (${nodes[$1]} did not answer)"
}
tail_log() {  # tail_log I: the rank's last log lines, indented
    cl_remote "${nodes[$1]}" "tail -n ${GLMSPARK_TAIL_LINES:-8} $(printf '%q' "$run/rank$1.log")" 2>&1 \
        | sed 's/^/      /' >&2 || true
}
fail_cluster() {  # fail_cluster MESSAGE...
    cl_say "FAILED: $*"
    cl_say "stopping every rank"
    cl_stop_all "${nodes[@]}" || true
    exit 1
}
on_signal() { trap - INT TERM; fail_cluster "interrupted"; }
trap on_signal INT TERM

# GLMSPARK_READY=status: true when `glmspark status` exits 0 for a boot newer than the one
# there before the launch; else prints its verdict and rank lines that changed.
declare -A status_seen=()
status_final=""
poll_status() {
    local out code=0 boot line key
    out=$("${status_cmd[@]}" 2>&1) || code=$?
    boot=$(boot_of <<<"$out")
    if [ "$code" = 2 ] || { [ -n "$boot" ] && [ "$boot" != "$boot_before" ]; }; then
        [ "$code" = 0 ] && { status_final=$out; return 0; }
        while IFS= read -r line; do
            key=${line%% *}
            [ "$code" = 2 ] && key=error
            [ "${status_seen[$key]:-}" = "$line" ] && continue
            status_seen[$key]=$line
            cl_say "status ($(($(date +%s) - t0)) s): $line"
        done < <(grep -E '^(engine:|[0-9]+ |glmspark:)' <<<"$out")
    fi
    return 1
}

t0=$(date +%s)
# A node that does not answer a poll (ssh timing out under memory pressure while it loads)
# is not a dead rank: only GLMSPARK_MAX_MISSED (10) silent polls in a row fail the launch.
max_missed=${GLMSPARK_MAX_MISSED:-10}
declare -a ready_at last_line missed
for i in "${!nodes[@]}"; do ready_at[i]=""; last_line[i]=""; missed[i]=0; done
while :; do
    n_ready=0
    for i in "${!nodes[@]}"; do
        [ -n "${ready_at[i]}" ] && { n_ready=$((n_ready + 1)); continue; }
        read -r state ready last <<<"$(rank_status "$i" 1)"
        if [ "$ready_mode" = log ] && { [ "$ready" = 1 ] || [ "$state" = exited:0 ]; }; then
            ready_at[i]=$(($(date +%s) - t0))
            n_ready=$((n_ready + 1))
            cl_say "rank $i on ${nodes[$i]}: ready after ${ready_at[i]} s"
            continue
        fi
        if [ "$state" = unreachable ]; then
            missed[i]=$((missed[i] + 1))
            cl_say "rank $i on ${nodes[$i]}: no answer (${missed[i]} of $max_missed)"
            [ "${missed[i]}" -lt "$max_missed" ] && continue
        else
            missed[i]=0
        fi
        case $state in
        exited:* | dead | unreachable)
            cl_say "rank $i on ${nodes[$i]} failed while loading: ${state/exited:/exit status }; its log ends:"
            tail_log "$i"
            fail_cluster "rank $i on ${nodes[$i]}: ${state/exited:/exit status }"
            ;;
        esac
        if [ "$last" != "${last_line[$i]}" ]; then
            last_line[i]=$last
            cl_say "rank $i on ${nodes[$i]} ($(($(date +%s) - t0)) s): ${last:-(no output yet)}"
        fi
    done
    if [ "$ready_mode" = status ]; then
        poll_status && break
    else
        [ "$n_ready" = "$world" ] && break
    fi
    if [ $(($(date +%s) - t0)) -ge "$load_timeout" ]; then
        for i in "${!nodes[@]}"; do
            [ -z "${ready_at[i]}" ] && { cl_say "rank $i on ${nodes[$i]} not ready; its log ends:"; tail_log "$i"; }
        done
        fail_cluster "not ready after $load_timeout s (the recipe's load_timeout_s)"
    fi
    sleep "$poll_s"
done
if [ "$ready_mode" = status ]; then
    printf '%s\n' "$status_final" | sed 's/^/    /' >&2
    for i in "${!nodes[@]}"; do  # loaded: the page-cache dropper can rest
        cl_remote "${nodes[$i]}" "rm -f $(printf '%q' "$run/loading")" >/dev/null 2>&1 || true
    done
fi
cl_say "cluster $cluster_id ready: $world rank(s) in $(($(date +%s) - t0)) s; rank 0 on ${nodes[0]}, master $master"
[ "$wait_all" = 1 ] || exit 0

if [ "$launcher" != ssh ]; then  # mpirun/srun collects the ranks' statuses
    code=0
    wait "$lpid" || code=$?
    if [ "$code" != 0 ]; then
        for i in "${!nodes[@]}"; do cl_say "rank $i on ${nodes[$i]}: its log ends:"; tail_log "$i"; done
        tail -n 5 "$run/launcher.log" | sed 's/^/      /' >&2
        fail_cluster "$launcher exited with status $code"
    fi
    cl_say "$launcher exited with status 0"
    cl_stop_all "${nodes[@]}" >/dev/null 2>&1 || true
    exit 0
fi
worst=0
for i in "${!nodes[@]}"; do
    while :; do
        read -r state _ _ <<<"$(rank_status "$i" 0)"
        case $state in
        exited:*) code=${state#exited:}; break ;;
        dead) code=255; break ;;
        unreachable)
            missed[i]=$((missed[i] + 1))
            [ "${missed[i]}" -ge "$max_missed" ] && { code=255; break; } ;;
        *) missed[i]=0 ;;
        esac
        sleep "$poll_s"
    done
    if [ "$code" != 0 ]; then
        cl_say "rank $i on ${nodes[$i]} exited with status $code; its log ends:"
        tail_log "$i"
        worst=1
    else
        cl_say "rank $i on ${nodes[$i]} exited with status 0"
    fi
    [ "$worst" = 1 ] && fail_cluster "rank $i on ${nodes[$i]} exited with status $code"
done
cl_stop_all "${nodes[@]}" >/dev/null 2>&1 || true  # pid files and markers
exit 0
