#!/bin/sh
# run_pp.sh [CARRY_DIR] - the pipeline on two GPUs, on the nvidia-h200-x2 machine:
#   1. activation hop latency (pp_hop): NCCL over NVLink, NCCL over sockets
#      (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1), and the TCP data plane (GLMSPARK_PP_DATA=tcp);
#   2. `glmspark logits --backend cuda --pp 2` against `--pp 1` (max abs difference) on a
#      golden model and the mkmodel "small" preset, over NVLink, sockets and TCP; greedy
#      `generate` identical; NCCL_DEBUG=INFO shows the transport NCCL chose;
#   3. kill -9 of rank 1, then of rank 0, mid-decode: the command exits non-zero, the log
#      names the failed rank, and the seconds from the kill to the last rank's exit;
#   4. `generate --backend cuda --n-seqs S` for S = 1, 2, 4, 8: aggregate tok/s with --pp 1
#      and --pp 2 (NVLink, sockets).
#
# The GPU image lacks the engine's build dependencies, so the binaries are built on the
# development machine and carried (tests/gpu/carry.sh), as tests/gpu/run_backend.sh does, but
# run through the image's own loader and glibc with LD_LIBRARY_PATH (the `--pp` launcher
# re-executes /proc/self/exe, which must be glmspark itself, not a loader). NCCL (218 MB) does
# not travel: the image's own libnccl.so.2 is used. Make CARRY_DIR (default .carry/ppgpu) with:
#   cmake -S . -B build-ppgpu -G Ninja -DWERROR=ON && ninja -C build-ppgpu glmspark pp_hop
#   tests/gpu/run_pp.sh --pack build-ppgpu
# To check the script on a machine without GPUs: LOCAL=1 PP_BACKEND=cpu PP_PRESET=default
# PP_TOKENS=16 (no hop benchmark; everything else on CPU ranks over TCP, smaller). Logs and
# a summary go to $OUT (or ./gpu-out).
set -u
cd "$(dirname "$0")/../.." || exit 1
. tests/gpu/carry.sh
carry_start .carry/ppgpu "glmspark pp_hop" "$@"
g=$c/bin/glmspark
be=${PP_BACKEND:-cuda}
steps=${PP_STEPS:-1234}  # which of the four parts to run
preset=${PP_PRESET:-small}
ntok=${PP_TOKENS:-256}
summary=$out/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
status=0
bad() { say "FAIL: $*"; status=1; }
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), $ngpu GPUs, $(nproc) cores, libnccl from ${nccl_dir:-nowhere}"
nvidia-smi topo -m >"$out/topo.txt" 2>&1 && head -4 "$out/topo.txt"
[ "$ngpu" -ge 2 ] || [ "${LOCAL:-0}" = 1 ] || { say "needs 2 GPUs"; exit 1; }
"$g" --help >/dev/null 2>&1 || "$g" 2>&1 | grep -q -i usage || { say "glmspark does not start:"; ldd "$g" | grep "not found" | tee -a "$summary"; exit 1; }

# Transports: name and the environment that selects it.
transports="nvlink: socket:NCCL_P2P_DISABLE=1,NCCL_SHM_DISABLE=1 tcp:GLMSPARK_PP_DATA=tcp"
hop_transports="$transports nvlink-nonblocking:NCCL_COMM_BLOCKING=0"
with_env() {  # with_env "A=1,B=2" command...
    e=$1
    shift
    env $(echo "$e" | tr ',' ' ') "$@"
}

