/*
 * moe.cu - fused router and NVFP4 routed experts for decode.
 *
 * Router: kernels/moe_router.h's arithmetic (double) with one warp per token. Lane l holds
 * experts l, l+32, ... (at most 16 per lane); group scores and the k selections are warp
 * argmax reductions (value, then lower index), so the result equals the serial code's bit for
 * bit and does not depend on timing. Any expert count up to MOE_MAX_EXPERTS works, incl. 156.
 *
 * w13 (gate+up, SwiGLU fused): grid (inter/16, n_tok*k); a block is 8 warps, each warp owns
 * two output features i, i+1 and reads four rows (gate i, gate i+1, up i, up i+1) of its
 * slot's expert: every x chunk loaded from L1 is reused four times. Lane l reads 16-byte
 * chunks l, l+32, ... (32 codes), two chunks per row in flight. The warp finishes with a
 * butterfly and writes SiLU(g)*u in bf16.
 *
 * w2 (down + weighted sum + residual): grid (hidden/4, n_tok); a block owns 4 output rows of
 * one token, and its warp j walks the token's slots j, j+8, ..., reading 4 rows x inter/32
 * chunks per expert; the act chunk is reused for the 4 rows. The slot weight is applied per
 * chunk; the 8 warps' sums are added in warp order through shared memory, the residual once,
 * and the result written once: no atomics, no second pass, reproducible. (The first version
 * gave each warp all k slots of its rows: 1,536 warps for a token, too few to keep H200's
 * memory system busy; w2 ran at 36% of copy bandwidth against w13's 49%.)
 *
 * Both expert kernels are software-pipelined: a lane issues the loads of its next chunk (and,
 * in w2, of the next expert) before computing the current one. Without it a warp waits a full
 * memory latency per chunk, and the NVFP4 kernels reached only 1.4-1.7 TB/s on H200 while the
 * bf16 GEMV, with 8x less arithmetic per byte, reached 4.2 TB/s (docs/perf.md).
 *
 * Expert ids are read on the device. Two tokens that pick the same expert read its rows
 * twice; at batch <= 16 most of the second reads hit L2.
 */
#include "kernels/moe.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/nvfp4_dev.cuh"

enum { MOE_WARPS = 8 };

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
    const int t = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (t < n_tok)
        route_warp(t, idx, w, logits, bias, n_experts, k, n_group, topk_group, norm_topk_prob,
                   scale, is_ascending);
}

// Without group limits (every group kept: GLM-5's n_group = 1) the same choice by rank, a
// block per token: thread e counts the experts that moe_router_argmax() takes before e
// (larger biased score, or equal and a lower index: a total order without NaNs), so the
// experts of rank < K are exactly the K it takes, rank r the r-th. One pass of E comparisons
// per thread from shared memory instead of K dependent warp-wide argmax rounds. The weights
// sum the chosen experts' scores in ascending expert order, as moe_router_token() does. A
// token with a NaN score (which argmax handles by position) takes route_warp() instead.
enum { ROUTE_RANK_THREADS = 256 };

static __global__ void __launch_bounds__(ROUTE_RANK_THREADS)
    moe_route_rank_kernel(int32_t *__restrict__ idx, float *__restrict__ w,
                          const float *__restrict__ logits, const float *__restrict__ bias,
                          int n_experts, int k, bool norm_topk_prob, float scale, bool is_ascending)
{
    __shared__ double score[MOE_MAX_EXPERTS], choice[MOE_MAX_EXPERTS];
    __shared__ int chosen[MOE_MAX_K];
    const int t = blockIdx.x, tid = threadIdx.x;
    const float *lg = logits + (size_t) t * n_experts;
    bool nan = false;
    for (int e = tid; e < n_experts; e += ROUTE_RANK_THREADS) {
        const double sc = 1.0 / (1.0 + exp(-(double) lg[e]));
        score[e] = sc;
        choice[e] = sc + (bias ? bias[e] : 0.0f);
        nan |= choice[e] != choice[e];
    }
    if (__syncthreads_or(nan)) {
        if (tid < WARP_SIZE)
            route_warp(t, idx, w, logits, bias, n_experts, k, 1, 1, norm_topk_prob, scale,
                       is_ascending);
        return;
    }
    for (int e = tid; e < n_experts; e += ROUTE_RANK_THREADS) {
        const double v = choice[e];
        int rank = 0;
        for (int j = 0; j < n_experts && rank < k; j++) {
            const double u = choice[j];
            rank += u > v || (u == v && j < e);
        }
        if (rank < k) chosen[rank] = e;
    }
    __syncthreads();
    if (tid == 0) {
        int asc[MOE_MAX_K];
        for (int r = 0; r < k; r++) {  // insertion sort of K ids
            int i = r;
            for (; i > 0 && asc[i - 1] > chosen[r]; i--)
                asc[i] = asc[i - 1];
            asc[i] = chosen[r];
        }
        double sum = 0.0;
        for (int r = 0; r < k; r++)
            sum += score[asc[r]];
        for (int r = 0; r < k; r++) {
            const int e = is_ascending ? asc[r] : chosen[r];
            double v = score[e];
            if (norm_topk_prob) v /= sum + 1e-20;
            idx[(size_t) t * k + r] = e;
            w[(size_t) t * k + r] = (float) (v * scale);
        }
    }
}

