/*
 * nvfp4_ref.h - the obvious NVFP4 products (kernels/nvfp4.h), one weight at a time in double.
 *
 * Layout as in nvfp4.h: q uint8 [rows, cols/2] (low nibble first), scale uint8 [rows, cols/16]
 * (E4M3), global fp32. Inputs bf16 [n_tok, cols]; outputs fp32 [n_tok, rows].
 *
 * Ownership: none; host pointers borrowed for the call. Threads: pure. Errors: none.
 */
#ifndef KERNELS_REF_NVFP4_REF_H
#define KERNELS_REF_NVFP4_REF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Dequantized W[r, c].
double nvfp4_weight_ref(const uint8_t *q, const uint8_t *scale, float global, int cols, int r,
                        int c);

// y = W x; y_abs (or NULL) = sum |W x| terms per output.
void nvfp4_gemv_ref(float *y, float *y_abs, const uint8_t *q, const uint8_t *scale, float global,
                    int rows, int cols, const uint16_t *x, int n_tok);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_REF_NVFP4_REF_H
