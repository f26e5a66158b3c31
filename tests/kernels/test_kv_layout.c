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
 * followed by zeros, its index keys padded to 16s through kernels/dsa_format.h's reader; and
 * its MLA attention, run the way the CUDA backend's mla_tuned runs it (q and heads padded,
 * engine/backend/mla_pack.h's packs, kernels' reference decode over the padded pages, the
 * output cropped), equals the CPU backend's.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/mla_pack.h"
#include "engine/model/backend.h"
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
            const float want = j < L ? e[j] : j >= LATENT && j < LATENT + R ? e[L + j - LATENT] : 0.0f;
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

// MLA at a sweep model's widths (3 heads, q_nope 24, rope 8, v 5, latent 40) as the CUDA
// backend's mla_tuned runs it, emulated on the host with the kernels' reference: q_nope and
// q_pe padded to 192 and 64 and the heads to 32, q_lat = W_UK^T q_nope with mla_pack.h's
// pack, mla_decode_ref over the padded pages, out = W_UV o_lat cropped to 3 x 5. Against the
// CPU backend's f32 attention over the same cache.
static void test_narrow_mla(KvDtype dtype, int mla_type)
{
    enum { H = 3, NOPE = 24, R = 8, V = 5, L = 40, T = 150, N = 4 };
    const BackendMla mp = {H, NOPE, R, V, L, 0.17f};
    const int Hp = backend_mla_heads(H), Vp = backend_mla_v_rows(&mp);
    CHECK(Hp == 32 && Vp == 8 && backend_mla_shape_tuned(&mp));
    const KvCacheParams p = {.n_layers = 1,
                             .block_size = BLOCK,
                             .n_blocks = 2,
                             .kv_lora = L,
                             .rope_dim = R,
                             .dtype = dtype};
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    CHECK(backend_mla_tuned(&mp, &kv.entry[0]));
    KvSeq s = {0};
    ASSERT(kv_seq_reserve(&kv, &s, T) == ERR_OK);
    uint64_t rng = 13;
    for (int pos = 0; pos < T; pos++) {
        float in[L + R];
        for (int j = 0; j < L + R; j++)
            in[j] = kern_rand_uniform(&rng, -2.0f, 2.0f);
        kv_store(&kv, &s, 0, pos, 0, in, L + R);
    }
    // kv_b: bf16 values [H * (NOPE + V), L].
    uint16_t *w = malloc((size_t) H * (NOPE + V) * L * sizeof *w);
    ASSERT(w);
    for (int i = 0; i < H * (NOPE + V) * L; i++)
        w[i] = nvfp4_float_to_bf16(kern_rand_uniform(&rng, -0.5f, 0.5f));
    const CkptLinear kv_b = {CKPT_LINEAR_BF16, H * (NOPE + V), L, w, NULL, NULL, 1.0f, "kv_b"};
    const int pos[N] = {0, 1, 127, 149}, seq_of[N] = {0, 0, 0, 0};
    int len[N];
    float q[N * H * (NOPE + R)];
    for (int t = 0; t < N; t++)
        len[t] = pos[t] + 1;
    for (int i = 0; i < N * H * (NOPE + R); i++)
        q[i] = kern_rand_uniform(&rng, -1.0f, 1.0f);
    Backend *cpu = NULL;
    ASSERT(backend_cpu_create(1, &cpu) == ERR_OK);
    KvSeq *seqs[1] = {&s};
    const BackendSeqs bs = {seqs, 1, pos, seq_of, len, N};
    float want[N * H * V];
    cpu->mla_attention(cpu, want, q, &kv_b, &kv, &bs, 0, NULL, NULL, 0, &mp);
    // The GPU's way.
    uint16_t *uk = malloc(backend_mla_uk_elems(&mp) * 2), *uv = malloc(backend_mla_uv_elems(&mp) * 2);
    float *q_lat = calloc((size_t) N * Hp * LATENT, sizeof *q_lat);
    float *q_pe = calloc((size_t) N * Hp * ROPE, sizeof *q_pe);
    float *o_lat = malloc((size_t) N * Hp * LATENT * sizeof *o_lat);
    ASSERT(uk && uv && q_lat && q_pe && o_lat);
    CHECK(backend_mla_pack_kv_b(&kv_b, &mp, uk, uv) == ERR_OK);
    for (int t = 0; t < N; t++)
        for (int h = 0; h < Hp; h++) {
            float nope[192] = {0};
            for (int r = 0; h < H && r < NOPE + R; r++) {
                const float v = q[((size_t) t * H + h) * (NOPE + R) + r];
                if (r < NOPE)
                    nope[r] = v;
                else
                    q_pe[((size_t) t * Hp + h) * ROPE + r - NOPE] = v;
            }
            for (int c = 0; c < LATENT; c++) {
                double d = 0.0;
                for (int r = 0; r < 192; r++)
                    d += (double) kern_bf16_to_f32(uk[((size_t) h * LATENT + c) * 192 + r]) * nope[r];
                q_lat[((size_t) t * Hp + h) * LATENT + c] = (float) d;
            }
        }
    mla_decode_ref(o_lat, NULL, NULL, q_lat, q_pe, (const uint8_t *) kv.pool + kv.mla_offset[0],
                   mla_type, s.blocks, s.n_blocks, seq_of, len, NULL, 0, N, Hp, mp.scale);
    double num = 0.0, den = 0.0;
    int padded_nonzero = 0;
    for (int t = 0; t < N; t++)
        for (int h = 0; h < Hp; h++)
            for (int v = 0; v < Vp; v++) {
                double d = 0.0;
                for (int c = 0; c < LATENT; c++)
                    d += (double) kern_bf16_to_f32(uv[((size_t) h * Vp + v) * LATENT + c])
                         * o_lat[((size_t) t * Hp + h) * LATENT + c];
                if (h >= H || v >= V) {  // cropped: zero rows of W_UV
                    padded_nonzero += d != 0.0;
                    continue;
                }
                const double r = want[((size_t) t * H + h) * V + v];
                num += (d - r) * (d - r);
                den += r * r;
            }
    printf("narrow MLA (%s cache) the CUDA backend's way vs the CPU backend: relative L2 %.3g\n",
           kv_dtype_name(dtype), sqrt(num / den));
    // fp32 q_lat and the reference's fp32 decode of the same bytes against the CPU's double
    // sums: about 1e-7.
    CHECK(den > 0.0 && sqrt(num / den) < 1e-5);
    CHECK(padded_nonzero == 0);
    free(uk), free(uv), free(q_lat), free(q_pe), free(o_lat), free(w);
    cpu->destroy(cpu);
    kv_seq_free(&kv, &s);
    kv_free(&kv);
}

int main(void)
{
    test_narrow_layout(KV_DTYPE_FP8, MLA_FP8);
    test_narrow_layout(KV_DTYPE_BF16, MLA_BF16);
    test_narrow_mla(KV_DTYPE_BF16, MLA_BF16);
    test_narrow_mla(KV_DTYPE_FP8, MLA_FP8);
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
