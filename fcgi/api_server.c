/*
 * api_server.c - routing and handlers of the HTTP API (route list in api_server.h).
 *
 * Every generating request becomes a job row first; the answer, streamed or not, is then
 * read back from job_chunks. So a chat completion and GET /v1/jobs/{id}/events share one
 * reader loop (stream_job): read chunks with seq > last, and when there are none, check
 * the job's state and wait for the engine's NOTIFY or the poll timer. A client sees only
 * committed output, which is why a reconnect with Last-Event-ID resumes exactly.
 *
 * Limits are checked in the enqueue transaction, after locking the key's row so that
 * concurrent requests of one key are serialized: max_concurrent (unfinished jobs) and rpm
 * (job-creating requests in the last minute) give 429 with Retry-After; a full queue 503.
 */
#include "fcgi/api_server.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/shared/apikey.h"
#include "engine/shared/buf.h"
#include "engine/shared/clock.h"
#include "fcgi/api_http.h"
#include "fcgi/api_metrics.h"
#include "fcgi/api_request.h"

typedef struct Ctx {
    FCGX_Request *req;
    ApiDb *db;
    const ApiConfig *cfg;
    const ApiModel *model;  // the request's model (generate routes)
    char model_name[128];   // the model named in output envelopes (the request's or job's)
    const char *method;
    char path[256];
    const char *query;
    ApiKey key;
    bool is_broken;  // a write failed: the client is gone
} Ctx;

// ---------------------------------------------------------------------------
// Output

static void put(Ctx *c, const char *s, size_t n)
{
    if (c->is_broken) return;
    if (FCGX_PutStr(s, (int) n, c->req->out) != (int) n) c->is_broken = true;
}

