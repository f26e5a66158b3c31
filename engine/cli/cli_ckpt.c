/*
 * cli_ckpt.c - `glmspark inspect` (describe and validate a checkpoint) and `glmspark mkmodel`
 * (write a small random one).
 *
 * inspect reads the config, opens every shard, resolves every linear weight's format
 * (which also validates its scales) and checks that each layer has the tensors its config
 * promises with the right shapes, then prints the architecture, the per-layer structure,
 * the storage format and bytes per tensor class and per layer. With --touch it also reads
 * every byte once and reports the load rate (ckpt_open + touch). With --pp N it prints the
 * pipeline split (pp.h): layers, weight bytes, KV room and the longest context per rank,
 * for --mem bytes per rank (default 121G) at --mem-util (default 0.9), the KV cache at
 * --context positions (default max_position_embeddings) stored as --kv-dtype (default fp8,
 * the layout of engine/model/kv_cache.h). Exit status 1 with the reason on stderr when anything is
 * wrong.
 */
#include "engine/cli/cli.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/model/checkpoint.h"
#include "engine/model/config.h"
#include "engine/model/model.h"
#include "engine/pipeline/pp.h"
#include "engine/shared/clock.h"
#include "engine/shared/num.h"
#include "engine/tools/mkmodel.h"

// ---------------------------------------------------------------------------
// Tensor classes

typedef enum TensorClass {
    CLASS_EMBED,
    CLASS_ATTN,
    CLASS_INDEXER,
    CLASS_DENSE_MLP,
    CLASS_ROUTER,
    CLASS_EXPERTS,
    CLASS_SHARED,
    CLASS_NORM,
    CLASS_LM_HEAD,
    CLASS_MTP,
    CLASS_OTHER,
    N_CLASSES,
} TensorClass;

static const char *const class_names[N_CLASSES] = {
    "embeddings",     "attention", "indexer", "dense MLP",   "router", "routed experts",
    "shared experts", "norms",     "lm_head", "MTP (extra)", "other",
};

typedef struct ClassStats {
    size_t n_bytes;
    int n_tensors;
    unsigned formats;  // bit per CkptLinearFormat, plus dtype bits shifted by 8 for non-linears
} ClassStats;

// Layer index of a "model.layers.N." name, or -1.
static int layer_of(const char *name)
{
    if (strncmp(name, "model.layers.", 13) != 0) return -1;
    char *end = NULL;
    const long v = strtol(name + 13, &end, 10);
    return end != name + 13 && *end == '.' && v >= 0 && v < 1 << 20 ? (int) v : -1;
}

static TensorClass classify(const ModelConfig *cfg, const char *name)
{
    const int layer = layer_of(name);
    if (!strncmp(name, "model.embed_tokens.", 19)) return CLASS_EMBED;
    if (!strncmp(name, "lm_head.", 8)) return CLASS_LM_HEAD;
    if (!strcmp(name, "model.norm.weight")) return CLASS_NORM;
    if (layer < 0) return CLASS_OTHER;
    if (strstr(name, ".self_attn.indexer.")) return CLASS_INDEXER;
    if (strstr(name, ".mlp.experts.")) return CLASS_EXPERTS;
    if (strstr(name, ".mlp.shared_experts.")) return CLASS_SHARED;
    if (strstr(name, ".mlp.gate.")) return CLASS_ROUTER;
    if (strstr(name, "layernorm.") || strstr(name, "norm.weight")) return CLASS_NORM;
    if (strstr(name, ".self_attn.")) return CLASS_ATTN;
    if (strstr(name, ".mlp.")) return CLASS_DENSE_MLP;
    if (layer >= cfg->n_layers) return CLASS_MTP;  // enorm, hnorm, eh_proj, shared_head
    return CLASS_OTHER;
}

