/*
 * constrain.h - constrained decoding: the vocabulary mask that keeps a job's output a
 * valid JSON document of its response_format (engine/shared/json_grammar.h).
 *
 * ConstrainVocab is built once per tokenizer: every token's bytes (tok_token_bytes;
 * special tokens are never allowed inside a document, end-of-sequence ids only at its
 * end), a trie over them, and "plain" tokens (no '"', '\\' or control byte, valid UTF-8
 * starting on a character, the last one possibly cut short) grouped by the characters
 * they start. A mask is a depth-first walk of the trie that feeds each edge's byte to the
 * automaton and prunes the subtree where it is refused; inside a string, plain tokens are
 * taken wholesale from a precomputed mask and only the subtrees holding other tokens are
 * walked. Masks of recurring states (inside a string, between keys) come from a small
 * per-job cache.
 *
 * Running out of max_tokens: when the tokens left could not finish the document, only
 * tokens along the shortest completion are allowed (jgram_completion), so the output ends
 * as a whole document when max_tokens allows it at all; within 256 tokens of that point
 * every candidate token is also checked to leave a completion that still fits.
 *
 * Reasoning: a job whose prompt opens a reasoning block is unconstrained until the model
 * writes "</think>"; the document starts after it. Tool calls (tool_choice "required" or
 * named): the grammar of jgram_compile_tools starts after the forced "<tool_call>" opening,
 * and its markup may be special tokens (GLM's "<arg_key>" ...), which are then allowed
 * where the automaton accepts their text.
 *
 * The token bytes assume a byte-level decoder whose output is the concatenation of the
 * tokens' own decodes (GLM's, DeepSeek's, Qwen's and Llama 3's tokenizers are).
 *
 * Ownership: ConstrainVocab borrows nothing after constrain_vocab_create; Constrain owns
 *            its grammar and borrows its vocab (which must outlive it). Masks returned are
 *            owned by the Constrain and valid until its next call.
 * Threads:   one thread for a vocab and all its Constrains (mask walks share the vocab's
 *            scratch).
 * Errors:    ERR_NOMEM; constrain_token returns false for a token the mask did not allow.
 */
#ifndef ENGINE_SERVE_CONSTRAIN_H
#define ENGINE_SERVE_CONSTRAIN_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/shared/err.h"
#include "engine/shared/json_grammar.h"
#include "engine/shared/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ConstrainVocab ConstrainVocab;
typedef struct Constrain Constrain;

// Token bytes and trie for tok, masks of n_vocab bits (the model's vocabulary, which may
// exceed the tokenizer's: the extra ids are never allowed); eos ids end a document.
Err constrain_vocab_create(const Tokenizer *tok, int32_t n_vocab, const int *eos_ids, int n_eos,
                           ConstrainVocab **out);

// Release a vocabulary (its Constrains must be gone). Safe on NULL.
void constrain_vocab_destroy(ConstrainVocab *v);

// 32-bit words of a mask: bit (id % 32) of word id / 32 allows token id.
int constrain_mask_words(const ConstrainVocab *v);

// A job's constraint over grammar g (taken: freed with the Constrain, also on failure).
// wait[0..n_wait) (at most 2, each under 400 bytes): texts the output shows, in order,
// before the grammar starts ("</think>" when the prompt opens a reasoning block; a forced
// tool-call opening); nothing is constrained until then.
Err constrain_create(const ConstrainVocab *v, JgramGrammar *g, const char *const *wait, int n_wait,
                     Constrain **out);

// Release a constraint and its grammar. Safe on NULL.
void constrain_destroy(Constrain *c);

// One output token (sampled, forced or replayed). False when it leaves no valid document
// (the output is then unconstrained from here on, and the caller should say so).
bool constrain_token(Constrain *c, int32_t id);

// The mask for the next token, with n_left tokens (this one included) before max_tokens;
// NULL while unconstrained (reasoning, or after a refused token).
const uint32_t *constrain_mask(Constrain *c, int n_left);

// True when the output so far is a whole document (or nothing is constrained).
bool constrain_is_complete(const Constrain *c);

// Masks computed, cache hits, and the microseconds spent computing (for logs and bench).
typedef struct ConstrainStats {
    uint64_t n_masks, n_cached;
    double us;
} ConstrainStats;

// The constraint's counters so far into *out.
void constrain_stats(const Constrain *c, ConstrainStats *out);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SERVE_CONSTRAIN_H
