/*
 * rope_format.h - RoPE's inverse frequencies, in plain C for the host, so that every RoPE
 * (the CPU backend's, kernels/rope.h and kernels/kv.h's cache write, the references) rotates by the
 * same fp32 angles.
 *
 * inv_freq[i] = 1 / theta^(2i / rot_dim), in fp32 as transformers computes it (the exponent
 * (float) 2i / (float) rot_dim, then the host's powf, then the division). The device's powf
 * may differ from the host's in the last bits, which at position 256K moves a high-frequency
 * angle by hundredths of a radian; so the kernels never compute them: the launcher fills a
 * RopeFreqs on the host and passes it by value (a kernel parameter, which a CUDA graph
 * records), and the angle pos * inv_freq is one fp32 product on either side.
 * rope_cos_sin and rope_rotate are the rest of the arithmetic, for the host and the device
 * alike: every RoPE (the CPU backend's, rope.cu's, kv.cu's) calls them.
 *
 * Ownership: none. Threads: pure. Errors: none.
 */
#ifndef KERNELS_ROPE_FORMAT_H
#define KERNELS_ROPE_FORMAT_H

#include <math.h>

#ifdef __CUDACC__
#define ROPE_FN static inline __host__ __device__
#else
#define ROPE_FN static inline
#endif

// Pairs a RopeFreqs holds: rot_dim up to 2 * ROPE_MAX_PAIRS (GLM-5: 64).
#define ROPE_MAX_PAIRS 256

typedef struct RopeFreqs {
    float inv[ROPE_MAX_PAIRS];
} RopeFreqs;

static inline float rope_inv_freq(int i, int rot_dim, float theta)
{
    return 1.0f / powf(theta, (float) (2 * i) / (float) rot_dim);
}

// f->inv[0 .. rot_dim / 2), the rest zero (a kernel parameter's bytes are all defined);
// rot_dim even, at most 2 * ROPE_MAX_PAIRS (the caller checks).
static inline void rope_freqs(RopeFreqs *f, int rot_dim, float theta)
{
    for (int i = 0; i < ROPE_MAX_PAIRS; i++)
        f->inv[i] = i < rot_dim / 2 ? rope_inv_freq(i, rot_dim, theta) : 0.0f;
}

// cos and sin of the angle of position pos at inverse frequency inv: the fp32 product, then
// cos and sin in double, rounded to fp32.
ROPE_FN void rope_cos_sin(int pos, float inv, float *cs, float *sn)
{
    const float angle = (float) pos * inv;  // one product: nothing to contract
    *cs = (float) cos((double) angle);
    *sn = (float) sin((double) angle);
}

// Pair (a, b) rotated: *first = a cs - b sn, *second = b cs + a sn, each product rounded
// (no FMA: nvcc contracts unless told, the host builds with -ffp-contract=off).
ROPE_FN void rope_rotate(float a, float b, float cs, float sn, float *first, float *second)
{
#ifdef __CUDA_ARCH__
    *first = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
    *second = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
#else
    *first = a * cs - b * sn;
    *second = b * cs + a * sn;
#endif
}

#endif  // KERNELS_ROPE_FORMAT_H
