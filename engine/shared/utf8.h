/*
 * utf8.h - the few UTF-8 primitives the tokenizer needs, with Rust's exact semantics.
 *
 * HF tokenizers is Rust: invalid input becomes U+FFFD through String::from_utf8_lossy, which
 * replaces each "maximal subpart of an ill-formed subsequence" (Unicode 15, §3.9, U+FFFD
 * substitution of maximal subparts) by one U+FFFD. Python's errors="replace" follows the same
 * rule, so goldens made from Python strings and our C bytes agree.
 *
 * Ownership: nothing is allocated except by utf8_lossy(), whose result the caller frees.
 * Threads:   pure functions; any thread.
 * Errors:    ERR_NOMEM from utf8_lossy only.
 */
#ifndef ENGINE_SHARED_UTF8_H
#define ENGINE_SHARED_UTF8_H

#include <stddef.h>
#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

// Length of the well-formed character starting at s[0] (1..4), or 0 when s[0..n) does not
// start with one. n must be > 0.
size_t utf8_char_len(const uint8_t *s, size_t n);

// Length of the longest prefix of s[0..n) that is well-formed UTF-8.
size_t utf8_valid_prefix(const uint8_t *s, size_t n);

// Number of trailing bytes of s[0..n) that form an incomplete but so far well-formed
// character (a proper prefix of some valid sequence): 0..3. Appending bytes could still
// complete them.
size_t utf8_incomplete_tail(const uint8_t *s, size_t n);

// Write s[0..n) to a new malloc'd NUL-terminated buffer with every maximal ill-formed
// subpart replaced by U+FFFD (EF BF BD). *out_n receives the length without the NUL.
Err utf8_lossy(const uint8_t *s, size_t n, char **out, size_t *out_n);

// Same, appending to dst, which must have room for 3 * n bytes (the worst case).
// Returns the number of bytes written.
size_t utf8_lossy_into(const uint8_t *s, size_t n, char *dst);

// Decode the character at s[0] (well-formed, len bytes) to a code point.
uint32_t utf8_decode(const uint8_t *s, size_t len);

// Encode code point cp (<= 0x10FFFF, not a surrogate) into dst[0..4); returns its length.
size_t utf8_encode(uint32_t cp, char *dst);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_UTF8_H
