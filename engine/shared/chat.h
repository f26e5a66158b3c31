/*
 * chat.h - the GLM chat format: OpenAI-style messages to the GLM-4.7/GLM-5.x prompt text,
 * and the incremental parser that splits generated text into reasoning, content and tool
 * calls.
 *
 * Rendering reproduces the GLM-4.7 Jinja chat template (the same role tokens, thinking and
 * tool-call syntax GLM-5.x uses) as transformers renders it, byte for byte:
 *
 *   [gMASK]<sop>                              always
 *   <|system|>Reasoning Effort: High          GLM-5.2 only, when thinking is on
 *   <|system|>\n# Tools ... </tools> ...      when tools is a non-empty array
 *   <|system|>{text}  <|user|>{text}          per message (developer counts as system)
 *   <|assistant|><think>{r}</think>{content}  r only after the last user message (or with
 *   <|assistant|></think>{content}            clear_thinking false), else the bare </think>
 *   <tool_call>{name}<arg_key>{k}</arg_key><arg_value>{v}</arg_value>...</tool_call>
 *   <|observation|><tool_response>{c}</tool_response>...  once per run of tool messages
 *   <|assistant|><think>  /  <|assistant|></think>        generation prompt, thinking on/off
 *
 * Strings are inserted raw; non-string tool arguments and tool definitions are serialised
 * as Python's json.dumps(ensure_ascii=False) does (", " and ": " separators, shortest float
 * repr), and content is stripped with Python's str.strip() whitespace set, because that is
 * what the template's tojson filter and .strip() do. tests/golden/chat/cases.jsonl holds
 * renderings made by transformers 5.17 from the real template.
 *
 * Where the template would print nonsense we render what a client means and say so here:
 * content null renders as "" (the template prints "None"), tool-call arguments arrive as a
 * JSON string (OpenAI) and are parsed, in key order, before rendering (the template needs
 * a mapping), a tool message whose content is an array of text parts renders like a string.
 * Inputs the template cannot express are rejected with ERR_INVAL and a message naming the
 * field ("messages[2].content: ..."): unknown roles, wrong JSON types, non-text content
 * parts, a tool message that follows no assistant tool call, arguments that are not a JSON
 * object. Integers beyond 64 bits are clamped by json-c (Python would keep them exact).
 *
 * The output parser (ChatParser) takes generated text in arbitrary pieces (as the
 * streaming detokenizer emits them; a tag may be split anywhere) and calls back with
 * reasoning deltas, content deltas and complete tool calls. It never emits part of a tag
 * as text: a suffix that could still become <think>, </think>, <tool_call> or </tool_call>
 * is held back until the next piece decides it. Whitespace between consecutive tool calls
 * and after the last one is dropped. A tool call that does not parse (or is cut off by the
 * end of generation) is passed on verbatim as content, so no generated text is lost. The
 * same output split at any points yields the same text per kind, in the same order.
 * Feed text detokenized with skip_special = false: the tags are added tokens of GLM's
 * tokenizer and would vanish otherwise. Stop tokens (<|user|>, <|observation|>,
 * <|endoftext|>) end generation before they reach the parser.
 *
 * Ownership: chat_render* returns a malloc'd prompt the caller frees with free(). Messages,
 *            tools and requests are borrowed for the call. ChatParser is caller storage
 *            (chat_parser_init/chat_parser_free); it takes its own reference on tools.
 *            Event pointers are valid only during the callback.
 * Threads:   rendering is reentrant. A ChatParser belongs to one thread at a time.
 * Errors:    ERR_INVAL for a request the format cannot express (ChatError.msg names the
 *            field; logged at debug level only: it is the client's error, fcgi/ answers
 *            400 with the message), ERR_NOMEM, or whatever a callback returns.
 */
#ifndef ENGINE_SHARED_CHAT_H
#define ENGINE_SHARED_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include <json-c/json.h>

#include "engine/shared/buf.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ChatTemplate {
    CHAT_TEMPLATE_GLM47,  // the GLM-4.7 template exactly (what the goldens test)
    CHAT_TEMPLATE_GLM52,  // GLM-4.7 plus GLM-5.2's first line "Reasoning Effort: ..."
} ChatTemplate;

typedef enum ChatEffort {
    CHAT_EFFORT_HIGH,  // "Reasoning Effort: High" (the serving recipe's patched default)
    CHAT_EFFORT_MAX,   // "Reasoning Effort: Max" (GLM-5.2's template for any other value)
} ChatEffort;

