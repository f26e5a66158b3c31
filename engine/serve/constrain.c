/*
 * constrain.c - vocabulary masks from the JSON automaton (constrain.h).
 *
 * The trie: node 0 is the root; each node has a first child and a next sibling, the byte
 * on its incoming edge, the first token whose bytes end there (tok_next chains tokens with
 * the same bytes), and has_other: its subtree holds a token that is not plain. Tokens
 * longer than CONSTRAIN_MAX_BYTES bytes are left out (never allowed).
 *
 * A mask walk keeps one automaton state per trie depth (c->scratch[d]: the state after the
 * first d bytes of the current path).
 */
#include "engine/serve/constrain.h"

#include <stdlib.h>
#include <string.h>

#include "engine/shared/clock.h"
#include "engine/shared/err.h"
#include "engine/shared/utf8.h"

enum {
    CONSTRAIN_MAX_BYTES = 128,  // longest token bytes the trie holds
    CONSTRAIN_CACHE = 16,       // cached masks per job
    CONSTRAIN_MAX_COMPLETION = 4096,
    CONSTRAIN_END_ZONE = 256,  // tokens before the end where candidates are checked
    CONSTRAIN_MAX_WAIT = 2,
    CONSTRAIN_MAX_WAIT_BYTES = 400,
};

typedef struct TrieNode {
    uint32_t child, sibling;
    int32_t tok;  // first token ending here, -1: none
    uint8_t byte;
    bool has_other;    // a token below is not plain
    bool has_partial;  // a plain token below ends inside a character
} TrieNode;

struct ConstrainVocab {
    int32_t n_vocab, n_tok;  // mask bits; tokenizer ids
    int n_words;
    uint32_t *off;  // [n_tok + 1] token bytes in bytes[]
    uint8_t *bytes;
    uint8_t *is_special;  // [n_tok]
    int32_t *tok_next;    // [n_tok] next token with the same bytes, -1: none
    TrieNode *nodes;
    uint32_t n_nodes, cap_nodes;
    uint32_t *eos_mask;     // [n_words]
    uint32_t *plain_upto;   // [(max_cps + 1) * n_words]: plain tokens of <= r code points
    uint32_t *whole_upto;   // the same without those ending inside a character
    int max_cps;
    int32_t *specials;  // special tokens but end-of-sequence (tool-call markup may be one)
    int n_specials;
};

typedef struct CacheEntry {
    uint64_t hash, used;
    bool is_set;
    JgramState *st;
    uint32_t *mask;
} CacheEntry;

struct Constrain {
    const ConstrainVocab *v;
    JgramGrammar *g;
    bool is_broken;
    // Waiting: the texts still to see before the grammar starts, in order
    char *wait[CONSTRAIN_MAX_WAIT];
    int n_wait, i_wait;
    char tail[CONSTRAIN_MAX_WAIT_BYTES];  // the last bytes seen while waiting
    int n_tail;
    JgramState st;
    JgramState *scratch;  // [CONSTRAIN_MAX_BYTES + 1]
    uint32_t *mask;
    CacheEntry cache[CONSTRAIN_CACHE];
    uint64_t clock;
    int check_left;  // end zone: completions must fit in this many bytes (-1: no check)
    bool check_partial;  // ... and plain tokens that end inside a character are checked too
    char comp[CONSTRAIN_MAX_COMPLETION];
    ConstrainStats stats;
};

// ---------------------------------------------------------------------------
// Vocabulary

// Plain: no '"', '\\' or control byte, and UTF-8 that starts on a character and is valid
// up to its end, where the last character may be cut short (byte-level tokens split
// characters; the next token finishes it). *cps: the characters it starts. Inside a
// string (no escape or character pending), a plain token is accepted exactly when the
// string has room for *cps more code points.
static bool is_plain(const uint8_t *p, uint32_t n, int *cps, bool *is_partial)
{
    int count = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (p[i] < 0x20 || p[i] == '"' || p[i] == '\\') return false;
        count += (p[i] & 0xC0) != 0x80;  // the characters it starts
    }
    const size_t tail = utf8_incomplete_tail(p, n);
    *cps = count;
    *is_partial = tail > 0;
    return n > 0 && utf8_valid_prefix(p, n) + tail == n;
}

