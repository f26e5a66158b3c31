#!/bin/sh
# check_headers.sh SRCDIR CC CXX - every header compiles on its own, as C11 and as C++
# (self-contained headers, usable from C++). Kernel headers are checked only where CUDA
# headers exist.
set -eu
src=$1 cc=$2 cxx=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
inc="-I$src $(pkg-config --cflags json-c libpcre2-8 libutf8proc libpq libcrypto 2>/dev/null || true)"
[ -d /usr/local/cuda/include ] && inc="$inc -isystem /usr/local/cuda/include"
pass=0 fail=0
for h in $(cd "$src" && find engine fcgi kernels -name '*.h' 2>/dev/null | sort); do
    case $h in
    kernels/* | engine/shared/cuda_check.h) [ -d /usr/local/cuda/include ] || continue ;;
    esac
    printf '#include "%s"\n#include "%s"\n' "$h" "$h" >"$tmp/t.c"
    cp "$tmp/t.c" "$tmp/t.cpp"
    if $cc -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Wpedantic -Wstrict-prototypes \
            -Wundef -Werror $inc -fsyntax-only "$tmp/t.c" 2>"$tmp/err" \
        && $cxx -std=c++17 -D_POSIX_C_SOURCE=200809L -Wall -Werror $inc -fsyntax-only \
            "$tmp/t.cpp" 2>>"$tmp/err"; then
        pass=$((pass + 1))
    else
        echo "header $h does not compile on its own:"
        cat "$tmp/err"
        fail=$((fail + 1))
    fi
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
