/*
 * dsa.cu - DSA indexer: scores, top-k (the keys are written by kernels/kv.h's kv_write).
 *
 * Scores: grid (n_tok, tiles of 128 positions); a CTA of 128 threads covers one tile, thread r
 * position r: it streams its key 16 values at a time (16 bytes of fp8, 32 of bf16, 64 of
 * fp32, wherever the DsaCache's pages put it) and dots it with all (up to 32) query heads
 * held in shared memory (broadcast reads), one fp32 accumulator per head; the key scale,
 * ReLU and the head weights finish the score (kernels/dsa_format.h's order).
 *
 * Top-k: a cluster of 1-8 CTAs of 1024 threads per token, each over a contiguous segment of
 * the row (more CTAs when few tokens leave SMs idle: at decode a 128K row takes a CTA ~300 us
 * alone, bound by one SM's loads in flight; clusters on sm_90 / sm_100 only, one CTA per token
 * elsewhere). A 4-pass MSB-first radix select over the scores'
 * order-preserving 32-bit keys finds the k-th largest key T and how many positions equal to T
 * to keep: each CTA counts its segment's digits (histogram atomics aggregated per warp with
 * __match_any_sync), one cluster barrier per pass, then every CTA sums the cluster's counts
 * through distributed shared memory and finds the digit itself with one warp scan. The last
 * pass's bin of T counts the positions that tie at T, and a final ordered pass writes the
 * positions with key > T and the last such ties (the tie rule: among equal scores the later
 * position wins, as in the engine's CPU reference), in ascending order: each CTA starts after
 * the selections of the earlier segments (their counts of keys > T and == T, exchanged the
 * same way), with one block scan per 1024 positions (both counts packed in one word), and
 * stops once k are written. Scores are read 5 times from L2 (512 KB at 128K).
 */
#include "kernels/dsa.h"

#include <cooperative_groups.h>
#include <stdint.h>

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/launch.cuh"

enum { TOPK_THREADS = 1024, TOPK_UNROLL = 8 };

// ---------------------------------------------------------------------------
// Score kernels

