/*
 * scheduler.c - continuous batching with chunked prefill over the pipeline (scheduler.h).
 *
 * Sequence life: waiting (queued, no slot) -> running (slot and KV blocks committed; the
 * first micro-batch that carries it sends PP_SEQ_START) -> finished (last event
 * delivered; a PP_SEQ_FREE op in the next micro-batch releases its slot on every rank)
 * -> gone. A sequence is in at most one micro-batch at a time: its next decode token is
 * the one the previous micro-batch sampled. Slots and block commitments are released
 * when the FREE op is submitted; ranks process micro-batches in order, so a later START
 * on the same slot finds it free.
 *
 * KV admission: a request commits ceil((n_prompt + max_tokens) / block_size) blocks of
 * rank 0's pool when admitted. Every rank's pool has the same block count (model_kv_params
 * of each stage), so no rank can run out while the commitments fit.
 *
 * Logprobs: an op that samples for a request with n_top_logprobs >= 0 also asks for the
 * raw logits (PP_SEQ_LOGITS), and the event gets the log-softmax (in double) of the row of
 * the sampled position. PP_SEQ_LOGITS returns (and the last rank computes) a row for every
 * new position, so such a request's last prompt token goes alone in a micro-batch of its
 * own: one row instead of a whole prefill chunk of vocabulary-sized rows.
 * Forcing: sched_force() queues ids that replace the next sampled tokens; they are fed
 * back like sampled ones (the last rank's sampler history is the tokens fed).
 * Prefix caching: at admission a request hashes its prompt's full blocks (SHA-256 chained
 * from block to block, so a key names the whole prefix) and takes the longest run rank 0's
 * index holds, leaving at least its last prompt token to compute; its START op carries the
 * blocks (every rank attaches the same ids: their caches move in step) and their tokens (the
 * last rank's penalty history). When its prefill has been submitted its own full prompt
 * blocks enter rank 0's index (a contiguous run: where another sequence already published a
 * prefix the run stops), and its FREE op tells every rank to publish that run, so all ranks
 * keep the same blocks cached. Commitments stay whole (a hit commits as many blocks as a
 * miss): reuse never lets admission overcommit.
 */
#include "engine/pipeline/scheduler.h"

#include <math.h>
#include <openssl/sha.h>
#include <stdlib.h>
#include <string.h>

typedef enum SeqState { SEQ_WAITING, SEQ_RUNNING, SEQ_FINISHED } SeqState;

enum { SCHED_MAX_FORCED = 64 };

typedef struct Seq {
    uint64_t id;
    int32_t *prompt;  // [n_prompt], owned
    int n_prompt;
    int n_prefilled;  // prompt tokens sent
    int max_tokens;
    int n_generated;
    SamplerParams sampling;
    int32_t stop_ids[SCHED_MAX_STOP_IDS];
    int n_stop_ids;
    bool ignore_eos;
    int n_top_logprobs;                 // -1: none
    int32_t forced[SCHED_MAX_FORCED];  // sched_force: the next outputs, from forced_head
    int forced_head, n_forced;
    SeqState state;
    int slot;      // -1 while waiting
    int n_blocks;  // committed
    int32_t last;  // the last sampled token: the next decode input
    // MTP: drafts per step (0: none), the drafts the last result proposed, the positions
    // the next op drops, the drafts the op in flight carries
    int mtp_k, n_drafts, n_rollback, n_draft_sent;
    int32_t drafts[MTP_MAX_DRAFTS];
    bool started, inflight, cancelled;
    // Prefix caching: the blocks reused (their ids on rank 0, every rank's too), the prompt
    // blocks' keys, and the run of own blocks published in rank 0's index
    int *cached_blocks;
    int n_cached_blocks;
    // Constrained decoding: each sampled token needs the mask sched_set_mask() gave after
    // the one before (has_mask false: this token is free); the op that samples takes it.
    bool is_constrained, has_mask, is_mask_fresh;
    uint32_t *mask;  // [pp_mask_words]
    uint64_t *keys;  // [n_prompt / block_size]
    int publish_first, publish_last;
    bool is_published;
} Seq;

typedef struct MicroBatch {
    Seq **seqs;   // [n_ops] the op's sequence, NULL for FREE ops
    int *n_rows;  // [n_ops] logits rows the op returns (its n_new with PP_SEQ_LOGITS, else 0)
    int n_ops;
} MicroBatch;

