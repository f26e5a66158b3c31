/*
 * fuzz_json_grammar.c - jgram_compile on arbitrary schemas, then the automaton on arbitrary
 * output bytes.
 *
 * Bytes up to the first NUL are the schema (JSON; not JSON or a refused schema is fine; an
 * array is a request's "tools", compiled as a tool call's grammar), the rest is fed to the
 * automaton byte by byte. Invariants (abort on violation): a refused
 * schema leaves a message; from live states (about 32 per input, and the last) the
 * completion, fed back, makes a whole document; a dead state stays dead.
 */
#include <json-c/json.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/json_grammar.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    const uint8_t *nul = memchr(data, 0, size);
    const size_t len = nul ? (size_t) (nul - data) : size;
    json_tokener *tk = json_tokener_new_ex(32);
    if (!tk) return 0;
    json_object *schema = json_tokener_parse_ex(tk, (const char *) data, (int) len);
    json_tokener_free(tk);
    if (!schema && len > 0) return 0;  // not JSON: nothing to compile (empty: json_object)
    JgramGrammar *g = NULL;
    char msg[200];
    // An array is a tools list: the tool-call grammar (tool_choice "required").
    const Err err = json_object_is_type(schema, json_type_array)
                        ? jgram_compile_tools(schema, NULL, &g, msg, sizeof msg)
                        : jgram_compile(schema, &g, msg, sizeof msg);
    ASSERT((err == ERR_OK) == (g != NULL));
    if (err == ERR_INVAL) ASSERT(msg[0] != 0);
    if (g) {
        JgramState *st = malloc(sizeof *st), *probe = malloc(sizeof *probe);
        // Completions up to the serving path's bound (engine/serve/constrain.c,
        // CONSTRAIN_MAX_COMPLETION): longer ones return -1 there too, and feeding 128 KiB
        // ones back 32 times an input took tens of seconds under the sanitizers.
        static char comp[4096 + 1];
        if (st && probe) {
            jgram_start(g, st);
            const uint8_t *doc = nul ? nul + 1 : data + size;
            const size_t n_doc = (size_t) (data + size - doc);
            const size_t every = n_doc / 32 + 1;  // completions at ~32 points: bounded time
            for (size_t i = 0; i <= n_doc; i++) {
                if (st->n == 0) break;
                // From this live state the completion finishes a document.
                const int m = i % every == 0 || i == n_doc
                                  ? jgram_completion(g, st, comp, (int) sizeof comp - 1)
                                  : -1;
                if (m >= 0) {
                    jgram_copy(probe, st);
                    ASSERT(jgram_feed_bytes(g, probe, comp, (size_t) m));
                    ASSERT(jgram_can_end(g, probe));
                }
                if (i < n_doc && !jgram_feed(g, st, doc[i])) ASSERT(st->n == 0 && !jgram_feed(g, st, 'x'));
            }
        }
        free(st);
        free(probe);
    }
    jgram_free(g);
    json_object_put(schema);
    return 0;
}
