/*
 * backend_cuda.h - the CUDA backend: every op of backend.h on one GPU, fp32 activations.
 *
 * Built only with CUDA (GLMSPARK_HAVE_CUDA); backend_cuda.cu has the design. Weights are
 * copied to device memory in their stored format at bind_linear() and dequantized as the
 * kernels read them; the KV cache's pool is mirrored by a device pool of the same layout
 * (allocated on the first op that touches a cache), so kv_cache.c stays host-only.
 *
 * Ownership: backend_cuda_create() returns a Backend released with its destroy op, which
 *            frees every device allocation it made (weights, mirrored pools, scratch).
 * Threads:   one thread calls the ops (see backend.h); the device is selected on create.
 * Errors:    ERR_INVAL when there is no usable CUDA device (logged); ERR_NOMEM. A CUDA
 *            error inside an op is fatal (ops cannot fail).
 */
#ifndef ENGINE_BACKEND_CUDA_H
#define ENGINE_BACKEND_CUDA_H

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// The CUDA backend on device `device` (0-based). *out is NULL on failure.
Err backend_cuda_create(int device, Backend **out);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_BACKEND_CUDA_H
