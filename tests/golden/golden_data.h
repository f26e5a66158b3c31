/*
 * golden_data.h - read a golden model directory's golden.json and logits file, the two
 * measures the golden tests compare by, and the checks they run on a backend. Shared by
 * tests/golden/test_golden.c (CPU) and tests/gpu/golden_cuda.c (CUDA backend). Format:
 * tests/golden/README.md.
 *
 * Ownership: golden_read() fills a Golden whose arrays the caller frees with golden_free();
 *            golden_read_logits() and golden_check_model() return malloc'd arrays the caller
 *            frees.
 * Threads:   no shared state.
 * Errors:    a missing or malformed file prints the path and returns false / NULL.
 */
#ifndef TESTS_GOLDEN_GOLDEN_DATA_H
#define TESTS_GOLDEN_GOLDEN_DATA_H

#include <json-c/json.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/shared/err.h"
#include "tests/check.h"
#include "tests/golden/rel_l2.h"

typedef struct Golden {
    int *tokens;
    int n_tokens;
    int vocab;
    char logits_file[256];
    int *prompt;
    int n_prompt;
    int max_tokens;
    int *output;
    int n_output;
    int logits_first;  // the logits file holds positions [logits_first, n_tokens)
    bool *fragile;     // [n_tokens]: the position's DSA choice is within fragile_rel of a tie
    double fragile_rel;
    double logits_tolerance;  // > 0: the reference's own bound for the other positions (a
                              // stated reason in golden.json), used when above the runner's
} Golden;

// The bound for fragile positions (golden.json "fragile_positions", the long-context model):
// an fp32 engine may swap two keys whose indexer scores differ by less than its own error,
// which moves that row's logits by up to ~7e-3 relative (measured: 6.8e-3 at 4,160 tokens,
// 4.3e-3 between the CUDA and CPU backends on long_dsa); 1e-2 still catches a wrong op there,
// and every other position keeps the tight bound.
#define GOLDEN_TOL_FRAGILE 1e-2

// Release the arrays golden_read() allocated; safe on a zeroed Golden.
static inline void golden_free(Golden *g)
{
    free(g->tokens);
    free(g->prompt);
    free(g->output);
    free(g->fragile);
    memset(g, 0, sizeof *g);
}

static inline int *golden_int_array(json_object *arr, int *n)
{
    if (!arr || !json_object_is_type(arr, json_type_array)) return NULL;
    *n = (int) json_object_array_length(arr);
    int *v = malloc(((size_t) *n + 1) * sizeof *v);
    ASSERT(v);
    for (int i = 0; i < *n; i++)
        v[i] = json_object_get_int(json_object_array_get_idx(arr, (size_t) i));
    return v;
}

static inline bool golden_read(const char *dir, Golden *g)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/golden.json", dir);
    json_object *root = json_object_from_file(path);
    if (!root) {
        fprintf(stderr, "could not read \"%s\"\n", path);
        return false;
    }
    json_object *v, *greedy;
    memset(g, 0, sizeof *g);
    g->tokens = golden_int_array(json_object_object_get_ex(root, "tokens", &v) ? v : NULL, &g->n_tokens);
    g->vocab = json_object_object_get_ex(root, "vocab_size", &v) ? json_object_get_int(v) : 0;
    g->logits_first =
        json_object_object_get_ex(root, "logits_first", &v) ? json_object_get_int(v) : 0;
    g->fragile_rel =
        json_object_object_get_ex(root, "fragile_rel", &v) ? json_object_get_double(v) : 0.0;
    g->logits_tolerance = json_object_object_get_ex(root, "logits_tolerance", &v)
                              ? json_object_get_double(v)
                              : 0.0;
    int n_fr = 0;
    int *fr = golden_int_array(
        json_object_object_get_ex(root, "fragile_positions", &v) ? v : NULL, &n_fr);
    if (g->tokens) {
        g->fragile = calloc((size_t) g->n_tokens + 1, sizeof *g->fragile);
        ASSERT(g->fragile);
        for (int i = 0; fr && i < n_fr; i++)
            if (fr[i] >= 0 && fr[i] < g->n_tokens) g->fragile[fr[i]] = true;
    }
    free(fr);
    snprintf(g->logits_file, sizeof g->logits_file, "%s",
             json_object_object_get_ex(root, "logits_file", &v) ? json_object_get_string(v)
                                                                : "logits.f32");
    if (json_object_object_get_ex(root, "greedy", &greedy)) {
        g->prompt =
            golden_int_array(json_object_object_get_ex(greedy, "prompt", &v) ? v : NULL, &g->n_prompt);
        g->output =
            golden_int_array(json_object_object_get_ex(greedy, "output", &v) ? v : NULL, &g->n_output);
        g->max_tokens = json_object_object_get_ex(greedy, "max_tokens", &v) ? json_object_get_int(v)
                                                                            : g->n_output;
    }
    json_object_put(root);
    if (!g->tokens || g->n_tokens < 1 || g->vocab < 1 || !g->prompt || !g->output
        || g->logits_first < 0 || g->logits_first >= g->n_tokens) {
        fprintf(stderr, "\"%s\" lacks tokens, vocab_size or greedy.prompt/output, or its "
                "logits_first is out of range\n", path);
        golden_free(g);
        return false;
    }
    return true;
}

