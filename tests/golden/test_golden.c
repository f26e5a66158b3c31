/*
 * test_golden.c - one golden model directory against its reference outputs (CPU backend).
 *
 *   test_golden DIR
 *
 * DIR holds a checkpoint (config.json, safetensors) and golden.json (format:
 * tests/golden/README.md). Checks, by golden_check_model(): for every position with reference
 * logits, relative L2 error of the logits row <= TOL_REFERENCE and the same argmax; feeding the
 * tokens one at a time (decode) gives the prefill's logits to <= TOL_DECODE; greedy generation
 * from greedy.prompt with the KV cache equals greedy.output. Prints the largest errors.
 *
 * The tolerances follow from what is measured: over every golden model (the hand-picked ones,
 * the seeded sweep, the tie model and the 4,160-token DSA model) the CPU backend's fp32 pipeline
 * stays within 4e-6 of the float64 references (tests/golden/README.md has the figures), so
 * TOL_REFERENCE = 2e-5 fails a regression of 5x while a wrong op moves logits by > 1e-2.
 * Decode and prefill run the same fp32 ops in another grouping: measured <= 1e-6, TOL_DECODE
 * 1e-5.
 */
#include <stdio.h>
#include <stdlib.h>

#include "engine/model/backend.h"
#include "engine/shared/err.h"
#include "tests/check.h"
#include "tests/golden/golden_data.h"

enum { THREADS = 2 };
#define TOL_REFERENCE 2e-5
#define TOL_DECODE 1e-5

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_golden MODEL_DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    Golden g;
    float *want = golden_load(dir, &g);
    if (!want) return 1;

    Backend *be = NULL;
    ASSERT(backend_cpu_create(THREADS, &be) == ERR_OK);
    free(golden_check_model(be, "cpu", dir, &g, want, TOL_REFERENCE, TOL_DECODE));

    free(want);
    golden_free(&g);
    be->destroy(be);
    return check_exit();
}
