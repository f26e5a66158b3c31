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
 * jobq_append_batch() is the same for many jobs in one prepared statement whose items
 * and chunks travel as parallel arrays: one UPDATE ... FROM unnest(...) matches only the
 * rows still ours, so a fenced item drops out without aborting the others, and one commit
 * (one WAL flush, one pass of the notify queue) serves the whole engine step.
 */
#include "engine/serve/jobq.h"

#include <errno.h>
#include <libpq-fe.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/shared/buf.h"

struct JobQueue {
    PGconn *conn;
    JobqOptions opt;
    char *conninfo, *engine_name, *model;  // owned copies of opt's strings
    int64_t epoch;
    char epoch_text[24];
    char lease_text[16];
    bool is_batch_prepared;  // the batch statement exists on this connection
    // A batch sent by jobq_append_send whose answer has not been read (is_sent), or has been
    // read into pend_items (results, next_seq) and waits for jobq_append_finish (pend_err).
    JobqAppend *pend_items;
    int pend_n;
    bool is_sent;
    Err pend_err;
};

static void settle(JobQueue *q);

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
    settle(q);
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

// Open the connection and LISTEN. ERR_DB on a connection failure.
static Err open_session(JobQueue *q)
{
    settle(q);  // a batch in flight on the old connection is answered (or failed) first
    PQfinish(q->conn);
    q->is_batch_prepared = false;
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
    return ERR_OK;
}

// Whether process pid runs on this host (a boot's pid, which engines registers; our own
// pid is an earlier boot of this very process, so not a live other engine). A zombie (killed,
// not yet reaped by its parent) does not run.
static bool pid_alive(long pid)
{
    if (pid <= 0 || pid == (long) getpid()) return false;
    if (kill((pid_t) pid, 0) != 0 && errno != EPERM) return false;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return true;  // no /proc: the signal test alone
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces
    return !(paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X'));
}

// After registering: no other live boot may carry our name, since jobq_recover() takes the
// jobs of earlier boots of this name back at once. A boot of our name that has not stopped,
// has beaten within the lease and whose pid runs on this host is live: ERR_AGAIN. The others
// (crashed, or a pid gone from this host) are earlier lives of this engine.
static Err check_name(JobQueue *q)
{
    PGresult *res = exec_params(
        q, "checking the engine name",
        "SELECT id, pid FROM engines WHERE name = $1 AND id <> $2::bigint AND stopped_at IS NULL"
        " AND heartbeat_at > now() - $3::int * interval '1 second'",
        3, (const char *const[]){q->engine_name, q->epoch_text, q->lease_text}, PGRES_TUPLES_OK);
    if (!res) return ERR_DB;
    Err err = ERR_OK;
    for (int i = 0; i < PQntuples(res) && !err; i++) {
        const long pid = PQgetisnull(res, i, 1) ? 0 : strtol(PQgetvalue(res, i, 1), NULL, 10);
        if (!pid_alive(pid)) continue;
        LOG_ERROR("jobq: engine name \"%s\" is in use by boot %s (pid %ld, alive); give each "
                  "engine cluster its own name (--name)",
                  q->engine_name, PQgetvalue(res, i, 0), pid);
        err = ERR_AGAIN;
    }
    PQclear(res);
    return err;
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
    if ((err = check_name(q))) goto done;  // jobq_destroy marks this boot stopped
    LOG_INFO("jobq: engine \"%s\" registered with epoch %lld", q->engine_name,
             (long long) q->epoch);
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
    settle(q);
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
        delay = delay * 2 > 1000 ? 1000 : delay * 2;  // a failover takes seconds: keep looking
    }
}

// ---------------------------------------------------------------------------
// Claim and recovery

