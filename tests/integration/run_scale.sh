#!/bin/bash
# run_scale.sh - scale-out end to end (test_scale.mjs): a throwaway stack through ops/devstack
# with three CPU engines (two of glmspark-demo, one of glmspark-demo-b, a second demo model
# with its own weights) and two glmspark-fcgi processes behind nginx, on one PostgreSQL.
# Engines are slowed (--step-delay-ms) so that each is bound by its steps, and their leases
# are 5 s so that a killed engine's jobs come back quickly. Always stops the stack and deletes
# its state. Prints the scaling and kill -9 figures (docs/perf.md, docs/reliability.md).
set -euo pipefail
src=${GLMSPARK_SOURCE_DIR:?}
bin=${GLMSPARK_BIN_DIR:?}
command -v node >/dev/null || { echo "run_scale.sh: node is required" >&2; exit 1; }
[ -d "$src/tests/node_modules/openai" ] || (cd "$src/tests" && npm install --no-audit --no-fund >&2)

# shellcheck source=tests/integration/stack.sh
. "$src/tests/integration/stack.sh"
export GLMSPARK_MAX_NUM_SEQS=8
stack_env scale
export GLMSPARK_MODELS="glmspark-demo glmspark-demo-b"
export GLMSPARK_ENGINES="glmspark-demo glmspark-demo glmspark-demo-b"
export GLMSPARK_FCGI_PROCS=2 GLMSPARK_MAX_QUEUE=1000
export GLMSPARK_ENGINE_ARGS="--step-delay-ms ${GLMSPARK_STEP_DELAY_MS:-200} --lease-s 5"
cleanup() {
    local rc=${1:-$?}
    rm -f "$src/tests/.test_scale.run.mjs"
    stack_down "$rc" 30
    exit "$rc"
}
trap cleanup EXIT

stack_up
user=$(key --name scale-user)
export GLMSPARK_URL=$url GLMSPARK_USER_KEY=$user GLMSPARK_DB_SUPER=$db
export GLMSPARK_DEVSTACK=$devstack GLMSPARK_VAR=$var
export NODE_EXTRA_CA_CERTS=$var/tls/cert.pem NODE_PATH=$src/tests/node_modules
# ESM resolves packages from the script's directory upwards: run from a copy inside tests/.
cp "$src/tests/integration/test_scale.mjs" "$src/tests/.test_scale.run.mjs"
"$src/tests/tools/node_test.sh" --test-concurrency=1 "$src/tests/.test_scale.run.mjs"
