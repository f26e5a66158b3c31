/*
 * config.c - config.json (+ hf_quant_config.json) into a ModelConfig, with the semantics of
 * transformers' GlmMoeDsaConfig (5.17).
 *
 * Every field has transformers' default when absent or null (q_lora_rank: null means "no
 * q_lora", stored as 0). The per-layer arrays are resolved here, in transformers' order:
 * indexer_types, else index_topk_pattern ("FSS..." or a list), else the rule
 * full iff max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (defaults 2 and 1,
 * so every layer is "full"); mlp_layer_types, else first_k_dense_replace dense layers. MTP
 * layers (num_nextn_predict_layers, indices n_layers..) are MoE with a full indexer, as vLLM
 * builds them. Quantization comes from hf_quant_config.json when given, else from
 * config.json's quantization_config (ModelOpt, compressed-tensors, FP8).
 *
 * Validation is strict on types and ranges, because the numbers size allocations later: a
 * field of the wrong type is ERR_FORMAT, a value we cannot serve (zero or negative dims,
 * sizes beyond the bounds below, products that overflow int) is ERR_INVAL. Every message
 * names the origin (file) and the field.
 */
#include "engine/model/config.h"

#include <errno.h>
#include <json-c/json.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"
#include "kernels/rope_format.h"

// Bounds on single dimensions: a generous ceiling above every GLM/DeepSeek model, low enough
// that products of two of them fit comfortably in int64 and derived sizes in int.
enum {
    CONFIG_MAX_DIM = 1 << 17,    // hidden, intermediate, lora ranks
    CONFIG_MAX_HEAD_DIM = 4096,  // per-head dims
    CONFIG_MAX_HEADS = 1024,
    CONFIG_MAX_VOCAB = 1 << 22,
    CONFIG_MAX_EXPERTS = 1 << 14,
    CONFIG_MAX_POSITIONS = 1 << 26,
};

// ---------------------------------------------------------------------------
// Typed field access

typedef struct Ctx {
    const char *origin;
} Ctx;

// The member `key` of obj, or NULL when absent or JSON null.
static json_object *member(json_object *obj, const char *key)
{
    json_object *v = NULL;
    if (!obj || !json_object_object_get_ex(obj, key, &v)) return NULL;
    return json_object_is_type(v, json_type_null) ? NULL : v;
}

// Integer field in [lo, hi]; *out keeps its default when absent. A double with an integral
// value is accepted (some tools write 16.0).
static Err get_int(const Ctx *c, json_object *obj, const char *key, int lo, int hi, int *out)
{
    json_object *v = member(obj, key);
    if (!v) return ERR_OK;
    int64_t x;
    if (json_object_is_type(v, json_type_int)) {
        x = json_object_get_int64(v);
    } else if (json_object_is_type(v, json_type_double)) {
        const double d = json_object_get_double(v);
        if (!(d >= -9e15 && d <= 9e15) || d != floor(d)) {
            LOG_ERROR("%s: field \"%s\" must be an integer", c->origin, key);
            return ERR_FORMAT;
        }
        x = (int64_t) d;
    } else {
        LOG_ERROR("%s: field \"%s\" must be an integer, not %s", c->origin, key,
                  json_type_to_name(json_object_get_type(v)));
        return ERR_FORMAT;
    }
    if (x < lo || x > hi) {
        LOG_ERROR("%s: field \"%s\" = %lld is outside [%d, %d]", c->origin, key, (long long) x, lo,
                  hi);
        return ERR_INVAL;
    }
    *out = (int) x;
    return ERR_OK;
}

static Err get_float(const Ctx *c, json_object *obj, const char *key, double lo, double hi,
                     float *out)
{
    json_object *v = member(obj, key);
    if (!v) return ERR_OK;
    if (!json_object_is_type(v, json_type_int) && !json_object_is_type(v, json_type_double)) {
        LOG_ERROR("%s: field \"%s\" must be a number, not %s", c->origin, key,
                  json_type_to_name(json_object_get_type(v)));
        return ERR_FORMAT;
    }
    const double d = json_object_get_double(v);
    if (!(d >= lo && d <= hi)) {
        LOG_ERROR("%s: field \"%s\" = %g is outside [%g, %g]", c->origin, key, d, lo, hi);
        return ERR_INVAL;
    }
    *out = (float) d;
    return ERR_OK;
}

static Err get_bool(const Ctx *c, json_object *obj, const char *key, bool *out)
{
    json_object *v = member(obj, key);
    if (!v) return ERR_OK;
    if (!json_object_is_type(v, json_type_boolean)) {
        LOG_ERROR("%s: field \"%s\" must be true or false, not %s", c->origin, key,
                  json_type_to_name(json_object_get_type(v)));
        return ERR_FORMAT;
    }
    *out = json_object_get_boolean(v);
    return ERR_OK;
}

