/*
 * stats.h - the engine's status JSON (engines.stats, version 1), read back.
 *
 * Rank 0 of glmspark-engine writes a JSON object into engines.stats of its boot at every
 * heartbeat (jobq_set_stats, at least every 2 s while it runs); `glmspark status`
 * (engine/cli/cli_status.c) and glmspark-fcgi's /metrics (fcgi/api_metrics.c) read it through
 * stats_parse. Every key of version 1 is documented in EngineStats below. Readers are
 * lenient in one way only: a missing key reads as 0 / "" / no ranks (an older engine, or
 * one that does not know the value yet); a key of the wrong JSON type, a rank that is not
 * an object, or text that is not a JSON object is ERR_FORMAT, with the key named in
 * err_key. Unknown keys are ignored (a newer engine may add some).
 *
 * STATS_SQL_LATEST is the one query both readers use: the newest engine boot that has not
 * stopped, its heartbeat age, its stats, and the queue's counts.
 *
 * Ownership: EngineStats is caller storage, with fixed-size arrays (no heap).
 * Threads:   stats_parse may be called from any thread.
 * Errors:    ERR_FORMAT as above; nothing is logged (callers report with their context).
 */
#ifndef ENGINE_SHARED_STATS_H
#define ENGINE_SHARED_STATS_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define STATS_MAX_RANKS 64
#define STATS_STALE_S 30.0  // a heartbeat older than this is a stale engine (/health too)

// Columns: 0 id, 1 name, 2 model, 3 pid ('' when NULL), 4 heartbeat age in seconds,
// 5 stats ('' when NULL), 6 jobs queued, 7 jobs running. No row when no engine is running;
// the queue counts then come from STATS_SQL_QUEUE (columns 0 queued, 1 running). The
// _ADMIN variants read the same through the admin role's views (sql/002, sql/005).
#define STATS_SQL_LATEST_FROM(ENGINES, QUEUED, RUNNING)                              \
    "SELECT e.id, e.name, e.model, coalesce(e.pid::text, ''),"                        \
    " extract(epoch FROM now() - e.heartbeat_at)::float8, coalesce(e.stats::text, ''),"    \
    " (" QUEUED "), (" RUNNING ") FROM " ENGINES " e WHERE e.stopped_at IS NULL"      \
    " ORDER BY e.id DESC LIMIT 1"
#define STATS_SQL_QUEUED "SELECT count(*) FROM jobs WHERE state = 'queued'"
#define STATS_SQL_RUNNING "SELECT count(*) FROM jobs WHERE state = 'running'"
#define STATS_SQL_LATEST STATS_SQL_LATEST_FROM("engines", STATS_SQL_QUEUED, STATS_SQL_RUNNING)
#define STATS_SQL_QUEUE "SELECT (" STATS_SQL_QUEUED "), (" STATS_SQL_RUNNING ")"
#define STATS_SQL_LATEST_ADMIN                                                        \
    STATS_SQL_LATEST_FROM("admin.engines", "SELECT count(*) FROM admin.queue",        \
                          "SELECT count(*) FROM admin.running")
#define STATS_SQL_QUEUE_ADMIN                                                         \
    "SELECT (SELECT count(*) FROM admin.queue), (SELECT count(*) FROM admin.running)"

typedef struct StatsRank {
    int rank;
    char host[64];
    int pid;
    char state[16];       // "up", "down" or "loading"
    int first_layer;      // the decoder layers this rank holds: [first_layer, last_layer)
    int last_layer;       // (e.g. 0 and 26 for the first of 79 layers)
    double weight_bytes;  // bytes of weights loaded on this rank (a double: 2^53 is ample)
    double load_fraction; // 0..1 while loading, 1 when loaded
} StatsRank;

typedef struct EngineStats {
    int version;
    double updated_unix;     // when rank 0 wrote it, seconds since the epoch
    char backend[16];        // "cpu" or "cuda"
    char model[128];
    int world;               // pipeline ranks
    char state[16];          // "loading", "ready" or "stopping"
    int n_ranks;             // entries of ranks[] (at most STATS_MAX_RANKS are kept)
    StatsRank ranks[STATS_MAX_RANKS];
    int64_t kv_blocks_total;
    int64_t kv_blocks_used;
    int64_t kv_block_size;   // tokens per block
    int64_t max_num_seqs;
    int64_t running;         // sequences in the scheduler
    int64_t waiting;
    int64_t inflight_microbatches;
    int64_t steps_total;
    double step_ms_avg;      // over the last window_s
    double step_ms_max;
    double commit_ms_avg;    // the job-queue commit after each step (0 from older engines)
    // Decode-only steps (no prompt tokens) since the boot, and their step and commit time
    int64_t decode_steps_total;
    double decode_step_ms_total, decode_commit_ms_total;
    double batch_seqs_avg;
    double batch_tokens_avg;
    int64_t prompt_tokens_total;
    int64_t generated_tokens_total;
    double tokens_per_s;     // generated tokens per second over the last window
    double window_s;
    // Prefix caching: prompt tokens looked up and served from the cache since the boot;
    // KV blocks holding cached prefixes, and those of them no sequence uses (evictable)
    int64_t prefix_query_tokens_total, prefix_hit_tokens_total;
    int64_t prefix_cached_blocks, prefix_idle_blocks;
} EngineStats;

// Parse the status JSON text into *out (zeroed first). ERR_FORMAT when json is not a JSON
// object or a known key has the wrong type; then err_key (may be NULL) gets the key's name
// (static storage) and *out is zeroed.
Err stats_parse(const char *json, EngineStats *out, const char **err_key);

// Ranks whose state is "up".
int stats_n_ranks_up(const EngineStats *s);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_STATS_H
