/*
 * mla_format.h - the widths kernels/mla.h is built for and the softmax convention of the
 * tensor-core MLA (mla_decode_tc), in plain C for the host and the device: the KV cache
 * (engine/model/kv_cache.h) pads its entries to these widths, and the CPU backend rounds the
 * probabilities the kernel rounds.
 *
 * Widths: GLM-5's latent (kv_lora_rank 512) and rotary key (qk_rope_head_dim 64), q_nope
 * (qk_nope_head_dim 192), pages of MLA_BLOCK positions. A model with narrower ones runs the
 * same kernels on zero-padded values (kv_cache.h, backend_cuda.cu's mla_tuned), which change
 * no dot product.
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

#define MLA_KV_LORA 512
#define MLA_ROPE 64
#define MLA_QK_NOPE 192
#define MLA_LK (MLA_KV_LORA + MLA_ROPE)
#define MLA_BLOCK 128
#define MLA_FP8_TOKEN_BYTES 656

#define MLA_LOG2E 1.44269504f  // log2(e) in fp32
#define MLA_LN2 0.693147182f   // ln(2) in fp32

// The factor that takes a dot product to log2 units: sm_scale * MLA_LOG2E, rounded to fp32.
MLA_FN float mla_log2_scale(float sm_scale)
{
    return sm_scale * MLA_LOG2E;
}

#endif  // KERNELS_MLA_FORMAT_H
