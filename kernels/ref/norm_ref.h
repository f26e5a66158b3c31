/*
 * norm_ref.h - RMSNorm, LayerNorm, interleaved RoPE and SwiGLU references (kernels/norm.h,
 * rope.h, act.h) in double, without the final bf16 rounding (tests add that to the bound).
 *
 * Ownership: none; host pointers borrowed for the call. Threads: pure. Errors: none.
 */
#ifndef KERNELS_REF_NORM_REF_H
#define KERNELS_REF_NORM_REF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// out [n, d] = x * rsqrt(mean(x^2) + eps) * w; x [n, d] with row stride x_stride.
void norm_rms_ref(float *out, const float *x, const float *w, float eps, int n, int d,
                  int x_stride);

// out [n, d] = (x - mean) * rsqrt(var + eps) * w + b.
void norm_layer_ref(float *out, const float *x, const float *w, const float *b, float eps, int n,
                    int d, int x_stride);

// In place on x [n_tok, n_heads, head_stride], dims [offset, offset + rot_dim), as rope.h.
void rope_interleaved_ref(float *x, const int32_t *pos, int n_tok, int n_heads, int head_stride,
                          int offset, int rot_dim, float theta);

// out [n, inter] = SiLU(gu[:, :inter]) * gu[:, inter:].
void act_silu_mul_ref(float *out, const float *gu, int n, int inter);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_REF_NORM_REF_H
