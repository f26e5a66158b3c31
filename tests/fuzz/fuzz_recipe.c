/*
 * fuzz_recipe.c - recipe_parse on arbitrary bytes.
 *
 * Invariants of an accepted recipe (abort on violation): every numeric field within its
 * documented range, block_size a power of two, strings NUL-terminated without quotes or
 * control characters, and formatting every set key and parsing the result again gives the
 * same Recipe.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/serve/recipe.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_str(const char *s)
{
    const size_t n = strnlen(s, RECIPE_MAX_STR);
    ASSERT(n < RECIPE_MAX_STR);
    for (size_t i = 0; i < n; i++) ASSERT((unsigned char) s[i] >= 0x20 && s[i] != '"');
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    Recipe *r = malloc(sizeof *r), *back = malloc(sizeof *back);
    char *text = malloc((size_t) recipe_n_keys() * (RECIPE_MAX_STR + 64));
    if (!r || !back || !text) goto done;
    recipe_defaults(r);
    if (recipe_parse(r, (const char *) data, size, "fuzz") != ERR_OK) goto done;
    ASSERT(r->pipeline_parallel >= 1 && r->pipeline_parallel <= RECIPE_MAX_WORLD);
    ASSERT(r->tensor_parallel == 1);
    ASSERT(r->gpu_memory_utilization > 0 && r->gpu_memory_utilization <= 1);
    ASSERT(r->max_model_len >= 1 && r->max_num_seqs >= 1 && r->max_num_batched_tokens >= 1);
    ASSERT(r->block_size >= 1 && (r->block_size & (r->block_size - 1)) == 0);
    ASSERT(r->threads >= 1 && r->kv_blocks >= 0 && r->lease_s >= 1);
    ASSERT(r->master_port >= 1 && r->master_port <= 65535);
    ASSERT(r->kv_cache_dtype >= KV_DTYPE_F32 && r->kv_cache_dtype <= KV_DTYPE_FP8);
    ASSERT(r->backend == RECIPE_BACKEND_CPU || r->backend == RECIPE_BACKEND_CUDA);
    ASSERT(r->min_free_memory_gb >= 0);
    check_str(r->model);
    check_str(r->model_name);
    check_str(r->tokenizer);
    size_t len = 0;
    for (int i = 0; i < recipe_n_keys(); i++) {
        if (!(r->set_mask & (UINT64_C(1) << i))) continue;
        char v[RECIPE_MAX_STR + 8];
        recipe_format_value(r, i, v, sizeof v);
        len += (size_t) sprintf(text + len, "%s = %s\n", recipe_key_name(i), v);
    }
    recipe_defaults(back);
    ASSERT(recipe_parse(back, text, len, "fuzz round trip") == ERR_OK);
    ASSERT(back->set_mask == r->set_mask);
    ASSERT(!memcmp(r, back, sizeof *r));
done:
    free(r);
    free(back);
    free(text);
    return 0;
}
