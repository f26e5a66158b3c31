/*
 * dsa.h - DeepSeek sparse attention's indexer: scores over every cached position and top-k
 * selection (transformers 5.17 modeling_glm_moe_dsa.py, the indexer of GlmMoeDsaAttention).
 *
 * GLM-5's fp8 key pages, one per DSA_BLOCK positions (DSA_BLOCK_BYTES per page; the engine's
 * KV cache lays its index keys out so at these widths, kernels/kv_format.h kv_entry_layout,
 * and kernels/kv.h's kv_write stores them; dsa_cache_fp8 describes them as a DsaCache):
 *   bytes [0, 128*128)              128 keys of 128 fp8-e4m3 values, row = position % 128
 *   bytes [128*128, 128*128 + 512)  128 fp32 scales, one per key (amax / 448)
 * dsa_scores reads any DsaCache (kernels/dsa_format.h: fp8, bf16 or fp32 keys of 16 .. 128
 * values in pages of any block size, such as the engine's KV cache). Pages are found through
 * block_table int32 [n_seq, max_blocks] as in mla.h.
 *
 *   dsa_scores: scores[t, p] = sum_h w[t, h] * w_scale * ReLU(sm_scale * q[t, h] . k(p)) for
 *     p < kv_len[t]; q fp32 [n_tok, n_heads, dim] already rotated, w fp32 [n_tok, n_heads]
 *     (weights_proj output; w_scale = n_heads^-0.5, sm_scale = dim^-0.5 for GLM-5), in fp32
 *     in the order of dsa_format.h's dsa_key_score, bit for bit.
 *     scores fp32 [n_tok, score_stride]; entries at p >= kv_len[t] are not written.
 *   dsa_topk: idx int32 [n_tok, k] = the min(k, kv_len[t]) positions with the largest scores,
 *     ties to the higher (later) position, in ascending position order; n_sel int32 [n_tok] their count.
 *     The output feeds mla_decode(indices = idx, kv_len = n_sel).
 *
 * Numerics: fp32 dot products of the exact key values, the key's scale applied to each head's
 * dot product (dsa_format.h); selection is exact on the fp32 scores (a radix select over
 * their bits), so it is reproducible and a C loop over dsa_key_score selects the same keys.
 *
 * Ownership: borrowed pointers. Threads: thread-safe launchers. Errors: ASSERT on bad shapes;
 * CUDA failures fatal. Launchers never allocate and never synchronize; lengths are read on the
 * device (graph-safe).
 */
#ifndef KERNELS_DSA_H
#define KERNELS_DSA_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/dsa_format.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSA_DIM 128
#define DSA_ROPE 64
#define DSA_BLOCK 128
#define DSA_BLOCK_BYTES (DSA_BLOCK * DSA_DIM + DSA_BLOCK * 4)

// GLM-5's fp8 key pages (DSA_BLOCK keys of DSA_DIM values) as a DsaCache.
static inline DsaCache dsa_cache_fp8(const uint8_t *cache)
{
    const DsaCache c = {cache, DSA_KEY_FP8, DSA_DIM, DSA_BLOCK, DSA_DIM, DSA_BLOCK * DSA_DIM,
                        DSA_BLOCK_BYTES};
    return c;
}

// max_len bounds kv_len[t] (host-known capacity, sizes the grid). q 16-byte aligned.
void dsa_scores(float *scores, int score_stride, const float *q, const float *w, float w_scale,
                float sm_scale, const DsaCache *cache, const int32_t *block_table, int max_blocks,
                const int32_t *seq, const int32_t *kv_len, int max_len, int n_tok, int n_heads,
                cudaStream_t stream);

// dsa_scores on the tensor cores (dsa_scores_tc_supported: fp8 or bf16 keys): each q value
// rounded to bf16 (nearest even), each head's dot product with the exact key values
// accumulated in fp32 by mma.sync in the hardware's order, then the key scale, ReLU and head
// weights as dsa_key_score applies them, summed over heads by a shuffle tree. So the scores
// equal dsa_key_score of the rounded q up to the fp32 rounding of the two summations (about
// (dim + n_heads) 2^-23 of the sums of magnitudes: the tensor cores may truncate), not bit for bit.
// A CTA takes 4 tokens and `tiles` tiles of 64 positions (q loaded once for them); 0 chooses by
// size (prefill chunks up to 16, decode steps 1). Every value of tiles gives the same scores.
void dsa_scores_tc(float *scores, int score_stride, const float *q, const float *w, float w_scale,
                   float sm_scale, const DsaCache *cache, const int32_t *block_table,
                   int max_blocks, const int32_t *seq, const int32_t *kv_len, int max_len,
                   int n_tok, int n_heads, int tiles, cudaStream_t stream);

void dsa_topk(int32_t *idx, int32_t *n_sel, const float *scores, int score_stride,
              const int32_t *kv_len, int n_tok, int k, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_DSA_H
