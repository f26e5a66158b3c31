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
 * handshake.
 *
 * The model is tests/golden/models/dsa_modelopt (found through GLMSPARK_SOURCE_DIR).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/err.h"
#include "engine/backend.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/pp.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "tests/check.h"

enum { N_REQ = 4, MAX_TOK = 10, MAX_OUT = 64 };

static char model_dir[1024];

static const int32_t prompts[N_REQ][20] = {
    {88, 64, 203, 76, 229, 208, 179},
    {112, 14, 190},
    {203, 165, 70, 26, 224, 72, 181, 124, 88, 113, 17, 5, 9, 33, 47, 51, 60, 2, 7, 99},
    {42},
};
static const int prompt_len[N_REQ] = {7, 3, 20, 1};
static int32_t reference[N_REQ][MAX_TOK];

// Greedy decoding of prompt alone.
static void generate_alone(Model *m, KvCache *kv, const int32_t *prompt, int n, int32_t *out)
{
    Sampler s;
    ASSERT(sampler_init(&s, m->cfg.vocab_size, sampler_default_params()) == ERR_OK);
    float *logits = malloc((size_t) m->cfg.vocab_size * sizeof *logits);
    ASSERT(logits);
    KvSeq seq = {0};
    ASSERT(model_forward(m, kv, &seq, prompt, n, logits, false) == ERR_OK);
    for (int i = 0; i < MAX_TOK; i++) {
        out[i] = sampler_sample(&s, logits);
        if (i + 1 < MAX_TOK)
            ASSERT(model_forward(m, kv, &seq, &out[i], 1, logits, false) == ERR_OK);
    }
    kv_seq_free(kv, &seq);
    free(logits);
    sampler_free(&s);
}

// ---------------------------------------------------------------------------
// Event collection

typedef struct Collected {
    int32_t tokens[N_REQ][MAX_OUT];
    int n[N_REQ];
    SchedFinish finish[N_REQ];
    int n_events;
    int order[512];  // request id of each event, in order
} Collected;

static void on_event(void *user, const SchedEvent *ev)
{
    Collected *c = user;
    ASSERT(ev->id < N_REQ);
    const int i = (int) ev->id;
    if (ev->token >= 0) {
        ASSERT(c->n[i] < MAX_OUT);
        c->tokens[i][c->n[i]++] = ev->token;
        CHECK(ev->n_generated == c->n[i]);
    }
    CHECK(c->finish[i] == SCHED_FINISH_NONE);  // nothing after the last event
    c->finish[i] = ev->finish;
    if (c->n_events < 512) c->order[c->n_events] = i;
    c->n_events++;
}

static SchedRequest request(int i, int max_tokens)
{
    SchedRequest r = {.id = (uint64_t) i,
                      .prompt = prompts[i],
                      .n_prompt = prompt_len[i],
                      .max_tokens = max_tokens,
                      .ignore_eos = true};
    r.sampling = sampler_default_params();
    return r;
}

static void run_until_idle(Scheduler *s, int *max_inflight)
{
    int guard = 0;
    while (sched_has_work(s) && guard++ < 10000) {
        CHECK(sched_step(s) == ERR_OK);
        SchedStats st;
        sched_stats(s, &st);
        if (max_inflight && st.n_inflight + 1 > *max_inflight) *max_inflight = st.n_inflight + 1;
    }
    CHECK(!sched_has_work(s));
}

static void check_reference(const Collected *c)
{
    for (int i = 0; i < N_REQ; i++) {
        CHECK(c->n[i] == MAX_TOK);
        CHECK(c->finish[i] == SCHED_FINISH_LENGTH);
        CHECK(memcmp(c->tokens[i], reference[i], sizeof reference[i]) == 0);
    }
}

// ---------------------------------------------------------------------------
// One stage

