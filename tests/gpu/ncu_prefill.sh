#!/bin/sh
# ncu_prefill.sh CARRY_DIR MODEL_DIR - what bounds the prefill kernels, from Nsight Compute:
# one launch each of the tensor-core MLA (mla_tc_kernel) and the wide expert kernels
# (moe_w13_wide_kernel, moe_w2_wide_kernel) in the second 4,096-token call of an 8K prompt
# through `glmspark bench --model` (the first call's attention is shorter), with the sections
# that say why: speed of light, compute and memory workload, warp states (the stall reasons),
# scheduler statistics, occupancy, launch statistics. Prints each kernel's key lines; the full
# reports go to $OUT/ncu-prefill-*.txt. CTX (default 8192) and SKIP_MLA / SKIP_MOE (launches of
# the kernel to skip; defaults: past the first call of a 5-layer model, 1 dense + 4 MoE) adapt
# it to other checkpoints. KERNELS="NAME:SKIP ..." (regexes of kernel names, launches to skip)
# with STEPS and BATCH takes decode kernels instead, e.g. CTX=1024 STEPS=8
# KERNELS="gemv_group:30 moe_route_rank:20 moe_w13_kernel:20" (a 5-layer model's prefill and
# first decode steps skipped; `ncu_reap.sh` lists a step's kernels), or a long prompt's indexer:
# CTX=131072 KERNELS="dsa_scores_tc:60 dsa_topk_kernel:60" (docs/perf.md run 23e).
set -u
c=$1; dir=$2; ctx=${CTX:-8192}
out=${OUT:-/tmp}
ncu=$(ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu"; exit 1; }
cublas=$(find /usr /opt -name 'libcublasLt.so.1[0-9]*' -path '*nvidia*' 2>/dev/null | head -1)
libpath="$c/lib:$(dirname "$cublas"):/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu"
# mla_tc_kernel runs once per 256-token chunk and layer: 16 x 5 in the first 4,096-token call.
for k in ${KERNELS:-"mla_tc_kernel:${SKIP_MLA:-88}" "moe_w13_wide_kernel:${SKIP_MOE:-5}" \
         "moe_w2_wide_kernel:${SKIP_MOE:-5}"}; do
    name=${k%%:*}; skip=${k#*:}
    rep="$out/ncu-prefill-$name.txt"
    "$ncu" --kernel-name "regex:$name" --launch-skip "$skip" --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats --metrics \
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
        --page details --print-units base \
        "$c/lib/ld-linux-x86-64.so.2" --library-path "$libpath" "$c/bin/glmspark" bench \
        --backend cuda --model "$dir" --batch "${BATCH:-1}" --ctx "$ctx" --steps "${STEPS:-1}" --kv-dtype fp8 \
        >"$rep" 2>&1 || { echo "ncu $name failed"; tail -5 "$rep"; continue; }
    echo "== $name (launch $((skip + 1)))"
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|\
Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issue Slots Busy|\
Warp Cycles Per Issued|No Eligible|Dynamic Shared Memory Per Block|hmma_cycles|pipe_lsu|bank_conflicts|\
Executed Ipc Active|Stall|stall" "$rep" | sed 's/  */ /g' | head -40
done
