/*
 * test_buf.c - the growable byte buffer (engine/shared/buf.h): NUL termination from the first
 * append, growth past any fixed size, printf-style appends, id arrays, whole files,
 * consume/clear/take, and the sticky allocation failure (forced through the size check: no
 * allocator hook).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"
#include "tests/check.h"

static void test_append(void)
{
    Buf b = {0};
    CHECK(buf_add(&b, "", 0) == ERR_OK && b.p && b.n == 0 && b.p[0] == '\0');
    // Longer than any fixed buffer the old code used (1 KiB): nothing is cut.
    char *big = malloc(5000);
    memset(big, 'x', 4999);
    big[4999] = '\0';
    CHECK(buf_addf(&b, "<%s>", big) == ERR_OK);
    CHECK(b.n == 5001 && b.p[0] == '<' && b.p[5000] == '>' && b.p[5001] == '\0');
    CHECK(buf_add(&b, "ab", 2) == ERR_OK && b.n == 5003 && !strcmp(b.p + 5001, "ab"));
    for (int i = 0; i < 1000; i++)
        CHECK(buf_addf(&b, "%d,", i) == ERR_OK);
    CHECK(b.n == 5003 + 3890 && strlen(b.p) == b.n);
    CHECK(buf_adds(&b, "end") == ERR_OK && !strcmp(b.p + b.n - 3, "end"));
    CHECK(b.cap > b.n && !b.is_oom);
    buf_free(&b);
    CHECK(b.p == NULL && b.n == 0 && b.cap == 0);
    buf_free(&b);  // a zeroed buffer is fine
    buf_free(NULL);
    free(big);

    // Bytes with NULs of their own are kept; the terminator follows them.
    CHECK(buf_add(&b, "a\0b", 3) == ERR_OK && b.n == 3 && !memcmp(b.p, "a\0b", 4));
    buf_free(&b);
}

static void test_consume_clear_take(void)
{
    Buf b = {0};
    buf_consume(&b, 0);  // nothing yet: fine
    CHECK(buf_adds(&b, "hello, world") == ERR_OK);
    buf_consume(&b, 7);
    CHECK(b.n == 5 && !strcmp(b.p, "world"));
    buf_consume(&b, 0);
    CHECK(b.n == 5 && !strcmp(b.p, "world"));
    buf_consume(&b, 5);
    CHECK(b.n == 0 && b.p[0] == '\0');
    CHECK(buf_adds(&b, "again") == ERR_OK);
    const size_t cap = b.cap;
    buf_clear(&b);
    CHECK(b.n == 0 && b.p[0] == '\0' && b.cap == cap);  // the memory stays
    CHECK(buf_adds(&b, "xy") == ERR_OK);
    size_t n = 99;
    char *s = buf_take(&b, &n);
    CHECK(s && n == 2 && !strcmp(s, "xy"));
    CHECK(b.p == NULL && b.n == 0 && b.cap == 0);
    free(s);
    // An empty buffer still hands over a string.
    s = buf_take(&b, NULL);
    CHECK(s && s[0] == '\0');
    free(s);
    buf_clear(&b);  // a zeroed buffer is fine
    CHECK(b.p == NULL && b.n == 0);
}

static void test_ids(void)
{
    Buf b = {0};
    CHECK(buf_add_ids(&b, NULL, 0) == ERR_OK && !strcmp(b.p, "{}"));
    const int32_t ids[] = {0, -1, 2147483647, (int32_t) -2147483647 - 1, 42};
    CHECK(buf_add_ids(&b, ids, 5) == ERR_OK);
    CHECK(!strcmp(b.p, "{}{0,-1,2147483647,-2147483648,42}"));
    buf_free(&b);
}

static void test_file(void)
{
    // More than the first read's 64 KiB, so the room doubles; appended after what is there.
    FILE *f = tmpfile();
    CHECK(f != NULL);
    if (!f) return;
    for (int i = 0; i < 20000; i++)
        fprintf(f, "%05d\n", i);
    rewind(f);
    Buf b = {0};
    CHECK(buf_adds(&b, "head:") == ERR_OK);
    CHECK(buf_add_file(&b, f) == ERR_OK);
    CHECK(b.n == 5 + 20000 * 6 && b.p[b.n] == '\0' && strlen(b.p) == b.n);
    CHECK(!strncmp(b.p, "head:00000\n00001\n", 17) && !strcmp(b.p + b.n - 6, "19999\n"));
    // At the end of the file: nothing more, still OK.
    const size_t n = b.n;
    CHECK(buf_add_file(&b, f) == ERR_OK && b.n == n);
    fclose(f);
    buf_free(&b);

    // An empty file still gives a string.
    f = tmpfile();
    CHECK(f != NULL);
    if (!f) return;
    CHECK(buf_add_file(&b, f) == ERR_OK && b.p && b.n == 0 && b.p[0] == '\0');
    fclose(f);
    buf_free(&b);

    // A directory opens for reading on Linux and then fails to read (EISDIR): ERR_IO, not
    // sticky.
    f = fopen(".", "rb");
    CHECK(f != NULL);
    if (f) {
        CHECK(buf_add_file(&b, f) == ERR_IO && !b.is_oom);
        CHECK(buf_adds(&b, "x") == ERR_OK && !strcmp(b.p, "x"));
        fclose(f);
    }
    buf_free(&b);
}

static void test_sticky_failure(void)
{
    Buf b = {0};
    CHECK(buf_adds(&b, "kept") == ERR_OK);
    // A size no allocator can give fails like an allocation would, and the bytes stay.
    CHECK(buf_reserve(&b, SIZE_MAX - 8) == ERR_NOMEM && b.is_oom);
    CHECK(b.n == 4 && !strcmp(b.p, "kept"));
    // Every later append fails too, leaving the bytes as they were.
    CHECK(buf_add(&b, "x", 1) == ERR_NOMEM && b.n == 4 && !strcmp(b.p, "kept"));
    CHECK(buf_addf(&b, "%d", 1) == ERR_NOMEM && b.n == 4);
    CHECK(buf_reserve(&b, 0) == ERR_NOMEM);
    buf_clear(&b);  // clearing keeps the failure visible
    CHECK(b.is_oom && buf_adds(&b, "y") == ERR_NOMEM && b.n == 0);
    size_t n = 7;
    CHECK(buf_take(&b, &n) == NULL && n == 0);
    CHECK(b.p == NULL && b.n == 0 && b.cap == 0 && !b.is_oom);  // freed and zeroed
    CHECK(buf_adds(&b, "fresh") == ERR_OK && !strcmp(b.p, "fresh"));
    buf_free(&b);
    CHECK(!b.is_oom);
}

int main(void)
{
    test_append();
    test_consume_clear_take();
    test_ids();
    test_file();
    test_sticky_failure();
    return check_exit();
}
