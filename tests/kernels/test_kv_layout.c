/*
 * test_kv_layout.c - the engine's KV cache (engine/model/kv_cache.h) in the byte layout the
 * tuned kernels read: at GLM-5's widths and block 128, each layer's MLA pages are a
 * kernels/mla.h MlaCache (fp8: MLA_CACHE_FP8, bf16: MLA_BF16) and its key pages are
 * kernels/dsa.h's. Values stored through kv_store at scattered positions of two sequences
 * read back through the kernels' references (mla_cache_read_ref, dsa_key_read_ref) exactly
 * as kv_read_entry / kv_read_key widen them. (kernels/mla.h and dsa.h need the CUDA headers,
 * which a CPU-only build lacks, so their constants are spelled out here: BLOCK 128,
 * latent 512 + rope 64, 656 and 1,152 bytes per token, KEY 128, DSA_BLOCK_BYTES 16,896.)
 *
 * A model narrower than GLM-5 (kv_cache.h's padding): the kernels' reader sees its values
 * followed by zeros, its index keys padded to 16s through kernels/dsa_format.h's reader.
 */
#include <stdlib.h>
#include <string.h>

#include "engine/model/kv_cache.h"
#include "kernels/ref/dsa_ref.h"
#include "kernels/ref/kern_ref.h"
#include "kernels/ref/mla_ref.h"
#include "tests/check.h"

enum {
    BLOCK = 128,      // BLOCK, DSA_BLOCK
    LATENT = 512,     // LATENT
    ROPE = 64,        // ROPE
    LK = 576,         // LK
    KEY = 128,        // KEY
    FP8_TOKEN = 656,  // MLA_FP8_TOKEN_BYTES
    BF16_TOKEN = 1152,
    KEY_PAGE = 128 * 128 + 128 * 4,  // DSA_BLOCK_BYTES
    MLA_FP8 = 0,                     // MLA_CACHE_FP8
    MLA_BF16 = 1,                    // MLA_BF16
};

static void test_layout(KvDtype dtype, int mla_type)
{
    KvCacheParams p = {.n_layers = 2,
                       .block_size = BLOCK,
                       .n_blocks = 5,
                       .kv_lora = LATENT,
                       .rope_dim = ROPE,
                       .index_dim = KEY,
                       .dtype = dtype};
    p.has_index[1] = true;
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    CHECK(kv.entry[0].bytes == (mla_type == MLA_FP8 ? FP8_TOKEN : BF16_TOKEN));
    if (dtype == KV_DTYPE_FP8) CHECK(kv.entry[1].key_page == KEY_PAGE);
    // Two sequences, so that their blocks interleave in the pool (a: 0, 2; b: 1, 3).
    KvSeq a = {0}, b = {0};
    ASSERT(kv_seq_reserve(&kv, &a, 1) == ERR_OK && kv_seq_reserve(&kv, &b, 1) == ERR_OK);
    ASSERT(kv_seq_reserve(&kv, &a, 2 * BLOCK) == ERR_OK);
    ASSERT(kv_seq_reserve(&kv, &b, 2 * BLOCK) == ERR_OK);
    KvSeq *seqs[2] = {&a, &b};
    const int positions[5] = {0, 1, 127, 128, 255};
    uint64_t rng = 7;
    float in[LK + KEY], tmp[LK + KEY], ref[LK];
    int mla_bad = 0, key_bad = 0, checked = 0;
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < 5; i++) {
            const int pos = positions[i];
            for (int l = 0; l < 2; l++) {
                const int n = kv_entry_values(&kv, l);
                for (int j = 0; j < n; j++)
                    in[j] = kern_rand_uniform(&rng, -3.0f, 3.0f);
                kv_store(&kv, seqs[s], l, pos, 0, in, n);
                const int blk = seqs[s]->blocks[pos / BLOCK], row = pos % BLOCK;
                const float *e = kv_read_entry(&kv, seqs[s], l, pos, tmp);
                mla_cache_read_ref(ref, (const uint8_t *) kv.pool + kv.mla_offset[l], mla_type, blk,
                                   row);
                mla_bad += memcmp(ref, e, LK * sizeof(float)) != 0;
                if (l == 1) {
                    const float *k = kv_read_key(&kv, seqs[s], l, pos, tmp);
                    dsa_key_read_ref(ref, (const uint8_t *) kv.pool + kv.key_offset[l], blk, row);
                    key_bad += memcmp(ref, k, KEY * sizeof(float)) != 0;
                }
                checked++;
            }
        }
    CHECK(checked == 20);
    CHECK(mla_bad == 0);
    CHECK(key_bad == 0);
    kv_seq_free(&kv, &a);
    kv_seq_free(&kv, &b);
    kv_free(&kv);
}

