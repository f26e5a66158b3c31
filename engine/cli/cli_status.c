/*
 * cli_status.c - `glmspark status`: is the engine up, and what is it doing.
 *
 * Reads the newest engine boot that has not stopped (engines row) with the status JSON
 * that its rank 0 publishes every heartbeat (engines.stats, engine/shared/stats.h),
 * and the job queue's counts, in one query (STATS_SQL_LATEST). Prints the verdict, the
 * backend and model, one line per pipeline rank (host, pid, state, layers as an inclusive
 * range, weights, load progress; "?" for what the engine does not know), KV cache use,
 * jobs, tokens/s, step time and batch size; --json prints the same as one JSON object (the
 * stats object as the engine wrote it, plus the verdict). Then, for clusters and models
 * beside it (any number of engine clusters, of one or several models, share the queue):
 * every live boot (not stopped, heartbeat under --stale-s) with its model, pid and tokens/s,
 * and per model its live engines, queued and running jobs and tokens/s (admin.models,
 * sql/006); --json adds them as "engines" and "models".
 *
 * Verdict and exit status:
 *   up        heartbeat younger than --stale-s (30 s), state "ready", every rank of the
 *             world "up" (an engine that publishes no stats: heartbeat alone)       exit 0
 *   loading   heartbeat fresh, the engine or a rank still loading                  exit 1
 *   degraded  heartbeat fresh, a rank down or missing, or the engine stopping       exit 1
 *   stale     the heartbeat is older than --stale-s (a hung or killed engine)       exit 1
 *   down      no engine boot is running                                             exit 1
 *   usage error, no database, a failed query                                        exit 2
 * so `until glmspark status >/dev/null; do sleep 2; done` waits for a ready cluster
 * (ops/launch-cluster.sh does that, printing the rank lines as they change).
 *
 * The database: --db CONNINFO, else $GLMSPARK_DB, else the GLMSPARK_DB line of the
 * operator's settings file (--env FILE, $GLMSPARK_ENV, or /etc/glmspark/env). The app role
 * reads the tables; the admin role, which may read only the admin views, reads
 * admin.engines, admin.queue and admin.running instead.
 */
#include <json-c/json.h>
#include <libpq-fe.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cli/cli.h"
#include "engine/shared/stats.h"

typedef enum Verdict { VERDICT_UP, VERDICT_LOADING, VERDICT_DEGRADED, VERDICT_STALE, VERDICT_DOWN } Verdict;

static const char *const verdict_names[] = {"up", "loading", "degraded", "stale", "down"};

typedef struct Status {
    bool has_engine;
    bool has_stats;
    long long id;
    char name[128];
    char model[256];
    char pid[24];
    double heartbeat_age_s;
    long long jobs_queued;
    long long jobs_running;
    char *stats_text;  // engines.stats as stored (heap), NULL when none
    EngineStats stats;
    bool is_admin;     // read through the admin views
    PGresult *live;    // live boots: id, name, model, pid, heartbeat age, tokens/s ('' if none)
    PGresult *models;  // admin.models: model, engines_live, queued, running, tokens/s
    Verdict verdict;
    char why[256];     // the reason for a verdict other than up
} Status;

static void usage(void)
{
    fprintf(stderr,
            "usage: glmspark status [--db CONNINFO] [--env FILE] [--json] [--stale-s S]\n"
            "  the engine's state from the job-queue database: ranks, KV cache, jobs,\n"
            "  tokens/s. Exit 0 when up with every rank up, 1 when loading, degraded,\n"
            "  stale or down, 2 on a usage or database error.\n"
            "  CONNINFO: --db, else $GLMSPARK_DB, else GLMSPARK_DB in the settings file\n"
            "  (--env FILE, $GLMSPARK_ENV, or /etc/glmspark/env).\n");
}

// ---------------------------------------------------------------------------
// The connection string

// The value of KEY=VALUE in a shell-syntax settings file (ops/env.example), quotes removed,
// into out[n]. False when the file or the key is absent.
static bool env_file_value(const char *path, const char *key, char *out, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[2048];
    bool found = false;
    const size_t klen = strlen(key);
    while (fgets(line, sizeof line, f)) {
        const char *p = line + strspn(line, " \t");
        if (!strncmp(p, "export ", 7)) p += 7 + strspn(p + 7, " \t");
        if (strncmp(p, key, klen) != 0 || p[klen] != '=') continue;
        p += klen + 1;
        size_t len = strcspn(p, "\r\n");
        if (len >= 2 && (p[0] == '"' || p[0] == '\'') && p[len - 1] == p[0]) {
            p++;
            len -= 2;
        }
        snprintf(out, n, "%.*s", (int) len, p);
        found = true;  // the last assignment wins, as in the shell
    }
    fclose(f);
    return found;
}

