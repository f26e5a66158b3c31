/*
 * json_grammar.h - JSON and a JSON-Schema subset as a byte-by-byte automaton, for
 * constrained decoding (response_format) and for validating schemas in the API.
 *
 * jgram_compile() turns a schema (or none: any JSON object, {"type": "json_object"}) into a
 * tree of nodes; a JgramState is where a partial output stands in it. jgram_feed() advances
 * a state by one byte and says whether the byte can still lead to a valid document;
 * jgram_can_end() says whether the output may end here; jgram_completion() writes the
 * shortest bytes that finish the document from a state (what the engine forces when
 * max_tokens is about to run out, so even a random model's output parses).
 *
 * The supported subset (anything else is refused by jgram_compile, naming the keyword):
 *   type (a name or an array of names: null, boolean, integer, number, string, array,
 *   object), enum, const, properties, required, additionalProperties (false, true or a
 *   schema; absent means false when "properties" is given, any value otherwise, as
 *   vLLM's strict mode does), items, minItems, maxItems, minLength, maxLength, anyOf,
 *   $ref to "#/$defs/NAME" or "#/definitions/NAME" (not recursive), and the annotations
 *   title, description, default, examples, $schema, $id, $comment, deprecated, readOnly,
 *   writeOnly, strict (ignored).
 * What the automaton emits is a subset of what the schema accepts: compact JSON (one
 * optional space after ':' and ',', up to two spaces or newlines before the document, no
 * other whitespace), numbers with at most 16 integer digits, 16 fraction digits and 3
 * exponent digits, objects nested at most JGRAM_MAX_DEPTH - 1 deep, no duplicate declared
 * keys (duplicates among additional keys are not tracked). Strings are UTF-8 with
 * JSON's escapes; lengths count code points. Limits: 64 properties per object, 64 enum
 * values, 8 alternatives per anyOf (after flattening) and 8 ways to read one value through
 * nested anyOf (JGRAM_MAX_THREADS), 4096 nodes, 64 KiB of literals, shortest values of
 * 64 KiB each and 4 MiB together, shortest values nested at most JGRAM_MAX_DEPTH - 2 deep
 * (containers open only where their shortest close fits). A $ref target compiles once.
 *
 * Ownership: jgram_compile allocates the grammar (jgram_free releases it); a JgramState
 *            is plain data the caller owns and may copy with jgram_copy.
 * Threads:   a compiled grammar is read-only: any number of threads may use it at once.
 * Errors:    jgram_compile returns ERR_INVAL with a message naming the keyword and its
 *            JSON pointer, ERR_NOMEM; the matcher functions cannot fail.
 */
#ifndef ENGINE_SHARED_JSON_GRAMMAR_H
#define ENGINE_SHARED_JSON_GRAMMAR_H

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { JGRAM_MAX_DEPTH = 24, JGRAM_MAX_THREADS = 8 };

typedef struct JgramGrammar JgramGrammar;

// One frame of a parse: a value being read and where in it (json_grammar.c).
typedef struct JgramFrame {
    uint8_t kind, st;
    uint16_t node;
    uint32_t a, b, c;
    uint64_t set;
} JgramFrame;

// One way to read the output so far (anyOf keeps several).
typedef struct JgramThread {
    int depth;
    JgramFrame f[JGRAM_MAX_DEPTH];
} JgramThread;

typedef struct JgramState {
    int n;  // live threads; 0: the output can no longer be valid
    JgramThread t[JGRAM_MAX_THREADS];
} JgramState;

// Compile schema (NULL: any JSON object). *out NULL on failure; msg (cap bytes) gets the
// reason on ERR_INVAL, e.g. "unsupported keyword 'pattern' at /properties/name".
Err jgram_compile(json_object *schema, JgramGrammar **out, char *msg, size_t cap);

// A tool call's grammar (tool_choice "required" or named), in GLM's format: for tools (the
// request's "tools" array) the text after the forced "<tool_call>" (name NULL: one of the
// tools' names, then its arguments) or after "<tool_call>NAME" (name given: that tool's
// arguments), i.e. "NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>". Each
// tool's "parameters" must be an object schema of the subset; a value whose schema's
// "type" names "string" is raw text without '<' (as the chat parser reads it), others
// JSON. Errors as jgram_compile, the pointer starting "/tools/I/function/parameters".
Err jgram_compile_tools(json_object *tools, const char *name, JgramGrammar **out, char *msg,
                        size_t cap);

// True for tool-call grammars: their markup ("<arg_key>", ...) may come as special tokens.
bool jgram_wants_markup(const JgramGrammar *g);

// Release a grammar. Safe on NULL.
void jgram_free(JgramGrammar *g);

// The state before any output.
void jgram_start(const JgramGrammar *g, JgramState *st);

// Advance by one byte (or n bytes). False when no valid document starts with the output
// so far; the state is then dead (n == 0) and stays so.
bool jgram_feed(const JgramGrammar *g, JgramState *st, uint8_t byte);
bool jgram_feed_bytes(const JgramGrammar *g, JgramState *st, const void *bytes, size_t n);

// True when the output so far is a whole valid document.
bool jgram_can_end(const JgramGrammar *g, const JgramState *st);

// The shortest bytes that make the output a whole document: written to out (cap bytes,
// no terminator); returns their count, or -1 when the state is dead or they need more
// than cap bytes. 0 when jgram_can_end(). With several threads (anyOf) each one's shortest
// completion is checked by feeding it to a copy of the whole state.
int jgram_completion(const JgramGrammar *g, const JgramState *st, char *out, int cap);

// Copy a state (only its live part); hash its live part (equal states hash alike).
void jgram_copy(JgramState *dst, const JgramState *src);
uint64_t jgram_hash(const JgramState *st);
bool jgram_equal(const JgramState *a, const JgramState *b);

// With one live thread reading a string whose next byte may be any plain character
// (not inside an escape or a UTF-8 sequence): how many more code points it may take
// (INT32_MAX: no maxLength), else -1. Every plain token (no '"', '\\' or control byte;
// valid UTF-8 starting on a character, its last one possibly cut short) that starts at
// most that many characters is then accepted (constrain.c's fast path).
int32_t jgram_plain_room(const JgramGrammar *g, const JgramState *st);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_JSON_GRAMMAR_H
