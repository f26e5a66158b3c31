/*
 * chat.c - GLM chat prompt rendering and incremental output parsing (see chat.h).
 *
 * The renderer is a direct transcription of the GLM-4.7 Jinja template as transformers
 * runs it (trim_blocks, lstrip_blocks, its own tojson filter), so every rule below points
 * at a template construct: visible_text() is the template's macro of the same name,
 * py_strip() is Python's str.strip(), py_dumps() is json.dumps(ensure_ascii=False).
 * Output goes to a Buf (buf.h), whose allocation failure is sticky: code appends freely
 * and the one check sits at the end.
 *
 * The parser keeps one buffer: in text states it holds only the suffix that could still
 * grow into a tag (at most 11 bytes), inside <tool_call> the whole call body.
 */
#include "engine/shared/chat.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"

// ---------------------------------------------------------------------------
// Helpers

// json-c's getters do not modify their argument but are declared without const.
static json_object *jmut(const json_object *o)
{
    return (json_object *) o;
}

// ---------------------------------------------------------------------------
// Errors

__attribute__((format(printf, 2, 3))) static Err fail(ChatError *err, const char *fmt, ...)
{
    ChatError local;
    if (!err) err = &local;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    // The client's mistake, answered with 400 by fcgi/; not worth more than a debug line.
    LOG_DEBUG("chat request rejected: %s", err->msg);
    return ERR_INVAL;
}

static const char *type_name(const json_object *o)
{
    return o ? json_type_to_name(json_object_get_type(o)) : "null";
}

// ---------------------------------------------------------------------------
// Python string semantics: str.strip() whitespace and UTF-8 walking

// Decode one UTF-8 character at s[0..n); *len gets its length. Invalid bytes decode as
// U+FFFD with length 1 (never whitespace, which is all we ask of them).
static uint32_t u8_next(const unsigned char *s, size_t n, size_t *len)
{
    *len = 1;
    if (s[0] < 0x80) return s[0];
    size_t k = s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC0 ? 2 : 0;
    if (k == 0 || k > n) return 0xFFFD;
    uint32_t c = s[0] & (0x7F >> k);
    for (size_t i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0xFFFD;
        c = (c << 6) | (s[i] & 0x3F);
    }
    *len = k;
    return c;
}

// Python's str.isspace(): bidi class WS, B or S, or category Zs (Unicode 15).
static bool py_space(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0
           || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029
           || c == 0x202F || c == 0x205F || c == 0x3000;
}

typedef struct Str {
    const char *p;
    size_t n;
} Str;

// Python str.strip() with no argument.
static Str py_strip(Str s)
{
    const unsigned char *u = (const unsigned char *) s.p;
    size_t i = 0, j = s.n, len;
    while (i < j && py_space(u8_next(u + i, j - i, &len)))
        i += len;
    while (j > i) {
        size_t k = j - 1;
        while (k > i && j - k < 4 && (u[k] & 0xC0) == 0x80)
            k--;
        const uint32_t c = u8_next(u + k, j - k, &len);
        if (k + len != j || !py_space(c)) break;
        j = k;
    }
    return (Str){s.p + i, j - i};
}

static Str strip_char_left(Str s, char c)
{
    while (s.n && s.p[0] == c)
        s.p++, s.n--;
    return s;
}

static Str strip_char_right(Str s, char c)
{
    while (s.n && s.p[s.n - 1] == c)
        s.n--;
    return s;
}

// First (or, with last, final) occurrence of needle in s; SIZE_MAX when absent.
static size_t find(const char *s, size_t n, const char *needle, bool last)
{
    const size_t m = strlen(needle);
    if (m > n) return SIZE_MAX;
    size_t found = SIZE_MAX;
    for (size_t i = 0; i + m <= n; i++) {
        if (s[i] == needle[0] && memcmp(s + i, needle, m) == 0) {
            found = i;
            if (!last) break;
        }
    }
    return found;
}

// ---------------------------------------------------------------------------
// Python json.dumps(ensure_ascii=False)

// repr(float): the shortest digits that read back as d, in fixed notation for
// 1e-4 <= |d| < 1e16 and in exponent notation otherwise (CPython's format_float_short).
static void py_float_repr(double d, Buf *out)
{
    if (isnan(d)) {
        buf_adds(out, "NaN");
        return;
    }
    if (isinf(d)) {
        buf_adds(out, d < 0 ? "-Infinity" : "Infinity");
        return;
    }
    if (d == 0) {
        buf_adds(out, signbit(d) ? "-0.0" : "0.0");
        return;
    }
    char tmp[48];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, d);
        if (strtod(tmp, NULL) == d) break;
    }
    // tmp is "[-]D[.DDD]e[+-]XX": split into sign, digits and the decimal exponent.
    const char *p = tmp;
    if (*p == '-') {
        buf_add(out, "-", 1);
        p++;
    }
    char digits[24];
    int n_digits = 0;
    for (; *p && *p != 'e'; p++) {
        if (*p != '.' && n_digits < 20) digits[n_digits++] = *p;
    }
    const int exp10 = atoi(p + 1);
    while (n_digits > 1 && digits[n_digits - 1] == '0')
        n_digits--;
    const int decpt = exp10 + 1;  // digits[0..decpt) precede the decimal point
    if (exp10 >= -4 && exp10 < 16) {
        if (decpt <= 0) {
            buf_adds(out, "0.");
            for (int i = 0; i < -decpt; i++)
                buf_add(out, "0", 1);
            buf_add(out, digits, (size_t) n_digits);
        } else if (decpt >= n_digits) {
            buf_add(out, digits, (size_t) n_digits);
            for (int i = n_digits; i < decpt; i++)
                buf_add(out, "0", 1);
            buf_adds(out, ".0");
        } else {
            buf_add(out, digits, (size_t) decpt);
            buf_add(out, ".", 1);
            buf_add(out, digits + decpt, (size_t) (n_digits - decpt));
        }
    } else {
        buf_add(out, digits, 1);
        if (n_digits > 1) {
            buf_add(out, ".", 1);
            buf_add(out, digits + 1, (size_t) (n_digits - 1));
        }
        char e[16];
        snprintf(e, sizeof e, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
        buf_adds(out, e);
    }
}

