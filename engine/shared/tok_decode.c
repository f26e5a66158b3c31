/*
 * tok_decode.c - token ids to text, whole or streamed.
 *
 * Decoding follows HF tokenizers: ids become their token strings (unknown ids skipped,
 * special tokens skipped when asked), then each decoder rewrites the list of strings
 * (decode_chain in HF's decoders), and the final list is concatenated; with no decoder the
 * strings are joined by single spaces.
 *
 * Streaming: a TokStream keeps the ids of an open "window" and decodes the whole window
 * each time. The window is cut, and its text emitted, at the first point where the text so
 * far can no longer change: for ByteLevel when its bytes do not end inside a UTF-8
 * character, for ByteFallback when the last token is not a <0xXX> byte token (a later byte
 * token could still turn an invalid run into a character or the reverse). Every decoder we
 * support is per token apart from these two and from rules about the very first token
 * (Metaspace drops its replacement chars, Strip after Fuse cuts the leading chars), which
 * the stream applies only to the first window that holds a token (for Strip, the first
 * whose text is not empty: the window stays open until then). A chain with any other
 * decoder after a fusing one (Fuse, ByteLevel) sees the whole text at once: its stream
 * holds everything until the flush (tok_stream_holds_all). So the pieces concatenate to
 * exactly tok_decode() of everything fed, and each piece is whole UTF-8 characters.
 */
#include "engine/shared/tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"
#include "engine/shared/tok_internal.h"
#include "engine/shared/utf8.h"

// A list of strings in one buffer: string i is bytes.p[off[i] .. off[i] + len[i]), and the
// strings lie back to back, so the buffer is also their concatenation.
typedef struct StrList {
    Buf bytes;
    size_t *off, *len;  // [n]
    size_t n, cap;
} StrList;

// Make the bytes appended since offset start the list's next string.
static Err list_close(StrList *l, size_t start)
{
    if (l->bytes.is_oom) return ERR_NOMEM;
    if (l->n == l->cap) {
        const size_t cap = l->cap ? 2 * l->cap : 64;
        size_t *off = realloc(l->off, cap * sizeof *off);
        if (!off) return ERR_NOMEM;
        l->off = off;
        size_t *len = realloc(l->len, cap * sizeof *len);
        if (!len) return ERR_NOMEM;
        l->len = len;
        l->cap = cap;
    }
    l->off[l->n] = start;
    l->len[l->n] = l->bytes.n - start;
    l->n++;
    return ERR_OK;
}

static Err list_push(StrList *l, const char *s, size_t n)
{
    const size_t start = l->bytes.n;
    buf_add(&l->bytes, s, n);
    return list_close(l, start);
}

static void list_free(StrList *l)
{
    buf_free(&l->bytes);
    free(l->off);
    free(l->len);
    memset(l, 0, sizeof *l);
}

static void list_swap(StrList *a, StrList *b)
{
    const StrList t = *a;
    *a = *b;
    *b = t;
    b->n = 0;
    buf_clear(&b->bytes);
}

// Byte for a char of the byte-level alphabet, -1 if cp is not one.
static int bytelevel_inverse(uint32_t cp)
{
    static int16_t table[0x144];
    static int ready;  // racing first calls all write the same values before publishing
    if (!__atomic_load_n(&ready, __ATOMIC_ACQUIRE)) {
        for (size_t i = 0; i < 0x144; i++)
            table[i] = -1;
        for (int b = 0; b < 256; b++)
            table[tok_bytelevel_char((uint8_t) b)] = (int16_t) b;
        __atomic_store_n(&ready, 1, __ATOMIC_RELEASE);
    }
    return cp < 0x144 ? table[cp] : -1;
}

// Bytes a byte-level token stands for: its chars unmapped, or its raw bytes when any char
// is outside the alphabet (HF decoders/byte_level.rs). Appends to dst (room for n bytes).
static size_t bytelevel_unmap(const char *s, size_t n, char *dst)
{
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        const size_t len = utf8_char_len((const uint8_t *) s + i, n - i);
        const int b = len ? bytelevel_inverse(utf8_decode((const uint8_t *) s + i, len)) : -1;
        if (b < 0) {
            memcpy(dst, s, n);
            return n;
        }
        dst[w++] = (char) b;
        i += len;
    }
    return w;
}

// Byte value of a "<0xXX>" token, -1 otherwise.
static int byte_token(const char *s, size_t n)
{
    if (n != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        const char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') {
            v |= c - '0';
        } else if (c >= 'A' && c <= 'F') {
            v |= c - 'A' + 10;
        } else if (c >= 'a' && c <= 'f') {
            v |= c - 'a' + 10;
        } else {
            return -1;
        }
    }
    return v;
}

