/*
 * fuzz_api_http.c - libFuzzer target for the request-line parsing of fcgi/api_http.c:
 * routing, query strings, the presented key, Last-Event-ID and header values.
 *
 * The input is "<path>\n<rest>" (no newline: all path); rest serves as query string,
 * Authorization value, Last-Event-ID and header value. Invariants: a route's argument
 * lies inside the path and a job route's argument is a valid job id; a query value fits
 * its buffer and holds no '&'; an accepted Last-Event-ID is in -1..INT32_MAX; a presented
 * key is non-empty and starts with no space; an accepted header is exactly
 * "name: value\r\n" with no other line break, a refused one leaves the buffer unchanged.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/err.h"
#include "fcgi/api_http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = malloc(size + 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';  // an embedded NUL ends the text early, as FastCGI params do
    char *rest = strchr(buf, '\n');
    if (rest)
        *rest++ = '\0';
    else
        rest = buf + strlen(buf);
    const char *path = buf;

    static const char *const methods[] = {"GET", "POST", "DELETE"};
    for (int m = 0; m < 3; m++) {
        const char *arg = NULL;
        size_t n_arg = 0;
        const ApiRoute r = api_http_route(methods[m], path, &arg, &n_arg);
        if (arg) ASSERT(arg >= path && arg + n_arg <= path + strlen(path));
        if (r >= API_ROUTE_JOB_GET) ASSERT(api_http_is_job_id(arg, n_arg));
        if (r == API_ROUTE_BAD_JOB || r == API_ROUTE_NONE) ASSERT(!arg && !n_arg);
    }

    char v[16];
    const Err qerr = api_http_query_value(rest, "after", v, sizeof v);
    if (!qerr) ASSERT(strlen(v) < sizeof v && !strchr(v, '&'));
    (void) api_http_query_has_key(rest);

    const char *key = api_http_bearer_key(rest, path);
    if (key) ASSERT(*key && *key != ' ');

    int seq = 0;
    if (!api_http_parse_event_id(rest, &seq)) ASSERT(seq >= -1);

    Buf b = {0};
    const Err herr = api_http_add_header(&b, "X-Test", rest);
    if (!herr) {
        ASSERT(b.n == strlen("X-Test: \r\n") + strlen(rest));
        ASSERT(strcspn(b.p, "\r\n") == b.n - 2);
    } else {
        ASSERT(b.n == 0);
    }
    buf_free(&b);
    free(buf);
    return 0;
}
