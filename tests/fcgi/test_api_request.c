/*
 * test_api_request.c - request body decoding: accepted requests and their defaults, and
 * each class of bad input answered with 400 (or 413) naming the field.
 */
#include <stdlib.h>
#include <string.h>

#include "fcgi/api_request.h"
#include "tests/check.h"

static Err parse(ApiRequest *r, ApiKind kind, const char *body, ApiError *e)
{
    return api_request_parse(r, kind, body, strlen(body), e);
}

// Expect a rejection with status 400 naming param ("" for the body as a whole).
static void expect_bad(ApiKind kind, const char *body, const char *param)
{
    ApiRequest r;
    ApiError e;
    const Err err = parse(&r, kind, body, &e);
    CHECK(err == ERR_FORMAT || err == ERR_INVAL);
    CHECK(e.status == 400);
    CHECK(strcmp(e.type, "invalid_request_error") == 0);
    CHECK(e.message[0] != '\0');
    if (strcmp(e.param, param) != 0)
        fprintf(stderr, "body %.60s: param \"%s\", want \"%s\" (%s)\n", body, e.param, param, e.message);
    CHECK(strcmp(e.param, param) == 0);
    CHECK(r.root == NULL);  // failure leaves zero
}

static void test_valid_chat(void)
{
    ApiRequest r;
    ApiError e;
    const char *body =
        "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
        "{\"role\":\"user\",\"content\":\"h\\u00e9llo\"}],\"stream\":true,"
        "\"stream_options\":{\"include_usage\":true},\"max_completion_tokens\":64,"
        "\"temperature\":0.5,\"top_p\":0.9,\"top_k\":40,\"min_p\":0.05,\"seed\":-3,"
        "\"presence_penalty\":-2,\"frequency_penalty\":1.5,\"repetition_penalty\":1.1,"
        "\"stop\":[\"\\n\\n\",\"END\"],\"logprobs\":true,\"top_logprobs\":5,"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"unknown_field\":{}}  \n";
    CHECK(parse(&r, API_KIND_CHAT, body, &e) == ERR_OK);
    CHECK(strcmp(r.model, "m") == 0);
    CHECK(json_object_array_length(r.messages) == 2);
    CHECK(r.tools != NULL);
    CHECK(r.stream && r.include_usage);
    CHECK(r.max_tokens == 64);
    CHECK_NEAR(r.temperature, 0.5, 0);
    CHECK_NEAR(r.top_p, 0.9, 0);
    CHECK(r.top_k == 40);
    CHECK_NEAR(r.min_p, 0.05, 0);
    CHECK(r.has_seed && r.seed == -3);
    CHECK_NEAR(r.presence_penalty, -2, 0);
    CHECK_NEAR(r.repetition_penalty, 1.1, 1e-12);
    CHECK(r.n_stop == 2 && strcmp(r.stop[0], "\n\n") == 0 && strcmp(r.stop[1], "END") == 0);
    CHECK(r.logprobs && r.top_logprobs == 5);
    CHECK(api_request_check(&r));

    json_object *p = api_request_params(&r), *v;
    CHECK(p != NULL);
    CHECK(json_object_object_get_ex(p, "stop", &v) && json_object_array_length(v) == 2);
    CHECK(json_object_object_get_ex(p, "seed", &v) && json_object_get_int64(v) == -3);
    CHECK(json_object_object_get_ex(p, "top_k", &v) && json_object_get_int(v) == 40);
    CHECK(json_object_object_get_ex(p, "tools", &v) && json_object_array_length(v) == 1);
    json_object_put(p);
    api_request_free(&r);
    CHECK(r.root == NULL);
}

