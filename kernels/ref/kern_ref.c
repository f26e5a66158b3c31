/*
 * kern_ref.c - bf16 / e4m3 rounding and a seeded generator for the kernel references.
 *
 * The bf16 and e4m3 codecs are kernels/nvfp4_format.h's (tests/kernels/test_kern_ref.c checks its
 * encoder against a walk over every representable magnitude).
 */
#include "kernels/ref/kern_ref.h"

#include "kernels/nvfp4_format.h"

float kern_bf16_to_f32(uint16_t b)
{
    return nvfp4_bf16_to_float(b);
}

uint16_t kern_f32_to_bf16(float f)
{
    return nvfp4_float_to_bf16(f);
}

float kern_round_bf16(float f)
{
    return nvfp4_round_bf16(f);
}

float kern_e4m3_to_f32(uint8_t b)
{
    return nvfp4_e4m3_to_float(b);
}

uint8_t kern_f32_to_e4m3(float f)
{
    return nvfp4_float_to_e4m3(f);
}

uint64_t kern_rand_u64(uint64_t *state)
{
    uint64_t x = *state ? *state : 0x9e3779b97f4a7c15ull;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545f4914f6cdd1dull;
}

float kern_rand_uniform(uint64_t *state, float lo, float hi)
{
    const double u = (double) (kern_rand_u64(state) >> 11) / 9007199254740992.0;  // [0, 1)
    return (float) (lo + (hi - lo) * u);
}
