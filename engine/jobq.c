/*
 * jobq.c - the engine side of the PostgreSQL job queue (contract in jobq.h, sql/).
 *
 * Every operation is one statement, hence one implicit transaction and one round trip:
 * the claim's UPDATE picks its row with FOR UPDATE SKIP LOCKED inside a MATERIALIZED CTE
 * (so concurrent claimers never take the same job and never wait on each other), and an
 * append's UPDATE of the job row (the fencing check, lease extension, and the seq check
 * that keeps chunks contiguous) feeds the INSERT of its chunks and the NOTIFY through
 * data-modifying CTEs. The UPDATE takes the job's row lock first, so an append and a
 * takeover by another engine are serialized and the loser sees zero rows.
 */
#include "jobq.h"

#include <libpq-fe.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

// The queue's advisory lock: one active exclusive engine per database.
#define JOBQ_LOCK_KEY "7406135331560110082"

struct JobQueue {
    PGconn *conn;
    JobqOptions opt;
    char *conninfo, *engine_name, *model;  // owned copies of opt's strings
    int64_t epoch;
    char epoch_text[24];
    char lease_text[16];
};

// ---------------------------------------------------------------------------
// Helpers

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long) (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// Run a parameterized statement; returns the result when its status is want, else logs
// and returns NULL (ERR_DB for the caller).
static PGresult *exec_params(JobQueue *q, const char *what, const char *sql, int n,
                             const char *const *params, ExecStatusType want)
{
    PGresult *res = PQexecParams(q->conn, sql, n, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) == want) return res;
    LOG_ERROR("jobq: %s failed: %s", what, PQerrorMessage(q->conn));
    PQclear(res);
    return NULL;
}

// Parse a PostgreSQL int[] in text form ("{1,2,3}") into a new array. NULL with *n = 0
// for "{}"; ERR_FORMAT on anything else.
static Err parse_int_array(const char *s, int32_t **out, int *n_out)
{
    *out = NULL;
    *n_out = 0;
    if (s[0] != '{') return ERR_FORMAT;
    int cap = 1;
    for (const char *p = s; *p; p++) cap += *p == ',';
    if (!strcmp(s, "{}")) return ERR_OK;
    int32_t *v = malloc((size_t) cap * sizeof *v);
    if (!v) return ERR_NOMEM;
    int n = 0;
    const char *p = s + 1;
    for (;;) {
        char *end = NULL;
        const long x = strtol(p, &end, 10);
        if (end == p || n == cap || x < INT32_MIN || x > INT32_MAX) break;
        v[n++] = (int32_t) x;
        if (*end == ',') {
            p = end + 1;
        } else if (end[0] == '}' && end[1] == '\0') {
            *out = v;
            *n_out = n;
            return ERR_OK;
        } else {
            break;
        }
    }
    free(v);
    return ERR_FORMAT;
}

// Append "{a,b,c}" for ids[0..n) to buf (a growing heap string). false on OOM.
static bool format_int_array(char **buf, size_t *len, size_t *cap, const int32_t *ids, int n)
{
    const size_t need = *len + 2 + (size_t) n * 12 + 1;
    if (need > *cap) {
        size_t c = *cap ? *cap : 64;
        while (c < need) c *= 2;
        char *b = realloc(*buf, c);
        if (!b) return false;
        *buf = b;
        *cap = c;
    }
    char *p = *buf + *len;
    *p++ = '{';
    for (int i = 0; i < n; i++) p += sprintf(p, i ? ",%d" : "%d", (int) ids[i]);
    *p++ = '}';
    *p = '\0';
    *len = (size_t) (p - *buf);
    return true;
}

