/*
 * golden_cuda.c - one golden model directory through the CUDA backend (label gpu).
 *
 *   gpu_golden_cuda DIR [CLI_LOGITS]
 *
 * Like tests/golden/test_golden.c (format there), with backend_cuda: every position's logits
 * within 1e-3 relative L2 of transformers' float64 reference with the same argmax; decode
 * (one token at a time) equals the prefill to 1e-5; greedy generation equals the reference.
 * Also prints the CUDA-vs-CPU-backend difference of the prefill logits, and, when CLI_LOGITS
 * is given (a file from `glmspark logits --backend cuda --tokens <golden tokens>`), checks
 * that file against the reference the same way. Needs a GPU: never run by ops/test.
 */
#include <json-c/json.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "engine/backend.h"
#include "engine/backend_cuda.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "tests/check.h"
#include "tests/golden/golden_data.h"

// Prefill logits [n_tokens, V] of the golden tokens on backend be, or NULL.
static float *prefill(Backend *be, const char *dir, const Golden *g)
{
    Model m;
    if (model_load(&m, dir, NULL, be) != ERR_OK) return NULL;
    const KvCacheParams kp = model_kv_params(&m, (g->n_tokens + 15) / 16, 16);
    KvCache kv;
    ASSERT(kv_init(&kv, &kp) == ERR_OK);
    float *got = malloc((size_t) g->n_tokens * g->vocab * sizeof *got);
    ASSERT(got);
    KvSeq seq = {0};
    const Err err = model_forward(&m, &kv, &seq, g->tokens, g->n_tokens, got, true);
    kv_seq_free(&kv, &seq);
    kv_free(&kv);
    model_free(&m);
    if (err) {
        free(got);
        return NULL;
    }
    return got;
}

// Largest per-row relative L2 error of got against want; counts argmax mismatches.
static double compare(const char *what, const float *got, const float *want, const Golden *g,
                      double tol)
{
    const int V = g->vocab;
    double worst = 0.0;
    int worst_pos = 0, argmax_bad = 0;
    for (int t = 0; t < g->n_tokens; t++) {
        const double e = golden_rel_l2(got + (size_t) t * V, want + (size_t) t * V, V);
        if (e > worst) worst = e, worst_pos = t;
        CHECK(e <= tol);
        const int a = golden_argmax(got + (size_t) t * V, V), b = golden_argmax(want + (size_t) t * V, V);
        argmax_bad += a != b;
        if (a != b) fprintf(stderr, "%s: position %d: argmax %d, reference %d\n", what, t, a, b);
    }
    CHECK(argmax_bad == 0);
    printf("%s: max relative L2 error %.3g (position %d of %d), %d argmax mismatches\n", what,
           worst, worst_pos, g->n_tokens, argmax_bad);
    return worst;
}

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: gpu_golden_cuda MODEL_DIR [CLI_LOGITS]\n");
        return 2;
    }
    const char *dir = argv[1];
    Golden g;
    if (!golden_read(dir, &g)) return 1;
    float *want = golden_read_logits(dir, &g);
    if (!want) return 1;
    const int V = g.vocab;

    Backend *cpu = NULL, *be = NULL;
    ASSERT(backend_cpu_create(2, &cpu) == ERR_OK);
    if (backend_cuda_create(0, &be) != ERR_OK) {
        fprintf(stderr, "no CUDA device\n");
        return 1;
    }
    float *ref_cpu = prefill(cpu, dir, &g);
    CHECK(ref_cpu != NULL);

    Model m;
    if (model_load(&m, dir, NULL, be) != ERR_OK) {
        fprintf(stderr, "could not load the model in \"%s\" on CUDA\n", dir);
        return 1;
    }
    CHECK(m.cfg.vocab_size == g.vocab);
    const int longest =
        g.n_tokens > g.n_prompt + g.max_tokens ? g.n_tokens : g.n_prompt + g.max_tokens;
    const int block = 16;  // small blocks: sequences cross block boundaries
    const KvCacheParams kp = model_kv_params(&m, 3 * ((longest + block - 1) / block), block);
    KvCache kv;
    ASSERT(kv_init(&kv, &kp) == ERR_OK);

    // 1. one forward pass over every token
    float *got = malloc((size_t) g.n_tokens * V * sizeof *got);
    float *row = malloc((size_t) V * sizeof *row);
    ASSERT(got && row);
    KvSeq seq = {0};
    CHECK(model_forward(&m, &kv, &seq, g.tokens, g.n_tokens, got, true) == ERR_OK);
    printf("%s\n", dir);
    compare("cuda prefill vs reference", got, want, &g, 1e-3);
    if (ref_cpu) compare("cuda prefill vs cpu backend", got, ref_cpu, &g, 1e-3);

    // 2. token-by-token decode equals the prefill
    KvSeq seq2 = {0};
    double worst_decode = 0.0;
    for (int t = 0; t < g.n_tokens; t++) {
        CHECK(model_forward(&m, &kv, &seq2, g.tokens + t, 1, row, false) == ERR_OK);
        const double e = golden_rel_l2(row, got + (size_t) t * V, V);
        if (e > worst_decode) worst_decode = e;
    }
    CHECK(worst_decode <= 1e-5);
    printf("cuda decode vs prefill: max relative L2 difference %.3g\n", worst_decode);
    kv_seq_free(&kv, &seq2);
    kv_seq_free(&kv, &seq);

    // 3. greedy generation with the KV cache
    KvSeq seq3 = {0};
    int *gen = malloc(((size_t) g.max_tokens + 1) * sizeof *gen);
    ASSERT(gen);
    CHECK(model_forward(&m, &kv, &seq3, g.prompt, g.n_prompt, row, false) == ERR_OK);
    for (int i = 0; i < g.max_tokens; i++) {
        gen[i] = golden_argmax(row, V);
        if (i + 1 < g.max_tokens)
            CHECK(model_forward(&m, &kv, &seq3, &gen[i], 1, row, false) == ERR_OK);
    }
    CHECK(g.n_output == g.max_tokens);
    int same = g.n_output == g.max_tokens;
    for (int i = 0; i < g.max_tokens && i < g.n_output; i++)
        same &= gen[i] == g.output[i];
    CHECK(same);
    printf("cuda greedy %d tokens:", g.max_tokens);
    for (int i = 0; i < g.max_tokens; i++)
        printf(" %d", gen[i]);
    printf(" (%s the reference)\n", same ? "equal to" : "DIFFERENT from");
    kv_seq_free(&kv, &seq3);

    // 4. the command line's output, when given
    if (argc == 3) {
        float *cli = malloc((size_t) g.n_tokens * V * sizeof *cli);
        FILE *f = fopen(argv[2], "rb");
        const bool ok =
            cli && f
            && fread(cli, sizeof *cli, (size_t) g.n_tokens * V, f) == (size_t) g.n_tokens * V;
        if (f) fclose(f);
        CHECK(ok);
        if (ok) compare("glmspark logits --backend cuda vs reference", cli, want, &g, 1e-3);
        free(cli);
    }

    free(gen);
    free(got);
    free(row);
    free(want);
    free(ref_cpu);
    golden_free(&g);
    kv_free(&kv);
    model_free(&m);
    be->destroy(be);
    cpu->destroy(cpu);
    return check_exit();
}
