/*
 * fuzz_safetensors_header.c - ckpt_parse_header on arbitrary bytes.
 *
 * The input is a whole safetensors file (len == file size), so accepted headers also get
 * data pointers. Invariants of an accepted header (checked, abort on violation): every
 * tensor's bytes lie inside the input, its byte count equals the product of its shape times
 * its dtype size, it has at most CKPT_MAX_DIMS dimensions and a non-empty NUL-terminated
 * name inside the names allocation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));  // rejections are the common case
    CkptTensor *t = NULL;
    char *names = NULL;
    int n = 0;
    if (ckpt_parse_header(data, size, size, "fuzz", &t, &n, &names) != ERR_OK) return 0;
    ASSERT(n >= 0);
    for (int i = 0; i < n; i++) {
        ASSERT(t[i].n_dims >= 0 && t[i].n_dims <= CKPT_MAX_DIMS);
        uint64_t elems = 1;
        for (int d = 0; d < t[i].n_dims; d++) {
            ASSERT(t[i].shape[d] >= 0);
            elems *= (uint64_t) t[i].shape[d];
        }
        ASSERT(elems * ckpt_dtype_size(t[i].dtype) == t[i].n_bytes);
        const uint8_t *p = t[i].data;
        ASSERT(p >= data + 8 && p <= data + size && t[i].n_bytes <= (size_t) (data + size - p));
        ASSERT(t[i].name && t[i].name[0] && strlen(t[i].name) < size);
        ASSERT(strcmp(t[i].name, "__metadata__") != 0);
    }
    free(t);
    free(names);
    return 0;
}