// Open the connection, LISTEN, take the lock when exclusive. ERR_AGAIN when the lock is
// held elsewhere, ERR_DB on a connection failure.
static Err open_session(JobQueue *q)
{
    PQfinish(q->conn);
    q->conn = PQconnectdb(q->conninfo);
    if (PQstatus(q->conn) != CONNECTION_OK) {
        LOG_WARN("jobq: could not connect to the database: %s", PQerrorMessage(q->conn));
        return ERR_DB;
    }
    PGresult *res = PQexec(q->conn, "LISTEN jobs_new");
    const bool listening = PQresultStatus(res) == PGRES_COMMAND_OK;
    PQclear(res);
    if (!listening) {
        LOG_WARN("jobq: LISTEN failed: %s", PQerrorMessage(q->conn));
        return ERR_DB;
    }
    if (!q->opt.is_exclusive) return ERR_OK;
    res = PQexec(q->conn, "SELECT pg_try_advisory_lock(" JOBQ_LOCK_KEY ")");
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        LOG_WARN("jobq: could not take the queue lock: %s", PQerrorMessage(q->conn));
        PQclear(res);
        return ERR_DB;
    }
    const bool locked = PQgetvalue(res, 0, 0)[0] == 't';
    PQclear(res);
    if (!locked) {
        LOG_ERROR("jobq: another engine holds the queue lock; only one engine cluster may "
                  "serve a queue");
        return ERR_AGAIN;
    }
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Lifecycle

Err jobq_create(const JobqOptions *opt, JobQueue **out)
{
    Err err = ERR_NOMEM;
    PGresult *res = NULL;
    JobQueue *q = calloc(1, sizeof *q);
    *out = NULL;
    if (!q) goto done;
    q->opt = *opt;
    if (q->opt.lease_s <= 0) q->opt.lease_s = 30;
    q->conninfo = strdup(opt->conninfo ? opt->conninfo : "");
    q->engine_name = strdup(opt->engine_name ? opt->engine_name : "engine");
    q->model = strdup(opt->model ? opt->model : "");
    if (!q->conninfo || !q->engine_name || !q->model) goto done;
    q->opt.conninfo = q->conninfo;
    q->opt.engine_name = q->engine_name;
    q->opt.model = q->model;
    snprintf(q->lease_text, sizeof q->lease_text, "%d", q->opt.lease_s);
    if ((err = open_session(q))) goto done;

    char pid[16];
    snprintf(pid, sizeof pid, "%d", (int) getpid());
    err = ERR_DB;
    res = exec_params(q, "registering the engine",
                      "INSERT INTO engines (name, model, pid) VALUES ($1, $2, $3::int) RETURNING id",
                      3, (const char *const[]){q->engine_name, q->model, pid}, PGRES_TUPLES_OK);
    if (!res) goto done;
    q->epoch = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    snprintf(q->epoch_text, sizeof q->epoch_text, "%lld", (long long) q->epoch);
    LOG_INFO("jobq: engine \"%s\" registered with epoch %lld%s", q->engine_name,
             (long long) q->epoch, q->opt.is_exclusive ? " (exclusive)" : "");
    *out = q;
    q = NULL;  // ownership moved to *out
    err = ERR_OK;
done:
    PQclear(res);
    jobq_destroy(q);
    return err;
}

void jobq_destroy(JobQueue *q)
{
    if (!q) return;
    if (q->conn && q->epoch && PQstatus(q->conn) == CONNECTION_OK) {
        PGresult *res = PQexecParams(q->conn, "UPDATE engines SET stopped_at = now() WHERE id = $1",
                                     1, NULL, (const char *const[]){q->epoch_text}, NULL, NULL, 0);
        PQclear(res);
    }
    PQfinish(q->conn);
    free(q->conninfo);
    free(q->engine_name);
    free(q->model);
    free(q);
}

int64_t jobq_epoch(const JobQueue *q)
{
    return q->epoch;
}

Err jobq_reconnect(JobQueue *q, int max_wait_ms)
{
    int delay = 100, waited = 0;
    for (;;) {
        const Err err = open_session(q);
        if (err != ERR_DB) {
            if (!err) LOG_INFO("jobq: reconnected to the database after %d ms", waited);
            return err;
        }
        if (max_wait_ms >= 0 && waited >= max_wait_ms) return ERR_DB;
        sleep_ms(delay);
        waited += delay;
        delay = delay * 2 > 5000 ? 5000 : delay * 2;
    }
}

// ---------------------------------------------------------------------------
// Claim and recovery