static void py_string(const char *s, size_t n, Buf *out)
{
    size_t start = 0;  // first byte not yet copied
    buf_add(out, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char) s[i];
        const char *esc = NULL;
        char u[8];
        switch (c) {
        case '"':
            esc = "\\\"";
            break;
        case '\\':
            esc = "\\\\";
            break;
        case '\n':
            esc = "\\n";
            break;
        case '\r':
            esc = "\\r";
            break;
        case '\t':
            esc = "\\t";
            break;
        case '\b':
            esc = "\\b";
            break;
        case '\f':
            esc = "\\f";
            break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", c);
                esc = u;
            }
        }
        if (!esc) continue;
        buf_add(out, s + start, i - start);
        buf_adds(out, esc);
        start = i + 1;
    }
    buf_add(out, s + start, n - start);
    buf_add(out, "\"", 1);
}

static void py_dumps(const json_object *o, Buf *out);

static void py_dumps(const json_object *o, Buf *out)
{
    char num[32];
    switch (o ? json_object_get_type(o) : json_type_null) {
    case json_type_null:
        buf_adds(out, "null");
        break;
    case json_type_boolean:
        buf_adds(out, json_object_get_boolean(o) ? "true" : "false");
        break;
    case json_type_int: {
        const int64_t v = json_object_get_int64(o);
        const uint64_t u = json_object_get_uint64(o);
        if (v == INT64_MAX && u > (uint64_t) INT64_MAX) {
            snprintf(num, sizeof num, "%llu", (unsigned long long) u);
        } else {
            snprintf(num, sizeof num, "%lld", (long long) v);
        }
        buf_adds(out, num);
        break;
    }
    case json_type_double:
        py_float_repr(json_object_get_double(o), out);
        break;
    case json_type_string:
        py_string(json_object_get_string(jmut(o)), (size_t) json_object_get_string_len(o), out);
        break;
    case json_type_array: {
        const size_t n = json_object_array_length(o);
        buf_add(out, "[", 1);
        for (size_t i = 0; i < n; i++) {
            if (i) buf_add(out, ", ", 2);
            py_dumps(json_object_array_get_idx(o, i), out);
        }
        buf_add(out, "]", 1);
        break;
    }
    case json_type_object: {
        bool first = true;
        buf_add(out, "{", 1);
        json_object_object_foreach(jmut(o), key, val)
        {
            if (!first) buf_add(out, ", ", 2);
            first = false;
            py_string(key, strlen(key), out);
            buf_add(out, ": ", 2);
            py_dumps(val, out);
        }
        buf_add(out, "}", 1);
        break;
    }
    }
}

Err chat_json_dumps(const json_object *value, char **out, size_t *n_out)
{
    Buf b = {0};
    py_dumps(value, &b);
    buf_add(&b, "", 0);
    if (b.is_oom) {
        buf_free(&b);
        LOG_ERROR("could not allocate a JSON string");
        return ERR_NOMEM;
    }
    *out = b.p;
    *n_out = b.n;
    return ERR_OK;
}

// Strict JSON (RFC 8259 plus NaN/Infinity, like Python's json.loads) of exactly s[0..n).
// Returns NULL in *out with ERR_OK for JSON null; ERR_FORMAT when s is not one JSON value.
static Err parse_json(const char *s, size_t n, json_object **out)
{
    Err e = ERR_FORMAT;
    json_object *o = NULL;
    char *copy = malloc(n + 1);  // json-c finishes a trailing number only at a NUL
    json_tokener *tok = json_tokener_new();
    if (!copy || !tok) {
        e = ERR_NOMEM;
        goto done;
    }
    memcpy(copy, s, n);
    copy[n] = '\0';
    json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
    o = json_tokener_parse_ex(tok, copy, (int) (n + 1));
    if (json_tokener_get_error(tok) != json_tokener_success) goto done;
    size_t end = json_tokener_get_parse_end(tok);
    while (end < n
           && (copy[end] == ' ' || copy[end] == '\t' || copy[end] == '\n' || copy[end] == '\r'))
        end++;
    if (end < n) goto done;
    *out = o;
    o = NULL;  // ownership moved to *out
    e = ERR_OK;
done:
    json_object_put(o);
    if (tok) json_tokener_free(tok);
    free(copy);
    return e;
}

// ---------------------------------------------------------------------------
// Rendering

