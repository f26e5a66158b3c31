#!/bin/sh
# check_kernel_entry.sh SRCDIR - what programmatic dependent launch needs of kernels/
# (kernels/launch.cuh): every kernel's body starts with KERN_ENTRY(); or, in a kernel that
# prefetches its weights first, KERN_ENTRY_AFTER(name_prefetch(a, b, ...)); with plain
# parameters as arguments (the helper computes addresses from them; nothing of a kernel may read
# or write memory before it waits for the grid it depends on), and no kernel is launched with
# <<< >>> (kern_launch is the one way; a cluster launch calls cudaLaunchKernelEx itself).
# Prints each offence and exits 1 on any.
set -eu
cd "$1"
fail=0
kernels=0
for f in kernels/*.cu kernels/*.cuh; do
    out=$(awk -v f="$f" '
        /^[ \t]*(\/\/|\*)/ { next }                      # comment lines
        /<<</ { print f ":" FNR ": a <<< >>> launch (use kern_launch)" }
        /__global__/ { want = 1; line = FNR; next }
        want == 1 && /^\{[ \t]*$/ { want = 2; next }
        want == 2 && /^[ \t]*$/ { next }
        want == 2 {
            n++
            if ($0 !~ /^[ \t]*KERN_ENTRY\(\);[ \t]*$/ \
                && $0 !~ /^[ \t]*KERN_ENTRY_AFTER\([a-z0-9_]*_prefetch(<[A-Za-z0-9_]*>)?\([A-Za-z0-9_, ]*\)\);[ \t]*$/)
                print f ":" line ": a kernel whose first statement is not KERN_ENTRY(); or KERN_ENTRY_AFTER(..._prefetch(...));"
            want = 0
        }
        END { print "kernels " n }' "$f")
    n=$(echo "$out" | sed -n 's/^kernels //p')
    kernels=$((kernels + ${n:-0}))
    bad=$(echo "$out" | grep -v '^kernels ' || true)
    if [ -n "$bad" ]; then
        echo "$bad"
        fail=$((fail + $(echo "$bad" | wc -l)))
    fi
done
globals=$(grep -h '__global__' kernels/*.cu kernels/*.cuh | grep -cv '^[[:space:]]*\(//\|\*\)' || true)
if [ "$globals" -ne "$kernels" ]; then
    echo "kernels/: $globals __global__ functions but $kernels bodies checked (a body's { not on its own line?)"
    fail=$((fail + 1))
fi
echo "$kernels kernels checked, $fail offences"
[ "$fail" -eq 0 ]
