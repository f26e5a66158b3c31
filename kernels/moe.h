/*
 * moe.h - mixture-of-experts decode: the fused router and the routed experts in NVFP4 or bf16.
 *
 * Router (GLM-5 / DeepSeek-V3 "noaux_tc", transformers 5.17 GlmMoeDsaTopkRouter): exactly
 * kernels/moe_router.h's moe_router_token() for each token (sigmoid, biased choice, group
 * scores, ties to the lower expert index, the weight sum in ascending expert order, all in
 * double), so the GPU and the CPU backend choose the same experts with the same weights bit
 * for bit. logits come from the router weight's GEMV (fp32).

 * Experts, stacked (E experts of one layer) and packed at load by moe_pack_w13/moe_pack_w2
 * from the checkpoint's layout (nvfp4_format.h: codes [rows, K/2], scales [rows, K/16]) into 16-row
 * tiles for the tensor-core kernels (moe.cu); the packed arrays have the same sizes:
 *
 *   q13, s13  expert e's gate (rows [0, inter)) and up ([inter, 2 inter)), hidden columns:
 *             inter/8 tiles, each 8 gate + 8 up rows of the same features
 *   g13       fp32 [E, 2]   weight_scale_2 of gate and of up
 *   q2, s2    down, hidden rows of inter columns: hidden/16 tiles
 *   g2        fp32 [E]
 *   A tile of K columns: 8*K code bytes then K scale bytes per tile, tiles in order.
 *
 * A step (n_tok tokens, k slots, n_tok * k <= MOE_MAX_CHUNK_PAIRS):
 *   moe_group: work int32 [moe_work_ints] = the pairs p = t*k + j grouped by expert idx[p]
 *     into tiles of <= MOE_TILE_COLS, ascending expert; up to MOE_MAX_PAIRS pairs (decode) in
 *     slot order within an expert, by one block; more (a prefill chunk) in the order atomics
 *     give them, by three launches. A pair's outputs do not depend on its tile or column, so
 *     both give the same results bit for bit; larger chunks read each expert fewer times
 *     (a tile reads its whole expert: ~pairs / 8 + experts reads a chunk).
 *   moe_experts_w13: act[p, i] = bf16( SiLU(gate_e(x_t)[i]) * up_e(x_t)[i] ), x fp32
 *     [n_tok, hidden] rounded to bf16 as read; act bf16 [n_tok*k, inter].
 *   moe_experts_w2: y[p, :] = w[p] * down_e(act[p]), y fp32 [n_tok*k, hidden].
 *   moe_combine: out[t, :] = residual[t, :] + sum_j y[t*k + j, :] (j ascending); out may
 *     alias residual; residual may be NULL.
 * Experts stored in bf16 (MoeExpertsBf16: the checkpoint's layout, stacked, not packed) take
 * the same work list, act, y and moe_combine, on CUDA cores (decode is bandwidth-bound):
 *   moe_experts_bf16_w13: act[p, i] = bf16( SiLU(gate_e(x_t)[i]) * up_e(x_t)[i] ), x fp32
 *     [n_tok, hidden] rounded to bf16 (nearest even) as read, weights exact.
 *   moe_experts_bf16_w2: y[p, :] = w[p] * down_e(act[p]) fp32.
 *   Their products are exact in fp32 (bf16 x bf16); the sums run in fp32 in a fixed order:
 *   lane l of a warp adds 8-value chunks l, l + 32, ... of a row in ascending order (the
 *   values of a chunk in order, from 0), then a butterfly over the 32 lanes. A pair's outputs
 *   depend on its row alone, so both groupings again give the same bits. Each tile reads its
 *   expert's weights once (16-byte loads, shared by its <= 8 pairs), so a step reads its
 *   selected experts once per 8 pairs, inactive experts not at all.
 *   Dynamic shared memory: min(n_tok, 8) * K * 2 bytes (K: hidden for w13, inter for w2), at
 *   most moe_experts_smem_bytes(hidden, inter).
 * Both formats end in the same fp32 formulas: act = bf16(g / (1 + expf(-g)) * u) from the fp32
 * gate g and up u, and y = dot * m, dot the fp32 down product and m = w[p] (NVFP4: times the
 * scales).
 *
 * Numerics of the products: the weights and the bf16 inputs are exact on the tensor cores
 * (inputs scaled per column by a power of two; only magnitudes below 2^-27 of a column's
 * largest lose bits), fp32 accumulation over all of K (ref/moe_ref.c accumulates in double:
 * the sums differ in order and precision only).
 *
 * Ownership: borrowed pointers. Threads: thread-safe launchers. Errors: ASSERT on bad shapes;
 * CUDA failures fatal. Launchers never allocate and never synchronize; expert indices are read
 * on the device, so the whole MoE block can be captured in a CUDA graph.
 */
