/*
 * cli_model.c - placeholder until its owner lands the real commands (see cli.h).
 */
#include "cli.h"

#include <stdio.h>

int cli_logits(int argc, char **argv)
{
    (void) argc;
    fprintf(stderr, "glmspark %s: not built yet\n", argv[0]);
    return 1;
}

int cli_generate(int argc, char **argv)
{
    (void) argc;
    fprintf(stderr, "glmspark %s: not built yet\n", argv[0]);
    return 1;
}
