#!/bin/sh
# run_mtp.sh [CARRY_DIR] - MTP speculative decoding on the CUDA backend, on the
# GPU machine: greedy `glmspark generate --backend cuda --mtp K` (K = 1..3) prints the same
# ids as the run without --mtp, on every golden model with an MTP layer (mtp_theta and the
# sweep's, with and without indexer tensors on the MTP layer) and the mkmodel "small" preset
# (hidden 1024, 12 layers, an MTP layer); `--n-seqs 2 --mtp K` (the scheduler: the last-stage
# drafting code of the pipeline, on one GPU); with two GPUs also `--pp 2 --mtp K` (the last rank
# drafts, the next micro-batch verifies; activations over NCCL, then over TCP with
# GLMSPARK_PP_DATA=tcp), against `--pp 2` without it. Decode tok/s and the acceptance
# counters go to the summary.
#
# The binaries are built on the development machine and carried as tests/gpu/run_pp.sh
# does (the image's own loader and glibc, LD_LIBRARY_PATH; NCCL from the image). Make
# CARRY_DIR (default .carry/mtp) with:
#   cmake -S . -B build-mtp-cuda -G Ninja -DWERROR=ON && ninja -C build-mtp-cuda glmspark
#   tests/gpu/run_mtp.sh --pack build-mtp-cuda
# Logs and summary.txt go to $OUT (or ./gpu-out). To check the script without a GPU:
# MTP_BACKEND=cpu MTP_NGPU=2 MTP_TOKENS=16.
set -u
cd "$(dirname "$0")/../.." || exit 1
. tests/gpu/carry.sh
carry_start .carry/mtp glmspark "$@"
g=$c/bin/glmspark
summary=$out/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
status=0
bad() { say "FAIL: $*"; status=1; }
ngpu=${MTP_NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c GPU)}
say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $ngpu GPUs"
"$g" mkmodel --out "$tmp/small" --preset small 2>"$out/mkmodel.log" || bad "mkmodel small"
toks=1,5,7,9,11,3,2,8,13,21,34,55,89,144,150,120  # below every model's vocabulary (192 at the smallest)
n=${MTP_TOKENS:-64}

# gen NAME MODEL ARGS...: greedy ids into $tmp/NAME.txt, log into $out/NAME.log.
gen() {
    name=$1
    model=$2
    shift 2
    timeout 120 "$g" generate --backend "${MTP_BACKEND:-cuda}" --model "$model" --tokens $toks --max-tokens $n \
        --temperature 0 --ignore-eos "$@" >"$tmp/$name.txt" 2>"$out/$name.log" \
        || { bad "$name: exit status $?"; tail -5 "$out/$name.log" | tee -a "$summary"; }
}
rate() { grep -o "decode: [0-9]* tokens in [0-9.]* s ([0-9.]* tok/s\|[0-9.]* tok/s aggregate" "$out/$1.log" | tail -1; }
accept() { grep -o "mtp [0-9]: .*" "$out/$1.log" | tail -1; }

golden_mtp=$(grep -l '"num_nextn_predict_layers": [1-9]' tests/golden/models/*/config.json \
    | xargs -n1 dirname | xargs -n1 basename)
for m in $golden_mtp small; do
    model=$tmp/$m
    [ $m = small ] || model=tests/golden/models/$m
    gen "$m.plain" "$model"
    say "$m plain: $(rate "$m.plain")"
    if [ "$ngpu" -ge 2 ]; then
        # The two-rank references: greedy --pp 2 without MTP, per data plane.
        for data in nccl tcp; do
            if [ $data = tcp ]; then export GLMSPARK_PP_DATA=tcp; else unset GLMSPARK_PP_DATA; fi
            gen "$m.pp2.$data.plain" "$model" --pp 2
            unset GLMSPARK_PP_DATA
            cmp -s "$tmp/$m.plain.txt" "$tmp/$m.pp2.$data.plain.txt" && r="equals" || r="DIFFERS from"
            say "$m --pp 2 ($data) plain: $r --pp 1; $(rate "$m.pp2.$data.plain")"
        done
    fi
    for k in 1 2 3; do
        gen "$m.mtp$k" "$model" --mtp $k
        if cmp -s "$tmp/$m.plain.txt" "$tmp/$m.mtp$k.txt" && [ -s "$tmp/$m.plain.txt" ]; then r=PASS; else
            r="FAIL ($(head -c 120 "$tmp/$m.mtp$k.txt") vs $(head -c 120 "$tmp/$m.plain.txt"))"
            status=1
        fi
        say "$m --mtp $k: $r; $(rate "$m.mtp$k"); $(accept "$m.mtp$k")"
        # The scheduler on one GPU: the pipeline's last-stage MTP code (mtp_stage_op), two
        # sequences at once; each line is the plain output.
        gen "$m.sched.mtp$k" "$model" --n-seqs 2 --mtp $k
        r=PASS
        for i in 1 2; do
            sed -n "${i}p" "$tmp/$m.sched.mtp$k.txt" | cmp -s - "$tmp/$m.plain.txt" || r=FAIL
        done
        [ $r = PASS ] || { status=1; r="FAIL ($(head -c 200 "$tmp/$m.sched.mtp$k.txt"))"; }
        say "$m --n-seqs 2 --mtp $k (scheduler, last-stage drafting): $r; $(rate "$m.sched.mtp$k"); $(accept "$m.sched.mtp$k")"
        [ "$ngpu" -ge 2 ] || continue
        for data in nccl tcp; do
            name=$m.pp2.$data.mtp$k
            if [ $data = tcp ]; then export GLMSPARK_PP_DATA=tcp; else unset GLMSPARK_PP_DATA; fi
            gen "$name" "$model" --pp 2 --mtp $k
            unset GLMSPARK_PP_DATA
            ref=$tmp/$m.pp2.$data.plain.txt
            if cmp -s "$ref" "$tmp/$name.txt" && [ -s "$ref" ]; then r=PASS; else
                r="FAIL ($(head -c 120 "$tmp/$name.txt") vs $(head -c 120 "$ref"))"
                status=1
            fi
            say "$m --pp 2 ($data) --mtp $k: $r; $(rate "$name"); $(accept "$name")"
        done
    done
done
say "status $status"
exit $status
