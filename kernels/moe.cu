/*
 * moe.cu - fused router and routed experts (NVFP4 or bf16) for decode.
 *
 * Router: kernels/moe_router.h's arithmetic (double) with one warp per token. Lane l holds
 * experts l, l+32, ... (at most 16 per lane); group scores and the k selections are warp
 * argmax reductions (value, then lower index), so the result equals the serial code's bit for
 * bit and does not depend on timing. Any expert count up to MOE_MAX_EXPERTS works, incl. 156.
 *
 * Experts on tensor cores (mma.sync m16n8k16, f16 inputs, fp32 accumulation). moe_group
 * sorts the step's (token, slot) pairs by expert into tiles of up to 8 pairs; each tile's
 * expert is read once for all of its pairs (the 8 columns of the MMA), so the bytes grow with
 * the distinct experts of a step, not with its pairs. A block owns one tile and 8 x 16 rows
 * (a 16-row MMA tile per warp, all of K): it stages the tile's columns in shared memory as
 * f16 (each column scaled by a power of two into [2^13, 2^14): exact for bf16 values), and
 * its warps stream their rows' codes as moe_pack_* laid them out: per lane and k-step one
 * 32-bit word holding exactly the lane's 8 A-fragment codes, four k-steps per 16-byte load.
 * Decoding is 9 integer ops per 8 weights: a code's bits already sit where an E5M2 byte has
 * them (sign 7, exponent 3..2, mantissa 1), so a mask and a byte permute give the f16 pair
 * e2m1 * 2^-14; one f16 multiply per pair applies the E4M3 group scale, exactly (at most 6
 * significant bits; the smallest product, 2^-24, is f16's smallest subnormal). The previous
 * kernels dequantized to fp32 for CUDA-core FMAs (~4.5 instructions per weight) and read an
 * expert once per pair. Measured on an H100 at batch 1 (docs/perf.md, run 22c, 2026-12-05):
 * w13 ~2.3 TB/s, w2 ~2.1 TB/s, 74% and 68% of its 3.12 TB/s read rate, bound by the decode's
 * instruction issue (issue 19's scope 1).
 *
 * w13 tiles interleave 8 gate and 8 up rows of the same features, so a lane ends with gate
 * and up of one feature and applies SwiGLU in registers. w2 writes each pair's weighted
 * output; moe_combine adds a token's k outputs in slot order (and the residual): no atomics,
 * reproducible.
 *
 * Experts stored in bf16 run on CUDA cores over the same work list and grid (row blocks x
 * tiles): a block of 8 warps stages its tile's <= 8 input columns in shared memory as bf16,
 * then each warp owns two weight rows at a time (w13: gate and up of one feature; w2: two
 * consecutive rows) and streams them in 16-byte loads, 4 per row in flight, each load feeding
 * all of the tile's columns; each lane sums its chunks in fp32 in a fixed order, then the
 * warp's butterfly (moe.h). Decode is bandwidth-bound: 2 bytes a weight, read once per tile.
 */
#include "kernels/moe.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/launch.cuh"
#include "kernels/nvfp4_format.h"

// ---------------------------------------------------------------------------
// Router kernel

enum { ROUTE_NONE = 0x7fffffff, ROUTE_PER_LANE = MOE_MAX_EXPERTS / WARP_SIZE };

// (v, i) beats (bv, bi) as moe_router_argmax() ranks them: any candidate beats none, then the
// larger value, then the lower index.
static __device__ __forceinline__ bool route_beats(double v, int i, double bv, int bi)
{
    return bi == ROUTE_NONE || v > bv || (v == bv && i < bi);
}

// Warp-wide argmax of each lane's best (v, i); every lane gets the winner.
static __device__ void route_argmax(double *v, int *i)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double ov = __shfl_xor_sync(0xffffffffu, *v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, *i, o);
        if (oi != ROUTE_NONE && route_beats(ov, oi, *v, *i)) {
            *v = ov;
            *i = oi;
        }
    }
}

// The best expert of group g (g < 0: of all) among those not in `skip` (a bit per j) and not
// `except`; ROUTE_NONE when none. Lane l holds experts l, l + 32, ...
static __device__ int route_best(const double *v, unsigned skip, int except, int g,
                                 int per_group, int n_experts, double *best)
{
    const int lane = threadIdx.x % WARP_SIZE;
    double bv = 0.0;
    int bi = ROUTE_NONE;
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; j++) {
        const int e = lane + WARP_SIZE * j;
        if (e < n_experts && !(skip >> j & 1) && e != except && (g < 0 || e / per_group == g)
            && route_beats(v[j], e, bv, bi)) {
            bv = v[j];
            bi = e;
        }
    }
    route_argmax(&bv, &bi);
    *best = bv;
    return bi;
}

// moe_router_token() (kernels/moe_router.h) for one token a warp: the same double arithmetic
// in the same order, with the argmax scans split over the lanes (exact: a max and the lowest
// index among equals do not depend on the order of the comparisons).
static __device__ void route_warp(int t, int32_t *__restrict__ idx, float *__restrict__ w,
                                  const float *__restrict__ logits, const float *__restrict__ bias,
                                  int n_experts, int k, int n_group, int topk_group,
                                  bool norm_topk_prob, float scale, bool is_ascending)
{
    const int lane = threadIdx.x % WARP_SIZE;
    const float *lg = logits + (size_t) t * n_experts;
    const int per_group = n_experts / n_group;

    double s[ROUTE_PER_LANE], choice[ROUTE_PER_LANE];
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; j++) {
        const int e = lane + WARP_SIZE * j;
        s[j] = 0.0;
        choice[j] = 0.0;
        if (e < n_experts) {
            s[j] = 1.0 / (1.0 + exp(-(double) lg[e]));
            choice[j] = s[j] + (bias ? bias[e] : 0.0f);
        }
    }
    if (topk_group < n_group) {  // else every group stays and the group scores do not matter
        double gscore = 0.0;     // lane g holds group g's
        for (int g = 0; g < n_group; g++) {
            double a, b;
            const int ia = route_best(choice, 0u, -1, g, per_group, n_experts, &a);
            const int ib = route_best(choice, 0u, ia, g, per_group, n_experts, &b);
            if (lane == g) gscore = a + (ib != ROUTE_NONE ? b : 0.0);
        }
        unsigned keep = 0;
        for (int r = 0; r < topk_group; r++) {
            double bv = gscore;
            int bi = lane < n_group && !(keep >> lane & 1) ? lane : ROUTE_NONE;
            route_argmax(&bv, &bi);
            keep |= 1u << bi;
        }
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++) {
            const int e = lane + WARP_SIZE * j;
            if (e < n_experts && !(keep >> (e / per_group) & 1)) choice[j] = -INFINITY;
        }
    }

    int chosen[MOE_MAX_K];
    double chosen_s[MOE_MAX_K];
    unsigned taken = 0;
    for (int r = 0; r < k; r++) {
        double bv;
        const int bi = route_best(choice, taken, -1, -1, 1, n_experts, &bv);
        double sv = 0.0;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++)
            if (lane + WARP_SIZE * j == bi) {
                sv = s[j];
                taken |= 1u << j;
            }
        chosen[r] = bi;
        chosen_s[r] = __shfl_sync(0xffffffffu, sv, bi % WARP_SIZE);
    }
    // The sum runs over the chosen experts in ascending order, as moe_router_token's does.
    int order[MOE_MAX_K];
    for (int r = 0; r < k; r++) {
        int i = r;
        for (; i > 0 && chosen[order[i - 1]] > chosen[r]; i--) order[i] = order[i - 1];
        order[i] = r;
    }
    double sum = 0.0;
    for (int r = 0; r < k; r++) sum += chosen_s[order[r]];
    if (lane < k) {
        double v = 0.0;
        int e = 0;
        for (int r = 0; r < k; r++)  // registers, not a dynamically indexed array
            if (r == lane) {
                const int c = is_ascending ? order[r] : r;
                e = chosen[c];
                v = chosen_s[c];
            }
        if (norm_topk_prob) v /= sum + 1e-20;
        idx[(size_t) t * k + lane] = e;
        w[(size_t) t * k + lane] = (float) (v * scale);
    }
}

static __global__ void moe_route_kernel(int32_t *__restrict__ idx, float *__restrict__ w,
                                        const float *__restrict__ logits,
                                        const float *__restrict__ bias, int n_tok, int n_experts,
                                        int k, int n_group, int topk_group, bool norm_topk_prob,
                                        float scale, bool is_ascending)
{
    KERN_ENTRY();
    const int t = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (t < n_tok)
        route_warp(t, idx, w, logits, bias, n_experts, k, n_group, topk_group, norm_topk_prob,
                   scale, is_ascending);
}

// Without group limits (every group kept: GLM-5's n_group = 1) the same choice by rank:
// thread e counts the experts that moe_router_argmax() takes before e (larger biased score, or
// equal and a lower index: a total order without NaNs), so the experts of rank < K are
// exactly the K it takes, rank r the r-th. One pass of E comparisons per (token, expert) from
// shared memory instead of K dependent warp-wide argmax rounds. The weights sum the chosen
// experts' scores in ascending expert order, as moe_router_token() does. A token with a NaN
// score (which argmax handles by position) takes route_warp() (warp 0) instead.
enum { ROUTE_RANK_THREADS = 256 };