static const char TOOLS_HEAD[] =
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n";
static const char TOOLS_TAIL[] =
    "</tools>\n\nFor each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
    "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>"
    "...</tool_call>";

// The template's visible_text(content) into dst: a string as is, an array's strings and
// text parts concatenated, null or absent as nothing. path names the field for errors.
static Err visible_text(const json_object *content, const char *path, Buf *dst, ChatError *err)
{
    switch (content ? json_object_get_type(content) : json_type_null) {
    case json_type_null:
        return ERR_OK;
    case json_type_string:
        buf_add(dst, json_object_get_string(jmut(content)),
                (size_t) json_object_get_string_len(content));
        return ERR_OK;
    case json_type_array:
        break;
    default:
        return fail(err, "%s: expected a string or an array of text parts, not %s", path,
                    type_name(content));
    }
    const size_t n = json_object_array_length(content);
    for (size_t j = 0; j < n; j++) {
        const json_object *item = json_object_array_get_idx(content, j);
        if (json_object_is_type(item, json_type_string)) {
            buf_add(dst, json_object_get_string(jmut(item)),
                    (size_t) json_object_get_string_len(item));
            continue;
        }
        if (!json_object_is_type(item, json_type_object)) {
            return fail(err, "%s[%zu]: expected a text part, not %s", path, j, type_name(item));
        }
        json_object *type = NULL, *text = NULL;
        json_object_object_get_ex(item, "type", &type);
        if (!json_object_is_type(type, json_type_string)
            || strcmp(json_object_get_string(type), "text") != 0) {
            return fail(err, "%s[%zu].type: only \"text\" parts are supported", path, j);
        }
        if (!json_object_object_get_ex(item, "text", &text)
            || !json_object_is_type(text, json_type_string)) {
            return fail(err, "%s[%zu].text: expected a string", path, j);
        }
        buf_add(dst, json_object_get_string(text), (size_t) json_object_get_string_len(text));
    }
    return ERR_OK;
}

// Optional string field: absent or null gives *has = false.
static Err opt_string(const json_object *msg, const char *key, const char *path, Str *s, bool *has,
                      ChatError *err)
{
    json_object *v = NULL;
    *has = false;
    if (!json_object_object_get_ex(msg, key, &v) || !v) return ERR_OK;
    if (!json_object_is_type(v, json_type_string)) {
        return fail(err, "%s.%s: expected a string, not %s", path, key, type_name(v));
    }
    *s = (Str){json_object_get_string(v), (size_t) json_object_get_string_len(v)};
    *has = true;
    return ERR_OK;
}

// Arguments of a tool call as a JSON object: given as an object, as a JSON string holding
// one (OpenAI), or absent/null/"" for none. *owned receives a parsed object to release.
static Err call_arguments(const json_object *fn, const char *path, const json_object **args,
                          json_object **owned, ChatError *err)
{
    json_object *a = NULL;
    *args = NULL;
    *owned = NULL;
    if (!json_object_object_get_ex(fn, "arguments", &a) || !a) return ERR_OK;
    if (json_object_is_type(a, json_type_object)) {
        *args = a;
        return ERR_OK;
    }
    if (!json_object_is_type(a, json_type_string)) {
        return fail(err, "%s.arguments: expected a JSON object or a string holding one, not %s",
                    path, type_name(a));
    }
    const size_t n = (size_t) json_object_get_string_len(a);
    if (n == 0) return ERR_OK;
    json_object *parsed = NULL;
    const Err e = parse_json(json_object_get_string(a), n, &parsed);
    if (e == ERR_NOMEM) return e;
    if (e || !json_object_is_type(parsed, json_type_object)) {
        json_object_put(parsed);
        return fail(err, "%s.arguments: not a JSON object", path);
    }
    *args = *owned = parsed;
    return ERR_OK;
}

static Err render_tool_calls(const json_object *calls, const char *mpath, Buf *out, ChatError *err)
{
    const size_t n = json_object_array_length(calls);
    for (size_t j = 0; j < n; j++) {
        char path[96];
        const json_object *tc = json_object_array_get_idx(calls, j);
        if (!json_object_is_type(tc, json_type_object)) {
            return fail(err, "%s.tool_calls[%zu]: expected an object, not %s", mpath, j,
                        type_name(tc));
        }
        // {% if tc.function %}{% set tc = tc.function %}: the OpenAI shape, or a flat call.
        json_object *fn = NULL;
        snprintf(path, sizeof path, "%s.tool_calls[%zu]", mpath, j);
        if (json_object_object_get_ex(tc, "function", &fn) && fn) {
            if (!json_object_is_type(fn, json_type_object)) {
                return fail(err, "%s.function: expected an object, not %s", path, type_name(fn));
            }
            snprintf(path, sizeof path, "%s.tool_calls[%zu].function", mpath, j);
        } else {
            fn = jmut(tc);
        }
        json_object *name = NULL;
        if (!json_object_object_get_ex(fn, "name", &name)
            || !json_object_is_type(name, json_type_string)) {
            return fail(err, "%s.name: expected a string", path);
        }
        const json_object *args = NULL;
        json_object *owned = NULL;
        Err e = call_arguments(fn, path, &args, &owned, err);
        if (e) return e;
        buf_adds(out, "<tool_call>");
        buf_add(out, json_object_get_string(name), (size_t) json_object_get_string_len(name));
        if (args) {
            json_object_object_foreach(jmut(args), key, val)
            {
                buf_adds(out, "<arg_key>");
                buf_adds(out, key);
                buf_adds(out, "</arg_key><arg_value>");
                if (json_object_is_type(val, json_type_string)) {
                    buf_add(out, json_object_get_string(val),
                            (size_t) json_object_get_string_len(val));
                } else {
                    py_dumps(val, out);
                }
                buf_adds(out, "</arg_value>");
            }
        }
        buf_adds(out, "</tool_call>");
        json_object_put(owned);
    }
    return ERR_OK;
}