static uint32_t trie_child(ConstrainVocab *v, uint32_t node, uint8_t byte, bool add)
{
    for (uint32_t ch = v->nodes[node].child; ch; ch = v->nodes[ch].sibling)
        if (v->nodes[ch].byte == byte) return ch;
    if (!add) return 0;
    if (v->n_nodes == v->cap_nodes) {
        const uint32_t cap = v->cap_nodes * 2;
        TrieNode *p = realloc(v->nodes, (size_t) cap * sizeof *p);
        if (!p) return 0;
        v->nodes = p;
        v->cap_nodes = cap;
    }
    const uint32_t k = v->n_nodes++;
    v->nodes[k] = (TrieNode){0, v->nodes[node].child, -1, byte, false, false};
    v->nodes[node].child = k;
    return k;
}

static inline void set_bit(uint32_t *m, int32_t id) { m[id >> 5] |= 1u << (id & 31); }

Err constrain_vocab_create(const Tokenizer *tok, int32_t n_vocab, const int *eos_ids, int n_eos,
                           ConstrainVocab **out)
{
    *out = NULL;
    ConstrainVocab *v = calloc(1, sizeof *v);
    if (!v) return ERR_NOMEM;
    Err err = ERR_NOMEM;
    const int32_t n_tok = tok_n_vocab(tok) < n_vocab ? tok_n_vocab(tok) : n_vocab;
    v->n_vocab = n_vocab;
    v->n_tok = n_tok;
    v->n_words = (n_vocab + 31) / 32;
    int *cps = calloc((size_t) n_tok + 1, sizeof *cps);
    uint8_t *partial = calloc((size_t) n_tok + 1, 1);
    v->off = calloc((size_t) n_tok + 1, sizeof *v->off);
    v->is_special = calloc((size_t) n_tok + 1, 1);
    v->tok_next = malloc(((size_t) n_tok + 1) * sizeof *v->tok_next);
    v->eos_mask = calloc((size_t) v->n_words, sizeof(uint32_t));
    v->cap_nodes = 1 << 16;
    v->nodes = malloc(v->cap_nodes * sizeof *v->nodes);
    size_t cap_bytes = (size_t) n_tok * 8 + 64, n_bytes = 0;
    v->bytes = malloc(cap_bytes);
    if (!cps || !partial || !v->off || !v->is_special || !v->tok_next || !v->eos_mask || !v->nodes || !v->bytes)
        goto done;
    v->nodes[0] = (TrieNode){0, 0, -1, 0, false, false};
    v->n_nodes = 1;
    for (int i = 0; i < n_eos; i++)
        if (eos_ids[i] >= 0 && eos_ids[i] < n_vocab) set_bit(v->eos_mask, eos_ids[i]);
    for (int32_t id = 0; id < n_tok; id++) {
        v->off[id] = (uint32_t) n_bytes;
        v->tok_next[id] = -1;
        char *text = NULL;
        size_t n = 0;
        v->is_special[id] = tok_is_special(tok, id);
        if (v->is_special[id]) {
            const char *t = tok_id_to_token(tok, id);
            if (t && !(text = strdup(t))) goto done;
            n = t ? strlen(t) : 0;
        } else if (tok_token_bytes(tok, id, &text, &n) != ERR_OK) {
            text = NULL, n = 0;
        }
        if (n_bytes + n > cap_bytes) {
            cap_bytes = (n_bytes + n) * 2;
            uint8_t *b = realloc(v->bytes, cap_bytes);
            if (!b) {
                free(text);
                goto done;
            }
            v->bytes = b;
        }
        if (n) memcpy(v->bytes + n_bytes, text, n);
        n_bytes += n;
        free(text);
    }
    v->off[n_tok] = (uint32_t) n_bytes;
    if (!(v->specials = malloc(((size_t) n_tok + 1) * sizeof *v->specials))) goto done;
    for (int32_t id = 0; id < n_tok; id++)
        if (v->is_special[id] && !(v->eos_mask[id >> 5] >> (id & 31) & 1) && v->off[id + 1] > v->off[id])
            v->specials[v->n_specials++] = id;
    // The trie, and the plain tokens' code points.
    for (int32_t id = 0; id < n_tok; id++) {
        const uint8_t *p = v->bytes + v->off[id];
        const uint32_t n = v->off[id + 1] - v->off[id];
        const bool is_eos = v->eos_mask[id >> 5] >> (id & 31) & 1;
        if (v->is_special[id] || is_eos || n == 0 || n > CONSTRAIN_MAX_BYTES) continue;
        int k = 0;
        bool is_partial = false;
        const bool plain = is_plain(p, n, &k, &is_partial);
        cps[id] = plain ? k : 0;
        partial[id] = plain && is_partial;
        if (plain && k > v->max_cps) v->max_cps = k;
        uint32_t node = 0;
        for (uint32_t i = 0; i < n; i++) {
            if (!(node = trie_child(v, node, p[i], true))) goto done;
            if (!plain) v->nodes[node].has_other = true;
            if (partial[id]) v->nodes[node].has_partial = true;
        }
        v->tok_next[id] = v->nodes[node].tok;
        v->nodes[node].tok = id;
    }
    v->plain_upto = calloc((size_t) (v->max_cps + 1) * (size_t) v->n_words, sizeof(uint32_t));
    v->whole_upto = calloc((size_t) (v->max_cps + 1) * (size_t) v->n_words, sizeof(uint32_t));
    if (!v->plain_upto || !v->whole_upto) goto done;
    for (int32_t id = 0; id < n_tok; id++)
        for (int r = cps[id]; cps[id] > 0 && r <= v->max_cps; r++) {
            set_bit(v->plain_upto + (size_t) r * v->n_words, id);
            if (!partial[id]) set_bit(v->whole_upto + (size_t) r * v->n_words, id);
        }
    LOG_INFO("constrained decoding: %d token byte strings, %u trie nodes, plain tokens up to %d "
             "code points",
             n_tok, v->n_nodes, v->max_cps);
    err = ERR_OK;
done:
    free(cps);
    free(partial);
    if (err) constrain_vocab_destroy(v);
    else *out = v;
    return err;
}

