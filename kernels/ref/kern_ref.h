/*
 * kern_ref.h - number-format helpers shared by the kernel references: bf16 and fp8-e4m3
 * rounding exactly as the CUDA kernels round (nearest even; e4m3 saturates at +-448), and
 * a deterministic random source for tests and the benchmark's host-side checks.
 *
 * Ownership: none. Threads: pure functions, except kern_rand_*, which advance *state.
 * Errors: none.
 */
#ifndef KERNELS_REF_KERN_REF_H
#define KERNELS_REF_KERN_REF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// bf16 bits -> float (exact).
float kern_bf16_to_f32(uint16_t b);
// float -> bf16 bits, round to nearest even.
uint16_t kern_f32_to_bf16(float f);
// float rounded through bf16 and back.
float kern_round_bf16(float f);
// float -> fp8 e4m3 bits, round to nearest even, saturating at +-448 (no NaN produced).
uint8_t kern_f32_to_e4m3(float f);
// fp8 e4m3 bits -> float (exact; the NaN encodings 0x7f/0xff are never produced here).
float kern_e4m3_to_f32(uint8_t b);

// xorshift64* generator: same seed, same sequence on every platform.
uint64_t kern_rand_u64(uint64_t *state);
// Uniform in [lo, hi).
float kern_rand_uniform(uint64_t *state, float lo, float hi);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_REF_KERN_REF_H
