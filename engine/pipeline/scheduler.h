/*
 * scheduler.h - continuous batching over the pipeline: requests in, token events out.
 *
 * Each sched_step() keeps up to n_microbatches micro-batches in flight through the
 * pipeline (pp.h; one per stage, so every stage works when enough sequences run) and
 * retires the oldest. A micro-batch holds at most max_num_batched_tokens tokens: first one
 * decode token for every running sequence that is not already in flight, then prefill
 * chunks (a long prompt is cut into chunks, so it delays the others' decode by at most
 * one chunk), then newly admitted requests, up to max_num_seqs running. A request is
 * admitted only when the KV cache can hold its prompt plus max_tokens (the block count is
 * the same on every rank), so a running sequence never runs out of cache. Sampling
 * (per-sequence params and seed) happens on the last stage; eos ids (unless ignore_eos),
 * stop ids and max_tokens end a sequence; cancel ends it at the next step. A constrained
 * request samples under the vocabulary mask its driver sets after each token. A sequence's
 * tokens do not depend on what else runs: the batched forward gives each sequence the
 * logits it would get alone (model.h).
 *
 * Driving it (one thread; engine/serve/main_engine.c or a test):
 *     sched_create(stage, &model, &kv, &params, &s);
 *     loop: sched_submit(s, &req) for new jobs (ERR_AGAIN: queue full, retry later);
 *           sched_cancel(s, id) for cancelled jobs;
 *           if (sched_has_work(s)) sched_step(s) else wait for jobs;
 *     events arrive through params.on_event during sched_step(): a token, and on the
 *     sequence's last event a finish reason.
 *
 * Ownership: the Scheduler borrows the PpStage, Model and KvCache (they outlive it) and
 *            copies each request's prompt.
 * Threads:   one thread; on_event runs on it, inside sched_step().
 * Errors:    sched_submit: ERR_INVAL (bad request), ERR_AGAIN (waiting queue full).
 *            sched_step: what pp_submit/pp_collect return (ERR_IO when a rank failed: the
 *            pipeline is gone, the caller hands its jobs back and exits).
 */
#ifndef ENGINE_PIPELINE_SCHEDULER_H
#define ENGINE_PIPELINE_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/model/sampler.h"
#include "engine/pipeline/pp.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { SCHED_MAX_STOP_IDS = 16, SCHED_MAX_TOP_LOGPROBS = 20 };

typedef enum SchedFinish {
    SCHED_FINISH_NONE,       // more tokens follow
    SCHED_FINISH_LENGTH,     // max_tokens reached
    SCHED_FINISH_STOP,       // an eos or stop id was sampled (it is this event's token)
    SCHED_FINISH_CANCELLED,  // sched_cancel()
    SCHED_FINISH_ERROR,      // could not be served (prompt + max_tokens exceeds the cache)
} SchedFinish;

typedef struct SchedEvent {
    uint64_t id;         // the request's id
    int32_t token;       // the sampled id, -1 when none (cancelled, error)
    int n_generated;     // tokens generated so far, this one included
    int n_cached;        // prompt tokens whose KV came from the prefix cache
    SchedFinish finish;  // SCHED_FINISH_NONE until the sequence's last event
    // With n_top_logprobs >= 0 (and token >= 0): the token's log-probability under the raw
    // logits (log-softmax before temperature and penalties) and the n_top most likely ids,
    // most likely first (ties: lower id first). Otherwise logprob 0 and n_top 0.
    float logprob;
    int n_top;
    int32_t top_ids[SCHED_MAX_TOP_LOGPROBS];
    float top_logprobs[SCHED_MAX_TOP_LOGPROBS];
} SchedEvent;

typedef void (*SchedEventFn)(void *user, const SchedEvent *ev);

typedef struct SchedParams {
    int max_num_seqs;            // running sequences (<= PP_MAX_SLOTS); 0 means 16
    int max_num_batched_tokens;  // tokens per micro-batch; 0 means 512
    int n_microbatches;          // in flight; 0 means the pipeline's world size
    int max_waiting;             // queued requests before ERR_AGAIN; 0 means 1024
    // MTP speculative decoding (mtp.h): the last stage drafts mtp_k tokens (1 ..
    // MTP_MAX_DRAFTS; 0: off) after each sample, the next micro-batch verifies them, and a
    // sequence gets 1 .. mtp_k + 1 events per step. The last stage needs the MTP layer
    // (load_mtp). Requests whose sampling mtp_params_ok() refuses (filters, penalties) run
    // without drafts.
    int mtp_k;
    // Prefix caching (kv_cache.h): a request reuses the cached KV blocks of the longest run
    // of full blocks its prompt shares with an earlier one (keyed by a SHA-256 chain over
    // the blocks' tokens), at least one prompt token is always computed; its own full prompt
    // blocks are published once prefilled. Outputs are the same with it or without. MTP
    // requests neither reuse nor publish (their draft cache is not kept per block).
    bool prefix_caching;
    SchedEventFn on_event;  // required
    void *user;
} SchedParams;

