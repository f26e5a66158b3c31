/*
 * mkmodel.c - small random GlmMoeDsa checkpoints in the real on-disk layout (see mkmodel.h).
 *
 * The writer first lists every tensor (name, dtype, shape, how to generate it), assigns
 * whole groups (the globals, one decoder layer) to shards so that a pipeline rank can map
 * only its layers' shards, then writes each shard as safetensors does: header padded with
 * spaces to 8 bytes, tensors ordered by descending element size and then by name so that
 * every tensor is aligned to its element size, __metadata__ {"format": "pt"}.
 *
 * Values: linear weights ~ N(0, 1/in_features), embeddings ~ N(0, 1), norm weights
 * 1 + 0.1 N(0, 1), biases 0.1 N(0, 1) (e_score_correction_bias 0.05 N(0, 1)), all rounded to
 * bf16 first, so that the NVFP4 experts are quantized from bf16 weights as ModelOpt sees
 * them. The generator is splitmix64 seeded with seed ^ FNV-1a(tensor name), with Box-Muller
 * normals: the same (seed, name) gives the same values on every run and machine with IEEE
 * float and a correctly rounded-enough libm (logf/cosf/sinf are used).
 */
#define _DEFAULT_SOURCE  // realpath
#include "engine/tools/mkmodel.h"

#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "engine/model/checkpoint.h"
#include "engine/shared/clock.h"
#include "kernels/nvfp4_format.h"

// ---------------------------------------------------------------------------
// Presets

typedef struct Preset {
    const char *name;
    int vocab, hidden, layers, first_dense;
    int heads, q_lora, kv_lora, nope, rope, v;
    int index_heads, index_dim, index_topk, index_freq, index_offset;
    int inter, moe_inter, experts, top_k, shared, mtp;
    float rope_theta;
    int max_pos;
    bool fp4_direct;  // routed experts' NVFP4 codes and scales drawn directly (fp4_direct)
} Preset;

static const Preset presets[] = {
    // Tests: < 2 MB, every structural feature (dense + MoE, full + shared indexer, MTP).
    {.name = "tiny",
     .vocab = 512,
     .hidden = 64,
     .layers = 4,
     .first_dense = 1,
     .heads = 4,
     .q_lora = 32,
     .kv_lora = 32,
     .nope = 16,
     .rope = 16,
     .v = 16,
     .index_heads = 2,
     .index_dim = 32,
     .index_topk = 8,
     .index_freq = 2,
     .index_offset = 1,
     .inter = 128,
     .moe_inter = 32,
     .experts = 8,
     .top_k = 2,
     .shared = 1,
     .mtp = 1,
     .rope_theta = 1e6f,
     .max_pos = 4096},
    // The CPU demo: GLM-5.2's layer rules (3 dense layers, indexer on 0,1,2,6,...).
    {.name = "default",
     .vocab = 4096,
     .hidden = 256,
     .layers = 8,
     .first_dense = 3,
     .heads = 4,
     .q_lora = 128,
     .kv_lora = 64,
     .nope = 32,
     .rope = 32,
     .v = 32,
     .index_heads = 4,
     .index_dim = 64,
     .index_topk = 64,
     .index_freq = 4,
     .index_offset = 3,
     .inter = 512,
     .moe_inter = 64,
     .experts = 32,
     .top_k = 4,
     .shared = 1,
     .mtp = 1,
     .rope_theta = 8e6f,
     .max_pos = 16384},
    // Load and throughput measurements: about 300 MB.
    {.name = "small",
     .vocab = 8192,
     .hidden = 1024,
     .layers = 12,
     .first_dense = 3,
     .heads = 8,
     .q_lora = 256,
     .kv_lora = 128,
     .nope = 64,
     .rope = 32,
     .v = 64,
     .index_heads = 8,
     .index_dim = 64,
     .index_topk = 256,
     .index_freq = 4,
     .index_offset = 3,
     .inter = 2048,
     .moe_inter = 256,
     .experts = 32,
     .top_k = 8,
     .shared = 1,
     .mtp = 1,
     .rope_theta = 8e6f,
     .max_pos = 65536},
    // GLM-5.2-NVFP4-REAP-469B's dimensions (config.json of the release, 156 experts after
    // REAP) for benchmarks of one pipeline stage: 26 layers (the first rank's), no MTP layer
    // unless --mtp 1 (its BF16 experts alone are 11.8 GB). About 88 GB at 26 layers; --layers
    // and --dense give shorter models (3 layers, 1 dense: 8.9 GB).
    {.name = "reap",
     .vocab = 154880,
     .hidden = 6144,
     .layers = 26,
     .first_dense = 3,
     .heads = 64,
     .q_lora = 2048,
     .kv_lora = 512,
     .nope = 192,
     .rope = 64,
     .v = 256,
     .index_heads = 32,
     .index_dim = 128,
     .index_topk = 2048,
     .index_freq = 4,
     .index_offset = 3,
     .inter = 12288,
     .moe_inter = 2048,
     .experts = 156,
     .top_k = 8,
     .shared = 1,
     .mtp = 0,
     .rope_theta = 8e6f,
     .max_pos = 1048576,
     .fp4_direct = true},
};

static const char *const preset_names[] = {"tiny", "default", "small", "reap", NULL};

const char *const *mkmodel_presets(void)
{
    return preset_names;
}

// GLM's special tokens, in the order they are appended to a tokenizer that lacks them.
static const char *const specials[] = {
    "[gMASK]",          "<sop>",         "<|system|>",  "<|user|>",     "<|assistant|>",
    "<|observation|>",  "<think>",       "</think>",    "<tool_call>",  "</tool_call>",
    "<arg_key>",        "</arg_key>",    "<arg_value>", "</arg_value>", "<tool_response>",
    "</tool_response>", "<|endoftext|>",
};
enum { N_SPECIALS = (int) (sizeof specials / sizeof specials[0]) };

// ---------------------------------------------------------------------------
// Random values

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) {
        h = (h ^ (uint8_t) *s) * 0x100000001b3ull;
    }
    return h;
}

static uint16_t float_to_bf16(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even (no NaNs are generated)
    return (uint16_t) (bits >> 16);
}

static float bf16_round(float x)
{
    const uint32_t bits = (uint32_t) float_to_bf16(x) << 16;
    float y;
    memcpy(&y, &bits, 4);
    return y;
}

// out[i - begin] = bf16(mean + std * N(0, 1)) for i in [begin, end) of the stream drawn from
// (seed, name), where end is the stream's length or an even index; begin is even. Pair j
// (values 2j, 2j + 1) takes splitmix64 outputs 2j and 2j + 1, so any range starts in O(1)
// and a stream cut into ranges equals the stream drawn whole.
static void gen_normal(uint64_t seed, const char *name, size_t begin, size_t end, float mean,
                       float std, float *out)
{
    ASSERT(begin % 2 == 0);
    uint64_t state = (seed ^ fnv1a(name)) + (uint64_t) begin * 0x9e3779b97f4a7c15ull;
    out -= begin;
    for (size_t i = begin; i < end; i += 2) {
        // 53-bit uniforms in (0, 1]; Box-Muller gives two normals per pair.
        const double u1 = ((double) (splitmix64(&state) >> 11) + 1.0) / 9007199254740992.0;
        const double u2 = (double) (splitmix64(&state) >> 11) / 9007199254740992.0;
        const float r = sqrtf(-2.0f * logf((float) u1));
        const float a = (float) (6.283185307179586 * u2);
        out[i] = bf16_round(mean + std * r * cosf(a));
        if (i + 1 < end) out[i + 1] = bf16_round(mean + std * r * sinf(a));
    }
}