struct Scheduler {
    SchedParams p;
    PpStage *stage;      // borrowed
    const Model *model;  // borrowed
    int n_blocks_total, block_size, n_blocks_committed;
    Seq **waiting;  // FIFO [max_waiting]
    int n_waiting;
    Seq **running;  // [max_num_seqs] (running or finished-not-freed)
    int n_running;
    bool slot_used[PP_MAX_SLOTS];
    MicroBatch *ring;  // [n_microbatches] in-flight micro-batches, oldest at head
    int head, n_inflight;
    PpSeqOp *ops;     // [max_num_seqs] scratch for building
    int32_t *tokens;  // [max_num_batched_tokens + extra] scratch
    int cap_tokens;
    int32_t *extra;   // the batch's cached-prefix ids (pp.h), copied after the tokens
    int n_extra, cap_extra;
    // The batch's vocabulary masks (PP_SEQ_MASK), copied after the extra ids at submit: the
    // masks of its sampling ops' sequences, in op order (a batch names a slot once).
    const uint32_t *masks[PP_MAX_SLOTS];
    int n_masks;
    int mask_words;
    KvCache *kv;      // rank 0's, borrowed: the prefix index
    uint64_t prefix_query_tokens, prefix_hit_tokens;
    uint64_t n_mb_total, n_tok_total;
    uint64_t mtp_steps, mtp_drafted, mtp_accepted;
    int max_batch_tokens;
};

static void seq_destroy(Seq *q)
{
    if (!q) return;
    free(q->prompt);
    free(q->cached_blocks);
    free(q->keys);
    free(q->mask);
    free(q);
}

void sched_destroy(Scheduler *s)
{
    if (!s) return;
    for (int i = 0; i < s->n_waiting; i++)
        seq_destroy(s->waiting[i]);
    for (int i = 0; i < s->n_running; i++)
        seq_destroy(s->running[i]);
    if (s->ring)
        for (int i = 0; i < s->p.n_microbatches; i++) {
            free(s->ring[i].seqs);
            free(s->ring[i].n_rows);
        }
    free(s->ring);
    free(s->waiting);
    free(s->running);
    free(s->ops);
    free(s->tokens);
    free(s->extra);
    free(s);
}

Err sched_create(PpStage *stage, const Model *model, KvCache *kv, const SchedParams *p,
                 Scheduler **out)
{
    *out = NULL;
    ASSERT(p->on_event);
    Scheduler *s = calloc(1, sizeof *s);
    if (!s) return ERR_NOMEM;
    s->p = *p;
    if (s->p.max_num_seqs <= 0) s->p.max_num_seqs = 16;
    if (s->p.max_num_batched_tokens <= 0) s->p.max_num_batched_tokens = 512;
    if (s->p.max_waiting <= 0) s->p.max_waiting = 1024;
    if (s->p.n_microbatches <= 0) s->p.n_microbatches = stage ? pp_world(stage) : 1;
    if (s->p.mtp_k < 0 || s->p.mtp_k > MTP_MAX_DRAFTS) {
        LOG_ERROR("scheduler: %d MTP drafts per step (0 .. %d)", s->p.mtp_k, MTP_MAX_DRAFTS);
        free(s);
        return ERR_INVAL;
    }
    if (s->p.max_num_seqs > PP_MAX_SLOTS || s->p.n_microbatches > PP_MAX_INFLIGHT) {
        LOG_ERROR("scheduler: max_num_seqs %d (at most %d) or %d micro-batches (at most %d) out "
                  "of range",
                  s->p.max_num_seqs, PP_MAX_SLOTS, s->p.n_microbatches, PP_MAX_INFLIGHT);
        free(s);
        return ERR_INVAL;
    }
    s->stage = stage;
    s->model = model;
    s->kv = kv;
    s->n_blocks_total = kv->params.n_blocks;
    s->block_size = kv->params.block_size;
    s->mask_words = pp_mask_words(stage);
    s->waiting = calloc((size_t) s->p.max_waiting, sizeof *s->waiting);
    s->running = calloc((size_t) s->p.max_num_seqs, sizeof *s->running);
    s->ring = calloc((size_t) s->p.n_microbatches, sizeof *s->ring);
    // A micro-batch holds an op per running sequence plus a FREE op per sequence that
    // finished since the last one (their slots differ): up to twice max_num_seqs ops.
    const size_t max_ops = 2 * (size_t) s->p.max_num_seqs;
    s->ops = calloc(max_ops, sizeof *s->ops);
    s->cap_tokens = s->p.max_num_batched_tokens + 1;
    s->tokens = calloc((size_t) s->cap_tokens, sizeof *s->tokens);
    bool ok = s->waiting && s->running && s->ring && s->ops && s->tokens;
    for (int i = 0; ok && i < s->p.n_microbatches; i++) {
        s->ring[i].seqs = calloc(max_ops, sizeof(Seq *));
        s->ring[i].n_rows = calloc(max_ops, sizeof(int));
        ok = s->ring[i].seqs && s->ring[i].n_rows;
    }
    if (!ok) {
        sched_destroy(s);
        return ERR_NOMEM;
    }
    *out = s;
    return ERR_OK;
}

