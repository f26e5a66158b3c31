/*
 * api_http.h - the HTTP pieces of glmspark-fcgi that need no database: routing, query-string
 * and header parsing, and header formatting (into a Buf, engine/shared/buf.h).
 *
 * api_server.c answers requests with these; they are separate so that the routing and
 * parsing rules can be tested without a FastCGI socket (tests/fcgi/test_api_http.c). A
 * request's path is matched to an ApiRoute with its job id; a route that exists for
 * another method is API_ROUTE_METHOD (405), an unknown one API_ROUTE_NONE (404), and a
 * malformed job id API_ROUTE_BAD_JOB (404 "no such job").
 *
 * Header values are checked rather than cut: a value longer than API_HTTP_MAX_HEADER
 * bytes, or holding CR or LF (which would split the header block), is refused with
 * ERR_INVAL and logged, so that nothing the client sees was silently truncated.
 *
 * Ownership: every function borrows its arguments for the call.
 * Threads:   everything may run on any thread; nothing here has state.
 * Errors:    ERR_NOMEM when the Buf cannot grow; ERR_INVAL for a header value that
 *            cannot be sent (logged once, here).
 */
#ifndef FCGI_API_HTTP_H
#define FCGI_API_HTTP_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/shared/buf.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

// Longest header value we send (nginx's default proxy/fastcgi buffer is 4 KiB for the
// whole header block; 1 KiB per value leaves room for the others).
#define API_HTTP_MAX_HEADER 1024

typedef enum ApiRoute {
    API_ROUTE_NONE,         // no such endpoint: 404
    API_ROUTE_METHOD,       // the endpoint exists, not for this method: 405
    API_ROUTE_BAD_JOB,      // /v1/jobs/<not a job id>...: 404 job_not_found
    API_ROUTE_HEALTH,       // GET /health (any method, as before)
    API_ROUTE_AUTH,         // /internal/auth
    API_ROUTE_METRICS,      // /metrics
    API_ROUTE_MODELS,       // GET /v1/models
    API_ROUTE_MODEL,        // GET /v1/models/{name}
    API_ROUTE_CHAT,         // POST /v1/chat/completions
    API_ROUTE_COMPLETIONS,  // POST /v1/completions
    API_ROUTE_JOB_SUBMIT,   // POST /v1/jobs
    API_ROUTE_JOB_LIST,     // GET /v1/jobs
    API_ROUTE_JOB_GET,      // GET /v1/jobs/{id}
    API_ROUTE_JOB_EVENTS,   // GET /v1/jobs/{id}/events
    API_ROUTE_JOB_CANCEL,   // POST /v1/jobs/{id}/cancel
} ApiRoute;

// Match method and path (no query string) to a route. *arg gets the job id or the model
// name (a pointer into path, *n_arg bytes) for the routes that carry one, else NULL/0.
ApiRoute api_http_route(const char *method, const char *path, const char **arg, size_t *n_arg);

// True for "job-" followed by 1..56 hex digits (s[0..n)).
bool api_http_is_job_id(const char *s, size_t n);

// Copy the value of name in the query string q (may be NULL) into out[cap].
// ERR_NOTFOUND when absent; ERR_INVAL when the value is longer than cap - 1 (refused
// rather than cut; nothing is logged: it is the client's error to report).
Err api_http_query_value(const char *q, const char *name, char *out, size_t cap);

// True when the query string carries something that looks like an API key.
bool api_http_query_has_key(const char *q);

// The API key a request presents: "Authorization: Bearer <key>" (case-insensitive
// scheme, spaces skipped), else the X-Api-Key header. A pointer into one of the two
// arguments (either may be NULL); NULL when neither carries a non-empty key.
const char *api_http_bearer_key(const char *authorization, const char *x_api_key);

// Parse a Last-Event-ID value: a chunk seq in -1..INT32_MAX. ERR_INVAL otherwise.
Err api_http_parse_event_id(const char *s, int *out);

// The reason phrase of an HTTP status we send ("Status" for others). Static storage.
const char *api_http_reason_phrase(int status);

// Append "name: value\r\n" to b. ERR_INVAL (logged with the header's name and length) when
// value is longer than API_HTTP_MAX_HEADER or holds CR or LF; ERR_NOMEM.
Err api_http_add_header(Buf *b, const char *name, const char *value);

#ifdef __cplusplus
}
#endif
#endif  // FCGI_API_HTTP_H