static Err replace_all(const TokDec *d, pcre2_match_data *md, const char *s, size_t n, StrList *out)
{
    // Every step of HF's decoder chain holds a Rust String (valid UTF-8); an earlier ByteLevel
    // step can leave invalid bytes here, which PCRE2 (run without its own check) must not see.
    char *fixed = NULL;
    if (utf8_valid_prefix((const uint8_t *) s, n) != n) {
        size_t n_fixed;
        const Err err = utf8_lossy((const uint8_t *) s, n, &fixed, &n_fixed);
        if (err) return err;
        s = fixed;
        n = n_fixed;
    }
    // Build the result in out's buffer directly, then close it as out's next string.
    const size_t start = out->bytes.n;
    const Err err = tok_regex_replace(d->re, md, s, n, d->content, d->content_n, &out->bytes);
    free(fixed);
    return err ? err : list_close(out, start);
}

// Decode ids; first: ids[0..] start the sequence (first-token rules apply). *n_kept receives
// how many tokens survived the filter. The result is in *out (malloc'd, NUL-terminated).
static Err decode_impl(const Tokenizer *tok, const int32_t *ids, size_t n_ids, bool skip_special,
                       bool first, size_t *n_kept, char **out, size_t *out_n)
{
    StrList a = {0}, b = {0};
    pcre2_match_data *md = NULL;
    char *tmp = NULL;
    Err err = ERR_OK;
    for (size_t i = 0; i < n_ids && !err; i++) {
        const char *s = tok_id_to_token(tok, ids[i]);
        if (!s || (skip_special && tok_is_special(tok, ids[i]))) continue;
        err = list_push(&a, s, strlen(s));
    }
    if (err) goto done;
    *n_kept = a.n;
    bool fused = false;  // the list is one string: the whole text of these ids
    for (size_t k = 0; k < tok->n_decs && !err; k++) {
        const TokDec *d = &tok->decs[k];
        switch (d->kind) {
        case TOK_DEC_BYTELEVEL: {
            tmp = malloc(a.bytes.n + 1);
            if (!tmp) {
                err = ERR_NOMEM;
                break;
            }
            size_t w = 0;
            for (size_t i = 0; i < a.n; i++)
                w += bytelevel_unmap(a.bytes.p + a.off[i], a.len[i], tmp + w);
            char *fixed;
            size_t nf;
            err = utf8_lossy((const uint8_t *) tmp, w, &fixed, &nf);
            free(tmp);
            tmp = NULL;
            if (err) break;
            err = list_push(&b, fixed, nf);
            free(fixed);
            fused = true;
            break;
        }
        case TOK_DEC_REPLACE:
            if (!md) md = pcre2_match_data_create(1, NULL);
            if (!md) {
                err = ERR_NOMEM;
                break;
            }
            for (size_t i = 0; i < a.n && !err; i++)
                err = replace_all(d, md, a.bytes.p + a.off[i], a.len[i], &b);
            break;
        case TOK_DEC_BYTEFALLBACK: {
            // Runs of byte tokens become their UTF-8 text, or one U+FFFD per byte token when
            // the run is not valid UTF-8 (HF decoders/byte_fallback.rs).
            for (size_t i = 0; i < a.n && !err;) {
                if (byte_token(a.bytes.p + a.off[i], a.len[i]) < 0) {
                    err = list_push(&b, a.bytes.p + a.off[i], a.len[i]);
                    i++;
                    continue;
                }
                size_t j = i;
                while (j < a.n && byte_token(a.bytes.p + a.off[j], a.len[j]) >= 0)
                    j++;
                uint8_t *run = malloc(j - i);
                if (!run) {
                    err = ERR_NOMEM;
                    break;
                }
                for (size_t r = i; r < j; r++)
                    run[r - i] = (uint8_t) byte_token(a.bytes.p + a.off[r], a.len[r]);
                const size_t nr = j - i;
                if (utf8_valid_prefix(run, nr) == nr) {
                    err = list_push(&b, (const char *) run, nr);
                } else {
                    for (size_t r = 0; r < nr && !err; r++)
                        err = list_push(&b, "\xEF\xBF\xBD", 3);
                }
                free(run);
                i = j;
            }
            break;
        }
        case TOK_DEC_FUSE:
            // Pushes are adjacent in the buffer, so a's buffer is already the concatenation.
            err = list_push(&b, a.bytes.p, a.bytes.n);
            fused = true;
            break;
        case TOK_DEC_STRIP: {
            // On a fused text only the true start of the sequence may lose leading chars.
            const size_t start = fused && !first ? 0 : d->start;
            for (size_t i = 0; i < a.n && !err; i++) {
                const char *s = a.bytes.p + a.off[i];
                size_t lo = 0, hi = a.len[i];
                for (size_t c = 0; c < start && lo < hi; c++) {
                    if (hi - lo < d->content_n || memcmp(s + lo, d->content, d->content_n) != 0)
                        break;
                    lo += d->content_n;
                }
                for (size_t c = 0; c < d->stop && hi > lo; c++) {
                    if (hi - lo < d->content_n
                        || memcmp(s + hi - d->content_n, d->content, d->content_n) != 0) {
                        break;
                    }
                    hi -= d->content_n;
                }
                err = list_push(&b, s + lo, hi - lo);
            }
            break;
        }
        case TOK_DEC_METASPACE:
            for (size_t i = 0; i < a.n && !err; i++) {
                const char *s = a.bytes.p + a.off[i];
                const size_t n = a.len[i], start = b.bytes.n;
                const bool drop = i == 0 && first && d->strip_first;
                size_t run = 0;  // s[run..c) is copied as it is
                for (size_t c = 0; c < n;) {
                    if (n - c >= d->content_n && memcmp(s + c, d->content, d->content_n) == 0) {
                        buf_add(&b.bytes, s + run, c - run);
                        if (!drop) buf_add(&b.bytes, " ", 1);
                        c += d->content_n;
                        run = c;
                    } else {
                        c++;
                    }
                }
                buf_add(&b.bytes, s + run, n - run);
                err = list_close(&b, start);
            }
            break;
        }
        list_swap(&a, &b);
    }
    if (err) goto done;
    // Join: by nothing after decoders, by spaces without any.
    size_t total = a.bytes.n + (tok->has_decoder ? 0 : a.n + 1);
    char *res = malloc(total + 1);
    if (!res) {
        err = ERR_NOMEM;
        goto done;
    }
    size_t w = 0;
    for (size_t i = 0; i < a.n; i++) {
        if (!tok->has_decoder && (i > 0 || !first)) res[w++] = ' ';
        memcpy(res + w, a.bytes.p + a.off[i], a.len[i]);
        w += a.len[i];
    }
    res[w] = '\0';
    *out = res;
    *out_n = w;
done:
    free(tmp);
    pcre2_match_data_free(md);
    list_free(&a);
    list_free(&b);
    return err;
}