// 16 key values of row chunk j as fp32 (raw: the fp8 scale is applied per head later). W
// uint4 words hold them: 1 for fp8, 2 for bf16, 4 for fp32.
template <int FMT>
struct KeyChunk {
    static constexpr int W = FMT == DSA_KEY_FP8 ? 1 : FMT == DSA_KEY_BF16 ? 2 : 4;
    uint4 w[W];
    __device__ __forceinline__ void load(const uint8_t *key, int j)
    {
#pragma unroll
        for (int i = 0; i < W; i++) w[i] = __ldg((const uint4 *) key + j * W + i);
    }
    __device__ __forceinline__ void zero()
    {
#pragma unroll
        for (int i = 0; i < W; i++) w[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ void decode(float kf[16]) const
    {
#pragma unroll
        for (int i = 0; i < W; i++) {
            const uint32_t kw[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (FMT == DSA_KEY_FP8) {  // nvfp4_format.h's decoder, as the CPU's (0x7f: 480, not NaN)
#pragma unroll
                    for (int b = 0; b < 4; b++) kf[4 * e + b] = nvfp4_e4m3_to_float((uint8_t) (kw[e] >> (8 * b)));
                } else if (FMT == DSA_KEY_BF16) {
                    const float2 f = bf16x2_bits_to_f32(kw[e]);
                    kf[8 * i + 2 * e] = f.x;
                    kf[8 * i + 2 * e + 1] = f.y;
                } else {
                    kf[4 * i + e] = __uint_as_float(kw[e]);
                }
            }
        }
    }
};

// Grid (n_tok, tiles of DSA_BLOCK positions): tokens on x, so a prefill call may hold any
// number of them (y caps the tiles at 65,535: 8.4M positions); thread r of a tile owns
// position p = tile * 128 + r, wherever its page puts it (c.block need not be DSA_BLOCK).
template <int FMT>
static __global__ void __launch_bounds__(DSA_BLOCK)
    dsa_scores_kernel(float *__restrict__ scores, int score_stride, const float *__restrict__ q,
                      const float *__restrict__ w, float w_scale, float sm_scale, DsaCache c,
                      const int32_t *__restrict__ block_table, int max_blocks,
                      const int32_t *__restrict__ seq, const int32_t *__restrict__ kv_len,
                      int n_heads)
{
    KERN_ENTRY();
    __shared__ float4 qs[DSA_MAX_HEADS * DSA_MAX_DIM / 4];  // [head][dim / 4]; heads past n_heads zero
    __shared__ float ws[DSA_MAX_HEADS];
    const int tile = blockIdx.y, t = blockIdx.x, r = threadIdx.x;
    const int len = kv_len[t];
    const int p0 = tile * DSA_BLOCK, p = p0 + r;
    if (p0 >= len) return;  // the whole CTA

    const int dq = c.dim / 4, n_chunks = c.dim / 16;
    const float4 *qt = (const float4 *) (q + (size_t) t * n_heads * c.dim);
    for (int i = r; i < DSA_MAX_HEADS * dq; i += DSA_BLOCK)
        qs[i] = i / dq < n_heads ? qt[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r < DSA_MAX_HEADS) ws[r] = r < n_heads ? w[(size_t) t * n_heads + r] * w_scale : 0.0f;
    const uint8_t *key = NULL;
    float ks = 0.0f;
    KeyChunk<FMT> kcur;
    kcur.zero();
    if (p < len) {
        const int blk = block_table[(size_t) seq[t] * max_blocks + p / c.block];
        const uint8_t *page = c.pages + (size_t) blk * c.page_bytes;
        key = page + (size_t) (p % c.block) * c.key_bytes;
        ks = FMT == DSA_KEY_FP8 ? __ldg((const float *) (page + c.scales) + p % c.block) : 1.0f;
        kcur.load(key, 0);
    }
    __syncthreads();
    if (p >= len) return;

    // Thread r owns position p: 16 key values at a time against every head's matching 16 query
    // values (shared-memory broadcasts), one fp32 dot product per head; the key scale, ReLU
    // and head weights finish it (dsa_format.h's order). No shuffles (the first version, which
    // transposed 32 heads across a warp per position with 31 shuffles, took 272 us per indexer
    // layer at 128K context; this one 58 us, H200, 2026-11-30).
    float acc[DSA_MAX_HEADS];
#pragma unroll
    for (int h = 0; h < DSA_MAX_HEADS; h++) acc[h] = 0.0f;
#pragma unroll 1
    for (int j = 0; j < n_chunks; j++) {
        KeyChunk<FMT> knext;
        if (j + 1 < n_chunks)
            knext.load(key, j + 1);
        else
            knext.zero();
        float kf[16];
        kcur.decode(kf);
#pragma unroll
        for (int h = 0; h < DSA_MAX_HEADS; h++) {
            const float4 *qh = qs + h * dq + j * 4;
            float a = acc[h];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float4 v = qh[i];
                a = fmaf(v.x, kf[4 * i], a);
                a = fmaf(v.y, kf[4 * i + 1], a);
                a = fmaf(v.z, kf[4 * i + 2], a);
                a = fmaf(v.w, kf[4 * i + 3], a);
            }
            acc[h] = a;
        }
        kcur = knext;
    }
    float sc = 0.0f;
#pragma unroll
    for (int h = 0; h < DSA_MAX_HEADS; h++) sc = fmaf(ws[h], fmaxf(acc[h] * ks * sm_scale, 0.0f), sc);
    scores[(size_t) t * score_stride + p] = sc;
}

// ---------------------------------------------------------------------------
// Scores on the tensor cores (dsa_scores_tc)

enum { TC_TOKENS = 4, TC_POS = 64, TC_KS = DSA_MAX_DIM + 8 };  // TC_KS: padded key row, bf16
enum { TC_GROUPS = 4 };  // 8-position groups a warp's MMAs take at a time
static_assert(TC_GROUPS == 1 || TC_GROUPS == 2 || TC_GROUPS == 4, "the reduction's rounds");

// Grid (tokens in 4s, runs of `tiles` tiles of 64 positions); warp w of a CTA owns token 4 x + w:
// its 32 heads (two m16 tiles, heads past n_heads zero) as the MMA's A, q rounded to bf16 and
// held in registers over the whole dim and every tile of the run; each tile's keys, as bf16 in
// shared memory (fp8 codes exact), are the B operand, so a tile is read once for the CTA's
// tokens of one sequence. A CTA that took one tile loaded 16 KB of q a token for 8 KB of fp8
// keys: a prefill chunk's q was read ~tiles times over from L2 (68 GB for 4,096 tokens at 64K). Tokens of
// other sequences in the CTA (a decode batch, or a prefill chunk's edge) take further rounds,
// one per sequence, each staging that sequence's keys. Per 8-position tile the warp's
// accumulators are finished in registers: each lane applies scale, ReLU and head weight to its
// 4 heads, and three shuffles sum the 8 lanes that share the positions.
template <int FMT>
static __global__ void __launch_bounds__(TC_TOKENS * WARP_SIZE)
    dsa_scores_tc_kernel(float *__restrict__ scores, int score_stride, const float *__restrict__ q,
                         const float *__restrict__ w, float w_scale, float sm_scale, DsaCache c,
                         const int32_t *__restrict__ block_table, int max_blocks,
                         const int32_t *__restrict__ seq, const int32_t *__restrict__ kv_len,
                         int n_tok, int n_heads, int tiles)
{
    KERN_ENTRY();
    __shared__ __align__(16) uint16_t ks[TC_POS * TC_KS];  // [position][dim] bf16
    __shared__ float kscale[TC_POS];
    __shared__ const uint8_t *row_key[TC_POS];  // a staged row's key in the cache, or NULL
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, cq = lane % 4, n_k = c.dim / 16;
    const int tile0 = blockIdx.y * tiles;
    int tl[TC_TOKENS], ts[TC_TOKENS];
    unsigned todo = 0;
#pragma unroll
    for (int r = 0; r < TC_TOKENS; r++) {
        const int t = blockIdx.x * TC_TOKENS + r;
        tl[r] = t < n_tok ? kv_len[t] : 0;
        ts[r] = t < n_tok ? seq[t] : -1;
        if (tl[r] > tile0 * TC_POS) todo |= 1u << r;
    }
    if (!todo) return;  // the whole CTA
    const int t = blockIdx.x * TC_TOKENS + warp;
    const bool mine = (todo >> warp) & 1u;  // a token that sees no position of the first tile
                                            // sees none of the later ones

    // A fragments: heads mt * 16 + g (+ 8) of this warp's token, dims ks * 16 + 2 cq (+ 8).
    uint32_t a[2][DSA_MAX_DIM / 16][4];
    float ws[4];  // head weights of heads g, g + 8, 16 + g, 24 + g (0 past n_heads)
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int h = mt * 16 + hh * 8 + g;
            const bool on = mine && h < n_heads;
            ws[2 * mt + hh] = on ? w[(size_t) t * n_heads + h] * w_scale : 0.0f;
            const float *qh = q + ((size_t) t * n_heads + h) * c.dim;
#pragma unroll
            for (int k = 0; k < DSA_MAX_DIM / 16; k++) {
                float2 lo = make_float2(0.0f, 0.0f), hi = lo;
                if (on && k < n_k) {
                    lo = *(const float2 *) (qh + k * 16 + 2 * cq);
                    hi = *(const float2 *) (qh + k * 16 + 2 * cq + 8);
                }
                a[mt][k][hh] = (uint32_t) f32_to_bf16_bits(lo.x) | (uint32_t) f32_to_bf16_bits(lo.y) << 16;
                a[mt][k][hh + 2] = (uint32_t) f32_to_bf16_bits(hi.x) | (uint32_t) f32_to_bf16_bits(hi.y) << 16;
            }
        }
    }

    if (FMT != DSA_KEY_FP8)  // bf16 keys have no scale (the rounds' barriers order this)
        for (int row = threadIdx.x; row < TC_POS; row += TC_TOKENS * WARP_SIZE) kscale[row] = 1.0f;
    for (int tile = tile0; tile < tile0 + tiles; tile++) {
        const int p0 = tile * TC_POS;
        todo = 0;
#pragma unroll
        for (int r = 0; r < TC_TOKENS; r++)
            if (tl[r] > p0) todo |= 1u << r;
        if (!todo) break;  // uniform: the lengths are the CTA's
        while (todo) {
            // This round: the tokens (not yet done) of the first remaining token's sequence.
            int sq = 0;
            bool found = false;
#pragma unroll
            for (int r = 0; r < TC_TOKENS; r++)  // selects, not a dynamic index (registers, not stack)
                if (!found && ((todo >> r) & 1u)) {
                    sq = ts[r];
                    found = true;
                }
            unsigned round = 0;
            int cover = 0;  // positions the round's tokens see in this tile
#pragma unroll
            for (int r = 0; r < TC_TOKENS; r++)
                if (((todo >> r) & 1u) && ts[r] == sq) {
                    round |= 1u << r;
                    cover = max(cover, min(tl[r] - p0, (int) TC_POS));
                }
            todo &= ~round;
            __syncthreads();  // the previous round's warps are done with the tile
            // Stage the keys: 16-byte words, 8 bf16 (or 16 fp8 codes, written as two) each. Each
            // row's page is looked up once (a thread a row), then a thread's word loads are issued
            // KEY_BATCH at a time before any is stored: two memory latencies a tile of fp8 keys,
            // where a lookup and a load one after another per word were several.
            constexpr int VB = FMT == DSA_KEY_FP8 ? 16 : 8;  // values per 16-byte global word
            constexpr int THREADS = TC_TOKENS * WARP_SIZE;
            constexpr int PER = (TC_POS * (DSA_MAX_DIM / VB) + THREADS - 1) / THREADS;
            constexpr int KEY_BATCH = 4;  // loads in flight a thread: fp8 keys all 4, bf16 4 then 4
            const int words = c.dim / VB;
            for (int row = threadIdx.x; row < TC_POS; row += THREADS) {
                const uint8_t *page = NULL;
                if (row < cover) {
                    const int p = p0 + row;
                    page = c.pages + (size_t) block_table[(size_t) sq * max_blocks + p / c.block] * c.page_bytes;
                    row_key[row] = page + (size_t) (p % c.block) * c.key_bytes;
                } else {
                    row_key[row] = NULL;
                }
                if (FMT == DSA_KEY_FP8)
                    kscale[row] = page ? __ldg((const float *) (page + c.scales) + (p0 + row) % c.block) : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int u0 = 0; u0 < PER; u0 += KEY_BATCH) {
                uint4 v[KEY_BATCH];
#pragma unroll
                for (int u = 0; u < KEY_BATCH; u++) {
                    const int i = threadIdx.x + (u0 + u) * THREADS;
                    v[u] = make_uint4(0u, 0u, 0u, 0u);
                    if (u0 + u < PER && i < TC_POS * words && row_key[i / words])
                        v[u] = __ldg((const uint4 *) row_key[i / words] + i % words);
                }
#pragma unroll
                for (int u = 0; u < KEY_BATCH; u++) {
                    const int i = threadIdx.x + (u0 + u) * THREADS;
                    if (u0 + u >= PER || i >= TC_POS * words) break;
                    uint16_t *dst = ks + (i / words) * TC_KS + (i % words) * VB;
                    if (FMT == DSA_KEY_FP8) {
                        const uint2 b0 = e4m3x4_to_bf16x4(v[u].x), b1 = e4m3x4_to_bf16x4(v[u].y);
                        const uint2 b2 = e4m3x4_to_bf16x4(v[u].z), b3 = e4m3x4_to_bf16x4(v[u].w);
                        *(uint4 *) dst = make_uint4(b0.x, b0.y, b1.x, b1.y);
                        *(uint4 *) (dst + 8) = make_uint4(b2.x, b2.y, b3.x, b3.y);
                    } else {
                        *(uint4 *) dst = v[u];
                    }
                }
            }
            __syncthreads();
            if (!((round >> warp) & 1u)) continue;
            int len = 0;
#pragma unroll
            for (int r = 0; r < TC_TOKENS; r++)
                if (r == warp) len = tl[r];
            float *out = scores + (size_t) t * score_stride;
            // TC_GROUPS 8-position groups at a time: 2 x TC_GROUPS independent MMA chains (one
            // chain's MMA latency no longer paces the warp), and their 2 x TC_GROUPS sums over
            // the 8 lanes that share positions reduced by halving: each round a lane keeps half
            // of its values and adds its partner's other half, 2 x TC_GROUPS - 1 shuffles where
            // summing each value apart took 3 x 2 x TC_GROUPS. Lane (g, cq) then holds value
            // j = g >> GS (GS = 3 - log2(2 TC_GROUPS)): position 8 (j / 2) + 2 cq + j % 2 of the
            // groups, stored by the lanes whose g has its low GS bits 0. A token's last group of
            // positions runs all TC_GROUPS groups' MMAs (zero keys or another token's), its
            // stores bounded by its length.
            constexpr int NV = 2 * TC_GROUPS, GS = NV == 8 ? 0 : NV == 4 ? 1 : 2;
#pragma unroll 1
            for (int nt = 0; nt < TC_POS / 8 && p0 + nt * 8 < len; nt += TC_GROUPS) {
                float acc[TC_GROUPS][2][4];
#pragma unroll
                for (int u = 0; u < TC_GROUPS; u++)
#pragma unroll
                    for (int mt = 0; mt < 2; mt++)
#pragma unroll
                        for (int i = 0; i < 4; i++) acc[u][mt][i] = 0.0f;
#pragma unroll
                for (int k = 0; k < DSA_MAX_DIM / 16; k++) {
                    if (k < n_k) {
#pragma unroll
                        for (int u = 0; u < TC_GROUPS; u++) {
                            const uint16_t *kr = ks + ((nt + u) * 8 + g) * TC_KS + 2 * cq + k * 16;  // B: key (nt + u) 8 + g
                            const uint32_t b0 = *(const uint32_t *) kr;
                            const uint32_t b1 = *(const uint32_t *) (kr + 8);
                            mma_bf16_16816(acc[u][0], a[0][k][0], a[0][k][1], a[0][k][2], a[0][k][3], b0, b1);
                            mma_bf16_16816(acc[u][1], a[1][k][0], a[1][k][1], a[1][k][2], a[1][k][3], b0, b1);
                        }
                    }
                }
                // acc[u][mt][0 / 1]: head mt * 16 + g at positions 2 cq, 2 cq + 1 of group u;
                // [2 / 3]: head mt * 16 + 8 + g. v[2 u + j]: position 2 cq + j of group u, this
                // lane's 4 heads.
                float v[NV];
#pragma unroll
                for (int u = 0; u < TC_GROUPS; u++) {
                    const int pl = (nt + u) * 8 + 2 * cq;
                    const float k0 = kscale[pl], k1 = kscale[pl + 1];
                    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
#pragma unroll
                        for (int hh = 0; hh < 2; hh++) {  // dsa_key_score's (acc * scale) * sm_scale
                            s0 = fmaf(ws[2 * mt + hh], fmaxf(acc[u][mt][2 * hh] * k0 * sm_scale, 0.0f), s0);
                            s1 = fmaf(ws[2 * mt + hh], fmaxf(acc[u][mt][2 * hh + 1] * k1 * sm_scale, 0.0f), s1);
                        }
                    }
                    v[2 * u] = s0;
                    v[2 * u + 1] = s1;
                }
#pragma unroll
                for (int o = 16, n = NV; o >= 4; o >>= 1) {
                    if (n == 1) {
                        v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
                        continue;
                    }
                    const bool hi = lane & o;  // keeps the upper half
#pragma unroll
                    for (int i = 0; i < n / 2; i++) {
                        const float send = hi ? v[i] : v[i + n / 2];
                        const float keep = hi ? v[i + n / 2] : v[i];
                        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                    }
                    n /= 2;
                }
                if ((g & ((1 << GS) - 1)) == 0) {
                    const int j = g >> GS;  // v's index before the rounds
                    const int p = p0 + (nt + j / 2) * 8 + 2 * cq + j % 2;
                    if (p < len) out[p] = v[0];
                }
            }
        }
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