static Err render_assistant(const json_object *msg, const char *path, bool keep_reasoning, Buf *out,
                            bool *has_calls, ChatError *err)
{
    Err e = ERR_OK;
    Buf text = {0};
    char field[80];
    json_object *content = NULL, *calls = NULL;
    *has_calls = false;

    json_object_object_get_ex(msg, "content", &content);
    snprintf(field, sizeof field, "%s.content", path);
    if ((e = visible_text(content, field, &text, err))) goto done;
    Str body = {text.p ? text.p : "", text.n};

    // reasoning_content if it is a string (we also take vLLM's newer name "reasoning");
    // otherwise reasoning written inline as <think>...</think> in the content.
    Str reasoning = {"", 0};
    bool has_reasoning = false;
    if ((e = opt_string(msg, "reasoning_content", path, &reasoning, &has_reasoning, err))) {
        goto done;
    }
    if (!has_reasoning) {
        if ((e = opt_string(msg, "reasoning", path, &reasoning, &has_reasoning, err))) goto done;
    }
    if (!has_reasoning) {
        const size_t close = find(body.p, body.n, "</think>", false);
        if (close != SIZE_MAX) {
            // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
            Str head = strip_char_right((Str){body.p, close}, '\n');
            const size_t open = find(head.p, head.n, "<think>", true);
            if (open != SIZE_MAX) head = (Str){head.p + open + 7, head.n - open - 7};
            reasoning = strip_char_left(head, '\n');
            // content.split('</think>')[-1].lstrip('\n')
            const size_t last = find(body.p, body.n, "</think>", true);
            body = strip_char_left((Str){body.p + last + 8, body.n - last - 8}, '\n');
        }
    }

    buf_adds(out, "<|assistant|>");
    if (keep_reasoning && reasoning.n > 0) {
        const Str r = py_strip(reasoning);
        buf_adds(out, "<think>");
        buf_add(out, r.p, r.n);
        buf_adds(out, "</think>");
    } else {
        buf_adds(out, "</think>");
    }
    const Str c = py_strip(body);
    buf_add(out, c.p, c.n);

    if (json_object_object_get_ex(msg, "tool_calls", &calls) && calls) {
        if (!json_object_is_type(calls, json_type_array)) {
            e = fail(err, "%s.tool_calls: expected an array, not %s", path, type_name(calls));
            goto done;
        }
        if ((e = render_tool_calls(calls, path, out, err))) goto done;
        *has_calls = json_object_array_length(calls) > 0;
    }
done:
    if (!e && text.is_oom) e = ERR_NOMEM;
    buf_free(&text);
    return e;
}

static Err render_tools(const json_object *tools, Buf *out, ChatError *err)
{
    if (!tools) return ERR_OK;
    if (!json_object_is_type(tools, json_type_array)) {
        return fail(err, "tools: expected an array, not %s", type_name(tools));
    }
    const size_t n = json_object_array_length(tools);
    if (n == 0) return ERR_OK;  // {% if tools %}: an empty list is false
    buf_adds(out, TOOLS_HEAD);
    for (size_t k = 0; k < n; k++) {
        const json_object *t = json_object_array_get_idx(tools, k);
        json_object *fn = NULL, *name = NULL;
        if (!json_object_is_type(t, json_type_object)) {
            return fail(err, "tools[%zu]: expected an object, not %s", k, type_name(t));
        }
        if (!json_object_object_get_ex(t, "function", &fn)
            || !json_object_is_type(fn, json_type_object)) {
            return fail(err, "tools[%zu].function: expected an object", k);
        }
        if (!json_object_object_get_ex(fn, "name", &name)
            || !json_object_is_type(name, json_type_string)) {
            return fail(err, "tools[%zu].function.name: expected a string", k);
        }
        py_dumps(t, out);
        buf_add(out, "\n", 1);
    }
    buf_adds(out, TOOLS_TAIL);
    return ERR_OK;
}

typedef enum Role { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL } Role;

static Err message_role(const json_object *msg, size_t i, Role *role, ChatError *err)
{
    json_object *r = NULL;
    if (!json_object_is_type(msg, json_type_object)) {
        return fail(err, "messages[%zu]: expected an object, not %s", i, type_name(msg));
    }
    if (!json_object_object_get_ex(msg, "role", &r) || !json_object_is_type(r, json_type_string)) {
        return fail(err, "messages[%zu].role: expected a string", i);
    }
    const char *s = json_object_get_string(r);
    if (strcmp(s, "system") == 0 || strcmp(s, "developer") == 0) {
        *role = ROLE_SYSTEM;
    } else if (strcmp(s, "user") == 0) {
        *role = ROLE_USER;
    } else if (strcmp(s, "assistant") == 0) {
        *role = ROLE_ASSISTANT;
    } else if (strcmp(s, "tool") == 0) {
        *role = ROLE_TOOL;
    } else {
        return fail(err, "messages[%zu].role: unknown role \"%.40s\"", i, s);
    }
    return ERR_OK;
}

