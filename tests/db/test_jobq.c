/*
 * test_jobq.c - queue semantics against a real PostgreSQL (run by with_pg.sh).
 *
 * Covers: migrations apply once and are idempotent; the app role can run the queue and
 * the admin role can only read admin views; many concurrent claimers take every job
 * exactly once; an expired lease re-delivers a job that resumes from its committed tokens
 * while the old owner is fenced off; several engines on one queue: a restarted engine
 * recovers its crashed boot's jobs (not another engine's) and a live engine's name is
 * refused; cancel of queued and running jobs; max_attempts; batched appends (one fenced item
 * does not abort the others, finish in the batch, cancel flags, one NOTIFY per job with
 * output), release and resume, engine stats through admin.engines.
 * Lease expiry is simulated by moving lease_until into the past, never by sleeping.
 */
#include <libpq-fe.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/cli/cli.h"
#include "engine/serve/jobq.h"
#include "engine/shared/apikey.h"
#include "tests/check.h"

static char conn_super[512], conn_app[512], conn_admin[512];

static PGconn *connect_or_die(const char *conninfo)
{
    PGconn *c = PQconnectdb(conninfo);
    if (PQstatus(c) != CONNECTION_OK) {
        fprintf(stderr, "connect %s: %s", conninfo, PQerrorMessage(c));
        exit(1);
    }
    PQsetNoticeProcessor(c, NULL, NULL);
    return c;
}

// Run sql; return the first value of the first row (static buffer) or NULL on error, with
// the error text in last_error.
static char last_error[512];
static const char *q1(PGconn *c, const char *sql)
{
    static char value[4096];
    PGresult *r = PQexec(c, sql);
    const ExecStatusType st = PQresultStatus(r);
    const char *out = NULL;
    if (st == PGRES_TUPLES_OK || st == PGRES_COMMAND_OK) {
        snprintf(value, sizeof value, "%s",
                 st == PGRES_TUPLES_OK && PQntuples(r) > 0 ? PQgetvalue(r, 0, 0) : "");
        out = value;
    } else {
        snprintf(last_error, sizeof last_error, "%s", PQerrorMessage(c));
    }
    PQclear(r);
    return out;
}

static int qint(PGconn *c, const char *sql)
{
    const char *v = q1(c, sql);
    if (!v) fprintf(stderr, "query failed: %s: %s", sql, last_error);
    return v ? atoi(v) : -1;
}

static long long key_id;

// Insert n queued jobs with prompt [i, i+1] and max_tokens 8; returns the first job id.
static long long insert_jobs(PGconn *c, int n, int max_attempts)
{
    char sql[512];
    snprintf(sql, sizeof sql,
             "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids, n_prompt_tokens,"
             " max_tokens, max_attempts) SELECT %lld, 'chat', 'm', '{}', ARRAY[g, g + 1], 2, 8, %d"
             " FROM generate_series(1, %d) g RETURNING id",
             key_id, max_attempts, n);
    const char *v = q1(c, sql);
    return v ? atoll(v) : -1;
}

// An engine boot named name (NULL: "test"; this process's boots of one name count as
// earlier lives of one engine, never as live rivals).
static JobQueue *open_queue(const char *name, Err *err_out)
{
    JobqOptions o = {
        .conninfo = conn_app, .engine_name = name ? name : "test", .model = "m", .lease_s = 30};
    JobQueue *q = NULL;
    const Err err = jobq_create(&o, &q);
    if (err_out) *err_out = err;
    return q;
}

// ---------------------------------------------------------------------------

static void test_migrate(void)
{
    char *argv[] = {"db", "migrate", "--db", conn_super, NULL};
    CHECK(cli_db(4, argv) == 0);
    CHECK(cli_db(4, argv) == 0);  // idempotent: applies nothing the second time
    PGconn *c = connect_or_die(conn_super);
    CHECK(qint(c, "SELECT count(*) FROM schema_migrations") == 7);
    // 004: revoking a key (by any means) rings api_keys_revoked with its prefix, once.
    PQclear(PQexec(c, "LISTEN api_keys_revoked"));
    PQclear(PQexec(c, "INSERT INTO api_keys (prefix, key_hash, name) VALUES"
                      " ('gsk_trigger01', sha256('t'), 'trigger-test')"));
    PQclear(PQexec(c, "UPDATE api_keys SET last_used_at = now() WHERE prefix = 'gsk_trigger01'"));
    PQconsumeInput(c);
    PGnotify *note = PQnotifies(c);
    CHECK(note == NULL);  // other updates do not ring
    PQfreemem(note);
    PQclear(PQexec(c, "UPDATE api_keys SET revoked_at = now() WHERE prefix = 'gsk_trigger01'"));
    PQconsumeInput(c);
    note = PQnotifies(c);
    CHECK(note && !strcmp(note->relname, "api_keys_revoked") && !strcmp(note->extra, "gsk_trigger01"));
    PQfreemem(note);
    PQclear(PQexec(c, "UPDATE api_keys SET revoked_at = now() WHERE prefix = 'gsk_trigger01'"));
    PQconsumeInput(c);
    note = PQnotifies(c);
    CHECK(note == NULL);  // already revoked: no second ring
    PQfreemem(note);
    PQclear(PQexec(c, "UNLISTEN *"));
    PQclear(PQexec(c, "DELETE FROM api_keys WHERE prefix = 'gsk_trigger01'"));
    CHECK(qint(c, "SELECT count(*) FROM information_schema.views WHERE table_schema = 'admin'")
          == 7);
    char *bad[] = {"db", "migrate", "--db", conn_super, "--sql", "/nonexistent", NULL};
    CHECK(cli_db(6, bad) == 1);
    PQfinish(c);
}

