/*
 * test_nvfp4.c - kernels/nvfp4.cu (W4A16 GEMV, dequantize, dequantize + GEMM) against
 * kernels/ref/nvfp4_ref.c.
 *
 * Random codes (all 16 E2M1 values), realistic E4M3 scales and bf16 inputs; awkward shapes (one
 * chunk, rows not a multiple of anything, every token bucket, the four-rows-per-warp path) and
 * GLM-5.2's expert shapes. Outputs poisoned first.
 *
 * Tolerance: dequantization is exact and every product is exact in fp32, so only additions
 * round: (cols + 64) * FLT_EPSILON * sum|terms| (the 64 covers the per-group scale multiply and
 * the final global-scale multiply); bf16 outputs add 2^-8 relative.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/nvfp4.h"
#include "kernels/ref/gemm_ref.h"
#include "kernels/ref/nvfp4_ref.h"
#include "tests/gpu/gpu_util.h"

static uint64_t rng = 7;

typedef struct HostNv {
    uint8_t *q, *s;
    float global;
    int rows, cols;
} HostNv;

static HostNv make_nv(int rows, int cols)
{
    HostNv h = {xmalloc((size_t) rows * cols / 2), xmalloc((size_t) rows * cols / 16), 0.0125f,
                rows, cols};
    fill_bytes(h.q, (size_t) rows * cols / 2, &rng);
    for (size_t i = 0; i < (size_t) rows * cols / 16; i++) h.s[i] = random_e4m3_scale(&rng);
    return h;
}

static void test_gemv(int rows, int cols, int n_tok, GemmOut out, int with_residual)
{
    HostNv h = make_nv(rows, cols);
    const size_t ny = (size_t) n_tok * rows;
    uint16_t *x = xmalloc((size_t) n_tok * cols * 2);
    float *want = xmalloc(ny * 4), *abs_ = xmalloc(ny * 4), *res = xmalloc(ny * 4);
    fill_bf16(x, (size_t) n_tok * cols, &rng, -2.0f, 2.0f);
    fill_f32(res, ny, &rng, -1.0f, 1.0f);
    nvfp4_gemv_ref(want, abs_, h.q, h.s, h.global, rows, cols, x, n_tok);

    const Nvfp4Matrix w = {gpu_upload(h.q, (size_t) rows * cols / 2),
                           gpu_upload(h.s, (size_t) rows * cols / 16), h.global, rows, cols};
    uint16_t *d_x = gpu_upload(x, (size_t) n_tok * cols * 2);
    float *d_res = with_residual ? gpu_upload(res, ny * 4) : NULL;
    void *d_y = gpu_alloc_poisoned(ny * 4);
    nvfp4_gemv(d_y, out, &w, d_x, d_res, n_tok, 0);
    char name[96];
    snprintf(name, sizeof name, "nvfp4 gemv %dx%d tok=%d %s%s", rows, cols, n_tok,
             out == GEMM_OUT_F32 ? "f32" : "bf16", with_residual ? " +res" : "");
    compare_gemv(name, d_y, out == GEMM_OUT_BF16, want, abs_, with_residual ? res : NULL, ny,
                 cols + 64);
    cudaFree((void *) w.q), cudaFree((void *) w.scale), cudaFree(d_x), cudaFree(d_res), cudaFree(d_y);
    free(h.q), free(h.s), free(x), free(want), free(abs_), free(res);
}

static void test_dequant_gemm(int rows, int cols, int m, GemmLt *lt)
{
    HostNv h = make_nv(rows, cols);
    const size_t nw = (size_t) rows * cols;
    float *want_w = xmalloc(nw * 4), *got_w = xmalloc(nw * 4);
    uint16_t *gb = xmalloc(nw * 2);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            want_w[(size_t) r * cols + c] = (float) nvfp4_weight_ref(h.q, h.s, h.global, cols, r, c);
    const Nvfp4Matrix w = {gpu_upload(h.q, nw / 2), gpu_upload(h.s, nw / 16), h.global, rows, cols};
    uint16_t *d_wb = gpu_alloc_poisoned(nw * 2);
    nvfp4_dequant_bf16(d_wb, &w, 0);
    gpu_download(gb, d_wb, nw * 2);
    for (size_t i = 0; i < nw; i++) got_w[i] = kern_bf16_to_f32(gb[i]);
    float *tol = xmalloc(nw * 4);
    for (size_t i = 0; i < nw; i++) tol[i] = ldexpf(fabsf(want_w[i]), -8);
    char name[96];
    snprintf(name, sizeof name, "nvfp4 dequant %dx%d", rows, cols);
    compare(name, got_w, want_w, tol, 0, nw, 1e-4);

    // Prefill: the reference multiplies the bf16 weights the kernel produced.
    uint16_t *x = xmalloc((size_t) m * cols * 2);
    float *want = xmalloc((size_t) m * rows * 4), *abs_ = xmalloc((size_t) m * rows * 4);
    float *got = xmalloc((size_t) m * rows * 4), *tol2 = xmalloc((size_t) m * rows * 4);
    fill_bf16(x, (size_t) m * cols, &rng, -1.0f, 1.0f);
    for (int i = 0; i < m; i++)
        gemm_bf16_gemv_ref(want + (size_t) i * rows, abs_ + (size_t) i * rows, gb,
                           x + (size_t) i * cols, rows, cols, 1, 1);
    uint16_t *d_x = gpu_upload(x, (size_t) m * cols * 2);
    float *d_y = gpu_alloc_poisoned((size_t) m * rows * 4);
    nvfp4_gemm(d_y, GEMM_OUT_F32, d_x, &w, m, d_wb, lt, 0);
    gpu_download(got, d_y, (size_t) m * rows * 4);
    for (size_t i = 0; i < (size_t) m * rows; i++) tol2[i] = (float) ((cols + 8) * FLT_EPSILON * abs_[i]);
    snprintf(name, sizeof name, "nvfp4 gemm m=%d %dx%d", m, rows, cols);
    compare(name, got, want, tol2, 0, (size_t) m * rows, 1e-10);
    cudaFree((void *) w.q), cudaFree((void *) w.scale), cudaFree(d_wb), cudaFree(d_x), cudaFree(d_y);
    free(h.q), free(h.s), free(want_w), free(got_w), free(gb), free(tol), free(x), free(want);
    free(abs_), free(got), free(tol2);
}

int main(void)
{
    test_gemv(1, 32, 1, GEMM_OUT_F32, 0);
    test_gemv(3, 96, 2, GEMM_OUT_F32, 1);
    test_gemv(33, 33 * 32, 16, GEMM_OUT_BF16, 0);
    test_gemv(77, 2080, 5, GEMM_OUT_F32, 0);
    test_gemv(16900, 64, 3, GEMM_OUT_F32, 1);  // four rows per warp
    test_gemv(6144, 2048, 1, GEMM_OUT_F32, 1);  // an expert's down projection
    test_gemv(4096, 6144, 1, GEMM_OUT_F32, 0);  // its gate+up projection
    test_gemv(4096, 6144, 8, GEMM_OUT_BF16, 0);
    GemmLt lt = {0};
    gemm_lt_init(&lt);
    test_dequant_gemm(96, 64, 7, &lt);
    test_dequant_gemm(4096, 6144, 64, &lt);
    gemm_lt_free(&lt);
    return check_exit();
}
