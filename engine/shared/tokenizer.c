/*
 * tokenizer.c - load a Hugging Face tokenizer.json into a Tokenizer; lookups; hash tables.
 *
 * Loading walks the JSON once with json-c and turns each component into the flat tables of
 * tok_internal.h. Every field is type-checked: a field of the wrong JSON type is ERR_FORMAT,
 * a component or option we do not implement is ERR_INVAL, and both are logged with the JSON
 * path (e.g. "pre_tokenizer.pretokenizers[1].type") so that a user sees which part of their
 * file we reject. Nothing is half-supported silently: a BPE option we ignore (dropout) must
 * be null.
 */
#include "engine/shared/tokenizer.h"

#include <errno.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"
#include "engine/shared/tok_internal.h"
#include "engine/shared/utf8.h"

// ---------------------------------------------------------------------------
// Pools and hash maps

uint64_t tok_hash(const void *s, size_t n)
{
    // 8 bytes per step with a multiply-xorshift mix: fast on short words, good enough spread.
    const uint8_t *p = s;
    uint64_t h = 0x243F6A8885A308D3ull ^ (n * 0x9E3779B97F4A7C15ull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    for (size_t i = 0; i < n; i++)
        w |= (uint64_t) p[i] << (8 * i);
    h = (h ^ w) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return h;
}

Err tok_pool_add(TokPool *pool, const char *s, size_t n, size_t *off)
{
    // One reservation for the string and its NUL, so a failed add leaves the pool as it was;
    // and usable, not sticky: the encoder's word cache goes on after a failed put.
    if (buf_reserve(pool, n + 1)) {
        pool->is_oom = false;
        return ERR_NOMEM;
    }
    *off = pool->n;
    buf_add(pool, s, n);
    buf_add(pool, "", 1);
    return ERR_OK;
}

const char *tok_strmap_key(const TokStrMap *m, const TokPool *pool, size_t i, size_t *n)
{
    *n = (size_t) (m->off_len[i] & 0xFFFFFF);
    return pool->p + (m->off_len[i] >> 24);
}

static size_t strmap_find(const TokStrMap *m, const TokPool *pool, const char *s, size_t n,
                          uint64_t h, bool *found)
{
    size_t i = (size_t) h & (m->cap - 1);
    for (;;) {
        const uint32_t e = m->slots[i];
        if (e == 0) {
            *found = false;
            return i;
        }
        const uint64_t ol = m->off_len[e - 1];
        if ((ol & 0xFFFFFF) == n && memcmp(pool->p + (ol >> 24), s, n) == 0) {
            *found = true;
            return i;
        }
        i = (i + 1) & (m->cap - 1);
    }
}

static Err strmap_grow(TokStrMap *m, const TokPool *pool)
{
    const size_t cap = m->cap ? m->cap * 2 : 1024;
    uint32_t *slots = calloc(cap, sizeof *slots);
    if (!slots) return ERR_NOMEM;
    for (size_t e = 0; e < m->n; e++) {
        size_t n;
        const char *s = tok_strmap_key(m, pool, e, &n);
        size_t i = (size_t) tok_hash(s, n) & (cap - 1);
        while (slots[i])
            i = (i + 1) & (cap - 1);
        slots[i] = (uint32_t) e + 1;
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    return ERR_OK;
}

Err tok_strmap_put(TokStrMap *m, TokPool *pool, const char *s, size_t n, int32_t val)
{
    if (n >= (1u << 24)) return ERR_INVAL;
    if (2 * (m->n + 1) > m->cap) {
        const Err err = strmap_grow(m, pool);
        if (err) return err;
    }
    bool found;
    const size_t i = strmap_find(m, pool, s, n, tok_hash(s, n), &found);
    if (found) {
        m->vals[m->slots[i] - 1] = val;
        return ERR_OK;
    }
    if (m->n == m->n_alloc) {
        const size_t na = m->n_alloc ? m->n_alloc * 2 : 1024;
        uint64_t *ol = realloc(m->off_len, na * sizeof *ol);
        if (!ol) return ERR_NOMEM;
        m->off_len = ol;
        int32_t *vals = realloc(m->vals, na * sizeof *vals);
        if (!vals) return ERR_NOMEM;
        m->vals = vals;
        m->n_alloc = na;
    }
    size_t off;
    const Err err = tok_pool_add(pool, s, n, &off);
    if (err) return err;
    if (off >= (1ull << 40)) return ERR_NOMEM;
    m->off_len[m->n] = (uint64_t) off << 24 | n;
    m->vals[m->n] = val;
    m->slots[i] = (uint32_t) ++m->n;
    return ERR_OK;
}

int32_t tok_strmap_get(const TokStrMap *m, const TokPool *pool, const char *s, size_t n)
{
    if (!m->cap) return -1;
    bool found;
    const size_t i = strmap_find(m, pool, s, n, tok_hash(s, n), &found);
    return found ? m->vals[m->slots[i] - 1] : -1;
}

void tok_strmap_free(TokStrMap *m)
{
    free(m->slots);
    free(m->off_len);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

static Err merge_put(TokMergeMap *m, int32_t a, int32_t b, uint32_t rank, int32_t id)
{
    if (2 * (m->n + 1) > m->cap) {
        const size_t cap = m->cap ? m->cap * 2 : 4096;
        uint64_t *kv = calloc(2 * cap, sizeof *kv);
        if (!kv) return ERR_NOMEM;
        for (size_t j = 0; j < m->cap; j++) {
            const uint64_t k = m->kv[2 * j];
            if (!k) continue;
            size_t i = (size_t) ((k * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
            while (kv[2 * i])
                i = (i + 1) & (cap - 1);
            kv[2 * i] = k;
            kv[2 * i + 1] = m->kv[2 * j + 1];
        }
        free(m->kv);
        m->kv = kv;
        m->cap = cap;
    }
    const uint64_t key = ((uint64_t) (uint32_t) (a + 1) << 32) | (uint32_t) b;
    size_t i = (size_t) ((key * 0x9E3779B97F4A7C15ull) >> 20) & (m->cap - 1);
    while (m->kv[2 * i] && m->kv[2 * i] != key)
        i = (i + 1) & (m->cap - 1);
    if (m->kv[2 * i]) return ERR_OK;  // HF keeps the first (lowest) rank of a repeated merge
    m->kv[2 * i] = key;
    m->kv[2 * i + 1] = (uint64_t) rank << 32 | (uint32_t) id;
    m->n++;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Byte-level alphabet (GPT-2): printable Latin-1 bytes stand for themselves, the other 68
// bytes map to U+0100.. in byte order.

static bool bytelevel_printable(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t tok_bytelevel_char(uint8_t b)
{
    if (bytelevel_printable(b)) return b;
    uint32_t k = 0;
    for (unsigned i = 0; i < b; i++)
        k += !bytelevel_printable(i);
    return 0x100 + k;
}

int tok_bytelevel_byte(uint32_t cp)
{
    if (cp < 0x100) return bytelevel_printable(cp) ? (int) cp : -1;
    if (cp >= 0x100 + 68) return -1;
    uint32_t k = 0;
    for (unsigned b = 0; b < 256; b++) {
        if (bytelevel_printable(b)) continue;
        if (k++ == cp - 0x100) return (int) b;
    }
    return -1;
}

// ---------------------------------------------------------------------------
// Regexes

Err tok_regex_compile(const char *pattern, size_t n, bool literal, const char *path,
                      pcre2_code **out)
{
    int code;
    PCRE2_SIZE at;
    const uint32_t opts = literal ? PCRE2_LITERAL | PCRE2_UTF : PCRE2_UTF | PCRE2_UCP;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR) pattern, n, opts, &code, &at, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        LOG_ERROR("tokenizer.json: %s: could not compile regex at offset %zu: %s", path,
                  (size_t) at, (const char *) msg);
        return ERR_INVAL;
    }
    // JIT is an optimisation: where it is unavailable, pcre2_match interprets the pattern.
    (void) pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return ERR_OK;
}

int tok_regex_next(const pcre2_code *re, pcre2_match_data *md, const char *s, size_t n, size_t *pos,
                   size_t *ms, size_t *me)
{
    if (*pos > n) return 0;
    int rc = pcre2_match(re, (PCRE2_SPTR) s, n, *pos, PCRE2_NO_UTF_CHECK, md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
        // The interpreter keeps its backtracking on the heap: slower, never out of stack.
        rc = pcre2_match(re, (PCRE2_SPTR) s, n, *pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
    }
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        LOG_ERROR("could not match a tokenizer regex over %zu bytes: %s", n, (const char *) msg);
        return -1;
    }
    const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    *ms = ov[0];
    *me = ov[1];
    if (*me > *ms) {
        *pos = *me;
    } else if (*me >= n) {
        *pos = n + 1;  // an empty match at the end: nothing follows
    } else {
        // An empty match: step over one character so the search moves on.
        const size_t len = utf8_char_len((const uint8_t *) s + *me, n - *me);
        *pos = *me + (len ? len : 1);  // 0: unreachable on repaired input; keeps loops finite
    }
    return 1;
}

Err tok_regex_replace(const pcre2_code *re, pcre2_match_data *md, const char *s, size_t n,
                      const char *content, size_t content_n, Buf *out)
{
    size_t pos = 0, prev = 0, ms, me;
    int rc;
    while ((rc = tok_regex_next(re, md, s, n, &pos, &ms, &me)) > 0) {
        buf_add(out, s + prev, ms - prev);
        buf_add(out, content, content_n);
        prev = me;
    }
    if (rc < 0) return ERR_INVAL;
    return buf_add(out, s + prev, n - prev);
}

// ---------------------------------------------------------------------------
// JSON helpers. Each takes the path of the object for messages.

typedef struct Path {
    char s[256];
} Path;

static Path path_join(const Path *base, const char *field)
{
    Path p;
    // A path cut at 255 bytes still names the place; the return value says if it was.
    if (snprintf(p.s, sizeof p.s, "%s%s%s", base->s, base->s[0] ? "." : "", field) < 0) {
        p.s[0] = '\0';
    }
    return p;
}

static Path path_index(const Path *base, const char *field, size_t i)
{
    Path p;
    if (snprintf(p.s, sizeof p.s, "%s%s%s[%zu]", base->s, base->s[0] ? "." : "", field, i) < 0) {
        p.s[0] = '\0';
    }
    return p;
}

static const char *json_type_str(json_type t)
{
    return json_type_to_name(t);
}

// Field key of obj with the given JSON type. Missing or null: *out = NULL, ok unless required.
static Err get_field(json_object *obj, const Path *path, const char *key, json_type type,
                     bool required, json_object **out)
{
    *out = NULL;
    json_object *v = NULL;
    if (!json_object_object_get_ex(obj, key, &v) || json_object_get_type(v) == json_type_null) {
        if (!required) return ERR_OK;
        LOG_ERROR("tokenizer.json: %s: missing field", path_join(path, key).s);
        return ERR_FORMAT;
    }
    json_type t = json_object_get_type(v);
    const bool ok = t == type || (type == json_type_double && t == json_type_int);
    if (!ok) {
        LOG_ERROR("tokenizer.json: %s: expected %s, got %s", path_join(path, key).s,
                  json_type_str(type), json_type_str(t));
        return ERR_FORMAT;
    }
    *out = v;
    return ERR_OK;
}

static Err get_bool(json_object *obj, const Path *path, const char *key, bool dflt, bool *out)
{
    json_object *v;
    const Err err = get_field(obj, path, key, json_type_boolean, false, &v);
    if (err) return err;
    *out = v ? json_object_get_boolean(v) : dflt;
    return ERR_OK;
}

static Err get_str(json_object *obj, const Path *path, const char *key, bool required,
                   const char **s, size_t *n)
{
    json_object *v;
    const Err err = get_field(obj, path, key, json_type_string, required, &v);
    if (err) return err;
    *s = v ? json_object_get_string(v) : NULL;
    *n = v ? (size_t) json_object_get_string_len(v) : 0;
    return ERR_OK;
}

static Err get_size(json_object *obj, const Path *path, const char *key, size_t dflt, size_t *out)
{
    json_object *v;
    const Err err = get_field(obj, path, key, json_type_int, false, &v);
    if (err) return err;
    if (!v) {
        *out = dflt;
        return ERR_OK;
    }
    const int64_t x = json_object_get_int64(v);
    if (x < 0 || x > INT32_MAX) {
        LOG_ERROR("tokenizer.json: %s: %lld is out of range", path_join(path, key).s,
                  (long long) x);
        return ERR_FORMAT;
    }
    *out = (size_t) x;
    return ERR_OK;
}

static Err unsupported(const Path *path, const char *what, const char *value)
{
    LOG_ERROR("tokenizer.json: %s: unsupported %s \"%s\"", path->s, what, value);
    return ERR_INVAL;
}

static Err dup_str(const char *s, size_t n, char **out)
{
    char *d = malloc(n + 1);
    if (!d) return ERR_NOMEM;
    memcpy(d, s, n);
    d[n] = '\0';
    *out = d;
    return ERR_OK;
}

// A pattern object {"String": s} or {"Regex": r}.
static Err load_pattern(json_object *obj, const Path *path, const char *key, pcre2_code **re)
{
    json_object *pat;
    Err err = get_field(obj, path, key, json_type_object, true, &pat);
    if (err) return err;
    const Path pp = path_join(path, key);
    const char *s;
    size_t n;
    err = get_str(pat, &pp, "String", false, &s, &n);
    if (err) return err;
    if (s) return tok_regex_compile(s, n, true, pp.s, re);
    err = get_str(pat, &pp, "Regex", false, &s, &n);
    if (err) return err;
    if (s) return tok_regex_compile(s, n, false, path_join(&pp, "Regex").s, re);
    LOG_ERROR("tokenizer.json: %s: expected a String or Regex pattern", pp.s);
    return ERR_FORMAT;
}

// ---------------------------------------------------------------------------
// Normalizers

static Err push_item(void **arr, size_t *n, size_t size)
{
    void *a = realloc(*arr, (*n + 1) * size);
    if (!a) return ERR_NOMEM;
    memset((char *) a + *n * size, 0, size);
    *arr = a;
    (*n)++;
    return ERR_OK;
}

// A pipeline component (normalizer, pre-tokenizer, decoder, post-processor) is an object with
// a "type". Writes the type to *type; an error names the path.
static Err component_type(json_object *obj, const Path *path, const char **type)
{
    if (json_object_get_type(obj) != json_type_object) {
        LOG_ERROR("tokenizer.json: %s: expected object", path->s);
        return ERR_FORMAT;
    }
    size_t type_n;
    return get_str(obj, path, "type", true, type, &type_n);
}

typedef Err (*ComponentLoader)(Tokenizer *tok, json_object *obj, const Path *path);

// Load each element of the array obj[key] (a "Sequence" component) with load, in order.
static Err load_sequence(Tokenizer *tok, json_object *obj, const Path *path, const char *key,
                         ComponentLoader load)
{
    json_object *list;
    Err err = get_field(obj, path, key, json_type_array, true, &list);
    for (size_t i = 0; !err && i < json_object_array_length(list); i++) {
        const Path ip = path_index(path, key, i);
        err = load(tok, json_object_array_get_idx(list, i), &ip);
    }
    return err;
}

static Err load_normalizer(Tokenizer *tok, json_object *obj, const Path *path)
{
    const char *type;
    Err err = component_type(obj, path, &type);
    if (err) return err;
    const Path tp = path_join(path, "type");
    if (strcmp(type, "Sequence") == 0) return load_sequence(tok, obj, path, "normalizers", load_normalizer);
    TokNorm norm = {0};
    if (strcmp(type, "NFC") == 0) {
        norm.kind = TOK_NORM_NFC;
    } else if (strcmp(type, "NFD") == 0) {
        norm.kind = TOK_NORM_NFD;
    } else if (strcmp(type, "NFKC") == 0) {
        norm.kind = TOK_NORM_NFKC;
    } else if (strcmp(type, "NFKD") == 0) {
        norm.kind = TOK_NORM_NFKD;
    } else if (strcmp(type, "Lowercase") == 0) {
        norm.kind = TOK_NORM_LOWERCASE;
    } else if (strcmp(type, "Replace") == 0) {
        norm.kind = TOK_NORM_REPLACE;
        const char *s;
        err = get_str(obj, path, "content", true, &s, &norm.content_n);
        if (!err) err = dup_str(s, norm.content_n, &norm.content);
        if (!err) err = load_pattern(obj, path, "pattern", &norm.re);
    } else if (strcmp(type, "Prepend") == 0) {
        norm.kind = TOK_NORM_PREPEND;
        const char *s;
        err = get_str(obj, path, "prepend", true, &s, &norm.content_n);
        if (!err) err = dup_str(s, norm.content_n, &norm.content);
    } else if (strcmp(type, "Strip") == 0) {
        norm.kind = TOK_NORM_STRIP;
        err = get_bool(obj, path, "strip_left", true, &norm.left);
        if (!err) err = get_bool(obj, path, "strip_right", true, &norm.right);
    } else {
        return unsupported(&tp, "normalizer", type);
    }
    if (!err) err = push_item((void **) &tok->norms, &tok->n_norms, sizeof norm);
    if (err) {
        pcre2_code_free(norm.re);
        free(norm.content);
        return err;
    }
    tok->norms[tok->n_norms - 1] = norm;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Pre-tokenizers

// GPT-2's pattern, used by ByteLevel with use_regex (HF byte_level.rs).
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static Err load_replacement(json_object *obj, const Path *path, char *dst, size_t *n)
{
    const char *s;
    size_t len;
    Err err = get_str(obj, path, "replacement", true, &s, &len);
    if (err) return err;
    if (len == 0 || len > 4 || utf8_char_len((const uint8_t *) s, len) != len) {
        LOG_ERROR("tokenizer.json: %s: expected one character", path_join(path, "replacement").s);
        return ERR_FORMAT;
    }
    memcpy(dst, s, len);
    dst[len] = '\0';
    *n = len;
    return ERR_OK;
}

static Err load_prepend_scheme(json_object *obj, const Path *path, TokPrependScheme *out)
{
    const char *s;
    size_t n;
    Err err = get_str(obj, path, "prepend_scheme", false, &s, &n);
    if (err) return err;
    if (!s) {
        // Old files: add_prefix_space (default true) stands for always / never.
        bool add = true;
        err = get_bool(obj, path, "add_prefix_space", true, &add);
        *out = add ? TOK_PREPEND_ALWAYS : TOK_PREPEND_NEVER;
        return err;
    }
    if (strcmp(s, "always") == 0) {
        *out = TOK_PREPEND_ALWAYS;
    } else if (strcmp(s, "first") == 0) {
        *out = TOK_PREPEND_FIRST;
    } else if (strcmp(s, "never") == 0) {
        *out = TOK_PREPEND_NEVER;
    } else {
        const Path pp = path_join(path, "prepend_scheme");
        return unsupported(&pp, "prepend_scheme", s);
    }
    return ERR_OK;
}

static Err load_pre_tokenizer(Tokenizer *tok, json_object *obj, const Path *path)
{
    const char *type;
    Err err = component_type(obj, path, &type);
    if (err) return err;
    const Path tp = path_join(path, "type");
    if (strcmp(type, "Sequence") == 0) return load_sequence(tok, obj, path, "pretokenizers", load_pre_tokenizer);
    if (tok->byte_level) {
        // Our model step reads raw bytes and maps them itself, so nothing may follow ByteLevel.
        LOG_ERROR("tokenizer.json: %s: unsupported pre-tokenizer after ByteLevel", tp.s);
        return ERR_INVAL;
    }
    TokPre pre = {0};
    pre.behavior = TOK_SPLIT_ISOLATED;
    if (strcmp(type, "Split") == 0) {
        pre.kind = TOK_PRE_SPLIT;
        const char *b;
        size_t bn;
        err = load_pattern(obj, path, "pattern", &pre.re);
        if (!err) err = get_bool(obj, path, "invert", false, &pre.invert);
        if (!err) err = get_str(obj, path, "behavior", true, &b, &bn);
        if (!err) {
            if (strcmp(b, "Removed") == 0) {
                pre.behavior = TOK_SPLIT_REMOVED;
            } else if (strcmp(b, "Isolated") == 0) {
                pre.behavior = TOK_SPLIT_ISOLATED;
            } else if (strcmp(b, "MergedWithPrevious") == 0) {
                pre.behavior = TOK_SPLIT_MERGED_WITH_PREVIOUS;
            } else if (strcmp(b, "MergedWithNext") == 0) {
                pre.behavior = TOK_SPLIT_MERGED_WITH_NEXT;
            } else if (strcmp(b, "Contiguous") == 0) {
                pre.behavior = TOK_SPLIT_CONTIGUOUS;
            } else {
                const Path bp = path_join(path, "behavior");
                err = unsupported(&bp, "behavior", b);
            }
        }
    } else if (strcmp(type, "ByteLevel") == 0) {
        pre.kind = TOK_PRE_BYTELEVEL;
        bool use_regex;
        err = get_bool(obj, path, "add_prefix_space", true, &pre.add_prefix_space);
        if (!err) err = get_bool(obj, path, "use_regex", true, &use_regex);
        if (!err && use_regex) {
            err = tok_regex_compile(GPT2_PATTERN, sizeof GPT2_PATTERN - 1, false, tp.s, &pre.re);
        }
        tok->byte_level = true;
    } else if (strcmp(type, "Digits") == 0) {
        pre.kind = TOK_PRE_DIGITS;
        err = get_bool(obj, path, "individual_digits", false, &pre.individual_digits);
    } else if (strcmp(type, "Metaspace") == 0) {
        pre.kind = TOK_PRE_METASPACE;
        err = load_replacement(obj, path, pre.replacement, &pre.replacement_n);
        if (!err) err = load_prepend_scheme(obj, path, &pre.prepend_scheme);
        if (!err) err = get_bool(obj, path, "split", true, &pre.split);
    } else if (strcmp(type, "Whitespace") == 0) {
        pre.kind = TOK_PRE_WHITESPACE;
        static const char ws[] = "\\w+|[^\\w\\s]+";
        err = tok_regex_compile(ws, sizeof ws - 1, false, tp.s, &pre.re);
    } else if (strcmp(type, "WhitespaceSplit") == 0) {
        pre.kind = TOK_PRE_WHITESPACE_SPLIT;
    } else {
        return unsupported(&tp, "pre-tokenizer", type);
    }
    if (!err) err = push_item((void **) &tok->pres, &tok->n_pres, sizeof pre);
    if (err) {
        pcre2_code_free(pre.re);
        return err;
    }
    tok->pres[tok->n_pres - 1] = pre;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Decoders

static Err load_decoder(Tokenizer *tok, json_object *obj, const Path *path)
{
    const char *type;
    Err err = component_type(obj, path, &type);
    if (err) return err;
    const Path tp = path_join(path, "type");
    if (strcmp(type, "Sequence") == 0) return load_sequence(tok, obj, path, "decoders", load_decoder);
    TokDec dec = {0};
    if (strcmp(type, "ByteLevel") == 0) {
        dec.kind = TOK_DEC_BYTELEVEL;
    } else if (strcmp(type, "Replace") == 0) {
        dec.kind = TOK_DEC_REPLACE;
        const char *s;
        err = get_str(obj, path, "content", true, &s, &dec.content_n);
        if (!err) err = dup_str(s, dec.content_n, &dec.content);
        if (!err) err = load_pattern(obj, path, "pattern", &dec.re);
    } else if (strcmp(type, "Strip") == 0) {
        dec.kind = TOK_DEC_STRIP;
        const char *s;
        err = get_str(obj, path, "content", true, &s, &dec.content_n);
        if (!err
            && (dec.content_n == 0
                || utf8_char_len((const uint8_t *) s, dec.content_n) != dec.content_n)) {
            LOG_ERROR("tokenizer.json: %s: expected one character", path_join(path, "content").s);
            err = ERR_FORMAT;
        }
        if (!err) err = dup_str(s, dec.content_n, &dec.content);
        if (!err) err = get_size(obj, path, "start", 0, &dec.start);
        if (!err) err = get_size(obj, path, "stop", 0, &dec.stop);
    } else if (strcmp(type, "Fuse") == 0) {
        dec.kind = TOK_DEC_FUSE;
    } else if (strcmp(type, "ByteFallback") == 0) {
        dec.kind = TOK_DEC_BYTEFALLBACK;
    } else if (strcmp(type, "Metaspace") == 0) {
        dec.kind = TOK_DEC_METASPACE;
        char rep[5];
        TokPrependScheme scheme = TOK_PREPEND_ALWAYS;
        err = load_replacement(obj, path, rep, &dec.content_n);
        if (!err) err = dup_str(rep, dec.content_n, &dec.content);
        if (!err) err = load_prepend_scheme(obj, path, &scheme);
        dec.strip_first = scheme != TOK_PREPEND_NEVER;
    } else {
        return unsupported(&tp, "decoder", type);
    }
    if (!err) err = push_item((void **) &tok->decs, &tok->n_decs, sizeof dec);
    if (err) {
        pcre2_code_free(dec.re);
        free(dec.content);
        return err;
    }
    tok->decs[tok->n_decs - 1] = dec;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Model

static Err set_id_str(Tokenizer *tok, int32_t id, size_t off)
{
    if (id < 0) return ERR_FORMAT;
    if (id >= tok->n_vocab) {
        int32_t n = tok->n_vocab ? tok->n_vocab : 1024;
        while (n <= id)
            n *= 2;
        int32_t *s = realloc(tok->id_str, (size_t) n * sizeof *s);
        if (!s) return ERR_NOMEM;
        tok->id_str = s;
        int32_t *a = realloc(tok->id_added, (size_t) n * sizeof *a);
        if (!a) return ERR_NOMEM;
        tok->id_added = a;
        for (int32_t i = tok->n_vocab; i < n; i++)
            tok->id_str[i] = tok->id_added[i] = -1;
        tok->n_vocab = n;
    }
    if (off > INT32_MAX) return ERR_NOMEM;
    tok->id_str[id] = (int32_t) off;
    return ERR_OK;
}

static Err load_vocab(Tokenizer *tok, json_object *vocab, const Path *path)
{
    Err err = ERR_OK;
    json_object_object_foreach(vocab, key, val)
    {
        if (json_object_get_type(val) != json_type_int) {
            const Path p = path_join(path, key);
            LOG_ERROR("tokenizer.json: %s: expected int", p.s);
            return ERR_FORMAT;
        }
        const int64_t id = json_object_get_int64(val);
        if (id < 0 || id >= (1 << 26)) {
            const Path p = path_join(path, key);
            LOG_ERROR("tokenizer.json: %s: id %lld is out of range", p.s, (long long) id);
            return ERR_FORMAT;
        }
        // json-c object keys are NUL-terminated: a key with an embedded NUL is cut there, a
        // limitation we accept (no real vocabulary has one).
        err = tok_strmap_put(&tok->vocab, &tok->pool, key, strlen(key), (int32_t) id);
        if (err) return err;
    }
    // The id -> string table points at the strings the map copied into the pool.
    for (size_t e = 0; e < tok->vocab.n; e++) {
        size_t n;
        const char *s = tok_strmap_key(&tok->vocab, &tok->pool, e, &n);
        err = set_id_str(tok, tok->vocab.vals[e], (size_t) (s - tok->pool.p));
        if (err) return err;
    }
    return ERR_OK;
}

// Byte-level vocabularies: also key each entry by the bytes its chars stand for, so the
// encoder can look words up without mapping them.
static Err build_raw_vocab(Tokenizer *tok)
{
    Buf raw = {0};
    Err err = ERR_OK;
    for (size_t e = 0; e < tok->vocab.n && !err; e++) {
        size_t n;
        const char *s = tok_strmap_key(&tok->vocab, &tok->pool, e, &n);
        // Copy the key first: adding to the pool may move it.
        buf_clear(&raw);
        bool ok = true;
        for (size_t i = 0; i < n && ok;) {
            const size_t len = utf8_char_len((const uint8_t *) s + i, n - i);
            const int b = len ? tok_bytelevel_byte(utf8_decode((const uint8_t *) s + i, len)) : -1;
            if (b < 0) {
                ok = false;
            } else {
                const char c = (char) b;
                buf_add(&raw, &c, 1);
                i += len;
            }
        }
        if (raw.is_oom) {
            err = ERR_NOMEM;
        } else if (ok) {
            err = tok_strmap_put(&tok->raw_vocab, &tok->pool, raw.p, raw.n, tok->vocab.vals[e]);
        }
    }
    buf_free(&raw);
    return err;
}

static Err load_merges(Tokenizer *tok, json_object *merges, const Path *path)
{
    const size_t n = json_object_array_length(merges);
    Buf merged = {0};
    Err err = ERR_OK;
    for (size_t r = 0; r < n && !err; r++) {
        json_object *m = json_object_array_get_idx(merges, r);
        const Path ip = path_index(path, "merges", r);
        const char *a, *b;
        size_t an, bn;
        if (json_object_get_type(m) == json_type_string) {
            a = json_object_get_string(m);
            const size_t len = (size_t) json_object_get_string_len(m);
            const char *sp = memchr(a, ' ', len);
            if (!sp || memchr(sp + 1, ' ', len - (size_t) (sp + 1 - a))) {
                LOG_ERROR("tokenizer.json: %s: expected \"a b\"", ip.s);
                err = ERR_FORMAT;
                break;
            }
            an = (size_t) (sp - a);
            b = sp + 1;
            bn = len - an - 1;
        } else if (json_object_get_type(m) == json_type_array && json_object_array_length(m) == 2
                   && json_object_get_type(json_object_array_get_idx(m, 0)) == json_type_string
                   && json_object_get_type(json_object_array_get_idx(m, 1)) == json_type_string) {
            json_object *ja = json_object_array_get_idx(m, 0),
                        *jb = json_object_array_get_idx(m, 1);
            a = json_object_get_string(ja);
            an = (size_t) json_object_get_string_len(ja);
            b = json_object_get_string(jb);
            bn = (size_t) json_object_get_string_len(jb);
        } else {
            LOG_ERROR("tokenizer.json: %s: expected a string \"a b\" or a pair of strings", ip.s);
            err = ERR_FORMAT;
            break;
        }
        const int32_t ia = tok_strmap_get(&tok->vocab, &tok->pool, a, an);
        const int32_t ib = tok_strmap_get(&tok->vocab, &tok->pool, b, bn);
        // The merged token drops b's continuing-subword prefix (HF bpe/model.rs).
        size_t skip = 0;
        if (tok->prefix && bn >= tok->prefix_n && memcmp(b, tok->prefix, tok->prefix_n) == 0) {
            skip = tok->prefix_n;
        }
        buf_clear(&merged);
        buf_add(&merged, a, an);
        if (buf_add(&merged, b + skip, bn - skip)) {
            err = ERR_NOMEM;
            break;
        }
        const int32_t im = tok_strmap_get(&tok->vocab, &tok->pool, merged.p, merged.n);
        if (ia < 0 || ib < 0 || im < 0) {
            LOG_ERROR("tokenizer.json: %s: merge of tokens missing from the vocabulary", ip.s);
            err = ERR_FORMAT;
            break;
        }
        err = merge_put(&tok->merges, ia, ib, (uint32_t) r, im);
    }
    buf_free(&merged);
    return err;
}

static Err load_model(Tokenizer *tok, json_object *model)
{
    const Path path = {"model"};
    if (json_object_get_type(model) != json_type_object) {
        LOG_ERROR("tokenizer.json: model: expected object");
        return ERR_FORMAT;
    }
    const char *type, *s;
    size_t n;
    Err err = get_str(model, &path, "type", false, &type, &n);
    if (err) return err;
    if (type && strcmp(type, "BPE") != 0) {
        const Path tp = path_join(&path, "type");
        return unsupported(&tp, "model", type);
    }
    json_object *dropout, *vocab, *merges;
    err = get_field(model, &path, "dropout", json_type_double, false, &dropout);
    if (err) return err;
    if (dropout && json_object_get_double(dropout) != 0.0) {
        const Path dp = path_join(&path, "dropout");
        return unsupported(&dp, "option", "dropout != null");
    }
    err = get_bool(model, &path, "fuse_unk", false, &tok->fuse_unk);
    if (!err) err = get_bool(model, &path, "byte_fallback", false, &tok->byte_fallback);
    if (!err) err = get_bool(model, &path, "ignore_merges", false, &tok->ignore_merges);
    if (!err) err = get_str(model, &path, "continuing_subword_prefix", false, &s, &n);
    if (!err && s && n) err = dup_str(s, n, &tok->prefix);
    tok->prefix_n = tok->prefix ? n : 0;
    if (!err) err = get_str(model, &path, "end_of_word_suffix", false, &s, &n);
    if (!err && s && n) err = dup_str(s, n, &tok->suffix);
    tok->suffix_n = tok->suffix ? n : 0;
    if (!err) err = get_field(model, &path, "vocab", json_type_object, true, &vocab);
    if (!err) {
        const Path vp = path_join(&path, "vocab");
        err = load_vocab(tok, vocab, &vp);
    }
    if (!err) err = get_field(model, &path, "merges", json_type_array, true, &merges);
    if (!err) err = load_merges(tok, merges, &path);
    if (!err) err = get_str(model, &path, "unk_token", false, &s, &n);
    if (err) return err;
    tok->unk_id = -1;
    if (s) {
        tok->unk_id = tok_strmap_get(&tok->vocab, &tok->pool, s, n);
        if (tok->unk_id < 0) {
            LOG_ERROR("tokenizer.json: model.unk_token: \"%s\" is not in the vocabulary", s);
            return ERR_FORMAT;
        }
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        tok->byte_fallback_id[b] = tok_strmap_get(&tok->vocab, &tok->pool, name, 6);
    }
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Added tokens and post-processor

Err tok_trie_add(TokTrie *t, const char *s, size_t n, int32_t added)
{
    if (n == 0) return ERR_OK;
    if (t->n == 0) {
        t->cap = 256;
        t->nodes = malloc(t->cap * sizeof *t->nodes);
        if (!t->nodes) return ERR_NOMEM;
        t->nodes[0] = (TokTrieNode){-1, -1, -1, 0};
        t->n = 1;
    }
    t->first_byte[(uint8_t) s[0]] = true;
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        const uint8_t c = (uint8_t) s[i];
        int32_t k = t->nodes[node].child;
        while (k >= 0 && t->nodes[k].byte != c)
            k = t->nodes[k].sibling;
        if (k < 0) {
            if (t->n == t->cap) {
                TokTrieNode *nodes = realloc(t->nodes, 2 * t->cap * sizeof *nodes);
                if (!nodes) return ERR_NOMEM;
                t->nodes = nodes;
                t->cap *= 2;
            }
            k = (int32_t) t->n++;
            t->nodes[k] = (TokTrieNode){-1, t->nodes[node].child, -1, c};
            t->nodes[node].child = k;
        }
        node = k;
    }
    // The first token with a given content wins, as HF keeps one id per content.
    if (t->nodes[node].added < 0) t->nodes[node].added = added;
    return ERR_OK;
}

void tok_trie_free(TokTrie *t)
{
    free(t->nodes);
    memset(t, 0, sizeof *t);
}

static Err load_added_tokens(Tokenizer *tok, json_object *list)
{
    const Path path = {""};
    const size_t n = json_object_array_length(list);
    tok->added = calloc(n ? n : 1, sizeof *tok->added);
    if (!tok->added) return ERR_NOMEM;
    for (size_t i = 0; i < n; i++) {
        json_object *a = json_object_array_get_idx(list, i);
        const Path ip = path_index(&path, "added_tokens", i);
        if (json_object_get_type(a) != json_type_object) {
            LOG_ERROR("tokenizer.json: %s: expected object", ip.s);
            return ERR_FORMAT;
        }
        TokAdded *t = &tok->added[tok->n_added];
        const char *content;
        size_t cn, id;
        Err err = get_str(a, &ip, "content", true, &content, &cn);
        if (!err) err = get_size(a, &ip, "id", SIZE_MAX, &id);
        if (!err && id == SIZE_MAX) {
            LOG_ERROR("tokenizer.json: %s.id: missing field", ip.s);
            err = ERR_FORMAT;
        }
        if (!err && id >= (1 << 26)) {
            LOG_ERROR("tokenizer.json: %s.id: %zu is out of range", ip.s, id);
            err = ERR_FORMAT;
        }
        if (!err) err = get_bool(a, &ip, "special", false, &t->special);
        if (!err) err = get_bool(a, &ip, "lstrip", false, &t->lstrip);
        if (!err) err = get_bool(a, &ip, "rstrip", false, &t->rstrip);
        if (!err) err = get_bool(a, &ip, "single_word", false, &t->single_word);
        if (!err) err = get_bool(a, &ip, "normalized", !t->special, &t->normalized);
        if (err) return err;
        if (cn == 0) continue;  // HF ignores empty added tokens
        t->id = (int32_t) id;
        t->n = cn;
        err = tok_pool_add(&tok->pool, content, cn, &t->off);
        if (!err) err = set_id_str(tok, t->id, t->off);
        if (!err) err = tok_strmap_put(&tok->added_map, &tok->pool, content, cn, t->id);
        if (err) return err;
        tok->id_added[t->id] = (int32_t) tok->n_added;
        tok->n_added++;
    }
    // HF puts special tokens before the others in its matcher; with leftmost-longest matching
    // only equal contents could tie, and those share one id.
    for (size_t i = 0; i < tok->n_added; i++) {
        const TokAdded *t = &tok->added[i];
        if (t->normalized) {
            tok->has_norm_added = true;
            continue;
        }
        Err err = tok_trie_add(&tok->trie_raw, tok->pool.p + t->off, t->n, (int32_t) i);
        if (err) return err;
    }
    return ERR_OK;
}

// Normalized added tokens match the normalized text by their normalized form; that needs the
// normalizer, so it runs after the components are loaded.
static Err build_norm_trie(Tokenizer *tok)
{
    for (size_t i = 0; i < tok->n_added; i++) {
        const TokAdded *t = &tok->added[i];
        if (!t->normalized) continue;
        char *norm = NULL;
        size_t nn;
        Err err = tok_normalize(tok, tok->pool.p + t->off, t->n, &norm, &nn);
        if (!err) err = tok_trie_add(&tok->trie_norm, norm, nn, (int32_t) i);
        free(norm);
        if (err) return err;
    }
    return ERR_OK;
}

static Err push_ids(int32_t **arr, size_t *n, const int32_t *ids, size_t k)
{
    int32_t *a = realloc(*arr, (*n + k + 1) * sizeof *a);
    if (!a) return ERR_NOMEM;
    if (k) memcpy(a + *n, ids, k * sizeof *ids);
    *arr = a;
    *n += k;
    return ERR_OK;
}

// Ids of a special token named by string in a TemplateProcessing "special_tokens" map.
static Err template_ids(json_object *specials, const Path *path, const char *name, int32_t **arr,
                        size_t *n)
{
    json_object *sp = NULL, *ids = NULL;
    if (!specials || !json_object_object_get_ex(specials, name, &sp)
        || !json_object_object_get_ex(sp, "ids", &ids)
        || json_object_get_type(ids) != json_type_array) {
        LOG_ERROR("tokenizer.json: %s: special token \"%s\" has no ids", path->s, name);
        return ERR_FORMAT;
    }
    for (size_t i = 0; i < json_object_array_length(ids); i++) {
        json_object *v = json_object_array_get_idx(ids, i);
        if (json_object_get_type(v) != json_type_int || json_object_get_int64(v) < 0
            || json_object_get_int64(v) >= (1 << 26)) {
            LOG_ERROR("tokenizer.json: %s: bad id for \"%s\"", path->s, name);
            return ERR_FORMAT;
        }
        const int32_t id = (int32_t) json_object_get_int64(v);
        const Err err = push_ids(arr, n, &id, 1);
        if (err) return err;
    }
    return ERR_OK;
}

static Err load_post_processor(Tokenizer *tok, json_object *obj, const Path *path)
{
    const char *type;
    Err err = component_type(obj, path, &type);
    if (err) return err;
    if (strcmp(type, "Sequence") == 0) return load_sequence(tok, obj, path, "processors", load_post_processor);
    if (strcmp(type, "ByteLevel") == 0) return ERR_OK;  // offsets only
    int32_t *pre = NULL, *suf = NULL;
    size_t n_pre = 0, n_suf = 0;
    if (strcmp(type, "TemplateProcessing") == 0) {
        json_object *single, *specials;
        err = get_field(obj, path, "single", json_type_array, true, &single);
        if (!err) err = get_field(obj, path, "special_tokens", json_type_object, false, &specials);
        bool seen_a = false;
        for (size_t i = 0; !err && i < json_object_array_length(single); i++) {
            json_object *item = json_object_array_get_idx(single, i), *sp, *id;
            const Path ip = path_index(path, "single", i);
            if (json_object_object_get_ex(item, "Sequence", &sp)) {
                seen_a = true;
            } else if (json_object_object_get_ex(item, "SpecialToken", &sp)
                       && json_object_object_get_ex(sp, "id", &id)
                       && json_object_get_type(id) == json_type_string) {
                err = template_ids(specials, &ip, json_object_get_string(id), seen_a ? &suf : &pre,
                                   seen_a ? &n_suf : &n_pre);
            } else {
                LOG_ERROR("tokenizer.json: %s: expected Sequence or SpecialToken", ip.s);
                err = ERR_FORMAT;
            }
        }
    } else if (strcmp(type, "RobertaProcessing") == 0 || strcmp(type, "BertProcessing") == 0) {
        json_object *cls, *sep;
        err = get_field(obj, path, "cls", json_type_array, true, &cls);
        if (!err) err = get_field(obj, path, "sep", json_type_array, true, &sep);
        if (!err && (json_object_array_length(cls) != 2 || json_object_array_length(sep) != 2)) {
            LOG_ERROR("tokenizer.json: %s: cls and sep must be [token, id]", path->s);
            err = ERR_FORMAT;
        }
        if (!err) {
            const int32_t c = (int32_t) json_object_get_int(json_object_array_get_idx(cls, 1));
            const int32_t s = (int32_t) json_object_get_int(json_object_array_get_idx(sep, 1));
            err = push_ids(&pre, &n_pre, &c, 1);
            if (!err) err = push_ids(&suf, &n_suf, &s, 1);
        }
    } else {
        const Path tp = path_join(path, "type");
        err = unsupported(&tp, "post-processor", type);
    }
    // A later processor wraps the result of an earlier one.
    if (!err) err = push_ids(&pre, &n_pre, tok->prefix_ids, tok->n_prefix_ids);
    if (!err) err = push_ids(&tok->suffix_ids, &tok->n_suffix_ids, suf, n_suf);
    if (!err) {
        free(tok->prefix_ids);
        tok->prefix_ids = pre;
        tok->n_prefix_ids = n_pre;
        pre = NULL;
    }
    free(pre);
    free(suf);
    return err;
}

// ---------------------------------------------------------------------------
// Public entry points

static Err load_root(Tokenizer *tok, json_object *root)
{
    const Path path = {""};
    if (json_object_get_type(root) != json_type_object) {
        LOG_ERROR("tokenizer.json: the top level is not an object");
        return ERR_FORMAT;
    }
    json_object *model, *added, *norm, *pre, *post, *dec, *trunc, *pad;
    Err err = get_field(root, &path, "model", json_type_object, true, &model);
    if (!err) err = load_model(tok, model);
    if (!err) err = get_field(root, &path, "added_tokens", json_type_array, false, &added);
    if (!err && added) err = load_added_tokens(tok, added);
    if (!err) err = get_field(root, &path, "normalizer", json_type_object, false, &norm);
    if (!err && norm) {
        const Path p = {"normalizer"};
        err = load_normalizer(tok, norm, &p);
    }
    if (!err) err = get_field(root, &path, "pre_tokenizer", json_type_object, false, &pre);
    if (!err && pre) {
        const Path p = {"pre_tokenizer"};
        err = load_pre_tokenizer(tok, pre, &p);
    }
    if (!err) err = get_field(root, &path, "post_processor", json_type_object, false, &post);
    if (!err && post) {
        const Path p = {"post_processor"};
        err = load_post_processor(tok, post, &p);
    }
    if (!err) err = get_field(root, &path, "decoder", json_type_object, false, &dec);
    if (!err && dec) {
        const Path p = {"decoder"};
        tok->has_decoder = true;
        err = load_decoder(tok, dec, &p);
        if (!err && tok_stream_holds_all(tok))
            LOG_WARN("tokenizer.json: decoder: a step after Fuse or ByteLevel sees the whole "
                     "text (not one Strip of the start): streamed output is held until the end");
    }
    // Truncation and padding change what encode returns; we implement neither.
    if (!err) err = get_field(root, &path, "truncation", json_type_object, false, &trunc);
    if (!err && trunc) {
        const Path p = {"truncation"};
        err = unsupported(&p, "option", "truncation != null");
    }
    if (!err) err = get_field(root, &path, "padding", json_type_object, false, &pad);
    if (!err && pad) {
        const Path p = {"padding"};
        err = unsupported(&p, "option", "padding != null");
    }
    if (!err && tok->byte_level) err = build_raw_vocab(tok);
    if (!err && tok->has_norm_added) err = build_norm_trie(tok);
    if (err) return err;
    for (int b = 0; b < 256; b++) {
        char s[4];
        const size_t n = utf8_encode(tok_bytelevel_char((uint8_t) b), s);
        tok->byte_id[b] = tok_strmap_get(&tok->vocab, &tok->pool, s, n);
    }
    for (size_t i = 0; i < tok->n_prefix_ids; i++) {
        if (tok->prefix_ids[i] >= tok->n_vocab || !tok_id_to_token(tok, tok->prefix_ids[i])) {
            LOG_ERROR("tokenizer.json: post_processor: id %d is not in the vocabulary",
                      (int) tok->prefix_ids[i]);
            return ERR_FORMAT;
        }
    }
    for (size_t i = 0; i < tok->n_suffix_ids; i++) {
        if (tok->suffix_ids[i] >= tok->n_vocab || !tok_id_to_token(tok, tok->suffix_ids[i])) {
            LOG_ERROR("tokenizer.json: post_processor: id %d is not in the vocabulary",
                      (int) tok->suffix_ids[i]);
            return ERR_FORMAT;
        }
    }
    // Shrink n_vocab to one past the largest id in use.
    while (tok->n_vocab > 0 && tok->id_str[tok->n_vocab - 1] < 0)
        tok->n_vocab--;
    return ERR_OK;
}

Err tok_load_json(Tokenizer **out, const char *json, size_t n_bytes)
{
    *out = NULL;
    Err err = ERR_OK;
    json_object *root = NULL;
    Tokenizer *tok = calloc(1, sizeof *tok);
    json_tokener *jt = json_tokener_new_ex(JSON_TOKENER_DEFAULT_DEPTH);
    if (!tok || !jt || n_bytes > INT32_MAX) {
        free(tok);
        tok = NULL;
        err = n_bytes > INT32_MAX ? ERR_INVAL : ERR_NOMEM;
        goto done;
    }
    pthread_mutex_init(&tok->cache_mu, NULL);
    // JSON text is UTF-8 (RFC 8259; Hugging Face's loader refuses anything else), and the
    // strings it holds reach the regexes, which are run on valid UTF-8 only. Checking the raw
    // bytes is enough: json-c decodes escapes to valid UTF-8 (a lone surrogate becomes U+FFFD).
    const size_t n_valid = utf8_valid_prefix((const uint8_t *) json, n_bytes);
    if (n_valid != n_bytes) {
        LOG_ERROR("tokenizer.json: not valid UTF-8 at byte %zu", n_valid);
        err = ERR_FORMAT;
        goto done;
    }
    root = json_tokener_parse_ex(jt, json, (int) n_bytes);
    enum json_tokener_error jerr = json_tokener_get_error(jt);
    if (jerr == json_tokener_continue) jerr = json_tokener_error_parse_eof;
    if (!root || jerr != json_tokener_success) {
        LOG_ERROR("tokenizer.json: malformed JSON at byte %zu: %s",
                  (size_t) json_tokener_get_parse_end(jt), json_tokener_error_desc(jerr));
        err = ERR_FORMAT;
        goto done;
    }
    // Only whitespace may follow the top-level value.
    for (size_t i = json_tokener_get_parse_end(jt); i < n_bytes; i++) {
        if (json[i] != ' ' && json[i] != '\n' && json[i] != '\r' && json[i] != '\t') {
            LOG_ERROR("tokenizer.json: malformed JSON: trailing bytes at %zu", i);
            err = ERR_FORMAT;
            goto done;
        }
    }
    err = load_root(tok, root);
    if (err) goto done;
    *out = tok;
    tok = NULL;  // ownership moved to *out
done:
    tok_destroy(tok);
    json_object_put(root);
    if (jt) json_tokener_free(jt);
    return err;
}

Err tok_load(Tokenizer **out, const char *path)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        LOG_ERROR("could not open tokenizer \"%s\": %s", path, strerror(errno));
        return ERR_IO;
    }
    Buf text = {0};
    Err err = buf_add_file(&text, f);
    if (err == ERR_IO) LOG_ERROR("could not read tokenizer \"%s\": %s", path, strerror(errno));
    if (err) goto done;
    err = tok_load_json(out, text.p, text.n);
    if (err) LOG_ERROR("could not load tokenizer \"%s\": %s", path, err_name(err));
done:
    buf_free(&text);
    fclose(f);
    return err;
}

void tok_destroy(Tokenizer *tok)
{
    if (!tok) return;
    for (size_t i = 0; i < tok->n_norms; i++) {
        pcre2_code_free(tok->norms[i].re);
        free(tok->norms[i].content);
    }
    for (size_t i = 0; i < tok->n_pres; i++)
        pcre2_code_free(tok->pres[i].re);
    for (size_t i = 0; i < tok->n_decs; i++) {
        pcre2_code_free(tok->decs[i].re);
        free(tok->decs[i].content);
    }
    free(tok->norms);
    free(tok->pres);
    free(tok->decs);
    buf_free(&tok->pool);
    tok_strmap_free(&tok->vocab);
    tok_strmap_free(&tok->raw_vocab);
    tok_strmap_free(&tok->added_map);
    free(tok->id_str);
    free(tok->id_added);
    free(tok->merges.kv);
    free(tok->prefix);
    free(tok->suffix);
    free(tok->added);
    tok_trie_free(&tok->trie_raw);
    tok_trie_free(&tok->trie_norm);
    free(tok->prefix_ids);
    free(tok->suffix_ids);
    tok_cache_free(&tok->cache);
    pthread_mutex_destroy(&tok->cache_mu);
    free(tok);
}

// ---------------------------------------------------------------------------
// Lookups

int32_t tok_n_vocab(const Tokenizer *tok)
{
    return tok->n_vocab;
}

int32_t tok_token_to_id(const Tokenizer *tok, const char *token)
{
    const size_t n = strlen(token);
    const int32_t id = tok_strmap_get(&tok->added_map, &tok->pool, token, n);
    return id >= 0 ? id : tok_strmap_get(&tok->vocab, &tok->pool, token, n);
}

const char *tok_id_to_token(const Tokenizer *tok, int32_t id)
{
    if (id < 0 || id >= tok->n_vocab || tok->id_str[id] < 0) return NULL;
    return tok->pool.p + tok->id_str[id];
}

bool tok_is_special(const Tokenizer *tok, int32_t id)
{
    if (id < 0 || id >= tok->n_vocab || tok->id_added[id] < 0) return false;
    return tok->added[tok->id_added[id]].special;
}

size_t tok_special_prefix(const Tokenizer *tok, int32_t *ids, size_t cap)
{
    for (size_t i = 0; i < tok->n_prefix_ids && i < cap; i++)
        ids[i] = tok->prefix_ids[i];
    return tok->n_prefix_ids;
}

size_t tok_special_suffix(const Tokenizer *tok, int32_t *ids, size_t cap)
{
    for (size_t i = 0; i < tok->n_suffix_ids && i < cap; i++)
        ids[i] = tok->suffix_ids[i];
    return tok->n_suffix_ids;
}
