/*
 * api_metrics.c - the /metrics body (see api_metrics.h).
 *
 * Written into an open_memstream, family by family: family() prints the HELP and TYPE
 * lines, then the samples follow. The queue figures are SQL aggregates over jobs and
 * engines; the engine internals are the newest running boot's engines.stats parsed by
 * stats_parse, for every engine (the newest boot of each name), labelled engine and model (a
 * boot whose stats are missing or unreadable contributes only its heartbeat age; unreadable
 * stats are logged).
 */
#include "fcgi/api_metrics.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/stats.h"

static const char *const ttft_buckets[] = {"0.05", "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "30", "60"};
enum { N_TTFT_BUCKETS = sizeof ttft_buckets / sizeof *ttft_buckets };

static void family(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

// A label value with \, " and newline escaped.
static void put_label_value(FILE *f, const char *s)
{
    for (; *s; s++) {
        if (*s == '\\') fputs("\\\\", f);
        else if (*s == '"') fputs("\\\"", f);
        else if (*s == '\n') fputs("\\n", f);
        else fputc(*s, f);
    }
}

// ---------------------------------------------------------------------------
// The job queue

static const char queue_sql[] =
    "SELECT (SELECT count(*) FROM jobs WHERE state = 'queued'),"
    " (SELECT count(*) FROM jobs WHERE state = 'running'),"
    " (SELECT coalesce(sum(n_completion_tokens), 0) FROM jobs),"
    " (SELECT coalesce(sum(n_prompt_tokens), 0) FROM jobs),"
    " (SELECT count(*) FROM engines WHERE stopped_at IS NULL"
    "   AND heartbeat_at > now() - interval '30 seconds'),"
    " (SELECT count(*) FROM jobs WHERE state = 'succeeded'),"
    " (SELECT count(*) FROM jobs WHERE state = 'failed'),"
    " (SELECT count(*) FROM jobs WHERE state = 'cancelled')";

// Per bucket b: TTFT <= b, inter-token latency <= b; then (the same on every row) the
// TTFT count and sum, the inter-token count and sum.
static const char latency_sql[] =
    "SELECT b, count(*) FILTER (WHERE extract(epoch FROM first_token_at - claimed_at) <= b),"
    " count(*) FILTER (WHERE n_completion_tokens > 1 AND finished_at IS NOT NULL AND"
    "   extract(epoch FROM finished_at - first_token_at) / (n_completion_tokens - 1) <= b),"
    " count(*) FILTER (WHERE first_token_at IS NOT NULL),"
    " coalesce(sum(extract(epoch FROM first_token_at - claimed_at)), 0),"
    " count(*) FILTER (WHERE n_completion_tokens > 1 AND finished_at IS NOT NULL),"
    " coalesce(sum(extract(epoch FROM finished_at - first_token_at) / (n_completion_tokens - 1))"
    "   FILTER (WHERE n_completion_tokens > 1 AND finished_at IS NOT NULL), 0)"
    " FROM unnest('{0.05,0.1,0.25,0.5,1,2.5,5,10,30,60}'::float8[]) b"
    " LEFT JOIN jobs ON first_token_at IS NOT NULL GROUP BY b ORDER BY b";

static const char boots_sql[] =
    "SELECT id, name, (stopped_at IS NULL AND heartbeat_at > now() - interval '30 seconds')::int"
    " FROM engines ORDER BY id DESC LIMIT 8";

// Per model (every model with jobs or a live engine boot): queued, running, completion and
// prompt tokens, live boots, and the live boots' own tokens/s (engines.stats) summed.
static const char models_sql[] =
    "WITH live AS (SELECT model, stats FROM engines WHERE stopped_at IS NULL"
    "   AND heartbeat_at > now() - interval '30 seconds'),"
    " j AS (SELECT model, count(*) FILTER (WHERE state = 'queued') AS q,"
    "   count(*) FILTER (WHERE state = 'running') AS r, sum(n_completion_tokens) AS ct,"
    "   sum(n_prompt_tokens) AS pt FROM jobs GROUP BY model),"
    " e AS (SELECT model, count(*) AS n, sum((stats ->> 'tokens_per_s')::float8)"
    "   FILTER (WHERE jsonb_typeof(stats -> 'tokens_per_s') = 'number') AS tps"
    "   FROM live GROUP BY model)"
    " SELECT coalesce(j.model, e.model), coalesce(j.q, 0), coalesce(j.r, 0), coalesce(j.ct, 0),"
    "   coalesce(j.pt, 0), coalesce(e.n, 0), coalesce(e.tps, 0)"
    " FROM j FULL JOIN e ON e.model = j.model ORDER BY 1";

static void put_models(FILE *f, PGresult *m)
{
    static const struct {
        const char *name, *type, *help;
    } fams[] = {
        {"glmspark_model_queue_depth", "gauge", "Jobs of the model waiting in the queue."},
        {"glmspark_model_jobs_running", "gauge", "Jobs of the model an engine is generating."},
        {"glmspark_model_completion_tokens_total", "counter",
         "Tokens generated for the model's jobs in the database."},
        {"glmspark_model_prompt_tokens_total", "counter", "Prompt tokens of the model's jobs in the database."},
        {"glmspark_model_engines_up", "gauge",
         "Engine boots serving the model whose heartbeat is under 30 s old."},
        {"glmspark_model_tokens_per_second", "gauge",
         "Generated tokens per second of the model's live engines (their own windows, summed)."},
    };
    for (int k = 0; k < (int) (sizeof fams / sizeof *fams); k++) {
        family(f, fams[k].name, fams[k].type, fams[k].help);
        for (int i = 0; i < PQntuples(m); i++) {
            fprintf(f, "%s{model=\"", fams[k].name);
            put_label_value(f, PQgetvalue(m, i, 0));
            fprintf(f, "\"} %s\n", PQgetvalue(m, i, 1 + k));
        }
    }
}

static void put_queue(FILE *f, PGresult *q, PGresult *lat, PGresult *boots)
{
    family(f, "glmspark_queue_depth", "gauge", "Jobs waiting in the queue.");
    fprintf(f, "glmspark_queue_depth %s\n", PQgetvalue(q, 0, 0));
    family(f, "glmspark_jobs_running", "gauge", "Jobs an engine is generating.");
    fprintf(f, "glmspark_jobs_running %s\n", PQgetvalue(q, 0, 1));
    family(f, "glmspark_completion_tokens_total", "counter", "Tokens generated for every job in the database.");
    fprintf(f, "glmspark_completion_tokens_total %s\n", PQgetvalue(q, 0, 2));
    family(f, "glmspark_prompt_tokens_total", "counter", "Prompt tokens of every job in the database.");
    fprintf(f, "glmspark_prompt_tokens_total %s\n", PQgetvalue(q, 0, 3));
    family(f, "glmspark_engine_up", "gauge", "1 when an engine boot has beaten its heartbeat in the last 30 s.");
    fprintf(f, "glmspark_engine_up %d\n", atoi(PQgetvalue(q, 0, 4)) > 0);
    family(f, "glmspark_jobs_total", "counter", "Finished jobs by final state.");
    fprintf(f, "glmspark_jobs_total{state=\"succeeded\"} %s\n", PQgetvalue(q, 0, 5));
    fprintf(f, "glmspark_jobs_total{state=\"failed\"} %s\n", PQgetvalue(q, 0, 6));
    fprintf(f, "glmspark_jobs_total{state=\"cancelled\"} %s\n", PQgetvalue(q, 0, 7));
    for (int h = 0; h < 2; h++) {
        const char *name = h ? "glmspark_inter_token_latency_seconds" : "glmspark_ttft_seconds";
        family(f, name, "histogram",
               h ? "Mean time between a finished job's tokens, per job."
                 : "Time from a job's claim by an engine to its first token.");
        const int n_rows = PQntuples(lat);
        for (int i = 0; i < n_rows && i < N_TTFT_BUCKETS; i++)
            fprintf(f, "%s_bucket{le=\"%s\"} %s\n", name, ttft_buckets[i], PQgetvalue(lat, i, 1 + h));
        if (n_rows > 0) {
            fprintf(f, "%s_bucket{le=\"+Inf\"} %s\n", name, PQgetvalue(lat, 0, h ? 5 : 3));
            fprintf(f, "%s_sum %s\n", name, PQgetvalue(lat, 0, h ? 6 : 4));
            fprintf(f, "%s_count %s\n", name, PQgetvalue(lat, 0, h ? 5 : 3));
        }
    }
    family(f, "glmspark_rank_up", "gauge", "Per engine boot (the last 8): 1 while its heartbeat is fresh.");
    for (int i = 0; i < PQntuples(boots); i++) {
        fputs("glmspark_rank_up{engine=\"", f);
        put_label_value(f, PQgetvalue(boots, i, 1));
        fprintf(f, "\",epoch=\"%s\",rank=\"0\"} %s\n", PQgetvalue(boots, i, 0), PQgetvalue(boots, i, 2));
    }
}

// ---------------------------------------------------------------------------
// Engine internals (engines.stats)

// The newest boot of each engine name that has not stopped and beat its heartbeat in the
// last 10 minutes (a killed engine shows, stale, for that long): id, name, model, heartbeat
// age in seconds, stats ('' when NULL). One series per engine name, so a restart continues
// its series.
static const char engines_sql[] =
    "SELECT DISTINCT ON (name) id, name, model,"
    " extract(epoch FROM now() - heartbeat_at)::float8, coalesce(stats::text, '')"
    " FROM engines WHERE stopped_at IS NULL AND heartbeat_at > now() - interval '10 minutes'"
    " ORDER BY name, id DESC LIMIT 64";

// One engine's labels (engine, model), then more (", ..."-less: the caller adds its own).
static void put_engine_labels(FILE *f, PGresult *e, int i)
{
    fputs("engine=\"", f);
    put_label_value(f, PQgetvalue(e, i, 1));
    fputs("\",model=\"", f);
    put_label_value(f, PQgetvalue(e, i, 2));
    fputc('"', f);
}

// One sample per rank of every engine of a per-rank family; what: 0 up, 1 load fraction,
// 2 weight bytes.
static void put_ranks(FILE *f, PGresult *e, const EngineStats *st, const bool *has, const char *name,
                      const char *help, int what)
{
    family(f, name, "gauge", help);
    for (int k = 0; k < PQntuples(e); k++) {
        if (!has[k]) continue;
        const EngineStats *s = &st[k];
        for (int i = 0; i < s->n_ranks; i++) {
            const StatsRank *r = &s->ranks[i];
            const double v = what == 0 ? !strcmp(r->state, "up") : what == 1 ? r->load_fraction : r->weight_bytes;
            fprintf(f, "%s{", name);
            put_engine_labels(f, e, k);
            fprintf(f, ",rank=\"%d\",host=\"", r->rank);
            put_label_value(f, r->host);
            fprintf(f, "\"} %.15g\n", v);
        }
    }
}

// The internals of every engine of engines_sql, labelled by engine and model. A boot whose
// stats are missing or unreadable (logged) contributes only its heartbeat age.
static Err put_engines(FILE *f, PGresult *e)
{
    const int n = PQntuples(e);
    EngineStats *st = calloc((size_t) (n ? n : 1), sizeof *st);
    bool *has = calloc((size_t) (n ? n : 1), sizeof *has);
    if (!st || !has) {
        free(st);
        free(has);
        return ERR_NOMEM;
    }
    for (int k = 0; k < n; k++) {
        if (!*PQgetvalue(e, k, 4)) continue;
        const char *bad = NULL;
        has[k] = stats_parse(PQgetvalue(e, k, 4), &st[k], &bad) == ERR_OK;
        if (!has[k]) LOG_WARN("api: engine %s published unreadable stats (key \"%s\")", PQgetvalue(e, k, 0), bad);
    }
    family(f, "glmspark_engine_heartbeat_age_seconds", "gauge",
           "Seconds since the engine's newest running boot beat its heartbeat.");
    for (int k = 0; k < n; k++) {
        fputs("glmspark_engine_heartbeat_age_seconds{", f);
        put_engine_labels(f, e, k);
        fprintf(f, "} %s\n", PQgetvalue(e, k, 3));
    }
    family(f, "glmspark_engine_info", "gauge", "The running engine: backend, model and state (value 1).");
    for (int k = 0; k < n; k++) {
        if (!has[k]) continue;
        fputs("glmspark_engine_info{engine=\"", f);
        put_label_value(f, PQgetvalue(e, k, 1));
        fputs("\",backend=\"", f);
        put_label_value(f, st[k].backend);
        fputs("\",model=\"", f);
        put_label_value(f, st[k].model);
        fputs("\",state=\"", f);
        put_label_value(f, st[k].state);
        fprintf(f, "\",world=\"%d\"} 1\n", st[k].world);
    }
    put_ranks(f, e, st, has, "glmspark_engine_rank_up", "1 when the pipeline rank is up, 0 when down or loading.", 0);
    put_ranks(f, e, st, has, "glmspark_engine_rank_load_fraction", "Fraction of the rank's weights loaded.", 1);
    put_ranks(f, e, st, has, "glmspark_engine_rank_weight_bytes", "Bytes of weights loaded on the rank.", 2);
    family(f, "glmspark_engine_step_seconds", "gauge",
           "Engine step time over the engine's last window: stat=\"avg\" or \"max\".");
    for (int k = 0; k < n; k++) {
        if (!has[k]) continue;
        for (int j = 0; j < 2; j++) {
            fputs("glmspark_engine_step_seconds{", f);
            put_engine_labels(f, e, k);
            fprintf(f, ",stat=\"%s\"} %.15g\n", j ? "max" : "avg",
                    (j ? st[k].step_ms_max : st[k].step_ms_avg) / 1000.0);
        }
    }
    static const struct {
        const char *name, *type, *help;
    } scalars[] = {
        {"glmspark_engine_batch_sequences", "gauge", "Mean sequences per step over the last window."},
        {"glmspark_engine_batch_tokens", "gauge", "Mean tokens per step over the last window."},
        {"glmspark_engine_kv_blocks_used", "gauge", "KV cache blocks in use."},
        {"glmspark_engine_kv_blocks_capacity", "gauge", "KV cache blocks in all (not _total: a gauge)."},
        {"glmspark_engine_kv_usage_ratio", "gauge", "KV cache blocks used / blocks in all."},
        {"glmspark_engine_running_sequences", "gauge", "Sequences the scheduler is running."},
        {"glmspark_engine_waiting_sequences", "gauge", "Sequences waiting for a scheduler slot."},
        {"glmspark_engine_tokens_per_second", "gauge", "Generated tokens per second over the last window."},
        {"glmspark_engine_steps_total", "counter", "Engine steps since the boot."},
        {"glmspark_engine_commit_seconds", "gauge",
         "Mean time of the job-queue commit after each step over the last window."},
        {"glmspark_engine_decode_steps_total", "counter",
         "Decode-only steps (no prompt tokens) since the boot."},
        {"glmspark_engine_decode_step_seconds_total", "counter",
         "Time in decode-only steps since the boot (their mean between two scrapes: the "
         "difference over the difference of glmspark_engine_decode_steps_total)."},
        {"glmspark_engine_decode_commit_seconds_total", "counter",
         "Time in the commits after decode-only steps since the boot."},
        {"glmspark_engine_prompt_tokens_total", "counter", "Prompt tokens processed since the boot."},
        {"glmspark_engine_generated_tokens_total", "counter", "Tokens generated since the boot."},
        {"glmspark_engine_prefix_cache_query_tokens_total", "counter",
         "Prompt tokens of the requests that looked the prefix cache up, since the boot."},
        {"glmspark_engine_prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens served from the prefix cache since the boot."},
        {"glmspark_engine_prefix_cache_hit_ratio", "gauge",
         "Prompt tokens served from the prefix cache / looked up, since the boot."},
        {"glmspark_engine_prefix_cache_blocks", "gauge", "KV blocks holding cached prompt prefixes."},
        {"glmspark_engine_prefix_cache_idle_blocks", "gauge",
         "KV blocks holding cached prefixes that no sequence uses (evicted first when room is needed)."},
    };
    for (size_t j = 0; j < sizeof scalars / sizeof *scalars; j++) {
        family(f, scalars[j].name, scalars[j].type, scalars[j].help);
        for (int k = 0; k < n; k++) {
            if (!has[k]) continue;
            const EngineStats *s = &st[k];
            const double v[] = {
                s->batch_seqs_avg,
                s->batch_tokens_avg,
                (double) s->kv_blocks_used,
                (double) s->kv_blocks_total,
                s->kv_blocks_total > 0 ? (double) s->kv_blocks_used / (double) s->kv_blocks_total : 0.0,
                (double) s->running,
                (double) s->waiting,
                s->tokens_per_s,
                (double) s->steps_total,
                s->commit_ms_avg / 1000.0,
                (double) s->decode_steps_total,
                s->decode_step_ms_total / 1000.0,
                s->decode_commit_ms_total / 1000.0,
                (double) s->prompt_tokens_total,
                (double) s->generated_tokens_total,
                (double) s->prefix_query_tokens_total,
                (double) s->prefix_hit_tokens_total,
                s->prefix_query_tokens_total > 0
                    ? (double) s->prefix_hit_tokens_total / (double) s->prefix_query_tokens_total
                    : 0.0,
                (double) s->prefix_cached_blocks,
                (double) s->prefix_idle_blocks,
            };
            fprintf(f, "%s{", scalars[j].name);
            put_engine_labels(f, e, k);
            fprintf(f, "} %.15g\n", v[j]);
        }
    }
    free(st);
    free(has);
    return ERR_OK;
}

// ---------------------------------------------------------------------------

Err api_metrics_render(ApiDb *db, char **text, size_t *n_text)
{
    Err err = ERR_DB;
    char *buf = NULL;
    size_t n = 0;
    FILE *f = NULL;
    *text = NULL;
    *n_text = 0;
    PGresult *q = api_db_exec(db, queue_sql, 0, NULL, PGRES_TUPLES_OK);
    PGresult *lat = q ? api_db_exec(db, latency_sql, 0, NULL, PGRES_TUPLES_OK) : NULL;
    PGresult *boots = lat ? api_db_exec(db, boots_sql, 0, NULL, PGRES_TUPLES_OK) : NULL;
    PGresult *engines = boots ? api_db_exec(db, engines_sql, 0, NULL, PGRES_TUPLES_OK) : NULL;
    PGresult *models = engines ? api_db_exec(db, models_sql, 0, NULL, PGRES_TUPLES_OK) : NULL;
    if (!models) goto done;
    err = ERR_NOMEM;
    if (!(f = open_memstream(&buf, &n))) goto done;
    put_queue(f, q, lat, boots);
    put_models(f, models);
    if ((err = put_engines(f, engines))) goto done;
    err = ERR_NOMEM;
    if (fclose(f) != 0) {
        f = NULL;
        goto done;
    }
    f = NULL;
    *text = buf;  // ownership moved to the caller
    *n_text = n;
    buf = NULL;
    err = ERR_OK;
done:
    if (f) fclose(f);
    free(buf);
    PQclear(q);
    PQclear(lat);
    PQclear(boots);
    PQclear(engines);
    PQclear(models);
    return err;
}

// Rank of a health status: the best one wins.
static int health_rank(const char *status)
{
    static const char *const order[] = {"unavailable", "stopping", "loading", "degraded", "ok"};
    for (int i = 4; i > 0; i--)
        if (!strcmp(status, order[i])) return i;
    return 0;
}

Err api_metrics_health(ApiDb *db, const char *model, ApiHealth *out)
{
    memset(out, 0, sizeof *out);
    out->status = "unavailable";
    PGresult *res = api_db_exec(db,
                                "SELECT model, stats::text FROM engines WHERE stopped_at IS NULL"
                                " AND heartbeat_at > now() - interval '30 seconds' ORDER BY id DESC",
                                0, NULL, PGRES_TUPLES_OK);
    if (!res) return ERR_DB;
    const int n = PQntuples(res);
    for (int i = 0; i < n; i++) {
        const char *name = PQgetvalue(res, i, 0);
        EngineStats s;
        memset(&s, 0, sizeof s);
        const bool has_stats = !PQgetisnull(res, i, 1) && !stats_parse(PQgetvalue(res, i, 1), &s, NULL);
        const char *st = "ok";  // an engine that publishes no (readable) stats: its heartbeat says up
        int ranks_up = 0;
        if (has_stats) {
            ranks_up = stats_n_ranks_up(&s);
            if (!strcmp(s.state, "loading")) st = "loading";
            else if (!strcmp(s.state, "stopping")) st = "stopping";
            else if (strcmp(s.state, "ready") != 0 || ranks_up < s.n_ranks) st = "degraded";
        }
        ApiHealthModel *m = NULL;
        for (int k = 0; k < out->n_models && !m; k++)
            if (!strcmp(out->models[k].name, name)) m = &out->models[k];
        if (!m && out->n_models < API_HEALTH_MAX_MODELS) {
            m = &out->models[out->n_models++];
            snprintf(m->name, sizeof m->name, "%s", name);
            m->status = "unavailable";
        }
        if (m) {
            m->n_engines++;
            if (health_rank(st) > health_rank(m->status)) m->status = st;
        }
        if (model && strcmp(model, name) != 0) continue;
        out->n_engines++;
        if (health_rank(st) <= health_rank(out->status)) continue;
        out->status = st;  // newest first: among equals, the newest boot's figures
        out->has_stats = has_stats;
        out->ranks_up = has_stats ? ranks_up : 0;
        out->world = has_stats ? s.world : 0;
    }
    PQclear(res);
    return ERR_OK;
}
