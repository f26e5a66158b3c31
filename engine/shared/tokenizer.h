/*
 * tokenizer.h - Hugging Face tokenizer.json (BPE) in C: encode text to ids, decode ids to
 * text, and a streaming decoder that never splits a UTF-8 character.
 *
 * We implement the subset of the `tokenizers` library (0.23) that BPE checkpoints use:
 * added/special tokens matched on the raw text first (longest match, with their lstrip,
 * rstrip, single_word and normalized flags), then normalizers (NFC/NFD/NFKC/NFKD through
 * utf8proc, Sequence, Replace, Lowercase, Prepend, Strip), pre-tokenizers (Split with PCRE2
 * regexes in UTF+UCP mode, ByteLevel, Digits, Metaspace, Sequence), the BPE model (merge
 * ranks, byte_fallback, unk, ignore_merges, subword prefix/suffix), the post-processor
 * (TemplateProcessing, ByteLevel, RobertaProcessing; applied only when add_special is true)
 * and decoders (ByteLevel, Sequence, Replace, Strip, Fuse, ByteFallback, Metaspace).
 * Goldens in tests/golden/tokenizer/ hold ids produced by HF tokenizers on real files.
 *
 * Invalid UTF-8 input is replaced like Rust's String::from_utf8_lossy (U+FFFD per maximal
 * invalid subpart) before encoding, which is what HF sees when Python hands it such text.
 *
 * Ownership: tok_load*() returns a Tokenizer the caller frees with tok_destroy(). Arrays
 *            returned through TokIds / out pointers are owned by the caller as documented
 *            per function. TokStream borrows its Tokenizer, which must outlive it.
 * Threads:   a loaded Tokenizer is read-only except for an internal word cache guarded by
 *            a mutex: tok_encode, tok_decode and the lookups may be called from any number
 *            of threads at once. A TokStream belongs to one thread at a time.
 * Errors:    ERR_IO (file unreadable), ERR_FORMAT (malformed JSON or a field of the wrong
 *            JSON type), ERR_INVAL (a component type or option we do not support; the log
 *            names its JSON path, e.g. "pre_tokenizer.pretokenizers[1].type"), ERR_NOMEM.
 *            Each failure is logged once, where it is detected.
 */
#ifndef ENGINE_SHARED_TOKENIZER_H
#define ENGINE_SHARED_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct Tokenizer Tokenizer;
typedef struct TokStream TokStream;

// A growable array of token ids. Zero-initialise before first use; free with tok_ids_free.
typedef struct TokIds {
    int32_t *ids;  // [n]
    size_t n;
    size_t cap;
} TokIds;

// ---------------------------------------------------------------------------
// Loading

// Load a tokenizer.json file. On success *out is a new Tokenizer (free with tok_destroy);
// on failure *out is NULL and the log says why (path and JSON field).
Err tok_load(Tokenizer **out, const char *path);

// Same as tok_load, from n_bytes of JSON in memory (need not be NUL-terminated; borrowed).
Err tok_load_json(Tokenizer **out, const char *json, size_t n_bytes);

// Free a tokenizer; NULL is allowed.
void tok_destroy(Tokenizer *tok);

// ---------------------------------------------------------------------------
// Encoding and decoding

// Encode n_bytes of text (UTF-8; invalid bytes are replaced by U+FFFD) and append the ids
// to *out (which may already hold ids). add_special applies the post-processor (BOS/EOS
// and the like); without it no special token is added, though special-token strings in
// the text are still recognised as their ids, as HF does. On failure *out keeps its
// previous length.
Err tok_encode(const Tokenizer *tok, const char *text, size_t n_bytes, bool add_special,
               TokIds *out);

// Decode n_ids ids to text like HF's tokenizer.decode(ids, skip_special_tokens).
// On success *out_text is a malloc'd NUL-terminated string of *out_n bytes that the caller
// frees. Ids outside the vocabulary are skipped, as HF does.
Err tok_decode(const Tokenizer *tok, const int32_t *ids, size_t n_ids, bool skip_special,
               char **out_text, size_t *out_n);

// The bytes token id contributes to decoded text before any UTF-8 repair: with a lone
// ByteLevel decoder, its unmapped bytes (possibly part of a character, where tok_decode
// of the id alone gives U+FFFD); otherwise tok_decode of the id alone. *out_text is
// malloc'd, NUL-terminated, *out_n bytes; the caller frees it.
Err tok_token_bytes(const Tokenizer *tok, int32_t id, char **out_text, size_t *out_n);

// Release the array of ids and zero *ids; NULL and a zeroed TokIds are allowed.
void tok_ids_free(TokIds *ids);

// ---------------------------------------------------------------------------
// Lookups

// Number of ids: one more than the largest id of the vocabulary or added tokens.
int32_t tok_n_vocab(const Tokenizer *tok);

// Id of a token given by its exact string (an added/special token such as "<|user|>", or
// a vocabulary entry in its raw form, e.g. "Ġthe"); -1 when there is none.
int32_t tok_token_to_id(const Tokenizer *tok, const char *token);

// Raw string of token id (an added token's content or the vocabulary entry); NULL when id
// is out of range or unused. Static for the tokenizer's lifetime.
const char *tok_id_to_token(const Tokenizer *tok, int32_t id);

// True when id is an added token marked "special" (skipped by skip_special decoding).
bool tok_is_special(const Tokenizer *tok, int32_t id);

// Ids the post-processor puts before and after a single sequence when add_special is
// true: at most cap ids are written to ids[]; returns how many there are in total.
size_t tok_special_prefix(const Tokenizer *tok, int32_t *ids, size_t cap);
size_t tok_special_suffix(const Tokenizer *tok, int32_t *ids, size_t cap);

// ---------------------------------------------------------------------------
// Streaming decoder: feed ids one at a time, get the text they add. Pieces never end in
// the middle of a UTF-8 character, and the concatenation of every piece plus the final
// flush equals tok_decode() of all ids fed so far with the same skip_special.

// Create a stream over tok (borrowed; must outlive the stream).
Err tok_stream_create(TokStream **out, const Tokenizer *tok, bool skip_special);

// Feed one id. *piece/*n_piece receive the newly complete text (possibly empty); the
// pointer is owned by the stream and valid until the next call on it.
Err tok_stream_feed(TokStream *s, int32_t id, const char **piece, size_t *n_piece);

// End of ids: return whatever is still held back (an incomplete character decodes to
// U+FFFD as in tok_decode). The stream may then be reused from an empty state.
Err tok_stream_flush(TokStream *s, const char **piece, size_t *n_piece);

// Free a stream; NULL is allowed.
void tok_stream_destroy(TokStream *s);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_TOKENIZER_H
