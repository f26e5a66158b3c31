#!/bin/sh
# ncu_reap.sh CARRY_DIR MODEL_DIR BATCH - per-kernel GPU time of one decode step of `glmspark
# bench --model` (graphs on), from Nsight Compute: two runs of 2 and 6 steps, the difference
# over 4 = one step's kernels by name (so the prefill and warm-up cancel). Prints µs per step
# for each kernel name, the sum, and the bench's own ms/step for the gap between the two.
set -u
c=$1; dir=$2; batch=$3; ctx=${CTX:-1024}
out=${OUT:-/tmp}
ncu=$(ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu"; exit 1; }
cublas=$(find /usr /opt -name 'libcublasLt.so.1[0-9]*' -path '*nvidia*' 2>/dev/null | head -1)
libpath="$c/lib:$(dirname "$cublas"):/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu"
for s in 2 6; do
    "$ncu" --metrics gpu__time_duration.sum --clock-control none --cache-control ${NCU_CACHE:-none} --csv --print-units base \
        --log-file "$out/ncu-b$batch-s$s.csv" \
        "$c/lib/ld-linux-x86-64.so.2" --library-path "$libpath" "$c/bin/glmspark" bench \
        --backend cuda --model "$dir" --batch "$batch" --ctx "$ctx" --steps $s --kv-dtype fp8 \
        ${BENCH_ARGS:-} >"$out/ncu-b$batch-s$s.log" 2>&1 || { echo "ncu run failed"; tail "$out/ncu-b$batch-s$s.log"; }
done
[ -n "${NO_BENCH:-}" ] || "$c/lib/ld-linux-x86-64.so.2" --library-path "$libpath" "$c/bin/glmspark" bench --backend cuda \
    --model "$dir" --batch "$batch" --ctx "$ctx" --steps 16 --kv-dtype fp8 ${BENCH_ARGS:-} 2>&1 | grep -v INFO
python3 - "$out/ncu-b$batch-s2.csv" "$out/ncu-b$batch-s6.csv" <<'PY'
import csv, sys, collections
def load(p):
    agg = collections.defaultdict(lambda: [0.0, 0])
    rows = [l for l in open(p) if l.startswith('"')]
    for r in csv.DictReader(rows):
        if r.get("Metric Name") != "gpu__time_duration.sum": continue
        k = r["Kernel Name"][:70] + " " + r["Grid Size"]
        agg[k][0] += float(r["Metric Value"].replace(",", "")); agg[k][1] += 1
    return agg
a, b = load(sys.argv[1]), load(sys.argv[2])
tot = 0.0; lines = []
for k in b:
    d = (b[k][0] - a.get(k, [0, 0])[0]) / 4 / 1000.0
    n = (b[k][1] - a.get(k, [0, 0])[1]) / 4
    if n > 0: lines.append((d, n, k)); tot += d
for d, n, k in sorted(lines, reverse=True):
    print("%9.1f us %6.1f launches  %s" % (d, n, k))
print("sum of kernel time per step: %.1f us, launches %.1f" % (tot, sum(l[1] for l in lines)))
PY
