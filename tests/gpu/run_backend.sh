#!/bin/sh
# run_backend.sh [CARRY_DIR] - the engine's CUDA backend tests on the GPU machine (label gpu).
#
# The GPU image lacks the engine's build dependencies (json-c, pcre2, utf8proc, libpq), so the
# engine is built on the development machine and carried: CARRY_DIR (default
# .carry/cudabackend, gitignored) holds bin/{glmspark,gpu_backend_ops,gpu_golden_cuda} from a
# CUDA build (-DGLMSPARK_NCCL_LIBRARY=OFF keeps NCCL out) and lib/ with every shared library
# they need plus the dynamic loader, which runs them so that the image's own glibc does not
# matter. Make it with:
#   cmake -S . -B build-cudabackend -G Ninja -DWERROR=ON -DGLMSPARK_NCCL_LIBRARY=OFF
#   ninja -C build-cudabackend glmspark gpu_backend_ops gpu_golden_cuda
#   tests/gpu/run_backend.sh --pack build-cudabackend
# (--pack strips the binaries; the pack is ~51 MB. When it and the tree pass the device's 64 MiB
# transfer limit, carry `tar cf - -C .carry cudabackend | xz -T2 >.carry/cudabe.tar.xz` (~13 MB)
# instead and start the device command with `tar xJf .carry/cudabe.tar.xz -C .carry`.)
# Runs: every op against the CPU backend following the bf16 recipe; each golden model end to
# end (in-process, and the `glmspark logits --backend cuda` file, against the float64
# reference within the recipe's bound); `glmspark generate --backend cuda` greedy output
# against the CPU following the recipe (CUDA graphs on, the default; agreement with
# golden.json's float64 output reported); 4 sampled
# sequences 2 at a time (--n-seqs 4 --max-seqs 2: batches change sequences) equal with graphs
# on and off; and with
# `--kv-dtype fp8` against the CPU backend's with the same cache; the prefill's and the
# one-token decode steps' logits (--decode-out) byte for byte the same with GLMSPARK_CUDA_PDL=0
# GLMSPARK_CUDA_FUSE=0; greedy
# `--mtp K` (K = 1..3) against the output without MTP on every golden model with an MTP layer. With
# BENCH="PRESET:BATCHES:CTX ..." (e.g. "default:1,8:1024 small:1,8:1024") it then runs
# `glmspark bench --synthetic --backend cuda` for each, with graphs on and off
# (GLMSPARK_CUDA_GRAPHS=0), into bench.log; REAP (below) benchmarks checkpoints at GLM-5.2-REAP
# dimensions. GOLDEN=0 skips the golden models and MTP; GEN_GOLDEN (below) makes new ones
# first. Logs go to $OUT (or ./gpu-out). The
# environment reaches every binary: GLMSPARK_MLA_TC=0 runs it all without the tensor-core MLA
# (Backend.mla_tc, on the CPU reference too), GLMSPARK_DSA_TC=0 without the tensor-core indexer
# scores (Backend.dsa_tc).
set -u
cd "$(dirname "$0")/../.." || exit 1
if [ "${1:-}" = "--pack" ]; then
    bld=$2
    c=.carry/cudabackend
    rm -rf "$c" && mkdir -p "$c/bin" "$c/lib"
    cp "$bld/bin/glmspark" "$bld/bin/gpu_backend_ops" "$bld/bin/gpu_golden_cuda" "$c/bin/"
    for t in gpu_test_moe gpu_test_mla gpu_test_gemm gpu_test_norm gpu_test_dsa; do  # the kernel tests of what the backend runs, if built
        [ -x "$bld/bin/$t" ] && cp "$bld/bin/$t" "$c/bin/"
    done
    # cuBLAS (kernels/gemm.cu's cuBLASLt, ~0.5 GB) is not carried: the GPU image has its own
    # (the nvidia-cublas wheel), found below.
    for b in "$c"/bin/*; do ldd "$b" | awk '/=>/ {print $3}'; done | sort -u | while read -r l; do
        case "$l" in */libcublas*) continue ;; esac
        [ -n "$l" ] && cp -L "$l" "$c/lib/"
    done
    cp -L /lib64/ld-linux-x86-64.so.2 "$c/lib/"
    strip "$c"/bin/*
    du -sh "$c"
    exit 0
fi
c=${1:-.carry/cudabackend}
out=${OUT:-$(pwd)/gpu-out}
mkdir -p "$out"
cublas=$(find /usr /opt -name 'libcublasLt.so.1[0-9]*' -path '*nvidia*' 2>/dev/null | head -1)
[ -n "$cublas" ] || cublas=$(find /usr /opt -name 'libcublasLt.so.1[0-9]*' 2>/dev/null | head -1)
[ -n "$cublas" ] || { echo "no libcublasLt on this machine"; exit 1; }
libpath="$c/lib:$(dirname "$cublas"):/usr/local/nvidia/lib64:/usr/local/nvidia/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
run() { "$c/lib/ld-linux-x86-64.so.2" --library-path "$libpath" "$@"; }
# run_setting SETTING ARGS...: `glmspark ARGS` under SETTING, variables joined by commas
# (e.g. GLMSPARK_MLA_TC=0,GLMSPARK_DSA_TC=0); BIN=NAME in it runs $c/bin/NAME, another build.
run_setting() {
    e=$1; shift
    bin=glmspark
    for v in $(echo "$e" | tr , " "); do case $v in BIN=*) bin=${v#BIN=} ;; esac; done
    env $(echo "$e" | tr , " " | sed 's/BIN=[^ ]*//g') "$c/lib/ld-linux-x86-64.so.2" \
        --library-path "$libpath" "$c/bin/$bin" "$@"
}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# TESTS=0 skips the kernel and op tests (to spend a run on benchmarks alone); TESTS="NAME ..."
# runs only those of them (gpu_test_mla, gpu_test_dsa, ..., gpu_backend_ops: a short run when
# little device time is left). gpu_test_moe runs after the golden models: its double references
# at GLM's widths take ~5 minutes of the GPU machine's CPU (run 21), which should not hold the
# rest back under a command's limit.
wants_test() {
    case "${TESTS:-1}" in
    1) return 0 ;;
    0) return 1 ;;
    *) case " $TESTS " in *" $1 "*) return 0 ;; esac; return 1 ;;
    esac
}
kernel_tests() {
    for t in "$@"; do
        [ -x "$c/bin/$t" ] && wants_test "$t" || continue
        echo "== $t (kernels/ against kernels/ref)"
        if run "$c/bin/$t" >"$out/$t.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
        tail -15 "$out/$t.log"
        echo "$t $r"
    done
}
kernel_tests gpu_test_mla gpu_test_gemm gpu_test_norm gpu_test_dsa

