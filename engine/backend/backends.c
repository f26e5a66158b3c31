/*
 * backends.c - open a backend by kind (backends.h).
 */
#include "engine/backend/backends.h"

#include <stddef.h>
#include <string.h>

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
    if (!err && precision != BACKEND_PRECISION_DEFAULT)
        (*be)->precision = (BackendPrecision) precision;
    return err;
}
