/*
 * apikey.c - API key generation and verification (see apikey.h for the format).
 *
 * Base62 characters are drawn from random bytes by rejection: bytes >= 248 (= 4 * 62) are
 * discarded so that every character is uniform. 44 characters of base62 give
 * 44 * log2(62) = 262 bits.
 */
#include "engine/shared/apikey.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <string.h>

static const char base62[] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

static bool is_base62(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
}

// Fill out[0..n) with uniform base62 characters.
static Err fill_base62(char *out, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned char buf[64];
        if (RAND_bytes(buf, (int) sizeof buf) != 1) {
            LOG_ERROR("could not generate an api key: RAND_bytes failed");
            return ERR_IO;
        }
        for (size_t j = 0; j < sizeof buf && i < n; j++)
            if (buf[j] < 248) out[i++] = base62[buf[j] % 62];
    }
    return ERR_OK;
}

Err apikey_generate(char key[APIKEY_LEN + 1])
{
    char tmp[APIKEY_LEN + 1];
    memcpy(tmp, APIKEY_PREFIX_TAG, 4);
    Err err = fill_base62(tmp + 4, APIKEY_N_ID);
    if (!err) {
        tmp[APIKEY_PREFIX_LEN] = '_';
        err = fill_base62(tmp + APIKEY_PREFIX_LEN + 1, APIKEY_N_SECRET);
    }
    if (!err) {
        tmp[APIKEY_LEN] = '\0';
        memcpy(key, tmp, sizeof tmp);
    }
    OPENSSL_cleanse(tmp, sizeof tmp);
    return err;
}

Err apikey_parse(const char *key, size_t n, char prefix[APIKEY_PREFIX_LEN + 1])
{
    if (!key || n != APIKEY_LEN || memcmp(key, APIKEY_PREFIX_TAG, 4) != 0 ||
        key[APIKEY_PREFIX_LEN] != '_')
        return ERR_FORMAT;
    for (size_t i = 4; i < n; i++)
        if (i != APIKEY_PREFIX_LEN && !is_base62(key[i])) return ERR_FORMAT;
    memcpy(prefix, key, APIKEY_PREFIX_LEN);
    prefix[APIKEY_PREFIX_LEN] = '\0';
    return ERR_OK;
}

void apikey_hash(const char *key, size_t n, uint8_t digest[APIKEY_HASH_LEN])
{
    SHA256((const unsigned char *) key, n, digest);
}

bool apikey_verify(const char *key, size_t n, const uint8_t stored[APIKEY_HASH_LEN])
{
    uint8_t digest[APIKEY_HASH_LEN];
    apikey_hash(key, n, digest);
    return CRYPTO_memcmp(digest, stored, APIKEY_HASH_LEN) == 0;
}