void constrain_vocab_destroy(ConstrainVocab *v)
{
    if (!v) return;
    free(v->off);
    free(v->bytes);
    free(v->is_special);
    free(v->tok_next);
    free(v->nodes);
    free(v->eos_mask);
    free(v->plain_upto);
    free(v->whole_upto);
    free(v->specials);
    free(v);
}

int constrain_mask_words(const ConstrainVocab *v) { return v->n_words; }

// ---------------------------------------------------------------------------
// A job's constraint

Err constrain_create(const ConstrainVocab *v, JgramGrammar *g, const char *const *wait, int n_wait,
                     Constrain **out)
{
    *out = NULL;
    Constrain *c = calloc(1, sizeof *c);
    if (c) {
        c->v = v;
        c->g = g;  // freed by constrain_destroy from here on
    }
    bool ok = c && n_wait >= 0 && n_wait <= CONSTRAIN_MAX_WAIT;
    if (ok) {
        c->scratch = malloc((CONSTRAIN_MAX_BYTES + 1) * sizeof *c->scratch);
        c->mask = malloc((size_t) v->n_words * sizeof *c->mask);
        ok = c->scratch && c->mask;
        for (int i = 0; i < n_wait && ok; i++)
            ok = strlen(wait[i]) < CONSTRAIN_MAX_WAIT_BYTES && (c->wait[c->n_wait++] = strdup(wait[i]));
    }
    if (!ok) {
        if (c) constrain_destroy(c);
        else jgram_free(g);
        return ERR_NOMEM;
    }
    jgram_start(g, &c->st);
    *out = c;
    return ERR_OK;
}

void constrain_destroy(Constrain *c)
{
    if (!c) return;
    for (int i = 0; i < CONSTRAIN_CACHE; i++) {
        free(c->cache[i].st);
        free(c->cache[i].mask);
    }
    jgram_free(c->g);
    for (int i = 0; i < c->n_wait; i++) free(c->wait[i]);
    free(c->scratch);
    free(c->mask);
    free(c);
}