#ifndef KERNELS_MOE_H
#define KERNELS_MOE_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_MAX_EXPERTS 512
#define MOE_MAX_K 16
#define MOE_MAX_GROUPS 32
#define MOE_TILE_COLS 8    // pairs of one expert per tensor-core tile
#define MOE_MAX_PAIRS 512  // n_tok * k that moe_group's one-block grouping takes (decode)
#define MOE_MAX_CHUNK_PAIRS 8192  // n_tok * k of one launch (a 1,024-token prefill chunk at k 8)

typedef struct MoeExperts {
    const uint8_t *q13, *s13;  // [E, 2*inter, hidden/2], [E, 2*inter, hidden/16]
    const float *g13;          // [E, 2]
    const uint8_t *q2, *s2;    // [E, hidden, inter/2], [E, hidden, inter/16]
    const float *g2;           // [E]
    int n_experts;
    int hidden;  // multiple of 16
    int inter;   // multiple of 16
} MoeExperts;

// idx int32 [n_tok, k], w fp32 [n_tok, k], logits fp32 [n_tok, n_experts], bias fp32
// [n_experts] or NULL. n_experts % n_group == 0; 1 <= topk_group <= n_group; k <= n_experts.
// is_ascending: each token's experts in ascending id order, else in the order chosen.
void moe_route(int32_t *idx, float *w, const float *logits, const float *bias, int n_tok,
               int n_experts, int k, int n_group, int topk_group, bool norm_topk_prob, float scale,
               bool is_ascending, cudaStream_t stream);

// Packing one expert, device memory to device memory (the outputs do not alias the inputs):
// its gate and up stacked (codes [2*inter, hidden/2], scales [2*inter, hidden/16]) or its
// down (codes [hidden, inter/2], scales [hidden, inter/16]); hidden and inter multiples of 16.
void moe_pack_w13(uint8_t *q_out, uint8_t *s_out, const uint8_t *q, const uint8_t *s, int inter,
                  int hidden, cudaStream_t stream);
void moe_pack_w2(uint8_t *q_out, uint8_t *s_out, const uint8_t *q, const uint8_t *s, int hidden,
                 int inter, cudaStream_t stream);

// int32 count of moe_group's work list for n_pairs pairs.
size_t moe_work_ints(int n_pairs, int n_experts);
void moe_group(int32_t *work, const int32_t *idx, int n_tok, int k, int n_experts,
               cudaStream_t stream);
// moe_route (without group limits: n_group == topk_group) and moe_group in one launch, a
// decode step's: idx, w and work bit for bit what the two write. moe_route_group_ok says
// whether it takes the step (at most MOE_ROUTE_GROUP_MAX_TOK tokens: one block routes them
// all, where moe_route runs a block a token, so its rank pass grows with the tokens: run 25
// measured 8 here against 2 on one H100, batch 8 5.456 against 5.410 ms, batch 16 10.555 against
// 10.496, so 2; a build may set it, -DMOE_ROUTE_GROUP_MAX_TOK=8 in CMAKE_CUDA_FLAGS, to measure).
#ifndef MOE_ROUTE_GROUP_MAX_TOK
#define MOE_ROUTE_GROUP_MAX_TOK 2
#endif
#define MOE_ROUTE_GROUP_SMEM (32 * 1024)  // bytes of scores and choices the block holds
bool moe_route_group_ok(int n_tok, int n_experts, int k, int n_group, int topk_group);
void moe_route_group(int32_t *work, int32_t *idx, float *w, const float *logits,
                     const float *bias, int n_tok, int n_experts, int k, bool norm_topk_prob,
                     float scale, bool is_ascending, cudaStream_t stream);
// The dynamic shared memory (bytes) the two expert launches need at these widths: a tile's
// MOE_TILE_COLS staged columns of the longer K (hidden for w13, inter for w2). A GPU whose
// cudaDevAttrMaxSharedMemoryPerBlockOptin is smaller cannot run them (GB10: 101,376 bytes;
// GLM-5's hidden 6144 needs 98,432).
size_t moe_experts_smem_bytes(int hidden, int inter);

void moe_experts_w13(uint16_t *act, const MoeExperts *ex, const float *x, const int32_t *work,
                     int n_tok, int k, cudaStream_t stream);
void moe_experts_w2(float *y, const MoeExperts *ex, const uint16_t *act, const int32_t *work,
                    const float *w, int n_tok, int k, cudaStream_t stream);
