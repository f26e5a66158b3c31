/*
 * norm_ref.h - RMSNorm, LayerNorm, RoPE and SwiGLU references (kernels/norm.h, rope.h, act.h)
 * in double, without the final rounding (tests add that to the bound).
 *
 * Ownership: none; host pointers borrowed for the call. Threads: pure. Errors: none.
 */
#ifndef KERNELS_REF_NORM_REF_H
#define KERNELS_REF_NORM_REF_H

#include <stddef.h>
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

// In place, as rope.h: interleaved pairs in, halves out. inv_freq (rope_format.h) and the
// angle in fp32 as rope.h states, cos, sin and the rotation in double.
void rope_glm_ref(float *x, const int32_t *pos, int n_tok, int n_heads, int stride,
                  int head_stride, int offset, int rot_dim, float theta);

// y [n] = SiLU(gate) * up.
void act_silu_mul_ref(float *y, const float *gate, const float *up, size_t n);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_REF_NORM_REF_H