// ---------------------------------------------------------------------------
// Reading

// The verdict and its reason from what was read.
static void judge(Status *st, double stale_s)
{
    const EngineStats *s = &st->stats;
    st->verdict = VERDICT_UP;
    st->why[0] = '\0';
    if (!st->has_engine) {
        st->verdict = VERDICT_DOWN;
        snprintf(st->why, sizeof st->why, "no engine is running (no engines row without stopped_at)");
        return;
    }
    if (st->heartbeat_age_s > stale_s) {
        st->verdict = VERDICT_STALE;
        snprintf(st->why, sizeof st->why, "last heartbeat %.0f s ago (more than %.0f s): hung or killed?",
                 st->heartbeat_age_s, stale_s);
        return;
    }
    if (!st->has_stats) return;  // an engine that publishes no stats: its heartbeat says up
    for (int i = 0; i < s->n_ranks; i++) {
        const StatsRank *r = &s->ranks[i];
        if (!strcmp(r->state, "up") || !strcmp(r->state, "loading")) continue;
        st->verdict = VERDICT_DEGRADED;
        snprintf(st->why, sizeof st->why, "rank %d on %s is %s", r->rank, r->host[0] ? r->host : "?",
                 r->state[0] ? r->state : "in no state");
        return;
    }
    if (!strcmp(s->state, "stopping")) {
        st->verdict = VERDICT_DEGRADED;
        snprintf(st->why, sizeof st->why, "the engine is stopping");
        return;
    }
    if (!strcmp(s->state, "loading") || stats_n_ranks_up(s) < s->n_ranks) {
        st->verdict = VERDICT_LOADING;
        snprintf(st->why, sizeof st->why, "%d of %d ranks up", stats_n_ranks_up(s),
                 s->world > s->n_ranks ? s->world : s->n_ranks);
        return;
    }
    if (s->n_ranks > 0 && s->n_ranks < s->world) {  // no ranks at all: not known yet (stats.h)
        st->verdict = VERDICT_DEGRADED;
        snprintf(st->why, sizeof st->why, "%d of %d ranks reported", s->n_ranks, s->world);
        return;
    }
    if (strcmp(s->state, "ready") != 0) {
        st->verdict = VERDICT_DEGRADED;
        snprintf(st->why, sizeof st->why, "engine state \"%s\"", s->state);
    }
}

// True when res failed for want of privileges (SQLSTATE 42501).
static bool is_denied(const PGresult *res)
{
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    return state && !strcmp(state, "42501");
}

// Query and parse; 0, or 2 after reporting a database error, or 1 for unreadable stats.
// The admin role (which reads views only) gets the same through admin.engines/queue/running.
static int read_status(PGconn *conn, Status *st)
{
    PGresult *res = PQexec(conn, STATS_SQL_LATEST);
    bool is_admin = false;
    int status = 2;
    if (PQresultStatus(res) != PGRES_TUPLES_OK && is_denied(res)) {
        PQclear(res);
        res = PQexec(conn, STATS_SQL_LATEST_ADMIN);
        is_admin = true;
    }
    st->is_admin = is_admin;
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        fprintf(stderr, "glmspark: could not read the engine's state: %s", PQerrorMessage(conn));
        goto done;
    }
    if (PQntuples(res) == 0) {
        PQclear(res);
        res = PQexec(conn, is_admin ? STATS_SQL_QUEUE_ADMIN : STATS_SQL_QUEUE);
        if (PQresultStatus(res) != PGRES_TUPLES_OK) {
            fprintf(stderr, "glmspark: could not read the job queue: %s", PQerrorMessage(conn));
            goto done;
        }
        st->jobs_queued = atoll(PQgetvalue(res, 0, 0));
        st->jobs_running = atoll(PQgetvalue(res, 0, 1));
        status = 0;
        goto done;
    }
    st->has_engine = true;
    st->id = atoll(PQgetvalue(res, 0, 0));
    snprintf(st->name, sizeof st->name, "%s", PQgetvalue(res, 0, 1));
    snprintf(st->model, sizeof st->model, "%s", PQgetvalue(res, 0, 2));
    snprintf(st->pid, sizeof st->pid, "%s", PQgetvalue(res, 0, 3));
    st->heartbeat_age_s = atof(PQgetvalue(res, 0, 4));
    st->jobs_queued = atoll(PQgetvalue(res, 0, 6));
    st->jobs_running = atoll(PQgetvalue(res, 0, 7));
    const char *text = PQgetvalue(res, 0, 5);
    status = 0;
    if (*text) {
        const char *bad = NULL;
        if (stats_parse(text, &st->stats, &bad)) {
            fprintf(stderr, "glmspark: engine %lld published unreadable stats (key \"%s\")\n", st->id, bad);
            status = 1;
            goto done;
        }
        st->has_stats = true;
        st->stats_text = strdup(text);
    }
