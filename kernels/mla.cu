/*
 * mla.cu - MLA decode: query split, split-KV absorbed attention and the split merge (the cache
 * is written by kernels/kv.h's kv_write).
 *
 * Attention decomposition: grid (n_split, H / 16, n_tok); a CTA of 256 threads owns 16 heads
 * of one token and one contiguous range of its positions, so each cache tile is read from
 * memory once per 16 heads (4 times per token for H = 64, the extra reads hitting L2). Per
 * tile of 16 positions the CTA
 *   1. gathers the 16 cache rows through the page table, dequantizes them to fp32 in shared
 *      memory (rows padded to 580 floats so that 16 lanes' 16-byte reads cover all banks;
 *      consecutive threads write consecutive 16-byte pieces, so the fill is conflict-free);
 *   2. thread (head hl = tid/16, position tk = tid%16) computes one 576-long score; a
 *      half-warp shuffle gives the tile max and sum of each head (online softmax, fp32);
 *   3. thread (hl, tk) owns 32 of its head's 512 output values (columns tk*4 + 64j) and adds
 *      p * c_kv for the 16 positions, taking each p from its half-warp by shuffle.
 * Shared memory: q 16 x 576 fp32 + tile 16 x 580 fp32 = 74 KB (fits GB10's 99 KB).
 * This is the CUDA-core baseline: at 32K context it is bound by shared-memory bandwidth, not
 * by the cache bytes (H200, 2026-11-30); tensor-core (mma.sync) tiles are the next step.
 *
 * Merge: one CTA per (head, token) rescales the n_split partial outputs by exp(m_s - M); the
 * (m_s, l_s) pairs are reduced by one warp, then the partial outputs are read with all splits'
 * loads independent (the first version walked the splits one dependent load after another;
 * with this merge and the 16-byte query loads, attention at 1K context with 64 splits went from
 * 41 to 29 us per layer on H200, 2026-11-30).
 */
#include "kernels/mla.h"

#include <string.h>

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/launch.cuh"
#include "kernels/rope_format.h"

enum {
    HB = MLA_HEADS_PER_CTA,
    TILE = 16,
    KS_STRIDE = MLA_LK + 4,
    DEC_THREADS = 256,
    BF16_TOKEN_BYTES = MLA_LK * 2,
};

// ---------------------------------------------------------------------------
// Query split kernel

// Block (g, t): heads g * heads_per_block .. of token t (1 or SPLIT_HEADS: the launcher), a
// thread per value of a head; RoPE's cos and sin of the token's position computed once a block
// (in double: GB10's FP64 units are few), as rope.cu computes them once for its block of heads.
enum { SPLIT_HEADS = 8, SPLIT_FEW_TOKENS = 16 };

static __global__ void mla_q_split_kernel(uint16_t *__restrict__ q_nope, float *__restrict__ q_pe,
                                          const float *__restrict__ q,
                                          const int32_t *__restrict__ pos,
                                          const __grid_constant__ RopeFreqs f, int n_heads,
                                          int qk_nope, int qk_rope, int heads_pad,
                                          int heads_per_block)
{
    KERN_ENTRY();
    __shared__ float cs_s[MLA_ROPE / 2], sn_s[MLA_ROPE / 2];
    const int t = blockIdx.y, tid = threadIdx.x;  // MLA_QK_NOPE + MLA_ROPE threads
    const int half = qk_rope / 2, j = tid - MLA_QK_NOPE, i = half > 0 ? j % half : 0;
    if (pos && tid < half) rope_cos_sin(pos[t], f.inv[tid], &cs_s[tid], &sn_s[tid]);
    __syncthreads();
    for (int hh = 0; hh < heads_per_block; hh++) {
        const int h = blockIdx.x * heads_per_block + hh;
        if (h >= heads_pad) break;
        const size_t row = (size_t) t * heads_pad + h;
        const float *qh = h < n_heads ? q + ((size_t) t * n_heads + h) * (qk_nope + qk_rope) : NULL;
        if (tid < MLA_QK_NOPE) {
            q_nope[row * MLA_QK_NOPE + tid] = qh && tid < qk_nope ? f32_to_bf16_bits(qh[tid]) : 0;
            continue;
        }
        float v = 0.0f;
        if (qh && j < qk_rope) {
            const float *pe = qh + qk_nope;
            if (pos) {  // rope.cu's pair i = j mod half: first half a cs - b sn, second b cs + a sn
                float first, second;
                rope_rotate(pe[2 * i], pe[2 * i + 1], cs_s[i], sn_s[i], &first, &second);
                v = j < half ? first : second;
            } else {
                v = pe[j];
            }
        }
        q_pe[row * MLA_ROPE + j] = v;
    }
}

// ---------------------------------------------------------------------------
// Attention kernels

// The cache position of entry i of token t's range [.., end) (the i-th selected position with
// indices), or -1 past end.
static __device__ __forceinline__ int tile_row_pos(int i, int end, int t,
                                                   const int32_t *__restrict__ indices,
                                                   int idx_stride)
{
    if (i >= end) return -1;
    return indices ? indices[(size_t) t * idx_stride + i] : i;
}

// The byte offset in the cache of position p (>= 0) of sequence s, or -1 for p = -1.
static __device__ __forceinline__ long long pos_offset(int p, int s,
                                                       const int32_t *__restrict__ block_table,
                                                       int max_blocks, size_t tb)
{
    if (p < 0) return -1;
    const int blk = block_table[(size_t) s * max_blocks + p / MLA_BLOCK];
    return ((long long) blk * MLA_BLOCK + p % MLA_BLOCK) * (long long) tb;
}

// The byte offset of entry i of token t's range (sequence s), or -1 past end: one row of an
// attention tile.
static __device__ __forceinline__ long long tile_row_offset(int i, int end, int t, int s,
                                                            const int32_t *__restrict__ indices,
                                                            int idx_stride,
                                                            const int32_t *__restrict__ block_table,
                                                            int max_blocks, size_t tb)
{
    if (i >= end) return -1;
    return pos_offset(indices ? indices[(size_t) t * idx_stride + i] : i, s, block_table,
                      max_blocks, tb);
}

