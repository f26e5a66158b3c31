/*
 * act.cu - SwiGLU and the bf16 cast: one thread per output element; memory-bound and tiny at
 * decode sizes.
 */
#include "kernels/act.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"

// ---------------------------------------------------------------------------
// Activation kernel

static __global__ void act_silu_mul_kernel(uint16_t *__restrict__ out,
                                           const float *__restrict__ gu, int n, int inter)
{
    const long i = (long) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long) n * inter) return;
    const long t = i / inter, j = i % inter;
    const float g = gu[t * 2 * inter + j], u = gu[t * 2 * inter + inter + j];
    out[i] = f32_to_bf16_bits(g / (1.0f + expf(-g)) * u);
}

static __global__ void act_to_bf16_kernel(uint16_t *__restrict__ out, const float *__restrict__ x,
                                          size_t n)
{
    const size_t i = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16_bits(x[i]);
}

// ---------------------------------------------------------------------------
// Launchers

void act_silu_mul(uint16_t *out, const float *gu, int n, int inter, cudaStream_t stream)
{
    ASSERT(n > 0 && inter > 0);
    const long total = (long) n * inter;
    act_silu_mul_kernel<<<(unsigned) CEIL_DIV(total, 256), 256, 0, stream>>>(out, gu, n, inter);
    CUDA_CHECK(cudaGetLastError());
}

void act_to_bf16(uint16_t *out, const float *x, size_t n, cudaStream_t stream)
{
    if (n == 0) return;
    ASSERT(CEIL_DIV(n, 256) <= 0x7fffffff);
    act_to_bf16_kernel<<<(unsigned) CEIL_DIV(n, 256), 256, 0, stream>>>(out, x, n);
    CUDA_CHECK(cudaGetLastError());
}