static void test_roles(void)
{
    PGconn *admin = connect_or_die(conn_admin);
    CHECK(q1(admin, "SELECT count(*) FROM admin.queue") != NULL);
    CHECK(q1(admin, "SELECT count(*) FROM admin.running") != NULL);
    CHECK(q1(admin, "SELECT count(*) FROM admin.recent_jobs") != NULL);
    CHECK(q1(admin, "SELECT count(*) FROM admin.usage_by_key") != NULL);
    CHECK(qint(admin, "SELECT count(*) FROM admin.throughput") == 3);
    CHECK(q1(admin, "SELECT count(*) FROM admin.engines") != NULL);
    CHECK(q1(admin, "SELECT stats FROM engines") == NULL);
    CHECK(q1(admin, "SELECT key_hash FROM api_keys") == NULL);
    CHECK(strstr(last_error, "permission denied") != NULL);
    CHECK(q1(admin, "SELECT * FROM jobs") == NULL);
    CHECK(q1(admin, "UPDATE jobs SET priority = 1") == NULL);
    CHECK(q1(admin, "INSERT INTO job_chunks VALUES (1, 0, 1, 'content', 'x', '{}')") == NULL);
    CHECK(q1(admin, "DELETE FROM jobs") == NULL);
    PQfinish(admin);

    PGconn *app = connect_or_die(conn_app);
    CHECK(q1(app, "SELECT count(*) FROM api_keys") != NULL);
    CHECK(q1(app, "CREATE TABLE app_may_not_create (x int)") == NULL);
    CHECK(q1(app, "DROP TABLE jobs") == NULL);
    PQfinish(app);
}

static void test_keys(void)
{
    char key[APIKEY_LEN + 1], prefix[APIKEY_PREFIX_LEN + 1], sql[512];
    uint8_t digest[APIKEY_HASH_LEN];
    CHECK(apikey_generate(key) == ERR_OK);
    CHECK(apikey_parse(key, strlen(key), prefix) == ERR_OK);
    apikey_hash(key, strlen(key), digest);
    char hex[2 * APIKEY_HASH_LEN + 1];
    for (int i = 0; i < APIKEY_HASH_LEN; i++) snprintf(hex + 2 * i, 3, "%02x", digest[i]);
    PGconn *c = connect_or_die(conn_super);
    snprintf(sql, sizeof sql,
             "INSERT INTO api_keys (prefix, key_hash, name) VALUES ('%s', '\\x%s', 'test')"
             " RETURNING id", prefix, hex);
    const char *id = q1(c, sql);
    CHECK(id != NULL);
    key_id = id ? atoll(id) : 0;
    // The stored hash verifies the key and nothing else.
    snprintf(sql, sizeof sql, "SELECT encode(key_hash, 'hex') FROM api_keys WHERE prefix = '%s'",
             prefix);
    const char *stored_hex = q1(c, sql);
    CHECK(stored_hex && strcmp(stored_hex, hex) == 0);
    CHECK(apikey_verify(key, strlen(key), digest));
    key[APIKEY_LEN - 1] ^= 1;
    CHECK(!apikey_verify(key, strlen(key), digest));

    char *revoke[] = {"keys", "revoke", prefix, "--db", conn_super, NULL};
    char *revoke_again[] = {"keys", "revoke", prefix, "--db", conn_super, NULL};
    char *create_bad[] = {"keys", "create", "--name", "x", "--scope", "root", "--db", conn_super,
                          NULL};
    snprintf(sql, sizeof sql, "INSERT INTO api_keys (prefix, key_hash, name) VALUES"
             " ('gsk_revokeme0000', '\\x%s', 'r')", "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff");
    CHECK(q1(c, sql) != NULL);
    revoke[2] = revoke_again[2] = "gsk_revokeme0000";
    CHECK(cli_keys(5, revoke) == 0);
    CHECK(qint(c, "SELECT count(*) FROM api_keys WHERE revoked_at IS NOT NULL") == 1);
    CHECK(cli_keys(5, revoke_again) == 1);  // already revoked: reported, non-zero
    CHECK(cli_keys(8, create_bad) == 2);
    PQfinish(c);
}

// ---------------------------------------------------------------------------
// Concurrent claimers

enum { N_CLAIM_JOBS = 1500, N_CLAIMERS = 8 };
static int claim_count[N_CLAIM_JOBS];
static long long claim_base;
static pthread_mutex_t claim_mutex = PTHREAD_MUTEX_INITIALIZER;
static int claim_errors;