template <int CT>
static __global__ void __launch_bounds__(DEC_THREADS)
    mla_decode_kernel(float *__restrict__ ws_o, float *__restrict__ ws_ml,
                      const float *__restrict__ q_lat, const float *__restrict__ q_pe,
                      const uint8_t *__restrict__ cache, const int32_t *__restrict__ block_table,
                      int max_blocks, const int32_t *__restrict__ seq,
                      const int32_t *__restrict__ kv_len, const int32_t *__restrict__ indices,
                      int idx_stride, int n_heads, float sm_scale, int n_split, int vec_q)
{
    KERN_ENTRY();
    extern __shared__ float4 smem4[];
    float *qs = (float *) smem4;   // [HB][MLA_LK]
    float *ks = qs + HB * MLA_LK;  // [TILE][KS_STRIDE]
    __shared__ long long offs[TILE];

    const int split = blockIdx.x, hg = blockIdx.y, t = blockIdx.z;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, hl = tid / TILE, tk = tid % TILE;
    const int h = hg * HB + hl;
    const size_t tb = CT == MLA_CACHE_FP8 ? MLA_FP8_TOKEN_BYTES : BF16_TOKEN_BYTES;

    if (vec_q) {
        // 16 heads x 144 float4: all 9 loads of a thread are in flight before the first store
        // (a scalar loop waited one L2 latency per 256 values; at 1K context with 64 splits the
        // whole CTA is a single tile, so nothing hides that latency).
        enum { Q4 = HB * MLA_LK / 4, Q4_PER = Q4 / DEC_THREADS, ROW4 = MLA_LK / 4 };
        float4 v[Q4_PER];
#pragma unroll
        for (int r = 0; r < Q4_PER; r++) {
            const int i = tid + r * DEC_THREADS, hh = hg * HB + i / ROW4, c4 = i % ROW4;
            v[r] = c4 < MLA_KV_LORA / 4
                       ? __ldg((const float4 *) (q_lat + ((size_t) t * n_heads + hh) * MLA_KV_LORA) + c4)
                       : __ldg((const float4 *) (q_pe + ((size_t) t * n_heads + hh) * MLA_ROPE) + c4 - MLA_KV_LORA / 4);
        }
#pragma unroll
        for (int r = 0; r < Q4_PER; r++) ((float4 *) qs)[tid + r * DEC_THREADS] = v[r];
    } else {
        for (int i = tid; i < HB * MLA_LK; i += DEC_THREADS) {
            const int hh = hg * HB + i / MLA_LK, c = i % MLA_LK;
            qs[i] = c < MLA_KV_LORA ? q_lat[((size_t) t * n_heads + hh) * MLA_KV_LORA + c]
                                    : q_pe[((size_t) t * n_heads + hh) * MLA_ROPE + c - MLA_KV_LORA];
        }
    }

    const int len = kv_len[t];
    const int per = CEIL_DIV(CEIL_DIV(len, n_split), TILE) * TILE;
    const int beg = split * per, end = min(len, beg + per);
    const int s = seq[t];

    float m_run = -INFINITY, l_run = 0.0f;
    float o[32];
#pragma unroll
    for (int j = 0; j < 32; j++) o[j] = 0.0f;

    for (int base = beg; base < end; base += TILE) {
        __syncthreads();  // the previous tile is consumed (and q is in place)
        if (tid < TILE)
            offs[tid] = tile_row_offset(base + tid, end, t, s, indices, idx_stride, block_table,
                                        max_blocks, tb);
        __syncthreads();
        // Consecutive threads fill consecutive 16-byte pieces of a row: coalesced 128-byte
        // loads per warp and conflict-free shared-memory stores.
        if (CT == MLA_CACHE_FP8) {
            for (int it = tid; it < TILE * 160; it += DEC_THREADS) {
                const int tok = it / 160, r = it % 160;
                const long long off = offs[tok];
                if (r < 128) {
                    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (off >= 0) {
                        const uint32_t wd = __ldg((const uint32_t *) (cache + off) + r);
                        const float sc = __ldg((const float *) (cache + off + MLA_KV_LORA) + r / 32);
                        v = make_float4(e4m3_bits_to_f32((uint8_t) wd) * sc,
                                        e4m3_bits_to_f32((uint8_t) (wd >> 8)) * sc,
                                        e4m3_bits_to_f32((uint8_t) (wd >> 16)) * sc,
                                        e4m3_bits_to_f32((uint8_t) (wd >> 24)) * sc);
                    }
                    *(float4 *) (ks + tok * KS_STRIDE + r * 4) = v;
                } else {
                    const int i = r - 128;  // pair of rope values
                    float2 v = make_float2(0.0f, 0.0f);
                    if (off >= 0)
                        v = bf16x2_bits_to_f32(__ldg((const uint32_t *) (cache + off + MLA_KV_LORA + 16) + i));
                    *(float2 *) (ks + tok * KS_STRIDE + MLA_KV_LORA + 2 * i) = v;
                }
            }
        } else {
            for (int it = tid; it < TILE * (MLA_LK / 2); it += DEC_THREADS) {
                const int tok = it / (MLA_LK / 2), i = it % (MLA_LK / 2);
                const long long off = offs[tok];
                float2 v = make_float2(0.0f, 0.0f);
                if (off >= 0) v = bf16x2_bits_to_f32(__ldg((const uint32_t *) (cache + off) + i));
                *(float2 *) (ks + tok * KS_STRIDE + 2 * i) = v;
            }
        }
        __syncthreads();

        const float *qh = qs + hl * MLA_LK;
        const float *kt = ks + tk * KS_STRIDE;
        float sc = 0.0f;
#pragma unroll 8
        for (int c = 0; c < MLA_LK; c += 4) {
            const float4 a = *(const float4 *) (qh + c), b = *(const float4 *) (kt + c);
            sc = fmaf(a.x, b.x, sc);
            sc = fmaf(a.y, b.y, sc);
            sc = fmaf(a.z, b.z, sc);
            sc = fmaf(a.w, b.w, sc);
        }
        const bool valid = offs[tk] >= 0;
        sc = valid ? sc * sm_scale : -INFINITY;
        float mt = sc;
#pragma unroll
        for (int o2 = 8; o2 > 0; o2 >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o2));
        const float m_new = fmaxf(m_run, mt);
        const float p = valid ? expf(sc - m_new) : 0.0f;
        const float alpha = m_run == -INFINITY ? 0.0f : expf(m_run - m_new);
        float ps = p;
#pragma unroll
        for (int o2 = 8; o2 > 0; o2 >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o2);
        l_run = l_run * alpha + ps;
        m_run = m_new;
#pragma unroll
        for (int j = 0; j < 32; j++) o[j] *= alpha;
#pragma unroll 4
        for (int i = 0; i < TILE; i++) {
            const float pi = __shfl_sync(0xffffffffu, p, (lane & 16) | i);
            const float *kr = ks + i * KS_STRIDE + tk * 4;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float4 v = *(const float4 *) (kr + 64 * j);
                o[4 * j] = fmaf(pi, v.x, o[4 * j]);
                o[4 * j + 1] = fmaf(pi, v.y, o[4 * j + 1]);
                o[4 * j + 2] = fmaf(pi, v.z, o[4 * j + 2]);
                o[4 * j + 3] = fmaf(pi, v.w, o[4 * j + 3]);
            }
        }
    }

    const size_t row = ((size_t) t * n_split + split) * n_heads + h;
    float *wo = ws_o + row * MLA_KV_LORA + tk * 4;
    if (beg < end) {  // an empty split's output is never read (mla_merge_kernel)
#pragma unroll
        for (int j = 0; j < 8; j++)
            *(float4 *) (wo + 64 * j) = make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]);
    }
    if (tk == 0) {
        ws_ml[row * 2] = m_run;
        ws_ml[row * 2 + 1] = l_run;
    }
}

