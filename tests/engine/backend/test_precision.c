/*
 * test_precision.c - the CPU backend following the bf16 precision recipe (engine/model/
 * backend.h, docs/precision.md), which the GPU is checked against: it must round exactly the
 * values the recipe names, where it names them, and nothing else.
 *
 *   matmul: with a bf16 weight (columns in 8s or not), bf16(x) is the input: the output
 *           equals the f32 recipe's on the rounded x bit for bit, and differs on x; an f32
 *           weight is untouched, but bound under the recipe it is stored in bf16 and then runs
 *           as a bf16 one; so are f16, FP8 (block scales) and NVFP4 dense weights, each value
 *           ckpt_linear_row's rounded to bf16 (test_bind_formats); under the f32 recipe
 *           binding leaves every format alone.
 *   moe:    NVFP4 experts (any widths) and bf16 ones: x and silu(gate) * up are rounded, so
 *           moe(x) equals moe(bf16(x)) bit for bit and differs from the f32 recipe; f32
 *           experts are untouched; experts not all NVFP4 are bound in bf16 under the recipe
 *           (bind_experts), as the GPU stacks them. With a residual (in place or apart) the
 *           output is residual + the sum, bit for bit.
 *   mla:    at GLM-5's widths over a bf16 cache: q_nope (not q_pe), kv_b and the output latent
 *           are rounded; with Backend.mla_tc and heads in 32s also q_lat, q_pe and each
 *           probability times its fp8 group scale (test_mla_tc).
 *   fused ops: matmul_group (plain and SwiGLU) and kv_write's transform equal the ops they
 *           fuse, bit for bit, as the backend's scratch grows between them.
 *   the tuned-shape predicates: MLA at GLM-5's widths or narrower (stored zero-padded) over
 *           fp8 (656-byte) and bf16 (1,152-byte) entries of 128-position blocks, and nothing
 *           wider; the DSA indexer's (kernels/dsa.cu: index dims up to 128, in 16s on an f32
 *           cache, padded on bf16 and fp8 ones, up to 32 heads; its scores
 *           under the recipe: tests/engine/backend/test_attention.c), and its tensor-core
 *           variant's (Backend.dsa_tc: the same with fp8 or bf16 keys, bf16 recipe only).
 */
#include <stdlib.h>
#include <string.h>

#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/kv_cache.h"
#include "engine/shared/err.h"
#include "kernels/nvfp4_format.h"
#include "tests/check.h"

static unsigned rng = 7;

static float frand(void)
{
    rng = rng * 1103515245u + 12345u;
    return (float) ((rng >> 8) & 0xffff) / 32768.0f - 1.0f;
}

static float *rand_vec(size_t n)
{
    float *v = malloc(n * sizeof *v);
    ASSERT(v);
    for (size_t i = 0; i < n; i++)
        v[i] = frand() * (1.0f + (float) (i % 7));  // not bf16 values
    return v;
}

static float *rounded(const float *x, size_t n)
{
    float *r = malloc(n * sizeof *r);
    ASSERT(r);
    for (size_t i = 0; i < n; i++)
        r[i] = nvfp4_round_bf16(x[i]);
    return r;
}

// y under each recipe for weight w and input x (n tokens).
static void matmul_both(Backend *be, const CkptLinear *w, const float *x, int n, float *y32,
                        float *y16)
{
    be->precision = BACKEND_PRECISION_F32;
    be->matmul(be, y32, w, x, n);
    be->precision = BACKEND_PRECISION_BF16;
    be->matmul(be, y16, w, x, n);
    be->precision = BACKEND_PRECISION_F32;
}

