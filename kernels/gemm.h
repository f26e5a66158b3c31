/*
 * gemm.h - products with bf16 weights: batched GEMV for decode, cuBLASLt GEMM for prefill.
 *
 * Layouts (row-major, outermost first; bf16 is spelled uint16_t):
 *
 *   w         bf16 [n_mat, rows, cols]     one row per output feature, as in the checkpoint
 *   x         bf16 [n_tok, n_mat, cols]    token t's input to matrix m at x + (t*n_mat+m)*cols
 *   y         fp32 or bf16 [n_tok, n_mat, rows]
 *   residual  fp32 [n_tok, n_mat, rows] or NULL; may alias y (each element is read, then written,
 *             by the same thread)
 *
 *   y[t, m, r] = residual[t, m, r] + sum_c w[m, r, c] * x[t, m, c]
 *
 * n_mat > 1 is the per-head form that MLA's absorbed decode needs (64 small matrices, each
 * applied to its own head's slice of the input). Numerics: products and sums in fp32, one
 * rounding to bf16 at the end when y is bf16. Summation order is fixed (per lane, then a warp
 * butterfly), so results are bitwise reproducible run to run.
 *
 * gemm_bf16_lt: Y[M, N] = X[M, K] W[N, K]^T through cuBLASLt (fp32 accumulation), for prefill;
 * gemm_bf16_lt_mats the same per matrix of the n_mat form.
 *
 * Ownership: launchers borrow every pointer for the duration of the enqueue; GemmLt owns a
 * cuBLASLt handle and a device workspace from gemm_lt_init until gemm_lt_free.
 * Threads:   launchers are thread-safe; one GemmLt per stream at a time.
 * Errors:    shapes or alignment the kernels cannot handle trip an ASSERT (caller bug); CUDA
 *            and cuBLAS failures are fatal (engine/shared/cuda_check.h). Launchers never allocate
 * and never synchronize.
 */
#ifndef KERNELS_GEMM_H
#define KERNELS_GEMM_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GEMM_MAX_TOK 16  // decode GEMVs take at most this many tokens per launch
// gemm_bf16_gemv runs a matrix of at most this many rows (n_mat * rows) on its split-K kernel.
#define GEMM_SK_MAX_ROWS 4096
#define GEMM_MAX_GROUP 4  // segments of one gemm_bf16_gemv_group launch

typedef enum GemmOut { GEMM_OUT_F32 = 0, GEMM_OUT_BF16 = 1 } GemmOut;

// y = w x (+ residual) as above. Preconditions: cols % 8 == 0; w, x 16-byte aligned;
// 1 <= n_tok <= GEMM_MAX_TOK; residual only with GEMM_OUT_F32.
void gemm_bf16_gemv(void *y, GemmOut y_type, const uint16_t *w, const uint16_t *x,
                    const float *residual, int rows, int cols, int n_mat, int n_tok,
                    cudaStream_t stream);

// The same product through tensor cores (mma.sync, bf16 in, fp32 accumulate; sm_80 and
// later): one weight load serves all n_tok tokens. Same contract and preconditions as
// gemm_bf16_gemv; summation order differs (fixed: per warp, then warps in order), so results
// are reproducible but not bitwise equal to gemm_bf16_gemv's. Meant for 2+ tokens (the
// CUDA-core GEMV does one fp32 FMA per weight per token and is instruction-bound at 4+; at 1
// token it already streams near copy bandwidth on H200), and for one where a row must be its
// row of a batched call (the engine's lm_head, matmul_rows). A token's outputs depend only on its
// own input, bit for bit whatever n_tok and the other tokens (the engine's matmul_rows relies
// on it). Wants n_mat * rows / 8 well above the SM count (one CTA per 8 rows, or 4 or 2 groups
// of 8 a CTA where that still leaves two CTAs a multiprocessor).
void gemm_bf16_gemv_tc(void *y, GemmOut y_type, const uint16_t *w, const uint16_t *x,
                       const float *residual, int rows, int cols, int n_mat, int n_tok,
                       cudaStream_t stream);

// The two GEMVs with fp32 inputs x [n_tok, n_mat, cols] rounded to bf16 (nearest even) as
// they are read: the same products as on act_to_bf16(x) (kernels/act.h), without the extra
// launch and buffer. Same preconditions (x 16-byte aligned).
void gemm_bf16_gemv_f32x(void *y, GemmOut y_type, const uint16_t *w, const float *x,
                         const float *residual, int rows, int cols, int n_mat, int n_tok,
                         cudaStream_t stream);
void gemm_bf16_gemv_tc_f32x(void *y, GemmOut y_type, const uint16_t *w, const float *x,
                            const float *residual, int rows, int cols, int n_mat, int n_tok,
                            cudaStream_t stream);

