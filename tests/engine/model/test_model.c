/*
 * test_model.c - model.c beyond the golden comparison: chunked prefill and interleaved
 * sequences give the same logits as one prefill, thread count does not change a bit,
 * a full KV cache and bad token ids are refused cleanly, and load errors name the problem.
 *
 * Uses the golden models tests/golden/models/dsa_modelopt (DSA with top-k 6 < sequence,
 * full and shared indexer layers, dense and MoE layers, NVFP4 experts) and mtp_theta (an
 * MTP layer), found through
 * GLMSPARK_SOURCE_DIR. Every forward computes each value with the same arithmetic whatever
 * the chunking (backend_cpu.c), so equality here is exact, not approximate.
 */
#include <json-c/json.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/shared/err.h"
#include "tests/check.h"

enum { N_TOK = 21 };

static const int tokens[N_TOK] = {88,  64, 203, 76,  229, 208, 179, 112, 14,  190, 203,
                                  165, 70, 26,  224, 72,  181, 124, 88,  113, 17};

static char model_dir[1024];

static void open_model(int threads, Backend **be, Model *m, KvCache *kv, int n_blocks)
{
    ASSERT(backend_cpu_create(threads, be) == ERR_OK);
    ASSERT(model_load(m, model_dir, NULL, *be) == ERR_OK);
    const KvCacheParams p = model_kv_params(m, n_blocks, 4);
    ASSERT(kv_init(kv, &p) == ERR_OK);
}

static void close_model(Backend *be, Model *m, KvCache *kv)
{
    kv_free(kv);
    model_free(m);
    be->destroy(be);
}

// Chunked prefill (5 + 7 + 1 + 8 tokens) and a second sequence decoded in between equal one
// prefill; two threads equal one thread.
static void test_chunks_and_threads(void)
{
    Backend *be;
    Model m;
    KvCache kv;
    open_model(1, &be, &m, &kv, 32);
    const int V = m.cfg.vocab_size;
    float *ref = malloc((size_t) N_TOK * V * sizeof *ref);
    float *got = malloc((size_t) N_TOK * V * sizeof *got);
    float *other = malloc((size_t) V * sizeof *other);
    ASSERT(ref && got && other);

    KvSeq a = {0}, b = {0};
    CHECK(model_forward(&m, &kv, &a, tokens, N_TOK, ref, true) == ERR_OK);
    CHECK(a.n_tokens == N_TOK);
    kv_seq_free(&kv, &a);

    const int chunks[4] = {5, 7, 1, 8};
    int done = 0;
    for (int c = 0; c < 4; c++) {
        CHECK(model_forward(&m, &kv, &a, tokens + done, chunks[c], got + (size_t) done * V, true)
              == ERR_OK);
        // another sequence advances in between, in the same cache
        CHECK(model_forward(&m, &kv, &b, tokens + N_TOK - 1 - c, 1, other, false) == ERR_OK);
        done += chunks[c];
    }
    CHECK(done == N_TOK && a.n_tokens == N_TOK && b.n_tokens == 4);
    CHECK(memcmp(got, ref, (size_t) N_TOK * V * sizeof *got) == 0);

    // the last-position-only output is the last row
    KvSeq c = {0};
    CHECK(model_forward(&m, &kv, &c, tokens, N_TOK, other, false) == ERR_OK);
    CHECK(memcmp(other, ref + (size_t) (N_TOK - 1) * V, (size_t) V * sizeof *other) == 0);
    kv_seq_free(&kv, &a);
    kv_seq_free(&kv, &b);
    kv_seq_free(&kv, &c);
    CHECK(kv_n_free_blocks(&kv) == 32);
    close_model(be, &m, &kv);

    open_model(2, &be, &m, &kv, 32);
    CHECK(model_forward(&m, &kv, &a, tokens, N_TOK, got, true) == ERR_OK);
    CHECK(memcmp(got, ref, (size_t) N_TOK * V * sizeof *got) == 0);
    kv_seq_free(&kv, &a);
    close_model(be, &m, &kv);
    free(ref);
    free(got);
    free(other);
}

// A cache too small for the request and a token outside the vocabulary are refused, and the
// sequence is left as it was.
static void test_refusals(void)
{
    Backend *be;
    Model m;
    KvCache kv;
    open_model(1, &be, &m, &kv, 2);  // 8 positions
    float *logits = malloc((size_t) m.cfg.vocab_size * sizeof *logits);
    ASSERT(logits);
    KvSeq s = {0};
    CHECK(model_forward(&m, &kv, &s, tokens, 9, logits, false) == ERR_AGAIN);
    CHECK(s.n_tokens == 0 && s.n_blocks == 0 && kv_n_free_blocks(&kv) == 2);
    CHECK(model_forward(&m, &kv, &s, tokens, 8, logits, false) == ERR_OK);
    CHECK(model_forward(&m, &kv, &s, tokens, 1, logits, false) == ERR_AGAIN);
    CHECK(s.n_tokens == 8);
    const int bad[2] = {1, m.cfg.vocab_size};
    KvSeq t = {0};
    CHECK(model_forward(&m, &kv, &t, bad, 2, logits, false) == ERR_INVAL);
    CHECK(t.n_tokens == 0);
    kv_seq_free(&kv, &s);
    kv_seq_free(&kv, &t);
    free(logits);
    close_model(be, &m, &kv);
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    ASSERT(f);
    fseek(f, 0, SEEK_END);
    *len = (size_t) ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc(*len + 1);
    ASSERT(buf && fread(buf, 1, *len, f) == *len);
    buf[*len] = '\0';
    fclose(f);
    return buf;
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    ASSERT(f && fputs(text, f) >= 0 && fclose(f) == 0);
}

