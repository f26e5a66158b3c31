/*
 * buf.c - the growable byte buffer (see buf.h).
 */
#include "engine/shared/buf.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

Err buf_reserve(Buf *b, size_t n)
{
    if (b->is_oom) return ERR_NOMEM;
    if (n > SIZE_MAX / 2 - b->n) {  // past any real allocation; also keeps the doubling finite
        b->is_oom = true;
        return ERR_NOMEM;
    }
    const size_t need = b->n + n + 1;
    if (need <= b->cap) return ERR_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->is_oom = true;
        return ERR_NOMEM;
    }
    b->p = p;
    b->cap = cap;
    return ERR_OK;
}

Err buf_add(Buf *b, const char *s, size_t n)
{
    const Err err = buf_reserve(b, n);
    if (err) return err;
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return ERR_OK;
}

Err buf_adds(Buf *b, const char *s)
{
    return buf_add(b, s, strlen(s));
}

Err buf_vaddf(Buf *b, const char *fmt, va_list ap)
{
    va_list again;
    va_copy(again, ap);
    const int n = vsnprintf(NULL, 0, fmt, ap);
    Err err = n < 0 ? ERR_INVAL : buf_reserve(b, (size_t) n);
    if (!err) {
        vsnprintf(b->p + b->n, (size_t) n + 1, fmt, again);
        b->n += (size_t) n;
    }
    va_end(again);
    return err;
}

Err buf_addf(Buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    const Err err = buf_vaddf(b, fmt, ap);
    va_end(ap);
    return err;
}

Err buf_add_ids(Buf *b, const int32_t *ids, size_t n)
{
    // Formatted on the stack: buf_addf would run vsnprintf twice per id.
    char t[16];
    buf_add(b, "{", 1);
    for (size_t i = 0; i < n; i++)
        buf_add(b, t, (size_t) snprintf(t, sizeof t, i ? ",%d" : "%d", (int) ids[i]));
    return buf_add(b, "}", 1);
}

Err buf_add_file(Buf *b, FILE *f)
{
    for (;;) {
        // Read straight into the spare room; when it is full, double it (from 64 KiB).
        if (b->n + 1 >= b->cap) {
            const Err err = buf_reserve(b, b->cap ? b->cap : (size_t) 1 << 16);
            if (err) return err;
        }
        const size_t got = fread(b->p + b->n, 1, b->cap - b->n - 1, f);
        b->n += got;
        b->p[b->n] = '\0';
        if (got == 0) break;
    }
    return ferror(f) ? ERR_IO : ERR_OK;
}

void buf_consume(Buf *b, size_t k)
{
    ASSERT(k <= b->n);
    if (k == 0) return;
    memmove(b->p, b->p + k, b->n - k);
    b->n -= k;
    b->p[b->n] = '\0';
}

void buf_clear(Buf *b)
{
    b->n = 0;
    if (b->p) b->p[0] = '\0';
}

char *buf_take(Buf *b, size_t *n)
{
    buf_add(b, "", 0);  // an empty buffer still hands over a string
    char *p = b->is_oom ? NULL : b->p;
    if (n) *n = p ? b->n : 0;
    if (!p) free(b->p);
    *b = (Buf){0};
    return p;  // ownership moved to the caller
}

void buf_free(Buf *b)
{
    if (!b) return;
    free(b->p);
    *b = (Buf){0};
}