static void test_defaults_and_completion(void)
{
    ApiRequest r;
    ApiError e;
    CHECK(parse(&r, API_KIND_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", &e) == ERR_OK);
    CHECK(!r.stream && !r.include_usage && r.max_tokens == 0 && !r.has_seed && r.n_stop == 0);
    CHECK_NEAR(r.temperature, 1, 0);
    CHECK_NEAR(r.top_p, 1, 0);
    CHECK_NEAR(r.repetition_penalty, 1, 0);
    CHECK(r.tools == NULL);
    api_request_free(&r);

    CHECK(parse(&r, API_KIND_COMPLETION, "{\"model\":\"m\",\"prompt\":\"abc\",\"stop\":\"x\",\"max_tokens\":3}", &e) == ERR_OK);
    CHECK(r.prompt && strcmp(r.prompt, "abc") == 0 && r.n_prompt == 3);
    CHECK(r.n_stop == 1 && r.max_tokens == 3);
    CHECK(api_request_check(&r));
    api_request_free(&r);
    CHECK(parse(&r, API_KIND_COMPLETION, "{\"model\":\"m\",\"prompt\":[\"one\"]}", &e) == ERR_OK);
    CHECK(r.n_prompt == 3);
    api_request_free(&r);
    api_request_free(NULL);
}

static void test_bad_inputs(void)
{
    const char *msg = ",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]";
    char buf[512];
    // Not JSON, not an object, bad encodings.
    static const char *const not_json[] = {
        "",
        "{\"model\":",
        "[1]",
        "{\"model\":\"m\"} x",
        "{\"model\":\"m\",}",
        "{\"model\":\"\xc3\x28\"}",      // invalid UTF-8
        "{\"model\":\"\xe0\x80\xaf\"}",  // overlong
        "{\"model\":\"a\\u0000b\"}",     // U+0000
        // Unpaired surrogate escapes (json-c would turn them into U+FFFD; found by
        // tests/reliability): a lone high, a lone low, a high followed by a non-low escape
        // or at the end, a reversed pair, one in a key.
        "{\"model\":\"\\ud800\"}",
        "{\"model\":\"\\uDC00x\"}",
        "{\"model\":\"a\\ud83d\\u0041\"}",
        "{\"model\":\"a\\ud83d\\n\"}",
        "{\"model\":\"\\ude00\\ud83d\"}",
        "{\"\\ud800\":1,\"model\":\"m\"}",
        "{\"model\":\"m\",\"temperature\":NaN}",
        "{\"model\":\"m\",\"temperature\":Infinity}",
    };
    for (size_t i = 0; i < sizeof not_json / sizeof *not_json; i++)
        expect_bad(API_KIND_CHAT, not_json[i], "");
    // Too deep.
    char deep[300] = "";
    for (int i = 0; i < 100; i++) strcat(deep, "[");
    for (int i = 0; i < 100; i++) strcat(deep, "]");
    snprintf(buf, sizeof buf, "{\"model\":\"m\",\"x\":%s}", deep);
    expect_bad(API_KIND_CHAT, buf, "");
    // Fields.
    static const struct {
        ApiKind kind;
        const char *json, *param;
    } fields[] = {
        {API_KIND_CHAT, "{\"messages\":[{\"role\":\"user\"}]}", "model"},
        {API_KIND_CHAT, "{\"model\":7}", "model"},
        {API_KIND_CHAT, "{\"model\":\"m\"}", "messages"},
        {API_KIND_CHAT, "{\"model\":\"m\",\"messages\":[]}", "messages"},
        {API_KIND_CHAT, "{\"model\":\"m\",\"messages\":[{\"content\":\"x\"}]}", "messages[0]"},
        {API_KIND_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\"},3]}", "messages[1]"},
        {API_KIND_COMPLETION, "{\"model\":\"m\"}", "prompt"},
        {API_KIND_COMPLETION, "{\"model\":\"m\",\"prompt\":[1,2]}", "prompt"},
    };
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++)
        expect_bad(fields[i].kind, fields[i].json, fields[i].param);
    struct { const char *field, *param; } cases[] = {
        {"\"temperature\":2.5", "temperature"}, {"\"temperature\":\"hot\"", "temperature"},
        {"\"top_p\":0", "top_p"}, {"\"top_p\":1.5", "top_p"}, {"\"top_k\":-2", "top_k"},
        {"\"top_k\":1.5", "top_k"}, {"\"min_p\":2", "min_p"},
        {"\"presence_penalty\":3", "presence_penalty"},
        {"\"frequency_penalty\":-3", "frequency_penalty"},
        {"\"repetition_penalty\":0", "repetition_penalty"},
        {"\"max_tokens\":0", "max_tokens"}, {"\"max_tokens\":1e10", "max_tokens"},
        {"\"max_completion_tokens\":-1", "max_completion_tokens"}, {"\"n\":2", "n"},
        {"\"stream\":\"yes\"", "stream"}, {"\"stream_options\":1", "stream_options"},
        {"\"stream_options\":{\"include_usage\":1}", "stream_options.include_usage"},
        {"\"stop\":\"\"", "stop"}, {"\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]", "stop"},
        {"\"stop\":[\"a\",1]", "stop[1]"}, {"\"stop\":{}", "stop"}, {"\"seed\":\"s\"", "seed"},
        {"\"logprobs\":1", "logprobs"}, {"\"top_logprobs\":21", "top_logprobs"},
        {"\"tools\":{}", "tools"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(buf, sizeof buf, "{\"model\":\"m\"%s,%s}", msg, cases[i].field);
        expect_bad(API_KIND_CHAT, buf, cases[i].param);
    }
    // null means absent.
    ApiRequest r;
    ApiError e;
    // A proper pair, an escaped backslash before "u" and a literal U+FFFD all pass.
    CHECK(parse(&r, API_KIND_CHAT,
                "{\"model\":\"m\\ud83d\\ude00 \\\\ud800 \\ufffd\",\"messages\":[{\"role\":\"user\","
                "\"content\":\"\\\"\\ud800\\udc00\"}]}",
                &e) == ERR_OK);
    CHECK(strcmp(r.model, "m\xf0\x9f\x98\x80 \\ud800 \xef\xbf\xbd") == 0);
    api_request_free(&r);
    snprintf(buf, sizeof buf, "{\"model\":\"m\"%s,\"temperature\":null,\"stop\":null,\"tools\":null}", msg);
    CHECK(parse(&r, API_KIND_CHAT, buf, &e) == ERR_OK);
    CHECK_NEAR(r.temperature, 1, 0);
    api_request_free(&r);
}

// logprobs (chat: bool + top_logprobs; completions: an integer) and tool_choice.
static void test_logprobs_and_tool_choice(void)
{
    const char *msg = "\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]";
    const char *tools = ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}},"
                        "{\"type\":\"function\",\"function\":{\"name\":\"g\"}}]";
    char buf[512];
    ApiRequest r;
    ApiError e;
    snprintf(buf, sizeof buf, "{%s,\"logprobs\":true}", msg);
    CHECK(parse(&r, API_KIND_CHAT, buf, &e) == ERR_OK);
    CHECK(r.logprobs && r.top_logprobs == 0);
    api_request_free(&r);
    snprintf(buf, sizeof buf, "{%s,\"top_logprobs\":3}", msg);  // needs logprobs: true
    expect_bad(API_KIND_CHAT, buf, "top_logprobs");
    CHECK(parse(&r, API_KIND_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\",\"logprobs\":4}", &e) == ERR_OK);
    CHECK(r.logprobs && r.top_logprobs == 4);
    json_object *p = api_request_params(&r), *v;
    CHECK(json_object_object_get_ex(p, "top_logprobs", &v) && json_object_get_int(v) == 4);
    json_object_put(p);
    api_request_free(&r);
    CHECK(parse(&r, API_KIND_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\",\"logprobs\":0}", &e) == ERR_OK);
    CHECK(r.logprobs && r.top_logprobs == 0);
    api_request_free(&r);
    CHECK(parse(&r, API_KIND_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\"}", &e) == ERR_OK);
    CHECK(!r.logprobs);
    api_request_free(&r);
    expect_bad(API_KIND_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\",\"logprobs\":true}", "logprobs");
    expect_bad(API_KIND_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\",\"logprobs\":21}", "logprobs");

    // tool_choice: auto (default), none drops the tools, required, a named function.
    snprintf(buf, sizeof buf, "{%s%s}", msg, tools);
    CHECK(parse(&r, API_KIND_CHAT, buf, &e) == ERR_OK);
    CHECK(r.tool_choice == API_TOOL_CHOICE_AUTO && r.tools);
    api_request_free(&r);
    snprintf(buf, sizeof buf, "{%s%s,\"tool_choice\":\"none\"}", msg, tools);
    CHECK(parse(&r, API_KIND_CHAT, buf, &e) == ERR_OK);
    CHECK(r.tool_choice == API_TOOL_CHOICE_NONE && !r.tools);
    CHECK(!json_object_object_get_ex(r.root, "tools", &v));  // rendered without tools
    CHECK(api_request_check(&r));
    api_request_free(&r);
    snprintf(buf, sizeof buf, "{%s%s,\"tool_choice\":\"required\"}", msg, tools);
    CHECK(parse(&r, API_KIND_CHAT, buf, &e) == ERR_OK);
    CHECK(r.tool_choice == API_TOOL_CHOICE_REQUIRED && r.tools);
    api_request_free(&r);
    snprintf(buf, sizeof buf, "{%s%s,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}}",
             msg, tools);
    CHECK(parse(&r, API_KIND_CHAT, buf, &e) == ERR_OK);
    CHECK(r.tool_choice == API_TOOL_CHOICE_FUNCTION && !strcmp(r.tool_choice_name, "g"));
    CHECK(api_request_check(&r));
    api_request_free(&r);
    const char *bad[] = {
        "\"tool_choice\":\"always\"", "\"tool_choice\":3", "\"tool_choice\":{\"type\":\"function\"}",
        "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"h\"}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(buf, sizeof buf, "{%s%s,%s}", msg, tools, bad[i]);
        expect_bad(API_KIND_CHAT, buf, "tool_choice");
    }
    snprintf(buf, sizeof buf, "{%s,\"tool_choice\":\"required\"}", msg);  // no tools
    expect_bad(API_KIND_CHAT, buf, "tool_choice");
}

int main(void)
{
    test_logprobs_and_tool_choice();
    test_valid_chat();
    test_defaults_and_completion();
    test_bad_inputs();
    return check_exit();
}
