/*
 * pp.h - pipeline parallelism: the layer-split planner, rank discovery, the local launcher
 * (`--pp N`) and the stage runtime that moves batches through the ranks.
 *
 * Planner: contiguous decoder-layer ranges, one per rank, minimising the largest rank's
 * bytes (weights + KV cache at the configured context); rank 0 also holds the embeddings,
 * the last rank the final norm, lm_head and the MTP layer(s). Per rank it reports the
 * weight bytes, the room left for the KV cache within mem_bytes * mem_utilization, and the
 * longest context that room holds.
 *
 * Runtime: rank 0 drives. pp_submit() hands the pipeline one micro-batch: a list of
 * sequence operations (slot, new tokens, flags) and the token ids. Rank 0 runs its layers
 * and sends the activations on; each rank runs its layers (its own KV cache, its own
 * KvSeq per slot) and passes them on; the last rank computes logits, samples with the
 * slot's sampler (params travel with PP_SEQ_START; the history is the tokens fed) and
 * sends the token ids (and logits when asked) back to rank 0, where pp_collect() returns
 * them in submission order. Up to `world` micro-batches may be in flight, so every stage
 * works when several are queued. With world == 1 the same calls run everything locally.
 * MTP (mtp.h): slots started with mtp_k draft on the last rank after each sample; the
 * drafts come back in PpResult.mtp, the next op carries them (n_draft) for verification
 * and the previous op's rejected positions (n_rollback), which every rank drops.
 *
 * Ownership: PpStage borrows the Model and KvCache (they must outlive it) and owns its
 *            comm, per-slot KV sequences, samplers and buffers.
 * Threads:   one thread drives a PpStage (pp_comm has its own heartbeat thread).
 * Errors:    ERR_IO when a peer fails (logged once, naming rank and host), ERR_INVAL for
 *            bad plans or handshakes, ERR_AGAIN when a rank's KV cache is full (fatal for
 *            the pipeline: slots would diverge), ERR_NOMEM.
 */
#ifndef ENGINE_PIPELINE_PP_H
#define ENGINE_PIPELINE_PP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/model/config.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/model/sampler.h"
#include "engine/pipeline/mtp.h"
#include "engine/pipeline/pp_comm.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------
// Planner

typedef struct PpPlanInput {
    int world;
    int n_layers;                       // decoder layers
    const uint64_t *layer_bytes;        // [n_layers] weight bytes of each decoder layer
    uint64_t first_bytes;               // rank 0 only: embeddings
    uint64_t last_bytes;                // last rank only: final norm, lm_head, MTP layer(s)
    uint64_t kv_bytes_per_token_layer;  // KV cache bytes per token per layer
    int context;                        // positions the KV cache must hold on every rank
    uint64_t mem_bytes;                 // memory per rank
    double mem_utilization;             // fraction of mem_bytes we may use (0 means 0.9)
    uint64_t reserve_bytes;             // per rank: activations, workspaces, runtime
} PpPlanInput;

typedef struct PpRankPlan {
    int first_layer, last_layer;  // [first, last)
    uint64_t weight_bytes;
    uint64_t kv_room_bytes;  // budget - weights - reserve (0 when negative)
    int64_t max_context;     // positions the room holds for this rank's layers
} PpRankPlan;

typedef struct PpPlan {
    int world;
    PpRankPlan ranks[PP_MAX_WORLD];
    bool fits;  // every rank holds its weights and `context` positions
} PpPlan;

// Split the layers: minimise the largest rank's (weights + KV at context). ERR_INVAL (logged)
// when world is out of range or larger than the layer count. A plan that does not fit is
// still returned, with fits == false.
Err pp_plan(const PpPlanInput *in, PpPlan *out);

