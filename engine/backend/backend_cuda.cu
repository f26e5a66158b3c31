/*
 * backend_cuda.cu - the CUDA backend (backend_cuda.h): every op of backend.h on one stream of
 * the backend's own, with the decode step replayable as a CUDA graph.
 *
 * Design:
 * - Under the bf16 precision recipe (engine/model/backend.h, the default here) the tuned
 *   kernels of kernels/ run what they can take (backend_*_tuned): bf16 linears through
 *   kernels/gemm.h (matmul_tuned), routed NVFP4 experts stacked at bind_experts as
 *   kernels/moe.h reads them (moe_tuned), MLA through kernels/mla.h over the engine's own
 *   pages with kv_b repacked at bind_kv_b (mla_tuned). A model narrower than GLM-5 runs the
 *   same kernels at GLM-5's widths on zero-padded values: the KV cache stores entries and
 *   index keys padded (kv_cache.h), q, heads and kv_b are padded here and the outputs
 *   cropped (kernels/act.h act_repad); zeros change no sum. (The experts' kernels take any
 *   NVFP4 widths, multiples of 16.) The router is kernels/moe.cu's under both recipes. The rest of this file is the
 *   backend's own fp32 kernels (what --precision f32 runs everywhere, and the bf16 recipe
 *   only where backend_*_tuned refuses: counted, backend_cuda_untuned):
 * - Weights: bind_linear() copies data, NVFP4 group scales and FP8 block scales to device
 *   memory unchanged and rewrites the CkptLinear's pointers; kernels decode each element as
 *   they read it with the same values as the CPU backend (kernels/nvfp4_format.h, by bit
 *   manipulation on the device), so no weight is expanded in memory.
 * - matmul (k_gemv): one warp per output row and chunk of up to 8 tokens (one token when n is
 *   1), so each weight byte is read once per chunk. When a row is a whole number of 16-byte
 *   vectors (and x is 16-byte aligned) each lane reads 16-byte weight vectors (4 f32, 8
 *   bf16/f16, 16 fp8, 32 NVFP4 codes with their two group scales), four vectors in flight,
 *   lanes owning vectors lane, lane + 32, ...; otherwise one element per lane. fp32 products
 *   summed per lane in vector order, then across the warp. Which path a weight takes depends
 *   on the weight alone, and each token's sum on nothing but its own row, so decode equals
 *   prefill bit for bit, as on the CPU.
 * - Reductions that decide something (norm statistics, DSA scores, attention scores and
 *   softmax) run in double, in the CPU backend's order where one thread owns a
 *   sum (a router token, a DSA score, q_lat channels) and in a fixed tree order otherwise.
 * - MLA attention (absorbed form, as the CPU backend) is five launches: q_lat per (token,
 *   head); scores with a warp per key; softmax statistics; partial o_lat per split of 256
 *   keys; the splits summed in order and projected. Long contexts spread over the GPU.
 * - KV cache: kv_cache.c owns a host pool; this backend keeps a device pool of the same
 *   layout per KvCache (found by address, created zeroed on first use), writes and reads its
 *   entries through kv_cache.h's host/device routines (f32, bf16, fp8), and keeps a step's
 *   block tables ([sequences, longest table], DevStep) in device rows per step shape (cache,
 *   sequence count, stride), uploaded again only when a table changed. The cache ops (kv_write, dsa_topk, mla_attention) run once per step for
 *   every sequence: a token finds its table row through BackendSeqs.seq_of. Only this
 *   backend reads or writes the device pool, so the host pool of a cache used with CUDA
 *   stays zero.
 * - MoE: four launches whatever the expert count: the (token, slot) pairs grouped by expert
 *   with the list of active experts (ascending) on the GPU; gate and up of every active
 *   expert with silu(gate) * up fused (grid: row blocks x active experts, so inactive experts
 *   cost nothing; the slots sharing an expert share its weight read, 8 per read); down the
 *   same way; the weighted sum in ascending expert order (the CPU order).
 * - Graphs (graph_begin/graph_end of backend.h): the caller names a run of ops by a key;
 *   the backend adds the cache, the sequence count and the block tables' stride (which name
 *   the step's table rows, whatever sequences fill them: a batch whose sequences change
 *   replays) and a generation counter that every device (re)allocation bumps, since launches
 *   capture pointers and grid sizes. A key seen in the previous call, with no allocation since, is captured
 *   (stream capture) and launched; later calls with the key replay the graph, the caller
 *   skipping the ops. Varying inputs (positions, token ids, block tables) live in device
 *   buffers the caller uploads before. GLMSPARK_CUDA_GRAPHS=0 turns graphs off;
 *   GLMSPARK_MOE_WIDE=1 lets prefill chunks take the wide expert tiles (moe_tuned);
 *   MLA attention runs on the tensor cores where the shape allows (Backend.mla_tc:
 *   mla_decode_tc, whose recipe also rounds q and the probabilities to bf16, as the CPU
 *   backend then does; GLMSPARK_MLA_TC=0 keeps mla_decode).
 * - DSA under the bf16 recipe (backend_dsa_tuned layers): kernels/dsa.h's scores and top-k
 *   over the engine's key pages (kv_dsa_cache_stored), fp32 scores in the order the CPU backend
 *   follows (kernels/dsa_format.h), so the two select the same keys. The scores run on the
 *   tensor cores on fp8 or bf16 keys (Backend.dsa_tc: dsa_scores_tc, q rounded to bf16, as
 *   the CPU backend then does; the accumulation order differs; GLMSPARK_DSA_TC=0 keeps
 *   dsa_scores).
 * Not yet through kernels/: the embedding lookup, the KV write, the f32 recipe's ops.
 * Host syncs: uploads and downloads (cudaMemcpy semantics), scratch growth, block-table
 * uploads when a sequence gains a block, and the first use of a cache or experts array;
 * none inside a decode step's layer loop once its graph exists.
 */
#include "engine/backend/backend_cuda.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/backend/tuned_pack.h"
#include "engine/shared/clock.h"
#include "engine/shared/cuda_check.h"
#include "kernels/act.h"
#include "kernels/dsa.h"
#include "kernels/gemm.h"
#include "kernels/mla.h"
#include "kernels/moe.h"
#include "kernels/norm.h"
#include "kernels/nvfp4_format.h"
#include "kernels/rope.h"

enum {
    SCRATCH_A,  // double / float work buffers
    SCRATCH_B,
    SCRATCH_C,
    SCRATCH_D,
    SCRATCH_E,  // MoE slot grouping
    SCRATCH_X,  // bf16 inputs of the tuned kernels (x, q_nope); the experts' pair outputs
    SCRATCH_Y,  // their intermediates (expert activations, q_pe, o_lat)
    SCRATCH_Z,  // q_lat, mla_decode's split workspace
    N_SCRATCH,
    MAX_POOLS = 16,
    MAX_STEPS = 64,  // graphed steps' block tables kept: (cache, sequences, stride) shapes
    MAX_EXPERT_TABLES = 512,
    MAX_KV_B = 512,
    MAX_PAD_LINS = 1024,
    MAX_GRAPHS = 16,
    MAX_GRAPH_KEY = 256,  // key words (caller's and backend's) a graph can be recorded under
    THREADS = 256,
    MM_WARPS = 4,  // k_gemv / MoE: rows (warps) per block
    MATMUL_TOK = 8,
};

// The scores one pass of the tuned DSA top-k may hold by default (cuda_dsa_topk: rows in
// passes; backend_cuda_limit_dsa_scores).
#define DSA_SCORE_BYTES ((size_t) 256 << 20)

// A device mirror of one KvCache's pool (bound to its initialisation: KvCache.serial).
typedef struct DevPool {
    const KvCache *kv;
    uint64_t serial;
    size_t bytes;
    void *dev;
} DevPool;

// The block tables of one step's sequences on the device, one row of `stride` ints per
// sequence (rows padded with 0), re-uploaded only when a table changed.
typedef struct DevStep {
    // The slot's key: a graphed call's tables live in the slot of its cache, sequence count
    // and stride, whichever sequences they are, so that a recorded step replays for any batch
    // of that shape (a sequence that ends and one that joins change no graph). kv NULL: the
    // ungraphed calls' slot (impl->step_eager), which no graph reads.
    const KvCache *kv;
    int n_seqs;
    int stride;               // ints per row: the longest table (at least 1)
    int cap;                  // ints allocated in host and dev
    int *host;                // the tables as last uploaded, owned
    int *dev;                 // device copy, owned
    unsigned long long used;  // last use (for eviction)
    // Set anew whenever the slot takes another shape (recycled): part of the graph keys, so
    // recycling a slot retires only the graphs recorded with it.
    unsigned long long serial;
} DevStep;

// A device copy of an experts array's descriptors (DevLin [3 E]).
typedef struct ExpertTable {
    const CkptLinear *host;
    int n;
    void *dev;
} ExpertTable;

// A MoE layer's NVFP4 experts stacked as kernels/moe.h reads them (bind_experts); each
// expert's CkptLinear points into the stack.
typedef struct ExpertStack {
    const CkptLinear *experts;
    MoeExperts ex;
} ExpertStack;

// A bf16 weight whose columns are not in 8s, as the tuned GEMV reads it (bind_linear): rows
// of cols_p (the columns rounded up to 8) with zeros after the weight's own, beside the
// stored copy at data (which the f32 recipe's kernels read).
typedef struct PadLin {
    const void *data;
    const uint16_t *padded;
    int cols_p;
} PadLin;

// A kv_b_proj repacked for the tuned MLA path (bind_kv_b, tuned_pack.h): bf16 W_UK^T
// [Hp, 512, 192] and W_UV [Hp, Vp, 512].
typedef struct KvBPack {
    const CkptLinear *kv_b;
    uint16_t *uk, *uv;
} KvBPack;

// A recorded decode step: the key it was captured under and its executable graph.
typedef struct GraphEntry {
    unsigned long long key[MAX_GRAPH_KEY];
    int n_key;  // 0: slot empty
    unsigned long long gen;
    unsigned long long used;
    cudaGraphExec_t exec;
} GraphEntry;

typedef enum GraphMode { GRAPH_NONE, GRAPH_EAGER, GRAPH_CAPTURE, GRAPH_REPLAY } GraphMode;

// Ops timed by GLMSPARK_CUDA_PROFILE=1 (backend_cuda_profile_report).
enum {
    PROF_MATMUL,
    PROF_EMBED,
    PROF_NORM,
    PROF_ROPE,
    PROF_ELEMENTWISE,
    PROF_ROUTE,
    PROF_KV_WRITE,
    PROF_DSA,
    PROF_MLA,
    PROF_MLA_PROJ,
    PROF_MOE,
    N_PROF,
};
static const char *const prof_names[N_PROF] = {
    "matmul",   "embed",    "rmsnorm/layernorm", "rope",          "silu_mul/add",
    "route",    "kv_write", "dsa_topk",          "mla_attention", "mla q/out proj",
    "moe"};

typedef struct CudaImpl {
    int device;
    BackendCudaUntuned untuned;  // backend_cuda_untuned
    int n_sm;                // streaming multiprocessors
    cudaStream_t stream;     // every launch and copy
    unsigned long long gen;  // bumped by every device (re)allocation (graphs record pointers)
    unsigned long long step_serial;  // DevStep.serial's counter
    bool graphs;             // GLMSPARK_CUDA_GRAPHS != 0
    GraphMode mode;          // between graph_begin and graph_end
    GraphEntry *graph_cur;   // the entry being replayed
    unsigned long long key[MAX_GRAPH_KEY];  // the current call's key
    int n_key;
    unsigned long long last_key[MAX_GRAPH_KEY];  // the last eager call's key, and gen after it
    int n_last_key;
    unsigned long long last_gen;
    GraphEntry graph_cache[MAX_GRAPHS];
    // Graphed calls (graph_begin with graphs on) by outcome, logged at destroy: a serving
    // path whose steps keep missing the cache pays every launch of the step on the host.
    unsigned long long n_replays, n_captures, n_eager;
    // Host seconds spent recording and instantiating graphs, and launching the eager calls
    // (graph_begin to graph_end): what a graphed serving run pays that the bench's timed
    // steps do not.
    double capture_s, eager_s, graph_t0;
    // Downloads: count, bytes and host seconds copying, after the device's queued work.
    unsigned long long n_downloads, download_bytes;
    double download_s;
    bool profile;  // GLMSPARK_CUDA_PROFILE=1: each op synchronized and timed (graphs off)
    bool moe_wide;  // prefill chunks may take the wide expert tiles (GLMSPARK_MOE_WIDE=0: no)
    size_t dsa_score_bytes;  // a DSA top-k pass's scores (DSA_SCORE_BYTES; tests lower it)
    int moe_chunk;  // GLMSPARK_MOE_CHUNK: tokens per expert launch of a prefill (0: the most
                    // the tiles take, MOE_MAX_WIDE_PAIRS or MOE_MAX_CHUNK_PAIRS / top_k)
    double prof_t0;
    double prof_s[N_PROF];
    double prof_bytes[N_PROF];  // weight bytes read (matmul, moe)
    long prof_calls[N_PROF];
    void **allocs;  // weight copies made by bind_linear, owned
    int n_allocs, cap_allocs;
    void *scratch[N_SCRATCH];
    size_t scratch_bytes[N_SCRATCH];
    DevPool pools[MAX_POOLS];
    DevStep steps[MAX_STEPS];  // graphed calls' tables (DevStep)
    DevStep step_eager;        // ungraphed calls' tables
    int *step_tmp;  // host staging for a step's tables, owned
    int step_tmp_cap;
    unsigned long long clock;
    ExpertTable tables[MAX_EXPERT_TABLES];
    int n_tables;
    ExpertStack stacks[MAX_EXPERT_TABLES];
    int n_stacks;
    KvBPack kv_bs[MAX_KV_B];
    int n_kv_b;
    PadLin pad_lins[MAX_PAD_LINS];
    int n_pad_lins;
    GemmLt lt;  // cuBLASLt for tuned matmuls of more than GEMM_MAX_TOK tokens
} CudaImpl;

// A weight as the kernels see it (pointers into device memory).
typedef struct DevLin {
    int format;
    int rows;
    int cols;
    const void *data;
    const uint8_t *scale;
    const float *scale_f32;
    float global;
    int vec;  // rows are whole 16-byte vectors: k_gemv's vector path
} DevLin;

// One layer of a cache, for the tokens of a step, as the kernels see it: token t's position
// p lives in block tables[seq_of[t] * stride + p / block_size] (kv_cache.h's layout).
typedef struct DevKv {
    const unsigned char *mla;   // the layer's MLA pages
    const unsigned char *keys;  // its key pages (layers with an indexer key)
    const int *tables;          // [n_seqs, stride] (DevStep)
    int stride;
    const int *seq_of;  // [n] each token's row
    KvEntryLayout lo;   // the layer's storage
} DevKv;

// Elements of format f in one 16-byte vector.
static __host__ __device__ constexpr int vec_elems(int f)
{
    return f == CKPT_LINEAR_F32 ? 4 : f == CKPT_LINEAR_FP8 ? 16 : f == CKPT_LINEAR_NVFP4 ? 32 : 8;
}

static DevLin dev_lin(const CkptLinear *w)
{
    const int n = vec_elems((int) w->format);
    const bool aligned = ((uintptr_t) w->data & 15) == 0
                         && (w->format != CKPT_LINEAR_NVFP4 || ((uintptr_t) w->scale & 1) == 0);
    DevLin d = {(int) w->format, w->rows,      w->cols,         w->data,
                w->scale,        w->scale_f32, w->global_scale, aligned && w->cols % n == 0};
    return d;
}

// ---------------------------------------------------------------------------
// Device helpers