// Tokens t0 .. t0 + n_tok by the whole block (any multiple of WARP_SIZE threads): score and
// choice hold n_tok * n_experts doubles, chosen and asc n_tok * k ints, nan_of n_tok ints
// (shared memory). idx and w are written when it returns (visible to the block).
static __device__ void route_rank_tokens(int32_t *idx, float *w, const float *__restrict__ logits,
                                         const float *__restrict__ bias, int t0, int n_tok,
                                         int n_experts, int k, bool norm_topk_prob, float scale,
                                         bool is_ascending, double *score, double *choice,
                                         int *chosen, int *asc, int *nan_of)
{
    const int tid = threadIdx.x, nth = blockDim.x, n_all = n_tok * n_experts;
    for (int t = tid; t < n_tok; t += nth) nan_of[t] = 0;
    __syncthreads();
    bool nan = false;
    for (int i = tid; i < n_all; i += nth) {
        const int t = i / n_experts, e = i - t * n_experts;
        const double sc = 1.0 / (1.0 + exp(-(double) logits[(size_t) (t0 + t) * n_experts + e]));
        score[i] = sc;
        choice[i] = sc + (bias ? bias[e] : 0.0f);
        if (choice[i] != choice[i]) {
            nan_of[t] = 1;
            nan = true;
        }
    }
    const bool any_nan = __syncthreads_or(nan);
    // Every thread counts over all experts (no early exit): the loads of choice[] are
    // independent and unrolled, where a loop that stopped at rank k ran its slowest threads'
    // (the top experts') 156 loads one after another.
    for (int i = tid; i < n_all; i += nth) {
        const int t = i / n_experts, e = i - t * n_experts;
        if (nan_of[t]) continue;
        const double *ch = choice + (size_t) t * n_experts;
        const double v = ch[e];
        int rank = 0;
#pragma unroll 8
        for (int j = 0; j < n_experts; j++) {
            const double u = ch[j];
            rank += u > v || (u == v && j < e);
        }
        if (rank < k) chosen[t * k + rank] = e;
    }
    __syncthreads();
    // Slot (t, r) places chosen[t, r] in ascending id order (distinct ids: its count of smaller
    // ones), then each slot sums its token's k scores in that order (the same sum on every
    // slot) and writes itself.
    for (int p = tid; p < n_tok * k; p += nth) {
        const int t = p / k;
        if (nan_of[t]) continue;
        const int c = chosen[p];
        int pos = 0;
        for (int j = 0; j < k; j++) pos += chosen[t * k + j] < c;
        asc[t * k + pos] = c;
    }
    __syncthreads();
    for (int p = tid; p < n_tok * k; p += nth) {
        const int t = p / k;
        if (nan_of[t]) continue;
        const double *sc = score + (size_t) t * n_experts;
        double sum = 0.0;
        for (int r = 0; r < k; r++) sum += sc[asc[t * k + r]];
        const int e = is_ascending ? asc[p] : chosen[p];
        double v = sc[e];
        if (norm_topk_prob) v /= sum + 1e-20;
        idx[(size_t) t0 * k + p] = e;
        w[(size_t) t0 * k + p] = (float) (v * scale);
    }
    if (any_nan && tid < WARP_SIZE)
        for (int t = 0; t < n_tok; t++)
            if (nan_of[t])
                route_warp(t0 + t, idx, w, logits, bias, n_experts, k, 1, 1, norm_topk_prob, scale,
                           is_ascending);
    __syncthreads();
}

// A block per token.
static __global__ void __launch_bounds__(ROUTE_RANK_THREADS)
    moe_route_rank_kernel(int32_t *__restrict__ idx, float *__restrict__ w,
                          const float *__restrict__ logits, const float *__restrict__ bias,
                          int n_experts, int k, bool norm_topk_prob, float scale, bool is_ascending)
{
    KERN_ENTRY();
    __shared__ double score[MOE_MAX_EXPERTS], choice[MOE_MAX_EXPERTS];
    __shared__ int chosen[MOE_MAX_K], asc[MOE_MAX_K], nan_of[1];
    route_rank_tokens(idx, w, logits, bias, blockIdx.x, 1, n_experts, k, norm_topk_prob, scale,
                      is_ascending, score, choice, chosen, asc, nan_of);
}

// ---------------------------------------------------------------------------
// The work list: pairs grouped by expert into tiles of up to MOE_TILE_COLS

enum { GROUP_THREADS = MOE_MAX_PAIRS, TILE_INTS = 2 + MOE_TILE_COLS };

// Inclusive scan of the experts' tile counts (ceil(count / cols)) into base, by one warp:
// lane l sums a run of experts, the lanes' sums are scanned by shuffles, and each lane writes
// its run's prefix.
static __device__ void scan_tiles(int32_t *base, const int32_t *count, int n_experts, int cols)
{
    const int lane = threadIdx.x % WARP_SIZE;
    const int per = CEIL_DIV(n_experts, WARP_SIZE), e0 = lane * per;
    int sum = 0;
    for (int i = e0; i < e0 + per && i < n_experts; i++) sum += CEIL_DIV(count[i], cols);
    int incl = sum;
#pragma unroll
    for (int o = 1; o < WARP_SIZE; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    int run = incl - sum;
    for (int i = e0; i < e0 + per && i < n_experts; i++) {
        run += CEIL_DIV(count[i], cols);
        base[i] = run;
    }
}

// One block. Pair p = t*k + j of expert e gets rank = #{p' < p : idx[p'] == e}; expert e's
// tiles start at the prefix sum of ceil(count / 8) over the experts before it; the pair goes
// to tile base[e] + rank / 8, column rank % 8. Tiles in ascending expert order, columns in
// slot order: the list depends on idx alone.
// The whole block of GROUP_THREADS threads; idx: written by an earlier kernel, or by this block
// before a barrier (plain loads).
static __device__ void group_pairs(int32_t *__restrict__ work, const int32_t *idx, int n_pairs,
                                   int n_experts)
{
    __shared__ int32_t ids[MOE_MAX_PAIRS];
    __shared__ int32_t count[MOE_MAX_EXPERTS], base[MOE_MAX_EXPERTS];  // base: inclusive tile prefix
    const int tid = threadIdx.x;
    for (int e = tid; e < n_experts; e += GROUP_THREADS) count[e] = 0;
    if (tid < n_pairs) ids[tid] = idx[tid];
    __syncthreads();
    int e = -1, rank = 0;
    if (tid < n_pairs) {
        e = ids[tid];
        for (int q = 0; q < tid; q++) rank += ids[q] == e;
        atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (tid < WARP_SIZE) scan_tiles(base, count, n_experts, MOE_TILE_COLS);
    __syncthreads();
    if (tid == 0) work[0] = base[n_experts - 1];
    if (e >= 0) {
        const int tile = base[e] - CEIL_DIV(count[e], MOE_TILE_COLS) + rank / MOE_TILE_COLS;
        int32_t *t = work + 1 + (size_t) tile * TILE_INTS;
        const int col = rank % MOE_TILE_COLS;
        t[2 + col] = tid;
        if (col == 0) {
            t[0] = e;
            t[1] = min(MOE_TILE_COLS, count[e] - (rank - col));
        }
    }
}

static __global__ void __launch_bounds__(GROUP_THREADS)
    moe_group_kernel(int32_t *__restrict__ work, const int32_t *__restrict__ idx, int n_pairs,
                     int n_experts)
{
    KERN_ENTRY();
    group_pairs(work, idx, n_pairs, n_experts);
}

// Route and group in one block (moe_route_group): the router's rank pass over all the step's
// tokens (dynamic shared memory: score and choice, n_tok * n_experts doubles each), then
// group_pairs on the experts it wrote.
static __global__ void __launch_bounds__(GROUP_THREADS)
    moe_route_group_kernel(int32_t *__restrict__ work, int32_t *idx, float *w,
                           const float *__restrict__ logits, const float *__restrict__ bias,
                           int n_tok, int n_experts, int k, bool norm_topk_prob, float scale,
                           bool is_ascending)
{
    KERN_ENTRY();
    static_assert(MOE_ROUTE_GROUP_MAX_TOK * MOE_MAX_K <= MOE_MAX_PAIRS, "group_pairs' block");
    extern __shared__ double rg[];  // score, then choice
    __shared__ int chosen[MOE_ROUTE_GROUP_MAX_TOK * MOE_MAX_K];
    __shared__ int asc[MOE_ROUTE_GROUP_MAX_TOK * MOE_MAX_K], nan_of[MOE_ROUTE_GROUP_MAX_TOK];
    route_rank_tokens(idx, w, logits, bias, 0, n_tok, n_experts, k, norm_topk_prob, scale,
                      is_ascending, rg, rg + (size_t) n_tok * n_experts, chosen, asc, nan_of);
    group_pairs(work, idx, n_tok * k, n_experts);
}

// More pairs than one block holds (a prefill chunk, up to MOE_MAX_CHUNK_PAIRS), or the wide
// tiles of the prefill kernels below (cols = MOE_WIDE_COLS): the same tiles by atomics over
// three launches. cnt = work's counters past the tiles: count[E], cursor[E], base[E] (count
// and cursor zeroed by the launcher); a tile is 2 + cols ints. A pair's column is the order in
// which its thread reached the expert's cursor, so the list varies between runs; a pair's
// results do not (each MMA column is its own dot products, and each staged column its own
// scale), so the outputs equal moe_group_kernel's bit for bit.
static __global__ void moe_count_kernel(int32_t *__restrict__ cnt, const int32_t *__restrict__ idx,
                                        int n_pairs)
{
    KERN_ENTRY();
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < n_pairs) atomicAdd(&cnt[idx[p]], 1);
}

static __global__ void moe_scan_kernel(int32_t *__restrict__ work, int32_t *__restrict__ cnt,
                                       int n_experts, int cols)
{
    KERN_ENTRY();
    int32_t *base = cnt + 2 * n_experts;
    scan_tiles(base, cnt, n_experts, cols);
    __syncwarp();
    if (threadIdx.x == 0) work[0] = base[n_experts - 1];
}

static __global__ void moe_place_kernel(int32_t *__restrict__ work, int32_t *__restrict__ cnt,
                                        const int32_t *__restrict__ idx, int n_pairs, int n_experts,
                                        int cols)
{
    KERN_ENTRY();
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n_pairs) return;
    const int e = idx[p], count = cnt[e];
    const int rank = atomicAdd(&cnt[n_experts + e], 1);
    const int tile = cnt[2 * n_experts + e] - CEIL_DIV(count, cols) + rank / cols;
    int32_t *t = work + 1 + (size_t) tile * (2 + cols);
    const int col = rank % cols;
    t[2 + col] = p;
    if (col == 0) {
        t[0] = e;
        t[1] = min(cols, count - rank);
    }
}

// ---------------------------------------------------------------------------
// Expert epilogues: one formula for every weight format (NVFP4 and bf16 kernels below; the
// engine's CPU reference computes the same)

// gate/up -> one activation: bf16(SiLU(g) * u), SiLU(g) = g / (1 + e^-g), in fp32 (expf, IEEE
// division; no fast math), rounded to nearest even.
static __device__ __forceinline__ uint16_t swiglu_bf16(float g, float u)
{
    return f32_to_bf16_bits(g / (1.0f + expf(-g)) * u);
}

