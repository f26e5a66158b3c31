/*
 * cli_chat.c - `glmspark chat-template`: render an OpenAI-style chat request to the GLM
 * prompt (engine/shared/chat.h) and optionally tokenize it (engine/shared/tokenizer.h).
 *
 * stdin holds {"messages": [...], "tools": [...], ...options} or a bare messages array.
 * Request options (add_generation_prompt, chat_template_kwargs.enable_thinking, ...) apply
 * first; command-line flags override them. The prompt goes to stdout byte for byte with
 * no newline added; with --ids the token ids of the prompt (special-token strings
 * recognised, nothing added around them, as HF's apply_chat_template(tokenize=True) does)
 * go to stdout space-separated on one line instead.
 */
#include "engine/cli/cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"
#include "engine/shared/chat.h"
#include "engine/shared/tokenizer.h"

static int usage_chat_template(void)
{
    fprintf(stderr,
            "usage: glmspark chat-template [--model DIR] [--ids] [--template glm52|glm47]\n"
            "                              [--no-thinking] [--effort high|max]\n"
            "                              [--no-generation-prompt] < request.json\n"
            "  reads {\"messages\": [...], \"tools\": [...]} or a messages array on stdin and\n"
            "  prints the GLM prompt; --ids prints its token ids (needs DIR/tokenizer.json)\n");
    return 2;
}

static int print_ids(const char *dir, const char *prompt, size_t n_prompt)
{
    int rc = 1;
    Tokenizer *tok = NULL;
    TokIds ids = {0};
    char path[4096];
    if (snprintf(path, sizeof path, "%s/tokenizer.json", dir) >= (int) sizeof path) {
        fprintf(stderr, "glmspark chat-template: model path too long\n");
        return 1;
    }
    if (tok_load(&tok, path)) {
        fprintf(stderr, "glmspark chat-template: could not load \"%s\"\n", path);
        goto done;
    }
    if (tok_encode(tok, prompt, n_prompt, false, &ids)) {
        fprintf(stderr, "glmspark chat-template: could not tokenize the prompt\n");
        goto done;
    }
    for (size_t i = 0; i < ids.n; i++)
        printf(i ? " %d" : "%d", (int) ids.ids[i]);
    printf("\n");
    rc = fflush(stdout) == 0 ? 0 : 1;
done:
    tok_ids_free(&ids);
    tok_destroy(tok);
    return rc;
}

int cli_chat_template(int argc, char **argv)
{
    const char *model = NULL;
    bool want_ids = false, no_thinking = false, no_gen = false;
    const char *effort = NULL;
    ChatTemplate tmpl = CHAT_TEMPLATE_GLM52;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--model") == 0 && i + 1 < argc) {
            model = argv[++i];
        } else if (strcmp(a, "--ids") == 0) {
            want_ids = true;
        } else if (strcmp(a, "--no-thinking") == 0) {
            no_thinking = true;
        } else if (strcmp(a, "--no-generation-prompt") == 0) {
            no_gen = true;
        } else if (strcmp(a, "--effort") == 0 && i + 1 < argc) {
            effort = argv[++i];
            if (strcmp(effort, "high") != 0 && strcmp(effort, "max") != 0) {
                return usage_chat_template();
            }
        } else if (strcmp(a, "--template") == 0 && i + 1 < argc) {
            const char *t = argv[++i];
            if (strcmp(t, "glm52") == 0) {
                tmpl = CHAT_TEMPLATE_GLM52;
            } else if (strcmp(t, "glm47") == 0) {
                tmpl = CHAT_TEMPLATE_GLM47;
            } else {
                return usage_chat_template();
            }
        } else {
            return usage_chat_template();
        }
    }
    if (want_ids && !model) {
        fprintf(stderr, "glmspark chat-template: --ids needs --model DIR\n");
        return 2;
    }

    int rc = 1;
    size_t n_prompt = 0;
    char *prompt = NULL;
    Buf in = {0};
    json_object *request = NULL;
    json_tokener *tok = json_tokener_new();
    if (buf_add_file(&in, stdin) || !tok) {
        fprintf(stderr, "glmspark chat-template: could not read stdin\n");
        goto done;
    }
    request = json_tokener_parse_ex(tok, in.p, (int) in.n + 1);  // +1: the NUL ends a number
    if (json_tokener_get_error(tok) != json_tokener_success) {
        fprintf(stderr, "glmspark chat-template: stdin is not valid JSON at byte %zu: %s\n",
                json_tokener_get_parse_end(tok),
                json_tokener_error_desc(json_tokener_get_error(tok)));
        goto done;
    }

    ChatOptions opts;
    ChatError err = {{0}};
    json_object *messages = request, *tools = NULL;
    chat_options_default(&opts, tmpl);
    if (json_object_is_type(request, json_type_object)) {
        messages = NULL;
        json_object_object_get_ex(request, "messages", &messages);
        json_object_object_get_ex(request, "tools", &tools);
        if (chat_options_from_request(&opts, request, &err)) {
            fprintf(stderr, "glmspark chat-template: %s\n", err.msg);
            goto done;
        }
    }
    if (no_thinking) opts.thinking = false;
    if (no_gen) opts.add_generation_prompt = false;
    if (effort) opts.effort = strcmp(effort, "high") == 0 ? CHAT_EFFORT_HIGH : CHAT_EFFORT_MAX;
    if (chat_render(messages, tools, &opts, &prompt, &n_prompt, &err)) {
        fprintf(stderr, "glmspark chat-template: %s\n", err.msg[0] ? err.msg : "out of memory");
        goto done;
    }
    if (want_ids) {
        rc = print_ids(model, prompt, n_prompt);
    } else {
        rc = fwrite(prompt, 1, n_prompt, stdout) == n_prompt && fflush(stdout) == 0 ? 0 : 1;
    }
done:
    free(prompt);
    json_object_put(request);
    if (tok) json_tokener_free(tok);
    buf_free(&in);
    return rc;
}
