/*
 * dsa.cu - DSA indexer for decode: key append, scores, top-k.
 *
 * Scores: grid (pages, n_tok); a CTA of 4 warps covers one 128-position page, a warp 32
 * positions one after another. Lane l owns key dims 4l..4l+3 and keeps the matching slice of
 * all (up to 32) query heads in registers, so a position costs one 4-byte fp8 load per lane,
 * 128 FMAs per lane, and a 31-shuffle transpose-reduction after which lane h holds head h's
 * dot product; ReLU, the head weight and a warp sum finish the score.
 *
 * Top-k: one CTA of 1024 threads per token. A 4-pass MSB-first radix select over the scores'
 * order-preserving 32-bit keys finds the k-th largest key T and how many positions equal to T
 * to keep; a final ordered pass (ballot prefix sums) writes the positions with key > T and the
 * first such ties, in ascending order. Scores are read 5 times from L2 (128 KB at 32K context).
 */
#include "kernels/dsa.h"

#include "common/cuda_check.h"
#include "kernels/common.cuh"

enum { TOPK_THREADS = 1024 };

// ---------------------------------------------------------------------------
// Append and score kernels

static __global__ void dsa_append_kernel(uint8_t *__restrict__ cache, const float *__restrict__ k,
                                         const float *__restrict__ ln_w,
                                         const float *__restrict__ ln_b, float eps, float theta,
                                         const int32_t *__restrict__ pos,
                                         const int32_t *__restrict__ seq,
                                         const int32_t *__restrict__ block_table, int max_blocks)
{
    __shared__ float red[4];
    __shared__ float y[DSA_DIM];
    const int t = blockIdx.x, d = threadIdx.x, lane = d % WARP_SIZE, warp = d / WARP_SIZE;
    const float x = k[(size_t) t * DSA_DIM + d];
    float s = warp_sum(x);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    const float mean = (red[0] + red[1] + red[2] + red[3]) / DSA_DIM;
    __syncthreads();
    const float c = x - mean;
    s = warp_sum(c * c);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    const float inv = rsqrtf((red[0] + red[1] + red[2] + red[3]) / DSA_DIM + eps);
    y[d] = fmaf(c * inv, ln_w[d], ln_b[d]);
    __syncthreads();
    float v = y[d];
    if (d < DSA_ROPE) {
        const int i = d / 2;
        const double inv_freq = pow((double) theta, -2.0 * i / DSA_ROPE);
        double sn, cs;
        sincos((double) pos[t] * inv_freq, &sn, &cs);
        v = (d % 2 == 0) ? y[d] * (float) cs - y[d + 1] * (float) sn
                         : y[d] * (float) cs + y[d - 1] * (float) sn;
    }
    __syncthreads();  // red is reused below
    const float a = warp_max(fabsf(v));
    if (lane == 0) red[warp] = a;
    __syncthreads();
    const float m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    const float scale = m > 0.0f ? m / 448.0f : 1.0f;
    const int p = pos[t];
    const int blk = block_table[(size_t) seq[t] * max_blocks + p / DSA_BLOCK];
    uint8_t *page = cache + (size_t) blk * DSA_BLOCK_BYTES;
    page[(p % DSA_BLOCK) * DSA_DIM + d] = f32_to_e4m3_bits(v / scale);
    if (d == 0) ((float *) (page + DSA_BLOCK * DSA_DIM))[p % DSA_BLOCK] = scale;
}

