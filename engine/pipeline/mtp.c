/*
 * mtp.c - speculative decoding with the MTP layer (mtp.h): drafting, one batched verify
 * forward, the acceptance rule and the KV rollback; one sequence on one rank (MtpGen), and
 * the pipeline's last stage (MtpStage: per-slot drafting and verification for pp.c).
 */
#include "engine/pipeline/mtp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

bool mtp_params_ok(const SamplerParams *p)
{
    const bool filters =
        p->temperature > 0.0f && (p->top_k > 0 || p->top_p < 1.0f || p->min_p > 0.0f);
    const bool penalties = (p->repetition_penalty != 0.0f && p->repetition_penalty != 1.0f)
                           || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
    return !filters && !penalties;
}

Err mtp_check_params(const SamplerParams *p)
{
    if (!mtp_params_ok(p)) {
        LOG_ERROR("speculative decoding (--mtp) supports temperature alone: top-k, top-p, "
                  "min-p and the penalties are not available with drafts");
        return ERR_INVAL;
    }
    return ERR_OK;
}

// Largest logit, ties to the lowest id (as sampler.h's greedy choice).
static int argmax(const float *x, int V)
{
    int best = 0;
    for (int i = 1; i < V; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

// p = softmax(logits / T) in double.
static void softmax_t(double *p, const float *logits, int V, float T)
{
    double mx = -INFINITY;
    for (int i = 0; i < V; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    for (int i = 0; i < V; i++)
        sum += p[i] = exp(((double) logits[i] - mx) / T);
    for (int i = 0; i < V; i++)
        p[i] /= sum;
}

// One draw from p (sums to total > 0); never returns a zero-probability id.
static int draw(const double *p, int V, double total, Sampler *s)
{
    const double u = sampler_uniform(s) * total;
    double c = 0.0;
    int last = -1;
    for (int i = 0; i < V; i++) {
        if (p[i] <= 0.0) continue;
        last = i;
        c += p[i];
        if (u < c) return i;
    }
    ASSERT(last >= 0);
    return last;
}

int mtp_accept(const double *p, const double *q, const int *drafts, int k, int V, Sampler *s,
               double *resid, int *out)
{
    for (int i = 0; i < k; i++) {
        const double *pi = p + (size_t) i * V, *qi = q + (size_t) i * V;
        const int d = drafts[i];
        ASSERT(d >= 0 && d < V && qi[d] > 0.0);
        if (sampler_uniform(s) * qi[d] < pi[d]) {  // u < p/q
            out[i] = d;
            continue;
        }
        double total = 0.0;
        for (int j = 0; j < V; j++)
            total += resid[j] = pi[j] > qi[j] ? pi[j] - qi[j] : 0.0;
        // p == q up to rounding: the residual is empty and p itself is the answer.
        out[i] = total > 0.0 ? draw(resid, V, total, s) : draw(pi, V, 1.0, s);
        return i + 1;
    }
    out[k] = draw(p + (size_t) k * V, V, 1.0, s);
    return k + 1;
}

void mtp_gen_free(MtpGen *g)
{
    if (!g) return;
    if (g->kv) kv_seq_free(g->kv, &g->seq);
    if (g->mkv) kv_seq_free(g->mkv, &g->mseq);
    free(g->pend_hid);
    free(g->pend_tok);
    free(g->vlog);
    free(g->vhid);
    free(g->dlog);
    free(g->hcur);
    free(g->prob);
    memset(g, 0, sizeof *g);
}

Err mtp_gen_init(MtpGen *g, Model *m, KvCache *kv, KvCache *mkv, Sampler *s, int k)
{
    memset(g, 0, sizeof *g);
    Err err = ERR_OK;
    if (k < 1 || k > MTP_MAX_DRAFTS) {
        LOG_ERROR("--mtp takes 1 .. %d drafts, not %d", MTP_MAX_DRAFTS, k);
        return ERR_INVAL;
    }
    if (!m->mtp) {
        LOG_ERROR("speculative decoding needs the model's MTP layer (num_nextn_predict_layers "
                  "%d; load it with load_mtp)",
                  m->cfg.n_mtp_layers);
        return ERR_INVAL;
    }
    if ((err = mtp_check_params(&s->params))) return err;
    const size_t V = (size_t) m->cfg.vocab_size, H = (size_t) m->cfg.hidden_size;
    *g = (MtpGen){.m = m, .kv = kv, .mkv = mkv, .s = s, .k = k, .last = -1};
    g->vlog = malloc((size_t) (k + 1) * V * sizeof *g->vlog);
    g->vhid = malloc((size_t) (k + 1) * H * sizeof *g->vhid);
    g->dlog = malloc((size_t) k * V * sizeof *g->dlog);
    g->hcur = malloc(H * sizeof *g->hcur);
    g->prob = malloc((size_t) (2 * k + 2) * V * sizeof *g->prob);
    if (!g->vlog || !g->vhid || !g->dlog || !g->hcur || !g->prob) {
        LOG_ERROR("out of memory for speculative decoding (vocab %zu, %d drafts)", V, k);
        mtp_gen_free(g);
        return ERR_NOMEM;
    }
    return ERR_OK;
}

static Err pend_reserve(MtpGen *g, int n)
{
    if (g->pend_cap >= n) return ERR_OK;
    const size_t H = (size_t) g->m->cfg.hidden_size;
    float *h = realloc(g->pend_hid, (size_t) n * H * sizeof *h);
    if (h) g->pend_hid = h;
    int *t = realloc(g->pend_tok, (size_t) n * sizeof *t);
    if (t) g->pend_tok = t;
    if (!h || !t) {
        LOG_ERROR("out of memory for %d pending MTP rows", n);
        return ERR_NOMEM;
    }
    g->pend_cap = n;
    return ERR_OK;
}

// The next token from one logits row: greedy, or a draw from softmax(row / T) (prob: [V]).
static int choose(Sampler *s, const float *row, int V, double *prob)
{
    const float T = s->params.temperature;
    if (T <= 0.0f) return argmax(row, V);
    softmax_t(prob, row, V, T);
    return draw(prob, V, 1.0, s);
}

// One sequence's part in draft_batch: n rows of the first MTP pass (the batch's tok and hid
// hold every sequence's rows in order), whose last drafts d_1, then the recursion for d_2 ..
// d_K.
typedef struct DraftSeq {
    KvSeq *mseq;  // the sequence in the MTP cache: advances by n + K - 1 (the caller drops
                  // the K - 1 recursive rows, drafts of drafts)
    int n, K;
    Sampler *s;
    float *dlog;    // [K, vocab]: each draft's MTP logits, or NULL (not kept)
    double *q;      // [K, vocab] at temperature > 0: each draft's distribution (scratch that
                    // sequences may share when the caller does not keep it)
    int *drafts;    // [K]
    int (*hook)(void *ctx, int i, const float *row);  // temperature 0 test hook, or NULL
    void *ctx;
} DraftSeq;

// Draft for n_seqs sequences at once: one MTP forward over every sequence's rows (tok [sum
// n], hid [sum n, hidden]), then one forward per recursion depth over the sequences that
// draft that deep, so the MTP layer's weights are read once per depth for all of them, and
// each sequence's numbers are those it would get alone (model_mtp_forward_batch). blog
// [n_seqs, vocab] and hcur [n_seqs, hidden]: scratch.
static Err draft_batch(Model *m, KvCache *mkv, DraftSeq *d, int n_seqs, const int *tok,
                       const float *hid, float *blog, float *hcur)
{
    const size_t V = (size_t) m->cfg.vocab_size, H = (size_t) m->cfg.hidden_size;
    KvSeq **seqs = malloc((size_t) n_seqs * sizeof *seqs);
    int *n_new = malloc((size_t) n_seqs * sizeof *n_new);
    int *dtok = malloc((size_t) n_seqs * sizeof *dtok);
    Err err = ERR_OK;
    if (!seqs || !n_new || !dtok) {
        LOG_ERROR("out of memory for the drafts of %d sequences", n_seqs);
        err = ERR_NOMEM;
        goto done;
    }
    for (int k = 0; k < n_seqs; k++) {
        seqs[k] = d[k].mseq;
        n_new[k] = d[k].n;
    }
    ModelBatch b = {n_seqs, seqs, n_new};
    err = model_mtp_forward_batch(m, mkv, &b, tok, hid, blog, hcur, false);
    // At depth i, row j of blog and hcur is the j-th sequence (in order) with K > i.
    for (int i = 0; !err; i++) {
        int j = 0, next = 0;
        for (int k = 0; k < n_seqs; k++) {
            DraftSeq *ds = &d[k];
            if (ds->K <= i) continue;
            const float *row = blog + (size_t) j * V;
            if (ds->dlog) memcpy(ds->dlog + (size_t) i * V, row, V * sizeof *row);
            ds->drafts[i] = ds->hook && ds->s->params.temperature <= 0.0f
                                ? ds->hook(ds->ctx, i, row)
                                : choose(ds->s, row, (int) V, ds->q + (size_t) i * V);
            ASSERT(ds->drafts[i] >= 0 && ds->drafts[i] < (int) V);
            if (ds->K > i + 1) {  // drafts deeper: its row moves up to the next depth's place
                if (next != j) memmove(hcur + (size_t) next * H, hcur + (size_t) j * H, H * sizeof *hcur);
                seqs[next] = ds->mseq;
                n_new[next] = 1;
                dtok[next++] = ds->drafts[i];
            }
            j++;
        }
        if (next == 0) break;
        b.n_seqs = next;
        err = model_mtp_forward_batch(m, mkv, &b, dtok, hcur, blog, hcur, false);
    }
done:
    free(seqs);
    free(n_new);
    free(dtok);
    return err;
}

// The emitted tokens for drafts[0..K) from the verify logits vlog [K + 1, V]: the greedy
// prefix and the correction/bonus token, or the acceptance rule with the draft rows q
// [K, V] (p: scratch [K + 1, V], resid [V]). Returns the count (1 .. K + 1).
static int verify(const float *vlog, const int *drafts, int K, int V, Sampler *s, const double *q,
                  double *p, double *resid, int *out)
{
    const float T = s->params.temperature;
    if (T > 0.0f) {
        for (int i = 0; i <= K; i++)
            softmax_t(p + (size_t) i * V, vlog + (size_t) i * V, V, T);
        return mtp_accept(p, q, drafts, K, V, s, resid, out);
    }
    int n = 0;
    while (n < K && drafts[n] == argmax(vlog + (size_t) n * V, V)) {
        out[n] = drafts[n];
        n++;
    }
    out[n] = argmax(vlog + (size_t) n * V, V);
    return n + 1;
}

static int gen_hook(void *ctx, int i, const float *row)
{
    const MtpGen *g = ctx;
    return g->draft_hook(g->hook_user, g, i, row);
}

Err mtp_gen_prefill(MtpGen *g, const int *tokens, int n, int *first)
{
    ASSERT(n > 0 && g->last < 0);
    Err err = pend_reserve(g, n > g->k + 1 ? n : g->k + 1);
    if (err) return err;
    if ((err = model_forward_hidden(g->m, g->kv, &g->seq, tokens, n, g->vlog, false, g->pend_hid)))
        return err;
    g->last = choose(g->s, g->vlog, g->m->cfg.vocab_size, g->prob);
    // Pending MTP rows: (h_p, token p+1) for p = 0 .. n-1, the last one's token being
    // the first generated.
    for (int p = 0; p + 1 < n; p++)
        g->pend_tok[p] = tokens[p + 1];
    g->pend_tok[n - 1] = g->last;
    g->n_pend = n;
    *first = g->last;
    return ERR_OK;
}

Err mtp_gen_step(MtpGen *g, int *out, int *n_out)
{
    ASSERT(g->last >= 0 && g->n_pend >= 1);
    Model *m = g->m;
    const int V = m->cfg.vocab_size, K = g->k;
    const size_t H = (size_t) m->cfg.hidden_size;
    const int P = g->seq.n_tokens;
    ASSERT(g->mseq.n_tokens + g->n_pend == P);
    double *p = g->prob, *q = g->prob + (size_t) (K + 1) * V;  // [K+1, V], [K, V]
    Err err;

    // Drafts: the pending rows (last one at position P-1) give d_1; then the recursion. The
    // verify logits' buffer is free until the verify: the passes' logits go there.
    DraftSeq d = {&g->mseq, g->n_pend, K, g->s, g->dlog, q, g->drafts,
                  g->draft_hook ? gen_hook : NULL, g};
    if ((err = draft_batch(m, g->mkv, &d, 1, g->pend_tok, g->pend_hid, g->vlog, g->hcur)))
        goto rollback;
    // The recursive rows are drafts of drafts: never kept.
    g->mseq.n_tokens = P;

    // Verify [x_P, d_1 .. d_K] in one forward.
    int toks[MTP_MAX_DRAFTS + 1];
    toks[0] = g->last;
    for (int i = 0; i < K; i++)
        toks[i + 1] = g->drafts[i];
    if ((err = model_forward_hidden(m, g->kv, &g->seq, toks, K + 1, g->vlog, true, g->vhid)))
        goto rollback;  // the main sequence did not advance
    const int n = verify(g->vlog, g->drafts, K, V, g->s, q, p, q + (size_t) K * V, out);
    const int accepted = n - 1;
    // Roll the main cache back to x_P and the accepted drafts.
    g->seq.n_tokens = P + accepted + 1;
    // Next step's MTP rows: positions P .. P+accepted, from the verify hidden states.
    memcpy(g->pend_hid, g->vhid, (size_t) n * H * sizeof *g->pend_hid);
    for (int j = 0; j < n; j++)
        g->pend_tok[j] = out[j];
    g->n_pend = n;
    g->last = out[n - 1];
    g->stats.steps++;
    g->stats.drafted += K;
    g->stats.accepted += accepted;
    g->stats.emitted += n;
    *n_out = n;
    return ERR_OK;

rollback:
    // The pending rows stay pending: a retry recomputes them (the same bits).
    g->mseq.n_tokens = P - g->n_pend;
    return err;
}

// ---------------------------------------------------------------------------
// The pipeline's last stage

void mtp_stage_free(MtpStage *ms)
{
    if (!ms) return;
    for (int i = 0; ms->slots && i < ms->n_slots; i++)
        mtp_slot_end(ms, i);
    free(ms->slots);
    kv_free(&ms->mkv);
    if (ms->m) {
        Backend *be = ms->m->be;
        be->free_mem(be, ms->xd);
        be->free_mem(be, ms->hd);
        be->free_mem(be, ms->ld);
    }
    free(ms->hid);
    free(ms->tok);
    free(ms->vlog);
    free(ms->blog);
    free(ms->bhcur);
    free(ms->bhid);
    free(ms->btok);
    free(ms->bdraft);
    free(ms->bhook);
    free(ms->bbase);
    free(ms->prob);
    memset(ms, 0, sizeof *ms);
}

Err mtp_stage_init(MtpStage *ms, Model *m, const KvCacheParams *main, int n_slots)
{
    memset(ms, 0, sizeof *ms);
    if (!m->mtp || !m->has_head) {
        LOG_ERROR("speculative decoding needs the MTP layer on the last pipeline stage "
                  "(num_nextn_predict_layers %d)",
                  m->cfg.n_mtp_layers);
        return ERR_INVAL;
    }
    const size_t V = (size_t) m->cfg.vocab_size, H = (size_t) m->cfg.hidden_size;
    KvCacheParams mp = model_mtp_kv_params(m, main->n_blocks, main->block_size);
    mp.dtype = main->dtype;
    Err err = kv_init(&ms->mkv, &mp);
    if (err) return err;
    ms->m = m;
    ms->n_slots = n_slots;
    ms->slots = calloc((size_t) n_slots, sizeof *ms->slots);
    ms->vlog = malloc((MTP_MAX_DRAFTS + 1) * V * sizeof *ms->vlog);
    ms->blog = malloc((size_t) n_slots * V * sizeof *ms->blog);
    ms->bhcur = malloc((size_t) n_slots * H * sizeof *ms->bhcur);
    ms->prob = malloc((2 * MTP_MAX_DRAFTS + 2) * V * sizeof *ms->prob);
    if (!ms->slots || !ms->vlog || !ms->blog || !ms->bhcur || !ms->prob) {
        LOG_ERROR("out of memory for the MTP state of %d pipeline slots", n_slots);
        mtp_stage_free(ms);
        return ERR_NOMEM;
    }
    return ERR_OK;
}

void mtp_slot_end(MtpStage *ms, int slot)
{
    MtpSlot *sl = &ms->slots[slot];
    kv_seq_free(&ms->mkv, &sl->mseq);
    free(sl->dlog);
    free(sl->carry);
    memset(sl, 0, sizeof *sl);
}

Err mtp_slot_start(MtpStage *ms, int slot, int k, const SamplerParams *p)
{
    mtp_slot_end(ms, slot);
    if (k == 0) return ERR_OK;
    if (k < 0 || k > MTP_MAX_DRAFTS) {
        LOG_ERROR("pipeline slot %d: %d MTP drafts per step (1 .. %d)", slot, k, MTP_MAX_DRAFTS);
        return ERR_INVAL;
    }
    Err err = mtp_check_params(p);
    if (err) return err;
    MtpSlot *sl = &ms->slots[slot];
    const size_t V = (size_t) ms->m->cfg.vocab_size, H = (size_t) ms->m->cfg.hidden_size;
    sl->carry = malloc(H * sizeof *sl->carry);
    if (sl->carry && p->temperature > 0.0f) sl->dlog = malloc((size_t) k * V * sizeof *sl->dlog);
    if (!sl->carry || (p->temperature > 0.0f && !sl->dlog)) {
        LOG_ERROR("out of memory for the MTP state of pipeline slot %d", slot);
        mtp_slot_end(ms, slot);
        return ERR_NOMEM;
    }
    sl->k = k;
    return ERR_OK;
}

Err mtp_slot_rollback(MtpStage *ms, int slot, int n_rollback)
{
    MtpSlot *sl = &ms->slots[slot];
    const int extra = n_rollback - sl->expect_rollback;
    if (extra < 0 || extra > sl->mseq.n_tokens) {
        LOG_ERROR("pipeline slot %d: the op drops %d positions, the last stage rejected %d "
                  "drafts",
                  slot, n_rollback, sl->expect_rollback);
        return ERR_FORMAT;
    }
    // Rank 0 may drop kept positions too (a forced token replaced an emitted one): their
    // MTP rows go with them, and the drafts built on them.
    sl->mseq.n_tokens -= extra;
    if (extra > 0) sl->n_drafts = 0;
    sl->expect_rollback = 0;
    return ERR_OK;
}

Err mtp_slot_check(const MtpStage *ms, int slot, const int32_t *tokens, int n, int n_draft,
                   bool sample)
{
    const MtpSlot *sl = &ms->slots[slot];
    bool ok = sl->k > 0 && n_draft >= 0 && n_draft <= sl->n_drafts
              && (n_draft == 0 || (sample && n == n_draft + 1));
    for (int i = 0; ok && i < n_draft; i++)
        ok = tokens[1 + i] == sl->drafts[i];
    if (!ok) {
        LOG_ERROR("pipeline slot %d: an op of %d tokens verifies %d drafts the last stage did not "
                  "propose (it proposed %d)",
                  slot, n, n_draft, sl->n_drafts);
        return ERR_FORMAT;
    }
    return ERR_OK;
}

// Backend buffer *p of at least rows * row_bytes (contents not kept).
static Err dev_reserve(Backend *be, void **p, int *cap, int rows, size_t row_bytes)
{
    if (*cap >= rows) return ERR_OK;
    be->free_mem(be, *p);
    *cap = 0;
    if (!(*p = be->alloc(be, (size_t) rows * row_bytes))) {
        LOG_ERROR("could not allocate %zu bytes of backend memory for the MTP head",
                  (size_t) rows * row_bytes);
        return ERR_NOMEM;
    }
    *cap = rows;
    return ERR_OK;
}

// The final norm over x [n, hidden] (host) into ms->hid rows 1 .. n (row 0 is left for a
// carry), and when n_logits > 0 the head over the last n_logits rows into ms->vlog, both
// computed as model_forward_hidden() does (every row at once; the head by model_head).
static Err stage_head(MtpStage *ms, const float *x, int n, int n_logits)
{
    Model *m = ms->m;
    Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    const size_t H = (size_t) c->hidden_size, V = (size_t) c->vocab_size;
    Err err;
    if (ms->cap_rows < n) {  // the two row buffers grow together
        int cap = 0;
        if ((err = dev_reserve(be, &ms->hd, &cap, n, H * sizeof(float)))
            || (err = dev_reserve(be, &ms->xd, &ms->cap_rows, n, H * sizeof(float))))
            return err;
    }
    if ((err = dev_reserve(be, (void **) &ms->ld, &ms->cap_lrows, n_logits, V * sizeof(float))))
        return err;
    if (ms->cap_hrows < n + 1) {
        float *h = realloc(ms->hid, (size_t) (n + 1) * H * sizeof *h);
        if (h) ms->hid = h;
        int *t = realloc(ms->tok, (size_t) (n + 1) * sizeof *t);
        if (t) ms->tok = t;
        if (!h || !t) {
            LOG_ERROR("out of memory for %d MTP rows", n + 1);
            return ERR_NOMEM;
        }
        ms->cap_hrows = n + 1;
    }
    float *xd = ms->xd, *hd = ms->hd;
    be->upload(be, xd, x, (size_t) n * H * sizeof(float));
    be->rmsnorm(be, hd, xd, m->final_norm, n, c->hidden_size, c->hidden_size, c->rms_norm_eps);
    be->download(be, ms->hid + H, hd, (size_t) n * H * sizeof(float));
    if (n_logits > 0) {
        model_head(m, ms->ld, hd + (size_t) (n - n_logits) * H, n_logits);
        be->download(be, ms->vlog, ms->ld, (size_t) n_logits * V * sizeof(float));
    }
    return ERR_OK;
}

typedef struct StageHook {
    MtpStage *ms;
    int slot;
} StageHook;

static int stage_hook(void *ctx, int i, const float *row)
{
    const StageHook *h = ctx;
    return h->ms->draft_hook(h->ms->hook_user, h->slot, i, row);
}

// Host buffers of mtp_stage_ops for n_ops sampling ops and rows first-pass rows.
static Err batch_reserve(MtpStage *ms, int n_ops, int rows)
{
    const size_t H = (size_t) ms->m->cfg.hidden_size;
    if (ms->cap_brows < rows) {
        float *h = realloc(ms->bhid, (size_t) rows * H * sizeof *h);
        if (h) ms->bhid = h;
        int *t = realloc(ms->btok, (size_t) rows * sizeof *t);
        if (t) ms->btok = t;
        if (!h || !t) goto oom;
        ms->cap_brows = rows;
    }
    if (ms->cap_bops < n_ops) {
        void *d = realloc(ms->bdraft, (size_t) n_ops * sizeof(DraftSeq));
        if (d) ms->bdraft = d;
        void *k = realloc(ms->bhook, (size_t) n_ops * sizeof(StageHook));
        if (k) ms->bhook = k;
        int *b = realloc(ms->bbase, (size_t) n_ops * 2 * sizeof *b);
        if (b) ms->bbase = b;
        if (!d || !k || !b) goto oom;
        ms->cap_bops = n_ops;
    }
    return ERR_OK;
oom:
    LOG_ERROR("out of memory for the MTP drafts of %d sequences (%d rows)", n_ops, rows);
    return ERR_NOMEM;
}

Err mtp_stage_ops(MtpStage *ms, const MtpStageOp *ops, int n_ops)
{
    Model *m = ms->m;
    const int V = m->cfg.vocab_size;
    const size_t H = (size_t) m->cfg.hidden_size;
    // Every op is checked before anything changes.
    int rows = 0, n_sample = 0;
    for (int i = 0; i < n_ops; i++) {
        const MtpStageOp *op = &ops[i];
        *op->out = (MtpOut){0};
        ASSERT(ms->slots[op->slot].k > 0 && op->n >= 1);
        for (int j = 0; j < i; j++)
            ASSERT(ops[j].slot != op->slot);
        Err err = mtp_slot_check(ms, op->slot, op->tokens, op->n, op->n_draft, op->sample);
        if (err) return err;
        rows += op->sample ? op->n + 1 : 0;
        n_sample += op->sample;
    }
    Err err = batch_reserve(ms, n_sample, rows);
    if (err) return err;
    DraftSeq *ds = ms->bdraft;
    StageHook *hk = ms->bhook;
    int *base = ms->bbase, *kept = ms->bbase + n_sample;
    int nd = 0;
    rows = 0;
    for (int i = 0; i < n_ops; i++) {
        const MtpStageOp *op = &ops[i];
        MtpSlot *sl = &ms->slots[op->slot];
        Sampler *s = op->s;
        const int n = op->n, n_draft = op->n_draft;
        if ((err = stage_head(ms, op->x, n, n_draft > 0 ? n : 0))) return err;
        // Rows for the MTP: the carry (position mseq.n_tokens), then this op's rows; row r's
        // token is the one after its position.
        const int r0 = sl->has_carry ? 0 : 1;
        if (sl->has_carry) memcpy(ms->hid, sl->carry, H * sizeof *ms->hid);
        int *tok = ms->tok;
        const float *hid = ms->hid + (size_t) r0 * H;
        for (int t = 0; t < n; t++)
            tok[t] = op->tokens[t];  // the token after row t (ms->hid row 0 is the carry)
        int n_rows = n + 1 - r0;  // rows from r0: the carry and this op's
        tok += r0;
        if (!op->sample) {
            // The last row's next token comes with the next op.
            if (n_rows > 1
                && (err = model_mtp_forward(m, &ms->mkv, &sl->mseq, tok, hid, n_rows - 1, NULL,
                                            NULL, false)))
                return err;
            memcpy(sl->carry, hid + (size_t) (n_rows - 1) * H, H * sizeof *sl->carry);
            sl->has_carry = true;
            continue;
        }
        int *emit = op->out->emit;
        int n_emit = 1;
        const double *q = ms->prob + (size_t) (n_draft + 1) * V;
        if (n_draft == 0) {
            emit[0] = sampler_sample(s, op->last_logits);
        } else {
            if (s->params.temperature > 0.0f)
                for (int d = 0; d < n_draft; d++)
                    softmax_t(ms->prob + (size_t) (n_draft + 1 + d) * V, sl->dlog + (size_t) d * V,
                              V, s->params.temperature);
            n_emit = verify(ms->vlog, sl->drafts, n_draft, V, s, q, ms->prob,
                            ms->prob + (size_t) (2 * n_draft + 1) * V, emit);
            ms->stats.steps++;
            ms->stats.drafted += n_draft;
            ms->stats.accepted += n_emit - 1;
            ms->stats.emitted += n_emit;
        }
        op->out->n_emit = n_emit;
        // Kept rows: the carry and this op's rows up to the last emitted token's position
        // (the rejected drafts' rows are dropped; the first rejected position's row gives
        // the correction token, which is the next token of the last kept row).
        n_rows -= n_draft - (n_emit - 1);
        tok[n_rows - 1] = emit[n_emit - 1];
        sl->has_carry = false;
        sl->expect_rollback = n_draft - (n_emit - 1);
        memcpy(ms->bhid + (size_t) rows * H, hid, (size_t) n_rows * H * sizeof *hid);
        memcpy(ms->btok + rows, tok, (size_t) n_rows * sizeof *tok);
        rows += n_rows;
        const bool T0 = s->params.temperature <= 0.0f;
        hk[nd] = (StageHook){ms, op->slot};
        // At temperature > 0 the drafts' logits stay with the slot (the verify's q); their
        // distributions here are scratch.
        ds[nd] = (DraftSeq){&sl->mseq, n_rows, sl->k, s, T0 ? NULL : sl->dlog, ms->prob,
                            sl->drafts, ms->draft_hook ? stage_hook : NULL, &hk[nd]};
        base[nd] = sl->mseq.n_tokens;
        kept[nd++] = i;
    }
    if (nd == 0) return ERR_OK;
    err = draft_batch(m, &ms->mkv, ds, nd, ms->btok, ms->bhid, ms->blog, ms->bhcur);
    if (err == ERR_AGAIN)
        LOG_ERROR("the MTP cache has no room for the drafts of %d sequences (%d free blocks)", nd,
                  kv_n_free_blocks(&ms->mkv));
    for (int d = 0; d < nd; d++) {
        const MtpStageOp *op = &ops[kept[d]];
        MtpSlot *sl = &ms->slots[op->slot];
        sl->mseq.n_tokens = base[d] + ds[d].n;  // the recursive rows are drafts of drafts
        if (err) continue;
        sl->n_drafts = sl->k;
        op->out->n_drafts = sl->k;
        for (int j = 0; j < sl->k; j++)
            op->out->drafts[j] = sl->drafts[j];
    }
    return err;
}

Err mtp_stage_op(MtpStage *ms, int slot, Sampler *s, const int32_t *tokens, int n, int n_draft,
                 bool sample, const float *x, float *last_logits, MtpOut *out)
{
    const MtpStageOp op = {slot, s, tokens, n, n_draft, sample, x, last_logits, out};
    return mtp_stage_ops(ms, &op, 1);
}
