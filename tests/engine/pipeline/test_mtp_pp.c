/*
 * test_mtp_pp.c - MTP speculative decoding through the pipeline's stage runtime and the
 * scheduler (mtp.h MtpStage; pp.h PpSeqOp.mtp_k / n_draft / n_rollback; SchedParams.mtp_k).
 *
 * Reference: greedy decoding of each prompt alone with model_forward() and no MTP.
 *   - one stage, four concurrent requests (prompts of 1..20 tokens; a 4-token budget, so
 *     prompts are prefilled in chunks and drafts get cut by the budget), mtp_k 1..3, on
 *     the golden model mtp_theta and the mkmodel tiny preset: every request gets the
 *     reference tokens, with the MTP layer's own drafts (random weights: few accepted) and
 *     with a draft hook that proposes the true continuation except at chosen places, so
 *     drafts are accepted and rejected (every acceptance length is hit); every KV block
 *     comes back afterwards;
 *   - max_tokens, stop ids and cancel end a sequence exactly where the plain run does,
 *     with drafts in flight; a forced token (sched_force) voids the drafts it replaces;
 *   - a three-stage pipeline (ranks 1 and 2 in threads over loopback TCP, the MTP layer
 *     on rank 2) with the hook: reference tokens, drafts accepted and rejected, so the
 *     rollback travels to ranks 0 and 1 in the next op (a rank that kept a rejected
 *     position would shift every later position and change the output); the last rank's
 *     own positions are checked against its MTP cache at every draft;
 *   - a stage driven op by op: n_rollback lowers the slot's positions; drafts the stage
 *     did not propose, a rollback that is not what it rejected, MTP on a model without
 *     the layer and drafts on a slot without MTP are refused;
 *   - temperature 0.8: the same seed gives the same tokens twice, tokens in range;
 *   - temperature 1 on mkmodel tiny, 3000 requests (seeds) through the scheduler with
 *     mtp_k 2: the second generated token (the first a verify step emits) follows its exact
 *     marginal sum_y1 p(y1) p(y2 | y1) (chi-square, p = 1e-4), with drafts accepted.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/model/sampler.h"
#include "engine/pipeline/mtp.h"
#include "engine/pipeline/pp.h"
#include "engine/pipeline/scheduler.h"
#include "engine/shared/err.h"
#include "engine/tools/mkmodel.h"
#include "tests/check.h"
#include "tests/engine/pipeline/mtp_test_util.h"
#include "tests/engine/pipeline/pp_test_util.h"
#include "tests/engine/pipeline/sched_test_util.h"

enum { N_REQ = SCHED_TEST_N_REQ, MAX_TOK = 12, TRUTH = MAX_TOK + MTP_MAX_DRAFTS + 2, BLOCKS = 40 };

static char src_dir[1024];
static char tmp_root[512];

// truth[i]: prompt i, then its first TRUTH greedy tokens (model_forward alone).
static int32_t truth[N_REQ][20 + TRUTH];

static void make_truth(Model *m)
{
    const KvCacheParams p = model_kv_params(m, 16, 8);
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    for (int i = 0; i < N_REQ; i++) {
        const int n = sched_test_prompt_len[i];
        memcpy(truth[i], sched_test_prompts[i], (size_t) n * sizeof(int32_t));
        sched_test_greedy(m, &kv, sched_test_prompts[i], n, TRUTH, truth[i] + n);
    }
    kv_free(&kv);
}

// ---------------------------------------------------------------------------
// The draft hook: request i runs in slot i (admitted in order into free slots). Draft i of
// the slot proposes the token at position mseq.n_tokens + 1 (mtp.h: the MTP cache holds
// the committed positions, plus one per recursive draft), the truth except where
// (position * 7 + slot * 3 + i) % 5 == 0.

typedef struct Oracle {
    int V;
    PpStage *stage;  // the last stage, for its positions (NULL: not checked)
    int bad;         // inconsistencies seen (checked by the main thread)
    long calls;
} Oracle;

static int oracle_draft(void *user, int slot, int i, const float *mtp_logits)
{
    (void) mtp_logits;
    Oracle *o = user;
    o->calls++;
    MtpStage *ms = o->stage ? pp_mtp(o->stage) : NULL;
    if (slot < 0 || slot >= N_REQ || !ms) {
        o->bad++;
        return 0;
    }
    const MtpSlot *sl = &ms->slots[slot];
    // The main cache still holds the rejected positions (the next op drops them).
    if (pp_slot_positions(o->stage, slot) - sl->expect_rollback != sl->mseq.n_tokens - i) o->bad++;
    const int pos = sl->mseq.n_tokens + 1;
    if (pos >= sched_test_prompt_len[slot] + TRUTH) return 0;
    const int t = truth[slot][pos];
    return (pos * 7 + slot * 3 + i) % 5 == 0 ? (t + 1) % o->V : t;
}

// Every request's tokens are its reference.
static bool matches_truth(const SchedTestEvents *c, int n_tok)
{
    bool ok = true;
    for (int i = 0; i < N_REQ; i++) {
        ok &= c->n[i] == n_tok && c->finish[i] == SCHED_FINISH_LENGTH;
        for (int t = 0; ok && t < n_tok; t++)
            ok &= c->tokens[i][t] == truth[i][sched_test_prompt_len[i] + t];
    }
    return ok;
}

// All requests at once through a scheduler on stage; returns the scheduler's counters and
// in *is_truth whether every request got its reference tokens.
static SchedStats run_all(PpStage *stage, Model *m, KvCache *kv, int k, int budget, bool *is_truth)
{
    SchedTestEvents *c;
    Scheduler *s = sched_test_open(
        stage, m, kv,
        (SchedParams){.max_num_seqs = 8, .max_num_batched_tokens = budget, .mtp_k = k}, &c);
    for (int i = 0; i < N_REQ; i++) {
        SchedRequest r = sched_test_request(i, MAX_TOK);
        CHECK(sched_submit(s, &r) == ERR_OK);
    }
    sched_test_run(s, NULL);
    SchedStats st;
    sched_stats(s, &st);
    *is_truth = matches_truth(c, MAX_TOK);
    sched_test_close(s, c);
    return st;
}

// ---------------------------------------------------------------------------
// One stage

static void test_one_stage(const char *name, const char *dir)
{
    Backend *be;
    ASSERT(backend_cpu_create(2, &be) == ERR_OK);
    Model plain, m;
    ASSERT(model_load(&plain, dir, NULL, be) == ERR_OK);
    make_truth(&plain);
    model_free(&plain);
    const ModelOptions opts = {.load_mtp = true};
    ASSERT(model_load(&m, dir, &opts, be) == ERR_OK && m.mtp);
    const KvCacheParams p = model_kv_params(&m, BLOCKS, 4);
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    PpStage *stage;
    ASSERT(pp_stage_create(&m, &kv, 0, 1, NULL, 0, &stage) == ERR_OK);
    MtpStage *ms = pp_mtp(stage);
    CHECK(ms != NULL);
    Oracle o = {.V = m.cfg.vocab_size, .stage = stage};

    for (int k = 1; k <= 3; k++)
        for (int hooked = 0; hooked < 2; hooked++) {
            ms->draft_hook = hooked ? oracle_draft : NULL;
            ms->hook_user = &o;
            const MtpStats before = ms->stats;
            bool is_truth;
            const SchedStats st = run_all(stage, &m, &kv, k, 4, &is_truth);
            CHECK(is_truth);
            CHECK(kv_n_free_blocks(&kv) == BLOCKS && kv_n_free_blocks(&ms->mkv) == BLOCKS);
            // The scheduler's counters and the last stage's agree.
            CHECK(st.mtp_drafted == (uint64_t) (ms->stats.drafted - before.drafted));
            CHECK(st.mtp_accepted == (uint64_t) (ms->stats.accepted - before.accepted));
            CHECK(st.mtp_steps > 0 && st.mtp_drafted >= st.mtp_steps);
            if (hooked) CHECK(st.mtp_accepted > 0 && st.mtp_accepted < st.mtp_drafted);
            printf("%s, one stage, mtp %d, %s drafts: %llu verify steps, %llu of %llu drafts "
                   "accepted, %llu micro-batches for %d tokens\n",
                   name, k, hooked ? "hooked" : "own", (unsigned long long) st.mtp_steps,
                   (unsigned long long) st.mtp_accepted, (unsigned long long) st.mtp_drafted,
                   (unsigned long long) st.n_microbatches, N_REQ * MAX_TOK);
        }
    CHECK(o.bad == 0 && o.calls > 0);

    // max_tokens, a stop id and cancel with drafts in flight (always-right hook).
    {
        ms->draft_hook = oracle_draft;
        SchedTestEvents *c;
        Scheduler *s =
            sched_test_open(stage, &m, &kv, (SchedParams){.max_num_seqs = 8, .mtp_k = 3}, &c);
        SchedRequest r = sched_test_request(0, 5);
        CHECK(sched_submit(s, &r) == ERR_OK);
        r = sched_test_request(1, MAX_TOK);
        const int32_t stop = truth[1][sched_test_prompt_len[1] + 6];
        int first_stop = 0;
        while (truth[1][sched_test_prompt_len[1] + first_stop] != stop)
            first_stop++;
        r.stop_ids[0] = stop;
        r.n_stop_ids = 1;
        CHECK(sched_submit(s, &r) == ERR_OK);
        r = sched_test_request(2, MAX_TOK);
        CHECK(sched_submit(s, &r) == ERR_OK);
        r = sched_test_request(3, MAX_TOK);
        CHECK(sched_submit(s, &r) == ERR_OK);
        CHECK(sched_step(s) == ERR_OK);  // prefills, first tokens
        CHECK(sched_step(s) == ERR_OK);
        sched_cancel(s, 2);
        // Force request 3's next two outputs; the rest follows from them.
        const int32_t forced[2] = {5, 9};
        sched_force(s, 3, forced, 2);
        sched_test_run(s, NULL);
        CHECK(c->finish[0] == SCHED_FINISH_LENGTH && c->n[0] == 5);
        CHECK(c->finish[1] == SCHED_FINISH_STOP && c->n[1] == first_stop + 1);
        CHECK(c->finish[2] == SCHED_FINISH_CANCELLED && c->n[2] < MAX_TOK);
        CHECK(c->finish[3] == SCHED_FINISH_LENGTH && c->n[3] == MAX_TOK);
        for (int i = 0; i < 3; i++)
            for (int t = 0; t < c->n[i]; t++)
                CHECK(c->tokens[i][t] == truth[i][sched_test_prompt_len[i] + t]);
        // Request 3 against a plain greedy run over its prompt and the forced tokens.
        int forced_at = 0;
        while (forced_at < c->n[3] && c->tokens[3][forced_at] != 5)
            forced_at++;
        CHECK(forced_at < c->n[3] - 1 && c->tokens[3][forced_at + 1] == 9);
        for (int t = 0; t < forced_at; t++)
            CHECK(c->tokens[3][t] == truth[3][sched_test_prompt_len[3] + t]);
        {
            int32_t ctx[64];
            const int n_ctx = sched_test_prompt_len[3] + forced_at + 2;
            memcpy(ctx, sched_test_prompts[3], (size_t) sched_test_prompt_len[3] * sizeof *ctx);
            memcpy(ctx + sched_test_prompt_len[3], c->tokens[3],
                   (size_t) (forced_at + 2) * sizeof *ctx);
            const KvCacheParams lp = model_kv_params(&m, 8, 8);
            KvCache lkv;
            ASSERT(kv_init(&lkv, &lp) == ERR_OK);
            int32_t cont[SCHED_TEST_MAX_OUT];
            const int n_cont = c->n[3] - (forced_at + 2);
            sched_test_greedy(&m, &lkv, ctx, n_ctx, n_cont, cont);
            for (int t = 0; t < n_cont; t++)
                CHECK(c->tokens[3][forced_at + 2 + t] == cont[t]);
            kv_free(&lkv);
        }
        CHECK(kv_n_free_blocks(&kv) == BLOCKS && kv_n_free_blocks(&ms->mkv) == BLOCKS);
        sched_test_close(s, c);
        ms->draft_hook = NULL;
    }

    // Temperature 0.8: reproducible for a seed, tokens in range.
    {
        SchedTestEvents *c[2];
        for (int run = 0; run < 2; run++) {
            Scheduler *s = sched_test_open(stage, &m, &kv, (SchedParams){.mtp_k = 2}, &c[run]);
            for (int i = 0; i < N_REQ; i++) {
                SchedRequest r = sched_test_request(i, MAX_TOK);
                r.sampling.temperature = 0.8f;
                r.sampling.seed = 100 + (uint64_t) i;
                CHECK(sched_submit(s, &r) == ERR_OK);
            }
            sched_test_run(s, NULL);
            sched_destroy(s);  // the events stay for the comparison below
        }
        for (int i = 0; i < N_REQ; i++) {
            CHECK(c[0]->n[i] == MAX_TOK && c[1]->n[i] == MAX_TOK);
            CHECK(memcmp(c[0]->tokens[i], c[1]->tokens[i], sizeof c[0]->tokens[i]) == 0);
            for (int t = 0; t < c[0]->n[i]; t++)
                CHECK(c[0]->tokens[i][t] >= 0 && c[0]->tokens[i][t] < m.cfg.vocab_size);
        }
        free(c[0]);
        free(c[1]);
    }

    pp_stage_destroy(stage);
    kv_free(&kv);
    model_free(&m);
    be->destroy(be);
}

// ---------------------------------------------------------------------------
// Temperature 1 through the scheduler: the rejection rule on the last stage keeps the
// target distribution.

typedef struct Second {
    long *count;  // [V] second tokens
    int *n;       // [RUNS] events per request
} Second;

static void on_second(void *user, const SchedEvent *ev)
{
    Second *c = user;
    if (ev->token >= 0 && ++c->n[ev->id] == 2) c->count[ev->token]++;
}

static void test_sampling(const char *dir)
{
    enum { RUNS = 3000 };
    Backend *be;
    ASSERT(backend_cpu_create(2, &be) == ERR_OK);
    Model m;
    const ModelOptions opts = {.load_mtp = true};
    ASSERT(model_load(&m, dir, &opts, be) == ERR_OK);
    const int V = m.cfg.vocab_size;
    const int prompt[5] = {11, 200, 37, 5, 99};
    double *marg = calloc((size_t) V, sizeof *marg);
    Second c = {calloc((size_t) V, sizeof *c.count), calloc(RUNS, sizeof *c.n)};
    ASSERT(marg && c.count && c.n);
    const KvCacheParams p = model_kv_params(&m, 64 * 3, 4);
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    second_token_marginal(&m, &kv, prompt, 5, marg);
    PpStage *stage;
    ASSERT(pp_stage_create(&m, &kv, 0, 1, NULL, 0, &stage) == ERR_OK);
    Scheduler *s;
    const SchedParams sp = {
        .max_num_seqs = 64, .max_waiting = RUNS, .mtp_k = 2, .on_event = on_second, .user = &c};
    ASSERT(sched_create(stage, &m, &kv, &sp, &s) == ERR_OK);
    for (int r = 0; r < RUNS; r++) {
        SchedRequest q = {.id = (uint64_t) r,
                          .prompt = prompt,
                          .n_prompt = 5,
                          .max_tokens = 4,  // room for two drafts after the first token
                          .ignore_eos = true,
                          .n_top_logprobs = -1};
        q.sampling = sampler_default_params();
        q.sampling.temperature = 1.0f;
        q.sampling.seed = 5000 + (uint64_t) r;
        CHECK(sched_submit(s, &q) == ERR_OK);
    }
    sched_test_run(s, NULL);
    SchedStats st;
    sched_stats(s, &st);
    int dof;
    const double c2 = chi2(c.count, marg, V, RUNS, &dof);
    printf("tiny, temperature 1, scheduler mtp 2: second token over %d seeds: chi2 %.1f (dof %d, "
           "limit %.1f); %llu of %llu drafts accepted\n",
           RUNS, c2, dof, chi2_crit(dof), (unsigned long long) st.mtp_accepted,
           (unsigned long long) st.mtp_drafted);
    CHECK(dof >= 5 && c2 < chi2_crit(dof));
    CHECK(st.mtp_accepted > 0 && st.mtp_drafted >= RUNS);
    sched_destroy(s);
    pp_stage_destroy(stage);
    kv_free(&kv);
    free(marg);
    free(c.count);
    free(c.n);
    model_free(&m);
    be->destroy(be);
}

// ---------------------------------------------------------------------------
// Ops by hand on one stage: rollback, refusals

static void test_ops(const char *dir)
{
    Backend *be;
    ASSERT(backend_cpu_create(1, &be) == ERR_OK);
    Model m, plain;
    const ModelOptions o = {.load_mtp = true};
    ASSERT(model_load(&m, dir, &o, be) == ERR_OK && model_load(&plain, dir, NULL, be) == ERR_OK);
    const KvCacheParams p = model_kv_params(&m, 16, 4);
    KvCache kv, kv2;
    ASSERT(kv_init(&kv, &p) == ERR_OK && kv_init(&kv2, &p) == ERR_OK);
    PpStage *stage, *no_mtp;
    ASSERT(pp_stage_create(&m, &kv, 0, 1, NULL, 0, &stage) == ERR_OK);
    ASSERT(pp_stage_create(&plain, &kv2, 0, 1, NULL, 0, &no_mtp) == ERR_OK);
    CHECK(pp_mtp(no_mtp) == NULL);
    fprintf(stderr, "(the refusals below log errors on purpose)\n");

    PpResult res;
    PpSeqOp op = {.slot = 3,
                  .n_new = 7,
                  .flags = PP_SEQ_START | PP_SEQ_SAMPLE,
                  .mtp_k = 2,
                  .params = sampler_default_params()};
    CHECK(pp_submit(no_mtp, &op, 1, sched_test_prompts[0]) == ERR_INVAL);  // no MTP layer there
    CHECK(pp_submit(stage, &op, 1, sched_test_prompts[0]) == ERR_OK
          && pp_collect(stage, &res) == ERR_OK);
    CHECK(res.mtp && res.mtp[0].n_emit == 1 && res.mtp[0].n_drafts == 2);
    CHECK(res.tokens[0] == truth[0][7] && res.mtp[0].emit[0] == truth[0][7]);
    CHECK(pp_slot_positions(stage, 3) == 7);
    int32_t toks[3] = {res.tokens[0], res.mtp[0].drafts[0], res.mtp[0].drafts[1]};
    // Drafts it did not propose.
    op = (PpSeqOp){.slot = 3, .n_new = 3, .flags = PP_SEQ_SAMPLE, .n_draft = 2};
    int32_t wrong[3] = {toks[0], (toks[1] + 1) % m.cfg.vocab_size, toks[2]};
    CHECK(pp_submit(stage, &op, 1, wrong) == ERR_FORMAT);
    // Verify both drafts: 1 + accepted tokens come back.
    CHECK(pp_submit(stage, &op, 1, toks) == ERR_OK && pp_collect(stage, &res) == ERR_OK);
    const int n_emit = res.mtp[0].n_emit;
    CHECK(n_emit >= 1 && n_emit <= 3);
    CHECK(res.mtp[0].emit[0] == truth[0][8]);
    CHECK(pp_slot_positions(stage, 3) == 10);  // rejected positions stay until the next op
    const int rejected = 2 - (n_emit - 1);
    // Fewer dropped positions than the stage rejected (random weights: the MTP's own
    // drafts are rejected here), or a negative count; then the right one.
    const int32_t next = res.tokens[0];
    CHECK(rejected > 0);
    op = (PpSeqOp){.slot = 3, .n_new = 1, .flags = PP_SEQ_SAMPLE, .n_rollback = rejected - 1};
    CHECK(pp_submit(stage, &op, 1, &next) == ERR_FORMAT);
    op.n_rollback = -1;
    CHECK(pp_submit(stage, &op, 1, &next) == ERR_FORMAT);
    CHECK(pp_slot_positions(stage, 3) == 10);
    op.n_rollback = rejected;
    CHECK(pp_submit(stage, &op, 1, &next) == ERR_OK && pp_collect(stage, &res) == ERR_OK);
    CHECK(pp_slot_positions(stage, 3) == 10 - rejected + 1);
    CHECK(res.tokens[0] == truth[0][7 + n_emit + 1]);
    // Drafts on a slot without MTP.
    op = (PpSeqOp){.slot = 4,
                   .n_new = 3,
                   .flags = PP_SEQ_START | PP_SEQ_SAMPLE,
                   .params = sampler_default_params()};
    CHECK(pp_submit(stage, &op, 1, sched_test_prompts[1]) == ERR_OK
          && pp_collect(stage, &res) == ERR_OK);
    CHECK(!res.mtp && res.tokens[0] == truth[1][3]);  // no MTP op in the batch
    op = (PpSeqOp){.slot = 4, .n_new = 2, .flags = PP_SEQ_SAMPLE, .n_draft = 1};
    CHECK(pp_submit(stage, &op, 1, toks) == ERR_FORMAT);
    // MTP with a sampling filter is refused at the start.
    op = (PpSeqOp){.slot = 5,
                   .n_new = 1,
                   .flags = PP_SEQ_START | PP_SEQ_SAMPLE,
                   .mtp_k = 1,
                   .params = sampler_default_params()};
    op.params.temperature = 0.7f;
    op.params.top_p = 0.9f;
    CHECK(pp_submit(stage, &op, 1, sched_test_prompts[3]) == ERR_INVAL);

    pp_stage_destroy(stage);
    pp_stage_destroy(no_mtp);
    kv_free(&kv);
    kv_free(&kv2);
    model_free(&m);
    model_free(&plain);
    be->destroy(be);
}

// ---------------------------------------------------------------------------
// Three stages

static const int split[4] = {0, 1, 2, 3};

// Rank 2 holds the MTP layer and drafts through the hook.
static void hook_last_rank(PpStage *st, void *user)
{
    Oracle *o = user;
    o->stage = st;
    pp_mtp(st)->draft_hook = oracle_draft;
    pp_mtp(st)->hook_user = o;
}

static void test_pipeline(const char *dir)
{
    Backend *be;
    ASSERT(backend_cpu_create(1, &be) == ERR_OK);
    Model plain;
    ASSERT(model_load(&plain, dir, NULL, be) == ERR_OK);
    make_truth(&plain);
    Oracle o = {.V = plain.cfg.vocab_size};
    model_free(&plain);

    char master[64];
    snprintf(master, sizeof master, "127.0.0.1:%d", pp_test_free_port());
    const SchedTestRank proto = {.world = 3,
                                 .dir = dir,
                                 .master = master,
                                 .split = split,
                                 .n_blocks = BLOCKS,
                                 .hash = 0x3a7,
                                 .is_mtp_last = true,
                                 .on_last_stage = hook_last_rank,
                                 .user = &o};
    SchedTestRank ranks[3];
    pthread_t th[3];
    sched_test_start_ranks(&proto, ranks, th);
    Model m;
    const ModelOptions mo = {.first_layer = 0, .last_layer = 1};
    ASSERT(model_load(&m, dir, &mo, be) == ERR_OK);
    const KvCacheParams p = model_kv_params(&m, BLOCKS, 4);
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    PpStage *stage;
    CHECK(pp_stage_create(&m, &kv, 0, 3, master, 0x3a7, &stage) == ERR_OK);
    if (stage) {
        CHECK(pp_mtp(stage) == NULL);  // rank 0 holds no MTP layer
        for (int k = 2; k <= 3; k++) {
            bool is_truth;
            const SchedStats st = run_all(stage, &m, &kv, k, 5, &is_truth);
            CHECK(is_truth);
            CHECK(st.mtp_accepted > 0 && st.mtp_accepted < st.mtp_drafted);
            CHECK(kv_n_free_blocks(&kv) == BLOCKS);
            printf("pipeline of 3, mtp %d, hooked drafts: %llu verify steps, %llu of %llu drafts "
                   "accepted, %llu micro-batches for %d tokens\n",
                   k, (unsigned long long) st.mtp_steps, (unsigned long long) st.mtp_accepted,
                   (unsigned long long) st.mtp_drafted, (unsigned long long) st.n_microbatches,
                   N_REQ * MAX_TOK);
        }
        CHECK(pp_end(stage) == ERR_OK);
    }
    pp_stage_destroy(stage);
    sched_test_join_ranks(ranks, th);
    CHECK(o.bad == 0 && o.calls > 0);
    kv_free(&kv);
    model_free(&m);
    be->destroy(be);
}

int main(void)
{
    if (!mtp_test_dirs(src_dir, sizeof src_dir, "tests/golden/models/mtp_theta", tmp_root,
                       sizeof tmp_root, "glmspark_mtp_pp"))
        return 1;
    char theta[1200];
    snprintf(theta, sizeof theta, "%s/tests/golden/models/mtp_theta", src_dir);
    log_set_level(LOG_LEVEL_WARN);
    test_one_stage("mtp_theta", theta);
    test_ops(theta);  // truth: mtp_theta's, from test_one_stage
    char tiny[700];
    snprintf(tiny, sizeof tiny, "%s/tiny", tmp_root);
    const MkmodelOptions opt = {.out_dir = tiny, .preset = "tiny", .seed = 11};
    ASSERT(mkdir(tiny, 0755) == 0 && mkmodel_write(&opt) == ERR_OK);
    test_one_stage("mkmodel tiny", tiny);
    test_sampling(tiny);
    test_pipeline(theta);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp_root);
    return check_exit();
}
