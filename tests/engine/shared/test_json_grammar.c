/*
 * test_json_grammar.c - the JSON / JSON-Schema automaton (engine/shared/json_grammar.h):
 * schema errors name their keyword, documents are accepted or refused byte by byte, and
 * from random valid prefixes (random walks over the bytes the automaton allows) the
 * completion always yields a document that json-c parses and that satisfies the schema's
 * required keys, enums, lengths and item counts.
 */
#include <json-c/json.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/json_grammar.h"
#include "tests/check.h"

static JgramGrammar *compile(const char *schema)
{
    json_object *s = schema ? json_tokener_parse(schema) : NULL;
    JgramGrammar *g = NULL;
    char msg[256];
    const Err err = jgram_compile(s, &g, msg, sizeof msg);
    if (err) fprintf(stderr, "compile failed: %s\n", msg);
    json_object_put(s);
    return g;
}

static bool accepts(const JgramGrammar *g, const char *doc)
{
    JgramState st;
    jgram_start(g, &st);
    return jgram_feed_bytes(g, &st, doc, strlen(doc)) && jgram_can_end(g, &st);
}

static bool prefix_ok(const JgramGrammar *g, const char *doc)
{
    JgramState st;
    jgram_start(g, &st);
    return jgram_feed_bytes(g, &st, doc, strlen(doc));
}

