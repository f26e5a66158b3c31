/*
 * moe_ref.h - router and routed-expert references (kernels/moe.h), in double.
 *
 * Expert weight layout as moe.h (q13/s13/g13 with gate rows then up rows; q2/s2/g2; or the
 * bf16 stacks w13 [E, 2*inter, hidden] and w2 [E, hidden, inter] of MoeExpertsBf16).
 *
 * Ownership: none; host pointers borrowed for the call. Threads: pure. Errors: none.
 */
#ifndef KERNELS_REF_MOE_REF_H
#define KERNELS_REF_MOE_REF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Router as moe.h: sigmoid, bias, group limit, top-k (descending, ties to lower index),
// renormalize, scale. choice (or NULL) gets the biased, group-masked scores [n_tok, E] so
// tests can check selections against near-ties.
void moe_route_ref(int32_t *idx, float *w, double *choice, const float *logits,
                   const float *bias, int n_tok, int n_experts, int k, int n_group,
                   int topk_group, float scale);

// act [n_tok*k, inter] = SiLU(gate) * up, unrounded; g, u, g_abs, u_abs (each [n_tok*k, inter],
// any may be NULL) get the two projections and their sum |terms| for tolerances.
void moe_w13_ref(float *act, float *g, float *u, float *g_abs, float *u_abs, const uint8_t *q13,
                 const uint8_t *s13, const float *g13, const uint16_t *x, const int32_t *idx,
                 int n_tok, int k, int hidden, int inter);

// out [n_tok, hidden] = sum_j w[t,j] * down_{idx[t,j]}(act[t*k+j]) (no residual);
// out_abs (or NULL) = the sum of |terms|.
void moe_w2_ref(float *out, float *out_abs, const uint8_t *q2, const uint8_t *s2,
                const float *g2, const uint16_t *act, const int32_t *idx, const float *w,
                int n_tok, int k, int hidden, int inter);

// The same two references for experts stored in bf16 (moe_experts_bf16_w13 / _w2): w13 bf16
// [E, 2*inter, hidden], w2 bf16 [E, hidden, inter]; outputs as above.
void moe_w13_bf16_ref(float *act, float *g, float *u, float *g_abs, float *u_abs,
                      const uint16_t *w13, const uint16_t *x, const int32_t *idx, int n_tok, int k,
                      int hidden, int inter);
void moe_w2_bf16_ref(float *out, float *out_abs, const uint16_t *w2, const uint16_t *act,
                     const int32_t *idx, const float *w, int n_tok, int k, int hidden, int inter);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_REF_MOE_REF_H