Err tok_decode(const Tokenizer *tok, const int32_t *ids, size_t n_ids, bool skip_special,
               char **out_text, size_t *out_n)
{
    size_t kept;
    return decode_impl(tok, ids, n_ids, skip_special, true, &kept, out_text, out_n);
}

// ---------------------------------------------------------------------------
// Streaming

struct TokStream {
    const Tokenizer *tok;  // borrowed
    bool skip_special;
    bool first;    // no token has been decoded yet
    int32_t *win;  // [n_win] ids not yet emitted
    size_t n_win, cap_win;
    char *piece;  // last returned piece, owned
};

Err tok_token_bytes(const Tokenizer *tok, int32_t id, char **out_text, size_t *out_n)
{
    const char *t = tok_id_to_token(tok, id);
    if (t && tok->n_decs == 1 && tok->decs[0].kind == TOK_DEC_BYTELEVEL) {
        const size_t n = strlen(t);
        char *bytes = malloc(n + 1);
        if (!bytes) return ERR_NOMEM;
        *out_n = bytelevel_unmap(t, n, bytes);
        bytes[*out_n] = 0;
        *out_text = bytes;
        return ERR_OK;
    }
    return tok_decode(tok, &id, 1, false, out_text, out_n);
}

Err tok_stream_create(TokStream **out, const Tokenizer *tok, bool skip_special)
{
    *out = NULL;
    TokStream *s = calloc(1, sizeof *s);
    if (!s) return ERR_NOMEM;
    s->tok = tok;
    s->skip_special = skip_special;
    s->first = true;
    *out = s;
    return ERR_OK;
}

void tok_stream_destroy(TokStream *s)
{
    if (!s) return;
    free(s->win);
    free(s->piece);
    free(s);
}

