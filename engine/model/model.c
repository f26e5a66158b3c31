/*
 * model.c - load a GlmMoeDsa checkpoint into per-layer weight views and run the forward
 * pass through the backend's ops (backend.h).
 *
 * Reference: transformers 5.17 modeling_glm_moe_dsa.py. Per layer, with h = RMSNorm(x):
 *   q      = q_b(RMSNorm_1e-6(q_a(h)))            [n, H, nope | rope]
 *   kv     = kv_a(h) -> latent = RMSNorm_1e-6(kv[:kv_lora]), k_pe = kv[kv_lora:]
 *   RoPE (interleaved pairs) on q's rope part and on k_pe; latent and k_pe go to the cache
 *   full DSA layer: iq = wq_b(q_a normed) [n, Hi, Di], ik = LayerNorm_1e-6(wk(h)) [n, Di],
 *          RoPE on the first `rope` dims of both, ik to the cache, w = weights_proj(h);
 *          selection = top-k over visible keys of sum_h w_h Hi^-0.5 ReLU(iq_h . ik Di^-0.5);
 *          the tie rule (torch.topk has none): among equal scores the later position wins,
 *          on every backend (many keys score exactly 0 when few index heads are live)
 *   shared DSA layer: the selection of the most recent full layer (same call, same tokens)
 *   a full layer without indexer tensors in the checkpoint, and the shared layers after it,
 *          attend densely (model_resolve_indexers)
 *   attn   = softmax(q . k * scale) v over the selection (all visible keys without DSA)
 *   x     += o_proj(attn)
 *   x     += MLP(RMSNorm(x)): dense silu(gate) * up -> down, or MoE (sigmoid router with
 *            correction bias and group limit, renormalised, x routed_scaling_factor) plus
 *            the shared experts
 * then logits = lm_head(RMSNorm(x)). The MTP layer, which transformers ignores, runs in
 * model_mtp_forward() (model.h) with its own one-layer KV cache.
 *
 * Batches and stages (model_forward_batch): the projections, norms, MLP and MoE run over
 * every token of every sequence at once; cache writes, the DSA selection and attention run
 * per sequence on its segment. Each op computes a token's values from that token alone
 * (backend_cpu.c), so a sequence's numbers do not depend on its batch. A pipeline stage
 * holds layers [first_layer, last_layer); its KV cache holds those layers only (cache
 * layer = l - first_layer), and the activations it hands on carry the residual stream and
 * the DSA selection, which a stage starting on a shared indexer layer reuses.
 */
#include "engine/model/model.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The forward pass's buffers. The struct is host memory; every pointer but the *_host ones
// is backend memory (Backend.alloc).
struct ModelWork {
    int n_cap;      // tokens the buffers hold
    int *pos_host;  // [3 n] positions, each token's sequence index, lengths: host copy
    int *act_host;  // [n * (2 + topk) + 1] DSA state staging for stage hand-off, host
    int *pos;       // [n]
    int *seq_of;    // [n] each token's sequence (index into the batch's seqs)
    int *len;       // [n] pos + 1
    int *tok;       // [n] token ids
    float *logits;  // [logits_cap, vocab] (logits_ensure: the rows a call's head writes)
    int logits_cap;
    float *x;       // [n, hidden] residual stream
    float *h;       // [n, hidden] normed input of the current block
    float *qa;      // [n, q_lora]
    float *q;       // [n, H, nope + rope]
    float *kva;     // [n, kv_lora + rope]
    float *attn;    // [n, H, v]
    float *tmp;     // [n, hidden]
    float *tmp2;    // [n, hidden]
    float *iq;      // [n, Hi, Di]
    float *ik;      // [n, Di]
    float *iw;      // [n, Hi]
    int *sel;       // [n, index_topk] positions selected by the last full layer
    int *n_sel;     // [n]
    float *g;       // [n, max intermediate]
    float *rl;      // [n, E] router logits
    int *ridx;      // [n, K]
    float *rw;      // [n, K]
};

// ---------------------------------------------------------------------------
// Loading

enum { NAME_MAX_LEN = 192 };

static float to_f32(const CkptTensor *t, size_t i)
{
    const uint8_t *p = (const uint8_t *) t->data;
    switch (t->dtype) {
    case CKPT_DTYPE_F32: {
        float v;
        memcpy(&v, p + 4 * i, sizeof v);
        return v;
    }
    case CKPT_DTYPE_BF16: {
        const uint32_t bits = ((uint32_t) p[2 * i] | (uint32_t) p[2 * i + 1] << 8) << 16;
        float v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    case CKPT_DTYPE_F16: {
        const unsigned h = (unsigned) p[2 * i] | (unsigned) p[2 * i + 1] << 8;
        const int e = (h >> 10) & 31, mant = h & 1023;
        const float v = e == 0    ? ldexpf((float) mant, -24)
                        : e == 31 ? (mant ? NAN : INFINITY)
                                  : ldexpf((float) (mant | 1024), e - 25);
        return (h >> 15) ? -v : v;
    }
    default:
        ASSERT(!"vector dtype checked by ckpt_get");
        return 0.0f;
    }
}

// A 1-D float vector of n elements (f32/bf16/f16 in the checkpoint), widened to fp32 into
// backend memory at *out.
static Err load_vec(Model *m, const char *name, int n, float **out)
{
    const int64_t shape[1] = {n};
    const unsigned dtypes = 1u << CKPT_DTYPE_F32 | 1u << CKPT_DTYPE_BF16 | 1u << CKPT_DTYPE_F16;
    const CkptTensor *t = NULL;
    Err err = ckpt_get(&m->ckpt, name, 1, shape, dtypes, &t);
    if (err) return err;
    float *host = malloc((size_t) n * sizeof *host);
    float *v = m->be->alloc(m->be, (size_t) n * sizeof *v);
    if (!host || !v) {
        free(host);
        m->be->free_mem(m->be, v);
        LOG_ERROR("out of memory loading \"%s\" (%d floats)", name, n);
        return ERR_NOMEM;
    }
    for (int i = 0; i < n; i++)
        host[i] = to_f32(t, (size_t) i);
    m->be->upload(m->be, v, host, (size_t) n * sizeof *v);
    free(host);
    *out = v;
    return ERR_OK;
}

// After the backend bound linear `base` (out): when it took its own copy (a device backend
// rewrites the pointers away from `mapped`), drop the file's pages from this process and the
// page cache: on unified memory (DGX Spark) they would compete with the GPU. The CPU backend
// computes from the mapping itself, so nothing is dropped there.
static void release_bound(Model *m, const char *base, const CkptLinear *out, const void *mapped)
{
    if (out->data == mapped) return;
    static const char *const parts[] = {
        ".weight",         ".weight_packed",       ".weight_scale",
        ".weight_scale_2", ".weight_global_scale", ".weight_scale_inv"};
    char name[NAME_MAX_LEN];
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        snprintf(name, sizeof name, "%s%s", base, parts[i]);
        const CkptTensor *t = ckpt_find(&m->ckpt, name);
        if (t) ckpt_release(&m->ckpt, t);
    }
}