static void test_matmul(Backend *be)
{
    enum { ROWS = 12, N = 3 };
    const int col_cases[2] = {40, 36};  // columns in 8s, and not (the GPU pads those)
    for (int ci = 0; ci < 2; ci++) {
        const int cols = col_cases[ci];
        uint16_t *wb = malloc((size_t) ROWS * cols * 2);
        ASSERT(wb);
        for (int i = 0; i < ROWS * cols; i++)
            wb[i] = nvfp4_float_to_bf16(frand() * 0.1f);
        const CkptLinear w = {.format = CKPT_LINEAR_BF16,
                              .rows = ROWS,
                              .cols = cols,
                              .data = wb,
                              .global_scale = 1.0f,
                              .name = "w"};
        CHECK(backend_matmul_tuned(&w));
        float *x = rand_vec((size_t) N * cols), *xr = rounded(x, (size_t) N * cols);
        float y32[ROWS * N], y16[ROWS * N], yr32[ROWS * N], yr16[ROWS * N];
        matmul_both(be, &w, x, N, y32, y16);
        matmul_both(be, &w, xr, N, yr32, yr16);
        CHECK(memcmp(y16, yr32, sizeof y16) == 0);  // bf16(x) was the input
        CHECK(memcmp(y16, y32, sizeof y16) != 0);   // and x was not one already
        CHECK(memcmp(yr16, yr32, sizeof yr16) == 0);  // rounding a bf16 value changes nothing
        free(x), free(xr), free(wb);
    }
    // An f32 weight is not rounded by the matmul itself, nor its input; bound under the BF16
    // recipe it is stored in bf16 (backend_bind_rounds: GLM-5.2's weights_proj), and then
    // computes as the rounded weight does, input rounded too. Under F32 bind leaves it alone.
    float *wf = rand_vec((size_t) ROWS * 16), *x = rand_vec((size_t) N * 16);
    const CkptLinear w = {.format = CKPT_LINEAR_F32,
                          .rows = ROWS,
                          .cols = 16,
                          .data = wf,
                          .global_scale = 1.0f,
                          .name = "w"};
    CHECK(!backend_matmul_tuned(&w));
    float y32[ROWS * N], y16[ROWS * N];
    matmul_both(be, &w, x, N, y32, y16);
    CHECK(memcmp(y16, y32, sizeof y16) == 0);
    CkptLinear wb32 = w, wb16 = w;
    CHECK(be->bind_linear(be, &wb32) == ERR_OK && wb32.format == CKPT_LINEAR_F32
          && wb32.data == wf);
    be->precision = BACKEND_PRECISION_BF16;
    CHECK(backend_bind_rounds(be, &wb16) && be->bind_linear(be, &wb16) == ERR_OK);
    be->precision = BACKEND_PRECISION_F32;
    CHECK(wb16.format == CKPT_LINEAR_BF16 && wb16.data != wf && backend_matmul_tuned(&wb16));
    int wrong = 0;
    for (int i = 0; i < ROWS * 16; i++)
        wrong += ((const uint16_t *) wb16.data)[i] != nvfp4_float_to_bf16(wf[i]);
    CHECK(wrong == 0);
    float *xr = rounded(x, (size_t) N * 16), z32[ROWS * N], z16[ROWS * N];
    matmul_both(be, &wb16, x, N, z32, z16);
    matmul_both(be, &wb16, xr, N, y32, y16);
    CHECK(memcmp(z16, y32, sizeof z16) == 0);  // bf16(x) times the bf16 weight
    free(wf), free(x), free(xr);  // wb16's copy belongs to the backend
}

// Random NVFP4 [rows, cols] (host memory, released with free_nvfp4).
static CkptLinear nvfp4(int rows, int cols)
{
    uint8_t *q = malloc((size_t) rows * cols / 2), *s = malloc((size_t) rows * cols / 16);
    ASSERT(q && s);
    for (int i = 0; i < rows * cols / 2; i++)
        q[i] = (uint8_t) (rand() & 0xff);
    for (int i = 0; i < rows * cols / 16; i++)
        s[i] = (uint8_t) (0x28 + rand() % 0x18);
    return (CkptLinear){.format = CKPT_LINEAR_NVFP4,
                        .rows = rows,
                        .cols = cols,
                        .data = q,
                        .scale = s,
                        .global_scale = 0.0123f,
                        .name = "expert"};
}

// The recipe's rounding in moe() on experts ex [3 E] (HID 64, INTER 32, top-2 of 4, 3
// tokens): x enters as bf16(x) (bit for bit) and was not one already, and silu(gate) * up is
// rounded too (the f32 recipe on bf16(x) differs from the bf16 one).
static void check_moe_rounds(Backend *be, const CkptLinear *ex)
{
    enum { E = 4, K = 2, HID = 64, N = 3 };
    const int idx[N * K] = {0, 2, 1, 3, 0, 3};
    const float wts[N * K] = {0.6f, 0.4f, 0.7f, 0.3f, 0.5f, 0.5f};
    float *x = rand_vec((size_t) N * HID), *xr = rounded(x, (size_t) N * HID);
    float o32[N * HID], o16[N * HID], or16[N * HID], or32[N * HID];
    be->moe(be, o32, x, N, idx, wts, K, ex, E, NULL);
    be->moe(be, or32, xr, N, idx, wts, K, ex, E, NULL);
    be->precision = BACKEND_PRECISION_BF16;
    be->moe(be, o16, x, N, idx, wts, K, ex, E, NULL);
    be->moe(be, or16, xr, N, idx, wts, K, ex, E, NULL);
    be->precision = BACKEND_PRECISION_F32;
    CHECK(memcmp(o16, or16, sizeof o16) == 0);
    CHECK(memcmp(o16, o32, sizeof o16) != 0);
    CHECK(memcmp(or16, or32, sizeof or16) != 0);
    // With a residual (in place, and apart): residual + the sum, bit for bit, under both
    // recipes.
    for (int recipe = 0; recipe < 2; recipe++) {
        float res[N * HID], apart[N * HID], want[N * HID];
        for (int i = 0; i < N * HID; i++) {
            res[i] = x[i] * 3.0f + 0.25f;
            want[i] = res[i] + (recipe ? o16 : o32)[i];
        }
        be->precision = recipe ? BACKEND_PRECISION_BF16 : BACKEND_PRECISION_F32;
        be->moe(be, apart, x, N, idx, wts, K, ex, E, res);
        be->moe(be, res, x, N, idx, wts, K, ex, E, res);
        be->precision = BACKEND_PRECISION_F32;
        CHECK(memcmp(res, want, sizeof want) == 0);
        CHECK(memcmp(apart, want, sizeof want) == 0);
    }
    free(x), free(xr);
}