static void *claimer(void *arg)
{
    (void) arg;
    Err err;
    JobQueue *q = open_queue(NULL, &err);
    if (!q) {
        pthread_mutex_lock(&claim_mutex);
        claim_errors++;
        pthread_mutex_unlock(&claim_mutex);
        return NULL;
    }
    for (;;) {
        JobqJob job;
        err = jobq_claim(q, &job);
        if (err == ERR_NOTFOUND) break;
        pthread_mutex_lock(&claim_mutex);
        if (err || job.id < claim_base || job.id >= claim_base + N_CLAIM_JOBS)
            claim_errors++;
        else
            claim_count[job.id - claim_base]++;
        pthread_mutex_unlock(&claim_mutex);
        if (err) break;
        const int32_t tok = (int32_t) job.id;
        JobqChunk ch = {JOBQ_CHUNK_CONTENT, "x", &tok, 1, NULL};
        if (jobq_append(q, &job, &ch, 1, NULL) || jobq_finish(q, &job, "stop")) {
            pthread_mutex_lock(&claim_mutex);
            claim_errors++;
            pthread_mutex_unlock(&claim_mutex);
        }
        jobq_job_free(&job);
    }
    jobq_destroy(q);
    return NULL;
}

static void test_concurrent_claims(void)
{
    PGconn *c = connect_or_die(conn_super);
    claim_base = insert_jobs(c, N_CLAIM_JOBS, 3);
    CHECK(claim_base > 0);
    pthread_t th[N_CLAIMERS];
    for (int i = 0; i < N_CLAIMERS; i++) pthread_create(&th[i], NULL, claimer, NULL);
    for (int i = 0; i < N_CLAIMERS; i++) pthread_join(th[i], NULL);
    int n_once = 0;
    for (int i = 0; i < N_CLAIM_JOBS; i++) n_once += claim_count[i] == 1;
    printf("concurrent claims: %d jobs, %d claimers, %d claimed exactly once, %d errors\n",
           N_CLAIM_JOBS, N_CLAIMERS, n_once, claim_errors);
    CHECK(n_once == N_CLAIM_JOBS);
    CHECK(claim_errors == 0);
    CHECK(qint(c, "SELECT count(*) FROM jobs WHERE state = 'succeeded' AND attempt = 1"
                  " AND n_chunks = 1") == N_CLAIM_JOBS);
    PQfinish(c);
}

// ---------------------------------------------------------------------------

static void test_lease_expiry_and_fencing(void)
{
    PGconn *c = connect_or_die(conn_super);
    const long long id = insert_jobs(c, 1, 3);
    JobQueue *qa = open_queue(NULL, NULL), *qb = open_queue(NULL, NULL);
    CHECK(qa && qb);
    if (!qa || !qb) return;
    JobqJob ja, jb;
    CHECK(jobq_claim(qa, &ja) == ERR_OK);
    CHECK(ja.id == id && ja.attempt == 1 && ja.n_prompt == 2 && ja.next_seq == 0);
    CHECK(jobq_claim(qb, &jb) == ERR_NOTFOUND);  // leased: nobody else gets it
    const int32_t t1[] = {11, 12};
    JobqChunk ch1 = {JOBQ_CHUNK_REASONING, "ab", t1, 2, NULL};
    bool cancelled = true;
    CHECK(jobq_append(qa, &ja, &ch1, 1, &cancelled) == ERR_OK && !cancelled);
    CHECK(ja.next_seq == 1);

    char sql[256];
    snprintf(sql, sizeof sql, "UPDATE jobs SET lease_until = now() - interval '1 second'"
             " WHERE id = %lld", id);
    CHECK(q1(c, sql) != NULL);  // qa stalled past its lease
    CHECK(jobq_claim(qb, &jb) == ERR_OK);
    CHECK(jb.id == id && jb.attempt == 2 && jb.next_seq == 1);
    CHECK(jb.n_committed == 2 && jb.committed_ids && jb.committed_ids[0] == 11 &&
          jb.committed_ids[1] == 12);

    // The stalled owner wakes up: every write is refused.
    const int32_t t2[] = {13};
    JobqChunk ch2 = {JOBQ_CHUNK_CONTENT, "zombie", t2, 1, NULL};
    CHECK(jobq_append(qa, &ja, &ch2, 1, NULL) == ERR_NOTFOUND);
    CHECK(jobq_heartbeat(qa, &ja, NULL) == ERR_NOTFOUND);
    CHECK(jobq_finish(qa, &ja, "stop") == ERR_NOTFOUND);

    const int32_t t3[] = {21}, t4[] = {22, 23};
    JobqChunk ch3[2] = {{JOBQ_CHUNK_CONTENT, "c", t3, 1, "[{\"token\":\"c\",\"logprob\":-0.5}]"},
                         {JOBQ_CHUNK_CONTENT, "", t4, 2, NULL}};
    CHECK(jobq_append(qb, &jb, ch3, 2, NULL) == ERR_OK && jb.next_seq == 3);
    CHECK(jobq_finish(qb, &jb, "length") == ERR_OK);
    snprintf(sql, sizeof sql,
             "SELECT string_agg(seq || ':' || attempt || ':' || kind || ':' || text || ':' ||"
             " token_ids::text, ' ' ORDER BY seq) FROM job_chunks WHERE job_id = %lld", id);
    const char *v = q1(c, sql);
    CHECK(v && strcmp(v, "0:1:reasoning:ab:{11,12} 1:2:content:c:{21} 2:2:content::{22,23}") == 0);
    // logprobs are stored as jsonb with their chunk, NULL where none were given.
    snprintf(sql, sizeof sql,
             "SELECT string_agg(seq || '=' || coalesce((logprobs->0->>'logprob'), 'null'), ' '"
             " ORDER BY seq) FROM job_chunks WHERE job_id = %lld", id);
    v = q1(c, sql);
    CHECK(v && strcmp(v, "0=null 1=-0.5 2=null") == 0);
    snprintf(sql, sizeof sql, "SELECT state || ' ' || n_completion_tokens || ' ' || finish_reason"
             " FROM jobs WHERE id = %lld", id);
    v = q1(c, sql);
    CHECK(v && strcmp(v, "succeeded 5 length") == 0);
    jobq_job_free(&ja);
    jobq_job_free(&jb);
    jobq_destroy(qa);
    jobq_destroy(qb);
    PQfinish(c);
}

