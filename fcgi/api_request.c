/*
 * api_request.c - JSON request body to ApiRequest, with the checks listed in the header.
 *
 * json-c does the tokenizing in strict mode with UTF-8 validation and a depth limit; we
 * then walk the tree once more, because json-c still lets through NaN and Infinity,
 * overlong UTF-8 forms, unpaired surrogate escapes and U+0000 (kept with an explicit
 * length), none of which PostgreSQL's jsonb or a client should ever see. Then each field
 * is read with its type and range. Errors name the field in
 * the OpenAI style ("messages", "stop[1]", "stream_options.include_usage").
 */
#include "fcgi/api_request.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "engine/shared/json_grammar.h"

void api_error_set(ApiError *err, int status, const char *type, const char *code,
                   const char *param, const char *fmt, ...)
{
    err->status = status;
    err->type = type ? type : "invalid_request_error";
    err->code = code;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

// ---------------------------------------------------------------------------
// Tree checks

// True when s[0..n) is strict UTF-8: shortest forms only, no surrogates (UTF-8-encoded
// ones; escaped ones are has_lone_surrogate's), nothing above U+10FFFF, and no NUL byte.
static bool is_clean_utf8(const char *str, size_t n)
{
    const unsigned char *s = (const unsigned char *) str;
    size_t i = 0;
    while (i < n) {
        const unsigned c = s[i];
        if (c == 0) return false;
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned cp, min;
        if ((c & 0xE0) == 0xC0) len = 2, cp = c & 0x1F, min = 0x80;
        else if ((c & 0xF0) == 0xE0) len = 3, cp = c & 0x0F, min = 0x800;
        else if ((c & 0xF8) == 0xF0) len = 4, cp = c & 0x07, min = 0x10000;
        else return false;
        if (i + len > n) return false;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += len;
    }
    return true;
}

static unsigned hex4(const char *s)
{
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        const char c = s[k];
        const unsigned d = c >= '0' && c <= '9'   ? (unsigned) (c - '0')
                           : c >= 'a' && c <= 'f' ? (unsigned) (c - 'a' + 10)
                           : c >= 'A' && c <= 'F' ? (unsigned) (c - 'A' + 10)
                                                  : 16u;
        if (d == 16u) return 0xFFFFFFFFu;
        v = v << 4 | d;
    }
    return v;
}

// True when a string of the text (already parsed as valid JSON) holds a \uD800-\uDFFF
// escape that is not a high+low pair. json-c replaces such an escape with U+FFFD, which
// would silently change the client's text, so this check reads the raw body.
static bool has_lone_surrogate(const char *s, size_t n)
{
    bool in_string = false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '"') {
            in_string = !in_string;
            continue;
        }
        if (!in_string || s[i] != '\\') continue;
        if (++i >= n) return false;  // cannot happen in valid JSON
        if (s[i] != 'u') continue;
        if (i + 4 >= n) return false;
        const unsigned cp = hex4(s + i + 1);
        i += 4;  // on the last hex digit
        if (cp >= 0xDC00 && cp <= 0xDFFF) return true;
        if (cp < 0xD800 || cp > 0xDBFF) continue;
        if (i + 6 >= n || s[i + 1] != '\\' || s[i + 2] != 'u') return true;
        const unsigned lo = hex4(s + i + 3);
        if (lo < 0xDC00 || lo > 0xDFFF) return true;
        i += 6;
    }
    return false;
}

// Check every value of the tree: strings (and keys) are clean UTF-8 without NUL, numbers
// are finite (json-c accepts NaN and Infinity even in strict mode). NULL when all is
// well, else a message.
static const char *bad_value(json_object *v)
{
    switch (json_object_get_type(v)) {
    case json_type_string:
        return is_clean_utf8(json_object_get_string(v), (size_t) json_object_get_string_len(v))
                   ? NULL
                   : "strings must be valid UTF-8 without U+0000 or unpaired surrogates";
    case json_type_double:
        return isfinite(json_object_get_double(v)) ? NULL : "numbers must be finite (no NaN or Infinity)";
    case json_type_array: {
        const size_t n = json_object_array_length(v);
        for (size_t i = 0; i < n; i++) {
            const char *bad = bad_value(json_object_array_get_idx(v, i));
            if (bad) return bad;
        }
        return NULL;
    }
    case json_type_object: {
        json_object_object_foreach(v, key, val) {
            if (!is_clean_utf8(key, strlen(key))) return "keys must be valid UTF-8";
            const char *bad = bad_value(val);
            if (bad) return bad;
        }
        return NULL;
    }
    default:
        return NULL;
    }
}

