/*
 * mla_format.h - the softmax convention of the tensor-core MLA (mla_decode_tc), in plain C for
 * the host and the device, so that the CPU backend rounds the probabilities the kernel rounds.
 *
 * A score is taken in log2 units, x = dot * mla_log2_scale(sm_scale) (sm_scale * log2(e),
 * rounded to fp32 first); the maximum subtracted is an integer, M = ceil(max x) over the
 * positions attended, and p = 2^(x - M). A tiled kernel keeps a running integer maximum: its
 * p differs from this one by a power of two, and bf16 rounding commutes with powers of two,
 * so bf16(p * chunk scale) is the same whatever the tiles or splits. The split-KV merge
 * shared with mla_decode takes maxima in natural-log units: M * MLA_LN2.
 *
 * Ownership: none. Threads: pure. Errors: none.
 */
#ifndef KERNELS_MLA_FORMAT_H
#define KERNELS_MLA_FORMAT_H

#ifdef __CUDACC__
#define MLA_FN static inline __host__ __device__
#else
#define MLA_FN static inline
#endif

#define MLA_LOG2E 1.44269504f  // log2(e) in fp32
#define MLA_LN2 0.693147182f   // ln(2) in fp32

// The factor that takes a dot product to log2 units: sm_scale * MLA_LOG2E, rounded to fp32.
MLA_FN float mla_log2_scale(float sm_scale)
{
    return sm_scale * MLA_LOG2E;
}

#endif  // KERNELS_MLA_FORMAT_H