// count floats from path, exactly (the file must end there), malloc'd; NULL after a message.
static inline float *golden_read_floats(const char *path, size_t count)
{
    float *v = malloc(count * sizeof *v + 1);
    FILE *f = fopen(path, "rb");
    const bool ok = v && f && fread(v, sizeof *v, count, f) == count && fgetc(f) == EOF;
    if (f) fclose(f);
    if (!ok) {
        fprintf(stderr, "could not read %zu floats from \"%s\"\n", count, path);
        free(v);
        return NULL;
    }
    return v;
}

static inline float *golden_read_logits(const char *dir, const Golden *g)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, g->logits_file);
    return golden_read_floats(path, (size_t) (g->n_tokens - g->logits_first) * g->vocab);
}

// golden_read() and golden_read_logits() of dir: the reference logits (the caller frees
// them and golden_free()s *g), or NULL with *g zeroed after a message.
static inline float *golden_load(const char *dir, Golden *g)
{
    if (!golden_read(dir, g)) return NULL;
    float *want = golden_read_logits(dir, g);
    if (!want) golden_free(g);
    return want;
}

static inline int golden_argmax(const float *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

// Largest per-row relative L2 error of got [n_tokens, V] (every position) against want (the
// reference's rows, from logits_first); CHECKs each row against tol and every argmax.
static inline double golden_compare(const char *what, const float *got, const float *want,
                                    const Golden *g, double tol)
{
    const int V = g->vocab;
    double worst = 0.0, worst_fragile = 0.0;
    int worst_pos = 0, argmax_bad = 0, n_fragile = 0;
    for (int t = g->logits_first; t < g->n_tokens; t++) {
        const float *w = want + (size_t) (t - g->logits_first) * V, *r = got + (size_t) t * V;
        const double e = golden_rel_l2(r, w, V);
        if (g->fragile && g->fragile[t]) {
            n_fragile++;
            if (e > worst_fragile) worst_fragile = e;
            CHECK(e <= GOLDEN_TOL_FRAGILE);
        } else {
            if (e > worst) worst = e, worst_pos = t;
            CHECK(e <= tol);
        }
        const int a = golden_argmax(r, V), b = golden_argmax(w, V);
        argmax_bad += a != b;
        if (a != b) fprintf(stderr, "%s: position %d: argmax %d, reference %d\n", what, t, a, b);
    }
    CHECK(argmax_bad == 0);
    printf("%s: max relative L2 error %.3g (position %d; positions %d..%d), %d argmax "
           "mismatches (tolerance %.3g)\n",
           what, worst, worst_pos, g->logits_first, g->n_tokens - 1, argmax_bad, tol);
    if (n_fragile)
        printf("%s: %d fragile positions (a DSA choice within %.3g of a tie): max relative L2 "
               "error %.3g (tolerance %.3g)\n",
               what, n_fragile, g->fragile_rel, worst_fragile, GOLDEN_TOL_FRAGILE);
    return worst;
}

// Where a chunked prefill of the golden tokens cuts them (issue 20's awkward boundaries, with
// the 16-position blocks of golden_check_model's cache): a 1-token first chunk, cuts in the
// middle of a block (6, 22), another 1-token chunk (22..23), then every 37 positions, and
// around DSA's top-2048 (2047, 2048, 2049: one chunk holds position 2047, the last whose
// query sees at most 2,048 keys, alone; the next 2048 alone, the first that selects). The
// length of the chunk that starts at `start` of n tokens.
static inline int golden_chunk_len(int start, int n)
{
    static const int cuts[] = {1, 6, 22, 23, 2047, 2048, 2049};
    int end = start < 23 ? n : 23 + 37 * ((start - 23) / 37 + 1);
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++)
        if (cuts[i] > start && cuts[i] < end) end = cuts[i];
    return (end < n ? end : n) - start;
}

// Prefill logits [n, V] of tokens through model_forward in golden_chunk_len's chunks, on a
// fresh sequence of kv (freed again); the calls made in *n_calls (may be NULL). The first
// failing call's error, or ERR_OK.
static inline Err golden_prefill_chunked(Model *m, KvCache *kv, const int *tokens, int n,
                                         float *out, int *n_calls)
{
    KvSeq seq = {0};
    Err err = ERR_OK;
    int calls = 0;
    for (int t = 0; t < n && err == ERR_OK; calls++) {
        const int len = golden_chunk_len(t, n);
        err = model_forward(m, kv, &seq, tokens + t, len, out + (size_t) t * m->cfg.vocab_size,
                            true);
        t += len;
    }
    if (n_calls) *n_calls = calls;
    kv_seq_free(kv, &seq);
    return err;
}