static Err render_into(const json_object *messages, const json_object *tools,
                       const ChatOptions *opts, Buf *out, ChatError *err)
{
    Err e;
    if (!json_object_is_type(messages, json_type_array)) {
        return fail(err, "messages: expected an array, not %s", type_name(messages));
    }
    const size_t n = json_object_array_length(messages);
    if (n == 0) return fail(err, "messages: must hold at least one message");

    // ns.last_user_index: reasoning is kept only for assistant turns after it.
    size_t last_user = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        Role role;
        if ((e = message_role(json_object_array_get_idx(messages, i), i, &role, err))) return e;
        if (role == ROLE_USER) last_user = i;
    }

    buf_adds(out, "[gMASK]<sop>");
    if (opts->tmpl == CHAT_TEMPLATE_GLM52 && opts->thinking) {
        buf_adds(out, opts->effort == CHAT_EFFORT_HIGH ? "<|system|>Reasoning Effort: High"
                                                       : "<|system|>Reasoning Effort: Max");
    }
    if ((e = render_tools(tools, out, err))) return e;

    Role prev = ROLE_SYSTEM;
    bool calls_open = false;  // an assistant tool call precedes, through a run of tool messages
    for (size_t i = 0; i < n; i++) {
        const json_object *msg = json_object_array_get_idx(messages, i);
        char path[48], field[64];
        Role role;
        snprintf(path, sizeof path, "messages[%zu]", i);
        snprintf(field, sizeof field, "messages[%zu].content", i);
        message_role(msg, i, &role, err);  // validated above
        json_object *content = NULL;
        json_object_object_get_ex(msg, "content", &content);
        switch (role) {
        case ROLE_SYSTEM:
        case ROLE_USER:
            buf_adds(out, role == ROLE_USER ? "<|user|>" : "<|system|>");
            if ((e = visible_text(content, field, out, err))) return e;
            calls_open = false;
            break;
        case ROLE_ASSISTANT: {
            const bool keep = !opts->clear_thinking || last_user == SIZE_MAX || i > last_user;
            if ((e = render_assistant(msg, path, keep, out, &calls_open, err))) return e;
            break;
        }
        case ROLE_TOOL: {
            Str id;
            bool has_id;
            if (!calls_open) {
                return fail(err,
                            "messages[%zu]: a tool message must follow an assistant "
                            "message with tool_calls",
                            i);
            }
            if ((e = opt_string(msg, "tool_call_id", path, &id, &has_id, err))) return e;
            if (i == 0 || prev != ROLE_TOOL) buf_adds(out, "<|observation|>");
            buf_adds(out, "<tool_response>");
            if ((e = visible_text(content, field, out, err))) return e;
            buf_adds(out, "</tool_response>");
            break;
        }
        }
        prev = role;
    }
    if (opts->add_generation_prompt) {
        buf_adds(out, opts->thinking ? "<|assistant|><think>" : "<|assistant|></think>");
    }
    return ERR_OK;
}

void chat_options_default(ChatOptions *opts, ChatTemplate tmpl)
{
    *opts = (ChatOptions){.tmpl = tmpl,
                          .thinking = true,
                          .clear_thinking = true,
                          .add_generation_prompt = true,
                          .effort = CHAT_EFFORT_HIGH};
}

static Err opt_bool(const json_object *obj, const char *key, const char *path, bool *out,
                    ChatError *err)
{
    json_object *v = NULL;
    if (!json_object_object_get_ex(obj, key, &v) || !v) return ERR_OK;
    if (!json_object_is_type(v, json_type_boolean)) {
        return fail(err, "%s%s: expected a boolean, not %s", path, key, type_name(v));
    }
    *out = json_object_get_boolean(v);
    return ERR_OK;
}

Err chat_options_from_request(ChatOptions *opts, const json_object *request, ChatError *err)
{
    Err e;
    ChatOptions o = *opts;
    json_object *v = NULL;
    if (!json_object_is_type(request, json_type_object)) return ERR_OK;  // bare messages

    if ((e = opt_bool(request, "add_generation_prompt", "", &o.add_generation_prompt, err))) {
        return e;
    }
    if (json_object_object_get_ex(request, "thinking", &v) && v) {
        json_object *type = NULL;
        if (!json_object_is_type(v, json_type_object)
            || !json_object_object_get_ex(v, "type", &type)
            || !json_object_is_type(type, json_type_string)) {
            return fail(err, "thinking.type: expected \"enabled\" or \"disabled\"");
        }
        const char *t = json_object_get_string(type);
        if (strcmp(t, "enabled") == 0) {
            o.thinking = true;
        } else if (strcmp(t, "disabled") == 0) {
            o.thinking = false;
        } else {
            return fail(err, "thinking.type: expected \"enabled\" or \"disabled\"");
        }
    }
    if (json_object_object_get_ex(request, "reasoning_effort", &v) && v) {
        if (!json_object_is_type(v, json_type_string)) {
            return fail(err, "reasoning_effort: expected a string, not %s", type_name(v));
        }
        const char *s = json_object_get_string(v);
        if (strcmp(s, "none") == 0) {
            o.thinking = false;  // OpenAI's "no reasoning"
        } else {
            o.effort = strcmp(s, "high") == 0 ? CHAT_EFFORT_HIGH : CHAT_EFFORT_MAX;
        }
    }
    if (json_object_object_get_ex(request, "chat_template_kwargs", &v) && v) {
        if (!json_object_is_type(v, json_type_object)) {
            return fail(err, "chat_template_kwargs: expected an object, not %s", type_name(v));
        }
        if ((e = opt_bool(v, "enable_thinking", "chat_template_kwargs.", &o.thinking, err))) {
            return e;
        }
        if ((e = opt_bool(v, "clear_thinking", "chat_template_kwargs.", &o.clear_thinking, err))) {
            return e;
        }
    }
    *opts = o;
    return ERR_OK;
}