static void test_errors(void)
{
    static const struct {
        const char *schema, *want;
    } cases[] = {
        {"{\"type\":\"string\",\"pattern\":\"^a\"}", "unsupported keyword 'pattern' at /"},
        {"{\"properties\":{\"x\":{\"type\":\"integer\",\"minimum\":3}}}",
         "unsupported keyword 'minimum' at /properties/x"},
        {"{\"type\":\"strin\"}", "'type' must be"},
        {"{\"$defs\":{\"n\":{\"properties\":{\"k\":{\"$ref\":\"#/$defs/n\"}}}},\"$ref\":\"#/$defs/n\"}",
         "recursive '$ref'"},
        {"{\"$ref\":\"#/$defs/missing\"}", "does not name an entry"},
        {"{\"properties\":{\"a\":{}},\"required\":[\"b\"]}", "\"b\", which is not in 'properties'"},
        {"{\"type\":\"string\",\"minLength\":5,\"maxLength\":2}", "'maxLength' is below 'minLength'"},
        {"{\"type\":\"array\",\"maxItems\":-1}", "'maxItems' must be an integer"},
        {"{\"oneOf\":[{\"type\":\"string\"}]}", "unsupported keyword 'oneOf'"},
        {"{\"anyOf\":[]}", "'anyOf' must be a non-empty array"},
        {"false", "accepts nothing"},
        {"[1]", "a schema must be an object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        json_object *s = json_tokener_parse(cases[i].schema);
        JgramGrammar *g = NULL;
        char msg[256];
        CHECK(jgram_compile(s, &g, msg, sizeof msg) == ERR_INVAL);
        CHECK(g == NULL);
        if (!strstr(msg, cases[i].want)) fprintf(stderr, "case %zu: got \"%s\"\n", i, msg);
        CHECK(strstr(msg, cases[i].want) != NULL);
        json_object_put(s);
    }
}

static void test_documents(void)
{
    JgramGrammar *obj = compile(NULL);  // json_object
    CHECK(accepts(obj, "{}"));
    CHECK(accepts(obj, "{\"a\": [1, -2.5e+3, true, null, \"x\\u00e9\\n\"], \"b\":{\"c\":{}}}"));
    CHECK(accepts(obj, "\n{\"\xc3\xa9\":0}"));
    CHECK(!prefix_ok(obj, "[1]"));           // the document must be an object
    CHECK(!prefix_ok(obj, "{\"a\":01"));     // no leading zeros
    CHECK(!prefix_ok(obj, "{\"a\":1,}"));    // no trailing comma
    CHECK(!prefix_ok(obj, "{\"a\":\"\x01"));  // no raw control characters
    CHECK(!prefix_ok(obj, "{\"a\":\"\xe0\x80"));  // an overlong UTF-8 form
    CHECK(!prefix_ok(obj, "{\"a\":\"\xed\xa0"));  // a UTF-16 surrogate in UTF-8
    CHECK(!prefix_ok(obj, "{\"a\":  1"));    // one space after ':' at most
    CHECK(!accepts(obj, "{\"a\":1} "));      // nothing after the document
    CHECK(prefix_ok(obj, "{\"a\":1"));
    CHECK(!accepts(obj, "{\"a\":1"));
    jgram_free(obj);

    JgramGrammar *g = compile(
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"minLength\":2,"
        "\"maxLength\":4},\"age\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":"
        "{\"enum\":[\"x\",\"yy\",3]},\"minItems\":1,\"maxItems\":2},\"opt\":{\"anyOf\":[{\"type\":"
        "\"null\"},{\"$ref\":\"#/$defs/p\"}]}},\"required\":[\"name\",\"age\"],\"$defs\":{\"p\":"
        "{\"type\":\"object\",\"properties\":{\"q\":{\"type\":\"boolean\"}},\"required\":[\"q\"]}}}");
    CHECK(g != NULL);
    CHECK(accepts(g, "{\"name\":\"ab\",\"age\":-3}"));
    CHECK(accepts(g, "{\"age\": 7, \"name\": \"abcd\", \"tags\": [\"yy\", 3], \"opt\": {\"q\":false}}"));
    CHECK(accepts(g, "{\"name\":\"\xc3\xa9\xc3\xa9\",\"age\":0,\"opt\":null}"));
    CHECK(!prefix_ok(g, "{\"name\":\"abcde"));        // maxLength
    CHECK(!prefix_ok(g, "{\"name\":\"a\""));          // minLength
    CHECK(!prefix_ok(g, "{\"age\":1.5"));             // an integer
    CHECK(!prefix_ok(g, "{\"agee"));                  // not a declared name
    CHECK(!prefix_ok(g, "{\"age\":1,\"age\""));       // a duplicate key
    CHECK(!prefix_ok(g, "{\"tags\":[]"));             // minItems
    CHECK(!prefix_ok(g, "{\"tags\":[3,3,"));          // maxItems
    CHECK(!prefix_ok(g, "{\"tags\":[\"z"));           // enum
    CHECK(!prefix_ok(g, "{\"opt\":{}"));              // the object alternative needs q
    CHECK(!accepts(g, "{\"name\":\"ab\"}"));           // age is required
    jgram_free(g);

    JgramGrammar *num = compile("{\"type\":\"number\"}");
    CHECK(accepts(num, "12") && accepts(num, "-0.5E-12") && accepts(num, "0"));
    CHECK(!prefix_ok(num, "1.") || !accepts(num, "1."));
    CHECK(!prefix_ok(num, "12345678901234567"));  // 16 integer digits at most
    jgram_free(num);
}

// Random valid prefixes of g (up to max_len bytes, over `trials` walks), each completed:
// the completion must be accepted and end the output; check(doc, arg) sees each finished
// output (NULL: none).
static void walk_and_complete(const JgramGrammar *g, int trials, int max_len,
                              void (*check)(const char *doc, void *arg), void *arg)
{
    uint64_t rng = 42;
    for (int trial = 0; trial < trials; trial++) {
        JgramState st, probe;
        jgram_start(g, &st);
        char doc[4096];
        int n = 0;
        for (int k = 0; k < trial % max_len; k++) {
            uint8_t ok[256];
            int n_ok = 0;
            for (int c = 1; c < 256; c++) {
                jgram_copy(&probe, &st);
                if (jgram_feed(g, &probe, (uint8_t) c)) ok[n_ok++] = (uint8_t) c;
            }
            if (n_ok == 0) break;
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            const uint8_t c = ok[rng % (uint64_t) n_ok];
            jgram_feed(g, &st, c);
            doc[n++] = (char) c;
        }
        const int m = jgram_completion(g, &st, doc + n, (int) sizeof doc - n - 1);
        CHECK(m >= 0);
        if (m < 0) continue;
        const bool fed = jgram_feed_bytes(g, &st, doc + n, (size_t) m);
        if (!fed || !jgram_can_end(g, &st))
            fprintf(stderr, "prefix [%.*s] completion [%.*s] refused\n", n, doc, m, doc + n);
        CHECK(fed && jgram_can_end(g, &st));
        doc[n + m] = 0;
        if (check) check(doc, arg);
    }
}

// A completed document parses (json-c); for schema 1 its required parts are there.
static void check_document(const char *doc, void *arg)
{
    const size_t si = *(const size_t *) arg;
    enum json_tokener_error jerr;
    json_object *v = json_tokener_parse_verbose(doc, &jerr);  // NULL also for "null"
    if (jerr != json_tokener_success) fprintf(stderr, "schema %zu: completion does not parse: [%s]\n", si, doc);
    CHECK(jerr == json_tokener_success);
    if (si == 1 && v) {
        json_object *x;
        CHECK(json_object_object_get_ex(v, "name", &x) && json_object_get_string_len(x) >= 3);
        CHECK(json_object_object_get_ex(v, "list", &x) && json_object_array_length(x) >= 2);
        CHECK(json_object_object_get_ex(v, "sub", &x) && json_object_object_get_ex(x, "z", NULL));
        CHECK(json_object_object_get_ex(v, "kind", &x));
    }
    json_object_put(v);
}

// A finished tool call's text counts when it has an argument.
static void count_args(const char *doc, void *arg)
{
    *(int *) arg += strstr(doc, "get_weather<arg_key>") != NULL;
}

// From a random valid prefix of each schema, the completion finishes a document.
static void test_completion(void)
{
    static const char *const schemas[] = {
        NULL,
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"minLength\":3},"
        "\"n\":{\"type\":\"number\"},\"list\":{\"type\":\"array\",\"items\":{\"type\":\"integer\"},"
        "\"minItems\":2},\"kind\":{\"enum\":[\"alpha\",\"beta\",null]},\"sub\":{\"type\":\"object\","
        "\"properties\":{\"z\":{\"type\":\"boolean\"}},\"required\":[\"z\"]}},\"required\":[\"name\","
        "\"list\",\"kind\",\"sub\"]}",
        "{\"anyOf\":[{\"type\":\"object\",\"properties\":{\"a\":{\"const\":1}},\"required\":[\"a\"]},"
        "{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":3},\"minItems\":1},"
        "{\"type\":[\"string\",\"null\"]}]}",
    };
    for (size_t si = 0; si < sizeof schemas / sizeof schemas[0]; si++) {
        JgramGrammar *g = compile(schemas[si]);
        CHECK(g != NULL);
        if (!g) continue;
        walk_and_complete(g, 300, 60, check_document, &si);
        jgram_free(g);
    }
}