typedef struct ChatOptions {
    ChatTemplate tmpl;
    bool thinking;               // enable_thinking: <think> generation prompt when true
    bool clear_thinking;         // true: history keeps reasoning only after the last user turn
    bool add_generation_prompt;  // end with <|assistant|> and the think tag
    ChatEffort effort;           // GLM-5.2 only, printed when thinking is on
} ChatOptions;

// A client-facing error message naming the offending field, e.g.
// "messages[2].tool_calls[0].function.arguments: not a JSON object".
typedef struct ChatError {
    char msg[256];
} ChatError;

// ---------------------------------------------------------------------------
// Rendering

// Defaults: thinking on, clear_thinking on, generation prompt on, effort High.
void chat_options_default(ChatOptions *opts, ChatTemplate tmpl);

// Update *opts from an OpenAI-style request object: add_generation_prompt,
// chat_template_kwargs.{enable_thinking,clear_thinking}, thinking.type ("enabled" or
// "disabled", as GLM's own API sends it) and reasoning_effort ("high" -> High, any other
// string -> Max, as GLM-5.2's template does). Fields that are absent leave *opts alone.
// ERR_INVAL (err->msg names the field) when one has the wrong type.
Err chat_options_from_request(ChatOptions *opts, const json_object *request, ChatError *err);

// Render messages (a JSON array) and tools (a JSON array, or NULL) to the prompt text. On
// success *out is a malloc'd NUL-terminated string of *n_out bytes (strings may hold NUL
// bytes) that the caller frees; on failure *out is untouched and err->msg says why.
Err chat_render(const json_object *messages, const json_object *tools, const ChatOptions *opts,
                char **out, size_t *n_out, ChatError *err);

// Render a whole request: an object with "messages" (and "tools", options as in
// chat_options_from_request applied over chat_options_default(tmpl)) or a bare messages
// array. The options used are written to *opts_out when it is not NULL, so that the caller
// can start its ChatParser in the right state.
Err chat_render_request(const json_object *request, ChatTemplate tmpl, char **out, size_t *n_out,
                        ChatOptions *opts_out, ChatError *err);

// Python json.dumps(value, ensure_ascii=False) of a json-c value, appended to nothing: on
// success *out is a malloc'd NUL-terminated string the caller frees. value NULL is "null".
Err chat_json_dumps(const json_object *value, char **out, size_t *n_out);

// ---------------------------------------------------------------------------
// Output parser

typedef enum ChatEventKind {
    CHAT_EVENT_REASONING,  // text, n_text: a reasoning_content delta
    CHAT_EVENT_CONTENT,    // text, n_text: a content delta
    CHAT_EVENT_TOOL_CALL,  // name, arguments, index: one complete tool call
} ChatEventKind;

typedef struct ChatEvent {
    ChatEventKind kind;
    const char *text;  // delta bytes (not NUL-terminated); never empty
    size_t n_text;
    const char *name;       // NUL-terminated function name
    const char *arguments;  // NUL-terminated JSON object, Python json.dumps style
    int index;              // 0-based position of the call among this output's calls
} ChatEvent;

// Called for each event; a non-OK return stops the parser call and is returned by it.
typedef Err (*ChatEventFn)(void *user, const ChatEvent *event);

typedef struct ChatParser {
    int state;             // internal: where in the output we are
    bool after_tool_call;  // internal: whitespace after </tool_call> is pending
    int n_tool_calls;
    Buf buf;             // internal: held-back text, or the body of an open tool call
    size_t n_scanned;    // internal: bytes of an open call already searched for its end
    json_object *tools;  // own reference, or NULL: argument types come from the schema
} ChatParser;

// Start a parser. in_reasoning: the prompt ended inside <think> (see
// chat_prompt_opens_reasoning). tools (borrowed; the parser keeps a reference) may be NULL;
// with it, a value whose parameter schema says "string" stays a string even when it looks
// like JSON, any other value becomes a number/bool/object/array/null when it parses as JSON.
// Failure (ERR_NOMEM) leaves *p zeroed.
Err chat_parser_init(ChatParser *p, bool in_reasoning, const json_object *tools);

// Feed n bytes of generated text; events for everything that is now decided go to fn.
Err chat_parser_feed(ChatParser *p, const char *text, size_t n, ChatEventFn fn, void *user);

// End of generation: emit whatever is held back. The parser must then only be freed.
Err chat_parser_finish(ChatParser *p, ChatEventFn fn, void *user);

// Release the parser and zero it; NULL and a zeroed parser are allowed.
void chat_parser_free(ChatParser *p);

// True when the rendered prompt leaves the model inside a reasoning block (it ends with
// "<think>"): start the parser with in_reasoning = true.
bool chat_prompt_opens_reasoning(const char *prompt, size_t n);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_CHAT_H
