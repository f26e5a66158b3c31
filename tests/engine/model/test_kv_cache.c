/*
 * test_kv_cache.c - kv_cache.c: block accounting (reserve, exhaustion, free, reuse) and the
 * entry layout (every (layer, position) entry is its own memory, index keys only on layers
 * that have them), and bf16 storage (rounding on store, exact widening on read).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/kv_cache.h"
#include "tests/check.h"

static KvCacheParams small_params(void)
{
    KvCacheParams p = {
        .n_layers = 3, .block_size = 4, .n_blocks = 5, .kv_lora = 6, .rope_dim = 2, .index_dim = 3};
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
                const float *pool = kv.pool;
                CHECK(e >= pool && e + kv.entry_floats[l] <= pool + kv.block_floats * 5);
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

// bf16 storage: kv_store rounds to nearest even (ties included), kv_read widens exactly,
// and partial stores at an offset leave the rest of the entry alone.
static void test_bf16(void)
{
    KvCacheParams p = small_params();
    p.dtype = KV_DTYPE_BF16;
    KvCache kv;
    CHECK(kv_init(&kv, &p) == ERR_OK);
    CHECK(kv.value_bytes == 2);
    KvSeq s = {0};
    CHECK(kv_seq_reserve(&kv, &s, 6) == ERR_OK);
    // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa wins (1). 1 + 3 * 2^-8 ties
    // between 1 + 2^-7 and 1 + 2^-6: even wins (1 + 2^-6). 1 + 2^-8 + 2^-20 rounds up.
    const float in[11] = {1.0f + 0x1p-8f,
                          1.0f + 3 * 0x1p-8f,
                          1.0f + 0x1p-8f + 0x1p-20f,
                          -2.5f,
                          0.0f,
                          3.0e38f,
                          1e-40f,
                          -0.0f,
                          65504.0f,
                          0.1f,
                          7.0f};
    const float want[11] = {1.0f,  1.0f + 0x1p-6f, 1.0f + 0x1p-7f, -2.5f, 0.0f, 2.9979e38f, 1e-40f,
                            -0.0f, 65536.0f,       0.10009765625f, 7.0f};
    kv_store(&kv, &s, 2, 5, 0, in, 11);
    float tmp[11];
    const float *got = kv_read(&kv, &s, 2, 5, tmp);
    for (int i = 0; i < 11; i++) {
        // No exact literal for these two: within half a bf16 ulp (2^-8 relative; 2^-134
        // absolute for the subnormal, whose spacing is 2^-133).
        if (i == 5 || i == 6)
            CHECK_NEAR(got[i], in[i], fabs(in[i]) * 0x1p-8 + 0x1p-134);
        else
            CHECK(got[i] == want[i]);
    }
    const float two[2] = {5.0f, 6.0f};
    kv_store(&kv, &s, 2, 5, 8, two, 2);
    got = kv_read(&kv, &s, 2, 5, tmp);
    CHECK(got[7] == -0.0f && got[8] == 5.0f && got[9] == 6.0f && got[10] == 7.0f);
    // another position of the same layer is untouched
    got = kv_read(&kv, &s, 2, 4, tmp);
    CHECK(got[0] == 0.0f && got[10] == 0.0f);
    kv_seq_free(&kv, &s);
    kv_free(&kv);
}

int main(void)
{
    test_accounting();
    test_layout();
    test_bad_params();
    test_bf16();
    return check_exit();
}
