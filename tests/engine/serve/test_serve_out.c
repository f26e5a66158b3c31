/*
 * test_serve_out.c - one served job's output (engine/serve/serve_out.h) on a small character
 * tokenizer whose chat markup tokens are special: stop strings with hold-back, the forced
 * tool-call opening (thinking off and on), its state restored by a replay, markup
 * reaching the parser, logprobs entries, and request errors.
 */
#include <json-c/json.h>
#include <string.h>

#include "engine/serve/serve_out.h"
#include "tests/check.h"
#include "tests/engine/shared/tok_json.h"

// a..z = 0..25, ' ' = 26; markup 40.. (special).
static Tokenizer *make_tok(void)
{
    char vocab[1024];
    size_t n = 0;
    n += (size_t) snprintf(vocab + n, sizeof vocab - n, "{");
    for (int c = 0; c < 26; c++) n += (size_t) snprintf(vocab + n, sizeof vocab - n, "\"%c\":%d,", 'a' + c, c);
    snprintf(vocab + n, sizeof vocab - n, "\" \":26,\"<unk>\":27,\"<\":28,\"/\":29,\">\":30}");
    static const char *const markup[] = {"<tool_call>", "</tool_call>", "</think>", "<think>",
                                         "<arg_key>",   "</arg_key>",   "<arg_value>", "</arg_value>"};
    char added[1024];
    n = (size_t) snprintf(added, sizeof added, "[");
    for (int i = 0; i < 8; i++)
        n += (size_t) snprintf(added + n, sizeof added - n,
                               "%s{\"id\":%d,\"content\":\"%s\",\"special\":true,\"normalized\":false}",
                               i ? "," : "", 40 + i, markup[i]);
    snprintf(added + n, sizeof added - n, "]");
    char json[4096];
    snprintf(json, sizeof json,
             "{\"version\":\"1.0\",\"added_tokens\":%s,\"model\":{\"type\":\"BPE\",\"vocab\":%s,"
             "\"merges\":[],\"ignore_merges\":true,\"unk_token\":\"<unk>\"},\"decoder\":{\"type\":\"Fuse\"}}",
             added, vocab);
    Tokenizer *tok = NULL;
    CHECK(tok_load_json(&tok, json, strlen(json)) == ERR_OK);
    return tok;
}

static int32_t id_of(char c)
{
    return c == ' ' ? 26 : c == '<' ? 28 : c == '/' ? 29 : c == '>' ? 30 : c - 'a';
}

// Concatenated text of one kind over what the step holds; clears the step.
static void take(ServeOut *o, JobqChunkKind kind, char *buf, size_t cap)
{
    int n = 0;
    const JobqChunk *c = serve_out_chunks(o, &n);
    CHECK(c != NULL);
    for (int i = 0; c && i < n; i++)
        if (c[i].kind == kind) strncat(buf, c[i].text, cap - strlen(buf) - 1);
    serve_out_clear_step(o);
}

static void test_stop_hold_back(const Tokenizer *tok)
{
    JobqJob job = {.kind = "completion", .request_json = "{\"stop\":[\"lo w\"],\"temperature\":0}"};
    ServeOut o;
    const char *msg;
    CHECK(serve_out_init(&o, tok, &job, 1, &msg) == ERR_OK);
    CHECK(o.n_top_logprobs == -1 && o.sampling.temperature == 0.0f && o.sampling.seed == 1);
    char out[64] = "";
    const char *text = "hello world";
    for (const char *p = text; *p && !o.is_stopped; p++) {
        CHECK(serve_out_token(&o, id_of(*p), 0, NULL, NULL, 0) == ERR_OK);
        char step[64] = "";
        take(&o, JOBQ_CHUNK_CONTENT, step, sizeof step);
        CHECK(strstr(step, "lo") == NULL);  // held back until decided
        strcat(out, step);
    }
    CHECK(o.is_stopped);
    CHECK(!strcmp(out, "hel"));
    serve_out_free(&o);

    // A prefix that does not become the stop string is released at the end.
    ServeOut o2;
    CHECK(serve_out_init(&o2, tok, &job, 1, &msg) == ERR_OK);
    for (const char *p = "hello"; *p; p++) serve_out_token(&o2, id_of(*p), 0, NULL, NULL, 0);
    char all[64] = "";
    take(&o2, JOBQ_CHUNK_CONTENT, all, sizeof all);
    CHECK(!strcmp(all, "hel"));
    CHECK(serve_out_end(&o2) == ERR_OK);
    take(&o2, JOBQ_CHUNK_CONTENT, all, sizeof all);
    CHECK(!strcmp(all, "hello"));
    serve_out_free(&o2);
}