Err sched_submit(Scheduler *s, const SchedRequest *r)
{
    const int V = s->model->cfg.vocab_size;
    if (r->n_prompt < 1 || r->max_tokens < 1 || r->n_stop_ids < 0
        || r->n_stop_ids > SCHED_MAX_STOP_IDS || r->n_top_logprobs < -1
        || r->n_top_logprobs > SCHED_MAX_TOP_LOGPROBS) {
        LOG_ERROR("request %llu: needs a prompt, max_tokens >= 1, at most %d stop ids and "
                  "n_top_logprobs in -1..%d",
                  (unsigned long long) r->id, SCHED_MAX_STOP_IDS, SCHED_MAX_TOP_LOGPROBS);
        return ERR_INVAL;
    }
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= V) {
            LOG_ERROR("request %llu: prompt token %d at index %d is outside the vocabulary (%d)",
                      (unsigned long long) r->id, r->prompt[i], i, V);
            return ERR_INVAL;
        }
    if (s->n_waiting >= s->p.max_waiting) return ERR_AGAIN;
    Seq *q = calloc(1, sizeof *q);
    int32_t *prompt = malloc((size_t) r->n_prompt * sizeof *prompt);
    if (!q || !prompt) {
        free(q);
        free(prompt);
        return ERR_NOMEM;
    }
    memcpy(prompt, r->prompt, (size_t) r->n_prompt * sizeof *prompt);
    *q = (Seq){
        .id = r->id,
        .prompt = prompt,  // ownership moved to q
        .n_prompt = r->n_prompt,
        .max_tokens = r->max_tokens,
        .sampling = r->sampling,
        .n_stop_ids = r->n_stop_ids,
        .ignore_eos = r->ignore_eos,
        .n_top_logprobs = r->n_top_logprobs,
        .mtp_k = mtp_params_ok(&r->sampling) && !r->constrained ? s->p.mtp_k : 0,
        .is_constrained = r->constrained,
        .state = SEQ_WAITING,
        .slot = -1,
    };
    memcpy(q->stop_ids, r->stop_ids, sizeof q->stop_ids);
    s->waiting[s->n_waiting++] = q;
    return ERR_OK;
}

void sched_cancel(Scheduler *s, uint64_t id)
{
    for (int i = 0; i < s->n_waiting; i++)
        if (s->waiting[i]->id == id) s->waiting[i]->cancelled = true;
    for (int i = 0; i < s->n_running; i++)
        if (s->running[i]->id == id && s->running[i]->state == SEQ_RUNNING)
            s->running[i]->cancelled = true;
}

// The live sequence with this id (queued, or running and not finished), or NULL.
static Seq *find_live(Scheduler *s, uint64_t id)
{
    for (int i = 0; i < s->n_waiting; i++)
        if (s->waiting[i]->id == id) return s->waiting[i];
    for (int i = 0; i < s->n_running; i++)
        if (s->running[i]->id == id && s->running[i]->state == SEQ_RUNNING) return s->running[i];
    return NULL;
}

Err sched_set_mask(Scheduler *s, uint64_t id, const uint32_t *words)
{
    Seq *q = find_live(s, id);
    if (!q || !q->is_constrained) return ERR_OK;
    if (words) {
        if (!q->mask && !(q->mask = malloc((size_t) s->mask_words * sizeof *q->mask)))
            return ERR_NOMEM;
        memcpy(q->mask, words, (size_t) s->mask_words * sizeof *q->mask);
    }
    q->has_mask = words != NULL;
    q->is_mask_fresh = true;
    return ERR_OK;
}

void sched_force(Scheduler *s, uint64_t id, const int32_t *ids, int n)
{
    Seq *q = find_live(s, id);
    if (!q) return;
    if (q->forced_head == q->n_forced) q->forced_head = q->n_forced = 0;
    const int V = s->model->cfg.vocab_size;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= V || q->n_forced == SCHED_MAX_FORCED) {
            LOG_WARN("request %llu: forced token %d dropped (outside the vocabulary of %d, or "
                     "more than %d pending)",
                     (unsigned long long) id, ids[i], V, SCHED_MAX_FORCED);
            continue;
        }
        q->forced[q->n_forced++] = ids[i];
    }
}

