/*
 * tok_encode.c - text to token ids: added tokens, normalizers, pre-tokenizers, BPE.
 *
 * The pipeline is HF tokenizers' (tokenizer/mod.rs encode_single_sequence):
 *   1. split the raw text on added tokens with normalized == false (leftmost-longest, then
 *      the single_word / lstrip / rstrip rules of added_vocabulary.rs);
 *   2. normalize each remaining piece, then split it on normalized added tokens;
 *   3. pre-tokenize each piece into words (regex Split, ByteLevel, Digits, Metaspace, ...);
 *   4. run BPE on each word; 5. wrap with the post-processor's ids when asked.
 * We never build offsets: nothing downstream needs them.
 *
 * Words are spans (offset, length) into one growing byte buffer per call; a step that
 * changes bytes (a prefix space, Metaspace's replacement) appends the new bytes and points
 * the span there. ByteLevel does not rewrite bytes at all: the model maps each byte to the
 * id of its GPT-2 char through a 256-entry table, and whole-word lookups use a vocabulary
 * keyed by raw bytes (tok_internal.h), so byte-level words are never materialised.
 *
 * BPE per word is the classic heap algorithm (HF bpe/word.rs merge_all): a min-heap of
 * candidate pairs ordered by (rank, position), stale entries skipped when popped, which is
 * O(n log n) per word and therefore safe on a 100 KB run of one character class. A word
 * cache (bounded, cleared when full) short-cuts the frequent words; a call takes it with
 * trylock and encodes without it when another thread holds it.
 */
#include "engine/shared/tokenizer.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "engine/shared/buf.h"
#include "engine/shared/tok_internal.h"
#include "engine/shared/utf8.h"

enum {
    CACHE_MAX_WORD = 128,       // bytes; longer words are not cached
    CACHE_MAX_WORDS = 1 << 16,  // entries before the cache is cleared
    CACHE_MAX_IDS = 1 << 20,    // ids before the cache is cleared
};

typedef struct Span {
    size_t off, n;
    bool first;  // starts at offset 0 of the original text (Metaspace "first")
} Span;

typedef struct Mark {
    size_t start, end;
    bool is_match;
} Mark;

typedef struct Sym {
    int32_t id, prev, next, len;  // len 0: merged away
} Sym;

typedef struct HeapItem {
    uint32_t rank, pos;
    int32_t id;
} HeapItem;

typedef struct Seg {
    size_t start, end;
    int32_t added;  // index into tok->added, -1 for text
} Seg;

typedef struct Enc {
    const Tokenizer *tok;
    TokIds *out;
    bool use_cache;
    pcre2_match_data *md;
    Buf buf;  // word bytes
    Span *spans, *spans2;
    size_t n_spans, n_spans2, cap_spans, cap_spans2;
    Mark *marks;
    size_t n_marks, cap_marks;
    Sym *syms;
    size_t cap_syms;
    HeapItem *heap;
    size_t cap_heap;
} Enc;

// ---------------------------------------------------------------------------
// Small growable arrays

static Err grow(void **p, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap) return ERR_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, c * size);
    if (!q) return ERR_NOMEM;
    *p = q;
    *cap = c;
    return ERR_OK;
}

static Err push_id(TokIds *out, int32_t id)
{
    if (out->n == out->cap) {
        const Err err = grow((void **) &out->ids, &out->cap, out->n + 1, sizeof *out->ids);
        if (err) return err;
    }
    out->ids[out->n++] = id;
    return ERR_OK;
}

void tok_ids_free(TokIds *ids)
{
    if (!ids) return;
    free(ids->ids);
    memset(ids, 0, sizeof *ids);
}

// ---------------------------------------------------------------------------
// Character classes (Rust's definitions, which HF uses)

static bool is_white_space(uint32_t c)
{
    // Unicode White_Space: Rust char::is_whitespace and regex \s.
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680
           || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F
           || c == 0x205F || c == 0x3000;
}

