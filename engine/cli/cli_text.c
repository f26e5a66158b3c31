/*
 * cli_text.c - `glmspark tokenize`, `glmspark detokenize` and `glmspark bench-tokenize`.
 *
 *   tokenize --tokenizer FILE [--add-special] [--jsonl]
 *       stdin is UTF-8 text (invalid bytes become U+FFFD); prints the ids space-separated on
 *       one line. With --jsonl every input line is one JSON string and every output line one
 *       JSON array of ids. Special tokens are added only with --add-special; special-token
 *       strings inside the text are always recognised, as in HF tokenizers.
 *   detokenize --tokenizer FILE [--skip-special] [--stream]
 *       stdin holds ids separated by whitespace, commas or brackets; prints the text. With
 *       --stream the ids go through the streaming decoder one at a time (same output).
 *   bench-tokenize --tokenizer FILE --file TEXT [--prompt-tokens N]
 *       times single-threaded encoding of TEXT whole and line by line, and of the shortest
 *       prefix of whole lines holding N tokens (default 262144); prints one JSON line.
 */
#include "engine/cli/cli.h"

#include <errno.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"
#include "engine/shared/clock.h"
#include "engine/shared/tokenizer.h"

static int usage(const char *cmd)
{
    if (strcmp(cmd, "tokenize") == 0) {
        fprintf(stderr, "usage: glmspark tokenize --tokenizer FILE [--add-special] [--jsonl]\n");
    } else if (strcmp(cmd, "detokenize") == 0) {
        fprintf(stderr,
                "usage: glmspark detokenize --tokenizer FILE [--skip-special] [--stream]\n");
    } else {
        fprintf(stderr, "usage: glmspark bench-tokenize --tokenizer FILE --file TEXT "
                        "[--prompt-tokens N]\n");
    }
    return 2;
}

// Read all of f into a malloc'd NUL-terminated string. NULL on failure (errno says why).
static char *read_all(FILE *f, size_t *n_out)
{
    Buf b = {0};
    if (!buf_add_file(&b, f)) return buf_take(&b, n_out);
    buf_free(&b);
    return NULL;
}

static void print_ids(const TokIds *ids, bool json)
{
    if (json) putchar('[');
    for (size_t i = 0; i < ids->n; i++) {
        printf(i ? (json ? ",%d" : " %d") : "%d", (int) ids->ids[i]);
    }
    puts(json ? "]" : "");
}

// What tokenize and detokenize share: the tokenizer, all of stdin (n bytes, NUL-terminated)
// and the command's two boolean flags.
typedef struct TextCmd {
    Tokenizer *tok;
    char *input;
    size_t n;
    bool on[2];
} TextCmd;

// Parse "--tokenizer FILE" and the flags flags[0] and flags[1] (setting c->on[0], c->on[1]),
// load the tokenizer and read stdin into *c (zeroed by the caller). Returns -1 on success
// (text_cmd_close frees c); otherwise the command's exit status, 2 after printing the
// usage or 1 after a failure, with nothing to free.
static int text_cmd_open(int argc, char **argv, const char *const flags[2], TextCmd *c)
{
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc) {
            path = argv[++i];
        } else if (strcmp(argv[i], flags[0]) == 0) {
            c->on[0] = true;
        } else if (strcmp(argv[i], flags[1]) == 0) {
            c->on[1] = true;
        } else {
            return usage(argv[0]);
        }
    }
    if (!path) return usage(argv[0]);
    if (tok_load(&c->tok, path)) return 1;
    c->input = read_all(stdin, &c->n);
    if (!c->input) {
        fprintf(stderr, "glmspark %s: could not read stdin: %s\n", argv[0], strerror(errno));
        tok_destroy(c->tok);
        c->tok = NULL;
        return 1;
    }
    return -1;
}

// Free what text_cmd_open gave c.
static void text_cmd_close(TextCmd *c)
{
    free(c->input);
    tok_destroy(c->tok);
}

int cli_tokenize(int argc, char **argv)
{
    static const char *const flags[2] = {"--add-special", "--jsonl"};
    TextCmd c = {0};
    int rc = text_cmd_open(argc, argv, flags, &c);
    if (rc >= 0) return rc;
    const bool add_special = c.on[0], jsonl = c.on[1];
    TokIds ids = {0};
    rc = 1;
    if (!jsonl) {
        if (tok_encode(c.tok, c.input, c.n, add_special, &ids)) goto done;
        print_ids(&ids, false);
        rc = 0;
        goto done;
    }
    size_t line_no = 0;
    for (char *line = c.input; line < c.input + c.n;) {
        char *end = memchr(line, '\n', (size_t) (c.input + c.n - line));
        if (!end) end = c.input + c.n;
        line_no++;
        json_tokener *jt = json_tokener_new();
        json_object *js = jt ? json_tokener_parse_ex(jt, line, (int) (end - line)) : NULL;
        const bool ok = js && json_object_get_type(js) == json_type_string;
        if (!ok) {
            fprintf(stderr, "glmspark tokenize: line %zu: expected one JSON string\n", line_no);
        } else {
            ids.n = 0;
            if (tok_encode(c.tok, json_object_get_string(js),
                           (size_t) json_object_get_string_len(js), add_special, &ids)) {
                json_object_put(js);
                json_tokener_free(jt);
                goto done;
            }
            print_ids(&ids, true);
        }
        json_object_put(js);
        if (jt) json_tokener_free(jt);
        if (!ok) goto done;
        line = end + 1;
    }
    rc = 0;
done:
    if (fflush(stdout) != 0) rc = 1;
    tok_ids_free(&ids);
    text_cmd_close(&c);
    return rc;
}

