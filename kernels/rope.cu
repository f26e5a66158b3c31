/*
 * rope.cu - interleaved RoPE: one thread per (token, pair), looping over heads so that the
 * double-precision sincos is paid once per (token, pair) rather than once per head.
 */
#include "kernels/rope.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"

// ---------------------------------------------------------------------------
// RoPE kernel

static __global__ void rope_interleaved_kernel(float *x, const int32_t *__restrict__ pos,
                                               int n_tok, int n_heads, int head_stride,
                                               int offset, int rot_dim, float theta)
{
    const int half = rot_dim / 2;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_tok * half) return;
    const int t = idx / half, i = idx % half;
    const double inv_freq = pow((double) theta, -2.0 * i / rot_dim);
    double s, c;
    sincos((double) pos[t] * inv_freq, &s, &c);
    const float sf = (float) s, cf = (float) c;
    for (int h = 0; h < n_heads; h++) {
        float *p = x + ((size_t) t * n_heads + h) * head_stride + offset + 2 * i;
        const float x0 = p[0], x1 = p[1];
        p[0] = x0 * cf - x1 * sf;
        p[1] = x1 * cf + x0 * sf;
    }
}

// ---------------------------------------------------------------------------
// Launchers

void rope_interleaved(float *x, const int32_t *pos, int n_tok, int n_heads, int head_stride,
                      int offset, int rot_dim, float theta, cudaStream_t stream)
{
    ASSERT(n_tok > 0 && n_heads > 0 && rot_dim > 0 && rot_dim % 2 == 0);
    ASSERT(offset >= 0 && offset + rot_dim <= head_stride && theta > 0.0f);
    const int n = n_tok * (rot_dim / 2);
    rope_interleaved_kernel<<<CEIL_DIV(n, 128), 128, 0, stream>>>(x, pos, n_tok, n_heads,
                                                                  head_stride, offset, rot_dim,
                                                                  theta);
    CUDA_CHECK(cudaGetLastError());
}
