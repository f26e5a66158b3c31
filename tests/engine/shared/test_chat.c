/*
 * test_chat.c - GLM prompt rendering (engine/shared/chat.h) against transformers' renderings of
 * the real GLM-4.7 template, GLM-5.2's documented differences, Python's json.dumps, and
 * error messages that name the offending field.
 *
 * tests/golden/chat/cases.jsonl comes from tests/tools/gen_chat_golden.py run on the GPU
 * machine (transformers 5.17 apply_chat_template with the GLM-4.7-Flash template); each
 * line's "request" is rendered with CHAT_TEMPLATE_GLM47 and must equal "expected" byte for
 * byte. The GLM-5.2 expectations are written out by hand from the template plus the
 * documented first line (the example in GLM-5.2's reference README).
 */
#include <stdlib.h>
#include <string.h>

#include <json-c/json.h>

#include "engine/shared/chat.h"
#include "tests/check.h"
#include "tests/engine/shared/source_file.h"

static json_object *parse(const char *text)
{
    json_object *o = json_tokener_parse(text);
    if (!o) fprintf(stderr, "test bug: bad JSON %s\n", text);
    return o;
}

// Render a request given as JSON text with tmpl; returns the malloc'd prompt or NULL.
static char *render(const char *request, ChatTemplate tmpl, Err *e_out, ChatError *err)
{
    json_object *req = parse(request);
    char *out = NULL;
    size_t n = 0;
    ChatError local = {{0}};
    const Err e = chat_render_request(req, tmpl, &out, &n, NULL, err ? err : &local);
    if (e_out) *e_out = e;
    json_object_put(req);
    if (!e) CHECK(strlen(out) == n);
    return e ? NULL : out;
}

static void check_render(const char *request, ChatTemplate tmpl, const char *want)
{
    Err e;
    ChatError err = {{0}};
    char *got = render(request, tmpl, &e, &err);
    CHECK(e == ERR_OK);
    CHECK(got && strcmp(got, want) == 0);
    if (!got || strcmp(got, want) != 0) {
        fprintf(stderr, "  request: %s\n  got:  %s\n  want: %s\n  (%s)\n", request,
                got ? got : "(error)", want, err.msg);
    }
    free(got);
}

// The request must fail with ERR_INVAL and a message starting with field.
static void check_error(const char *request, const char *field)
{
    Err e;
    ChatError err = {{0}};
    char *got = render(request, CHAT_TEMPLATE_GLM47, &e, &err);
    CHECK(e == ERR_INVAL);
    CHECK(strncmp(err.msg, field, strlen(field)) == 0);
    if (e != ERR_INVAL || strncmp(err.msg, field, strlen(field)) != 0) {
        fprintf(stderr, "  request: %s\n  error: \"%s\", want field %s\n", request, err.msg, field);
    }
    free(got);
}

// ---------------------------------------------------------------------------
// Goldens from transformers

static void test_goldens(void)
{
    FILE *f = source_fopen("tests/golden/chat/cases.jsonl");
    CHECK(f != NULL);
    if (!f) return;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int n_cases = 0, n_meta = -1;
    while ((len = getline(&line, &cap, f)) > 0) {
        json_object *rec = json_tokener_parse(line);
        CHECK(rec != NULL);
        json_object *meta = NULL, *name = NULL, *request = NULL, *expected = NULL;
        if (json_object_object_get_ex(rec, "meta", &meta)) {
            json_object *n = NULL;
            json_object_object_get_ex(meta, "n_cases", &n);
            n_meta = json_object_get_int(n);
            json_object_put(rec);
            continue;
        }
        CHECK(json_object_object_get_ex(rec, "name", &name));
        CHECK(json_object_object_get_ex(rec, "request", &request));
        CHECK(json_object_object_get_ex(rec, "expected", &expected));
        char *got = NULL;
        size_t n_got = 0;
        ChatOptions used;
        ChatError err = {{0}};
        const Err e = chat_render_request(request, CHAT_TEMPLATE_GLM47, &got, &n_got, &used, &err);
        CHECK(e == ERR_OK);
        const char *want = json_object_get_string(expected);
        const size_t n_want = (size_t) json_object_get_string_len(expected);
        const bool same = !e && n_got == n_want && memcmp(got, want, n_want) == 0;
        CHECK(same);
        if (!same) {
            fprintf(stderr, "  golden %s differs (%s)\n  got:  %s\n  want: %s\n",
                    json_object_get_string(name), err.msg, got ? got : "(error)", want);
        }
        // The parser starts inside reasoning exactly when the prompt ends with <think>.
        if (!e)
            CHECK(chat_prompt_opens_reasoning(got, n_got)
                  == (used.add_generation_prompt && used.thinking));
        free(got);
        json_object_put(rec);
        n_cases++;
    }
    free(line);
    fclose(f);
    CHECK(n_cases >= 20);
    CHECK(n_cases == n_meta);
}

