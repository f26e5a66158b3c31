/*
 * mla.h - multi-head latent attention for decode, in absorbed form, over a paged latent cache.
 *
 * Per token the cache holds GLM-5's 576-wide MLA latent (config.json kv_lora_rank 512 +
 * qk_rope_head_dim 64): c_kv (512, after kv_a_layernorm) and k_pe (64, after RoPE). Cache
 * layout, one page per MLA_BLOCK tokens:
 *
 *   MLA_CACHE_FP8  (vLLM's fp8_ds_mla, MLA_FP8_TOKEN_BYTES = 656 per token):
 *                  bytes [0, 512)    c_kv in fp8-e4m3, divided by its chunk scale
 *                  bytes [512, 528)  4 fp32 scales, one per 128 latent values (amax / 448)
 *                  bytes [528, 656)  k_pe, 64 bf16
 *   MLA_CACHE_BF16 (1152 bytes per token): c_kv then k_pe, 576 bf16
 *
 *   data  uint8 [n_blocks, MLA_BLOCK, token_bytes]
 *   block_table int32 [n_seq, max_blocks]: page of position p of sequence s is
 *               block_table[s * max_blocks + p / MLA_BLOCK], row p % MLA_BLOCK.
 *
 * Decode attention, per token t (sequence seq[t]) and head h:
 *
 *   positions P = 0 .. kv_len[t]-1, or, when indices != NULL (DSA), indices[t, 0 .. kv_len[t])
 *   score(p) = (q_lat[t,h] . c_kv(p) + q_pe[t,h] . k_pe(p)) * sm_scale      (sm_scale = 1/16)
 *   out[t,h] = sum_p softmax(score)(p) * c_kv(p)                              bf16 [.., 512]
 *
 * q_lat fp32 [n_tok, H, 512] is q_nope absorbed through W_UK (gemm_bf16_gemv per head); q_pe
 * fp32 [n_tok, H, 64] is already rotated (mla_q_split). Split-KV: the positions of a token
 * are cut into n_split equal ranges that run in parallel; each writes an unnormalized partial
 * output and its (max, sum) to the caller's workspace, and mla_decode's second kernel merges
 * them. A split with no positions (n_split is sized for the graph's capacity, not the context:
 * at 1K context up to half of them) writes only (-inf, 0); the merge reads no partial output
 * of an empty split (they are a suffix of the splits). Numerics: dequantized cache values are
 * code x scale rounded to fp32 (4 x 24 bits); dot products, softmax and the weighted sum are
 * fp32; one rounding to bf16 at the end.
 *
 * Ownership: borrowed pointers; MlaCache does not own its data. Threads: thread-safe
 * launchers. Errors: ASSERT on bad shapes; CUDA failures fatal. Launchers never allocate and
 * never synchronize; lengths, positions and indices are read on the device, so decode steps
 * can be captured once in a CUDA graph and replayed as the context grows.
 */
#ifndef KERNELS_MLA_H
#define KERNELS_MLA_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/mla_format.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MLA_MAX_SPLIT 64
#define MLA_HEADS_PER_CTA 16  // n_heads must be a multiple

typedef enum MlaCacheType { MLA_CACHE_FP8 = 0, MLA_CACHE_BF16 = 1 } MlaCacheType;

typedef struct MlaCache {
    uint8_t *data;  // [n_blocks, MLA_BLOCK, mla_cache_token_bytes(type)]
    MlaCacheType type;
    int n_blocks;
} MlaCache;

// Bytes one token occupies in a cache of this type.
size_t mla_cache_token_bytes(MlaCacheType type);

