/*
 * fuzz_api_request.c - libFuzzer target for the API request decoder (fcgi/api_request.c).
 *
 * Invariants checked on every input: a rejected body leaves the request zeroed with a
 * 4xx status and a message; an accepted one satisfies api_request_check() (fields in
 * range, no U+0000, required fields present) and serialises its engine parameters.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/err.h"
#include "fcgi/api_request.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    for (int k = 0; k < 2; k++) {
        ApiRequest r;
        ApiError e;
        const Err err = api_request_parse(&r, k ? API_KIND_COMPLETION : API_KIND_CHAT,
                                          (const char *) data, size, &e);
        if (err) {
            ASSERT(r.root == NULL && r.model == NULL);
            ASSERT(e.status >= 400 && e.status < 500 && e.message[0]);
            continue;
        }
        ASSERT(api_request_check(&r));
        json_object *p = api_request_params(&r);
        ASSERT(p != NULL);
        ASSERT(json_object_to_json_string(p) != NULL);
        json_object_put(p);
        api_request_free(&r);
    }
    return 0;
}
