/*
 * serve_out.h - one served job's output: request options, detokenizer, chat parser, stop
 * strings, logprobs and the forced tool-call opening, turned into the chunks that
 * glmspark-engine commits each step (engine/serve/main_engine.c).
 *
 * Tokens go in one at a time (serve_out_token) as the scheduler samples them. Each goes
 * through the streaming detokenizer (special tokens skipped, except GLM's chat markup
 * such as <think> and <tool_call>, whose text the parser needs even where a tokenizer
 * marks them special) and, for chat jobs, the chat parser (reasoning / content / tool
 * calls); content goes through the stop-string filter, which holds back
 * text that could still become a stop string, so no stop string ever reaches a client.
 * The step's tokens, their logprobs and the chunks they produced are taken with
 * serve_out_chunks() and committed in one jobq_append_batch.
 *
 * Resume: a re-claimed job replays its committed ids (serve_out_replay) through the same
 * path without emitting anything, which restores the detokenizer, parser, stop-filter
 * and forcing state exactly as they were when those ids were generated.
 *
 * response_format: the request's schema is compiled by serve_out_init (a bad one is
 * ERR_INVAL); serve_out_constrain() attaches the vocabulary-mask constraint (constrain.h)
 * that every output token then goes through, and serve_out_mask() gives the mask for the
 * next one. A forced tool call is constrained the same way after its opening: the name
 * (for "required") and the arguments follow the tools' parameter schemas.
 *
 * tool_choice "required" / {"function": NAME}: the output must open a tool call. The
 * opening ("<tool_call>" or "<tool_call>NAME", tokenized) is forced where content starts:
 * at once when the prompt does not open a reasoning block, else right after the model's
 * "</think>". serve_out_force() hands the ids still to force to the caller (sched_force).
 * When generation ends inside the forced call, serve_out_end() closes it ("</tool_call>"),
 * so the client gets the call it asked for (its arguments as far as they were written).
 *
 * Ownership: ServeOut owns its copies and state; it borrows the Tokenizer (which must
 *            outlive it). Chunks from serve_out_chunks() stay valid until
 *            serve_out_clear_step() or serve_out_free().
 * Threads:   one thread per ServeOut.
 * Errors:    serve_out_init: ERR_INVAL with a client message in *msg (bad request fields),
 *            ERR_NOMEM. serve_out_token/replay/end: ERR_NOMEM.
 */
#ifndef ENGINE_SERVE_SERVE_OUT_H
#define ENGINE_SERVE_SERVE_OUT_H

#include <json-c/json.h>
#include <stdbool.h>
#include <stdint.h>

#include "engine/model/sampler.h"
#include "engine/serve/constrain.h"
#include "engine/serve/jobq.h"
#include "engine/shared/buf.h"
#include "engine/shared/chat.h"
#include "engine/shared/err.h"
#include "engine/shared/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
    SERVE_MAX_STOP = 4,
    SERVE_MAX_STEP_CHUNKS = 16,
    SERVE_MAX_TOP = 20,
    SERVE_MAX_FORCE = 64,
    SERVE_N_MARKUP = 8,
};

typedef struct ServeChunk {
    JobqChunkKind kind;
    Buf text;  // owned; text.p is what the chunk says
} ServeChunk;

typedef enum ServeForce {
    SERVE_FORCE_NONE,        // no tool call to force (or done)
    SERVE_FORCE_WAIT_THINK,  // forcing starts after the model's "</think>"
    SERVE_FORCE_DUE,         // the next outputs are the forced ids
} ServeForce;

typedef struct ServeOut {
    const Tokenizer *tok;  // borrowed
    bool is_chat;
    bool is_replay;   // restoring state from committed ids: emit nothing
    bool is_stopped;  // a stop string matched: the output is complete
    char *stop[SERVE_MAX_STOP];
    int n_stop;
    Buf hold;  // content held back while it could become a stop string
    ChatParser parser;
    bool has_parser;
    TokStream *ts;
    // Request options
    SamplerParams sampling;
    int n_top_logprobs;  // -1: no logprobs
    // This step's output
    ServeChunk chunks[SERVE_MAX_STEP_CHUNKS];
    int n_chunks;
    int32_t *ids;  // [n_ids] tokens of this step
    int n_ids, cap_ids;
    json_object *lp;  // this step's logprobs entries (array) or NULL
    char *lp_text;    // lp serialised by serve_out_chunks()
    JobqChunk out[SERVE_MAX_STEP_CHUNKS];
    // Forced tool-call opening
    ServeForce force;
    int32_t force_ids[SERVE_MAX_FORCE];
    int n_force, n_forced;  // opening length; outputs of it already seen
    bool is_force_sent;     // serve_out_force() handed the rest to the caller
    bool is_force_used;     // the whole opening was output
    char tail[8];           // the last output bytes, to spot "</think>"
    int n_tail;
    // Chat markup ("<think>", "<tool_call>", "<arg_key>", ...) that the tokenizer marks
    // special: the detokenizer skips special ids, the parser needs their text.
    int32_t markup_ids[SERVE_N_MARKUP];
    // response_format: the request's grammar (until serve_out_constrain takes it) and the
    // constraint fed every output token
    JgramGrammar *grammar;
    bool in_reasoning;  // the prompt opens a reasoning block
    char *wait[2];      // what the output shows before the grammar starts (constrain.h)
    int n_wait;
    Constrain *con;
    bool is_con_broken;  // an output token left the grammar (logged once)
    Err err;  // first error inside a parser callback
} ServeOut;

// Set up for a claimed job: parse its request (sampling, stop strings, logprobs, tools,
// tool_choice, reasoning) and create the detokenizer and parser. seed_default seeds the
// sampler when the request has no seed. On ERR_INVAL *msg is a message for the client.
Err serve_out_init(ServeOut *o, const Tokenizer *tok, const JobqJob *job, uint64_t seed_default,
                   const char **msg);

// Constrain the output (a request with response_format, or with tool_choice "required" or
// named for the call's name and arguments, has o->grammar after serve_out_init). Call
// before serve_out_replay. ERR_NOMEM.
Err serve_out_constrain(ServeOut *o, const ConstrainVocab *cv);

// The mask for the next token with n_left tokens to max_tokens (constrain_mask), or NULL
// when the output is not constrained (now).
const uint32_t *serve_out_mask(ServeOut *o, int n_left);

// Replay committed output ids[0..n) without emitting.
Err serve_out_replay(ServeOut *o, const int32_t *ids, int n);

// One generated token (not an end-of-sequence id) with its logprob and alternatives
// (n_top of them; ignored unless the request asked for logprobs).
Err serve_out_token(ServeOut *o, int32_t id, float logprob, const int32_t *top_ids,
                    const float *top_logprobs, int n_top);

// End of output (not on cancel or a matched stop string): flush what the detokenizer,
// the parser and the stop filter hold, closing a forced tool call left open.
Err serve_out_end(ServeOut *o);

// The forced ids still to come, once (then NULL): when non-NULL, pass them to
// sched_force. *n gets their count.
const int32_t *serve_out_force(ServeOut *o, int *n);

// This step's chunks for jobq (ids and logprobs on the first; an empty content chunk
// carries them when the step produced no text). *n gets the count (0: nothing to commit).
// NULL on ERR_NOMEM.
const JobqChunk *serve_out_chunks(ServeOut *o, int *n);

// Forget this step's chunks and ids (after a commit).
void serve_out_clear_step(ServeOut *o);

// Release everything; zeroes *o. Safe on a zeroed ServeOut.
void serve_out_free(ServeOut *o);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SERVE_SERVE_OUT_H