// ---------------------------------------------------------------------------
// Tensor-core attention (mla_decode_tc)
//
// Grid (n_split, H / 32, n_tok); 8 warps own 32 heads of one token and one range of its
// positions, in tiles of 32 positions (or, for prefill, H / 64 and 16 warps on 64 heads with
// the next tile's loads in flight: see the kernel). Per tile:
//   1. the 32 cache rows gathered through the page table into shared memory as bf16 (E4M3
//      codes and bf16 values are exact in bf16; the fp8 chunk scales kept apart, fp32), in
//      16-byte loads that a thread issues together (6 at a time), while the next tile's
//      rows are looked up (index, then page) into a register;
//   2. S = Q K^T: warp w computes heads 16 (w % 2) .. +16 x positions 8 (w / 2) .. +8, one
//      MMA chain per 128-value scale chunk, each chunk's sum times its position's scale, the
//      rope part unscaled (q was rounded to bf16 once, on the way into shared memory);
//   3. online softmax per head in fp32 (8 threads a head), the probabilities times each
//      chunk's scale rounded to bf16 (one matrix per chunk; one for a bf16 cache);
//   4. O += P_c V_c: warp w owns heads 16 (w % 2) .. +16 and the 128 output columns of chunk
//      w / 2 (64 fp32 accumulators a thread), rescaled by the heads' alpha first.
// Shared memory: q and the tile 2 x 32 x 584 bf16 (rows padded by 8 so that the fragments'
// 32-bit loads hit 32 different banks), scores 32 x 33 fp32, P 4 x 32 x 40 bf16, two tiles'
// row offsets: 90,624 bytes (GB10's opt-in limit is 101,376; two CTAs an SM on the H200, at
// <= 128 registers); 142,848 with 64 heads (one CTA an SM; not on GB10).
// Output and (max, sum) go to the workspace in mla_decode_kernel's format, for the same
// merge. Run 17 (docs/perf.md) measured the loads one 4-byte word at a time, each waited on
// before the next, at ~49 TFLOP/s in prefill.
enum {
    TC_TILE = 32,
    TC_QS = MLA_LK + 8,        // bf16 row stride of q and the tile
    TC_SS = TC_TILE + 1,       // fp32 row stride of the scores
    TC_PS = TC_TILE + 8,       // bf16 row stride of P
    TC_CHUNKS = MLA_KV_LORA / 128,
};

static size_t tc_smem_bytes(int heads)
{
    return (size_t) heads * TC_QS * 2                        // q (bf16)
           + (size_t) TC_TILE * TC_QS * 2                    // tile (bf16)
           + (size_t) TC_TILE * TC_CHUNKS * 4                // chunk scales
           + (size_t) heads * TC_SS * 4                      // scores
           + (size_t) TC_CHUNKS * heads * TC_PS * 2          // P per chunk
           + (size_t) 3 * heads * 4                          // running max, sum, alpha
           + (size_t) 2 * TC_TILE * 8;                       // row offsets (two tiles)
}

// 32 heads a CTA: two CTAs an SM on sm_90 (2 x 90 KB of its 227 KB: at most 128 registers);
// one elsewhere (GB10's SM has ~100 KB of shared memory), without the register cap that would
// spill. 64 heads (512 threads, 142 KB): one CTA an SM, 128 registers.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define TC_MIN_BLOCKS 2
#else
#define TC_MIN_BLOCKS 1
#endif

// One 16-byte word `it` of a tile (row it / row16, word it % row16) into shared memory: fp8
// codes to bf16 (exact), the fp8 chunk scales apart, rope and bf16 rows as they are.
template <int CT>
static __device__ __forceinline__ void tc_store_word(uint16_t *ks, float *scl, int it, uint4 v)
{
    constexpr int ROW16 = CT == MLA_CACHE_FP8 ? MLA_FP8_TOKEN_BYTES / 16 : BF16_TOKEN_BYTES / 16;
    const int tok = it / ROW16, r = it % ROW16;
    uint16_t *row = ks + tok * TC_QS;
    if (CT == MLA_CACHE_FP8) {
        if (r < MLA_KV_LORA / 16) {  // 16 codes -> 16 bf16 (exact)
            const uint2 b0 = e4m3x4_to_bf16x4(v.x), b1 = e4m3x4_to_bf16x4(v.y);
            const uint2 b2 = e4m3x4_to_bf16x4(v.z), b3 = e4m3x4_to_bf16x4(v.w);
            *(uint4 *) (row + 16 * r) = make_uint4(b0.x, b0.y, b1.x, b1.y);
            *(uint4 *) (row + 16 * r + 8) = make_uint4(b2.x, b2.y, b3.x, b3.y);
        } else if (r == MLA_KV_LORA / 16) {  // the 4 chunk scales
            *(uint4 *) (scl + tok * TC_CHUNKS) = v;
        } else {  // rope: 8 bf16
            *(uint4 *) (row + MLA_KV_LORA + 8 * (r - MLA_KV_LORA / 16 - 1)) = v;
        }
    } else {
        *(uint4 *) (row + 8 * r) = v;
    }
}

