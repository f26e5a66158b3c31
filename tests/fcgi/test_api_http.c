/*
 * test_api_http.c - the parts of the HTTP surface that need no database: routing (every
 * route, the wrong method, malformed job ids), query strings (values, keys leaked into
 * them, over-long values refused), the presented key, Last-Event-ID and header formatting
 * (over-long and line-breaking values refused, never cut). The buffer the headers go into
 * is tested in tests/engine/shared/test_buf.c.
 */
#include <stdlib.h>
#include <string.h>

#include "fcgi/api_http.h"
#include "tests/check.h"

static ApiRoute route(const char *method, const char *path, const char **arg, size_t *n_arg)
{
    return api_http_route(method, path, arg, n_arg);
}

static void test_routes(void)
{
    const char *arg;
    size_t n;
    static const struct {
        const char *method, *path;
        ApiRoute want;
    } cases[] = {
        {"GET", "/health", API_ROUTE_HEALTH},
        {"POST", "/health", API_ROUTE_HEALTH},
        {"GET", "/internal/auth", API_ROUTE_AUTH},
        {"GET", "/metrics", API_ROUTE_METRICS},
        {"GET", "/v1/models", API_ROUTE_MODELS},
        {"POST", "/v1/models", API_ROUTE_METHOD},
        {"GET", "/v1/models/glmspark-demo", API_ROUTE_MODEL},
        {"DELETE", "/v1/models/x", API_ROUTE_METHOD},
        {"POST", "/v1/chat/completions", API_ROUTE_CHAT},
        {"GET", "/v1/chat/completions", API_ROUTE_METHOD},
        {"POST", "/v1/completions", API_ROUTE_COMPLETIONS},
        {"PUT", "/v1/completions", API_ROUTE_METHOD},
        {"POST", "/v1/jobs", API_ROUTE_JOB_SUBMIT},
        {"GET", "/v1/jobs", API_ROUTE_JOB_LIST},
        {"DELETE", "/v1/jobs", API_ROUTE_METHOD},
        {"GET", "/v1/jobs/job-0123abcdef", API_ROUTE_JOB_GET},
        {"POST", "/v1/jobs/job-0123abcdef", API_ROUTE_METHOD},
        {"GET", "/v1/jobs/job-0123abcdef/events", API_ROUTE_JOB_EVENTS},
        {"POST", "/v1/jobs/job-0123abcdef/events", API_ROUTE_METHOD},
        {"POST", "/v1/jobs/job-0123abcdef/cancel", API_ROUTE_JOB_CANCEL},
        {"GET", "/v1/jobs/job-0123abcdef/cancel", API_ROUTE_METHOD},
        {"GET", "/v1/jobs/job-0123abcdef/other", API_ROUTE_NONE},
        {"GET", "/v1/jobs/job-0123abcdef/events/", API_ROUTE_NONE},
        {"GET", "/v1/jobs/job-xyz", API_ROUTE_BAD_JOB},
        {"GET", "/v1/jobs/", API_ROUTE_BAD_JOB},
        {"GET", "/v1/jobs/../../etc/passwd", API_ROUTE_BAD_JOB},
        {"GET", "/", API_ROUTE_NONE},
        {"GET", "", API_ROUTE_NONE},
        {"GET", "/v1", API_ROUTE_NONE},
        {"GET", "/v1/modelsx", API_ROUTE_NONE},
        {"GET", "/internal/auth/x", API_ROUTE_NONE},
        {"GET", "/HEALTH", API_ROUTE_NONE},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const ApiRoute got = route(cases[i].method, cases[i].path, &arg, &n);
        if (got != cases[i].want)
            fprintf(stderr, "%s %s: route %d, want %d\n", cases[i].method, cases[i].path, got,
                    cases[i].want);
        CHECK(got == cases[i].want);
    }
    CHECK(route("GET", "/v1/jobs/job-0123abcdef/events", &arg, &n) == API_ROUTE_JOB_EVENTS);
    CHECK(n == 14 && !strncmp(arg, "job-0123abcdef", n));
    CHECK(route("GET", "/v1/models/glmspark-demo", &arg, &n) == API_ROUTE_MODEL);
    CHECK(n == 13 && !strcmp(arg, "glmspark-demo"));
    CHECK(route("GET", "/v1/models", &arg, &n) == API_ROUTE_MODELS && !arg && n == 0);
    CHECK(route("GET", "/v1/jobs/job-0123abcdef/x", &arg, &n) == API_ROUTE_NONE && !arg);
}

static void test_job_ids(void)
{
    CHECK(api_http_is_job_id("job-a", 5));
    CHECK(api_http_is_job_id("job-0123456789abcdefABCDEF", 26));
    CHECK(!api_http_is_job_id("job-", 4));
    CHECK(!api_http_is_job_id("job-g", 5));
    CHECK(!api_http_is_job_id("jobs-1", 6));
    CHECK(!api_http_is_job_id("job-1 ", 6));
    char long_id[80] = "job-";
    memset(long_id + 4, 'a', 57);  // 61 characters: one too many
    CHECK(!api_http_is_job_id(long_id, 61));
    CHECK(api_http_is_job_id(long_id, 60));
}

