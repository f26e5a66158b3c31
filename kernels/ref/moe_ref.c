/*
 * moe_ref.c - the router and the experts written out plainly, following
 * transformers 5.17 models/glm_moe_dsa/modeling_glm_moe_dsa.py (GlmMoeDsaTopkRouter / route_tokens_to_experts).
 */
#include "kernels/ref/moe_ref.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "kernels/ref/kern_ref.h"
#include "kernels/ref/nvfp4_ref.h"

void moe_route_ref(int32_t *idx, float *w, double *choice, const float *logits,
                   const float *bias, int n_tok, int n_experts, int k, int n_group,
                   int topk_group, float scale)
{
    double *s = malloc(sizeof(double) * n_experts);
    double *c = malloc(sizeof(double) * n_experts);
    double *gs = malloc(sizeof(double) * n_group);
    int *keep = malloc(sizeof(int) * n_group);
    const int per_group = n_experts / n_group;
    for (int t = 0; t < n_tok; t++) {
        for (int e = 0; e < n_experts; e++) {
            s[e] = 1.0 / (1.0 + exp(-(double) logits[(size_t) t * n_experts + e]));
            c[e] = s[e] + bias[e];
        }
        if (n_group > 1) {
            for (int g = 0; g < n_group; g++) {
                double best = -INFINITY, second = -INFINITY;
                for (int e = g * per_group; e < (g + 1) * per_group; e++) {
                    if (c[e] > best) {
                        second = best;
                        best = c[e];
                    } else if (c[e] > second) {
                        second = c[e];
                    }
                }
                gs[g] = best + second;
                keep[g] = 0;
            }
            for (int r = 0; r < topk_group; r++) {
                int b = -1;
                for (int g = 0; g < n_group; g++)
                    if (!keep[g] && (b < 0 || gs[g] > gs[b])) b = g;
                keep[b] = 1;
            }
            for (int e = 0; e < n_experts; e++)
                if (!keep[e / per_group]) c[e] = -INFINITY;
        }
        if (choice)
            for (int e = 0; e < n_experts; e++) choice[(size_t) t * n_experts + e] = c[e];
        double sum = 0.0;
        for (int r = 0; r < k; r++) {
            int b = -1;
            for (int e = 0; e < n_experts; e++)
                if (b < 0 || c[e] > c[b]) b = e;
            idx[(size_t) t * k + r] = b;
            w[(size_t) t * k + r] = (float) s[b];
            sum += s[b];
            c[b] = -INFINITY;
        }
        for (int r = 0; r < k; r++) {
            const int e = idx[(size_t) t * k + r];
            w[(size_t) t * k + r] = (float) (s[e] / (sum + 1e-20) * scale);
        }
    }
    free(s);
    free(c);
    free(gs);
    free(keep);
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