// A tile's words for thread tid of THREADS (word tid + i THREADS in v[i], the tile's rows at
// byte offsets offs[], -1: a missing row, read as 0), the prefetching kernel's loads.
template <int CT, int THREADS>
static __device__ __forceinline__ void tc_load_tile(uint4 *v, const long long *offs,
                                                    const uint8_t *__restrict__ cache, int tid)
{
    constexpr int ROW16 = CT == MLA_CACHE_FP8 ? MLA_FP8_TOKEN_BYTES / 16 : BF16_TOKEN_BYTES / 16,
                  N16 = TC_TILE * ROW16, PER = (N16 + THREADS - 1) / THREADS;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int it = tid + i * THREADS;
        v[i] = make_uint4(0u, 0u, 0u, 0u);
        if (it < N16 && offs[it / ROW16] >= 0)
            v[i] = __ldg((const uint4 *) (cache + offs[it / ROW16]) + it % ROW16);
    }
}

// Grid (n_split, H / HEADS, n_tok), 8 x HEADS threads (HEADS / 4 warps, MT = HEADS / 16 head
// tiles). HEADS = 64 (prefill: few splits, each many tiles) reads each tile into shared memory
// once for all 64 heads, where two 32-head CTAs each read it (and converted its fp8 codes), and
// prefetches: tile i + 1's loads are issued into registers before tile i's MMAs and stored
// after them, so one CTA an SM overlaps its gather with its compute, as two CTAs of 32 heads do
// with each other. Each head's arithmetic is the same in both (same MMA order, the same online
// softmax): equal outputs for equal splits.
template <int CT, int HEADS>
static __global__ void __launch_bounds__(8 * HEADS, HEADS == 32 ? TC_MIN_BLOCKS : 1)
    mla_tc_kernel(float *__restrict__ ws_o, float *__restrict__ ws_ml,
                  const float *__restrict__ q_lat, const float *__restrict__ q_pe,
                  const uint8_t *__restrict__ cache, const int32_t *__restrict__ block_table,
                  int max_blocks, const int32_t *__restrict__ seq,
                  const int32_t *__restrict__ kv_len, const int32_t *__restrict__ indices,
                  int idx_stride, int n_heads, float sm_scale, int n_split, int vec_q)
{
    KERN_ENTRY();
    constexpr int TC_HEADS = HEADS, TC_THREADS = 8 * HEADS, MT = HEADS / 16;
    constexpr bool PREFETCH = HEADS == 64;
    extern __shared__ uint4 smem_tc[];
    uint16_t *qs = (uint16_t *) smem_tc;                 // [TC_HEADS][TC_QS]
    uint16_t *ks = qs + TC_HEADS * TC_QS;                // [TC_TILE][TC_QS]
    float *scl = (float *) (ks + TC_TILE * TC_QS);       // [TC_TILE][TC_CHUNKS]
    float *ss = scl + TC_TILE * TC_CHUNKS;               // [TC_HEADS][TC_SS]
    uint16_t *ps = (uint16_t *) (ss + TC_HEADS * TC_SS); // [TC_CHUNKS][TC_HEADS][TC_PS]
    float *row_m = (float *) (ps + TC_CHUNKS * TC_HEADS * TC_PS);
    float *row_l = row_m + TC_HEADS, *row_a = row_l + TC_HEADS;
    long long *offs = (long long *) (row_a + TC_HEADS);  // [2][TC_TILE], 8-byte aligned: all above are

    const int split = blockIdx.x, hg = blockIdx.y, t = blockIdx.z;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane >> 2, tq = lane & 3;
    const int mt = warp % MT;  // heads 16 mt .. 16 mt + 15 of the CTA's
    const float sm_log2 = mla_log2_scale(sm_scale);  // scores in log2 units (step 3)
    const size_t tb = CT == MLA_CACHE_FP8 ? MLA_FP8_TOKEN_BYTES : BF16_TOKEN_BYTES;

    const int len = kv_len[t];
    const int per = CEIL_DIV(CEIL_DIV(len, n_split), TC_TILE) * TC_TILE;
    const int beg = split * per, end = min(len, beg + per);
    const int s = seq[t];

    // The CTA's 32 heads of q as bf16 (an empty split only writes (-inf, 0)). With
    // 16-byte aligned q (vec_q), 4 values a load and Q_BATCH loads of a thread issued before the
    // first is stored: a few memory latencies for the 74 KB, where one value a load waited
    // once per few values (measured: -11 us a 5-layer step at batch 1, -51 at batch 8).
    if (beg < end && vec_q) {
        enum { Q4 = MLA_LK / 4, N4 = TC_HEADS * Q4, Q_PER = (N4 + TC_THREADS - 1) / TC_THREADS,
               Q_BATCH = 6 };  // 9 made ptxas spill in the main loop (sm_90a, 128 registers)
        const float4 *ql = (const float4 *) q_lat, *qp = (const float4 *) q_pe;
#pragma unroll
        for (int i0 = 0; i0 < Q_PER; i0 += Q_BATCH) {
            float4 v[Q_BATCH];
#pragma unroll
            for (int i = 0; i < Q_BATCH; i++) {
                const int it = tid + (i0 + i) * TC_THREADS, c4 = it % Q4;
                const size_t row = (size_t) t * n_heads + hg * TC_HEADS + it / Q4;
                v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (i0 + i < Q_PER && it < N4)
                    v[i] = c4 < MLA_KV_LORA / 4 ? __ldg(ql + row * (MLA_KV_LORA / 4) + c4)
                                                : __ldg(qp + row * (MLA_ROPE / 4) + c4 - MLA_KV_LORA / 4);
            }
#pragma unroll
            for (int i = 0; i < Q_BATCH; i++) {
                const int it = tid + (i0 + i) * TC_THREADS;
                if (i0 + i >= Q_PER || it >= N4) break;
                const uint32_t lo = (uint32_t) f32_to_bf16_bits(v[i].x) | (uint32_t) f32_to_bf16_bits(v[i].y) << 16;
                const uint32_t hi = (uint32_t) f32_to_bf16_bits(v[i].z) | (uint32_t) f32_to_bf16_bits(v[i].w) << 16;
                *(uint2 *) (qs + (it / Q4) * TC_QS + 4 * (it % Q4)) = make_uint2(lo, hi);
            }
        }
    } else if (beg < end) {
        for (int i = tid; i < TC_HEADS * MLA_LK; i += TC_THREADS) {
            const int h = i / MLA_LK, c = i % MLA_LK, hh = hg * TC_HEADS + h;
            const float v = c < MLA_KV_LORA
                                ? q_lat[((size_t) t * n_heads + hh) * MLA_KV_LORA + c]
                                : q_pe[((size_t) t * n_heads + hh) * MLA_ROPE + c - MLA_KV_LORA];
            qs[h * TC_QS + c] = f32_to_bf16_bits(v);
        }
    }
    if (tid < TC_HEADS) {
        row_m[tid] = -INFINITY;
        row_l[tid] = 0.0f;
    }

    float o[16][4];
#pragma unroll
    for (int j = 0; j < 16; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

    constexpr int ROW16 = CT == MLA_CACHE_FP8 ? MLA_FP8_TOKEN_BYTES / 16 : BF16_TOKEN_BYTES / 16,
                  N16 = TC_TILE * ROW16, PER = (N16 + TC_THREADS - 1) / TC_THREADS;
    // The rows of the first tile; each tile then looks up the next one's while its own rows
    // load (so the two dependent lookups, index and page, are off the critical path).
    long long next_off = tid < TC_TILE && beg < end
                             ? tile_row_offset(beg + tid, end, t, s, indices, idx_stride,
                                               block_table, max_blocks, tb)
                             : -1;
    // PREFETCH: v_next holds the next tile's words (PER a thread, a missing row's as 0) between
    // its loads, issued before this tile's MMAs, and their stores after them. The lookups run
    // further ahead, so that no load waits on another inside an iteration: while tile i
    // computes, tile i + 1's words load, tile i + 2's pages (next_off, from next_pos) and tile
    // i + 3's selected positions (next_pos).
    uint4 v_next[PREFETCH ? PER : 1];
    int next_pos = -1;
    if constexpr (PREFETCH) {
        if (tid < TC_TILE) offs[tid] = next_off;
        __syncthreads();
        tc_load_tile<CT, TC_THREADS>(v_next, offs, cache, tid);
        if (tid < TC_TILE && beg < end) {
            next_off = tile_row_offset(beg + TC_TILE + tid, end, t, s, indices, idx_stride,
                                       block_table, max_blocks, tb);
            next_pos = tile_row_pos(beg + 2 * TC_TILE + tid, end, t, indices, idx_stride);
        }
    }
    for (int base = beg, buf = 0; base < end; base += TC_TILE, buf ^= 1) {
        const long long *toffs = offs + (PREFETCH ? buf * TC_TILE : 0);  // this tile's rows
        if constexpr (PREFETCH) {
            __syncthreads();  // the previous tile is consumed (and q is in place)
#pragma unroll
            for (int i = 0; i < PER; i++) {
                const int it = tid + i * TC_THREADS;
                if (it < N16) tc_store_word<CT>(ks, scl, it, v_next[i]);
            }
            if (tid < TC_TILE) offs[(buf ^ 1) * TC_TILE + tid] = next_off;
            __syncthreads();
            if (base + TC_TILE < end) {  // the next tile's loads, in flight over this tile
                tc_load_tile<CT, TC_THREADS>(v_next, offs + (buf ^ 1) * TC_TILE, cache, tid);
                if (tid < TC_TILE) {  // addresses from registers: nothing waits here
                    next_off = pos_offset(next_pos, s, block_table, max_blocks, tb);
                    next_pos = tile_row_pos(base + 3 * TC_TILE + tid, end, t, indices, idx_stride);
                }
            }
        } else {
            __syncthreads();  // the previous tile is consumed (and q is in place)
            if (tid < TC_TILE) offs[tid] = next_off;
            __syncthreads();
            // 1. The tile's rows, 16 bytes a load, every load of a thread issued before the first
            //    is used (one memory latency a tile, not one per word): fp8 rows are 41 loads
            //    (32 of codes, the 4 scales, 8 of rope), bf16 rows 72; a missing row reads as 0.
            {
                enum { BATCH = 6 };  // loads in flight a thread (fp8: all 6; bf16: 6, then 3)
#pragma unroll
                for (int i0 = 0; i0 < PER; i0 += BATCH) {
                    uint4 v[BATCH];
#pragma unroll
                    for (int i = 0; i < BATCH; i++) {
                        const int it = tid + (i0 + i) * TC_THREADS;
                        v[i] = make_uint4(0u, 0u, 0u, 0u);
                        if (i0 + i < PER && it < N16) {
                            const long long off = offs[it / ROW16];
                            if (off >= 0) v[i] = __ldg((const uint4 *) (cache + off) + it % ROW16);
                        }
                    }
                    if (i0 == 0 && tid < TC_TILE)
                        next_off = tile_row_offset(base + TC_TILE + tid, end, t, s, indices,
                                                   idx_stride, block_table, max_blocks, tb);
#pragma unroll
                    for (int i = 0; i < BATCH; i++) {
                        const int it = tid + (i0 + i) * TC_THREADS;
                        if (i0 + i >= PER || it >= N16) break;
                        tc_store_word<CT>(ks, scl, it, v[i]);
                    }
                }
            }
            __syncthreads();
        }

        // 2. Scores: heads 16 mt + (g, g + 8) x positions 8 nt + (2 tq, 2 tq + 1).
        {
            const int nt = warp / MT;
            // ldmatrix rows: q's (heads 16 mt + 8 (m % 2) + r, dims + 8 (m / 2)) and the keys'
            // (position 8 nt + r, dims + 8 m), m = lane / 8 the matrix, r = lane % 8 its row.
            const int lm = lane >> 3, lr = lane & 7;
            const uint16_t *q_rows = qs + (16 * mt + 8 * (lm & 1) + lr) * TC_QS + 8 * (lm >> 1);
            const uint16_t *k_rows = ks + (8 * nt + lr) * TC_QS + 8 * lm;
            float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int c = 0; c <= TC_CHUNKS; c++) {  // chunk TC_CHUNKS: the rope part, unscaled
                const int k_beg = c * 128, k_end = c < TC_CHUNKS ? k_beg + 128 : MLA_LK;
                float ca[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                // Two k-steps a B load, the fragments by ldmatrix (3 a 32-wide step).
#pragma unroll
                for (int k0 = k_beg; k0 < k_end; k0 += 32) {
                    uint32_t a[4], a2[4], b[4];
                    ldsm_x4<false>(a, q_rows + k0);
                    ldsm_x4<false>(a2, q_rows + k0 + 16);
                    ldsm_x4<false>(b, k_rows + k0);
                    mma_bf16_16816(ca, a[0], a[1], a[2], a[3], b[0], b[1]);
                    mma_bf16_16816(ca, a2[0], a2[1], a2[2], a2[3], b[2], b[3]);
                }
                if (CT == MLA_CACHE_FP8 && c < TC_CHUNKS) {
                    const float s0 = scl[(8 * nt + 2 * tq) * TC_CHUNKS + c];
                    const float s1 = scl[(8 * nt + 2 * tq + 1) * TC_CHUNKS + c];
                    sc[0] = fmaf(ca[0], s0, sc[0]);
                    sc[1] = fmaf(ca[1], s1, sc[1]);
                    sc[2] = fmaf(ca[2], s0, sc[2]);
                    sc[3] = fmaf(ca[3], s1, sc[3]);
                } else {
#pragma unroll
                    for (int j = 0; j < 4; j++) sc[j] += ca[j];
                }
            }
            const int key = 8 * nt + 2 * tq;
            const bool v0 = toffs[key] >= 0, v1 = toffs[key + 1] >= 0;
            float *srow = ss + (16 * mt + g) * TC_SS + key;
            srow[0] = v0 ? sc[0] * sm_log2 : -INFINITY;
            srow[1] = v1 ? sc[1] * sm_log2 : -INFINITY;
            srow[8 * TC_SS] = v0 ? sc[2] * sm_log2 : -INFINITY;
            srow[8 * TC_SS + 1] = v1 ? sc[3] * sm_log2 : -INFINITY;
        }
        __syncthreads();

        // 3. Online softmax: head h = tid / 8, positions 4 (tid % 8) .. +4. Scores are in
        //    log2 units and the running maximum is an integer (the ceiling of the largest
        //    score so far), so p = 2^(score - max) differs from its value under the final
        //    maximum by a power of two: its bf16 rounding does not depend on the tile order
        //    or the split, and the CPU rounds the same p (backend_cpu.c, MlaJob.tc).
        {
            const int h = tid >> 3, part = tid & 7;
            float v[4], mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                v[j] = ss[h * TC_SS + 4 * part + j];
                mx = fmaxf(mx, v[j]);
            }
#pragma unroll
            for (int o2 = 4; o2 > 0; o2 >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
            const float m_old = row_m[h], m_new = fmaxf(m_old, ceilf(mx));
            float p[4], psum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                p[j] = v[j] == -INFINITY ? 0.0f : exp2f(v[j] - m_new);
                psum += p[j];
            }
#pragma unroll
            for (int o2 = 4; o2 > 0; o2 >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o2);
            const float alpha = m_old == -INFINITY ? 0.0f : exp2f(m_old - m_new);
            const int n_p = CT == MLA_CACHE_FP8 ? TC_CHUNKS : 1;
            for (int c = 0; c < n_p; c++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int key = 4 * part + j;
                    const float pj = CT == MLA_CACHE_FP8 ? p[j] * scl[key * TC_CHUNKS + c] : p[j];
                    ps[(c * TC_HEADS + h) * TC_PS + key] = f32_to_bf16_bits(pj);
                }
            __syncwarp();  // every lane of the head read row_m before it changes
            if (part == 0) {
                row_m[h] = m_new;
                row_l[h] = row_l[h] * alpha + psum;
                row_a[h] = alpha;
            }
        }
        __syncthreads();

        // 4. O += P V over the tile: heads 16 mt + (g, g + 8), columns 128 cc + 8 j + 2 tq.
        {
            const int cc = warp / MT;
            const float a_lo = row_a[16 * mt + g], a_hi = row_a[16 * mt + g + 8];
#pragma unroll
            for (int j = 0; j < 16; j++) {
                o[j][0] *= a_lo;
                o[j][1] *= a_lo;
                o[j][2] *= a_hi;
                o[j][3] *= a_hi;
            }
            // The warp's 16 heads of P (chunk cc's matrix on an fp8 cache).
            const uint16_t *pw = ps + ((CT == MLA_CACHE_FP8 ? cc : 0) * TC_HEADS + 16 * mt) * TC_PS;
            // P's rows (heads + 8 (m % 2) + r, positions + 8 (m / 2)) and V's, transposed:
            // positions k0 + 8 (m % 2) + r, columns 128 cc + 8 (j + m / 2).
            const int lm = lane >> 3, lr = lane & 7;
            const uint16_t *p_rows = pw + (8 * (lm & 1) + lr) * TC_PS + 8 * (lm >> 1);
            const uint16_t *v_rows = ks + (8 * (lm & 1) + lr) * TC_QS + 128 * cc + 8 * (lm >> 1);
#pragma unroll
            for (int k0 = 0; k0 < TC_TILE; k0 += 16) {
                uint32_t a[4];
                ldsm_x4<false>(a, p_rows + k0);
#pragma unroll
                for (int j = 0; j < 16; j += 2) {
                    uint32_t b[4];
                    ldsm_x4<true>(b, v_rows + k0 * TC_QS + 8 * j);
                    mma_bf16_16816(o[j], a[0], a[1], a[2], a[3], b[0], b[1]);
                    mma_bf16_16816(o[j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                }
            }
        }
    }

    // Unnormalized output and (max, sum), as mla_decode_kernel writes them.
    const int cc = warp / MT;
    const size_t row0 = ((size_t) t * n_split + split) * n_heads + hg * TC_HEADS + 16 * mt + g;
    if (beg < end) {  // an empty split writes only (-inf, 0) (mla_merge_kernel)
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int col = 128 * cc + 8 * j + 2 * tq;
            *(float2 *) (ws_o + row0 * MLA_KV_LORA + col) = make_float2(o[j][0], o[j][1]);
            *(float2 *) (ws_o + (row0 + 8) * MLA_KV_LORA + col) = make_float2(o[j][2], o[j][3]);
        }
    }
    __syncthreads();  // the last tile's row_m / row_l are written
    if (tid < TC_HEADS) {
        const size_t row = ((size_t) t * n_split + split) * n_heads + hg * TC_HEADS + tid;
        ws_ml[row * 2] = row_m[tid] * MLA_LN2;  // the merge's natural-log units
        ws_ml[row * 2 + 1] = row_l[tid];
    }
}

enum { MERGE_BATCH = 8 };  // the merge's partial-output loads of a thread in flight at once

static __global__ void mla_merge_kernel(uint16_t *__restrict__ out, const float *__restrict__ ws_o,
                                        const float *__restrict__ ws_ml, int n_heads, int n_split)
{
    KERN_ENTRY();
    __shared__ float wgt[MLA_MAX_SPLIT];
    __shared__ float s_l;
    __shared__ int s_live;
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;  // 128 threads x 4 columns
    const size_t row0 = (size_t) t * n_split * n_heads + h;      // split s: row0 + s * n_heads
    if (tid < WARP_SIZE) {
        // Warp 0: lane l holds splits l and l + 32; the maximum, the weights exp(m_s - M) and
        // the denominator are warp reductions instead of a serial loop of dependent loads.
        float m2[2], l2[2];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int s = tid + WARP_SIZE * j;
            m2[j] = s < n_split ? ws_ml[(row0 + (size_t) s * n_heads) * 2] : -INFINITY;
            l2[j] = s < n_split ? ws_ml[(row0 + (size_t) s * n_heads) * 2 + 1] : 0.0f;
        }
        const float m = warp_max(fmaxf(m2[0], m2[1]));
        float l = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int s = tid + WARP_SIZE * j;
            const float wg = m2[j] == -INFINITY ? 0.0f : expf(m2[j] - m);
            if (s < n_split) wgt[s] = wg;
            l = fmaf(wg, l2[j], l);
        }
        l = warp_sum(l);
        // The splits that hold positions: the ranges are equal and contiguous, so the empty
        // ones (exactly (-inf, 0), output not written) are a suffix, and every split before
        // the last non-empty one wrote its output. A split whose scores were all NaN reads
        // (-inf, NaN): it counts, so the NaN reaches the output as before.
        const unsigned hi = __ballot_sync(0xffffffffu, m2[1] != -INFINITY || l2[1] != 0.0f),
                       lo = __ballot_sync(0xffffffffu, m2[0] != -INFINITY || l2[0] != 0.0f);
        if (tid == 0) {
            s_l = l;
            s_live = hi ? WARP_SIZE + 32 - __clz(hi) : 32 - __clz(lo);
        }
    }
    __syncthreads();
    // The partial outputs of the non-empty splits are independent loads: unrolled, several are
    // in flight. Empty splits (n_split is sized for a graph's capacity, not the context: at 1K
    // context about half of them) write no output and are not read.
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const int n_live = s_live;
    for (int s0 = 0; s0 < n_live; s0 += MERGE_BATCH) {
        float4 v[MERGE_BATCH];
#pragma unroll
        for (int i = 0; i < MERGE_BATCH; i++)
            v[i] = s0 + i < n_live ? __ldg((const float4 *) (ws_o + (row0 + (size_t) (s0 + i) * n_heads) * MLA_KV_LORA) + tid)
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int i = 0; i < MERGE_BATCH; i++) {
            if (s0 + i >= n_live) break;
            const float wg = wgt[s0 + i];
            acc.x = fmaf(wg, v[i].x, acc.x);
            acc.y = fmaf(wg, v[i].y, acc.y);
            acc.z = fmaf(wg, v[i].z, acc.z);
            acc.w = fmaf(wg, v[i].w, acc.w);
        }
    }
    const float l = s_l;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    uint16_t *o = out + ((size_t) t * n_heads + h) * MLA_KV_LORA + tid * 4;
    o[0] = f32_to_bf16_bits(acc.x * inv);
    o[1] = f32_to_bf16_bits(acc.y * inv);
    o[2] = f32_to_bf16_bits(acc.z * inv);
    o[3] = f32_to_bf16_bits(acc.w * inv);
}