// A narrow model's entries (latent 40, rope 8, index 20) through the kernels' readers: the
// values, then zeros to 512 + 64 (MLA) and to 32 (keys).
static void test_narrow_layout(KvDtype dtype, int mla_type)
{
    enum { L = 40, R = 8, DI = 20 };
    KvCacheParams p = {.n_layers = 1,
                       .block_size = BLOCK,
                       .n_blocks = 2,
                       .kv_lora = L,
                       .rope_dim = R,
                       .index_dim = DI,
                       .dtype = dtype};
    p.has_index[0] = true;
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    CHECK(kv.entry[0].bytes == (mla_type == MLA_FP8 ? FP8_TOKEN : BF16_TOKEN)
          && kv.entry[0].key_store == 32);
    KvSeq s = {0};
    ASSERT(kv_seq_reserve(&kv, &s, BLOCK + 2) == ERR_OK);
    uint64_t rng = 11;
    int bad = 0;
    const int positions[3] = {0, 127, 129};
    for (int i = 0; i < 3; i++) {
        const int pos = positions[i], blk = s.blocks[pos / BLOCK], row = pos % BLOCK;
        float in[L + R + DI], tmp[L + R + DI], ref[LK];
        for (int j = 0; j < L + R + DI; j++)
            in[j] = kern_rand_uniform(&rng, -3.0f, 3.0f);
        kv_store(&kv, &s, 0, pos, 0, in, L + R + DI);
        const float *e = kv_read(&kv, &s, 0, pos, tmp);
        mla_cache_read_ref(ref, (const uint8_t *) kv.pool + kv.mla_offset[0], mla_type, blk, row);
        for (int j = 0; j < LK; j++) {
            const float want = j < L                           ? e[j]
                               : j >= LATENT && j < LATENT + R ? e[L + j - LATENT]
                                                               : 0.0f;
            bad += ref[j] != want;
        }
        const DsaCache c = kv_dsa_cache_stored(&kv, kv.pool, 0);
        const uint8_t *page = (const uint8_t *) kv.pool + kv_key_page_offset(&kv, &s, 0, pos);
        const float scale = c.format == DSA_KEY_FP8 ? dsa_key_scale(&c, page, row) : 1.0f;
        for (int j = 0; j < c.dim; j++)
            bad += dsa_key_raw(&c, page, row, j) * scale != (j < DI ? e[L + R + j] : 0.0f);
    }
    CHECK(bad == 0);
    kv_seq_free(&kv, &s);
    kv_free(&kv);
}

int main(void)
{
    test_narrow_layout(KV_DTYPE_FP8, MLA_FP8);
    test_narrow_layout(KV_DTYPE_BF16, MLA_BF16);
    test_layout(KV_DTYPE_FP8, MLA_FP8);
    // bf16: the MLA pages are MLA_BF16's (the key pages of dsa.h are fp8-only).
    KvCacheParams p = {.n_layers = 1,
                       .block_size = BLOCK,
                       .n_blocks = 1,
                       .kv_lora = LATENT,
                       .rope_dim = ROPE,
                       .dtype = KV_DTYPE_BF16};
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    KvSeq s = {0};
    ASSERT(kv_seq_reserve(&kv, &s, 3) == ERR_OK);
    uint64_t rng = 9;
    float in[LK], tmp[LK], ref[LK];
    for (int j = 0; j < LK; j++)
        in[j] = kern_rand_uniform(&rng, -3.0f, 3.0f);
    kv_store(&kv, &s, 0, 2, 0, in, LK);
    mla_cache_read_ref(ref, (const uint8_t *) kv.pool, MLA_BF16, s.blocks[0], 2);
    CHECK(memcmp(ref, kv_read_entry(&kv, &s, 0, 2, tmp), sizeof ref) == 0);
    kv_seq_free(&kv, &s);
    kv_free(&kv);
    return check_exit();
}