bool constrain_token(Constrain *c, int32_t id)
{
    const ConstrainVocab *v = c->v;
    if (c->is_broken) return true;
    const bool in_vocab = id >= 0 && id < v->n_tok;
    const uint8_t *p = in_vocab ? v->bytes + v->off[id] : NULL;
    const uint32_t n = in_vocab ? v->off[id + 1] - v->off[id] : 0;
    if (c->i_wait < c->n_wait) {  // look for the awaited text across token boundaries
        const char *w = c->wait[c->i_wait];
        const int nw = (int) strlen(w);
        char buf[CONSTRAIN_MAX_WAIT_BYTES + CONSTRAIN_MAX_BYTES];
        const uint32_t m = n < CONSTRAIN_MAX_BYTES ? n : CONSTRAIN_MAX_BYTES;
        memcpy(buf, c->tail, (size_t) c->n_tail);
        if (m) memcpy(buf + c->n_tail, p + (n - m), m);
        const int len = c->n_tail + (int) m;
        for (int i = 0; i + nw <= len; i++)
            if (!memcmp(buf + i, w, (size_t) nw)) {  // seen: wait for the next one afresh
                c->i_wait++;
                c->n_tail = 0;
                return true;
            }
        const int keep = len < nw - 1 ? len : nw - 1;
        memmove(c->tail, buf + len - keep, (size_t) keep);
        c->n_tail = keep;
        return true;
    }
    if (id >= 0 && id < v->n_vocab && (v->eos_mask[id >> 5] >> (id & 31) & 1)) return true;
    if (!in_vocab || (v->is_special[id] && !jgram_wants_markup(c->g)) ||
        !jgram_feed_bytes(c->g, &c->st, p, n)) {
        c->is_broken = true;
        return false;
    }
    return true;
}

bool constrain_is_complete(const Constrain *c)
{
    return c->is_broken || c->i_wait < c->n_wait ? true : jgram_can_end(c->g, &c->st);
}

// Allow the tokens under trie node `node` (path state c->scratch[depth]) that the
// automaton accepts. fast: plain tokens are already allowed, walk only subtrees with
// others. With c->check_left >= 0 a token must also leave a completion that fits; plain
// tokens that end inside a character lengthen it by up to 3 bytes (the rest of the
// character), so within 4 tokens of the end (check_partial) those are walked too.
static void walk(Constrain *c, uint32_t node, int depth, bool fast)
{
    const ConstrainVocab *v = c->v;
    for (uint32_t ch = v->nodes[node].child; ch; ch = v->nodes[ch].sibling) {
        const TrieNode *t = &v->nodes[ch];
        if (fast && !t->has_other && !(c->check_partial && t->has_partial)) continue;
        JgramState *s = &c->scratch[depth + 1];
        jgram_copy(s, &c->scratch[depth]);
        if (!jgram_feed(c->g, s, t->byte)) continue;
        if (t->tok >= 0 &&
            (c->check_left < 0 || jgram_completion(c->g, s, c->comp, c->check_left) >= 0))
            for (int32_t id = t->tok; id >= 0; id = v->tok_next[id]) set_bit(c->mask, id);
        if (depth + 1 < CONSTRAIN_MAX_BYTES) walk(c, ch, depth + 1, fast);
    }
}

static bool mask_empty(const uint32_t *m, int n)
{
    for (int i = 0; i < n; i++)
        if (m[i]) return false;
    return true;
}

// Tool-call markup may come as special tokens: those the automaton accepts (and, in the
// end zone, that leave a completion that fits).
static void allow_specials(Constrain *c)
{
    const ConstrainVocab *v = c->v;
    JgramState *s = &c->scratch[1];
    for (int i = 0; i < v->n_specials; i++) {
        const int32_t id = v->specials[i];
        jgram_copy(s, &c->st);
        if (jgram_feed_bytes(c->g, s, v->bytes + v->off[id], v->off[id + 1] - v->off[id]) &&
            (c->check_left < 0 || jgram_completion(c->g, s, c->comp, c->check_left) >= 0))
            set_bit(c->mask, id);
    }
}

