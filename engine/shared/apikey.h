/*
 * apikey.h - API keys: generation, parsing, hashing, constant-time verification.
 *
 * A key looks like "gsk_<12 base62>_<32 base62>". The first part, "gsk_<12 base62>", is the
 * key's public prefix: unique, stored in clear, shown by `glmspark keys list` and used to
 * find the key's row. The whole key has about 262 random bits from OpenSSL's RAND_bytes;
 * only its SHA-256 is stored. Because keys are random, a fast hash is enough (no password
 * stretching) and the stored digest is compared with CRYPTO_memcmp, in constant time.
 * Keys are never logged: callers log the prefix.
 *
 * Ownership: callers provide all buffers.
 * Threads:   every function may be called from any thread.
 * Errors:    apikey_generate returns ERR_IO when the random generator fails; parsing
 *            returns ERR_FORMAT for anything that is not a well-formed key.
 */
#ifndef ENGINE_SHARED_APIKEY_H
#define ENGINE_SHARED_APIKEY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define APIKEY_PREFIX_TAG "gsk_"
#define APIKEY_N_ID 12       // base62 characters of the public id
#define APIKEY_N_SECRET 32   // base62 characters of the secret part
#define APIKEY_PREFIX_LEN (4 + APIKEY_N_ID)                      // "gsk_" + id
#define APIKEY_LEN (APIKEY_PREFIX_LEN + 1 + APIKEY_N_SECRET)     // + "_" + secret
#define APIKEY_HASH_LEN 32

// Write a fresh key (NUL-terminated, APIKEY_LEN chars) into key[APIKEY_LEN + 1].
Err apikey_generate(char key[APIKEY_LEN + 1]);

// Check that key[0..n) is a well-formed key and copy its public prefix into
// prefix[APIKEY_PREFIX_LEN + 1]. ERR_FORMAT otherwise (nothing is logged).
Err apikey_parse(const char *key, size_t n, char prefix[APIKEY_PREFIX_LEN + 1]);

// SHA-256 of key[0..n).
void apikey_hash(const char *key, size_t n, uint8_t digest[APIKEY_HASH_LEN]);

// True when SHA-256(key[0..n)) equals stored, compared in constant time.
bool apikey_verify(const char *key, size_t n, const uint8_t stored[APIKEY_HASH_LEN]);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_APIKEY_H