// ---------------------------------------------------------------------------
// Field readers: each returns false after filling *err.

static bool get_number(json_object *root, const char *key, double lo, double hi, double *out,
                       ApiError *err)
{
    json_object *v;
    if (!json_object_object_get_ex(root, key, &v) || json_object_is_type(v, json_type_null))
        return true;
    if (!json_object_is_type(v, json_type_double) && !json_object_is_type(v, json_type_int)) {
        api_error_set(err, 400, NULL, NULL, key, "'%s' must be a number", key);
        return false;
    }
    const double x = json_object_get_double(v);
    if (!isfinite(x) || x < lo || x > hi) {
        api_error_set(err, 400, NULL, NULL, key, "'%s' must be between %g and %g", key, lo, hi);
        return false;
    }
    *out = x;
    return true;
}

static bool get_int(json_object *root, const char *key, int64_t lo, int64_t hi, int64_t *out,
                    bool *present, ApiError *err)
{
    json_object *v;
    if (!json_object_object_get_ex(root, key, &v) || json_object_is_type(v, json_type_null))
        return true;
    if (!json_object_is_type(v, json_type_int)) {
        api_error_set(err, 400, NULL, NULL, key, "'%s' must be an integer", key);
        return false;
    }
    const int64_t x = json_object_get_int64(v);
    if (x < lo || x > hi) {
        api_error_set(err, 400, NULL, NULL, key, "'%s' must be between %lld and %lld", key,
                      (long long) lo, (long long) hi);
        return false;
    }
    *out = x;
    if (present) *present = true;
    return true;
}

static bool get_bool(json_object *root, const char *key, bool *out, ApiError *err)
{
    json_object *v;
    if (!json_object_object_get_ex(root, key, &v) || json_object_is_type(v, json_type_null))
        return true;
    if (!json_object_is_type(v, json_type_boolean)) {
        api_error_set(err, 400, NULL, NULL, key, "'%s' must be a boolean", key);
        return false;
    }
    *out = json_object_get_boolean(v);
    return true;
}

static bool get_stop(ApiRequest *r, ApiError *err)
{
    json_object *v;
    if (!json_object_object_get_ex(r->root, "stop", &v) || json_object_is_type(v, json_type_null))
        return true;
    if (json_object_is_type(v, json_type_string)) {
        if (json_object_get_string_len(v) == 0) {
            api_error_set(err, 400, NULL, NULL, "stop", "'stop' strings must not be empty");
            return false;
        }
        r->stop[r->n_stop++] = json_object_get_string(v);
        return true;
    }
    if (!json_object_is_type(v, json_type_array) ||
        json_object_array_length(v) > API_MAX_STOP) {
        api_error_set(err, 400, NULL, NULL, "stop",
                      "'stop' must be a string or an array of at most %d strings", API_MAX_STOP);
        return false;
    }
    for (size_t i = 0; i < json_object_array_length(v); i++) {
        json_object *s = json_object_array_get_idx(v, i);
        if (!json_object_is_type(s, json_type_string) || json_object_get_string_len(s) == 0) {
            char param[32];
            snprintf(param, sizeof param, "stop[%zu]", i);
            api_error_set(err, 400, NULL, NULL, param, "'%s' must be a non-empty string", param);
            return false;
        }
        r->stop[r->n_stop++] = json_object_get_string(s);
    }
    return true;
}

// The name of tools[i]'s function ({"type": "function", "function": {"name": ...}}), or NULL.
static const char *tool_name(json_object *tool)
{
    json_object *fn, *name;
    if (!json_object_is_type(tool, json_type_object)) return NULL;
    if (!json_object_object_get_ex(tool, "function", &fn)) fn = tool;
    if (!json_object_is_type(fn, json_type_object) || !json_object_object_get_ex(fn, "name", &name) ||
        !json_object_is_type(name, json_type_string))
        return NULL;
    return json_object_get_string(name);
}

