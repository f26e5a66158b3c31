/*
 * test_gemm.c - kernels/gemm.cu (bf16 GEMV and the cuBLASLt GEMM) against kernels/ref/gemm_ref.c.
 *
 * Shapes: one chunk; rows not a multiple of the warp's rows; columns not a multiple of the
 * warp's stride; every token count bucket; and GLM-5.2's decode shapes (fused q_a+kv_a, q_b,
 * o_proj, the per-head W_UK^T / W_UV products, the router). Both GEMVs (CUDA-core and tensor-
 * core) run every shape; the grouped GEMV runs GLM-5.2's groups of projections and odd shapes,
 * bit for bit each matrix's own GEMV (a SwiGLU pair: act_silu_mul's value of the two); with
 * its norm (up to GEMM_NORM_MAX_TOK tokens), the normalized rows bit for bit norm_rms_f32's
 * and the products bit for bit the GEMV's of those rows.
 * Outputs are poisoned (NaN) first.
 *
 * Tolerance: an n-term fp32 dot product, in any order, is within about n * FLT_EPSILON *
 * sum|terms| of the exact value; bf16 outputs add half an ulp (at most 2^-8 relative: 8 significant bits).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/act.h"
#include "kernels/gemm.h"
#include "kernels/norm.h"
#include "kernels/ref/gemm_ref.h"
#include "kernels/ref/kern_ref.h"
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
    if (g_tc) {  // fp32 inputs (here bf16 values, exact in fp32): bit for bit the bf16 input's
        float *xf = xmalloc(nx * 4);
        for (size_t i = 0; i < nx; i++) xf[i] = kern_bf16_to_f32(x[i]);
        float *d_xf = gpu_upload(xf, nx * 4);
        void *d_y2 = gpu_alloc_poisoned(ny * 4);
        gemm_bf16_gemv_tc_f32x(d_y2, out, d_w, d_xf, d_res, rows, cols, n_mat, n_tok, 0);
        const size_t ob = out == GEMM_OUT_F32 ? 4 : 2, nb = ny * ob;
        char *a = xmalloc(nb), *b = xmalloc(nb);
        gpu_download(a, d_y, nb);
        gpu_download(b, d_y2, nb);
        const int same = memcmp(a, b, nb) == 0;
        printf("%-40s fp32 input bit for bit the bf16 one's: %s\n", name, same ? "yes" : "NO");
        CHECK(same);
        // The first and the last token alone: bit for bit their rows of the whole launch
        // (the row groups included; matmul_rows relies on it).
        const size_t xr = (size_t) n_mat * cols, yr = (size_t) n_mat * rows;
        int alone_same = 1;
        for (int k = 0; k < 2; k++) {
            const int t = k ? n_tok - 1 : 0;
            gemm_bf16_gemv_tc(d_y2, out, d_w, d_x + t * xr, d_res ? d_res + t * yr : NULL, rows,
                              cols, n_mat, 1, 0);
            gpu_download(b, d_y2, yr * ob);
            alone_same &= memcmp(a + t * yr * ob, b, yr * ob) == 0;
        }
        printf("%-40s first and last token alone bit for bit: %s\n", name,
               alone_same ? "yes" : "NO");
        CHECK(alone_same);
        cudaFree(d_xf), cudaFree(d_y2);
        free(xf), free(a), free(b);
    }
    compare_gemv(name, d_y, out == GEMM_OUT_BF16, want, abs_, with_residual ? res : NULL, ny,
                 cols + 8);
    cudaFree(d_w);
    cudaFree(d_x);
    cudaFree(d_res);
    cudaFree(d_y);
    free(w), free(x), free(res), free(want), free(abs_);
}

// gemm_bf16_gemv_group on n_segs matrices of rows[i] x cols with one fp32 input of n_tok
// tokens: each output bit for bit gemm_bf16_gemv_f32x's on its matrix alone, and within the
// GEMV's bound of the reference on the input rounded to bf16. glu: segment 1 is a SwiGLU pair
// (its up a second matrix of its rows): bit for bit act_silu_mul of its two GEMVs alone.
// norm: gemm_bf16_gemv_group_norm on the un-normalized rows instead, its h bit for bit
// norm_rms_f32's and each output bit for bit the matrix's GEMV of that h.
static void test_group_any(const int *rows, int n_segs, int cols, int n_tok, int glu, int norm)
{
    const size_t nx = (size_t) n_tok * cols;
    float *x = xmalloc(nx * 4);
    uint16_t *xb = xmalloc(nx * 2);
    fill_f32(x, nx, &rng, -2.0f, 2.0f);  // not bf16 values: the kernel rounds them
    float *d_raw = NULL, *d_nw = NULL, *d_h = NULL;
    const float eps = 1e-5f;
    if (norm) {  // x becomes norm_rms_f32's output, computed on the device from raw rows
        float *nw = xmalloc((size_t) cols * 4);
        fill_f32(nw, (size_t) cols, &rng, 0.5f, 1.5f);
        for (size_t i = 0; i < nx; i++) x[i] *= (float) (1 + i % 7);  // rows of some spread
        d_raw = gpu_upload(x, nx * 4);
        d_nw = gpu_upload(nw, (size_t) cols * 4);
        d_h = gpu_alloc_poisoned(nx * 4);
        float *d_href = gpu_alloc_poisoned(nx * 4);
        norm_rms_f32(d_href, d_raw, d_nw, eps, n_tok, cols, cols, cols, 0);
        gpu_download(x, d_href, nx * 4);
        cudaFree(d_href);
        free(nw);
    }
    for (size_t i = 0; i < nx; i++) xb[i] = kern_f32_to_bf16(x[i]);
    float *d_x = gpu_upload(x, nx * 4);
    GemmSeg segs[GEMM_MAX_GROUP];
    uint16_t *w[GEMM_MAX_GROUP];
    float *d_alone[GEMM_MAX_GROUP], *d_up_alone = NULL;
    for (int i = 0; i < n_segs; i++) {
        const size_t nw = (size_t) rows[i] * cols, ny = (size_t) n_tok * rows[i];
        const bool pair = glu && i == 1;
        w[i] = xmalloc(nw * 2 * (pair ? 2 : 1));  // a pair: gate, then up
        fill_bf16(w[i], nw * (pair ? 2 : 1), &rng, -1.0f, 1.0f);
        uint16_t *d_w = gpu_upload(w[i], nw * 2 * (pair ? 2 : 1));
        segs[i] = (GemmSeg){d_w, pair ? d_w + nw : NULL, gpu_alloc_poisoned(ny * 4), rows[i]};
        d_alone[i] = gpu_alloc_poisoned(ny * 4);
        gemm_bf16_gemv_f32x(d_alone[i], GEMM_OUT_F32, segs[i].w, d_x, NULL, rows[i], cols, 1, n_tok,
                            0);
        if (pair) {  // the pair's value: act_silu_mul of the two, on the device
            d_up_alone = gpu_alloc_poisoned(ny * 4);
            gemm_bf16_gemv_f32x(d_up_alone, GEMM_OUT_F32, segs[i].w_up, d_x, NULL, rows[i], cols, 1,
                                n_tok, 0);
            act_silu_mul(d_alone[i], d_alone[i], d_up_alone, ny, 0);
        }
    }
    if (norm) {
        CHECK(gemm_group_norm_ok(d_h, d_raw, d_nw, cols, n_tok));
        gemm_bf16_gemv_group_norm(segs, n_segs, d_h, d_raw, d_nw, eps, cols, n_tok, 0);
        float *h = xmalloc(nx * 4);
        gpu_download(h, d_h, nx * 4);
        const bool same = memcmp(h, x, nx * 4) == 0;
        if (!same)
            fprintf(stderr, "gemv group norm %dx%d tok=%d: h is not norm_rms_f32's\n", n_segs, cols,
                    n_tok);
        CHECK(same);
        free(h), cudaFree(d_raw), cudaFree(d_nw), cudaFree(d_h);
    } else {
        gemm_bf16_gemv_group(segs, n_segs, d_x, cols, n_tok, 0);
    }
    for (int i = 0; i < n_segs; i++) {
        const size_t ny = (size_t) n_tok * rows[i];
        const bool pair = glu && i == 1;
        float *got = xmalloc(ny * 4), *alone = xmalloc(ny * 4), *want = xmalloc(ny * 4),
              *abs_ = xmalloc(ny * 4);
        gpu_download(got, segs[i].y, ny * 4);
        gpu_download(alone, d_alone[i], ny * 4);
        char name[96];
        snprintf(name, sizeof name, "gemv group%s %d/%d %dx%d tok=%d%s", norm ? " norm" : "", i,
                 n_segs, rows[i], cols, n_tok, pair ? " swiglu" : "");
        if (pair) cudaFree(d_up_alone);
        const bool same = memcmp(got, alone, ny * 4) == 0;
        if (!same) fprintf(stderr, "%s: not bit for bit the matrix's own GEMV\n", name);
        CHECK(same);
        if (!pair) {
            gemm_bf16_gemv_ref(want, abs_, w[i], xb, rows[i], cols, 1, n_tok);
            compare_gemv(name, segs[i].y, false, want, abs_, NULL, ny, cols + 8);
        }
        cudaFree((void *) segs[i].w), cudaFree(segs[i].y), cudaFree(d_alone[i]);
        free(w[i]), free(got), free(alone), free(want), free(abs_);
    }
    cudaFree(d_x);
    free(x), free(xb);
}

static void test_group(const int *rows, int n_segs, int cols, int n_tok, int glu)
{
    test_group_any(rows, n_segs, cols, n_tok, glu, 0);
    if (n_tok <= GEMM_NORM_MAX_TOK && (size_t) n_tok * cols * 2 <= GEMM_NORM_SMEM)
        test_group_any(rows, n_segs, cols, n_tok, glu, 1);
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
        // Batch 16 (the tensor-core GEMV's row groups: 4 or 2 groups of 8 rows a block where
        // the rows give every multiprocessor two blocks; 8,500 rows end in a partial group).
        test_gemv(64 * 256, 2048, 1, 16, GEMM_OUT_F32, 0);   // q_b
        test_gemv(6144, 64 * 256, 1, 16, GEMM_OUT_F32, 1);   // o_proj + residual
        test_gemv(8500, 2056, 1, 16, GEMM_OUT_F32, 1);
        test_gemv(8500, 2056, 1, 6, GEMM_OUT_BF16, 0);
        test_gemv(512, 192, 64, 16, GEMM_OUT_F32, 0);        // 64 matrices
    }

    // Grouped GEMVs: GLM-5.2's projections of the normalized input (q_a, kv_a, the indexer's
    // wk and weights_proj; the router and the shared expert's gate and up), a layer without
    // an indexer, odd rows and columns, every token bucket.
    const int attn[] = {2048, 576, 128, 32}, mlp[] = {156, 2048}, odd[] = {5, 37, 1000};
    const int one[] = {4096}, small[] = {3, 9};
    for (int t = 1; t <= GEMM_MAX_TOK; t = t < 4 ? t + 1 : t * 2) {
        test_group(attn, 4, 6144, t, 0);
        test_group(mlp, 2, 6144, t, 1);  // the router and the shared expert's SwiGLU
    }
    test_group(attn, 2, 6144, 1, 0);
    test_group(odd, 3, 72, 3, 0);
    test_group(odd, 3, 2056, 16, 1);
    test_group(one, 1, 520, 5, 0);
    test_group(small, 2, 64, 2, 1);  // one block a pair (rows per block 1)
    const int mid[] = {400, 300};
    test_group(mid, 2, 1024, 2, 0);  // 700 rows: two rows a block

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
