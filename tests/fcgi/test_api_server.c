/*
 * test_api_server.c - api_server_handle driven through in-memory FastCGI streams, with no
 * database (its conninfo points at a socket directory that does not exist).
 *
 * What needs no database is checked on every route: a request that sets nginx's old
 * identity parameters itself (GLMSPARK_KEY_ID=1, scope admin, ...) with no key, or with a
 * malformed key, is answered 401 with a JSON error and WWW-Authenticate, before any body
 * is read; a key in the query string is 401 api_key_in_query; an over-long path is 414
 * (refused, not cut); /internal/auth without a key is 401; /health without a database is
 * 503 with "database": false. Each answer's header block is checked for shape (Status
 * line, CRLF, blank line, then the body).
 */
#include <stdlib.h>
#include <string.h>

#include "tests/fcgi/fcgi_capture.h"

static ApiDb db;
static ApiConfig cfg = CAPTURE_CONFIG;

// Answer one request; nothing here may read a body before authenticating.
static char *handle(char **envp, const char *body)
{
    size_t n_read = 0;
    char *text = capture_handle(envp, body, &db, &cfg, &n_read);
    CHECK(n_read == 0);
    return text;
}

static const struct {
    const char *method, *uri;
} routes[] = {
    {"GET", "/v1/models"},
    {"GET", "/v1/models/glmspark-demo"},
    {"POST", "/v1/chat/completions"},
    {"POST", "/v1/completions"},
    {"POST", "/v1/jobs"},
    {"GET", "/v1/jobs"},
    {"GET", "/v1/jobs/job-0123abcd"},
    {"GET", "/v1/jobs/job-0123abcd/events"},
    {"POST", "/v1/jobs/job-0123abcd/cancel"},
    {"GET", "/metrics"},
    {"GET", "/v1/nonexistent"},
    {"DELETE", "/v1/jobs"},
};

// Every route, with forged identity parameters and the given Authorization (NULL: none),
// must answer 401 with code.
static void forged(const char *authorization, const char *code)
{
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        char method[32], uri[128], auth[128];
        snprintf(method, sizeof method, "REQUEST_METHOD=%s", routes[i].method);
        snprintf(uri, sizeof uri, "DOCUMENT_URI=%s", routes[i].uri);
        snprintf(auth, sizeof auth, "HTTP_AUTHORIZATION=%s", authorization ? authorization : "");
        char *envp[] = {method,
                        uri,
                        "QUERY_STRING=",
                        "CONTENT_LENGTH=2",
                        "GLMSPARK_KEY_ID=1",
                        "GLMSPARK_KEY_SCOPE=admin",
                        "GLMSPARK_KEY_PREFIX=gsk_forgedforged",
                        "GLMSPARK_KEY_RPM=0",
                        "GLMSPARK_KEY_MAX_CONCURRENT=0",
                        authorization ? auth : NULL,
                        NULL};
        char *text = handle(envp, "{}");
        const char *body = NULL;
        const int status = capture_status(text, &body);
        if (status != 401)
            fprintf(stderr, "%s %s: %.200s\n", routes[i].method, routes[i].uri, text);
        CHECK(status == 401);
        CHECK(strstr(text, "WWW-Authenticate: Bearer\r\n") != NULL);
        CHECK(strstr(text, "Content-Type: application/json\r\n") != NULL);
        CHECK(body && strstr(body, code) != NULL);
        CHECK(body && strstr(body, "\"type\":\"invalid_request_error\"") != NULL);
        free(text);
    }
}

static void test_forged_identity(void)
{
    forged(NULL, "\"code\":\"missing_api_key\"");
    forged("Bearer not-a-key", "\"code\":\"invalid_api_key\"");
    forged("Basic Z3NrOng=", "\"code\":\"missing_api_key\"");
}

// Answer envp and check the status and that the whole response holds needle (and, when
// absent is not NULL, does not hold it).
static void expect(char **envp, int status, const char *needle, const char *absent)
{
    char *text = handle(envp, NULL);
    const char *body = NULL;
    const int got = capture_status(text, &body);
    if (got != status) fprintf(stderr, "want %d: %.300s\n", status, text);
    CHECK(got == status);
    CHECK(strstr(text, needle) != NULL);
    if (absent) CHECK(strstr(text, absent) == NULL);
    free(text);
}

static void test_other_answers(void)
{
    char *query[] = {"REQUEST_METHOD=GET", "DOCUMENT_URI=/v1/models", "QUERY_STRING=api_key=gsk_x",
                     "HTTP_AUTHORIZATION=Bearer gsk_x", NULL};
    expect(query, 401, "\"code\":\"api_key_in_query\"", NULL);

    char uri[600] = "DOCUMENT_URI=/v1/jobs/job-";
    memset(uri + strlen(uri), 'a', 400);
    char *long_path[] = {"REQUEST_METHOD=GET", uri, NULL};
    expect(long_path, 414, "\"code\":\"uri_too_long\"", NULL);

    char *auth[] = {"REQUEST_METHOD=GET", "DOCUMENT_URI=/internal/auth", "GLMSPARK_KEY_ID=1",
                    "GLMSPARK_KEY_SCOPE=admin", NULL};
    expect(auth, 401, "Content-Type: text/plain", "X-Key-Id");

    char *health[] = {"REQUEST_METHOD=GET", "DOCUMENT_URI=/health", NULL};
    expect(health, 503, "\"database\":false", NULL);
}

int main(void)
{
    log_set_level(LOG_LEVEL_ERROR);
    CHECK(api_db_init(&db, "host=/nonexistent-glmspark-test dbname=none connect_timeout=1")
          == ERR_OK);
    db.retry_ms = 100;
    test_forged_identity();
    test_other_answers();
    api_db_free(&db);
    return check_exit();
}
