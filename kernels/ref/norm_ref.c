/*
 * norm_ref.c - element-wise references: norms, rotary embedding, SwiGLU; double throughout.
 */
#include "kernels/ref/norm_ref.h"

#include <math.h>
#include <stddef.h>

void norm_rms_ref(float *out, const float *x, const float *w, float eps, int n, int d,
                  int x_stride)
{
    for (int i = 0; i < n; i++) {
        const float *xr = x + (size_t) i * x_stride;
        double ss = 0.0;
        for (int j = 0; j < d; j++) ss += (double) xr[j] * xr[j];
        const double inv = 1.0 / sqrt(ss / d + eps);
        for (int j = 0; j < d; j++) out[(size_t) i * d + j] = (float) (xr[j] * inv * w[j]);
    }
}

void norm_layer_ref(float *out, const float *x, const float *w, const float *b, float eps, int n,
                    int d, int x_stride)
{
    for (int i = 0; i < n; i++) {
        const float *xr = x + (size_t) i * x_stride;
        double mean = 0.0;
        for (int j = 0; j < d; j++) mean += xr[j];
        mean /= d;
        double var = 0.0;
        for (int j = 0; j < d; j++) var += (xr[j] - mean) * (xr[j] - mean);
        var /= d;
        const double inv = 1.0 / sqrt(var + eps);
        for (int j = 0; j < d; j++)
            out[(size_t) i * d + j] = (float) ((xr[j] - mean) * inv * w[j] + b[j]);
    }
}

void rope_interleaved_ref(float *x, const int32_t *pos, int n_tok, int n_heads, int head_stride,
                          int offset, int rot_dim, float theta)
{
    for (int t = 0; t < n_tok; t++) {
        for (int i = 0; i < rot_dim / 2; i++) {
            const double a = pos[t] * pow((double) theta, -2.0 * i / rot_dim);
            const double c = cos(a), s = sin(a);
            for (int h = 0; h < n_heads; h++) {
                float *p = x + ((size_t) t * n_heads + h) * head_stride + offset + 2 * i;
                const double x0 = p[0], x1 = p[1];
                p[0] = (float) (x0 * c - x1 * s);
                p[1] = (float) (x1 * c + x0 * s);
            }
        }
    }
}

void act_silu_mul_ref(float *out, const float *gu, int n, int inter)
{
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < inter; j++) {
            const double g = gu[(size_t) t * 2 * inter + j];
            const double u = gu[(size_t) t * 2 * inter + inter + j];
            out[(size_t) t * inter + j] = (float) (g / (1.0 + exp(-g)) * u);
        }
    }
}
