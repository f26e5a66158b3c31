/*
 * gemm.cu - bf16-weight GEMV (decode) and the cuBLASLt GEMM wrapper (prefill).
 *
 * GEMV decomposition. A block is 8 warps; each warp owns R consecutive rows of one matrix
 * (R = 4 when there are enough rows to fill the chip, else 1; matrices of at most 4,096 rows
 * take the split-K kernel below instead, whose 8 warps share R rows). Lane l reads 16-byte chunks
 * l, l+32, ... of each of its rows (8 bf16 weights per chunk), two chunks per row in flight,
 * so a warp streams 512 contiguous bytes per row per step. The 8 matching inputs of every
 * token are loaded once per chunk (through L1: every warp of the block reads the same x) and
 * reused for the R rows. Each lane accumulates R x NT fp32 partial sums; a warp butterfly
 * adds them and lane j stores output j, so stores are spread over the warp.
 *
 * Memory: weights are read once with L1::no_allocate loads (they are used once per step);
 * inputs and the residual are tiny and stay in L1/L2.
 */
#include "kernels/gemm.h"

#include <cublasLt.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/launch.cuh"
#include "kernels/norm_dev.cuh"

enum { GEMV_WARPS = 8 };

// ---------------------------------------------------------------------------
// GEMV kernel

// Inputs: 8 consecutive values (16-byte chunk ch of a bf16 row) as 8 bf16; an fp32 row is
// read as two float4 and rounded to bf16 on the way (nearest even), so the products are those
// of the bf16-rounded input.
static __device__ __forceinline__ uint4 load_x8(const uint16_t *row, int ch)
{
    return __ldg((const uint4 *) row + ch);
}

static __device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi)
{
    return (uint32_t) f32_to_bf16_bits(lo) | (uint32_t) f32_to_bf16_bits(hi) << 16;
}

static __device__ __forceinline__ uint4 load_x8(const float *row, int ch)
{
    const float4 a = __ldg((const float4 *) row + 2 * ch), b = __ldg((const float4 *) row + 2 * ch + 1);
    return make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                      pack_bf16x2(b.z, b.w));
}

// bf16 inputs staged in shared memory (the grouped kernel with a norm: gemv_norm_stage), read
// with plain loads (__ldg is for global memory).
typedef struct SmemBf16 {
    uint16_t bits;
} SmemBf16;

static __device__ __forceinline__ uint4 load_x8(const SmemBf16 *row, int ch)
{
    return ((const uint4 *) row)[ch];
}

template <typename OutT> static __device__ __forceinline__ void store_out(OutT *p, float v);
template <> __device__ __forceinline__ void store_out<float>(float *p, float v)
{
    *p = v;
}
template <> __device__ __forceinline__ void store_out<uint16_t>(uint16_t *p, float v)
{
    *p = f32_to_bf16_bits(v);
}

// L2 prefetches of the lines the first `bytes` of rows r0 .. r0 + n_rows (those < rows) of
// matrix m span, spread over threads tid of n_threads: what a GEMV's first loads read, issued
// before KERN_ENTRY's wait (weights: no kernel writes them).
static __device__ __forceinline__ void gemv_rows_prefetch(const uint16_t *w, int rows, int cols,
                                                          int m, int r0, int n_rows, int bytes,
                                                          int tid, int n_threads)
{
    const int lines = (min(bytes, cols * 2) + 127) / 128;
    for (int k = tid; k < n_rows * lines; k += n_threads) {
        const int r = r0 + k / lines;
        if (r < rows)
            kern_prefetch_l2((const char *) (w + ((size_t) m * rows + r) * cols) + (size_t) (k % lines) * 128);
    }
}

// The warp-per-row kernel's first step: each warp's R rows, 2 chunks of 16 bytes a lane.
template <int R>
static __device__ __forceinline__ void gemv_warp_prefetch(const uint16_t *w, int rows, int cols,
                                                          int n_mat)
{
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = blockIdx.x * GEMV_WARPS + threadIdx.x / WARP_SIZE;
    const int warps_per_mat = CEIL_DIV(rows, R), m = warp / warps_per_mat;
    if (m < n_mat)
        gemv_rows_prefetch(w, rows, cols, m, (warp % warps_per_mat) * R, R, 2 * WARP_SIZE * 16,
                           lane, WARP_SIZE);
}