// down -> a pair's output: the fp32 dot product times the pair's factor m (w[p], times the
// format's scales when it has any), one fp32 multiply.
static __device__ __forceinline__ float down_weighted(float dot, float m)
{
    return dot * m;
}

// ---------------------------------------------------------------------------
// Expert kernels (tensor cores)

enum {
    MMA_WARPS = 8,
    MMA_THREADS = MMA_WARPS * WARP_SIZE,
    CHUNK_KS = 4,          // k-steps of 16 per 16-byte lane load
    CHUNK_BYTES = 512,     // one chunk of a 16-row tile: 32 lanes x 16 bytes
    CHUNK_SBYTES = 64,     // its scales: 16 rows x 4 groups
    PIPE = 8,              // chunks in flight per lane (4 → 8: w2 27.5 → 22.6 µs a layer, w13 64 → 62)
    X_EXP_TOP = 13,        // staged columns are scaled by 2^-e into [2^13, 2^14)
};

// Words per staged column of K values (f16 pairs): K/2 rounded so that the row stride is 4
// words past a multiple of 32 banks; the 8 columns' fragment loads then hit 32 banks.
static __host__ __device__ int stage_words(int K)
{
    const int w = K / 2;
    return w + ((4 - w % 32) + 32) % 32;
}

// The column scale exponent: |x| * 2^-e < 2^14 for the largest |x| (exact in f16 from bf16
// down to 2^-14 of the scaled range).
static __device__ __forceinline__ int col_exponent(float amax)
{
    if (!(amax > 0.0f) || !isfinite(amax)) return 0;
    return min(max(ilogbf(amax) - X_EXP_TOP, -110), 100);
}

// A staged column's factors from its largest magnitude: the input's 2^-e (col_exponent) and
// the output's 2^e, times the 2^14 of the codes' E5M2 patterns.
static __device__ __forceinline__ void col_factors(float amax, float *s_in, float *out_mul)
{
    const int e = col_exponent(amax);
    *s_in = ldexpf(1.0f, -e);
    *out_mul = ldexpf(1.0f, e) * 16384.0f;
}

// 8 codes of one lane and k-step (packed by moe_pack_*) -> 4 f16 pairs A0..A3 of the
// m16n8k16 A fragment, each code as its E5M2 pattern (= e2m1 * 2^-14 in f16), multiplied
// by the rows' group scales (exact: the product has at most 6 significant bits, and the
// smallest, 2^-24, is f16's smallest subnormal). s16: scales of rows r (low byte) and r+8.
static __device__ __forceinline__ void decode_a(uint32_t a[4], uint32_t w, uint32_t s16)
{
    const uint32_t x0 = w & 0x8e8e8e8eu;
    const uint32_t x1 = ((w << 1) & 0x82828282u) | ((w >> 2) & 0x0c0c0c0cu);
    const __half2_raw sr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t) s16, __NV_E4M3);
    const __half2 s = __half2(sr);
    const __half2 s_lo = __low2half2(s), s_hi = __high2half2(s);
    const uint32_t raw[4] = {__byte_perm(x0, 0u, 0x1404), __byte_perm(x0, 0u, 0x3424),
                             __byte_perm(x1, 0u, 0x1404), __byte_perm(x1, 0u, 0x3424)};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __half2 h = *(const __half2 *) &raw[i];
        h = __hmul2(h, i % 2 ? s_hi : s_lo);
        a[i] = *(const uint32_t *) &h;
    }
}

