/*
 * serve_stage.c - one pipeline rank of glmspark-engine: backend, layers, KV cache, stage
 * (serve_stage.h).
 */
#include "engine/serve/serve_stage.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/backend/backends.h"
#include "engine/shared/clock.h"

Err serve_stage_load(ServeStage *e, const Recipe *r, const char *model_dir, int local_rank,
                     int rank, int world)
{
    Err err = ERR_NOMEM;
    if (!(e->cfg = malloc(sizeof *e->cfg))) return err;
    if ((err = config_load(e->cfg, model_dir))) return err;
    KvDtype dtype = r->kv_cache_dtype;
    const int block = recipe_is_set(r, "block_size") ? r->block_size : KV_DEFAULT_BLOCK_SIZE;
    if (!backend_kind_check("glmspark-engine", r->backend == RECIPE_BACKEND_CUDA, r->precision,
                            recipe_is_set(r, "kv_cache_dtype"), &dtype, block))
        return ERR_INVAL;
    int kv_blocks = r->kv_blocks;
    if (kv_blocks <= 0) {
        int ctx = e->cfg->max_position_embeddings;
        if (ctx <= 0 || ctx > 32768) ctx = 32768;
        if (recipe_is_set(r, "max_model_len")) ctx = r->max_model_len;
        kv_blocks = (ctx + block - 1) / block;
    }
    // Memory is not the constraint on the CPU: balance bytes (weights + KV at the context).
    if ((err = pp_plan_model(model_dir, e->cfg, world, UINT64_C(1) << 60, 1.0, kv_blocks * block,
                             dtype, &e->plan)))
        return err;
    const PpRankPlan *mine = &e->plan.ranks[rank];
    if (r->mtp_tokens > 0 && e->cfg->n_mtp_layers < 1) {
        LOG_ERROR("mtp_tokens = %d: the model in \"%s\" has no MTP layer "
                  "(num_nextn_predict_layers 0)",
                  r->mtp_tokens, model_dir);
        return ERR_INVAL;
    }
    e->mtp_tokens = r->mtp_tokens;
    const ModelOptions mo = {.load_mtp = r->mtp_tokens > 0,
                             .first_layer = mine->first_layer,
                             .last_layer = mine->last_layer};
    const double t0 = clock_now_s();
    if ((err = backend_open(r->backend == RECIPE_BACKEND_CUDA, r->threads, local_rank, r->precision,
                            &e->be))
        || (err = model_load(&e->model, model_dir, &mo, e->be))) {
        fprintf(stderr, "glmspark-engine: could not load the model in \"%s\"\n", model_dir);
        return err;
    }
    CkptTouchStats touch;  // read the weights now, with progress in the log
    ckpt_touch(&e->model.ckpt, &touch);
    KvCacheParams kp = model_kv_params(&e->model, kv_blocks, block);
    kp.dtype = dtype;
    if ((err = kv_init(&e->kv, &kp))) {
        fprintf(stderr, "glmspark-engine: could not allocate the KV cache (%d blocks)\n",
                kv_blocks);
        return err;
    }
    LOG_INFO("engine rank %d of %d: layers [%d, %d), %.3f GB of weights, %d KV blocks of %d (%s), "
             "loaded in %.3f s",
             rank, world, mine->first_layer, mine->last_layer, mine->weight_bytes / 1e9, kv_blocks,
             block, kv_dtype_name(dtype), clock_now_s() - t0);
    return ERR_OK;
}

Err serve_stage_connect(ServeStage *e, int rank, int world, const char *master)
{
    const uint64_t extra = (uint64_t) e->mtp_tokens << 56 ^ (uint64_t) e->kv.params.n_blocks << 24
                           ^ (uint64_t) e->kv.params.block_size << 4
                           ^ (uint64_t) e->kv.params.dtype;
    return pp_stage_create(&e->model, &e->kv, rank, world, world > 1 ? master : NULL,
                           pp_plan_hash(e->cfg, &e->plan, extra), &e->stage);
}

void serve_stage_free(ServeStage *e)
{
    pp_stage_destroy(e->stage);
    kv_free(&e->kv);
    model_free(&e->model);
    if (e->be) e->be->destroy(e->be);
    free(e->cfg);
    memset(e, 0, sizeof *e);
}
