/*
 * rope.cu - the engine's RoPE (rope.h): a block per (token, group of ROPE_HEADS heads), a
 * thread per pair, which takes its pair's cos and sin once (in double: costly on GB10's FP64
 * units) for the group's heads; every thread reads its pairs before any thread writes, since
 * the output is de-interleaved.
 */
#include "kernels/rope.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/launch.cuh"
#include "kernels/rope_format.h"

enum { ROPE_HEADS = 8 };  // heads a block rotates: 8 blocks a token for MLA's 64 q heads

// ---------------------------------------------------------------------------
// RoPE kernel

// Block (t, g): heads g * ROPE_HEADS .. (at most n_heads); thread i < rot_dim / 2.
static __global__ void rope_glm_kernel(float *x, const int32_t *__restrict__ pos, int n_heads,
                                       int stride, int head_stride, int offset, int rot_dim,
                                       const __grid_constant__ RopeFreqs f)
{
    KERN_ENTRY();
    const int t = blockIdx.x, h0 = blockIdx.y * ROPE_HEADS, i = threadIdx.x, half = rot_dim / 2;
    const int nh = n_heads - h0 < ROPE_HEADS ? n_heads - h0 : ROPE_HEADS;
    float *v = x + (size_t) t * stride + (size_t) h0 * head_stride + offset;
    float a[ROPE_HEADS], b[ROPE_HEADS], cs = 0.0f, sn = 0.0f;
    if (i < half) {
        rope_cos_sin(pos[t], f.inv[i], &cs, &sn);
#pragma unroll
        for (int h = 0; h < ROPE_HEADS; h++)
            if (h < nh) {
                a[h] = v[(size_t) h * head_stride + 2 * i];
                b[h] = v[(size_t) h * head_stride + 2 * i + 1];
            }
    }
    __syncthreads();
    if (i < half) {
#pragma unroll
        for (int h = 0; h < ROPE_HEADS; h++)
            if (h < nh) {
                float *vh = v + (size_t) h * head_stride;
                rope_rotate(a[h], b[h], cs, sn, &vh[i], &vh[half + i]);
            }
    }
}

// ---------------------------------------------------------------------------
// Launchers

void rope_glm(float *x, const int32_t *pos, int n_tok, int n_heads, int stride, int head_stride,
              int offset, int rot_dim, float theta, cudaStream_t stream)
{
    ASSERT(rot_dim % 2 == 0 && rot_dim / 2 <= ROPE_MAX_PAIRS && offset >= 0 && theta > 0.0f);
    if (n_tok == 0 || n_heads == 0 || rot_dim == 0) return;
    const int groups = CEIL_DIV(n_heads, ROPE_HEADS);
    ASSERT(n_tok > 0 && n_heads > 0 && groups <= 65535);
    RopeFreqs f;
    rope_freqs(&f, rot_dim, theta);
    const int threads = CEIL_DIV(rot_dim / 2, 32) * 32;
    kern_launch(rope_glm_kernel, dim3((unsigned) n_tok, (unsigned) groups), threads, 0, stream, x,
                pos, n_heads, stride, head_stride, offset, rot_dim, f);
}
