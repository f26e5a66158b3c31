/*
 * kv_cache.h - the paged KV cache: per layer, per token, the MLA latent and (on full DSA
 * layers) the indexer key, in fixed-size blocks drawn from one pool.
 *
 * What one token stores for layer l (fp32, "entry" below):
 *   latent     [kv_lora]     kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora]), the MLA latent
 *   k_pe       [rope]        the shared rope key, rotated already (layout as model.c's RoPE)
 *   index_key  [index_dim]   indexer key after LayerNorm and RoPE; only layers with has_index
 * Attention is computed from the latent (absorbed form, backend_cpu.c), so nothing per head
 * is stored. A block holds block_size consecutive positions of one sequence for every layer:
 *   pool = [n_blocks][layer][block_size][entry(layer)]
 * so one layer's entries within a block are contiguous. A sequence owns a block table;
 * position p lives in block blocks[p / block_size] at row p % block_size.
 *
 * Ownership: kv_init() allocates the whole pool once (startup tier); KvSeq block tables are
 *            allocated by kv_seq_reserve() and released by kv_seq_free(). Entry pointers
 *            stay valid until the sequence is freed.
 * Threads:   one owner thread allocates and frees; reading and writing entries of distinct
 *            tokens from several threads is safe.
 * Errors:    ERR_NOMEM at init, ERR_AGAIN when the pool has too few free blocks (nothing is
 *            allocated by the failing call), ERR_INVAL for bad parameters.
 */
#ifndef ENGINE_KV_CACHE_H
#define ENGINE_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>

#include "common/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { KV_MAX_LAYERS = 256, KV_DEFAULT_BLOCK_SIZE = 128 };

typedef struct KvCacheParams {
    int n_layers;
    int block_size;  // positions per block; 0 means KV_DEFAULT_BLOCK_SIZE
    int n_blocks;    // blocks in the pool
    int kv_lora;     // latent width
    int rope_dim;    // k_pe width
    int index_dim;   // indexer key width (used on layers with has_index)
    bool has_index[KV_MAX_LAYERS];
} KvCacheParams;

typedef struct KvCache {
    KvCacheParams params;
    size_t layer_offset[KV_MAX_LAYERS];  // floats from a block's start to the layer's rows
    size_t entry_floats[KV_MAX_LAYERS];  // floats per token entry of the layer
    size_t block_floats;                 // floats per block (all layers)
    float *pool;                         // [n_blocks, block_floats], owned
    int *free_blocks;                    // stack of free block ids, owned
    int n_free;
} KvCache;

typedef struct KvSeq {
    int *blocks;   // [n_blocks] block ids, owned
    int n_blocks;  // blocks held
    int n_tokens;  // positions written so far (the model's forward advances it)
} KvSeq;

// Allocate the pool described by p. On failure *kv is zeroed.
Err kv_init(KvCache *kv, const KvCacheParams *p);

// Free the pool; safe on a zeroed cache; zeroes *kv. Sequences must have been freed.
void kv_free(KvCache *kv);

// Make seq able to hold n_tokens positions (taking blocks from the pool as needed). On
// ERR_AGAIN nothing changes.
Err kv_seq_reserve(KvCache *kv, KvSeq *seq, int n_tokens);

// Return seq's blocks to the pool and zero *seq. Safe on a zeroed KvSeq.
void kv_seq_free(KvCache *kv, KvSeq *seq);

// Blocks available in the pool.
int kv_n_free_blocks(const KvCache *kv);

// The entry of `layer` at position pos of seq (pos < reserved capacity): latent, then k_pe,
// then the index key if the layer has one. Valid until the sequence is freed.
static inline float *kv_entry(const KvCache *kv, const KvSeq *seq, int layer, int pos)
{
    const int bs = kv->params.block_size;
    const int block = seq->blocks[pos / bs];
    return kv->pool + (size_t) block * kv->block_floats + kv->layer_offset[layer] +
           (size_t) (pos % bs) * kv->entry_floats[layer];
}

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_KV_CACHE_H
