/*
 * recipe.c - the deployment recipe parser: a table of keys, each with a kind, a range and
 * the field it sets. See recipe.h for the format.
 */
#include "engine/serve/recipe.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/backends.h"

typedef enum KeyKind {
    KIND_STR,
    KIND_INT,
    KIND_REAL,
    KIND_KV_DTYPE,
    KIND_BACKEND,
    KIND_PRECISION
} KeyKind;

typedef struct KeyDef {
    const char *name;
    KeyKind kind;
    size_t offset;
    double min, max;  // KIND_INT, KIND_REAL; for reals min is exclusive when min_open
    bool min_open;
    bool power_of_two;
} KeyDef;

#define F(field) offsetof(Recipe, field)
static const KeyDef KEYS[] = {
    {"model", KIND_STR, F(model), 0, 0, false, false},
    {"model_name", KIND_STR, F(model_name), 0, 0, false, false},
    {"tokenizer", KIND_STR, F(tokenizer), 0, 0, false, false},
    {"pipeline_parallel", KIND_INT, F(pipeline_parallel), 1, RECIPE_MAX_WORLD, false, false},
    {"tensor_parallel", KIND_INT, F(tensor_parallel), 1, 1, false, false},
    {"gpu_memory_utilization", KIND_REAL, F(gpu_memory_utilization), 0, 1, true, false},
    {"max_model_len", KIND_INT, F(max_model_len), 1, 16777216, false, false},
    {"kv_cache_dtype", KIND_KV_DTYPE, F(kv_cache_dtype), 0, 0, false, false},
    {"block_size", KIND_INT, F(block_size), 1, 65536, false, true},
    {"max_num_seqs", KIND_INT, F(max_num_seqs), 1, 4096, false, false},
    {"max_num_batched_tokens", KIND_INT, F(max_num_batched_tokens), 1, 16777216, false, false},
    {"threads", KIND_INT, F(threads), 1, 1024, false, false},
    {"kv_blocks", KIND_INT, F(kv_blocks), 0, 1 << 24, false, false},
    {"lease_s", KIND_INT, F(lease_s), 1, 86400, false, false},
    {"master_port", KIND_INT, F(master_port), 1, 65535, false, false},
    {"load_timeout_s", KIND_INT, F(load_timeout_s), 1, 604800, false, false},
    {"min_free_memory_gb", KIND_REAL, F(min_free_memory_gb), 0, 1e6, false, false},
    {"backend", KIND_BACKEND, F(backend), 0, 0, false, false},
    {"precision", KIND_PRECISION, F(precision), 0, 0, false, false},
    {"mtp_tokens", KIND_INT, F(mtp_tokens), 0, 8, false, false},
    {"prefix_caching", KIND_INT, F(prefix_caching), 0, 1, false, false},
    {"commit_interval_ms", KIND_INT, F(commit_interval_ms), 0, 10000, false, false},
};
#undef F
enum { N_KEYS = (int) (sizeof KEYS / sizeof KEYS[0]) };
_Static_assert(N_KEYS <= 64, "set_mask holds 64 keys");

static const char *const BACKENDS[] = {"cpu", "cuda"};

void recipe_defaults(Recipe *r)
{
    memset(r, 0, sizeof *r);
    r->pipeline_parallel = 1;
    r->tensor_parallel = 1;
    r->gpu_memory_utilization = 0.85;
    r->max_model_len = 262144;
    r->kv_cache_dtype = KV_DTYPE_FP8;
    r->block_size = 128;
    r->max_num_seqs = 1;
    r->max_num_batched_tokens = 2048;
    r->threads = 2;
    r->kv_blocks = 0;
    r->lease_s = 60;
    r->master_port = 29500;
    r->load_timeout_s = 3600;
    r->min_free_memory_gb = 0;
    r->precision = BACKEND_PRECISION_DEFAULT;
    r->prefix_caching = 1;
    r->commit_interval_ms = 0;
}

int recipe_n_keys(void)
{
    return N_KEYS;
}

const char *recipe_key_name(int i)
{
    return i >= 0 && i < N_KEYS ? KEYS[i].name : NULL;
}

const char *recipe_backend_name(RecipeBackend b)
{
    return (unsigned) b < 2 ? BACKENDS[b] : "?";
}

static int find_key(const char *key, size_t n)
{
    for (int i = 0; i < N_KEYS; i++)
        if (strlen(KEYS[i].name) == n && !memcmp(KEYS[i].name, key, n)) return i;
    return -1;
}

bool recipe_is_set(const Recipe *r, const char *key)
{
    const int k = find_key(key, strlen(key));
    return k >= 0 && (r->set_mask & (UINT64_C(1) << k));
}

// Index of s among names[0..n), or -1.
static int name_index(const char *const *names, int n, const char *s)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(s, names[i])) return i;
    return -1;
}

