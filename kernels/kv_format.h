/*
 * kv_format.h - how one token's KV cache entry is stored (KvEntryLayout) and the routines that
 * read and write its values, in plain C for the host and CUDA devices: the engine's KV cache
 * (engine/model/kv_cache.h, which lays entries out in pages and describes the storage types
 * and their padding) is read and written through these on the CPU backend, and written by
 * kernels/kv.h's kv_write on the GPU, so both store the same bytes for the same values.
 *
 * Ownership: none. Threads: pure. Errors: none (callers check kv_write_ok).
 */
#ifndef KERNELS_KV_FORMAT_H
#define KERNELS_KV_FORMAT_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/dsa_format.h"
#include "kernels/mla_format.h"
#include "kernels/nvfp4_format.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __CUDACC__
#define KV_FN static inline __host__ __device__
#else
#define KV_FN static inline
#endif

enum { KV_FP8_GROUP = 128 };  // latent values sharing one fp8 scale

typedef enum KvDtype {
    KV_DTYPE_F32,   // exact: decode equals prefill bit for bit, golden tests run on it
    KV_DTYPE_BF16,  // half the memory, ~3 significant digits per cached value
    KV_DTYPE_FP8,   // the reference deployment's cache: E4M3 with fp32 group scales (kv_cache.h)
} KvDtype;

// One layer's storage, in bytes (f32 and bf16: values in order, value_bytes each; fp8: the
// offsets of engine/model/kv_cache.h's layout).
typedef struct KvEntryLayout {
    int dtype;                         // KvDtype
    int kv_lora, rope_dim, index_dim;  // index_dim 0 on a layer without an indexer key
    int lat_store, pe_store, key_store;  // the widths stored (padded: kv_cache.h)
    int block_size;
    int value_bytes;  // f32 4, bf16 2; fp8 0 (mixed)
    int lat_scale;    // fp8: the latent's group scales (of lat_store values), in the entry
    int pe;           // k_pe, in the entry
    int bytes;        // the entry (latent and k_pe)
    int key_bytes;    // one index key's row in a key page
    int key_scales;   // fp8: the page's scale array (block_size fp32), from the page's start
    int key_page;     // a key page; 0 without an indexer key
} KvEntryLayout;

static inline int kv_align4(int n)
{
    return (n + 3) & ~3;
}

// The width an index key of `width` values is stored in (engine/model/kv_cache.h, padding): a
// multiple of 16 up to DSA_MAX_DIM in a bf16 or fp8 cache, else its own.
static inline int kv_key_store_width(KvDtype dtype, int width)
{
    if (dtype == KV_DTYPE_F32 || width <= 0 || width > DSA_MAX_DIM) return width;
    return (width + 15) / 16 * 16;
}

// The storage of a layer with these widths (index_dim 0: no indexer key) in this type and
// block size (engine/model/kv_cache.h describes it). Widths must be >= 0, block_size >= 1 and
// dtype one of KvDtype. At GLM-5's widths and blocks of MLA_BLOCK its MLA entries are
// kernels/mla.h's cache (fp8_ds_mla or bf16) and its key pages kernels/dsa.h's fp8 keys.
static inline KvEntryLayout kv_entry_layout(KvDtype dtype, int kv_lora, int rope_dim, int index_dim,
                                            int block_size)
{
    KvEntryLayout e;
    memset(&e, 0, sizeof e);
    e.dtype = (int) dtype;
    e.kv_lora = kv_lora;
    e.rope_dim = rope_dim;
    e.index_dim = index_dim;
    e.lat_store = kv_lora;
    e.pe_store = rope_dim;
    e.key_store = kv_key_store_width(dtype, index_dim);
    e.block_size = block_size;
    // The MLA entry padded to the kernels' widths where they could read it (kv_cache.h).
    if (dtype != KV_DTYPE_F32 && block_size == MLA_BLOCK && kv_lora <= MLA_KV_LORA
        && rope_dim <= MLA_ROPE) {
        e.lat_store = MLA_KV_LORA;
        e.pe_store = MLA_ROPE;
    }
    if (dtype != KV_DTYPE_FP8) {
        e.value_bytes = dtype == KV_DTYPE_BF16 ? 2 : 4;
        e.pe = e.lat_store * e.value_bytes;
        e.bytes = (e.lat_store + e.pe_store) * e.value_bytes;
        e.key_bytes = e.key_store * e.value_bytes;
        e.key_page = block_size * e.key_bytes;
        return e;
    }
    const int groups = (e.lat_store + KV_FP8_GROUP - 1) / KV_FP8_GROUP;
    e.lat_scale = kv_align4(e.lat_store);
    e.pe = e.lat_scale + 4 * groups;
    e.bytes = kv_align4(e.pe + 2 * e.pe_store);
    if (index_dim > 0) {
        e.key_bytes = kv_align4(e.key_store);
        e.key_scales = block_size * e.key_bytes;
        e.key_page = e.key_scales + 4 * block_size;
    }
    return e;
}