static __device__ __forceinline__ void mma_f16(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The packed layout of one 16-row tile (moe_pack_* writes it, the kernels read it): chunk ch
// of nk (4, or the tail's 1-3) k-steps holds lane l's word of k-step j at code_at(ch, l, nk,
// j) and the scales of rows r and r + 8 for k-step j at scale_at(ch, r, nk, j).
static __host__ __device__ __forceinline__ size_t code_at(int ch, int lane, int nk, int j)
{
    return (size_t) ch * CHUNK_BYTES + ((size_t) lane * nk + j) * 4;
}

static __host__ __device__ __forceinline__ size_t scale_at(int ch, int r, int nk, int j)
{
    return (size_t) ch * CHUNK_SBYTES + ((size_t) r * nk + j) * 2;
}

// Full chunk ch of a tile: the lane's 16 bytes of codes and its rows' 8 bytes of scales.
static __device__ __forceinline__ void load_chunk(uint4 *q, uint2 *s, const uint8_t *qt,
                                                  const uint8_t *st, int ch)
{
    const int lane = threadIdx.x % WARP_SIZE;
    *q = ld_stream_u4(qt + code_at(ch, lane, CHUNK_KS, 0));
    *s = ld_stream_u2(st + scale_at(ch, lane / 4, CHUNK_KS, 0));
}

// One chunk of a warp's 16-row tile (qv: the lane's code words of its CHUNK_KS k-steps, sv:
// its rows' scales) against nt <= NT n-tiles: n-tile t's B words of k-step j at
// b + off[t] + 8 j (and + 4). Even k-steps accumulate into c[t], odd ones into c2[t]: two
// MMA chains, whose order the decode kernels keep so that they agree bit for bit (the wide
// tiles pass c as c2: one chain).

template <int NT>
static __device__ __forceinline__ void chunk_mma(float (*c)[4], float (*c2)[4], uint4 qv, uint2 sv,
                                                 const uint32_t *b, const int *off, int nt)
{
    const uint32_t qw[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
    for (int j = 0; j < CHUNK_KS; j++) {
        uint32_t a[4];
        decode_a(a, qw[j], ((j < 2 ? sv.x : sv.y) >> (16 * (j % 2))) & 0xffffu);
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < nt) {
                const uint32_t *bt = b + off[t] + 8 * j;
                mma_f16(j % 2 ? c2[t] : c[t], a, bt[0], bt[4]);
            }
    }
}

// Tail k-step j of a tile whose K is not a multiple of 64 (its code word and scales loaded
// directly), into c[t] for nt <= NT n-tiles with B words at b + off[t] (and + 4).
template <int NT>
static __device__ __forceinline__ void tail_mma(float (*c)[4], const uint8_t *qt, const uint8_t *st,
                                                int nfull, int ntail, int j, const uint32_t *b,
                                                const int *off, int nt)
{
    const int lane = threadIdx.x % WARP_SIZE;
    const uint32_t w = __ldg((const uint32_t *) (qt + code_at(nfull, lane, ntail, j)));
    const uint32_t s16 = __ldg((const uint16_t *) (st + scale_at(nfull, lane / 4, ntail, j)));
    uint32_t a[4];
    decode_a(a, w, s16);
#pragma unroll
    for (int t = 0; t < NT; t++)
        if (t < nt) mma_f16(c[t], a, b[off[t]], b[off[t] + 4]);
}

// PIPE consecutive chunks ch0 .. ch0 + PIPE - 1 (those below nfull) of a warp's tile from the
// register pipeline (slot d holds chunk ch0 + d; each is refilled with the chunk PIPE later),
// chunk ch0 + d's B words at b + d * CHUNK_KS * 8 (chunk_mma's offsets).
template <int NT>
static __device__ __forceinline__ void range_mma(float (*c)[4], float (*c2)[4], uint4 qa[PIPE],
                                                 uint2 sa[PIPE], const uint8_t *qt,
                                                 const uint8_t *st, int ch0, int nfull,
                                                 const uint32_t *b, const int *off, int nt)
{
#pragma unroll
    for (int d = 0; d < PIPE; d++) {
        const int ch = ch0 + d;
        if (ch < nfull) {
            const uint4 qv = qa[d];
            const uint2 sv = sa[d];
            if (ch + PIPE < nfull) load_chunk(&qa[d], &sa[d], qt, st, ch + PIPE);
            chunk_mma<NT>(c, c2, qv, sv, b + d * CHUNK_KS * 8, off, nt);
        }
    }
}

// One warp's 16-row tile over all K: c[0..1] rows r = lane/4, columns 2(lane%4) + {0, 1};
// c[2..3] row r + 8. qt, st: the tile's packed codes and scales; bs: the staged columns.
// The first PIPE chunks' loads were issued by the caller (qa, sa), before the staging.
static __device__ __forceinline__ void tile_mma(float c[4], const uint8_t *qt, const uint8_t *st,
                                                const uint32_t *bs, int K, uint4 qa[PIPE],
                                                uint2 sa[PIPE])
{
    const int lane = threadIdx.x % WARP_SIZE, cq = lane % 4;
    const int nks = K / 16, nfull = nks / CHUNK_KS, ntail = nks % CHUNK_KS;
    const uint32_t *bl = bs + cq;
    const int off[1] = {0};
    float c2[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // odd k-steps of the chunks
    float (*cc)[4] = (float (*)[4]) c, (*cc2)[4] = (float (*)[4]) c2;
    for (int ch0 = 0; ch0 < nfull; ch0 += PIPE)
        range_mma<1>(cc, cc2, qa, sa, qt, st, ch0, nfull, bl + ch0 * CHUNK_KS * 8, off, 1);
    for (int j = 0; j < ntail; j++)
        tail_mma<1>(cc, qt, st, nfull, ntail, j, bl + (nfull * CHUNK_KS + j) * 8, off, 1);
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] += c2[i];
}

static __device__ __forceinline__ void tile_prefetch(uint4 qa[PIPE], uint2 sa[PIPE],
                                                     const uint8_t *qt, const uint8_t *st, int K)
{
    const int nfull = K / 16 / CHUNK_KS;
#pragma unroll
    for (int d = 0; d < PIPE; d++)
        if (d < nfull) load_chunk(&qa[d], &sa[d], qt, st, d);
}

// Warp w of block x of an expert kernel: its 16-row tile rt = x*8 + w of expert e's packed
// matrix (n_tiles tiles of K columns), the tile's codes and scales (*qt, *st), and the first
// PIPE chunks' loads issued (qa, sa) when rt < n_tiles. Returns rt.
static __device__ __forceinline__ int warp_rows(const uint8_t *q, const uint8_t *s, int e,
                                                int n_tiles, int K, const uint8_t **qt,
                                                const uint8_t **st, uint4 qa[PIPE], uint2 sa[PIPE])
{
    const int rt = blockIdx.x * MMA_WARPS + threadIdx.x / WARP_SIZE;
    *qt = q + ((size_t) e * n_tiles + rt) * (8 * (size_t) K);
    *st = s + ((size_t) e * n_tiles + rt) * (size_t) K;
    if (rt < n_tiles) tile_prefetch(qa, sa, *qt, *st, K);
    return rt;
}

// Four consecutive inputs of a column as fp32: fp32 rows rounded to bf16 (the recipe's
// rounding of the experts' input), or bf16 rows (exact).
static __device__ __forceinline__ float4 load4(const float *p, int i)
{
    const float4 f = __ldg((const float4 *) p + i);
    return make_float4(bf16_bits_to_f32(f32_to_bf16_bits(f.x)), bf16_bits_to_f32(f32_to_bf16_bits(f.y)),
                       bf16_bits_to_f32(f32_to_bf16_bits(f.z)), bf16_bits_to_f32(f32_to_bf16_bits(f.w)));
}

static __device__ __forceinline__ float4 load4(const uint16_t *p, int i)
{
    const uint2 u = __ldg((const uint2 *) p + i);
    const float2 a = bf16x2_bits_to_f32(u.x), b = bf16x2_bits_to_f32(u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}

// Four inputs of a column scaled by its power of two sc into two f16 pairs at dst (exact).
static __device__ __forceinline__ void stage4(uint32_t *dst, float4 v, float sc)
{
    const __half2 h0 = __floats2half2_rn(v.x * sc, v.y * sc), h1 = __floats2half2_rn(v.z * sc, v.w * sc);
    *(uint2 *) dst = make_uint2(*(const uint32_t *) &h0, *(const uint32_t *) &h1);
}

// Stage the tile's columns in shared memory as f16, column n scaled by 2^-exponent: the
// block finds each column's largest magnitude (all threads, 4 values a load), then converts.
template <typename T>
static __device__ void stage_columns(uint32_t *bs, float *out_mul, const T *src, size_t stride,
                                     const int *row_of, int ncols, int K)
{
    __shared__ unsigned amax_bits[MOE_TILE_COLS];
    __shared__ float s_in[MOE_TILE_COLS];
    const int lane = threadIdx.x % WARP_SIZE, q = K / 4, W = stage_words(K);
    if (threadIdx.x < MOE_TILE_COLS) amax_bits[threadIdx.x] = 0u;
    __syncthreads();
    for (int n = 0; n < ncols; n++) {
        const T *p = src + (size_t) row_of[n] * stride;
        float m = 0.0f;
        for (int i = threadIdx.x; i < q; i += MMA_THREADS) {
            const float4 v = load4(p, i);
            m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
        m = warp_max(m);
        if (lane == 0 && m > 0.0f) atomicMax(&amax_bits[n], __float_as_uint(m));  // m >= 0: bits order as values
    }
    __syncthreads();
    if (threadIdx.x < ncols) {
        col_factors(__uint_as_float(amax_bits[threadIdx.x]), &s_in[threadIdx.x],
                    &out_mul[threadIdx.x]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ncols * q; i += MMA_THREADS) {
        const int n = i / q, kk = i % q;
        stage4(bs + n * W + 2 * kk, load4(src + (size_t) row_of[n] * stride, kk), s_in[n]);
    }
    __syncthreads();
}

// What a warp of an expert kernel ends with: its tile's expert, columns, their pairs and
// output factors (shared memory).
typedef struct TileOut {
    int e, ncols;
    const int *pair_of;
    const float *out_mul;
} TileOut;

// The common body of the expert kernels, for block (x, tile) of a matrix of n_tiles 16-row
// tiles and K columns: the tile's expert and pairs, its columns staged from src (pair p's row
// p / row_div, K values each) with their output factors, and warp w's rows, tile x*8 + w,
// over all K into c (tile_mma's layout). False for blocks past the step's tiles and for
// warps past the last row tile (after the block's staging, which they share).
template <typename T>
static __device__ bool expert_tile(float c[4], TileOut *o, const uint8_t *q, const uint8_t *s,
                                   const T *src, int row_div, const int32_t *work, int n_tiles,
                                   int K)
{
    extern __shared__ __align__(16) uint32_t bs[];
    __shared__ float out_mul[MOE_TILE_COLS];
    __shared__ int pair_of[MOE_TILE_COLS], row_of[MOE_TILE_COLS];
    if ((int) blockIdx.y >= work[0]) return false;  // the whole block
    const int32_t *tl = work + 1 + (size_t) blockIdx.y * TILE_INTS;
    const int e = tl[0], ncols = tl[1], lane = threadIdx.x % WARP_SIZE;
    const uint8_t *qt, *st;
    uint4 qa[PIPE];
    uint2 sa[PIPE];
    const int rt = warp_rows(q, s, e, n_tiles, K, &qt, &st, qa, sa);
    if (threadIdx.x < MOE_TILE_COLS) {
        const int p = (int) threadIdx.x < ncols ? tl[2 + threadIdx.x] : 0;
        pair_of[threadIdx.x] = p;
        row_of[threadIdx.x] = p / row_div;
    }
    __syncthreads();
    stage_columns<T>(bs, out_mul, src, (size_t) K, row_of, ncols, K);
    *o = TileOut{e, ncols, pair_of, out_mul};
    if (rt >= n_tiles) return false;
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] = 0.0f;
    const int n_lane = lane / 4 < ncols ? lane / 4 : 0;  // columns past ncols read column 0
    tile_mma(c, qt, st, bs + n_lane * stage_words(K), K, qa, sa);
    return true;
}

// The epilogues of an n8 MMA tile c (tile_mma's layout) whose columns are the tile's columns
// n0 .. n0 + 7 (o: the tile; columns past o->ncols are skipped). gate/up: SwiGLU of the
// lane's feature feat into act; down: the weighted rows row and row + 8 into y.
static __device__ __forceinline__ void w13_out(uint16_t *act, const float c[4], const TileOut *o,
                                               int n0, int feat, float gg, float gu, int inter)
{
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int n = n0 + 2 * (lane % 4) + h;
        if (n < o->ncols) {
            const float g = c[h] * o->out_mul[n] * gg, u = c[2 + h] * o->out_mul[n] * gu;
            act[(size_t) o->pair_of[n] * inter + feat] = swiglu_bf16(g, u);
        }
    }
}

static __device__ __forceinline__ void w2_out(float *y, const float c[4], const TileOut *o, int n0,
                                              int row, float ge, const float *w, int hidden)
{
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int n = n0 + 2 * (lane % 4) + h;
        if (n < o->ncols) {
            const int p = o->pair_of[n];
            const float m = o->out_mul[n] * ge * w[p];
            float *yp = y + (size_t) p * hidden + row;
            yp[0] = down_weighted(c[h], m);
            yp[8] = down_weighted(c[2 + h], m);
        }
    }
}

// gate/up + SwiGLU. Grid (ceil(inter / 64), max tiles); warp w of block x owns the 16-row
// tile x*8 + w: gate rows 8*tile + r and up rows of the same features, so that a lane holds
// gate and up of feature 8*tile + r for its two columns.
static __global__ void __launch_bounds__(MMA_THREADS)
    moe_w13_kernel(uint16_t *__restrict__ act, const uint8_t *__restrict__ q13,
                   const uint8_t *__restrict__ s13, const float *__restrict__ g13,
                   const float *__restrict__ x, const int32_t *__restrict__ work, int k,
                   int hidden, int inter)
{
    KERN_ENTRY();
    float c[4];
    TileOut o;
    if (!expert_tile<float>(c, &o, q13, s13, x, k, work, inter / 8, hidden)) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int feat = (blockIdx.x * MMA_WARPS + threadIdx.x / WARP_SIZE) * 8 + lane / 4;
    w13_out(act, c, &o, 0, feat, g13[2 * o.e], g13[2 * o.e + 1], inter);
}

// down: y[p, row] = w[p] * down_e(act[p])[row] for block (x, tile)'s rows, the work of
// moe_w2_kernel and moe_w2_combine_kernel (grid (ceil(hidden / 128), max tiles)).
static __device__ __forceinline__ void
w2_tile(float *__restrict__ y, const uint8_t *__restrict__ q2, const uint8_t *__restrict__ s2,
        const float *__restrict__ g2, const uint16_t *__restrict__ act,
        const int32_t *__restrict__ work, const float *__restrict__ w, int hidden, int inter)
{
    float c[4];
    TileOut o;
    if (!expert_tile<uint16_t>(c, &o, q2, s2, act, 1, work, hidden / 16, inter)) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = (blockIdx.x * MMA_WARPS + threadIdx.x / WARP_SIZE) * 16 + lane / 4;
    w2_out(y, c, &o, 0, row, g2[o.e], w, hidden);
}

static __global__ void __launch_bounds__(MMA_THREADS)
    moe_w2_kernel(float *__restrict__ y, const uint8_t *__restrict__ q2,
                  const uint8_t *__restrict__ s2, const float *__restrict__ g2,
                  const uint16_t *__restrict__ act, const int32_t *__restrict__ work,
                  const float *__restrict__ w, int hidden, int inter)
{
    KERN_ENTRY();
    w2_tile(y, q2, s2, g2, act, work, w, hidden, inter);
}

// out[t, r] = residual[t, r] + sum_j y[t*k + j, r] (j ascending; residual may be NULL, out may
// alias it): moe_combine's value, for moe_combine_kernel and moe_w2_combine_kernel. y is read
// from L2 (the combine kernel reads other blocks' stores of the same launch).
static __device__ __forceinline__ void combine_at(float *out, const float *y, const float *residual,
                                                  size_t t, size_t r, int k, int hidden)
{
    float s = 0.0f;
    for (int j = 0; j < k; j++) s += __ldcg(y + (t * k + j) * hidden + r);
    const size_t i = t * hidden + r;
    out[i] = residual ? residual[i] + s : s;
}

// down and the combine in one launch (moe_experts_w2_combine): moe_w2_kernel's work, then the
// last of the step's tiles to finish a block's 128 rows (a counter a row block, cnt[x]) adds
// every token's k outputs of those rows to the residual, moe_combine_kernel's sums in its
// order; the count wraps to zero for the next launch. Each thread fences its stores before the
// block's count (the fence-then-count pattern; the last block fences again and reads the
// others' stores from L2).
static __global__ void __launch_bounds__(MMA_THREADS)
    moe_w2_combine_kernel(float *out, float *y, const float *residual, int32_t *cnt,
                          const uint8_t *__restrict__ q2, const uint8_t *__restrict__ s2,
                          const float *__restrict__ g2, const uint16_t *__restrict__ act,
                          const int32_t *__restrict__ work, const float *__restrict__ w,
                          int n_tok, int k, int hidden, int inter)
{
    KERN_ENTRY();
    __shared__ int last;
    const int n_used = work[0];
    if ((int) blockIdx.y >= n_used) return;  // the whole block: no tile, not counted
    w2_tile(y, q2, s2, g2, act, work, w, hidden, inter);  // its warps past the rows store nothing
    __threadfence();
    __syncthreads();
    // atomicInc wraps to 0 at the last block: the counter resets itself.
    if (threadIdx.x == 0)
        last = atomicInc((unsigned *) &cnt[blockIdx.x], n_used - 1) == (unsigned) n_used - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int r0 = blockIdx.x * MMA_WARPS * 16, rows = min(MMA_WARPS * 16, hidden - r0);
    for (int i = threadIdx.x; i < n_tok * rows; i += MMA_THREADS)
        combine_at(out, y, residual, i / rows, r0 + i % rows, k, hidden);
}

// ---------------------------------------------------------------------------
// Wide tiles for prefill: up to MOE_WIDE_COLS pairs of one expert a tile

enum {
    WIDE_NT = MOE_WIDE_COLS / 8,  // n8 MMA tiles per warp
    WIDE_KC = 64 * PIPE,          // K values staged at a time: PIPE chunks of 4 k-steps
    WIDE_TILE_INTS = 2 + MOE_WIDE_COLS,
};

// Per row r of src [n_rows, K] (fp32 rounded to bf16 as read, or bf16), one warp each: the
// row staged once as stage_columns stages a column, xs [n_rows, K] f16, each value times the
// staging factor 2^-e of the row's largest magnitude (exact; the same exponent: the maximum
// is exact in any order), and the output factor 2^e * 2^14 into out_mul[r]. The wide tiles
// then copy these rows into shared memory instead of converting their columns again for
// every 128-row block of the expert.
template <typename T>
static __global__ void moe_row_stage_kernel(uint16_t *__restrict__ xs, float *__restrict__ out_mul,
                                            const T *__restrict__ src, int n_rows, int K)
{
    KERN_ENTRY();
    const int r = (int) ((blockIdx.x * (size_t) blockDim.x + threadIdx.x) / WARP_SIZE);
    const int lane = threadIdx.x % WARP_SIZE;
    if (r >= n_rows) return;
    const T *p = src + (size_t) r * K;
    float m = 0.0f;
    for (int i = lane; i < K / 4; i += WARP_SIZE) {
        const float4 v = load4(p, i);
        m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    m = warp_max(m);
    float sc, om;
    col_factors(m, &sc, &om);
    if (lane == 0) out_mul[r] = om;
    uint32_t *row = (uint32_t *) (xs + (size_t) r * K);
    for (int i = lane; i < K / 4; i += WARP_SIZE) stage4(row + 2 * i, load4(p, i), sc);
}

// The common body of the wide expert kernels, for block (x, tile) of a matrix of n_tiles
// 16-row tiles and K columns: warp w's rows (tile x*8 + w) against the tile's ncols <= 64
// columns (pair p's row p / row_div of xs, staged by moe_row_stage_kernel, whose output
// factor is out_rows of that row), copied into shared memory WIDE_KC values of K at a time.
// Each decoded A fragment feeds the ceil(ncols / 8) n-tiles' MMAs. The staged values are
// stage_columns' (the same factor, the same f16 rounding) and the products are exact, so a
// column differs from the 8-column kernels' only in the order of its fp32 sums: one MMA chain
// per n-tile here (32 accumulator registers, not tile_mma's two chains' 64), so that two
// blocks fit an SM and one block's staging overlaps the other's MMAs. c[t] holds n-tile t
// (columns 8t..8t+7) in tile_mma's layout.
static __device__ bool wide_tile(float c[WIDE_NT][4], TileOut *o, const uint8_t *q,
                                 const uint8_t *s, const uint16_t *xs, int row_div,
                                 const int32_t *work, const float *out_rows, int n_tiles, int K)
{
    extern __shared__ __align__(16) uint32_t bs[];  // [MOE_WIDE_COLS][stage_words(WIDE_KC)]
    __shared__ float out_mul[MOE_WIDE_COLS];
    __shared__ int pair_of[MOE_WIDE_COLS], row_of[MOE_WIDE_COLS];
    if ((int) blockIdx.y >= work[0]) return false;  // the whole block
    const int32_t *tl = work + 1 + (size_t) blockIdx.y * WIDE_TILE_INTS;
    const int e = tl[0], ncols = tl[1], lane = threadIdx.x % WARP_SIZE, cq = lane % 4;
    const uint8_t *qt, *st;
    uint4 qa[PIPE];
    uint2 sa[PIPE];
    const int rt = warp_rows(q, s, e, n_tiles, K, &qt, &st, qa, sa);
    for (int i = threadIdx.x; i < MOE_WIDE_COLS; i += MMA_THREADS) {
        const int p = tl[2 + (i < ncols ? i : 0)], r = p / row_div;
        pair_of[i] = p;
        row_of[i] = r;
        out_mul[i] = out_rows[r];
    }
#pragma unroll
    for (int t = 0; t < WIDE_NT; t++)
#pragma unroll
        for (int i = 0; i < 4; i++) c[t][i] = 0.0f;
    const int nt = CEIL_DIV(ncols, 8), nks = K / 16, nfull = nks / CHUNK_KS,
              ntail = nks % CHUNK_KS, W = stage_words(WIDE_KC);
    // Lane's column in n-tile t: 8t + lane/4, or column 0 past ncols (its outputs unused).
    int col_off[WIDE_NT];
#pragma unroll
    for (int t = 0; t < WIDE_NT; t++) {
        const int n = 8 * t + lane / 4;
        col_off[t] = (n < ncols ? n : 0) * W + cq;
    }
    for (int k0 = 0; k0 < K; k0 += WIDE_KC) {
        const int kc = K - k0 < WIDE_KC ? K - k0 : WIDE_KC, q8 = kc / 8;  // K in 16s: kc too
        __syncthreads();  // the previous K range's MMAs are done with bs (and row_of is set)
#pragma unroll 4
        for (int i = threadIdx.x; i < ncols * q8; i += MMA_THREADS) {
            const int n = i / q8, kk = i % q8;  // 8 staged values: 16 bytes, 4 words
            *(uint4 *) (bs + n * W + 4 * kk) =
                __ldg((const uint4 *) (xs + (size_t) row_of[n] * K + k0) + kk);
        }
        __syncthreads();
        if (rt >= n_tiles) continue;  // still staging with the block
        const int ch0 = k0 / 64;  // WIDE_KC / 64 == PIPE chunks of this range
        range_mma<WIDE_NT>(c, c, qa, sa, qt, st, ch0, nfull, bs, col_off, nt);  // one chain
        if (k0 + kc == K)  // the tail's k-steps lie in this last range
            for (int j = 0; j < ntail; j++)
                tail_mma<WIDE_NT>(c, qt, st, nfull, ntail, j,
                                  bs + ((nfull - ch0) * CHUNK_KS + j) * 8, col_off, nt);
    }
    *o = TileOut{e, ncols, pair_of, out_mul};
    return rt < n_tiles;
}

// gate/up + SwiGLU over wide tiles (w13_out per n-tile). Two blocks an SM (128 registers).
static __global__ void __launch_bounds__(MMA_THREADS, 2)
    moe_w13_wide_kernel(uint16_t *__restrict__ act, const uint8_t *__restrict__ q13,
                        const uint8_t *__restrict__ s13, const float *__restrict__ g13,
                        const uint16_t *__restrict__ xs, const int32_t *__restrict__ work,
                        const float *__restrict__ out_rows, int k, int hidden, int inter)
{
    KERN_ENTRY();
    float c[WIDE_NT][4];
    TileOut o;
    if (!wide_tile(c, &o, q13, s13, xs, k, work, out_rows, inter / 8, hidden)) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int feat = (blockIdx.x * MMA_WARPS + threadIdx.x / WARP_SIZE) * 8 + lane / 4;
    const float gg = g13[2 * o.e], gu = g13[2 * o.e + 1];
#pragma unroll
    for (int t = 0; t < WIDE_NT; t++) w13_out(act, c[t], &o, 8 * t, feat, gg, gu, inter);
}

// down over wide tiles (w2_out per n-tile). Two blocks an SM.
static __global__ void __launch_bounds__(MMA_THREADS, 2)
    moe_w2_wide_kernel(float *__restrict__ y, const uint8_t *__restrict__ q2,
                       const uint8_t *__restrict__ s2, const float *__restrict__ g2,
                       const uint16_t *__restrict__ xs, const int32_t *__restrict__ work,
                       const float *__restrict__ out_rows, const float *__restrict__ w, int hidden,
                       int inter)
{
    KERN_ENTRY();
    float c[WIDE_NT][4];
    TileOut o;
    if (!wide_tile(c, &o, q2, s2, xs, 1, work, out_rows, hidden / 16, inter)) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = (blockIdx.x * MMA_WARPS + threadIdx.x / WARP_SIZE) * 16 + lane / 4;
    const float ge = g2[o.e];
#pragma unroll
    for (int t = 0; t < WIDE_NT; t++) w2_out(y, c[t], &o, 8 * t, row, ge, w, hidden);
}

// ---------------------------------------------------------------------------
// Expert kernels in bf16 (CUDA cores)

enum {
    BF16_WARPS = 8,
    BF16_THREADS = BF16_WARPS * WARP_SIZE,
    BF16_ROWS = 2,   // weight rows a warp reads together: w13's gate and up of one feature, or
                     // two consecutive rows of w2 (sharing each staged load of the columns)
    BF16_LOADS = 4,  // 16-byte chunks of each row a lane loads ahead: 8 loads in flight
    BF16_UNITS = 2 * BF16_WARPS,  // row pairs (w13: features) of a block, two a warp in turn
};

// The bf16 kernels ask for two blocks an SM (at most 128 registers a thread): without it,
// ptxas (CUDA 13) holds w2 to 80 registers on sm_121a and spills; sm_90a takes ~110 either way.

// Block (x, tile) of a bf16 expert kernel: the tile's expert *e, its ncols pairs (pair_of) and
// their inputs staged in bs as bf16, column n at bs + n*K: pair p's row p / row_div of src, K
// values, fp32 rounded to nearest even as read (load4) or bf16 copied. False for blocks past
// the step's tiles (the whole block). max_cols: the columns bs holds; a tile with more (a
// token taking an expert twice, which moe_route never gives) traps instead of overrunning it.
template <typename T>
static __device__ bool bf16_tile(uint16_t *bs, int *e, int *ncols, int *pair_of, const T *src,
                                 int row_div, const int32_t *work, int K, int max_cols)
{
    __shared__ int row_of[MOE_TILE_COLS];
    if ((int) blockIdx.y >= work[0]) return false;
    const int32_t *tl = work + 1 + (size_t) blockIdx.y * TILE_INTS;
    *e = tl[0];
    *ncols = tl[1];
    if (*ncols > max_cols) __trap();
    if (threadIdx.x < MOE_TILE_COLS) {
        const int p = (int) threadIdx.x < *ncols ? tl[2 + threadIdx.x] : 0;
        pair_of[threadIdx.x] = p;
        row_of[threadIdx.x] = p / row_div;
    }
    __syncthreads();
    const int q = K / 4;
    for (int i = threadIdx.x; i < *ncols * q; i += BF16_THREADS) {
        const int n = i / q, kk = i % q;
        const float4 v = load4(src + (size_t) row_of[n] * K, kk);  // bf16 values: exact below
        *(uint2 *) (bs + (size_t) n * K + 4 * kk) =
            make_uint2(f32_to_bf16_bits(v.x) | (uint32_t) f32_to_bf16_bits(v.y) << 16,
                       f32_to_bf16_bits(v.z) | (uint32_t) f32_to_bf16_bits(v.w) << 16);
    }
    __syncthreads();
    return true;
}

// 8 bf16 (one 16-byte chunk, element 0 in the low half of x) -> fp32, exact.
static __device__ __forceinline__ void bf16x8_to_f32(float f[8], uint4 v)
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 p = bf16x2_bits_to_f32(w[i]);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

// The dot products of BF16_ROWS bf16 weight rows (row[r], K values) with the ncols staged
// columns (bs, bf16_tile's layout), acc[r][n] on every lane, in moe.h's order: lane l takes
// the 8-value chunks l, l + 32, l + 64, ... in ascending order and, within a chunk, the values
// in order, each product (exact: bf16 x bf16) added in fp32 from 0; then warp_sum's butterfly
// over the lanes. A column's operations do not depend on n or ncols, so a pair's sums depend
// on its row alone. Each lane keeps BF16_LOADS chunks of every row in flight.
static __device__ __forceinline__ void bf16_dots(float acc[BF16_ROWS][MOE_TILE_COLS],
                                                 const uint16_t *const row[BF16_ROWS],
                                                 const uint16_t *bs, int ncols, int K)
{
    const int lane = threadIdx.x % WARP_SIZE, nch = K / 8;
#pragma unroll
    for (int r = 0; r < BF16_ROWS; r++)
#pragma unroll
        for (int n = 0; n < MOE_TILE_COLS; n++)
            acc[r][n] = 0.0f;
    for (int c0 = lane; c0 < nch; c0 += BF16_LOADS * WARP_SIZE) {
        uint4 wv[BF16_LOADS][BF16_ROWS];
#pragma unroll
        for (int u = 0; u < BF16_LOADS; u++)
#pragma unroll
            for (int r = 0; r < BF16_ROWS; r++)
                if (c0 + u * WARP_SIZE < nch)
                    wv[u][r] = ld_stream_u4(row[r] + (size_t) 8 * (c0 + u * WARP_SIZE));
#pragma unroll
        for (int u = 0; u < BF16_LOADS; u++) {
            const int c = c0 + u * WARP_SIZE;
            if (c >= nch) break;
            float wf[BF16_ROWS][8];
#pragma unroll
            for (int r = 0; r < BF16_ROWS; r++)
                bf16x8_to_f32(wf[r], wv[u][r]);
#pragma unroll
            for (int n = 0; n < MOE_TILE_COLS; n++) {
                if (n >= ncols) break;
                float xf[8];
                bf16x8_to_f32(xf, *(const uint4 *) (bs + (size_t) n * K + 8 * c));
#pragma unroll
                for (int r = 0; r < BF16_ROWS; r++)
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        acc[r][n] = __fmaf_rn(wf[r][i], xf[i], acc[r][n]);
            }
        }
    }
#pragma unroll
    for (int n = 0; n < MOE_TILE_COLS; n++)
        if (n < ncols)
#pragma unroll
            for (int r = 0; r < BF16_ROWS; r++)
                acc[r][n] = warp_sum(acc[r][n]);
}

// gate/up + SwiGLU. Grid (ceil(inter / BF16_UNITS), max tiles); warp w of block x owns
// features BF16_UNITS x + w and + BF16_WARPS in turn: gate row f and up row inter + f of
// expert e, and lane n writes column n's activation.
static __global__ void __launch_bounds__(BF16_THREADS, 2)
    moe_w13_bf16_kernel(uint16_t *__restrict__ act, const uint16_t *__restrict__ w13,
                        const float *__restrict__ x, const int32_t *__restrict__ work, int k,
                        int hidden, int inter, int max_cols)
{
    KERN_ENTRY();
    extern __shared__ __align__(16) uint32_t bs[];  // [max_cols][hidden] bf16
    __shared__ int pair_of[MOE_TILE_COLS];
    uint16_t *xs = (uint16_t *) bs;
    int e, ncols;
    if (!bf16_tile<float>(xs, &e, &ncols, pair_of, x, k, work, hidden, max_cols)) return;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    for (int i = 0; i < BF16_UNITS / BF16_WARPS; i++) {
        const int f = blockIdx.x * BF16_UNITS + i * BF16_WARPS + warp;
        if (f >= inter) break;
        const uint16_t *gate = w13 + ((size_t) e * 2 * inter + f) * hidden;
        const uint16_t *const row[BF16_ROWS] = {gate, gate + (size_t) inter * hidden};
        float acc[BF16_ROWS][MOE_TILE_COLS];
        bf16_dots(acc, row, xs, ncols, hidden);
#pragma unroll
        for (int n = 0; n < MOE_TILE_COLS; n++)
            if (n < ncols && lane == n)
                act[(size_t) pair_of[n] * inter + f] = swiglu_bf16(acc[0][n], acc[1][n]);
    }
}

// down: y[p, row] = w[p] * down_e(act[p])[row]. Grid (ceil(hidden / (2 BF16_UNITS)), max
// tiles); warp w of block x owns the row pairs BF16_UNITS x + w and + BF16_WARPS in turn.
static __global__ void __launch_bounds__(BF16_THREADS, 2)
    moe_w2_bf16_kernel(float *__restrict__ y, const uint16_t *__restrict__ w2,
                       const uint16_t *__restrict__ act, const int32_t *__restrict__ work,
                       const float *__restrict__ w, int hidden, int inter, int max_cols)
{
    KERN_ENTRY();
    extern __shared__ __align__(16) uint32_t bs[];  // [max_cols][inter] bf16
    __shared__ int pair_of[MOE_TILE_COLS];
    uint16_t *as = (uint16_t *) bs;
    int e, ncols;
    if (!bf16_tile<uint16_t>(as, &e, &ncols, pair_of, act, 1, work, inter, max_cols)) return;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    for (int i = 0; i < BF16_UNITS / BF16_WARPS; i++) {
        const int r0 = BF16_ROWS * (blockIdx.x * BF16_UNITS + i * BF16_WARPS + warp);
        if (r0 >= hidden) break;  // hidden is even: r0 + 1 < hidden
        const uint16_t *w0 = w2 + ((size_t) e * hidden + r0) * inter;
        const uint16_t *const row[BF16_ROWS] = {w0, w0 + inter};
        float acc[BF16_ROWS][MOE_TILE_COLS];
        bf16_dots(acc, row, as, ncols, inter);
#pragma unroll
        for (int n = 0; n < MOE_TILE_COLS; n++)
            if (n < ncols && lane == n) {
                const int p = pair_of[n];
                float *yp = y + (size_t) p * hidden + r0;
#pragma unroll
                for (int r = 0; r < BF16_ROWS; r++)
                    yp[r] = down_weighted(acc[r][n], w[p]);
            }
    }
}

// ---------------------------------------------------------------------------
// Combining a token's outputs

// out[t] = residual[t] + sum over j in slot order of y[t*k + j].
static __global__ void moe_combine_kernel(float *out, const float *__restrict__ y,
                                          const float *residual, int n_tok, int k, int hidden)
{
    KERN_ENTRY();
    const size_t i = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t) n_tok * hidden) return;
    combine_at(out, y, residual, i / hidden, i % hidden, k, hidden);
}

