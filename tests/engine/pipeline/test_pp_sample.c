/*
 * test_pp_sample.c - the last rank samples a step's sequences on a thread pool (pp.c): the
 * tokens are those of sampling each sequence alone, in op order, and do not depend on the
 * number of threads.
 *
 * One stage (world 1) of tests/golden/models/dsa_modelopt (256-token vocabulary, found
 * through GLMSPARK_SOURCE_DIR) runs 8 sequences for 6 steps: a prefill of 3-8 tokens, then
 * one token a step, each op sampling with its own parameters (greedy, temperature, top-k,
 * top-p, min-p, penalties) and some with a vocabulary mask. Every op asks for its logits
 * (PP_SEQ_LOGITS returns them before the penalties and the mask), so the test repeats the
 * sampling itself with one Sampler per sequence: penalties over the tokens fed so far, the
 * mask, the draw. The vocabulary is under the pool's threshold, so GLMSPARK_SAMPLE_THREADS
 * sets the pool's size: 1 (everything on the calling thread), 2 and 5 (with fewer rows drawing
 * over the whole softmax than threads, each such row's weights are split into chunks).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/model/sampler.h"
#include "engine/pipeline/pp.h"
#include "engine/shared/err.h"
#include "tests/check.h"

enum { N_SEQ = 8, N_STEPS = 6, MAX_TOKENS = 8 + N_STEPS };

static char model_dir[1024];

static SamplerParams seq_params(int i)
{
    SamplerParams p = sampler_default_params();
    p.seed = 1000 + (uint64_t) i;
    switch (i) {
    case 0:
        break;  // greedy
    case 1:
        p.temperature = 1.0f;
        break;
    case 2:
        p.temperature = 0.7f;
        p.top_p = 0.9f;
        break;
    case 3:
        p.temperature = 1.3f;
        p.top_k = 20;
        break;
    case 4:
        p.temperature = 1.0f;
        p.min_p = 0.05f;
        break;
    case 5:
        p.temperature = 0.8f;
        p.top_p = 0.95f;
        p.repetition_penalty = 1.3f;
        p.presence_penalty = 0.5f;
        p.frequency_penalty = 0.2f;
        break;
    case 6:
        p.temperature = 1.0f;
        p.top_k = 200;
        p.top_p = 0.8f;
        break;
    default:
        p.temperature = 2.0f;
        p.repetition_penalty = 1.5f;
        break;
    }
    return p;
}

// Sequence i's mask in a step (bit id % 32 of word id / 32 allows id), or false when its op
// carries none: sequences 1, 5 and 7 are masked every other step.
static bool seq_mask(int i, int step, uint32_t *words, int n_words)
{
    if (!((i == 1 || i == 5 || i == 7) && step % 2 == 0)) return false;
    uint64_t r = 77 + (uint64_t) (i * 31 + step);
    for (int w = 0; w < n_words; w++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        words[w] = (uint32_t) (r >> 32) & (uint32_t) (r >> 7);  // about a quarter allowed
    }
    words[0] |= 1u << (step + i);  // never empty
    return true;
}

// Runs the 8 sequences through a stage with the sampling pool at n_threads, and checks
// each sampled token against sampling alone. out[step][seq]: the tokens. Returns how many
// sampled tokens were not their row's largest logit (draws, not greedy picks).
static int run(Model *m, int n_threads, int32_t out[N_STEPS][N_SEQ])
{
    char env[16];
    snprintf(env, sizeof env, "%d", n_threads);
    setenv("GLMSPARK_SAMPLE_THREADS", env, 1);
    const KvCacheParams kp = model_kv_params(m, 64, 4);
    KvCache kv;
    ASSERT(kv_init(&kv, &kp) == ERR_OK);
    PpStage *stage;
    ASSERT(pp_stage_create(m, &kv, 0, 1, NULL, 0, &stage) == ERR_OK);
    unsetenv("GLMSPARK_SAMPLE_THREADS");

    const int V = m->cfg.vocab_size, n_words = pp_mask_words(stage);
    Sampler ref[N_SEQ];
    int32_t hist[N_SEQ][MAX_TOKENS];
    int n_hist[N_SEQ] = {0};
    float *row = malloc((size_t) V * sizeof *row);
    int32_t *tokens = malloc((size_t) (N_SEQ * 8 + N_SEQ * n_words) * sizeof *tokens);
    ASSERT(row && tokens);
    for (int i = 0; i < N_SEQ; i++)
        ASSERT(sampler_init(&ref[i], V, seq_params(i)) == ERR_OK);

    int n_bad = 0, n_drawn = 0;
    for (int step = 0; step < N_STEPS; step++) {
        PpSeqOp ops[N_SEQ];
        int n_tokens = 0;
        for (int i = 0; i < N_SEQ; i++) {
            const int n_new = step == 0 ? 3 + i % 6 : 1;
            ops[i] = (PpSeqOp){.slot = 2 * i + 1,
                               .n_new = n_new,
                               .flags = PP_SEQ_SAMPLE | PP_SEQ_LOGITS,
                               .params = seq_params(i)};
            if (step == 0) ops[i].flags |= PP_SEQ_START;
            if (step == N_STEPS - 1) ops[i].flags |= PP_SEQ_FREE;
            for (int t = 0; t < n_new; t++) {
                const int32_t id = step == 0 ? (17 * i + 5 * t + 3) % V : out[step - 1][i];
                tokens[n_tokens++] = id;
                hist[i][n_hist[i]++] = id;
            }
        }
        int n_extra = 0;
        for (int i = 0; i < N_SEQ; i++)
            if (seq_mask(i, step, (uint32_t *) (tokens + n_tokens + n_extra), n_words)) {
                ops[i].flags |= PP_SEQ_MASK;
                n_extra += n_words;
            }
        ASSERT(pp_submit(stage, ops, N_SEQ, tokens) == ERR_OK);
        PpResult res;
        ASSERT(pp_collect(stage, &res) == ERR_OK);
        ASSERT(res.n_ops == N_SEQ);
        int r = 0;
        uint32_t *mask = malloc((size_t) n_words * sizeof *mask);
        ASSERT(mask);
        for (int i = 0; i < N_SEQ; i++) {
            r += ops[i].n_new;  // the op's last row is the one sampled
            memcpy(row, res.logits + (size_t) (r - 1) * (size_t) V, (size_t) V * sizeof *row);
            sampler_apply_penalties(&ref[i], row, hist[i], n_hist[i]);
            if (seq_mask(i, step, mask, n_words))
                for (int id = 0; id < V; id++)
                    if (!(mask[id >> 5] >> (id & 31) & 1)) row[id] = -INFINITY;
            int best = 0;
            for (int id = 1; id < V; id++)
                if (row[id] > row[best]) best = id;
            const int32_t want = sampler_sample(&ref[i], row);
            n_drawn += want != best;
            out[step][i] = res.tokens[i];
            if (res.tokens[i] != want && n_bad++ == 0)
                fprintf(stderr, "%d threads, step %d, sequence %d: token %d, alone %d\n", n_threads,
                        step, i, res.tokens[i], want);
        }
        free(mask);
    }
    CHECK(n_bad == 0);
    for (int i = 0; i < N_SEQ; i++)
        sampler_free(&ref[i]);
    free(row);
    free(tokens);
    pp_stage_destroy(stage);
    kv_free(&kv);
    return n_drawn;
}

// A masked op on a slot that drafts with MTP is refused (pp.c run_ops: the mask would be
// ignored and every later op would read the wrong one), and the stage goes on.
static void test_mask_with_mtp(Model *m)
{
    const KvCacheParams kp = model_kv_params(m, 16, 4);
    KvCache kv;
    ASSERT(kv_init(&kv, &kp) == ERR_OK);
    PpStage *stage;
    ASSERT(pp_stage_create(m, &kv, 0, 1, NULL, 0, &stage) == ERR_OK);
    const int n_words = pp_mask_words(stage);
    int32_t *tokens = calloc((size_t) (2 + n_words), sizeof *tokens);
    ASSERT(tokens);
    tokens[0] = 5;
    tokens[1] = 6;
    for (int w = 0; w < n_words; w++)
        tokens[2 + w] = -1;  // every id allowed
    PpSeqOp op = {.slot = 3,
                  .n_new = 2,
                  .flags = PP_SEQ_START | PP_SEQ_SAMPLE | PP_SEQ_MASK | PP_SEQ_FREE,
                  .mtp_k = 1,
                  .params = sampler_default_params()};
    PpResult res;
    Err err = pp_submit(stage, &op, 1, tokens);
    if (!err) err = pp_collect(stage, &res);
    CHECK(err == ERR_FORMAT);
    op.mtp_k = 0;  // the same op without drafts is served
    err = pp_submit(stage, &op, 1, tokens);
    if (!err) err = pp_collect(stage, &res);
    CHECK(err == ERR_OK && res.n_ops == 1 && res.tokens[0] >= 0);
    free(tokens);
    pp_stage_destroy(stage);
    kv_free(&kv);
}

int main(void)
{
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    snprintf(model_dir, sizeof model_dir, "%s/tests/golden/models/dsa_modelopt", src ? src : ".");
    Backend *be;
    Model m;
    ASSERT(backend_cpu_create(1, &be) == ERR_OK);
    ASSERT(model_load(&m, model_dir, NULL, be) == ERR_OK);
    int32_t one[N_STEPS][N_SEQ], two[N_STEPS][N_SEQ], five[N_STEPS][N_SEQ];
    // Most draws are not the largest logit (the test model's rows are nearly flat), so the
    // comparisons below see the generators, not just argmax.
    CHECK(run(&m, 1, one) > N_STEPS * N_SEQ / 4);
    run(&m, 2, two);
    run(&m, 5, five);
    CHECK(memcmp(one, two, sizeof one) == 0);
    CHECK(memcmp(one, five, sizeof one) == 0);
    test_mask_with_mtp(&m);
    model_free(&m);
    be->destroy(be);
    return check_exit();
}
