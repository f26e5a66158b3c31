/*
 * buf.h - the growable byte buffer that every piece of text we build goes into: the chat
 * prompt, tokenizer strings, job output, SQL parameters, HTTP headers and bodies.
 *
 * Appends double the capacity (from 256 bytes), so building text piece by piece costs
 * amortised O(1) a byte. Once anything was appended (even nothing: buf_add(b, "", 0)), the
 * bytes are NUL-terminated, p[n] == '\0', so p is a C string whenever the n bytes hold no
 * NUL of their own. Allocation failure is sticky: the append that fails and every later
 * one leave the bytes as they were, return ERR_NOMEM and keep is_oom set, so a builder may
 * either check each append or append freely and check is_oom once at the end.
 *
 * Ownership: a Buf owns its bytes; buf_free releases them, buf_take hands them over. Any
 *            append may move p: keep offsets into a Buf, not pointers, across one.
 * Threads:   one thread per Buf.
 * Errors:    ERR_NOMEM (sticky, as above); buf_addf's ERR_INVAL for a format vsnprintf
 *            refuses and buf_add_file's ERR_IO (neither sticky). Nothing is logged: callers
 *            name what they were building.
 */
#ifndef ENGINE_SHARED_BUF_H
#define ENGINE_SHARED_BUF_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

// Zero-initialise to start ({0}).
typedef struct Buf {
    char *p;  // [cap]; NULL until the first append, then p[n] == '\0'
    size_t n, cap;
    bool is_oom;  // an append failed; every later one fails too
} Buf;

// Make room for n more bytes and the NUL without appending anything (p may move).
// ERR_NOMEM (sticky) when the buffer cannot grow.
Err buf_reserve(Buf *b, size_t n);

// Append s[0..n) (s may be NULL when n is 0). ERR_NOMEM (sticky).
Err buf_add(Buf *b, const char *s, size_t n);

// Append the C string s. ERR_NOMEM (sticky).
Err buf_adds(Buf *b, const char *s);

// Append printf-style text, whatever its length. ERR_NOMEM (sticky); ERR_INVAL on a format
// vsnprintf refuses (the bytes are unchanged).
Err buf_addf(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// buf_addf with a va_list (consumed).
Err buf_vaddf(Buf *b, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

// Append ids[0..n) as "{a,b,c}", a PostgreSQL int[] literal (how both sides of the job
// queue write token ids). ERR_NOMEM (sticky).
Err buf_add_ids(Buf *b, const int32_t *ids, size_t n);

// Append what f holds from its position to its end. ERR_NOMEM (sticky); ERR_IO when a read
// fails (ferror(f), errno as the read left it; the bytes read so far stay).
Err buf_add_file(Buf *b, FILE *f);

// Drop the first k (<= n) bytes, moving the rest to the front.
void buf_consume(Buf *b, size_t k);

// Empty the bytes, keeping the memory (and is_oom: a failure stays visible).
void buf_clear(Buf *b);

// Hand the bytes over: a malloc'd NUL-terminated string of *n bytes (n may be NULL) that
// the caller frees, even for an empty buffer; the buffer is zeroed. NULL (the buffer
// freed and zeroed) when an append failed or the empty string cannot be allocated.
char *buf_take(Buf *b, size_t *n);

// Free the bytes and zero the buffer; accepts a zeroed buffer or NULL.
void buf_free(Buf *b);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_BUF_H