Err chat_render(const json_object *messages, const json_object *tools, const ChatOptions *opts,
                char **out, size_t *n_out, ChatError *err)
{
    Buf b = {0};
    Err e = render_into(messages, tools, opts, &b, err);
    if (!e) buf_add(&b, "", 0);  // a NUL-terminated string even when empty
    if (!e && b.is_oom) {
        LOG_ERROR("could not allocate the chat prompt (%zu bytes so far)", b.n);
        e = ERR_NOMEM;
    }
    if (e) {
        buf_free(&b);
        return e;
    }
    *out = b.p;
    *n_out = b.n;
    return ERR_OK;
}

Err chat_render_request(const json_object *request, ChatTemplate tmpl, char **out, size_t *n_out,
                        ChatOptions *opts_out, ChatError *err)
{
    ChatOptions opts;
    chat_options_default(&opts, tmpl);
    const json_object *messages = request, *tools = NULL;
    if (json_object_is_type(request, json_type_object)) {
        json_object *m = NULL, *t = NULL;
        if (!json_object_object_get_ex(request, "messages", &m)) {
            return fail(err, "messages: missing");
        }
        json_object_object_get_ex(request, "tools", &t);
        messages = m;
        tools = t;
        Err e = chat_options_from_request(&opts, request, err);
        if (e) return e;
    } else if (!json_object_is_type(request, json_type_array)) {
        return fail(err, "request: expected an object with \"messages\" or an array of messages");
    }
    Err e = chat_render(messages, tools, &opts, out, n_out, err);
    if (!e && opts_out) *opts_out = opts;
    return e;
}

bool chat_prompt_opens_reasoning(const char *prompt, size_t n)
{
    return n >= 7 && memcmp(prompt + n - 7, "<think>", 7) == 0;
}

// ---------------------------------------------------------------------------
// Output parser

enum { PARSE_REASONING, PARSE_CONTENT, PARSE_TOOL_CALL, PARSE_DONE };

static const char TAG_THINK[] = "<think>";
static const char TAG_THINK_END[] = "</think>";
static const char TAG_CALL[] = "<tool_call>";
static const char TAG_CALL_END[] = "</tool_call>";

Err chat_parser_init(ChatParser *p, bool in_reasoning, const json_object *tools)
{
    *p = (ChatParser){.state = in_reasoning ? PARSE_REASONING : PARSE_CONTENT};
    if (tools) p->tools = json_object_get(jmut(tools));
    return ERR_OK;
}

void chat_parser_free(ChatParser *p)
{
    if (!p) return;
    buf_free(&p->buf);
    json_object_put(p->tools);
    *p = (ChatParser){0};
}

static Err parser_append(ChatParser *p, const char *s, size_t n)
{
    const Err err = buf_add(&p->buf, s, n);
    if (err) LOG_ERROR("could not grow the chat parser buffer past %zu bytes", p->buf.n);
    return err;
}

static Err emit_text(ChatEventKind kind, const char *s, size_t n, ChatEventFn fn, void *user)
{
    if (n == 0) return ERR_OK;
    const ChatEvent ev = {.kind = kind, .text = s, .n_text = n};
    return fn(user, &ev);
}

// Length of the longest suffix of s[0..n) that is a proper prefix of one of the tags.
static size_t partial_tag(const char *s, size_t n, const char *const *tags, int n_tags)
{
    size_t best = 0;
    for (int t = 0; t < n_tags; t++) {
        const size_t m = strlen(tags[t]);
        for (size_t k = (m - 1 < n ? m - 1 : n); k > best; k--) {
            if (memcmp(s + n - k, tags[t], k) == 0) {
                best = k;
                break;
            }
        }
    }
    return best;
}

static bool is_ascii_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static Str trim_ascii(Str s)
{
    while (s.n && is_ascii_space(s.p[0]))
        s.p++, s.n--;
    while (s.n && is_ascii_space(s.p[s.n - 1]))
        s.n--;
    return s;
}

