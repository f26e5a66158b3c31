/*
 * capture.h - what a piece of code under test writes to one of its file descriptors
 * (stdout, stderr: the logger writes to fd 2), read back as text.
 *
 *   Capture cap;
 *   capture_begin(&cap, STDERR_FILENO);
 *   ... code that writes ...
 *   capture_end(&cap, text, sizeof text);  // fd restored; text holds what was written
 *
 * The descriptor goes to an unnamed temporary file (tmpfile) between the two calls; stdio
 * buffers are flushed on both sides. Text beyond n - 1 bytes is cut. Header-only: static
 * functions, for tests.
 */
#ifndef TESTS_CAPTURE_H
#define TESTS_CAPTURE_H

#include <stdbool.h>
#include <stdio.h>
#include <unistd.h>

typedef struct Capture {
    int fd;     // the descriptor captured
    int saved;  // its original target, dup()ed; -1 when capture_begin failed
    FILE *tmp;
} Capture;

// Send what is written to fd into a temporary file. False (and nothing redirected) when the
// temporary file or the dup fails.
static inline bool capture_begin(Capture *c, int fd)
{
    fflush(stdout);
    fflush(stderr);
    c->fd = fd;
    c->saved = -1;
    c->tmp = tmpfile();
    if (!c->tmp) return false;
    c->saved = dup(fd);
    if (c->saved < 0 || dup2(fileno(c->tmp), fd) < 0) {
        if (c->saved >= 0) close(c->saved);
        c->saved = -1;
        fclose(c->tmp);
        c->tmp = NULL;
        return false;
    }
    return true;
}

// Restore the descriptor and copy what was written into out[n] (NUL-terminated; empty when
// capture_begin failed). Returns the length copied.
static inline size_t capture_end(Capture *c, char *out, size_t n)
{
    fflush(stdout);
    fflush(stderr);
    size_t got = 0;
    if (c->saved >= 0) {
        dup2(c->saved, c->fd);
        close(c->saved);
        c->saved = -1;
    }
    if (c->tmp) {
        rewind(c->tmp);
        got = fread(out, 1, n - 1, c->tmp);
        fclose(c->tmp);
        c->tmp = NULL;
    }
    out[got] = '\0';
    return got;
}

#endif  // TESTS_CAPTURE_H
