/*
 * clock.h - monotonic time, for timing phases, deadlines, heartbeats and rates.
 *
 * Header-only. Threads: any. Errors: none (CLOCK_MONOTONIC always exists on Linux).
 */
#ifndef ENGINE_SHARED_CLOCK_H
#define ENGINE_SHARED_CLOCK_H

#include <time.h>

// Seconds on CLOCK_MONOTONIC, from an arbitrary origin.
static inline double clock_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + (double) ts.tv_nsec * 1e-9;
}

#endif  // ENGINE_SHARED_CLOCK_H
