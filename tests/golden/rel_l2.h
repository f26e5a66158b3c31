/*
 * rel_l2.h - the relative L2 error ||got - want|| / ||want|| in double, the measure every
 * logits and backend comparison uses (tests/golden/golden_data.h, tests/gpu/backend_ops.c).
 *
 * Ownership: none. Threads: pure. Errors: none; an all-zero want divides by 1.
 */
#ifndef TESTS_GOLDEN_REL_L2_H
#define TESTS_GOLDEN_REL_L2_H

#include <math.h>
#include <stddef.h>

static inline double golden_rel_l2(const float *got, const float *want, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double) got[i] - want[i];
        num += d * d;
        den += (double) want[i] * want[i];
    }
    return sqrt(num / (den > 0.0 ? den : 1.0));
}

#endif  // TESTS_GOLDEN_REL_L2_H
