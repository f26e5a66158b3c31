/*
 * test_api_server_db.c - api_server_handle against a real PostgreSQL (run by with_pg.sh),
 * through in-memory FastCGI streams (tests/fcgi/fcgi_capture.h); no nginx, no engine (the
 * test writes the engine's rows itself).
 *
 * Checked: a real key works and forged identity params change nothing (a user key stays a
 * user key); the Idempotency-Key race made deterministic (a second transaction holds an
 * uncommitted job with the same key while the handler submits: the handler waits in ON
 * CONFLICT and answers 202 with that job once it commits, where the old code answered 503);
 * the SSE writing of /v1/jobs/{id}/events (id lines, events, the end event, [DONE]),
 * Last-Event-ID resume and its validation; job list paging validation; a revoked key
 * refused at once.
 */
#include <json-c/json.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/cli/cli.h"
#include "engine/shared/tokenizer.h"
#include "tests/db/api_key_util.h"
#include "tests/fcgi/fcgi_capture.h"

static PGconn *admin;
static ApiDb db;
static ApiConfig cfg = CAPTURE_CONFIG;
static char key[APIKEY_LEN + 1], auth_header[APIKEY_LEN + 64];

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long) (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// One value of a query on the admin connection (a static copy; "" when none).
static const char *value(const char *q)
{
    static char out[256];
    PGresult *res = PQexec(admin, q);
    snprintf(out, sizeof out, "%s",
             PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) ? PQgetvalue(res, 0, 0) : "");
    PQclear(res);
    return out;
}

// GET or POST path (with query) as our key, with extra params (NULL-terminated, may be
// NULL); returns the status and the response text in *text (the caller frees it).
static int request(const char *method, const char *uri, const char *query, char **extra,
                   const char *body, char **text)
{
    char m[32], u[256], q[256], cl[48];
    snprintf(m, sizeof m, "REQUEST_METHOD=%s", method);
    snprintf(u, sizeof u, "DOCUMENT_URI=%s", uri);
    snprintf(q, sizeof q, "QUERY_STRING=%s", query ? query : "");
    snprintf(cl, sizeof cl, "CONTENT_LENGTH=%zu", body ? strlen(body) : 0);
    char *envp[16] = {m, u, q, cl, auth_header};
    int n = 5;
    for (int i = 0; extra && extra[i] && n < 15; i++)
        envp[n++] = extra[i];
    envp[n] = NULL;
    *text = capture_handle(envp, body, &db, &cfg, NULL);
    const char *b = NULL;
    return capture_status(*text, &b);
}

static void test_key_and_forged_scope(void)
{
    char *text = NULL;
    CHECK(request("GET", "/v1/models", NULL, NULL, NULL, &text) == 200);
    free(text);
    char *forged[] = {"GLMSPARK_KEY_ID=1", "GLMSPARK_KEY_SCOPE=admin", NULL};
    CHECK(request("GET", "/metrics", NULL, forged, NULL, &text) == 403);
    free(text);
    CHECK(request("GET", "/v1/jobs/job-00", NULL, NULL, NULL, &text) == 404);
    free(text);
    CHECK(request("PUT", "/v1/jobs", NULL, NULL, NULL, &text) == 405);
    free(text);
}

// ---------------------------------------------------------------------------
// Idempotency-Key race

typedef struct Submit {
    int status;
    char *text;
} Submit;

static void *submit_main(void *arg)
{
    Submit *s = arg;
    char *idem[] = {"HTTP_IDEMPOTENCY_KEY=race-1", NULL};
    const char *body =
        "{\"model\":\"glmspark-demo\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
        "\"max_tokens\":4}";
    s->status = request("POST", "/v1/jobs", NULL, idem, body, &s->text);
    return NULL;
}