static void test_moe(Backend *be)
{
    enum { E = 4, K = 2, HID = 64, INTER = 32 };
    CkptLinear ex[3 * E];
    for (int e = 0; e < E; e++) {
        ex[3 * e] = nvfp4(INTER, HID);
        ex[3 * e + 1] = nvfp4(INTER, HID);
        ex[3 * e + 2] = nvfp4(HID, INTER);
    }
    CHECK(backend_moe_tuned(ex, E, K) && !backend_moe_tuned(ex, E, 17));
    check_moe_rounds(be, ex);
    for (int i = 0; i < 3 * E; i++) {
        free((void *) ex[i].data);
        free((void *) ex[i].scale);
    }
}

// Random weight of format f [rows, cols] in host memory (f16 / FP8 with 128x128 block scales /
// NVFP4), released with free_weight.
static CkptLinear weight_of(CkptLinearFormat f, int rows, int cols)
{
    CkptLinear w = {.format = f, .rows = rows, .cols = cols, .global_scale = 1.0f, .name = "w"};
    const size_t n = (size_t) rows * (size_t) cols;
    if (f == CKPT_LINEAR_F16) {
        uint16_t *d = malloc(n * 2);
        ASSERT(d);
        for (size_t i = 0; i < n; i++)
            d[i] = (uint16_t) ((rand() & 0x8000) | (0x2c00 + rand() % 0x7ff));
        w.data = d;
    } else if (f == CKPT_LINEAR_FP8) {
        uint8_t *d = malloc(n);
        float *sc = malloc(sizeof(float) * (size_t) ((rows + 127) / 128) * ((cols + 127) / 128));
        ASSERT(d && sc);
        for (size_t i = 0; i < n; i++)
            d[i] = (uint8_t) ((rand() & 0x80) | (0x20 + rand() % 0x30));
        for (int i = 0; i < ((rows + 127) / 128) * ((cols + 127) / 128); i++)
            sc[i] = 0.013f + 0.007f * (float) i;  // not powers of two: the products need rounding
        w.data = d;
        w.scale_f32 = sc;
    } else {
        w = nvfp4(rows, cols);
        w.name = "w";
    }
    return w;
}

static void free_weight(CkptLinear *w)
{
    free((void *) w->data);
    free((void *) w->scale);
    free((void *) w->scale_f32);
}

static void test_bind_formats(Backend *be)
{
    const CkptLinearFormat formats[3] = {CKPT_LINEAR_F16, CKPT_LINEAR_FP8, CKPT_LINEAR_NVFP4};
    for (int fi = 0; fi < 3; fi++) {
        enum { ROWS = 130, COLS = 144 };  // FP8: two row blocks, two column blocks
        CkptLinear w = weight_of(formats[fi], ROWS, COLS), w32 = w, w16 = w;
        CHECK(!backend_matmul_tuned(&w));
        CHECK(be->bind_linear(be, &w32) == ERR_OK && w32.format == w.format && w32.data == w.data);
        be->precision = BACKEND_PRECISION_BF16;
        CHECK(backend_bind_rounds(be, &w16) && be->bind_linear(be, &w16) == ERR_OK);
        be->precision = BACKEND_PRECISION_F32;
        CHECK(w16.format == CKPT_LINEAR_BF16 && backend_matmul_tuned(&w16) && !w16.scale
              && !w16.scale_f32);
        float row[COLS];
        int wrong = 0, inexact = 0;
        for (int r = 0; r < ROWS; r++) {
            ckpt_linear_row(&w, r, row);
            for (int c = 0; c < COLS; c++) {
                const uint16_t b = ((const uint16_t *) w16.data)[r * COLS + c];
                wrong += b != nvfp4_float_to_bf16(row[c]);
                inexact += nvfp4_round_bf16(row[c]) != row[c];
            }
        }
        CHECK(wrong == 0);
        // FP8 times its block scale needs the rounding (f16 too: 11 significant bits).
        if (formats[fi] != CKPT_LINEAR_NVFP4) CHECK(inexact > 0);
        free_weight(&w);  // w16's copy belongs to the backend
    }
}