// Does the tools schema declare parameter key of function name as a string?
static bool param_is_string(const json_object *tools, const char *name, const char *key)
{
    const size_t n =
        json_object_is_type(tools, json_type_array) ? json_object_array_length(tools) : 0;
    for (size_t i = 0; i < n; i++) {
        json_object *fn = NULL, *fname = NULL, *params = NULL, *props = NULL, *prop = NULL,
                    *type = NULL;
        const json_object *t = json_object_array_get_idx(tools, i);
        if (!json_object_object_get_ex(t, "function", &fn)
            || !json_object_object_get_ex(fn, "name", &fname)
            || !json_object_is_type(fname, json_type_string)
            || strcmp(json_object_get_string(fname), name) != 0) {
            continue;
        }
        if (!json_object_object_get_ex(fn, "parameters", &params)
            || !json_object_object_get_ex(params, "properties", &props)
            || !json_object_object_get_ex(props, key, &prop)
            || !json_object_object_get_ex(prop, "type", &type)) {
            return false;
        }
        if (json_object_is_type(type, json_type_string)) {
            return strcmp(json_object_get_string(type), "string") == 0;
        }
        if (json_object_is_type(type, json_type_array)) {
            for (size_t j = 0; j < json_object_array_length(type); j++) {
                json_object *tj = json_object_array_get_idx(type, j);
                if (json_object_is_type(tj, json_type_string)
                    && strcmp(json_object_get_string(tj), "string") == 0) {
                    return true;
                }
            }
        }
        return false;
    }
    return false;
}

// Take one tagged section s[0..n) starting at *pos: skip ASCII whitespace, expect open,
// find close. *inner gets what lies between. False when the shape is wrong.
static bool take_tagged(const char *s, size_t n, size_t *pos, const char *open, const char *close,
                        Str *inner)
{
    size_t i = *pos;
    while (i < n && is_ascii_space(s[i]))
        i++;
    const size_t lo = strlen(open), lc = strlen(close);
    if (n - i < lo || memcmp(s + i, open, lo) != 0) return false;
    i += lo;
    const size_t end = find(s + i, n - i, close, false);
    if (end == SIZE_MAX) return false;
    *inner = (Str){s + i, end};
    *pos = i + end + lc;
    return true;
}

// Parse a tool-call body "name<arg_key>k</arg_key><arg_value>v</arg_value>..." (newlines
// between the parts allowed, as GLM-4.5/4.6 print them) into *name and an arguments object.
static Err parse_call(const ChatParser *p, const char *s, size_t n, char **name_out,
                      json_object **args_out, bool *ok)
{
    Err e = ERR_OK;
    json_object *args = NULL;
    char *name = NULL;
    *ok = false;

    size_t first = find(s, n, "<arg_key>", false);
    if (first == SIZE_MAX) first = n;
    const Str nm = trim_ascii((Str){s, first});
    if (nm.n == 0 || find(nm.p, nm.n, "<", false) != SIZE_MAX || memchr(nm.p, '\0', nm.n)) {
        goto done;
    }
    name = malloc(nm.n + 1);
    args = json_object_new_object();
    if (!name || !args) {
        e = ERR_NOMEM;
        goto done;
    }
    memcpy(name, nm.p, nm.n);
    name[nm.n] = '\0';
    size_t pos = first;
    for (;;) {
        size_t rest = pos;
        while (rest < n && is_ascii_space(s[rest]))
            rest++;
        if (rest == n) break;
        Str key, value;
        if (!take_tagged(s, n, &pos, "<arg_key>", "</arg_key>", &key)
            || !take_tagged(s, n, &pos, "<arg_value>", "</arg_value>", &value)) {
            goto done;
        }
        key = trim_ascii(key);
        if (key.n == 0 || memchr(key.p, '\0', key.n)) goto done;
        char *k = malloc(key.n + 1);
        if (!k) {
            e = ERR_NOMEM;
            goto done;
        }
        memcpy(k, key.p, key.n);
        k[key.n] = '\0';
        json_object *v = NULL;
        bool typed = false;
        if (!param_is_string(p->tools, name, k)) {
            const Str t = trim_ascii(value);
            e = t.n ? parse_json(t.p, t.n, &v) : ERR_FORMAT;
            if (e == ERR_NOMEM) {
                free(k);
                goto done;
            }
            typed = e == ERR_OK;
            e = ERR_OK;
        }
        if (!typed) {
            v = json_object_new_string_len(value.p, (int) value.n);
            if (!v) {
                free(k);
                e = ERR_NOMEM;
                goto done;
            }
        }
        const int rc = json_object_object_add(args, k, v);  // takes v, copies k
        free(k);
        if (rc != 0) {
            json_object_put(v);
            e = ERR_NOMEM;
            goto done;
        }
    }
    *ok = true;
    *name_out = name;
    *args_out = args;
    name = NULL;  // ownership moved to the caller
    args = NULL;
done:
    free(name);
    json_object_put(args);
    return e;
}

static Err finish_call(ChatParser *p, size_t body_n, ChatEventFn fn, void *user)
{
    char *name = NULL, *args_text = NULL;
    json_object *args = NULL;
    size_t n_args = 0;
    bool ok = false;
    Err e = parse_call(p, p->buf.p, body_n, &name, &args, &ok);
    if (e) goto done;
    if (ok) {
        if ((e = chat_json_dumps(args, &args_text, &n_args))) goto done;
        const ChatEvent ev = {.kind = CHAT_EVENT_TOOL_CALL,
                              .name = name,
                              .arguments = args_text,
                              .index = p->n_tool_calls++};
        p->after_tool_call = true;
        e = fn(user, &ev);
    } else {
        // Not a call we understand: hand the text on as content, tags and all.
        Buf b = {0};
        buf_adds(&b, TAG_CALL);
        buf_add(&b, p->buf.p, body_n);
        buf_adds(&b, TAG_CALL_END);
        e = b.is_oom ? ERR_NOMEM : emit_text(CHAT_EVENT_CONTENT, b.p, b.n, fn, user);
        buf_free(&b);
    }
done:
    free(name);
    free(args_text);
    json_object_put(args);
    return e;
}

