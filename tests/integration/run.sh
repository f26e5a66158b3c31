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

free_port() { node -e "const s=require('net').createServer().listen(0,'127.0.0.1',()=>{console.log(s.address().port);s.close()})"; }
var=$(mktemp -d /tmp/glmspark-it.XXXXXX)
chmod 755 "$var"
export GLMSPARK_VAR=$var GLMSPARK_BUILD=$(dirname "$bin") GLMSPARK_SKIP_DEPS=1 GLMSPARK_SKIP_BUILD=1
export GLMSPARK_HTTPS_PORT=$(free_port) GLMSPARK_HTTP_PORT=$(free_port)
# One sequence at a time: the scenarios here count on a second job waiting in the queue
# (continuous batching is tested by tests/integration/test_engine_serve.sh).
export GLMSPARK_MAX_NUM_SEQS=${GLMSPARK_MAX_NUM_SEQS:-1}
export GLMSPARK_ENGINE_ARGS="--step-delay-ms ${GLMSPARK_STEP_DELAY_MS:-25}"
# A small queue, so that the queue-full test can fill it (no other test queues this many).
export GLMSPARK_MAX_QUEUE=${GLMSPARK_MAX_QUEUE:-6}
devstack=$src/ops/devstack
cleanup() {
    local rc=${1:-$?}
    rm -f "$src/tests/.test_api.run.mjs"
    if [ $rc -ne 0 ]; then
        for c in engine fcgi nginx; do echo "== $c log" >&2; "$devstack" logs $c 2>/dev/null | tail -30 >&2 || true; done
    fi
    "$devstack" down >/dev/null 2>&1 || true
    rm -rf "$var"
    exit $rc
}
trap cleanup EXIT

out=$("$devstack" up)
url=$(echo "$out" | sed -n 's/^URL=//p')
admin=$(echo "$out" | sed -n 's/^API_KEY=//p')
db="host=$var/pg/run dbname=glmspark user=postgres"
key() { "$bin/glmspark" keys create --db "$db" "$@" 2>/dev/null; }
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
