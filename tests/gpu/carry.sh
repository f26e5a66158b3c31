# shellcheck shell=bash
# carry.sh - sourced by the GPU scripts whose binaries are built on the development machine
# and carried to the GPU machine (run_pp.sh, run_mtp.sh), which lacks the
# engine's build dependencies.
#   carry_pack DEST BIN...  copy the binaries to DEST/bin and every shared library they
#                           need to DEST/lib (carry_libs)
#   carry_libs LIBDIR FILE...  copy every shared library the files (programs, modules) need
#                           to LIBDIR, except glibc and the compiler runtime (the image's are
#                           newer), NCCL (218 MB; the image has its own) and the names
#                           matching a glob of CARRY_SKIP_LIBS (space-separated)
#   carry_env DEST          on the GPU machine: LD_LIBRARY_PATH for DEST/lib, the image's
#                           NCCL and the driver, and NVLink multicast off (on the lent GPU
#                           hosts it can take the host's GPUs out of service). The binaries run through
#                           the image's own loader, so `--pp` can re-execute itself.
#   carry_start DEST "BIN..." ARGS...  a carried script's opening, called with the script's
#                           arguments: `--pack BUILD` packs BUILD/bin/BIN... into DEST and
#                           exits; otherwise c (the carried folder: the first argument, or
#                           DEST), out ($OUT or ./gpu-out, created), tmp (removed at exit) and
#                           carry_env.
carry_pack() {
    dest=$1
    shift
    rm -rf "$dest" && mkdir -p "$dest/bin" "$dest/lib" || return 1
    cp "$@" "$dest/bin/" || return 1
    carry_libs "$dest/lib" "$dest"/bin/* || return 1
    du -sh "$dest"
}

carry_libs() {
    libdir=$1
    shift
    for f in "$@"; do ldd "$f" 2>/dev/null | awk '/=>/ {print $3}'; done | sort -u | while read -r l; do
        [ -n "$l" ] || continue
        n=$(basename "$l")
        case $n in
        libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | libresolv.so.* | ld-linux* \
            | libstdc++.so.* | libgcc_s.so.* | libnccl*) continue ;;
        esac
        skip=0
        for g in ${CARRY_SKIP_LIBS:-}; do
            # shellcheck disable=SC2254  # g is a glob on purpose
            case $n in $g) skip=1 ;; esac
        done
        [ $skip = 1 ] || cp -L "$l" "$libdir/" || return 1
    done
}

carry_env() {
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    nccl_dir=""
    for d in /usr/local/cuda/lib /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
        [ -e "$d/libnccl.so.2" ] && { nccl_dir=$d; break; }
    done
    [ -n "$nccl_dir" ] || nccl_dir=$(dirname "$(find /usr /opt -name 'libnccl.so.2' 2>/dev/null | head -1)" 2>/dev/null)
    export LD_LIBRARY_PATH="$1/lib:${nccl_dir:-.}:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}"
}

carry_start() {
    dest=$1
    bins=$2
    shift 2
    if [ "${1:-}" = "--pack" ]; then
        build=$2
        set --
        for b in $bins; do set -- "$@" "$build/bin/$b"; done
        carry_pack "$dest" "$@"
        exit
    fi
    c=${1:-$dest}
    out=${OUT:-$(pwd)/gpu-out}
    mkdir -p "$out"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    carry_env "$c"
}
