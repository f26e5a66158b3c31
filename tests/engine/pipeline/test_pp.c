/*
 * test_pp.c - the pipeline's pieces that need no second process: the split planner
 * (small exact cases and a GLM-5.2-REAP-shaped config: 78 layers, 156 experts, NVFP4,
 * three 121 GiB ranks), byte-size parsing, the batched forward (several sequences in one
 * call equal each run alone, bit for bit) and a model cut into three stages chained
 * through their activation blobs (equal to the whole model, bit for bit, with stages that
 * start on shared DSA layers so the selection hand-off is exercised).
 *
 * The model is tests/golden/models/dsa_modelopt (5 layers: indexer full, shared, full,
 * shared, shared; dense, dense, MoE x3), found through GLMSPARK_SOURCE_DIR. Equality is
 * exact because every op computes each token's values independently of the others
 * (backend_cpu.c), which is what makes batching and splitting invisible in the output.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/pipeline/pp.h"
#include "engine/shared/err.h"
#include "tests/check.h"

static char model_dir[1024];

// ---------------------------------------------------------------------------
// Planner

static void test_plan_small(void)
{
    uint64_t layers[6] = {10, 10, 10, 10, 10, 10};
    PpPlanInput in = {.world = 3,
                      .n_layers = 6,
                      .layer_bytes = layers,
                      .mem_bytes = 1000,
                      .mem_utilization = 1.0};
    PpPlan plan;
    CHECK(pp_plan(&in, &plan) == ERR_OK);
    for (int r = 0; r < 3; r++) {
        CHECK(plan.ranks[r].first_layer == 2 * r && plan.ranks[r].last_layer == 2 * r + 2);
        CHECK(plan.ranks[r].weight_bytes == 20);
        CHECK(plan.ranks[r].kv_room_bytes == 980);
    }
    CHECK(plan.fits);

    // Embeddings on rank 0 worth two layers: rank 0 takes fewer layers, the largest rank
    // holds 30 bytes (the optimum: 20 + 10 | 10 10 10 | 10 10 or 20 + 10 | 10 10 | 10 10 10).
    in.first_bytes = 20;
    CHECK(pp_plan(&in, &plan) == ERR_OK);
    CHECK(plan.ranks[0].first_layer == 0 && plan.ranks[0].last_layer == 1);
    uint64_t worst = 0;
    for (int r = 0; r < 3; r++)
        worst = plan.ranks[r].weight_bytes > worst ? plan.ranks[r].weight_bytes : worst;
    CHECK(worst == 30);
    CHECK(plan.ranks[2].last_layer == 6);

    // KV: 1 byte per token per layer at context 100 on a 100-byte budget does not fit a
    // two-layer rank (20 weights + 200 KV); the longest context is what is left / 2.
    in.first_bytes = 0;
    in.kv_bytes_per_token_layer = 1;
    in.context = 100;
    in.mem_bytes = 100;
    CHECK(pp_plan(&in, &plan) == ERR_OK);
    CHECK(!plan.fits);
    CHECK(plan.ranks[1].max_context == 40);

    in.world = 7;
    CHECK(pp_plan(&in, &plan) == ERR_INVAL);
    in.world = 0;
    CHECK(pp_plan(&in, &plan) == ERR_INVAL);
}

// GLM-5.2-NVFP4-REAP-469B's shapes (config.json of the published checkpoint): the reference
// deployment splits it 26/27/26 layers (83.9/90.3/92.1 GiB) over three 121 GB DGX Sparks.
// Balancing bytes instead of layer counts gives rank 0 (three light dense layers plus the
// embeddings) a couple more layers and the last rank (lm_head, MTP) a couple fewer, with
// all three within ~2 GiB of each other (28/26/24, 89.8/89.2/87.7 GiB): the same
// 26-ish layers a rank, tighter in bytes than the reference's 8 GiB spread.
static void test_plan_reap(void)
{
    ModelConfig c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 154880;
    c.hidden_size = 6144;
    c.n_layers = 78;
    c.n_mtp_layers = 1;
    c.n_heads = 64;
    c.q_lora_rank = 2048;
    c.kv_lora_rank = 512;
    c.qk_nope_head_dim = 192;
    c.qk_rope_head_dim = 64;
    c.v_head_dim = 256;
    c.index_n_heads = 32;
    c.index_head_dim = 128;
    c.index_topk = 2048;
    c.intermediate_size = 12288;
    c.moe_intermediate_size = 2048;
    c.n_routed_experts = 156;
    c.n_shared_experts = 1;
    c.n_experts_per_tok = 8;
    c.quant = CONFIG_QUANT_NVFP4_MODELOPT;
    for (int l = 0; l < 79; l++) {
        c.mlp[l] = l < 3 ? CONFIG_MLP_DENSE : CONFIG_MLP_MOE;
        c.indexer[l] = CONFIG_INDEXER_FULL;
    }
    uint64_t layers[78], total = 0;
    for (int l = 0; l < 78; l++)
        total += layers[l] = pp_estimate_layer_bytes(&c, l);
    const uint64_t embed = pp_estimate_embed_bytes(&c);
    const uint64_t head = embed + pp_estimate_layer_bytes(&c, 78) + 2ull * 6144 * 6144 * 2;
    total += embed + head;
    // ~287 GB in all (the figure for the checkpoint).
    CHECK(total > 270e9 && total < 300e9);
    uint64_t mem;
    CHECK(pp_parse_bytes("121G", &mem) && mem == 121ull << 30);
    // fp8_ds_mla's 656 bytes (512 E4M3 + 4 fp32 scales + 64 bf16) + the indexer key's 132.
    CHECK(pp_kv_bytes_per_token_layer(&c, KV_DTYPE_FP8) == 656 + 132);
    CHECK(pp_kv_bytes_per_token_layer(&c, KV_DTYPE_BF16) == 2 * (512 + 64 + 128));
    const PpPlanInput in = {
        .world = 3,
        .n_layers = 78,
        .layer_bytes = layers,
        .first_bytes = embed,
        .last_bytes = head,
        .kv_bytes_per_token_layer = pp_kv_bytes_per_token_layer(&c, KV_DTYPE_FP8),
        .context = 202752,
        .mem_bytes = mem,
        .mem_utilization = 0.9,
    };
    PpPlan plan;
    CHECK(pp_plan(&in, &plan) == ERR_OK);
    CHECK(plan.fits);
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int r = 0; r < 3; r++) {
        const PpRankPlan *p = &plan.ranks[r];
        const int n = p->last_layer - p->first_layer;
        printf("reap rank %d: layers [%d, %d) = %d, %.1f GiB, kv room %.1f GiB, context %lld\n", r,
               p->first_layer, p->last_layer, n, p->weight_bytes / 1073741824.0,
               p->kv_room_bytes / 1073741824.0, (long long) p->max_context);
        CHECK(n >= 24 && n <= 28);
        CHECK(p->max_context >= 202752);
        lo = p->weight_bytes < lo ? p->weight_bytes : lo;
        hi = p->weight_bytes > hi ? p->weight_bytes : hi;
    }
    CHECK(plan.ranks[0].first_layer == 0 && plan.ranks[2].last_layer == 78);
    CHECK(plan.ranks[0].last_layer == plan.ranks[1].first_layer);
    CHECK(plan.ranks[1].last_layer == plan.ranks[2].first_layer);
    CHECK((double) hi / (double) lo < 1.04);  // balanced within a layer's worth
    CHECK(plan.ranks[0].last_layer >= 26 && plan.ranks[2].first_layer <= 54);
    // Half the memory cannot hold a third of the model.
    PpPlanInput small = in;
    small.mem_bytes = mem / 2;
    CHECK(pp_plan(&small, &plan) == ERR_OK && !plan.fits);
}

static void test_parse_bytes(void)
{
    uint64_t v;
    CHECK(pp_parse_bytes("1000", &v) && v == 1000);
    CHECK(pp_parse_bytes("64GiB", &v) && v == 64ull << 30);
    CHECK(pp_parse_bytes("1.5M", &v) && v == 3ull << 19);
    CHECK(!pp_parse_bytes("", &v));
    CHECK(!pp_parse_bytes("12X", &v));
    CHECK(!pp_parse_bytes("-5G", &v));
    CHECK(!pp_parse_bytes("5Gx", &v));
    char addr[64];
    int port;
    CHECK(pp_comm_parse_addr("127.0.0.1:29500", addr, sizeof addr, &port));
    CHECK(strcmp(addr, "127.0.0.1") == 0 && port == 29500);
    CHECK(!pp_comm_parse_addr("127.0.0.1", addr, sizeof addr, &port));
    CHECK(!pp_comm_parse_addr("host:0", addr, sizeof addr, &port));
    CHECK(!pp_comm_parse_addr(":80", addr, sizeof addr, &port));
}

// Every launcher's rank and world variables unset.
static void unset_rank_env(void)
{
    unsetenv("OMPI_COMM_WORLD_RANK");
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("PMI_RANK");
    unsetenv("PMI_SIZE");
    unsetenv("SLURM_PROCID");
    unsetenv("SLURM_NTASKS");
}

// Rank and world from each launcher's variables; a bad pair is refused.
static void test_rank_env(void)
{
    int rank = -1, world = -1;
    unset_rank_env();
    CHECK(!pp_rank_from_env(&rank, &world));
    setenv("SLURM_PROCID", "2", 1);
    setenv("SLURM_NTASKS", "3", 1);
    CHECK(pp_rank_from_env(&rank, &world) && rank == 2 && world == 3);
    setenv("PMI_RANK", "1", 1);
    setenv("PMI_SIZE", "4", 1);
    CHECK(pp_rank_from_env(&rank, &world) && rank == 1 && world == 4);  // PMI before SLURM
    setenv("OMPI_COMM_WORLD_RANK", "0", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    CHECK(pp_rank_from_env(&rank, &world) && rank == 0 && world == 2);
    setenv("OMPI_COMM_WORLD_RANK", "5", 1);  // rank >= world
    CHECK(!pp_rank_from_env(&rank, &world));
    setenv("OMPI_COMM_WORLD_RANK", "x", 1);
    CHECK(!pp_rank_from_env(&rank, &world));
    unset_rank_env();
}

// ---------------------------------------------------------------------------
// Batched forward and stages

static const int toks_a[7] = {88, 64, 203, 76, 229, 208, 179};
static const int toks_b[5] = {112, 14, 190, 203, 165};

static void test_batch_equals_alone(void)
{
    Backend *be;
    Model m;
    KvCache kv;
    ASSERT(backend_cpu_create(1, &be) == ERR_OK);
    ASSERT(model_load(&m, model_dir, NULL, be) == ERR_OK);
    const KvCacheParams p = model_kv_params(&m, 32, 4);
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    const size_t V = (size_t) m.cfg.vocab_size;
    float *alone = malloc(4 * V * sizeof *alone), *batch = malloc(12 * V * sizeof *batch);
    ASSERT(alone && batch);

    KvSeq a = {0}, b = {0}, a2 = {0}, b2 = {0};
    CHECK(model_forward(&m, &kv, &a, toks_a, 7, alone, false) == ERR_OK);
    CHECK(model_forward(&m, &kv, &b, toks_b, 5, alone + V, false) == ERR_OK);
    const int next[2] = {17, 42};
    CHECK(model_forward(&m, &kv, &a, &next[0], 1, alone + 2 * V, false) == ERR_OK);
    CHECK(model_forward(&m, &kv, &b, &next[1], 1, alone + 3 * V, false) == ERR_OK);

    // The same work as two batched calls: prefill both, then decode both.
    KvSeq *seqs[2] = {&a2, &b2};
    int both[12];
    memcpy(both, toks_a, sizeof toks_a);
    memcpy(both + 7, toks_b, sizeof toks_b);
    const int n_pre[2] = {7, 5}, n_dec[2] = {1, 1};
    const ModelBatch pre = {2, seqs, n_pre}, dec = {2, seqs, n_dec};
    CHECK(model_forward_batch(&m, &kv, &pre, both, NULL, NULL, batch, MODEL_LOGITS_LAST) == ERR_OK);
    CHECK(memcmp(batch, alone, 2 * V * sizeof(float)) == 0);
    CHECK(a2.n_tokens == 7 && b2.n_tokens == 5);
    CHECK(model_forward_batch(&m, &kv, &dec, next, NULL, NULL, batch, MODEL_LOGITS_LAST) == ERR_OK);
    CHECK(memcmp(batch, alone + 2 * V, 2 * V * sizeof(float)) == 0);

    // A mixed batch (one decode + one prefill) with all logits: rows equal the lone runs.
    KvSeq c = {0}, d = {0}, e = {0};
    float *ref = malloc(6 * V * sizeof *ref);
    ASSERT(ref);
    CHECK(model_forward(&m, &kv, &c, toks_a, 6, ref, false) == ERR_OK);
    CHECK(model_forward(&m, &kv, &c, toks_a + 6, 1, ref, true) == ERR_OK);
    CHECK(model_forward(&m, &kv, &e, toks_b, 5, ref + V, true) == ERR_OK);
    KvSeq f = {0};
    CHECK(model_forward(&m, &kv, &f, toks_a, 6, batch, false) == ERR_OK);
    KvSeq *mixed[2] = {&f, &d};
    const int n_mixed[2] = {1, 5};
    int mixed_toks[6] = {toks_a[6]};
    memcpy(mixed_toks + 1, toks_b, sizeof toks_b);
    const ModelBatch mb = {2, mixed, n_mixed};
    CHECK(model_forward_batch(&m, &kv, &mb, mixed_toks, NULL, NULL, batch, MODEL_LOGITS_ALL)
          == ERR_OK);
    CHECK(memcmp(batch, ref, V * sizeof(float)) == 0);
    CHECK(memcmp(batch + V, ref + V, 5 * V * sizeof(float)) == 0);

    KvSeq *all[] = {&a, &b, &a2, &b2, &c, &d, &e, &f};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        kv_seq_free(&kv, all[i]);
    CHECK(kv_n_free_blocks(&kv) == 32);
    free(ref);
    free(alone);
    free(batch);
    kv_free(&kv);
    model_free(&m);
    be->destroy(be);
}

// The model as three stages [0,1) [1,3) [3,5), each with its own cache, chained through
// the activation blobs: prefill then two decode steps equal the whole model bit for bit.
static void test_stages_chain(void)
{
    Backend *be;
    ASSERT(backend_cpu_create(1, &be) == ERR_OK);
    Model whole, st[3];
    KvCache kv_whole, kv[3];
    ASSERT(model_load(&whole, model_dir, NULL, be) == ERR_OK);
    KvCacheParams p = model_kv_params(&whole, 8, 4);
    ASSERT(kv_init(&kv_whole, &p) == ERR_OK);
    const int range[4] = {0, 1, 3, 5};
    for (int s = 0; s < 3; s++) {
        const ModelOptions o = {.first_layer = range[s], .last_layer = range[s + 1]};
        CHECK(model_load(&st[s], model_dir, &o, be) == ERR_OK);
        CHECK(st[s].has_embed == (s == 0) && st[s].has_head == (s == 2));
        p = model_kv_params(&st[s], 8, 4);
        CHECK(p.n_layers == range[s + 1] - range[s]);
        ASSERT(kv_init(&kv[s], &p) == ERR_OK);
    }
    // Stage 1 maps fewer bytes than the whole model: it opened only its tensors.
    CHECK(st[1].ckpt.n_tensors < whole.ckpt.n_tensors);
    const size_t V = (size_t) whole.cfg.vocab_size;
    float *ref = malloc(7 * V * sizeof *ref), *got = malloc(7 * V * sizeof *got);
    void *act1 = malloc(model_act_bytes(&whole, 7)), *act2 = malloc(model_act_bytes(&whole, 7));
    ASSERT(ref && got && act1 && act2);
    KvSeq sw = {0}, ss[3] = {{0}};
    int n = 7;
    const int *toks = toks_a;
    for (int step = 0; step < 3; step++) {
        CHECK(model_forward(&whole, &kv_whole, &sw, toks, n, ref, true) == ERR_OK);
        KvSeq *s0[1] = {&ss[0]}, *s1[1] = {&ss[1]}, *s2[1] = {&ss[2]};
        const ModelBatch b0 = {1, s0, &n}, b1 = {1, s1, &n}, b2 = {1, s2, &n};
        CHECK(model_forward_batch(&st[0], &kv[0], &b0, toks, NULL, act1, NULL, MODEL_LOGITS_NONE)
              == ERR_OK);
        CHECK(model_forward_batch(&st[1], &kv[1], &b1, NULL, act1, act2, NULL, MODEL_LOGITS_NONE)
              == ERR_OK);
        CHECK(model_forward_batch(&st[2], &kv[2], &b2, NULL, act2, NULL, got, MODEL_LOGITS_ALL)
              == ERR_OK);
        CHECK(memcmp(got, ref, (size_t) n * V * sizeof(float)) == 0);
        toks = toks_b + step;
        n = 1;
    }
    for (int s = 0; s < 3; s++) {
        kv_seq_free(&kv[s], &ss[s]);
        kv_free(&kv[s]);
        model_free(&st[s]);
    }
    // A range outside the model is refused.
    const ModelOptions bad = {.first_layer = 3, .last_layer = 9};
    Model mb;
    CHECK(model_load(&mb, model_dir, &bad, be) == ERR_INVAL);
    kv_seq_free(&kv_whole, &sw);
    kv_free(&kv_whole);
    model_free(&whole);
    free(ref);
    free(got);
    free(act1);
    free(act2);
    be->destroy(be);
}

int main(void)
{
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    snprintf(model_dir, sizeof model_dir, "%s/tests/golden/models/dsa_modelopt", src ? src : ".");
    test_plan_small();
    test_plan_reap();
    test_parse_bytes();
    test_rank_env();
    test_batch_equals_alone();
    test_stages_chain();
    return check_exit();
}
