/*
 * fuzz_tok_encode.c - libFuzzer target: random bytes through the encoder and back.
 *
 * Two small tokenizers are built once in-process: a GPT-2 style byte-level one (regex
 * pre-tokenizer, merges, a special token) and a SentencePiece style one (Prepend/Replace
 * normalizers, byte_fallback over all 256 bytes, Replace/ByteFallback/Fuse/Strip decoders).
 * The first input byte picks one. Invariants: encoding never fails or crashes; for input
 * that is valid UTF-8, decode(encode(x)) == x, and the streaming decoder yields the same
 * bytes in pieces that are each valid UTF-8.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"
#include "engine/shared/err.h"
#include "engine/shared/tok_internal.h"
#include "engine/shared/tokenizer.h"
#include "engine/shared/utf8.h"
#include "tests/engine/shared/tok_json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static Tokenizer *build(int kind)
{
    Buf json = {0};
    if (kind == 0) {
        buf_adds(&json, "{\"added_tokens\":[{\"id\":300,\"content\":\"<|end|>\",\"special\":"
                        "true,\"normalized\":false}],\"normalizer\":{\"type\":\"NFC\"},"
                        "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":"
                        "\"Digits\",\"individual_digits\":true},{\"type\":\"ByteLevel\","
                        "\"add_prefix_space\":false,\"use_regex\":true}]},\"decoder\":"
                        "{\"type\":\"ByteLevel\"},");
        tok_json_bytelevel_model(&json);
    } else {
        buf_adds(&json,
                 "{\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":"
                 "\"Prepend\",\"prepend\":\"\\u2581\"},{\"type\":\"Replace\",\"pattern\":"
                 "{\"String\":\" \"},\"content\":\"\\u2581\"}]},\"decoder\":{\"type\":"
                 "\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":"
                 "\"\\u2581\"},\"content\":\" \"},{\"type\":\"ByteFallback\"},{\"type\":"
                 "\"Fuse\"},{\"type\":\"Strip\",\"content\":\" \",\"start\":1,\"stop\":0}]},"
                 "\"model\":{\"type\":\"BPE\",\"byte_fallback\":true,\"unk_token\":\"<unk>\","
                 "\"fuse_unk\":true,\"vocab\":{\"<unk>\":0,");
        for (int b = 0; b < 256; b++)
            buf_addf(&json, "\"<0x%02X>\":%d,", b, b + 1);
        buf_adds(&json, "\"\\u2581\":257,\"a\":258,\"b\":259,\"\\u2581a\":260,\"ab\":261,"
                        "\"\\u4e2d\":262},\"merges\":[\"\\u2581 a\",\"a b\"]}}");
    }
    Tokenizer *tok = NULL;
    if (json.is_oom || tok_load_json(&tok, json.p, json.n)) abort();
    buf_free(&json);
    return tok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static Tokenizer *toks[2];
    if (!toks[0]) {
        toks[0] = build(0);
        toks[1] = build(1);
    }
    if (size == 0) return 0;
    const Tokenizer *tok = toks[data[0] & 1];
    const char *text = (const char *) data + 1;
    const size_t n = size - 1;
    TokIds ids = {0};
    if (tok_encode(tok, text, n, false, &ids)) abort();
    char *out = NULL;
    size_t out_n = 0;
    if (tok_decode(tok, ids.ids, ids.n, false, &out, &out_n)) abort();
    // The round trip is exact for valid UTF-8 except where the tokenizer rewrites text on
    // purpose: NFC may recompose (so the byte-level check takes ASCII only), and the
    // SentencePiece style turns a literal U+2581 in the input into a space.
    const bool valid = utf8_valid_prefix((const uint8_t *) text, n) == n;
    bool exact = valid;
    for (size_t i = 0; i < n && exact; i++) {
        exact = (data[0] & 1) ? !(i + 2 < n && memcmp(text + i, "\xe2\x96\x81", 3) == 0)
                              : (uint8_t) text[i] < 0x80;
    }
    if (exact && (out_n != n || memcmp(out, text, n) != 0)) abort();
    TokStream *s = NULL;
    if (tok_stream_create(&s, tok, false)) abort();
    size_t got = 0;
    for (size_t k = 0; k <= ids.n; k++) {
        const char *p;
        size_t np;
        if (k < ids.n ? tok_stream_feed(s, ids.ids[k], &p, &np) : tok_stream_flush(s, &p, &np)) {
            abort();
        }
        if (utf8_valid_prefix((const uint8_t *) p, np) != np) abort();
        if (got + np > out_n || memcmp(out + got, p, np) != 0) abort();
        got += np;
    }
    if (got != out_n) abort();
    tok_stream_destroy(s);
    free(out);
    tok_ids_free(&ids);
    return 0;
}