// q fp32 [n_tok, H, qk_nope + qk_rope] per head (the q_b projection output) -> q_nope bf16
// [n_tok, heads_pad, MLA_QK_NOPE] and q_pe fp32 [n_tok, heads_pad, MLA_ROPE], copied; with
// pos (int32 [n_tok], device memory) q_pe rotated at pos[t] on the way, exactly as
// kernels/rope.h rotates it (theta; without pos q_pe comes rotated); values past qk_nope and
// qk_rope, and heads past H, are 0 (a model narrower than GLM-5 runs the kernels at their
// widths: the padding changes no dot product). qk_nope <= MLA_QK_NOPE, qk_rope <= MLA_ROPE
// (even), H <= heads_pad.
void mla_q_split(uint16_t *q_nope, float *q_pe, const float *q, const int32_t *pos, float theta,
                 int n_tok, int n_heads, int qk_nope, int qk_rope, int heads_pad,
                 cudaStream_t stream);

// Decode attention as above. ws_o fp32 [n_tok, n_split, H, 512] and ws_ml fp32
// [n_tok, n_split, H, 2] are the caller's workspace. indices int32 [n_tok, idx_stride] or NULL.
void mla_decode(uint16_t *out, const float *q_lat, const float *q_pe, const MlaCache *cache,
                const int32_t *block_table, int max_blocks, const int32_t *seq,
                const int32_t *kv_len, const int32_t *indices, int idx_stride, int n_tok,
                int n_heads, float sm_scale, int n_split, float *ws_o, float *ws_ml,
                cudaStream_t stream);

// mla_decode on the tensor cores (mma.sync, bf16 in, fp32 accumulate, fragments by ldmatrix),
// for prefill chunks and any token count, n_heads a multiple of 32. Its recipe differs from
// mla_decode's in two roundings: q (q_lat and q_pe) is rounded to bf16 once, and each
// probability, times the fp8 chunk scale of its position and the output column's chunk (1 for
// a bf16 cache), is rounded to bf16 before it weights the position's stored values (E4M3
// codes or bf16, exact); scores, softmax, the running sums and the output stay fp32 as in
// mla_decode: out = (sum_p bf16(p * scale) * value) / sum_p p, where p = 2^(x - M),
// x = (q . k) * mla_log2_scale(sm_scale) and M = ceil(max x) over every position the token attends (the kernel keeps a running
// integer maximum, so a tile's p differs from this one by a power of two, which bf16 rounding
// commutes with: the roundings do not depend on tiles or splits; kernels/mla_format.h). The
// same workspace and merge as mla_decode. The engine calls it with Backend.mla_tc (on unless
// GLMSPARK_MLA_TC=0), under which the CPU backend rounds the same p (tests/gpu/test_mla.c
// checks it against mla_decode_ref with q rounded, the probabilities' rounding in the
// tolerance).
void mla_decode_tc(uint16_t *out, const float *q_lat, const float *q_pe, const MlaCache *cache,
                   const int32_t *block_table, int max_blocks, const int32_t *seq,
                   const int32_t *kv_len, const int32_t *indices, int idx_stride, int n_tok,
                   int n_heads, float sm_scale, int n_split, float *ws_o, float *ws_ml,
                   cudaStream_t stream);

// mla_decode_tc with `heads` (32 or 64) heads a CTA, equal outputs for equal n_split (each
// head's arithmetic is the same); n_heads a multiple of heads, and mla_tc_heads_fit(heads):
// the device's per-block shared memory holds the width's (64: 142 KB, not on GB10).
// mla_decode_tc takes mla_tc_heads': 64 for few splits of long ranges (prefill chunks), 32
// otherwise.
void mla_decode_tc_heads(uint16_t *out, const float *q_lat, const float *q_pe,
                         const MlaCache *cache, const int32_t *block_table, int max_blocks,
                         const int32_t *seq, const int32_t *kv_len, const int32_t *indices,
                         int idx_stride, int n_tok, int n_heads, float sm_scale, int n_split,
                         float *ws_o, float *ws_ml, int heads, cudaStream_t stream);
bool mla_tc_heads_fit(int heads);
int mla_tc_heads(int n_tok, int n_heads, int n_split);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_MLA_H
