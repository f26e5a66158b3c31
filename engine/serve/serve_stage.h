/*
 * serve_stage.h - one pipeline rank of glmspark-engine: the backend, this rank's layers of
 * the split, its KV cache and its pipeline stage (engine/serve/main_engine.c drives them).
 *
 * Every rank computes the same split (pp_plan_model over the checkpoint, balancing weights
 * plus KV bytes at the cache's context), loads only its layer range (model_load with
 * first/last layer: only the shards holding them are opened; ckpt_touch reads them now,
 * with progress in the log), sizes its KV cache identically (kv_blocks, or max_model_len /
 * block_size, else the model's context capped at 32768) and connects (pp_stage_create)
 * with a handshake hash over the config, the split and the cache's shape, so ranks started
 * with different settings refuse each other. kv_cache_dtype: unset is f32 (fp8 and bf16 on
 * either backend, engine/model/kv_cache.h); backend cuda needs a CUDA build.
 *
 * Ownership: ServeStage owns everything in it; serve_stage_free releases it.
 * Threads:   one thread.
 * Errors:    serve_stage_load: what config_load, pp_plan_model, model_load, kv_init return,
 *            ERR_INVAL for a recipe value this build cannot serve (logged, naming the key).
 *            serve_stage_connect: what pp_stage_create returns.
 */
#ifndef ENGINE_SERVE_SERVE_STAGE_H
#define ENGINE_SERVE_SERVE_STAGE_H

#include "engine/model/backend.h"
#include "engine/model/config.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/pipeline/pp.h"
#include "engine/serve/recipe.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ServeStage {
    Backend *be;
    Model model;
    KvCache kv;
    ModelConfig *cfg;
    PpPlan plan;  // the split, the same on every rank
    PpStage *stage;
    int mtp_tokens;  // MTP drafts per step (recipe mtp_tokens; in the handshake's hash)
} ServeStage;

// Load rank `rank` of `world` from model_dir with the recipe's settings; local_rank picks
// the GPU of the cuda backend. On failure the caller still calls serve_stage_free.
Err serve_stage_load(ServeStage *s, const Recipe *r, const char *model_dir, int local_rank,
                     int rank, int world);

// Join the pipeline (master: rank 0's HOST:PORT; ignored when world == 1).
Err serve_stage_connect(ServeStage *s, int rank, int world, const char *master);

// Release everything; zeroes *s. Safe on a zeroed ServeStage.
void serve_stage_free(ServeStage *s);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SERVE_SERVE_STAGE_H
