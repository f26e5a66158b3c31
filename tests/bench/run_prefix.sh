#!/bin/bash
# run_prefix.sh BIN_DIR - time to first token with a ~4K-token shared prompt prefix, with the
# engine's prefix cache and without (tests/bench/prefix_ttft.mjs), on a private devstack
# (demo model, CPU). Not a test: prints numbers for docs/perf.md. PREFIX_TOKENS (4000) sets
# the prefix length.
set -euo pipefail
# shellcheck disable=SC2034,SC2154  # bin is stack.sh's; url, admin, var, devstack come from it
bin=$(cd "${1:?usage: run_prefix.sh BIN_DIR}" && pwd)
src=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tests/integration/stack.sh
. "$src/tests/integration/stack.sh"
stack_env prefix
export GLMSPARK_ENGINE_ARGS="--kv-blocks 96"
trap 'stack_down $? 20' EXIT
stack_up
echo "machine: $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ), load $(cut -d' ' -f1 /proc/loadavg)"
export GLMSPARK_URL=$url GLMSPARK_KEY=$admin GLMSPARK_MODEL=glmspark-demo
export NODE_EXTRA_CA_CERTS=$var/tls/cert.pem
MODE=on node "$src/tests/bench/prefix_ttft.mjs"
GLMSPARK_ENGINE_ARGS="--kv-blocks 96 --prefix-caching 0" "$devstack" restart engine
"$devstack" up >/dev/null  # waits until healthy
MODE=off node "$src/tests/bench/prefix_ttft.mjs"