// ---------------------------------------------------------------------------
// Expert kernels

// Four rows' 16-byte code chunks and their scale pairs: one pipeline step of a lane.
typedef struct Step4 {
    uint4 q[4];
    uint16_t s[4];
} Step4;

static __device__ __forceinline__ void load_step4(Step4 *st, const uint8_t *const *qr,
                                                  const uint16_t *const *sr, int c)
{
#pragma unroll
    for (int r = 0; r < 4; r++) {
        st->q[r] = ld_stream_u4(qr[r] + (size_t) c * 16);
        st->s[r] = __ldg(sr[r] + c);
    }
}

static __device__ __forceinline__ void dot_step4(float *acc, const Step4 *st, const uint16_t *x32,
                                                 float wgt)
{
    float xf[32];
    load_x32(x32, xf);
#pragma unroll
    for (int r = 0; r < 4; r++) acc[r] += wgt * nvfp4_chunk_dot(st->q[r], st->s[r], xf);
}

static __global__ void __launch_bounds__(MOE_WARPS *WARP_SIZE)
    moe_w13_kernel(uint16_t *__restrict__ act, const uint8_t *__restrict__ q13,
                   const uint8_t *__restrict__ s13, const float *__restrict__ g13,
                   const uint16_t *__restrict__ x, const int32_t *__restrict__ idx, int k,
                   int hidden, int inter)
{
    const int lane = threadIdx.x % WARP_SIZE;
    const int i0 = (blockIdx.x * MOE_WARPS + threadIdx.x / WARP_SIZE) * 2;
    const int p = blockIdx.y;  // slot t*k + j
    const int t = p / k;
    if (i0 >= inter) return;
    const int e = idx[p];

    const size_t row_q = hidden / 2, row_s = hidden / NVFP4_GROUP;
    const size_t base = (size_t) e * 2 * inter;
    const int rows[4] = {i0, i0 + 1, inter + i0, inter + i0 + 1};
    const uint8_t *qr[4];
    const uint16_t *sr[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        qr[r] = q13 + (base + rows[r]) * row_q;
        sr[r] = (const uint16_t *) (s13 + (base + rows[r]) * row_s);
    }
    const uint16_t *xt = x + (size_t) t * hidden;

    // Software pipeline: the next chunk's loads are in flight while this one is computed.
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int n_chunks = hidden / 32;
    Step4 a, b;
    if (lane < n_chunks) load_step4(&a, qr, sr, lane);
    for (int c = lane; c < n_chunks; c += 2 * WARP_SIZE) {
        const int c1 = c + WARP_SIZE, c2 = c + 2 * WARP_SIZE;
        if (c1 < n_chunks) load_step4(&b, qr, sr, c1);
        dot_step4(acc, &a, xt + (size_t) c * 32, 1.0f);
        if (c1 < n_chunks) {
            if (c2 < n_chunks) load_step4(&a, qr, sr, c2);
            dot_step4(acc, &b, xt + (size_t) c1 * 32, 1.0f);
        }
    }
    float v[4];
#pragma unroll
    for (int r = 0; r < 4; r++) v[r] = warp_sum(acc[r]);
    if (lane < 2) {
        const float g = (lane ? v[1] : v[0]) * g13[2 * e];
        const float u = (lane ? v[3] : v[2]) * g13[2 * e + 1];
        act[(size_t) p * inter + i0 + lane] = f32_to_bf16_bits(g / (1.0f + expf(-g)) * u);
    }
}

// Rows r0..r0+3 of expert e's down projection.
static __device__ __forceinline__ void w2_rows(const uint8_t **qr, const uint16_t **sr,
                                               const uint8_t *q2, const uint8_t *s2, int e,
                                               int r0, int hidden, int inter)
{
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const size_t row = (size_t) e * hidden + r0 + r;
        qr[r] = q2 + row * (inter / 2);
        sr[r] = (const uint16_t *) (s2 + row * (inter / NVFP4_GROUP));
    }
}