// Formatted output of any length: short text (SSE ids, status lines) is formatted on the
// stack, anything longer in a Buf, so nothing is ever cut. A formatting or memory
// failure is logged and ends the response: a half-formatted line must not go out.
static void putf(Ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(Ctx *c, const char *fmt, ...)
{
    char small[256];
    Buf b = {0};
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    Err err = n < 0 ? ERR_INVAL : ERR_OK;
    const bool is_small = !err && (size_t) n < sizeof small;
    if (!err && !is_small) {
        va_start(ap, fmt);
        err = buf_vaddf(&b, fmt, ap);
        va_end(ap);
    }
    if (err) {
        LOG_ERROR("api: could not format a response line: %s", err_name(err));
        c->is_broken = true;
    } else {
        put(c, is_small ? small : b.p, is_small ? (size_t) n : b.n);
    }
    buf_free(&b);
}

static void flush(Ctx *c)
{
    if (!c->is_broken && FCGX_FFlush(c->req->out) != 0) c->is_broken = true;
}

static const char *json_text(json_object *o)
{
    return json_object_to_json_string_ext(o,
                                          JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE);
}

// Send status + JSON body; takes ownership of body. extra: more header lines (made with
// api_http_add_header), or NULL.
static void send_json(Ctx *c, int status, json_object *body, const Buf *extra)
{
    const char *text = json_text(body);
    putf(c, "Status: %d %s\r\nContent-Type: application/json\r\nCache-Control: no-store\r\n%s\r\n",
         status, api_http_reason_phrase(status), extra && extra->p ? extra->p : "");
    put(c, text, strlen(text));
    put(c, "\n", 1);
    json_object_put(body);
}

static json_object *error_object(const ApiError *e)
{
    json_object *o = json_object_new_object(), *inner = json_object_new_object();
    json_object_object_add(inner, "message", json_object_new_string(e->message));
    json_object_object_add(inner, "type",
                           json_object_new_string(e->type ? e->type : "invalid_request_error"));
    json_object_object_add(inner, "param", e->param[0] ? json_object_new_string(e->param) : NULL);
    json_object_object_add(inner, "code", e->code ? json_object_new_string(e->code) : NULL);
    json_object_object_add(o, "error", inner);
    return o;
}

static void send_error(Ctx *c, const ApiError *e, int retry_after_s)
{
    Buf extra = {0};
    Err err = ERR_OK;
    if (retry_after_s > 0) err = buf_addf(&extra, "Retry-After: %d\r\n", retry_after_s);
    if (!err && e->status == 401) err = api_http_add_header(&extra, "WWW-Authenticate", "Bearer");
    if (err)
        LOG_ERROR("api: could not add the headers of a %d answer: %s", e->status, err_name(err));
    send_json(c, e->status, error_object(e), &extra);
    buf_free(&extra);
}

static void fail(Ctx *c, int status, const char *type, const char *code, const char *param,
                 const char *msg)
{
    ApiError e;
    api_error_set(&e, status, type, code, param, "%s", msg);
    send_error(c, &e, 0);
}

static void fail_db(Ctx *c)
{
    fail(c, 503, "server_error", "database_unavailable", NULL,
         "the job database is unavailable; retry shortly");
}

static void fail_oom(Ctx *c)
{
    fail(c, 500, "server_error", NULL, NULL, "out of memory");
}

// ---------------------------------------------------------------------------
// Request helpers

static const char *param(const Ctx *c, const char *name)
{
    return FCGX_GetParam(name, c->req->envp);
}

// Read the body into a new NUL-terminated string; NULL after answering 413/400.
static char *read_body(Ctx *c, size_t *n_out)
{
    const char *cl = param(c, "CONTENT_LENGTH");
    const long long len = cl && *cl ? atoll(cl) : 0;
    if (len <= 0) {
        fail(c, 400, NULL, NULL, NULL, "the request needs a JSON body");
        return NULL;
    }
    if ((unsigned long long) len > c->cfg->max_body_bytes) {
        fail(c, 413, NULL, "request_too_large", NULL, "the request body is too large");
        return NULL;
    }
    char *body = malloc((size_t) len + 1);
    if (!body) {
        fail_oom(c);
        return NULL;
    }
    size_t got = 0;
    while (got < (size_t) len) {
        const int r = FCGX_GetStr(body + got, (int) ((size_t) len - got), c->req->in);
        if (r <= 0) break;
        got += (size_t) r;
    }
    if (got != (size_t) len) {
        free(body);
        fail(c, 400, NULL, NULL, NULL, "the request body ended early");
        return NULL;
    }
    body[got] = '\0';
    *n_out = got;
    return body;
}

// Identify the caller by the key it presents (Authorization: Bearer, or X-Api-Key), on
// every request. FastCGI parameters never carry identity: anything that can connect to
// the socket can set them (GLMSPARK_KEY_ID and friends, which nginx used to pass, are
// ignored). Behind nginx the auth_request subrequest has just verified the same key, so
// this is a hit in the process's auth cache. false after answering 401/503.
static bool authenticate(Ctx *c)
{
    const char *key =
        api_http_bearer_key(param(c, "HTTP_AUTHORIZATION"), param(c, "HTTP_X_API_KEY"));
    if (!key) {
        fail(c, 401, "invalid_request_error", "missing_api_key", NULL,
             "no API key: send it as \"Authorization: Bearer <key>\"");
        return false;
    }
    const Err err = api_db_auth(c->db, key, strlen(key), &c->key);
    if (err == ERR_DB) {
        fail_db(c);
        return false;
    }
    if (err) {
        fail(c, 401, "invalid_request_error", "invalid_api_key", NULL,
             "invalid or revoked API key");
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------
// Jobs: enqueue

typedef struct NewJob {
    int64_t id;
    char public_id[64];
    long long created;
    int n_prompt;
    int max_tokens;
} NewJob;

static PGresult *tx(ApiDb *db, const char *sql, int n, const char *const *params,
                    ExecStatusType want)
{
    PGresult *res = PQexecParams(db->conn, sql, n, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) == want) return res;
    LOG_ERROR("api: enqueue statement failed: %s", PQerrorMessage(db->conn));
    api_db_note_failure(db, res);  // a read-only session: the next request reconnects
    PQclear(res);
    return NULL;
}

// The job that an earlier request with this Idempotency-Key made, read in the open
// transaction (each statement sees what committed before it). ERR_OK with *job filled,
// ERR_NOTFOUND when there is none, ERR_DB when the statement failed (logged by tx).
static Err find_idem_job(Ctx *c, const char *key_id, const char *idem, NewJob *job)
{
    PGresult *res = tx(c->db,
                       "SELECT id, public_id, extract(epoch FROM created_at)::bigint,"
                       " n_prompt_tokens, max_tokens FROM jobs"
                       " WHERE api_key_id = $1::bigint AND idem_key = $2",
                       2, (const char *const[]){key_id, idem}, PGRES_TUPLES_OK);
    if (!res) return ERR_DB;
    const Err err = PQntuples(res) == 1 ? ERR_OK : ERR_NOTFOUND;
    if (!err) {
        job->id = atoll(PQgetvalue(res, 0, 0));
        snprintf(job->public_id, sizeof job->public_id, "%s", PQgetvalue(res, 0, 1));
        job->created = atoll(PQgetvalue(res, 0, 2));
        job->n_prompt = atoi(PQgetvalue(res, 0, 3));
        job->max_tokens = atoi(PQgetvalue(res, 0, 4));
    }
    PQclear(res);
    return err;
}

// Render, tokenize, check the context, insert. false after answering the client.
static bool enqueue(Ctx *c, const ApiRequest *r, NewJob *job)
{
    const ApiModel *model = c->model;
    char *prompt = NULL;
    Buf ids_text = {0};
    size_t n_prompt_bytes = 0;
    TokIds ids = {0};
    json_object *params = NULL;
    bool ok = false, in_tx = false;
    ApiError e;
    int retry_after = 0;
    memset(&e, 0, sizeof e);

    bool in_reasoning = false;
    if (r->kind == API_KIND_CHAT) {
        ChatError cerr;
        ChatOptions opts;
        const Err err = chat_render_request(r->root, model->chat_template, &prompt, &n_prompt_bytes,
                                            &opts, &cerr);
        if (err == ERR_INVAL) {
            api_error_set(&e, 400, NULL, NULL, NULL, "%s", cerr.msg);
            goto done;
        }
        if (err) {
            api_error_set(&e, 500, "server_error", NULL, NULL, "could not render the prompt");
            goto done;
        }
        in_reasoning = chat_prompt_opens_reasoning(prompt, n_prompt_bytes);
        if (tok_encode(model->tok, prompt, n_prompt_bytes, false, &ids)) {
            api_error_set(&e, 500, "server_error", NULL, NULL, "could not tokenize the prompt");
            goto done;
        }
    } else if (tok_encode(model->tok, r->prompt, r->n_prompt, true, &ids)) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "could not tokenize the prompt");
        goto done;
    }
    if (ids.n == 0) {
        api_error_set(&e, 400, NULL, NULL, "prompt", "the prompt is empty");
        goto done;
    }
    job->n_prompt = (int) ids.n;
    if ((long long) ids.n + (r->max_tokens ? r->max_tokens : 1) > model->context_len) {
        api_error_set(&e, 400, NULL, "context_length_exceeded",
                      r->kind == API_KIND_CHAT ? "messages" : "prompt",
                      "This model's maximum context length is %d tokens. However, you requested "
                      "%lld tokens (%zu in the prompt, %d for the completion).",
                      model->context_len, (long long) ids.n + (r->max_tokens ? r->max_tokens : 0),
                      ids.n, r->max_tokens);
        goto done;
    }
    job->max_tokens = r->max_tokens ? r->max_tokens : model->context_len - (int) ids.n;

    // Prompt ids as a PostgreSQL array literal.
    if (buf_add_ids(&ids_text, ids.ids, ids.n)) goto oom;
    if (!(params = api_request_params(r))) goto oom;
    json_object_object_add(params, "stream", json_object_new_boolean(r->stream));
    json_object_object_add(params, "in_reasoning", json_object_new_boolean(in_reasoning));

    char key_id[24], n_prompt_text[16], max_tokens_text[16], limit_text[16];
    snprintf(key_id, sizeof key_id, "%lld", (long long) c->key.id);
    snprintf(n_prompt_text, sizeof n_prompt_text, "%d", job->n_prompt);
    snprintf(max_tokens_text, sizeof max_tokens_text, "%d", job->max_tokens);
    const char *idem = param(c, "HTTP_IDEMPOTENCY_KEY");
    if (idem && (!*idem || strlen(idem) > 255)) idem = NULL;

    // BEGIN is where a connection that died while idle (a database restart) shows up:
    // nothing has happened yet, so reconnect and try once more.
    PGresult *res = NULL;
    for (int attempt = 0; attempt < 2 && !res; attempt++) {
        if (api_db_ensure(c->db)) goto db_down;
        res = tx(c->db, "BEGIN", 0, NULL, PGRES_COMMAND_OK);
    }
    if (!res) goto db_down;
    PQclear(res);
    in_tx = true;
    // With limits, lock the key's row: it serializes this key's enqueues so that the counts
    // below are exact. Without, a share lock only keeps the key from being revoked under us.
    const bool has_limits = c->key.max_concurrent > 0 || c->key.rpm > 0;
    if (!(res = tx(c->db,
                   has_limits ? "SELECT 1 FROM api_keys WHERE id = $1::bigint"
                                " AND revoked_at IS NULL FOR UPDATE"
                              : "SELECT 1 FROM api_keys WHERE id = $1::bigint"
                                " AND revoked_at IS NULL FOR SHARE",
                   1, (const char *const[]){key_id}, PGRES_TUPLES_OK)))
        goto db_down;
    const bool active = PQntuples(res) == 1;
    PQclear(res);
    if (!active) {
        api_error_set(&e, 401, NULL, "invalid_api_key", NULL, "invalid or revoked API key");
        goto done;
    }
    if (idem) {  // a retry of a request we already accepted gets that request's job
        const Err err = find_idem_job(c, key_id, idem, job);
        if (err == ERR_DB) goto db_down;
        if (!err) goto commit;
    }
    if (c->key.max_concurrent > 0) {
        if (!(res = tx(c->db,
                       "SELECT count(*) FROM jobs WHERE api_key_id = $1::bigint"
                       " AND finished_at IS NULL",
                       1, (const char *const[]){key_id}, PGRES_TUPLES_OK)))
            goto db_down;
        const int n = atoi(PQgetvalue(res, 0, 0));
        PQclear(res);
        if (n >= c->key.max_concurrent) {
            api_error_set(&e, 429, "rate_limit_error", "concurrency_limit_exceeded", NULL,
                          "this key already has %d unfinished jobs (limit %d)", n,
                          c->key.max_concurrent);
            retry_after = 1;
            goto done;
        }
    }
    if (c->key.rpm > 0) {
        if (!(res = tx(c->db,
                       "SELECT count(*), coalesce(ceil(extract(epoch FROM"
                       " min(at) + interval '1 minute' - now())), 1)::int FROM key_requests"
                       " WHERE api_key_id = $1::bigint AND at > now() - interval '1 minute'",
                       1, (const char *const[]){key_id}, PGRES_TUPLES_OK)))
            goto db_down;
        const int n = atoi(PQgetvalue(res, 0, 0)), wait_s = atoi(PQgetvalue(res, 0, 1));
        PQclear(res);
        if (n >= c->key.rpm) {
            api_error_set(&e, 429, "rate_limit_error", "rate_limit_exceeded", NULL,
                          "this key is limited to %d requests per minute", c->key.rpm);
            retry_after = wait_s > 0 ? wait_s : 1;
            goto done;
        }
        if (!(res = tx(c->db,
                       "WITH d AS (DELETE FROM key_requests WHERE api_key_id = $1::bigint"
                       " AND at < now() - interval '2 minutes')"
                       " INSERT INTO key_requests (api_key_id) VALUES ($1::bigint)",
                       1, (const char *const[]){key_id}, PGRES_COMMAND_OK)))
            goto db_down;
        PQclear(res);
    }
    if (c->cfg->max_queue > 0) {
        snprintf(limit_text, sizeof limit_text, "%d", c->cfg->max_queue);
        if (!(res = tx(c->db,
                       "SELECT count(*) >= $1::int FROM (SELECT 1 FROM jobs"
                       " WHERE state = 'queued' LIMIT $1::int) q",
                       1, (const char *const[]){limit_text}, PGRES_TUPLES_OK)))
            goto db_down;
        const bool full = PQgetvalue(res, 0, 0)[0] == 't';
        PQclear(res);
        if (full) {
            api_error_set(&e, 503, "server_error", "queue_full", NULL,
                          "the queue is full; retry later");
            retry_after = 5;
            goto done;
        }
    }
    // The caller's input (messages or prompt) is kept so that GET /v1/jobs/{id} can show it.
    json_object *input = r->kind == API_KIND_CHAT
                             ? json_object_get(r->messages)
                             : json_object_new_string_len(r->prompt, (int) r->n_prompt);
    char *input_text = input ? strdup(json_text(input)) : NULL;
    json_object_put(input);
    if (!input_text) goto oom;
    res = tx(c->db,
             "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids, n_prompt_tokens,"
             " max_tokens, idem_key, input) VALUES ($1::bigint, $2, $3, $4::jsonb, $5::int[],"
             " $6::int, $7::int, $8, $9::jsonb)"
             " ON CONFLICT (api_key_id, idem_key) WHERE idem_key IS NOT NULL DO NOTHING"
             " RETURNING id, public_id, extract(epoch FROM created_at)::bigint",
             9,
             (const char *const[]){key_id, r->kind == API_KIND_CHAT ? "chat" : "completion",
                                   model->name, json_text(params), ids_text.p, n_prompt_text,
                                   max_tokens_text, idem, input_text},
             PGRES_TUPLES_OK);
    free(input_text);
    if (!res) goto db_down;
    if (PQntuples(res) == 0) {
        // Only a key without limits gets here concurrently (a key with limits holds its row
        // FOR UPDATE): a request with the same Idempotency-Key inserted first. ON CONFLICT
        // waited for it to commit and inserted nothing; its job is this request's answer.
        PQclear(res);
        const Err err = find_idem_job(c, key_id, idem ? idem : "", job);
        if (err == ERR_DB) goto db_down;
        if (err) {
            LOG_ERROR("api: key %s: no job for Idempotency-Key after a conflict", c->key.prefix);
            goto db_down;
        }
        goto commit;
    }
    job->id = atoll(PQgetvalue(res, 0, 0));
    snprintf(job->public_id, sizeof job->public_id, "%s", PQgetvalue(res, 0, 1));
    job->created = atoll(PQgetvalue(res, 0, 2));
    PQclear(res);
commit:
    if (!(res = tx(c->db, "COMMIT", 0, NULL, PGRES_COMMAND_OK))) goto db_down;
    PQclear(res);
    in_tx = false;
    // The doorbell goes after the commit, in its own statement: a NOTIFY inside the
    // transaction would hold PostgreSQL's database-wide notify lock across the commit's WAL
    // flush and serialize every enqueue (and every engine append) behind it.
    res = PQexec(c->db->conn, "NOTIFY jobs_new");
    if (PQresultStatus(res) != PGRES_COMMAND_OK)  // committed anyway; the engine's poll finds it
        LOG_WARN("api: could not notify jobs_new for job %s: %s", job->public_id,
                 PQerrorMessage(c->db->conn));
    PQclear(res);
    LOG_INFO("api: key %s queued job %s (%d prompt tokens, max %d)", c->key.prefix, job->public_id,
             job->n_prompt, job->max_tokens);
    ok = true;
    goto done;
oom:
    api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
    goto done;
db_down:
    api_error_set(&e, 503, "server_error", "database_unavailable", NULL,
                  "the job database is unavailable; retry shortly");
    retry_after = 1;
done:
    if (in_tx) {
        // A failed ROLLBACK means the connection is gone, which ends the transaction too.
        PGresult *rb = PQexec(c->db->conn, "ROLLBACK");
        if (PQresultStatus(rb) != PGRES_COMMAND_OK)
            LOG_WARN("api: could not roll back an enqueue: %s", PQerrorMessage(c->db->conn));
        PQclear(rb);
    }
    if (!ok) send_error(c, &e, retry_after);
    json_object_put(params);
    buf_free(&ids_text);
    free(prompt);
    tok_ids_free(&ids);
    return ok;
}