// Resolve linear weight `base` and hand it to the backend; with mla, it is a kv_b_proj, shown
// to bind_kv_b first.
static Err load_linear_as(Model *m, const char *base, int rows, int cols, const BackendMla *mla,
                          CkptLinear *out)
{
    Err err = ckpt_linear(&m->ckpt, base, rows, cols, out);
    if (err) return err;
    const void *mapped = out->data;
    if (mla && (err = m->be->bind_kv_b(m->be, out, mla))) return err;
    if ((err = m->be->bind_linear(m->be, out))) return err;
    release_bound(m, base, out, mapped);
    return ERR_OK;
}

static Err load_linear(Model *m, const char *base, int rows, int cols, CkptLinear *out)
{
    return load_linear_as(m, base, rows, cols, NULL, out);
}

// The routed experts of layer l: resolved one by one, bound together (bind_experts).
static Err load_experts(Model *m, int l, CkptLinear *experts)
{
    const ModelConfig *c = &m->cfg;
    const int E = c->n_routed_experts, I = c->moe_intermediate_size, hidden = c->hidden_size;
    static const char *const parts[3] = {"gate_proj", "up_proj", "down_proj"};
    char name[NAME_MAX_LEN];
    const void **mapped = malloc((size_t) 3 * E * sizeof *mapped);
    if (!mapped) return ERR_NOMEM;
    Err err = ERR_OK;
    for (int i = 0; i < 3 * E && !err; i++) {
        const int k = i % 3, rows = k == 2 ? hidden : I, cols = k == 2 ? I : hidden;
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s", l, i / 3, parts[k]);
        err = ckpt_linear(&m->ckpt, name, rows, cols, &experts[i]);
        mapped[i] = experts[i].data;
    }
    if (!err) err = m->be->bind_experts(m->be, experts, E);
    for (int i = 0; i < 3 * E && !err; i++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s", l, i / 3, parts[i % 3]);
        release_bound(m, name, &experts[i], mapped[i]);
    }
    free(mapped);
    return err;
}

#define NAME(...) (snprintf(name, sizeof name, __VA_ARGS__), name)

// The MLA shapes of every attention layer.
static BackendMla layer_mla(const ModelConfig *c)
{
    return (BackendMla){
        .n_heads = c->n_heads,
        .qk_nope = c->qk_nope_head_dim,
        .qk_rope = c->qk_rope_head_dim,
        .v_dim = c->v_head_dim,
        .kv_lora = c->kv_lora_rank,
        // YaRN's mscale^2 would multiply this; config_load() refuses every rope_type but
        // "default" (GLM-5's), so the plain 1/sqrt(qk_head_dim) is the whole story.
        .scale = (float) (1.0 / sqrt((double) config_qk_head_dim(c))),
    };
}

// A backend whose ops run kernels/ (Backend.kernels: the CUDA one) takes what they take; a
// model outside is refused at load, naming the limit, instead of failing in an op.
static Err check_kernel_shapes(const ModelConfig *c, const Backend *be, const char *dir)
{
    if (!be->kernels) return ERR_OK;
    const BackendMla mla = layer_mla(c);
    const char *what = NULL;
    if (!backend_mla_shape_tuned(&mla))
        what = "MLA wider than GLM-5's (kv_lora_rank <= 512, qk_rope_head_dim <= 64, "
               "qk_nope_head_dim <= 192)";
    else if (c->index_topk > 0
             && (c->index_head_dim > DSA_MAX_DIM || c->index_n_heads > DSA_MAX_HEADS))
        what = "a DSA indexer wider than kernels/dsa.h takes (index_head_dim <= 128, "
               "index_n_heads <= 32)";
    else if (c->n_routed_experts > 0
             && (c->n_routed_experts > 512 || c->n_experts_per_tok > 16
                 || c->moe_intermediate_size % 8 || c->hidden_size % 8))
        what = "routed experts kernels/moe.h does not take (at most 512, top-k <= 16, "
               "hidden_size and moe_intermediate_size multiples of 8)";
    if (!what) return ERR_OK;
    LOG_ERROR("\"%s\": the %s backend runs kernels/ only, and this model has %s", dir, be->name,
              what);
    return ERR_INVAL;
}

static Err load_layer(Model *m, int l, ModelLayer *L)
{
    const ModelConfig *c = &m->cfg;
    char name[NAME_MAX_LEN];
    Err err = ERR_OK;
    const int hidden = c->hidden_size, H = c->n_heads, qk = config_qk_head_dim(c);
    const char *p = "model.layers";
    const BackendMla mla = layer_mla(c);

    if ((err = load_vec(m, NAME("%s.%d.input_layernorm.weight", p, l), hidden, &L->input_norm)))
        return err;
    if ((err = load_vec(m, NAME("%s.%d.post_attention_layernorm.weight", p, l), hidden,
                        &L->post_norm)))
        return err;

    if (c->q_lora_rank > 0) {
        if ((err = load_linear(m, NAME("%s.%d.self_attn.q_a_proj", p, l), c->q_lora_rank, hidden,
                               &L->q_a))
            || (err = load_vec(m, NAME("%s.%d.self_attn.q_a_layernorm.weight", p, l),
                               c->q_lora_rank, &L->q_a_norm))
            || (err = load_linear(m, NAME("%s.%d.self_attn.q_b_proj", p, l), H * qk, c->q_lora_rank,
                                  &L->q_b)))
            return err;
    } else if ((err = load_linear(m, NAME("%s.%d.self_attn.q_proj", p, l), H * qk, hidden,
                                  &L->q_proj))) {
        return err;
    }
    if ((err = load_linear(m, NAME("%s.%d.self_attn.kv_a_proj_with_mqa", p, l),
                           c->kv_lora_rank + c->qk_rope_head_dim, hidden, &L->kv_a))
        || (err = load_vec(m, NAME("%s.%d.self_attn.kv_a_layernorm.weight", p, l), c->kv_lora_rank,
                           &L->kv_a_norm))
        || (err = load_linear_as(m, NAME("%s.%d.self_attn.kv_b_proj", p, l),
                                 H * (c->qk_nope_head_dim + c->v_head_dim), c->kv_lora_rank, &mla,
                                 &L->kv_b))
        || (err = load_linear(m, NAME("%s.%d.self_attn.o_proj", p, l), hidden, H * c->v_head_dim,
                              &L->o_proj)))
        return err;

    L->has_indexer = c->indexer[l] == CONFIG_INDEXER_FULL;
    if (L->has_indexer) {
        const int Hi = c->index_n_heads, Di = c->index_head_dim;
        if ((err = load_linear(m, NAME("%s.%d.self_attn.indexer.wq_b", p, l), Hi * Di,
                               c->q_lora_rank, &L->idx_wq_b))
            || (err = load_linear(m, NAME("%s.%d.self_attn.indexer.wk", p, l), Di, hidden,
                                  &L->idx_wk))
            || (err = load_vec(m, NAME("%s.%d.self_attn.indexer.k_norm.weight", p, l), Di,
                               &L->idx_k_norm))
            || (err = load_vec(m, NAME("%s.%d.self_attn.indexer.k_norm.bias", p, l), Di,
                               &L->idx_k_bias))
            || (err = load_linear(m, NAME("%s.%d.self_attn.indexer.weights_proj", p, l), Hi, hidden,
                                  &L->idx_weights)))
            return err;
    }

    L->is_moe = c->mlp[l] == CONFIG_MLP_MOE;
    if (!L->is_moe) {
        const int I = c->intermediate_size;
        if ((err = load_linear(m, NAME("%s.%d.mlp.gate_proj", p, l), I, hidden, &L->gate))
            || (err = load_linear(m, NAME("%s.%d.mlp.up_proj", p, l), I, hidden, &L->up))
            || (err = load_linear(m, NAME("%s.%d.mlp.down_proj", p, l), hidden, I, &L->down)))
            return err;
        return ERR_OK;
    }
    const int E = c->n_routed_experts, I = c->moe_intermediate_size;
    if ((err = load_linear(m, NAME("%s.%d.mlp.gate", p, l), E, hidden, &L->router))
        || (err = load_vec(m, NAME("%s.%d.mlp.gate.e_score_correction_bias", p, l), E,
                           &L->router_bias)))
        return err;
    L->experts = calloc((size_t) E * 3, sizeof *L->experts);
    if (!L->experts) return ERR_NOMEM;
    if ((err = load_experts(m, l, L->experts))) return err;
    if (c->n_shared_experts > 0) {
        const int S = I * c->n_shared_experts;
        if ((err = load_linear(m, NAME("%s.%d.mlp.shared_experts.gate_proj", p, l), S, hidden,
                               &L->sh_gate))
            || (err = load_linear(m, NAME("%s.%d.mlp.shared_experts.up_proj", p, l), S, hidden,
                                  &L->sh_up))
            || (err = load_linear(m, NAME("%s.%d.mlp.shared_experts.down_proj", p, l), hidden, S,
                                  &L->sh_down)))
            return err;
    }
    return ERR_OK;
}

