/*
 * kv_cache.c - block pool and per-sequence block tables (layout in kv_cache.h).
 *
 * The pool is one allocation made at startup; the free list is a stack, so a freed
 * sequence's blocks are the next to be reused (they are still warm in cache).
 */
#include "engine/model/kv_cache.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    static _Atomic uint64_t serials;
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
    kv->serial = ++serials;
    const size_t nb = (size_t) params.n_blocks;
    kv->free_blocks = malloc(nb * sizeof *kv->free_blocks);
    kv->refs = calloc(nb, sizeof *kv->refs);
    kv->published = calloc(nb, 1);
    kv->hash = calloc(nb, sizeof *kv->hash);
    kv->lru_prev = malloc(nb * sizeof *kv->lru_prev);
    kv->lru_next = malloc(nb * sizeof *kv->lru_next);
    kv->index_cap = 16;
    while (kv->index_cap < 2 * params.n_blocks)
        kv->index_cap *= 2;
    kv->index_keys = calloc((size_t) kv->index_cap, sizeof *kv->index_keys);
    kv->index_vals = calloc((size_t) kv->index_cap, sizeof *kv->index_vals);
    kv->lru_head = kv->lru_tail = -1;
    if (!kv->pool || !kv->free_blocks || !kv->refs || !kv->published || !kv->hash || !kv->lru_prev
        || !kv->lru_next || !kv->index_keys || !kv->index_vals) {
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
    free(kv->refs);
    free(kv->published);
    free(kv->hash);
    free(kv->lru_prev);
    free(kv->lru_next);
    free(kv->index_keys);
    free(kv->index_vals);
    memset(kv, 0, sizeof *kv);
}

// ---------------------------------------------------------------------------
// Prefix caching: the LRU list and the index

static void lru_remove(KvCache *kv, int b)
{
    const int p = kv->lru_prev[b], n = kv->lru_next[b];
    if (p >= 0) kv->lru_next[p] = n;
    else kv->lru_head = n;
    if (n >= 0) kv->lru_prev[n] = p;
    else kv->lru_tail = p;
    kv->n_lru--;
}

static void lru_push(KvCache *kv, int b)  // the most recently used end
{
    kv->lru_prev[b] = kv->lru_tail;
    kv->lru_next[b] = -1;
    if (kv->lru_tail >= 0) kv->lru_next[kv->lru_tail] = b;
    else kv->lru_head = b;
    kv->lru_tail = b;
    kv->n_lru++;
}

// The slot of h in the index (its key h), or -1.
static int index_slot(const KvCache *kv, uint64_t h)
{
    const unsigned mask = (unsigned) kv->index_cap - 1;
    for (unsigned i = (unsigned) (h ^ h >> 29) & mask, k = 0; k < (unsigned) kv->index_cap;
         i = (i + 1) & mask, k++) {
        if (kv->index_keys[i] == 0) return -1;
        if (kv->index_keys[i] == h) return (int) i;
    }
    return -1;
}

static uint64_t index_key(uint64_t h)
{
    return h < 2 ? h + 2 : h;  // 0 and 1 mark empty and deleted slots
}

int kv_prefix_find(const KvCache *kv, uint64_t h)
{
    if (!kv->index_keys) return -1;
    const int i = index_slot(kv, index_key(h));
    return i < 0 ? -1 : kv->index_vals[i];
}

bool kv_prefix_insert(KvCache *kv, uint64_t h, int b)
{
    h = index_key(h);
    if (b < 0 || b >= kv->params.n_blocks || kv->hash[b] != 0 || index_slot(kv, h) >= 0)
        return false;
    const unsigned mask = (unsigned) kv->index_cap - 1;
    unsigned i = (unsigned) (h ^ h >> 29) & mask;
    while (kv->index_keys[i] > 1)  // at most n_blocks keys in 2 * n_blocks slots: one is free
        i = (i + 1) & mask;
    kv->index_keys[i] = h;
    kv->index_vals[i] = b;
    kv->hash[b] = h;
    if (!kv->published[b]) {
        kv->published[b] = 1;
        kv->n_published++;
    }
    return true;
}

