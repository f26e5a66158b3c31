/*
 * test_kv_cache.c - kv_cache.c: block accounting (reserve, exhaustion, free, reuse) and the
 * entry layout (every (layer, position) entry is its own memory, index keys only on layers
 * that have them).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kv_cache.h"
#include "tests/check.h"

static KvCacheParams small_params(void)
{
    KvCacheParams p = {.n_layers = 3, .block_size = 4, .n_blocks = 5, .kv_lora = 6,
                       .rope_dim = 2, .index_dim = 3};
    p.has_index[0] = true;
    p.has_index[2] = true;
    return p;
}

static void test_accounting(void)
{
    KvCacheParams p = small_params();
    KvCache kv;
    CHECK(kv_init(&kv, &p) == ERR_OK);
    CHECK(kv_n_free_blocks(&kv) == 5);
    CHECK(kv.entry_floats[0] == 11 && kv.entry_floats[1] == 8 && kv.entry_floats[2] == 11);
    CHECK(kv.block_floats == 4 * (11 + 8 + 11));

    KvSeq a = {0}, b = {0};
    CHECK(kv_seq_reserve(&kv, &a, 0) == ERR_OK && a.n_blocks == 0);
    CHECK(kv_seq_reserve(&kv, &a, 1) == ERR_OK && a.n_blocks == 1);
    CHECK(kv_seq_reserve(&kv, &a, 4) == ERR_OK && a.n_blocks == 1);  // still fits
    CHECK(kv_seq_reserve(&kv, &a, 5) == ERR_OK && a.n_blocks == 2);
    CHECK(kv_n_free_blocks(&kv) == 3);
    CHECK(kv_seq_reserve(&kv, &b, 12) == ERR_OK && b.n_blocks == 3);
    CHECK(kv_n_free_blocks(&kv) == 0);
    // Exhausted: the call fails and changes nothing.
    CHECK(kv_seq_reserve(&kv, &a, 9) == ERR_AGAIN);
    CHECK(a.n_blocks == 2 && kv_n_free_blocks(&kv) == 0);

    // The five blocks are distinct.
    int seen[5] = {0};
    for (int i = 0; i < a.n_blocks; i++)
        seen[a.blocks[i]]++;
    for (int i = 0; i < b.n_blocks; i++)
        seen[b.blocks[i]]++;
    for (int i = 0; i < 5; i++)
        CHECK(seen[i] == 1);

    kv_seq_free(&kv, &b);
    CHECK(b.blocks == NULL && b.n_blocks == 0 && b.n_tokens == 0);
    CHECK(kv_n_free_blocks(&kv) == 3);
    CHECK(kv_seq_reserve(&kv, &a, 9) == ERR_OK && a.n_blocks == 3);
    CHECK(kv_n_free_blocks(&kv) == 2);
    kv_seq_free(&kv, &a);
    kv_seq_free(&kv, &a);  // a zeroed sequence is fine
    CHECK(kv_n_free_blocks(&kv) == 5);
    kv_free(&kv);
    kv_free(&kv);
}

// Write a distinct value into every float of every entry of two sequences, then read all
// of them back: any overlap between entries (or blocks) would overwrite something.
static void test_layout(void)
{
    KvCacheParams p = small_params();
    KvCache kv;
    CHECK(kv_init(&kv, &p) == ERR_OK);
    KvSeq s[2] = {{0}, {0}};
    const int n_pos[2] = {7, 9};
    CHECK(kv_seq_reserve(&kv, &s[0], n_pos[0]) == ERR_OK);
    CHECK(kv_seq_reserve(&kv, &s[1], n_pos[1]) == ERR_OK);
    float v = 1.0f;
    for (int q = 0; q < 2; q++)
        for (int l = 0; l < p.n_layers; l++)
            for (int t = 0; t < n_pos[q]; t++) {
                float *e = kv_entry(&kv, &s[q], l, t);
                CHECK(e >= kv.pool && e + kv.entry_floats[l] <= kv.pool + kv.block_floats * 5);
                for (size_t i = 0; i < kv.entry_floats[l]; i++)
                    e[i] = v++;
            }
    v = 1.0f;
    int bad = 0;
    for (int q = 0; q < 2; q++)
        for (int l = 0; l < p.n_layers; l++)
            for (int t = 0; t < n_pos[q]; t++) {
                const float *e = kv_entry(&kv, &s[q], l, t);
                for (size_t i = 0; i < kv.entry_floats[l]; i++)
                    bad += e[i] != v++;
            }
    CHECK(bad == 0);
    kv_seq_free(&kv, &s[0]);
    kv_seq_free(&kv, &s[1]);
    kv_free(&kv);
}

static void test_bad_params(void)
{
    KvCacheParams p = small_params();
    KvCache kv;
    p.n_blocks = 0;
    CHECK(kv_init(&kv, &p) == ERR_INVAL);
    CHECK(kv.pool == NULL);
    p = small_params();
    p.block_size = 0;  // the default
    CHECK(kv_init(&kv, &p) == ERR_OK);
    CHECK(kv.params.block_size == KV_DEFAULT_BLOCK_SIZE);
    kv_free(&kv);
}

int main(void)
{
    test_accounting();
    test_layout();
    test_bad_params();
    return check_exit();
}
