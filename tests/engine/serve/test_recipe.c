/*
 * test_recipe.c - the recipe parser: the shipped recipes parse to the reference deployment's
 * settings; every kind of bad line is an error naming the key; flags override; formatting
 * round-trips.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend/backends.h"
#include "engine/serve/recipe.h"
#include "tests/capture.h"
#include "tests/check.h"

static Err parse(Recipe *r, const char *text)
{
    recipe_defaults(r);
    return recipe_parse(r, text, strlen(text), "test");
}

// Runs parse() with fd 2 captured (the log writes there); returns the error and copies
// the message to msg.
static Err parse_msg(const char *text, char *msg, size_t n)
{
    Recipe r;
    Capture cap;
    if (!capture_begin(&cap, STDERR_FILENO)) return ERR_IO;
    const Err err = parse(&r, text);
    capture_end(&cap, msg, n);
    return err;
}

static void test_shipped_recipe(void)
{
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/ops/recipes/glm-5.2-nvfp4-reap-469b.conf", src ? src : ".");
    Recipe r;
    recipe_defaults(&r);
    CHECK(recipe_load(&r, path) == ERR_OK);
    // The reference deployment's recipe table.
    CHECK(r.pipeline_parallel == 3);
    CHECK(r.tensor_parallel == 1);
    CHECK_NEAR(r.gpu_memory_utilization, 0.85, 0);
    CHECK(r.max_model_len == 262144);
    CHECK(r.kv_cache_dtype == KV_DTYPE_FP8);
    CHECK(r.backend == RECIPE_BACKEND_CUDA && r.mtp_tokens == 0);
    CHECK(r.block_size == 128);
    CHECK(r.max_num_seqs == 1);
    CHECK(r.max_num_batched_tokens == 2048);
    CHECK(!strcmp(r.model, "/models/GLM-5.2-NVFP4-REAP-469B"));
    CHECK(!strcmp(r.model_name, "GLM-5.2-NVFP4-REAP-469B"));
    CHECK(r.load_timeout_s == 3600 && r.master_port == 29500);

    snprintf(path, sizeof path, "%s/ops/recipes/devstack-tiny-cpu.conf", src ? src : ".");
    recipe_defaults(&r);
    CHECK(recipe_load(&r, path) == ERR_OK);
    CHECK(r.pipeline_parallel == 3 && r.kv_cache_dtype == KV_DTYPE_F32 && r.threads == 1);

    recipe_defaults(&r);
    CHECK(recipe_load(&r, "/nonexistent/recipe.conf") == ERR_IO);
}

static void test_syntax(void)
{
    Recipe r;
    CHECK(parse(&r, "") == ERR_OK);
    CHECK(r.pipeline_parallel == 1 && r.set_mask == 0);
    CHECK(parse(&r, "# comment\n\n   \t\n  # indented comment\r\n") == ERR_OK);
    CHECK(parse(&r, "threads=4\nmax_num_seqs   =   7   # trailing comment\r\n") == ERR_OK);
    CHECK(r.threads == 4 && r.max_num_seqs == 7);
    CHECK(parse(&r, "model = \"/a b/c#d\"  # quoted keeps spaces and #\n") == ERR_OK);
    CHECK(!strcmp(r.model, "/a b/c#d"));
    CHECK(parse(&r, "model = /x#y\n") == ERR_OK);  // # without a space before is text
    CHECK(!strcmp(r.model, "/x#y"));
    CHECK(parse(&r, "kv_cache_dtype = bf16\n") == ERR_OK);
    CHECK(r.kv_cache_dtype == KV_DTYPE_BF16);
    CHECK(r.backend == RECIPE_BACKEND_CPU);  // the default
    CHECK(parse(&r, "backend = cuda\n") == ERR_OK);
    CHECK(r.backend == RECIPE_BACKEND_CUDA && !strcmp(recipe_backend_name(r.backend), "cuda"));
    CHECK(r.precision == BACKEND_PRECISION_DEFAULT);  // the backend's own
    CHECK(parse(&r, "precision = f32\n") == ERR_OK);
    CHECK(r.precision == BACKEND_PRECISION_F32
          && !strcmp(backend_precision_name(r.precision), "f32"));
    CHECK(parse(&r, "precision = bf16\n") == ERR_OK && r.precision == BACKEND_PRECISION_BF16);
    CHECK(parse(&r, "gpu_memory_utilization = 1\nmin_free_memory_gb = 0\n") == ERR_OK);
    CHECK_NEAR(r.gpu_memory_utilization, 1.0, 0);
    CHECK(parse(&r, "block_size = 64") == ERR_OK);  // no final newline
    CHECK(r.block_size == 64);
}

typedef struct BadCase {
    const char *text;
    Err err;
    const char *must_mention;  // in the logged message
} BadCase;

static void test_errors_name_the_key(void)
{
    static const BadCase cases[] = {
        {"pipeline_paralel = 3\n", ERR_INVAL, "pipeline_paralel"},
        {"threads = 2\nfoo = 1\n", ERR_INVAL, "test:2: unknown recipe key \"foo\""},
        {"threads = 2\nthreads = 3\n", ERR_INVAL, "threads is set twice"},
        {"threads\n", ERR_FORMAT, "test:1"},
        {"= 4\n", ERR_FORMAT, "test:1"},
        {"Threads = 4\n", ERR_FORMAT, "Threads"},
        {"threads = four\n", ERR_INVAL, "threads: \"four\" is not an integer"},
        {"threads = 0\n", ERR_INVAL, "threads: 0 is out of range"},
        {"threads = 99999999999999999999\n", ERR_INVAL, "threads"},
        {"threads =\n", ERR_INVAL, "threads: empty value"},
        {"pipeline_parallel = 9\n", ERR_INVAL, "pipeline_parallel: 9 is out of range"},
        {"tensor_parallel = 2\n", ERR_INVAL, "tensor_parallel"},
        {"gpu_memory_utilization = 0\n", ERR_INVAL, "gpu_memory_utilization: 0 is out of range"},
        {"gpu_memory_utilization = 1.5\n", ERR_INVAL, "gpu_memory_utilization"},
        {"gpu_memory_utilization = nan\n", ERR_INVAL, "gpu_memory_utilization"},
        {"gpu_memory_utilization = 0.8x\n", ERR_INVAL, "not a number"},
        {"block_size = 100\n", ERR_INVAL, "block_size: 100 is not a power of two"},
        {"kv_cache_dtype = int4\n", ERR_INVAL, "kv_cache_dtype: \"int4\" is not one of"},
        {"backend = tpu\n", ERR_INVAL, "backend: \"tpu\" is not one of cpu, cuda"},
        {"precision = fp16\n", ERR_INVAL, "precision: \"fp16\" is not one of default, f32, bf16"},
        {"model = \"/unterminated\n", ERR_FORMAT, "model: unterminated"},
        {"model = \"/a\" extra\n", ERR_FORMAT, "model: text after"},
        {"model = \"\"\n", ERR_INVAL, "model: empty value"},
        {"model = a\"b\n", ERR_INVAL, "model: control characters and quotes"},
        {"master_port = 70000\n", ERR_INVAL, "master_port"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char msg[1024];
        const Err err = parse_msg(cases[i].text, msg, sizeof msg);
        const bool ok = err == cases[i].err && strstr(msg, cases[i].must_mention);
        if (!ok)
            fprintf(stderr, "case %zu \"%s\": got %s, message \"%s\"\n", i, cases[i].text,
                    err_name(err), msg);
        CHECK(ok);
    }
}

static void test_flags_override(void)
{
    Recipe r;
    CHECK(parse(&r, "threads = 4\nmodel = /m\n") == ERR_OK);
    CHECK(recipe_set(&r, "threads", "16", "command line") == ERR_OK);
    CHECK(r.threads == 16 && !strcmp(r.model, "/m"));
    CHECK(recipe_is_set(&r, "threads") && recipe_is_set(&r, "model"));
    CHECK(!recipe_is_set(&r, "block_size") && !recipe_is_set(&r, "no_such_key"));
    CHECK(recipe_set(&r, "threads", "0", "command line") == ERR_INVAL);
    CHECK(recipe_set(&r, "nope", "1", "command line") == ERR_INVAL);
    CHECK(r.threads == 16);
}

static void test_round_trip(void)
{
    Recipe r, back;
    CHECK(parse(&r, "model = \"/m o/d\"\nmodel_name = x\ntokenizer = /t.json\n"
                    "gpu_memory_utilization = 0.123456789\nkv_cache_dtype = bf16\n"
                    "min_free_memory_gb = 12.5\n") == ERR_OK);
    char text[8192] = "";
    size_t len = 0;
    for (int i = 0; i < recipe_n_keys(); i++) {
        char v[RECIPE_MAX_STR + 8];
        recipe_format_value(&r, i, v, sizeof v);
        if (!strcmp(v, "\"\"")) continue;  // unset strings
        len += (size_t) snprintf(text + len, sizeof text - len, "%s = %s\n", recipe_key_name(i), v);
    }
    CHECK(len < sizeof text);
    recipe_defaults(&back);
    CHECK(recipe_parse(&back, text, len, "round trip") == ERR_OK);
    back.set_mask = r.set_mask = 0;
    CHECK(!memcmp(&r, &back, sizeof r));
    CHECK(recipe_key_name(-1) == NULL && recipe_key_name(recipe_n_keys()) == NULL);
}

int main(void)
{
    test_shipped_recipe();
    test_syntax();
    test_errors_name_the_key();
    test_flags_override();
    test_round_trip();
    return check_exit();
}
