/*
 * sched_test_util.h - shared by the scheduler tests (test_sched.c, test_mtp_pp.c): four
 * prompts of 1 to 20 tokens and their greedy continuation with model_forward() alone (the
 * reference), a request for each, the collector of a scheduler's events, the step loop, and
 * a pipeline rank served by a thread (pp_serve) over loopback TCP.
 *
 * Requests have ids 0 .. SCHED_TEST_N_REQ - 1; a request runs until max_tokens
 * (ignore_eos) with greedy sampling and no logprobs unless the test changes it.
 */
#ifndef TESTS_ENGINE_SCHED_TEST_UTIL_H
#define TESTS_ENGINE_SCHED_TEST_UTIL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
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

enum { SCHED_TEST_N_REQ = 4, SCHED_TEST_MAX_OUT = 64, SCHED_TEST_MAX_PROMPT = 20 };

static const int32_t sched_test_prompts[SCHED_TEST_N_REQ][SCHED_TEST_MAX_PROMPT] = {
    {88, 64, 203, 76, 229, 208, 179},
    {112, 14, 190},
    {203, 165, 70, 26, 224, 72, 181, 124, 88, 113, 17, 5, 9, 33, 47, 51, 60, 2, 7, 99},
    {42},
};
static const int sched_test_prompt_len[SCHED_TEST_N_REQ] = {7, 3, 20, 1};

// out [n_out]: greedy decoding of prompt [n] alone (kv: room for n + n_out positions).
static inline void sched_test_greedy(Model *m, KvCache *kv, const int32_t *prompt, int n, int n_out,
                                     int32_t *out)
{
    Sampler s;
    ASSERT(sampler_init(&s, m->cfg.vocab_size, sampler_default_params()) == ERR_OK);
    float *logits = malloc((size_t) m->cfg.vocab_size * sizeof *logits);
    ASSERT(logits);
    KvSeq seq = {0};
    ASSERT(model_forward(m, kv, &seq, prompt, n, logits, false) == ERR_OK);
    for (int i = 0; i < n_out; i++) {
        out[i] = sampler_sample(&s, logits);
        if (i + 1 < n_out) ASSERT(model_forward(m, kv, &seq, &out[i], 1, logits, false) == ERR_OK);
    }
    kv_seq_free(kv, &seq);
    free(logits);
    sampler_free(&s);
}

// Request i: prompt i, max_tokens, greedy, to the end (ignore_eos), no logprobs.
static inline SchedRequest sched_test_request(int i, int max_tokens)
{
    SchedRequest r = {.id = (uint64_t) i,
                      .prompt = sched_test_prompts[i],
                      .n_prompt = sched_test_prompt_len[i],
                      .max_tokens = max_tokens,
                      .ignore_eos = true,
                      .n_top_logprobs = -1};
    r.sampling = sampler_default_params();
    return r;
}

// ---------------------------------------------------------------------------
// Events

// What a scheduler reported, per request: tokens with their logprobs and top alternatives,
// and how it finished; the request id of every event in order.
typedef struct SchedTestEvents {
    int32_t tokens[SCHED_TEST_N_REQ][SCHED_TEST_MAX_OUT];
    int n[SCHED_TEST_N_REQ];
    SchedFinish finish[SCHED_TEST_N_REQ];
    int n_events;
    int order[512];  // request id of each event, in order (the first 512)
    float logprob[SCHED_TEST_N_REQ][SCHED_TEST_MAX_OUT];
    int n_top[SCHED_TEST_N_REQ][SCHED_TEST_MAX_OUT];
    int32_t top_ids[SCHED_TEST_N_REQ][SCHED_TEST_MAX_OUT][SCHED_MAX_TOP_LOGPROBS];
    float top_logprobs[SCHED_TEST_N_REQ][SCHED_TEST_MAX_OUT][SCHED_MAX_TOP_LOGPROBS];
} SchedTestEvents;

// SchedParams.on_event with user = a SchedTestEvents: records the event and checks that
// nothing follows a request's last event and that n_generated counts its tokens.
static inline void sched_test_on_event(void *user, const SchedEvent *ev)
{
    SchedTestEvents *c = user;
    ASSERT(ev->id < SCHED_TEST_N_REQ);
    const int i = (int) ev->id;
    CHECK(c->finish[i] == SCHED_FINISH_NONE);  // nothing after the last event
    if (ev->token >= 0) {
        ASSERT(c->n[i] < SCHED_TEST_MAX_OUT);
        ASSERT(ev->n_top >= 0 && ev->n_top <= SCHED_MAX_TOP_LOGPROBS);
        c->logprob[i][c->n[i]] = ev->logprob;
        c->n_top[i][c->n[i]] = ev->n_top;
        memcpy(c->top_ids[i][c->n[i]], ev->top_ids, sizeof ev->top_ids);
        memcpy(c->top_logprobs[i][c->n[i]], ev->top_logprobs, sizeof ev->top_logprobs);
        c->tokens[i][c->n[i]++] = ev->token;
        CHECK(ev->n_generated == c->n[i]);
    }
    c->finish[i] = ev->finish;
    if (c->n_events < 512) c->order[c->n_events] = i;
    c->n_events++;
}