// ---------------------------------------------------------------------------
// GLM-5.2: the template above plus a first system line when thinking is on

static void test_glm52(void)
{
    // The reference README's example, verbatim.
    check_render("{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}", CHAT_TEMPLATE_GLM52,
                 "[gMASK]<sop><|system|>Reasoning Effort: High<|user|>Hello<|assistant|><think>");
    check_render("{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],"
                 "\"reasoning_effort\":\"high\"}",
                 CHAT_TEMPLATE_GLM52,
                 "[gMASK]<sop><|system|>Reasoning Effort: High<|user|>Hello<|assistant|><think>");
    // The official template prints Max for every effort but "high".
    check_render("{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],"
                 "\"reasoning_effort\":\"medium\"}",
                 CHAT_TEMPLATE_GLM52,
                 "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>Hello<|assistant|><think>");
    // Thinking off: no effort line, and the GLM-4.7 closing tag as generation prompt.
    check_render("{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],"
                 "\"chat_template_kwargs\":{\"enable_thinking\":false}}",
                 CHAT_TEMPLATE_GLM52, "[gMASK]<sop><|user|>Hello<|assistant|></think>");
    check_render("{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],"
                 "\"thinking\":{\"type\":\"disabled\"}}",
                 CHAT_TEMPLATE_GLM52, "[gMASK]<sop><|user|>Hello<|assistant|></think>");
    check_render("{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],"
                 "\"reasoning_effort\":\"none\"}",
                 CHAT_TEMPLATE_GLM52, "[gMASK]<sop><|user|>Hello<|assistant|></think>");
    // The effort line comes before the tools block and the conversation's own system.
    check_render(
        "{\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":"
        "\"Q\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}",
        CHAT_TEMPLATE_GLM52,
        "[gMASK]<sop><|system|>Reasoning Effort: High<|system|>\n# Tools\n\nYou may call one or "
        "more functions to assist with the user query.\n\nYou are provided with function "
        "signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", "
        "\"function\": {\"name\": \"f\"}}\n</tools>\n\nFor each function call, output the "
        "function name and arguments within the following XML format:\n<tool_call>{function-"
        "name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-"
        "key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call><|system|>S<|user|>"
        "Q<|assistant|><think>");
}

// ---------------------------------------------------------------------------
// What the template leaves to us: OpenAI shapes it cannot take directly

static void test_openai_shapes(void)
{
    // developer is a system message; a bare array is a messages list.
    check_render(
        "[{\"role\":\"developer\",\"content\":\"D\"},{\"role\":\"user\",\"content\":\"U\"}]",
        CHAT_TEMPLATE_GLM47, "[gMASK]<sop><|system|>D<|user|>U<|assistant|><think>");
    // content null (an assistant turn with tool calls) renders as nothing, not "None";
    // arguments given as an object and as a JSON string render the same.
    const char *want = "[gMASK]<sop><|user|>U<|assistant|></think><tool_call>f<arg_key>a"
                       "</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>x"
                       "</arg_value></tool_call><|observation|><tool_response>R</tool_response>"
                       "<|assistant|><think>";
    check_render("[{\"role\":\"user\",\"content\":\"U\"},{\"role\":\"assistant\",\"content\":null,"
                 "\"tool_calls\":[{\"id\":\"1\",\"type\":\"function\",\"function\":{\"name\":\"f\","
                 "\"arguments\":\"{\\\"a\\\": 1, \\\"b\\\": \\\"x\\\"}\"}}]},{\"role\":\"tool\","
                 "\"tool_call_id\":\"1\",\"content\":\"R\"}]",
                 CHAT_TEMPLATE_GLM47, want);
    check_render("[{\"role\":\"user\",\"content\":\"U\"},{\"role\":\"assistant\",\"tool_calls\":"
                 "[{\"function\":{\"name\":\"f\",\"arguments\":{\"a\":1,\"b\":\"x\"}}}]},"
                 "{\"role\":\"tool\",\"content\":[{\"type\":\"text\",\"text\":\"R\"}]}]",
                 CHAT_TEMPLATE_GLM47, want);
    // Reasoning after the last user turn: vLLM's field name "reasoning" works too.
    check_render("[{\"role\":\"user\",\"content\":\"U\"},{\"role\":\"assistant\",\"content\":\"A\","
                 "\"reasoning\":\" r \"}]",
                 CHAT_TEMPLATE_GLM47,
                 "[gMASK]<sop><|user|>U<|assistant|><think>r</think>A<|assistant|><think>");
    // No user message at all: every assistant turn counts as after the last user.
    check_render("{\"messages\":[{\"role\":\"assistant\",\"content\":\"A\",\"reasoning_content\":"
                 "\"R\"}],\"add_generation_prompt\":false}",
                 CHAT_TEMPLATE_GLM47, "[gMASK]<sop><|assistant|><think>R</think>A");
    // Empty tools list: no tools block ({% if tools %}).
    check_render("{\"messages\":[{\"role\":\"user\",\"content\":\"U\"}],\"tools\":[]}",
                 CHAT_TEMPLATE_GLM47, "[gMASK]<sop><|user|>U<|assistant|><think>");
}

