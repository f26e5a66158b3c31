/*
 * moe_ref.c - the router and the experts written out plainly, following transformers 5.17
 * models/glm_moe_dsa/modeling_glm_moe_dsa.py (GlmMoeDsaTopkRouter / route_tokens_to_experts).
 * The router is kernels/moe_router.h, the one the CPU and CUDA backends run, in moe.h's
 * order (descending choice) and with norm_topk_prob, as kernels/moe.cu computes it. The
 * experts' references read weights of either format (NVFP4 or bf16) through ref_weight().
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

// One stacked expert matrix [E, rows, cols] in either format, as the references read it:
// NVFP4 (q codes [E, rows, cols/2], s scales [E, rows, cols/16], g global scales [E, n_g], one
// per rows / n_g consecutive rows: w13's gate and up) or bf16 (w [E, rows, cols]).
typedef struct RefExperts {
    const uint8_t *q, *s;
    const float *g;
    int n_g;
    const uint16_t *w;  // bf16, or NULL for NVFP4
    int rows, cols;
} RefExperts;

// Expert e's W[r, c], exact.
static double ref_weight(const RefExperts *m, int e, int r, int c)
{
    const size_t per = (size_t) m->rows * m->cols;
    if (m->w) return kern_bf16_to_f32(m->w[e * per + (size_t) r * m->cols + c]);
    return nvfp4_weight_ref(m->q + e * per / 2, m->s + e * per / 16,
                            m->g[e * m->n_g + r / (m->rows / m->n_g)], m->cols, r, c);
}

static void w13_ref(float *act, float *g, float *u, float *g_abs, float *u_abs, const RefExperts *m,
                    const uint16_t *x, const int32_t *idx, int n_tok, int k, int hidden, int inter)
{
    for (int p = 0; p < n_tok * k; p++) {
        const int t = p / k, e = idx[p];
        const uint16_t *xt = x + (size_t) t * hidden;
        for (int i = 0; i < inter; i++) {
            double gv = 0.0, uv = 0.0, ga = 0.0, ua = 0.0;
            for (int c = 0; c < hidden; c++) {
                const double xv = kern_bf16_to_f32(xt[c]);
                const double tg = ref_weight(m, e, i, c) * xv;
                const double tu = ref_weight(m, e, inter + i, c) * xv;
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

static void w2_ref(float *out, float *out_abs, const RefExperts *m, const uint16_t *act,
                   const int32_t *idx, const float *w, int n_tok, int k, int hidden, int inter)
{
    for (int t = 0; t < n_tok; t++) {
        for (int r = 0; r < hidden; r++) {
            double sum = 0.0, sum_abs = 0.0;
            for (int j = 0; j < k; j++) {
                const int p = t * k + j, e = idx[p];
                for (int c = 0; c < inter; c++) {
                    const double term = w[p] * ref_weight(m, e, r, c)
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

void moe_w13_ref(float *act, float *g, float *u, float *g_abs, float *u_abs, const uint8_t *q13,
                 const uint8_t *s13, const float *g13, const uint16_t *x, const int32_t *idx,
                 int n_tok, int k, int hidden, int inter)
{
    const RefExperts m = {q13, s13, g13, 2, NULL, 2 * inter, hidden};
    w13_ref(act, g, u, g_abs, u_abs, &m, x, idx, n_tok, k, hidden, inter);
}

void moe_w2_ref(float *out, float *out_abs, const uint8_t *q2, const uint8_t *s2, const float *g2,
                const uint16_t *act, const int32_t *idx, const float *w, int n_tok, int k,
                int hidden, int inter)
{
    const RefExperts m = {q2, s2, g2, 1, NULL, hidden, inter};
    w2_ref(out, out_abs, &m, act, idx, w, n_tok, k, hidden, inter);
}

void moe_w13_bf16_ref(float *act, float *g, float *u, float *g_abs, float *u_abs,
                      const uint16_t *w13, const uint16_t *x, const int32_t *idx, int n_tok, int k,
                      int hidden, int inter)
{
    const RefExperts m = {NULL, NULL, NULL, 1, w13, 2 * inter, hidden};
    w13_ref(act, g, u, g_abs, u_abs, &m, x, idx, n_tok, k, hidden, inter);
}

void moe_w2_bf16_ref(float *out, float *out_abs, const uint16_t *w2, const uint16_t *act,
                     const int32_t *idx, const float *w, int n_tok, int k, int hidden, int inter)
{
    const RefExperts m = {NULL, NULL, NULL, 1, w2, hidden, inter};
    w2_ref(out, out_abs, &m, act, idx, w, n_tok, k, hidden, inter);
}
