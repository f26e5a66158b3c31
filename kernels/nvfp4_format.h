/*
 * nvfp4_format.h - decode one E2M1 weight code and one E4M3 group scale.
 *
 * Shared by the CUDA kernels, the C references and the CPU backend so that all of them read
 * the format identically; tests/kernels/test_kern_ref.c pins the values. NVFP4 as
 * ModelOpt writes it: W[r, c] = e2m1(code(r, c)) * e4m3(scale[r, c / 16]) * global_scale,
 * with element 2j in the low nibble of byte j and 2j+1 in the high nibble. The checkpoint
 * loader rejects NaN scale encodings (0x7f, 0xff), so the decoders do not handle them.
 */
#ifndef KERNELS_NVFP4_FORMAT_H
#define KERNELS_NVFP4_FORMAT_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define NVFP4_FN static inline __host__ __device__
#else
#define NVFP4_FN static inline
#endif

#define NVFP4_GROUP 16  // consecutive weights that share one E4M3 scale

// E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit. Magnitudes 0 .. 6.
NVFP4_FN float nvfp4_e2m1_to_float(uint8_t code)
{
    const int exponent = (code >> 1) & 3;
    const int mantissa = code & 1;
    const float magnitude =
        exponent ? ldexpf(1.0f + 0.5f * mantissa, exponent - 1) : 0.5f * mantissa;
    return (code & 8) ? -magnitude : magnitude;
}

// E4M3 ("fn": no infinities): sign, 4 exponent bits (bias 7), 3 mantissa bits.
NVFP4_FN float nvfp4_e4m3_to_float(uint8_t bits)
{
    const int exponent = (bits >> 3) & 15;
    const int mantissa = bits & 7;
    const float magnitude = exponent ? ldexpf(1.0f + mantissa / 8.0f, exponent - 7)
                                     : ldexpf(mantissa / 8.0f, -6);  // subnormal
    return (bits & 0x80) ? -magnitude : magnitude;
}

#endif  // KERNELS_NVFP4_FORMAT_H