static void free_layer(Backend *be, ModelLayer *L)
{
    be->free_mem(be, L->input_norm);
    be->free_mem(be, L->post_norm);
    be->free_mem(be, L->q_a_norm);
    be->free_mem(be, L->kv_a_norm);
    be->free_mem(be, L->idx_k_norm);
    be->free_mem(be, L->idx_k_bias);
    be->free_mem(be, L->router_bias);
    free(L->experts);
    memset(L, 0, sizeof *L);
}

// Structural checks transformers would fail on (or that we cannot run), with the field named.
static Err check_config(const ModelConfig *c, const char *dir)
{
    const char *why = NULL;
    if (c->vocab_size < 1 || c->hidden_size < 1 || c->n_layers < 1 || c->n_heads < 1)
        why = "vocab_size, hidden_size, num_hidden_layers and num_attention_heads must be > 0";
    else if (c->kv_lora_rank < 1 || c->qk_rope_head_dim < 2 || c->qk_rope_head_dim % 2
             || c->qk_nope_head_dim < 0 || c->v_head_dim < 1)
        why = "kv_lora_rank, v_head_dim must be > 0 and qk_rope_head_dim even";
    else if (c->n_layers + c->n_mtp_layers > CONFIG_MAX_LAYERS
             || c->n_layers + c->n_mtp_layers > KV_MAX_LAYERS)
        why = "too many layers";
    if (why) {
        LOG_ERROR("cannot run the model in \"%s\": %s", dir, why);
        return ERR_INVAL;
    }
    bool seen_full = false, any_indexer = false;
    for (int l = 0; l < c->n_layers; l++) {
        if (c->indexer[l] == CONFIG_INDEXER_FULL) seen_full = any_indexer = true;
        if (c->indexer[l] == CONFIG_INDEXER_SHARED && !seen_full) {
            LOG_ERROR("cannot run the model in \"%s\": layer %d is a shared DSA layer with no "
                      "full layer before it (indexer_types)",
                      dir, l);
            return ERR_INVAL;
        }
        if (c->mlp[l] == CONFIG_MLP_MOE
            && (c->n_routed_experts < 1 || c->n_experts_per_tok < 1
                || c->n_experts_per_tok > c->n_routed_experts || c->n_group < 1
                || c->n_routed_experts % c->n_group || c->topk_group < 1
                || c->topk_group > c->n_group || c->moe_intermediate_size < 1)) {
            LOG_ERROR("cannot run the model in \"%s\": layer %d is MoE but n_routed_experts %d, "
                      "num_experts_per_tok %d, n_group %d, topk_group %d do not fit",
                      dir, l, c->n_routed_experts, c->n_experts_per_tok, c->n_group, c->topk_group);
            return ERR_INVAL;
        }
        if (c->mlp[l] == CONFIG_MLP_DENSE && c->intermediate_size < 1) {
            LOG_ERROR("cannot run the model in \"%s\": intermediate_size must be > 0", dir);
            return ERR_INVAL;
        }
    }
    if (any_indexer
        && (c->q_lora_rank < 1 || c->index_n_heads < 1 || c->index_topk < 1
            || c->index_head_dim < c->qk_rope_head_dim)) {
        LOG_ERROR("cannot run the model in \"%s\": the DSA indexer needs q_lora_rank > 0, "
                  "index_n_heads > 0, index_topk > 0 and index_head_dim >= qk_rope_head_dim",
                  dir);
        return ERR_INVAL;
    }
    return ERR_OK;
}

static bool has_tensor_base(const Ckpt *ck, const char *base)
{
    char name[NAME_MAX_LEN];
    return ckpt_find(ck, NAME("%s.weight", base)) || ckpt_find(ck, NAME("%s.weight_packed", base));
}

typedef struct StageFilter {
    const Model *m;  // first_layer, last_layer, has_* and cfg set
    bool load_mtp;
    bool *has_indexer;  // [CONFIG_MAX_LAYERS]: layer l has tensors "...l.self_attn.indexer.*"
} StageFilter;

// Note in has_indexer[] the layer of an indexer tensor name.
static void note_indexer_tensor(const char *name, bool *has_indexer)
{
    int l = -1, n = 0;
    if (sscanf(name, "model.layers.%d.self_attn.indexer.%n", &l, &n) == 1 && n > 0 && l >= 0
        && l < CONFIG_MAX_LAYERS)
        has_indexer[l] = true;
}

// ckpt_open_filtered() predicate: the tensors one pipeline stage needs. It sees every name
// of the checkpoint (the index lists them all), so it also notes which layers have indexer
// tensors: every rank then decides the same dense layers.
static bool stage_keeps(const char *name, void *user)
{
    const StageFilter *f = user;
    const Model *m = f->m;
    const char *layers = "model.layers.";
    note_indexer_tensor(name, f->has_indexer);
    if (strncmp(name, layers, strlen(layers)) == 0) {
        char *end;
        const long l = strtol(name + strlen(layers), &end, 10);
        if (*end != '.') return false;
        if (l >= m->first_layer && l < m->last_layer) return true;
        return l >= m->cfg.n_layers && m->has_head && f->load_mtp;
    }
    if (strncmp(name, "model.embed_tokens.", 19) == 0)
        return m->has_embed || (m->has_head && (m->cfg.tie_word_embeddings || f->load_mtp));
    if (strncmp(name, "model.norm.", 11) == 0 || strncmp(name, "lm_head.", 8) == 0)
        return m->has_head;
    return false;
}