done:
    PQclear(res);
    return status;
}

// The live boots and the per-model view into st->live and st->models; 0, or 2 after
// reporting a database error.
static int read_fleet(PGconn *conn, Status *st, double stale_s)
{
    char sql[640], age[32];
    snprintf(age, sizeof age, "%.3f", stale_s);
    snprintf(sql, sizeof sql,
             "SELECT id, name, model, coalesce(pid::text, ''),"
             " extract(epoch FROM now() - heartbeat_at)::float8,"
             " CASE WHEN jsonb_typeof(stats -> 'tokens_per_s') = 'number'"
             "   THEN (stats ->> 'tokens_per_s') ELSE '' END"
             " FROM %s WHERE stopped_at IS NULL AND heartbeat_at > now() - $1::float8 * interval '1 second'"
             " ORDER BY model, id",
             st->is_admin ? "admin.engines" : "engines");
    st->live = PQexecParams(conn, sql, 1, NULL, (const char *const[]){age}, NULL, NULL, 0);
    st->models = PQexec(conn, "SELECT model, engines_live, queued, running, engine_tokens_per_s"
                              " FROM admin.models");
    if (PQresultStatus(st->live) != PGRES_TUPLES_OK || PQresultStatus(st->models) != PGRES_TUPLES_OK) {
        fprintf(stderr, "glmspark: could not read the engines and models: %s", PQerrorMessage(conn));
        return 2;
    }
    return 0;
}

// ---------------------------------------------------------------------------
// Printing

static void print_fleet(const Status *st)
{
    const int n = PQntuples(st->live), m = PQntuples(st->models);
    printf("live engines: %d\n", n);
    if (n) printf("  %-8s %-20s %-28s %-8s %-10s %s\n", "BOOT", "NAME", "MODEL", "PID", "HEARTBEAT", "TOKENS/S");
    for (int i = 0; i < n; i++) {
        const char *tps = PQgetvalue(st->live, i, 5);
        printf("  %-8s %-20s %-28s %-8s %-10.1f %s\n", PQgetvalue(st->live, i, 0),
               PQgetvalue(st->live, i, 1), PQgetvalue(st->live, i, 2),
               *PQgetvalue(st->live, i, 3) ? PQgetvalue(st->live, i, 3) : "?",
               atof(PQgetvalue(st->live, i, 4)), *tps ? tps : "?");
    }
    printf("models: %d\n", m);
    if (m) printf("  %-28s %-8s %-8s %-8s %s\n", "MODEL", "ENGINES", "QUEUED", "RUNNING", "TOKENS/S");
    for (int i = 0; i < m; i++)
        printf("  %-28s %-8s %-8s %-8s %.1f\n", PQgetvalue(st->models, i, 0),
               PQgetvalue(st->models, i, 1), PQgetvalue(st->models, i, 2),
               PQgetvalue(st->models, i, 3), atof(PQgetvalue(st->models, i, 4)));
}

static double percent(int64_t part, int64_t whole)
{
    return whole > 0 ? 100.0 * (double) part / (double) whole : 0.0;
}