bool sched_has_work(const Scheduler *s)
{
    return s->n_waiting > 0 || s->n_running > 0 || s->n_inflight > 0;
}

void sched_stats(const Scheduler *s, SchedStats *out)
{
    *out = (SchedStats){
        .n_waiting = s->n_waiting,
        .n_running = s->n_running,
        .n_inflight = s->n_inflight,
        .n_microbatches = s->n_mb_total,
        .n_tokens = s->n_tok_total,
        .max_batch_tokens = s->max_batch_tokens,
        .mtp_steps = s->mtp_steps,
        .mtp_drafted = s->mtp_drafted,
        .mtp_accepted = s->mtp_accepted,
        .prefix_query_tokens = s->prefix_query_tokens,
        .prefix_hit_tokens = s->prefix_hit_tokens,
        .prefix_blocks = s->kv ? kv_n_published(s->kv) : 0,
        .prefix_blocks_idle = s->kv ? kv_n_cached_idle(s->kv) : 0,
    };
}

// ev's logprob of its token and its n_top most likely ids under the raw logits row (V
// entries): log-softmax in double; ties go to the lower id.
static void fill_logprobs(SchedEvent *ev, const float *row, int V, int n_top)
{
    double mx = row[0];
    for (int v = 1; v < V; v++)
        if (row[v] > mx) mx = row[v];
    double sum = 0;
    for (int v = 0; v < V; v++) sum += exp((double) row[v] - mx);
    const double lse = mx + log(sum);
    ev->logprob = (float) ((double) row[ev->token] - lse);
    // Insertion into the sorted top list; ids ascend, so an equal logit stays behind.
    int n = 0;
    for (int v = 0; v < V; v++) {
        if (n == n_top && (n == 0 || row[v] <= row[ev->top_ids[n - 1]])) continue;
        int k = n < n_top ? n++ : n - 1;
        while (k > 0 && row[ev->top_ids[k - 1]] < row[v]) {
            ev->top_ids[k] = ev->top_ids[k - 1];
            k--;
        }
        ev->top_ids[k] = v;
    }
    ev->n_top = n;
    for (int k = 0; k < n; k++) ev->top_logprobs[k] = (float) ((double) row[ev->top_ids[k]] - lse);
}

// Deliver an event; row (V logits) fills its logprob fields when the request asked.
static void emit_row(Scheduler *s, Seq *q, int32_t token, SchedFinish finish, const float *row)
{
    SchedEvent ev = {.id = q->id,
                     .token = token,
                     .n_generated = q->n_generated,
                     .n_cached = q->n_cached_blocks * s->block_size,
                     .finish = finish};
    if (row && token >= 0 && q->n_top_logprobs >= 0)
        fill_logprobs(&ev, row, s->model->cfg.vocab_size, q->n_top_logprobs);
    if (finish != SCHED_FINISH_NONE) q->state = SEQ_FINISHED;
    s->p.on_event(s->p.user, &ev);
}

static void emit(Scheduler *s, Seq *q, int32_t token, SchedFinish finish)
{
    emit_row(s, q, token, finish, NULL);
}

static bool is_stop(const Scheduler *s, const Seq *q, int32_t tok)
{
    if (!q->ignore_eos)
        for (int e = 0; e < s->model->cfg.n_eos_ids; e++)
            if (tok == s->model->cfg.eos_ids[e]) return true;
    for (int i = 0; i < q->n_stop_ids; i++)
        if (tok == q->stop_ids[i]) return true;
    return false;
}

// Remove running[i] (order kept: older sequences decode first).
static void running_remove(Scheduler *s, int i)
{
    memmove(s->running + i, s->running + i + 1, (size_t) (s->n_running - i - 1) * sizeof(Seq *));
    s->n_running--;
}

// ---------------------------------------------------------------------------
// Prefix caching

