/*
 * test_cli_bench.c - `glmspark bench` on the CPU backend: bad arguments are refused with
 * status 2, and a run on a synthetic tiny model prints one JSON line per batch size with the
 * configuration echoed and positive timings. No timing is asserted beyond "> 0".
 */
#define _DEFAULT_SOURCE  // mkdtemp
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/cli/cli.h"
#include "tests/check.h"

static int run(int argc, const char **argv)
{
    return cli_bench(argc, (char **) argv);
}

int main(void)
{
    // Bad arguments: usage, status 2, nothing run.
    const char *no_model[] = {"bench", "--ctx", "4"};
    CHECK(run(3, no_model) == 2);
    const char *both[] = {"bench", "--synthetic", "--model", "/nonexistent"};
    CHECK(run(4, both) == 2);
    const char *bad_batch[] = {"bench", "--synthetic", "--batch", "1,0"};
    CHECK(run(4, bad_batch) == 2);
    const char *bad_backend[] = {"bench", "--synthetic", "--backend", "tpu"};
    CHECK(run(4, bad_backend) == 2);
    const char *missing_value[] = {"bench", "--synthetic", "--steps"};
    CHECK(run(3, missing_value) == 2);
    const char *bad_chunk[] = {"bench", "--synthetic", "--prefill-chunk", "0"};
    CHECK(run(4, bad_chunk) == 2);
    const char *unknown[] = {"bench", "--synthetic", "--frobnicate", "1"};
    CHECK(run(4, unknown) == 2);
    // A model directory that does not exist: an error, not a crash.
    const char *missing_model[] = {"bench", "--model", "/nonexistent/glmspark-model"};
    CHECK(run(3, missing_model) == 1);

    // A real run: synthetic tiny preset in a private TMPDIR, JSON to a file.
    const char *base = getenv("TMPDIR");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/glmspark-bench-test-XXXXXX", base && *base ? base : "/tmp");
    CHECK(mkdtemp(dir) != NULL);
    setenv("TMPDIR", dir, 1);
    char out_path[600];
    snprintf(out_path, sizeof out_path, "%s/out.json", dir);
    fflush(stdout);
    const int saved = dup(1);
    CHECK(freopen(out_path, "w", stdout) != NULL);
    // The 9-token prompts are prefilled in calls of 4, 4 and 1 tokens.
    const char *ok_args[] = {"bench", "--synthetic", "--preset", "tiny",    "--backend",
                             "cpu",   "--threads",   "2",        "--batch", "1,3",
                             "--ctx", "9",           "--steps",  "2",       "--json",
                             "--prefill-chunk", "4"};
    const int rc = run(17, ok_args);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    CHECK(rc == 0);

    FILE *f = fopen(out_path, "r");
    CHECK(f != NULL);
    char line[1024];
    int lines = 0;
    double kv_batch1 = 0.0;
    while (f && fgets(line, sizeof line, f)) {
        lines++;
        char want[64];
        snprintf(want, sizeof want, "\"batch\":%d,\"ctx\":9,", lines == 1 ? 1 : 3);
        CHECK(strstr(line, want) != NULL);
        CHECK(strstr(line, "\"backend\":\"cpu\"") != NULL);
        const char *tok = strstr(line, "\"decode_tok_s\":");
        CHECK(tok && atof(tok + strlen("\"decode_tok_s\":")) > 0.0);
        const char *pre = strstr(line, "\"prefill_tok_s\":");
        CHECK(pre && atof(pre + strlen("\"prefill_tok_s\":")) > 0.0);
        // Bytes by category: the weights' sum is weight_bytes_step; the cache's bytes are per
        // sequence, so batch 3 reads exactly 3x batch 1's.
        double cat[7] = {0}, total = 0.0, sum = 0.0;
        const char *bs = strstr(line, "\"bytes_step\":{");
        CHECK(bs && sscanf(bs, "\"bytes_step\":{\"attention\":%lf,\"indexer\":%lf,\"dense_mlp\":%lf,"
                                 "\"shared_expert_router\":%lf,\"routed_experts\":%lf,"
                                 "\"lm_head\":%lf,\"kv_cache\":%lf}",
                           &cat[0], &cat[1], &cat[2], &cat[3], &cat[4], &cat[5], &cat[6]) == 7);
        const char *wb = strstr(line, "\"weight_bytes_step\":");
        CHECK(wb && sscanf(wb, "\"weight_bytes_step\":%lf", &total) == 1);
        for (int i = 0; i < 6; i++) sum += cat[i];
        CHECK(cat[0] > 0.0 && cat[5] > 0.0 && cat[6] > 0.0 && fabs(sum - total) <= 1.0 + 1e-9 * total);
        if (lines == 1) kv_batch1 = cat[6];
        else CHECK(cat[6] == 3.0 * kv_batch1);
    }
    if (f) fclose(f);
    CHECK(lines == 2);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    return check_exit();
}