// ---------------------------------------------------------------------------
// Launchers

size_t mla_cache_token_bytes(MlaCacheType type)
{
    return type == MLA_CACHE_FP8 ? MLA_FP8_TOKEN_BYTES : BF16_TOKEN_BYTES;
}

void mla_q_split(uint16_t *q_nope, float *q_pe, const float *q, const int32_t *pos, float theta,
                 int n_tok, int n_heads, int qk_nope, int qk_rope, int heads_pad,
                 cudaStream_t stream)
{
    ASSERT(n_tok > 0 && n_heads > 0 && n_heads <= heads_pad && qk_nope >= 0
           && qk_nope <= MLA_QK_NOPE && qk_rope >= 0 && qk_rope <= MLA_ROPE);
    RopeFreqs f;
    memset(&f, 0, sizeof f);
    if (pos) {
        ASSERT(qk_rope % 2 == 0 && qk_rope > 0 && theta > 0.0f);
        rope_freqs(&f, qk_rope, theta);
    }
    // A decode step's few tokens: a block per head (one load each, in parallel over 64 blocks,
    // where 8 heads a block read one after another); a prefill chunk's many: SPLIT_HEADS a
    // block, so that RoPE's angles are computed once per 8 heads.
    const int per = n_tok <= SPLIT_FEW_TOKENS ? 1 : SPLIT_HEADS;
    kern_launch(mla_q_split_kernel, dim3(CEIL_DIV(heads_pad, per), n_tok), MLA_QK_NOPE + MLA_ROPE,
                0, stream, q_nope, q_pe, q, pos, f, n_heads, qk_nope, qk_rope, heads_pad, per);
}

