/*
 * mla_format.h - the softmax convention of the tensor-core MLA (mla_decode_tc), in plain C for
 * the host and the device, so that the CPU backend rounds the probabilities the kernel rounds.
 *
 * A score s (the dot product times sm_scale) is taken in log2 units, x = s * (sm_scale *
 * MLA_LOG2E) with that product rounded to fp32 first; the maximum subtracted is an integer,
 * M = ceil(max x) over the positions attended, and p = 2^(x - M). A tiled kernel keeps a
 * running integer maximum: its p differs from this one by a power of two, and bf16 rounding
 * commutes with powers of two, so bf16(p * chunk scale) is the same whatever the tiles or
 * splits.
 *
 * Ownership: none. Threads: pure. Errors: none.
 */
#ifndef KERNELS_MLA_FORMAT_H
#define KERNELS_MLA_FORMAT_H

#define MLA_LOG2E 1.44269504f  // log2(e) in fp32

#endif  // KERNELS_MLA_FORMAT_H
