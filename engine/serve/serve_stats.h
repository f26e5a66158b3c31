/*
 * serve_stats.h - glmspark-engine's status JSON (version 1, engine/shared/stats.h): what the
 * engine publishes with jobq_set_stats() every heartbeat and `glmspark status` / /metrics
 * read back from engines.stats.
 *
 * The engine records every scheduler step (serve_stats_step: its duration, the job-queue
 * commit that followed it, the sequences that got a token, the tokens it put through the
 * model, the tokens it generated) and every admitted prompt; serve_stats_json() turns the
 * last window_s seconds of steps into averages (step_ms_avg/max, commit_ms_avg,
 * batch_seqs_avg, batch_tokens_avg, tokens_per_s) next to the decode-only steps' counters
 * (decode_steps_total, decode_step_ms_total, decode_commit_ms_total) and
 * the totals, the KV cache occupancy and the pipeline's ranks. Every key of version 1 is
 * always present.
 *
 * Ownership: ServeStats is plain data plus a fixed ring; serve_stats_json returns a
 *            malloc'd string the caller frees.
 * Threads:   one thread.
 * Errors:    serve_stats_json returns NULL on ERR_NOMEM.
 */
#ifndef ENGINE_SERVE_SERVE_STATS_H
#define ENGINE_SERVE_SERVE_STATS_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/pipeline/pp.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { SERVE_STATS_RING = 4096, SERVE_STATS_WINDOW_S = 10 };

typedef struct ServeStep {
    double t;      // monotonic seconds at the step's end
    float ms;         // its duration (sched_step: the model's forward and the sampling)
    float commit_ms;  // the job queue's time on the engine's thread after it: the last
                      // commit's answer read, this step's output sent (one transaction)
    int n_seqs;    // sequences that got a token
    int n_tokens;  // tokens through the model (prefill + decode)
    int n_generated;
} ServeStep;

typedef struct ServeRank {
    char host[64];
    int pid;
    const char *state;  // "up", "down", "loading"
    int first_layer, last_layer;
    uint64_t weight_bytes;
    double load_fraction;
} ServeRank;

typedef struct ServeStats {
    // Set by the engine
    const char *backend, *model, *state;
    int world;
    ServeRank ranks[PP_MAX_WORLD];
    int kv_blocks_total, kv_blocks_used, kv_block_size;
    int max_num_seqs, running, waiting, inflight;
    // Prefix caching (SchedStats): prompt tokens looked up and served, blocks cached
    uint64_t prefix_query_tokens, prefix_hit_tokens;
    int prefix_blocks, prefix_blocks_idle;
    // Kept by serve_stats_step / serve_stats_prompt
    uint64_t steps_total, prompt_tokens_total, generated_tokens_total;
    // Decode-only steps (every token through the model a sequence's next: no prompt tokens)
    // and their time: counters, so that a scrape before and after a run gives its decode
    // step's mean exactly, whatever the window holds
    uint64_t decode_steps_total;
    double decode_step_ms_total, decode_commit_ms_total;
    ServeStep ring[SERVE_STATS_RING];
    int head, n;  // oldest at head
} ServeStats;

// Record one scheduler step that ended at `t` (clock_now_s(), engine/shared/clock.h).
void serve_stats_step(ServeStats *s, const ServeStep *step);

// Count an admitted prompt of n tokens.
void serve_stats_prompt(ServeStats *s, int n);

// The status JSON as of now (monotonic now_mono, wall clock now_unix); malloc'd.
char *serve_stats_json(const ServeStats *s, double now_mono, double now_unix);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SERVE_SERVE_STATS_H
