/*
 * backend_cuda.cu - the CUDA backend (backend_cuda.h): every op of backend.h on one stream of
 * the backend's own, through the kernels of kernels/ only, with the decode step replayable as
 * a CUDA graph.
 *
 * Design:
 * - One recipe: the bf16 precision recipe of engine/model/backend.h (Backend.kernels; the
 *   f32 recipe and an f32 KV cache are the CPU reference's, refused here by backends.h's
 *   backend_kind_check and model.c). Every dense weight is bound in bf16 (backend_bind_rounds:
 *   f32, f16, FP8 and NVFP4 weights decoded and rounded once at load, as the CPU backend
 *   following the recipe binds them) and multiplied by kernels/gemm.h (matmul_tuned: the
 *   CUDA-core GEMV for 1 token, tensor cores from 2 when the rows fill the chip twice,
 *   cuBLASLt past GEMM_MAX_TOK tokens), a weight whose columns are not in 8s through a
 *   zero-padded copy (PadLin). Routed experts are stacked at bind_experts as kernels/moe.h
 *   reads them: NVFP4 experts packed for its tensor-core tiles, any others in bf16 for its
 *   bf16 kernels (GLM-5.2's MTP layer). MLA runs kernels/mla.h over the engine's own pages
 *   with kv_b repacked at bind_kv_b (mla_tuned), the indexer kernels/dsa.h, norms
 *   kernels/norm.h, RoPE kernels/rope.h, SwiGLU, adds and the embedding lookup kernels/act.h,
 *   the KV write kernels/kv.h, the router kernels/moe.h. A model narrower than GLM-5 runs the
 *   same kernels at GLM-5's widths on zero-padded values: the KV cache stores entries and
 *   index keys padded (kv_cache.h), q, heads and kv_b are padded here and the outputs cropped
 *   (kernels/act.h act_repad); zeros change no sum. A model outside what the kernels take is
 *   refused at load (model.c check_kernel_shapes); reaching an op with such a shape is a bug
 *   (log_fatal).
 * - KV cache: kv_cache.c owns a host pool; this backend keeps a device pool of the same
 *   layout per KvCache (found by address, created zeroed on first use), written by
 *   kernels/kv.h (kernels/kv_format.h's store routine, the CPU backend's) and read by the
 *   attention kernels, and keeps a step's block tables ([sequences, longest table], DevStep)
 *   in device rows per step shape (cache, sequence count, stride), uploaded again only when a
 *   table changed. The cache ops (kv_write, dsa_topk, mla_attention) run once per step for
 *   every sequence: a token finds its table row through BackendSeqs.seq_of. Only this backend
 *   reads or writes the device pool, so the host pool of a cache used with CUDA stays zero.
 * - Graphs (graph_begin/graph_end of backend.h): the caller names a run of ops by a key;
 *   the backend adds the cache, the sequence count and the block tables' stride (which name
 *   the step's table rows, whatever sequences fill them: a batch whose sequences change
 *   replays) and a generation counter that every device (re)allocation bumps, since launches
 *   capture pointers and grid sizes. A key seen in the previous call, with no allocation since, is captured
 *   (stream capture) and launched; later calls with the key replay the graph, the caller
 *   skipping the ops. Varying inputs (positions, token ids, block tables) live in device
 *   buffers the caller uploads before. Kernels launch with programmatic dependent launch
 *   (kernels/launch.h: each may be scheduled while the one before it finishes, and waits for
 *   it before touching memory), but for graphed steps (decode batches) of more than
 *   GLMSPARK_CUDA_PDL tokens (default 1: at batch 8 it lost, docs/perf.md; 0: never). A decode layer's
 *   projections of one normalized row run as one grouped GEMV (matmul_group), the shared
 *   expert's SwiGLU in its store, the cache writes normalize and rotate what they store
 *   (kv_write's KvIn), and MLA's query split rotates q (BackendMla.rope_theta);
 *   GLMSPARK_CUDA_FUSE=0 runs those one op at a time (the same numbers: an A/B knob).
 *   GLMSPARK_CUDA_GRAPHS=0 turns graphs off;
 *   GLMSPARK_MOE_WIDE=0 keeps prefill chunks off the wide expert tiles (moe_tuned);
 *   MLA attention runs on the tensor cores where the shape allows (Backend.mla_tc:
 *   mla_decode_tc, whose recipe also rounds q and the probabilities to bf16, as the CPU
 *   backend then does; GLMSPARK_MLA_TC=0 keeps mla_decode).
 * - DSA (backend_dsa_tuned): kernels/dsa.h's scores and top-k over the engine's key pages
 *   (kv_dsa_cache_stored), fp32 scores in the order the CPU backend follows
 *   (kernels/dsa_format.h), so the two select the same keys. The scores run on the tensor
 *   cores (Backend.dsa_tc: dsa_scores_tc, q rounded to bf16, as the CPU backend then does;
 *   the accumulation order differs; GLMSPARK_DSA_TC=0 keeps dsa_scores).
 * Host syncs: uploads and downloads (cudaMemcpy semantics), scratch growth, block-table
 * uploads when a sequence gains a block, and the first use of a cache; none inside a decode
 * step's layer loop once its graph exists.
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
#include "engine/shared/num.h"
#include "kernels/act.h"
#include "kernels/dsa.h"
#include "kernels/gemm.h"
#include "kernels/kv.h"
#include "kernels/launch.h"
#include "kernels/mla.h"
#include "kernels/moe.h"
#include "kernels/norm.h"
#include "kernels/nvfp4_format.h"
#include "kernels/rope.h"

enum {
    SCRATCH_A,  // DSA scores
    SCRATCH_C,  // a padded weight's zero-padded input
    SCRATCH_E,  // MoE slot grouping
    SCRATCH_X,  // bf16 inputs of the tuned kernels (x, q_nope); the experts' pair outputs
    SCRATCH_Y,  // their intermediates (expert activations, q_pe, o_lat)
    SCRATCH_Z,  // q_lat, mla_decode's split workspace
    SCRATCH_T,  // a fused op's temporary when it runs one op at a time (kv_write's transformed
                // values, a SwiGLU pair's up product, MLA's rotated q)
    N_SCRATCH,
    MAX_POOLS = 16,
    MAX_STEPS = 64,  // graphed steps' block tables kept: (cache, sequences, stride) shapes
    MAX_EXPERT_STACKS = 512,
    MAX_KV_B = 512,
    MAX_PAD_LINS = 1024,
    MAX_GRAPHS = 16,
    MAX_GRAPH_KEY = 256,  // key words (caller's and backend's) a graph can be recorded under
    MAX_GRAPH_TOKENS_PDL = 1 << 20,  // GLMSPARK_CUDA_PDL's largest value
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

// A MoE layer's experts stacked as kernels/moe.h reads them (bind_experts): NVFP4 packed
// (ex), or (bf16) in bf16 (exb; ex then holds only the widths and the count, for the
// grouping); each expert's CkptLinear points into the stack.
typedef struct ExpertStack {
    const CkptLinear *experts;
    bool bf16;
    MoeExperts ex;
    MoeExpertsBf16 exb;
    int32_t *cnt;  // NVFP4: moe_experts_w2_combine's counters (zero between launches)
} ExpertStack;

// A bf16 weight whose columns are not in 8s, as the tuned GEMV reads it (bind_linear): rows
// of cols_p (the columns rounded up to 8) with zeros after the weight's own, found by the
// bound copy's address (data).
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
    int n_sm;                // streaming multiprocessors
    // Double precision at no worse than a quarter of single (the data-centre parts: H100 1/2;
    // GB10 and the other consumer-class GPUs 1/64): where norm_matmul_group's one launch pays
    // off, its every block repeating the norm's double arithmetic.
    bool fp64_fast;
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
    // The fused launches (matmul_group's grouped GEMV and SwiGLU, kv_write's norm and RoPE):
    // on unless GLMSPARK_CUDA_FUSE=0, which runs the same kernels one op at a time (an A/B
    // knob for measuring what the fusions save; the numbers are the same either way).
    bool fuse;
    // Programmatic dependent launch (GLMSPARK_CUDA_PDL=N, default 1; 0: never): on for every
    // launch but a graphed step's (graph_begin: decode batches, at most 64 tokens) of more
    // than N tokens. Measured on an H100 (docs/perf.md run 21, 5 layers): 43 µs faster at
    // batch 1, 169 µs slower at batch 8, 0.8-1.7% faster prefill.
    int pdl_tokens;
    size_t dsa_score_bytes;  // a DSA top-k pass's scores (DSA_SCORE_BYTES; tests lower it)
    int mla_split_pos;  // GLMSPARK_MLA_SPLIT_POS: the fewest cache positions a decode split
                        // takes (0: the kernel's tile, 32 on the tensor cores, 16 otherwise)
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
    ExpertStack stacks[MAX_EXPERT_STACKS];
    int n_stacks;
    KvBPack kv_bs[MAX_KV_B];
    int n_kv_b;
    PadLin pad_lins[MAX_PAD_LINS];
    int n_pad_lins;
    GemmLt lt;  // cuBLASLt for tuned matmuls of more than GEMM_MAX_TOK tokens
} CudaImpl;

// ---------------------------------------------------------------------------
// Host side

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

// Bytes of a bound weight (bf16, the only dense format the kernels read).
static double lin_bytes(const CkptLinear *w)
{
    return 2.0 * (double) w->rows * (double) w->cols;
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

// A copy of n floats of src in SCRATCH_T: the input of a fused op run one op at a time.
static float *scratch_copy(CudaImpl *impl, const float *src, size_t n)
{
    float *t = (float *) scratch(impl, SCRATCH_T, n * sizeof(float));
    CUDA_CHECK(cudaMemcpyAsync(t, src, n * sizeof(float), cudaMemcpyDeviceToDevice, impl->stream));
    return t;
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

// Layer `layer` of kv's device pool as kernels/kv.h's kv_write addresses it.
static KvPages kv_pages(CudaImpl *impl, const KvCache *kv, int layer)
{
    unsigned char *pool = dev_pool(impl, kv);
    const KvPages pg = {pool + kv->mla_offset[layer],
                        kv->entry[layer].key_page ? pool + kv->key_offset[layer] : NULL,
                        kv->entry[layer]};
    return pg;
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
    if (w->cols % 8 == 0) return ERR_OK;
    if (impl->n_pad_lins == MAX_PAD_LINS) {
        LOG_ERROR("%s: more than %d weights with columns not in 8s (each needs a padded copy "
                  "for the GEMV)",
                  w->name ? w->name : "a weight", MAX_PAD_LINS);
        return ERR_INVAL;
    }
    return pad_linear(impl, w, (const uint16_t *) host);
}

static const PadLin *pad_lin(const CudaImpl *impl, const CkptLinear *w)
{
    for (int i = 0; i < impl->n_pad_lins; i++)
        if (impl->pad_lins[i].data == w->data) return &impl->pad_lins[i];
    return NULL;
}

// w's values in bf16 on the host: its own data when stored in bf16, else decoded and rounded
// into buf (backend_round_linear; row: float [w->cols] of scratch).
static const void *bf16_values(const Backend *be, const CkptLinear *w, uint16_t *buf, float *row)
{
    if (!backend_bind_rounds(be, w)) return w->data;
    backend_round_linear(w, buf, row);
    return buf;
}

// Every weight is stored in bf16 (backend_bind_rounds: the BF16 recipe, the only one this
// backend runs, rounds every other format when bound, as the CPU backend following it does),
// with a padded copy where its columns are not in 8s (bind_padded).
static Err cuda_bind_linear(Backend *be, CkptLinear *w)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    ASSERT(be->precision == BACKEND_PRECISION_BF16);
    const size_t n = (size_t) w->rows * (size_t) w->cols;
    uint16_t *rounded = NULL;
    float *row = NULL;
    if (backend_bind_rounds(be, w)) {
        rounded = (uint16_t *) malloc(n * 2);
        row = (float *) malloc((size_t) w->cols * sizeof(float));
        if (!rounded || !row) {
            free(rounded), free(row);
            return ERR_NOMEM;
        }
    }
    const void *host = bf16_values(be, w, rounded, row);
    free(row);
    void *data = keep_copy(impl, host, n * 2);
    Err err = ERR_NOMEM;
    if (data) {
        w->data = data;
        w->format = CKPT_LINEAR_BF16;
        w->scale = NULL;
        w->scale_f32 = NULL;
        err = bind_padded(be, w, host);
    } else {
        LOG_ERROR("out of GPU memory binding %s (%zu bytes)", w->name ? w->name : "a weight",
                  n * 2);
    }
    free(rounded);
    return err;
}

// Routed experts not all NVFP4, stored in bf16 (backend_bind_rounds' rounding for any other
// format) and stacked as kernels/moe.h's MoeExpertsBf16: gate and up of expert e as rows [e 2
// inter, (e + 1) 2 inter) of w13, its down as w2[e]. GLM-5.2's MTP layer keeps its experts in
// bf16.
static Err bind_experts_bf16(Backend *be, CkptLinear *experts, int n_experts)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    const size_t E = (size_t) n_experts, hidden = (size_t) experts[0].cols,
                 inter = (size_t) experts[0].rows, nm = inter * hidden;
    const char *name = experts[0].name ? experts[0].name : "routed experts";
    uint16_t *w13 = (uint16_t *) keep_alloc(impl, E * 2 * nm * 2);
    uint16_t *w2 = (uint16_t *) keep_alloc(impl, E * nm * 2);
    uint16_t *buf = (uint16_t *) malloc(nm * 2);
    float *row = (float *) malloc((hidden > inter ? hidden : inter) * sizeof(float));
    if (!w13 || !w2 || !buf || !row) {
        free(buf), free(row);
        LOG_ERROR("out of memory binding the %d bf16 experts of %s (%.2f GB on the GPU)",
                  n_experts, name, 3.0 * E * nm * 2 / 1e9);
        return ERR_NOMEM;
    }
    for (size_t e = 0; e < E; e++) {
        CkptLinear *w = &experts[3 * e];
        uint16_t *dst[3] = {w13 + e * 2 * nm, w13 + e * 2 * nm + nm, w2 + e * nm};
        for (int k = 0; k < 3; k++) {
            CUDA_CHECK(cudaMemcpy(dst[k], bf16_values(be, &w[k], buf, row), nm * 2,
                                  cudaMemcpyHostToDevice));
            w[k].data = dst[k];
            w[k].format = CKPT_LINEAR_BF16;
            w[k].scale = NULL;
            w[k].scale_f32 = NULL;
        }
    }
    free(buf), free(row);
    ExpertStack *st = &impl->stacks[impl->n_stacks++];
    memset(st, 0, sizeof *st);
    st->experts = experts;
    st->bf16 = true;
    st->ex.n_experts = n_experts;  // the grouping's widths (moe_work_ints)
    st->ex.hidden = (int) hidden;
    st->ex.inter = (int) inter;
    st->exb = (MoeExpertsBf16){w13, w2, n_experts, (int) hidden, (int) inter};
    return ERR_OK;
}

// Routed experts, stacked in one allocation per array as kernels/moe.h reads them: NVFP4
// experts packed there (moe_pack_w13 / moe_pack_w2), others in bf16 (bind_experts_bf16).
static Err cuda_bind_experts(Backend *be, CkptLinear *experts, int n_experts)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    const char *name = experts[0].name ? experts[0].name : "routed experts";
    // A model loaded after another may reuse a freed experts array's address: forget what
    // was kept for that address (the device memory stays until destroy, as every weight's).
    for (int i = 0; i < impl->n_stacks; i++)
        if (impl->stacks[i].experts == experts) impl->stacks[i--] = impl->stacks[--impl->n_stacks];
    if (impl->n_stacks == MAX_EXPERT_STACKS) {
        LOG_ERROR("%s: more than %d MoE layers on one CUDA backend", name,
                  MAX_EXPERT_STACKS);
        return ERR_INVAL;
    }
    const size_t E = (size_t) n_experts, hidden = (size_t) experts[0].cols,
                 inter = (size_t) experts[0].rows;
    for (size_t i = 0; i < 3 * E; i++) {
        const CkptLinear *w = &experts[i];
        const bool down = i % 3 == 2;
        if ((size_t) w->rows != (down ? hidden : inter)
            || (size_t) w->cols != (down ? inter : hidden)) {
            LOG_ERROR("%s: expert shape [%d, %d] differs from the layer's",
                      w->name ? w->name : name, w->rows, w->cols);
            return ERR_INVAL;
        }
    }
    // Both formats' kernels stage a tile's columns of the longer K (the bf16 ones at most
    // what the NVFP4 ones do).
    int smem_max = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                      impl->device));
    const size_t smem = moe_experts_smem_bytes((int) hidden, (int) inter);
    if (smem > (size_t) smem_max) {
        LOG_ERROR("%s: the routed experts' kernels need %zu bytes of shared memory per block at "
                  "hidden %zu and intermediate %zu; this GPU allows %d",
                  name, smem, hidden, inter, smem_max);
        return ERR_INVAL;
    }
    if (!backend_experts_nvfp4(experts, n_experts)) return bind_experts_bf16(be, experts, n_experts);
    const size_t q13 = E * 2 * inter * hidden / 2, s13 = E * 2 * inter * hidden / NVFP4_GROUP;
    const size_t q2 = E * hidden * inter / 2, s2 = E * hidden * inter / NVFP4_GROUP;
    uint8_t *dq13 = (uint8_t *) keep_alloc(impl, q13), *ds13 = (uint8_t *) keep_alloc(impl, s13);
    uint8_t *dq2 = (uint8_t *) keep_alloc(impl, q2), *ds2 = (uint8_t *) keep_alloc(impl, s2);
    float *dg13 = (float *) keep_alloc(impl, E * 2 * sizeof(float));
    float *dg2 = (float *) keep_alloc(impl, E * sizeof(float));
    const size_t n_cnt = moe_combine_counters((int) hidden);
    int32_t *cnt = (int32_t *) keep_alloc(impl, n_cnt * sizeof(int32_t));
    float *g = (float *) malloc(E * 3 * sizeof(float));
    // Staging for one expert's gate and up as stored (the largest of its matrices).
    const size_t nq = inter * hidden / 2, ns = inter * hidden / NVFP4_GROUP;
    uint8_t *tq = NULL, *ts = NULL;
    const bool staged = cudaMalloc((void **) &tq, 2 * nq) == cudaSuccess
                        && cudaMalloc((void **) &ts, 2 * ns) == cudaSuccess;
    if (!dq13 || !ds13 || !dq2 || !ds2 || !dg13 || !dg2 || !cnt || !g || !staged) {
        free(g);
        cudaFree(tq), cudaFree(ts);
        (void) cudaGetLastError();
        LOG_ERROR("out of GPU memory binding the %d experts of %s", n_experts, name);
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
    CUDA_CHECK(cudaMemset(cnt, 0, n_cnt * sizeof(int32_t)));
    free(g);
    ExpertStack *st = &impl->stacks[impl->n_stacks++];
    memset(st, 0, sizeof *st);
    st->experts = experts;
    st->ex = (MoeExperts){dq13, ds13, dg13, dq2, ds2, dg2, n_experts, (int) hidden, (int) inter};
    st->cnt = cnt;
    return ERR_OK;
}

// The stack of experts (bind_experts), or NULL.
static const ExpertStack *expert_stack(const CudaImpl *impl, const CkptLinear *experts)
{
    for (int i = 0; i < impl->n_stacks; i++)
        if (impl->stacks[i].experts == experts) return &impl->stacks[i];
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
    const char *name = kv_b->name ? kv_b->name : "kv_b_proj";
    if (!backend_mla_shape_tuned(p)) {  // model.c's check_kernel_shapes refuses such a model first
        LOG_ERROR("%s: MLA wider than kernels/mla.h takes", name);
        return ERR_INVAL;
    }
    if (impl->n_kv_b == MAX_KV_B) {
        LOG_ERROR("%s: more than %d attention layers on one CUDA backend", name, MAX_KV_B);
        return ERR_INVAL;
    }
    const size_t nk = backend_mla_uk_elems(p), nv = backend_mla_uv_elems(p);
    uint16_t *uk = (uint16_t *) malloc(nk * 2), *uv = (uint16_t *) malloc(nv * 2);
    Err err = uk && uv ? backend_mla_pack_kv_b(kv_b, p, uk, uv) : ERR_NOMEM;
    void *duk = err ? NULL : keep_copy(impl, uk, nk * 2);
    void *duv = err ? NULL : keep_copy(impl, uv, nv * 2);
    free(uk), free(uv);
    if (err) return err;
    if (!duk || !duv) {
        LOG_ERROR("out of GPU memory repacking %s", name);
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

#ifndef GEMV_TC_MIN_TOK
#define GEMV_TC_MIN_TOK 2  // a build may set it, to measure another
#endif

// Whether a weight of these rows takes the tensor-core GEMV (from GEMV_TC_MIN_TOK tokens, or
// from one in matmul_rows): its blocks of 8 rows fill the chip twice.
static bool gemv_tc_rows(const CudaImpl *impl, int rows)
{
    return (long) (rows + 7) / 8 >= 2L * impl->n_sm;
}

// y fp32 [n, n_mat, rows] = w bf16 [n_mat, rows, cols] x [n, n_mat, cols] (acc: y +=) through
// kernels/gemm.h, GEMM_MAX_TOK tokens a launch: x bf16, or (x_f32) fp32 rounded to bf16 as it
// is read; tensor cores for launches of tc_from tokens or more (0: never). The tensor-core
// GEMV's sums for a token do not depend on the launch's other tokens (kernels/gemm.h).
static void gemv_chunks(CudaImpl *impl, float *y, const uint16_t *w, const void *x, bool x_f32,
                        int rows, int cols, int n_mat, int n, int tc_from, bool acc)
{
    const size_t x_elem = x_f32 ? sizeof(float) : sizeof(uint16_t);
    for (int t0 = 0; t0 < n; t0 += GEMM_MAX_TOK) {
        const int nt = n - t0 < GEMM_MAX_TOK ? n - t0 : GEMM_MAX_TOK;
        float *yt = y + (size_t) t0 * n_mat * rows;
        const void *xt = (const char *) x + (size_t) t0 * n_mat * cols * x_elem;
        const bool use_tc = tc_from > 0 && nt >= tc_from;
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
                    gemv_tc_rows(impl, rows) ? GEMV_TC_MIN_TOK : 0, acc);
}

// Whether w runs through matmul_tuned as bound: bf16 (bind_linear stores every weight so),
// 16-byte aligned with columns in 8s (so every token's fp32 row of x stays 16-byte aligned
// when x is), or with a padded copy (PadLin).
static bool linear_tuned(const Backend *be, const CkptLinear *w)
{
    if (!backend_matmul_tuned(w)) return false;
    if (w->cols % 8) return pad_lin((const CudaImpl *) be->impl, w) != NULL;
    return (uintptr_t) w->data % 16 == 0;
}

// y = w x, or (acc) y += w x: the same sums, each rounded to fp32 and then added to y (in the
// tuned GEMV's store; after cuBLASLt, which cannot add, into a temporary, then act_add).
static void matmul_any(Backend *be, float *y, const CkptLinear *w, const float *x, int n, bool acc)
{
    ASSERT(w->rows > 0 && w->cols > 0 && n >= 0);
    if (n == 0) return;
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (!linear_tuned(be, w))
        log_fatal(__FILE__, __LINE__, "CUDA backend: %s was not bound as the GEMV reads it",
                  w->name ? w->name : "a weight");
    prof_begin(impl);
    const bool via_tmp = acc && matmul_lt(w, n);
    float *yt =
        via_tmp ? (float *) scratch(impl, SCRATCH_Y, (size_t) n * w->rows * sizeof(float)) : y;
    matmul_tuned(impl, yt, w, x, n, acc && !via_tmp);
    if (via_tmp) act_add(y, yt, (size_t) n * w->rows, impl->stream);
    prof_end(impl, PROF_MATMUL, lin_bytes(w));
}

static void cuda_matmul(Backend *be, float *y, const CkptLinear *w, const float *x, int n)
{
    matmul_any(be, y, w, x, n, false);
}

// Tuned and aligned: one GEMV launch per GEMM_MAX_TOK rows, whatever n the same kernel (each
// row's sums in the same order): the tensor-core one where its rows fill the chip twice (the
// lm_head; so from one row), else the CUDA-core one. Otherwise a one-row matmul per row.
static void cuda_matmul_rows(Backend *be, float *y, const CkptLinear *w, const float *x, int n)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (linear_tuned(be, w) && w->cols % 8 == 0 && (uintptr_t) x % 16 == 0) {
        prof_begin(impl);
        gemv_chunks(impl, y, (const uint16_t *) w->data, x, true, w->rows, w->cols, 1, n,
                    gemv_tc_rows(impl, w->rows) ? 1 : 0, false);
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

// Whether matmul_any would run w alone for n tokens on the GEMV's split-K kernel with x as
// it is (matmul_tuned: bf16 columns in 8s, no padded copy, x 16-byte aligned, at most
// GEMM_SK_MAX_ROWS rows, CUDA cores): the products gemm_bf16_gemv_group takes.
static bool group_member(const Backend *be, const CkptLinear *w, const float *x, int n)
{
    const CudaImpl *impl = (const CudaImpl *) be->impl;
    const bool tc = gemv_tc_rows(impl, w->rows);  // matmul_tuned's choice
    return linear_tuned(be, w) && w->cols % 8 == 0 && (uintptr_t) x % 16 == 0
           && w->rows <= GEMM_SK_MAX_ROWS && n <= GEMM_MAX_TOK && (n < 2 || !tc);
}

static void cuda_silu_mul(Backend *be, float *y, const float *gate, const float *up, int n_elems);
static_assert(BACKEND_MAX_GROUP <= GEMM_MAX_GROUP, "a matmul_group call is one grouped launch");

// The products the split-K kernel would run alone (a SwiGLU pair: both of its weights), in one
// gemm_bf16_gemv_group launch (bit for bit their matmul's numbers, and a pair's silu_mul's:
// gemm.h); the others (and all of them with GLMSPARK_CUDA_FUSE=0) through matmul_any, a pair's
// up product into a temporary, then silu_mul.
// The products of p over x that the grouped GEMV takes (GLMSPARK_CUDA_FUSE permitting; a
// SwiGLU pair: both of its weights): their segments in segs, in_group[i] set, *bytes their
// weights' bytes. Returns how many.
static int group_segs(Backend *be, const BackendProduct *p, int n_p, const float *x, int n,
                      GemmSeg *segs, bool *in_group, double *bytes)
{
    const CudaImpl *impl = (const CudaImpl *) be->impl;
    int n_segs = 0;
    *bytes = 0.0;
    for (int i = 0; i < n_p; i++) {
        const CkptLinear *w = p[i].w, *up = p[i].up;
        ASSERT(w->cols == p[0].w->cols && (!up || (up->rows == w->rows && up->cols == w->cols)));
        in_group[i] =
            impl->fuse && group_member(be, w, x, n) && (!up || group_member(be, up, x, n));
        if (!in_group[i]) continue;
        segs[n_segs++] = (GemmSeg){(const uint16_t *) w->data,
                                   up ? (const uint16_t *) up->data : NULL, p[i].y, w->rows};
        *bytes += lin_bytes(w) + (up ? lin_bytes(up) : 0.0);
    }
    return n_segs;
}

static void cuda_matmul_group(Backend *be, const BackendProduct *p, int n_p, const float *x, int n)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    ASSERT(n_p >= 1 && n_p <= BACKEND_MAX_GROUP && n >= 0);
    if (n == 0) return;
    GemmSeg segs[BACKEND_MAX_GROUP];
    double bytes;
    bool in_group[BACKEND_MAX_GROUP];
    int n_segs = group_segs(be, p, n_p, x, n, segs, in_group, &bytes);
    if (n_segs == 1 && !segs[0].w_up) n_segs = 0;  // one plain product: matmul_any's launch
    if (n_segs) {
        prof_begin(impl);
        gemm_bf16_gemv_group(segs, n_segs, x, p[0].w->cols, n, impl->stream);
        prof_end(impl, PROF_MATMUL, bytes);
    }
    for (int i = 0; i < n_p; i++) {
        if (n_segs && in_group[i]) continue;
        matmul_any(be, p[i].y, p[i].w, x, n, false);
        if (!p[i].up) continue;
        const int elems = n * p[i].w->rows;
        float *u = (float *) scratch(impl, SCRATCH_T, (size_t) elems * sizeof(float));
        matmul_any(be, u, p[i].up, x, n, false);
        cuda_silu_mul(be, p[i].y, p[i].y, u, elems);
    }
}

// In one launch (kernels/gemm.h gemm_bf16_gemv_group_norm) when matmul_group would run every
// product in its grouped launch, the kernel takes the rows and double precision is fast
// (fp64_fast: ~1,000 blocks each normalizing a 6,144-wide row in double cost tens of us at
// 1/64 rate); otherwise the two ops.
static void cuda_norm_matmul_group(Backend *be, const BackendProduct *p, int n_p, float *h,
                                   const float *x, const float *norm_w, float eps, int n)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    ASSERT(n_p >= 1 && n_p <= BACKEND_MAX_GROUP && n >= 0);
    if (n == 0) return;
    const int cols = p[0].w->cols;
    GemmSeg segs[BACKEND_MAX_GROUP];
    double bytes;
    bool in_group[BACKEND_MAX_GROUP];
    const bool one = impl->fp64_fast && gemm_group_norm_ok(h, x, norm_w, cols, n)
                     && (n_p > 1 || p[0].up)
                     && group_segs(be, p, n_p, h, n, segs, in_group, &bytes) == n_p;
    if (!one) {
        backend_norm_matmul_group_ops(be, p, n_p, h, x, norm_w, eps, n);
        return;
    }
    prof_begin(impl);
    gemm_bf16_gemv_group_norm(segs, n_p, h, x, norm_w, eps, cols, n, impl->stream);
    prof_end(impl, PROF_MATMUL, bytes);
}

static void cuda_embed(Backend *be, float *y, const CkptLinear *table, const int *ids, int n)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    if (n == 0) return;
    ASSERT(table->format == CKPT_LINEAR_BF16);  // bind_linear stores every weight in bf16
    prof_begin(impl);
    act_embed(y, (const uint16_t *) table->data, table->rows, table->cols, ids, n, impl->stream);
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

static void check_route(const BackendRoute *p)
{
    const int E = p->n_experts, G = p->n_group;
    ASSERT(E > 0 && p->top_k > 0 && p->top_k <= E && G > 0 && E % G == 0 && p->topk_group > 0
           && p->topk_group <= G);
}

static void cuda_route_ops(CudaImpl *impl, int *idx, float *wts, const float *logits,
                           const float *bias, int n, const BackendRoute *p)
{
    prof_begin(impl);
    moe_route(idx, wts, logits, bias, n, p->n_experts, p->top_k, p->n_group, p->topk_group,
              p->norm_topk_prob, p->routed_scaling_factor, true, impl->stream);
    prof_end(impl, PROF_ROUTE, 0.0);
}

static void cuda_route(Backend *be, int *idx, float *wts, const float *logits, const float *bias,
                       int n, const BackendRoute *p)
{
    check_route(p);
    if (n == 0) return;
    cuda_route_ops((CudaImpl *) be->impl, idx, wts, logits, bias, n, p);
}

// With a transform: in the write's launch (kernels/kv.h), or (GLMSPARK_CUDA_FUSE=0, or a write
// wider than the launch stages) the rmsnorm or layernorm op and the rope op into a copy first,
// then the plain write.
static void cuda_kv_write(Backend *be, KvCache *kv, const BackendSeqs *s, int layer, int offset,
                          const float *src, int width, const KvIn *in)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    const int n = s->n;
    const KvEntryLayout *lo = &kv->entry[layer];
    ASSERT(kv_write_ok(lo, offset, width));
    if (n == 0 || width == 0) return;
    if (in && (!impl->fuse || width > KV_IN_MAX)) {
        // The norm reads src itself (norm.cu judges its 16-byte loads on src, as the fused
        // write does), writing into the copy.
        float *t = scratch_copy(impl, src, (size_t) n * width);
        backend_kv_in_ops(be, t, src, n, width, in, s->pos);
        src = t;
        in = NULL;
    }
    const DevStep *st = dev_step(impl, kv, s->seqs, s->n_seqs);
    const KvPages pg = kv_pages(impl, kv, layer);
    prof_begin(impl);
    kv_write(&pg, st->dev, st->stride, s->seq_of, s->pos, offset, src, width, n, in, impl->stream);
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
    if (n == 0) return;
    const int cap = seq_capacity(impl, kv, s);
    if (backend_dsa_tuned(p, kv, layer)) {
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
                              s->seq_of + r0, s->len + r0, cap, nr, p->n_heads, 0, impl->stream);
            else
                dsa_scores(score, cap, qr, wr, w_scale, sm_scale, &c, st->dev, st->stride,
                           s->seq_of + r0, s->len + r0, cap, nr, p->n_heads, impl->stream);
            dsa_topk(sel + (size_t) r0 * p->top_k, n_sel + r0, score, cap, s->len + r0, nr,
                     p->top_k, impl->stream);
        }
        prof_end(impl, PROF_DSA, 0.0);
        return;
    }
    log_fatal(__FILE__, __LINE__,
              "CUDA backend: DSA layer %d (%d heads of %d) outside kernels/dsa.h's shapes", layer,
              p->n_heads, p->head_dim);
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
        gemv_chunks(impl, y, w, x, false, rows, cols, n_mat, n, GEMV_TC_MIN_TOK, false);
}

// MLA attention through kernels/mla.h (backend_mla_tuned layers under the BF16 recipe): q
// split into bf16 q_nope and fp32 q_pe (already rotated by the model), q_lat = W_UK^T q_nope,
// split-KV decode over the layer's own pages (kv_cache.h's layout is mla.h's), out = W_UV
// o_lat (heads_product). A model narrower than GLM-5 runs at the kernels' widths: q split
// zero-padded to MLA_QK_NOPE + MLA_ROPE and Hp heads (backend_mla_heads), kv_b repacked
// likewise (bind_kv_b), the cache padded (kv_cache.h), and out [Hp, Vp] cropped to [H, V]
// (act_repad). Tokens in chunks of 256 so the workspace stays bounded. tc (backend_mla_tc):
// the tensor-core kernel, mla_decode_tc (tiles of 32 positions; 32 heads a CTA, 64 for a
// prefill chunk's few long splits: mla_tc_heads). The split count is sized for 32.
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
    const int hpc = tc ? 32 : MLA_HEADS_PER_CTA, tile = tc ? 32 : 16;
    const int min_pos = impl->mla_split_pos > tile ? impl->mla_split_pos : tile;
    // About four CTAs per SM (Hp / hpc CTAs per token and split), at least min_pos positions a
    // split (each split writes every head's 512-float partial output, which the merge reads
    // back: at 1K context and 32 positions a split those are 8 MB against 0.7 MB of cache).
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
        const bool rotate = p->rope_theta > 0.0f && p->qk_rope > 0;  // q's RoPE in the split
        mla_q_split(q_nope, q_pe, q + (size_t) t0 * H * (p->qk_nope + p->qk_rope),
                    rotate ? s->pos + t0 : NULL, p->rope_theta, nc, H, p->qk_nope, p->qk_rope, Hp,
                    impl->stream);
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
    if (s->n == 0) return;
    const KvBPack *pk = backend_mla_tuned(p, &kv->entry[layer]) ? kv_b_pack(impl, kv_b) : NULL;
    if (pk) {
        BackendMla pp = *p;
        if (p->rope_theta > 0.0f && !impl->fuse) {  // the rope op on a copy, then a plain split
            float *qr =
                scratch_copy(impl, q, (size_t) s->n * p->n_heads * (p->qk_nope + p->qk_rope));
            backend_mla_q_rope(be, qr, s->n, p, s->pos);
            q = qr;
            pp.rope_theta = 0.0f;
        }
        mla_tuned(impl, out, q, pk, kv, s, layer, sel, n_sel, sel_stride, &pp,
                  backend_mla_tc(be, p, &kv->entry[layer]));
        return;
    }
    log_fatal(__FILE__, __LINE__,
              "CUDA backend: MLA layer %d outside kernels/mla.h's shapes or cache entries", layer);
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
// The routing route_moe hands moe_tuned: the router's logits and bias, its parameters, and
// where the choice goes (moe_tuned's idx and wts).
typedef struct RouteIn {
    const float *logits, *bias;
    const BackendRoute *p;
    int *idx;
    float *wts;
} RouteIn;

// A chunk's work list of 8-column tiles: moe_group on its nc tokens' experts idx, or (r: the
// step is this one chunk) routed into r->idx, r->wts and grouped in one launch.
static void group_chunk(CudaImpl *impl, int32_t *work, const int *idx, int nc, int top_k,
                        int n_experts, const RouteIn *r)
{
    if (r)
        moe_route_group(work, r->idx, r->wts, r->logits, r->bias, nc, n_experts, top_k,
                        r->p->norm_topk_prob, r->p->routed_scaling_factor, true, impl->stream);
    else
        moe_group(work, idx, nc, top_k, n_experts, impl->stream);
}

// With r: routes first, into r->idx and r->wts (= idx, wts; a single-chunk step that
// moe_route_group takes: routed and grouped in one launch, GLMSPARK_CUDA_FUSE permitting).
static void moe_tuned(CudaImpl *impl, float *out, const float *x, int n, const int *idx,
                      const float *wts, int top_k, const ExpertStack *st, const float *residual,
                      const RouteIn *r)
{
    const MoeExperts *ex = &st->ex;
    const bool wide_ok = impl->moe_wide && !st->bf16;
    const int most = (wide_ok ? MOE_MAX_WIDE_PAIRS : MOE_MAX_CHUNK_PAIRS) / top_k;
    const int per = impl->moe_chunk > 0 && impl->moe_chunk < most ? impl->moe_chunk : most;
    const int chunk = n < per ? n : per;
    const size_t hidden = (size_t) ex->hidden, inter = (size_t) ex->inter,
                 pairs = (size_t) chunk * top_k;
    const size_t narrow_ints = moe_work_ints((int) pairs, ex->n_experts),
                 wide_ints = wide_ok ? moe_wide_work_ints(ex, chunk, top_k) : 0;
    int32_t *work = (int32_t *) scratch(
        impl, SCRATCH_E, (narrow_ints > wide_ints ? narrow_ints : wide_ints) * sizeof(int32_t));
    uint16_t *act = (uint16_t *) scratch(impl, SCRATCH_Y, pairs * inter * 2);
    float *y = (float *) scratch(impl, SCRATCH_X, pairs * hidden * sizeof(float));
    const bool narrow = !wide_ok || n * top_k < MOE_WIDE_MIN_PAIRS * ex->n_experts;
    const bool route_group =
        r && impl->fuse && n == chunk && narrow
        && moe_route_group_ok(n, ex->n_experts, top_k, r->p->n_group, r->p->topk_group);
    if (r && !route_group) cuda_route_ops(impl, r->idx, r->wts, r->logits, r->bias, n, r->p);
    prof_begin(impl);
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const int nc = n - t0 < chunk ? n - t0 : chunk;
        const size_t k0 = (size_t) t0 * top_k;
        const float *xc = x + (size_t) t0 * hidden;
        // Past MOE_MAX_CHUNK_PAIRS a chunk is wide: 8,192 pairs >= 16 x MOE_MAX_EXPERTS.
        if (st->bf16) {
            group_chunk(impl, work, idx + k0, nc, top_k, ex->n_experts, route_group ? r : NULL);
            moe_experts_bf16_w13(act, &st->exb, xc, work, nc, top_k, impl->stream);
            moe_experts_bf16_w2(y, &st->exb, act, work, wts + k0, nc, top_k, impl->stream);
        } else if (wide_ok && nc * top_k >= MOE_WIDE_MIN_PAIRS * ex->n_experts) {
            moe_group_wide(work, idx + k0, nc, top_k, ex->n_experts, impl->stream);
            moe_experts_w13_wide(act, ex, xc, work, nc, top_k, impl->stream);
            moe_experts_w2_wide(y, ex, act, work, wts + k0, nc, top_k, impl->stream);
        } else {
            group_chunk(impl, work, idx + k0, nc, top_k, ex->n_experts, route_group ? r : NULL);
            moe_experts_w13(act, ex, xc, work, nc, top_k, impl->stream);
            if (impl->fuse && nc <= MOE_COMBINE_FUSED_MAX_TOK) {  // down and the combine at once
                moe_experts_w2_combine(out + (size_t) t0 * hidden, y,
                                       residual ? residual + (size_t) t0 * hidden : NULL, st->cnt,
                                       ex, act, work, wts + k0, nc, top_k, impl->stream);
                continue;
            }
            moe_experts_w2(y, ex, act, work, wts + k0, nc, top_k, impl->stream);
        }
        moe_combine(out + (size_t) t0 * hidden, y, residual ? residual + (size_t) t0 * hidden : NULL,
                    nc, top_k, (int) hidden, impl->stream);
    }
    prof_end(impl, PROF_MOE, 0.0);
}

static void moe_any(Backend *be, float *out, const float *x, int n, const int *idx,
                    const float *wts, int top_k, const CkptLinear *experts, int n_experts,
                    const float *residual, const RouteIn *r)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    const int hidden = experts[0].cols, inter = experts[0].rows;
    for (int e = 0; e < n_experts; e++) {
        const CkptLinear *w = experts + 3 * (size_t) e;
        ASSERT(w[0].cols == hidden && w[0].rows == inter && w[1].cols == hidden
               && w[1].rows == inter && w[2].rows == hidden && w[2].cols == inter);
    }
    if (n == 0) return;
    const ExpertStack *st = expert_stack(impl, experts);  // only kernels/moe.h reads it
    if (st) {
        if (top_k > MOE_MAX_K)
            log_fatal(__FILE__, __LINE__, "top_k %d exceeds the tuned experts' %d", top_k,
                      MOE_MAX_K);
        moe_tuned(impl, out, x, n, idx, wts, top_k, st, residual, r);
        return;
    }
    log_fatal(__FILE__, __LINE__, "CUDA backend: the experts of %s were not bound",
              experts[0].name ? experts[0].name : "a MoE layer");
}

static void cuda_moe(Backend *be, float *out, const float *x, int n, const int *idx,
                     const float *wts, int top_k, const CkptLinear *experts, int n_experts,
                     const float *residual)
{
    moe_any(be, out, x, n, idx, wts, top_k, experts, n_experts, residual, NULL);
}

static void cuda_route_moe(Backend *be, float *out, const float *x, int n, int *idx, float *wts,
                           const float *logits, const float *bias, const BackendRoute *rp,
                           const CkptLinear *experts, int n_experts, const float *residual)
{
    check_route(rp);
    ASSERT(rp->n_experts == n_experts);
    if (n == 0) return;
    const RouteIn r = {logits, bias, rp, idx, wts};
    moe_any(be, out, x, n, idx, wts, rp->top_k, experts, n_experts, residual, &r);
}

// Graphs: see the file comment. A key too long for MAX_GRAPH_KEY runs eagerly.
static bool cuda_graph_begin(Backend *be, const KvCache *kv, KvSeq *const *seqs, int n_seqs,
                             int n_tok, const unsigned long long *key, int n_key)
{
    CudaImpl *impl = (CudaImpl *) be->impl;
    ASSERT(impl->mode == GRAPH_NONE && n_key >= 0 && n_seqs >= 0 && n_tok >= 0);
    // Recorded with the launches (the key names n_tok); graph_end restores it.
    kern_set_pdl(impl->pdl_tokens > 0 && n_tok <= impl->pdl_tokens);
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
    kern_set_pdl(impl->pdl_tokens > 0);
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

int backend_cuda_pdl_tokens(void)
{
    const char *v = getenv("GLMSPARK_CUDA_PDL");
    if (!v || !*v) return 1;
    int n;
    return num_parse_int(v, 0, MAX_GRAPH_TOKENS_PDL, &n) ? n : -1;
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
    int sp_dp = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sp_dp, cudaDevAttrSingleToDoublePrecisionPerfRatio, device));
    impl->fp64_fast = sp_dp > 0 && sp_dp <= 4;
    if ((e = cudaStreamCreate(&impl->stream)) != cudaSuccess) {  // blocking: ordered with
        LOG_ERROR("cannot create a CUDA stream: %s", cudaGetErrorString(e));  // cudaMemcpy
        free(be);
        free(impl);
        return ERR_INVAL;
    }
    impl->profile = backend_env_flag("GLMSPARK_CUDA_PROFILE", false);
    impl->moe_wide = backend_env_flag("GLMSPARK_MOE_WIDE", true);
    impl->fuse = backend_env_flag("GLMSPARK_CUDA_FUSE", true);
    impl->pdl_tokens = backend_cuda_pdl_tokens();
    if (impl->pdl_tokens < 0) {
        LOG_ERROR("GLMSPARK_CUDA_PDL=%s: expected the most tokens of a step launched with "
                  "programmatic dependent launch, 0 .. %d (0: never)",
                  getenv("GLMSPARK_CUDA_PDL"), MAX_GRAPH_TOKENS_PDL);
        cudaStreamDestroy(impl->stream);
        free(be);
        free(impl);
        return ERR_INVAL;
    }
    kern_set_pdl(impl->pdl_tokens > 0);  // graph_begin: off for a step of more tokens
    impl->dsa_score_bytes = DSA_SCORE_BYTES;
    const char *split = getenv("GLMSPARK_MLA_SPLIT_POS");
    if (split && *split) {  // an experiment's knob: the fewest positions a decode split takes
        if (!num_parse_int(split, 0, 1 << 20, &impl->mla_split_pos)) {
            LOG_ERROR("GLMSPARK_MLA_SPLIT_POS=%s: expected the fewest cache positions one split "
                      "of the MLA decode attention takes, 0 .. %d (0: the kernel's tile)",
                      split, 1 << 20);
            cudaStreamDestroy(impl->stream);
            free(be);
            free(impl);
            return ERR_INVAL;
        }
    }
    const char *chunk = getenv("GLMSPARK_MOE_CHUNK");
    if (chunk && *chunk) {  // an experiment's knob: tokens per expert launch of a prefill
        const long most = impl->moe_wide ? MOE_MAX_WIDE_PAIRS : MOE_MAX_CHUNK_PAIRS;
        if (!num_parse_int(chunk, 1, (int) most, &impl->moe_chunk)) {
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
    be->kernels = true;
    be->mla_tc = backend_mla_tc_env();
    be->dsa_tc = backend_dsa_tc_env();
    be->matmul = cuda_matmul;
    be->matmul_rows = cuda_matmul_rows;
    be->matmul_group = cuda_matmul_group;
    be->norm_matmul_group = cuda_norm_matmul_group;
    be->matmul_add = cuda_matmul_add;
    be->embed = cuda_embed;
    be->rmsnorm = cuda_rmsnorm;
    be->layernorm = cuda_layernorm;
    be->rope = cuda_rope;
    be->silu_mul = cuda_silu_mul;
    be->route = cuda_route;
    be->route_moe = cuda_route_moe;
    be->dsa_topk = cuda_dsa_topk;
    be->mla_attention = cuda_mla_attention;
    be->kv_write = cuda_kv_write;
    be->moe = cuda_moe;
    be->graph_begin = cuda_graph_begin;
    be->graph_end = cuda_graph_end;
    *out = be;
    return ERR_OK;
}
