/*
 * test_cli_bench.c - `glmspark bench` on the CPU backend: bad arguments (and a bad
 * GLMSPARK_THREADS, for `generate` too) are refused with status 2, and a run on a synthetic
 * tiny model prints one JSON line per batch size with the configuration echoed and positive
 * timings; --mtp-drafts adds the MTP steps' figures (and a checkpoint without an MTP layer is
 * an error). No timing is asserted beyond "> 0" and the figures' own arithmetic.
 */
#define _DEFAULT_SOURCE  // mkdtemp
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/cli/cli.h"
#include "engine/tools/mkmodel.h"
#include "tests/check.h"

static int run(int argc, const char **argv)
{
    return cli_bench(argc, (char **) argv);
}

// run() with standard output in the file at path; its status.
static int run_to_file(int argc, const char **argv, const char *path)
{
    fflush(stdout);
    const int saved = dup(1);
    CHECK(freopen(path, "w", stdout) != NULL);
    const int rc = run(argc, argv);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    return rc;
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
    const char *bad_drafts[] = {"bench", "--synthetic", "--mtp-drafts", "4"};
    CHECK(run(4, bad_drafts) == 2);
    const char *zero_drafts[] = {"bench", "--synthetic", "--mtp-drafts", "1,0"};
    CHECK(run(4, zero_drafts) == 2);
    // GLMSPARK_THREADS, the thread count without --threads, is whole and in range or an
    // error (status 2), for bench and for the model commands (generate, logits) alike.
    const char *synthetic[] = {"bench", "--synthetic"};
    const char *gen[] = {"generate", "--model", "/nonexistent", "--tokens", "1"};
    const char *bad_env[] = {"abc", "8x", "0", "65", "", "-3"};
    for (size_t i = 0; i < sizeof bad_env / sizeof *bad_env; i++) {
        CHECK(setenv("GLMSPARK_THREADS", bad_env[i], 1) == 0);
        CHECK(run(2, synthetic) == 2);
        CHECK(cli_generate(5, (char **) gen) == 2);
    }
    CHECK(unsetenv("GLMSPARK_THREADS") == 0);
    // The CUDA backend runs the bf16 recipe over a bf16 or fp8 cache only: refused before
    // anything is opened (the same in a build without CUDA).
    const char *cuda_f32[] = {"bench", "--synthetic", "--backend", "cuda", "--precision", "f32"};
    CHECK(run(6, cuda_f32) == 2);
    const char *cuda_f32_kv[] = {"bench", "--synthetic", "--backend", "cuda", "--kv-dtype", "f32"};
    CHECK(run(6, cuda_f32_kv) == 2);
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
    // The 9-token prompts are prefilled in calls of 4, 4 and 1 tokens.
    const char *ok_args[] = {"bench", "--synthetic", "--preset", "tiny",    "--backend",
                             "cpu",   "--threads",   "2",        "--batch", "1,3",
                             "--ctx", "9",           "--steps",  "2",       "--json",
                             "--prefill-chunk", "4"};
    CHECK(run_to_file(17, ok_args, out_path) == 0);

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
        // Prefill FLOPs: positive, and the TFLOP/s is a sequence's FLOPs at the token rate.
        const char *fl = strstr(line, "\"prefill_flops_seq\":"), *tf = strstr(line, "\"prefill_tflop_s\":");
        CHECK(fl && tf);
        if (fl && tf && pre) {
            const double flops = atof(fl + strlen("\"prefill_flops_seq\":"));
            const double tflops = atof(tf + strlen("\"prefill_tflop_s\":"));
            const double rate = atof(pre + strlen("\"prefill_tok_s\":"));
            CHECK(flops > 0.0 && fabs(tflops - rate * flops / 9.0 * 1e-12) <= 1e-4 + 1e-3 * tflops);
        }
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

    // MTP steps (--mtp-drafts): tiny has an MTP layer. One JSON line per batch size with an
    // "mtp" entry per draft count: positive verify and draft times, the published accepted
    // length, and the speed-up = that length x the per-accepted-token ratio.
    char mtp_path[600];
    snprintf(mtp_path, sizeof mtp_path, "%s/mtp.json", dir);
    const char *mtp_args[] = {"bench",  "--synthetic", "--preset", "tiny",      "--backend",
                              "cpu",    "--threads",   "2",        "--batch",   "2",
                              "--ctx",  "9",           "--steps",  "2",         "--json",
                              "--mtp-drafts", "1,3"};
    CHECK(run_to_file(17, mtp_args, mtp_path) == 0);
    f = fopen(mtp_path, "r");
    CHECK(f != NULL);
    int mtp_lines = 0;
    while (f && fgets(line, sizeof line, f)) {
        mtp_lines++;
        const char *m = strstr(line, "\"mtp\":[");
        CHECK(m != NULL);
        const int drafts[2] = {1, 3};
        const double accept[2] = {1.84, 2.99};
        for (int i = 0; i < 2 && m; i++) {
            int k = 0;
            double v_ms = 0, ratio = 0, d_ms = 0, step = 0, per = 0, len = 0, speed = 0;
            m = strstr(m, "{\"drafts\":");
            CHECK(m && sscanf(m, "{\"drafts\":%d,\"verify_ms\":%lf,\"verify_ratio\":%lf,"
                                 "\"draft_ms\":%lf,\"step_ms\":%lf,"
                                 "\"speedup_per_accepted_token\":%lf,"
                                 "\"published_accept_len\":%lf,\"speedup\":%lf}",
                              &k, &v_ms, &ratio, &d_ms, &step, &per, &len, &speed) == 8);
            CHECK(k == drafts[i] && v_ms > 0.0 && ratio > 0.0 && d_ms > 0.0);
            CHECK(fabs(step - (v_ms + d_ms)) <= 1e-3 * step + 1e-4);
            CHECK(len == accept[i] && fabs(speed - len * per) <= 1e-3 * speed);
            if (m) m++;
        }
    }
    if (f) fclose(f);
    CHECK(mtp_lines == 1);
    // A checkpoint without an MTP layer: a clear error, status 1.
    char no_mtp[600];
    snprintf(no_mtp, sizeof no_mtp, "%s/no-mtp", dir);
    const MkmodelOptions mo = {.out_dir = no_mtp, .preset = "tiny", .set_mtp = true, .mtp = 0};
    CHECK(mkmodel_write(&mo) == ERR_OK);
    const char *mtp_missing[] = {"bench", "--model", no_mtp, "--ctx", "4", "--steps", "1",
                                 "--mtp-drafts", "1"};
    CHECK(run(9, mtp_missing) == 1);

    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    return check_exit();
}