// Estimated weight bytes of decoder layer l (and of the embeddings / the head) from the
// config alone, for configs without a checkpoint: NVFP4 experts at 4.5 bits per weight
// when cfg->quant is NVFP4, BF16 elsewhere, as NVIDIA's GLM-5 NVFP4 exports store them.
uint64_t pp_estimate_layer_bytes(const ModelConfig *cfg, int l);
uint64_t pp_estimate_embed_bytes(const ModelConfig *cfg);
// KV bytes per token per layer in a cache of this type: the entry of kv_cache.h with the
// indexer key counted on every layer when the model has an indexer (an upper bound: only
// the layers that own an indexer store one).
uint64_t pp_kv_bytes_per_token_layer(const ModelConfig *cfg, KvDtype dtype);

// pp_plan() with the per-layer bytes of the checkpoint in dir (its headers only; MTP
// layers, the final norm and lm_head count for the last rank, the embeddings for rank 0).
Err pp_plan_model(const char *dir, const ModelConfig *cfg, int world, uint64_t mem_bytes,
                  double mem_utilization, int context, KvDtype kv_dtype, PpPlan *plan);

// A stable hash of the config and the plan's split, for the handshake.
uint64_t pp_plan_hash(const ModelConfig *cfg, const PpPlan *plan, uint64_t extra);

// Parse "121G", "900M", "64GiB", "1e9" into bytes; false when malformed.
bool pp_parse_bytes(const char *s, uint64_t *out);

// ---------------------------------------------------------------------------
// Ranks and the local launcher

// Rank and world from the launcher's environment (OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE,
// SLURM_PROCID/NTASKS). Returns false when none is set.
bool pp_rank_from_env(int *rank, int *world);

// Start `world` ranks of this program on this host: re-executes /proc/self/exe with argv
// plus "--rank R --world N --master 127.0.0.1:PORT --local-rank R" (the caller's --pp is
// removed; --local-rank picks the GPU of a device backend), every
// child in one process group that dies with the parent (PR_SET_PDEATHSIG). The master's
// port is bound here, before the ranks start, and rank 0 inherits the listening socket
// (PP_LISTEN_FD_ENV, pp_comm.h), so no other process can take it in between. Waits for all;
// when one fails, kills the rest of the group 2 s later. Rank 0's stdout is the
// command's. Returns the exit status for main (0 when every rank succeeded).
int pp_launch_local(int argc, char **argv, int world);

// ---------------------------------------------------------------------------
// Stage runtime

enum {
    PP_MAX_SLOTS = 256,
    PP_MAX_INFLIGHT = PP_MAX_WORLD,
};

enum {
    PP_SEQ_START = 1,   // a new sequence in this slot: reset its cache, take params
    PP_SEQ_SAMPLE = 2,  // sample the next token from the last position's logits
    PP_SEQ_LOGITS = 4,  // return the logits of every new position
    PP_SEQ_FREE = 8,    // free the slot after this step (n_new may be 0: free only)
    PP_SEQ_MASK = 16,   // sample only among the ids a vocabulary mask allows (with
                        // PP_SEQ_SAMPLE, no drafts): the batch's extra ids carry
                        // pp_mask_words() words per such op, after every cached prefix,
                        // in op order; bit id % 32 of word id / 32 allows id
};

typedef struct PpSeqOp {
    int32_t slot;
    int32_t n_new;   // tokens of this sequence in the batch (0 only with PP_SEQ_FREE)
    uint32_t flags;  // PP_SEQ_*
    // MTP speculative decoding (mtp.h). With PP_SEQ_START: mtp_k drafts per sample (0:
    // off; the last rank needs the MTP layer). n_draft: the op's last n_draft tokens are
    // the drafts the previous result proposed (a prefix of them), verified by the last
    // rank (needs PP_SEQ_SAMPLE and n_new == 1 + n_draft). n_rollback: positions every
    // rank drops from the slot's cache before this op: the drafts the previous result
    // rejected (its n_draft + 1 - n_emit); the last rank checks it.
    int32_t mtp_k;
    int32_t n_draft;
    int32_t n_rollback;
    // Prefix caching (kv_cache.h). With PP_SEQ_START: the slot starts with n_cached blocks of
    // cached prefix (n_cached * block_size positions; slots without MTP only); the batch's
    // extra ids carry their block ids, then their tokens (the last rank's sampler history).
    // With PP_SEQ_FREE: the slot's blocks publish_first .. publish_last-1 are published
    // (kept as cached prefix) before the slot is freed.
    int32_t n_cached;
    int32_t publish_first, publish_last;
    SamplerParams params;  // with PP_SEQ_START
} PpSeqOp;