// ---------------------------------------------------------------------------
// Jobs: reading

typedef struct JobState {
    char state[16];
    char finish_reason[32];
    char error[512];
    int n_prompt, n_completion, n_chunks, n_cached;
    bool is_terminal;
} JobState;

// The job's state. ERR_NOTFOUND when the row is gone, ERR_DB when the read failed.
static Err read_state(Ctx *c, int64_t id, JobState *st)
{
    char id_text[24];
    snprintf(id_text, sizeof id_text, "%lld", (long long) id);
    PGresult *res = api_db_exec(c->db,
                                "SELECT state, coalesce(finish_reason, ''), coalesce(error, ''),"
                                " n_prompt_tokens, n_completion_tokens, n_chunks, n_cached_tokens"
                                " FROM jobs WHERE id = $1::bigint",
                                1, (const char *const[]){id_text}, PGRES_TUPLES_OK);
    if (!res) return ERR_DB;
    if (PQntuples(res) != 1) {
        PQclear(res);
        return ERR_NOTFOUND;
    }
    snprintf(st->state, sizeof st->state, "%s", PQgetvalue(res, 0, 0));
    snprintf(st->finish_reason, sizeof st->finish_reason, "%s", PQgetvalue(res, 0, 1));
    snprintf(st->error, sizeof st->error, "%s", PQgetvalue(res, 0, 2));
    st->n_prompt = atoi(PQgetvalue(res, 0, 3));
    st->n_completion = atoi(PQgetvalue(res, 0, 4));
    st->n_chunks = atoi(PQgetvalue(res, 0, 5));
    st->n_cached = atoi(PQgetvalue(res, 0, 6));
    st->is_terminal = !strcmp(st->state, "succeeded") || !strcmp(st->state, "failed")
                      || !strcmp(st->state, "cancelled");
    PQclear(res);
    return ERR_OK;
}

// Ask the engine to stop a job (a queued one is cancelled at once). true if found.
static bool cancel_job(ApiDb *db, int64_t id)
{
    char id_text[24];
    snprintf(id_text, sizeof id_text, "%lld", (long long) id);
    PGresult *res = api_db_exec(
        db,
        "WITH j AS (UPDATE jobs SET cancel_requested = true,"
        "  state = CASE WHEN state = 'queued' THEN 'cancelled' ELSE state END,"
        "  finish_reason = CASE WHEN state = 'queued' THEN 'cancelled' ELSE finish_reason END,"
        "  finished_at = CASE WHEN state = 'queued' THEN now() ELSE finished_at END"
        "  WHERE id = $1::bigint RETURNING public_id)"
        " SELECT pg_notify('job_chunks', public_id) FROM j",
        1, (const char *const[]){id_text}, PGRES_TUPLES_OK);
    const bool found = res && PQntuples(res) == 1;
    PQclear(res);
    return found;
}

typedef enum StreamMode {
    MODE_COLLECT,         // gather the output for a non-streamed answer
    MODE_CHAT_SSE,        // chat.completion.chunk events
    MODE_COMPLETION_SSE,  // text_completion events
    MODE_EVENTS_SSE,      // /v1/jobs/{id}/events
} StreamMode;

typedef struct Collected {
    Buf content, reasoning;
    json_object *tool_calls;  // array or NULL
    json_object *logprobs;    // array of per-token entries (chat shape), or NULL
} Collected;

// logprobs as the legacy completions API has them, from entries (chat shape: token,
// logprob, bytes, top_logprobs) of which the first starts at byte *offset of the text.
static json_object *legacy_logprobs(json_object *entries, int *offset)
{
    json_object *o = json_object_new_object(), *tokens = json_object_new_array(),
                *lps = json_object_new_array(), *tops = json_object_new_array(),
                *offs = json_object_new_array();
    for (size_t i = 0; entries && i < json_object_array_length(entries); i++) {
        json_object *en = json_object_array_get_idx(entries, i), *tok = NULL, *lp = NULL,
                    *top = NULL;
        json_object_object_get_ex(en, "token", &tok);
        json_object_object_get_ex(en, "logprob", &lp);
        json_object_object_get_ex(en, "top_logprobs", &top);
        json_object_array_add(tokens, json_object_get(tok));
        json_object_array_add(lps, json_object_get(lp));
        json_object *alt = json_object_new_object();
        for (size_t k = 0; top && k < json_object_array_length(top); k++) {
            json_object *a = json_object_array_get_idx(top, k), *at = NULL, *al = NULL;
            json_object_object_get_ex(a, "token", &at);
            json_object_object_get_ex(a, "logprob", &al);
            if (at) json_object_object_add(alt, json_object_get_string(at), json_object_get(al));
        }
        json_object_array_add(tops, alt);
        json_object_array_add(offs, json_object_new_int(*offset));
        *offset += tok ? json_object_get_string_len(tok) : 0;
    }
    json_object_object_add(o, "tokens", tokens);
    json_object_object_add(o, "token_logprobs", lps);
    json_object_object_add(o, "top_logprobs", tops);
    json_object_object_add(o, "text_offset", offs);
    return o;
}

