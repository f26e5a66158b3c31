/*
 * rope.h - rotary position embedding as GLM-5 applies it, in place: the engine's RoPE.
 *
 * x fp32 rows [n_tok] of stride `stride`, n_heads heads of head_stride floats each; the rotated
 * dims of a head are x[offset .. offset + rot_dim). They hold interleaved pairs (x[2i],
 * x[2i+1]) and are written back de-interleaved, first halves then second halves (transformers
 * 5.17 modeling_glm_moe_dsa.py, rope_interleave, followed by rotate_half):
 *
 *   inv_freq = 1 / theta^(2i / rot_dim), angle = pos[t] * inv_freq   (both fp32, as transformers)
 *   y[i]        = x[2i] cos(angle) - x[2i+1] sin(angle)
 *   y[half + i] = x[2i+1] cos(angle) + x[2i] sin(angle)
 *
 * inv_freq comes from kernels/rope_format.h, computed on the host at each launch (the CPU
 * backend's values, bit for bit); cos and sin of the fp32 angle are taken in double and rounded
 * to fp32; the rotation is fp32 without contraction into FMAs: the CPU backend's arithmetic
 * (engine/backend/backend_cpu.c cpu_rope), so the two differ at most where the device's double
 * cos/sin and the host's round differently to fp32.
 *
 * Ownership: borrowed pointers. Threads: thread-safe launchers. Errors: ASSERT on bad shapes;
 * CUDA failures fatal. Launchers never allocate and never synchronize.
 */
#ifndef KERNELS_ROPE_H
#define KERNELS_ROPE_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// pos int32 [n_tok], device memory. rot_dim even, at most 2 * ROPE_MAX_PAIRS.
void rope_glm(float *x, const int32_t *pos, int n_tok, int n_heads, int stride, int head_stride,
              int offset, int rot_dim, float theta, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_ROPE_H
