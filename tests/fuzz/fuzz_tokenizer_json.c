/*
 * fuzz_tokenizer_json.c - libFuzzer target: arbitrary bytes as a tokenizer.json.
 *
 * Invariants: tok_load_json never crashes and either fails with *out == NULL or returns a
 * tokenizer that can encode and decode a few fixed strings (including invalid UTF-8 and
 * special-token look-alikes) without crashing, and whose stream decoding concatenates to
 * the whole decode.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/err.h"
#include "engine/shared/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const TEXTS[] = {"", "Hello  world 123", "a\xff\xc3", "<s>x</s>\n\t",
                                    "\xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x91\x8d"};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int quiet;
    if (!quiet) {
        // Rejected inputs are the common case here: keep the log quiet (above ERROR).
        log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
        quiet = 1;
    }
    Tokenizer *tok = NULL;
    const Err err = tok_load_json(&tok, (const char *) data, size);
    if (err) {
        if (tok) abort();  // a failed load must leave *out NULL
        return 0;
    }
    TokIds ids = {0};
    for (size_t i = 0; i < sizeof TEXTS / sizeof *TEXTS; i++) {
        ids.n = 0;
        if (tok_encode(tok, TEXTS[i], strlen(TEXTS[i]), i & 1, &ids)) continue;
        char *text = NULL;
        size_t n = 0;
        if (tok_decode(tok, ids.ids, ids.n, false, &text, &n) == ERR_OK) {
            TokStream *s = NULL;
            if (tok_stream_create(&s, tok, false) == ERR_OK) {
                size_t got = 0;
                for (size_t k = 0; k <= ids.n; k++) {
                    const char *p;
                    size_t np;
                    const Err e2 = k < ids.n ? tok_stream_feed(s, ids.ids[k], &p, &np)
                                             : tok_stream_flush(s, &p, &np);
                    if (e2) break;
                    if (got + np > n || memcmp(text + got, p, np) != 0) abort();
                    got += np;
                }
                tok_stream_destroy(s);
            }
        }
        free(text);
    }
    tok_ids_free(&ids);
    tok_destroy(tok);
    return 0;
}