// A choice's "logprobs": {"content": entries} for chat, the legacy object for completions.
// Takes a reference of entries; NULL when there are none.
static json_object *choice_logprobs(json_object *entries, bool is_chat, int *offset)
{
    if (!entries) return NULL;
    if (!is_chat) return legacy_logprobs(entries, offset);
    json_object *o = json_object_new_object();
    json_object_object_add(o, "content", json_object_get(entries));
    return o;
}

static json_object *usage_object(const JobState *st)
{
    json_object *u = json_object_new_object();
    json_object_object_add(u, "prompt_tokens", json_object_new_int(st->n_prompt));
    json_object_object_add(u, "completion_tokens", json_object_new_int(st->n_completion));
    json_object_object_add(u, "total_tokens", json_object_new_int(st->n_prompt + st->n_completion));
    // Prompt tokens whose KV the engine reused from its prefix cache (OpenAI's field).
    json_object *d = json_object_new_object();
    json_object_object_add(d, "cached_tokens", json_object_new_int(st->n_cached));
    json_object_object_add(u, "prompt_tokens_details", d);
    return u;
}

// A tool chunk's text is {"name": ..., "arguments": ...}; build the OpenAI tool call.
static json_object *tool_call_object(const char *job_id, int index, const char *text,
                                     bool with_index)
{
    json_object *src = json_tokener_parse(text), *name = NULL, *args = NULL;
    if (src) {
        json_object_object_get_ex(src, "name", &name);
        json_object_object_get_ex(src, "arguments", &args);
    }
    json_object *call = json_object_new_object(), *fn = json_object_new_object();
    char id[96];
    snprintf(id, sizeof id, "call_%s_%d", job_id, index);
    if (with_index) json_object_object_add(call, "index", json_object_new_int(index));
    json_object_object_add(call, "id", json_object_new_string(id));
    json_object_object_add(call, "type", json_object_new_string("function"));
    json_object_object_add(fn, "name",
                           json_object_new_string(name ? json_object_get_string(name) : ""));
    json_object_object_add(fn, "arguments",
                           json_object_new_string(!args ? "{}"
                                                  : json_object_is_type(args, json_type_string)
                                                      ? json_object_get_string(args)
                                                      : json_text(args)));
    json_object_object_add(call, "function", fn);
    json_object_put(src);
    return call;
}

static json_object *chunk_envelope(const Ctx *c, const char *job_id, long long created,
                                   bool is_chat)
{
    json_object *o = json_object_new_object();
    json_object_object_add(o, "id", json_object_new_string(job_id));
    json_object_object_add(
        o, "object", json_object_new_string(is_chat ? "chat.completion.chunk" : "text_completion"));
    json_object_object_add(o, "created", json_object_new_int64(created));
    json_object_object_add(o, "model", json_object_new_string(c->model_name));
    return o;
}

static void sse_data(Ctx *c, json_object *o)
{
    const char *t = json_text(o);
    put(c, "data: ", 6);
    put(c, t, strlen(t));
    put(c, "\n\n", 2);
    json_object_put(o);
}

// One choice delta event (chat) or text event (completion).
static void sse_delta(Ctx *c, const char *job_id, long long created, bool is_chat,
                      json_object *delta_or_text, const char *finish_reason, json_object *logprobs)
{
    json_object *o = chunk_envelope(c, job_id, created, is_chat),
                *choices = json_object_new_array(), *ch = json_object_new_object();
    json_object_object_add(ch, "index", json_object_new_int(0));
    json_object_object_add(ch, is_chat ? "delta" : "text", delta_or_text);
    json_object_object_add(ch, "logprobs", logprobs);
    json_object_object_add(ch, "finish_reason",
                           finish_reason ? json_object_new_string(finish_reason) : NULL);
    json_object_array_add(choices, ch);
    json_object_object_add(o, "choices", choices);
    sse_data(c, o);
}

static const char *client_finish_reason(const JobState *st, int n_tools)
{
    if (n_tools > 0 && !strcmp(st->finish_reason, "stop")) return "tool_calls";
    return st->finish_reason[0] ? st->finish_reason : "stop";
}

// The reader loop's state for one stream.
typedef struct Stream {
    StreamMode mode;
    const char *job_id;
    long long created;
    bool is_chat, want_lp;
    Collected *col;       // MODE_COLLECT only
    int last;             // seq of the last chunk handled
    int n_tools;          // tool chunks so far (their call index)
    int lp_offset;        // legacy completions: text_offset of the next token
    double last_write;    // when bytes last went out (events or keep-alive)
    double outage_since;  // first failed read of the current outage; 0 while reads work
} Stream;

// While the database is away a stream's reads reconnect for at most this long, and it
// waits at most until its next keep-alive, so keep-alives stay on time and a client that
// left is noticed at the next one.
enum { STREAM_RETRY_MS = 250 };

// Handle row i of a job_chunks read (seq, kind, text, logprobs). ERR_NOMEM when the
// collected output cannot grow (logged).
static Err stream_chunk(Ctx *c, Stream *s, PGresult *res, int i)
{
    const int seq = atoi(PQgetvalue(res, i, 0));
    const char *kind = PQgetvalue(res, i, 1), *text = PQgetvalue(res, i, 2);
    const size_t n_text = (size_t) PQgetlength(res, i, 2);
    Err err = ERR_OK;
    s->last = seq;
    json_object *lp = PQgetisnull(res, i, 3) ? NULL : json_tokener_parse(PQgetvalue(res, i, 3));
    if (s->mode == MODE_EVENTS_SSE) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "seq", json_object_new_int(seq));
        json_object_object_add(o, "kind", json_object_new_string(kind));
        json_object_object_add(o, "text", json_object_new_string_len(text, (int) n_text));
        if (lp) json_object_object_add(o, "logprobs", lp);
        putf(c, "id: %d\n", seq);
        sse_data(c, o);
        return ERR_OK;
    }
    if (!s->want_lp) {
        json_object_put(lp);
        lp = NULL;
    }
    Collected *col = s->col;
    if (s->mode == MODE_COLLECT && lp) {
        if (!col->logprobs) col->logprobs = json_object_new_array();
        for (size_t k = 0; k < json_object_array_length(lp); k++)
            json_object_array_add(col->logprobs, json_object_get(json_object_array_get_idx(lp, k)));
    }
    if (n_text == 0 && (!lp || s->mode == MODE_COLLECT)) {
        json_object_put(lp);
        return ERR_OK;
    }
    const bool is_tool = !strcmp(kind, "tool"), is_reasoning = !strcmp(kind, "reasoning");
    if (s->mode == MODE_COLLECT) {
        if (is_tool) {
            if (!col->tool_calls) col->tool_calls = json_object_new_array();
            json_object_array_add(col->tool_calls,
                                  tool_call_object(s->job_id, s->n_tools, text, false));
        } else if ((err = buf_add(is_reasoning ? &col->reasoning : &col->content, text, n_text))) {
            LOG_ERROR("api: out of memory collecting the output of job %s (%zu bytes so far)",
                      s->job_id, col->content.n + col->reasoning.n);
        }
    } else if (s->mode == MODE_CHAT_SSE) {
        json_object *d = json_object_new_object();
        if (is_tool) {
            json_object *calls = json_object_new_array();
            json_object_array_add(calls, tool_call_object(s->job_id, s->n_tools, text, true));
            json_object_object_add(d, "tool_calls", calls);
        } else if (is_reasoning) {
            json_object_object_add(d, "reasoning_content",
                                   json_object_new_string_len(text, (int) n_text));
            json_object_object_add(d, "reasoning", json_object_new_string_len(text, (int) n_text));
        } else {
            json_object_object_add(d, "content", json_object_new_string_len(text, (int) n_text));
        }
        sse_delta(c, s->job_id, s->created, true, d, NULL, choice_logprobs(lp, true, NULL));
    } else if (!is_reasoning && !is_tool) {
        sse_delta(c, s->job_id, s->created, false, json_object_new_string_len(text, (int) n_text),
                  NULL, choice_logprobs(lp, false, &s->lp_offset));
    }
    json_object_put(lp);
    s->n_tools += is_tool;
    return err;
}