// ---------------------------------------------------------------------------
// Errors name the field

static void test_errors(void)
{
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"robot\","
                "\"content\":\"b\"}]}",
                "messages[1].role");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"user\","
                "\"content\":\"b\"},{\"role\":\"user\",\"content\":7}]}",
                "messages[2].content");
    check_error("{\"messages\":[{\"content\":\"a\"}]}", "messages[0].role");
    check_error("{\"messages\":[\"hi\"]}", "messages[0]");
    check_error("{\"messages\":{}}", "messages");
    check_error("{\"messages\":[]}", "messages");
    check_error("{\"tools\":[]}", "messages");
    check_error("42", "request");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\","
                "\"image_url\":{\"url\":\"x\"}}]}]}",
                "messages[0].content[0].type");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}",
                "messages[0].content[0].text");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"tool\","
                "\"content\":\"r\"}]}",
                "messages[1]: a tool message must follow");
    check_error("{\"messages\":[{\"role\":\"tool\",\"content\":\"r\"}]}", "messages[0]: a tool");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
                "\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"{bad\"}}]}]}",
                "messages[1].tool_calls[0].function.arguments");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
                "\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"[1,2]\"}}]}]}",
                "messages[1].tool_calls[0].function.arguments");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
                "\"tool_calls\":[{\"function\":{\"arguments\":\"{}\"}}]}]}",
                "messages[1].tool_calls[0].function.name");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
                "\"tool_calls\":{}}]}",
                "messages[1].tool_calls");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
                "\"content\":\"b\",\"reasoning_content\":5}]}",
                "messages[1].reasoning_content");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"tools\":[{\"type\":"
                "\"function\",\"function\":{\"name\":3}}]}",
                "tools[0].function.name");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"tools\":{}}", "tools");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"chat_template_kwargs\":"
                "{\"enable_thinking\":\"no\"}}",
                "chat_template_kwargs.enable_thinking");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"add_generation_prompt\":"
                "1}",
                "add_generation_prompt");
    check_error("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"thinking\":"
                "{\"type\":\"maybe\"}}",
                "thinking.type");
}

// ---------------------------------------------------------------------------
// json.dumps(ensure_ascii=False): each expectation is what CPython 3.12 prints

static void check_dumps(const char *json, const char *want)
{
    json_object *o = json_tokener_parse(json);
    char *got = NULL;
    size_t n = 0;
    CHECK(chat_json_dumps(o, &got, &n) == ERR_OK);
    CHECK(got && strcmp(got, want) == 0 && n == strlen(want));
    if (!got || strcmp(got, want) != 0) {
        fprintf(stderr, "  dumps(%s) = %s, want %s\n", json, got ? got : "(null)", want);
    }
    free(got);
    json_object_put(o);
}

static void test_dumps(void)
{
    check_dumps("0.1", "0.1");
    check_dumps("1.0", "1.0");
    check_dumps("1.50", "1.5");
    check_dumps("100.0", "100.0");
    check_dumps("1e2", "100.0");
    check_dumps("1e16", "1e+16");
    check_dumps("1234567890123456.0", "1234567890123456.0");
    check_dumps("0.0001", "0.0001");
    check_dumps("0.00001", "1e-05");
    check_dumps("1.5e-7", "1.5e-07");
    check_dumps("0.30000000000000004", "0.30000000000000004");
    check_dumps("-0.0", "-0.0");
    check_dumps("5e-324", "5e-324");
    check_dumps("1.7976931348623157e308", "1.7976931348623157e+308");
    check_dumps("123e300", "1.23e+302");
    check_dumps("-2.5", "-2.5");
    check_dumps("9007199254740993", "9007199254740993");
    check_dumps("-9223372036854775808", "-9223372036854775808");
    check_dumps("18446744073709551615", "18446744073709551615");
    check_dumps("[]", "[]");
    check_dumps("{}", "{}");
    check_dumps("{\"b\":[1,true,null,{\"a\":\"x\"}],\"a\":false}",
                "{\"b\": [1, true, null, {\"a\": \"x\"}], \"a\": false}");
    // Escapes: quote, backslash, the short forms, other controls as lower-case \u00XX;
    // DEL, '/', and non-ASCII stay as they are.
    check_dumps("\"q\\\"b\\\\n\\n\\r\\t\\b\\f\\u0001\\u001f\\u007f/\\u00e9\\u4e2d\"",
                "\"q\\\"b\\\\n\\n\\r\\t\\b\\f\\u0001\\u001f\x7f/\xc3\xa9\xe4\xb8\xad\"");
    check_dumps("{\"k\\n\":1}", "{\"k\\n\": 1}");
}

int main(void)
{
    test_goldens();
    test_glm52();
    test_openai_shapes();
    test_errors();
    test_dumps();
    return check_exit();
}
