/*
 * test_sched.c - the continuous-batching scheduler against plain one-sequence generation.
 *
 * Reference: greedy decoding of each prompt alone with model_forward() (the path the
 * golden tests check against transformers). Checks: several concurrent sequences give the
 * reference tokens (one stage, and a three-stage pipeline with three micro-batches in
 * flight, its ranks 1 and 2 served by threads over loopback TCP); a tiny token budget
 * (chunked prefill) gives the same tokens and never exceeds the budget; a decoding
 * sequence gets a token from every micro-batch while a long prompt is prefilled; cancel
 * ends a sequence and returns its KV blocks; stop ids end a sequence on the stop token;
 * bad requests are refused; a rank with a different model/split hash is refused at the
 * handshake; logprobs (one stage and the pipeline, greedy and with temperature and
 * penalties) equal the log-softmax of model_forward()'s raw logits at each position of the
 * sequence the scheduler produced, top alternatives in order; forced ids replace the
 * sampled ones, never end the sequence (even an eos id), count towards max_tokens, and the
 * continuation is greedy decoding of prompt + forced ids. Prefix caching (one stage and a
 * two-stage pipeline): requests that share prompt prefixes with an earlier one reuse its
 * blocks (the counts of tokens served from the cache are exact) and give the tokens of the
 * same requests without the cache, greedy and sampled with a seed and penalties (whose
 * history includes the cached tokens); under eviction pressure (a cache of 12 blocks) too;
 * every block is back (free or cached) at the end.
 *
 * The model is tests/golden/models/dsa_modelopt (found through GLMSPARK_SOURCE_DIR).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/model/sampler.h"
#include "engine/pipeline/pp.h"
#include "engine/pipeline/scheduler.h"
#include "engine/shared/err.h"
#include "tests/check.h"
#include "tests/engine/pipeline/pp_test_util.h"
#include "tests/engine/pipeline/sched_test_util.h"

enum { N_REQ = SCHED_TEST_N_REQ, MAX_TOK = 10 };

static char model_dir[1024];

static int32_t reference[N_REQ][MAX_TOK];

// ---------------------------------------------------------------------------
// Logprobs reference: model_forward over the prompt and then each output token; at every
// position the log-softmax (double) of the raw logits, and the top ids by a full sort.

static const float *sort_row;
static int by_logit_desc(const void *a, const void *b)
{
    const int x = *(const int *) a, y = *(const int *) b;
    if (sort_row[x] != sort_row[y]) return sort_row[x] > sort_row[y] ? -1 : 1;
    return x - y;
}

// Check c's events of request i (tokens out[0..n) after prompt) against the reference;
// n_top is what the request asked for. Returns the number of positions checked.
static int check_logprobs(Model *m, const SchedTestEvents *c, int i, const int32_t *prompt,
                          int n_prompt, int n_top)
{
    const int V = m->cfg.vocab_size, n = c->n[i];
    const KvCacheParams p = model_kv_params(m, 32, 4);
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    KvSeq seq = {0};
    float *logits = malloc((size_t) V * sizeof *logits);
    int *order = malloc((size_t) V * sizeof *order);
    ASSERT(logits && order);
    ASSERT(model_forward(m, &kv, &seq, prompt, n_prompt, logits, false) == ERR_OK);
    int n_checked = 0;
    for (int t = 0; t < n; t++) {
        double mx = logits[0], sum = 0;
        for (int v = 1; v < V; v++)
            mx = logits[v] > mx ? logits[v] : mx;
        for (int v = 0; v < V; v++)
            sum += exp((double) logits[v] - mx);
        const double lse = mx + log(sum);
        const int32_t tok = c->tokens[i][t];
        CHECK(fabs(c->logprob[i][t] - ((double) logits[tok] - lse)) < 1e-4);
        CHECK(c->logprob[i][t] <= 0);
        CHECK(c->n_top[i][t] == n_top);
        for (int v = 0; v < V; v++)
            order[v] = v;
        sort_row = logits;
        qsort(order, (size_t) V, sizeof *order, by_logit_desc);
        for (int k = 0; k < c->n_top[i][t]; k++) {
            CHECK(c->top_ids[i][t][k] == order[k]);
            CHECK(fabs(c->top_logprobs[i][t][k] - ((double) logits[order[k]] - lse)) < 1e-4);
        }
        n_checked++;
        if (t + 1 < n) ASSERT(model_forward(m, &kv, &seq, &tok, 1, logits, false) == ERR_OK);
    }
    kv_seq_free(&kv, &seq);
    kv_free(&kv);
    free(logits);
    free(order);
    return n_checked;
}

static void check_reference(const SchedTestEvents *c)
{
    for (int i = 0; i < N_REQ; i++) {
        CHECK(c->n[i] == MAX_TOK);
        CHECK(c->finish[i] == SCHED_FINISH_LENGTH);
        CHECK(memcmp(c->tokens[i], reference[i], sizeof reference[i]) == 0);
    }
}

// ---------------------------------------------------------------------------
// One stage

// A pipeline of one stage over m, with a cache of 24 blocks of 4 in kv.
static PpStage *one_stage(Model *m, KvCache *kv)
{
    const KvCacheParams p = model_kv_params(m, 24, 4);
    ASSERT(kv_init(kv, &p) == ERR_OK);
    PpStage *stage;
    ASSERT(pp_stage_create(m, kv, 0, 1, NULL, 0, &stage) == ERR_OK);
    return stage;
}

static void test_single_stage(Model *m)
{
    KvCache kv;
    PpStage *stage = one_stage(m, &kv);

    // Concurrent, generous budget; then a 3-token budget (chunked prefill).
    const int budgets[2] = {512, 3};
    for (int k = 0; k < 2; k++) {
        SchedTestEvents *c;
        Scheduler *s = sched_test_open(
            stage, m, &kv, (SchedParams){.max_num_seqs = 8, .max_num_batched_tokens = budgets[k]},
            &c);
        for (int i = 0; i < N_REQ; i++) {
            const SchedRequest r = sched_test_request(i, MAX_TOK);
            CHECK(sched_submit(s, &r) == ERR_OK);
        }
        sched_test_run(s, NULL);
        check_reference(c);
        SchedStats st;
        sched_stats(s, &st);
        CHECK(st.max_batch_tokens <= budgets[k]);
        CHECK(kv_n_free_blocks(&kv) == 24);  // every sequence freed on the rank
        printf("budget %d: %llu micro-batches, %llu tokens, largest %d\n", budgets[k],
               (unsigned long long) st.n_microbatches, (unsigned long long) st.n_tokens,
               st.max_batch_tokens);
        sched_test_close(s, c);
    }

    // A long prefill (20 tokens, budget 4) next to a decoding sequence: the decoding one
    // gets a token from every micro-batch (delayed by at most one chunk).
    {
        SchedTestEvents *c;
        Scheduler *s = sched_test_open(
            stage, m, &kv, (SchedParams){.max_num_seqs = 8, .max_num_batched_tokens = 4}, &c);
        SchedRequest r = sched_test_request(3, 30);
        CHECK(sched_submit(s, &r) == ERR_OK);
        CHECK(sched_step(s) == ERR_OK);  // prefill of the 1-token prompt: first token
        CHECK(c->n[3] == 1);
        r = sched_test_request(2, 2);
        CHECK(sched_submit(s, &r) == ERR_OK);
        for (int step = 0; step < 8; step++) {
            const int before = c->n[3];
            CHECK(sched_step(s) == ERR_OK);
            CHECK(c->n[3] == before + 1);
        }
        CHECK(c->n[2] >= 1);  // 20 prompt tokens in 3-token chunks (7) beside the decode
        // Cancel the long one mid-decode: its last event says so and its blocks come back.
        const int free_before = kv_n_free_blocks(&kv);
        sched_cancel(s, 3);
        sched_test_run(s, NULL);
        CHECK(c->finish[3] == SCHED_FINISH_CANCELLED);
        CHECK(c->n[3] < 30);
        CHECK(c->finish[2] == SCHED_FINISH_LENGTH && c->n[2] == 2);
        CHECK(kv_n_free_blocks(&kv) == 24 && kv_n_free_blocks(&kv) > free_before);
        sched_test_close(s, c);
    }

    // Stop ids, a cancelled queued request, bad requests, a request larger than the cache.
    {
        SchedTestEvents *c;
        Scheduler *s = sched_test_open(stage, m, &kv, (SchedParams){.max_num_seqs = 1}, &c);
        SchedRequest r = sched_test_request(0, MAX_TOK);
        r.stop_ids[0] = reference[0][2];
        r.n_stop_ids = 1;
        CHECK(sched_submit(s, &r) == ERR_OK);
        r = sched_test_request(1, MAX_TOK);
        CHECK(sched_submit(s, &r) == ERR_OK);
        sched_cancel(s, 1);               // still queued behind request 0 (max_num_seqs 1)
        r = sched_test_request(2, 1000);  // 1020 positions > 24 blocks of 4
        CHECK(sched_submit(s, &r) == ERR_OK);
        SchedRequest bad = sched_test_request(3, 0);
        CHECK(sched_submit(s, &bad) == ERR_INVAL);
        bad = sched_test_request(3, 5);
        const int32_t oov[1] = {100000};
        bad.prompt = oov;
        CHECK(sched_submit(s, &bad) == ERR_INVAL);
        sched_test_run(s, NULL);
        int first_stop = 0;
        while (reference[0][first_stop] != reference[0][2])
            first_stop++;
        CHECK(c->finish[0] == SCHED_FINISH_STOP && c->n[0] == first_stop + 1);
        CHECK(c->finish[1] == SCHED_FINISH_CANCELLED && c->n[1] == 0);
        CHECK(c->finish[2] == SCHED_FINISH_ERROR && c->n[2] == 0);
        CHECK(kv_n_free_blocks(&kv) == 24);
        sched_test_close(s, c);
    }
    pp_stage_destroy(stage);
    kv_free(&kv);
}

// ---------------------------------------------------------------------------
// Logprobs and forced tokens, one stage

static void test_logprobs_and_force(Model *m)
{
    KvCache kv;
    PpStage *stage = one_stage(m, &kv);

    // Greedy with 5 alternatives, sampled with penalties with 20, the token only, none;
    // a 4-token budget, so prompts are prefilled in chunks.
    {
        SchedTestEvents *c;
        Scheduler *s = sched_test_open(
            stage, m, &kv, (SchedParams){.max_num_seqs = 8, .max_num_batched_tokens = 4}, &c);
        const int n_top[N_REQ] = {5, SCHED_MAX_TOP_LOGPROBS, 0, -1};
        for (int i = 0; i < N_REQ; i++) {
            SchedRequest r = sched_test_request(i, MAX_TOK);
            r.n_top_logprobs = n_top[i];
            if (i == 1) {
                r.sampling.temperature = 0.9f;
                r.sampling.seed = 7;
                r.sampling.repetition_penalty = 1.3f;
                r.sampling.presence_penalty = 0.5f;
            }
            CHECK(sched_submit(s, &r) == ERR_OK);
        }
        SchedRequest bad = sched_test_request(3, 5);
        bad.n_top_logprobs = SCHED_MAX_TOP_LOGPROBS + 1;
        CHECK(sched_submit(s, &bad) == ERR_INVAL);
        bad.n_top_logprobs = -2;
        CHECK(sched_submit(s, &bad) == ERR_INVAL);
        sched_test_run(s, NULL);
        for (int i = 0; i < N_REQ; i++)
            CHECK(c->n[i] == MAX_TOK);
        CHECK(memcmp(c->tokens[0], reference[0], sizeof reference[0]) == 0);
        CHECK(memcmp(c->tokens[2], reference[2], sizeof reference[2]) == 0);
        CHECK(memcmp(c->tokens[3], reference[3], sizeof reference[3]) == 0);
        for (int i = 0; i < 3; i++)
            CHECK(check_logprobs(m, c, i, sched_test_prompts[i], sched_test_prompt_len[i], n_top[i])
                  == MAX_TOK);
        for (int t = 0; t < MAX_TOK; t++)
            CHECK(c->n_top[3][t] == 0 && c->logprob[3][t] == 0);
        // The sampled request's tokens are not greedy ones somewhere (else the penalties
        // and temperature were not exercised); its logprobs stay those of the raw logits.
        CHECK(memcmp(c->tokens[1], reference[1], sizeof reference[1]) != 0);
        CHECK(kv_n_free_blocks(&kv) == 24);
        sched_test_close(s, c);
    }

    // Forced ids: before the first output (an eos id among them, which must not end the
    // sequence), and mid-sequence.
    {
        SchedTestEvents *c;
        Scheduler *s = sched_test_open(stage, m, &kv, (SchedParams){.max_num_seqs = 8}, &c);
        const int V = m->cfg.vocab_size;
        const int32_t forced[3] = {m->cfg.n_eos_ids > 0 ? m->cfg.eos_ids[0] : 5, 17, 23};
        SchedRequest r = sched_test_request(0, 6);
        r.ignore_eos = false;
        r.n_top_logprobs = 2;
        CHECK(sched_submit(s, &r) == ERR_OK);
        r = sched_test_request(1, MAX_TOK);
        CHECK(sched_submit(s, &r) == ERR_OK);
        sched_force(s, 0, forced, 3);
        sched_force(s, 99, forced, 3);                   // unknown: ignored
        sched_force(s, 1, (const int32_t[]){V, -1}, 2);  // outside the vocabulary
        while (c->n[1] < 2)
            CHECK(sched_step(s) == ERR_OK);
        CHECK(memcmp(c->tokens[1], reference[1], 2 * sizeof(int32_t)) == 0);
        const int32_t mid = reference[1][2] == 31 ? 32 : 31;
        sched_force(s, 1, &mid, 1);
        sched_test_run(s, NULL);

        // Request 0: the forced ids, then greedy decoding of prompt + forced ids until an
        // eos id or 6 tokens.
        int32_t want[6];
        int n_want = 0;
        SchedFinish want_fin = SCHED_FINISH_LENGTH;
        {
            const KvCacheParams p2 = model_kv_params(m, 32, 4);
            KvCache kv2;
            ASSERT(kv_init(&kv2, &p2) == ERR_OK);
            KvSeq seq = {0};
            Sampler smp;
            ASSERT(sampler_init(&smp, V, sampler_default_params()) == ERR_OK);
            float *logits = malloc((size_t) V * sizeof *logits);
            ASSERT(logits);
            ASSERT(model_forward(m, &kv2, &seq, sched_test_prompts[0], sched_test_prompt_len[0],
                                 logits, false)
                   == ERR_OK);
            while (n_want < 6) {
                const int32_t t = n_want < 3 ? forced[n_want] : sampler_sample(&smp, logits);
                want[n_want++] = t;
                bool is_eos = false;
                for (int e = 0; e < m->cfg.n_eos_ids; e++)
                    is_eos |= t == m->cfg.eos_ids[e];
                if (n_want > 3 && is_eos) {
                    want_fin = SCHED_FINISH_STOP;
                    break;
                }
                ASSERT(model_forward(m, &kv2, &seq, &t, 1, logits, false) == ERR_OK);
            }
            kv_seq_free(&kv2, &seq);
            kv_free(&kv2);
            free(logits);
            sampler_free(&smp);
        }
        CHECK(c->n[0] == n_want && c->finish[0] == want_fin);
        CHECK(memcmp(c->tokens[0], want, (size_t) n_want * sizeof(int32_t)) == 0);
        CHECK(check_logprobs(m, c, 0, sched_test_prompts[0], sched_test_prompt_len[0], 2)
              == n_want);
        // Request 1: two greedy tokens, the forced one, then greedy from there on.
        CHECK(c->n[1] == MAX_TOK && c->finish[1] == SCHED_FINISH_LENGTH && c->tokens[1][2] == mid);
        {
            int32_t ctx[20 + MAX_TOK];
            memcpy(ctx, sched_test_prompts[1], (size_t) sched_test_prompt_len[1] * sizeof(int32_t));
            memcpy(ctx + sched_test_prompt_len[1], c->tokens[1], 3 * sizeof(int32_t));
            int32_t cont[MAX_TOK];
            sched_test_greedy(m, &kv, ctx, sched_test_prompt_len[1] + 3, MAX_TOK, cont);
            CHECK(memcmp(c->tokens[1] + 3, cont, (MAX_TOK - 3) * sizeof(int32_t)) == 0);
        }
        CHECK(kv_n_free_blocks(&kv) == 24);
        sched_test_close(s, c);
    }
    pp_stage_destroy(stage);
    kv_free(&kv);
}

// ---------------------------------------------------------------------------
// Three stages over loopback TCP

typedef struct RankArgs {
    int rank;
    const char *master;
    uint64_t hash;
    Err result;
} RankArgs;

static const int split[4] = {0, 1, 3, 5};

static void test_pipeline(Model *full, Backend *be)
{
    char master[64];
    snprintf(master, sizeof master, "127.0.0.1:%d", pp_test_free_port());
    const uint64_t hash = 0x5eed;
    const SchedTestRank proto = {.world = 3,
                                 .dir = model_dir,
                                 .master = master,
                                 .split = split,
                                 .n_blocks = 24,
                                 .hash = hash};
    SchedTestRank ranks[3];
    pthread_t th[3];
    sched_test_start_ranks(&proto, ranks, th);

    Model m;
    KvCache kv;
    const ModelOptions o = {.first_layer = 0, .last_layer = 1};
    ASSERT(model_load(&m, model_dir, &o, be) == ERR_OK);
    const KvCacheParams p = model_kv_params(&m, 24, 4);
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    PpStage *stage;
    CHECK(pp_stage_create(&m, &kv, 0, 3, master, hash, &stage) == ERR_OK);
    if (stage) {
        SchedTestEvents *c;
        Scheduler *s = sched_test_open(
            stage, &m, &kv, (SchedParams){.max_num_seqs = 8, .max_num_batched_tokens = 5}, &c);
        for (int i = 0; i < N_REQ; i++) {
            SchedRequest r = sched_test_request(i, MAX_TOK);
            if (i == 2) r.n_top_logprobs = 3;  // logits rows come back over TCP
            CHECK(sched_submit(s, &r) == ERR_OK);
        }
        int max_inflight = 0;
        sched_test_run(s, &max_inflight);
        check_reference(c);
        CHECK(check_logprobs(full, c, 2, sched_test_prompts[2], sched_test_prompt_len[2], 3)
              == MAX_TOK);
        CHECK(max_inflight == 3);  // one micro-batch per stage
        CHECK(kv_n_free_blocks(&kv) == 24);
        printf("pipeline of 3: up to %d micro-batches in flight\n", max_inflight);
        sched_test_close(s, c);
        CHECK(pp_end(stage) == ERR_OK);
    }
    pp_stage_destroy(stage);
    sched_test_join_ranks(ranks, th);
    kv_free(&kv);
    model_free(&m);
}

// ---------------------------------------------------------------------------
// Prefix caching

enum { PC_N = 4, PC_LEN = 20 };
static int32_t pc_prompt[PC_N][PC_LEN];  // built in prefix_prompts()
static int pc_cached[PC_N];               // the n_cached of each request's events

static void pc_on_event(void *user, const SchedEvent *ev)
{
    sched_test_on_event(user, ev);
    if (ev->id < PC_N) pc_cached[ev->id] = ev->n_cached;
}

// 0: prompt 2 of sched_test_util (20 tokens, 5 blocks of 4); 1: its first 13 tokens and 7
// others; 2: prompt 2 again; 3: prompt 2 reversed (nothing shared).
static void prefix_prompts(void)
{
    const int32_t *p = sched_test_prompts[2];
    for (int t = 0; t < PC_LEN; t++) {
        pc_prompt[0][t] = pc_prompt[2][t] = p[t];
        pc_prompt[1][t] = t < 13 ? p[t] : 100 + t;
        pc_prompt[3][t] = p[PC_LEN - 1 - t];
    }
}

// Request i of pc_prompt, MAX_TOK tokens; sampled with a seed and penalties when is_sampled.
static SchedRequest pc_request(int i, bool is_sampled)
{
    SchedRequest r = sched_test_request(0, MAX_TOK);
    r.id = (uint64_t) i;
    r.prompt = pc_prompt[i];
    r.n_prompt = PC_LEN;
    if (is_sampled) {
        r.sampling.temperature = 0.9f;
        r.sampling.seed = 11 + (uint64_t) i;
        r.sampling.repetition_penalty = 1.3f;
        r.sampling.presence_penalty = 0.4f;
    }
    return r;
}

// Runs requests first .. last of pc_prompt together on a scheduler over stage/kv (a 5-token
// budget: prompts are prefilled in chunks), their tokens into out[i].
static void pc_run(PpStage *stage, const Model *m, KvCache *kv, bool is_cached, bool is_sampled,
                   int first, int last, int32_t out[PC_N][MAX_TOK])
{
    SchedTestEvents *c = calloc(1, sizeof *c);
    ASSERT(c);
    const SchedParams sp = {.max_num_seqs = 4,
                            .max_num_batched_tokens = 5,
                            .prefix_caching = is_cached,
                            .on_event = pc_on_event,
                            .user = c};
    Scheduler *s;
    ASSERT(sched_create(stage, m, kv, &sp, &s) == ERR_OK);
    for (int i = first; i <= last; i++) {
        const SchedRequest r = pc_request(i, is_sampled);
        pc_cached[i] = -1;
        CHECK(sched_submit(s, &r) == ERR_OK);
    }
    sched_test_run(s, NULL);
    for (int i = first; i <= last; i++) {
        CHECK(c->n[i] == MAX_TOK && c->finish[i] == SCHED_FINISH_LENGTH);
        memcpy(out[i], c->tokens[i], sizeof out[i]);
    }
    sched_destroy(s);
    free(c);
}

// The whole prefix-caching check on a stage whose cache kv (blocks of 4) is empty:
// reference tokens without the cache, then request 0 alone, then 1-3 (together when the
// cache holds them all, else one after another, evicting), with it.
static void pc_check(PpStage *stage, const Model *m, KvCache *kv, bool sampled, const char *what)
{
    const int n_blocks = kv->params.n_blocks;
    int32_t want[PC_N][MAX_TOK], got[PC_N][MAX_TOK];
    for (int i = 0; i < PC_N; i++)
        pc_run(stage, m, kv, false, sampled, i, i, want);
    CHECK(kv_n_published(kv) == 0 && kv_n_free_blocks(kv) == n_blocks);
    pc_run(stage, m, kv, true, sampled, 0, 0, got);
    CHECK(pc_cached[0] == 0);
    CHECK(kv_n_published(kv) == 5);  // its five full prompt blocks, now cached
    CHECK(kv_n_free_blocks(kv) == n_blocks);
    if (n_blocks >= 24) {
        pc_run(stage, m, kv, true, sampled, 1, 3, got);
        CHECK(pc_cached[1] == 12 && pc_cached[2] == 16 && pc_cached[3] == 0);
    } else {
        for (int i = 1; i < PC_N; i++)
            pc_run(stage, m, kv, true, sampled, i, i, got);
        CHECK(kv->n_evicted > 0);
        CHECK(pc_cached[1] == 12 && pc_cached[3] == 0);
    }
    for (int i = 0; i < PC_N; i++)
        CHECK(memcmp(got[i], want[i], sizeof want[i]) == 0);
    CHECK(kv_n_free_blocks(kv) == n_blocks);
    printf("prefix caching, %s, %s, %d blocks: hits %d/%d/%d tokens, %d blocks cached, %llu "
           "evicted\n",
           what, sampled ? "sampled" : "greedy", n_blocks, pc_cached[1], pc_cached[2], pc_cached[3],
           kv_n_published(kv), (unsigned long long) kv->n_evicted);
}

static void test_prefix_caching(Model *m)
{
    prefix_prompts();
    for (int k = 0; k < 4; k++) {
        KvCache kv;
        const KvCacheParams p = model_kv_params(m, k & 1 ? 12 : 24, 4);
        ASSERT(kv_init(&kv, &p) == ERR_OK);
        PpStage *stage;
        ASSERT(pp_stage_create(m, &kv, 0, 1, NULL, 0, &stage) == ERR_OK);
        pc_check(stage, m, &kv, k >= 2, "one stage");
        pp_stage_destroy(stage);
        kv_free(&kv);
    }
}

// The same over two stages (rank 1 in a thread), with eviction: every rank attaches,
// publishes and evicts the same blocks, or rank 1 refuses the START op.
static const int pc_split[3] = {0, 2, 5};

// fn(stage, model, kv, arg) on rank 0 of a two-stage pipeline (split pc_split, rank 1 in a
// thread), every rank's cache n_blocks blocks of 4; pp_end afterwards.
static void on_two_stages(Backend *be, int n_blocks, uint64_t hash,
                          void (*fn)(PpStage *, Model *, KvCache *, void *), void *arg)
{
    char master[64];
    snprintf(master, sizeof master, "127.0.0.1:%d", pp_test_free_port());
    const SchedTestRank proto = {
        .world = 2, .dir = model_dir, .master = master, .split = pc_split, .n_blocks = n_blocks, .hash = hash};
    SchedTestRank ranks[2];
    pthread_t th[2];
    sched_test_start_ranks(&proto, ranks, th);
    Model m;
    KvCache kv;
    const ModelOptions o = {.first_layer = pc_split[0], .last_layer = pc_split[1]};
    ASSERT(model_load(&m, model_dir, &o, be) == ERR_OK);
    const KvCacheParams p = model_kv_params(&m, n_blocks, 4);
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    PpStage *stage;
    CHECK(pp_stage_create(&m, &kv, 0, 2, master, hash, &stage) == ERR_OK);
    if (stage) {
        fn(stage, &m, &kv, arg);
        CHECK(pp_end(stage) == ERR_OK);
    }
    pp_stage_destroy(stage);
    sched_test_join_ranks(ranks, th);
    kv_free(&kv);
    model_free(&m);
}

static void pc_check_two(PpStage *stage, Model *m, KvCache *kv, void *sampled)
{
    pc_check(stage, m, kv, *(const bool *) sampled, "two stages");
}

static void test_prefix_caching_pipeline(Backend *be)
{
    for (int k = 0; k < 2; k++) {
        const bool sampled = k == 1;
        on_two_stages(be, 12, 0x9c, pc_check_two, (void *) &sampled);
    }
}

// ---------------------------------------------------------------------------
// Vocabulary masks (constrained decoding)

// Request 1 greedy under masks that allow one id per step (so its output is exactly those
// ids), request 0 sampled under masks that allow the ids of one residue mod 7 per step,
// request 2 unconstrained beside them (its greedy reference). Request 1 gets no mask after
// its third token until the others are done: it must wait, then go on. Over stage (one
// rank or the first of a pipeline).
static int32_t mask_only(int step, int V) { return (int32_t) ((17 + 31 * step) % V); }

static void check_masks(PpStage *stage, const Model *m, KvCache *kv, const char *what)
{
    const int V = m->cfg.vocab_size, words = pp_mask_words(stage);
    uint32_t *mask = calloc((size_t) words, sizeof *mask);
    ASSERT(mask);
    SchedTestEvents *c;
    Scheduler *s = sched_test_open(stage, m, kv, (SchedParams){.max_num_seqs = 4, .max_num_batched_tokens = 8}, &c);
    SchedRequest r[3] = {sched_test_request(0, MAX_TOK), sched_test_request(1, MAX_TOK), sched_test_request(2, MAX_TOK)};
    r[0].sampling.temperature = 0.9f;
    r[0].sampling.seed = 5;
    r[0].constrained = r[1].constrained = true;
    int seen[2] = {0, 0};  // events of requests 0 and 1 answered with a mask
    bool waited = false;
    for (int i = 0; i < 3; i++) CHECK(sched_submit(s, &r[i]) == ERR_OK);
    for (int guard = 0; sched_has_work(s) && guard < 10000; guard++) {
        for (int i = 0; i < 2; i++) {
            if (seen[i] > c->n[i] || c->finish[i] != SCHED_FINISH_NONE) continue;
            if (i == 1 && c->n[1] == 3 && c->finish[2] == SCHED_FINISH_NONE) {
                waited = true;  // no mask yet: request 1 must not move
                continue;
            }
            memset(mask, 0, (size_t) words * sizeof *mask);
            for (int32_t id = 0; id < V; id++)
                if (i == 1 ? id == mask_only(c->n[1], V) : id % 7 == c->n[0] % 7) mask[id >> 5] |= 1u << (id & 31);
            CHECK(sched_set_mask(s, (uint64_t) i, mask) == ERR_OK);
            seen[i] = c->n[i] + 1;
        }
        CHECK(sched_step(s) == ERR_OK);
        if (waited && c->finish[2] == SCHED_FINISH_NONE) CHECK(c->n[1] == 3);
    }
    CHECK(waited);
    for (int i = 0; i < 3; i++) CHECK(c->n[i] == MAX_TOK && c->finish[i] == SCHED_FINISH_LENGTH);
    for (int t = 0; t < MAX_TOK; t++) {
        CHECK(c->tokens[1][t] == mask_only(t, V));
        CHECK(c->tokens[0][t] % 7 == t % 7);
    }
    CHECK(memcmp(c->tokens[2], reference[2], sizeof reference[2]) == 0);
    printf("masks, %s: request 1 followed its masks, request 0 stayed in its residues, request 2 "
           "unchanged\n",
           what);
    sched_test_close(s, c);
    free(mask);
}

static void check_masks_two(PpStage *stage, Model *m, KvCache *kv, void *arg)
{
    (void) arg;
    check_masks(stage, m, kv, "two stages");
}

static void test_masks(Model *m, Backend *be)
{
    {
        KvCache kv;
        const KvCacheParams p = model_kv_params(m, 32, 4);
        ASSERT(kv_init(&kv, &p) == ERR_OK);
        PpStage *stage;
        ASSERT(pp_stage_create(m, &kv, 0, 1, NULL, 0, &stage) == ERR_OK);
        check_masks(stage, m, &kv, "one stage");
        pp_stage_destroy(stage);
        kv_free(&kv);
    }
    // Two stages: the masks travel with the batch to the last rank, which samples.
    on_two_stages(be, 32, 0x9d, check_masks_two, NULL);
}

// A rank whose config/split hash differs is refused by rank 0, and both sides fail fast.
static const int split2[3] = {0, 3, 5};

static void *rank1_of_2(void *arg)
{
    RankArgs *a = arg;
    Backend *be = NULL;
    Model m;
    KvCache kv = {0};
    PpStage *st = NULL;
    const ModelOptions o = {.first_layer = split2[1], .last_layer = split2[2]};
    ASSERT(backend_cpu_create(1, &be) == ERR_OK && model_load(&m, model_dir, &o, be) == ERR_OK);
    const KvCacheParams p = model_kv_params(&m, 4, 4);
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    a->result = pp_stage_create(&m, &kv, 1, 2, a->master, a->hash, &st);
    pp_stage_destroy(st);
    kv_free(&kv);
    model_free(&m);
    be->destroy(be);
    return NULL;
}

static void test_handshake_mismatch(Backend *be)
{
    char master[64];
    snprintf(master, sizeof master, "127.0.0.1:%d", pp_test_free_port());
    RankArgs a1 = {1, master, 0xbad, ERR_OK};
    pthread_t th;
    ASSERT(pthread_create(&th, NULL, rank1_of_2, &a1) == 0);
    Model m;
    KvCache kv;
    const ModelOptions o = {.first_layer = split2[0], .last_layer = split2[1]};
    ASSERT(model_load(&m, model_dir, &o, be) == ERR_OK);
    const KvCacheParams p = model_kv_params(&m, 4, 4);
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    PpStage *st = NULL;
    CHECK(pp_stage_create(&m, &kv, 0, 2, master, 0x600d, &st) == ERR_INVAL);
    CHECK(st == NULL);
    pthread_join(th, NULL);
    CHECK(a1.result == ERR_INVAL);
    kv_free(&kv);
    model_free(&m);
}

int main(void)
{
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    snprintf(model_dir, sizeof model_dir, "%s/tests/golden/models/dsa_modelopt", src ? src : ".");
    Backend *be;
    Model m;
    ASSERT(backend_cpu_create(1, &be) == ERR_OK);
    ASSERT(model_load(&m, model_dir, NULL, be) == ERR_OK);
    {
        const KvCacheParams p = model_kv_params(&m, 32, 4);
        KvCache kv;
        ASSERT(kv_init(&kv, &p) == ERR_OK);
        for (int i = 0; i < N_REQ; i++)
            sched_test_greedy(&m, &kv, sched_test_prompts[i], sched_test_prompt_len[i], MAX_TOK,
                              reference[i]);
        kv_free(&kv);
    }
    test_single_stage(&m);
    test_logprobs_and_force(&m);
    test_prefix_caching(&m);
    test_prefix_caching_pipeline(be);
    test_masks(&m, be);
    test_pipeline(&m, be);
    test_handshake_mismatch(be);
    model_free(&m);
    be->destroy(be);
    return check_exit();
}
