/*
 * sampler_ref.h - the oracle for engine/model/sampler.c: the sampler as it was before its
 * exact shortcuts (sampler.c's file comment), copied, for test_sampler.c and
 * tests/bench/bench_sampler.c. Do not optimise it: it is the definition the sampler is
 * checked against, and the "before" of the benchmark.
 *
 * It ranks every candidate with a heap over the whole vocabulary, then takes the prefixes,
 * recomputing each exp() where it is used. The copy differs from the original only in its
 * names (ref_*, n_vocab) and in the lines marked "trace". (Its 8-lane argmax, unchanged in
 * sampler.c, is checked against the plain first-index loop by test_greedy_lanes.)
 */
#ifndef TESTS_ENGINE_MODEL_SAMPLER_REF_H
#define TESTS_ENGINE_MODEL_SAMPLER_REF_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "engine/model/sampler.h"
#include "engine/model/topk.h"
#include "engine/shared/err.h"

// The oracle's sampler state: Sampler's, less the new scratch.
typedef struct RefSampler {
    SamplerParams params;
    uint64_t rng;
    int vocab_size;
    TopkEntry *candidates;  // [vocab_size]
    int32_t *counts;        // [vocab_size]
} RefSampler;

static inline uint64_t ref_splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline void ref_init(RefSampler *s, int vocab_size, SamplerParams params)
{
    s->params = params;
    s->vocab_size = vocab_size;
    s->candidates = malloc((size_t) vocab_size * sizeof *s->candidates);
    s->counts = calloc((size_t) vocab_size, sizeof *s->counts);
    ASSERT(s->candidates && s->counts);
    s->rng = ref_splitmix64(params.seed);
    if (s->rng == 0) s->rng = 1;
}

static inline void ref_free(RefSampler *s)
{
    free(s->candidates);
    free(s->counts);
}

static inline double ref_uniform(RefSampler *s)
{
    uint64_t x = s->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    s->rng = x;
    return (double) ((x * 0x2545f4914f6cdd1dull) >> 11) * 0x1.0p-53;
}

static inline void ref_apply_penalties(RefSampler *s, float *logits, const int32_t *history, int n)
{
    const SamplerParams *p = &s->params;
    const bool has_rep = p->repetition_penalty > 0.0f && p->repetition_penalty != 1.0f;
    if (!has_rep && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f) return;
    for (int i = 0; i < n; i++)
        if (history[i] >= 0 && history[i] < s->vocab_size) s->counts[history[i]]++;
    for (int i = 0; i < n; i++) {
        const int32_t id = history[i];
        if (id < 0 || id >= s->vocab_size || s->counts[id] == 0) continue;
        float v = logits[id];
        if (has_rep) v = v > 0.0f ? v / p->repetition_penalty : v * p->repetition_penalty;
        v -= p->presence_penalty + p->frequency_penalty * (float) s->counts[id];
        logits[id] = v;
        s->counts[id] = 0;
    }
}

static inline void ref_select_sorted(TopkEntry *c, int n, int k)
{
    int n_heap = 0;
    for (int i = 0; i < n; i++)
        topk_offer(c, &n_heap, k, c[i], TOPK_TIE_LOWER_ID);
    topk_sort(c, k, TOPK_TIE_LOWER_ID);
}

static inline int ref_argmax_first(const float *l, int n_vocab)
{
    enum { LANES = 8 };
    if (n_vocab < 2 * LANES || l[0] != l[0]) {
        int best = 0;
        for (int i = 1; i < n_vocab; i++)
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
    for (; i + LANES <= n_vocab; i += LANES)
        for (int j = 0; j < LANES; j++)
            if (l[i + j] > bv[j]) {
                bv[j] = l[i + j];
                bi[j] = i + j;
            }
    int best = bi[0];
    for (int j = 1; j < LANES; j++)
        if (bv[j] > l[best] || (bv[j] == l[best] && bi[j] < best)) best = bi[j];
    for (; i < n_vocab; i++)
        if (l[i] > l[best]) best = i;
    return best;
}

// What one draw of the oracle compared against: the candidates in draw order with the running
// sum after each, the total, and the token returned when no running sum exceeds u. With it
// the oracle's token for any uniform value is known without running it again (ref_replay).
typedef struct RefTrace {
    bool has_draw;  // false: greedy, no draw
    int n;          // candidates the draw walks
    int32_t *ids;   // [vocab_size]
    double *cum;    // [vocab_size]
    double total;
    int32_t fallback;
} RefTrace;

// The oracle. tr, when not NULL, records the draw (the lines marked "trace" are the only
// additions to the copied code).
static inline int32_t ref_sample(RefSampler *s, float *logits, RefTrace *tr)
{
    if (tr) tr->has_draw = false;  // trace
    const SamplerParams *p = &s->params;
    const int n_vocab = s->vocab_size;
    const int best = ref_argmax_first(logits, n_vocab);
    if (p->temperature == 0.0f) return best;

    const float max_scaled = logits[best] / p->temperature;
    const double max_logit = max_scaled;
    const bool has_top_k = p->top_k > 0 && p->top_k < n_vocab;
    if (!has_top_k && p->top_p >= 1.0f && p->min_p <= 0.0f) {
        double total = 0.0;
        for (int i = 0; i < n_vocab; i++)
            total += exp((double) logits[i] / p->temperature - max_logit);
        if (tr) {  // trace
            double c = 0.0;
            for (int i = 0; i < n_vocab; i++) {
                c += exp((double) logits[i] / p->temperature - max_logit);
                tr->ids[i] = i;
                tr->cum[i] = c;
            }
            *tr = (RefTrace){true, n_vocab, tr->ids, tr->cum, total, best};
        }
        const double u = ref_uniform(s) * total;
        double cum = 0.0;
        for (int i = 0; i < n_vocab; i++) {
            cum += exp((double) logits[i] / p->temperature - max_logit);
            if (u < cum) return i;
        }
        return best;
    }

    TopkEntry *c = s->candidates;
    int n = 0;
    const double floor_logit = p->min_p > 0.0f ? log((double) p->min_p) : -INFINITY;
    const bool min_p_first = p->top_p >= 1.0f;
    for (int i = 0; i < n_vocab; i++) {
        const float scaled = logits[i] / p->temperature;
        if (min_p_first && (double) scaled - max_logit < floor_logit) continue;
        c[n++] = (TopkEntry){scaled, i};
    }
    ASSERT(n > 0);
    ref_select_sorted(c, n, has_top_k && p->top_k < n ? p->top_k : n);
    if (has_top_k && p->top_k < n) n = p->top_k;

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
    if (tr) {  // trace
        double cu = 0.0;
        for (int i = 0; i < n; i++) {
            cu += exp(c[i].key - max_logit);
            tr->ids[i] = c[i].id;
            tr->cum[i] = cu;
        }
        *tr = (RefTrace){true, n, tr->ids, tr->cum, total, c[n - 1].id};
    }
    const double u = ref_uniform(s) * total;
    double cum = 0.0;
    for (int i = 0; i < n; i++) {
        cum += exp(c[i].key - max_logit);
        if (u < cum) return c[i].id;
    }
    return c[n - 1].id;
}

// The oracle's token had its uniform draw been v.
static inline int32_t ref_replay(const RefTrace *tr, double v)
{
    const double u = v * tr->total;
    for (int i = 0; i < tr->n; i++)
        if (u < tr->cum[i]) return tr->ids[i];
    return tr->fallback;
}

#endif  // TESTS_ENGINE_MODEL_SAMPLER_REF_H