void mkmodel_reference(uint64_t seed, const char *base, int rows, int cols, float *out)
{
    char name[512];
    snprintf(name, sizeof name, "%s.weight", base);
    gen_normal(seed, name, 0, (size_t) rows * (size_t) cols, 0.0f, 1.0f / sqrtf((float) cols), out);
}

// ---------------------------------------------------------------------------
// NVFP4 quantization (ModelOpt recipe)

// ModelOpt's _cast_fp4: searchsorted over the bounds, ties at odd-indexed bounds round up.
// Bounds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: the index is the count of bounds below |x|,
// plus one at the odd-indexed ties (0.75, 1.75, 3.5). Branch-free (random weights make every
// branch a coin toss).
static uint8_t float_to_e2m1(float x)
{
    const float a = fabsf(x);
    const int ord = (a > 0.25f) + (a > 0.75f) + (a > 1.25f) + (a > 1.75f) + (a > 2.5f) + (a > 3.5f)
                    + (a > 5.0f) + ((a == 0.75f) | (a == 1.75f) | (a == 3.5f));
    return (uint8_t) ((x < 0 ? 8 : 0) | ord);
}

void mkmodel_quantize_nvfp4(const float *w, int rows, int cols, uint8_t *codes, uint8_t *scale,
                            float *scale_2)
{
    const size_t n = (size_t) rows * (size_t) cols;
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) {
        amax = fmaxf(amax, fabsf(w[i]));
    }
    const float s2 = amax > 0.0f ? amax / (6.0f * 448.0f) : 1.0f;
    const int groups = cols / NVFP4_GROUP;
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < groups; g++) {
            const float *blk = w + (size_t) r * (size_t) cols + (size_t) g * NVFP4_GROUP;
            float bmax = 0.0f;
            for (int j = 0; j < NVFP4_GROUP; j++) {
                bmax = fmaxf(bmax, fabsf(blk[j]));
            }
            // ModelOpt: (bmax / 6) / s2, zero blocks get 1.0. We also keep the scale at or
            // above the smallest subnormal (2^-9) so that no block divides by zero.
            float q = bmax > 0.0f ? bmax / 6.0f / s2 : 1.0f;
            uint8_t code = nvfp4_float_to_e4m3(q);
            if ((code & 0x7f) == 0) code = 1;
            scale[(size_t) r * (size_t) groups + (size_t) g] = code;
            const float denom = nvfp4_e4m3_to_float(code) * s2;
            uint8_t *out = codes + (size_t) r * (size_t) (cols / 2) + (size_t) g * NVFP4_GROUP / 2;
            for (int j = 0; j < NVFP4_GROUP; j += 2) {
                const uint8_t lo = float_to_e2m1(blk[j] / denom);
                const uint8_t hi = float_to_e2m1(blk[j + 1] / denom);
                out[j / 2] = (uint8_t) (lo | hi << 4);
            }
        }
    }
    *scale_2 = s2;
}

// ---------------------------------------------------------------------------
// Tensor list

typedef enum Gen {
    GEN_LINEAR,       // N(0, 1/cols)
    GEN_EMBED,        // N(0, 1)
    GEN_NORM,         // 1 + 0.1 N
    GEN_BIAS,         // 0.1 N
    GEN_ROUTER_BIAS,  // 0.05 N, f32
    GEN_FP4_CODES,
    GEN_FP4_SCALE,
    GEN_FP4_SCALE2,
    GEN_FP4_INPUT,  // input_scale: a plausible activation amax / (6 * 448)
} Gen;

typedef struct Spec {
    char name[160];
    char base[160];  // linear base name for GEN_LINEAR / GEN_FP4_*
    CkptDtype dtype;
    Gen gen;
    int n_dims;
    int64_t shape[2];
    int rows, cols;  // logical weight shape
    int group;       // 0 = globals, 1 + layer
    bool direct;     // NVFP4 parts drawn directly (fp4_direct), not quantized
    int shard;
    size_t n_bytes;
    size_t offset;  // within the shard's data region
} Spec;

typedef struct Specs {
    Spec *v;
    int n, cap;
    int group;
    bool fp4_direct;  // routed experts' NVFP4 parts drawn directly
} Specs;

static Spec *spec_add(Specs *s, Gen gen, CkptDtype dtype, int n_dims, int64_t d0, int64_t d1,
                      const char *fmt, const char *suffix)
{
    if (s->n == s->cap) {
        const int cap = s->cap ? s->cap * 2 : 256;
        Spec *v = realloc(s->v, (size_t) cap * sizeof *v);
        if (!v) return NULL;
        s->v = v;
        s->cap = cap;
    }
    Spec *t = &s->v[s->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->base, sizeof t->base, "%s", fmt);
    snprintf(t->name, sizeof t->name, "%s%s", fmt, suffix);
    t->dtype = dtype;
    t->gen = gen;
    t->n_dims = n_dims;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->group = s->group;
    size_t n = ckpt_dtype_size(dtype);
    for (int i = 0; i < n_dims; i++) {
        n *= (size_t) t->shape[i];
    }
    t->n_bytes = n;
    return t;
}

// A linear layer: BF16 [rows, cols], NVFP4 (ModelOpt) or F32.
static bool add_linear(Specs *s, const char *base, int rows, int cols, int format)
{
    Spec *t;
    if (format == CKPT_LINEAR_NVFP4) {
        if (!(t = spec_add(s, GEN_FP4_CODES, CKPT_DTYPE_U8, 2, rows, cols / 2, base, ".weight"))) {
            return false;
        }
        t->rows = rows, t->cols = cols;
        if (!(t = spec_add(s, GEN_FP4_SCALE, CKPT_DTYPE_F8_E4M3, 2, rows, cols / NVFP4_GROUP, base,
                           ".weight_scale")))
            return false;
        t->rows = rows, t->cols = cols;
        if (!(t = spec_add(s, GEN_FP4_SCALE2, CKPT_DTYPE_F32, 0, 0, 0, base, ".weight_scale_2"))) {
            return false;
        }
        t->rows = rows, t->cols = cols;
        if (!(t = spec_add(s, GEN_FP4_INPUT, CKPT_DTYPE_F32, 0, 0, 0, base, ".input_scale"))) {
            return false;
        }
        for (int k = 1; k <= 4; k++)
            s->v[s->n - k].direct = s->fp4_direct;
        return true;
    }
    const CkptDtype dt = format == CKPT_LINEAR_F32 ? CKPT_DTYPE_F32 : CKPT_DTYPE_BF16;
    if (!(t = spec_add(s, GEN_LINEAR, dt, 2, rows, cols, base, ".weight"))) return false;
    t->rows = rows, t->cols = cols;
    return true;
}