int cli_detokenize(int argc, char **argv)
{
    static const char *const flags[2] = {"--skip-special", "--stream"};
    TextCmd c = {0};
    int rc = text_cmd_open(argc, argv, flags, &c);
    if (rc >= 0) return rc;
    TokStream *ts = NULL;
    char *text = NULL;
    const bool skip = c.on[0], stream = c.on[1];
    TokIds ids = {0};
    rc = 1;
    for (char *p = c.input; *p;) {
        if (strchr(" \t\r\n,[]", *p)) {
            p++;
            continue;
        }
        char *end;
        errno = 0;
        const long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            fprintf(stderr, "glmspark detokenize: bad id at byte %zu\n", (size_t) (p - c.input));
            goto done;
        }
        if (ids.n == ids.cap) {
            ids.cap = ids.cap ? 2 * ids.cap : 256;
            int32_t *a = realloc(ids.ids, ids.cap * sizeof *a);
            if (!a) goto done;
            ids.ids = a;
        }
        ids.ids[ids.n++] = (int32_t) v;
        p = end;
    }
    if (stream) {
        if (tok_stream_create(&ts, c.tok, skip)) goto done;
        const char *piece;
        size_t np;
        for (size_t i = 0; i < ids.n; i++) {
            if (tok_stream_feed(ts, ids.ids[i], &piece, &np)) goto done;
            fwrite(piece, 1, np, stdout);
        }
        if (tok_stream_flush(ts, &piece, &np)) goto done;
        fwrite(piece, 1, np, stdout);
    } else {
        size_t nt;
        if (tok_decode(c.tok, ids.ids, ids.n, skip, &text, &nt)) goto done;
        fwrite(text, 1, nt, stdout);
    }
    rc = 0;
done:
    if (fflush(stdout) != 0) rc = 1;
    tok_stream_destroy(ts);
    tok_ids_free(&ids);
    free(text);
    text_cmd_close(&c);
    return rc;
}

int cli_bench_tokenize(int argc, char **argv)
{
    const char *path = NULL, *file = NULL;
    long prompt_tokens = 262144;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc) {
            path = argv[++i];
        } else if (strcmp(argv[i], "--file") == 0 && i + 1 < argc) {
            file = argv[++i];
        } else if (strcmp(argv[i], "--prompt-tokens") == 0 && i + 1 < argc) {
            prompt_tokens = strtol(argv[++i], NULL, 10);
        } else {
            return usage(argv[0]);
        }
    }
    if (!path || !file || prompt_tokens <= 0) return usage(argv[0]);
    Tokenizer *tok = NULL;
    char *text = NULL;
    TokIds ids = {0};
    FILE *f = NULL;
    int rc = 1;
    const double t_load0 = clock_now_s();
    if (tok_load(&tok, path)) goto done;
    const double t_load = clock_now_s() - t_load0;
    f = fopen(file, "rb");
    size_t n = 0;
    if (f) text = read_all(f, &n);
    if (!text) {
        fprintf(stderr, "glmspark bench-tokenize: could not read \"%s\"\n", file);
        goto done;
    }
    // Cold cache for the whole-text run: a fresh tokenizer state is what a server sees at
    // first, and the line-by-line run after it measures the warm case.
    double t0 = clock_now_s();
    if (tok_encode(tok, text, n, false, &ids)) goto done;
    const double t_whole = clock_now_s() - t0;
    const size_t n_ids = ids.n;
    t0 = clock_now_s();
    size_t n_line_ids = 0;
    for (char *line = text; line < text + n;) {
        char *end = memchr(line, '\n', (size_t) (text + n - line));
        if (!end) end = text + n;
        ids.n = 0;
        if (tok_encode(tok, line, (size_t) (end - line), false, &ids)) goto done;
        n_line_ids += ids.n;
        line = end + 1;
    }
    const double t_lines = clock_now_s() - t0;
    // The shortest prefix of whole lines that holds prompt_tokens tokens.
    size_t cut = 0, have = 0;
    for (char *line = text; line < text + n && have < (size_t) prompt_tokens;) {
        char *end = memchr(line, '\n', (size_t) (text + n - line));
        if (!end) end = text + n;
        ids.n = 0;
        if (tok_encode(tok, line, (size_t) (end - line) + (end < text + n), false, &ids)) goto done;
        have += ids.n;
        cut = (size_t) (end - text) + (end < text + n);
        line = end + 1;
    }
    ids.n = 0;
    t0 = clock_now_s();
    if (tok_encode(tok, text, cut, false, &ids)) goto done;
    const double t_prompt = clock_now_s() - t0;
    const double mb = (double) n / 1e6;
    printf("{\"bench\": \"glmspark\", \"bytes\": %zu, \"ids\": %zu, \"load_s\": %.4f, "
           "\"whole_s\": %.4f, \"whole_MBps\": %.2f, \"lines_s\": %.4f, \"lines_MBps\": %.2f, "
           "\"line_ids\": %zu, \"prompt_bytes\": %zu, \"prompt_ids\": %zu, \"prompt_s\": %.4f}\n",
           n, n_ids, t_load, t_whole, mb / t_whole, t_lines, mb / t_lines, n_line_ids, cut, ids.n,
           t_prompt);
    rc = 0;
done:
    if (f) fclose(f);
    tok_ids_free(&ids);
    free(text);
    tok_destroy(tok);
    return rc;
}
