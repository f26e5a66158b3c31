/*
 * backend.h - the operations the forward pass is made of, behind one table of function
 * pointers, so that the CPU reference (backend_cpu.c) and a CUDA backend run the same
 * model code (model.c).
 *
 * Every op works on plain fp32 buffers with explicit shapes (outermost first) and on
 * CkptLinear weights in their stored format (f32, f16, bf16, fp8, NVFP4: each backend
 * dequantizes as it reads; nothing is expanded in memory). Buffers and int arrays passed
 * to ops belong to the backend's memory space (alloc/upload/download below): host memory
 * for the CPU backend, device memory for a CUDA one. model.c never touches them directly.
 * Weights are handed to bind_linear() once at load, which may move or repack them. The KV
 * cache's pool is host memory for now (kv_cache.c); a device backend will need it to come
 * from alloc. Shapes use the letters n (tokens in this call), H (heads), D (head dim),
 * E (experts), K (top-k).
 *
 * Numerics every backend honours (transformers' glm_moe_dsa in float64 is the reference):
 *   matmul      fp32 products, accumulation at least fp32
 *   norms       variance and mean in at least fp32, then scale
 *   softmax     attention scores and softmax in at least fp32
 *   router      sigmoid scores and selection in at least fp32
 *   RoPE        angles pos * inv_freq with inv_freq = 1 / theta^(2i/d) computed in fp32,
 *               as transformers does even for a float64 model
 *
 * The precision recipe (Backend.precision, chosen before the model binds its weights):
 *   BACKEND_PRECISION_F32   the above throughout: fp32 activations into and out of every op.
 *   BACKEND_PRECISION_BF16  the recipe of the GPU's tuned kernels (kernels/): as F32, except
 *               that these values are rounded to bf16 (nearest even) where an op reads them:
 *               matmul         x (bf16 weights, any columns); f32 weights are stored in bf16 (nearest
 *                              even) when bound (bind_linear, both backends), as vLLM loads
 *                              GLM-5.2's fp32 indexer weights_proj into its bf16 model;
 *               moe            x, and silu(gate) * up before down_proj (NVFP4 experts);
 *               mla_attention  q_nope, kv_b's weights and the attention's output latent
 *                              (before W_UV), when the CUDA backend's tuned kernels can take
 *                              the layer (latent <= 512, rope <= 64, qk_nope <= 192, an fp8
 *                              or bf16 cache of 128-position blocks: a narrower model runs
 *                              them zero-padded, backend_mla_shape_tuned).
 *               dsa_topk       the scores are fp32 in kernels/dsa.cu's order (dsa_format.h's
 *                              dsa_key_score: each head's dot product over the key's stored
 *                              values, then its scale), where kernels/dsa.cu takes the layer
 *                              (backend_dsa_tuned: index dim up to 128, up to 32 heads; a bf16
 *                              or fp8 cache stores keys padded to 16s, an f32 one needs dims in
 *                              16s): both backends then select the same keys.
 *                              With Backend.dsa_tc (backend_dsa_tc: fp8 or bf16 keys) q is
 *                              rounded to bf16 too and the GPU's dot products run on the
 *                              tensor cores (kernels/dsa.h dsa_scores_tc): the CPU follows
 *                              the rounding, the accumulation order differs (scores equal to
 *                              about (dim + heads) 2^-23 of their magnitudes), so keys within
 *                              that distance of the k-th score may be selected differently.
 *               Scores, softmax, sums and the residual stream stay fp32 or wider; the router
 *               is exact (kernels/moe_router.h) under both. The CPU backend follows it
 *               (ops it names round where the CUDA backend does, for the same shapes), so the
 *               two can be compared closely; the rounding bound against float64 is in
 *               docs/precision.md.
 *
 * Ownership: a Backend is created by its constructor (backend_cpu_create) and released
 *            with its destroy op; ops keep no pointer past the call.
 * Threads:   one thread calls the ops of a Backend (the backend may fan out internally).
 * Errors:    ops cannot fail: a wrong shape is a caller bug (ASSERT). Constructors return
 *            ERR_NOMEM or ERR_INVAL.
 */