// A scheduler on stage with sp (its on_event and user replaced) whose events go to a fresh
// SchedTestEvents in *events (calloc'd; sched_test_close frees both).
static inline Scheduler *sched_test_open(PpStage *stage, const Model *m, KvCache *kv,
                                         SchedParams sp, SchedTestEvents **events)
{
    *events = calloc(1, sizeof **events);
    ASSERT(*events);
    sp.on_event = sched_test_on_event;
    sp.user = *events;
    Scheduler *s;
    ASSERT(sched_create(stage, m, kv, &sp, &s) == ERR_OK);
    return s;
}

static inline void sched_test_close(Scheduler *s, SchedTestEvents *events)
{
    sched_destroy(s);
    free(events);
}

// Steps s until it has no work (at most 10000 steps), each step checked; max_inflight
// (NULL: not kept) gets the most micro-batches seen in flight.
static inline void sched_test_run(Scheduler *s, int *max_inflight)
{
    int guard = 0;
    while (sched_has_work(s) && guard++ < 10000) {
        const Err e = sched_step(s);
        if (e) fprintf(stderr, "sched_step: %s\n", err_name(e));
        CHECK(e == ERR_OK);
        SchedStats st;
        sched_stats(s, &st);
        if (max_inflight && st.n_inflight + 1 > *max_inflight) *max_inflight = st.n_inflight + 1;
    }
    CHECK(!sched_has_work(s));
}

// ---------------------------------------------------------------------------
// Pipeline ranks in threads

// One rank other than 0: its layers [split[rank], split[rank + 1]) of dir on a one-thread
// CPU backend, a cache of n_blocks blocks of 4, served until rank 0 ends the pipeline. The
// last rank loads the MTP layer when is_mtp_last, and on_last_stage (NULL: none) sees its
// stage before it serves.
typedef struct SchedTestRank {
    int rank, world;
    const char *dir, *master;
    const int *split;  // [world + 1] layer bounds; borrowed
    int n_blocks;
    uint64_t hash;
    bool is_mtp_last;
    void (*on_last_stage)(PpStage *st, void *user);
    void *user;
    Err result;  // pp_serve's, or ERR_IO when the rank could not start
} SchedTestRank;

static inline void *sched_test_rank_main(void *arg)
{
    SchedTestRank *a = arg;
    const bool is_last = a->rank == a->world - 1;
    Backend *be = NULL;
    Model m;
    KvCache kv = {0};
    PpStage *st = NULL;
    a->result = ERR_IO;
    const ModelOptions o = {.load_mtp = is_last && a->is_mtp_last,
                            .first_layer = a->split[a->rank],
                            .last_layer = a->split[a->rank + 1]};
    if (backend_cpu_create(1, &be) || model_load(&m, a->dir, &o, be)) return NULL;
    const KvCacheParams p = model_kv_params(&m, a->n_blocks, 4);
    if (kv_init(&kv, &p) == ERR_OK
        && pp_stage_create(&m, &kv, a->rank, a->world, a->master, a->hash, &st) == ERR_OK) {
        if (is_last && a->on_last_stage) a->on_last_stage(st, a->user);
        a->result = pp_serve(st);
    }
    pp_stage_destroy(st);
    kv_free(&kv);
    model_free(&m);
    be->destroy(be);
    return NULL;
}

// Ranks 1 .. proto->world - 1 in threads th[1..]: r[i] is proto as rank i (r and th have
// room for world entries and must outlive sched_test_join_ranks).
static inline void sched_test_start_ranks(const SchedTestRank *proto, SchedTestRank *r,
                                          pthread_t *th)
{
    for (int i = 0; i < proto->world; i++) {
        r[i] = *proto;
        r[i].rank = i;
        r[i].result = ERR_OK;
    }
    for (int i = 1; i < proto->world; i++)
        ASSERT(pthread_create(&th[i], NULL, sched_test_rank_main, &r[i]) == 0);
}

// Waits for the threads of sched_test_start_ranks; each rank's pp_serve succeeded.
static inline void sched_test_join_ranks(SchedTestRank *r, pthread_t *th)
{
    for (int i = 1; i < r[0].world; i++) {
        pthread_join(th[i], NULL);
        CHECK(r[i].result == ERR_OK);
    }
}

#endif  // TESTS_ENGINE_SCHED_TEST_UTIL_H