// A full DSA layer whose checkpoint has no indexer tensors (REAP checkpoints may drop them, as
// the reference deployment runs with DSA disabled) runs dense attention, and so do the shared
// layers that would reuse its selection; the MTP layers likewise. One notice names them.
static void resolve_dense_layers(ModelConfig *c, const bool *has_indexer, const char *dir)
{
    char list[512];
    size_t len = 0;
    int n_dense = 0;
    bool source_dense = false;
    list[0] = 0;
    for (int l = 0; l < c->n_layers + c->n_mtp_layers; l++) {
        if (l == c->n_layers) source_dense = false;  // MTP layers select for themselves
        if (c->indexer[l] == CONFIG_INDEXER_FULL) source_dense = !has_indexer[l];
        if (c->indexer[l] == CONFIG_INDEXER_NONE || !source_dense) continue;
        c->indexer[l] = CONFIG_INDEXER_NONE;
        n_dense++;
        if (len + 24 < sizeof list)
            len += (size_t) snprintf(list + len, sizeof list - len, "%s%d%s", len ? ", " : "", l,
                                     l >= c->n_layers ? " (MTP)" : "");
    }
    if (n_dense)
        LOG_WARN("model \"%s\": %d DSA layer%s without indexer tensors run%s dense attention: "
                 "layer%s %s",
                 dir, n_dense, n_dense > 1 ? "s" : "", n_dense > 1 ? "" : "s",
                 n_dense > 1 ? "s" : "", list);
}

void model_resolve_indexers(ModelConfig *c, const Ckpt *ck, const char *dir)
{
    bool has_indexer[CONFIG_MAX_LAYERS] = {0};
    for (int i = 0; i < ck->n_tensors; i++)
        note_indexer_tensor(ck->tensors[i].name, has_indexer);
    resolve_dense_layers(c, has_indexer, dir);
}

Err model_load(Model *m, const char *dir, const ModelOptions *opts, Backend *be)
{
    memset(m, 0, sizeof *m);
    const ModelOptions defaults = {0};
    if (!opts) opts = &defaults;
    char name[NAME_MAX_LEN];
    Err err = config_load(&m->cfg, dir);
    if (err) goto done;
    if ((err = check_config(&m->cfg, dir))) goto done;
    if ((err = check_kernel_shapes(&m->cfg, be, dir))) goto done;
    m->be = be;
    const ModelConfig *c = &m->cfg;
    m->first_layer = opts->first_layer;
    m->last_layer = opts->last_layer > 0 ? opts->last_layer : c->n_layers;
    if (m->first_layer < 0 || m->first_layer >= m->last_layer || m->last_layer > c->n_layers) {
        LOG_ERROR("layer range [%d, %d) is not within the %d layers of \"%s\"", opts->first_layer,
                  m->last_layer, c->n_layers, dir);
        err = ERR_INVAL;
        goto done;
    }
    m->has_embed = m->first_layer == 0;
    m->has_head = m->last_layer == c->n_layers;
    const bool whole = m->has_embed && m->has_head;
    bool has_indexer[CONFIG_MAX_LAYERS] = {0};
    StageFilter filter = {m, opts->load_mtp, has_indexer};
    if ((err = whole ? ckpt_open(&m->ckpt, dir)
                     : ckpt_open_filtered(&m->ckpt, dir, stage_keeps, &filter)))
        goto done;
    if (whole)
        model_resolve_indexers(&m->cfg, &m->ckpt, dir);
    else
        resolve_dense_layers(&m->cfg, has_indexer, dir);

    const bool tied_head = c->tie_word_embeddings && !has_tensor_base(&m->ckpt, "lm_head");
    // The last stage's MTP layer embeds the next token with the shared table too.
    const bool mtp_embed = opts->load_mtp && c->n_mtp_layers > 0;
    if ((m->has_embed || (m->has_head && (tied_head || mtp_embed)))
        && (err = load_linear(m, "model.embed_tokens", c->vocab_size, c->hidden_size, &m->embed)))
        goto done;
    if (m->has_head) {
        if ((err = load_vec(m, "model.norm.weight", c->hidden_size, &m->final_norm))) goto done;
        if (tied_head) {
            m->lm_head = m->embed;
        } else if ((err = load_linear(m, "lm_head", c->vocab_size, c->hidden_size, &m->lm_head))) {
            goto done;
        }
    }

    const int n_load = c->n_layers + (opts->load_mtp && m->has_head ? c->n_mtp_layers : 0);
    m->layers = calloc((size_t) n_load, sizeof *m->layers);
    if (!m->layers) {
        err = ERR_NOMEM;
        goto done;
    }
    m->n_layers_loaded = n_load;  // layers outside the range stay zeroed (free_layer is safe)
    for (int l = m->first_layer; l < n_load; l++) {
        if (l >= m->last_layer && l < c->n_layers) continue;
        if ((err = load_layer(m, l, &m->layers[l]))) goto done;
    }
    if (n_load > c->n_layers) {
        // The first MTP block's own tensors (model_mtp_forward runs that one).
        const int l = c->n_layers;
        if (!(m->mtp = calloc(1, sizeof *m->mtp))) {
            err = ERR_NOMEM;
            goto done;
        }
        if ((err = load_vec(m, NAME("model.layers.%d.enorm.weight", l), c->hidden_size,
                            &m->mtp->enorm))
            || (err = load_vec(m, NAME("model.layers.%d.hnorm.weight", l), c->hidden_size,
                               &m->mtp->hnorm))
            || (err = load_vec(m, NAME("model.layers.%d.shared_head.norm.weight", l),
                               c->hidden_size, &m->mtp->head_norm))
            || (err = load_linear(m, NAME("model.layers.%d.eh_proj", l), c->hidden_size,
                                  2 * c->hidden_size, &m->mtp->eh_proj)))
            goto done;
    }
    for (int l = c->n_layers + 1; l < n_load; l++) {
        // Further MTP blocks: we only check that they are present and well-shaped.
        const CkptTensor *t = NULL;
        const int64_t vec[1] = {c->hidden_size};
        const unsigned dt = 1u << CKPT_DTYPE_F32 | 1u << CKPT_DTYPE_BF16 | 1u << CKPT_DTYPE_F16;
        CkptLinear eh;
        if ((err = ckpt_get(&m->ckpt, NAME("model.layers.%d.enorm.weight", l), 1, vec, dt, &t))
            || (err = ckpt_get(&m->ckpt, NAME("model.layers.%d.hnorm.weight", l), 1, vec, dt, &t))
            || (err = ckpt_get(&m->ckpt, NAME("model.layers.%d.shared_head.norm.weight", l), 1, vec,
                               dt, &t))
            || (err = ckpt_linear(&m->ckpt, NAME("model.layers.%d.eh_proj", l), c->hidden_size,
                                  2 * c->hidden_size, &eh)))
            goto done;
    }
    LOG_INFO("model \"%s\": layers [%d, %d) of %d, hidden %d, vocab %d, %d experts, %.1f MB "
             "mapped from %d shards",
             dir, m->first_layer, m->last_layer, c->n_layers, c->hidden_size, c->vocab_size,
             c->n_routed_experts, m->ckpt.n_bytes_mapped / 1e6, m->ckpt.n_shards);
    err = ERR_OK;

done:
    if (err) model_free(m);
    return err;
}

