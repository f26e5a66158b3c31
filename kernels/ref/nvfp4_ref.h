/*
 * nvfp4_ref.h - an NVFP4 weight decoded the obvious way, in double (the references of the
 * expert kernels, kernels/ref/moe_ref.c, read their weights through it).
 *
 * Layout, the checkpoint's (ModelOpt): q uint8 [rows, cols/2] (low nibble first), scale uint8
 * [rows, cols/16] (E4M3), global fp32.
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

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_REF_NVFP4_REF_H