static __global__ void __launch_bounds__(128)
    dsa_scores_kernel(float *__restrict__ scores, int score_stride, const float *__restrict__ q,
                      const float *__restrict__ w, float w_scale, float sm_scale,
                      const uint8_t *__restrict__ cache, const int32_t *__restrict__ block_table,
                      int max_blocks, const int32_t *__restrict__ seq,
                      const int32_t *__restrict__ kv_len, int n_heads)
{
    const int page_i = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int len = kv_len[t];
    const int p0 = page_i * DSA_BLOCK;
    if (p0 >= len) return;

    float qr[DSA_MAX_HEADS][4];
#pragma unroll
    for (int h = 0; h < DSA_MAX_HEADS; h++) {
        const float4 v = h < n_heads ? *(const float4 *) (q + ((size_t) t * n_heads + h) * DSA_DIM + lane * 4)
                                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        qr[h][0] = v.x;
        qr[h][1] = v.y;
        qr[h][2] = v.z;
        qr[h][3] = v.w;
    }
    const float wh = lane < n_heads ? w[(size_t) t * n_heads + lane] * w_scale : 0.0f;
    const int blk = block_table[(size_t) seq[t] * max_blocks + page_i];
    const uint8_t *page = cache + (size_t) blk * DSA_BLOCK_BYTES;
    const float *kscale = (const float *) (page + DSA_BLOCK * DSA_DIM);

    for (int r = warp * 32; r < warp * 32 + 32; r++) {
        const int p = p0 + r;
        if (p >= len) break;
        const uint32_t kb = *(const uint32_t *) (page + r * DSA_DIM + lane * 4);
        const float ks = kscale[r];
        float kf[4];
#pragma unroll
        for (int j = 0; j < 4; j++) kf[j] = e4m3_bits_to_f32((uint8_t) (kb >> (8 * j))) * ks;
        float part[DSA_MAX_HEADS];
#pragma unroll
        for (int h = 0; h < DSA_MAX_HEADS; h++)
            part[h] = qr[h][0] * kf[0] + qr[h][1] * kf[1] + qr[h][2] * kf[2] + qr[h][3] * kf[3];
        // Transpose-reduce: afterwards part[0] of lane l is the full dot product of head l.
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const bool upper = lane & o;
#pragma unroll
            for (int i = 0; i < o; i++) {
                const float send = upper ? part[i] : part[i + o];
                const float keep = upper ? part[i + o] : part[i];
                part[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        }
        const float sc = warp_sum(wh * fmaxf(part[0] * sm_scale, 0.0f));
        if (lane == 0) scores[(size_t) t * score_stride + p] = sc;
    }
}

// ---------------------------------------------------------------------------
// Top-k kernel

// Order-preserving key of a score; -0 is folded into +0 so that they tie, as in C's <.
static __device__ __forceinline__ uint32_t order_key(float f)
{
    const uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of flag over the block, in thread order; returns the block total.
static __device__ int block_scan(int flag, int *excl, int *warp_tot)
{
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(ballot & ((1u << lane) - 1));
    __syncthreads();
    if (lane == 0) warp_tot[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int i = 0; i < TOPK_THREADS / WARP_SIZE; i++) {
        before += i < warp ? warp_tot[i] : 0;
        total += warp_tot[i];
    }
    *excl = before + in_warp;
    return total;
}

static __global__ void __launch_bounds__(TOPK_THREADS)
    dsa_topk_kernel(int32_t *__restrict__ idx, int32_t *__restrict__ n_sel,
                    const float *__restrict__ scores, int score_stride,
                    const int32_t *__restrict__ kv_len, int k)
{
    __shared__ int hist[256];
    __shared__ int warp_tot[TOPK_THREADS / WARP_SIZE];
    __shared__ uint32_t s_prefix;
    __shared__ int s_remaining;
    const int t = blockIdx.x, tid = threadIdx.x;
    const int len = kv_len[t];
    const float *sc = scores + (size_t) t * score_stride;
    int32_t *out = idx + (size_t) t * k;

    if (len <= k) {
        for (int i = tid; i < len; i += TOPK_THREADS) out[i] = i;
        if (tid == 0) n_sel[t] = len;
        return;
    }

    uint32_t prefix = 0, mask = 0;
    int remaining = k;  // how many of the elements matching prefix we still need
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += TOPK_THREADS) hist[i] = 0;
        __syncthreads();
        for (int i = tid; i < len; i += TOPK_THREADS) {
            const uint32_t key = order_key(sc[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (tid == 0) {
            int acc = 0, digit = 255;
            for (; digit > 0; digit--) {
                if (acc + hist[digit] >= remaining) break;
                acc += hist[digit];
            }
            s_prefix = prefix | ((uint32_t) digit << shift);
            s_remaining = remaining - acc;
        }
        __syncthreads();
        prefix = s_prefix;
        remaining = s_remaining;
        mask |= 255u << shift;
        __syncthreads();
    }
    // prefix is the k-th largest key T; keep every key > T and the first `remaining` keys == T.
    int written = 0, ties_taken = 0;
    for (int base = 0; base < len; base += TOPK_THREADS) {
        const int i = base + tid;
        const uint32_t key = i < len ? order_key(sc[i]) : 0;
        const int gt = i < len && key > prefix;
        const int eq = i < len && key == prefix;
        int ex_gt, ex_eq;
        const int tot_gt = block_scan(gt, &ex_gt, warp_tot);
        const int tot_eq = block_scan(eq, &ex_eq, warp_tot);
        const int take_eq = eq && ties_taken + ex_eq < remaining;
        // Positions are written in ascending order: all selections of this chunk in thread order.
        int ex_take;
        const int tot_take = block_scan(gt || take_eq, &ex_take, warp_tot);
        if (gt || take_eq) out[written + ex_take] = i;
        written += tot_take;
        ties_taken += min(tot_eq, max(remaining - ties_taken, 0));
        (void) tot_gt;
    }
    if (tid == 0) n_sel[t] = k;
}

// ---------------------------------------------------------------------------
// Launchers

void dsa_cache_append(uint8_t *cache, const float *k, const float *ln_w, const float *ln_b,
                      float eps, float theta, const int32_t *pos, const int32_t *seq,
                      const int32_t *block_table, int max_blocks, int n_tok, cudaStream_t stream)
{
    ASSERT(cache && n_tok > 0 && max_blocks > 0 && theta > 0.0f);
    dsa_append_kernel<<<n_tok, DSA_DIM, 0, stream>>>(cache, k, ln_w, ln_b, eps, theta, pos, seq,
                                                     block_table, max_blocks);
    CUDA_CHECK(cudaGetLastError());
}

void dsa_scores(float *scores, int score_stride, const float *q, const float *w, float w_scale,
                float sm_scale, const uint8_t *cache, const int32_t *block_table, int max_blocks,
                const int32_t *seq, const int32_t *kv_len, int max_len, int n_tok, int n_heads,
                cudaStream_t stream)
{
    ASSERT(n_tok > 0 && n_heads > 0 && n_heads <= DSA_MAX_HEADS && max_len > 0);
    ASSERT(score_stride >= max_len && max_blocks * DSA_BLOCK >= max_len);
    ASSERT((uintptr_t) q % 16 == 0);
    const dim3 grid((unsigned) CEIL_DIV(max_len, DSA_BLOCK), (unsigned) n_tok);
    dsa_scores_kernel<<<grid, 128, 0, stream>>>(scores, score_stride, q, w, w_scale, sm_scale,
                                                cache, block_table, max_blocks, seq, kv_len,
                                                n_heads);
    CUDA_CHECK(cudaGetLastError());
}

void dsa_topk(int32_t *idx, int32_t *n_sel, const float *scores, int score_stride,
              const int32_t *kv_len, int n_tok, int k, cudaStream_t stream)
{
    ASSERT(n_tok > 0 && k > 0 && score_stride > 0);
    dsa_topk_kernel<<<n_tok, TOPK_THREADS, 0, stream>>>(idx, n_sel, scores, score_stride, kv_len,
                                                        k);
    CUDA_CHECK(cudaGetLastError());
}
