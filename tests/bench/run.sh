#!/bin/bash
# run.sh BUILD_BIN_DIR - the serving benchmark on this machine (not a test: it
# prints numbers for docs/perf.md). Starts a private stack (ops/devstack) with the engine
# stopped, then measures through nginx over HTTPS:
#   1. wrk, authenticated GET /v1/models        (12 connections, 2 threads, 10 s)
#   2. wrk, POST /v1/jobs job submissions       (12 connections, 2 threads, 10 s)
#   3. chunk commit-to-client latency, 50 concurrent SSE streams, 40 chunks each 50 ms apart,
#      one commit per chunk (the one-sequence engine)
#   4. the same with one commit per round for all 50 streams' chunks every 30 ms
#      (jobq_append_batch: the continuous-batching engine's decode step), then every 100 ms
#      (a slower step: the fan-out's cost without queueing behind the previous step)
# Each measurement line is preceded by the 1-minute load average at its start.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(cd "${1:-$src/build/bin}" && pwd)
var=$(mktemp -d /tmp/glmspark-bench.XXXXXX)
chmod 755 "$var"
export GLMSPARK_VAR=$var GLMSPARK_BUILD=$(dirname "$bin") GLMSPARK_SKIP_DEPS=1 GLMSPARK_SKIP_BUILD=1
export GLMSPARK_HTTPS_PORT=${GLMSPARK_HTTPS_PORT:-18443} GLMSPARK_HTTP_PORT=${GLMSPARK_HTTP_PORT:-18080}
export GLMSPARK_FCGI_ARGS="--max-queue 0" GLMSPARK_FCGI_THREADS=${GLMSPARK_FCGI_THREADS:-64}
export GLMSPARK_IP_RATE=100000 GLMSPARK_IP_BURST=100000
trap '"$src/ops/devstack" down >/dev/null 2>&1 || true; rm -rf "$var"' EXIT
out=$("$src/ops/devstack" up)
url=$(echo "$out" | sed -n 's/^URL=//p')
key=$(echo "$out" | sed -n 's/^API_KEY=//p')
"$src/ops/devstack" stop engine  # the writer below plays the engine
sleep 1
echo "machine: $(nproc) cores, $(uname -m), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "load average (1 min): $(cut -d' ' -f1 /proc/loadavg)"

lua=$var/post.lua
cat >"$lua" <<LUA
wrk.method = "POST"
wrk.headers["Authorization"] = "Bearer $key"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"glmspark-demo","messages":[{"role":"user","content":"Hello"}],"max_tokens":4}'
LUA
echo "== GET /v1/models"
wrk -t2 -c12 -d10s --latency -H "Authorization: Bearer $key" "$url/v1/models" | grep -E 'Requests/sec|Non-2xx|99%|50%|requests in|Socket errors'
echo "== POST /v1/jobs"
wrk -t2 -c12 -d10s --latency -s "$lua" "$url/v1/jobs" | grep -E 'Requests/sec|Non-2xx|99%|50%|requests in|Socket errors'
"$src/ops/devstack" psql -qAtc "SELECT 'queued jobs after the run: ' || count(*) FROM admin.queue"
# Clear the queue so the latency run's writer claims only its own jobs.
psql -h "$var/pg/run" -U postgres -d glmspark -qAtc \
    "UPDATE jobs SET state = 'cancelled', finished_at = now() WHERE state = 'queued'" >/dev/null

load() { echo "load average (1 min): $(cut -d' ' -f1 /proc/loadavg)"; }
export GLMSPARK_DB="host=$var/pg/run dbname=glmspark user=glmspark_app"
echo "== chunk latency, 50 streams, one commit per chunk"
load
NODE_EXTRA_CA_CERTS=$var/tls/cert.pem node "$src/tests/bench/bench_streams.mjs" "$url" "$key" \
    glmspark-demo 50 "$bin/bench_chunk_writer" 50 40 50
for step_ms in 30 100; do
    echo "== chunk latency, 50 streams, one batched commit per $step_ms ms step"
    load
    NODE_EXTRA_CA_CERTS=$var/tls/cert.pem node "$src/tests/bench/bench_streams.mjs" "$url" "$key" \
        glmspark-demo 50 "$bin/bench_chunk_writer" 50 40 "$step_ms" --batch
done