// The keys of q's full prompt blocks: key j names tokens [0, (j + 1) * block_size), the
// first 8 bytes of a SHA-256 over block j's tokens chained to block j - 1's digest.
static Err prefix_keys(Scheduler *s, Seq *q)
{
    const int bs = s->block_size, n = q->n_prompt / bs;
    if (q->keys || n == 0) return ERR_OK;
    if (!(q->keys = malloc((size_t) n * sizeof *q->keys))) return ERR_NOMEM;
    // buf = the previous block's digest (zeros for block 0), the block size (part of what a
    // key names), the block's tokens; the digest replaces its start for the next block.
    const size_t n_buf = SHA256_DIGEST_LENGTH + sizeof bs + (size_t) bs * sizeof(int32_t);
    unsigned char *buf = calloc(n_buf, 1);
    if (!buf) return ERR_NOMEM;
    memcpy(buf + SHA256_DIGEST_LENGTH, &bs, sizeof bs);
    for (int j = 0; j < n; j++) {
        memcpy(buf + SHA256_DIGEST_LENGTH + sizeof bs, q->prompt + (size_t) j * bs,
               (size_t) bs * sizeof(int32_t));
        unsigned char digest[SHA256_DIGEST_LENGTH];
        SHA256(buf, n_buf, digest);
        memcpy(buf, digest, sizeof digest);
        memcpy(&q->keys[j], digest, sizeof q->keys[j]);
    }
    free(buf);
    return ERR_OK;
}

// Make room in s->extra for n more ids.
static Err extra_room(Scheduler *s, int n)
{
    if (s->n_extra + n <= s->cap_extra) return ERR_OK;
    const int cap = (s->n_extra + n) * 2;
    int32_t *e = realloc(s->extra, (size_t) cap * sizeof *e);
    if (!e) return ERR_NOMEM;
    s->extra = e;
    s->cap_extra = cap;
    return ERR_OK;
}

// At admission: the longest run of q's prompt blocks in rank 0's index, leaving at least
// the last prompt token to compute. Sets n_cached_blocks, cached_blocks and n_prefilled.
static Err prefix_lookup(Scheduler *s, Seq *q)
{
    Err err = prefix_keys(s, q);
    if (err) return err;
    const int bs = s->block_size, max = (q->n_prompt - 1) / bs;
    int n = 0;
    while (n < max && kv_prefix_find(s->kv, q->keys[n]) >= 0)
        n++;
    s->prefix_query_tokens += (uint64_t) q->n_prompt;
    if (n == 0) return ERR_OK;
    if (!(q->cached_blocks = malloc((size_t) n * sizeof *q->cached_blocks))) return ERR_NOMEM;
    if ((err = extra_room(s, n * (1 + bs)))) return err;
    for (int j = 0; j < n; j++)
        q->cached_blocks[j] = kv_prefix_find(s->kv, q->keys[j]);
    q->n_cached_blocks = n;
    q->n_prefilled = n * bs;
    s->prefix_hit_tokens += (uint64_t) n * (uint64_t) bs;
    return ERR_OK;
}

// Once q's prefill has been submitted (rank 0 has written its blocks): its own full prompt
// blocks enter the index, a contiguous run from the first one not there yet.
static void prefix_publish(Scheduler *s, Seq *q)
{
    q->is_published = true;
    const KvSeq *kq = pp_slot_seq(s->stage, q->slot);
    const int n = q->keys ? q->n_prompt / s->block_size : 0;
    if (!kq || kq->n_blocks < n) return;
    int j = q->n_cached_blocks;
    while (j < n && kv_prefix_find(s->kv, q->keys[j]) >= 0)
        j++;
    q->publish_first = q->publish_last = j;
    while (j < n && kv_prefix_insert(s->kv, q->keys[j], kq->blocks[j]))
        j++;
    q->publish_last = j;
}

// ---------------------------------------------------------------------------
// Building a micro-batch

typedef struct Builder {
    int n_ops, n_tokens, budget;
    Seq **seqs;   // the ring entry's sequence list
    int *n_rows;  // the ring entry's logits rows per op
} Builder;

