/*
 * rope.cu - the engine's RoPE (rope.h): a block per (token, head), a thread per pair; each
 * thread reads its pair before any thread writes, since the output is de-interleaved.
 */
#include "kernels/rope.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/rope_format.h"

// ---------------------------------------------------------------------------
// RoPE kernel

// Block (t, h), thread i < rot_dim / 2.
static __global__ void rope_glm_kernel(float *x, const int32_t *__restrict__ pos, int stride,
                                       int head_stride, int offset, int rot_dim,
                                       const __grid_constant__ RopeFreqs f)
{
    const int t = blockIdx.x, h = blockIdx.y, i = threadIdx.x, half = rot_dim / 2;
    float *v = x + (size_t) t * stride + (size_t) h * head_stride + offset;
    float a = 0.0f, b = 0.0f, cs = 0.0f, sn = 0.0f;
    if (i < half) {
        rope_cos_sin(pos[t], f.inv[i], &cs, &sn);
        a = v[2 * i];
        b = v[2 * i + 1];
    }
    __syncthreads();
    if (i < half) rope_rotate(a, b, cs, sn, &v[i], &v[half + i]);
}

// ---------------------------------------------------------------------------
// Launchers

void rope_glm(float *x, const int32_t *pos, int n_tok, int n_heads, int stride, int head_stride,
              int offset, int rot_dim, float theta, cudaStream_t stream)
{
    ASSERT(rot_dim % 2 == 0 && rot_dim / 2 <= ROPE_MAX_PAIRS && offset >= 0 && theta > 0.0f);
    if (n_tok == 0 || n_heads == 0 || rot_dim == 0) return;
    ASSERT(n_tok > 0 && n_heads > 0 && n_heads <= 65535);
    RopeFreqs f;
    rope_freqs(&f, rot_dim, theta);
    const int threads = CEIL_DIV(rot_dim / 2, 32) * 32;
    rope_glm_kernel<<<dim3((unsigned) n_tok, (unsigned) n_heads), threads, 0, stream>>>(
        x, pos, stride, head_stride, offset, rot_dim, f);
    CUDA_CHECK(cudaGetLastError());
}