// Exclusive prefix sum of v over the block, in thread order (warp shuffle scan, then the
// warp totals); returns the block total. Starts with a barrier, so warp_tot may be reused.
static __device__ uint32_t block_scan(uint32_t v, uint32_t *excl, uint32_t *warp_tot)
{
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    uint32_t inc = v;
#pragma unroll
    for (int o = 1; o < WARP_SIZE; o <<= 1) {
        const uint32_t n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == WARP_SIZE - 1) warp_tot[warp] = inc;
    __syncthreads();
    uint32_t before = 0, total = 0;
#pragma unroll 8
    for (int i = 0; i < TOPK_THREADS / WARP_SIZE; i++) {
        const uint32_t wt = warp_tot[i];
        before += i < warp ? wt : 0u;
        total += wt;
    }
    *excl = before + inc - v;
    return total;
}

// A cluster's barrier and a peer CTA's shared memory, or (CLUSTER false: one CTA per token,
// launched without clusters, for devices without distributed shared memory) the CTA's own.
template <bool CLUSTER>
static __device__ __forceinline__ void topk_sync()
{
    if constexpr (CLUSTER)
        cooperative_groups::this_cluster().sync();
    else
        __syncthreads();
}

template <bool CLUSTER, typename T>
static __device__ __forceinline__ T *topk_peer(T *p, int rank)
{
    if constexpr (CLUSTER)
        return cooperative_groups::this_cluster().map_shared_rank(p, rank);
    else
        return p;
}