// What a cache write does to a token's values before storing them, in this order (NULL: they
// are stored as given): values 0 .. norm_dim of the write normalized, RMSNorm with norm_w
// (norm_b NULL) or LayerNorm with norm_w and norm_b (then norm_dim is the write's width), in
// double as the backends' norms compute them; then values rope_off .. rope_off + rope_dim
// rotated at the token's position (interleaved pairs written de-interleaved, rope_format.h's
// arithmetic). A layer's latent (kv_a_layernorm, then RoPE on k_pe) and its index key
// (LayerNorm, then RoPE) are stored so: kernels/kv.h in the launch that stores them.
typedef struct KvIn {
    const float *norm_w, *norm_b;  // fp32 [norm_dim], the backend's memory
    int norm_dim;                  // 0: no norm
    float eps;
    int rope_off, rope_dim;  // rope_dim 0: no RoPE
    float theta;
} KvIn;

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

// Value i (0 <= i < kv_lora + rope_dim) of the MLA entry at e, as fp32.
KV_FN float kv_entry_value(const KvEntryLayout *lo, const unsigned char *e, int i)
{
    if (lo->dtype != KV_DTYPE_FP8) {
        const unsigned char *at = i < lo->kv_lora ? e + (size_t) lo->value_bytes * i
                                                  : e + lo->pe + (size_t) lo->value_bytes * (i - lo->kv_lora);
        return lo->dtype == KV_DTYPE_F32 ? kv_f32_load(at) : kv_bf16_load(at);
    }
    if (i < lo->kv_lora)
        return nvfp4_e4m3_to_float(e[i]) * kv_f32_load(e + lo->lat_scale + 4 * (i / KV_FP8_GROUP));
    return kv_bf16_load(e + lo->pe + 2 * (i - lo->kv_lora));
}

// Value i (< index_dim) of the index key in row `row` of the key page at page, as fp32.
KV_FN float kv_key_value(const KvEntryLayout *lo, const unsigned char *page, int row, int i)
{
    const unsigned char *k = page + (size_t) row * (size_t) lo->key_bytes;
    if (lo->dtype == KV_DTYPE_F32) return kv_f32_load(k + (size_t) 4 * i);
    if (lo->dtype == KV_DTYPE_BF16) return kv_bf16_load(k + (size_t) 2 * i);
    return nvfp4_e4m3_to_float(k[i]) * kv_f32_load(page + lo->key_scales + 4 * row);
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
KV_FN void kv_fp8_group_store(unsigned char *codes, unsigned char *scale_at, const float *src,
                              int n)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(src[i]));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int i = 0; i < n; i++)
        codes[i] = nvfp4_float_to_e4m3(src[i] / scale);
    memcpy(scale_at, &scale, sizeof scale);
}

// Whether a write of values offset .. offset + width (of latent, k_pe, index key) fits the
// layer, and in fp8 covers each scaled part it touches whole (the latent, or the index key:
// their values share scales); k_pe may be written alone. Every caller of kv_store_part checks
// it.
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
// of a token: e is its MLA entry, page its key page (NULL without an indexer key) and row its
// row there.
KV_FN void kv_store_part(const KvEntryLayout *lo, unsigned char *e, unsigned char *page, int row,
                         int offset, const float *src, int width, int part)
{
    const int pe0 = lo->kv_lora, idx0 = lo->kv_lora + lo->rope_dim, end = offset + width;
    if (lo->dtype != KV_DTYPE_FP8) {
        const int j = offset + part;
        unsigned char *at =
            j < pe0    ? e + (size_t) lo->value_bytes * j
            : j < idx0 ? e + lo->pe + (size_t) lo->value_bytes * (j - pe0)
                       : page + (size_t) row * lo->key_bytes + (size_t) lo->value_bytes * (j - idx0);
        if (lo->dtype == KV_DTYPE_F32)
            memcpy(at, src + part, sizeof(float));
        else
            kv_bf16_store(at, src[part]);
        return;
    }
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
        kv_fp8_group_store(page + (size_t) row * lo->key_bytes, page + lo->key_scales + 4 * row,
                           src + idx0 - offset, lo->index_dim);
    }
}

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_KV_FORMAT_H
