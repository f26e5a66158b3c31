/*
 * main_engine.c - glmspark-engine: claim jobs from PostgreSQL, generate, stream chunks back.
 *
 *   glmspark-engine --model DIR --db CONNINFO [--tokenizer FILE] [--model-name NAME]
 *                   [--threads N] [--kv-blocks N] [--name NAME] [--lease-s S]
 *                   [--step-delay-ms MS] [--prefill-slice N] [--recipe FILE]
 *   glmspark-engine --check-recipe FILE
 *
 * --recipe FILE (engine/recipe.h, ops/recipes/) supplies model, model_name, tokenizer,
 * threads, kv_blocks (or max_model_len / block_size), lease_s; flags given on the command
 * line override it wherever they appear. --check-recipe validates a recipe, prints every
 * key's effective value (`key = value`) and exits 0, or 2 naming the bad key.
 *
 * One sequence at a time (continuous batching is the scheduler's job, later): claim a job,
 * prefill its prompt ids plus whatever output earlier attempts committed, then decode
 * token by token. Each step's token goes through the streaming detokenizer and, for chat
 * jobs, the chat parser (reasoning / content / tool calls); the resulting chunks are
 * committed in one statement per step (jobq_append), which also returns the cancel flag.
 * Stop strings are matched on content: text that could still become a stop string is
 * held back until the next step decides it, so no stop string ever reaches a client.
 *
 * Resume: a re-claimed job comes with its committed token ids. We prefill them after the
 * prompt and replay them through the detokenizer and the parser without emitting, which
 * restores their state exactly; generation then continues at the next seq, so a client's
 * stream has no gap and no duplicate.
 *
 * The engine holds the queue's advisory lock (one engine cluster per queue); a second one
 * exits with status 3. It reconnects with backoff when PostgreSQL restarts. SIGTERM and
 * SIGINT stop it after the current step; the job in flight is resumed by the next engine.
 * --step-delay-ms slows decoding and prefill slices (demos and the kill tests in
 * tests/integration).
 *
 * Heartbeats: a prompt is prefilled in slices of --prefill-slice tokens (2048); between
 * slices, and between decode steps, the job's lease and the engine's heartbeat (what
 * /health reads) are renewed every lease_s / 3 seconds (1..5 s), so a long prefill neither
 * loses its job nor makes /health flap.
 */
#include <json-c/json.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/chat.h"
#include "common/err.h"
#include "common/tokenizer.h"
#include "jobq.h"
#include "model.h"
#include "recipe.h"
#include "sampler.h"

static volatile sig_atomic_t is_stopping;