static __device__ float half_bits_to_float(uint16_t h)
{
    const int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float v;
    if (exponent == 0)
        v = ldexpf((float) mantissa, -24);
    else if (exponent == 31)
        v = mantissa ? __int_as_float(0x7fc00000) : __int_as_float(0x7f800000);
    else
        v = ldexpf((float) (mantissa | 1024), exponent - 25);
    return sign ? -v : v;
}

// W[r, c] as fp32, decoded as ckpt_linear_row() does.
static __device__ __forceinline__ float lin_at(const DevLin &w, int r, int c)
{
    const size_t i = (size_t) r * (size_t) w.cols + (size_t) c;
    switch (w.format) {
    case CKPT_LINEAR_F32:
        return ((const float *) w.data)[i];
    case CKPT_LINEAR_BF16:
        return __uint_as_float((uint32_t) ((const uint16_t *) w.data)[i] << 16);
    case CKPT_LINEAR_F16:
        return half_bits_to_float(((const uint16_t *) w.data)[i]);
    case CKPT_LINEAR_FP8: {
        float s = w.global;
        if (w.scale_f32) {
            const size_t n_col_blocks = ((size_t) w.cols + 127) / 128;
            s = w.scale_f32[((size_t) r / 128) * n_col_blocks + (size_t) c / 128];
        }
        return nvfp4_e4m3_to_float(((const uint8_t *) w.data)[i]) * s;
    }
    default: {  // CKPT_LINEAR_NVFP4
        const uint8_t byte = ((const uint8_t *) w.data)[i / 2];
        const uint8_t code = (c & 1) ? byte >> 4 : byte & 15;
        return nvfp4_e2m1_to_float(code)
               * nvfp4_e4m3_to_float(w.scale[(size_t) r * (w.cols / NVFP4_GROUP) + c / NVFP4_GROUP])
               * w.global;
    }
    }
}

static __device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum (op 0) or max (op 1) of v over the block; every thread gets the result. buf: shared
// double [THREADS / 32].
static __device__ double block_reduce(double v, int op, double *buf)
{
    for (int o = 16; o > 0; o >>= 1) {
        const double u = __shfl_xor_sync(0xffffffffu, v, o);
        v = op ? fmax(v, u) : v + u;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    double r = buf[0];
    for (int i = 1; i < n_warps; i++)
        r = op ? fmax(r, buf[i]) : r + buf[i];
    return r;
}

static __device__ __forceinline__ int kv_block(const DevKv &k, int t, int pos)
{
    return k.tables[(size_t) k.seq_of[t] * k.stride + pos / k.lo.block_size];
}

// The MLA entry of token t's sequence at position pos.
static __device__ __forceinline__ const unsigned char *kv_at(const DevKv &k, int t, int pos)
{
    const size_t row = (size_t) kv_block(k, t, pos) * k.lo.block_size + pos % k.lo.block_size;
    return k.mla + row * (size_t) k.lo.bytes;
}

// The key page holding the index key of token t's sequence at position pos (its row there:
// pos % block_size).
static __device__ __forceinline__ const unsigned char *kv_key_page(const DevKv &k, int t, int pos)
{
    return k.keys + (size_t) kv_block(k, t, pos) * (size_t) k.lo.key_page;
}

// ---------------------------------------------------------------------------
// Kernels

// One 16-byte weight vector as read from memory, with what its decoding needs: the two
// NVFP4 group-scale bytes or the fp8 scale.
typedef struct RawVec {
    uint4 q;
    uint32_t s;
} RawVec;

// Vector k (elements k N .. k N + N - 1) of row r, format F (w.vec set).
template <int F> static __device__ __forceinline__ RawVec raw_vec(const DevLin &w, int r, int k)
{
    constexpr int N = vec_elems(F);
    RawVec v;
    v.q = __ldg((const uint4 *) w.data + (size_t) r * (size_t) (w.cols / N) + k);
    v.s = 0;
    if (F == CKPT_LINEAR_NVFP4) {
        v.s = __ldg(
            (const unsigned short *) (w.scale + (size_t) r * (size_t) (w.cols / NVFP4_GROUP)) + k);
    } else if (F == CKPT_LINEAR_FP8) {
        float s = w.global;
        if (w.scale_f32)
            s = __ldg(w.scale_f32 + ((size_t) r / 128) * (size_t) ((w.cols + 127) / 128)
                      + (size_t) k * N / 128);
        v.s = __float_as_uint(s);
    }
    return v;
}

// Element i of a vector (i a compile-time constant after unrolling); lin_at's value.
template <int F>
static __device__ __forceinline__ float vec_at(const RawVec &v, float global, int i)
{
    const uint32_t words[4] = {v.q.x, v.q.y, v.q.z, v.q.w};
    if (F == CKPT_LINEAR_F32) return __uint_as_float(words[i]);
    if (F == CKPT_LINEAR_BF16) {
        const uint32_t wd = words[i / 2];
        return __uint_as_float((i & 1) ? wd & 0xffff0000u : wd << 16);
    }
    if (F == CKPT_LINEAR_F16) {
        const uint32_t wd = words[i / 2];
        return __half2float(__ushort_as_half((unsigned short) ((i & 1) ? wd >> 16 : wd & 0xffffu)));
    }
    if (F == CKPT_LINEAR_FP8)
        return nvfp4_e4m3_to_float((uint8_t) (words[i / 4] >> (8 * (i % 4))) & 255u)
               * __uint_as_float(v.s);
    // NVFP4: code i is nibble i of the 16 bytes (low nibble first); codes 0..15 take scale
    // byte 0, 16..31 byte 1.
    const uint32_t code = (words[i / 8] >> (4 * (i % 8))) & 15u;
    return nvfp4_e2m1_to_float((uint8_t) code)
           * nvfp4_e4m3_to_float((uint8_t) (v.s >> (8 * (i / 16))) & 255u) * global;
}

// acc[j] += W[r, :] . xs[j][:] for j < nt, vector path: lane owns vectors lane, lane + 32,
// ... in that order, VEC_UNROLL loads in flight.
enum { VEC_UNROLL = 4 };
template <int F, int TOK>
static __device__ __forceinline__ void row_dot_vec(const DevLin &w, int r, const float *const *xs,
                                                   int nt, float *acc)
{
    constexpr int N = vec_elems(F);
    const int nk = w.cols / N, lane = threadIdx.x % 32;
    for (int k0 = lane; k0 < nk; k0 += 32 * VEC_UNROLL) {
        RawVec v[VEC_UNROLL];
#pragma unroll
        for (int u = 0; u < VEC_UNROLL; u++)
            if (k0 + 32 * u < nk) v[u] = raw_vec<F>(w, r, k0 + 32 * u);
#pragma unroll
        for (int u = 0; u < VEC_UNROLL; u++) {
            const int k = k0 + 32 * u;
            if (k >= nk) break;
            float wv[N];
#pragma unroll
            for (int i = 0; i < N; i++)
                wv[i] = vec_at<F>(v[u], w.global, i);
#pragma unroll
            for (int j = 0; j < TOK; j++) {
                if (j >= nt) break;
                const float4 *xp = (const float4 *) (xs[j] + (size_t) k * N);
#pragma unroll
                for (int i = 0; i < N / 4; i++) {
                    const float4 xv = xp[i];
                    acc[j] += wv[4 * i] * xv.x;
                    acc[j] += wv[4 * i + 1] * xv.y;
                    acc[j] += wv[4 * i + 2] * xv.z;
                    acc[j] += wv[4 * i + 3] * xv.w;
                }
            }
        }
    }
}

// acc[j] += W[r, :] . xs[j][:] for j < nt, any weight: the vector path when w.vec, else
// lane l sums columns l, l + 32, ... in order.
template <int TOK>
static __device__ __forceinline__ void row_dot(const DevLin &w, int r, const float *const *xs,
                                               int nt, float *acc)
{
    if (w.vec) {
        switch (w.format) {
        case CKPT_LINEAR_F32:
            row_dot_vec<CKPT_LINEAR_F32, TOK>(w, r, xs, nt, acc);
            return;
        case CKPT_LINEAR_BF16:
            row_dot_vec<CKPT_LINEAR_BF16, TOK>(w, r, xs, nt, acc);
            return;
        case CKPT_LINEAR_F16:
            row_dot_vec<CKPT_LINEAR_F16, TOK>(w, r, xs, nt, acc);
            return;
        case CKPT_LINEAR_FP8:
            row_dot_vec<CKPT_LINEAR_FP8, TOK>(w, r, xs, nt, acc);
            return;
        default:
            row_dot_vec<CKPT_LINEAR_NVFP4, TOK>(w, r, xs, nt, acc);
            return;
        }
    }
    for (int c = threadIdx.x % 32; c < w.cols; c += 32) {
        const float wv = lin_at(w, r, c);
#pragma unroll
        for (int j = 0; j < TOK; j++)
            if (j < nt) acc[j] += wv * xs[j][c];
    }
}

// y[t, r] = W[r, :] . x[t, :]; one warp per row and chunk of TOK tokens; chunks blockIdx.y
// + gridDim.y k. The same arithmetic per output element for any n and TOK.
template <int TOK>
static __global__ void __launch_bounds__(MM_WARPS * 32)
    k_gemv(float *y, DevLin w, const float *x, int n)
{
    const int r = blockIdx.x * MM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= w.rows) return;
    for (int t0 = blockIdx.y * TOK; t0 < n; t0 += gridDim.y * TOK) {
        const int nt = n - t0 < TOK ? n - t0 : TOK;
        const float *xs[TOK];
        float acc[TOK];
#pragma unroll
        for (int j = 0; j < TOK; j++) {
            xs[j] = x + (size_t) (t0 + (j < nt ? j : 0)) * w.cols;
            acc[j] = 0.0f;
        }
        row_dot<TOK>(w, r, xs, nt, acc);
#pragma unroll
        for (int j = 0; j < TOK; j++) {
            const float v = warp_sum(acc[j]);
            if (lane == 0 && j < nt) y[(size_t) (t0 + j) * w.rows + r] = v;
        }
    }
}

static __global__ void k_embed(float *y, DevLin w, const int *ids)
{
    const int t = blockIdx.x, id = ids[t];
    if (id < 0 || id >= w.rows) return;  // model.c validates ids on the host
    for (int c = threadIdx.x; c < w.cols; c += blockDim.x)
        y[(size_t) t * w.cols + c] = lin_at(w, id, c);
}

static __device__ __forceinline__ double warp_sum_double(double v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// DSA scores: block (t, chunk of THREADS / 32 positions), one warp per position s < pos[t] +
// 1; score[t, s] in double, each head's dot product lane-strided then summed across the
// warp, heads added in order.
static __global__ void k_dsa_scores(double *score, int cap, const float *q, const float *w,
                                    DevKv kv, const int *pos, BackendDsa p)
{
    const int t = blockIdx.x, lane = threadIdx.x % 32;
    const int s = blockIdx.y * (THREADS / 32) + threadIdx.x / 32;
    const int visible = pos[t] + 1;
    if (s >= visible || visible <= p.top_k) return;
    const unsigned char *page = kv_key_page(kv, t, s);
    const int row = s % kv.lo.block_size;
    const float *qt = q + (size_t) t * p.n_heads * p.head_dim;
    const float *wt = w + (size_t) t * p.n_heads;
    const double head_scale = 1.0 / sqrt((double) p.n_heads);
    const double dot_scale = 1.0 / sqrt((double) p.head_dim);
    double total = 0.0;
    for (int h = 0; h < p.n_heads; h++) {
        const float *qh = qt + (size_t) h * p.head_dim;
        double d = 0.0;
        for (int i = lane; i < p.head_dim; i += 32)
            d += (double) qh[i] * kv_key_value(&kv.lo, page, row, i);
        d = warp_sum_double(d) * dot_scale;
        if (d > 0.0) total += (double) wt[h] * head_scale * d;
    }
    if (lane == 0) score[(size_t) t * cap + s] = total;
}

// Order-preserving map of a double to an unsigned key (larger value, larger key).
static __device__ __forceinline__ unsigned long long order_key(double v)
{
    const unsigned long long u = (unsigned long long) __double_as_longlong(v);
    return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}

// Exclusive prefix count of pred over the block (threads in order) and the block's total.
// buf: shared int [THREADS / 32 + 1].
static __device__ int block_prefix(bool pred, int *total, int *buf)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    const unsigned ballot = __ballot_sync(0xffffffffu, pred);
    const int in_warp = __popc(ballot & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) buf[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < n_warps; w++) {
        if (w < warp) before += buf[w];
        all += buf[w];
    }
    *total = all;
    return before + in_warp;
}

// Top-k of the scores, positions ascending; one block per token. The tie rule (as the CPU
// backend): among equal scores the later position wins. A radix select over the 64-bit keys
// (8 passes of 8 bits) finds the k-th largest key T, how many keys equal T (the last pass's
// bin of T) and how many of them to take; a block scan in position order then writes every
// key > T and the last such equal ones. O(visible) work per pass.
static __global__ void k_dsa_select(int *sel, int *n_sel, const double *score, int cap,
                                    const int *pos, int top_k)
{
    __shared__ int hist[256];
    __shared__ int buf[THREADS / 32 + 1];
    __shared__ unsigned long long prefix_sh;
    __shared__ int need_sh;
    const int t = blockIdx.x, visible = pos[t] + 1;
    int *st = sel + (size_t) t * top_k;
    if (visible <= top_k) {
        for (int s = threadIdx.x; s < visible; s += blockDim.x)
            st[s] = s;
        if (threadIdx.x == 0) n_sel[t] = visible;
        return;
    }
    const double *sc = score + (size_t) t * cap;
    unsigned long long prefix = 0, mask = 0;
    int need = top_k;  // keys still to take among those matching prefix
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
            hist[i] = 0;
        __syncthreads();
        for (int s = threadIdx.x; s < visible; s += blockDim.x) {
            const unsigned long long key = order_key(sc[s]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // The highest bin b whose suffix count hist[b] + ... + hist[255] reaches need
            // (bin 0 at the latest); need_sh = need minus the count above b. Lane l owns
            // bins 8 l .. 8 l + 7; exactly one lane holds b.
            const int lane = threadIdx.x;
            int own = 0;
            for (int i = 0; i < 8; i++)
                own += hist[8 * lane + i];
            int suffix = own;  // inclusive suffix sum over lanes lane .. 31
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_down_sync(0xffffffffu, suffix, o);
                if (lane + o < 32) suffix += v;
            }
            const int above = suffix - own;  // bins of the lanes above this one
            if (above < need && (above + own >= need || lane == 0)) {
                int cum = above, b = 8 * lane + 7;
                for (; b > 0 && b >= 8 * lane; b--) {
                    if (cum + hist[b] >= need) break;
                    cum += hist[b];
                }
                need_sh = need - cum;
                prefix_sh = prefix | ((unsigned long long) b << shift);
            }
        }
        __syncthreads();
        need = need_sh;
        prefix = prefix_sh;
        mask |= 255ull << shift;
        __syncthreads();
    }
    // prefix is the k-th largest key; take every larger key and the last `need` equal ones.
    // The last pass's bin of prefix counted exactly the keys equal to it.
    const int n_eq = hist[prefix & 255];
    int eq_before = 0, out_before = 0;
    for (int s0 = 0; s0 < visible; s0 += blockDim.x) {
        const int s = s0 + threadIdx.x;
        const unsigned long long key = s < visible ? order_key(sc[s]) : 0;
        const bool eq = s < visible && key == prefix;
        int eq_total, out_total;
        const int eq_rank = eq_before + block_prefix(eq, &eq_total, buf);
        const bool take = s < visible && (key > prefix || (eq && eq_rank >= n_eq - need));
        const int out = out_before + block_prefix(take, &out_total, buf);
        if (take) st[out] = s;
        eq_before += eq_total;
        out_before += out_total;
    }
    if (threadIdx.x == 0) n_sel[t] = top_k;
}