// /v1/models lists the configured models that a live engine serves; a request picks its
// model (its tokenizer and context), an unknown one is a 404; jobs carry their model.
static void test_models(void)
{
    char *text = NULL;
    CHECK(request("GET", "/v1/models", NULL, NULL, NULL, &text) == 200);
    CHECK(text && strstr(text, "\"data\":[]") != NULL);  // no live engine yet
    free(text);
    CHECK(request("GET", "/v1/models/glmspark-demo-b", NULL, NULL, NULL, &text) == 404);
    CHECK(text && strstr(text, "model_not_found") != NULL);
    free(text);
    // A live engine of glmspark-demo-b, a stopped one of glmspark-demo, a live one of a model
    // this process does not accept.
    PQclear(PQexec(admin, "INSERT INTO engines (name, model) VALUES ('t-b', 'glmspark-demo-b'),"
                          " ('t-x', 'not-configured')"));
    PQclear(PQexec(admin, "INSERT INTO engines (name, model, stopped_at) VALUES"
                          " ('t-a', 'glmspark-demo', now())"));
    CHECK(request("GET", "/v1/models", NULL, NULL, NULL, &text) == 200);
    CHECK(text && strstr(text, "\"id\":\"glmspark-demo-b\"") && strstr(text, "\"max_model_len\":64")
          && !strstr(text, "\"id\":\"glmspark-demo\"") && !strstr(text, "not-configured"));
    free(text);
    CHECK(request("GET", "/v1/models/glmspark-demo-b", NULL, NULL, NULL, &text) == 200);
    free(text);
    CHECK(request("GET", "/v1/models/glmspark-demo", NULL, NULL, NULL, &text) == 404);
    free(text);
    CHECK(request("POST", "/v1/jobs", NULL, NULL,
                  "{\"model\":\"nope\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
                  &text) == 404);
    CHECK(text && strstr(text, "model_not_found") != NULL);
    free(text);
    // glmspark-demo-b's context is 64 tokens: 70 one-character tokens do not fit it ...
    char body[512];
    snprintf(body, sizeof body, "{\"model\":\"glmspark-demo-b\",\"prompt\":\"%070d\",\"max_tokens\":4}", 0);
    CHECK(request("POST", "/v1/completions", NULL, NULL, body, &text) == 400);
    CHECK(text && strstr(text, "context_length_exceeded") != NULL);
    free(text);
    // ... but they fit glmspark-demo's 4096; a queued job of a model without a live engine
    // is accepted (an engine of that model claims it when one comes).
    snprintf(body, sizeof body,
             "{\"model\":\"glmspark-demo\",\"messages\":[{\"role\":\"user\",\"content\":\"%070d\"}]}", 0);
    CHECK(request("POST", "/v1/jobs", NULL, NULL, body, &text) == 202);
    CHECK(text && strstr(text, "\"model\":\"glmspark-demo\"") != NULL);
    free(text);
    CHECK(request("POST", "/v1/jobs", NULL, NULL,
                  "{\"model\":\"glmspark-demo-b\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                  "\"max_tokens\":4}",
                  &text) == 202);
    CHECK(text && strstr(text, "\"model\":\"glmspark-demo-b\"") != NULL);
    free(text);
    CHECK(!strcmp(value("SELECT string_agg(model, ',' ORDER BY id)"
                        " FROM (SELECT * FROM jobs ORDER BY id DESC LIMIT 2) j"),
                  "glmspark-demo,glmspark-demo-b"));
    PQclear(PQexec(admin, "DELETE FROM jobs WHERE state = 'queued'"));
    PQclear(PQexec(admin, "DELETE FROM engines WHERE name IN ('t-a', 't-b', 't-x')"));
}