static bool add_vector(Specs *s, Gen gen, CkptDtype dtype, int n, const char *name)
{
    return spec_add(s, gen, dtype, 1, n, 0, name, "") != NULL;
}

static bool indexer_full(const Preset *p, int i)
{
    if (i >= p->layers) return true;  // MTP layers run their own indexer
    const int k = i - p->index_offset + 1 > 0 ? i - p->index_offset + 1 : 0;
    return k % p->index_freq == 0;
}

static bool add_layer(Specs *s, const Preset *p, int i)
{
    char b[160], n[200];
    const int H = p->hidden, qk = p->nope + p->rope;
    bool ok = true;
#define NAME(...) (snprintf(n, sizeof n, __VA_ARGS__), n)
    snprintf(b, sizeof b, "model.layers.%d", i);
    s->group = 1 + i;
    if (i >= p->layers) {
        ok = ok && add_vector(s, GEN_NORM, CKPT_DTYPE_BF16, H, NAME("%s.enorm.weight", b));
        ok = ok && add_vector(s, GEN_NORM, CKPT_DTYPE_BF16, H, NAME("%s.hnorm.weight", b));
        ok = ok && add_linear(s, NAME("%s.eh_proj", b), H, 2 * H, CKPT_LINEAR_BF16);
        ok = ok
             && add_vector(s, GEN_NORM, CKPT_DTYPE_BF16, H, NAME("%s.shared_head.norm.weight", b));
    }
    ok = ok && add_vector(s, GEN_NORM, CKPT_DTYPE_BF16, H, NAME("%s.input_layernorm.weight", b));
    ok = ok
         && add_vector(s, GEN_NORM, CKPT_DTYPE_BF16, H,
                       NAME("%s.post_attention_layernorm.weight", b));
    ok = ok && add_linear(s, NAME("%s.self_attn.q_a_proj", b), p->q_lora, H, CKPT_LINEAR_BF16);
    ok = ok
         && add_vector(s, GEN_NORM, CKPT_DTYPE_BF16, p->q_lora,
                       NAME("%s.self_attn.q_a_layernorm.weight", b));
    ok = ok
         && add_linear(s, NAME("%s.self_attn.q_b_proj", b), p->heads * qk, p->q_lora,
                       CKPT_LINEAR_BF16);
    ok = ok
         && add_linear(s, NAME("%s.self_attn.kv_a_proj_with_mqa", b), p->kv_lora + p->rope, H,
                       CKPT_LINEAR_BF16);
    ok = ok
         && add_vector(s, GEN_NORM, CKPT_DTYPE_BF16, p->kv_lora,
                       NAME("%s.self_attn.kv_a_layernorm.weight", b));
    ok = ok
         && add_linear(s, NAME("%s.self_attn.kv_b_proj", b), p->heads * (p->nope + p->v),
                       p->kv_lora, CKPT_LINEAR_BF16);
    ok = ok && add_linear(s, NAME("%s.self_attn.o_proj", b), H, p->heads * p->v, CKPT_LINEAR_BF16);
    if (p->index_topk > 0 && indexer_full(p, i)) {
        ok = ok
             && add_linear(s, NAME("%s.self_attn.indexer.wq_b", b), p->index_heads * p->index_dim,
                           p->q_lora, CKPT_LINEAR_BF16);
        ok =
            ok
            && add_linear(s, NAME("%s.self_attn.indexer.wk", b), p->index_dim, H, CKPT_LINEAR_BF16);
        ok = ok
             && add_vector(s, GEN_NORM, CKPT_DTYPE_BF16, p->index_dim,
                           NAME("%s.self_attn.indexer.k_norm.weight", b));
        ok = ok
             && add_vector(s, GEN_BIAS, CKPT_DTYPE_BF16, p->index_dim,
                           NAME("%s.self_attn.indexer.k_norm.bias", b));
        ok = ok
             && add_linear(s, NAME("%s.self_attn.indexer.weights_proj", b), p->index_heads, H,
                           CKPT_LINEAR_F32);
    }
    if (i < p->first_dense) {
        ok = ok && add_linear(s, NAME("%s.mlp.gate_proj", b), p->inter, H, CKPT_LINEAR_BF16);
        ok = ok && add_linear(s, NAME("%s.mlp.up_proj", b), p->inter, H, CKPT_LINEAR_BF16);
        ok = ok && add_linear(s, NAME("%s.mlp.down_proj", b), H, p->inter, CKPT_LINEAR_BF16);
    } else {
        // NVIDIA's export keeps the MTP layer's experts in BF16.
        const int fmt = i >= p->layers ? CKPT_LINEAR_BF16 : CKPT_LINEAR_NVFP4;
        ok = ok && add_linear(s, NAME("%s.mlp.gate", b), p->experts, H, CKPT_LINEAR_BF16);
        ok = ok
             && add_vector(s, GEN_ROUTER_BIAS, CKPT_DTYPE_F32, p->experts,
                           NAME("%s.mlp.gate.e_score_correction_bias", b));
        const int si = p->shared * p->moe_inter;
        if (si > 0) {
            ok = ok
                 && add_linear(s, NAME("%s.mlp.shared_experts.gate_proj", b), si, H,
                               CKPT_LINEAR_BF16);
            ok =
                ok
                && add_linear(s, NAME("%s.mlp.shared_experts.up_proj", b), si, H, CKPT_LINEAR_BF16);
            ok = ok
                 && add_linear(s, NAME("%s.mlp.shared_experts.down_proj", b), H, si,
                               CKPT_LINEAR_BF16);
        }
        for (int e = 0; e < p->experts && ok; e++) {
            ok = ok
                 && add_linear(s, NAME("%s.mlp.experts.%d.gate_proj", b, e), p->moe_inter, H, fmt);
            ok = ok && add_linear(s, NAME("%s.mlp.experts.%d.up_proj", b, e), p->moe_inter, H, fmt);
            ok = ok
                 && add_linear(s, NAME("%s.mlp.experts.%d.down_proj", b, e), H, p->moe_inter, fmt);
        }
    }
#undef NAME
    return ok;
}

static bool build_specs(Specs *s, const Preset *p, int vocab)
{
    bool ok = true;
    s->group = 0;
    ok = ok && add_vector(s, GEN_EMBED, CKPT_DTYPE_BF16, 0, "model.embed_tokens.weight");
    if (ok) {
        // Embeddings are [vocab, hidden]; add_vector made a 1-D entry, widen it.
        Spec *t = &s->v[s->n - 1];
        t->n_dims = 2, t->shape[0] = vocab, t->shape[1] = p->hidden;
        t->rows = vocab, t->cols = p->hidden;
        t->n_bytes = (size_t) vocab * (size_t) p->hidden * 2;
    }
    for (int i = 0; ok && i < p->layers + p->mtp; i++) {
        ok = add_layer(s, p, i);
    }
    s->group = 1 + p->layers + p->mtp;
    ok = ok && add_vector(s, GEN_NORM, CKPT_DTYPE_BF16, p->hidden, "model.norm.weight");
    ok = ok && add_linear(s, "lm_head", vocab, p->hidden, CKPT_LINEAR_BF16);
    return ok;
}

