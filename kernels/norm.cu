/*
 * norm.cu - RMSNorm and LayerNorm: one block of 256 threads per row.
 *
 * Each thread strides over the row (16-byte loads when the row allows, unrolled so that all
 * of a thread's loads are in flight at once; RMSNorm rows of up to 8,192 aligned values are
 * held in registers between the passes), accumulating double partial sums; a warp
 * butterfly and a shared-memory pass over the 8 warp sums give the row statistic, the same in
 * every thread. LayerNorm takes two passes (mean, then centred squares). Rows are at most a
 * few thousand elements, so they stay in L1 between passes. The statistics and the scaling
 * are the CPU backend's (engine/backend/backend_cpu.c) in double, so only the order of the
 * double sums differs from it.
 */
#include "kernels/norm.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/launch.cuh"
#include "kernels/norm_dev.cuh"

// ---------------------------------------------------------------------------
// Norm kernels

static __device__ __forceinline__ void store_norm(float *p, double v)
{
    *p = (float) v;
}

static __device__ __forceinline__ void store_norm(uint16_t *p, double v)
{
    *p = f32_to_bf16_bits((float) v);
}

// A row of at most NORM_REG_MAX values in 16-byte pieces (d % 4 == 0, x 16-byte aligned):
// each thread loads its pieces of x and w at once into registers, so the row costs one
// round trip to memory before the statistic instead of one per pass (a decode step's norms
// are one row each: latency, not bandwidth).
enum { NORM_REG = 8, NORM_REG_MAX = NORM_REG * 4 * NORM_THREADS };

static __device__ __forceinline__ void store_norm4(float *p, double a, double b, double c, double d)
{
    *(float4 *) p = make_float4((float) a, (float) b, (float) c, (float) d);
}

static __device__ __forceinline__ void store_norm4(uint16_t *p, double a, double b, double c,
                                                   double d)
{
    p[0] = f32_to_bf16_bits((float) a);
    p[1] = f32_to_bf16_bits((float) b);
    p[2] = f32_to_bf16_bits((float) c);
    p[3] = f32_to_bf16_bits((float) d);
}

template <typename OutT>
static __global__ void norm_rms_reg_kernel(OutT *out, const float *x, const float *__restrict__ w,
                                           float eps, int d, int x_stride, int out_stride)
{
    KERN_ENTRY();
    __shared__ double red[NORM_THREADS / WARP_SIZE];
    const float4 *xr = (const float4 *) (x + (size_t) blockIdx.x * x_stride);
    OutT *o = out + (size_t) blockIdx.x * out_stride;
    float4 xv[NORM_REG], wv[NORM_REG];
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < NORM_REG; j++) {
        const int i = threadIdx.x + j * NORM_THREADS;
        if (i < d / 4) {
            xv[j] = xr[i];
            wv[j] = ((const float4 *) w)[i];
        }
    }
#pragma unroll
    for (int j = 0; j < NORM_REG; j++)
        if (threadIdx.x + j * NORM_THREADS < d / 4)
            ss = norm_add4(ss, xv[j], norm_sq);
    const double inv = 1.0 / sqrt(norm_block_sum(ss, red) / d + eps);
#pragma unroll
    for (int j = 0; j < NORM_REG; j++) {
        const int i = threadIdx.x + j * NORM_THREADS;
        if (i < d / 4)
            store_norm4(o + 4 * i, norm_rms_value(xv[j].x, inv, wv[j].x),
                        norm_rms_value(xv[j].y, inv, wv[j].y), norm_rms_value(xv[j].z, inv, wv[j].z),
                        norm_rms_value(xv[j].w, inv, wv[j].w));
    }
}

// out may alias x (in place): every thread has read the whole row it needs before block_sum's
// barrier, and afterwards reads only the elements it writes.
template <typename OutT>
static __global__ void norm_rms_kernel(OutT *out, const float *x, const float *__restrict__ w,
                                       float eps, int d, int x_stride, int out_stride, bool vec)
{
    KERN_ENTRY();
    __shared__ double red[NORM_THREADS / WARP_SIZE];
    const float *xr = x + (size_t) blockIdx.x * x_stride;
    OutT *o = out + (size_t) blockIdx.x * out_stride;
    const double inv = norm_rms_inv(xr, d, vec, eps, red);
    for (int i = threadIdx.x; i < d; i += NORM_THREADS)
        store_norm(o + i, norm_rms_value(xr[i], inv, w[i]));
}

template <typename OutT>
static __global__ void norm_layer_kernel(OutT *out, const float *x, const float *__restrict__ w,
                                         const float *__restrict__ b, float eps, int d,
                                         int x_stride, int out_stride, bool vec)
{
    KERN_ENTRY();
    __shared__ double red[NORM_THREADS / WARP_SIZE];
    const float *xr = x + (size_t) blockIdx.x * x_stride;
    OutT *o = out + (size_t) blockIdx.x * out_stride;
    double mean;
    const double inv = norm_layer_inv(xr, d, vec, eps, red, &mean);
    for (int i = threadIdx.x; i < d; i += NORM_THREADS)
        store_norm(o + i, norm_layer_value(xr[i], mean, inv, w[i], b[i]));
}

// ---------------------------------------------------------------------------
// Launchers

template <typename OutT>
static void launch_rms(OutT *out, const float *x, const float *w, float eps, int n, int d,
                       int x_stride, int out_stride, cudaStream_t stream)
{
    ASSERT(n > 0 && d > 0 && x_stride >= d && out_stride >= d && eps >= 0.0f);
    const bool vec = norm_vec_rows(x, d, x_stride) && out_stride % 4 == 0 && (uintptr_t) out % 16 == 0
                     && (uintptr_t) w % 16 == 0;
    if (vec && d <= NORM_REG_MAX)
        kern_launch(norm_rms_reg_kernel<OutT>, n, NORM_THREADS, 0, stream, out, x, w, eps, d,
                    x_stride, out_stride);
    else
        kern_launch(norm_rms_kernel<OutT>, n, NORM_THREADS, 0, stream, out, x, w, eps, d, x_stride,
                    out_stride, norm_vec_rows(x, d, x_stride));
}

template <typename OutT>
static void launch_layer(OutT *out, const float *x, const float *w, const float *b, float eps,
                         int n, int d, int x_stride, int out_stride, cudaStream_t stream)
{
    ASSERT(n > 0 && d > 0 && x_stride >= d && out_stride >= d && eps >= 0.0f);
    kern_launch(norm_layer_kernel<OutT>, n, NORM_THREADS, 0, stream, out, x, w, b, eps, d, x_stride,
                out_stride, norm_vec_rows(x, d, x_stride));
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
