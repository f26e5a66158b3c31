/*
 * backends.c - open a backend by kind (backends.h).
 */
#include "engine/backend/backends.h"

#include <stddef.h>

#ifdef GLMSPARK_HAVE_CUDA
#include "engine/backend/backend_cuda.h"
#endif

Err backend_open(bool is_cuda, int n_threads, int gpu, Backend **be)
{
    if (!is_cuda) return backend_cpu_create(n_threads, be);
#ifdef GLMSPARK_HAVE_CUDA
    return backend_cuda_create(gpu, be);
#else
    (void) gpu;
    *be = NULL;
    LOG_ERROR("backend cuda: this build has no CUDA (nvcc was not found when it was configured)");
    return ERR_INVAL;
#endif
}