// Send ": keep-alive" once the stream has been quiet for keepalive_s (SSE modes). false
// when the client is gone.
static bool stream_keepalive(Ctx *c, Stream *s)
{
    if (s->mode != MODE_COLLECT && clock_now_s() - s->last_write >= c->cfg->keepalive_s) {
        put(c, ": keep-alive\n\n", 14);
        flush(c);
        s->last_write = clock_now_s();
    }
    return !c->is_broken;
}

// A read failed: the database is away. Wait a step (never past the next keep-alive), then
// send the keep-alive if due. ERR_OK to read again, ERR_IO when the client left, ERR_DB
// once the outage has lasted stream_outage_s (logged).
static Err stream_outage(Ctx *c, Stream *s)
{
    const double t = clock_now_s();
    if (s->outage_since == 0) {
        s->outage_since = t;
        LOG_WARN("api: stream of job %s: the database is unavailable; retrying", s->job_id);
    }
    if (t - s->outage_since >= c->cfg->stream_outage_s) {
        LOG_ERROR("api: stream of job %s: the database was unavailable for %d s; giving up",
                  s->job_id, c->cfg->stream_outage_s);
        return ERR_DB;
    }
    double wait_s = c->cfg->poll_ms / 1000.0;
    if (s->mode != MODE_COLLECT && s->last_write + c->cfg->keepalive_s - t < wait_s)
        wait_s = s->last_write + c->cfg->keepalive_s - t;
    if (wait_s > 0) api_db_wait(c->db, s->job_id, (int) (wait_s * 1000) + 1);
    return stream_keepalive(c, s) ? ERR_OK : ERR_IO;
}

// The events after the last chunk: the end event, usage, [DONE]; for a stream that gave up
// on the database (gave_up), an error event and [DONE] instead.
static void stream_end(Ctx *c, const Stream *s, const ApiRequest *r, const JobState *st,
                       bool gave_up)
{
    const char *fr = client_finish_reason(st, s->n_tools);
    if (s->mode == MODE_COLLECT) return;
    if (gave_up) {
        ApiError e;
        api_error_set(&e, 503, "server_error", "database_unavailable", NULL,
                      "the job database was unavailable for %d s; reconnect to "
                      "/v1/jobs/%s/events with Last-Event-ID %d to resume",
                      c->cfg->stream_outage_s, s->job_id, s->last);
        sse_data(c, error_object(&e));
    } else if (s->mode == MODE_EVENTS_SSE) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "state", json_object_new_string(st->state));
        json_object_object_add(o, "finish_reason",
                               st->finish_reason[0] ? json_object_new_string(fr) : NULL);
        json_object_object_add(o, "usage", usage_object(st));
        json_object_object_add(o, "error", st->error[0] ? json_object_new_string(st->error) : NULL);
        sse_data(c, o);
    } else {
        if (!strcmp(st->state, "failed")) {
            ApiError e;
            api_error_set(&e, 500, "server_error", "generation_failed", NULL, "%s", st->error);
            sse_data(c, error_object(&e));
        } else {
            sse_delta(c, s->job_id, s->created, s->is_chat,
                      s->is_chat ? json_object_new_object() : json_object_new_string(""), fr, NULL);
        }
        if (r && r->include_usage) {
            json_object *o = chunk_envelope(c, s->job_id, s->created, s->is_chat);
            json_object_object_add(o, "choices", json_object_new_array());
            json_object_object_add(o, "usage", usage_object(st));
            sse_data(c, o);
        }
    }
    put(c, "data: [DONE]\n\n", 14);
    flush(c);
}

// Read the job's output from seq > after until it is terminal. In SSE modes events are
// written as they arrive; in MODE_COLLECT the output goes to *col. *st gets the final
// state. While the database is away the stream keeps sending keep-alives and retries for
// cfg->stream_outage_s, then ends with an error event and [DONE]. Returns ERR_OK when the
// job ended and its end was written, ERR_NOTFOUND when the job vanished, ERR_IO when the
// client went away (c->is_broken), ERR_DB when it gave up on the database, ERR_NOMEM.
static Err stream_job(Ctx *c, int64_t id, const char *job_id, long long created, int after,
                      StreamMode mode, const ApiRequest *r, Collected *col, JobState *st)
{
    char id_text[24], seq_text[16];
    Stream s = {.mode = mode,
                .job_id = job_id,
                .created = created,
                .col = col,
                .last = after,
                .is_chat = mode != MODE_COMPLETION_SSE,
                .want_lp = r && r->logprobs,
                .last_write = clock_now_s()};
    Err err = ERR_OK;
    memset(st, 0, sizeof *st);
    snprintf(id_text, sizeof id_text, "%lld", (long long) id);
    c->db->retry_ms = STREAM_RETRY_MS;
    if (mode == MODE_CHAT_SSE) {
        json_object *d = json_object_new_object();
        json_object_object_add(d, "role", json_object_new_string("assistant"));
        json_object_object_add(d, "content", json_object_new_string(""));
        sse_delta(c, job_id, created, true, d, NULL, NULL);
        flush(c);
    }
    for (;;) {
        snprintf(seq_text, sizeof seq_text, "%d", s.last);
        PGresult *res = api_db_exec(c->db,
                                    "SELECT seq, kind, text, logprobs::text FROM job_chunks"
                                    " WHERE job_id = $1::bigint"
                                    " AND seq > $2::int ORDER BY seq LIMIT 256",
                                    2, (const char *const[]){id_text, seq_text}, PGRES_TUPLES_OK);
        if (!res) {
            if ((err = stream_outage(c, &s))) break;
            continue;
        }
        const int n = PQntuples(res);
        for (int i = 0; i < n && !err; i++)
            err = stream_chunk(c, &s, res, i);
        PQclear(res);
        if (err) break;
        if (mode != MODE_COLLECT && n > 0) {
            flush(c);
            s.last_write = clock_now_s();
        }
        if (c->is_broken) {
            err = ERR_IO;
            break;
        }
        if (n == 256) continue;
        err = read_state(c, id, st);
        if (err == ERR_DB) {
            if ((err = stream_outage(c, &s))) break;
            continue;
        }
        if (err) break;
        if (s.outage_since != 0) {
            LOG_INFO("api: stream of job %s: the database is back after %.1f s", job_id,
                     clock_now_s() - s.outage_since);
            s.outage_since = 0;
        }
        if (st->is_terminal && s.last + 1 >= st->n_chunks) break;
        if (s.last + 1 < st->n_chunks) continue;  // more is committed: read it before waiting
        api_db_wait(c->db, job_id, c->cfg->poll_ms);
        if (!stream_keepalive(c, &s)) {
            err = ERR_IO;
            break;
        }
    }
    c->db->retry_ms = 0;
    if (!err || err == ERR_DB) stream_end(c, &s, r, st, err == ERR_DB);
    if (!err && c->is_broken) err = ERR_IO;
    return err;
}

