/*
 * test_rope.c - the CPU backend's interleaved RoPE against the direct formula, in double.
 *
 * For pair i of a head (elements 2i, 2i+1) at position p, with f_i = theta^(-2i/d):
 *   out[i]       = x[2i] cos(p f_i) - x[2i+1] sin(p f_i)
 *   out[d/2 + i] = x[2i+1] cos(p f_i) + x[2i] sin(p f_i)
 * (transformers' apply_rotary_pos_emb_interleave writes the rotated pairs de-interleaved).
 * Elements outside [offset, offset + d) of each head must not change.
 *
 * Tolerance: the backend, like transformers, forms the angle in fp32: f_i from powf and a
 * division (about 2 ulp together) and p * f_i (0.5 ulp), so the angle is off by at most
 * 3 * 2^-24 * angle relative; cos and sin move by at most that much, and the products and
 * sum add a few fp32 roundings of |x|. Bound: (|x0| + |x1|) * (3 * 2^-24 * angle + 4 * 2^-24).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/backend.h"
#include "engine/shared/err.h"
#include "tests/check.h"

static float frand(void)
{
    return 2.0f * (float) rand() / (float) RAND_MAX - 1.0f;
}

static void test_shape(Backend *be, int n, int H, int head_stride, int offset, int d, float theta,
                       int pos_base)
{
    const int stride = H * head_stride + 3;  // rows with padding after the heads
    float *x = malloc((size_t) n * stride * sizeof *x);
    float *x0 = malloc((size_t) n * stride * sizeof *x0);
    int *pos = malloc((size_t) n * sizeof *pos);
    ASSERT(x && x0 && pos);
    for (int i = 0; i < n * stride; i++)
        x0[i] = x[i] = frand();
    for (int t = 0; t < n; t++)
        pos[t] = pos_base + t * 37;

    be->rope(be, x, n, H, stride, head_stride, offset, d, pos, theta);

    int untouched = 1;
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < H; h++) {
            const float *in = x0 + (size_t) t * stride + (size_t) h * head_stride;
            const float *out = x + (size_t) t * stride + (size_t) h * head_stride;
            for (int i = 0; i < head_stride; i++)
                if (i < offset || i >= offset + d) untouched &= in[i] == out[i];
            for (int i = 0; i < d / 2; i++) {
                const double f = pow((double) theta, -2.0 * i / d);
                const double angle = pos[t] * f;
                const double a = in[offset + 2 * i], b = in[offset + 2 * i + 1];
                const double tol = (fabs(a) + fabs(b)) * (3.0 * angle + 4.0) * 0x1.0p-24;
                CHECK_NEAR(out[offset + i], a * cos(angle) - b * sin(angle), tol);
                CHECK_NEAR(out[offset + d / 2 + i], b * cos(angle) + a * sin(angle), tol);
            }
        }
        for (int i = H * head_stride; i < stride; i++)
            untouched &= x0[(size_t) t * stride + i] == x[(size_t) t * stride + i];
    }
    CHECK(untouched);
    free(x);
    free(x0);
    free(pos);
}

int main(void)
{
    srand(1);
    Backend *be = NULL;
    ASSERT(backend_cpu_create(2, &be) == ERR_OK);
    test_shape(be, 1, 1, 2, 0, 2, 10000.0f, 0);           // one pair, position 0: identity
    test_shape(be, 5, 4, 24, 16, 8, 10000.0f, 3);         // rope after the nope part (MLA q)
    test_shape(be, 7, 1, 72, 64, 8, 1000000.0f, 11);      // the shared k_pe after the latent
    test_shape(be, 3, 2, 16, 0, 8, 10000.0f, 4000);       // indexer layout, far positions
    test_shape(be, 2, 3, 64, 0, 64, 1000000.0f, 100000);  // GLM-5's theta and rope width
    be->destroy(be);
    return check_exit();
}