Err jobq_recover(JobQueue *q, int *n_requeued)
{
    ASSERT(q->opt.is_exclusive);
    PGresult *res = exec_params(
        q, "recovering running jobs",
        "UPDATE jobs SET state = 'queued', lease_epoch = NULL, lease_until = NULL"
        " WHERE state = 'running' RETURNING public_id",
        0, NULL, PGRES_TUPLES_OK);
    if (!res) return ERR_DB;
    const int n = PQntuples(res);
    for (int i = 0; i < n; i++)
        LOG_INFO("jobq: requeued interrupted job %s", PQgetvalue(res, i, 0));
    PQclear(res);
    if (n) {
        res = PQexec(q->conn, "NOTIFY jobs_new");
        PQclear(res);
    }
    if (n_requeued) *n_requeued = n;
    return ERR_OK;
}

static const char claim_sql[] =
    "WITH c AS MATERIALIZED ("
    "  SELECT id FROM jobs"
    "  WHERE state = 'queued' OR (state = 'running' AND lease_until < now())"
    "  ORDER BY priority DESC, id LIMIT 1 FOR UPDATE SKIP LOCKED)"
    " UPDATE jobs j SET state = 'running', attempt = j.attempt + 1, lease_epoch = $1::bigint,"
    "   lease_until = now() + $2::int * interval '1 second',"
    "   claimed_at = coalesce(j.claimed_at, now()), heartbeat_at = now()"
    " FROM c WHERE j.id = c.id"
    " RETURNING j.id, j.public_id, j.kind, j.attempt, j.max_attempts, j.request::text,"
    "   j.prompt_ids::text, j.max_tokens, j.n_chunks";

Err jobq_claim(JobQueue *q, JobqJob *job)
{
    memset(job, 0, sizeof *job);
    for (;;) {
        Err err = ERR_DB;
        JobqJob j = {0};
        PGresult *chunks = NULL;
        PGresult *res = exec_params(q, "claiming a job", claim_sql, 2,
                                    (const char *const[]){q->epoch_text, q->lease_text},
                                    PGRES_TUPLES_OK);
        if (!res) return ERR_DB;
        if (PQntuples(res) == 0) {
            PQclear(res);
            return ERR_NOTFOUND;
        }
        j.id = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
        snprintf(j.public_id, sizeof j.public_id, "%s", PQgetvalue(res, 0, 1));
        snprintf(j.kind, sizeof j.kind, "%s", PQgetvalue(res, 0, 2));
        j.attempt = atoi(PQgetvalue(res, 0, 3));
        const int max_attempts = atoi(PQgetvalue(res, 0, 4));
        j.max_tokens = atoi(PQgetvalue(res, 0, 7));
        j.next_seq = atoi(PQgetvalue(res, 0, 8));
        if (j.attempt > max_attempts) {
            LOG_WARN("jobq: job %s failed after %d attempts", j.public_id, max_attempts);
            PQclear(res);
            if ((err = jobq_fail(q, &j, "the job was interrupted too many times")) &&
                err != ERR_NOTFOUND)
                return err;
            continue;
        }
        err = ERR_NOMEM;
        if (!(j.request_json = strdup(PQgetvalue(res, 0, 5)))) goto fail;
        if ((err = parse_int_array(PQgetvalue(res, 0, 6), &j.prompt_ids, &j.n_prompt))) {
            LOG_ERROR("jobq: job %s has malformed prompt ids", j.public_id);
            goto fail;
        }
        if (j.next_seq > 0) {
            // A resumed job: gather the tokens committed by earlier attempts, in order.
            char id_text[24];
            snprintf(id_text, sizeof id_text, "%lld", (long long) j.id);
            err = ERR_DB;
            chunks = exec_params(
                q, "reading committed chunks",
                "SELECT coalesce(array_agg(t ORDER BY c.seq, o), '{}')::text FROM job_chunks c,"
                " unnest(c.token_ids) WITH ORDINALITY AS u(t, o) WHERE c.job_id = $1::bigint",
                1, (const char *const[]){id_text}, PGRES_TUPLES_OK);
            if (!chunks) goto fail;
            if ((err = parse_int_array(PQgetvalue(chunks, 0, 0), &j.committed_ids, &j.n_committed)))
                goto fail;
            LOG_INFO("jobq: resuming job %s (attempt %d) after %d committed tokens in %d chunks",
                     j.public_id, j.attempt, j.n_committed, j.next_seq);
        }
        PQclear(res);
        PQclear(chunks);
        *job = j;
        return ERR_OK;
    fail:
        PQclear(res);
        PQclear(chunks);
        jobq_job_free(&j);
        return err;
    }
}

