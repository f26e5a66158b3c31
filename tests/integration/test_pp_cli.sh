#!/bin/sh
# test_pp_cli.sh BIN_DIR SOURCE_DIR - the CPU pipeline end to end through `glmspark`:
#   1. `logits --pp 2/3` writes the same file as `--pp 1` (byte for byte) on a golden model
#      (DSA, MoE, NVFP4) and on the mkmodel "tiny" preset; with `--kv-dtype fp8` too, where
#      decode also equals prefill;
#   2. `generate --pp 2/3` prints the same ids as `--pp 1` (sampling with penalties);
#   3. killing rank 1 mid-run makes the whole command exit non-zero within 10 s, rank 0
#      names the failed rank, and no process of the pipeline is left.
# shellcheck source=tests/integration/cli_test.sh
. "$(dirname "$0")/cli_test.sh"

golden=$src/tests/golden/models/dsa_modelopt
"$bin" mkmodel --out "$tmp/tiny" --preset tiny 2>/dev/null
"$bin" mkmodel --out "$tmp/default" --preset default 2>/dev/null

for model in "$golden" "$tmp/tiny"; do
    for pp in 1 2 3; do
        "$bin" logits --model "$model" --tokens 1,5,7,9,11,3,2,8 --out "$tmp/l$pp.f32" \
            --threads 1 --pp $pp 2>"$tmp/log" || { cat "$tmp/log"; fail "logits --pp $pp"; }
    done
    cmp "$tmp/l1.f32" "$tmp/l2.f32" || fail "logits --pp 2 differs from --pp 1 on $model"
    cmp "$tmp/l1.f32" "$tmp/l3.f32" || fail "logits --pp 3 differs from --pp 1 on $model"
    echo "ok: logits --pp 1/2/3 identical on $(basename "$model")"
done

# 1b. An fp8 KV cache (engine/model/kv_cache.h): --pp 3 writes the same logits as --pp 1,
# decoding token by token equals the prefill (--decode-check), and the logits are not the
# f32 cache's (the cache really is quantized).
for pp in 1 3; do
    "$bin" logits --model "$golden" --tokens 1,5,7,9,11,3,2,8 --out "$tmp/f8_$pp.f32" \
        --threads 1 --pp $pp --kv-dtype fp8 --decode-check 2>"$tmp/log" \
        || { cat "$tmp/log"; fail "logits --kv-dtype fp8 --pp $pp"; }
done
cmp "$tmp/f8_1.f32" "$tmp/f8_3.f32" || fail "logits --kv-dtype fp8: --pp 3 differs from --pp 1"
"$bin" logits --model "$golden" --tokens 1,5,7,9,11,3,2,8 --out "$tmp/f32.f32" --threads 1 \
    2>/dev/null || fail "logits (f32 cache)"
! cmp -s "$tmp/f8_1.f32" "$tmp/f32.f32" || fail "logits --kv-dtype fp8 equal the f32 cache's"
echo "ok: logits --kv-dtype fp8: --pp 1/3 identical, decode equals prefill"
# --decode-out: the one-token steps' logits in the prefill file's layout; with an f32 cache
# (exact) they are the prefill's byte for byte.
"$bin" logits --model "$golden" --tokens 1,5,7,9,11,3,2,8 --out "$tmp/pre.f32" \
    --decode-out "$tmp/dec.f32" --threads 1 2>"$tmp/log" || { cat "$tmp/log"; fail "logits --decode-out"; }
cmp "$tmp/pre.f32" "$tmp/dec.f32" || fail "logits --decode-out differs from the prefill with an f32 cache"
echo "ok: logits --decode-out equals the prefill's logits (f32 cache)"

for pp in 1 2 3; do
    "$bin" generate --model "$tmp/default" --tokens 1,5,7,9 --max-tokens 24 --temperature 0.8 \
        --seed 11 --repetition-penalty 1.2 --ignore-eos --threads 1 --pp $pp \
        >"$tmp/g$pp.txt" 2>"$tmp/log" || { cat "$tmp/log"; fail "generate --pp $pp"; }
done
[ -s "$tmp/g1.txt" ] || fail "generate printed nothing"
cmp "$tmp/g1.txt" "$tmp/g2.txt" || fail "generate --pp 2 differs: $(cat "$tmp/g1.txt") vs $(cat "$tmp/g2.txt")"
cmp "$tmp/g1.txt" "$tmp/g3.txt" || fail "generate --pp 3 differs"
echo "ok: generate --pp 1/2/3 identical: $(cat "$tmp/g1.txt")"

# 2b. Several sequences at once through the scheduler (--n-seqs): each line equals the
# sequence generated alone with seed + i, on one rank and on three.
for pp in 1 3; do
    "$bin" generate --model "$tmp/default" --tokens 1,5,7,9 --max-tokens 12 --temperature 0.9 \
        --seed 4 --n-seqs 3 --ignore-eos --threads 1 --pp $pp >"$tmp/n$pp.txt" 2>"$tmp/log" \
        || { cat "$tmp/log"; fail "generate --n-seqs 3 --pp $pp"; }
