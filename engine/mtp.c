/*
 * mtp.c - speculative decoding with the MTP layer (mtp.h): drafting, one batched verify
 * forward, the acceptance rule and the KV rollback.
 */
#include "mtp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

Err mtp_check_params(const SamplerParams *p)
{
    const bool filters =
        p->temperature > 0.0f && (p->top_k > 0 || p->top_p < 1.0f || p->min_p > 0.0f);
    const bool penalties = (p->repetition_penalty != 0.0f && p->repetition_penalty != 1.0f)
                           || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
    if (filters || penalties) {
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
static int choose(MtpGen *g, const float *row, double *prob)
{
    const int V = g->m->cfg.vocab_size;
    const float T = g->s->params.temperature;
    if (T <= 0.0f) return argmax(row, V);
    softmax_t(prob, row, V, T);
    return draw(prob, V, 1.0, g->s);
}

Err mtp_gen_prefill(MtpGen *g, const int *tokens, int n, int *first)
{
    ASSERT(n > 0 && g->last < 0);
    Err err = pend_reserve(g, n > g->k + 1 ? n : g->k + 1);
    if (err) return err;
    if ((err = model_forward_hidden(g->m, g->kv, &g->seq, tokens, n, g->vlog, false, g->pend_hid)))
        return err;
    g->last = choose(g, g->vlog, g->prob);
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
    const float T = g->s->params.temperature;
    const int P = g->seq.n_tokens;
    ASSERT(g->mseq.n_tokens + g->n_pend == P);
    double *p = g->prob, *q = g->prob + (size_t) (K + 1) * V;  // [K+1, V], [K, V]
    Err err;

    // Drafts: the pending rows (last one at position P-1) give d_1; then the recursion.
    if ((err = model_mtp_forward(m, g->mkv, &g->mseq, g->pend_tok, g->pend_hid, g->n_pend, g->dlog,
                                 g->hcur, false)))
        return err;
    for (int i = 0; i < K; i++) {
        float *row = g->dlog + (size_t) i * V;
        if (i > 0
            && (err = model_mtp_forward(m, g->mkv, &g->mseq, &g->drafts[i - 1], g->hcur, 1, row,
                                        g->hcur, false)))
            goto rollback;
        g->drafts[i] = g->draft_hook && T <= 0.0f ? g->draft_hook(g->hook_user, g, i, row)
                                                  : choose(g, row, q + (size_t) i * V);
        ASSERT(g->drafts[i] >= 0 && g->drafts[i] < V);
    }
    // The recursive rows are drafts of drafts: never kept.
    g->mseq.n_tokens = P;

    // Verify [x_P, d_1 .. d_K] in one forward.
    int toks[MTP_MAX_DRAFTS + 1];
    toks[0] = g->last;
    for (int i = 0; i < K; i++)
        toks[i + 1] = g->drafts[i];
    if ((err = model_forward_hidden(m, g->kv, &g->seq, toks, K + 1, g->vlog, true, g->vhid)))
        goto rollback;  // the main sequence did not advance
    int n = 0;
    if (T <= 0.0f) {
        while (n < K && g->drafts[n] == argmax(g->vlog + (size_t) n * V, V)) {
            out[n] = g->drafts[n];
            n++;
        }
        out[n] = argmax(g->vlog + (size_t) n * V, V);
        n++;
    } else {
        for (int i = 0; i <= K; i++)
            softmax_t(p + (size_t) i * V, g->vlog + (size_t) i * V, V, T);
        n = mtp_accept(p, q, g->drafts, K, V, g->s, q + (size_t) K * V, out);
    }
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
