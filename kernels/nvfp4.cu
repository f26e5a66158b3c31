/*
 * nvfp4.cu - NVFP4 weight x bf16 activation products: GEMV for decode, dequantize + cuBLASLt
 * GEMM for prefill.
 *
 * GEMV decomposition. A block is 8 warps; each warp owns R rows (R = 4 when the matrix has
 * enough rows to give every SM a few warps, else 1). A 16-byte chunk holds 32 codes, i.e. two
 * scale groups; lane l reads chunks l, l+32, ... of each of its rows plus the two matching
 * scale bytes, software-pipelined: the next chunk's loads are issued before the current one
 * is computed (NVFP4 has 8x the arithmetic per byte of bf16, so a warp that waited for each
 * load in turn left the memory system idle half the time). The 32 inputs of a chunk are loaded once per
 * token and reused for the R rows. Dequantization is in registers (nvfp4_dev.cuh); each group
 * is summed in fp32, scaled, and added to the lane's row sum; a warp butterfly finishes.
 *
 * Bytes per weight: 0.5 (code) + 1/16 (scale) = 0.5625. The launcher reads no globals and
 * allocates nothing; nvfp4_gemm takes its bf16 staging buffer from the caller.
 */
#include "kernels/nvfp4.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/nvfp4_dev.cuh"

enum { NVFP4_WARPS = 8 };

// ---------------------------------------------------------------------------
// GEMV kernel

template <typename OutT> static __device__ __forceinline__ void nv_store(OutT *p, float v);
template <> __device__ __forceinline__ void nv_store<float>(float *p, float v)
{
    *p = v;
}
template <> __device__ __forceinline__ void nv_store<uint16_t>(uint16_t *p, float v)
{
    *p = f32_to_bf16_bits(v);
}

template <int R>
static __device__ __forceinline__ void nv_load(uint4 *q, uint16_t *sc, const uint8_t *const *q_rows,
                                               const uint16_t *const *s_rows, int c)
{
#pragma unroll
    for (int i = 0; i < R; i++) {
        q[i] = ld_stream_u4(q_rows[i] + (size_t) c * 16);
        sc[i] = __ldg(s_rows[i] + c);
    }
}

template <int R, int NT>
static __device__ __forceinline__ void nv_compute(float (*acc)[NT], const uint4 *q,
                                                  const uint16_t *sc, const uint16_t *x, int cols,
                                                  int c, int n_tok)
{
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < n_tok) {
            float xf[32];
            load_x32(x + (size_t) t * cols + (size_t) c * 32, xf);
#pragma unroll
            for (int i = 0; i < R; i++) acc[i][t] += nvfp4_chunk_dot(q[i], sc[i], xf);
        }
    }
}