// ---------------------------------------------------------------------------
// Tensor data

typedef struct Fp4Cache {
    char base[160];
    uint8_t *codes, *scale;
    float scale_2;
} Fp4Cache;

static Err fp4_quantized(Fp4Cache *c, uint64_t seed, const Spec *t)
{
    if (!strcmp(c->base, t->base) && c->codes) return ERR_OK;
    const size_t n = (size_t) t->rows * (size_t) t->cols;
    float *w = malloc(n * sizeof *w);
    uint8_t *codes = malloc(n / 2), *scale = malloc(n / NVFP4_GROUP);
    if (!w || !codes || !scale) {
        free(w), free(codes), free(scale);
        return ERR_NOMEM;
    }
    mkmodel_reference(seed, t->base, t->rows, t->cols, w);
    free(c->codes), free(c->scale);
    mkmodel_quantize_nvfp4(w, t->rows, t->cols, codes, scale, &c->scale_2);
    free(w);
    c->codes = codes, c->scale = scale;
    snprintf(c->base, sizeof c->base, "%s", t->base);
    return ERR_OK;
}

// The NVFP4 part t drawn directly (MkmodelOptions.fp4_direct): codes uniform over the 16 E2M1
// codes, block scales uniform over the E4M3 values 0.875 .. 1.5 (codes 0x36 .. 0x3c), and
// scale_2 such that the weights' RMS is about 1/sqrt(cols), as the quantized path's
// N(0, 1/cols) draws (the codes' RMS is sqrt(68.5 / 8), the scales' mean 1.15).
static void fp4_direct(const Spec *t, uint64_t seed, uint8_t *out)
{
    uint64_t state = seed ^ fnv1a(t->name);
    if (t->gen == GEN_FP4_SCALE2) {
        const float s2 = (float) (1.0 / (sqrt((double) t->cols) * sqrt(68.5 / 8.0) * 1.15));
        memcpy(out, &s2, 4);
        return;
    }
    for (size_t i = 0; i < t->n_bytes; i += 8) {
        uint64_t r = splitmix64(&state);
        const size_t n = t->n_bytes - i < 8 ? t->n_bytes - i : 8;
        for (size_t k = 0; k < n; k++, r >>= 8)
            out[i + k] = t->gen == GEN_FP4_CODES ? (uint8_t) r : (uint8_t) (0x36 + (r & 0xff) % 7);
    }
}

// Fill out with t's bytes: elements [begin, end) (begin even), or the whole tensor for the
// NVFP4 parts and input_scale (begin 0, end its element count).
static Err gen_tensor(const Spec *t, uint64_t seed, Fp4Cache *cache, size_t begin, size_t end,
                      uint8_t *out)
{
    const size_t n = end - begin;
    float *f = NULL;
    Err err = ERR_OK;
    switch (t->gen) {
    case GEN_FP4_CODES:
    case GEN_FP4_SCALE:
    case GEN_FP4_SCALE2:
        if (t->direct) {
            fp4_direct(t, seed, out);
            return ERR_OK;
        }
        if ((err = fp4_quantized(cache, seed, t))) return err;
        if (t->gen == GEN_FP4_CODES) memcpy(out, cache->codes, t->n_bytes);
        if (t->gen == GEN_FP4_SCALE) memcpy(out, cache->scale, t->n_bytes);
        if (t->gen == GEN_FP4_SCALE2) memcpy(out, &cache->scale_2, 4);
        return ERR_OK;
    case GEN_FP4_INPUT: {
        const float v = 8.0f / (6.0f * 448.0f);  // as if activations peaked at 8
        memcpy(out, &v, 4);
        return ERR_OK;
    }
    default:
        break;
    }
    if (!(f = malloc((n ? n : 1) * sizeof *f))) return ERR_NOMEM;
    switch (t->gen) {
    case GEN_LINEAR:  // mkmodel_reference's values (t->name is base + ".weight")
        gen_normal(seed, t->name, begin, end, 0.0f, 1.0f / sqrtf((float) t->cols), f);
        break;
    case GEN_EMBED:
        gen_normal(seed, t->name, begin, end, 0.0f, 1.0f, f);
        break;
    case GEN_NORM:
        gen_normal(seed, t->name, begin, end, 1.0f, 0.1f, f);
        break;
    case GEN_BIAS:
        gen_normal(seed, t->name, begin, end, 0.0f, 0.1f, f);
        break;
    case GEN_ROUTER_BIAS:
        gen_normal(seed, t->name, begin, end, 0.0f, 0.05f, f);
        break;
    default:
        ASSERT(0);
    }
    if (t->dtype == CKPT_DTYPE_F32) {
        memcpy(out, f, n * 4);
    } else {
        ASSERT(t->dtype == CKPT_DTYPE_BF16);
        for (size_t i = 0; i < n; i++) {
            const uint16_t h = float_to_bf16(f[i]);
            out[2 * i] = (uint8_t) h, out[2 * i + 1] = (uint8_t) (h >> 8);
        }
    }
    free(f);
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Files

static Err write_json(const char *dir, const char *file, json_object *obj)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    if (json_object_to_file_ext(path, obj,
                                JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED
                                    | JSON_C_TO_STRING_NOSLASHESCAPE)
        != 0) {
        LOG_ERROR("could not write \"%s\": %s", path, json_util_get_last_err());
        return ERR_IO;
    }
    return ERR_OK;
}

static int spec_order(const void *a, const void *b)
{
    const Spec *x = *(const Spec *const *) a, *y = *(const Spec *const *) b;
    const size_t sx = ckpt_dtype_size(x->dtype), sy = ckpt_dtype_size(y->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return strcmp(x->name, y->name);
}

// One shard file: its descriptor and where its data region starts.
typedef struct ShardFile {
    int fd;
    size_t data_start;  // 8 + the padded header
    char path[4096];
} ShardFile;

static Err write_at(const ShardFile *sf, const void *data, size_t n, size_t offset)
{
    const uint8_t *p = data;
    while (n > 0) {
        const ssize_t w = pwrite(sf->fd, p, n, (off_t) offset);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            LOG_ERROR("could not write \"%s\": %s", sf->path, w < 0 ? strerror(errno) : "no space");
            return ERR_IO;
        }
        p += w, n -= (size_t) w, offset += (size_t) w;
    }
    return ERR_OK;
}

