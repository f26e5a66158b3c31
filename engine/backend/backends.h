/*
 * backends.h - open a backend by kind: what `glmspark --backend cpu|cuda` and the recipe's
 * `backend = cpu|cuda` both choose.
 *
 * Ownership: *be is the caller's (destroy it with its destroy op).
 * Errors:    ERR_INVAL (logged) for cuda in a build without CUDA; the constructors' errors.
 */
#ifndef ENGINE_BACKEND_BACKENDS_H
#define ENGINE_BACKEND_BACKENDS_H

#include <stdbool.h>

#include "engine/model/backend.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

// The CPU backend with n_threads threads, or (is_cuda) the CUDA backend on device gpu.
// *be is NULL on failure.
Err backend_open(bool is_cuda, int n_threads, int gpu, Backend **be);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_BACKEND_BACKENDS_H
