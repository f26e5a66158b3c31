#!/bin/bash
# apply-sysctl.sh - kernel settings for a glmspark node (replaces the reference deployment's
# scripts/apply_sysctl.sh). Persistent and idempotent: writes /etc/sysctl.d/99-glmspark.conf
# only when its content differs, then loads it with `sysctl -p`; prints the swap status and
# what to do when there is too little.
#
#   ops/apply-sysctl.sh [--root DIR] [--check]
#
# --root DIR   write under DIR (DIR/etc/sysctl.d/...) and apply nothing (packaging, tests)
# --check      change nothing: exit 0 when the file is current and the running kernel has
#              every value, 1 listing each difference
# GLMSPARK_MIN_SWAP_GB (64): the swap the guidance asks for.
set -euo pipefail
root=""
check=0
while [ $# -gt 0 ]; do
    case $1 in
    --root) [ $# -ge 2 ] || exit 2; root=$2; shift 2 ;;
    --check) check=1; shift ;;
    *) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done
file=$root/etc/sysctl.d/99-glmspark.conf
say() { echo "apply-sysctl: $*" >&2; }

# Unified memory (GB10): the GPU's memory is the page cache's memory. Each setting keeps the
# node reachable when memory runs short, which the reference deployment lost to OOM.
want='# 99-glmspark.conf - written by glmspark ops/apply-sysctl.sh; edits are overwritten.
# Keep 1 GiB free for the kernel, sshd and the OOM killer: a node that cannot allocate for
# them is a node that needs a power cycle.
vm.min_free_kbytes = 1048576
# Start background reclaim earlier (1% of memory) so allocations rarely stall.
vm.watermark_scale_factor = 100
# Prefer dropping page cache to swapping; swap is the emergency buffer, not working memory.
vm.swappiness = 10
# Reclaim dentries and inodes sooner.
vm.vfs_cache_pressure = 200
# Bound dirty page cache (logs, downloads) so writeback never holds gigabytes.
vm.dirty_background_bytes = 268435456
vm.dirty_bytes = 1073741824
# The OOM killer chooses by oom_score_adj (ops/oom-guard.sh, the units): never panic on OOM,
# never kill the allocating task blindly.
vm.panic_on_oom = 0
vm.oom_kill_allocating_task = 0
# A kernel crash reboots the node after 10 s instead of hanging until someone power-cycles it.
kernel.panic = 10
kernel.panic_on_oops = 1
# NCCL over TCP (NCCL_IB_DISABLE=1) between the nodes: large socket buffers.
net.core.rmem_max = 268435456
net.core.wmem_max = 268435456
net.ipv4.tcp_rmem = 4096 131072 268435456
net.ipv4.tcp_wmem = 4096 131072 268435456
net.core.netdev_max_backlog = 250000
# Notice dead peers (a crashed node) within about two minutes on idle connections.
net.ipv4.tcp_keepalive_time = 60
net.ipv4.tcp_keepalive_intvl = 10
net.ipv4.tcp_keepalive_probes = 6
'

differences=0
if [ -f "$file" ] && [ "$(cat "$file")" = "$(printf '%s' "$want")" ]; then
    file_current=1
else
    file_current=0
fi
if [ "$check" = 1 ]; then
    [ "$file_current" = 1 ] || { say "$file is missing or differs"; differences=1; }
    if [ -z "$root" ]; then
        while IFS= read -r line; do
            case $line in '#'* | '') continue ;; esac
            key=${line%% =*}
            value=${line#*= }
            live=$(sysctl -n "$key" 2>/dev/null | tr -s ' \t' ' ' || echo "?")
            if [ "$live" != "$value" ]; then say "$key is \"$live\", want \"$value\""; differences=1; fi
        done <<<"$want"
    fi
    [ "$differences" = 0 ] && say "current"
    exit "$differences"
fi

if [ "$file_current" = 1 ]; then
    say "$file unchanged"
else
    mkdir -p "$(dirname "$file")"
    printf '%s' "$want" >"$file.tmp"
    mv "$file.tmp" "$file"
    say "wrote $file"
fi
[ -n "$root" ] && exit 0

failed=0
sysctl -q -p "$file" >/dev/null 2>"/tmp/apply-sysctl.$$" || failed=1
if [ "$failed" = 1 ]; then
    say "some settings could not be applied (a container?):"
    sed 's/^/    /' "/tmp/apply-sysctl.$$" >&2
fi
rm -f "/tmp/apply-sysctl.$$"

# Swap guidance (the reference recommends 64 GB or more as the buffer during loading).
min_swap_gb=${GLMSPARK_MIN_SWAP_GB:-64}
swap_kb=$(awk '/^SwapTotal:/ {print $2}' /proc/meminfo)
swap_gb=$((swap_kb / 1048576))
if [ "$swap_gb" -lt "$min_swap_gb" ]; then
    say "swap is ${swap_gb} GiB; ${min_swap_gb} GiB or more is recommended. To add it:"
    cat >&2 <<EOS
    fallocate -l ${min_swap_gb}G /swapfile-glmspark && chmod 600 /swapfile-glmspark
    mkswap /swapfile-glmspark && swapon /swapfile-glmspark
    echo '/swapfile-glmspark none swap sw 0 0' >>/etc/fstab
EOS
else
    say "swap: ${swap_gb} GiB"
fi
exit "$failed"
