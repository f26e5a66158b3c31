#!/bin/bash
# local-rsh.sh HOST COMMAND... - ssh's contract on this machine, for the launcher tests
# (test_engine_launch.sh, test_ops_scripts.sh): HOST "here" runs the command string under
# bash from a clean environment (PATH only), as an ssh login would; any other HOST fails
# like an unreachable one (255).
[ "$1" = here ] || { echo "ssh: connect to host $1: Connection refused" >&2; exit 255; }
shift
exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin bash -c "$*"
