#!/bin/bash
# run.sh - start a throwaway serving stack and run the end-to-end tests against it.
#
# Uses ops/devstack with its own var/ directory in /tmp and free loopback ports, the
# binaries of the build under test ($GLMSPARK_BIN_DIR), and a slowed-down engine
# (--step-delay-ms) so that tests can cancel and kill it mid-generation. Always stops the
# stack and deletes its state.
set -euo pipefail
src=${GLMSPARK_SOURCE_DIR:?}
bin=${GLMSPARK_BIN_DIR:?}
command -v node >/dev/null || { echo "run.sh: node is required" >&2; exit 1; }
[ -d "$src/tests/node_modules/openai" ] || (cd "$src/tests" && npm install --no-audit --no-fund >&2)

# shellcheck source=tests/integration/stack.sh
. "$src/tests/integration/stack.sh"
stack_env it
export GLMSPARK_ENGINE_ARGS="--step-delay-ms ${GLMSPARK_STEP_DELAY_MS:-25}"
# A small queue, so that the queue-full test can fill it (no other test queues this many).
export GLMSPARK_MAX_QUEUE=${GLMSPARK_MAX_QUEUE:-6}
cleanup() {
    local rc=${1:-$?}
    rm -f "$src/tests/.test_api.run.mjs"
    stack_down "$rc" 30
    exit "$rc"
}
trap cleanup EXIT

stack_up
user=$(key --name it-user)
other=$(key --name it-other)
revoked=$(key --name it-revoked)
conc1=$(key --name it-conc1 --max-concurrent 1)
rpm2=$(key --name it-rpm2 --rpm 2)
"$bin/glmspark" keys revoke it-revoked --db "$db" >/dev/null

export GLMSPARK_URL=$url GLMSPARK_ADMIN_KEY=$admin GLMSPARK_USER_KEY=$user GLMSPARK_OTHER_KEY=$other
export GLMSPARK_DB_SUPER=$db GLMSPARK_REVOKED_KEY=$revoked GLMSPARK_CONC1_KEY=$conc1 GLMSPARK_RPM2_KEY=$rpm2
export GLMSPARK_MODEL=glmspark-demo GLMSPARK_DEVSTACK=$devstack GLMSPARK_BIN=$bin
export GLMSPARK_DB_APP="host=$var/pg/run dbname=glmspark user=glmspark_app"
export NODE_EXTRA_CA_CERTS=$var/tls/cert.pem NODE_PATH=$src/tests/node_modules
# ESM resolves packages from the script's directory upwards: run from a copy inside tests/.
cp "$src/tests/integration/test_api.mjs" "$src/tests/.test_api.run.mjs"
"$src/tests/tools/node_test.sh" "$src/tests/.test_api.run.mjs"

# Keys never reach a log.
for k in "$admin" "$user" "$other" "$revoked" "$conc1" "$rpm2"; do
    secret=${k##*_}
    if grep -rq -- "$secret" "$var/log" "$var/pg/server.log"; then
        echo "run.sh: a key's secret part appears in a log" >&2
        exit 1
    fi
done
echo "key leak check: 0 hits in logs"