// bf16 experts run the recipe as NVFP4 ones do; experts not all NVFP4 are bound in bf16.
static void test_moe_bf16(Backend *be)
{
    enum { E = 4, K = 2, HID = 64, INTER = 32 };
    CkptLinear ex[3 * E];
    uint16_t *store[3 * E];
    for (int i = 0; i < 3 * E; i++) {
        const int rows = i % 3 == 2 ? HID : INTER, cols = i % 3 == 2 ? INTER : HID;
        store[i] = malloc((size_t) rows * cols * 2);
        ASSERT(store[i]);
        for (int j = 0; j < rows * cols; j++)
            store[i][j] = nvfp4_float_to_bf16(frand() * 0.2f);
        ex[i] = (CkptLinear){.format = CKPT_LINEAR_BF16,
                             .rows = rows,
                             .cols = cols,
                             .data = store[i],
                             .global_scale = 1.0f,
                             .name = "expert"};
    }
    CHECK(backend_moe_tuned(ex, E, K) && !backend_experts_nvfp4(ex, E));
    check_moe_rounds(be, ex);

    // NVFP4 experts but one FP8: bound one by one, in bf16 under the recipe (values as
    // ckpt_linear_row decodes them), untouched under the f32 one.
    CkptLinear mix[3 * E], m32[3 * E], m16[3 * E];
    for (int i = 0; i < 3 * E; i++) {
        const int rows = i % 3 == 2 ? HID : INTER, cols = i % 3 == 2 ? INTER : HID;
        mix[i] = weight_of(i / 3 == 1 ? CKPT_LINEAR_FP8 : CKPT_LINEAR_NVFP4, rows, cols);
    }
    memcpy(m32, mix, sizeof mix);
    memcpy(m16, mix, sizeof mix);
    CHECK(!backend_moe_tuned(mix, E, K));
    CHECK(be->bind_experts(be, m32, E) == ERR_OK && memcmp(m32, mix, sizeof mix) == 0);
    be->precision = BACKEND_PRECISION_BF16;
    CHECK(be->bind_experts(be, m16, E) == ERR_OK);
    be->precision = BACKEND_PRECISION_F32;
    CHECK(backend_moe_tuned(m16, E, K));
    int wrong = 0;
    float row[HID];
    for (int i = 0; i < 3 * E; i++)
        for (int r = 0; r < mix[i].rows; r++) {
            ckpt_linear_row(&mix[i], r, row);
            for (int c = 0; c < mix[i].cols; c++)
                wrong += ((const uint16_t *) m16[i].data)[r * mix[i].cols + c]
                         != nvfp4_float_to_bf16(row[c]);
        }
    CHECK(wrong == 0);
    // All NVFP4: read in place under either recipe.
    CkptLinear all4[3 * E];
    for (int i = 0; i < 3 * E; i++)
        all4[i] = mix[i / 3 == 1 ? i - 3 : i];
    CkptLinear a16[3 * E];
    memcpy(a16, all4, sizeof all4);
    be->precision = BACKEND_PRECISION_BF16;
    CHECK(be->bind_experts(be, a16, E) == ERR_OK && memcmp(a16, all4, sizeof all4) == 0);
    be->precision = BACKEND_PRECISION_F32;
    for (int i = 0; i < 3 * E; i++) {
        free(store[i]);
        free_weight(&mix[i]);
    }
}

// A one-layer cache at GLM-5's MLA widths (latent 512 + 64, blocks of 128) holding one
// sequence of 3 positions with random latents, written by be; *seqs = seq. Returns the 3
// tokens' view (positions 0, 1, 2) for mla_attention.
enum { GLM_T = 3 };
static const int glm_pos[GLM_T] = {0, 1, 2}, glm_seq_of[GLM_T] = {0, 0, 0},
                 glm_len[GLM_T] = {1, 2, 3};
static BackendSeqs glm_cache(Backend *be, KvCache *kv, KvSeq *seq, KvSeq **seqs, KvDtype dtype)
{
    const KvCacheParams kp = {.n_layers = 1,
                              .block_size = 128,
                              .n_blocks = 1,
                              .kv_lora = 512,
                              .rope_dim = 64,
                              .dtype = dtype};
    ASSERT(kv_init(kv, &kp) == ERR_OK && kv_seq_reserve(kv, seq, GLM_T) == ERR_OK);
    *seqs = seq;
    const BackendSeqs s = {seqs, 1, glm_pos, glm_seq_of, glm_len, GLM_T};
    float *lat = rand_vec((size_t) GLM_T * (512 + 64));
    be->kv_write(be, kv, &s, 0, 0, lat, 512 + 64, NULL);
    free(lat);
    return s;
}