void jobq_job_free(JobqJob *job)
{
    if (!job) return;
    free(job->request_json);
    free(job->prompt_ids);
    free(job->committed_ids);
    memset(job, 0, sizeof *job);
}

// ---------------------------------------------------------------------------
// Output and termination

static const char *const kind_names[] = {"content", "reasoning", "tool"};

Err jobq_append(JobQueue *q, JobqJob *job, const JobqChunk *chunks, int n, bool *is_cancelled)
{
    ASSERT(n > 0 && n <= 64);
    enum { N_FIXED = 6, PER_CHUNK = 4 };
    const char *params[N_FIXED + PER_CHUNK * 64];
    char id_text[24], seq_text[16], n_text[16], n_tok_text[16], attempt_text[16];
    char *arrays = NULL, *sql = NULL;
    size_t arrays_len = 0, arrays_cap = 0, offsets[64];
    PGresult *res = NULL;
    Err err = ERR_NOMEM;

    int n_tokens = 0;
    for (int i = 0; i < n; i++) {
        offsets[i] = arrays_len;
        if (!format_int_array(&arrays, &arrays_len, &arrays_cap, chunks[i].token_ids,
                              chunks[i].n_tokens))
            goto done;
        arrays_len++;  // keep the NUL: each array is its own parameter string
        n_tokens += chunks[i].n_tokens;
    }
    snprintf(id_text, sizeof id_text, "%lld", (long long) job->id);
    snprintf(seq_text, sizeof seq_text, "%d", job->next_seq);
    snprintf(n_text, sizeof n_text, "%d", n);
    snprintf(n_tok_text, sizeof n_tok_text, "%d", n_tokens);
    snprintf(attempt_text, sizeof attempt_text, "%d", job->attempt);
    params[0] = id_text;
    params[1] = q->epoch_text;
    params[2] = seq_text;
    params[3] = n_text;
    params[4] = n_tok_text;
    params[5] = attempt_text;

    // VALUES ($7, $8, $9::int[], 0), ... : kind, text, token ids, position in the batch.
    const size_t sql_cap = 1024 + (size_t) n * 96;
    if (!(sql = malloc(sql_cap))) goto done;
    int len = snprintf(sql, sql_cap,
                       "WITH j AS (UPDATE jobs SET n_chunks = n_chunks + $4::int,"
                       " n_completion_tokens = n_completion_tokens + $5::int,"
                       " first_token_at = coalesce(first_token_at, now()), heartbeat_at = now(),"
                       " lease_until = now() + %d * interval '1 second'"
                       " WHERE id = $1::bigint AND state = 'running' AND lease_epoch = $2::bigint"
                       " AND n_chunks = $3::int RETURNING id, public_id, cancel_requested),"
                       " ins AS (INSERT INTO job_chunks (job_id, seq, attempt, kind, text, token_ids,"
                       " logprobs) SELECT j.id, $3::int + v.k, $6::int, v.kind, v.text, v.ids, v.lp"
                       " FROM j, (VALUES ",
                       q->opt.lease_s);
    for (int i = 0; i < n; i++) {
        const int p = N_FIXED + PER_CHUNK * i;
        params[p] = kind_names[chunks[i].kind];
        params[p + 1] = chunks[i].text ? chunks[i].text : "";
        params[p + 2] = arrays + offsets[i];
        params[p + 3] = chunks[i].logprobs_json;  // NULL: SQL NULL
        len += snprintf(sql + len, sql_cap - (size_t) len,
                        "%s($%d::text, $%d::text, $%d::int[], $%d::jsonb, %d)", i ? ", " : "", p + 1,
                        p + 2, p + 3, p + 4, i);
    }
    snprintf(sql + len, sql_cap - (size_t) len,
             ") AS v (kind, text, ids, lp, k))"
             " SELECT cancel_requested, pg_notify('job_chunks', public_id) FROM j");
    err = ERR_DB;
    if (!(res = exec_params(q, "appending chunks", sql, N_FIXED + PER_CHUNK * n, params,
                            PGRES_TUPLES_OK)))
        goto done;
    if (PQntuples(res) == 0) {
        LOG_WARN("jobq: job %s is no longer owned by epoch %s; dropping its output",
                 job->public_id, q->epoch_text);
        err = ERR_NOTFOUND;
        goto done;
    }
    if (is_cancelled) *is_cancelled = PQgetvalue(res, 0, 0)[0] == 't';
    job->next_seq += n;
    err = ERR_OK;
done:
    PQclear(res);
    free(sql);
    free(arrays);
    return err;
}

