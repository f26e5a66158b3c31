/*
 * gemm_ref.h - the obvious bf16 GEMV (kernels/gemm.h), one product at a time in double.
 *
 * Ownership: none; all pointers are host memory borrowed for the call.
 * Threads:   pure functions. Errors: none (shapes are the caller's business).
 */
#ifndef KERNELS_REF_GEMM_REF_H
#define KERNELS_REF_GEMM_REF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// y fp32 [n_tok, n_mat, rows] = w bf16 [n_mat, rows, cols] x bf16 [n_tok, n_mat, cols];
// y_abs (or NULL) gets sum |w * x| per output, for tolerances.
void gemm_bf16_gemv_ref(float *y, float *y_abs, const uint16_t *w, const uint16_t *x, int rows,
                        int cols, int n_mat, int n_tok);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_REF_GEMM_REF_H
