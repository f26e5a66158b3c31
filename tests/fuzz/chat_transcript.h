/*
 * chat_transcript.h - shared by the chat fuzz targets: run ChatParser over some text and
 * flatten its events into a transcript that does not depend on how the text was split.
 *
 * The parser's streaming contract says that the same output cut at any points yields the
 * same text per kind, in the same order, and the same tool calls. chat_transcript() feeds
 * the text in the pieces given and writes one line per run of one kind ("\nR", "\nC", then
 * the concatenated text) and one line per tool call ("\nT", name, arguments), so two
 * transcripts of the same text compare equal with memcmp. Every event is checked against
 * chat.h's ChatEvent contract on the way (abort on violation): text never empty, a tool
 * call has a non-empty name without '<' and arguments that are a JSON object, calls are
 * numbered 0, 1, 2, ... in order, and an argument whose parameter the tools schema types
 * as "string" is a JSON string (chat.h: it stays a string even when it looks like JSON).
 *
 * Ownership: a ChatSink's buffer is malloc'd; the caller frees sink.p.
 * Threads:   one sink per thread.
 * Errors:    none: a broken contract aborts, which is what the fuzzer reports. C only (test
 *            code; tests/tools/check_headers.sh covers engine, fcgi and kernels).
 */
#ifndef TESTS_FUZZ_CHAT_TRANSCRIPT_H
#define TESTS_FUZZ_CHAT_TRANSCRIPT_H

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <json-c/json.h>

#include "engine/shared/chat.h"

typedef struct ChatSink {
    char *p;  // [n] raw events, each a kind letter, its bytes and a NUL
    size_t n, cap;
    int n_tool_calls;
    const json_object *tools;  // the parser's tools schema, or NULL
} ChatSink;

// o[key], or NULL when o is not an object (NULL included) or has no such key.
static inline json_object *chat_get(const json_object *o, const char *key)
{
    json_object *v = NULL;
    return json_object_object_get_ex(o, key, &v) ? v : NULL;
}

static inline bool chat_is_str(json_object *o, const char *s)
{
    return json_object_is_type(o, json_type_string) && strcmp(json_object_get_string(o), s) == 0;
}

// Does the schema type parameter key of the first tool named name as "string" (alone or
// in a list of types)? The fuzz oracle for chat.h's rule, written from its contract.
static inline bool chat_schema_says_string(const json_object *tools, const char *name,
                                           const char *key)
{
    const size_t n =
        json_object_is_type(tools, json_type_array) ? json_object_array_length(tools) : 0;
    json_object *fn = NULL;
    for (size_t i = 0; i < n && !fn; i++) {
        json_object *f = chat_get(json_object_array_get_idx(tools, i), "function");
        if (chat_is_str(chat_get(f, "name"), name)) fn = f;
    }
    if (!fn) return false;
    json_object *type =
        chat_get(chat_get(chat_get(chat_get(fn, "parameters"), "properties"), key), "type");
    if (!json_object_is_type(type, json_type_array)) return chat_is_str(type, "string");
    for (size_t j = 0; j < json_object_array_length(type); j++) {
        if (chat_is_str(json_object_array_get_idx(type, j), "string")) return true;
    }
    return false;
}

static inline void chat_sink_put(ChatSink *s, const char *text, size_t n)
{
    if (s->n + n + 1 > s->cap) {
        s->cap = (s->n + n + 1) * 2;
        s->p = realloc(s->p, s->cap);
        if (!s->p) abort();
    }
    memcpy(s->p + s->n, text, n);
    s->n += n;
}

static inline Err chat_sink_event(void *user, const ChatEvent *ev)
{
    ChatSink *s = user;
    const char tag[2] = {"RCT"[ev->kind], 0};
    chat_sink_put(s, tag, 1);
    if (ev->kind == CHAT_EVENT_TOOL_CALL) {
        if (!ev->name[0] || strchr(ev->name, '<') || ev->index != s->n_tool_calls++) abort();
        json_object *args = json_tokener_parse(ev->arguments);
        if (!json_object_is_type(args, json_type_object)) abort();
        json_object_object_foreach(args, key, value)
        {
            if (chat_schema_says_string(s->tools, ev->name, key)
                && !json_object_is_type(value, json_type_string)) {
                abort();
            }
        }
        json_object_put(args);
        chat_sink_put(s, ev->name, strlen(ev->name));
        chat_sink_put(s, ev->arguments, strlen(ev->arguments));
    } else {
        if (ev->n_text == 0) abort();
        chat_sink_put(s, ev->text, ev->n_text);
    }
    chat_sink_put(s, "", 1);
    return ERR_OK;
}

// Concatenate text per run of one kind so that different splits compare equal. Text is
// compared up to its first NUL (callers cut their input there).
static inline void chat_sink_normalize(const ChatSink *in, ChatSink *out)
{
    size_t i = 0;
    char last = 0;
    while (i < in->n) {
        const char kind = in->p[i];
        const char *body = in->p + i + 1;
        const size_t len = strlen(body);
        if (kind == 'T' || kind != last) {
            chat_sink_put(out, "\n", 1);
            chat_sink_put(out, &kind, 1);
        }
        chat_sink_put(out, body, len);
        last = kind == 'T' ? 0 : kind;
        i += 1 + len + 1;
    }
}

// Parse text[0..size) fed in pieces ending at cuts[0..n_cuts) (ascending, <= size), then
// size; write the normalised transcript to *out (zeroed by the caller).
static inline void chat_transcript(const json_object *tools, bool in_reasoning, const char *text,
                                   size_t size, const size_t *cuts, int n_cuts, ChatSink *out)
{
    ChatParser p;
    ChatSink raw = {.tools = tools};
    if (chat_parser_init(&p, in_reasoning, tools)) abort();
    size_t at = 0;
    for (int i = 0; i <= n_cuts; i++) {
        const size_t end = i < n_cuts ? cuts[i] : size;
        if (chat_parser_feed(&p, text + at, end - at, chat_sink_event, &raw)) abort();
        at = end;
    }
    if (chat_parser_finish(&p, chat_sink_event, &raw)) abort();
    chat_parser_free(&p);
    chat_sink_normalize(&raw, out);
    free(raw.p);
}

// Abort unless two transcripts are identical.
static inline void chat_transcript_same(const ChatSink *a, const ChatSink *b)
{
    if (a->n != b->n || (a->n && memcmp(a->p, b->p, a->n) != 0)) abort();
}

#endif  // TESTS_FUZZ_CHAT_TRANSCRIPT_H