// config.json text with num_hidden_layers = n_layers, the per-layer arrays resized to match
// (new layers "full" / "sparse"), and, when first_shared, layer 0's indexer "shared".
static char *edit_config(const char *text, int n_layers, bool first_shared)
{
    json_object *root = json_tokener_parse(text);
    ASSERT(root);
    json_object_object_add(root, "num_hidden_layers", json_object_new_int(n_layers));
    const char *arrays[2] = {"indexer_types", "mlp_layer_types"};
    const char *fill[2] = {"full", "sparse"};
    for (int a = 0; a < 2; a++) {
        json_object *arr;
        ASSERT(json_object_object_get_ex(root, arrays[a], &arr));
        while ((int) json_object_array_length(arr) < n_layers)
            json_object_array_add(arr, json_object_new_string(fill[a]));
    }
    if (first_shared) {
        json_object *arr;
        json_object_object_get_ex(root, "indexer_types", &arr);
        json_object_array_put_idx(arr, 0, json_object_new_string("shared"));
    }
    char *out = strdup(json_object_to_json_string_ext(root, JSON_C_TO_STRING_PRETTY));
    json_object_put(root);
    ASSERT(out);
    return out;
}

// Model directories whose config.json asks for something the checkpoint or the engine
// cannot give: load fails with the right code and leaves the Model zeroed.
static void test_load_errors(void)
{
    char tmpl[] = "/tmp/test_model_XXXXXX";
    char *tmp = mkdtemp(tmpl);
    ASSERT(tmp);
    char path[1200], src[1200];
    size_t len;
    snprintf(src, sizeof src, "%s/config.json", model_dir);
    char *config = read_file(src, &len);
    const char *shards[3] = {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                             "model-00002-of-00002.safetensors"};
    for (int i = 0; i < 3; i++) {
        snprintf(src, sizeof src, "%s/%s", model_dir, shards[i]);
        snprintf(path, sizeof path, "%s/%s", tmp, shards[i]);
        ASSERT(symlink(src, path) == 0);
    }
    snprintf(src, sizeof src, "%s/hf_quant_config.json", model_dir);
    snprintf(path, sizeof path, "%s/hf_quant_config.json", tmp);
    ASSERT(symlink(src, path) == 0);
    snprintf(path, sizeof path, "%s/config.json", tmp);

    Backend *be;
    ASSERT(backend_cpu_create(1, &be) == ERR_OK);
    Model m;

    write_file(path, config);  // unchanged: loads
    CHECK(model_load(&m, tmp, NULL, be) == ERR_OK);
    model_free(&m);

    // One more layer than the checkpoint has: the missing tensor is reported.
    json_object *root = json_tokener_parse(config);
    json_object *n_obj;
    ASSERT(root && json_object_object_get_ex(root, "num_hidden_layers", &n_obj));
    const int n_layers = json_object_get_int(n_obj);
    json_object_put(root);
    char *more = edit_config(config, n_layers + 1, false);
    write_file(path, more);
    CHECK(model_load(&m, tmp, NULL, be) == ERR_NOTFOUND);
    CHECK(m.layers == NULL && m.ckpt.tensors == NULL);

    // A shared DSA layer with no full layer before it.
    char *shared = edit_config(config, n_layers, true);
    write_file(path, shared);
    CHECK(model_load(&m, tmp, NULL, be) == ERR_INVAL);

    // No such directory.
    CHECK(model_load(&m, "/nonexistent/model", NULL, be) != ERR_OK);
    model_free(&m);  // a zeroed Model is fine

    be->destroy(be);
    free(config);
    free(more);
    free(shared);
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", tmp, shards[i]);
        unlink(path);
    }
    snprintf(path, sizeof path, "%s/hf_quant_config.json", tmp);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", tmp);
    unlink(path);
    rmdir(tmp);
}

