/*
 * test_tokenizer.c - each tokenizer.json component on tiny in-process tokenizers, the
 * loader's errors, and streaming-decoder properties over random id sequences.
 *
 * The word tokenizer below sets ignore_merges, so a pre-token found in the vocabulary
 * becomes one id and the ids show exactly where the pre-tokenizer split. Expected ids are
 * worked out by hand from HF's documented semantics (pattern.rs, normalizer.rs split,
 * added_vocabulary.rs); the real-file goldens are in test_tokenizer_golden.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"
#include "engine/shared/tok_internal.h"
#include "engine/shared/tokenizer.h"
#include "engine/shared/utf8.h"
#include "tests/check.h"
#include "tests/engine/shared/tok_json.h"

#define VOCAB                                                                                  \
    "{\"<unk>\":0,\"a\":1,\"b\":2,\"-\":3,\"a-\":4,\"-b\":5,\"--\":6,\"1\":7,\"2\":8,\"3\":9," \
    "\"123\":10,\" \":11,\"ab\":12,\"fi\":13,\"f\":14,\"i\":15,\"x\":16,\"\\u2581\":17,"       \
    "\"\\u2581a\":18,\"A\":19}"

// A word tokenizer with the given normalizer, pre-tokenizer and added tokens (JSON or null).
static Tokenizer *word_tok(const char *norm, const char *pre, const char *added)
{
    char json[4096];
    snprintf(json, sizeof json,
             "{\"version\":\"1.0\",\"added_tokens\":%s,\"normalizer\":%s,\"pre_tokenizer\":%s,"
             "\"model\":{\"type\":\"BPE\",\"vocab\":" VOCAB ",\"merges\":[],"
             "\"ignore_merges\":true,\"unk_token\":\"<unk>\"}}",
             added ? added : "[]", norm ? norm : "null", pre ? pre : "null");
    Tokenizer *tok = NULL;
    const Err err = tok_load_json(&tok, json, strlen(json));
    CHECK(err == ERR_OK);
    return tok;
}

// Encode text and compare with want[0..n).
static void expect(const Tokenizer *tok, const char *text, const int32_t *want, size_t n, int line)
{
    TokIds ids = {0};
    const Err err = tok ? tok_encode(tok, text, strlen(text), false, &ids) : ERR_INVAL;
    bool ok = !err && ids.n == n;
    for (size_t i = 0; ok && i < n; i++)
        ok = ids.ids[i] == want[i];
    if (!ok) {
        fprintf(stderr, "line %d: \"%s\" ->", line, text);
        for (size_t i = 0; i < ids.n; i++)
            fprintf(stderr, " %d", (int) ids.ids[i]);
        fprintf(stderr, "\n");
    }
    CHECK(ok);
    tok_ids_free(&ids);
}

#define EXPECT(tok, text, ...)                                            \
    do {                                                                  \
        const int32_t want_[] = {__VA_ARGS__};                            \
        expect(tok, text, want_, sizeof want_ / sizeof *want_, __LINE__); \
    } while (0)

static Tokenizer *split_tok(const char *behavior, bool invert)
{
    char pre[256];
    snprintf(pre, sizeof pre,
             "{\"type\":\"Split\",\"pattern\":{\"String\":\"-\"},\"behavior\":\"%s\","
             "\"invert\":%s}",
             behavior, invert ? "true" : "false");
    return word_tok(NULL, pre, NULL);
}

static void test_split_behaviors(void)
{
    Tokenizer *t = split_tok("Removed", false);
    EXPECT(t, "a-b", 1, 2);
    tok_destroy(t);
    t = split_tok("Isolated", false);
    EXPECT(t, "a-b", 1, 3, 2);
    tok_destroy(t);
    t = split_tok("MergedWithPrevious", false);
    EXPECT(t, "a-b", 4, 2);
    EXPECT(t, "a--b", 4, 3, 2);  // a second match in a row starts its own piece
    tok_destroy(t);
    t = split_tok("MergedWithNext", false);
    EXPECT(t, "a-b", 1, 5);
    EXPECT(t, "a--b", 1, 3, 5);
    tok_destroy(t);
    t = split_tok("Contiguous", false);
    EXPECT(t, "a--b", 1, 6, 2);
    tok_destroy(t);
    t = split_tok("Removed", true);  // invert: the pattern's matches are what stays
    EXPECT(t, "a-b", 3);
    tok_destroy(t);
    // Regex patterns, UCP: \p{N} matches the Arabic-Indic digit too (not in vocab -> unk).
    t = word_tok(NULL,
                 "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\p{N}+\"},\"behavior\":"
                 "\"Isolated\",\"invert\":false}",
                 NULL);
    EXPECT(t, "a123b", 1, 10, 2);
    EXPECT(t,
           "a\xd9\xa3"
           "b",
           1, 0, 2);
    tok_destroy(t);
}

static void test_digits_and_sequence(void)
{
    Tokenizer *t = word_tok(NULL, "{\"type\":\"Digits\",\"individual_digits\":true}", NULL);
    EXPECT(t, "a123", 1, 7, 8, 9);
    tok_destroy(t);
    t = word_tok(NULL, "{\"type\":\"Digits\",\"individual_digits\":false}", NULL);
    EXPECT(t, "a123", 1, 10);
    tok_destroy(t);
    t = word_tok(NULL,
                 "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"WhitespaceSplit\"},"
                 "{\"type\":\"Digits\",\"individual_digits\":false}]}",
                 NULL);
    EXPECT(t, " a123  b ", 1, 10, 2);
    tok_destroy(t);
    t = word_tok(NULL,
                 "{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":"
                 "\"always\",\"split\":true}",
                 NULL);
    EXPECT(t, "a a", 18, 18);
    tok_destroy(t);
}

static void test_normalizers(void)
{
    Tokenizer *t = word_tok("{\"type\":\"Lowercase\"}", NULL, NULL);
    EXPECT(t, "AB", 12);
    tok_destroy(t);
    t = word_tok("{\"type\":\"NFKC\"}", NULL, NULL);
    EXPECT(t, "\xef\xac\x81", 13);  // U+FB01 LATIN SMALL LIGATURE FI -> "fi"
    tok_destroy(t);
    t = word_tok("{\"type\":\"NFC\"}", NULL, NULL);
    EXPECT(t, "\xef\xac\x81", 0);  // NFC keeps the ligature: unknown
    tok_destroy(t);
    t = word_tok("{\"type\":\"Replace\",\"pattern\":{\"String\":\"-\"},\"content\":\"\"}", NULL,
                 NULL);
    EXPECT(t, "a-b", 12);
    tok_destroy(t);
    t = word_tok("{\"type\":\"Replace\",\"pattern\":{\"Regex\":\"[0-9]+\"},\"content\":\"b\"}",
                 NULL, NULL);
    EXPECT(t, "a42", 12);
    tok_destroy(t);
    t = word_tok("{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Strip\",\"strip_left\":true,"
                 "\"strip_right\":true},{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"}]}",
                 NULL, NULL);
    EXPECT(t, " \t a \n", 18);
    TokIds ids = {0};
    CHECK(tok_encode(t, "", 0, false, &ids) == ERR_OK && ids.n == 0);  // Prepend skips ""
    tok_ids_free(&ids);
    tok_destroy(t);
}

static void test_added_tokens(void)
{
    Tokenizer *t = word_tok(NULL, NULL,
                            "[{\"id\":20,\"content\":\"<x>\",\"special\":true,\"lstrip\":true,"
                            "\"rstrip\":false,\"single_word\":false,\"normalized\":false}]");
    EXPECT(t, "a <x>b", 1, 20, 2);
    EXPECT(t, "<x><x>", 20, 20);
    CHECK(tok_token_to_id(t, "<x>") == 20);
    CHECK(tok_is_special(t, 20));
    CHECK(!tok_is_special(t, 1));
    CHECK(strcmp(tok_id_to_token(t, 20), "<x>") == 0);
    CHECK(tok_id_to_token(t, 99) == NULL);
    CHECK(tok_n_vocab(t) == 21);
    tok_destroy(t);
    t = word_tok(NULL, NULL,
                 "[{\"id\":20,\"content\":\"<x>\",\"special\":true,\"rstrip\":true,"
                 "\"normalized\":false}]");
    EXPECT(t, "a<x> \tb", 1, 20, 2);
    tok_destroy(t);
    t = word_tok(NULL, NULL,
                 "[{\"id\":20,\"content\":\"<x>\",\"special\":false,\"single_word\":true,"
                 "\"normalized\":false}]");
    EXPECT(t, "a<x>b", 1, 0, 16, 0, 2);  // inside a word: not matched; '<' '>' are unknown
    EXPECT(t, "a <x> b", 1, 11, 20, 11, 2);
    tok_destroy(t);
    // normalized == true: matched against the normalized text by its normalized form.
    t = word_tok("{\"type\":\"Lowercase\"}", NULL,
                 "[{\"id\":21,\"content\":\"XY\",\"special\":false,\"normalized\":true}]");
    EXPECT(t, "aXyb", 1, 21, 2);
    tok_destroy(t);
}

static void test_bpe_and_fallback(void)
{
    static const char *const merges[] = {"[\"b c\",\"a b\"]", "[[\"a\",\"b\"],[\"b\",\"c\"]]"};
    for (int k = 0; k < 2; k++) {
        char json[1024];
        snprintf(json, sizeof json,
                 "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"ab\":3,"
                 "\"bc\":4},\"merges\":%s},\"post_processor\":{\"type\":\"TemplateProcessing\","
                 "\"single\":[{\"SpecialToken\":{\"id\":\"a\",\"type_id\":0}},{\"Sequence\":"
                 "{\"id\":\"A\",\"type_id\":0}},{\"SpecialToken\":{\"id\":\"c\",\"type_id\":0}}],"
                 "\"special_tokens\":{\"a\":{\"id\":\"a\",\"ids\":[0],\"tokens\":[\"a\"]},"
                 "\"c\":{\"id\":\"c\",\"ids\":[2],\"tokens\":[\"c\"]}}}}",
                 merges[k]);
        Tokenizer *t = NULL;
        CHECK(tok_load_json(&t, json, strlen(json)) == ERR_OK);
        if (k == 0) {
            EXPECT(t, "abc", 0, 4);  // rank 0 is "b c"
        } else {
            EXPECT(t, "abc", 3, 2);
        }
        TokIds ids = {0};
        CHECK(tok_encode(t, "b", 1, true, &ids) == ERR_OK);
        CHECK(ids.n == 3 && ids.ids[0] == 0 && ids.ids[1] == 1 && ids.ids[2] == 2);
        tok_ids_free(&ids);
        int32_t pre[4];
        CHECK(tok_special_prefix(t, pre, 4) == 1 && pre[0] == 0);
        CHECK(tok_special_suffix(t, pre, 4) == 1 && pre[0] == 2);
        tok_destroy(t);
    }
    // Byte fallback, unk and fuse_unk; ByteFallback + Fuse decoding.
    const char *json =
        "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"<unk>\":0,\"<0xC3>\":1,\"<0xA9>\":2,"
        "\"a\":3},\"merges\":[],\"byte_fallback\":true,\"fuse_unk\":true,\"unk_token\":"
        "\"<unk>\"},\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":"
        "\"ByteFallback\"},{\"type\":\"Fuse\"}]}}";
    Tokenizer *t = NULL;
    CHECK(tok_load_json(&t, json, strlen(json)) == ERR_OK);
    EXPECT(t, "a\xc3\xa9", 3, 1, 2);
    EXPECT(t,
           "a\xe4\xb8\xad\xe4\xb8\xad"
           "a",
           3, 0, 3);
    const int32_t ok_ids[] = {1, 2, 3}, bad_ids[] = {1, 3};
    char *text;
    size_t n;
    CHECK(tok_decode(t, ok_ids, 3, false, &text, &n) == ERR_OK);
    CHECK(n == 3
          && memcmp(text,
                    "\xc3\xa9"
                    "a",
                    3)
                 == 0);
    free(text);
    CHECK(tok_decode(t, bad_ids, 2, false, &text, &n) == ERR_OK);
    CHECK(n == 4
          && memcmp(text,
                    "\xef\xbf\xbd"
                    "a",
                    4)
                 == 0);
    free(text);
    // Invalid UTF-8 input is repaired like Rust's from_utf8_lossy: "\xff" -> U+FFFD -> unk.
    EXPECT(t,
           "a\xff"
           "a",
           3, 0, 3);
    tok_destroy(t);
}

static void test_errors(void)
{
    static const struct {
        const char *json;
        Err want;
    } cases[] = {
        {"", ERR_FORMAT},
        {"{", ERR_FORMAT},
        {"[]", ERR_FORMAT},
        {"{} x", ERR_FORMAT},
        {"{}", ERR_FORMAT},  // no model
        {"{\"model\":{\"type\":\"Unigram\",\"vocab\":[]}}", ERR_INVAL},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":[],\"merges\":[]}}", ERR_FORMAT},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":\"0\"},\"merges\":[]}}", ERR_FORMAT},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a\"]}}", ERR_FORMAT},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a z\"]}}", ERR_FORMAT},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[],\"unk_token\":\"?\"}}",
         ERR_FORMAT},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[],\"dropout\":0.1}}", ERR_INVAL},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]},\"pre_tokenizer\":{\"type\":"
         "\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\"},{\"type\":\"Bogus\"}]}}",
         ERR_INVAL},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]},\"normalizer\":{\"type\":"
         "\"Replace\",\"pattern\":{\"Regex\":\"(\"},\"content\":\"\"}}",
         ERR_INVAL},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]},\"decoder\":{\"type\":7}}",
         ERR_FORMAT},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]},\"added_tokens\":[{\"id\":-1,"
         "\"content\":\"x\"}]}",
         ERR_FORMAT},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]},\"truncation\":{}}", ERR_INVAL},
        // Not UTF-8: a Prepend whose bytes would reach the regexes invalid (found by fuzzing:
        // PCRE2 runs without its own check, on text the loader must have validated).
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]},\"normalizer\":{\"type\":"
         "\"Prepend\",\"prepend\":\"\x8f\xff\"}}",
         ERR_FORMAT},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"\xc3\":0},\"merges\":[]}}", ERR_FORMAT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        Tokenizer *t = (Tokenizer *) 1;
        const Err err = tok_load_json(&t, cases[i].json, strlen(cases[i].json));
        if (err != cases[i].want) fprintf(stderr, "case %zu: got %s\n", i, err_name(err));
        CHECK(err == cases[i].want);
        CHECK(t == NULL);
    }
    Tokenizer *t = NULL;
    CHECK(tok_load(&t, "/nonexistent/tokenizer.json") == ERR_IO && t == NULL);
}

// A byte-level tokenizer over all 256 bytes with a few merges and one special token.
static Tokenizer *bytelevel_tok(void)
{
    Tokenizer *t = tok_json_bytelevel_tokenizer(
        "[{\"id\":260,\"content\":\"<|end|>\",\"special\":true,\"normalized\":false}]");
    CHECK(t != NULL);
    return t;
}

static void test_stream_property(void)
{
    Tokenizer *t = bytelevel_tok();
    if (!t) return;
    EXPECT(t, " the", 258);
    EXPECT(t, "a<|end|> the", 97, 260, 258);
    uint64_t rng = 0x9E3779B97F4A7C15ull;  // fixed seed: xorshift64
    for (int round = 0; round < 2000; round++) {
        int32_t ids[24];
        const size_t n = (size_t) (round % 24);
        for (size_t i = 0; i < n; i++) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            // Mostly UTF-8 lead and continuation bytes, so characters straddle ids.
            const uint32_t r = (uint32_t) (rng >> 33);
            ids[i] = r % 7 == 0 ? 256 + (int32_t) (r / 7 % 5) : (int32_t) (0x80 + r % 0x80);
        }
        for (int skip = 0; skip < 2; skip++) {
            char *want;
            size_t want_n;
            CHECK(tok_decode(t, ids, n, skip, &want, &want_n) == ERR_OK);
            TokStream *s = NULL;
            CHECK(tok_stream_create(&s, t, skip) == ERR_OK);
            char got[512];
            size_t got_n = 0;
            bool pieces_ok = true;
            for (size_t i = 0; i <= n; i++) {
                const char *p;
                size_t np;
                const Err err =
                    i < n ? tok_stream_feed(s, ids[i], &p, &np) : tok_stream_flush(s, &p, &np);
                pieces_ok &= !err && utf8_valid_prefix((const uint8_t *) p, np) == np
                             && got_n + np <= sizeof got;
                if (pieces_ok) {
                    memcpy(got + got_n, p, np);
                    got_n += np;
                }
            }
            CHECK(pieces_ok);
            CHECK(got_n == want_n && memcmp(got, want, want_n) == 0);
            tok_stream_destroy(s);
            free(want);
        }
    }
    tok_destroy(t);
}

// Decode ids whole and streamed; true when the pieces are valid UTF-8 and add up.
static bool stream_matches(const Tokenizer *t, const int32_t *ids, size_t n, bool skip)
{
    char *want;
    size_t want_n;
    if (tok_decode(t, ids, n, skip, &want, &want_n)) return false;
    TokStream *s = NULL;
    bool ok = tok_stream_create(&s, t, skip) == ERR_OK;
    size_t got = 0;
    for (size_t i = 0; ok && i <= n; i++) {
        const char *p;
        size_t np;
        ok = (i < n ? tok_stream_feed(s, ids[i], &p, &np) : tok_stream_flush(s, &p, &np)) == ERR_OK
             && utf8_valid_prefix((const uint8_t *) p, np) == np && got + np <= want_n
             && memcmp(want + got, p, np) == 0;
        got += ok ? np : 0;
    }
    ok = ok && got == want_n;
    tok_stream_destroy(s);
    free(want);
    return ok;
}

// Decoders whose first-token rules the stream must honour: none (join by spaces), Metaspace
// (drops the replacement chars of the first token), Strip after Fuse, two Strips after Fuse
// (they cut two chars of the start: the stream holds everything), and Strip after Fuse where
// a first token decodes to nothing ("a" is replaced by "": the start is still ahead); then
// decoders after a fusing step that see the whole text (Metaspace, Replace, ByteLevel after
// Fuse: the stream holds everything) and a Strip after ByteLevel (which fuses too).
static void test_stream_first_token_rules(void)
{
    Tokenizer *t = word_tok(NULL, NULL, "[{\"id\":20,\"content\":\"<x>\",\"special\":true}]");
    char *text;
    size_t n;
    const int32_t ab[] = {1, 2};
    CHECK(tok_decode(t, ab, 2, false, &text, &n) == ERR_OK && strcmp(text, "a b") == 0);
    free(text);
    tok_destroy(t);
    static const char *const decoders[] = {
        "null",
        "{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"always\","
        "\"split\":true}",
        "{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":"
        "\"\\u2581\"},\"content\":\" \"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":"
        "\" \",\"start\":1,\"stop\":0}]}",
        "{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":"
        "\"\\u2581\"},\"content\":\" \"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":"
        "\" \",\"start\":1,\"stop\":0},{\"type\":\"Strip\",\"content\":\" \",\"start\":1,\"stop\":0}]}",
        "{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":"
        "\"a\"},\"content\":\"\"},{\"type\":\"Replace\",\"pattern\":{\"String\":"
        "\"\\u2581\"},\"content\":\" \"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":"
        "\" \",\"start\":1,\"stop\":0}]}",
        "{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Fuse\"},{\"type\":\"Metaspace\","
        "\"replacement\":\"\\u2581\",\"prepend_scheme\":\"always\",\"split\":true}]}",
        "{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Fuse\"},{\"type\":\"Replace\","
        "\"pattern\":{\"String\":\"a\\u2581\"},\"content\":\"X\"}]}",
        "{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"ByteLevel\"},{\"type\":\"Strip\","
        "\"content\":\"a\",\"start\":1,\"stop\":0}]}",
        "{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Fuse\"},{\"type\":\"ByteLevel\"}]}",
    };
    for (size_t k = 0; k < sizeof decoders / sizeof *decoders; k++) {
        char json[4096];
        snprintf(json, sizeof json,
                 "{\"added_tokens\":[{\"id\":20,\"content\":\"<x>\",\"special\":true}],"
                 "\"decoder\":%s,\"model\":{\"type\":\"BPE\",\"vocab\":" VOCAB ",\"merges\":[]}}",
                 decoders[k]);
        t = NULL;
        CHECK(tok_load_json(&t, json, strlen(json)) == ERR_OK);
        if (!t) continue;
        const int32_t first[] = {18, 17, 1};  // "\u2581a" "\u2581" "a"
        CHECK(tok_decode(t, first, 3, false, &text, &n) == ERR_OK);
#define BAR "\xe2\x96\x81"  // U+2581
        static const char *const want[] = {
            BAR "a " BAR " a", "a a", "a a", "a a", " ", "aa", BAR "Xa", BAR "a" BAR "a",
            BAR "a" BAR "a",
        };
#undef BAR
        CHECK(strcmp(text, want[k]) == 0);
        free(text);
        uint64_t rng = 12345;
        int bad = 0;
        for (int round = 0; round < 500; round++) {
            int32_t ids[12];
            const size_t m = (size_t) (round % 12);
            for (size_t i = 0; i < m; i++) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                static const int32_t pick[] = {17, 18, 11, 1, 2, 20, 3};
                ids[i] = pick[(rng >> 32) % 7];
            }
            bad += !stream_matches(t, ids, m, round & 1);
        }
        CHECK(bad == 0);
        tok_destroy(t);
    }
}

int main(void)
{
    test_split_behaviors();
    test_digits_and_sequence();
    test_normalizers();
    test_added_tokens();
    test_bpe_and_fallback();
    test_errors();
    test_stream_property();
    test_stream_first_token_rules();
    return check_exit();
}