// Two engines (clusters) on one queue. A restarted engine (a new boot of its name) takes its
// crashed boot's job back at once and leaves the other engine's; the name of a live engine on
// this host is refused; a reconnect keeps the boot and its fencing.
static void test_engines_and_recovery(void)
{
    PGconn *c = connect_or_die(conn_super);
    Err err_a, err_b;
    JobQueue *a = open_queue("a", &err_a), *b = open_queue("b", &err_b);
    CHECK(a && b && err_a == ERR_OK && err_b == ERR_OK);
    const long long id = insert_jobs(c, 2, 3);
    JobqJob ja, jb, ja2, jb2;
    CHECK(a && jobq_claim(a, &ja) == ERR_OK && ja.id == id);
    CHECK(b && jobq_claim(b, &jb) == ERR_OK && jb.id == id + 1);
    const int32_t t[] = {7};
    JobqChunk ch = {JOBQ_CHUNK_CONTENT, "seven", t, 1, NULL};
    CHECK(jobq_append(a, &ja, &ch, 1, NULL) == ERR_OK);
    CHECK(jobq_append(b, &jb, &ch, 1, NULL) == ERR_OK);

    // a "crashes" (never stops) and starts again: its old boot runs no more (this process's
    // pid), so the new boot registers and recovers a's job only.
    Err err;
    JobQueue *a2 = open_queue("a", &err);
    CHECK(a2 && err == ERR_OK);
    int n_requeued = -1;
    CHECK(a2 && jobq_recover(a2, &n_requeued) == ERR_OK && n_requeued == 1);
    CHECK(a2 && jobq_claim(a2, &ja2) == ERR_OK && ja2.id == id && ja2.attempt == 2
          && ja2.next_seq == 1 && ja2.n_committed == 1);
    CHECK(jobq_append(a, &ja, &ch, 1, NULL) == ERR_NOTFOUND);  // the old boot is fenced
    CHECK(jobq_append(b, &jb, &ch, 1, NULL) == ERR_OK);        // b's job stayed b's
    CHECK(qint(c, "SELECT count(*) FROM engines WHERE name = 'a' AND stopped_at IS NULL") == 1);

    // A live engine elsewhere on this host holds "b" (pid 1 always runs): a second "b" is
    // refused, and its own boot is marked stopped.
    char sql[256];
    snprintf(sql, sizeof sql, "UPDATE engines SET pid = 1 WHERE id = %lld",
             (long long) jobq_epoch(b));
    PQclear(PQexec(c, sql));
    JobQueue *b2 = open_queue("b", &err);
    CHECK(!b2 && err == ERR_AGAIN);
    jobq_destroy(b2);
    CHECK(qint(c, "SELECT count(*) FROM engines WHERE name = 'b' AND stopped_at IS NULL") == 1);

    // b reconnects (a database restart, say): same boot, same fencing; its recovery hands its
    // own job back and it resumes it.
    CHECK(jobq_reconnect(b, 500) == ERR_OK);
    CHECK(jobq_recover(b, &n_requeued) == ERR_OK && n_requeued == 1);
    CHECK(jobq_claim(b, &jb2) == ERR_OK && jb2.id == id + 1 && jb2.attempt == 2 && jb2.next_seq == 2
          && jb2.n_committed == 2);
    CHECK(jobq_finish(a2, &ja2, "stop") == ERR_OK);
    CHECK(jobq_finish(b, &jb2, "stop") == ERR_OK);
    snprintf(sql, sizeof sql, "SELECT count(*) FROM job_chunks WHERE job_id IN (%lld, %lld)", id,
             id + 1);
    CHECK(qint(c, sql) == 3);
    jobq_job_free(&ja);
    jobq_job_free(&jb);
    jobq_job_free(&ja2);
    jobq_job_free(&jb2);
    jobq_destroy(a);
    jobq_destroy(a2);
    jobq_destroy(b);
    PQfinish(c);
}

