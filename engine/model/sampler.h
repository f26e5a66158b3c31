/*
 * sampler.h - choose the next token from one row of logits.
 *
 * Optional penalties on the tokens seen so far (repetition as in Hugging Face: divide a
 * positive logit, multiply a negative one; presence and frequency as in OpenAI: subtract
 * presence once and frequency per occurrence), then temperature, then top-k, top-p and
 * min-p on the remaining distribution, then one draw. Temperature 0 is greedy: the
 * largest logit, ties to the lowest id. The generator is xorshift64* seeded through
 * splitmix64, so a seed reproduces the same tokens on every machine.
 *
 * The draw is a function of the logits, the parameters and the generator state alone; the
 * filters' ranking is computed over the candidates that can change it (sampler.c says why
 * that is exact), so a 154,880-token row costs a scan and a short sort, not a full sort.
 *
 * Ownership: sampler_init() allocates scratch sized for the vocabulary (about 44 bytes a
 *            token, touched only as a path needs it) and sampler_free() releases it.
 *            Logits are borrowed and are overwritten.
 * Threads:   one thread at a time per Sampler; each sequence owns one. Samplers share
 *            nothing, so different Samplers may run on different threads at once (the
 *            pipeline's last rank samples a step's sequences in parallel).
 * Errors:    only sampler_init() can fail (ERR_NOMEM, ERR_INVAL for parameters out of
 *            range: fcgi/ validates requests, the CLI reports them).
 */
#ifndef ENGINE_MODEL_SAMPLER_H
#define ENGINE_MODEL_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model/topk.h"
#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct SamplerParams {
    float temperature;         // 0 means greedy; otherwise > 0
    int top_k;                 // 0 disables
    float top_p;               // in (0, 1]; 1 disables
    float min_p;               // in [0, 1]; 0 disables
    float repetition_penalty;  // >= 1 (1 or 0 disables)
    float presence_penalty;    // 0 disables
    float frequency_penalty;   // 0 disables
    uint64_t seed;             // same seed and same logits give the same token
} SamplerParams;

// The defaults: greedy, every filter off, seed 0.
SamplerParams sampler_default_params(void);

typedef struct Sampler {
    SamplerParams params;
    uint64_t rng;           // xorshift64* state, advanced per draw
    int vocab_size;         // entries in every logits row
    TopkEntry *candidates;  // owned scratch, vocab_size entries: scaled logit, token id
    uint64_t *order;        // owned scratch, 2 * vocab_size: packed (rank, id), radix sort
    double *weights;        // owned scratch, vocab_size: exp(scaled - max) per candidate
    int32_t *counts;        // owned scratch for penalties, vocab_size entries
    double *block_cum;      // owned scratch: the draw's running sum at each SAMPLER_SCAN_BLOCK
    int pend_best;          // between sampler_begin and sampler_finish: the largest logit's id
    double pend_max;        // ... and the largest scaled logit
} Sampler;

enum { SAMPLER_SCAN_BLOCK = 4096 };  // entries per block of the unfiltered draw's scan

// Whether sampler_init() accepts these parameters (ERR_INVAL, logged, when not), without
// allocating its scratch (44 bytes per vocabulary token).
Err sampler_check_params(SamplerParams params);

// Prepare s for a vocabulary of vocab_size tokens. On failure *s is left zeroed, so
// sampler_free(s) is still safe to call.
Err sampler_init(Sampler *s, int vocab_size, SamplerParams params);

// Release what sampler_init() allocated and zero *s. Safe on a zeroed Sampler.
void sampler_free(Sampler *s);

// Apply the penalties for the tokens history[0..n) to logits (vocab_size floats) in place.
// A no-op when every penalty is disabled.
void sampler_apply_penalties(Sampler *s, float *logits, const int32_t *history, int n);

// Return the next token. logits holds vocab_size floats; it is read, not kept, and may be
// modified.
int32_t sampler_sample(Sampler *s, float *logits);

// sampler_sample in three parts, so that threads can share one row's work (the pipeline's
// last rank samples a step's rows this way): sampler_begin chooses the token at once
// (returns true, *token set) unless the row takes the unfiltered draw at temperature > 0;
// then every chunk c of n_chunks (any n_chunks >= 1, the chunks on any threads in any
// order) goes through sampler_weights, the costly part (an exp() per token), and
// sampler_finish draws. The token and the generator state are sampler_sample's, bit for
// bit. logits must not change in between.
bool sampler_begin(Sampler *s, float *logits, int32_t *token);
void sampler_weights(Sampler *s, const float *logits, int chunk, int n_chunks);
int32_t sampler_finish(Sampler *s);

// A uniform double in [0, 1) from the sampler's generator (exposed for tests).
double sampler_uniform(Sampler *s);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_MODEL_SAMPLER_H
