/*
 * sampler.c - penalties, temperature, top-k / top-p / min-p and one draw (see sampler.h).
 *
 * Candidates are ranked by scaled logit, descending, ties by id, so the filters are prefixes
 * of one order; every draw walks its kept prefix in that order (or, without filters, the
 * vocabulary in id order). Probabilities are computed in double from the scaled logits. The
 * result is a function of the logits, the parameters and the generator state alone: how we
 * get there below is chosen for speed, and each shortcut is exact (tests/engine/model/
 * test_sampler.c checks them against the straightforward algorithm, token and generator
 * state).
 *
 * The shortcuts, at a 154,880-token vocabulary, where a decode step's sampling adds up:
 *   - Each weight exp(scaled - max) is computed once into s->weights and reused by the
 *     sums, the top-p scan and the draw (the straightforward code computes it up to 4 times).
 *   - The filters sort only the candidates that can matter. The best one has weight exactly
 *     exp(0) = 1, so every running sum over the ranked order is >= 1 from its first term on;
 *     a weight below 2^-54 (scaled - max < -38: exp(-38) = 3.1e-17) added to a sum >= 1 is
 *     under half its last place and rounds away. Such candidates rank after all others, so
 *     they change no sum, no cumulative value and no draw; they only lengthen the list. We
 *     drop them and sort the rest: a heap for small top-k, else a stable radix sort on the
 *     key's bits, which keeps id order within ties. Without NaNs the rank order is total, so
 *     any correct sort gives the same list.
 *   - The full ranking (sample_filtered_all, the straightforward code) still runs where the
 *     argument does not hold: a NaN anywhere or an infinite maximum, and a top-p scan that
 *     ends without reaching top_p over what we kept while the full list is longer (its kept
 *     set would run into the dropped candidates; the scan's rounding keeps it within
 *     n * 2^-53 of 1, so this needs vocabularies past 2^28, but the check costs nothing).
 * Measured (tests/bench/bench_sampler.c, docs/perf.md, 2-core development VM): temperature
 * 0.7 with top-p 0.95 went from 17.3 ms to 0.81 ms a row (1.4 ms when every candidate is
 * within reach of the maximum), temperature alone from 0.88 to 0.60 ms, top-k 50 from 0.36
 * to 0.21 ms.
 */
#include "engine/model/sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

// Candidates with scaled - max below this cannot change any sum (file comment): exp(-38) =
// 3.1e-17 < 2^-54 with room for exp()'s last-place error.
#define SAMPLER_NEGLIGIBLE (-38.0)

enum {
    // Top-k up to this size selects with a k-entry heap as it scans: one comparison per
    // candidate in the usual case, log2(k) levels of sifting for each that enters (all of
    // them in a row that rises with the id), hence the bound. Larger k, and top-p or min-p
    // alone, go through the radix sort.
    SAMPLER_HEAP_MAX_K = 128,
    // Up to this many candidates are sorted by the heap too: the radix sort's fixed cost
    // (three 2,048-bucket histograms, cleared and scanned) would dominate.
    SAMPLER_HEAP_MAX_SORT = 256,
    RADIX_BITS = 11,
    RADIX_BUCKETS = 1 << RADIX_BITS,
};

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

Err sampler_check_params(SamplerParams params)
{
    if (!(params.temperature >= 0.0f) || params.top_k < 0
        || !(params.top_p > 0.0f && params.top_p <= 1.0f)
        || !(params.min_p >= 0.0f && params.min_p <= 1.0f) || !(params.repetition_penalty >= 0.0f)
        || !isfinite(params.presence_penalty) || !isfinite(params.frequency_penalty)) {
        LOG_ERROR("bad sampling parameters: temperature %g, top_k %d, top_p %g, min_p %g, "
                  "repetition_penalty %g",
                  params.temperature, params.top_k, params.top_p, params.min_p,
                  params.repetition_penalty);
        return ERR_INVAL;
    }
    return ERR_OK;
}