// ---------------------------------------------------------------------------
// Packing

// Code c of an E2M1 nibble (sign, e1, e0, m) in the two bit placements decode_a reads: the
// first four codes of a word at bits 7, 3, 2, 1 of their byte (E5M2), the last four at bits
// 6, 5, 4, 0.
static __device__ uint32_t place_first(uint32_t c, int byte)
{
    return (((c & 8u) << 4) | ((c & 7u) << 1)) << (8 * byte);
}

static __device__ uint32_t place_second(uint32_t c, int byte)
{
    return (((c & 0xeu) << 3) | (c & 1u)) << (8 * byte);
}

// One thread per (tile, k-step, lane) of n_tiles 16-row tiles of a K-column NVFP4 matrix:
// the lane's word, and (lanes 0, 4, ..) its rows' two scales. Tile row i of tile rt is source
// row 16*rt + i, or (split != 0) 8*rt + i for i < 8 and split + 8*rt + i - 8 for the rest
// (gate and up of the same features).
static __global__ void moe_pack_kernel(uint8_t *__restrict__ qo, uint8_t *__restrict__ so,
                                       const uint8_t *__restrict__ q,
                                       const uint8_t *__restrict__ s, int n_tiles, int K,
                                       int split)
{
    KERN_ENTRY();
    const int nks = K / 16, nfull = nks / CHUNK_KS, ntail = nks % CHUNK_KS;
    const size_t i = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t) n_tiles * nks * WARP_SIZE) return;
    const int lane = (int) (i % WARP_SIZE), ks = (int) (i / WARP_SIZE % nks);
    const int rt = (int) (i / WARP_SIZE / nks);
    const int ch = ks / CHUNK_KS, j = ks % CHUNK_KS, nk = ch < nfull ? CHUNK_KS : ntail;
    const int r = lane / 4, cq = lane % 4;
    const size_t rq = (size_t) K / 2, rs = (size_t) K / NVFP4_GROUP;
    const size_t r0 = split ? (size_t) 8 * rt + r : (size_t) 16 * rt + r;
    const size_t r1 = split ? (size_t) split + 8 * rt + r : r0 + 8;
    const int k0 = 16 * ks + 2 * cq;
    uint32_t word = 0;