static void test_cancel_and_attempts(void)
{
    PGconn *c = connect_or_die(conn_super);
    JobQueue *q = open_queue(NULL, NULL);
    CHECK(q != NULL);
    if (!q) return;
    char sql[256];
    // Cancelled while queued (what POST /v1/jobs/{id}/cancel does): never claimed.
    long long id = insert_jobs(c, 1, 3);
    snprintf(sql, sizeof sql, "UPDATE jobs SET state = 'cancelled', finished_at = now(),"
             " finish_reason = 'cancelled' WHERE id = %lld AND state = 'queued'", id);
    CHECK(q1(c, sql) != NULL);
    JobqJob j;
    CHECK(jobq_claim(q, &j) == ERR_NOTFOUND);

    // Cancelled while running: the next append reports it.
    id = insert_jobs(c, 1, 3);
    CHECK(jobq_claim(q, &j) == ERR_OK && j.id == id);
    snprintf(sql, sizeof sql, "UPDATE jobs SET cancel_requested = true WHERE id = %lld", id);
    CHECK(q1(c, sql) != NULL);
    const int32_t t[] = {1};
    JobqChunk ch = {JOBQ_CHUNK_CONTENT, "x", t, 1, NULL};
    bool cancelled = false;
    CHECK(jobq_append(q, &j, &ch, 1, &cancelled) == ERR_OK && cancelled);
    cancelled = false;
    CHECK(jobq_heartbeat(q, &j, &cancelled) == ERR_OK && cancelled);
    CHECK(jobq_finish(q, &j, "cancelled") == ERR_OK);
    snprintf(sql, sizeof sql, "SELECT state FROM jobs WHERE id = %lld", id);
    const char *v = q1(c, sql);
    CHECK(v && strcmp(v, "cancelled") == 0);
    jobq_job_free(&j);

    // A job that keeps losing its lease fails after max_attempts.
    id = insert_jobs(c, 1, 1);
    CHECK(jobq_claim(q, &j) == ERR_OK && j.id == id);
    jobq_job_free(&j);
    snprintf(sql, sizeof sql, "UPDATE jobs SET lease_until = now() - interval '1 second'"
             " WHERE id = %lld", id);
    CHECK(q1(c, sql) != NULL);
    CHECK(jobq_claim(q, &j) == ERR_NOTFOUND);
    snprintf(sql, sizeof sql, "SELECT state FROM jobs WHERE id = %lld", id);
    v = q1(c, sql);
    CHECK(v && strcmp(v, "failed") == 0);
    jobq_destroy(q);
    PQfinish(c);
}

// ---------------------------------------------------------------------------
// Batches, release, stats

// "seq:attempt:kind:text:ids" of a job's chunks, space-separated (static buffer).
static const char *chunk_list(PGconn *c, long long id)
{
    char sql[256];
    snprintf(sql, sizeof sql,
             "SELECT coalesce(string_agg(seq || ':' || attempt || ':' || kind || ':' || text ||"
             " ':' || token_ids::text, ' ' ORDER BY seq), '') FROM job_chunks WHERE job_id = %lld",
             id);
    return q1(c, sql);
}

static const char *job_state(PGconn *c, long long id)
{
    char sql[256];
    snprintf(sql, sizeof sql,
             "SELECT state || ' ' || n_chunks || ' ' || n_completion_tokens || ' ' ||"
             " coalesce(finish_reason, '-') || ' ' || coalesce(error, '-') || ' ' ||"
             " (lease_until IS NULL) || ' ' || (finished_at IS NULL) FROM jobs WHERE id = %lld", id);
    return q1(c, sql);
}