typedef struct PpResult {
    int n_ops;
    int32_t *tokens;  // [n_ops] sampled id per op, -1 when not sampled; owned by the stage
                      // (MTP ops: the last emitted token)
    float *logits;    // [n_rows, vocab] of the ops with PP_SEQ_LOGITS, in op order
    int n_rows;
    MtpOut *mtp;      // [n_ops] when the batch has ops of MTP slots (else NULL): the
                      // emitted tokens and next drafts of each (n_emit 0 for other ops)
} PpResult;

typedef struct PpStage PpStage;

// Connect this rank (pp_comm_init) and prepare slots for a model loaded with this rank's
// layer range. kv: this rank's cache. The last rank of a model loaded with its MTP layer
// (load_mtp) also keeps an MTP cache of kv's block count for slots started with mtp_k.
// On failure *out is NULL.
Err pp_stage_create(Model *m, KvCache *kv, int rank, int world, const char *master,
                    uint64_t config_hash, PpStage **out);

// Rank 0: run one micro-batch (ops[0..n_ops), tokens = concatenation of their new tokens,
// then the extra ids of their n_cached prefixes in op order: for each such op its n_cached
// block ids, then its n_cached * block_size prefix tokens; then the masks of PP_SEQ_MASK
// ops). At most `world` submits may be outstanding.
Err pp_submit(PpStage *s, const PpSeqOp *ops, int n_ops, const int32_t *tokens);

// Rank 0: the result of the oldest outstanding submit. out's arrays are valid until the
// next pp_collect().
Err pp_collect(PpStage *s, PpResult *out);

// Ranks > 0: serve micro-batches until rank 0 ends the pipeline (ERR_OK) or a peer fails.
Err pp_serve(PpStage *s);

// Rank 0: end the pipeline in order (every rank returns from pp_serve). Nothing may be
// outstanding.
Err pp_end(PpStage *s);

// 32-bit words of a PP_SEQ_MASK op's vocabulary mask: ceil(vocab_size / 32).
int pp_mask_words(const PpStage *s);

// Micro-batches submitted and not yet collected.
int pp_inflight(const PpStage *s);

// Where this rank's time went, totals since pp_stage_create: the batches it ran, the wall
// seconds inside model_forward_batch and the MTP drafts' forwards (the backend's ops,
// waiting for the device and the logits' download included) and sampling the rows (the last
// rank). A caller differences two
// snapshots to time a phase (generate --n-seqs: its decode phase per batch).
typedef struct PpStageTimes {
    long long batches;
    double forward_s, sample_s;
} PpStageTimes;
PpStageTimes pp_stage_times(const PpStage *s);

// The pipeline's world size (stages).
int pp_world(const PpStage *s);

// Host name and process id of rank r as exchanged in the handshake (this process's own for
// a pipeline of one); "" and 0 when r is out of range.
const char *pp_rank_host(const PpStage *s, int r);
int pp_rank_pid(const PpStage *s, int r);

// The last rank's MTP state (drafting counters, the test hook), NULL on other ranks or
// without an MTP layer.
MtpStage *pp_mtp(PpStage *s);

// Positions slot holds in this rank's cache (0 when free), for tests.
int pp_slot_positions(const PpStage *s, int slot);

// The KV sequence of slot in this rank's cache (rank 0's scheduler publishes its blocks).
const KvSeq *pp_slot_seq(const PpStage *s, int slot);

// Release everything; closes the connections (a rank that has not ended sees a failure).
void pp_stage_destroy(PpStage *s);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_PIPELINE_PP_H