static void work_free(Backend *be, ModelWork *w)
{
    if (!w) return;
    free(w->pos_host);
    free(w->act_host);
    be->free_mem(be, w->pos);
    be->free_mem(be, w->seq_of);
    be->free_mem(be, w->len);
    be->free_mem(be, w->tok);
    be->free_mem(be, w->logits);
    be->free_mem(be, w->x);
    be->free_mem(be, w->h);
    be->free_mem(be, w->qa);
    be->free_mem(be, w->q);
    be->free_mem(be, w->kva);
    be->free_mem(be, w->attn);
    be->free_mem(be, w->tmp);
    be->free_mem(be, w->tmp2);
    be->free_mem(be, w->iq);
    be->free_mem(be, w->ik);
    be->free_mem(be, w->iw);
    be->free_mem(be, w->sel);
    be->free_mem(be, w->n_sel);
    be->free_mem(be, w->g);
    be->free_mem(be, w->rl);
    be->free_mem(be, w->ridx);
    be->free_mem(be, w->rw);
    free(w);
}

void model_free(Model *m)
{
    if (!m) return;
    if (m->layers)
        for (int l = 0; l < m->n_layers_loaded; l++)
            free_layer(m->be, &m->layers[l]);
    free(m->layers);
    if (m->be) {
        m->be->free_mem(m->be, m->final_norm);
        if (m->mtp) {
            m->be->free_mem(m->be, m->mtp->enorm);
            m->be->free_mem(m->be, m->mtp->hnorm);
            m->be->free_mem(m->be, m->mtp->head_norm);
            m->be->free_mem(m->be, m->mtp->cat);
        }
        work_free(m->be, m->work);
    }
    free(m->mtp);
    ckpt_close(&m->ckpt);
    memset(m, 0, sizeof *m);
}

KvCacheParams model_kv_params(const Model *m, int n_blocks, int block_size)
{
    const ModelConfig *c = &m->cfg;
    const int first = m->first_layer, last = m->last_layer > 0 ? m->last_layer : c->n_layers;
    KvCacheParams p = {
        .n_layers = last - first,
        .block_size = block_size,
        .n_blocks = n_blocks,
        .kv_lora = c->kv_lora_rank,
        .rope_dim = c->qk_rope_head_dim,
        .index_dim = c->index_head_dim,
    };
    for (int l = first; l < last && l - first < KV_MAX_LAYERS; l++)
        p.has_index[l - first] = c->indexer[l] == CONFIG_INDEXER_FULL;
    return p;
}

// ---------------------------------------------------------------------------
// Workspace

static Err work_ensure(Model *m, int n)
{
    if (m->work && m->work->n_cap >= n) return ERR_OK;
    Backend *be = m->be;
    work_free(be, m->work);
    m->work = NULL;
    const ModelConfig *c = &m->cfg;
    ModelWork *w = calloc(1, sizeof *w);
    if (!w) return ERR_NOMEM;
    const size_t N = (size_t) n, hidden = (size_t) c->hidden_size, H = (size_t) c->n_heads;
    const size_t qk = (size_t) config_qk_head_dim(c);
    const size_t inter_max =
        (size_t) (c->intermediate_size > c->moe_intermediate_size * c->n_shared_experts
                      ? c->intermediate_size
                      : c->moe_intermediate_size * c->n_shared_experts);
    const size_t topk = c->index_topk > 0 ? (size_t) c->index_topk : 1;
    const size_t E = c->n_routed_experts > 0 ? (size_t) c->n_routed_experts : 1;
    const size_t K = c->n_experts_per_tok > 0 ? (size_t) c->n_experts_per_tok : 1;
    const size_t Hi = c->index_n_heads > 0 ? (size_t) c->index_n_heads : 1;
    const size_t Di = c->index_head_dim > 0 ? (size_t) c->index_head_dim : 1;
    w->n_cap = n;
    w->pos_host = malloc(3 * N * sizeof *w->pos_host);
    w->act_host = malloc((N * (1 + topk) + 1) * sizeof *w->act_host);
    w->pos = be->alloc(be, N * sizeof(int));
    w->seq_of = be->alloc(be, N * sizeof(int));
    w->len = be->alloc(be, N * sizeof(int));
    w->tok = be->alloc(be, N * sizeof(int));
    w->x = be->alloc(be, N * hidden * sizeof(float));
    w->h = be->alloc(be, N * hidden * sizeof(float));
    const size_t q_lora = c->q_lora_rank > 0 ? (size_t) c->q_lora_rank : 1;
    w->qa = be->alloc(be, N * q_lora * sizeof(float));
    w->q = be->alloc(be, N * H * qk * sizeof(float));
    const size_t kv_width = (size_t) (c->kv_lora_rank + c->qk_rope_head_dim);
    w->kva = be->alloc(be, N * kv_width * sizeof(float));
    w->attn = be->alloc(be, N * H * (size_t) c->v_head_dim * sizeof(float));
    w->tmp = be->alloc(be, N * hidden * sizeof(float));
    w->tmp2 = be->alloc(be, N * hidden * sizeof(float));
    w->iq = be->alloc(be, N * Hi * Di * sizeof(float));
    w->ik = be->alloc(be, N * Di * sizeof(float));
    w->iw = be->alloc(be, N * Hi * sizeof(float));
    w->sel = be->alloc(be, N * topk * sizeof(int));
    w->n_sel = be->alloc(be, N * sizeof(int));
    w->g = be->alloc(be, N * (inter_max ? inter_max : 1) * sizeof(float));
    w->rl = be->alloc(be, N * E * sizeof(float));
    w->ridx = be->alloc(be, N * K * sizeof(int));
    w->rw = be->alloc(be, N * K * sizeof(float));
    if (!w->pos_host || !w->act_host || !w->pos || !w->seq_of || !w->len || !w->tok
        || !w->x || !w->h || !w->qa || !w->q || !w->kva || !w->attn || !w->tmp || !w->tmp2 || !w->iq
        || !w->ik || !w->iw || !w->sel || !w->n_sel || !w->g || !w->rl || !w->ridx
        || !w->rw) {
        LOG_ERROR("could not allocate the forward workspace for %d tokens", n);
        work_free(be, w);
        return ERR_NOMEM;
    }
    m->work = w;
    return ERR_OK;
}