# SANITIZE="NAME ..." runs those under compute-sanitizer memcheck (the engine's carried
# binaries, through their loader): gpu_backend_ops (every op the CUDA backend runs against the
# CPU), golden:MODEL (`glmspark logits --backend cuda` on tests/golden/models/MODEL: the whole
# forward pass, prefill and graphed decode steps) and the kernel tests (gpu_test_*); a run is
# clean when memcheck reports no error and the program passes. SANITIZE_LIMIT seconds each
# (default 300): a run past it is reported as such, not as clean.
for s in ${SANITIZE:-}; do
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    [ -n "$cs" ] || { echo "SANITIZE: no compute-sanitizer on this machine"; status=1; break; }
    case $s in
    golden:*) d=tests/golden/models/${s#golden:}
        toks=$(python3 -c "import json;print(','.join(map(str,json.load(open('$d/golden.json'))['tokens'])))")
        set -- "$c/bin/glmspark" logits --backend cuda --model "$d" --tokens "$toks" \
            --out /dev/null --decode-out /dev/null ;;
    *) set -- "$c/bin/$s" ;;
    esac
    log="$out/memcheck.$(echo "$s" | tr ':/' '__').log"
    timeout "${SANITIZE_LIMIT:-300}" "$cs" --tool memcheck --error-exitcode 3 \
        "$c/lib/ld-linux-x86-64.so.2" --library-path "$libpath" "$@" >"$log" 2>&1
    rc=$?
    case $rc in
    0) r=clean ;;
    124) r="NOT FINISHED in ${SANITIZE_LIMIT:-300} s"; status=1 ;;
    3) r="MEMCHECK ERRORS"; status=1 ;;
    *) r="FAILED (exit $rc)"; status=1 ;;
    esac
    echo "memcheck $s: $r; $(grep -m1 'ERROR SUMMARY' "$log")"
    [ "$r" = clean ] || grep -m8 "=========" "$log"
done

if wants_test gpu_backend_ops; then
echo "== op tests (CUDA vs CPU backend)"
if run "$c/bin/gpu_backend_ops" >"$out/backend_ops.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
grep -B1 "check failed" "$out/backend_ops.log" | head -20
tail -5 "$out/backend_ops.log"
echo "backend_ops $r"
fi