#define TOOLS "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]"

static void test_forced_tool_call(const Tokenizer *tok)
{
    JobqJob job = {.kind = "chat",
                   .request_json = "{" TOOLS ",\"tool_choice\":\"function\",\"tool_choice_name\":\"f\"}"};
    ServeOut o;
    const char *msg;
    CHECK(serve_out_init(&o, tok, &job, 1, &msg) == ERR_OK);
    int n = 0;
    const int32_t *ids = serve_out_force(&o, &n);
    CHECK(ids && n == 2 && ids[0] == 40 && ids[1] == id_of('f'));
    CHECK(serve_out_force(&o, &n) == NULL);  // handed over once
    // The scheduler outputs them; the model closes the call on its own here.
    const int32_t out[] = {40, id_of('f'), 41};
    for (int i = 0; i < 3; i++) CHECK(serve_out_token(&o, out[i], 0, NULL, NULL, 0) == ERR_OK);
    char tool[128] = "";
    take(&o, JOBQ_CHUNK_TOOL, tool, sizeof tool);
    CHECK(!strcmp(tool, "{\"name\":\"f\",\"arguments\":\"{}\"}"));
    serve_out_free(&o);

    // Cut off inside the forced call: the end closes it.
    ServeOut o2;
    CHECK(serve_out_init(&o2, tok, &job, 1, &msg) == ERR_OK);
    serve_out_force(&o2, &n);
    serve_out_token(&o2, 40, 0, NULL, NULL, 0);
    serve_out_token(&o2, id_of('f'), 0, NULL, NULL, 0);
    CHECK(serve_out_end(&o2) == ERR_OK);
    tool[0] = '\0';
    take(&o2, JOBQ_CHUNK_TOOL, tool, sizeof tool);
    CHECK(!strcmp(tool, "{\"name\":\"f\",\"arguments\":\"{}\"}"));
    serve_out_free(&o2);

    // A resumed job whose committed output holds the first forced id: the rest is forced.
    ServeOut o3;
    CHECK(serve_out_init(&o3, tok, &job, 1, &msg) == ERR_OK);
    const int32_t committed[] = {40};
    CHECK(serve_out_replay(&o3, committed, 1) == ERR_OK);
    ids = serve_out_force(&o3, &n);
    CHECK(ids && n == 1 && ids[0] == id_of('f'));
    int n_chunks = 0;
    serve_out_chunks(&o3, &n_chunks);
    CHECK(n_chunks == 0);  // a replay emits nothing
    serve_out_free(&o3);

    // "auto" forces nothing.
    JobqJob automatic = {.kind = "chat", .request_json = "{" TOOLS ",\"tool_choice\":\"auto\"}"};
    ServeOut o4;
    CHECK(serve_out_init(&o4, tok, &automatic, 1, &msg) == ERR_OK);
    CHECK(serve_out_force(&o4, &n) == NULL && n == 0);
    serve_out_free(&o4);
}

static void test_forced_after_thinking(const Tokenizer *tok)
{
    JobqJob job = {.kind = "chat",
                   .request_json = "{" TOOLS ",\"tool_choice\":\"required\",\"in_reasoning\":true}"};
    ServeOut o;
    const char *msg;
    int n = 0;
    CHECK(serve_out_init(&o, tok, &job, 1, &msg) == ERR_OK);
    CHECK(serve_out_force(&o, &n) == NULL);  // not while reasoning
    serve_out_token(&o, id_of('h'), 0, NULL, NULL, 0);
    serve_out_token(&o, id_of('m'), 0, NULL, NULL, 0);
    CHECK(serve_out_force(&o, &n) == NULL);
    serve_out_token(&o, 42, 0, NULL, NULL, 0);  // "</think>", a special id
    const int32_t *ids = serve_out_force(&o, &n);
    CHECK(ids && n == 1 && ids[0] == 40);  // "required": the opening alone
    char reasoning[64] = "";
    take(&o, JOBQ_CHUNK_REASONING, reasoning, sizeof reasoning);
    CHECK(!strcmp(reasoning, "hm"));
    serve_out_free(&o);

    // "</think>" written as plain text, one character per token: found across pieces.
    CHECK(serve_out_init(&o, tok, &job, 1, &msg) == ERR_OK);
    for (const char *p = "ok</think"; *p; p++) {
        serve_out_token(&o, id_of(*p), 0, NULL, NULL, 0);
        CHECK(serve_out_force(&o, &n) == NULL);
    }
    serve_out_token(&o, id_of('>'), 0, NULL, NULL, 0);
    ids = serve_out_force(&o, &n);
    CHECK(ids && n == 1 && ids[0] == 40);
    reasoning[0] = '\0';
    take(&o, JOBQ_CHUNK_REASONING, reasoning, sizeof reasoning);
    CHECK(!strcmp(reasoning, "ok"));
    serve_out_free(&o);
}

