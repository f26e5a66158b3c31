/*
 * backend_cuda.h - the CUDA backend: every op of backend.h on one GPU through kernels/, the
 * bf16 precision recipe (fp32 activations between ops, rounded to bf16 where the kernels
 * read them: engine/model/backend.h).
 *
 * Built only with CUDA (GLMSPARK_HAVE_CUDA); backend_cuda.cu has the design (and graphs:
 * graph_begin/graph_end, off with GLMSPARK_CUDA_GRAPHS=0). Dense weights are copied to
 * device memory in bf16 at bind_linear() (rounded once when stored otherwise), routed
 * experts stacked at bind_experts() as kernels/moe.h reads them; the KV cache's pool (bf16 or
 * fp8) is mirrored by a device pool of the same layout (allocated on the first op that
 * touches a cache), so kv_cache.c stays host-only.
 *
 * Ownership: backend_cuda_create() returns a Backend released with its destroy op, which
 *            frees every device allocation it made (weights, mirrored pools, scratch).
 * Threads:   one thread calls the ops (see backend.h); the device is selected on create.
 * Errors:    ERR_INVAL when there is no usable CUDA device (logged); ERR_NOMEM. A CUDA
 *            error inside an op is fatal (ops cannot fail).
 */
#ifndef ENGINE_BACKEND_BACKEND_CUDA_H
#define ENGINE_BACKEND_BACKEND_CUDA_H

#include "engine/model/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// The CUDA backend on device `device` (0-based). *out is NULL on failure.
Err backend_cuda_create(int device, Backend **out);

// Device-to-device copy bandwidth of be's GPU in GB/s (read + write bytes per second, best
// of 5 cudaMemcpy's of `bytes`), the ceiling `glmspark bench` reports against; 0 when the
// buffers do not fit (logged).
double backend_cuda_copy_gbs(Backend *be, size_t bytes);

// GLMSPARK_CUDA_PDL: kernels launch with programmatic dependent launch, but for graphed steps
// (decode batches: graph_begin) of more than this many tokens (unset: 1; 0: never); -1 when
// the value is not such a number (create refuses it).
int backend_cuda_pdl_tokens(void);

// Bytes of be's GPU in use now (cudaMemGetInfo: total - free, every process and the CUDA
// context included); *total gets the device's bytes.
size_t backend_cuda_mem_used(Backend *be, size_t *total);

// bf16 GEMM throughput of be's GPU in TFLOP/s through the backend's own cuBLASLt path
// (gemm_bf16_lt, fp32 output): best of 5 products [n, n] x [n, n]^T after a warm-up, the
// ceiling `glmspark bench` reports prefill against; 0 when the buffers do not fit (logged).
double backend_cuda_gemm_tflops(Backend *be, int n);

// With GLMSPARK_CUDA_PROFILE=1 in the environment at create (which turns graphs off), every op
// synchronizes and is timed: this prints the time per op kind since the last report to
// stderr under `title` (nothing when title is NULL) and starts counting again. A no-op
// without the variable.
void backend_cuda_profile_report(Backend *be, const char *title);

// The scores one pass of the DSA top-k holds: it scores a step's rows in passes of at most
// bytes / (4 * capacity) rows (at least one), so that a long prompt's chunk does not hold
// rows x positions scores at once. Default 256 MiB; tests lower it to make passes.
void backend_cuda_limit_dsa_scores(Backend *be, size_t bytes);

// Copy the device copy of kv's pool (kv->block_bytes * n_blocks bytes; zeros if the backend
// has not used kv yet) into host memory at dst: for tests that compare the bytes the two
// backends store. Synchronous.
void backend_cuda_kv_download(Backend *be, const KvCache *kv, void *dst);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_BACKEND_BACKEND_CUDA_H
