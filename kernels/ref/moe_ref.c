/*
 * moe_ref.c - the router and the experts written out plainly, following transformers 5.17
 * models/glm_moe_dsa/modeling_glm_moe_dsa.py (GlmMoeDsaTopkRouter / route_tokens_to_experts).
 * The router is kernels/moe_router.h, the one the CPU and CUDA backends run, in moe.h's
 * order (descending choice) and with norm_topk_prob, as kernels/moe.cu computes it.
 */
#include "kernels/ref/moe_ref.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "kernels/moe_router.h"
#include "kernels/ref/kern_ref.h"
#include "kernels/ref/nvfp4_ref.h"

void moe_route_ref(int32_t *idx, float *w, double *choice, const float *logits,
                   const float *bias, int n_tok, int n_experts, int k, int n_group,
                   int topk_group, float scale)
{
    void *work = malloc(moe_router_work_bytes(n_experts, n_group));
    for (int t = 0; t < n_tok; t++)
        moe_router_token(idx + (size_t) t * k, w + (size_t) t * k,
                         choice ? choice + (size_t) t * n_experts : NULL,
                         logits + (size_t) t * n_experts, bias, n_experts, k, n_group,
                         topk_group, true, scale, false, work);
    free(work);
}

void moe_w13_ref(float *act, float *g, float *u, float *g_abs, float *u_abs, const uint8_t *q13,
                 const uint8_t *s13, const float *g13, const uint16_t *x, const int32_t *idx,
                 int n_tok, int k, int hidden, int inter)
{
    for (int p = 0; p < n_tok * k; p++) {
        const int t = p / k, e = idx[p];
        const uint16_t *xt = x + (size_t) t * hidden;
        const uint8_t *q = q13 + (size_t) e * 2 * inter * (hidden / 2);
        const uint8_t *s = s13 + (size_t) e * 2 * inter * (hidden / 16);
        for (int i = 0; i < inter; i++) {
            double gv = 0.0, uv = 0.0, ga = 0.0, ua = 0.0;
            for (int c = 0; c < hidden; c++) {
                const double xv = kern_bf16_to_f32(xt[c]);
                const double tg = nvfp4_weight_ref(q, s, g13[2 * e], hidden, i, c) * xv;
                const double tu = nvfp4_weight_ref(q, s, g13[2 * e + 1], hidden, inter + i, c) * xv;
                gv += tg;
                uv += tu;
                ga += fabs(tg);
                ua += fabs(tu);
            }
            const size_t o = (size_t) p * inter + i;
            act[o] = (float) (gv / (1.0 + exp(-gv)) * uv);
            if (g) g[o] = (float) gv;
            if (u) u[o] = (float) uv;
            if (g_abs) g_abs[o] = (float) ga;
            if (u_abs) u_abs[o] = (float) ua;
        }
    }
}

void moe_w2_ref(float *out, float *out_abs, const uint8_t *q2, const uint8_t *s2,
                const float *g2, const uint16_t *act, const int32_t *idx, const float *w,
                int n_tok, int k, int hidden, int inter)
{
    for (int t = 0; t < n_tok; t++) {
        for (int r = 0; r < hidden; r++) {
            double sum = 0.0, sum_abs = 0.0;
            for (int j = 0; j < k; j++) {
                const int p = t * k + j, e = idx[p];
                const uint8_t *q = q2 + (size_t) e * hidden * (inter / 2);
                const uint8_t *s = s2 + (size_t) e * hidden * (inter / 16);
                for (int c = 0; c < inter; c++) {
                    const double term = w[p] * nvfp4_weight_ref(q, s, g2[e], inter, r, c)
                                        * kern_bf16_to_f32(act[(size_t) p * inter + c]);
                    sum += term;
                    sum_abs += fabs(term);
                }
            }
            out[(size_t) t * hidden + r] = (float) sum;
            if (out_abs) out_abs[(size_t) t * hidden + r] = (float) sum_abs;
        }
    }
}
