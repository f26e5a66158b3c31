/*
 * test_sampler.c - sampler.c: greedy, determinism under a seed, the top-k / top-p / min-p
 * masks, penalties, the drawn distribution against the softmax, and every draw against the
 * straightforward algorithm.
 *
 * Distribution check: with N draws the count of a token with probability p is binomial,
 * standard deviation sqrt(N p (1 - p)); we allow 6 of them. The seed is fixed, so the test
 * is deterministic; the bound only says that a correct sampler passes with any seed.
 *
 * Oracle check: sampler.c takes shortcuts (weights computed once, only the candidates that
 * can matter ranked, a radix sort) that must not change a single token. The oracle below is
 * the sampler as it was before them, copied: rank every candidate by a heap, then the
 * prefixes, recomputing each exp() where it is used. Both run on the same rows (ties,
 * masked -inf entries, signed zeros, wide and narrow spreads, rows sorted by id) with the
 * same seed, for greedy, temperature alone and every filter and penalty combination, at
 * small vocabularies and at 154,880; tokens, penalised logits and the generator state
 * afterwards must be identical.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/sampler.h"
#include "tests/check.h"
#include "tests/engine/model/sampler_ref.h"

enum { V = 16 };

static void fill(float *logits)
{
    // A fixed, distinct set of logits: token i has logit (i * 7 % 16) / 4.
    for (int i = 0; i < V; i++)
        logits[i] = (float) ((i * 7) % V) / 4.0f;
}

static int draw(Sampler *s)
{
    float logits[V];
    fill(logits);
    return sampler_sample(s, logits);
}

// count[V]: how often each token came out of n draws from fill()'s logits by a fresh sampler
// with params p.
static void draw_counts(SamplerParams p, int n, int *count)
{
    Sampler s;
    CHECK(sampler_init(&s, V, p) == ERR_OK);
    memset(count, 0, V * sizeof *count);
    for (int i = 0; i < n; i++)
        count[draw(&s)]++;
    sampler_free(&s);
}

static void test_greedy(void)
{
    Sampler s;
    CHECK(sampler_init(&s, V, sampler_default_params()) == ERR_OK);
    float logits[V];
    fill(logits);
    int best = 0;
    for (int i = 0; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    CHECK(sampler_sample(&s, logits) == best);
    for (int i = 0; i < V; i++)
        logits[i] = 1.0f;  // all tied: the lowest id
    CHECK(sampler_sample(&s, logits) == 0);
    sampler_free(&s);
}

// Greedy over vocabularies of every size mod 8 up to a real one's (the argmax runs in 8
// lanes): the first index of the maximum as a plain scan finds it, with ties planted in other
// lanes and before the maximum, and NaNs (never chosen unless at 0, as the plain scan does).
static void test_greedy_lanes(void)
{
    const int sizes[] = {1, 2, 15, 16, 17, 23, 64, 1001, 154880};
    uint64_t r = 12345;
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        const int n = sizes[k];
        Sampler s;
        CHECK(sampler_init(&s, n, sampler_default_params()) == ERR_OK);
        float *l = malloc((size_t) n * sizeof *l);
        for (int trial = 0; trial < 40; trial++) {
            for (int i = 0; i < n; i++) {
                r = r * 6364136223846793005ull + 1442695040888963407ull;
                l[i] = (float) ((r >> 33) % 50);  // many ties
            }
            if (trial % 4 == 1 && n > 3) l[n / 3] = NAN;
            if (trial % 4 == 2) l[0] = NAN;
            if (trial % 4 == 3) l[n - 1] = 60.0f;
            int want = 0;
            for (int i = 1; i < n; i++)
                if (l[i] > l[want]) want = i;
            CHECK(sampler_sample(&s, l) == want);
        }
        free(l);
        sampler_free(&s);
    }
}

static void test_determinism(void)
{
    SamplerParams p = sampler_default_params();
    p.temperature = 1.0f;
    p.seed = 42;
    Sampler a, b, c;
    CHECK(sampler_init(&a, V, p) == ERR_OK);
    CHECK(sampler_init(&b, V, p) == ERR_OK);
    p.seed = 43;
    CHECK(sampler_init(&c, V, p) == ERR_OK);
    int same = 1, differ = 0;
    for (int i = 0; i < 200; i++) {
        const int x = draw(&a), y = draw(&b), z = draw(&c);
        same &= x == y;
        differ += x != z;
    }
    CHECK(same);
    CHECK(differ > 50);  // another seed gives another stream (about 90% differ here)
    sampler_free(&a);
    sampler_free(&b);
    sampler_free(&c);
}

// Softmax of fill()'s logits / temperature.
static void softmax_ref(double temperature, double *prob)
{
    float logits[V];
    fill(logits);
    double sum = 0.0;
    for (int i = 0; i < V; i++)
        sum += prob[i] = exp(logits[i] / temperature);
    for (int i = 0; i < V; i++)
        prob[i] /= sum;
}

static void test_distribution(void)
{
    const int N = 40000;
    SamplerParams p = sampler_default_params();
    p.temperature = 0.8f;
    p.seed = 7;
    int count[V];
    draw_counts(p, N, count);
    double prob[V];
    softmax_ref(0.8, prob);
    for (int i = 0; i < V; i++)
        CHECK_NEAR(count[i], N * prob[i], 6.0 * sqrt(N * prob[i] * (1 - prob[i])) + 1.0);
}

static void test_masks(void)
{
    const int N = 4000;
    double prob[V];
    softmax_ref(1.0, prob);
    // Tokens by probability, descending.
    int order[V];
    for (int i = 0; i < V; i++)
        order[i] = i;
    for (int i = 0; i < V; i++)
        for (int j = i + 1; j < V; j++)
            if (prob[order[j]] > prob[order[i]]) {
                const int t = order[i];
                order[i] = order[j];
                order[j] = t;
            }

    // top-k 3: only the three most likely, each drawn.
    SamplerParams p = sampler_default_params();
    p.temperature = 1.0f;
    p.top_k = 3;
    int count[V];
    draw_counts(p, N, count);
    for (int r = 0; r < V; r++)
        CHECK(r < 3 ? count[order[r]] > 0 : count[order[r]] == 0);

    // top-p: the smallest prefix whose mass reaches p.
    p = sampler_default_params();
    p.temperature = 1.0f;
    p.top_p = 0.7f;
    int keep = 0;
    for (double cum = 0.0; cum < 0.7; keep++)
        cum += prob[order[keep]];
    draw_counts(p, N, count);
    for (int r = 0; r < V; r++)
        CHECK(r < keep ? count[order[r]] > 0 : count[order[r]] == 0);

    // min-p: tokens with p >= min_p * p_max.
    p = sampler_default_params();
    p.temperature = 1.0f;
    p.min_p = 0.3f;
    draw_counts(p, N, count);
    for (int i = 0; i < V; i++)
        CHECK(prob[i] >= 0.3 * prob[order[0]] ? count[i] > 0 : count[i] == 0);

    // min-p 1 keeps only the most likely token, alone or after top-p.
    for (int with_top_p = 0; with_top_p < 2; with_top_p++) {
        p = sampler_default_params();
        p.temperature = 1.3f;
        p.min_p = 1.0f;
        p.top_p = with_top_p ? 0.9f : 1.0f;
        draw_counts(p, 100, count);
        CHECK(count[order[0]] == 100);
    }

    // top-k over tied logits keeps the lowest ids.
    p = sampler_default_params();
    p.temperature = 1.0f;
    p.top_k = 3;
    Sampler s;
    CHECK(sampler_init(&s, V, p) == ERR_OK);
    int low_ids = 1;
    for (int i = 0; i < 200; i++) {
        float flat[V];
        for (int j = 0; j < V; j++)
            flat[j] = 0.5f;
        low_ids &= sampler_sample(&s, flat) < 3;
    }
    CHECK(low_ids);
    sampler_free(&s);

    // top-k 1 is greedy whatever the temperature.
    p = sampler_default_params();
    p.temperature = 5.0f;
    p.top_k = 1;
    draw_counts(p, 100, count);
    CHECK(count[order[0]] == 100);
}

static void test_penalties(void)
{
    SamplerParams p = sampler_default_params();
    p.repetition_penalty = 2.0f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    Sampler s;
    CHECK(sampler_init(&s, V, p) == ERR_OK);
    float logits[V];
    for (int i = 0; i < V; i++)
        logits[i] = (float) (i - 8);
    const int32_t history[] = {10, 3, 10, 10};  // 10: 2.0 three times, 3: -5 once
    sampler_apply_penalties(&s, logits, history, 4);
    CHECK_NEAR(logits[10], 2.0 / 2.0 - 0.5 - 0.25 * 3, 1e-6);
    CHECK_NEAR(logits[3], -5.0 * 2.0 - 0.5 - 0.25, 1e-6);
    CHECK(logits[4] == -4.0f && logits[11] == 3.0f);
    for (int i = 0; i < V; i++)
        CHECK(s.counts[i] == 0);  // scratch left clean
    sampler_free(&s);

    p = sampler_default_params();
    p.top_p = 0.0f;
    CHECK(sampler_init(&s, V, p) == ERR_INVAL);
    CHECK(s.candidates == NULL);
    sampler_free(&s);
    CHECK(sampler_check_params(p) == ERR_INVAL);  // the same rule, without the scratch
    CHECK(sampler_check_params(sampler_default_params()) == ERR_OK);
    CHECK(sampler_init(&s, 0, sampler_default_params()) == ERR_INVAL && s.candidates == NULL);
}

// ---------------------------------------------------------------------------
// Oracle check (the oracle itself: sampler_ref.h)

// The xorshift64* state whose next sampler_uniform() is k * 2^-53 (k < 2^53): the output
// multiplier is odd, hence invertible mod 2^64, and each xorshift step is invertible. Lets
// a test put the draw at any point it likes, such as one unit either side of a boundary
// between two candidates, where a total one last place off would change the token.
static uint64_t rng_state_for(uint64_t k)
{
    const uint64_t mul = 0x2545f4914f6cdd1dull;
    uint64_t inv = mul;  // Newton's iteration doubles the correct low bits each step
    for (int i = 0; i < 6; i++)
        inv *= 2 - mul * inv;
    uint64_t y = (k << 11 | 1) * inv;  // the state after the step (never 0)
    // Undo x ^= x >> 27, then x ^= x << 25, then x ^= x >> 12.
    uint64_t x = y;
    for (int t = 27; t < 64; t += 27)
        x ^= y >> t;
    y = x;
    for (int t = 25; t < 64; t += 25)
        x ^= y << t;
    y = x;
    for (int t = 12; t < 64; t += 12)
        x ^= y >> t;
    return x;
}

// ---------------------------------------------------------------------------
// Rows and parameter sets for the oracle check

static uint64_t rnd(uint64_t *r)
{
    *r = *r * 6364136223846793005ull + 1442695040888963407ull;
    return *r >> 11;
}

// A uniform float in [0, 1).
static float rnd_unit(uint64_t *r)
{
    return (float) (rnd(r) >> 29) * 0x1.0p-24f;
}

enum { N_STYLES = 10 };

// Fills l[0..n) with one of N_STYLES kinds of row. with_nonfinite adds a NaN or an infinity
// (no shortcut applies to those rows; the sampler must still answer as the oracle does).
static void fill_row(float *l, int n, int style, bool with_nonfinite, uint64_t *r)
{
    switch (style) {
    case 0:  // continuous, narrow: every candidate matters at temperature 1
        for (int i = 0; i < n; i++)
            l[i] = 4.0f * rnd_unit(r) - 2.0f;
        break;
    case 1:  // a language model's shape: a bell around -2, a few tokens far above it
        for (int i = 0; i < n; i++)
            l[i] = 2.5f * (rnd_unit(r) + rnd_unit(r) + rnd_unit(r) + rnd_unit(r) - 2.0f) - 2.0f;
        for (int k = 0; k < 1 + n / 20000; k++)
            l[rnd(r) % (uint64_t) n] = 15.0f + 10.0f * rnd_unit(r);
        break;
    case 2:  // few distinct values: long runs of ties, the best one tied too
        for (int i = 0; i < n; i++)
            l[i] = (float) (rnd(r) % 12) * 0.75f - 4.0f;
        break;
    case 3:  // a vocabulary mask: most entries -inf (sometimes all but one)
        for (int i = 0; i < n; i++)
            l[i] = rnd(r) % 4 == 0 ? 6.0f * rnd_unit(r) - 3.0f : -INFINITY;
        if (rnd(r) % 3 == 0) {
            for (int i = 0; i < n; i++)
                l[i] = -INFINITY;
            l[rnd(r) % (uint64_t) n] = 1.5f;
        }
        break;
    case 4:  // a wide spread: most candidates far below the best (dropped before sorting)
        for (int i = 0; i < n; i++)
            l[i] = 2000.0f * rnd_unit(r) - 1000.0f;
        break;
    case 5:  // signed zeros and subnormals: equal keys with different bits
        for (int i = 0; i < n; i++) {
            const uint64_t k = rnd(r) % 5;
            l[i] = k == 0 ? 0.0f : k == 1 ? -0.0f : k == 2 ? 1e-40f : k == 3 ? -1e-40f : -1.0f;
        }
        break;
    case 6:  // all equal
        for (int i = 0; i < n; i++)
            l[i] = 0.5f;
        break;
    case 7:  // increasing with the id (every entry displaces a heap's worst)
        for (int i = 0; i < n; i++)
            l[i] = (float) i * 1e-3f;
        break;
    case 8:  // decreasing with the id, in steps that make ties
        for (int i = 0; i < n; i++)
            l[i] = -(float) (i / 3) * 0.01f;
        break;
    default:  // the bell, masked in stretches, with a tie at the top
        for (int i = 0; i < n; i++)
            l[i] = (i / 64) % 3 == 1 ? -INFINITY : 3.0f * (rnd_unit(r) - rnd_unit(r));
        if (n > 2) l[n - 1] = l[n / 2] = 9.0f;
        break;
    }
    if (with_nonfinite && n > 1) {
        const uint64_t k = rnd(r) % 3;
        l[rnd(r) % (uint64_t) n] = k == 0 ? NAN : k == 1 ? INFINITY : -INFINITY;
        if (k == 0 && rnd(r) % 2) l[0] = NAN;
    }
}

// The parameter sets: temperature alone, each filter, combinations, penalties. top_k values
// around SAMPLER_HEAP_MAX_K (128) and SAMPLER_HEAP_MAX_SORT (256) exercise every ranking;
// top_k -1 stands for the vocabulary's size - 1, -2 for its size + 5.
typedef struct OracleParams {
    float temperature;
    int top_k;
    float top_p, min_p, repetition, presence, frequency;
} OracleParams;

// clang-format off
static const OracleParams oracle_sets[] = {
    {0.0f,  0,   1.0f,      0.0f,   1.0f, 0.0f, 0.0f},   // greedy
    {1.0f,  0,   1.0f,      0.0f,   1.0f, 0.0f, 0.0f},   // temperature alone
    {0.7f,  0,   1.0f,      0.0f,   1.0f, 0.0f, 0.0f},
    {1.7f,  0,   1.0f,      0.0f,   1.0f, 0.0f, 0.0f},
    {0.05f, 0,   1.0f,      0.0f,   1.0f, 0.0f, 0.0f},
    {1.0f,  1,   1.0f,      0.0f,   1.0f, 0.0f, 0.0f},   // top-k
    {1.0f,  5,   1.0f,      0.0f,   1.0f, 0.0f, 0.0f},
    {0.7f,  50,  1.0f,      0.0f,   1.0f, 0.0f, 0.0f},
    {1.0f,  128, 1.0f,      0.0f,   1.0f, 0.0f, 0.0f},
    {1.0f,  129, 1.0f,      0.0f,   1.0f, 0.0f, 0.0f},
    {1.0f,  1000, 1.0f,     0.0f,   1.0f, 0.0f, 0.0f},
    {1.0f,  -1,  1.0f,      0.0f,   1.0f, 0.0f, 0.0f},
    {1.0f,  -2,  1.0f,      0.0f,   1.0f, 0.0f, 0.0f},
    {0.7f,  0,   0.95f,     0.0f,   1.0f, 0.0f, 0.0f},   // top-p
    {1.0f,  0,   0.5f,      0.0f,   1.0f, 0.0f, 0.0f},
    {1.0f,  0,   0.1f,      0.0f,   1.0f, 0.0f, 0.0f},
    {1.0f,  0,   0.999999f, 0.0f,   1.0f, 0.0f, 0.0f},
    {1.0f,  0,   0x1.fffffep-1f, 0.0f, 1.0f, 0.0f, 0.0f},  // the largest top_p below 1
    {1.0f,  0,   1.0f,      0.05f,  1.0f, 0.0f, 0.0f},   // min-p
    {1.0f,  0,   1.0f,      1e-20f, 1.0f, 0.0f, 0.0f},   // its floor below the cut at -38
    {1.0f,  0,   1.0f,      1.0f,   1.0f, 0.0f, 0.0f},
    {0.8f,  40,  0.9f,      0.0f,   1.0f, 0.0f, 0.0f},   // combinations
    {0.8f,  300, 0.9f,      0.02f,  1.0f, 0.0f, 0.0f},
    {1.0f,  0,   0.9f,      0.1f,   1.0f, 0.0f, 0.0f},
    {1.2f,  20,  1.0f,      0.05f,  1.0f, 0.0f, 0.0f},
    {0.7f,  500, 1.0f,      1e-30f, 1.0f, 0.0f, 0.0f},
    {0.7f,  0,   0.9f,      0.0f,   1.3f, 0.4f, 0.2f},   // penalties
    {0.0f,  0,   1.0f,      0.0f,   1.5f, 0.0f, 0.0f},
    {1.0f,  0,   1.0f,      0.0f,   1.1f, 0.0f, -0.5f},
    {3.0f,  64,  0.8f,      0.01f,  1.0f, 1.0f, 0.0f},
};
// clang-format on

enum { N_ORACLE_PARAMS = sizeof oracle_sets / sizeof *oracle_sets };

static SamplerParams oracle_params(int i, int n_vocab)
{
    const OracleParams *o = &oracle_sets[i];
    SamplerParams p = sampler_default_params();
    p.temperature = o->temperature;
    p.top_k = o->top_k == -1 ? n_vocab - 1 : o->top_k == -2 ? n_vocab + 5 : o->top_k;
    p.top_p = o->top_p;
    p.min_p = o->min_p;
    p.repetition_penalty = o->repetition;
    p.presence_penalty = o->presence;
    p.frequency_penalty = o->frequency;
    return p;
}

// sampler_sample in its parts (sampler.h), the weights in n_chunks chunks taken last first,
// as the pipeline's threads may run them.
static int32_t sample_split(Sampler *s, float *logits, int n_chunks)
{
    int32_t token;
    if (sampler_begin(s, logits, &token)) return token;
    for (int c = n_chunks - 1; c >= 0; c--)
        sampler_weights(s, logits, c, n_chunks);
    return sampler_finish(s);
}

// For each parameter set, n_trials rows of n_vocab entries (styles in turn). From each row,
// n_draws draws by the seeded generator (a fresh copy of the row each time, penalties first)
// from the sampler and the oracle side by side; then 3 draws around each of n_bounds
// boundaries between candidates of the oracle's first draw (the generator set so that the
// uniform value is one unit below, at and above the boundary), against the oracle's replay.
// Odd draws go through sample_split (1 to 7 chunks) instead of sampler_sample.
static void oracle_check(int n_vocab, int n_trials, int n_draws, int n_bounds, bool with_nonfinite)
{
    float *row = malloc((size_t) n_vocab * sizeof *row);
    float *la = malloc((size_t) n_vocab * sizeof *la), *lb = malloc((size_t) n_vocab * sizeof *lb);
    float *pen = malloc((size_t) n_vocab * sizeof *pen);
    RefTrace tr = {.ids = malloc((size_t) n_vocab * sizeof *tr.ids),
                   .cum = malloc((size_t) n_vocab * sizeof *tr.cum)};
    int32_t history[48];
    ASSERT(row && la && lb && pen && tr.ids && tr.cum && n_draws >= 1);
    uint64_t r = 0x5eed0000u + (uint64_t) n_vocab;
    for (int pi = 0; pi < N_ORACLE_PARAMS; pi++) {
        int n_bad = 0, n_runs = 0;
        for (int trial = 0; trial < n_trials; trial++) {
            SamplerParams p = oracle_params(pi, n_vocab);
            if (p.top_k < 0) p.top_k = 0;
            p.seed = rnd(&r);
            Sampler a;
            RefSampler b;
            ASSERT(sampler_init(&a, n_vocab, p) == ERR_OK);
            ref_init(&b, n_vocab, p);
            const int style = (trial + pi) % N_STYLES;
            fill_row(row, n_vocab, style, with_nonfinite, &r);
            const int n_hist = (int) (rnd(&r) % 48);
            for (int h = 0; h < n_hist; h++)
                history[h] = h % 11 == 10 ? -1 : (int32_t) (rnd(&r) % (uint64_t) (n_vocab + 2));
            for (int d = 0; d < n_draws + 3 * n_bounds; d++) {
                int32_t ta, tb;
                bool same_logits = true;
                if (d < n_draws) {
                    memcpy(la, row, (size_t) n_vocab * sizeof *la);
                    memcpy(lb, row, (size_t) n_vocab * sizeof *lb);
                    sampler_apply_penalties(&a, la, history, n_hist);
                    ref_apply_penalties(&b, lb, history, n_hist);
                    same_logits = memcmp(la, lb, (size_t) n_vocab * sizeof *la) == 0;
                    if (d == 0) memcpy(pen, la, (size_t) n_vocab * sizeof *pen);
                    ta = d % 2 ? sample_split(&a, la, 1 + d % 7) : sampler_sample(&a, la);
                    tb = ref_sample(&b, lb, d == 0 ? &tr : NULL);
                } else {
                    if (!tr.has_draw) break;
                    const int q = (d - n_draws) / 3, dk = (d - n_draws) % 3 - 1;
                    const int at = q == 0   ? 0
                                   : q == 1 ? tr.n - 1
                                            : (int) (rnd(&r) % (uint64_t) tr.n);
                    double x = tr.cum[at] / tr.total * 0x1.0p53;
                    if (!(x < 0x1.0p53 - 2)) x = 0x1.0p53 - 2;
                    if (x < 1) x = 1;
                    const uint64_t k = (uint64_t) x + (uint64_t) (int64_t) dk;
                    a.rng = b.rng = rng_state_for(k);
                    memcpy(la, pen, (size_t) n_vocab * sizeof *la);
                    ta = d % 2 ? sample_split(&a, la, 1 + d % 7) : sampler_sample(&a, la);
                    tb = ref_replay(&tr, ref_uniform(&b));
                }
                n_runs++;
                if (ta != tb || a.rng != b.rng || !same_logits) {
                    if (n_bad++ == 0)
                        fprintf(stderr,
                                "oracle: vocabulary %d, params %d, style %d, draw %d: token %d, "
                                "oracle %d%s%s\n",
                                n_vocab, pi, style, d, ta, tb,
                                a.rng != b.rng ? ", generator differs" : "",
                                same_logits ? "" : ", penalised logits differ");
                }
            }
            sampler_free(&a);
            ref_free(&b);
        }
        CHECK(n_runs > 0 && n_bad == 0);
    }
    free(row);
    free(la);
    free(lb);
    free(pen);
    free(tr.ids);
    free(tr.cum);
}

static void test_oracle(void)
{
    // The generator can be put anywhere (what the boundary draws rely on).
    const uint64_t ks[] = {1, 2, 12345, (1ull << 52) + 7, (1ull << 53) - 1};
    for (size_t i = 0; i < sizeof ks / sizeof *ks; i++) {
        Sampler s = {.rng = rng_state_for(ks[i])};
        CHECK(sampler_uniform(&s) == (double) ks[i] * 0x1.0p-53);
    }
    const int sizes[] = {1, 2, 3, 7, 16, 100, 1000, 4099};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++)
        oracle_check(sizes[k], 3 * N_STYLES, 3, 6, false);
    // NaN and infinities: no shortcut applies, the answer must still be the oracle's.
    oracle_check(16, N_STYLES, 2, 3, true);
    oracle_check(1000, N_STYLES, 2, 3, true);
    // A real vocabulary: every parameter set over 3 rows (each set starts at another style).
    oracle_check(154880, 3, 2, 4, false);
}

int main(void)
{
    test_greedy();
    test_greedy_lanes();
    test_determinism();
    test_distribution();
    test_masks();
    test_penalties();
    test_oracle();
    return check_exit();
}