static void on_signal(int sig)
{
    (void) sig;
    is_stopping = 1;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long) (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

typedef struct Engine {
    Model model;
    Backend *be;
    KvCache kv;
    Tokenizer *tok;
    JobQueue *q;
    float *logits;  // [vocab]
    int step_delay_ms;
    int prefill_slice;  // tokens per prefill model_forward call
    int beat_s;         // seconds between heartbeats while working on a job
} Engine;

// ---------------------------------------------------------------------------
// One job's generation state

enum { MAX_STOP = 4, MAX_STEP_CHUNKS = 16 };

typedef struct StepChunk {
    JobqChunkKind kind;
    char *text;  // owned
} StepChunk;

typedef struct Gen {
    bool is_chat;
    bool is_replay;          // restoring state from committed tokens: emit nothing
    char *stop[MAX_STOP];    // owned copies
    int n_stop;
    size_t max_stop_len;
    char *hold;              // content held back while it could become a stop string
    size_t n_hold, cap_hold;
    bool is_stopped;         // a stop string matched
    StepChunk chunks[MAX_STEP_CHUNKS];
    int n_chunks;
    Err err;                 // first error in a callback
} Gen;

static void gen_push(Gen *g, JobqChunkKind kind, const char *text, size_t n)
{
    if (g->is_replay || n == 0) return;
    // Merge with the previous chunk of the same kind within the step.
    if (g->n_chunks > 0 && g->chunks[g->n_chunks - 1].kind == kind && kind != JOBQ_CHUNK_TOOL) {
        StepChunk *c = &g->chunks[g->n_chunks - 1];
        const size_t old = strlen(c->text);
        char *t = realloc(c->text, old + n + 1);
        if (!t) {
            g->err = ERR_NOMEM;
            return;
        }
        memcpy(t + old, text, n);
        t[old + n] = '\0';
        c->text = t;
        return;
    }
    if (g->n_chunks == MAX_STEP_CHUNKS) {
        g->err = ERR_NOMEM;
        return;
    }
    char *t = malloc(n + 1);
    if (!t) {
        g->err = ERR_NOMEM;
        return;
    }
    memcpy(t, text, n);
    t[n] = '\0';
    g->chunks[g->n_chunks++] = (StepChunk){kind, t};
}

// Content goes through the stop-string filter.
static void gen_content(Gen *g, const char *text, size_t n)
{
    if (g->is_stopped) return;
    if (g->n_stop == 0) {
        gen_push(g, JOBQ_CHUNK_CONTENT, text, n);
        return;
    }
    if (g->n_hold + n + 1 > g->cap_hold) {
        size_t cap = g->cap_hold ? g->cap_hold : 64;
        while (cap < g->n_hold + n + 1) cap *= 2;
        char *h = realloc(g->hold, cap);
        if (!h) {
            g->err = ERR_NOMEM;
            return;
        }
        g->hold = h;
        g->cap_hold = cap;
    }
    memcpy(g->hold + g->n_hold, text, n);
    g->n_hold += n;
    g->hold[g->n_hold] = '\0';
    // A complete stop string: emit what precedes it and stop.
    size_t cut = g->n_hold;
    for (int i = 0; i < g->n_stop; i++) {
        const char *hit = strstr(g->hold, g->stop[i]);
        if (hit && (size_t) (hit - g->hold) < cut) cut = (size_t) (hit - g->hold);
    }
    if (cut < g->n_hold) {
        gen_push(g, JOBQ_CHUNK_CONTENT, g->hold, cut);
        g->n_hold = 0;
        g->is_stopped = true;
        return;
    }
    // Otherwise keep the longest suffix that is a prefix of some stop string.
    size_t keep = 0;
    for (int i = 0; i < g->n_stop; i++) {
        const size_t ls = strlen(g->stop[i]);
        for (size_t k = ls - 1; k > keep; k--)
            if (k <= g->n_hold && !memcmp(g->hold + g->n_hold - k, g->stop[i], k)) {
                keep = k;
                break;
            }
    }
    gen_push(g, JOBQ_CHUNK_CONTENT, g->hold, g->n_hold - keep);
    memmove(g->hold, g->hold + g->n_hold - keep, keep);
    g->n_hold = keep;
}

static Err on_chat_event(void *user, const ChatEvent *ev)
{
    Gen *g = user;
    if (ev->kind == CHAT_EVENT_REASONING) {
        gen_push(g, JOBQ_CHUNK_REASONING, ev->text, ev->n_text);
    } else if (ev->kind == CHAT_EVENT_CONTENT) {
        gen_content(g, ev->text, ev->n_text);
    } else {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "name", json_object_new_string(ev->name));
        json_object_object_add(o, "arguments", json_object_new_string(ev->arguments));
        const char *t = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN);
        gen_push(g, JOBQ_CHUNK_TOOL, t, strlen(t));
        json_object_put(o);
    }
    return g->err;
}

static void gen_free(Gen *g)
{
    for (int i = 0; i < g->n_stop; i++) free(g->stop[i]);
    for (int i = 0; i < g->n_chunks; i++) free(g->chunks[i].text);
    free(g->hold);
    memset(g, 0, sizeof *g);
}

static void gen_clear_chunks(Gen *g)
{
    for (int i = 0; i < g->n_chunks; i++) free(g->chunks[i].text);
    g->n_chunks = 0;
}

// Commit this step's chunks with tokens ids[0..n_ids) and their log-probabilities lp_json
// (or NULL) attached to the first chunk; an empty content chunk carries them when the step
// produced no text.
static Err commit_step(Engine *e, JobqJob *job, Gen *g, const int32_t *ids, int n_ids,
                       const char *lp_json, bool *is_cancelled)
{
    JobqChunk chunks[MAX_STEP_CHUNKS];
    int n = 0;
    for (int i = 0; i < g->n_chunks; i++)
        chunks[n++] = (JobqChunk){g->chunks[i].kind, g->chunks[i].text, i == 0 ? ids : NULL,
                                  i == 0 ? n_ids : 0, i == 0 ? lp_json : NULL};
    if (n == 0) {
        if (n_ids == 0) return ERR_OK;
        chunks[n++] = (JobqChunk){JOBQ_CHUNK_CONTENT, "", ids, n_ids, lp_json};
    }
    const Err err = jobq_append(e->q, job, chunks, n, is_cancelled);
    gen_clear_chunks(g);
    return err;
}