// The golden checks of one model directory on backend be: (1) one forward pass over every
// token against want within tol; (2) feeding the tokens one at a time (decode) gives the
// prefill's logits within tol_decode, and so does a prefill in chunks cut at awkward places
// (golden_chunk_len); (3) greedy generation from greedy.prompt with the KV cache equals
// greedy.output. Returns the prefill logits [n_tokens, V] (the caller frees them), or NULL
// when the model does not load.
static inline float *golden_check_model(Backend *be, const char *what, const char *dir,
                                        const Golden *g, const float *want, double tol,
                                        double tol_decode)
{
    Model m;
    if (model_load(&m, dir, NULL, be) != ERR_OK) {
        fprintf(stderr, "could not load the model in \"%s\" (%s)\n", dir, what);
        CHECK(false);
        return NULL;
    }
    CHECK(m.cfg.vocab_size == g->vocab);
    const int V = g->vocab;
    if (g->logits_tolerance > tol) {
        printf("%s: the reference sets the logits tolerance %.3g (golden.json "
               "logits_tolerance_why)\n",
               dir, g->logits_tolerance);
        tol = g->logits_tolerance;
    }
    const int longest =
        g->n_tokens > g->n_prompt + g->max_tokens ? g->n_tokens : g->n_prompt + g->max_tokens;
    const int block = 16;  // small blocks: sequences cross block boundaries
    const KvCacheParams kp = model_kv_params(&m, 3 * ((longest + block - 1) / block), block);
    KvCache kv;
    ASSERT(kv_init(&kv, &kp) == ERR_OK);
    char label[256];

    // 1. one forward pass over every token
    float *got = malloc((size_t) g->n_tokens * V * sizeof *got);
    float *row = malloc((size_t) V * sizeof *row);
    ASSERT(got && row);
    KvSeq seq = {0};
    CHECK(model_forward(&m, &kv, &seq, g->tokens, g->n_tokens, got, true) == ERR_OK);
    snprintf(label, sizeof label, "%s: %s prefill vs reference", dir, what);
    golden_compare(label, got, want, g, tol);

    // 2. token-by-token decode equals the prefill
    KvSeq seq2 = {0};
    double worst_decode = 0.0;
    for (int t = 0; t < g->n_tokens; t++) {
        CHECK(model_forward(&m, &kv, &seq2, g->tokens + t, 1, row, false) == ERR_OK);
        const double e = golden_rel_l2(row, got + (size_t) t * V, V);
        if (e > worst_decode) worst_decode = e;
    }
    CHECK(worst_decode <= tol_decode);
    printf("%s: %s decode vs prefill max relative L2 difference %.3g (tolerance %.3g)\n", dir,
           what, worst_decode, tol_decode);
    kv_seq_free(&kv, &seq2);
    kv_seq_free(&kv, &seq);

    // 2b. a prefill in chunks equals the prefill in one call
    float *chunked = malloc((size_t) g->n_tokens * V * sizeof *chunked);
    ASSERT(chunked);
    int n_chunks = 0;
    double worst_chunked = 0.0;
    const bool chunks_ok =
        golden_prefill_chunked(&m, &kv, g->tokens, g->n_tokens, chunked, &n_chunks) == ERR_OK;
    CHECK(chunks_ok);
    for (int t = 0; t < g->n_tokens && chunks_ok; t++) {
        const double e = golden_rel_l2(chunked + (size_t) t * V, got + (size_t) t * V, V);
        if (e > worst_chunked) worst_chunked = e;
    }
    CHECK(worst_chunked <= tol_decode);
    printf("%s: %s prefill in %d chunks vs one call: max relative L2 difference %.3g "
           "(tolerance %.3g)\n",
           dir, what, n_chunks, worst_chunked, tol_decode);
    free(chunked);

    // 3. greedy generation with the KV cache
    KvSeq seq3 = {0};
    int *gen = malloc(((size_t) g->max_tokens + 1) * sizeof *gen);
    ASSERT(gen);
    CHECK(model_forward(&m, &kv, &seq3, g->prompt, g->n_prompt, row, false) == ERR_OK);
    for (int i = 0; i < g->max_tokens; i++) {
        gen[i] = golden_argmax(row, V);
        if (i + 1 < g->max_tokens)
            CHECK(model_forward(&m, &kv, &seq3, &gen[i], 1, row, false) == ERR_OK);
    }
    CHECK(g->n_output == g->max_tokens);
    int same = g->n_output == g->max_tokens;
    for (int i = 0; i < g->max_tokens && i < g->n_output; i++)
        same &= gen[i] == g->output[i];
    CHECK(same);
    printf("%s: %s greedy %d tokens:", dir, what, g->max_tokens);
    for (int i = 0; i < g->max_tokens; i++)
        printf(" %d", gen[i]);
    printf(" (%s the reference)\n", same ? "equal to" : "DIFFERENT from");
    kv_seq_free(&kv, &seq3);

    free(gen);
    free(row);
    kv_free(&kv);
    model_free(&m);
    return got;
}

#endif  // TESTS_GOLDEN_GOLDEN_DATA_H