# 1. Hop latency
if [ "${LOCAL:-0}" != 1 ] && [ "${steps#*1}" != "$steps" ]; then
    say "== 1. activation hop (ping-pong, half a round trip; GLM-5 decode message: 6144 f32 + DSA state per row)"
    port=29650
    for t in $hop_transports; do
        name=${t%%:*}
        e=${t#*:}
        port=$((port + 1))
        with_env "$e" "$c/bin/pp_hop" --rank 1 --world 2 --master 127.0.0.1:$port \
            >"$out/hop_$name.r1.log" 2>&1 &
        r1=$!
        if with_env "$e" timeout 60 "$c/bin/pp_hop" --rank 0 --world 2 \
            --master 127.0.0.1:$port >"$tmp/hop.txt" 2>"$out/hop_$name.r0.log"; then :; else
            bad "pp_hop $name"
            cat "$out/hop_$name.r0.log" | tail -5
        fi
        wait $r1 || bad "pp_hop $name rank 1"
        sed "s/^/$name /" "$tmp/hop.txt" | tee -a "$summary"
    done
fi

# Models: a golden model (5 layers: DSA full + shared, MoE, NVFP4) and mkmodel "small"
# (hidden 1024, 12 layers, 32 experts: about 300 MB).
t0=$(date +%s)
"$g" mkmodel --out "$tmp/$preset" --preset $preset 2>"$out/mkmodel.log" || bad "mkmodel $preset"
say "mkmodel $preset: $(( $(date +%s) - t0 )) s"
golden=tests/golden/models/dsa_modelopt
toks=1,5,7,9,11,3,2,8,13,21,34,55,89,144,233,200  # below every vocabulary size

# 2. logits and greedy generate, --pp 2 vs --pp 1
[ "${steps#*2}" != "$steps" ] && {
say "== 2. logits --backend $be: --pp 2 vs --pp 1 (max abs difference)"
maxdiff() {
    python3 -c "
import sys, array
a, b = array.array('f'), array.array('f')
a.frombytes(open(sys.argv[1], 'rb').read()); b.frombytes(open(sys.argv[2], 'rb').read())
print('size mismatch' if len(a) != len(b) or not a else '%.3g' % max(abs(x - y) for x, y in zip(a, b)))" "$1" "$2"
}
for model in "$golden" "$tmp/$preset"; do
    m=$(basename "$model")
    "$g" logits --backend $be --model "$model" --tokens $toks --out "$tmp/$m.pp1.f32" \
        2>"$out/logits_$m.pp1.log" || bad "logits $m --pp 1"
    for t in $transports; do
        name=${t%%:*}
        e=${t#*:}
        with_env "$e" timeout 120 "$g" logits --backend $be --model "$model" --tokens $toks \
            --out "$tmp/$m.$name.f32" --pp 2 2>"$out/logits_$m.$name.log" || bad "logits $m --pp 2 $name"
        d=$(maxdiff "$tmp/$m.pp1.f32" "$tmp/$m.$name.f32")
        say "logits $m --pp 2 ($name): max abs diff vs --pp 1 = $d"
        case $d in 0 | [0-9]*e-0[6-9] | [0-9]*e-[1-9][0-9]) ;; *) bad "logits $m $name differ: $d" ;; esac
        if [ "$be" = cuda ]; then
            plane=$(grep -h -o "NCCL data plane on GPU [0-9]*\|activations over TCP" "$out/logits_$m.$name.log" | sort -u | tr '\n' ' ')
            say "  data plane: $plane"
            case $name:$plane in tcp:*TCP* | nvlink:*NCCL* | socket:*NCCL*) ;; *) bad "$name ran on '$plane'" ;; esac
        fi
    done
    want=$("$g" generate --backend $be --model "$model" --tokens 1,5,7,9 --max-tokens 32 \
        --temperature 0 --ignore-eos 2>"$out/gen_$m.pp1.log")
    for t in $transports; do
        name=${t%%:*}
        e=${t#*:}
        got=$(with_env "$e" timeout 120 "$g" generate --backend $be --model "$model" --tokens 1,5,7,9 \
            --max-tokens 32 --temperature 0 --ignore-eos --pp 2 2>"$out/gen_$m.$name.log")
        if [ -n "$want" ] && [ "$got" = "$want" ]; then say "generate $m --pp 2 ($name): greedy 32 tokens identical"; else
            bad "generate $m --pp 2 ($name): '$got' vs '$want'"
        fi
    done
done
# Which transport NCCL picked (NCCL_DEBUG=INFO), NVLink and sockets.
for t in $transports; do
    name=${t%%:*}
    e=${t#*:}
    [ "$name" = tcp ] && continue
    with_env "$e" env NCCL_DEBUG=INFO timeout 120 "$g" logits --backend $be --model "$golden" \
        --tokens $toks --out "$tmp/x.f32" --pp 2 >"$out/nccl_info_$name.log" 2>&1 || bad "NCCL_DEBUG run $name"
    say "NCCL ($name): $(grep -m1 -o 'NCCL version [^ ]*' "$out/nccl_info_$name.log") $(grep -o 'via [A-Za-z0-9/]*' "$out/nccl_info_$name.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
done

}

# 3. kill -9 of one rank mid-decode
[ "${steps#*3}" != "$steps" ] && {
say "== 3. kill -9 of one rank mid-decode (generate --backend $be --pp 2, $preset)"
for victim in 1 0; do
    "$g" generate --backend $be --model "$tmp/$preset" --tokens 1,5,7,9 --max-tokens 30000 \
        --ignore-eos --pp 2 >/dev/null 2>"$out/kill_rank$victim.log" &
    launcher=$!
    i=0
    while [ "$(grep -c "pipeline rank . of 2: layers" "$out/kill_rank$victim.log")" -lt 2 ] && [ $i -lt 600 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    sleep 3  # well into decoding
    pid=""
    for p in $(ps -o pid= --ppid $launcher 2>/dev/null); do
        if tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "--rank $victim "; then pid=$p; fi
    done
    pgid=$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')
    [ -n "$pid" ] || { bad "rank $victim never started"; kill $launcher; continue; }
    kill -KILL "$pid"
    k0=$(date +%s.%N)
    st=0
    wait $launcher || st=$?
    el=$(awk "BEGIN { printf \"%.2f\", $(date +%s.%N) - $k0 }")
    left=$(ps -o pid= -g "$pgid" 2>/dev/null | tr -d ' ' | tr '\n' ' ')
    msg=$(grep -m1 "failed" "$out/kill_rank$victim.log")
    say "kill -9 rank $victim: exit status $st after $el s; left: '${left}'; message: $msg"
    [ "$st" -ne 0 ] || bad "exit status 0 after killing rank $victim"
    awk "BEGIN { exit !($el < 10) }" || bad "took $el s"
    [ -z "$left" ] || bad "processes left: $left"
    echo "$msg" | grep -q "rank $victim (.*) failed" || bad "no message naming rank $victim"
done

}

# 4. Throughput: aggregate tok/s, S sequences of $ntok tokens each, 4-token prompt
[ "${steps#*4}" != "$steps" ] && {
say "== 4. generate --backend $be --n-seqs S, $preset preset, $ntok tokens per sequence: aggregate tok/s"
say "$(printf '%-10s %8s %8s %8s %8s' config S=1 S=2 S=4 S=8)"
for cfg in ${PP_BENCH:-pp1 nvlink socket tcp}; do
    line=$(printf '%-10s' "$cfg")
    for S in 1 2 4 8; do
        pp=2
        e=""
        case $cfg in pp1) pp=1 ;; nvlink) ;; socket) e=NCCL_P2P_DISABLE=1,NCCL_SHM_DISABLE=1 ;; tcp) e=GLMSPARK_PP_DATA=tcp ;; esac
        with_env "$e" timeout 120 "$g" generate --backend $be --model "$tmp/$preset" --tokens 1,5,7,9 \
            --max-tokens $ntok --ignore-eos --temperature 0 --n-seqs $S --pp $pp \
            >"$tmp/gen.txt" 2>"$out/bench_${cfg}_$S.log" || bad "bench $cfg S=$S"
        # --n-seqs 1 has no scheduler line: one sequence reports decode tok/s instead.
        r=$(grep -o '[0-9.]* tok/s aggregate' "$out/bench_${cfg}_$S.log" | head -1 | cut -d' ' -f1)
        [ -n "$r" ] || r=$(grep -o 'decode: [0-9]* tokens in [0-9.]* s ([0-9.]* tok/s' "$out/bench_${cfg}_$S.log" | sed 's/.*(\([0-9.]*\) tok.*/\1/')
        line="$line $(printf '%8s' "${r:-?}")"
    done
    say "$line"
done
}
say "== done: status $status"
# At most 8 files come back from the machine: every log in one archive, beside the summary.
(cd "$out" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt ./*.log ./*.txt 2>/dev/null \
    && find . -name '*.log' -delete && rm -f topo.txt)
exit $status
