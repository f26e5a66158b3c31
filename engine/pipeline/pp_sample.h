/*
 * pp_sample.h - sample a step's rows on a thread pool, as the pipeline's last rank does.
 *
 * Each row: its penalties over its history (sampler_apply_penalties), its vocabulary mask
 * (tokens whose bit is clear get -inf), then the draw (sampler.h). The rows start side by
 * side; a row that draws over the whole softmax at temperature > 0 (sampler_begin leaves it
 * pending) has its weights, an exp() per vocabulary entry and the costly part, computed in
 * chunks spread over the pool's threads (ceil(threads / pending rows) chunks each), so one
 * row uses every thread; then the pending rows draw. Tokens and generator states are those
 * of sampler_sample on each row alone, however the work is split (tests/engine/pipeline/
 * test_pp_sample.c).
 *
 * Ownership: rows and their buffers are the caller's; PpSampleScratch is caller storage.
 * Threads:   the caller's; it runs the pool (thread_pool_run: not concurrently, not from a task).
 * Errors:    none.
 */
#ifndef ENGINE_PIPELINE_PP_SAMPLE_H
#define ENGINE_PIPELINE_PP_SAMPLE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/shared/thread_pool.h"
#include "engine/model/sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { PP_SAMPLE_MAX_ROWS = 256 };

typedef struct PpSampleRow {
    Sampler *sampler;
    float *logits;             // [vocab], penalised and masked in place
    const int32_t *history;    // the tokens for the penalties
    int n_history;
    const uint32_t *mask;      // [ceil(vocab / 32)] allowed-token bits, or NULL
    int32_t *token;            // out
    bool is_pending;           // internal
} PpSampleRow;

typedef struct PpSampleScratch {
    int pending[PP_SAMPLE_MAX_ROWS];
    struct {
        int row, chunk, n_chunks;
    } chunks[PP_SAMPLE_MAX_ROWS + THREAD_POOL_MAX_THREADS];
    PpSampleRow *rows;  // the call's rows, for the tasks
} PpSampleScratch;

// Sample rows[0..n) (n <= PP_SAMPLE_MAX_ROWS) on pool; each row's token goes to *row.token.
void pp_sample_rows(ThreadPool *pool, PpSampleRow *rows, int n, PpSampleScratch *scratch);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_PIPELINE_PP_SAMPLE_H
