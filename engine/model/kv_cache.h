/*
 * kv_cache.h - the paged KV cache: per layer, per token, the MLA latent and (on full DSA
 * layers) the indexer key, in fixed-size blocks drawn from one pool.
 *
 * What one token stores for layer l ("entry" below; fp32, or bf16 with KV_DTYPE_BF16):
 *   latent     [kv_lora]     kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora]), the MLA latent
 *   k_pe       [rope]        the shared rope key, rotated already (layout as model.c's RoPE)
 *   index_key  [index_dim]   indexer key after LayerNorm and RoPE; only layers with has_index
 * Attention is computed from the latent (absorbed form, backend_cpu.c), so nothing per head
 * is stored. A block holds block_size consecutive positions of one sequence for every layer:
 *   pool = [n_blocks][layer][block_size][entry(layer)]
 * so one layer's entries within a block are contiguous. A sequence owns a block table;
 * position p lives in block blocks[p / block_size] at row p % block_size. A bf16 cache halves
 * the memory; values are rounded to nearest even on kv_store() and widened on kv_read().
 *
 * Ownership: kv_init() allocates the whole pool once (startup tier); KvSeq block tables are
 *            allocated by kv_seq_reserve() and released by kv_seq_free(). Entry pointers
 *            stay valid until the sequence is freed.
 * Threads:   one owner thread allocates and frees; reading and writing entries of distinct
 *            tokens from several threads is safe.
 * Errors:    ERR_NOMEM at init, ERR_AGAIN when the pool has too few free blocks (nothing is
 *            allocated by the failing call), ERR_INVAL for bad parameters.
 */
#ifndef ENGINE_MODEL_KV_CACHE_H
#define ENGINE_MODEL_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { KV_MAX_LAYERS = 256, KV_DEFAULT_BLOCK_SIZE = 128 };

typedef enum KvDtype {
    KV_DTYPE_F32,   // exact: decode equals prefill bit for bit, golden tests run on it
    KV_DTYPE_BF16,  // half the memory, ~3 significant digits per cached value
} KvDtype;

typedef struct KvCacheParams {
    int n_layers;
    int block_size;  // positions per block; 0 means KV_DEFAULT_BLOCK_SIZE
    int n_blocks;    // blocks in the pool
    int kv_lora;     // latent width
    int rope_dim;    // k_pe width
    int index_dim;   // indexer key width (used on layers with has_index)
    bool has_index[KV_MAX_LAYERS];
    KvDtype dtype;  // storage type of every value (KV_DTYPE_F32 when zeroed)
} KvCacheParams;

typedef struct KvCache {
    KvCacheParams params;
    size_t layer_offset[KV_MAX_LAYERS];  // values from a block's start to the layer's rows
    size_t entry_floats[KV_MAX_LAYERS];  // values per token entry of the layer
    size_t block_floats;                 // values per block (all layers)
    size_t value_bytes;                  // 4 (f32) or 2 (bf16)
    void *pool;                          // [n_blocks, block_floats] values, owned
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

// Byte address of the entry of `layer` at position pos of seq (pos < reserved capacity).
static inline unsigned char *kv_entry_bytes(const KvCache *kv, const KvSeq *seq, int layer, int pos)
{
    const int bs = kv->params.block_size;
    const int block = seq->blocks[pos / bs];
    const size_t value = (size_t) block * kv->block_floats + kv->layer_offset[layer]
                         + (size_t) (pos % bs) * kv->entry_floats[layer];
    return (unsigned char *) kv->pool + value * kv->value_bytes;
}

// The entry of `layer` at position pos of seq in an fp32 cache: latent, then k_pe, then the
// index key if the layer has one. Valid until the sequence is freed.
static inline float *kv_entry(const KvCache *kv, const KvSeq *seq, int layer, int pos)
{
    return (float *) (void *) kv_entry_bytes(kv, seq, layer, pos);
}

// The entry as fp32 whatever the storage: the entry itself (fp32 cache) or tmp (float
// [entry_floats[layer]]) filled by widening bf16 values.
static inline const float *kv_read(const KvCache *kv, const KvSeq *seq, int layer, int pos,
                                   float *tmp)
{
    const unsigned char *e = kv_entry_bytes(kv, seq, layer, pos);
    if (kv->params.dtype == KV_DTYPE_F32) return (const float *) (const void *) e;
    const size_t n = kv->entry_floats[layer];
    for (size_t i = 0; i < n; i++) {
        const uint32_t bits = ((uint32_t) e[2 * i] | (uint32_t) e[2 * i + 1] << 8) << 16;
        memcpy(tmp + i, &bits, sizeof bits);
    }
    return tmp;
}

// Store src[0..width) into values offset .. offset+width of the entry (layer, pos), rounding
// to the cache's dtype.
void kv_store(KvCache *kv, const KvSeq *seq, int layer, int pos, int offset, const float *src,
              int width);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_MODEL_KV_CACHE_H
