/*
 * moe.h - mixture-of-experts decode: the fused router and the routed experts in NVFP4.
 *
 * Router (GLM-5 / DeepSeek-V3 "noaux_tc", transformers 5.17 GlmMoeDsaTopkRouter): exactly
 * kernels/moe_router.h's moe_router_token() for each token (sigmoid, biased choice, group
 * scores, ties to the lower expert index, the weight sum in ascending expert order, all in
 * double), so the GPU and the CPU backend choose the same experts with the same weights bit
 * for bit. logits come from the router weight's GEMV (fp32).

 * Experts, stacked, as the checkpoint stores them per expert (layout of nvfp4.h):
 *
 *   q13    uint8 [E, 2*inter, hidden/2]   rows [0, inter) = gate_proj, [inter, 2 inter) = up_proj
 *   s13    uint8 [E, 2*inter, hidden/16]
 *   g13    fp32  [E, 2]                   weight_scale_2 of gate and of up (kept separate)
 *   q2     uint8 [E, hidden, inter/2]     down_proj
 *   s2     uint8 [E, hidden, inter/16]
 *   g2     fp32  [E]
 *
 * moe_experts_w13: for each (token t, slot j), expert e = idx[t, j]:
 *   act[t*k + j, i] = bf16( SiLU(gate_e(x_t)[i]) * up_e(x_t)[i] )         bf16 [n_tok*k, inter]
 * moe_experts_w2: out[t, :] = residual[t, :] + sum_j w[t, j] * down_{idx[t,j]}(act[t*k + j])
 *   out, residual fp32 [n_tok, hidden]; out may alias residual. The weighted sum and the
 *   residual add are fused; slots are added in a fixed order, so results are reproducible.
 *
 * Numerics of the products: as nvfp4.h (exact dequantization, fp32 accumulation per group).
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

typedef struct MoeExperts {
    const uint8_t *q13, *s13;  // [E, 2*inter, hidden/2], [E, 2*inter, hidden/16]
    const float *g13;          // [E, 2]
    const uint8_t *q2, *s2;    // [E, hidden, inter/2], [E, hidden, inter/16]
    const float *g2;           // [E]
    int n_experts;
    int hidden;  // multiple of 32
    int inter;   // multiple of 64
} MoeExperts;

// idx int32 [n_tok, k], w fp32 [n_tok, k], logits fp32 [n_tok, n_experts], bias fp32
// [n_experts] or NULL. n_experts % n_group == 0; 1 <= topk_group <= n_group; k <= n_experts.
// is_ascending: each token's experts in ascending id order, else in the order chosen.
void moe_route(int32_t *idx, float *w, const float *logits, const float *bias, int n_tok,
               int n_experts, int k, int n_group, int topk_group, bool norm_topk_prob, float scale,
               bool is_ascending, cudaStream_t stream);

// act bf16 [n_tok*k, inter]; x bf16 [n_tok, hidden]; idx int32 [n_tok, k].
void moe_experts_w13(uint16_t *act, const MoeExperts *ex, const uint16_t *x, const int32_t *idx,
                     int n_tok, int k, cudaStream_t stream);

// out fp32 [n_tok, hidden]; act bf16 [n_tok*k, inter]; idx, w [n_tok, k]; residual or NULL.
void moe_experts_w2(float *out, const MoeExperts *ex, const uint16_t *act, const int32_t *idx,
                    const float *w, const float *residual, int n_tok, int k,
                    cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_MOE_H