done
cmp "$tmp/n1.txt" "$tmp/n3.txt" || fail "--n-seqs 3: --pp 3 differs from --pp 1"
for i in 0 1 2; do
    "$bin" generate --model "$tmp/default" --tokens 1,5,7,9 --max-tokens 12 --temperature 0.9 \
        --seed $((4 + i)) --ignore-eos --threads 1 >"$tmp/alone.txt" 2>/dev/null
    sed -n "$((i + 1))p" "$tmp/n3.txt" | cmp - "$tmp/alone.txt" \
        || fail "--n-seqs: sequence $i differs from its run alone"
done
echo "ok: generate --n-seqs 3 (scheduler) equals each sequence alone, --pp 1 and 3"

# 2c. Sequences taking turns (--max-seqs 2 of --n-seqs 4): 2 and 3 join as 0 and 1 end, so a
# batch of the same size holds other sequences; each line still equals its run alone.
"$bin" generate --model "$tmp/default" --tokens 1,5,7,9 --max-tokens 12 --temperature 0.9 \
    --seed 4 --n-seqs 4 --max-seqs 2 --ignore-eos --threads 1 >"$tmp/turns.txt" 2>"$tmp/log" \
    || { cat "$tmp/log"; fail "generate --n-seqs 4 --max-seqs 2"; }
[ "$(wc -l <"$tmp/turns.txt")" -eq 4 ] || fail "--max-seqs 2: $(wc -l <"$tmp/turns.txt") lines"
head -3 "$tmp/turns.txt" | cmp - "$tmp/n1.txt" || fail "--max-seqs 2: sequences 0-2 differ from --n-seqs 3"
"$bin" generate --model "$tmp/default" --tokens 1,5,7,9 --max-tokens 12 --temperature 0.9 \
    --seed 7 --ignore-eos --threads 1 >"$tmp/alone.txt" 2>/dev/null
sed -n 4p "$tmp/turns.txt" | cmp - "$tmp/alone.txt" || fail "--max-seqs 2: sequence 3 differs from its run alone"
echo "ok: generate --n-seqs 4 --max-seqs 2 (sequences taking turns) equals each sequence alone"

# long_run R LOG: a long `generate --pp 3` in the background (stderr into LOG), waited for
# until every rank has loaded and then 1.5 s into decoding; sets launcher (its pid), rank
# (rank R's pid) and pgid (the pipeline's process group).
long_run() {
    "$bin" generate --model "$tmp/default" --tokens 1,5,7,9 --max-tokens 30000 --ignore-eos \
        --threads 1 --pp 3 >/dev/null 2>"$2" &
    launcher=$!
    rank=""
    i=0
    while [ -z "$rank" ] && [ $i -lt 100 ]; do
        sleep 0.1
        i=$((i + 1))
        for p in $(ps -o pid= --ppid $launcher 2>/dev/null); do
            if tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "--rank $1 "; then rank=$p; fi
        done
    done
    [ -n "$rank" ] || { kill $launcher; fail "rank $1 never started"; }
    # Past loading and the handshake (slow under sanitizers): every rank has logged its layers.
    i=0
    while [ "$(grep -c "pipeline rank . of 3: layers" "$2")" -lt 3 ] && [ $i -lt 600 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    pgid=$(ps -o pgid= -p "$rank" | tr -d ' ')
    sleep 1.5  # well into decoding
}

# expect_stopped WHAT LOG PATTERN: after WHAT happened to a rank at $t0, the launcher exits
# non-zero within 10 s, LOG has a line matching PATTERN (the rank named), and no process of
# the pipeline's group is left.
expect_stopped() {
    status=0
    wait $launcher || status=$?
    elapsed=$(awk "BEGIN { print $(date +%s.%N) - $t0 }")
    echo "pipeline exited with status $status $elapsed s after $1"
    [ $status -ne 0 ] || fail "the pipeline exited 0 after $1"
    awk "BEGIN { exit !($elapsed < 10) }" || fail "took $elapsed s (limit 10 s)"
    grep -q "$3" "$2" || { cat "$2"; fail "no message naming the rank: $3"; }
    left=$(ps -o pid= -g "$pgid" 2>/dev/null || true)
    [ -z "$left" ] || fail "processes left in the pipeline's group: $left"
}

# 3. Kill rank 1 of a long run.
long_run 1 "$tmp/kill.log"
rank0=$(ps -o pid= --ppid $launcher | head -1 | tr -d ' ')
kill -KILL "$rank"
t0=$(date +%s.%N)
expect_stopped "rank 1 was killed" "$tmp/kill.log" "rank 1 (.*) failed"
echo "ok: killing rank 1 stopped every rank (group $pgid, rank 0 pid $rank0) with:"
grep "failed" "$tmp/kill.log" | head -3

# 4. A hung rank (SIGSTOP: alive, silent) once the pipeline runs: the heartbeat timeout
# catches it. (A rank that hangs before the handshake is caught by the 60 s join timeout,
# PP_COMM_CONNECT_MS, which has to allow for loading a large model.)
long_run 2 "$tmp/hang.log"
kill -STOP "$rank"
t0=$(date +%s.%N)
expect_stopped "rank 2 was stopped" "$tmp/hang.log" "rank 2 (.*) failed: no heartbeat"
echo "ok: a hung rank 2 was detected and every rank stopped:"
grep "failed" "$tmp/hang.log" | head -3
echo "all pipeline CLI checks passed"
