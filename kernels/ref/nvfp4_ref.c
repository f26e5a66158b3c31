/*
 * nvfp4_ref.c - an NVFP4 weight decoded the obvious way, one at a time, written to be checked
 * by eye rather than to be fast.
 */
#include "kernels/ref/nvfp4_ref.h"

#include <stddef.h>

#include "kernels/nvfp4_format.h"

double nvfp4_weight_ref(const uint8_t *q, const uint8_t *scale, float global, int cols, int r,
                        int c)
{
    const uint8_t byte = q[(size_t) r * (cols / 2) + c / 2];
    const uint8_t code = (c % 2 == 0) ? (byte & 15) : (byte >> 4);
    const uint8_t s = scale[(size_t) r * (cols / NVFP4_GROUP) + c / NVFP4_GROUP];
    return (double) nvfp4_e2m1_to_float(code) * nvfp4_e4m3_to_float(s) * global;
}
