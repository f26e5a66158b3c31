/*
 * golden_data.h - read a golden model directory's golden.json and logits file, and the two
 * measures the golden tests compare by. Shared by tests/golden/test_golden.c (CPU) and
 * tests/gpu/golden_cuda.c (CUDA backend). Format: tests/golden/README.md.
 *
 * Ownership: golden_read() fills a Golden whose arrays the caller frees with golden_free();
 *            golden_read_logits() returns a malloc'd array the caller frees.
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

#include "common/err.h"

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
} Golden;

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
    if (!g->tokens || g->n_tokens < 1 || g->vocab < 1 || !g->prompt || !g->output) {
        fprintf(stderr, "\"%s\" lacks tokens, vocab_size or greedy.prompt/output\n", path);
        return false;
    }
    return true;
}

static inline float *golden_read_logits(const char *dir, const Golden *g)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, g->logits_file);
    const size_t count = (size_t) g->n_tokens * g->vocab;
    float *v = malloc(count * sizeof *v);
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

static inline double golden_rel_l2(const float *got, const float *want, int n)
{
    double num = 0.0, den = 0.0;
    for (int i = 0; i < n; i++) {
        const double d = (double) got[i] - want[i];
        num += d * d;
        den += (double) want[i] * want[i];
    }
    return sqrt(num / (den > 0.0 ? den : 1.0));
}

static inline int golden_argmax(const float *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

// Release the arrays golden_read() allocated; safe on a zeroed Golden.
static inline void golden_free(Golden *g)
{
    free(g->tokens);
    free(g->prompt);
    free(g->output);
    memset(g, 0, sizeof *g);
}

#endif  // TESTS_GOLDEN_GOLDEN_DATA_H