// MLA attention, absorbed form, in five launches so that long contexts spread over the GPU:
// q_lat per (t, h); scores with one warp per key; softmax statistics per (t, h); partial
// o_lat per split of MLA_SPLIT keys; then the splits summed in order and projected by W_uv.
// Split boundaries depend only on the key index, so a token's result does not depend on n.
enum { MLA_SPLIT = 256 };

// Keys of token t: sel row or every position up to pos[t].
static __device__ __forceinline__ int mla_n_keys(const int *pos, const int *n_sel, int t)
{
    return n_sel ? n_sel[t] : pos[t] + 1;
}

// q_lat [t, h, L] = W_uk[h]^T q_nope; block (t, h, chunk of 32 channels): lane = channel,
// warp w sums rows i = w, w + 8, ...; the warps' sums added in warp order.
static __global__ void k_mla_qlat(double *q_lat, const float *q, DevLin kv_b, BackendMla p)
{
    __shared__ double part[THREADS / 32][32];
    const int t = blockIdx.x, h = blockIdx.y, L = p.kv_lora, qk = p.qk_nope + p.qk_rope;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, c = blockIdx.z * 32 + lane;
    const float *qt = q + ((size_t) t * p.n_heads + h) * qk;
    const int row0 = h * (p.qk_nope + p.v_dim);
    double acc = 0.0;
    if (c < L)
        for (int i = warp; i < p.qk_nope; i += THREADS / 32)
            acc += (double) qt[i] * lin_at(kv_b, row0 + i, c);
    part[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && c < L) {
        double sum = 0.0;
        for (int k = 0; k < THREADS / 32; k++)
            sum += part[k][lane];
        q_lat[((size_t) t * p.n_heads + h) * L + c] = sum;
    }
}

// prob[t, h, j] = score of key j; block (t, h, chunk of 8 keys), one warp per key.
static __global__ void k_mla_scores(double *prob, int cap, const double *q_lat, const float *q,
                                    DevKv kv, const int *pos, const int *sel, const int *n_sel,
                                    int sel_stride, BackendMla p)
{
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x % 32;
    const int j = blockIdx.z * (THREADS / 32) + threadIdx.x / 32;
    if (j >= mla_n_keys(pos, n_sel, t)) return;
    const int L = p.kv_lora, qk = p.qk_nope + p.qk_rope;
    const int s = sel ? sel[(size_t) t * sel_stride + j] : j;
    const unsigned char *e = kv_at(kv, t, s);
    const double *ql = q_lat + ((size_t) t * p.n_heads + h) * L;
    const float *qr = q + ((size_t) t * p.n_heads + h) * qk + p.qk_nope;
    double d = 0.0;
    for (int c = lane; c < L; c += 32)
        d += ql[c] * kv_entry_value(&kv.lo, e, c);
    for (int i = lane; i < p.qk_rope; i += 32)
        d += (double) qr[i] * kv_entry_value(&kv.lo, e, L + i);
    for (int o = 16; o > 0; o >>= 1)
        d += __shfl_xor_sync(0xffffffffu, d, o);
    if (lane == 0) prob[((size_t) t * p.n_heads + h) * cap + j] = d * p.scale;
}

// prob -> exp(prob - max) / (their sum), stat[t, h] = the sum; block (t, h).
static __global__ void k_mla_softmax(double *prob, double *stat, int cap, const int *pos,
                                     const int *n_sel, int n_heads)
{
    __shared__ double buf[THREADS / 32];
    const int t = blockIdx.x, h = blockIdx.y, n_keys = mla_n_keys(pos, n_sel, t);
    double *pr = prob + ((size_t) t * n_heads + h) * cap;
    double mx = -INFINITY;
    for (int j = threadIdx.x; j < n_keys; j += blockDim.x)
        mx = fmax(mx, pr[j]);
    mx = block_reduce(mx, 1, buf);
    double sum = 0.0;
    for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
        pr[j] = exp(pr[j] - mx);
        sum += pr[j];
    }
    sum = block_reduce(sum, 0, buf);
    for (int j = threadIdx.x; j < n_keys; j += blockDim.x)
        pr[j] = pr[j] / sum;  // each thread normalizes the entries it wrote
    if (threadIdx.x == 0) stat[(size_t) t * n_heads + h] = sum;
}

// part[t, h, split, c] = sum over the split's keys of p_j latent_j[c] (p normalized by
// k_mla_softmax); block (t, h, split), keys in order.
static __global__ void k_mla_pv(double *part, int n_split, const double *prob, int cap, DevKv kv,
                                const int *pos, const int *sel, const int *n_sel, int sel_stride,
                                BackendMla p)
{
    __shared__ const unsigned char *rows[MLA_SPLIT];  // the split's cache entries
    __shared__ double pn[MLA_SPLIT];                  // and their probabilities
    const int t = blockIdx.x, h = blockIdx.y, split = blockIdx.z, L = p.kv_lora;
    const int n_keys = mla_n_keys(pos, n_sel, t);
    const int j0 = split * MLA_SPLIT;
    if (j0 >= n_keys) return;  // k_mla_out reads only the splits that hold keys
    const int j1 = j0 + MLA_SPLIT < n_keys ? j0 + MLA_SPLIT : n_keys, nj = j1 - j0;
    const double *pr = prob + ((size_t) t * p.n_heads + h) * cap;
    for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        rows[j - j0] = kv_at(kv, t, sel ? sel[(size_t) t * sel_stride + j] : j);
        pn[j - j0] = pr[j];
    }
    __syncthreads();
    double *pt = part + (((size_t) t * p.n_heads + h) * n_split + split) * L;
    for (int c = threadIdx.x; c < L; c += blockDim.x) {
        double acc = 0.0;
#pragma unroll 8
        for (int j = 0; j < nj; j++)
            acc += pn[j] * kv_entry_value(&kv.lo, rows[j], c);
        pt[c] = acc;
    }
}

// out[t, h] = W_uv[h] (sum of the splits in order); block (t, h). Shared: double o_lat [L].
static __global__ void k_mla_out(float *out, const double *part, int n_split, DevLin kv_b,
                                 const int *pos, const int *n_sel, BackendMla p)
{
    extern __shared__ double o_lat[];
    const int t = blockIdx.x, h = blockIdx.y, L = p.kv_lora;
    const int used = (mla_n_keys(pos, n_sel, t) + MLA_SPLIT - 1) / MLA_SPLIT;
    const double *pt = part + ((size_t) t * p.n_heads + h) * n_split * L;
    for (int c = threadIdx.x; c < L; c += blockDim.x) {
        double acc = 0.0;
        for (int sp = 0; sp < used; sp++)
            acc += pt[(size_t) sp * L + c];
        o_lat[c] = acc;
    }
    __syncthreads();
    // One warp per output j, lanes over the latent channels (coalesced weight rows).
    const int row0 = h * (p.qk_nope + p.v_dim), lane = threadIdx.x % 32;
    float *ot = out + ((size_t) t * p.n_heads + h) * p.v_dim;
    for (int j = threadIdx.x / 32; j < p.v_dim; j += blockDim.x / 32) {
        double d = 0.0;
        for (int c = lane; c < L; c += 32)
            d += lin_at(kv_b, row0 + p.qk_nope + j, c) * o_lat[c];
        d = warp_sum_double(d);
        if (lane == 0) ot[j] = (float) d;
    }
}

// Values offset .. offset + width of token t, stored as kv_cache.h's kv_store_part stores them
// (the CPU backend's kv_store runs the same parts, so both store the same bytes): block t.
// f32 and bf16: a thread per value (kv_store_part). fp8: a warp per part (a latent scale
// group, k_pe, the index key), its lanes over the part's values (kv_fp8_group_store_warp).
static __device__ void kv_fp8_group_store_warp(unsigned char *codes, unsigned char *scale_at,
                                               const float *src, int n, int lane)
{
    // kv_fp8_group_store with the amax split over the lanes: a maximum does not depend on the
    // order of the comparisons, so the scale and every code are the same.
    float amax = 0.0f;
    for (int i = lane; i < n; i += 32)
        amax = fmaxf(amax, fabsf(src[i]));
    for (int o = 16; o > 0; o >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int i = lane; i < n; i += 32)
        codes[i] = nvfp4_float_to_e4m3(src[i] / scale);
    if (lane == 0) memcpy(scale_at, &scale, sizeof scale);
}

static __global__ void k_kv_write(DevKv kv, const int *pos, int offset, const float *src, int width)
{
    const int t = blockIdx.x, row = pos[t] % kv.lo.block_size;
    unsigned char *e = (unsigned char *) kv_at(kv, t, pos[t]);
    unsigned char *page = kv.lo.key_page ? (unsigned char *) kv_key_page(kv, t, pos[t]) : NULL;
    const float *st = src + (size_t) t * width;
    const KvEntryLayout &lo = kv.lo;
    if (lo.dtype != KV_DTYPE_FP8) {
        for (int p = threadIdx.x; p < width; p += blockDim.x)
            kv_store_part(&lo, e, page, row, offset, st, width, p);
        return;
    }
    // The parts of kv_store_part's fp8 branch, in its order: latent groups, k_pe, index key.
    const int lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    const int pe0 = lo.kv_lora, idx0 = lo.kv_lora + lo.rope_dim, end = offset + width;
    const int groups = (lo.kv_lora + KV_FP8_GROUP - 1) / KV_FP8_GROUP;
    for (int part = threadIdx.x / 32; part < groups + 2; part += n_warps) {
        if (part < groups) {
            if (offset >= pe0) continue;
            const int g0 = part * KV_FP8_GROUP;
            const int n = lo.kv_lora - g0 < KV_FP8_GROUP ? lo.kv_lora - g0 : KV_FP8_GROUP;
            kv_fp8_group_store_warp(e + g0, e + lo.lat_scale + 4 * part, st + g0 - offset, n, lane);
        } else if (part == groups) {
            for (int i = (offset > pe0 ? offset : pe0) + lane; i < end && i < idx0; i += 32)
                kv_bf16_store(e + lo.pe + 2 * (i - pe0), st[i - offset]);
        } else if (end > idx0) {
            kv_fp8_group_store_warp(page + (size_t) row * lo.key_bytes,
                                    page + lo.key_scales + 4 * row, st + idx0 - offset,
                                    lo.index_dim, lane);
        }
    }
}

// Group the slots (t, k) by expert: meta = offsets [E + 1] | n_active [1] | active [E] |
// list [n K]. The slots of expert e are list[offsets[e] .. offsets[e + 1]), in no
// particular order (each slot's result does not depend on the others); active holds the
// experts with slots, ascending. One block.
static __global__ void k_moe_group(int *meta, const int *idx, int n_slots, int E)
{
    extern __shared__ int cnt[];  // [2 E]: counts, then cursors
    int *offsets = meta, *n_active = meta + E + 1, *active = n_active + 1, *list = active + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        cnt[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x)
        atomicAdd(&cnt[idx[s]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0, na = 0;
        for (int e = 0; e < E; e++) {
            offsets[e] = acc;
            cnt[E + e] = acc;
            acc += cnt[e];
            if (cnt[e]) active[na++] = e;
        }
        offsets[E] = acc;
        *n_active = na;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x)
        list[atomicAdd(&cnt[E + idx[s]], 1)] = s;
}

// The expert of MoE block row blockIdx.y (an index into meta's active list), or -1.
static __device__ __forceinline__ int moe_expert(const int *meta, int E)
{
    const int a = blockIdx.y;
    return a < meta[E + 1] ? meta[E + 2 + a] : -1;
}

// Input rows of slots list[i0 .. i0 + nt) of x: per token ([n, cols], x_per_slot 0) or per
// slot ([n K, cols]).
template <int TOK>
static __device__ __forceinline__ void moe_inputs(const float **xs, const int *list, int i0, int nt,
                                                  const float *x, int x_per_slot, int top_k,
                                                  int cols)
{
#pragma unroll
    for (int j = 0; j < TOK; j++) {
        const int slot = list[i0 + (j < nt ? j : 0)];
        xs[j] = x + (size_t) (x_per_slot ? slot : slot / top_k) * cols;
    }
}

// Routed experts, gate and up with the activation: h[slot, r] = silu(gate_e x) * (up_e x)
// (act_silu_mul's formula, kernels/act.h) for each slot of active expert e; block (row block, active
// expert), one warp per row over e's slots in chunks of TOK (each weight read once per
// chunk). Per output element the arithmetic of k_gemv, whatever the grouping.
template <int TOK>
static __global__ void __launch_bounds__(MM_WARPS * 32)
    k_moe_gateup(float *h, const DevLin *table, const int *meta, int E, const float *x, int top_k,
                 int xvec)
{
    const int e = moe_expert(meta, E), lane = threadIdx.x % 32;
    if (e < 0) return;
    DevLin wg = table[3 * e], wu = table[3 * e + 1];
    wg.vec &= xvec;  // x not 16-byte aligned: the element path
    wu.vec &= xvec;
    const int r = blockIdx.x * MM_WARPS + threadIdx.x / 32;
    if (r >= wg.rows) return;
    const int *list = meta + 2 * E + 2;
    const int begin = meta[e], end = meta[e + 1];
    for (int i0 = begin; i0 < end; i0 += TOK) {
        const int nt = end - i0 < TOK ? end - i0 : TOK;
        const float *xs[TOK];
        float ag[TOK], au[TOK];
        moe_inputs<TOK>(xs, list, i0, nt, x, 0, top_k, wg.cols);
#pragma unroll
        for (int j = 0; j < TOK; j++)
            ag[j] = au[j] = 0.0f;
        row_dot<TOK>(wg, r, xs, nt, ag);
        row_dot<TOK>(wu, r, xs, nt, au);
#pragma unroll
        for (int j = 0; j < TOK; j++) {
            const double g = warp_sum(ag[j]);
            const float u = warp_sum(au[j]);
            if (lane == 0 && j < nt)
                h[(size_t) list[i0 + j] * wg.rows + r] = (float) (g / (1.0 + exp(-g)) * u);
        }
    }
}

// Routed experts, down: y[slot, r] = down_e h[slot]; blocks as k_moe_gateup.
template <int TOK>
static __global__ void __launch_bounds__(MM_WARPS * 32)
    k_moe_down(float *y, const DevLin *table, const int *meta, int E, const float *h, int top_k)
{
    const int e = moe_expert(meta, E), lane = threadIdx.x % 32;
    if (e < 0) return;
    const DevLin w = table[3 * e + 2];
    const int r = blockIdx.x * MM_WARPS + threadIdx.x / 32;
    if (r >= w.rows) return;
    const int *list = meta + 2 * E + 2;
    const int begin = meta[e], end = meta[e + 1];
    for (int i0 = begin; i0 < end; i0 += TOK) {
        const int nt = end - i0 < TOK ? end - i0 : TOK;
        const float *xs[TOK];
        float acc[TOK];
        moe_inputs<TOK>(xs, list, i0, nt, h, 1, top_k, w.cols);
#pragma unroll
        for (int j = 0; j < TOK; j++)
            acc[j] = 0.0f;
        row_dot<TOK>(w, r, xs, nt, acc);
#pragma unroll
        for (int j = 0; j < TOK; j++) {
            const float v = warp_sum(acc[j]);
            if (lane == 0 && j < nt) y[(size_t) list[i0 + j] * w.rows + r] = v;
        }
    }
}

// out[t, c] = sum over the token's slots in ascending expert order of ye[slot, c] wts[slot].
static __global__ void k_moe_combine(float *out, const float *ye, const int *idx, const float *wts,
                                     int n, int top_k, int hidden)
{
    const size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x;
    if (i >= (size_t) n * hidden) return;
    const int t = (int) (i / hidden), c = (int) (i % hidden);
    const int *it = idx + (size_t) t * top_k;
    float acc = 0.0f;
    int last_e = -1, last_k = -1;
    for (int done = 0; done < top_k; done++) {
        // Next slot by (expert, slot) ascending.
        int best = -1;
        for (int k = 0; k < top_k; k++) {
            const bool after = it[k] > last_e || (it[k] == last_e && k > last_k);
            if (after && (best < 0 || it[k] < it[best])) best = k;
        }
        last_e = it[best];
        last_k = best;
        const size_t slot = (size_t) t * top_k + best;
        acc = __fadd_rn(acc, __fmul_rn(ye[slot * hidden + c], wts[slot]));
    }
    out[i] = acc;
}

// Synthetic weight bytes (backend_cuda_random_linear): a hash of (seed, index) shaped into
// finite values: bf16 / f16 / fp8 codes near 2^-4 with a random sign, any NVFP4 code, e4m3
// group scales between 2^-2 and 2^1.
static __device__ __forceinline__ uint32_t mix32(unsigned long long x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t) x;
}