// Set key k from value[0..n). where: "origin:line" or "origin" for messages.
static Err set_value(Recipe *r, int k, const char *value, size_t n, const char *where)
{
    const KeyDef *d = &KEYS[k];
    char *field = (char *) r + d->offset;
    char buf[64];
    if (d->kind == KIND_STR) {
        if (n == 0 || n >= RECIPE_MAX_STR) {
            LOG_ERROR("%s: %s: %s", where, d->name, n == 0 ? "empty value" : "value too long");
            return ERR_INVAL;
        }
        for (size_t i = 0; i < n; i++)
            if ((unsigned char) value[i] < 0x20 || value[i] == '"' || value[i] == 0x7f) {
                LOG_ERROR("%s: %s: control characters and quotes are not allowed", where,
                          d->name);
                return ERR_INVAL;
            }
        memcpy(field, value, n);
        field[n] = '\0';
        return ERR_OK;
    }
    if (n == 0 || n >= sizeof buf || memchr(value, '\0', n)) {
        LOG_ERROR("%s: %s: %s", where, d->name, n == 0 ? "empty value" : "value too long");
        return ERR_INVAL;
    }
    memcpy(buf, value, n);
    buf[n] = '\0';
    if (d->kind == KIND_KV_DTYPE || d->kind == KIND_BACKEND || d->kind == KIND_PRECISION) {
        KvDtype kv_dtype = KV_DTYPE_F32;
        int precision = BACKEND_PRECISION_DEFAULT;
        const int i = d->kind == KIND_KV_DTYPE ? (kv_dtype_parse(buf, &kv_dtype) ? 0 : -1)
                      : d->kind == KIND_BACKEND
                          ? name_index(BACKENDS, 2, buf)
                          : (backend_precision_parse(buf, &precision) ? 0 : -1);
        if (i < 0) {
            LOG_ERROR("%s: %s: \"%s\" is not one of %s", where, d->name, buf,
                      d->kind == KIND_KV_DTYPE  ? "fp8, bf16, f32"
                      : d->kind == KIND_BACKEND ? "cpu, cuda"
                                                : "default, f32, bf16");
            return ERR_INVAL;
        }
        if (d->kind == KIND_KV_DTYPE) {
            memcpy(field, &kv_dtype, sizeof kv_dtype);
        } else if (d->kind == KIND_BACKEND) {
            const RecipeBackend t = (RecipeBackend) i;
            memcpy(field, &t, sizeof t);
        } else {
            memcpy(field, &precision, sizeof precision);
        }
        return ERR_OK;
    }
    char *end;
    errno = 0;
    if (d->kind == KIND_INT) {
        const long long v = strtoll(buf, &end, 10);
        if (errno || end == buf || *end) {
            LOG_ERROR("%s: %s: \"%s\" is not an integer", where, d->name, buf);
            return ERR_INVAL;
        }
        if ((double) v < d->min || (double) v > d->max) {
            LOG_ERROR("%s: %s: %lld is out of range [%.0f, %.0f]", where, d->name, v, d->min,
                      d->max);
            return ERR_INVAL;
        }
        if (d->power_of_two && (v & (v - 1))) {
            LOG_ERROR("%s: %s: %lld is not a power of two", where, d->name, v);
            return ERR_INVAL;
        }
        const int iv = (int) v;
        memcpy(field, &iv, sizeof iv);
        return ERR_OK;
    }
    const double v = strtod(buf, &end);
    if (errno || end == buf || *end || !isfinite(v) || (v != 0 && fabs(v) < DBL_MIN)) {
        LOG_ERROR("%s: %s: \"%s\" is not a number", where, d->name, buf);
        return ERR_INVAL;
    }
    if ((d->min_open ? v <= d->min : v < d->min) || v > d->max) {
        LOG_ERROR("%s: %s: %g is out of range %s%g, %g]", where, d->name, v,
                  d->min_open ? "(" : "[", d->min, d->max);
        return ERR_INVAL;
    }
    memcpy(field, &v, sizeof v);
    return ERR_OK;
}

static bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\r';
}

static bool is_key_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
}

Err recipe_set(Recipe *r, const char *key, const char *value, const char *origin)
{
    const int k = find_key(key, strlen(key));
    if (k < 0) {
        LOG_ERROR("%s: unknown recipe key \"%s\"", origin, key);
        return ERR_INVAL;
    }
    const Err err = set_value(r, k, value, strlen(value), origin);
    if (!err) r->set_mask |= UINT64_C(1) << k;
    return err;
}

