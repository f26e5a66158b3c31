/*
 * norm.cu - RMSNorm and LayerNorm: one block of 256 threads per row.
 *
 * Each thread strides over the row (16-byte loads when the row allows, unrolled so that all
 * of a thread's loads are in flight at once), accumulating double partial sums; a warp
 * butterfly and a shared-memory pass over the 8 warp sums give the row statistic, the same in
 * every thread. LayerNorm takes two passes (mean, then centred squares). Rows are at most a
 * few thousand elements, so they stay in L1 between passes. The statistics and the scaling
 * are the CPU backend's (engine/backend/backend_cpu.c) in double, so only the order of the
 * double sums differs from it.
 */
#include "kernels/norm.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"

enum { NORM_THREADS = 256 };

// ---------------------------------------------------------------------------
// Norm kernels

static __device__ double block_sum(double v, double *red)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    __syncthreads();  // red may still be read from a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < NORM_THREADS / WARP_SIZE; i++) s += red[i];
    return s;
}

static __device__ __forceinline__ void store_norm(float *p, double v)
{
    *p = (float) v;
}

static __device__ __forceinline__ void store_norm(uint16_t *p, double v)
{
    *p = f32_to_bf16_bits((float) v);
}

// Sum of f(x[i]) over the row; vec: d % 4 == 0 and x 16-byte aligned.
template <typename F>
static __device__ __forceinline__ double row_sum(const float *xr, int d, bool vec, F f)
{
    double s = 0.0;
    if (vec) {
#pragma unroll 8
        for (int i = threadIdx.x; i < d / 4; i += NORM_THREADS) {
            const float4 v = ((const float4 *) xr)[i];
            s += f(v.x) + f(v.y) + f(v.z) + f(v.w);
        }
    } else {
#pragma unroll 8
        for (int i = threadIdx.x; i < d; i += NORM_THREADS)
            s += f(xr[i]);
    }
    return s;
}

// out may alias x (in place): every thread has read the whole row it needs before block_sum's
// barrier, and afterwards reads only the elements it writes.
template <typename OutT>
static __global__ void norm_rms_kernel(OutT *out, const float *x, const float *__restrict__ w,
                                       float eps, int d, int x_stride, int out_stride, bool vec)
{
    __shared__ double red[NORM_THREADS / WARP_SIZE];
    const float *xr = x + (size_t) blockIdx.x * x_stride;
    OutT *o = out + (size_t) blockIdx.x * out_stride;
    const double ss = row_sum(xr, d, vec, [](float v) { return (double) v * v; });
    const double inv = 1.0 / sqrt(block_sum(ss, red) / d + eps);
    for (int i = threadIdx.x; i < d; i += NORM_THREADS)
        store_norm(o + i, w[i] * (xr[i] * inv));
}

template <typename OutT>
static __global__ void norm_layer_kernel(OutT *out, const float *x, const float *__restrict__ w,
                                         const float *__restrict__ b, float eps, int d,
                                         int x_stride, int out_stride, bool vec)
{
    __shared__ double red[NORM_THREADS / WARP_SIZE];
    const float *xr = x + (size_t) blockIdx.x * x_stride;
    OutT *o = out + (size_t) blockIdx.x * out_stride;
    const double mean = block_sum(row_sum(xr, d, vec, [](float v) { return (double) v; }), red) / d;
    const double var =
        row_sum(xr, d, vec, [mean](float v) { return ((double) v - mean) * ((double) v - mean); });
    const double inv = 1.0 / sqrt(block_sum(var, red) / d + eps);
    for (int i = threadIdx.x; i < d; i += NORM_THREADS)
        store_norm(o + i, (xr[i] - mean) * inv * w[i] + b[i]);
}

// ---------------------------------------------------------------------------
// Launchers

static bool vec_rows(const float *x, int d, int x_stride)
{
    return d % 4 == 0 && x_stride % 4 == 0 && (uintptr_t) x % 16 == 0;
}

template <typename OutT>
static void launch_rms(OutT *out, const float *x, const float *w, float eps, int n, int d,
                       int x_stride, int out_stride, cudaStream_t stream)
{
    ASSERT(n > 0 && d > 0 && x_stride >= d && out_stride >= d && eps >= 0.0f);
    norm_rms_kernel<OutT><<<n, NORM_THREADS, 0, stream>>>(out, x, w, eps, d, x_stride, out_stride,
                                                          vec_rows(x, d, x_stride));
    CUDA_CHECK(cudaGetLastError());
}

template <typename OutT>
static void launch_layer(OutT *out, const float *x, const float *w, const float *b, float eps,
                         int n, int d, int x_stride, int out_stride, cudaStream_t stream)
{
    ASSERT(n > 0 && d > 0 && x_stride >= d && out_stride >= d && eps >= 0.0f);
    norm_layer_kernel<OutT><<<n, NORM_THREADS, 0, stream>>>(out, x, w, b, eps, d, x_stride,
                                                            out_stride, vec_rows(x, d, x_stride));
    CUDA_CHECK(cudaGetLastError());
}

void norm_rms(uint16_t *out, const float *x, const float *w, float eps, int n, int d, int x_stride,
              int out_stride, cudaStream_t stream)
{
    launch_rms(out, x, w, eps, n, d, x_stride, out_stride, stream);
}

void norm_layer(uint16_t *out, const float *x, const float *w, const float *b, float eps, int n,
                int d, int x_stride, int out_stride, cudaStream_t stream)
{
    launch_layer(out, x, w, b, eps, n, d, x_stride, out_stride, stream);
}

void norm_rms_f32(float *out, const float *x, const float *w, float eps, int n, int d, int x_stride,
                  int out_stride, cudaStream_t stream)
{
    launch_rms(out, x, w, eps, n, d, x_stride, out_stride, stream);
}

void norm_layer_f32(float *out, const float *x, const float *w, const float *b, float eps, int n,
                    int d, int x_stride, int out_stride, cudaStream_t stream)
{
    launch_layer(out, x, w, b, eps, n, d, x_stride, out_stride, stream);
}