// An fp32 kv_b at GLM-5's widths (qk_nope 192, latent 512) over the weights w [H (192 + v), 512].
static CkptLinear glm_kv_b(float *w, int H, int v)
{
    return (CkptLinear){.format = CKPT_LINEAR_F32,
                        .rows = H * (192 + v),
                        .cols = 512,
                        .data = w,
                        .global_scale = 1.0f,
                        .name = "kv_b"};
}

// MLA at GLM-5's widths (16 heads) over a bf16 cache of 3 positions: under the bf16 recipe
// q_nope is rounded (q_pe is not), kv_b is read rounded, and the output latent is rounded.
static void test_mla(Backend *be)
{
    enum { H = 16, NOPE = 192, ROPE = 64, V = 32, L = 512, T = GLM_T, QK = NOPE + ROPE };
    const BackendMla p = {H, NOPE, ROPE, V, L, 0.0625f, 0.0f};
    KvCache kv;
    KvSeq seq = {0}, *seqs[1];
    const BackendSeqs s = glm_cache(be, &kv, &seq, seqs, KV_DTYPE_BF16);
    CHECK(backend_mla_tuned(&p, &kv.entry[0]));

    const size_t nq = (size_t) T * H * QK, nw = (size_t) H * (NOPE + V) * L;
    float *q = rand_vec(nq), *q_nope_r = malloc(nq * sizeof *q), *q_pe_r = malloc(nq * sizeof *q);
    ASSERT(q_nope_r && q_pe_r);
    for (size_t i = 0; i < nq; i++) {
        const bool is_nope = i % QK < NOPE;
        q_nope_r[i] = is_nope ? nvfp4_round_bf16(q[i]) : q[i];
        q_pe_r[i] = is_nope ? q[i] : nvfp4_round_bf16(q[i]);
    }
    float *w = rand_vec(nw), *w_r = malloc(nw * sizeof *w_r);
    ASSERT(w_r);
    for (size_t i = 0; i < nw; i++) {
        w[i] *= 0.05f;
        w_r[i] = nvfp4_round_bf16(w[i]);
    }
    const CkptLinear kv_b = glm_kv_b(w, H, V);
    CkptLinear kv_b_r = kv_b;
    kv_b_r.data = w_r;
    const size_t no = (size_t) T * H * V;
    float *o16 = malloc(no * 4), *o_nope = malloc(no * 4), *o_pe = malloc(no * 4),
          *o_w = malloc(no * 4), *o32 = malloc(no * 4), *o32_r = malloc(no * 4);
    ASSERT(o16 && o_nope && o_pe && o_w && o32 && o32_r);
    be->precision = BACKEND_PRECISION_BF16;
    be->mla_attention(be, o16, q, &kv_b, &kv, &s, 0, NULL, NULL, 1, &p);
    be->mla_attention(be, o_nope, q_nope_r, &kv_b, &kv, &s, 0, NULL, NULL, 1, &p);
    be->mla_attention(be, o_pe, q_pe_r, &kv_b, &kv, &s, 0, NULL, NULL, 1, &p);
    be->mla_attention(be, o_w, q, &kv_b_r, &kv, &s, 0, NULL, NULL, 1, &p);
    be->precision = BACKEND_PRECISION_F32;
    be->mla_attention(be, o32, q, &kv_b, &kv, &s, 0, NULL, NULL, 1, &p);
    be->mla_attention(be, o32_r, q_nope_r, &kv_b_r, &kv, &s, 0, NULL, NULL, 1, &p);
    CHECK(memcmp(o16, o_nope, no * 4) == 0);  // q_nope entered rounded
    CHECK(memcmp(o16, o_pe, no * 4) != 0);    // q_pe did not
    CHECK(memcmp(o16, o_w, no * 4) == 0);     // kv_b read rounded
    CHECK(memcmp(o16, o32, no * 4) != 0);
    // The same bf16 inputs through the f32 recipe: position 0 attends to itself alone, so
    // its latent is a cached bf16 row and rounds to itself (equal); later positions mix rows
    // and their rounded latent differs.
    const size_t head0 = (size_t) H * V;
    CHECK(memcmp(o16, o32_r, head0 * 4) == 0);
    CHECK(memcmp(o16 + head0, o32_r + head0, (no - head0) * 4) != 0);
    free(q), free(q_nope_r), free(q_pe_r), free(w), free(w_r);
    free(o16), free(o_nope), free(o_pe), free(o_w), free(o32), free(o32_r);
    kv_seq_free(&kv, &seq);
    kv_free(&kv);
}

