#!/bin/bash
# test_shellcheck.sh SOURCE_DIR - shellcheck on every shell script in ops/ and tests/ (files
# named *.sh, and executable files whose first line runs sh or bash; tests/node_modules
# excluded).
# Every script must be free of errors; the operations scripts (ops/, tests/ops/) also of
# warnings. Prints each finding; exits 1 on any.
set -euo pipefail
src=$(cd "$1" && pwd)
cd "$src"
command -v shellcheck >/dev/null || { echo "FAIL: shellcheck is not installed (ops/install-deps.sh)"; exit 1; }
scripts=()
while IFS= read -r -d '' f; do
    case $f in
    *.sh) scripts+=("$f") ;;
    *) head -n1 "$f" 2>/dev/null | grep -qE '^#!.*[/ ](ba|da)?sh( |$)' && scripts+=("$f") ;;
    esac
done < <(find ops tests -path tests/node_modules -prune -o -type f \( -name '*.sh' -o -perm -u+x \) \
    ! -name '*.c' ! -name '*.mjs' ! -name '*.py' -print0 | sort -z)
[ ${#scripts[@]} -gt 0 ] || { echo "FAIL: no scripts found under $src"; exit 1; }
ops=()
rest=()
for f in "${scripts[@]}"; do
    case $f in ops/* | tests/ops/*) ops+=("$f") ;; *) rest+=("$f") ;; esac
done
status=0
# One shellcheck per severity (each finding names its file and line).
if [ ${#ops[@]} -gt 0 ] && ! shellcheck -x -S warning -f gcc "${ops[@]}"; then
    echo "FAIL: findings in the operations scripts (severity warning)"
    status=1
fi
if [ ${#rest[@]} -gt 0 ] && ! shellcheck -x -S error -f gcc "${rest[@]}"; then
    echo "FAIL: findings in the other scripts (severity error)"
    status=1
fi
echo "shellcheck: ${#scripts[@]} scripts checked (ops/ and tests/ops/ at warning, the rest at error)"
[ "$status" = 0 ] && echo "1 passed, 0 failed" || echo "0 passed, 1 failed"
exit $status
