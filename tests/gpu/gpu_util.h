/*
 * gpu_util.h - helpers for the GPU tests: device buffers, poisoning, random fills, and the
 * per-element + NMSE comparison every kernel test ends with.
 *
 * Ownership: gpu_upload/gpu_alloc return device memory the caller frees with cudaFree.
 * Threads:   single-threaded tests. Errors: CUDA failures are fatal (CUDA_CHECK).
 */
#ifndef TESTS_GPU_GPU_UTIL_H
#define TESTS_GPU_GPU_UTIL_H

#include <cuda_runtime_api.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/shared/cuda_check.h"
#include "kernels/ref/kern_ref.h"
#include "tests/check.h"

// Device copy of n bytes of host memory.
static inline void *gpu_upload(const void *h, size_t n)
{
    void *d = NULL;
    CUDA_CHECK(cudaMalloc(&d, n ? n : 1));
    if (n) CUDA_CHECK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    return d;
}

// Device buffer of n bytes filled with 0xff: NaN as fp32 and bf16, so unwritten outputs fail.
static inline void *gpu_alloc_poisoned(size_t n)
{
    void *d = NULL;
    CUDA_CHECK(cudaMalloc(&d, n ? n : 1));
    CUDA_CHECK(cudaMemset(d, 0xff, n ? n : 1));
    return d;
}

static inline void gpu_download(void *h, const void *d, size_t n)
{
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
}

static inline void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    ASSERT(p);
    return p;
}

static inline void fill_bf16(uint16_t *p, size_t n, uint64_t *rng, float lo, float hi)
{
    for (size_t i = 0; i < n; i++) p[i] = kern_f32_to_bf16(kern_rand_uniform(rng, lo, hi));
}

static inline void fill_f32(float *p, size_t n, uint64_t *rng, float lo, float hi)
{
    for (size_t i = 0; i < n; i++) p[i] = kern_rand_uniform(rng, lo, hi);
}

// A random E4M3 scale in [2^-4, 2^4): realistic, never a NaN encoding.
static inline uint8_t random_e4m3_scale(uint64_t *rng)
{
    const int exponent = 3 + (int) (kern_rand_u64(rng) % 8);
    return (uint8_t) (exponent << 3 | (int) (kern_rand_u64(rng) % 8));
}

static inline void fill_bytes(uint8_t *p, size_t n, uint64_t *rng)
{
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t) (kern_rand_u64(rng) >> 56);
}

// Compare n outputs against want with per-element bounds tol[i] (or tol_const when tol is
// NULL), then the aggregate NMSE against nmse_max. Prints one summary line; counts one check
// failure per failing element (first 5 printed) and one for the NMSE.
static inline void compare(const char *what, const float *got, const float *want,
                           const float *tol, double tol_const, size_t n, double nmse_max)
{
    size_t bad = 0;
    double err2 = 0.0, ref2 = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double g = got[i], w = want[i];
        const double t = tol ? tol[i] : tol_const;
        const double e = fabs(g - w);
        if (!(e <= t)) {  // NaN fails
            if (bad < 5)
                fprintf(stderr, "%s[%zu]: got %.9g want %.9g (tolerance %.3g)\n", what, i, g, w, t);
            bad++;
        } else if (t > 0 && e / t > worst) {
            worst = e / t;
        }
        err2 += (g - w) * (g - w);
        ref2 += w * w;
    }
    const double nmse = ref2 > 0 ? err2 / ref2 : err2;
    printf("%-40s n=%-9zu bad=%-6zu worst/tol=%.3f nmse=%.3g\n", what, n, bad, worst, nmse);
    if (bad) check_failures++;
    else check_passes++;
    CHECK(nmse <= nmse_max);  // NaN fails too
}

// A GEMV's output d_y [ny] on the device (fp32, or bf16 when is_bf16) against the reference
// want [ny], whose sum |terms| over n_terms terms is abs [ny]: res [ny] (or NULL, the
// residual the kernel added) is added to want first. Each element may be off by
// n_terms * FLT_EPSILON * (abs + |res|), plus the bf16 rounding of the output; the NMSE by
// 1e-10 (fp32) or 1e-4 (bf16). want is modified.
static inline void compare_gemv(const char *what, const void *d_y, bool is_bf16, float *want,
                                const float *abs, const float *res, size_t ny, int n_terms)
{
    float *got = (float *) xmalloc(ny * 4), *tol = (float *) xmalloc(ny * 4);
    if (!is_bf16) {
        gpu_download(got, d_y, ny * 4);
    } else {
        uint16_t *gb = (uint16_t *) xmalloc(ny * 2);
        gpu_download(gb, d_y, ny * 2);
        for (size_t i = 0; i < ny; i++) got[i] = kern_bf16_to_f32(gb[i]);
        free(gb);
    }
    for (size_t i = 0; i < ny; i++) {
        if (res) want[i] += res[i];
        tol[i] = (float) (n_terms * FLT_EPSILON * (abs[i] + (res ? fabsf(res[i]) : 0)));
        if (is_bf16) tol[i] += ldexpf(fabsf(want[i]), -8);
    }
    compare(what, got, want, tol, 0, ny, is_bf16 ? 1e-4 : 1e-10);
    free(got);
    free(tol);
}

#endif  // TESTS_GPU_GPU_UTIL_H