void mla_decode(uint16_t *out, const float *q_lat, const float *q_pe, const MlaCache *cache,
                const int32_t *block_table, int max_blocks, const int32_t *seq,
                const int32_t *kv_len, const int32_t *indices, int idx_stride, int n_tok,
                int n_heads, float sm_scale, int n_split, float *ws_o, float *ws_ml,
                cudaStream_t stream)
{
    ASSERT(cache && cache->data && n_tok > 0 && n_heads > 0 && n_heads % HB == 0);
    ASSERT(n_split >= 1 && n_split <= MLA_MAX_SPLIT && max_blocks > 0);
    ASSERT(indices == NULL || idx_stride > 0);
    ASSERT((uintptr_t) ws_o % 16 == 0);
    const size_t smem = (size_t) (HB * MLA_LK + TILE * KS_STRIDE) * sizeof(float);
    const dim3 grid(n_split, n_heads / HB, n_tok);
    const int vec_q = ((uintptr_t) q_lat | (uintptr_t) q_pe) % 16 == 0;
    if (cache->type == MLA_CACHE_FP8) {
        CUDA_CHECK(cudaFuncSetAttribute(mla_decode_kernel<MLA_CACHE_FP8>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
        kern_launch(mla_decode_kernel<MLA_CACHE_FP8>, grid, DEC_THREADS, smem, stream, ws_o, ws_ml,
                    q_lat, q_pe, cache->data, block_table, max_blocks, seq, kv_len, indices,
                    idx_stride, n_heads, sm_scale, n_split, vec_q);
    } else {
        CUDA_CHECK(cudaFuncSetAttribute(mla_decode_kernel<MLA_CACHE_BF16>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
        kern_launch(mla_decode_kernel<MLA_CACHE_BF16>, grid, DEC_THREADS, smem, stream, ws_o, ws_ml,
                    q_lat, q_pe, cache->data, block_table, max_blocks, seq, kv_len, indices,
                    idx_stride, n_heads, sm_scale, n_split, vec_q);
    }
    kern_launch(mla_merge_kernel, dim3(n_heads, n_tok), MLA_KV_LORA / 4, 0, stream, out, ws_o,
                ws_ml, n_heads, n_split);
}

// The CTA width mla_decode_tc takes: 64 heads when each CTA walks a long range (at most 4
// splits: prefill chunks) and the grid still covers every SM, where the device has the shared
// memory; else 32 (decode steps: many splits of few tiles, two CTAs an SM).
bool mla_tc_heads_fit(int heads)
{
    return (heads == 32 || heads == 64) && tc_smem_bytes(heads) <= (size_t) kern_smem_optin();
}

int mla_tc_heads(int n_tok, int n_heads, int n_split)
{
    if (n_heads % 64 != 0 || n_split > 4) return 32;
    if ((long long) n_tok * n_split * (n_heads / 64) < kern_sm_count()) return 32;
    return mla_tc_heads_fit(64) ? 64 : 32;
}

void mla_decode_tc(uint16_t *out, const float *q_lat, const float *q_pe, const MlaCache *cache,
                   const int32_t *block_table, int max_blocks, const int32_t *seq,
                   const int32_t *kv_len, const int32_t *indices, int idx_stride, int n_tok,
                   int n_heads, float sm_scale, int n_split, float *ws_o, float *ws_ml,
                   cudaStream_t stream)
{
    mla_decode_tc_heads(out, q_lat, q_pe, cache, block_table, max_blocks, seq, kv_len, indices,
                        idx_stride, n_tok, n_heads, sm_scale, n_split, ws_o, ws_ml,
                        mla_tc_heads(n_tok, n_heads, n_split), stream);
}

template <int CT, int HEADS>
static void tc_launch(const dim3 &grid, size_t smem, cudaStream_t stream, float *ws_o,
                      float *ws_ml, const float *q_lat, const float *q_pe, const uint8_t *cache,
                      const int32_t *block_table, int max_blocks, const int32_t *seq,
                      const int32_t *kv_len, const int32_t *indices, int idx_stride,
                      int n_heads, float sm_scale, int n_split, int vec_q)
{
    // Two 32-head CTAs an SM where the unified memory allows (H200: 2 x 90 KB of 227 KB).
    CUDA_CHECK(cudaFuncSetAttribute(mla_tc_kernel<CT, HEADS>,
                                    cudaFuncAttributePreferredSharedMemoryCarveout,
                                    (int) cudaSharedmemCarveoutMaxShared));
    CUDA_CHECK(cudaFuncSetAttribute(mla_tc_kernel<CT, HEADS>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
    kern_launch(mla_tc_kernel<CT, HEADS>, grid, 8 * HEADS, smem, stream, ws_o, ws_ml, q_lat, q_pe,
                cache, block_table, max_blocks, seq, kv_len, indices, idx_stride, n_heads,
                sm_scale, n_split, vec_q);
}

void mla_decode_tc_heads(uint16_t *out, const float *q_lat, const float *q_pe,
                         const MlaCache *cache, const int32_t *block_table, int max_blocks,
                         const int32_t *seq, const int32_t *kv_len, const int32_t *indices,
                         int idx_stride, int n_tok, int n_heads, float sm_scale, int n_split,
                         float *ws_o, float *ws_ml, int heads, cudaStream_t stream)
{
    ASSERT(mla_tc_heads_fit(heads));
    ASSERT(cache && cache->data && n_tok > 0 && n_heads > 0 && n_heads % heads == 0);
    ASSERT(n_split >= 1 && n_split <= MLA_MAX_SPLIT && max_blocks > 0);
    ASSERT(indices == NULL || idx_stride > 0);
    ASSERT((uintptr_t) ws_o % 16 == 0);
    ASSERT((uintptr_t) cache->data % 16 == 0);  // rows are read 16 bytes at a time
    const size_t smem = tc_smem_bytes(heads);
    const dim3 grid(n_split, n_heads / heads, n_tok);
    const int vec_q = ((uintptr_t) q_lat | (uintptr_t) q_pe) % 16 == 0;
    const bool fp8 = cache->type == MLA_CACHE_FP8;
    auto launch = fp8 ? (heads == 64 ? tc_launch<MLA_CACHE_FP8, 64> : tc_launch<MLA_CACHE_FP8, 32>)
                      : (heads == 64 ? tc_launch<MLA_CACHE_BF16, 64> : tc_launch<MLA_CACHE_BF16, 32>);
    launch(grid, smem, stream, ws_o, ws_ml, q_lat, q_pe, cache->data, block_table, max_blocks, seq,
           kv_len, indices, idx_stride, n_heads, sm_scale, n_split, vec_q);
    kern_launch(mla_merge_kernel, dim3(n_heads, n_tok), MLA_KV_LORA / 4, 0, stream, out, ws_o,
                ws_ml, n_heads, n_split);
}
