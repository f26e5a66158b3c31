#!/bin/bash
# test_ops_scripts.sh BIN_DIR SOURCE_DIR - the operations scripts without a cluster:
#   1. glmspark-engine --check-recipe: the shipped recipes parse to the reference settings;
#      a bad key, a bad value and a repeated key exit 2 naming the key and the line;
#   2. install.sh --root: every file in place, units rendered, a second run changes nothing,
#      the units pass `systemd-analyze verify` without a single warning;
#   3. apply-sysctl.sh --root: idempotent, --check notices an edited file;
#   4. pagecache-dropper.sh --once: drops only while a rank loads and the cache is large;
#   5. oom-guard.sh --once: raises a victim's oom_score_adj, stops a rank by its pid file
#      below the memory floor, and leaves a process whose pid file is stale alone;
#   6. launch-cluster.sh --check-only through a local transport: a recipe/node mismatch, a
#      missing model, a missing binary and rank 0's database not answering are reported
#      naming the host; a bad GLMSPARK_READY is refused; a good node passes.
set -euo pipefail
bin=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
tmp=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

# 1. Recipes through the engine.
out=$("$bin/glmspark-engine" --check-recipe "$src/ops/recipes/glm-5.2-nvfp4-reap-469b.conf")
for kv in "pipeline_parallel = 3" "tensor_parallel = 1" "gpu_memory_utilization = 0.85" \
    "max_model_len = 262144" "kv_cache_dtype = fp8" "block_size = 128" "max_num_seqs = 1" \
    "max_num_batched_tokens = 2048" "backend = cuda" "precision = bf16"; do
    grep -qx "$kv" <<<"$out" || fail "the GLM-5.2 recipe lacks \"$kv\": $out"
done
"$bin/glmspark-engine" --check-recipe "$src/ops/recipes/devstack-tiny-cpu.conf" >/dev/null \
    || fail "the devstack recipe does not parse"
bad() {  # bad TEXT EXPECTED_MESSAGE
    printf '%b' "$1" >"$tmp/bad.conf"
    local st=0
    "$bin/glmspark-engine" --check-recipe "$tmp/bad.conf" >/dev/null 2>"$tmp/bad.err" || st=$?
    [ "$st" = 2 ] || fail "recipe \"$1\": exit $st, want 2"
    grep -qF "$2" "$tmp/bad.err" || fail "recipe \"$1\": message \"$(cat "$tmp/bad.err")\" lacks \"$2\""
}
bad 'threads = 2\npipline_parallel = 3\n' 'bad.conf:2: unknown recipe key "pipline_parallel"'
bad 'kv_cache_dtype = fp4\n' 'bad.conf:1: kv_cache_dtype: "fp4" is not one of'
bad 'precision = fp16\n' 'bad.conf:1: precision: "fp16" is not one of default, f32, bf16'
bad 'max_model_len = 1\nmax_model_len = 2\n' 'bad.conf:2: max_model_len is set twice'
bad 'gpu_memory_utilization = 85%\n' 'gpu_memory_utilization: "85%" is not a number'
# What the CUDA backend does not take (backends.h backend_kind_check), named before loading.
bad 'backend = cuda\nprecision = f32\n' 'the CUDA backend runs the bf16 precision recipe'
bad 'backend = cuda\nkv_cache_dtype = f32\n' "the CUDA backend's KV cache is bf16 or fp8"
bad 'backend = cuda\nblock_size = 16\n' "the CUDA backend's KV cache is in blocks of 128 positions"
st=0
"$bin/glmspark-engine" --recipe "$tmp/missing.conf" >/dev/null 2>&1 || st=$?
[ "$st" = 2 ] || fail "a missing --recipe: exit $st, want 2"
echo "ok: recipes parse; bad keys and values are named with their line"

# 2. install.sh --root.
r=$tmp/root
p=$tmp/prefix
"$src/ops/install.sh" --root "$r" --prefix "$p" --build "$bin/.." >"$tmp/i1.log" 2>&1 \
    || { cat "$tmp/i1.log"; fail "install.sh"; }
for f in "$p/bin/glmspark-engine" "$p/bin/glmspark-fcgi" "$p/lib/glmspark/launch-cluster.sh" \
    "$p/lib/glmspark/oom-guard.sh" "$p/share/glmspark/recipes/glm-5.2-nvfp4-reap-469b.conf"; do
    [ -x "$r$f" ] || [ -f "$r$f" ] || fail "install.sh did not install $f"