static __global__ void k_random_fill(uint32_t *words, size_t n_words, int kind,
                                     unsigned long long seed)
{
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n_words;
         i += (size_t) gridDim.x * blockDim.x) {
        const uint32_t r = mix32(seed * 0x9e3779b97f4a7c15ull + i), r2 = mix32(~seed + 7 * i);
        uint32_t v = r;
        if (kind == 1)  // two bf16
            v = ((r & 0x8000u) | (0x3b00u + (r2 & 0x1ffu)))
                | ((r & 0x80000000u) | ((0x3b00u + ((r2 >> 16) & 0x1ffu)) << 16));
        else if (kind == 2)  // four fp8 / e4m3 scales: 0x28 + (0 .. 23) and a sign (fp8)
            v = (0x28u + (r & 0xffu) % 24u) | (0x28u + ((r >> 8) & 0xffu) % 24u) << 8
                | (0x28u + ((r >> 16) & 0xffu) % 24u) << 16 | (0x28u + (r >> 24) % 24u) << 24;
        words[i] = v;
    }
}

// ---------------------------------------------------------------------------
// Host side

static void check_launch(const char *what)
{
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        log_fatal(__FILE__, __LINE__, "CUDA: %s: %s", what, cudaGetErrorString(e));
}

// Host work that cannot be part of a graph (allocation, synchronous copy) must not happen
// while one is captured: graph_begin captures only a call whose allocations an eager call
// with the same key made already, so reaching this is a bug in that bookkeeping.
static void no_capture(const CudaImpl *impl, const char *what)
{
    if (impl->mode == GRAPH_CAPTURE)
        log_fatal(__FILE__, __LINE__, "CUDA backend: %s while capturing a graph", what);
}

// Profiling (GLMSPARK_CUDA_PROFILE=1): the GPU is idle at prof_begin, and prof_end waits
// for the op, so each op's wall time is its own (plus one launch and sync).
static void prof_begin(CudaImpl *impl)
{
    if (!impl->profile) return;
    CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    impl->prof_t0 = clock_now_s();
}

static void prof_end(CudaImpl *impl, int op, double weight_bytes)
{
    if (!impl->profile) return;
    CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    impl->prof_s[op] += clock_now_s() - impl->prof_t0;
    impl->prof_bytes[op] += weight_bytes;
    impl->prof_calls[op]++;
}

// Bytes of a stored weight: 16 per vector of vec_elems, plus NVFP4's group scales.
static double lin_bytes(const CkptLinear *w)
{
    const double n = (double) w->rows * (double) w->cols;
    return n * 16.0 / vec_elems((int) w->format)
           + (w->format == CKPT_LINEAR_NVFP4 ? n / NVFP4_GROUP : 0.0);
}

static unsigned grid_1d(size_t n)
{
    const size_t g = (n + THREADS - 1) / THREADS;
    return (unsigned) (g < 65535 ? (g ? g : 1) : 65535);
}

// Scratch buffer `slot` of at least `bytes` (grows geometrically; contents not kept).
static void *scratch(CudaImpl *impl, int slot, size_t bytes)
{
    if (impl->scratch_bytes[slot] < bytes) {
        const size_t grown =
            bytes < 2 * impl->scratch_bytes[slot] ? 2 * impl->scratch_bytes[slot] : bytes;
        no_capture(impl, "scratch growth");
        impl->gen++;
        if (impl->scratch[slot]) CUDA_CHECK(cudaFree(impl->scratch[slot]));
        impl->scratch[slot] = NULL;
        CUDA_CHECK(cudaMalloc(&impl->scratch[slot], grown));
        impl->scratch_bytes[slot] = grown;
    }
    return impl->scratch[slot];
}

// The device pool mirroring kv's (created zeroed on first use).
static unsigned char *dev_pool(CudaImpl *impl, const KvCache *kv)
{
    const size_t bytes = kv->block_bytes * (size_t) kv->params.n_blocks;
    DevPool *free_slot = NULL;
    for (int i = 0; i < MAX_POOLS; i++) {
        DevPool *d = &impl->pools[i];
        if (d->kv == kv) {
            if (d->serial == kv->serial && d->bytes == bytes) return (unsigned char *) d->dev;
            CUDA_CHECK(cudaFree(d->dev));  // the cache was freed and set up again at this address
            memset(d, 0, sizeof *d);
        }
        if (!d->kv && !free_slot) free_slot = d;
    }
    if (!free_slot)
        log_fatal(__FILE__, __LINE__, "more than %d KV caches on one CUDA backend", MAX_POOLS);
    no_capture(impl, "a KV pool allocation");
    impl->gen++;
    void *p = NULL;
    CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    CUDA_CHECK(cudaMemset(p, 0, bytes ? bytes : 1));
    *free_slot = (DevPool){kv, kv->serial, bytes, p};
    return (unsigned char *) p;
}

// The row length of a step's device block tables: the longest sequence's block count, and
// between graph_begin and graph_end that count rounded up to a power of two (at least 8).
// Kernels take it, and bounds derived from it (seq_capacity), as launch arguments, so a
// recorded graph stays valid while the sequences grow inside it: a decode step is
// re-recorded when the longest sequence passes 8, 16, 32 ... blocks (1K, 2K, 4K ... positions
// of 128), not at every block. Ungraphed calls (prefill) keep the exact count, which sizes
// their per-position buffers.
static int table_stride(const CudaImpl *impl, KvSeq *const *seqs, int n_seqs)
{
    int blocks = 1;
    for (int i = 0; i < n_seqs; i++)
        if (seqs[i]->n_blocks > blocks) blocks = seqs[i]->n_blocks;
    if (impl->mode == GRAPH_NONE) return blocks;
    int stride = 8;
    while (stride < blocks)
        stride *= 2;
    return stride;
}

// The block tables of a step's sequences in device memory (DevStep), compared with the host
// tables on every call (a few ints per sequence) and uploaded only when they differ: a decode
// step uploads nothing unless a sequence gained a block or the batch changed. A graphed call
// (between graph_begin and graph_end) takes the slot of (kv, n_seqs, stride), the least
// recently used one recycled; new contents go into the same device rows, so the graphs
// recorded with a slot read the current tables when replayed, whichever sequences the batch
// holds (graph_begin calls this first). Recycling a slot gives it a new serial, which retires
// the graphs recorded with it (graph keys hold it).
// Ungraphed calls (prefill chunks, exact strides) share step_eager.
static const DevStep *dev_step(CudaImpl *impl, const KvCache *kv, KvSeq *const *seqs, int n_seqs)
{
    ASSERT(n_seqs > 0 && kv);
    const int stride = table_stride(impl, seqs, n_seqs);
    const int need = n_seqs * stride;
    if (need > impl->step_tmp_cap) {
        free(impl->step_tmp);
        impl->step_tmp_cap = 2 * need > 1024 ? 2 * need : 1024;
        impl->step_tmp = (int *) malloc((size_t) impl->step_tmp_cap * sizeof(int));
        if (!impl->step_tmp) log_fatal(__FILE__, __LINE__, "out of memory");
    }
    int *tmp = impl->step_tmp;
    for (int i = 0; i < n_seqs; i++) {
        const KvSeq *q = seqs[i];
        if (q->n_blocks)
            memcpy(tmp + (size_t) i * stride, q->blocks, (size_t) q->n_blocks * sizeof(int));
        memset(tmp + (size_t) i * stride + q->n_blocks, 0,
               (size_t) (stride - q->n_blocks) * sizeof(int));
    }
    DevStep *slot = NULL;
    bool fresh = false;
    if (impl->mode == GRAPH_NONE) {
        slot = &impl->step_eager;
    } else {
        DevStep *lru = &impl->steps[0];
        for (int i = 0; i < MAX_STEPS && !slot; i++) {
            DevStep *d = &impl->steps[i];
            if (d->kv == kv && d->n_seqs == n_seqs && d->stride == stride)
                slot = d;
            else if (d->used < lru->used)
                lru = d;
        }
        if (!slot) {
            slot = lru;
            slot->serial = ++impl->step_serial;
            slot->kv = kv;
            slot->n_seqs = n_seqs;
            slot->stride = stride;
            fresh = true;  // uploaded below (its rows kept if they fit)
        }
    }
    slot->used = ++impl->clock;
    if (!fresh && slot->cap >= need && slot->stride == stride && slot->n_seqs == n_seqs
        && memcmp(slot->host, tmp, (size_t) need * sizeof(int)) == 0)
        return slot;
    no_capture(impl, "a block-table upload");
    if (need > slot->cap) {
        // A graphed slot is new here (its serial changed: no graph refers to these rows);
        // step_eager is read by no graph. cudaFree waits for the device.
        const int cap = 2 * need > 64 ? 2 * need : 64;
        free(slot->host);
        if (slot->dev) CUDA_CHECK(cudaFree(slot->dev));
        slot->host = (int *) malloc((size_t) cap * sizeof(int));
        if (!slot->host) log_fatal(__FILE__, __LINE__, "out of memory");
        CUDA_CHECK(cudaMalloc(&slot->dev, (size_t) cap * sizeof(int)));
        slot->cap = cap;
    }
    memcpy(slot->host, tmp, (size_t) need * sizeof(int));
    // On the stream: after the kernels of earlier steps that read these rows (a pageable
    // source is staged before the call returns, so slot->host may change afterwards).
    CUDA_CHECK(cudaMemcpyAsync(slot->dev, slot->host, (size_t) need * sizeof(int),
                               cudaMemcpyHostToDevice, impl->stream));
    slot->n_seqs = n_seqs;
    slot->stride = stride;
    return slot;
}

static DevKv dev_kv(CudaImpl *impl, const KvCache *kv, const BackendSeqs *s, int layer)
{
    const DevStep *st = dev_step(impl, kv, s->seqs, s->n_seqs);
    const unsigned char *pool = dev_pool(impl, kv);
    DevKv d = {pool + kv->mla_offset[layer],
               pool + kv->key_offset[layer],
               st->dev,
               st->stride,
               s->seq_of,
               kv->entry[layer]};
    return d;
}

static void *cuda_alloc(Backend *be, size_t bytes)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    no_capture(impl, "alloc");
    impl->gen++;
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void) cudaGetLastError();
        return NULL;
    }
    CUDA_CHECK(cudaMemset(p, 0, bytes ? bytes : 1));
    return p;
}

static void cuda_free_mem(Backend *be, void *p)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    no_capture(impl, "free_mem");
    impl->gen++;
    if (p) CUDA_CHECK(cudaFree(p));
}

static void cuda_upload(Backend *be, void *dst, const void *src_host, size_t bytes)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    no_capture(impl, "upload");
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, impl->stream));
    CUDA_CHECK(cudaStreamSynchronize(impl->stream));
}

static void cuda_pin_host(Backend *be, void *p, size_t bytes)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (!p || !bytes) return;
    CUDA_CHECK(cudaSetDevice(impl->device));
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {  // the copies still work, through a staging buffer
        (void) cudaGetLastError();
        LOG_WARN("CUDA: could not page-lock %zu bytes of host memory (%s): downloads into it "
                 "go through a staging buffer",
                 bytes, cudaGetErrorString(e));
        return;
    }
}

static void cuda_unpin_host(Backend *be, void *p)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (!p) return;
    CUDA_CHECK(cudaSetDevice(impl->device));
    if (cudaHostUnregister(p) != cudaSuccess)
        (void) cudaGetLastError();  // never pinned (cuda_pin_host warned)
}

static void cuda_download(Backend *be, void *dst_host, const void *src, size_t bytes)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    no_capture(impl, "download");
    if (!bytes) return;
    // The device's queued work first, then the copy alone, timed (the summary at destroy).
    CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    const double t0 = clock_now_s();
    CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, impl->stream));
    CUDA_CHECK(cudaStreamSynchronize(impl->stream));
    impl->download_s += clock_now_s() - t0;
    impl->download_bytes += bytes;
    impl->n_downloads++;
}

// Device memory of `bytes` bytes, remembered for destroy; NULL when out of memory.
static void *keep_alloc(CudaImpl *impl, size_t bytes)
{
    if (impl->n_allocs == impl->cap_allocs) {
        const int cap = impl->cap_allocs ? 2 * impl->cap_allocs : 256;
        void **a = (void **) realloc(impl->allocs, (size_t) cap * sizeof *a);
        if (!a) return NULL;
        impl->allocs = a;
        impl->cap_allocs = cap;
    }
    no_capture(impl, "a weight allocation");
    impl->gen++;
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void) cudaGetLastError();
        return NULL;
    }
    impl->allocs[impl->n_allocs++] = p;
    return p;
}

// A device copy of host bytes, remembered for destroy; NULL when out of memory.
static void *keep_copy(CudaImpl *impl, const void *src, size_t bytes)
{
    void *p = keep_alloc(impl, bytes);
    if (p && bytes) CUDA_CHECK(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
    return p;
}

// The padded copy of a bf16 weight bound at host rows (PadLin), registered under w->data.
static Err pad_linear(CudaImpl *impl, const CkptLinear *w, const uint16_t *host)
{
    const size_t rows = (size_t) w->rows, cols = (size_t) w->cols, cols_p = (cols + 7) / 8 * 8;
    uint16_t *b = (uint16_t *) calloc(rows * cols_p, 2);
    if (!b) return ERR_NOMEM;
    for (size_t r = 0; r < rows; r++)
        memcpy(b + r * cols_p, host + r * cols, cols * 2);
    void *padded = keep_copy(impl, b, rows * cols_p * 2);
    free(b);
    if (!padded) {
        LOG_ERROR("out of GPU memory padding %s", w->name ? w->name : "a weight");
        return ERR_NOMEM;
    }
    impl->pad_lins[impl->n_pad_lins++] = (PadLin){w->data, (const uint16_t *) padded, (int) cols_p};
    return ERR_OK;
}

// After binding w (host: its values as stored, or as rounded to bf16): the padded copy the
// tuned GEMV reads, where the BF16 recipe runs a bf16 weight whose columns are not in 8s.
static Err bind_padded(Backend *be, const CkptLinear *w, const void *host)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (be->precision != BACKEND_PRECISION_BF16 || w->format != CKPT_LINEAR_BF16 || w->cols % 8 == 0
        || impl->n_pad_lins == MAX_PAD_LINS)
        return ERR_OK;
    return pad_linear(impl, w, (const uint16_t *) host);
}

static const PadLin *pad_lin(const CudaImpl *impl, const CkptLinear *w)
{
    for (int i = 0; i < impl->n_pad_lins; i++)
        if (impl->pad_lins[i].data == w->data) return &impl->pad_lins[i];
    return NULL;
}

