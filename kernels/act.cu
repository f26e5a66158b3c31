/*
 * act.cu - SwiGLU, the residual add and the bf16 cast: grid-stride loops, one element a
 * thread a step; memory-bound and tiny at decode sizes.
 */
#include "kernels/act.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/launch.cuh"

enum { ACT_THREADS = 256, ACT_MAX_BLOCKS = 65535 };

// ---------------------------------------------------------------------------
// Element-wise kernels

static __global__ void act_silu_mul_kernel(float *y, const float *gate, const float *up, size_t n)
{
    KERN_ENTRY();
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n;
         i += (size_t) gridDim.x * blockDim.x) {
        y[i] = silu_mul_value(gate[i], up[i]);
    }
}

static __global__ void act_add_kernel(float *y, const float *__restrict__ x, size_t n)
{
    KERN_ENTRY();
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n;
         i += (size_t) gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

static __global__ void act_to_bf16_kernel(uint16_t *__restrict__ out, const float *__restrict__ x,
                                          size_t n)
{
    KERN_ENTRY();
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n;
         i += (size_t) gridDim.x * blockDim.x)
        out[i] = f32_to_bf16_bits(x[i]);
}

static __global__ void act_repad_kernel(float *__restrict__ dst, int rows_d, int cols_d,
                                        const float *__restrict__ src, int rows_s, int cols_s,
                                        size_t total)
{
    KERN_ENTRY();
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < total;
         i += (size_t) gridDim.x * blockDim.x) {
        const size_t per = (size_t) rows_d * cols_d, t = i / per;
        const int r = (int) (i % per / cols_d), c = (int) (i % cols_d);
        dst[i] = r < rows_s && c < cols_s ? src[(t * rows_s + r) * cols_s + c] : 0.0f;
    }
}

// ---------------------------------------------------------------------------
// Launchers

static unsigned act_blocks(size_t n)
{
    const size_t b = CEIL_DIV(n, (size_t) ACT_THREADS);
    return (unsigned) (b < (size_t) ACT_MAX_BLOCKS ? b : (size_t) ACT_MAX_BLOCKS);
}

void act_silu_mul(float *y, const float *gate, const float *up, size_t n, cudaStream_t stream)
{
    if (n == 0) return;
    kern_launch(act_silu_mul_kernel, act_blocks(n), ACT_THREADS, 0, stream, y, gate, up, n);
}

void act_add(float *y, const float *x, size_t n, cudaStream_t stream)
{
    if (n == 0) return;
    kern_launch(act_add_kernel, act_blocks(n), ACT_THREADS, 0, stream, y, x, n);
}

void act_to_bf16(uint16_t *out, const float *x, size_t n, cudaStream_t stream)
{
    if (n == 0) return;
    kern_launch(act_to_bf16_kernel, act_blocks(n), ACT_THREADS, 0, stream, out, x, n);
}

void act_repad(float *dst, int rows_d, int cols_d, const float *src, int rows_s, int cols_s,
               size_t n, cudaStream_t stream)
{
    ASSERT(rows_d > 0 && cols_d > 0 && rows_s > 0 && cols_s > 0);
    const size_t total = n * (size_t) rows_d * (size_t) cols_d;
    if (total == 0) return;
    kern_launch(act_repad_kernel, act_blocks(total), ACT_THREADS, 0, stream, dst, rows_d, cols_d,
                src, rows_s, cols_s, total);
}

// A row's 16-byte pieces (8 values; vec: cols % 8 == 0 and both rows 16-byte aligned) are
// loaded EMBED_UNROLL at a time before any is stored, so one row costs a few memory latencies
// rather than one per 2-byte load.
enum { EMBED_UNROLL = 4 };

static __global__ void act_embed_kernel(float *__restrict__ y, const uint16_t *__restrict__ table,
                                        int rows, int cols, const int32_t *__restrict__ ids,
                                        bool vec)
{
    KERN_ENTRY();
    const int t = blockIdx.x, id = ids[t];
    if (id < 0 || id >= rows) return;
    const uint16_t *row = table + (size_t) id * (size_t) cols;
    float *out = y + (size_t) t * cols;
    if (!vec) {
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            out[c] = __uint_as_float((uint32_t) row[c] << 16);
        return;
    }
    const int n = cols / 8;
    for (int c0 = threadIdx.x; c0 < n; c0 += EMBED_UNROLL * blockDim.x) {
        uint4 v[EMBED_UNROLL];
#pragma unroll
        for (int u = 0; u < EMBED_UNROLL; u++) {
            const int c = c0 + u * blockDim.x;
            v[u] = c < n ? __ldg((const uint4 *) row + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < EMBED_UNROLL; u++) {
            const int c = c0 + u * blockDim.x;
            if (c >= n) break;
            const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
            float4 *o = (float4 *) (out + 8 * (size_t) c);
            o[0] = make_float4(__uint_as_float(w[0] << 16), __uint_as_float(w[0] & 0xffff0000u),
                               __uint_as_float(w[1] << 16), __uint_as_float(w[1] & 0xffff0000u));
            o[1] = make_float4(__uint_as_float(w[2] << 16), __uint_as_float(w[2] & 0xffff0000u),
                               __uint_as_float(w[3] << 16), __uint_as_float(w[3] & 0xffff0000u));
        }
    }
}

void act_embed(float *y, const uint16_t *table, int rows, int cols, const int32_t *ids, int n,
               cudaStream_t stream)
{
    ASSERT(rows > 0 && cols > 0 && n >= 0);
    if (n == 0) return;
    const bool vec = cols % 8 == 0 && (uintptr_t) table % 16 == 0 && (uintptr_t) y % 16 == 0;
    kern_launch(act_embed_kernel, (unsigned) n, ACT_THREADS, 0, stream, y, table, rows, cols, ids,
                vec);
}
