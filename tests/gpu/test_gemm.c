/*
 * test_gemm.c - kernels/gemm.cu (bf16 GEMV and the cuBLASLt GEMM) against kernels/ref/gemm_ref.c.
 *
 * Shapes: one chunk; rows not a multiple of the warp's rows; columns not a multiple of the
 * warp's stride; every token count bucket; and GLM-5.2's decode shapes (fused q_a+kv_a, q_b,
 * o_proj, the per-head W_UK^T / W_UV products, the router). Both GEMVs (CUDA-core and tensor-
 * core) run every shape. Outputs are poisoned (NaN) first.
 *
 * Tolerance: an n-term fp32 dot product, in any order, is within about n * FLT_EPSILON *
 * sum|terms| of the exact value; bf16 outputs add half an ulp (at most 2^-8 relative: 8 significant bits).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/gemm.h"
#include "kernels/ref/gemm_ref.h"
#include "tests/gpu/gpu_util.h"

static uint64_t rng = 42;
static int g_tc;  // test gemm_bf16_gemv_tc instead of gemm_bf16_gemv

static void test_gemv(int rows, int cols, int n_mat, int n_tok, GemmOut out, int with_residual)
{
    const size_t nw = (size_t) n_mat * rows * cols, nx = (size_t) n_tok * n_mat * cols;
    const size_t ny = (size_t) n_tok * n_mat * rows;
    uint16_t *w = xmalloc(nw * 2), *x = xmalloc(nx * 2);
    float *res = xmalloc(ny * 4), *want = xmalloc(ny * 4), *abs_ = xmalloc(ny * 4);
    fill_bf16(w, nw, &rng, -1.0f, 1.0f);
    fill_bf16(x, nx, &rng, -2.0f, 2.0f);
    fill_f32(res, ny, &rng, -4.0f, 4.0f);
    gemm_bf16_gemv_ref(want, abs_, w, x, rows, cols, n_mat, n_tok);

    uint16_t *d_w = gpu_upload(w, nw * 2), *d_x = gpu_upload(x, nx * 2);
    float *d_res = with_residual ? gpu_upload(res, ny * 4) : NULL;
    void *d_y = gpu_alloc_poisoned(ny * 4);
    if (g_tc)
        gemm_bf16_gemv_tc(d_y, out, d_w, d_x, d_res, rows, cols, n_mat, n_tok, 0);
    else
        gemm_bf16_gemv(d_y, out, d_w, d_x, d_res, rows, cols, n_mat, n_tok, 0);
    char name[96];
    snprintf(name, sizeof name, "gemv%s %dx%d mats=%d tok=%d %s%s", g_tc ? "-tc" : "", rows, cols, n_mat, n_tok,
             out == GEMM_OUT_F32 ? "f32" : "bf16", with_residual ? " +res" : "");
    compare_gemv(name, d_y, out == GEMM_OUT_BF16, want, abs_, with_residual ? res : NULL, ny,
                 cols + 8);
    cudaFree(d_w);
    cudaFree(d_x);
    cudaFree(d_res);
    cudaFree(d_y);
    free(w), free(x), free(res), free(want), free(abs_);
}

// gemm_bf16_lt (n_mat 1) or gemm_bf16_lt_mats: m tokens, n_mat matrices of n x k.
static void test_lt(int m, int n, int k, int n_mat, GemmLt *lt)
{
    const size_t nx = (size_t) m * n_mat * k, nw = (size_t) n_mat * n * k,
                 ny = (size_t) m * n_mat * n;
    uint16_t *x = xmalloc(nx * 2), *w = xmalloc(nw * 2);
    float *want = xmalloc(ny * 4), *abs_ = xmalloc(ny * 4);
    float *got = xmalloc(ny * 4), *tol = xmalloc(ny * 4);
    fill_bf16(x, nx, &rng, -1.0f, 1.0f);
    fill_bf16(w, nw, &rng, -1.0f, 1.0f);
    // Y = X W^T is the GEMV with tokens = rows of X.
    gemm_bf16_gemv_ref(want, abs_, w, x, n, k, n_mat, m);
    uint16_t *d_x = gpu_upload(x, nx * 2), *d_w = gpu_upload(w, nw * 2);
    float *d_y = gpu_alloc_poisoned(ny * 4);
    if (n_mat == 1)
        gemm_bf16_lt(d_y, GEMM_OUT_F32, d_x, d_w, m, n, k, lt, 0);
    else
        gemm_bf16_lt_mats(d_y, GEMM_OUT_F32, d_x, d_w, m, n, k, n_mat, lt, 0);
    gpu_download(got, d_y, ny * 4);
    for (size_t i = 0; i < ny; i++)
        tol[i] = (float) ((k + 8) * FLT_EPSILON * abs_[i]);
    char name[64];
    snprintf(name, sizeof name, "cublasLt %dx%dx%d mats=%d", m, n, k, n_mat);
    compare(name, got, want, tol, 0, ny, 1e-10);
    cudaFree(d_x), cudaFree(d_w), cudaFree(d_y);
    free(x), free(w), free(want), free(abs_), free(got), free(tol);
}

int main(void)
{
    for (g_tc = 0; g_tc < 2; g_tc++) {
        test_gemv(1, 8, 1, 1, GEMM_OUT_F32, 0);
        test_gemv(37, 72, 1, 3, GEMM_OUT_F32, 1);
        test_gemv(129, 520, 1, 16, GEMM_OUT_BF16, 0);
        test_gemv(300, 2056, 1, 5, GEMM_OUT_F32, 1);
        test_gemv(16900, 64, 1, 2, GEMM_OUT_F32, 1);  // four rows per warp
        test_gemv(16900, 64, 1, 9, GEMM_OUT_BF16, 0);
        // GLM-5.2 decode shapes.
        test_gemv(2048 + 576, 6144, 1, 1, GEMM_OUT_F32, 0);  // q_a + kv_a
        test_gemv(64 * 256, 2048, 1, 4, GEMM_OUT_F32, 0);    // q_b
        test_gemv(6144, 64 * 256, 1, 1, GEMM_OUT_F32, 1);    // o_proj + residual
        test_gemv(6144, 64 * 256, 1, 8, GEMM_OUT_F32, 1);    // o_proj, batch 8
        test_gemv(512, 192, 64, 2, GEMM_OUT_F32, 0);         // q_nope -> latent (W_UK^T per head)
        test_gemv(256, 512, 64, 8, GEMM_OUT_BF16, 0);        // latent -> v (W_UV per head)
        test_gemv(156, 6144, 1, 16, GEMM_OUT_F32, 0);        // router logits
        test_gemv(4096, 6144, 1, 13, GEMM_OUT_F32, 0);       // shared gate/up, 13 tokens
    }

    GemmLt lt = {0};
    gemm_lt_init(&lt);
    test_lt(64, 96, 128, 1, &lt);
    test_lt(300, 1024, 512, 1, &lt);
    test_lt(2048, 576, 6144, 1, &lt);
    test_lt(300, 156, 6144, 1, &lt);  // the router's 156 experts: rows in 4s (fp32 out)
    // MLA's absorbed projections of a prefill chunk: W_UK^T per head, W_UV per head.
    test_lt(256, 512, 192, 64, &lt);
    test_lt(77, 256, 512, 64, &lt);
    test_lt(40, 16, 24, 3, &lt);
    gemm_lt_free(&lt);
    return check_exit();
}