// One line (without its newline). Returns ERR_OK for blank and comment lines.
static Err parse_line(Recipe *r, const char *s, size_t n, uint64_t *seen, const char *where)
{
    size_t i = 0;
    while (i < n && is_space(s[i])) i++;
    if (i == n || s[i] == '#') return ERR_OK;
    const size_t k0 = i;
    while (i < n && is_key_char(s[i])) i++;
    const size_t k1 = i;
    while (i < n && is_space(s[i])) i++;
    if (k1 == k0 || i == n || s[i] != '=') {
        size_t show = k1 > k0 ? k1 - k0 : n - k0;
        if (show > 64) show = 64;
        LOG_ERROR("%s: expected `key = value`, got \"%.*s\"", where, (int) show, s + k0);
        return ERR_FORMAT;
    }
    const int k = find_key(s + k0, k1 - k0);
    if (k < 0) {
        const size_t show = k1 - k0 > 64 ? 64 : k1 - k0;
        LOG_ERROR("%s: unknown recipe key \"%.*s\"", where, (int) show, s + k0);
        return ERR_INVAL;
    }
    if (*seen & (UINT64_C(1) << k)) {
        LOG_ERROR("%s: %s is set twice", where, KEYS[k].name);
        return ERR_INVAL;
    }
    i++;
    while (i < n && is_space(s[i])) i++;
    size_t v0 = i, v1;
    if (i < n && s[i] == '"') {
        v0 = ++i;
        while (i < n && s[i] != '"') i++;
        if (i == n) {
            LOG_ERROR("%s: %s: unterminated quoted value", where, KEYS[k].name);
            return ERR_FORMAT;
        }
        v1 = i++;
        while (i < n && is_space(s[i])) i++;
        if (i < n && s[i] != '#') {
            LOG_ERROR("%s: %s: text after the quoted value", where, KEYS[k].name);
            return ERR_FORMAT;
        }
    } else {
        v1 = v0;
        while (v1 < n && !(s[v1] == '#' && is_space(s[v1 - 1]))) v1++;
        while (v1 > v0 && is_space(s[v1 - 1])) v1--;
    }
    const Err err = set_value(r, k, s + v0, v1 - v0, where);
    if (err) return err;
    *seen |= UINT64_C(1) << k;
    r->set_mask |= UINT64_C(1) << k;
    return ERR_OK;
}

Err recipe_parse(Recipe *r, const char *text, size_t len, const char *origin)
{
    uint64_t seen = 0;
    size_t pos = 0;
    int line = 0;
    char where[320];
    while (pos < len) {
        line++;
        const char *nl = memchr(text + pos, '\n', len - pos);
        const size_t end = nl ? (size_t) (nl - text) : len;
        snprintf(where, sizeof where, "%.256s:%d", origin, line);
        const Err err = parse_line(r, text + pos, end - pos, &seen, where);
        if (err) return err;
        pos = end + 1;
    }
    return ERR_OK;
}

Err recipe_load(Recipe *r, const char *path)
{
    Err err = ERR_OK;
    char *text = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        LOG_ERROR("%s: cannot open the recipe: %s", path, strerror(errno));
        return ERR_IO;
    }
    enum { MAX_BYTES = 1 << 20 };
    if (!(text = malloc(MAX_BYTES + 1))) {
        err = ERR_NOMEM;
        goto done;
    }
    const size_t n = fread(text, 1, MAX_BYTES + 1, f);
    if (ferror(f)) {
        LOG_ERROR("%s: cannot read the recipe", path);
        err = ERR_IO;
        goto done;
    }
    if (n > MAX_BYTES) {
        LOG_ERROR("%s: the recipe is larger than 1 MiB", path);
        err = ERR_FORMAT;
        goto done;
    }
    err = recipe_parse(r, text, n, path);
done:
    free(text);
    fclose(f);
    return err;
}

char *recipe_format_value(const Recipe *r, int i, char *buf, size_t n)
{
    if (n == 0) return buf;
    buf[0] = '\0';
    if (i < 0 || i >= N_KEYS) return buf;
    const KeyDef *d = &KEYS[i];
    const char *field = (const char *) r + d->offset;
    switch (d->kind) {
    case KIND_STR:
        snprintf(buf, n, "\"%s\"", field);
        break;
    case KIND_INT: {
        int v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, n, "%d", v);
        break;
    }
    case KIND_REAL: {
        double v;
        memcpy(&v, field, sizeof v);
        // The shortest of %.15g / %.17g that reads back exactly.
        snprintf(buf, n, "%.15g", v);
        if (strtod(buf, NULL) != v) snprintf(buf, n, "%.17g", v);
        break;
    }
    case KIND_KV_DTYPE: {
        KvDtype v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, n, "%s", kv_dtype_name(v));
        break;
    }
    case KIND_BACKEND: {
        RecipeBackend v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, n, "%s", recipe_backend_name(v));
        break;
    }
    case KIND_PRECISION: {
        int v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, n, "%s", backend_precision_name(v));
        break;
    }
    }
    return buf;
}
