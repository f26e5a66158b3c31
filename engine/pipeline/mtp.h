/*
 * mtp.h - speculative decoding with the model's MTP layer: draft K tokens with the MTP
 * layer, verify them in one batched forward of the main model, keep the accepted prefix.
 *
 * One step, with P positions in the main cache and x_P the last emitted token (not yet in
 * it): the MTP layer runs over its pending rows (main hidden h_p after model.norm, token
 * p+1) up to position P-1, whose last row drafts d_1; d_k for k > 1 comes from the MTP's
 * own output hidden state fed back with d_{k-1} at position P+k-2 (vLLM's recursion).
 * The main model then runs [x_P, d_1 .. d_K] at positions P .. P+K (n = 1 + K), giving K+1
 * target rows. Temperature 0: d_i is kept while it equals the target row's argmax (ties to
 * the lowest id, as sampler.h); the first mismatch, or the row after the last draft, gives
 * the emitted correction/bonus token, so the output is the plain greedy output. Temperature
 * T > 0: d_i ~ q_i = softmax(mtp_logits / T) is kept with probability min(1, p_i / q_i) for
 * p_i = softmax(target_logits / T); on rejection the token is drawn from norm(max(0, p_i -
 * q_i)); after K acceptances a bonus token from p_K. Each emitted token is distributed as
 * p (Leviathan et al. 2023). Rejected positions are rolled back by lowering n_tokens of the
 * main and the MTP sequence (later writes overwrite them; attention reads positions <= its
 * own); the MTP's recursive draft rows are always rolled back, and its rows for the
 * accepted positions are recomputed from the main model's verify hidden states next step.
 *
 * Sampling filters (top-k, top-p, min-p) and penalties change p per position and are not
 * supported with drafts: mtp_check_params() refuses them.
 *
 * Ownership: MtpGen borrows the Model, both caches and the Sampler (for its generator);
 *            it owns its two sequences and buffers, released by mtp_gen_free(). MtpStage
 *            (the pipeline's last stage, below) borrows the Model and owns the MTP cache,
 *            its per-slot state and buffers, released by mtp_stage_free().
 * Threads:   one thread per MtpGen / MtpStage (the model's workspace is shared).
 * Errors:    ERR_INVAL (no MTP layer, K outside 1..MTP_MAX_DRAFTS, unsupported sampling),
 *            ERR_AGAIN (a cache is full), ERR_NOMEM, ERR_FORMAT (an op that verifies drafts
 *            the stage did not propose, or drops the wrong positions); logged once at the
 *            site.
 */
#ifndef ENGINE_PIPELINE_MTP_H
#define ENGINE_PIPELINE_MTP_H

#include <stdbool.h>

#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/model/sampler.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MTP_MAX_DRAFTS = 8 };

typedef struct MtpStats {
    long steps;     // verify forwards
    long drafted;   // draft tokens proposed
    long accepted;  // draft tokens kept
    long emitted;   // tokens emitted by steps (accepted + one per step)
} MtpStats;

typedef struct MtpGen MtpGen;

struct MtpGen {
    Model *m;         // borrowed, loaded with load_mtp
    KvCache *kv;      // borrowed: main cache
    KvCache *mkv;     // borrowed: MTP cache (model_mtp_kv_params)
    Sampler *s;       // borrowed: its params and generator
    KvSeq seq;        // main sequence, owned
    KvSeq mseq;       // MTP sequence, owned
    int k;            // drafts per step
    int last;         // last emitted token, not yet in the main cache (-1 before prefill)
    int n_pend;       // MTP rows pending: positions mseq.n_tokens .. seq.n_tokens - 1
    int pend_cap;     // rows pend_hid/pend_tok hold
    float *pend_hid;  // [pend_cap, hidden] main hidden states of pending rows
    int *pend_tok;    // [pend_cap] the token after each pending row's position
    float *vlog;      // [k + 1, vocab] verify logits
    float *vhid;      // [k + 1, hidden] verify hidden states
    float *dlog;      // [k, vocab] draft logits
    float *hcur;      // [hidden] MTP hidden state for the recursion
    double *prob;     // [3, vocab] scratch: p, q, residual
    int drafts[MTP_MAX_DRAFTS];
    MtpStats stats;
    // Optional, temperature 0 only: replaces draft i's choice (the token at position
    // seq.n_tokens + 1 + i) with what it returns, given the MTP's logits row [vocab]. Lets
    // tests drive every acceptance length; NULL uses the MTP layer's argmax.
    int (*draft_hook)(void *user, const MtpGen *g, int i, const float *mtp_logits);
    void *hook_user;
};