static Err cuda_bind_linear(Backend *be, CkptLinear *w)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    const size_t n = (size_t) w->rows * (size_t) w->cols;
    if (backend_bind_rounds(be, w)) {  // the BF16 recipe stores an f32 weight in bf16
        uint16_t *b = (uint16_t *) malloc(n * 2);
        if (!b) return ERR_NOMEM;
        backend_round_linear(w, b);
        void *data = keep_copy(impl, b, n * 2);
        Err err = ERR_NOMEM;
        if (data) {
            w->data = data;
            w->format = CKPT_LINEAR_BF16;
            err = bind_padded(be, w, b);
        } else {
            LOG_ERROR("out of GPU memory binding %s (%zu bytes)", w->name ? w->name : "a weight",
                      n * 2);
        }
        free(b);
        return err;
    }
    size_t data_bytes = 0, scale_bytes = 0, scale_f32_bytes = 0;
    switch (w->format) {
    case CKPT_LINEAR_F32:
        data_bytes = n * 4;
        break;
    case CKPT_LINEAR_F16:
    case CKPT_LINEAR_BF16:
        data_bytes = n * 2;
        break;
    case CKPT_LINEAR_FP8:
        data_bytes = n;
        if (w->scale_f32)
            scale_f32_bytes =
                (((size_t) w->rows + 127) / 128) * (((size_t) w->cols + 127) / 128) * sizeof(float);
        break;
    case CKPT_LINEAR_NVFP4:
        data_bytes = n / 2;
        scale_bytes = n / NVFP4_GROUP;
        break;
    default:
        LOG_ERROR("%s: unknown weight format %d", w->name ? w->name : "weight", (int) w->format);
        return ERR_INVAL;
    }
    void *data = keep_copy(impl, w->data, data_bytes);
    void *scale = scale_bytes ? keep_copy(impl, w->scale, scale_bytes) : NULL;
    void *scale_f32 = scale_f32_bytes ? keep_copy(impl, w->scale_f32, scale_f32_bytes) : NULL;
    if (!data || (scale_bytes && !scale) || (scale_f32_bytes && !scale_f32)) {
        LOG_ERROR("out of GPU memory binding %s (%zu bytes)", w->name ? w->name : "a weight",
                  data_bytes + scale_bytes + scale_f32_bytes);
        return ERR_NOMEM;
    }
    const void *host = w->data;
    w->data = data;
    if (scale_bytes) w->scale = (const uint8_t *) scale;
    if (scale_f32_bytes) w->scale_f32 = (const float *) scale_f32;
    return bind_padded(be, w, host);
}

// Under the BF16 recipe, experts the tuned kernels take (backend_moe_tuned with any top_k
// they allow) are stacked in one allocation per array and packed there as kernels/moe.h lays
// them out (on the GPU, an expert at a time through a staging buffer); each CkptLinear then
// points at its packed rows, which only kernels/moe.h reads. Others, and every expert under
// the F32 recipe, are bound one by one in their stored format.
static Err cuda_bind_experts(Backend *be, CkptLinear *experts, int n_experts)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    // A model loaded after another may reuse a freed experts array's address: forget what
    // was kept for that address (the device memory stays until destroy, as every weight's).
    for (int i = 0; i < impl->n_stacks; i++)
        if (impl->stacks[i].experts == experts) impl->stacks[i--] = impl->stacks[--impl->n_stacks];
    for (int i = 0; i < impl->n_tables; i++)
        if (impl->tables[i].host == experts) {
            impl->gen++;  // graphs may hold the table
            CUDA_CHECK(cudaFree(impl->tables[i].dev));
            impl->tables[i--] = impl->tables[--impl->n_tables];
        }
    if (be->precision != BACKEND_PRECISION_BF16 || !backend_moe_tuned(experts, n_experts, 1)
        || impl->n_stacks == MAX_EXPERT_TABLES) {
        for (int i = 0; i < 3 * n_experts; i++) {
            const Err err = cuda_bind_linear(be, &experts[i]);
            if (err) return err;
        }
        return ERR_OK;
    }
    const size_t E = (size_t) n_experts, hidden = (size_t) experts[0].cols,
                 inter = (size_t) experts[0].rows;
    for (size_t i = 0; i < 3 * E; i++) {
        const CkptLinear *w = &experts[i];
        const bool down = i % 3 == 2;
        if ((size_t) w->rows != (down ? hidden : inter)
            || (size_t) w->cols != (down ? inter : hidden)) {
            LOG_ERROR("%s: expert shape [%d, %d] differs from the layer's", w->name, w->rows,
                      w->cols);
            return ERR_INVAL;
        }
    }
    int smem_max = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                      impl->device));
    const size_t smem = moe_experts_smem_bytes((int) hidden, (int) inter);
    if (smem > (size_t) smem_max) {
        LOG_ERROR("%s: the routed experts' kernels need %zu bytes of shared memory per block at "
                  "hidden %zu and intermediate %zu; this GPU allows %d (the f32 recipe, "
                  "--precision f32, runs them with other kernels)",
                  experts[0].name, smem, hidden, inter, smem_max);
        return ERR_INVAL;
    }
    const size_t q13 = E * 2 * inter * hidden / 2, s13 = E * 2 * inter * hidden / NVFP4_GROUP;
    const size_t q2 = E * hidden * inter / 2, s2 = E * hidden * inter / NVFP4_GROUP;
    uint8_t *dq13 = (uint8_t *) keep_alloc(impl, q13), *ds13 = (uint8_t *) keep_alloc(impl, s13);
    uint8_t *dq2 = (uint8_t *) keep_alloc(impl, q2), *ds2 = (uint8_t *) keep_alloc(impl, s2);
    float *dg13 = (float *) keep_alloc(impl, E * 2 * sizeof(float));
    float *dg2 = (float *) keep_alloc(impl, E * sizeof(float));
    float *g = (float *) malloc(E * 3 * sizeof(float));
    // Staging for one expert's gate and up as stored (the largest of its matrices).
    const size_t nq = inter * hidden / 2, ns = inter * hidden / NVFP4_GROUP;
    uint8_t *tq = NULL, *ts = NULL;
    const bool staged = cudaMalloc((void **) &tq, 2 * nq) == cudaSuccess
                        && cudaMalloc((void **) &ts, 2 * ns) == cudaSuccess;
    if (!dq13 || !ds13 || !dq2 || !ds2 || !dg13 || !dg2 || !g || !staged) {
        free(g);
        cudaFree(tq), cudaFree(ts);
        (void) cudaGetLastError();
        LOG_ERROR("out of GPU memory binding the %d experts of %s", n_experts, experts[0].name);
        return ERR_NOMEM;
    }
    for (size_t e = 0; e < E; e++) {
        CkptLinear *w = &experts[3 * e];
        for (int k = 0; k < 3; k++) {
            // Each upload waits for the previous pack kernel (both on the legacy stream).
            CUDA_CHECK(cudaMemcpy(tq + (k == 1 ? nq : 0), w[k].data, nq, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(ts + (k == 1 ? ns : 0), w[k].scale, ns, cudaMemcpyHostToDevice));
            if (k == 1)
                moe_pack_w13(dq13 + e * 2 * nq, ds13 + e * 2 * ns, tq, ts, (int) inter,
                             (int) hidden, 0);
            if (k == 2)
                moe_pack_w2(dq2 + e * nq, ds2 + e * ns, tq, ts, (int) hidden, (int) inter, 0);
            g[k < 2 ? 2 * e + k : 2 * E + e] = w[k].global_scale;
        }
        w[0].data = dq13 + e * 2 * nq;
        w[1].data = dq13 + e * 2 * nq + nq;
        w[2].data = dq2 + e * nq;
        w[0].scale = ds13 + e * 2 * ns;
        w[1].scale = ds13 + e * 2 * ns + ns;
        w[2].scale = ds2 + e * ns;
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaFree(tq));
    CUDA_CHECK(cudaFree(ts));
    CUDA_CHECK(cudaMemcpy(dg13, g, E * 2 * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dg2, g + 2 * E, E * sizeof(float), cudaMemcpyHostToDevice));
    free(g);
    impl->stacks[impl->n_stacks++] = (ExpertStack){
        experts, {dq13, ds13, dg13, dq2, ds2, dg2, n_experts, (int) hidden, (int) inter}};
    return ERR_OK;
}

// The stack of experts (bind_experts), or NULL.
static const MoeExperts *expert_stack(const CudaImpl *impl, const CkptLinear *experts)
{
    for (int i = 0; i < impl->n_stacks; i++)
        if (impl->stacks[i].experts == experts) return &impl->stacks[i].ex;
    return NULL;
}

// kv_b_proj of a layer the tuned MLA path can take, repacked (tuned_pack.h: bf16 W_UK^T and
// W_UV per head at the kernels' widths, zero where the model is narrower) and uploaded.
// Nothing for other shapes or under the F32 recipe.
static Err cuda_bind_kv_b(Backend *be, const CkptLinear *kv_b, const BackendMla *p)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    for (int i = 0; i < impl->n_kv_b; i++)  // as in cuda_bind_experts
        if (impl->kv_bs[i].kv_b == kv_b) impl->kv_bs[i--] = impl->kv_bs[--impl->n_kv_b];
    if (be->precision != BACKEND_PRECISION_BF16 || !backend_mla_shape_tuned(p)
        || impl->n_kv_b == MAX_KV_B)
        return ERR_OK;
    const size_t nk = backend_mla_uk_elems(p), nv = backend_mla_uv_elems(p);
    uint16_t *uk = (uint16_t *) malloc(nk * 2), *uv = (uint16_t *) malloc(nv * 2);
    Err err = uk && uv ? backend_mla_pack_kv_b(kv_b, p, uk, uv) : ERR_NOMEM;
    void *duk = err ? NULL : keep_copy(impl, uk, nk * 2);
    void *duv = err ? NULL : keep_copy(impl, uv, nv * 2);
    free(uk), free(uv);
    if (err) return err;
    if (!duk || !duv) {
        LOG_ERROR("out of GPU memory repacking %s", kv_b->name ? kv_b->name : "kv_b_proj");
        return ERR_NOMEM;
    }
    impl->kv_bs[impl->n_kv_b++] = (KvBPack){kv_b, (uint16_t *) duk, (uint16_t *) duv};
    return ERR_OK;
}

static const KvBPack *kv_b_pack(const CudaImpl *impl, const CkptLinear *kv_b)
{
    for (int i = 0; i < impl->n_kv_b; i++)
        if (impl->kv_bs[i].kv_b == kv_b) return &impl->kv_bs[i];
    return NULL;
}

// y += x over n floats (the add op's kernel, kernels/act.h).
static void add_f32(CudaImpl *impl, float *y, const float *x, size_t n)
{
    act_add(y, x, n, impl->stream);
}

// Launch k_gemv: one token per chunk when n is 1 (decode), else MATMUL_TOK.
static void launch_gemv(CudaImpl *impl, float *y, DevLin w, const float *x, int n)
{
    w.vec &= ((uintptr_t) x & 15) == 0;  // float4 activation loads
    const unsigned row_blocks = (unsigned) ((w.rows + MM_WARPS - 1) / MM_WARPS);
    if (n == 1) {
        k_gemv<1><<<row_blocks, MM_WARPS * 32, 0, impl->stream>>>(y, w, x, n);
    } else {
        const int chunks = (n + MATMUL_TOK - 1) / MATMUL_TOK;
        const dim3 grid(row_blocks, (unsigned) (chunks < 65535 ? chunks : 65535));
        k_gemv<MATMUL_TOK><<<grid, MM_WARPS * 32, 0, impl->stream>>>(y, w, x, n);
    }
    check_launch("matmul");
}

// y fp32 [n, n_mat, rows] = w bf16 [n_mat, rows, cols] x [n, n_mat, cols] (acc: y +=) through
// kernels/gemm.h, GEMM_MAX_TOK tokens a launch: x bf16, or (x_f32) fp32 rounded to bf16 as it
// is read; tensor cores from 2 tokens when tc.
static void gemv_chunks(CudaImpl *impl, float *y, const uint16_t *w, const void *x, bool x_f32,
                        int rows, int cols, int n_mat, int n, bool tc, bool acc)
{
    const size_t x_elem = x_f32 ? sizeof(float) : sizeof(uint16_t);
    for (int t0 = 0; t0 < n; t0 += GEMM_MAX_TOK) {
        const int nt = n - t0 < GEMM_MAX_TOK ? n - t0 : GEMM_MAX_TOK;
        float *yt = y + (size_t) t0 * n_mat * rows;
        const void *xt = (const char *) x + (size_t) t0 * n_mat * cols * x_elem;
        const bool use_tc = tc && nt >= 2;
        const float *res =
            acc ? yt : NULL;  // y += w x: each output read, then written, by one thread
        if (x_f32 && use_tc)
            gemm_bf16_gemv_tc_f32x(yt, GEMM_OUT_F32, w, (const float *) xt, res, rows, cols, n_mat,
                                   nt, impl->stream);
        else if (x_f32)
            gemm_bf16_gemv_f32x(yt, GEMM_OUT_F32, w, (const float *) xt, res, rows, cols, n_mat, nt,
                                impl->stream);
        else if (use_tc)
            gemm_bf16_gemv_tc(yt, GEMM_OUT_F32, w, (const uint16_t *) xt, res, rows, cols, n_mat,
                              nt, impl->stream);
        else
            gemm_bf16_gemv(yt, GEMM_OUT_F32, w, (const uint16_t *) xt, res, rows, cols, n_mat, nt,
                           impl->stream);
    }
}

// Whether matmul_tuned runs cuBLASLt: more than GEMM_MAX_TOK tokens, rows in 4s (fp32 out:
// 16-byte rows; the router's 156 experts among them).
static bool matmul_lt(const CkptLinear *w, int n)
{
    return n > GEMM_MAX_TOK && w->rows % 4 == 0;
}

// A bf16 weight under the BF16 recipe (backend_matmul_tuned) through kernels/gemm.h: up to
// GEMM_MAX_TOK tokens a launch with the fp32 input rounded as it is read (a bf16 copy first
// when x is not 16-byte aligned; tensor cores from 2 tokens when the rows fill the chip
// twice), acc adding into y in the GEMV's store; more tokens
// (matmul_lt) through cuBLASLt on a bf16 copy of the input, which cannot add (acc false).
static void matmul_tuned(CudaImpl *impl, float *y, const CkptLinear *w, const float *x, int n,
                         bool acc)
{
    const uint16_t *wd = (const uint16_t *) w->data;
    const int rows = w->rows;
    int cols = w->cols;
    const PadLin *pl = cols % 8 ? pad_lin(impl, w) : NULL;
    if (pl) {  // columns not in 8s: the padded copy, and x zero-padded to match
        float *xp = (float *) scratch(impl, SCRATCH_C, (size_t) n * pl->cols_p * sizeof(float));
        act_repad(xp, 1, pl->cols_p, x, 1, cols, (size_t) n, impl->stream);
        wd = pl->padded, cols = pl->cols_p, x = xp;
    }
    const bool lt = matmul_lt(w, n), aligned = (uintptr_t) x % 16 == 0;
    ASSERT(!(lt && acc));
    uint16_t *xb = NULL;
    if (lt || !aligned) {
        xb = (uint16_t *) scratch(impl, SCRATCH_X, (size_t) n * cols * 2);
        act_to_bf16(xb, x, (size_t) n * cols, impl->stream);
    }
    if (lt)
        gemm_bf16_lt(y, GEMM_OUT_F32, xb, wd, n, rows, cols, &impl->lt, impl->stream);
    else
        gemv_chunks(impl, y, wd, xb ? (const void *) xb : (const void *) x, !xb, rows, cols, 1, n,
                    (long) (rows + 7) / 8 >= 2L * impl->n_sm, acc);
}

// Whether w runs through matmul_tuned: a bf16 weight under the BF16 recipe, stored 16-byte
// aligned with columns in 8s (so every token's fp32 row of x stays 16-byte aligned when x
// is), or with a padded copy (PadLin).
static bool linear_tuned(const Backend *be, const CkptLinear *w)
{
    if (be->precision != BACKEND_PRECISION_BF16 || !backend_matmul_tuned(w)) return false;
    if (w->cols % 8) return pad_lin((const CudaImpl *) be->impl, w) != NULL;
    return (uintptr_t) w->data % 16 == 0;
}

