/*
 * bench_stage.cu - decode and prefill throughput of one GLM-5.2-REAP pipeline stage on one GPU,
 * with synthetic weights generated on the device.
 *
 * Model dimensions (GLM-5.2-NVFP4-REAP-469B's config.json): hidden 6144, 64 heads, q_lora 2048, kv_lora 512,
 * rope 64, nope 192, v 256, 156 routed experts x 2048 (top-8) + 1 shared expert, dense MLP
 * 12288. A stage is 26 layers, the first 3 dense. Precision mix of the real checkpoint:
 * routed experts NVFP4; attention, router, shared expert and dense MLP bf16; fp8 MLA cache.
 *
 * Decode step (per layer, batch B at context C): RMSNorm; fused q_a+kv_a GEMV; q_a RMSNorm;
 * then two graph branches: (1) cache append (kv_a RMSNorm, RoPE, fp8) and, with DSA on and on
 * the layers that run their own indexer (GLM-5.2 IndexShare: 0, 1, 2, 6, 10, ... - 8 of a
 * stage's 26), the indexer: wk and weights_proj GEMVs, key LayerNorm + RoPE + fp8 append,
 * wq_b GEMV, query RoPE, scores over all C positions, top-2048; (2) q_b GEMV; q split + RoPE;
 * per-head W_UK^T GEMV. Then split-KV absorbed MLA attention over the C positions (DSA off) or
 * over the 2048 selected by the most recent indexer layer (DSA on); per-head W_UV GEMV; o_proj
 * GEMV + residual; RMSNorm; then two branches again: (1) router GEMV + fused top-8, routed
 * gate/up + SwiGLU; (2) shared gate/up GEMV, SwiGLU, shared down + residual; then routed down
 * + weighted sum + residual (MoE layers), or the dense MLP. The whole step (26 layers) is
 * captured in one CUDA graph and replayed; the weights (~88 GB) are far larger than L2, so every
 * replay streams them from HBM. The single-stream graph (fork 0) is timed too.
 *
 * Reported: ms/step, tok/s, bytes read per step by category (routed experts counted per
 * distinct expert actually selected), achieved GB/s and its % of a device-to-device copy
 * measured in the same run, at 1K / 32K / 128K context with DSA off and on; the MTP verify
 * step (one sequence, 1+k rows attending causally to the same cache, k = 1..3, at 1K and 32K,
 * rows routed (a) independently or (b) reusing the previous row's experts with probability
 * 1/2) with its cost ratio to one row and the projected speed-up (1 + a + ... + a^k) / ratio;
 * a per-op breakdown (each op replayed over all layers in its own graph); prefill tok/s for the
 * stage's linear layers (cuBLASLt; NVFP4 experts dequantized to bf16 first) and its TFLOP/s vs
 * an 8192^3 cuBLAS bf16 GEMM measured in the same run.
 * Not included: MLA prefill attention (no flash-MLA prefill kernel yet), embedding and lm_head
 * (they are not part of a middle stage), the MTP draft layer's own cost.
 *
 * Usage: bench_stage [--json PATH] [--layers N] [--iters N] [--quick] [--dsa-only]
 * (--dsa-only: only the DSA decode rows, the MTP section and the DSA per-op tables)
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/cuda_check.h"
#include "kernels/act.h"
#include "kernels/common.cuh"
#include "kernels/dsa.h"
#include "kernels/gemm.h"
#include "kernels/mla.h"
#include "kernels/moe.h"
#include "kernels/norm.h"
#include "kernels/nvfp4.h"
#include "kernels/rope.h"

enum {
    HID = 6144,
    NH = 64,
    QLORA = 2048,
    NOPE = 192,
    VDIM = 256,
    QHEAD = 256,
    NEXP = 156,
    NEXP_PAD = 160,  // router rows allocated (cuBLASLt wants N % 8 == 0 in prefill)
    INTER = 2048,
    TOPK = 8,
    DENSE_INTER = 12288,
    QKV_A = QLORA + MLA_LK,
    MAX_B = 16,
    LONG_B = 8,  // sequences that can run past the short context (page budget)
    N_DENSE = 3,
    IDX_HEADS = 32,
    IDX_TOPK = 2048,
};

static const float EPS = 1e-5f, THETA = 8e6f, ROUTE_SCALE = 2.5f;

// ---------------------------------------------------------------------------
// Synthetic weights

static __device__ uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// bf16 uniform in [-amp, amp).
static __global__ void fill_bf16_kernel(uint16_t *p, size_t n, uint64_t seed, float amp)
{
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        const float u = (float) (mix64(seed ^ (i * 0x100000001b3ull)) >> 40) / 16777216.0f;
        p[i] = f32_to_bf16_bits((2.0f * u - 1.0f) * amp);
    }
}

// Random bytes (E2M1 codes), or E4M3 scales in [2^-2, 2^2) when is_scale.
static __global__ void fill_u8_kernel(uint8_t *p, size_t n, uint64_t seed, int is_scale)
{
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n / 8; i += (size_t) gridDim.x * blockDim.x) {
        uint64_t r = mix64(seed ^ (i * 0x100000001b3ull));
        if (is_scale) r = (r & 0x0f0f0f0f0f0f0f0full) | 0x2828282828282828ull;  // exp 5..6, any mantissa
        ((uint64_t *) p)[i] = r;
    }
}

// fp32 uniform in [-amp, amp): distinct inputs per token, so that tokens route differently.
static __global__ void fill_f32_rand_kernel(float *p, size_t n, uint64_t seed, float amp)
{
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        const float u = (float) (mix64(seed ^ (i * 0x100000001b3ull)) >> 40) / 16777216.0f;
        p[i] = (2.0f * u - 1.0f) * amp;
    }
}

// The copy ceiling: 16-byte loads and stores, grid-stride, as a bandwidth-bound kernel does.
static __global__ void copy_kernel(uint4 *__restrict__ dst, const uint4 *__restrict__ src, size_t n)
{
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x)
        dst[i] = src[i];
}

static __global__ void fill_f32_kernel(float *p, size_t n, float v)
{
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) p[i] = v;
}

static uint64_t g_seed = 1;

static void *dalloc(size_t n)
{
    void *p = NULL;
    CUDA_CHECK(cudaMalloc(&p, n));
    return p;
}

static uint16_t *new_bf16(size_t n, float amp)
{
    uint16_t *p = (uint16_t *) dalloc(n * 2);
    fill_bf16_kernel<<<4096, 256>>>(p, n, g_seed++ * 0x51ed27, amp);
    CUDA_CHECK(cudaGetLastError());
    return p;
}

static uint8_t *new_u8(size_t n, int is_scale)
{
    uint8_t *p = (uint8_t *) dalloc(n);
    fill_u8_kernel<<<4096, 256>>>(p, n, g_seed++ * 0x51ed27, is_scale);
    CUDA_CHECK(cudaGetLastError());
    return p;
}

static float *new_f32(size_t n, float v)
{
    float *p = (float *) dalloc(n * 4);
    fill_f32_kernel<<<1024, 256>>>(p, n, v);
    CUDA_CHECK(cudaGetLastError());
    return p;
}

typedef struct Layer {
    int id, dense;
    int full;          // runs its own DSA indexer (GLM-5.2 IndexShare: layers 0, 1, 2, 6, 10, ...)
    uint16_t *qkv_a;   // [2624, 6144]
    uint16_t *q_b;     // [16384, 2048]
    uint16_t *kv_b;    // [64*448, 512]: W_UK^T [64, 512, 192] then W_UV [64, 256, 512] in decode
    uint16_t *o_proj;  // [6144, 16384]
    float *norm_in, *norm_post, *q_norm, *kv_norm;
    uint16_t *router;  // [160, 6144]
    float *bias;       // [160]
    MoeExperts ex;
    uint16_t *sh13, *sh2;  // shared expert [4096, 6144], [6144, 2048]
    uint16_t *d13, *d2;    // dense MLP [24576, 6144], [6144, 12288]
    MlaCache cache;
    int32_t *idx;  // [MAX_B, 8] routing result of the last step
    float *wts;
    // DSA indexer (full layers): wq_b [4096, 2048], wk [128, 6144], weights_proj [32, 6144],
    // k_norm LayerNorm, fp8 key cache; the selection [MAX_B, 2048] and its counts [MAX_B].
    uint16_t *iwq, *iwk, *iwp;
    float *iln_w, *iln_b;
    uint8_t *icache;
    int32_t *sel, *n_sel;
    const int32_t *use_sel, *use_n_sel;  // the selection this layer attends (its own or shared)
} Layer;

// ---------------------------------------------------------------------------
// Decode

typedef struct Work {
    float *h, *h0, *qkv, *q, *q_pe, *q_lat, *logits, *sgu, *ws_o, *ws_ml;
    uint16_t *xb, *qr, *q_nope, *o_lat, *ov, *act, *sact;
    float *iq, *ik, *iw, *scores;  // indexer query [B, 32, 128], key [B, 128], weights [B, 32]
    int32_t *pos, *seq, *kv_len, *table;
    int max_blocks, max_ctx;
    int ctx;          // context of the current configuration (host copy of kv_len's maximum)
    int dsa;          // attention through the DSA indexer's top-2048 selection
    int route_share;  // MTP verify model (b): a row reuses the previous row's experts w.p. 0.5
    int fork;         // independent chains on two streams (graph branches)
    int tc;           // bf16 GEMVs through tensor cores at 2+ tokens
    int n_split;
    cudaStream_t side;
    cudaEvent_t ev_fork, ev_join;
} Work;

typedef enum Op {
    OP_NORM_IN, OP_QKV_A, OP_Q_NORM, OP_KV_APPEND, OP_IDX_K, OP_IDX_W, OP_IDX_APPEND, OP_IDX_Q,
    OP_IDX_ROPE, OP_IDX_SCORE, OP_IDX_TOPK, OP_Q_B, OP_Q_SPLIT, OP_W_UK, OP_ATTN, OP_W_UV,
    OP_O_PROJ, OP_NORM_POST, OP_ROUTER, OP_ROUTE, OP_ROUTE_SHARE, OP_W13, OP_SH13, OP_SH_ACT,
    OP_SH2, OP_W2, OP_D13, OP_D_ACT, OP_D2, N_OPS
} Op;

static const char *op_name[N_OPS] = {
    "norm_in", "qkv_a gemv", "q_a norm", "kv append", "idx wk gemv", "idx wproj gemv",
    "idx key append", "idx wq_b gemv", "idx q rope", "idx scores", "idx top2048", "q_b gemv",
    "q split+rope", "W_UK^T gemv", "mla attention", "W_UV gemv", "o_proj gemv+res", "norm_post",
    "router gemv", "route top8", "route share", "experts w13+act", "shared w13", "shared act",
    "shared w2+res", "experts w2+sum", "dense w13", "dense act", "dense w2+res"};

static int op_applies(Op op, const Layer *L, const Work *w)
{
    if (op >= OP_IDX_K && op <= OP_IDX_TOPK) return w->dsa && L->full;
    if (op == OP_ROUTE_SHARE) return !L->dense && w->route_share;
    if (op >= OP_ROUTER && op <= OP_W2) return !L->dense;
    if (op >= OP_D13) return L->dense;
    return 1;
}

// MTP verify model (b): row i > 0 takes row i-1's expert in slot j with probability 1/2 (a
// fixed hash per layer, row and slot) unless row i already has it. One thread: rows <= 16.
static __global__ void route_share_kernel(int32_t *idx, int n_rows, int k, uint64_t seed)
{
    for (int i = 1; i < n_rows; i++) {
        for (int j = 0; j < k; j++) {
            if (mix64(seed ^ (uint64_t) (i * 64 + j)) & 1) continue;
            const int e = idx[(i - 1) * k + j];
            int dup = 0;
            for (int jj = 0; jj < k; jj++) dup |= idx[i * k + jj] == e;
            if (!dup) idx[i * k + j] = e;
        }
    }
}

// bf16 GEMV: through tensor cores at 2+ tokens when there are enough 8-row CTAs to fill the
// chip twice (w->tc), else the CUDA-core kernel.
static void gemv(const Work *w, void *y, GemmOut yt, const uint16_t *W, const uint16_t *x,
                 const float *res, int rows, int cols, int n_mat, int B, cudaStream_t s)
{
    if (w->tc && B >= 2 && (long) n_mat * ((rows + 7) / 8) >= 2 * 132)
        gemm_bf16_gemv_tc(y, yt, W, x, res, rows, cols, n_mat, B, s);
    else
        gemm_bf16_gemv(y, yt, W, x, res, rows, cols, n_mat, B, s);
}

static void run_op(Op op, Layer *L, Work *w, int B, cudaStream_t s)
{
    switch (op) {
    case OP_NORM_IN: norm_rms(w->xb, w->h, L->norm_in, EPS, B, HID, HID, HID, s); break;
    case OP_QKV_A: gemv(w, w->qkv, GEMM_OUT_F32, L->qkv_a, w->xb, NULL, QKV_A, HID, 1, B, s); break;
    case OP_Q_NORM: norm_rms(w->qr, w->qkv, L->q_norm, EPS, B, QLORA, QKV_A, QLORA, s); break;
    case OP_KV_APPEND:
        mla_cache_append(&L->cache, w->qkv + QLORA, QKV_A, L->kv_norm, EPS, THETA, w->pos, w->seq,
                         w->table, w->max_blocks, B, s);
        break;
    case OP_IDX_K: gemv(w, w->ik, GEMM_OUT_F32, L->iwk, w->xb, NULL, DSA_DIM, HID, 1, B, s); break;
    case OP_IDX_W: gemv(w, w->iw, GEMM_OUT_F32, L->iwp, w->xb, NULL, IDX_HEADS, HID, 1, B, s); break;
    case OP_IDX_APPEND:
        dsa_cache_append(L->icache, w->ik, L->iln_w, L->iln_b, 1e-6f, THETA, w->pos, w->seq, w->table,
                         w->max_blocks, B, s);
        break;
    case OP_IDX_Q:
        gemv(w, w->iq, GEMM_OUT_F32, L->iwq, w->qr, NULL, IDX_HEADS * DSA_DIM, QLORA, 1, B, s);
        break;
    case OP_IDX_ROPE: rope_interleaved(w->iq, w->pos, B, IDX_HEADS, DSA_DIM, 0, DSA_ROPE, THETA, s); break;
    case OP_IDX_SCORE:
        dsa_scores(w->scores, w->max_ctx, w->iq, w->iw, 1.0f / sqrtf((float) IDX_HEADS),
                   1.0f / sqrtf((float) DSA_DIM), L->icache, w->table, w->max_blocks, w->seq,
                   w->kv_len, w->ctx, B, IDX_HEADS, s);
        break;
    case OP_IDX_TOPK: dsa_topk(L->sel, L->n_sel, w->scores, w->max_ctx, w->kv_len, B, IDX_TOPK, s); break;
    case OP_Q_B: gemv(w, w->q, GEMM_OUT_F32, L->q_b, w->qr, NULL, NH * QHEAD, QLORA, 1, B, s); break;
    case OP_Q_SPLIT: mla_q_split(w->q_nope, w->q_pe, w->q, w->pos, B, NH, THETA, s); break;
    case OP_W_UK: gemv(w, w->q_lat, GEMM_OUT_F32, L->kv_b, w->q_nope, NULL, MLA_KV_LORA, NOPE, NH, B, s); break;
    case OP_ATTN:
        mla_decode(w->o_lat, w->q_lat, w->q_pe, &L->cache, w->table, w->max_blocks, w->seq,
                   w->dsa ? L->use_n_sel : w->kv_len, w->dsa ? L->use_sel : NULL, IDX_TOPK, B, NH,
                   1.0f / 16.0f, w->n_split, w->ws_o, w->ws_ml, s);
        break;
    case OP_W_UV:
        gemv(w, w->ov, GEMM_OUT_BF16, L->kv_b + (size_t) NH * MLA_KV_LORA * NOPE, w->o_lat,
                       NULL, VDIM, MLA_KV_LORA, NH, B, s);
        break;
    case OP_O_PROJ: gemv(w, w->h, GEMM_OUT_F32, L->o_proj, w->ov, w->h, HID, NH * VDIM, 1, B, s); break;
    case OP_NORM_POST: norm_rms(w->xb, w->h, L->norm_post, EPS, B, HID, HID, HID, s); break;
    case OP_ROUTER: gemv(w, w->logits, GEMM_OUT_F32, L->router, w->xb, NULL, NEXP, HID, 1, B, s); break;
    case OP_ROUTE: moe_route(L->idx, L->wts, w->logits, L->bias, B, NEXP, TOPK, 1, 1, true, ROUTE_SCALE, false, s); break;
    case OP_ROUTE_SHARE:
        route_share_kernel<<<1, 1, 0, s>>>(L->idx, B, TOPK, (uint64_t) L->id);
        CUDA_CHECK(cudaGetLastError());
        break;
    case OP_W13: moe_experts_w13(w->act, &L->ex, w->xb, L->idx, B, TOPK, s); break;
    case OP_SH13: gemv(w, w->sgu, GEMM_OUT_F32, L->sh13, w->xb, NULL, 2 * INTER, HID, 1, B, s); break;
    case OP_SH_ACT: act_silu_mul(w->sact, w->sgu, B, INTER, s); break;
    case OP_W2: moe_experts_w2(w->h, &L->ex, w->act, L->idx, L->wts, w->h, B, TOPK, s); break;
    case OP_SH2: gemv(w, w->h, GEMM_OUT_F32, L->sh2, w->sact, w->h, HID, INTER, 1, B, s); break;
    case OP_D13: gemv(w, w->sgu, GEMM_OUT_F32, L->d13, w->xb, NULL, 2 * DENSE_INTER, HID, 1, B, s); break;
    case OP_D_ACT: act_silu_mul(w->sact, w->sgu, B, DENSE_INTER, s); break;
    case OP_D2: gemv(w, w->h, GEMM_OUT_F32, L->d2, w->sact, w->h, HID, DENSE_INTER, 1, B, s); break;
    default: break;
    }
}

// Positions attended per token: the whole context, or the top-2048 selection with DSA.
static int attended(const Work *w)
{
    return w->dsa && w->ctx > IDX_TOPK ? IDX_TOPK : w->ctx;
}

// Weight (and cache) bytes one op reads in one layer; distinct = distinct routed experts.
static double op_bytes(Op op, const Work *w, int B, double distinct)
{
    const double nv = 0.5625;  // NVFP4 bytes per weight
    switch (op) {
    case OP_QKV_A: return 2.0 * QKV_A * HID;
    case OP_IDX_K: return 2.0 * DSA_DIM * HID;
    case OP_IDX_W: return 2.0 * IDX_HEADS * HID;
    case OP_IDX_Q: return 2.0 * IDX_HEADS * DSA_DIM * QLORA;
    case OP_IDX_SCORE: return (double) B * w->ctx * (DSA_DIM + 4);
    case OP_Q_B: return 2.0 * NH * QHEAD * QLORA;
    case OP_W_UK: return 2.0 * NH * MLA_KV_LORA * NOPE;
    case OP_W_UV: return 2.0 * NH * VDIM * MLA_KV_LORA;
    case OP_O_PROJ: return 2.0 * HID * NH * VDIM;
    case OP_ATTN: return (double) B * attended(w) * MLA_FP8_TOKEN_BYTES;
    case OP_ROUTER: return 2.0 * NEXP * HID;
    case OP_W13: return distinct * nv * 2 * INTER * HID;
    case OP_W2: return distinct * nv * HID * INTER;
    case OP_SH13: return 2.0 * 2 * INTER * HID;
    case OP_SH2: return 2.0 * HID * INTER;
    case OP_D13: return 2.0 * 2 * DENSE_INTER * HID;
    case OP_D2: return 2.0 * HID * DENSE_INTER;
    default: return 0.0;
    }
}

// Byte category of an op: 0 attention weights (incl. indexer), 1 routed experts, 2 shared
// expert + router, 3 dense MLP, 4 caches (MLA latent and indexer keys).
static int op_category(Op op)
{
    if (op == OP_ATTN || op == OP_IDX_SCORE) return 4;
    if (op == OP_W13 || op == OP_W2) return 1;
    if (op == OP_SH13 || op == OP_SH2 || op == OP_ROUTER) return 2;
    if (op >= OP_D13) return 3;
    return 0;
}

static void run_ops(Layer *L, Work *w, int B, Op first, Op last, cudaStream_t s)
{
    for (int op = first; op <= last; op++)
        if (op_applies((Op) op, L, w)) run_op((Op) op, L, w, B, s);
}

// Two independent chains: a on the main stream, b on the side stream, joined afterwards. In a
// captured graph they become parallel branches, so the small latency-bound kernels of one
// chain overlap the bandwidth-bound GEMVs of the other.
static void run_fork(Layer *L, Work *w, int B, Op a0, Op a1, Op b0, Op b1, cudaStream_t s)
{
    if (!w->fork) {
        run_ops(L, w, B, a0, a1, s);
        run_ops(L, w, B, b0, b1, s);
        return;
    }
    CUDA_CHECK(cudaEventRecord(w->ev_fork, s));
    CUDA_CHECK(cudaStreamWaitEvent(w->side, w->ev_fork, 0));
    run_ops(L, w, B, b0, b1, w->side);
    run_ops(L, w, B, a0, a1, s);
    CUDA_CHECK(cudaEventRecord(w->ev_join, w->side));
    CUDA_CHECK(cudaStreamWaitEvent(s, w->ev_join, 0));
}

static void enqueue_step(Layer *layers, int n_layers, Work *w, int B, cudaStream_t s)
{
    CUDA_CHECK(cudaMemcpyAsync(w->h, w->h0, (size_t) B * HID * 4, cudaMemcpyDeviceToDevice, s));
    for (int l = 0; l < n_layers; l++) {
        Layer *L = &layers[l];
        run_ops(L, w, B, OP_NORM_IN, OP_Q_NORM, s);
        // Cache append and indexer | q_b, q split, W_UK.
        run_fork(L, w, B, OP_KV_APPEND, OP_IDX_TOPK, OP_Q_B, OP_W_UK, s);
        run_ops(L, w, B, OP_ATTN, OP_NORM_POST, s);
        if (L->dense) {
            run_ops(L, w, B, OP_D13, OP_D2, s);
            continue;
        }
        // Router, routed gate/up | shared expert (its down projection adds into h); then the
        // routed down projection adds into h.
        run_fork(L, w, B, OP_ROUTER, OP_W13, OP_SH13, OP_SH2, s);
        run_ops(L, w, B, OP_W2, OP_W2, s);
    }
}

static int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *) a, y = *(const float *) b;
    return (x > y) - (x < y);
}

// Median milliseconds of `iters` replays of a graph (after 2 warm-up replays).
static float time_graph(cudaGraphExec_t g, int iters, cudaStream_t s)
{
    float t[64];
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 2; i++) CUDA_CHECK(cudaGraphLaunch(g, s));
    if (iters > 64) iters = 64;
    for (int i = 0; i < iters; i++) {
        CUDA_CHECK(cudaEventRecord(a, s));
        CUDA_CHECK(cudaGraphLaunch(g, s));
        CUDA_CHECK(cudaEventRecord(b, s));
        CUDA_CHECK(cudaEventSynchronize(b));
        CUDA_CHECK(cudaEventElapsedTime(&t[i], a, b));
    }
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
    qsort(t, (size_t) iters, sizeof t[0], cmp_float);
    return t[iters / 2];
}

static cudaGraphExec_t capture_begin_end(cudaStream_t s, cudaGraph_t *graph)
{
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamEndCapture(s, graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, *graph, 0));
    return exec;
}

static int choose_split(int B, int len)
{
    // About four CTAs per SM (H = 64 heads = 4 CTAs per token and split), at least one
    // 16-position tile per split; the per-op section also times other split counts.
    int n = (528 + 4 * B - 1) / (4 * B);
    const int by_len = (len + 15) / 16;
    if (n > by_len) n = by_len;
    if (n > MLA_MAX_SPLIT) n = MLA_MAX_SPLIT;
    return n < 1 ? 1 : n;
}

// Configure B rows at context ctx. mtp = 0: B independent sequences, each at position ctx-1.
// mtp = 1: one sequence verifying B = 1+k tokens: row i sits at position ctx-B+i and attends
// causally to positions 0 .. ctx-B+i (the cache and the earlier rows of this step).
static void set_rows(Work *w, int B, int ctx, int dsa, int fork, int tc, int mtp)
{
    int32_t hp[MAX_B], hl[MAX_B], hs[MAX_B];
    for (int b = 0; b < MAX_B; b++) {
        hp[b] = mtp ? ctx - B + (b < B ? b : B - 1) : ctx - 1;
        hl[b] = hp[b] + 1;
        hs[b] = mtp ? 0 : b;
    }
    CUDA_CHECK(cudaMemcpy(w->pos, hp, sizeof hp, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(w->kv_len, hl, sizeof hl, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(w->seq, hs, sizeof hs, cudaMemcpyHostToDevice));
    w->ctx = ctx;
    w->dsa = dsa;
    w->fork = fork;
    w->tc = tc;
    w->n_split = choose_split(B, attended(w));
}

// Median ms of one decode step of B rows, as one graph (a warm-up step runs eagerly first).
static float time_step(Layer *layers, int n_layers, Work *w, int B, int iters, cudaStream_t s)
{
    cudaGraph_t graph;
    enqueue_step(layers, n_layers, w, B, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    enqueue_step(layers, n_layers, w, B, s);
    cudaGraphExec_t ge = capture_begin_end(s, &graph);
    const float ms = time_graph(ge, iters, s);
    CUDA_CHECK(cudaGraphExecDestroy(ge));
    CUDA_CHECK(cudaGraphDestroy(graph));
    return ms;
}

// Distinct routed experts per MoE layer in the last step's routing of B rows.
static double count_distinct(const Layer *layers, int n_layers, int B)
{
    double distinct = 0.0;
    int n_moe = 0;
    for (int l = 0; l < n_layers; l++) {
        if (layers[l].dense) continue;
        int32_t idx[MAX_B * TOPK];
        CUDA_CHECK(cudaMemcpy(idx, layers[l].idx, (size_t) B * TOPK * 4, cudaMemcpyDeviceToHost));
        char seen[NEXP];
        memset(seen, 0, sizeof seen);
        for (int i = 0; i < B * TOPK; i++)
            if (idx[i] >= 0 && idx[i] < NEXP && !seen[idx[i]]) seen[idx[i]] = 1, distinct++;
        n_moe++;
    }
    return n_moe ? distinct / n_moe : 0.0;
}

// Bytes one step reads, by op_category; returns the total.
static double step_bytes(const Layer *layers, int n_layers, const Work *w, int B, double distinct,
                         double cat[5])
{
    for (int c = 0; c < 5; c++) cat[c] = 0.0;
    for (int l = 0; l < n_layers; l++)
        for (int op = 0; op < N_OPS; op++)
            if (op_applies((Op) op, &layers[l], w)) cat[op_category((Op) op)] += op_bytes((Op) op, w, B, distinct);
    return cat[0] + cat[1] + cat[2] + cat[3] + cat[4];
}

// ---------------------------------------------------------------------------
// Prefill (linear layers of one layer at m tokens)

typedef struct Prefill {
    uint16_t *x, *y, *a, *wbuf;  // bf16 [m, 16384], [m, 28672], [m, 12288], dequant staging
    float *h, *f;                // fp32 [m, 6144], [m, 24576]
} Prefill;

static double prefill_layer(Layer *L, Prefill *p, int m, GemmLt *lt, cudaStream_t s)
{
    double flops = 0.0;
#define GEMM(Y, YT, X, W, M, N, K)                                     \
    do {                                                               \
        gemm_bf16_lt((Y), (YT), (X), (W), (M), (N), (K), lt, s);       \
        flops += 2.0 * (double) (M) * (N) * (K);                       \
    } while (0)
    norm_rms(p->x, p->h, L->norm_in, EPS, m, HID, HID, HID, s);
    GEMM(p->y, GEMM_OUT_BF16, p->x, L->qkv_a, m, QKV_A, HID);
    GEMM(p->y, GEMM_OUT_BF16, p->x, L->q_b, m, NH * QHEAD, QLORA);
    GEMM(p->y, GEMM_OUT_BF16, p->x, L->kv_b, m, NH * (NOPE + VDIM), MLA_KV_LORA);
    GEMM(p->f, GEMM_OUT_F32, p->x, L->o_proj, m, HID, NH * VDIM);
    norm_rms(p->x, p->h, L->norm_post, EPS, m, HID, HID, HID, s);
    if (L->dense) {
        GEMM(p->f, GEMM_OUT_F32, p->x, L->d13, m, 2 * DENSE_INTER, HID);
        act_silu_mul(p->a, p->f, m, DENSE_INTER, s);
        GEMM(p->f, GEMM_OUT_F32, p->a, L->d2, m, HID, DENSE_INTER);
        return flops;
    }
    GEMM(p->f, GEMM_OUT_F32, p->x, L->router, m, NEXP_PAD, HID);
    GEMM(p->f, GEMM_OUT_F32, p->x, L->sh13, m, 2 * INTER, HID);
    act_silu_mul(p->a, p->f, m, INTER, s);
    GEMM(p->f, GEMM_OUT_F32, p->a, L->sh2, m, HID, INTER);
    // Routed experts: tokens spread evenly (m*8 slots over 156 experts), already grouped.
    const long slots = (long) m * TOPK;
    for (int e = 0; e < NEXP; e++) {
        const int me = (int) (slots / NEXP + (e < slots % NEXP));
        if (me == 0) continue;
        const size_t q13 = (size_t) e * 2 * INTER * HID, q2 = (size_t) e * HID * INTER;
        const Nvfp4Matrix w13 = {L->ex.q13 + q13 / 2, L->ex.s13 + q13 / 16, 0.01f, 2 * INTER, HID};
        const Nvfp4Matrix w2 = {L->ex.q2 + q2 / 2, L->ex.s2 + q2 / 16, 0.01f, HID, INTER};
        nvfp4_dequant_bf16(p->wbuf, &w13, s);
        GEMM(p->f, GEMM_OUT_F32, p->x, p->wbuf, me, 2 * INTER, HID);
        act_silu_mul(p->a, p->f, me, INTER, s);
        nvfp4_dequant_bf16(p->wbuf, &w2, s);
        GEMM(p->f, GEMM_OUT_F32, p->a, p->wbuf, me, HID, INTER);
    }
#undef GEMM
    return flops;
}

// ---------------------------------------------------------------------------
// Main

int main(int argc, char **argv)
{
    const char *json_path = NULL;
    int n_layers = 26, iters = 20, quick = 0, dsa_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) n_layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--dsa-only")) dsa_only = 1;
        else {
            fprintf(stderr, "usage: bench_stage [--json PATH] [--layers N] [--iters N] [--quick] [--dsa-only]\n");
            return 2;
        }
    }
    if (n_layers < 1 || n_layers > 78) n_layers = 26;
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB, %.0f GB\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20, prop.totalGlobalMem / 1e9);

    // Ceilings measured in this run: device-to-device copy and a large bf16 GEMM.
    const size_t copy_bytes = (size_t) 2 << 30;
    void *ca = dalloc(copy_bytes), *cb = dalloc(copy_bytes);
    CUDA_CHECK(cudaMemset(ca, 1, copy_bytes));
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    copy_kernel<<<prop.multiProcessorCount * 8, 512, 0, s>>>((uint4 *) cb, (const uint4 *) ca, copy_bytes / 16);
    cudaGraphExec_t ge = capture_begin_end(s, &graph);
    const float copy_ms = time_graph(ge, 10, s);
    const double copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
    CUDA_CHECK(cudaGraphExecDestroy(ge));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CUDA_CHECK(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, s));
    ge = capture_begin_end(s, &graph);
    const float memcpy_ms = time_graph(ge, 10, s);
    const double memcpy_gbs = 2.0 * copy_bytes / (memcpy_ms * 1e-3) / 1e9;
    CUDA_CHECK(cudaGraphExecDestroy(ge));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaFree(ca));
    CUDA_CHECK(cudaFree(cb));
    printf("copy bandwidth (2 GiB device-to-device, read+write): %.0f GB/s by kernel (the reference "
           "below), %.0f GB/s by cudaMemcpyAsync in a graph\n", copy_gbs, memcpy_gbs);

    GemmLt lt;
    memset(&lt, 0, sizeof lt);
    gemm_lt_init(&lt);
    const int gn = 8192;
    uint16_t *ga = new_bf16((size_t) gn * gn, 1.0f), *gb = new_bf16((size_t) gn * gn, 1.0f);
    uint16_t *gc = (uint16_t *) dalloc((size_t) gn * gn * 2);
    float gt[10];
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < 13; i++) {
        CUDA_CHECK(cudaEventRecord(e0, s));
        gemm_bf16_lt(gc, GEMM_OUT_BF16, ga, gb, gn, gn, gn, &lt, s);
        CUDA_CHECK(cudaEventRecord(e1, s));
        CUDA_CHECK(cudaEventSynchronize(e1));
        if (i >= 3) CUDA_CHECK(cudaEventElapsedTime(&gt[i - 3], e0, e1));
    }
    qsort(gt, 10, sizeof gt[0], cmp_float);
    const double gemm_tflops = 2.0 * gn * (double) gn * gn / (gt[5] * 1e-3) / 1e12;
    printf("cuBLAS bf16 GEMM %d^3: %.0f TFLOP/s\n", gn, gemm_tflops);
    CUDA_CHECK(cudaFree(ga));
    CUDA_CHECK(cudaFree(gb));
    CUDA_CHECK(cudaFree(gc));

    // Weights. Pages: position block j of sequence b is page b*short_blocks + j for the first
    // short_ctx positions; beyond (only the first LONG_B sequences go there) page
    // MAX_B*short_blocks + b*(max_blocks - short_blocks) + j - short_blocks.
    const int short_ctx = quick ? 4096 : 32768, long_ctx = quick ? 8192 : 131072;
    Work w;
    memset(&w, 0, sizeof w);
    w.max_ctx = long_ctx;
    w.max_blocks = long_ctx / MLA_BLOCK;
    const int short_blocks = short_ctx / MLA_BLOCK;
    const int n_pages = MAX_B * short_blocks + LONG_B * (w.max_blocks - short_blocks);
    Layer *layers = (Layer *) calloc((size_t) n_layers, sizeof(Layer));
    double weight_bytes = 0.0;
    for (int l = 0; l < n_layers; l++) {
        Layer *L = &layers[l];
        L->id = l;
        L->dense = l < N_DENSE;
        L->full = l < 3 || (l - 2) % 4 == 0;
        const float a6144 = 1.7f / sqrtf(6144.0f);
        L->qkv_a = new_bf16((size_t) QKV_A * HID, a6144);
        L->q_b = new_bf16((size_t) NH * QHEAD * QLORA, 1.7f / sqrtf(2048.0f));
        L->kv_b = new_bf16((size_t) NH * (NOPE + VDIM) * MLA_KV_LORA, 1.7f / sqrtf(512.0f));
        L->o_proj = new_bf16((size_t) HID * NH * VDIM, 1.7f / sqrtf(16384.0f));
        L->norm_in = new_f32(HID, 1.0f);
        L->norm_post = new_f32(HID, 1.0f);
        L->q_norm = new_f32(QLORA, 1.0f);
        L->kv_norm = new_f32(MLA_KV_LORA, 1.0f);
        weight_bytes += 2.0 * ((double) QKV_A * HID + (double) NH * QHEAD * QLORA
                               + (double) NH * (NOPE + VDIM) * MLA_KV_LORA + (double) HID * NH * VDIM);
        if (L->full) {
            L->iwq = new_bf16((size_t) IDX_HEADS * DSA_DIM * QLORA, 1.7f / sqrtf(2048.0f));
            L->iwk = new_bf16((size_t) DSA_DIM * HID, a6144);
            L->iwp = new_bf16((size_t) IDX_HEADS * HID, a6144);
            L->iln_w = new_f32(DSA_DIM, 1.0f);
            L->iln_b = new_f32(DSA_DIM, 0.0f);
            L->icache = new_u8((size_t) n_pages * DSA_BLOCK_BYTES, 1);
            L->sel = (int32_t *) dalloc((size_t) MAX_B * IDX_TOPK * 4);
            L->n_sel = (int32_t *) dalloc(MAX_B * 4);
            weight_bytes += 2.0 * ((double) IDX_HEADS * DSA_DIM * QLORA + (double) (DSA_DIM + IDX_HEADS) * HID);
        }
        L->use_sel = L->full ? L->sel : layers[l - 1].use_sel;
        L->use_n_sel = L->full ? L->n_sel : layers[l - 1].use_n_sel;
        if (L->dense) {
            L->d13 = new_bf16((size_t) 2 * DENSE_INTER * HID, a6144);
            L->d2 = new_bf16((size_t) HID * DENSE_INTER, 1.7f / sqrtf(12288.0f));
            weight_bytes += 2.0 * 3 * DENSE_INTER * (double) HID;
        } else {
            L->router = new_bf16((size_t) NEXP_PAD * HID, a6144);
            L->bias = new_f32(NEXP_PAD, 0.0f);
            const size_t n13 = (size_t) NEXP * 2 * INTER * HID, n2 = (size_t) NEXP * HID * INTER;
            L->ex.q13 = new_u8(n13 / 2, 0);
            L->ex.s13 = new_u8(n13 / 16, 1);
            L->ex.q2 = new_u8(n2 / 2, 0);
            L->ex.s2 = new_u8(n2 / 16, 1);
            L->ex.g13 = new_f32(2 * NEXP, 0.3f / sqrtf(6144.0f));
            L->ex.g2 = new_f32(NEXP, 0.3f / sqrtf(2048.0f));
            L->ex.n_experts = NEXP;
            L->ex.hidden = HID;
            L->ex.inter = INTER;
            L->sh13 = new_bf16((size_t) 2 * INTER * HID, a6144);
            L->sh2 = new_bf16((size_t) HID * INTER, 1.7f / sqrtf(2048.0f));
            L->idx = (int32_t *) dalloc(MAX_B * TOPK * 4);
            L->wts = (float *) dalloc(MAX_B * TOPK * 4);
            weight_bytes += 0.5625 * (double) (n13 + n2) + 2.0 * 3 * INTER * (double) HID + 2.0 * NEXP * HID;
        }
        L->cache.type = MLA_CACHE_FP8;
        L->cache.n_blocks = n_pages;
        L->cache.data = new_u8((size_t) n_pages * MLA_BLOCK * MLA_FP8_TOKEN_BYTES, 1);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    int n_full = 0;
    for (int l = 0; l < n_layers; l++) n_full += layers[l].full;
    printf("stage: %d layers (%d dense, %d with their own DSA indexer), %.1f GB of weights in device memory\n",
           n_layers, n_layers < N_DENSE ? n_layers : N_DENSE, n_full, weight_bytes / 1e9);

    // Decode work buffers.
    w.h = (float *) dalloc(MAX_B * HID * 4);
    w.h0 = (float *) dalloc(MAX_B * HID * 4);
    fill_f32_rand_kernel<<<64, 256>>>(w.h0, MAX_B * HID, 12345, 1.0f);
    CUDA_CHECK(cudaGetLastError());
    w.xb = (uint16_t *) dalloc(MAX_B * HID * 2);
    w.qkv = (float *) dalloc(MAX_B * QKV_A * 4);
    w.qr = (uint16_t *) dalloc(MAX_B * QLORA * 2);
    w.q = (float *) dalloc((size_t) MAX_B * NH * QHEAD * 4);
    w.q_nope = (uint16_t *) dalloc((size_t) MAX_B * NH * NOPE * 2);
    w.q_pe = (float *) dalloc((size_t) MAX_B * NH * MLA_ROPE * 4);
    w.q_lat = (float *) dalloc((size_t) MAX_B * NH * MLA_KV_LORA * 4);
    w.o_lat = (uint16_t *) dalloc((size_t) MAX_B * NH * MLA_KV_LORA * 2);
    w.ov = (uint16_t *) dalloc((size_t) MAX_B * NH * VDIM * 2);
    w.logits = (float *) dalloc(MAX_B * NEXP_PAD * 4);
    w.act = (uint16_t *) dalloc((size_t) MAX_B * TOPK * INTER * 2);
    w.sgu = (float *) dalloc((size_t) MAX_B * 2 * DENSE_INTER * 4);
    w.sact = (uint16_t *) dalloc((size_t) MAX_B * DENSE_INTER * 2);
    w.ws_o = (float *) dalloc((size_t) MAX_B * MLA_MAX_SPLIT * NH * MLA_KV_LORA * 4);
    w.ws_ml = (float *) dalloc((size_t) MAX_B * MLA_MAX_SPLIT * NH * 2 * 4);
    w.iq = (float *) dalloc((size_t) MAX_B * IDX_HEADS * DSA_DIM * 4);
    w.ik = (float *) dalloc((size_t) MAX_B * DSA_DIM * 4);
    w.iw = (float *) dalloc((size_t) MAX_B * IDX_HEADS * 4);
    w.scores = (float *) dalloc((size_t) MAX_B * w.max_ctx * 4);
    int32_t *h_table = (int32_t *) calloc((size_t) MAX_B * w.max_blocks, 4);
    for (int b = 0; b < MAX_B; b++)
        for (int j = 0; j < w.max_blocks; j++)
            h_table[b * w.max_blocks + j] =
                j < short_blocks ? b * short_blocks + j
                : b < LONG_B     ? MAX_B * short_blocks + b * (w.max_blocks - short_blocks) + j - short_blocks
                                 : 0;
    w.table = (int32_t *) dalloc((size_t) MAX_B * w.max_blocks * 4);
    CUDA_CHECK(cudaMemcpy(w.table, h_table, (size_t) MAX_B * w.max_blocks * 4, cudaMemcpyHostToDevice));
    free(h_table);
    w.seq = (int32_t *) dalloc(MAX_B * 4);
    w.pos = (int32_t *) dalloc(MAX_B * 4);
    w.kv_len = (int32_t *) dalloc(MAX_B * 4);
    CUDA_CHECK(cudaStreamCreateWithFlags(&w.side, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&w.ev_fork, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&w.ev_join, cudaEventDisableTiming));

    FILE *js = json_path ? fopen(json_path, "w") : NULL;
    if (js)
        fprintf(js, "{\n  \"device\": \"%s\", \"sms\": %d, \"copy_gbs\": %.1f, \"memcpy_gbs\": %.1f, \"cublas_bf16_tflops\": %.1f,\n"
                    "  \"layers\": %d, \"weight_gb\": %.2f,\n  \"decode\": [\n",
                prop.name, prop.multiProcessorCount, copy_gbs, memcpy_gbs, gemm_tflops, n_layers, weight_bytes / 1e9);

    // Decode sweeps: {ctx, batch, dsa, fork, tc}. fork 0 = every op on one stream; tc 0 = the
    // CUDA-core bf16 GEMV at every batch: {1024, 8, 0, 0, 0} is the previous graph exactly.
    const int cfg[][5] = {
        {1024, 1, 0, 1, 1}, {1024, 2, 0, 1, 1}, {1024, 4, 0, 1, 1}, {1024, 8, 0, 1, 1},
        {1024, 16, 0, 1, 1}, {1024, 1, 0, 0, 1}, {1024, 8, 0, 0, 0}, {1024, 8, 0, 1, 0},
        {short_ctx, 1, 0, 1, 1}, {short_ctx, 8, 0, 1, 1}, {short_ctx, 16, 0, 1, 1},
        {long_ctx, 1, 0, 1, 1}, {1024, 1, 1, 1, 1}, {1024, 8, 1, 1, 1}, {short_ctx, 1, 1, 1, 1},
        {short_ctx, 8, 1, 1, 1}, {long_ctx, 1, 1, 1, 1}, {long_ctx, 8, 1, 1, 1}};
    const int n_cfg = (int) (sizeof cfg / sizeof cfg[0]);
    double ms_of[sizeof cfg / sizeof cfg[0]], gb_of[sizeof cfg / sizeof cfg[0]];
    printf("\ndecode, one graph per step (%d layers):\n", n_layers);
    printf("%6s %5s %3s %4s %3s %5s %8s %8s %8s %8s %6s | GB/step: %6s %6s %6s %6s %6s\n", "ctx", "batch",
           "dsa", "fork", "tc", "split", "ms/step", "tok/s", "GB/step", "GB/s", "%copy", "attn", "routed",
           "shared", "dense", "kv");
    int first_row = 1;
    for (int c = 0; c < n_cfg; c++) {
        ms_of[c] = gb_of[c] = 0.0;
        if (dsa_only && !cfg[c][2]) continue;
        const int ctx = cfg[c][0], B = cfg[c][1];
        set_rows(&w, B, ctx, cfg[c][2], cfg[c][3], cfg[c][4], 0);
        const float ms = time_step(layers, n_layers, &w, B, iters, s);
        const double avg_distinct = count_distinct(layers, n_layers, B);
        double cat[5];
        const double total = step_bytes(layers, n_layers, &w, B, avg_distinct, cat);
        const double gbs = total / (ms * 1e-3) / 1e9;
        const double tps = B / (ms * 1e-3);
        ms_of[c] = ms;
        gb_of[c] = total;
        printf("%6d %5d %3d %4d %3d %5d %8.3f %8.1f %8.2f %8.0f %5.1f%% | %15.2f %6.2f %6.2f %6.2f %6.2f  (distinct experts/layer %.1f)\n",
               ctx, B, w.dsa, w.fork, w.tc, w.n_split, ms, tps, total / 1e9, gbs, 100.0 * gbs / copy_gbs,
               cat[0] / 1e9, cat[1] / 1e9, cat[2] / 1e9, cat[3] / 1e9, cat[4] / 1e9, avg_distinct);
        if (js)
            fprintf(js, "%s    {\"ctx\": %d, \"batch\": %d, \"dsa\": %d, \"fork\": %d, \"tc\": %d, \"split\": %d, \"ms_per_step\": %.4f, "
                        "\"tok_s\": %.2f, \"gb_per_step\": %.4f, \"gbs\": %.1f, \"pct_copy\": %.2f, \"gb_attn_w\": %.4f, "
                        "\"gb_routed\": %.4f, \"gb_shared_router\": %.4f, \"gb_dense\": %.4f, \"gb_kv\": %.4f, "
                        "\"distinct_experts\": %.2f}",
                    first_row ? "" : ",\n", ctx, B, w.dsa, w.fork, w.tc, w.n_split, ms, tps, total / 1e9, gbs,
                    100.0 * gbs / copy_gbs, cat[0] / 1e9, cat[1] / 1e9, cat[2] / 1e9, cat[3] / 1e9,
                    cat[4] / 1e9, avg_distinct);
        first_row = 0;
    }
    // Ratios the targets ask for (indices into cfg above).
    if (!dsa_only) printf("batch 8 / batch 1 tok/s at 1K: %.2fx measured; byte-model cap at equal bandwidth "
           "8 x %.2f / %.2f GB = %.2fx\n", 8.0 * ms_of[0] / ms_of[3], gb_of[0] / 1e9, gb_of[3] / 1e9,
           8.0 * gb_of[0] / gb_of[3]);
    if (!dsa_only)
        printf("at 1K: batch 1 two-branch graph %.3f ms vs one stream %.3f ms; batch 8 %.3f ms vs "
           "CUDA-core GEMVs %.3f ms vs one stream + CUDA-core GEMVs (the previous graph) %.3f ms\n",
           ms_of[0], ms_of[5], ms_of[3], ms_of[7], ms_of[6]);
    printf("DSA on, batch 1: 1K %.3f ms, %dK %.3f ms, %dK %.3f ms: long / 1K = %.2fx (dense %dK: %.3f ms)\n",
           ms_of[12], short_ctx / 1024, ms_of[14], long_ctx / 1024, ms_of[16], ms_of[16] / ms_of[12],
           long_ctx / 1024, ms_of[11]);  // dense long context: 0 with --dsa-only

    // MTP verify step: one sequence, 1+k rows attending causally to the same cache, DSA on;
    // (a) every row routed independently, (b) a row reuses the previous row's experts w.p. 1/2.
    if (js) fprintf(js, "\n  ],\n  \"mtp\": [\n");
    printf("\nMTP verify step, batch 1, DSA on: cost of 1+k rows vs 1 row, projected speed-up "
           "(1 + a + ... + a^k) / cost ratio\n");
    printf("%6s %2s %-28s %8s %6s %8s | %6s %6s %6s %6s\n", "ctx", "k", "routing", "ms/step", "ratio",
           "distinct", "a=0.6", "a=0.7", "a=0.8", "a=0.9");
    first_row = 1;
    const int mtp_ctx[2] = {1024, short_ctx};
    for (int ci = 0; ci < 2; ci++) {
        set_rows(&w, 1, mtp_ctx[ci], 1, 1, 1, 1);
        const float base = time_step(layers, n_layers, &w, 1, iters, s);
        printf("%6d %2d %-28s %8.3f %6.3f %8.1f |\n", mtp_ctx[ci], 0, "(one token)", base, 1.0,
               count_distinct(layers, n_layers, 1));
        for (int share = 0; share < 2; share++) {
            for (int k = 1; k <= 3; k++) {
                set_rows(&w, 1 + k, mtp_ctx[ci], 1, 1, 1, 1);
                w.route_share = share;
                const float ms = time_step(layers, n_layers, &w, 1 + k, iters, s);
                const double d = count_distinct(layers, n_layers, 1 + k);
                w.route_share = 0;
                const double ratio = ms / base;
                double sp[4];
                for (int a = 0; a < 4; a++) {
                    const double acc = 0.6 + 0.1 * a;
                    double e = 0.0, p = 1.0;
                    for (int j = 0; j <= k; j++, p *= acc) e += p;
                    sp[a] = e / ratio;
                }
                const char *mode = share ? "(b) share prev w.p. 0.5" : "(a) independent per row";
                printf("%6d %2d %-28s %8.3f %6.3f %8.1f | %6.2f %6.2f %6.2f %6.2f\n", mtp_ctx[ci], k, mode,
                       ms, ratio, d, sp[0], sp[1], sp[2], sp[3]);
                if (js)
                    fprintf(js, "%s    {\"ctx\": %d, \"k\": %d, \"routing\": \"%s\", \"ms_per_step\": %.4f, "
                                "\"ms_one_token\": %.4f, \"cost_ratio\": %.4f, \"distinct_experts\": %.2f, "
                                "\"speedup_a06\": %.3f, \"speedup_a07\": %.3f, \"speedup_a08\": %.3f, \"speedup_a09\": %.3f}",
                            first_row ? "" : ",\n", mtp_ctx[ci], k, share ? "b" : "a", ms, base, ratio, d,
                            sp[0], sp[1], sp[2], sp[3]);
                first_row = 0;
            }
        }
    }

    // Per-op breakdown: {batch, ctx, dsa}.
    if (js) fprintf(js, "\n  ],\n  \"ops\": [\n");
    first_row = 1;
    const int op_cfg[4][3] = {{1, 1024, 0}, {8, 1024, 0}, {1, short_ctx, 1}, {1, long_ctx, 1}};
    for (int k = dsa_only ? 2 : 0; k < 4; k++) {
        const int B = op_cfg[k][0], ctx = op_cfg[k][1];
        set_rows(&w, B, ctx, op_cfg[k][2], 0, 1, 0);
        enqueue_step(layers, n_layers, &w, B, s);
        CUDA_CHECK(cudaStreamSynchronize(s));
        const double avg_distinct = count_distinct(layers, n_layers, B);
        printf("\nper-op, batch %d, ctx %d, dsa %d (each op replayed over its layers in one graph):\n", B, ctx, w.dsa);
        printf("%-18s %8s %10s %8s %7s\n", "op", "us/layer", "MB/layer", "GB/s", "%copy");
        double sum_us = 0.0;
        for (int op = 0; op < N_OPS; op++) {
            int n_app = 0;
            CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            for (int l = 0; l < n_layers; l++)
                if (op_applies((Op) op, &layers[l], &w)) run_op((Op) op, &layers[l], &w, B, s), n_app++;
            ge = capture_begin_end(s, &graph);
            const float ms = n_app ? time_graph(ge, iters, s) : 0.0f;
            CUDA_CHECK(cudaGraphExecDestroy(ge));
            CUDA_CHECK(cudaGraphDestroy(graph));
            if (!n_app) continue;
            const double us = 1e3 * ms / n_app;
            const double by = op_bytes((Op) op, &w, B, avg_distinct);
            const double gbs = by / (us * 1e-6) / 1e9;
            sum_us += us * n_app;
            printf("%-18s %8.1f %10.2f %8.0f %6.1f%%\n", op_name[op], us, by / 1e6, gbs, 100.0 * gbs / copy_gbs);
            if (js)
                fprintf(js, "%s    {\"batch\": %d, \"ctx\": %d, \"dsa\": %d, \"op\": \"%s\", \"layers\": %d, \"us_per_layer\": %.2f, "
                            "\"mb_per_layer\": %.3f, \"gbs\": %.1f}",
                        first_row ? "" : ",\n", B, ctx, w.dsa, op_name[op], n_app, us, by / 1e6, gbs);
            first_row = 0;
        }
        printf("%-18s %8.1f ms per step if run back to back\n", "sum of ops", sum_us / 1e3);
        const int alt[4] = {1, 4, 16, 64};
        const int keep_split = w.n_split;
        for (int a = 0; a < 4; a++) {
            w.n_split = alt[a];
            CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            for (int l = 0; l < n_layers; l++) run_op(OP_ATTN, &layers[l], &w, B, s);
            ge = capture_begin_end(s, &graph);
            const float ms = time_graph(ge, iters, s);
            CUDA_CHECK(cudaGraphExecDestroy(ge));
            CUDA_CHECK(cudaGraphDestroy(graph));
            printf("  mla attention with %2d splits: %8.1f us/layer\n", alt[a], 1e3 * ms / n_layers);
            if (js)
                fprintf(js, ",\n    {\"batch\": %d, \"ctx\": %d, \"dsa\": %d, \"op\": \"mla attention split %d\", \"us_per_layer\": %.2f}",
                        B, ctx, w.dsa, alt[a], 1e3 * ms / n_layers);
        }
        w.n_split = keep_split;
    }

    // Prefill.
    if (js) fprintf(js, "\n  ],\n  \"prefill\": [\n");
    first_row = 1;
    const int pm[2] = {2048, 8192};
    Prefill p;
    p.x = new_bf16((size_t) 8192 * NH * VDIM, 0.5f);
    p.y = (uint16_t *) dalloc((size_t) 8192 * NH * (NOPE + VDIM) * 2);
    p.a = new_bf16((size_t) 8192 * DENSE_INTER, 0.5f);
    p.wbuf = (uint16_t *) dalloc((size_t) 2 * INTER * HID * 2);
    p.h = new_f32((size_t) 8192 * HID, 0.5f);
    p.f = (float *) dalloc((size_t) 8192 * 2 * DENSE_INTER * 4);
    printf("\nprefill, linear layers only (MLA prefill attention not included):\n");
    printf("%6s %10s %10s %10s %10s %8s\n", "tokens", "ms/stage", "tok/s", "TFLOP", "TFLOP/s", "%cuBLAS");
    for (int k = 0; k < (dsa_only ? 0 : 2); k++) {
        const int m = pm[k];
        double t_layer[2] = {0, 0}, f_layer[2] = {0, 0};
        for (int kind = 0; kind < 2; kind++) {  // 0 = dense layer 0, 1 = MoE layer (last)
            Layer *L = &layers[kind ? n_layers - 1 : 0];
            if (kind == 1 && L->dense) continue;
            float t[5];
            for (int r = 0; r < 5; r++) {
                CUDA_CHECK(cudaEventRecord(e0, s));
                f_layer[kind] = prefill_layer(L, &p, m, &lt, s);
                CUDA_CHECK(cudaEventRecord(e1, s));
                CUDA_CHECK(cudaEventSynchronize(e1));
                CUDA_CHECK(cudaEventElapsedTime(&t[r], e0, e1));
            }
            qsort(t, 5, sizeof t[0], cmp_float);
            t_layer[kind] = t[2];
        }
        const int n_dense = n_layers < N_DENSE ? n_layers : N_DENSE, n_moe = n_layers - n_dense;
        const double ms = n_dense * t_layer[0] + n_moe * t_layer[1];
        const double fl = n_dense * f_layer[0] + n_moe * f_layer[1];
        const double tfs = fl / (ms * 1e-3) / 1e12;
        printf("%6d %10.1f %10.0f %10.1f %10.1f %7.1f%%   (dense layer %.2f ms, MoE layer %.2f ms)\n", m, ms,
               m / (ms * 1e-3), fl / 1e12, tfs, 100.0 * tfs / gemm_tflops, t_layer[0], t_layer[1]);
        if (js)
            fprintf(js, "%s    {\"tokens\": %d, \"ms_per_stage\": %.3f, \"tok_s\": %.1f, \"tflop\": %.3f, "
                        "\"tflops\": %.1f, \"pct_cublas\": %.2f, \"ms_dense_layer\": %.3f, \"ms_moe_layer\": %.3f}",
                    first_row ? "" : ",\n", m, ms, m / (ms * 1e-3), fl / 1e12, tfs,
                    100.0 * tfs / gemm_tflops, t_layer[0], t_layer[1]);
        first_row = 0;
    }
    if (js) {
        fprintf(js, "\n  ]\n}\n");
        fclose(js);
    }
    gemm_lt_free(&lt);
    printf("done\n");
    return 0;
}
