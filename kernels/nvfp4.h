/*
 * nvfp4.h - products with NVFP4 weights and bf16 activations (W4A16): y = W x for decode,
 * and dequantize-to-bf16 for prefill through cuBLASLt.
 *
 * Weight layout, exactly as ModelOpt stores it in the checkpoint, one row per output feature:
 *
 *   q       uint8 [rows, cols / 2]   two E2M1 codes per byte, element 2j in the low nibble
 *   scale   uint8 [rows, cols / 16]  one E4M3 scale per group of 16 weights
 *   global  float                    one FP32 scale for the whole tensor (weight_scale_2)
 *
 *   W[r, c] = e2m1(q[r, c]) * e4m3(scale[r, c / 16]) * global
 *
 * Activations: x bf16 [n_tok, cols]; y fp32 or bf16 [n_tok, rows]; residual fp32 [n_tok, rows]
 * or NULL (may alias y). H200 (sm_90) has no FP4 tensor cores, so the GEMV turns codes into
 * fp16 with three integer ops per pair, widens them to fp32 and accumulates in fp32: each
 * 16-weight group is summed first, then multiplied by its scale, then added to the row sum.
 * Every intermediate is exact except the fp32 additions, so the error bound is the fp32 one.
 *
 * Ownership: launchers borrow every pointer for the duration of the enqueue.
 * Threads:   launchers are thread-safe.
 * Errors:    shapes or alignment the kernels cannot handle trip an ASSERT (caller bug); CUDA
 *            failures are fatal. Launchers never allocate and never synchronize.
 */
#ifndef KERNELS_NVFP4_H
#define KERNELS_NVFP4_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/gemm.h"
#include "kernels/nvfp4_format.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct Nvfp4Matrix {
    const uint8_t *q;      // [rows, cols / 2]
    const uint8_t *scale;  // [rows, cols / NVFP4_GROUP]
    float global_scale;
    int rows;
    int cols;  // a multiple of 32 (one 16-byte load holds 32 codes)
} Nvfp4Matrix;

// y = W x (+ residual). Preconditions: cols % 32 == 0; q 16-byte aligned; scale 2-byte
// aligned; x 16-byte aligned; 1 <= n_tok <= GEMM_MAX_TOK; residual only with GEMM_OUT_F32.
void nvfp4_gemv(void *y, GemmOut y_type, const Nvfp4Matrix *w, const uint16_t *x,
                const float *residual, int n_tok, cudaStream_t stream);

// out bf16 [rows, cols] = W, rounded to nearest even (exact unless |W| leaves bf16's range
// or precision: e2m1 x e4m3 x global has at most 6 significant bits, so only global can
// make it inexact).
void nvfp4_dequant_bf16(uint16_t *out, const Nvfp4Matrix *w, cudaStream_t stream);

// Prefill: Y[m, rows] = X[m, cols] W^T. Dequantizes W into wbuf (bf16 [rows, cols], caller's
// workspace), then runs gemm_bf16_lt. Y fp32 or bf16 per y_type.
void nvfp4_gemm(void *y, GemmOut y_type, const uint16_t *x, const Nvfp4Matrix *w, int m,
                uint16_t *wbuf, GemmLt *lt, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_NVFP4_H