static bool is_word_char(uint32_t c)
{
    // Rust regex \w: Alphabetic, marks, decimal numbers, connector punctuation, joiners.
    if (c < 0x80) {
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
               || c == '_';
    }
    if (c == 0x200C || c == 0x200D) return true;
    switch (utf8proc_category((utf8proc_int32_t) c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
        return true;
    default:
        return false;
    }
}

static bool is_numeric(uint32_t c)
{
    // Rust char::is_numeric: general categories Nd, Nl, No.
    if (c < 0x80) return c >= '0' && c <= '9';
    const utf8proc_category_t k = utf8proc_category((utf8proc_int32_t) c);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

// Code point at s[i] (input is valid UTF-8) and its length.
static uint32_t char_at(const char *s, size_t n, size_t i, size_t *len)
{
    *len = utf8_char_len((const uint8_t *) s + i, n - i);
    if (*len == 0) *len = 1;  // unreachable on repaired input; keeps loops finite
    return utf8_decode((const uint8_t *) s + i, *len);
}

// Code point ending at s[i) and its length.
static uint32_t char_before(const char *s, size_t i, size_t *len)
{
    size_t k = i - 1;
    while (k > 0 && ((uint8_t) s[k] & 0xC0) == 0x80)
        k--;
    *len = i - k;
    return utf8_decode((const uint8_t *) s + k, *len);
}

// ---------------------------------------------------------------------------
// Regex search

static Err add_mark(Enc *e, size_t start, size_t end, bool is_match)
{
    const Err err = grow((void **) &e->marks, &e->cap_marks, e->n_marks + 1, sizeof *e->marks);
    if (err) return err;
    e->marks[e->n_marks++] = (Mark){start, end, is_match};
    return ERR_OK;
}

// HF Pattern::find_matches for a regex: contiguous marks covering s[0..n).
static Err regex_marks(Enc *e, const pcre2_code *re, const char *s, size_t n)
{
    e->n_marks = 0;
    if (n == 0) return add_mark(e, 0, 0, false);
    size_t prev = 0, pos = 0, ms, me;
    int rc;
    while ((rc = tok_regex_next(re, e->md, s, n, &pos, &ms, &me)) > 0) {
        Err err = ERR_OK;
        if (prev != ms) err = add_mark(e, prev, ms, false);
        if (!err) err = add_mark(e, ms, me, true);
        if (err) return err;
        prev = me;
    }
    if (rc < 0) return ERR_INVAL;
    if (prev != n) return add_mark(e, prev, n, false);
    return ERR_OK;
}

// HF find_matches for a char predicate: each matching char is its own mark.
static Err pred_marks(Enc *e, bool (*pred)(uint32_t), const char *s, size_t n)
{
    e->n_marks = 0;
    if (n == 0) return add_mark(e, 0, 0, false);
    size_t last = 0;
    for (size_t i = 0; i < n;) {
        size_t len;
        const uint32_t c = char_at(s, n, i, &len);
        if (pred(c)) {
            Err err = ERR_OK;
            if (last < i) err = add_mark(e, last, i, false);
            if (!err) err = add_mark(e, i, i + len, true);
            if (err) return err;
            last = i + len;
        }
        i += len;
    }
    if (last < n) return add_mark(e, last, n, false);
    return ERR_OK;
}

static Err add_span2(Enc *e, size_t off, size_t n, bool first)
{
    if (n == 0) return ERR_OK;  // HF drops empty splits
    const Err err = grow((void **) &e->spans2, &e->cap_spans2, e->n_spans2 + 1, sizeof *e->spans2);
    if (err) return err;
    e->spans2[e->n_spans2++] = (Span){off, n, first};
    return ERR_OK;
}

// Turn e->marks over the span at base into spans2 according to behavior (HF
// normalizer.rs NormalizedString::split).
static Err apply_behavior(Enc *e, size_t base, bool first, TokSplitBehavior behavior, bool invert)
{
    Mark *m = e->marks;
    const size_t n = e->n_marks;
    if (invert) {
        for (size_t i = 0; i < n; i++)
            m[i].is_match = !m[i].is_match;
    }
    // Collapse marks in place into [start, end) pieces, then emit the non-empty ones.
    size_t k = 0;
    switch (behavior) {
    case TOK_SPLIT_REMOVED:
        for (size_t i = 0; i < n; i++) {
            if (!m[i].is_match) m[k++] = m[i];
        }
        break;
    case TOK_SPLIT_ISOLATED:
        k = n;
        break;
    case TOK_SPLIT_MERGED_WITH_PREVIOUS: {
        bool prev_match = false;
        for (size_t i = 0; i < n; i++) {
            if (m[i].is_match && !prev_match && k > 0) {
                m[k - 1].end = m[i].end;
            } else {
                m[k++] = m[i];
            }
            prev_match = m[i].is_match;
        }
        break;
    }
    case TOK_SPLIT_MERGED_WITH_NEXT: {
        // HF folds from the right; "previous" is the mark after this one.
        bool next_match = false;
        size_t w = n;  // pieces are built at the back, then moved to the front
        for (size_t i = n; i-- > 0;) {
            const bool is_match = m[i].is_match;
            if (is_match && !next_match && w < n) {
                m[w].start = m[i].start;
            } else {
                m[--w] = m[i];
            }
            next_match = is_match;
        }
        memmove(m, m + w, (n - w) * sizeof *m);
        k = n - w;
        break;
    }
    case TOK_SPLIT_CONTIGUOUS: {
        bool prev_match = false;
        for (size_t i = 0; i < n; i++) {
            const bool is_match = m[i].is_match;
            if (is_match == prev_match && k > 0) {
                m[k - 1].end = m[i].end;
            } else {
                m[k++] = m[i];
            }
            prev_match = is_match;
        }
        break;
    }
    }
    for (size_t i = 0; i < k; i++) {
        const Err err =
            add_span2(e, base + m[i].start, m[i].end - m[i].start, first && m[i].start == 0);
        if (err) return err;
    }
    return ERR_OK;
}

// Append bytes to the word buffer; *off receives where they start.
static Err text_add(Enc *e, const char *s, size_t n, size_t *off)
{
    const size_t at = e->buf.n;
    const Err err = buf_add(&e->buf, s, n);
    if (!err) *off = at;
    return err;
}

// ---------------------------------------------------------------------------
// Pre-tokenizers

static Err pre_split(Enc *e, const TokPre *p)
{
    for (size_t i = 0; i < e->n_spans; i++) {
        const Span sp = e->spans[i];
        Err err = regex_marks(e, p->re, e->buf.p + sp.off, sp.n);
        if (!err) err = apply_behavior(e, sp.off, sp.first, p->behavior, p->invert);
        if (err) return err;
    }
    return ERR_OK;
}

static Err pre_bytelevel(Enc *e, const TokPre *p)
{
    for (size_t i = 0; i < e->n_spans; i++) {
        Span sp = e->spans[i];
        Err err = ERR_OK;
        if (p->add_prefix_space && e->buf.p[sp.off] != ' ') {
            size_t off = 0;
            err = buf_reserve(&e->buf, sp.n + 1);  // so the copy's source stays put
            if (!err) err = text_add(e, " ", 1, &off);
            if (!err) err = text_add(e, e->buf.p + sp.off, sp.n, &sp.off);
            sp.off = off;
            sp.n += 1;
        }
        if (!err && p->re) {
            err = regex_marks(e, p->re, e->buf.p + sp.off, sp.n);
            if (!err) err = apply_behavior(e, sp.off, sp.first, TOK_SPLIT_ISOLATED, false);
        } else if (!err) {
            err = add_span2(e, sp.off, sp.n, sp.first);
        }
        if (err) return err;
    }
    return ERR_OK;
}

static Err pre_digits(Enc *e, const TokPre *p)
{
    for (size_t i = 0; i < e->n_spans; i++) {
        const Span sp = e->spans[i];
        Err err = pred_marks(e, is_numeric, e->buf.p + sp.off, sp.n);
        if (!err) {
            err = apply_behavior(e, sp.off, sp.first,
                                 p->individual_digits ? TOK_SPLIT_ISOLATED : TOK_SPLIT_CONTIGUOUS,
                                 false);
        }
        if (err) return err;
    }
    return ERR_OK;
}

static bool is_space_char(uint32_t c)
{
    return c == ' ';
}

static Err pre_whitespace_split(Enc *e)
{
    for (size_t i = 0; i < e->n_spans; i++) {
        const Span sp = e->spans[i];
        Err err = pred_marks(e, is_white_space, e->buf.p + sp.off, sp.n);
        if (!err) err = apply_behavior(e, sp.off, sp.first, TOK_SPLIT_REMOVED, false);
        if (err) return err;
    }
    return ERR_OK;
}

static Err pre_metaspace(Enc *e, const TokPre *p)
{
    for (size_t i = 0; i < e->n_spans; i++) {
        const Span sp = e->spans[i];
        // Rewrite: optional replacement prefix, then spaces replaced.
        Err err = buf_reserve(&e->buf, p->replacement_n * (sp.n + 1));
        if (err) return err;
        const size_t start = e->buf.n;
        const char *src = e->buf.p + sp.off;
        const bool starts_rep =
            sp.n >= p->replacement_n && memcmp(src, p->replacement, p->replacement_n) == 0;
        const bool starts_space = sp.n > 0 && src[0] == ' ';
        const bool prepend = !starts_rep && !starts_space
                             && (p->prepend_scheme == TOK_PREPEND_ALWAYS
                                 || (p->prepend_scheme == TOK_PREPEND_FIRST && sp.first));
        char *dst = e->buf.p + e->buf.n;
        size_t w = 0;
        if (prepend) {
            memcpy(dst, p->replacement, p->replacement_n);
            w += p->replacement_n;
        }
        for (size_t k = 0; k < sp.n; k++) {
            if (src[k] == ' ') {
                memcpy(dst + w, p->replacement, p->replacement_n);
                w += p->replacement_n;
            } else {
                dst[w++] = src[k];
            }
        }
        e->buf.n += w;
        e->buf.p[e->buf.n] = '\0';  // reserved above, as Buf keeps it
        if (!p->split) {
            err = add_span2(e, start, w, sp.first);
        } else {
            // Split on the replacement char, each one merged with what follows it.
            e->n_marks = 0;
            size_t last = 0;
            for (size_t k = 0; k < w;) {
                if (w - k >= p->replacement_n
                    && memcmp(e->buf.p + start + k, p->replacement, p->replacement_n) == 0) {
                    if (last < k) err = add_mark(e, last, k, false);
                    if (!err) err = add_mark(e, k, k + p->replacement_n, true);
                    k += p->replacement_n;
                    last = k;
                } else {
                    k++;
                }
                if (err) return err;
            }
            if (last < w) err = add_mark(e, last, w, false);
            if (!err && w == 0) err = add_mark(e, 0, 0, false);
            if (!err) err = apply_behavior(e, start, sp.first, TOK_SPLIT_MERGED_WITH_NEXT, false);
        }
        if (err) return err;
    }
    return ERR_OK;
}

static Err pre_tokenize(Enc *e)
{
    const Tokenizer *tok = e->tok;
    for (size_t k = 0; k < tok->n_pres; k++) {
        const TokPre *p = &tok->pres[k];
        e->n_spans2 = 0;
        Err err = ERR_OK;
        switch (p->kind) {
        case TOK_PRE_SPLIT:
            err = pre_split(e, p);
            break;
        case TOK_PRE_BYTELEVEL:
            err = pre_bytelevel(e, p);
            break;
        case TOK_PRE_DIGITS:
            err = pre_digits(e, p);
            break;
        case TOK_PRE_METASPACE:
            err = pre_metaspace(e, p);
            break;
        case TOK_PRE_WHITESPACE: {
            const TokPre ws = {
                .kind = TOK_PRE_SPLIT, .re = p->re, .behavior = TOK_SPLIT_REMOVED, .invert = true};
            err = pre_split(e, &ws);
            break;
        }
        case TOK_PRE_WHITESPACE_SPLIT:
            err = pre_whitespace_split(e);
            break;
        }
        if (err) return err;
        Span *t = e->spans;
        e->spans = e->spans2;
        e->spans2 = t;
        size_t c = e->cap_spans;
        e->cap_spans = e->cap_spans2;
        e->cap_spans2 = c;
        e->n_spans = e->n_spans2;
    }
    (void) is_space_char;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// BPE

static bool heap_less(const HeapItem *a, const HeapItem *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(HeapItem *h, size_t *n, HeapItem it)
{
    size_t i = (*n)++;
    while (i > 0) {
        const size_t parent = (i - 1) / 2;
        if (!heap_less(&it, &h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = it;
}

static HeapItem heap_pop(HeapItem *h, size_t *n)
{
    const HeapItem top = h[0];
    const HeapItem last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(&h[c + 1], &h[c])) c++;
        if (!heap_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) h[i] = last;
    return top;
}

typedef struct Word {
    Sym *syms;
    size_t n;
    int32_t unk_id, unk_len;  // pending unknown run (HF's `unk`), unk_id -1 when none
} Word;

static void word_add(Word *w, int32_t id, int32_t len)
{
    w->syms[w->n] = (Sym){id, (int32_t) w->n - 1, -1, len};
    if (w->n > 0) w->syms[w->n - 1].next = (int32_t) w->n;
    w->n++;
}

// One character (as the model sees it: with prefix/suffix) that the vocabulary may lack.
static void word_add_char(const Tokenizer *tok, Word *w, const char *s, size_t n, int32_t id,
                          int32_t byte_len)
{
    if (id >= 0) {
        if (w->unk_id >= 0) {
            word_add(w, w->unk_id, w->unk_len);
            w->unk_id = -1;
        }
        word_add(w, id, byte_len);
        return;
    }
    if (tok->byte_fallback) {
        bool all = true;
        for (size_t i = 0; i < n && all; i++)
            all = tok->byte_fallback_id[(uint8_t) s[i]] >= 0;
        if (all) {
            // HF adds byte tokens without flushing a pending unk first; so do we.
            for (size_t i = 0; i < n; i++)
                word_add(w, tok->byte_fallback_id[(uint8_t) s[i]], 1);
            return;
        }
    }
    if (tok->unk_id < 0) return;  // no unk token: the char is dropped, as in HF
    if (w->unk_id >= 0 && tok->fuse_unk) {
        w->unk_len += byte_len;
        return;
    }
    if (w->unk_id >= 0) word_add(w, w->unk_id, w->unk_len);
    w->unk_id = tok->unk_id;
    w->unk_len = byte_len;
}

static Err cache_put(TokCache *c, const char *s, size_t n, const int32_t *ids, size_t k);

static Err bpe_word(Enc *e, const char *s, size_t n)
{
    const Tokenizer *tok = e->tok;
    TokCache *cache = (TokCache *) &tok->cache;  // guarded by cache_mu, held when use_cache
    if (e->use_cache && n <= CACHE_MAX_WORD) {
        const int32_t idx = tok_strmap_get(&cache->map, &cache->words, s, n);
        if (idx >= 0) {
            const uint64_t span = cache->spans[idx];
            const size_t k = (size_t) (span & 0xFFFF);
            if (k == 0) return ERR_OK;  // a word of dropped chars (no unk token)
            const int32_t *ids = cache->ids + (span >> 16);
            Err err = grow((void **) &e->out->ids, &e->out->cap, e->out->n + k, sizeof(int32_t));
            if (err) return err;
            memcpy(e->out->ids + e->out->n, ids, k * sizeof *ids);
            e->out->n += k;
            return ERR_OK;
        }
    }
    if (tok->ignore_merges) {
        const int32_t id = tok->byte_level ? tok_strmap_get(&tok->raw_vocab, &tok->pool, s, n)
                                           : tok_strmap_get(&tok->vocab, &tok->pool, s, n);
        if (id >= 0) return push_id(e->out, id);
    }
    // Build the symbols: at most one per byte (byte fallback can give one per byte too).
    Err err = grow((void **) &e->syms, &e->cap_syms, n + 1, sizeof *e->syms);
    if (err) return err;
    Word w = {e->syms, 0, -1, 0};
    if (tok->byte_level && !tok->prefix && !tok->suffix) {
        for (size_t i = 0; i < n; i++) {
            const int32_t id = tok->byte_id[(uint8_t) s[i]];
            if (id >= 0 && w.unk_id < 0) {
                word_add(&w, id, 1);
            } else {
                char ch[4];
                const size_t len = utf8_encode(tok_bytelevel_char((uint8_t) s[i]), ch);
                word_add_char(tok, &w, ch, len, id, 1);
            }
        }
    } else {
        // Chars as strings, with the subword prefix on all but the first and the suffix on
        // the last; byte-level chars are mapped first.
        char tmp[64];
        for (size_t i = 0; i < n;) {
            size_t len;
            char_at(s, n, i, &len);
            if (tok->byte_level) len = 1;
            const bool is_first = i == 0, is_last = i + len == n;
            size_t k = 0;
            if (!is_first && tok->prefix && tok->prefix_n < 32) {
                memcpy(tmp, tok->prefix, tok->prefix_n);
                k = tok->prefix_n;
            }
            if (tok->byte_level) {
                k += utf8_encode(tok_bytelevel_char((uint8_t) s[i]), tmp + k);
            } else {
                memcpy(tmp + k, s + i, len);
                k += len;
            }
            if (is_last && tok->suffix && tok->suffix_n < 24) {
                memcpy(tmp + k, tok->suffix, tok->suffix_n);
                k += tok->suffix_n;
            }
            const int32_t id = tok_strmap_get(&tok->vocab, &tok->pool, tmp, k);
            word_add_char(tok, &w, tmp, k, id, (int32_t) len);
            i += len;
        }
    }
    if (w.unk_id >= 0) word_add(&w, w.unk_id, w.unk_len);

    // Merge by rank with a heap of candidate pairs.
    Sym *sy = w.syms;
    if (w.n > 1) {
        err = grow((void **) &e->heap, &e->cap_heap, 2 * w.n + 2, sizeof *e->heap);
        if (err) return err;
        HeapItem *h = e->heap;
        size_t nh = 0;
        for (size_t i = 0; i + 1 < w.n; i++) {
            const uint64_t m = tok_merge_get(&tok->merges, sy[i].id, sy[i + 1].id);
            if (m != UINT64_MAX)
                heap_push(h, &nh,
                          (HeapItem){(uint32_t) (m >> 32), (uint32_t) i, (int32_t) (uint32_t) m});
        }
        while (nh > 0) {
            const HeapItem top = heap_pop(h, &nh);
            Sym *a = &sy[top.pos];
            if (a->len == 0 || a->next < 0) continue;
            Sym *b = &sy[a->next];
            const uint64_t m = tok_merge_get(&tok->merges, a->id, b->id);
            if (m == UINT64_MAX || (int32_t) (uint32_t) m != top.id
                || (uint32_t) (m >> 32) != top.rank) {
                continue;  // stale: one side was merged since this pair was queued
            }
            a->id = top.id;
            a->len += b->len;
            a->next = b->next;
            b->len = 0;
            if (a->next >= 0) sy[a->next].prev = (int32_t) top.pos;
            // The heap never holds more than one entry per live pair plus stale ones; each
            // merge adds at most two, so 2n bounds it.
            if (nh + 2 > e->cap_heap) {
                err = grow((void **) &e->heap, &e->cap_heap, nh + 2, sizeof *e->heap);
                if (err) return err;
                h = e->heap;
            }
            if (a->prev >= 0) {
                const uint64_t mp = tok_merge_get(&tok->merges, sy[a->prev].id, a->id);
                if (mp != UINT64_MAX)
                    heap_push(h, &nh,
                              (HeapItem){(uint32_t) (mp >> 32), (uint32_t) a->prev,
                                         (int32_t) (uint32_t) mp});
            }
            if (a->next >= 0) {
                const uint64_t mn = tok_merge_get(&tok->merges, a->id, sy[a->next].id);
                if (mn != UINT64_MAX)
                    heap_push(h, &nh,
                              (HeapItem){(uint32_t) (mn >> 32), top.pos, (int32_t) (uint32_t) mn});
            }
        }
    }
    const size_t start = e->out->n;
    for (int32_t i = w.n ? 0 : -1; i >= 0; i = sy[i].next) {
        err = push_id(e->out, sy[i].id);
        if (err) return err;
    }
    if (e->use_cache && n <= CACHE_MAX_WORD) {
        const size_t k = e->out->n - start;
        err = cache_put(cache, s, n, k ? e->out->ids + start : NULL, k);
        if (err) return err;
    }
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Word cache

void tok_cache_free(TokCache *c)
{
    tok_strmap_free(&c->map);
    buf_free(&c->words);
    free(c->spans);
    free(c->ids);
    memset(c, 0, sizeof *c);
}

static Err cache_put(TokCache *c, const char *s, size_t n, const int32_t *ids, size_t k)
{
    if (k > 0xFFFF) return ERR_OK;
    if (c->map.n >= CACHE_MAX_WORDS || c->n_ids + k > CACHE_MAX_IDS) {
        // Clear rather than evict: cheap, and a working set this large gains little anyway.
        memset(c->map.slots, 0, c->map.cap * sizeof *c->map.slots);
        c->map.n = 0;
        buf_clear(&c->words);
        c->n_ids = 0;
    }
    Err err = grow((void **) &c->ids, &c->cap_ids, c->n_ids + k, sizeof *c->ids);
    if (!err) err = grow((void **) &c->spans, &c->cap_spans, c->map.n + 1, sizeof *c->spans);
    if (err) return err;
    const size_t e = c->map.n;
    err = tok_strmap_put(&c->map, &c->words, s, n, (int32_t) e);
    if (err) return err;
    if (k) memcpy(c->ids + c->n_ids, ids, k * sizeof *ids);
    c->spans[e] = (uint64_t) c->n_ids << 16 | k;
    c->n_ids += k;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Normalizers

static Err norm_replace(Enc *e, const TokNorm *nm, const char *s, size_t n, char **out,
                        size_t *out_n)
{
    Buf d = {0};
    const Err err = tok_regex_replace(nm->re, e->md, s, n, nm->content, nm->content_n, &d);
    if (err) {
        buf_free(&d);
        return err;
    }
    size_t w;
    char *res = buf_take(&d, &w);
    if (!res) return ERR_NOMEM;
    *out = res;
    *out_n = w;
    return ERR_OK;
}

static Err norm_one(Enc *e, const TokNorm *nm, const char *s, size_t n, char **out, size_t *out_n)
{
    *out = NULL;
    switch (nm->kind) {
    case TOK_NORM_NFC:
    case TOK_NORM_NFD:
    case TOK_NORM_NFKC:
    case TOK_NORM_NFKD: {
        bool ascii = true;
        for (size_t i = 0; i < n && ascii; i++)
            ascii = (uint8_t) s[i] < 0x80;
        if (ascii) return ERR_OK;  // every normal form of ASCII is itself
        int opts = UTF8PROC_STABLE;
        opts |= (nm->kind == TOK_NORM_NFC || nm->kind == TOK_NORM_NFKC) ? UTF8PROC_COMPOSE
                                                                        : UTF8PROC_DECOMPOSE;
        if (nm->kind == TOK_NORM_NFKC || nm->kind == TOK_NORM_NFKD) opts |= UTF8PROC_COMPAT;
        utf8proc_uint8_t *dst = NULL;
        const utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *) s, (utf8proc_ssize_t) n,
                                                &dst, (utf8proc_option_t) opts);
        if (r < 0) {
            LOG_ERROR("could not normalize %zu bytes: %s", n, utf8proc_errmsg(r));
            return r == UTF8PROC_ERROR_NOMEM ? ERR_NOMEM : ERR_INVAL;
        }
        *out = (char *) dst;
        *out_n = (size_t) r;
        return ERR_OK;
    }
    case TOK_NORM_LOWERCASE: {
        char *d = malloc(3 * n + 1);  // U+0130 (2 bytes) lowers to 3 bytes; nothing grows more
        if (!d) return ERR_NOMEM;
        size_t w = 0;
        for (size_t i = 0; i < n;) {
            size_t len;
            const uint32_t c = char_at(s, n, i, &len);
            if (c == 0x130) {
                memcpy(d + w, "i\xCC\x87", 3);  // Rust: U+0130 -> "i\u0307"
                w += 3;
            } else {
                w += utf8_encode((uint32_t) utf8proc_tolower((utf8proc_int32_t) c), d + w);
            }
            i += len;
        }
        d[w] = '\0';
        *out = d;
        *out_n = w;
        return ERR_OK;
    }
    case TOK_NORM_REPLACE:
        return norm_replace(e, nm, s, n, out, out_n);
    case TOK_NORM_PREPEND: {
        if (n == 0) return ERR_OK;
        char *d = malloc(n + nm->content_n + 1);
        if (!d) return ERR_NOMEM;
        memcpy(d, nm->content, nm->content_n);
        memcpy(d + nm->content_n, s, n);
        d[n + nm->content_n] = '\0';
        *out = d;
        *out_n = n + nm->content_n;
        return ERR_OK;
    }
    case TOK_NORM_STRIP: {
        size_t a = 0, b = n, len;
        while (nm->left && a < b && is_white_space(char_at(s, n, a, &len)))
            a += len;
        while (nm->right && b > a && is_white_space(char_before(s, b, &len)))
            b -= len;
        char *d = malloc(b - a + 1);
        if (!d) return ERR_NOMEM;
        memcpy(d, s + a, b - a);
        d[b - a] = '\0';
        *out = d;
        *out_n = b - a;
        return ERR_OK;
    }
    }
    return ERR_INVAL;
}

// Apply every normalizer; *out is a new malloc'd string (possibly a copy of s).
static Err normalize(Enc *e, const char *s, size_t n, char **out, size_t *out_n)
{
    char *cur = malloc(n + 1);
    if (!cur) return ERR_NOMEM;
    memcpy(cur, s, n);
    cur[n] = '\0';
    size_t cur_n = n;
    for (size_t k = 0; k < e->tok->n_norms; k++) {
        char *next = NULL;
        size_t next_n = 0;
        const Err err = norm_one(e, &e->tok->norms[k], cur, cur_n, &next, &next_n);
        if (err) {
            free(cur);
            return err;
        }
        if (next) {
            free(cur);
            cur = next;
            cur_n = next_n;
        }
    }
    *out = cur;
    *out_n = cur_n;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Added tokens

static Err add_seg(Seg **segs, size_t *n, size_t *cap, Seg s)
{
    const Err err = grow((void **) segs, cap, *n + 1, sizeof **segs);
    if (err) return err;
    (*segs)[(*n)++] = s;
    return ERR_OK;
}

// HF AddedVocabulary::find_matches: segments covering s[0..n), added tokens marked.
static Err find_added(const Tokenizer *tok, const TokTrie *trie, const char *s, size_t n,
                      Seg **segs, size_t *n_segs, size_t *cap_segs)
{
    *n_segs = 0;
    size_t start_offset = 0;
    for (size_t i = 0; trie->n && i < n;) {
        if (!trie->first_byte[(uint8_t) s[i]]) {
            i++;
            continue;
        }
        // Longest token starting at i.
        int32_t node = 0, best = -1;
        size_t best_end = 0;
        for (size_t j = i; j < n; j++) {
            int32_t k = trie->nodes[node].child;
            while (k >= 0 && trie->nodes[k].byte != (uint8_t) s[j])
                k = trie->nodes[k].sibling;
            if (k < 0) break;
            node = k;
            if (trie->nodes[k].added >= 0) {
                best = trie->nodes[k].added;
                best_end = j + 1;
            }
        }
        if (best < 0) {
            i++;
            continue;
        }
        const TokAdded *t = &tok->added[best];
        size_t start = i, stop = best_end, len;
        i = best_end;  // the matcher resumes after this match even when it is discarded
        if (t->single_word) {
            const bool start_space = start == 0 || !is_word_char(char_before(s, start, &len));
            const bool stop_space = stop == n || !is_word_char(char_at(s, n, stop, &len));
            if (!start_space || !stop_space) continue;
        }
        if (t->lstrip) {
            size_t ns = start;
            while (ns > 0 && is_white_space(char_before(s, ns, &len)))
                ns -= len;
            start = ns > start_offset ? ns : start_offset;
        }
        if (t->rstrip) {
            while (stop < n && is_white_space(char_at(s, n, stop, &len)))
                stop += len;
            i = stop;
        }
        Err err = ERR_OK;
        if (start_offset < start)
            err = add_seg(segs, n_segs, cap_segs, (Seg){start_offset, start, -1});
        if (!err) err = add_seg(segs, n_segs, cap_segs, (Seg){start, stop, best});
        if (err) return err;
        start_offset = stop;
    }
    if (start_offset != n || n == 0) {
        return add_seg(segs, n_segs, cap_segs, (Seg){start_offset, n, -1});
    }
    return ERR_OK;
}

// Pre-tokenize and BPE one normalized piece with no added tokens in it.
static Err encode_words(Enc *e, const char *s, size_t n, bool first)
{
    if (n == 0) return ERR_OK;
    buf_clear(&e->buf);
    e->n_spans = 0;
    size_t off;
    Err err = text_add(e, s, n, &off);
    if (!err) err = grow((void **) &e->spans, &e->cap_spans, 1, sizeof *e->spans);
    if (err) return err;
    e->spans[e->n_spans++] = (Span){off, n, first};
    err = pre_tokenize(e);
    for (size_t i = 0; !err && i < e->n_spans; i++) {
        err = bpe_word(e, e->buf.p + e->spans[i].off, e->spans[i].n);
    }
    return err;
}

// Normalize a raw piece, split it on normalized added tokens, encode the rest.
static Err encode_piece(Enc *e, const char *s, size_t n, bool first)
{
    const Tokenizer *tok = e->tok;
    char *norm = NULL;
    size_t nn = 0;
    Seg *segs = NULL;
    size_t n_segs = 0, cap_segs = 0;
    Err err = ERR_OK;
    if (tok->n_norms) {
        err = normalize(e, s, n, &norm, &nn);
        if (err) goto done;
        s = norm;
        n = nn;
    }
    if (!tok->has_norm_added) {
        err = encode_words(e, s, n, first);
        goto done;
    }
    err = find_added(tok, &tok->trie_norm, s, n, &segs, &n_segs, &cap_segs);
    for (size_t i = 0; !err && i < n_segs; i++) {
        if (segs[i].added >= 0) {
            err = push_id(e->out, tok->added[segs[i].added].id);
        } else {
            err = encode_words(e, s + segs[i].start, segs[i].end - segs[i].start,
                               first && segs[i].start == 0);
        }
    }
done:
    free(norm);
    free(segs);
    return err;
}

// ---------------------------------------------------------------------------
// Entry point

Err tok_normalize(const Tokenizer *tok, const char *s, size_t n, char **out, size_t *out_n)
{
    Enc e = {.tok = tok};
    e.md = pcre2_match_data_create(1, NULL);
    if (!e.md) return ERR_NOMEM;
    const Err err = normalize(&e, s, n, out, out_n);
    pcre2_match_data_free(e.md);
    return err;
}

Err tok_encode(const Tokenizer *tok, const char *text, size_t n_bytes, bool add_special,
               TokIds *out)
{
    const size_t n0 = out->n;
    char *fixed = NULL;
    Seg *segs = NULL;
    size_t n_segs = 0, cap_segs = 0;
    Enc e = {.tok = tok, .out = out};
    Err err = ERR_OK;
    if (utf8_valid_prefix((const uint8_t *) text, n_bytes) != n_bytes) {
        size_t n_fixed;
        err = utf8_lossy((const uint8_t *) text, n_bytes, &fixed, &n_fixed);
        if (err) goto done;
        text = fixed;
        n_bytes = n_fixed;
    }
    e.md = pcre2_match_data_create(1, NULL);
    if (!e.md) {
        err = ERR_NOMEM;
        goto done;
    }
    e.use_cache = pthread_mutex_trylock((pthread_mutex_t *) &tok->cache_mu) == 0;
    if (add_special) {
        for (size_t i = 0; i < tok->n_prefix_ids && !err; i++)
            err = push_id(out, tok->prefix_ids[i]);
    }
    if (!err) err = find_added(tok, &tok->trie_raw, text, n_bytes, &segs, &n_segs, &cap_segs);
    for (size_t i = 0; !err && i < n_segs; i++) {
        if (segs[i].added >= 0) {
            err = push_id(out, tok->added[segs[i].added].id);
        } else if (segs[i].end > segs[i].start) {
            err = encode_piece(&e, text + segs[i].start, segs[i].end - segs[i].start,
                               segs[i].start == 0);
        }
    }
    if (add_special) {
        for (size_t i = 0; i < tok->n_suffix_ids && !err; i++)
            err = push_id(out, tok->suffix_ids[i]);
    }
    if (e.use_cache) pthread_mutex_unlock((pthread_mutex_t *) &tok->cache_mu);
done:
    if (err) out->n = n0;
    pcre2_match_data_free(e.md);
    buf_free(&e.buf);
    free(e.spans);
    free(e.spans2);
    free(e.marks);
    free(e.syms);
    free(e.heap);
    free(segs);
    free(fixed);
    return err;
}