#pragma unroll
    for (int h = 0; h < 2; h++) {  // columns k0.. (codes 0-3) and k0 + 8.. (codes 4-7)
        const int kc = k0 + 8 * h;
        const uint32_t b0 = q[r0 * rq + kc / 2], b1 = q[r1 * rq + kc / 2];  // kc even
        const uint32_t c[4] = {b0 & 15u, b0 >> 4, b1 & 15u, b1 >> 4};
#pragma unroll
        for (int m = 0; m < 4; m++) word |= h ? place_second(c[m], m) : place_first(c[m], m);
    }
    uint8_t *qt = qo + (size_t) rt * 8 * K, *st = so + (size_t) rt * K;
    *(uint32_t *) (qt + code_at(ch, lane, nk, j)) = word;
    if (cq == 0) {
        uint8_t *sp = st + scale_at(ch, r, nk, j);
        sp[0] = s[r0 * rs + ks];
        sp[1] = s[r1 * rs + ks];
    }
}

static void pack(uint8_t *qo, uint8_t *so, const uint8_t *q, const uint8_t *s, int n_tiles,
                 int K, int split, cudaStream_t stream)
{
    const size_t n = (size_t) n_tiles * (K / 16) * WARP_SIZE;
    kern_launch(moe_pack_kernel, (unsigned) CEIL_DIV(n, 256), 256, 0, stream, qo, so, q, s, n_tiles,
                K, split);
}