// "tool_choice": "none" | "auto" | "required" | {"type": "function", "function": {"name"}}.
// "none" removes the tools from the request, so the prompt is rendered without them.
static bool get_tool_choice(ApiRequest *r, ApiError *err)
{
    json_object *v, *fn, *name;
    r->tool_choice = API_TOOL_CHOICE_AUTO;
    if (!json_object_object_get_ex(r->root, "tool_choice", &v) || json_object_is_type(v, json_type_null))
        return true;
    if (json_object_is_type(v, json_type_string)) {
        const char *s = json_object_get_string(v);
        if (!strcmp(s, "auto")) return true;
        if (!strcmp(s, "none")) {
            r->tool_choice = API_TOOL_CHOICE_NONE;
            r->tools = NULL;
            json_object_object_del(r->root, "tools");
            return true;
        }
        if (!strcmp(s, "required")) {
            if (!r->tools) {
                api_error_set(err, 400, NULL, NULL, "tool_choice",
                              "'tool_choice' is \"required\" but no 'tools' were given");
                return false;
            }
            r->tool_choice = API_TOOL_CHOICE_REQUIRED;
            return true;
        }
        api_error_set(err, 400, NULL, NULL, "tool_choice",
                      "'tool_choice' must be \"none\", \"auto\", \"required\" or a function object");
        return false;
    }
    if (!json_object_is_type(v, json_type_object) || !json_object_object_get_ex(v, "function", &fn) ||
        !json_object_is_type(fn, json_type_object) || !json_object_object_get_ex(fn, "name", &name) ||
        !json_object_is_type(name, json_type_string)) {
        api_error_set(err, 400, NULL, NULL, "tool_choice",
                      "'tool_choice' must be \"none\", \"auto\", \"required\" or"
                      " {\"type\": \"function\", \"function\": {\"name\": ...}}");
        return false;
    }
    const char *want = json_object_get_string(name);
    for (size_t i = 0; r->tools && i < json_object_array_length(r->tools); i++) {
        const char *have = tool_name(json_object_array_get_idx(r->tools, i));
        if (have && !strcmp(have, want)) {
            r->tool_choice = API_TOOL_CHOICE_FUNCTION;
            r->tool_choice_name = want;
            return true;
        }
    }
    api_error_set(err, 400, NULL, NULL, "tool_choice",
                  "'tool_choice' names the function '%.64s', which is not in 'tools'", want);
    return false;
}

// The grammar the engine will build for the request (engine/shared/json_grammar.h), compiled
// here and dropped: a schema (or, is_tools, a tools list with tool_name or NULL) it cannot
// take is the client's 400 naming param and the keyword.
static bool grammar_ok(json_object *spec, bool is_tools, const char *tool_name, const char *param,
                       ApiError *err)
{
    JgramGrammar *g = NULL;
    char msg[200];
    const Err e = is_tools ? jgram_compile_tools(spec, tool_name, &g, msg, sizeof msg)
                           : jgram_compile(spec, &g, msg, sizeof msg);
    jgram_free(g);
    if (e == ERR_NOMEM) {
        api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        return false;
    }
    if (e) {
        api_error_set(err, 400, NULL, NULL, param, "'%s': %s", param, msg);
        return false;
    }
    return true;
}

