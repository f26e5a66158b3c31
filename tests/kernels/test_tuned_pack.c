/*
 * test_tuned_pack.c - a model narrower than GLM-5 the way the CUDA backend runs it on the
 * tuned kernels, emulated on the host through the kernels' references (kernels/ref), against
 * the CPU backend: the padding (kv_cache.h's entries, engine/backend/tuned_pack.h's packs, q,
 * heads and x padded, the outputs cropped) must change nothing. The GPU runs the same packs
 * and kernels whose references these are (tests/gpu/backend_ops.c, test_mla.c, test_moe.c).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/tuned_pack.h"
#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "kernels/nvfp4_format.h"
#include "kernels/ref/kern_ref.h"
#include "kernels/ref/mla_ref.h"
#include "kernels/ref/moe_ref.h"
#include "tests/check.h"

enum { MLA_BF16 = 1, MLA_FP8 = 0 };  // kernels/mla.h MlaCacheType

static double rel_l2(double num, double den)
{
    return den > 0.0 ? sqrt(num / den) : INFINITY;
}

// MLA at a sweep model's widths (3 heads, q_nope 24, rope 8, v 5, latent 40) as the CUDA
// backend's mla_tuned runs it, emulated on the host with the kernels' reference: q_nope and
// q_pe padded to 192 and 64 and the heads to 32, q_lat = W_UK^T q_nope with tuned_pack.h's
// pack, mla_decode_ref over the padded pages, out = W_UV o_lat cropped to 3 x 5. Against the
// CPU backend's f32 attention over the same cache.
static void test_narrow_mla(KvDtype dtype, int mla_type)
{
    enum { H = 3, NOPE = 24, R = 8, V = 5, L = 40, T = 150, N = 4 };
    const BackendMla mp = {H, NOPE, R, V, L, 0.17f};
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
    double num = 0.0, den = 0.0;
    int padded_nonzero = 0;
    for (int t = 0; t < N; t++)
        for (int h = 0; h < Hp; h++)
            for (int v = 0; v < Vp; v++) {
                double d = 0.0;
                for (int c = 0; c < MLA_KV_LORA; c++)
                    d += (double) kern_bf16_to_f32(uv[((size_t) h * Vp + v) * MLA_KV_LORA + c])
                         * o_lat[((size_t) t * Hp + h) * MLA_KV_LORA + c];
                if (h >= H || v >= V) {  // cropped: zero rows of W_UV
                    padded_nonzero += d != 0.0;
                    continue;
                }
                const double r = want[((size_t) t * H + h) * V + v];
                num += (d - r) * (d - r);
                den += r * r;
            }
    printf("narrow MLA (%s cache) the CUDA backend's way vs the CPU backend: relative L2 %.3g\n",
           kv_dtype_name(dtype), rel_l2(num, den));
    // fp32 q_lat and the reference's fp32 decode of the same bytes against the CPU's double
    // sums: about 1e-7.
    CHECK(den > 0.0 && rel_l2(num, den) < 1e-5);
    CHECK(padded_nonzero == 0);
    free(uk), free(uv), free(q_lat), free(q_pe), free(o_lat), free(w);
    cpu->destroy(cpu);
    kv_seq_free(&kv, &s);
    kv_free(&kv);
}

// A random NVFP4 matrix [rows, cols] (host memory, owned by the caller: data and scale).
static CkptLinear rand_nvfp4(uint64_t *rng, int rows, int cols)
{
    uint8_t *q = malloc((size_t) rows * cols / 2), *sc = malloc((size_t) rows * cols / 16);
    ASSERT(q && sc);
    for (size_t i = 0; i < (size_t) rows * cols / 2; i++)
        q[i] = (uint8_t) kern_rand_u64(rng);
    for (size_t i = 0; i < (size_t) rows * cols / 16; i++)
        sc[i] = nvfp4_float_to_e4m3(kern_rand_uniform(rng, 0.02f, 0.2f));
    return (CkptLinear){CKPT_LINEAR_NVFP4, rows, cols, q, sc, NULL, 0.75f, "expert"};
}

// Routed experts at hidden 48, intermediate 16 (a sweep model's), stacked the way
// bind_experts stacks them (backend_nvfp4_pad to 64 and 32: the kernels' multiples of 32), x
// padded, kernels/moe.h's references (moe_w13_ref, then the activations rounded to bf16 as the
// kernel stores them, moe_w2_ref), the sums cropped: against the CPU backend under the bf16
// recipe (which rounds x and the activations alike; the sums' order differs, so a rounding
// to bf16 may flip: the GPU-vs-recipe bound, 1e-3). The padded columns must come out 0.
static void test_narrow_moe(void)
{
    enum { E = 6, K = 3, HID = 48, INTER = 16, HP = 64, IP = 32, N = 7 };
    uint64_t rng = 17;
    CkptLinear ex[3 * E];
    for (int i = 0; i < 3 * E; i++)
        ex[i] = i % 3 == 2 ? rand_nvfp4(&rng, HID, INTER) : rand_nvfp4(&rng, INTER, HID);
    int idx[N * K];
    float wts[N * K], x[N * HID];
    for (int t = 0; t < N; t++)
        for (int j = 0; j < K; j++) {
            idx[t * K + j] = (t + 2 * j) % E;  // K distinct experts a token
            wts[t * K + j] = kern_rand_uniform(&rng, 0.1f, 1.0f);
        }
    for (int i = 0; i < N * HID; i++)
        x[i] = kern_rand_uniform(&rng, -2.0f, 2.0f);
    Backend *cpu = NULL;
    ASSERT(backend_cpu_create(1, &cpu) == ERR_OK);
    cpu->precision = BACKEND_PRECISION_BF16;
    CHECK(backend_moe_tuned(ex, E, K) && cpu->bind_experts(cpu, ex, E) == ERR_OK);
    float want[N * HID];
    cpu->moe(cpu, want, x, N, idx, wts, K, ex, E);
    // The stack: gate rows then up rows per expert (moe.h's q13/s13), down (q2/s2).
    uint8_t *q13 = malloc((size_t) E * 2 * IP * HP / 2),
            *s13 = malloc((size_t) E * 2 * IP * HP / 16);
    uint8_t *q2 = malloc((size_t) E * HP * IP / 2), *s2 = malloc((size_t) E * HP * IP / 16);
    float g13[2 * E], g2[E];
    ASSERT(q13 && s13 && q2 && s2);
    const size_t nq = (size_t) IP * HP / 2, ns = (size_t) IP * HP / 16;
    for (int e = 0; e < E; e++) {
        backend_nvfp4_pad(q13 + (2 * e) * nq, s13 + (2 * e) * ns, &ex[3 * e], IP, HP);
        backend_nvfp4_pad(q13 + (2 * e + 1) * nq, s13 + (2 * e + 1) * ns, &ex[3 * e + 1], IP, HP);
        backend_nvfp4_pad(q2 + e * nq, s2 + e * ns, &ex[3 * e + 2], HP, IP);
        g13[2 * e] = ex[3 * e].global_scale;
        g13[2 * e + 1] = ex[3 * e + 1].global_scale;
        g2[e] = ex[3 * e + 2].global_scale;
    }
    uint16_t xb[N * HP], act16[N * K * IP];
    float act[N * K * IP], out[N * HP];
    for (int t = 0; t < N; t++)
        for (int c = 0; c < HP; c++)
            xb[t * HP + c] = c < HID ? kern_f32_to_bf16(x[t * HID + c]) : 0;
    moe_w13_ref(act, NULL, NULL, NULL, NULL, q13, s13, g13, xb, idx, N, K, HP, IP);
    for (int i = 0; i < N * K * IP; i++)
        act16[i] = kern_f32_to_bf16(act[i]);
    moe_w2_ref(out, NULL, q2, s2, g2, act16, idx, wts, N, K, HP, IP);
    double num = 0.0, den = 0.0;
    int padded_nonzero = 0;
    for (int t = 0; t < N; t++)
        for (int c = 0; c < HP; c++) {
            if (c >= HID) {
                padded_nonzero += out[t * HP + c] != 0.0f;
                continue;
            }
            const double d = (double) out[t * HP + c] - want[t * HID + c];
            num += d * d;
            den += (double) want[t * HID + c] * want[t * HID + c];
        }
    for (int i = 0; i < N * K * IP; i++)  // the padded intermediate columns: SiLU(0) * 0
        padded_nonzero += i % IP >= INTER && act[i] != 0.0f;
    printf("narrow MoE the CUDA backend's way vs the CPU backend (bf16 recipe): relative L2 "
           "%.3g\n",
           rel_l2(num, den));
    CHECK(rel_l2(num, den) < 1e-3);
    CHECK(padded_nonzero == 0);
    for (int i = 0; i < 3 * E; i++)
        free((void *) ex[i].data), free((void *) ex[i].scale);
    free(q13), free(s13), free(q2), free(s2);
    cpu->destroy(cpu);
}

int main(void)
{
    test_narrow_mla(KV_DTYPE_BF16, MLA_BF16);
    test_narrow_mla(KV_DTYPE_FP8, MLA_FP8);
    test_narrow_moe();
    return check_exit();
}