void moe_pack_w13(uint8_t *q_out, uint8_t *s_out, const uint8_t *q, const uint8_t *s, int inter,
                  int hidden, cudaStream_t stream)
{
    ASSERT(inter > 0 && inter % 8 == 0 && hidden > 0 && hidden % 16 == 0);
    pack(q_out, s_out, q, s, inter / 8, hidden, inter, stream);
}

void moe_pack_w2(uint8_t *q_out, uint8_t *s_out, const uint8_t *q, const uint8_t *s, int hidden,
                 int inter, cudaStream_t stream)
{
    ASSERT(hidden > 0 && hidden % 16 == 0 && inter > 0 && inter % 16 == 0);
    pack(q_out, s_out, q, s, hidden / 16, inter, 0, stream);
}

// ---------------------------------------------------------------------------
// Launchers

void moe_route(int32_t *idx, float *w, const float *logits, const float *bias, int n_tok,
               int n_experts, int k, int n_group, int topk_group, bool norm_topk_prob,
               float scale, bool is_ascending, cudaStream_t stream)
{
    ASSERT(n_tok > 0 && n_experts > 0 && n_experts <= MOE_MAX_EXPERTS);
    ASSERT(k >= 1 && k <= MOE_MAX_K && k <= n_experts);
    ASSERT(n_group >= 1 && n_group <= MOE_MAX_GROUPS && n_experts % n_group == 0);
    ASSERT(topk_group >= 1 && topk_group <= n_group);
    const int warps = 4;
    if (topk_group == n_group)
        kern_launch(moe_route_rank_kernel, n_tok, ROUTE_RANK_THREADS, 0, stream, idx, w, logits,
                    bias, n_experts, k, norm_topk_prob, scale, is_ascending);
    else
        kern_launch(moe_route_kernel, CEIL_DIV(n_tok, warps), warps * WARP_SIZE, 0, stream, idx, w,
                    logits, bias, n_tok, n_experts, k, n_group, topk_group, norm_topk_prob, scale,
                    is_ascending);
}

bool moe_route_group_ok(int n_tok, int n_experts, int k, int n_group, int topk_group)
{
    return n_group == topk_group && n_tok >= 1 && n_tok <= MOE_ROUTE_GROUP_MAX_TOK
           && k <= MOE_MAX_K
           && (size_t) n_tok * n_experts * 2 * sizeof(double) <= MOE_ROUTE_GROUP_SMEM;
}

void moe_route_group(int32_t *work, int32_t *idx, float *w, const float *logits,
                     const float *bias, int n_tok, int n_experts, int k, bool norm_topk_prob,
                     float scale, bool is_ascending, cudaStream_t stream)
{
    ASSERT(n_experts > 0 && n_experts <= MOE_MAX_EXPERTS && k >= 1 && k <= MOE_MAX_K
           && k <= n_experts);
    ASSERT(moe_route_group_ok(n_tok, n_experts, k, 1, 1));
    kern_launch(moe_route_group_kernel, 1, GROUP_THREADS,
                (size_t) n_tok * n_experts * 2 * sizeof(double), stream, work, idx, w, logits, bias,
                n_tok, n_experts, k, norm_topk_prob, scale, is_ascending);
}

// Tiles of up to cols pairs that n_pairs pairs over n_experts experts can need: each expert
// used ceil(count / cols) <= count / cols + 1.
static int max_tiles(int n_pairs, int n_experts, int cols)
{
    return (n_pairs < n_experts ? n_pairs : n_experts) + n_pairs / cols;
}

// A work list of tiles of up to cols pairs: the tile count and the tiles (2 + cols ints
// each), then (atomic grouping) its counters, 3 * n_experts ints at tile_list_ints.
static size_t tile_list_ints(int n_pairs, int n_experts, int cols)
{
    return 1 + (size_t) max_tiles(n_pairs, n_experts, cols) * (2 + cols);
}

// The three launches of the atomic grouping (moe_count/scan/place_kernel) into work, a list
// of tiles of up to cols pairs with its counters (tile_list_ints).
static void group_atomic(int32_t *work, const int32_t *idx, int n_pairs, int n_experts, int cols,
                         cudaStream_t stream)
{
    int32_t *cnt = work + tile_list_ints(n_pairs, n_experts, cols);
    CUDA_CHECK(cudaMemsetAsync(cnt, 0, (size_t) 2 * n_experts * sizeof *cnt, stream));
    const unsigned blocks = (unsigned) CEIL_DIV(n_pairs, 256);
    kern_launch(moe_count_kernel, blocks, 256, 0, stream, cnt, idx, n_pairs);
    kern_launch(moe_scan_kernel, 1, WARP_SIZE, 0, stream, work, cnt, n_experts, cols);
    kern_launch(moe_place_kernel, blocks, 256, 0, stream, work, cnt, idx, n_pairs, n_experts, cols);
}

// One launch's pairs: n_tok tokens of k slots, at most max_pairs (MOE_MAX_CHUNK_PAIRS, or
// MOE_MAX_WIDE_PAIRS for the wide tiles).
static void check_pairs(int n_tok, int k, int max_pairs = MOE_MAX_CHUNK_PAIRS)
{
    ASSERT(n_tok > 0 && k >= 1 && k <= MOE_MAX_K && (long long) n_tok * k <= max_pairs);
}

size_t moe_work_ints(int n_pairs, int n_experts)
{
    const size_t counters = n_pairs > MOE_MAX_PAIRS ? (size_t) 3 * n_experts : 0;
    return tile_list_ints(n_pairs, n_experts, MOE_TILE_COLS) + counters;
}

void moe_group(int32_t *work, const int32_t *idx, int n_tok, int k, int n_experts,
               cudaStream_t stream)
{
    check_pairs(n_tok, k);
    ASSERT(n_experts > 0 && n_experts <= MOE_MAX_EXPERTS);
    const int n_pairs = n_tok * k;
    if (n_pairs <= MOE_MAX_PAIRS) {
        kern_launch(moe_group_kernel, 1, GROUP_THREADS, 0, stream, work, idx, n_pairs, n_experts);
        return;
    }
    group_atomic(work, idx, n_pairs, n_experts, MOE_TILE_COLS, stream);
}

static void check_experts(const MoeExperts *ex)
{
    ASSERT(ex->n_experts > 0 && ex->n_experts <= MOE_MAX_EXPERTS);
    ASSERT(ex->hidden > 0 && ex->hidden % 16 == 0 && ex->inter > 0 && ex->inter % 16 == 0);
    ASSERT((uintptr_t) ex->q13 % 16 == 0 && (uintptr_t) ex->q2 % 16 == 0);
    ASSERT((uintptr_t) ex->s13 % 8 == 0 && (uintptr_t) ex->s2 % 8 == 0);
}

// Staged columns of one launch: a tile holds distinct tokens, so at most min(n_tok, 8).
static size_t stage_bytes(int n_tok, int K)
{
    return (size_t) (n_tok < MOE_TILE_COLS ? n_tok : MOE_TILE_COLS) * stage_words(K) * 4;
}

size_t moe_experts_smem_bytes(int hidden, int inter)
{
    const size_t a = stage_bytes(MOE_TILE_COLS, hidden), b = stage_bytes(MOE_TILE_COLS, inter);
    return a > b ? a : b;
}

// What both expert launches check and set: kernel's shared-memory limit for n_tok tokens'
// K-long columns (returned) and the grid for a matrix of n_tiles 16-row tiles.
static size_t launch_shape(const void *kernel, const MoeExperts *ex, int n_tok, int k, int K,
                           int n_tiles, dim3 *grid)
{
    check_experts(ex);
    check_pairs(n_tok, k);
    const size_t smem = stage_bytes(n_tok, K);
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int) smem));
    *grid = dim3((unsigned) CEIL_DIV(n_tiles, MMA_WARPS),
                 (unsigned) max_tiles(n_tok * k, ex->n_experts, MOE_TILE_COLS));
    return smem;
}