static void add_op(Scheduler *s, Builder *b, Seq *q, int n_new, uint32_t flags, const int32_t *toks)
{
    if ((flags & PP_SEQ_SAMPLE) && q->n_top_logprobs >= 0) flags |= PP_SEQ_LOGITS;
    if ((flags & PP_SEQ_SAMPLE) && q->is_constrained) {
        if (q->has_mask) {  // the mask goes with this op
            flags |= PP_SEQ_MASK;
            s->masks[s->n_masks++] = q->mask;
        }
        q->is_mask_fresh = false;
    }
    PpSeqOp *op = &s->ops[b->n_ops];
    *op = (PpSeqOp){.slot = q->slot, .n_new = n_new, .flags = flags};
    if (flags & PP_SEQ_START) {
        op->params = q->sampling;
        op->mtp_k = q->mtp_k;
        op->n_cached = q->n_cached_blocks;
        if (q->n_cached_blocks > 0) {
            // Its blocks, then their tokens (room made at admission: extra_room).
            memcpy(s->extra + s->n_extra, q->cached_blocks,
                   (size_t) q->n_cached_blocks * sizeof(int32_t));
            s->n_extra += q->n_cached_blocks;
            memcpy(s->extra + s->n_extra, q->prompt,
                   (size_t) q->n_cached_blocks * s->block_size * sizeof(int32_t));
            s->n_extra += q->n_cached_blocks * s->block_size;
        }
    }
    if (flags & PP_SEQ_FREE) {
        op->publish_first = q->publish_first;
        op->publish_last = q->publish_last;
    }
    if (n_new > 0) memcpy(s->tokens + b->n_tokens, toks, (size_t) n_new * sizeof(int32_t));
    b->n_rows[b->n_ops] = (flags & PP_SEQ_LOGITS) ? n_new : 0;
    b->seqs[b->n_ops++] = (flags & PP_SEQ_FREE) ? NULL : q;
    b->n_tokens += n_new;
    b->budget -= n_new;
    if (!(flags & PP_SEQ_FREE)) q->inflight = true;
}

// A constrained sequence samples only with the mask given since its last token.
static bool may_sample(const Seq *q) { return !q->is_constrained || q->is_mask_fresh; }

// The next prefill chunk of q (which is running and not in flight).
static void add_prefill(Scheduler *s, Builder *b, Seq *q)
{
    const int rest = q->n_prompt - q->n_prefilled;
    int chunk = rest < b->budget ? rest : b->budget;
    // Constrained and no mask yet: everything but the sampling token.
    if (chunk == rest && !may_sample(q)) chunk--;
    // With logprobs the sampling op returns a logits row per token: keep it to one token.
    if (q->n_top_logprobs >= 0 && chunk == rest && rest > 1) chunk--;
    if (chunk <= 0) return;
    uint32_t flags = q->started ? 0 : PP_SEQ_START;
    if (chunk == rest) flags |= PP_SEQ_SAMPLE;  // the prompt's last token gives the first output
    add_op(s, b, q, chunk, flags, q->prompt + q->n_prefilled);
    q->started = true;
    q->n_prefilled += chunk;
}

// q's decode op: its last token, then as many of the drafts the last stage proposed as the
// budget and max_tokens leave room for (none while a forced token is pending); the op
// drops the positions the previous verify rejected.
static void add_decode(Scheduler *s, Builder *b, Seq *q)
{
    int d = q->n_drafts;
    if (d > q->max_tokens - q->n_generated - 1) d = q->max_tokens - q->n_generated - 1;
    if (d > b->budget - 1) d = b->budget - 1;
    if (d < 0 || q->forced_head < q->n_forced) d = 0;
    int32_t toks[MTP_MAX_DRAFTS + 1];
    toks[0] = q->last;
    memcpy(toks + 1, q->drafts, (size_t) d * sizeof *toks);
    add_op(s, b, q, 1 + d, PP_SEQ_SAMPLE, toks);
    PpSeqOp *op = &s->ops[b->n_ops - 1];
    op->n_draft = d;
    op->n_rollback = q->n_rollback;
    q->n_rollback = q->n_drafts = 0;
    q->n_draft_sent = d;
    if (d > 0) {
        s->mtp_steps++;
        s->mtp_drafted += (uint64_t) d;
    }
}

