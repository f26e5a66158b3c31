/*
 * test_norm.c - kernels/norm.cu, rope.cu and act.cu against kernels/ref/norm_ref.c.
 *
 * Tolerances: the statistics are fp32 sums of d terms (relative error <= d * FLT_EPSILON, which
 * moves the output by as much through rsqrt), then one bf16 rounding (at most 2^-8
 * relative: 8 significant bits). RoPE: the angle is exact to double precision on both sides; fp32 rotation costs a
 * few ulp of |x0| + |x1|. SwiGLU: fp32 expf (a few ulp), then bf16 rounding.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "kernels/act.h"
#include "kernels/norm.h"
#include "kernels/ref/norm_ref.h"
#include "kernels/rope.h"
#include "tests/gpu/gpu_util.h"

static uint64_t rng = 3;

static void test_norm(int n, int d, int x_stride, int out_stride, int layer)
{
    float *x = xmalloc((size_t) n * x_stride * 4), *w = xmalloc(d * 4), *b = xmalloc(d * 4);
    fill_f32(x, (size_t) n * x_stride, &rng, -3.0f, 5.0f);
    fill_f32(w, d, &rng, 0.5f, 1.5f);
    fill_f32(b, d, &rng, -0.5f, 0.5f);
    float *want = xmalloc((size_t) n * d * 4), *got = xmalloc((size_t) n * d * 4);
    float *tol = xmalloc((size_t) n * d * 4);
    uint16_t *gb = xmalloc((size_t) n * out_stride * 2);
    const float eps = 1e-5f;
    if (layer)
        norm_layer_ref(want, x, w, b, eps, n, d, x_stride);
    else
        norm_rms_ref(want, x, w, eps, n, d, x_stride);
    float *d_x = gpu_upload(x, (size_t) n * x_stride * 4), *d_w = gpu_upload(w, d * 4);
    float *d_b = gpu_upload(b, d * 4);
    uint16_t *d_o = gpu_alloc_poisoned((size_t) n * out_stride * 2);
    if (layer)
        norm_layer(d_o, d_x, d_w, d_b, eps, n, d, x_stride, out_stride, 0);
    else
        norm_rms(d_o, d_x, d_w, eps, n, d, x_stride, out_stride, 0);
    gpu_download(gb, d_o, (size_t) n * out_stride * 2);
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < d; j++) {
            const size_t o = (size_t) i * d + j;
            got[o] = kern_bf16_to_f32(gb[(size_t) i * out_stride + j]);
            const float centred = layer ? fabsf(want[o] - b[j]) : fabsf(want[o]);
            tol[o] = ldexpf(fabsf(want[o]), -8) + (float) ((d + 16) * FLT_EPSILON) * (centred + fabsf(b[j]) * layer);
        }
    }
    char name[64];
    snprintf(name, sizeof name, "%s n=%d d=%d", layer ? "layernorm" : "rmsnorm", n, d);
    compare(name, got, want, tol, 0, (size_t) n * d, 1e-4);
    cudaFree(d_x), cudaFree(d_w), cudaFree(d_b), cudaFree(d_o);
    free(x), free(w), free(b), free(want), free(got), free(tol), free(gb);
}

static void test_rope(int n_tok, int n_heads, int head_stride, int offset, int rot_dim, float theta)
{
    const size_t n = (size_t) n_tok * n_heads * head_stride;
    float *x = xmalloc(n * 4), *want = xmalloc(n * 4), *got = xmalloc(n * 4), *tol = xmalloc(n * 4);
    int32_t *pos = xmalloc(n_tok * 4);
    fill_f32(x, n, &rng, -2.0f, 2.0f);
    for (int t = 0; t < n_tok; t++) pos[t] = (int32_t) (kern_rand_u64(&rng) % 1000000);
    pos[0] = 0;
    for (size_t i = 0; i < n; i++) want[i] = x[i];
    rope_interleaved_ref(want, pos, n_tok, n_heads, head_stride, offset, rot_dim, theta);
    float *d_x = gpu_upload(x, n * 4);
    int32_t *d_pos = gpu_upload(pos, n_tok * 4);
    rope_interleaved(d_x, d_pos, n_tok, n_heads, head_stride, offset, rot_dim, theta, 0);
    gpu_download(got, d_x, n * 4);
    for (size_t i = 0; i < n; i++) tol[i] = 8 * FLT_EPSILON * 4.0f;  // |x0| + |x1| <= 4
    char name[64];
    snprintf(name, sizeof name, "rope tok=%d heads=%d rot=%d", n_tok, n_heads, rot_dim);
    compare(name, got, want, tol, 0, n, 1e-12);
    cudaFree(d_x), cudaFree(d_pos);
    free(x), free(want), free(got), free(tol), free(pos);
}

static void test_act(int n, int inter)
{
    float *gu = xmalloc((size_t) n * 2 * inter * 4), *want = xmalloc((size_t) n * inter * 4);
    float *got = xmalloc((size_t) n * inter * 4), *tol = xmalloc((size_t) n * inter * 4);
    uint16_t *gb = xmalloc((size_t) n * inter * 2);
    fill_f32(gu, (size_t) n * 2 * inter, &rng, -8.0f, 8.0f);
    act_silu_mul_ref(want, gu, n, inter);
    float *d_gu = gpu_upload(gu, (size_t) n * 2 * inter * 4);
    uint16_t *d_o = gpu_alloc_poisoned((size_t) n * inter * 2);
    act_silu_mul(d_o, d_gu, n, inter, 0);
    gpu_download(gb, d_o, (size_t) n * inter * 2);
    for (size_t i = 0; i < (size_t) n * inter; i++) {
        got[i] = kern_bf16_to_f32(gb[i]);
        tol[i] = ldexpf(fabsf(want[i]), -8) + 16 * FLT_EPSILON * fabsf(want[i]) + 1e-30f;
    }
    char name[64];
    snprintf(name, sizeof name, "silu*mul n=%d inter=%d", n, inter);
    compare(name, got, want, tol, 0, (size_t) n * inter, 1e-4);
    cudaFree(d_gu), cudaFree(d_o);
    free(gu), free(want), free(got), free(tol), free(gb);
}

int main(void)
{
    test_norm(1, 1, 1, 1, 0);
    test_norm(3, 300, 301, 305, 0);
    test_norm(16, 6144, 6144, 6144, 0);
    test_norm(5, 2048, 2048 + 576, 2048, 0);  // q_a slice of the fused q_a + kv_a output
    test_norm(3, 512, 576, 576, 0);           // the c_kv slice of kv_a, in registers
    test_norm(2, 8192, 8192, 8192, 0);        // the longest row held in registers
    test_norm(2, 8196, 8196, 8196, 0);        // one piece past it: the looping kernel
    test_norm(7, 128, 128, 128, 1);          // the indexer's k_norm
    test_norm(2, 1000, 1003, 1000, 1);
    test_rope(1, 1, 2, 0, 2, 10000.0f);
    test_rope(5, 64, 256, 192, 64, 8e6f);  // MLA q_pe
    test_rope(9, 32, 128, 0, 64, 8e6f);    // indexer q (rope dims first)
    test_act(1, 1);
    test_act(3, 2048);
    test_act(16, 12288);
    return check_exit();
}
