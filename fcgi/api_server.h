/*
 * api_server.h - the HTTP API of glmspark-fcgi: routes one FastCGI request to its handler.
 *
 * Routes (all JSON; errors are OpenAI error objects):
 *   GET  /v1/models, /v1/models/{name}     the configured models that a live engine serves
 *                                          (engines: not stopped, heartbeat under 30 s)
 *   POST /v1/chat/completions, /v1/completions   a job, answered when done or streamed (SSE)
 *   POST /v1/jobs                          a job, answered at once with 202 and its id
 *   GET  /v1/jobs, /v1/jobs/{id}           own jobs (admin keys: all), paged with ?limit&after
 *   GET  /v1/jobs/{id}/events              SSE of the output; id: = chunk seq; resumable with
 *                                          Last-Event-ID; ": keep-alive" every 15 s; ends with
 *                                          data: [DONE]
 *   POST /v1/jobs/{id}/cancel
 *   GET  /health, /metrics                 engine heartbeat (200/503), Prometheus text
 *   GET  /internal/auth                    nginx auth_request: 200 + X-Key-* headers, or 401
 * Identity: every request is authenticated here, from the key it presents (Authorization:
 * Bearer, or X-Api-Key), through the process's auth cache; FastCGI parameters never carry
 * identity, because anything that can connect to the socket can set them. nginx's
 * auth_request (to /internal/auth) only rejects bad keys early, before a body is read, and
 * warms the cache for the real request. So the socket's file mode is defence in depth,
 * not authentication.
 * Streams outlive database outages: reads retry, keep-alives go on, a client that leaves
 * is noticed at the next keep-alive, and after stream_outage_s without the database the
 * stream ends with an error event and [DONE] (resumable with Last-Event-ID).
 *
 * Models: the process knows each model it accepts (ApiModel: served name, tokenizer, chat
 * template, context); a request names one, or gets 404 model_not_found. A job of a known
 * model is queued even while no engine of it is live (nothing accepted is lost: an engine of
 * that model claims it when it comes), but /v1/models lists only the models some live engine
 * serves, so clients see what answers now.
 *
 * Ownership: ApiConfig, its models and their tokenizers are borrowed and must outlive every
 *            call.
 * Threads:   api_server_handle may run on many threads at once, each with its own ApiDb.
 * Errors:    reported to the client; nothing is returned.
 */
#ifndef FCGI_API_SERVER_H
#define FCGI_API_SERVER_H

#include <fcgiapp.h>
#include <stdbool.h>
#include <stddef.h>

#include "engine/shared/chat.h"
#include "engine/shared/tokenizer.h"
#include "fcgi/api_db.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { API_MAX_MODELS = 16 };  // models one process accepts

typedef struct ApiModel {
    const char *name;  // served model id, e.g. "GLM-5.2-NVFP4-REAP-469B" (jobs.model)
    const Tokenizer *tok;  // borrowed
    ChatTemplate chat_template;
    int context_len;  // prompt + completion tokens per sequence
} ApiModel;

typedef struct ApiConfig {
    const ApiModel *models;    // [n_models], distinct names; borrowed
    int n_models;              // 1 .. API_MAX_MODELS
    int max_queue;             // queued jobs before 503; 0 = unlimited
    size_t max_body_bytes;     // larger bodies get 413
    int keepalive_s;           // SSE keep-alive comment interval (15)
    int poll_ms;               // fallback poll when no notification arrives (1000)
    int stream_outage_s;       // a stream gives up after this long without the database (300)
} ApiConfig;

// Answer one request. Does not call FCGX_Finish_r.
void api_server_handle(FCGX_Request *req, ApiDb *db, const ApiConfig *cfg);

#ifdef __cplusplus
}
#endif
#endif  // FCGI_API_SERVER_H