// ERR_OK when params can be used with drafts (no top-k/top-p/min-p, no penalties), else
// ERR_INVAL with the reason logged.
Err mtp_check_params(const SamplerParams *p);

// mtp_check_params() without the message: true when p can be used with drafts.
bool mtp_params_ok(const SamplerParams *p);

// Prepare g for k drafts per step. m needs its MTP layer (load_mtp); mkv comes from
// model_mtp_kv_params(). On failure g is zeroed (mtp_gen_free is still safe).
Err mtp_gen_init(MtpGen *g, Model *m, KvCache *kv, KvCache *mkv, Sampler *s, int k);

// Release g's sequences and buffers; safe on a zeroed MtpGen. Zeroes *g.
void mtp_gen_free(MtpGen *g);

// Run the prompt tokens[0..n) through the main model and return the first generated token.
Err mtp_gen_prefill(MtpGen *g, const int *tokens, int n, int *first);

// One draft-and-verify step: writes 1 .. k+1 emitted tokens to out (room for k + 1) and
// their count to *n_out.
Err mtp_gen_step(MtpGen *g, int *out, int *n_out);

// ---------------------------------------------------------------------------
// MTP on the pipeline's last stage (pp.c)
//
// Under pipeline parallelism the last stage drafts: after it samples a sequence's token it
// runs the MTP layer over the rows the step committed (their final-normed hidden states,
// computed here from the residual stream model_forward_batch() hands out through act_out,
// and the token after each) and drafts K tokens by the recursion above. Rank 0 feeds the
// next op [token, d_1 .. d_j] (j <= K drafts, n_draft = j) through every stage; this
// stage verifies them against the K+1 target rows (exact match at temperature 0, the
// acceptance rule otherwise) and returns the emitted tokens and the next drafts. The
// rejected positions (j - accepted) are dropped from every rank's cache by the sequence's
// next op (PpSeqOp.n_rollback), which every rank processes in order before its forward.
// A prefill chunk's last row waits (carry) for the next chunk's first token.

// The outcome of one op of an MTP sequence on the last stage (travels back to rank 0).
typedef struct MtpOut {
    int32_t n_emit;    // tokens emitted: 0 (not sampled), else 1 .. n_draft + 1
    int32_t n_drafts;  // drafts the next op may verify (a prefix of them)
    int32_t emit[MTP_MAX_DRAFTS + 1];
    int32_t drafts[MTP_MAX_DRAFTS];
} MtpOut;

typedef struct MtpSlot {
    KvSeq mseq;           // this sequence in the MTP cache
    int k;                // drafts per step; 0: the slot runs without MTP
    int n_drafts;         // drafts of the last sample, not yet verified
    int drafts[MTP_MAX_DRAFTS];
    float *dlog;          // [k, vocab] their MTP logits (temperature > 0 only), owned
    float *carry;         // [hidden] a row waiting for its next token, owned
    bool has_carry;
    int expect_rollback;  // positions the slot's next op drops (rejected drafts)
} MtpSlot;

typedef struct MtpStage {
    Model *m;          // borrowed: the last stage's layers, head and MTP layer
    KvCache mkv;       // owned: the MTP layer's cache (the main cache's block count)
    MtpSlot *slots;    // [n_slots] owned
    int n_slots;
    void *xd, *hd;     // backend memory [cap_rows, hidden]: residual rows, normed rows
    float *ld;         // backend memory [cap_lrows, vocab]
    int cap_rows, cap_lrows;
    float *hid;        // host [cap_hrows, hidden]: the normed rows (+1 for a carry)
    int *tok;          // host [cap_hrows]: the token after each row
    int cap_hrows;
    float *vlog;       // host [MTP_MAX_DRAFTS + 1, vocab] verify logits
    float *blog;       // host [n_slots, vocab] one drafting pass's logits
    float *bhcur;      // host [n_slots, hidden] its MTP hidden states
    float *bhid;       // host [cap_brows, hidden] the first drafting pass's rows, all slots
    int *btok;         // host [cap_brows] the token after each
    int cap_brows;
    void *bdraft, *bhook;  // host [cap_bops] each: per sampling op (mtp.c)
    int *bbase;            // host [2 * cap_bops]
    int cap_bops;
    double *prob;      // host [2 * MTP_MAX_DRAFTS + 2, vocab]
    MtpStats stats;
    // Optional, temperature 0 only (tests): replaces draft i of slot's next op.
    int (*draft_hook)(void *user, int slot, int i, const float *mtp_logits);
    void *hook_user;
} MtpStage;

