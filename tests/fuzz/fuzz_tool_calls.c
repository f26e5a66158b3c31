/*
 * fuzz_tool_calls.c - libFuzzer target for ChatParser with a tools schema: generated text
 * holding <think> and <tool_call> sections, streamed in arbitrary pieces.
 *
 * fuzz_chat_messages covers the parser without tools; here the schema decides whether an
 * <arg_value> stays a string or is parsed as JSON (engine/shared/chat.c param_is_string),
 * and the text is mostly model output rather than a request. Input layout:
 *
 *   byte 0        flags: bit 0 = the prompt left the model inside <think>
 *   bytes 1..     the tools JSON (any JSON: the parser must cope with a wrong schema),
 *                 up to the first NUL; no NUL means no tools and the rest is text
 *   after the NUL the generated text, up to the next NUL
 *
 * Invariants (chat_transcript.h checks every event): the transcript is the same fed whole,
 * one byte at a time, and cut at pseudo-random points seeded by the flags byte; every tool
 * call has a name and a JSON object of arguments, numbered in order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <json-c/json.h>

#include "engine/shared/chat.h"
#include "tests/fuzz/chat_transcript.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MAX_TEXT = 1 << 16, N_CUTS = 8 };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (1 << 20)) return 0;
    const uint8_t flags = data[0];
    const char *rest = (const char *) data + 1;
    const size_t n_rest = size - 1;
    const char *nul = memchr(rest, 0, n_rest);
    json_object *tools = NULL;
    const char *text = rest;
    size_t n_text = n_rest;
    if (nul) {
        json_tokener *tok = json_tokener_new();
        if (!tok) return 0;
        tools = json_tokener_parse_ex(tok, rest, (int) (nul - rest));
        if (json_tokener_get_error(tok) != json_tokener_success) {
            json_object_put(tools);
            tools = NULL;
        }
        json_tokener_free(tok);
        text = nul + 1;
        n_text = n_rest - (size_t) (nul - rest) - 1;
        const char *end = memchr(text, 0, n_text);
        if (end) n_text = (size_t) (end - text);
    }
    if (n_text > MAX_TEXT) n_text = MAX_TEXT;
    const bool in_reasoning = flags & 1;

    ChatSink whole = {0}, bytewise = {0}, random = {0};
    chat_transcript(tools, in_reasoning, text, n_text, NULL, 0, &whole);

    size_t *ones = n_text ? malloc(n_text * sizeof *ones) : NULL;
    if (n_text && !ones) abort();
    for (size_t i = 0; i < n_text; i++)
        ones[i] = i + 1;
    chat_transcript(tools, in_reasoning, text, n_text, ones, n_text ? (int) n_text - 1 : 0,
                    &bytewise);
    free(ones);

    size_t cuts[N_CUTS];
    uint32_t x = 0x9e3779b9u ^ flags;
    for (int i = 0; i < N_CUTS; i++) {
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;  // xorshift32
        cuts[i] = n_text ? x % (n_text + 1) : 0;
    }
    for (int i = 1; i < N_CUTS; i++) {  // insertion sort: cuts must ascend
        for (int j = i; j > 0 && cuts[j - 1] > cuts[j]; j--) {
            const size_t t = cuts[j];
            cuts[j] = cuts[j - 1];
            cuts[j - 1] = t;
        }
    }
    chat_transcript(tools, in_reasoning, text, n_text, cuts, N_CUTS, &random);

    chat_transcript_same(&whole, &bytewise);
    chat_transcript_same(&whole, &random);
    free(whole.p);
    free(bytewise.p);
    free(random.p);
    json_object_put(tools);
    return 0;
}
