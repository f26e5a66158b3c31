/*
 * tok_internal.h - the private layout of a Tokenizer, shared by tokenizer.c (loading and
 * lookups), tok_encode.c (text to ids) and tok_decode.c (ids to text, streaming).
 *
 * Strings live in one pool per tokenizer and are named by offset, so growing the pool never
 * invalidates them. Component chains (normalizer, pre-tokenizer, decoder) are flattened:
 * a "Sequence" of sequences is the concatenation of its steps, which is what HF computes.
 *
 * Ownership: everything here is owned by the Tokenizer and freed by tok_destroy().
 * Threads:   read-only after loading, except cache (guarded by cache_mu).
 * Errors:    none at this level; see tokenizer.h.
 */
#ifndef ENGINE_SHARED_TOK_INTERNAL_H
#define ENGINE_SHARED_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/shared/buf.h"
#include "engine/shared/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------
// Byte strings and hash tables

// The string pool: every string followed by a NUL, so each is also a C string.
typedef Buf TokPool;

// Open-addressing map from byte strings in a TokPool to int32 values.
typedef struct TokStrMap {
    uint32_t *slots;    // [cap] entry index + 1; 0 = empty
    size_t cap;         // power of two, at least twice n
    uint64_t *off_len;  // [n] pool offset << 24 | length (strings are < 16 MiB)
    int32_t *vals;      // [n]
    size_t n, n_alloc;
} TokStrMap;

// Merge table: pair of ids -> (rank, merged id). Key and value sit side by side so that a
// lookup touches one cache line; BPE on long words is bound by these random reads.
typedef struct TokMergeMap {
    uint64_t *kv;  // [cap][2]: key (a + 1) << 32 | b (0 = empty), value rank << 32 | merged id
    size_t cap, n;
} TokMergeMap;

uint64_t tok_hash(const void *s, size_t n);
// Insert or overwrite; the string is copied into pool. Returns ERR_NOMEM on failure.
Err tok_strmap_put(TokStrMap *m, TokPool *pool, const char *s, size_t n, int32_t val);
// Value for s[0..n), or -1.
int32_t tok_strmap_get(const TokStrMap *m, const TokPool *pool, const char *s, size_t n);
void tok_strmap_free(TokStrMap *m);
// Pool string of entry i.
const char *tok_strmap_key(const TokStrMap *m, const TokPool *pool, size_t i, size_t *n);
Err tok_pool_add(TokPool *pool, const char *s, size_t n, size_t *off);

// rank << 32 | merged id, or UINT64_MAX when (a, b) is no merge.
static inline uint64_t tok_merge_get(const TokMergeMap *m, int32_t a, int32_t b)
{
    if (m->cap == 0) return UINT64_MAX;
    const uint64_t key = ((uint64_t) (uint32_t) (a + 1) << 32) | (uint32_t) b;
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t) (h >> 20) & (m->cap - 1);
    for (;;) {
        const uint64_t k = m->kv[2 * i];
        if (k == key) return m->kv[2 * i + 1];
        if (k == 0) return UINT64_MAX;
        i = (i + 1) & (m->cap - 1);
    }
}

// ---------------------------------------------------------------------------
// Components

typedef enum TokNormKind {
    TOK_NORM_NFC,
    TOK_NORM_NFD,
    TOK_NORM_NFKC,
    TOK_NORM_NFKD,
    TOK_NORM_LOWERCASE,
    TOK_NORM_REPLACE,
    TOK_NORM_PREPEND,
    TOK_NORM_STRIP,
} TokNormKind;

typedef struct TokNorm {
    TokNormKind kind;
    pcre2_code *re;  // REPLACE: the pattern (a literal for String patterns)
    char *content;   // REPLACE: replacement; PREPEND: the prefix
    size_t content_n;
    bool left, right;  // STRIP
} TokNorm;

typedef enum TokSplitBehavior {
    TOK_SPLIT_REMOVED,
    TOK_SPLIT_ISOLATED,
    TOK_SPLIT_MERGED_WITH_PREVIOUS,
    TOK_SPLIT_MERGED_WITH_NEXT,
    TOK_SPLIT_CONTIGUOUS,
} TokSplitBehavior;

typedef enum TokPreKind {
    TOK_PRE_SPLIT,
    TOK_PRE_BYTELEVEL,
    TOK_PRE_DIGITS,
    TOK_PRE_METASPACE,
    TOK_PRE_WHITESPACE,        // \w+|[^\w\s]+
    TOK_PRE_WHITESPACE_SPLIT,  // split on whitespace, removed
} TokPreKind;

typedef enum TokPrependScheme {
    TOK_PREPEND_ALWAYS,
    TOK_PREPEND_FIRST,
    TOK_PREPEND_NEVER,
} TokPrependScheme;

typedef struct TokPre {
    TokPreKind kind;
    pcre2_code *re;  // SPLIT, BYTELEVEL with use_regex, WHITESPACE
    TokSplitBehavior behavior;
    bool invert;
    bool add_prefix_space;   // BYTELEVEL
    bool individual_digits;  // DIGITS
    char replacement[5];     // METASPACE, UTF-8 of the replacement char
    size_t replacement_n;
    TokPrependScheme prepend_scheme;
    bool split;  // METASPACE
} TokPre;