static void test_idempotency_race(void)
{
    // Another request with the same key got as far as its INSERT and has not committed.
    PGconn *other = PQconnectdb(getenv("GLMSPARK_DB"));
    CHECK(PQstatus(other) == CONNECTION_OK);
    db_sql(other, "BEGIN");
    PGresult *res =
        PQexec(other, "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids,"
                      " n_prompt_tokens, max_tokens, idem_key) SELECT id, 'chat', 'glmspark-demo',"
                      " '{}', '{1}', 1, 4, 'race-1' FROM api_keys WHERE name = 'server'"
                      " RETURNING public_id");
    CHECK(PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1);
    char first[64] = "";
    if (PQntuples(res) == 1) snprintf(first, sizeof first, "%s", PQgetvalue(res, 0, 0));
    PQclear(res);

    Submit s = {0};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, submit_main, &s) == 0);
    // Wait until the handler blocks on that row (its INSERT waits for the other transaction).
    bool is_waiting = false;
    for (int i = 0; i < 500 && !is_waiting; i++) {
        is_waiting =
            atoi(value("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                       " AND query LIKE 'INSERT INTO jobs%'"))
            == 1;
        if (!is_waiting) sleep_ms(10);
    }
    CHECK(is_waiting);
    db_sql(other, "COMMIT");
    pthread_join(t, NULL);
    if (s.status != 202) fprintf(stderr, "idempotency race: %.300s\n", s.text ? s.text : "");
    CHECK(s.status == 202);
    CHECK(first[0] && s.text && strstr(s.text, first) != NULL);  // the other request's job
    CHECK(atoi(value("SELECT count(*) FROM jobs WHERE idem_key = 'race-1'")) == 1);
    free(s.text);
    PQfinish(other);
}

// ---------------------------------------------------------------------------
// Events

static void test_events(void)
{
    const char *id = value("SELECT public_id FROM jobs WHERE idem_key = 'race-1'");
    char job[64], uri[128];
    snprintf(job, sizeof job, "%s", id);
    // The engine's part: three chunks, then the end.
    char q[512];
    snprintf(
        q, sizeof q,
        "INSERT INTO job_chunks (job_id, seq, attempt, kind, text, token_ids)"
        " SELECT j.id, s, 1, CASE WHEN s = 0 THEN 'reasoning' ELSE 'content' END, 'c' || s, '{1}'"
        " FROM jobs j, generate_series(0, 2) s WHERE j.public_id = '%s'",
        job);
    db_sql(admin, q);
    snprintf(q, sizeof q,
             "UPDATE jobs SET state = 'succeeded', n_chunks = 3, n_completion_tokens = 3,"
             " finish_reason = 'stop', finished_at = now() WHERE public_id = '%s'",
             job);
    db_sql(admin, q);

    char *text = NULL;
    snprintf(uri, sizeof uri, "/v1/jobs/%s/events", job);
    CHECK(request("GET", uri, NULL, NULL, NULL, &text) == 200);
    CHECK(strstr(text, "Content-Type: text/event-stream\r\n") != NULL);
    const char *p0 =
        strstr(text, "id: 0\ndata: {\"seq\":0,\"kind\":\"reasoning\",\"text\":\"c0\"}\n\n");
    const char *p2 =
        strstr(text, "id: 2\ndata: {\"seq\":2,\"kind\":\"content\",\"text\":\"c2\"}\n\n");
    const char *end = strstr(text, "data: {\"state\":\"succeeded\",\"finish_reason\":\"stop\"");
    const char *done = strstr(text, "data: [DONE]\n\n");
    CHECK(p0 && p2 && end && done && p0 < p2 && p2 < end && end < done);
    CHECK(done && done[14] == '\0');  // nothing after [DONE]
    free(text);

    char *resume[] = {"HTTP_LAST_EVENT_ID=1", NULL};
    CHECK(request("GET", uri, NULL, resume, NULL, &text) == 200);
    CHECK(strstr(text, "id: 1\n") == NULL && strstr(text, "id: 2\n") != NULL);
    free(text);
    CHECK(request("GET", uri, "after=0", NULL, NULL, &text) == 200);
    CHECK(strstr(text, "id: 0\n") == NULL && strstr(text, "id: 1\n") != NULL);
    free(text);
    char *bad[] = {"HTTP_LAST_EVENT_ID=one", NULL};
    CHECK(request("GET", uri, NULL, bad, NULL, &text) == 400);
    CHECK(strstr(text, "\"param\":\"Last-Event-ID\"") != NULL);
    free(text);
    CHECK(request("GET", uri, "after=x", NULL, NULL, &text) == 400);
    free(text);

    snprintf(uri, sizeof uri, "/v1/jobs/%s", job);
    CHECK(request("GET", uri, NULL, NULL, NULL, &text) == 200);
    CHECK(strstr(text, "\"content\":\"c1c2\"") && strstr(text, "\"reasoning_content\":\"c0\""));
    free(text);
}

static void test_job_list(void)
{
    char *text = NULL;
    CHECK(request("GET", "/v1/jobs", "limit=1", NULL, NULL, &text) == 200);
    CHECK(strstr(text, "\"object\":\"list\"") && strstr(text, "\"scope\":\"user\""));
    free(text);
    CHECK(request("GET", "/v1/jobs", "limit=0", NULL, NULL, &text) == 400);
    free(text);
    CHECK(request("GET", "/v1/jobs", "limit=12345678901234567890", NULL, NULL, &text) == 400);
    free(text);
    char q[128] = "after=job-";
    memset(q + strlen(q), 'a', 80);
    CHECK(request("GET", "/v1/jobs", q, NULL, NULL, &text) == 400);
    free(text);
}

static bool is_listening(void)
{
    return atoi(
               value("SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN api_keys_revoked'"
                     " AND state = 'idle'"))
           == 1;
}

static void test_revoked(void)
{
    char *text = NULL;
    CHECK(request("GET", "/v1/models", NULL, NULL, NULL, &text) == 200);  // cached now
    free(text);
    const uint64_t clears = api_db_auth_clears();
    db_sql(admin, "UPDATE api_keys SET revoked_at = now() WHERE name = 'server'");
    for (int i = 0; i < 500 && api_db_auth_clears() == clears; i++)
        sleep_ms(10);
    CHECK(request("GET", "/v1/models", NULL, NULL, NULL, &text) == 401);
    CHECK(strstr(text, "invalid_api_key") != NULL);
    free(text);
}

int main(void)
{
    log_set_level(LOG_LEVEL_ERROR);
    const char *conninfo = NULL;
    if (!(admin = db_open_migrated("test_api_server_db", &conninfo))) return 1;
    // A one-token-per-character tokenizer is all enqueue needs (unknown characters: <unk>).
    const char *tok_json =
        "{\"version\":\"1.0\",\"added_tokens\":[],\"normalizer\":null,"
        "\"pre_tokenizer\":null,\"model\":{\"type\":\"BPE\",\"vocab\":{\"<unk>\":0,"
        "\"h\":1,\"i\":2},\"merges\":[],\"unk_token\":\"<unk>\"}}";
    Tokenizer *tok = NULL;
    CHECK(tok_load_json(&tok, tok_json, strlen(tok_json)) == ERR_OK);
    capture_models[0].tok = capture_models[1].tok = tok;
    db_make_key(admin, key, "server", "user");
    snprintf(auth_header, sizeof auth_header, "HTTP_AUTHORIZATION=Bearer %s", key);
    CHECK(api_db_init(&db, conninfo) == ERR_OK);
    CHECK(api_db_watch_revocations(conninfo) == ERR_OK);
    for (int i = 0; i < 500 && !is_listening(); i++)
        sleep_ms(10);
    CHECK(is_listening());

    test_key_and_forged_scope();
    test_models();
    test_idempotency_race();
    test_events();
    test_job_list();
    test_revoked();

    api_db_free(&db);
    tok_destroy(tok);
    PQfinish(admin);
    return check_exit();
}
