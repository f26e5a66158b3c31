/*
 * sampler.c - penalties, temperature, top-k / top-p / min-p and one draw (see sampler.h).
 *
 * Candidates are sorted by logit, descending, ties by id, so the filters are prefixes of
 * one order and the result does not depend on qsort's stability. Probabilities are
 * computed in double from the scaled logits of the kept candidates.
 */
#include "sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

SamplerParams sampler_default_params(void)
{
    return (SamplerParams){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                           .repetition_penalty = 1.0f};
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
    if (vocab_size < 1 || !(params.temperature >= 0.0f) || params.top_k < 0 ||
        !(params.top_p > 0.0f && params.top_p <= 1.0f) ||
        !(params.min_p >= 0.0f && params.min_p <= 1.0f) ||
        !(params.repetition_penalty >= 0.0f) || !isfinite(params.presence_penalty) ||
        !isfinite(params.frequency_penalty)) {
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

static int by_logit_desc(const void *a, const void *b)
{
    const SamplerCandidate *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

int32_t sampler_sample(Sampler *s, float *logits)
{
    const SamplerParams *p = &s->params;
    const int V = s->vocab_size;
    if (p->temperature == 0.0f) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (logits[i] > logits[best]) best = i;
        return best;
    }
    SamplerCandidate *c = s->candidates;
    for (int i = 0; i < V; i++)
        c[i] = (SamplerCandidate){i, logits[i] / p->temperature};
    qsort(c, (size_t) V, sizeof *c, by_logit_desc);

    int n = V;
    if (p->top_k > 0 && p->top_k < n) n = p->top_k;

    // Probabilities of the kept prefix; c[0] has the largest logit.
    double sum = 0.0;
    const double max_logit = c[0].logit;
    for (int i = 0; i < n; i++)
        sum += exp((double) c[i].logit - max_logit);
    if (p->top_p < 1.0f) {
        double cum = 0.0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += exp((double) c[i].logit - max_logit) / sum;
            if (cum >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (p->min_p > 0.0f) {
        // p_i >= min_p * p_max  <=>  logit_i - max_logit >= log(min_p)
        const double floor_logit = log((double) p->min_p);
        int keep = 1;
        while (keep < n && (double) c[keep].logit - max_logit >= floor_logit)
            keep++;
        n = keep;
    }
    double total = 0.0;
    for (int i = 0; i < n; i++)
        total += exp((double) c[i].logit - max_logit);
    const double u = sampler_uniform(s) * total;
    double cum = 0.0;
    for (int i = 0; i < n; i++) {
        cum += exp((double) c[i].logit - max_logit);
        if (u < cum) return c[i].id;
    }
    return c[n - 1].id;
}
