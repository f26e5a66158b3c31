/*
 * model.h - a loaded GlmMoeDsa model (config + mapped checkpoint + per-layer weight views)
 * and its forward pass over one sequence, a batch of sequences, or one pipeline stage's
 * layers of either.
 *
 * The forward pass is transformers' GlmMoeDsaForCausalLM (5.17), op for op: embeddings (no
 * scaling); per layer RMSNorm -> MLA attention with DSA top-k selection -> residual ->
 * RMSNorm -> dense MLP or MoE -> residual; final RMSNorm; lm_head. Prefill and decode are the
 * same call: n new tokens at positions seq->n_tokens .. +n-1, whose latents (and indexer
 * keys) are appended to the KV cache before attention reads them. Weights are views into
 * the checkpoint mapping (CkptLinear, passed once through the backend's bind_linear); only
 * norm vectors, biases and the router correction bias are widened to small fp32 copies at
 * load. Every buffer the ops see comes from the backend's allocator; tokens go up and
 * logits come down through upload/download, so model.c runs unchanged on a device backend.
 *
 * Ownership: model_load() maps the checkpoint and allocates the layer tables; model_free()
 *            releases them. The backend is borrowed and must outlive the model. The
 *            forward pass's workspace is owned by the Model and grows to the largest n seen,
 *            so a decode loop allocates nothing.
 * Threads:   one thread at a time per Model (the workspace is shared); the backend fans out.
 * Errors:    model_load: ERR_IO / ERR_FORMAT / ERR_NOTFOUND from config and checkpoint,
 *            ERR_INVAL for a structure we cannot run; messages name the tensor and file.
 *            model_forward: ERR_AGAIN when the KV cache has no room, ERR_INVAL for a token id
 *            outside the vocabulary, ERR_NOMEM.
 */
#ifndef ENGINE_MODEL_MODEL_H
#define ENGINE_MODEL_MODEL_H

#include <stdbool.h>

#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/config.h"
#include "engine/model/kv_cache.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ModelOptions {
    bool load_mtp;  // also load the first MTP layer (model_mtp_forward)
    // Pipeline stage: decoder layers [first_layer, last_layer) only (last_layer 0 means
    // n_layers). The first stage also holds the embeddings, the last the final norm,
    // lm_head and the MTP layer(s); only the shards holding these tensors are opened.
    int first_layer;
    int last_layer;
} ModelOptions;

// One decoder layer's weights. Linear weights borrow from the Ckpt (after bind_linear);
// float arrays are backend memory owned by the Model.
typedef struct ModelLayer {
    float *input_norm;  // [hidden]
    float *post_norm;   // [hidden]

    // MLA
    CkptLinear q_a, q_b;  // q_lora_rank > 0
    CkptLinear q_proj;    // q_lora_rank == 0
    float *q_a_norm;      // [q_lora]
    CkptLinear kv_a;      // [kv_lora + rope, hidden]
    float *kv_a_norm;     // [kv_lora]
    CkptLinear kv_b;      // [H * (nope + v), kv_lora]
    CkptLinear o_proj;    // [hidden, H * v]

    // DSA indexer (full layers only)
    bool has_indexer;
    CkptLinear idx_wq_b;             // [Hi * Di, q_lora]
    CkptLinear idx_wk;               // [Di, hidden]
    float *idx_k_norm, *idx_k_bias;  // [Di]
    CkptLinear idx_weights;          // [Hi, hidden]

    // MLP
    bool is_moe;
    CkptLinear gate, up, down;           // dense MLP
    CkptLinear router;                   // [E, hidden]
    float *router_bias;                  // [E] e_score_correction_bias
    CkptLinear *experts;                 // [E * 3]: gate, up, down of each expert, owned array
    CkptLinear sh_gate, sh_up, sh_down;  // shared experts (intermediate = moe_inter * n_shared)
} ModelLayer;

typedef struct ModelWork ModelWork;

// The MTP (next-token prediction) block of layer n_layers, beside its decoder layer
// (layers[n_layers]): enorm, hnorm and shared_head.norm as fp32 backend vectors, eh_proj
// [hidden, 2 * hidden] bound through the backend; cat is its [n, 2 * hidden] input buffer.
typedef struct ModelMtp {
    float *enorm, *hnorm, *head_norm;  // [hidden] each, backend memory
    CkptLinear eh_proj;
    float *cat;   // backend memory, [cat_cap, 2 * hidden]
    int cat_cap;  // rows cat holds
} ModelMtp;

typedef struct Model {
    ModelConfig cfg;
    Ckpt ckpt;
    Backend *be;         // borrowed
    CkptLinear embed;    // [vocab, hidden]
    CkptLinear lm_head;  // [vocab, hidden] (the embedding when tied and absent)
    float *final_norm;   // [hidden], backend memory
    ModelLayer *layers;  // [n_layers + n_mtp loaded]
    int n_layers_loaded;
    int first_layer, last_layer;  // this stage's decoder layers [first, last)
    bool has_embed;               // first stage: tokens in
    bool has_head;                // last stage: final norm + lm_head, logits out
    ModelWork *work;              // owned forward workspace
    ModelMtp *mtp;                // the MTP block's own tensors (load_mtp on the last stage)
} Model;

// Several sequences in one forward call: sequence i contributes n_new[i] consecutive
// tokens at its positions seqs[i]->n_tokens.., in order; tokens and activations are the
// concatenation, n = sum of n_new. A sequence appears at most once.
typedef struct ModelBatch {
    int n_seqs;
    KvSeq *const *seqs;  // [n_seqs] borrowed
    const int *n_new;    // [n_seqs], each >= 1
} ModelBatch;

