/*
 * test_sampler.c - sampler.c: greedy, determinism under a seed, the top-k / top-p / min-p
 * masks, penalties, and the drawn distribution against the softmax.
 *
 * Distribution check: with N draws the count of a token with probability p is binomial,
 * standard deviation sqrt(N p (1 - p)); we allow 6 of them. The seed is fixed, so the test
 * is deterministic; the bound only says that a correct sampler passes with any seed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/sampler.h"
#include "tests/check.h"

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
}

int main(void)
{
    test_greedy();
    test_greedy_lanes();
    test_determinism();
    test_distribution();
    test_masks();
    test_penalties();
    return check_exit();
}