done
for f in glmspark-engine.service glmspark-fcgi@.socket glmspark-fcgi@.service \
    glmspark-oom-guard.service glmspark-pagecache-dropper.service ssh.service.d/glmspark-oom.conf \
    nginx.service.d/glmspark.conf; do
    [ -f "$r/etc/systemd/system/$f" ] || fail "no unit $f"
    ! grep -q '@[A-Z]*@' "$r/etc/systemd/system/$f" || fail "$f has unfilled placeholders"
done
[ -f "$r/etc/glmspark/env" ] && [ -f "$r/etc/glmspark/recipe.conf" ] || fail "no /etc/glmspark"
! grep -v '^#' "$r/etc/nginx/conf.d/glmspark.conf" | grep -q '@[A-Z_]*@' || fail "the nginx site has placeholders"
for k in 1 2; do  # --fcgi-procs 2 (the default): both instances' sockets in the upstream
    grep -q "server unix:/run/glmspark/fcgi-$k.sock;" "$r/etc/nginx/conf.d/glmspark.conf" \
        || fail "the nginx site's upstream lacks fcgi-$k.sock"
done
echo "edited" >>"$r/etc/glmspark/env"
"$src/ops/install.sh" --root "$r" --prefix "$p" --build "$bin/.." >"$tmp/i2.log" 2>&1 || fail "install.sh again"
grep -q "(0 file(s) changed)" "$tmp/i2.log" || { cat "$tmp/i2.log"; fail "a second install changed files"; }
tail -1 "$r/etc/glmspark/env" | grep -qx edited || fail "install.sh overwrote the operator's env"
if command -v systemd-analyze >/dev/null; then
    ln -s "$r$p" "$p"  # ExecStart paths must exist for verify
    # Templates verify as an instance (a link named like one).
    (cd "$r/etc/systemd/system" && ln -sf glmspark-fcgi@.socket glmspark-fcgi@1.socket \
        && ln -sf glmspark-fcgi@.service glmspark-fcgi@1.service)
    out=$(cd "$r/etc/systemd/system" && systemd-analyze verify --man=no glmspark-engine.service \
        glmspark-fcgi@1.socket glmspark-fcgi@1.service glmspark-oom-guard.service \
        glmspark-pagecache-dropper.service 2>&1) || fail "systemd-analyze verify: $out"
    [ -z "$out" ] || fail "systemd-analyze verify warns: $out"
    echo "ok: install.sh --root, idempotent; units verified by systemd-analyze"
else
    echo "ok: install.sh --root, idempotent (systemd-analyze not installed: units not verified)"
fi

# 3. apply-sysctl.sh.
s=$tmp/sysroot
"$src/ops/apply-sysctl.sh" --root "$s" 2>"$tmp/s1.log" || fail "apply-sysctl"
grep -qx "vm.min_free_kbytes = 1048576" "$s/etc/sysctl.d/99-glmspark.conf" || fail "no min_free_kbytes"
"$src/ops/apply-sysctl.sh" --root "$s" 2>"$tmp/s2.log"
grep -q unchanged "$tmp/s2.log" || fail "apply-sysctl rewrote an unchanged file"
"$src/ops/apply-sysctl.sh" --root "$s" --check 2>/dev/null || fail "--check on a current file"
sed -i 's/^vm.swappiness = .*/vm.swappiness = 60/' "$s/etc/sysctl.d/99-glmspark.conf"
if "$src/ops/apply-sysctl.sh" --root "$s" --check 2>/dev/null; then fail "--check missed an edit"; fi
"$src/ops/apply-sysctl.sh" --root "$s" 2>/dev/null
"$src/ops/apply-sysctl.sh" --root "$s" --check 2>/dev/null || fail "not repaired"
echo "ok: apply-sysctl.sh idempotent; --check notices edits"

# 4. pagecache-dropper.sh with a fake meminfo and drop_caches.
mkdir -p "$tmp/run"
printf 'MemTotal: 125000000 kB\nCached: 20971520 kB\nShmem: 1048576 kB\n' >"$tmp/meminfo"
drop() {
    rm -f "$tmp/drop"
    GLMSPARK_RUN_DIR=$tmp/run GLMSPARK_MEMINFO=$tmp/meminfo GLMSPARK_DROP_CACHES_FILE=$tmp/drop \
        GLMSPARK_DROP_ABOVE_MB=4096 "$src/ops/pagecache-dropper.sh" --once 2>/dev/null
}
drop
[ ! -e "$tmp/drop" ] || fail "dropped with no rank loading"
touch "$tmp/run/loading"
drop
[ "$(cat "$tmp/drop" 2>/dev/null)" = 1 ] || fail "did not drop 19 GiB of cache while loading"
printf 'Cached: 2097152 kB\nShmem: 0 kB\n' >"$tmp/meminfo"
drop
[ ! -e "$tmp/drop" ] || fail "dropped 2 GiB, below the 4 GiB threshold"
rm -f "$tmp/run/loading"
echo "ok: pagecache-dropper drops only while loading and above the threshold"

