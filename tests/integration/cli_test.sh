# cli_test.sh - sourced by the `glmspark` command tests here (test_pp_cli.sh,
# test_mtp_cli.sh), whose arguments are BIN_DIR SOURCE_DIR: bin (the glmspark binary), src,
# a temporary directory tmp (removed on exit) and fail MESSAGE (prints it, exits 1).
# shellcheck shell=sh disable=SC2034  # bin and src are for the sourcing script
set -eu
bin=$1/glmspark
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
