/*
 * act.cu - SwiGLU: one thread per output element; memory-bound and tiny at decode sizes.
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

// ---------------------------------------------------------------------------
// Launchers

void act_silu_mul(uint16_t *out, const float *gu, int n, int inter, cudaStream_t stream)
{
    ASSERT(n > 0 && inter > 0);
    const long total = (long) n * inter;
    act_silu_mul_kernel<<<(unsigned) CEIL_DIV(total, 256), 256, 0, stream>>>(out, gu, n, inter);
    CUDA_CHECK(cudaGetLastError());
}
