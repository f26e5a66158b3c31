/*
 * mla_ref.h - MLA cache and decode-attention references (kernels/mla.h), in double.
 *
 * The cache byte layouts are those of mla.h (type 0 = fp8 656 B/token, 1 = bf16 1152 B/token,
 * pages of 128 tokens); the reference decodes the same bytes the kernel reads.
 *
 * Ownership: none; host pointers borrowed for the call. Threads: pure. Errors: none.
 */
#ifndef KERNELS_REF_MLA_REF_H
#define KERNELS_REF_MLA_REF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The 576 latent values of cache page blk, row, decoded exactly.
void mla_cache_read_ref(float *out, const uint8_t *cache, int type, int blk, int row);

// The exact (unquantized) values the engine's cache write stores for each token's latent
// (kernels/kv.h kv_write with kv_a_layernorm and RoPE on k_pe): want [n_tok, 576].
void mla_latent_store_ref(float *want, const float *ckv, int ckv_stride, const float *norm_w,
                          float eps, float theta, const int32_t *pos, int n_tok);

// out [n_tok, H, 512] as mla_decode (unrounded). out_abs [n_tok, H, 512] = sum_p p |c_kv|;
// score_abs [n_tok, H] = max_p sum_i |q_i k_i| * sm_scale. Either may be NULL.
void mla_decode_ref(float *out, float *out_abs, float *score_abs, const float *q_lat,
                    const float *q_pe, const uint8_t *cache, int type, const int32_t *block_table,
                    int max_blocks, const int32_t *seq, const int32_t *kv_len,
                    const int32_t *indices, int idx_stride, int n_tok, int n_heads,
                    float sm_scale);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_REF_MLA_REF_H
