/*
 * config.h - the model's architecture, read from config.json (and hf_quant_config.json or
 * config.json's quantization_config) with json-c.
 *
 * Covers GlmMoeDsaForCausalLM (glm_moe_dsa) and its family. Every field the forward pass
 * needs is resolved here, once, with defaults matching transformers' GlmMoeDsaConfig, so
 * that no other module reads JSON: `rope_theta` or `rope_parameters.rope_theta`;
 * `indexer_types` (or the index_topk_freq / index_skip_topk_offset rule, or "full" on every
 * layer when neither is present) and `mlp_layer_types` (or first_k_dense_replace) become
 * per-layer arrays; `n_routed_experts` may be a REAP-pruned count such as 156.
 *
 * Ownership: ModelConfig is plain data with no pointers; copy it freely.
 * Threads:   functions are reentrant.
 * Errors:    ERR_IO for a missing or unreadable file, ERR_FORMAT for malformed JSON or a
 *            field of the wrong type, ERR_INVAL for values we cannot serve; the message names
 *            the file and the field.
 */
#ifndef ENGINE_MODEL_CONFIG_H
#define ENGINE_MODEL_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
    CONFIG_MAX_LAYERS = 256,  // decoder layers, the MTP layers included
    CONFIG_MAX_EOS = 8,
    CONFIG_MAX_EXCLUDES = 64,
};

typedef enum ConfigMlp {
    CONFIG_MLP_DENSE,  // gate/up/down with intermediate_size
    CONFIG_MLP_MOE,    // router + routed experts + shared experts
} ConfigMlp;

typedef enum ConfigIndexer {
    CONFIG_INDEXER_NONE,    // no DSA: dense causal attention (index_topk <= 0)
    CONFIG_INDEXER_FULL,    // the layer runs its own indexer and publishes its top-k
    CONFIG_INDEXER_SHARED,  // the layer reuses the most recent full layer's top-k
} ConfigIndexer;

typedef enum ConfigQuant {
    CONFIG_QUANT_NONE,
    CONFIG_QUANT_NVFP4_MODELOPT,  // quant_algo NVFP4 (hf_quant_config.json or quant_method modelopt)
    CONFIG_QUANT_NVFP4_CT,        // compressed-tensors nvfp4-pack-quantized
    CONFIG_QUANT_FP8,             // FP8 weights (per-tensor or block scales)
} ConfigQuant;

typedef struct ModelConfig {
    char architecture[64];  // e.g. "GlmMoeDsaForCausalLM"
    char model_type[32];    // e.g. "glm_moe_dsa"

    int vocab_size;
    int hidden_size;
    int n_layers;  // num_hidden_layers: decoder layers, the MTP layers not included
    int n_mtp_layers;  // num_nextn_predict_layers; layer indices n_layers .. n_layers+n_mtp-1

    // MLA attention
    int n_heads;
    int q_lora_rank;  // 0: q_proj directly (no q_a/q_b), as some small configs do
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int v_head_dim;
    float rope_theta;
    bool rope_interleave;
    float rms_norm_eps;  // input/post-attention/final norms
    float attn_norm_eps;  // q_a_layernorm, kv_a_layernorm: transformers uses 1e-6
    int max_position_embeddings;

    // DSA indexer
    int index_n_heads;
    int index_head_dim;
    int index_topk;  // <= 0: no indexer anywhere
    bool indexer_rope_interleave;

    // MLP / MoE
    int intermediate_size;      // dense layers
    int moe_intermediate_size;  // each routed and shared expert
    int n_routed_experts;
    int n_shared_experts;
    int n_experts_per_tok;
    int n_group;
    int topk_group;
    bool norm_topk_prob;
    float routed_scaling_factor;

    // Per decoder layer (index < n_layers + n_mtp_layers).
    ConfigMlp mlp[CONFIG_MAX_LAYERS];
    ConfigIndexer indexer[CONFIG_MAX_LAYERS];

    bool tie_word_embeddings;
    int eos_ids[CONFIG_MAX_EOS];
    int n_eos_ids;
    int pad_id;  // -1 when absent

    // Quantization as the config declares it (tensors still decide per tensor).
    ConfigQuant quant;
    int quant_group_size;        // 16 for NVFP4
    bool kv_cache_fp8;           // kv_cache_quant_algo FP8 / kv_cache_scheme present
    int n_excludes;              // exclude_modules / ignore patterns, for `inspect`
    char excludes[CONFIG_MAX_EXCLUDES][96];
} ModelConfig;

// Read DIR/config.json and, when present, DIR/hf_quant_config.json into *cfg. On failure
// *cfg is zeroed and the reason (file, field) has been logged.
Err config_load(ModelConfig *cfg, const char *model_dir);

// Parse config.json text (json, len bytes, not necessarily NUL-terminated) and the optional
// hf_quant_config.json text (quant_json may be NULL). `origin` names the source in messages.
// The fuzz target's entry point; never crashes on any bytes.
Err config_parse(ModelConfig *cfg, const char *json, size_t len, const char *quant_json,
                 size_t quant_len, const char *origin);

// Head dims derived from the config.
static inline int config_qk_head_dim(const ModelConfig *cfg)
{
    return cfg->qk_nope_head_dim + cfg->qk_rope_head_dim;
}

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_MODEL_CONFIG_H
