/*
 * nvfp4_dev.cuh - device-side NVFP4 decoding shared by nvfp4.cu and moe.cu.
 *
 * e2m1x8_to_f32: one 32-bit word holds 8 codes (code k in bits 4k..4k+3). Shifting the word
 * right by 4k puts code k in bits 0..3 and code k+4 in bits 16..19; two shifts and masks move
 * the sign to bit 15/31 and the three magnitude bits (2 exponent, 1 mantissa) to bits 9..11 /
 * 25..27 of an fp16 pair. That fp16 is exactly e2m1 * 2^-14 for every code, normal or
 * subnormal (E2M1's bias is 1, fp16's is 15), so the 2^14 is folded into the group scale.
 * The outputs come in the order (c0, c4, c1, c5, c2, c6, c3, c7); callers pair them with
 * their inputs accordingly (E2M1_SLOT below). Cost: ~2.5 integer ops and one conversion per
 * weight, inside H200's budget of ~4 simple ops per weight at full bandwidth.
 */
#ifndef KERNELS_NVFP4_DEV_CUH
#define KERNELS_NVFP4_DEV_CUH

#include "kernels/common.cuh"
#include "kernels/nvfp4_format.h"

// Column (0..7 within the word) of output slot s of e2m1x8_to_f32.
#define E2M1_SLOT(s) (((s) >> 1) + 4 * ((s) & 1))

static __device__ __forceinline__ void e2m1x8_to_f32(uint32_t w, float out[8])
{
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint32_t s = w >> (4 * k);
        const uint32_t h = ((s << 12) & 0x80008000u) | ((s << 9) & 0x0e000e00u);
        __half2_raw hr;
        hr.x = (unsigned short) (h & 0xffffu);
        hr.y = (unsigned short) (h >> 16);
        const float2 f = __half22float2(__half2(hr));
        out[2 * k] = f.x;
        out[2 * k + 1] = f.y;
    }
}

// Group scale with the 2^14 of e2m1x8_to_f32 folded in.
static __device__ __forceinline__ float nvfp4_group_scale(uint8_t s)
{
    return e4m3_bits_to_f32(s) * 16384.0f;
}

// Dot product of 32 codes (one 16-byte chunk = two groups) with 32 fp32 inputs xf, in
// natural column order. Returns sum over both groups of (group dot) * scale.
static __device__ __forceinline__ float nvfp4_chunk_dot(uint4 q, uint16_t sc2, const float *xf)
{
    const uint32_t qs[4] = {q.x, q.y, q.z, q.w};
    float g[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float a = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            float wf[8];
            e2m1x8_to_f32(qs[2 * h + j], wf);
#pragma unroll
            for (int s = 0; s < 8; s++) a = fmaf(wf[s], xf[16 * h + 8 * j + E2M1_SLOT(s)], a);
        }
        g[h] = a;
    }
    return g[0] * nvfp4_group_scale((uint8_t) (sc2 & 0xff))
           + g[1] * nvfp4_group_scale((uint8_t) (sc2 >> 8));
}

// 32 bf16 inputs starting at p (16-byte aligned) -> fp32.
static __device__ __forceinline__ void load_x32(const uint16_t *p, float *xf)
{
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint4 v = __ldg((const uint4 *) p + i);
        const uint32_t vs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = bf16x2_bits_to_f32(vs[j]);
            xf[8 * i + 2 * j] = f.x;
            xf[8 * i + 2 * j + 1] = f.y;
        }
    }
}

#endif  // KERNELS_NVFP4_DEV_CUH