// ---------------------------------------------------------------------------

static double jnum(json_object *o, const char *k, double def)
{
    json_object *v;
    return json_object_object_get_ex(o, k, &v) ? json_object_get_double(v) : def;
}

// ---------------------------------------------------------------------------
// Log-probabilities (OpenAI's logprobs / top_logprobs): of the model's own distribution,
// log_softmax of the raw logits, before penalties and temperature, as OpenAI and vLLM
// report them.

enum { MAX_TOP_LOGPROBS = 20 };

// {"token", "logprob", "bytes"} of token id: its decoded bytes, and as text those bytes
// with each invalid UTF-8 sequence (a piece of a character) replaced by U+FFFD.
static json_object *lp_entry(const Tokenizer *tok, int32_t id, double logprob)
{
    char *text = NULL;
    size_t n = 0;
    json_object *o = json_object_new_object(), *bytes = json_object_new_array();
    char *clean = NULL;
    if (tok_decode(tok, &id, 1, false, &text, &n) == ERR_OK && (clean = malloc(3 * n + 1))) {
        size_t m = 0;
        const unsigned char *u = (const unsigned char *) text;
        for (size_t i = 0; i < n;) {
            json_object_array_add(bytes, json_object_new_int(u[i]));
            size_t len = u[i] < 0x80 ? 1 : (u[i] & 0xE0) == 0xC0 ? 2 : (u[i] & 0xF0) == 0xE0 ? 3
                                                               : (u[i] & 0xF8) == 0xF0 ? 4 : 0;
            bool ok = len > 0 && i + len <= n && u[i] != 0;
            for (size_t k = 1; ok && k < len; k++) ok = (u[i + k] & 0xC0) == 0x80;
            if (ok) {
                for (size_t k = 1; k < len; k++) json_object_array_add(bytes, json_object_new_int(u[i + k]));
                memcpy(clean + m, text + i, len);
                m += len;
                i += len;
            } else {
                memcpy(clean + m, "\xef\xbf\xbd", 3);
                m += 3;
                i++;
            }
        }
        json_object_object_add(o, "token", json_object_new_string_len(clean, (int) m));
    } else {
        json_object_object_add(o, "token", json_object_new_string(""));
    }
    json_object_object_add(o, "logprob", json_object_new_double(logprob));
    json_object_object_add(o, "bytes", bytes);
    free(clean);
    free(text);
    return o;
}

