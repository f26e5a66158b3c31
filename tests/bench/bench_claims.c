/*
 * bench_claims.c - the queue under many engines: claims/s and chunk commits/s with E
 * concurrent engine boots on one PostgreSQL (the database from $GLMSPARK_DB, migrated; the
 * role needs the app role's rights).
 *
 *   bench_claims ENGINES JOBS STEPS
 *
 * Each engine is a thread with its own JobQueue (engine/serve/jobq.c, the real engine's
 * code: its own connection, boot and fencing epoch, name "bench-claims-I"). Three phases,
 * each timed from the first call to the last thread's end:
 *   claim    JOBS queued jobs are claimed and finished (one jobq_claim + one jobq_finish
 *            each, two commits) until none is left: claims/s;
 *   append   every engine claims 8 jobs, then appends one chunk to one job at a time
 *            (jobq_append: one commit per chunk) STEPS times: chunk commits/s;
 *   batch    every engine claims 8 jobs, then writes one chunk to each of them per
 *            jobq_append_batch (one commit per step, what the batching engine does) STEPS
 *            times: steps/s and chunks/s.
 * Checks on the way (a failure exits 1): every job of a phase is claimed exactly once
 * (attempt 1) and ends succeeded with its chunks contiguous. Prints one line per phase.
 * Not a test: ctest does not run it; tests/bench/run_claims.sh does, with a private
 * PostgreSQL.
 */
#include <libpq-fe.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/serve/jobq.h"

enum { MAX_ENGINES = 64, PER_ENGINE = 8 };

static const char *conninfo;
static int steps;

typedef struct Worker {
    int index, phase;
    long n_claims, n_chunks, n_commits;
    bool failed;
} Worker;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + ts.tv_nsec * 1e-9;
}

static bool sql_ok(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    const bool ok = PQresultStatus(r) == PGRES_COMMAND_OK || PQresultStatus(r) == PGRES_TUPLES_OK;
    if (!ok) fprintf(stderr, "bench_claims: %s: %s", sql, PQerrorMessage(c));
    PQclear(r);
    return ok;
}

static long long sql_int(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    long long v = -1;
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 && !PQgetisnull(r, 0, 0))
        v = atoll(PQgetvalue(r, 0, 0));
    else
        fprintf(stderr, "bench_claims: %s: %s", sql, PQerrorMessage(c));
    PQclear(r);
    return v;
}

static void *work(void *arg)
{
    Worker *w = arg;
    char name[32];
    snprintf(name, sizeof name, "bench-claims-%d", w->index);
    const JobqOptions o = {.conninfo = conninfo, .engine_name = name, .model = "bench",
                           .lease_s = 60};
    JobQueue *q = NULL;
    if (jobq_create(&o, &q)) {
        w->failed = true;
        return NULL;
    }
    const int32_t tok[1] = {7};
    const JobqChunk ch = {JOBQ_CHUNK_CONTENT, "x", tok, 1, NULL};
    if (w->phase == 0) {
        for (;;) {
            JobqJob j;
            const Err err = jobq_claim(q, &j);
            if (err == ERR_NOTFOUND) break;
            if (err || jobq_finish(q, &j, "stop")) {
                w->failed = true;
                jobq_job_free(&j);
                break;
            }
            w->n_claims++;
            w->n_commits += 2;
            jobq_job_free(&j);
        }
    } else {
        JobqJob jobs[PER_ENGINE];
        memset(jobs, 0, sizeof jobs);
        int n = 0;
        for (; n < PER_ENGINE; n++)
            if (jobq_claim(q, &jobs[n])) break;
        w->n_claims = n;
        if (n < PER_ENGINE) w->failed = true;
        for (int s = 0; s < steps && !w->failed; s++) {
            if (w->phase == 1) {
                if (jobq_append(q, &jobs[s % n], &ch, 1, NULL)) w->failed = true;
                w->n_chunks++;
                w->n_commits++;
            } else {
                JobqAppend items[PER_ENGINE];
                for (int i = 0; i < n; i++)
                    items[i] = (JobqAppend){.job = &jobs[i], .chunks = &ch, .n_chunks = 1,
                                            .finish_reason = s == steps - 1 ? "stop" : NULL};
                if (jobq_append_batch(q, items, n)) w->failed = true;
                for (int i = 0; i < n; i++)
                    if (items[i].result) w->failed = true;
                w->n_chunks += n;
                w->n_commits++;
            }
        }
        for (int i = 0; i < n && w->phase == 1; i++)
            if (jobq_finish(q, &jobs[i], "stop")) w->failed = true;
        for (int i = 0; i < n; i++)
            jobq_job_free(&jobs[i]);
    }
    jobq_destroy(q);
    return NULL;
}