// The MTP layer's tensors load on request (and only then), from the golden model that has one.
static void test_mtp(void)
{
    char dir[1100];
    snprintf(dir, sizeof dir, "%s/../mtp_theta", model_dir);
    Backend *be;
    ASSERT(backend_cpu_create(1, &be) == ERR_OK);
    Model m;
    CHECK(model_load(&m, dir, NULL, be) == ERR_OK);
    CHECK(m.cfg.n_mtp_layers == 1 && m.n_layers_loaded == m.cfg.n_layers);
    model_free(&m);
    const ModelOptions with_mtp = {.load_mtp = true};
    CHECK(model_load(&m, dir, &with_mtp, be) == ERR_OK);
    CHECK(m.n_layers_loaded == m.cfg.n_layers + 1);
    CHECK(m.layers[m.cfg.n_layers].is_moe && m.layers[m.cfg.n_layers].experts != NULL);
    model_free(&m);
    be->destroy(be);
}

// A bf16 KV cache on reap_odd over its golden tokens: DSA keeps every position there and
// the generator checked that the MoE routing margins of these tokens are clear, so no
// discrete choice flips (on other tokens one can: a 2^-9 nudge re-routes a token whose
// top experts nearly tie, and the logits then move by O(1)). Each cached value moves by at
// most 2^-9 relative, which moves the logits by a few 1e-3 (measured 2e-3 .. 6e-3); we
// bound it at 2e-2 and require that it is not exactly fp32. Decode equals prefill exactly.
// An fp8 cache: E4M3 keeps 3 mantissa bits, a step 2^5 coarser than bf16's 8, so the bf16
// bound scaled by 32 (0.64); measured 0.26. Decode equals prefill exactly here too.
static void test_low_cache(KvDtype dtype, double bound)
{
    char dir[1100], path[1200];
    snprintf(dir, sizeof dir, "%s/../reap_odd", model_dir);
    snprintf(path, sizeof path, "%s/golden.json", dir);
    json_object *root = json_object_from_file(path), *arr;
    ASSERT(root && json_object_object_get_ex(root, "tokens", &arr));
    const int n_tok = (int) json_object_array_length(arr);
    int *toks = malloc((size_t) n_tok * sizeof *toks);
    ASSERT(toks);
    for (int i = 0; i < n_tok; i++)
        toks[i] = json_object_get_int(json_object_array_get_idx(arr, (size_t) i));
    json_object_put(root);
    Backend *be;
    ASSERT(backend_cpu_create(2, &be) == ERR_OK);
    Model m;
    ASSERT(model_load(&m, dir, NULL, be) == ERR_OK);
    const int V = m.cfg.vocab_size;
    KvCacheParams p = model_kv_params(&m, 3 * ((n_tok + 7) / 8), 8);
    KvCache kv32, kv16;
    ASSERT(kv_init(&kv32, &p) == ERR_OK);
    p.dtype = dtype;
    ASSERT(kv_init(&kv16, &p) == ERR_OK);
    float *a = malloc((size_t) n_tok * V * sizeof *a);
    float *b = malloc((size_t) n_tok * V * sizeof *b);
    float *row = malloc((size_t) V * sizeof *row);
    ASSERT(a && b && row);
    KvSeq s32 = {0}, s16 = {0}, d16 = {0};
    CHECK(model_forward(&m, &kv32, &s32, toks, n_tok, a, true) == ERR_OK);
    CHECK(model_forward(&m, &kv16, &s16, toks, n_tok, b, true) == ERR_OK);
    double worst = 0.0;
    int decode_same = 1;
    for (int t = 0; t < n_tok; t++) {
        double num = 0.0, den = 0.0;
        for (int i = 0; i < V; i++) {
            const double d = (double) b[(size_t) t * V + i] - a[(size_t) t * V + i];
            num += d * d;
            den += (double) a[(size_t) t * V + i] * a[(size_t) t * V + i];
        }
        if (sqrt(num / den) > worst) worst = sqrt(num / den);
        CHECK(model_forward(&m, &kv16, &d16, toks + t, 1, row, false) == ERR_OK);
        decode_same &= memcmp(row, b + (size_t) t * V, (size_t) V * sizeof *row) == 0;
    }
    CHECK(worst > 0.0 && worst < bound);
    CHECK(decode_same);
    printf("%s kv cache: max relative L2 difference to fp32 %.3g (bound %.3g)\n",
           kv_dtype_name(dtype), worst, bound);
    kv_seq_free(&kv32, &s32);
    kv_seq_free(&kv16, &s16);
    kv_seq_free(&kv16, &d16);
    kv_free(&kv32);
    kv_free(&kv16);
    free(a);
    free(b);
    free(row);
    free(toks);
    model_free(&m);
    be->destroy(be);
}

int main(void)
{
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    snprintf(model_dir, sizeof model_dir, "%s/tests/golden/models/dsa_modelopt", src ? src : ".");
    struct stat st;
    if (stat(model_dir, &st) != 0) {
        fprintf(stderr, "golden model \"%s\" not found (set GLMSPARK_SOURCE_DIR)\n", model_dir);
        return 1;
    }
    test_chunks_and_threads();
    test_refusals();
    test_load_errors();
    test_mtp();
    test_low_cache(KV_DTYPE_BF16, 2e-2);
    test_low_cache(KV_DTYPE_FP8, 0.64);
    return check_exit();
}