static void sse_headers(Ctx *c)
{
    putf(c, "Status: 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            "X-Accel-Buffering: no\r\n\r\n");
    flush(c);
}

// ---------------------------------------------------------------------------
// Handlers

static json_object *model_object(const ApiModel *m)
{
    json_object *o = json_object_new_object();
    json_object_object_add(o, "id", json_object_new_string(m->name));
    json_object_object_add(o, "object", json_object_new_string("model"));
    json_object_object_add(o, "created", json_object_new_int64(0));
    json_object_object_add(o, "owned_by", json_object_new_string("glmspark"));
    json_object_object_add(o, "max_model_len", json_object_new_int(m->context_len));
    return o;
}

// The configured model named name[0..n) (not NUL-terminated), or NULL.
static const ApiModel *find_model(const ApiConfig *cfg, const char *name, size_t n)
{
    for (int i = 0; i < cfg->n_models; i++)
        if (strlen(cfg->models[i].name) == n && !memcmp(cfg->models[i].name, name, n))
            return &cfg->models[i];
    return NULL;
}

// GET /v1/models and /v1/models/{name}: the configured models that a live engine serves
// (api_server.h), in configuration order.
static void handle_models(Ctx *c, const char *name, size_t n_name)
{
    PGresult *res = api_db_exec(c->db,
                                "SELECT DISTINCT model FROM engines WHERE stopped_at IS NULL"
                                " AND heartbeat_at > now() - interval '30 seconds'",
                                0, NULL, PGRES_TUPLES_OK);
    if (!res) {
        fail_db(c);
        return;
    }
    bool live[API_MAX_MODELS] = {false};
    for (int i = 0; i < PQntuples(res); i++) {
        const char *m = PQgetvalue(res, i, 0);
        const ApiModel *found = find_model(c->cfg, m, strlen(m));
        if (found) live[found - c->cfg->models] = true;
    }
    PQclear(res);
    if (name) {
        const ApiModel *m = find_model(c->cfg, name, n_name);
        if (!m || !live[m - c->cfg->models]) {
            fail(c, 404, NULL, "model_not_found", "model",
                 m ? "no engine serves this model now" : "no such model");
            return;
        }
        send_json(c, 200, model_object(m), NULL);
        return;
    }
    json_object *o = json_object_new_object(), *data = json_object_new_array();
    for (int i = 0; i < c->cfg->n_models; i++)
        if (live[i]) json_object_array_add(data, model_object(&c->cfg->models[i]));
    json_object_object_add(o, "object", json_object_new_string("list"));
    json_object_object_add(o, "data", data);
    send_json(c, 200, o, NULL);
}

static json_object *message_object(const Collected *col, const char *job_id)
{
    (void) job_id;
    json_object *m = json_object_new_object();
    json_object_object_add(m, "role", json_object_new_string("assistant"));
    json_object_object_add(m, "content",
                           json_object_new_string(col->content.p ? col->content.p : ""));
    if (col->reasoning.n) {
        json_object_object_add(m, "reasoning_content", json_object_new_string(col->reasoning.p));
        json_object_object_add(m, "reasoning", json_object_new_string(col->reasoning.p));
    }
    if (col->tool_calls) json_object_object_add(m, "tool_calls", json_object_get(col->tool_calls));
    return m;
}

// POST /v1/chat/completions, /v1/completions, /v1/jobs.
static void handle_generate(Ctx *c, ApiKind kind, bool is_job)
{
    size_t n_body = 0;
    char *body = read_body(c, &n_body);
    ApiRequest r;
    ApiError e;
    Collected col = {0};
    if (!body) return;
    if (api_request_parse(&r, kind, body, n_body, &e)) {
        free(body);
        send_error(c, &e, 0);
        return;
    }
    free(body);
    if (!(c->model = find_model(c->cfg, r.model, strlen(r.model)))) {
        api_error_set(&e, 404, NULL, "model_not_found", "model",
                      "the model '%.100s' does not exist (GET /v1/models lists the models served)",
                      r.model);
        send_error(c, &e, 0);
        goto done;
    }
    snprintf(c->model_name, sizeof c->model_name, "%s", c->model->name);
    NewJob job = {0};
    if (!enqueue(c, &r, &job)) goto done;

    if (is_job) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "id", json_object_new_string(job.public_id));
        json_object_object_add(o, "object", json_object_new_string("job"));
        json_object_object_add(o, "state", json_object_new_string("queued"));
        json_object_object_add(o, "created_at", json_object_new_int64(job.created));
        json_object_object_add(o, "model", json_object_new_string(c->model_name));
        json_object_object_add(o, "prompt_tokens", json_object_new_int(job.n_prompt));
        json_object_object_add(o, "max_tokens", json_object_new_int(job.max_tokens));
        char loc[128];
        Buf extra = {0};
        snprintf(loc, sizeof loc, "/v1/jobs/%s", job.public_id);
        if (api_http_add_header(&extra, "Location", loc)) {
            json_object_put(o);
            fail(c, 500, "server_error", NULL, NULL, "could not write the response headers");
        } else {
            send_json(c, 202, o, &extra);
        }
        buf_free(&extra);
        goto done;
    }
    JobState st = {0};
    if (r.stream) {
        sse_headers(c);
        const Err err =
            stream_job(c, job.id, job.public_id, job.created, -1,
                       kind == API_KIND_CHAT ? MODE_CHAT_SSE : MODE_COMPLETION_SSE, &r, NULL, &st);
        if (err == ERR_IO) {
            // The client left a chat/completions stream: nobody can read the rest.
            LOG_INFO("api: client left the stream of job %s; cancelling it", job.public_id);
            if (!cancel_job(c->db, job.id))
                LOG_WARN("api: could not cancel job %s after its client left", job.public_id);
        }
        goto done;
    }
    const Err err =
        stream_job(c, job.id, job.public_id, job.created, -1, MODE_COLLECT, &r, &col, &st);
    if (err == ERR_DB) {
        api_error_set(&e, 503, "server_error", "database_unavailable", NULL,
                      "the job database was unavailable for %d s; job %s goes on: read it with "
                      "GET /v1/jobs/%s",
                      c->cfg->stream_outage_s, job.public_id, job.public_id);
        send_error(c, &e, 1);
        goto done;
    }
    if (err == ERR_NOMEM) {
        fail_oom(c);
        goto done;
    }
    if (err) {
        if (err == ERR_NOTFOUND) fail(c, 500, "server_error", NULL, NULL, "the job disappeared");
        goto done;
    }
    if (!strcmp(st.state, "failed")) {
        api_error_set(&e, 500, "server_error", "generation_failed", NULL, "%s", st.error);
        send_error(c, &e, 0);
        goto done;
    }
    const int n_tools = col.tool_calls ? (int) json_object_array_length(col.tool_calls) : 0;
    json_object *o = json_object_new_object(), *choices = json_object_new_array(),
                *ch = json_object_new_object();
    json_object_object_add(o, "id", json_object_new_string(job.public_id));
    json_object_object_add(
        o, "object",
        json_object_new_string(kind == API_KIND_CHAT ? "chat.completion" : "text_completion"));
    json_object_object_add(o, "created", json_object_new_int64(job.created));
    json_object_object_add(o, "model", json_object_new_string(c->model_name));
    json_object_object_add(ch, "index", json_object_new_int(0));
    if (kind == API_KIND_CHAT)
        json_object_object_add(ch, "message", message_object(&col, job.public_id));
    else
        json_object_object_add(ch, "text",
                               json_object_new_string(col.content.p ? col.content.p : ""));
    int lp_offset = 0;
    if (r.logprobs && !col.logprobs) col.logprobs = json_object_new_array();
    json_object_object_add(
        ch, "logprobs",
        r.logprobs ? choice_logprobs(col.logprobs, kind == API_KIND_CHAT, &lp_offset) : NULL);
    json_object_object_add(ch, "finish_reason",
                           json_object_new_string(client_finish_reason(&st, n_tools)));
    json_object_array_add(choices, ch);
    json_object_object_add(o, "choices", choices);
    json_object_object_add(o, "usage", usage_object(&st));
    send_json(c, 200, o, NULL);
done:
    buf_free(&col.content);
    buf_free(&col.reasoning);
    json_object_put(col.tool_calls);
    json_object_put(col.logprobs);
    api_request_free(&r);
}

static const char job_columns[] =
    "j.id, j.public_id, j.state, j.kind, j.model, j.attempt,"
    " extract(epoch FROM j.created_at)::float8, extract(epoch FROM j.claimed_at)::float8,"
    " extract(epoch FROM j.first_token_at)::float8, extract(epoch FROM j.finished_at)::float8,"
    " j.n_prompt_tokens, j.n_completion_tokens, j.finish_reason, j.error, j.max_tokens,"
    " CASE WHEN j.state = 'queued' THEN (SELECT count(*) FROM jobs q WHERE q.state = 'queued'"
    "   AND (q.priority > j.priority OR (q.priority = j.priority AND q.id <= j.id))) END,"
    " (SELECT k.name FROM api_keys k WHERE k.id = j.api_key_id),"
    " (SELECT k.prefix FROM api_keys k WHERE k.id = j.api_key_id), j.n_cached_tokens";
enum { N_JOB_COLUMNS = 19 };  // handle_job_get's output columns follow