template <bool CLUSTER>
static __global__ void __launch_bounds__(TOPK_THREADS)
    dsa_topk_kernel(int32_t *__restrict__ idx, int32_t *__restrict__ n_sel,
                    const float *__restrict__ scores, int score_stride,
                    const int32_t *__restrict__ kv_len, int k)
{
    KERN_ENTRY();
    __shared__ int hist[2][256];  // this CTA's counts, alternating between passes (see below)
    __shared__ int total[256];    // the whole row's: every CTA of the cluster sums them itself
    __shared__ uint32_t warp_tot[TOPK_THREADS / WARP_SIZE];
    __shared__ uint32_t s_prefix;
    __shared__ int s_remaining;
    __shared__ int s_count[2];  // this segment's keys > T and == T, read by the later ranks
    int n_cta = 1, rank = 0;
    if constexpr (CLUSTER) {
        n_cta = (int) cooperative_groups::this_cluster().num_blocks();
        rank = (int) cooperative_groups::this_cluster().block_rank();
    }
    const int t = blockIdx.x / n_cta, tid = threadIdx.x, lane = tid % WARP_SIZE,
              warp = tid / WARP_SIZE;
    const int len = kv_len[t];
    const float *sc = scores + (size_t) t * score_stride;
    int32_t *out = idx + (size_t) t * k;
    // This CTA's segment of the row; rank order is position order.
    const int seg = CEIL_DIV(len, n_cta);
    const int lo = min(rank * seg, len), hi = min(lo + seg, len);

    if (len <= k) {  // uniform over the cluster: no CTA reaches a cluster barrier
        for (int i = lo + tid; i < hi; i += TOPK_THREADS) out[i] = i;
        if (rank == 0 && tid == 0) n_sel[t] = len;
        return;
    }

    uint32_t prefix = 0, mask = 0;
    int remaining = k;  // how many of the elements matching prefix we still need
    int above = 0;      // the last pass: this thread's keys whose top 24 bits exceed T's
    for (int pass = 0, shift = 24; shift >= 0; pass++, shift -= 8) {
        // Pass p fills hist[p & 1]. A CTA clears it again in pass p + 2 only after the cluster
        // barrier of pass p + 1, which every CTA reaches after reading pass p's counts: one
        // cluster barrier per pass.
        int *h = hist[pass & 1];
        for (int i = tid; i < 256; i += TOPK_THREADS) h[i] = 0;
        __syncthreads();
        // Lanes with the same digit are combined first (__match_any_sync): scores of one row
        // share few top digits, and unaggregated shared-memory atomics on one address
        // serialize the whole warp.
        for (int base = lo; base < hi; base += TOPK_THREADS * TOPK_UNROLL) {
            float v[TOPK_UNROLL];  // all loads of the batch in flight before the first use
#pragma unroll
            for (int u = 0; u < TOPK_UNROLL; u++) {
                const int i = base + u * TOPK_THREADS + tid;
                v[u] = i < hi ? sc[i] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < TOPK_UNROLL; u++) {
                const int i = base + u * TOPK_THREADS + tid;
                int bin = -1;
                if (i < hi) {
                    const uint32_t key = order_key(v[u]);
                    if ((key & mask) == prefix)
                        bin = (int) ((key >> shift) & 255);
                    else if (shift == 0 && (key & mask) > prefix)
                        above++;
                }
                // After the first pass few keys still match the prefix: a warp with none of
                // them skips the match (the histogram is the same).
                if (__any_sync(0xffffffffu, bin >= 0)) {
                    const unsigned peers = __match_any_sync(0xffffffffu, bin);
                    if (bin >= 0 && __ffs(peers) - 1 == lane) atomicAdd(&h[bin], __popc(peers));
                }
            }
        }
        topk_sync<CLUSTER>();  // every CTA's counts of this pass are complete
        for (int i = tid; i < 256; i += TOPK_THREADS) {
            int sum = 0;
            for (int r = 0; r < n_cta; r++) sum += topk_peer<CLUSTER>(h, r)[i];
            total[i] = sum;
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l owns digits 255-8l .. 248-8l; a scan over the lanes finds the one holding
            // the remaining-th largest key, which then walks its 8 digits.
            int loc[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                loc[j] = total[255 - 8 * lane - j];
                sum += loc[j];
            }
            int incl = sum;
#pragma unroll
            for (int o = 1; o < WARP_SIZE; o <<= 1) {
                const int n = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += n;
            }
            const unsigned hit = __ballot_sync(0xffffffffu, incl >= remaining);
            const int owner = hit ? __ffs(hit) - 1 : WARP_SIZE - 1;
            if (lane == owner) {
                int acc = incl - sum, digit = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    digit = 255 - 8 * lane - j;
                    if (acc + loc[j] >= remaining || digit == 0) break;
                    acc += loc[j];
                }
                s_prefix = prefix | ((uint32_t) digit << shift);
                s_remaining = remaining - acc;
            }
        }
        __syncthreads();
        prefix = s_prefix;
        remaining = s_remaining;
        mask |= 255u << shift;
        __syncthreads();
    }
    // prefix is the k-th largest key T; keep every key > T and the last `remaining` keys == T,
    // in ascending position order: the first n_eq - remaining ties of the row are skipped.
    const int n_eq = total[prefix & 255];  // the last pass's bin of T: the row's keys equal to T
    const int skip_eq = n_eq - remaining;
    // This segment's keys > T (above T's top 24 bits, or in a higher bin of the last pass) and
    // == T; the earlier ranks' sums place this segment's selections.
    {
        const int *h = hist[1];  // the last pass (3) is odd
        uint32_t ex;
        const uint32_t n_above = block_scan((uint32_t) above, &ex, warp_tot);
        if (tid == 0) {
            int gt = (int) n_above;
            for (int b = (int) (prefix & 255) + 1; b < 256; b++) gt += h[b];
            s_count[0] = gt;
            s_count[1] = h[prefix & 255];
        }
    }
    topk_sync<CLUSTER>();  // counts published; nobody reads hist any more
    int gt_before = 0, eq_before = 0;
    for (int r = 0; r < rank; r++) {
        const int *c = topk_peer<CLUSTER>(s_count, r);
        gt_before += c[0];
        eq_before += c[1];
    }
    topk_sync<CLUSTER>();  // no CTA exits while a later rank may still read its counts
    // One scan per chunk counts both kinds (greater in the low 16 bits, equal in the high 16);
    // an element's output slot is the selections before it.
    int written = gt_before + max(eq_before - skip_eq, 0), eq_seen = eq_before;
    for (int base = lo; base < hi && written < k; base += TOPK_THREADS * TOPK_UNROLL) {
        uint32_t kv[TOPK_UNROLL];
#pragma unroll
        for (int u = 0; u < TOPK_UNROLL; u++) {
            const int i = base + u * TOPK_THREADS + tid;
            kv[u] = i < hi ? order_key(sc[i]) : 0u;
        }
#pragma unroll
        for (int u = 0; u < TOPK_UNROLL; u++) {
            if (base + u * TOPK_THREADS >= hi || written >= k) break;  // uniform
            const int i = base + u * TOPK_THREADS + tid;
            const int gt = i < hi && kv[u] > prefix;
            const int eq = i < hi && kv[u] == prefix;
            uint32_t ex;
            const uint32_t tot = block_scan((uint32_t) gt | ((uint32_t) eq << 16), &ex, warp_tot);
            const int ex_gt = (int) (ex & 0xffffu), ex_eq = (int) (ex >> 16);
            // ties of this chunk before i that are taken (written counts the earlier chunks')
            const int taken_eq_before = max(ex_eq - max(skip_eq - eq_seen, 0), 0);
            if (gt || (eq && eq_seen + ex_eq >= skip_eq))
                out[written + ex_gt + taken_eq_before] = i;
            const int eq_after = eq_seen + (int) (tot >> 16);
            written += (int) (tot & 0xffffu) + max(eq_after - skip_eq, 0)
                       - max(eq_seen - skip_eq, 0);
            eq_seen = eq_after;
        }
    }
    if (rank == 0 && tid == 0) n_sel[t] = k;
}