void moe_experts_w13(uint16_t *act, const MoeExperts *ex, const float *x, const int32_t *work,
                     int n_tok, int k, cudaStream_t stream)
{
    ASSERT((uintptr_t) x % 16 == 0);
    dim3 grid;
    const size_t smem = launch_shape((const void *) moe_w13_kernel, ex, n_tok, k, ex->hidden,
                                     ex->inter / 8, &grid);
    kern_launch(moe_w13_kernel, grid, MMA_THREADS, smem, stream, act, ex->q13, ex->s13, ex->g13, x,
                work, k, ex->hidden, ex->inter);
}

void moe_experts_w2(float *y, const MoeExperts *ex, const uint16_t *act, const int32_t *work,
                    const float *w, int n_tok, int k, cudaStream_t stream)
{
    ASSERT((uintptr_t) act % 8 == 0);
    dim3 grid;
    const size_t smem = launch_shape((const void *) moe_w2_kernel, ex, n_tok, k, ex->inter,
                                     ex->hidden / 16, &grid);
    kern_launch(moe_w2_kernel, grid, MMA_THREADS, smem, stream, y, ex->q2, ex->s2, ex->g2, act,
                work, w, ex->hidden, ex->inter);
}

size_t moe_combine_counters(int hidden)
{
    return (size_t) CEIL_DIV(hidden / 16, MMA_WARPS);
}

void moe_experts_w2_combine(float *out, float *y, const float *residual, int32_t *cnt,
                            const MoeExperts *ex, const uint16_t *act, const int32_t *work,
                            const float *w, int n_tok, int k, cudaStream_t stream)
{
    ASSERT((uintptr_t) act % 8 == 0 && cnt);
    dim3 grid;
    const size_t smem = launch_shape((const void *) moe_w2_combine_kernel, ex, n_tok, k, ex->inter,
                                     ex->hidden / 16, &grid);
    ASSERT(grid.x == moe_combine_counters(ex->hidden));
    kern_launch(moe_w2_combine_kernel, grid, MMA_THREADS, smem, stream, out, y, residual, cnt,
                ex->q2, ex->s2, ex->g2, act, work, w, n_tok, k, ex->hidden, ex->inter);
}

static void check_experts_bf16(const MoeExpertsBf16 *ex)
{
    ASSERT(ex->n_experts > 0 && ex->n_experts <= MOE_MAX_EXPERTS);
    ASSERT(ex->hidden > 0 && ex->hidden % 8 == 0 && ex->inter > 0 && ex->inter % 8 == 0);
    ASSERT((uintptr_t) ex->w13 % 16 == 0 && (uintptr_t) ex->w2 % 16 == 0);
}

// What both bf16 expert launches check and set: kernel's shared-memory limit for n_tok tokens'
// K-long bf16 columns (a tile holds distinct tokens: at most min(n_tok, 8); *max_cols) and the
// grid for n_units row pairs. The limit asked is the launch's own, at most 98,304 bytes at
// GLM's hidden 6144 (GB10 allows 101,376).
static dim3 bf16_launch_shape(const void *kernel, const MoeExpertsBf16 *ex, int n_tok, int k, int K,
                              int n_units, size_t *smem, int *max_cols)
{
    check_experts_bf16(ex);
    check_pairs(n_tok, k);
    *max_cols = n_tok < MOE_TILE_COLS ? n_tok : MOE_TILE_COLS;
    *smem = (size_t) *max_cols * K * sizeof(uint16_t);
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) *smem));
    return dim3((unsigned) CEIL_DIV(n_units, BF16_UNITS),
                (unsigned) max_tiles(n_tok * k, ex->n_experts, MOE_TILE_COLS));
}

void moe_experts_bf16_w13(uint16_t *act, const MoeExpertsBf16 *ex, const float *x,
                          const int32_t *work, int n_tok, int k, cudaStream_t stream)
{
    ASSERT((uintptr_t) x % 16 == 0);
    size_t smem;
    int max_cols;
    const dim3 grid = bf16_launch_shape((const void *) moe_w13_bf16_kernel, ex, n_tok, k,
                                        ex->hidden, ex->inter, &smem, &max_cols);
    kern_launch(moe_w13_bf16_kernel, grid, BF16_THREADS, smem, stream, act, ex->w13, x, work, k,
                ex->hidden, ex->inter, max_cols);
}

void moe_experts_bf16_w2(float *y, const MoeExpertsBf16 *ex, const uint16_t *act,
                         const int32_t *work, const float *w, int n_tok, int k, cudaStream_t stream)
{
    ASSERT((uintptr_t) act % 8 == 0);
    size_t smem;
    int max_cols;
    const dim3 grid = bf16_launch_shape((const void *) moe_w2_bf16_kernel, ex, n_tok, k, ex->inter,
                                        ex->hidden / BF16_ROWS, &smem, &max_cols);
    kern_launch(moe_w2_bf16_kernel, grid, BF16_THREADS, smem, stream, y, ex->w2, act, work, w,
                ex->hidden, ex->inter, max_cols);
}

// The wide work list: tile_list_ints' layout for tiles of MOE_WIDE_COLS with the counters,
// then a float per pair for the rows' output factors (moe_row_stage_kernel: the tokens' for
// w13, the pairs' for w2, in turn), at wide_factors_at, then (16-byte aligned, at
// wide_rows_at) the staged rows: f16 [n_tok, hidden] for w13, [n_pairs, inter] for w2.
static size_t wide_factors_at(int n_pairs, int n_experts)
{
    return tile_list_ints(n_pairs, n_experts, MOE_WIDE_COLS) + (size_t) 3 * n_experts;
}

static size_t wide_rows_at(int n_pairs, int n_experts)
{
    return (wide_factors_at(n_pairs, n_experts) + (size_t) n_pairs + 3) & ~(size_t) 3;
}

size_t moe_wide_work_ints(const MoeExperts *ex, int n_tok, int k)
{
    const size_t n_pairs = (size_t) n_tok * k, w13 = (size_t) n_tok * ex->hidden,
                 w2 = n_pairs * ex->inter;
    return wide_rows_at((int) n_pairs, ex->n_experts) + ((w13 > w2 ? w13 : w2) + 1) / 2;
}

size_t moe_wide_smem_bytes(void)
{
    return (size_t) MOE_WIDE_COLS * stage_words(WIDE_KC) * 4;
}

void moe_group_wide(int32_t *work, const int32_t *idx, int n_tok, int k, int n_experts,
                    cudaStream_t stream)
{
    check_pairs(n_tok, k, MOE_MAX_WIDE_PAIRS);
    ASSERT(n_experts > 0 && n_experts <= MOE_MAX_EXPERTS);
    const int n_pairs = n_tok * k;
    group_atomic(work, idx, n_pairs, n_experts, MOE_WIDE_COLS, stream);
}

// The row factors and staged rows of src [n_rows, K] into the work list, then the grid of a
// wide launch for a matrix of n_tiles 16-row tiles (and the kernel's shared-memory limit).
template <typename T>
static dim3 wide_launch(const void *kernel, const MoeExperts *ex, int32_t *work, const T *src,
                        int n_rows, int K, int n_tok, int k, int n_tiles, uint16_t **xs,
                        float **out_rows, cudaStream_t stream)
{
    check_experts(ex);
    check_pairs(n_tok, k, MOE_MAX_WIDE_PAIRS);
    ASSERT((uintptr_t) work % 16 == 0);
    const int n_pairs = n_tok * k;
    *out_rows = (float *) (work + wide_factors_at(n_pairs, ex->n_experts));
    *xs = (uint16_t *) (work + wide_rows_at(n_pairs, ex->n_experts));
    const unsigned warps_per_block = 8;
    kern_launch(moe_row_stage_kernel<T>, (unsigned) CEIL_DIV(n_rows, (int) warps_per_block),
                warps_per_block * WARP_SIZE, 0, stream, *xs, *out_rows, src, n_rows, K);
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int) moe_wide_smem_bytes()));
    // All of the SM's unified memory as shared where the carveout allows: two blocks an SM.
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    (int) cudaSharedmemCarveoutMaxShared));
    return dim3((unsigned) CEIL_DIV(n_tiles, MMA_WARPS),
                (unsigned) max_tiles(n_pairs, ex->n_experts, MOE_WIDE_COLS));
}

void moe_experts_w13_wide(uint16_t *act, const MoeExperts *ex, const float *x, int32_t *work,
                          int n_tok, int k, cudaStream_t stream)
{
    ASSERT((uintptr_t) x % 16 == 0);
    uint16_t *xs;
    float *out_rows;
    const dim3 grid = wide_launch<float>((const void *) moe_w13_wide_kernel, ex, work, x,
                                         n_tok, ex->hidden, n_tok, k, ex->inter / 8, &xs,
                                         &out_rows, stream);
    kern_launch(moe_w13_wide_kernel, grid, MMA_THREADS, moe_wide_smem_bytes(), stream, act, ex->q13,
                ex->s13, ex->g13, xs, work, out_rows, k, ex->hidden, ex->inter);
}

void moe_experts_w2_wide(float *y, const MoeExperts *ex, const uint16_t *act, int32_t *work,
                         const float *w, int n_tok, int k, cudaStream_t stream)
{
    ASSERT((uintptr_t) act % 8 == 0);
    uint16_t *xs;
    float *out_rows;
    const dim3 grid = wide_launch<uint16_t>((const void *) moe_w2_wide_kernel, ex, work,
                                            act, n_tok * k, ex->inter, n_tok, k, ex->hidden / 16,
                                            &xs, &out_rows, stream);
    kern_launch(moe_w2_wide_kernel, grid, MMA_THREADS, moe_wide_smem_bytes(), stream, y, ex->q2,
                ex->s2, ex->g2, xs, work, out_rows, w, ex->hidden, ex->inter);
}

void moe_combine(float *out, const float *y, const float *residual, int n_tok, int k, int hidden,
                 cudaStream_t stream)
{
    ASSERT(n_tok > 0 && k >= 1 && hidden > 0);
    const size_t n = (size_t) n_tok * hidden;
    kern_launch(moe_combine_kernel, (unsigned) CEIL_DIV(n, 256), 256, 0, stream, out, y, residual,
                n_tok, k, hidden);
}
