/*
 * kv_cache.h - the paged KV cache: per layer, per token, the MLA latent and (on full DSA
 * layers) the indexer key, in fixed-size blocks drawn from one pool.
 *
 * What one token stores for layer l, as values (kv_read widens them in this order):
 *   latent     [kv_lora]     kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora]), the MLA latent
 *   k_pe       [rope]        the shared rope key, rotated already (layout as model.c's RoPE)
 *   index_key  [index_dim]   indexer key after LayerNorm and RoPE; only layers with has_index
 * Attention is computed from the latent (absorbed form, backend_cpu.c), so nothing per head
 * is stored. A sequence owns a block table; position p lives in block blocks[p / block_size]
 * at row p % block_size. The pool is laid out layer by layer, as the GPU kernels read it
 * (kernels/mla.h's MlaCache pages, kernels/dsa.h's key pages):
 *   pool = for each layer: MLA pages [n_blocks][block_size][entry]
 *                          then, with an indexer key, key pages [n_blocks][key page]
 *   entry    = latent, then k_pe (KvEntryLayout: lat_scale, pe, bytes)
 *   key page = block_size keys of key_bytes, then (fp8) block_size fp32 scales
 * A block's id indexes every layer's pages, so a block costs block_bytes of the pool.
 *
 * Padding (bf16 and fp8): the tuned GPU kernels read GLM-5's widths, so a narrower part is
 * stored zero-padded to them where they could read it: in blocks of MLA_BLOCK (128) positions
 * with latent <= 512 and rope <= 64, the latent to MLA_KV_LORA (512) values and k_pe to
 * MLA_ROPE (64); the index key to a multiple of 16 up to DSA_MAX_DIM (any block size). Other
 * parts are stored as they are. Nothing writes the padding: the pool starts zeroed (and the
 * GPU's copy too: KvCache.serial), so padded values read as 0 (fp8: codes 0, and scale 0 for
 * a group wholly in the padding), and a dot product over the padded widths equals the one
 * over the model's. Reads (kv_entry_value, kv_key_value) and writes (kv_store_part) take the
 * model's widths; KvEntryLayout's lat_store, pe_store and key_store give the stored ones. f32
 * (the CPU reference's cache; the GPU's kernels read none) is stored unpadded. A model at
 * GLM-5's widths is stored as before.
 *
 * Storage types (KvDtype):
 *   f32   every value fp32.
 *   bf16  every value bf16 (nearest even on store, exact widening on read): half of f32.
 *   fp8   vLLM's fp8_ds_mla entry generalised to any width, and DeepSeek's fp8 indexer keys:
 *           latent codes   lat_store bytes of E4M3, value / scale of its group
 *           latent scales  ceil(lat_store / KV_FP8_GROUP) fp32 (4-byte aligned), one per group
 *                          of KV_FP8_GROUP consecutive latent values: scale = amax / 448
 *           k_pe           pe_store bf16 (the rotary key keeps bf16, as fp8_ds_mla does)
 *           key            key_store bytes of E4M3 (rows 4-byte aligned), value / scale,
 *                          its fp32 scale (amax of the key / 448) in the page's scale array
 *         At GLM-5's widths (latent 512, rope 64, index 128) and block 128 an entry is 656
 *         bytes (fp8_ds_mla, kernels/mla.h MLA_CACHE_FP8) and a key page 16,896 bytes
 *         (kernels/dsa.h DSA_BLOCK_BYTES): 788 bytes per token on an indexer layer, against
 *         2,816 in f32. A group whose values are all 0 gets scale 1. Codes are
 *         kernels/nvfp4_format.h's nvfp4_float_to_e4m3 (nearest even, saturating) of the fp32
 *         quotient value / scale; a value reads back as e4m3(code) * scale in fp32. The store
 *         and read routines (kernels/kv_format.h: KvEntryLayout, kv_store_part,
 *         kv_entry_value, kv_key_value) are compiled for the host and for CUDA devices
 *         (kernels/kv.h's write), so the CPU reference and the CUDA backend store identical
 *         bytes for identical inputs.
 *
 * Prefix caching: a block may be shared by several sequences (kv_seq_attach) and counts its
 * references. A published block holds KV that a later sequence with the same token prefix
 * may reuse; when its last reference goes it is kept, in an LRU list, instead of freed, and
 * kv_seq_reserve evicts the least recently used of them when no block is free (a chain's
 * last blocks first: kv_seq_free releases a sequence's blocks from its end). Rank 0 (which
 * sees the tokens) also keeps an index from a prefix's hash to its block (kv_prefix_find,
 * kv_prefix_insert); eviction removes the block's entry. Every rank of a pipeline applies the
 * same reserve, attach, publish and free calls in the same order, so their blocks agree.
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

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "engine/shared/err.h"
#include "kernels/dsa_format.h"
#include "kernels/kv_format.h"
#include "kernels/mla_format.h"
#include "kernels/nvfp4_format.h"

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
    KvDtype dtype;  // storage type (KV_DTYPE_F32 when zeroed)
} KvCacheParams;

typedef struct KvCache {
    KvCacheParams params;
    KvEntryLayout entry[KV_MAX_LAYERS];  // the storage of each layer
    size_t mla_offset[KV_MAX_LAYERS];    // bytes from the pool's start to the layer's MLA pages
    size_t key_offset[KV_MAX_LAYERS];    // ... to its key pages (layers with an indexer key)
    size_t block_bytes;                  // bytes a block takes over all layers
    void *pool;                          // n_blocks * block_bytes bytes, owned
    int *free_blocks;                    // stack of free block ids, owned
    int n_free;
    // Prefix caching (all [n_blocks], owned): references, published flag, the index hash
    // (0: not in the index), the LRU list of published blocks without references (-1 ends).
    int *refs;
    unsigned char *published;
    uint64_t *hash;
    int *lru_prev, *lru_next;
    int lru_head, lru_tail, n_lru, n_published;
    uint64_t *index_keys;  // [index_cap] open addressing: 0 empty, 1 deleted, else a hash
    int *index_vals;       // [index_cap] the block of index_keys[i]
    int index_cap;
    uint64_t n_evicted;  // published blocks evicted so far
    uint64_t serial;     // this initialisation's number (kv_init): a device mirror of the pool
                         // is bound to it, so that a cache set up again at the same address
                         // never inherits another's bytes (its padding must read 0)
} KvCache;

typedef struct KvSeq {
    int *blocks;   // [n_blocks] block ids, owned
    int n_blocks;  // blocks held
    int n_tokens;  // positions written so far (the model's forward advances it)
} KvSeq;

// Bytes one token takes in a layer of this storage (its entry and, with an indexer key, its
// share of a key page).
static inline size_t kv_token_bytes(const KvEntryLayout *lo)
{
    return (size_t) lo->bytes + (size_t) lo->key_page / (size_t) lo->block_size;
}

// Name of a storage type: "f32", "bf16", "fp8".
const char *kv_dtype_name(KvDtype dtype);

// Parse a storage type name (as kv_dtype_name writes it); false when it is none of them.
bool kv_dtype_parse(const char *s, KvDtype *out);

// Allocate the pool described by p. On failure *kv is zeroed.
Err kv_init(KvCache *kv, const KvCacheParams *p);

// Free the pool; safe on a zeroed cache; zeroes *kv. Sequences must have been freed.
void kv_free(KvCache *kv);

// Make seq able to hold n_tokens positions (taking blocks from the pool as needed). On
// ERR_AGAIN nothing changes.
Err kv_seq_reserve(KvCache *kv, KvSeq *seq, int n_tokens);

// Return seq's blocks to the pool and zero *seq. Safe on a zeroed KvSeq.
void kv_seq_free(KvCache *kv, KvSeq *seq);

// Blocks available in the pool: free ones and cached ones no sequence references (which a
// reservation evicts).
int kv_n_free_blocks(const KvCache *kv);

// Give the empty seq the n blocks[] (a cached prefix: published blocks, or blocks other
// sequences hold) as its first n_blocks, holding n * block_size positions; each gains a
// reference (an unreferenced one leaves the LRU list). ERR_INVAL (logged, nothing changed)
// when seq is not empty or a block is out of range, free, or listed twice.
Err kv_seq_attach(KvCache *kv, KvSeq *seq, const int *blocks, int n);

// Publish seq's blocks first .. last-1 (kept, cached, when their last reference goes).
void kv_seq_publish(KvCache *kv, const KvSeq *seq, int first, int last);

// Rank 0's index: the block published under hash h (not 0), or -1.
int kv_prefix_find(const KvCache *kv, uint64_t h);

// Publish block b under hash h (not 0) in the index; false (nothing changed) when h is
// there already or b is indexed under another hash.
bool kv_prefix_insert(KvCache *kv, uint64_t h, int b);

// Published blocks (referenced or cached) and those of them no sequence references.
static inline int kv_n_published(const KvCache *kv)
{
    return kv->n_published;
}
static inline int kv_n_cached_idle(const KvCache *kv)
{
    return kv->n_lru;
}

// Values in an entry of `layer` (the width kv_read widens to).
static inline int kv_entry_values(const KvCache *kv, int layer)
{
    const KvEntryLayout *e = &kv->entry[layer];
    return e->kv_lora + e->rope_dim + e->index_dim;
}

// Offset in the pool of the MLA entry of `layer` at position pos of seq (pos < reserved
// capacity), and of the key page holding its index key (row pos % block_size).
static inline size_t kv_entry_offset(const KvCache *kv, const KvSeq *seq, int layer, int pos)
{
    const int bs = kv->params.block_size;
    const KvEntryLayout *lo = &kv->entry[layer];
    return kv->mla_offset[layer]
           + ((size_t) seq->blocks[pos / bs] * (size_t) bs + (size_t) (pos % bs))
                 * (size_t) lo->bytes;
}

static inline size_t kv_key_page_offset(const KvCache *kv, const KvSeq *seq, int layer, int pos)
{
    return kv->key_offset[layer]
           + (size_t) seq->blocks[pos / kv->params.block_size] * (size_t) kv->entry[layer].key_page;
}

// The index keys of `layer` (a layer with one) in a pool laid out as kv's (kv->pool, or a
// device copy of it) as kernels/dsa_format.h describes key pages: one page per block, dim the
// model's index_dim (kv_dsa_cache_stored: the stored width, its padding read as 0).
static inline DsaCache kv_dsa_cache(const KvCache *kv, const void *pool, int layer)
{
    const KvEntryLayout *lo = &kv->entry[layer];
    const DsaCache c = {(const uint8_t *) pool + kv->key_offset[layer],
                        lo->dtype == KV_DTYPE_FP8    ? DSA_KEY_FP8
                        : lo->dtype == KV_DTYPE_BF16 ? DSA_KEY_BF16
                                                     : DSA_KEY_F32,
                        lo->index_dim,
                        lo->block_size,
                        lo->key_bytes,
                        lo->key_scales,
                        (size_t) lo->key_page};
    return c;
}

static inline DsaCache kv_dsa_cache_stored(const KvCache *kv, const void *pool, int layer)
{
    DsaCache c = kv_dsa_cache(kv, pool, layer);
    c.dim = kv->entry[layer].key_store;
    return c;
}

// Byte address of the MLA entry of `layer` at position pos of seq.
static inline unsigned char *kv_entry_bytes(const KvCache *kv, const KvSeq *seq, int layer, int pos)
{
    return (unsigned char *) kv->pool + kv_entry_offset(kv, seq, layer, pos);
}

// The MLA entry of `layer` at position pos of seq in an fp32 cache: latent, then k_pe.
static inline float *kv_entry(const KvCache *kv, const KvSeq *seq, int layer, int pos)
{
    return (float *) (void *) kv_entry_bytes(kv, seq, layer, pos);
}

// A token's latent and k_pe in `layer` as fp32: the entry itself in an fp32 cache, else tmp
// (float [kv_lora + rope_dim]) filled by widening.
static inline const float *kv_read_entry(const KvCache *kv, const KvSeq *seq, int layer, int pos,
                                         float *tmp)
{
    const KvEntryLayout *lo = &kv->entry[layer];
    const unsigned char *e = kv_entry_bytes(kv, seq, layer, pos);
    if (lo->dtype == KV_DTYPE_F32) return (const float *) (const void *) e;
    for (int i = 0; i < lo->kv_lora + lo->rope_dim; i++)
        tmp[i] = kv_entry_value(lo, e, i);
    return tmp;
}

// A token's index key in `layer` (a layer with one) as fp32: the key itself in an fp32
// cache, else tmp (float [index_dim]) filled by widening.
static inline const float *kv_read_key(const KvCache *kv, const KvSeq *seq, int layer, int pos,
                                       float *tmp)
{
    const KvEntryLayout *lo = &kv->entry[layer];
    const unsigned char *page =
        (const unsigned char *) kv->pool + kv_key_page_offset(kv, seq, layer, pos);
    const int row = pos % kv->params.block_size;
    if (lo->dtype == KV_DTYPE_F32)
        return (const float *) (const void *) (page + (size_t) row * (size_t) lo->key_bytes);
    for (int i = 0; i < lo->index_dim; i++)
        tmp[i] = kv_key_value(lo, page, row, i);
    return tmp;
}

// A token's values of `layer` as fp32 in the order latent, k_pe, index key, into tmp (float
// [kv_entry_values(kv, layer)]). Returns tmp.
static inline const float *kv_read(const KvCache *kv, const KvSeq *seq, int layer, int pos,
                                   float *tmp)
{
    const KvEntryLayout *lo = &kv->entry[layer];
    const int n = lo->kv_lora + lo->rope_dim;
    const float *e = kv_read_entry(kv, seq, layer, pos, tmp);
    if (e != tmp) memcpy(tmp, e, (size_t) n * sizeof *tmp);
    if (lo->index_dim > 0) {
        const float *k = kv_read_key(kv, seq, layer, pos, tmp + n);
        if (k != tmp + n) memcpy(tmp + n, k, (size_t) lo->index_dim * sizeof *tmp);
    }
    return tmp;
}

// Store src[0..width) into values offset .. offset+width of the entry (layer, pos), rounding
// to the cache's dtype (kv_store_part's rules; kv_write_ok holds).
void kv_store(KvCache *kv, const KvSeq *seq, int layer, int pos, int offset, const float *src,
              int width);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_MODEL_KV_CACHE_H