// One matrix of a grouped GEMV: y fp32 [n_tok, rows] = w bf16 [rows, cols] x; or, with w_up
// (bf16 [rows, cols], a SwiGLU's up beside its gate w), y = SiLU(w x) (w_up x), each product
// summed as alone and the value act_silu_mul's (kernels/common.cuh silu_mul_value).
typedef struct GemmSeg {
    const uint16_t *w;
    const uint16_t *w_up;  // NULL: a plain product
    float *y;
    int rows;
} GemmSeg;

// The products of n_segs (1 .. GEMM_MAX_GROUP) matrices of at most GEMM_SK_MAX_ROWS rows each
// and the same columns with one input x fp32 [n_tok, cols] (rounded to bf16 as it is read), in
// one launch: each product bit for bit gemm_bf16_gemv_f32x's on its matrix alone (the split-K
// kernel, whose sums do not depend on the rows a block takes), a SwiGLU pair's y bit for bit
// act_silu_mul on the two, without a launch and a tail per matrix: the projections a decode
// step makes from one normalized input (q_a, kv_a and the indexer's wk and weights_proj; the
// router and the shared expert's gate and up). Same preconditions as gemm_bf16_gemv for each
// matrix.
void gemm_bf16_gemv_group(const GemmSeg *segs, int n_segs, const float *x, int cols, int n_tok,
                          cudaStream_t stream);

// The grouped GEMV of an RMSNorm's output, the norm in its launch: h fp32 [n_tok, cols] =
// kernels/norm.h norm_rms_f32(x, w, eps) bit for bit (stored, for the norm's other readers),
// and every segment's product of h exactly as gemm_bf16_gemv_group(segs, h) computes it. Each
// block normalizes the rows itself (its bf16 copy in n_tok * cols * 2 bytes of shared memory),
// so the step saves the norm's launch and its wait: a decode step's input and post-attention
// norms. Each block repeats the norm's double arithmetic: for GPUs with fast double precision
// (the CUDA backend's fp64_fast). Preconditions: gemm_group_norm_ok(h, x, w, cols, n_tok) (at
// most GEMM_NORM_MAX_TOK tokens, h, x, w 16-byte aligned, h apart from x) and
// gemm_bf16_gemv_group's; no segment's y may overlap x (blocks still read x while others store
// y).
#define GEMM_NORM_MAX_TOK 2
#define GEMM_NORM_SMEM (40 * 1024)  // bytes of bf16 rows a block stages (with its static: < 48 KB)
bool gemm_group_norm_ok(const float *h, const float *x, const float *w, int cols, int n_tok);
void gemm_bf16_gemv_group_norm(const GemmSeg *segs, int n_segs, float *h, const float *x,
                               const float *w, float eps, int cols, int n_tok, cudaStream_t stream);

typedef struct GemmLt {
    void *handle;     // cublasLtHandle_t
    void *workspace;  // device memory, workspace_bytes
    size_t workspace_bytes;
    void *plans;  // host cache of descriptors and the chosen algorithm per (m, n, k, y_type)
    int n_plans;
} GemmLt;

// Create the cuBLASLt handle, a 32 MiB workspace and an empty plan cache. Fatal on failure
// (startup only).
void gemm_lt_init(GemmLt *lt);
// Release what gemm_lt_init made and zero *lt. Safe on a zeroed GemmLt.
void gemm_lt_free(GemmLt *lt);

// Y[M, N] = X[M, K] W[N, K]^T, all row-major. X, W bf16; Y fp32 or bf16 per y_type.
// Preconditions: K % 8 == 0, N % 8 == 0 (N % 4 == 0 for fp32 Y), 16-byte aligned pointers. The
// first call for a shape creates its descriptors and asks cuBLASLt's heuristic (host work); later
// calls reuse them. Not thread-safe per GemmLt.
void gemm_bf16_lt(void *y, GemmOut y_type, const uint16_t *x, const uint16_t *w, int m, int n,
                  int k, GemmLt *lt, cudaStream_t stream);

// The per-head form of gemm_bf16_lt, one strided-batched cuBLASLt call: with the GEMV's
// layouts above (w [n_mat, n, k], x [m, n_mat, k], y [m, n_mat, n]), y[t, i, :] = w[i] x[t, i, :]
// for every token t < m and matrix i < n_mat. MLA's absorbed projections for prefill chunks.
// Same preconditions as gemm_bf16_lt; n_mat = 1 is gemm_bf16_lt.
void gemm_bf16_lt_mats(void *y, GemmOut y_type, const uint16_t *x, const uint16_t *w, int m, int n,
                       int k, int n_mat, GemmLt *lt, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_GEMM_H