// String field; *out stays NULL when absent. The string is owned by obj.
static Err get_string(const Ctx *c, json_object *obj, const char *key, const char **out)
{
    json_object *v = member(obj, key);
    *out = NULL;
    if (!v) return ERR_OK;
    if (!json_object_is_type(v, json_type_string)) {
        LOG_ERROR("%s: field \"%s\" must be a string, not %s", c->origin, key,
                  json_type_to_name(json_object_get_type(v)));
        return ERR_FORMAT;
    }
    *out = json_object_get_string(v);
    return ERR_OK;
}

static void copy_string(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

// Parse len bytes of JSON into an object; NULL (and a logged error) unless the text is one
// JSON object followed only by whitespace.
static json_object *parse_object(const char *text, size_t len, const char *origin)
{
    if (len > (size_t) INT_MAX) {
        LOG_ERROR("%s: %zu bytes is too large for a config file", origin, len);
        return NULL;
    }
    json_tokener *tok = json_tokener_new();
    if (!tok) return NULL;
    json_object *obj = json_tokener_parse_ex(tok, text, (int) len);
    const enum json_tokener_error jerr = json_tokener_get_error(tok);
    size_t used = json_tokener_get_parse_end(tok);
    json_tokener_free(tok);
    if (!obj || jerr != json_tokener_success) {
        LOG_ERROR("%s: invalid JSON: %s", origin,
                  jerr == json_tokener_continue ? "unexpected end of input"
                                                : json_tokener_error_desc(jerr));
        json_object_put(obj);
        return NULL;
    }
    for (; used < len; used++) {
        const char ch = text[used];
        if (ch != ' ' && ch != '\t' && ch != '\n' && ch != '\r' && ch != '\0') {
            LOG_ERROR("%s: invalid JSON: trailing bytes after the object", origin);
            json_object_put(obj);
            return NULL;
        }
    }
    if (!json_object_is_type(obj, json_type_object)) {
        LOG_ERROR("%s: the top level must be a JSON object", origin);
        json_object_put(obj);
        return NULL;
    }
    return obj;
}

// ---------------------------------------------------------------------------
// Per-layer arrays

static Err parse_indexer_entry(const Ctx *c, const char *field, int i, const char *s,
                               ConfigIndexer *out)
{
    const size_t len = strlen(s);  // compared by length first: gcc -O3 warns on short buffers
    if ((len == 4 && !memcmp(s, "full", 4)) || (len == 1 && s[0] == 'F')) {
        *out = CONFIG_INDEXER_FULL;
    } else if ((len == 6 && !memcmp(s, "shared", 6)) || (len == 1 && s[0] == 'S')) {
        *out = CONFIG_INDEXER_SHARED;
    } else {
        LOG_ERROR("%s: field \"%s\"[%d] = \"%.32s\" is neither \"full\" nor \"shared\"", c->origin,
                  field, i, s);
        return ERR_FORMAT;
    }
    return ERR_OK;
}

// A per-layer field has one entry per layer, the MTP layers' entries optional.
static Err check_layer_count(const Ctx *c, const char *field, size_t len, const ModelConfig *cfg)
{
    const int n = cfg->n_layers;
    if (len != (size_t) n && len != (size_t) (n + cfg->n_mtp_layers)) {
        LOG_ERROR("%s: field \"%s\" has %zu entries for %d layers", c->origin, field, len, n);
        return ERR_INVAL;
    }
    return ERR_OK;
}

// A per-layer field given as a list: a JSON array with one entry per layer.
static Err check_layer_list(const Ctx *c, const char *field, json_object *types,
                            const ModelConfig *cfg)
{
    if (!json_object_is_type(types, json_type_array)) {
        LOG_ERROR("%s: field \"%s\" must be a list of strings", c->origin, field);
        return ERR_FORMAT;
    }
    return check_layer_count(c, field, json_object_array_length(types), cfg);
}

static Err resolve_indexer(const Ctx *c, json_object *root, ModelConfig *cfg)
{
    Err err = ERR_OK;
    const int n = cfg->n_layers;
    json_object *types = member(root, "indexer_types");
    const char *field = "indexer_types";
    if (!types) {
        types = member(root, "index_topk_pattern");
        field = "index_topk_pattern";
    }
    if (types && json_object_is_type(types, json_type_string)) {
        const char *s = json_object_get_string(types);
        if ((err = check_layer_count(c, field, strlen(s), cfg))) return err;
        for (int i = 0; i < n; i++) {
            const char one[2] = {s[i], 0};
            if ((err = parse_indexer_entry(c, field, i, one, &cfg->indexer[i]))) return err;
        }
    } else if (types) {
        if ((err = check_layer_list(c, field, types, cfg))) return err;
        for (int i = 0; i < n; i++) {
            json_object *e = json_object_array_get_idx(types, (size_t) i);
            if (!json_object_is_type(e, json_type_string)) {
                LOG_ERROR("%s: field \"%s\"[%d] must be a string", c->origin, field, i);
                return ERR_FORMAT;
            }
            if ((err = parse_indexer_entry(c, field, i, json_object_get_string(e),
                                           &cfg->indexer[i]))) {
                return err;
            }
        }
    } else {
        int freq = 1, offset = 2;
        if ((err = get_int(c, root, "index_topk_freq", INT_MIN, INT_MAX, &freq))) return err;
        if ((err = get_int(c, root, "index_skip_topk_offset", -CONFIG_MAX_LAYERS, CONFIG_MAX_LAYERS,
                           &offset))) {
            return err;
        }
        if (freq < 1) freq = 1;  // transformers: max(index_topk_freq, 1)
        for (int i = 0; i < n; i++) {
            const int k = i - offset + 1 > 0 ? i - offset + 1 : 0;
            cfg->indexer[i] = k % freq == 0 ? CONFIG_INDEXER_FULL : CONFIG_INDEXER_SHARED;
        }
    }
    for (int i = n; i < n + cfg->n_mtp_layers; i++) {
        cfg->indexer[i] = CONFIG_INDEXER_FULL;
    }
    if (cfg->index_topk <= 0) {
        for (int i = 0; i < n + cfg->n_mtp_layers; i++) {
            cfg->indexer[i] = CONFIG_INDEXER_NONE;
        }
    } else if (cfg->indexer[0] == CONFIG_INDEXER_SHARED) {
        LOG_ERROR("%s: field \"%s\": layer 0 is \"shared\" but no earlier layer runs an indexer",
                  c->origin, field);
        return ERR_INVAL;
    }
    return ERR_OK;
}

static Err resolve_mlp(const Ctx *c, json_object *root, ModelConfig *cfg)
{
    Err err = ERR_OK;
    const int n = cfg->n_layers;
    json_object *types = member(root, "mlp_layer_types");
    if (types) {
        if ((err = check_layer_list(c, "mlp_layer_types", types, cfg))) return err;
        for (int i = 0; i < n; i++) {
            json_object *e = json_object_array_get_idx(types, (size_t) i);
            const char *s =
                json_object_is_type(e, json_type_string) ? json_object_get_string(e) : NULL;
            if (s && !strcmp(s, "dense")) {
                cfg->mlp[i] = CONFIG_MLP_DENSE;
            } else if (s && (!strcmp(s, "sparse") || !strcmp(s, "moe"))) {
                cfg->mlp[i] = CONFIG_MLP_MOE;
            } else {
                LOG_ERROR("%s: field \"mlp_layer_types\"[%d] must be \"dense\" or \"sparse\"",
                          c->origin, i);
                return ERR_FORMAT;
            }
        }
    } else {
        int first_dense = 3;
        if ((err = get_int(c, root, "first_k_dense_replace", 0, INT_MAX, &first_dense))) {
            return err;
        }
        for (int i = 0; i < n; i++) {
            cfg->mlp[i] = i < first_dense ? CONFIG_MLP_DENSE : CONFIG_MLP_MOE;
        }
    }
    for (int i = n; i < n + cfg->n_mtp_layers; i++) {
        cfg->mlp[i] = CONFIG_MLP_MOE;
    }
    return ERR_OK;
}

static Err resolve_eos(const Ctx *c, json_object *root, ModelConfig *cfg)
{
    json_object *v = member(root, "eos_token_id");
    if (!v) {
        if (json_object_object_get_ex(root, "eos_token_id", NULL)) {
            cfg->n_eos_ids = 0;  // explicit null: no eos
        }
        return ERR_OK;
    }
    if (json_object_is_type(v, json_type_int)) {
        const int64_t id = json_object_get_int64(v);
        if (id < 0 || id >= cfg->vocab_size) {
            LOG_ERROR("%s: field \"eos_token_id\" = %lld is outside the vocabulary (%d)", c->origin,
                      (long long) id, cfg->vocab_size);
            return ERR_INVAL;
        }
        cfg->eos_ids[0] = (int) id;
        cfg->n_eos_ids = 1;
        return ERR_OK;
    }
    if (!json_object_is_type(v, json_type_array)) {
        LOG_ERROR("%s: field \"eos_token_id\" must be an integer or a list of integers", c->origin);
        return ERR_FORMAT;
    }
    const size_t len = json_object_array_length(v);
    if (len > CONFIG_MAX_EOS) {
        LOG_ERROR("%s: field \"eos_token_id\" has %zu ids, at most %d are supported", c->origin,
                  len, CONFIG_MAX_EOS);
        return ERR_INVAL;
    }
    for (size_t i = 0; i < len; i++) {
        json_object *e = json_object_array_get_idx(v, i);
        if (!json_object_is_type(e, json_type_int)) {
            LOG_ERROR("%s: field \"eos_token_id\"[%zu] must be an integer", c->origin, i);
            return ERR_FORMAT;
        }
        const int64_t id = json_object_get_int64(e);
        if (id < 0 || id >= cfg->vocab_size) {
            LOG_ERROR("%s: field \"eos_token_id\"[%zu] = %lld is outside the vocabulary (%d)",
                      c->origin, i, (long long) id, cfg->vocab_size);
            return ERR_INVAL;
        }
        cfg->eos_ids[i] = (int) id;
    }
    cfg->n_eos_ids = (int) len;
    return ERR_OK;
}

static Err resolve_rope(const Ctx *c, json_object *root, ModelConfig *cfg)
{
    Err err = ERR_OK;
    // transformers 5 standardizes the legacy `rope_scaling` dict into `rope_parameters`; a
    // top-level `rope_theta` is the older spelling of rope_parameters.rope_theta.
    json_object *params = member(root, "rope_parameters");
    const char *field = "rope_parameters";
    if (!params) {
        params = member(root, "rope_scaling");
        field = "rope_scaling";
    }
    if ((err = get_float(c, root, "rope_theta", 1e-3, 1e12, &cfg->rope_theta))) return err;
    if (!params) return ERR_OK;
    if (!json_object_is_type(params, json_type_object)) {
        LOG_ERROR("%s: field \"%s\" must be an object", c->origin, field);
        return ERR_FORMAT;
    }
    if ((err = get_float(c, params, "rope_theta", 1e-3, 1e12, &cfg->rope_theta))) return err;
    const char *type = NULL;
    if ((err = get_string(c, params, "rope_type", &type))) return err;
    if (!type && (err = get_string(c, params, "type", &type))) return err;
    if (type && strcmp(type, "default") != 0) {
        // YaRN and friends change the frequencies and the softmax scale; the forward pass
        // implements GLM-5.x's plain RoPE only.
        LOG_ERROR("%s: field \"%s.rope_type\" = \"%.32s\" is not supported (only \"default\")",
                  c->origin, field, type);
        return ERR_INVAL;
    }
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Quantization

static Err add_excludes(const Ctx *c, json_object *list, const char *field, ModelConfig *cfg)
{
    if (!list) return ERR_OK;
    if (!json_object_is_type(list, json_type_array)) {
        LOG_ERROR("%s: field \"%s\" must be a list of strings", c->origin, field);
        return ERR_FORMAT;
    }
    const size_t len = json_object_array_length(list);
    for (size_t i = 0; i < len; i++) {
        json_object *e = json_object_array_get_idx(list, i);
        if (!json_object_is_type(e, json_type_string)) {
            LOG_ERROR("%s: field \"%s\"[%zu] must be a string", c->origin, field, i);
            return ERR_FORMAT;
        }
        if (cfg->n_excludes == CONFIG_MAX_EXCLUDES) {
            LOG_WARN("%s: field \"%s\" has %zu entries; keeping the first %d for display",
                     c->origin, field, len, CONFIG_MAX_EXCLUDES);
            break;
        }
        copy_string(cfg->excludes[cfg->n_excludes++], sizeof cfg->excludes[0],
                    json_object_get_string(e));
    }
    return ERR_OK;
}

static Err quant_from_algo(const Ctx *c, const char *field, const char *algo, ModelConfig *cfg)
{
    if (!algo) {
        LOG_ERROR("%s: field \"%s\" is missing", c->origin, field);
        return ERR_FORMAT;
    }
    if (!strcmp(algo, "NVFP4") || !strcmp(algo, "W4A16_NVFP4")) {
        cfg->quant = CONFIG_QUANT_NVFP4_MODELOPT;
        cfg->quant_group_size = 16;
    } else if (!strcmp(algo, "FP8") || !strcmp(algo, "FP8_BLOCKWISE")
               || !strcmp(algo, "FP8_PER_CHANNEL_PER_TOKEN")) {
        cfg->quant = CONFIG_QUANT_FP8;
        cfg->quant_group_size = 0;
    } else {
        LOG_ERROR("%s: field \"%s\" = \"%.32s\" is not supported (NVFP4, W4A16_NVFP4 or FP8)",
                  c->origin, field, algo);
        return ERR_INVAL;
    }
    return ERR_OK;
}

// hf_quant_config.json: {"quantization": {"quant_algo", "kv_cache_quant_algo", "group_size",
// "exclude_modules"}}.
static Err parse_hf_quant(const Ctx *c, json_object *root, ModelConfig *cfg)
{
    Err err = ERR_OK;
    json_object *q = member(root, "quantization");
    if (!q || !json_object_is_type(q, json_type_object)) {
        LOG_ERROR("%s: field \"quantization\" must be an object", c->origin);
        return ERR_FORMAT;
    }
    const char *algo = NULL, *kv = NULL;
    if ((err = get_string(c, q, "quant_algo", &algo))) return err;
    if ((err = quant_from_algo(c, "quantization.quant_algo", algo, cfg))) return err;
    if ((err = get_string(c, q, "kv_cache_quant_algo", &kv))) return err;
    cfg->kv_cache_fp8 = kv && !strcmp(kv, "FP8");
    if ((err = get_int(c, q, "group_size", 1, 1 << 16, &cfg->quant_group_size))) return err;
    return add_excludes(c, member(q, "exclude_modules"), "quantization.exclude_modules", cfg);
}

// Compressed-tensors: the format is top-level or per config group.
static Err ct_format(const Ctx *c, json_object *q, const char **format, int *group_size)
{
    Err err = get_string(c, q, "format", format);
    if (err) return err;
    json_object *groups = member(q, "config_groups");
    if (!groups) return ERR_OK;
    if (!json_object_is_type(groups, json_type_object)) {
        LOG_ERROR("%s: field \"quantization_config.config_groups\" must be an object", c->origin);
        return ERR_FORMAT;
    }
    json_object_object_foreach(groups, name, group)
    {
        (void) name;
        if (!json_object_is_type(group, json_type_object)) continue;
        const char *f = NULL;
        if ((err = get_string(c, group, "format", &f))) return err;
        if (!*format) *format = f;
        json_object *w = member(group, "weights");
        if (w && json_object_is_type(w, json_type_object)) {
            if ((err = get_int(c, w, "group_size", 1, 1 << 16, group_size))) return err;
        }
    }
    return ERR_OK;
}

static Err parse_quant_config(const Ctx *c, json_object *q, ModelConfig *cfg)
{
    Err err = ERR_OK;
    if (!json_object_is_type(q, json_type_object)) {
        LOG_ERROR("%s: field \"quantization_config\" must be an object", c->origin);
        return ERR_FORMAT;
    }
    const char *method = NULL;
    if ((err = get_string(c, q, "quant_method", &method))) return err;
    if (!method) {
        LOG_ERROR("%s: field \"quantization_config.quant_method\" is missing", c->origin);
        return ERR_FORMAT;
    }
    cfg->kv_cache_fp8 = member(q, "kv_cache_scheme") != NULL;
    if (!strcmp(method, "modelopt")) {
        const char *algo = NULL;
        if ((err = get_string(c, q, "quant_algo", &algo))) return err;
        if ((err = quant_from_algo(c, "quantization_config.quant_algo", algo, cfg))) return err;
        if ((err = get_int(c, q, "group_size", 1, 1 << 16, &cfg->quant_group_size))) return err;
        const char *kv = NULL;
        if ((err = get_string(c, q, "kv_cache_quant_algo", &kv))) return err;
        if (kv && !strcmp(kv, "FP8")) cfg->kv_cache_fp8 = true;
    } else if (!strcmp(method, "compressed-tensors")) {
        const char *format = NULL;
        int group_size = 16;
        if ((err = ct_format(c, q, &format, &group_size))) return err;
        if (format && !strcmp(format, "nvfp4-pack-quantized")) {
            cfg->quant = CONFIG_QUANT_NVFP4_CT;
            cfg->quant_group_size = group_size;
        } else if (format && !strcmp(format, "float-quantized")) {
            cfg->quant = CONFIG_QUANT_FP8;
        } else {
            LOG_ERROR("%s: field \"quantization_config.format\" = \"%.32s\" is not supported "
                      "(nvfp4-pack-quantized or float-quantized)",
                      c->origin, format ? format : "(missing)");
            return ERR_INVAL;
        }
    } else if (!strcmp(method, "fp8")) {
        cfg->quant = CONFIG_QUANT_FP8;
    } else {
        LOG_ERROR("%s: field \"quantization_config.quant_method\" = \"%.32s\" is not supported "
                  "(modelopt, compressed-tensors or fp8)",
                  c->origin, method);
        return ERR_INVAL;
    }
    Err e1 = add_excludes(c, member(q, "ignore"), "quantization_config.ignore", cfg);
    if (e1) return e1;
    return add_excludes(c, member(q, "exclude_modules"), "quantization_config.exclude_modules",
                        cfg);
}

// ---------------------------------------------------------------------------
// The config

static void set_defaults(ModelConfig *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    copy_string(cfg->model_type, sizeof cfg->model_type, "glm_moe_dsa");
    cfg->vocab_size = 154880;
    cfg->hidden_size = 6144;
    cfg->n_layers = 78;
    cfg->n_mtp_layers = 0;
    cfg->n_heads = 64;
    cfg->q_lora_rank = 2048;
    cfg->kv_lora_rank = 512;
    cfg->qk_nope_head_dim = 192;
    cfg->qk_rope_head_dim = 64;
    cfg->v_head_dim = 256;
    cfg->rope_theta = 10000.0f;  // transformers' default_theta when no rope parameters are given
    cfg->rope_interleave = true;
    cfg->rms_norm_eps = 1e-5f;
    cfg->attn_norm_eps = 1e-6f;  // GlmMoeDsaRMSNorm(q_lora_rank) uses the class default
    cfg->max_position_embeddings = 202752;
    cfg->index_n_heads = 32;
    cfg->index_head_dim = 128;
    cfg->index_topk = 2048;
    cfg->indexer_rope_interleave = true;
    cfg->intermediate_size = 12288;
    cfg->moe_intermediate_size = 2048;
    cfg->n_routed_experts = 256;
    cfg->n_shared_experts = 1;
    cfg->n_experts_per_tok = 8;
    cfg->n_group = 1;
    cfg->topk_group = 1;
    cfg->norm_topk_prob = true;
    cfg->routed_scaling_factor = 2.5f;
    cfg->tie_word_embeddings = false;
    cfg->eos_ids[0] = 1;  // transformers' default eos_token_id
    cfg->n_eos_ids = 1;
    cfg->pad_id = -1;
    cfg->quant = CONFIG_QUANT_NONE;
}

// Products that become an int dimension (heads x head dim) must fit in int; products that
// count a tensor's elements must stay below 2^34 (GLM-5's largest, the embedding, has
// 0.95 G elements; 17 G is no real model).
static Err check_product_limit(const Ctx *c, const char *what, int64_t a, int64_t b, int64_t limit)
{
    if (a * b > limit) {
        LOG_ERROR("%s: %s = %lld x %lld is too large", c->origin, what, (long long) a,
                  (long long) b);
        return ERR_INVAL;
    }
    return ERR_OK;
}

static Err check_product(const Ctx *c, const char *what, int64_t a, int64_t b)
{
    return check_product_limit(c, what, a, b, INT_MAX);
}

static Err check_elements(const Ctx *c, const char *what, int64_t a, int64_t b)
{
    return check_product_limit(c, what, a, b, (int64_t) 1 << 34);
}

static Err validate(const Ctx *c, const ModelConfig *cfg)
{
    Err err = ERR_OK;
    const int64_t qk = (int64_t) cfg->qk_nope_head_dim + cfg->qk_rope_head_dim;
    if (cfg->qk_rope_head_dim % 2 || cfg->qk_rope_head_dim > 2 * ROPE_MAX_PAIRS) {
        LOG_ERROR("%s: field \"qk_rope_head_dim\" = %d must be even and at most %d (the "
                  "RoPE kernels' inverse frequencies, kernels/rope_format.h)",
                  c->origin, cfg->qk_rope_head_dim, 2 * ROPE_MAX_PAIRS);
        return ERR_INVAL;
    }
    if ((err = check_product(c, "num_attention_heads * qk_head_dim", cfg->n_heads, qk))) return err;
    if ((err = check_product(c, "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
                             cfg->n_heads, (int64_t) cfg->qk_nope_head_dim + cfg->v_head_dim))) {
        return err;
    }
    if ((err = check_elements(c, "o_proj: num_attention_heads * v_head_dim * hidden_size",
                              (int64_t) cfg->n_heads * cfg->v_head_dim, cfg->hidden_size))) {
        return err;
    }
    if ((err = check_elements(c, "q_b_proj: num_attention_heads * qk_head_dim * q_lora_rank",
                              (int64_t) cfg->n_heads * qk, cfg->q_lora_rank))) {
        return err;
    }
    if ((err = check_elements(c, "vocab_size * hidden_size", cfg->vocab_size, cfg->hidden_size))) {
        return err;
    }
    if ((err = check_elements(c, "intermediate_size * hidden_size", cfg->intermediate_size,
                              cfg->hidden_size))) {
        return err;
    }
    if ((err = check_elements(c, "moe_intermediate_size * hidden_size", cfg->moe_intermediate_size,
                              cfg->hidden_size))) {
        return err;
    }
    if ((err =
             check_elements(c, "q_lora_rank * hidden_size", cfg->q_lora_rank, cfg->hidden_size))) {
        return err;
    }
    if ((err = check_elements(c, "n_routed_experts * hidden_size", cfg->n_routed_experts,
                              cfg->hidden_size))) {
        return err;
    }
    bool any_moe = false, any_index = false;
    for (int i = 0; i < cfg->n_layers + cfg->n_mtp_layers; i++) {
        any_moe |= cfg->mlp[i] == CONFIG_MLP_MOE;
        any_index |= cfg->indexer[i] != CONFIG_INDEXER_NONE;
    }
    if (any_moe) {
        if (cfg->n_routed_experts < 1 || cfg->n_experts_per_tok > cfg->n_routed_experts) {
            LOG_ERROR("%s: field \"num_experts_per_tok\" = %d needs at least as many routed "
                      "experts (n_routed_experts = %d)",
                      c->origin, cfg->n_experts_per_tok, cfg->n_routed_experts);
            return ERR_INVAL;
        }
        if (cfg->n_routed_experts % cfg->n_group || cfg->topk_group > cfg->n_group) {
            LOG_ERROR("%s: fields \"n_group\" = %d / \"topk_group\" = %d do not divide "
                      "n_routed_experts = %d",
                      c->origin, cfg->n_group, cfg->topk_group, cfg->n_routed_experts);
            return ERR_INVAL;
        }
    }
    if (any_index) {
        if (cfg->index_head_dim < cfg->qk_rope_head_dim) {
            LOG_ERROR("%s: field \"index_head_dim\" = %d is smaller than qk_rope_head_dim = %d",
                      c->origin, cfg->index_head_dim, cfg->qk_rope_head_dim);
            return ERR_INVAL;
        }
        if ((err = check_product(c, "index_n_heads * index_head_dim", cfg->index_n_heads,
                                 cfg->index_head_dim))) {
            return err;
        }
    }
    for (int i = 0; i < cfg->n_eos_ids; i++) {
        if (cfg->eos_ids[i] >= cfg->vocab_size) {  // the default eos (1) included
            LOG_ERROR("%s: field \"eos_token_id\" = %d is outside the vocabulary (%d)", c->origin,
                      cfg->eos_ids[i], cfg->vocab_size);
            return ERR_INVAL;
        }
    }
    if (cfg->pad_id >= cfg->vocab_size) {
        LOG_ERROR("%s: field \"pad_token_id\" = %d is outside the vocabulary (%d)", c->origin,
                  cfg->pad_id, cfg->vocab_size);
        return ERR_INVAL;
    }
    return ERR_OK;
}

static Err parse_root(const Ctx *c, json_object *root, ModelConfig *cfg)
{
    Err err = ERR_OK;
    json_object *archs = member(root, "architectures");
    if (archs) {
        if (!json_object_is_type(archs, json_type_array)) {
            LOG_ERROR("%s: field \"architectures\" must be a list of strings", c->origin);
            return ERR_FORMAT;
        }
        json_object *a0 = json_object_array_get_idx(archs, 0);
        if (a0 && !json_object_is_type(a0, json_type_string)) {
            LOG_ERROR("%s: field \"architectures\"[0] must be a string", c->origin);
            return ERR_FORMAT;
        }
        if (a0) {
            copy_string(cfg->architecture, sizeof cfg->architecture, json_object_get_string(a0));
        }
    }
    const char *model_type = NULL;
    if ((err = get_string(c, root, "model_type", &model_type))) return err;
    if (model_type) copy_string(cfg->model_type, sizeof cfg->model_type, model_type);

    // Field name, lower bound, upper bound, destination. Lower bound 1 means "positive".
    const struct {
        const char *key;
        int lo, hi;
        int *dst;
    } ints[] = {
        {"vocab_size", 1, CONFIG_MAX_VOCAB, &cfg->vocab_size},
        {"hidden_size", 1, CONFIG_MAX_DIM, &cfg->hidden_size},
        {"num_hidden_layers", 1, CONFIG_MAX_LAYERS, &cfg->n_layers},
        {"num_nextn_predict_layers", 0, CONFIG_MAX_LAYERS, &cfg->n_mtp_layers},
        {"num_attention_heads", 1, CONFIG_MAX_HEADS, &cfg->n_heads},
        {"q_lora_rank", 0, CONFIG_MAX_DIM, &cfg->q_lora_rank},
        {"kv_lora_rank", 1, CONFIG_MAX_DIM, &cfg->kv_lora_rank},
        {"qk_nope_head_dim", 0, CONFIG_MAX_HEAD_DIM, &cfg->qk_nope_head_dim},
        {"qk_rope_head_dim", 2, CONFIG_MAX_HEAD_DIM, &cfg->qk_rope_head_dim},
        {"v_head_dim", 1, CONFIG_MAX_HEAD_DIM, &cfg->v_head_dim},
        {"max_position_embeddings", 1, CONFIG_MAX_POSITIONS, &cfg->max_position_embeddings},
        {"index_n_heads", 1, CONFIG_MAX_HEADS, &cfg->index_n_heads},
        {"index_head_dim", 1, CONFIG_MAX_HEAD_DIM, &cfg->index_head_dim},
        {"index_topk", INT_MIN, CONFIG_MAX_POSITIONS, &cfg->index_topk},
        {"intermediate_size", 1, CONFIG_MAX_DIM, &cfg->intermediate_size},
        {"moe_intermediate_size", 1, CONFIG_MAX_DIM, &cfg->moe_intermediate_size},
        {"n_routed_experts", 0, CONFIG_MAX_EXPERTS, &cfg->n_routed_experts},
        {"num_experts", 0, CONFIG_MAX_EXPERTS, &cfg->n_routed_experts},  // BC alias
        {"n_shared_experts", 0, 64, &cfg->n_shared_experts},
        {"num_experts_per_tok", 1, CONFIG_MAX_EXPERTS, &cfg->n_experts_per_tok},
        {"n_group", 1, CONFIG_MAX_EXPERTS, &cfg->n_group},
        {"topk_group", 1, CONFIG_MAX_EXPERTS, &cfg->topk_group},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        if ((err = get_int(c, root, ints[i].key, ints[i].lo, ints[i].hi, ints[i].dst))) return err;
    }
    if (!member(root, "q_lora_rank") && json_object_object_get_ex(root, "q_lora_rank", NULL)) {
        cfg->q_lora_rank = 0;  // explicit null: q_proj without the low-rank path
    }
    if (cfg->n_layers + cfg->n_mtp_layers > CONFIG_MAX_LAYERS) {
        LOG_ERROR("%s: num_hidden_layers + num_nextn_predict_layers = %d exceeds %d", c->origin,
                  cfg->n_layers + cfg->n_mtp_layers, CONFIG_MAX_LAYERS);
        return ERR_INVAL;
    }
    if ((err = get_float(c, root, "rms_norm_eps", 0.0, 1.0, &cfg->rms_norm_eps))) return err;
    if ((err =
             get_float(c, root, "routed_scaling_factor", 0.0, 1e6, &cfg->routed_scaling_factor))) {
        return err;
    }
    if ((err = get_bool(c, root, "rope_interleave", &cfg->rope_interleave))) return err;
    if ((err = get_bool(c, root, "indexer_rope_interleave", &cfg->indexer_rope_interleave))) {
        return err;
    }
    if ((err = get_bool(c, root, "norm_topk_prob", &cfg->norm_topk_prob))) return err;
    if ((err = get_bool(c, root, "tie_word_embeddings", &cfg->tie_word_embeddings))) return err;
    if ((err = get_int(c, root, "pad_token_id", -1, CONFIG_MAX_VOCAB, &cfg->pad_id))) return err;
    // Options the forward pass does not implement: refuse them here, by name, rather than
    // computing something else later.
    const struct {
        const char *key, *want;
    } fixed[] = {{"hidden_act", "silu"}, {"scoring_func", "sigmoid"}};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        const char *v = NULL;
        if ((err = get_string(c, root, fixed[i].key, &v))) return err;
        if (v && strcmp(v, fixed[i].want) != 0) {
            LOG_ERROR("%s: field \"%s\" = \"%.32s\" is not supported (only \"%s\")", c->origin,
                      fixed[i].key, v, fixed[i].want);
            return ERR_INVAL;
        }
    }
    const char *no_bias[] = {"attention_bias", "mlp_bias"};
    for (size_t i = 0; i < 2; i++) {
        bool b = false;
        if ((err = get_bool(c, root, no_bias[i], &b))) return err;
        if (b) {
            LOG_ERROR("%s: field \"%s\" = true is not supported", c->origin, no_bias[i]);
            return ERR_INVAL;
        }
    }
    if ((err = resolve_rope(c, root, cfg))) return err;
    if ((err = resolve_eos(c, root, cfg))) return err;
    if ((err = resolve_mlp(c, root, cfg))) return err;
    if ((err = resolve_indexer(c, root, cfg))) return err;
    return validate(c, cfg);
}

Err config_parse(ModelConfig *cfg, const char *json, size_t len, const char *quant_json,
                 size_t quant_len, const char *origin)
{
    Err err = ERR_OK;
    json_object *root = NULL, *qroot = NULL;
    ModelConfig *tmp = malloc(sizeof *tmp);
    const Ctx c = {origin ? origin : "config.json"};
    if (!tmp) {
        err = ERR_NOMEM;
        goto done;
    }
    set_defaults(tmp);
    if (!(root = parse_object(json, len, c.origin))) {
        err = ERR_FORMAT;
        goto done;
    }
    if ((err = parse_root(&c, root, tmp))) goto done;
    if (quant_json) {
        char qorigin[512];
        // hf_quant_config.json lives next to config.json; name it in messages.
        const char *slash = strrchr(c.origin, '/');
        snprintf(qorigin, sizeof qorigin, "%.*shf_quant_config.json",
                 slash ? (int) (slash - c.origin + 1) : 0, c.origin);
        const Ctx qc = {qorigin};
        if (!(qroot = parse_object(quant_json, quant_len, qc.origin))) {
            err = ERR_FORMAT;
            goto done;
        }
        if ((err = parse_hf_quant(&qc, qroot, tmp))) goto done;
    } else {
        json_object *q = member(root, "quantization_config");
        if (q && (err = parse_quant_config(&c, q, tmp))) goto done;
    }
    *cfg = *tmp;
done:
    if (err) memset(cfg, 0, sizeof *cfg);
    json_object_put(root);
    json_object_put(qroot);
    free(tmp);
    return err;
}

// ---------------------------------------------------------------------------
// Files

// Read all of path into a NUL-terminated allocation. ERR_NOTFOUND when it does not exist
// (not logged: the caller decides whether that is an error), ERR_IO otherwise.
static Err read_file(const char *path, char **out, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (errno == ENOENT) return ERR_NOTFOUND;
        LOG_ERROR("could not open \"%s\": %s", path, strerror(errno));
        return ERR_IO;
    }
    Buf b = {0};
    Err err = buf_add_file(&b, f);
    if (err == ERR_IO) {
        LOG_ERROR("could not read \"%s\": %s", path, strerror(errno));
    } else if (!err && b.n > ((size_t) 1 << 30)) {
        LOG_ERROR("could not read \"%s\": larger than 1 GiB", path);
        err = ERR_INVAL;
    }
    fclose(f);
    if (!err && !(*out = buf_take(&b, len_out))) err = ERR_NOMEM;
    buf_free(&b);
    return err;
}

Err config_load(ModelConfig *cfg, const char *model_dir)
{
    Err err = ERR_OK;
    char *json = NULL, *quant = NULL;
    size_t len = 0, quant_len = 0;
    char path[4096], qpath[4096];
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    snprintf(qpath, sizeof qpath, "%s/hf_quant_config.json", model_dir);
    if ((err = read_file(path, &json, &len))) {
        if (err == ERR_NOTFOUND) {
            LOG_ERROR("could not open \"%s\": no such file", path);
            err = ERR_IO;
        }
        goto done;
    }
    err = read_file(qpath, &quant, &quant_len);
    if (err == ERR_NOTFOUND) {
        err = ERR_OK;
    } else if (err) {
        goto done;
    }
    err = config_parse(cfg, json, len, quant, quant_len, path);
done:
    if (err) memset(cfg, 0, sizeof *cfg);
    free(json);
    free(quant);
    return err;
}
