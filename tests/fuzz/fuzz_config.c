/*
 * fuzz_config.c - config_parse on arbitrary bytes.
 *
 * Bytes up to the first NUL are config.json; bytes after it, when present, are
 * hf_quant_config.json. Invariants of an accepted config (abort on violation): layer counts
 * within CONFIG_MAX_LAYERS, positive dims, per-layer enums in range for every layer, eos ids
 * and pad inside the vocabulary, no more experts per token than experts when a layer is MoE,
 * excludes within bounds and NUL-terminated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    const uint8_t *nul = memchr(data, 0, size);
    const size_t len = nul ? (size_t) (nul - data) : size;
    const char *quant = nul ? (const char *) nul + 1 : NULL;
    const size_t quant_len = nul ? size - len - 1 : 0;
    ModelConfig *cfg = malloc(sizeof *cfg);
    if (!cfg) return 0;
    if (config_parse(cfg, (const char *) data, len, quant, quant_len, "fuzz") == ERR_OK) {
        const int n = cfg->n_layers + cfg->n_mtp_layers;
        ASSERT(cfg->n_layers >= 1 && cfg->n_mtp_layers >= 0 && n <= CONFIG_MAX_LAYERS);
        ASSERT(cfg->vocab_size > 0 && cfg->hidden_size > 0 && cfg->n_heads > 0);
        ASSERT(cfg->kv_lora_rank > 0 && cfg->qk_rope_head_dim > 0 && cfg->v_head_dim > 0);
        ASSERT(cfg->q_lora_rank >= 0 && cfg->qk_rope_head_dim % 2 == 0);
        bool any_moe = false;
        for (int i = 0; i < n; i++) {
            ASSERT(cfg->mlp[i] == CONFIG_MLP_DENSE || cfg->mlp[i] == CONFIG_MLP_MOE);
            ASSERT(cfg->indexer[i] >= CONFIG_INDEXER_NONE
                   && cfg->indexer[i] <= CONFIG_INDEXER_SHARED);
            ASSERT((cfg->indexer[i] == CONFIG_INDEXER_NONE) == (cfg->index_topk <= 0));
            any_moe |= cfg->mlp[i] == CONFIG_MLP_MOE;
        }
        ASSERT(cfg->index_topk <= 0 || cfg->indexer[0] == CONFIG_INDEXER_FULL);
        if (any_moe) ASSERT(cfg->n_experts_per_tok <= cfg->n_routed_experts);
        ASSERT(cfg->n_eos_ids >= 0 && cfg->n_eos_ids <= CONFIG_MAX_EOS);
        for (int i = 0; i < cfg->n_eos_ids; i++) {
            ASSERT(cfg->eos_ids[i] >= 0 && cfg->eos_ids[i] < cfg->vocab_size);
        }
        ASSERT(cfg->pad_id >= -1 && cfg->pad_id < cfg->vocab_size);
        ASSERT(cfg->n_excludes >= 0 && cfg->n_excludes <= CONFIG_MAX_EXCLUDES);
        for (int i = 0; i < cfg->n_excludes; i++) {
            ASSERT(memchr(cfg->excludes[i], 0, sizeof cfg->excludes[i]) != NULL);
        }
        ASSERT(memchr(cfg->architecture, 0, sizeof cfg->architecture) != NULL);
    }
    free(cfg);
    return 0;
}