// Take block b out of the prefix cache: unpublished, out of the index.
static void unpublish(KvCache *kv, int b)
{
    if (kv->hash[b]) {
        const int i = index_slot(kv, kv->hash[b]);
        if (i >= 0) kv->index_keys[i] = 1;
        kv->hash[b] = 0;
    }
    if (kv->published[b]) {
        kv->published[b] = 0;
        kv->n_published--;
    }
}

void kv_seq_publish(KvCache *kv, const KvSeq *seq, int first, int last)
{
    for (int i = first < 0 ? 0 : first; i < last && i < seq->n_blocks; i++) {
        const int b = seq->blocks[i];
        if (!kv->published[b]) {
            kv->published[b] = 1;
            kv->n_published++;
        }
    }
}

Err kv_seq_attach(KvCache *kv, KvSeq *seq, const int *blocks, int n)
{
    if (seq->n_blocks != 0 || n < 0) {
        LOG_ERROR("kv cache: a cached prefix goes only to an empty sequence");
        return ERR_INVAL;
    }
    for (int i = 0; i < n; i++) {
        const int b = blocks[i];
        bool twice = false;
        for (int j = 0; j < i && !twice; j++)
            twice = blocks[j] == b;
        if (b < 0 || b >= kv->params.n_blocks || twice || (kv->refs[b] == 0 && !kv->published[b])) {
            LOG_ERROR("kv cache: cached prefix block %d (%d of %d) is out of range, repeated or free",
                      b, i, n);
            return ERR_INVAL;
        }
    }
    if (n == 0) return ERR_OK;
    int *copy = malloc((size_t) n * sizeof *copy);
    if (!copy) return ERR_NOMEM;
    for (int i = 0; i < n; i++) {
        const int b = blocks[i];
        if (kv->refs[b]++ == 0) lru_remove(kv, b);
        copy[i] = b;
    }
    free(seq->blocks);
    seq->blocks = copy;
    seq->n_blocks = n;
    seq->n_tokens = n * kv->params.block_size;
    return ERR_OK;
}

// ---------------------------------------------------------------------------

Err kv_seq_reserve(KvCache *kv, KvSeq *seq, int n_tokens)
{
    ASSERT(n_tokens >= 0);
    const int bs = kv->params.block_size;
    const int need = (int) (((long long) n_tokens + bs - 1) / bs);
    if (need <= seq->n_blocks) return ERR_OK;
    const int more = need - seq->n_blocks;
    if (more > kv->n_free + kv->n_lru) {
        LOG_DEBUG("kv cache: %d more blocks wanted, %d free, %d cached", more, kv->n_free, kv->n_lru);
        return ERR_AGAIN;
    }
    int *blocks = realloc(seq->blocks, (size_t) need * sizeof *blocks);
    if (!blocks) return ERR_NOMEM;
    seq->blocks = blocks;
    for (int i = 0; i < more; i++) {
        int b;
        if (kv->n_free > 0) {
            b = kv->free_blocks[--kv->n_free];
        } else {  // evict the least recently used cached block
            b = kv->lru_head;
            lru_remove(kv, b);
            unpublish(kv, b);
            kv->n_evicted++;
        }
        kv->refs[b] = 1;
        seq->blocks[seq->n_blocks++] = b;
    }
    return ERR_OK;
}

void kv_seq_free(KvCache *kv, KvSeq *seq)
{
    if (!seq) return;
    // From the end: a cached chain's last blocks are the least recently used, evicted first.
    for (int i = seq->n_blocks - 1; i >= 0; i--) {
        const int b = seq->blocks[i];
        ASSERT(kv->refs[b] > 0);
        if (--kv->refs[b] > 0) continue;
        if (kv->published[b]) {
            lru_push(kv, b);
        } else {
            ASSERT(kv->n_free < kv->params.n_blocks);
            kv->free_blocks[kv->n_free++] = b;
        }
    }
    free(seq->blocks);
    memset(seq, 0, sizeof *seq);
}

int kv_n_free_blocks(const KvCache *kv)
{
    return kv->n_free + kv->n_lru;
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