static bool ends_with(const char *s, const char *suffix)
{
    const size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

// The format bit of tensor t: a linear weight resolves through ckpt_linear (validating its
// scales); scales and 1-D tensors report nothing or their dtype.
static Err tensor_format(const Ckpt *ck, const CkptTensor *t, unsigned *bits)
{
    char base[512];
    *bits = 0;
    const bool packed = ends_with(t->name, ".weight_packed");
    if (t->n_dims == 2 && (packed || ends_with(t->name, ".weight"))) {
        const size_t n = strlen(t->name) - (packed ? 14 : 7);
        if (n >= sizeof base) return ERR_OK;
        memcpy(base, t->name, n);
        base[n] = 0;
        const int rows = (int) t->shape[0];
        const int cols = (int) t->shape[1] * (t->dtype == CKPT_DTYPE_U8 ? 2 : 1);
        CkptLinear w;
        Err err = ckpt_linear(ck, base, rows, cols, &w);
        if (err) return err;
        *bits = 1u << w.format;
        return ERR_OK;
    }
    if (strstr(t->name, "scale")) return ERR_OK;  // counted with its weight's class
    switch (t->dtype) {  // floating vectors print like the linear formats of the same name
    case CKPT_DTYPE_F32:
        *bits = 1u << CKPT_LINEAR_F32;
        break;
    case CKPT_DTYPE_F16:
        *bits = 1u << CKPT_LINEAR_F16;
        break;
    case CKPT_DTYPE_BF16:
        *bits = 1u << CKPT_LINEAR_BF16;
        break;
    default:
        *bits = 1u << (8 + t->dtype);
        break;
    }
    return ERR_OK;
}

static void print_formats(unsigned bits)
{
    bool first = true;
    for (int f = 0; f < 8; f++) {
        if (bits & (1u << f)) {
            printf("%s%s", first ? "" : "+", ckpt_linear_format_name((CkptLinearFormat) f));
            first = false;
        }
    }
    for (int d = 0; d < 16; d++) {
        if (bits & (1u << (8 + d))) {
            printf("%s%s", first ? "" : "+", ckpt_dtype_name((CkptDtype) d));
            first = false;
        }
    }
    if (first) printf("-");
}

// ---------------------------------------------------------------------------
// Structural check: every layer has what the config promises.

static Err expect_linear(const Ckpt *ck, const char *base, int rows, int cols)
{
    CkptLinear w;
    return ckpt_linear(ck, base, rows, cols, &w);
}

static Err expect_vector(const Ckpt *ck, const char *name, int n)
{
    const int64_t shape[1] = {n};
    const CkptTensor *t;
    return ckpt_get(ck, name, 1, shape, CKPT_DTYPE_ANY, &t);
}

static Err check_layer(const Ckpt *ck, const ModelConfig *c, int i)
{
    Err err = ERR_OK;
    char b[64], n[256];
    const int H = c->hidden_size, qk = config_qk_head_dim(c);
#define N(...) (snprintf(n, sizeof n, __VA_ARGS__), n)
#define TRY(x)                       \
    do {                             \
        if ((err = (x))) return err; \
    } while (0)
    snprintf(b, sizeof b, "model.layers.%d", i);
    TRY(expect_vector(ck, N("%s.input_layernorm.weight", b), H));
    TRY(expect_vector(ck, N("%s.post_attention_layernorm.weight", b), H));
    if (c->q_lora_rank > 0) {
        TRY(expect_linear(ck, N("%s.self_attn.q_a_proj", b), c->q_lora_rank, H));
        TRY(expect_vector(ck, N("%s.self_attn.q_a_layernorm.weight", b), c->q_lora_rank));
        TRY(expect_linear(ck, N("%s.self_attn.q_b_proj", b), c->n_heads * qk, c->q_lora_rank));
    } else {
        TRY(expect_linear(ck, N("%s.self_attn.q_proj", b), c->n_heads * qk, H));
    }
    TRY(expect_linear(ck, N("%s.self_attn.kv_a_proj_with_mqa", b),
                      c->kv_lora_rank + c->qk_rope_head_dim, H));
    TRY(expect_vector(ck, N("%s.self_attn.kv_a_layernorm.weight", b), c->kv_lora_rank));
    TRY(expect_linear(ck, N("%s.self_attn.kv_b_proj", b),
                      c->n_heads * (c->qk_nope_head_dim + c->v_head_dim), c->kv_lora_rank));
    TRY(expect_linear(ck, N("%s.self_attn.o_proj", b), H, c->n_heads * c->v_head_dim));
    if (c->indexer[i] == CONFIG_INDEXER_FULL) {
        TRY(expect_linear(ck, N("%s.self_attn.indexer.wq_b", b),
                          c->index_n_heads * c->index_head_dim,
                          c->q_lora_rank > 0 ? c->q_lora_rank : H));
        TRY(expect_linear(ck, N("%s.self_attn.indexer.wk", b), c->index_head_dim, H));
        TRY(expect_vector(ck, N("%s.self_attn.indexer.k_norm.weight", b), c->index_head_dim));
        TRY(expect_vector(ck, N("%s.self_attn.indexer.k_norm.bias", b), c->index_head_dim));
        TRY(expect_linear(ck, N("%s.self_attn.indexer.weights_proj", b), c->index_n_heads, H));
    }
    if (c->mlp[i] == CONFIG_MLP_DENSE) {
        TRY(expect_linear(ck, N("%s.mlp.gate_proj", b), c->intermediate_size, H));
        TRY(expect_linear(ck, N("%s.mlp.up_proj", b), c->intermediate_size, H));
        TRY(expect_linear(ck, N("%s.mlp.down_proj", b), H, c->intermediate_size));
    } else {
        const int E = c->n_routed_experts, MI = c->moe_intermediate_size;
        TRY(expect_linear(ck, N("%s.mlp.gate", b), E, H));
        TRY(expect_vector(ck, N("%s.mlp.gate.e_score_correction_bias", b), E));
        if (c->n_shared_experts > 0) {
            const int SI = MI * c->n_shared_experts;
            TRY(expect_linear(ck, N("%s.mlp.shared_experts.gate_proj", b), SI, H));
            TRY(expect_linear(ck, N("%s.mlp.shared_experts.up_proj", b), SI, H));
            TRY(expect_linear(ck, N("%s.mlp.shared_experts.down_proj", b), H, SI));
        }
        for (int e = 0; e < E; e++) {
            TRY(expect_linear(ck, N("%s.mlp.experts.%d.gate_proj", b, e), MI, H));
            TRY(expect_linear(ck, N("%s.mlp.experts.%d.up_proj", b, e), MI, H));
            TRY(expect_linear(ck, N("%s.mlp.experts.%d.down_proj", b, e), H, MI));
        }
    }
    if (i >= c->n_layers) {
        TRY(expect_vector(ck, N("%s.enorm.weight", b), H));
        TRY(expect_vector(ck, N("%s.hnorm.weight", b), H));
        TRY(expect_linear(ck, N("%s.eh_proj", b), H, 2 * H));
        TRY(expect_vector(ck, N("%s.shared_head.norm.weight", b), H));
    }
#undef N
#undef TRY
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// inspect

static const char *quant_name(ConfigQuant q)
{
    switch (q) {
    case CONFIG_QUANT_NONE:
        return "none";
    case CONFIG_QUANT_NVFP4_MODELOPT:
        return "NVFP4 (ModelOpt)";
    case CONFIG_QUANT_NVFP4_CT:
        return "NVFP4 (compressed-tensors)";
    case CONFIG_QUANT_FP8:
        return "FP8";
    }
    return "?";
}

static void print_config(const ModelConfig *c)
{
    printf("architecture   %s (%s)\n", c->architecture[0] ? c->architecture : "?", c->model_type);
    printf("dims           vocab %d, hidden %d, %d layers + %d MTP, max positions %d\n",
           c->vocab_size, c->hidden_size, c->n_layers, c->n_mtp_layers, c->max_position_embeddings);
    printf("attention      MLA, %d heads, q_lora %d, kv_lora %d, qk_nope %d, qk_rope %d, v %d, "
           "rope theta %g%s\n",
           c->n_heads, c->q_lora_rank, c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim,
           c->v_head_dim, (double) c->rope_theta, c->rope_interleave ? " (interleaved)" : "");
    if (c->index_topk > 0) {
        printf("indexer        DSA, %d heads x %d, top-k %d\n", c->index_n_heads, c->index_head_dim,
               c->index_topk);
    } else {
        printf("indexer        none (dense attention)\n");
    }
    printf("mlp            dense intermediate %d; MoE %d routed experts, top %d, %d shared, "
           "intermediate %d, groups %d/%d, scaling %g\n",
           c->intermediate_size, c->n_routed_experts, c->n_experts_per_tok, c->n_shared_experts,
           c->moe_intermediate_size, c->n_group, c->topk_group, (double) c->routed_scaling_factor);
    printf("eos            ");
    for (int i = 0; i < c->n_eos_ids; i++) {
        printf("%s%d", i ? ", " : "", c->eos_ids[i]);
    }
    printf("%s; pad %d\n", c->n_eos_ids ? "" : "none", c->pad_id);
    printf("quantization   %s", quant_name(c->quant));
    if (c->quant != CONFIG_QUANT_NONE) printf(", group %d", c->quant_group_size);
    printf(", kv cache %s, %d exclude patterns\n", c->kv_cache_fp8 ? "fp8" : "bf16", c->n_excludes);
}

static int usage_inspect(void)
{
    fprintf(stderr, "usage: glmspark inspect --model DIR [--touch] [--pp N [--mem 121G] "
                    "[--mem-util 0.9] [--context N] [--kv-dtype fp8|bf16|f32]]\n"
                    "  --touch  read every tensor byte once and report the load rate\n");
    return 2;
}

int cli_inspect(int argc, char **argv)
{
    const char *dir = NULL;
    bool touch = false;
    int pp = 0, context = 0;
    KvDtype kv_dtype = KV_DTYPE_FP8;
    uint64_t mem = 121ull << 30;
    double mem_util = 0.9;
    for (int i = 1; i < argc; i++) {
        char *end = NULL;
        if (!strcmp(argv[i], "--model") && i + 1 < argc) {
            dir = argv[++i];
        } else if (!strcmp(argv[i], "--touch")) {
            touch = true;
        } else if (!strcmp(argv[i], "--pp") && i + 1 < argc) {
            if (!num_parse_int(argv[++i], 1, PP_MAX_WORLD, &pp)) return usage_inspect();
        } else if (!strcmp(argv[i], "--context") && i + 1 < argc) {
            if (!num_parse_int(argv[++i], 1, INT_MAX, &context)) return usage_inspect();
        } else if (!strcmp(argv[i], "--kv-dtype") && i + 1 < argc) {
            if (!kv_dtype_parse(argv[++i], &kv_dtype)) return usage_inspect();
        } else if (!strcmp(argv[i], "--mem") && i + 1 < argc) {
            if (!pp_parse_bytes(argv[++i], &mem)) return usage_inspect();
        } else if (!strcmp(argv[i], "--mem-util") && i + 1 < argc) {
            mem_util = strtod(argv[++i], &end);
            if (*end || !(mem_util > 0 && mem_util <= 1)) return usage_inspect();
        } else {
            return usage_inspect();
        }
    }
    if (!dir) return usage_inspect();
    int status = 1;
    Ckpt ck = {0};
    ModelConfig *cfg = malloc(sizeof *cfg);
    size_t *layer_bytes = NULL;
    if (!cfg) goto done;
    if (config_load(cfg, dir)) {
        fprintf(stderr, "glmspark inspect: bad config in \"%s\" (see the message above)\n", dir);
        goto done;
    }
    const double t0 = clock_now_s();
    if (ckpt_open(&ck, dir)) {
        fprintf(stderr, "glmspark inspect: bad checkpoint \"%s\" (see the message above)\n", dir);
        goto done;
    }
    model_resolve_indexers(cfg, &ck, dir);  // layers without indexer tensors: dense attention
    const double t_open = clock_now_s() - t0;
    const int n_layers = cfg->n_layers + cfg->n_mtp_layers;
    ClassStats classes[N_CLASSES] = {{0}};
    if (!(layer_bytes = calloc((size_t) n_layers + 1, sizeof *layer_bytes))) goto done;
    size_t total = 0;
    for (int i = 0; i < ck.n_tensors; i++) {
        const CkptTensor *t = &ck.tensors[i];
        unsigned bits = 0;
        if (tensor_format(&ck, t, &bits)) {
            fprintf(stderr, "glmspark inspect: bad tensor \"%s\" (see the message above)\n",
                    t->name);
            goto done;
        }
        const int layer = layer_of(t->name);
        TensorClass k = classify(cfg, t->name);
        // Everything in an MTP layer is reported as MTP, whatever its role.
        ClassStats *cs = &classes[layer >= cfg->n_layers ? CLASS_MTP : k];
        cs->n_bytes += t->n_bytes;
        cs->n_tensors++;
        cs->formats |= bits;
        if (layer >= 0 && layer < n_layers) layer_bytes[layer] += t->n_bytes;
        total += t->n_bytes;
    }
    for (int i = 0; i < n_layers; i++) {
        if (check_layer(&ck, cfg, i)) {
            fprintf(stderr,
                    "glmspark inspect: layer %d does not match config.json (see the "
                    "message above)\n",
                    i);
            goto done;
        }
    }
    const char *globals[] = {"model.embed_tokens.weight", "model.norm.weight"};
    for (int i = 0; i < 2; i++) {
        if (!ckpt_find(&ck, globals[i])) {
            fprintf(stderr, "glmspark inspect: tensor \"%s\" is missing from \"%s\"\n", globals[i],
                    dir);
            goto done;
        }
    }
    if (!cfg->tie_word_embeddings && !ckpt_find(&ck, "lm_head.weight")) {
        fprintf(stderr, "glmspark inspect: tensor \"lm_head.weight\" is missing from \"%s\"\n",
                dir);
        goto done;
    }

    printf("model          %s\n", dir);
    print_config(cfg);
    printf("\nlayer  mlp    indexer  bytes\n");
    for (int i = 0; i < n_layers; i++) {
        static const char *const ix[] = {"none", "full", "shared"};
        printf("%-6d %-6s %-8s %zu%s\n", i, cfg->mlp[i] == CONFIG_MLP_DENSE ? "dense" : "moe",
               ix[cfg->indexer[i]], layer_bytes[i], i >= cfg->n_layers ? "  (MTP)" : "");
    }
    printf("\nclass            tensors  bytes         format\n");
    for (int k = 0; k < N_CLASSES; k++) {
        if (!classes[k].n_tensors) continue;
        printf("%-16s %-8d %-13zu ", class_names[k], classes[k].n_tensors, classes[k].n_bytes);
        print_formats(classes[k].formats);
        printf("\n");
    }
    printf("\ntotal          %zu bytes (%.3f GB) in %d tensors, %d shards\n", total,
           (double) total / 1e9, ck.n_tensors, ck.n_shards);
    if (pp > 0) {
        if (!context)
            context = cfg->max_position_embeddings > 0 ? cfg->max_position_embeddings : 4096;
        PpPlan plan;
        if (pp_plan_model(dir, cfg, pp, mem, mem_util, context, kv_dtype, &plan)) {
            fprintf(stderr,
                    "glmspark inspect: cannot split \"%s\" over %d ranks (see the message "
                    "above)\n",
                    dir, pp);
            goto done;
        }
        printf("\npipeline       %d ranks, %.1f GiB each at %.2f, KV cache for %d positions "
               "(%s, %llu bytes per token per layer)\n",
               pp, mem / 1073741824.0, mem_util, context, kv_dtype_name(kv_dtype),
               (unsigned long long) pp_kv_bytes_per_token_layer(cfg, kv_dtype));
        printf("rank  layers        n   weights (GiB)  kv room (GiB)  longest context\n");
        for (int r = 0; r < pp; r++) {
            const PpRankPlan *p = &plan.ranks[r];
            char range[32];
            snprintf(range, sizeof range, "[%d, %d)", p->first_layer, p->last_layer);
            printf("%-5d %-13s %-3d %-14.2f %-14.2f %lld%s\n", r, range,
                   p->last_layer - p->first_layer, p->weight_bytes / 1073741824.0,
                   p->kv_room_bytes / 1073741824.0, (long long) p->max_context,
                   r == 0 && pp > 1 ? "  + embeddings"
                   : r == pp - 1    ? (pp > 1 ? "  + norm, lm_head, MTP" : "  (whole model)")
                                    : "");
        }
        if (!plan.fits) {
            fprintf(stderr,
                    "glmspark inspect: the model does not fit %d ranks of %.1f GiB with a "
                    "%d-position KV cache\n",
                    pp, mem / 1073741824.0, context);
            goto done;
        }
    }
    if (touch) {
        // CPU time next to wall time: on a shared machine the wall figure mostly measures
        // the other tenants.
        CkptTouchStats st;
        const clock_t c0 = clock();
        ckpt_touch(&ck, &st);
        const double cpu = (double) (clock() - c0) / CLOCKS_PER_SEC;
        printf("load           open %.3f s + touch %.3f s for %.3f GB: %.2f GB/s (touch alone "
               "%.2f GB/s, checksum %016llx)\n",
               t_open, st.seconds, (double) st.n_bytes / 1e9,
               (double) st.n_bytes / 1e9 / (t_open + st.seconds), st.gb_per_s,
               (unsigned long long) st.checksum);
        printf("load cpu       touch %.3f s cpu: %.2f GB per cpu-second\n", cpu,
               cpu > 0 ? (double) st.n_bytes / 1e9 / cpu : 0.0);
    }
    status = 0;
done:
    ckpt_close(&ck);
    free(layer_bytes);
    free(cfg);
    return status;
}

// ---------------------------------------------------------------------------
// mkmodel

static int usage_mkmodel(void)
{
    fprintf(stderr, "usage: glmspark mkmodel --out DIR [--preset NAME] [--seed S] "
                    "[--tokenizer FILE] [--layers N] [--dense N] [--mtp N] [--threads N] "
                    "[--spill DIR]\n"
                    "  presets:");
    for (const char *const *p = mkmodel_presets(); *p; p++) {
        fprintf(stderr, " %s", *p);
    }
    fprintf(stderr, " (default: default)\n");
    return 2;
}

int cli_mkmodel(int argc, char **argv)
{
    MkmodelOptions opt = {.preset = "default", .seed = 0};
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) return usage_mkmodel();
        if (!strcmp(argv[i], "--out")) {
            opt.out_dir = argv[++i];
        } else if (!strcmp(argv[i], "--preset")) {
            opt.preset = argv[++i];
        } else if (!strcmp(argv[i], "--tokenizer")) {
            opt.tokenizer = argv[++i];
        } else if (!strcmp(argv[i], "--seed")) {
            char *end = NULL;
            opt.seed = strtoull(argv[++i], &end, 0);
            if (!*argv[i] || *end) return usage_mkmodel();
        } else if (!strcmp(argv[i], "--layers")) {
            if (!num_parse_int(argv[++i], 1, 256, &opt.layers)) return usage_mkmodel();
        } else if (!strcmp(argv[i], "--dense")) {
            if (!num_parse_int(argv[++i], 0, 256, &opt.dense)) return usage_mkmodel();
            opt.set_dense = true;
        } else if (!strcmp(argv[i], "--mtp")) {
            if (!num_parse_int(argv[++i], 0, 3, &opt.mtp)) return usage_mkmodel();
            opt.set_mtp = true;
        } else if (!strcmp(argv[i], "--threads")) {
            if (!num_parse_int(argv[++i], 1, 1024, &opt.threads)) return usage_mkmodel();
        } else if (!strcmp(argv[i], "--spill")) {
            opt.spill_dir = argv[++i];
        } else {
            return usage_mkmodel();
        }
    }
    if (!opt.out_dir) return usage_mkmodel();
    if (mkmodel_write(&opt)) {
        fprintf(stderr, "glmspark mkmodel: could not write \"%s\" (see the message above)\n",
                opt.out_dir);
        return 1;
    }
    return 0;
}