// Create the shard file, order its tensors (list is sorted in place), give each its offset
// in the data region and write the header as safetensors does.
static Err open_shard(const char *dir, const char *file, Spec **list, int n, ShardFile *sf)
{
    Err err = ERR_OK;
    json_object *hdr = json_object_new_object(), *meta = json_object_new_object();
    uint8_t *buf = NULL;
    snprintf(sf->path, sizeof sf->path, "%s/%s", dir, file);
    sf->fd = -1;
    if (!hdr || !meta) {
        json_object_put(meta);
        err = ERR_NOMEM;
        goto done;
    }
    json_object_object_add(meta, "format", json_object_new_string("pt"));
    json_object_object_add(hdr, "__metadata__", meta);
    qsort(list, (size_t) n, sizeof *list, spec_order);
    size_t offset = 0;
    for (int i = 0; i < n; i++) {
        Spec *t = list[i];
        json_object *e = json_object_new_object(), *shape = json_object_new_array(),
                    *offs = json_object_new_array();
        json_object_object_add(e, "dtype", json_object_new_string(ckpt_dtype_name(t->dtype)));
        for (int d = 0; d < t->n_dims; d++) {
            json_object_array_add(shape, json_object_new_int64(t->shape[d]));
        }
        json_object_object_add(e, "shape", shape);
        t->offset = offset;
        json_object_array_add(offs, json_object_new_int64((int64_t) offset));
        json_object_array_add(offs, json_object_new_int64((int64_t) (offset + t->n_bytes)));
        json_object_object_add(e, "data_offsets", offs);
        json_object_object_add(hdr, t->name, e);
        offset += t->n_bytes;
    }
    size_t hlen = 0;
    const char *text = json_object_to_json_string_length(hdr, JSON_C_TO_STRING_PLAIN, &hlen);
    const size_t padded = (hlen + 7) / 8 * 8;
    if (!(buf = malloc(8 + padded))) {
        err = ERR_NOMEM;
        goto done;
    }
    if ((sf->fd = open(sf->path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0) {
        LOG_ERROR("could not create \"%s\": %s", sf->path, strerror(errno));
        err = ERR_IO;
        goto done;
    }
    for (int i = 0; i < 8; i++) {
        buf[i] = (uint8_t) ((uint64_t) padded >> (8 * i));
    }
    memcpy(buf + 8, text, hlen);
    memset(buf + 8 + hlen, ' ', padded - hlen);
    sf->data_start = 8 + padded;
    err = write_at(sf, buf, 8 + padded, 0);
done:
    free(buf);
    json_object_put(hdr);
    return err;
}

// The tensors of every shard, generated by a pool of threads and written in place with
// pwrite. Work items are whole tensors, or ranges of GEN_CHUNK values of a large non-NVFP4
// one (the embeddings and lm_head are ~1e9 values: a stream draws any range in O(1)), largest
// first. An NVFP4 weight's codes item also writes its scales (the next two specs), so each
// weight is quantized once, from its whole bf16 matrix (scale_2 is the tensor's amax).
enum { GEN_CHUNK = 1 << 24 };

typedef struct GenItem {
    const Spec *t;
    size_t begin, end;  // elements
} GenItem;

typedef struct GenWork {
    GenItem *items;
    int n;
    const ShardFile *shards;
    uint64_t seed;
    int next;  // atomic: the next item
    pthread_mutex_t mu;
    Err err;  // the first failure (under mu)
    size_t done_bytes, total_bytes;
    double t0, last_log;
} GenWork;

static int item_larger(const void *a, const void *b)
{
    const GenItem *x = a, *y = b;
    const size_t sx = (x->end - x->begin) * ckpt_dtype_size(x->t->dtype);
    const size_t sy = (y->end - y->begin) * ckpt_dtype_size(y->t->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    const int c = strcmp(x->t->name, y->t->name);
    return c ? c : (x->begin > y->begin) - (x->begin < y->begin);
}

// Generate one item (and an NVFP4 weight's scales) into *buf (grown as needed) and write it.
static Err gen_item(GenWork *w, const GenItem *it, Fp4Cache *cache, uint8_t **buf, size_t *cap,
                    size_t *bytes)
{
    const Spec *t = it->t;
    const int parts = t->gen == GEN_FP4_CODES ? 3 : 1;
    *bytes = 0;
    for (int k = 0; k < parts; k++) {
        const Spec *u = t + k;  // an NVFP4 weight's codes, scale, scale_2 are consecutive
        ASSERT(k == 0 || !strcmp(u->base, t->base));
        const size_t esz = ckpt_dtype_size(u->dtype);
        const size_t begin = k ? 0 : it->begin, end = k ? u->n_bytes / esz : it->end;
        const size_t n = (end - begin) * esz;
        if (n > *cap) {
            free(*buf);
            *cap = 0;
            if (!(*buf = malloc(n))) return ERR_NOMEM;
            *cap = n;
        }
        Err err = gen_tensor(u, w->seed, cache, begin, end, *buf);
        if (!err)
            err = write_at(&w->shards[u->shard], *buf, n,
                           w->shards[u->shard].data_start + u->offset + begin * esz);
        if (err) return err;
        *bytes += n;
    }
    return ERR_OK;
}

static void *gen_worker(void *arg)
{
    GenWork *w = arg;
    uint8_t *buf = NULL;
    size_t cap = 0;
    Fp4Cache cache = {{0}, NULL, NULL, 0.0f};
    for (;;) {
        const int i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (i >= w->n || __atomic_load_n(&w->err, __ATOMIC_RELAXED)) break;
        size_t bytes = 0;
        const Err err = gen_item(w, &w->items[i], &cache, &buf, &cap, &bytes);
        pthread_mutex_lock(&w->mu);
        if (err && !w->err) w->err = err;
        w->done_bytes += bytes;
        const double now = clock_now_s();
        if (!err && now - w->last_log >= 5.0 && w->done_bytes < w->total_bytes) {
            const double rate = (double) w->done_bytes / (now - w->t0);
            LOG_INFO("mkmodel: %.2f of %.2f GB written, %.0f MB/s, about %.0f s left",
                     (double) w->done_bytes / 1e9, (double) w->total_bytes / 1e9, rate / 1e6,
                     (double) (w->total_bytes - w->done_bytes) / rate);
            w->last_log = now;
        }
        pthread_mutex_unlock(&w->mu);
        if (err) break;
    }
    free(buf);
    free(cache.codes);
    free(cache.scale);
    return NULL;
}

static Err generate_all(const Specs *specs, const ShardFile *shards, uint64_t seed, int n_threads)
{
    GenWork w = {.shards = shards, .seed = seed, .t0 = clock_now_s()};
    w.last_log = w.t0;
    int cap = 0;
    for (int i = 0; i < specs->n; i++) {
        const Spec *t = &specs->v[i];
        w.total_bytes += t->n_bytes;
        if (t->gen == GEN_FP4_SCALE || t->gen == GEN_FP4_SCALE2) continue;
        const size_t n = t->n_bytes / ckpt_dtype_size(t->dtype);
        const bool split = t->gen != GEN_FP4_CODES && t->gen != GEN_FP4_INPUT;
        size_t b = 0;  // one item for an empty or unsplit tensor, else ranges of GEN_CHUNK
        do {
            if (w.n == cap) {
                cap = cap ? 2 * cap : 1024;
                GenItem *v = realloc(w.items, (size_t) cap * sizeof *v);
                if (!v) {
                    free(w.items);
                    return ERR_NOMEM;
                }
                w.items = v;
            }
            const size_t e = split && n - b > GEN_CHUNK ? b + GEN_CHUNK : n;
            w.items[w.n++] = (GenItem){t, b, e};
            b = e;
        } while (b < n);
    }
    qsort(w.items, (size_t) w.n, sizeof *w.items, item_larger);
    pthread_mutex_init(&w.mu, NULL);
    if (n_threads < 1) n_threads = 1;
    if (n_threads > w.n) n_threads = w.n > 0 ? w.n : 1;
    pthread_t *tid = malloc((size_t) n_threads * sizeof *tid);
    int started = 0;
    if (tid) {
        for (; started < n_threads; started++)
            if (pthread_create(&tid[started], NULL, gen_worker, &w) != 0) break;
    }
    if (started == 0) gen_worker(&w);  // no thread could start: do the work here
    for (int i = 0; i < started; i++)
        pthread_join(tid[i], NULL);
    pthread_mutex_destroy(&w.mu);
    free(tid);
    free(w.items);
    return w.err;
}

// ---------------------------------------------------------------------------
// Tokenizer

typedef struct Vocab {
    int size;                     // model vocab_size (multiple of 64)
    int special_ids[N_SPECIALS];  // id of specials[i]
} Vocab;

void mkmodel_add_special_token(json_object *added, int id, const char *content)
{
    json_object *a = json_object_new_object();
    json_object_object_add(a, "id", json_object_new_int(id));
    json_object_object_add(a, "content", json_object_new_string(content));
    json_object_object_add(a, "single_word", json_object_new_boolean(0));
    json_object_object_add(a, "lstrip", json_object_new_boolean(0));
    json_object_object_add(a, "rstrip", json_object_new_boolean(0));
    json_object_object_add(a, "normalized", json_object_new_boolean(0));
    json_object_object_add(a, "special", json_object_new_boolean(1));
    json_object_array_add(added, a);
}

// Copy tokenizer.json into dir, appending GLM's special tokens when missing.
static Err write_tokenizer(const char *src, const char *dir, Vocab *voc)
{
    Err err = ERR_OK;
    json_object *root = json_object_from_file(src);
    json_object *model = NULL, *vocab = NULL, *added = NULL;
    int max_id = -1;
    if (!root || !json_object_is_type(root, json_type_object)) {
        LOG_ERROR("could not read tokenizer \"%s\": %s", src,
                  root ? "not a JSON object" : json_util_get_last_err());
        err = ERR_INVAL;
        goto done;
    }
    if (json_object_object_get_ex(root, "model", &model)
        && json_object_object_get_ex(model, "vocab", &vocab)
        && json_object_is_type(vocab, json_type_object)) {
        json_object_object_foreach(vocab, tok, id)
        {
            (void) tok;
            if (json_object_is_type(id, json_type_int) && json_object_get_int(id) > max_id) {
                max_id = json_object_get_int(id);
            }
        }
    } else {
        LOG_ERROR("tokenizer \"%s\": field \"model.vocab\" must be an object", src);
        err = ERR_INVAL;
        goto done;
    }
    if (!json_object_object_get_ex(root, "added_tokens", &added)
        || !json_object_is_type(added, json_type_array)) {
        added = json_object_new_array();
        json_object_object_add(root, "added_tokens", added);
    }
    for (int i = 0; i < N_SPECIALS; i++) {
        voc->special_ids[i] = -1;
    }
    const size_t n_added = json_object_array_length(added);
    for (size_t i = 0; i < n_added; i++) {
        json_object *a = json_object_array_get_idx(added, i), *id = NULL, *content = NULL;
        if (!json_object_object_get_ex(a, "id", &id)
            || !json_object_object_get_ex(a, "content", &content)
            || !json_object_is_type(id, json_type_int)
            || !json_object_is_type(content, json_type_string)) {
            LOG_ERROR("tokenizer \"%s\": added_tokens[%zu] needs an integer id and a string "
                      "content",
                      src, i);
            err = ERR_INVAL;
            goto done;
        }
        const int v = json_object_get_int(id);
        if (v > max_id) max_id = v;
        for (int s = 0; s < N_SPECIALS; s++) {
            if (!strcmp(json_object_get_string(content), specials[s])) voc->special_ids[s] = v;
        }
    }
    if (max_id < 0 || max_id > (1 << 22)) {
        LOG_ERROR("tokenizer \"%s\": vocabulary ids out of range (max %d)", src, max_id);
        err = ERR_INVAL;
        goto done;
    }
    for (int s = 0; s < N_SPECIALS; s++) {
        if (voc->special_ids[s] >= 0) continue;
        voc->special_ids[s] = ++max_id;
        mkmodel_add_special_token(added, max_id, specials[s]);
    }
    voc->size = (max_id + 1 + 63) / 64 * 64;
    err = write_json(dir, "tokenizer.json", root);
done:
    json_object_put(root);
    return err;
}

// ---------------------------------------------------------------------------
// Configs

static json_object *int_array(const int *v, int n)
{
    json_object *a = json_object_new_array();
    for (int i = 0; i < n; i++) {
        json_object_array_add(a, json_object_new_int(v[i]));
    }
    return a;
}

static json_object *make_config(const Preset *p, const Vocab *voc)
{
    json_object *c = json_object_new_object(), *a;
#define SET(key, value) json_object_object_add(c, key, value)
#define INT(v)          json_object_new_int(v)
#define DBL(v)          json_object_new_double(v)
#define STR(v)          json_object_new_string(v)
#define BOOL(v)         json_object_new_boolean(v)
    a = json_object_new_array();
    json_object_array_add(a, STR("GlmMoeDsaForCausalLM"));
    SET("architectures", a);
    SET("model_type", STR("glm_moe_dsa"));
    SET("attention_bias", BOOL(0));
    SET("attention_dropout", DBL(0.0));
    SET("dtype", STR("bfloat16"));
    const int eos[3] = {voc->special_ids[16], voc->special_ids[3], voc->special_ids[5]};
    SET("eos_token_id", int_array(eos, 3));
    SET("pad_token_id", INT(eos[0]));
    SET("first_k_dense_replace", INT(p->first_dense));
    SET("head_dim", INT(p->rope));
    SET("hidden_act", STR("silu"));
    SET("hidden_size", INT(p->hidden));
    SET("index_head_dim", INT(p->index_dim));
    SET("index_n_heads", INT(p->index_heads));
    SET("index_share_for_mtp_iteration", BOOL(1));
    SET("index_skip_topk_offset", INT(p->index_offset));
    SET("index_topk", INT(p->index_topk));
    SET("index_topk_freq", INT(p->index_freq));
    SET("indexer_rope_interleave", BOOL(1));
    a = json_object_new_array();
    for (int i = 0; i < p->layers; i++) {
        json_object_array_add(a, STR(indexer_full(p, i) ? "full" : "shared"));
    }
    SET("indexer_types", a);
    SET("initializer_range", DBL(0.02));
    SET("intermediate_size", INT(p->inter));
    SET("kv_lora_rank", INT(p->kv_lora));
    SET("max_position_embeddings", INT(p->max_pos));
    a = json_object_new_array();
    for (int i = 0; i < p->layers; i++) {
        json_object_array_add(a, STR(i < p->first_dense ? "dense" : "sparse"));
    }
    SET("mlp_layer_types", a);
    SET("moe_intermediate_size", INT(p->moe_inter));
    SET("moe_layer_freq", INT(1));
    SET("n_group", INT(1));
    SET("n_routed_experts", INT(p->experts));
    SET("n_shared_experts", INT(p->shared));
    SET("norm_topk_prob", BOOL(1));
    SET("num_attention_heads", INT(p->heads));
    SET("num_experts_per_tok", INT(p->top_k));
    SET("num_hidden_layers", INT(p->layers));
    SET("num_key_value_heads", INT(p->heads));
    SET("num_nextn_predict_layers", INT(p->mtp));
    SET("q_lora_rank", INT(p->q_lora));
    SET("qk_head_dim", INT(p->nope + p->rope));
    SET("qk_nope_head_dim", INT(p->nope));
    SET("qk_rope_head_dim", INT(p->rope));
    SET("rms_norm_eps", json_object_new_double_s(1e-5, "1e-05"));
    SET("rope_interleave", BOOL(1));
    json_object *rope = json_object_new_object();
    json_object_object_add(rope, "rope_theta", json_object_new_int64((int64_t) p->rope_theta));
    json_object_object_add(rope, "rope_type", STR("default"));
    SET("rope_parameters", rope);
    SET("routed_scaling_factor", DBL(2.5));
    SET("scoring_func", STR("sigmoid"));
    SET("tie_word_embeddings", BOOL(0));
    SET("topk_group", INT(1));
    SET("topk_method", STR("noaux_tc"));
    SET("transformers_version", STR("5.17.0"));
    SET("use_cache", BOOL(1));
    SET("v_head_dim", INT(p->v));
    SET("vocab_size", INT(voc->size));
#undef SET
    return c;
}

static json_object *make_quant_config(const Preset *p)
{
    char buf[96];
    json_object *root = json_object_new_object(), *producer = json_object_new_object(),
                *q = json_object_new_object(), *ex = json_object_new_array();
    json_object_object_add(producer, "name", STR("modelopt"));
    json_object_object_add(producer, "version", STR("0.37.0"));
    json_object_object_add(root, "producer", producer);
    json_object_object_add(q, "quant_algo", STR("NVFP4"));
    json_object_object_add(q, "kv_cache_quant_algo", STR("FP8"));
    json_object_object_add(q, "group_size", INT(16));
    json_object_array_add(ex, STR("lm_head"));
    json_object_array_add(ex, STR("model.embed_tokens"));
    json_object_array_add(ex, STR("model.layers.*.self_attn*"));
    json_object_array_add(ex, STR("model.layers.*.mlp.gate"));
    json_object_array_add(ex, STR("model.layers.*.mlp.shared_experts*"));
    for (int i = 0; i < p->first_dense && i < p->layers; i++) {
        snprintf(buf, sizeof buf, "model.layers.%d.mlp*", i);
        json_object_array_add(ex, STR(buf));
    }
    for (int i = p->layers; i < p->layers + p->mtp; i++) {
        snprintf(buf, sizeof buf, "model.layers.%d*", i);
        json_object_array_add(ex, STR(buf));
    }
    json_object_object_add(q, "exclude_modules", ex);
    json_object_object_add(root, "quantization", q);
    return root;
}

static json_object *make_generation_config(const Vocab *voc)
{
    json_object *g = json_object_new_object();
    const int eos[3] = {voc->special_ids[16], voc->special_ids[3], voc->special_ids[5]};
    json_object_object_add(g, "_from_model_config", BOOL(0));
    json_object_object_add(g, "do_sample", BOOL(1));
    json_object_object_add(g, "eos_token_id", int_array(eos, 3));
    json_object_object_add(g, "pad_token_id", INT(eos[0]));
    json_object_object_add(g, "temperature", DBL(1.0));
    json_object_object_add(g, "top_p", json_object_new_double_s(0.95, "0.95"));
    json_object_object_add(g, "transformers_version", STR("5.17.0"));
    return g;
}
#undef INT
#undef DBL
#undef STR
#undef BOOL

// ---------------------------------------------------------------------------
// The writer

// mkdir -p: create path and any missing parents.
static Err make_dirs(const char *path)
{
    char buf[4096];
    const size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) {
        LOG_ERROR("could not create \"%s\": bad path", path);
        return ERR_INVAL;
    }
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != 0) continue;
        const char saved = buf[i];
        buf[i] = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) {
            LOG_ERROR("could not create \"%s\": %s", buf, strerror(errno));
            return ERR_IO;
        }
        buf[i] = saved;
    }
    return ERR_OK;
}

