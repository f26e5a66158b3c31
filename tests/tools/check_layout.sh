#!/bin/sh
# check_layout.sh SRCDIR - the layout's rules, read from the folders' own READMEs:
#   - engine/ holds folders only (its CMakeLists.txt and README.md aside), each with a
#     README.md;
#   - each source folder's README.md (engine/*/, fcgi/, kernels/, kernels/ref/) has a line
#     "May include: P1, P2, ..." (folders or files, as paths from the repository root), and
#     every `#include "..."` of a .c/.h/.cu/.cuh there names its own folder or one of them;
#   - every project include names an existing file from the repository root.
# Prints each offence and exits 1 on any.
set -eu
src=$1
cd "$src"
fail=0
pass=0
offend() { echo "$*"; fail=$((fail + 1)); }

for f in engine/*; do
    case $f in
    engine/CMakeLists.txt | engine/README.md) ;;
    *) [ -d "$f" ] || offend "$f: engine/ holds folders only; put it in the folder of its part" ;;
    esac
done

for dir in engine/*/ fcgi/ kernels/ kernels/ref/; do
    dir=${dir%/}
    readme=$dir/README.md
    if [ ! -f "$readme" ]; then
        offend "$dir: no README.md saying what the folder owns and what it may include"
        continue
    fi
    allowed=$(sed -n 's/^May include: *//p' "$readme" | head -1 | sed 's/(.*//' | tr -d '`' | tr ',' ' ')
    if ! grep -q '^May include:' "$readme"; then
        offend "$readme: no \"May include:\" line"
        continue
    fi
    for file in "$dir"/*.c "$dir"/*.h "$dir"/*.cu "$dir"/*.cuh; do
        [ -f "$file" ] || continue
        for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$file"); do
            if [ ! -f "$inc" ]; then
                offend "$file: #include \"$inc\" is not a path from the repository root"
                continue
            fi
            ok=0
            case $inc in "$dir"/*) case ${inc#"$dir"/} in */*) ;; *) ok=1 ;; esac ;; esac
            for a in $allowed; do
                a=${a%/}
                case $inc in "$a" | "$a"/*) ok=1 ;; esac
            done
            if [ "$ok" -eq 1 ]; then
                pass=$((pass + 1))
            else
                offend "$file: includes $inc, which $readme does not allow (May include: $allowed)"
            fi
        done
    done
done
echo "$pass includes follow the layout; $fail offences"
[ "$fail" -eq 0 ] && echo "1 passed, 0 failed" || echo "0 passed, 1 failed"
[ "$fail" -eq 0 ]