static void test_append_batch(void)
{
    PGconn *c = connect_or_die(conn_super);
    JobQueue *qa = open_queue(NULL, NULL), *qb = open_queue(NULL, NULL);
    CHECK(qa && qb);
    if (!qa || !qb) return;
    const long long first = insert_jobs(c, 4, 3);
    JobqJob j[4], taken;
    for (int i = 0; i < 4; i++) CHECK(jobq_claim(qa, &j[i]) == ERR_OK && j[i].id == first + i);
    char sql[256];
    // Job 1 is taken over by qb (qa stalled past its lease); job 0 gets a cancel request.
    snprintf(sql, sizeof sql, "UPDATE jobs SET lease_until = now() - interval '1 second'"
             " WHERE id = %lld", first + 1);
    CHECK(q1(c, sql) != NULL);
    CHECK(jobq_claim(qb, &taken) == ERR_OK && taken.id == first + 1);
    snprintf(sql, sizeof sql, "UPDATE jobs SET cancel_requested = true WHERE id = %lld", first);
    CHECK(q1(c, sql) != NULL);
    snprintf(sql, sizeof sql, "UPDATE jobs SET lease_until = now() + interval '2 seconds'"
             " WHERE id = %lld", first + 3);
    CHECK(q1(c, sql) != NULL);
    PQclear(PQexec(c, "LISTEN job_chunks"));

    const int32_t t0[] = {1, 2}, t1[] = {3}, t2[] = {4, 5, 6};
    const JobqChunk c0[2] = {{JOBQ_CHUNK_REASONING, "r", t0, 2, NULL},
                             {JOBQ_CHUNK_CONTENT, "it's", t1, 1, "[{\"logprob\":-1.25}]"}};
    const JobqChunk c1 = {JOBQ_CHUNK_CONTENT, "zombie", t1, 1, NULL};
    const JobqChunk c2 = {JOBQ_CHUNK_TOOL, "{\"a\":1}", t2, 3, NULL};
    JobqAppend items[4] = {
        {.job = &j[0], .chunks = c0, .n_chunks = 2, .n_cached = 128, .result = ERR_DB},
        {.job = &j[1], .chunks = &c1, .n_chunks = 1, .result = ERR_DB},  // fenced
        {.job = &j[2], .chunks = &c2, .n_chunks = 1, .finish_reason = "tool_calls",
         .result = ERR_DB},
        {.job = &j[3], .n_cached = -1, .result = ERR_DB},  // lease renewal only
    };
    CHECK(jobq_append_batch(qa, items, 4) == ERR_OK);
    CHECK(items[0].result == ERR_OK && items[0].is_cancelled && j[0].next_seq == 2);
    CHECK(items[1].result == ERR_NOTFOUND && j[1].next_seq == 0);
    CHECK(items[2].result == ERR_OK && !items[2].is_cancelled && j[2].next_seq == 1);
    CHECK(items[3].result == ERR_OK && !items[3].is_cancelled && j[3].next_seq == 0);
    const char *v = chunk_list(c, first);
    CHECK(v && !strcmp(v, "0:1:reasoning:r:{1,2} 1:1:content:it's:{3}"));
    v = chunk_list(c, first + 1);
    CHECK(v && !strcmp(v, ""));  // the zombie wrote nothing
    v = chunk_list(c, first + 2);
    CHECK(v && !strcmp(v, "0:1:tool:{\"a\":1}:{4,5,6}"));
    snprintf(sql, sizeof sql, "SELECT logprobs->0->>'logprob' FROM job_chunks"
             " WHERE job_id = %lld AND seq = 1", first);
    v = q1(c, sql);
    CHECK(v && !strcmp(v, "-1.25"));
    v = job_state(c, first);
    CHECK(v && !strcmp(v, "running 2 3 - - false true"));
    v = job_state(c, first + 1);
    CHECK(v && !strcmp(v, "running 0 0 - - false true"));  // qb's, untouched
    v = job_state(c, first + 2);
    CHECK(v && !strcmp(v, "succeeded 1 3 tool_calls - true false"));
    snprintf(sql, sizeof sql, "SELECT lease_until > now() + interval '20 seconds'"
             " AND first_token_at IS NULL FROM jobs WHERE id = %lld", first + 3);
    v = q1(c, sql);
    CHECK(v && !strcmp(v, "t"));  // renewed, and no output means no first token
    // Prompt tokens served from the prefix cache: set by item 0, left alone by item 3 (-1).
    snprintf(sql, sizeof sql, "SELECT string_agg(n_cached_tokens::text, ' ' ORDER BY id) FROM jobs"
             " WHERE id IN (%lld, %lld)", first, first + 3);
    v = q1(c, sql);
    CHECK(v && !strcmp(v, "128 0"));
    // One doorbell per job that got output or ended: jobs 0 and 2.
    PQconsumeInput(c);
    char rung[4] = {0};
    int n_notes = 0;
    PGnotify *note;
    while ((note = PQnotifies(c))) {
        for (int i = 0; i < 4; i++) rung[i] += !strcmp(note->extra, j[i].public_id);
        n_notes++;
        PQfreemem(note);
    }
    CHECK(n_notes == 2 && rung[0] == 1 && rung[2] == 1);

    // A lease with more than 3/4 of lease_s left is kept as it is (the row stays HOT).
    snprintf(sql, sizeof sql, "SELECT lease_until::text FROM jobs WHERE id = %lld", first);
    char lease_before[64];
    v = q1(c, sql);
    snprintf(lease_before, sizeof lease_before, "%s", v ? v : "?");
    JobqAppend renew = {.job = &j[0]};
    CHECK(jobq_append_batch(qa, &renew, 1) == ERR_OK && renew.result == ERR_OK);
    v = q1(c, sql);
    CHECK(v && !strcmp(v, lease_before));

    // Fail one job and finish another as cancelled, with output, in one batch; the job
    // already finished is fenced now.
    const int32_t t3[] = {7};
    const JobqChunk c3 = {JOBQ_CHUNK_CONTENT, "end", t3, 1, NULL};
    JobqAppend more[3] = {
        {.job = &j[0], .chunks = &c3, .n_chunks = 1, .finish_reason = "cancelled"},
        {.job = &j[3], .error = "the model failed"},
        {.job = &j[2], .chunks = &c3, .n_chunks = 1},
    };
    CHECK(jobq_append_batch(qa, more, 3) == ERR_OK);
    CHECK(more[0].result == ERR_OK && more[1].result == ERR_OK && more[2].result == ERR_NOTFOUND);
    CHECK(j[0].next_seq == 3 && j[2].next_seq == 1);
    v = job_state(c, first);
    CHECK(v && !strcmp(v, "cancelled 3 4 cancelled - true false"));
    v = job_state(c, first + 3);
    CHECK(v && !strcmp(v, "failed 0 0 error the model failed true false"));
    v = chunk_list(c, first + 2);
    CHECK(v && !strcmp(v, "0:1:tool:{\"a\":1}:{4,5,6}"));

    // Malformed batches are refused before anything is sent.
    JobqAppend dup[2] = {{.job = &j[1]}, {.job = &j[1]}};
    CHECK(jobq_append_batch(qb, dup, 2) == ERR_INVAL);
    JobqAppend no_chunks = {.job = &taken, .n_chunks = 1};
    CHECK(jobq_append_batch(qb, &no_chunks, 1) == ERR_INVAL);
    CHECK(jobq_append_batch(qb, NULL, 0) == ERR_OK);

    // Release: the job goes back to the queue at once and the next claim resumes it.
    JobqAppend own = {.job = &taken, .chunks = &c1, .n_chunks = 1};
    CHECK(jobq_append_batch(qb, &own, 1) == ERR_OK && own.result == ERR_OK && taken.next_seq == 1);
    CHECK(jobq_release(qa, &taken) == ERR_NOTFOUND);  // not qa's
    CHECK(jobq_release(qb, &taken) == ERR_OK);
    CHECK(jobq_release(qb, &taken) == ERR_NOTFOUND);  // no longer running
    v = job_state(c, first + 1);
    CHECK(v && !strcmp(v, "queued 1 1 - - true true"));
    JobqJob again;
    CHECK(jobq_claim(qa, &again) == ERR_OK && again.id == first + 1 && again.attempt == 3
          && again.next_seq == 1 && again.n_committed == 1 && again.committed_ids[0] == 3);
    // Text and logprobs travel inside array literals: quotes, backslashes, braces, commas,
    // NULL, newlines and UTF-8 come back byte for byte, as does an empty token list.
    const char *tricky = "NULL \\ \"q\" {x,y} \u00e9\n'";
    const char *tricky_lp = "[{\"token\":\"\\\"}\\\\\",\"logprob\":-2}]";
    const JobqChunk fin_chunks[2] = {c3, {JOBQ_CHUNK_CONTENT, tricky, NULL, 0, tricky_lp}};
    JobqAppend fin = {.job = &again, .chunks = fin_chunks, .n_chunks = 2, .finish_reason = "stop"};
    CHECK(jobq_append_batch(qa, &fin, 1) == ERR_OK && fin.result == ERR_OK && again.next_seq == 3);
    v = chunk_list(c, first + 1);
    CHECK(v && !strncmp(v, "0:2:content:zombie:{3} 1:3:content:end:{7} 2:3:content:", 55));
    snprintf(sql, sizeof sql, "SELECT (text = $1 AND logprobs = $2::jsonb AND token_ids = '{}')::text"
             " FROM job_chunks WHERE job_id = %lld AND seq = 2", first + 1);
    PGresult *r = PQexecParams(c, sql, 2, NULL, (const char *const[]){tricky, tricky_lp}, NULL,
                               NULL, 0);
    CHECK(PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1
          && !strcmp(PQgetvalue(r, 0, 0), "true"));
    PQclear(r);
    PQclear(PQexec(c, "UNLISTEN *"));
    for (int i = 0; i < 4; i++) jobq_job_free(&j[i]);
    jobq_job_free(&taken);
    jobq_job_free(&again);
    jobq_destroy(qa);
    jobq_destroy(qb);
    PQfinish(c);
}