static void build(Scheduler *s, Builder *b)
{
    // Cancelled requests that never ran end here.
    for (int i = 0; i < s->n_waiting;) {
        Seq *q = s->waiting[i];
        if (!q->cancelled) {
            i++;
            continue;
        }
        emit(s, q, -1, SCHED_FINISH_CANCELLED);
        memmove(s->waiting + i, s->waiting + i + 1,
                (size_t) (s->n_waiting - i - 1) * sizeof(Seq *));
        s->n_waiting--;
        seq_destroy(q);
    }
    // Cancelled running sequences between micro-batches end now.
    for (int i = 0; i < s->n_running; i++) {
        Seq *q = s->running[i];
        if (q->state == SEQ_RUNNING && q->cancelled && !q->inflight)
            emit(s, q, -1, SCHED_FINISH_CANCELLED);
    }
    // 1. Free finished sequences (no tokens; releases KV blocks on every rank). Their
    // slots are reused from the next micro-batch on (a batch names a slot once).
    int freed[PP_MAX_SLOTS], n_freed = 0;
    for (int i = 0; i < s->n_running;) {
        Seq *q = s->running[i];
        if (q->state != SEQ_FINISHED || q->inflight) {
            i++;
            continue;
        }
        add_op(s, b, q, 0, PP_SEQ_FREE, NULL);
        freed[n_freed++] = q->slot;
        s->n_blocks_committed -= q->n_blocks;
        running_remove(s, i);
        seq_destroy(q);
    }
    // 2. One decode token for each running sequence past its prompt. With several stages,
    // at most ceil(decoding / stages) per micro-batch, so the decoding sequences spread over
    // the micro-batches in flight and every stage works (all of them in one micro-batch
    // would leave the other stages idle while it passes).
    int n_decoding = 0;
    for (int i = 0; i < s->n_running; i++) {
        const Seq *q = s->running[i];
        n_decoding += q->state == SEQ_RUNNING && q->n_prefilled == q->n_prompt;
    }
    const int mb = s->p.n_microbatches;
    const int cap = mb > 1 ? (n_decoding + mb - 1) / mb : n_decoding;
    for (int i = 0, n = 0; i < s->n_running && b->budget > 0 && n < cap; i++) {
        Seq *q = s->running[i];
        if (q->state == SEQ_RUNNING && !q->inflight && q->n_prefilled == q->n_prompt
            && may_sample(q)) {
            add_decode(s, b, q);
            n++;
        }
    }
    // 3. Prefill chunks of running sequences, oldest first.
    for (int i = 0; i < s->n_running && b->budget > 0; i++) {
        Seq *q = s->running[i];
        if (q->state == SEQ_RUNNING && !q->inflight && q->n_prefilled < q->n_prompt)
            add_prefill(s, b, q);
    }
    // 4. Admit waiting requests while slots, KV blocks and the token budget allow.
    while (s->n_waiting > 0 && s->n_running < s->p.max_num_seqs && b->budget > 0) {
        Seq *q = s->waiting[0];
        // MTP: the last stage's draft recursion runs up to mtp_k - 1 positions past the
        // output in its MTP cache (the main cache's block count).
        const int need =
            (q->n_prompt + q->max_tokens + q->mtp_k + s->block_size - 1) / s->block_size;
        if (need > s->n_blocks_total) {
            LOG_ERROR("request %llu: %d prompt + %d max tokens need %d KV blocks, the cache has "
                      "%d",
                      (unsigned long long) q->id, q->n_prompt, q->max_tokens, need,
                      s->n_blocks_total);
        } else if (s->n_blocks_committed + need > s->n_blocks_total) {
            break;  // wait for running sequences to finish
        }
        int slot = 0;
        while (slot < PP_MAX_SLOTS && s->slot_used[slot])
            slot++;
        if (slot == PP_MAX_SLOTS && need <= s->n_blocks_total) break;  // freed ones: next batch
        memmove(s->waiting, s->waiting + 1, (size_t) (s->n_waiting - 1) * sizeof(Seq *));
        s->n_waiting--;
        if (need > s->n_blocks_total) {
            emit(s, q, -1, SCHED_FINISH_ERROR);
            seq_destroy(q);
            continue;
        }
        if (s->p.prefix_caching && q->mtp_k == 0 && prefix_lookup(s, q)) {
            // Out of memory: the request runs without the cache.
            q->n_cached_blocks = 0;
            q->n_prefilled = 0;
        }
        s->slot_used[slot] = true;
        q->slot = slot;
        q->n_blocks = need;
        q->state = SEQ_RUNNING;
        s->n_blocks_committed += need;
        s->running[s->n_running++] = q;
        add_prefill(s, b, q);
    }
    for (int i = 0; i < n_freed; i++)
        s->slot_used[freed[i]] = false;
}

// ---------------------------------------------------------------------------
// Stepping