// Bytes an unprivileged writer may still use on path's filesystem.
static Err free_bytes(const char *path, uint64_t *out)
{
    struct statvfs st;
    if (statvfs(path, &st) != 0) {
        LOG_ERROR("could not read the free space of \"%s\": %s", path, strerror(errno));
        return ERR_IO;
    }
    *out = (uint64_t) st.f_bavail * (uint64_t) st.f_frsize;
    return ERR_OK;
}

// Before open_shard creates out_dir/file: with spill_dir (absolute) it becomes a symbolic link
// to spill_dir/file, through which the file is then created; without, a link an earlier run
// left there goes (the shard is written in out_dir itself).
static Err place_shard(const char *out_dir, const char *spill_dir, const char *file)
{
    char link[PATH_MAX], target[PATH_MAX];
    if ((size_t) snprintf(link, sizeof link, "%s/%s", out_dir, file) >= sizeof link
        || (spill_dir
            && (size_t) snprintf(target, sizeof target, "%s/%s", spill_dir, file) >= sizeof target)) {
        LOG_ERROR("mkmodel: path too long for \"%s\"", file);
        return ERR_INVAL;
    }
    struct stat st;
    const bool exists = lstat(link, &st) == 0;
    if (exists && (spill_dir || S_ISLNK(st.st_mode)) && unlink(link) != 0) {
        LOG_ERROR("could not remove \"%s\": %s", link, strerror(errno));
        return ERR_IO;
    }
    if (spill_dir && symlink(target, link) != 0) {
        LOG_ERROR("could not link \"%s\" to \"%s\": %s", link, target, strerror(errno));
        return ERR_IO;
    }
    return ERR_OK;
}