static __global__ void __launch_bounds__(MOE_WARPS *WARP_SIZE)
    moe_w2_kernel(float *out, const uint8_t *__restrict__ q2, const uint8_t *__restrict__ s2,
                  const float *__restrict__ g2, const uint16_t *__restrict__ act,
                  const int32_t *__restrict__ idx, const float *__restrict__ w,
                  const float *residual, int k, int hidden, int inter)
{
    __shared__ float part[MOE_WARPS][4];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int r0 = blockIdx.x * 4;
    const int t = blockIdx.y;
    const int n_chunks = inter / 32;
    // Warp `warp` takes slots warp, warp + MOE_WARPS, ... of the block's 4 rows; this lane's
    // chunks of one expert are lane, lane+32, ...; steps run over (slot, chunk) so that the
    // next slot's loads are already in flight while the last chunk of a slot is computed. The
    // slot weight is applied per chunk (the sum is linear), so one warp reduction at the end
    // serves all of the warp's slots.
    const int per = lane < n_chunks ? (n_chunks - lane + WARP_SIZE - 1) / WARP_SIZE : 0;
    const int my_k = warp < k ? (k - warp + MOE_WARPS - 1) / MOE_WARPS : 0;
    const int n_steps = per * my_k;

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const uint8_t *qr[4];
    const uint16_t *sr[4];
    Step4 a, b;
    if (n_steps > 0) {
        w2_rows(qr, sr, q2, s2, idx[t * k + warp], r0, hidden, inter);
        load_step4(&a, qr, sr, lane);
    }
    for (int st = 0; st < n_steps; st += 2) {
        const int j0 = warp + (st / per) * MOE_WARPS, c0 = lane + (st % per) * WARP_SIZE;
        const int j1 = warp + ((st + 1) / per) * MOE_WARPS, c1 = lane + ((st + 1) % per) * WARP_SIZE;
        const int j2 = warp + ((st + 2) / per) * MOE_WARPS, c2 = lane + ((st + 2) % per) * WARP_SIZE;
        if (st + 1 < n_steps) {
            w2_rows(qr, sr, q2, s2, idx[t * k + j1], r0, hidden, inter);
            load_step4(&b, qr, sr, c1);
        }
        const int p0 = t * k + j0;
        dot_step4(acc, &a, act + (size_t) p0 * inter + (size_t) c0 * 32, w[p0] * g2[idx[p0]]);
        if (st + 1 < n_steps) {
            if (st + 2 < n_steps) {
                w2_rows(qr, sr, q2, s2, idx[t * k + j2], r0, hidden, inter);
                load_step4(&a, qr, sr, c2);
            }
            const int p1 = t * k + j1;
            dot_step4(acc, &b, act + (size_t) p1 * inter + (size_t) c1 * 32, w[p1] * g2[idx[p1]]);
        }
    }
    float v[4];
#pragma unroll
    for (int r = 0; r < 4; r++) v[r] = warp_sum(acc[r]);
    if (lane < 4) part[warp][lane] = lane == 0 ? v[0] : lane == 1 ? v[1] : lane == 2 ? v[2] : v[3];
    __syncthreads();
    if (warp == 0 && lane < 4) {
        // Fixed order over the warps: the result does not depend on timing.
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < MOE_WARPS; i++) sum += part[i][lane];
        const size_t o = (size_t) t * hidden + r0 + lane;
        out[o] = residual ? residual[o] + sum : sum;
    }
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
        moe_route_rank_kernel<<<n_tok, ROUTE_RANK_THREADS, 0, stream>>>(
            idx, w, logits, bias, n_experts, k, norm_topk_prob, scale, is_ascending);
    else
        moe_route_kernel<<<CEIL_DIV(n_tok, warps), warps * WARP_SIZE, 0, stream>>>(
            idx, w, logits, bias, n_tok, n_experts, k, n_group, topk_group, norm_topk_prob, scale,
            is_ascending);
    CUDA_CHECK(cudaGetLastError());
}

static void check_experts(const MoeExperts *ex)
{
    ASSERT(ex->n_experts > 0 && ex->hidden > 0 && ex->inter > 0);
    ASSERT(ex->hidden % 32 == 0 && ex->inter % 32 == 0 && ex->hidden % 4 == 0);
    ASSERT((uintptr_t) ex->q13 % 16 == 0 && (uintptr_t) ex->q2 % 16 == 0);
    ASSERT((uintptr_t) ex->s13 % 2 == 0 && (uintptr_t) ex->s2 % 2 == 0);
}

void moe_experts_w13(uint16_t *act, const MoeExperts *ex, const uint16_t *x, const int32_t *idx,
                     int n_tok, int k, cudaStream_t stream)
{
    check_experts(ex);
    ASSERT(n_tok > 0 && k >= 1 && k <= MOE_MAX_K && (uintptr_t) x % 16 == 0);
    ASSERT(ex->inter % 2 == 0);
    const dim3 grid((unsigned) CEIL_DIV(ex->inter, 2 * MOE_WARPS), (unsigned) (n_tok * k));
    moe_w13_kernel<<<grid, MOE_WARPS * WARP_SIZE, 0, stream>>>(act, ex->q13, ex->s13, ex->g13, x,
                                                               idx, k, ex->hidden, ex->inter);
    CUDA_CHECK(cudaGetLastError());
}

void moe_experts_w2(float *out, const MoeExperts *ex, const uint16_t *act, const int32_t *idx,
                    const float *w, const float *residual, int n_tok, int k,
                    cudaStream_t stream)
{
    check_experts(ex);
    ASSERT(n_tok > 0 && k >= 1 && k <= MOE_MAX_K && (uintptr_t) act % 16 == 0);
    const dim3 grid((unsigned) (ex->hidden / 4), (unsigned) n_tok);
    moe_w2_kernel<<<grid, MOE_WARPS * WARP_SIZE, 0, stream>>>(out, ex->q2, ex->s2, ex->g2, act,
                                                              idx, w, residual, k, ex->hidden,
                                                              ex->inter);
    CUDA_CHECK(cudaGetLastError());
}
