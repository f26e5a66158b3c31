/*
 * serve_out.c - one served job's output (serve_out.h): the stop-string filter, the chat
 * parser callback, OpenAI logprobs entries and the forced tool-call opening.
 */
#include "engine/serve/serve_out.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/utf8.h"

// The chat parser's tags (chat.c), which some tokenizers mark special.
static const char *const MARKUP[SERVE_N_MARKUP] = {
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
};

static double jnum(json_object *o, const char *k, double def)
{
    json_object *v;
    return o && json_object_object_get_ex(o, k, &v) ? json_object_get_double(v) : def;
}

static const char *jstr(json_object *o, const char *k)
{
    json_object *v;
    return o && json_object_object_get_ex(o, k, &v) && json_object_is_type(v, json_type_string)
               ? json_object_get_string(v)
               : NULL;
}

// ---------------------------------------------------------------------------
// Chunks of the step

static void out_push(ServeOut *o, JobqChunkKind kind, const char *text, size_t n)
{
    if (o->is_replay || n == 0) return;
    // Merge with the previous chunk of the same kind within the step.
    const bool is_merge =
        o->n_chunks > 0 && o->chunks[o->n_chunks - 1].kind == kind && kind != JOBQ_CHUNK_TOOL;
    if (!is_merge && o->n_chunks == SERVE_MAX_STEP_CHUNKS) {
        o->err = ERR_NOMEM;
        return;
    }
    ServeChunk *c = &o->chunks[is_merge ? o->n_chunks - 1 : o->n_chunks];
    if (!is_merge) *c = (ServeChunk){.kind = kind};
    if (buf_add(&c->text, text, n)) {
        o->err = ERR_NOMEM;
        if (!is_merge) buf_free(&c->text);  // the slot stays unused
        return;
    }
    if (!is_merge) o->n_chunks++;
}

// Content goes through the stop-string filter.
static void out_content(ServeOut *o, const char *text, size_t n)
{
    if (o->is_stopped) return;
    if (o->n_stop == 0) {
        out_push(o, JOBQ_CHUNK_CONTENT, text, n);
        return;
    }
    if (buf_add(&o->hold, text, n)) {
        o->err = ERR_NOMEM;
        return;
    }
    // A complete stop string: emit what precedes it and stop.
    size_t cut = o->hold.n;
    for (int i = 0; i < o->n_stop; i++) {
        const char *hit = strstr(o->hold.p, o->stop[i]);
        if (hit && (size_t) (hit - o->hold.p) < cut) cut = (size_t) (hit - o->hold.p);
    }
    if (cut < o->hold.n) {
        out_push(o, JOBQ_CHUNK_CONTENT, o->hold.p, cut);
        buf_clear(&o->hold);
        o->is_stopped = true;
        return;
    }
    // Otherwise keep the longest suffix that is a prefix of some stop string.
    size_t keep = 0;
    for (int i = 0; i < o->n_stop; i++) {
        const size_t ls = strlen(o->stop[i]);
        for (size_t k = ls - 1; k > keep; k--)
            if (k <= o->hold.n && !memcmp(o->hold.p + o->hold.n - k, o->stop[i], k)) {
                keep = k;
                break;
            }
    }
    out_push(o, JOBQ_CHUNK_CONTENT, o->hold.p, o->hold.n - keep);
    buf_consume(&o->hold, o->hold.n - keep);
}

static Err on_chat_event(void *user, const ChatEvent *ev)
{
    ServeOut *o = user;
    if (ev->kind == CHAT_EVENT_REASONING) {
        out_push(o, JOBQ_CHUNK_REASONING, ev->text, ev->n_text);
    } else if (ev->kind == CHAT_EVENT_CONTENT) {
        out_content(o, ev->text, ev->n_text);
    } else {
        json_object *j = json_object_new_object();
        json_object_object_add(j, "name", json_object_new_string(ev->name));
        json_object_object_add(j, "arguments", json_object_new_string(ev->arguments));
        const char *t = json_object_to_json_string_ext(j, JSON_C_TO_STRING_PLAIN);
        out_push(o, JOBQ_CHUNK_TOOL, t, strlen(t));
        json_object_put(j);
    }
    return o->err;
}