// ---------------------------------------------------------------------------
// Launchers

void dsa_scores(float *scores, int score_stride, const float *q, const float *w, float w_scale,
                float sm_scale, const DsaCache *cache, const int32_t *block_table, int max_blocks,
                const int32_t *seq, const int32_t *kv_len, int max_len, int n_tok, int n_heads,
                cudaStream_t stream)
{
    ASSERT(n_tok > 0 && max_len > 0 && dsa_scores_supported(cache, n_heads));
    ASSERT(score_stride >= max_len && (long long) max_blocks * cache->block >= max_len);
    ASSERT((uintptr_t) q % 16 == 0);
    ASSERT(CEIL_DIV(max_len, DSA_BLOCK) <= 65535);
    const dim3 grid((unsigned) n_tok, (unsigned) CEIL_DIV(max_len, DSA_BLOCK));
    const DsaCache c = *cache;
    if (c.format == DSA_KEY_FP8)
        kern_launch(dsa_scores_kernel<DSA_KEY_FP8>, grid, DSA_BLOCK, 0, stream, scores,
                    score_stride, q, w, w_scale, sm_scale, c, block_table, max_blocks, seq, kv_len,
                    n_heads);
    else if (c.format == DSA_KEY_BF16)
        kern_launch(dsa_scores_kernel<DSA_KEY_BF16>, grid, DSA_BLOCK, 0, stream, scores,
                    score_stride, q, w, w_scale, sm_scale, c, block_table, max_blocks, seq, kv_len,
                    n_heads);
    else
        kern_launch(dsa_scores_kernel<DSA_KEY_F32>, grid, DSA_BLOCK, 0, stream, scores,
                    score_stride, q, w, w_scale, sm_scale, c, block_table, max_blocks, seq, kv_len,
                    n_heads);
}