template <int R, int NT, typename OutT, typename XT>
static __global__ void __launch_bounds__(GEMV_WARPS *WARP_SIZE)
    gemm_bf16_gemv_kernel(OutT *__restrict__ y, const uint16_t *__restrict__ w,
                          const XT *__restrict__ x, const float *residual, int rows,
                          int cols, int n_mat, int n_tok)
{
    KERN_ENTRY_AFTER(gemv_warp_prefetch<R>(w, rows, cols, n_mat));
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = blockIdx.x * GEMV_WARPS + threadIdx.x / WARP_SIZE;
    const int warps_per_mat = CEIL_DIV(rows, R);
    const int m = warp / warps_per_mat;
    const int r0 = (warp % warps_per_mat) * R;
    if (m >= n_mat) return;  // whole warp leaves together

    const int n_chunks = cols / 8;
    const uint16_t *w_rows[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        const int r = min(r0 + i, rows - 1);  // clamped rows compute garbage that is not stored
        w_rows[i] = w + ((size_t) m * rows + r) * cols;
    }

    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;

    for (int c = lane; c < n_chunks; c += 2 * WARP_SIZE) {
        const int c2 = c + WARP_SIZE;
        const bool has2 = c2 < n_chunks;
        uint4 wv[2][R];
#pragma unroll
        for (int i = 0; i < R; i++) {
            wv[0][i] = ld_stream_u4(w_rows[i] + (size_t) c * 8);
            wv[1][i] = has2 ? ld_stream_u4(w_rows[i] + (size_t) c2 * 8) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int cc = u ? c2 : c;
            if (u && !has2) break;
            float wf[R][8];
#pragma unroll
            for (int i = 0; i < R; i++) {
                const uint32_t ws[4] = {wv[u][i].x, wv[u][i].y, wv[u][i].z, wv[u][i].w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 f = bf16x2_bits_to_f32(ws[j]);
                    wf[i][2 * j] = f.x;
                    wf[i][2 * j + 1] = f.y;
                }
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < n_tok) {
                    const uint4 xv = load_x8(x + ((size_t) t * n_mat + m) * cols, cc);
                    const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w};
                    float xf[8];
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const float2 f = bf16x2_bits_to_f32(xs[j]);
                        xf[2 * j] = f.x;
                        xf[2 * j + 1] = f.y;
                    }
#pragma unroll
                    for (int i = 0; i < R; i++)
#pragma unroll
                        for (int j = 0; j < 8; j++) acc[i][t] = fmaf(wf[i][j], xf[j], acc[i][t]);
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < R; i++) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float v = warp_sum(acc[i][t]);
            const int r = r0 + i;
            if (lane == (i * NT + t) % WARP_SIZE && t < n_tok && r < rows) {
                const size_t o = ((size_t) t * n_mat + m) * rows + r;
                store_out<OutT>(y + o, residual ? v + residual[o] : v);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Split-K GEMV, for matrices with too few rows to fill the chip a warp per row (the router's
// 156 rows, kv_a's 576, q_a's and the shared expert's 2048): a block of 8 warps owns R rows
// and its warps split the columns. Warp w's lane l takes 16-byte chunks (k * 8 + w) * 32 + l,
// so the block reads 4 KB of a row contiguously per step, SK_IN_FLIGHT steps' loads in flight
// per lane; the inputs of each chunk are loaded once for the R rows. The 8 warps' sums meet
// in shared memory and are added in warp order: reproducible, no atomics.

enum { SK_IN_FLIGHT = 4 };

// Rows r0 .. r0 + R of matrix m, by one block: the split-K kernel's work, which the grouped
// kernel (below) runs on its segments' rows. GLU (the grouped kernel's SwiGLU pairs): rows
// r0 .. r0 + R / 2 of w (gate) and of w_up (up), each summed exactly as alone, and y[r] =
// SiLU(gate_r x) (up_r x) (act_silu_mul's value) for those rows.
template <int R, int NT, typename OutT, typename XT, bool GLU = false>
static __device__ __forceinline__ void gemv_sk_rows(OutT *__restrict__ y,
                                                    const uint16_t *__restrict__ w,
                                                    const XT *__restrict__ x,
                                                    const float *residual, int rows, int cols,
                                                    int n_mat, int n_tok, int m, int r0,
                                                    const uint16_t *__restrict__ w_up = NULL)
{
    static_assert(!GLU || R % 2 == 0, "a SwiGLU block takes rows in pairs");
    constexpr int RG = GLU ? R / 2 : R;  // output rows of the block
    __shared__ float red[GEMV_WARPS][R * NT];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_chunks = cols / 8, step = GEMV_WARPS * WARP_SIZE;
    const uint16_t *w_rows[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        const int r = min(r0 + i % RG, rows - 1);  // clamped: not stored
        w_rows[i] = (GLU && i >= RG ? w_up : w) + ((size_t) m * rows + r) * cols;
    }
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++)
            acc[i][t] = 0.0f;

    for (int c0 = warp * WARP_SIZE + lane; c0 < n_chunks; c0 += SK_IN_FLIGHT * step) {
        uint4 wv[SK_IN_FLIGHT][R];
#pragma unroll
        for (int u = 0; u < SK_IN_FLIGHT; u++) {
            const int c = c0 + u * step;
#pragma unroll
            for (int i = 0; i < R; i++)
                wv[u][i] = c < n_chunks ? ld_stream_u4(w_rows[i] + (size_t) c * 8)
                                        : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < SK_IN_FLIGHT; u++) {
            const int c = c0 + u * step;
            if (c >= n_chunks) break;
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= n_tok) break;
                const uint4 xv = load_x8(x + ((size_t) t * n_mat + m) * cols, c);
                const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                for (int i = 0; i < R; i++) {
                    const uint32_t ws[4] = {wv[u][i].x, wv[u][i].y, wv[u][i].z, wv[u][i].w};
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const float2 wf = bf16x2_bits_to_f32(ws[j]), xf = bf16x2_bits_to_f32(xs[j]);
                        acc[i][t] = fmaf(wf.x, xf.x, acc[i][t]);
                        acc[i][t] = fmaf(wf.y, xf.y, acc[i][t]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float v = warp_sum(acc[i][t]);
            if (lane == 0) red[warp][i * NT + t] = v;
        }
    __syncthreads();
    if (threadIdx.x < RG * NT) {
        const int i = threadIdx.x / NT, t = threadIdx.x % NT, r = r0 + i;
        if (t < n_tok && r < rows) {
            float v = 0.0f;
#pragma unroll
            for (int k = 0; k < GEMV_WARPS; k++)
                v += red[k][threadIdx.x];
            const size_t o = ((size_t) t * n_mat + m) * rows + r;
            if constexpr (GLU) {
                float u = 0.0f;
#pragma unroll
                for (int k = 0; k < GEMV_WARPS; k++)
                    u += red[k][threadIdx.x + RG * NT];
                store_out<OutT>(y + o, silu_mul_value(v, u));
            } else {
                store_out<OutT>(y + o, residual ? v + residual[o] : v);
            }
        }
    }
}

// The split-K kernel's first step: the block's R rows, SK_IN_FLIGHT steps of 16-byte chunks
// over its threads (the whole row when shorter).
template <int R>
static __device__ __forceinline__ void gemv_sk_prefetch(const uint16_t *w, int rows, int cols)
{
    const int blocks_per_mat = CEIL_DIV(rows, R);
    gemv_rows_prefetch(w, rows, cols, blockIdx.x / blocks_per_mat,
                       (blockIdx.x % blocks_per_mat) * R, R,
                       SK_IN_FLIGHT * GEMV_WARPS * WARP_SIZE * 16, threadIdx.x,
                       GEMV_WARPS * WARP_SIZE);
}

template <int R, int NT, typename OutT, typename XT>
static __global__ void __launch_bounds__(GEMV_WARPS *WARP_SIZE)
    gemm_bf16_gemv_sk_kernel(OutT *__restrict__ y, const uint16_t *__restrict__ w,
                             const XT *__restrict__ x, const float *residual, int rows, int cols,
                             int n_mat, int n_tok)
{
    KERN_ENTRY_AFTER(gemv_sk_prefetch<R>(w, rows, cols));
    const int blocks_per_mat = CEIL_DIV(rows, R);
    gemv_sk_rows<R, NT, OutT, XT>(y, w, x, residual, rows, cols, n_mat, n_tok,
                                  blockIdx.x / blocks_per_mat, (blockIdx.x % blocks_per_mat) * R);
}

// The grouped GEMV: segment s's blocks are first[s] .. first[s + 1], each on R of its rows,
// or (a SwiGLU pair, w_up[s] set) on RP rows of w[s] and the same rows of w_up[s] (gemm.h
// gemm_bf16_gemv_group).
typedef struct GemvGroup {
    const uint16_t *w[GEMM_MAX_GROUP];
    const uint16_t *w_up[GEMM_MAX_GROUP];
    float *y[GEMM_MAX_GROUP];
    int rows[GEMM_MAX_GROUP];
    int first[GEMM_MAX_GROUP + 1];
    int n;
} GemvGroup;

// Rows of each matrix of a SwiGLU pair that a block of the grouped kernel takes at R rows a
// block (two rows at least: one of each).
static constexpr __host__ __device__ int gemv_pair_rows(int R)
{
    return R > 1 ? R / 2 : 1;
}

// The segment of g this block works on, and (*b) the block's index within it.
static __device__ __forceinline__ int gemv_group_segment(const GemvGroup &g, int *b)
{
    int s = 0;
    while (s + 1 < g.n && (int) blockIdx.x >= g.first[s + 1]) s++;
    *b = (int) blockIdx.x - g.first[s];
    return s;
}

// The grouped kernel's first step: as gemv_sk_prefetch on the block's segment (a pair: its RP
// rows of both matrices).
template <int R>
static __device__ __forceinline__ void gemv_group_prefetch(const GemvGroup &g, int cols)
{
    constexpr int RP = gemv_pair_rows(R), bytes = SK_IN_FLIGHT * GEMV_WARPS * WARP_SIZE * 16;
    int b;
    const int s = gemv_group_segment(g, &b), threads = GEMV_WARPS * WARP_SIZE;
    if (!g.w_up[s]) {
        gemv_rows_prefetch(g.w[s], g.rows[s], cols, 0, b * R, R, bytes, threadIdx.x, threads);
    } else {
        gemv_rows_prefetch(g.w[s], g.rows[s], cols, 0, b * RP, RP, bytes, threadIdx.x, threads);
        gemv_rows_prefetch(g.w_up[s], g.rows[s], cols, 0, b * RP, RP, bytes, threadIdx.x, threads);
    }
}

template <int R, int NT, typename XT>
static __global__ void __launch_bounds__(GEMV_WARPS *WARP_SIZE)
    gemm_bf16_gemv_group_kernel(const __grid_constant__ GemvGroup g, const XT *__restrict__ x,
                                int cols, int n_tok)
{
    KERN_ENTRY_AFTER(gemv_group_prefetch<R>(g, cols));
    constexpr int RP = gemv_pair_rows(R);
    int b;
    const int s = gemv_group_segment(g, &b);
    if (g.w_up[s])
        gemv_sk_rows<2 * RP, NT, float, XT, true>(g.y[s], g.w[s], x, NULL, g.rows[s], cols, 1,
                                                  n_tok, 0, b * RP, g.w_up[s]);
    else
        gemv_sk_rows<R, NT, float, XT>(g.y[s], g.w[s], x, NULL, g.rows[s], cols, 1, n_tok, 0,
                                       b * R);
}

// The grouped kernel's norm (gemm_bf16_gemv_group_norm): every block normalizes the n_tok
// rows of x [n_tok, cols] itself, norm.cu's RMSNorm numbers (norm_dev.cuh: the same sums in the
// same order, 16-byte pieces), into xs as the bf16 the GEMV reads (the fp32 value rounded to
// nearest even, as load_x8 rounds an fp32 row), and block 0 stores the fp32 rows into h: what
// norm_rms_f32 would have written. A launch and a dependent wait less than the norm op before
// the GEMV, for a second read of x and w from L2 a block.
static __device__ void gemv_norm_stage(SmemBf16 *xs, float *h, const float *x,
                                       const float *__restrict__ nw, float eps, int cols,
                                       int n_tok)
{
    static_assert(GEMV_WARPS * WARP_SIZE == NORM_THREADS, "norm_dev.cuh's block sums");
    __shared__ double red[NORM_THREADS / WARP_SIZE];
    for (int t = 0; t < n_tok; t++) {
        const float *xr = x + (size_t) t * cols;
        const double inv = norm_rms_inv(xr, cols, true, eps, red);
        for (int i = threadIdx.x; i < cols / 4; i += NORM_THREADS) {
            const float4 v = ((const float4 *) xr)[i], w = ((const float4 *) nw)[i];
            const float4 o = make_float4((float) norm_rms_value(v.x, inv, w.x),
                                         (float) norm_rms_value(v.y, inv, w.y),
                                         (float) norm_rms_value(v.z, inv, w.z),
                                         (float) norm_rms_value(v.w, inv, w.w));
            ((uint2 *) (xs + (size_t) t * cols))[i] =
                make_uint2(pack_bf16x2(o.x, o.y), pack_bf16x2(o.z, o.w));
            if (blockIdx.x == 0) ((float4 *) (h + (size_t) t * cols))[i] = o;
        }
    }
    __syncthreads();
}

template <int R, int NT>
static __global__ void __launch_bounds__(GEMV_WARPS *WARP_SIZE)
    gemm_bf16_gemv_group_norm_kernel(const __grid_constant__ GemvGroup g, float *h,
                                     const float *x, const float *__restrict__ nw, float eps,
                                     int cols, int n_tok)
{
    KERN_ENTRY_AFTER(gemv_group_prefetch<R>(g, cols));
    extern __shared__ uint4 xs_words[];  // n_tok rows of cols bf16
    SmemBf16 *xs = (SmemBf16 *) xs_words;
    gemv_norm_stage(xs, h, x, nw, eps, cols, n_tok);
    constexpr int RP = gemv_pair_rows(R);
    int b;
    const int s = gemv_group_segment(g, &b);
    if (g.w_up[s])
        gemv_sk_rows<2 * RP, NT, float, SmemBf16, true>(g.y[s], g.w[s], xs, NULL, g.rows[s], cols,
                                                        1, n_tok, 0, b * RP, g.w_up[s]);
    else
        gemv_sk_rows<R, NT, float, SmemBf16>(g.y[s], g.w[s], xs, NULL, g.rows[s], cols, 1, n_tok,
                                             0, b * R);
}

// ---------------------------------------------------------------------------
// Tensor-core GEMV: mma.sync m16n8k16 (bf16 in, fp32 accumulate)
//
// The tokens are the MMA's M (rows 0..15 = tokens, unused ones zero) and 8 weight rows its N,
// so one weight load serves every token with one MMA per 16 weights per row, instead of one
// fp32 FMA per weight per token (which made the CUDA-core GEMV instruction-bound at 4+
// tokens). A block is 8 warps on the same 8 rows (or J groups of 8: below); lane (g = lane/4,
// c = lane%4) loads 16 bytes (8 weights) of row r0+g and the same 8 inputs of tokens g and g+8,
// so a warp covers 32 columns per tile and takes tiles warp, warp+8, ... (4 tiles' loads in
// flight). The MMA's k order is a relabelling of the 32 columns (A and B lanes with the same c
// hold the same columns), so no shuffles are needed. The 8 warps' partial sums meet in shared
// memory and are added in warp order: reproducible, no atomics.

#ifndef GEMV_TC_TILES_IN_FLIGHT
#define GEMV_TC_TILES_IN_FLIGHT 4  // a build may set it, to measure another
#endif
enum { MMA_WARPS = 8, MMA_TILES_IN_FLIGHT = GEMV_TC_TILES_IN_FLIGHT };

// Row groups: a block may take J groups of 8 rows (8J rows), its warps loading each tile's
// inputs once for the J weight loads and 2J MMAs; the inputs a lane reads (32 or 64 bytes of
// fp32 for 16 of weights at 16 tokens) are then shared by J groups. Each row's sums are the
// same in any J: the same tiles in each warp, the warps added in the same order.
// A warp's tiles in flight with J groups (J x that many weight loads).
static constexpr __host__ __device__ int gemv_tc_tiles(int J)
{
    return J >= 4 ? 2 : MMA_TILES_IN_FLIGHT;
}

// The tensor-core GEMV's first step: the block's 8J rows, gemv_tc_tiles(J) tiles of 32 columns
// for each of its warps.
template <int J>
static __device__ __forceinline__ void gemv_tc_prefetch(const uint16_t *w, int rows, int cols)
{
    const int blocks_per_mat = CEIL_DIV(rows, 8 * J);
    gemv_rows_prefetch(w, rows, cols, blockIdx.x / blocks_per_mat,
                       (blockIdx.x % blocks_per_mat) * 8 * J, 8 * J,
                       MMA_WARPS * gemv_tc_tiles(J) * 32 * 2, threadIdx.x,
                       MMA_WARPS * WARP_SIZE);
}

template <int J, typename OutT, typename XT>
static __global__ void __launch_bounds__(MMA_WARPS *WARP_SIZE)
    gemm_bf16_gemv_tc_kernel(OutT *__restrict__ y, const uint16_t *__restrict__ w,
                             const XT *__restrict__ x, const float *residual, int rows,
                             int cols, int n_mat, int n_tok)
{
    KERN_ENTRY_AFTER(gemv_tc_prefetch<J>(w, rows, cols));
    constexpr int TIF = gemv_tc_tiles(J);
    __shared__ float4 red[J][MMA_WARPS][WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / 4, c = lane % 4;
    const int blocks_per_mat = CEIL_DIV(rows, 8 * J);
    const int m = blockIdx.x / blocks_per_mat;
    const int r0 = (blockIdx.x % blocks_per_mat) * 8 * J;
    const int n_chunks = cols / 8, n_tiles = CEIL_DIV(n_chunks, 4);
    // Rows past the end are clamped (their sums are not stored); so are absent tokens' inputs
    // (not loaded: zeros).
    const uint16_t *wr[J];
#pragma unroll
    for (int j = 0; j < J; j++) wr[j] = w + ((size_t) m * rows + min(r0 + 8 * j + g, rows - 1)) * cols;
    const XT *x0 = x + ((size_t) min(g, n_tok - 1) * n_mat + m) * cols;
    const XT *x1 = x + ((size_t) min(g + 8, n_tok - 1) * n_mat + m) * cols;
    const bool has0 = g < n_tok, has1 = g + 8 < n_tok;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    float d[J][4];
#pragma unroll
    for (int j = 0; j < J; j++) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
    for (int t0 = warp; t0 < n_tiles; t0 += MMA_WARPS * TIF) {
        uint4 wv[TIF][J], xa[TIF], xb[TIF];
#pragma unroll
        for (int u = 0; u < TIF; u++) {
            const int ch = (t0 + u * MMA_WARPS) * 4 + c;
            const bool ok = ch < n_chunks;
#pragma unroll
            for (int j = 0; j < J; j++) wv[u][j] = ok ? ld_stream_u4(wr[j] + (size_t) ch * 8) : zero;
            xa[u] = ok && has0 ? load_x8(x0, ch) : zero;
            xb[u] = ok && has1 ? load_x8(x1, ch) : zero;
        }
#pragma unroll
        for (int u = 0; u < TIF; u++)
#pragma unroll
            for (int j = 0; j < J; j++) {
                mma_bf16_16816(d[j], xa[u].x, xb[u].x, xa[u].y, xb[u].y, wv[u][j].x, wv[u][j].y);
                mma_bf16_16816(d[j], xa[u].z, xb[u].z, xa[u].w, xb[u].w, wv[u][j].z, wv[u][j].w);
            }
    }
#pragma unroll
    for (int j = 0; j < J; j++) red[j][warp][lane] = make_float4(d[j][0], d[j][1], d[j][2], d[j][3]);
    __syncthreads();
    if (warp < J) {  // warp j adds group j's partial sums, in warp order
        const int j = warp, rj = r0 + 8 * j;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < MMA_WARPS; i++) {
            const float4 p = red[j][i][lane];
            v[0] += p.x;
            v[1] += p.y;
            v[2] += p.z;
            v[3] += p.w;
        }
        // Accumulator q of lane (g, c): token g + 8 * (q / 2), row rj + 2c + q % 2.
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int tok = g + 8 * (q >> 1), r = rj + 2 * c + (q & 1);
            if (tok < n_tok && r < rows) {
                const size_t o = ((size_t) tok * n_mat + m) * rows + r;
                store_out<OutT>(y + o, residual ? v[q] + residual[o] : v[q]);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Launchers

// One launch: the warp-per-row kernel (a block of 8 warps, each on R rows) or (SK) the
// split-K one (a block on R rows).
template <int R, int NT, bool SK, typename OutT, typename XT>
static void launch_gemv_kernel(OutT *y, const uint16_t *w, const XT *x, const float *residual,
                               int rows, int cols, int n_mat, int n_tok, cudaStream_t stream)
{
    const long units = (long) n_mat * CEIL_DIV(rows, R);  // warps, or (SK) blocks
    const long n_blocks = SK ? units : CEIL_DIV(units, GEMV_WARPS);
    ASSERT(n_blocks <= 0x7fffffffL);
    const dim3 grid((unsigned) n_blocks), block(GEMV_WARPS * WARP_SIZE);
    if constexpr (SK)
        kern_launch(gemm_bf16_gemv_sk_kernel<R, NT, OutT, XT>, grid, block, 0, stream, y, w, x,
                    residual, rows, cols, n_mat, n_tok);
    else
        kern_launch(gemm_bf16_gemv_kernel<R, NT, OutT, XT>, grid, block, 0, stream, y, w, x,
                    residual, rows, cols, n_mat, n_tok);
}

// The token count picks the instantiation (1, 2, 4, 8 or 16 accumulators per row), y_type the
// output type.
template <int R, bool SK, typename XT>
static void launch_gemv_r(void *y, GemmOut y_type, const uint16_t *w, const XT *x,
                          const float *residual, int rows, int cols, int n_mat, int n_tok,
                          cudaStream_t stream)
{
#define GEMV_NT(NT)                                                                               \
    (y_type == GEMM_OUT_F32 ? launch_gemv_kernel<R, NT, SK>((float *) y, w, x, residual, rows,    \
                                                            cols, n_mat, n_tok, stream)           \
                            : launch_gemv_kernel<R, NT, SK>((uint16_t *) y, w, x, residual, rows, \
                                                            cols, n_mat, n_tok, stream))
    if (n_tok <= 1)
        GEMV_NT(1);
    else if (n_tok <= 2)
        GEMV_NT(2);
    else if (n_tok <= 4)
        GEMV_NT(4);
    else if (n_tok <= 8)
        GEMV_NT(8);
    else
        GEMV_NT(16);
#undef GEMV_NT
}

// The preconditions both GEMVs share (gemm.h).
static void check_gemv(GemmOut y_type, const uint16_t *w, const void *x, const float *residual,
                       int rows, int cols, int n_mat, int n_tok)
{
    ASSERT(rows > 0 && cols > 0 && n_mat > 0 && cols % 8 == 0);
    ASSERT(n_tok >= 1 && n_tok <= GEMM_MAX_TOK);
    ASSERT((uintptr_t) w % 16 == 0 && (uintptr_t) x % 16 == 0);
    ASSERT(residual == NULL || y_type == GEMM_OUT_F32);
}

template <typename XT>
static void gemv_any(void *y, GemmOut y_type, const uint16_t *w, const XT *x,
                     const float *residual, int rows, int cols, int n_mat, int n_tok,
                     cudaStream_t stream)
{
    check_gemv(y_type, w, x, residual, rows, cols, n_mat, n_tok);
    // Four rows per warp reuse each input load four times, but only when that still leaves
    // a few warps per multiprocessor to keep loads in flight (132 SMs on H200, 48 on GB10).
    // Up to 4,096 rows in all a warp per row leaves the chip half idle (256 rows of 2048 columns
    // measured 1.8 TB/s): the split-K kernel, with as many rows per block (4, 2, 1) as still
    // give two blocks per multiprocessor.
    const long total = (long) rows * n_mat;
    if (total >= 4L * 32 * 132 && rows % 4 == 0)
        launch_gemv_r<4, false>(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
    else if (total > GEMM_SK_MAX_ROWS)
        launch_gemv_r<1, false>(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
    else if (total >= 4L * 2 * 132)
        launch_gemv_r<4, true>(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
    else if (total >= 2L * 2 * 132)
        launch_gemv_r<2, true>(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
    else
        launch_gemv_r<1, true>(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
}

template <int J, typename XT>
static void launch_gemv_tc(void *y, GemmOut y_type, const uint16_t *w, const XT *x,
                           const float *residual, int rows, int cols, int n_mat, int n_tok,
                           cudaStream_t stream)
{
    const long n_blocks = (long) n_mat * CEIL_DIV(rows, 8 * J);
    ASSERT(n_blocks <= 0x7fffffffL);
    const dim3 grid((unsigned) n_blocks), block(MMA_WARPS * WARP_SIZE);
    if (y_type == GEMM_OUT_F32)
        kern_launch(gemm_bf16_gemv_tc_kernel<J, float, XT>, grid, block, 0, stream, (float *) y, w,
                    x, residual, rows, cols, n_mat, n_tok);
    else
        kern_launch(gemm_bf16_gemv_tc_kernel<J, uint16_t, XT>, grid, block, 0, stream,
                    (uint16_t *) y, w, x, residual, rows, cols, n_mat, n_tok);
}

// A block takes 4 or 2 groups of 8 rows, the most that still give every multiprocessor two
// blocks: each tile's inputs loaded once for the groups (measured from one token: docs/perf.md,
// run 28).
template <typename XT>
static void gemv_tc_any(void *y, GemmOut y_type, const uint16_t *w, const XT *x,
                        const float *residual, int rows, int cols, int n_mat, int n_tok,
                        cudaStream_t stream)
{
    check_gemv(y_type, w, x, residual, rows, cols, n_mat, n_tok);
    const long two_waves = 2L * kern_sm_count();
    if ((long) n_mat * CEIL_DIV(rows, 32) >= two_waves)
        launch_gemv_tc<4>(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
    else if ((long) n_mat * CEIL_DIV(rows, 16) >= two_waves)
        launch_gemv_tc<2>(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
    else
        launch_gemv_tc<1>(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
}

// The grouped kernel's optional norm (gemm_bf16_gemv_group_norm): h = rmsnorm(x) * w.
typedef struct GroupNorm {
    float *h;
    const float *w;
    float eps;
} GroupNorm;

// The grouped kernel at R rows a block for NT tokens (with nm->h: the norm's kernel).
template <int R, int NT>
static void launch_group(const GemvGroup &g, const float *x, const GroupNorm *nm, int cols,
                         int n_tok, cudaStream_t stream)
{
    if (!nm)
        kern_launch(gemm_bf16_gemv_group_kernel<R, NT, float>, (unsigned) g.first[g.n],
                    GEMV_WARPS * WARP_SIZE, 0, stream, g, x, cols, n_tok);
    else if constexpr (NT <= GEMM_NORM_MAX_TOK)
        kern_launch(gemm_bf16_gemv_group_norm_kernel<R, NT>, (unsigned) g.first[g.n],
                    GEMV_WARPS * WARP_SIZE, (size_t) n_tok * cols * 2, stream, g, nm->h, x, nm->w,
                    nm->eps, cols, n_tok);
    else
        ASSERT(!"a grouped norm takes at most GEMM_NORM_MAX_TOK tokens");
}

template <int R>
static void group_r(GemvGroup &g, const GemmSeg *segs, const float *x, const GroupNorm *nm,
                    int cols, int n_tok, cudaStream_t stream)
{
    constexpr int RP = gemv_pair_rows(R);  // as the kernel takes a SwiGLU pair's rows
    g.first[0] = 0;
    for (int i = 0; i < g.n; i++)
        g.first[i + 1] = g.first[i] + CEIL_DIV(segs[i].rows, segs[i].w_up ? RP : R);
    if (n_tok <= 1)
        launch_group<R, 1>(g, x, nm, cols, n_tok, stream);
    else if (n_tok <= 2)
        launch_group<R, 2>(g, x, nm, cols, n_tok, stream);
    else if (n_tok <= 4)
        launch_group<R, 4>(g, x, nm, cols, n_tok, stream);
    else if (n_tok <= 8)
        launch_group<R, 8>(g, x, nm, cols, n_tok, stream);
    else
        launch_group<R, 16>(g, x, nm, cols, n_tok, stream);
}

static void gemv_group(const GemmSeg *segs, int n_segs, const float *x, const GroupNorm *nm,
                       int cols, int n_tok, cudaStream_t stream)
{
    ASSERT(segs && n_segs >= 1 && n_segs <= GEMM_MAX_GROUP);
    GemvGroup g;
    memset(&g, 0, sizeof g);
    g.n = n_segs;
    long total = 0;
    for (int i = 0; i < n_segs; i++) {
        check_gemv(GEMM_OUT_F32, segs[i].w, x, NULL, segs[i].rows, cols, 1, n_tok);
        ASSERT(segs[i].rows <= GEMM_SK_MAX_ROWS && segs[i].y);
        ASSERT(!segs[i].w_up || (uintptr_t) segs[i].w_up % 16 == 0);
        g.w[i] = segs[i].w;
        g.w_up[i] = segs[i].w_up;
        g.y[i] = segs[i].y;
        g.rows[i] = segs[i].rows;
        total += segs[i].w_up ? 2L * segs[i].rows : segs[i].rows;
    }
    // Rows a block as gemv_any's split-K branches pick them, from all the segments' rows.
    if (total >= 4L * 2 * 132)
        group_r<4>(g, segs, x, nm, cols, n_tok, stream);
    else if (total >= 2L * 2 * 132)
        group_r<2>(g, segs, x, nm, cols, n_tok, stream);
    else
        group_r<1>(g, segs, x, nm, cols, n_tok, stream);
}

void gemm_bf16_gemv_group(const GemmSeg *segs, int n_segs, const float *x, int cols, int n_tok,
                          cudaStream_t stream)
{
    gemv_group(segs, n_segs, x, NULL, cols, n_tok, stream);
}

bool gemm_group_norm_ok(const float *h, const float *x, const float *w, int cols, int n_tok)
{
    const uintptr_t hb = (uintptr_t) h, xb = (uintptr_t) x, bytes = (uintptr_t) n_tok * cols * 4;
    return n_tok >= 1 && n_tok <= GEMM_NORM_MAX_TOK && cols % 8 == 0
           && (size_t) n_tok * cols * 2 <= GEMM_NORM_SMEM && hb % 16 == 0 && xb % 16 == 0
           && (uintptr_t) w % 16 == 0 && (hb + bytes <= xb || xb + bytes <= hb);
}

void gemm_bf16_gemv_group_norm(const GemmSeg *segs, int n_segs, float *h, const float *x,
                               const float *w, float eps, int cols, int n_tok, cudaStream_t stream)
{
    ASSERT(gemm_group_norm_ok(h, x, w, cols, n_tok) && eps >= 0.0f);
    const GroupNorm nm = {h, w, eps};
    gemv_group(segs, n_segs, x, &nm, cols, n_tok, stream);
}

void gemm_bf16_gemv(void *y, GemmOut y_type, const uint16_t *w, const uint16_t *x,
                    const float *residual, int rows, int cols, int n_mat, int n_tok,
                    cudaStream_t stream)
{
    gemv_any(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
}

void gemm_bf16_gemv_tc(void *y, GemmOut y_type, const uint16_t *w, const uint16_t *x,
                       const float *residual, int rows, int cols, int n_mat, int n_tok,
                       cudaStream_t stream)
{
    gemv_tc_any(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
}

void gemm_bf16_gemv_f32x(void *y, GemmOut y_type, const uint16_t *w, const float *x,
                         const float *residual, int rows, int cols, int n_mat, int n_tok,
                         cudaStream_t stream)
{
    gemv_any(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
}

void gemm_bf16_gemv_tc_f32x(void *y, GemmOut y_type, const uint16_t *w, const float *x,
                            const float *residual, int rows, int cols, int n_mat, int n_tok,
                            cudaStream_t stream)
{
    gemv_tc_any(y, y_type, w, x, residual, rows, cols, n_mat, n_tok, stream);
}

// ---------------------------------------------------------------------------
// cuBLASLt GEMM

#define CUBLAS_CHECK(call)                                                              \
    do {                                                                                \
        const cublasStatus_t cublas_rc_ = (call);                                       \
        if (cublas_rc_ != CUBLAS_STATUS_SUCCESS)                                        \
            log_fatal(__FILE__, __LINE__, "%s: cublas status %d", #call, (int) cublas_rc_); \
    } while (0)

typedef struct LtPlan {
    int m, n, k, n_mat, y_type;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
} LtPlan;

enum { LT_MAX_PLANS = 128 };

void gemm_lt_init(GemmLt *lt)
{
    cublasLtHandle_t h = NULL;
    CUBLAS_CHECK(cublasLtCreate(&h));
    lt->handle = h;
    lt->workspace_bytes = (size_t) 32 << 20;
    CUDA_CHECK(cudaMalloc(&lt->workspace, lt->workspace_bytes));
    lt->plans = calloc(LT_MAX_PLANS, sizeof(LtPlan));
    ASSERT(lt->plans);
    lt->n_plans = 0;
}

static void plan_destroy(LtPlan *p)
{
    cublasLtMatrixLayoutDestroy(p->lc);
    cublasLtMatrixLayoutDestroy(p->lb);
    cublasLtMatrixLayoutDestroy(p->la);
    cublasLtMatmulDescDestroy(p->op);
}

void gemm_lt_free(GemmLt *lt)
{
    if (!lt) return;
    for (int i = 0; i < lt->n_plans; i++) plan_destroy((LtPlan *) lt->plans + i);
    free(lt->plans);
    if (lt->handle) cublasLtDestroy((cublasLtHandle_t) lt->handle);
    if (lt->workspace) CUDA_CHECK(cudaFree(lt->workspace));
    lt->handle = NULL;
    lt->workspace = NULL;
    lt->workspace_bytes = 0;
    lt->plans = NULL;
    lt->n_plans = 0;
}

// A strided batch of n_mat matrices on a layout (batch offset in elements).
static void layout_batch(cublasLtMatrixLayout_t l, int n_mat, int64_t stride)
{
    const int32_t count = n_mat;
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                  sizeof count));
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                  &stride, sizeof stride));
}

// Column-major view, per matrix i: Y_i^T [n, m] = W_i [n, k] (stored as k x n, transposed) *
// X_i^T [k, m], where X_i and Y_i are matrix i's column slices of x and y (leading dimensions
// n_mat k and n_mat n, batch offsets k and n) and W_i is w's i-th [n, k] block.
static void plan_init(LtPlan *p, GemmLt *lt, int m, int n, int k, int n_mat, GemmOut y_type)
{
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cudaDataType_t yt = y_type == GEMM_OUT_F32 ? CUDA_R_32F : CUDA_R_16BF;
    p->m = m, p->n = n, p->k = k, p->n_mat = n_mat, p->y_type = (int) y_type;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, k, n, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, k, m, (int64_t) n_mat * k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, yt, n, m, (int64_t) n_mat * n));
    if (n_mat > 1) {
        layout_batch(p->la, n_mat, (int64_t) n * k);
        layout_batch(p->lb, n_mat, k);
        layout_batch(p->lc, n_mat, n);
    }
    cublasLtMatmulPreference_t pref = NULL;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lt->workspace_bytes,
        sizeof lt->workspace_bytes));
    cublasLtMatmulHeuristicResult_t heur;
    int n_found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t) lt->handle, p->op, p->la, p->lb,
                                                p->lc, p->lc, pref, 1, &heur, &n_found));
    cublasLtMatmulPreferenceDestroy(pref);
    ASSERT(n_found > 0);
    p->algo = heur.algo;
}

void gemm_bf16_lt(void *y, GemmOut y_type, const uint16_t *x, const uint16_t *w, int m, int n,
                  int k, GemmLt *lt, cudaStream_t stream)
{
    gemm_bf16_lt_mats(y, y_type, x, w, m, n, k, 1, lt, stream);
}

void gemm_bf16_lt_mats(void *y, GemmOut y_type, const uint16_t *x, const uint16_t *w, int m,
                       int n, int k, int n_mat, GemmLt *lt, cudaStream_t stream)
{
    ASSERT(m > 0 && n > 0 && k > 0 && n_mat > 0 && k % 8 == 0);
    ASSERT(n % (y_type == GEMM_OUT_F32 ? 4 : 8) == 0);  // 16-byte rows of y
    ASSERT(lt && lt->handle && lt->plans);
    LtPlan *plans = (LtPlan *) lt->plans, tmp, *p = NULL;
    for (int i = 0; i < lt->n_plans && !p; i++)
        if (plans[i].m == m && plans[i].n == n && plans[i].k == k && plans[i].n_mat == n_mat
            && plans[i].y_type == (int) y_type)
            p = &plans[i];
    if (!p) {
        p = lt->n_plans < LT_MAX_PLANS ? &plans[lt->n_plans++] : &tmp;
        plan_init(p, lt, m, n, k, n_mat, y_type);
    }
    const float alpha = 1.0f, beta = 0.0f;
    CUBLAS_CHECK(cublasLtMatmul((cublasLtHandle_t) lt->handle, p->op, &alpha, w, p->la, x, p->lb,
                                &beta, y, p->lc, y, p->lc, &p->algo, lt->workspace,
                                lt->workspace_bytes, stream));
    if (p == &tmp) plan_destroy(p);
}