// Completions from states the fuzzer found wrong (each fed back must finish the document):
// a key stopped inside an escape or a UTF-8 character of a declared name; a key that could
// only close as a declared name already seen (a duplicate); the thread a completion follows
// crowded out of JGRAM_MAX_THREADS by nested anyOf; schemas whose shortest values nest
// deeper than the automaton's frames (refused when compiled, with the limit named).
static void test_completion_edges(void)
{
    static const struct {
        const char *schema, *prefix;
    } cases[] = {
        {"{\"properties\":{\"a\\\"b\":{}}}", "{\"a\\"},
        {"{\"properties\":{\"\xc3\xa9\":{}}}", "{\"\xc3"},
        {"{\"properties\":{\"\\n\":{\"type\":\"null\"}},\"additionalProperties\":true}", "{\"\\"},
        {"{\"properties\":{\"a\":{}},\"additionalProperties\":true}", "{\"a\":1,\"a"},
        {"{\"properties\":{\"\":{}},\"additionalProperties\":true}", "{\"\":1,"},
        {"{\"properties\":{\"\\n\":{}},\"additionalProperties\":true}", "{\"\\n\":0,\"\\"},
        {"{\"properties\":{\"a\":{},\"b\":{}},\"additionalProperties\":true}", "{\"a\":1,\"b\":2,"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        JgramGrammar *g = compile(cases[i].schema);
        CHECK(g != NULL);
        if (!g) continue;
        JgramState st;
        jgram_start(g, &st);
        CHECK(jgram_feed_bytes(g, &st, cases[i].prefix, strlen(cases[i].prefix)));
        char comp[4096];
        const int m = jgram_completion(g, &st, comp, (int) sizeof comp);
        if (m < 0) fprintf(stderr, "case %zu: no completion\n", i);
        CHECK(m >= 0);
        if (m >= 0) {
            const bool ok = jgram_feed_bytes(g, &st, comp, (size_t) m) && jgram_can_end(g, &st);
            if (!ok) fprintf(stderr, "case %zu: completion \"%.*s\" does not finish\n", i, m, comp);
            CHECK(ok);
        }
        jgram_free(g);
    }
    // Alternatives nested into 9 ways to read a value (8 inside the first, 1 in the second):
    // a state keeps 8, so the schema is refused rather than half matched.
    json_object *s = json_tokener_parse(
        "{\"anyOf\":[{\"type\":\"array\",\"minItems\":1,\"items\":{\"anyOf\":["
        "{\"type\":\"array\",\"minItems\":1},{\"type\":\"array\",\"minItems\":1},"
        "{\"type\":\"array\",\"minItems\":1},{\"type\":\"array\",\"minItems\":1},"
        "{\"type\":\"array\",\"minItems\":1},{\"type\":\"array\",\"minItems\":1},"
        "{\"type\":\"array\",\"minItems\":1},{\"type\":\"array\",\"minItems\":1}]}},"
        "{\"type\":\"array\",\"minItems\":1,\"items\":{\"type\":\"array\"}}]}");
    JgramGrammar *g = NULL;
    char msg[256] = "";
    CHECK(jgram_compile(s, &g, msg, sizeof msg) == ERR_INVAL && g == NULL);
    CHECK(strstr(msg, "more than 8 ways") != NULL);
    json_object_put(s);
    // Shortest values nested 24 arrays deep need more frames than a state has: refused.
    char deep[2048];
    size_t len = 0;
    for (int d = 0; d < 23; d++)
        len += (size_t) snprintf(deep + len, sizeof deep - len,
                                 "{\"type\":\"array\",\"minItems\":1,\"items\":");
    len += (size_t) snprintf(deep + len, sizeof deep - len, "{\"type\":\"array\"}");
    for (int d = 0; d < 23; d++)
        len += (size_t) snprintf(deep + len, sizeof deep - len, "}");
    s = json_tokener_parse(deep);
    g = NULL;
    CHECK(jgram_compile(s, &g, msg, sizeof msg) == ERR_INVAL && g == NULL);
    CHECK(strstr(msg, "nest deeper than") != NULL);
    json_object_put(s);
    // One level less compiles, and its shortest document completes from the start.
    const char *inner = strchr(deep + 1, '{');
    char shallower[2048];
    snprintf(shallower, sizeof shallower, "%.*s", (int) (strlen(inner) - 1), inner);
    g = compile(shallower);
    CHECK(g != NULL);
    if (g) {
        JgramState st;
        jgram_start(g, &st);
        char comp[4096];
        const int m = jgram_completion(g, &st, comp, (int) sizeof comp);
        CHECK(m == 46 && jgram_feed_bytes(g, &st, comp, (size_t) m) && jgram_can_end(g, &st));
        jgram_free(g);
    }
}

// $defs that refer to one another many times compile each once (the 3.4 KB schema below
// needed 4,032 copies of a 65,000-letter string before), and a total bound on the shortest
// texts refuses what would still be too large; a response_format's string enum may hold '<'
// (only a tool's raw arguments may not).
static void test_schema_bounds(void)
{
    char schema[8192];
    int n = snprintf(schema, sizeof schema,
                     "{\"$defs\":{\"a\":{\"type\":\"string\",\"minLength\":65000},\"b\":{\"properties\":{");
    for (int i = 0; i < 63; i++)
        n += snprintf(schema + n, sizeof schema - (size_t) n, "%s\"%d\":{\"$ref\":\"#/$defs/a\"}",
                      i ? "," : "", i);
    n += snprintf(schema + n, sizeof schema - (size_t) n, "}}},\"properties\":{");
    for (int i = 0; i < 64; i++)
        n += snprintf(schema + n, sizeof schema - (size_t) n, "%s\"%d\":{\"$ref\":\"#/$defs/b\"}",
                      i ? "," : "", i);
    snprintf(schema + n, sizeof schema - (size_t) n, "}}");
    JgramGrammar *g = compile(schema);
    CHECK(g != NULL);
    jgram_free(g);
    // 65 distinct strings of about 65,000 letters: more than 4 MiB of shortest texts.
    n = snprintf(schema, sizeof schema, "{\"properties\":{");
    for (int i = 0; i < 64; i++)
        n += snprintf(schema + n, sizeof schema - (size_t) n, "%s\"%d\":{\"minLength\":%d}",
                      i ? "," : "", i, 65000 - i);
    snprintf(schema + n, sizeof schema - (size_t) n,
             "},\"additionalProperties\":{\"minLength\":64000}}");
    json_object *s = json_tokener_parse(schema);
    char msg[256] = "";
    g = NULL;
    CHECK(jgram_compile(s, &g, msg, sizeof msg) == ERR_INVAL && g == NULL);
    CHECK(strstr(msg, "exceed 4 MiB") != NULL);
    json_object_put(s);
    g = compile("{\"properties\":{\"a\":{\"type\":\"string\",\"enum\":[\"<\",1]}}}");
    CHECK(g != NULL && accepts(g, "{\"a\":\"<\"}"));
    jgram_free(g);
}

// Tool calls in GLM's format: names, raw and JSON arguments, required ones, enums.
static void test_tool_calls(void)
{
    json_object *tools = json_tokener_parse(
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":"
        "\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":20},\"unit\":"
        "{\"type\":\"string\",\"enum\":[\"celsius\",\"fahrenheit\"]},\"days\":{\"type\":\"integer\"},"
        "\"opts\":{\"type\":\"object\",\"properties\":{\"hourly\":{\"type\":\"boolean\"}},"
        "\"required\":[\"hourly\"]}},\"required\":[\"city\",\"days\"]}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"get_time\",\"parameters\":{\"type\":"
        "\"object\",\"properties\":{\"tz\":{\"type\":\"string\"}}}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"get\"}}]");
    CHECK(tools != NULL);
    char msg[200];
    JgramGrammar *any = NULL, *named = NULL, *bad = NULL;
    CHECK(jgram_compile_tools(tools, NULL, &any, msg, sizeof msg) == ERR_OK);
    CHECK(jgram_compile_tools(tools, "get_time", &named, msg, sizeof msg) == ERR_OK);
    CHECK(jgram_compile_tools(tools, "nope", &bad, msg, sizeof msg) == ERR_INVAL && !bad);
    if (any && named) {
        CHECK(jgram_wants_markup(any));
        CHECK(accepts(any, "get_weather<arg_key>city</arg_key><arg_value>Paris, \"FR\"</arg_value>"
                           "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"));
        CHECK(accepts(any, "get_weather<arg_key>days</arg_key><arg_value>-1</arg_value><arg_key>unit"
                           "</arg_key><arg_value>celsius</arg_value><arg_key>opts</arg_key><arg_value>"
                           "{\"hourly\": true}</arg_value><arg_key>city</arg_key><arg_value></arg_value>"
                           "</tool_call>"));
        CHECK(accepts(any, "get</tool_call>"));
        CHECK(accepts(any, "get_time</tool_call>"));
        CHECK(!prefix_ok(any, "get_weather</tool_call>"));  // city and days are required
        CHECK(!prefix_ok(any, "get_w</"));                  // not a whole name
        CHECK(!prefix_ok(any, "other"));
        CHECK(!prefix_ok(any, "get_weather<arg_key>unit</arg_key><arg_value>kelvin"));
        CHECK(!prefix_ok(any, "get_weather<arg_key>days</arg_key><arg_value>\"3\""));  // JSON integer
        CHECK(!prefix_ok(any, "get_weather<arg_key>city</arg_key><arg_value>a</arg_value><arg_key>city<"));
        CHECK(!prefix_ok(any, "get_weather<arg_key>zip<"));
        CHECK(!prefix_ok(any, "get_weather<arg_key>city</arg_key><arg_value>123456789012345678901"));
        CHECK(!accepts(any, "get</tool_call>x"));
        CHECK(accepts(named, "</tool_call>"));
        CHECK(accepts(named, "<arg_key>tz</arg_key><arg_value>Europe/Paris</arg_value></tool_call>"));
        CHECK(!prefix_ok(named, "get_time"));
        int with_args = 0;
        walk_and_complete(any, 400, 80, count_args, &with_args);
        CHECK(with_args > 0);
        walk_and_complete(named, 200, 80, NULL, NULL);
    }
    // Parameter schemas are checked like response_format's, the error naming the tool.
    json_object *t2 = json_tokener_parse(
        "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"x\":{\"type\":\"string\",\"format\":\"date\"}}}}}]");
    CHECK(jgram_compile_tools(t2, NULL, &bad, msg, sizeof msg) == ERR_INVAL);
    CHECK(strstr(msg, "unsupported keyword 'format' at /tools/0/function/parameters/properties/x") != NULL);
    json_object_put(t2);
    // Two tools of one name: which one a call means is unknown.
    t2 = json_tokener_parse("[{\"type\":\"function\",\"function\":{\"name\":\"g\"}},"
                            "{\"type\":\"function\",\"function\":{\"name\":\"g\"}}]");
    CHECK(jgram_compile_tools(t2, NULL, &bad, msg, sizeof msg) == ERR_INVAL);
    CHECK(strstr(msg, "two tools are named \"g\"") != NULL);
    json_object_put(t2);
    jgram_free(any);
    jgram_free(named);
    json_object_put(tools);
}

int main(void)
{
    test_errors();
    test_documents();
    test_completion();
    test_completion_edges();
    test_schema_bounds();
    test_tool_calls();
    return check_exit();
}
