#!/bin/bash
# run_claims.sh BIN_DIR [ENGINES...] - the queue under many engines (tests/bench/bench_claims.c)
# on a private PostgreSQL (tests/db/with_pg.sh: a throwaway cluster on loopback), for each
# engine count (default 1 4 16): claims/s, single-chunk commits/s, batched commits/s.
# JOBS (2000) and STEPS (200) set the work per run. Not a test; figures go to docs/perf.md.
set -euo pipefail
bin=$(cd "$1" && pwd)
shift
src=$(cd "$(dirname "$0")/../.." && pwd)
counts=${*:-1 4 16}
exec "$src/tests/db/with_pg.sh" bash -c '
    set -euo pipefail
    "$0/glmspark" db migrate --db "$GLMSPARK_DB" --sql "$1/sql" >/dev/null
    nproc_=$(nproc)
    echo "PostgreSQL $(psql "$GLMSPARK_DB" -qAtX -c "SHOW server_version"), $nproc_ cores, load $(cut -d" " -f1 /proc/loadavg)"
    for e in $2; do "$0/bench_claims" "$e" "${JOBS:-2000}" "${STEPS:-200}"; done
' "$bin" "$src" "$counts"
