/*
 * kv_cache.h - the paged KV cache: per layer, per token, the MLA latent and (on full DSA
 * layers) the indexer key, in fixed-size blocks drawn from one pool.
 *
 * What one token stores for layer l (its "entry"), as values:
 *   latent     [kv_lora]     kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora]), the MLA latent
 *   k_pe       [rope]        the shared rope key, rotated already (layout as model.c's RoPE)
 *   index_key  [index_dim]   indexer key after LayerNorm and RoPE; only layers with has_index
 * Attention is computed from the latent (absorbed form, backend_cpu.c), so nothing per head
 * is stored. A block holds block_size consecutive positions of one sequence for every layer:
 *   pool = [n_blocks][layer][block_size][entry(layer)]
 * so one layer's entries within a block are contiguous. A sequence owns a block table;
 * position p lives in block blocks[p / block_size] at row p % block_size.
 *
 * Storage types (KvDtype) and the bytes of an entry (KvEntryLayout):
 *   f32   every value fp32, in the order above.
 *   bf16  every value bf16 (nearest even on store, exact widening on read): half of f32.
 *   fp8   vLLM's fp8_ds_mla layout generalised to any width, and DeepSeek's fp8 indexer keys:
 *           latent codes   kv_lora bytes of E4M3, value / scale of its group
 *           latent scales  ceil(kv_lora / KV_FP8_GROUP) fp32 (4-byte aligned), one per group
 *                          of KV_FP8_GROUP consecutive latent values: scale = amax / 448
 *           k_pe           rope bf16 (the rotary key keeps bf16, as fp8_ds_mla does)
 *           index codes    index_dim bytes of E4M3 (4-byte aligned start), value / scale
 *           index scale    one fp32 (4-byte aligned): amax of the key / 448
 *         At GLM-5's widths (latent 512, rope 64, index 128) an entry is 656 bytes (exactly
 *         fp8_ds_mla's) plus 132 on layers with an indexer key, against 2,304 + 512 in f32.
 *         A group whose values are all 0 gets scale 1. Codes are kernels/nvfp4_format.h's
 *         nvfp4_float_to_e4m3 (nearest even, saturating) of the fp32 quotient value / scale,
 *         and a value reads back as e4m3(code) * scale in fp32. kv_entry_store and
 *         kv_entry_value below are compiled for the host and for CUDA devices, so the CPU
 *         reference and the CUDA backend store identical bytes for identical inputs.
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
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "engine/shared/err.h"
#include "kernels/nvfp4_format.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __CUDACC__
#define KV_FN static inline __host__ __device__
#else
#define KV_FN static inline
#endif

enum { KV_MAX_LAYERS = 256, KV_DEFAULT_BLOCK_SIZE = 128, KV_FP8_GROUP = 128 };

typedef enum KvDtype {
    KV_DTYPE_F32,   // exact: decode equals prefill bit for bit, golden tests run on it
    KV_DTYPE_BF16,  // half the memory, ~3 significant digits per cached value
    KV_DTYPE_FP8,   // the reference deployment's cache: E4M3 with fp32 group scales (above)
} KvDtype;

// Where the parts of one entry lie, in bytes from the entry's start (f32 and bf16: the values
// in order, value_bytes each; the fp8 offsets are those of the layout above).
typedef struct KvEntryLayout {
    int dtype;  // KvDtype
    int kv_lora, rope_dim, index_dim;  // index_dim 0 on a layer without an indexer key
    int value_bytes;  // f32 4, bf16 2; fp8 0 (mixed)
    int lat_scale;    // fp8: the latent's group scales
    int pe;           // k_pe
    int idx;          // index key
    int idx_scale;    // fp8: its scale
    int bytes;        // the whole entry
} KvEntryLayout;

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
    KvEntryLayout entry[KV_MAX_LAYERS];  // the entry of each layer
    size_t layer_offset[KV_MAX_LAYERS];  // bytes from a block's start to the layer's rows
    size_t block_bytes;                  // bytes per block (all layers)
    void *pool;                          // [n_blocks, block_bytes], owned
    int *free_blocks;                    // stack of free block ids, owned
    int n_free;
} KvCache;

typedef struct KvSeq {
    int *blocks;   // [n_blocks] block ids, owned
    int n_blocks;  // blocks held
    int n_tokens;  // positions written so far (the model's forward advances it)
} KvSeq;

// The entry of a layer with these widths (index_dim 0: no indexer key) in this storage type.
// ERR-free: widths must be >= 0 and dtype one of KvDtype.
KvEntryLayout kv_entry_layout(KvDtype dtype, int kv_lora, int rope_dim, int index_dim);

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

// Blocks available in the pool.
int kv_n_free_blocks(const KvCache *kv);

// Values in an entry of `layer` (the width kv_read widens to).
static inline int kv_entry_values(const KvCache *kv, int layer)
{
    const KvEntryLayout *e = &kv->entry[layer];
    return e->kv_lora + e->rope_dim + e->index_dim;
}

// Byte address of the entry of `layer` at position pos of seq (pos < reserved capacity).
static inline unsigned char *kv_entry_bytes(const KvCache *kv, const KvSeq *seq, int layer, int pos)
{
    const int bs = kv->params.block_size;
    const int block = seq->blocks[pos / bs];
    return (unsigned char *) kv->pool + (size_t) block * kv->block_bytes + kv->layer_offset[layer]
           + (size_t) (pos % bs) * (size_t) kv->entry[layer].bytes;
}

// The entry of `layer` at position pos of seq in an fp32 cache: latent, then k_pe, then the
// index key if the layer has one. Valid until the sequence is freed.
static inline float *kv_entry(const KvCache *kv, const KvSeq *seq, int layer, int pos)
{
    return (float *) (void *) kv_entry_bytes(kv, seq, layer, pos);
}

// Loads of a bf16 and an fp32 value of an entry. Entries, their fp32 parts and their scales
// are 4-byte aligned in the pool and bf16 values 2-byte aligned, so a device reads them with
// one load; the host keeps memcpy (the pool's bytes have no declared type).
KV_FN float kv_bf16_load(const unsigned char *p)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float((uint32_t) * (const uint16_t *) (const void *) p << 16);
#else
    const uint32_t bits = ((uint32_t) p[0] | (uint32_t) p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

KV_FN float kv_f32_load(const unsigned char *p)
{
#ifdef __CUDA_ARCH__
    return *(const float *) (const void *) p;
#else
    float f;
    memcpy(&f, p, sizeof f);
    return f;
#endif
}

// Value i (0 <= i < kv_lora + rope_dim + index_dim) of the entry at e, as fp32.
KV_FN float kv_entry_value(const KvEntryLayout *lo, const unsigned char *e, int i)
{
    if (lo->dtype == KV_DTYPE_F32) return kv_f32_load(e + (size_t) 4 * i);
    if (lo->dtype == KV_DTYPE_BF16) return kv_bf16_load(e + (size_t) 2 * i);
    if (i < lo->kv_lora)
        return nvfp4_e4m3_to_float(e[i]) * kv_f32_load(e + lo->lat_scale + 4 * (i / KV_FP8_GROUP));
    i -= lo->kv_lora;
    if (i < lo->rope_dim) return kv_bf16_load(e + lo->pe + 2 * i);
    i -= lo->rope_dim;
    return nvfp4_e4m3_to_float(e[lo->idx + i]) * kv_f32_load(e + lo->idx_scale);
}

KV_FN void kv_bf16_store(unsigned char *p, float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint16_t h;
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        h = (uint16_t) ((bits >> 16) | 0x40);  // NaN stays a (quiet) NaN
    else
        h = (uint16_t) ((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);  // nearest even
    p[0] = (unsigned char) (h & 0xff);
    p[1] = (unsigned char) (h >> 8);
}

// n values as E4M3 codes of one fp32 scale (amax / 448, or 1 when all are 0), stored at
// scale_at.
KV_FN void kv_fp8_group_store(unsigned char *codes, unsigned char *scale_at, const float *src, int n)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(src[i]));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int i = 0; i < n; i++)
        codes[i] = nvfp4_float_to_e4m3(src[i] / scale);
    memcpy(scale_at, &scale, sizeof scale);
}

// Whether a write of values offset .. offset + width fits the entry, and in an fp8 entry
// covers each scaled part it touches whole (the latent, or the index key: their values share
// scales); k_pe may be written alone. Every caller of kv_entry_store checks it.
static inline bool kv_write_ok(const KvEntryLayout *lo, int offset, int width)
{
    const int end = offset + width, idx0 = lo->kv_lora + lo->rope_dim;
    const int n = idx0 + lo->index_dim;
    if (offset < 0 || width < 0 || end > n) return false;
    return lo->dtype != KV_DTYPE_FP8 || width == 0
           || ((offset >= lo->kv_lora || (offset == 0 && end >= lo->kv_lora))
               && (end <= idx0 || (offset <= idx0 && end == n)));
}

// A store of values offset .. offset + width (kv_write_ok) is made of independent parts, so
// that a device can run them on parallel threads: f32 and bf16, one part per value; fp8, one
// per latent group (its values share a scale), then k_pe, then the index key (a part the
// write does not touch does nothing).
KV_FN int kv_store_parts(const KvEntryLayout *lo, int width)
{
    return lo->dtype == KV_DTYPE_FP8 ? (lo->kv_lora + KV_FP8_GROUP - 1) / KV_FP8_GROUP + 2 : width;
}

// Part `part` (< kv_store_parts) of storing src[0 .. width) as values offset .. offset + width
// of the entry at e.
KV_FN void kv_store_part(const KvEntryLayout *lo, unsigned char *e, int offset, const float *src,
                         int width, int part)
{
    if (lo->dtype == KV_DTYPE_F32) {
        memcpy(e + (size_t) 4 * (offset + part), src + part, sizeof(float));
        return;
    }
    if (lo->dtype == KV_DTYPE_BF16) {
        kv_bf16_store(e + (size_t) 2 * (offset + part), src[part]);
        return;
    }
    const int end = offset + width, pe0 = lo->kv_lora, idx0 = lo->kv_lora + lo->rope_dim;
    const int groups = (lo->kv_lora + KV_FP8_GROUP - 1) / KV_FP8_GROUP;
    if (part < groups) {  // latent group `part`: the write covers the whole latent
        if (offset >= pe0) return;
        const int g0 = part * KV_FP8_GROUP;
        const int n = lo->kv_lora - g0 < KV_FP8_GROUP ? lo->kv_lora - g0 : KV_FP8_GROUP;
        kv_fp8_group_store(e + g0, e + lo->lat_scale + 4 * part, src + g0 - offset, n);
    } else if (part == groups) {  // k_pe values in the write
        for (int i = offset > pe0 ? offset : pe0; i < end && i < idx0; i++)
            kv_bf16_store(e + lo->pe + 2 * (i - pe0), src[i - offset]);
    } else if (end > idx0) {  // the index key, whole
        kv_fp8_group_store(e + lo->idx, e + lo->idx_scale, src + idx0 - offset, lo->index_dim);
    }
}

// Store src[0 .. width) as values offset .. offset + width of the entry at e (kv_write_ok):
// every part in order.
KV_FN void kv_entry_store(const KvEntryLayout *lo, unsigned char *e, int offset, const float *src,
                          int width)
{
    const int parts = kv_store_parts(lo, width);
    for (int p = 0; p < parts; p++)
        kv_store_part(lo, e, offset, src, width, p);
}

// The entry as fp32 whatever the storage: the entry itself (fp32 cache) or tmp (float
// [kv_entry_values(kv, layer)]) filled by widening.
static inline const float *kv_read(const KvCache *kv, const KvSeq *seq, int layer, int pos,
                                   float *tmp)
{
    const unsigned char *e = kv_entry_bytes(kv, seq, layer, pos);
    if (kv->params.dtype == KV_DTYPE_F32) return (const float *) (const void *) e;
    const KvEntryLayout *lo = &kv->entry[layer];
    const int n = kv_entry_values(kv, layer);
    for (int i = 0; i < n; i++)
        tmp[i] = kv_entry_value(lo, e, i);
    return tmp;
}

// Store src[0..width) into values offset .. offset+width of the entry (layer, pos), rounding
// to the cache's dtype (kv_entry_store's rules).
void kv_store(KvCache *kv, const KvSeq *seq, int layer, int pos, int offset, const float *src,
              int width);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_MODEL_KV_CACHE_H