// Decide everything the buffer already determines.
static Err parser_run(ChatParser *p, ChatEventFn fn, void *user)
{
    static const char *const reasoning_tags[] = {TAG_THINK_END};
    static const char *const content_tags[] = {TAG_CALL, TAG_THINK};
    Err e;
    for (;;) {
        const char *s = p->buf.p;
        const size_t n = p->buf.n;
        if (p->state == PARSE_REASONING) {
            const size_t at = find(s, n, TAG_THINK_END, false);
            if (at != SIZE_MAX) {
                if ((e = emit_text(CHAT_EVENT_REASONING, s, at, fn, user))) return e;
                buf_consume(&p->buf, at + strlen(TAG_THINK_END));
                p->state = PARSE_CONTENT;
                continue;
            }
            const size_t keep = partial_tag(s, n, reasoning_tags, 1);
            if ((e = emit_text(CHAT_EVENT_REASONING, s, n - keep, fn, user))) return e;
            buf_consume(&p->buf, n - keep);
            return ERR_OK;
        }
        if (p->state == PARSE_CONTENT) {
            if (p->after_tool_call) {
                size_t w = 0;
                while (w < n && is_ascii_space(s[w]))
                    w++;
                const size_t rest = n - w, lc = strlen(TAG_CALL);
                if (rest == 0) return ERR_OK;  // only whitespace so far: undecided
                if (rest < lc && memcmp(s + w, TAG_CALL, rest) == 0) return ERR_OK;
                p->after_tool_call = false;
                if (rest >= lc && memcmp(s + w, TAG_CALL, lc) == 0) {
                    buf_consume(&p->buf, w);  // whitespace between two calls
                    continue;
                }
            }
            const size_t at_call = find(s, n, TAG_CALL, false);
            const size_t at_think = find(s, n, TAG_THINK, false);
            const size_t at = at_call < at_think ? at_call : at_think;
            if (at != SIZE_MAX) {
                if ((e = emit_text(CHAT_EVENT_CONTENT, s, at, fn, user))) return e;
                const bool call = at == at_call;
                buf_consume(&p->buf, at + strlen(call ? TAG_CALL : TAG_THINK));
                p->state = call ? PARSE_TOOL_CALL : PARSE_REASONING;
                continue;
            }
            const size_t keep = partial_tag(s, n, content_tags, 2);
            if ((e = emit_text(CHAT_EVENT_CONTENT, s, n - keep, fn, user))) return e;
            buf_consume(&p->buf, n - keep);
            return ERR_OK;
        }
        if (p->state == PARSE_TOOL_CALL) {
            // Search only what is new (plus a possible tag start): a long call fed token by
            // token stays linear.
            const size_t from = p->n_scanned;
            size_t at = find(s + from, n - from, TAG_CALL_END, false);
            if (at == SIZE_MAX) {
                const size_t lt = strlen(TAG_CALL_END) - 1;
                p->n_scanned = n > lt ? n - lt : 0;
                return ERR_OK;
            }
            at += from;
            p->n_scanned = 0;
            if ((e = finish_call(p, at, fn, user))) return e;
            buf_consume(&p->buf, at + strlen(TAG_CALL_END));
            p->state = PARSE_CONTENT;
            continue;
        }
        return ERR_OK;
    }
}

Err chat_parser_feed(ChatParser *p, const char *text, size_t n, ChatEventFn fn, void *user)
{
    ASSERT(p->state != PARSE_DONE);
    Err e = parser_append(p, text, n);
    if (e) return e;
    return parser_run(p, fn, user);
}

Err chat_parser_finish(ChatParser *p, ChatEventFn fn, void *user)
{
    ASSERT(p->state != PARSE_DONE);
    Err e = ERR_OK;
    switch (p->state) {
    case PARSE_REASONING:
        e = emit_text(CHAT_EVENT_REASONING, p->buf.p, p->buf.n, fn, user);
        break;
    case PARSE_CONTENT: {
        size_t w = 0;
        while (w < p->buf.n && is_ascii_space(p->buf.p[w]))
            w++;
        if (!(p->after_tool_call && w == p->buf.n)) {
            e = emit_text(CHAT_EVENT_CONTENT, p->buf.p, p->buf.n, fn, user);
        }
        break;
    }
    case PARSE_TOOL_CALL: {
        // Cut off inside a call: pass the text on as content.
        Buf b = {0};
        buf_adds(&b, TAG_CALL);
        buf_add(&b, p->buf.p, p->buf.n);
        e = b.is_oom ? ERR_NOMEM : emit_text(CHAT_EVENT_CONTENT, b.p, b.n, fn, user);
        buf_free(&b);
        break;
    }
    }
    buf_clear(&p->buf);
    p->state = PARSE_DONE;
    return e;
}
