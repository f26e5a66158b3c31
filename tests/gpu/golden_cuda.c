/*
 * golden_cuda.c - one golden model directory through the CUDA backend (label gpu).
 *
 *   gpu_golden_cuda DIR [CLI_LOGITS]
 *
 * The checks of tests/golden/test_golden.c (golden_check_model(), format in
 * tests/golden/README.md) with backend_cuda: every reference position's logits within
 * TOL_REFERENCE relative L2 of the reference with the same argmax; decode (one token at a
 * time) equals the prefill to TOL_DECODE; greedy generation equals the reference. Also the
 * CUDA-vs-CPU-backend difference of the prefill logits at every position, and, when
 * CLI_LOGITS is given (a file from `glmspark logits --backend cuda --tokens <golden tokens>`),
 * that file against the reference the same way. Needs a GPU: never run by ops/test.
 *
 * Tolerances from what is measured: the CUDA backend computes in fp32 with double
 * reductions, as the CPU backend does; over every golden model it stays within 4e-6 of the
 * references and of the CPU backend (docs: tests/golden/README.md), so 2e-5 (the CPU test's
 * bound) fails a fivefold regression. Decode and prefill: 1e-5.
 */
#include <json-c/json.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend/backend_cuda.h"
#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/shared/err.h"
#include "tests/check.h"
#include "tests/golden/golden_data.h"

#define TOL_REFERENCE 2e-5
#define TOL_DECODE 1e-5

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

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: gpu_golden_cuda MODEL_DIR [CLI_LOGITS]\n");
        return 2;
    }
    const char *dir = argv[1];
    Golden g;
    float *want = golden_load(dir, &g);
    if (!want) return 1;
    const int V = g.vocab;

    Backend *cpu = NULL, *be = NULL;
    // The CPU reference prefill on every core: the long-context golden is 4,160 tokens.
    const long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
    ASSERT(backend_cpu_create(n_cpu > 1 ? (int) n_cpu : 1, &cpu) == ERR_OK);
    if (backend_cuda_create(0, &be) != ERR_OK) {
        fprintf(stderr, "no CUDA device\n");
        return 1;
    }
    float *ref_cpu = prefill(cpu, dir, &g);
    CHECK(ref_cpu != NULL);

    float *got = golden_check_model(be, "cuda", dir, &g, want, TOL_REFERENCE, TOL_DECODE);
    if (got && ref_cpu) {
        // Both backends' prefill logits at every position: the CPU run as the reference.
        Golden all = g;
        all.logits_first = 0;
        golden_compare("cuda prefill vs cpu backend", got, ref_cpu, &all,
                       g.logits_tolerance > TOL_REFERENCE ? g.logits_tolerance : TOL_REFERENCE);
    }

    // 4. the command line's output, when given
    if (argc == 3) {
        float *cli = golden_read_floats(argv[2], (size_t) g.n_tokens * V);
        CHECK(cli != NULL);
        if (cli) golden_compare("glmspark logits --backend cuda vs reference", cli, want, &g,
                                TOL_REFERENCE);
        free(cli);
    }

    free(got);
    free(want);
    free(ref_cpu);
    golden_free(&g);
    be->destroy(be);
    cpu->destroy(cpu);
    return check_exit();
}
