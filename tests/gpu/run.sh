#!/bin/sh
# run.sh [--sanitize] - build the CUDA kernels and their GPU tests from source on the GPU
# machine, then run every test (label gpu), optionally under compute-sanitizer memcheck. (The
# performance of record is the product's: `glmspark bench --model`, tests/gpu/run_backend.sh.)
#
# It compiles with nvcc/cc directly rather than through CMake, because the GPU image lacks the
# engine's other build dependencies (json-c, pcre2, utf8proc) and the kernels need none of
# them; the flags match kernels/CMakeLists.txt. Only sm_90a is built here (the H200); the
# default CMake build covers sm_90a and sm_121a.
#
# Output: a summary table on stdout; logs under $OUT (or ./gpu-out) when set.
set -u
cd "$(dirname "$0")/../.."
src=$(pwd)
out=${OUT:-$src/gpu-out}
mkdir -p "$out"
bld=${GPU_BUILD_DIR:-/tmp/glmspark-gpu}
mkdir -p "$bld/obj"
sanitize=0
while [ $# -gt 0 ]; do
    case $1 in
    --sanitize) sanitize=1; shift ;;
    *) echo "unknown option $1"; exit 2 ;;
    esac
done
cuda=${CUDA_HOME:-/usr/local/cuda}
nvcc="$cuda/bin/nvcc"
arch=${GPU_ARCH:-"-gencode=arch=compute_90a,code=sm_90a"}
inc="-I$src"
cflags="-O2 -g -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra $inc -isystem $cuda/include"
nvflags="-O2 -lineinfo $arch $inc -Xcompiler=-Wall,-Wextra,-fno-exceptions"
libs="-L$cuda/lib64 -lcublasLt -lcublas -lcudart -lm -lstdc++ -lpthread -ldl -lrt"

echo "== build ($(nproc) cores)"
t0=$(date +%s)
fail=0
for f in kernels/*.cu; do echo "$f"; done | xargs -P "$(nproc)" -I{} sh -c \
    "$nvcc $nvflags -c {} -o $bld/obj/\$(basename {} .cu).o || exit 255" || fail=1
for f in kernels/ref/*.c engine/shared/err.c engine/shared/thread_pool.c; do
    cc $cflags -c "$f" -o "$bld/obj/$(basename "$f" .c).o" || fail=1
done
[ $fail -eq 0 ] || { echo "build failed"; exit 1; }
objs=$(ls $bld/obj/*.o)
for t in tests/gpu/test_*.c; do
    name=$(basename "$t" .c)
    cc $cflags "$t" $objs $libs -o "$bld/$name" || fail=1
done
[ $fail -eq 0 ] || { echo "build failed"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader

echo "== tests"
summary=""
status=0
for t in tests/gpu/test_*.c; do
    name=$(basename "$t" .c)
    t1=$(date +%s)
    if "$bld/$name" >"$out/$name.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
    line=$(printf '%-14s %s %4ss  %s' "$name" "$r" "$(( $(date +%s) - t1 ))" "$(tail -1 "$out/$name.log")")
    summary="$summary$line
"
    if [ "$r" = FAIL ]; then grep -v "bad=0 " "$out/$name.log" | head -20; fi
    if [ $sanitize -eq 1 ]; then
        if compute-sanitizer --tool memcheck --error-exitcode 3 "$bld/$name" >"$out/$name.memcheck.log" 2>&1; then
            m=clean
        else
            m="ERRORS"; status=1
            grep -m5 "=========" "$out/$name.memcheck.log"
        fi
        summary="$summary$(printf '%-14s memcheck %s' "$name" "$m")
"
    fi
done
echo "== summary"
printf '%s' "$summary"
exit $status
