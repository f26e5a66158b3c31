/*
 * api_request.h - decode and validate the body of an OpenAI-style request.
 *
 * The one parser of outside bytes in fcgi/: JSON text in, a validated ApiRequest out, or
 * an ApiError that names the field and carries the HTTP status (always 400 here). Rules:
 * the body is a JSON object, strict JSON (no NaN, no comments, no trailing commas), valid
 * UTF-8, nesting depth at most 64, and no string holds U+0000 (PostgreSQL's jsonb cannot
 * store it). Unknown fields are ignored, as OpenAI-compatible servers do, so that newer
 * clients keep working. Numeric fields are range-checked; "n" other than 1 is refused.
 * tests/fuzz/fuzz_api_request.c fuzzes it; accepted requests satisfy api_request_check().
 *
 * Ownership: ApiRequest owns the parsed JSON tree; every pointer in it (model, messages,
 *            prompt, stop strings, tools) points into that tree and lives until
 *            api_request_free.
 * Threads:   reentrant; an ApiRequest belongs to one thread.
 * Errors:    ERR_FORMAT (not JSON, bad UTF-8, too deep) or ERR_INVAL (a field is wrong),
 *            both with *err filled for the client; ERR_NOMEM.
 */
#ifndef FCGI_API_REQUEST_H
#define FCGI_API_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <json-c/json.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define API_MAX_STOP 4
#define API_MAX_DEPTH 64

typedef enum ApiKind {
    API_KIND_CHAT,        // /v1/chat/completions and /v1/jobs
    API_KIND_COMPLETION,  // /v1/completions
} ApiKind;

// What the client is told: {"error": {"message", "type", "param", "code"}} with status.
typedef struct ApiError {
    int status;            // HTTP status
    const char *type;      // e.g. "invalid_request_error"; static storage
    const char *code;      // e.g. "context_length_exceeded", or NULL; static storage
    char param[64];        // offending field, or ""
    char message[256];
} ApiError;

#define API_MAX_TOP_LOGPROBS 20

// tool_choice. The prompt is rendered with the tools for AUTO, REQUIRED and FUNCTION (the
// model is not constrained: REQUIRED and FUNCTION are validated and recorded only) and
// without them for NONE, whose request then has no tools at all.
typedef enum ApiToolChoice {
    API_TOOL_CHOICE_AUTO,
    API_TOOL_CHOICE_NONE,
    API_TOOL_CHOICE_REQUIRED,
    API_TOOL_CHOICE_FUNCTION,
} ApiToolChoice;

// response_format. JSON_OBJECT and JSON_SCHEMA constrain the output (the engine masks
// the vocabulary token by token, engine/serve/constrain.h); the schema is validated here
// (engine/shared/json_grammar.h's subset).
typedef enum ApiFormat {
    API_FORMAT_TEXT,
    API_FORMAT_JSON_OBJECT,
    API_FORMAT_JSON_SCHEMA,
} ApiFormat;

typedef struct ApiRequest {
    ApiKind kind;
    json_object *root;          // owned: the whole body
    const char *model;          // "model"
    json_object *messages;      // chat: "messages" (a non-empty array)
    json_object *tools;         // chat: "tools" (an array) or NULL
    const char *prompt;         // completion: "prompt" text
    size_t n_prompt;
    bool stream;
    bool include_usage;         // stream_options.include_usage
    int max_tokens;             // max_tokens / max_completion_tokens; 0 when absent
    double temperature;         // default 1
    double top_p;               // default 1
    int top_k;                  // default 0 (off); -1 also means off
    double min_p;               // default 0
    double presence_penalty, frequency_penalty;  // default 0
    double repetition_penalty;  // default 1
    bool has_seed;
    int64_t seed;
    int n_stop;
    const char *stop[API_MAX_STOP];
    bool logprobs;              // chat: "logprobs"; completion: "logprobs" is an integer N
    int top_logprobs;           // alternatives per token, 0..API_MAX_TOP_LOGPROBS
    ApiToolChoice tool_choice;  // chat: "tool_choice"; default auto
    const char *tool_choice_name;  // API_TOOL_CHOICE_FUNCTION: the named function
    ApiFormat format;              // "response_format"; default text
    json_object *schema;           // API_FORMAT_JSON_SCHEMA: the schema (NULL: any value)
} ApiRequest;

// Parse body[0..n) as a request of the given kind. On success *r owns the tree; on failure
// *r is zeroed and *err says what is wrong (status 400).
Err api_request_parse(ApiRequest *r, ApiKind kind, const char *body, size_t n, ApiError *err);

// Free the tree; zeroes *r. Accepts a zeroed request.
void api_request_free(ApiRequest *r);

// The sampling and stop parameters as a new JSON object (the caller owns it) for the job
// row's request column: what the engine needs, in canonical form. NULL on OOM.
json_object *api_request_params(const ApiRequest *r);

// Invariants of an accepted request (used by the fuzz target): true when they all hold.
bool api_request_check(const ApiRequest *r);

// Fill *err. status 400 unless stated; type defaults to invalid_request_error.
void api_error_set(ApiError *err, int status, const char *type, const char *code,
                   const char *param, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

#ifdef __cplusplus
}
#endif
#endif  // FCGI_API_REQUEST_H