// y = w x, or (acc) y += w x: the same sums, each rounded to fp32 and then added to y (in the
// tuned GEMV's store; elsewhere into a temporary, then add_f32).
static void matmul_any(Backend *be, float *y, const CkptLinear *w, const float *x, int n, bool acc)
{
    ASSERT(w->rows > 0 && w->cols > 0 && n >= 0);
    if (n == 0) return;
    CudaImpl *impl = (CudaImpl *) be->impl;
    prof_begin(impl);
    const bool tuned = linear_tuned(be, w);
    const bool via_tmp = acc && (!tuned || matmul_lt(w, n));
    float *yt =
        via_tmp ? (float *) scratch(impl, SCRATCH_Y, (size_t) n * w->rows * sizeof(float)) : y;
    if (tuned) {
        matmul_tuned(impl, yt, w, x, n, acc && !via_tmp);
    } else {
        impl->untuned.matmul += be->precision == BACKEND_PRECISION_BF16;
        launch_gemv(impl, yt, dev_lin(w), x, n);
    }
    if (via_tmp) add_f32(impl, y, yt, (size_t) n * w->rows);
    prof_end(impl, PROF_MATMUL, lin_bytes(w));
}

static void cuda_matmul(Backend *be, float *y, const CkptLinear *w, const float *x, int n)
{
    matmul_any(be, y, w, x, n, false);
}

// Tuned and aligned: one CUDA-core GEMV launch per GEMM_MAX_TOK rows (the kernel a one-row
// call runs, each row's sums in the same order); otherwise a one-row call per row.
static void cuda_matmul_rows(Backend *be, float *y, const CkptLinear *w, const float *x, int n)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (n > 1 && linear_tuned(be, w) && w->cols % 8 == 0 && (uintptr_t) x % 16 == 0) {
        prof_begin(impl);
        gemv_chunks(impl, y, (const uint16_t *) w->data, x, true, w->rows, w->cols, 1, n, false,
                    false);
        prof_end(impl, PROF_MATMUL, lin_bytes(w));
        return;
    }
    for (int t = 0; t < n; t++)
        matmul_any(be, y + (size_t) t * w->rows, w, x + (size_t) t * w->cols, 1, false);
}

static void cuda_matmul_add(Backend *be, float *y, const CkptLinear *w, const float *x, int n)
{
    matmul_any(be, y, w, x, n, true);
}

static void cuda_embed(Backend *be, float *y, const CkptLinear *table, const int *ids, int n)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (n == 0) return;
    prof_begin(impl);
    k_embed<<<n, THREADS, 0, impl->stream>>>(y, dev_lin(table), ids);
    check_launch("embed");
    prof_end(impl, PROF_EMBED, 0.0);
}

static void cuda_rmsnorm(Backend *be, float *y, const float *x, const float *w, int n, int dim,
                         int stride, float eps)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    ASSERT(dim > 0 && stride >= dim);
    if (n == 0) return;
    prof_begin(impl);
    norm_rms_f32(y, x, w, eps, n, dim, stride, stride, impl->stream);
    prof_end(impl, PROF_NORM, 0.0);
}

static void cuda_layernorm(Backend *be, float *y, const float *x, const float *w, const float *b,
                           int n, int dim, float eps)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (n == 0) return;
    prof_begin(impl);
    norm_layer_f32(y, x, w, b, eps, n, dim, dim, dim, impl->stream);
    prof_end(impl, PROF_NORM, 0.0);
}

static void cuda_rope(Backend *be, float *x, int n, int n_heads, int stride, int head_stride,
                      int offset, int rope_dim, const int *pos, float theta)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (n == 0 || rope_dim == 0 || n_heads == 0) return;
    prof_begin(impl);
    rope_glm(x, pos, n, n_heads, stride, head_stride, offset, rope_dim, theta, impl->stream);
    prof_end(impl, PROF_ROPE, 0.0);
}

static void cuda_silu_mul(Backend *be, float *y, const float *gate, const float *up, int n_elems)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (n_elems <= 0) return;
    prof_begin(impl);
    act_silu_mul(y, gate, up, (size_t) n_elems, impl->stream);
    prof_end(impl, PROF_ELEMENTWISE, 0.0);
}

static void cuda_add(Backend *be, float *y, const float *x, int n_elems)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (n_elems <= 0) return;
    prof_begin(impl);
    add_f32(impl, y, x, (size_t) n_elems);
    prof_end(impl, PROF_ELEMENTWISE, 0.0);
}

static void cuda_route(Backend *be, int *idx, float *wts, const float *logits, const float *bias,
                       int n, const BackendRoute *p)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    const int E = p->n_experts, G = p->n_group;
    ASSERT(E > 0 && p->top_k > 0 && p->top_k <= E && G > 0 && E % G == 0 && p->topk_group > 0
           && p->topk_group <= G);
    if (n == 0) return;
    prof_begin(impl);
    moe_route(idx, wts, logits, bias, n, E, p->top_k, G, p->topk_group, p->norm_topk_prob,
              p->routed_scaling_factor, true, impl->stream);
    prof_end(impl, PROF_ROUTE, 0.0);
}

static void cuda_kv_write(Backend *be, KvCache *kv, const BackendSeqs *s, int layer, int offset,
                          const float *src, int width)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    const int n = s->n;
    const KvEntryLayout *lo = &kv->entry[layer];
    ASSERT(kv_write_ok(lo, offset, width));
    if (n == 0 || width == 0) return;
    const DevKv d = dev_kv(impl, kv, s, layer);
    prof_begin(impl);
    k_kv_write<<<n, THREADS, 0, impl->stream>>>(d, s->pos, offset, src, width);
    check_launch("kv_write");
    prof_end(impl, PROF_KV_WRITE, 0.0);
}

// A bound on pos[t] + 1 known on the host (model.c reserves before running the layers): the
// positions a device table row can address, so that it changes with the tables' stride only.
static int seq_capacity(const CudaImpl *impl, const KvCache *kv, const BackendSeqs *s)
{
    return table_stride(impl, s->seqs, s->n_seqs) * kv->params.block_size;
}

// The rows of n that one DSA top-k pass scores: as many as dsa_score_bytes holds at row_bytes
// of scores a row (at least one). Each row's scores and selection depend on that row alone, so
// the passes change no result.
static int dsa_pass_rows(const CudaImpl *impl, int n, size_t row_bytes)
{
    const size_t most = impl->dsa_score_bytes / row_bytes;
    return most >= (size_t) n ? n : most > 0 ? (int) most : 1;
}

static void cuda_dsa_topk(Backend *be, int *sel, int *n_sel, const float *q, const float *w,
                          const KvCache *kv, const BackendSeqs *s, int layer, const BackendDsa *p)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    ASSERT(kv->params.has_index[layer] && kv->params.index_dim == p->head_dim && p->top_k > 0);
    const int n = s->n;
    const int *pos = s->pos;
    if (n == 0) return;
    const int cap = seq_capacity(impl, kv, s);
    if (be->precision == BACKEND_PRECISION_BF16 && backend_dsa_tuned(p, kv, layer)) {
        // kernels/dsa.cu over the engine's key pages: fp32 scores, exact radix top-k. Keys
        // stored zero-padded (kv_cache.h) meet q zero-padded to their width (act_repad).
        const DsaCache c = kv_dsa_cache_stored(kv, dev_pool(impl, kv), layer);
        const bool pad = c.dim != p->head_dim;
        const DevStep *st = dev_step(impl, kv, s->seqs, s->n_seqs);
        float w_scale, sm_scale;
        backend_dsa_scales(p, &w_scale, &sm_scale);
        // Rows in passes (dsa_pass_rows): a 4,096-token chunk at 256K positions would
        // otherwise hold 4.3 GB of scores.
        const size_t row_bytes = (size_t) cap * sizeof(float);
        const int rows = dsa_pass_rows(impl, n, row_bytes);
        float *score = (float *) scratch(impl, SCRATCH_A, (size_t) rows * row_bytes);
        float *q_pad = pad ? (float *) scratch(impl, SCRATCH_X, (size_t) rows * p->n_heads
                                                                     * c.dim * sizeof(float))
                           : NULL;
        const bool tc = backend_dsa_tc(be, p, kv, layer);
        const size_t q_row = (size_t) p->n_heads * p->head_dim;
        prof_begin(impl);
        for (int r0 = 0; r0 < n; r0 += rows) {
            const int nr = n - r0 < rows ? n - r0 : rows;
            const float *qr = q + (size_t) r0 * q_row, *wr = w + (size_t) r0 * p->n_heads;
            if (pad) {
                act_repad(q_pad, p->n_heads, c.dim, qr, p->n_heads, p->head_dim, (size_t) nr,
                          impl->stream);
                qr = q_pad;
            }
            if (tc)
                dsa_scores_tc(score, cap, qr, wr, w_scale, sm_scale, &c, st->dev, st->stride,
                              s->seq_of + r0, s->len + r0, cap, nr, p->n_heads, impl->stream);
            else
                dsa_scores(score, cap, qr, wr, w_scale, sm_scale, &c, st->dev, st->stride,
                           s->seq_of + r0, s->len + r0, cap, nr, p->n_heads, impl->stream);
            dsa_topk(sel + (size_t) r0 * p->top_k, n_sel + r0, score, cap, s->len + r0, nr,
                     p->top_k, impl->stream);
        }
        prof_end(impl, PROF_DSA, 0.0);
        return;
    }
    impl->untuned.dsa += be->precision == BACKEND_PRECISION_BF16;
    const DevKv d = dev_kv(impl, kv, s, layer);
    // Rows in passes, as the tuned path's (dsa_pass_rows), of double scores.
    const size_t row_bytes = (size_t) cap * sizeof(double);
    const int rows = dsa_pass_rows(impl, n, row_bytes);
    double *score = (double *) scratch(impl, SCRATCH_A, (size_t) rows * row_bytes);
    prof_begin(impl);
    const int key_blocks = (cap + THREADS / 32 - 1) / (THREADS / 32);  // a warp per key
    ASSERT(key_blocks <= 65535);
    for (int r0 = 0; r0 < n; r0 += rows) {
        const int nr = n - r0 < rows ? n - r0 : rows;
        DevKv dr = d;  // the pass's tokens
        dr.seq_of += r0;
        k_dsa_scores<<<dim3((unsigned) nr, (unsigned) key_blocks), THREADS, 0, impl->stream>>>(
            score, cap, q + (size_t) r0 * p->n_heads * p->head_dim, w + (size_t) r0 * p->n_heads,
            dr, pos + r0, *p);
        check_launch("dsa_scores");
        k_dsa_select<<<nr, THREADS, 0, impl->stream>>>(sel + (size_t) r0 * p->top_k, n_sel + r0,
                                                       score, cap, pos + r0, p->top_k);
        check_launch("dsa_select");
    }
    prof_end(impl, PROF_DSA, 0.0);
}

static size_t align256(size_t n)
{
    return (n + 255) & ~(size_t) 255;
}

// y fp32 [n, n_mat, rows] = each of the n_mat bf16 matrices w [n_mat, rows, cols] times its
// slice of x bf16 [n, n_mat, cols] (MLA's absorbed projections): the per-head GEMV on tensor
// cores for up to GEMM_MAX_TOK tokens, one strided-batched cuBLASLt GEMM for more (as
// matmul_tuned chooses for one matrix).
static void heads_product(CudaImpl *impl, float *y, const uint16_t *w, const uint16_t *x,
                          int rows, int cols, int n_mat, int n)
{
    if (n > GEMM_MAX_TOK)
        gemm_bf16_lt_mats(y, GEMM_OUT_F32, x, w, n, rows, cols, n_mat, &impl->lt, impl->stream);
    else
        gemv_chunks(impl, y, w, x, false, rows, cols, n_mat, n, true, false);
}

// MLA attention through kernels/mla.h (backend_mla_tuned layers under the BF16 recipe): q
// split into bf16 q_nope and fp32 q_pe (already rotated by the model), q_lat = W_UK^T q_nope,
// split-KV decode over the layer's own pages (kv_cache.h's layout is mla.h's), out = W_UV
// o_lat (heads_product). A model narrower than GLM-5 runs at the kernels' widths: q split
// zero-padded to MLA_QK_NOPE + MLA_ROPE and Hp heads (backend_mla_heads), kv_b repacked
// likewise (bind_kv_b), the cache padded (kv_cache.h), and out [Hp, Vp] cropped to [H, V]
// (act_repad). Tokens in chunks of 256 so the workspace stays bounded. tc (backend_mla_tc):
// the tensor-core kernel, mla_decode_tc (32 heads a CTA, tiles of 32 positions).
static void mla_tuned(CudaImpl *impl, float *out, const float *q, const KvBPack *pk,
                      const KvCache *kv, const BackendSeqs *s, int layer, const int *sel,
                      const int *n_sel, int sel_stride, const BackendMla *p, bool tc)
{
    const int n = s->n, H = p->n_heads, V = p->v_dim, L = MLA_KV_LORA;
    const int Hp = backend_mla_heads(H), Vp = backend_mla_v_rows(p);
    const bool crop = Hp != H || Vp != V;
    const KvEntryLayout *lo = &kv->entry[layer];
    const DevStep *st = dev_step(impl, kv, s->seqs, s->n_seqs);
    unsigned char *pool = dev_pool(impl, kv);
    const MlaCache cache = {pool + kv->mla_offset[layer],
                            lo->dtype == KV_DTYPE_FP8 ? MLA_CACHE_FP8 : MLA_CACHE_BF16,
                            kv->params.n_blocks};
    const int cap = seq_capacity(impl, kv, s);
    const int attended = sel && sel_stride < cap ? sel_stride : cap;
    const int chunk = n < 256 ? n : 256;
    const int hpc = tc ? 32 : MLA_HEADS_PER_CTA, min_pos = tc ? 32 : 16;
    // About four CTAs per SM (Hp / hpc CTAs per token and split), at least min_pos positions a
    // split.
    int n_split = (4 * impl->n_sm + (Hp / hpc) * chunk - 1) / ((Hp / hpc) * chunk);
    if (n_split > (attended + min_pos - 1) / min_pos) n_split = (attended + min_pos - 1) / min_pos;
    if (n_split > MLA_MAX_SPLIT) n_split = MLA_MAX_SPLIT;
    if (n_split < 1) n_split = 1;
    const size_t c = (size_t) chunk, h = (size_t) Hp;
    const size_t b_nope = align256(c * h * MLA_QK_NOPE * 2), b_pe = align256(c * h * MLA_ROPE * 4);
    const size_t b_lat = align256(c * h * L * 4), b_ws = align256(c * n_split * h * L * 4);
    // The uncropped output (crop) takes q's place once the attention has read it.
    const size_t b_out = crop ? c * h * (size_t) Vp * 4 : 0;
    unsigned char *x =
        (unsigned char *) scratch(impl, SCRATCH_X, b_nope + b_pe > b_out ? b_nope + b_pe : b_out);
    uint16_t *o_lat = (uint16_t *) scratch(impl, SCRATCH_Y, c * h * L * 2);
    unsigned char *z =
        (unsigned char *) scratch(impl, SCRATCH_Z, b_lat + b_ws + c * n_split * h * 2 * 4);
    uint16_t *q_nope = (uint16_t *) x;
    float *q_pe = (float *) (x + b_nope), *q_lat = (float *) z, *ws_o = (float *) (z + b_lat);
    float *ws_ml = (float *) (z + b_lat + b_ws);
    const int *len = sel ? n_sel : s->len;
    // Profiled per 256-token chunk: the absorbed projections (q_lat = W_UK q_nope, out = W_UV
    // o_lat) apart from the attention itself.
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const int nc = n - t0 < chunk ? n - t0 : chunk;
        prof_begin(impl);
        mla_q_split(q_nope, q_pe, q + (size_t) t0 * H * (p->qk_nope + p->qk_rope), nc, H,
                    p->qk_nope, p->qk_rope, Hp, impl->stream);
        heads_product(impl, q_lat, pk->uk, q_nope, L, MLA_QK_NOPE, Hp, nc);
        prof_end(impl, PROF_MLA_PROJ, 0.0);
        prof_begin(impl);
        (tc ? mla_decode_tc : mla_decode)(
            o_lat, q_lat, q_pe, &cache, st->dev, st->stride, s->seq_of + t0, len + t0,
            sel ? sel + (size_t) t0 * sel_stride : NULL, sel_stride, nc, Hp, p->scale, n_split,
            ws_o, ws_ml, impl->stream);
        prof_end(impl, PROF_MLA, 0.0);
        prof_begin(impl);
        float *dst = out + (size_t) t0 * H * V;
        if (crop) {
            heads_product(impl, (float *) x, pk->uv, o_lat, Vp, L, Hp, nc);
            act_repad(dst, H, V, (const float *) x, Hp, Vp, (size_t) nc, impl->stream);
        } else {
            heads_product(impl, dst, pk->uv, o_lat, V, L, H, nc);
        }
        prof_end(impl, PROF_MLA_PROJ, 0.0);
    }
}

