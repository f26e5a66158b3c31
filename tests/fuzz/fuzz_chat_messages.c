/*
 * fuzz_chat_messages.c - libFuzzer target for the GLM chat renderer and output parser.
 *
 * The input is taken as a chat request JSON (object or bare messages array) and rendered
 * with both templates. Invariants (SQLite's fuzzinvariants style): no crash, no leak; a
 * rendering that succeeds starts with "[gMASK]<sop>" and is NUL-terminated at its length;
 * a failure is ERR_INVAL with a non-empty message (or ERR_NOMEM). The same bytes are then
 * fed to ChatParser whole and in three pieces cut at input-dependent points: both runs
 * must yield the same transcript (the parser's streaming contract).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <json-c/json.h>

#include "engine/common/chat.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct Sink {
    char *p;
    size_t n, cap;
} Sink;

static void sink_put(Sink *s, const char *text, size_t n)
{
    if (s->n + n + 1 > s->cap) {
        s->cap = (s->n + n + 1) * 2;
        s->p = realloc(s->p, s->cap);
        if (!s->p) abort();
    }
    memcpy(s->p + s->n, text, n);
    s->n += n;
}

static Err on_event(void *user, const ChatEvent *ev)
{
    Sink *s = user;
    char tag[2] = {"RCT"[ev->kind], 0};
    sink_put(s, tag, 1);
    if (ev->kind == CHAT_EVENT_TOOL_CALL) {
        if (!ev->name[0] || ev->arguments[0] != '{') abort();
        sink_put(s, ev->name, strlen(ev->name));
        sink_put(s, ev->arguments, strlen(ev->arguments));
    } else {
        if (ev->n_text == 0) abort();
        sink_put(s, ev->text, ev->n_text);
    }
    sink_put(s, "", 1);
    return ERR_OK;
}

// Concatenate text per run of one kind so that different splits compare equal.
static void normalize(const Sink *in, Sink *out)
{
    size_t i = 0;
    char last = 0;
    while (i < in->n) {
        const char kind = in->p[i];
        const char *body = in->p + i + 1;
        const size_t len = strlen(body);  // the input is cut at its first NUL
        if (kind == 'T' || kind != last) {
            sink_put(out, "\n", 1);
            sink_put(out, &kind, 1);
        }
        sink_put(out, body, len);
        last = kind == 'T' ? 0 : kind;
        i += 1 + len + 1;
    }
}

static void parse_text(const uint8_t *data, size_t size, const size_t *cuts, int n_cuts, Sink *out)
{
    ChatParser p;
    Sink raw = {0};
    const bool in_reasoning = size > 0 && (data[0] & 1);
    if (chat_parser_init(&p, in_reasoning, NULL)) abort();
    size_t at = 0;
    for (int i = 0; i <= n_cuts; i++) {
        const size_t end = i < n_cuts ? cuts[i] : size;
        if (chat_parser_feed(&p, (const char *) data + at, end - at, on_event, &raw)) abort();
        at = end;
    }
    if (chat_parser_finish(&p, on_event, &raw)) abort();
    chat_parser_free(&p);
    normalize(&raw, out);
    free(raw.p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (1 << 20)) return 0;
    json_tokener *tok = json_tokener_new();
    json_object *req = json_tokener_parse_ex(tok, (const char *) data, (int) size);
    if (json_tokener_get_error(tok) == json_tokener_success) {
        for (int t = 0; t < 2; t++) {
            char *out = NULL;
            size_t n = 0;
            ChatOptions opts;
            ChatError err = {{0}};
            const Err e = chat_render_request(req, t ? CHAT_TEMPLATE_GLM52 : CHAT_TEMPLATE_GLM47,
                                              &out, &n, &opts, &err);
            if (e == ERR_OK) {
                if (n < 12 || memcmp(out, "[gMASK]<sop>", 12) != 0 || out[n] != '\0') abort();
                free(out);
            } else if (e == ERR_INVAL) {
                if (!err.msg[0] || out) abort();
            } else if (e != ERR_NOMEM) {
                abort();
            }
        }
    }
    json_object_put(req);
    json_tokener_free(tok);

    // Parser: events hold no NUL except inside text, so cut the text at the first NUL.
    const uint8_t *nul = memchr(data, 0, size);
    const size_t n_text = nul ? (size_t) (nul - data) : size;
    Sink whole = {0}, split = {0};
    size_t cuts[2] = {n_text / 3, n_text / 3 + (n_text > 1 ? data[1] % (n_text - n_text / 3) : 0)};
    if (cuts[1] > n_text) cuts[1] = n_text;
    parse_text(data, n_text, NULL, 0, &whole);
    parse_text(data, n_text, cuts, 2, &split);
    if (whole.n != split.n || (whole.n && memcmp(whole.p, split.p, whole.n) != 0)) abort();
    free(whole.p);
    free(split.p);
    return 0;
}