Err mkmodel_write(const MkmodelOptions *opt)
{
    Err err = ERR_OK;
    Specs specs = {0};
    Spec **list = NULL;
    json_object *cfg = NULL, *quant = NULL, *gen = NULL, *index = NULL;
    const char *pname = opt->preset ? opt->preset : "default";
    Preset preset;
    const Preset *p = NULL;
    Vocab voc = {0};
    ShardFile *shards = NULL;
    int n_shards = 0;
    const double t0 = clock_now_s();
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (!strcmp(presets[i].name, pname)) p = &presets[i];
    }
    if (!p) {
        LOG_ERROR("unknown mkmodel preset \"%s\" (tiny, default, small, reap)", pname);
        return ERR_INVAL;
    }
    preset = *p;
    if (opt->layers > 0) preset.layers = opt->layers;
    if (opt->set_dense) preset.first_dense = opt->dense;
    if (opt->set_mtp) preset.mtp = opt->mtp;
    if (preset.layers > 256 || preset.first_dense < 0 || preset.first_dense > preset.layers) {
        LOG_ERROR("mkmodel: %d layers with %d dense ones: at most 256 layers, and no more dense "
                  "layers than layers",
                  preset.layers, preset.first_dense);
        return ERR_INVAL;
    }
    if (preset.mtp < 0 || preset.mtp > 3) {
        LOG_ERROR("mkmodel: %d MTP layers: 0 to 3", preset.mtp);
        return ERR_INVAL;
    }
    p = &preset;
    if ((err = make_dirs(opt->out_dir))) return err;
    if (opt->tokenizer) {
        if ((err = write_tokenizer(opt->tokenizer, opt->out_dir, &voc))) goto done;
    } else {
        // No tokenizer: the specials take the last ids of the preset's vocabulary.
        voc.size = p->vocab;
        for (int i = 0; i < N_SPECIALS; i++) {
            voc.special_ids[i] = p->vocab - N_SPECIALS + i;
        }
    }
    specs.fp4_direct = opt->fp4_direct || p->fp4_direct;
    if (!build_specs(&specs, p, voc.size)) {
        err = ERR_NOMEM;
        goto done;
    }
    // Shards: whole groups, split where the running total crosses k * total / n_shards.
    size_t total = 0;
    for (int i = 0; i < specs.n; i++) {
        total += specs.v[i].n_bytes;
    }
    const size_t shard_target = (size_t) 64 << 20;
    n_shards = (int) ((total + shard_target - 1) / shard_target);
    if (n_shards < 2) n_shards = 2;
    {
        size_t running = 0;
        int shard = 0, group = -1;
        for (int i = 0; i < specs.n; i++) {
            if (specs.v[i].group != group) {
                group = specs.v[i].group;
                while (shard + 1 < n_shards
                       && running >= (size_t) ((double) total * (shard + 1) / n_shards)) {
                    shard++;
                }
            }
            specs.v[i].shard = shard;
            running += specs.v[i].n_bytes;
        }
        // Number the shards that received tensors 0, 1, ... (a group larger than the target
        // skips the shards it spans).
        int used = -1, last = -1;
        for (int i = 0; i < specs.n; i++) {
            if (specs.v[i].shard != last) last = specs.v[i].shard, used++;
            specs.v[i].shard = used;
        }
        n_shards = used + 1;
    }
    if (!(list = malloc((size_t) specs.n * sizeof *list))
        || !(shards = calloc((size_t) n_shards, sizeof *shards))) {
        err = ERR_NOMEM;
        goto done;
    }
    for (int s = 0; s < n_shards; s++)
        shards[s].fd = -1;
    index = json_object_new_object();
    json_object *meta = json_object_new_object(), *map = json_object_new_object();
    json_object_object_add(meta, "total_size", json_object_new_int64((int64_t) total));
    json_object_object_add(index, "metadata", meta);
    json_object_object_add(index, "weight_map", map);
    // Room: out_dir's free space less a margin, then the spill directory's (statvfs).
    const uint64_t margin = (uint64_t) 1 << 30;
    uint64_t room = opt->room, spill_room = 0;
    char spill_dir[PATH_MAX] = "";
    if (!room) {
        if ((err = free_bytes(opt->out_dir, &room))) goto done;
        room = room > margin ? room - margin : 0;
    }
    if (opt->spill_dir) {
        if ((err = make_dirs(opt->spill_dir)) || (err = free_bytes(opt->spill_dir, &spill_room)))
            goto done;
        spill_room = spill_room > margin ? spill_room - margin : 0;
        if (!realpath(opt->spill_dir, spill_dir)) {  // the links must not depend on the cwd
            LOG_ERROR("could not resolve \"%s\": %s", opt->spill_dir, strerror(errno));
            err = ERR_IO;
            goto done;
        }
    }
    if (total > room + spill_room) {
        LOG_ERROR("mkmodel: the checkpoint needs %.1f GB; \"%s\" has room for %.1f GB%s%s%s (1 GiB "
                  "kept free on each)",
                  (double) total / 1e9, opt->out_dir, (double) room / 1e9,
                  opt->spill_dir ? ", the spill directory \"" : " (--spill DIR adds another)",
                  opt->spill_dir ? opt->spill_dir : "", opt->spill_dir ? "\" the rest" : "");
        err = ERR_IO;
        goto done;
    }
    uint64_t placed = 0;
    int n_spilled = 0;
    for (int s = 0; s < n_shards; s++) {
        char file[64];
        snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        int n = 0;
        uint64_t bytes = 0;
        for (int i = 0; i < specs.n; i++) {
            if (specs.v[i].shard != s) continue;
            list[n++] = &specs.v[i];
            bytes += specs.v[i].n_bytes;
            json_object_object_add(map, specs.v[i].name, json_object_new_string(file));
        }
        const bool spill = opt->spill_dir && placed + bytes > room;
        if ((err = place_shard(opt->out_dir, spill ? spill_dir : NULL, file))) goto done;
        if (spill) {
            n_spilled++;
        } else {
            placed += bytes;
        }
        if ((err = open_shard(opt->out_dir, file, list, n, &shards[s]))) goto done;
    }
    if (n_spilled > 0)
        LOG_INFO("mkmodel: %d of %d shards in \"%s\" (linked from \"%s\")", n_spilled, n_shards,
                 opt->spill_dir, opt->out_dir);
    if ((err = generate_all(&specs, shards, opt->seed,
                            opt->threads > 0 ? opt->threads : (int) sysconf(_SC_NPROCESSORS_ONLN))))
        goto done;
    for (int s = 0; s < n_shards; s++) {
        const int fd = shards[s].fd;
        shards[s].fd = -1;
        if (close(fd) != 0) {
            LOG_ERROR("could not write \"%s\": %s", shards[s].path, strerror(errno));
            err = ERR_IO;
            goto done;
        }
    }
    cfg = make_config(p, &voc);
    quant = make_quant_config(p);
    gen = make_generation_config(&voc);
    if ((err = write_json(opt->out_dir, "model.safetensors.index.json", index))) goto done;
    if ((err = write_json(opt->out_dir, "config.json", cfg))) goto done;
    if ((err = write_json(opt->out_dir, "hf_quant_config.json", quant))) goto done;
    if ((err = write_json(opt->out_dir, "generation_config.json", gen))) goto done;
    LOG_INFO("wrote preset \"%s\" (seed %llu, %d layers, %d dense) to \"%s\": %d tensors, %.1f MB "
             "in %d shards in %.1f s",
             pname, (unsigned long long) opt->seed, p->layers, p->first_dense, opt->out_dir,
             specs.n, (double) total / 1e6, n_shards, clock_now_s() - t0);
done:
    for (int s = 0; shards && s < n_shards; s++)
        if (shards[s].fd >= 0) close(shards[s].fd);
    free(shards);
    json_object_put(cfg);
    json_object_put(quant);
    json_object_put(gen);
    json_object_put(index);
    free(list);
    free(specs.v);
    return err;
}