// Text of the output: through the parser (chat) or straight to content.
static void out_text(ServeOut *o, const char *text, size_t n)
{
    if (o->has_parser) chat_parser_feed(&o->parser, text, n, on_chat_event, o);
    else out_content(o, text, n);
    if (o->force != SERVE_FORCE_WAIT_THINK) return;
    // Spot "</think>" in this piece or across the boundary with the 7 bytes before it.
    static const char end_think[] = "</think>";
    char edge[sizeof o->tail + 7];
    const size_t head = n < 7 ? n : 7;
    memcpy(edge, o->tail, (size_t) o->n_tail);
    memcpy(edge + o->n_tail, text, head);
    const size_t m = (size_t) o->n_tail + head;
    bool found = false;
    for (size_t i = 0; i + 8 <= m && !found; i++) found = !memcmp(edge + i, end_think, 8);
    for (size_t i = 0; i + 8 <= n && !found; i++) found = !memcmp(text + i, end_think, 8);
    if (found) {
        o->force = SERVE_FORCE_DUE;
        return;
    }
    // Keep the last 7 bytes seen (of the piece, topped up from the old tail when short).
    char last[16];
    memcpy(last, o->tail, (size_t) o->n_tail);
    const size_t take = n < 7 ? n : 7;
    memcpy(last + o->n_tail, text + n - take, take);
    const size_t k = (size_t) o->n_tail + take, keep = k < 7 ? k : 7;
    memcpy(o->tail, last + k - keep, keep);
    o->n_tail = (int) keep;
}

// ---------------------------------------------------------------------------
// Log-probabilities (OpenAI's logprobs / top_logprobs)

// {"token", "logprob", "bytes"} of token id: the bytes it contributes to the text
// (tok_token_bytes: with a byte-level decoder possibly part of a character, which clients
// join across tokens, as OpenAI's bytes are meant), and as text those bytes with each
// ill-formed piece replaced by U+FFFD.
static json_object *lp_entry(const Tokenizer *tok, int32_t id, double logprob)
{
    char *raw = NULL, *text = NULL;
    size_t n = 0, n_text = 0;
    json_object *o = json_object_new_object(), *bytes = json_object_new_array();
    if (tok_token_bytes(tok, id, &raw, &n) == ERR_OK
        && utf8_lossy((const uint8_t *) raw, n, &text, &n_text) == ERR_OK) {
        for (size_t i = 0; i < n; i++)
            json_object_array_add(bytes, json_object_new_int((unsigned char) raw[i]));
        json_object_object_add(o, "token", json_object_new_string_len(text, (int) n_text));
    } else {
        json_object_object_add(o, "token", json_object_new_string(""));
    }
    json_object_object_add(o, "logprob", json_object_new_double(logprob));
    json_object_object_add(o, "bytes", bytes);
    free(text);
    free(raw);
    return o;
}

// ---------------------------------------------------------------------------

// A grammar that did not compile: e, with *msg the client's message for ERR_INVAL
// ("<what>: <detail>"; static storage, engine thread only).
static Err grammar_error(Err e, const char *what, const char *detail, const char **msg)
{
    static char why[200];
    if (e == ERR_INVAL) {
        snprintf(why, sizeof why, "%s: %s", what, detail);
        *msg = why;
    }
    return e;
}

