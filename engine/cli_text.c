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
#include "cli.h"

#include <errno.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/tokenizer.h"

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

// Read all of f into a malloc'd buffer (NUL-terminated). Returns NULL on failure.
static char *read_all(FILE *f, size_t *n_out)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf) return NULL;
    for (;;) {
        if (n + 1 >= cap) {
            char *b = realloc(buf, cap * 2);
            if (!b) {
                free(buf);
                return NULL;
            }
            buf = b;
            cap *= 2;
        }
        const size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    *n_out = n;
    return buf;
}

static void print_ids(const TokIds *ids, bool json)
{
    if (json) putchar('[');
    for (size_t i = 0; i < ids->n; i++) {
        printf(i ? (json ? ",%d" : " %d") : "%d", (int) ids->ids[i]);
    }
    puts(json ? "]" : "");
}

int cli_tokenize(int argc, char **argv)
{
    const char *path = NULL;
    bool add_special = false, jsonl = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc) {
            path = argv[++i];
        } else if (strcmp(argv[i], "--add-special") == 0) {
            add_special = true;
        } else if (strcmp(argv[i], "--jsonl") == 0) {
            jsonl = true;
        } else {
            return usage(argv[0]);
        }
    }
    if (!path) return usage(argv[0]);
    Tokenizer *tok = NULL;
    char *input = NULL;
    TokIds ids = {0};
    int rc = 1;
    if (tok_load(&tok, path)) goto done;
    size_t n;
    input = read_all(stdin, &n);
    if (!input) {
        fprintf(stderr, "glmspark tokenize: could not read stdin: %s\n", strerror(errno));
        goto done;
    }
    if (!jsonl) {
        if (tok_encode(tok, input, n, add_special, &ids)) goto done;
        print_ids(&ids, false);
        rc = 0;
        goto done;
    }
    size_t line_no = 0;
    for (char *line = input; line < input + n;) {
        char *end = memchr(line, '\n', (size_t) (input + n - line));
        if (!end) end = input + n;
        line_no++;
        json_tokener *jt = json_tokener_new();
        json_object *js = jt ? json_tokener_parse_ex(jt, line, (int) (end - line)) : NULL;
        const bool ok = js && json_object_get_type(js) == json_type_string;
        if (!ok) {
            fprintf(stderr, "glmspark tokenize: line %zu: expected one JSON string\n", line_no);
        } else {
            ids.n = 0;
            if (tok_encode(tok, json_object_get_string(js), (size_t) json_object_get_string_len(js),
                           add_special, &ids)) {
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
    free(input);
    tok_destroy(tok);
    return rc;
}

int cli_detokenize(int argc, char **argv)
{
    const char *path = NULL;
    bool skip = false, stream = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc) {
            path = argv[++i];
        } else if (strcmp(argv[i], "--skip-special") == 0) {
            skip = true;
        } else if (strcmp(argv[i], "--stream") == 0) {
            stream = true;
        } else {
            return usage(argv[0]);
        }
    }
    if (!path) return usage(argv[0]);
    Tokenizer *tok = NULL;
    TokStream *ts = NULL;
    char *input = NULL, *text = NULL;
    TokIds ids = {0};
    int rc = 1;
    if (tok_load(&tok, path)) goto done;
    size_t n;
    input = read_all(stdin, &n);
    if (!input) {
        fprintf(stderr, "glmspark detokenize: could not read stdin: %s\n", strerror(errno));
        goto done;
    }
    for (char *p = input; *p;) {
        if (strchr(" \t\r\n,[]", *p)) {
            p++;
            continue;
        }
        char *end;
        errno = 0;
        const long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            fprintf(stderr, "glmspark detokenize: bad id at byte %zu\n", (size_t) (p - input));
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
        if (tok_stream_create(&ts, tok, skip)) goto done;
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
        if (tok_decode(tok, ids.ids, ids.n, skip, &text, &nt)) goto done;
        fwrite(text, 1, nt, stdout);
    }
    rc = 0;
done:
    if (fflush(stdout) != 0) rc = 1;
    tok_stream_destroy(ts);
    tok_ids_free(&ids);
    free(text);
    free(input);
    tok_destroy(tok);
    return rc;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
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
    const double t_load0 = now_s();
    if (tok_load(&tok, path)) goto done;
    const double t_load = now_s() - t_load0;
    f = fopen(file, "rb");
    size_t n = 0;
    if (f) text = read_all(f, &n);
    if (!text) {
        fprintf(stderr, "glmspark bench-tokenize: could not read \"%s\"\n", file);
        goto done;
    }
    // Cold cache for the whole-text run: a fresh tokenizer state is what a server sees at
    // first, and the line-by-line run after it measures the warm case.
    double t0 = now_s();
    if (tok_encode(tok, text, n, false, &ids)) goto done;
    const double t_whole = now_s() - t0;
    const size_t n_ids = ids.n;
    t0 = now_s();
    size_t n_line_ids = 0;
    for (char *line = text; line < text + n;) {
        char *end = memchr(line, '\n', (size_t) (text + n - line));
        if (!end) end = text + n;
        ids.n = 0;
        if (tok_encode(tok, line, (size_t) (end - line), false, &ids)) goto done;
        n_line_ids += ids.n;
        line = end + 1;
    }
    const double t_lines = now_s() - t0;
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
    t0 = now_s();
    if (tok_encode(tok, text, cut, false, &ids)) goto done;
    const double t_prompt = now_s() - t0;
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
