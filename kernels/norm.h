/*
 * norm.h - RMSNorm and LayerNorm (with bias) over the last dimension.
 *
 * Layouts: x fp32 [n, d] with row stride x_stride (elements); out bf16 (or fp32: the _f32
 * launchers) [n, d] with row stride out_stride; w, b fp32 [d] (converted from the checkpoint's
 * bf16 at load time).
 *
 *   rms:   out = x * rsqrt(mean(x^2) + eps) * w
 *   layer: out = (x - mean(x)) * rsqrt(var(x) + eps) * w + b,  var = mean((x-mean)^2)
 *
 * Numerics: statistics and scaling in double (the CPU backend's formulas, backend_cpu.c),
 * sums over a fixed block-wide tree, so results are reproducible; one rounding to the output
 * type at the end. Strides let q_a and the c_kv slice of kv_a be normalized in place of a
 * fused projection output; out may equal x (in place, same strides).
 *
 * Ownership: borrowed pointers. Threads: thread-safe launchers. Errors: ASSERT on bad shapes;
 * CUDA failures fatal. Launchers never allocate and never synchronize.
 */
#ifndef KERNELS_NORM_H
#define KERNELS_NORM_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void norm_rms(uint16_t *out, const float *x, const float *w, float eps, int n, int d,
              int x_stride, int out_stride, cudaStream_t stream);

void norm_layer(uint16_t *out, const float *x, const float *w, const float *b, float eps, int n,
                int d, int x_stride, int out_stride, cudaStream_t stream);

// fp32 outputs (the residual stream's precision): the CUDA backend's rmsnorm and layernorm.
void norm_rms_f32(float *out, const float *x, const float *w, float eps, int n, int d, int x_stride,
                  int out_stride, cudaStream_t stream);

void norm_layer_f32(float *out, const float *x, const float *w, const float *b, float eps, int n,
                    int d, int x_stride, int out_stride, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_NORM_H
