/*
 * kv_cache.c - block pool and per-sequence block tables (layout in kv_cache.h).
 *
 * The pool is one allocation made at startup; the free list is a stack, so a freed
 * sequence's blocks are the next to be reused (they are still warm in cache).
 */
#include "engine/model/kv_cache.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int align4(int n)
{
    return (n + 3) & ~3;
}

KvEntryLayout kv_entry_layout(KvDtype dtype, int kv_lora, int rope_dim, int index_dim,
                              int block_size)
{
    KvEntryLayout e = {.dtype = (int) dtype,
                       .kv_lora = kv_lora,
                       .rope_dim = rope_dim,
                       .index_dim = index_dim,
                       .block_size = block_size};
    if (dtype != KV_DTYPE_FP8) {
        e.value_bytes = dtype == KV_DTYPE_BF16 ? 2 : 4;
        e.pe = kv_lora * e.value_bytes;
        e.bytes = (kv_lora + rope_dim) * e.value_bytes;
        e.key_bytes = index_dim * e.value_bytes;
        e.key_page = block_size * e.key_bytes;
        return e;
    }
    const int groups = (kv_lora + KV_FP8_GROUP - 1) / KV_FP8_GROUP;
    e.lat_scale = align4(kv_lora);
    e.pe = e.lat_scale + 4 * groups;
    e.bytes = align4(e.pe + 2 * rope_dim);
    if (index_dim > 0) {
        e.key_bytes = align4(index_dim);
        e.key_scales = block_size * e.key_bytes;
        e.key_page = e.key_scales + 4 * block_size;
    }
    return e;
}

static const char *const dtype_names[] = {"f32", "bf16", "fp8"};

const char *kv_dtype_name(KvDtype dtype)
{
    return (unsigned) dtype < 3 ? dtype_names[dtype] : "?";
}

bool kv_dtype_parse(const char *s, KvDtype *out)
{
    for (int i = 0; i < 3; i++)
        if (!strcmp(s, dtype_names[i])) {
            *out = (KvDtype) i;
            return true;
        }
    return false;
}

Err kv_init(KvCache *kv, const KvCacheParams *p)
{
    memset(kv, 0, sizeof *kv);
    KvCacheParams params = *p;
    if (params.block_size == 0) params.block_size = KV_DEFAULT_BLOCK_SIZE;
    if (params.n_layers < 1 || params.n_layers > KV_MAX_LAYERS || params.block_size < 1
        || params.n_blocks < 1 || params.kv_lora < 1 || params.rope_dim < 0
        || params.index_dim < 0) {
        LOG_ERROR("bad kv cache parameters: %d layers, block size %d, %d blocks, latent %d",
                  params.n_layers, params.block_size, params.n_blocks, params.kv_lora);
        return ERR_INVAL;
    }
    if (params.dtype != KV_DTYPE_F32 && params.dtype != KV_DTYPE_BF16
        && params.dtype != KV_DTYPE_FP8) {
        LOG_ERROR("bad kv cache dtype %d", (int) params.dtype);
        return ERR_INVAL;
    }
    kv->params = params;
    size_t per_block = 0;
    for (int l = 0; l < params.n_layers; l++) {
        kv->entry[l] =
            kv_entry_layout(params.dtype, params.kv_lora, params.rope_dim,
                            params.has_index[l] ? params.index_dim : 0, params.block_size);
        per_block += (size_t) kv->entry[l].bytes * (size_t) params.block_size
                     + (size_t) kv->entry[l].key_page;
    }
    kv->block_bytes = per_block;
    if (kv->block_bytes > SIZE_MAX / (size_t) params.n_blocks) return ERR_NOMEM;
    const size_t bytes = kv->block_bytes * (size_t) params.n_blocks;
    // Layer by layer: the MLA pages of every block, then the key pages.
    size_t offset = 0;
    for (int l = 0; l < params.n_layers; l++) {
        kv->mla_offset[l] = offset;
        offset +=
            (size_t) kv->entry[l].bytes * (size_t) params.block_size * (size_t) params.n_blocks;
        kv->key_offset[l] = offset;
        offset += (size_t) kv->entry[l].key_page * (size_t) params.n_blocks;
    }
    kv->pool = calloc(bytes, 1);
    kv->free_blocks = malloc((size_t) params.n_blocks * sizeof *kv->free_blocks);
    if (!kv->pool || !kv->free_blocks) {
        LOG_ERROR("could not allocate a kv cache of %zu bytes (%d blocks of %d positions)", bytes,
                  params.n_blocks, params.block_size);
        kv_free(kv);
        return ERR_NOMEM;
    }
    // Block 0 on top of the stack: a fresh sequence gets blocks 0, 1, 2, ...
    for (int i = 0; i < params.n_blocks; i++)
        kv->free_blocks[i] = params.n_blocks - 1 - i;
    kv->n_free = params.n_blocks;
    return ERR_OK;
}

void kv_free(KvCache *kv)
{
    if (!kv) return;
    free(kv->pool);
    free(kv->free_blocks);
    memset(kv, 0, sizeof *kv);
}

Err kv_seq_reserve(KvCache *kv, KvSeq *seq, int n_tokens)
{
    ASSERT(n_tokens >= 0);
    const int bs = kv->params.block_size;
    const int need = (int) (((long long) n_tokens + bs - 1) / bs);
    if (need <= seq->n_blocks) return ERR_OK;
    const int more = need - seq->n_blocks;
    if (more > kv->n_free) {
        LOG_DEBUG("kv cache: %d more blocks wanted, %d free", more, kv->n_free);
        return ERR_AGAIN;
    }
    int *blocks = realloc(seq->blocks, (size_t) need * sizeof *blocks);
    if (!blocks) return ERR_NOMEM;
    seq->blocks = blocks;
    for (int i = 0; i < more; i++)
        seq->blocks[seq->n_blocks++] = kv->free_blocks[--kv->n_free];
    return ERR_OK;
}

void kv_seq_free(KvCache *kv, KvSeq *seq)
{
    if (!seq) return;
    for (int i = seq->n_blocks - 1; i >= 0; i--) {
        ASSERT(kv->n_free < kv->params.n_blocks);
        kv->free_blocks[kv->n_free++] = seq->blocks[i];
    }
    free(seq->blocks);
    memset(seq, 0, sizeof *seq);
}

int kv_n_free_blocks(const KvCache *kv)
{
    return kv->n_free;
}

void kv_store(KvCache *kv, const KvSeq *seq, int layer, int pos, int offset, const float *src,
              int width)
{
    const KvEntryLayout *lo = &kv->entry[layer];
    ASSERT(kv_write_ok(lo, offset, width));
    unsigned char *e = kv_entry_bytes(kv, seq, layer, pos);
    unsigned char *page = lo->index_dim > 0
                              ? (unsigned char *) kv->pool + kv_key_page_offset(kv, seq, layer, pos)
                              : NULL;
    const int parts = kv_store_parts(lo, width);
    for (int p = 0; p < parts; p++)
        kv_store_part(lo, e, page, pos % kv->params.block_size, offset, src, width, p);
}