Err serve_out_init(ServeOut *o, const Tokenizer *tok, const JobqJob *job, uint64_t seed_default,
                   const char **msg)
{
    memset(o, 0, sizeof *o);
    o->tok = tok;
    o->n_top_logprobs = -1;
    *msg = "out of memory";
    json_object *req = json_tokener_parse(job->request_json), *v;
    Err err = ERR_NOMEM;
    o->is_chat = !strcmp(job->kind, "chat");
    SamplerParams sp = sampler_default_params();
    sp.temperature = (float) jnum(req, "temperature", 1.0);
    sp.top_p = (float) jnum(req, "top_p", 1.0);
    sp.top_k = (int) jnum(req, "top_k", 0);
    sp.min_p = (float) jnum(req, "min_p", 0.0);
    sp.presence_penalty = (float) jnum(req, "presence_penalty", 0.0);
    sp.frequency_penalty = (float) jnum(req, "frequency_penalty", 0.0);
    sp.repetition_penalty = (float) jnum(req, "repetition_penalty", 1.0);
    sp.seed = req && json_object_object_get_ex(req, "seed", &v) ? (uint64_t) json_object_get_int64(v)
                                                                : seed_default;
    o->sampling = sp;
    if (req && json_object_object_get_ex(req, "stop", &v) && json_object_is_type(v, json_type_array))
        for (size_t i = 0; i < json_object_array_length(v) && o->n_stop < SERVE_MAX_STOP; i++) {
            const char *t = json_object_get_string(json_object_array_get_idx(v, i));
            if (t && *t && !(o->stop[o->n_stop++] = strdup(t))) goto done;
        }
    const bool in_reasoning = req && json_object_object_get_ex(req, "in_reasoning", &v) &&
                              json_object_get_boolean(v);
    o->in_reasoning = in_reasoning;
    // response_format (fcgi stores {"type": "json_object"} or {"type": "json_schema",
    // "schema": S}); "text" or none: unconstrained.
    json_object *rf = NULL;
    if (req && json_object_object_get_ex(req, "response_format", &rf) && rf) {
        const char *type = jstr(rf, "type");
        json_object *schema = NULL;
        if (type && !strcmp(type, "json_schema")) json_object_object_get_ex(rf, "schema", &schema);
        if (type && (!strcmp(type, "json_object") || schema)) {
            char detail[160];
            const Err e = jgram_compile(schema, &o->grammar, detail, sizeof detail);
            if (e) {
                err = grammar_error(e, "response_format", detail, msg);
                goto done;
            }
        }
    }
    if (req && json_object_object_get_ex(req, "logprobs", &v) && json_object_get_boolean(v)) {
        const int n_top = (int) jnum(req, "top_logprobs", 0);
        o->n_top_logprobs = n_top < 0 ? 0 : n_top > SERVE_MAX_TOP ? SERVE_MAX_TOP : n_top;
    }
    json_object *tools = NULL;
    if (req) json_object_object_get_ex(req, "tools", &tools);
    if (tok_stream_create(&o->ts, tok, true)) goto done;
    if (o->is_chat) {
        if (chat_parser_init(&o->parser, in_reasoning, tools)) goto done;
        o->has_parser = true;
        for (int i = 0; i < SERVE_N_MARKUP; i++) {
            TokIds t = {0};
            o->markup_ids[i] = -1;
            if (tok_encode(tok, MARKUP[i], strlen(MARKUP[i]), false, &t) == ERR_OK && t.n == 1 &&
                tok_is_special(tok, t.ids[0]))
                o->markup_ids[i] = t.ids[0];
            tok_ids_free(&t);
        }
    }
    // tool_choice "required" or a named function (fcgi stores "function" + tool_choice_name).
    const char *choice = jstr(req, "tool_choice"), *name = jstr(req, "tool_choice_name");
    const bool is_named = choice && !strcmp(choice, "function") && name;
    char opening[320];  // a forced tool call's opening
    bool is_tool_grammar = false;
    if (o->is_chat && tools && choice && (is_named || !strcmp(choice, "required"))) {
        const int n_open = snprintf(opening, sizeof opening, "<tool_call>%s", is_named ? name : "");
        TokIds ids = {0};
        if (n_open < 0 || (size_t) n_open >= sizeof opening ||
            tok_encode(tok, opening, (size_t) n_open, false, &ids) || ids.n == 0 ||
            ids.n > SERVE_MAX_FORCE) {
            tok_ids_free(&ids);
            *msg = "the forced tool call could not be tokenized";
            err = ERR_INVAL;
            goto done;
        }
        memcpy(o->force_ids, ids.ids, ids.n * sizeof *ids.ids);
        o->n_force = (int) ids.n;
        tok_ids_free(&ids);
        o->force = in_reasoning ? SERVE_FORCE_WAIT_THINK : SERVE_FORCE_DUE;
        // The call after the opening: a tool's name (required), then its arguments.
        if (!o->grammar) {
            char detail[160];
            const Err e = jgram_compile_tools(tools, is_named ? name : NULL, &o->grammar, detail, sizeof detail);
            if (e) {
                err = grammar_error(e, "tools", detail, msg);
                goto done;
            }
            is_tool_grammar = true;
        }
    }
    // What the output shows before its grammar starts: the end of the reasoning, then (a
    // tool call) the forced opening.
    if (o->grammar && in_reasoning && !(o->wait[o->n_wait++] = strdup("</think>"))) goto done;
    if (is_tool_grammar && !(o->wait[o->n_wait++] = strdup(opening))) goto done;
    err = ERR_OK;
done:
    json_object_put(req);
    if (err) serve_out_free(o);
    return err;
}

// A token through the detokenizer, the parser/stop filter and the forcing state.
static Err out_token(ServeOut *o, int32_t id)
{
    if (o->con && !constrain_token(o->con, id) && !o->is_con_broken) {
        o->is_con_broken = true;
        LOG_WARN("output token %d leaves the response_format grammar; the rest is unconstrained", id);
    }
    if (o->force == SERVE_FORCE_DUE) {
        if (id != o->force_ids[o->n_forced]) {
            o->force = SERVE_FORCE_NONE;  // output that is not the opening (a resumed job)
        } else if (++o->n_forced == o->n_force) {
            o->force = SERVE_FORCE_NONE;
            o->is_force_used = true;
        }
    }
    for (int i = 0; i < SERVE_N_MARKUP && o->is_chat; i++)
        if (id == o->markup_ids[i]) {
            out_text(o, MARKUP[i], strlen(MARKUP[i]));
            return o->err;
        }
    const char *piece;
    size_t n_piece;
    if (tok_stream_feed(o->ts, id, &piece, &n_piece) == ERR_OK) out_text(o, piece, n_piece);
    return o->err;
}

