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
    kv->params = params;
    size_t offset = 0;
    for (int l = 0; l < params.n_layers; l++) {
        kv->layer_offset[l] = offset;
        kv->entry_floats[l] = (size_t) params.kv_lora + (size_t) params.rope_dim
                              + (params.has_index[l] ? (size_t) params.index_dim : 0);
        offset += kv->entry_floats[l] * (size_t) params.block_size;
    }
    kv->block_floats = offset;

    if (params.dtype != KV_DTYPE_F32 && params.dtype != KV_DTYPE_BF16) {
        LOG_ERROR("bad kv cache dtype %d", (int) params.dtype);
        memset(kv, 0, sizeof *kv);
        return ERR_INVAL;
    }
    kv->value_bytes = params.dtype == KV_DTYPE_BF16 ? 2 : 4;
    const size_t n_floats = kv->block_floats * (size_t) params.n_blocks;
    if (n_floats > SIZE_MAX / kv->value_bytes) return ERR_NOMEM;
    kv->pool = calloc(n_floats, kv->value_bytes);
    kv->free_blocks = malloc((size_t) params.n_blocks * sizeof *kv->free_blocks);
    if (!kv->pool || !kv->free_blocks) {
        LOG_ERROR("could not allocate a kv cache of %zu bytes (%d blocks of %d positions)",
                  n_floats * kv->value_bytes, params.n_blocks, params.block_size);
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
    ASSERT(offset >= 0 && width >= 0
           && (size_t) offset + (size_t) width <= kv->entry_floats[layer]);
    unsigned char *e = kv_entry_bytes(kv, seq, layer, pos) + (size_t) offset * kv->value_bytes;
    if (kv->params.dtype == KV_DTYPE_F32) {
        memcpy(e, src, (size_t) width * sizeof(float));
        return;
    }
    for (int i = 0; i < width; i++) {
        uint32_t bits;
        memcpy(&bits, src + i, sizeof bits);
        uint16_t h;
        if ((bits & 0x7fffffffu) > 0x7f800000u)
            h = (uint16_t) ((bits >> 16) | 0x40);  // NaN stays a (quiet) NaN
        else
            h = (uint16_t) ((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);  // nearest even
        e[2 * i] = (unsigned char) (h & 0xff);
        e[2 * i + 1] = (unsigned char) (h >> 8);
    }
}