// The job object for row i of res (columns as job_columns, then optionally outputs).
static json_object *job_object(PGresult *res, int i, bool with_output)
{
    json_object *o = json_object_new_object(), *t = json_object_new_object(),
                *u = json_object_new_object();
#define COL_STR(k, col)     \
    json_object_object_add( \
        o, k, PQgetisnull(res, i, col) ? NULL : json_object_new_string(PQgetvalue(res, i, col)))
#define COL_NUM(obj, k, col) \
    json_object_object_add(  \
        obj, k,              \
        PQgetisnull(res, i, col) ? NULL : json_object_new_double(atof(PQgetvalue(res, i, col))))
    COL_STR("id", 1);
    json_object_object_add(o, "object", json_object_new_string("job"));
    COL_STR("state", 2);
    COL_STR("kind", 3);
    COL_STR("model", 4);
    json_object_object_add(o, "attempts", json_object_new_int(atoi(PQgetvalue(res, i, 5))));
    json_object_object_add(
        o, "queue_position",
        PQgetisnull(res, i, 15) ? NULL : json_object_new_int(atoi(PQgetvalue(res, i, 15))));
    json_object_object_add(o, "created_at",
                           json_object_new_int64((int64_t) atof(PQgetvalue(res, i, 6))));
    COL_NUM(t, "created_at", 6);
    COL_NUM(t, "claimed_at", 7);
    COL_NUM(t, "first_token_at", 8);
    COL_NUM(t, "finished_at", 9);
    if (!PQgetisnull(res, i, 7))
        json_object_object_add(
            t, "queue_wait_s",
            json_object_new_double(atof(PQgetvalue(res, i, 7)) - atof(PQgetvalue(res, i, 6))));
    if (!PQgetisnull(res, i, 8))
        json_object_object_add(
            t, "ttft_s",
            json_object_new_double(atof(PQgetvalue(res, i, 8)) - atof(PQgetvalue(res, i, 7))));
    json_object_object_add(o, "timings", t);
    const int np = atoi(PQgetvalue(res, i, 10)), nc = atoi(PQgetvalue(res, i, 11));
    json_object_object_add(u, "prompt_tokens", json_object_new_int(np));
    json_object_object_add(u, "completion_tokens", json_object_new_int(nc));
    json_object_object_add(u, "total_tokens", json_object_new_int(np + nc));
    json_object *d = json_object_new_object();
    json_object_object_add(d, "cached_tokens", json_object_new_int(atoi(PQgetvalue(res, i, 18))));
    json_object_object_add(u, "prompt_tokens_details", d);
    json_object_object_add(o, "usage", u);
    json_object_object_add(o, "max_tokens", json_object_new_int(atoi(PQgetvalue(res, i, 14))));
    COL_STR("finish_reason", 12);
    COL_STR("error", 13);
    // The key that owns the job: its name and public prefix (never anything secret).
    json_object *owner = json_object_new_object();
    json_object_object_add(owner, "name", json_object_new_string(PQgetvalue(res, i, 16)));
    json_object_object_add(owner, "prefix", json_object_new_string(PQgetvalue(res, i, 17)));
    json_object_object_add(o, "owner", owner);
    if (with_output) {
        const int k0 = N_JOB_COLUMNS;
        json_object *out = json_object_new_object();
        json_object_object_add(out, "content", json_object_new_string(PQgetvalue(res, i, k0)));
        json_object_object_add(out, "reasoning_content",
                               json_object_new_string(PQgetvalue(res, i, k0 + 1)));
        json_object *tools = json_tokener_parse(PQgetvalue(res, i, k0 + 2)),
                    *calls = json_object_new_array();
        for (size_t k = 0; tools && k < json_object_array_length(tools); k++)
            json_object_array_add(
                calls, tool_call_object(PQgetvalue(res, i, 1), (int) k,
                                        json_object_get_string(json_object_array_get_idx(tools, k)),
                                        false));
        json_object_put(tools);
        json_object_object_add(out, "tool_calls", calls);
        json_object_object_add(o, "output", out);
        // What the caller sent: {"messages": [...]} for chat, {"prompt": "..."} for completions.
        json_object *input =
            PQgetisnull(res, i, k0 + 3) ? NULL : json_tokener_parse(PQgetvalue(res, i, k0 + 3));
        if (input) {
            json_object *request = json_object_new_object();
            json_object_object_add(
                request, json_object_is_type(input, json_type_string) ? "prompt" : "messages",
                input);
            json_object_object_add(o, "request", request);
        }
    }
#undef COL_STR
#undef COL_NUM
    return o;
}

// Look a job up by public id for this key (admins: any). Returns its row id, 0 after 404.
static int64_t find_job(Ctx *c, const char *public_id, long long *created)
{
    char key_id[24];
    snprintf(key_id, sizeof key_id, "%lld", (long long) c->key.id);
    PGresult *res = api_db_exec(
        c->db,
        "SELECT id, extract(epoch FROM created_at)::bigint, model FROM jobs"
        " WHERE public_id = $1 AND (api_key_id = $2::bigint OR $3::bool)",
        3, (const char *const[]){public_id, key_id, c->key.is_admin ? "t" : "f"}, PGRES_TUPLES_OK);
    if (!res) {
        fail_db(c);
        return 0;
    }
    int64_t id = 0;
    if (PQntuples(res) == 1) {
        id = atoll(PQgetvalue(res, 0, 0));
        if (created) *created = atoll(PQgetvalue(res, 0, 1));
        snprintf(c->model_name, sizeof c->model_name, "%s", PQgetvalue(res, 0, 2));
    } else {
        fail(c, 404, NULL, "job_not_found", NULL, "no such job");
    }
    PQclear(res);
    return id;
}

static void handle_job_get(Ctx *c, const char *public_id)
{
    if (!find_job(c, public_id, NULL)) return;
    char sql[2048];
    snprintf(
        sql, sizeof sql,
        "SELECT %s,"
        " coalesce((SELECT string_agg(text, '' ORDER BY seq) FROM job_chunks WHERE job_id = j.id"
        "  AND kind = 'content'), ''),"
        " coalesce((SELECT string_agg(text, '' ORDER BY seq) FROM job_chunks WHERE job_id = j.id"
        "  AND kind = 'reasoning'), ''),"
        " coalesce((SELECT json_agg(text ORDER BY seq) FROM job_chunks WHERE job_id = j.id"
        "  AND kind = 'tool'), '[]')::text,"
        " j.input::text"
        " FROM jobs j WHERE j.public_id = $1",
        job_columns);
    PGresult *res = api_db_exec(c->db, sql, 1, (const char *const[]){public_id}, PGRES_TUPLES_OK);
    if (!res || PQntuples(res) != 1) {
        PQclear(res);
        fail_db(c);
        return;
    }
    send_json(c, 200, job_object(res, 0, true), NULL);
    PQclear(res);
}

static void handle_job_list(Ctx *c)
{
    char limit_text[16] = "20", after[64] = "", key_id[24], sql[2048];
    if (api_http_query_value(c->query, "after", after, sizeof after) == ERR_INVAL) {
        fail(c, 400, NULL, NULL, "after", "'after' must be a job id");
        return;
    }
    const Err err = api_http_query_value(c->query, "limit", limit_text, sizeof limit_text);
    const int limit = err == ERR_INVAL ? 0 : atoi(limit_text);
    if (limit < 1 || limit > 100) {
        fail(c, 400, NULL, NULL, "limit", "'limit' must be between 1 and 100");
        return;
    }
    snprintf(limit_text, sizeof limit_text, "%d", limit + 1);
    snprintf(key_id, sizeof key_id, "%lld", (long long) c->key.id);
    snprintf(sql, sizeof sql,
             "SELECT %s FROM jobs j WHERE (j.api_key_id = $1::bigint OR $2::bool)"
             " AND ($3 = '' OR j.id < (SELECT id FROM jobs WHERE public_id = $3))"
             " ORDER BY j.id DESC LIMIT $4::int",
             job_columns);
    PGresult *res =
        api_db_exec(c->db, sql, 4,
                    (const char *const[]){key_id, c->key.is_admin ? "t" : "f", after, limit_text},
                    PGRES_TUPLES_OK);
    if (!res) {
        fail_db(c);
        return;
    }
    const int n = PQntuples(res);
    json_object *o = json_object_new_object(), *data = json_object_new_array();
    for (int i = 0; i < n && i < limit; i++)
        json_object_array_add(data, job_object(res, i, false));
    json_object_object_add(o, "object", json_object_new_string("list"));
    json_object_object_add(o, "data", data);
    json_object_object_add(o, "has_more", json_object_new_boolean(n > limit));
    // Whose jobs these are: an admin key lists everyone's.
    json_object_object_add(o, "scope", json_object_new_string(c->key.is_admin ? "admin" : "user"));
    PQclear(res);
    send_json(c, 200, o, NULL);
}

