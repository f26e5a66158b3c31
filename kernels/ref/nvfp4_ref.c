/*
 * nvfp4_ref.c - the obvious implementation of nvfp4.h, one weight at a time, written to be
 * checked by eye rather than to be fast.
 */
#include "kernels/ref/nvfp4_ref.h"

#include <math.h>
#include <stddef.h>

#include "kernels/nvfp4_format.h"
#include "kernels/ref/kern_ref.h"

double nvfp4_weight_ref(const uint8_t *q, const uint8_t *scale, float global, int cols, int r,
                        int c)
{
    const uint8_t byte = q[(size_t) r * (cols / 2) + c / 2];
    const uint8_t code = (c % 2 == 0) ? (byte & 15) : (byte >> 4);
    const uint8_t s = scale[(size_t) r * (cols / NVFP4_GROUP) + c / NVFP4_GROUP];
    return (double) nvfp4_e2m1_to_float(code) * nvfp4_e4m3_to_float(s) * global;
}

void nvfp4_gemv_ref(float *y, float *y_abs, const uint8_t *q, const uint8_t *scale, float global,
                    int rows, int cols, const uint16_t *x, int n_tok)
{
    for (int t = 0; t < n_tok; t++) {
        for (int r = 0; r < rows; r++) {
            double sum = 0.0, sum_abs = 0.0;
            for (int c = 0; c < cols; c++) {
                const double term = nvfp4_weight_ref(q, scale, global, cols, r, c)
                                    * kern_bf16_to_f32(x[(size_t) t * cols + c]);
                sum += term;
                sum_abs += fabs(term);
            }
            y[(size_t) t * rows + r] = (float) sum;
            if (y_abs) y_abs[(size_t) t * rows + r] = (float) sum_abs;
        }
    }
}
