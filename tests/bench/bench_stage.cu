/*
 * bench_stage.cu - decode and prefill throughput of one GLM-5.2-REAP pipeline stage on one GPU,
 * with synthetic weights generated on the device.
 *
 * Model dimensions (notes/model.md §0): hidden 6144, 64 heads, q_lora 2048, kv_lora 512,
 * rope 64, nope 192, v 256, 156 routed experts x 2048 (top-8) + 1 shared expert, dense MLP
 * 12288. A stage is 26 layers, the first 3 dense. Precision mix of the real checkpoint:
 * routed experts NVFP4; attention, router, shared expert and dense MLP bf16; fp8 MLA cache.
 *
 * Decode step (per layer, batch B at context C): RMSNorm; fused q_a+kv_a GEMV; q_a RMSNorm;
 * cache append (kv_a RMSNorm, RoPE, fp8); q_b GEMV; q split + RoPE; per-head W_UK^T GEMV;
 * split-KV absorbed MLA attention over C positions; per-head W_UV GEMV; o_proj GEMV + residual;
 * RMSNorm; then router GEMV + fused top-8, routed gate/up + SwiGLU, shared gate/up GEMV +
 * SwiGLU, routed down + weighted sum + residual, shared down + residual (MoE layers) or the
 * dense MLP. The whole step (26 layers) is captured in one CUDA graph and replayed; the weights
 * (~88 GB) are far larger than L2, so every replay streams them from HBM.
 *
 * Reported: ms/step, tok/s, bytes read per step by category (routed experts counted per
 * distinct expert actually selected), achieved GB/s and its % of a device-to-device copy
 * measured in the same run; a per-op breakdown (each op replayed over all layers in its own
 * graph); prefill tok/s for the stage's linear layers (cuBLASLt; NVFP4 experts dequantized to
 * bf16 first) and its TFLOP/s vs an 8192^3 cuBLAS bf16 GEMM measured in the same run.
 * Not included: MLA prefill attention (no flash-MLA prefill kernel yet), the DSA indexer,
 * embedding and lm_head (they are not part of a middle stage).
 *
 * Usage: bench_stage [--json PATH] [--layers N] [--iters N] [--quick]
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cuda_check.h"
#include "kernels/act.h"
#include "kernels/common.cuh"
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
    N_DENSE = 3,
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
    int dense;
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
} Layer;

// ---------------------------------------------------------------------------
// Decode

typedef struct Work {
    float *h, *h0, *qkv, *q, *q_pe, *q_lat, *logits, *sgu, *ws_o, *ws_ml;
    uint16_t *xb, *qr, *q_nope, *o_lat, *ov, *act, *sact;
    int32_t *pos, *seq, *kv_len, *table;
    int max_blocks;
} Work;

typedef enum Op {
    OP_NORM_IN, OP_QKV_A, OP_Q_NORM, OP_KV_APPEND, OP_Q_B, OP_Q_SPLIT, OP_W_UK, OP_ATTN, OP_W_UV,
    OP_O_PROJ, OP_NORM_POST, OP_ROUTER, OP_ROUTE, OP_W13, OP_SH13, OP_SH_ACT, OP_W2, OP_SH2,
    OP_D13, OP_D_ACT, OP_D2, N_OPS
} Op;

static const char *op_name[N_OPS] = {
    "norm_in", "qkv_a gemv", "q_a norm", "kv append", "q_b gemv", "q split+rope", "W_UK^T gemv",
    "mla attention", "W_UV gemv", "o_proj gemv+res", "norm_post", "router gemv", "route top8",
    "experts w13+act", "shared w13", "shared act", "experts w2+sum", "shared w2+res",
    "dense w13", "dense act", "dense w2+res"};

static int op_applies(Op op, const Layer *L)
{
    if (op >= OP_ROUTER && op <= OP_SH2) return !L->dense;
    if (op >= OP_D13) return L->dense;
    return 1;
}

static void run_op(Op op, Layer *L, Work *w, int B, int n_split, cudaStream_t s)
{
    switch (op) {
    case OP_NORM_IN: norm_rms(w->xb, w->h, L->norm_in, EPS, B, HID, HID, HID, s); break;
    case OP_QKV_A: gemm_bf16_gemv(w->qkv, GEMM_OUT_F32, L->qkv_a, w->xb, NULL, QKV_A, HID, 1, B, s); break;
    case OP_Q_NORM: norm_rms(w->qr, w->qkv, L->q_norm, EPS, B, QLORA, QKV_A, QLORA, s); break;
    case OP_KV_APPEND:
        mla_cache_append(&L->cache, w->qkv + QLORA, QKV_A, L->kv_norm, EPS, THETA, w->pos, w->seq,
                         w->table, w->max_blocks, B, s);
        break;
    case OP_Q_B: gemm_bf16_gemv(w->q, GEMM_OUT_F32, L->q_b, w->qr, NULL, NH * QHEAD, QLORA, 1, B, s); break;
    case OP_Q_SPLIT: mla_q_split(w->q_nope, w->q_pe, w->q, w->pos, B, NH, THETA, s); break;
    case OP_W_UK: gemm_bf16_gemv(w->q_lat, GEMM_OUT_F32, L->kv_b, w->q_nope, NULL, MLA_KV_LORA, NOPE, NH, B, s); break;
    case OP_ATTN:
        mla_decode(w->o_lat, w->q_lat, w->q_pe, &L->cache, w->table, w->max_blocks, w->seq,
                   w->kv_len, NULL, 0, B, NH, 1.0f / 16.0f, n_split, w->ws_o, w->ws_ml, s);
        break;
    case OP_W_UV:
        gemm_bf16_gemv(w->ov, GEMM_OUT_BF16, L->kv_b + (size_t) NH * MLA_KV_LORA * NOPE, w->o_lat,
                       NULL, VDIM, MLA_KV_LORA, NH, B, s);
        break;
    case OP_O_PROJ: gemm_bf16_gemv(w->h, GEMM_OUT_F32, L->o_proj, w->ov, w->h, HID, NH * VDIM, 1, B, s); break;
    case OP_NORM_POST: norm_rms(w->xb, w->h, L->norm_post, EPS, B, HID, HID, HID, s); break;
    case OP_ROUTER: gemm_bf16_gemv(w->logits, GEMM_OUT_F32, L->router, w->xb, NULL, NEXP, HID, 1, B, s); break;
    case OP_ROUTE: moe_route(L->idx, L->wts, w->logits, L->bias, B, NEXP, TOPK, 1, 1, ROUTE_SCALE, s); break;
    case OP_W13: moe_experts_w13(w->act, &L->ex, w->xb, L->idx, B, TOPK, s); break;
    case OP_SH13: gemm_bf16_gemv(w->sgu, GEMM_OUT_F32, L->sh13, w->xb, NULL, 2 * INTER, HID, 1, B, s); break;
    case OP_SH_ACT: act_silu_mul(w->sact, w->sgu, B, INTER, s); break;
    case OP_W2: moe_experts_w2(w->h, &L->ex, w->act, L->idx, L->wts, w->h, B, TOPK, s); break;
    case OP_SH2: gemm_bf16_gemv(w->h, GEMM_OUT_F32, L->sh2, w->sact, w->h, HID, INTER, 1, B, s); break;
    case OP_D13: gemm_bf16_gemv(w->sgu, GEMM_OUT_F32, L->d13, w->xb, NULL, 2 * DENSE_INTER, HID, 1, B, s); break;
    case OP_D_ACT: act_silu_mul(w->sact, w->sgu, B, DENSE_INTER, s); break;
    case OP_D2: gemm_bf16_gemv(w->h, GEMM_OUT_F32, L->d2, w->sact, w->h, HID, DENSE_INTER, 1, B, s); break;
    default: break;
    }
}

// Weight (and cache) bytes one op reads in one layer; distinct = distinct routed experts.
static double op_bytes(Op op, const Layer *L, int B, int ctx, double distinct)
{
    const double nv = 0.5625;  // NVFP4 bytes per weight
    (void) L;
    switch (op) {
    case OP_QKV_A: return 2.0 * QKV_A * HID;
    case OP_Q_B: return 2.0 * NH * QHEAD * QLORA;
    case OP_W_UK: return 2.0 * NH * MLA_KV_LORA * NOPE;
    case OP_W_UV: return 2.0 * NH * VDIM * MLA_KV_LORA;
    case OP_O_PROJ: return 2.0 * HID * NH * VDIM;
    case OP_ATTN: return (double) B * ctx * MLA_FP8_TOKEN_BYTES;
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

static void enqueue_step(Layer *layers, int n_layers, Work *w, int B, int n_split, cudaStream_t s)
{
    CUDA_CHECK(cudaMemcpyAsync(w->h, w->h0, (size_t) B * HID * 4, cudaMemcpyDeviceToDevice, s));
    for (int l = 0; l < n_layers; l++)
        for (int op = 0; op < N_OPS; op++)
            if (op_applies((Op) op, &layers[l])) run_op((Op) op, &layers[l], w, B, n_split, s);
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

static int choose_split(int B, int ctx)
{
    // About four CTAs per SM (H = 64 heads = 4 CTAs per token and split), at least one
    // 16-position tile per split; the per-op section also times other split counts.
    int n = (528 + 4 * B - 1) / (4 * B);
    const int by_len = (ctx + 15) / 16;
    if (n > by_len) n = by_len;
    if (n > MLA_MAX_SPLIT) n = MLA_MAX_SPLIT;
    return n < 1 ? 1 : n;
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
    int n_layers = 26, iters = 20, quick = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) n_layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else {
            fprintf(stderr, "usage: bench_stage [--json PATH] [--layers N] [--iters N] [--quick]\n");
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

    // Weights.
    const int max_ctx = quick ? 4096 : 32768;
    Work w;
    memset(&w, 0, sizeof w);
    w.max_blocks = max_ctx / MLA_BLOCK;
    Layer *layers = (Layer *) calloc((size_t) n_layers, sizeof(Layer));
    double weight_bytes = 0.0;
    for (int l = 0; l < n_layers; l++) {
        Layer *L = &layers[l];
        L->dense = l < N_DENSE;
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
        L->cache.n_blocks = MAX_B * w.max_blocks;
        L->cache.data = new_u8((size_t) L->cache.n_blocks * MLA_BLOCK * MLA_FP8_TOKEN_BYTES, 1);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    printf("stage: %d layers (%d dense), %.1f GB of weights in device memory\n", n_layers,
           n_layers < N_DENSE ? n_layers : N_DENSE, weight_bytes / 1e9);

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
    int32_t h_table[MAX_B * 256], h_seq[MAX_B];
    for (int b = 0; b < MAX_B; b++) {
        h_seq[b] = b;
        for (int j = 0; j < w.max_blocks; j++) h_table[b * w.max_blocks + j] = b * w.max_blocks + j;
    }
    w.table = (int32_t *) dalloc(sizeof h_table);
    CUDA_CHECK(cudaMemcpy(w.table, h_table, sizeof h_table, cudaMemcpyHostToDevice));
    w.seq = (int32_t *) dalloc(sizeof h_seq);
    CUDA_CHECK(cudaMemcpy(w.seq, h_seq, sizeof h_seq, cudaMemcpyHostToDevice));
    w.pos = (int32_t *) dalloc(MAX_B * 4);
    w.kv_len = (int32_t *) dalloc(MAX_B * 4);

    FILE *js = json_path ? fopen(json_path, "w") : NULL;
    if (js)
        fprintf(js, "{\n  \"device\": \"%s\", \"sms\": %d, \"copy_gbs\": %.1f, \"memcpy_gbs\": %.1f, \"cublas_bf16_tflops\": %.1f,\n"
                    "  \"layers\": %d, \"weight_gb\": %.2f,\n  \"decode\": [\n",
                prop.name, prop.multiProcessorCount, copy_gbs, memcpy_gbs, gemm_tflops, n_layers, weight_bytes / 1e9);

    // Decode sweeps.
    const int ctxs[2] = {1024, quick ? 4096 : 32768};
    const int batches[5] = {1, 2, 4, 8, 16};
    double tok1[2] = {0, 0};
    int first_row = 1;
    printf("\ndecode, one graph per step (%d layers):\n", n_layers);
    printf("%6s %5s %5s %8s %8s %8s %8s %6s | GB/step: %6s %6s %6s %6s %6s\n", "ctx", "batch",
           "split", "ms/step", "tok/s", "GB/step", "GB/s", "%copy", "attn", "routed", "shared",
           "dense", "kv");
    for (int ci = 0; ci < 2; ci++) {
        for (int bi = 0; bi < 5; bi++) {
            const int B = batches[bi], ctx = ctxs[ci];
            int32_t hp[MAX_B], hl[MAX_B];
            for (int b = 0; b < MAX_B; b++) hp[b] = ctx - 1, hl[b] = ctx;
            CUDA_CHECK(cudaMemcpy(w.pos, hp, sizeof hp, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(w.kv_len, hl, sizeof hl, cudaMemcpyHostToDevice));
            const int n_split = choose_split(B, ctx);
            enqueue_step(layers, n_layers, &w, B, n_split, s);  // warm-up outside capture
            CUDA_CHECK(cudaStreamSynchronize(s));
            CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            enqueue_step(layers, n_layers, &w, B, n_split, s);
            ge = capture_begin_end(s, &graph);
            const float ms = time_graph(ge, iters, s);
            CUDA_CHECK(cudaGraphExecDestroy(ge));
            CUDA_CHECK(cudaGraphDestroy(graph));
            // Distinct routed experts per MoE layer, from the last replay's routing.
            double distinct = 0.0;
            int n_moe = 0;
            for (int l = 0; l < n_layers; l++) {
                if (layers[l].dense) continue;
                int32_t idx[MAX_B * TOPK];
                CUDA_CHECK(cudaMemcpy(idx, layers[l].idx, (size_t) B * TOPK * 4, cudaMemcpyDeviceToHost));
                char seen[NEXP];
                memset(seen, 0, sizeof seen);
                int d = 0;
                for (int i = 0; i < B * TOPK; i++) {
                    if (idx[i] < 0 || idx[i] >= NEXP) continue;
                    d += !seen[idx[i]];
                    seen[idx[i]] = 1;
                }
                distinct += d;
                n_moe++;
            }
            const double avg_distinct = n_moe ? distinct / n_moe : 0.0;
            double cat[5] = {0, 0, 0, 0, 0};  // attn weights, routed, shared+router, dense, kv
            for (int l = 0; l < n_layers; l++) {
                for (int op = 0; op < N_OPS; op++) {
                    if (!op_applies((Op) op, &layers[l])) continue;
                    const double by = op_bytes((Op) op, &layers[l], B, ctx, avg_distinct);
                    const int c = op == OP_ATTN ? 4 : (op == OP_W13 || op == OP_W2) ? 1
                                  : (op == OP_SH13 || op == OP_SH2 || op == OP_ROUTER) ? 2
                                  : (op >= OP_D13) ? 3 : 0;
                    cat[c] += by;
                }
            }
            const double total = cat[0] + cat[1] + cat[2] + cat[3] + cat[4];
            const double gbs = total / (ms * 1e-3) / 1e9;
            const double tps = B / (ms * 1e-3);
            if (B == 1) tok1[ci] = tps;
            printf("%6d %5d %5d %8.3f %8.1f %8.2f %8.0f %5.1f%% | %15.2f %6.2f %6.2f %6.2f %6.2f  (distinct experts/layer %.1f)\n",
                   ctx, B, n_split, ms, tps, total / 1e9, gbs, 100.0 * gbs / copy_gbs, cat[0] / 1e9,
                   cat[1] / 1e9, cat[2] / 1e9, cat[3] / 1e9, cat[4] / 1e9, avg_distinct);
            if (js)
                fprintf(js, "%s    {\"ctx\": %d, \"batch\": %d, \"split\": %d, \"ms_per_step\": %.4f, \"tok_s\": %.2f, "
                            "\"gb_per_step\": %.4f, \"gbs\": %.1f, \"pct_copy\": %.2f, \"gb_attn_w\": %.4f, "
                            "\"gb_routed\": %.4f, \"gb_shared_router\": %.4f, \"gb_dense\": %.4f, \"gb_kv\": %.4f, "
                            "\"distinct_experts\": %.2f}",
                        first_row ? "" : ",\n", ctx, B, n_split, ms, tps, total / 1e9, gbs,
                        100.0 * gbs / copy_gbs, cat[0] / 1e9, cat[1] / 1e9, cat[2] / 1e9,
                        cat[3] / 1e9, cat[4] / 1e9, avg_distinct);
            first_row = 0;
            if (B == 8) printf("       batch 8 / batch 1 tok/s: %.2fx\n", tps / tok1[ci]);
        }
    }

    // Per-op breakdown at batch 1 and batch 8, ctx 1K and the long context.
    if (js) fprintf(js, "\n  ],\n  \"ops\": [\n");
    first_row = 1;
    const int op_cfg[3][2] = {{1, 1024}, {8, 1024}, {1, quick ? 4096 : 32768}};
    for (int k = 0; k < 3; k++) {
        const int B = op_cfg[k][0], ctx = op_cfg[k][1];
        int32_t hp[MAX_B], hl[MAX_B];
        for (int b = 0; b < MAX_B; b++) hp[b] = ctx - 1, hl[b] = ctx;
        CUDA_CHECK(cudaMemcpy(w.pos, hp, sizeof hp, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(w.kv_len, hl, sizeof hl, cudaMemcpyHostToDevice));
        const int n_split = choose_split(B, ctx);
        enqueue_step(layers, n_layers, &w, B, n_split, s);
        CUDA_CHECK(cudaStreamSynchronize(s));
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
        const double avg_distinct = n_moe ? distinct / n_moe : 0.0;
        printf("\nper-op, batch %d, ctx %d (each op replayed over its layers in one graph):\n", B, ctx);
        printf("%-18s %8s %10s %8s %7s\n", "op", "us/layer", "MB/layer", "GB/s", "%copy");
        double sum_us = 0.0;
        for (int op = 0; op < N_OPS; op++) {
            int n_app = 0;
            CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            for (int l = 0; l < n_layers; l++)
                if (op_applies((Op) op, &layers[l])) run_op((Op) op, &layers[l], &w, B, n_split, s), n_app++;
            ge = capture_begin_end(s, &graph);
            const float ms = n_app ? time_graph(ge, iters, s) : 0.0f;
            CUDA_CHECK(cudaGraphExecDestroy(ge));
            CUDA_CHECK(cudaGraphDestroy(graph));
            if (!n_app) continue;
            const double us = 1e3 * ms / n_app;
            const double by = op_bytes((Op) op, &layers[n_layers - 1], B, ctx, avg_distinct);
            const double gbs = by / (us * 1e-6) / 1e9;
            sum_us += us * n_app;
            printf("%-18s %8.1f %10.2f %8.0f %6.1f%%\n", op_name[op], us, by / 1e6, gbs, 100.0 * gbs / copy_gbs);
            if (js)
                fprintf(js, "%s    {\"batch\": %d, \"ctx\": %d, \"op\": \"%s\", \"layers\": %d, \"us_per_layer\": %.2f, "
                            "\"mb_per_layer\": %.3f, \"gbs\": %.1f}",
                        first_row ? "" : ",\n", B, ctx, op_name[op], n_app, us, by / 1e6, gbs);
            first_row = 0;
        }
        printf("%-18s %8.1f ms per step if run back to back\n", "sum of ops", sum_us / 1e3);
        const int alt[4] = {1, 4, 16, 64};
        for (int a = 0; a < 4; a++) {
            CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            for (int l = 0; l < n_layers; l++) run_op(OP_ATTN, &layers[l], &w, B, alt[a], s);
            ge = capture_begin_end(s, &graph);
            const float ms = time_graph(ge, iters, s);
            CUDA_CHECK(cudaGraphExecDestroy(ge));
            CUDA_CHECK(cudaGraphDestroy(graph));
            printf("  mla attention with %2d splits: %8.1f us/layer\n", alt[a], 1e3 * ms / n_layers);
            if (js)
                fprintf(js, ",\n    {\"batch\": %d, \"ctx\": %d, \"op\": \"mla attention split %d\", \"us_per_layer\": %.2f}",
                        B, ctx, alt[a], 1e3 * ms / n_layers);
        }
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
    for (int k = 0; k < 2; k++) {
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
