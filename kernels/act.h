/*
 * act.h - the engine's element-wise ops on fp32 activations: SwiGLU, the residual add, and
 * the bf16 cast.
 *
 * act_silu_mul: y[i] = SiLU(gate[i]) * up[i], SiLU(g) = g / (1 + exp(-g)) in double, one
 * rounding to fp32 (the CPU backend's formula, engine/backend/backend_cpu.c cpu_silu_mul). y may
 * alias gate or up (each element is read before it is written, by the same thread).
 * act_add: y[i] += x[i] in fp32 (round to nearest, no contraction).
 * act_repad: n fp32 matrices copied to another row and column count, zero-filled or cropped:
 * how a model narrower than the tuned kernels' widths reaches them (backend_cuda.cu).
 * act_embed: the embedding lookup, bf16 table rows widened to fp32 (exact).
 *
 * Ownership: borrowed pointers. Threads: thread-safe launchers. Errors: ASSERT on bad shapes;
 * CUDA failures fatal. Launchers never allocate and never synchronize.
 */
#ifndef KERNELS_ACT_H
#define KERNELS_ACT_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void act_silu_mul(float *y, const float *gate, const float *up, size_t n, cudaStream_t stream);

void act_add(float *y, const float *x, size_t n, cudaStream_t stream);

// out bf16 [n] = x fp32 [n], rounded to nearest even: the input of a kernel that reads bf16
// (moe.h's experts) from an fp32 op's output.
void act_to_bf16(uint16_t *out, const float *x, size_t n, cudaStream_t stream);

// dst fp32 [n, rows_d, cols_d] from src fp32 [n, rows_s, cols_s]: element (t, r, c) is src's
// where r < rows_s and c < cols_s, else 0 (exact copies). dst and src must not overlap.
void act_repad(float *dst, int rows_d, int cols_d, const float *src, int rows_s, int cols_s,
               size_t n, cudaStream_t stream);

// y fp32 [n, cols] = table bf16 [rows, cols] rows ids[t] (0 <= ids[t] < rows, checked by the
// caller on the host; a row outside is left unwritten).
void act_embed(float *y, const uint16_t *table, int rows, int cols, const int32_t *ids, int n,
               cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_ACT_H
