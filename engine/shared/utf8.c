/*
 * utf8.c - UTF-8 validation, lossy repair and code point conversion (see utf8.h).
 *
 * Well-formedness follows Unicode table 3-7: the second byte's range depends on the first
 * (E0 A0..BF, ED 80..9F, F0 90..BF, F4 80..8F), which is also what defines a "maximal
 * subpart": the longest prefix of a would-be character whose bytes are each still allowed.
 */
#include "engine/shared/utf8.h"

#include <stdlib.h>
#include <string.h>

// Allowed range of the second byte after lead byte b, or lo > hi when b is no lead byte.
static void second_range(uint8_t b, uint8_t *lo, uint8_t *hi, size_t *len)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
        *len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
        *len = 3;
        if (b == 0xE0) *lo = 0xA0;
        if (b == 0xED) *hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        *len = 4;
        if (b == 0xF0) *lo = 0x90;
        if (b == 0xF4) *hi = 0x8F;
    } else {
        *len = 0;
        *lo = 1;
        *hi = 0;
    }
}

// Length of the maximal subpart at s[0] (>= 1) when it is ill-formed, 0 when s starts with a
// whole well-formed character; *ok_len receives that character's length.
static size_t subpart(const uint8_t *s, size_t n, size_t *ok_len)
{
    *ok_len = 0;
    if (s[0] < 0x80) {
        *ok_len = 1;
        return 0;
    }
    uint8_t lo, hi;
    size_t len;
    second_range(s[0], &lo, &hi, &len);
    if (len == 0) return 1;
    size_t i = 1;
    for (; i < len && i < n; i++) {
        const uint8_t a = i == 1 ? lo : 0x80, z = i == 1 ? hi : 0xBF;
        if (s[i] < a || s[i] > z) return i;
    }
    if (i < len) return i;  // truncated at the end of the input
    *ok_len = len;
    return 0;
}

size_t utf8_char_len(const uint8_t *s, size_t n)
{
    size_t ok;
    subpart(s, n, &ok);
    return ok;
}

size_t utf8_valid_prefix(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t ok;
        if (subpart(s + i, n - i, &ok)) break;
        i += ok;
    }
    return i;
}

size_t utf8_incomplete_tail(const uint8_t *s, size_t n)
{
    // A proper prefix is at most 3 bytes; find the last lead byte within them.
    for (size_t k = 1; k <= 3 && k <= n; k++) {
        const uint8_t *p = s + n - k;
        if (p[0] >= 0x80 && p[0] < 0xC0) continue;
        uint8_t lo, hi;
        size_t len;
        second_range(p[0], &lo, &hi, &len);
        if (len <= k) return 0;  // ASCII, not a lead byte, or already complete
        size_t ok;
        return subpart(p, k, &ok) == k ? k : 0;
    }
    return 0;
}

size_t utf8_lossy_into(const uint8_t *s, size_t n, char *dst)
{
    size_t i = 0, w = 0;
    while (i < n) {
        // Copy the longest valid run at once; ASCII dominates real text.
        const size_t run = utf8_valid_prefix(s + i, n - i);
        memcpy(dst + w, s + i, run);
        w += run;
        i += run;
        if (i >= n) break;
        size_t ok;
        const size_t bad = subpart(s + i, n - i, &ok);
        memcpy(dst + w, "\xEF\xBF\xBD", 3);
        w += 3;
        i += bad;
    }
    return w;
}

Err utf8_lossy(const uint8_t *s, size_t n, char **out, size_t *out_n)
{
    char *buf = malloc(3 * n + 1);
    if (!buf) return ERR_NOMEM;
    const size_t w = utf8_lossy_into(s, n, buf);
    buf[w] = '\0';
    *out = buf;
    *out_n = w;
    return ERR_OK;
}

uint32_t utf8_decode(const uint8_t *s, size_t len)
{
    switch (len) {
    case 1:
        return s[0];
    case 2:
        return ((uint32_t) (s[0] & 0x1F) << 6) | (s[1] & 0x3F);
    case 3:
        return ((uint32_t) (s[0] & 0x0F) << 12) | ((uint32_t) (s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    default:
        return ((uint32_t) (s[0] & 0x07) << 18) | ((uint32_t) (s[1] & 0x3F) << 12)
               | ((uint32_t) (s[2] & 0x3F) << 6) | (s[3] & 0x3F);
    }
}

size_t utf8_encode(uint32_t cp, char *dst)
{
    uint8_t *d = (uint8_t *) dst;
    if (cp < 0x80) {
        d[0] = (uint8_t) cp;
        return 1;
    }
    if (cp < 0x800) {
        d[0] = (uint8_t) (0xC0 | (cp >> 6));
        d[1] = (uint8_t) (0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        d[0] = (uint8_t) (0xE0 | (cp >> 12));
        d[1] = (uint8_t) (0x80 | ((cp >> 6) & 0x3F));
        d[2] = (uint8_t) (0x80 | (cp & 0x3F));
        return 3;
    }
    d[0] = (uint8_t) (0xF0 | (cp >> 18));
    d[1] = (uint8_t) (0x80 | ((cp >> 12) & 0x3F));
    d[2] = (uint8_t) (0x80 | ((cp >> 6) & 0x3F));
    d[3] = (uint8_t) (0x80 | (cp & 0x3F));
    return 4;
}