// Prepare the MTP side of a last stage with n_slots sequence slots; the MTP cache gets
// main->n_blocks blocks of main->block_size in main->dtype. ERR_INVAL without an MTP layer.
// On failure ms is zeroed (mtp_stage_free is safe).
Err mtp_stage_init(MtpStage *ms, Model *m, const KvCacheParams *main, int n_slots);

// Release everything; safe on a zeroed MtpStage. Zeroes *ms.
void mtp_stage_free(MtpStage *ms);

// A new sequence in slot drafting k per step (0: none) with params p (mtp_check_params).
Err mtp_slot_start(MtpStage *ms, int slot, int k, const SamplerParams *p);

// Forget slot's sequence (its MTP cache blocks are released).
void mtp_slot_end(MtpStage *ms, int slot);

// Check the positions the slot's next op drops: at least the drafts its previous op
// rejected (more when rank 0 discarded emitted tokens: the MTP rows of those go too and
// the drafts are void). ERR_FORMAT (logged) otherwise.
Err mtp_slot_rollback(MtpStage *ms, int slot, int n_rollback);

// ERR_OK when an op of n tokens whose last n_draft are drafts (sample: it samples) fits
// what slot proposed, else ERR_FORMAT (logged). Before the forward: nothing has changed yet.
Err mtp_slot_check(const MtpStage *ms, int slot, const int32_t *tokens, int n, int n_draft,
                   bool sample);

// One op of an MTP slot after the stage's forward: tokens [n] were fed (the last n_draft
// of them drafts the slot proposed, verified when sample), x [n, hidden] host is their
// residual stream (act_out), last_logits [vocab] the last row's logits as a plain decode
// computes them (used when n_draft == 0; may be modified). Samples with s, advances the
// MTP cache, drafts; writes *out. ERR_FORMAT for drafts the slot did not propose.
Err mtp_stage_op(MtpStage *ms, int slot, Sampler *s, const int32_t *tokens, int n, int n_draft,
                 bool sample, const float *x, float *last_logits, MtpOut *out);

// One op of mtp_stage_ops: mtp_stage_op's arguments.
typedef struct MtpStageOp {
    int slot;
    Sampler *s;
    const int32_t *tokens;
    int n, n_draft;
    bool sample;
    const float *x;
    float *last_logits;
    MtpOut *out;
} MtpStageOp;

// mtp_stage_op for the MTP ops of one step (distinct slots), in order, with their drafting
// batched: one MTP forward over every sampling op's rows, then one per draft depth over
// the slots drafting that deep (the MTP layer's weights and the head read once per depth
// for the whole step, not once per sequence). Each slot draws from its own sampler in the
// order mtp_stage_op would; its drafts are mtp_stage_op's wherever the backend's numbers do
// not depend on the batch (model_forward_batch). Every op is checked (ERR_FORMAT) before
// anything runs.
Err mtp_stage_ops(MtpStage *ms, const MtpStageOp *ops, int n_ops);

// The acceptance rule on probability rows, exposed for tests: p [k + 1, V] target
// distributions, q [k, V] draft distributions, drafts[k] (q_i(drafts[i]) > 0). Writes the
// emitted tokens (the accepted drafts, then the correction or bonus token) to out and
// returns their count (1 .. k+1). resid: scratch [V]. Uses sampler_uniform(s).
int mtp_accept(const double *p, const double *q, const int *drafts, int k, int V, Sampler *s,
               double *resid, int *out);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_PIPELINE_MTP_H
