#!/bin/sh
# check_symbols.sh LIBDIR - every exported symbol of each module library (one per engine/
# folder, kernels, kernels_ref, fcgi_core) starts with one of that module's prefixes, so a
# forgotten `static` or a name without its module's prefix fails. Prints offenders and
# exits 1.
set -eu
libdir=$1
fail=0 checked=0
check() {  # check LIBNAME REGEX
    lib="$libdir/lib$1.a"
    [ -f "$lib" ] || return 0
    checked=$((checked + 1))
    # __odr_asan.NAME: AddressSanitizer's marker beside every instrumented global NAME
    bad=$(nm -g --defined-only "$lib" 2>/dev/null | awk 'NF==3 && $2 ~ /[TDBRVW]/ {print $3}' \
          | grep -v '^__odr_asan\.' | grep -Ev "$2" || true)
    if [ -n "$bad" ]; then
        echo "lib$1.a exports names without a module prefix:"
        echo "$bad" | sed 's/^/  /'
        fail=1
    fi
}
check glmspark_shared '^(err_|log_|buf_|tok_|chat_|utf8_|apikey_|stats_|jgram_|thread_pool_)'
check engine_model '^(ckpt_|config_|model_|kv_|sampler_)'
check engine_backend '^(backend_)'
check engine_pipeline '^(pp_|sched_|mtp_)'
check engine_serve '^(serve_|jobq_|recipe_|constrain_)'
check engine_tools '^(mkmodel_)'
check engine_cli '^(cli_)'
check kernels '^(nvfp4_|mla_|moe_|dsa_|norm_|rope_|sample_|kern_|cuda_backend_|gemm_|attn_|embed_|act_|kv_)'
check kernels_ref '^(nvfp4_|mla_|moe_|dsa_|norm_|rope_|sample_|kern_|gemm_|attn_|embed_|act_)'
check fcgi_core '^(api_)'
[ "$checked" -gt 0 ] || { echo "no module libraries found in $libdir"; exit 1; }
[ "$fail" -eq 0 ] && echo "1 passed, 0 failed" || echo "0 passed, 1 failed"
exit $fail
