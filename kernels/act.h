/*
 * act.h - SwiGLU activation: out = SiLU(gate) * up; and fp32 activations rounded to bf16.
 *
 * gu fp32 [n, 2 * inter]: gate in columns [0, inter), up in [inter, 2 inter) (the order of a
 * fused gate_up projection). out bf16 [n, inter]. SiLU(g) = g / (1 + exp(-g)), in fp32; one
 * rounding to bf16.
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

void act_silu_mul(uint16_t *out, const float *gu, int n, int inter, cudaStream_t stream);

// out bf16 [n] = x fp32 [n], rounded to nearest even: the input of a kernel that reads bf16
// (moe.h's experts) from an fp32 op's output.
void act_to_bf16(uint16_t *out, const float *x, size_t n, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_ACT_H
