/*
 * backends.h - open a backend by kind: what `glmspark --backend cpu|cuda [--precision
 * f32|bf16]` and the recipe's `backend = cpu|cuda` choose.
 *
 * Ownership: *be is the caller's (destroy it with its destroy op).
 * Errors:    ERR_INVAL (logged) for cuda in a build without CUDA; the constructors' errors.
 */
#ifndef ENGINE_BACKEND_BACKENDS_H
#define ENGINE_BACKEND_BACKENDS_H

#include <stdbool.h>

#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

// Keep the backend's own precision recipe (backend.h: the CPU's f32, the CUDA one's bf16).
#define BACKEND_PRECISION_DEFAULT (-1)

// The CPU backend with n_threads threads, or (is_cuda) the CUDA backend on device gpu, with
// the precision recipe `precision` (a BackendPrecision, or BACKEND_PRECISION_DEFAULT).
// *be is NULL on failure.
Err backend_open(bool is_cuda, int n_threads, int gpu, int precision, Backend **be);

// "default" / "f32" / "bf16" -> BACKEND_PRECISION_DEFAULT / _F32 / _BF16 in *out (false for
// anything else), and back: the one spelling of the commands' --precision and the recipe's
// precision key.
bool backend_precision_parse(const char *s, int *out);
const char *backend_precision_name(int precision);

// What a command or the serving engine may ask of a backend kind, checked before opening it:
// the CUDA backend runs kernels/ only, so the bf16 recipe (precision F32 is the CPU
// reference's), bf16 or fp8 caches (its kernels read no f32 cache) in blocks of MLA_BLOCK
// (128) positions (the MLA kernels' pages). *kv_dtype: the cache type asked for, or (kv_set
// false) set to the kind's default (CPU f32, CUDA bf16); block_size: the cache's. false (the
// reason logged, naming `who`) for a combination the kind does not take.
bool backend_kind_check(const char *who, bool is_cuda, int precision, bool kv_set,
                        KvDtype *kv_dtype, int block_size);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_BACKEND_BACKENDS_H
