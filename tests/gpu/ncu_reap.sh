#!/bin/sh
# ncu_reap.sh CARRY_DIR MODEL_DIR BATCH - per-kernel GPU time of one decode step of `glmspark
# bench --model` (graphs on), from Nsight Compute: two runs of 2 and 6 steps, the difference
# over 4 = one step's kernels by name (so the prefill and warm-up cancel). Prints µs per step
# for each kernel name with the DRAM bytes it read and their rate (GB/s: set them beside the
# copy bandwidth the bench prints), the sum, and the bench's own ms/step for the gap between
# the two. (ncu runs each kernel alone with its caches as the one before left them: a kernel's
# time here has no launch gap and no overlap with its neighbours.) NCU_FILTER=REGEX profiles only
# the kernels whose names match (e.g. "gemv|moe_w13_kernel": the decode step's, not the
# prefill's, so that a batch of 16 prompts does not spend the command's time under ncu).
set -u
c=$1; dir=$2; batch=$3; ctx=${CTX:-1024}
out=${OUT:-/tmp}
ncu=$(ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu"; exit 1; }
cublas=$(find /usr /opt -name 'libcublasLt.so.1[0-9]*' -path '*nvidia*' 2>/dev/null | head -1)
libpath="$c/lib:$(dirname "$cublas"):/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu"
for s in 2 6; do
    "$ncu" --metrics gpu__time_duration.sum,dram__bytes_read.sum --clock-control none --cache-control ${NCU_CACHE:-none} --csv --print-units base \
        ${NCU_FILTER:+--kernel-name "regex:$NCU_FILTER"} \
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
    agg = collections.defaultdict(lambda: [0.0, 0, 0.0])
    rows = [l for l in open(p) if l.startswith('"')]
    for r in csv.DictReader(rows):
        k = r["Kernel Name"][:70] + " " + r["Grid Size"]
        v = float(r["Metric Value"].replace(",", ""))
        if r.get("Metric Name") == "gpu__time_duration.sum":
            agg[k][0] += v; agg[k][1] += 1
        elif r.get("Metric Name") == "dram__bytes_read.sum":
            agg[k][2] += v
    return agg
a, b = load(sys.argv[1]), load(sys.argv[2])
tot = tot_b = 0.0; lines = []
for k in b:
    z = a.get(k, [0.0, 0, 0.0])
    d = (b[k][0] - z[0]) / 4 / 1000.0
    n = (b[k][1] - z[1]) / 4
    by = (b[k][2] - z[2]) / 4
    if n > 0: lines.append((d, n, by, k)); tot += d; tot_b += by
for d, n, by, k in sorted(lines, reverse=True):
    print("%9.1f us %6.1f launches %9.2f MB %7.0f GB/s  %s" % (d, n, by / 1e6, by / d / 1e3 if d > 0 else 0.0, k))
print("sum of kernel time per step: %.1f us, launches %.1f, DRAM read %.1f MB (%.0f GB/s over the kernels' time)"
      % (tot, sum(l[1] for l in lines), tot_b / 1e6, tot_b / tot / 1e3 if tot > 0 else 0.0))
PY
