/*
 * common.cuh - small device helpers shared by every kernel family: warp reductions, bf16 and
 * fp8 conversions, streaming loads.
 *
 * Activations cross kernel boundaries as bf16 (GEMV inputs) or fp32 (GEMV outputs, the
 * residual stream); in plain-C headers bf16 is spelled uint16_t and fp8-e4m3 uint8_t. The
 * conversions here are exact (bf16 -> fp32) or round to nearest even (fp32 -> bf16, fp32 ->
 * e4m3 with saturation), the same rounding the C references use (kernels/ref/kern_ref.h).
 */
#ifndef KERNELS_COMMON_CUH
#define KERNELS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define WARP_SIZE 32
#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

static __device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// SiLU(g) * u = g / (1 + e^-g) * u in double, one rounding to fp32: SwiGLU's value wherever
// an fp32 activation takes it (kernels/act.h act_silu_mul, the grouped GEMV's pairs; the CPU
// backend's cpu_silu_mul).
static __device__ __forceinline__ float silu_mul_value(float g, float u)
{
    const double gd = g;
    return (float) (gd / (1.0 + exp(-gd)) * (double) u);
}

// bf16 bits -> fp32, exact.
static __device__ __forceinline__ float bf16_bits_to_f32(uint16_t b)
{
    return __uint_as_float((uint32_t) b << 16);
}

// Two bf16 packed in one word (element 0 in the low half) -> two fp32, exact.
static __device__ __forceinline__ float2 bf16x2_bits_to_f32(uint32_t w)
{
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// fp32 -> bf16 bits, round to nearest even (NaN stays NaN).
static __device__ __forceinline__ uint16_t f32_to_bf16_bits(float f)
{
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

// fp8 e4m3 bits -> fp32 (exact).
static __device__ __forceinline__ float e4m3_bits_to_f32(uint8_t b)
{
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t) b, __NV_E4M3);
    return __half2float(__half(h));
}

// fp8 e4m3 code (low byte of b) -> bf16 bits, exact (every e4m3 value is a bf16 value); 0x7f
// and 0xff decode to +-480 as nvfp4_format.h's decoder (the C references') has them, not NaN.
static __device__ __forceinline__ uint32_t e4m3_to_bf16_bits(uint32_t b)
{
    const uint32_t em = b & 0x7fu;  // exponent and mantissa: 2^(e-7) (1 + m/8), or m 2^-9
    const uint32_t mag = em >= 8u ? (em + (120u << 3)) << 4 : __float_as_uint((float) em * 0x1p-9f) >> 16;
    return (b & 0x80u) << 8 | mag;
}

// Four e4m3 codes (code 0 in the low byte) -> four bf16, two a word (element 0 in the low half).
static __device__ __forceinline__ uint2 e4m3x4_to_bf16x4(uint32_t wd)
{
    return make_uint2(e4m3_to_bf16_bits(wd & 0xffu) | e4m3_to_bf16_bits((wd >> 8) & 0xffu) << 16,
                      e4m3_to_bf16_bits((wd >> 16) & 0xffu) | e4m3_to_bf16_bits(wd >> 24) << 16);
}

// fp32 -> fp8 e4m3 bits, round to nearest even, saturating at +-448.
static __device__ __forceinline__ uint8_t f32_to_e4m3_bits(float f)
{
    return (uint8_t) __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
}

// d += A B on the tensor cores: mma.sync m16n8k16, bf16 in, fp32 accumulate. With g = lane / 4
// and c = lane % 4, each register holds two bf16 (the lower column or k in the low half):
// a0 = A[g][2c..], a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]; b0 = B[2c..][g],
// b1 = B[2c+8..][g]; d0, d1 = D[g][2c], D[g][2c+1]; d2, d3 = D[g+8][2c], D[g+8][2c+1].
static __device__ __forceinline__ void mma_bf16_16816(float *d, uint32_t a0, uint32_t a1,
                                                      uint32_t a2, uint32_t a3, uint32_t b0,
                                                      uint32_t b1)
{
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ldmatrix: four 8x8 bf16 matrices from shared memory, lane l giving the address of row l % 8
// of matrix l / 8 (16 bytes, 16-byte aligned); r[m] is matrix m's pair at row lane / 4,
// columns 2 (lane % 4) and + 1 (mma_bf16_16816's a and b layouts), or with trans the pair at
// rows 2 (lane % 4) and + 1 of column lane / 4 (a b fragment from a row-major [k][n] tile).
template <bool TRANS>
static __device__ __forceinline__ void ldsm_x4(uint32_t r[4], const uint16_t *row)
{
    const uint32_t a = (uint32_t) __cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
}

// 16-byte load that does not allocate in L1: weights are streamed once per step.
static __device__ __forceinline__ uint4 ld_stream_u4(const void *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// The same for 8 bytes.
static __device__ __forceinline__ uint2 ld_stream_u2(const void *p)
{
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(p));
    return v;
}

#endif  // KERNELS_COMMON_CUH