static void cuda_mla_attention(Backend *be, float *out, const float *q, const CkptLinear *kv_b,
                               const KvCache *kv, const BackendSeqs *s, int layer, const int *sel,
                               const int *n_sel, int sel_stride, const BackendMla *p)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    ASSERT(kv_b->cols == p->kv_lora && kv_b->rows == p->n_heads * (p->qk_nope + p->v_dim));
    ASSERT(kv->params.kv_lora == p->kv_lora && kv->params.rope_dim == p->qk_rope);
    const int n = s->n;
    const int *pos = s->pos;
    if (n == 0) return;
    const KvBPack *pk =
        be->precision == BACKEND_PRECISION_BF16 && backend_mla_tuned(p, &kv->entry[layer])
            ? kv_b_pack(impl, kv_b)
            : NULL;
    if (pk) {
        mla_tuned(impl, out, q, pk, kv, s, layer, sel, n_sel, sel_stride, p,
                  backend_mla_tc(be, p, &kv->entry[layer]));
        return;
    }
    impl->untuned.mla += be->precision == BACKEND_PRECISION_BF16;
    const int cap = sel ? (sel_stride > 0 ? sel_stride : 1) : seq_capacity(impl, kv, s);
    const int n_split = (cap + MLA_SPLIT - 1) / MLA_SPLIT;
    const DevKv d = dev_kv(impl, kv, s, layer);
    const DevLin w = dev_lin(kv_b);
    const size_t H = (size_t) p->n_heads, L = (size_t) p->kv_lora;
    ASSERT(L * sizeof(double) <= 40 * 1024 && (cap + THREADS / 32 - 1) / (THREADS / 32) <= 65535);
    // Tokens in chunks, so the scratch stays under ~256 MB whatever n (each token's result
    // does not depend on its chunk).
    const size_t per_tok = H * (L + (size_t) cap + 1 + (size_t) n_split * L) * sizeof(double);
    int chunk = (int) ((256u << 20) / per_tok);
    if (chunk < 1) chunk = 1;
    if (chunk > n) chunk = n;
    double *q_lat = (double *) scratch(impl, SCRATCH_A, (size_t) chunk * H * L * sizeof(double));
    double *prob = (double *) scratch(impl, SCRATCH_C, (size_t) chunk * H * cap * sizeof(double));
    double *stat = (double *) scratch(impl, SCRATCH_B, (size_t) chunk * H * sizeof(double));
    double *part =
        (double *) scratch(impl, SCRATCH_D, (size_t) chunk * H * n_split * L * sizeof(double));
    prof_begin(impl);
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const int nc = n - t0 < chunk ? n - t0 : chunk;
        const float *qc = q + (size_t) t0 * H * (p->qk_nope + p->qk_rope);
        const int *pc = pos + t0;
        DevKv dc = d;  // the chunk's tokens
        dc.seq_of += t0;
        const int *sc = sel ? sel + (size_t) t0 * sel_stride : NULL;
        const int *nsc = sel ? n_sel + t0 : NULL;
        const dim3 th((unsigned) nc, (unsigned) H);
        k_mla_qlat<<<dim3((unsigned) nc, (unsigned) H, (unsigned) ((L + 31) / 32)), THREADS, 0,
                     impl->stream>>>(q_lat, qc, w, *p);
        k_mla_scores<<<dim3((unsigned) nc, (unsigned) H,
                            (unsigned) ((cap + THREADS / 32 - 1) / (THREADS / 32))),
                       THREADS, 0, impl->stream>>>(prob, cap, q_lat, qc, dc, pc, sc, nsc,
                                                   sel_stride, *p);
        k_mla_softmax<<<th, THREADS, 0, impl->stream>>>(prob, stat, cap, pc, nsc, p->n_heads);
        k_mla_pv<<<dim3((unsigned) nc, (unsigned) H, (unsigned) n_split), THREADS, 0,
                   impl->stream>>>(part, n_split, prob, cap, dc, pc, sc, nsc, sel_stride, *p);
        k_mla_out<<<th, THREADS, L * sizeof(double), impl->stream>>>(
            out + (size_t) t0 * H * p->v_dim, part, n_split, w, pc, nsc, *p);
    }
    check_launch("mla_attention");
    prof_end(impl, PROF_MLA, 0.0);
}

// The device descriptor table of an experts array (uploaded on first use).
static const DevLin *expert_table(CudaImpl *impl, const CkptLinear *experts, int n_experts)
{
    for (int i = 0; i < impl->n_tables; i++)
        if (impl->tables[i].host == experts && impl->tables[i].n == n_experts)
            return (const DevLin *) impl->tables[i].dev;
    if (impl->n_tables == MAX_EXPERT_TABLES)
        log_fatal(__FILE__, __LINE__, "more than %d MoE layers", MAX_EXPERT_TABLES);
    no_capture(impl, "an expert table upload");
    impl->gen++;
    DevLin *host = (DevLin *) malloc((size_t) 3 * n_experts * sizeof *host);
    if (!host) log_fatal(__FILE__, __LINE__, "out of memory");
    for (int i = 0; i < 3 * n_experts; i++)
        host[i] = dev_lin(&experts[i]);
    void *dev = NULL;
    CUDA_CHECK(cudaMalloc(&dev, (size_t) 3 * n_experts * sizeof *host));
    CUDA_CHECK(
        cudaMemcpy(dev, host, (size_t) 3 * n_experts * sizeof *host, cudaMemcpyHostToDevice));
    free(host);
    impl->tables[impl->n_tables++] = (ExpertTable){experts, n_experts, dev};
    return (const DevLin *) dev;
}

// Routed experts through kernels/moe.h (stacked, packed NVFP4 experts under the BF16 recipe):
// the pairs grouped by expert, gate/up with SwiGLU (x rounded to bf16 as read) into bf16
// activations, down into each pair's weighted output, the k outputs of a token added in slot
// order. A tile reads its whole expert, so a prefill's expert bytes fall with the tokens of a
// launch: a chunk whose experts average MOE_WIDE_MIN_PAIRS pairs or more takes the wide tiles
// (up to 64 pairs of an expert per weight read) in launches of up to MOE_MAX_WIDE_PAIRS pairs
// (4,096 tokens at GLM's k 8; docs/perf.md run 17: a 4,096-token call 37.4 ms a layer on the
// 8-column tiles in 1,024-token launches, 31.0 wide in 1,024-token ones, 26.6 wide in one,
// 15.5 with one MMA chain a column and two blocks an SM);
// smaller ones, and every chunk with GLMSPARK_MOE_WIDE=0, take the 8-column tiles in launches
// of up to MOE_MAX_CHUNK_PAIRS pairs. GLMSPARK_MOE_CHUNK=N caps a launch at N tokens.
#define MOE_WIDE_MIN_PAIRS 16
static void moe_tuned(CudaImpl *impl, float *out, const float *x, int n, const int *idx,
                      const float *wts, int top_k, const MoeExperts *ex)
{
    const int most = (impl->moe_wide ? MOE_MAX_WIDE_PAIRS : MOE_MAX_CHUNK_PAIRS) / top_k;
    const int per = impl->moe_chunk > 0 && impl->moe_chunk < most ? impl->moe_chunk : most;
    const int chunk = n < per ? n : per;
    const size_t hidden = (size_t) ex->hidden, inter = (size_t) ex->inter,
                 pairs = (size_t) chunk * top_k;
    const size_t narrow_ints = moe_work_ints((int) pairs, ex->n_experts),
                 wide_ints = impl->moe_wide ? moe_wide_work_ints(ex, chunk, top_k) : 0;
    int32_t *work = (int32_t *) scratch(
        impl, SCRATCH_E, (narrow_ints > wide_ints ? narrow_ints : wide_ints) * sizeof(int32_t));
    uint16_t *act = (uint16_t *) scratch(impl, SCRATCH_Y, pairs * inter * 2);
    float *y = (float *) scratch(impl, SCRATCH_X, pairs * hidden * sizeof(float));
    prof_begin(impl);
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const int nc = n - t0 < chunk ? n - t0 : chunk;
        const size_t k0 = (size_t) t0 * top_k;
        const float *xc = x + (size_t) t0 * hidden;
        // Past MOE_MAX_CHUNK_PAIRS a chunk is wide: 8,192 pairs >= 16 x MOE_MAX_EXPERTS.
        if (impl->moe_wide && nc * top_k >= MOE_WIDE_MIN_PAIRS * ex->n_experts) {
            moe_group_wide(work, idx + k0, nc, top_k, ex->n_experts, impl->stream);
            moe_experts_w13_wide(act, ex, xc, work, nc, top_k, impl->stream);
            moe_experts_w2_wide(y, ex, act, work, wts + k0, nc, top_k, impl->stream);
        } else {
            moe_group(work, idx + k0, nc, top_k, ex->n_experts, impl->stream);
            moe_experts_w13(act, ex, xc, work, nc, top_k, impl->stream);
            moe_experts_w2(y, ex, act, work, wts + k0, nc, top_k, impl->stream);
        }
        moe_combine(out + (size_t) t0 * hidden, y, NULL, nc, top_k, (int) hidden, impl->stream);
    }
    prof_end(impl, PROF_MOE, 0.0);
}

static void cuda_moe(Backend *be, float *out, const float *x, int n, const int *idx,
                     const float *wts, int top_k, const CkptLinear *experts, int n_experts)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    const int hidden = experts[0].cols, inter = experts[0].rows;
    for (int e = 0; e < n_experts; e++) {
        const CkptLinear *w = experts + 3 * (size_t) e;
        ASSERT(w[0].cols == hidden && w[0].rows == inter && w[1].cols == hidden
               && w[1].rows == inter && w[2].rows == hidden && w[2].cols == inter);
    }
    if (n == 0) return;
    const MoeExperts *ex = expert_stack(impl, experts);  // packed: only kernels/moe.h reads it
    if (ex) {
        if (top_k > MOE_MAX_K)
            log_fatal(__FILE__, __LINE__, "top_k %d exceeds the tuned experts' %d", top_k,
                      MOE_MAX_K);
        moe_tuned(impl, out, x, n, idx, wts, top_k, ex);
        return;
    }
    impl->untuned.moe += be->precision == BACKEND_PRECISION_BF16;
    const DevLin *table = expert_table(impl, experts, n_experts);
    const int slots = n * top_k;
    float *hs = (float *) scratch(impl, SCRATCH_A, (size_t) slots * inter * sizeof(float));
    float *ye = (float *) scratch(impl, SCRATCH_D, (size_t) slots * hidden * sizeof(float));
    int *meta =
        (int *) scratch(impl, SCRATCH_E, ((size_t) slots + 2 * n_experts + 2) * sizeof(int));
    ASSERT((size_t) 2 * n_experts * sizeof(int) <= 48 * 1024);
    prof_begin(impl);
    k_moe_group<<<1, 1024, (size_t) 2 * n_experts * sizeof(int), impl->stream>>>(meta, idx, slots,
                                                                                 n_experts);
    // Grid rows: one per possibly active expert (at most min(slots, E) are).
    const unsigned ny = (unsigned) (slots < n_experts ? slots : n_experts);
    ASSERT(ny <= 65535);
    const dim3 g_inter((unsigned) ((inter + MM_WARPS - 1) / MM_WARPS), ny);
    const dim3 g_hidden((unsigned) ((hidden + MM_WARPS - 1) / MM_WARPS), ny);
    const int xvec = ((uintptr_t) x & 15) == 0;
    if (n == 1) {  // one slot per expert
        k_moe_gateup<1><<<g_inter, MM_WARPS * 32, 0, impl->stream>>>(hs, table, meta, n_experts, x,
                                                                     top_k, xvec);
        k_moe_down<1>
            <<<g_hidden, MM_WARPS * 32, 0, impl->stream>>>(ye, table, meta, n_experts, hs, top_k);
    } else {
        k_moe_gateup<MATMUL_TOK><<<g_inter, MM_WARPS * 32, 0, impl->stream>>>(
            hs, table, meta, n_experts, x, top_k, xvec);
        k_moe_down<MATMUL_TOK>
            <<<g_hidden, MM_WARPS * 32, 0, impl->stream>>>(ye, table, meta, n_experts, hs, top_k);
    }
    k_moe_combine<<<(unsigned) (((size_t) n * hidden + THREADS - 1) / THREADS), THREADS, 0,
                    impl->stream>>>(out, ye, idx, wts, n, top_k, hidden);
    check_launch("moe");
    prof_end(impl, PROF_MOE, 0.0);
}

// Graphs: see the file comment. A key too long for MAX_GRAPH_KEY runs eagerly.
static bool cuda_graph_begin(Backend *be, const KvCache *kv, KvSeq *const *seqs, int n_seqs,
                             const unsigned long long *key, int n_key)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    ASSERT(impl->mode == GRAPH_NONE && n_key >= 0 && n_seqs >= 0);
    impl->mode = GRAPH_EAGER;
    impl->n_key = 0;
    impl->graph_t0 = clock_now_s();
    if (!impl->graphs || n_key + 4 > MAX_GRAPH_KEY) return false;
    // The pool and block tables up to date now (a new pool bumps gen), so that a replay reads
    // them.
    (void) dev_pool(impl, kv);
    const DevStep *st = n_seqs > 0 ? dev_step(impl, kv, seqs, n_seqs) : NULL;
    unsigned long long *k = impl->key;
    int nk = 0;
    for (int i = 0; i < n_key; i++)
        k[nk++] = key[i];
    // The cache, the sequence count and the stride name the step's table slot (dev_step),
    // its serial the slot's current tenure; which sequences fill it does not matter to a
    // recording.
    k[nk++] = (unsigned long long) (uintptr_t) kv;
    k[nk++] = (unsigned long long) n_seqs;
    if (st) {
        k[nk++] = (unsigned long long) st->stride;
        k[nk++] = st->serial;
    }
    impl->n_key = nk;
    const size_t kb = (size_t) nk * sizeof *k;
    for (int i = 0; i < MAX_GRAPHS; i++) {
        GraphEntry *g = &impl->graph_cache[i];
        if (g->n_key == nk && g->gen == impl->gen && memcmp(g->key, k, kb) == 0) {
            g->used = ++impl->clock;
            impl->graph_cur = g;
            impl->mode = GRAPH_REPLAY;
            impl->n_replays++;
            return true;
        }
    }
    if (impl->n_last_key == nk && impl->last_gen == impl->gen
        && memcmp(impl->last_key, k, kb) == 0) {
        CUDA_CHECK(cudaStreamBeginCapture(impl->stream, cudaStreamCaptureModeThreadLocal));
        impl->mode = GRAPH_CAPTURE;
        impl->n_captures++;
    } else {
        impl->n_eager++;
    }
    return false;
}

