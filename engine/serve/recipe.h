/*
 * recipe.h - the deployment recipe: one file of `key = value` lines that says how a model is
 * served (the files in ops/recipes/), read by glmspark-engine (--recipe FILE) and, through
 * `glmspark-engine --check-recipe`, by ops/launch-cluster.sh.
 *
 * Format: one setting per line, `key = value`; blank lines and lines starting with `#` are
 * ignored; a value may be wrapped in double quotes (no escapes) and ends at the line's end or
 * at ` #` (a comment). Every key is known (RECIPE_KEYS below); an unknown key, a repeated key,
 * a malformed line or a value out of range is an error whose message names the file, the
 * line and the key. Command-line flags override a recipe: the engine applies the recipe
 * first, then its flags (recipe_set() with origin "command line" validates them the same way).
 *
 * Keys and defaults (the vLLM names of the reference deployment where one exists):
 *   model                     checkpoint directory                  (none)
 *   model_name                name served on /v1/models             (the directory's name)
 *   tokenizer                 tokenizer.json                        (MODEL/tokenizer.json)
 *   pipeline_parallel         ranks, one per node, 1..8             1
 *   tensor_parallel           1 (a DGX Spark has one GPU)           1
 *   gpu_memory_utilization    fraction of a node's memory, (0, 1]   0.85
 *   max_model_len             context positions, >= 1               262144
 *   kv_cache_dtype            fp8 | bf16 | f32                      fp8
 *   block_size                KV block positions, power of two      128
 *   max_num_seqs              concurrent sequences, >= 1            1
 *   max_num_batched_tokens    prefill chunk, >= 1                   2048
 *   threads                   CPU threads per rank, >= 1            2
 *   kv_blocks                 KV blocks (0: from max_model_len)     0
 *   lease_s                   job lease seconds, >= 1               60
 *   master_port               rank 0's pipeline port, 1..65535      29500
 *   load_timeout_s            launcher's readiness limit, >= 1      3600
 *   min_free_memory_gb        launcher's per-node check, >= 0       0
 *   backend                   cpu | cuda (ops of every rank)        cpu
 *   precision                 default | f32 | bf16 (docs/precision.md) default
 *   mtp_tokens                MTP drafts per step, 0..8 (0: off)    0
 *   prefix_caching            reuse cached prompt prefixes, 0 | 1   1
 *   commit_interval_ms        least ms between output commits,      0
 *                             0..10000 (0: after every step)
 *
 * Who reads what: glmspark-engine applies model, model_name, tokenizer, threads, kv_blocks,
 * lease_s, commit_interval_ms, max_model_len and block_size (the KV cache size), pipeline_parallel (ranks;
 * --pp/--world override), max_num_seqs,
 * max_num_batched_tokens, prefix_caching and mtp_tokens (the scheduler; mtp_tokens > 0 loads the model's MTP
 * layer on the last rank and is an error for a model without one), backend, precision and
 * kv_cache_dtype (engine/model/kv_cache.h's storage types, on either backend; unset: f32);
 * ops/launch-cluster.sh uses pipeline_parallel (must equal the node count), master_port,
 * load_timeout_s, min_free_memory_gb and model. tensor_parallel (1) and
 * gpu_memory_utilization are validated only: the engine sizes its KV cache from kv_blocks
 * or max_model_len (`glmspark inspect --pp N --mem M` shows what a node's memory holds).
 *
 * Ownership: Recipe is plain data (fixed-size strings); copy it freely.
 * Threads:   functions are reentrant.
 * Errors:    ERR_IO when the file cannot be read, ERR_FORMAT for a malformed line, ERR_INVAL
 *            for an unknown key, a repeated key or a bad value; logged once, naming the key.
 */
#ifndef ENGINE_SERVE_RECIPE_H
#define ENGINE_SERVE_RECIPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/model/kv_cache.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
    RECIPE_MAX_STR = 1024,  // longest string value, NUL included
    RECIPE_MAX_WORLD = 8,
};

typedef enum RecipeBackend {
    RECIPE_BACKEND_CPU,
    RECIPE_BACKEND_CUDA,
} RecipeBackend;

typedef struct Recipe {
    char model[RECIPE_MAX_STR];       // "" when unset
    char model_name[RECIPE_MAX_STR];  // "" when unset
    char tokenizer[RECIPE_MAX_STR];   // "" when unset
    int pipeline_parallel;
    int tensor_parallel;
    double gpu_memory_utilization;
    int max_model_len;
    KvDtype kv_cache_dtype;  // engine/model/kv_cache.h's storage types
    int block_size;
    int max_num_seqs;
    int max_num_batched_tokens;
    int commit_interval_ms;
    int mtp_tokens;  // MTP drafts per verify step (0: off)
    int prefix_caching;  // 1: reuse the KV of cached prompt prefixes (scheduler.h); 0: off
    int threads;
    int kv_blocks;
    int lease_s;
    int master_port;
    int load_timeout_s;
    double min_free_memory_gb;
    RecipeBackend backend;
    int precision;      // BACKEND_PRECISION_DEFAULT, _F32 or _BF16 (backends.h, docs/precision.md)
    uint64_t set_mask;  // bit i: key i of recipe_key_name() was set (by a file or a flag)
} Recipe;

// The defaults listed above.
void recipe_defaults(Recipe *r);

// Parse text[0..len) (need not be NUL-terminated) on top of *r (start from
// recipe_defaults()). origin names the source in messages (a file name). On error *r may
// be partly updated; discard it.
Err recipe_parse(Recipe *r, const char *text, size_t len, const char *origin);

// Read and parse a file.
Err recipe_load(Recipe *r, const char *path);

// Set one key from a string, validated as in a file (a repeat is allowed here: flags
// override). origin names the source in messages ("command line").
Err recipe_set(Recipe *r, const char *key, const char *value, const char *origin);

// Key i's name (0 <= i < recipe_n_keys()), NULL when out of range.
const char *recipe_key_name(int i);
int recipe_n_keys(void);

// Key i's current value as text, in the file syntax (recipe_parse reads it back to the same
// Recipe). buf of n bytes; returns buf.
char *recipe_format_value(const Recipe *r, int i, char *buf, size_t n);

// Whether key was set by a file or recipe_set() (false for unknown keys).
bool recipe_is_set(const Recipe *r, const char *key);

// The backend's name ("cpu", "cuda").
const char *recipe_backend_name(RecipeBackend b);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SERVE_RECIPE_H