Err sampler_init(Sampler *s, int vocab_size, SamplerParams params)
{
    memset(s, 0, sizeof *s);
    if (vocab_size < 1) {
        LOG_ERROR("bad vocabulary size %d for a sampler", vocab_size);
        return ERR_INVAL;
    }
    Err err = sampler_check_params(params);
    if (err) return err;
    // Untouched pages cost nothing: greedy touches none of these, the other paths only the
    // entries they use.
    s->candidates = malloc((size_t) vocab_size * sizeof *s->candidates);
    s->order = malloc(2 * (size_t) vocab_size * sizeof *s->order);
    s->weights = malloc((size_t) vocab_size * sizeof *s->weights);
    s->counts = calloc((size_t) vocab_size, sizeof *s->counts);
    s->block_cum = malloc(((size_t) vocab_size / SAMPLER_SCAN_BLOCK + 1) * sizeof *s->block_cum);
    if (!s->candidates || !s->order || !s->weights || !s->counts || !s->block_cum) {
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
    free(s->order);
    free(s->weights);
    free(s->counts);
    free(s->block_cum);
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

// ---------------------------------------------------------------------------
// Ranking

// Keep the k best of c[0..n) in c[0..k), sorted best first (engine/model/topk.h), ties to the
// lower token id.
static void select_sorted(TopkEntry *c, int n, int k)
{
    int n_heap = 0;
    for (int i = 0; i < n; i++)
        topk_offer(c, &n_heap, k, c[i], TOPK_TIE_LOWER_ID);
    topk_sort(c, k, TOPK_TIE_LOWER_ID);
}

// A candidate as one integer whose ascending order is the rank order: the upper 32 bits the
// scaled logit's bits mapped so that larger floats give smaller integers (finite keys; -0 is
// made +0 first, as the ranking compares them equal), the lower 32 bits the token id.
static uint64_t rank_pack(float key, int32_t id)
{
    const float k = key + 0.0f;  // -0 + 0 is +0; every other value is unchanged
    uint32_t b;
    memcpy(&b, &k, sizeof b);
    const uint32_t sign = 0u - (b >> 31);  // all ones for a negative key
    const uint32_t ascending = b ^ (sign | 0x80000000u);
    return (uint64_t) ~ascending << 32 | (uint32_t) id;
}

static TopkEntry rank_unpack(uint64_t v)
{
    const uint32_t ascending = ~(uint32_t) (v >> 32);
    const uint32_t b = ascending >> 31 ? ascending & 0x7fffffffu : ~ascending;
    float key;
    memcpy(&key, &b, sizeof key);
    return (TopkEntry){key, (int32_t) (uint32_t) v};
}

// Sorts a[0..n) ascending by the upper 32 bits, stably (entries entered in id order stay in
// id order within a key), LSD in three 11-bit digits through tmp[0..n). A digit every entry
// shares is skipped. Returns the buffer holding the result, a or tmp.
static uint64_t *radix_sort_hi32(uint64_t *a, uint64_t *tmp, int n)
{
    uint32_t hist[3][RADIX_BUCKETS];
    memset(hist, 0, sizeof hist);
    for (int i = 0; i < n; i++) {
        const uint32_t k = (uint32_t) (a[i] >> 32);
        hist[0][k & (RADIX_BUCKETS - 1)]++;
        hist[1][k >> RADIX_BITS & (RADIX_BUCKETS - 1)]++;
        hist[2][k >> 2 * RADIX_BITS]++;
    }
    for (int pass = 0; pass < 3; pass++) {
        const int shift = 32 + pass * RADIX_BITS;
        uint32_t *h = hist[pass];
        if (h[a[0] >> shift & (RADIX_BUCKETS - 1)] == (uint32_t) n) continue;
        uint32_t at = 0;
        for (int d = 0; d < RADIX_BUCKETS; d++) {
            const uint32_t c = h[d];
            h[d] = at;
            at += c;
        }
        for (int i = 0; i < n; i++)
            tmp[h[a[i] >> shift & (RADIX_BUCKETS - 1)]++] = a[i];
        uint64_t *t = a;
        a = tmp;
        tmp = t;
    }
    return a;
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

// ---------------------------------------------------------------------------
// Filtered draws

// The filters by the definition: every candidate ranked, then the prefixes. The fast path
// below returns what this returns; it runs itself only where the fast path cannot show that
// it does (NaN keys, an infinite maximum, a top-p scan that runs out). max_logit is the
// largest scaled logit.
static int32_t sample_filtered_all(Sampler *s, const float *logits, double max_logit)
{
    const SamplerParams *p = &s->params;
    const int V = s->vocab_size;
    const bool has_top_k = p->top_k > 0 && p->top_k < V;
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

// sample_filtered_all's result over the candidates that can matter (file comment): those
// within SAMPLER_NEGLIGIBLE of the maximum, ranked by a heap (small top-k) or the radix sort.
static int32_t sample_filtered(Sampler *s, const float *logits, double max_logit)
{
    const SamplerParams *p = &s->params;
    const int V = s->vocab_size;
    const bool has_top_k = p->top_k > 0 && p->top_k < V;
    const double floor_logit = p->min_p > 0.0f ? log((double) p->min_p) : -INFINITY;
    const bool min_p_first = p->top_p >= 1.0f;
    const bool use_heap = has_top_k && p->top_k <= SAMPLER_HEAP_MAX_K;
    TopkEntry *c = s->candidates;
    uint64_t *packed = s->order;
    // A candidate is in the full list when rel = scaled - max passes min-p-first, and can
    // matter when it is also at least SAMPLER_NEGLIGIBLE: rel >= cut.
    const double pass_floor = min_p_first ? floor_logit : -INFINITY;
    const double cut = pass_floor > SAMPLER_NEGLIGIBLE ? pass_floor : SAMPLER_NEGLIGIBLE;
    int n_pass = 0;  // candidates in the full list: its length before top-k
    int m = 0;       // of them, those that can matter, in c (heap) or packed (id order)
    // Three scans of the same candidates, for three patterns of branches. A NaN compares
    // false everywhere, so each scan's rare path (or, in the third, a flag) catches it.
    if (use_heap) {
        // One branch, rarely taken once the heap is full: can it beat the heap's worst?
        for (int i = 0; i < V; i++) {
            const float scaled = logits[i] / p->temperature;
            const double rel = (double) scaled - max_logit;
            n_pass += rel >= pass_floor;
            const double worst = m < p->top_k ? -INFINITY : c[0].key;
            if (!(rel < cut) & !((double) scaled < worst)) {
                if (scaled != scaled) return sample_filtered_all(s, logits, max_logit);
                topk_offer(c, &m, p->top_k, (TopkEntry){scaled, i}, TOPK_TIE_LOWER_ID);
            }
        }
    } else if (cut > SAMPLER_NEGLIGIBLE) {
        // min-p decides, and usually keeps few: a branch almost never taken is cheaper than
        // a store per candidate (170 against 370 µs a row at min-p 0.05).
        for (int i = 0; i < V; i++) {
            const float scaled = logits[i] / p->temperature;
            if ((double) scaled - max_logit < cut) continue;
            if (scaled != scaled) return sample_filtered_all(s, logits, max_logit);
            packed[m++] = rank_pack(scaled, i);
        }
        n_pass = m;
    } else {
        // Whether a candidate can matter follows no pattern in id order (half of a row can
        // sit on either side of the cut), so every one is stored and the kept are counted
        // without a branch: a mispredicted branch per candidate took 10 of the 14 ns a
        // candidate cost (T 0.7, top-p 0.95).
        bool has_nan = false;
        for (int i = 0; i < V; i++) {
            const float scaled = logits[i] / p->temperature;
            const double rel = (double) scaled - max_logit;
            has_nan |= scaled != scaled;
            n_pass += rel >= pass_floor;
            packed[m] = rank_pack(scaled, i);
            m += rel >= cut;
        }
        if (has_nan) return sample_filtered_all(s, logits, max_logit);
    }
    ASSERT(m > 0);  // the best candidate (rel 0) always passes
    // The full list keeps n_kept candidates after top-k; ours is its first n.
    const int n_kept = has_top_k && p->top_k < n_pass ? p->top_k : n_pass;
    int n;
    if (use_heap) {
        n = m;  // min(top_k, candidates that matter)
        if (m < p->top_k)
            select_sorted(c, m, m);  // never filled: not a heap yet
        else
            topk_sort(c, m, TOPK_TIE_LOWER_ID);
    } else if (m <= SAMPLER_HEAP_MAX_SORT) {
        n = m < n_kept ? m : n_kept;
        for (int j = 0; j < m; j++)
            c[j] = rank_unpack(packed[j]);
        select_sorted(c, m, n);
    } else {
        n = m < n_kept ? m : n_kept;
        const uint64_t *sorted = radix_sort_hi32(packed, packed + V, m);
        for (int j = 0; j < n; j++)
            c[j] = rank_unpack(sorted[j]);
    }

    // Weights once, in rank order; equal keys sit together and share one exp().
    double *w = s->weights;
    double sum = 0.0;
    for (int j = 0; j < n; j++) {
        w[j] = j > 0 && c[j].key == c[j - 1].key ? w[j - 1] : exp(c[j].key - max_logit);
        sum += w[j];
    }
    int keep = n;
    if (p->top_p < 1.0f) {
        double cum = 0.0;
        int j = 0;
        while (j < n && !((cum += w[j] / sum) >= p->top_p))
            j++;
        if (j == n && n < n_kept) return sample_filtered_all(s, logits, max_logit);
        keep = j < n ? j + 1 : n;
    }
    if (p->min_p > 0.0f && !min_p_first) {
        int k = 1;
        while (k < keep && c[k].key - max_logit >= floor_logit)
            k++;
        keep = k;
    }
    // The same additions as sum's when nothing was cut, hence the same total.
    double total = sum;
    if (keep < n) {
        total = 0.0;
        for (int j = 0; j < keep; j++)
            total += w[j];
    }
    const double u = sampler_uniform(s) * total;
    double cum = 0.0;
    for (int j = 0; j < keep; j++) {
        cum += w[j];
        if (u < cum) return c[j].id;
    }
    return c[keep - 1].id;
}

// ---------------------------------------------------------------------------
// Draw

bool sampler_begin(Sampler *s, float *logits, int32_t *token)
{
    const SamplerParams *p = &s->params;
    const int V = s->vocab_size;
    const int best = argmax_first(logits, V);
    *token = best;
    if (p->temperature == 0.0f) return true;  // greedy: ties to the lowest id

    // The same fp32 division as every candidate's, so the best one sits exactly at 0 below.
    const float max_scaled = logits[best] / p->temperature;
    const double max_logit = max_scaled;
    const bool has_top_k = p->top_k > 0 && p->top_k < V;
    if (!has_top_k && p->top_p >= 1.0f && p->min_p <= 0.0f) {
        // No filter: the whole softmax in id order, nothing to sort (sampler_weights,
        // sampler_finish).
        s->pend_best = best;
        s->pend_max = max_logit;
        return false;
    }
    *token = isfinite(max_scaled) ? sample_filtered(s, logits, max_logit)
                                  : sample_filtered_all(s, logits, max_logit);
    return true;
}

void sampler_weights(Sampler *s, const float *logits, int chunk, int n_chunks)
{
    const int V = s->vocab_size;
    const int lo = (int) ((long long) V * chunk / n_chunks);
    const int hi = (int) ((long long) V * (chunk + 1) / n_chunks);
    const float temperature = s->params.temperature;
    const double max_logit = s->pend_max;
    double *w = s->weights;
    for (int i = lo; i < hi; i++)
        w[i] = exp((double) logits[i] / temperature - max_logit);
}

int32_t sampler_finish(Sampler *s)
{
    // Each weight was computed once: the total and the scan add the same values in the same
    // order, and the scan restarts from the running sum recorded at the start of the block
    // where it first exceeds u (the same partial sums, so the same token).
    const int V = s->vocab_size;
    const double *w = s->weights;
    double total = 0.0;
    for (int b = 0, i = 0; i < V; b++) {
        s->block_cum[b] = total;
        const int end = i + SAMPLER_SCAN_BLOCK < V ? i + SAMPLER_SCAN_BLOCK : V;
        for (; i < end; i++)
            total += w[i];
    }
    const double u = sampler_uniform(s) * total;
    const int n_blocks = (V + SAMPLER_SCAN_BLOCK - 1) / SAMPLER_SCAN_BLOCK;
    int b = 0;
    while (b + 1 < n_blocks && !(u < s->block_cum[b + 1]))
        b++;
    double cum = s->block_cum[b];
    for (int i = b * SAMPLER_SCAN_BLOCK; i < V; i++) {
        cum += w[i];
        if (u < cum) return i;
    }
    return s->pend_best;
}

int32_t sampler_sample(Sampler *s, float *logits)
{
    int32_t token;
    if (sampler_begin(s, logits, &token)) return token;
    sampler_weights(s, logits, 0, 1);
    return sampler_finish(s);
}