// w->logits for `rows` rows of the head. Sized apart from the other buffers: a prefill chunk
// of n tokens projects only its sequences' last rows, and n x vocab floats would be 2.5 GB at
// 4,096 tokens and GLM-5's vocabulary. Grows by doubling (at least 16 rows), so that a batch
// that gains a sequence rarely reallocates (which re-records the backend's graphs). Call
// before graph_begin.
static Err logits_ensure(Model *m, int rows)
{
    ModelWork *w = m->work;
    if (w->logits_cap >= rows) return ERR_OK;
    int cap = w->logits_cap * 2 > rows ? w->logits_cap * 2 : rows;
    if (cap < 16) cap = 16;
    m->be->free_mem(m->be, w->logits);
    w->logits_cap = 0;
    if (!(w->logits = m->be->alloc(m->be, (size_t) cap * m->cfg.vocab_size * sizeof(float)))) {
        LOG_ERROR("could not allocate logits for %d rows of %d", cap, m->cfg.vocab_size);
        return ERR_NOMEM;
    }
    w->logits_cap = cap;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Forward

// Positions and sequence indices of the batch's tokens (sequence i's n_new[i] rows follow
// sequence i-1's), uploaded; the ops' view of them.
static BackendSeqs upload_positions(Model *m, const ModelBatch *b, int n)
{
    ModelWork *w = m->work;
    int *seq_of = w->pos_host + n, *len = seq_of + n;
    for (int i = 0, off = 0; i < b->n_seqs; off += b->n_new[i++])
        for (int t = 0; t < b->n_new[i]; t++) {
            w->pos_host[off + t] = b->seqs[i]->n_tokens + t;
            seq_of[off + t] = i;
            len[off + t] = b->seqs[i]->n_tokens + t + 1;
        }
    m->be->upload(m->be, w->pos, w->pos_host, (size_t) n * sizeof(int));
    m->be->upload(m->be, w->seq_of, seq_of, (size_t) n * sizeof(int));
    m->be->upload(m->be, w->len, len, (size_t) n * sizeof(int));
    return (BackendSeqs){b->seqs, b->n_seqs, w->pos, w->seq_of, w->len, n};
}

// Attention for layer l over a batch: projections, cache writes, DSA selection and attention,
// each over all n tokens of all sequences at once.
static void attention_block(Model *m, KvCache *kv, const BackendSeqs *s, int l, bool *has_sel)
{
    const int n = s->n;
    const ModelConfig *c = &m->cfg;
    const ModelLayer *L = &m->layers[l];
    ModelWork *w = m->work;
    Backend *be = m->be;
    const int kv_width = c->kv_lora_rank + c->qk_rope_head_dim;

    // The input norm and every projection of its output at once (one launch where the GEMV
    // allows).
    BackendProduct in[BACKEND_MAX_GROUP] = {
        c->q_lora_rank > 0 ? (BackendProduct){w->qa, &L->q_a, NULL}
                           : (BackendProduct){w->q, &L->q_proj, NULL},
        {w->kva, &L->kv_a, NULL},
    };
    int n_in = 2;
    if (L->has_indexer) {
        in[n_in++] = (BackendProduct){w->ik, &L->idx_wk, NULL};
        in[n_in++] = (BackendProduct){w->iw, &L->idx_weights, NULL};
    }
    be->norm_matmul_group(be, in, n_in, w->h, w->x, L->input_norm, c->rms_norm_eps, n);
    if (c->q_lora_rank > 0) {
        be->rmsnorm(be, w->qa, w->qa, L->q_a_norm, n, c->q_lora_rank, c->q_lora_rank,
                    c->attn_norm_eps);
        be->matmul(be, w->q, &L->q_b, w->qa, n);
    }
    // The stage's cache holds its own layers only; the MTP layer has a cache of its own.
    const int kl = l >= c->n_layers ? l - c->n_layers : l - m->first_layer;
    const int topk = c->index_topk > 0 ? c->index_topk : 1;
    // The latent: kv_a_layernorm on c_kv, RoPE on k_pe, stored (one launch on a GPU).
    const KvIn lat_in = {L->kv_a_norm, NULL, c->kv_lora_rank, c->attn_norm_eps,
                         c->kv_lora_rank, c->qk_rope_head_dim, c->rope_theta};
    be->kv_write(be, kv, s, kl, 0, w->kva, kv_width, &lat_in);

    if (L->has_indexer) {
        const int Hi = c->index_n_heads, Di = c->index_head_dim;
        const BackendDsa dsa = {Hi, Di, c->index_topk};
        be->matmul(be, w->iq, &L->idx_wq_b, w->qa, n);
        be->rope(be, w->iq, n, Hi, Hi * Di, Di, 0, c->qk_rope_head_dim, w->pos, c->rope_theta);
        // The index key: LayerNorm, RoPE on its first dims, stored.
        const KvIn key_in = {L->idx_k_norm, L->idx_k_bias, Di, 1e-6f, 0, c->qk_rope_head_dim,
                             c->rope_theta};
        be->kv_write(be, kv, s, kl, kv_width, w->ik, Di, &key_in);
        be->dsa_topk(be, w->sel, w->n_sel, w->iq, w->iw, kv, s, kl, &dsa);
        *has_sel = true;
    }
    const bool use_sel = c->indexer[l] != CONFIG_INDEXER_NONE;
    ASSERT(!use_sel || *has_sel);  // check_config: no shared layer before a full one

    BackendMla mla = layer_mla(c);
    mla.rope_theta = c->rope_theta;  // q's RoPE in the attention's query split
    be->mla_attention(be, w->attn, w->q, &L->kv_b, kv, s, kl, use_sel ? w->sel : NULL,
                      use_sel ? w->n_sel : NULL, topk, &mla);
    be->matmul_add(be, w->x, &L->o_proj, w->attn, n);
}

static void mlp_block(Model *m, int l, int n)
{
    const ModelConfig *c = &m->cfg;
    const ModelLayer *L = &m->layers[l];
    ModelWork *w = m->work;
    Backend *be = m->be;

    if (!L->is_moe) {
        const BackendProduct glu = {w->g, &L->gate, &L->up};  // SwiGLU
        be->norm_matmul_group(be, &glu, 1, w->h, w->x, L->post_norm, c->rms_norm_eps, n);
        be->matmul_add(be, w->x, &L->down, w->g, n);
        return;
    }
    const BackendRoute route = {
        .n_experts = c->n_routed_experts,
        .top_k = c->n_experts_per_tok,
        .n_group = c->n_group,
        .topk_group = c->topk_group,
        .norm_topk_prob = c->norm_topk_prob,
        .routed_scaling_factor = c->routed_scaling_factor,
    };
    // The post-attention norm, the router's product and the shared expert's SwiGLU of its
    // output at once (h: the routed experts' input).
    const BackendProduct in[] = {{w->rl, &L->router, NULL}, {w->g, &L->sh_gate, &L->sh_up}};
    be->norm_matmul_group(be, in, c->n_shared_experts > 0 ? 2 : 1, w->h, w->x, L->post_norm,
                          c->rms_norm_eps, n);
    // x += shared expert (in the down GEMV's store), then the routing and x += the routed
    // experts' sum (in the op): no separate residual add.
    if (c->n_shared_experts > 0) be->matmul_add(be, w->x, &L->sh_down, w->g, n);
    be->route_moe(be, w->x, w->h, n, w->ridx, w->rw, w->rl, L->router_bias, &route, L->experts,
                  c->n_routed_experts, w->x);
}

size_t model_act_bytes(const Model *m, int n)
{
    const ModelConfig *c = &m->cfg;
    const size_t topk = c->index_topk > 0 ? (size_t) c->index_topk : 1;
    return (size_t) n * (size_t) c->hidden_size * sizeof(float)
           + (1 + (size_t) n * (1 + topk)) * sizeof(int32_t);
}

// A backend whose ops run kernels/ reads bf16 or fp8 caches in blocks of MLA_BLOCK only
// (backends.h backend_kind_check refuses others before a command or the engine loads; this
// is the forward pass's own check). whose: the cache, for the message.
static Err check_kv_for_kernels(const Model *m, const KvCache *kv, const char *whose)
{
    if (!m->be->kernels || (kv->params.dtype != KV_DTYPE_F32 && kv->params.block_size == MLA_BLOCK))
        return ERR_OK;
    LOG_ERROR("the %s backend's KV cache is bf16 or fp8 in blocks of %d; %s is %s in blocks of %d",
              m->be->name, MLA_BLOCK, whose, kv_dtype_name(kv->params.dtype),
              kv->params.block_size);
    return ERR_INVAL;
}

Err model_forward_batch(Model *m, KvCache *kv, const ModelBatch *b, const int *tokens,
                        const void *act_in, void *act_out, float *logits, ModelLogitRows rows)
{
    const ModelConfig *c = &m->cfg;
    ASSERT(b->n_seqs > 0 && kv->params.n_layers >= m->last_layer - m->first_layer);
    ASSERT(m->has_embed ? tokens != NULL : act_in != NULL);
    ASSERT(m->has_head || (act_out && rows == MODEL_LOGITS_NONE));
    if (check_kv_for_kernels(m, kv, "this one")) return ERR_INVAL;
    int n = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        ASSERT(b->n_new[i] > 0);
        n += b->n_new[i];
    }
    if (m->has_embed)
        for (int t = 0; t < n; t++)
            if (tokens[t] < 0 || tokens[t] >= c->vocab_size) {
                LOG_ERROR("token id %d at index %d is outside the vocabulary (%d)", tokens[t], t,
                          c->vocab_size);
                return ERR_INVAL;
            }
    // Reserve for every sequence before running anything; blocks reserved by an earlier
    // sequence when a later one fails stay with it (capacity only, n_tokens is unchanged).
    Err err = ERR_OK;
    for (int i = 0; i < b->n_seqs; i++)
        if ((err = kv_seq_reserve(kv, b->seqs[i], b->seqs[i]->n_tokens + b->n_new[i]))) return err;
    if ((err = work_ensure(m, n))) return err;
    if (logits && rows != MODEL_LOGITS_NONE && m->has_head
        && (err = logits_ensure(m, rows == MODEL_LOGITS_ALL ? n : b->n_seqs)))
        return err;
    ModelWork *w = m->work;
    Backend *be = m->be;
    const int hidden = c->hidden_size;
    const size_t topk = c->index_topk > 0 ? (size_t) c->index_topk : 1;
    const size_t x_bytes = (size_t) n * hidden * sizeof(float);
    const BackendSeqs seqs = upload_positions(m, b, n);

    bool has_sel = false;
    if (m->has_embed) {
        be->upload(be, w->tok, tokens, (size_t) n * sizeof(int));
        be->embed(be, w->x, &m->embed, w->tok, n);
    } else {
        // act_in: x, has_sel, n_sel [n], sel [n, topk] (model_act_bytes).
        be->upload(be, w->x, act_in, x_bytes);
        memcpy(w->act_host, (const char *) act_in + x_bytes,
               (1 + (size_t) n * (1 + topk)) * sizeof(int32_t));
        has_sel = w->act_host[0] != 0;
        if (has_sel) {
            be->upload(be, w->n_sel, w->act_host + 1, (size_t) n * sizeof(int));
            be->upload(be, w->sel, w->act_host + 1 + n, (size_t) n * topk * sizeof(int));
        }
    }
    // Small batches (decode) run the layers, and the head when each sequence's last row is
    // wanted, as one recorded unit where the backend can (backend.h, graph_begin); the key
    // names what the ops' arguments depend on.
    enum { GRAPH_MAX_TOKENS = 64 };
    const bool graphed = be->graph_begin && n <= GRAPH_MAX_TOKENS;
    const bool head_last = logits && rows == MODEL_LOGITS_LAST;
    ASSERT(!head_last || m->has_head);
    bool replay = false;
    if (graphed) {
        unsigned long long key[5 + GRAPH_MAX_TOKENS];
        int nk = 0;
        key[nk++] = (unsigned long long) (uintptr_t) m;
        key[nk++] = (unsigned long long) (uintptr_t) w;
        key[nk++] = (unsigned long long) n;
        key[nk++] = has_sel;
        key[nk++] = head_last;
        for (int i = 0; i < b->n_seqs; i++)
            key[nk++] = (unsigned long long) b->n_new[i];
        replay = be->graph_begin(be, kv, b->seqs, b->n_seqs, n, key, nk);
    }
    if (replay) {
        for (int l = m->first_layer; l < m->last_layer; l++)
            if (m->layers[l].has_indexer) has_sel = true;  // as attention_block sets it
    } else {
        for (int l = m->first_layer; l < m->last_layer; l++) {
            attention_block(m, kv, &seqs, l, &has_sel);
            mlp_block(m, l, n);
        }
        // One row per sequence (its last token) into row i of w->logits; each is normed alone
        // and projected with matmul_rows, as a single-sequence call would, so the numbers do
        // not depend on the batch (the weight is still read once for all rows).
        for (int i = 0, off = 0; head_last && i < b->n_seqs; off += b->n_new[i++]) {
            const int last = off + b->n_new[i] - 1;
            be->rmsnorm(be, w->h + (size_t) i * hidden, w->x + (size_t) last * hidden,
                        m->final_norm, 1, hidden, hidden, c->rms_norm_eps);
        }
        if (head_last) be->matmul_rows(be, w->logits, &m->lm_head, w->h, b->n_seqs);
    }
    if (graphed) be->graph_end(be);
    for (int i = 0; i < b->n_seqs; i++)
        b->seqs[i]->n_tokens += b->n_new[i];

    if (act_out) {
        be->download(be, act_out, w->x, x_bytes);
        w->act_host[0] = has_sel;
        if (has_sel) {
            be->download(be, w->act_host + 1, w->n_sel, (size_t) n * sizeof(int));
            be->download(be, w->act_host + 1 + n, w->sel, (size_t) n * topk * sizeof(int));
        } else {
            memset(w->act_host + 1, 0, (size_t) n * (1 + topk) * sizeof(int));
        }
        memcpy((char *) act_out + x_bytes, w->act_host,
               (1 + (size_t) n * (1 + topk)) * sizeof(int32_t));
    }
    if (logits && rows != MODEL_LOGITS_NONE) {
        ASSERT(m->has_head);
        const size_t V = (size_t) c->vocab_size;
        if (rows == MODEL_LOGITS_ALL) {
            be->rmsnorm(be, w->h, w->x, m->final_norm, n, hidden, hidden, c->rms_norm_eps);
            be->matmul(be, w->logits, &m->lm_head, w->h, n);
            be->download(be, logits, w->logits, (size_t) n * V * sizeof(float));
        } else {  // computed after the layers (head_last)
            be->download(be, logits, w->logits, (size_t) b->n_seqs * V * sizeof(float));
        }
    }
    return ERR_OK;
}