// How many leading chars the Strips after the first fusing decoder (Fuse, ByteLevel: each
// makes the list one string, the whole text) may cut from the start of the sequence (their
// starts summed), or -1 when a decoder after it sees across windows: a Strip of the end, or
// anything but Strip and Fuse (a Replace's pattern or a later ByteLevel's all-or-nothing
// unmapping spans tokens, a Metaspace drops its replacement chars in the whole text, a
// ByteFallback sees byte tokens that only the fusing made).
static int fused_strip_start(const Tokenizer *tok)
{
    bool fused = false;
    int start = 0;
    for (size_t k = 0; k < tok->n_decs; k++) {
        const TokDec *d = &tok->decs[k];
        if (fused && d->kind == TOK_DEC_STRIP) {
            if (d->stop > 0) return -1;
            start += (int) (d->start < 2 ? d->start : 2);
        } else if (fused && d->kind != TOK_DEC_FUSE) {
            return -1;
        }
        fused |= d->kind == TOK_DEC_FUSE || d->kind == TOK_DEC_BYTELEVEL;
    }
    return start;
}

bool tok_stream_holds_all(const Tokenizer *tok)
{
    const int start = fused_strip_start(tok);
    return start < 0 || start > 1;
}

// True when a later id could still change the window's text.
static bool window_open(const TokStream *s)
{
    const Tokenizer *tok = s->tok;
    // Strips after the fusing cut the start of the whole text. One of at most one char is
    // applied to the first window whose text is not empty (below); more than one char, the
    // end, or another decoder after the fusing sees across windows: hold everything (no real
    // tokenizer does this; the loader warns).
    const int strip_start = fused_strip_start(tok);
    if (strip_start < 0 || strip_start > 1) return true;  // tok_stream_holds_all
    if (strip_start == 1 && s->first) {
        // Until the text is not empty, the next token's leading char is still the start.
        char *text = NULL;
        size_t n = 0, kept = 0;
        if (decode_impl(tok, s->win, s->n_win, s->skip_special, true, &kept, &text, &n)) return true;
        free(text);
        if (n == 0) return true;
    }
    bool has_bytelevel = false, has_fallback = false;
    for (size_t k = 0; k < tok->n_decs; k++) {
        const TokDec *d = &tok->decs[k];
        has_bytelevel |= d->kind == TOK_DEC_BYTELEVEL;
        has_fallback |= d->kind == TOK_DEC_BYTEFALLBACK;
    }
    // Walk back over the surviving tokens.
    uint8_t tail[4];
    size_t n_tail = 0;
    bool last_seen = false;
    for (size_t i = s->n_win; i-- > 0;) {
        const int32_t id = s->win[i];
        const char *t = tok_id_to_token(tok, id);
        if (!t || (s->skip_special && tok_is_special(tok, id))) continue;
        const size_t n = strlen(t);
        if (!last_seen) {
            last_seen = true;
            if (has_fallback && byte_token(t, n) >= 0) return true;
            if (!has_bytelevel) return false;
        }
        char small[256];
        char *bytes = n <= sizeof small ? small : malloc(n);
        if (!bytes) return true;  // out of memory: hold the text; flush still emits it
        const size_t nb = bytelevel_unmap(t, n, bytes);
        for (size_t k = nb; k-- > 0 && n_tail < 4;) {
            memmove(tail + 1, tail, n_tail);
            tail[0] = (uint8_t) bytes[k];
            n_tail++;
        }
        if (bytes != small) free(bytes);
        if (n_tail >= 4) break;
    }
    return has_bytelevel && utf8_incomplete_tail(tail, n_tail) > 0;
}

static Err stream_emit(TokStream *s, const char **piece, size_t *n_piece)
{
    char *text;
    size_t n, kept;
    const Err err =
        decode_impl(s->tok, s->win, s->n_win, s->skip_special, s->first, &kept, &text, &n);
    if (err) return err;
    if (kept) s->first = false;
    s->n_win = 0;
    free(s->piece);
    s->piece = text;
    *piece = text;
    *n_piece = n;
    return ERR_OK;
}

Err tok_stream_feed(TokStream *s, int32_t id, const char **piece, size_t *n_piece)
{
    *piece = "";
    *n_piece = 0;
    if (s->n_win == s->cap_win) {
        const size_t cap = s->cap_win ? 2 * s->cap_win : 16;
        int32_t *w = realloc(s->win, cap * sizeof *w);
        if (!w) return ERR_NOMEM;
        s->win = w;
        s->cap_win = cap;
    }
    s->win[s->n_win++] = id;
    if (window_open(s)) return ERR_OK;
    return stream_emit(s, piece, n_piece);
}

Err tok_stream_flush(TokStream *s, const char **piece, size_t *n_piece)
{
    const Err err = stream_emit(s, piece, n_piece);
    s->first = true;
    s->n_win = 0;
    return err;
}
