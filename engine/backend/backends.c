/*
 * backends.c - open a backend by kind (backends.h).
 */
#include "engine/backend/backends.h"

#include <stddef.h>
#include <string.h>

#include "engine/shared/err.h"

#ifdef GLMSPARK_HAVE_CUDA
#include "engine/backend/backend_cuda.h"
#endif

bool backend_precision_parse(const char *s, int *out)
{
    if (strcmp(s, "default") == 0)
        *out = BACKEND_PRECISION_DEFAULT;
    else if (strcmp(s, "f32") == 0)
        *out = BACKEND_PRECISION_F32;
    else if (strcmp(s, "bf16") == 0)
        *out = BACKEND_PRECISION_BF16;
    else
        return false;
    return true;
}

const char *backend_precision_name(int precision)
{
    return precision == BACKEND_PRECISION_DEFAULT ? "default"
           : precision == BACKEND_PRECISION_BF16  ? "bf16"
                                                  : "f32";
}

bool backend_kind_check(const char *who, bool is_cuda, int precision, bool kv_set,
                        KvDtype *kv_dtype, int block_size)
{
    if (!kv_set) *kv_dtype = is_cuda ? KV_DTYPE_BF16 : KV_DTYPE_F32;
    if (!is_cuda) return true;
    if (precision == BACKEND_PRECISION_F32) {
        LOG_ERROR("%s: the CUDA backend runs the bf16 precision recipe of kernels/ only "
                  "(docs/precision.md); the f32 recipe is the CPU reference's (--backend cpu)",
                  who);
        return false;
    }
    if (*kv_dtype == KV_DTYPE_F32) {
        LOG_ERROR("%s: the CUDA backend's KV cache is bf16 or fp8 (its kernels read no f32 "
                  "cache); an f32 cache is the CPU reference's (--backend cpu)",
                  who);
        return false;
    }
    if (block_size != MLA_BLOCK) {
        LOG_ERROR("%s: the CUDA backend's KV cache is in blocks of %d positions (its MLA "
                  "kernels' pages), not %d",
                  who, MLA_BLOCK, block_size);
        return false;
    }
    return true;
}

Err backend_open(bool is_cuda, int n_threads, int gpu, int precision, Backend **be)
{
    Err err;
    if (!is_cuda) {
        err = backend_cpu_create(n_threads, be);
    } else {
#ifdef GLMSPARK_HAVE_CUDA
        err = backend_cuda_create(gpu, be);
#else
        (void) gpu;
        *be = NULL;
        LOG_ERROR("backend cuda: this build has no CUDA (nvcc was not found when it was "
                  "configured)");
        return ERR_INVAL;
#endif
    }
    if (!err && precision != BACKEND_PRECISION_DEFAULT) {
        if ((*be)->kernels && precision != BACKEND_PRECISION_BF16) {
            LOG_ERROR("the %s backend runs the bf16 precision recipe only (docs/precision.md)",
                      (*be)->name);
            (*be)->destroy(*be);
            *be = NULL;
            return ERR_INVAL;
        }
        (*be)->precision = (BackendPrecision) precision;
    }
    return err;
}
