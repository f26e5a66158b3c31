# stack.sh - sourced by the run.sh of tests/integration, tests/web and tests/reliability: a
# throwaway serving stack through ops/devstack, with its own var/ directory in /tmp, free
# loopback ports and the binaries of the build under test.
#
# The caller sets src (the source tree) and bin (the build's bin/ folder) and may set
# GLMSPARK_ENGINE_ARGS and the other GLMSPARK_* devstack settings before stack_up. One
# sequence at a time unless GLMSPARK_MAX_NUM_SEQS says otherwise: the scenarios of these
# suites count on a second job waiting in the queue (continuous batching is tested by
# tests/integration/test_engine_serve.sh).
# shellcheck shell=bash disable=SC2034,SC2154  # src and bin from, url and admin for the caller

# A loopback TCP port that was free a moment ago.
free_port() { node -e "const s=require('net').createServer().listen(0,'127.0.0.1',()=>{console.log(s.address().port);s.close()})"; }

# stack_env NAME: var (a fresh /tmp/glmspark-NAME.XXXXXX), devstack and db, and the devstack
# settings exported.
stack_env() {
    var=$(mktemp -d "/tmp/glmspark-$1.XXXXXX")
    chmod 755 "$var"
    GLMSPARK_BUILD=$(dirname "$bin")
    GLMSPARK_HTTPS_PORT=$(free_port)
    GLMSPARK_HTTP_PORT=$(free_port)
    export GLMSPARK_VAR=$var GLMSPARK_BUILD GLMSPARK_SKIP_DEPS=1 GLMSPARK_SKIP_BUILD=1
    export GLMSPARK_HTTPS_PORT GLMSPARK_HTTP_PORT
    export GLMSPARK_MAX_NUM_SEQS=${GLMSPARK_MAX_NUM_SEQS:-1}
    devstack=$src/ops/devstack
    db="host=$var/pg/run dbname=glmspark user=postgres"
}

# stack_down RC LINES: after a failure (RC not 0) the last LINES of each component's log on
# stderr; then the stack stopped and its state deleted.
stack_down() {
    if [ "$1" -ne 0 ]; then
        for c in engine fcgi nginx; do echo "== $c log" >&2; "$devstack" logs $c 2>/dev/null | tail -"$2" >&2 || true; done
    fi
    "$devstack" down >/dev/null 2>&1 || true
    rm -rf "$var"
}

# stack_up: starts the stack; url and admin (its admin API key) from devstack's output.
stack_up() {
    local out
    out=$("$devstack" up)
    url=$(echo "$out" | sed -n 's/^URL=//p')
    admin=$(echo "$out" | sed -n 's/^API_KEY=//p')
}

# key ARGS...: a new API key (`glmspark keys create ARGS`) on stdout.
key() { "$bin/glmspark" keys create --db "$db" "$@" 2>/dev/null; }