static void test_query(void)
{
    char v[8];
    CHECK(api_http_query_value("limit=5&after=job-1", "limit", v, sizeof v) == ERR_OK
          && !strcmp(v, "5"));
    CHECK(api_http_query_value("limit=5&after=job-1", "after", v, sizeof v) == ERR_OK
          && !strcmp(v, "job-1"));
    CHECK(api_http_query_value("xlimit=5", "limit", v, sizeof v) == ERR_NOTFOUND);
    CHECK(api_http_query_value("limit", "limit", v, sizeof v) == ERR_NOTFOUND);
    CHECK(api_http_query_value("limit=", "limit", v, sizeof v) == ERR_OK && !strcmp(v, ""));
    CHECK(api_http_query_value(NULL, "limit", v, sizeof v) == ERR_NOTFOUND);
    CHECK(api_http_query_value("", "limit", v, sizeof v) == ERR_NOTFOUND);
    // Seven characters fit in v[8]; eight are refused, not cut to seven.
    CHECK(api_http_query_value("a=1234567", "a", v, sizeof v) == ERR_OK && !strcmp(v, "1234567"));
    CHECK(api_http_query_value("a=12345678", "a", v, sizeof v) == ERR_INVAL);

    CHECK(api_http_query_has_key("api_key=x"));
    CHECK(api_http_query_has_key("a=1&KEY=x"));
    CHECK(api_http_query_has_key("access_token=x"));
    CHECK(api_http_query_has_key("q=gsk_abc"));
    CHECK(api_http_query_has_key("q=GSK%5Fabc"));
    CHECK(!api_http_query_has_key("monkey=1"));
    CHECK(!api_http_query_has_key("limit=5&after=job-1"));
    CHECK(!api_http_query_has_key(NULL));
    CHECK(!api_http_query_has_key(""));
}

static void test_bearer(void)
{
    CHECK(!strcmp(api_http_bearer_key("Bearer gsk_a", NULL), "gsk_a"));
    CHECK(!strcmp(api_http_bearer_key("bearer   gsk_a", NULL), "gsk_a"));
    CHECK(!strcmp(api_http_bearer_key(NULL, "gsk_b"), "gsk_b"));
    CHECK(!strcmp(api_http_bearer_key("Basic xyz", "gsk_b"), "gsk_b"));
    CHECK(api_http_bearer_key("Basic xyz", NULL) == NULL);
    CHECK(api_http_bearer_key("Bearer ", NULL) == NULL);
    CHECK(api_http_bearer_key("Bearer    ", "") == NULL);
    CHECK(api_http_bearer_key(NULL, NULL) == NULL);
    CHECK(api_http_bearer_key("", "") == NULL);
}

static void test_event_id(void)
{
    int v = 99;
    CHECK(api_http_parse_event_id("0", &v) == ERR_OK && v == 0);
    CHECK(api_http_parse_event_id("-1", &v) == ERR_OK && v == -1);
    CHECK(api_http_parse_event_id("2147483647", &v) == ERR_OK && v == 2147483647);
    v = 99;
    CHECK(api_http_parse_event_id("2147483648", &v) == ERR_INVAL && v == 99);
    CHECK(api_http_parse_event_id("-2", &v) == ERR_INVAL);
    CHECK(api_http_parse_event_id("12x", &v) == ERR_INVAL);
    CHECK(api_http_parse_event_id(" 12", &v) == ERR_INVAL);
    CHECK(api_http_parse_event_id("", &v) == ERR_INVAL);
    CHECK(api_http_parse_event_id(NULL, &v) == ERR_INVAL);
    CHECK(api_http_parse_event_id("99999999999999999999999", &v) == ERR_INVAL);
}

static void test_headers(void)
{
    Buf b = {0};
    CHECK(api_http_add_header(&b, "Location", "/v1/jobs/job-1") == ERR_OK);
    CHECK(!strcmp(b.p, "Location: /v1/jobs/job-1\r\n"));
    const size_t n = b.n;
    CHECK(api_http_add_header(&b, "X-Evil", "a\r\nSet-Cookie: x") == ERR_INVAL && b.n == n);
    CHECK(api_http_add_header(&b, "X-Evil", "a\nb") == ERR_INVAL && b.n == n);
    char *v = malloc(API_HTTP_MAX_HEADER + 2);
    memset(v, 'v', API_HTTP_MAX_HEADER + 1);
    v[API_HTTP_MAX_HEADER + 1] = '\0';
    CHECK(api_http_add_header(&b, "X-Long", v) == ERR_INVAL && b.n == n);  // refused, not cut
    v[API_HTTP_MAX_HEADER] = '\0';
    CHECK(api_http_add_header(&b, "X-Long", v) == ERR_OK);
    CHECK(b.n == n + strlen("X-Long: \r\n") + API_HTTP_MAX_HEADER);
    free(v);
    buf_free(&b);

    CHECK(!strcmp(api_http_reason_phrase(200), "OK"));
    CHECK(!strcmp(api_http_reason_phrase(401), "Unauthorized"));
    CHECK(!strcmp(api_http_reason_phrase(414), "URI Too Long"));
    CHECK(!strcmp(api_http_reason_phrase(503), "Service Unavailable"));
    CHECK(!strcmp(api_http_reason_phrase(599), "Status"));
}

int main(void)
{
    test_routes();
    test_job_ids();
    test_query();
    test_bearer();
    test_event_id();
    test_headers();
    return check_exit();
}
