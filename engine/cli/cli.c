/*
 * cli.c - the command table behind `glmspark <command>`, and the option parsing the command
 * files share.
 *
 * Kept apart from main.c so that tests can link the whole table and call a command as a
 * function.
 */
#include "engine/cli/cli.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/num.h"
#include "engine/shared/thread_pool.h"

static const CliCommand commands[] = {
    {"logits", cli_logits, "run one forward pass over token ids and write f32 logits"},
    {"generate", cli_generate, "generate token ids from prompt token ids"},
    {"inspect", cli_inspect, "describe a checkpoint: layers, quantization, bytes"},
    {"mkmodel", cli_mkmodel, "write a small random checkpoint in the real on-disk format"},
    {"tokenize", cli_tokenize, "turn UTF-8 text on stdin into token ids"},
    {"detokenize", cli_detokenize, "turn token ids on stdin into text"},
    {"bench-tokenize", cli_bench_tokenize, "time single-threaded tokenization of a text file"},
    {"bench", cli_bench, "time prefill and batched decode through the engine (--backend cpu|cuda)"},
    {"chat-template", cli_chat_template, "render OpenAI-style messages as a GLM prompt"},
    {"db", cli_db, "apply the job-queue SQL migrations: db migrate --db CONNINFO"},
    {"keys", cli_keys, "API keys: keys create|list|revoke"},
    {"status", cli_status, "the engine's ranks, KV cache, jobs and tokens/s (exit 0 when up)"},
    {NULL, NULL, NULL},
};

const CliCommand *cli_commands(void)
{
    return commands;
}

bool cli_parse_backend(const char *s, bool *is_cuda)
{
    if (strcmp(s, "cpu") != 0 && strcmp(s, "cuda") != 0) return false;
    *is_cuda = strcmp(s, "cuda") == 0;
    return true;
}

bool cli_default_threads(const char *cmd, int *out)
{
    const char *env = getenv("GLMSPARK_THREADS");
    if (!env) {
        *out = thread_pool_cores(THREAD_POOL_MAX_THREADS);
        return true;
    }
    if (num_parse_int(env, 1, THREAD_POOL_MAX_THREADS, out)) return true;
    fprintf(stderr, "glmspark %s: GLMSPARK_THREADS=\"%s\": expected a thread count from 1 to %d\n",
            cmd, env, (int) THREAD_POOL_MAX_THREADS);
    return false;
}
