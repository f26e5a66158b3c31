/*
 * fcgi_capture.h - drive api_server_handle through in-memory FastCGI streams (tests only).
 *
 * The writer stream lands its bytes in a Buf through a 64-byte window, so that
 * FCGX_PutStr's refill path (emptyBuffProc) runs too; the reader stream hands out a body
 * and then reports the end. Used by tests/fcgi/test_api_server.c (no database) and
 * tests/db/test_api_server_db.c (a throwaway PostgreSQL). Header-only: static functions,
 * one copy per test executable.
 */
#ifndef TESTS_FCGI_CAPTURE_H
#define TESTS_FCGI_CAPTURE_H

#include <fcgiapp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fcgi/api_http.h"
#include "fcgi/api_server.h"
#include "tests/check.h"

// The configuration both tests serve with: two models (their tokenizer is set by the test
// that needs one).
static ApiModel capture_models[2] = {
    {.name = "glmspark-demo", .context_len = 4096},
    {.name = "glmspark-demo-b", .context_len = 64},
};
#define CAPTURE_CONFIG                                                                          \
    {                                                                                           \
        .models = capture_models, .n_models = 2, .max_body_bytes = 1 << 20, .keepalive_s = 15,  \
        .poll_ms = 100, .stream_outage_s = 2,                                                   \
    }

typedef struct Capture {
    unsigned char window[64];
    Buf out;
    size_t n_body_read;  // reader side: bytes handed out
    const char *body;
    size_t n_body;
} Capture;

static void capture_empty(FCGX_Stream *s, int do_close)
{
    Capture *cap = s->data;
    (void) do_close;
    CHECK(buf_add(&cap->out, (const char *) cap->window, (size_t) (s->wrNext - cap->window))
          == ERR_OK);
    s->wrNext = cap->window;
}

static void capture_fill(FCGX_Stream *s)
{
    Capture *cap = s->data;
    if (cap->n_body_read == cap->n_body) {
        s->isClosed = 1;
        return;
    }
    s->rdNext = s->stopUnget = (unsigned char *) cap->body + cap->n_body_read;
    s->stop = (unsigned char *) cap->body + cap->n_body;
    cap->n_body_read = cap->n_body;
}

// Answer one request (envp: NULL-terminated "NAME=value" strings, body or NULL) and return
// the response text (the caller frees it); *n_body_read (may be NULL) gets how many body
// bytes the handler read.
static char *capture_handle(char **envp, const char *body, ApiDb *db, const ApiConfig *cfg,
                            size_t *n_body_read)
{
    Capture cap = {.body = body ? body : "", .n_body = body ? strlen(body) : 0};
    FCGX_Stream in = {.isReader = 1, .fillBuffProc = capture_fill, .data = &cap};
    in.rdNext = in.stop = in.stopUnget = (unsigned char *) cap.body;
    FCGX_Stream out = {.wrNext = cap.window,
                       .stop = cap.window + sizeof cap.window,
                       .emptyBuffProc = capture_empty,
                       .data = &cap};
    out.rdNext = out.stop;
    FCGX_Request req = {.in = &in, .out = &out, .envp = envp};
    api_server_handle(&req, db, cfg);
    capture_empty(&out, 1);
    if (n_body_read) *n_body_read = cap.n_body_read;
    return cap.out.p ? cap.out.p : strdup("");
}

// The status of a response and its body (a pointer into text), after checking that the
// header block is "Status: N ...\r\n" lines ending in a blank line; -1 when it is not.
static int capture_status(const char *text, const char **body)
{
    int status = 0;
    if (sscanf(text, "Status: %d", &status) != 1) return -1;
    const char *end = strstr(text, "\r\n\r\n");
    if (!end) return -1;
    for (const char *p = text; p < end; p++)
        if (*p == '\n' && p[-1] != '\r') return -1;  // bare LF inside the header block
    *body = end + 4;
    return status;
}

#endif  // TESTS_FCGI_CAPTURE_H
