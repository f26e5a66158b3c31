/*
 * moe_router.h - the MoE router of one token (GlmMoeDsaTopkRouter), written once in plain C.
 *
 * transformers 5.17 models/glm_moe_dsa/modeling_glm_moe_dsa.py (route_tokens_to_experts), in
 * double, E experts, K chosen, G groups of E / G:
 *
 *   s[e]      = sigmoid(logits[e])
 *   choice[e] = s[e] + bias[e]                 (the correction bias only chooses)
 *   group g   = the sum of its two best choices (its one choice when a group has one expert);
 *               the topk_group best groups stay, the others' choices become -inf
 *   idx       = the K largest choices, by repeated argmax, ties to the lower index
 *   w         = s[idx] / (sum of the K s[idx] + 1e-20) * scale   (s[idx] * scale without
 *               norm_topk_prob); the sum runs over the chosen experts in ascending order
 *
 * The exact numbers every router gives: the CPU backend (engine/backend/backend_cpu.c) and
 * the kernels' reference (kernels/ref/moe_ref.c) call it; kernels/moe.cu's warp-per-token
 * router, which the CUDA backend runs, is this arithmetic with the argmax scans split over
 * the lanes, so the two backends choose alike bit for bit (tests/gpu/test_moe.c checks it
 * equal). tests/engine/backend/test_router.c checks this against a brute-force enumeration of
 * ranks.
 *
 * Ownership: none; every pointer borrowed for the call. Threads: pure. Errors: none; the
 * callers assert the shapes (K <= E, E % G == 0, 1 <= topk_group <= G).
 */
#ifndef KERNELS_MOE_ROUTER_H
#define KERNELS_MOE_ROUTER_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define MOE_ROUTER_FN static inline __host__ __device__
#else
#define MOE_ROUTER_FN static inline
#endif

// Bytes of the work buffer moe_router_token() needs for E experts in G groups: doubles
// [3 E + G], then flags [max(E, G)]. The buffer must be aligned for double.
MOE_ROUTER_FN size_t moe_router_work_bytes(int n_experts, int n_group)
{
    return ((size_t) 3 * n_experts + n_group) * sizeof(double)
           + (size_t) (n_experts > n_group ? n_experts : n_group);
}

// Index of the largest v[i] among i < n not yet taken, ties to the lowest index; -1 if none.
MOE_ROUTER_FN int moe_router_argmax(const double *v, const unsigned char *taken, int n)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

// Routes one token: logits fp32 [E], bias fp32 [E] or NULL. Writes idx [K] (ascending expert
// ids when is_ascending, else in the order chosen: descending choice, ties to the lower
// index) and w [K], the weight of each idx; choice (or NULL) gets the biased scores with
// -inf outside the kept groups [E]. work: moe_router_work_bytes(E, G) bytes. Returns the
// number of experts chosen (K whenever K <= E).
MOE_ROUTER_FN int moe_router_token(int32_t *idx, float *w, double *choice, const float *logits,
                                   const float *bias, int n_experts, int top_k, int n_group,
                                   int topk_group, bool norm_topk_prob, float scale,
                                   bool is_ascending, void *work)
{
    const int E = n_experts, K = top_k, G = n_group, per_group = E / G;
    double *score = (double *) work;  // sigmoid(logit) [E]
    double *biased = score + E;       // score + bias [E]
    double *group = biased + E;       // [G]
    double *masked = group + G;       // biased, -inf outside kept groups [E]
    unsigned char *taken = (unsigned char *) (masked + E);  // [max(E, G)]

    for (int e = 0; e < E; e++) {
        score[e] = 1.0 / (1.0 + exp(-(double) logits[e]));
        biased[e] = score[e] + (bias ? bias[e] : 0.0f);
    }
    for (int g = 0; g < G; g++) {
        const double *bg = biased + (size_t) g * per_group;
        for (int i = 0; i < per_group; i++)
            taken[i] = 0;
        const int a = moe_router_argmax(bg, taken, per_group);
        taken[a] = 1;
        const int b = moe_router_argmax(bg, taken, per_group);
        group[g] = bg[a] + (b >= 0 ? bg[b] : 0.0);
    }
    for (int g = 0; g < G; g++)
        taken[g] = 0;
    for (int r = 0; r < topk_group; r++)
        taken[moe_router_argmax(group, taken, G)] = 1;
    for (int e = 0; e < E; e++)
        masked[e] = taken[e / per_group] ? biased[e] : -INFINITY;
    if (choice)
        for (int e = 0; e < E; e++)
            choice[e] = masked[e];

    for (int e = 0; e < E; e++)
        taken[e] = 0;
    for (int r = 0; r < K; r++) {
        const int e = moe_router_argmax(masked, taken, E);
        if (e < 0) break;
        taken[e] = 1;
        if (!is_ascending) idx[r] = e;
    }
    int n_chosen = 0;
    double sum = 0.0;
    for (int e = 0; e < E; e++)
        if (taken[e]) {
            if (is_ascending) idx[n_chosen] = e;
            n_chosen++;
            sum += score[e];
        }
    for (int r = 0; r < n_chosen; r++) {
        double v = score[idx[r]];
        if (norm_topk_prob) v /= sum + 1e-20;
        w[r] = (float) (v * scale);
    }
    return n_chosen;
}

#endif  // KERNELS_MOE_ROUTER_H