static void print_text(const Status *st)
{
    const EngineStats *s = &st->stats;
    if (!st->has_engine) {
        printf("engine: down: %s\n", st->why);
        printf("jobs: %lld queued, %lld running\n", st->jobs_queued, st->jobs_running);
        return;
    }
    printf("engine: %s%s%s\n", verdict_names[st->verdict], st->why[0] ? ": " : "", st->why);
    printf("boot %lld \"%s\", pid %s, model \"%s\", heartbeat %.1f s ago\n", st->id, st->name,
           st->pid[0] ? st->pid : "?", st->model, st->heartbeat_age_s);
    if (!st->has_stats) {
        printf("no stats published (an engine older than the status JSON)\n");
        printf("jobs: %lld queued, %lld running\n", st->jobs_queued, st->jobs_running);
        return;
    }
    printf("backend %s, state %s, world %d, %d of %d ranks up\n", s->backend, s->state, s->world,
           stats_n_ranks_up(s), s->n_ranks);
    printf("%-5s %-20s %-8s %-8s %-9s %-11s %s\n", "RANK", "HOST", "PID", "STATE", "LAYERS", "WEIGHTS",
           "LOADED");
    for (int i = 0; i < s->n_ranks; i++) {
        const StatsRank *r = &s->ranks[i];
        char layers[24] = "-", weights[24];
        if (r->last_layer > r->first_layer)  // [first, last): printed inclusive
            snprintf(layers, sizeof layers, "%d-%d", r->first_layer, r->last_layer - 1);
        if (r->weight_bytes >= 1073741824.0)
            snprintf(weights, sizeof weights, "%.1f GiB", r->weight_bytes / 1073741824.0);
        else
            snprintf(weights, sizeof weights, "%.1f MiB", r->weight_bytes / 1048576.0);
        char pid[16] = "?";
        if (r->pid > 0) snprintf(pid, sizeof pid, "%d", r->pid);
        printf("%-5d %-20s %-8s %-8s %-9s %-11s %.0f%%\n", r->rank, r->host[0] ? r->host : "?", pid,
               r->state[0] ? r->state : "?", layers, weights, 100.0 * r->load_fraction);
    }
    printf("kv cache: %lld of %lld blocks used (%.1f%%), %lld tokens per block\n",
           (long long) s->kv_blocks_used, (long long) s->kv_blocks_total,
           percent(s->kv_blocks_used, s->kv_blocks_total), (long long) s->kv_block_size);
    printf("jobs: %lld queued, %lld running; scheduler: %lld running, %lld waiting (max %lld), "
           "%lld microbatches in flight\n",
           st->jobs_queued, st->jobs_running, (long long) s->running, (long long) s->waiting,
           (long long) s->max_num_seqs, (long long) s->inflight_microbatches);
    printf("throughput: %.1f tokens/s over the last %.0f s; step %.1f ms avg, %.1f ms max, "
           "commit %.1f ms avg; batch %.1f sequences, %.1f tokens\n",
           s->tokens_per_s, s->window_s, s->step_ms_avg, s->step_ms_max, s->commit_ms_avg,
           s->batch_seqs_avg, s->batch_tokens_avg);
    printf("totals: %lld steps, %lld prompt tokens, %lld generated tokens\n", (long long) s->steps_total,
           (long long) s->prompt_tokens_total, (long long) s->generated_tokens_total);
    printf("prefix cache: %lld of %lld prompt tokens served from it (%.1f%%); %lld blocks cached, "
           "%lld of them idle\n",
           (long long) s->prefix_hit_tokens_total, (long long) s->prefix_query_tokens_total,
           percent(s->prefix_hit_tokens_total, s->prefix_query_tokens_total),
           (long long) s->prefix_cached_blocks, (long long) s->prefix_idle_blocks);
}

