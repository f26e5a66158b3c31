/*
 * check.h - the whole test framework: CHECK, CHECK_NEAR, check_exit().
 *
 * A failed check prints file:line and the values, counts a failure, and the test goes on
 * so that one run shows every failure. check_exit() returns the process exit status and
 * prints "N passed, N failed".
 */
#ifndef TESTS_CHECK_H
#define TESTS_CHECK_H

#include <math.h>
#include <stdio.h>

static int check_failures;
static int check_passes;

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (cond) {                                                            \
            check_passes++;                                                    \
        } else {                                                               \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            check_failures++;                                                  \
        }                                                                      \
    } while (0)

#define CHECK_NEAR(got, want, tol)                                                                \
    do {                                                                                          \
        const double got_ = (got), want_ = (want), tol_ = (tol);                                  \
        if (fabs(got_ - want_) <= tol_) {                                                         \
            check_passes++;                                                                       \
        } else {                                                                                  \
            fprintf(stderr, "%s:%d: %s = %.9g, want %.9g (tolerance %.3g)\n", __FILE__, __LINE__, \
                    #got, got_, want_, tol_);                                                     \
            check_failures++;                                                                     \
        }                                                                                         \
    } while (0)

static inline int check_exit(void)
{
    printf("%d passed, %d failed\n", check_passes, check_failures);
    return check_failures ? 1 : 0;
}

#endif  // TESTS_CHECK_H
