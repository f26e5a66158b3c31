/*
 * sampler.c - penalties, temperature, top-k / top-p / min-p and one draw (see sampler.h).
 *
 * Candidates are ranked by logit, descending, ties by id, so the filters are prefixes of
 * one order. Only what a filter needs is sorted: the top-k by a k-element heap, min-p
 * survivors by heapsort, and nothing at all without filters (the draw then walks the
 * vocabulary in id order). Probabilities are computed in double from the scaled logits.
 */
#include "engine/model/sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

SamplerParams sampler_default_params(void)
{
    return (SamplerParams){
        .temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .repetition_penalty = 1.0f};
}

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

Err sampler_init(Sampler *s, int vocab_size, SamplerParams params)
{
    memset(s, 0, sizeof *s);
    if (vocab_size < 1 || !(params.temperature >= 0.0f) || params.top_k < 0
        || !(params.top_p > 0.0f && params.top_p <= 1.0f)
        || !(params.min_p >= 0.0f && params.min_p <= 1.0f) || !(params.repetition_penalty >= 0.0f)
        || !isfinite(params.presence_penalty) || !isfinite(params.frequency_penalty)) {
        LOG_ERROR("bad sampling parameters: temperature %g, top_k %d, top_p %g, min_p %g, "
                  "repetition_penalty %g",
                  params.temperature, params.top_k, params.top_p, params.min_p,
                  params.repetition_penalty);
        return ERR_INVAL;
    }
    s->candidates = malloc((size_t) vocab_size * sizeof *s->candidates);
    s->counts = calloc((size_t) vocab_size, sizeof *s->counts);
    if (!s->candidates || !s->counts) {
        sampler_free(s);
        return ERR_NOMEM;
    }
    s->params = params;
    s->vocab_size = vocab_size;
    s->rng = splitmix64(params.seed);
    if (s->rng == 0) s->rng = 1;  // xorshift's one fixed point
    return ERR_OK;
}

void sampler_free(Sampler *s)
{
    if (!s) return;
    free(s->candidates);
    free(s->counts);
    memset(s, 0, sizeof *s);
}

double sampler_uniform(Sampler *s)
{
    uint64_t x = s->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    s->rng = x;
    return (double) ((x * 0x2545f4914f6cdd1dull) >> 11) * 0x1.0p-53;
}

void sampler_apply_penalties(Sampler *s, float *logits, const int32_t *history, int n)
{
    const SamplerParams *p = &s->params;
    const bool has_rep = p->repetition_penalty > 0.0f && p->repetition_penalty != 1.0f;
    if (!has_rep && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f) return;
    for (int i = 0; i < n; i++)
        if (history[i] >= 0 && history[i] < s->vocab_size) s->counts[history[i]]++;
    for (int i = 0; i < n; i++) {
        const int32_t id = history[i];
        if (id < 0 || id >= s->vocab_size || s->counts[id] == 0) continue;  // done already
        float v = logits[id];
        if (has_rep) v = v > 0.0f ? v / p->repetition_penalty : v * p->repetition_penalty;
        v -= p->presence_penalty + p->frequency_penalty * (float) s->counts[id];
        logits[id] = v;
        s->counts[id] = 0;  // leaves the scratch zeroed for the next call
    }
}

// Keep the k best of c[0..n) in c[0..k), sorted best first (engine/model/topk.h), ties to the
// lower token id.
static void select_sorted(TopkEntry *c, int n, int k)
{
    int n_heap = 0;
    for (int i = 0; i < n; i++)
        topk_offer(c, &n_heap, k, c[i], TOPK_TIE_LOWER_ID);
    topk_sort(c, k, TOPK_TIE_LOWER_ID);
}