// The tensor-core variant (Backend.mla_tc, backend_mla_tc): only under the bf16 recipe, at
// GLM-5's widths with heads in 32s. Its probabilities 2^(x - ceil(max x)) (kernels/
// mla_format.h) are rounded to bf16, so even position 0, which attends to itself alone, differs
// from the plain recipe (its p is in (1/2, 1]); every output stays within a few bf16 roundings
// of the plain recipe's. 16 heads keep the plain recipe.
static void test_mla_tc(Backend *be)
{
    enum { NOPE = 192, ROPE = 64, V = 32, L = 512, T = GLM_T, QK = NOPE + ROPE };
    const int heads[2] = {32, 16};
    const KvDtype dtypes[2] = {KV_DTYPE_BF16, KV_DTYPE_FP8};
    for (int hi = 0; hi < 2; hi++)
        for (int d = 0; d < 2; d++) {
            const int H = heads[hi];
            const BackendMla p = {H, NOPE, ROPE, V, L, 0.0625f, 0.0f};
            KvCache kv;
            KvSeq seq = {0}, *seqs[1];
            const BackendSeqs s = glm_cache(be, &kv, &seq, seqs, dtypes[d]);
            const size_t nq = (size_t) T * H * QK, nw = (size_t) H * (NOPE + V) * L;
            float *q = rand_vec(nq), *w = rand_vec(nw);
            for (size_t i = 0; i < nw; i++)
                w[i] *= 0.05f;
            const CkptLinear kv_b = glm_kv_b(w, H, V);
            const size_t no = (size_t) T * H * V, head0 = (size_t) H * V;
            float *o_tc = malloc(no * 4), *o16 = malloc(no * 4), *o32 = malloc(no * 4);
            ASSERT(o_tc && o16 && o32);
            be->precision = BACKEND_PRECISION_BF16;
            be->mla_tc = true;
            CHECK(backend_mla_tc(be, &p, &kv.entry[0]) == (H % 32 == 0));
            be->mla_attention(be, o_tc, q, &kv_b, &kv, &s, 0, NULL, NULL, 1, &p);
            be->mla_tc = false;
            CHECK(!backend_mla_tc(be, &p, &kv.entry[0]));
            be->mla_attention(be, o16, q, &kv_b, &kv, &s, 0, NULL, NULL, 1, &p);
            be->precision = BACKEND_PRECISION_F32;
            be->mla_tc = true;  // no effect under the f32 recipe
            CHECK(!backend_mla_tc(be, &p, &kv.entry[0]));
            be->mla_attention(be, o32, q, &kv_b, &kv, &s, 0, NULL, NULL, 1, &p);
            be->mla_tc = false;
            be->precision = BACKEND_PRECISION_F32;
            if (H % 32) {
                CHECK(memcmp(o_tc, o16, no * 4) == 0);
            } else {
                CHECK(memcmp(o_tc, o16, head0 * 4) != 0);
                CHECK(memcmp(o_tc + head0, o16 + head0, (no - head0) * 4) != 0);
                double num = 0.0, den = 0.0;  // q_lat, q_pe and p rounded: ~3 x 2^-9 each
                for (size_t i = 0; i < no; i++) {
                    num += ((double) o_tc[i] - o16[i]) * ((double) o_tc[i] - o16[i]);
                    den += (double) o16[i] * o16[i];
                }
                CHECK(sqrt(num / den) < 0x1p-7);
            }
            CHECK(memcmp(o_tc, o32, no * 4) != 0);
            free(q), free(w), free(o_tc), free(o16), free(o32);
            kv_seq_free(&kv, &seq);
            kv_free(&kv);
        }
}