# GOLDEN=0 skips the golden models and MTP (to spend a run on REAP alone); GOLDEN_MODELS
# (directories, or names under tests/golden/models) runs those instead of every one.
golden_dirs=
for d in ${GOLDEN_MODELS:-$(ls -d tests/golden/models/*/)}; do
    [ -d "$d" ] || [ ! -d "tests/golden/models/$d" ] || d=tests/golden/models/$d
    [ -f "$d/golden.json" ] || { echo "GOLDEN_MODELS: $d is no golden model directory"; status=1; continue; }
    golden_dirs="$golden_dirs $d"
done
# GEN_GOLDEN=NAME,... makes those models of tests/tools/gen_golden_models.py here first (this
# machine has torch and transformers: their reference is transformers' float64 forward) into
# $OUT/golden_new/, and the golden runs below include them; copy them into tests/golden/models/
# to keep them.
if [ -n "${GEN_GOLDEN:-}" ] && [ "${GOLDEN:-1}" != 0 ]; then
    echo "== generating golden models $GEN_GOLDEN"
    python3 tests/tools/gen_golden_models.py --out "$out/golden_new" --only "$GEN_GOLDEN" \
        >"$out/gen_golden.log" 2>&1 || { echo "gen_golden_models.py failed"; status=1; }
    grep -v "rejected" "$out/gen_golden.log" | tail -8
    golden_dirs="$golden_dirs $(ls -d "$out"/golden_new/*/ 2>/dev/null)"
fi
if [ "${GOLDEN:-1}" != 0 ]; then
echo "== golden models"
for d in $golden_dirs; do
    m=$(basename "$d")
    toks=$(python3 -c "import json;print(','.join(map(str,json.load(open('$d/golden.json'))['tokens'])))")
    # (PDL on every step a graph may take, 64 tokens, not only on the default one-token steps)
    GLMSPARK_CUDA_PDL=64 run "$c/bin/glmspark" logits --backend cuda --model "$d" --tokens "$toks" \
        --out "$out/$m.logits" --decode-out "$out/$m.dec" >"$out/$m.cli.log" 2>&1 \
        || { echo "$m: glmspark logits failed"; status=1; }
    if run "$c/bin/gpu_golden_cuda" "$d" "$out/$m.logits" >"$out/$m.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
    # Programmatic dependent launch and the fused launches change no number (a race or a
    # fusion that sums otherwise would): the prefill's logits and the one-token decode steps'
    # (--decode-out: the grouped GEMVs and the graphs run there) with both off, byte for byte.
    env GLMSPARK_CUDA_PDL=0 GLMSPARK_CUDA_FUSE=0 "$c/lib/ld-linux-x86-64.so.2" --library-path "$libpath" \
        "$c/bin/glmspark" logits --backend cuda --model "$d" --tokens "$toks" \
        --out "$out/$m.plain.logits" --decode-out "$out/$m.plain.dec" >>"$out/$m.cli.log" 2>&1 \
        || { echo "$m: plain logits failed"; status=1; }
    if cmp -s "$out/$m.logits" "$out/$m.plain.logits" && cmp -s "$out/$m.dec" "$out/$m.plain.dec"
    then pf=PASS; else pf=FAIL; status=1; fi
    rm -f "$out/$m.logits" "$out/$m.plain.logits" "$out/$m.dec" "$out/$m.plain.dec"
    # The checks' lines, not the loader's INFO lines (the device returns only the output's tail).
    grep -v " INFO " "$out/$m.log"; grep -i "decode\|error" "$out/$m.cli.log" | head -3
    prompt=$(python3 -c "import json;print(','.join(map(str,json.load(open('$d/golden.json'))['greedy']['prompt'])))")
    want=$(python3 -c "import json;g=json.load(open('$d/golden.json'))['greedy'];print(' '.join(map(str,g['output'])))")
    n=$(python3 -c "import json;print(json.load(open('$d/golden.json'))['greedy']['max_tokens'])")
    # Greedy: the CUDA backend (bf16 recipe, bf16 cache) equals the CPU following the recipe
    # with the same cache; agreement with the float64 greedy output is reported.
    got=$(run "$c/bin/glmspark" generate --backend cuda --model "$d" \
        --tokens "$prompt" --max-tokens "$n" --temperature 0 --ignore-eos 2>"$out/$m.gen.log" \
        | tr -s ' ' | sed 's/ *$//')
    cg=$(run "$c/bin/glmspark" generate --backend cpu --precision bf16 --kv-dtype bf16 --model "$d" \
        --tokens "$prompt" --max-tokens "$n" --temperature 0 --ignore-eos 2>>"$out/$m.gen.log" \
        | tr -s ' ' | sed 's/ *$//')
    f64=$(python3 -c "a='$got'.split();b='$want'.split();print(sum(x==y for x,y in zip(a,b)),'of',len(b))")
    if [ -n "$got" ] && [ "$got" = "$cg" ]; then g="PASS (float64's tokens: $f64)"; else g="FAIL (cuda '$got', cpu following the recipe '$cg')"; status=1; fi
    # Sequences taking turns (2 at a time of 4, sampled: each sequence its own tokens and
    # cache): the second pair replays the graphs the first recorded (a step's graph is keyed
    # by its shape, not its sequences). The same lines as with graphs off, and some replays.
    # At least 8 tokens a sequence: with fewer (long_dsa's 3) a pair may take no two decode
    # steps of one shape, so nothing is recorded to replay.
    nt=$((n > 8 ? n : 8))
    tw=$(run "$c/bin/glmspark" generate --backend cuda --model "$d" \
        --tokens "$prompt" --max-tokens "$nt" --temperature 0.9 --seed 7 --ignore-eos --n-seqs 4 --max-seqs 2 \
        2>"$out/$m.turns.log")
    te=$(env GLMSPARK_CUDA_GRAPHS=0 "$c/lib/ld-linux-x86-64.so.2" --library-path "$libpath" \
        "$c/bin/glmspark" generate --backend cuda --model "$d" \
        --tokens "$prompt" --max-tokens "$nt" --temperature 0.9 --seed 7 --ignore-eos --n-seqs 4 --max-seqs 2 \
        2>>"$out/$m.turns.log")
    replays=$(grep -o "CUDA graphs: [0-9]* graphed calls replayed" "$out/$m.turns.log" | grep -o "[0-9][0-9]*" | head -1)
    if [ "$(echo "$tw" | grep -c .)" -eq 4 ] && [ "$tw" = "$te" ] && [ "${replays:-0}" -gt 0 ]; then
        g="$g, 4 sampled sequences 2 at a time = graphs off PASS ($replays replays)"
    else g="$g, 4 sampled sequences 2 at a time FAIL ('$tw' vs graphs off '$te', ${replays:-no} replays)"; status=1; fi
    # fp8 KV cache: the CUDA backend's greedy output equals the CPU reference's with the same cache.
    g8=$(run "$c/bin/glmspark" generate --backend cuda --kv-dtype fp8 --model "$d" \
        --tokens "$prompt" --max-tokens "$n" --temperature 0 --ignore-eos 2>>"$out/$m.gen.log")
    c8=$(run "$c/bin/glmspark" generate --backend cpu --precision bf16 --kv-dtype fp8 --model "$d" --tokens "$prompt" \
        --max-tokens "$n" --temperature 0 --ignore-eos 2>>"$out/$m.gen.log")
    if [ -n "$c8" ] && [ "$g8" = "$c8" ]; then f=PASS; else f="FAIL (cuda '$g8', cpu '$c8')"; status=1; fi
    echo "$m: golden $r, prefill and decode logits = with PDL and fusions off $pf, generate --backend cuda $g, fp8 cache cuda = cpu $f"
done

# The fp8 comparison is checked on the models whose two caches hold equal E4M3 codes
# (tests/gpu/golden_cuda.c); it must not go vacuous: at least half the golden models (of the
# whole set: a GOLDEN_MODELS subset may hold only models whose codes differ; each model's own
# comparison above is checked either way).
n_models=$(echo $golden_dirs | wc -w)
n_fp8=$(for d in $golden_dirs; do grep -c "^fp8 cache: codes equal, checked" "$out/$(basename "$d").log"; done \
    | awk '{ s += $1 } END { print s + 0 }')
if [ $((2 * n_fp8)) -ge "$n_models" ]; then r=PASS
elif [ -n "${GOLDEN_MODELS:-}" ]; then r="not held to the floor (GOLDEN_MODELS: a chosen subset)"
else r=FAIL; status=1; fi
echo "fp8 cache cuda vs cpu checked (equal codes) on $n_fp8 of $n_models golden models: $r"

echo "== MTP on every golden model with an MTP layer (with and without MTP indexer tensors)"
toks=1,5,7,9,11,3
for cfgf in $(for d in $golden_dirs; do grep -l '"num_nextn_predict_layers": [1-9]' "$d/config.json"; done); do
    d=$(dirname "$cfgf")
    m=$(basename "$d")
    ref=$(run "$c/bin/glmspark" generate --backend cuda --model "$d" --tokens $toks --max-tokens 24 \
        --temperature 0 --ignore-eos 2>"$out/$m.mtp0.log")
    dense=""
    grep -q "without indexer tensors run.* dense attention: .*(MTP)" "$out/$m.mtp0.log" \
        && dense=" (MTP layer without indexer tensors: dense)"
    for k in 1 2 3; do
        got=$(run "$c/bin/glmspark" generate --backend cuda --model "$d" --tokens $toks \
            --max-tokens 24 --temperature 0 --ignore-eos --mtp $k 2>"$out/$m.mtp$k.log")
        if [ -n "$ref" ] && [ "$got" = "$ref" ]; then r=PASS; else r="FAIL ('$got' vs '$ref')"; status=1; fi
        echo "$m --mtp $k: $r$dense; $(grep -o "mtp $k: .*" "$out/$m.mtp$k.log" | tail -1)"
    done
done
fi
kernel_tests gpu_test_moe

for cfg in ${BENCH:-}; do
    preset=${cfg%%:*}; rest=${cfg#*:}; batches=${rest%%:*}; ctx=${rest#*:}
    for graphs in 1 0; do
        echo "== bench $preset batch $batches ctx $ctx graphs $graphs" | tee -a "$out/bench.log"
        GLMSPARK_CUDA_GRAPHS=$graphs TMPDIR=/tmp run "$c/bin/glmspark" bench --backend cuda \
            --synthetic --preset "$preset" --batch "$batches" --ctx "$ctx" --steps "${STEPS:-32}" \
            >>"$out/bench.log" 2>&1 || { echo "bench $preset failed"; status=1; }
    done
done
# REAP="LAYERS:DENSE ..." (e.g. "3:1 5:1"): write `mkmodel --preset reap` checkpoints of those
# sizes into ${REAP_DIR:-/tmp} (timed), then `glmspark bench --model` on each (batches
# ${REAP_BATCH:-1,8}, context 1024) with the fp8 and the bf16 KV cache (${REAP_KV:-fp8 bf16}),
# batch 1 at each context of $REAP_LONG
# (profiled too with REAP_LONG_PROFILE=1),
# `glmspark generate` on 1 and 8 sequences (the serving path against the bench), and one
# profiled (GLMSPARK_CUDA_PROFILE=1) batch-1 fp8 run; into reap.log. Per MoE layer (printed
# at the end) = the difference of two sizes with the same dense count over their MoE-layer
# difference. To spend
# less device time: REAP_KV=fp8,
# REAP_PROFILE=0 (no profiled run; REAP_PROFILE_BATCH=1,16: the batches it profiles),
# REAP_COMPARE=0 (no reap_compare below), GEN_TOKENS (generate's length, 64).
# REAP_PREFILL="2048 8192" adds batch-1 runs at those prompt lengths (prefill tok/s and
# TFLOP/s against the cuBLASLt GEMM of the same run).
# REAP_PREFILL_ENVS="GLMSPARK_MOE_WIDE=0 GLMSPARK_MLA_TC=0,GLMSPARK_DSA_TC=0" repeats them (and
# the REAP_LONG runs) with
# each of those settings (commas join variables; BIN=NAME another build, as below), REAP_PREFILL_PROFILE=1 profiles
# each per op kind. REAP_SPILL=DIR lets a checkpoint larger than the disk put its last shards
# in DIR (`mkmodel --spill`, e.g. /dev/shm: REAP=26:3, one 90 GB stage, on the 64 GB disk).
# REAP_DECODE_ENVS="GLMSPARK_CUDA_PDL=0 GLMSPARK_CUDA_FUSE=0" repeats the fp8 decode bench
# with each of those settings (the A/B of programmatic dependent launch and of the fused
# launches, which leave the numbers as they are); BIN=NAME in one (e.g.
# "BIN=glmspark-pdlexit,GLMSPARK_CUDA_PDL=8") runs $CARRY_DIR/bin/NAME, another build, instead;
# with REAP_MTP the MTP bench (drafts 1-3) is repeated with each setting too.
# REAP_TTFT="25000" times `glmspark generate --max-tokens 1` on a prompt of that many tokens
# (its prefill line: the time to the first token, issue 20).
# REAP_KEEP=1 leaves the checkpoints on disk afterwards, and REAP_REUSE=1 takes a checkpoint
# that an earlier command on the same (still warm) machine wrote completely (the same REAP,
# REAP_DIR and REAP_MTP) instead of writing it again (~50 s for 26 layers); REAP_KV=0 runs no
# decode bench.
# REAP_MTP=1 writes the checkpoints with an MTP layer (+11.8 GB of
# BF16 experts) and times MTP steps with 1-3 drafts (`bench --mtp-drafts 1,2,3`, batches
# ${REAP_MTP_BATCH:-1,8}: issue 19's verify ratios and the speed-up at published acceptance;
# REAP_MTP_PROFILE=1 profiles them per op kind at batch 1).
# mtp_bench SETTING: the MTP bench (drafts 1-3 on the checkpoint $dir of REAP size $cfg: verify
# rows, draft passes) under SETTING (run_setting's; "" the plain build), into reap.log.
mtp_bench() {
    mtp_setting=$1
    echo "== bench reap $cfg kv fp8 precision bf16 mtp drafts 1,2,3${mtp_setting:+ $mtp_setting}" \
        | tee -a "$out/reap.log"
    run_setting "$mtp_setting" bench --backend cuda --model "$dir" \
        --batch "${REAP_MTP_BATCH:-1,8}" --ctx 1024 --steps "${STEPS:-16}" --kv-dtype fp8 \
        --mtp-drafts 1,2,3 >>"$out/reap.log" 2>&1 \
        || { echo "bench reap $cfg mtp${mtp_setting:+ $mtp_setting} failed"; status=1; }
}
# reap_compare DIR KV: `glmspark logits` of a 40-token prompt on the CUDA backend (the bf16
# recipe, its only one) and the CPU backend under both recipes, relative L2 per row. Checked:
# the CUDA backend's largest and mean distance from the CPU's f32 result at most
# 1.25x (+1e-4) the CPU-following-bf16 one's: the GPU is as close to the exact computation as
# the recipe itself. Reported: CUDA bf16 against CPU bf16 (roundings that a 1e-7 difference flips
# differ between the two; at REAP size they add up to the recipe's own size, docs/precision.md).
reap_compare() {
    toks=$(python3 -c "print(','.join(str((i * 7919) % 150000 + 5) for i in range(40)))")
    for cfg in cuda:bf16 cpu:bf16 cpu:f32; do
        b=${cfg%%:*}; p=${cfg#*:}
        if ! run "$c/bin/glmspark" logits --backend "$b" --precision "$p" --model "$1" \
                --tokens "$toks" --kv-dtype "$2" --out "$out/reap.$b.$p" 2>>"$out/reap.log"; then
            echo "reap logits $1 $2 $cfg failed" | tee -a "$out/reap.log"; status=1; return
        fi
    done
    python3 - "$out/reap" "$(basename "$1") $2 cache" >"$out/reap.cmp" <<'PY' || status=1
import sys, numpy as np
L = lambda n: np.fromfile(f"{sys.argv[1]}.{n}", dtype=np.float32).reshape(40, -1).astype(np.float64)
def rel(a, b):
    x, y = L(a), L(b)
    return np.linalg.norm(x - y, axis=1) / np.linalg.norm(y, axis=1), int((x.argmax(1) == y.argmax(1)).sum())
gpu16, gpu16_agree = rel("cuda.bf16", "cpu.f32")
cpu16, _ = rel("cpu.bf16", "cpu.f32")
both16, both16_agree = rel("cuda.bf16", "cpu.bf16")
ok_16 = bool(np.isfinite(gpu16).all() and gpu16.max() <= 1.25 * cpu16.max() + 1e-4
             and gpu16.mean() <= 1.25 * cpu16.mean() + 1e-4)
tag = sys.argv[2]
print(f"reap {tag}: bf16 recipe vs exact (cpu f32): cuda max {gpu16.max():.3g} mean "
      f"{gpu16.mean():.3g}, cpu following it max {cpu16.max():.3g} mean {cpu16.mean():.3g}, "
      f"argmax {gpu16_agree}/40: {'PASS' if ok_16 else 'FAIL'}")
print(f"reap {tag}: bf16 recipe, cuda vs cpu following it (reported): max {both16.max():.3g} median "
      f"{np.median(both16):.3g}, argmax {both16_agree}/40")
sys.exit(0 if ok_16 else 1)
PY
    cat "$out/reap.cmp" | tee -a "$out/reap.log"
    rm -f "$out"/reap.cuda.* "$out"/reap.cpu.*
}
if [ -n "${REAP:-}" ] && [ "${REAP_COMPARE:-1}" = 1 ]; then
    # GLM-5.2's attention and dense MLP shapes with no routing (two dense layers).
    dir=${REAP_DIR:-/tmp}/reap-2-2
    run "$c/bin/glmspark" mkmodel --preset reap --layers 2 --dense 2 --out "$dir" >>"$out/reap.log" 2>&1 \
        || { echo "mkmodel reap 2:2 failed"; status=1; }
    reap_compare "$dir" fp8
    reap_compare "$dir" bf16
    rm -rf "$dir"
fi
# REAP_PREFILL_CHUNK=N: the REAP_PREFILL and REAP_LONG benches in forward calls of N tokens
# (`bench --prefill-chunk`; default 4,096).
pchunk=${REAP_PREFILL_CHUNK:+--prefill-chunk $REAP_PREFILL_CHUNK}
for cfg in ${REAP:-}; do
    layers=${cfg%%:*}; dense=${cfg#*:}
    dir=${REAP_DIR:-/tmp}/reap-$layers-$dense
    echo "== mkmodel reap --layers $layers --dense $dense ($(nproc) cores)" | tee -a "$out/reap.log"
    t0=$(date +%s.%N)
    spill=${REAP_SPILL:+$REAP_SPILL/reap-$layers-$dense-spill}
    if [ "${REAP_REUSE:-0}" = 1 ] && [ -f "$dir/.mkmodel-done${REAP_MTP:+-mtp}" ]; then
        echo "mkmodel reap $cfg: kept from an earlier run on this machine (REAP_REUSE=1)" | tee -a "$out/reap.log"
    else
        rm -f "$dir"/.mkmodel-done*
        run "$c/bin/glmspark" mkmodel --preset reap --layers "$layers" --dense "$dense" \
            ${REAP_MTP:+--mtp 1} ${spill:+--spill "$spill"} --out "$dir" \
            >>"$out/reap.log" 2>&1 || { echo "mkmodel reap $cfg failed"; status=1; continue; }
        touch "$dir/.mkmodel-done${REAP_MTP:+-mtp}"
        echo "mkmodel reap $cfg: $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s, $(du -shL "$dir" | cut -f1)" | tee -a "$out/reap.log"
    fi
    for kv in ${REAP_KV:-fp8 bf16}; do
        [ "$kv" = 0 ] && break  # REAP_KV=0: no decode bench (a later run's REAP_LONG alone)
        echo "== bench reap $cfg kv $kv" | tee -a "$out/reap.log"
        run "$c/bin/glmspark" bench --backend cuda --model "$dir" --batch "${REAP_BATCH:-1,8}" \
            --ctx 1024 --steps "${STEPS:-16}" --kv-dtype $kv >>"$out/reap.log" 2>&1 \
            || { echo "bench reap $cfg $kv failed"; status=1; }
    done
    if [ -n "${REAP_MTP:-}" ]; then  # MTP steps with 1-3 drafts: verify rows, draft passes
        mtp_bench ""
        if [ "${REAP_MTP_PROFILE:-0}" = 1 ]; then  # per op kind: the verify rows, the MTP passes
            echo "== profile reap $cfg kv fp8 mtp drafts 1,2,3 batch 1" | tee -a "$out/reap.log"
            GLMSPARK_CUDA_PROFILE=1 run "$c/bin/glmspark" bench --backend cuda --model "$dir" \
                --batch 1 --ctx 1024 --steps 8 --kv-dtype fp8 --mtp-drafts 1,2,3 \
                >>"$out/reap.log" 2>&1 || status=1
        fi
    fi
    for ctx in ${REAP_PREFILL:-}; do  # e.g. "2048 8192": prefill tok/s and % of the GEMM
        echo "== bench reap $cfg kv fp8 precision bf16 prefill $ctx" | tee -a "$out/reap.log"
        run "$c/bin/glmspark" bench --backend cuda --model "$dir" --batch 1 --ctx "$ctx" \
            --steps 2 --kv-dtype fp8 $pchunk >>"$out/reap.log" 2>&1 \
            || { echo "bench reap $cfg prefill $ctx failed"; status=1; }
        for e in "" ${REAP_PREFILL_ENVS:-}; do  # e.g. GLMSPARK_MOE_WIDE=0
            if [ -n "$e" ]; then
                echo "== bench reap $cfg kv fp8 precision bf16 prefill $ctx $e" | tee -a "$out/reap.log"
                run_setting "$e" bench --backend cuda --model "$dir" --batch 1 --ctx "$ctx" --steps 2 $pchunk \
                    --kv-dtype fp8 >>"$out/reap.log" 2>&1 || status=1
            fi
            if [ "${REAP_PREFILL_PROFILE:-0}" = 1 ]; then  # per op kind (graphs off)
                echo "== profile reap $cfg kv fp8 prefill $ctx $e" | tee -a "$out/reap.log"
                run_setting "GLMSPARK_CUDA_PROFILE=1${e:+,$e}" bench --backend cuda --model "$dir" \
                    --batch 1 --ctx "$ctx" --steps 2 --kv-dtype fp8 >>"$out/reap.log" 2>&1 || status=1
            fi
        done
    done
    for long in ${REAP_LONG:-}; do  # e.g. "32768 131072": batch 1 at that context (DSA on), fp8
      for e in "" ${REAP_PREFILL_ENVS:-}; do  # and with each of REAP_PREFILL_ENVS
        [ "${REAP_LONG_PROFILE:-0}" = only ] && break  # the profiled run alone
        echo "== bench reap $cfg kv fp8 precision bf16 ctx $long $e" | tee -a "$out/reap.log"
        run_setting "$e" bench --backend cuda --model "$dir" --batch 1 --ctx "$long" \
            --steps "${STEPS:-16}" --kv-dtype fp8 $pchunk >>"$out/reap.log" 2>&1 \
            || { echo "bench reap $cfg ctx $long $e failed"; status=1; }
      done
        if [ "${REAP_LONG_PROFILE:-0}" != 0 ]; then  # per op kind at that context (graphs off; only: alone)
            echo "== profile reap $cfg kv fp8 batch 1 ctx $long" | tee -a "$out/reap.log"
            GLMSPARK_CUDA_PROFILE=1 run "$c/bin/glmspark" bench --backend cuda --model "$dir" \
                --batch 1 --ctx "$long" --steps 8 --kv-dtype fp8 $pchunk >>"$out/reap.log" 2>&1 || status=1
        fi
    done
    for n_ttft in ${REAP_TTFT:-}; do  # e.g. 25000: time to first token of an n-token prompt
        # ids below 1,005: 25K of them stay under the kernel's 128 KB limit on one argument
        toks=$(python3 -c "print(','.join(str((i * 7919) % 1000 + 5) for i in range($n_ttft)))")
        run "$c/bin/glmspark" generate --backend cuda --kv-dtype fp8 --model "$dir" --tokens "$toks" \
            --max-tokens 1 --ignore-eos 2>&1 >/dev/null | grep -o "prefill: [0-9]* tokens in [^;]*" \
            | sed "s/^/generate reap $cfg, TTFT: /" | tee -a "$out/reap.log"
    done
    # The serving path against the bench (issue 18: within 5%): `glmspark generate` on one
    # sequence of a 1,024-token prompt (its decode tok/s), and 8 sequences of it through the
    # scheduler (the aggregate decode tok/s once all 8 are prefilled: the bench's batch 8), with
    # the backend's count of graphed steps replayed, captured and run eagerly.
    # REAP_GEN=0 skips them (two more loads of the checkpoint).
    toks=$(python3 -c "print(','.join(str((i * 7919) % 150000 + 5) for i in range(1024)))")
    [ "${REAP_GEN:-1}" = 0 ] || run "$c/bin/glmspark" generate --backend cuda --kv-dtype fp8 --model "$dir" --tokens "$toks" \
        --max-tokens "${GEN_TOKENS:-64}" --ignore-eos 2>&1 >/dev/null | grep -o "decode: .*\|CUDA graphs: .*\|CUDA downloads: .*" \
        | sed "s/^/generate reap $cfg, 1 sequence, 1K prompt: /" | tee -a "$out/reap.log"
    [ "${REAP_GEN:-1}" = 0 ] || run "$c/bin/glmspark" generate --backend cuda --kv-dtype fp8 --model "$dir" --tokens "$toks" \
        --max-tokens "${GEN_TOKENS:-64}" --ignore-eos --n-seqs 8 2>&1 >/dev/null \
        | grep -o "[0-9]* sequences x .*\|decode with all .*\|CUDA graphs: .*\|CUDA downloads: .*" \
        | sed "s/^/generate reap $cfg, 8 sequences, 1K prompts: /" | tee -a "$out/reap.log"
    # The A/B settings after the serving path's runs (the targets first under a command's limit).
    for e in ${REAP_DECODE_ENVS:-}; do  # e.g. "GLMSPARK_CUDA_PDL=0 GLMSPARK_CUDA_FUSE=0"
        echo "== bench reap $cfg kv fp8 $e" | tee -a "$out/reap.log"
        run_setting "$e" bench --backend cuda --model "$dir" --batch "${REAP_BATCH:-1,8}" \
            --ctx 1024 --steps "${STEPS:-16}" --kv-dtype fp8 >>"$out/reap.log" 2>&1 \
            || { echo "bench reap $cfg $e failed"; status=1; }
        [ -z "${REAP_MTP:-}" ] || mtp_bench "$e"
    done
    if [ "${REAP_PROFILE:-1}" = 1 ]; then
        echo "== profile reap $cfg kv fp8 batch ${REAP_PROFILE_BATCH:-1}" | tee -a "$out/reap.log"
        GLMSPARK_CUDA_PROFILE=1 run "$c/bin/glmspark" bench --backend cuda --model "$dir" \
            --batch "${REAP_PROFILE_BATCH:-1}" \
            --ctx 1024 --steps 8 --kv-dtype fp8 >>"$out/reap.log" 2>&1 || status=1
    fi
    [ "${REAP_KEEP:-0}" = 1 ] || rm -rf "$dir" ${spill:+"$spill"}  # REAP_KEEP=1: for REAP_REUSE
done
[ -f "$out/bench.log" ] && grep -v "^\[\|INFO" "$out/bench.log"
[ -f "$out/reap.log" ] && grep -v "INFO" "$out/reap.log"
# Per MoE layer by difference (issue 18's figure): two REAP sizes with the same dense count,
# the same cache, recipe, batch and context, e.g. REAP="3:1 5:1".
[ -f "$out/reap.log" ] && python3 - "$out/reap.log" <<'PY'
import re, sys
runs, cur = {}, None
for line in open(sys.argv[1]):
    m = re.match(r"== bench reap (\d+):(\d+) kv (\S+)\s*$", line)
    if m:
        cur = m.groups()
        continue
    if line.startswith("=="):
        cur = None
    m = re.search(r"batch\s+(\d+) ctx\s+(\d+): .*decode\s+([\d.]+) ms/step", line)
    if cur and m:
        layers, dense, kv = cur
        runs[(int(dense), kv, int(m.group(1)), int(m.group(2)), int(layers))] = float(m.group(3))
for (dense, kv, b, ctx, l1), t1 in sorted(runs.items()):
    for (d2, kv2, b2, c2, l2), t2 in sorted(runs.items()):
        if (d2, kv2, b2, c2) == (dense, kv, b, ctx) and l2 > l1:
            print(f"per MoE layer, {kv} cache, batch {b}, ctx {ctx}: ({t2:.3f} - {t1:.3f} ms) "
                  f"/ {l2 - l1} = {1e3 * (t2 - t1) / (l2 - l1):.0f} us ({l1} and {l2} layers, {dense} dense)")
PY
exit $status