// The device's SM count, read once per process (one device kind); benign race.
void dsa_scores_tc(float *scores, int score_stride, const float *q, const float *w, float w_scale,
                   float sm_scale, const DsaCache *cache, const int32_t *block_table,
                   int max_blocks, const int32_t *seq, const int32_t *kv_len, int max_len,
                   int n_tok, int n_heads, int tiles, cudaStream_t stream)
{
    ASSERT(n_tok > 0 && max_len > 0 && tiles >= 0 && dsa_scores_tc_supported(cache, n_heads));
    ASSERT(score_stride >= max_len && (long long) max_blocks * cache->block >= max_len);
    ASSERT((uintptr_t) q % 16 == 0);
    const int n_tiles = CEIL_DIV(max_len, TC_POS), groups = CEIL_DIV(n_tok, TC_TOKENS);
    if (tiles == 0) {
        // As many tiles a CTA as leave ~8 CTAs an SM (4 resident, two rounds), at most 16:
        // prefill chunks take 16 (q read once per 1,024 positions), a decode step's few tokens
        // one (its positions spread over every SM, as before).
        const long long per = (long long) n_tiles * groups / (8LL * kern_sm_count());
        tiles = per < 1 ? 1 : per > 16 ? 16 : (int) per;
    }
    ASSERT(CEIL_DIV(n_tiles, tiles) <= 65535);
    const dim3 grid((unsigned) groups, (unsigned) CEIL_DIV(n_tiles, tiles));
    const DsaCache c = *cache;
    if (c.format == DSA_KEY_FP8)
        kern_launch(dsa_scores_tc_kernel<DSA_KEY_FP8>, grid, TC_TOKENS * WARP_SIZE, 0, stream,
                    scores, score_stride, q, w, w_scale, sm_scale, c, block_table, max_blocks, seq,
                    kv_len, n_tok, n_heads, tiles);
    else
        kern_launch(dsa_scores_tc_kernel<DSA_KEY_BF16>, grid, TC_TOKENS * WARP_SIZE, 0, stream,
                    scores, score_stride, q, w, w_scale, sm_scale, c, block_table, max_blocks, seq,
                    kv_len, n_tok, n_heads, tiles);
}

