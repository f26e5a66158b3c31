/*
 * dsa_ref.h - DSA indexer references (kernels/dsa.h), in double; byte layout of the key cache
 * as dsa.h (pages of 128 keys x 128 fp8, then 128 fp32 scales).
 *
 * Ownership: none; host pointers borrowed for the call. Threads: pure. Errors: none.
 */
#ifndef KERNELS_REF_DSA_REF_H
#define KERNELS_REF_DSA_REF_H

#include <stdint.h>

#include "kernels/dsa_format.h"

#ifdef __cplusplus
extern "C" {
#endif

// The 128 key values of page blk, row, decoded exactly.
void dsa_key_read_ref(float *out, const uint8_t *cache, int blk, int row);

// The exact values the engine's cache write stores for an index key (kernels/kv.h kv_write:
// LayerNorm, then RoPE on [0, 64)): want [n_tok, 128].
void dsa_key_store_ref(float *want, const float *k, const float *ln_w, const float *ln_b,
                          float eps, float theta, const int32_t *pos, int n_tok);

// scores [n_tok, stride] for p < kv_len[t] over the keys of cache (any DsaCache, host
// memory), each value exact (raw value times the key's scale); scores_abs (or NULL) = sum_h |w_h| * w_scale *
// sm_scale * sum_i |q_i k_i|, a bound on every term's magnitude.
void dsa_scores_ref(float *scores, float *scores_abs, int stride, const float *q, const float *w,
                    float w_scale, float sm_scale, const DsaCache *cache,
                    const int32_t *block_table, int max_blocks, const int32_t *seq,
                    const int32_t *kv_len, int n_tok, int n_heads);

// idx [n_tok, k], n_sel [n_tok] as dsa_topk, on the given fp32 scores.
void dsa_topk_ref(int32_t *idx, int32_t *n_sel, const float *scores, int stride,
                  const int32_t *kv_len, int n_tok, int k);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_REF_DSA_REF_H