// The first index of the largest logit, as `for i: if (l[i] > l[best]) best = i` finds it
// (NaNs never win unless at 0), in 8 independent running maxima (lane j takes i = j mod 8)
// merged by value then lowest index: a dependent chain per element made this a third of a
// decode step's host time at a 154,880-token vocabulary.
static int argmax_first(const float *l, int V)
{
    enum { LANES = 8 };
    if (V < 2 * LANES || l[0] != l[0]) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (l[i] > l[best]) best = i;
        return best;
    }
    float bv[LANES];
    int bi[LANES];
    for (int j = 0; j < LANES; j++) {
        bv[j] = l[0];
        bi[j] = 0;
    }
    int i = 0;
    for (; i + LANES <= V; i += LANES)
        for (int j = 0; j < LANES; j++)
            if (l[i + j] > bv[j]) {
                bv[j] = l[i + j];
                bi[j] = i + j;
            }
    int best = bi[0];
    for (int j = 1; j < LANES; j++)
        if (bv[j] > l[best] || (bv[j] == l[best] && bi[j] < best)) best = bi[j];
    for (; i < V; i++)
        if (l[i] > l[best]) best = i;
    return best;
}

int32_t sampler_sample(Sampler *s, float *logits)
{
    const SamplerParams *p = &s->params;
    const int V = s->vocab_size;
    const int best = argmax_first(logits, V);
    if (p->temperature == 0.0f) return best;  // greedy: ties to the lowest id

    // The same fp32 division as every candidate's, so the best one sits exactly at 0 below.
    const float max_scaled = logits[best] / p->temperature;
    const double max_logit = max_scaled;
    const bool has_top_k = p->top_k > 0 && p->top_k < V;
    if (!has_top_k && p->top_p >= 1.0f && p->min_p <= 0.0f) {
        // No filter: draw from the whole softmax in id order, nothing to sort.
        double total = 0.0;
        for (int i = 0; i < V; i++)
            total += exp((double) logits[i] / p->temperature - max_logit);
        const double u = sampler_uniform(s) * total;
        double cum = 0.0;
        for (int i = 0; i < V; i++) {
            cum += exp((double) logits[i] / p->temperature - max_logit);
            if (u < cum) return i;
        }
        return best;
    }

    TopkEntry *c = s->candidates;
    int n = 0;
    // min-p (p_i >= min_p * p_max, i.e. logit_i - max_logit >= log(min_p)) can go first when
    // no top-p follows: a candidate it drops could never pass it after top-k. With top-p,
    // min-p must see the top-p survivors, so it waits.
    const double floor_logit = p->min_p > 0.0f ? log((double) p->min_p) : -INFINITY;
    const bool min_p_first = p->top_p >= 1.0f;
    for (int i = 0; i < V; i++) {
        const float scaled = logits[i] / p->temperature;
        if (min_p_first && (double) scaled - max_logit < floor_logit) continue;
        c[n++] = (TopkEntry){scaled, i};
    }
    ASSERT(n > 0);  // the best candidate always passes min-p (0 >= log(min_p))
    select_sorted(c, n, has_top_k && p->top_k < n ? p->top_k : n);
    if (has_top_k && p->top_k < n) n = p->top_k;

    // Probabilities of the kept prefix; c[0] has the largest logit.
    double sum = 0.0;
    for (int i = 0; i < n; i++)
        sum += exp(c[i].key - max_logit);
    if (p->top_p < 1.0f) {
        double cum = 0.0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += exp(c[i].key - max_logit) / sum;
            if (cum >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (p->min_p > 0.0f && !min_p_first) {
        int keep = 1;
        while (keep < n && c[keep].key - max_logit >= floor_logit)
            keep++;
        n = keep;
    }
    double total = 0.0;
    for (int i = 0; i < n; i++)
        total += exp(c[i].key - max_logit);
    const double u = sampler_uniform(s) * total;
    double cum = 0.0;
    for (int i = 0; i < n; i++) {
        cum += exp(c[i].key - max_logit);
        if (u < cum) return c[i].id;
    }
    return c[n - 1].id;
}