// jobq_append_send / jobq_append_finish: the batch commits (and rings) without its answer
// being read; another call in between reads the answer first; finish reports it.
static void test_append_send(void)
{
    PGconn *c = connect_or_die(conn_super);
    JobQueue *qa = open_queue(NULL, NULL);
    CHECK(qa != NULL);
    if (!qa) return;
    const long long first = insert_jobs(c, 2, 3);
    JobqJob j[2];
    for (int i = 0; i < 2; i++) CHECK(jobq_claim(qa, &j[i]) == ERR_OK && j[i].id == first + i);
    char sql[256];
    snprintf(sql, sizeof sql, "UPDATE jobs SET cancel_requested = true WHERE id = %lld", first);
    CHECK(q1(c, sql) != NULL);
    const int32_t t0[] = {5};
    const JobqChunk ch = {JOBQ_CHUNK_CONTENT, "x", t0, 1, NULL};
    JobqAppend items[2] = {{.job = &j[0], .chunks = &ch, .n_chunks = 1, .result = ERR_DB},
                           {.job = &j[1], .chunks = &ch, .n_chunks = 1, .finish_reason = "stop",
                            .result = ERR_DB}};
    CHECK(jobq_append_finish(qa) == ERR_OK);  // nothing in flight
    CHECK(jobq_append_send(qa, items, 2) == ERR_OK);
    CHECK(items[0].result == ERR_DB && j[0].next_seq == 0);  // not read yet
    // Another reader sees the commit while the answer is still unread (at most 5 s).
    const char *v = NULL;
    for (int i = 0; i < 500; i++) {
        v = job_state(c, first + 1);
        if (v && !strncmp(v, "succeeded", 9)) break;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    CHECK(v && !strcmp(v, "succeeded 1 1 stop - true false"));
    v = chunk_list(c, first);
    CHECK(v && !strcmp(v, "0:1:content:x:{5}"));
    // A call in between reads the answer first (into items), then runs.
    CHECK(jobq_set_stats(qa, "{\"state\": \"ready\"}") == ERR_OK);
    CHECK(items[0].result == ERR_OK && items[0].is_cancelled && j[0].next_seq == 1);
    CHECK(items[1].result == ERR_OK && !items[1].is_cancelled && j[1].next_seq == 1);
    CHECK(jobq_append_finish(qa) == ERR_OK);
    CHECK(jobq_append_finish(qa) == ERR_OK);  // collected: nothing in flight
    // Send, then finish directly: the fenced job (ended above) is reported.
    JobqAppend again[2] = {{.job = &j[0], .chunks = &ch, .n_chunks = 1},
                           {.job = &j[1], .chunks = &ch, .n_chunks = 1}};
    CHECK(jobq_append_send(qa, again, 2) == ERR_OK);
    CHECK(jobq_append_finish(qa) == ERR_OK);
    CHECK(again[0].result == ERR_OK && j[0].next_seq == 2 && again[1].result == ERR_NOTFOUND
          && j[1].next_seq == 1);
    CHECK(jobq_append_send(qa, NULL, 0) == ERR_OK && jobq_append_finish(qa) == ERR_OK);
    // A malformed batch is refused before anything is sent; nothing is in flight after it.
    JobqAppend dup[2] = {{.job = &j[0]}, {.job = &j[0]}};
    CHECK(jobq_append_send(qa, dup, 2) == ERR_INVAL && jobq_append_finish(qa) == ERR_OK);
    for (int i = 0; i < 2; i++) jobq_job_free(&j[i]);
    jobq_destroy(qa);
    PQfinish(c);
}

static void test_stats(void)
{
    PGconn *c = connect_or_die(conn_super), *admin = connect_or_die(conn_admin);
    JobQueue *q = open_queue(NULL, NULL);
    CHECK(q != NULL);
    if (!q) return;
    char sql[256];
    snprintf(sql, sizeof sql, "UPDATE engines SET heartbeat_at = now() - interval '1 hour'"
             " WHERE id = %lld", (long long) jobq_epoch(q));
    CHECK(q1(c, sql) != NULL);
    const char *stats = "{\"version\":1,\"state\":\"ready\",\"world\":3,\"ranks\":[{\"rank\":0,"
                        "\"host\":\"n1\"}],\"tokens_per_s\":75.25}";
    CHECK(jobq_set_stats(q, stats) == ERR_OK);
    snprintf(sql, sizeof sql,
             "SELECT (stats->>'state') || ' ' || (stats->>'world') || ' ' ||"
             " (stats->'ranks'->0->>'host') || ' ' || (stats->>'tokens_per_s') || ' ' ||"
             " (heartbeat_at > now() - interval '1 minute') || ' ' || name"
             " FROM admin.engines WHERE id = %lld", (long long) jobq_epoch(q));
    const char *v = q1(admin, sql);
    CHECK(v && !strcmp(v, "ready 3 n1 75.25 true test"));
    CHECK(jobq_set_stats(q, "{\"version\":") == ERR_DB);  // not JSON: refused, reported
    v = q1(admin, sql);
    CHECK(v && !strcmp(v, "ready 3 n1 75.25 true test"));  // the last good stats stay
    jobq_destroy(q);
    PQfinish(admin);
    PQfinish(c);
}

// Engines claim only the jobs of the model they serve; admin.models and admin.running count
// per model.
static void test_models(void)
{
    PGconn *c = connect_or_die(conn_super), *admin = connect_or_die(conn_admin);
    const long long first_m = insert_jobs(c, 2, 3);  // model "m": no engine below serves it
    CHECK(first_m > 0);
    char sql[512];
    snprintf(sql, sizeof sql,
             "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids, n_prompt_tokens,"
             " max_tokens) SELECT %lld, 'chat', 'm2', '{}', '{1,2}', 2, 8"
             " FROM generate_series(1, 3) RETURNING id", key_id);
    CHECK(q1(c, sql) != NULL);
    const JobqOptions o = {
        .conninfo = conn_app, .engine_name = "model-two", .model = "m2", .lease_s = 30};
    JobQueue *q = NULL;
    CHECK(jobq_create(&o, &q) == ERR_OK);
    if (!q) return;
    JobqJob j[4];
    int n = 0;
    while (n < 4 && jobq_claim(q, &j[n]) == ERR_OK)
        n++;
    CHECK(n == 3);  // the "m" jobs stay queued
    for (int i = 0; i < n; i++) {
        snprintf(sql, sizeof sql, "SELECT model FROM jobs WHERE id = %lld", (long long) j[i].id);
        const char *m = q1(c, sql);
        CHECK(m && !strcmp(m, "m2"));
    }
    snprintf(sql, sizeof sql, "SELECT state FROM jobs WHERE id = %lld", first_m);
    const char *st = q1(c, sql);
    CHECK(st && !strcmp(st, "queued"));
    const char *v = q1(admin, "SELECT engines_live || ' ' || queued || ' ' || running"
                              " FROM admin.models WHERE model = 'm2'");
    CHECK(v && !strcmp(v, "1 0 3"));
    CHECK(qint(admin, "SELECT count(*) FROM admin.running WHERE model = 'm2'") == 3);
    CHECK(qint(admin, "SELECT queued FROM admin.models WHERE model = 'm'") >= 2);
    for (int i = 0; i < n; i++) {
        CHECK(jobq_finish(q, &j[i], "stop") == ERR_OK);
        jobq_job_free(&j[i]);
    }
    v = q1(admin, "SELECT engines_live || ' ' || queued || ' ' || running"
                  " FROM admin.models WHERE model = 'm2'");
    CHECK(v && !strcmp(v, "1 0 0"));
    jobq_destroy(q);  // stopped, and no unfinished job: the model leaves the view
    CHECK(qint(admin, "SELECT count(*) FROM admin.models WHERE model = 'm2'") == 0);
    snprintf(sql, sizeof sql, "DELETE FROM jobs WHERE model = 'm' AND id >= %lld", first_m);
    PQclear(PQexec(c, sql));
    PQfinish(admin);
    PQfinish(c);
}

int main(void)
{
    const char *host = getenv("GLMSPARK_PGHOST"), *db = getenv("GLMSPARK_DB");
    if (!host || !db) {
        fprintf(stderr, "test_jobq: run me through tests/db/with_pg.sh\n");
        return 1;
    }
    snprintf(conn_super, sizeof conn_super, "%s", db);
    snprintf(conn_app, sizeof conn_app, "host=%s user=glmspark_app dbname=glmspark", host);
    snprintf(conn_admin, sizeof conn_admin, "host=%s user=glmspark_admin dbname=glmspark", host);
    test_migrate();
    test_roles();
    test_keys();
    test_concurrent_claims();
    test_lease_expiry_and_fencing();
    test_engines_and_recovery();
    test_cancel_and_attempts();
    test_append_batch();
    test_append_send();
    test_stats();
    test_models();
    return check_exit();
}