// The logprobs entry of the sampled token `next` given the raw logits [vocab]: its
// log-probability and the n_top most likely tokens, best first. A new JSON string (the
// caller frees it) holding a one-element array, or NULL on OOM.
static char *lp_json_for(const Tokenizer *tok, const float *logits, int vocab, int32_t next,
                         int n_top)
{
    float mx = -INFINITY;
    for (int i = 0; i < vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0;
    for (int i = 0; i < vocab; i++) sum += exp((double) logits[i] - mx);
    const double lse = mx + log(sum);
    int top[MAX_TOP_LOGPROBS];
    int n = 0;
    for (int i = 0; i < vocab && n_top > 0; i++) {  // insertion into a short sorted list
        if (n == n_top && logits[i] <= logits[top[n - 1]]) continue;
        int at = n < n_top ? n++ : n - 1;
        while (at > 0 && logits[top[at - 1]] < logits[i]) {
            top[at] = top[at - 1];
            at--;
        }
        top[at] = i;
    }
    json_object *arr = json_object_new_array();
    json_object *entry = lp_entry(tok, next, (double) logits[next] - lse), *alts = json_object_new_array();
    for (int k = 0; k < n; k++) json_object_array_add(alts, lp_entry(tok, top[k], (double) logits[top[k]] - lse));
    json_object_object_add(entry, "top_logprobs", alts);
    json_object_array_add(arr, entry);
    char *out = strdup(json_object_to_json_string_ext(arr, JSON_C_TO_STRING_PLAIN));
    json_object_put(arr);
    return out;
}

// Generate one claimed job to its end. Returns ERR_DB when the database went away (the
// caller reconnects; the job is resumed from its committed output), else ERR_OK: the job
// was finished, failed or taken from us.
static Err run_job(Engine *e, JobqJob *job)
{
    const ModelConfig *cfg = &e->model.cfg;
    json_object *req = json_tokener_parse(job->request_json), *v;
    Gen g = {0};
    ChatParser parser = {0};
    TokStream *ts = NULL;
    Sampler s = {0};
    KvSeq seq = {0};
    int32_t *ids = NULL;
    Err err = ERR_OK, db_err = ERR_OK;
    const char *fail_msg = NULL, *finish = "length";
    bool is_cancelled = false;
    float *raw = NULL;  // a copy of the step's raw logits when logprobs are wanted
    char *lp = NULL;    // the step's logprobs JSON

    g.is_chat = !strcmp(job->kind, "chat");
    SamplerParams sp = sampler_default_params();
    sp.temperature = (float) jnum(req, "temperature", 1.0);
    sp.top_p = (float) jnum(req, "top_p", 1.0);
    sp.top_k = (int) jnum(req, "top_k", 0);
    sp.min_p = (float) jnum(req, "min_p", 0.0);
    sp.presence_penalty = (float) jnum(req, "presence_penalty", 0.0);
    sp.frequency_penalty = (float) jnum(req, "frequency_penalty", 0.0);
    sp.repetition_penalty = (float) jnum(req, "repetition_penalty", 1.0);
    if (req && json_object_object_get_ex(req, "seed", &v))
        sp.seed = (uint64_t) json_object_get_int64(v);
    else
        sp.seed = (uint64_t) job->id * 0x9E3779B97F4A7C15ull + (uint64_t) job->attempt;
    if (req && json_object_object_get_ex(req, "stop", &v) && json_object_is_type(v, json_type_array))
        for (size_t i = 0; i < json_object_array_length(v) && g.n_stop < MAX_STOP; i++) {
            const char *t = json_object_get_string(json_object_array_get_idx(v, i));
            if (t && *t && (g.stop[g.n_stop] = strdup(t))) g.n_stop++;
        }
    const bool in_reasoning = req && json_object_object_get_ex(req, "in_reasoning", &v) &&
                              json_object_get_boolean(v);
    json_object *tools = NULL;
    if (req) json_object_object_get_ex(req, "tools", &tools);
    const bool want_lp = req && json_object_object_get_ex(req, "logprobs", &v) &&
                         json_object_get_boolean(v);
    int n_top = (int) jnum(req, "top_logprobs", 0);
    n_top = n_top < 0 ? 0 : n_top > MAX_TOP_LOGPROBS ? MAX_TOP_LOGPROBS : n_top;
    if (want_lp && !(raw = malloc((size_t) cfg->vocab_size * sizeof *raw))) {
        fail_msg = "out of memory";
        goto done;
    }

    if (sampler_init(&s, cfg->vocab_size, sp)) {
        fail_msg = "invalid sampling parameters";
        goto done;
    }
    if (tok_stream_create(&ts, e->tok, true) ||
        (g.is_chat && chat_parser_init(&parser, in_reasoning, tools))) {
        fail_msg = "out of memory";
        goto done;
    }
    const int n_ctx = job->n_prompt + job->n_committed;
    if (!(ids = malloc(((size_t) n_ctx + 1) * sizeof *ids))) {
        fail_msg = "out of memory";
        goto done;
    }
    memcpy(ids, job->prompt_ids, (size_t) job->n_prompt * sizeof *ids);
    if (job->n_committed)
        memcpy(ids + job->n_prompt, job->committed_ids, (size_t) job->n_committed * sizeof *ids);

    // Replay committed output through the detokenizer and parser to restore their state.
    g.is_replay = true;
    for (int i = 0; i < job->n_committed; i++) {
        const char *piece;
        size_t n_piece;
        if (tok_stream_feed(ts, job->committed_ids[i], &piece, &n_piece)) continue;
        if (g.is_chat) chat_parser_feed(&parser, piece, n_piece, on_chat_event, &g);
        else gen_content(&g, piece, n_piece);
    }
    g.is_replay = false;  // g.hold keeps what was held back at the crash, as it was then

    if (jobq_heartbeat(e->q, job, &is_cancelled) == ERR_DB) {
        db_err = ERR_DB;
        goto done;
    }
    // Prefill in slices, beating between them, so that a long prompt keeps the job's lease
    // and the engine's heartbeat (what /health reads) fresh.
    time_t last_beat = time(NULL);
    for (int at = 0; at < n_ctx && !err && !is_cancelled && !is_stopping;) {
        const int n = n_ctx - at < e->prefill_slice ? n_ctx - at : e->prefill_slice;
        err = model_forward(&e->model, &e->kv, &seq, ids + at, n, e->logits, false);
        at += n;
        if (!err && at < n_ctx && e->step_delay_ms > 0) sleep_ms(e->step_delay_ms);
        if (!err && at < n_ctx && time(NULL) - last_beat >= e->beat_s) {
            last_beat = time(NULL);
            if (jobq_heartbeat(e->q, job, &is_cancelled) == ERR_DB) {
                db_err = ERR_DB;
                goto done;
            }
        }
    }
    if (err == ERR_AGAIN) {
        fail_msg = "the prompt does not fit in the KV cache";
        goto done;
    }
    if (err) {
        fail_msg = "the model failed on this input";
        goto done;
    }
    // Penalties look at the generated tokens only, as OpenAI's do.
    int n_gen = job->n_committed;
    int32_t *hist = malloc(((size_t) job->max_tokens + 1) * sizeof *hist);
    if (!hist) {
        fail_msg = "out of memory";
        goto done;
    }
    if (job->n_committed) memcpy(hist, job->committed_ids, (size_t) job->n_committed * sizeof *hist);

    while (!is_cancelled && !is_stopping) {
        if (n_gen >= job->max_tokens) {
            finish = "length";
            break;
        }
        if (raw) memcpy(raw, e->logits, (size_t) cfg->vocab_size * sizeof *raw);
        sampler_apply_penalties(&s, e->logits, hist, n_gen);
        const int32_t next = sampler_sample(&s, e->logits);
        bool is_eos = false;
        for (int i = 0; i < cfg->n_eos_ids; i++) is_eos |= next == cfg->eos_ids[i];
        if (is_eos) {
            finish = "stop";
            break;
        }
        hist[n_gen++] = next;
        const char *piece;
        size_t n_piece;
        if (tok_stream_feed(ts, next, &piece, &n_piece) == ERR_OK) {
            if (g.is_chat) chat_parser_feed(&parser, piece, n_piece, on_chat_event, &g);
            else gen_content(&g, piece, n_piece);
        }
        if (g.err) {
            fail_msg = "out of memory";
            break;
        }
        free(lp);
        lp = raw ? lp_json_for(e->tok, raw, cfg->vocab_size, next, n_top) : NULL;
        if (raw && !lp) {
            fail_msg = "out of memory";
            break;
        }
        const Err cerr = commit_step(e, job, &g, &next, 1, lp, &is_cancelled);
        if (cerr == ERR_DB) {
            db_err = ERR_DB;
            break;
        }
        if (cerr == ERR_NOTFOUND) {
            db_err = ERR_NOTFOUND;  // taken over or finished elsewhere: drop it
            break;
        }
        if (g.is_stopped) {
            finish = "stop";
            break;
        }
        if (is_cancelled) break;
        // Appends extend the job's lease; the engine's own heartbeat (what /health reads)
        // needs a beat of its own during long generations.
        const time_t now = time(NULL);
        if (now - last_beat >= e->beat_s) {
            last_beat = now;
            if (jobq_heartbeat(e->q, job, &is_cancelled) == ERR_DB) {
                db_err = ERR_DB;
                break;
            }
        }
        if (e->step_delay_ms > 0) sleep_ms(e->step_delay_ms);
        if (n_gen < job->max_tokens &&
            model_forward(&e->model, &e->kv, &seq, &next, 1, e->logits, false)) {
            fail_msg = "the model failed while decoding (context full?)";
            break;
        }
    }
    free(hist);
    if (db_err || fail_msg) goto done;
    if (is_stopping && !is_cancelled) {
        db_err = ERR_NOTFOUND;  // shutting down: leave it running; the next engine resumes it
        goto done;
    }
    if (is_cancelled) finish = "cancelled";
    // End of output: flush what the detokenizer, the parser and the stop filter hold.
    if (!g.is_stopped && !is_cancelled) {
        const char *piece;
        size_t n_piece;
        if (tok_stream_flush(ts, &piece, &n_piece) == ERR_OK && n_piece) {
            if (g.is_chat) chat_parser_feed(&parser, piece, n_piece, on_chat_event, &g);
            else gen_content(&g, piece, n_piece);
        }
        if (g.is_chat) chat_parser_finish(&parser, on_chat_event, &g);
        if (!g.is_stopped && g.n_hold) {
            gen_push(&g, JOBQ_CHUNK_CONTENT, g.hold, g.n_hold);
            g.n_hold = 0;
        }
        const Err cerr = commit_step(e, job, &g, NULL, 0, NULL, NULL);
        if (cerr) {
            db_err = cerr;
            goto done;
        }
    }
    const Err ferr = jobq_finish(e->q, job, finish);
    if (ferr == ERR_DB) db_err = ERR_DB;
    if (!ferr)
        LOG_INFO("engine: job %s %s after %d tokens (attempt %d)", job->public_id, finish, n_gen,
                 job->attempt);

done:
    if (fail_msg && !db_err) {
        LOG_ERROR("engine: job %s failed: %s", job->public_id, fail_msg);
        if (jobq_fail(e->q, job, fail_msg) == ERR_DB) db_err = ERR_DB;
    }
    json_object_put(req);
    free(raw);
    free(lp);
    gen_free(&g);
    chat_parser_free(&parser);
    tok_stream_destroy(ts);
    sampler_free(&s);
    kv_seq_free(&e->kv, &seq);
    free(ids);
    return db_err == ERR_DB ? ERR_DB : ERR_OK;
}

// ---------------------------------------------------------------------------

static int usage(void)
{
    fprintf(stderr, "usage: glmspark-engine --model DIR --db CONNINFO [--tokenizer FILE]\n"
                    "       [--model-name NAME] [--threads N] [--kv-blocks N] [--name NAME]\n"
                    "       [--lease-s S] [--step-delay-ms MS] [--prefill-slice N] [--recipe FILE]\n"
                    "       glmspark-engine --check-recipe FILE\n");
    return 2;
}

int main(int argc, char **argv)
{
    const char *model_dir = NULL, *conninfo = getenv("GLMSPARK_DB"), *tok_path = NULL;
    const char *model_name = NULL, *name = NULL;
    int n_threads = 2, kv_blocks = 0, lease_s = 60;
    Engine e = {0};
    int rc = 1;
    // The recipe first (wherever --recipe appears), so that every flag overrides it.
    Recipe recipe;
    recipe_defaults(&recipe);
    if (argc == 3 && !strcmp(argv[1], "--check-recipe")) {
        if (recipe_load(&recipe, argv[2])) return 2;
        for (int k = 0; k < recipe_n_keys(); k++) {
            char val[RECIPE_MAX_STR + 8];
            printf("%s = %s\n", recipe_key_name(k), recipe_format_value(&recipe, k, val, sizeof val));
        }
        return 0;
    }
    for (int i = 1; i + 1 < argc; i += 2)
        if (!strcmp(argv[i], "--recipe") && recipe_load(&recipe, argv[i + 1])) return 2;
    if (recipe.model[0]) model_dir = recipe.model;
    if (recipe.tokenizer[0]) tok_path = recipe.tokenizer;
    if (recipe.model_name[0]) model_name = recipe.model_name;
    n_threads = recipe.threads;
    kv_blocks = recipe.kv_blocks;
    lease_s = recipe.lease_s;
    const bool has_recipe_ctx = recipe_is_set(&recipe, "max_model_len");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) return usage();
        i++;
        if (!strcmp(a, "--model")) model_dir = v;
        else if (!strcmp(a, "--db")) conninfo = v;
        else if (!strcmp(a, "--tokenizer")) tok_path = v;
        else if (!strcmp(a, "--model-name")) model_name = v;
        else if (!strcmp(a, "--threads")) n_threads = atoi(v);
        else if (!strcmp(a, "--kv-blocks")) kv_blocks = atoi(v);
        else if (!strcmp(a, "--name")) name = v;
        else if (!strcmp(a, "--lease-s")) lease_s = atoi(v);
        else if (!strcmp(a, "--step-delay-ms")) e.step_delay_ms = atoi(v);
        else if (!strcmp(a, "--prefill-slice")) e.prefill_slice = atoi(v);
        else if (!strcmp(a, "--recipe")) continue;  // read above
        else return usage();
    }
    if (!model_dir || !conninfo || n_threads < 1 || lease_s < 1 || e.prefill_slice < 0) return usage();
    if (e.prefill_slice == 0) e.prefill_slice = 2048;
    e.beat_s = lease_s / 3 < 1 ? 1 : lease_s / 3 > 5 ? 5 : lease_s / 3;
    char tok_default[4096], name_buf[256], host[128] = "engine";
    if (!tok_path) {
        snprintf(tok_default, sizeof tok_default, "%s/tokenizer.json", model_dir);
        tok_path = tok_default;
    }
    if (!model_name) {
        size_t n = strlen(model_dir);
        while (n > 1 && model_dir[n - 1] == '/') n--;
        size_t start = n;
        while (start > 0 && model_dir[start - 1] != '/') start--;
        snprintf(name_buf, sizeof name_buf, "%.*s", (int) (n - start), model_dir + start);
        model_name = name_buf;
    }
    if (!name) {
        gethostname(host, sizeof host - 1);
        name = host;
    }
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    // Load first: a model that cannot load should not take the queue.
    if (backend_cpu_create(n_threads, &e.be) || model_load(&e.model, model_dir, NULL, e.be)) {
        fprintf(stderr, "glmspark-engine: could not load the model in \"%s\"\n", model_dir);
        goto done;
    }
    if (tok_load(&e.tok, tok_path)) {
        fprintf(stderr, "glmspark-engine: could not load the tokenizer \"%s\"\n", tok_path);
        goto done;
    }
    const int block =
        recipe_is_set(&recipe, "block_size") ? recipe.block_size : KV_DEFAULT_BLOCK_SIZE;
    if (kv_blocks <= 0) {
        int ctx = e.model.cfg.max_position_embeddings;
        if (ctx <= 0 || ctx > 32768) ctx = 32768;
        if (has_recipe_ctx) ctx = recipe.max_model_len;
        kv_blocks = (ctx + block - 1) / block;
    }
    const KvCacheParams kp = model_kv_params(&e.model, kv_blocks, block);
    if (kv_init(&e.kv, &kp) || !(e.logits = malloc((size_t) e.model.cfg.vocab_size * sizeof *e.logits))) {
        fprintf(stderr, "glmspark-engine: could not allocate the KV cache (%d blocks)\n", kv_blocks);
        goto done;
    }

    JobqOptions qo = {.conninfo = conninfo, .engine_name = name, .model = model_name,
                      .is_exclusive = true, .lease_s = lease_s};
    for (int delay = 100;;) {
        const Err err = jobq_create(&qo, &e.q);
        if (err == ERR_AGAIN) {
            fprintf(stderr, "glmspark-engine: another engine is serving this queue; exiting\n");
            rc = 3;
            goto done;
        }
        if (!err) break;
        if (is_stopping) goto done;
        sleep_ms(delay);
        delay = delay * 2 > 5000 ? 5000 : delay * 2;
    }
    int n_requeued = 0;
    if (jobq_recover(e.q, &n_requeued)) goto done;
    LOG_INFO("engine: serving \"%s\" as \"%s\" (%d KV blocks); %d interrupted jobs requeued",
             model_name, name, kv_blocks, n_requeued);

    while (!is_stopping) {
        JobqJob job;
        Err err = jobq_claim(e.q, &job);
        if (err == ERR_OK) {
            err = run_job(&e, &job);
            jobq_job_free(&job);
        } else if (err == ERR_NOTFOUND) {
            err = jobq_heartbeat(e.q, NULL, NULL);
            if (!err) err = jobq_wait(e.q, 1000);
        }
        if (err == ERR_DB && !is_stopping) {
            err = jobq_reconnect(e.q, -1);
            if (err == ERR_AGAIN) {
                fprintf(stderr, "glmspark-engine: lost the queue to another engine; exiting\n");
                rc = 3;
                goto done;
            }
            // The job we were running (if any) was dropped: resume it now rather than
            // after its lease runs out.
            if (!err) jobq_recover(e.q, NULL);
        }
    }
    LOG_INFO("engine: stopping");
    rc = 0;
done:
    jobq_destroy(e.q);
    free(e.logits);
    kv_free(&e.kv);
    tok_destroy(e.tok);
    model_free(&e.model);
    if (e.be) e.be->destroy(e.be);
    return rc;
}