// Only the tokens along the shortest completion comp[0..n) (specials too for tool calls).
static void force_completion(Constrain *c, int n)
{
    const ConstrainVocab *v = c->v;
    for (int i = 0; i < v->n_specials && jgram_wants_markup(c->g); i++) {
        const int32_t id = v->specials[i];
        const uint32_t len = v->off[id + 1] - v->off[id];
        if (len <= (uint32_t) n && !memcmp(v->bytes + v->off[id], c->comp, len)) set_bit(c->mask, id);
    }
    uint32_t node = 0;
    for (int i = 0; i < n; i++) {
        uint32_t ch = v->nodes[node].child;
        while (ch && v->nodes[ch].byte != (uint8_t) c->comp[i]) ch = v->nodes[ch].sibling;
        if (!ch) break;
        node = ch;
        for (int32_t id = v->nodes[node].tok; id >= 0; id = v->tok_next[id]) set_bit(c->mask, id);
    }
}

const uint32_t *constrain_mask(Constrain *c, int n_left)
{
    if (c->i_wait < c->n_wait || c->is_broken) return NULL;
    const ConstrainVocab *v = c->v;
    const double t0 = clock_now_s();
    c->stats.n_masks++;
    const int nw = v->n_words;
    const size_t mask_bytes = (size_t) nw * sizeof(uint32_t);
    const int need = jgram_completion(c->g, &c->st, c->comp, CONSTRAIN_MAX_COMPLETION);
    const bool can_end = need == 0;
    // A completion longer than CONSTRAIN_MAX_COMPLETION: max_tokens cannot hold it anyway,
    // so any valid continuation is as good (no end zone, no forcing).
    const int n_need = need < 0 ? -CONSTRAIN_END_ZONE - 1 : need;
    memset(c->mask, 0, mask_bytes);
    if (need >= 0 && n_left <= need) {  // only the shortest way to the end still fits (if that)
        force_completion(c, need < 0 ? 0 : need);
    } else {
        const bool in_end_zone = n_left <= n_need + CONSTRAIN_END_ZONE;
        const uint64_t h = jgram_hash(&c->st);
        CacheEntry *hit = NULL, *victim = &c->cache[0];
        for (int i = 0; i < CONSTRAIN_CACHE && !in_end_zone; i++) {
            CacheEntry *e = &c->cache[i];
            if (e->is_set && e->hash == h && jgram_equal(e->st, &c->st)) hit = e;
            if (!e->is_set || e->used < victim->used) victim = e;
        }
        if (hit) {
            hit->used = ++c->clock;
            c->stats.n_cached++;
            memcpy(c->mask, hit->mask, mask_bytes);
        } else {
            const int32_t room = jgram_plain_room(c->g, &c->st);
            c->check_partial = n_left <= n_need + 4;
            if (room >= 0) {
                const int r = room > v->max_cps ? v->max_cps : room;
                memcpy(c->mask, (c->check_partial ? v->whole_upto : v->plain_upto) + (size_t) r * nw,
                       mask_bytes);
            }
            c->check_left = in_end_zone ? n_left - 1 : -1;
            jgram_copy(&c->scratch[0], &c->st);
            walk(c, 0, 0, room >= 0);
            if (jgram_wants_markup(c->g)) allow_specials(c);
            if (!in_end_zone) {
                if (!victim->st) victim->st = malloc(sizeof *victim->st);
                if (!victim->mask) victim->mask = malloc(mask_bytes);
                if (victim->st && victim->mask) {
                    jgram_copy(victim->st, &c->st);
                    memcpy(victim->mask, c->mask, mask_bytes);
                    victim->hash = h;
                    victim->used = ++c->clock;
                    victim->is_set = true;
                }
            }
        }
        if (mask_empty(c->mask, nw) && need > 0) force_completion(c, need);
    }
    if (can_end)
        for (int i = 0; i < nw; i++) c->mask[i] |= v->eos_mask[i];
    if (mask_empty(c->mask, nw)) {
        // No token continues the document (the tokenizer lacks the bytes it needs): end it.
        LOG_WARN("constrained decoding: no token continues the document; ending the output");
        for (int i = 0; i < nw; i++) c->mask[i] = v->eos_mask[i];
    }
    c->stats.us += (clock_now_s() - t0) * 1e6;
    return c->mask;
}

void constrain_stats(const Constrain *c, ConstrainStats *out) { *out = c->stats; }
