/*
 * tok_json.h - the small byte-level BPE model that tokenizer tests build their
 * tokenizer.json around (tests only; header-only).
 *
 * tok_json_bytelevel_model appends the "model" member and closes the tokenizer object: a
 * BPE whose vocabulary is the 256 byte-level chars (ids 0..255, byte b as its char
 * tok_bytelevel_char(b)) plus four merges: " t" (256), "he" (257), " the" (258) and the
 * first two bytes of U+4E2D 中 (259). The caller writes what comes before it (added tokens,
 * normalizer, pre-tokenizer, decoder), ending in a comma. tok_json_bytelevel_tokenizer loads
 * the plain byte-level tokenizer around it (ByteLevel pre-tokenizer and decoder).
 *
 * Ownership: appends to the caller's Buf.
 * Threads:   any.
 * Errors:    none here; the Buf's sticky is_oom says whether it all fit.
 */
#ifndef TESTS_ENGINE_SHARED_TOK_JSON_H
#define TESTS_ENGINE_SHARED_TOK_JSON_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/shared/buf.h"
#include "engine/shared/tok_internal.h"
#include "engine/shared/tokenizer.h"
#include "engine/shared/utf8.h"

static inline void tok_json_bytelevel_model(Buf *b)
{
    buf_adds(b, "\"model\":{\"type\":\"BPE\",\"vocab\":{");
    for (int i = 0; i < 256; i++) {
        char ch[5] = {0};
        utf8_encode(tok_bytelevel_char((uint8_t) i), ch);
        const bool esc = ch[0] == '"' || ch[0] == '\\';
        buf_addf(b, "\"%s%s\":%d,", esc ? "\\" : "", ch, i);
    }
    // U+0120 is the byte-level char for ' '; 0xE4 0xB8 0xAD is U+4E2D.
    buf_adds(b, "\"\\u0120t\":256,\"he\":257,\"\\u0120the\":258,\"\\u00e4\\u00b8\":259},"
                "\"merges\":[\"\\u0120 t\",\"h e\",\"\\u0120t he\",\"\\u00e4 \\u00b8\"]}}");
}

// The byte-level tokenizer with added_tokens (a JSON array) as given; NULL when it does not
// load. The caller destroys it (tok_destroy).
static inline Tokenizer *tok_json_bytelevel_tokenizer(const char *added_tokens)
{
    Buf json = {0};
    buf_addf(&json, "{\"added_tokens\":%s,\"pre_tokenizer\":{\"type\":\"ByteLevel\","
                    "\"add_prefix_space\":false,\"use_regex\":true},\"decoder\":{\"type\":"
                    "\"ByteLevel\"},",
             added_tokens);
    tok_json_bytelevel_model(&json);
    Tokenizer *t = NULL;
    if (json.is_oom || tok_load_json(&t, json.p, json.n) != ERR_OK) t = NULL;
    buf_free(&json);
    return t;
}

#endif  // TESTS_ENGINE_SHARED_TOK_JSON_H
