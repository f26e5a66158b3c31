/*
 * test_chat_parser.c - the incremental GLM output parser (ChatParser in engine/shared/chat.h).
 *
 * Each case is a model output with the events it must produce, written as a transcript:
 * "R:" reasoning text, "C:" content text (adjacent deltas of one kind merged), "T:" a
 * tool call as name + " " + arguments JSON. Every case is then fed again split at every
 * single point and at many random sets of points (fixed seed): the transcript must not
 * change, which is the parser's streaming contract. A round-trip test feeds the assistant
 * turn of a transformers golden back through the parser and re-renders the calls it finds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <json-c/json.h>

#include "engine/shared/chat.h"
#include "tests/check.h"
#include "tests/engine/shared/source_file.h"

typedef struct Transcript {
    char *p;
    size_t n, cap;
    int last_kind;  // kind of the previous event, -1 at start: merges adjacent deltas
    int n_events;
    bool saw_empty;
} Transcript;

static void tr_put(Transcript *t, const char *s, size_t n)
{
    if (t->n + n + 1 > t->cap) {
        t->cap = (t->n + n + 1) * 2;
        t->p = realloc(t->p, t->cap);
    }
    memcpy(t->p + t->n, s, n);
    t->n += n;
    t->p[t->n] = '\0';
}

static Err on_event(void *user, const ChatEvent *ev)
{
    Transcript *t = user;
    t->n_events++;
    if (ev->kind == CHAT_EVENT_TOOL_CALL) {
        tr_put(t, "|T:", 3);
        tr_put(t, ev->name, strlen(ev->name));
        tr_put(t, " ", 1);
        tr_put(t, ev->arguments, strlen(ev->arguments));
        t->last_kind = -1;
        return ERR_OK;
    }
    if (ev->n_text == 0) t->saw_empty = true;
    if ((int) ev->kind != t->last_kind) {
        tr_put(t, ev->kind == CHAT_EVENT_REASONING ? "|R:" : "|C:", 3);
        t->last_kind = (int) ev->kind;
    }
    tr_put(t, ev->text, ev->n_text);
    return ERR_OK;
}

// Feed text cut at the given offsets (ascending, within [0, n]) and return the transcript.
static char *run(const char *text, bool in_reasoning, const json_object *tools, const size_t *cuts,
                 int n_cuts)
{
    ChatParser p;
    Transcript t = {.last_kind = -1};
    tr_put(&t, "", 0);
    CHECK(chat_parser_init(&p, in_reasoning, tools) == ERR_OK);
    const size_t n = strlen(text);
    size_t at = 0;
    for (int i = 0; i <= n_cuts; i++) {
        const size_t end = i < n_cuts ? cuts[i] : n;
        CHECK(chat_parser_feed(&p, text + at, end - at, on_event, &t) == ERR_OK);
        at = end;
    }
    CHECK(chat_parser_finish(&p, on_event, &t) == ERR_OK);
    chat_parser_free(&p);
    CHECK(!t.saw_empty);
    return t.p;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_next(void)
{
    // xorshift64*: deterministic, seeded above.
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}

static int cmp_size(const void *a, const void *b)
{
    const size_t x = *(const size_t *) a, y = *(const size_t *) b;
    return x < y ? -1 : x > y;
}

static void check_case(const char *text, bool in_reasoning, const json_object *tools,
                       const char *want)
{
    char *whole = run(text, in_reasoning, tools, NULL, 0);
    CHECK(strcmp(whole, want) == 0);
    if (strcmp(whole, want) != 0) {
        fprintf(stderr, "  output: %s\n  got:  %s\n  want: %s\n", text, whole, want);
    }
    // Property: any split gives the same transcript. Every single cut, every byte alone,
    // then random cut sets.
    const size_t n = strlen(text);
    int n_bad = 0;
    for (size_t c = 0; c <= n; c++) {
        char *got = run(text, in_reasoning, tools, &c, 1);
        if (strcmp(got, whole) != 0 && n_bad++ < 3) {
            fprintf(stderr, "  split at %zu of %s:\n  got:  %s\n  want: %s\n", c, text, got, whole);
        }
        free(got);
    }
    size_t *cuts = malloc((n + 9) * sizeof *cuts);
    for (size_t c = 0; c <= n; c++)
        cuts[c] = c;
    char *bytewise = run(text, in_reasoning, tools, cuts, (int) n + 1);
    if (strcmp(bytewise, whole) != 0 && n_bad++ < 3) {
        fprintf(stderr, "  byte by byte %s:\n  got:  %s\n  want: %s\n", text, bytewise, whole);
    }
    free(bytewise);
    for (int trial = 0; trial < 200; trial++) {
        const int k = (int) (rng_next() % 8) + 1;
        for (int i = 0; i < k; i++)
            cuts[i] = (size_t) (rng_next() % (n + 1));
        qsort(cuts, (size_t) k, sizeof *cuts, cmp_size);
        char *got = run(text, in_reasoning, tools, cuts, k);
        if (strcmp(got, whole) != 0 && n_bad++ < 3) {
            fprintf(stderr, "  random split (trial %d) of %s:\n  got:  %s\n  want: %s\n", trial,
                    text, got, whole);
        }
        free(got);
    }
    CHECK(n_bad == 0);
    free(cuts);
    free(whole);
}

static const char TOOLS[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"search\",\"parameters\":{\"type\":"
    "\"object\",\"properties\":{\"query\":{\"type\":\"string\"},\"limit\":{\"type\":\"integer\"},"
    "\"maybe\":{\"type\":[\"string\",\"null\"]}}}}}]";

static void test_cases(void)
{
    json_object *tools = json_tokener_parse(TOOLS);

    check_case("Let me think.</think>The answer is 42.", true, NULL,
               "|R:Let me think.|C:The answer is 42.");
    check_case("Hello <b>world</b>, a < b and <thin k> <tool_c", false, NULL,
               "|C:Hello <b>world</b>, a < b and <thin k> <tool_c");
    check_case("no end of reasoning </thin", true, NULL, "|R:no end of reasoning </thin");
    check_case("</think>", true, NULL, "");
    check_case("<think>r</think>c", false, NULL, "|R:r|C:c");
    check_case("\n\nplan</think>\n\nanswer\n", true, NULL, "|R:\n\nplan|C:\n\nanswer\n");

    // GLM-4.7 calls, typed without a schema: numbers, objects, bools, null become JSON.
    check_case("I'll check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
               "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>\n"
               "<tool_call>search<arg_key>query</arg_key><arg_value>{\"a\": [1, 2.50]}"
               "</arg_value><arg_key>ok</arg_key><arg_value>false</arg_value><arg_key>none"
               "</arg_key><arg_value>null</arg_value></tool_call>\n",
               false, NULL,
               "|C:I'll check.|T:get_weather {\"city\": \"Paris\", \"days\": 3}"
               "|T:search {\"query\": {\"a\": [1, 2.5]}, \"ok\": false, \"none\": null}");
    // With the tools schema a "string" parameter stays a string even when it parses.
    check_case("<tool_call>search<arg_key>query</arg_key><arg_value>{\"a\": 1}</arg_value>"
               "<arg_key>limit</arg_key><arg_value> 42 </arg_value><arg_key>maybe</arg_key>"
               "<arg_value>null</arg_value><arg_key>other</arg_key><arg_value>7</arg_value>"
               "</tool_call>",
               false, tools,
               "|T:search {\"query\": \"{\\\"a\\\": 1}\", \"limit\": 42, \"maybe\": \"null\", "
               "\"other\": 7}");
    // GLM-4.5/4.6 layout: newlines between the parts; strings keep their bytes.
    check_case("<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>true</arg_value>\n<arg_key>s"
               "</arg_key>\n<arg_value> two  words\n</arg_value>\n</tool_call>",
               false, NULL, "|T:f {\"x\": true, \"s\": \" two  words\\n\"}");
    check_case("<tool_call>f<arg_key>s</arg_key><arg_value>\xe6\x97\xa5\xe6\x9c\xac \"q\" "
               "</arg_value></tool_call>",
               false, NULL, "|T:f {\"s\": \"\xe6\x97\xa5\xe6\x9c\xac \\\"q\\\" \"}");
    check_case("<tool_call>noargs</tool_call>", false, NULL, "|T:noargs {}");
    // Whitespace after a call is dropped before another call or the end, kept before text.
    check_case("<tool_call>a</tool_call>\n\n<tool_call>b</tool_call>  \n", false, NULL,
               "|T:a {}|T:b {}");
    check_case("<tool_call>a</tool_call>\n\nDone <tool", false, NULL, "|T:a {}|C:\n\nDone <tool");
    check_case("<tool_call>a</tool_call> <tool_c", false, NULL, "|T:a {}|C: <tool_c");
    // Calls we cannot parse, and a call cut off by the end, pass through as content.
    check_case("x<tool_call>bad<arg_key>k</arg_value></tool_call>rest", false, NULL,
               "|C:x<tool_call>bad<arg_key>k</arg_value></tool_call>rest");
    check_case("<tool_call></tool_call>", false, NULL, "|C:<tool_call></tool_call>");
    check_case("<tool_call>f<arg_key></arg_key><arg_value>1</arg_value></tool_call>", false, NULL,
               "|C:<tool_call>f<arg_key></arg_key><arg_value>1</arg_value></tool_call>");
    check_case("text<tool_call>f<arg_key>a", false, NULL, "|C:text<tool_call>f<arg_key>a");
    // Reasoning, then content, then a call: the whole GLM turn.
    check_case("Need weather.</think>Checking.<tool_call>search<arg_key>query</arg_key>"
               "<arg_value>1 < 2 </arg_value></tool_call>",
               true, tools, "|R:Need weather.|C:Checking.|T:search {\"query\": \"1 < 2 \"}");
    json_object_put(tools);
}

// Held back text is only ever a possible tag: after "abc</" nothing but "abc" is out.
static void test_holdback(void)
{
    ChatParser p;
    Transcript t = {.last_kind = -1};
    tr_put(&t, "", 0);
    CHECK(chat_parser_init(&p, true, NULL) == ERR_OK);
    CHECK(chat_parser_feed(&p, "abc</", 5, on_event, &t) == ERR_OK);
    CHECK(strcmp(t.p, "|R:abc") == 0);
    CHECK(chat_parser_feed(&p, "b", 1, on_event, &t) == ERR_OK);  // "</b" is no tag
    CHECK(strcmp(t.p, "|R:abc</b") == 0);
    CHECK(chat_parser_feed(&p, "</think", 7, on_event, &t) == ERR_OK);
    CHECK(strcmp(t.p, "|R:abc</b") == 0);
    CHECK(chat_parser_feed(&p, ">x<tool_call>f", 14, on_event, &t) == ERR_OK);
    CHECK(strcmp(t.p, "|R:abc</b|C:x") == 0);
    CHECK(chat_parser_feed(&p, "</tool_call>", 12, on_event, &t) == ERR_OK);
    CHECK(strcmp(t.p, "|R:abc</b|C:x|T:f {}") == 0);
    CHECK(chat_parser_finish(&p, on_event, &t) == ERR_OK);
    chat_parser_free(&p);
    chat_parser_free(&p);  // freeing twice is allowed: the first zeroes it
    free(t.p);
    CHECK(chat_prompt_opens_reasoning("x<|assistant|><think>", 21));
    CHECK(!chat_prompt_opens_reasoning("x<|assistant|></think>", 22));
    CHECK(!chat_prompt_opens_reasoning("", 0));
}

// A callback error stops the parser and comes back unchanged.
static Err on_event_fail(void *user, const ChatEvent *ev)
{
    (void) user;
    (void) ev;
    return ERR_IO;
}

static void test_callback_error(void)
{
    ChatParser p;
    CHECK(chat_parser_init(&p, false, NULL) == ERR_OK);
    CHECK(chat_parser_feed(&p, "text", 4, on_event_fail, NULL) == ERR_IO);
    chat_parser_free(&p);
}

// ---------------------------------------------------------------------------
// Round trip: an assistant turn rendered by transformers, parsed back, re-rendered

static const json_object *golden_case(json_object *all, const char *name)
{
    const size_t n = json_object_array_length(all);
    for (size_t i = 0; i < n; i++) {
        json_object *rec = json_object_array_get_idx(all, i), *nm = NULL;
        if (json_object_object_get_ex(rec, "name", &nm) && nm
            && strcmp(json_object_get_string(nm), name) == 0) {
            return rec;
        }
    }
    return NULL;
}

typedef struct Collected {
    json_object *calls;  // OpenAI tool_calls array
    char content[4096];
} Collected;

static Err collect(void *user, const ChatEvent *ev)
{
    Collected *c = user;
    if (ev->kind == CHAT_EVENT_CONTENT) {
        strncat(c->content, ev->text, ev->n_text < 4000 ? ev->n_text : 4000);
    } else if (ev->kind == CHAT_EVENT_TOOL_CALL) {
        json_object *fn = json_object_new_object(), *tc = json_object_new_object();
        json_object_object_add(fn, "name", json_object_new_string(ev->name));
        json_object_object_add(fn, "arguments", json_object_new_string(ev->arguments));
        json_object_object_add(tc, "type", json_object_new_string("function"));
        json_object_object_add(tc, "function", fn);
        json_object_array_add(c->calls, tc);
    }
    return ERR_OK;
}

static void test_round_trip(void)
{
    FILE *f = source_fopen("tests/golden/chat/cases.jsonl");
    CHECK(f != NULL);
    if (!f) return;
    json_object *all = json_object_new_array();
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0)
        json_object_array_add(all, json_tokener_parse(line));
    free(line);
    fclose(f);

    const json_object *rec = golden_case(all, "tool_call_string_number_object");
    CHECK(rec != NULL);
    json_object *request = NULL, *expected = NULL, *tools = NULL;
    json_object_object_get_ex(rec, "request", &request);
    json_object_object_get_ex(rec, "expected", &expected);
    json_object_object_get_ex(request, "tools", &tools);
    const char *prompt = json_object_get_string(expected);
    const char *marker = "<|assistant|></think>";
    const char *turn = strstr(prompt, marker);
    CHECK(turn != NULL);
    if (!turn) goto done;
    turn += strlen(marker);

    // What the model would have generated after "<|assistant|>" with thinking off.
    Collected c = {.calls = json_object_new_array()};
    ChatParser p;
    CHECK(chat_parser_init(&p, false, tools) == ERR_OK);
    CHECK(chat_parser_feed(&p, turn, strlen(turn), collect, &c) == ERR_OK);
    CHECK(chat_parser_finish(&p, collect, &c) == ERR_OK);
    chat_parser_free(&p);
    CHECK(strcmp(c.content, "Let me search.") == 0);
    CHECK(json_object_array_length(c.calls) == 1);

    // Re-render the parsed turn: it must reproduce transformers' bytes exactly.
    json_object *req = json_object_new_object(), *msgs = json_object_new_array();
    json_object *u = json_object_new_object(), *a = json_object_new_object();
    json_object_object_add(u, "role", json_object_new_string("user"));
    json_object_object_add(u, "content", json_object_new_string("Search for GPUs"));
    json_object_object_add(a, "role", json_object_new_string("assistant"));
    json_object_object_add(a, "content", json_object_new_string(c.content));
    json_object_object_add(a, "tool_calls", c.calls);
    json_object_array_add(msgs, u);
    json_object_array_add(msgs, a);
    json_object_object_add(req, "messages", msgs);
    json_object_object_add(req, "tools", json_object_get(tools));
    json_object_object_add(req, "add_generation_prompt", json_object_new_boolean(0));
    char *again = NULL;
    size_t n_again = 0;
    ChatError err = {{0}};
    CHECK(chat_render_request(req, CHAT_TEMPLATE_GLM47, &again, &n_again, NULL, &err) == ERR_OK);
    CHECK(again && strcmp(again, prompt) == 0);
    if (again && strcmp(again, prompt) != 0) {
        fprintf(stderr, "  round trip differs:\n  got:  %s\n  want: %s\n", again, prompt);
    }
    free(again);
    json_object_put(req);
done:
    json_object_put(all);
}

int main(void)
{
    test_cases();
    test_holdback();
    test_callback_error();
    test_round_trip();
    return check_exit();
}
