#!/bin/bash
# run_constrain.sh BIN_DIR - the cost of response_format on the CPU demo model: decode time
# per step with 8 concurrent requests, unconstrained, json_object and json_schema
# (tests/bench/constrain_step.mjs), on a private devstack. Not a test: prints numbers for
# docs/perf.md, and the engine's per-job mask figures (count, cache hits, mean time).
# ROUNDS (3) and MAX_TOKENS (160) pass through.
set -euo pipefail
# shellcheck disable=SC2034,SC2154  # bin is stack.sh's; url, admin, var, devstack come from it
bin=$(cd "${1:?usage: run_constrain.sh BIN_DIR}" && pwd)
src=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tests/integration/stack.sh
. "$src/tests/integration/stack.sh"
stack_env constrain
export GLMSPARK_MAX_NUM_SEQS=8  # the 8 requests decode together
trap 'stack_down $? 20' EXIT
stack_up
echo "machine: $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ), load $(cut -d' ' -f1 /proc/loadavg)"
export GLMSPARK_URL=$url GLMSPARK_KEY=$admin GLMSPARK_MODEL=glmspark-demo
export NODE_EXTRA_CA_CERTS=$var/tls/cert.pem
node "$src/tests/bench/constrain_step.mjs"
echo "engine mask figures (per job):"
"$devstack" logs engine | grep -o 'response_format: .*' | sort | uniq -c | sort -rn | head -5