Err serve_out_replay(ServeOut *o, const int32_t *ids, int n)
{
    o->is_replay = true;
    for (int i = 0; i < n && !o->err; i++) out_token(o, ids[i]);
    o->is_replay = false;  // hold keeps what was held back at the crash, as it was then
    return o->err;
}

Err serve_out_token(ServeOut *o, int32_t id, float logprob, const int32_t *top_ids,
                    const float *top_logprobs, int n_top)
{
    if (o->n_ids == o->cap_ids) {
        const int cap = o->cap_ids ? 2 * o->cap_ids : 4;
        int32_t *ids = realloc(o->ids, (size_t) cap * sizeof *ids);
        if (!ids) return o->err = ERR_NOMEM;
        o->ids = ids;
        o->cap_ids = cap;
    }
    o->ids[o->n_ids++] = id;
    if (o->n_top_logprobs >= 0) {
        if (!o->lp && !(o->lp = json_object_new_array())) return o->err = ERR_NOMEM;
        json_object *entry = lp_entry(o->tok, id, logprob), *alts = json_object_new_array();
        const int k_max = n_top < o->n_top_logprobs ? n_top : o->n_top_logprobs;
        for (int k = 0; k < k_max; k++)
            json_object_array_add(alts, lp_entry(o->tok, top_ids[k], top_logprobs[k]));
        json_object_object_add(entry, "top_logprobs", alts);
        json_object_array_add(o->lp, entry);
    }
    return out_token(o, id);
}

Err serve_out_end(ServeOut *o)
{
    if (o->is_stopped) return o->err;
    const char *piece;
    size_t n_piece;
    if (tok_stream_flush(o->ts, &piece, &n_piece) == ERR_OK && n_piece) out_text(o, piece, n_piece);
    if (o->has_parser) {
        // A forced call the model did not close: close it (the client asked for a call).
        if (o->is_force_used && o->parser.n_tool_calls == 0)
            chat_parser_feed(&o->parser, "</tool_call>", 12, on_chat_event, o);
        chat_parser_finish(&o->parser, on_chat_event, o);
        chat_parser_free(&o->parser);
        o->has_parser = false;
    }
    if (!o->is_stopped && o->hold.n) {
        out_push(o, JOBQ_CHUNK_CONTENT, o->hold.p, o->hold.n);
        buf_clear(&o->hold);
    }
    return o->err;
}

const int32_t *serve_out_force(ServeOut *o, int *n)
{
    *n = 0;
    if (o->force != SERVE_FORCE_DUE || o->is_force_sent) return NULL;
    o->is_force_sent = true;
    *n = o->n_force - o->n_forced;
    return o->force_ids + o->n_forced;
}

const JobqChunk *serve_out_chunks(ServeOut *o, int *n)
{
    *n = 0;
    free(o->lp_text);
    o->lp_text = NULL;
    if (o->lp && !(o->lp_text = strdup(json_object_to_json_string_ext(o->lp, JSON_C_TO_STRING_PLAIN))))
        return NULL;
    for (int i = 0; i < o->n_chunks; i++)
        o->out[i] = (JobqChunk){o->chunks[i].kind, o->chunks[i].text.p, i == 0 ? o->ids : NULL,
                                i == 0 ? o->n_ids : 0, i == 0 ? o->lp_text : NULL};
    *n = o->n_chunks;
    if (*n == 0 && o->n_ids > 0) {
        o->out[0] = (JobqChunk){JOBQ_CHUNK_CONTENT, "", o->ids, o->n_ids, o->lp_text};
        *n = 1;
    }
    return o->out;
}

void serve_out_clear_step(ServeOut *o)
{
    for (int i = 0; i < o->n_chunks; i++) buf_free(&o->chunks[i].text);
    o->n_chunks = 0;
    o->n_ids = 0;
    json_object_put(o->lp);
    o->lp = NULL;
}

Err serve_out_constrain(ServeOut *o, const ConstrainVocab *cv)
{
    if (!o->grammar) return ERR_OK;
    JgramGrammar *g = o->grammar;
    o->grammar = NULL;  // constrain_create takes it
    return constrain_create(cv, g, (const char *const *) o->wait, o->n_wait, &o->con);
}

const uint32_t *serve_out_mask(ServeOut *o, int n_left)
{
    return o->con ? constrain_mask(o->con, n_left) : NULL;
}

void serve_out_free(ServeOut *o)
{
    jgram_free(o->grammar);
    constrain_destroy(o->con);
    for (int i = 0; i < o->n_wait; i++) free(o->wait[i]);
    serve_out_clear_step(o);
    for (int i = 0; i < o->n_stop; i++) free(o->stop[i]);
    buf_free(&o->hold);
    free(o->ids);
    free(o->lp_text);
    if (o->has_parser) chat_parser_free(&o->parser);
    tok_stream_destroy(o->ts);
    memset(o, 0, sizeof *o);
}