Err sched_step(Scheduler *s)
{
    Err err = ERR_OK;
    while (s->n_inflight < s->p.n_microbatches) {
        MicroBatch *mb = &s->ring[(s->head + s->n_inflight) % s->p.n_microbatches];
        Builder b = {0, 0, s->p.max_num_batched_tokens, mb->seqs, mb->n_rows};
        s->n_extra = 0;
        s->n_masks = 0;
        build(s, &b);
        if (b.n_ops == 0) break;
        const int n_mask_ids = s->n_masks * s->mask_words;
        const int n_all = b.n_tokens + s->n_extra + n_mask_ids;
        if (n_all > s->cap_tokens) {
            int32_t *t = realloc(s->tokens, (size_t) n_all * sizeof *t);
            if (!t) return ERR_NOMEM;
            s->tokens = t;
            s->cap_tokens = n_all;
        }
        if (s->n_extra > 0)
            memcpy(s->tokens + b.n_tokens, s->extra, (size_t) s->n_extra * sizeof(int32_t));
        for (int i = 0; i < s->n_masks; i++)
            memcpy(s->tokens + b.n_tokens + s->n_extra + (size_t) i * s->mask_words, s->masks[i],
                   (size_t) s->mask_words * sizeof(int32_t));
        if ((err = pp_submit(s->stage, s->ops, b.n_ops, s->tokens))) return err;
        if (s->p.prefix_caching)
            for (int i = 0; i < b.n_ops; i++) {
                Seq *q = mb->seqs[i];
                if (q && q->mtp_k == 0 && !q->is_published && q->n_prefilled == q->n_prompt)
                    prefix_publish(s, q);
            }
        mb->n_ops = b.n_ops;
        s->n_inflight++;
        s->n_mb_total++;
        s->n_tok_total += (uint64_t) b.n_tokens;
        if (b.n_tokens > s->max_batch_tokens) s->max_batch_tokens = b.n_tokens;
    }
    if (s->n_inflight == 0) return ERR_OK;

    PpResult res;
    if ((err = pp_collect(s->stage, &res))) return err;
    MicroBatch *mb = &s->ring[s->head];
    ASSERT(res.n_ops == mb->n_ops);
    s->head = (s->head + 1) % s->p.n_microbatches;
    s->n_inflight--;
    const size_t V = (size_t) s->model->cfg.vocab_size;
    int row_end = 0;  // rows of the ops so far
    for (int i = 0; i < mb->n_ops; i++) {
        row_end += mb->n_rows[i];
        Seq *q = mb->seqs[i];
        if (!q) continue;  // a FREE op
        q->inflight = false;
        if (q->cancelled) {
            if (q->state == SEQ_RUNNING) emit(s, q, -1, SCHED_FINISH_CANCELLED);
            continue;
        }
        // MTP ops emit 1 .. n_draft_sent + 1 tokens; the others one (or none).
        const MtpOut *mo = res.mtp && res.mtp[i].n_emit > 0 ? &res.mtp[i] : NULL;
        if (!mo && res.tokens[i] < 0) continue;  // a prefill chunk before the last
        if (mo && (mo->n_emit > q->n_draft_sent + 1 || mo->n_drafts < 0
                   || mo->n_drafts > MTP_MAX_DRAFTS)) {
            LOG_ERROR("request %llu: the last stage emitted %d tokens for %d drafts",
                      (unsigned long long) q->id, mo->n_emit, q->n_draft_sent);
            return ERR_FORMAT;
        }
        const int n_emit = mo ? mo->n_emit : 1;
        // Emitted token u's position is the op's row n_new - 1 - n_draft + u.
        const int row0 = row_end - 1 - q->n_draft_sent;
        int used = 0;
        bool forced_any = false;
        while (used < n_emit && q->state == SEQ_RUNNING) {
            int32_t tok = mo ? mo->emit[used] : res.tokens[i];
            const bool is_forced = q->forced_head < q->n_forced;
            if (is_forced) tok = q->forced[q->forced_head++];
            q->n_generated++;
            q->last = tok;
            const SchedFinish fin = !is_forced && is_stop(s, q, tok) ? SCHED_FINISH_STOP
                                    : q->n_generated >= q->max_tokens ? SCHED_FINISH_LENGTH
                                                                      : SCHED_FINISH_NONE;
            const bool has_row = mb->n_rows[i] > 0 && row_end <= res.n_rows;
            emit_row(s, q, tok, fin,
                     has_row ? res.logits + (size_t) (row0 + used) * V : NULL);
            used++;
            if (is_forced) {  // the tokens after it were sampled after what it replaced
                forced_any = true;
                break;
            }
        }
        if (mo) {
            if (q->n_draft_sent > 0) s->mtp_accepted += (uint64_t) (mo->n_emit - 1);
            // The next op drops the rejected drafts and the emitted tokens not used.
            q->n_rollback = q->n_draft_sent - (mo->n_emit - 1) + (mo->n_emit - used);
            q->n_drafts = forced_any ? 0 : mo->n_drafts;
            memcpy(q->drafts, mo->drafts, sizeof q->drafts);
        }
    }
    return ERR_OK;
}
