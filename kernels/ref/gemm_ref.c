/*
 * gemm_ref.c - bf16 GEMV reference: double accumulation, checked by eye.
 */
#include "kernels/ref/gemm_ref.h"

#include <math.h>
#include <stddef.h>

#include "kernels/ref/kern_ref.h"

void gemm_bf16_gemv_ref(float *y, float *y_abs, const uint16_t *w, const uint16_t *x, int rows,
                        int cols, int n_mat, int n_tok)
{
    for (int t = 0; t < n_tok; t++) {
        for (int m = 0; m < n_mat; m++) {
            const uint16_t *xv = x + ((size_t) t * n_mat + m) * cols;
            for (int r = 0; r < rows; r++) {
                const uint16_t *wr = w + ((size_t) m * rows + r) * cols;
                double sum = 0.0, sum_abs = 0.0;
                for (int c = 0; c < cols; c++) {
                    const double term = (double) kern_bf16_to_f32(wr[c]) * kern_bf16_to_f32(xv[c]);
                    sum += term;
                    sum_abs += fabs(term);
                }
                const size_t o = ((size_t) t * n_mat + m) * rows + r;
                y[o] = (float) sum;
                if (y_abs) y_abs[o] = (float) sum_abs;
            }
        }
    }
}