static void test_single_stage(Model *m)
{
    KvCacheParams p = model_kv_params(m, 24, 4);
    KvCache kv;
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    PpStage *stage;
    ASSERT(pp_stage_create(m, &kv, 0, 1, NULL, 0, &stage) == ERR_OK);

    // Concurrent, generous budget; then a 3-token budget (chunked prefill).
    const int budgets[2] = {512, 3};
    for (int k = 0; k < 2; k++) {
        Collected *c = calloc(1, sizeof *c);
        Scheduler *s;
        const SchedParams sp = {.max_num_seqs = 8,
                                .max_num_batched_tokens = budgets[k],
                                .on_event = on_event,
                                .user = c};
        ASSERT(sched_create(stage, m, &kv, &sp, &s) == ERR_OK);
        for (int i = 0; i < N_REQ; i++) {
            const SchedRequest r = request(i, MAX_TOK);
            CHECK(sched_submit(s, &r) == ERR_OK);
        }
        run_until_idle(s, NULL);
        check_reference(c);
        SchedStats st;
        sched_stats(s, &st);
        CHECK(st.max_batch_tokens <= budgets[k]);
        CHECK(kv_n_free_blocks(&kv) == 24);  // every sequence freed on the rank
        printf("budget %d: %llu micro-batches, %llu tokens, largest %d\n", budgets[k],
               (unsigned long long) st.n_microbatches, (unsigned long long) st.n_tokens,
               st.max_batch_tokens);
        sched_destroy(s);
        free(c);
    }

    // A long prefill (20 tokens, budget 4) next to a decoding sequence: the decoding one
    // gets a token from every micro-batch (delayed by at most one chunk).
    {
        Collected *c = calloc(1, sizeof *c);
        Scheduler *s;
        const SchedParams sp = {
            .max_num_seqs = 8, .max_num_batched_tokens = 4, .on_event = on_event, .user = c};
        ASSERT(sched_create(stage, m, &kv, &sp, &s) == ERR_OK);
        SchedRequest r = request(3, 30);
        CHECK(sched_submit(s, &r) == ERR_OK);
        CHECK(sched_step(s) == ERR_OK);  // prefill of the 1-token prompt: first token
        CHECK(c->n[3] == 1);
        r = request(2, 2);
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
        run_until_idle(s, NULL);
        CHECK(c->finish[3] == SCHED_FINISH_CANCELLED);
        CHECK(c->n[3] < 30);
        CHECK(c->finish[2] == SCHED_FINISH_LENGTH && c->n[2] == 2);
        CHECK(kv_n_free_blocks(&kv) == 24 && kv_n_free_blocks(&kv) > free_before);
        sched_destroy(s);
        free(c);
    }

    // Stop ids, a cancelled queued request, bad requests, a request larger than the cache.
    {
        Collected *c = calloc(1, sizeof *c);
        Scheduler *s;
        const SchedParams sp = {.max_num_seqs = 1, .on_event = on_event, .user = c};
        ASSERT(sched_create(stage, m, &kv, &sp, &s) == ERR_OK);
        SchedRequest r = request(0, MAX_TOK);
        r.stop_ids[0] = reference[0][2];
        r.n_stop_ids = 1;
        CHECK(sched_submit(s, &r) == ERR_OK);
        r = request(1, MAX_TOK);
        CHECK(sched_submit(s, &r) == ERR_OK);
        sched_cancel(s, 1);    // still queued behind request 0 (max_num_seqs 1)
        r = request(2, 1000);  // 1020 positions > 24 blocks of 4
        CHECK(sched_submit(s, &r) == ERR_OK);
        SchedRequest bad = request(3, 0);
        CHECK(sched_submit(s, &bad) == ERR_INVAL);
        bad = request(3, 5);
        const int32_t oov[1] = {100000};
        bad.prompt = oov;
        CHECK(sched_submit(s, &bad) == ERR_INVAL);
        run_until_idle(s, NULL);
        int first_stop = 0;
        while (reference[0][first_stop] != reference[0][2])
            first_stop++;
        CHECK(c->finish[0] == SCHED_FINISH_STOP && c->n[0] == first_stop + 1);
        CHECK(c->finish[1] == SCHED_FINISH_CANCELLED && c->n[1] == 0);
        CHECK(c->finish[2] == SCHED_FINISH_ERROR && c->n[2] == 0);
        CHECK(kv_n_free_blocks(&kv) == 24);
        sched_destroy(s);
        free(c);
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

static void *rank_main(void *arg)
{
    RankArgs *a = arg;
    Backend *be = NULL;
    Model m;
    KvCache kv = {0};
    PpStage *st = NULL;
    a->result = ERR_IO;
    const ModelOptions o = {.first_layer = split[a->rank], .last_layer = split[a->rank + 1]};
    if (backend_cpu_create(1, &be) || model_load(&m, model_dir, &o, be)) return NULL;
    const KvCacheParams p = model_kv_params(&m, 24, 4);
    if (kv_init(&kv, &p) == ERR_OK
        && pp_stage_create(&m, &kv, a->rank, 3, a->master, a->hash, &st) == ERR_OK)
        a->result = pp_serve(st);
    pp_stage_destroy(st);
    kv_free(&kv);
    model_free(&m);
    be->destroy(be);
    return NULL;
}

static int free_port(void)
{
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    ASSERT(fd >= 0 && bind(fd, (struct sockaddr *) &sa, sizeof sa) == 0
           && getsockname(fd, (struct sockaddr *) &sa, &len) == 0);
    close(fd);
    return ntohs(sa.sin_port);
}

static void test_pipeline(Backend *be)
{
    char master[64];
    snprintf(master, sizeof master, "127.0.0.1:%d", free_port());
    const uint64_t hash = 0x5eed;
    RankArgs args[3] = {{0}, {1, master, hash, ERR_OK}, {2, master, hash, ERR_OK}};
    pthread_t th[3];
    for (int r = 1; r < 3; r++)
        ASSERT(pthread_create(&th[r], NULL, rank_main, &args[r]) == 0);

    Model m;
    KvCache kv;
    const ModelOptions o = {.first_layer = 0, .last_layer = 1};
    ASSERT(model_load(&m, model_dir, &o, be) == ERR_OK);
    const KvCacheParams p = model_kv_params(&m, 24, 4);
    ASSERT(kv_init(&kv, &p) == ERR_OK);
    PpStage *stage;
    CHECK(pp_stage_create(&m, &kv, 0, 3, master, hash, &stage) == ERR_OK);
    if (stage) {
        Collected *c = calloc(1, sizeof *c);
        Scheduler *s;
        const SchedParams sp = {
            .max_num_seqs = 8, .max_num_batched_tokens = 5, .on_event = on_event, .user = c};
        ASSERT(sched_create(stage, &m, &kv, &sp, &s) == ERR_OK);
        for (int i = 0; i < N_REQ; i++) {
            const SchedRequest r = request(i, MAX_TOK);
            CHECK(sched_submit(s, &r) == ERR_OK);
        }
        int max_inflight = 0;
        run_until_idle(s, &max_inflight);
        check_reference(c);
        CHECK(max_inflight == 3);  // one micro-batch per stage
        CHECK(kv_n_free_blocks(&kv) == 24);
        printf("pipeline of 3: up to %d micro-batches in flight\n", max_inflight);
        sched_destroy(s);
        free(c);
        CHECK(pp_end(stage) == ERR_OK);
    }
    pp_stage_destroy(stage);
    for (int r = 1; r < 3; r++) {
        pthread_join(th[r], NULL);
        CHECK(args[r].result == ERR_OK);
    }
    kv_free(&kv);
    model_free(&m);
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
    snprintf(master, sizeof master, "127.0.0.1:%d", free_port());
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
            generate_alone(&m, &kv, prompts[i], prompt_len[i], reference[i]);
        kv_free(&kv);
    }
    test_single_stage(&m);
    test_pipeline(be);
    test_handshake_mismatch(be);
    model_free(&m);
    be->destroy(be);
    return check_exit();
}