static void test_logprobs(const Tokenizer *tok)
{
    JobqJob job = {.kind = "completion", .request_json = "{\"logprobs\":true,\"top_logprobs\":2}"};
    ServeOut o;
    const char *msg;
    CHECK(serve_out_init(&o, tok, &job, 1, &msg) == ERR_OK);
    CHECK(o.n_top_logprobs == 2);
    const int32_t top[3] = {id_of('a'), id_of('b'), id_of('c')};
    const float lp[3] = {-0.25f, -1.5f, -3.0f};
    serve_out_token(&o, id_of('b'), -1.5f, top, lp, 3);
    serve_out_token(&o, id_of('a'), -0.25f, top, lp, 3);
    int n = 0;
    const JobqChunk *c = serve_out_chunks(&o, &n);
    CHECK(c && n == 1 && c[0].n_tokens == 2 && c[0].token_ids[0] == id_of('b'));
    CHECK(!strcmp(c[0].text, "ba"));
    json_object *arr = c && c[0].logprobs_json ? json_tokener_parse(c[0].logprobs_json) : NULL;
    CHECK(arr && json_object_array_length(arr) == 2);
    json_object *e0 = json_object_array_get_idx(arr, 0), *v, *alts;
    CHECK(json_object_object_get_ex(e0, "token", &v) && !strcmp(json_object_get_string(v), "b"));
    CHECK(json_object_object_get_ex(e0, "logprob", &v) && json_object_get_double(v) == -1.5);
    CHECK(json_object_object_get_ex(e0, "top_logprobs", &alts) && json_object_array_length(alts) == 2);
    json_object_put(arr);
    serve_out_clear_step(&o);
    c = serve_out_chunks(&o, &n);
    CHECK(c && n == 0);
    serve_out_free(&o);
}

// With a byte-level tokenizer a token may be part of a character: its entry's bytes are the
// raw bytes (which the client joins with the next token's), its text U+FFFD.
static void test_logprobs_partial_char(void)
{
    Tokenizer *tok = tok_json_bytelevel_tokenizer("[]");
    CHECK(tok != NULL);
    if (!tok) return;
    JobqJob job = {.kind = "completion", .request_json = "{\"logprobs\":true}"};
    ServeOut o;
    const char *msg;
    CHECK(serve_out_init(&o, tok, &job, 1, &msg) == ERR_OK);
    // "é" is C3 A9: the byte tokens 0xC3 and 0xA9 (ids = byte values in this vocabulary).
    serve_out_token(&o, 0xC3, -0.5f, NULL, NULL, 0);
    serve_out_token(&o, 0xA9, -0.25f, NULL, NULL, 0);
    int n = 0;
    const JobqChunk *c = serve_out_chunks(&o, &n);
    CHECK(c && n == 1 && !strcmp(c[0].text, "\xc3\xa9"));
    json_object *arr = c && c[0].logprobs_json ? json_tokener_parse(c[0].logprobs_json) : NULL;
    CHECK(arr && json_object_array_length(arr) == 2);
    for (int i = 0; arr && i < 2; i++) {
        json_object *e = json_object_array_get_idx(arr, (size_t) i), *v, *b;
        CHECK(json_object_object_get_ex(e, "token", &v)
              && !strcmp(json_object_get_string(v), "\xef\xbf\xbd"));
        CHECK(json_object_object_get_ex(e, "bytes", &b) && json_object_array_length(b) == 1
              && json_object_get_int(json_object_array_get_idx(b, 0)) == (i ? 0xA9 : 0xC3));
    }
    json_object_put(arr);
    serve_out_free(&o);
    tok_destroy(tok);
}