static void handle_job_events(Ctx *c, const char *public_id)
{
    long long created = 0;
    const int64_t id = find_job(c, public_id, &created);
    if (!id) return;
    int after = -1;
    const char *last = param(c, "HTTP_LAST_EVENT_ID");
    char qafter[16];
    if (last && *last) {
        if (api_http_parse_event_id(last, &after)) {
            fail(c, 400, NULL, NULL, "Last-Event-ID",
                 "Last-Event-ID must be a chunk sequence number");
            return;
        }
    } else {
        const Err err = api_http_query_value(c->query, "after", qafter, sizeof qafter);
        if (err == ERR_INVAL || (!err && api_http_parse_event_id(qafter, &after))) {
            fail(c, 400, NULL, NULL, "after", "'after' must be a chunk sequence number");
            return;
        }
    }
    sse_headers(c);
    JobState st;
    // Whatever ended the stream was logged where it happened; events streams cancel nothing.
    (void) stream_job(c, id, public_id, created, after, MODE_EVENTS_SSE, NULL, NULL, &st);
}

static void handle_job_cancel(Ctx *c, const char *public_id)
{
    const int64_t id = find_job(c, public_id, NULL);
    if (!id) return;
    if (!cancel_job(c->db, id)) {
        fail_db(c);
        return;
    }
    handle_job_get(c, public_id);
}

// 200 {"status":"ok"} while an engine serves (the model's, with ?model=NAME), else 503 with
// the reason; every model with a live engine and its status (api_metrics.h).
static void handle_health(Ctx *c)
{
    char model[128];
    const Err qerr = api_http_query_value(c->query, "model", model, sizeof model);
    if (qerr == ERR_INVAL) {
        fail(c, 400, NULL, NULL, "model", "'model' is too long");
        return;
    }
    ApiHealth h;
    const Err err = api_metrics_health(c->db, qerr == ERR_OK ? model : NULL, &h);
    json_object *o = json_object_new_object();
    json_object_object_add(o, "status", json_object_new_string(h.status));
    if (qerr == ERR_OK) json_object_object_add(o, "model", json_object_new_string(model));
    json_object_object_add(o, "database", json_object_new_boolean(err == ERR_OK));
    json_object_object_add(o, "engines", json_object_new_int(h.n_engines));
    if (h.has_stats) {
        json_object_object_add(o, "ranks_up", json_object_new_int(h.ranks_up));
        json_object_object_add(o, "world", json_object_new_int(h.world));
    }
    json_object *models = json_object_new_object();
    for (int i = 0; i < h.n_models; i++) {
        json_object *m = json_object_new_object();
        json_object_object_add(m, "status", json_object_new_string(h.models[i].status));
        json_object_object_add(m, "engines", json_object_new_int(h.models[i].n_engines));
        json_object_object_add(models, h.models[i].name, m);
    }
    json_object_object_add(o, "models", models);
    send_json(c, strcmp(h.status, "ok") ? 503 : 200, o, NULL);
}

static void handle_metrics(Ctx *c)
{
    char *text = NULL;
    size_t n = 0;
    if (api_metrics_render(c->db, &text, &n)) {
        fail_db(c);
        return;
    }
    putf(c, "Status: 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nCache-Control: "
            "no-store\r\n\r\n");
    put(c, text, n);
    free(text);
}

// nginx auth_request: 200 with the identity in headers (for nginx's access log and for
// operators; the app never reads them back), or 401.
static void handle_auth(Ctx *c)
{
    const char *key =
        api_http_bearer_key(param(c, "HTTP_AUTHORIZATION"), param(c, "HTTP_X_API_KEY"));
    ApiKey k;
    Buf h = {0};
    char num[24];
    const Err err = key ? api_db_auth(c->db, key, strlen(key), &k) : ERR_NOTFOUND;
    if (err) {
        putf(c, "Status: %d\r\nContent-Type: text/plain\r\n\r\n", err == ERR_DB ? 503 : 401);
        return;
    }
    snprintf(num, sizeof num, "%lld", (long long) k.id);
    Err herr = api_http_add_header(&h, "X-Key-Id", num);
    if (!herr) herr = api_http_add_header(&h, "X-Key-Scope", k.is_admin ? "admin" : "user");
    if (!herr) herr = api_http_add_header(&h, "X-Key-Prefix", k.prefix);
    snprintf(num, sizeof num, "%d", k.rpm);
    if (!herr) herr = api_http_add_header(&h, "X-Key-Rpm", num);
    snprintf(num, sizeof num, "%d", k.max_concurrent);
    if (!herr) herr = api_http_add_header(&h, "X-Key-Max-Concurrent", num);
    if (herr)
        putf(c, "Status: 500\r\nContent-Type: text/plain\r\n\r\n");
    else
        putf(c, "Status: 200 OK\r\n%sContent-Type: text/plain\r\n\r\n", h.p);
    buf_free(&h);
}

// ---------------------------------------------------------------------------
// Routing

void api_server_handle(FCGX_Request *req, ApiDb *db, const ApiConfig *cfg)
{
    Ctx ctx = {.req = req, .db = db, .cfg = cfg};
    Ctx *c = &ctx;
    c->method = param(c, "REQUEST_METHOD");
    c->query = param(c, "QUERY_STRING");
    if (!c->method) c->method = "GET";
    const char *uri = param(c, "DOCUMENT_URI");
    if (!uri) uri = param(c, "REQUEST_URI");
    if (!uri) uri = "/";
    const size_t n_path = strcspn(uri, "?");
    if (n_path >= sizeof c->path) {  // refused, not cut: a cut path could name another route
        fail(c, 414, NULL, "uri_too_long", NULL, "the request path is too long");
        return;
    }
    memcpy(c->path, uri, n_path);
    c->path[n_path] = '\0';
    const char *arg = NULL;
    size_t n_arg = 0;
    const ApiRoute route = api_http_route(c->method, c->path, &arg, &n_arg);
    char public_id[64] = "";
    if (route >= API_ROUTE_JOB_GET) snprintf(public_id, sizeof public_id, "%.*s", (int) n_arg, arg);

    if (route == API_ROUTE_HEALTH) {
        handle_health(c);
        return;
    }
    if (api_http_query_has_key(c->query)) {
        fail(c, 401, NULL, "api_key_in_query", NULL,
             "API keys are accepted only in the Authorization header, never in the URL");
        return;
    }
    if (route == API_ROUTE_AUTH) {
        handle_auth(c);
        return;
    }
    // Every other route, unknown ones included, answers only a verified key.
    if (!authenticate(c)) return;
    switch (route) {
    case API_ROUTE_METRICS:
        if (!c->key.is_admin) {
            fail(c, 403, "permission_error", "insufficient_scope", NULL,
                 "this endpoint needs an admin key");
            return;
        }
        handle_metrics(c);
        return;
    case API_ROUTE_MODELS:
        handle_models(c, NULL, 0);
        return;
    case API_ROUTE_MODEL:
        handle_models(c, arg, n_arg);
        return;
    case API_ROUTE_CHAT:
        handle_generate(c, API_KIND_CHAT, false);
        return;
    case API_ROUTE_COMPLETIONS:
        handle_generate(c, API_KIND_COMPLETION, false);
        return;
    case API_ROUTE_JOB_SUBMIT:
        handle_generate(c, API_KIND_CHAT, true);
        return;
    case API_ROUTE_JOB_LIST:
        handle_job_list(c);
        return;
    case API_ROUTE_JOB_GET:
        handle_job_get(c, public_id);
        return;
    case API_ROUTE_JOB_EVENTS:
        handle_job_events(c, public_id);
        return;
    case API_ROUTE_JOB_CANCEL:
        handle_job_cancel(c, public_id);
        return;
    case API_ROUTE_BAD_JOB:
        fail(c, 404, NULL, "job_not_found", NULL, "no such job");
        return;
    case API_ROUTE_METHOD:
        fail(c, 405, NULL, "method_not_allowed", NULL, "method not allowed on this endpoint");
        return;
    case API_ROUTE_NONE:
    case API_ROUTE_HEALTH:
    case API_ROUTE_AUTH:
        break;
    }
    fail(c, 404, NULL, "not_found", NULL, "no such endpoint");
}