// One JSON object on stdout; false when out of memory.
static bool print_json(const Status *st)
{
    json_object *o = json_object_new_object(), *jobs = json_object_new_object(), *eng = NULL;
    if (!o || !jobs) {
        json_object_put(o);
        json_object_put(jobs);
        return false;
    }
    json_object_object_add(o, "status", json_object_new_string(verdict_names[st->verdict]));
    json_object_object_add(o, "reason", st->why[0] ? json_object_new_string(st->why) : NULL);
    if (st->has_engine) {
        eng = json_object_new_object();
        json_object_object_add(eng, "id", json_object_new_int64(st->id));
        json_object_object_add(eng, "name", json_object_new_string(st->name));
        json_object_object_add(eng, "model", json_object_new_string(st->model));
        json_object_object_add(eng, "pid", st->pid[0] ? json_object_new_int(atoi(st->pid)) : NULL);
        json_object_object_add(eng, "heartbeat_age_s", json_object_new_double(st->heartbeat_age_s));
    }
    json_object_object_add(o, "engine", eng);
    json_object_object_add(jobs, "queued", json_object_new_int64(st->jobs_queued));
    json_object_object_add(jobs, "running", json_object_new_int64(st->jobs_running));
    json_object_object_add(o, "jobs", jobs);
    json_object_object_add(o, "ranks_up", json_object_new_int(stats_n_ranks_up(&st->stats)));
    json_object_object_add(o, "kv_used_percent",
                           json_object_new_double(percent(st->stats.kv_blocks_used, st->stats.kv_blocks_total)));
    json_object_object_add(o, "stats", st->stats_text ? json_tokener_parse(st->stats_text) : NULL);
    json_object *live = json_object_new_array(), *models = json_object_new_array();
    for (int i = 0; i < PQntuples(st->live); i++) {
        json_object *e = json_object_new_object();
        const char *pid = PQgetvalue(st->live, i, 3), *tps = PQgetvalue(st->live, i, 5);
        json_object_object_add(e, "id", json_object_new_int64(atoll(PQgetvalue(st->live, i, 0))));
        json_object_object_add(e, "name", json_object_new_string(PQgetvalue(st->live, i, 1)));
        json_object_object_add(e, "model", json_object_new_string(PQgetvalue(st->live, i, 2)));
        json_object_object_add(e, "pid", *pid ? json_object_new_int(atoi(pid)) : NULL);
        json_object_object_add(e, "heartbeat_age_s", json_object_new_double(atof(PQgetvalue(st->live, i, 4))));
        json_object_object_add(e, "tokens_per_s", *tps ? json_object_new_double(atof(tps)) : NULL);
        json_object_array_add(live, e);
    }
    for (int i = 0; i < PQntuples(st->models); i++) {
        json_object *e = json_object_new_object();
        json_object_object_add(e, "model", json_object_new_string(PQgetvalue(st->models, i, 0)));
        json_object_object_add(e, "engines_live", json_object_new_int64(atoll(PQgetvalue(st->models, i, 1))));
        json_object_object_add(e, "queued", json_object_new_int64(atoll(PQgetvalue(st->models, i, 2))));
        json_object_object_add(e, "running", json_object_new_int64(atoll(PQgetvalue(st->models, i, 3))));
        json_object_object_add(e, "tokens_per_s", json_object_new_double(atof(PQgetvalue(st->models, i, 4))));
        json_object_array_add(models, e);
    }
    json_object_object_add(o, "engines", live);
    json_object_object_add(o, "models", models);
    puts(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN));
    json_object_put(o);
    return true;
}

// ---------------------------------------------------------------------------
// The command

int cli_status(int argc, char **argv)
{
    const char *db = NULL, *env_path = NULL;
    bool is_json = false;
    double stale_s = STATS_STALE_S;
    static char env_db[2048];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--json")) {
            is_json = true;
            continue;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        }
        if (strcmp(a, "--db") != 0 && strcmp(a, "--env") != 0 && strcmp(a, "--stale-s") != 0) {
            fprintf(stderr, "glmspark: unexpected argument \"%s\"\n", a);
            usage();
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "glmspark: option %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--db")) {
            db = v;
        } else if (!strcmp(a, "--env")) {
            env_path = v;
        } else {
            char *end = NULL;
            stale_s = strtod(v, &end);
            if (!*v || *end || !(stale_s > 0) || !isfinite(stale_s)) {
                fprintf(stderr, "glmspark: --stale-s needs a positive number of seconds, not \"%s\"\n", v);
                return 2;
            }
        }
    }
    if (!db && !env_path) db = getenv("GLMSPARK_DB");
    if (!db) {
        const char *path = env_path ? env_path : getenv("GLMSPARK_ENV");
        if (!path) path = "/etc/glmspark/env";
        if (env_file_value(path, "GLMSPARK_DB", env_db, sizeof env_db)) {
            db = env_db;
        } else if (env_path) {
            fprintf(stderr, "glmspark: no GLMSPARK_DB in \"%s\"\n", env_path);
            return 2;
        }
    }
    if (!db || !*db) {
        fprintf(stderr, "glmspark: no database: pass --db CONNINFO, set GLMSPARK_DB, or put "
                        "GLMSPARK_DB in /etc/glmspark/env\n");
        return 2;
    }

    Status st = {0};
    int status = 2;
    PGconn *conn = PQconnectdb(db);
    if (PQstatus(conn) != CONNECTION_OK) {
        fprintf(stderr, "glmspark: could not connect to the database: %s", PQerrorMessage(conn));
        goto done;
    }
    status = read_status(conn, &st);
    if (!status) status = read_fleet(conn, &st, stale_s);
    if (status) goto done;
    judge(&st, stale_s);
    if (is_json) {
        if (!print_json(&st)) {
            fprintf(stderr, "glmspark: out of memory\n");
            status = 2;
            goto done;
        }
    } else {
        print_text(&st);
        print_fleet(&st);
    }
    status = st.verdict == VERDICT_UP ? 0 : 1;
done:
    fflush(stdout);
    free(st.stats_text);
    PQclear(st.live);
    PQclear(st.models);
    PQfinish(conn);
    return status;
}