# 5. oom-guard.sh on a private victim name (no other process on this machine is touched).
name=gsoom$$
cp "$(command -v sleep)" "$tmp/$name"
setsid "$tmp/$name" 300 &
victim=$!
pids+=("$victim")
sleep 0.2
guard() {  # guard FLOOR_MB
    GLMSPARK_RUN_DIR=$tmp/run GLMSPARK_OOM_FLOOR_MB=$1 GLMSPARK_OOM_PROTECT=gs-none-$$ \
        GLMSPARK_OOM_CONTROL=gs-none-$$ GLMSPARK_OOM_VICTIMS=$name "$src/ops/oom-guard.sh" --once 2>&1
}
guard 0 >/dev/null
[ "$(cat "/proc/$victim/oom_score_adj")" = 500 ] || fail "the victim's oom_score_adj is not 500"
start=$(sed 's/^.*) //' "/proc/$victim/stat" | cut -d' ' -f20)
echo "$victim $((start + 1)) group" >"$tmp/run/rank0.pid"  # stale: another start time
guard 99999999 >/dev/null
kill -0 "$victim" 2>/dev/null || fail "oom-guard killed a process whose pid file is stale"
echo "$victim $start group" >"$tmp/run/rank0.pid"
out=$(guard 99999999)
for _ in $(seq 50); do kill -0 "$victim" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$victim" 2>/dev/null && [ "$(sed 's/^.*) //' "/proc/$victim/stat" | cut -d' ' -f1)" != Z ]; then
    fail "oom-guard did not stop the rank below the floor: $out"
fi
grep -q "SIGTERM to rank pid $victim" <<<"$out" || fail "no message: $out"
echo "ok: oom-guard sets +500 on the engine, stops a rank below the floor, ignores stale pid files"

# 6. launch-cluster.sh --check-only with a local transport (ssh's contract).
"$bin/glmspark" mkmodel --out "$tmp/model" --preset tiny 2>/dev/null
check() {  # check NODES RECIPE [VAR=VALUE...] -> output, status in $st
    local nodes=$1 recipe=$2
    shift 2
    st=0
    out=$(env GLMSPARK_NODES="$nodes" GLMSPARK_RSH="$src/tests/ops/local-rsh.sh" GLMSPARK_RUN_DIR="$tmp/lrun" \
        GLMSPARK_BIN="$bin" GLMSPARK_MODEL="$tmp/model" GLMSPARK_RECIPE="$recipe" "$@" \
        GLMSPARK_ENV=/nonexistent-glmspark-env "$src/ops/launch-cluster.sh" --check-only 2>&1) || st=$?
}
check "here" "$src/ops/recipes/devstack-tiny-cpu.conf"
[ "$st" = 1 ] && grep -q "pipeline_parallel = 3 but GLMSPARK_NODES lists 1" <<<"$out" \
    || fail "recipe/node mismatch: $out"
check "here here gone" "$src/ops/recipes/devstack-tiny-cpu.conf"
[ "$st" = 1 ] && grep -q "FAILED gone: unreachable" <<<"$out" || fail "unreachable: $out"
check "here" "" GLMSPARK_MODEL="$tmp/no-model"
[ "$st" = 1 ] && grep -q "FAILED here: no model directory" <<<"$out" || fail "no model: $out"
check "here" "" GLMSPARK_BIN="$tmp/no-bin"
[ "$st" = 1 ] && grep -q "FAILED here: no executable" <<<"$out" || fail "no binary: $out"
check "here" "" GLMSPARK_MIN_MEM_GB=100000000
[ "$st" = 1 ] && grep -q "FAILED here: .* GiB of memory available" <<<"$out" || fail "memory: $out"
check "here" "" GLMSPARK_DB="host=/nonexistent-glmspark-pg dbname=glmspark connect_timeout=2"
[ "$st" = 1 ] && grep -q "FAILED here: rank 0's database (GLMSPARK_DB) does not answer" <<<"$out" \
    || fail "an unreachable database: $out"
check "here" "" GLMSPARK_READY=maybe
[ "$st" = 1 ] && grep -q "GLMSPARK_READY must be status or log" <<<"$out" || fail "GLMSPARK_READY: $out"
check "here" ""
[ "$st" = 0 ] && grep -q "every node passed" <<<"$out" || fail "a good node: $out"
echo "ok: launch-cluster --check-only names the failing host and reason"
echo "all ops script checks passed"