Err jobq_heartbeat(JobQueue *q, const JobqJob *job, bool *is_cancelled)
{
    char id_text[24];
    snprintf(id_text, sizeof id_text, "%lld", job ? (long long) job->id : 0LL);
    PGresult *res = exec_params(
        q, "heartbeat",
        "WITH e AS (UPDATE engines SET heartbeat_at = now() WHERE id = $2::bigint)"
        " UPDATE jobs SET heartbeat_at = now(), lease_until = now() + $3::int * interval '1 second'"
        " WHERE id = $1::bigint AND state = 'running' AND lease_epoch = $2::bigint"
        " RETURNING cancel_requested",
        3, (const char *const[]){id_text, q->epoch_text, q->lease_text}, PGRES_TUPLES_OK);
    if (!res) return ERR_DB;
    Err err = ERR_OK;
    if (!job) {
        err = ERR_OK;
    } else if (PQntuples(res) == 0) {
        err = ERR_NOTFOUND;
    } else if (is_cancelled) {
        *is_cancelled = PQgetvalue(res, 0, 0)[0] == 't';
    }
    PQclear(res);
    return err;
}

// Move a running job of ours to a terminal state.
static Err end_job(JobQueue *q, const JobqJob *job, const char *state, const char *finish_reason,
                   const char *error)
{
    char id_text[24];
    snprintf(id_text, sizeof id_text, "%lld", (long long) job->id);
    PGresult *res = exec_params(
        q, "finishing a job",
        "WITH j AS (UPDATE jobs SET state = $3, finished_at = now(), finish_reason = $4,"
        " error = $5, lease_until = NULL"
        " WHERE id = $1::bigint AND state = 'running' AND lease_epoch = $2::bigint"
        " RETURNING public_id)"
        " SELECT pg_notify('job_chunks', public_id) FROM j",
        5, (const char *const[]){id_text, q->epoch_text, state, finish_reason, error},
        PGRES_TUPLES_OK);
    if (!res) return ERR_DB;
    const Err err = PQntuples(res) == 1 ? ERR_OK : ERR_NOTFOUND;
    if (err) LOG_WARN("jobq: could not end job %s: not owned by epoch %s", job->public_id,
                      q->epoch_text);
    PQclear(res);
    return err;
}

Err jobq_finish(JobQueue *q, const JobqJob *job, const char *finish_reason)
{
    const bool is_cancel = !strcmp(finish_reason, "cancelled");
    return end_job(q, job, is_cancel ? "cancelled" : "succeeded", finish_reason, NULL);
}

Err jobq_fail(JobQueue *q, const JobqJob *job, const char *error)
{
    return end_job(q, job, "failed", "error", error);
}

Err jobq_wait(JobQueue *q, int timeout_ms)
{
    struct pollfd pfd = {.fd = PQsocket(q->conn), .events = POLLIN};
    if (pfd.fd < 0) return ERR_DB;
    PGnotify *note;
    bool woken = false;
    if (!PQconsumeInput(q->conn)) goto lost;
    while ((note = PQnotifies(q->conn))) {
        woken = true;
        PQfreemem(note);
    }
    if (woken) return ERR_OK;
    if (poll(&pfd, 1, timeout_ms) > 0) {
        if (!PQconsumeInput(q->conn)) goto lost;
        while ((note = PQnotifies(q->conn))) PQfreemem(note);
    }
    return ERR_OK;
lost:
    LOG_WARN("jobq: lost the database connection: %s", PQerrorMessage(q->conn));
    return ERR_DB;
}
