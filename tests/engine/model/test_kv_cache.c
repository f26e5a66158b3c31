/*
 * test_kv_cache.c - kv_cache.c: block accounting (reserve, exhaustion, free, reuse) and the
 * entry layout (every (layer, position) entry is its own memory, index keys only on layers
 * that have them), bf16 storage (rounding on store, exact widening on read) and fp8 storage
 * (the byte layout, group scales, E4M3 codes, partial writes).
 */
#include <math.h>
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
    CHECK(kv_entry_values(&kv, 0) == 11 && kv_entry_values(&kv, 1) == 8
          && kv_entry_values(&kv, 2) == 11);
    // Per block: 4 positions x 8 floats of MLA entry on each layer, 4 x 3 of keys on two.
    CHECK(kv.block_bytes == 4 * 4 * (8 + 8 + 8 + 3 + 3));
    CHECK(kv.mla_offset[0] == 0 && kv.key_offset[0] == 5 * 4 * 4 * 8
          && kv.mla_offset[1] == kv.key_offset[0] + 5 * 4 * 4 * 3
          && kv.key_offset[1] == kv.mla_offset[1] + 5 * 4 * 4 * 8
          && kv.mla_offset[2] == kv.key_offset[1]);

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

// Store a distinct value into every value of every (sequence, layer, position) of two
// sequences, then read all of them back: any overlap between entries, key rows or blocks
// would overwrite something. Every byte stays inside the pool.
static void test_layout(void)
{
    KvCacheParams p = small_params();
    KvCache kv;
    CHECK(kv_init(&kv, &p) == ERR_OK);
    KvSeq s[2] = {{0}, {0}};
    const int n_pos[2] = {7, 9};
    CHECK(kv_seq_reserve(&kv, &s[0], n_pos[0]) == ERR_OK);
    CHECK(kv_seq_reserve(&kv, &s[1], n_pos[1]) == ERR_OK);
    const size_t pool_bytes = kv.block_bytes * 5;
    float v = 1.0f, vals[11];
    for (int q = 0; q < 2; q++)
        for (int l = 0; l < p.n_layers; l++)
            for (int t = 0; t < n_pos[q]; t++) {
                CHECK(kv_entry_offset(&kv, &s[q], l, t) + (size_t) kv.entry[l].bytes <= pool_bytes);
                if (kv.entry[l].index_dim)
                    CHECK(kv_key_page_offset(&kv, &s[q], l, t) + (size_t) kv.entry[l].key_page
                          <= pool_bytes);
                for (int i = 0; i < kv_entry_values(&kv, l); i++)
                    vals[i] = v++;
                kv_store(&kv, &s[q], l, t, 0, vals, kv_entry_values(&kv, l));
            }
    v = 1.0f;
    int bad = 0;
    for (int q = 0; q < 2; q++)
        for (int l = 0; l < p.n_layers; l++)
            for (int t = 0; t < n_pos[q]; t++) {
                const float *e = kv_read(&kv, &s[q], l, t, vals);
                for (int i = 0; i < kv_entry_values(&kv, l); i++)
                    bad += e[i] != v++;
                // fp32: the entry is read in place
                bad += kv_read_entry(&kv, &s[q], l, t, vals) != kv_entry(&kv, &s[q], l, t);
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
    // Blocks of 4: the MLA entry unpadded (the tuned MLA reads blocks of 128); the index key
    // padded 3 -> 16.
    const KvEntryLayout *lo = &kv.entry[2];
    CHECK(lo->value_bytes == 2 && lo->lat_store == 6 && lo->pe_store == 2 && lo->pe == 12
          && lo->bytes == 16 && lo->key_store == 16 && lo->key_bytes == 32
          && lo->key_page == 4 * 32);
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
    // The bytes where the values live, and nothing in the padding: k_pe at lo->pe, the key at
    // the row's start, zeros between.
    const unsigned char *e = kv_entry_bytes(&kv, &s, 2, 5);
    const unsigned char *key = (const unsigned char *) kv.pool
                               + kv_key_page_offset(&kv, &s, 2, 5) + 1 * (size_t) lo->key_bytes;
    CHECK(kv_bf16_load(e + 2 * 3) == -2.5f && kv_bf16_load(e + lo->pe) == got[6]
          && signbit(kv_bf16_load(e + lo->pe + 2)) && kv_bf16_load(key) == 5.0f
          && kv_bf16_load(key + 2) == 6.0f && kv_bf16_load(key + 4) == 7.0f);
    int nonzero = 0;
    for (int i = 2 * 6; i < lo->pe; i++)
        nonzero += e[i] != 0;
    for (int i = lo->pe + 2 * 2; i < lo->bytes; i++)
        nonzero += e[i] != 0;
    for (int i = 2 * 3; i < lo->key_bytes; i++)
        nonzero += key[i] != 0;
    CHECK(nonzero == 0);
    // another position of the same layer is untouched
    got = kv_read(&kv, &s, 2, 4, tmp);
    CHECK(got[0] == 0.0f && got[10] == 0.0f);
    kv_seq_free(&kv, &s);
    kv_free(&kv);
}

// fp8: the byte layout (GLM-5's widths give fp8_ds_mla's 656-byte entry and kernels/dsa.h's
// 16,896-byte key page of 128 keys), the group scales (amax / 448), codes against the E4M3
// encoder, the read-back, a k_pe write alone, and an all-zero group.
static void test_fp8(void)
{
    const KvEntryLayout glm = kv_entry_layout(KV_DTYPE_FP8, 512, 64, 128, 128);
    CHECK(glm.lat_scale == 512 && glm.pe == 528 && glm.bytes == 656);
    CHECK(glm.key_bytes == 128 && glm.key_scales == 128 * 128 && glm.key_page == 16896);
    CHECK(kv_token_bytes(&glm) == 788);
    const KvEntryLayout bf = kv_entry_layout(KV_DTYPE_BF16, 512, 64, 128, 128);
    CHECK(bf.bytes == 1152 && kv_token_bytes(&bf) == 1408);

    // Latent 130 (a group of 128 and one of 2), rope 2, index 3.
    KvCacheParams p = {.n_layers = 2,
                       .block_size = 4,
                       .n_blocks = 3,
                       .kv_lora = 130,
                       .rope_dim = 2,
                       .index_dim = 3,
                       .dtype = KV_DTYPE_FP8};
    p.has_index[1] = true;
    KvCache kv;
    CHECK(kv_init(&kv, &p) == ERR_OK);
    const KvEntryLayout *lo = &kv.entry[1];
    // Blocks of 4: the latent and k_pe unpadded; the key padded to 16.
    CHECK(lo->lat_store == 130 && lo->lat_scale == 132 && lo->pe == 140 && lo->bytes == 144
          && lo->key_store == 16 && lo->key_bytes == 16 && lo->key_scales == 64
          && lo->key_page == 80);
    CHECK(kv.entry[0].bytes == 144 && kv.entry[0].key_page == 0
          && kv.block_bytes == 4 * 144 + 4 * 144 + 80);
    // Blocks of 128 (the tuned MLA's): the latent padded to 512 (4 groups), k_pe to 64:
    // fp8_ds_mla's 656 bytes, and bf16's 1,152 with k_pe at 1,024.
    const KvEntryLayout p8 = kv_entry_layout(KV_DTYPE_FP8, 130, 2, 3, 128);
    CHECK(p8.lat_store == 512 && p8.pe_store == 64 && p8.lat_scale == 512 && p8.pe == 528
          && p8.bytes == 656 && p8.key_store == 16);
    const KvEntryLayout p16 = kv_entry_layout(KV_DTYPE_BF16, 6, 2, 3, 128);
    CHECK(p16.lat_store == 512 && p16.pe == 1024 && p16.bytes == 1152 && p16.key_bytes == 32);
    // A rope wider than 64: nothing to pad for (the tuned MLA cannot take it).
    const KvEntryLayout r96 = kv_entry_layout(KV_DTYPE_FP8, 130, 96, 0, 128);
    CHECK(r96.lat_store == 130 && r96.pe_store == 96);
    // Wider than the kernels' widths: stored as they are.
    const KvEntryLayout wide = kv_entry_layout(KV_DTYPE_FP8, 640, 64, 192, 128);
    CHECK(wide.lat_store == 640 && wide.pe_store == 64 && wide.key_store == 192
          && wide.bytes == 640 + 4 * 5 + 2 * 64);
    const KvEntryLayout f32 = kv_entry_layout(KV_DTYPE_F32, 130, 2, 3, 4);
    CHECK(f32.lat_store == 130 && f32.pe_store == 2 && f32.key_store == 3 && f32.bytes == 4 * 132);
    KvSeq s = {0};
    CHECK(kv_seq_reserve(&kv, &s, 6) == ERR_OK);
    float in[135];
    for (int i = 0; i < 128; i++)
        in[i] = (float) (i - 60) * 0.37f;  // amax 67 * 0.37 at i = 127
    in[128] = 0.0f;
    in[129] = 0.0f;            // an all-zero group: scale 1, codes 0
    in[130] = 1.0f + 0x1p-8f;  // k_pe: bf16, nearest even -> 1
    in[131] = -3.0f;
    in[132] = 0.5f;
    in[133] = -2.0f;
    in[134] = 1.0f;
    kv_store(&kv, &s, 1, 5, 0, in, 135);
    const unsigned char *e = kv_entry_bytes(&kv, &s, 1, 5);
    const unsigned char *page = (const unsigned char *) kv.pool + kv_key_page_offset(&kv, &s, 1, 5);
    const unsigned char *key = page + 1 * lo->key_bytes;  // position 5: row 1 of its block
    float sc[3];
    memcpy(sc, e + lo->lat_scale, 8);
    memcpy(sc + 2, page + lo->key_scales + 4 * 1, 4);
    CHECK(sc[0] == (67 * 0.37f) / 448.0f && sc[1] == 1.0f && sc[2] == 2.0f / 448.0f);
    int bad = 0;
    for (int i = 0; i < 128; i++)
        bad += e[i] != nvfp4_float_to_e4m3(in[i] / sc[0]);
    CHECK(bad == 0);
    CHECK(e[128] == 0 && e[129] == 0);
    // The bytes not written (codes 130, 131 before the 4-byte aligned scales, the key's 3 .. 15:
    // its padding to 16) stay zero, which the kernels read as 0.
    int nonzero = 0;
    for (int i = 130; i < lo->pe; i++)
        nonzero += i < lo->lat_scale + 8 && i >= lo->lat_scale ? 0 : e[i] != 0;
    for (int i = lo->pe + 4; i < lo->bytes; i++)
        nonzero += e[i] != 0;
    for (int i = 3; i < lo->key_bytes; i++)
        nonzero += key[i] != 0;
    CHECK(nonzero == 0);
    CHECK(e[127] == 0x7e);  // the largest value is 448 times its scale
    for (int i = 0; i < 3; i++)
        CHECK(key[i] == nvfp4_float_to_e4m3(in[132 + i] / sc[2]));
    float tmp[135];
    const float *got = kv_read(&kv, &s, 1, 5, tmp);
    double worst = 0.0;
    for (int i = 0; i < 128; i++) {
        CHECK(got[i] == nvfp4_e4m3_to_float(e[i]) * sc[0]);
        const double rel = fabs(got[i] - in[i]) / (67 * 0.37);
        if (rel > worst) worst = rel;
    }
    // E4M3 keeps 3 mantissa bits: within half an ulp, 2^-4 of the value, so at most 2^-4
    // of the group's largest value.
    CHECK(worst > 0.0 && worst <= 0x1p-4);
    CHECK(got[128] == 0.0f && got[129] == 0.0f && got[130] == 1.0f && got[131] == -3.0f);
    for (int i = 132; i < 135; i++)
        CHECK_NEAR(got[i], in[i], 2.0 * 0x1p-4);
    // k_pe written alone; the latent and the index key keep their bytes.
    unsigned char before[144], key_before[4];
    memcpy(before, e, sizeof before);
    memcpy(key_before, key, sizeof key_before);
    const float pe[2] = {7.0f, 0.25f};
    kv_store(&kv, &s, 1, 5, 130, pe, 2);
    got = kv_read(&kv, &s, 1, 5, tmp);
    CHECK(got[130] == 7.0f && got[131] == 0.25f);
    CHECK(memcmp(e, before, (size_t) lo->pe) == 0 && memcmp(key, key_before, 4) == 0);
    // The index key written alone (model.c writes it after the latent and k_pe).
    const float key3[3] = {-448.0f, 1.0f, 0.0f};
    kv_store(&kv, &s, 1, 5, 132, key3, 3);
    got = kv_read(&kv, &s, 1, 5, tmp);
    CHECK(got[132] == -448.0f && got[133] == 1.0f && got[134] == 0.0f && got[130] == 7.0f);
    kv_seq_free(&kv, &s);
    kv_free(&kv);

    KvDtype d;
    CHECK(kv_dtype_parse("fp8", &d) && d == KV_DTYPE_FP8 && !strcmp(kv_dtype_name(d), "fp8"));
    CHECK(kv_dtype_parse("bf16", &d) && d == KV_DTYPE_BF16);
    CHECK(kv_dtype_parse("f32", &d) && d == KV_DTYPE_F32);
    CHECK(!kv_dtype_parse("fp16", &d) && !kv_dtype_parse("", &d));
}

int main(void)
{
    test_accounting();
    test_layout();
    test_bad_params();
    test_bf16();
    test_fp8();
    return check_exit();
}