static void cuda_graph_end(Backend *be)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    switch (impl->mode) {
    case GRAPH_REPLAY:
        CUDA_CHECK(cudaGraphLaunch(impl->graph_cur->exec, impl->stream));
        break;
    case GRAPH_CAPTURE: {
        cudaGraph_t graph = NULL;
        CUDA_CHECK(cudaStreamEndCapture(impl->stream, &graph));
        GraphEntry *g = &impl->graph_cache[0];
        for (int i = 1; i < MAX_GRAPHS; i++)
            if (impl->graph_cache[i].used < g->used) g = &impl->graph_cache[i];
        if (g->n_key) CUDA_CHECK(cudaGraphExecDestroy(g->exec));
        g->n_key = 0;
        CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
        CUDA_CHECK(cudaGraphDestroy(graph));
        impl->capture_s += clock_now_s() - impl->graph_t0;
        memcpy(g->key, impl->key, (size_t) impl->n_key * sizeof *g->key);
        g->n_key = impl->n_key;
        g->gen = impl->gen;
        g->used = ++impl->clock;
        CUDA_CHECK(cudaGraphLaunch(g->exec, impl->stream));
        impl->n_last_key = 0;
        break;
    }
    case GRAPH_EAGER:
        impl->eager_s += clock_now_s() - impl->graph_t0;
        memcpy(impl->last_key, impl->key, (size_t) impl->n_key * sizeof *impl->key);
        impl->n_last_key = impl->n_key;
        impl->last_gen = impl->gen;
        break;
    case GRAPH_NONE:
        ASSERT(!"graph_end without graph_begin");
    }
    impl->mode = GRAPH_NONE;
    impl->graph_cur = NULL;
}

size_t backend_cuda_mem_used(Backend *be, size_t *total)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    CUDA_CHECK(cudaSetDevice(impl->device));
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    *total = total_b;
    return total_b - free_b;
}

BackendCudaUntuned backend_cuda_untuned(const Backend *be)
{
    return ((const CudaImpl *) be->impl)->untuned;
}

void backend_cuda_limit_dsa_scores(Backend *be, size_t bytes)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    impl->dsa_score_bytes = bytes;
    impl->gen++;  // graphs recorded the passes of the old limit
}

void backend_cuda_kv_download(Backend *be, const KvCache *kv, void *dst)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    no_capture(impl, "a KV pool download");
    const unsigned char *pool = dev_pool(impl, kv);
    CUDA_CHECK(cudaMemcpyAsync(dst, pool, kv->block_bytes * (size_t) kv->params.n_blocks,
                               cudaMemcpyDeviceToHost, impl->stream));
    CUDA_CHECK(cudaStreamSynchronize(impl->stream));
}

// `bytes` synthetic bytes of k_random_fill's `kind` (0 any, 1 bf16, 2 e4m3), remembered
// for destroy; NULL when out of memory.
static void *random_bytes(CudaImpl *impl, size_t bytes, int kind, unsigned long long seed)
{
    const size_t padded = (bytes + 3) / 4 * 4;
    void *p = keep_alloc(impl, padded);
    if (!p) return NULL;
    k_random_fill<<<grid_1d(padded / 4), THREADS, 0, impl->stream>>>((uint32_t *) p, padded / 4,
                                                                     kind, seed);
    check_launch("random_fill");
    return p;
}

Err backend_cuda_random_linear(Backend *be, CkptLinear *w, CkptLinearFormat format, int rows,
                               int cols, unsigned long long seed)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    memset(w, 0, sizeof *w);
    if (rows < 1 || cols < 1 || (format == CKPT_LINEAR_NVFP4 && cols % NVFP4_GROUP)
        || (format != CKPT_LINEAR_BF16 && format != CKPT_LINEAR_FP8
            && format != CKPT_LINEAR_NVFP4)) {
        LOG_ERROR("random weight: format %d [%d, %d] not supported (bf16, fp8, NVFP4 with "
                  "cols %% 16 == 0)",
                  (int) format, rows, cols);
        return ERR_INVAL;
    }
    const size_t n = (size_t) rows * (size_t) cols;
    w->format = format;
    w->rows = rows;
    w->cols = cols;
    w->global_scale = format == CKPT_LINEAR_NVFP4 ? 0.01f
                      : format == CKPT_LINEAR_FP8 ? 0.05f
                                                  : 1.0f;
    w->name = "synthetic";
    const size_t data_bytes = format == CKPT_LINEAR_BF16  ? 2 * n
                              : format == CKPT_LINEAR_FP8 ? n
                                                          : n / 2;
    w->data = random_bytes(impl, data_bytes,
                           format == CKPT_LINEAR_BF16  ? 1
                           : format == CKPT_LINEAR_FP8 ? 2
                                                       : 0,
                           seed);
    if (format == CKPT_LINEAR_NVFP4)
        w->scale = (const uint8_t *) random_bytes(impl, n / NVFP4_GROUP, 2, seed + 1);
    if (!w->data || (format == CKPT_LINEAR_NVFP4 && !w->scale)) {
        LOG_ERROR("out of GPU memory for a random [%d, %d] weight", rows, cols);
        return ERR_NOMEM;
    }
    return ERR_OK;
}

void backend_cuda_profile_report(Backend *be, const char *title)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (!impl->profile) return;
    if (title) {
        double total = 0.0;
        for (int i = 0; i < N_PROF; i++)
            total += impl->prof_s[i];
        fprintf(stderr, "cuda profile (%s): %.3f ms in ops\n", title, total * 1e3);
        for (int i = 0; i < N_PROF; i++) {
            if (!impl->prof_calls[i]) continue;
            fprintf(stderr, "  %-18s %8ld calls %10.3f ms %5.1f%% %9.2f us/call", prof_names[i],
                    impl->prof_calls[i], impl->prof_s[i] * 1e3,
                    total > 0 ? 100.0 * impl->prof_s[i] / total : 0.0,
                    impl->prof_s[i] / impl->prof_calls[i] * 1e6);
            if (impl->prof_bytes[i] > 0)
                fprintf(stderr, " %8.1f GB/s", impl->prof_bytes[i] / impl->prof_s[i] * 1e-9);
            fprintf(stderr, "\n");
        }
    }
    memset(impl->prof_s, 0, sizeof impl->prof_s);
    memset(impl->prof_bytes, 0, sizeof impl->prof_bytes);
    memset(impl->prof_calls, 0, sizeof impl->prof_calls);
}

// The shortest of 5 enqueues of op(impl, ctx) on impl's stream after one warm-up (which also
// makes any plan it needs), in milliseconds by CUDA events.
static float best_ms(CudaImpl *impl, void (*op)(CudaImpl *, void *), void *ctx)
{
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    float best = 0.0f;
    for (int i = 0; i < 6; i++) {
        CUDA_CHECK(cudaEventRecord(e0, impl->stream));
        op(impl, ctx);
        CUDA_CHECK(cudaEventRecord(e1, impl->stream));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (i > 0 && (best == 0.0f || ms < best)) best = ms;
    }
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    return best;
}

typedef struct TimedGemm {
    void *y, *x, *w;
    int n;
} TimedGemm;

static void timed_gemm(CudaImpl *impl, void *ctx)
{
    const TimedGemm *g = (const TimedGemm *) ctx;
    gemm_bf16_lt(g->y, GEMM_OUT_F32, (const uint16_t *) g->x, (const uint16_t *) g->w, g->n, g->n,
                 g->n, &impl->lt, impl->stream);
}

double backend_cuda_gemm_tflops(Backend *be, int n)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    ASSERT(n > 0 && n % 8 == 0);
    const size_t elems = (size_t) n * n;
    TimedGemm g = {NULL, NULL, NULL, n};
    double tflops = 0.0;
    if (cudaMalloc(&g.x, elems * 2) != cudaSuccess || cudaMalloc(&g.w, elems * 2) != cudaSuccess
        || cudaMalloc(&g.y, elems * 4) != cudaSuccess) {
        (void) cudaGetLastError();
        LOG_ERROR("GEMM benchmark: no room for three %d x %d matrices on the GPU", n, n);
    } else {
        CUDA_CHECK(cudaMemsetAsync(g.x, 0x3c, elems * 2, impl->stream));  // bf16 0x3c3c: ~0.0115
        CUDA_CHECK(cudaMemsetAsync(g.w, 0x3c, elems * 2, impl->stream));
        const float ms = best_ms(impl, timed_gemm, &g);
        tflops = 2.0 * (double) n * n * n / (ms * 1e-3) / 1e12;
    }
    cudaFree(g.x);
    cudaFree(g.w);
    cudaFree(g.y);
    return tflops;
}

typedef struct TimedCopy {
    void *dst;
    const void *src;
    size_t bytes;
} TimedCopy;

static void timed_copy(CudaImpl *impl, void *ctx)
{
    const TimedCopy *c = (const TimedCopy *) ctx;
    CUDA_CHECK(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, impl->stream));
}

double backend_cuda_copy_gbs(Backend *be, size_t bytes)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    void *a = NULL, *b = NULL;
    double gbs = 0.0;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
        (void) cudaGetLastError();
        LOG_ERROR("copy benchmark: no room for 2 x %zu bytes on the GPU", bytes);
    } else {
        CUDA_CHECK(cudaMemsetAsync(a, 1, bytes, impl->stream));
        TimedCopy c = {b, a, bytes};
        const float ms = best_ms(impl, timed_copy, &c);
        gbs = 2.0 * (double) bytes / (ms * 1e-3) / 1e9;
    }
    cudaFree(a);
    cudaFree(b);
    return gbs;
}

static void cuda_destroy(Backend *be)
{
    if (!be) return;
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (impl) {
        if (impl->n_replays + impl->n_captures + impl->n_eager)
            LOG_INFO("CUDA graphs: %llu graphed calls replayed, %llu captured (%.1f ms recording "
                     "and instantiating), %llu run eagerly (a key or a device allocation changed "
                     "since the last call; %.1f ms launching)",
                     impl->n_replays, impl->n_captures, 1e3 * impl->capture_s, impl->n_eager,
                     1e3 * impl->eager_s);
        if (impl->n_downloads)
            LOG_INFO("CUDA downloads: %llu, %.1f MB in %.1f ms of copying (%.2f GB/s)",
                     impl->n_downloads, impl->download_bytes / 1e6, 1e3 * impl->download_s,
                     impl->download_bytes / 1e9 / (impl->download_s > 0 ? impl->download_s : 1e-9));
        for (int i = 0; i < impl->n_allocs; i++)
            cudaFree(impl->allocs[i]);
        free(impl->allocs);
        for (int i = 0; i < N_SCRATCH; i++)
            cudaFree(impl->scratch[i]);
        for (int i = 0; i < MAX_POOLS; i++)
            cudaFree(impl->pools[i].dev);
        for (int i = 0; i < MAX_STEPS; i++) {
            free(impl->steps[i].host);
            cudaFree(impl->steps[i].dev);
        }
        free(impl->step_eager.host);
        cudaFree(impl->step_eager.dev);
        free(impl->step_tmp);
        for (int i = 0; i < impl->n_tables; i++)
            cudaFree(impl->tables[i].dev);
        for (int i = 0; i < MAX_GRAPHS; i++)
            if (impl->graph_cache[i].n_key) cudaGraphExecDestroy(impl->graph_cache[i].exec);
        gemm_lt_free(&impl->lt);
        if (impl->stream) cudaStreamDestroy(impl->stream);
        free(impl);
    }
    free(be);
}

Err backend_cuda_create(int device, Backend **out)
{
    *out = NULL;
    int n_devices = 0;
    cudaError_t e = cudaGetDeviceCount(&n_devices);
    if (e != cudaSuccess || device < 0 || device >= n_devices) {
        LOG_ERROR("no CUDA device %d (%d found%s%s)", device, e == cudaSuccess ? n_devices : 0,
                  e == cudaSuccess ? "" : ": ", e == cudaSuccess ? "" : cudaGetErrorString(e));
        (void) cudaGetLastError();
        return ERR_INVAL;
    }
    if ((e = cudaSetDevice(device)) != cudaSuccess) {
        LOG_ERROR("cannot use CUDA device %d: %s", device, cudaGetErrorString(e));
        return ERR_INVAL;
    }
    Backend *be = (Backend *) calloc(1, sizeof *be);
    CudaImpl *impl = (CudaImpl *) calloc(1, sizeof *impl);
    if (!be || !impl) {
        free(be);
        free(impl);
        return ERR_NOMEM;
    }
    impl->device = device;
    CUDA_CHECK(cudaDeviceGetAttribute(&impl->n_sm, cudaDevAttrMultiProcessorCount, device));
    if ((e = cudaStreamCreate(&impl->stream)) != cudaSuccess) {  // blocking: ordered with
        LOG_ERROR("cannot create a CUDA stream: %s", cudaGetErrorString(e));  // cudaMemcpy
        free(be);
        free(impl);
        return ERR_INVAL;
    }
    impl->profile = backend_env_flag("GLMSPARK_CUDA_PROFILE", false);
    impl->moe_wide = backend_env_flag("GLMSPARK_MOE_WIDE", true);
    impl->dsa_score_bytes = DSA_SCORE_BYTES;
    const char *chunk = getenv("GLMSPARK_MOE_CHUNK");
    if (chunk && *chunk) {  // an experiment's knob: tokens per expert launch of a prefill
        char *end;
        const long v = strtol(chunk, &end, 10);
        const long most = impl->moe_wide ? MOE_MAX_WIDE_PAIRS : MOE_MAX_CHUNK_PAIRS;
        if (*end || v < 1 || v > most) {
            LOG_ERROR("GLMSPARK_MOE_CHUNK=%s: expected tokens per expert launch, 1 .. %ld (a "
                      "launch takes at most %ld pairs on %s, so at most %ld / top_k tokens)",
                      chunk, most, most,
                      impl->moe_wide ? "the wide tiles" : "the 8-column tiles (GLMSPARK_MOE_WIDE=0)",
                      most);
            cudaStreamDestroy(impl->stream);
            free(be);
            free(impl);
            return ERR_INVAL;
        }
        impl->moe_chunk = (int) v;
    }
    gemm_lt_init(&impl->lt);
    impl->graphs = !impl->profile && backend_env_flag("GLMSPARK_CUDA_GRAPHS", true);
    be->impl = impl;
    be->name = "cuda";
    be->destroy = cuda_destroy;
    be->alloc = cuda_alloc;
    be->free_mem = cuda_free_mem;
    be->upload = cuda_upload;
    be->download = cuda_download;
    be->pin_host = cuda_pin_host;
    be->unpin_host = cuda_unpin_host;
    be->bind_linear = cuda_bind_linear;
    be->bind_experts = cuda_bind_experts;
    be->bind_kv_b = cuda_bind_kv_b;
    be->precision = BACKEND_PRECISION_BF16;
    be->mla_tc = backend_mla_tc_env();
    be->dsa_tc = backend_dsa_tc_env();
    be->matmul = cuda_matmul;
    be->matmul_rows = cuda_matmul_rows;
    be->matmul_add = cuda_matmul_add;
    be->embed = cuda_embed;
    be->rmsnorm = cuda_rmsnorm;
    be->layernorm = cuda_layernorm;
    be->rope = cuda_rope;
    be->silu_mul = cuda_silu_mul;
    be->add = cuda_add;
    be->route = cuda_route;
    be->dsa_topk = cuda_dsa_topk;
    be->mla_attention = cuda_mla_attention;
    be->kv_write = cuda_kv_write;
    be->moe = cuda_moe;
    be->graph_begin = cuda_graph_begin;
    be->graph_end = cuda_graph_end;
    *out = be;
    return ERR_OK;
}