// "response_format": {"type": "text"} | {"type": "json_object"} | {"type": "json_schema",
// "json_schema": {"name", "schema", "strict", "description"}}. The schema must compile
// (the supported subset: engine/shared/json_grammar.h); the error names the keyword.
static bool get_response_format(ApiRequest *r, ApiError *err)
{
    json_object *rf, *v;
    if (!json_object_object_get_ex(r->root, "response_format", &rf) || json_object_is_type(rf, json_type_null))
        return true;
    if (!json_object_is_type(rf, json_type_object) || !json_object_object_get_ex(rf, "type", &v) ||
        !json_object_is_type(v, json_type_string)) {
        api_error_set(err, 400, NULL, NULL, "response_format",
                      "'response_format' must be an object with a string 'type'");
        return false;
    }
    const char *type = json_object_get_string(v);
    if (!strcmp(type, "text")) return true;
    if (!strcmp(type, "json_object")) {
        r->format = API_FORMAT_JSON_OBJECT;
    } else if (!strcmp(type, "json_schema")) {
        json_object *js, *name;
        if (!json_object_object_get_ex(rf, "json_schema", &js) || !json_object_is_type(js, json_type_object)) {
            api_error_set(err, 400, NULL, NULL, "response_format.json_schema",
                          "'response_format.json_schema' must be an object with 'name' and 'schema'");
            return false;
        }
        if (!json_object_object_get_ex(js, "name", &name) || !json_object_is_type(name, json_type_string) ||
            json_object_get_string_len(name) == 0 || json_object_get_string_len(name) > 64) {
            api_error_set(err, 400, NULL, NULL, "response_format.json_schema.name",
                          "'response_format.json_schema.name' must be a string of 1 to 64 characters");
            return false;
        }
        if (json_object_object_get_ex(js, "strict", &v) && !json_object_is_type(v, json_type_null) &&
            !json_object_is_type(v, json_type_boolean)) {
            api_error_set(err, 400, NULL, NULL, "response_format.json_schema.strict",
                          "'response_format.json_schema.strict' must be a boolean");
            return false;
        }
        r->format = API_FORMAT_JSON_SCHEMA;
        if (json_object_object_get_ex(js, "schema", &v) && !json_object_is_type(v, json_type_null)) {
            if (!json_object_is_type(v, json_type_object)) {
                api_error_set(err, 400, NULL, NULL, "response_format.json_schema.schema",
                              "'response_format.json_schema.schema' must be an object");
                return false;
            }
            r->schema = v;
        }
    } else {
        api_error_set(err, 400, NULL, NULL, "response_format.type",
                      "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"");
        return false;
    }
    if (r->tool_choice == API_TOOL_CHOICE_REQUIRED || r->tool_choice == API_TOOL_CHOICE_FUNCTION) {
        api_error_set(err, 400, NULL, NULL, "response_format",
                      "'response_format' cannot be combined with a required or named 'tool_choice'");
        return false;
    }
    return r->format != API_FORMAT_JSON_SCHEMA || !r->schema ||
           grammar_ok(r->schema, false, NULL, "response_format.json_schema.schema", err);
}

// ---------------------------------------------------------------------------

static bool parse_fields(ApiRequest *r, ApiError *err)
{
    json_object *root = r->root, *v;

    if (!json_object_object_get_ex(root, "model", &v) || !json_object_is_type(v, json_type_string) ||
        json_object_get_string_len(v) == 0) {
        api_error_set(err, 400, NULL, NULL, "model", "'model' is required and must be a string");
        return false;
    }
    r->model = json_object_get_string(v);

    if (r->kind == API_KIND_CHAT) {
        if (!json_object_object_get_ex(root, "messages", &v) ||
            !json_object_is_type(v, json_type_array) || json_object_array_length(v) == 0) {
            api_error_set(err, 400, NULL, NULL, "messages",
                          "'messages' is required and must be a non-empty array");
            return false;
        }
        r->messages = v;
        for (size_t i = 0; i < json_object_array_length(v); i++) {
            json_object *m = json_object_array_get_idx(v, i), *role;
            if (!json_object_is_type(m, json_type_object) ||
                !json_object_object_get_ex(m, "role", &role) ||
                !json_object_is_type(role, json_type_string)) {
                char param[32];
                snprintf(param, sizeof param, "messages[%zu]", i);
                api_error_set(err, 400, NULL, NULL, param,
                              "'%s' must be an object with a string 'role'", param);
                return false;
            }
        }
        if (json_object_object_get_ex(root, "tools", &v) && !json_object_is_type(v, json_type_null)) {
            if (!json_object_is_type(v, json_type_array)) {
                api_error_set(err, 400, NULL, NULL, "tools", "'tools' must be an array");
                return false;
            }
            r->tools = json_object_array_length(v) ? v : NULL;
        }
        if (!get_tool_choice(r, err)) return false;
        if (r->tool_choice == API_TOOL_CHOICE_REQUIRED || r->tool_choice == API_TOOL_CHOICE_FUNCTION) {
            // The engine constrains the call to the tools' parameter schemas: they must compile.
            if (!grammar_ok(r->tools, true, r->tool_choice_name, "tools", err)) return false;
        }
    } else {
        if (!json_object_object_get_ex(root, "prompt", &v)) v = NULL;
        if (v && json_object_is_type(v, json_type_array) && json_object_array_length(v) == 1)
            v = json_object_array_get_idx(v, 0);
        if (!v || !json_object_is_type(v, json_type_string)) {
            api_error_set(err, 400, NULL, NULL, "prompt",
                          "'prompt' is required and must be a string (or an array of one string)");
            return false;
        }
        r->prompt = json_object_get_string(v);
        r->n_prompt = (size_t) json_object_get_string_len(v);
    }

    if (!get_bool(root, "stream", &r->stream, err)) return false;
    if (json_object_object_get_ex(root, "stream_options", &v) &&
        !json_object_is_type(v, json_type_null)) {
        json_object *u;
        if (!json_object_is_type(v, json_type_object)) {
            api_error_set(err, 400, NULL, NULL, "stream_options", "'stream_options' must be an object");
            return false;
        }
        if (json_object_object_get_ex(v, "include_usage", &u) &&
            !json_object_is_type(u, json_type_null)) {
            if (!json_object_is_type(u, json_type_boolean)) {
                api_error_set(err, 400, NULL, NULL, "stream_options.include_usage",
                              "'stream_options.include_usage' must be a boolean");
                return false;
            }
            r->include_usage = json_object_get_boolean(u);
        }
    }

    int64_t x = 0;
    bool present = false;
    if (!get_int(root, "max_tokens", 1, INT32_MAX, &x, &present, err)) return false;
    if (!get_int(root, "max_completion_tokens", 1, INT32_MAX, &x, &present, err)) return false;
    r->max_tokens = present ? (int) x : 0;
    x = 1;
    if (!get_int(root, "n", 1, 1, &x, NULL, err)) return false;
    x = 0;
    if (!get_int(root, "top_k", -1, 1 << 20, &x, NULL, err)) return false;
    r->top_k = (int) x;
    if (!get_int(root, "seed", INT64_MIN, INT64_MAX, &r->seed, &r->has_seed, err)) return false;
    bool has_lp = false;
    x = 0;
    if (r->kind == API_KIND_CHAT) {
        if (!get_bool(root, "logprobs", &r->logprobs, err)) return false;
        if (!get_int(root, "top_logprobs", 0, API_MAX_TOP_LOGPROBS, &x, &has_lp, err)) return false;
        if (has_lp && !r->logprobs) {
            api_error_set(err, 400, NULL, NULL, "top_logprobs",
                          "'top_logprobs' needs 'logprobs' to be true");
            return false;
        }
    } else {
        // The legacy completions API: "logprobs" is the number of alternatives per token.
        if (!get_int(root, "logprobs", 0, API_MAX_TOP_LOGPROBS, &x, &has_lp, err)) return false;
        r->logprobs = has_lp;
    }
    r->top_logprobs = (int) x;
    if (!get_number(root, "temperature", 0, 2, &r->temperature, err)) return false;
    if (!get_number(root, "top_p", 0, 1, &r->top_p, err)) return false;
    if (!get_number(root, "min_p", 0, 1, &r->min_p, err)) return false;
    if (!get_number(root, "presence_penalty", -2, 2, &r->presence_penalty, err)) return false;
    if (!get_number(root, "frequency_penalty", -2, 2, &r->frequency_penalty, err)) return false;
    if (!get_number(root, "repetition_penalty", 0.01, 10, &r->repetition_penalty, err))
        return false;
    if (r->top_p <= 0) {
        api_error_set(err, 400, NULL, NULL, "top_p", "'top_p' must be greater than 0");
        return false;
    }
    return get_stop(r, err) && get_response_format(r, err);
}

Err api_request_parse(ApiRequest *r, ApiKind kind, const char *body, size_t n, ApiError *err)
{
    memset(r, 0, sizeof *r);
    memset(err, 0, sizeof *err);
    json_tokener *tok = json_tokener_new_ex(API_MAX_DEPTH);
    if (!tok) return ERR_NOMEM;
    json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
    json_object *root = NULL;
    Err e = ERR_FORMAT;
    if (n > INT32_MAX) {
        api_error_set(err, 413, NULL, NULL, NULL, "request body too large");
        goto done;
    }
    root = json_tokener_parse_ex(tok, body, (int) n);
    enum json_tokener_error jerr = json_tokener_get_error(tok);
    if (jerr == json_tokener_continue) jerr = json_tokener_error_parse_eof;
    if (jerr != json_tokener_success || json_tokener_get_parse_end(tok) != n) {
        // Trailing bytes after the value are only acceptable as whitespace.
        size_t end = json_tokener_get_parse_end(tok);
        while (jerr == json_tokener_success && end < n && strchr(" \t\r\n", body[end]) && body[end])
            end++;
        if (jerr != json_tokener_success || end != n) {
            api_error_set(err, 400, NULL, NULL, NULL, "the body is not valid JSON: %s",
                          jerr != json_tokener_success ? json_tokener_error_desc(jerr)
                                                       : "unexpected bytes after the value");
            goto done;
        }
    }
    if (!json_object_is_type(root, json_type_object)) {
        api_error_set(err, 400, NULL, NULL, NULL, "the body must be a JSON object");
        goto done;
    }
    const char *bad = has_lone_surrogate(body, n)
                          ? "strings must be valid UTF-8 without U+0000 or unpaired surrogates"
                          : bad_value(root);
    if (bad) {
        api_error_set(err, 400, NULL, NULL, NULL, "%s", bad);
        goto done;
    }
    r->kind = kind;
    r->root = root;
    r->temperature = 1;
    r->top_p = 1;
    r->repetition_penalty = 1;
    e = ERR_INVAL;
    if (!parse_fields(r, err)) {
        r->root = NULL;
        goto done;
    }
    root = NULL;  // ownership moved to *r
    e = ERR_OK;
done:
    if (e) memset(r, 0, sizeof *r);
    json_object_put(root);
    json_tokener_free(tok);
    return e;
}

void api_request_free(ApiRequest *r)
{
    if (!r) return;
    json_object_put(r->root);
    memset(r, 0, sizeof *r);
}

json_object *api_request_params(const ApiRequest *r)
{
    json_object *o = json_object_new_object(), *stop = json_object_new_array();
    if (!o || !stop) {
        json_object_put(o);
        json_object_put(stop);
        return NULL;
    }
    json_object_object_add(o, "temperature", json_object_new_double(r->temperature));
    json_object_object_add(o, "top_p", json_object_new_double(r->top_p));
    json_object_object_add(o, "top_k", json_object_new_int(r->top_k < 0 ? 0 : r->top_k));
    json_object_object_add(o, "min_p", json_object_new_double(r->min_p));
    json_object_object_add(o, "presence_penalty", json_object_new_double(r->presence_penalty));
    json_object_object_add(o, "frequency_penalty", json_object_new_double(r->frequency_penalty));
    json_object_object_add(o, "repetition_penalty", json_object_new_double(r->repetition_penalty));
    if (r->has_seed) json_object_object_add(o, "seed", json_object_new_int64(r->seed));
    for (int i = 0; i < r->n_stop; i++)
        json_object_array_add(stop, json_object_new_string(r->stop[i]));
    json_object_object_add(o, "stop", stop);
    json_object_object_add(o, "logprobs", json_object_new_boolean(r->logprobs));
    json_object_object_add(o, "top_logprobs", json_object_new_int(r->top_logprobs));
    if (r->tools) json_object_object_add(o, "tools", json_object_get(r->tools));
    static const char *const choices[] = {"auto", "none", "required", "function"};
    json_object_object_add(o, "tool_choice", json_object_new_string(choices[r->tool_choice]));
    if (r->tool_choice_name)
        json_object_object_add(o, "tool_choice_name", json_object_new_string(r->tool_choice_name));
    if (r->format != API_FORMAT_TEXT) {
        json_object *rf = json_object_new_object();
        json_object_object_add(rf, "type", json_object_new_string(r->format == API_FORMAT_JSON_OBJECT
                                                                      ? "json_object"
                                                                      : "json_schema"));
        if (r->format == API_FORMAT_JSON_SCHEMA)  // no schema: any JSON value
            json_object_object_add(rf, "schema", r->schema ? json_object_get(r->schema)
                                                           : json_object_new_boolean(1));
        json_object_object_add(o, "response_format", rf);
    }
    return o;
}

bool api_request_check(const ApiRequest *r)
{
    if (!r->root || !r->model || !*r->model) return false;
    if (r->kind == API_KIND_CHAT && (!r->messages || json_object_array_length(r->messages) == 0))
        return false;
    if (r->kind == API_KIND_COMPLETION && !r->prompt) return false;
    if (r->prompt && strlen(r->prompt) != r->n_prompt) return false;
    if (r->top_logprobs < 0 || r->top_logprobs > API_MAX_TOP_LOGPROBS) return false;
    if (r->tool_choice == API_TOOL_CHOICE_NONE && r->tools) return false;
    if ((r->tool_choice == API_TOOL_CHOICE_FUNCTION) != (r->tool_choice_name != NULL)) return false;
    if (r->format > API_FORMAT_JSON_SCHEMA || (r->schema && r->format != API_FORMAT_JSON_SCHEMA)) return false;
    if (r->format != API_FORMAT_TEXT &&
        (r->tool_choice == API_TOOL_CHOICE_REQUIRED || r->tool_choice == API_TOOL_CHOICE_FUNCTION))
        return false;
    if (r->max_tokens < 0 || r->n_stop < 0 || r->n_stop > API_MAX_STOP) return false;
    for (int i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !*r->stop[i]) return false;
    if (!(r->temperature >= 0 && r->temperature <= 2 && r->top_p > 0 && r->top_p <= 1 &&
          r->min_p >= 0 && r->min_p <= 1 && r->repetition_penalty > 0))
        return false;
    return bad_value(r->root) == NULL;
}
