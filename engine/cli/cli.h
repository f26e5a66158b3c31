/*
 * cli.h - the subcommands of the `glmspark` command-line tool.
 *
 * engine/cli/main.c dispatches `glmspark <command> [args]` to cli_<command>(argc, argv) with
 * argv[0] = the command name. Each returns the process exit status: 0 on success, 1 on a
 * failure that has been reported on stderr, 2 on a usage error. Commands are grouped in
 * files by subject: cli_model.c (logits, generate), cli_ckpt.c (inspect, mkmodel),
 * cli_text.c (tokenize, detokenize), cli_chat.c (chat-template), cli_serve.c (db, keys),
 * cli_status.c (status), cli_bench.c (bench). cli.c holds the table and the option parsing
 * the command files share.
 *
 * Ownership: nothing outlives a call.
 * Threads:   called once, from main.
 * Errors:    reported on stderr, never returned as Err.
 */
#ifndef ENGINE_CLI_CLI_H
#define ENGINE_CLI_CLI_H

#include <stdbool.h>

#include "engine/model/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int (*CliCommandFn)(int argc, char **argv);

typedef struct CliCommand {
    const char *name;
    CliCommandFn run;
    const char *summary;  // one line for `glmspark help`
} CliCommand;

// The table of commands, terminated by an entry with name == NULL. Static storage.
const CliCommand *cli_commands(void);

// Option values, shared by the command files (integers: engine/shared/num.h): each returns
// false on a malformed or out-of-range value and then leaves *out unchanged.
// --backend cpu|cuda: *is_cuda.
bool cli_parse_backend(const char *s, bool *is_cuda);
// The CPU backend's threads when --threads is not given, into *out: GLMSPARK_THREADS (1 to
// THREAD_POOL_MAX_THREADS) or the online CPUs (at most that many); false, after a message
// naming command cmd, when GLMSPARK_THREADS is set to anything else.
bool cli_default_threads(const char *cmd, int *out);

int cli_logits(int argc, char **argv);
int cli_generate(int argc, char **argv);
int cli_inspect(int argc, char **argv);
int cli_mkmodel(int argc, char **argv);
int cli_tokenize(int argc, char **argv);
int cli_detokenize(int argc, char **argv);
int cli_bench_tokenize(int argc, char **argv);
int cli_bench(int argc, char **argv);
int cli_chat_template(int argc, char **argv);
int cli_db(int argc, char **argv);
int cli_keys(int argc, char **argv);
int cli_status(int argc, char **argv);  // cli_status.c

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_CLI_CLI_H
