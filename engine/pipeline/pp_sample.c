/*
 * pp_sample.c - a step's rows sampled on a thread pool (pp_sample.h).
 */
#include "engine/pipeline/pp_sample.h"

#include <math.h>
#include <stddef.h>

#include "engine/shared/err.h"

static void begin_task(void *ctx, int task, int thread)
{
    (void) thread;
    PpSampleScratch *sc = ctx;
    PpSampleRow *r = &sc->rows[task];
    sampler_apply_penalties(r->sampler, r->logits, r->history, r->n_history);
    if (r->mask) {
        const size_t V = (size_t) r->sampler->vocab_size;
        for (size_t id = 0; id < V; id++)
            if (!(r->mask[id >> 5] >> (id & 31) & 1)) r->logits[id] = -INFINITY;
    }
    r->is_pending = !sampler_begin(r->sampler, r->logits, r->token);
}

static void weights_task(void *ctx, int task, int thread)
{
    (void) thread;
    PpSampleScratch *sc = ctx;
    const PpSampleRow *r = &sc->rows[sc->chunks[task].row];
    sampler_weights(r->sampler, r->logits, sc->chunks[task].chunk, sc->chunks[task].n_chunks);
}

// A pending row whole (no more threads than pending rows): its weights while they stay in
// this core's cache, then its draw.
static void whole_task(void *ctx, int task, int thread)
{
    (void) thread;
    PpSampleScratch *sc = ctx;
    const PpSampleRow *r = &sc->rows[sc->pending[task]];
    sampler_weights(r->sampler, r->logits, 0, 1);
    *r->token = sampler_finish(r->sampler);
}

static void finish_task(void *ctx, int task, int thread)
{
    (void) thread;
    PpSampleScratch *sc = ctx;
    const PpSampleRow *r = &sc->rows[sc->pending[task]];
    *r->token = sampler_finish(r->sampler);
}

void pp_sample_rows(ThreadPool *pool, PpSampleRow *rows, int n, PpSampleScratch *scratch)
{
    ASSERT(n >= 0 && n <= PP_SAMPLE_MAX_ROWS);
    if (n == 0) return;
    scratch->rows = rows;
    thread_pool_run(pool, n, begin_task, scratch);
    int n_pending = 0;
    for (int i = 0; i < n; i++)
        if (rows[i].is_pending) scratch->pending[n_pending++] = i;
    if (n_pending == 0) return;
    const int n_threads = thread_pool_size(pool);
    const int per_row = (n_threads + n_pending - 1) / n_pending;  // n_pending * per_row < n + threads
    if (per_row == 1) {
        thread_pool_run(pool, n_pending, whole_task, scratch);
        return;
    }
    int n_chunks = 0;
    for (int i = 0; i < n_pending; i++)
        for (int c = 0; c < per_row; c++) {
            scratch->chunks[n_chunks].row = scratch->pending[i];
            scratch->chunks[n_chunks].chunk = c;
            scratch->chunks[n_chunks++].n_chunks = per_row;
        }
    thread_pool_run(pool, n_chunks, weights_task, scratch);
    thread_pool_run(pool, n_pending, finish_task, scratch);
}
