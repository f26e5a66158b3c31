/*
 * num.h - decimal integers from option values and recipe fields: the whole string, in range.
 *
 * Header-only. Threads: any. Errors: false on an empty or partial number, overflow, or a value
 * outside [lo, hi]; *out is then unchanged.
 */
#ifndef ENGINE_SHARED_NUM_H
#define ENGINE_SHARED_NUM_H

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>

// A decimal long in [lo, hi] spanning all of s (strtol's leading white space allowed).
static inline bool num_parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    const long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

// The same for an int.
static inline bool num_parse_int(const char *s, int lo, int hi, int *out)
{
    long v;
    if (!num_parse_long(s, lo, hi, &v)) return false;
    *out = (int) v;
    return true;
}

#endif  // ENGINE_SHARED_NUM_H
