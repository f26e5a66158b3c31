/*
 * topk.h - the k best of a stream of (key, id) entries by a k-element min-heap, written once
 * for the sampler's top-k (model/sampler.c) and the CPU backend's DSA top-k
 * (backend/backend_cpu.c).
 *
 * The heap keeps the worst kept entry on top, so each new entry costs one comparison unless
 * it beats that one: O(n log k) for n entries, and no allocation (qsort may allocate; the
 * decode loop must not). Ranking is by key, descending; equal keys are ordered by id, and
 * the caller says which id wins: the sampler ranks the lower token id first (greedy's
 * rule), DSA the later position (its tie rule, see engine/model/README.md).
 *
 * Ownership: none; arrays borrowed for the call. Threads: pure. Errors: none.
 */
#ifndef ENGINE_MODEL_TOPK_H
#define ENGINE_MODEL_TOPK_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct TopkEntry {
    double key;  // larger is better
    int32_t id;
} TopkEntry;

// Which of two entries with equal keys ranks first.
typedef enum TopkTie {
    TOPK_TIE_LOWER_ID,   // the lower id wins
    TOPK_TIE_HIGHER_ID,  // the higher id wins
} TopkTie;

// True when a ranks below b: a lower key, or the same key and the id that loses the tie.
static inline bool topk_ranks_below(TopkEntry a, TopkEntry b, TopkTie tie)
{
    if (a.key != b.key) return a.key < b.key;
    return tie == TOPK_TIE_HIGHER_ID ? a.id < b.id : a.id > b.id;
}

// Restores the min-heap (the lowest-ranked entry on top) below node i of h[0..n).
static inline void topk_sift_down(TopkEntry *h, int n, int i, TopkTie tie)
{
    for (;;) {
        const int l = 2 * i + 1, r = l + 1;
        int m = i;
        if (l < n && topk_ranks_below(h[l], h[m], tie)) m = l;
        if (r < n && topk_ranks_below(h[r], h[m], tie)) m = r;
        if (m == i) return;
        const TopkEntry t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

// Offers e to the heap h of *n entries that keeps the best k (k >= 1): the first k entries
// fill it (heapified when full), later ones replace its top when they rank above it.
// h[*n] may be e itself (selection in place).
static inline void topk_offer(TopkEntry *h, int *n, int k, TopkEntry e, TopkTie tie)
{
    if (*n < k) {
        h[(*n)++] = e;
        if (*n == k)
            for (int i = k / 2 - 1; i >= 0; i--)
                topk_sift_down(h, k, i, tie);
    } else if (topk_ranks_below(h[0], e, tie)) {
        h[0] = e;
        topk_sift_down(h, k, 0, tie);
    }
}

// Sorts the full heap h[0..n) best first (heapsort: the worst popped to the back).
static inline void topk_sort(TopkEntry *h, int n, TopkTie tie)
{
    for (int end = n - 1; end > 0; end--) {
        const TopkEntry t = h[0];
        h[0] = h[end];
        h[end] = t;
        topk_sift_down(h, end, 0, tie);
    }
}

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_MODEL_TOPK_H