// Our own jobs and those of earlier boots of our name (check_name: none of them is live),
// which are marked stopped on the way; other engines' jobs are theirs until their leases
// run out.
Err jobq_recover(JobQueue *q, int *n_requeued)
{
    PGresult *res = exec_params(
        q, "recovering running jobs",
        "WITH dead AS (UPDATE engines SET stopped_at = now() WHERE name = $1 AND id < $2::bigint"
        "   AND stopped_at IS NULL RETURNING id)"
        " UPDATE jobs SET state = 'queued', lease_epoch = NULL, lease_until = NULL"
        " WHERE state = 'running' AND (lease_epoch = $2::bigint"
        "   OR lease_epoch IN (SELECT id FROM engines WHERE name = $1 AND id < $2::bigint))"
        " RETURNING public_id",
        2, (const char *const[]){q->engine_name, q->epoch_text}, PGRES_TUPLES_OK);
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
    "  WHERE model = $3 AND (state = 'queued' OR (state = 'running' AND lease_until < now()))"
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
        PGresult *res = exec_params(q, "claiming a job", claim_sql, 3,
                                    (const char *const[]){q->epoch_text, q->lease_text, q->model},
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
    Buf sql = {0}, arrays = {0};
    size_t offsets[64];
    PGresult *res = NULL;
    Err err = ERR_NOMEM;

    int n_tokens = 0;
    for (int i = 0; i < n; i++) {
        offsets[i] = arrays.n;
        buf_add_ids(&arrays, chunks[i].token_ids, (size_t) chunks[i].n_tokens);
        buf_add(&arrays, "", 1);  // keep the NUL: each array is its own parameter string
        n_tokens += chunks[i].n_tokens;
    }
    if (arrays.is_oom) goto done;
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
    buf_addf(&sql,
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
        params[p + 2] = arrays.p + offsets[i];
        params[p + 3] = chunks[i].logprobs_json;  // NULL: SQL NULL
        buf_addf(&sql, "%s($%d::text, $%d::text, $%d::int[], $%d::jsonb, %d)", i ? ", " : "", p + 1,
                 p + 2, p + 3, p + 4, i);
    }
    buf_adds(&sql, ") AS v (kind, text, ids, lp, k))"
                   " SELECT cancel_requested, pg_notify('job_chunks', public_id) FROM j");
    if (sql.is_oom) goto done;
    err = ERR_DB;
    if (!(res = exec_params(q, "appending chunks", sql.p, N_FIXED + PER_CHUNK * n, params,
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
    buf_free(&sql);
    buf_free(&arrays);
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

// Run sql, a statement on one running job of ours returning one row when it applied:
// $1 the job id, $2 our epoch, $3.. extra[0..n_extra). ERR_NOTFOUND (logged) when the job
// is no longer ours.
static Err exec_owned(JobQueue *q, const JobqJob *job, const char *what, const char *sql,
                      const char *const *extra, int n_extra)
{
    char id_text[24];
    const char *params[5] = {id_text, q->epoch_text};
    ASSERT(n_extra <= 3);
    for (int i = 0; i < n_extra; i++) params[2 + i] = extra[i];
    snprintf(id_text, sizeof id_text, "%lld", (long long) job->id);
    PGresult *res = exec_params(q, what, sql, 2 + n_extra, params, PGRES_TUPLES_OK);
    if (!res) return ERR_DB;
    const Err err = PQntuples(res) == 1 ? ERR_OK : ERR_NOTFOUND;
    if (err) LOG_WARN("jobq: %s %s: the job is not owned by epoch %s", what, job->public_id,
                      q->epoch_text);
    PQclear(res);
    return err;
}

// Move a running job of ours to a terminal state.
static Err end_job(JobQueue *q, const JobqJob *job, const char *state, const char *finish_reason,
                   const char *error)
{
    return exec_owned(q, job, "finishing job",
                      "WITH j AS (UPDATE jobs SET state = $3, finished_at = now(),"
                      " finish_reason = $4, error = $5, lease_until = NULL"
                      " WHERE id = $1::bigint AND state = 'running' AND lease_epoch = $2::bigint"
                      " RETURNING public_id)"
                      " SELECT pg_notify('job_chunks', public_id) FROM j",
                      (const char *const[]){state, finish_reason, error}, 3);
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
    settle(q);
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

// ---------------------------------------------------------------------------
// Batched output, release, engine status

// Append one element to a PostgreSQL array literal being built in b ("{" first, "}" at
// the end): a number, or a string quoted with \ and " escaped, or NULL for s == NULL.
static void add_array_number(Buf *b, long long x)
{
    buf_addf(b, "%s%lld", b->n > 1 ? "," : "", x);
}

static void add_array_string(Buf *b, const char *s)
{
    if (b->n > 1) buf_add(b, ",", 1);
    if (!s) {
        buf_add(b, "NULL", 4);
        return;
    }
    buf_add(b, "\"", 1);
    for (const char *p = s;;) {
        const size_t run = strcspn(p, "\\\"");
        buf_add(b, p, run);
        if (!p[run]) break;
        buf_add(b, "\\", 1);
        buf_add(b, p + run, 1);
        p += run + 1;
    }
    buf_add(b, "\"", 1);
}

// The batch statement, prepared once per connection. Every item's and chunk's fields go
// as parallel arrays, so the text never changes and the plan is cached: one UPDATE of
// the items' job rows (fencing: state running, our epoch, n_chunks equal to the item's
// next_seq, so a fenced item matches no row and the others go on; id = ANY keeps it an
// index scan however large jobs grows), feeding the INSERT of the chunks of the rows it
// matched and one NOTIFY per job that got output or ended.
#define BATCH_STMT "jobq_append_batch"
static const char batch_sql[] =
    "WITH v AS (SELECT * FROM unnest($3::bigint[], $4::int[], $5::int[], $6::int[], $7::text[],"
    "   $8::text[], $15::int[]) AS v (id, seq, n, ntok, fin, err, nc)),"
    " j AS (UPDATE jobs SET n_chunks = jobs.n_chunks + v.n,"
    "   n_cached_tokens = CASE WHEN v.nc >= 0 THEN v.nc ELSE jobs.n_cached_tokens END,"
    "   n_completion_tokens = jobs.n_completion_tokens + v.ntok,"
    "   first_token_at = CASE WHEN v.n > 0 THEN coalesce(jobs.first_token_at, now())"
    "     ELSE jobs.first_token_at END,"
    "   heartbeat_at = now(),"
    "   state = CASE WHEN v.err IS NOT NULL THEN 'failed' WHEN v.fin = 'cancelled' THEN 'cancelled'"
    "     WHEN v.fin IS NOT NULL THEN 'succeeded' ELSE jobs.state END,"
    "   finished_at = CASE WHEN v.err IS NOT NULL OR v.fin IS NOT NULL THEN now() END,"
    "   finish_reason = CASE WHEN v.err IS NOT NULL THEN 'error'"
    "     ELSE coalesce(v.fin, jobs.finish_reason) END,"
    "   error = coalesce(v.err, jobs.error),"
    "   lease_until = CASE WHEN v.err IS NOT NULL OR v.fin IS NOT NULL THEN NULL"
    "     WHEN jobs.lease_until > now() + $2::int * interval '0.75 second' THEN jobs.lease_until"
    "     ELSE now() + $2::int * interval '1 second' END"
    "  FROM v WHERE jobs.id = ANY ($3::bigint[]) AND jobs.id = v.id AND jobs.state = 'running'"
    "   AND jobs.lease_epoch = $1::bigint AND jobs.n_chunks = v.seq"
    "  RETURNING jobs.id, jobs.public_id, jobs.cancel_requested, jobs.attempt,"
    "   (v.n > 0 OR v.fin IS NOT NULL OR v.err IS NOT NULL) AS wake),"
    " ins AS (INSERT INTO job_chunks (job_id, seq, attempt, kind, text, token_ids, logprobs)"
    "  SELECT j.id, c.seq, j.attempt, c.kind, c.text, c.ids::int[], c.lp::jsonb"
    "  FROM j JOIN unnest($9::bigint[], $10::int[], $11::text[], $12::text[], $13::text[],"
    "   $14::text[]) AS c (job_id, seq, kind, text, ids, lp) ON c.job_id = j.id)"
    " SELECT id, cancel_requested, CASE WHEN wake THEN pg_notify('job_chunks', public_id) END"
    " FROM j";

enum {
    B_ID, B_SEQ, B_N, B_NTOK, B_FIN, B_ERR,           // per item
    C_JOB, C_SEQ, C_KIND, C_TEXT, C_IDS, C_LP,        // per chunk
    B_NCACHED,                                        // per item ($15)
    N_BATCH_ARRAYS
};

// Fill the 13 array parameters for items[0..n).
static Err build_batch_arrays(const JobqAppend *items, int n, Buf a[N_BATCH_ARRAYS])
{
    Buf ids = {0};
    for (int k = 0; k < N_BATCH_ARRAYS; k++) buf_add(&a[k], "{", 1);
    for (int i = 0; i < n; i++) {
        const JobqAppend *it = &items[i];
        int n_tok = 0;
        for (int k = 0; k < it->n_chunks; k++) {
            const JobqChunk *ch = &it->chunks[k];
            n_tok += ch->n_tokens;
            buf_clear(&ids);
            buf_add_ids(&ids, ch->token_ids, (size_t) ch->n_tokens);
            add_array_number(&a[C_JOB], (long long) it->job->id);
            add_array_number(&a[C_SEQ], it->job->next_seq + k);
            add_array_string(&a[C_KIND], kind_names[ch->kind]);
            add_array_string(&a[C_TEXT], ch->text ? ch->text : "");
            add_array_string(&a[C_IDS], ids.is_oom ? NULL : ids.p);
            add_array_string(&a[C_LP], ch->logprobs_json);
        }
        add_array_number(&a[B_ID], (long long) it->job->id);
        add_array_number(&a[B_SEQ], it->job->next_seq);
        add_array_number(&a[B_N], it->n_chunks);
        add_array_number(&a[B_NTOK], n_tok);
        add_array_string(&a[B_FIN], it->error ? NULL : it->finish_reason);
        add_array_string(&a[B_ERR], it->error);
        add_array_number(&a[B_NCACHED], it->n_cached);
    }
    buf_free(&ids);
    bool is_oom = ids.is_oom;
    for (int k = 0; k < N_BATCH_ARRAYS; k++) {
        buf_add(&a[k], "}", 1);
        is_oom |= a[k].is_oom;
    }
    return is_oom ? ERR_NOMEM : ERR_OK;
}

// ERR_INVAL (logged) unless every item names a job once and its chunks are well formed.
static Err check_batch(const JobqAppend *items, int n)
{
    for (int i = 0; i < n; i++) {
        const JobqAppend *it = &items[i];
        bool is_bad = !it->job || it->n_chunks < 0 || it->n_chunks > 64
                      || (it->n_chunks > 0 && !it->chunks);
        for (int k = 0; !is_bad && k < it->n_chunks; k++) {
            const JobqChunk *ch = &it->chunks[k];
            is_bad = ch->n_tokens < 0 || (ch->n_tokens > 0 && !ch->token_ids)
                     || (int) ch->kind < 0 || (int) ch->kind > (int) JOBQ_CHUNK_TOOL;
        }
        for (int k = 0; !is_bad && k < i; k++) is_bad = items[k].job->id == it->job->id;
        if (is_bad) {
            LOG_ERROR("jobq: batch item %d is malformed (no job, a job twice, or bad chunks)", i);
            return ERR_INVAL;
        }
    }
    return ERR_OK;
}

Err jobq_append_send(JobQueue *q, JobqAppend *items, int n)
{
    ASSERT(!q->pend_items);  // the caller collects each batch before sending the next
    if (n <= 0) return ERR_OK;
    settle(q);
    Err err = check_batch(items, n);
    if (err) return err;
    Buf a[N_BATCH_ARRAYS] = {{0}};
    if ((err = build_batch_arrays(items, n, a))) goto done;
    err = ERR_DB;
    if (!q->is_batch_prepared) {
        PGresult *res = PQprepare(q->conn, BATCH_STMT, batch_sql, 0, NULL);
        const bool ok = PQresultStatus(res) == PGRES_COMMAND_OK;
        PQclear(res);
        if (!ok) {
            LOG_ERROR("jobq: preparing the batch statement failed: %s", PQerrorMessage(q->conn));
            goto done;
        }
        q->is_batch_prepared = true;
    }
    const char *params[2 + N_BATCH_ARRAYS] = {q->epoch_text, q->lease_text};
    for (int k = 0; k < N_BATCH_ARRAYS; k++) params[2 + k] = a[k].p;
    // Blocking mode: the whole statement is on its way (libpq copied the parameters) when
    // this returns, so the arrays can go; the server commits it whether or not we read on.
    if (!PQsendQueryPrepared(q->conn, BATCH_STMT, 2 + N_BATCH_ARRAYS, params, NULL, NULL, 0)) {
        LOG_ERROR("jobq: sending a batch of %d jobs failed: %s", n, PQerrorMessage(q->conn));
        goto done;
    }
    q->pend_items = items;
    q->pend_n = n;
    q->is_sent = true;
    err = ERR_OK;
done:
    for (int k = 0; k < N_BATCH_ARRAYS; k++) buf_free(&a[k]);
    return err;
}

// Read the answer of a sent batch into its items (results, is_cancelled, next_seq) and
// pend_err; a no-op when nothing is in flight. Every other use of the connection settles
// first, so a batch can be in flight across any call.
static void settle(JobQueue *q)
{
    if (!q->is_sent) return;
    q->is_sent = false;
    JobqAppend *items = q->pend_items;
    const int n = q->pend_n;
    for (int i = 0; i < n; i++) {
        items[i].result = ERR_NOTFOUND;
        items[i].is_cancelled = false;
    }
    q->pend_err = ERR_DB;
    PGresult *res;
    bool is_first = true;
    while ((res = PQgetResult(q->conn))) {  // one result, then NULL (or errors)
        if (is_first && PQresultStatus(res) == PGRES_TUPLES_OK) {
            q->pend_err = ERR_OK;
            const int n_rows = PQntuples(res);
            for (int r = 0; r < n_rows; r++) {
                const int64_t id = strtoll(PQgetvalue(res, r, 0), NULL, 10);
                for (int i = 0; i < n; i++)
                    if (items[i].job->id == id) {
                        items[i].result = ERR_OK;
                        items[i].is_cancelled = PQgetvalue(res, r, 1)[0] == 't';
                        items[i].job->next_seq += items[i].n_chunks;
                        break;
                    }
            }
        } else if (PQresultStatus(res) != PGRES_TUPLES_OK) {
            q->pend_err = ERR_DB;
        }
        is_first = false;
        PQclear(res);
    }
    if (q->pend_err) {
        LOG_ERROR("jobq: appending a batch of %d jobs failed: %s", n, PQerrorMessage(q->conn));
        return;
    }
    for (int i = 0; i < n; i++)
        if (items[i].result)
            LOG_WARN("jobq: job %s is no longer owned by epoch %s; dropping its output",
                     items[i].job->public_id, q->epoch_text);
}

Err jobq_append_finish(JobQueue *q)
{
    if (!q->pend_items) return ERR_OK;
    settle(q);
    q->pend_items = NULL;
    q->pend_n = 0;
    return q->pend_err;
}

Err jobq_append_batch(JobQueue *q, JobqAppend *items, int n)
{
    const Err err = jobq_append_send(q, items, n);
    return err ? err : jobq_append_finish(q);
}

Err jobq_release(JobQueue *q, const JobqJob *job)
{
    const Err err = exec_owned(q, job, "releasing job",
                               "UPDATE jobs SET state = 'queued', lease_epoch = NULL,"
                               " lease_until = NULL WHERE id = $1::bigint AND state = 'running'"
                               " AND lease_epoch = $2::bigint RETURNING public_id",
                               NULL, 0);
    if (err) return err;
    LOG_INFO("jobq: released job %s after %d chunks", job->public_id, job->next_seq);
    PQclear(PQexec(q->conn, "NOTIFY jobs_new"));  // the doorbell for claimers, after the commit
    return ERR_OK;
}

Err jobq_set_stats(JobQueue *q, const char *stats_json)
{
    PGresult *res = exec_params(
        q, "publishing engine stats",
        "UPDATE engines SET stats = $2::jsonb, heartbeat_at = now() WHERE id = $1::bigint",
        2, (const char *const[]){q->epoch_text, stats_json}, PGRES_COMMAND_OK);
    if (!res) return ERR_DB;
    PQclear(res);
    return ERR_OK;
}
