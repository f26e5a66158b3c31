/*
 * test_tuned_pack.c - MLA and the DSA indexer of a model narrower than GLM-5 the way the CUDA
 * backend runs them on the tuned kernels, emulated on the host through the kernels' references
 * (kernels/ref), against the CPU backend: the padding (kv_cache.h's entries and keys,
 * engine/backend/tuned_pack.h's packs, q and heads padded, the output cropped) must change
 * nothing. The GPU runs the same packs and the kernels whose references these are
 * (tests/gpu/backend_ops.c, test_mla.c, test_dsa.c).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/tuned_pack.h"
#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "kernels/nvfp4_format.h"
#include "kernels/ref/dsa_ref.h"
#include "kernels/ref/kern_ref.h"
#include "kernels/ref/mla_ref.h"
#include "tests/check.h"
#include "tests/golden/rel_l2.h"

enum { MLA_BF16 = 1, MLA_FP8 = 0 };  // kernels/mla.h MlaCacheType

// MLA at a sweep model's widths (3 heads, q_nope 24, rope 8, v 5, latent 40) as the CUDA
// backend's mla_tuned runs it, emulated on the host with the kernels' reference: q_nope and
// q_pe padded to 192 and 64 and the heads to 32, q_lat = W_UK^T q_nope with tuned_pack.h's
// pack, mla_decode_ref over the padded pages, out = W_UV o_lat cropped to 3 x 5. Against the
// CPU backend's f32 attention over the same cache.
static void test_narrow_mla(KvDtype dtype, int mla_type)
{
    enum { H = 3, NOPE = 24, R = 8, V = 5, L = 40, T = 150, N = 4 };
    const BackendMla mp = {H, NOPE, R, V, L, 0.17f, 0.0f};
    const int Hp = backend_mla_heads(H), Vp = backend_mla_v_rows(&mp);
    CHECK(Hp == 32 && Vp == 8 && backend_mla_shape_tuned(&mp));
    const KvCacheParams p = {.n_layers = 1,
                             .block_size = MLA_BLOCK,
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
    uint16_t *uk = malloc(backend_mla_uk_elems(&mp) * 2),
             *uv = malloc(backend_mla_uv_elems(&mp) * 2);
    float *q_lat = calloc((size_t) N * Hp * MLA_KV_LORA, sizeof *q_lat);
    float *q_pe = calloc((size_t) N * Hp * MLA_ROPE, sizeof *q_pe);
    float *o_lat = malloc((size_t) N * Hp * MLA_KV_LORA * sizeof *o_lat);
    ASSERT(uk && uv && q_lat && q_pe && o_lat);
    CHECK(backend_mla_pack_kv_b(&kv_b, &mp, uk, uv) == ERR_OK);
    for (int t = 0; t < N; t++)
        for (int h = 0; h < Hp; h++) {
            float nope[MLA_QK_NOPE] = {0};
            for (int r = 0; h < H && r < NOPE + R; r++) {
                const float v = q[((size_t) t * H + h) * (NOPE + R) + r];
                if (r < NOPE)
                    nope[r] = v;
                else
                    q_pe[((size_t) t * Hp + h) * MLA_ROPE + r - NOPE] = v;
            }
            for (int c = 0; c < MLA_KV_LORA; c++) {
                double d = 0.0;
                for (int r = 0; r < MLA_QK_NOPE; r++)
                    d += (double) kern_bf16_to_f32(
                             uk[((size_t) h * MLA_KV_LORA + c) * MLA_QK_NOPE + r])
                         * nope[r];
                q_lat[((size_t) t * Hp + h) * MLA_KV_LORA + c] = (float) d;
            }
        }
    mla_decode_ref(o_lat, NULL, NULL, q_lat, q_pe, (const uint8_t *) kv.pool + kv.mla_offset[0],
                   mla_type, s.blocks, s.n_blocks, seq_of, len, NULL, 0, N, Hp, mp.scale);
    float got[N * H * V];
    int padded_nonzero = 0;
    for (int t = 0; t < N; t++)
        for (int h = 0; h < Hp; h++)
            for (int v = 0; v < Vp; v++) {
                double d = 0.0;
                for (int c = 0; c < MLA_KV_LORA; c++)
                    d += (double) kern_bf16_to_f32(uv[((size_t) h * Vp + v) * MLA_KV_LORA + c])
                         * o_lat[((size_t) t * Hp + h) * MLA_KV_LORA + c];
                if (h < H && v < V)
                    got[((size_t) t * H + h) * V + v] = (float) d;
                else  // cropped: zero rows of W_UV
                    padded_nonzero += d != 0.0;
            }
    const double err = golden_rel_l2(got, want, (size_t) N * H * V);
    printf("narrow MLA (%s cache) the CUDA backend's way vs the CPU backend: relative L2 %.3g\n",
           kv_dtype_name(dtype), err);
    // fp32 q_lat and the reference's fp32 decode of the same bytes against the CPU's double
    // sums: about 1e-7.
    float norm = 0.0f;
    for (int i = 0; i < N * H * V; i++)
        norm = fmaxf(norm, fabsf(want[i]));
    CHECK(norm > 0.0f && err < 1e-5);
    CHECK(padded_nonzero == 0);
    free(uk), free(uv), free(q_lat), free(q_pe), free(o_lat), free(w);
    cpu->destroy(cpu);
    kv_seq_free(&kv, &s);
    kv_free(&kv);
}

// The DSA indexer at a sweep model's widths (4 heads of 20) the way the CUDA backend's
// cuda_dsa_topk runs it: q zero-padded to the stored key width (32, kv_cache.h), the kernels'
// reference scores (dsa_scores_ref, over kv_dsa_cache_stored's pages) and top-k
// (dsa_topk_ref): the same keys as the CPU backend's selection (f32 recipe: double scores;
// random data, no near ties at the boundary).
static void test_narrow_dsa(KvDtype dtype)
{
    enum { HI = 4, DI = 20, T = 150, N = 4, TOPK = 8 };
    const KvCacheParams p = {.n_layers = 1,
                             .block_size = 16,
                             .n_blocks = 10,
                             .kv_lora = 8,
                             .rope_dim = 4,
                             .index_dim = DI,
                             .has_index = {true},
                             .dtype = dtype};
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    const BackendDsa dp = {HI, DI, TOPK};
    CHECK(backend_dsa_tuned(&dp, &kv, 0) && kv.entry[0].key_store == 32);
    KvSeq s = {0};
    ASSERT(kv_seq_reserve(&kv, &s, T) == ERR_OK);
    uint64_t rng = 19;
    for (int pos = 0; pos < T; pos++) {
        float key[DI];
        for (int j = 0; j < DI; j++)
            key[j] = kern_rand_uniform(&rng, -2.0f, 2.0f);
        kv_store(&kv, &s, 0, pos, 8 + 4, key, DI);
    }
    const int pos[N] = {20, 77, 128, 149}, seq_of[N] = {0, 0, 0, 0};
    int len[N];
    float q[N * HI * DI], w[N * HI];
    for (int t = 0; t < N; t++)
        len[t] = pos[t] + 1;
    for (int i = 0; i < N * HI * DI; i++)
        q[i] = kern_rand_uniform(&rng, -1.0f, 1.0f);
    for (int i = 0; i < N * HI; i++)
        w[i] = kern_rand_uniform(&rng, -1.0f, 1.0f);
    Backend *cpu = NULL;
    ASSERT(backend_cpu_create(1, &cpu) == ERR_OK);
    KvSeq *seqs[1] = {&s};
    const BackendSeqs bs = {seqs, 1, pos, seq_of, len, N};
    int sel[N * TOPK], n_sel[N];
    cpu->dsa_topk(cpu, sel, n_sel, q, w, &kv, &bs, 0, &dp);
    // The GPU's way.
    const DsaCache c = kv_dsa_cache_stored(&kv, kv.pool, 0);
    float q_pad[N * HI * 32] = {0}, scores[N * T];
    for (int t = 0; t < N * HI; t++)
        memcpy(q_pad + (size_t) t * c.dim, q + (size_t) t * DI, DI * sizeof(float));
    float w_scale, sm_scale;
    backend_dsa_scales(&dp, &w_scale, &sm_scale);
    dsa_scores_ref(scores, NULL, T, q_pad, w, w_scale, sm_scale, &c, s.blocks, s.n_blocks, seq_of,
                   len, N, HI);
    int32_t idx[N * TOPK], n_idx[N];
    dsa_topk_ref(idx, n_idx, scores, T, len, N, TOPK);
    // Both list a row's keys ascending (the CPU's dsa_topk, dsa_topk_ref).
    int differ = 0;
    for (int t = 0; t < N; t++) {
        int bad = n_sel[t] != TOPK || n_idx[t] != TOPK;
        for (int k = 0; k < TOPK; k++)
            bad += sel[t * TOPK + k] != idx[t * TOPK + k];
        differ += bad != 0;
    }
    printf("narrow DSA (%s keys) the CUDA backend's way vs the CPU backend: %d of %d rows "
           "select other keys\n",
           kv_dtype_name(dtype), differ, N);
    CHECK(differ == 0);
    cpu->destroy(cpu);
    kv_seq_free(&kv, &s);
    kv_free(&kv);
}

int main(void)
{
    test_narrow_mla(KV_DTYPE_BF16, MLA_BF16);
    test_narrow_mla(KV_DTYPE_FP8, MLA_FP8);
    test_narrow_dsa(KV_DTYPE_BF16);
    test_narrow_dsa(KV_DTYPE_FP8);
    return check_exit();
}