typedef struct SchedRequest {
    uint64_t id;            // unique among live requests
    const int32_t *prompt;  // [n_prompt], copied
    int n_prompt;           // >= 1
    int max_tokens;         // >= 1
    SamplerParams sampling;
    int32_t stop_ids[SCHED_MAX_STOP_IDS];
    int n_stop_ids;
    bool ignore_eos;
    int n_top_logprobs;  // -1: no logprobs; 0..20: the sampled token's logprob
                         // plus that many alternatives (log-softmax of the raw
                         // logits, before temperature/penalties, as OpenAI does)
    // Constrained decoding (response_format): every sampled token waits for the mask that
    // sched_set_mask() gives after the token before it (the first one: after submit).
    // Such requests run without MTP drafts.
    bool constrained;
} SchedRequest;

typedef struct Scheduler Scheduler;

// A scheduler driving stage (rank 0 of its pipeline). model: for the eos ids and the
// vocabulary; kv: rank 0's cache (its block count bounds admission; its prefix index is
// the scheduler's to keep). *out NULL on failure.
Err sched_create(PpStage *stage, const Model *model, KvCache *kv, const SchedParams *p,
                 Scheduler **out);

// Queue a request. ERR_INVAL (logged) for an empty prompt, max_tokens < 1 or token ids
// outside the vocabulary; ERR_AGAIN when max_waiting requests are queued.
Err sched_submit(Scheduler *s, const SchedRequest *r);

// Cancel request id (queued or running); its last event (SCHED_FINISH_CANCELLED) comes
// from a later sched_step(). Unknown ids are ignored.
void sched_cancel(Scheduler *s, uint64_t id);

// The sequence's next n outputs are ids[0..n) instead of sampled tokens (tool_choice
// "required"/named: the engine forces the tool-call opening); events are delivered as
// usual (logprob fields still filled from the logits); forced ids never end the sequence
// (no eos/stop check), max_tokens counts them. Calls add to what is still to force (at
// most 64 pending per sequence; ids outside the vocabulary are dropped, logged).
// ERR-free: unknown ids ignored.
void sched_force(Scheduler *s, uint64_t id, const int32_t *ids, int n);

// The vocabulary mask for constrained request id's next sampled token (words: the
// stage's pp_mask_words(), copied; bit id % 32 of word id / 32 allows id), or NULL: that
// token is unconstrained. Until this is called after each of its tokens, the request
// does not sample. Unknown or unconstrained ids are ignored. ERR_NOMEM.
Err sched_set_mask(Scheduler *s, uint64_t id, const uint32_t *words);

// True while requests are queued, running or in flight.
bool sched_has_work(const Scheduler *s);

// Fill the pipeline with micro-batches, then retire the oldest, delivering its events.
Err sched_step(Scheduler *s);

// Counters for tests and logs.
typedef struct SchedStats {
    int n_waiting, n_running, n_inflight;
    uint64_t n_microbatches;  // submitted so far
    uint64_t n_tokens;        // tokens through the model so far (prefill + decode)
    int max_batch_tokens;     // the largest micro-batch seen
    // MTP: verify ops (ops carrying drafts), drafts they carried, drafts accepted
    uint64_t mtp_steps, mtp_drafted, mtp_accepted;
    // Prefix caching: prompt tokens of the requests that looked the cache up, and of those
    // the tokens it served; blocks published (in use or cached) and cached without a user.
    uint64_t prefix_query_tokens, prefix_hit_tokens;
    int prefix_blocks, prefix_blocks_idle;
} SchedStats;
void sched_stats(const Scheduler *s, SchedStats *out);

// Free everything; running sequences are dropped without events (their slots stay as
// they are on the ranks). Safe on NULL.
void sched_destroy(Scheduler *s);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_PIPELINE_SCHEDULER_H
