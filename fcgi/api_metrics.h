/*
 * api_metrics.h - the text of GET /metrics (Prometheus exposition format 0.0.4).
 *
 * Two sources, read in one call:
 *   the job queue     queue depth, jobs by state, prompt/completion tokens, TTFT and
 *                     inter-token latency histograms, engine boots (glmspark_rank_up,
 *                     glmspark_engine_up); per model (label model, glmspark_model_*): queue
 *                     depth, running jobs, completion and prompt tokens, live engine boots
 *                     and the sum of their tokens/s;
 *   engines.stats     the engine internals that rank 0 of each engine publishes (the newest
 *                     boot of each engine name that has not stopped and beat its heartbeat
 *                     in the last 10 minutes; every sample labelled engine and model)
 *                     (engine/shared/stats.h): step time (avg and max over the
 *                     engine's window), batch sequences and tokens, KV blocks used and
 *                     capacity (a gauge, so not named _total) and their ratio,
 *                     running and waiting sequences, tokens/s, per-rank up/loading/weights
 *                     ({rank, host}), the token and step counters, the heartbeat's age.
 *                     Absent (HELP and TYPE only) while no engine publishes stats.
 * Every family has one HELP and one TYPE line before its samples; label values are escaped
 * (backslash, double quote, newline). GET /health's verdict is computed here too, from the
 * same engines.stats.
 *
 * Ownership: *text is the caller's (free()).
 * Threads:   call with the calling thread's ApiDb.
 * Errors:    ERR_DB when a query fails (logged by api_db_exec), ERR_NOMEM.
 */
#ifndef FCGI_API_METRICS_H
#define FCGI_API_METRICS_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/shared/err.h"
#include "fcgi/api_db.h"

#ifdef __cplusplus
extern "C" {
#endif

// Render the whole /metrics body into *text (NUL-terminated, *n_text bytes). On failure
// *text is NULL.
Err api_metrics_render(ApiDb *db, char **text, size_t *n_text);

enum { API_HEALTH_MAX_MODELS = 32 };  // models listed in one answer (more are counted, not listed)

typedef struct ApiHealthModel {
    char name[128];
    const char *status;  // the best of its engines' (below)
    int n_engines;
} ApiHealthModel;

typedef struct ApiHealth {
    int n_engines;       // engine boots with a heartbeat in the last STATS_STALE_S seconds
    const char *status;  // "ok", "unavailable", "loading", "stopping" or "degraded" (static)
    bool has_stats;      // the engine the verdict came from published stats: ranks_up, world set
    int ranks_up, world;
    ApiHealthModel models[API_HEALTH_MAX_MODELS];  // every model with a live engine
    int n_models;
} ApiHealth;

// What GET /health answers. Each live engine (a heartbeat in the last STATS_STALE_S seconds)
// is "ok" when its published state is "ready" with no rank down (or when it publishes no
// readable state: its heartbeat says up), else "loading", "stopping" or "degraded"; a model's
// status is the best of its engines' (ok, degraded, loading, stopping), and the answer's the
// best over every engine, or over the engines of `model` when it is not NULL ("unavailable"
// with none): one ready engine is enough to serve, whatever the others do (a restart, a
// second engine still loading). 200 for "ok", else 503. ERR_DB when the query fails; *out
// then says "unavailable".
Err api_metrics_health(ApiDb *db, const char *model, ApiHealth *out);

#ifdef __cplusplus
}
#endif
#endif  // FCGI_API_METRICS_H
