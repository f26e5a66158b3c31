/*
 * norm.cu - RMSNorm and LayerNorm: one block of 256 threads per row.
 *
 * Each thread strides over the row, accumulating fp32 partial sums; a warp butterfly and a
 * shared-memory pass over the 8 warp sums give the row statistic. LayerNorm takes two passes
 * (mean, then centred squares) to avoid the cancellation of E[x^2] - E[x]^2. Rows are at most
 * a few thousand elements, so they stay in L1 between passes.
 */
#include "kernels/norm.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"

enum { NORM_THREADS = 256 };

// ---------------------------------------------------------------------------
// Norm kernels

static __device__ float block_sum(float v, float *red)
{
    v = warp_sum(v);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    __syncthreads();  // red may still be read from a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_THREADS / WARP_SIZE; i++) s += red[i];
    return s;
}

static __global__ void norm_rms_kernel(uint16_t *__restrict__ out, const float *__restrict__ x,
                                       const float *__restrict__ w, float eps, int d,
                                       int x_stride, int out_stride)
{
    __shared__ float red[NORM_THREADS / WARP_SIZE];
    const float *xr = x + (size_t) blockIdx.x * x_stride;
    uint16_t *o = out + (size_t) blockIdx.x * out_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += NORM_THREADS) ss = fmaf(xr[i], xr[i], ss);
    const float inv = rsqrtf(block_sum(ss, red) / d + eps);
    for (int i = threadIdx.x; i < d; i += NORM_THREADS) o[i] = f32_to_bf16_bits(xr[i] * inv * w[i]);
}

static __global__ void norm_layer_kernel(uint16_t *__restrict__ out,
                                         const float *__restrict__ x,
                                         const float *__restrict__ w,
                                         const float *__restrict__ b, float eps, int d,
                                         int x_stride, int out_stride)
{
    __shared__ float red[NORM_THREADS / WARP_SIZE];
    const float *xr = x + (size_t) blockIdx.x * x_stride;
    uint16_t *o = out + (size_t) blockIdx.x * out_stride;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += NORM_THREADS) s += xr[i];
    const float mean = block_sum(s, red) / d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += NORM_THREADS) {
        const float c = xr[i] - mean;
        ss = fmaf(c, c, ss);
    }
    const float inv = rsqrtf(block_sum(ss, red) / d + eps);
    for (int i = threadIdx.x; i < d; i += NORM_THREADS)
        o[i] = f32_to_bf16_bits(fmaf((xr[i] - mean) * inv, w[i], b[i]));
}

// ---------------------------------------------------------------------------
// Launchers

void norm_rms(uint16_t *out, const float *x, const float *w, float eps, int n, int d,
              int x_stride, int out_stride, cudaStream_t stream)
{
    ASSERT(n > 0 && d > 0 && x_stride >= d && out_stride >= d && eps >= 0.0f);
    norm_rms_kernel<<<n, NORM_THREADS, 0, stream>>>(out, x, w, eps, d, x_stride, out_stride);
    CUDA_CHECK(cudaGetLastError());
}

void norm_layer(uint16_t *out, const float *x, const float *w, const float *b, float eps, int n,
                int d, int x_stride, int out_stride, cudaStream_t stream)
{
    ASSERT(n > 0 && d > 0 && x_stride >= d && out_stride >= d && eps >= 0.0f);
    norm_layer_kernel<<<n, NORM_THREADS, 0, stream>>>(out, x, w, b, eps, d, x_stride, out_stride);
    CUDA_CHECK(cudaGetLastError());
}