typedef enum ModelLogitRows {
    MODEL_LOGITS_NONE,  // no lm_head
    MODEL_LOGITS_LAST,  // each sequence's last token: logits [n_seqs, vocab]
    MODEL_LOGITS_ALL,   // every token: logits [n, vocab]
} ModelLogitRows;

// Load the model in dir: config, checkpoint, every tensor the forward pass needs (and the
// MTP layer's when opts->load_mtp). opts may be NULL (defaults). On failure *m is zeroed.
// A DSA layer whose indexer tensors are absent runs dense attention (model_resolve_indexers).
Err model_load(Model *m, const char *dir, const ModelOptions *opts, Backend *be);

// The DSA layers of c (the MTP layers included) whose checkpoint ck has no indexer tensors
// ("model.layers.L.self_attn.indexer.*") run dense attention: their c->indexer, and that of
// the shared layers that would reuse their selection, becomes CONFIG_INDEXER_NONE; one
// warning names them. ck must list every tensor (an unfiltered ckpt_open).
void model_resolve_indexers(ModelConfig *c, const Ckpt *ck, const char *dir);

// Release everything model_load() allocated; safe on a zeroed Model; zeroes *m.
void model_free(Model *m);

// KV cache parameters that fit this model (this stage's layers only), for n_blocks blocks
// of block_size positions (0: default).
KvCacheParams model_kv_params(const Model *m, int n_blocks, int block_size);

// Run tokens[0..n) at positions seq->n_tokens.. and advance seq->n_tokens by n. Logits for
// every position go to logits [n, vocab] when all_logits, else the last position's to
// logits [vocab]. logits may be NULL (no lm_head).
Err model_forward(Model *m, KvCache *kv, KvSeq *seq, const int *tokens, int n, float *logits,
                  bool all_logits);

// Bytes of the activations one stage hands the next for n tokens: the residual stream
// f32 [n, hidden], then the DSA selection state (int32 has_sel, n_sel [n], sel [n, topk]),
// which a stage starting on a shared DSA layer needs from the previous one.
size_t model_act_bytes(const Model *m, int n);

// Run this stage's layers over a batch. The first stage reads token ids (tokens [n]); the
// others read act_in (model_act_bytes(n), from the previous stage). A stage with a next one
// writes act_out (model_act_bytes(n)); the last stage writes logits per `rows` (its
// lm_head). Every sequence's n_tokens advances by its n_new. On a single stage holding the
// whole model, a batch of one sequence is model_forward() bit for bit, and each sequence of
// a batch gets the logits it would get alone. Errors as model_forward(); nothing advances.
Err model_forward_batch(Model *m, KvCache *kv, const ModelBatch *b, const int *tokens,
                        const void *act_in, void *act_out, float *logits, ModelLogitRows rows);

// model_forward() that also returns the final-normed hidden state of every row (hidden
// [n, hidden_size], host memory): the input the MTP layer takes (vLLM's DeepseekV2Model
// output, after model.norm). Logits as model_forward (every row or the last; the same bits).
Err model_forward_hidden(Model *m, KvCache *kv, KvSeq *seq, const int *tokens, int n, float *logits,
                         bool all_logits, float *hidden);

// The lm_head over n final-normed rows h (backend memory) into y: one row as matmul_rows (the
// numbers model_forward gives a batch's last rows), more as matmul (its every-row logits).
void model_head(Model *m, float *y, const float *h, int n);

// KV cache parameters for the MTP layer alone (one cache layer, its own DSA index keys).
KvCacheParams model_mtp_kv_params(const Model *m, int n_blocks, int block_size);

// Run the MTP layer (needs load_mtp) over n rows at positions seq->n_tokens.. of its own
// cache kv (model_mtp_kv_params): row t takes the main model's hidden state h_prev[t]
// (model_forward_hidden, or the MTP's own h_out for recursive drafts) at position p and
// the token at p + 1, tokens[t]; as vLLM's DeepSeekMultiTokenPredictorLayer:
//   e = RMSNorm(embed(tokens[t]), enorm) (embedding zeroed at position 0), hh =
//   RMSNorm(h_prev[t], hnorm), z = eh_proj([e, hh]), z = decoder layer(z),
//   logits = lm_head(RMSNorm(z, shared_head.norm)).
// Writes logits and h_out (z before the head norm; either may be NULL), host memory, for
// every row ([n, vocab], [n, hidden]) when all_rows, else for the last ([vocab],
// [hidden]); advances seq->n_tokens by n. ERR_INVAL without an MTP layer or for
// a token outside the vocabulary, ERR_AGAIN when the cache is full, ERR_NOMEM.
Err model_mtp_forward(Model *m, KvCache *kv, KvSeq *seq, const int *tokens, const float *h_prev,
                      int n, float *logits, float *h_out, bool all_rows);

// model_mtp_forward over a batch: sequence i runs b->n_new[i] rows (tokens and h_prev hold
// them in order, [n] and [n, hidden] for n = sum n_new), at its own positions. all_rows:
// logits [n, vocab] and h_out [n, hidden] for every row; else for each sequence's last row,
// [n_seqs, vocab] and [n_seqs, hidden], each computed as a one-sequence call computes it
// (the head's weight is read once for all rows). Nothing advances on an error.
Err model_mtp_forward_batch(Model *m, KvCache *kv, const ModelBatch *b, const int *tokens,
                            const float *h_prev, float *logits, float *h_out, bool all_rows);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_MODEL_MODEL_H