// MLA on the tuned kernels: GLM-5's widths, and narrower ones (stored zero-padded to them,
// kv_cache.h), over an fp8 or bf16 cache of 128-position blocks; not a wider latent, rope or
// q_nope, an f32 cache or other blocks.
static void test_mla_predicate(void)
{
    const BackendMla glm = {64, 192, 64, 256, 512, 0.0625f, 0.0f};
    const BackendMla small = {4, 24, 16, 20, 144, 0.2f, 0.0f}, sweep = {3, 33, 4, 5, 24, 0.2f, 0.0f};
    const BackendMla wide_lat = {16, 192, 64, 256, 576, 0.1f, 0.0f},
                     wide_rope = {16, 192, 96, 256, 512, 0.1f, 0.0f},
                     wide_nope = {16, 256, 64, 256, 512, 0.1f, 0.0f};
    CHECK(backend_mla_shape_tuned(&glm) && backend_mla_shape_tuned(&small)
          && backend_mla_shape_tuned(&sweep));
    CHECK(!backend_mla_shape_tuned(&wide_lat) && !backend_mla_shape_tuned(&wide_rope)
          && !backend_mla_shape_tuned(&wide_nope));
    // Heads: in 16s as they are (the CUDA-core kernel's CTA), others padded to 32s.
    CHECK(backend_mla_heads(64) == 64 && backend_mla_heads(16) == 16 && backend_mla_heads(4) == 32
          && backend_mla_heads(33) == 64);
    const BackendMla *shapes[3] = {&glm, &small, &sweep};
    const KvDtype dtypes[3] = {KV_DTYPE_FP8, KV_DTYPE_BF16, KV_DTYPE_F32};
    const int blocks[2] = {128, 16};
    for (int i = 0; i < 3; i++)
        for (int d = 0; d < 3; d++)
            for (int b = 0; b < 2; b++) {
                const KvCacheParams p = {.n_layers = 1,
                                         .block_size = blocks[b],
                                         .n_blocks = 1,
                                         .kv_lora = shapes[i]->kv_lora,
                                         .rope_dim = shapes[i]->qk_rope,
                                         .dtype = dtypes[d]};
                KvCache kv;
                ASSERT(kv_init(&kv, &p) == ERR_OK);
                const bool want = dtypes[d] != KV_DTYPE_F32 && blocks[b] == 128;
                CHECK(backend_mla_tuned(shapes[i], &kv.entry[0]) == want);
                kv_free(&kv);
            }
    const KvCacheParams pw = {.n_layers = 1,
                              .block_size = 128,
                              .n_blocks = 1,
                              .kv_lora = 576,
                              .rope_dim = 64,
                              .dtype = KV_DTYPE_FP8};
    KvCache kv;
    ASSERT(kv_init(&kv, &pw) == ERR_OK);
    CHECK(!backend_mla_tuned(&wide_lat, &kv.entry[0]));
    kv_free(&kv);
}

// DSA under the recipe (kernels/dsa.cu's fp32 scores): GLM-5's indexer (32 heads of 128) on
// each cache type and block size, a small model's (4 of 32), and one outside 16s (4 of 24) on
// a bf16 or fp8 cache, which stores its keys padded to 32; not on an f32 cache (unpadded), not
// past 128 dims or 32 heads, nor on a layer without an indexer key.
static void test_dsa_predicate(Backend *be)
{
    const BackendDsa glm = {32, 128, 2048}, small = {4, 32, 8}, odd = {4, 24, 8},
                     wide = {4, 144, 8}, many = {33, 128, 8};
    const KvDtype dtypes[3] = {KV_DTYPE_FP8, KV_DTYPE_BF16, KV_DTYPE_F32};
    const int blocks[2] = {128, 16};
    const BackendDsa *dsa[5] = {&glm, &small, &odd, &wide, &many};
    const bool want[5] = {true, true, false, false, false};
    for (int d = 0; d < 3; d++)
        for (int b = 0; b < 2; b++)
            for (int i = 0; i < 5; i++) {
                KvCacheParams p = {.n_layers = 2,
                                   .block_size = blocks[b],
                                   .n_blocks = 3,
                                   .kv_lora = 512,
                                   .rope_dim = 64,
                                   .index_dim = dsa[i]->head_dim,
                                   .dtype = dtypes[d]};
                p.has_index[1] = true;
                KvCache kv;
                ASSERT(kv_init(&kv, &p) == ERR_OK);
                const bool tuned = want[i] || (i == 2 && dtypes[d] != KV_DTYPE_F32);
                CHECK(backend_dsa_tuned(dsa[i], &kv, 1) == tuned);
                CHECK(!backend_dsa_tuned(dsa[i], &kv, 0));
                // The tensor-core scores (Backend.dsa_tc): bf16 recipe, fp8 or bf16 keys.
                be->precision = BACKEND_PRECISION_BF16;
                be->dsa_tc = true;
                CHECK(backend_dsa_tc(be, dsa[i], &kv, 1) == (tuned && dtypes[d] != KV_DTYPE_F32));
                CHECK(!backend_dsa_tc(be, dsa[i], &kv, 0));
                be->dsa_tc = false;
                CHECK(!backend_dsa_tc(be, dsa[i], &kv, 1));
                be->precision = BACKEND_PRECISION_F32;
                be->dsa_tc = true;
                CHECK(!backend_dsa_tc(be, dsa[i], &kv, 1));
                be->dsa_tc = false;
                kv_free(&kv);
            }
}

