/*
 * main.c - `glmspark`, the command-line tool: run a model offline, dump logits, tokenize,
 * inspect a checkpoint, make small test models. See cli.h for the command contract.
 */
#include <stdio.h>
#include <string.h>

#include "engine/cli/cli.h"

static void usage(FILE *out)
{
    fprintf(out, "usage: glmspark <command> [options]\n\ncommands:\n");
    for (const CliCommand *c = cli_commands(); c->name; c++)
        fprintf(out, "  %-14s %s\n", c->name, c->summary);
    fprintf(out, "\n`glmspark <command> --help` describes a command's options.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "help") == 0 || strcmp(argv[1], "--help") == 0
        || strcmp(argv[1], "-h") == 0) {
        usage(stdout);
        return 0;
    }
    for (const CliCommand *c = cli_commands(); c->name; c++) {
        if (strcmp(c->name, argv[1]) == 0) return c->run(argc - 1, argv + 1);
    }
    fprintf(stderr, "glmspark: unknown command \"%s\"\n\n", argv[1]);
    usage(stderr);
    return 2;
}