Err model_forward(Model *m, KvCache *kv, KvSeq *seq, const int *tokens, int n, float *logits,
                  bool all_logits)
{
    ASSERT(n > 0 && m->has_embed && m->has_head);
    KvSeq *seqs[1] = {seq};
    const ModelBatch b = {1, seqs, &n};
    return model_forward_batch(m, kv, &b, tokens, NULL, NULL, logits,
                               !logits      ? MODEL_LOGITS_NONE
                               : all_logits ? MODEL_LOGITS_ALL
                                            : MODEL_LOGITS_LAST);
}

// ---------------------------------------------------------------------------
// MTP layer

void model_head(Model *m, float *y, const float *h, int n)
{
    (n == 1 ? m->be->matmul_rows : m->be->matmul)(m->be, y, &m->lm_head, h, n);
}

Err model_forward_hidden(Model *m, KvCache *kv, KvSeq *seq, const int *tokens, int n, float *logits,
                         bool all_logits, float *hidden)
{
    ASSERT(n > 0 && m->has_embed && m->has_head && logits && hidden);
    KvSeq *seqs[1] = {seq};
    const ModelBatch b = {1, seqs, &n};
    Err err = model_forward_batch(m, kv, &b, tokens, NULL, NULL, NULL, MODEL_LOGITS_NONE);
    if (err || (err = logits_ensure(m, all_logits ? n : 1))) return err;
    // The head as model_forward_batch runs it: all rows at once, or the last alone.
    const ModelConfig *c = &m->cfg;
    Backend *be = m->be;
    ModelWork *w = m->work;
    const size_t hidden_n = (size_t) c->hidden_size, V = (size_t) c->vocab_size;
    const int n_logits = all_logits ? n : 1;
    be->rmsnorm(be, w->h, w->x, m->final_norm, n, c->hidden_size, c->hidden_size, c->rms_norm_eps);
    be->download(be, hidden, w->h, (size_t) n * hidden_n * sizeof(float));
    model_head(m, w->logits, w->h + (size_t) (n - n_logits) * hidden_n, n_logits);
    be->download(be, logits, w->logits, (size_t) n_logits * V * sizeof(float));
    return ERR_OK;
}

