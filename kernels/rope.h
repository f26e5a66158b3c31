/*
 * rope.h - rotary position embedding, interleaved (GPT-J) pairs, in place.
 *
 * x fp32 [n_tok, n_heads, head_stride]; the rotated dims are x[t, h, offset .. offset+rot_dim).
 * Pair i (0 <= i < rot_dim/2) is (x[offset+2i], x[offset+2i+1]):
 *
 *   a = pos[t] * theta^(-2i/rot_dim)
 *   y[2i]   = x[2i] cos a - x[2i+1] sin a
 *   y[2i+1] = x[2i+1] cos a + x[2i] sin a
 *
 * This is GLM-5's layout for MLA and for the DSA indexer (transformers 5.17
 * modeling_glm_moe_dsa.py, rope_interleave). The angle and
 * its sine/cosine are computed in double so that positions up to 2^20 keep full fp32 accuracy;
 * the rotation itself is fp32.
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

// pos int32 [n_tok], device memory.
void rope_interleaved(float *x, const int32_t *pos, int n_tok, int n_heads, int head_stride,
                      int offset, int rot_dim, float theta, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_ROPE_H
