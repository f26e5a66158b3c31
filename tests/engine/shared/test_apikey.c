/*
 * test_apikey.c - API key format, parsing and verification.
 *
 * Checks the generated format (prefix tag, lengths, base62 alphabet), that keys differ,
 * that parsing accepts exactly well-formed keys, that the stored digest is SHA-256 (FIPS
 * 180-2 test vector "abc"), and that verification rejects every single-character change.
 */
#include <string.h>

#include "engine/shared/apikey.h"
#include "tests/check.h"

int main(void)
{
    char a[APIKEY_LEN + 1], b[APIKEY_LEN + 1], prefix[APIKEY_PREFIX_LEN + 1];
    CHECK(apikey_generate(a) == ERR_OK);
    CHECK(apikey_generate(b) == ERR_OK);
    CHECK(strlen(a) == APIKEY_LEN && strlen(a) == 49);
    CHECK(strncmp(a, "gsk_", 4) == 0 && a[APIKEY_PREFIX_LEN] == '_');
    CHECK(strcmp(a, b) != 0);
    CHECK(strncmp(a, b, APIKEY_PREFIX_LEN) != 0);  // public ids differ too
    CHECK(apikey_parse(a, strlen(a), prefix) == ERR_OK);
    CHECK(strlen(prefix) == APIKEY_PREFIX_LEN && strncmp(prefix, a, APIKEY_PREFIX_LEN) == 0);

    // Malformed keys.
    char bad[APIKEY_LEN + 2];
    CHECK(apikey_parse(a, strlen(a) - 1, prefix) == ERR_FORMAT);
    CHECK(apikey_parse("", 0, prefix) == ERR_FORMAT);
    CHECK(apikey_parse(NULL, 0, prefix) == ERR_FORMAT);
    memcpy(bad, a, sizeof a);
    bad[0] = 'G';
    CHECK(apikey_parse(bad, APIKEY_LEN, prefix) == ERR_FORMAT);
    memcpy(bad, a, sizeof a);
    bad[APIKEY_PREFIX_LEN] = '-';
    CHECK(apikey_parse(bad, APIKEY_LEN, prefix) == ERR_FORMAT);
    memcpy(bad, a, sizeof a);
    bad[20] = '%';
    CHECK(apikey_parse(bad, APIKEY_LEN, prefix) == ERR_FORMAT);
    memcpy(bad, a, sizeof a);
    bad[30] = '\0';
    CHECK(apikey_parse(bad, APIKEY_LEN, prefix) == ERR_FORMAT);

    // SHA-256("abc"), FIPS 180-2 appendix B.1.
    static const uint8_t abc[APIKEY_HASH_LEN] = {
        0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40, 0xde, 0x5d, 0xae, 0x22, 0x23,
        0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad};
    uint8_t d[APIKEY_HASH_LEN];
    apikey_hash("abc", 3, d);
    CHECK(memcmp(d, abc, sizeof d) == 0);
    CHECK(apikey_verify("abc", 3, abc));

    // Verification: the key verifies; every one-character change does not.
    apikey_hash(a, APIKEY_LEN, d);
    CHECK(apikey_verify(a, APIKEY_LEN, d));
    int n_rejected = 0;
    for (int i = 0; i < APIKEY_LEN; i++) {
        memcpy(bad, a, sizeof a);
        bad[i] = bad[i] == 'x' ? 'y' : 'x';
        n_rejected += !apikey_verify(bad, APIKEY_LEN, d);
    }
    CHECK(n_rejected == APIKEY_LEN);
    CHECK(!apikey_verify(b, APIKEY_LEN, d));

    // Base62 only, and roughly uniform: over 200 keys every character class shows up.
    int n_digit = 0, n_upper = 0, n_lower = 0;
    for (int k = 0; k < 200; k++) {
        CHECK(apikey_generate(b) == ERR_OK);
        for (int i = 4; i < APIKEY_LEN; i++) {
            const char c = b[i];
            if (i == APIKEY_PREFIX_LEN) continue;
            n_digit += c >= '0' && c <= '9';
            n_upper += c >= 'A' && c <= 'Z';
            n_lower += c >= 'a' && c <= 'z';
        }
    }
    CHECK(n_digit + n_upper + n_lower == 200 * (APIKEY_LEN - 5));
    // Expected shares 10/62, 26/62, 26/62 of 8,800 characters (means 1419, 3690, 3690;
    // sd 34.5, 46.3, 46.3). The generator is OpenSSL's, not seeded, so the bounds are 6
    // sigma: a false failure has probability below 1e-8 per run.
    CHECK(n_digit > 1212 && n_digit < 1626);
    CHECK(n_upper > 3412 && n_upper < 3968);
    CHECK(n_lower > 3412 && n_lower < 3968);
    return check_exit();
}