KvCacheParams model_mtp_kv_params(const Model *m, int n_blocks, int block_size)
{
    const ModelConfig *c = &m->cfg;
    KvCacheParams p = {
        .n_layers = 1,
        .block_size = block_size,
        .n_blocks = n_blocks,
        .kv_lora = c->kv_lora_rank,
        .rope_dim = c->qk_rope_head_dim,
        .index_dim = c->index_head_dim,
    };
    p.has_index[0] = c->indexer[c->n_layers] == CONFIG_INDEXER_FULL;
    return p;
}

Err model_mtp_forward_batch(Model *m, KvCache *kv, const ModelBatch *b, const int *tokens,
                            const float *h_prev, float *logits, float *h_out, bool all_rows)
{
    const ModelConfig *c = &m->cfg;
    ASSERT(b->n_seqs > 0 && tokens && h_prev);
    if (!m->mtp || !m->has_head || !m->embed.data) {
        LOG_ERROR("the model has no MTP layer loaded (num_nextn_predict_layers %d)",
                  c->n_mtp_layers);
        return ERR_INVAL;
    }
    ASSERT(kv->params.n_layers == 1);
    if (check_kv_for_kernels(m, kv, "the MTP layer's")) return ERR_INVAL;
    int n = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        ASSERT(b->n_new[i] > 0);
        n += b->n_new[i];
    }
    for (int t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= c->vocab_size) {
            LOG_ERROR("MTP token id %d at index %d is outside the vocabulary (%d)", tokens[t], t,
                      c->vocab_size);
            return ERR_INVAL;
        }
    // Reserve for every sequence first, as model_forward_batch does.
    Err err = ERR_OK;
    for (int i = 0; i < b->n_seqs; i++)
        if ((err = kv_seq_reserve(kv, b->seqs[i], b->seqs[i]->n_tokens + b->n_new[i]))) return err;
    if ((err = work_ensure(m, n))) return err;
    if (logits && (err = logits_ensure(m, all_rows ? n : b->n_seqs))) return err;
    Backend *be = m->be;
    ModelWork *w = m->work;
    ModelMtp *mt = m->mtp;
    const int hidden = c->hidden_size;
    const size_t row = (size_t) hidden * sizeof(float);
    if (mt->cat_cap < n) {
        be->free_mem(be, mt->cat);
        mt->cat_cap = 0;
        if (!(mt->cat = be->alloc(be, (size_t) n * 2 * row))) {
            LOG_ERROR("could not allocate the MTP input for %d tokens", n);
            return ERR_NOMEM;
        }
        mt->cat_cap = n;
    }
    const BackendSeqs s = upload_positions(m, b, n);
    be->upload(be, w->tok, tokens, (size_t) n * sizeof(int));
    be->embed(be, w->tmp, &m->embed, w->tok, n);
    float *zero = NULL;
    for (int i = 0, off = 0; i < b->n_seqs; off += b->n_new[i++]) {
        if (b->seqs[i]->n_tokens != 0) continue;
        // vLLM: inputs_embeds[positions == 0] = 0 (RMSNorm then keeps the row zero).
        if (!zero && !(zero = calloc((size_t) hidden, sizeof *zero))) return ERR_NOMEM;
        be->upload(be, w->tmp + (size_t) off * hidden, zero, row);
    }
    free(zero);
    be->upload(be, w->tmp2, h_prev, (size_t) n * row);
    // cat[t] = [RMSNorm(e_t, enorm), RMSNorm(h_t, hnorm)]: row by row, as the two halves
    // of a row are interleaved with the other rows' in cat.
    for (int t = 0; t < n; t++) {
        float *dst = mt->cat + (size_t) t * 2 * hidden;
        be->rmsnorm(be, dst, w->tmp + (size_t) t * hidden, mt->enorm, 1, hidden, hidden,
                    c->rms_norm_eps);
        be->rmsnorm(be, dst + hidden, w->tmp2 + (size_t) t * hidden, mt->hnorm, 1, hidden, hidden,
                    c->rms_norm_eps);
    }
    be->matmul(be, w->x, &mt->eh_proj, mt->cat, n);

    bool has_sel = false;
    attention_block(m, kv, &s, c->n_layers, &has_sel);
    mlp_block(m, c->n_layers, n);
    for (int i = 0; i < b->n_seqs; i++)
        b->seqs[i]->n_tokens += b->n_new[i];

    const size_t V = (size_t) c->vocab_size;
    if (all_rows) {
        if (h_out) be->download(be, h_out, w->x, (size_t) n * row);
        if (logits) {
            be->rmsnorm(be, w->h, w->x, mt->head_norm, n, hidden, hidden, c->rms_norm_eps);
            be->matmul(be, w->logits, &m->lm_head, w->h, n);
            be->download(be, logits, w->logits, (size_t) n * V * sizeof(float));
        }
        return ERR_OK;
    }
    // Each sequence's last row, normed alone into row i of w->h and projected with
    // matmul_rows (the weight read once for all rows, each row's numbers as alone).
    const bool one_row_each = n == b->n_seqs;
    if (h_out && one_row_each) be->download(be, h_out, w->x, (size_t) n * row);
    for (int i = 0, off = 0; i < b->n_seqs; off += b->n_new[i++]) {
        const float *x = w->x + (size_t) (off + b->n_new[i] - 1) * hidden;
        if (h_out && !one_row_each) be->download(be, h_out + (size_t) i * hidden, x, row);
        if (logits)
            be->rmsnorm(be, w->h + (size_t) i * hidden, x, mt->head_norm, 1, hidden, hidden,
                        c->rms_norm_eps);
    }
    if (logits) {
        be->matmul_rows(be, w->logits, &m->lm_head, w->h, b->n_seqs);
        be->download(be, logits, w->logits, (size_t) b->n_seqs * V * sizeof(float));
    }
    return ERR_OK;
}

Err model_mtp_forward(Model *m, KvCache *kv, KvSeq *seq, const int *tokens, const float *h_prev,
                      int n, float *logits, float *h_out, bool all_rows)
{
    ASSERT(n > 0);
    KvSeq *seqs[1] = {seq};
    const ModelBatch b = {1, seqs, &n};
    return model_mtp_forward_batch(m, kv, &b, tokens, h_prev, logits, h_out, all_rows);
}
