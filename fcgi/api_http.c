/*
 * api_http.c - routing, parsing and header formatting without a database (see api_http.h).
 *
 * Everything here is a pure function of its arguments, so tests/fcgi/test_api_http.c can
 * pin the rules down: which path and method reach which handler, which query strings are
 * taken for a leaked key, and which header values are refused.
 */
#include "fcgi/api_http.h"

#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

// ---------------------------------------------------------------------------
// Routing

bool api_http_is_job_id(const char *s, size_t n)
{
    if (n < 5 || n > 60 || strncmp(s, "job-", 4) != 0) return false;
    for (size_t i = 4; i < n; i++)
        if (!isxdigit((unsigned char) s[i])) return false;
    return true;
}

// The job routes below /v1/jobs/: id, then nothing, /events or /cancel.
static ApiRoute route_job(bool is_get, bool is_post, const char *id, const char **arg,
                          size_t *n_arg)
{
    const char *rest = strchr(id, '/');
    const size_t n_id = rest ? (size_t) (rest - id) : strlen(id);
    if (!api_http_is_job_id(id, n_id)) return API_ROUTE_BAD_JOB;
    *arg = id;
    *n_arg = n_id;
    if (!rest) return is_get ? API_ROUTE_JOB_GET : API_ROUTE_METHOD;
    if (!strcmp(rest, "/events")) return is_get ? API_ROUTE_JOB_EVENTS : API_ROUTE_METHOD;
    if (!strcmp(rest, "/cancel")) return is_post ? API_ROUTE_JOB_CANCEL : API_ROUTE_METHOD;
    *arg = NULL;
    *n_arg = 0;
    return API_ROUTE_NONE;
}

ApiRoute api_http_route(const char *method, const char *path, const char **arg, size_t *n_arg)
{
    const bool is_get = !strcmp(method, "GET"), is_post = !strcmp(method, "POST");
    *arg = NULL;
    *n_arg = 0;
    if (!strcmp(path, "/health")) return API_ROUTE_HEALTH;
    if (!strcmp(path, "/internal/auth")) return API_ROUTE_AUTH;
    if (!strcmp(path, "/metrics")) return API_ROUTE_METRICS;
    if (!strcmp(path, "/v1/models")) return is_get ? API_ROUTE_MODELS : API_ROUTE_METHOD;
    if (!strncmp(path, "/v1/models/", 11)) {
        *arg = path + 11;
        *n_arg = strlen(path + 11);
        return is_get ? API_ROUTE_MODEL : API_ROUTE_METHOD;
    }
    if (!strcmp(path, "/v1/chat/completions")) return is_post ? API_ROUTE_CHAT : API_ROUTE_METHOD;
    if (!strcmp(path, "/v1/completions")) return is_post ? API_ROUTE_COMPLETIONS : API_ROUTE_METHOD;
    if (!strcmp(path, "/v1/jobs")) {
        return is_post ? API_ROUTE_JOB_SUBMIT : is_get ? API_ROUTE_JOB_LIST : API_ROUTE_METHOD;
    }
    if (!strncmp(path, "/v1/jobs/", 9)) return route_job(is_get, is_post, path + 9, arg, n_arg);
    return API_ROUTE_NONE;
}

// ---------------------------------------------------------------------------
// Request parsing

Err api_http_query_value(const char *q, const char *name, char *out, size_t cap)
{
    const size_t n = strlen(name);
    while (q && *q) {
        if (!strncmp(q, name, n) && q[n] == '=') {
            const char *v = q + n + 1;
            const size_t len = strcspn(v, "&");
            if (len >= cap) return ERR_INVAL;
            memcpy(out, v, len);
            out[len] = '\0';
            return ERR_OK;
        }
        q = strchr(q, '&');
        if (q) q++;
    }
    return ERR_NOTFOUND;
}

bool api_http_query_has_key(const char *q)
{
    if (!q) return false;
    for (const char *p = q; *p; p++) {
        if (!strncmp(p, "gsk_", 4) || !strncasecmp(p, "gsk%5f", 6)) return true;
        if ((p == q || p[-1] == '&')
            && (!strncasecmp(p, "api_key=", 8) || !strncasecmp(p, "key=", 4)
                || !strncasecmp(p, "access_token=", 13)))
            return true;
    }
    return false;
}

const char *api_http_bearer_key(const char *authorization, const char *x_api_key)
{
    const char *key = NULL;
    if (authorization && !strncasecmp(authorization, "Bearer ", 7))
        key = authorization + 7;
    else
        key = x_api_key;
    while (key && *key == ' ')
        key++;
    return key && *key ? key : NULL;
}

Err api_http_parse_event_id(const char *s, int *out)
{
    char *end = NULL;
    if (!s || !*s || isspace((unsigned char) *s)) return ERR_INVAL;
    const long long v = strtoll(s, &end, 10);
    if (*end || v < -1 || v > INT32_MAX) return ERR_INVAL;
    *out = (int) v;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Response headers

const char *api_http_reason_phrase(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 202:
        return "Accepted";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 409:
        return "Conflict";
    case 413:
        return "Payload Too Large";
    case 414:
        return "URI Too Long";
    case 429:
        return "Too Many Requests";
    case 500:
        return "Internal Server Error";
    case 503:
        return "Service Unavailable";
    default:
        return "Status";
    }
}

Err api_http_add_header(Buf *b, const char *name, const char *value)
{
    const size_t n = strlen(value);
    if (n > API_HTTP_MAX_HEADER) {
        LOG_ERROR("api: header \"%s\" is %zu bytes, over the limit of %d", name, n,
                  API_HTTP_MAX_HEADER);
        return ERR_INVAL;
    }
    if (strpbrk(value, "\r\n")) {
        LOG_ERROR("api: header \"%s\" holds a line break", name);
        return ERR_INVAL;
    }
    return buf_addf(b, "%s: %s\r\n", name, value);
}