#ifndef ENGINE_MODEL_BACKEND_H
#define ENGINE_MODEL_BACKEND_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/checkpoint.h"
#include "engine/model/kv_cache.h"
#include "engine/shared/err.h"
#include "kernels/mla_format.h"
#include "kernels/nvfp4_format.h"

#ifdef __cplusplus
extern "C" {
#endif

// MoE routing parameters (GlmMoeDsaTopkRouter).
typedef struct BackendRoute {
    int n_experts;   // E
    int top_k;       // K experts per token
    int n_group;     // E % n_group == 0
    int topk_group;  // groups kept, 1..n_group
    bool norm_topk_prob;
    float routed_scaling_factor;
} BackendRoute;

// MLA shapes and the softmax scale.
typedef struct BackendMla {
    int n_heads;  // H
    int qk_nope;  // per-head non-rotary query/key width
    int qk_rope;  // rotary width (shared k_pe)
    int v_dim;    // per-head value width
    int kv_lora;  // latent width
    float scale;  // softmax scale, 1/sqrt(qk_nope + qk_rope) (x mscale^2 for yarn)
    // > 0: q's rope part is not yet rotated, and mla_attention rotates it at each token's
    // position as the rope op does with this theta (the CUDA backend in its query split);
    // 0: q comes rotated.
    float rope_theta;
} BackendMla;

// DSA indexer shapes.
typedef struct BackendDsa {
    int n_heads;   // Hi
    int head_dim;  // Di; the first rope dims of q and k are rotated
    int top_k;     // index_topk
} BackendDsa;

// The sequences of one step and where their tokens are, for the ops that read or write the
// KV cache: each runs once for all tokens of all sequences (one launch on a GPU), whatever
// mix of prefill chunks and decode tokens the step holds. Token t (t < n) is at position
// pos[t] of sequence seqs[seq_of[t]]; a sequence sees its own cache only.
typedef struct BackendSeqs {
    KvSeq *const *seqs;  // [n_seqs], host memory: the block tables
    int n_seqs;
    const int *pos;     // [n], backend memory
    const int *seq_of;  // [n], backend memory: indices into seqs
    const int *len;     // [n], backend memory: pos[t] + 1, the positions token t sees
    int n;              // tokens
} BackendSeqs;

// One product of matmul_group: y [n, w->rows] = w x; or, with up (w's shape: a SwiGLU's up
// beside its gate w), y = silu_mul(w x, up x), the numbers of matmul, matmul and silu_mul.
typedef struct BackendProduct {
    float *y;
    const CkptLinear *w;
    const CkptLinear *up;  // NULL: a plain product
} BackendProduct;

#define BACKEND_MAX_GROUP 4  // products of one matmul_group call

typedef enum BackendPrecision {
    BACKEND_PRECISION_F32 = 0,
    BACKEND_PRECISION_BF16 = 1,
} BackendPrecision;

typedef struct Backend Backend;

struct Backend {
    const char *name;  // "cpu", "cuda"
    void *impl;        // the implementation's private state
    // The recipe above; the constructors set F32 (CPU) and BF16 (CUDA). Set it before any
    // weight is bound; it does not change afterwards.
    BackendPrecision precision;
    // The ops run kernels/ (the CUDA backend): precision is BF16 and stays so, a KV cache is
    // bf16 or fp8 (model_forward_batch refuses an f32 one), and a model must fit kernels/'s
    // shapes (model_load checks: model.c check_kernel_shapes). false on the CPU reference.
    bool kernels;
    // The BF16 recipe's MLA on the tensor cores (kernels/mla.h mla_decode_tc; backend_mla_tc
    // below): q and each probability times its fp8 chunk scale are rounded to bf16 as well.
    // Both constructors set it from GLMSPARK_MLA_TC (on unless "0"; docs/perf.md run 15: 4.7x
    // faster prefill attention than mla_decode); it may change between calls (op tests run
    // both).
    bool mla_tc;
    // The BF16 recipe's DSA indexer scores on the tensor cores (kernels/dsa.h dsa_scores_tc;
    // backend_dsa_tc below): q rounded to bf16. Both constructors set it from GLMSPARK_DSA_TC
    // (on unless "0"); it may change between calls.
    bool dsa_tc;

    void (*destroy)(Backend *be);

    // Zero-filled backend memory of `bytes` bytes, or NULL when out of memory. Released
    // with free_mem (NULL allowed).
    void *(*alloc)(Backend *be, size_t bytes);
    void (*free_mem)(Backend *be, void *p);

    // Copy bytes from host memory into backend memory, and back.
    void (*upload)(Backend *be, void *dst, const void *src_host, size_t bytes);
    void (*download)(Backend *be, void *dst_host, const void *src, size_t bytes);

    // Page-lock host memory that download() fills at every step (the logits), so that its
    // copies run at the bus's speed instead of through a staging buffer; unpin_host before
    // freeing or reallocating it. NULL on a backend without device memory (the CPU's).
    void (*pin_host)(Backend *be, void *p, size_t bytes);
    void (*unpin_host)(Backend *be, void *p);

    // Make weight w usable by the ops (upload or repack it, rewriting w's pointers). Called
    // once per weight at load; the CPU backend uses the mapping as it is. ERR_NOMEM.
    Err (*bind_linear)(Backend *be, CkptLinear *w);

    // The same for the routed experts of one MoE layer, as moe() takes them (experts[3 e +
    // 0/1/2]: gate, up, down of expert e), instead of bind_linear on each: a device backend
    // may stack them as its expert kernels read them. ERR_NOMEM.
    Err (*bind_experts)(Backend *be, CkptLinear *experts, int n_experts);

    // Called once per attention layer at load with its kv_b_proj before bind_linear binds it
    // (its data is still host memory): a device backend may keep a repacked copy for
    // mla_attention (the CUDA one: W_UK^T and W_UV per head in bf16). ERR_NOMEM.
    Err (*bind_kv_b)(Backend *be, const CkptLinear *kv_b, const BackendMla *p);

    // y[t, r] = sum_c W[r, c] x[t, c] for t < n. y: [n, w->rows], x: [n, w->cols].
    void (*matmul)(Backend *be, float *y, const CkptLinear *w, const float *x, int n);

    // The n_p (1 .. BACKEND_MAX_GROUP) products p over one input x [n, cols] (every weight
    // has cols columns): each p[i].y bit for bit what matmul(p[i].y, p[i].w, x, n) writes, or
    // for a SwiGLU pair matmul into y and a temporary, then silu_mul. The projections a layer
    // makes from one normalized input (q_a, kv_a and the indexer's wk and weights_proj; the
    // router and the shared expert's SwiGLU): the CUDA backend runs those its GEMV would run
    // alone on the split-K kernel in one launch (kernels/gemm.h gemm_bf16_gemv_group, SwiGLU
    // in its store), the others one op at a time.
    void (*matmul_group)(Backend *be, const BackendProduct *p, int n_p, const float *x, int n);

    // rmsnorm(h, x, norm_w, n, cols, cols, eps), then matmul_group(p, n_p, h, n): those two
    // ops' numbers, h written (h and x distinct; cols: the products' columns). A layer's input
    // and post-attention norms with the products they feed; the CUDA backend runs a decode
    // step's (at most GEMM_NORM_MAX_TOK tokens, every product in the grouped launch) as one
    // launch where double precision is fast, each block normalizing the rows itself
    // (kernels/gemm.h gemm_bf16_gemv_group_norm).
    void (*norm_matmul_group)(Backend *be, const BackendProduct *p, int n_p, float *h,
                              const float *x, const float *norm_w, float eps, int n);

    // matmul with every row's numbers exactly those of matmul_rows on that row alone (bit for
    // bit, whatever n): the lm_head over a batch's last rows, so that logits do not depend on
    // the batch. The CUDA backend reads the weight once for all rows with one GEMV kernel
    // whatever n (the tensor-core one for the lm_head, from one row: its per-row sums do not
    // depend on the other rows), where matmul would pick the kernel by the number of tokens.
    void (*matmul_rows)(Backend *be, float *y, const CkptLinear *w, const float *x, int n);

    // y[t, r] += sum_c W[r, c] x[t, c]: the numbers of matmul into a temporary and add (each
    // sum rounded to fp32, then added), without the temporary (the CUDA backend adds in the
    // GEMV's store: the residual adds after o_proj and the shared expert).
    void (*matmul_add)(Backend *be, float *y, const CkptLinear *w, const float *x, int n);

    // y[t] = table row ids[t]; y: [n, table->cols]. ids must be < table->rows.
    void (*embed)(Backend *be, float *y, const CkptLinear *table, const int *ids, int n);

    // y = x * rsqrt(mean(x^2) + eps) * w over the last dim. y may equal x. x: [n, dim].
    // x and y rows are `stride` floats apart (stride >= dim).
    void (*rmsnorm)(Backend *be, float *y, const float *x, const float *w, int n, int dim,
                    int stride, float eps);

    // y = (x - mean) / sqrt(var + eps) * w + b (biased variance). y may equal x.
    void (*layernorm)(Backend *be, float *y, const float *x, const float *w, const float *b, int n,
                      int dim, float eps);

    // Interleaved RoPE, in place, on x[t, h, offset .. offset+rope_dim) for t < n, h < H;
    // rows of a token are `stride` floats apart, heads `head_stride`. Pairs (2i, 2i+1) are
    // rotated by angle pos[t] * theta^(-2i/rope_dim) and written de-interleaved, as
    // transformers' apply_rotary_pos_emb_interleave does: out[i] = x[2i] cos - x[2i+1] sin,
    // out[rope_dim/2 + i] = x[2i+1] cos + x[2i] sin.
    void (*rope)(Backend *be, float *x, int n, int n_heads, int stride, int head_stride, int offset,
                 int rope_dim, const int *pos, float theta);

    // y[i] = silu(gate[i]) * up[i] for i < n_elems. y may equal gate.
    void (*silu_mul)(Backend *be, float *y, const float *gate, const float *up, int n_elems);

    // Write src [s->n, width] into the cache entries of `layer` of every token of s (token t
    // at its position in its sequence), values offset .. offset+width of each entry
    // (kv_cache.h: the entry layout; kv_write_ok holds), transformed first by in (NULL: as
    // given; kernels/kv_format.h KvIn: a norm, then RoPE at the token's position, the numbers
    // of the rmsnorm or layernorm op on src's rows followed by the rope op). src is not
    // written. The CUDA backend stores and transforms in one launch.
    void (*kv_write)(Backend *be, KvCache *kv, const BackendSeqs *s, int layer, int offset,
                     const float *src, int width, const KvIn *in);

    // Routed experts: out[t] = sum_k wts[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]) with
    // e = idx[t, k]; experts[3 e + 0/1/2] are expert e's gate [I, hidden], up [I, hidden]
    // and down [hidden, I]. out, x: [n, hidden]; idx, wts: [n, K]. Experts are applied in
    // ascending order and each token's contributions summed in that order. With residual
    // ([n, hidden], may equal out), out[t] = residual[t] + that sum (the sum rounded to fp32
    // first): the MoE layer's residual add in the op (the CUDA backend's combine launch).
    void (*moe)(Backend *be, float *out, const float *x, int n, const int *idx, const float *wts,
                int top_k, const CkptLinear *experts, int n_experts, const float *residual);

    // Expert choice from router logits [n, E] and correction bias [E]: idx [n, K] (experts,
    // ascending) and their weights wts [n, K].
    void (*route)(Backend *be, int *idx, float *wts, const float *logits, const float *bias, int n,
                  const BackendRoute *p);

    // route(idx, wts, logits, bias, n, rp), then moe(out, x, n, idx, wts, rp->top_k, experts,
    // n_experts, residual): those two ops' numbers, idx and wts written. The CUDA backend
    // routes a decode step's tokens and groups them by expert in one launch (kernels/moe.h
    // moe_route_group).
    void (*route_moe)(Backend *be, float *out, const float *x, int n, int *idx, float *wts,
                      const float *logits, const float *bias, const BackendRoute *rp,
                      const CkptLinear *experts, int n_experts, const float *residual);

    // DSA top-k for the s->n queries of s over keys in layer `layer` of the cache: token t
    // sees positions 0 .. pos[t] of its own sequence. q: [n, Hi, Di] (rope applied), w:
    // [n, Hi] (weights_proj output). Writes sel [n, top_k] (positions ascending) and n_sel
    // [n] = min(top_k, pos[t] + 1).
    void (*dsa_topk)(Backend *be, int *sel, int *n_sel, const float *q, const float *w,
                     const KvCache *kv, const BackendSeqs *s, int layer, const BackendDsa *p);

    // MLA attention for the s->n queries of s, from the latents cached in `layer` of each
    // token's own sequence. q: [n, H, qk_nope + qk_rope] (rope part rotated, or rotated here
    // when p->rope_theta > 0; q is not written); kv_b: kv_b_proj,
    // [H * (qk_nope + v_dim), kv_lora]; out: [n, H, v_dim]. With sel == NULL every position
    // 0 .. pos[t] is attended; otherwise only sel[t, 0 .. n_sel[t]) (rows sel_stride apart).
    void (*mla_attention)(Backend *be, float *out, const float *q, const CkptLinear *kv_b,
                          const KvCache *kv, const BackendSeqs *s, int layer, const int *sel,
                          const int *n_sel, int sel_stride, const BackendMla *p);

    // Optional (NULL when the backend has none, as the CPU one): record the ops called
    // between graph_begin and graph_end once and replay them (a CUDA graph). key [n_key]
    // must name everything host-side those ops' arguments depend on (buffers, shapes, n)
    // except the KvCache and the sequences' block tables, which the backend takes from kv
    // and seqs [n_seqs] itself; inputs that vary (positions, token ids) must be in backend
    // memory, uploaded before graph_begin. n_tok: the rows the ops take (the step's tokens;
    // the backend may launch differently by it, the key already naming it). Returns true
    // when a recording of this key will run at graph_end: the caller then skips the ops.
    // graph_end follows every graph_begin.
    bool (*graph_begin)(Backend *be, const KvCache *kv, KvSeq *const *seqs, int n_seqs, int n_tok,
                        const unsigned long long *key, int n_key);
    void (*graph_end)(Backend *be);
};

// norm_matmul_group as the backend's own ops (the CPU backend's, and the CUDA backend's when
// its fused launch does not apply).
static inline void backend_norm_matmul_group_ops(Backend *be, const BackendProduct *p, int n_p,
                                                 float *h, const float *x, const float *norm_w,
                                                 float eps, int n)
{
    const int cols = p[0].w->cols;
    be->rmsnorm(be, h, x, norm_w, n, cols, cols, eps);
    be->matmul_group(be, p, n_p, h, n);
}

// route_moe as the backend's own ops (the CPU backend's, and the CUDA backend's when its
// fused launch does not apply).
static inline void backend_route_moe_ops(Backend *be, float *out, const float *x, int n, int *idx,
                                         float *wts, const float *logits, const float *bias,
                                         const BackendRoute *rp, const CkptLinear *experts,
                                         int n_experts, const float *residual)
{
    be->route(be, idx, wts, logits, bias, n, rp);
    be->moe(be, out, x, n, idx, wts, rp->top_k, experts, n_experts, residual);
}

// A cache write's transform (kernels/kv_format.h KvIn) as the backend's own ops, the numbers
// kv_write's transform promises: t [n, width] holds a copy of src [n, width]; the norm reads
// src and writes t, then RoPE rotates t at the tokens' positions pos (the backend's memory).
static inline void backend_kv_in_ops(Backend *be, float *t, const float *src, int n, int width,
                                     const KvIn *in, const int *pos)
{
    if (in->norm_dim > 0 && in->norm_b)
        be->layernorm(be, t, src, in->norm_w, in->norm_b, n, width, in->eps);
    else if (in->norm_dim > 0)
        be->rmsnorm(be, t, src, in->norm_w, n, in->norm_dim, width, in->eps);
    if (in->rope_dim > 0)
        be->rope(be, t, n, 1, width, 0, in->rope_off, in->rope_dim, pos, in->theta);
}

// q's rope parts rotated in place as mla_attention with p->rope_theta > 0 rotates them, by the
// backend's rope op: qr [n, H, qk_nope + qk_rope] (a copy of q), pos the tokens' positions.
static inline void backend_mla_q_rope(Backend *be, float *qr, int n, const BackendMla *p,
                                      const int *pos)
{
    const int qk = p->qk_nope + p->qk_rope;
    be->rope(be, qr, n, p->n_heads, p->n_heads * qk, qk, p->qk_nope, p->qk_rope, pos,
             p->rope_theta);
}

// Whether matmul() on this weight / moe() on these experts / mla_attention() on a layer of
// this shape and cache entry run the tuned kernels on the CUDA backend, and so round under
// BACKEND_PRECISION_BF16 (on both backends): the limits of kernels/gemm.h (bf16 weights in
// rows of 8s: the CUDA backend keeps a zero-padded copy of one whose columns are not), kernels/moe.h (NVFP4 experts, whose widths are multiples of 16 as the
// kernels need, top_k <= 16, at most MOE_MAX_EXPERTS) and kernels/mla.h (GLM-5's
// latent 512 + 64, qk_nope 192, heads in 16s, blocks of 128 positions, an fp8 entry of 656
// bytes or a bf16 one of 1,152: a narrower model's q, heads, kv_b and cache entries are
// zero-padded to them, kv_cache.h and backend_cuda.cu's mla_tuned). Zero padding changes no
// sum, so the CPU follows the recipe at the model's own widths.
static inline bool backend_matmul_tuned(const CkptLinear *w)
{
    return w->format == CKPT_LINEAR_BF16;
}

// Whether bind_linear (and bind_experts, for experts not all NVFP4) stores w in bf16 under
// the BF16 recipe (both backends): every weight stored otherwise than in bf16 (f32 as
// GLM-5.2's indexer weights_proj, f16, FP8, NVFP4 dense weights), each value decoded as
// ckpt_linear_row decodes it and rounded to bf16 (nearest even), as vLLM loads GLM-5.2's fp32
// weights_proj into its bf16 model. The tuned GEMV and experts then take every weight the
// model binds (NVFP4 routed experts stay NVFP4: kernels/moe.h).
static inline bool backend_bind_rounds(const Backend *be, const CkptLinear *w)
{
    return be->precision == BACKEND_PRECISION_BF16 && w->format != CKPT_LINEAR_BF16;
}

// w's values rounded to bf16 (nearest even) into out [rows * cols]: what bind_linear stores
// when backend_bind_rounds. row: float [w->cols] of scratch.
static inline void backend_round_linear(const CkptLinear *w, uint16_t *out, float *row)
{
    for (int r = 0; r < w->rows; r++) {
        ckpt_linear_row(w, r, row);
        for (int c = 0; c < w->cols; c++)
            out[(size_t) r * (size_t) w->cols + (size_t) c] = nvfp4_float_to_bf16(row[c]);
    }
}

// Whether the routed experts of a layer are stored as kernels/moe.h's NVFP4 kernels read
// them (all NVFP4); under the BF16 recipe others are bound in bf16 (backend_bind_rounds) and
// run by its bf16 kernels.
static inline bool backend_experts_nvfp4(const CkptLinear *experts, int n_experts)
{
    for (int i = 0; i < 3 * n_experts; i++)
        if (experts[i].format != CKPT_LINEAR_NVFP4) return false;
    return true;
}

static inline bool backend_moe_tuned(const CkptLinear *experts, int n_experts, int top_k)
{
    if (n_experts < 1 || n_experts > 512 || top_k > 16) return false;  // kernels/moe.h's limits
    const CkptLinearFormat f = experts[0].format;
    if (f != CKPT_LINEAR_NVFP4 && f != CKPT_LINEAR_BF16) return false;
    for (int i = 0; i < 3 * n_experts; i++)
        if (experts[i].format != f) return false;
    return true;
}
static inline bool backend_mla_shape_tuned(const BackendMla *p)
{
    return p->kv_lora >= 1 && p->kv_lora <= MLA_KV_LORA && p->qk_rope >= 0
           && p->qk_rope <= MLA_ROPE && p->qk_nope >= 0 && p->qk_nope <= MLA_QK_NOPE
           && p->n_heads >= 1 && p->v_dim >= 1;
}

// The heads the tuned MLA kernels run for a layer of n_heads: heads in 16s as they are, others
// padded with zero heads to a multiple of 32 (the tensor-core kernel's heads per CTA).
static inline int backend_mla_heads(int n_heads)
{
    return n_heads % 16 == 0 ? n_heads : (n_heads + 31) / 32 * 32;
}

static inline bool backend_mla_tuned(const BackendMla *p, const KvEntryLayout *lo)
{
    return backend_mla_shape_tuned(p) && lo->block_size == MLA_BLOCK
           && lo->lat_store == MLA_KV_LORA && lo->pe_store == MLA_ROPE
           && ((lo->dtype == KV_DTYPE_FP8 && lo->bytes == MLA_FP8_TOKEN_BYTES)
               || (lo->dtype == KV_DTYPE_BF16 && lo->bytes == 2 * MLA_LK));
}

// Whether mla_attention() on this layer runs the tensor-core variant (Backend.mla_tc, heads in
// 32s after backend_mla_heads) and both backends round q and the probabilities too.
static inline bool backend_mla_tc(const Backend *be, const BackendMla *p, const KvEntryLayout *lo)
{
    return be->mla_tc && be->precision == BACKEND_PRECISION_BF16 && backend_mla_tuned(p, lo)
           && backend_mla_heads(p->n_heads) % 32 == 0;
}

// An on/off environment variable of the backends: "0" is off, any other value on, unset dflt.
static inline bool backend_env_flag(const char *name, bool dflt)
{
    const char *e = getenv(name);
    return e ? strcmp(e, "0") != 0 : dflt;
}

// GLMSPARK_MLA_TC: Backend.mla_tc's default in both constructors, on unless "0".
static inline bool backend_mla_tc_env(void)
{
    return backend_env_flag("GLMSPARK_MLA_TC", true);
}

// Whether dsa_topk() on this layer runs kernels/dsa.h: the keys as stored (kv_cache.h pads them
// to a multiple of 16, and the CUDA backend pads q to match) within its limits.
static inline bool backend_dsa_tuned(const BackendDsa *p, const KvCache *kv, int layer)
{
    // The pool's alignment is 16 or more.
    const DsaCache c = kv_dsa_cache_stored(kv, kv->pool, layer);
    return kv->params.has_index[layer] && kv->entry[layer].index_dim == p->head_dim
           && dsa_scores_supported(&c, p->n_heads);
}

// Whether dsa_topk() on this layer runs the tensor-core scores (Backend.dsa_tc) and both
// backends round q to bf16.
static inline bool backend_dsa_tc(const Backend *be, const BackendDsa *p, const KvCache *kv,
                                  int layer)
{
    if (!be->dsa_tc || be->precision != BACKEND_PRECISION_BF16 || !backend_dsa_tuned(p, kv, layer))
        return false;
    const DsaCache c = kv_dsa_cache_stored(kv, kv->pool, layer);
    return dsa_scores_tc_supported(&c, p->n_heads);
}

// GLMSPARK_DSA_TC: Backend.dsa_tc's default in both constructors, on unless "0".
static inline bool backend_dsa_tc_env(void)
{
    return backend_env_flag("GLMSPARK_DSA_TC", true);
}

// The indexer's scales in fp32, as both backends apply them under the bf16 recipe: head
// weights times n_heads^-0.5, dot products times head_dim^-0.5.
static inline void backend_dsa_scales(const BackendDsa *p, float *w_scale, float *sm_scale)
{
    *w_scale = (float) (1.0 / sqrt((double) p->n_heads));
    *sm_scale = (float) (1.0 / sqrt((double) p->head_dim));
}

// The plain-C11 reference backend: fp32 math (double where a reduction needs it), split
// over n_threads threads (>= 1) with a thread pool. *out is NULL on failure.
Err backend_cpu_create(int n_threads, Backend **out);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_MODEL_BACKEND_H
