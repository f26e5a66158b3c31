/*
 * test_router.c - the CPU backend's MoE routing (kernels/moe_router.h, which the CUDA backend
 * and the kernels' reference run too) against a brute-force reference of
 * transformers' GlmMoeDsaTopkRouter: sigmoid scores; the correction bias only for choosing;
 * group score = sum of the two best biased scores of the group; keep topk_group groups;
 * top-k experts among them; weights from the unbiased sigmoid, renormalised (+1e-20) when
 * norm_topk_prob, times routed_scaling_factor.
 *
 * The reference chooses by enumerating ranks (count how many beat each candidate), a
 * different algorithm from the backend's repeated argmax. Random logits are continuous, so
 * ties have probability zero. Weights: both sides compute in double and round once to
 * float, so they agree to 2 fp32 ulps.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/backend.h"
#include "engine/shared/err.h"
#include "tests/check.h"

enum { MAX_E = 64 };

static double frand(void)
{
    return 2.0 * rand() / RAND_MAX - 1.0;
}

// Experts chosen for one token (chosen[e] = 1) and their weights, by ranks.
static void route_ref(const float *logit, const float *bias, const BackendRoute *p, int *chosen,
                      double *weight)
{
    const int E = p->n_experts, G = p->n_group, per = E / G;
    double s[MAX_E], c[MAX_E], gs[MAX_E];
    for (int e = 0; e < E; e++) {
        s[e] = 1.0 / (1.0 + exp(-(double) logit[e]));
        c[e] = s[e] + bias[e];
    }
    for (int g = 0; g < G; g++) {
        // the two largest of the group: rank 0 and rank 1
        double top[2] = {0, 0};
        for (int e = g * per; e < (g + 1) * per; e++) {
            int rank = 0;
            for (int o = g * per; o < (g + 1) * per; o++)
                rank += c[o] > c[e] || (c[o] == c[e] && o < e);
            if (rank < 2) top[rank] = c[e];
        }
        gs[g] = top[0] + (per > 1 ? top[1] : 0.0);
    }
    double sum = 0.0;
    for (int e = 0; e < E; e++) {
        const int g = e / per;
        int group_rank = 0;
        for (int o = 0; o < G; o++)
            group_rank += gs[o] > gs[g] || (gs[o] == gs[g] && o < g);
        chosen[e] = 0;
        if (group_rank >= p->topk_group) continue;
        int rank = 0;
        for (int o = 0; o < E; o++) {
            int o_rank = 0;
            for (int q = 0; q < G; q++)
                o_rank += gs[q] > gs[o / per] || (gs[q] == gs[o / per] && q < o / per);
            if (o_rank < p->topk_group) rank += c[o] > c[e] || (c[o] == c[e] && o < e);
        }
        chosen[e] = rank < p->top_k;
        if (chosen[e]) sum += s[e];
    }
    for (int e = 0; e < E; e++)
        weight[e] =
            chosen[e] ? (p->norm_topk_prob ? s[e] / (sum + 1e-20) : s[e]) * p->routed_scaling_factor
                      : 0.0;
}

static void test_config(Backend *be, BackendRoute p, int n, double bias_scale)
{
    const int E = p.n_experts, K = p.top_k;
    float *logits = malloc((size_t) n * E * sizeof *logits);
    float bias[MAX_E];
    int *idx = malloc((size_t) n * K * sizeof *idx);
    float *wts = malloc((size_t) n * K * sizeof *wts);
    ASSERT(logits && idx && wts);
    for (int i = 0; i < n * E; i++)
        logits[i] = (float) (3.0 * frand());
    for (int e = 0; e < E; e++)
        bias[e] = (float) (bias_scale * frand());

    be->route(be, idx, wts, logits, bias, n, &p);

    for (int t = 0; t < n; t++) {
        int chosen[MAX_E];
        double weight[MAX_E];
        route_ref(logits + (size_t) t * E, bias, &p, chosen, weight);
        int n_chosen = 0;
        for (int e = 0; e < E; e++)
            n_chosen += chosen[e];
        CHECK(n_chosen == K);
        for (int k = 0; k < K; k++) {
            const int e = idx[(size_t) t * K + k];
            CHECK(e >= 0 && e < E && chosen[e]);
            if (k > 0) CHECK(e > idx[(size_t) t * K + k - 1]);  // ascending, distinct
            if (e >= 0 && e < E)
                CHECK_NEAR(wts[(size_t) t * K + k], weight[e], 2.0 * FLT_EPSILON * weight[e]);
        }
    }
    free(logits);
    free(idx);
    free(wts);
}

// A hand-made case: the bias flips the choice, and the weight still comes from the sigmoid.
static void test_bias_only_chooses(Backend *be)
{
    const BackendRoute p = {.n_experts = 4,
                            .top_k = 1,
                            .n_group = 1,
                            .topk_group = 1,
                            .norm_topk_prob = false,
                            .routed_scaling_factor = 2.5f};
    const float logits[4] = {2.0f, 0.0f, -1.0f, 1.0f};
    const float bias[4] = {0.0f, 0.0f, 0.9f, 0.0f};  // sigmoid(-1) + 0.9 = 1.169 > 0.881
    int idx;
    float w;
    be->route(be, &idx, &w, logits, bias, 1, &p);
    CHECK(idx == 2);
    CHECK_NEAR(w, 2.5 / (1.0 + exp(1.0)), 1e-6);
}

// Group limit: the best single expert lives in a group whose top-2 sum loses.
static void test_group_limit(Backend *be)
{
    const BackendRoute p = {.n_experts = 4,
                            .top_k = 1,
                            .n_group = 2,
                            .topk_group = 1,
                            .norm_topk_prob = true,
                            .routed_scaling_factor = 1.0f};
    const float logits[4] = {5.0f, -5.0f, 3.0f, 3.0f};  // group 0: 0.993+0.007; group 1: 2 * 0.953
    const float bias[4] = {0};
    int idx;
    float w;
    be->route(be, &idx, &w, logits, bias, 1, &p);
    CHECK(idx == 2);
    CHECK_NEAR(w, 1.0, 1e-6);  // renormalised over one expert
}

int main(void)
{
    srand(3);
    Backend *be = NULL;
    ASSERT(backend_cpu_create(1, &be) == ERR_OK);
    test_bias_only_chooses(be);
    test_group_limit(be);
    test_config(be, (BackendRoute){8, 2, 1, 1, true, 2.5f}, 50, 0.1);
    test_config(be, (BackendRoute){8, 3, 4, 2, true, 2.5f}, 50, 0.3);    // groups
    test_config(be, (BackendRoute){7, 3, 1, 1, true, 1.0f}, 50, 0.2);    // odd count (REAP)
    test_config(be, (BackendRoute){13, 3, 1, 1, false, 2.5f}, 50, 0.2);  // no renorm
    test_config(be, (BackendRoute){32, 4, 8, 3, true, 2.5f}, 50, 0.5);
    test_config(be, (BackendRoute){6, 2, 6, 2, true, 1.5f}, 50, 0.5);  // one expert a group
    be->destroy(be);
    return check_exit();
}
