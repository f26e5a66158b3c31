/*
 * test_norm.c - kernels/norm.cu, rope.cu and act.cu against kernels/ref/norm_ref.c.
 *
 * Tolerances: the statistics are fp32 sums of d terms (relative error <= d * FLT_EPSILON, which
 * moves the output by as much through rsqrt), then one bf16 rounding (at most 2^-8
 * relative: 8 significant bits). RoPE: inv_freq comes from the host on both sides
 * (kernels/rope_format.h) and the angle is one fp32 product, so only cos and sin (double,
 * rounded to fp32) and the fp32 rotation differ: a few ulp of |x0| + |x1|.
 * Dims outside the rotated range must come back untouched. SwiGLU: the same double formula,
 * rounded once (a few ulp for the device's exp). The add: exact.
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

static void test_rope(int n_tok, int n_heads, int stride, int head_stride, int offset,
                      int rot_dim, float theta)
{
    const size_t n = (size_t) n_tok * stride;
    float *x = xmalloc(n * 4), *want = xmalloc(n * 4), *got = xmalloc(n * 4), *tol = xmalloc(n * 4);
    int32_t *pos = xmalloc(n_tok * 4);
    fill_f32(x, n, &rng, -2.0f, 2.0f);
    for (int t = 0; t < n_tok; t++) pos[t] = (int32_t) (kern_rand_u64(&rng) % 300000);
    pos[0] = 0;
    for (size_t i = 0; i < n; i++) {
        want[i] = x[i];
        tol[i] = 0.0f;
    }
    rope_glm_ref(want, pos, n_tok, n_heads, stride, head_stride, offset, rot_dim, theta);
    for (int t = 0; t < n_tok; t++) {
        for (int h = 0; h < n_heads; h++) {
            const size_t base = (size_t) t * stride + (size_t) h * head_stride + offset;
            for (int i = 0; i < rot_dim / 2; i++) {
                const double mag = fabs(x[base + 2 * i]) + fabs(x[base + 2 * i + 1]);
                tol[base + i] = tol[base + rot_dim / 2 + i] = (float) (mag * 8 * FLT_EPSILON);
            }
        }
    }
    float *d_x = gpu_upload(x, n * 4);
    int32_t *d_pos = gpu_upload(pos, n_tok * 4);
    rope_glm(d_x, d_pos, n_tok, n_heads, stride, head_stride, offset, rot_dim, theta, 0);
    gpu_download(got, d_x, n * 4);
    char name[80];
    snprintf(name, sizeof name, "rope tok=%d heads=%d rot=%d offset=%d", n_tok, n_heads, rot_dim,
             offset);
    compare(name, got, want, tol, 0, n, 1e-12);
    cudaFree(d_x), cudaFree(d_pos);
    free(x), free(want), free(got), free(tol), free(pos);
}

static void test_act(size_t n)
{
    float *gate = xmalloc(n * 4), *up = xmalloc(n * 4), *want = xmalloc(n * 4);
    float *got = xmalloc(n * 4), *tol = xmalloc(n * 4), *sum = xmalloc(n * 4);
    fill_f32(gate, n, &rng, -30.0f, 30.0f);
    fill_f32(up, n, &rng, -8.0f, 8.0f);
    act_silu_mul_ref(want, gate, up, n);
    float *d_g = gpu_upload(gate, n * 4), *d_u = gpu_upload(up, n * 4);
    float *d_y = gpu_alloc_poisoned(n * 4);
    act_silu_mul(d_y, d_g, d_u, n, 0);
    gpu_download(got, d_y, n * 4);
    for (size_t i = 0; i < n; i++)
        tol[i] = 4 * FLT_EPSILON * fabsf(want[i]) + 1e-30f;
    char name[64];
    snprintf(name, sizeof name, "silu*mul n=%zu", n);
    compare(name, got, want, tol, 0, n, 1e-6);
    // In place over gate, as the MLPs call it.
    act_silu_mul(d_g, d_g, d_u, n, 0);
    gpu_download(got, d_g, n * 4);
    snprintf(name, sizeof name, "silu*mul in place n=%zu", n);
    compare(name, got, want, tol, 0, n, 1e-6);
    // The add: y += x, exactly fp32's sum.
    act_add(d_u, d_y, n, 0);
    gpu_download(got, d_u, n * 4);
    float *y = xmalloc(n * 4);
    gpu_download(y, d_y, n * 4);
    for (size_t i = 0; i < n; i++) {
        sum[i] = up[i] + y[i];
        tol[i] = 0.0f;
    }
    snprintf(name, sizeof name, "add n=%zu", n);
    compare(name, got, sum, tol, 0, n, 0.0);
    cudaFree(d_g), cudaFree(d_u), cudaFree(d_y);
    free(gate), free(up), free(want), free(got), free(tol), free(sum), free(y);
}

// act_repad: n matrices [rows_s, cols_s] into [rows_d, cols_d], zero-filled or cropped,
// exactly.
static void test_repad(size_t n, int rows_s, int cols_s, int rows_d, int cols_d)
{
    const size_t ns = n * rows_s * cols_s, nd = n * rows_d * cols_d;
    float *src = xmalloc(ns * 4), *want = xmalloc(nd * 4), *got = xmalloc(nd * 4);
    float *tol = xmalloc(nd * 4);
    fill_f32(src, ns, &rng, -3.0f, 3.0f);
    for (size_t t = 0; t < n; t++)
        for (int r = 0; r < rows_d; r++)
            for (int c = 0; c < cols_d; c++) {
                const size_t o = (t * rows_d + r) * cols_d + c;
                want[o] = r < rows_s && c < cols_s ? src[(t * rows_s + r) * cols_s + c] : 0.0f;
                tol[o] = 0.0f;
            }
    float *d_s = gpu_upload(src, ns * 4), *d_d = gpu_alloc_poisoned(nd * 4);
    act_repad(d_d, rows_d, cols_d, d_s, rows_s, cols_s, n, 0);
    gpu_download(got, d_d, nd * 4);
    char name[80];
    snprintf(name, sizeof name, "repad %zu x [%d, %d] -> [%d, %d]", n, rows_s, cols_s, rows_d,
             cols_d);
    compare(name, got, want, tol, 0, nd, 0.0);
    cudaFree(d_s), cudaFree(d_d);
    free(src), free(want), free(got), free(tol);
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
    test_rope(1, 1, 2, 2, 0, 2, 10000.0f);
    test_rope(5, 64, 64 * 256, 256, 192, 64, 8e6f);  // MLA q_pe
    test_rope(3, 1, 576, 0, 512, 64, 8e6f);          // the k_pe of kv_a's row
    test_rope(9, 32, 32 * 128, 128, 0, 64, 8e6f);    // indexer q (rope dims first)
    test_rope(2, 3, 130, 40, 8, 16, 1e4f);           // a strided row, heads inside it
    test_act(1);
    test_act(3 * 2048);
    test_act(16 * 12288 + 5);
    test_act((size_t) 65535 * 256 + 77);  // past one grid: the grid-stride loop
    test_repad(7, 1, 48, 1, 64);     // a row zero-padded
    test_repad(7, 1, 64, 1, 48);     // and cropped
    test_repad(5, 32, 8, 3, 5);      // MLA's padded heads and W_UV rows cropped
    test_repad(3, 16, 20, 16, 32);   // DSA q padded to the stored key width
    test_repad(300000, 1, 64, 1, 60); // past one grid (65,535 x 256): the grid-stride loop
    return check_exit();
}