// Queue n jobs of this run (model "bench"); false on failure.
static bool queue_jobs(PGconn *c, long long key, int n)
{
    char sql[512];
    snprintf(sql, sizeof sql,
             "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids, n_prompt_tokens,"
             " max_tokens) SELECT %lld, 'completion', 'bench', '{}', ARRAY[1, 2], 2, 4096"
             " FROM generate_series(1, %d)",
             key, n);
    return sql_ok(c, sql);
}

int main(int argc, char **argv)
{
    const int n_engines = argc == 4 ? atoi(argv[1]) : 0, n_jobs = argc == 4 ? atoi(argv[2]) : 0;
    steps = argc == 4 ? atoi(argv[3]) : 0;
    conninfo = getenv("GLMSPARK_DB");
    if (n_engines < 1 || n_engines > MAX_ENGINES || n_jobs < 1 || steps < 1 || !conninfo) {
        fprintf(stderr, "usage: bench_claims ENGINES(1..%d) JOBS STEPS (database from "
                        "$GLMSPARK_DB)\n",
                MAX_ENGINES);
        return 2;
    }
    PGconn *c = PQconnectdb(conninfo);
    if (PQstatus(c) != CONNECTION_OK) {
        fprintf(stderr, "bench_claims: %s", PQerrorMessage(c));
        return 1;
    }
    // A key of this run's own (the app role may insert keys): its jobs are the only ones
    // the checks below count.
    if (!sql_ok(c, "INSERT INTO api_keys (prefix, key_hash, name) VALUES ('gsk_bench_'"
                   " || txid_current(), sha256(random()::text::bytea), 'bench-claims')"))
        return 1;
    const long long key = sql_int(c, "SELECT max(id) FROM api_keys WHERE name = 'bench-claims'");
    if (key < 0 || sql_int(c, "SELECT count(*) FROM jobs WHERE state IN ('queued', 'running')"))
        return fprintf(stderr, "bench_claims: the queue must start empty\n"), 1;
    const char *names[3] = {"claim", "append", "batch"};
    int rc = 0;
    for (int phase = 0; phase < 3; phase++) {
        const int queued = phase == 0 ? n_jobs : n_engines * PER_ENGINE;
        if (!queue_jobs(c, key, queued)) return 1;
        Worker w[MAX_ENGINES];
        pthread_t th[MAX_ENGINES];
        const double t0 = now_s();
        for (int i = 0; i < n_engines; i++) {
            w[i] = (Worker){.index = i, .phase = phase};
            pthread_create(&th[i], NULL, work, &w[i]);
        }
        long claims = 0, chunks = 0, commits = 0;
        bool failed = false;
        for (int i = 0; i < n_engines; i++) {
            pthread_join(th[i], NULL);
            claims += w[i].n_claims;
            chunks += w[i].n_chunks;
            commits += w[i].n_commits;
            failed |= w[i].failed;
        }
        const double dt = now_s() - t0;
        char sql[512];
        snprintf(sql, sizeof sql,
                 "SELECT count(*) FROM jobs j WHERE api_key_id = %lld AND (state <> 'succeeded'"
                 " OR attempt <> 1 OR n_chunks <> (SELECT count(*) FROM job_chunks c"
                 " WHERE c.job_id = j.id))",
                 key);
        const long long bad = sql_int(c, sql);
        if (failed || claims != queued || bad != 0) {
            fprintf(stderr, "bench_claims: %s phase: %ld of %d jobs claimed, %lld bad, %s\n",
                    names[phase], claims, queued, bad, failed ? "a call failed" : "no call failed");
            rc = 1;
        }
        if (phase == 0)
            printf("claim   %2d engines: %d jobs claimed and finished in %.3f s: %.0f claims/s "
                   "(%.0f commits/s)\n",
                   n_engines, queued, dt, claims / dt, commits / dt);
        else
            printf("%-7s %2d engines x %d jobs, %d steps: %ld chunks in %ld commits in %.3f s: "
                   "%.0f commits/s, %.0f chunks/s\n",
                   names[phase], n_engines, PER_ENGINE, steps, chunks, commits, dt, commits / dt,
                   chunks / dt);
        fflush(stdout);
    }
    PQfinish(c);
    return rc;
}
