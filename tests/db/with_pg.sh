#!/bin/bash
# with_pg.sh CMD [ARGS...] - run CMD against a throwaway PostgreSQL cluster.
#
# initdb's a fresh cluster into a temporary directory, starts it listening only on a Unix
# socket in that directory (so no TCP port can clash with anything), creates database
# glmspark, exports GLMSPARK_DB (superuser conninfo) and GLMSPARK_PGHOST, runs CMD, and
# always stops and deletes the cluster. PostgreSQL refuses to run as root, so under root
# (CI) the server runs as the "postgres" user that Debian's package creates.
set -euo pipefail
pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -n "$pgbin" ] || { echo "with_pg: no PostgreSQL server in /usr/lib/postgresql" >&2; exit 1; }

dir=$(mktemp -d /tmp/glmspark-pg.XXXXXX)
as=()
if [ "$(id -u)" -eq 0 ]; then
    chown postgres: "$dir"
    chmod 755 "$dir"
    as=(runuser -u postgres --)
fi
cleanup() {
    "${as[@]}" "$pgbin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap cleanup EXIT

"${as[@]}" "$pgbin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-locale >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; exit 1; }
"${as[@]}" "$pgbin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses='' -c unix_socket_directories='$dir' -c fsync=off -c max_connections=200" \
    start >/dev/null || { cat "$dir/server.log" >&2; exit 1; }
"$pgbin/psql" -h "$dir" -U postgres -d postgres -qAtc "CREATE DATABASE glmspark" >/dev/null

export GLMSPARK_PGHOST=$dir
export GLMSPARK_DB="host=$dir user=postgres dbname=glmspark"
status=0
"$@" || status=$?
if [ $status -ne 0 ] && [ -n "${GLMSPARK_PG_LOG:-}" ]; then tail -50 "$dir/server.log" >&2; fi
exit $status
