/*
 * norm_ref.c - element-wise references: norms, rotary embedding, SwiGLU; double throughout.
 */
#include "kernels/ref/norm_ref.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "kernels/rope_format.h"

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

void rope_glm_ref(float *x, const int32_t *pos, int n_tok, int n_heads, int stride,
                  int head_stride, int offset, int rot_dim, float theta)
{
    const int half = rot_dim / 2;
    double tmp[2048];
    if (rot_dim % 2 != 0 || rot_dim > 2048) abort();  // rope.h's contract
    for (int t = 0; t < n_tok; t++) {
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (size_t) t * stride + (size_t) h * head_stride + offset;
            for (int i = 0; i < half; i++) {
                const double a = (double) ((float) pos[t] * rope_inv_freq(i, rot_dim, theta));
                tmp[i] = v[2 * i] * cos(a) - v[2 * i + 1] * sin(a);
                tmp[half + i] = v[2 * i + 1] * cos(a) + (double) v[2 * i] * sin(a);
            }
            for (int i = 0; i < rot_dim; i++)
                v[i] = (float) tmp[i];
        }
    }
}

void act_silu_mul_ref(float *y, const float *gate, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const double g = gate[i];
        y[i] = (float) (g / (1.0 + exp(-g)) * up[i]);
    }
}