static void test_bad_request(const Tokenizer *tok)
{
    // A forced opening longer than the scheduler takes is refused with a client message.
    char name[200];
    memset(name, 'x', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    char req[512];
    snprintf(req, sizeof req, "{" TOOLS ",\"tool_choice\":\"function\",\"tool_choice_name\":\"%s\"}", name);
    JobqJob job = {.kind = "chat", .request_json = req};
    ServeOut o;
    const char *msg = NULL;
    CHECK(serve_out_init(&o, tok, &job, 1, &msg) == ERR_INVAL);
    CHECK(msg && strstr(msg, "tool call"));
    serve_out_free(&o);  // safe after a failed init
}

// A named tool call constrained after its forced opening: its markup arrives as special
// tokens (ids 44..47, 41), the argument follows the tool's schema (an enum), the call ends
// when its required argument is there, then only end-of-sequence (id 27 here) is left.
static bool allowed(const uint32_t *m, int32_t id) { return m && (m[id >> 5] >> (id & 31) & 1); }

static void test_constrained_tool_call(const Tokenizer *tok)
{
    const int eos = 27;
    ConstrainVocab *cv = NULL;
    CHECK(constrain_vocab_create(tok, 64, &eos, 1, &cv) == ERR_OK);
    JobqJob job = {.kind = "chat",
                   .request_json = "{\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\","
                                   "\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":"
                                   "\"string\",\"enum\":[\"xy\",\"z\"]}},\"required\":[\"a\"]}}}],"
                                   "\"tool_choice\":\"function\",\"tool_choice_name\":\"f\"}"};
    ServeOut o;
    const char *msg;
    CHECK(serve_out_init(&o, tok, &job, 1, &msg) == ERR_OK);
    CHECK(o.grammar != NULL);
    CHECK(serve_out_constrain(&o, cv) == ERR_OK);
    int n = 0;
    const int32_t *ids = serve_out_force(&o, &n);
    CHECK(ids && n == 2);
    for (int i = 0; i < n; i++) {
        CHECK(serve_out_mask(&o, 50) == NULL);  // the opening is forced, not masked
        CHECK(serve_out_token(&o, ids[i], 0, NULL, NULL, 0) == ERR_OK);
    }
    const int32_t want[] = {44, id_of('a'), 45, 46, id_of('z'), 47, 41};
    for (int i = 0; i < 7; i++) {
        const uint32_t *m = serve_out_mask(&o, 50);
        CHECK(allowed(m, want[i]));
        if (i == 0) CHECK(!allowed(m, 41) && !allowed(m, id_of('a')) && !allowed(m, eos));  // a is required
        if (i == 4) CHECK(allowed(m, id_of('x')) && !allowed(m, id_of('y')) && !allowed(m, 47));
        if (i == 6) CHECK(!allowed(m, 44));  // no argument left to give
        CHECK(serve_out_token(&o, want[i], 0, NULL, NULL, 0) == ERR_OK);
    }
    const uint32_t *m = serve_out_mask(&o, 50);
    CHECK(allowed(m, eos));
    for (int32_t id = 0; id < 64; id++) CHECK(id == eos || !allowed(m, id));
    CHECK(serve_out_end(&o) == ERR_OK);
    char tool[128] = "";
    take(&o, JOBQ_CHUNK_TOOL, tool, sizeof tool);
    CHECK(!strcmp(tool, "{\"name\":\"f\",\"arguments\":\"{\\\"a\\\": \\\"z\\\"}\"}"));
    CHECK(!o.is_con_broken);
    serve_out_free(&o);
    constrain_vocab_destroy(cv);
}

int main(void)
{
    Tokenizer *tok = make_tok();
    if (tok) {
        test_stop_hold_back(tok);
        test_forced_tool_call(tok);
        test_forced_after_thinking(tok);
        test_logprobs(tok);
        test_logprobs_partial_char();
        test_bad_request(tok);
        test_constrained_tool_call(tok);
    }
    tok_destroy(tok);
    return check_exit();
}