template <int R, int NT, typename OutT>
static __global__ void __launch_bounds__(NVFP4_WARPS *WARP_SIZE)
    nvfp4_gemv_kernel(OutT *__restrict__ y, const uint8_t *__restrict__ q,
                      const uint8_t *__restrict__ scale, float global_scale,
                      const uint16_t *__restrict__ x, const float *residual, int rows, int cols,
                      int n_tok)
{
    const int lane = threadIdx.x % WARP_SIZE;
    const int r0 = (blockIdx.x * NVFP4_WARPS + threadIdx.x / WARP_SIZE) * R;
    if (r0 >= rows) return;

    const int n_chunks = cols / 32;
    const uint8_t *q_rows[R];
    const uint16_t *s_rows[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        const int r = min(r0 + i, rows - 1);
        q_rows[i] = q + (size_t) r * (cols / 2);
        s_rows[i] = (const uint16_t *) (scale + (size_t) r * (cols / NVFP4_GROUP));
    }

    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;

    // Software pipeline: the next chunk's loads are in flight while this one is computed.
    uint4 qa[R], qb[R];
    uint16_t sa[R], sb[R];
    if (lane < n_chunks) nv_load<R>(qa, sa, q_rows, s_rows, lane);
    for (int c = lane; c < n_chunks; c += 2 * WARP_SIZE) {
        const int c1 = c + WARP_SIZE, c2 = c + 2 * WARP_SIZE;
        if (c1 < n_chunks) nv_load<R>(qb, sb, q_rows, s_rows, c1);
        nv_compute<R, NT>(acc, qa, sa, x, cols, c, n_tok);
        if (c1 < n_chunks) {
            if (c2 < n_chunks) nv_load<R>(qa, sa, q_rows, s_rows, c2);
            nv_compute<R, NT>(acc, qb, sb, x, cols, c1, n_tok);
        }
    }

#pragma unroll
    for (int i = 0; i < R; i++) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float v = warp_sum(acc[i][t]) * global_scale;
            const int r = r0 + i;
            if (lane == (i * NT + t) % WARP_SIZE && t < n_tok && r < rows) {
                const size_t o = (size_t) t * rows + r;
                nv_store<OutT>(y + o, residual ? v + residual[o] : v);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Dequantize kernel: one thread per 16-weight group, writing 32 bytes of bf16.

static __global__ void nvfp4_dequant_kernel(uint16_t *__restrict__ out,
                                            const uint8_t *__restrict__ q,
                                            const uint8_t *__restrict__ scale, float global_scale,
                                            long n_groups)
{
    const long g = (long) blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n_groups) return;
    const uint2 codes = *(const uint2 *) (q + g * 8);
    const float s = e4m3_bits_to_f32(scale[g]) * global_scale;
    const uint32_t cw[2] = {codes.x, codes.y};
    uint32_t packed[8];
#pragma unroll
    for (int j = 0; j < 2; j++) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t b = cw[j] >> (8 * k);
            const float lo = nvfp4_e2m1_to_float((uint8_t) (b & 15)) * s;
            const float hi = nvfp4_e2m1_to_float((uint8_t) ((b >> 4) & 15)) * s;
            packed[4 * j + k] = (uint32_t) f32_to_bf16_bits(lo) | ((uint32_t) f32_to_bf16_bits(hi) << 16);
        }
    }
    uint4 *o = (uint4 *) (out + g * 16);
    o[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    o[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// ---------------------------------------------------------------------------
// Launchers

template <int R, int NT>
static void launch_nv(void *y, GemmOut y_type, const Nvfp4Matrix *w, const uint16_t *x,
                      const float *residual, int n_tok, cudaStream_t stream)
{
    const dim3 grid((unsigned) CEIL_DIV(CEIL_DIV(w->rows, R), NVFP4_WARPS));
    const dim3 block(NVFP4_WARPS * WARP_SIZE);
    if (y_type == GEMM_OUT_F32)
        nvfp4_gemv_kernel<R, NT, float><<<grid, block, 0, stream>>>(
            (float *) y, w->q, w->scale, w->global_scale, x, residual, w->rows, w->cols, n_tok);
    else
        nvfp4_gemv_kernel<R, NT, uint16_t><<<grid, block, 0, stream>>>(
            (uint16_t *) y, w->q, w->scale, w->global_scale, x, residual, w->rows, w->cols, n_tok);
    CUDA_CHECK(cudaGetLastError());
}

template <int R>
static void launch_nv_r(void *y, GemmOut y_type, const Nvfp4Matrix *w, const uint16_t *x,
                        const float *residual, int n_tok, cudaStream_t stream)
{
    if (n_tok <= 1)
        launch_nv<R, 1>(y, y_type, w, x, residual, n_tok, stream);
    else if (n_tok <= 2)
        launch_nv<R, 2>(y, y_type, w, x, residual, n_tok, stream);
    else if (n_tok <= 4)
        launch_nv<R, 4>(y, y_type, w, x, residual, n_tok, stream);
    else if (n_tok <= 8)
        launch_nv<R, 8>(y, y_type, w, x, residual, n_tok, stream);
    else
        launch_nv<R, 16>(y, y_type, w, x, residual, n_tok, stream);
}

void nvfp4_gemv(void *y, GemmOut y_type, const Nvfp4Matrix *w, const uint16_t *x,
                const float *residual, int n_tok, cudaStream_t stream)
{
    ASSERT(w->rows > 0 && w->cols > 0 && w->cols % 32 == 0);
    ASSERT(n_tok >= 1 && n_tok <= GEMM_MAX_TOK);
    ASSERT((uintptr_t) w->q % 16 == 0 && (uintptr_t) w->scale % 2 == 0);
    ASSERT((uintptr_t) x % 16 == 0);
    ASSERT(residual == NULL || y_type == GEMM_OUT_F32);
    if (w->rows >= 4 * 32 * 132 && w->rows % 4 == 0)
        launch_nv_r<4>(y, y_type, w, x, residual, n_tok, stream);
    else
        launch_nv_r<1>(y, y_type, w, x, residual, n_tok, stream);
}

void nvfp4_dequant_bf16(uint16_t *out, const Nvfp4Matrix *w, cudaStream_t stream)
{
    ASSERT(w->rows > 0 && w->cols > 0 && w->cols % NVFP4_GROUP == 0);
    ASSERT((uintptr_t) w->q % 8 == 0 && (uintptr_t) out % 16 == 0);
    const long n_groups = (long) w->rows * (w->cols / NVFP4_GROUP);
    nvfp4_dequant_kernel<<<(unsigned) CEIL_DIV(n_groups, 256), 256, 0, stream>>>(
        out, w->q, w->scale, w->global_scale, n_groups);
    CUDA_CHECK(cudaGetLastError());
}

void nvfp4_gemm(void *y, GemmOut y_type, const uint16_t *x, const Nvfp4Matrix *w, int m,
                uint16_t *wbuf, GemmLt *lt, cudaStream_t stream)
{
    nvfp4_dequant_bf16(wbuf, w, stream);
    gemm_bf16_lt(y, y_type, x, wbuf, m, w->rows, w->cols, lt, stream);
}