// CTAs per token (a cluster): one CTA reads a 128K row at ~1/10 of what a few SMs do, so
// when the tokens leave SMs idle (decode: one to a few tokens) each row is split over up to 8
// (the portable cluster size) as far as the device co-schedules clusters of 1,024-thread CTAs;
// rows of at most one CTA chunk (8,192 scores) stay on one CTA. Clusters only on sm_90 and
// sm_100 (distributed shared memory; sm_12x lacks it: NVIDIA/dgx-spark-playbooks issue 22): elsewhere
// one CTA per token, launched without a cluster attribute. On a GB10 the 128K top-k is a few
// percent of a bandwidth-bound step.
// A launch of dsa_topk_kernel<true> on grid CTAs in clusters of c (the config refers to attr).
static cudaLaunchConfig_t topk_config(cudaLaunchAttribute *attr, int c, unsigned grid,
                                      cudaStream_t stream)
{
    *attr = cudaLaunchAttribute{};
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = (unsigned) c, attr->val.clusterDim.y = 1, attr->val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid), cfg.blockDim = dim3(TOPK_THREADS), cfg.stream = stream;
    cfg.attrs = attr, cfg.numAttrs = 1;
    return cfg;
}

static int topk_cluster(int n_tok, int score_stride)
{
    static int c_max = 0;  // per process (one device kind); benign race
    if (c_max == 0) {
        int dev = 0, major = 0, c = 1;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        if (major == 9 || major == 10) {
            for (c = 8; c > 1; c /= 2) {
                int n_clusters = 0;
                cudaLaunchAttribute a;
                const cudaLaunchConfig_t cfg = topk_config(&a, c, (unsigned) c, 0);
                if (cudaOccupancyMaxActiveClusters(&n_clusters, dsa_topk_kernel<true>, &cfg)
                        == cudaSuccess
                    && n_clusters > 0)
                    break;
                (void) cudaGetLastError();
            }
        }
        c_max = c;
    }
    const int n_sm = kern_sm_count();
    if (score_stride <= TOPK_THREADS * TOPK_UNROLL) return 1;
    int c = 1;
    while (c < c_max && 2 * c * n_tok <= n_sm) c *= 2;
    return c;
}

void dsa_topk(int32_t *idx, int32_t *n_sel, const float *scores, int score_stride,
              const int32_t *kv_len, int n_tok, int k, cudaStream_t stream)
{
    ASSERT(n_tok > 0 && k > 0 && score_stride > 0);
    const int c = topk_cluster(n_tok, score_stride);
    if (c == 1) {
        kern_launch(dsa_topk_kernel<false>, n_tok, TOPK_THREADS, 0, stream, idx, n_sel, scores,
                    score_stride, kv_len, k);
        return;
    }
    ASSERT((long long) n_tok * c <= INT32_MAX);
    cudaLaunchAttribute a;
    const cudaLaunchConfig_t cfg = topk_config(&a, c, (unsigned) (n_tok * c), stream);
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, dsa_topk_kernel<true>, idx, n_sel, scores, score_stride,
                                  kv_len, k));
}
