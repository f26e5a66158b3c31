/*
 * check.h - the whole test framework: CHECK, CHECK_NEAR, check_exit().
 *
 * A failed check prints file:line and the values, counts a failure, and the test goes on
 * so that one run shows every failure. check_skip() records a part of the test that could
 * not run (a missing optional input), with the reason. check_exit() prints "N passed, N
 * failed[, N skipped]" and returns the process exit status: 1 on any failure, else
 * CHECK_SKIPPED (77, every test's SKIP_RETURN_CODE: ctest counts it as skipped, never as
 * passed) if anything was skipped, else 0.
 */
#ifndef TESTS_CHECK_H
#define TESTS_CHECK_H

#include <math.h>
#include <stdio.h>

static int check_failures;
static int check_passes;
static int check_skips;

enum { CHECK_SKIPPED = 77 };

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

// Record that part of the test did not run, and why (printed).
static inline void check_skip(const char *why)
{
    printf("SKIPPED: %s\n", why);
    check_skips++;
}

static inline int check_exit(void)
{
    if (check_skips) {
        printf("%d passed, %d failed, %d skipped\n", check_passes, check_failures, check_skips);
        return check_failures ? 1 : CHECK_SKIPPED;
    }
    printf("%d passed, %d failed\n", check_passes, check_failures);
    return check_failures ? 1 : 0;
}

#endif  // TESTS_CHECK_H
