/*
 * nvfp4_format.h - decode one E2M1 weight code and one E4M3 group scale; the E4M3 and bf16
 * encoders of plain C code.
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
#include <string.h>

#ifdef __CUDACC__
#define NVFP4_FN static inline __host__ __device__
#else
#define NVFP4_FN static inline
#endif

#define NVFP4_GROUP 16  // consecutive weights that share one E4M3 scale

NVFP4_FN float nvfp4_bits_to_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit. Magnitudes 0 .. 6: 2^(e-1) (1 + m/2),
// or m / 2 when e = 0, built as fp32 bits (exact; no libm call, so cheap on a GPU too).
NVFP4_FN float nvfp4_e2m1_to_float(uint8_t code)
{
    const uint32_t e = (code >> 1) & 3u, m = code & 1u;
    const uint32_t bits = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3f000000u : 0u);
    return nvfp4_bits_to_float(bits | ((uint32_t) (code & 8u) << 28));
}

// E4M3 ("fn": no infinities): sign, 4 exponent bits (bias 7), 3 mantissa bits:
// 2^(e-7) (1 + m/8), or m 2^-9 when e = 0 (subnormal), built as fp32 bits (exact).
NVFP4_FN float nvfp4_e4m3_to_float(uint8_t bits)
{
    const uint32_t e = (bits >> 3) & 15u, m = bits & 7u;
    const float magnitude =
        e ? nvfp4_bits_to_float(((e + 120u) << 23) | (m << 20)) : (float) m * 0.001953125f;
    return (bits & 0x80) ? -magnitude : magnitude;
}

// float -> E4M3 code, round to nearest even, saturating at +-448 (the "satfinite" rule of
// CUDA's __nv_cvt_float_to_fp8); NaN -> 0x7f with the sign. The one encoder of plain C code:
// the kernels' references (kernels/ref/kern_ref.c) and the fp8 KV cache of the CPU and CUDA
// backends (engine/model/kv_cache.h), so that the two backends store identical bytes.
// tests/kernels/test_kern_ref.c checks it against a walk over every code.
NVFP4_FN uint8_t nvfp4_float_to_e4m3(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t) ((u >> 24) & 0x80);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t) (sign | 0x7f);   // NaN
    if (a >= 0x43e00000u) return (uint8_t) (sign | 0x7e);  // >= 448 (and inf): saturate
    if (a < 0x3c800000u) {  // below 2^-6: multiples of 2^-9, code = the multiple (8 = 2^-6)
        float m;
        memcpy(&m, &a, sizeof m);
        return (uint8_t) (sign | (uint8_t) rintf(m * 512.0f));
    }
    // Normal: keep 3 of the 23 mantissa bits, nearest even; a carry moves into the exponent.
    const uint32_t exp8 = (a >> 23) - 127 + 7;  // 1 .. 15
    const uint32_t mant = a & 0x7fffffu;
    uint32_t code = (exp8 << 3) | (mant >> 20);
    const uint32_t rest = mant & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (code & 1))) code++;
    if (code > 0x7e) code = 0x7e;  // 448 < |f| < 464 rounds to 480, beyond the format: saturate
    return (uint8_t) (sign | code);
}

// bf16 bits -> float (exact).
NVFP4_FN float nvfp4_bf16_to_float(uint16_t b)
{
    return nvfp4_bits_to_float((uint32_t) b << 16);
}

// float -> bf16 bits, round to nearest even; NaN stays NaN (quiet). The rounding of the bf16
// precision recipe (engine/model/backend.h) on the CPU, equal to CUDA's __float2bfloat16_rn.
NVFP4_FN uint16_t nvfp4_float_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t) ((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t) (u >> 16);
}

// f rounded to bf16 and back.
NVFP4_FN float nvfp4_round_bf16(float f)
{
    return nvfp4_bf16_to_float(nvfp4_float_to_bf16(f));
}

#endif  // KERNELS_NVFP4_FORMAT_H