// The fused ops under the recipe, on a fresh backend so that its scratch grows between them
// (the sanitizer build runs this): matmul_group (a plain product and a SwiGLU pair) equals
// matmul, matmul and silu_mul bit for bit; a wider matmul (its rounded input outgrows the
// earlier scratch) in between; kv_write with a transform equals the ops on a copy, src left as
// it was; then the group again, unchanged.
static void test_fused_ops(void)
{
    Backend *be = NULL;
    ASSERT(backend_cpu_create(2, &be) == ERR_OK);
    be->precision = BACKEND_PRECISION_BF16;
    enum { N = 5, ROWS = 24, COLS = 40, WIDE = 520, L = 40, R = 8 };
    float *wg = rand_vec(ROWS * COLS), *wu = rand_vec(ROWS * COLS), *ww = rand_vec(ROWS * WIDE);
    const CkptLinear gate = {CKPT_LINEAR_F32, ROWS, COLS, wg, NULL, NULL, 1.0f, "gate"},
                     up = {CKPT_LINEAR_F32, ROWS, COLS, wu, NULL, NULL, 1.0f, "up"},
                     wide = {CKPT_LINEAR_F32, ROWS, WIDE, ww, NULL, NULL, 1.0f, "wide"};
    CkptLinear g = gate, u = up, wd = wide;
    CHECK(be->bind_linear(be, &g) == ERR_OK && be->bind_linear(be, &u) == ERR_OK
          && be->bind_linear(be, &wd) == ERR_OK);
    float *x = rand_vec(N * COLS), *xw = rand_vec(N * WIDE);
    float y0[N * ROWS], y1[N * ROWS], a[N * ROWS], b[N * ROWS], yw[N * ROWS];
    for (int pass = 0; pass < 2; pass++) {
        const BackendProduct p[2] = {{y0, &g, NULL}, {y1, &g, &u}};
        be->matmul_group(be, p, 2, x, N);
        be->matmul(be, a, &g, x, N);
        be->matmul(be, b, &u, x, N);
        be->silu_mul(be, b, a, b, N * ROWS);
        CHECK(memcmp(y0, a, sizeof a) == 0 && memcmp(y1, b, sizeof b) == 0);
        be->matmul(be, yw, &wd, xw, N);  // grows the rounded-input scratch past the group's
        // kv_write with RMSNorm on the latent and RoPE on k_pe, against the ops on a copy.
        KvCacheParams kp = {.n_layers = 1, .block_size = 4, .n_blocks = 2, .kv_lora = L,
                            .rope_dim = R, .dtype = KV_DTYPE_BF16};
        KvCache k1, k2;
        ASSERT(kv_init(&k1, &kp) == ERR_OK && kv_init(&k2, &kp) == ERR_OK);
        KvSeq s1 = {0}, s2 = {0};
        ASSERT(kv_seq_reserve(&k1, &s1, N) == ERR_OK && kv_seq_reserve(&k2, &s2, N) == ERR_OK);
        int pos[N], seq_of[N] = {0}, len[N];
        for (int t = 0; t < N; t++) pos[t] = t, len[t] = t + 1;
        KvSeq *q1[1] = {&s1}, *q2[1] = {&s2};
        const BackendSeqs b1 = {q1, 1, pos, seq_of, len, N}, b2 = {q2, 1, pos, seq_of, len, N};
        float *src = rand_vec(N * (L + R)), *copy = malloc(N * (L + R) * sizeof *copy);
        float *nw = rand_vec(L);
        ASSERT(copy);
        memcpy(copy, src, N * (L + R) * sizeof *copy);
        const KvIn in = {nw, NULL, L, 1e-6f, L, R, 10000.0f};
        be->kv_write(be, &k1, &b1, 0, 0, src, L + R, &in);
        CHECK(memcmp(src, copy, N * (L + R) * sizeof *copy) == 0);
        be->rmsnorm(be, copy, copy, nw, N, L, L + R, 1e-6f);
        be->rope(be, copy, N, 1, L + R, 0, L, R, pos, 10000.0f);
        be->kv_write(be, &k2, &b2, 0, 0, copy, L + R, NULL);
        CHECK(memcmp(k1.pool, k2.pool, k1.block_bytes * (size_t) kp.n_blocks) == 0);
        kv_seq_free(&k1, &s1);
        kv_seq_free(&k2, &s2);
        kv_free(&k1);
        kv_free(&k2);
        free(src), free(copy), free(nw);
    }
    free(wg), free(wu), free(ww), free(x), free(xw);
    be->destroy(be);
}

int main(void)
{
    Backend *be = NULL;
    ASSERT(backend_cpu_create(2, &be) == ERR_OK);
    CHECK(be->precision == BACKEND_PRECISION_F32);  // the CPU's default: the reference
    test_matmul(be);
    test_moe(be);
    test_bind_formats(be);
    test_moe_bf16(be);
    test_mla(be);
    test_mla_tc(be);
    test_mla_predicate();
    test_dsa_predicate(be);
    test_fused_ops();
    be->destroy(be);
    return check_exit();
}
