#!/bin/bash
# run.sh - run the browser tests of the web UI (tests/web/ui_test.mjs) in headless chromium.
#
#   tests/web/run.sh            against a throwaway real stack: ops/devstack with its own var/
#                               in /tmp, free loopback ports and the binaries of the build under
#                               test ($GLMSPARK_BIN_DIR); stopped and deleted afterwards
#   tests/web/run.sh --mock     against tests/web/mock_api.mjs (no build needed; also covers a
#                               full queue and a failed job, which the real stack cannot force)
#
# Screenshots land in tests/web/screenshots/{stack,mock}/ (git-ignored). Needs node, npm
# (playwright-core from tests/package.json) and Debian's chromium (ops/install-deps.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${GLMSPARK_SOURCE_DIR:-$(cd "$here/../.." && pwd)}
mode=${1:-stack}
command -v node >/dev/null || { echo "run.sh: node is required" >&2; exit 1; }
chromium=${GLMSPARK_CHROMIUM:-/usr/bin/chromium}
[ -x "$chromium" ] || { echo "run.sh: $chromium not found (apt-get install chromium)" >&2; exit 1; }
[ -d "$src/tests/node_modules/playwright-core" ] \
    || (cd "$src/tests" && npm install --no-audit --no-fund >&2)
mkdir -p "$here/screenshots"

if [ "$mode" = --mock ]; then
    unset GLMSPARK_WEB_URL
    exec "$here/../tools/node_test.sh" --test-concurrency=1 "$here/ui_test.mjs"
fi

bin=${GLMSPARK_BIN_DIR:?set GLMSPARK_BIN_DIR to the bin/ folder of a build (ctest does)}
# shellcheck source=tests/integration/stack.sh
. "$src/tests/integration/stack.sh"
stack_env web
# A steady pace, so that a test can reload or cut the connection while a job streams.
export GLMSPARK_ENGINE_ARGS="--step-delay-ms ${GLMSPARK_STEP_DELAY_MS:-25}"
# Two models, an engine each: the model picker lists both and a job of the second runs on it.
export GLMSPARK_MODELS="glmspark-demo glmspark-demo-b" GLMSPARK_ENGINES="glmspark-demo glmspark-demo-b"
cleanup() {
    local rc=$?
    stack_down "$rc" 30
    exit "$rc"
}
trap cleanup EXIT

stack_up
export GLMSPARK_WEB_URL=$url GLMSPARK_WEB_ADMIN_KEY=$admin
export GLMSPARK_WEB_KEY=$(key --name web-user)
export GLMSPARK_WEB_RPM_KEY=$(key --name web-rpm1 --rpm 1)
# Restarting fcgi cuts every open event stream: the "dropped connection" test.
export GLMSPARK_WEB_DROP_CMD="$devstack restart fcgi"
[ -n "$GLMSPARK_WEB_URL" ] && [ -n "$GLMSPARK_WEB_KEY" ] || { echo "run.sh: devstack gave no URL or key" >&2; exit 1; }
"$here/../tools/node_test.sh" --test-concurrency=1 "$here/ui_test.mjs"