void moe_combine(float *out, const float *y, const float *residual, int n_tok, int k, int hidden,
                 cudaStream_t stream);
// moe_experts_w2, then moe_combine(out, y, residual, ...), in one launch (a decode step's): the
// last tile to finish a block of rows sums them, so out and y are bit for bit what the two
// launches write. cnt: int32 [moe_combine_counters(hidden)], zero before the first call and
// zero again after each (one set per stream at a time). The last tile's block sums n_tok rows
// of 128 outputs alone: meant for a decode step's few tokens (MOE_COMBINE_FUSED_MAX_TOK).
#define MOE_COMBINE_FUSED_MAX_TOK 16
size_t moe_combine_counters(int hidden);
void moe_experts_w2_combine(float *out, float *y, const float *residual, int32_t *cnt,
                            const MoeExperts *ex, const uint16_t *act, const int32_t *work,
                            const float *w, int n_tok, int k, cudaStream_t stream);

// Experts stored in bf16, stacked (one allocation per array, 16-byte aligned), row-major:
typedef struct MoeExpertsBf16 {
    const uint16_t *w13;  // [E, 2*inter, hidden]: expert e's gate rows [0, inter) then its up
                          // rows [inter, 2 inter)
    const uint16_t *w2;   // [E, hidden, inter]
    int n_experts;
    int hidden;  // multiple of 8
    int inter;   // multiple of 8
} MoeExpertsBf16;

// The bf16 counterparts of moe_experts_w13 / moe_experts_w2 (above): the same work (from
// moe_group), x, act, w and y, the same preconditions (k <= MOE_MAX_K, n_tok * k <=
// MOE_MAX_CHUNK_PAIRS, x 16-byte and act 8-byte aligned); moe_combine follows as before.
void moe_experts_bf16_w13(uint16_t *act, const MoeExpertsBf16 *ex, const float *x,
                          const int32_t *work, int n_tok, int k, cudaStream_t stream);
void moe_experts_bf16_w2(float *y, const MoeExpertsBf16 *ex, const uint16_t *act,
                         const int32_t *work, const float *w, int n_tok, int k,
                         cudaStream_t stream);

// Prefill's wide tiles: the same products over tiles of up to MOE_WIDE_COLS pairs of one
// expert, up to MOE_MAX_WIDE_PAIRS pairs a launch, so that each expert is read once per 64 of
// its pairs instead of once per 8 (a 4,096-token chunk at GLM's k 8 and 156 experts: ~210
// pairs an expert, 4 tiles). Each decoded weight fragment feeds up to 8 MMAs. A small kernel
// first stages each input row once in the work list (its largest magnitude, its power-of-two
// factor, the row in f16 times that factor: what the 8-column kernels stage per tile); the
// tiles then copy WIDE_KC (512) staged values of K at a time into shared memory, two blocks
// an SM so that one block's copy overlaps the other's MMAs. The staged values and the products
// equal the 8-column kernels'; the fp32 sums run in one chain per column instead of two, so
// outputs differ from moe_experts_w13 / w2's in summation order only (tests/gpu/test_moe.c
// holds both to the reference's bound). work: int32 [moe_wide_work_ints(ex, n_tok, k)] (the
// list, its grouping's counters, the rows' factors and staged rows), grouped by
// moe_group_wide; act, y and moe_combine as above. Shared memory: moe_wide_smem_bytes()
// (66,560 bytes a block: GB10's opt-in limit is 101,376, one block an SM there). Each expert
// launch also writes its rows into work, so a work list serves one stream's launches in order
// (group, w13, w2), not two streams at once.
#define MOE_WIDE_COLS 64
#ifndef MOE_MAX_WIDE_PAIRS  // a build may set it (e.g. 65536: 8,192-token launches), to measure
#define MOE_MAX_WIDE_PAIRS 32768  // n_tok * k of one wide launch (4,096 tokens at k 8)
#endif
size_t moe_wide_work_ints(const MoeExperts *ex, int n_tok, int k);
size_t moe_wide_smem_bytes(void);
void moe_group_wide(int32_t *work, const int32_t *idx, int n_tok, int k, int n_experts,
                    cudaStream_t stream);
void moe_experts_w13_wide(uint16_t *act, const MoeExperts *ex, const float *x, int32_t *work,
                          int n_tok, int k, cudaStream_t stream);
void moe_experts_w2_wide(float *y, const MoeExperts *ex, const uint16_t *act, int32_t *work,
                         const float *w, int n_tok, int k, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_MOE_H
