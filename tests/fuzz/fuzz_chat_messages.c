/*
 * fuzz_chat_messages.c - libFuzzer target for the GLM chat renderer and output parser.
 *
 * The input is taken as a chat request JSON (object or bare messages array) and rendered
 * with both templates. Invariants (SQLite's fuzzinvariants style): no crash, no leak; a
 * rendering that succeeds starts with "[gMASK]<sop>" and is NUL-terminated at its length;
 * a failure is ERR_INVAL with a non-empty message (or ERR_NOMEM). The same bytes are then
 * fed to ChatParser whole and in three pieces cut at input-dependent points: both runs
 * must yield the same transcript (the parser's streaming contract).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <json-c/json.h>

#include "engine/shared/chat.h"
#include "tests/fuzz/chat_transcript.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (1 << 20)) return 0;
    json_tokener *tok = json_tokener_new();
    json_object *req = json_tokener_parse_ex(tok, (const char *) data, (int) size);
    if (json_tokener_get_error(tok) == json_tokener_success) {
        for (int t = 0; t < 2; t++) {
            char *out = NULL;
            size_t n = 0;
            ChatOptions opts;
            ChatError err = {{0}};
            const Err e = chat_render_request(req, t ? CHAT_TEMPLATE_GLM52 : CHAT_TEMPLATE_GLM47,
                                              &out, &n, &opts, &err);
            if (e == ERR_OK) {
                if (n < 12 || memcmp(out, "[gMASK]<sop>", 12) != 0 || out[n] != '\0') abort();
                free(out);
            } else if (e == ERR_INVAL) {
                if (!err.msg[0] || out) abort();
            } else if (e != ERR_NOMEM) {
                abort();
            }
        }
    }
    json_object_put(req);
    json_tokener_free(tok);

    // Parser: events hold no NUL except inside text, so cut the text at the first NUL.
    const uint8_t *nul = memchr(data, 0, size);
    const size_t n_text = nul ? (size_t) (nul - data) : size;
    ChatSink whole = {0}, split = {0};
    size_t cuts[2] = {n_text / 3, n_text / 3 + (n_text > 1 ? data[1] % (n_text - n_text / 3) : 0)};
    if (cuts[1] > n_text) cuts[1] = n_text;
    const bool in_reasoning = n_text > 0 && (data[0] & 1);
    chat_transcript(NULL, in_reasoning, (const char *) data, n_text, NULL, 0, &whole);
    chat_transcript(NULL, in_reasoning, (const char *) data, n_text, cuts, 2, &split);
    chat_transcript_same(&whole, &split);
    free(whole.p);
    free(split.p);
    return 0;
}
