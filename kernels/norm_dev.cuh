/*
 * norm_dev.cuh - the row statistics of kernels/norm.cu as device functions for a block of
 * NORM_THREADS threads, so that a kernel that normalizes a row on the way (kernels/kv.cu's
 * cache write) computes exactly the numbers norm.cu's kernels compute: each thread sums its
 * elements (16-byte pieces when vec, in order), in double; a warp butterfly and the 8 warp sums
 * in warp order give the statistic, the same in every thread.
 *
 * Ownership: none. Threads: every thread of the block calls them (they synchronize).
 * Errors: none.
 */
#ifndef KERNELS_NORM_DEV_CUH
#define KERNELS_NORM_DEV_CUH

#include "kernels/common.cuh"

enum { NORM_THREADS = 256 };

// The block's sum of v; red: NORM_THREADS / WARP_SIZE doubles of shared memory.
static __device__ double norm_block_sum(double v, double *red)
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

// s + f(a) + f(b) + f(c) + f(d), left to right, each double operation rounded on its own (no
// contraction): every kernel that sums a row sums it so.
template <typename F>
static __device__ __forceinline__ double norm_add4(double s, float4 v, F f)
{
    return __dadd_rn(s, __dadd_rn(__dadd_rn(__dadd_rn(f(v.x), f(v.y)), f(v.z)), f(v.w)));
}

static __device__ __forceinline__ double norm_sq(float v)
{
    return __dmul_rn((double) v, (double) v);
}

// This thread's sum of f(x[i]) over the row; vec: d % 4 == 0 and x 16-byte aligned.
template <typename F>
static __device__ __forceinline__ double norm_row_sum(const float *xr, int d, bool vec, F f)
{
    double s = 0.0;
    if (vec) {
#pragma unroll 8
        for (int i = threadIdx.x; i < d / 4; i += NORM_THREADS)
            s = norm_add4(s, ((const float4 *) xr)[i], f);
    } else {
#pragma unroll 8
        for (int i = threadIdx.x; i < d; i += NORM_THREADS)
            s = __dadd_rn(s, f(xr[i]));
    }
    return s;
}

// RMSNorm's factor 1 / sqrt(mean(x^2) + eps); value i is then w[i] * (x[i] * inv).
static __device__ __forceinline__ double norm_rms_inv(const float *xr, int d, bool vec, float eps,
                                                      double *red)
{
    const double ss = norm_row_sum(xr, d, vec, norm_sq);
    return 1.0 / sqrt(norm_block_sum(ss, red) / d + eps);
}

// LayerNorm's mean and factor 1 / sqrt(var + eps) (biased variance, centred squares); value i
// is then (x[i] - mean) * inv * w[i] + b[i].
static __device__ __forceinline__ double norm_layer_inv(const float *xr, int d, bool vec, float eps,
                                                        double *red, double *mean_out)
{
    const double mean =
        norm_block_sum(norm_row_sum(xr, d, vec, [](float v) { return (double) v; }), red) / d;
    const double var = norm_row_sum(xr, d, vec, [mean](float v) {
        const double c = __dsub_rn((double) v, mean);
        return __dmul_rn(c, c);
    });
    *mean_out = mean;
    return 1.0 / sqrt(norm_block_sum(var, red) / d + eps);
}

// Value x normalized: RMSNorm's w (x inv), LayerNorm's (x - mean) inv w + b, in double.
static __device__ __forceinline__ double norm_rms_value(float x, double inv, float w)
{
    return __dmul_rn((double) w, __dmul_rn((double) x, inv));
}

static __device__ __forceinline__ double norm_layer_value(float x, double mean, double inv, float w,
                                                          float b)
{
    return __dadd_rn(__dmul_rn(__dmul_rn(__dsub_rn((double) x, mean), inv), (double) w), (double) b);
}

// Whether norm.cu reads a row of d values x_stride apart from x in 16-byte pieces.
static inline bool norm_vec_rows(const float *x, int d, int x_stride)
{
    return d % 4 == 0 && x_stride % 4 == 0 && (uintptr_t) x % 16 == 0;
}

#endif  // KERNELS_NORM_DEV_CUH