typedef enum TokDecKind {
    TOK_DEC_BYTELEVEL,
    TOK_DEC_REPLACE,
    TOK_DEC_STRIP,
    TOK_DEC_FUSE,
    TOK_DEC_BYTEFALLBACK,
    TOK_DEC_METASPACE,
} TokDecKind;

typedef struct TokDec {
    TokDecKind kind;
    pcre2_code *re;  // REPLACE
    char *content;   // REPLACE: replacement; STRIP: the char (UTF-8); METASPACE: replacement
    size_t content_n;
    size_t start, stop;  // STRIP
    bool strip_first;    // METASPACE: drop the leading space of the first token
} TokDec;

typedef struct TokAdded {
    size_t off, n;  // content in the pool
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
} TokAdded;

// Byte trie over added-token contents, for leftmost-longest matching.
typedef struct TokTrieNode {
    int32_t child;    // first child, -1 if none
    int32_t sibling;  // next sibling, -1 if none
    int32_t added;    // index into Tokenizer.added of the token ending here, -1 if none
    uint8_t byte;
} TokTrieNode;

typedef struct TokTrie {
    TokTrieNode *nodes;  // [n]; node 0 is the root
    size_t n, cap;
    bool first_byte[256];  // bytes some token starts with
} TokTrie;

// Word cache entry: raw pre-token bytes -> ids.
typedef struct TokCache {
    TokStrMap map;  // word -> index into spans
    TokPool words;
    uint64_t *spans;  // [map.n] ids offset << 16 | count
    int32_t *ids;     // [n_ids]
    size_t n_ids, cap_ids, cap_spans;
} TokCache;

struct Tokenizer {
    TokPool pool;
    TokStrMap vocab;      // model vocabulary (strings as in the file)
    TokStrMap raw_vocab;  // byte-level models: vocabulary keyed by the bytes the chars stand for
    TokStrMap added_map;  // added-token content -> id
    int32_t *id_str;      // [n_vocab] pool offset of the token string, -1 if unused
    int32_t *id_added;    // [n_vocab] index into added, -1 if not an added token
    int32_t n_vocab;
    TokMergeMap merges;

    // BPE model options.
    int32_t unk_id;  // -1 when there is no unk token
    bool fuse_unk, byte_fallback, ignore_merges;
    char *prefix;  // continuing_subword_prefix, NULL when absent or empty
    size_t prefix_n;
    char *suffix;  // end_of_word_suffix
    size_t suffix_n;
    int32_t byte_fallback_id[256];  // ids of "<0xXX>", -1 where missing
    int32_t byte_id[256];           // byte-level models: id of the char standing for each byte

    TokNorm *norms;
    size_t n_norms;
    TokPre *pres;
    size_t n_pres;
    bool byte_level;  // a ByteLevel pre-tokenizer maps bytes to chars before the model
    TokDec *decs;
    size_t n_decs;
    bool has_decoder;

    TokAdded *added;
    size_t n_added;
    TokTrie trie_raw;   // added tokens with normalized == false
    TokTrie trie_norm;  // added tokens with normalized == true, as normalized
    bool has_norm_added;

    int32_t *prefix_ids, *suffix_ids;  // post-processor, single sequence
    size_t n_prefix_ids, n_suffix_ids;

    pthread_mutex_t cache_mu;
    TokCache cache;
};

// Encoding internals shared with tokenizer.c (trie of normalized added tokens).
Err tok_normalize(const Tokenizer *tok, const char *s, size_t n, char **out, size_t *out_n);
Err tok_trie_add(TokTrie *t, const char *s, size_t n, int32_t added);
void tok_trie_free(TokTrie *t);
void tok_cache_free(TokCache *c);

// True when tok's decoder chain sees the whole text after a fusing step (Fuse, ByteLevel)
// in a way no window can (anything but Strips of at most one leading char, and Fuse): its
// TokStream then holds everything until the flush (tok_decode.c).
bool tok_stream_holds_all(const Tokenizer *tok);

// Byte-level alphabet: the char GPT-2 uses for byte b, and the inverse (-1 if none).
uint32_t tok_bytelevel_char(uint8_t b);
int tok_bytelevel_byte(uint32_t cp);

// Compile a regex (UTF, UCP, JIT). literal: match pattern as plain text. Logs at path.
Err tok_regex_compile(const char *pattern, size_t n, bool literal, const char *path,
                      pcre2_code **out);

// The next match of re (compiled by tok_regex_compile) in s[0..n) at or after *pos, as HF's
// find_matches walks them: 1 with the match in [*ms, *me), 0 when there is none (or *pos is
// past n), -1 when matching fails (logged). *pos moves past the match, or one character
// past an empty one, so the next call finds the next match. md: room for one match.
int tok_regex_next(const pcre2_code *re, pcre2_match_data *md, const char *s, size_t n, size_t *pos,
                   size_t *ms, size_t *me);

// Append s[0..n) to out with every match of re replaced by content[0..content_n) (HF's
// Replace normalizer and decoder). ERR_INVAL when matching fails (logged), ERR_NOMEM (out's
// sticky failure).
Err tok_regex_replace(const pcre2_code *re, pcre2_match_data *md, const char *s, size_t n,
                      const char *content, size_t content_n, Buf *out);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_TOK_INTERNAL_H
